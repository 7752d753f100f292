"""kvring's vLLM connector driven by the mini engine (mini_engine.py) in
vLLM's call order, against a real kvring server, with every loaded byte
compared with what the engine's forward wrote.

On CUDA the caches are bigger (8 layers, more than 60 MiB per rank, so that
torch's expandable segments span several 20 MiB chunks); on CPU they are
small, and the CUDA-only allocation kinds are skipped. Every scenario ends
with no lease held on the server, stores and loads counted, no load or
store failure, no block left allocated, and bytes checked.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import replace

import pytest

import kvring
import standin_vllm
from kv_layouts import CUDA_ONLY_KINDS, LAYOUT_CASES, LayoutCase
from mini_engine import CHUNK_TOKENS, DEVICE, EngineError, Report, RequestSpec, Scenario

MiB = 2**20
TIMEOUT_S = 180.0 if DEVICE == "cuda" else 120.0
if DEVICE == "cuda":
    GEOMETRY = {"layers": 8, "heads": 8, "head_size": 128, "min_blocks": 128, "min_bytes": 72 * MiB}
    DEFAULT_LAYOUT = LAYOUT_CASES["0.33-LBNHC-bf16"]  # vLLM 0.33's default preference
else:
    GEOMETRY = {"layers": 2, "heads": 4, "head_size": 64, "min_blocks": 128, "min_bytes": 0}
    DEFAULT_LAYOUT = LAYOUT_CASES["0.33-LBHNC-bf16"]  # vLLM's CPU attention: [B, H, N, 2D]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 32000) for _ in range(n)]


def scenario(name, requests, server, *, layout: LayoutCase = DEFAULT_LAYOUT, tp=1, **kw) -> Scenario:
    """A scenario on `server` with the device's geometry; the cache has
    enough blocks to hold `min_bytes` per rank."""
    head_size = 576 if layout.mla else GEOMETRY["head_size"]  # MLA: latent 512 + rope 64
    sc = Scenario(
        name=name,
        requests=requests,
        server_name=server.name,
        runtime_dir=server.dir,
        device=DEVICE,
        layout=layout,
        layers=GEOMETRY["layers"],
        heads=GEOMETRY["heads"],
        head_size=head_size,
        blocks=1,
        tp=tp,
        **kw,
    )
    per_block = sc.kv_spec().block_bytes
    return replace(sc, blocks=max(GEOMETRY["min_blocks"], -(-GEOMETRY["min_bytes"] // per_block)))


def run(engines, sc: Scenario) -> tuple[Report, dict[str, int]]:
    """Runs `sc`; returns its report and the server's stats afterwards."""
    report = engines(sc.kind).run(sc, TIMEOUT_S)
    with kvring.Client(sc.server_name, runtime_dir=sc.runtime_dir) as c:
        return report, c.stats()


def assert_clean_end(report: Report, stats: dict[str, int]) -> None:
    """What every scenario ends with."""
    assert stats["leases"] == 0, f"leases still held: {stats}"
    assert report.leaked_blocks == 0, "blocks never freed (a finished_sending missing?)"
    ws = report.worker_stats
    assert ws["store_chunks"] > 0 and stats["stored_chunks"] > 0, (ws, stats)
    assert ws["load_chunks"] > 0 and stats["retrieved_chunks"] > 0, (ws, stats)
    assert ws["load_failures"] == 0 and ws["store_failures"] == 0, ws
    assert stats["store_no_space_chunks"] == 0, stats
    assert stats["stored_chunks"] == ws["store_chunks"] and stats["retrieved_chunks"] == ws["load_chunks"], (ws, stats)
    assert report.checked_bytes > 0
    for name, t in report.requests.items():
        assert t.load_failures == 0, name
        assert t.finished or t.aborted, name
    assert report.kv_load_failure_policy == "recompute", "the connector must make failed loads recompute"


def store_then_load(rng: random.Random) -> list[RequestSpec]:
    """r0 stores a 300-token prompt (4 full chunks); then, at once, r1
    (r0's first 256 tokens and 100 more) and r2 (r0's first 200 tokens and
    150 more, with an 80-token local prefix hit: its load starts 16 tokens
    into chunk 1)."""
    p = _tokens(rng, 300)
    return [
        RequestSpec("r0", p),
        RequestSpec("r1", p[:256] + _tokens(rng, 100), after=("r0",)),
        RequestSpec("r2", p[:200] + _tokens(rng, 150), after=("r0",), local_hit=80),
    ]


def assert_store_then_load(report: Report, stats: dict[str, int], tp: int) -> None:
    r0, r1, r2 = (report.requests[n] for n in ("r0", "r1", "r2"))
    assert r0.asks == [(0, 0, False, 0)] and r0.allocs == [0]
    assert r0.delayed_free, "r0 stored chunks: its blocks must wait for finished_sending"
    # r1: 4 chunks hit, loaded asynchronously; update_state_after_alloc once
    # at admission and again when the load is done.
    assert r1.asks == [(0, 256, True, 0)]
    assert r1.allocs == [256, 0]
    assert r1.loaded_tokens == 256
    # r2: chunks 0-2 hit, 80 tokens local: 112 loaded from token 80.
    assert r2.asks == [(80, 112, True, 0)]
    assert r2.allocs == [112, 0]
    assert r2.loaded_tokens == 112
    for name, t in (("r1", r1), ("r2", r2)):
        assert sorted(t.verified) == list(range(tp)), f"{name}'s load not verified by every rank: {t.verified}"
    assert r1.load_blocks[0][:16] != r0.block_ids[:16], "r1 loaded into the blocks r0 stored from"
    # every rank's shard of r0's 4 chunks, r1's 5th, r2's 4th and 5th, and
    # each prompt's tail (its whole blocks past its last whole chunk: none
    # is another's); loaded: r1's chunks 0-3, r2's 1-2
    assert stats["objects"] == 10 * tp and stats["retrieved_chunks"] == 6 * tp, stats
    assert_clean_end(report, stats)


def test_the_engine_uses_the_vllm_the_environment_provides(engines):
    """Real vLLM where it is importable, unless the stand-in is forced."""
    provider = engines("caching").info["vllm"]
    if os.environ.get(standin_vllm.FORCE_ENV) == "1" or importlib.util.find_spec("vllm") is None:
        assert provider == "stand-in"
    else:
        assert provider.startswith("vllm "), provider


def test_stores_then_async_loads_into_other_blocks(engines, kv_server):
    """r1 and r2 load r0's chunks into blocks of their own (r2 after a
    local hit that ends inside a chunk), every byte checked."""
    report, stats = run(engines, scenario("store-load", store_then_load(random.Random(1)), kv_server))
    assert_store_then_load(report, stats, tp=1)


def test_tensor_parallel_two_worker_processes(engines, kv_server):
    """Two ranks with half the heads each: every rank stores and loads its
    own shard, and a transfer is over once both reported it."""
    report, stats = run(engines, scenario("tp2", store_then_load(random.Random(2)), kv_server, tp=2))
    assert_store_then_load(report, stats, tp=2)


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_layouts(engines, kv_server, case):
    """The store-then-load scenario on each KV cache layout of
    kv_layouts.LAYOUT_CASES (vLLM 0.33/0.34 physical orders, fp8, MLA, and
    the per-layer tensors of 0.26 and 0.21)."""
    layout = LAYOUT_CASES[case]
    sc = scenario(f"layout-{case}", store_then_load(random.Random(3)), kv_server, layout=layout)
    try:
        report, stats = run(engines, sc)
    except EngineError as e:
        # vLLM's CPU attention (which the connector asks for the layout)
        # refuses an fp8 cache on a CPU without AVX-512 or AMX: an engine
        # could not run this case on this machine either.
        if layout.fp8 and "requires x86 with AVX-512 or AMX" in str(e):
            pytest.skip("vLLM runs no fp8 KV cache on this CPU (it needs AVX-512 or AMX)")
        raise
    assert_store_then_load(report, stats, tp=1)


@pytest.mark.parametrize("kind", CUDA_ONLY_KINDS)
def test_allocation_kinds(engines, kv_server, kind):
    """The store-then-load scenario on a cache in torch's expandable
    segments (VMM, several 20 MiB chunks) and in one cuMemCreate allocation
    made exportable because the connector declares EXPORTS_FD."""
    if DEVICE != "cuda":
        pytest.skip(f"{kind} allocations are CUDA memory")
    report, stats = run(engines, scenario(f"alloc-{kind}", store_then_load(random.Random(4)), kv_server, kind=kind))
    assert_store_then_load(report, stats, tp=1)
    (info,) = report.workers
    assert info["allocations"] == 1, info
    if kind == "expandable":
        assert info["expandable"] == [True], info
        assert info["cache_bytes"] > 60 * MiB, "the cache must span several 20 MiB chunks"
    else:
        assert info["expandable"] == [False], info
        assert info["export_fd"], "the connector must declare KVCacheAccess.EXPORTS_FD"


def test_preempted_request_reloads_after_its_blocks_were_reused(engines, kv_server):
    """24 usable blocks, 64-token prefill chunks: a (320 tokens) and b (192)
    prefill side by side until the pool is full; a's next chunk preempts b
    (the last running), whose blocks a then uses. b asks again, waits for
    blocks until a finished, and loads its own three stored chunks."""
    rng = random.Random(5)
    reqs = [RequestSpec("a", _tokens(rng, 320), max_tokens=2), RequestSpec("b", _tokens(rng, 192), max_tokens=2)]
    sc = scenario("preempt", reqs, kv_server, usable_blocks=24, long_prefill_token_threshold=64)
    report, stats = run(engines, sc)
    b = report.requests["b"]
    assert b.preemptions == 1
    assert "a" in report.preemption_reuse["b"], report.preemption_reuse
    assert b.asks[0] == (0, 0, False, 0)
    after = [ask for ask in b.asks if ask[3] == 1]
    assert after and set(after) == {(0, 192, True, 1)}, b.asks
    assert b.allocs == [0, 192, 0]
    assert b.loaded_tokens == 192 and sorted(b.verified) == [0]
    assert_clean_end(report, stats)


def test_abort_before_allocation_ends_the_lease(engines, kv_server):
    """r2 hits r0's four chunks while r1 fills the pool: it is asked, never
    allocated, then aborted; request_finished must end its lease (the
    server's lease count drops to 0 at once). r3, with r2's prompt, still
    loads those chunks afterwards."""
    rng = random.Random(6)
    p = _tokens(rng, 256)
    reqs = [
        RequestSpec("r0", p, max_tokens=2),
        RequestSpec("r1", _tokens(rng, 320), max_tokens=8, after=("r0",)),
        RequestSpec("r2", p + _tokens(rng, 44), after=("r0",), abort_after_ask=True),
        RequestSpec("r3", p + _tokens(rng, 44), after=("r1", "r2")),
    ]
    report, stats = run(engines, scenario("abort", reqs, kv_server, usable_blocks=24))
    r2 = report.requests["r2"]
    assert r2.aborted and r2.asks == [(0, 256, True, 0)] and r2.allocs == []
    before, after = report.lease_probes["r2"]
    assert before >= 1 and after == 0, report.lease_probes
    assert report.requests["r3"].loaded_tokens == 256
    assert_clean_end(report, stats)


def test_full_prompt_hit_loads_every_chunk_and_computes_the_last_token(engines, kv_server):
    """A 256-token prompt (4 chunks) stored, then asked again: loaded
    asynchronously, the connector answers all 4 chunks and loads them; vLLM
    then computes the last token again, to sample the next one."""
    p = _tokens(random.Random(7), 4 * CHUNK_TOKENS)
    reqs = [RequestSpec("r0", p, max_tokens=2), RequestSpec("r1", p, max_tokens=2, after=("r0",))]
    report, stats = run(engines, scenario("full-hit", reqs, kv_server))
    r1 = report.requests["r1"]
    assert r1.asks == [(0, 4 * CHUNK_TOKENS, True, 0)]
    assert r1.allocs == [4 * CHUNK_TOKENS, 0]
    assert r1.loaded_tokens == 4 * CHUNK_TOKENS
    assert stats["lookup_hit_chunks"] >= 4 and stats["retrieved_chunks"] == 4, stats
    assert_clean_end(report, stats)


def test_a_hit_ends_with_the_prompt_s_tail(engines, kv_server):
    """A 300-token prompt stored: its 4 chunks and its tail, the 2 whole
    blocks past them (a chunk of 2 blocks). Asked again, the hit ends where
    the tail does (288 tokens; vLLM computes the last 12), every loaded
    byte checked; after a local hit inside the tail, the tail's rest alone."""
    p = _tokens(random.Random(9), 300)
    reqs = [
        RequestSpec("r0", p, max_tokens=2),
        RequestSpec("r1", p, max_tokens=2, after=("r0",)),
        RequestSpec("r2", p, max_tokens=2, after=("r1",), local_hit=272),
    ]
    report, stats = run(engines, scenario("tail", reqs, kv_server))
    r1, r2 = report.requests["r1"], report.requests["r2"]
    assert r1.asks == [(0, 288, True, 0)]
    assert r1.loaded_tokens == 288
    assert r2.asks == [(272, 16, True, 0)]
    assert r2.loaded_tokens == 16
    # 4 chunks and the tail; loaded: r1's 4 chunks and tail, r2's tail.
    assert stats["objects"] == 5 and stats["retrieved_chunks"] == 6, stats
    assert_clean_end(report, stats)


def test_prompt_tails_turned_off_end_hits_on_whole_chunks(engines, kv_server):
    """`kvring.store_tails=false`: the same prompt again hits its whole
    chunks only, and no tail is stored."""
    p = _tokens(random.Random(10), 300)
    reqs = [RequestSpec("r0", p, max_tokens=2), RequestSpec("r1", p, max_tokens=2, after=("r0",))]
    sc = scenario("no-tails", reqs, kv_server, settings={"kvring.store_tails": False})
    report, stats = run(engines, sc)
    assert report.requests["r1"].asks == [(0, 256, True, 0)]
    assert stats["objects"] == 4 and stats["retrieved_chunks"] == 4, stats
    assert_clean_end(report, stats)


def test_a_changed_byte_fails_the_check(engines, kv_server):
    """A control of the check itself: one byte of r1's loaded KV changed
    before the check (the last byte-0 of head 0 of layer 0) must fail the
    run, naming where."""
    sc = scenario("control", store_then_load(random.Random(8)), kv_server, corrupt_load="r1")
    where = (
        r"request r1's loaded KV differs at layer 0 \(group 0\), block \d+ \(token 255, slot 15\), "
        r"head 0 of the rank, byte 0"
    )
    with pytest.raises(EngineError, match=where):
        run(engines, sc)


WINDOW = 32
"""The sliding window of the hybrid scenarios: two blocks."""


def window_store_then_load(rng: random.Random) -> list[RequestSpec]:
    """r0 stores a 300-token prompt through a full-attention group and a
    sliding-window group (its window's blocks freed as the prefill moves
    on, 128 tokens a step); then r1, r0's first 256 tokens and 100 more."""
    p = _tokens(rng, 300)
    return [RequestSpec("r0", p), RequestSpec("r1", p[:256] + _tokens(rng, 100), after=("r0",))]


@pytest.mark.parametrize("case", [c for c in LAYOUT_CASES if not LAYOUT_CASES[c].fp8 and not LAYOUT_CASES[c].mla])
def test_a_sliding_window_group_loads_only_its_window(engines, kv_server, case):
    """A model of two KV cache groups as vLLM's hybrid manager keeps them
    (layers alternating full attention and a 32-token window, each pair
    viewing one tensor), on each bf16 layout: r0's chunks are stored for
    both groups, each before vLLM frees the window group's blocks; r1's
    hit loads every block of the full-attention group and, of the window
    group, only the blocks vLLM holds for the window before its first
    token to compute (the others are the null block), every byte of both
    checked."""
    sc = scenario(
        f"window-{case}",
        window_store_then_load(random.Random(9)),
        kv_server,
        layout=LAYOUT_CASES[case],
        window=WINDOW,
    )
    report, stats = run(engines, sc)
    r0, r1 = report.requests["r0"], report.requests["r1"]
    assert r0.asks == [(0, 0, False, 0)] and r0.delayed_free
    assert r1.asks == [(0, 256, True, 0)] and r1.allocs == [256, 0]
    assert r1.loaded_tokens == 256
    assert sorted(r1.verified) == [0], r1.verified
    # r0's 4 chunks and its tail (tokens 256-287), r1's 5th chunk and its
    # tail, once per group; r1 loads chunks 0-3 of the full-attention group
    # and chunk 3 of the window's (its last 2 blocks: the window before
    # token 256)
    assert stats["objects"] == 2 * 7, stats
    assert stats["retrieved_chunks"] == 4 + 1, stats
    assert_clean_end(report, stats)


def test_a_sliding_window_group_on_two_ranks(engines, kv_server):
    """The same on two tensor-parallel ranks: each stores and loads its
    shard of both groups, and r1's load is over once both reported it."""
    sc = scenario("window-tp2", window_store_then_load(random.Random(11)), kv_server, window=WINDOW, tp=2)
    report, stats = run(engines, sc)
    r1 = report.requests["r1"]
    assert r1.asks == [(0, 256, True, 0)] and r1.loaded_tokens == 256
    assert sorted(r1.verified) == [0, 1], r1.verified
    assert stats["objects"] == 2 * 2 * 7 and stats["retrieved_chunks"] == 2 * (4 + 1), stats
    assert_clean_end(report, stats)


def test_a_preempted_request_of_a_windowed_model_reloads_its_window(engines, kv_server):
    """Preemption with two groups: 30 usable blocks, 64-token prefill
    chunks; a (320 tokens) and b (192) prefill side by side, the window
    group's blocks freed as they go (and given to the other request at
    once), until a's next chunk preempts b, whose blocks a then uses. b
    asks again and loads its own two stored chunks into new blocks of both
    groups, every byte checked."""
    rng = random.Random(5)
    reqs = [RequestSpec("a", _tokens(rng, 320), max_tokens=2), RequestSpec("b", _tokens(rng, 192), max_tokens=2)]
    sc = scenario(
        "window-preempt", reqs, kv_server, usable_blocks=30, long_prefill_token_threshold=64, window=WINDOW
    )
    report, stats = run(engines, sc)
    b = report.requests["b"]
    assert b.preemptions == 1
    assert "a" in report.preemption_reuse["b"], report.preemption_reuse
    after = [ask for ask in b.asks if ask[3] == 1]
    assert after and set(after) == {(0, 128, True, 1)}, b.asks
    assert b.allocs == [0, 128, 0]
    assert b.loaded_tokens == 128 and sorted(b.verified) == [0]
    assert_clean_end(report, stats)


def test_a_windowed_model_s_hit_ends_with_its_tail_or_its_whole_prompt(engines, kv_server):
    """Tails and whole-prompt hits with a sliding-window group: r0 stores
    a 300-token prompt's 4 chunks and its tail (tokens 256-287, its whole
    blocks) in both groups. r1, the same prompt, hits 288 tokens; r2, the
    prompt's first 288 tokens, hits all of them, and vLLM computes its
    last token again, whose window reaches token 256. The window of a
    288-token hit lies in the tail (the group holds blocks 16-17 only), so
    the window group loads the tail alone, every byte checked."""
    rng = random.Random(12)
    p = _tokens(rng, 300)
    reqs = [
        RequestSpec("r0", p),
        RequestSpec("r1", p, after=("r0",)),
        RequestSpec("r2", p[:288], after=("r1",)),
    ]
    report, stats = run(engines, scenario("window-tail", reqs, kv_server, window=WINDOW))
    for name in ("r1", "r2"):
        r = report.requests[name]
        assert r.asks == [(0, 288, True, 0)], (name, r.asks)
        assert r.loaded_tokens == 288 and sorted(r.verified) == [0], (name, r)
    # r0's chunks and tail in both groups; each hit: 4 chunks and the tail
    # of the full-attention group, the tail of the window group
    assert stats["objects"] == 2 * 5, stats
    assert stats["retrieved_chunks"] == 2 * (4 + 1 + 1), stats
    assert_clean_end(report, stats)


def test_a_prefill_past_the_window_stores_nothing_not_even_its_tail(engines, kv_server):
    """16-token prefill steps with a 32-token window: chunk 0 completes in
    the step from token 48, when vLLM has freed the window group's block
    of tokens 0-15, so it cannot be stored whole in that group; the request
    stores nothing more (a hit needs every group), and no tail, which
    would never be hit without its chunks. The same prompt again misses."""
    p = _tokens(random.Random(13), 300)
    reqs = [RequestSpec("r0", p), RequestSpec("r1", p, after=("r0",))]
    sc = scenario("window-past", reqs, kv_server, window=WINDOW, long_prefill_token_threshold=16)
    report, stats = run(engines, sc)
    assert report.requests["r1"].asks == [(0, 0, False, 0)], report.requests["r1"].asks
    assert stats["objects"] == 0 and stats["stored_chunks"] == 0, stats
    assert report.leaked_blocks == 0 and stats["leases"] == 0


def test_a_changed_byte_of_the_window_group_fails_the_check(engines, kv_server):
    """The control of the window group's check: one byte of the window
    group's loaded KV changed before the check must fail the run."""
    sc = scenario(
        "window-control",
        window_store_then_load(random.Random(10)),
        kv_server,
        window=WINDOW,
        corrupt_load="r1",
        corrupt_group=1,
    )
    with pytest.raises(EngineError, match=r"request r1's loaded KV differs at layer 1 \(group 1\), block \d+ \(token 255"):
        run(engines, sc)
