"""`python -m sluice.bench.gpu_check` runs end to end on the CPU, at small sizes, so it cannot rot before a GPU comes.

One run (about half a minute) serves every test here: they read its report and results.
"""

import json
import os
import subprocess
import sys

import pytest

from sluice.bench import gpu_check, gpu_report


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    child_env = gpu_check.child_env
    with pytest.MonkeyPatch.context() as patch:
        # A fresh compilation cache makes the engine's compile time a cold start's, a GPU figure: here its steps
        # compile through the suite's cache (conftest.py), which spares the smoke run about 40 s of CPU.
        patch.setattr(gpu_check, "child_env", lambda work, xla_flags: {
            **child_env(work, xla_flags), "SLUICE_JAX_CACHE": os.environ["JAX_COMPILATION_CACHE_DIR"]})
        # Concurrency 2 and 8 tokens per step in place of the small sizes' 4 and 16, sampled: all reach the engine.
        # Smaller, not larger: the engine compiles a decode step and a multi-step decode call per batch size up to
        # the concurrency (1 and 2, not 1, 2 and 3) and one mixed step per token bucket (8 alone, not 16 and 24).
        status = gpu_check.main(["--out", str(out), "--budget-s", "400", "--engine-args",
                                 "--concurrency 1 2 --max-num-batched-tokens 8 --temperature 0.8 --top-p 0.9"])
    return status, out, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_every_step_ran_and_passed(check):
    status, _, results, _ = check
    assert status == 0, results["steps"]
    assert [s["name"] for s in results["steps"]] == ["probe", "kernel-tests", "kernel-bench", "engine-tiny",
                                                         "step-audit"]
    assert all(s["status"] == "ok" for s in results["steps"])


def test_report_names_the_machine_and_has_every_section(check):
    _, out, results, report = check
    probe = results["probe"]
    assert report.startswith(f"## Sluice GPU check, {probe['date']}: cpu (cpu)")
    assert f"jax {probe['jax']}, jaxlib {probe['jaxlib']}" in report
    assert "driver none (no nvidia-smi)" in report
    for section in ("### Kernel correctness", "### Decode attention kernels", "### Engine offline",
                    "### Where a step's time goes", "### Step-bytes audit", "### Steps"):
        assert section in report
    assert ("Host syncs in the decode call of 8 steps (tiny, bfloat16, 2 greedy rows, the sampler's branches "
            "decided by the device): ") in report
    log = (out / "log.txt").read_text()
    assert all(f"\n===== {step['name']}: " in log for step in results["steps"])


def test_kernels_agree_with_the_oracle_and_mosaic_waits_for_a_gpu(check):
    _, _, results, report = check
    outcomes = results["kernel-tests"]
    by_backend = {b: [o["outcome"] for o in outcomes if o["backend"] == b] for b in gpu_report.KERNEL_BACKENDS}
    assert "failed" not in [o["outcome"] for o in outcomes]
    assert by_backend["pallas-triton"].count("passed") >= 3 and by_backend["reference"].count("passed") >= 2
    assert any("ragged_matches" in o["name"] and o["outcome"] == "passed" for o in outcomes)
    mosaic = [o for o in outcomes if o["backend"] == "pallas-mosaic"]
    assert any(o["outcome"] == "skipped" and "only on a GPU" in o["message"] for o in mosaic)
    assert any(o["outcome"] == "passed" and "lowers_for_cuda" in o["name"] for o in mosaic)
    rows = results["kernel-bench"]
    assert {r["backend"] for r in rows} == {"pallas-triton", "reference"}
    assert all(r["max_diff"] < 1e-4 and r["gbps"] > 0 for r in rows)
    assert "| pallas-triton | 2 | 40 |" in report


def test_engine_produced_every_requested_token_without_the_http_stack(check):
    _, _, results, report = check
    (engine,) = results["engine"]
    assert engine["model"] == "tiny" and engine["backend"] == "cpu" and engine["http_stack_imported"] == []
    assert [level["concurrency"] for level in engine["levels"]] == [1, 2]
    assert engine["sizes"]["max_num_batched_tokens"] == 8
    assert engine["decoding"] == {"temperature": 0.8, "top_p": 0.9}
    for level in engine["levels"]:
        # engine_check fails the run if any request got a different number of tokens than it asked for.
        assert level["output_tokens"] > 0 and level["output_tok_s"] > 0
        assert level["ttft_s"] > 0 and level["tpot_s"] > 0 and level["decode_tpot_s"] > 0
        # Timed separately on a shared CPU, attention alone may take longer than a whole step: only measured.
        assert level["step"]["attention_s"] > 0 and level["step"]["step_s"] > 0
    assert engine["compile_s"] > 0
    assert "| tiny | cpu, scan | 2 | 4 |" in report
    pool_mib = engine["kv_cache_bytes"] / 2**20
    assert (f"- tiny: up to 2 sequences, 8 tokens per step, a KV pool of {pool_mib:,.2f} MiB, 0 preemptions, sampled "
            "at temperature 0.8, top-p 0.9, programs compiled during the timed levels [0, 0] on the engine thread "
            "(each a stall) and [0, 0] off it") in report


def test_the_traced_decode_steps_say_where_device_time_went(check):
    _, _, results, report = check
    for level in results["engine"][0]["levels"]:
        profile = level["profile"]
        assert profile["steps"] >= 8
        assert 0 < profile["busy_ms"] <= profile["span_ms"]
        # Every op class sum is kernel time inside the window, and the model's programs ran in it.
        assert 0 < sum(profile["by_class_ms"].values())
        assert any("decode" in program for program in profile["by_program_ms"])
        # The longest kernels, longest first, each no longer than its class's sum.
        ops = profile["top_ops"]
        assert ops and [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
        assert all(0 < op["ms"] <= profile["by_class_ms"][op["op_class"]] + 1e-9 and op["runs"] > 0 for op in ops)
        # The sustained stream's steady state: its steps' prefill ran in mixed steps of the workload's prompts.
        sustained = level["sustained"]["profile"]
        assert 0 < sustained["busy_ms"] <= sustained["span_ms"] and sustained["output_tok_s"] > 0
        assert sustained["mixed_steps"]["steps"] > 0
        assert sustained["mixed_steps"]["tokens"] <= sustained["mixed_steps"]["bucket"] <= 8
    traced = report.split("### Where a step's time goes")[1]
    assert "| tiny | 2 | decode | " in traced and "| tiny | 2 | sustained | " in traced
    longest = traced.split("Longest kernels of the decode windows")[1]
    assert f"| tiny | 2 | {results['engine'][0]['levels'][1]['profile']['top_ops'][0]['op_class']} | " in longest


def test_a_step_without_time_left_is_skipped_and_reported(tmp_path):
    run = gpu_check.Run(tmp_path, tmp_path, budget_s=gpu_check.MIN_STEP_S - 1)
    (tmp_path / "log.txt").write_text("")
    result = run.step("engine-tiny", gpu_check.python("-c", "raise SystemExit(1)"), gpu_check.child_env(tmp_path))
    assert result.status == "skipped" and "budget left" in result.note
    assert "| engine-tiny | skipped | 0 |" in "\n".join(gpu_report.steps_section(run.steps))


def test_the_kernel_table_gives_a_traced_kernel_time_its_share_of_the_peak():
    row = dict(backend="pallas-mosaic", batch=64, context=2048, bytes=10**8, ms=0.2, gbps=500.0, kernel_ms=0.125,
               kernel_gbps=800.0, max_diff=1e-3)
    untraced = {k: v for k, v in row.items() if not k.startswith("kernel")}
    lines = gpu_report.kernel_bench_section([row, untraced], peak_gbs=1000.0)
    assert "| pallas-mosaic | 64 | 2048 | 0.2000 | 500 | 50% | 0.1250 | 80% | 1.0e-03 |" in lines
    assert "| pallas-mosaic | 64 | 2048 | 0.2000 | 500 | 50% | - | - | 1.0e-03 |" in lines


def test_an_engine_step_is_not_started_with_less_left_than_it_needs(tmp_path):
    """A model's engine compiles for about two minutes: started with 100 s left it would time out having measured
    nothing, where a short step still runs."""
    run = gpu_check.Run(tmp_path, tmp_path, budget_s=100)
    (tmp_path / "log.txt").write_text("")
    env = gpu_check.child_env(tmp_path)
    engine = run.step("engine-smollm2-135m", gpu_check.python("-c", "pass"), env)
    audit = run.step("step-audit", gpu_check.python("-c", "pass"), env)
    assert engine.status == "skipped" and "budget left" in engine.note
    assert audit.status == "ok"


def test_what_ran_out_of_time_gets_a_command_to_finish_it(tmp_path):
    steps = [
        gpu_report.StepResult("kernel-tests", "ok"),
        gpu_report.StepResult("kernel-bench-mosaic", "timed out"),
        gpu_report.StepResult("engine-llama-3.2-1b", "skipped", note="12 s of the budget left"),
        gpu_report.StepResult("engine-llama-3-8b", "skipped", note="needs about 24.0 GiB"),
    ]
    assert gpu_check.unfinished(steps, tmp_path / "a") == (
        f"python -m sluice.bench.gpu_check --out {tmp_path}/a/more --require-gpu --steps kernel-bench engine "
        "--models llama-3.2-1b"
    )
    assert gpu_check.unfinished(steps[:1], tmp_path) is None


def test_xla_flags_reach_every_step_after_the_environments(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert gpu_check.child_env(tmp_path, gpu_check.COMMAND_BUFFERS)["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x " + gpu_check.COMMAND_BUFFERS)
    monkeypatch.delenv("XLA_FLAGS")
    assert gpu_check.child_env(tmp_path)["XLA_FLAGS"] == ""


def test_a_failing_step_is_reported_with_its_output_in_the_log(tmp_path):
    run = gpu_check.Run(tmp_path, tmp_path, budget_s=60)
    command = gpu_check.python("-c", "print('the cause'); raise SystemExit(3)")
    result = run.step("probe", command, gpu_check.child_env(tmp_path))
    assert result.status == "failed" and result.note == "exit status 3: the cause"
    assert "the cause" in (tmp_path / "log.txt").read_text()


def test_require_gpu_stops_at_once_without_one(tmp_path):
    status = gpu_check.main(["--out", str(tmp_path), "--require-gpu"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert status == 1
    assert [(s["name"], s["status"]) for s in results["steps"]] == [("probe", "failed")]
    assert "cannot run: no GPU" in results["steps"][0]["note"]
    assert "| probe | failed |" in (tmp_path / "report.md").read_text()


def test_the_command_buffer_flags_are_flags_this_xla_knows():
    # XLA parses every backend's flags on any backend, and aborts the process at an unknown one: a typo here would
    # cost a GPU session its run.
    env = {**os.environ, "XLA_FLAGS": gpu_check.COMMAND_BUFFERS}
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "2.0", done.stderr[-1000:]
