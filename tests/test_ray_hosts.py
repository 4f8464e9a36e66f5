"""`sluice serve --hosts 2`: Ray starts the two processes of a multi-process job (two actors in a placement group,
2 simulated CPU devices each), which serve one tensor-parallel model as `--coordinator-address` does by hand; each
runs `sluice serve`'s entry point with its place in the job, through the command's checks."""

from __future__ import annotations

import time
import uuid

import httpx
import numpy as np
import pytest

pytest.importorskip("ray")

from sluice.app import serve
from sluice.app.cli import build_parser
from sluice.app.ray_hosts import _place
from test_api_e2e import start_server
from test_ray_cli import _marked_pids
from test_multihost import LIMITS, PROMPT, reference, tiny_model  # noqa: F401 (a fixture)


def test_a_process_of_a_job_on_a_joined_cluster_passes_the_commands_checks(capsys):
    """The process joins no cluster itself (its actor is on one): `--ray-address` without `--hosts` would be refused
    as tuning a mode that is off. Its model is looked for on its own host, where this one is missing."""
    args = build_parser().parse_args(["serve", "--hosts", "2", "--tp", "2", "--ray-address", "10.0.0.7:6379",
                                      "--model", "/nowhere/model.gguf"])
    assert serve.run(_place(args, "10.0.0.7:8476", hosts=2, process_id=1)) == 2
    refusal = capsys.readouterr().err
    assert refusal.startswith("sluice serve: error: ") and "/nowhere/model.gguf" in refusal


# Ray's start-up on top of what tests/test_multihost.py checks by hand: about 25 s on 2 cores.
@pytest.mark.long
def test_two_ray_actors_serve_one_model_like_a_single_process(tiny_model):  # noqa: F811
    server = start_server("--model", str(tiny_model), "--tp", "4", "--hosts", "2", "--no-ui", *LIMITS,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, startup_timeout_s=600)
    try:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1,
        })
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
    finally:
        assert server.stop(timeout_s=120) == 0, server.output()[-4000:]
    assert "running process 0's steps" in server.output()
    assert "Stopping: process 0 finishes its requests in flight" in server.output()

    text, logprobs = reference(tiny_model)
    assert choice["text"] == text
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=1e-4)


@pytest.mark.long
def test_a_signal_while_the_processes_load_stops_the_command_with_0_leaving_nothing(tiny_model):  # noqa: F811
    """Process 0 ends at once, still loading (as a single process does), and the other process with it: Ray sees
    two workers that died, which the command says is the stop's doing; the local cluster ends with it."""
    mark = uuid.uuid4().hex
    server = start_server("--model", str(tiny_model), "--tp", "4", "--hosts", "2", "--no-ui", *LIMITS,
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "LEAK_MARK": mark},
                          startup_timeout_s=600, until=503)
    assert server.stop(timeout_s=120) == 0, server.output()[-4000:]
    assert "Stopped during the start-up" in server.output()
    deadline = time.monotonic() + 30
    while left := _marked_pids(mark):
        assert time.monotonic() < deadline, f"processes of the command's cluster outlived it: {left}"
        time.sleep(0.5)
