// The playground view: a chat with the served model over /v1/chat/completions (streamed), with TTFT and
// tokens/s, optional per-token probability colours, and the same request as curl and openai snippets.
import { apiFetch, apiKey, errorMessage, sseData, Unauthorized } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor(askForKey) {
    this.askForKey = askForKey;
    this.model = "";
    this.history = [];
    this.snippetKind = "curl";
    this.controller = null;
    $("pg-form").addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    $("pg-input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); this.send(); }
    });
    $("pg-stop-button").addEventListener("click", () => this.controller && this.controller.abort());
    $("pg-clear").addEventListener("click", () => { this.history = []; $("pg-messages").replaceChildren(); this.updateSnippet(); });
    for (const input of document.querySelectorAll("#playground input, #playground textarea")) {
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

  // The request's fields from the settings; empty fields are left to the server's defaults.
  params() {
    const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
    const stop = $("pg-stop").value.split("\n").filter((s) => s !== "");
    return {
      temperature: number("pg-temperature"), top_p: number("pg-top-p"), max_tokens: number("pg-max-tokens"),
      seed: number("pg-seed"), stop: stop.length ? stop : undefined, logprobs: $("pg-logprobs").checked || undefined,
    };
  }

  messages(next) {
    const system = $("pg-system").value.trim();
    return [...(system ? [{ role: "system", content: system }] : []), ...this.history,
      ...(next ? [{ role: "user", content: next }] : [])];
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
      .map(([k, v]) => `    ${k}=${v === true ? "True" : JSON.stringify(v)},`).join("\n");
    const key = apiKey() ? 'os.environ["SLUICE_API_KEY"]' : '"unused"';
    const lines = [...(apiKey() ? ["import os", ""] : []), "from openai import OpenAI", "",
      `client = OpenAI(base_url="${base}", api_key=${key})`,
      "stream = client.chat.completions.create(",
      `    model=${JSON.stringify(model)},`,
      `    messages=${JSON.stringify(messages, null, 4).replaceAll("\n", "\n    ")},`,
      ...(args ? [args] : []), "    stream=True,", ")",
      "for chunk in stream:",
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
    message.append(label, body);
    $("pg-messages").append(message);
    $("pg-messages").scrollTop = $("pg-messages").scrollHeight;
    return message;
  }

  async send() {
    const text = $("pg-input").value.trim();
    if (!text || this.controller) return;
    const body = this.body(text);
    this.history.push({ role: "user", content: text });
    $("pg-input").value = "";
    this.addMessage("user", text);
    const reply = this.addMessage("assistant", "");
    this.controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop-button").disabled = false;
    try {
      const answer = await this.stream(body, reply.querySelector(".text"));
      this.history.push({ role: "assistant", content: answer });
    } catch (error) {
      reply.classList.add("error");
      reply.querySelector(".text").textContent = error.name === "AbortError" ? "(stopped)" : error.message;
      this.history.pop();
      if (error instanceof Unauthorized) this.askForKey();
    } finally {
      this.controller = null;
      $("pg-send").disabled = false;
      $("pg-stop-button").disabled = true;
      this.updateSnippet();
    }
  }

  // Streams one answer into `target`; resolves to its text.
  async stream(body, target) {
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
      if (!content) continue;
      last = performance.now();
      first = first || last;
      tokens += 1;
      answer += content;
      this.appendText(target, content, choice.logprobs && choice.logprobs.content);
      $("pg-stats").textContent = this.stats(sent, first, last, tokens, null);
    }
    $("pg-stats").textContent = this.stats(sent, first, last, tokens, finish);
    return answer;
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
