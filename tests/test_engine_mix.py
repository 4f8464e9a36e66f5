"""A seeded, randomized differential check of the engine under feature mixes, on a tiny random model over SmolLM2's
vocabulary: concurrent requests mixing greedy and seeded sampling, n > 1, stop strings and stop ids, logprobs,
prompt logprobs, structured output, shared prompt prefixes, submitted and aborted at random steps, on engines
that overlap or not, run multi-step calls, draft n-grams, preempt in a small pool or keep a persistent prefix
store. Every choice ends once, within its limits and before any stop string; an idle engine holds no page and no
request; and each greedy or seeded request that was not aborted answers as it does alone on a plain engine."""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, replace

import numpy as np
import pytest
from flax import nnx

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import Increment, TokenLogprob
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from test_speculative import free_verification

PAGE = 4
PLAIN = EngineConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=128, page_size=PAGE, num_decode_steps=1,
                     async_scheduling=False, enable_prefix_caching=False, warmup=False, step_timeout_s=None)
REGEX = r"(ab|cd|ef)+\."
SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}'
STOP_STRINGS = ("e", "in", "s ", "ab", "\n", "er")
# A few tokens some requests are limited to (allowed_token_ids): "a", "b", "e", "s", " ", "in", "er", "\n". Their
# outputs repeat themselves, so n-gram drafts are accepted, stop strings and stop ids met.
ALPHABET = (81, 82, 85, 99, 216, 254, 259, 198)
# Each mix: (its name, the engine's settings over PLAIN, KV pages in the pool).
MIXES = {
    "overlap-small-pool": (dict(async_scheduling=True, enable_prefix_caching=True), 24),
    "multi-step-small-pool": (dict(num_decode_steps=4, enable_prefix_caching=True), 24),
    "ngram": (dict(speculative="ngram", enable_prefix_caching=True, spec_max_batch_size=8), 40),
    # A persistent prefix store, and one request's logits turned NaN at the 15th step (`batching/faults.py`): it
    # alone ends with an error, and its pages leave the prefix cache and the store.
    "store-nan": (dict(async_scheduling=True, num_decode_steps=4, enable_prefix_caching=True, prefix_cache_ram=1 << 14,
                       prefix_cache_size=1 << 24), 24),
}


@pytest.fixture(scope="module")
def tiny(smollm2) -> LoadedModel:
    config = ModelConfig.tiny(vocab_size=smollm2.tokenizer.vocab_size)
    return LoadedModel(config, Llama(config, rngs=nnx.Rngs(3)), smollm2.tokenizer, "tiny")


def pool_bytes(config: ModelConfig, num_pages: int) -> int:
    return num_pages * 2 * config.num_layers * config.num_kv_heads * PAGE * config.head_dim * 4


def make_engine(tiny: LoadedModel, num_pages: int, **overrides) -> Engine:
    return Engine(tiny, replace(PLAIN, kv_cache_memory=pool_bytes(tiny.config, num_pages),
                                max_model_len=min(PLAIN.max_model_len, num_pages * PAGE), **overrides),
                  progress=False)


@pytest.fixture(scope="module")
def plain(tiny) -> Engine:
    """Runs each request alone: the reference."""
    return make_engine(tiny, 256)


@dataclass
class Spec:
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    submit_at: int
    abort_at: int | None

    @property
    def reproducible(self) -> bool:
        return self.params.temperature == 0 or self.params.seed is not None


class Recorder:
    """One request's sink: its increments per choice, checked as they come."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.num_choices = len(spec.prompts) * spec.params.n
        self.parts: list[list[Increment]] = [[] for _ in range(self.num_choices)]
        self.usage = None

    def put(self, increment: Increment) -> None:
        parts = self.parts[increment.choice]
        assert not parts or parts[-1].finish_reason is None, f"{self.spec.request_id}: an increment after its finish"
        parts.append(increment)
        if increment.usage is not None:
            assert self.usage is None, f"{self.spec.request_id}: usage twice"
            self.usage = increment.usage

    def tokens(self, choice: int) -> list[int]:
        return [t for i in self.parts[choice] for t in i.token_ids]

    def text(self, choice: int) -> str:
        return "".join(i.text for i in self.parts[choice])

    def logprobs(self, choice: int) -> list[TokenLogprob]:
        return [lp for i in self.parts[choice] for lp in i.logprobs]

    def where(self, choice: int) -> str:
        return f"{self.spec.request_id} choice {choice} ({self.spec.params})"


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    seeded = 0.5 <= kind < 0.85
    # A seeded request draws from its top 20 tokens: the tiny model's next-token distribution is nearly flat over
    # 49,152 ids, each of mass 2e-5, where logits a rounding apart in another batch (1e-6) move the draw to the
    # next id now and then.
    params = SamplingParams(max_tokens=rng.randrange(1, 41), ignore_eos=rng.random() < 0.7,
                            temperature=0.0 if kind < 0.5 else rng.choice((0.7, 1.0)),
                            seed=rng.randrange(1 << 20) if seeded else None,
                            top_k=20 if seeded else rng.choice((0, 20)), top_p=rng.choice((1.0, 0.9)))
    if rng.random() < 0.25:
        params = replace(params, n=rng.randrange(2, 4))
    if rng.random() < 0.3:
        params = replace(params, stop=tuple(rng.sample(STOP_STRINGS, rng.randrange(1, 3))),
                         include_stop_str_in_output=rng.random() < 0.3)
    if rng.random() < 0.4:
        params = replace(params, allowed_token_ids=tuple(rng.sample(ALPHABET, rng.randrange(2, 6))))
    if rng.random() < 0.3:
        ids = params.allowed_token_ids or ALPHABET
        params = replace(params, stop_token_ids=(rng.choice(ids),))
    if rng.random() < 0.25:
        params = replace(params, logprobs=True, top_logprobs=rng.choice((0, 2)))
    if rng.random() < 0.15:
        params = replace(params, prompt_logprobs=rng.choice((0, 1)))
    if rng.random() < 0.2:
        kind, source = rng.choice((("regex", REGEX), ("json_schema", SCHEMA)))
        params = replace(params, structured=StructuredOutput(kind, source), ignore_eos=False, allowed_token_ids=())
    if rng.random() < 0.15:
        params = replace(params, min_tokens=rng.randrange(0, params.max_tokens + 1))
    if params.min_tokens and params.allowed_token_ids and set(params.stop_token_ids) >= set(params.allowed_token_ids):
        params = replace(params, min_tokens=0)
    if rng.random() < 0.15:
        params = replace(params, presence_penalty=0.5, repetition_penalty=rng.choice((1.0, 1.3)))
    if rng.random() < 0.1:
        params = replace(params, logit_bias=((rng.choice(ALPHABET), 5.0),))
    return replace(params, priority=rng.choice((0, 0, 0, 1, -1)), cache_salt=rng.choice((None, None, None, "tenant")))


def random_specs(rng: random.Random, num_requests: int) -> list[Spec]:
    prefixes = [[rng.randrange(100, 49000) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    specs = []
    for i in range(num_requests):
        prompts = []
        for _ in range(2 if rng.random() < 0.1 else 1):
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompts.append(head + [rng.randrange(100, 49000) for _ in range(rng.randrange(1, 12))])
        params = random_params(rng)
        submit_at = rng.randrange(0, 30)
        abort_at = submit_at + rng.randrange(0, 20) if rng.random() < 0.15 else None
        specs.append(Spec(f"mix-{i}", prompts, params, submit_at, abort_at))
    return specs


def drive(engine: Engine, specs: list[Spec]) -> dict[str, Recorder]:
    """Submits and aborts each request at its step and steps until the engine is idle."""
    recorders = {s.request_id: Recorder(s) for s in specs}
    step = 0
    last = max(max(s.submit_at, s.abort_at or 0) for s in specs)
    while step <= last or engine.has_work:
        for spec in specs:
            if spec.submit_at == step:
                engine.submit(spec.prompts, spec.params, recorders[spec.request_id], spec.request_id)
            if spec.abort_at == step:
                engine.abort(spec.request_id)
        if engine.has_work:
            engine.step()
        step += 1
        assert step < 5000, "the engine never went idle"
    return recorders


def assert_idle(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_used_pages == 0 and not any(bm.ref_counts), "pages left held"
    assert not engine._requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine._unemitted and engine._in_flight is None
    assert engine._num_scoring == engine._num_pooling == 0
    assert sorted(engine.scheduler._free_slots) == list(range(engine.config.max_num_seqs))


def check_choice(recorder: Recorder, choice: int, tokenizer) -> None:
    params, parts, where = recorder.spec.params, recorder.parts[choice], recorder.where(choice)
    assert parts and parts[-1].finish_reason is not None, f"{where}: never finished"
    finish = parts[-1].finish_reason
    assert finish != "error", f"{where}: {parts[-1].error}"
    tokens, text = recorder.tokens(choice), recorder.text(choice)
    assert len(tokens) <= params.max_tokens, where
    if finish == "length":
        assert len(tokens) == params.max_tokens, where
    if params.stop and finish != "abort":
        check_stop_strings(recorder, choice, tokenizer)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {2})
    for j, token in enumerate(tokens[:-1]):
        assert token not in stop_ids or j < params.min_tokens, f"{where}: a stop id before the last token"
    if params.wants_logprobs:
        logprobs = recorder.logprobs(choice)
        assert [lp.token_id for lp in logprobs] == tokens, where
    if params.structured is not None and params.structured.kind == "regex" and finish == "stop" and not params.stop \
            and tokens[-1] not in params.stop_token_ids:
        assert re.fullmatch(REGEX, text), f"{where}: {text!r}"


def check_stop_strings(recorder: Recorder, choice: int, tokenizer) -> None:
    """That a finished choice's text holds none of its request's stop strings, but for the one that ended it where
    include_stop_str_in_output emits it, and any in the text of a stop id that ended it."""
    params, parts, where = recorder.spec.params, recorder.parts[choice], recorder.where(choice)
    tokens, text = recorder.tokens(choice), recorder.text(choice)
    # A stop string wholly within the text of the first min_tokens tokens is emitted and ends nothing.
    held = len(tokenizer.decode(tokens[:params.min_tokens])) if params.min_tokens else 0
    # A stop id comes first, as in vLLM: its text (emitted with include_stop_str_in_output) is not searched.
    stopped_by_id = parts[-1].stop_reason in params.stop_token_ids and tokens[-1] == parts[-1].stop_reason
    searched = text[:len(tokenizer.decode(tokens[:-1]))] if stopped_by_id else text
    found = [i for s in params.stop if (i := searched.find(s, max(0, held - len(s) + 1))) >= 0]
    if params.include_stop_str_in_output and parts[-1].stop_reason in params.stop:
        stop = parts[-1].stop_reason
        assert text.endswith(stop) and min(found) == len(text) - len(stop), where
    else:
        assert not found, f"{where}: a stop string in {text!r}"


class _Tokenizer:
    """Decodes ALPHABET's ids to their texts, as SmolLM2's tokenizer does."""

    TEXTS = dict(zip(ALPHABET, ("a", "b", "e", "s", " ", "in", "er", "\n")))

    def decode(self, ids: list[int]) -> str:
        return "".join(self.TEXTS[i] for i in ids)


@pytest.mark.parametrize(("emitted", "caught"), [(("a", "b"), False), (("a", "e", "b"), True)],
                         ids=["before-it-none", "before-it-one"])
def test_the_stop_string_check_leaves_out_the_text_of_a_final_stop_id_only(emitted, caught):
    """A stop id comes first and its text, emitted with include_stop_str_in_output, is not searched for stop strings
    ("er" holds "e"); the text before it is."""
    texts = {text: token for token, text in _Tokenizer.TEXTS.items()}
    params = SamplingParams(max_tokens=8, stop=("e",), stop_token_ids=(texts["er"],), include_stop_str_in_output=True)
    recorder = Recorder(Spec("hand-built", [[5, 6]], params, 0, None))
    recorder.put(Increment(0, "".join(emitted), tuple(texts[text] for text in emitted)))
    recorder.put(Increment(0, "er", (texts["er"],), finish_reason="stop", stop_reason=texts["er"]))
    if caught:
        with pytest.raises(AssertionError, match="a stop string in 'aeber'"):
            check_stop_strings(recorder, 0, _Tokenizer())
    else:
        check_stop_strings(recorder, 0, _Tokenizer())


def check_against_alone(recorder: Recorder, alone: Recorder) -> None:
    for choice in range(recorder.num_choices):
        where = recorder.where(choice)
        assert recorder.tokens(choice) == alone.tokens(choice), where
        assert recorder.text(choice) == alone.text(choice), where
        assert recorder.parts[choice][-1].finish_reason == alone.parts[choice][-1].finish_reason, where
        np.testing.assert_allclose([lp.logprob for lp in recorder.logprobs(choice)],
                                   [lp.logprob for lp in alone.logprobs(choice)], atol=1e-4, err_msg=where)
        mixed, single = recorder.parts[choice][0].prompt_logprobs, alone.parts[choice][0].prompt_logprobs
        assert (mixed is None) == (single is None), where
        if mixed is not None:
            np.testing.assert_allclose([lp.logprob for lp in mixed[1:]], [lp.logprob for lp in single[1:]],
                                       atol=1e-4, err_msg=where)
    assert recorder.usage.completion_tokens == alone.usage.completion_tokens
    assert recorder.usage.prompt_tokens == alone.usage.prompt_tokens


def hunt(tiny, plain, mix: str, seed: int, num_requests: int, tmp_path, monkeypatch) -> None:
    settings, num_pages = MIXES[mix]
    if "prefix_cache_ram" in settings:
        settings = dict(settings, prefix_cache_dir=str(tmp_path))
    with monkeypatch.context() as patch:
        if mix.endswith("-nan"):
            patch.setenv("SLUICE_FAULT", "nan@15")
        engine = make_engine(tiny, num_pages, **settings)
    if engine.speculator is not None:
        free_verification(engine)
    rng = random.Random(seed)
    specs = random_specs(rng, num_requests)
    recorders = drive(engine, specs)
    assert_idle(engine)
    # A NaN may strike any choice of a request, the first of an n > 1 request's included after it finished.
    failed = [r for r in recorders.values() if any(part[-1].finish_reason == "error" for part in r.parts)]
    assert len(failed) <= mix.endswith("-nan")
    assert all("not finite" in part[-1].error for r in failed for part in r.parts if part[-1].finish_reason == "error")
    for recorder in recorders.values():
        if recorder in failed:
            continue
        for choice in range(recorder.num_choices):
            check_choice(recorder, choice, tiny.tokenizer)
        spec = recorder.spec
        aborted = any(p[-1].finish_reason == "abort" for p in recorder.parts)
        if spec.reproducible and not aborted:
            alone_spec = replace(spec, submit_at=0, abort_at=None)
            check_against_alone(recorder, drive(plain, [alone_spec])[spec.request_id])
    if engine.prefix_store is not None:
        engine.close_store()


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_random_mix_of_requests_ends_each_once_leaks_nothing_and_answers_as_alone(tiny, plain, mix, tmp_path,
                                                                                    monkeypatch):
    seeds = int(os.environ.get("SLUICE_MIX_SEEDS", "1"))
    for seed in range(seeds):
        hunt(tiny, plain, mix, seed, int(os.environ.get("SLUICE_MIX_REQUESTS", "16")), tmp_path / str(seed),
             monkeypatch)


@pytest.mark.parametrize("held", [dict(min_tokens=25), dict(ignore_eos=True)], ids=["min-tokens", "ignore-eos"])
@pytest.mark.parametrize("logprobs", [False, True], ids=["", "logprobs"])
def test_a_grammar_complete_before_min_tokens_or_with_eos_ignored_ends_with_its_eos(plain, held, logprobs):
    """`(ab|cd)(e|f)` is complete after two tokens and then allows nothing but EOS, which ends the output as it
    does where nothing holds EOS back (min_tokens banned it: every logit -inf, and the request failed on
    non-finite logits; ignored, EOS was sampled again and again up to max_tokens)."""
    grammar = SamplingParams(temperature=0.0, max_tokens=30, logprobs=logprobs,
                             structured=StructuredOutput("regex", "(ab|cd)(e|f)"))
    [[free]] = plain.generate([[5, 6, 7]], grammar)
    [[held_back]] = plain.generate([[5, 6, 7]], replace(grammar, **held))
    assert free.finish_reason == "stop" and free.token_ids[-1] in plain.limits.eos_token_ids
    assert (held_back.text, held_back.token_ids, held_back.finish_reason) == (free.text, free.token_ids, "stop")
    assert len(held_back.logprobs) == len(free.logprobs)
