"""The Python API against a real server: every operation, every error as
its exception, handles released by garbage collection, the GIL released
while a call waits, a killed server ending a wait within its bound."""

import ctypes
import gc
import os
import random
import signal
import threading
import time

import pytest

import kvring

CHUNK = 64
MODEL = kvring.model_id("pytest-model")


class HostCache:
    """A KV cache in ordinary process memory (as vLLM's CPU cache is), laid
    out as vLLM 0.33's default one buffer: 2 layers, 64 blocks of 16
    tokens, 2 heads of 32 two-byte elements."""

    def __init__(self) -> None:
        self.layout = kvring.Layout.preset(
            "lbnhc", layers=2, blocks=64, block_tokens=16, heads=2, head_dim=32, elem_bytes=2)
        self.size = self.layout.allocations[0]
        # One byte past a 64-byte boundary: no alignment is needed.
        self.raw = (ctypes.c_uint8 * (self.size + 64))()
        self.addr = ctypes.addressof(self.raw) + 1
        self.page = self.layout.page_bytes
        self.layers = self.layout.layers
        self.blocks = self.layout.blocks

    def view(self) -> memoryview:
        return memoryview((ctypes.c_uint8 * self.size).from_address(self.addr)).cast("B")

    def block(self, layer: int, block: int) -> bytes:
        at = (layer * self.blocks + block) * self.page
        return bytes(self.view()[at:at + self.page])

    def fill(self, layer: int, block: int, data: bytes) -> None:
        at = (layer * self.blocks + block) * self.page
        self.view()[at:at + self.page] = data

    def poison(self, byte: int) -> None:
        ctypes.memset(self.addr, byte, self.size)

    def register(self, client: kvring.Client, **kw) -> kvring.Registration:
        return client.register_process_memory(self.layout, [self.addr], model_id=MODEL, **kw)


def prompt(seed: int, chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(chunks * CHUNK)]


def test_store_lookup_retrieve_round_trip(server):
    with server.client() as c:
        cfg = c.server_config()
        assert cfg["chunk_tokens"] == CHUNK and cfg["backend"] == "host"
        cache = HostCache()
        with cache.register(c) as reg:
            assert (reg.chunk_tokens, reg.blocks_per_chunk) == (CHUNK, 4)
            hashes = kvring.chunk_hashes(prompt(1, 3), CHUNK)
            assert len(hashes) == 3 and all(len(h) == 16 for h in hashes)
            blocks = [5, 9, 2, 40, 41, 42, 43, 7, 8, 60, 61, 3]
            want = {}
            rng = random.Random(7)
            for layer in range(cache.layers):
                for b in blocks:
                    want[layer, b] = rng.randbytes(cache.page)
                    cache.fill(layer, b, want[layer, b])
            with c.store(reg, hashes, blocks) as job:
                st = job.wait(10)
                assert st.state == "done" and st.ok and st.finished and st.value == 3
            cache.poison(0xEE)
            with c.lookup(MODEL, 1, hashes) as lease:
                assert lease.hits == 3 and len(lease.id) == 16
                fresh = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33]
                with c.retrieve(reg, lease.id, fresh) as job:
                    assert job.wait(10).ok
                for layer in range(cache.layers):
                    for b, f in zip(blocks, fresh):
                        assert cache.block(layer, f) == want[layer, b], (layer, b, f)
            stats = c.stats()
            assert stats["stored_chunks"] == 3 and stats["retrieved_chunks"] == 3
            assert stats["lookup_hit_chunks"] == 3
        assert c.stats()["instances"] == 0
        assert c.clear() == {"objects": 3, "bytes": 3 * 2 * 4 * cache.page}
        with c.lookup(MODEL, 1, hashes) as lease:
            assert lease.hits == 0


def test_a_retrieve_in_layer_groups_lands_each_group_for_its_layers(server):
    with server.client() as c:
        cache = HostCache()
        with cache.register(c) as reg:
            hashes = kvring.chunk_hashes(prompt(11, 2), CHUNK)
            blocks = list(range(8))
            rng = random.Random(11)
            want = {(layer, b): rng.randbytes(cache.page) for layer in range(cache.layers) for b in blocks}
            for (layer, b), data in want.items():
                cache.fill(layer, b, data)
            assert c.store(reg, hashes, blocks).wait(10).ok
            fresh = list(range(16, 24))
            with c.lookup(MODEL, 1, hashes) as lease:
                with pytest.raises(kvring.KvringError, match="layer groups"):
                    c.retrieve(reg, lease.id, fresh, layer_groups=cache.layers + 1)
                cache.poison(0xEE)
                with c.retrieve(reg, lease.id, fresh, layer_groups=cache.layers) as job:
                    assert job.layer_groups == cache.layers
                    for layer in range(cache.layers):
                        # Group k of L groups over L layers is layer k.
                        job.wait_layer_group(layer, timeout=10)
                        assert job.layer_group_landed(layer)
                        for b, f in zip(blocks, fresh):
                            assert cache.block(layer, f) == want[layer, b], (layer, b, f)
                    assert job.wait(10).ok


def test_a_lease_frees_chunks_that_will_not_be_loaded_and_ends(server):
    with server.client() as c:
        cache = HostCache()
        reg = cache.register(c)
        hashes = kvring.chunk_hashes(prompt(2, 2), CHUNK)
        assert c.store(reg, hashes, list(range(8))).wait(10).ok
        lease = c.lookup(MODEL, 1, hashes)
        assert c.stats()["leases"] == 1
        c.release_lease_chunks(lease.id, 1, 1)
        # Chunk 1's hold is gone: retrieving it is refused, chunk 0 works.
        with pytest.raises(kvring.StatusError) as e:
            c.retrieve(reg, lease.id, list(range(12, 16)), first_chunk=1)
        assert e.value.status == "no_lease"
        assert c.retrieve(reg, lease.id, list(range(8, 12))).wait(10).ok
        lease.end()
        assert c.stats()["leases"] == 0
        lease.end()  # a second end is a no-op


def test_every_error_is_its_exception(server):
    with pytest.raises(kvring.NoServer):
        kvring.Client("no-such-server-here", runtime_dir=server.dir, connect_timeout=0.1)
    with pytest.raises(kvring.InvalidArgument):
        kvring.Client("bad/name", runtime_dir=server.dir)
    c = server.client(engine="engine-a")
    cache = HostCache()
    reg = cache.register(c)
    hashes = kvring.chunk_hashes(prompt(3, 1), CHUNK)
    # ValueError too: a wrong hash length, a wrong lease id length.
    with pytest.raises(ValueError):
        c.store(reg, [b"short"], list(range(4)))
    with pytest.raises(kvring.InvalidArgument):
        c.retrieve(reg, b"\0" * 15, list(range(4)))
    with pytest.raises(kvring.InvalidArgument):
        c.store(reg, hashes, [1, 2, 3, 4, 5])  # 4 blocks per chunk at most
    with pytest.raises(kvring.InvalidArgument):
        c.delay_job(-1.0, 0.0)
    # The server's answers.
    with pytest.raises(kvring.StatusError) as e:
        c.retrieve(reg, b"\0" * 16, list(range(4)))
    assert e.value.status == "no_lease"
    assert c.store(reg, hashes, list(range(4))).wait(10).ok
    other = server.client(engine="engine-b")
    lease = other.lookup(MODEL, 1, hashes)
    assert lease.hits == 1
    with pytest.raises(kvring.StatusError) as e:
        c.retrieve(reg, lease.id, list(range(4, 8)))
    assert e.value.status == "foreign_lease"
    # A layout the server refuses (16-token blocks do not divide 24-token
    # chunks is checked locally; a block index out of range by the server).
    with pytest.raises(kvring.StatusError):
        c.store(reg, hashes, [64, 65, 66, 67])
    bad = kvring.Layout(layers=1, blocks=4, block_tokens=48, heads=1, k_width=8, v_width=8,
                        elem_bytes=2, allocations=[4 * 48 * 32], placements=[(0, 0, 16, 48 * 32, 0, 32)])
    with pytest.raises(kvring.InvalidArgument):
        c.register_process_memory(bad, [cache.addr], model_id=MODEL)
    with pytest.raises(kvring.RegistrationRefused) as e:
        c.register_process_memory(cache.layout, [8], model_id=MODEL)
    assert "not mapped" in str(e.value)
    # Timeouts are TimeoutError too.
    job = c.delay_job(0.0, 5.0)
    with pytest.raises(TimeoutError):
        job.wait(0.05)
    # A closed client.
    c.close()
    with pytest.raises(kvring.ClientClosed):
        c.stats()
    with pytest.raises(kvring.ClientClosed):
        c.lookup(MODEL, 1, hashes)
    job.release()
    with pytest.raises(kvring.KvringError):
        job.status()
    other.close()


def test_handles_are_released_when_collected(server):
    with server.client() as c:
        cache = HostCache()
        reg = cache.register(c)
        hashes = kvring.chunk_hashes(prompt(4, 1), CHUNK)
        job = c.store(reg, hashes, list(range(4)))
        job.wait(10)
        job_id = job.id
        lease = c.lookup(MODEL, 1, hashes)
        assert (c.stats()["leases"], c.stats()["instances"]) == (1, 1)
        del job, lease, reg
        gc.collect()
        # Released with the client's next request.
        c.ping()
        stats = c.stats()
        assert (stats["leases"], stats["instances"]) == (0, 0)
        assert job_id[0] != 0


def test_another_thread_runs_while_one_waits(server):
    with server.client() as c:
        job = c.delay_job(0.0, 0.6, value=42, aux=7)
        assert job.status().state in ("pending", "running")
        counted = 0
        stop = threading.Event()

        def count():
            nonlocal counted
            while not stop.is_set():
                counted += 1

        t = threading.Thread(target=count)
        t.start()
        t0 = time.monotonic()
        st = job.wait(10)
        waited = time.monotonic() - t0
        stop.set()
        t.join()
        assert (st.state, st.value, st.aux) == ("done", 42, 7)
        assert waited >= 0.3
        # Without the GIL released the counter could not move while the
        # main thread waited.
        assert counted > 1000, counted
        # A blocking call on the client too: ping while the server is stopped.
        server.signal(signal.SIGSTOP)
        try:
            counted = 0
            stop.clear()
            t = threading.Thread(target=count)
            t.start()
            with pytest.raises(kvring.ServerTimeout):
                c.ping(timeout=0.3)
            stop.set()
            t.join()
            assert counted > 1000, counted
        finally:
            server.signal(signal.SIGCONT)


def test_a_killed_server_ends_a_wait_with_server_gone_within_its_bound(server):
    c = server.client()
    job = c.delay_job(0.0, 30.0)
    killer = threading.Timer(0.2, lambda: server.signal(signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(kvring.ServerGone):
        job.wait(20)
    # One park slice (50 ms) after the kill at 0.2 s, with room for a slow
    # machine; far below the 20 s the wait allowed.
    assert time.monotonic() - t0 < 2.0
    killer.join()
    assert c.server_gone
    with pytest.raises(kvring.ServerGone):
        c.lookup(MODEL, 1, [b"\0" * 16])
    # poll() reports the same without blocking.
    with pytest.raises(kvring.ServerGone):
        job.poll()


def test_poll_reads_a_job_without_blocking(server):
    with server.client() as c:
        job = c.delay_job(0.0, 0.5, value=3)
        t0 = time.monotonic()
        assert job.poll().state in ("pending", "running")
        assert time.monotonic() - t0 < 0.4  # no wait for the 0.5 s job
        assert job.wait(10).value == 3
        assert job.poll().state == "done"
        # Released: its slot is a tombstone that still says how it ended.
        job_id = job.id
        job.release()
        c.ping()
        other = c.delay_job(0.0, 0.0)
        assert other.wait(10).ok and other.id != job_id


def test_command_line_runs_from_the_package(server):
    import json
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "kvring", "inspect", "show", server.name, "--json"],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "KVRING_RUNTIME_DIR": server.dir})
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout.strip().splitlines()[-1])
    assert snap["server"]["alive"] is True
    bad = subprocess.run([sys.executable, "-m", "kvring", "no-such-command"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unrecognized subcommand" in bad.stderr


def test_the_server_is_the_binary_the_wheel_carries(server):
    """`python -m kvring serve` is the packaged `kvring` binary in place of
    the interpreter (same pid), and the `kvring-inspect` script runs it too."""
    import subprocess
    import sys
    from kvring.__main__ import BINARY
    assert BINARY.is_file() and os.access(BINARY, os.X_OK)
    assert os.readlink(f"/proc/{server.proc.pid}/exe") == str(BINARY)
    with open(f"/proc/{server.proc.pid}/maps") as f:
        assert "_native" not in f.read()  # no interpreter, no extension module
    script = os.path.join(os.path.dirname(sys.executable), "kvring-inspect")
    out = subprocess.run([script, "list"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "KVRING_RUNTIME_DIR": server.dir})
    assert out.returncode == 0, out.stderr
    assert server.name in out.stdout


def stopped_state(pid: int) -> str:
    """The state letter of process `pid` ("T": stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stop(server) -> None:
    """SIGSTOPs the server and returns once /proc says it is stopped (the
    signal is delivered apart), or after 5 s."""
    server.signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while stopped_state(server.proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.001)


def wait_for_no_leases(c) -> None:
    """Waits up to 5 s for the server to hold no lease, then checks it."""
    deadline = time.monotonic() + 5
    while c.stats()["leases"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.stats()["leases"] == 0, c.stats()


def test_a_lookup_is_submitted_and_polled_without_waiting_on_a_stopped_server(server):
    with server.client() as c:
        cache = HostCache()
        reg = cache.register(c)
        hashes = kvring.chunk_hashes(prompt(4, 2), CHUNK)
        assert c.store(reg, hashes, list(range(8))).wait(10).ok
        # A pool hit is answered by the time the server took the lookup.
        pending = c.submit_lookup(MODEL, 1, hashes)
        lease = pending.poll()
        assert lease is not None and lease.hits == 2
        with pytest.raises(kvring.InvalidArgument):
            pending.poll()  # answered already
        lease.end()
        # Stopped: the submission fails at its deadline, not the call timeout.
        stop(server)
        try:
            t0 = time.monotonic()
            with pytest.raises(kvring.ServerTimeout):
                c.submit_lookup(MODEL, 1, hashes, timeout=0.05)
            took = time.monotonic() - t0
            assert took < 0.5, took
        finally:
            server.signal(signal.SIGCONT)
        # The lookup the server took once it went on leaves no lease.
        wait_for_no_leases(c)
        c.unregister(reg)


def test_a_stopped_server_costs_an_engine_step_no_more_than_its_bounds(server):
    """What an engine's step asks of a stopped (not dead) server: a store or
    retrieve submission fails at its `submit_timeout`, not the call
    timeout; ending a lease and freeing its holds are posted, never waited
    for, and the server applies them once it goes on."""
    with server.client() as c:
        cache = HostCache()
        reg = cache.register(c)
        hashes = kvring.chunk_hashes(prompt(5, 4), CHUNK)
        assert c.store(reg, hashes, list(range(16))).wait(10).ok
        kept = c.lookup(MODEL, 1, hashes)
        ended = c.lookup(MODEL, 1, hashes)
        assert kept.hits == ended.hits == 4
        assert c.stats()["leases"] == 2
        stop(server)
        try:
            t0 = time.monotonic()
            c.release_lease_chunks(kept.id, 2, 2, post=True)
            ended.end(post=True)
            posted = time.monotonic() - t0
            assert posted < 0.05, posted
            t0 = time.monotonic()
            with pytest.raises(kvring.ServerTimeout):
                c.retrieve(reg, kept.id, list(range(16, 24)), submit_timeout=0.05)
            with pytest.raises(kvring.ServerTimeout):
                c.store(reg, kvring.chunk_hashes(prompt(6, 1), CHUNK), list(range(24, 28)),
                        submit_timeout=0.05)
            took = time.monotonic() - t0
            assert took < 1.0, took
        finally:
            server.signal(signal.SIGCONT)
        # Once the server goes on: the posted end freed one lease; the
        # retrieve it took late consumed the other's first two chunks
        # (the posted release freed the last two), so nothing is held.
        wait_for_no_leases(c)
        kept.end()
        c.unregister(reg)
