"""`sluice chat`: a conversation in the terminal with a running server, as vLLM's `vllm chat`.

Each reply streams from the server's `/v1/chat/completions` as it is sampled, and joins the history the next turn
sends. A reasoning model's thinking (a server with `--reasoning-parser`) shows dimmed on a terminal, and is left out
of the history, as chat templates expect. `-q MESSAGE` sends one message, prints the reply and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

from sluice.app.arguments import CommandError, at_least

DEFAULT_URL = "http://127.0.0.1:8000/v1"
DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's API base (default: {DEFAULT_URL})")
    parser.add_argument("--model", default=None, help="the served model's name (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"),
                        help="the server's --api-key (default: $SLUICE_API_KEY)")
    parser.add_argument("--system-prompt", default=None, help="a system message that opens the conversation")
    parser.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                        help="send this one message, print the reply and exit")
    parser.add_argument("--max-tokens", type=at_least(1, int), default=None, help="per reply (default: the server's)")
    parser.add_argument("--temperature", type=at_least(0.0, float), default=None,
                        help="0: greedy (default: the model's)")


class Conversation:
    """The messages so far, and a turn: send the user's text, stream the reply to `out`, keep both."""

    def __init__(self, client: httpx.Client, model: str, system_prompt: str | None, sampling: dict[str, Any]):
        self.client = client
        self.model = model
        self.sampling = sampling
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def turn(self, text: str, out: TextIO) -> str:
        """The reply to `text`, written to `out` as it arrives. Interrupted (Ctrl-C), the reply so far is kept."""
        self.messages.append({"role": "user", "content": text})
        shown = out.isatty()
        answer: list[str] = []
        try:
            for reasoning, content in self._deltas():
                if reasoning and shown:
                    out.write(f"{DIM}{reasoning}{RESET}")
                answer.append(content)
                out.write(content)
                out.flush()
        except KeyboardInterrupt:  # the stream is closed, which aborts the request on the server
            pass
        finally:
            out.write("\n")
        reply = "".join(answer)
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _deltas(self) -> Iterator[tuple[str, str]]:
        """(reasoning, content) of each streamed chunk."""
        body = {"model": self.model, "messages": self.messages, "stream": True, **self.sampling}
        with self.client.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise CommandError(f"the server answered {response.status_code}: {_error_message(response)}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:  # the stream's own end, after its 200
                    raise CommandError(f"the reply failed: {event['error']['message']}")
                for choice in event["choices"]:
                    delta = choice["delta"]
                    yield delta.get("reasoning") or "", delta.get("content") or ""


def run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sampling = {name: value for name in ("max_tokens", "temperature") if (value := getattr(args, name)) is not None}
    with httpx.Client(base_url=args.url, headers=headers, timeout=httpx.Timeout(10.0, read=None)) as client:
        try:
            conversation = Conversation(client, args.model or _served_model(client), args.system_prompt, sampling)
            if args.quick is not None:
                conversation.turn(args.quick, sys.stdout)
                return 0
            while (text := _read_message()) is not None:
                if text.strip():
                    conversation.turn(text, sys.stdout)
        except httpx.ConnectError as error:
            raise CommandError(f"cannot connect to {args.url} (is `sluice serve` running?): {error}") from None
    return 0


def _read_message() -> str | None:
    """The user's next message; None at the end of input (Ctrl-D) or on `exit` / `quit`."""
    try:
        text = input("> ")
    except EOFError:
        print()
        return None
    return None if text.strip() in ("exit", "quit") else text


def _served_model(client: httpx.Client) -> str:
    response = client.get("/models")
    if response.status_code != 200:
        raise CommandError(f"the server answered {response.status_code} to /models: {_error_message(response)}")
    return response.json()["data"][0]["id"]


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text.strip() or response.reason_phrase
