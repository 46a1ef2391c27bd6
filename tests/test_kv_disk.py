"""The KV disk tier: prefix blocks evicted from RAM are served from disk, bit for bit, across
restarts, never across fingerprints, within a byte bound, and never when torn or corrupt."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.snapshot import engine_state
from kvserve.explain import explain, format_explanation
from kvserve.kv.block_pool import prefix_block_hashes
from kvserve.kv.disk_store import DiskStore, encode_block
from kvserve.kv.kv_size import human

GREEDY = dict(temperature=0.0, ignore_eos=True)
SP = SamplingParams(max_tokens=4, **GREEDY)
NS = bytes(range(16))


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


def on_disk(path: Path, gib: float = 0.01) -> dict:
    return {"disk_path": str(path), "disk_bytes": int(gib * (1 << 30))}


def served(llm, prompt: list[int]):
    before = llm.engine.stats()
    out = llm.generate(prompt, SP, use_tqdm=False)[0]
    after = llm.engine.stats()
    return out, after.prefix_cache_disk_hits - before.prefix_cache_disk_hits, after.disk


def test_blocks_offloaded_to_disk_come_back_with_the_same_tokens(make_llm, tmp_path) -> None:
    llm = make_llm(cache=on_disk(tmp_path))
    plain = make_llm(caching=False)
    prompt = prompt_of(200)
    first = llm.generate(prompt, SP, use_tqdm=False)[0]
    # 200 prompt + 3 computed output tokens: 12 full blocks cached, all saved.
    assert llm.offload_prefix_cache() == 12
    assert llm.manager.pool.num_cached_free_blocks == 0
    assert llm.engine.stats().disk.blocks == 12 and llm.engine.stats().disk.blocks_written == 12
    out, disk_hit_tokens, disk = served(llm, prompt)
    # The lookup stops before the block of the last prompt token: 199 // 16 = 12 blocks.
    assert out.num_cached_tokens == 192 and disk_hit_tokens == 192
    assert disk.hit_blocks == 12 and disk.hit_tokens == 192 and disk.load_errors == 0
    assert out.token_ids == first.token_ids == plain.generate(prompt, SP, use_tqdm=False)[0].token_ids
    llm.manager.pool.check_invariant()
    state = engine_state(llm.engine)  # the live page's picture: both tiers
    assert state["prefix_cache"]["hits_by_tier"] == {"ram": 0, "disk": 192}
    assert state["disk"]["blocks"] == 12 and state["disk"]["hit_blocks"] == 12
    assert state["pool"]["cached"] == 12  # the loaded blocks are RAM's again, and still on disk


def test_an_int8_pool_comes_back_with_its_row_scales(make_llm, tmp_path) -> None:
    """An int8 block's file holds its K/V and its float16 row scales: both come back bit for bit."""
    llm = make_llm(cache={**on_disk(tmp_path), "dtype": "int8"})
    plain = make_llm(caching=False, cache={"dtype": "int8"})
    prompt = prompt_of(200, seed=3)
    first = llm.generate(prompt, SP, use_tqdm=False)[0]
    runner = llm.runner
    ids = [b.block_id for b in llm.manager.find_prefix(prompt)]
    saved = [(kv[:, :, ids].clone(), sc[:, :, ids].clone()) for kv, sc in zip(runner.kv_caches, runner.kv_scales)]
    assert len(ids) == 12 and llm.offload_prefix_cache() == 12
    for kv, sc in zip(runner.kv_caches, runner.kv_scales):  # nothing left in RAM to be read by mistake
        kv.zero_()
        sc.zero_()
    out, disk_hit_tokens, disk = served(llm, prompt)
    assert disk_hit_tokens == 192 and disk.load_errors == 0
    assert out.token_ids == first.token_ids == plain.generate(prompt, SP, use_tqdm=False)[0].token_ids
    ids = [b.block_id for b in llm.manager.find_prefix(prompt)]
    for (k, s), kv, sc in zip(saved, runner.kv_caches, runner.kv_scales):
        assert torch.equal(kv[:, :, ids], k) and torch.equal(sc[:, :, ids], s)


def test_explain_shows_the_hits_of_each_tier(make_llm, tmp_path) -> None:
    llm = make_llm(cache=on_disk(tmp_path))
    prompt = prompt_of(60, seed=12)
    cold = explain(llm, prompt, max_tokens=2, measure=False)
    assert (cold.hit_tokens_ram, cold.hit_tokens_disk, cold.disk_blocks) == (0, 0, 0)
    llm.offload_prefix_cache()
    warm = explain(llm, prompt, max_tokens=2, measure=False)
    assert (warm.hit_tokens_ram, warm.hit_tokens_disk, warm.disk_blocks) == (0, 48, 3)
    assert warm.steps[0].token_id == cold.steps[0].token_id
    lines = format_explanation(warm).splitlines()
    assert ("   Prefix cache: 0 from RAM, 48 from disk of 60 prompt tokens were not computed again; now RAM 4 blocks "
            f"in use, 0 cached; disk 3 blocks ({human(warm.disk_bytes)})") in lines
    assert any(line.startswith("2. Prefill: 12 of 60 prompt tokens in one forward pass (the first 48 from") for line in lines)


def test_blocks_the_pool_evicts_are_written_and_read_back(make_llm, tmp_path) -> None:
    llm = make_llm(num_blocks=12, cache=on_disk(tmp_path))
    a = prompt_of(60, seed=1)
    first = llm.generate(a, SP, use_tqdm=False)[0]
    for seed in (2, 3):  # 2 x 7 blocks through a 12-block pool: every block of `a` is reused
        llm.generate(prompt_of(100, seed), SP, use_tqdm=False)
    llm.manager.disk.flush()
    assert all(llm.manager.pool.lookup(h, ids) is None for h, ids in prefix_block_hashes(a, 16))
    out, disk_hit_tokens, disk = served(llm, a)
    assert disk_hit_tokens == 48 and disk.hit_blocks == 3  # (60 - 1) // 16 blocks
    assert out.token_ids == first.token_ids
    assert disk.writes_dropped == 0 and disk.blocks_written >= 3
    llm.manager.pool.check_invariant()


def hit_rate_over(llm, docs: list[list[int]], rounds: int, seed: int) -> float:
    """Prefix-cache hit rate (tokens found / looked up) of `rounds` passes over docs in shuffled
    order, each request a doc and a suffix of its own; the disk writer is let finish after each."""
    rng = random.Random(seed)
    before = llm.engine.stats()
    for r in range(rounds):
        for i in rng.sample(range(len(docs)), len(docs)):
            llm.generate(docs[i] + prompt_of(8, seed=1000 * r + i), SP, use_tqdm=False)
            if llm.manager.disk is not None:
                llm.manager.disk.flush()
    after = llm.engine.stats()
    return (after.prefix_cache_hits - before.prefix_cache_hits) / (after.prefix_cache_queries - before.prefix_cache_queries)


def test_a_working_set_three_times_the_pool_hits_at_least_twice_as_often_with_the_disk_tier(make_llm, tmp_path) -> None:
    """9 documents of 16 blocks through a 48-block pool: RAM holds a third of them, the disk all."""
    docs = [prompt_of(256, seed=100 + d) for d in range(9)]
    ram_only = hit_rate_over(make_llm(num_blocks=48), docs, rounds=5, seed=7)
    tiered_llm = make_llm(num_blocks=48, cache=on_disk(tmp_path, gib=0.05))
    tiered = hit_rate_over(tiered_llm, docs, rounds=5, seed=7)
    print(f"prefix hit rate, working set 3x the pool: RAM only {ram_only:.1%}, with the disk tier {tiered:.1%}")
    assert tiered >= 2 * ram_only and tiered > 0.7  # after the first pass every document is on disk
    assert tiered_llm.engine.stats().disk.writes_dropped == 0


def test_a_restarted_llm_reads_the_same_directory(make_llm, tmp_path) -> None:
    prompt = prompt_of(200, seed=5)
    old = make_llm(cache=on_disk(tmp_path))
    first = old.generate(prompt, SP, use_tqdm=False)[0]
    old.offload_prefix_cache()
    new = make_llm(cache=on_disk(tmp_path))
    out, disk_hit_tokens, disk = served(new, prompt)
    assert disk_hit_tokens == 192 and disk.hit_blocks == 12
    assert out.token_ids == first.token_ids


def test_another_fingerprint_gets_no_hit(make_llm, tmp_path) -> None:
    prompt = prompt_of(200, seed=6)
    writer = make_llm(cache=on_disk(tmp_path))
    writer.generate(prompt, SP, use_tqdm=False)
    writer.offload_prefix_cache()
    for other in ({"block_size": 32}, {"dtype": "bfloat16"}):
        reader = make_llm(cache={**on_disk(tmp_path), **other})
        out, disk_hit_tokens, disk = served(reader, prompt)
        assert disk_hit_tokens == 0 and out.num_cached_tokens == 0 and disk.hit_blocks == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 3  # three namespaces side by side


def test_a_block_under_another_namespace_is_refused(tmp_path) -> None:
    """Even a file moved by hand into our namespace's place is refused: it names its own."""
    key, ids, payload = hashlib.sha256(b"k").digest(), list(range(16)), b"\x01" * 1000
    theirs = DiskStore(tmp_path, bytes(16), 1 << 20)
    assert theirs.put(key, ids, payload)
    ours_path = Path(DiskStore(tmp_path, NS, 1 << 20).path_of(key))
    ours_path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(theirs.path_of(key), ours_path)
    ours = DiskStore(tmp_path, NS, 1 << 20)
    assert key in ours
    assert ours.get(key, ids) is None and ours.counters.load_errors == 1 and not ours_path.exists()


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _allocated(length: int) -> int:
    """What a file of `length` bytes takes on this disk (4 KiB blocks, as ext4 and XFS allocate)."""
    return -(-length // 4096) * 4096


def test_lru_by_bytes_keeps_exactly_what_fits(tmp_path) -> None:
    payload = b"\x07" * 4000
    size = _allocated(sum(len(p) for p in encode_block(_key(0), NS, [0] * 16, payload)))
    store = DiskStore(tmp_path, NS, 3 * size + size // 2)  # room for 3 files, not 4
    for i in range(5):
        assert store.put(_key(i), [i] * 16, payload)
    assert [Path(p).name[:8] for p in store.files()] == [_key(i).hex()[:8] for i in (2, 3, 4)]
    assert store.bytes_used == 3 * size
    assert bytes(store.get(_key(2), [2] * 16)) == payload  # now the most recently used
    assert store.put(_key(5), [5] * 16, payload)
    assert [Path(p).name[:8] for p in store.files()] == [_key(i).hex()[:8] for i in (4, 2, 5)]
    assert len(list(tmp_path.rglob("*.kvb"))) == 3
    assert store.get(_key(3), [3] * 16) is None  # evicted: a miss, not an error
    assert store.counters.load_errors == 0 and store.counters.evicted_files == 3
    assert not store.put(_key(9), [9] * 16, b"\x00" * (4 * size))  # larger than the whole bound
    # A restart with a smaller bound evicts down to it at once.
    smaller = DiskStore(tmp_path, NS, 2 * size)
    assert smaller.num_files == 2 and len(list(tmp_path.rglob("*.kvb"))) == 2 and smaller.bytes_used == 2 * size


def test_a_sparse_file_or_a_file_not_its_own_evicts_nothing(tmp_path) -> None:
    """The bound counts the bytes the disk holds (st_blocks x 512): a 1 GiB sparse file made with
    truncate, named as one of the store's blocks, costs nothing (and fails its checks when read);
    files outside the store's layout are never counted, evicted or deleted."""
    payload, gib = b"\x07" * 4000, 1 << 30
    store = DiskStore(tmp_path, NS, 1 << 20)
    for i in range(10):
        assert store.put(_key(i), [i] * 16, payload)
    used = store.bytes_used
    assert used == sum(f.stat().st_blocks * 512 for f in tmp_path.rglob("*.kvb"))
    sparse = Path(store.path_of(_key(100)))
    ns = tmp_path / NS.hex()
    foreign = [tmp_path / "big.kvb", ns / "big.kvb", ns / "ab" / "big.kvb", tmp_path / "zz" / sparse.name,
               ns / "zz" / sparse.name, sparse.parent / f"{_key(101).hex()}.kvb", tmp_path / "old.kvb.1.2.tmp"]
    assert _key(101).hex()[:2] != sparse.parent.name  # in another key's directory: not the store's place
    for path in [sparse, *foreign]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(gib)
    link = Path(store.path_of(_key(102)))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(tmp_path / "big.kvb")
    os.utime(tmp_path / "old.kvb.1.2.tmp", (0, 0))  # a temporary long dead, but not the store's
    restarted = DiskStore(tmp_path, NS, 1 << 20)
    assert restarted.num_files == 11 and restarted.bytes_used == used  # the ten blocks and the sparse one
    assert restarted.counters.evicted_files == 0
    assert all(bytes(restarted.get(_key(i), [i] * 16)) == payload for i in range(10))
    assert restarted.get(_key(100), [100] * 16) is None and not sparse.exists()  # fails its checks: deleted
    assert all(p.stat().st_size == gib for p in foreign) and link.is_symlink()


WRITER = textwrap.dedent("""
    import hashlib, sys
    from kvserve.kv.disk_store import DiskStore
    store = DiskStore(sys.argv[1], bytes(range(16)), 1 << 40)
    i = 0
    while True:
        store.put(hashlib.sha256(str(i).encode()).digest(), [i] * 16, bytes([i % 251]) * (1 << 20))
        print(i, flush=True)
        i += 1
""")


def test_a_writer_killed_mid_write_leaves_only_whole_blocks(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if int(line) >= 20:
                break
        proc.send_signal(signal.SIGKILL)  # whatever it is writing now is cut off
    finally:
        proc.kill()
        proc.wait()
    store = DiskStore(tmp_path, NS, 1 << 40)
    whole = 0
    for i in range(store.num_files + 5):
        got = store.get(_key(i), [i] * 16)
        if got is not None:
            assert bytes(got) == bytes([i % 251]) * (1 << 20)
            whole += 1
    assert whole == store.num_files >= 21 and store.counters.load_errors == 0
    # By hand: one file cut short, one with a flipped bit. Both are refused and deleted.
    cut, flipped = store.path_of(_key(3)), store.path_of(_key(4))
    os.truncate(cut, os.path.getsize(cut) - 100)
    with open(flipped, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x10]))
    assert store.get(_key(3), [3] * 16) is None and store.get(_key(4), [4] * 16) is None
    assert store.counters.load_errors == 2 and not os.path.exists(cut) and not os.path.exists(flipped)
    assert store.num_files == whole - 2
    assert bytes(store.get(_key(5), [5] * 16)) == bytes([5]) * (1 << 20)


def test_a_corrupt_block_ends_the_disk_hit_there(make_llm, tmp_path) -> None:
    prompt = prompt_of(200, seed=7)
    llm = make_llm(cache=on_disk(tmp_path))
    first = llm.generate(prompt, SP, use_tqdm=False)[0]
    llm.offload_prefix_cache()
    fifth = [h for h, _ in prefix_block_hashes(prompt, 16)][4]
    path = llm.manager.disk.store.path_of(fifth)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    out, disk_hit_tokens, disk = served(llm, prompt)
    assert disk_hit_tokens == 4 * 16 and disk.hit_blocks == 4 and disk.load_errors == 1
    assert out.token_ids == first.token_ids and not os.path.exists(path)
    llm.manager.pool.check_invariant()


def _complete(server, prompt: list[int]) -> str:
    from server_harness import MODEL_NAME

    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow  # two server processes of its own (its flags, a restart)
def test_a_server_serves_a_prefix_from_disk_and_counts_it(tmp_path_factory) -> None:
    from server_harness import start_server, wait_for

    disk = tmp_path_factory.mktemp("kv-disk")
    # 8 KiB blocks of the tiny model: a 26-block pool, so the fillers push the first prompt out.
    flags = ("--kv-cache-gib", "0.0002", "--kv-disk-path", str(disk), "--kv-disk-gib", "0.01")
    server = start_server(tmp_path_factory, *flags)
    a, b = prompt_of(100, seed=8), prompt_of(40, seed=13)
    try:
        first = _complete(server, a)
        assert server.metric("kvserve_kv_disk_hit_blocks_total") == 0
        for seed in (9, 10, 11):
            _complete(server, prompt_of(150, seed))
        wait_for(lambda: server.metric("kvserve_kv_disk_blocks_written_total") >= 6)
        assert _complete(server, a) == first
        assert server.metric("kvserve_kv_disk_hit_blocks_total") == 6  # (100 - 1) // 16
        assert server.metric("kvserve_kv_disk_hit_tokens_total") == 96
        assert server.metric("kvserve_kv_disk_load_errors_total") == 0
        # The second request's evictions are still being written, and the engine's counters are
        # read as of its last step (every 0.5 s while idle): the gauge settles on the files' sum.
        def settled() -> bool:
            return server.metric("kvserve_kv_disk_bytes_used") == sum(f.stat().st_blocks * 512
                                                                      for f in disk.rglob("*.kvb")) > 0

        wait_for(settled)
        assert server.metric("kvserve_kv_disk_bytes_capacity") == int(0.01 * (1 << 30))
        second = _complete(server, b)  # its blocks stay in RAM until the shutdown saves them
    finally:
        server.stop()
    assert "cached blocks saved at shutdown" in server.log_path.read_text()
    restarted = start_server(tmp_path_factory, *flags)
    try:
        assert _complete(restarted, b) == second
        assert restarted.metric("kvserve_kv_disk_hit_blocks_total") == 2  # (40 - 1) // 16
    finally:
        restarted.stop()


def test_serve_refuses_a_disk_bound_without_a_path() -> None:
    r = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--kv-disk-gib", "1"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 2
    assert r.stderr.strip().endswith(
        "kvserve: error: --kv-disk-gib bounds the disk tier: give --kv-disk-path DIR to turn it on")
