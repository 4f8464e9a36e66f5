"""vLLM's runtime LoRA updating (`--allow-runtime-lora-updating`, VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters loaded
(`POST /v1/load_lora_adapter`) and unloaded (`POST /v1/unload_lora_adapter`) while serving, into slots held from the
start, checked against the PEFT goldens of tests/data/tiny_lora as the adapters given at start-up are
(tests/test_lora_serving.py). One engine serves the module: two slots of rank 8 (the tiny adapters' largest; the
other, of rank 4, is padded), each test finding it with no adapter loaded and leaving it so."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import threading

import httpx
import pytest

from golden_checks import assert_completion_gives_case, golden_engine, golden_params, home  # noqa: F401 (a fixture)
from test_lora_serving import ADAPTERS, BASE, DATA, LORA, case_named, folder, fresh, serve  # noqa: F401 (a fixture)
from sluice.app.cli import main
from sluice.app.state import ServerState
from sluice.app.serve import ENGINE_TUNING_FLAGS, add_arguments, checked_engine_config, with_runtime_lora_updating
from sluice.batching.config import InvalidEngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import RequestRejected
from sluice.model.lora import WEIGHTS_FILE, LoraError, load_adapter

FOLDERS = {name: str(DATA / "tiny_lora" / adapter["folder"]) for name, adapter in ADAPTERS.items()}
A_FILE = f"{FOLDERS['all_modules']}/{WEIGHTS_FILE}"
"""An adapter's weights file: a path that names a file, not the PEFT folder a lora_path wants."""
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def shared(folder) -> Engine:
    return golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_loras=2,
                         max_lora_rank=8)


@pytest.fixture
def engine(shared: Engine) -> Engine:
    """The module's engine, left as the test found it: its requests run to their end, its adapters unloaded."""
    yield shared
    while shared.has_work:
        shared.step()
    for name in list(shared.adapters):
        shared.unload_lora(name)
    shared.step()


def load(name: str, adapter: str, **fields) -> dict:
    """A load request's body for the tiny adapter `adapter` (a key of ADAPTERS) under `name`."""
    return {"lora_name": name, "lora_path": FOLDERS[adapter], **fields}


def completion(model: str, case: dict) -> dict:
    return {"model": model, "prompt": case["prompt_ids"], "max_tokens": LORA["num_new_tokens"], "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def load_offline(engine: Engine, name: str, adapter: str):
    """Loads tiny adapter `adapter` as `name` into an engine whose loop is not started; what its requests carry."""
    written = engine.load_lora(name, FOLDERS[adapter])
    engine.step()  # the engine thread's part, between two steps
    return written.result()


def test_adapters_loaded_at_runtime_give_pefts_goldens_as_adapters_given_at_start_up_do(engine):
    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.get("/metrics"),
                *[await client.post(LOAD, json=load(f"runtime_{name}", name)) for name in ADAPTERS],
                await client.get("/v1/models"), await client.get("/metrics")]

    before, *loaded, models, after = serve(engine, scenario, lora_admin=True, served_model_name="tiny")
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in before.text
    for response, name in zip(loaded, ADAPTERS, strict=True):
        assert response.status_code == 200, response.text
        assert response.text == f"Success: LoRA adapter 'runtime_{name}' added successfully."
    assert [(m["id"], m["parent"]) for m in models.json()["data"]] == [
        ("tiny", None), *[(f"runtime_{name}", "tiny") for name in ADAPTERS]]
    assert 'max_lora="2"' in after.text
    runs = [(case, None) for case in BASE["cases"]]
    runs += [(case, f"runtime_{name}") for name, adapter in ADAPTERS.items() for case in adapter["cases"]]
    outputs = engine.generate([case["prompt_ids"] for case, _ in runs],
                              [golden_params(BASE, lora=engine.adapters.get(name)) for _, name in runs])
    for (case, name), [output] in zip(runs, outputs, strict=True):
        assert_completion_gives_case(output, case | {"name": f"{name or 'base'}: {case['name']}"})


def test_base_requests_give_the_same_tokens_with_runtime_updating_on_as_without_lora(engine):
    """tiny_llama3's goldens, which an engine without LoRA gives (tests/test_family_golden.py), beside zeroed slots."""
    outputs = engine.generate([case["prompt_ids"] for case in BASE["cases"]], golden_params(BASE))
    for case, [output] in zip(BASE["cases"], outputs, strict=True):
        assert_completion_gives_case(output, case)


def test_health_answers_while_an_adapters_files_are_read(engine, monkeypatch):
    reading, answered = threading.Event(), threading.Event()
    read = engine.load_lora

    def slow_read(name: str, path: str):
        reading.set()
        assert answered.wait(10), "/health did not answer while the adapter was read"
        return read(name, path)

    monkeypatch.setattr(engine, "load_lora", slow_read)

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        loading = asyncio.ensure_future(client.post(LOAD, json=load("sql", "all_modules")))
        await asyncio.to_thread(reading.wait, 10)
        health = await client.get("/health")
        answered.set()
        return [health, await loading]

    health, loaded = serve(engine, scenario, lora_admin=True)
    assert health.status_code == 200 and loaded.status_code == 200


def test_an_unloaded_adapter_is_an_unknown_model_and_unloading_it_again_is_a_404(engine):
    case = case_named(BASE["cases"], "short")

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post(LOAD, json=load("gone", "all_modules")),
                await client.post(UNLOAD, json={"lora_name": "gone", "lora_int_id": 1}),
                await client.post("/v1/completions", json=completion("gone", case)),
                await client.post(UNLOAD, json={"lora_name": "gone"}),
                await client.get("/v1/models")]

    loaded, unloaded, refused, again, models = serve(engine, scenario, lora_admin=True)
    assert loaded.status_code == 200 and unloaded.status_code == 200
    assert unloaded.text == "Success: LoRA adapter 'gone' removed successfully."
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "The lora adapter 'gone' cannot be found."
    assert [m["id"] for m in models.json()["data"]] == [engine.model_name]


def test_a_request_whose_adapter_is_unloaded_once_its_model_was_checked_is_a_404_not_a_run_of_the_base(
        engine, monkeypatch):
    check_model = ServerState.check_model

    def checked_then_unloaded(state: ServerState, requested: str | None) -> None:
        check_model(state, requested)
        if requested == "gone":
            engine.unload_lora("gone").result(timeout=60)

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        loaded = await client.post(LOAD, json=load("gone", "all_modules"))
        monkeypatch.setattr(ServerState, "check_model", checked_then_unloaded)
        return [loaded, await client.post("/v1/completions", json=completion("gone", case_named(BASE["cases"],
                                                                                                  "short")))]

    loaded, refused = serve(engine, scenario, lora_admin=True)
    assert loaded.status_code == 200
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text


def test_a_request_running_when_its_adapter_is_unloaded_finishes_with_it_and_then_frees_its_slot(engine):
    case = case_named(ADAPTERS["all_modules"]["cases"], "forty_tokens")  # 3 prefill steps of 16 tokens, 12 decodes
    sql = load_offline(engine, "sql", "all_modules")
    sink = ListCollector(1)
    engine.submit([case["prompt_ids"]], golden_params(LORA, lora=sql), sink, "running")
    engine.step()
    unloaded = engine.unload_lora("sql")
    engine.step()
    assert unloaded.done() and "sql" not in engine.adapters and engine.stats.lora_running == ("sql",)
    with pytest.raises(RequestRejected, match="not served here"):
        engine.submit([case["prompt_ids"]], golden_params(LORA, lora=sql), ListCollector(1), "late")
    assert engine.loras.slots.users[engine.loras.slots.holders.index(sql)] == 1
    while engine.has_work:
        engine.step()
    [output] = sink.completions()
    assert_completion_gives_case(output, case)
    assert engine.loras.slots.users == [0, 0]
    load_offline(engine, "again", "all_modules")
    [[again]] = engine.generate([case["prompt_ids"]], golden_params(LORA, lora=engine.adapters["again"]))
    assert_completion_gives_case(again, case)


def test_a_request_let_in_before_its_adapter_was_unloaded_is_refused(engine):
    """`submit` checks the adapter against those served in the caller's thread; the engine thread takes the request in
    later, maybe after an unload: then it must not run."""
    sql = load_offline(engine, "sql", "all_modules")
    engine.unload_lora("sql")  # the engine thread takes it in at its next step, before the request
    sink = ListCollector(1)
    engine.submit([[1, 2, 3]], golden_params(LORA, lora=sql), sink, "stale")  # "sql" is still served
    engine.step()
    [output] = sink.completions()
    assert output.finish_reason == "error" and "'sql' was unloaded before the request started" in output.error


def test_a_load_cancelled_before_the_engine_thread_takes_it_serves_nothing_and_running_requests_run_on(engine):
    case = case_named(BASE["cases"], "forty_tokens")
    sink = ListCollector(1)
    engine.submit([case["prompt_ids"]], golden_params(BASE), sink, "running")
    engine.step()
    assert engine.load_lora("sql", FOLDERS["all_modules"]).cancel()  # its caller gone before the next step
    while engine.has_work:
        engine.step()
    [output] = sink.completions()
    assert_completion_gives_case(output, case)
    assert "sql" not in engine.adapters


def test_an_unload_cancelled_before_the_engine_thread_takes_it_leaves_the_adapter_served(engine):
    sql = load_offline(engine, "sql", "all_modules")
    assert engine.unload_lora("sql").cancel()
    engine.step()
    assert engine.adapters == {"sql": sql}


def test_a_command_that_fails_while_the_engine_is_idle_leaves_its_thread_serving(engine, monkeypatch):
    """The step loop's guard covers what it applies from the inbox while idle too: a bug there must not end the
    engine thread, which every later request would wait on."""
    case = case_named(BASE["cases"], "short")
    applied = threading.Event()

    def fail(name: str) -> None:
        applied.set()
        raise RuntimeError("a bug in applying an unload")

    monkeypatch.setattr(engine.loras, "unload", fail)

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        engine.unload_lora("sql")
        await asyncio.to_thread(applied.wait, 10)
        return await asyncio.wait_for(client.post("/v1/completions", json=completion(engine.model_name, case)), 30)

    answered = serve(engine, scenario)
    assert answered.status_code == 200 and answered.json()["choices"][0]["token_ids"] == case["greedy_ids"]


def test_a_load_whose_request_is_cancelled_is_seen_through_before_the_next_update(engine, monkeypatch):
    """uvicorn cancels the requests still open a while into its shutdown; a cancelled load goes on to its end, and
    the next update waits for it (a load of the same name then finds it loaded)."""
    reading, read_on = threading.Event(), threading.Event()
    read = engine.load_lora

    def slow_first_read(name: str, path: str):
        if not reading.is_set():
            reading.set()
            assert read_on.wait(10)
        return read(name, path)

    monkeypatch.setattr(engine, "load_lora", slow_first_read)

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        cancelled = asyncio.ensure_future(client.post(LOAD, json=load("sql", "all_modules")))
        await asyncio.to_thread(reading.wait, 10)
        cancelled.cancel()
        second = asyncio.ensure_future(client.post(LOAD, json=load("sql", "qv_rslora")))
        await asyncio.sleep(0.1)
        read_on.set()
        return await asyncio.wait_for(second, 30)

    second = serve(engine, scenario, lora_admin=True)
    assert second.status_code == 400 and "has already been loaded" in second.json()["error"]["message"]
    assert engine.adapters["sql"].fingerprint == load_adapter("sql", FOLDERS["all_modules"],
                                                              engine.runner.config).fingerprint


def test_a_request_that_named_an_adapter_since_loaded_in_place_runs_with_the_new_one(engine):
    """Its `model` named the adapter (its LoraRequest) before a load_inplace of that name: the name is still served,
    so it runs with the weights now under it, and reads no page the old one computed."""
    old = load_offline(engine, "sql", "all_modules")
    case = case_named(ADAPTERS["qv_rslora"]["cases"], "forty_tokens")
    params = golden_params(LORA, lora=old, cache_salt="in place, named before")
    [[first]] = engine.generate([case["prompt_ids"]], params)
    assert list(first.token_ids) == case_named(ADAPTERS["all_modules"]["cases"], "forty_tokens")["greedy_ids"]
    load_offline(engine, "sql", "qv_rslora")
    [[output]] = engine.generate([case["prompt_ids"]], params)
    assert_completion_gives_case(output, case)
    assert output.usage.cached_prompt_tokens == 0


def test_an_adapter_above_the_slots_rank_is_refused_before_its_weights_are_read(folder, tmp_path):
    """Its adapter_config.json gives its rank: a weights file however large (here, not even safetensors) is not
    read, at start-up nor when loaded at runtime."""
    big = tmp_path / "big"
    shutil.copytree(FOLDERS["all_modules"], big)
    (big / "adapter_model.safetensors").write_bytes(b"not read")
    with pytest.raises(InvalidEngineConfig, match="has rank 8, above the largest served, 4"):
        golden_engine(fresh(folder), enable_lora=True, max_lora_rank=4, lora_modules=(("big", str(big)),))
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_lora_rank=4)
    with pytest.raises(LoraError, match="has rank 8, above the largest served, 4"):
        engine.load_lora("big", str(big))


def test_a_slot_is_written_into_layers_stored_one_array_each(folder):
    """A GPU's default layer loop (`llama.resolve_layer_loop`): each layer's LoRA weights an array of their own."""
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_lora_rank=8,
                           layer_loop="unrolled")
    case = case_named(ADAPTERS["all_modules"]["cases"], "short")
    sql = load_offline(engine, "sql", "all_modules")
    [[output]] = engine.generate([case["prompt_ids"]], golden_params(LORA, lora=sql))
    assert_completion_gives_case(output, case)


def test_an_adapter_of_a_rank_above_the_slots_is_refused_at_start_up_and_when_loaded(folder):
    with pytest.raises(InvalidEngineConfig, match="has rank 8, above the largest served, 4"):
        golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_lora_rank=4,
                      lora_modules=(("sql", FOLDERS["all_modules"]),))
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_lora_rank=4)
    with pytest.raises(LoraError, match="has rank 8, above the largest served, 4"):
        engine.load_lora("sql", FOLDERS["all_modules"])
    assert load_offline(engine, "chat", "qv_rslora") == engine.adapters["chat"]  # rank 4 fits


def test_a_file_given_for_an_adapters_folder_at_start_up_is_refused_saying_so(folder):
    """As a load names it (`test_a_load_sluice_cannot_serve_says_why_in_lora_errors_line`): the command line gives
    InvalidEngineConfig's one line (tests/test_lora_serving.py)."""
    with pytest.raises(InvalidEngineConfig, match="is a file, not a folder: give the PEFT adapter's folder"):
        golden_engine(fresh(folder), enable_lora=True, lora_modules=(("sql", A_FILE),))


def test_more_adapters_than_slots_load_each_kept_in_host_memory_until_a_sequence_needs_one(engine):
    """They are swapped into the slots (tests/test_lora_swap.py)."""
    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post(LOAD, json=load(name, "qv_rslora")) for name in ("a", "b", "c")]

    loaded = serve(engine, scenario, lora_admin=True)
    assert [response.status_code for response in loaded] == [200, 200, 200]
    assert set(engine.adapters) == {"a", "b", "c"}


@pytest.mark.parametrize(("path", "status", "words"), [
    (DATA / "tiny_llama3", 400, "has no adapter_config.json"),  # a model's folder, not an adapter's
    (A_FILE, 400, "is a file, not a folder: give the PEFT adapter's folder"),
    (DATA / "no_such_adapter", 404, "no such folder"),
    (DATA / ("x" * 300), 404, "File name too long"),  # no file system has such a name
    ("~nosuchuser/adapter", 404, "no such folder"),
], ids=["not-an-adapter", "a-file", "no-folder", "name-too-long", "no-such-user"])
def test_a_load_sluice_cannot_serve_says_why_in_lora_errors_line(engine, path, status, words):
    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(LOAD, json={"lora_name": "broken", "lora_path": str(path)})

    refused = serve(engine, scenario, lora_admin=True)
    message = refused.json()["error"]["message"]
    assert refused.status_code == status and message.startswith("LoRA adapter 'broken' (") and words in message
    assert "\n" not in message and "broken" not in engine.adapters


@pytest.mark.parametrize(("body", "message"), [
    ({"lora_name": "", "lora_path": "/adapters/sql"}, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "tiny", "lora_path": FOLDERS["all_modules"]}, "has the served model's name"),
], ids=["empty-name", "the-models-name"])
def test_a_load_without_a_name_of_its_own_is_a_400(engine, body, message):
    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(LOAD, json=body)

    refused = serve(engine, scenario, lora_admin=True, served_model_name="tiny")
    assert refused.status_code == 400 and message in refused.json()["error"]["message"]


def test_loading_a_name_already_loaded_is_a_400(engine):
    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post(LOAD, json=load("sql", "all_modules")),
                await client.post(LOAD, json=load("sql", "qv_rslora"))]

    loaded, refused = serve(engine, scenario, lora_admin=True)
    assert loaded.status_code == 200 and refused.status_code == 400
    assert refused.json()["error"]["message"] == ("The lora adapter 'sql' has already been loaded. If you want to load "
                                                  "the adapter in place, set 'load_inplace' to True.")


def test_load_inplace_replaces_the_adapter_and_its_prefix_cache_namespace(engine):
    case = case_named(ADAPTERS["qv_rslora"]["cases"], "forty_tokens")
    request = completion("sql", case) | {"cache_salt": "in place"}  # no page another test's requests computed

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        first = [await client.post(LOAD, json=load("sql", "all_modules")),
                 await client.post("/v1/completions", json=request)]
        return first + [await client.post(LOAD, json=load("sql", "qv_rslora", load_inplace=True)),
                        await client.post("/v1/completions", json=request), await client.get("/v1/models")]

    loaded, before, replaced, after, models = serve(engine, scenario, lora_admin=True)
    assert loaded.status_code == replaced.status_code == 200
    assert before.json()["choices"][0]["token_ids"] == case_named(ADAPTERS["all_modules"]["cases"],
                                                                  "forty_tokens")["greedy_ids"]
    # The prompt's pages the old adapter computed (a repeat would read 36 of its 40 tokens) are not the new one's.
    assert after.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert after.json()["choices"][0]["token_ids"] == case["greedy_ids"]
    assert [m["id"] for m in models.json()["data"]].count("sql") == 1


def test_the_routes_and_their_openapi_paths_exist_only_with_runtime_updating(engine):
    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post(LOAD, json=load("sql", "all_modules")),
                await client.post(UNLOAD, json={"lora_name": "sql"}), await client.get("/openapi.json")]

    *absent, document = serve(engine, scenario)
    assert [response.status_code for response in absent] == [404, 404] and not engine.adapters
    assert LOAD not in document.json()["paths"]
    document = serve(engine, lambda client: client.get("/openapi.json"), lora_admin=True).json()
    assert document["paths"][LOAD]["post"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}}
    for path, missing in [(LOAD, "Nothing at lora_path"), (UNLOAD, "no adapter loaded of that name")]:
        assert missing in document["paths"][path]["post"]["responses"]["404"]["description"]
    schemas = document["components"]["schemas"]
    assert list(schemas["LoadLoraAdapterRequest"]["properties"]) == ["lora_name", "lora_path", "load_inplace"]
    assert list(schemas["UnloadLoraAdapterRequest"]["properties"]) == ["lora_name", "lora_int_id"]


@pytest.mark.parametrize(("args", "variable"), [
    (["--replicas", "2", "--allow-runtime-lora-updating"], None),
    (["--hosts", "1"], "true"),
    (["--num-processes", "2"], "1"),
], ids=["replicas", "hosts", "processes"])
def test_runtime_updating_over_several_engine_processes_is_a_one_line_error(folder, capsys, monkeypatch, args,
                                                                           variable):
    if variable is not None:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", variable)
    status = main(["serve", "--model", str(folder), *args])
    said = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(said) == 1 and "runtime LoRA updating" in said[0] and "--replicas" in said[0], said


def test_more_start_up_adapters_than_max_loras_slots_are_served_by_swapping():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-loras", "1", "--lora-modules", *[f"{name}={path}" for name, path in
                                                                        FOLDERS.items()]])
    config = with_runtime_lora_updating(checked_engine_config(args, ENGINE_TUNING_FLAGS), args, {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert config.runtime_lora_slots == (1, 16) and len(config.lora_modules) == 2


def test_the_slots_are_at_least_one_per_start_up_adapter_without_max_loras():
    """vLLM's command line `--lora-modules a=... b=...` with runtime updating on, and no --max-loras."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--lora-modules", *[f"{name}={path}" for name, path in FOLDERS.items()]])
    config = with_runtime_lora_updating(checked_engine_config(args, ENGINE_TUNING_FLAGS), args, {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert config.runtime_lora_slots == (2, 16)


@pytest.mark.parametrize(("flag", "variable", "on"), [
    ([], None, False), (["--allow-runtime-lora-updating"], None, True), ([], "True", True), ([], "1", True),
    ([], "0", False), ([], "yes", False),  # vLLM reads "1" and "true" alone
])
def test_vllms_variable_or_the_flag_turns_runtime_updating_and_lora_on(monkeypatch, flag, variable, on):
    environ = {} if variable is None else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": variable}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(flag)
    config = with_runtime_lora_updating(checked_engine_config(args, ENGINE_TUNING_FLAGS), args, environ)
    assert config.allow_runtime_lora_updating == config.enable_lora == on
