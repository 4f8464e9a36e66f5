"""The markdown report of a `bench.gpu_check` run, ready to paste into bench/RESULTS.md.

`report(results, command, small)` takes the run's results (as results.json holds them): the probe's machine
description, the kernel tests' outcomes, the kernel benchmark's rows, each model's engine figures and the
steps' statuses. Figures a step did not produce (it failed, timed out or was skipped) show as "-" or as a
row that says so; the steps table says why.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

KERNEL_BACKENDS = ("pallas-triton", "pallas-mosaic", "reference")
HOST_PHASES = ("schedule", "inputs", "dispatch", "collect", "append", "emit", "wait", "cpu")
LONGEST_KERNELS = 10  # of each decode window, in the report


@dataclass
class StepResult:
    name: str
    status: str  # "ok", "failed", "timed out", "skipped"
    seconds: float = 0.0
    note: str = ""


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1e3, ".2f")


def cell(text: str) -> str:
    """Free text (an error, a note) made safe inside a markdown table cell."""
    return text.replace("|", "\\|")


def environment_section(probe: dict, command: str, wall_s: float) -> list[str]:
    smi = probe.get("nvidia_smi") or {}
    driver = smi.get("driver_version", "none (no nvidia-smi)")
    limit = probe.get("memory_limit_bytes")
    memory = smi.get("memory.total") or (f"{limit / 2**30:.1f} GiB usable" if limit else "-")
    return [
        f"## Sluice GPU check, {probe.get('date', datetime.date.today().isoformat())}: "
        f"{probe.get('device_kind', '?')} ({probe.get('platform', '?')})",
        "",
        f"`{command}` - {wall_s:.0f} s in all.",
        "",
        f"- Device: {probe.get('device_kind', '?')} x{probe.get('device_count', '?')}, compute capability "
        f"{probe.get('compute_capability') or '-'}, memory {memory}, driver {driver}, runtime "
        f"{probe.get('platform_version') or '-'}",
        f"- Software: jax {probe.get('jax', '?')}, jaxlib {probe.get('jaxlib', '?')}, flax {probe.get('flax', '?')}, "
        f"Python {probe.get('python', '?')}; host {probe.get('host', '?')}",
        f"- Measured peaks: memory bandwidth {fmt(probe.get('bandwidth_gbs'), '.0f')} GB/s, matmul "
        f"{fmt(probe.get('bf16_matmul_gflops'), '.0f')} GFLOP/s bf16, {fmt(probe.get('f32_matmul_gflops'), '.0f')} "
        "GFLOP/s f32",
        "",
    ]


def kernel_tests_section(outcomes: list[dict], small: bool) -> list[str]:
    mode = "a subset, Triton interpreted: no GPU here" if small else "compiled"
    lines = [f"### Kernel correctness ({mode})", "",
             "tests/test_paged_attention.py (float64 oracle, jax's shipped paged attention) and "
             "tests/test_kernel_lowering.py.", "",
             "| backend | passed | failed | skipped |", "|---|---:|---:|---:|"]
    for backend in (*KERNEL_BACKENDS, "other"):
        mine = [o for o in outcomes if o["backend"] == backend]
        if mine:
            counts = [sum(o["outcome"] == k for o in mine) for k in ("passed", "failed", "skipped")]
            lines.append(f"| {backend} | {counts[0]} | {counts[1]} | {counts[2]} |")
    if not outcomes:
        lines.append("| (no results: see the steps table and log.txt) | | | |")
    failures = [o for o in outcomes if o["outcome"] == "failed"]
    if failures:
        lines += ["", "Failures:"] + [f"- `{o['name']}`: {o['message']}" for o in failures]
    skip_reasons = sorted({o["message"] for o in outcomes if o["outcome"] == "skipped"})
    if skip_reasons:
        lines += ["", "Skipped because: " + "; ".join(skip_reasons)]
    return lines + [""]


def kernel_bench_section(rows: list[dict], peak_gbs: float | None) -> list[str]:
    lines = ["### Decode attention kernels", "",
             "`python -m sluice.bench.kernels` (see its docstring): median of chained calls; bandwidth counts K, V and "
             "q read once" + (f", % of the measured {peak_gbs:.0f} GB/s" if peak_gbs else "") + ". Kernel: the "
             "attention kernel's own device time per call, traced (where the run traced it), without the wrapper's "
             "query tiling and output slicing.", "",
             "| backend | batch | context | ms / call | GB/s | % of peak | kernel ms | kernel % of peak "
             "| max abs diff vs reference |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    share = lambda gbps: f"{100 * gbps / peak_gbs:.0f}%" if peak_gbs else "-"
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | failed: {cell(r['error'])} | | | | | |")
        else:
            kernel = f"{r['kernel_ms']:.4f} | {share(r['kernel_gbps'])}" if "kernel_ms" in r else "- | -"
            lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                         f"{share(r['gbps'])} | {kernel} | {r['max_diff']:.1e} |")
    if not rows:
        lines.append("| (no results: see the steps table and log.txt) | | | | | | | | |")
    return lines + [""]


def _decoding(decoding: dict | None) -> str:
    if not decoding or not decoding["temperature"]:
        return "greedy"
    return f"sampled at temperature {decoding['temperature']:g}, top-p {decoding['top_p']:g}"


def engine_section(results: list[dict], peak_gbs: float | None) -> list[str]:
    lines = ["### Engine offline, random weights with real shapes, bf16", "",
             "`python -m sluice.bench.engine_check` (see its docstring). Throughput: the workload's requests in waves of "
             "C; sustained: 4 x C requests with C kept in flight (the next sent as each ends). TTFT: C fresh prompts sent at once, until all have a first token. TPOT: per request (last - first "
             "token's arrival) / (tokens - 1), at batch C, the others' prefill included; decode TPOT: the same once "
             "every request decodes. Step: a decode step at batch C timed directly "
             "(forward + LM head + argmax), its attention over all layers, its LM head + argmax, the rest; "
             "`engine extra` = TPOT - step (sampler, host work, bucket padding). HBM %: weights + K/V bytes over "
             "the step's time, against the measured bandwidth. Roofline %: output tok/s over bench.roofline's bound.",
             "",
             "| model | attention, layers | C | requests | output tok/s | total tok/s | sustained output tok/s | "
             "TTFT s | TPOT ms | "
             "decode TPOT ms | step ms | attention ms | LM head ms | rest ms | engine extra ms | HBM % | roofline % | "
             "compile s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        if "skipped" in result:
            lines.append(f"| {result['model']} | skipped: {cell(result['skipped'])} |" + " |" * 16)
            continue
        if not result.get("levels"):
            lines.append(f"| {result['model']} | no results: see the steps table and log.txt |" + " |" * 16)
            continue
        for level in result["levels"]:
            step = level.get("step", {})
            step_s = step.get("step_s")
            rest = step_s - step["attention_s"] - step["head_s"] if step_s is not None else None
            extra = level["tpot_s"] - step_s if "tpot_s" in level and step_s is not None else None
            hbm = 100 * step["floor_bytes"] / (peak_gbs * 1e9) / step_s if step_s and peak_gbs else None
            roofline = (100 * level["output_tok_s"] / level["roofline_output_tok_s"]
                        if "roofline_output_tok_s" in level else None)
            lines.append(
                f"| {result['model']} | {result.get('backend', '-')}, {result.get('layer_loop', '-')}"
                f"{'' if result.get('quantization', 'none') == 'none' else ', ' + result['quantization']} | "
                f"{level['concurrency']} | "
                f"{level.get('requests', '-')} | {fmt(level.get('output_tok_s'), '.0f')} | "
                f"{fmt(level.get('total_tok_s'), '.0f')} | "
                f"{fmt(level.get('sustained', {}).get('output_tok_s'), '.0f')} | {fmt(level.get('ttft_s'), '.3f')} | "
                f"{ms(level.get('tpot_s'))} | {ms(level.get('decode_tpot_s'))} | {ms(step_s)} | "
                f"{ms(step.get('attention_s'))} | "
                f"{ms(step.get('head_s'))} | {ms(rest)} | {ms(extra)} | {fmt(hbm, '.0f')} | {fmt(roofline, '.0f')} | "
                f"{fmt(result.get('compile_s'), '.0f')} |"
            )
    settings = [f"- {r['model']}: up to {max(r['sizes']['concurrency'])} sequences, "
                f"{r['sizes']['max_num_batched_tokens']} tokens per step, a KV pool of "
                f"{r['kv_cache_bytes'] / 2**20:,.2f} MiB, {r.get('num_preemptions', 0)} preemptions, "
                f"{_decoding(r.get('decoding'))}, programs compiled during the timed levels "
                f"{[level.get('compiled', 0) for level in r['levels']]} on the engine thread (each a stall) and "
                f"{[level.get('compiled_off_thread', 0) for level in r['levels']]} off it; the direct steps "
                f"compiled in {fmt(r.get('direct_compile_s'), '.0f')} s, one thread each"
                for r in results if "kv_cache_bytes" in r]
    return lines + ([""] + settings if settings else []) + [""]


def profile_section(results: list[dict]) -> list[str]:
    """Per model, concurrency and run (the decode wave's, the sustained stream's steady state): the engine's period
    per step against the device's busy time in it, the busy time by op class (`bench.device_profile`), all in ms
    per step, and the sustained window's mixed steps."""
    classes = ("matmul", "attention", "copy", "fusion", "other")
    lines = ["### Where a step's time goes (engine, traced)", "",
             "`bench.engine_check`: decode, C requests decoding (`profiled_decode`, tpot_steps steps); sustained, "
             "the stream's steady state (`sustained`, its engine steps after C requests ended). Period: the "
             "window's wall time per engine step; busy: the union of the device's kernels; idle = period - "
             "busy, the device waiting for the host. Op classes sum kernel time (`bench.device_profile`); per "
             "program, the top three by busy time. Host: the engine's phases in the window (`bench.host_phases`; "
             "wait: blocked on the device). Mixed steps: how many of the window's steps had prefill, their mean "
             "tokens / token bucket, and decode rows. XLA runs command buffers op by op while it traces, unless "
             "`--xla_enable_command_buffers_during_profiling`: a traced window may launch kernels otherwise than an "
             "untraced run.", "",
             "| model | C | run | steps | period ms | busy ms | idle % | " + " | ".join(f"{c} ms" for c in classes)
             + " | top programs (ms) | host ms: " + ", ".join(HOST_PHASES) + " | mixed steps |",
             "|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(classes) + "---|---|---|"]
    for result in results:
        for level in result.get("levels", []):
            runs = (("decode", level.get("profile")), ("sustained", level.get("sustained", {}).get("profile")))
            for run, p in runs:
                if not p:
                    continue
                programs = sorted(p["by_program_ms"].items(), key=lambda kv: -sum(kv[1].values()))[:3]
                top = "; ".join(f"{cell(name)} {sum(c.values()):.2f}" for name, c in programs)
                idle = 100 * (1 - p["busy_share"])
                lines.append(f"| {result['model']} | {level['concurrency']} | {run} | {p['steps']} | "
                             f"{p['span_ms']:.2f} | {p['busy_ms']:.2f} | {idle:.0f} | "
                             + " | ".join(f"{p['by_class_ms'].get(c, 0.0):.2f}" for c in classes) + f" | {top} | "
                             + " / ".join(f"{p.get('host_ms', {}).get(h, 0.0):.2f}" for h in HOST_PHASES)
                             + f" | {_mixed(p.get('mixed_steps'))} |")
    return lines + [""] + longest_kernels(results)


def longest_kernels(results: list[dict]) -> list[str]:
    """The decode windows' longest kernels (`ProfileSummary.top_ops`), in ms and runs per step: what a fusion
    or a faster kernel would win first."""
    lines = ["Longest kernels of the decode windows, per step:", "",
             "| model | C | class | kernel | HLO op | runs | ms |", "|---|---:|---|---|---|---:|---:|"]
    for result in results:
        for level in result.get("levels", []):
            for op in (level.get("profile") or {}).get("top_ops", [])[:LONGEST_KERNELS]:
                lines.append(f"| {result['model']} | {level['concurrency']} | {op['op_class']} | "
                             f"{cell(op['kernel'][:60])} | {cell(op['hlo_op'])} | {op['runs']:.1f} | {op['ms']:.3f} |")
    return lines + [""] if len(lines) > 4 else []


def _mixed(mixed: dict | None) -> str:
    if not mixed:
        return "-"
    if not mixed["steps"]:
        return "0"
    return f"{mixed['steps']}: {mixed['tokens']:.0f} / {mixed['bucket']:.0f}, {mixed['decode_rows']:.0f} rows"


def steps_section(steps: list[StepResult]) -> list[str]:
    lines = ["### Steps", "", "| step | status | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} | {cell(s.note)} |" for s in steps]
    return lines + [""]


def report(results: dict, command: str, small: bool) -> str:
    probe = results.get("probe", {})
    peak = probe.get("bandwidth_gbs")
    lines = environment_section(probe, command, results["wall_s"])
    if "kernel-tests" in results:
        lines += kernel_tests_section(results["kernel-tests"], small)
    if "kernel-bench" in results:
        lines += kernel_bench_section(results["kernel-bench"], peak)
    if "engine" in results:
        lines += engine_section(results["engine"], peak)
        lines += profile_section(results["engine"])
    if results.get("step-audit"):
        lines += ["### Step-bytes audit (`bench.step_audit`)", "", results["step-audit"], ""]
    lines += steps_section([StepResult(**s) for s in results["steps"]])
    if results.get("unfinished"):
        lines += ["Out of time for part of the run; to finish it: `" + results["unfinished"] + "`", ""]
    return "\n".join(lines)
