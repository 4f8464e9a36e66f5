// Talking to the server: the API key (kept in this browser), authorized fetches, and SSE bodies read from a
// fetch stream (EventSource cannot send an Authorization header).

const KEY_STORAGE = "sluice.apiKey";

export class Unauthorized extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  localStorage.setItem(KEY_STORAGE, key);
}

export async function apiFetch(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) throw new Unauthorized("API key missing or wrong");
  return response;
}

// The `data:` payloads of a text/event-stream body, as they arrive; comments (keep-alives) are skipped.
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

// The error message of an OpenAI-shaped error response.
export async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}
