// The built-in page: a streaming chat over /v1/chat/completions and a cluster view polling
// /v1/status. Plain browser JavaScript, no build step and nothing loaded from elsewhere; text
// from the server is only ever set as textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const chat = { messages: [], abort: null };
const POLL_MS = 1000;

function authHeaders() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---- chat ----------------------------------------------------------------------------------

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  box.appendChild(el("span", "role", role));
  const reasoning = el("details", "reasoning");
  reasoning.appendChild(el("summary", null, "reasoning"));
  const reasoningText = el("div", "reasoning-text");
  reasoning.appendChild(reasoningText);
  reasoning.hidden = true;
  box.appendChild(reasoning);
  const content = el("div", "content", text);
  box.appendChild(content);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return {
    box,
    setReasoning(t) { reasoning.hidden = false; reasoningText.textContent = t; },
    setContent(t) { content.textContent = t; box.scrollIntoView({ block: "end" }); },
    finish(note) {
      box.dataset.state = "done";
      if (note) box.appendChild(el("span", "usage", note));
    },
  };
}

// The `data:` payloads of a server-sent event stream, as they arrive (comments such as
// `: keepalive` are skipped).
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

async function send(text) {
  const error = $("chat-error");
  error.hidden = true;
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const view = addMessage("assistant", "");
  view.box.dataset.state = "streaming";
  const body = {
    messages: chat.messages,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || undefined,
    temperature: Number($("temperature").value),
  };
  chat.abort = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let content = "", reasoning = "", finish = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: chat.abort.signal,
    });
    if (!response.ok) throw new Error(await errorOf(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          reasoning += delta.reasoning_content;
          view.setReasoning(reasoning);
        }
        if (delta.content) {
          content += delta.content;
          view.setContent(content);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    const secs = (performance.now() - t0) / 1000;
    let note = finish ? "finish: " + finish : "";
    if (usage) {
      note += ` · ${usage.prompt_tokens} prompt tokens` +
        ` (${(usage.prompt_tokens_details || {}).cached_tokens || 0} cached),` +
        ` ${usage.completion_tokens} generated in ${secs.toFixed(2)} s`;
    }
    view.finish(note);
  } catch (e) {
    view.finish(e.name === "AbortError" ? "stopped" : "failed");
    if (e.name !== "AbortError") {
      error.textContent = e.message;
      error.hidden = false;
    }
  } finally {
    // What was shown stays in the conversation, so the next turn continues from it.
    chat.messages.push({ role: "assistant", content });
    chat.abort = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function setUpChat() {
  const input = $("input");
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || chat.abort) return;
    input.value = "";
    send(text);
  });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chat.abort && chat.abort.abort());
  $("clear").addEventListener("click", () => {
    if (chat.abort) chat.abort.abort();
    chat.messages = [];
    $("messages").replaceChildren();
  });
  const key = $("api-key");
  key.value = localStorage.getItem("moeshard-api-key") || "";
  key.addEventListener("change", () => localStorage.setItem("moeshard-api-key", key.value));
}

// ---- cluster view --------------------------------------------------------------------------

const fmt = {
  num: (v, digits = 1) => Number(v).toFixed(digits),
  ms: (seconds) => (seconds * 1000).toFixed(seconds < 0.01 ? 2 : 1) + " ms",
  us: (us) => (us >= 10000 ? (us / 1000).toFixed(1) + " ms" : us + " µs"),
  bytes: (b) => (b >= 1 << 20 ? (b / (1 << 20)).toFixed(1) + " MiB" : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B"),
  pct: (r) => (r * 100).toFixed(1) + " %",
};

function tile(label, value) {
  const t = el("div", "tile");
  t.appendChild(el("div", "value", value));
  t.appendChild(el("div", "label", label));
  t.dataset.label = label;
  return t;
}

function row(cells, numeric = []) {
  const tr = el("tr");
  cells.forEach((c, i) => tr.appendChild(el("td", numeric.includes(i) ? "num" : null, String(c))));
  return tr;
}

function table(head, rows, numeric) {
  const t = el("table");
  const tr = el("tr");
  head.forEach((h) => tr.appendChild(el("th", null, h)));
  t.appendChild(el("thead")).appendChild(tr);
  const body = t.appendChild(el("tbody"));
  rows.forEach((r) => body.appendChild(row(r, numeric)));
  return t;
}

function renderTiles(s) {
  const srv = s.server, lat = s.latency, ex = s.executor;
  const tiles = [
    tile("decode tokens/s", fmt.num(srv.decode_tokens_per_second)),
    tile("prompt tokens/s", fmt.num(srv.prompt_tokens_per_second)),
    tile("queue depth", String(srv.requests_queued)),
    tile("slots busy", `${srv.requests_processing} / ${srv.slots}`),
    tile("KV cache in use", fmt.pct(srv.kv_cache_usage_ratio)),
    tile("requests", String(srv.requests_total)),
    tile("tokens generated", String(srv.generated_tokens_total)),
  ];
  if (lat.time_to_first_token.count > 0) tiles.push(tile("mean time to first token", fmt.ms(lat.time_to_first_token.mean_seconds)));
  if (lat.inter_token.count > 0) tiles.push(tile("mean inter-token latency", fmt.ms(lat.inter_token.mean_seconds)));
  if (lat.step.count > 0) tiles.push(tile("mean step", fmt.ms(lat.step.mean_seconds)));
  // Expert-cache figures exist only when experts are streamed from disk.
  if ("expert_hit_rate" in ex) tiles.push(tile("expert-cache hit rate", fmt.pct(ex.expert_hit_rate)));
  if ("expert_read_mib" in ex) tiles.push(tile("expert bytes read", fmt.bytes(ex.expert_read_mib * (1 << 20))));
  $("tiles").replaceChildren(...tiles);
}

function renderHops(c) {
  const box = $("hops");
  if (c.kind === "pipeline" && c.hops.length > 0) {
    const rows = c.hops.map((h) => [h.stage, fmt.us(h.wait_us), fmt.us(h.compute_us), fmt.us(h.send_us), fmt.bytes(h.bytes_in), fmt.bytes(h.bytes_out)]);
    box.replaceChildren(table(["stage", "wait", "compute", "send", "in", "out"], rows, [1, 2, 3, 4, 5]));
  } else if (c.kind === "tensor_parallel" && c.tp_step) {
    const t = c.tp_step;
    box.replaceChildren(table(["tokens", "step", "compute", "all-reduce", "exchanges", "slowest rank", "gather"],
      [[t.tokens, fmt.us(t.step_us), fmt.us(t.compute_us), fmt.us(t.exchange_us), t.exchanges, fmt.us(t.slowest_rank_us), fmt.us(t.gather_us)]],
      [0, 1, 2, 3, 4, 5, 6]));
  } else {
    box.replaceChildren(el("p", "muted", c.kind === "local" ? "one process: no hops" : "no step yet"));
  }
}

function render(s) {
  const c = s.cluster;
  $("model-name").textContent = `${s.model.id} · ${s.model.arch}, ${s.model.n_layer} layers, ` +
    `${s.model.n_expert} experts (top ${s.model.n_expert_used}), context ${s.model.n_ctx}`;
  $("cluster-kind").textContent = c.kind.replace("_", " ");
  const complete = $("cluster-complete");
  complete.textContent = c.complete ? "complete" : "waiting for peers";
  complete.className = "badge " + (c.complete ? "ok" : "bad");
  renderTiles(s);
  $("nodes").tBodies[0].replaceChildren(...c.nodes.map((n) =>
    row([n.role, n.layers, n.rank === null ? "" : n.rank, n.address || "this process"])));
  renderHops(c);
  const stats = Object.entries(s.executor);
  $("executor-stats").tBodies[0].replaceChildren(...(stats.length > 0
    ? stats.map(([k, v]) => row([k, Number.isInteger(v) ? v : v.toFixed(4)], [1]))
    : [row(["none reported (resident experts)", ""])]));
  document.body.dataset.status = "loaded";
}

async function poll() {
  const conn = $("conn"), error = $("status-error");
  try {
    const response = await fetch("/v1/status", { headers: authHeaders() });
    if (!response.ok) throw new Error(await errorOf(response));
    render(await response.json());
    conn.textContent = "connected";
    conn.className = "badge ok";
    error.hidden = true;
  } catch (e) {
    conn.textContent = "disconnected";
    conn.className = "badge bad";
    error.textContent = "status: " + e.message;
    error.hidden = false;
  }
  setTimeout(poll, POLL_MS);
}

setUpChat();
poll();
