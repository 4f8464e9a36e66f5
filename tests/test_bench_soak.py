"""A short `sluice bench soak` (12 s of load, a SIGKILL and a restart in the middle) against the real default
model: its summary is made of the run's own numbers and holds the soak's promises. On 2 cores each client sends
about 13 requests a life, going through the 8 kinds in turn; the half minute is the load, the two server
start-ups (6 s each) and the soak's own start and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.bench.soak import HELD, KINDS, OUTCOMES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# Two sequences, 32 tokens a step: each server start compiles (cold on CI) its decode step and multi-step decode call
# at batches 1 and 2 and mixed steps of 16 and 32 tokens, not also batch 4 and 64 tokens; the clients queue for them.
SERVER_ARGS = "--max-num-seqs 2 --max-num-batched-tokens 32 --max-model-len 512 --kv-cache-memory 32MiB --log-level warning"


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("soak")
    run = subprocess.run(
        [sys.executable, "-m", "sluice.bench.soak", "--minutes", "0.2", "--concurrency", "4", "--sample-interval",
         "0.5", "--out", str(out), "--server-args", SERVER_ARGS],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    print(run.stdout, run.stderr)
    return {"returncode": run.returncode, "stdout": run.stdout, "out": out,
            **json.loads((out / "soak.json").read_text())}


def test_soak_exits_0_with_nothing_lost_no_5xx_and_no_wrong_answer(soak):
    summary = soak["summary"]
    assert (summary["lost"], summary["5xx"], summary["wrong"]) == (0, 0, 0), soak["not_ok"]
    assert soak["returncode"] == 0


def test_every_kind_ran_and_its_outcomes_add_up(soak):
    summary = soak["summary"]
    for kind in KINDS:
        counts = summary["by_kind"][kind]
        assert counts["sent"] == sum(counts[o] for o in OUTCOMES)
        assert counts["rejected" if kind == "bad" else "ok"] > 0, kind
    assert summary["requests"] == sum(c["sent"] for c in summary["by_kind"].values())
    assert summary["killed"] == len([r for r in soak["not_ok"] if r["outcome"] == "killed"])


def test_the_server_was_killed_once_under_load_and_restarted(soak):
    summary = soak["summary"]
    assert summary["restarts"] == 1
    assert {s["life"] for s in soak["samples"]} == {1, 2}
    killed_at = summary["killed_at_minutes"] * 60
    assert all(r["start_s"] <= killed_at <= r["end_s"] for r in soak["not_ok"] if r["outcome"] == "killed")
    first_life_pid, second_life_pid = (r["pid"] for r in summary["rss"])
    assert first_life_pid != second_life_pid


def test_rss_is_read_from_the_server_processes(soak):
    for life in soak["summary"]["rss"]:
        rss = [s["rss_mib"] for s in soak["samples"] if s["life"] == life["life"]]
        assert len(rss) == life["samples"] >= 5
        assert 100 < min(rss) <= life["after_warmup_mib"] <= max(rss)  # the model alone is ~100 MiB
        assert life["growth"] == pytest.approx(life["end_mib"] / life["after_warmup_mib"] - 1)


def test_kv_pages_were_used_under_load_and_all_freed_after_the_drain_with_no_request_left(soak):
    summary = soak["summary"]
    assert max(s["kv_pages_used"] for s in soak["samples"]) > 0
    assert summary["held_after_drain"] == dict.fromkeys(HELD, 0) and summary["kv_pages_total"] > 0
    assert ("KV pages in use after the drain: 0 of" in soak["stdout"]
            and "requests_running: 0, requests_waiting: 0, seqs_running: 0, seqs_waiting: 0" in soak["stdout"])


def test_the_plot_is_written(soak):
    assert (soak["out"] / "soak.png").stat().st_size > 10_000
