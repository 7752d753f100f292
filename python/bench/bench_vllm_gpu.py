"""kvring inside a real vLLM engine on a GPU, side by side with what users
would pick instead: no connector (recompute) and vLLM's own CPU offloading
(`OffloadingConnector`, the same CPU budget).

One engine per process: `run` measures one configuration (`--config none |
native | kvring`, `--mode graphs | eager`) and writes its JSON; `report`
reads several and prints the tables, as ratios. Measured in every run:

* the pinned host-to-device copy ceiling (torch, 1 GiB, median of 10): the
  floor of a hit is cached KV bytes / this, plus the no-connector time of
  the uncached suffix (measured in the `none` run: `suffix`);
* `ttft`: time to first token of single requests of 512, 1K, 2K, 10K and 30K
  tokens, cold (never seen) and warm (the same prompt again after it was
  stored), from vLLM's own request metrics (queued -> scheduled -> first
  token) and the wall time of `generate`; `num_cached_tokens`; the first
  token's log-probabilities (top 5) for the correctness check, and a
  control prompt (the same uncached suffix after another prefix); for
  kvring, each warm request's wait split at its load (`place_loads`); the
  time from arrival to vLLM's queue (`to_queued`: vLLM's input processing,
  which with any connector hashes every block of the prompt);
* `nohit`: 64 prompts of 1K tokens, 128 output tokens each, submitted
  together, nothing to hit: output tokens/s;
* `shared`: 48 requests of an 8K-token prefix stored before plus 64 tokens
  of their own, 64 output tokens, submitted together; `burst`: the same on
  a prefix never seen: output tokens/s, TTFT p50/p99, hits;
* `engine_b` (kvring only, with `--server` and `--warm-only`): a second
  engine process on the same kvring server loads what the first stored;
* `faults` (kvring only): the server SIGSTOPped or SIGKILLed while warm 30K
  prompts load: every request must finish, with the cold run's first token.

The model is Llama-3-8B's geometry with dummy weights scaled to std 0.02 (the
norm gains set to 1), so outputs depend on the KV; prefix caching is off so
every reused token comes from the connector. Prompts are token ids from
seeded generators: every configuration sees the same prompts.

    python bench_vllm_gpu.py run --config kvring --mode eager --out R.json
    python bench_vllm_gpu.py report R1.json R2.json ... [--json OUT]

Needs vLLM (0.26 to 0.34), torch with CUDA, and for `kvring` the kvring
package. `--geometry tiny` and `--device cpu` run the same code on a CPU
vLLM with a 2-layer model (a check of the script, not a measurement).
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
import threading
import time
import uuid

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model(a function)
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

CHUNK = 256
GEOMETRIES = {
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 128 KiB of KV per token.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      vocab_size=128256, max_position_embeddings=32768),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 vocab_size=4096, max_position_embeddings=4096),
}
TTFT_LENGTHS = (512, 1024, 2048, 10000, 30000)
SUFFIX = 16  # tokens of the `suffix` test: a short uncached forward


# ---------------------------------------------------------------- model


def make_model_dir(path: str, geometry: str) -> str:
    """A LlamaForCausalLM folder (config and a word-level tokenizer over the
    whole vocabulary); the weights are vLLM's dummy ones."""
    g = GEOMETRIES[geometry]
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
        **g,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(g["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1",
                   "eos_token": "t2", "unk_token": "t0", "model_max_length": g["max_position_embeddings"]}, f)
    return path


def scale_weights(model) -> dict:
    """Run in each worker (`LLM.apply_model`): every weight of rank >= 2 to
    std 0.02 from a generator seeded by its name, every norm gain to 1, so
    that activations (and so the outputs) depend on the whole context."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(sum(name.encode()) * 7919 + len(name))
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(p.dtype) * 0.02)
                n += 1
            elif "norm" in name:
                p.fill_(1.0)
    return {"scaled": n}


# ---------------------------------------------------------------- prompts


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def ttft_prompts(lengths, reps: dict, vocab: int) -> list[dict]:
    """For each length and repetition: the prompt, and a control with the
    same uncached tail after another prefix."""
    out = []
    for n in lengths:
        for r in range(reps[n]):
            p = tokens(1_000_003 * n + r, n, vocab)
            cached = (n - 1) // CHUNK * CHUNK
            control = tokens(7_000_001 * n + r, cached, vocab) + p[cached:]
            out.append({"len": n, "rep": r, "ids": p, "control": control})
    return out


# ---------------------------------------------------------------- measuring


def pinned_h2d_ceiling(device: str) -> dict | None:
    """GB/s of one 1 GiB pinned host-to-device copy, median of 10 (CUDA events)."""
    import torch

    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    med = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 1 << 30, "median_s": med, "gb_per_s": (1 << 30) / med / 1e9}


def request_times(out) -> dict:
    """vLLM's own timestamps of a request (seconds; what the version has)."""
    m = getattr(out, "metrics", None)
    if m is None:
        return {}
    d = {}
    for k in ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts",
              "first_token_latency", "first_scheduled_time", "first_token_time", "time_in_queue"):
        v = getattr(m, k, None)
        if isinstance(v, (int, float)):
            d[k] = float(v)
    if "scheduled_ts" in d and "queued_ts" in d:
        d["queue_to_scheduled_s"] = d["scheduled_ts"] - d["queued_ts"]
    if "first_token_ts" in d and "scheduled_ts" in d:
        d["scheduled_to_first_token_s"] = d["first_token_ts"] - d["scheduled_ts"]
    return d


def first_logprobs(out) -> list:
    lp = out.outputs[0].logprobs
    if not lp:
        return []
    return sorted(([int(t), float(v.logprob)] for t, v in lp[0].items()), key=lambda x: -x[1])


def one(llm, ids, sp) -> dict:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    times = request_times(out)
    return {
        "wall_s": wall,
        "ttft_s": times.get("first_token_latency", wall),
        "cached": out.num_cached_tokens or 0,
        "first_token": out.outputs[0].token_ids[0] if out.outputs[0].token_ids else None,
        "logprobs": first_logprobs(out),
        "times": times,
    }


def batch(llm, prompts, sp) -> dict:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    times = [request_times(o) for o in outs]
    ttfts = sorted(t.get("first_token_latency", float("nan")) for t in times)
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    # Where a slower run lost its time: the first token of every request
    # (the prefills, and the stores they start) against the decode steps
    # after it (the per-step cost of a connector).
    firsts = [t["first_token_ts"] for t in times if "first_token_ts" in t]
    starts = [t["scheduled_ts"] for t in times if "scheduled_ts" in t]
    lasts = [t["last_token_ts"] for t in times if "last_token_ts" in t]
    itl = sorted((t["last_token_ts"] - t["first_token_ts"]) / (len(o.outputs[0].token_ids) - 1)
                 for o, t in zip(outs, times)
                 if "last_token_ts" in t and "first_token_ts" in t and len(o.outputs[0].token_ids) > 1)
    return {
        "requests": len(outs),
        "wall_s": wall,
        "output_tokens": gen,
        "output_tokens_per_s": gen / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "prefill_phase_s": max(firsts) - min(starts) if firsts and starts else None,
        "decode_phase_s": max(lasts) - max(firsts) if firsts and lasts else None,
        "itl_p50_s": statistics.median(itl) if itl else None,
        "hit_requests": sum(1 for o in outs if (o.num_cached_tokens or 0) > 0),
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "first_tokens": [o.outputs[0].token_ids[0] for o in outs],
        "timeline": timeline(outs, times),
    }


def timeline(outs, times) -> list[dict]:
    """Each request of a batch in the order it was scheduled: when it was
    queued, scheduled and got its first token (seconds after the first
    request was queued; vLLM's monotonic timestamps) and its cached tokens.
    Says where a batch's time went when its percentiles do not."""
    t0 = min((t["queued_ts"] for t in times if "queued_ts" in t), default=None)
    if t0 is None:
        return []
    rows = []
    for o, t in zip(outs, times):
        row = {k: round(t[k] - t0, 4) for k in ("queued_ts", "scheduled_ts", "first_token_ts") if k in t}
        row["cached"] = o.num_cached_tokens or 0
        rows.append(row)
    return sorted(rows, key=lambda r: r.get("scheduled_ts", float("inf")))


def settle(seconds: float) -> None:
    """Lets stores issued by the last request end before the next lookup."""
    time.sleep(seconds)


# ---------------------------------------------------------------- server


class Server:
    """A kvring server of its own (python -m kvring serve), stopped at exit."""

    def __init__(self, name: str, runtime_dir: str, pool: str, chunk_tokens: int = CHUNK, *args: str) -> None:
        """`args`: more `kvring serve` flags."""
        self.name, self.runtime_dir = name, runtime_dir
        os.makedirs(runtime_dir, exist_ok=True)
        os.chmod(runtime_dir, 0o700)  # the server refuses a directory others may enter
        self.log = open(os.path.join(runtime_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvring", "serve", "--name", name, "--runtime-dir", runtime_dir,
             "--pool-bytes", pool, "--chunk-tokens", str(chunk_tokens), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        import kvring

        deadline = time.monotonic() + 180
        while True:
            try:
                kvring.Client(name, runtime_dir=runtime_dir, connect_timeout=1.0).close()
                return
            except kvring.KvringError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvring server {name} did not start: see {self.log.name}") from None
                time.sleep(0.2)

    def stats(self) -> dict:
        import kvring

        try:
            with kvring.Client(self.name, runtime_dir=self.runtime_dir, connect_timeout=1.0) as c:
                return dict(c.stats())
        except kvring.KvringError as e:
            return {"error": str(e)}

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


# ---------------------------------------------------------------- one configuration


def settings(items: list[str]) -> dict:
    """KEY=VALUE arguments: the value as JSON where it reads as JSON (a
    number, true/false, a list, an object, a string in quotes), else as
    the string given."""
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = json.loads(v) if v[:1] in "0123456789tf[{\"-" else v
    return out


def build_llm(args, model_dir: str, server: Server | None):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if args.config == "native":
        kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": args.cpu_gib << 30})
    elif args.config == "kvring":
        extra = {"kvring.name": server.name, "kvring.runtime_dir": server.runtime_dir,
                 "kvring.autostart": False}
        extra.update(settings(args.extra))
        kv = KVTransferConfig(kv_connector="KvringConnector", kv_connector_module_path="kvring.vllm",
                              kv_role="kv_both", kv_connector_extra_config=extra)
    kw = dict(model=model_dir, tokenizer=model_dir, load_format="dummy", dtype="bfloat16",
              max_model_len=GEOMETRIES[args.geometry]["max_position_embeddings"],
              enable_prefix_caching=False, seed=0, enforce_eager=args.mode == "eager",
              disable_log_stats=False, kv_transfer_config=kv)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_util
    kw.update(settings(args.engine))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start = time.perf_counter() - t0
    # By reference to this file as a module: vLLM's workers unpickle it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_vllm_gpu import scale_weights as scale

    scaled = llm.apply_model(scale)
    return llm, {"engine_start_s": start, "scaled": scaled}


def run(args) -> dict:
    import torch
    from vllm import SamplingParams

    vocab = GEOMETRIES[args.geometry]["vocab_size"]
    res: dict = {"config": args.config, "mode": args.mode, "geometry": args.geometry,
                 "device": args.device, "tests": args.tests}
    import vllm

    res["vllm"] = vllm.__version__
    res["torch"] = torch.__version__
    if args.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    res["ceiling_h2d"] = pinned_h2d_ceiling(args.device)
    model_dir = make_model_dir(os.path.join(tempfile.gettempdir(), f"kvring-bench-{args.geometry}"), args.geometry)

    server = own = None
    if args.config == "kvring":
        if args.server:
            server = Server.__new__(Server)
            server.name, server.runtime_dir, server.proc = args.server, args.runtime_dir, None
        else:
            rd = args.runtime_dir or tempfile.mkdtemp(prefix="kvring-bench-")
            server = own = Server(f"bench-{uuid.uuid4().hex[:8]}", rd, f"{args.cpu_gib}GiB", args.chunk_tokens)
        res["server"] = {"name": server.name, "runtime_dir": server.runtime_dir}
    try:
        llm, info = build_llm(args, model_dir, server)
        res.update(info)
        lengths = [n for n in args.lengths if n <= GEOMETRIES[args.geometry]["max_position_embeddings"] - 64]
        reps = {n: (args.reps if n <= 2048 else max(2, args.reps // 2)) for n in lengths}
        sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
        # Warm-up (kernels, graphs, the connector's first lookups).
        for s in range(3):
            one(llm, tokens(99 + s, 2048 if args.geometry != "tiny" else 600, vocab), sp1)
        settle(0.5)
        if "ttft" in args.tests:
            res["ttft"] = test_ttft(llm, args, lengths, reps, vocab, sp1)
            if args.config == "kvring":
                place_loads(llm, res["ttft"])
        if "suffix" in args.tests:
            res["suffix"] = [one(llm, tokens(5 + r, SUFFIX, vocab), sp1) for r in range(args.reps)]
        if "nohit" in args.tests:
            n = 1024 if args.geometry != "tiny" else 300
            sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
            res["nohit"] = batch(llm, [tokens(20_000 + i, n, vocab) for i in range(64)], sp)
        if "shared" in args.tests:
            res["shared"] = test_shared(llm, args, vocab, stored=True)
        if "burst" in args.tests:
            res["burst"] = test_shared(llm, args, vocab, stored=False)
        if server is not None:
            res["server_stats"] = server.stats()
        if "faults" in args.tests and own is not None:
            res["faults"] = test_faults(llm, args, vocab, own, sp1)
        try:
            res["vllm_metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                                   if "kv" in m.name or "prefix" in m.name or "request_success" in m.name}
        except Exception as e:  # metrics off in this version
            res["vllm_metrics"] = {"error": repr(e)}
    finally:
        if own is not None:
            own.stop()
    return res


def test_ttft(llm, args, lengths, reps, vocab, sp1) -> list[dict]:
    rows = []
    for p in ttft_prompts(lengths, reps, vocab):
        row = {"len": p["len"], "rep": p["rep"]}
        if not args.warm_only:
            row["cold"] = one(llm, p["ids"], sp1)
            settle(0.3 + p["len"] / 20000)
        row["warm"] = one(llm, p["ids"], sp1)
        row["control"] = one(llm, p["control"], sp1)
        settle(0.1 + p["len"] / 40000)
        rows.append(row)
    return rows


def connector_loads(worker) -> list[dict]:
    """In each vLLM worker (`collective_rpc`): the loads kvring's connector
    saw, submitted and seen over (monotonic clock, as vLLM's timestamps)."""
    import dataclasses

    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    side = getattr(get_kv_transfer_group(), "_worker", None)
    return [dataclasses.asdict(x) for x in getattr(side, "loads_seen", ())]


def place_loads(llm, rows: list[dict]) -> None:
    """Places each warm request's load among vLLM's timestamps: `load_s`
    (submitted until the worker saw it over: the copy and the poll), and
    for an asynchronous load its wait (queued -> scheduled) split at it:
    `to_submit_s` (lookup and scheduling until the worker submitted the
    retrieve; of it `to_plan_s`, until the scheduler planned the load,
    `to_worker_s`, until the worker got the step that carries it, and
    `submit_s`, the worker's own part) and `to_schedule_s` (until vLLM
    scheduled the request)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_vllm_gpu import connector_loads as fetch

    try:
        loads = [x for per_worker in llm.collective_rpc(fetch) for x in per_worker]
    except Exception as e:  # a vLLM without collective_rpc of a function
        print(f"the connector's loads could not be read: {e}", flush=True)
        return
    for row in rows:
        t = row.get("warm", {}).get("times", {})
        q, sched, first = t.get("queued_ts"), t.get("scheduled_ts"), t.get("first_token_ts")
        if q is None or sched is None or first is None:
            continue
        mine = [x for x in loads if q <= x["submitted"] <= first]
        if len(mine) != 1:
            continue
        x = mine[0]
        t["load_s"] = x["seen_over"] - x["submitted"]
        t["load_chunks"] = x["chunks"]
        t["load_polls"] = x.get("polls")
        if x["submitted"] <= sched:
            # Asynchronous: the request was scheduled once it was over (a
            # synchronous load runs in the scheduled step's forward).
            t["to_submit_s"] = x["submitted"] - q
            t["to_schedule_s"] = sched - x["seen_over"]
            if x.get("planned") and x.get("received"):
                t["to_plan_s"] = x["planned"] - q
                t["to_worker_s"] = x["received"] - x["planned"]
                t["submit_s"] = x["submitted"] - x["received"]


def test_shared(llm, args, vocab, stored: bool) -> dict:
    from vllm import SamplingParams

    n = 8192 if args.geometry != "tiny" else 1024
    prefix = tokens(31_337 if stored else 41_337, n, vocab)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    if stored:
        one(llm, prefix + tokens(777, 64, vocab), SamplingParams(max_tokens=1, temperature=0.0))
        settle(1.0)
    prompts = [prefix + tokens(50_000 + i + (0 if stored else 1000), 64, vocab) for i in range(48)]
    return batch(llm, prompts, sp)


def test_faults(llm, args, vocab, server: Server, sp1) -> dict:
    """Warm 30K prompts load while the server is SIGSTOPped, then while it
    is SIGKILLed: each request must finish, with its cold first token."""
    n = 30000 if args.geometry != "tiny" else 2000
    prompts = [tokens(90_000 + i, n, vocab) for i in range(4)]
    cold = [one(llm, p, sp1) for p in prompts]
    settle(2.0)
    out: dict = {"cold_first_tokens": [c["first_token"] for c in cold]}
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        name = signal.Signals(sig).name
        runs = []
        # Signal the server 20 ms into the second request's load.
        timer = threading.Timer(0.02, server.signal, args=(sig,))
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            if i == 1:
                timer.start()
            r = one(llm, p, sp1)
            r["at_s"] = time.perf_counter() - t0
            runs.append(r)
        timer.join()
        ok = all(r["first_token"] == c["first_token"] for r, c in zip(runs, cold))
        out[name] = {"requests": [{k: r[k] for k in ("wall_s", "cached", "first_token", "at_s")} for r in runs],
                     "all_finished": len(runs) == len(prompts), "first_tokens_match_cold": ok,
                     "longest_s": max(r["wall_s"] for r in runs)}
        if sig == signal.SIGSTOP:
            server.signal(signal.SIGCONT)
            settle(2.0)
    return out


# ---------------------------------------------------------------- report


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def to_queued(r: dict) -> float | None:
    """A request's time from arrival to vLLM's scheduler queue: its time to
    first token less queued -> scheduled -> first token."""
    t = r.get("times", {})
    parts = (t.get("queue_to_scheduled_s"), t.get("scheduled_to_first_token_s"))
    return None if None in parts or r.get("ttft_s") is None else r["ttft_s"] - sum(parts)


def summarize(results: list[dict]) -> dict:
    """Per mode: TTFT medians per length and configuration, the floor, the
    ratios the targets name, throughput, and the correctness check."""
    kv_bytes_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    out: dict = {}
    for mode in sorted({r["mode"] for r in results}):
        rs: dict = {}
        for r in results:
            if r["mode"] == mode:
                merge_run(rs.setdefault(label(r), {}), r)
        ceiling = med([r["ceiling_h2d"]["gb_per_s"] for r in rs.values() if r.get("ceiling_h2d")])
        none = rs.get("none", {})
        # The fastest short forward: a floor is a lower bound, and the
        # first forward of an eager engine pays for its warm-up.
        suffix = min((x["ttft_s"] for x in none.get("suffix", [])), default=None)
        m: dict = {"ceiling_h2d_gb_per_s": ceiling, "suffix_ttft_s": suffix, "ttft": {}}
        lengths = sorted({row["len"] for r in rs.values() for row in r.get("ttft", [])})
        for n in lengths:
            # The most KV any configuration loaded for this prompt (a hit
            # of whole chunks, or all but its last token).
            cached = max((row["warm"]["cached"] for r in rs.values() for row in r.get("ttft", [])
                          if row["len"] == n and r is not none), default=(n - 1) // CHUNK * CHUNK)
            floor = cached * kv_bytes_per_token / (ceiling * 1e9) + (suffix or 0) if ceiling else None
            e = {"floor_s": floor}
            ref = {row["rep"]: row for row in none.get("ttft", []) if row["len"] == n}
            for cfg, r in rs.items():
                rows = [row for row in r.get("ttft", []) if row["len"] == n]
                if not rows:
                    continue
                warm = [row["warm"]["ttft_s"] for row in rows]
                c = {
                    "cold_s": med([row["cold"]["ttft_s"] for row in rows if "cold" in row]),
                    "warm_s": med(warm),
                    "warm_p99_s": max(warm),
                    "warm_cached": med([row["warm"]["cached"] for row in rows]),
                    "warm_queue_s": med([row["warm"]["times"].get("queue_to_scheduled_s") for row in rows]),
                    "warm_step_s": med([row["warm"]["times"].get("scheduled_to_first_token_s") for row in rows]),
                    # Arrival to queued: vLLM's input processing (with a
                    # connector, hashing every block of the prompt).
                    "warm_to_queued_s": med([to_queued(row["warm"]) for row in rows]),
                    "cold_to_queued_s": med([to_queued(row["cold"]) for row in rows if "cold" in row]),
                }
                # kvring's wait split at its load (`place_loads`).
                for k in ("to_submit_s", "to_plan_s", "to_worker_s", "submit_s", "load_s", "to_schedule_s"):
                    got = [row["warm"]["times"][k] for row in rows if k in row["warm"]["times"]]
                    if got:
                        c[f"warm_{k}"] = med(got)
                # correctness: first-token logprob against the no-connector run of the same prompt
                diffs, ctrl = [], []
                for row in rows:
                    base = ref.get(row["rep"], {}).get("cold") or ref.get(row["rep"], {}).get("warm")
                    if base and base["logprobs"] and row["warm"]["logprobs"]:
                        diffs.append(abs(row["warm"]["logprobs"][0][1] - lp_of(base["logprobs"], row["warm"]["logprobs"][0][0])))
                        if row["control"]["logprobs"]:
                            ctrl.append(abs(row["control"]["logprobs"][0][1] - lp_of(base["logprobs"], row["control"]["logprobs"][0][0])))
                        c.setdefault("same_first_token", True)
                        c["same_first_token"] &= row["warm"]["first_token"] == base["first_token"]
                c["logprob_diff_max"] = max(diffs) if diffs else None
                c["control_logprob_diff_min"] = min(ctrl) if ctrl else None
                if floor and c["warm_s"]:
                    c["warm_over_floor"] = c["warm_s"] / floor
                e[cfg] = c
            for cfg in list(e):
                if cfg not in ("floor_s", "none") and isinstance(e[cfg], dict):
                    if "none" in e and e["none"].get("cold_s"):
                        e[cfg]["speedup_vs_none"] = e["none"]["cold_s"] / e[cfg]["warm_s"]
                    if "native" in e and e["native"].get("warm_s"):
                        e[cfg]["speedup_vs_native"] = e["native"]["warm_s"] / e[cfg]["warm_s"]
            m["ttft"][n] = e
        for test in ("nohit", "shared", "burst"):
            m[test] = {cfg: {k: v for k, v in r[test].items() if k not in ("first_tokens", "timeline")}
                       for cfg, r in rs.items() if test in r}
        m["faults"] = {cfg: r["faults"] for cfg, r in rs.items() if "faults" in r}
        out[mode] = m
    return out


def merge_run(into: dict, r: dict) -> None:
    """Runs of one configuration and mode (one process measured the load
    tests, another the TTFTs) read as one: lists of rows are joined, other
    fields kept from the first run that has them."""
    for k, v in r.items():
        if isinstance(v, list) and isinstance(into.get(k), list):
            into[k] = into[k] + v
        else:
            into.setdefault(k, v)


def label(r: dict) -> str:
    """A run's name in the tables: its configuration, its `--extra` and
    `--engine` settings (`kvring[kvring.layer_groups=1]`), `-b` for a
    second engine; a kvring chunk size other than 256 as `chunk=N`."""
    name = r["config"]
    tags = list(r.get("extra", [])) + list(r.get("engine", []))
    if r["config"] == "kvring" and r.get("chunk_tokens", CHUNK) != CHUNK:
        tags.append(f"chunk={r['chunk_tokens']}")
    if tags:
        name += "[" + ",".join(tags) + "]"
    return name + ("-b" if r.get("warm_only") else "")


def lp_of(logprobs: list, token: int) -> float:
    """The log-probability of `token` in a top-k list (the smallest listed
    if it is not there: a lower bound of the difference)."""
    for t, v in logprobs:
        if t == token:
            return v
    return logprobs[-1][1]


def report(args) -> None:
    results = []
    for path in args.files:
        with open(path) as f:
            results.append(json.load(f))
    s = summarize(results)
    print(json.dumps(s, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "runs": results}, f, indent=1, default=str)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one configuration in this process")
    r.add_argument("--config", choices=["none", "native", "kvring"], required=True)
    r.add_argument("--mode", choices=["graphs", "eager"], default="graphs")
    r.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3-8b")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    r.add_argument("--tests", default="ttft,suffix,nohit,shared,burst",
                   help="comma-separated: ttft suffix nohit shared burst faults")
    r.add_argument("--lengths", default=",".join(map(str, TTFT_LENGTHS)))
    r.add_argument("--reps", type=int, default=5, help="prompts per length up to 2K (half above)")
    r.add_argument("--cpu-gib", type=int, default=24, help="CPU budget of the cache (both connectors)")
    r.add_argument("--gpu-util", type=float, default=0.5)
    r.add_argument("--chunk-tokens", type=int, default=CHUNK,
                   help="tokens per kvring chunk (the server started here)")
    r.add_argument("--server", help="an existing kvring server's name (else one is started)")
    r.add_argument("--runtime-dir")
    r.add_argument("--warm-only", action="store_true",
                   help="ttft: no cold run (engine B on prompts engine A stored)")
    r.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="a vllm.LLM argument (JSON value or string), e.g. async_scheduling=false")
    r.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                   help="more kvring.* connector settings")
    r.add_argument("--out", required=True)
    p = sub.add_parser("report", help="the tables from several runs")
    p.add_argument("files", nargs="+")
    p.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "report":
        report(args)
        return
    args.tests = [t for t in args.tests.split(",") if t]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    res = run(args)
    res["warm_only"] = args.warm_only
    res["extra"] = args.extra
    res["engine"] = args.engine
    res["chunk_tokens"] = args.chunk_tokens
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
