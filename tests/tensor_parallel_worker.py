"""Runs the engine at several --tp values on simulated CPU devices and prints what the TP tests compare (JSON).

A separate process because the device count must be set before jax is imported. Each argument is a run and its
--tp values; one process makes them all, one after another:
    python tests/tensor_parallel_worker.py tiny=1,2,4 tiny-int8=1,2  # the tiny model, and over an int8 KV cache
    python tests/tensor_parallel_worker.py tiny-unrolled=1,2         # its layers unrolled, one array each
    python tests/tensor_parallel_worker.py tiny-drafts=1,2           # drafts checked inside multi-step calls
    python tests/tensor_parallel_worker.py tiny-fine-buckets=1,2     # steps of 512 to 1,000 tokens
    python tests/tensor_parallel_worker.py qwen3=1,2                 # tests/data/tiny_qwen3, converted in SLUICE_HOME
    python tests/tensor_parallel_worker.py smollm2=1,3               # SmolLM2-135M-Instruct through Engine.create
    python tests/tensor_parallel_worker.py smollm2-int4=1,3          # SmolLM2's serving features over int4 weights
    python tests/tensor_parallel_worker.py smollm2-int8=1,3          # ... over int8 weights, an int8 KV pool and drafts
SmolLM2's runs at a --tp above 1 also say what their decode step all-gathers.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from functools import cache  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from hf_folder import write_tokenizer_files  # noqa: E402
from sluice.batching.config import EngineConfig  # noqa: E402
from sluice.batching.device_step import Bucket  # noqa: E402
from sluice.batching.engine import Engine  # noqa: E402
from sluice.batching.model_runner import ModelRunner  # noqa: E402
from sluice.batching.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from sluice.bench.step_audit import compile_decode_step, parse_hlo  # noqa: E402
from sluice.model.config import ModelConfig  # noqa: E402
from sluice.model.fetch import sluice_home  # noqa: E402
from sluice.model.llama import Llama  # noqa: E402
from sluice.model.loader import LoadedModel, load_model  # noqa: E402
from sluice.model.tokenizer import Tokenizer  # noqa: E402
from sluice.sharding.mesh import make_mesh  # noqa: E402
from sluice.sharding.rules import shard_model  # noqa: E402

TINY = ModelConfig.tiny(num_heads=8, num_kv_heads=4, head_dim=16)
ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, kv_cache_memory=1 << 22,
                      num_decode_steps=1, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)
# Four prompts of 450 tokens at a budget of 1,000 tokens a step: the first step takes 1,000 of them (its own bucket,
# the last), the second the other 800 and two decodes (the quarter-octave bucket of 896).
FINE_BUCKETS = replace(ENGINE, max_num_batched_tokens=1000, max_model_len=512)
QWEN3_FOLDER = Path(__file__).with_name("data") / "tiny_qwen3"
# The golden's prompts in one batch as test_qwen3 serves them (the 40-token one prefilled in chunks of 16, pages of 4
# tokens), then decoded 4 steps a call.
QWEN3_ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, page_size=4,
                            kv_cache_memory=1 << 20, num_decode_steps=4, dtype="float32", warmup=False)
# SmolLM2 as `sluice serve --tp N` serves it, but for a step budget of 48 tokens, which splits the longer prompts'
# prefill over several steps, and pages small enough that the second round's shared prefixes hit the cache.
# SmolLM2's three chat prompts (108 tokens) prefilled in one step, then decoded together to their last token: two
# step programs and one sampler to compile at each --tp, where chunks of 32 tokens ran five and three (the features'
# run below chunks its prefill).
SMOLLM2_ENGINE = replace(ENGINE, dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=128)
FEATURES = EngineConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=512, kv_cache_memory=64 << 20,
                        page_size=16, num_decode_steps=4, warmup=False)
FEATURE_CONFIGS = {"smollm2-int4": replace(FEATURES, quantization="int4"),  # the CPU's default weights
                   "smollm2-int8": replace(FEATURES, quantization="int8", kv_cache_dtype="int8", speculative="ngram")}
SYSTEM = ("You are a careful assistant for a library. You answer questions about opening hours, loans, fines and "
          "the catalogue in short sentences, and you say so when you do not know.")
# Copied greedily, so that prompt-lookup drafts are proposed from the first tokens on, and some rejected.
COPY = "Repeat this sentence exactly: The river carried salt, wool and news down to the sea."
# The runs whose decode step the tests audit for all-gathers at a --tp above 1: float32 weights, and int4 weights
# (the CPU's default).
AUDITED_GATHERS = ("smollm2", "smollm2-int4")
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}))


def tiny_engine(loaded: LoadedModel, tp: int, config: EngineConfig) -> Engine:
    mesh = make_mesh(tp) if tp > 1 else None
    if mesh is not None:
        shard_model(loaded.model, mesh)
    return Engine(loaded, config, progress=False, mesh=mesh)


def record_buckets(runner: ModelRunner) -> list[dict]:
    """The compiled shapes `runner` runs from now on (`Bucket`'s fields), in a list it appends to."""
    ran, bucket_for = [], runner.bucket_for

    def recording(*args, **kwargs) -> Bucket:
        bucket = bucket_for(*args, **kwargs)
        ran.append(asdict(bucket))
        return bucket

    runner.bucket_for = recording
    return ran


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict:
    buckets = record_buckets(engine.runner)
    outputs = engine.generate(prompts, params)
    return {
        "tokens": [list(o[0].token_ids) for o in outputs],
        "texts": [o[0].text for o in outputs],
        "logprobs": [[lp.logprob for lp in o[0].logprobs] for o in outputs],
        "prompt_logprobs": [[lp.logprob for lp in o[0].prompt_logprobs[1:]] if o[0].prompt_logprobs else []
                            for o in outputs],
        # The K pool's arrays: one, or an int8 pool's values and scales.
        "kv": [{"global_shape": list(x.shape), "devices": len(x.sharding.device_set),
                "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards})}
               for x in jax.tree.leaves(engine.runner.kv_cache[0])],
        # The stack's shard, or with the layers unstacked the first layer's.
        "wqkv_shard_shape": list(jax.tree.leaves(engine.runner.state["wqkv"])[0].addressable_shards[0].data.shape),
        "accepted_drafts": engine.speculator.counters().num_accepted_tokens if engine.speculator else 0,
        "buckets": buckets,
    }


@cache
def qwen3_folder() -> Path:
    """tests/data/tiny_qwen3 with a tokenizer (the loader needs one; the golden prompts are token ids), in
    SLUICE_HOME, where its conversion goes too."""
    folder = sluice_home() / "tiny_qwen3"
    shutil.copytree(QWEN3_FOLDER, folder, dirs_exist_ok=True)
    config = json.loads((QWEN3_FOLDER / "config.json").read_text())
    write_tokenizer_files(folder, config["vocab_size"])
    return folder


def run_qwen3(tp: int) -> dict:
    """The golden's prompts through the engine as `sluice serve --tp N` builds it."""
    engine = Engine.create(replace(QWEN3_ENGINE, model=str(qwen3_folder()), tp=tp), progress=False)
    golden = json.loads((QWEN3_FOLDER / "golden.json").read_text())
    return run_engine(engine, [case["prompt_ids"] for case in golden["cases"]],
                      replace(GREEDY, max_tokens=golden["num_new_tokens"]))


def chat(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def completion(output) -> dict:
    """A greedy completion's tokens, their logprobs, and how far each beat the runner-up (where a near tie may
    tip another way at another --tp; a token a grammar forced has none)."""
    return {"tokens": list(output.token_ids), "logprobs": [lp.logprob for lp in output.logprobs],
            "margins": [lp.top[0][1] - lp.top[1][1] if len(lp.top) > 1 else math.inf for lp in output.logprobs]}


def run_features(engine: Engine) -> dict:
    """Prompts of mixed lengths in one batch, chunked, one of them copied (drafts accepted and rejected); then prompts
    sharing their prefixes (prefix-cache hits) beside a JSON-schema request. Each greedy completion, the JSON's
    text, the second round's cache hits, the prompts' lengths against the step's token budget, the drafts."""
    tokenizer = engine.tokenizer
    first = [chat(tokenizer, "Hi."), chat(tokenizer, COPY),
             chat(tokenizer, "When does the library open on Sundays?", SYSTEM)]
    second = [chat(tokenizer, "Can I renew a loan twice?", SYSTEM), first[1],
              chat(tokenizer, "Give the largest city of Japan as JSON.")]
    params = replace(GREEDY, max_tokens=16, top_logprobs=2)
    outputs = engine.generate(first, params)
    hits_before = engine.stats.prefix_cache_hit_tokens
    as_long_as_the_json = replace(params, max_tokens=8)  # '{"city": "Tokyo"}': the round ends about when it does
    outputs += engine.generate(second, [as_long_as_the_json, as_long_as_the_json,
                                        replace(params, max_tokens=24, ignore_eos=False, structured=JSON_SCHEMA)])
    drafts = engine.speculator.counters() if engine.speculator else None
    return {"completions": [completion(o[0]) for o in outputs], "json": outputs[-1][0].text,
            "hit_tokens": engine.stats.prefix_cache_hit_tokens - hits_before,
            "prompt_lengths": [len(prompt) for prompt in first + second],
            "step_budget": engine.config.max_num_batched_tokens,
            "accepted_drafts": drafts.num_accepted_tokens if drafts else 0,
            "rejected_drafts": drafts.num_draft_tokens - drafts.num_accepted_tokens if drafts else 0}


def decode_gathers(engine: Engine, rows: int) -> dict:
    """The types of the arrays the compiled decode step for `rows` sequences all-gathers over the mesh."""
    computations = parse_hlo(compile_decode_step(engine.runner, rows).as_text())
    return {"rows": rows, "vocab": engine.runner.config.vocab_size,
            "gathered": [[i.dtype, list(i.dims)] for c in computations.values() for i in c.instrs.values()
                         if i.op == "all-gather"]}


@cache
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's, which the tiny model runs with (its end of sequence, its detokenizer)."""
    return load_model().tokenizer


def tiny_prompts(which: str) -> list[list[int]]:
    """Six random prompts of 3 to 40 tokens, or for the fine buckets' run four of 450."""
    rng = random.Random(0)
    if which == "tiny-fine-buckets":
        return [[rng.randrange(3, 256) for _ in range(450)] for _ in range(4)]
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(6)]


def run(which: str, tp: int) -> dict:
    """One run's results at one --tp."""
    if which in FEATURE_CONFIGS:
        engine = Engine.create(replace(FEATURE_CONFIGS[which], tp=tp), progress=False)
        result = run_features(engine)
    elif which == "qwen3":
        result = run_qwen3(tp)
    elif which == "smollm2":  # as `sluice serve --tp N --quantization none` builds it: float32, HF's answers
        engine = Engine.create(replace(SMOLLM2_ENGINE, tp=tp), progress=False)
        result = run_engine(engine, [chat(engine.tokenizer, q) for q in (
            "What is the capital of France?", "Name three colours.", "Write a haiku about rain.")])
    else:
        config = {"tiny-int8": replace(ENGINE, kv_cache_dtype="int8"),
                  # Drafts proposed and checked inside 4-step calls (no cost seeds without warm-up: drafts look free).
                  "tiny-drafts": replace(ENGINE, speculative="ngram", num_decode_steps=4),
                  "tiny-unrolled": replace(ENGINE, layer_loop="unrolled"),
                  "tiny-fine-buckets": FINE_BUCKETS}.get(which, ENGINE)
        engine = tiny_engine(LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), smollm2_tokenizer(), "tiny"), tp, config)
        # The plain tiny model's prompts are scored too (`prompt_logprobs`): its LM head over every token.
        result = run_engine(engine, tiny_prompts(which),
                            replace(GREEDY, prompt_logprobs=2) if which == "tiny" else GREEDY)
    if which in AUDITED_GATHERS and tp > 1:
        result["decode_gathers"] = decode_gathers(engine, rows=4)
    return result


def main() -> None:
    runs = dict(arg.split("=") for arg in sys.argv[1:])
    results = {which: {tp: run(which, tp) for tp in map(int, tps.split(","))} for which, tps in runs.items()}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
