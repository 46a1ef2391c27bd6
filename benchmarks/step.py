"""`python -m benchmarks.step`: where one decode step's milliseconds go.

At 100+ tokens/s a step lasts under 10 ms, so the cost around the matmuls (Python, torch's
dispatch, packing the batch, sampling) is worth measuring on its own. This prints:
  - the step time of a single-stream decode and of a batch of B decoding sequences, through
    the engine (`LLMEngine.step()`, what the server runs), median over many steps (decode steps
    run as one native call where the model allows it: KVSERVE_NATIVE_DECODE=0 times the per-op
    path instead);
  - where a step's time goes: scheduling, the runner's packing, the forward, the LM head,
    sampling and the engine's update, timed inside real steps;
  - each part of the forward timed alone over all layers (linears, attention, the fused
    elementwise ops), LM head and sampling; what the parts do not add up to is Python and
    dispatch between them;
  - torch's operator count per step (each one a dispatch through the ATen stack);
  - with `--phases`, inside the native step: each thread's work and its wait at the barrier after each
    phase (norm, qkv, attention, ..., LM head), from decode_step.c's profiling build (the same bits).
Timings on a shared machine are noisy: compare figures taken in the same run. `--clock cpu`
times with the process's CPU time instead of the wall clock: on a machine busy with other work
that is the steadier figure (with --threads 1, it is the work the step does).
`--kv-cache-dtype float16,int8 --prompt-len 4096` times the same steps over each KV cache format
in turn, at a long context where reading the cache is a large share of the step.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig
from kvserve.kernels import decode_step
from kvserve.model import quant


clock = time.perf_counter  # --clock cpu: time.process_time


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


GREEDY = {"temperature": 0.0}


def engine_step_ms(llm: LLM, batch: int, steps: int, prompt_len: int = 32, sampling: dict = GREEDY) -> float:
    """Median ms of an engine step in which `batch` sequences each decode one token."""
    engine = llm.engine
    sp = SamplingParams(**sampling, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}", [(7 * i + j) % 1000 + 10 for j in range(prompt_len)], sp)
    while any(s.num_computed_tokens < s.num_prompt_tokens for r in engine.requests.values() for s in r.seqs):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = clock()
        engine.step()
        times.append(clock() - t0)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def breakdown(llm: LLM, batch: int, context: int, reps: int) -> dict[str, float]:
    """ms per step of each part of a decode step of `batch` rows at `context` tokens."""
    from kvserve.engine.sampler import SamplingRow
    from kvserve.model.attention import AttentionMetadata

    model, c = llm.model, llm.config
    kv = llm.runner.kv_caches
    scales = llm.runner.kv_scales or [None] * len(kv)  # an int8 pool's row scales
    bs = llm.manager.block_size
    nblk = -(-context // bs)
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)]
    slots = torch.tensor([t[-1] * bs + (context - 1) % bs for t in tables], dtype=torch.long)
    meta = AttentionMetadata(slot_mapping=slots, query_lens=[1] * batch, seq_lens=[context] * batch,
                             block_tables=tables, block_size=bs)
    H, D = c.num_attention_heads, c.head_dim
    x = torch.randn(batch, c.hidden_size, dtype=model.dtype)
    lw = model.layers[0]
    qkv = lw.qkv(x)
    cos, sin = model.rope(torch.full((batch,), context - 1))
    q, k, v = model.ops.rope_and_store(qkv, cos, sin, kv[0], slots, H, kv_scale=scales[0])
    o = model.attention.forward(q, k, v, kv[0], meta, model.scale, kv_scale=scales[0])
    gu = lw.gate_up(x)
    act = model.ops.glu(gu)
    ids = torch.zeros(batch, dtype=torch.long)
    logits = model.logits(x)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(batch)]
    layers = list(zip(model.layers, kv, scales))

    def each_layer(fn: Callable) -> Callable[[], None]:
        # Every layer's own weights and KV pool, as a step reads them: a loop over one layer
        # would time weights that stay in the cache.
        return lambda: [fn(lw, (cache, scale)) for lw, cache, scale in layers]

    parts = {
        "linears (qkv, o, gate_up, down)": each_layer(
            lambda lw, cache: (lw.qkv(x), lw.o(o.reshape(batch, H * D)), lw.gate_up(x), lw.down(act))),
        "attention (paged decode)": each_layer(
            lambda lw, cache: model.attention.forward(q, k, v, cache[0], dict_meta(meta), model.scale,
                                                      kv_scale=cache[1])),
        "add + RMSNorm (x2)": each_layer(
            lambda lw, cache: (model.ops.add_rms_norm(x.clone(), x, lw.input_norm, 1e-5),
                               model.ops.add_rms_norm(x.clone(), x, lw.post_norm, 1e-5))),
        "RoPE + KV store": each_layer(
            lambda lw, cache: model.ops.rope_and_store(qkv, cos, sin, cache[0], slots, H, kv_scale=cache[1])),
        "SiLU * up": each_layer(lambda lw, cache: model.ops.glu(gu.clone())),
        "embedding + RoPE tables + final norm": lambda: (quant.embedding(ids, model.embed, model.dtype),
                                                         model.rope(torch.full((batch,), context - 1)),
                                                         model.ops.add_rms_norm(x.clone(), x, model.norm, 1e-5)),
        "LM head": lambda: model.logits(x),
        "sampling (greedy)": lambda: llm.engine.sampler(logits, rows),
    }
    out = {name: _median_ms(fn, reps) for name, fn in parts.items()}
    return out


def dict_meta(meta):
    """The same metadata with an empty per-step scratch (as each new step has)."""
    meta.scratch.clear()
    return meta


class _Timed:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **k):
        t0 = clock()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += clock() - t0

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def phases(llm: LLM, batch: int, steps: int, sampling: dict = GREEDY) -> dict[str, float]:
    """ms per engine decode step spent in scheduling, the runner (packing around the model),
    the model forward, the LM head, sampling, and the engine's own update (outputs, stops)."""
    engine, runner, model = llm.engine, llm.runner, llm.model
    run_name = "execute" if hasattr(runner, "execute") else "run"
    timed = {
        "schedule": (engine.scheduler, "schedule"),
        "runner": (runner, run_name),
        "forward": (model, "forward"),
        "lm head": (model, "logits"),
    }
    if runner.native is not None:  # decode steps as one native call (model/native_decode.py)
        timed["native"] = (runner, "native")
    sampler = engine.sampler
    sampler_t = _Timed(sampler)
    holders = [o for o in (engine, runner) if getattr(o, "sampler", None) is sampler]
    for o in holders:
        o.sampler = sampler_t
    wrappers = {}
    for name, (obj, attr) in timed.items():
        wrappers[name] = _Timed(getattr(obj, attr))
        setattr(obj, attr, wrappers[name])
    step_t = _Timed(engine.step)
    try:
        sp = SamplingParams(**sampling, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"ph-{i}", [10 + i, 11, 12, 13], sp)
        engine.step()
        engine.step()
        for w in (*wrappers.values(), sampler_t):
            w.seconds = 0.0
        for _ in range(steps):
            step_t()
    finally:
        for name, (obj, attr) in timed.items():
            if attr in vars(type(obj)):  # a method: drop the instance's wrapper
                delattr(obj, attr)
            else:  # an attribute (the native step): put the object back
                setattr(obj, attr, wrappers[name].fn)
        for o in holders:
            o.sampler = sampler
        for rid in list(engine.requests):
            engine.abort_request(rid)
    ms = {k: w.seconds * 1e3 / steps for k, w in wrappers.items()}
    ms["sampling"] = sampler_t.seconds * 1e3 / steps
    native = ms.get("native", 0.0)
    inside = ms["forward"] + ms["lm head"] + native + (ms["sampling"] if runner in holders else 0.0)
    out = {
        "schedule": ms["schedule"],
        "runner packing (around the model)": ms["runner"] - inside,
        f"model forward ({len(model.layers)} layers)": ms["forward"],
        "LM head": ms["lm head"],
    }
    if "native" in ms:
        out["native step (layers + LM head, one call)"] = native
    out["sampling"] = ms["sampling"]
    total = step_t.seconds * 1e3 / steps
    out["engine update (append, detokenize, outputs)"] = total - ms["schedule"] - ms["runner"] - (
        0.0 if runner in holders else ms["sampling"])
    out["step total"] = total
    return out


def native_phases(llm: LLM, batch: int, steps: int, prompt_len: int = 32,
                  sampling: dict = GREEDY) -> tuple[list[str], list[list[float]]] | None:
    """ms per step of each thread's work and wait in each phase of the native step ([phase][work t0.., wait t0..]),
    from the profiling build of decode_step.c run in real engine steps after prompts of prompt_len tokens (as
    engine_step_ms); None without a native step."""
    native = llm.runner.native
    lib = decode_step.library(phases=True)
    if native is None or lib is None:
        return None
    engine, threads = llm.engine, torch.get_num_threads()
    work = (ctypes.c_double * (threads * len(decode_step.PHASES)))()
    wait = (ctypes.c_double * (threads * len(decode_step.PHASES)))()
    old = native.use_library(lib)
    try:
        sp = SamplingParams(**sampling, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"np-{i}", [(7 * i + j) % 1000 + 10 for j in range(prompt_len)], sp)
        while any(s.num_computed_tokens < s.num_prompt_tokens for r in engine.requests.values() for s in r.seqs):
            engine.step()  # prefill
        engine.step()
        lib.kvserve_phase_times(work, wait, threads)  # from here on
        for _ in range(steps):
            engine.step()
        counted = lib.kvserve_phase_times(work, wait, threads)
    finally:
        native.use_library(old)
        for rid in list(engine.requests):
            engine.abort_request(rid)
    n = len(decode_step.PHASES)
    return list(decode_step.PHASES), [[1e3 * v[t * n + k] / counted for v in (work, wait) for t in range(threads)]
                                      for k in range(n)]


def op_count(llm: LLM, batch: int) -> int:
    """torch operators dispatched in one engine decode step of `batch` rows."""
    engine = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ops-{i}", [10 + i, 11, 12, 13], sp)
    engine.step()
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantize", default="auto", help="the weights, as `kvserve serve --quantize` (default: auto)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--context", type=int, default=64, help="context of the parts timed alone (default: 64)")
    ap.add_argument("--prompt-len", type=int, default=32,
                    help="tokens each decoding sequence has read before the timed steps (default: 32)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the KV cache's element type, or several separated by commas, timed in turn "
                         "(auto, float32, bfloat16, float16, int8; default: auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--phases", action="store_true", help="also time each phase inside the native step, thread by thread")
    ap.add_argument("--temperature", type=float, default=0.0, help="the decoding rows' sampling (default: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    for kv_dtype in args.kv_cache_dtype.split(","):
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantize, cache=CacheConfig(dtype=kv_dtype.strip()))
        print(f"model {args.model}, {args.dtype}, weights {args.quantize}, KV cache {str(llm.kv_dtype).removeprefix('torch.')}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.clock} clock")
        print(f"sampling: temperature {args.temperature:g}, top_p {args.top_p:g}; context {args.prompt_len} tokens")
        run(llm, args, sampling)
        del llm


def run(llm: LLM, args: argparse.Namespace, sampling: dict) -> None:
    for b in (int(s) for s in args.batches.split(",")):
        ms = engine_step_ms(llm, b, args.steps, prompt_len=args.prompt_len, sampling=sampling)
        print(f"\nbatch {b}: engine decode step {ms:.2f} ms ({b * 1e3 / ms:.1f} tok/s), "
              f"{op_count(llm, b)} torch ops per step")
        for name, v in phases(llm, b, args.steps, sampling).items():
            print(f"  {name:40s} {v:7.2f} ms")
        inside = native_phases(llm, b, args.steps, args.prompt_len, sampling) if args.phases else None
        if inside:
            names, rows = inside
            t = len(rows[0]) // 2
            print("  inside the native step, ms per step (thread 0 is the engine's):")
            print(f"  {'phase':40s} " + " ".join(f"{f'work t{i}':>8s}" for i in range(t)) + "   "
                  + " ".join(f"{f'wait t{i}':>8s}" for i in range(t)))
            for name, row in zip(names, rows):
                if any(row):
                    print(f"  {name:40s} " + " ".join(f"{v:8.3f}" for v in row[:t]) + "   "
                          + " ".join(f"{v:8.3f}" for v in row[t:]))
            sums = [sum(r[i] for r in rows) for i in range(2 * t)]
            print(f"  {'all phases':40s} " + " ".join(f"{v:8.3f}" for v in sums[:t]) + "   "
                  + " ".join(f"{v:8.3f}" for v in sums[t:]))
        if args.no_breakdown:
            continue
        print("  the parts, each timed alone over the 30 layers (weights and KV read as a step reads them):")
        parts = breakdown(llm, b, args.context, reps=max(20, args.steps // 2))
        for name, v in parts.items():
            print(f"  {name:40s} {v:7.2f} ms")
        print(f"  {'sum of parts':40s} {sum(parts.values()):7.2f} ms; the rest of the step: "
              f"{ms - sum(parts.values()):.2f} ms (Python, dispatch, packing, scheduling, output)")


if __name__ == "__main__":
    main()
