"""Tensor parallelism (kvserve/parallel/): 2 ranks on loopback against one process.

Exactness. Splitting o_proj and down_proj by input columns changes the order in which their
products are summed (two partial sums, then the all-reduce), so float32 results differ from one
process in their last bits: the float path asserts the same greedy tokens and logits within
1e-4. The quantized path quantizes each activation block to int8, so a last-bit difference in a
layer's input can move one activation by a whole int8 step: it is held to test_quant.py's
definition of agreement (the same token at nearly every teacher-forced step, partings only at
near-ties of the reference's logits).
"""
from __future__ import annotations

import os
import signal

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import LLM, CacheConfig, SamplingParams
from kvserve.config import ModelConfig
from kvserve.model.quant import QuantizedLinear, QuantizedWeight
from kvserve.parallel.shard import TensorParallelError, _cols, plan
from server_harness import grammar_processes, start_server, wait_for
from family_checks import greedy_along


@pytest.fixture
def one_thread():
    """2 ranks x 1 thread on this 2-core machine (the workers take rank 0's thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _greedy(llm: LLM, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens and the logits that chose each."""
    from kvserve.engine.runner import SeqChunk

    cache, token = llm.prefill(ids)
    out, logits = [token], []
    with cache:
        for _ in range(n - 1):
            k = cache.num_tokens
            assert llm.manager.allocate(cache.seq_id, k + 1)
            row = llm.runner.run([SeqChunk([token], k, cache.block_ids, True)])[0]
            cache.token_ids.append(token)
            token = int(row.argmax())
            out.append(token)
            logits.append(row)
    return out, torch.stack(logits)


@pytest.mark.slow
def test_two_ranks_give_one_process_greedy_tokens_on_the_float_path(tiny_llama_dir, one_thread) -> None:
    cache = CacheConfig(num_blocks=64)
    one = LLM(str(tiny_llama_dir), dtype="float32", cache=cache)
    two = LLM(str(tiny_llama_dir), dtype="float32", cache=cache, tensor_parallel_size=2)
    try:
        # Each rank holds one of the 2 KV heads: half the pool's bytes per token.
        assert two.runner.kv_caches[0].shape == (2, 1, 64, 16, 16) and two.kv_sizing.num_kv_heads == 1
        ids = one.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
        want, want_logits = _greedy(one, ids, 32)
        got, got_logits = _greedy(two, ids, 32)
        assert got == want
        assert torch.allclose(got_logits, want_logits, atol=1e-4, rtol=0)
        # The engine's batch (chunked prefills beside decodes, several sequences) splits the same way.
        prompts = ["Once upon a time", "def fibonacci(n):", "List three prime numbers:"]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert ([o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
                == [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)])
        assert two.manager.pool.num_used_blocks == 0
    finally:
        two.model.close()


def test_a_size_the_model_cannot_split_is_a_clear_error(tiny_llama_dir) -> None:
    with pytest.raises(TensorParallelError, match=r"^tensor parallel size 3 exceeds the model's 2 KV heads: each rank "
                       r"holds whole KV heads, so use a size of at most 2$"):
        LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=8), tensor_parallel_size=3)
    with pytest.raises(TensorParallelError, match=r"^the tensor parallel size must be at least 1, got 0$"):
        LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=8), tensor_parallel_size=0)


def _config(heads: int, kv_heads: int, head_dim: int, ffn: int) -> ModelConfig:
    return ModelConfig("llama", 256, heads * head_dim, ffn, 1, heads, kv_heads, head_dim, 512)


def _blocks(qtype: Q, rows: int, cols: int) -> QuantizedWeight:
    from gguf import GGML_QUANT_SIZES

    per, size = GGML_QUANT_SIZES[qtype]
    return QuantizedWeight(torch.zeros(rows, cols // per * size, dtype=torch.uint8), qtype, (rows, cols))


def test_quantized_splits_fall_on_block_boundaries_or_are_refused() -> None:
    # The default model's shape: 9 heads of 64 over 3 KV heads, FFN 1536. In Q4_1 (32-column blocks)
    # 2 ranks split it 2 + 1 KV heads (o_proj at column 384) and 768 + 768 FFN columns.
    c = _config(9, 3, 64, 1536)
    q41 = {"model.layers.0.self_attn.o_proj.weight": _blocks(Q.Q4_1, 576, 576),
           "model.layers.0.mlp.down_proj.weight": _blocks(Q.Q4_1, 576, 1536)}
    p = plan(c, q41, 2)
    assert p.kv_heads == ((0, 2), (2, 3)) and p.ffn == ((0, 768), (768, 1536)) and p.group == 3
    # In Q4_K (256-column blocks) column 384 falls inside a block of o_proj.
    q4k = {**q41, "model.layers.0.self_attn.o_proj.weight": _blocks(Q.Q4_K, 576, 576)}
    with pytest.raises(TensorParallelError, match=r"^tensor parallel size 2 splits o_proj at column 384 \(6 heads of "
                       r"64\), inside one of its 256-column quantized blocks: choose a size whose head split falls "
                       r"on 256 columns$"):
        plan(c, q4k, 2)
    # An FFN of 6 Q4_K blocks cannot give 8 ranks one each (8 KV heads, so heads are not the limit).
    c8 = _config(8, 8, 256, 1536)
    with pytest.raises(TensorParallelError, match=r"cannot split the FFN's 1536 columns into whole 256-column "
                       r"quantized blocks per rank: use a size of at most 6$"):
        plan(c8, {"model.layers.0.self_attn.o_proj.weight": _blocks(Q.Q4_K, 2048, 2048),
                  "model.layers.0.mlp.down_proj.weight": _blocks(Q.Q4_K, 2048, 1536)}, 8)


class _SplitSum:
    """One process's emulation of a column-split layer: the ranks' partial products, then their sum."""

    def __init__(self, lin: QuantizedLinear, cuts: list[int]) -> None:
        # cut from the stored blocks and laid out for the kernel again, as each rank's shard is
        self.parts = [(a, b, QuantizedLinear(_cols(lin.weight.unpacked(), a, b).packed())) for a, b in zip(cuts, cuts[1:])]
        for _, _, q in self.parts:
            q.set_activation_levels(lin.levels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [q(x[:, a:b].contiguous()) for a, b, q in self.parts]
        return ys[0] + ys[1]


@pytest.mark.slow
def test_two_ranks_on_the_quantized_default_model(one_thread) -> None:
    """Exact against one process that sums the same partial products; against the unsplit model,
    test_quant.py's agreement. Not the near-tie bound: on "The capital of France is" the split
    sums' last bits flip int8 activations enough that, fed the unsplit model's tokens, step 8's
    choice differs where the unsplit model's logits are 6.3 apart (the one-process emulation
    chooses the same as the 2 ranks, so this is the quantized path's arithmetic, not the ranks)."""
    cache = CacheConfig(num_blocks=64)
    one = LLM(cache=cache)
    two = LLM(cache=cache, tensor_parallel_size=2)
    try:
        p, D = two.model.plan, one.config.head_dim
        assert p.kv_heads == ((0, 2), (2, 3)) and p.ffn == ((0, 768), (768, 1536))
        emulated = LLM(cache=cache)
        emulated.runner.native = None  # the per-op path, as the ranks run
        for lw in emulated.model.layers:
            lw.o = _SplitSum(lw.o, [0, p.kv_heads[1][0] * p.group * D, one.config.num_attention_heads * D])
            lw.down = _SplitSum(lw.down, [0, p.ffn[1][0], p.ffn[1][1]])
        steps = agree = 0
        for prompt in ["The capital of France is", "What is 12 times 12?"]:
            ids = one.encode_chat([{"role": "user", "content": prompt}])
            got, got_logits = _greedy(two, ids, 12)
            want, want_logits = _greedy(emulated, ids, 12)
            assert got == want and torch.equal(got_logits, want_logits)
            unsplit, _ = _greedy(one, ids, 12)
            fed = greedy_along(two, ids, unsplit)
            steps += len(unsplit)
            agree += sum(g == w for g, w in zip(fed, unsplit))
        assert agree >= 0.9 * steps
    finally:
        two.model.close()


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_server_of_two_ranks_answers_and_leaves_no_worker_behind(tmp_path_factory) -> None:
    server = start_server(tmp_path_factory, "--tensor-parallel-size", "2")
    try:
        grammar, _ = grammar_processes(server.proc.pid)  # the grammar compiles' fork server is a child too
        workers = [pid for pid in _children(server.proc.pid) if pid not in grammar]
        assert len(workers) == 1 and len(grammar) == 1
        with server.client() as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Hello"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"
        assert "tensor parallel: 2 ranks; KV heads per rank [1, 1]" in server.log()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        wait_for(lambda: not any(_alive(w) for w in workers), timeout=15)
    finally:
        server.stop()
