// The playground view: a chat with the served model over /v1/chat/completions (streamed), with TTFT and
// tokens/s, optional per-token probability colours, tools (the reply's calls shown as they stream; the next
// message answers them), and the same request as curl and openai snippets.
import { apiFetch, apiKey, errorMessage, sseData, Unauthorized } from "./api.js";
import { parseTools, ToolCallsView } from "./tool_calls.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor(askForKey) {
    this.askForKey = askForKey;
    this.model = "";
    this.history = [];
    this.pendingCalls = [];  // the last reply's calls: the next message is their result
    this.snippetKind = "curl";
    this.controller = null;
    $("pg-form").addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    $("pg-input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); this.send(); }
    });
    $("pg-stop-button").addEventListener("click", () => this.controller && this.controller.abort());
    $("pg-clear").addEventListener("click", () => {
      this.history = [];
      this.setPendingCalls([]);
      $("pg-messages").replaceChildren();
      this.updateSnippet();
    });
    for (const input of document.querySelectorAll("#playground input, #playground textarea, #playground select")) {
      input.addEventListener("input", () => this.updateSnippet());
    }
    for (const tab of document.querySelectorAll("button.snippet-tab")) {
      tab.addEventListener("click", () => {
        this.snippetKind = tab.dataset.snippet;
        document.querySelectorAll("button.snippet-tab").forEach((t) => t.setAttribute("aria-selected", String(t === tab)));
        this.updateSnippet();
      });
    }
    this.updateSnippet();
  }

  setModel(name) {
    this.model = name;
    this.updateSnippet();
  }

  // The request's fields from the settings; empty fields are left out, so the server applies the model's own
  // defaults (its generation config) to them. Tools that do not parse are left out (and said so under their box).
  params() {
    const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
    const stop = $("pg-stop").value.split("\n").filter((s) => s !== "");
    const tools = this.tools();
    return {
      temperature: number("pg-temperature"), top_p: number("pg-top-p"), max_tokens: number("pg-max-tokens"),
      seed: number("pg-seed"), stop: stop.length ? stop : undefined, logprobs: $("pg-logprobs").checked || undefined,
      tools: tools && tools.length ? tools : undefined,
      tool_choice: tools && tools.length ? $("pg-tool-choice").value : undefined,
      parallel_tool_calls: tools && tools.length && !$("pg-parallel").checked ? false : undefined,
    };
  }

  // The tools box's tools, or null (with the reason shown) when it does not parse.
  tools() {
    try {
      const tools = parseTools($("pg-tools").value);
      $("pg-tools-error").textContent = "";
      return tools;
    } catch (error) {
      $("pg-tools-error").textContent = `tools: ${error.message}`;
      return null;
    }
  }

  // The conversation's next turn: the user's message, or, after a reply that made calls, their result.
  turn(text) {
    if (!this.pendingCalls.length) return [{ role: "user", content: text }];
    return this.pendingCalls.map((call) => ({ role: "tool", tool_call_id: call.id, content: text }));
  }

  setPendingCalls(calls) {
    this.pendingCalls = calls;
    const names = calls.map((call) => call.function.name).join(", ");
    $("pg-input").placeholder = calls.length ? `Result of ${names} (sent as the tool message)`
      : "Message (Enter sends, Shift+Enter for a new line)";
  }

  messages(next) {
    const system = $("pg-system").value.trim();
    return [...(system ? [{ role: "system", content: system }] : []), ...this.history,
      ...(next ? this.turn(next) : [])];
  }

  body(next) {
    return { model: this.model, messages: this.messages(next), ...this.params(), stream: true };
  }

  updateSnippet() {
    const body = this.body($("pg-input").value.trim() || "Hello!");
    const base = `${location.origin}/v1`;
    if (this.snippetKind === "curl") {
      const auth = apiKey() ? `\n  -H "Authorization: Bearer $SLUICE_API_KEY" \\` : "";
      const json = JSON.stringify(body, null, 2).replaceAll("'", "'\\''");
      $("pg-snippet").textContent = `curl -N ${base}/chat/completions \\\n  -H 'Content-Type: application/json' \\${auth}\n  -d '${json}'`;
      return;
    }
    const { model, messages, stream, ...params } = body;
    const args = Object.entries(params).filter(([, v]) => v !== undefined)
      .map(([k, v]) => `    ${k}=${python(v)},`).join("\n");
    const key = apiKey() ? 'os.environ["SLUICE_API_KEY"]' : '"unused"';
    const lines = [...(apiKey() ? ["import os", ""] : []), "from openai import OpenAI", "",
      `client = OpenAI(base_url="${base}", api_key=${key})`,
      "stream = client.chat.completions.create(",
      `    model=${JSON.stringify(model)},`,
      `    messages=${python(messages)},`,
      ...(args ? [args] : []), "    stream=True,", ")",
      "for chunk in stream:",
      ...(params.tools ? ["    for call in chunk.choices[0].delta.tool_calls or []:",
        '        print(call.function.name or "", call.function.arguments, end="", flush=True)'] : []),
      '    print(chunk.choices[0].delta.content or "", end="", flush=True)'];
    $("pg-snippet").textContent = lines.join("\n");
  }

  addMessage(role, text) {
    const message = document.createElement("div");
    message.className = `message ${role}`;
    const label = document.createElement("span");
    label.className = "role";
    label.textContent = role;
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    const calls = document.createElement("div");
    calls.className = "tool-calls";
    message.append(label, body, calls);
    $("pg-messages").append(message);
    $("pg-messages").scrollTop = $("pg-messages").scrollHeight;
    return message;
  }

  async send() {
    const text = $("pg-input").value.trim();
    if (!text || this.controller || this.tools() === null) return;
    const body = this.body(text);
    const before = this.history.length;
    const turn = this.turn(text);
    this.history.push(...turn);
    $("pg-input").value = "";
    this.addMessage(turn[0].role, text);
    const reply = this.addMessage("assistant", "");
    this.controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop-button").disabled = false;
    try {
      const { answer, calls } = await this.stream(body, reply);
      this.history.push({ role: "assistant", content: answer || (calls.length ? null : ""),
        ...(calls.length ? { tool_calls: calls } : {}) });
      this.setPendingCalls(calls);
    } catch (error) {
      reply.classList.add("error");
      reply.querySelector(".text").textContent = error.name === "AbortError" ? "(stopped)" : error.message;
      this.history.length = before;
      if (error instanceof Unauthorized) this.askForKey();
    } finally {
      this.controller = null;
      $("pg-send").disabled = false;
      $("pg-stop-button").disabled = true;
      this.updateSnippet();
    }
  }

  // Streams one answer into the `reply` message; resolves to its text and its tool calls.
  async stream(body, reply) {
    const target = reply.querySelector(".text");
    const calls = new ToolCallsView(reply.querySelector(".tool-calls"));
    const sent = performance.now();
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...body, stream_options: { include_usage: true } }), signal: this.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    let answer = "", first = null, last = null, tokens = 0, finish = null;
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices[0];
      if (!choice) continue;
      finish = choice.finish_reason || finish;
      const content = choice.delta.content || "";
      const toolCalls = choice.delta.tool_calls || [];
      if (!content && !toolCalls.length) continue;
      last = performance.now();
      first = first || last;
      tokens += 1;
      answer += content;
      if (content) this.appendText(target, content, choice.logprobs && choice.logprobs.content);
      calls.add(toolCalls);
      $("pg-stats").textContent = this.stats(sent, first, last, tokens, null);
    }
    $("pg-stats").textContent = this.stats(sent, first, last, tokens, finish);
    return { answer, calls: calls.finish() };
  }

  appendText(target, content, logprobs) {
    if (!logprobs || !logprobs.length) {
      target.append(content);
      return;
    }
    for (const { token, logprob } of logprobs) {
      const p = Math.exp(logprob);
      const span = document.createElement("span");
      span.className = "token";
      span.textContent = token;
      span.style.background = `hsl(${Math.round(120 * p)} 85% 82%)`;
      span.title = `p = ${p.toFixed(3)}`;
      target.append(span);
    }
  }

  stats(sent, first, last, tokens, finish) {
    if (first === null) return finish ? `no tokens (${finish})` : "";
    const ttft = first - sent;
    const rate = tokens > 1 && last > first ? ((tokens - 1) * 1000) / (last - first) : null;
    return [`TTFT ${ttft.toFixed(0)} ms`, rate === null ? null : `${rate.toFixed(1)} tok/s`, `${tokens} tokens`,
      finish && `finish: ${finish}`].filter(Boolean).join(" · ");
  }
}

// A JSON value written as a Python literal (for the openai snippet).
function python(value, indent = "    ") {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value !== "object") return JSON.stringify(value);
  const inner = indent + "    ";
  const items = Array.isArray(value) ? value.map((v) => python(v, inner))
    : Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${python(v, inner)}`);
  const [open, close] = Array.isArray(value) ? ["[", "]"] : ["{", "}"];
  return items.length ? `${open}\n${inner}${items.join(`,\n${inner}`)},\n${indent}${close}` : open + close;
}
