"""Routing by kvring's KV events, against random routing, and what the
event stream costs the rings and the copies.

**Routing.** Two nodes, each a real `kvring serve --kv-events` and an
engine on it: a small transformer (4 layers, 2 KV heads of 64, bf16, on the
CPU with torch) whose KV cache (vLLM's one-buffer layout, 16-token blocks)
is registered with its node's server. For each request the engine looks
its prompt up, retrieves the hit chunks into its cache, computes the rest
of the prompt (attention over the loaded and the new KV) up to the last
token's logits (time to first token), then describes and stores the new
chunks. The prompts share prefixes: `--groups` system prompts of
`--prefix` tokens, each request one of them (drawn at random) and a suffix
of its own. The pools hold about `--pool-prefixes` prefixes each.

The router sends each request to a node by one of two policies:

* `events`: it subscribes to both nodes' event streams and sends the
  request to the node whose stream claims the longest prefix of it (ties:
  the node with fewer requests so far);
* `random`: a node at random.

Both run on the same request sequence, on fresh servers. Reported: the hit
rate (prompt tokens loaded / prompt tokens), time to first token (median,
p99), and the same engine with no cache at all.

**Cost of the stream.** One server at a time, with no event stream, with a
stream and no subscriber, and with a subscriber that never reads (its
queue fills to its high-water mark): a LOOKUP's round trip (16 stored
chunks, median and p99 of many) and STORE / RETRIEVE GB/s of 32-chunk jobs
that evict (every store publishes and every eviction too), median of
passes; ratios to the server without a stream.

    python bench/bench_routing.py [--json out.json]

Runs where the kvring wheel, torch, pyzmq and msgspec are installed (the
vLLM CPU test environment has them). A benchmark: it asserts only that a
retrieved chunk's bytes are the ones stored.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import msgspec
import torch
import zmq

import kvring

CHUNK = 64
BLOCK = 16
LAYERS, HEADS, HEAD_DIM = 4, 2, 64
D_MODEL = 256
VOCAB = 32000
MODEL = kvring.model_id("bench-routing-tiny")


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


class Node:
    """A `kvring serve` with an event stream on an ipc socket of its own."""

    def __init__(self, pool_mib: int, events: bool, extra=()):
        self.name = f"bench-rt-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.dir = tempfile.mkdtemp(prefix="kvring-bench-rt-")
        os.chmod(self.dir, 0o700)
        self.live = f"ipc://{self.dir}/events"
        args = [sys.executable, "-m", "kvring", "serve", "--name", self.name, "--runtime-dir", self.dir,
                "--chunk-tokens", str(CHUNK), "--pool-bytes", f"{pool_mib}MiB", "--copy-threads", "1",
                "--prefault", "--http", "off", *extra]
        if events:
            args += ["--kv-events", self.live]
        self.events = events
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client = kvring.Client(self.name, runtime_dir=self.dir, connect_timeout=0.5)
                break
            except kvring.NoServer:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise

    def stop(self):
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Engine:
    """The tiny transformer (float32 on the CPU) and its paged KV cache
    (bf16), registered with a node."""

    def __init__(self, node: Node, max_tokens: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        kv = HEADS * HEAD_DIM

        def w(*shape):
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        self.emb = w(VOCAB, D_MODEL)
        self.layers = [(w(D_MODEL, D_MODEL), w(D_MODEL, kv), w(D_MODEL, kv), w(D_MODEL, D_MODEL),
                        w(D_MODEL, 4 * D_MODEL), w(4 * D_MODEL, D_MODEL)) for _ in range(LAYERS)]
        self.blocks = -(-max_tokens // BLOCK)
        # vLLM's one-buffer layout: [layer][block][token][head][K then V].
        self.cache = torch.zeros(LAYERS, self.blocks, BLOCK, HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16)
        layout = kvring.Layout.preset("lbnhc", layers=LAYERS, blocks=self.blocks, block_tokens=BLOCK,
                                      heads=HEADS, head_dim=HEAD_DIM, elem_bytes=2)
        self.node = node
        self.reg = node.client.register_process_memory(layout, [self.cache.data_ptr()], model_id=MODEL)
        self.bpc = CHUNK // BLOCK

    def _kv(self, layer, n):
        """Layer `layer`'s K and V of the first `n` positions, [n, heads, dim]."""
        flat = self.cache[layer].reshape(self.blocks * BLOCK, HEADS, 2 * HEAD_DIM)[:n]
        return flat[..., :HEAD_DIM], flat[..., HEAD_DIM:]

    def forward(self, tokens, start):
        """Computes positions `start ..` of `tokens` (the KV of positions
        before `start` is in the cache) and writes their KV; the last
        token's logits."""
        x = self.emb[torch.tensor(tokens[start:])]
        n = len(tokens)
        for layer, (wq, wk, wv, wo, w1, w2) in enumerate(self.layers):
            q = x @ wq
            k_new, v_new = (x @ wk).view(-1, HEADS, HEAD_DIM), (x @ wv).view(-1, HEADS, HEAD_DIM)
            flat = self.cache[layer].view(self.blocks * BLOCK, HEADS, 2 * HEAD_DIM)
            flat[start:n, :, :HEAD_DIM] = k_new.to(torch.bfloat16)
            flat[start:n, :, HEAD_DIM:] = v_new.to(torch.bfloat16)
            k, v = (t.float() for t in self._kv(layer, n))
            # Grouped-query attention: each KV head serves two query heads.
            qh = q.view(-1, HEADS, 2, HEAD_DIM).permute(1, 2, 0, 3)  # [kv, 2, new, d]
            kh = k.permute(1, 0, 2).unsqueeze(1).expand(-1, 2, -1, -1)
            vh = v.permute(1, 0, 2).unsqueeze(1).expand(-1, 2, -1, -1)
            a = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=torch.ones(n - start, n, dtype=torch.bool).tril(start))
            x = x + a.permute(2, 0, 1, 3).reshape(-1, D_MODEL) @ wo
            x = x + torch.relu(x @ w1) @ w2
        return x[-1] @ self.emb.T

    def serve(self, tokens):
        """One request: lookup, load the hits, compute the rest (time to
        first token), then store the new chunks. Returns (hit tokens, ttft s)."""
        c = self.node.client
        hashes = kvring.chunk_hashes(tokens, CHUNK)
        blocks = list(range(len(hashes) * self.bpc))
        t0 = time.perf_counter()
        with c.lookup(MODEL, 1, hashes) as lease:
            hits = lease.hits
            if hits:
                assert c.retrieve(self.reg, lease.id, blocks[: hits * self.bpc]).wait(30).ok
        self.forward(tokens, hits * CHUNK)
        ttft = time.perf_counter() - t0
        if hits < len(hashes):
            if self.node.events:
                c.describe(tokens, model_id=MODEL, chunk_tokens=CHUNK, first_chunk=hits)
            job = c.store(self.reg, hashes[hits:], blocks[hits * self.bpc:])
            assert job.wait(30).ok
        return hits * CHUNK, ttft


class Watcher:
    """What a node's event stream says it holds (chunk hashes)."""

    def __init__(self, ctx, endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.held: set[bytes] = set()
        self.dec = msgspec.msgpack.Decoder()

    def drain(self):
        while True:
            try:
                _, _, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for ev in self.dec.decode(payload)[1]:
                kind = ev["type"]
                if kind == "AllBlocksCleared":
                    self.held.clear()
                elif kind == "BlockStored":
                    self.held.add(ev["chunk_hash"])
                elif kind == "BlockRemoved":
                    self.held.discard(ev["chunk_hash"])

    def claims(self, hashes):
        n = 0
        for h in hashes:
            if h not in self.held:
                break
            n += 1
        return n


def workload(a, rng):
    prefixes = [[rng.randrange(VOCAB) for _ in range(a.prefix)] for _ in range(a.groups)]
    return [prefixes[rng.randrange(a.groups)] + [rng.randrange(VOCAB) for _ in range(a.suffix)]
            for _ in range(a.requests)]


def run_routing(a, policy, prompts):
    pool_mib = max(2, a.pool_prefixes * (a.prefix // CHUNK) * object_bytes() >> 20)
    nodes = [Node(pool_mib, events=True) for _ in range(2)]
    engines = [Engine(n, a.prefix + a.suffix) for n in nodes]
    ctx = zmq.Context()
    watchers = [Watcher(ctx, n.live) for n in nodes]
    time.sleep(0.3)  # the subscribers join before the first event
    rng = random.Random(7)
    routed = [0, 0]
    hit = total = 0
    ttfts = []
    try:
        for tokens in prompts:
            if policy == "random":
                i = rng.randrange(2)
            elif policy == "events":
                hashes = kvring.chunk_hashes(tokens, CHUNK)
                for w in watchers:
                    w.drain()
                score = [w.claims(hashes) for w in watchers]
                i = max(range(2), key=lambda j: (score[j], -routed[j]))
            else:
                i = len(ttfts) % 2
            routed[i] += 1
            h, t = engines[i].serve(tokens) if policy != "none" else (0, timed_forward(engines[i], tokens))
            hit += h
            total += len(tokens)
            ttfts.append(t)
            # Let the stream catch up, as a router between arrivals would.
            time.sleep(a.gap_ms / 1000)
    finally:
        for w in watchers:
            w.sub.close(0)
        ctx.term()
        for n in nodes:
            n.stop()
    return {
        "policy": policy,
        "hit_rate": hit / total,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
        "requests_per_node": routed,
        "pool_mib_per_node": pool_mib,
    }


def timed_forward(e, tokens):
    t0 = time.perf_counter()
    e.forward(tokens, 0)
    return time.perf_counter() - t0


def object_bytes():
    return LAYERS * CHUNK * HEADS * 2 * HEAD_DIM * 2


def run_cost(a, mode):
    """Lookup round trip and store / retrieve GB/s on a server with no
    stream, a stream and no subscriber, or a subscriber that never reads."""
    node = Node(16, events=mode != "off", extra=("--kv-events-hwm", "16") if mode == "stalled" else ())
    ctx = zmq.Context()
    stalled = None
    if mode == "stalled":
        stalled = ctx.socket(zmq.SUB)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.setsockopt(zmq.RCVHWM, 16)
        stalled.connect(node.live)
    chunks = 32
    e = Engine(node, chunks * CHUNK)
    c = node.client
    rng = random.Random(3)
    stored = [rng.randrange(VOCAB) for _ in range(16 * CHUNK)]
    hashes = kvring.chunk_hashes(stored, CHUNK)
    assert c.store(e.reg, hashes, list(range(16 * e.bpc))).wait(30).ok
    rtt = []
    for _ in range(a.lookups):
        t0 = time.perf_counter()
        lease = c.lookup(MODEL, 1, hashes)
        rtt.append(time.perf_counter() - t0)
        lease.end()
    nbytes = chunks * object_bytes()
    blocks = list(range(chunks * e.bpc))
    store_gbps, retrieve_gbps = [], []
    e.cache.view(torch.int16).random_(generator=torch.Generator().manual_seed(1))
    for p in range(-2, a.passes):  # two passes to warm up, not timed
        tokens = [rng.randrange(VOCAB) for _ in range(chunks * CHUNK)]
        hs = kvring.chunk_hashes(tokens, CHUNK)
        if node.events:
            c.describe(tokens, model_id=MODEL, chunk_tokens=CHUNK)
        t0 = time.perf_counter()
        assert c.store(e.reg, hs, blocks).wait(30).ok
        t_store = time.perf_counter() - t0
        lease = c.lookup(MODEL, 1, hs)
        assert lease.hits == chunks
        t0 = time.perf_counter()
        assert c.retrieve(e.reg, lease.id, blocks).wait(30).ok
        t_retrieve = time.perf_counter() - t0
        lease.end()
        if p >= 0:
            store_gbps.append(nbytes / t_store / 1e9)
            retrieve_gbps.append(nbytes / t_retrieve / 1e9)
    s = c.stats()
    if stalled is not None:
        stalled.close(0)
    ctx.term()
    node.stop()
    return {
        "mode": mode,
        "lookup_rtt_p50_us": statistics.median(rtt) * 1e6,
        "lookup_rtt_p99_us": pct(rtt, 0.99) * 1e6,
        "store_gbps": statistics.median(store_gbps),
        "retrieve_gbps": statistics.median(retrieve_gbps),
        "evicted_objects": s["evicted_objects"],
        "events_published": s["events_published"],
        "events_dropped": s["events_dropped"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=12, help="shared prefixes")
    p.add_argument("--prefix", type=int, default=1024, help="tokens of each shared prefix")
    p.add_argument("--suffix", type=int, default=128, help="tokens of each request's own suffix")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--pool-prefixes", type=int, default=8, help="prefixes one node's pool holds")
    p.add_argument("--gap-ms", type=float, default=10.0, help="time between requests")
    p.add_argument("--lookups", type=int, default=2000, help="lookups timed per stream mode")
    p.add_argument("--passes", type=int, default=30, help="store/retrieve passes per stream mode")
    p.add_argument("--repeats", type=int, default=3, help="servers per stream mode, in turn")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    torch.set_num_threads(1)
    prompts = workload(a, random.Random(11))
    routing = [run_routing(a, pol, prompts) for pol in ("events", "random", "none")]
    base = routing[2]["ttft_p50_ms"]
    print(f"{'policy':8} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'vs no cache':>12}  per node")
    for r in routing:
        r["speedup_vs_no_cache"] = base / r["ttft_p50_ms"]
        print(f"{r['policy']:8} {r['hit_rate']:9.3f} {r['ttft_p50_ms']:8.2f}ms {r['ttft_p99_ms']:8.2f}ms"
              f" {r['speedup_vs_no_cache']:11.2f}x  {r['requests_per_node']}")
    # The modes in turn, --repeats times, so that drift of the machine
    # falls on all of them; each figure is the median over the repeats.
    modes = ("off", "idle", "stalled")
    runs = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            runs[m].append(run_cost(a, m))
    cost = []
    for m in modes:
        r = {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0] if k != "mode"}
        r["mode"] = m
        r["runs"] = runs[m]
        cost.append(r)
    off = cost[0]
    print(f"\n{'stream':8} {'lookup p50':>11} {'p99':>9} {'store':>11} {'retrieve':>11}  ratios to no stream (lookup p50, store, retrieve)")
    for r in cost:
        r["ratio_lookup_p50"] = r["lookup_rtt_p50_us"] / off["lookup_rtt_p50_us"]
        r["ratio_store"] = r["store_gbps"] / off["store_gbps"]
        r["ratio_retrieve"] = r["retrieve_gbps"] / off["retrieve_gbps"]
        print(f"{r['mode']:8} {r['lookup_rtt_p50_us']:9.1f}us {r['lookup_rtt_p99_us']:7.1f}us"
              f" {r['store_gbps']:7.2f}GB/s {r['retrieve_gbps']:7.2f}GB/s  {r['ratio_lookup_p50']:.2f}"
              f" {r['ratio_store']:.2f} {r['ratio_retrieve']:.2f}  ({r['events_published']} events, {r['evicted_objects']} evicted)")
    out = {"args": vars(a), "routing": routing, "stream_cost": cost,
           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "kvring": kvring.__version__}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
