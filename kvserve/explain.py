"""kvserve explain: one prompt through the real pipeline, every stage shown with measured numbers.

It answers the questions a first request raises: what the model actually reads (tokens), why
the whole prompt is computed before the first new token (prefill: every prompt token's K/V
must exist for attention), why each later token costs about the same (decode: one token per
step, reading every weight once), and why the KV cache grows with every token. The closing
section sets the measured times against this machine's own ceilings, measured on the spot:
arithmetic (a matmul's FLOP/s) and memory (a large read's bytes/s).

It drives LLM.prefill() / LLM.decode(): the same tokenizer, runner, model, sampler and paged KV
pool the engine uses, one sequence, greedy sampling.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.kv.kv_size import human, read_bandwidth
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.llm import LLM, KVCache

SPARKS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Step:
    """One forward pass: the prefill (all prompt tokens) or a decode step (one token)."""

    index: int  # 0 is the prefill
    tokens_in: int  # tokens whose K/V this step computed
    seconds: float
    token_id: int  # the token it sampled
    piece: str
    cache_tokens: int  # tokens with K/V in the cache after the step
    cache_blocks: int
    cache_bytes: int
    # a mixture of experts': per sparse layer, the experts the step's last row chose (the router's first first)
    experts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Ceilings:
    """This machine's limits, measured with torch in the model's dtype."""

    matmul_flops: float  # FLOP/s of a square matmul
    read_bytes: float  # bytes/s of summing a tensor far larger than the caches


@dataclass
class Explanation:
    model: str
    dtype: str
    kv_dtype: str
    threads: int
    prompt_ids: list[int]
    pieces: list[str]
    block_size: int
    block_bytes: int
    kv_bytes_per_token: int
    weight_bytes_read: int  # per one-token forward pass: every matmul weight it multiplies and the LM head
    matmul_params: int  # weights a token multiplies through (LM head apart; of experts, its chosen ones)
    lm_head_params: int
    attn_flops_per_pair: int  # FLOPs of one query attending to one cached token, all layers
    steps: list[Step] = field(default_factory=list)
    ceilings: Ceilings | None = None
    # The prefill's prefix-cache hits per tier (tokens) and each tier's blocks after it.
    hit_tokens_ram: int = 0
    hit_tokens_disk: int = 0
    ram_blocks_used: int = 0
    ram_blocks_cached: int = 0  # cached blocks in the pool that no sequence holds
    disk_blocks: int | None = None  # block files in the disk tier; None: no tier
    disk_bytes: int = 0
    num_experts: int = 0  # a mixture of experts': experts per sparse layer, and chosen per token
    experts_per_token: int = 0

    @property
    def prefill(self) -> Step:
        return self.steps[0]

    @property
    def decode_steps(self) -> list[Step]:
        return self.steps[1:]

    def prefill_flops(self) -> float:
        n = len(self.prompt_ids)
        # Linear layers per token, the LM head for the last token only, causal attention n^2/2.
        return 2 * self.matmul_params * n + 2 * self.lm_head_params + self.attn_flops_per_pair * n * (n + 1) / 2

    def decode_flops(self, context: int) -> float:
        return 2 * (self.matmul_params + self.lm_head_params) + self.attn_flops_per_pair * context

    def decode_bytes(self, context: int) -> float:
        return self.weight_bytes_read + self.kv_bytes_per_token * context


def measure_ceilings(dtype: torch.dtype, seconds: float = 0.3) -> Ceilings:
    """Best-of-several matmul FLOP/s and read bytes/s (a quick probe, noisy on a shared machine)."""
    n = 1024
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = float("inf")
    deadline = time.perf_counter() + seconds / 2
    for i in range(50):
        t0 = time.perf_counter()
        torch.mm(a, b)
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if i >= 3 and t1 > deadline:
            break
    return Ceilings(matmul_flops=2 * n**3 / best, read_bytes=read_bandwidth(seconds / 2))


def _piece(llm: LLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id])


def _step(index: int, n: int, seconds: float, token: int, cache: KVCache, llm: LLM) -> Step:
    experts = tuple(tuple(lw.experts.last_chosen[-1].tolist()) for lw in llm.model.layers
                    if lw.experts and lw.experts.last_chosen is not None)
    return Step(index, n, seconds, token, _piece(llm, token), cache.num_tokens, cache.num_blocks, cache.nbytes,
                experts)


def explain(
    llm: LLM,
    prompt: str | list[int],
    max_tokens: int = 16,
    *,
    measure: bool = True,
    on_step: Callable[[Step, KVCache], None] | None = None,
) -> Explanation:
    """Prefill `prompt`, decode up to max_tokens tokens greedily, and time every step.

    on_step(step, cache) is called after each step while the cache is still open (tests read the
    pool's own accounting there)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = llm.engine.inputs.process(prompt, params)
    cfg, model = llm.config, llm.model
    d, q, kv = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    # a token's MLP weights: a dense layer's, or its chosen experts' in a sparse one
    mlp = sum(3 * h * (cfg.num_experts_per_tok * cfg.moe_intermediate_size if cfg.sparse(i) else ffn)
              for i in range(cfg.num_hidden_layers))
    embed = model.embed  # a tensor, or GGUF blocks kept quantized
    embed_bytes = embed.nbytes if not isinstance(embed, torch.Tensor) else embed.numel() * embed.element_size()
    e = Explanation(
        model=llm.model_name, dtype=str(llm.dtype).removeprefix("torch."),
        kv_dtype=str(llm.kv_dtype).removeprefix("torch."), threads=torch.get_num_threads(),
        prompt_ids=ids, pieces=[_piece(llm, t) for t in ids],
        block_size=llm.manager.block_size, block_bytes=llm.kv_sizing.block_bytes,
        kv_bytes_per_token=llm.kv_sizing.bytes_per_token,
        # The embedding is only looked up (one row per token) unless it doubles as the LM head.
        weight_bytes_read=model.active_nbytes - (0 if model.tied else embed_bytes),
        matmul_params=cfg.num_hidden_layers * (h * (q + 2 * kv) + q * h) + mlp,
        lm_head_params=cfg.vocab_size * h,
        attn_flops_per_pair=cfg.num_hidden_layers * cfg.num_attention_heads * 4 * d,  # q.k and p.v
        num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
    )
    native = llm.runner.native  # asked to leave its rows' experts where the per-op path does
    traced = native is not None and native.trace
    if native is not None:
        native.trace = True
    try:
        _run(llm, ids, params, max_tokens, e, on_step)
    finally:
        if native is not None:
            native.trace = traced
    if measure:
        e.ceilings = measure_ceilings(llm.dtype)
    return e


def _run(llm: LLM, ids: list[int], params: SamplingParams, max_tokens: int, e: Explanation,
         on_step: Callable[[Step, KVCache], None] | None) -> None:
    """The prefill and the decode steps of `explain`, each timed into e.steps."""
    # One throwaway token first: the first forward pass pays one-time costs (allocator, thread
    # pool, kernel set-up) that would otherwise be counted as prefill. It fills no full block.
    warm, _ = llm.prefill(ids[:1], params)
    warm.close()
    stats = llm.manager.prefix_stats
    hits, disk_hits = stats.hits, stats.disk_hits
    t0 = time.perf_counter()
    cache, token = llm.prefill(ids, params)
    with cache:
        e.steps.append(_step(0, len(ids), time.perf_counter() - t0, token, cache, llm))
        e.hit_tokens_disk = stats.disk_hits - disk_hits
        e.hit_tokens_ram = stats.hits - hits - e.hit_tokens_disk
        e.ram_blocks_used = llm.manager.pool.num_used_blocks
        e.ram_blocks_cached = llm.manager.pool.num_cached_free_blocks
        if llm.manager.disk is not None:
            disk = llm.manager.disk.stats()
            e.disk_blocks, e.disk_bytes = disk.blocks, disk.bytes_used
        if on_step is not None:
            on_step(e.steps[-1], cache)
        for i in range(1, max_tokens):
            if token in llm.eos_token_ids:
                break
            t0 = time.perf_counter()
            cache, token = llm.decode(cache, token, params)
            e.steps.append(_step(i, 1, time.perf_counter() - t0, token, cache, llm))
            if on_step is not None:
                on_step(e.steps[-1], cache)


# -- the report ---------------------------------------------------------------------------------
def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))] for v in values)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _bound(flops: float, nbytes: float, c: Ceilings) -> tuple[float, float, str]:
    t_flops, t_bytes = flops / c.matmul_flops, nbytes / c.read_bytes
    return t_flops, t_bytes, "arithmetic (FLOPs)" if t_flops > t_bytes else "memory (bytes moved)"


def _experts_section(e: Explanation, layers_shown: int = 4) -> list[str]:
    """A mixture of experts: which experts each token went through (the first sparse layers), and how many
    of each layer's experts the tokens used between them."""
    steps = [s for s in e.steps if s.experts]
    if not steps:
        return []
    sparse = len(steps[0].experts)
    shown = min(layers_shown, sparse)
    out = ["", f"   Experts: each token went through {e.experts_per_token} of {e.num_experts} in each of {sparse} sparse "
           f"layers (first {shown} shown, the router's first choice first)"]
    for s in steps:
        out.append(f"   {s.index:4d}  {s.piece!r:<16.16} " + " | ".join(" ".join(f"{x:d}" for x in chosen)
                                                                         for chosen in s.experts[:shown]))
    used = [len({x for s in steps for x in s.experts[layer]}) for layer in range(sparse)]
    out.append(f"   Experts used by these {len(steps)} tokens, per layer: {' '.join(map(str, used))} of {e.num_experts}; "
               "a decode step reads only its tokens' experts' weights.")
    return out


def format_explanation(e: Explanation, max_rows: int = 24) -> str:
    n, p = len(e.prompt_ids), e.prefill
    out = [f"kvserve explain: {e.model}, {e.dtype} activations, {e.kv_dtype} KV cache, {e.threads} threads", ""]
    out.append(f"1. Tokenize: the model reads {n} tokens, not characters")
    shown = " ".join(f"{t}:{piece!r}" for t, piece in zip(e.prompt_ids[:48], e.pieces[:48]))
    out.append(f"   {shown}" + (f" ... (+{n - 48})" if n > 48 else ""))
    hit = e.hit_tokens_ram + e.hit_tokens_disk
    if hit:
        out += ["", f"2. Prefill: {n - hit} of {n} prompt tokens in one forward pass (the first {hit} from the prefix "
                f"cache), {_ms(p.seconds)} = {n / p.seconds:,.0f} prompt tokens/s"]
    else:
        out += ["", f"2. Prefill: all {n} prompt tokens in one forward pass, {_ms(p.seconds)} = {n / p.seconds:,.0f} tokens/s"]
    out.append("   Each layer's attention needs every earlier token's K and V, so the prompt is computed")
    out.append("   in full before the first new token can exist; that wait is the time to first token.")
    out.append(f"   First token: {p.piece!r} (id {p.token_id})")
    out.append(f"   KV cache: {p.cache_tokens} tokens in {p.cache_blocks} block{'s' if p.cache_blocks != 1 else ''} of {e.block_size} = {human(p.cache_bytes)} "
               f"({human(e.kv_bytes_per_token)} per token, {human(e.block_bytes)} per block)")
    if e.hit_tokens_ram or e.hit_tokens_disk or e.disk_blocks is not None:
        tiers = f"{e.hit_tokens_ram} from RAM" + ("" if e.disk_blocks is None else f", {e.hit_tokens_disk} from disk")
        held = f"RAM {e.ram_blocks_used} blocks in use, {e.ram_blocks_cached} cached" + (
            "" if e.disk_blocks is None else f"; disk {e.disk_blocks} blocks ({human(e.disk_bytes)})")
        out.append(f"   Prefix cache: {tiers} of {n} prompt tokens were not computed again; now {held}")
    dec = e.decode_steps
    out += ["", f"3. Decode: one token per step, each step a forward pass over 1 token ({len(dec)} steps)"]
    if dec:
        out.append("   step  token              time   cache tokens  blocks       bytes")
        rows = dec if len(dec) <= max_rows else dec[: max_rows // 2] + dec[-max_rows // 2 :]
        for i, s in enumerate(rows):
            if len(dec) > max_rows and i == max_rows // 2:
                out.append("    ...")
            out.append(f"   {s.index:4d}  {s.piece!r:<16.16} {_ms(s.seconds):>8}   {s.cache_tokens:12,d}  "
                       f"{s.cache_blocks:6d}  {human(s.cache_bytes):>10}")
        times = [s.seconds for s in dec]
        med = statistics.median(times)
        out.append(f"   time per step {sparkline(times)}  median {_ms(med)} = {1 / med:.1f} tokens/s")
        out.append(f"   The cache grew by {human(e.kv_bytes_per_token)} per token; a new block is taken every "
                   f"{e.block_size} tokens.")
    text = "".join(s.piece for s in e.steps)
    out += ["", f"   Output: {text!r}"]
    out += _experts_section(e)
    c = e.ceilings
    if c is None:
        return "\n".join(out)
    out += ["", f"4. Why: this machine now does {c.matmul_flops / 1e9:.0f} GFLOP/s ({e.dtype} matmul) and reads "
            f"{c.read_bytes / 1e9:.1f} GB/s (measured just now; a shared machine is noisy)"]
    balance = c.matmul_flops / c.read_bytes
    pf, pb = e.prefill_flops(), e.weight_bytes_read + e.kv_bytes_per_token * n
    tf, tb, bound = _bound(pf, pb, c)
    out.append(f"   Prefill: {pf / 1e9:.2f} GFLOP ({n} tokens x {2 * e.matmul_params / 1e6:.0f} MFLOP + LM head "
               f"+ attention) -> at least {_ms(tf)} of arithmetic;")
    out.append(f"   it reads the {human(e.weight_bytes_read)} of weights once -> at least {_ms(tb)}. Bound by {bound}; "
               f"measured {_ms(p.seconds)}.")
    # A pass is arithmetic-bound once each weight byte is used for more FLOPs than the machine's balance.
    bytes_per_param = e.weight_bytes_read / (e.matmul_params + e.lm_head_params)
    out.append(f"   A pass turns arithmetic-bound at about {balance * bytes_per_param / 2:.0f} tokens "
               f"(machine balance {balance:.1f} FLOP/byte x {bytes_per_param:.3g} bytes per weight / 2 FLOP).")
    if dec:
        ctx = dec[-1].cache_tokens
        df, db = e.decode_flops(ctx), e.decode_bytes(ctx)
        tf, tb, bound = _bound(df, db, c)
        out.append(f"   Decode step: {df / 1e9:.3f} GFLOP -> at least {_ms(tf)}; but it reads every weight again plus "
                   f"the cache ({human(db)}) -> at least {_ms(tb)}.")
        out.append(f"   Bound by {bound}; measured median {_ms(med)} ({tb / med:.0%} of the bytes ceiling). Running many")
        out.append("   sequences in one step shares that read among them: the reason for continuous batching.")
    return "\n".join(out)
