"""The dashboard and playground in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright)
against a live `sluice serve` with an API key. Screenshots go to build/screenshots/ (test artefacts).

`make test` installs Chromium (apt) and Playwright (the test extra); run elsewhere without them, these tests are
skipped saying what is missing, and fail instead under CI (CI=true), where they must run.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from test_api_e2e import SERVER_FLAGS, start_server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
KEY = "browser-key"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "build" / "screenshots"
# Declared peaks: no measuring at start-up.
FLAGS = [*SERVER_FLAGS, "--api-key", KEY, "--peak-gflops", "100", "--peak-bandwidth-gbs", "20",
         "--slo-ttft-ms", "2000", "--slo-itl-ms", "200"]
TIMEOUT_MS = 120_000  # a first launch builds Chromium's font cache, slow on a busy 2-core machine


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright; `make test` does it)"
    if shutil.which(CHROMIUM) is None:
        return f"{CHROMIUM} is missing (apt-get install chromium; `make test` does it as root)"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _missing()
    if missing is not None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"browser tests cannot run: {missing}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # No sandbox: it needs user namespaces, which containers (CI's included) often lack. Nor `make test`'s
        # mimalloc preload: Chromium's own allocator dies under it.
        env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], env=env,
                                              timeout=TIMEOUT_MS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def server():
    proc = start_server(*FLAGS)
    yield proc
    proc.stop()


@pytest.fixture
def page(browser, server):
    """A page of the server with the API key already saved in the browser."""
    context = browser.new_context(viewport={"width": 1400, "height": 1300})
    context.add_init_script(f"localStorage.setItem('sluice.apiKey', {KEY!r})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(server.url + "/", timeout=TIMEOUT_MS)
    yield page
    context.close()
    assert not errors, errors


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


def latest(page, panel: str) -> float:
    value = page.get_attribute(f"#panel-{panel}", "data-latest")
    return float(value) if value else 0.0


def test_the_page_asks_for_the_api_key_and_goes_live_once_given(browser, server):
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.url + "/ui", timeout=TIMEOUT_MS)
    page.wait_for_selector("#key-dialog[open]", timeout=TIMEOUT_MS)
    assert page.inner_text("#status") == "API key needed"
    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=TIMEOUT_MS)
    page.wait_for_function("document.getElementById('model').textContent !== ''", timeout=TIMEOUT_MS)
    context.close()


def test_a_playground_chat_streams_its_answer_with_ttft_rate_and_snippets(page):
    page.click("button[data-tab=playground]")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "12")
    page.check("#pg-logprobs")
    page.fill("#pg-input", "What is the capital of Germany?")
    page.click("#pg-send")
    page.wait_for_function("document.getElementById('pg-stats').textContent.includes('finish')")
    answer = page.inner_text(".message.assistant .text")
    assert "Berlin" in answer
    assert page.locator(".message.assistant .token").count() > 1  # coloured by probability
    stats = page.inner_text("#pg-stats")
    assert "TTFT" in stats and "tok/s" in stats
    snippet = page.inner_text("#pg-snippet")
    assert snippet.startswith("curl -N") and "$SLUICE_API_KEY" in snippet and '"temperature": 0' in snippet
    page.click("button[data-snippet=python]")
    assert "client.chat.completions.create(" in page.inner_text("#pg-snippet")
    screenshot(page, "playground")


def test_the_playground_leaves_the_sampling_fields_it_is_not_given_to_the_model(page):
    """It sent temperature 0.7 and top_p 1 unasked, overriding the model's own sampling defaults."""
    page.click("button[data-tab=playground]")
    page.fill("#pg-max-tokens", "2")
    page.fill("#pg-input", "Hi")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#pg-send")
    body = json.loads(sent.value.post_data)
    assert "temperature" not in body and "top_p" not in body
    assert page.get_attribute("#pg-temperature", "placeholder") == "model's default"
    page.wait_for_function("!document.getElementById('pg-send').disabled")
    page.fill("#pg-top-p", "0.9")
    page.fill("#pg-input", "Hi again")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#pg-send")
    assert json.loads(sent.value.post_data)["top_p"] == 0.9


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}


def test_playground_tools_show_the_streamed_call_and_the_next_message_answers_it(page):
    page.click("button[data-tab=playground]")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "60")
    page.fill("#pg-tools", "[{")
    assert page.inner_text("#pg-tools-error").startswith("tools:")
    page.fill("#pg-tools", json.dumps([WEATHER]))
    page.select_option("#pg-tool-choice", "required")
    page.uncheck("#pg-parallel")
    assert page.inner_text("#pg-tools-error") == "" and '"get_weather"' in page.inner_text("#pg-snippet")
    page.fill("#pg-input", "What is the weather in Paris?")
    page.click("#pg-send")
    page.wait_for_function("document.getElementById('pg-stats').textContent.includes('finish')")
    assert "finish: tool_calls" in page.inner_text("#pg-stats")
    assert page.inner_text(".message.assistant .tool-name") == "get_weather"
    assert set(json.loads(page.inner_text(".message.assistant .tool-arguments"))) == {"city"}
    assert page.get_attribute("#pg-input", "placeholder").startswith("Result of get_weather")
    screenshot(page, "playground-tool-call")

    page.select_option("#pg-tool-choice", "none")
    page.fill("#pg-input", '{"temperature": 18, "sky": "sunny"}')
    page.click("#pg-send")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 2"
                           " && !document.getElementById('pg-send').disabled")
    assert page.inner_text(".message.tool .role") == "tool"
    answer = page.locator(".message.assistant").nth(1)
    assert answer.locator(".text").inner_text() and answer.locator(".tool-call").count() == 0
    python = page.click("button[data-snippet=python]") or page.inner_text("#pg-snippet")
    assert '"role": "tool"' in python and '"tool_calls": [' in python and "tool_choice=\"none\"" in python


def test_load_moves_the_throughput_and_batch_panels(page, server):
    page.wait_for_function("document.getElementById('status').textContent === 'live'")
    page.wait_for_function("document.getElementById('panel-throughput').dataset.latest === '0'")

    def load() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as client:
            client.post(f"{server.url}/v1/completions", json=body).raise_for_status()

    senders = [threading.Thread(target=load) for _ in range(6)]
    for sender in senders:
        sender.start()
    try:
        page.wait_for_function("Number(document.getElementById('panel-throughput').dataset.latest) > 0")
        page.wait_for_function("Number(document.getElementById('panel-batch').dataset.latest) > 1")
        assert latest(page, "histogram") > 0
        assert page.locator("#panel-throughput canvas").count() == 1  # drawn by uPlot
        screenshot(page, "dashboard-under-load")
    finally:
        for sender in senders:
            sender.join()
