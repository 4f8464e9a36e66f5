"""Injected faults (`SLUICE_FAULT`, batching/faults.py): a failed device step ends every request that has run with an
error (those waiting for their first step run after) and the engine starts over in-process; NaN logits fail only their request; a hung step makes the watchdog
end every request and exit for a supervisor to restart the server. No request is left hanging."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from sluice.batching import kv_store
from sluice.batching.engine import EXIT_STEP_HUNG
from sluice.batching.outputs import ListCollector
from sluice.model.generate import generate
from test_api_e2e import metric, start_server
from test_engine import GREEDY, make_engine, prompts, tiny  # noqa: F401 - tiny: the fixture
from test_kv_store import SlowDisk


def run_to_completion(engine, batch: list[list[int]]) -> list:
    collectors = [ListCollector(1) for _ in batch]
    for i, (prompt, collector) in enumerate(zip(batch, collectors)):
        engine.submit([prompt], GREEDY, collector, f"req-{i}-{time.monotonic_ns()}")
    while engine.has_work:
        engine.step()
    return [c.completions()[0] for c in collectors]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_failed_step_ends_every_request_in_flight_and_the_engine_starts_over(tiny, monkeypatch, overlap):
    monkeypatch.setenv("SLUICE_FAULT", "raise@4")
    engine = make_engine(tiny, async_scheduling=overlap, warmup=False)
    batch = prompts(5, seed=3)
    failed = run_to_completion(engine, batch)
    assert all(c.finish_reason == "error" and "injected fault" in c.error for c in failed)
    assert engine.healthy and engine.stats.num_step_failures == 1 and engine.stats.kv_pages_used == 0
    served = run_to_completion(engine, batch)
    assert [list(c.token_ids) for c in served] == [generate(tiny.model, p, GREEDY.max_tokens) for p in batch]
    assert engine.stats.kv_pages_used == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_failed_step_leaves_the_requests_still_waiting_for_their_first_step_to_run_after(tiny, monkeypatch,
                                                                                           overlap):
    """They read nothing the failed step wrote: with room for two sequences, the two that ran end with the error,
    and the four behind them get the tokens of an engine that never failed."""
    monkeypatch.setenv("SLUICE_FAULT", "raise@2")
    engine = make_engine(tiny, max_num_seqs=2, async_scheduling=overlap, warmup=False)
    batch = prompts(6, seed=5)
    done = run_to_completion(engine, batch)
    assert [c.finish_reason == "error" for c in done] == [True, True, False, False, False, False]
    for prompt, completion in zip(batch[2:], done[2:]):
        assert list(completion.token_ids) == generate(tiny.model, prompt, GREEDY.max_tokens)
    assert engine.stats.num_step_failures == 1 and engine.stats.kv_pages_used == 0


def test_nan_logits_fail_only_their_request(tiny, monkeypatch):
    monkeypatch.setenv("SLUICE_FAULT", "nan@3")
    engine = make_engine(tiny, warmup=False)
    batch = prompts(4, seed=4)
    done = run_to_completion(engine, batch)
    failed = [c for c in done if c.finish_reason == "error"]
    assert len(failed) == 1 and "not finite" in failed[0].error
    for prompt, completion in zip(batch, done):
        if completion.finish_reason != "error":
            assert list(completion.token_ids) == generate(tiny.model, prompt, GREEDY.max_tokens)
    assert engine.stats.num_step_failures == 0 and engine.stats.kv_pages_used == 0


def test_a_request_ending_on_nan_logits_leaves_no_page_to_the_prefix_cache_nor_the_store(tiny, monkeypatch,
                                                                                           tmp_path):
    """Its K/V may not be finite either: a next request on its prompt computes it afresh, in this engine and in
    one reading the store after a restart."""
    monkeypatch.setenv("SLUICE_FAULT", "nan@3")  # after the prompt's two full pages are cached and stored
    store = {"prefix_cache_dir": str(tmp_path), "prefix_cache_ram": 1 << 20, "prefix_cache_size": 1 << 20}
    engine = make_engine(tiny, warmup=False, **store)
    prompt = list(range(3, 12))  # two full pages of 4, and one token
    (failed,) = run_to_completion(engine, [prompt])
    assert failed.finish_reason == "error" and "not finite" in failed.error
    (served,) = run_to_completion(engine, [prompt])
    assert list(served.token_ids) == generate(tiny.model, prompt, GREEDY.max_tokens)
    engine.close_store()
    assert engine.stats.prefix_cache_hit_tokens == 0
    monkeypatch.delenv("SLUICE_FAULT")
    restarted = make_engine(tiny, warmup=False, **store)
    assert restarted.prefix_store.counters().disk.pages > 0  # the second request's pages
    run_to_completion(restarted, [prompt])
    assert restarted.stats.prefix_cache_hit_tokens == 8  # hers, stored after the first's were forgotten
    restarted.close_store()


def test_a_request_aborted_while_its_nan_step_is_in_flight_leaves_no_page_to_the_prefix_cache(tiny, monkeypatch):
    """Overlapped, the abort ends the request before its step's logits are seen: they are suspect all the same."""
    monkeypatch.setenv("SLUICE_FAULT", "nan@3")
    engine = make_engine(tiny, async_scheduling=True, warmup=False)
    prompt = list(range(3, 12))  # two full pages of 4, and one token
    engine.submit([prompt], GREEDY, ListCollector(1), "aborted")
    for _ in range(3):  # the third dispatches the NaN step, which is in flight when this returns
        engine.step()
    assert engine._in_flight is not None
    engine.abort("aborted")
    while engine.has_work:
        engine.step()
    (served,) = run_to_completion(engine, [prompt])
    assert list(served.token_ids) == generate(tiny.model, prompt, GREEDY.max_tokens)
    assert engine.stats.prefix_cache_hit_tokens == 0 and engine.stats.kv_pages_used == 0


def test_forgetting_a_nan_requests_pages_does_not_wait_on_a_slow_disk(tiny, monkeypatch, tmp_path):
    """The store's writer is stuck in an fsync (a slow disk) when a request ends on NaN logits: its pages are
    forgotten without the engine's step waiting for the writes queued before, and none of them lands on disk after
    (the writes still queued are not made, the one in progress is removed)."""
    disk = SlowDisk(monkeypatch)
    monkeypatch.setenv("SLUICE_FAULT", "nan@3")  # after the prompt's two full pages are cached and stored
    store = {"prefix_cache_dir": str(tmp_path), "prefix_cache_ram": 1 << 20, "prefix_cache_size": 1 << 20}
    engine = make_engine(tiny, warmup=False, **store)
    (failed,) = run_to_completion(engine, [list(range(3, 12))])
    waited = disk.release.is_set()
    disk.release.set()
    assert failed.finish_reason == "error" and "not finite" in failed.error
    assert not waited, "the step waited for the writer"
    engine.close_store()
    assert engine.prefix_store.counters().disk.pages == 0
    assert not list(engine.prefix_store.directory.glob(f"*{kv_store.SUFFIX}"))


def test_a_nan_fault_strikes_a_step_whose_first_row_samples(tiny, monkeypatch):
    """Its first step prefills part of a prompt longer than a step's tokens, which samples nothing: the NaN row
    would be ignored there, so the fault waits for the step that samples."""
    monkeypatch.setenv("SLUICE_FAULT", "nan@1")
    engine = make_engine(tiny, warmup=False)
    (done,) = run_to_completion(engine, [list(range(3, 3 + 50))])  # 50 tokens: two steps of 32
    assert done.finish_reason == "error" and "not finite" in done.error


def test_a_malformed_fault_switch_is_refused(tiny, monkeypatch):
    monkeypatch.setenv("SLUICE_FAULT", "explode@2")
    with pytest.raises(ValueError, match="SLUICE_FAULT"):
        make_engine(tiny)


# --- a real server ---------------------------------------------------------------------------------------------

FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "2048",
         "--kv-cache-memory", "512MiB"]
LONG = {"prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "ignore_eos": True}


class Stream:
    """A streaming completion read in a thread to its end; `started` once its first token arrived."""

    def __init__(self, url: str) -> None:
        self.events: list[str] = []
        self.started = threading.Event()
        self.status = 0
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()

    def _read(self, url: str) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=300) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: "):])
                    self.started.set()
        self.started.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "a stream was left hanging"


def ends_with_an_error(stream: Stream) -> bool:
    errors = [json.loads(e) for e in stream.events[:-1] if "error" in json.loads(e)]
    return stream.status == 200 and stream.events[-1] == "[DONE]" and len(errors) == 1


@pytest.mark.slow
def test_server_a_failed_step_errors_every_request_then_serves_the_next():
    # Warm-up compiles without dispatching, so step 40 comes well after the streams below are under way.
    server = start_server(*FLAGS, env={"SLUICE_FAULT": "raise@40"})
    try:
        streams = [Stream(server.url) for _ in range(3)]
        whole: list[httpx.Response] = []
        plain = threading.Thread(target=lambda: whole.append(
            httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=300)), daemon=True)
        plain.start()
        for stream in streams:
            stream.join(300)
        plain.join(300)
        assert all(ends_with_an_error(s) for s in streams), [s.events[-3:] for s in streams]
        (response,) = whole
        assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert metric(server.url, "sluice_engine_step_failures_total") == 1
        after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
        assert metric(server.url, "sluice_kv_pages_used") == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_server_a_hung_step_errors_every_stream_and_exits_for_a_restart():
    server = start_server(*FLAGS, "--step-timeout", "2", env={"SLUICE_FAULT": "hang@20"})
    try:
        streams = [Stream(server.url) for _ in range(2)]
        for stream in streams:
            stream.join(120)
        assert all(ends_with_an_error(s) for s in streams), [s.events[-3:] for s in streams]
        hung_at = time.monotonic()
        server.process.wait(timeout=10)
        assert server.process.returncode == EXIT_STEP_HUNG, time.monotonic() - hung_at
        log = server.output()
        assert "ran past --step-timeout" in log and "Bucket(" in log
    finally:
        server.stop()
