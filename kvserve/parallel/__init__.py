"""Tensor parallelism: one model's weights and KV cache split over processes (torch.distributed,
gloo). shard.py: who holds what; group.py: the ranks and their messages; model.py: the split
model and rank 0's front; worker.py: ranks 1..'s loop."""
