"""Runs the engine at several --tp values on simulated CPU devices and prints what the TP tests compare (JSON).

A separate process because the device count must be set before jax is imported:
    python tests/tensor_parallel_worker.py tiny 1 2 4
    python tests/tensor_parallel_worker.py tiny-int8 1 2 4    # the tiny model over an int8 KV cache
    python tests/tensor_parallel_worker.py tiny-unrolled 1 2  # its layers unrolled, one array each
    python tests/tensor_parallel_worker.py smollm2 1 3        # SmolLM2-135M-Instruct through Engine.create
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from sluice.batching.config import EngineConfig  # noqa: E402
from sluice.batching.engine import Engine  # noqa: E402
from sluice.batching.sampling_params import SamplingParams  # noqa: E402
from sluice.model.config import ModelConfig  # noqa: E402
from sluice.model.llama import Llama  # noqa: E402
from sluice.model.loader import LoadedModel, load_model  # noqa: E402
from sluice.sharding.mesh import make_mesh  # noqa: E402
from sluice.sharding.rules import shard_model  # noqa: E402

TINY = ModelConfig.tiny(num_heads=8, num_kv_heads=4, head_dim=16)
ENGINE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, kv_cache_memory=1 << 22,
                      num_decode_steps=1, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True)


def tiny_engine(loaded: LoadedModel, tp: int, config: EngineConfig) -> Engine:
    mesh = make_mesh(tp) if tp > 1 else None
    if mesh is not None:
        shard_model(loaded.model, mesh)
    return Engine(loaded, config, progress=False, mesh=mesh)


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict:
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
    }


def main() -> None:
    which, tps = sys.argv[1], [int(t) for t in sys.argv[2:]]
    config = {"tiny-int8": replace(ENGINE, kv_cache_dtype="int8"),
              # Drafts proposed and checked inside 4-step calls (no cost seeds without warm-up: drafts look free).
              "tiny-drafts": replace(ENGINE, speculative="ngram", num_decode_steps=4),
              "tiny-unrolled": replace(ENGINE, layer_loop="unrolled")}.get(which, ENGINE)
    tokenizer = load_model().tokenizer  # SmolLM2's: its chat prompts, and to detokenize the tiny model's tokens
    results = {}
    for tp in tps:
        if which == "smollm2":  # as `sluice serve --tp N --quantization none` builds it: float32, HF's answers
            engine = Engine.create(replace(config, tp=tp, dtype="float32"), progress=False)
            prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
                       for q in ("What is the capital of France?", "Name three colours.", "Write a haiku about rain.")]
        else:
            engine = tiny_engine(LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), tokenizer, "tiny"), tp, config)
            rng = random.Random(0)
            prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
        # The plain tiny model's prompts are scored too (`prompt_logprobs`): its LM head over every token.
        results[tp] = run_engine(engine, prompts, replace(GREEDY, prompt_logprobs=2) if which == "tiny" else GREEDY)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
