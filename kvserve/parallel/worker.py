"""A tensor-parallel worker (ranks 1..): load this rank's shard, then run every step rank 0 sends.

    torchrun --nproc-per-node 2 -m kvserve serve ...     # ranks 1.. land here from `serve`
    python -m kvserve.parallel.worker                    # as spawned by rank 0 (RANK etc. set)

The worker runs the same per-op forward as rank 0 on its heads and FFN columns, over its own share
of the KV pool (its KV heads, the same block ids as rank 0's), and samples nothing: rank 0 runs
the LM head and the sampler. A block is zeroed the first time a step writes into it, as rank 0's
runner does, so masked attention never multiplies stale NaN.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from kvserve.kv.sizing import KVSizing, allocate_kv_pool
from kvserve.model.attention import AttentionMetadata
from kvserve.model.loader import load_checkpoint
from kvserve.parallel.group import OP_BATCH_INVARIANT, OP_STEP, OP_STOP, PARENT_ENV, TPGroup, env_world
from kvserve.parallel.model import build_shard, set_batch_invariant
from kvserve.parallel.shard import plan

log = logging.getLogger("kvserve.parallel")


def _exit_with_parent(parent: int) -> None:
    """A spawned worker must not outlive the process that spawned it (killed, or exited without
    sending OP_STOP): poll its parent pid."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="kvserve-tp-parent", daemon=True).start()


def run(group: TPGroup) -> int:
    spec = group.receive_spec()
    if spec is None:  # rank 0 refused the split (its error says why)
        return 1
    torch.set_num_threads(spec.threads)
    dtype = getattr(torch, spec.dtype)  # a torch dtype's name, e.g. float32
    try:
        ckpt = load_checkpoint(spec.model, dtype, spec.quantization)
        p = plan(ckpt.config, ckpt.tensors, group.size)
        model = build_shard(ckpt, p, group.rank, dtype, group)
        set_batch_invariant(model, spec.batch_invariant)
        model.set_activation_levels(spec.act_levels)
        local = p.local_config(ckpt.config, group.rank)
        kv_caches = allocate_kv_pool(KVSizing(spec.num_blocks, spec.block_size, local.num_hidden_layers,
                                              local.num_key_value_heads, local.head_dim, getattr(torch, spec.kv_dtype)))
    except Exception:
        log.exception("tensor-parallel rank %d failed to load its shard", group.rank)
        group.all_ok(False)
        return 1
    if not group.all_ok(True):
        return 1
    bs = spec.block_size
    never_written = bytearray(b"\x01") * spec.num_blocks
    with torch.inference_mode():
        while True:
            op, arg, step = group.receive()
            if op == OP_STOP:
                return 0
            if op == OP_BATCH_INVARIANT:
                set_batch_invariant(model, bool(arg))
                continue
            assert op == OP_STEP and step is not None
            fresh = [b for b in torch.unique(step.slots // bs).tolist() if never_written[b]]
            if fresh:
                for b in fresh:
                    never_written[b] = 0
                idx = torch.tensor(fresh, dtype=torch.long)
                for kv in kv_caches:
                    kv.index_fill_(2, idx, 0)
            meta = AttentionMetadata(slot_mapping=step.slots, query_lens=step.query_lens, seq_lens=step.seq_lens,
                                     block_tables=step.block_tables, block_size=bs)
            model.forward(step.ids, step.positions, kv_caches, meta)


def main() -> int:
    world = env_world()
    if world is None or world[0] == 0:
        print("kvserve.parallel.worker runs ranks 1.. of a tensor-parallel launch (RANK, WORLD_SIZE, MASTER_ADDR, "
              "MASTER_PORT set, as torchrun or `kvserve serve --tensor-parallel-size N` set them)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s[rank {world[0]}]: %(message)s",
                        stream=sys.stderr)
    if PARENT_ENV in os.environ:
        _exit_with_parent(int(os.environ[PARENT_ENV]))
    group = TPGroup(world[0], world[1], os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))
    try:
        return run(group)
    except RuntimeError as e:  # rank 0 went away mid-wait: its connection closed
        log.info("rank 0 is gone (%s): exiting", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return 0


if __name__ == "__main__":
    sys.exit(main())
