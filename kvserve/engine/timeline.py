"""Where a request's time went: a bounded per-request record of what the engine did with it.

For each request: arrival, when its prompt was ready as token ids, when the engine queued it,
each prefill chunk (and any recompute after a preemption) with the step's batch, each decode
step with its batch (one that verified a draft counts its drafted and accepted tokens, per
request and per step), preemptions, the first token and the finish. The engine thread writes
(three call sites: add_request, after each step's forward pass, at the finish); the server reads
copies through a lock, so nothing else of the engine is touched from another thread.

The same hooks keep what the live page (server/static, via engine/snapshot.py) shows of the engine as a whole: the last
`keep_steps` steps' batches (prefill vs decode tokens) and histograms of time to first token
and inter-token latency.

Memory is bounded twice: the timelines of live requests plus the last `keep` finished ones are
kept, and each keeps at most `max_events` events (a long generation keeps its first steps; the
summary still counts all of them).
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.request import Request
    from kvserve.engine.scheduler import SchedulerOutput

# (kind, start, end, seq index, tokens, batch sequences, batch tokens); unused fields are None.
Event = tuple[str, float, "float | None", "int | None", "int | None", "int | None", "int | None"]
_COUNTED = ("prefill", "recompute", "decode", "preempted", "drafted", "accepted")
KEEP_FINISHED = 128  # finished requests whose timelines are kept
# Histogram bucket upper edges, milliseconds (the last bucket is everything above).
LATENCY_EDGES_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


@dataclass(frozen=True)
class StepRecord:
    start: float
    end: float
    prefill_tokens: int  # prompt chunks and recomputation
    decode_tokens: int  # with drafted tokens
    num_seqs: int
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class Histogram:
    def __init__(self, edges: tuple[float, ...] = LATENCY_EDGES_MS) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(self.edges, ms)] += 1

    def to_json(self) -> dict[str, Any]:
        return {"edges_ms": list(self.edges), "counts": list(self.counts)}


@dataclass
class _Timeline:
    arrival: float
    prompt_tokens: int
    n: int
    events: list[Event] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTED, 0))
    dropped: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    last_token: dict[int, float] = field(default_factory=dict)  # seq index → when its last token came


class TimelineRecorder:
    def __init__(self, keep: int = KEEP_FINISHED, max_events: int = 1024, keep_steps: int = 120) -> None:
        self.keep = keep
        self.max_events = max_events
        self.steps: deque[StepRecord] = deque(maxlen=keep_steps)
        self.num_steps = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self._live: dict[str, _Timeline] = {}
        self._done: OrderedDict[str, _Timeline] = OrderedDict()
        self._lock = threading.Lock()

    # -- the engine thread ----------------------------------------------------------------
    def add(self, req: Request) -> None:
        tl = _Timeline(req.metrics.arrival_time, len(req.prompt_token_ids), len(req.seqs))
        tl.events.append(("queued", time.monotonic(), None, None, None, None, None))
        with self._lock:
            self._live[req.request_id] = tl

    def mark(self, request_id: str, kind: str, t: float) -> None:
        """A point event from outside the engine (e.g. "tokenized", stamped by the server side)."""
        with self._lock:
            tl = self._live.get(request_id)
            if tl is not None:
                self._append(tl, (kind, t, None, None, None, None, None))

    def step(self, sched: SchedulerOutput, start: float, end: float, accepted: dict | None = None) -> None:
        """After a step's forward pass, before its sequences' counters move on. `accepted`: how
        many of each drafting sequence's draft tokens were accepted."""
        seqs, tokens = len(sched.scheduled), sched.num_tokens
        decode_tokens = 0
        step_drafted = step_accepted = 0
        with self._lock:
            for seq in sched.preempted:
                tl = self._live.get(seq.request.request_id)
                if tl is not None:
                    self._append(tl, ("preempted", start, None, seq.index, None, None, None))
            for seq, n in sched.scheduled:
                tl = self._live.get(seq.request.request_id)
                if tl is None:
                    continue
                done = seq.num_computed_tokens
                draft = sched.drafts.get(seq)
                if draft:
                    a = accepted.get(seq, 0) if accepted else 0
                    tl.counts["drafted"] += len(draft)
                    tl.counts["accepted"] += a
                    step_drafted += len(draft)
                    step_accepted += a
                    kind = "decode"
                elif n == 1 and done >= seq.num_prompt_tokens and done == len(seq.token_ids) - 1:
                    kind = "decode"
                else:  # a prompt chunk; after a preemption the prompt and output are read again
                    kind = "prefill" if seq.num_preemptions == 0 else "recompute"
                if tl.first_scheduled is None:
                    tl.first_scheduled = start
                self._append(tl, (kind, start, end, seq.index, n, seqs, tokens))
                decode_tokens += n if kind == "decode" else 0
                if draft or done + n == len(seq.token_ids):  # this step samples the sequence's next token
                    last = tl.last_token.get(seq.index)
                    if last is None and not tl.last_token:
                        self.ttft.observe((end - tl.arrival) * 1e3)
                    elif last is not None:
                        self.itl.observe((end - last) * 1e3)
                    tl.last_token[seq.index] = end
            self.steps.append(StepRecord(start, end, tokens - decode_tokens, decode_tokens, seqs, step_drafted,
                                         step_accepted))
            self.num_steps += 1

    def finish(self, req: Request) -> None:
        m = req.metrics
        with self._lock:
            tl = self._live.pop(req.request_id, None)
            if tl is None:
                return
            tl.first_token, tl.finished = m.first_token_time, m.finished_time or time.monotonic()
            tl.finish_reasons = [s.finish_reason for s in req.seqs]
            self._done[req.request_id] = tl
            while len(self._done) > self.keep:
                self._done.popitem(last=False)

    def _append(self, tl: _Timeline, event: Event) -> None:
        if event[0] in tl.counts:
            tl.counts[event[0]] += 1
        if len(tl.events) < self.max_events:
            tl.events.append(event)
        else:
            tl.dropped += 1

    # -- any thread -----------------------------------------------------------------------
    def activity(self) -> dict[str, Any]:
        """Recent steps and the latency histograms, as JSON-able data."""
        with self._lock:
            return {
                "num_steps": self.num_steps,
                "steps": [{"t": s.start, "duration": round(s.end - s.start, 6), "prefill_tokens": s.prefill_tokens,
                           "decode_tokens": s.decode_tokens, "seqs": s.num_seqs, "drafted_tokens": s.drafted_tokens,
                           "accepted_tokens": s.accepted_tokens} for s in self.steps],
                "ttft": self.ttft.to_json(),
                "itl": self.itl.to_json(),
            }

    def get(self, request_id: str) -> dict[str, Any] | None:
        """The request's timeline as JSON-able data (seconds since arrival), or None if unknown
        or long forgotten."""
        with self._lock:
            tl = self._live.get(request_id) or self._done.get(request_id)
            if tl is None:
                return None
            return _render(request_id, tl, finished=request_id not in self._live)


def _render(request_id: str, tl: _Timeline, finished: bool) -> dict[str, Any]:
    t0 = tl.arrival

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 6)

    events: list[dict[str, Any]] = [{"event": "arrival", "t": 0.0, "prompt_tokens": tl.prompt_tokens}]
    for kind, start, end, index, tokens, seqs, batch_tokens in tl.events:
        e: dict[str, Any] = {"event": kind, "t": rel(start)}
        if end is not None:
            e["end"] = rel(end)
        if index is not None and tl.n > 1:
            e["index"] = index
        if tokens is not None:
            e |= {"tokens": tokens, "batch_seqs": seqs, "batch_tokens": batch_tokens}
        events.append(e)
    if tl.first_token is not None:
        events.append({"event": "first_token", "t": rel(tl.first_token)})
    if finished:
        events.append({"event": "finished", "t": rel(tl.finished), "finish_reasons": tl.finish_reasons})
    events.sort(key=lambda e: e["t"])  # stable: a step's start and end keep their order
    queued = next((e["t"] for e in events if e["event"] == "queued"), None)
    summary = {
        "queue_wait": None if tl.first_scheduled is None or queued is None else round(rel(tl.first_scheduled) - queued, 6),
        "time_to_first_token": rel(tl.first_token),
        "total": rel(tl.finished) if finished else None,
        "prefill_chunks": tl.counts["prefill"],
        "recompute_chunks": tl.counts["recompute"],
        "decode_steps": tl.counts["decode"],
        "preemptions": tl.counts["preempted"],
        "drafted_tokens": tl.counts["drafted"],
        "accepted_tokens": tl.counts["accepted"],
        "events_dropped": tl.dropped,
    }
    return {"request_id": request_id, "finished": finished, "arrival_monotonic": t0, "summary": summary, "events": events}
