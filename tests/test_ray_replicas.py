"""`sluice serve --replicas 2` (a local Ray cluster, two replicas of the default model behind the ingress):
the single process's routes, SSE and errors through the ingress, prefix affinity, and a replica killed under load.

One cluster for the module; the SIGKILL test runs last, since it takes a replica down.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from openai import OpenAI

from sluice.app.scale_out import REPLICA_HEADER
from sluice.bench.prefix_cache import parse
from sluice.bench.routing import wait_for_replicas
from test_api_e2e import SERVER_FLAGS, ServerProcess, start_server

pytestmark = pytest.mark.slow

REPLICA_PROCESS = "ray::ServeReplica:sluice:SluiceReplica"
ORIGIN = "https://app.example"  # the one origin whose pages may call the cluster


@pytest.fixture(scope="module")
def cluster():
    server = start_server("--replicas", "2", "--no-ui", *SERVER_FLAGS, "--drain-timeout", "10",
                          "--allowed-origins", json.dumps([ORIGIN]), startup_timeout_s=300)
    wait_for_replicas(server.url, 2, timeout_s=180)
    yield server
    assert server.stop(timeout_s=120) == 0, server.output()[-4000:]


def replica_pids(root: int) -> list[int]:
    """The replicas of the Ray cluster below process `root` (a server's, whose local cluster's raylet is its child;
    or a `ray start --block`'s), found as an operator would: processes Ray names as replicas, so another Ray cluster
    on the machine is left alone."""
    return ray_processes(root, (REPLICA_PROCESS,))


def ray_processes(root: int, names: tuple[str, ...]) -> list[int]:
    """The processes below process `root` whose command line (Ray's process title) starts with one of `names`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if ((entry / "cmdline").read_bytes().startswith(tuple(name.encode() for name in names))
                        and root in _ancestors(int(entry.name))):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        # /proc/<pid>/stat: "pid (comm) state ppid ...", and comm may hold spaces or parentheses
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


def test_openai_client_streams_a_chat_through_the_ingress(cluster):
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8


def test_errors_come_back_as_the_single_process_sends_them(cluster):
    bad = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "hi", "top_k": -7}, timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "top_k"
    unknown = httpx.post(f"{cluster.url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=60)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_a_stored_response_is_found_and_continued_whichever_replica_the_router_would_pick(cluster):
    """Each replica stores its own responses: a request naming one goes to the replica that stores it."""
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    first = client.responses.with_raw_response.create(model="SmolLM2-135M-Instruct.Q4_1", input="My name is Ann.",
                                                      temperature=0, max_output_tokens=2)
    stored_by, response_id = first.headers[REPLICA_HEADER], first.parse().id
    answers = [httpx.get(f"{cluster.url}/v1/responses/{response_id}", timeout=60) for _ in range(6)]
    answers.append(httpx.get(f"{cluster.url}/v1/responses/{response_id}/input_items", timeout=60))
    answers += [httpx.post(f"{cluster.url}/v1/responses", timeout=60, json={
        "input": f"Say {i}.", "previous_response_id": response_id, "max_output_tokens": 1}) for i in range(3)]
    assert [(a.status_code, a.headers[REPLICA_HEADER]) for a in answers] == [(200, stored_by)] * len(answers)


def test_a_body_over_the_limit_is_refused_by_the_ingress_before_any_replica_sees_it(cluster):
    huge = httpx.post(f"{cluster.url}/v1/completions", content=b"x" * (5 << 20), timeout=60,
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    assert REPLICA_HEADER not in huge.headers  # no replica answered it: the ingress read no more than the limit


def test_a_browsers_preflight_is_answered_by_the_ingress_with_the_cors_policy(cluster):
    preflight = httpx.options(f"{cluster.url}/v1/completions", timeout=60, headers={
        "origin": ORIGIN, "access-control-request-method": "POST", "access-control-request-headers": "content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert REPLICA_HEADER not in preflight.headers
    refused = httpx.options(f"{cluster.url}/v1/completions", timeout=60, headers={
        "origin": "https://elsewhere.example", "access-control-request-method": "POST"})
    assert refused.status_code == 400


def test_the_ingresss_own_error_carries_the_cors_headers(cluster):
    huge = httpx.post(f"{cluster.url}/v1/completions", content=b"x" * (5 << 20), timeout=60,
                      headers={"content-type": "application/json", "origin": ORIGIN})
    assert huge.status_code == 413
    assert huge.headers["access-control-allow-origin"] == ORIGIN


def test_a_replicas_answer_carries_the_cors_headers_once(cluster):
    """The ingress applies the policy; the replica behind it does not add its own (a doubled `Vary: Origin`)."""
    models = httpx.get(f"{cluster.url}/v1/models", timeout=60, headers={"origin": ORIGIN})
    assert models.status_code == 200 and REPLICA_HEADER in models.headers
    assert models.headers["access-control-allow-origin"] == ORIGIN
    assert [v.strip() for v in ",".join(models.headers.get_list("vary")).split(",")] == ["Origin"]


def test_requests_sharing_a_prefix_go_to_the_replica_that_cached_it(cluster):
    shared = list(range(1000, 1200))
    replicas, cached = set(), []
    for i in range(4):
        reply = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
            "prompt": shared + [2000 + i] * 8, "max_tokens": 1, "temperature": 0})
        assert reply.status_code == 200, reply.text
        replicas.add(reply.headers["x-sluice-replica"])
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(replicas) == 1
    assert cached[0] == 0 and min(cached[1:]) >= 192  # the shared 200 tokens, in whole 16-token pages
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    [replica] = replicas
    assert f'sluice_prefix_cache_hit_tokens_total{{replica="{replica}"}}' in metrics


async def _stream(client: httpx.AsyncClient, url: str, i: int, streaming: dict[int, str]) -> str:
    """One streamed completion: 'ok' (finished), 'failed' (an error event then [DONE], or an error status). While
    its tokens come, `streaming[i]` names the replica sending them."""
    body = {"prompt": [100 + i, 7, 8, 9] * 4, "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            assert response.status_code == 503, await response.aread()
            return "failed"
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    streaming[i] = response.headers[REPLICA_HEADER]
        finally:
            streaming.pop(i, None)
    assert events[-1] == "[DONE]", events[-3:]
    errors = [e for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) <= 1 and (not errors or errors[0] == events[-2])
    return "failed" if errors else "ok"


async def _load_and_kill(server: ServerProcess) -> list[str]:
    """32 streams; the kill comes once both replicas are sending tokens, so the killed one has streams in flight
    whichever it is (a fixed wait let every stream finish first on a quick machine)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        streaming: dict[int, str] = {}
        streams = [asyncio.ensure_future(_stream(client, server.url, i, streaming)) for i in range(32)]
        deadline = time.monotonic() + 120
        while len(set(streaming.values())) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        os.kill(replica_pids(server.process.pid)[0], signal.SIGKILL)
        # No client hangs: every stream ends, answered or cleanly failed, well within the client's timeout.
        return await asyncio.wait_for(asyncio.gather(*streams), 120)


def _answering_replica(url: str, prompt: str) -> str | None:
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    return reply.headers["x-sluice-replica"] if reply.status_code == 200 else None


def _reporting_replicas(url: str) -> set[str]:
    """The replicas whose prefix-cache counters the ingress's /metrics exports."""
    return set(parse(httpx.get(f"{url}/metrics", timeout=30).text))


def test_sigkill_of_a_replica_under_32_streams_fails_its_streams_cleanly_and_the_service_goes_on(cluster):
    assert len(replica_pids(cluster.process.pid)) == 2
    started = time.monotonic()
    while len(_reporting_replicas(cluster.url)) < 2:  # both have answered, so the killed one has a report
        assert time.monotonic() - started < 60
        _answering_replica(cluster.url, f"Hi {time.monotonic()}")
    outcomes = asyncio.run(_load_and_kill(cluster))
    assert outcomes.count("ok") + outcomes.count("failed") == 32
    assert "failed" in outcomes  # the killed replica had streams in flight
    killed_at = time.monotonic()
    while (survivor := _answering_replica(cluster.url, "Hello")) is None:  # new requests go to the live replica
        assert time.monotonic() - killed_at < 60
        time.sleep(0.2)
    deadline = time.monotonic() + 180  # and Ray starts a replacement, which serves once warm
    answering = {survivor}
    while len(answering) < 2:
        assert time.monotonic() < deadline, "no replacement replica answered"
        answering.add(_answering_replica(cluster.url, f"Hello number {len(answering)} {time.monotonic()}"))
        answering.discard(None)
        time.sleep(0.5)
    # The killed replica's counters are gone with it. A loaded machine may fail a replica's health check for a
    # moment, and the ingress drops the report of a replica its router does not list: the next answer brings it back.
    while (reporting := _reporting_replicas(cluster.url)) != answering:
        assert time.monotonic() < deadline, f"the ingress reports {reporting}, the replicas answering are {answering}"
        _answering_replica(cluster.url, f"Hello again {time.monotonic()}")
