"""Time to first token of long prompts before and after a server restart, with the persistent prefix cache.

    python -m sluice.bench.prefix_restart --prompt-tokens 2000 --prompts 3      # or: sluice bench prefix_restart

A `sluice serve --prefix-cache-dir DIR` (a fresh temporary DIR) answers each prompt once, cold; the server is then
killed (SIGKILL, or SIGTERM with --restart sigterm) and started again over DIR, and each prompt is asked again:
its pages now load from the disk tier instead of being computed. Each answer is greedy and must be the same
before and after. Prints TTFT per prompt, cold and warm, their ratio, and the store's disk hits after.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sluice.bench.compare import ROOT, free_port, wait_ready


def start(directory: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "sluice.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--prefix-cache-dir", str(directory), "--max-model-len", str(args.prompt_tokens + 64),
               "--log-level", "warning", *args.server_args.split()]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, args.startup_timeout)
    return process, url


def ask(url: str, prompt: list[int]) -> tuple[float, str]:
    """(seconds to the first token, the whole greedy text) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    start_s, ttft, text = time.perf_counter(), None, ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                piece = json.loads(line[len("data: "):])["choices"][0]["text"]
                if piece and ttft is None:
                    ttft = time.perf_counter() - start_s
                text += piece
    return ttft, text


def disk_pages(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f'{name}{{tier="disk"}} '):
            return float(line.split()[-1])
    raise RuntimeError(f"{name} missing from /metrics")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench prefix_restart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=3, help="distinct long prompts, each asked cold then warm")
    parser.add_argument("--restart", choices=["sigkill", "sigterm"], default="sigkill")
    parser.add_argument("--server-args", default="--max-num-seqs 4 --max-num-batched-tokens 512",
                        help="more `sluice serve` flags")
    parser.add_argument("--startup-timeout", type=float, default=900)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    full_pages = args.prompts * ((args.prompt_tokens - 1) // 16)
    with tempfile.TemporaryDirectory(prefix="sluice-prefix-") as directory:
        process, url = start(Path(directory), args)
        try:
            cold = [ask(url, prompt) for prompt in prompts]
            deadline = time.monotonic() + 120
            while disk_pages(url, "sluice_prefix_store_pages") < full_pages and time.monotonic() < deadline:
                time.sleep(0.2)
            process.send_signal(signal.SIGKILL if args.restart == "sigkill" else signal.SIGTERM)
            process.wait(120)
        finally:
            process.kill()
        process, url = start(Path(directory), args)
        try:
            warm = [ask(url, prompt) for prompt in prompts]
            hits = disk_pages(url, "sluice_prefix_store_hits_total")
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
    print(f"python -m sluice.bench.prefix_restart {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens, restart by {args.restart}; TTFT in seconds")
    print("prompt    cold    warm   cold/warm  same tokens")
    for i, ((c, c_text), (w, w_text)) in enumerate(zip(cold, warm)):
        print(f"{i:>6} {c:7.2f} {w:7.2f} {c / w:10.1f}x  {c_text == w_text}")
    ratios = [c / w for (c, _), (w, _) in zip(cold, warm)]
    print(f"median cold/warm {statistics.median(ratios):.1f}x; disk hits after the restart {hits:.0f} "
          f"of {full_pages} full pages")
    return 0 if all(c_text == w_text for (_, c_text), (_, w_text) in zip(cold, warm)) else 1


if __name__ == "__main__":
    sys.exit(main())
