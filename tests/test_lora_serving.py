"""LoRA adapters served as vLLM serves them (`--lora-modules NAME=PATH`, a request's `model` naming its adapter),
checked against HF transformers + PEFT: tests/data/tiny_lora holds two PEFT adapters of tests/data/tiny_llama3 and
what PEFT computes with each (tests/reference/make_lora_golden.py), tiny_llama3/golden.json what the base computes.
The engine serves the base and both adapters in one batch, keeps the prefix cache apart per adapter, and the HTTP
side names them (`model`, `/v1/models`); the flags refuse what they cannot serve in one line."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from golden_checks import (assert_completion_gives_case, copy_with_tokenizer, golden_engine, golden_params,
                           home)  # noqa: F401 (home: a fixture)
from sluice.app.cli import main
from sluice.app.serve import (ENGINE_TUNING_FLAGS, add_arguments, checked_engine_config, lora_module,
                              lora_modules)
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.config import EngineConfig, InvalidEngineConfig
from sluice.batching.engine import Engine
from sluice.batching.kv_store import KVLayout
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import CacheNamespace, LoraRequest, RequestRejected, SamplingParams
from sluice.model.loader import LoadedModel, load_model

DATA = Path(__file__).parent / "data"
BASE = json.loads((DATA / "tiny_llama3" / "golden.json").read_text())
LORA = json.loads((DATA / "tiny_lora" / "golden.json").read_text())
ADAPTERS = LORA["adapters"]
VOCAB = 320  # tiny_llama3's
MODULES = tuple((name, str(DATA / "tiny_lora" / adapter["folder"])) for name, adapter in ADAPTERS.items())


def case_named(cases: list[dict], name: str) -> dict:
    return next(case for case in cases if case["name"] == name)


@pytest.fixture(scope="module")
def folder(home, tmp_path_factory) -> Path:
    return copy_with_tokenizer(DATA / "tiny_llama3", tmp_path_factory.mktemp("model"), VOCAB)


def fresh(folder: Path) -> LoadedModel:
    """The base model, as no engine has given it adapters yet."""
    return load_model(str(folder), dtype="float32")


@pytest.mark.parametrize("options", [
    {"max_loras": 1},  # one slot, the adapters swapped into it (tests/test_lora_swap.py)
    {"speculative": "ngram", "max_loras": 3, "max_lora_rank": 16},  # drafts verified under each row's adapter
    {"async_scheduling": False, "num_decode_steps": 1},
], ids=["one-slot", "speculative", "one-step"])
def test_the_base_and_each_adapter_give_their_hf_goldens_in_one_batch(folder, options):
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, **options)
    runs = [(case, None) for case in BASE["cases"]]
    runs += [(case, name) for name, adapter in ADAPTERS.items() for case in adapter["cases"]]
    outputs = engine.generate([case["prompt_ids"] for case, _ in runs],
                              [golden_params(BASE, lora=engine.adapters.get(name)) for _, name in runs])
    for (case, name), [output] in zip(runs, outputs, strict=True):
        assert_completion_gives_case(output, case | {"name": f"{name or 'base'}: {case['name']}"})


def test_an_adapter_reads_no_page_the_base_or_another_adapter_computed_and_its_own_again(folder):
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES)
    prompt = case_named(BASE["cases"], "forty_tokens")["prompt_ids"]
    [[base]] = engine.generate([prompt], golden_params(BASE))
    assert_completion_gives_case(base, case_named(BASE["cases"], "forty_tokens"))
    for name, adapter in ADAPTERS.items():
        for cached in (False, True):
            [[output]] = engine.generate([prompt], golden_params(LORA, lora=engine.adapters[name]))
            assert (output.usage.cached_prompt_tokens > 0) == cached, (name, output.usage)
            assert_completion_gives_case(output, case_named(adapter["cases"], "forty_tokens"))
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages  # cached pages count as free


def test_the_prefix_cache_namespace_is_the_salt_and_the_adapters_content():
    a, b = LoraRequest("a", "f" * 64), LoraRequest("b", "e" * 64)
    namespaces = [SamplingParams(cache_salt=salt, lora=lora).cache_namespace
                  for salt in (None, "tenant") for lora in (None, a, b)]
    assert namespaces[0] is None and namespaces[3] == CacheNamespace("tenant", None)
    assert len(set(namespaces)) == len(namespaces)
    # An adapter's pages are keyed by its files, not by the name it is served under, as a persistent store outlives
    # the process that named it.
    assert SamplingParams(lora=LoraRequest("renamed", a.fingerprint)).cache_namespace == namespaces[1]
    # A salt, any string a client sends, never names an adapter's pages, in the pool or the persistent store.
    for lora in (a, b):
        mimic = SamplingParams(cache_salt=json.dumps([None, lora.fingerprint])).cache_namespace
        assert mimic != SamplingParams(lora=lora).cache_namespace
        layout = KVLayout(model="m", quantization="none", dtype="float32", kv_dtype="float32", page_size=2,
                          num_layers=1, num_kv_heads=1, head_dim=2)
        assert layout.page_keys([1, 2], namespace=mimic) != layout.page_keys([1, 2], namespace=SamplingParams(
            lora=lora).cache_namespace)


def test_requests_name_their_adapter_as_their_model_and_the_models_list_names_each(folder):
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES)
    case = case_named(ADAPTERS["qv_rslora"]["cases"], "short")
    request = {"prompt": case["prompt_ids"], "max_tokens": LORA["num_new_tokens"], "temperature": 0,
               "ignore_eos": True, "return_token_ids": True}

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.get("/v1/models"), await client.get("/v1/models/qv_rslora"),
                await client.post("/v1/completions", json=request | {"model": "qv_rslora"}),
                await client.post("/v1/completions", json=request | {"model": "tiny"}),
                await client.post("/v1/completions", json=request | {"model": "nonexistent"}),
                await client.get("/metrics")]

    models, card, adapted, base, unknown, metrics = serve(engine, scenario, served_model_name="tiny")
    assert [(m["id"], m["parent"]) for m in models.json()["data"]] == [
        ("tiny", None), ("all_modules", "tiny"), ("qv_rslora", "tiny")]
    assert card.json()["id"] == "qv_rslora" and card.json()["parent"] == "tiny"
    assert adapted.json()["model"] == "qv_rslora"
    assert adapted.json()["choices"][0]["token_ids"] == case["greedy_ids"]
    assert base.json()["model"] == "tiny"
    assert base.json()["choices"][0]["token_ids"] == case_named(BASE["cases"], "short")["greedy_ids"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics.text


def test_the_stats_name_the_adapters_of_the_running_and_the_waiting_sequences(folder):
    """What `vllm:lora_requests_info` shows inference gateways, which send a request where its adapter runs."""
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=3)
    assert (engine.stats.max_loras, engine.stats.lora_running, engine.stats.lora_waiting) == (3, (), ())
    prompt = case_named(BASE["cases"], "short")["prompt_ids"]
    sinks = []
    for i, name in enumerate([None, "qv_rslora", None, None, "all_modules"]):  # 4 run at once, the last waits
        sinks.append(ListCollector(1))
        engine.submit([prompt], golden_params(BASE, lora=engine.adapters.get(name)), sinks[-1], f"r{i}")
    engine.step()
    assert (engine.stats.lora_running, engine.stats.lora_waiting) == (("qv_rslora",), ("all_modules",))
    while engine.has_work:
        engine.step()
    assert (engine.stats.lora_running, engine.stats.lora_waiting) == ((), ())


def serve(engine: Engine, scenario, lora_admin: bool = False, **settings):
    """`scenario(client)` against the app over `engine`, its step loop started; `lora_admin`: `create_app`'s."""

    async def run():
        state = ServerState(ServerSettings(ui=False, **settings))
        state.set_engine(engine)
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state, lora_admin=lora_admin))
            async with httpx.AsyncClient(transport=transport, base_url="http://sluice", timeout=60) as client:
                return await scenario(client)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


@pytest.mark.parametrize(("text", "module"), [
    ("sql=/adapters/sql", ("sql", "/adapters/sql")),
    ("a=/b=c", ("a", "/b=c")),
    ('{"name": "sql", "path": "/adapters/sql", "base_model_name": "org/base"}', ("sql", "/adapters/sql")),
    ("hub=org/sql-lora", ("hub", "org/sql-lora")),  # a Hub id where no such local path is
])
def test_a_lora_module_is_name_equals_path_or_vllms_json(text, module):
    assert lora_module(text) == module


def test_a_relative_lora_path_is_made_absolute_for_a_replica_that_reads_it_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "org" / "sql-lora").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert lora_module("sql=org/sql-lora") == ("sql", str(tmp_path / "org" / "sql-lora"))
    assert lora_module("sql=./missing") == ("sql", str(tmp_path / "missing"))


@pytest.mark.parametrize(("text", "words"), [
    ("sql", "not NAME=PATH"),
    ("=/adapters/sql", "not NAME=PATH"),
    ("sql=", "not NAME=PATH"),
    ('{"name": "sql"}', "not NAME=PATH"),
    ('{"name": "sql", "path": "p", "rank": 8}', "unknown keys 'rank'"),
    ("{not json", "not a JSON object"),
    ("sql=~nosuchuser/adapters/sql", "Could not determine home directory"),
])
def test_a_malformed_lora_module_is_refused_saying_what_it_takes(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        lora_module(text)


def test_the_environment_gives_lora_modules_apart_by_spaces():
    assert lora_modules(" a=/x  b=/y ") == (("a", "/x"), ("b", "/y"))


@pytest.mark.parametrize(("fields", "words"), [
    ({"lora_modules": MODULES}, "lora_modules needs enable_lora"),
    ({"enable_lora": True, "lora_modules": (("a", "/x"), ("a", "/y"))}, "distinct, non-empty names"),
    ({"max_loras": 2}, "max_loras needs enable_lora"),
    ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank must be at least 1"),
])
def test_engine_settings_that_cannot_serve_adapters_are_refused(fields, words):
    with pytest.raises(InvalidEngineConfig, match=words):
        EngineConfig(**fields)


@pytest.mark.parametrize(("args", "words"), [
    (["--lora-modules", "broken={data}/tiny_llama3"], "--lora-modules"),  # a model folder, not an adapter
    (["--lora-modules", "tiny_llama3={data}/tiny_lora/all_modules"], "the model's own name"),
    (["--lora-modules", "a={data}/tiny_lora/all_modules", "--max-lora-rank", "4"], "--lora-modules"),
    (["--served-model-name", "a", "--lora-modules", "a={data}/tiny_lora/all_modules"], "--served-model-name"),
])
def test_an_adapter_that_cannot_be_served_is_a_one_line_error(folder, tmp_path, capsys, args, words):
    (tmp_path / "in.jsonl").write_text("")
    given = [arg.replace("{data}", str(DATA)) for arg in args]
    status = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                   "--model", str(folder), "--quantization", "none", "--max-model-len", "128", "--kv-cache-memory", "1M",
                   *given])
    said = capsys.readouterr().err.strip().splitlines()[-1]  # after the conversion's progress, if it converts
    assert status == 2 and said.startswith("sluice run-batch: error: ") and words in said, said


def test_a_request_for_an_adapter_the_engine_does_not_serve_is_rejected(folder):
    """By its name: a request for a name served runs with the adapter served under it (tests/test_lora_runtime.py)."""
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES[:1])
    with pytest.raises(RequestRejected, match="is not served here"):
        engine.generate([[1, 2, 3]], golden_params(BASE, lora=LoraRequest("qv_rslora", "0" * 64)))


def test_over_int8_weights_a_base_request_gets_the_same_bits_whether_or_not_adapters_share_its_steps(folder):
    """The CPU kernels normalize a projection's input inside: a base request's tokens take that path even in a step
    where other tokens' adapters add their deltas (`llama.with_lora`)."""
    engine = golden_engine(load_model(str(folder), dtype="float32", quantization="int8"), enable_lora=True,
                           lora_modules=MODULES)
    base = case_named(BASE["cases"], "forty_tokens")
    params = golden_params(BASE, cache_salt="alone")  # no page of one run is the other's
    [[alone]] = engine.generate([base["prompt_ids"]], params)
    [[shared], _] = engine.generate([base["prompt_ids"], base["prompt_ids"]],
                                    [replace(params, cache_salt="shared"),
                                     golden_params(LORA, lora=engine.adapters["all_modules"])])
    assert alone.token_ids == shared.token_ids
    assert [entry.top for entry in alone.logprobs] == [entry.top for entry in shared.logprobs]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_over_quantized_weights_an_adapters_request_gets_the_same_bits_whatever_shares_its_steps(folder,
                                                                                               quantization):
    """The CPU kernels quantize each projection's input to int8, so a delta that rounded otherwise in a larger step
    would move later tokens; an adapter's request must get the tokens it gets alone beside three others."""
    engine = golden_engine(load_model(str(folder), dtype="float32", quantization=quantization), enable_lora=True,
                           lora_modules=MODULES)
    case = case_named(ADAPTERS["all_modules"]["cases"], "forty_tokens")
    params = golden_params(LORA, lora=engine.adapters["all_modules"], cache_salt="alone")
    [[alone]] = engine.generate([case["prompt_ids"]], params)
    [[shared], *_] = engine.generate([case["prompt_ids"]] * 4, replace(params, cache_salt="shared"))
    assert alone.token_ids == shared.token_ids
    assert [entry.top for entry in alone.logprobs] == [entry.top for entry in shared.logprobs]


def test_over_int8_weights_tokens_of_different_adapters_in_one_step_each_get_the_bits_they_get_alone(folder):
    """A step of several adapters multiplies every slot's weights (`llama.lora_delta`'s several slots): each
    request's tokens must still be those it gets in steps of its adapter alone."""
    engine = golden_engine(load_model(str(folder), dtype="float32", quantization="int8"), enable_lora=True,
                           lora_modules=MODULES)
    prompts = [case_named(adapter["cases"], "forty_tokens")["prompt_ids"] for adapter in ADAPTERS.values()]
    params = [golden_params(LORA, lora=engine.adapters[name], cache_salt="alone") for name in ADAPTERS]
    alone = [engine.generate([prompt], request)[0][0] for prompt, request in zip(prompts, params)]
    shared = engine.generate(prompts * 2, [replace(request, cache_salt="shared") for request in params * 2])
    for own, (mixed, *_) in zip(alone * 2, shared):
        assert own.token_ids == mixed.token_ids
        assert [entry.top for entry in own.logprobs] == [entry.top for entry in mixed.logprobs]


def test_adapters_from_the_environment_are_kept_in_the_arguments_a_hosts_process_is_given(tmp_path, monkeypatch):
    """`sluice serve --hosts` hands its parsed arguments to a process on each host, whose environment and working
    directory are its own: the adapters the variable gave are read once, into the arguments, as absolute paths."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLUICE_LORA_MODULES", "sql=./adapters/sql")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    config = checked_engine_config(args, ENGINE_TUNING_FLAGS)
    monkeypatch.delenv("SLUICE_LORA_MODULES")
    monkeypatch.chdir(DATA)
    assert config.lora_modules == tuple(args.lora_modules) == (("sql", str(tmp_path / "adapters" / "sql")),)
    assert checked_engine_config(args, ENGINE_TUNING_FLAGS).lora_modules == config.lora_modules
