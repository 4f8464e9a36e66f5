"""PNG charts of benchmark results (matplotlib, headless): latency and throughput against request rate,
and the TTFT distribution of one run. Rates sit at evenly spaced positions so "inf" gets its own place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from sluice.bench.metrics import RequestRecord  # noqa: E402


def _rate_axis(results: list[dict[str, Any]]) -> tuple[list[int], list[str]]:
    labels = [str(r["load"]["request_rate"]) for r in results]
    return list(range(len(results))), labels


def plot_rate_curves(results: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Two charts from `serve` result JSONs (one per request rate, in sweep order)."""
    folder.mkdir(parents=True, exist_ok=True)
    x, labels = _rate_axis(results)
    latency, axes = plt.subplots(1, 2, figsize=(11, 4))
    for metric, ax in zip(("ttft_ms", "tpot_ms"), axes):
        for stat in ("median", "p90", "p99"):
            ax.plot(x, [r["summary"][metric][stat] for r in results], marker="o", label=stat)
        ax.set_title(metric.replace("_ms", "").upper() + " (ms)")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
    latency_path = _save(latency, folder / "latency_vs_rate.png")

    throughput, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["summary"]["output_throughput"] for r in results], marker="o", label="output tok/s")
    ax.plot(x, [r["summary"]["total_token_throughput"] for r in results], marker="o", label="total tok/s")
    ax.set_xticks(x, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("tokens/s")
    ax.legend()
    throughput_path = _save(throughput, folder / "throughput_vs_rate.png")
    return [latency_path, throughput_path]


def _save(figure: plt.Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_throughput_latency(results: list[dict[str, Any]], path: Path) -> Path:
    """The sweep's curve: output tokens/s against median and p99 TPOT, one point per rate, labelled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, ax = plt.subplots(figsize=(6, 4))
    tps = [r["summary"]["output_throughput"] for r in results]
    for stat in ("median", "p99"):
        ax.plot(tps, [r["summary"]["tpot_ms"][stat] for r in results], marker="o", label=f"TPOT {stat}")
    for r, t in zip(results, tps):
        ax.annotate(str(r["load"]["request_rate"]), (t, r["summary"]["tpot_ms"]["median"]), fontsize=8)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title("throughput vs latency (labels: req/s)")
    ax.legend()
    return _save(figure, path)


def plot_ttft_distribution(records: list[RequestRecord], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, ax = plt.subplots(figsize=(6, 4))
    ax.hist([r.ttft * 1e3 for r in records if r.ok], bins=30)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("requests")
    return _save(figure, path)
