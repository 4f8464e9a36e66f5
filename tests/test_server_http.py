"""HTTP edges that hold before any model is loaded: readiness, API key, body limit, error shapes,
SSE framing and disconnects, metrics registries, and the `sluice serve` flags."""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from importlib.metadata import version
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from sluice.batching.sampling_params import LoraRequest
from sluice.batching.stats import EngineStats

from sluice.app.metrics import ServerMetrics
from sluice.app.middleware import InternalErrorMiddleware, RequestIdMiddleware
from sluice.app.serve import add_arguments, byte_size, server_settings
from sluice.app.server import create_app
from sluice.app.streaming import DONE, KEEPALIVE, EventStreamResponse, sse_event
from sluice.app.state import ServerSettings, ServerState

KEY = "s3cret"


def client(**settings) -> TestClient:
    # Without entering the lifespan no engine is ever set: the server is "still loading".
    return TestClient(create_app(ServerState(ServerSettings(**settings))))


def assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_health_is_503_until_the_engine_is_ready():
    assert_openai_error(client().get("/health"), 503)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_generation_routes_are_503_while_loading(path):
    error = assert_openai_error(client().post(path, json={"prompt": "hi"}), 503)
    assert error["code"] == "not_ready"


def test_every_answer_carries_a_request_id_the_clients_own_when_it_is_a_plain_token():
    app = client(api_key=KEY)
    fresh = [app.get("/health").headers["x-request-id"], app.get("/v1/models").headers["x-request-id"]]
    assert len(set(fresh)) == 2 and all(len(request_id) == 32 for request_id in fresh)  # even a 401's
    assert app.get("/health", headers={"X-Request-Id": "trace-42.a:b"}).headers["x-request-id"] == "trace-42.a:b"
    assert app.get("/health", headers={"X-Request-Id": "no spaces"}).headers["x-request-id"] != "no spaces"
    messages = app.post("/v1/messages", json={}, headers={"X-Request-Id": "abc"})
    assert messages.headers["x-request-id"] == messages.headers["request-id"] == "abc"  # Anthropic's header too
    assert "request-id" not in app.get("/health").headers


def test_a_bugs_500_and_its_log_line_name_the_request_id(caplog):
    async def buggy(scope, receive, send):
        raise RuntimeError("a bug")

    app = TestClient(RequestIdMiddleware(InternalErrorMiddleware(buggy)))
    response = app.get("/v1/models", headers={"X-Request-Id": "trace-7"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-7"
    assert "(request id trace-7)" in caplog.text


def test_each_model_card_names_its_root_as_vllms_do():
    # What /v1/models reads of an engine: the model it was given, its adapters' folders.
    engine = SimpleNamespace(model_name="tiny", max_model_len=64, config=SimpleNamespace(model="/models/tiny.gguf"),
                             adapters={"sql": LoraRequest("sql", "f" * 64, "/adapters/sql")})
    state = ServerState(ServerSettings(ui=False))
    state.set_engine(engine)
    app = TestClient(create_app(state))
    cards = app.get("/v1/models").json()["data"]
    assert [(card["id"], card["root"], card["parent"]) for card in cards] == [
        ("tiny", "/models/tiny.gguf", None), ("sql", "/adapters/sql", "tiny")]
    assert app.get("/v1/models/sql").json()["root"] == "/adapters/sql"

def test_missing_api_key_is_401():
    assert_openai_error(client(api_key=KEY).get("/v1/models"), 401)


def test_wrong_api_key_is_401():
    response = client(api_key=KEY).get("/v1/models", headers={"Authorization": "Bearer s3cres"})
    assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


def test_right_api_key_passes_to_the_route():
    response = client(api_key=KEY).get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert_openai_error(response, 503)


def test_a_key_beyond_ascii_matches_as_its_utf8_bytes():
    key = "clé-🔑"
    for header in ("Authorization", "x-api-key"):
        value = (f"Bearer {key}" if header == "Authorization" else key).encode()
        assert_openai_error(client(api_key=key).get("/v1/models", headers={header: value}), 503)


def test_health_and_metrics_need_no_api_key():
    c = client(api_key=KEY)
    assert c.get("/metrics").status_code == 200
    assert c.get("/health").status_code == 503


def test_vllms_ping_and_version_routes_answer_without_the_api_key():
    """/ping is /health by the name vLLM (and SageMaker) probe, GET or POST; /version is the package's."""
    state = ServerState(ServerSettings(api_key=KEY))
    c = TestClient(create_app(state))
    assert c.get("/ping").status_code == c.post("/ping").status_code == 503
    assert c.get("/version").json() == {"version": version("sluice")}
    assert state.metrics.recent.take().errors == []  # a probe's 503 is not an error to list


def test_body_over_the_limit_is_413():
    response = client(max_body_bytes=100).post("/v1/completions", content=b"{" + b" " * 200 + b"}")
    assert assert_openai_error(response, 413)["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413_without_content_length():
    def chunks():
        for _ in range(10):
            yield b" " * 50

    response = client(max_body_bytes=100).post("/v1/completions", content=chunks())
    assert_openai_error(response, 413)


def test_unknown_route_is_an_openai_shaped_404_naming_the_url_as_openai_does():
    assert assert_openai_error(client().get("/v1/nothing"), 404)["message"] == "Invalid URL (GET /v1/nothing)"


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/messages/", "/health/"])
def test_a_trailing_slash_is_an_unknown_route_in_the_requests_shape_not_a_redirect(path):
    """Starlette's redirect to the route without the slash was in no API's shape, and a client that does not
    follow it, or re-POST to it, was left with an empty 307."""
    answer = client().post(path, json={}, follow_redirects=False)
    message = f"Invalid URL (POST {path})"
    if path.startswith("/v1/messages"):
        assert (answer.status_code, answer.json()) == (404, {"type": "error", "error": {"type": "not_found_error",
                                                                                       "message": message}})
    else:
        assert assert_openai_error(answer, 404)["message"] == message


def test_requests_are_counted_by_route_and_status():
    c = client()
    c.get("/health")
    c.get("/v1/nothing")
    text = c.get("/metrics").text
    assert 'sluice_requests_total{route="/health",status="503"} 1.0' in text
    assert 'sluice_requests_total{route="other",status="404"} 1.0' in text


def test_a_route_with_a_path_parameter_is_counted_under_its_template():
    c = client()
    c.get("/v1/responses/resp_123")
    text = c.get("/metrics").text
    assert 'sluice_requests_total{route="/v1/responses/{response_id}",' in text
    assert 'route="other"' not in text


def test_each_app_has_its_own_metrics_registry():
    first, second = client(), client()
    first.get("/health")
    assert 'route="/health"' not in second.get("/metrics").text


def test_gateways_and_dashboards_read_the_metrics_under_vllms_names_with_sluices_values():
    """As vLLM's, each carries the served model's name: its Grafana dashboards select by `model_name`."""
    stats = EngineStats(num_requests_running=3, num_requests_waiting=5, num_seqs_running=4, num_seqs_waiting=6,
                        kv_pages_used=30, kv_pages_total=120, prefix_cache_hit_tokens=700,
                        prefix_cache_query_tokens=1000, num_preemptions=2, prompt_tokens_total=1000,
                        generation_tokens_total=50, num_steps=9, last_step=None)
    metrics = ServerMetrics(lambda: stats, lambda: "smol")
    metrics.first_token(0.2)
    metrics.inter_token(0.01)
    metrics.inter_token(0.03)
    metrics.finished("success", 1.5)
    text = metrics.render().decode()

    def sample(name: str) -> float:
        labels = '{model_name="smol"}' if name.startswith("vllm:") else ""
        return float(re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE).group(1))

    assert sample("vllm:num_requests_running") == sample("sluice_num_requests_running") == 3
    assert sample("vllm:num_requests_waiting") == sample("sluice_num_requests_waiting") == 5
    assert sample("vllm:kv_cache_usage_perc") == sample("sluice_kv_pages_used") / sample("sluice_kv_pages_total")
    assert sample("vllm:prefix_cache_hits_total") == sample("sluice_prefix_cache_hit_tokens_total") == 700
    assert sample("vllm:prefix_cache_queries_total") == sample("sluice_prefix_cache_query_tokens_total") == 1000
    assert sample("vllm:prompt_tokens_total") == sample("sluice_prompt_tokens_total") == 1000
    assert sample("vllm:generation_tokens_total") == sample("sluice_generation_tokens_total") == 50
    assert sample("vllm:num_preemptions_total") == sample("sluice_num_preemptions_total") == 2
    assert sample("vllm:time_to_first_token_seconds_sum") == sample("sluice_time_to_first_token_seconds_sum") == 0.2
    assert sample("vllm:inter_token_latency_seconds_count") == sample("sluice_inter_token_latency_seconds_count") == 2
    assert sample("vllm:e2e_request_latency_seconds_sum") == 1.5


def test_sse_event_frames_json_compactly():
    assert sse_event({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_event_stream_stops_and_closes_when_the_client_disconnects():
    """A client that leaves mid-stream must stop the event generator (that is what aborts the engine
    request) even while the generator waits for its next event."""
    seen: list[str] = []

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(3600)
            yield b"data: never\n\n"
        finally:
            seen.append("generator closed")

    async def on_close() -> None:
        seen.append("on_close")

    async def scenario() -> list[dict]:
        sent: list[dict] = []
        disconnect = asyncio.Event()

        async def receive() -> dict:
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message.get("body") == b"data: 1\n\n":
                disconnect.set()

        await asyncio.wait_for(EventStreamResponse(events(), on_close, keepalive_s=60)({"type": "http"}, receive, send), 5)
        return sent

    sent = asyncio.run(scenario())
    assert seen == ["generator closed", "on_close"]
    assert sent[0]["headers"] and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]


def test_event_stream_runs_on_close_when_the_client_left_before_the_first_event():
    closed: list[bool] = []

    async def events():
        await asyncio.sleep(3600)
        yield b""

    async def on_close() -> None:
        closed.append(True)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    asyncio.run(asyncio.wait_for(EventStreamResponse(events(), on_close, keepalive_s=60)({"type": "http"}, receive, send), 5))
    assert closed == [True]


async def bodies_sent(events, keepalive_s: float) -> list[bytes]:
    """The non-empty bodies an event stream sends to a client that never leaves."""
    sent: list[bytes] = []

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    async def on_close() -> None:
        pass

    await asyncio.wait_for(EventStreamResponse(events, on_close, keepalive_s)({"type": "http"}, receive, send), 5)
    return [body for body in sent if body]


def test_event_stream_sends_keepalive_comments_while_no_event_is_ready_and_loses_no_event():
    async def events():
        await asyncio.sleep(0.3)
        yield b"data: 1\n\n"
        yield DONE

    bodies = asyncio.run(bodies_sent(events(), keepalive_s=0.05))
    assert bodies[-2:] == [b"data: 1\n\n", DONE]
    assert len(bodies) >= 4 and set(bodies[:-2]) == {KEEPALIVE}


def test_no_keepalive_comment_follows_the_last_event_when_its_timer_fires_as_the_events_come():
    async def events():
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.call_later(0.01, ready.set_result, None)
        time.sleep(0.2)  # the loop is held: the keep-alive timer (50 ms) and `ready` fire in one turn
        await ready
        yield b"data: 1\n\n"
        yield DONE

    assert asyncio.run(bodies_sent(events(), keepalive_s=0.05)) == [b"data: 1\n\n", DONE]


def test_event_stream_blocked_in_a_send_past_the_stall_limit_ends_and_reports_the_stall():
    seen: list[str] = []
    unblock = asyncio.Event()

    async def events():
        try:
            while True:
                yield b"data: 1\n\n"
        finally:
            seen.append("generator closed")

    async def on_close() -> None:
        seen.append("on_close")

    async def scenario() -> float:
        sent: list[bytes] = []

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message.get("body", b""))
            if len(sent) == 3:  # the reader stops reading: this send never returns
                await unblock.wait()

        response = EventStreamResponse(events(), on_close, keepalive_s=0.02, stall_timeout_s=0.3,
                                       on_stall=lambda: seen.append("stalled"))
        start = time.monotonic()
        await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
        assert len(sent) == 3, "no keep-alive or event may be sent past a blocked one"
        return time.monotonic() - start

    took = asyncio.run(scenario())
    assert seen == ["stalled", "generator closed", "on_close"]
    assert 0.3 <= took < 2


def test_openapi_document_describes_every_route_and_needs_no_api_key():
    document = client(api_key=KEY).get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].startswith("#/components/schemas/")
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health"} <= set(document["paths"])
    assert document["paths"]["/health"]["get"]["security"] == []
    # A full queue: 429 on OpenAI's routes, Anthropic's 529 on its own.
    assert "429" in chat["responses"] and "529" not in chat["responses"]
    messages = document["paths"]["/v1/messages"]["post"]["responses"]
    assert "529" in messages and "429" not in messages


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_every_serve_flag_is_settable_by_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("SLUICE_API_KEY", "from-env")
    monkeypatch.setenv("SLUICE_KV_CACHE_MEMORY", "2G")
    monkeypatch.setenv("SLUICE_DISABLE_PREFIX_CACHING", "1")
    monkeypatch.setenv("SLUICE_KV_CACHE_DTYPE", "int8")
    args = parse([])
    assert (args.max_num_seqs, args.api_key, args.kv_cache_memory) == (7, "from-env", 2 << 30)
    assert args.kv_cache_dtype == "int8"
    assert args.disable_prefix_caching


@pytest.mark.parametrize(("args", "env", "excluded"), [
    ([], None, False), (["--exclude-tools-when-tool-choice-none"], None, True), ([], "1", True), ([], "off", False)])
def test_exclude_tools_when_tool_choice_none_reaches_the_servers_settings(monkeypatch, args, env, excluded):
    """vLLM's flag: by default a request's tools are rendered with tool_choice "none" too; with it, left out."""
    if env is not None:
        monkeypatch.setenv("SLUICE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", env)
    assert server_settings(parse(args)).exclude_tools_when_tool_choice_none is excluded


def test_a_flag_overrides_its_environment_variable(monkeypatch):
    monkeypatch.setenv("SLUICE_PORT", "9000")
    assert parse(["--port", "9100"]).port == 9100


def test_malformed_environment_value_fails_like_a_malformed_flag(monkeypatch):
    monkeypatch.setenv("SLUICE_MAX_WAITING", "many")
    with pytest.raises(SystemExit):
        parse([])


@pytest.mark.parametrize(("text", "size"), [("4096", 4096), ("2G", 2 << 30), ("512MiB", 512 << 20), ("1kb", 1024)])
def test_byte_sizes_accept_binary_units(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("path", ["/", "/ui", "/ui/", "/ui/app.js", "/ui/style.css", "/ui/vendor/uPlot.iife.min.js"])
def test_the_dashboard_page_and_its_files_need_no_api_key(path):
    response = client(api_key=KEY).get(path)
    assert response.status_code == 200 and response.content


def test_the_page_loads_the_vendored_chart_library_which_ships_with_its_licence():
    c = client()
    page = c.get("/").text
    assert 'src="/ui/vendor/uPlot.iife.min.js"' in page and "http" not in page.split("<body>")[0]  # no CDN
    assert "MIT License" in c.get("/ui/vendor/LICENSE.uPlot").text


def test_the_push_stream_needs_the_api_key():
    assert_openai_error(client(api_key=KEY).get("/dashboard/events"), 401)


def test_the_push_stream_is_an_event_stream_that_ends_when_the_server_drains():
    state = ServerState(ServerSettings(api_key=KEY))
    state.begin_drain()
    response = TestClient(create_app(state)).get("/dashboard/events", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize("path", ["/", "/ui", "/ui/", "/ui/app.js", "/dashboard/events"])
def test_no_ui_serves_neither_the_page_nor_the_push_stream(path):
    assert_openai_error(client(ui=False).get(path), 404)


def test_error_responses_are_listed_for_the_dashboard_with_their_message_but_health_probes_are_not():
    state = ServerState(ServerSettings(api_key=KEY))
    c = TestClient(create_app(state))
    c.get("/v1/models")
    c.get("/health")
    errors = state.metrics.recent.take().errors
    assert [(e.kind, e.status, e.source, e.message) for e in errors] == [
        ("400", 401, "/v1/models", "Missing or incorrect API key")]


def test_dashboard_flags_parse_like_the_others_environment_included(monkeypatch):
    monkeypatch.setenv("SLUICE_NO_UI", "1")
    monkeypatch.setenv("SLUICE_SLO_TTFT_MS", "250")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--slo-itl-ms", "40", "--peak-gflops", "100", "--peak-bandwidth-gbs", "20"])
    assert (args.no_ui, args.slo_ttft_ms, args.slo_itl_ms, args.peak_gflops, args.peak_bandwidth_gbs) == (
        True, 250.0, 40.0, 100.0, 20.0)


PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_page_may_call_the_api_by_default_as_on_vllm():
    """A page of another origin (a web UI on its own port) preflights its POST without the API key, and reads the
    answer, an error's too; vLLM's defaults: any origin, method and header, no credentials."""
    c = client(api_key=KEY)
    preflight = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in preflight.headers
    refused = c.post("/v1/chat/completions", json={}, headers={"Origin": PAGE})
    assert_openai_error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == "*"


def test_cors_flags_limit_the_origins_and_may_allow_credentials():
    args = parse(["--allowed-origins", f'["{PAGE}"]', "--allowed-methods", '["GET", "POST"]', "--allow-credentials"])
    c = client(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
               allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    preflight = c.options("/v1/completions", headers=PREFLIGHT)
    assert (preflight.status_code, preflight.headers["access-control-allow-origin"]) == (200, PAGE)
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://elsewhere.example"}).status_code == 400
    assert c.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}
                     ).status_code == 400
    assert "access-control-allow-origin" not in c.get("/health", headers={"Origin": "https://elsewhere.example"}
                                                      ).headers


@pytest.mark.parametrize("text", ["http://localhost:3000", '"*"', "[1]", "{}"])
def test_a_cors_flag_that_is_no_json_list_of_strings_is_refused(text):
    with pytest.raises(SystemExit):
        parse(["--allowed-origins", text])
