// Tool calls in the playground: the tools box read as a request's `tools`, and a streamed reply's calls put
// together from their deltas (index, id and name first, then fragments of the arguments), shown as they grow.

// The tools box: empty (no tools), one OpenAI function tool or a list of them. Throws on JSON that is neither.
export function parseTools(text) {
  if (!text.trim()) return [];
  const value = JSON.parse(text);
  const tools = Array.isArray(value) ? value : [value];
  for (const tool of tools) {
    if (!tool || tool.type !== "function" || !tool.function || typeof tool.function.name !== "string") {
      throw new Error('each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}');
    }
  }
  return tools;
}

export class ToolCallsView {
  constructor(container) {
    this.container = container;
    this.calls = [];      // as the next request's assistant message carries them
    this.argumentViews = [];
  }

  // One chunk's `delta.tool_calls`.
  add(deltas) {
    for (const { index, id, function: fn = {} } of deltas) {
      if (!this.calls[index]) {
        this.calls[index] = { id, type: "function", function: { name: fn.name || "", arguments: "" } };
        this.argumentViews[index] = this.show(fn.name || "");
      }
      const call = this.calls[index].function;
      if (fn.arguments) {
        call.arguments += fn.arguments;
        this.argumentViews[index].textContent = call.arguments;
      }
    }
  }

  // The reply's calls; arguments that are whole JSON are shown indented.
  finish() {
    this.calls.forEach((call, i) => {
      try {
        this.argumentViews[i].textContent = JSON.stringify(JSON.parse(call.function.arguments), null, 2);
      } catch {
        // cut short by max_tokens: shown as they came
      }
    });
    return this.calls.filter(Boolean);
  }

  show(name) {
    const block = document.createElement("div");
    block.className = "tool-call";
    const title = document.createElement("span");
    title.className = "tool-name";
    title.textContent = name;
    const args = document.createElement("pre");
    args.className = "tool-arguments";
    block.append(title, args);
    this.container.append(block);
    return args;
  }
}
