"""`sluice bench serve`: an open-loop load generator against an OpenAI-compatible server.

Requests leave on a Poisson schedule (`--request-rate`, "inf" sends them all at once), optionally
capped at `--max-concurrency` in flight, whatever the server's pace: a slow server sees a queue, as in
production. Each request streams (`/v1/completions` with the prompt as token ids, or
`/v1/chat/completions` with it as text), greedy, with `ignore_eos` and `max_tokens` from the dataset so
every system produces the same number of tokens. Token counts come from the stream's final `usage`;
each content chunk is taken as one token for ITL (Sluice and vLLM send one chunk per engine step;
llama-server holds back a token whose text ends inside a UTF-8 character and sends it with the next one,
and ends its stream with a text-less chunk that carries only the finish reason, which is no token).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from sluice.app.arguments import at_least
from sluice.bench.dataset import DEFAULT_OUTPUT, DEFAULT_PROMPT, BenchRequest, LengthDistribution, SyntheticSpec, load_jsonl, synthetic
from sluice.bench import prefix_cache
from sluice.bench.metrics import RequestRecord, Slo, Summary, summarize
from sluice.bench.prefix_workload import PrefixGroupsSpec, shared_prefix
from sluice.bench.roofline import DTYPES, Peaks, Roofline, ServedModel, peaks_from, workload_roofline


@dataclass(frozen=True)
class LoadConfig:
    url: str
    endpoint: str = "completions"
    model: str | None = None
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class RunResult:
    load: LoadConfig
    records: list[RequestRecord]
    summary: Summary
    roofline: Roofline


def _payload(request: BenchRequest, load: LoadConfig, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if load.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
    return body


def _content_chunk(event: dict[str, Any], endpoint: str) -> bool:
    choices = event.get("choices") or []
    if endpoint == "chat":
        return any(c.get("delta", {}).get("content") for c in choices)
    return any(c.get("text") or c.get("finish_reason") is None for c in choices)


async def _send(client: httpx.AsyncClient, request: BenchRequest, load: LoadConfig, model: str) -> RequestRecord:
    path = "/v1/chat/completions" if load.endpoint == "chat" else "/v1/completions"
    chunk_times: list[float] = []
    usage: dict[str, int] = {}
    error: str | None = None
    sent_at = time.perf_counter()
    try:
        async with client.stream("POST", load.url + path, json=_payload(request, load, model)) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        error = str(event["error"].get("message", event["error"]))
                    elif _content_chunk(event, load.endpoint):
                        chunk_times.append(now)
                    if event.get("usage"):
                        usage = event["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as failure:
        error = f"{type(failure).__name__}: {failure}"
    done_at = time.perf_counter()
    return RequestRecord(
        sent_at=sent_at,
        done_at=done_at,
        chunk_times=tuple(chunk_times),
        chunk_tokens=(1,) * len(chunk_times),
        prompt_tokens=usage.get("prompt_tokens", request.prompt_tokens or 0),
        output_tokens=usage.get("completion_tokens", len(chunk_times)),
        error=error if error is not None or chunk_times else "no tokens streamed",
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    )


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(url + "/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _as_text(client: httpx.AsyncClient, url: str, requests: list[BenchRequest]) -> list[BenchRequest]:
    """Chat needs text: token-id prompts are detokenized by the server itself (before the clock starts)."""
    converted = []
    for r in requests:
        if not isinstance(r.prompt, str):
            response = await client.post(url + "/detokenize", json={"tokens": list(r.prompt)})
            response.raise_for_status()
            r = BenchRequest(response.json()["prompt"], r.output_tokens)
        converted.append(r)
    return converted


async def run_load(requests: list[BenchRequest], load: LoadConfig) -> tuple[list[RequestRecord], float]:
    """Sends `requests` on the load's schedule; returns their records and the run's wall time in seconds."""
    rng = np.random.default_rng(load.seed)
    gaps = rng.exponential(1.0 / load.request_rate, len(requests)) if np.isfinite(load.request_rate) else np.zeros(len(requests))
    limit = asyncio.Semaphore(load.max_concurrency or len(requests))
    timeout = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)
    # A connection per request: llama-server may close a kept-alive connection after a streamed response,
    # and a request sent on it fails before the server sees it. A loopback connect costs microseconds.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = load.model or await served_model(client, load.url)
        if load.endpoint == "chat":
            requests = await _as_text(client, load.url, requests)

        async def one(request: BenchRequest) -> RequestRecord:
            async with limit:
                return await _send(client, request, load, model)

        start = time.perf_counter()
        tasks = []
        for request, gap in zip(requests, gaps):
            await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(one(request)))
        records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


def benchmark(requests: list[BenchRequest], load: LoadConfig, slo: Slo, peaks: Peaks, served: ServedModel) -> RunResult:
    records, duration = asyncio.run(run_load(requests, load))
    summary = summarize(records, duration, slo)
    done = [r for r in records if r.ok]
    roofline = workload_roofline(
        served, peaks,
        [r.prompt_tokens for r in done] or [1], [r.output_tokens for r in done] or [1], summary.mean_decode_batch,
    )
    return RunResult(load, records, summary, roofline)


def report(result: RunResult, command: str) -> str:
    s, load = result.summary, result.load
    rate = "inf" if not np.isfinite(load.request_rate) else f"{load.request_rate:g}"
    rows = [
        ("Request rate (req/s) / max concurrency", f"{rate} / {load.max_concurrency or '-'}"),
        ("Successful / failed requests", f"{s.completed} / {s.failed}"),
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Prompt / output tokens", f"{s.prompt_tokens} / {s.output_tokens}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.1f}"),
        ("Mean decode batch", f"{s.mean_decode_batch:.1f}"),
    ]
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        rows.append((f"{name} ms mean / median / p90 / p99", f"{d.mean:.1f} / {d.median:.1f} / {d.p90:.1f} / {d.p99:.1f}"))
    if s.slo.ttft_ms is not None or s.slo.tpot_ms is not None:
        rows.append((f"Goodput (req/s) TTFT<={s.slo.ttft_ms} TPOT<={s.slo.tpot_ms} ms", f"{s.goodput:.2f} ({s.good_requests} good)"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(result.roofline.line(s.output_throughput))
    lines.append(f"command: {command}")
    return "\n".join(lines)


def result_json(result: RunResult, command: str, dataset: str) -> dict[str, Any]:
    load = asdict(result.load)
    load["request_rate"] = "inf" if not np.isfinite(result.load.request_rate) else result.load.request_rate
    return {
        "command": command,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "dataset": dataset,
        "load": load,
        "summary": asdict(result.summary),
        "roofline": asdict(result.roofline)
        | {"fraction_of_limit": result.summary.output_throughput / result.roofline.bound_output_tps},
        "requests": [
            {
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "ttft_ms": r.ttft * 1e3 if r.ok else None,
                "tpot_ms": r.tpot * 1e3 if r.ok and r.tpot is not None else None,
                "e2e_ms": r.e2e * 1e3,
                "error": r.error,
            }
            for r in result.records
        ],
    }


def command_line() -> str:
    """How this process was started, as a reader would retype it."""
    program = Path(sys.argv[0])
    prefix = ["sluice"] if program.name == "sluice" else ["python", "-m", f"sluice.bench.{program.stem}"]
    return shlex.join(prefix + sys.argv[1:])


def request_rate(text: str) -> float:
    """An argparse type: a Poisson arrival rate in req/s, positive, or inf (every request at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r}") from None
    if not rate > 0:  # zero, negative, nan
        raise argparse.ArgumentTypeError(f"must be positive or inf, got {text}")
    return rate


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="synthetic", help="'synthetic' or a JSONL file of {prompt, output_tokens}")
    parser.add_argument("--num-requests", type=at_least(1, int), default=64)
    parser.add_argument("--seed", type=int, default=0, help="seeds the synthetic workload and the arrival times")
    parser.add_argument("--prompt-len-mean", type=float, default=DEFAULT_PROMPT.mean)
    parser.add_argument("--prompt-len-max", type=int, default=DEFAULT_PROMPT.max)
    parser.add_argument("--output-len-mean", type=float, default=DEFAULT_OUTPUT.mean)
    parser.add_argument("--output-len-max", type=int, default=DEFAULT_OUTPUT.max)
    parser.add_argument("--prefix-groups", type=int, default=None,
                        help="shared-prefix workload: this many system prompts of --prefix-len tokens, each request "
                             "one of them (at random) followed by a synthetic prompt of its own")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens of each shared prefix")


def load_dataset(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The workload and a one-line description of it."""
    if args.dataset != "synthetic":
        return load_jsonl(Path(args.dataset), args.num_requests), f"{args.dataset} (first {args.num_requests})"
    prompt = LengthDistribution(args.prompt_len_mean, DEFAULT_PROMPT.sigma, DEFAULT_PROMPT.min, args.prompt_len_max)
    output = LengthDistribution(args.output_len_mean, DEFAULT_OUTPUT.sigma, DEFAULT_OUTPUT.min, args.output_len_max)
    if args.prefix_groups is not None:
        groups = PrefixGroupsSpec(args.prefix_groups, args.prefix_len, args.num_requests, prompt, output, args.seed)
        return shared_prefix(groups), groups.describe()
    spec = SyntheticSpec(num_requests=args.num_requests, seed=args.seed, prompt=prompt, output=output)
    return synthetic(spec), spec.describe()


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--max-concurrency", type=at_least(1, int), default=None, help="most requests in flight")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    parser.add_argument("--roofline-model", default=None, help="model file whose shape the roofline uses (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the server's activation and KV dtype, for the roofline")
    parser.add_argument("--quantization", default="auto", help="the server's --quantization, for the roofline")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the server's --kv-cache-dtype, for the roofline")
    parser.add_argument("--peaks", type=Path, default=None,
                        help="peaks JSON from `python -m sluice.bench.roofline --save` (default: measure here, now)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_dataset_arguments(parser)
    parser.add_argument("--request-rate", type=request_rate, default=float("inf"), help="Poisson arrival rate, req/s, or inf")
    parser.add_argument("--result-json", type=Path, default=Path("bench/out/serve.json"))
    parser.add_argument("--plot", type=Path, default=None, help="write PNG charts into this folder")


def load_config(args: argparse.Namespace, request_rate: float) -> LoadConfig:
    return LoadConfig(args.url.rstrip("/"), args.endpoint, args.model, request_rate, args.max_concurrency, args.seed)


def run(args: argparse.Namespace) -> int:
    command = command_line()
    requests, dataset = load_dataset(args)
    served = ServedModel.of(args.roofline_model, args.dtype, args.quantization, args.kv_cache_dtype)
    peaks = peaks_from(args.peaks, served.arithmetic)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    url = args.url.rstrip("/")
    cache_before = prefix_cache.read(url)
    result = benchmark(requests, load_config(args, args.request_rate), slo, peaks, served)
    cache = prefix_cache.difference(prefix_cache.read(url), cache_before)
    print(f"dataset: {dataset}\npeaks: {peaks.bandwidth_gbs:.1f} GB/s, {peaks.matmul_gflops:.0f} GFLOP/s ({peaks.device})")
    print(report(result, command))
    print("\n".join(f"{name}  {value}" for name, value in prefix_cache.report_rows(cache)))
    data = result_json(result, command, dataset) | {"prefix_cache": {r: asdict(c) for r, c in cache.items()}}
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(data, indent=2) + "\n")
    print(f"result: {args.result_json}")
    if args.plot is not None:
        from sluice.bench.plots import plot_rate_curves, plot_ttft_distribution

        plot_ttft_distribution(result.records, args.plot / "ttft_distribution.png")
        plot_rate_curves([data], args.plot)
        print(f"plots: {args.plot}")
    return 0 if result.summary.failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
