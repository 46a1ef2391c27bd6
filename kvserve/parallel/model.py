"""A Llama model split over tensor-parallel ranks: each rank's shard, and rank 0's front.

Every rank builds the same `LlamaModel` from its shard (kvserve/parallel/shard.py) under a local
config (its heads, its FFN width), with o_proj and down_proj wrapped in `AllReduced`: their
partial sums meet in an all-reduce, after which every rank holds the whole hidden state, so the
residual stream, the norms and the next layer's input are the same on all ranks. The LM head
runs on rank 0 alone (replicated: tied to the embedding, which every rank keeps whole).

`TensorParallelModel` is what rank 0's runner sees: `forward` sends the step's inputs to the
workers, then runs rank 0's shard; `logits` is rank 0's. It is not a `LlamaModel`, so
`NativeDecode` (one C call for every layer, with no place for an all-reduce between them) does
not take it: under tensor parallelism decode steps run the per-op forward.
"""
from __future__ import annotations

import logging
import weakref

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.kv.sizing import KVSizing, size_kv_pool
from kvserve.model.attention import AttentionMetadata
from kvserve.model.linear import LinearLayer
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import Checkpoint
from kvserve.parallel.group import OP_BATCH_INVARIANT, LoadSpec, TPGroup, connect, env_world
from kvserve.parallel.shard import ShardPlan, TensorParallelError, plan, shard_tensors

log = logging.getLogger("kvserve.parallel")


class AllReduced:
    """A linear layer split by input columns: each rank's product is a partial sum of the output;
    the all-reduce completes it on every rank."""

    def __init__(self, lin: LinearLayer, group: TPGroup) -> None:
        self.lin, self.group = lin, group

    @property
    def nbytes(self) -> int:
        return self.lin.nbytes

    def set_batch_invariant(self, on: bool) -> None:
        if hasattr(self.lin, "set_batch_invariant"):
            self.lin.set_batch_invariant(on)

    def set_activation_levels(self, levels: int) -> None:
        if hasattr(self.lin, "set_activation_levels"):
            self.lin.set_activation_levels(levels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.lin(x).contiguous())


def set_batch_invariant(model: LlamaModel, on: bool) -> None:
    """LlamaModel.set_batch_invariant, reaching inside the all-reduced layers too."""
    model.set_batch_invariant(on)
    for lw in model.layers:
        for lin in (lw.o, lw.down):
            if isinstance(lin, AllReduced):
                lin.set_batch_invariant(on)


def build_shard(ckpt: Checkpoint, p: ShardPlan, rank: int, dtype: torch.dtype, group: TPGroup) -> LlamaModel:
    """This rank's model over its shard (consumes ckpt.tensors)."""
    local = p.local_config(ckpt.config, rank)
    model = LlamaModel(local, shard_tensors(ckpt.tensors, ckpt.config, p, rank, keep_lm_head=rank == 0), dtype)
    for lw in model.layers:
        lw.o = AllReduced(lw.o, group)
        lw.down = AllReduced(lw.down, group) if lw.down is not None else None  # (plan() refuses experts)
    return model


class TensorParallelModel:
    """Rank 0's face of the split model, in place of a LlamaModel (the runner's `model`)."""

    def __init__(self, local: LlamaModel, config: ModelConfig, group: TPGroup, p: ShardPlan) -> None:
        self.local, self.config, self.group, self.plan = local, config, group, p
        self.dtype = local.dtype
        self.tensor_parallel_size = group.size
        self._finalizer = weakref.finalize(self, group.close)  # at close(), collection or exit

    def __getattr__(self, name: str):  # layers, embed, ops, ... for tools that look inside (rank 0's shard)
        return getattr(self.local, name)

    @property
    def nbytes(self) -> int:
        """Bytes of rank 0's shard (each worker holds about as much, less the LM head if untied)."""
        return self.local.nbytes

    def set_batch_invariant(self, on: bool) -> None:
        with self.group.lock:
            self.group.send_op(OP_BATCH_INVARIANT, int(on))
            set_batch_invariant(self.local, on)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        if kv_scales is not None:  # (LLM refuses an int8 pool under tensor parallel: the workers' pools are float)
            raise ValueError("tensor parallel does not support an int8 KV cache yet")
        with self.group.lock:  # the workers' step and every all-reduce in it, uninterrupted
            if self.group.closed:
                raise RuntimeError("the tensor-parallel workers are stopped: build a new LLM")
            self.group.send_step(input_ids, positions, meta.slot_mapping, meta.query_lens, meta.seq_lens,
                                 meta.block_tables)
            try:
                return self.local.forward(input_ids, positions, kv_caches, meta)
            except BaseException:
                # The workers are somewhere inside this step's all-reduces: no later step can pair
                # with them, so stop them rather than run out of step.
                self.group.closed = True
                for child in self.group.children:
                    child.kill()
                raise

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.logits(hidden)

    def close(self) -> None:
        """Stop the workers (also at exit)."""
        self._finalizer()


def start(ckpt: Checkpoint, size: int, dtype: torch.dtype, quantization: str, kv_dtype: torch.dtype,
          cache: CacheConfig, batch_invariant: bool, act_levels: int) -> tuple[TensorParallelModel, KVSizing]:
    """Rank 0: split the checkpoint over `size` ranks (spawning ranks 1.. on loopback unless torchrun
    started them), tell each what to load, build rank 0's shard; the KV pool sized for rank 0's heads
    (the largest share), which every rank allocates with the same number of blocks."""
    try:
        p = plan(ckpt.config, ckpt.tensors, size)
    except TensorParallelError:
        if env_world() is not None:  # torchrun's workers are waiting for a spec: send none, they exit
            connect(size).abort()
        raise
    local_config = p.local_config(ckpt.config, 0)
    sizing = size_kv_pool(local_config, cache, kv_dtype)
    group = connect(size)
    try:
        group.send_spec(LoadSpec(str(ckpt.path), str(dtype).removeprefix("torch."), quantization,
                                 str(kv_dtype).removeprefix("torch."), sizing.num_blocks, sizing.block_size,
                                 batch_invariant, torch.get_num_threads(), act_levels))
        local = build_shard(ckpt, p, 0, dtype, group)
        set_batch_invariant(local, batch_invariant)
        local.set_activation_levels(act_levels)
        if not group.all_ok(True):
            raise RuntimeError("a tensor-parallel worker failed to load its shard (its error is in the log above)")
    except BaseException:
        group.closed = True
        for child in group.children:
            child.kill()
        group.reap()
        raise
    log.info("tensor parallel: %d ranks; KV heads per rank %s, FFN columns per rank %s; decode runs the per-op "
             "forward (the native decode step has no all-reduce)", size,
             [b - a for a, b in p.kv_heads], [b - a for a, b in p.ffn])
    return TensorParallelModel(local, ckpt.config, group, p), sizing
