"""End to end: a real `sluice serve` subprocess with the real SmolLM2 model, driven by the official
`openai` client and by raw httpx for SSE framing. One server for the whole module (load + compile is slow)."""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest

from sluice.app.allocator import mimalloc_library
from sluice.app.cli import main as sluice_main
from sluice.bench.compare import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key"
MODEL = "smollm2-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Small limits: warm-up compiles few shapes, and a small KV pool keeps each CPU step cheap.
SERVER_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "256",
                "--kv-cache-memory", "32MiB"]


def _has_ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1 (a container or CI runner may have IPv6 switched off)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log: Path
    health_statuses: list[int]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start_server(*flags: str, startup_timeout_s: float = 900, env: dict[str, str] | None = None,
                 tries: int = 3, until: int = 200) -> ServerProcess:
    """Runs `sluice serve` and waits for /health `until` (200: ready; 503: loading), recording every /health
    status seen on the way. A port
    taken between free_port() and the server's bind (by another test's server or connection: the workers of
    `make test` start servers side by side) is given up for another one."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="sluice-serve-", suffix=".log")[1])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
            cwd=ROOT, env=full_env, stdout=sink, stderr=subprocess.STDOUT,
        )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log, [])
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if tries > 1 and "address already in use" in server.output().lower():
                return start_server(*flags, startup_timeout_s=startup_timeout_s, env=env, tries=tries - 1,
                                    until=until)
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.output()}")
        try:
            status = httpx.get(f"{server.url}/health", timeout=5).status_code
        except httpx.TransportError:
            time.sleep(0.2)
            continue
        server.health_statuses.append(status)
        if status == until:
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {startup_timeout_s} s:\n{server.output()}")


def metric(server_url: str, name: str) -> float:
    """A sample's value; `name` may carry labels: `x_count{outcome="success"}`."""
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def wait_for_metric(server_url: str, name: str, value: float, timeout_s: float = 20) -> float:
    deadline = time.monotonic() + timeout_s
    while (seen := metric(server_url, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return seen


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a raw SSE body, checking the framing on the way (comments are skipped, as SSE
    clients do: the server sends `: keep-alive` while a request waits)."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = [event for event in body.split("\n\n")[:-1] if not event.startswith(":")]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
    return [event[len("data: "):] for event in events]


@pytest.fixture(scope="module")
def server():
    # Started without `make test`'s preload: `sluice serve` preloads mimalloc itself.
    proc = start_server(*SERVER_FLAGS, "--skip-server-warmup", "--api-key", API_KEY, "--served-model-name", MODEL,
                        env={"LD_PRELOAD": ""})
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# --- the openai client ---------------------------------------------------------------------------


@pytest.mark.skipif(mimalloc_library() is None, reason="mimalloc's wheel is Linux-only here")
def test_the_server_process_runs_under_mimalloc(server):
    assert "libmimalloc" in Path(f"/proc/{server.process.pid}/maps").read_text()


def test_chat_answers_the_capital_of_germany(client):
    # The server runs the default quantization (int4 on a CPU, llama.cpp's numbers). A question whose answer
    # holds under it: for "...of France?" the 135M model's first two tokens are 0.08 nats apart in float32 and
    # swap places with int8 activations, in llama.cpp too.
    reply = client.chat.completions.create(
        model=MODEL, messages=chat("What is the capital of Germany?"), temperature=0, max_tokens=20
    )
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == MODEL
    assert "Berlin" in reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def token_ids(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]


def test_logit_bias_bans_the_greedy_token_or_forces_another_and_allowed_token_ids_are_all_it_samples(server, client):
    ids = partial(token_ids, server)
    kwargs = dict(model=MODEL, prompt="The capital of Germany is", max_tokens=1, temperature=0)
    greedy = client.completions.create(**kwargs).choices[0].text
    [greedy_id] = ids(greedy)
    banned = client.completions.create(**kwargs, logit_bias={str(greedy_id): -100}).choices[0].text
    assert banned != greedy
    [blue] = ids(" blue")
    forced = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0.7,
                                       logit_bias={str(blue): 100})
    assert forced.choices[0].text == " blue" * 3
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias={"999999": 1})
    [red] = ids(" red")
    allowed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=1.0, seed=3,
                                        extra_body={"allowed_token_ids": [blue, red]}, logprobs=0)
    assert set(token_ids(server, allowed.choices[0].text)) <= {blue, red}
    assert len(allowed.choices[0].logprobs.tokens) == 6 and set(allowed.choices[0].logprobs.tokens) <= {" blue", " red"}
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids cannot be combined with structured output"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={
            "allowed_token_ids": [blue], "structured_outputs": {"choice": ["a"]}})


def test_a_stop_string_or_id_ends_the_text_and_is_named_as_the_stop_reason(server, client):
    kwargs = dict(model=MODEL, prompt="The capital of Germany is", max_tokens=12, temperature=0)
    free = client.completions.create(**kwargs)
    text = free.choices[0].text
    assert (free.choices[0].finish_reason, free.choices[0].stop_reason) == ("length", None)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.index(stop)
    for include, expected in ((False, text[:cut]), (True, text[:cut + len(stop)])):
        reply = client.completions.create(**kwargs, stop=["never there", stop],
                                          extra_body={"include_stop_str_in_output": include})
        assert (reply.choices[0].text, reply.choices[0].finish_reason, reply.choices[0].stop_reason) == (
            expected, "stop", stop)
    chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True))
    assert [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks if c.choices[0].finish_reason] == [
        ("stop", stop)]
    prompt_ids = token_ids(server, kwargs["prompt"])
    third = token_ids(server, kwargs["prompt"] + text)[len(prompt_ids) + 2]  # the third token of the output
    stopped = client.completions.create(**kwargs, extra_body={"stop_token_ids": [third]}).choices[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", third)


def test_continue_final_message_continues_the_assistants_text_as_the_model_would_have(server, client):
    messages = chat("What is the capital of Germany?")
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    answer = whole.choices[0].message.content
    start = answer[:answer.index(" ", 4)]  # its first words, cut before a space (a token's start)
    opened = [*messages, {"role": "assistant", "content": start}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    reply = client.chat.completions.create(model=MODEL, messages=opened, temperature=0, max_tokens=4,
                                           extra_body=fields)
    assert answer[len(start):].startswith(reply.choices[0].message.content)
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": opened, **fields}, headers=AUTH).json()["count"]
    assert reply.usage.prompt_tokens == counted
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model=MODEL, messages=opened, max_tokens=1,
                                       extra_body={"continue_final_message": True})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client):
    prompt = "The capital of Germany is Berlin. The capital of France is"
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, echo=True)
    cut = client.completions.create(**kwargs, prompt=prompt, extra_body={"truncate_prompt_tokens": 5})
    tail = client.completions.create(**kwargs, prompt=token_ids(server, prompt)[-5:])
    assert cut.usage.prompt_tokens == tail.usage.prompt_tokens == 5
    assert cut.choices[0].text == tail.choices[0].text  # the echo too: the text of the tokens kept
    whole = client.completions.create(**kwargs, prompt=prompt, extra_body={"truncate_prompt_tokens": -1})
    assert whole.choices[0].text.startswith(prompt)


def test_streamed_chat_equals_the_unstreamed_answer(client):
    kwargs = dict(model=MODEL, messages=chat("Name three colors."), temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_with_max_tokens_stops_for_length(client):
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


def test_streamed_completion_equals_the_unstreamed_one(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_prompt_as_token_ids_matches_the_string_prompt(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello, my name is"}, headers=AUTH).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_list_of_prompts_gives_one_choice_per_prompt_times_n(client):
    reply = client.completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.choices[0].text == reply.choices[1].text  # greedy: both samples of a prompt agree
    assert reply.usage.completion_tokens == 16


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server, client):
    """lm-eval's loglikelihood request (token ids, echo, logprobs, max_tokens 1): the prompt's tokens come first,
    the first without a logprob, each scored as the model scores the token after the tokens before it."""
    context = token_ids(server, "The capital of Germany is")
    nexts = client.completions.create(model=MODEL, prompt=context, max_tokens=1, temperature=0, logprobs=5)
    [berlin] = token_ids(server, " Berlin")
    ids = [*context, berlin]
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    reply = client.completions.create(**kwargs)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith("The capital of Germany is Berlin")
    assert len(logprobs.tokens) == len(ids) + 1 and logprobs.text_offset[0] == 0
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[len(context)] == " Berlin"
    expected = nexts.choices[0].logprobs.top_logprobs[0][" Berlin"]
    assert logprobs.token_logprobs[len(context)] == pytest.approx(expected, abs=1e-3)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 1
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [lp for chunk in chunks if chunk.choices[0].logprobs for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed == logprobs.token_logprobs
    assert "".join(chunk.choices[0].text for chunk in chunks) == reply.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_of_no_tokens_scores_the_prompt_alone(server, client, stream):
    """max_tokens 0 with echo (OpenAI's legacy scoring call): the prompt, its logprobs, no token after it; with a
    stop string to hold text back for, too."""
    prompt = "The capital of Germany is Berlin"
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, echo=True, logprobs=1, stop=["zzz"])
    scored = client.completions.create(**kwargs, max_tokens=1).choices[0].logprobs.token_logprobs[:-1]
    if stream:
        chunks = list(client.completions.create(**kwargs, max_tokens=0, stream=True))
        text = "".join(chunk.choices[0].text for chunk in chunks)
        logprobs = [lp for chunk in chunks if chunk.choices[0].logprobs
                    for lp in chunk.choices[0].logprobs.token_logprobs]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kwargs, max_tokens=0).choices[0]
        text, logprobs, finish = choice.text, choice.logprobs.token_logprobs, choice.finish_reason
    assert (text, finish) == (prompt, "length")
    assert logprobs == scored and len(logprobs) == len(token_ids(server, prompt))
    assert wait_for_metric(server.url, "sluice_kv_pages_used", 0) == 0


def test_vllms_prompt_logprobs_rank_each_prompt_token_and_agree_with_the_echoed_logprobs(server, client):
    prompt = "The capital of Germany is Berlin"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120).json()
    scored = reply["choices"][0]["prompt_logprobs"]
    ids = token_ids(server, prompt)
    assert scored[0] is None and len(scored) == len(ids) == reply["usage"]["prompt_tokens"]
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                       logprobs=2).choices[0].logprobs
    for position, (token, entries) in enumerate(zip(ids[1:], scored[1:]), 1):
        mine = entries[str(token)]
        assert mine["logprob"] == pytest.approx(echoed.token_logprobs[position], abs=1e-4)
        # The token, and the two best (the token among them if it is one, keyed once).
        by_rank = {entry["rank"]: entry["logprob"] for entry in entries.values()}
        assert {1, 2} <= by_rank.keys() and len(entries) == (2 if mine["rank"] <= 2 else 3)
        assert by_rank[1] >= by_rank[2] >= (mine["logprob"] if mine["rank"] > 2 else by_rank[2])
    chatted = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": MODEL, "messages": chat("Hi"), "max_tokens": 1, "n": 2, "prompt_logprobs": 0}).json()
    assert len(chatted["prompt_logprobs"]) == chatted["usage"]["prompt_tokens"]
    assert all(len(entries) == 1 for entries in chatted["prompt_logprobs"][1:])


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(server, client):
    ids = token_ids(server, "Hello there")
    named = {"return_tokens_as_token_ids": True}
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                      extra_body=named)
    tokens = reply.choices[0].logprobs.tokens
    assert tokens[:len(ids)] == [f"token_id:{i}" for i in ids] and all(t.startswith("token_id:") for t in tokens)
    assert all(key.startswith("token_id:") for top in reply.choices[0].logprobs.top_logprobs[1:] for key in top)
    chat_reply = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=2, temperature=0,
                                                logprobs=True, top_logprobs=1, extra_body=named)
    [first, _] = chat_reply.choices[0].logprobs.content
    assert first.token.startswith("token_id:") and bytes(first.bytes).decode() == first.token
    assert first.top_logprobs[0].token == first.token  # greedy: the best is the one taken


def test_echo_prepends_the_prompt(client):
    reply = client.completions.create(model=MODEL, prompt="Roses are red,", echo=True, max_tokens=4, temperature=0)
    assert reply.choices[0].text.startswith("Roses are red,")


def test_stop_string_ends_the_text_before_it(client):
    free = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0).choices[0]
    stop = free.text.strip().split(",")[1].strip()  # a number the model is about to write
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


def test_same_seed_gives_the_same_sample(client):
    kwargs = dict(model=MODEL, messages=chat("Write a word."), temperature=1.0, max_tokens=10, seed=1234)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_chat_logprobs_have_top_alternatives_in_openai_shape(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy took the best
        assert bytes(entry.bytes).decode() == entry.token


def test_completion_logprobs_have_tokens_offsets_and_top_dicts(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset[0] == 0 and len(logprobs.token_logprobs) == 4
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)


def test_models_lists_the_served_name_and_retrieves_it_by_id(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(f"{MODEL}-other")


def test_tokenize_and_detokenize_round_trip(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Sluice serves tokens."}, headers=AUTH).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}, headers=AUTH).json()["prompt"]
    assert text == "Sluice serves tokens."


# --- raw HTTP ------------------------------------------------------------------------------------


def test_stream_is_framed_as_server_sent_events_ending_with_done(server):
    body = {"model": MODEL, "messages": chat("Hi"), "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c for c in chunks) and all(c["usage"] is None for c in chunks[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_stream_without_include_usage_has_no_usage_key(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        chunks = [json.loads(e) for e in sse_events(response)[:-1]]
    assert chunks and all("usage" not in c for c in chunks)


def post(server, path: str, body: dict | bytes, headers: dict = AUTH) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{server.url}{path}", headers={**headers, "Content-Type": "application/json"}, timeout=60,
                      **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 7}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "oracle", "content": "x"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": -1}, "thinking_token_budget"),
        # A budget binds only a reply read for its reasoning, and this server has no --reasoning-parser.
        ({"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": 8}, "thinking_token_budget"),
    ],
)
def test_invalid_chat_fields_are_400(server, body, param):
    assert error_of(post(server, "/v1/chat/completions", body), 400)["param"] == param


def test_malformed_json_is_400(server):
    error_of(post(server, "/v1/chat/completions", b'{"messages": ['), 400)


def test_prompt_longer_than_the_context_is_400(server):
    error = error_of(post(server, "/v1/completions", {"prompt": "word " * 400, "max_tokens": 200}), 400)
    assert "context length" in error["message"]


def test_unknown_model_is_404(server):
    error = error_of(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found"


def test_wrong_api_key_is_401_for_the_openai_client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_oversized_body_is_413(server):
    error_of(post(server, "/v1/completions", {"prompt": "x" * (5 << 20)}), 413)


# --- concurrency, disconnects, failures ------------------------------------------------------------

PROMPTS = [f"Write one sentence about the number {i}." for i in range(32)]


def stream_chat(server, content: str, max_tokens: int) -> str:
    body = {"model": MODEL, "messages": chat(content), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=600) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_32_concurrent_streams_are_complete_and_equal_to_each_prompt_alone(server):
    alone = [stream_chat(server, p, 8) for p in PROMPTS]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: stream_chat(server, p, 8), PROMPTS))
    assert together == alone


def test_client_disconnect_mid_stream_frees_its_kv_pages(server):
    assert wait_for_metric(server.url, "sluice_kv_pages_used", 0) == 0
    body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2,", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert metric(server.url, "sluice_kv_pages_used") > 0
    assert wait_for_metric(server.url, "sluice_kv_pages_used", 0) == 0
    assert metric(server.url, "sluice_num_requests_running") == 0


def test_200_aborted_streams_leave_no_pages_held_and_the_server_healthy(server):
    def abort_one(i: int) -> None:
        body = {"model": MODEL, "messages": chat(f"Tell a long story number {i}."), "max_tokens": 200,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
            assert r.status_code == 200
            if i % 2:  # half leave after the first token, half right after the headers
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                next(lines), next(lines)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(abort_one, range(200)))
    assert wait_for_metric(server.url, "sluice_kv_pages_used", 0, timeout_s=60) == 0
    assert metric(server.url, "sluice_num_requests_running") == 0
    assert metric(server.url, "sluice_num_requests_waiting") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert stream_chat(server, "Say hi.", 4)


def test_metrics_report_latencies_tokens_and_request_counts(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["sluice_time_to_first_token_seconds_count", "sluice_inter_token_latency_seconds_count",
                 'sluice_e2e_request_latency_seconds_count{outcome="success"}', "sluice_prompt_tokens_total",
                 "sluice_generation_tokens_total", "sluice_kv_pages_total", "sluice_prefix_cache_hit_tokens_total",
                 "sluice_prefix_cache_query_tokens_total", "sluice_num_preemptions_total",
                 "sluice_num_requests_running", "sluice_num_seqs_waiting"]:
        assert metric(server.url, name) >= 0, name
    assert metric(server.url, "sluice_generation_tokens_total") > 0
    assert metric(server.url, "sluice_prompt_tokens_total") > 0
    assert 'sluice_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'sluice_requests_total{route="/v1/completions",status="400"}' in text


def test_cached_prompt_tokens_reach_the_client_in_usage(client):
    system = "You are a careful assistant who answers in one short sentence about geography and history. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a river."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_a_cache_salt_shares_cached_prompt_tokens_only_with_its_own_salt(client):
    system = "You keep a ledger of ships that pass the lighthouse and answer with one ship's name. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which ship came first?"}]

    def cached(salt: str | None) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                               extra_body={} if salt is None else {"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    cached(None)
    assert cached(None) >= 32  # the prompt is in the cache
    assert cached("tenant-a") == 0 and cached("tenant-b") == 0
    assert cached("tenant-a") >= 32


# Each is out of range for one field (or names an unimplemented one, or a schema feature llguidance lacks) and
# must be that request's 400 alone.
BAD_FIELDS = [{"top_k": -5}, {"seed": -(2**63) - 1}, {"seed": 2**64}, {"stop_token_ids": [49152]},
              {"stop_token_ids": [-1]}, {"max_tokens": 0}, {"temperature": 3}, {"n": 1000},
              {"min_tokens": 9, "max_tokens": 2},
              {"max_tokens": None, "min_tokens": 7584327827},
              {"logit_bias": {"5": 300}}, {"prompt": [1, 2, 10**9]}, {"max_tokens": 10**6}, {"cache_salt": ""},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}]


def test_bad_requests_sent_among_good_ones_get_400s_and_the_good_ones_their_tokens_as_alone(server):
    good = [{"prompt": f"List {i} fruits:", "max_tokens": 8, "temperature": 0} for i in range(8)]
    alone = [post(server, "/v1/completions", body).json()["choices"][0]["text"] for body in good]
    bad = [{"prompt": "Hello", "max_tokens": 4, **fields} for fields in BAD_FIELDS]
    mixed = [("good", i, body) for i, body in enumerate(good)] + [("bad", i, body) for i, body in enumerate(bad)]
    with ThreadPoolExecutor(len(mixed)) as pool:
        responses = list(pool.map(lambda item: post(server, "/v1/completions", item[2]), mixed))
    for (kind, i, _), response in zip(mixed, responses):
        if kind == "good":
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == alone[i]
        else:
            assert error_of(response, 400)["message"], BAD_FIELDS[i]


def test_top_k_beyond_the_vocabulary_means_no_filter(client):
    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0.9, seed=3)
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, extra_body={"top_k": 2**40}).choices[0].text == plain


def test_an_idle_keep_alive_connection_outlives_the_clients_pool_expiry(server):
    """httpx and the OpenAI SDK reuse a pooled connection for 5 s; a server that closed it at 5 s too would now
    and then reset a request sent at that instant, unread (`sluice bench soak` lost one so)."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", "/health")
        first = connection.getresponse()
        assert first.status == 200 and first.read()
        sock = connection.sock
        time.sleep(6)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        assert connection.sock is sock
    finally:
        connection.close()


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_whole_and_streamed(server, client):
    """vLLM's `return_token_ids` (what RL and agent frameworks read to train on exactly the tokens sampled): the
    prompt's ids (once per completion choice, once per chat response; streamed, on the first chunk), and each
    choice's sampled ids (streamed, each chunk its new ones), the stop token included; no keys unless asked."""
    prompt = "Name three colors:"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    whole = client.completions.create(**kwargs, extra_body={"return_token_ids": True,
                                                            "return_tokens_as_token_ids": True}).choices[0]
    assert whole.prompt_token_ids == token_ids(server, prompt)
    assert whole.token_ids == [int(t.removeprefix("token_id:")) for t in whole.logprobs.tokens]
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].prompt_token_ids == whole.prompt_token_ids
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == whole.token_ids
    assert not {"prompt_token_ids", "token_ids"} & set(client.completions.create(**kwargs).choices[0].model_extra)

    messages = chat("Name a fruit.")
    chat_kwargs = dict(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    reply = client.chat.completions.create(**chat_kwargs, extra_body={"return_token_ids": True})
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=AUTH).json()["tokens"]
    assert reply.prompt_token_ids == rendered
    decoded = httpx.post(f"{server.url}/detokenize", json={"tokens": reply.choices[0].token_ids},
                         headers=AUTH).json()["prompt"]
    assert decoded.startswith(reply.choices[0].message.content) and len(reply.choices[0].token_ids) > 1
    stream = list(client.chat.completions.create(**chat_kwargs, stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == rendered
    assert all("prompt_token_ids" not in c.model_extra for c in stream[1:])
    assert [t for c in stream for t in c.choices[0].model_extra.get("token_ids", [])] == reply.choices[0].token_ids
    plain = client.chat.completions.create(**chat_kwargs)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra


def test_tokenize_renders_messages_with_tools_as_the_chat_request_does_and_names_the_vocabularys_strings(
        server, client):
    """vLLM's /tokenize takes a chat's `tools` (RL frameworks count an agent's prompt with it) and
    `return_token_strs` (the vocabulary's own strings, `Ġ` for a byte-level space)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = chat("What is the weather in Paris?")
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1, temperature=0,
                                           extra_body={"return_token_ids": True})
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": tools,
                                                           "return_token_strs": True}, headers=AUTH).json()
    bare = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=AUTH).json()
    assert tokenized["tokens"] == reply.prompt_token_ids and tokenized["count"] > bare["count"]
    assert bare["token_strs"] is None
    strings = tokenized["token_strs"]
    assert len(strings) == tokenized["count"] and strings[0] == "<|im_start|>" and "ĠParis" in strings
    refused = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi", "tools": tools}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_sluice_chat_streams_each_reply_and_sends_the_whole_conversation_each_turn(server, client, monkeypatch,
                                                                                    capsys):
    """`sluice chat`, as vLLM's `vllm chat`: the model is the server's own, and a turn's reply is the one the chat
    API gives the history so far."""
    flags = ["chat", "--url", f"{server.url}/v1", "--api-key", API_KEY, "--max-tokens", "12", "--temperature", "0",
             "--system-prompt", "You are terse."]
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n\nAnd of Italy?\n"))
    assert sluice_main(flags) == 0
    # Each prompt ("> ") before its reply, the empty line's too.
    first, second = [re.sub(r"^(> )+", "", line) for line in capsys.readouterr().out.splitlines() if line.strip("> ")]
    history = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "What is the capital of France?"}]

    def reply(messages: list[dict]) -> str:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                              temperature=0).choices[0].message.content

    assert first == reply(history).strip()
    assert second == reply(history + [{"role": "assistant", "content": first},
                                      {"role": "user", "content": "And of Italy?"}]).strip()
    assert sluice_main([*flags, "-q", "What is the capital of France?"]) == 0
    assert capsys.readouterr().out.strip() == first


def test_sluice_chat_says_in_one_line_what_the_server_refused(server, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    assert sluice_main(["chat", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "Hi"]) == 2
    assert "(is `sluice serve` running?)" in capsys.readouterr().err
    assert sluice_main(["chat", "--url", f"{server.url}/v1", "-q", "Hi"]) == 2  # no key
    assert capsys.readouterr().err.strip().startswith("sluice: error: the server answered 401 to /models: ")
    assert sluice_main(["chat", "--url", f"{server.url}/v1", "--api-key", API_KEY, "--model", "other", "-q", "Hi"]) == 2
    assert "the server answered 404: " in capsys.readouterr().err
