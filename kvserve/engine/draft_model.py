"""DraftModelDrafter: a smaller model of the target's vocabulary (or the target itself in a cheaper
format, e.g. the default model's Q4_1 blocks drafting for its float32 form) proposes the drafts.

It holds its own model, runner and paged KV pool, managed by the target's rules (kv/manager.py:
blocks allocated per sequence as it grows, all freed when the sequence finishes, is aborted or
preempted; no prefix cache, since drafted tokens are written past the verified ones). Per step,
for all asking sequences together:

  1. catch up: the tokens the draft has not seen (after a verify: the rejected draft's replacement,
     or the last drafted token and the bonus token, as one-token rows; at first: the whole prompt)
     in one forward, split into forwards of at most `step_tokens` tokens; each sequence's last row
     gives d_1;
  2. k - 1 greedy steps: each feeds d_j and takes d_{j+1} = argmax (one token per sequence: the
     native decode step where the draft's weights allow it).

Drafting by argmax makes the proposal a point mass, which is what engine/verify.py assumes, so
greedy output stays identical and sampled output keeps its distribution. After a step the draft
has K/V for the sequence's tokens and d_1..d_{k-1}; next time the fed drafts that the target
accepted are kept (their K/V are the same tokens at the same positions), the rest of the draft's
K/V is invalid and simply overwritten: `valid` tracks how far it holds real tokens.

Each propose() times its forwards (the catch-up prefill apart from the rest), so that the
speculator weighs what drafting costs from this drafter's own timings (engine/speculative.py).

A sequence the draft pool cannot cover, or longer than the draft's context, gets no draft that
step (drafting never preempts anything).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvserve.config import SpeculativeConfig
from kvserve.engine.request import Sequence
from kvserve.engine.runner import ModelRunner, SeqChunk
from kvserve.engine.sampler import Sampler, argmax
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.sizing import KVSizing, allocate_kv_pool, allocate_kv_scales, auto_kv_dtype
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import keeps_quantized, load_checkpoint
from kvserve.model.quant import QuantizedWeight
from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve")

# A catch-up this short (after a verify: 1 or 2 tokens) goes as one-token rows, so that a step of
# them stays a decode step (the native call); longer ones (a prompt) are prefill chunks.
ONE_TOKEN_ROWS = 8


@dataclass
class _DraftState:
    """What the draft's KV holds for one sequence."""

    valid: int = 0  # positions [0, valid) hold the sequence's own tokens
    fed: list[int] = field(default_factory=list)  # drafts whose K/V follow, at valid, valid + 1, ...


def vocabulary_mismatch(draft: str, target: Tokenizer, draft_tok: Tokenizer, target_vocab: int,
                        draft_vocab: int) -> str | None:
    """Why the draft cannot propose ids the target reads the same way; None when it can."""
    if draft_vocab != target_vocab or draft_tok.vocab_size != target.vocab_size:
        what = f"{draft_vocab} (tokenizer {draft_tok.vocab_size}) against the target's {target_vocab} (tokenizer {target.vocab_size})"
    elif draft_tok.backend.get_vocab(with_added_tokens=True) != target.backend.get_vocab(with_added_tokens=True):
        what = "the same size, but different tokens"
    else:
        return None
    return (f"draft model {draft!r} has a vocabulary of {what}: a draft model must share the target's tokenizer; "
            "use a smaller model of the same family, or the target itself in a quantized format")


class DraftModelDrafter:
    """Greedy drafts from a draft model over its own KV pool (see the module docstring)."""

    def __init__(self, model: LlamaModel, kv: KVSizing, step_tokens: int) -> None:
        self.model = model
        self.sizing = kv
        self.max_model_len = model.config.max_position_embeddings
        self.step_tokens = step_tokens  # the most tokens one catch-up forward computes
        kv_caches, kv_scales = allocate_kv_pool(kv), allocate_kv_scales(kv)
        self.vocab_size = model.config.vocab_size
        self.runner = ModelRunner(model, kv_caches, kv.block_size, Sampler(self.vocab_size), kv_scales=kv_scales)
        self.manager = KVCacheManager(BlockPool(kv.num_blocks, enable_caching=False), kv.block_size,
                                      step_tokens=step_tokens)
        self._state: dict[str, _DraftState] = {}
        # The last propose()'s timings, for the speculator's cost model: its catch-up prefill
        # (tokens read in forwards that held a prompt-like chunk, and their seconds: charged per
        # sequence, not per step) and its other forwards, (rows, seconds) each.
        self.prefill_tokens, self.prefill_seconds = 0, 0.0
        self.forward_times: list[tuple[int, float]] = []

    @classmethod
    def load(cls, config: SpeculativeConfig, target_tokenizer: Tokenizer, target_vocab: int, block_size: int,
             target_tokens: int, max_num_seqs: int, step_tokens: int, dtype: torch.dtype) -> DraftModelDrafter:
        """Load config.draft_model (quantization: config.draft_quantization; float weights in `dtype`,
        quantized ones with float32 activations, as LLM does) and refuse it if its vocabulary is not
        the target's. Its pool: config.draft_kv_cache_bytes, or as many tokens as the target's pool
        (target_tokens) and a block per sequence more, so it runs dry no sooner than the target."""
        assert config.draft_model is not None
        quantized = keeps_quantized(config.draft_model, config.draft_quantization)
        dtype = torch.float32 if quantized else dtype
        ckpt = load_checkpoint(config.draft_model, dtype, config.draft_quantization)
        why = vocabulary_mismatch(config.draft_model, target_tokenizer, Tokenizer.load(ckpt.path), target_vocab,
                                  ckpt.config.vocab_size)
        if why:
            raise ValueError(why)
        kv_dtype = auto_kv_dtype(dtype, any(isinstance(w, QuantizedWeight) for w in ckpt.tensors.values()))
        model = LlamaModel(ckpt.config, ckpt.tensors, dtype)  # (takes the tensors out of the dict)
        c = ckpt.config
        probe = KVSizing(1, block_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype)
        if config.draft_kv_cache_bytes is not None:
            num_blocks = config.draft_kv_cache_bytes // probe.block_bytes
            if num_blocks < 1:
                raise ValueError(f"the draft KV cache budget of {config.draft_kv_cache_bytes} bytes holds no block of "
                                 f"{probe.block_bytes} bytes: raise it")
        else:
            num_blocks = -(-target_tokens // block_size) + max_num_seqs
        sizing = KVSizing(num_blocks, block_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype)
        drafter = cls(model, sizing, step_tokens)
        log.info("draft model: %s (%s, %s), %.0f MB of weights; draft %s", config.draft_model, ckpt.path.name,
                 "quantized" if quantized else str(dtype).removeprefix("torch."), model.nbytes / 1e6, sizing.describe())
        return drafter

    def behind(self, seq: Sequence) -> int:
        """Tokens the draft must read for seq before its next draft, when more than the one or two
        a verified step leaves (a new sequence: its whole prompt); else 0."""
        st = self._state.get(seq.seq_id)
        lag = len(seq.token_ids) - (st.valid + self._kept(st, seq.token_ids) if st else 0)
        return lag if lag > ONE_TOKEN_ROWS else 0

    @staticmethod
    def _kept(st: _DraftState, tokens: list[int]) -> int:
        """How many of the fed drafts became the sequence's tokens (their K/V stay valid)."""
        same = 0
        for a, b in zip(st.fed, tokens[st.valid :]):
            if a != b:
                break
            same += 1
        return same

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        self.prefill_tokens, self.prefill_seconds, self.forward_times = 0, 0.0, []
        out: list[list[int]] = [[] for _ in requests]
        todo: list[tuple[int, Sequence, int, int]] = []  # (index in requests, seq, start, k)
        for i, (seq, k) in enumerate(requests):
            tokens = seq.token_ids
            k = min(k, self.max_model_len - len(tokens) + 1)  # the draft reads d_1..d_{k-1} at most
            if k < 1:
                continue
            st = self._state.setdefault(seq.seq_id, _DraftState())
            st.valid, st.fed = min(st.valid + self._kept(st, tokens), len(tokens) - 1), []  # the newest token is always fed
            while k >= 1 and not self.manager.allocate(seq.seq_id, len(tokens) + k - 1):
                k -= 1
            if k >= 1:
                self.manager.trim(seq.seq_id, len(tokens) + k - 1)  # a shorter draft than last time: blocks back
                todo.append((i, seq, st.valid, k))
        if not todo:
            return out
        firsts = self._catch_up([(seq, start) for _, seq, start, _ in todo])
        for (i, seq, _, _), d in zip(todo, firsts):
            out[i].append(d)
            st = self._state[seq.seq_id]
            st.valid = len(seq.token_ids)
        for j in range(1, max(k for *_, k in todo)):  # d_{j+1} from d_j, for the sequences drafting that far
            rows = [(i, seq) for i, seq, _, k in todo if k > j]
            chunks = [SeqChunk([out[i][-1]], len(seq.token_ids) + j - 1, self.manager.block_ids(seq.seq_id), True)
                      for i, seq in rows]
            t = time.perf_counter()
            drafted = self._argmax(self.runner.run(chunks))
            self.forward_times.append((len(chunks), time.perf_counter() - t))
            for (i, seq), d in zip(rows, drafted):
                self._state[seq.seq_id].fed.append(out[i][-1])
                out[i].append(d)
        return out

    def _catch_up(self, seqs: list[tuple[Sequence, int]]) -> list[int]:
        """Feed each sequence's tokens from `start` on (forwards of at most step_tokens tokens);
        each one's greedy next token, in order."""
        firsts: list[int] = [0] * len(seqs)
        pos = [start for _, start in seqs]
        while True:
            budget = self.step_tokens
            chunks, owners = [], []
            prefill = False
            for n, (seq, _) in enumerate(seqs):
                left = len(seq.token_ids) - pos[n]
                if left == 0 or budget == 0:
                    continue
                take = min(left, budget)
                table = self.manager.block_ids(seq.seq_id)
                if take == left <= ONE_TOKEN_ROWS:  # one-token rows, causal over the table (as the runner's drafts)
                    chunks += [SeqChunk([seq.token_ids[p]], p, table, p == pos[n] + take - 1)
                               for p in range(pos[n], pos[n] + take)]
                else:
                    chunks.append(SeqChunk(seq.token_ids[pos[n] : pos[n] + take], pos[n], table, take == left))
                    prefill = True
                if take == left:
                    owners.append(n)
                pos[n] += take
                budget -= take
            if not chunks:
                return firsts
            t = time.perf_counter()
            for n, d in zip(owners, self._argmax(self.runner.run(chunks))):
                firsts[n] = d
            if prefill:  # (the forward's one-token rows ride along; they are what a decode step has anyway)
                self.prefill_tokens += self.step_tokens - budget
                self.prefill_seconds += time.perf_counter() - t
            else:
                self.forward_times.append((len(chunks), time.perf_counter() - t))

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        return argmax(logits[:, : self.vocab_size]).tolist()

    def forget(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or preempted: its draft blocks go back to the pool."""
        self._state.pop(seq.seq_id, None)
        self.manager.free(seq.seq_id)
