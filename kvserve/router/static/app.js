// The router's live page: replicas, their loads and the latest routing decisions, redrawn from
// GET /router/state (a bounded answer: the replicas and a fixed-size ring of decisions).
"use strict";

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);
const view = { polls: 0, lastDecision: 0 };
window.kvserveRouterView = view; // read by the page test

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}
function pct(x) { return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`; }

function drawReplicas(st) {
  const body = $("replicas").querySelector("tbody");
  const most = Math.max(1, ...st.replicas.map((r) => r.outstanding_tokens));
  body.replaceChildren(...st.replicas.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.url = r.url;
    const state = cell("");
    const pill = document.createElement("span");
    const shown = r.state === "healthy" && !r.eligible ? `healthy, out (breaker ${r.breaker})` : r.state === "healthy" ? "healthy" : `out (${r.state})`;
    pill.className = `pill ${r.state}`;
    pill.textContent = shown;
    state.append(pill);
    const tokens = cell(String(r.outstanding_tokens));
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.round(80 * r.outstanding_tokens / most)}px`;
    tokens.append(bar);
    tr.append(cell(r.url, "url"), state, cell(String(r.in_flight)), tokens, cell(pct(r.cache_hit_rate)),
      cell(String(r.requests)), cell(String(r.errors)), cell(r.last_error || "", "err"));
    return tr;
  }));
  const up = st.replicas.filter((r) => r.eligible).length;
  $("replica-summary").textContent = `${up} of ${st.replicas.length} taking requests · ${st.active} request(s) in the router`;
}

function drawDecisions(st) {
  const body = $("decisions").querySelector("tbody");
  body.replaceChildren(...st.decisions.slice().reverse().map((d) => {
    const tr = document.createElement("tr");
    tr.dataset.n = d.n;
    if (d.n > view.lastDecision) tr.className = "new";
    tr.append(cell(String(d.n)), cell(new Date(d.time * 1000).toLocaleTimeString()), cell(d.path, "url"),
      cell(d.replica, "url"), cell(d.outcome, `reason-${d.outcome}`), cell(String(d.matched_tokens)),
      cell(d.cost == null ? "" : String(d.cost)));
    return tr;
  }));
  if (st.decisions.length) view.lastDecision = st.decisions[st.decisions.length - 1].n;
}

async function poll() {
  try {
    const r = await fetch("/router/state");
    if (!r.ok) throw new Error(`/router/state answered ${r.status}`);
    const st = await r.json();
    $("policy").textContent = `policy ${st.policy}` + (st.policy === "cache_aware" ? ` (${st.cache_source})` : "");
    const up = st.replicas.some((x) => x.eligible);
    $("health").textContent = st.draining ? "draining" : up ? "ready" : "no replica";
    $("health").className = `pill ${up && !st.draining ? "ready" : "bad"}`;
    drawReplicas(st);
    drawDecisions(st);
    view.polls += 1;
  } catch (e) {
    $("health").textContent = "unreachable";
    $("health").className = "pill bad";
  }
  setTimeout(poll, POLL_MS);
}
poll();
