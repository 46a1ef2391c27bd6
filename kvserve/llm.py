"""LLM: the public face. prefill() and decode() by hand, or generate() through the engine.

    from kvserve import LLM
    llm = LLM()                                  # the embedded default model
    prompt = llm.encode_chat([{"role": "user", "content": "Explain quantum computing like I'm ten."}])
    cache, token = llm.prefill(prompt)
    for _ in range(200):                         # a limit: sampling need not meet EOS
        if token in llm.eos_token_ids:
            break
        print(llm.tokenizer.decode([token]), end="")
        cache, token = llm.decode(cache, token)

The cache is a sequence's block table in the paged KV pool; watch it grow through num_tokens,
num_blocks and nbytes. Its blocks return to the pool on close() or when it is dropped.

Weights: `quantization="auto"` (the default) keeps a GGUF's quantized matrices as the file stores
them and multiplies them directly (model/quant.py: ~5x fewer bytes per decoded token for the
default model); "none" decodes them to `dtype` (the exact float path: float32 reproduces
transformers); "q8_0" / "q4_0" quantize a float checkpoint (safetensors, F16/BF16 GGUF) on load.
The KV cache follows: float16 under quantized weights (half the bytes per cached token), the
model's dtype otherwise (CacheConfig.dtype chooses; kv/sizing.py says why). With
`batch_invariant=True` quantized layers use the integer kernel at every batch size, so a greedy
request's tokens are the same whatever else is batched with it; False multiplies 32 rows or more
with a packed bfloat16 copy of the weights where the CPU computes bfloat16 (oneDNN; ~2.4x faster
prefill, 2 more bytes a weight), elsewhere with sgemm past ~128-256 rows. The default (None) is True where the kernel's integer dot is
AVX-512 VNNI or AVX2, which is as fast as sgemm there or faster, and False on the plain C build
(model/quant.py's batch_invariant_by_default).
`activations="int8x2"` has the integer kernels quantize each activation row twice, int8 and then what
int8 left, so quantized weights give the exact float path's answers (KL ~2e-6, docs/quality.md) for
twice the integer dots; "int8" is one level, as llama.cpp's, ~1.7-2x faster in large batches and
prompts, and a slightly different model; "auto" (the default) is int8x2 under a billion parameters
(the default model), int8 above (model/quant.py's ACTIVATIONS).
`CacheConfig(disk_path=...)` adds a disk tier under the prefix cache (kv/disk_tier.py): blocks the
pool evicts are saved there and read back by later prompts, after a restart too.
`speculative=SpeculativeConfig()` drafts tokens by prompt lookup and verifies them in the batch
(engine/speculative.py): greedy output is unchanged, sampled output keeps its distribution;
`SpeculativeConfig(method="draft", draft_model="smollm2-135m")` drafts with a model of the same
vocabulary instead (engine/draft_model.py), e.g. the Q4_1 file for `LLM(dtype="float32",
quantization="none")`, the same model decoded to float32.
"""
from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from kvserve import cpu, gguf_reader
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.runner import ModelRunner, SeqChunk
from kvserve.engine.sampler import NO_TOKEN, Generator, Sampler, SamplingRow
from kvserve.errors import CacheClosedError, EngineStalledError, NonFiniteLogitsError, OutOfBlocksError
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.disk_tier import DiskTier, tier_fields
from kvserve.kv.manager import KVCacheManager, peak_blocks
from kvserve.kv.sizing import allocate_kv_pool, allocate_kv_scales, auto_kv_dtype, size_kv_pool
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import DEFAULT_MODEL, keeps_quantized, load_checkpoint
from kvserve.model.quant import ACTIVATIONS, QuantizedWeight, activation_levels, batch_invariant_by_default
from kvserve.outputs import OutputKind, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.parallel.model import TensorParallelModel

log = logging.getLogger("kvserve")

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def _as_batch(prompts: str | list[int] | Sequence[str | list[int]]) -> Sequence[str | list[int]]:
    """A prompt (text, or token ids) as a batch of one; a batch as it is (the check is at run time)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast("str | list[int]", prompts)]
    return cast("Sequence[str | list[int]]", prompts)


def default_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX; kvserve runs on the CPU):
    decode reads every weight once per token, and half the bytes is nearly twice the speed
    (see docs/benchmarks.md). float32 elsewhere, where bfloat16 is emulated and slower: there an
    explicit dtype="bfloat16" keeps bf16 weights (half the bytes) widened in registers by the
    kernel (model/linear.py), but "auto" stays float32 so the default float path stays exact;
    a GGUF's quantized blocks (quantization="auto") already read fewer bytes than either."""
    return torch.bfloat16 if cpu.has_native_bf16() else torch.float32


def parse_dtype(dtype: str | torch.dtype, what: str = "dtype", int8: bool = False) -> torch.dtype:
    """A dtype by name ("auto": default_dtype()); `what` names the setting in the error; int8:
    "int8" is a choice too (the KV cache's)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             **({"int8": torch.int8} if int8 else {})}
    if dtype not in names:
        raise ValueError(f"{what} must be one of {', '.join(names)}, got {dtype!r}")
    return names[dtype] or default_dtype()


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: allocations of this size and up get mappings of their own
LOAD_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD = 4 << 20, 32 << 20


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (mallopt, malloc_trim), else None: that allocator decides."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _map_large_allocations() -> None:
    """While a model loads, allocations of 4 MiB and up get mappings of their own, so that the load's
    temporaries (tens of MB: a fused expert's blocks before packing, a tensor converted before it is split)
    go back to the OS when freed. glibc otherwise serves such sizes from its heaps once its mmap threshold
    has risen past them (it follows the largest chunk freed, up to 32 MiB), and what the load freed below a
    live block stayed resident: on a server's loader thread (an arena of its own) the gpt-oss-20b shape
    (12 layers, Zen 4) peaked at 12.2 GB of anonymous memory, 8.1 on the main thread, 7.7 with this."""
    if libc := _glibc():
        libc.mallopt(_M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)


def _release_freed_memory() -> None:
    """After a load: the mmap threshold at 32 MiB, where glibc's own ends up (serving's temporaries are
    reused from the heap as before), and the heap's free pages given back: glibc keeps what the load's
    temporaries freed (parsed metadata, staging copies; ~20 MB for the default model) until malloc_trim.
    (A load that fails leaves the threshold at 4 MiB: larger allocations are mapped anew, nothing worse.)"""
    gc.collect()
    if libc := _glibc():
        libc.mallopt(_M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD)
        libc.malloc_trim(0)


class KVCache:
    """One sequence's KV cache: its block table in the pool and the tokens computed into it."""

    def __init__(self, llm: LLM, seq_id: str, num_prompt_tokens: int) -> None:
        self._manager = llm.manager
        self._block_bytes = llm.kv_sizing.block_bytes
        self.seq_id = seq_id
        self.token_ids: list[int] = []  # tokens whose K/V are in the cache
        self.num_prompt_tokens = num_prompt_tokens
        self.generator: Generator | None = None  # from params.seed
        self._finalizer = weakref.finalize(self, self._manager.free, seq_id)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_ids(self) -> list[int]:
        return self._manager.block_ids(self.seq_id)

    @property
    def num_blocks(self) -> int:
        return self._manager.num_held_blocks(self.seq_id)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool this cache holds (whole blocks, K and V, all layers)."""
        return self.num_blocks * self._block_bytes

    def close(self) -> None:
        """Return the blocks to the pool (shared prefix blocks stay cached for reuse)."""
        self._finalizer()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_tokens} tokens in {self.num_blocks} blocks, {self.nbytes} bytes"
        return f"KVCache({state})"


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str | torch.dtype = "auto",
        *,
        quantization: str = "auto",
        cache: CacheConfig = CacheConfig(),
        scheduler: SchedulerConfig = SchedulerConfig(),
        max_model_len: int | None = None,
        seed: int | None = None,
        batch_invariant: bool | None = None,
        activations: str = "auto",
        speculative: SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        t0 = time.perf_counter()
        _map_large_allocations()  # until _release_freed_memory, below
        # "auto" under weights kept quantized: float32 activations. The integer kernels widen
        # activations to float32 anyway, and the native decode step (model/native_decode.py)
        # computes in float32, as llama.cpp does; the pool's "auto" is float16 then (kv/sizing.py).
        auto_f32 = dtype == "auto" and keeps_quantized(model, quantization)
        self.dtype = torch.float32 if auto_f32 else parse_dtype(dtype)
        self.quantization = quantization
        ckpt = load_checkpoint(model, self.dtype, quantization)
        self.config: ModelConfig = ckpt.config
        levels = activation_levels(activations, self.config)
        self.activations = {v: k for k, v in ACTIVATIONS.items()}[levels]  # the choice "auto" made
        self.model_path = ckpt.path
        self.model_name = model
        self.tokenizer = Tokenizer.load(ckpt.path)
        self.eos_token_ids: frozenset[int] = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.config.eos_token_ids)
        quantized = any(isinstance(w, QuantizedWeight) for w in ckpt.tensors.values())  # (the model takes them)
        self.kv_dtype = (auto_kv_dtype(self.dtype, quantized) if cache.dtype == "auto"
                         else parse_dtype(cache.dtype, "KV cache dtype", int8=True))
        self.tensor_parallel_size = tensor_parallel_size
        self.batch_invariant = batch_invariant_by_default() if batch_invariant is None else batch_invariant
        if tensor_parallel_size != 1:  # what the ranks do not share yet (kvserve/parallel/)
            unsupported = [what for what, on in (("an int8 KV cache", self.kv_dtype == torch.int8),
                                                 ("the KV disk tier", cache.disk_path is not None),
                                                 ("speculative decoding", speculative is not None)) if on]
            if unsupported:
                raise ValueError(f"tensor parallel (size {tensor_parallel_size}) does not support {' or '.join(unsupported)} "
                                 "yet: leave them out, or run one process")
        self.model: LlamaModel | TensorParallelModel  # (the latter stands in for a LlamaModel: its __getattr__)
        if tensor_parallel_size == 1:
            self.model = LlamaModel(self.config, ckpt.tensors, self.dtype)
            self.kv_sizing = size_kv_pool(self.config, cache, self.kv_dtype)
        else:  # this process is rank 0: the pool holds its share of the KV heads (kvserve/parallel/)
            from kvserve.parallel import model as tensor_parallel

            self.model, self.kv_sizing = tensor_parallel.start(ckpt, tensor_parallel_size, self.dtype, quantization,
                                                               self.kv_dtype, cache, self.batch_invariant, levels)
        # True: a greedy request's tokens do not depend on what else is in its batch (quantized
        # layers keep the integer kernel at every batch size).
        self.model.set_batch_invariant(self.batch_invariant)
        if tensor_parallel_size == 1:  # (the ranks took theirs at load)
            self.model.set_activation_levels(levels)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        window_blocks = peak_blocks(self.config.sliding_window, cache.block_size, scheduler.max_num_batched_tokens)
        if window_blocks is None or window_blocks > self.kv_sizing.num_blocks:
            # A sequence holds its whole context: the pool bounds it (under a sliding window only the
            # window's blocks and a step's are held at once, and the pool need only hold those).
            self.max_model_len = min(self.max_model_len, self.kv_sizing.num_tokens)
        if self.config.rope_scaling.kind == "longrope":  # its frequencies follow the context served
            if tensor_parallel_size != 1:
                raise ValueError("tensor parallel does not serve a LongRoPE model yet: run one process")
            self.model.set_context(self.max_model_len)
        kv_caches, kv_scales = allocate_kv_pool(self.kv_sizing), allocate_kv_scales(self.kv_sizing)
        disk = None
        if cache.disk_path is not None and cache.enable_prefix_caching:
            s = self.kv_sizing
            disk = DiskTier(cache.disk_path, cache.disk_bytes, tier_fields(
                ckpt.path, self.dtype, quantization, self.batch_invariant, self.activations, self.kv_dtype, cache.block_size, s.num_layers,
                s.num_kv_heads, s.head_dim, self.tokenizer.fingerprint(),
                self.max_model_len if self.config.rope_scaling.kind == "longrope" else None), kv_caches, cache.block_size,
                kv_scales=kv_scales)
        self.manager = KVCacheManager(BlockPool(self.kv_sizing.num_blocks, cache.enable_prefix_caching), cache.block_size,
                                      self.config.sliding_window, scheduler.max_num_batched_tokens, disk)
        self._sampler = Sampler(self.config.vocab_size, seed=seed)
        self.runner = ModelRunner(self.model, kv_caches, cache.block_size, self._sampler, self.eos_token_ids,
                                  kv_scales)
        self.scheduler_config = scheduler
        self.drafter = None  # a draft model, for speculative method "draft" (engine/draft_model.py)
        if speculative is not None and speculative.method == "draft":
            from kvserve.engine.draft_model import DraftModelDrafter

            self.drafter = DraftModelDrafter.load(speculative, self.tokenizer, self.config.vocab_size, cache.block_size,
                                                  self.kv_sizing.num_tokens, scheduler.max_num_seqs,
                                                  scheduler.max_num_batched_tokens, self.dtype)
        self.engine = LLMEngine(
            self.tokenizer, self.runner, self.manager, scheduler, self.config.vocab_size,
            self.max_model_len, self.eos_token_ids, speculative, self.drafter,
        )
        self._ids = itertools.count()
        self._live_caches: weakref.WeakSet[KVCache] = weakref.WeakSet()  # open prefill() caches
        gguf_reader.forget()  # config, weights and tokenizer are read: the parsed file is not needed again
        _release_freed_memory()
        self.load_seconds = time.perf_counter() - t0
        c = self.config
        experts = (f" ({self.model.active_nbytes / 1e6:.0f} MB read per token: {c.num_experts_per_tok} of {c.num_experts} "
                   "experts)") if c.num_experts and tensor_parallel_size == 1 else ""
        log.info("model: %s (%s, %s, quantization %s), %.0f MB of weights%s, loaded in %.1f s", model, ckpt.path.name,
                 str(self.dtype).removeprefix("torch."), quantization, self.model.nbytes / 1e6, experts, self.load_seconds)
        log.info(self.kv_sizing.describe())

    def offload_prefix_cache(self) -> int:
        """Move every cached prefix block no sequence holds out of RAM: to the disk tier (waiting
        until the files are written), or nowhere without one. Returns the blocks saved."""
        return self.manager.offload_cached()

    # -- prompts --------------------------------------------------------------------------
    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` (Jinja) instead of the model's template; its end-of-turn
        tokens stop generation too."""
        self.tokenizer = self.tokenizer.with_chat_template(source)
        self.engine.use_tokenizer(self.tokenizer)
        self.eos_token_ids = self.engine.eos_token_ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's own chat template; `tools` (OpenAI's
        list of functions) reach the template, or the system message if the template ignores them."""
        extra: dict[str, Any] = {"tools": tools} if tools else {}  # (no tools: the template sees none defined)
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **extra)

    # -- the seed's API -------------------------------------------------------------------
    def prefill(self, prompt: str | list[int], params: SamplingParams | None = None) -> tuple[KVCache, int]:
        """Read the whole prompt once into a new KV cache; return it and the first token."""
        params = params or GREEDY
        ids = self.engine.inputs.process(prompt, params)
        cache = KVCache(self, f"prefill-{next(self._ids)}", len(ids))
        self._live_caches.add(cache)
        if params.seed is not None:
            cache.generator = Sampler.make_generator(params.seed)
        try:
            prefix = self.manager.find_prefix(ids)
            done = len(prefix) * self.manager.block_size
            self.manager.record_prefix_query(len(ids), prefix)
            step = self.scheduler_config.max_num_batched_tokens  # bounds attention memory
            # The whole prompt's blocks up front (a full pool fails before any work), or under a
            # sliding window each chunk's as it comes: blocks behind the window are freed meanwhile.
            upto = min(len(ids), done + step) if self.manager.sliding_window else len(ids)
            if not self.manager.allocate(cache.seq_id, upto, prefix):
                raise OutOfBlocksError(
                    f"the KV pool has {self.manager.pool.num_free_blocks} free blocks, the prompt needs "
                    f"{self.manager.blocks_needed(upto) - len(prefix)}: close other caches first"
                )
            cache.token_ids = ids[:done]
            while done < len(ids):
                chunk = ids[done : done + step]
                if not self.manager.allocate(cache.seq_id, done + len(chunk)):
                    raise OutOfBlocksError(f"the KV pool has {self.manager.pool.num_free_blocks} free blocks, too few "
                                           "for the prompt's next chunk: close other caches first")
                logits = self.runner.run([SeqChunk(chunk, done, cache.block_ids, done + len(chunk) == len(ids))])
                done += len(chunk)
                cache.token_ids = ids[:done]
                self.manager.cache_computed(cache.seq_id, cache.token_ids, done)
                self.manager.slide(cache.seq_id, done)
            return cache, self._sample(logits, cache, params)
        except BaseException:
            cache.close()
            raise

    def decode(self, cache: KVCache, token: int, params: SamplingParams | None = None) -> tuple[KVCache, int]:
        """Append token to the cache (computing its K/V) and return the cache and the next token."""
        if cache.closed:
            raise CacheClosedError("this KV cache is closed and its blocks are back in the pool: prefill again")
        if not isinstance(token, int) or not 0 <= token < self.config.vocab_size:
            raise ValueError(f"token must be an id in [0, {self.config.vocab_size}), got {token!r}")
        n = cache.num_tokens
        if n + 1 > self.max_model_len:
            raise ValueError(f"the context is full ({self.max_model_len} tokens): start a new cache")
        if not self.manager.allocate(cache.seq_id, n + 1):
            raise OutOfBlocksError("the KV pool has no free block for this cache: close other caches first")
        logits = self.runner.run([SeqChunk([token], n, cache.block_ids, True)])
        cache.token_ids.append(token)
        self.manager.cache_computed(cache.seq_id, cache.token_ids, n + 1)
        self.manager.slide(cache.seq_id, n + 1)
        return cache, self._sample(logits, cache, params or GREEDY)

    def _sample(self, logits: torch.Tensor, cache: KVCache, params: SamplingParams) -> int:
        ids = cache.token_ids
        row = SamplingRow(params, ids[: cache.num_prompt_tokens], ids[cache.num_prompt_tokens :], cache.generator, self.eos_token_ids)
        token = self._sampler(logits, [row]).token_ids[0]
        if token == NO_TOKEN:
            raise NonFiniteLogitsError(
                f"the model produced NaN or infinite logits after {cache.num_tokens} tokens: no token can be "
                "chosen (broken weights, or an overflow in a low-precision dtype: try dtype='float32')"
            )
        return token

    def live_caches(self) -> list[KVCache]:
        """The prefill() caches still open (holding blocks of the pool)."""
        return [c for c in self._live_caches if not c.closed]

    # -- the offline batch API ------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt through the engine, batched continuously; outputs in input order.

        Scoring a text: `SamplingParams(max_tokens=0, prompt_logprobs=k)` generates nothing and
        returns, in `output.prompt_logprobs`, each prompt token's log-probability given the ones
        before it (the first is None) with the k most likely tokens at each place.

        Raises EngineStalledError, naming the open prefill() caches, when the blocks they hold
        leave no room for the next request (rather than waiting for a close that cannot come)."""
        prompts = _as_batch(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        return self._run(prompts, plist, use_tqdm, "generate")

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], use_tqdm: bool = True) -> list[RequestOutput]:
        """Each prompt's embedding, in input order: `outputs[i].embedding`, the mean of the final
        (normed) hidden states over the prompt's tokens, L2-normalised (a list of hidden_size
        floats). Through the engine, batched with anything else it runs; the prompt's KV blocks
        return to the pool (full ones stay in the prefix cache, as after any request)."""
        prompts = _as_batch(prompts)
        return self._run(prompts, [SamplingParams(max_tokens=0)] * len(prompts), use_tqdm, "embed", pooling=True)

    def _run(self, prompts: Sequence[str | list[int]], plist: list[SamplingParams], use_tqdm: bool, what: str,
             pooling: bool = False) -> list[RequestOutput]:
        ids = [self.engine.inputs.process(p, sp) for p, sp in zip(prompts, plist)]  # all checked first
        base = next(self._ids)
        rids = [f"{what[:3]}-{base}-{i}" for i in range(len(prompts))]
        for rid, p, sp, tok in zip(rids, prompts, plist, ids):
            self.engine.add_request(rid, tok, sp, output_kind=OutputKind.FINAL_ONLY, pooling=pooling,
                                    prompt=p if isinstance(p, str) else None)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc=what, unit="req")
        try:
            while len(results) < len(rids):
                try:
                    outs = self.engine.step()
                except EngineStalledError as e:
                    live = self.live_caches()
                    if not live:
                        raise
                    raise EngineStalledError(
                        f"{e}; {len(live)} open prefill() caches hold {sum(c.num_tokens for c in live)} tokens in "
                        f"{sum(c.num_blocks for c in live)} blocks: close() them (or use them as context "
                        "managers) before generate()"
                    ) from None
                for out in outs:
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in rids]
