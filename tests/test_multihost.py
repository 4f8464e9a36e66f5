"""Multi-process serving: two `sluice serve` processes on localhost (2 simulated CPU devices each, gloo
collectives) serve one tensor-parallel model; process 0 answers HTTP like a single process at --tp 1."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams
from conftest import home_with_built_kernels
from hf_folder import write_hf_folder
from sluice.model.config import ModelConfig
from sluice.model.loader import load_model
from sluice.sharding.mesh import DistributedConfig, initialize_distributed
from test_api_e2e import ROOT, free_port, start_server

CONFIG = ModelConfig.tiny(vocab_size=300, num_heads=8, num_kv_heads=4, intermediate_size=256)
# float32 weights, as the single-process reference below runs them; one sequence at a time (the test sends one
# request), so that warm-up compiles no bucket of two; the roofline's peaks declared, not measured at start-up.
LIMITS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--max-model-len", "64", "--kv-cache-memory", "1M",
          "--quantization", "none", "--peak-gflops", "1", "--peak-bandwidth-gbs", "1"]
PROMPT = [1, 5, 17, 42, 99, 7]


@pytest.fixture()
def tiny_model(tmp_path, monkeypatch):
    """The model's conversion under a SLUICE_HOME of the test's own, beside the CPU kernels already built (each
    process would otherwise build them again there, side by side: most of its start-up)."""
    monkeypatch.setenv("SLUICE_HOME", str(home_with_built_kernels(tmp_path / "home")))
    write_hf_folder(tmp_path / "tiny", CONFIG, seed=3)
    return tmp_path / "tiny"


def reference(folder) -> tuple[str, list[float]]:
    """Greedy text and logprobs from a single-process engine at --tp 1."""
    engine = Engine(load_model(str(folder), dtype="float32"),
                    EngineConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64, kv_cache_memory=1 << 20,
                                 num_decode_steps=1))
    [[out]] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True))
    return out.text, [lp.logprob for lp in out.logprobs]


def test_two_processes_serve_one_model_like_a_single_process(tiny_model, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    distributed = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    flags = ["--model", str(tiny_model), "--tp", "4", *LIMITS, *distributed]
    # Process 1 first: it waits in jax.distributed.initialize until process 0 joins.
    follower = subprocess.Popen(
        [sys.executable, "-m", "sluice.app.cli", "serve", *flags, "--process-id", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        leader = start_server(*flags, "--process-id", "0", startup_timeout_s=600)
        try:
            # A request rejected at the edge never reaches either process's step loop.
            rejected = httpx.post(f"{leader.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 2, "top_k": -7,
            })
            assert rejected.status_code == 400, rejected.text
            reply = httpx.post(f"{leader.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1,
            })
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
        finally:
            assert leader.stop() == 0, leader.output()
        assert follower.wait(timeout=60) == 0  # process 0's shutdown ends process 1's step loop
    finally:
        if follower.poll() is None:
            follower.kill()
        follower_log = follower.communicate()[0].decode(errors="replace")
    assert "running process 0's steps" in follower_log

    text, logprobs = reference(tiny_model)
    assert choice["text"] == text
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=1e-4)


def test_a_tp_that_does_not_span_every_process_is_refused(tiny_model, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    distributed = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    flags = ["--model", str(tiny_model), "--tp", "2", *LIMITS, *distributed]
    processes = [
        subprocess.Popen([sys.executable, "-m", "sluice.app.cli", "serve", *flags, "--process-id", str(i)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in (1, 0)
    ]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in processes]
    assert [p.returncode for p in processes] == [2, 2]  # the follower's and the server's one-line refusal
    assert all("--tp must be 4, got 2" in out for out in outputs), outputs


@pytest.mark.parametrize(("config", "message"), [
    (DistributedConfig(None, 2, 0), "needs --coordinator-address"),
    (DistributedConfig("127.0.0.1:1", 2, 2), r"--process-id must be in \[0, 2\), got 2"),
])
def test_bad_multi_process_flags_are_refused_before_joining(config, message):
    with pytest.raises(ValueError, match=message):
        initialize_distributed(config)
