"""Engine on the real SmolLM2: batched greedy equals the contiguous baseline, prefix caching, stop strings."""

import random
from dataclasses import replace

import numpy as np
import pytest

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams
from sluice.model.generate import sequence_logits
from sluice.model.loader import LoadedModel

pytestmark = pytest.mark.slow

PAGE_SIZE = 16  # so the system prompt below spans whole pages
PAGE_BYTES = 2 * 30 * 3 * PAGE_SIZE * 64 * 4  # SmolLM2 float32
# No warm-up: the tests compile only the step shapes they run, not every bucket of the real model.
CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, kv_cache_memory=160 * PAGE_BYTES,
                      num_decode_steps=1, page_size=PAGE_SIZE, warmup=False)
SYSTEM = (
    "<|im_start|>system\nYou are a helpful assistant named Sluice. You answer questions about geography, "
    "history and science briefly and precisely, in one sentence, without any preamble.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def loaded(smollm2) -> LoadedModel:
    return smollm2


@pytest.fixture(scope="module")
def engine(loaded) -> Engine:
    return Engine(loaded, CONFIG, progress=False)


def chat(loaded: LoadedModel, question: str) -> list[int]:
    return loaded.tokenizer.encode(SYSTEM + f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def greedy_continuation(loaded: LoadedModel, prompt: list[int], tokens: list[int]) -> list[int]:
    """The contiguous baseline's greedy choice after `prompt` and each prefix of `tokens` but the whole, in one
    teacher-forced pass (`sequence_logits`): `tokens` are the greedy ones exactly when this returns them. The pass
    is padded to a power of two, which rows before the padding do not see, so a handful of lengths compile."""
    known = prompt + tokens[:-1]
    padded = known + [0] * ((1 << (len(known) - 1).bit_length()) - len(known))
    logits = np.asarray(sequence_logits(loaded.model, padded))
    return logits[len(prompt) - 1:len(known)].argmax(-1).tolist()


def test_sixteen_mixed_length_requests_batched_equal_the_contiguous_baseline_one_at_a_time(loaded, engine):
    rng = random.Random(0)
    text = loaded.tokenizer.encode(
        "In the beginning the river was small, a thread of water between stones. Over centuries it carved a "
        "valley, fed forests and towns, and carried boats of salt, wool and news down to the sea. " * 3
    )
    prompts = [text[rng.randrange(0, 40):][:rng.randrange(4, 120)] for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert len(out[0].token_ids) == 10
        assert greedy_continuation(loaded, prompt, list(out[0].token_ids)) == list(out[0].token_ids)


def test_prefix_caching_on_and_off_give_identical_tokens_and_the_hit_counter_shows_reuse(loaded, engine):
    questions = ["What is the capital of France?", "Who painted the Mona Lisa?", "What is H2O?",
                 "How far is the Moon?"]
    prompts = [chat(loaded, q) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.stats
    cached = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    after = engine.stats
    uncached_engine = Engine(loaded, replace(CONFIG, enable_prefix_caching=False), progress=False)
    uncached = uncached_engine.generate(prompts[:1], params) + uncached_engine.generate(prompts[1:], params)
    assert [o[0].token_ids for o in cached] == [o[0].token_ids for o in uncached]
    system_pages = len(loaded.tokenizer.encode(SYSTEM)) // CONFIG.page_size
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 3 * system_pages * CONFIG.page_size
    assert uncached_engine.stats.prefix_cache_hit_tokens == 0
    assert cached[1][0].usage.cached_prompt_tokens >= system_pages * CONFIG.page_size


def test_a_one_token_request_leaves_its_prompts_pages_cached_for_the_next(loaded, engine):
    """Its only step computes the prompt and ends it (a cache warm-up's `max_tokens: 1`): the pages that step
    filled are cached before they are freed."""
    prompt = chat(loaded, "Which river flows through Vienna, Budapest and Belgrade?")
    warm, = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    again, = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    full_pages = (len(prompt) - 1) // CONFIG.page_size
    assert again[0].usage.cached_prompt_tokens == full_pages * CONFIG.page_size > warm[0].usage.cached_prompt_tokens


def test_stop_string_across_tokens_ends_generation_before_it(loaded, engine):
    prompt = chat(loaded, "What is the capital of France?")
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0][0]
    pieces = [loaded.tokenizer.decode([t]) for t in free.token_ids]
    k = next(i for i, p in enumerate(pieces[:-1]) if len(p) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-1] + pieces[k + 1][:2]
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(stop)]
    assert stopped.token_ids == free.token_ids[:k + 2]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_prompt_logprobs_are_the_teacher_forced_pass_whatever_the_cache_chunks_and_batch_hold(loaded, engine):
    """Each prompt token's logprob after the tokens before it, in prefill chunks (three prompts in steps of 64
    tokens), with the prompt's cached pages ignored, for both samples of n=2, beside a plain request; against
    the contiguous pass (`sequence_logits`), top alternatives too."""
    prompt = chat(loaded, "Name the largest ocean, the longest river and the highest mountain on Earth, please.")
    assert CONFIG.max_num_batched_tokens < 2 * len(prompt)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))  # its pages now cached
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    scored = replace(plain, prompt_logprobs=3, n=2)
    [alone], [pair, beside] = engine.generate([prompt], plain), engine.generate([prompt, prompt], [scored, plain])
    reference = log_softmax(np.asarray(sequence_logits(loaded.model, prompt)))
    for choice in pair:
        assert choice.token_ids == alone[0].token_ids  # scoring changes no token
        assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) == len(prompt)
        got = np.array([entry.logprob for entry in choice.prompt_logprobs[1:]])
        np.testing.assert_allclose(got, reference[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
        for position in (1, len(prompt) // 2, len(prompt) - 1):
            entry, row = choice.prompt_logprobs[position], reference[position - 1]
            assert [token for token, _ in entry.top] == np.argsort(-row)[:3].tolist()
            own = row[prompt[position]]  # its rank: 1 + the tokens more likely (ties within float32's error)
            assert 1 + np.sum(row > own + 1e-3) <= entry.rank <= 1 + np.sum(row > own - 1e-3)
    assert beside[0].token_ids == alone[0].token_ids and beside[0].prompt_logprobs is None
    assert pair[0].usage.cached_prompt_tokens == 0
    assert engine.stats.kv_pages_used == 0
