"""`sluice serve --replicas 2 --max-replicas 2 --min-replicas 1`: Ray Serve's autoscaler removes a replica once
the load no longer needs it, and the replica it removes finishes its streams in flight first."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from sluice.bench.routing import wait_for_replicas
from test_api_e2e import SERVER_FLAGS, start_server
from test_ray_replicas import replica_pids

pytestmark = pytest.mark.slow

# Ray Serve's controller logs its decision: `... 2026-11-26 15:56:51,011 controller ... -- Removing 1 replica from
# Deployment(name='SluiceReplica', app='sluice').`
REMOVAL = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) controller .* Removing 1 replica from "
                     r"Deployment\(name='SluiceReplica'")

# Few ongoing requests want one replica (target 64 each); the autoscaler acts after 6 s of that.
AUTOSCALING = ["--replicas", "2", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "64",
               "--downscale-delay", "6", "--drain-timeout", "120"]


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, list[str]]:
    """A long streamed completion: the replica that served it, and its events."""
    body = {"prompt": [300 + i, 5, 6, 7] * 4, "max_tokens": 240, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]
    return response.headers["x-sluice-replica"], events


async def _streams(url: str, n: int) -> list[tuple[str, list[str]]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        return await asyncio.gather(*(_stream(client, url, i) for i in range(n)))


def test_a_replica_scaled_down_finishes_its_streams_in_flight():
    server = start_server(*AUTOSCALING, "--no-ui", *SERVER_FLAGS, startup_timeout_s=300)
    try:
        wait_for_replicas(server.url, 2, timeout_s=180)  # a loaded machine starts a replica slowly
        results = asyncio.run(_streams(server.url, 8))
        streams_done = datetime.datetime.now()
        assert len({replica for replica, _ in results}) == 2  # both replicas had streams in flight
        for _, events in results:
            assert events[-1] == "[DONE]"
            assert not any("error" in json.loads(e) for e in events[:-1])
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 240
        deadline = time.monotonic() + 60
        while len(replica_pids(server)) > 1:
            assert time.monotonic() < deadline, "the autoscaler kept both replicas"
            time.sleep(1)
        [removed_at] = REMOVAL.findall(server.output())
        # The replica was told to go while streams ran on it, and they all finished.
        assert datetime.datetime.strptime(removed_at, "%Y-%m-%d %H:%M:%S,%f") < streams_done
    finally:
        assert server.stop(timeout_s=120) == 0, server.output()[-4000:]
