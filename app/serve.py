"""`sluice serve`: flags (each also a SLUICE_* environment variable), start-up, serving and draining.

Uvicorn starts listening at once (/health answers 503) while the engine loads and compiles in a
thread; readiness flips when the engine's step loop runs, and the URL is printed then. The first
SIGTERM/SIGINT drains: new requests get 503, requests in flight finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import uvicorn

from sluice.batching.config import ACCELERATOR_BATCH, ACCELERATOR_PAGE_SIZE, CPU_BATCH, CPU_PAGE_SIZE, \
    KV_CACHE_DTYPES, LAYER_LOOPS, LARGE_ACCELERATOR_BATCH, QUANTIZATIONS, SAMPLER_BRANCHES, EngineConfig, \
    InvalidEngineConfig
from sluice.batching.engine import Engine
from sluice.pallas_kernels.attention import BACKENDS
from sluice.model.fetch import InvalidModel, ModelNotFound, from_hub, resolve_model
from sluice.model.roofline import Peaks
from sluice.sharding.mesh import DistributedConfig, InvalidTensorParallelism, initialize_distributed

from sluice.app.addresses import http_url
from sluice.app.arguments import CHAT_TEMPLATE_HELP, DOWNLOAD_DIR_HELP, DTYPE_HELP, HF_OVERRIDES_HELP, REVISION_HELP, \
    CommandError, OneLineErrors, above, at_least, chat_template, claim_gpu_memory, dtype_name, fraction, hf_overrides, \
    json_object
from sluice.app.engine_loading import load_engine
from sluice.app.middleware import OPEN_PATHS
from sluice.app.scale_out import ROUTINGS, ScaleOutConfig
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.app.reasoning import REASONING_PARSERS
from sluice.app.tool_calls import TOOL_CALL_PARSERS

T = TypeVar("T")
logger = logging.getLogger("sluice.serve")

_ENGINE_DEFAULTS = EngineConfig()
_SERVER_DEFAULTS = ServerSettings()
_SCALE_DEFAULTS = ScaleOutConfig(replicas=1)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# Seconds an idle keep-alive connection stays open. Longer than clients' pool expiry (httpx and the OpenAI SDK:
# 5 s, uvicorn's default too; aiohttp: 15 s) and load balancers' idle timeout (60 s), so the client always
# closes first: a server that closes at the instant a client reuses the connection resets that request unread
# (`sluice bench soak` lost one in 21,246 so).
KEEP_ALIVE_S = 65
# Flags that tune a mode another flag turns on: set without it (to other than their default), they would do
# nothing, so they are refused. Each mode: what it is, what turns it on, whether `args` do, and its flags.
TuningFlags = list[tuple[str, str, Callable[[argparse.Namespace], bool], tuple[str, ...]]]
# The engine's modes (`add_engine_arguments`' flags), then those of serving over several engines (the server's own).
ENGINE_TUNING_FLAGS: TuningFlags = [
    ("speculative decoding", "--speculative ngram", lambda args: args.speculative is not None,
     ("--num-speculative-tokens", "--spec-ngram-min", "--spec-ngram-max", "--spec-max-batch-size")),
    ("the persistent prefix cache", "--prefix-cache-dir DIR", lambda args: args.prefix_cache_dir is not None,
     ("--prefix-cache-size", "--prefix-cache-ram")),
]
SCALE_OUT_TUNING_FLAGS: TuningFlags = [
    ("serving over replicas", "--replicas N", lambda args: args.replicas is not None,
     ("--routing", "--imbalanced-threshold", "--max-ongoing-requests", "--max-replicas", "--min-replicas",
      "--target-ongoing-requests", "--upscale-delay", "--downscale-delay")),
    ("autoscaling", "--max-replicas N", lambda args: args.max_replicas is not None,
     ("--min-replicas", "--target-ongoing-requests", "--upscale-delay", "--downscale-delay")),
    ("prefix-aware routing", "--routing prefix", lambda args: args.routing == "prefix", ("--imbalanced-threshold",)),
    ("joining a Ray cluster", "--replicas N or --hosts H",
     lambda args: args.replicas is not None or args.hosts is not None, ("--ray-address",)),
    ("a multi-process job", "--num-processes N", lambda args: args.num_processes > 1, ("--process-id",)),
]
_BUILT_IN_DEFAULTS: dict[str, Any] = {}  # flag -> its default before the environment's (`_option`)
RUNTIME_LORA_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch of --allow-runtime-lora-updating


def byte_size(text: str) -> int:
    """`1073741824`, `1G`, `1GiB`, `512MB` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 2147483648, 2G, 512MiB)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def positive_byte_size(text: str) -> int:
    size = byte_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def port(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (0 to 65535)")
    return int(text)


def string_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's CORS flags take: `'["https://app.example"]'`."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r} "
                                         """(example: '["http://localhost:3000"]')""")
    return tuple(value)


SPECULATIVE_CONFIG_KEYS = {"method": "speculative", "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_max": "spec_ngram_max", "prompt_lookup_min": "spec_ngram_min"}


def speculative_config(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON, of the n-gram method: its keys as Sluice's flags' destinations."""
    value = json_object(text, '{"method": "ngram", "num_speculative_tokens": 4}')
    if value.get("method") != "ngram":
        raise argparse.ArgumentTypeError(f"only the method \"ngram\" is served, got {value.get('method')!r}")
    if unknown := sorted(set(value) - set(SPECULATIVE_CONFIG_KEYS)):
        raise argparse.ArgumentTypeError(f"unknown keys {', '.join(map(repr, unknown))} (known: "
                                         f"{', '.join(SPECULATIVE_CONFIG_KEYS)})")
    for key, number in value.items():
        if key != "method" and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
            raise argparse.ArgumentTypeError(f"{key} must be a whole number of at least 1, got {number!r}")
    return {SPECULATIVE_CONFIG_KEYS[key]: number for key, number in value.items()}


def lora_module(text: str) -> tuple[str, str]:
    """One of vLLM's `--lora-modules`: `NAME=PATH`, or the JSON `{"name": NAME, "path": PATH}` (vLLM's
    `base_model_name` key is taken and unused: the base is the served model) -> (name, path): a Hub id (ORG/NAME)
    where no such local path is, else the path made absolute (a Ray replica reads it from a working directory of its
    own)."""
    if text.lstrip().startswith("{"):
        value = json_object(text, '{"name": "sql", "path": "/adapters/sql"}')
        if unknown := sorted(set(value) - {"name", "path", "base_model_name"}):
            raise argparse.ArgumentTypeError(f"unknown keys {', '.join(map(repr, unknown))} (known: name, path, "
                                             f"base_model_name)")
        name, path = value.get("name"), value.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"not NAME=PATH nor a JSON {{\"name\", \"path\"}}: {text!r}")
    path = path.strip()
    try:
        local = Path(path).expanduser()
    except RuntimeError as error:  # ~user of no such user
        raise argparse.ArgumentTypeError(f"{path!r}: {error}") from None
    return name.strip(), path if from_hub(path) else str(local.absolute())


def lora_modules(text: str) -> tuple[tuple[str, str], ...]:
    """$SLUICE_LORA_MODULES: `NAME=PATH` items apart by spaces."""
    return tuple(lora_module(item) for item in text.split())


def _apply_speculative_config(args: argparse.Namespace) -> str | None:
    """Sets the flags `--speculative-config` stands for; why not, if one of them was given another value."""
    for dest, value in (args.speculative_config or {}).items():
        flag = "--" + dest.replace("_", "-")
        if getattr(args, dest) not in (_built_in_default(flag), value):
            return f"--speculative-config sets {flag} {value}, and {flag} {getattr(args, dest)} was given too"
        setattr(args, dest, value)
    return None


def env_name(flag: str) -> str:
    return "SLUICE_" + _dest(flag).upper()


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _option(parser: argparse.ArgumentParser, flag: str, default: Any, help: str, aliases: tuple[str, ...] = (),
            **kwargs: Any) -> None:
    # argparse applies `type` to string defaults, so a malformed environment value fails like a flag would; but it
    # checks `choices` only on the command line, so they are checked by the type too.
    env = env_name(flag)
    _BUILT_IN_DEFAULTS[flag] = default
    if "choices" in kwargs:
        kwargs.setdefault("type", _one_of(kwargs["choices"]))
    if env in os.environ:
        default = os.environ[env]
        if "type" in kwargs:
            kwargs["type"] = _naming_the_variable(kwargs["type"], env, default)
    parser.add_argument(flag, default=default, help=f"{help}{_also(aliases)} [env {env}]", **kwargs)
    for alias in aliases:  # apart, so that an error names the flag given
        parser.add_argument(alias, dest=_dest(flag), default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def _built_in_default(flag: str) -> Any:
    """`flag`'s default before the environment's, also in a process that never built the parser (a --hosts actor,
    given the command's parsed arguments)."""
    if not _BUILT_IN_DEFAULTS:
        add_arguments(argparse.ArgumentParser())
    return _BUILT_IN_DEFAULTS[flag]


def _also(aliases: tuple[str, ...]) -> str:
    return f" (also {', '.join(aliases)}: vLLM's name)" if aliases else ""


def _naming_the_variable(kind: Callable[[str], Any], env: str, value: str) -> Callable[[str], Any]:
    """`kind`, whose refusal of the environment's `value` says it is the variable's: argparse names the flag, which
    the command line may not hold. argparse passes the default itself to the type, so `value` is told by identity."""
    def parse(text: str) -> Any:
        try:
            return kind(text)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
            if text is not value:
                raise
            reason = str(error) if isinstance(error, argparse.ArgumentTypeError) else \
                f"invalid {parse.__name__} value: {text!r}"
            raise argparse.ArgumentTypeError(f"{reason} (set by {env})") from None

    parse.__name__ = getattr(kind, "__name__", repr(kind))  # argparse's "invalid int value" names the type so
    return parse


def _one_of(choices: list[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(map(repr, choices))})")
        return text

    return parse


SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False, "": False}


def _switch(parser: argparse.ArgumentParser, flag: str, help: str, aliases: tuple[str, ...] = ()) -> None:
    """A flag that turns something on, or its environment variable set to one of `SWITCH_VALUES`; any other
    value of it is refused as a flag's bad value is, not taken for off."""
    env = env_name(flag)

    def parse(text: str) -> bool:
        if text.lower() not in SWITCH_VALUES:
            raise argparse.ArgumentTypeError(f"{env}={text!r} is neither on (1, true, yes, on) nor off (0, false, no, "
                                             f"off, or empty)")
        return SWITCH_VALUES[text.lower()]

    parser.add_argument(flag, action=_SwitchAction, type=parse, default=os.environ.get(env, ""),
                        help=f"{help}{_also(aliases)} [env {env}=1]")
    for alias in aliases:
        parser.add_argument(alias, dest=_dest(flag), action=_SwitchAction, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


class _SwitchAction(argparse.Action):
    """store_true that also takes a `type`, which argparse applies to a string default: the environment's value."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`sluice serve`'s flags: the engine's (`add_engine_arguments`) and the server's own, listed together."""
    _add_flags(parser, server=parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that build the engine and shape its answers, without the server's own (HTTP, auth, CORS, dashboard,
    streaming, drain, scale-out): those of a command that runs the engine but serves no HTTP (`sluice run-batch`)."""
    _add_flags(parser, server=argparse.ArgumentParser())  # a parser nothing parses: the server's flags are dropped


def _add_flags(parser: argparse.ArgumentParser, server: argparse.ArgumentParser) -> None:
    """Every flag, in the order --help lists them: the engine's on `parser`, the server's own on `server`."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as --model gives it (vLLM's `vllm serve MODEL`)")
    _option(parser, "--model", None, "a .gguf file, an HF folder, a Hugging Face Hub id (ORG/NAME, or "
            "ORG/NAME-GGUF:QUANT for a GGUF repository's file of that quant type) or a known name (default: "
            "SmolLM2-135M-Instruct, fetched if missing)")
    _option(parser, "--revision", None, REVISION_HELP)
    _option(parser, "--download-dir", None, DOWNLOAD_DIR_HELP)
    _option(parser, "--served-model-name", None, "the name clients pass as `model` (default: the model's name)")
    _option(parser, "--chat-template", None, CHAT_TEMPLATE_HELP, type=chat_template)
    _option(parser, "--hf-overrides", None, HF_OVERRIDES_HELP, type=hf_overrides)
    _option(server, "--host", "127.0.0.1", "address to listen on")
    _option(server, "--port", 8000, "port to listen on", type=port)
    _option(parser, "--dtype", None, DTYPE_HELP, type=dtype_name)
    _option(parser, "--quantization", "auto",
            "weights: none (the dtype), int8 (GGUF Q8_0), int4 (GGUF Q4_1, embedding Q8_0), auto (int4 on a CPU, none on a GPU)",
            choices=list(QUANTIZATIONS))
    _option(parser, "--tp", _ENGINE_DEFAULTS.tp, "tensor-parallel degree (devices)", type=int,
            aliases=("--tensor-parallel-size", "-tp"))
    _option(server, "--coordinator-address", None,
            "multi-process (multi-node) job: host:port where process 0 coordinates; every process passes the same")
    _option(server, "--num-processes", 1, "multi-process job: how many processes (one per node)",
            type=at_least(1, int))
    _option(server, "--process-id", 0, "multi-process job: this process's index; process 0 serves HTTP",
            type=at_least(0, int))
    _option(parser, "--max-model-len", None,
            "longest prompt + completion in tokens (default: min(model's, 4096, what the KV pool holds))", type=int)
    _option(parser, "--max-num-seqs", None, "most sequences in one running batch (default: {} on a CPU, {} on an "
            "accelerator, {} on one of 80 GB or more but an A100)".format(
                CPU_BATCH[0], ACCELERATOR_BATCH[0], LARGE_ACCELERATOR_BATCH[0]), type=int)
    _option(parser, "--max-num-batched-tokens", None, "most tokens (prefill + decode) in one step (default: {}, {}, "
            "{} as for --max-num-seqs)".format(CPU_BATCH[1], ACCELERATOR_BATCH[1], LARGE_ACCELERATOR_BATCH[1]),
            type=int)
    _option(parser, "--num-decode-steps", _ENGINE_DEFAULTS.num_decode_steps,
            "decode steps per device call when every running sequence decodes and none waits", type=int)
    _switch(parser, "--no-async-scheduling",
            "collect each step before scheduling the next (no overlap of host and device work; for comparison)")
    _switch(parser, "--skip-server-warmup",
            "compile each step program when a step first needs it, not before the server is ready (SGLang's flag): "
            "ready in seconds rather than a minute on a cold CPU, but a step that meets a program not yet compiled "
            "waits for it (seconds on a CPU, counted in --step-timeout), with every request in it")
    _option(parser, "--speculative", None, "speculative decoding: 'ngram' (prompt lookup drafts)", choices=["ngram"])
    _option(parser, "--num-speculative-tokens", _ENGINE_DEFAULTS.num_speculative_tokens,
            "with --speculative: most draft tokens per sequence and step", type=int)
    _option(parser, "--spec-ngram-min", _ENGINE_DEFAULTS.spec_ngram_min,
            "with --speculative: shortest suffix matched for drafts", type=int)
    _option(parser, "--spec-ngram-max", _ENGINE_DEFAULTS.spec_ngram_max,
            "with --speculative: longest suffix matched for drafts", type=int)
    _option(parser, "--spec-max-batch-size", _ENGINE_DEFAULTS.spec_max_batch_size,
            "with --speculative: no drafts while more sequences than this decode (their step is compute-bound)",
            type=int)
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        help="vLLM's JSON of the same: {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
                             "\"prompt_lookup_max\": N, \"prompt_lookup_min\": M}")
    _switch(parser, "--enable-lora", "serve LoRA adapters (implied by --lora-modules, --max-loras, --max-lora-rank and "
            "--max-cpu-loras)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=None,
                        metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders, or Hub ids ORG/NAME) served beside the model, each under "
                             "its NAME, which a request gives as its `model`; also JSON {\"name\": ..., \"path\": "
                             "...} as vLLM's [env SLUICE_LORA_MODULES: NAME=PATH items apart by spaces]")
    _option(parser, "--max-loras", None, "LoRA slots on the device, as vLLM's: the most adapters one batch holds; "
            "more adapters are kept in host memory and swapped into a slot no running request uses when a request "
            "needs one; no more slots than --lora-modules adapters without --allow-runtime-lora-updating (reported "
            "as given by vllm:lora_requests_info; default: one per --lora-modules adapter, each in its own "
            "from the start; with --allow-runtime-lora-updating, 1, or one per --lora-modules adapter where they are "
            "more)", type=at_least(1, int))
    _option(parser, "--max-lora-rank", None, "largest LoRA rank served: an adapter of a higher rank is refused "
            "(adapters are padded to the largest one's; with --allow-runtime-lora-updating, to this: default 16)",
            type=at_least(1, int))
    parser.add_argument("--max-cpu-loras", type=at_least(1, int), default=None,
                        help="LoRA adapters whose weights are kept in host memory, as vLLM's: the least recently "
                             "used others' are dropped, and read again from their folder (a Hub id's download) when "
                             "a request needs a slot for one, which delays that step; at least --max-loras (default: "
                             "every adapter served is kept, where vLLM keeps --max-loras)")
    _option(parser, "--kv-cache-memory", None, "KV-cache pool size, e.g. 2G or 512MiB (default: engine's choice)",
            type=byte_size)
    _option(parser, "--gpu-memory-utilization", None,
            "share of each GPU's memory the server may use in all (weights, activations, KV pool), as vLLM's: "
            "jax's allocator gets it (XLA_CLIENT_MEM_FRACTION wins if set) and the KV pool is sized under it; "
            "ignored on a CPU (default: jax's share, 0.75)", type=fraction)
    _option(parser, "--kv-cache-dtype", _ENGINE_DEFAULTS.kv_cache_dtype,
            "K/V storage: auto (the activation dtype) or int8 (a float32 scale per token and head)",
            choices=list(KV_CACHE_DTYPES))
    _option(parser, "--page-size", None, "tokens per KV-cache page (default: {} on a CPU, {} on an accelerator)".format(
        CPU_PAGE_SIZE, ACCELERATOR_PAGE_SIZE), type=int, aliases=("--block-size",))
    _switch(parser, "--disable-prefix-caching", "do not reuse KV pages of shared prompt prefixes",
            aliases=("--no-enable-prefix-caching",))
    parser.add_argument("--enable-prefix-caching", dest="disable_prefix_caching", action="store_false",
                        help="reuse KV pages of shared prompt prefixes (the default; vLLM's switch)")
    _option(parser, "--prefix-cache-dir", None,
            "keep full KV pages past the pool, in host RAM and then as files in DIR, so prefixes survive a restart")
    _option(parser, "--prefix-cache-size", _ENGINE_DEFAULTS.prefix_cache_size,
            "most bytes of KV page files in --prefix-cache-dir (least recently used out first), e.g. 16G",
            type=byte_size)
    _option(parser, "--prefix-cache-ram", _ENGINE_DEFAULTS.prefix_cache_ram,
            "most bytes of KV pages the persistent prefix cache keeps in host RAM, e.g. 1G", type=byte_size)
    _option(parser, "--attention-backend", _ENGINE_DEFAULTS.attention_backend,
            "attention kernels (auto: Mosaic on Hopper GPUs, else Triton; the C++ kernel on a CPU)",
            choices=list(BACKENDS))
    _option(parser, "--layer-loop", _ENGINE_DEFAULTS.layer_loop,
            "how the model runs its layers: a scan over stacked weights, or unrolled over one array per layer "
            "(auto: unrolled on a GPU, where the scan copies each layer's weights every step)",
            choices=list(LAYER_LOOPS))
    _option(parser, "--sampler-branches", _ENGINE_DEFAULTS.sampler_branches,
            "who decides which of the sampler's passes (penalties, sampling, filters, top logprobs) a step runs: "
            "the device, or the host, one compiled sampler per combination (auto: the host on a GPU, where the "
            "device's decisions stall each step)", choices=list(SAMPLER_BRANCHES))
    _option(server, "--max-waiting", _SERVER_DEFAULTS.max_waiting,
            "most sequences waiting for a batch slot; beyond it requests get 429 with Retry-After",
            type=at_least(0, int))
    _option(server, "--api-key", None, "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on all routes but "
            f"{', '.join(sorted(OPEN_PATHS))} and the dashboard's")
    _option(server, "--allowed-origins", _SERVER_DEFAULTS.allowed_origins,
            "CORS: the origins whose pages may call the API, as a JSON list (\"*\": any)", type=string_list)
    _option(server, "--allowed-methods", _SERVER_DEFAULTS.allowed_methods, "CORS: the methods they may use",
            type=string_list)
    _option(server, "--allowed-headers", _SERVER_DEFAULTS.allowed_headers, "CORS: the headers they may send",
            type=string_list)
    _switch(server, "--allow-credentials", "CORS: let those pages send cookies and HTTP authentication")
    _option(server, "--max-body-bytes", _SERVER_DEFAULTS.max_body_bytes, "largest request body (413 beyond)",
            type=positive_byte_size)
    _option(server, "--drain-timeout", 30.0, "seconds SIGTERM waits for requests in flight before exiting",
            type=at_least(0, float))
    _option(server, "--sse-keepalive", _SERVER_DEFAULTS.sse_keepalive_s,
            "seconds between keep-alive comments of a stream that has nothing to send", type=above(0, float))
    _option(server, "--stream-stall-timeout", _SERVER_DEFAULTS.stream_stall_timeout_s,
            "abort a stream whose reader accepts nothing for this many seconds, freeing its KV pages (0: never)",
            type=at_least(0, float))
    _option(parser, "--tool-call-parser", _SERVER_DEFAULTS.tool_call_parser,
            "how tool calls are read (and forced) for a template with tools: auto (the template's own format), hermes "
            "(`<tool_call>{...}</tool_call>`), llama3_json (`{\"name\", \"parameters\"}; ...`), mistral "
            "(`[TOOL_CALLS] [{\"name\", \"arguments\"}, ...]`) or granite (`<|tool_call|>[{\"name\", \"arguments\"}, "
            "...]`)",
            choices=list(TOOL_CALL_PARSERS))
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for reading calls from replies with tool_choice auto, which Sluice always "
                             "does: accepted so that vLLM's command lines run")
    _switch(parser, "--exclude-tools-when-tool-choice-none",
            'leave a request\'s tools out of its prompt when its tool_choice is "none" (by default the model is shown '
            "them, as vLLM's is, and its reply is not read for calls)")
    _option(parser, "--reasoning-parser", _SERVER_DEFAULTS.reasoning_parser,
            "tell a reasoning model's thinking from its answer (chat's `reasoning`, Anthropic's thinking blocks, the "
            "Responses API's reasoning items): deepseek_r1 (the reply starts inside <think>, as R1's template opens "
            "it) or qwen3 (the reply thinks if it starts with <think>) (default: none)",
            choices=list(REASONING_PARSERS))
    _option(parser, "--generation-config", _SERVER_DEFAULTS.generation_config,
            "auto: the sampling fields a request leaves out take the model's own defaults (generation_config.json, "
            "GGUF metadata); vllm: the API's defaults", choices=["auto", "vllm"])
    _option(parser, "--embedding-pooling", _SERVER_DEFAULTS.embedding_pooling,
            "how /v1/embeddings pools an input's final hidden states: last (the last prompt token's, as vLLM pools a "
            "causal LM) or mean (over every prompt token; such requests take no pages from the prefix cache)",
            choices=["last", "mean"])
    _option(server, "--responses-store-size", _SERVER_DEFAULTS.responses_store_size,
            "most responses /v1/responses keeps for GET and previous_response_id (least recently used out first; "
            "0: none)", type=at_least(0, int))
    _option(server, "--responses-store-bytes", _SERVER_DEFAULTS.responses_store_bytes,
            "most bytes of stored responses (their JSON)", type=byte_size)
    _option(server, "--conversations-store-size", _SERVER_DEFAULTS.conversations_store_size,
            "most conversations /v1/conversations keeps (least recently used out first, never one a response runs "
            "on)", type=at_least(1, int))
    _option(server, "--conversations-store-bytes", _SERVER_DEFAULTS.conversations_store_bytes,
            "most bytes of stored conversations (their items' JSON)", type=byte_size)
    _switch(server, "--allow-runtime-lora-updating",
            "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while "
            "serving, kept in host memory and swapped into --max-loras slots of rank --max-lora-rank (implies "
            f"--enable-lora; also vLLM's {RUNTIME_LORA_VARIABLE}=1 or true)")
    _switch(server, "--no-ui", "do not serve the dashboard and playground page (/, /ui) nor its push stream")
    _option(server, "--slo-ttft-ms", None, "time-to-first-token objective, drawn on the dashboard's TTFT chart",
            type=above(0, float))
    _option(server, "--slo-itl-ms", None, "inter-token latency objective, drawn on the dashboard's ITL chart",
            type=above(0, float))
    _option(server, "--peak-gflops", None, "one device's peak matmul rate for the dashboard's roofline "
            "(with --peak-bandwidth-gbs; default: measured at start-up)", type=above(0, float))
    _option(server, "--peak-bandwidth-gbs", None, "one device's peak memory bandwidth for the dashboard's roofline",
            type=above(0, float))
    _option(server, "--hosts", None, "run one engine over this many processes, one per host, as Ray actors (its "
            "--tp split evenly over them; needs Ray Serve: `pip install -e '.[ray]'` in the checkout)", type=int)
    _option(server, "--replicas", None, "serve with this many engine replicas behind one ingress, as a Ray Serve "
            "application (needs Ray Serve: `pip install -e '.[ray]'` in the checkout)", type=int)
    _option(server, "--ray-address", None, "with --replicas or --hosts: join this Ray cluster (default: start a local one)")
    _option(server, "--routing", _SCALE_DEFAULTS.routing,
            "with --replicas: how the ingress picks a replica: prefix (the one that was sent the longest prefix of "
            "the prompt, unless overloaded), round-robin, or pow2 (the less loaded of two random ones)",
            choices=list(ROUTINGS))
    _option(server, "--imbalanced-threshold", None,
            "with --routing prefix: ongoing requests beyond the least loaded replica's that make a prefix's "
            "replica overloaded (its request then goes to the less loaded of two random replicas; default: "
            "--max-num-seqs, a batch)", type=int)
    _option(server, "--max-ongoing-requests", None,
            "with --replicas: most requests a replica is sent at once; more wait at the ingress "
            "(default: twice --max-num-seqs)", type=int)
    _option(server, "--max-replicas", None, "with --replicas: autoscale up to this many replicas on queue depth",
            type=int)
    _option(server, "--min-replicas", None, "with --max-replicas: fewest replicas (default 1)", type=int)
    _option(server, "--target-ongoing-requests", None,
            "with --max-replicas: ongoing (queued or running) requests per replica the autoscaler aims at "
            "(default: --max-num-seqs)", type=float)
    _option(server, "--upscale-delay", _SCALE_DEFAULTS.upscale_delay_s,
            "with --max-replicas: seconds of sustained load before adding a replica",
            type=at_least(0, float))
    _option(server, "--downscale-delay", _SCALE_DEFAULTS.downscale_delay_s,
            "with --max-replicas: seconds of sustained low load before removing a replica (it drains first, "
            "for up to --drain-timeout)", type=at_least(0, float))
    _option(parser, "--step-timeout", _ENGINE_DEFAULTS.step_timeout_s,
            "seconds one engine step may run before it is taken for hung: every request in flight then ends with "
            "an error and the process exits (code 75) for its supervisor to restart it; 0 turns the watchdog off",
            type=at_least(0, float))
    _option(server, "--log-level", "info", "uvicorn log level", choices=["critical", "error", "warning", "info", "debug"],
            aliases=("--uvicorn-log-level",))


def run(args: argparse.Namespace, take_stop: Callable[[Callable[[], bool]], None] | None = None) -> int:
    """`sluice serve`'s exit status. `take_stop` is given, before the model loads, a function that stops process 0
    from any thread as a first signal does (once) and says whether the model was still loading (which then ends the
    process at once): `--hosts`'s actor takes no signal, its driver stops it so (app/ray_hosts.py)."""
    # jax's GPU allocator reads its share once, when its backend starts: nothing before this line has started it.
    if (ignored := claim_gpu_memory(args.gpu_memory_utilization, os.environ)) is not None:
        print(f"sluice serve: {ignored}", file=sys.stderr)
    try:
        engine_config = checked_engine_config(args, ENGINE_TUNING_FLAGS + SCALE_OUT_TUNING_FLAGS)
        engine_config = with_runtime_lora_updating(engine_config, args, os.environ)
    except CommandError as error:
        return _refuse(str(error))
    if args.api_key is not None and not args.api_key.strip():  # a key from an unset shell variable, say
        return _refuse("--api-key is empty, which would serve every client: pass the key clients must send, or "
                       "leave the flag (and SLUICE_API_KEY) out")
    if not args.host.strip():  # from an unset shell variable, say
        return _refuse("--host is empty, which would listen on every interface: pass 0.0.0.0 (or ::) for that, or "
                       "leave the flag (and SLUICE_HOST) out for 127.0.0.1")
    address = args.coordinator_address
    if args.num_processes > 1 and address is not None and re.fullmatch(r"\S+:\d+", address) is None:
        return _refuse(f"--coordinator-address must be host:port (process 0's), got {address!r}")
    settings = server_settings(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    # A path that holds no model is a one-line error now, not once the server (or a local Ray cluster) is up, and a
    # Hub model is downloaded now, or found in the HF cache; the hosts' and a joined cluster's are theirs (each
    # process downloads its own, as vLLM's do).
    if args.model is not None and args.hosts is None and args.ray_address is None:
        try:
            resolve_model(args.model, args.revision, args.download_dir)
        except (ModelNotFound, InvalidModel) as error:
            return _refuse(str(error))
    if args.replicas is not None:
        return _serve_replicas(engine_config, settings, args)
    if args.hosts is not None:
        return _serve_on_hosts(args)
    try:
        initialize_distributed(DistributedConfig(args.coordinator_address, args.num_processes, args.process_id))
    except ValueError as error:
        return _refuse(str(error))
    if args.process_id > 0:
        return _follow(engine_config, args)
    try:
        listener = listening_socket(args.host, args.port)
    except OSError as error:
        return _refuse(f"cannot listen on {args.host}:{args.port}: {error.strerror}")
    with listener:
        return asyncio.run(_serve(engine_config, settings, args, listener, take_stop))


def checked_engine_config(args: argparse.Namespace, tuning_flags: TuningFlags) -> EngineConfig:
    """The engine's configuration the flags give, checked as every command that runs an engine from them checks it
    (`sluice serve`, `sluice run-batch`), the modes of the command's `tuning_flags` among them; CommandError says,
    in one line, why they give none."""
    if args.model_tag is not None:
        if args.model not in (None, os.environ.get(env_name("--model")), args.model_tag):
            raise CommandError(f"the model is given twice, {args.model_tag!r} and --model {args.model!r}: give one")
        args.model = args.model_tag
    if (conflict := _apply_speculative_config(args)) is not None:
        raise CommandError(conflict)
    if (idle := _idle_tuning(args, tuning_flags)) is not None:
        raise CommandError(idle)
    if (cache_error := _jax_cache_error()) is not None:
        raise CommandError(cache_error)
    if args.prefix_cache_dir is not None and (unwritable := _unwritable(args.prefix_cache_dir)) is not None:
        raise CommandError(f"--prefix-cache-dir {args.prefix_cache_dir} {unwritable}")
    if args.lora_modules is None:  # read here, once: a --hosts process is given these arguments, not this environment
        args.lora_modules = list(_lora_modules_from_environment())
    modules = tuple(args.lora_modules)
    # vLLM's --enable-lora, which the flags that give adapters or size their slots imply here.
    enable_lora = (args.enable_lora or bool(modules)
                   or any(value is not None for value in (args.max_loras, args.max_lora_rank, args.max_cpu_loras)))
    if None not in (args.max_cpu_loras, args.max_loras) and args.max_cpu_loras < args.max_loras:  # vLLM's rule
        raise CommandError(f"--max-cpu-loras ({args.max_cpu_loras}) must be >= --max-loras ({args.max_loras})")
    if args.served_model_name is not None and args.served_model_name in dict(modules):
        raise CommandError(f"--lora-modules names an adapter {args.served_model_name!r}, as --served-model-name names "
                           f"the model: a request for it could not be told from one for the model")
    try:
        return EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            chat_template=args.chat_template,
            hf_overrides=args.hf_overrides,
            revision=args.revision,
            download_dir=args.download_dir,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_decode_steps=args.num_decode_steps,
            async_scheduling=not args.no_async_scheduling,
            warmup=not args.skip_server_warmup,
            speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            spec_ngram_min=args.spec_ngram_min,
            spec_ngram_max=args.spec_ngram_max,
            spec_max_batch_size=args.spec_max_batch_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
            page_size=args.page_size,
            enable_prefix_caching=not args.disable_prefix_caching,
            tp=args.tp,
            attention_backend=args.attention_backend,
            layer_loop=args.layer_loop,
            sampler_branches=args.sampler_branches,
            step_timeout_s=args.step_timeout or None,
            prefix_cache_dir=args.prefix_cache_dir,
            prefix_cache_size=args.prefix_cache_size,
            prefix_cache_ram=args.prefix_cache_ram,
            enable_lora=enable_lora,
            lora_modules=modules,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras,
        )
    except ValueError as error:
        raise CommandError(said_by_flag(error)) from None


def with_runtime_lora_updating(config: EngineConfig, args: argparse.Namespace, environ: Mapping[str, str]
                               ) -> EngineConfig:
    """`config` with runtime LoRA updating (and so LoRA) on where --allow-runtime-lora-updating or vLLM's variable,
    read as vLLM reads it ("1" or "true"), asks for it; CommandError where several engine processes would serve, each
    of which every load and unload would have to reach."""
    if not (args.allow_runtime_lora_updating
            or environ.get(RUNTIME_LORA_VARIABLE, "").strip().lower() in ("1", "true")):
        return config
    if args.replicas is not None or args.hosts is not None or args.num_processes > 1:
        raise CommandError("runtime LoRA updating (--allow-runtime-lora-updating, or " + RUNTIME_LORA_VARIABLE
                           + ") serves one engine process: leave out --replicas, --hosts and --num-processes")
    try:
        return replace(config, enable_lora=True, allow_runtime_lora_updating=True)
    except InvalidEngineConfig as error:
        raise CommandError(said_by_flag(error)) from None


def _lora_modules_from_environment() -> tuple[tuple[str, str], ...]:
    try:
        return lora_modules(os.environ.get(env_name("--lora-modules"), ""))
    except argparse.ArgumentTypeError as error:
        raise CommandError(f"{error} (set by {env_name('--lora-modules')})") from None


def answer_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP side's settings that shape its answers, from the flags `add_engine_arguments` adds; the server's
    own at their defaults."""
    return ServerSettings(
        served_model_name=args.served_model_name,
        generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser,
        embedding_pooling=args.embedding_pooling,
    )


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The HTTP side's settings the flags give: those that shape answers and the server's own."""
    return replace(
        answer_settings(args),
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        sse_keepalive_s=args.sse_keepalive,
        stream_stall_timeout_s=args.stream_stall_timeout,
        responses_store_size=args.responses_store_size,
        responses_store_bytes=args.responses_store_bytes,
        conversations_store_size=args.conversations_store_size,
        conversations_store_bytes=args.conversations_store_bytes,
        ui=not args.no_ui,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
    )


def _idle_tuning(args: argparse.Namespace, tuning_flags: TuningFlags) -> str | None:
    """Why a flag set for a mode of `tuning_flags` that is off is refused; None if none is."""
    for mode, switch, on, flags in tuning_flags:
        for flag in flags:
            if not on(args) and getattr(args, _dest(flag)) != _built_in_default(flag):
                return f"{flag} tunes {mode}, which is off: add {switch}"
    return None


def said_by_flag(error: Exception) -> str:
    """An error's message as the command line says it: an engine setting by its flag (`--page-size`)."""
    if isinstance(error, InvalidEngineConfig):
        return f"--{error.setting.replace('_', '-')} {error.problem}"
    return str(error)


def _refuse(message: str) -> int:
    """Input refused before serving: one line on stderr, exit status 2 (as argparse's)."""
    print(f"sluice serve: error: {message}", file=sys.stderr)
    return 2


def _jax_cache_error() -> str | None:
    """Why $SLUICE_JAX_CACHE cannot hold the compiled steps (None: it can, or is unset). JAX would only warn once,
    on its first compile, and then compile every step again at each start."""
    path = os.environ.get("SLUICE_JAX_CACHE")
    if not path or (unwritable := _unwritable(path)) is None:
        return None
    return f"SLUICE_JAX_CACHE={path} {unwritable}"


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be a folder Sluice writes (made if missing), said after its name; None: it can."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        return f"cannot be a folder ({error.strerror}): point it at a folder Sluice may write"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is a folder Sluice may not write: point it at one it may"
    return None


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: an address in use or a host that does not resolve is
    a one-line error now, not uvicorn's exit once loading has begun. Bound as uvicorn binds its own."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _serve_replicas(engine_config: EngineConfig, settings: ServerSettings, args: argparse.Namespace) -> int:
    """`--replicas N`: the Ray Serve application (`app/ray_app.py`), if Ray is installed."""
    if args.num_processes > 1 or args.hosts is not None:
        return _refuse("--replicas takes neither --num-processes nor --hosts")
    try:
        scale = ScaleOutConfig(
            replicas=args.replicas,
            host=args.host,
            port=args.port,
            ray_address=args.ray_address,
            routing=args.routing,
            imbalanced_threshold=args.imbalanced_threshold,
            max_ongoing_requests=args.max_ongoing_requests,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            upscale_delay_s=args.upscale_delay,
            downscale_delay_s=args.downscale_delay,
            graceful_shutdown_timeout_s=args.drain_timeout,
        )
    except ValueError as error:
        return _refuse(str(error))
    try:
        from sluice.app.ray_app import serve_replicas
        from sluice.app.replicas import ReplicaConfig
    except ModuleNotFoundError as error:
        return _ray_missing(error, "--replicas")
    return serve_replicas(ReplicaConfig(engine_config, settings, declared_peaks(args), args.drain_timeout), scale)


def _serve_on_hosts(args: argparse.Namespace) -> int:
    """`--hosts H`: this command as H processes of one multi-process job, started by Ray (`app/ray_hosts.py`)."""
    if args.hosts < 1 or args.tp % args.hosts:
        return _refuse(f"--hosts must be at least 1 and divide --tp ({args.tp}), got {args.hosts}")
    if args.num_processes > 1:
        return _refuse("--hosts starts the processes itself: leave out --num-processes")
    try:
        from sluice.app.ray_hosts import serve_on_hosts
    except ModuleNotFoundError as error:
        return _ray_missing(error, "--hosts")
    return serve_on_hosts(run, args, args.hosts, args.tp // args.hosts)


def _ray_missing(error: ModuleNotFoundError, flag: str) -> int:
    """Says how to install Ray when Ray is what is missing; any other missing module is a bug, raised."""
    if error.name is None or error.name.split(".")[0] != "ray":
        raise error
    return _refuse(f"{flag} needs Ray Serve: pip install -e '.[ray]' in Sluice's checkout")


def _follow(engine_config: EngineConfig, args: argparse.Namespace) -> int:
    """A process other than 0: loads its shards, then runs the steps process 0 schedules until it stops."""
    try:
        engine = Engine.create(engine_config, progress=False)
    except (InvalidEngineConfig, InvalidTensorParallelism) as error:
        return _refuse(said_by_flag(error))
    print(f"Sluice process {args.process_id} of {args.num_processes}: running process 0's steps", flush=True)
    engine.follow()
    return 0


async def _serve(engine_config: EngineConfig, settings: ServerSettings, args: argparse.Namespace,
                 listener: socket.socket, take_stop: Callable[[Callable[[], bool]], None] | None) -> int:
    state = ServerState(settings)
    config = uvicorn.Config(
        create_app(state, lora_admin=engine_config.allow_runtime_lora_updating),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = DrainingServer(config, state, drain_timeout_s=args.drain_timeout)
    if take_stop is not None:
        loop = asyncio.get_running_loop()

        def stop() -> bool:
            loop.call_soon_threadsafe(server.begin_drain)
            return state.engine is None

        take_stop(stop)
    serving = asyncio.ensure_future(server.serve([listener]))
    port = listener.getsockname()[1]
    print(f"Sluice is listening on {http_url(args.host, port)} (/health: 503 until the model is ready)", flush=True)
    loading = _in_daemon_thread(lambda: load_engine(engine_config, settings.ui, declared_peaks(args)))
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # stopped (a signal) before the model was ready
        await serving
        _exit_now(0)
    if loading.exception() is not None:
        server.should_exit = True
        await serving
        if isinstance(loading.exception(),
                      (InvalidModel, ModelNotFound, InvalidEngineConfig, InvalidTensorParallelism)):  # input
            return _refuse(said_by_flag(loading.exception()))
        logger.error("Could not start the engine: %s", loading.exception())
        return 1
    engine, peaks = loading.result()
    await engine.start()
    state.set_engine(engine, peaks)
    if engine.generation_defaults and settings.generation_config == "auto":
        defaults = ", ".join(f"{name}={value}" for name, value in engine.generation_defaults.items())
        print(f"The model's sampling defaults, for the fields a request leaves out: {defaults} "
              f"(--generation-config vllm: the APIs' own)", flush=True)
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"Sluice is ready: {http_url(args.host, port)}/v1 serving '{state.model_name}'", flush=True)
    await serving
    return 0


def declared_peaks(args: argparse.Namespace) -> Peaks | None:
    """One device's peaks as `--peak-gflops` and `--peak-bandwidth-gbs` declare them (both, or none)."""
    if args.peak_gflops is None or args.peak_bandwidth_gbs is None:
        return None
    return Peaks(args.peak_bandwidth_gbs, args.peak_gflops, "declared")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of closing the socket at once.

    While draining, the listening socket stays open so that new requests get a clear 503 (and /health
    turns 503 for load balancers), in-flight requests run to completion for up to `drain_timeout_s`,
    and then uvicorn's own shutdown runs (the app's lifespan stops the engine). A second signal exits
    at once. The signal is not re-raised afterwards, so a drained process exits with status 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._state.draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._state.draining
            return
        self._state.begin_drain()
        # A signal handler runs between two bytecodes of the loop's thread; hand over to the loop.
        self._loop.call_soon_threadsafe(self._start_drain)

    def begin_drain(self) -> None:
        """What a first signal does, on the loop; nothing once a signal or an earlier call has begun the drain."""
        if not self._state.draining:
            self._state.begin_drain()
            self._start_drain()

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("Draining: new requests get 503; waiting up to %.0f s for requests in flight", self._drain_timeout_s)
        # Past the timeout the drain aborts what is left: each then answers its abort (a 503, a stream's error
        # event) in uvicorn's graceful shutdown, which otherwise cancels it there: a 500, or a stream cut short.
        if not await self._state.drain(self._drain_timeout_s):
            logger.warning("Drain timeout: aborted the requests still in flight")
        self.should_exit = True


def _exit_now(code: int) -> NoReturn:
    """Ends the process without finalizing the interpreter, for a server stopped while its load thread is still
    in XLA's C++: finalizing would end that thread inside a C++ call, which aborts the process (glibc's "FATAL:
    exception not rethrown", SIGABRT) instead of exiting with `code`."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Runs `fn` in a daemon thread: a server told to stop mid-load must not wait for the load to end."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result = fn()
        except BaseException as error:  # delivered to the awaiting coroutine, not lost in the thread
            loop.call_soon_threadsafe(settle, None, error)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="sluice-engine-load", daemon=True).start()
    return future


def main() -> int:
    parser = OneLineErrors(prog="sluice serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
