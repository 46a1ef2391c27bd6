// kvserve's live page: a chat pane streaming from /v1/chat/completions, and the engine beside it,
// redrawn from GET /v1/engine/state (one snapshot per poll; the server shares snapshots among pages).
"use strict";

const POLL_MS = 300;
const $ = (id) => document.getElementById(id);
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const view = { snapshots: 0, ownId: null, ownMax: 0, lastGen: null, tps: 0, model: null };
window.kvserveView = view; // read by the page test
const conversation = [];

// -- helpers ----------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}
function hue(id) { // a stable colour per request id
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
  return `hsl(${(h >>> 0) % 360}, 70%, 62%)`;
}
function fmt(n) { return n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e4 ? (n / 1e3).toFixed(1) + "k" : String(n); }
function fitCanvas(c, height) {
  const dpr = window.devicePixelRatio || 1, w = c.clientWidth;
  if (height) c.style.height = height + "px";
  const h = c.clientHeight;
  if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) { c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); }
  const g = c.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  return [g, w, h];
}

// -- the engine -------------------------------------------------------------------------------
function drawPool(p) {
  const c = $("pool"), n = p.map.length;
  const w = c.clientWidth, maxH = 220;
  let s = Math.max(3, Math.min(18, Math.floor(Math.sqrt((w * maxH) / n))));
  const cols = Math.max(1, Math.floor(w / s)), rows = Math.ceil(n / cols);
  const [g] = fitCanvas(c, rows * s);
  const colours = p.owners.map(hue), free = css("--free"), cached = css("--cached"), own = css("--own");
  const ownCode = view.ownId ? p.owners.indexOf(view.ownId) + 2 : -1;
  let ownCells = 0;
  const gap = s >= 6 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    const code = p.map[i];
    let colour = code === 0 ? free : code === 1 ? cached : colours[code - 2] || "#9aa4b2";
    if (code === ownCode && ownCode >= 2) { colour = own; ownCells++; }
    g.fillStyle = colour;
    g.fillRect((i % cols) * s, Math.floor(i / cols) * s, s - gap, s - gap);
  }
  view.ownMax = Math.max(view.ownMax, ownCells);
  Object.assign(c.dataset, { cells: n, used: p.used, cached: p.cached, free: p.free, own: ownCells, ownMax: view.ownMax });
  const per = p.blocks_per_cell > 1 ? `, a cell is ${p.blocks_per_cell} blocks` : "";
  $("pool-summary").textContent =
    `${p.used} in use · ${p.cached} cached · ${p.free} free of ${p.num_blocks} blocks × ${p.block_size} tokens${per}` +
    (ownCells ? ` · yours: ${ownCells}` : "");
}

function drawQueues(st) {
  $("n-running").textContent = st.num_running;
  $("n-waiting").textContent = st.num_waiting;
  for (const which of ["running", "waiting"]) {
    const box = $(which);
    box.replaceChildren(...st.requests.filter((r) => r.state === which).map((r) => {
      const chip = document.createElement("span");
      chip.className = "chip" + (r.id === view.ownId ? " own" : "");
      chip.style.background = hue(r.id);
      const short = r.id.replace(/^(chatcmpl|cmpl)-/, "").slice(0, 6);
      chip.textContent = `${short} ${r.prompt_tokens}+${r.output_tokens} · ${r.blocks}b`;
      chip.title = `${r.id} (completion ${r.index}): ${r.prompt_tokens} prompt tokens (${r.cached_tokens} from the prefix cache), ` +
        `${r.output_tokens} generated, ${r.computed_tokens} computed, ${r.blocks} blocks, ${r.preemptions} preemptions`;
      return chip;
    }));
  }
}

function drawSteps(st) {
  const [g, w, h] = fitCanvas($("steps"));
  const steps = st.steps, max = Math.max(1, ...steps.map((s) => s.prefill_tokens + s.decode_tokens));
  const bw = w / Math.max(steps.length, 60), col = { pre: css("--prefill"), dec: css("--decode"), acc: css("--accepted"), rej: css("--rejected") };
  let drafted = 0, accepted = 0;
  steps.forEach((s, i) => {
    // one column per step, bottom up: decode tokens, then drafted ones accepted, drafted ones rejected, prefill
    const x = w - (steps.length - i) * bw, unit = (h - 14) / max;
    const d = s.drafted_tokens || 0, a = s.accepted_tokens || 0;
    let y = h;
    for (const [n, c] of [[s.decode_tokens - d, col.dec], [a, col.acc], [d - a, col.rej], [s.prefill_tokens, col.pre]]) {
      g.fillStyle = c; g.fillRect(x, y - n * unit, Math.max(1, bw - 1), n * unit); y -= n * unit;
    }
    drafted += d; accepted += a;
  });
  g.fillStyle = css("--muted"); g.font = "11px sans-serif"; g.fillText(`${max} tokens`, 2, 10);
  Object.assign($("steps").dataset, { drafted, accepted });
  const last = steps[steps.length - 1];
  $("step-summary").textContent = last
    ? `last: ${last.seqs} sequences, ${last.prefill_tokens} prefill + ${last.decode_tokens} decode tokens` +
      (last.drafted_tokens ? ` (${last.accepted_tokens} of ${last.drafted_tokens} drafted accepted)` : "") +
      ` in ${(last.duration * 1e3).toFixed(1)} ms`
    : "idle";
}

function drawHistogram(id, hist) {
  const [g, w, h] = fitCanvas($(id));
  const counts = hist.counts, max = Math.max(1, ...counts), n = counts.length, bw = w / n;
  const labels = hist.edges_ms.map((e) => (e >= 1000 ? e / 1000 + "s" : e + "")).concat(["more"]);
  g.font = "10px sans-serif";
  counts.forEach((c, i) => {
    const bh = (c / max) * (h - 28);
    g.fillStyle = css("--accent"); g.fillRect(i * bw + 1, h - 14 - bh, bw - 2, bh);
    g.fillStyle = css("--muted"); g.fillText(labels[i], i * bw + 2, h - 2);
    if (c) { g.fillStyle = css("--text"); g.fillText(fmt(c), i * bw + 2, h - 17 - bh); }
  });
  $(id).dataset.total = counts.reduce((a, b) => a + b, 0);
}

function render(st) {
  view.snapshots++;
  drawPool(st.pool);
  if (st.disk) $("pool-summary").textContent += ` · disk: ${fmt(st.disk.blocks)} blocks, ` +
    `${(st.disk.bytes_used / 2 ** 30).toFixed(2)} of ${(st.disk.capacity_bytes / 2 ** 30).toFixed(2)} GiB`;
  drawQueues(st);
  drawSteps(st);
  drawHistogram("ttft", st.ttft);
  drawHistogram("itl", st.itl);
  const pc = st.prefix_cache;
  $("stat-hit").textContent = pc.queries ? (pc.hit_rate * 100).toFixed(1) + "%" : "–";
  $("stat-hit-detail").textContent = `${fmt(pc.hits)} of ${fmt(pc.queries)} prompt tokens` +
    (st.disk ? ` (RAM ${fmt(pc.hits_by_tier.ram)}, disk ${fmt(pc.hits_by_tier.disk)})` : "");
  $("stat-steps").textContent = st.num_steps;
  $("stat-gen").textContent = st.totals.generation_tokens;
  $("stat-preempt").textContent = st.totals.preemptions;
  const spec = st.speculative;
  $("spec-stat").hidden = !spec?.enabled;
  if (spec?.enabled) {
    $("stat-spec").textContent = spec.drafted_tokens ? (spec.acceptance_rate * 100).toFixed(1) + "%" : "–";
    $("stat-spec-detail").textContent = `${fmt(spec.accepted_tokens)} of ${fmt(spec.drafted_tokens)} drafted tokens`;
  }
  if (view.lastGen) { // a smoothed rate from the engine's own clock
    const dt = st.time - view.lastGen.time, dn = st.totals.generation_tokens - view.lastGen.n;
    if (dt > 0) view.tps = 0.6 * view.tps + 0.4 * (dn / dt);
  }
  view.lastGen = { time: st.time, n: st.totals.generation_tokens };
  $("stat-tps").textContent = view.tps.toFixed(1);
  if (view.model !== st.model) { view.model = st.model; $("model").textContent = `${st.model} · up to ${st.max_model_len} tokens per request`; }
}

async function poll() {
  try {
    const r = await fetch("/v1/engine/state", { headers: headers() });
    const body = await r.json();
    if (r.ok) { render(body); setHealth("ready", true); }
    else setHealth(r.status === 401 ? "API key needed" : body.error?.message || `HTTP ${r.status}`, false);
  } catch (e) {
    setHealth("server unreachable", false);
  }
  setTimeout(poll, POLL_MS);
}
function setHealth(text, ok) { const h = $("health"); h.textContent = text; h.className = "pill " + (ok ? "ready" : "bad"); }

// -- the chat ---------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function* sseEvents(response) { // `data: ...` payloads of a text/event-stream body
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.state = "streaming";
  $("send").disabled = true;
  let answer = "";
  const started = performance.now();
  let firstAt = null;
  try {
    const body = { messages: conversation, stream: true, max_tokens: Number($("max-tokens").value) || 128, kvserve: { timeline: true } };
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!r.ok) throw new Error((await r.json()).error?.message || `HTTP ${r.status}`);
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (!view.ownId && chunk.id) { view.ownId = `${chunk.id}-0`; view.ownMax = 0; out.dataset.requestId = chunk.id; }
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        if (firstAt === null) firstAt = performance.now();
        answer += delta;
        out.textContent = answer;
        out.scrollIntoView({ block: "end" });
      }
      const tl = chunk.kvserve?.timeline?.prompts?.[0];
      if (tl) showTimeline(out, tl, firstAt === null ? null : firstAt - started);
    }
    conversation.push({ role: "assistant", content: answer });
    out.dataset.state = "done";
  } catch (e) {
    out.classList.add("error");
    out.textContent = (answer ? answer + "\n" : "") + `error: ${e.message}`;
    out.dataset.state = "error";
    conversation.pop();
  } finally {
    $("send").disabled = false;
    setTimeout(() => { view.ownId = null; }, 3000); // keep the highlight a moment after the end
  }
}

function showTimeline(out, tl, clientTtft) {
  const s = tl.summary, ms = (x) => (x === null || x === undefined ? "–" : (x * 1e3).toFixed(0) + " ms");
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `queue ${ms(s.queue_wait)} · first token ${ms(s.time_to_first_token)}` +
    (clientTtft !== null ? ` (here ${clientTtft.toFixed(0)} ms)` : "") +
    ` · ${s.prefill_chunks} prefill chunk${s.prefill_chunks === 1 ? "" : "s"}, ${s.decode_steps} decode steps` +
    (s.preemptions ? `, ${s.preemptions} preemptions` : "") + ` · total ${ms(s.total)}`;
  out.append(meta);
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("clear").addEventListener("click", () => { conversation.length = 0; $("messages").replaceChildren(); });
$("api-key").value = localStorage.getItem("kvserve-api-key") || "";
$("api-key").addEventListener("change", () => localStorage.setItem("kvserve-api-key", $("api-key").value.trim()));
poll();
