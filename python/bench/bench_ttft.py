"""A real model's KV through kvring, and the time to first token it buys.

A randomly initialised transformers Llama with Llama-3-8B's geometry (32
layers, 32 query and 8 KV heads of 128, hidden 4096, MLP 14336, vocabulary
128256, bf16; built from its config on the GPU, no weights downloaded) runs
in two processes against one kvring server (CUDA backend):

* process A prefills each prompt's cached prefix (its whole 256-token
  chunks, never the last token), scatters the KV from the model's cache into
  a paged cache laid out as vLLM 0.33 lays it out (one int8 buffer, LBNHC,
  per-layer [B, H, N, K|V] views, 16-token blocks) through a random block
  table, and STOREs the chunks through the Python package (the store
  ordered after the scatter by an interprocess event). It then prefills the
  rest of the prompt from its own cache: the baseline logits.
* process B registers its own paged cache, and for each prompt: LOOKUP,
  RETRIEVE into other block ids, the engine's current stream ordered after
  the retrieve through the job's word (`EngineStream.wait_job`: no CPU
  synchronisation before the first layer reads the KV), gathers the blocks
  into the model's cache and prefills the rest of the prompt. Its logits
  must equal A's bit for bit (the same bytes, the same computation; the
  largest difference is reported); a retrieve of another prompt's KV must
  change them.
* Time to first token in B, medians of `--repeats` runs after a warm-up:
  kvring (lookup + retrieve + gather + prefill of the rest, to the first
  token's logits) against a full prefill of the prompt.
* Retrieve throughput through Python (submit to done, the longest prefix)
  against the pinned-memory copy ceiling measured in the same run.
* Last, the server is SIGKILLed during a retrieve that B's stream waits
  for: the stream must go on (the client releases the job's word), the
  load is reported failed, B recomputes the prefix, and its logits still
  equal the baseline's.

    python bench/bench_ttft.py [--tokens 2000,10000,32000] [--repeats 5] [--json OUT]

It asserts what it checks (bytes, logits, liveness) and measures the rest.
Needs a CUDA GPU with ~40 GiB free, torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

CHUNK = 256
BLOCK = 16
LAYERS, KV_HEADS, HEAD = 32, 8, 128
SEED = 1234
MODEL = "llama-3-8b-geometry-random-init-seed-1234"
VOCAB = 128256


def prompt_tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


def cached_prefix(n: int) -> int:
    """Tokens of whole chunks a cache may serve: never the last token."""
    return (n - 1) // CHUNK * CHUNK


# ---------------------------------------------------------------- the model


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=LAYERS,
        num_attention_heads=32,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD,
        vocab_size=VOCAB,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    # The same seed gives the same weights in both processes; checked.
    with torch.no_grad():
        digest = sum(float(p.float().sum()) for p in list(model.parameters())[:8])
    return model, digest


def layer_kv(cache, i):
    """(keys, values) of layer i of a transformers cache, [1, H, T, D]."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()


# ---------------------------------------------------------------- paged cache


class PagedCache:
    """A KV cache as vLLM 0.33 allocates it: one int8 buffer, physical
    order LBNHC, per layer a [B, H, N, K|V] bf16 view; registered with the
    server through the package (the driver finds the buffer's cudaMalloc
    block from the views' addresses)."""

    def __init__(self, blocks: int):
        import torch

        self.blocks = blocks
        row = 2 * HEAD  # K|V, bf16 elements
        per_layer = blocks * BLOCK * KV_HEADS * row
        self.buffer = torch.zeros(LAYERS * per_layer * 2, dtype=torch.int8, device="cuda")
        flat = self.buffer.view(torch.bfloat16)
        self.views = {
            f"model.layers.{l}.self_attn.attn": torch.as_strided(
                flat,
                (blocks, KV_HEADS, BLOCK, row),
                (BLOCK * KV_HEADS * row, row, KV_HEADS * row, 1),
                l * per_layer,
            )
            for l in range(LAYERS)
        }
        self.layers = list(self.views.values())

    def register(self, client, model_id: int):
        from kvring.tensors import KvGeometry, describe_kv_caches, register_kv_cache_memory

        geometry = KvGeometry(block_tokens=BLOCK, heads=KV_HEADS, k_width=HEAD, v_width=HEAD)
        memory = describe_kv_caches(self.views, geometry)
        return register_kv_cache_memory(client, memory, model_id=model_id)

    def scatter(self, cache, table, tokens: int) -> None:
        """Writes the first `tokens` positions of a transformers cache into
        the blocks of `table` (on the current stream)."""
        n = tokens // BLOCK
        idx = table[:n]
        for l, view in enumerate(self.layers):
            k, v = layer_kv(cache, l)
            for part, t in ((slice(0, HEAD), k), (slice(HEAD, 2 * HEAD), v)):
                x = t[0, :, :tokens].reshape(KV_HEADS, n, BLOCK, HEAD).permute(1, 0, 2, 3)
                view[idx, :, :, part] = x

    def gather(self, model, table, tokens: int):
        """A transformers cache holding the first `tokens` positions read
        from the blocks of `table` (queued on the current stream)."""
        n = tokens // BLOCK
        idx = table[:n]
        cache = new_cache(model)
        for l, view in enumerate(self.layers):
            blocks = view[idx]  # [n, H, N, K|V]
            k = blocks[..., :HEAD].permute(1, 0, 2, 3).reshape(1, KV_HEADS, tokens, HEAD).contiguous()
            v = blocks[..., HEAD:].permute(1, 0, 2, 3).reshape(1, KV_HEADS, tokens, HEAD).contiguous()
            cache.update(k, v, l)
        return cache


def block_table(blocks: int, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randperm(blocks, generator=g)[:n].to("cuda")


def engine_event():
    """An interprocess event on the current stream and its handle: the
    server's copies come after what the engine queued."""
    import torch

    ev = torch.cuda.Event(interprocess=True)
    ev.record()
    return ev, bytes(ev.ipc_handle())


# ---------------------------------------------------------------- process A


def role_a(args) -> dict:
    import torch

    import kvring

    model, digest = build_model()
    mid = kvring.model_id(MODEL)
    lengths = [int(x) for x in args.tokens.split(",")]
    paged = PagedCache(max(cached_prefix(n) for n in lengths) // BLOCK + 8)
    client = kvring.Client(args.name, runtime_dir=args.runtime_dir, connect_timeout=30)
    reg = paged.register(client, mid)
    out = {"weights_digest": digest, "prompts": {}}
    prompts = [(n, n) for n in lengths] + [(max(lengths) + 1, max(lengths))]  # the last: other KV
    for seed, n in prompts:
        tokens = prompt_tokens(n, seed)
        p = cached_prefix(n)
        ids = torch.tensor([tokens], device="cuda")
        table = block_table(paged.blocks, p // BLOCK, seed)
        with torch.no_grad():
            cache = model(ids[:, :p], use_cache=True).past_key_values
            paged.scatter(cache, table, p)
            ev, handle = engine_event()
            hashes = kvring.chunk_hashes(tokens[:p], CHUNK)
            # The store still waits for the event; synchronising first makes
            # `store_s` the copy's time, not the prefill's still running.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            st = client.store(reg, hashes, table.tolist(), after=handle, timeout=60).wait(60)
            store_s = time.perf_counter() - t0
            assert st.ok, st
            logits = model(ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        path = os.path.join(args.workdir, f"logits-{seed}.pt")
        torch.save(logits.float().cpu(), path)
        out["prompts"][str(seed)] = {
            "tokens": n,
            "prefix": p,
            "store_s": store_s,
            "store_gbps": p * LAYERS * KV_HEADS * HEAD * 2 * 2 / store_s / 1e9,
        }
        del cache
        torch.cuda.empty_cache()
    out["stats"] = client.stats()
    return out


# ---------------------------------------------------------------- process B


def ceiling_gbps(gib: float = 1.0) -> dict:
    """Pinned host <-> device copy bandwidth (torch, one stream), median of 5."""
    import torch

    n = int(gib * 2**30)
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    res = {}
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        times = []
        for _ in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        res[name] = n / statistics.median(times[1:]) / 1e9
    return res


def role_b(args, a_out: dict) -> dict:
    import torch

    import kvring

    model, digest = build_model()
    assert digest == a_out["weights_digest"], (digest, a_out["weights_digest"])
    mid = kvring.model_id(MODEL)
    lengths = [int(x) for x in args.tokens.split(",")]
    longest = max(lengths)
    paged = PagedCache(cached_prefix(longest) // BLOCK + 8)
    client = kvring.Client(args.name, runtime_dir=args.runtime_dir, connect_timeout=30)
    reg = paged.register(client, mid)
    dev = torch.cuda.current_device()
    stream = kvring.EngineStream(dev, torch.cuda.current_stream().cuda_stream)
    out = {"ttft": {}, "ceiling_gbps": ceiling_gbps()}

    def load_and_prefill(tokens, table, hashes, ids, p):
        """kvring's path to the first token; returns (logits, job)."""
        lease = client.lookup(mid, 1, hashes)
        if lease.hits != len(hashes):
            raise AssertionError(f"lookup found {lease.hits} of {len(hashes)} chunks")
        _, handle = engine_event()
        job = client.retrieve(reg, lease.id, table[: p // BLOCK].tolist(), after=handle, timeout=60)
        stream.wait_job(job)  # the device waits; the host goes on queueing
        cache = paged.gather(model, table, p)
        logits = model(ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        lease.end()
        return logits, job

    for n in lengths:
        seed = n
        tokens = prompt_tokens(n, seed)
        p = cached_prefix(n)
        ids = torch.tensor([tokens], device="cuda")
        hashes = kvring.chunk_hashes(tokens[:p], CHUNK)
        table = block_table(paged.blocks, p // BLOCK, seed + 7)
        baseline = torch.load(os.path.join(args.workdir, f"logits-{seed}.pt"))
        with torch.no_grad():
            # Correctness first: retrieved KV gives A's logits exactly.
            logits, job = load_and_prefill(tokens, table, hashes, ids, p)
            got = logits.float().cpu()
            st = job.status()
            assert st.ok, st
            diff = float((got - baseline).abs().max())
            identical = bool(torch.equal(got, baseline))
            assert identical, f"{n} tokens: logits differ from the baseline by up to {diff}"
            kv_times, full_times = [], []
            for i in range(args.repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits, job = load_and_prefill(tokens, table, hashes, ids, p)
                logits.argmax().item()  # the first token, on the host
                t1 = time.perf_counter()
                assert job.status().ok
                full = model(ids, use_cache=True, logits_to_keep=1).logits[0, -1]
                full.argmax().item()
                t2 = time.perf_counter()
                if i:
                    kv_times.append((t1 - t0) * 1e3)
                    full_times.append((t2 - t1) * 1e3)
            # Retrieve alone, submit to done, through Python.
            rt = []
            for _ in range(args.repeats):
                lease = client.lookup(mid, 1, hashes)
                t0 = time.perf_counter()
                stj = client.retrieve(reg, lease.id, table[: p // BLOCK].tolist(), timeout=60).wait(60)
                rt.append(time.perf_counter() - t0)
                assert stj.ok, stj
                lease.end()
        torch.cuda.empty_cache()
        kv_ms, full_ms = statistics.median(kv_times), statistics.median(full_times)
        bytes_ = p * LAYERS * KV_HEADS * HEAD * 2 * 2
        out["ttft"][str(n)] = {
            "prefix_tokens": p,
            "kv_bytes": bytes_,
            "logits_identical": identical,
            "logits_max_abs_diff": diff,
            "kvring_ms": {"p50": kv_ms, "min": min(kv_times), "max": max(kv_times)},
            "full_prefill_ms": {"p50": full_ms, "min": min(full_times), "max": max(full_times)},
            "speedup": full_ms / kv_ms,
            "retrieve_gbps": bytes_ / statistics.median(rt) / 1e9,
        }
        out["ttft"][str(n)]["retrieve_vs_h2d_ceiling"] = (
            out["ttft"][str(n)]["retrieve_gbps"] / out["ceiling_gbps"]["h2d"]
        )
        print(json.dumps({n: out["ttft"][str(n)]}), file=sys.stderr, flush=True)

    # Other KV under the longest prompt's suffix changes the logits.
    n = longest
    tokens = prompt_tokens(n, n)
    p = cached_prefix(n)
    other = prompt_tokens(n, n + 1)
    ids = torch.tensor([tokens], device="cuda")
    table = block_table(paged.blocks, p // BLOCK, 99)
    baseline = torch.load(os.path.join(args.workdir, f"logits-{n}.pt"))
    with torch.no_grad():
        logits, job = load_and_prefill(tokens, table, kvring.chunk_hashes(other[:p], CHUNK), ids, p)
        got = logits.float().cpu()
    assert job.status().ok
    out["other_kv_max_abs_diff"] = float((got - baseline).abs().max())
    assert not torch.equal(got, baseline), "another prompt's KV left the logits unchanged"

    # The server SIGKILLed during a retrieve the engine's stream waits for.
    hashes = kvring.chunk_hashes(tokens[:p], CHUNK)
    with torch.no_grad():
        lease = client.lookup(mid, 1, hashes)
        assert lease.hits == len(hashes)
        job = client.retrieve(reg, lease.id, table[: p // BLOCK].tolist(), timeout=60)
        stream.wait_job(job)
        time.sleep(args.kill_after_ms / 1e3)
        state_at_kill = job.status().state
        os.kill(client.server_pid, signal.SIGKILL)
        killed = time.monotonic()
        # What the engine queues behind the load (its forward) runs once
        # the client has released the job's word.
        cache = paged.gather(model, table, p)
        model(ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        queued = torch.cuda.Event()
        queued.record()
        while not queued.query():
            assert time.monotonic() - killed < 10, "the engine's stream is still held 10 s after the kill"
            time.sleep(0.0005)
        released_ms = (time.monotonic() - killed) * 1e3
        try:
            failed = not job.wait(10).ok
            error = None
        except kvring.KvringError as e:
            failed, error = True, type(e).__name__
        # The load failed: recompute the prefix, as an engine does.
        cache = model(ids[:, :p], use_cache=True).past_key_values
        logits = model(ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        got = logits.float().cpu()
    out["server_killed"] = {
        "prompt_tokens": n,
        "job_state_at_kill": state_at_kill,
        "stream_released_ms_after_kill": released_ms,
        "load_reported_failed": failed,
        "error": error,
        "recomputed_logits_identical": bool(torch.equal(got, baseline)),
    }
    assert state_at_kill in ("pending", "running"), f"the retrieve was {state_at_kill} at the kill"
    assert failed, "the retrieve of a killed server was reported done"
    assert out["server_killed"]["recomputed_logits_identical"]
    return out


# ---------------------------------------------------------------- driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2000,10000,32000", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pool", default="12GiB", help="the server's pool")
    ap.add_argument("--kill-after-ms", type=float, default=10.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--role", choices=["a", "b"], help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--runtime-dir", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "a":
        json.dump(role_a(args), open(os.path.join(args.workdir, "a.json"), "w"))
        return 0
    if args.role == "b":
        a_out = json.load(open(os.path.join(args.workdir, "a.json")))
        json.dump(role_b(args, a_out), open(os.path.join(args.workdir, "b.json"), "w"))
        return 0

    workdir = tempfile.mkdtemp(prefix="kvring-ttft-")
    name = f"ttft-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    log = open(os.path.join(workdir, "server.log"), "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvring", "serve", "--name", name, "--runtime-dir", workdir,
         "--backend", "cuda", "--chunk-tokens", str(CHUNK), "--pool-bytes", args.pool],
        stdout=log, stderr=subprocess.STDOUT,
    )
    common = ["--tokens", args.tokens, "--repeats", str(args.repeats), "--kill-after-ms",
              str(args.kill_after_ms), "--name", name, "--runtime-dir", workdir, "--workdir", workdir]
    try:
        for role in ("a", "b"):
            r = subprocess.run([sys.executable, __file__, "--role", role, *common], timeout=900)
            if r.returncode:
                log.seek(0)
                print(log.read()[-4000:], file=sys.stderr)
                return r.returncode
        a_out = json.load(open(os.path.join(workdir, "a.json")))
        b_out = json.load(open(os.path.join(workdir, "b.json")))
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)
    result = {
        "model": "Llama-3-8B geometry, random init, bf16 (transformers, sdpa)",
        "layout": "vLLM 0.33 one int8 buffer, LBNHC, 16-token blocks, 256-token chunks",
        "store": a_out["prompts"],
        **b_out,
    }
    text = json.dumps(result, indent=2)
    if args.json:
        open(args.json, "w").write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
