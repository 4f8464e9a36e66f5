"""The `sluice` command: fetch, generate, serve, run-batch, bench."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.app.arguments import CHAT_TEMPLATE_HELP, DOWNLOAD_DIR_HELP, DTYPE_HELP, HF_OVERRIDES_HELP, REVISION_HELP, \
    CommandError, OneLineErrors, at_least, chat_template, dtype_name, hf_overrides, number
from sluice.app.allocator import preload_mimalloc
from sluice.model.fetch import InvalidModel, ModelNotFound

if TYPE_CHECKING:
    from sluice.model.tokenizer import Tokenizer


class Subcommand(OneLineErrors):
    """A subcommand's parser, which refuses the arguments it does not know itself: argparse leaves them to the top
    parser, whose error would name `sluice` and its --help rather than the subcommand and its own."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed, unknown


MODEL_HELP = ("a .gguf file, an HF folder or a Hugging Face Hub id (default: SmolLM2-135M-Instruct, downloaded if "
              "missing)")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_choice(parser)
    parser.add_argument("--dtype", type=dtype_name, default=None, help=DTYPE_HELP)
    parser.add_argument("--chat-template", type=chat_template, default=None, help=CHAT_TEMPLATE_HELP)
    parser.add_argument("--hf-overrides", type=hf_overrides, default=None, help=HF_OVERRIDES_HELP)


def _add_model_choice(parser: argparse.ArgumentParser) -> None:
    """--model, and a Hub model's --revision and --download-dir (as `sluice serve`'s)."""
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--revision", default=None, help=REVISION_HELP)
    parser.add_argument("--download-dir", default=None, help=DOWNLOAD_DIR_HELP)


def _fetch(args: argparse.Namespace) -> int:
    from sluice.model.fetch import resolve_model

    print(resolve_model(args.model, args.revision, args.download_dir))
    return 0


# `sluice bench NAME ...` runs `bench/NAME.py`; the benchmarks are imported only when asked for.
BENCHMARKS = {
    "throughput": "offline throughput: continuous vs static batching vs one at a time",
    "serve": "load a running server with streaming requests; latency percentiles and goodput",
    "sweep": "bench serve over a list of request rates; throughput-latency curve",
    "responsiveness": "/health and /metrics latency while a running server is loaded with streams",
    "server_threads": "a running server's CPU per engine call and per token, by thread, at a given concurrency",
    "speculative": "the same requests with and without n-gram drafts: output tok/s, TPOT, acceptance",
    "structured": "structured output: mask fill time per token, step-time cost, JSON-schema throughput",
    "routing": "sluice serve --replicas: prefix-aware routing against round-robin on a shared-prefix workload",
    "soak": "a mixed load for --minutes M with a SIGKILL and restart halfway: lost requests, 5xx, RSS, KV pages",
    "prefix_restart": "TTFT of long prompts before and after a restart, with the persistent prefix cache",
    "lora": "the same requests without LoRA, with adapters on the device unused, and spread over them: tok/s, TPOT",
}


def generate_prompt_ids(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    """`sluice generate`'s prompt: with `chat`, one user message rendered as the server renders a chat (the special
    tokens the template's alone); else the text with the BOS the tokenizer asks for."""
    from sluice.app.errors import APIError
    from sluice.app.prompts import chat_prompt
    from sluice.app.schemas import ChatMessage

    if not chat:
        return tokenizer.encode(prompt)
    try:
        return chat_prompt(tokenizer, [ChatMessage(role="user", content=prompt)]).token_ids
    except APIError as error:
        raise CommandError(f"--chat: {error.message}") from None


def _generate(args: argparse.Namespace) -> int:
    from sluice.model.generate import generate_stream
    from sluice.model.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype, chat_template=args.chat_template,
                        hf_overrides=args.hf_overrides, revision=args.revision, download_dir=args.download_dir)
    tokenizer = loaded.tokenizer
    if args.chat and not tokenizer.special.chat_template:
        raise CommandError("this model has no chat template: give one with --chat-template, or leave out --chat")
    prompt_ids = generate_prompt_ids(tokenizer, args.prompt, args.chat)
    context = loaded.config.max_position_embeddings
    if not prompt_ids:
        raise CommandError("the prompt is empty")
    if len(prompt_ids) + args.max_tokens > context:
        raise CommandError(f"the prompt's {len(prompt_ids)} tokens and --max-tokens {args.max_tokens} exceed the "
                           f"model's context of {context} tokens")
    detokenizer = tokenizer.decode_stream(prompt_ids)
    tokens = generate_stream(
        loaded.model, prompt_ids, args.max_tokens, temperature=args.temperature, seed=args.seed,
        stop_token_ids=loaded.config.eos_token_ids,
    )
    for token in tokens:
        if token in loaded.config.eos_token_ids:
            break
        print(detokenizer.push([token]), end="", flush=True)
    print(detokenizer.flush())
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `sluice` parser. `command`: the subcommand to be parsed, the only one whose own arguments are added (those
    of serve, run-batch, fetch and generate import jax, which `sluice --help` and `sluice chat` need not wait for);
    None: every one's."""
    parser = OneLineErrors(prog="sluice", description="High-throughput LLM inference on JAX/XLA.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Subcommand)

    def add(name: str, summary: str) -> argparse.ArgumentParser | None:
        added = commands.add_parser(name, help=summary)
        return added if command in (None, name) else None

    if fetch := add("fetch", "find a model (downloading the default one or a Hub model) and print its path"):
        _add_model_choice(fetch)
        fetch.set_defaults(run=_fetch)

    if gen := add("generate", "complete one prompt offline, streaming to the terminal"):
        gen.add_argument("prompt")
        gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
        gen.add_argument("--max-tokens", type=at_least(1, int), default=128)
        gen.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0: greedy")
        gen.add_argument("--seed", type=number(int, lambda value: -(2**63) <= value < 2**63,
                                               "in the signed 64-bit range"), default=0)
        _add_model_arguments(gen)
        gen.set_defaults(run=_generate)

    if serve_parser := add("serve", "serve the OpenAI-compatible HTTP API"):
        from sluice.app import serve

        serve.add_arguments(serve_parser)
        serve_parser.set_defaults(run=serve.run)

    if batch := add("run-batch", "answer a file of OpenAI Batch requests offline, through the server's own app "
                                 "(vLLM's `vllm run-batch`)"):
        from sluice.app import run_batch

        run_batch.add_arguments(batch)
        batch.set_defaults(run=run_batch.run)

    if chat := add("chat", "talk with a running server in the terminal (vLLM's `vllm chat`)"):
        from sluice.app import chat_cli

        chat_cli.add_arguments(chat)
        chat.set_defaults(run=chat_cli.run)

    bench = commands.add_parser(
        "bench", help="benchmarks", description="; ".join(f"{name}: {text}" for name, text in BENCHMARKS.items()),
    )
    bench.add_argument("benchmark", choices=BENCHMARKS, help="which benchmark (its own flags follow; try --help)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    bench.set_defaults(run=_bench)
    return parser


def _bench(args: argparse.Namespace) -> int:
    import httpx

    try:
        return importlib.import_module(f"sluice.bench.{args.benchmark}").main(args.args)
    except httpx.ConnectError as error:  # no server at --url (or at the one the benchmark started)
        raise CommandError(f"cannot connect to {error.request.url}: {error}") from None


# The commands that run a model in their own process: mimalloc serves their allocations (app/allocator.py).
RUNS_A_MODEL = ("serve", "run-batch", "generate", "bench")


def main(argv: list[str] | None = None) -> int:
    """`argv` None: the command line's, and a command that runs a model first re-executes itself with mimalloc
    preloaded."""
    try:
        if argv is None:
            argv = sys.argv[1:]
            if argv[:1] and argv[0] in RUNS_A_MODEL:
                preload_mimalloc()
        args = build_parser(argv[0] if argv else "").parse_args(argv)
        return args.run(args)
    except (ModelNotFound, InvalidModel, CommandError) as error:
        print(f"sluice: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
