"""kvring as SGLang's HiCache storage backend, inside a real SGLang engine on
a GPU, side by side with what SGLang users have without it: recomputing,
and SGLang's own host tier.

One kvring server (`--chunk-tokens` = SGLang's page size) and SGLang
engines with the hierarchical cache and kvring's backend
(`kvring.sglang.KvringStorage`, write-through, prefetch `wait_complete`),
each engine in a process of its own:

* engine A, for each prompt length: the prompt cold (computed, then
  backed up to the host tier and kvring); again after a filler prompt
  pushed it out of the GPU pool (`host`: SGLang's host tier); again after
  `flush_cache()` emptied the GPU and host tiers (`kvring`); a control
  prompt (another prefix, the same last page);
* engine B, a new engine on the same server (an engine restart: SGLang's
  own tiers are gone): each prompt again (`restart`); then faults: the
  server SIGSTOPped while the largest prompt is asked for after a flush
  (SGLang must serve it, recomputing), and SIGKILLed the same way.

Measured: time to first token (the wall time of `generate` with one output
token), SGLang's `cached_tokens_details` (where each reused token came
from), and the first token's log-probability against the cold run's, next
to the control's. The model is Llama-3-8B's geometry with SGLang's dummy
weights redrawn by `sglang_models` (outputs depend on the KV).

    python bench_sglang_gpu.py run --out R.json [--lengths 2048,10000,30000]

Needs SGLang 0.5.16 (its environment: attention_backend "triton"), torch
with CUDA, and the kvring package in SGLang's scheduler processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_vllm_gpu import GEOMETRIES, Server, make_model_dir, pinned_h2d_ceiling, tokens  # noqa: E402

VOCAB = GEOMETRIES["llama3-8b"]["vocab_size"]
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x K|V x bf16


def prompt(n: int) -> list[int]:
    return tokens(2_000_003 * n, n, VOCAB)


def control(n: int, page: int) -> list[int]:
    """Another prefix, then the prompt's last page: what a wrong KV gives."""
    keep = page + n % page
    return tokens(9_000_011 * n, n - keep, VOCAB) + prompt(n)[-keep:]


def gib(size: str) -> float:
    """GiB of a size as `kvring serve --pool-bytes` takes it (`24GiB`, `512MiB`, bytes)."""
    for unit, scale in (("TiB", 1024.0), ("GiB", 1.0), ("MiB", 1 / 1024), ("KiB", 1 / 2**20)):
        if size.endswith(unit):
            return float(size[: -len(unit)]) * scale
    return int(size) / 2**30


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def ensure_mem_available(gib: float) -> dict:
    """SGLang refuses a host pool larger than MemAvailable - 10 GiB, and a VM's
    MemAvailable may grow only once memory is used: memory is touched in a
    helper process (freed when it exits) until it reads `gib`."""
    before = mem_available_gib()
    if before < gib:
        code = (
            "import torch,sys\n"
            "bufs=[]\n"
            "def avail():\n"
            "  return int([l for l in open('/proc/meminfo') if l.startswith('MemAvailable:')][0].split()[1])/2**20\n"
            f"while avail() < {gib} and len(bufs) < 200:\n"
            "  bufs.append(torch.ones(1<<30, dtype=torch.uint8))\n"
        )
        subprocess.run([sys.executable, "-c", code], timeout=300, check=False)
    return {"before_gib": round(before, 1), "after_gib": round(mem_available_gib(), 1), "wanted_gib": gib}


# ---------------------------------------------------------------- one engine (child process)


def engine_kwargs(a, model_dir: str) -> dict:
    extra = {
        "backend_name": "kvring",
        "module_path": "kvring.sglang",
        "class_name": "KvringStorage",
        "interface_v1": 1,
        "kvring.name": a.server,
        "kvring.runtime_dir": a.runtime_dir,
        "kvring.autostart": False,
    }
    return dict(
        model_path=model_dir, load_format="dummy", dtype="bfloat16", mem_fraction_static=0.6,
        attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
        disable_cuda_graph=not a.cuda_graph, random_seed=0, log_level="warning", tp_size=1,
        enable_cache_report=True, context_length=GEOMETRIES["llama3-8b"]["max_position_embeddings"],
        page_size=a.page_size, max_total_tokens=a.device_tokens,
        enable_hierarchical_cache=True, hicache_size=a.hicache_gb, hicache_write_policy="write_through",
        hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra), watchdog_timeout=600,
    )


def generate(engine, ids: list[int]) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
    t0 = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True,
                          logprob_start_len=len(ids) - 1, top_logprobs_num=5)
    wall = time.perf_counter() - t0
    mi = out.get("meta_info", {})
    lp = mi.get("output_token_logprobs") or []
    return {
        "ttft_ms": wall * 1e3,
        "prompt_tokens": mi.get("prompt_tokens"),
        "cached_tokens": mi.get("cached_tokens"),
        "cached_from": mi.get("cached_tokens_details"),
        "first_id": (out.get("output_ids") or [None])[0],
        "first_logprob": float(lp[0][0]) if lp and lp[0] and lp[0][0] is not None else None,
    }


def server_objects(a) -> int:
    import kvring

    with kvring.Client(a.server, runtime_dir=a.runtime_dir, connect_timeout=1.0) as c:
        return int(c.stats()["objects"])


def wait_stored(a, at_least: int, limit_s: float = 30.0) -> dict:
    """Until the server holds `at_least` objects and none arrived for 0.5 s,
    or none arrived for 3 s (SGLang backs up fewer pages than expected)."""
    t0 = time.monotonic()
    last, since = -1, t0
    while time.monotonic() - t0 < limit_s:
        n = server_objects(a)
        if n != last:
            last, since = n, time.monotonic()
        quiet = time.monotonic() - since
        if (n >= at_least and quiet >= 0.5) or quiet >= 3.0:
            break
        time.sleep(0.1)
    return {"objects": last, "wanted": at_least, "waited_s": round(time.monotonic() - t0, 2)}


def flush(engine) -> None:
    for _ in range(40):
        r = engine.flush_cache()
        if getattr(r, "success", r) in (True, None) or (isinstance(r, dict) and r.get("success")):
            return
        time.sleep(0.25)
    raise RuntimeError("flush_cache() did not succeed")


def child(a) -> int:
    os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = "sglang_models"
    os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
    import sglang

    records = []

    def emit(**r) -> None:
        r["phase"] = a.phase
        records.append(r)
        print("RESULT " + json.dumps(r), flush=True)
        with open(a.results, "a") as f:
            f.write(json.dumps(r) + "\n")

    t0 = time.monotonic()
    engine = sglang.Engine(**engine_kwargs(a, a.model_dir))
    emit(step="engine_start", s=round(time.monotonic() - t0, 1))
    try:
        if a.phase == "a":
            stored = 0

            def expect(ids: list[int]) -> int:
                # The prompt's whole pages, but for one that may stay unstored.
                return (len(ids) - 1) // a.page_size - 1

            for n in a.lengths:
                ids = prompt(n)
                emit(step="cold", len=n, **generate(engine, ids))
                stored += expect(ids)
                emit(step="stored", len=n, **wait_stored(a, stored))
                # Two prompts that fill SGLang's GPU pool push this one out of
                # it, to the host tier (each within the model's context).
                for k in range(2):
                    filler = tokens(5_000_017 * n + k, a.device_tokens // 2, VOCAB)
                    emit(step="filler", len=n, **generate(engine, filler))
                    stored += expect(filler)
                emit(step="host", len=n, **generate(engine, ids))
                wait_stored(a, stored)
                flush(engine)
                emit(step="kvring", len=n, **generate(engine, ids))
                emit(step="control", len=n, **generate(engine, control(n, a.page_size)))
        else:
            for n in a.lengths:
                emit(step="restart", len=n, **generate(engine, prompt(n)))
            n = max(a.lengths)
            for sig, name in ((signal.SIGSTOP, "stopped"), (signal.SIGKILL, "killed")):
                flush(engine)
                os.kill(a.server_pid, sig)
                try:
                    emit(step=f"server_{name}", len=n, **generate(engine, prompt(n)))
                finally:
                    if sig == signal.SIGSTOP:
                        os.kill(a.server_pid, signal.SIGCONT)
                        time.sleep(1.5)  # the backend reconnects at most every second
    finally:
        engine.shutdown()
    return 0


# ---------------------------------------------------------------- orchestrator


def run(a) -> int:
    work = tempfile.mkdtemp(prefix="kvring-sglang-bench-")
    model_dir = make_model_dir(os.path.join(work, "model"), "llama3-8b")
    pool_gib = gib(a.pool_bytes)
    result = {"config": {k: v for k, v in vars(a).items() if k != "func"},
              "memory": ensure_mem_available(a.hicache_gb + pool_gib + 12),
              "h2d_ceiling": pinned_h2d_ceiling("cuda"), "records": [], "errors": []}
    name = f"sgbench-{uuid.uuid4().hex[:8]}"
    rundir = os.path.join(work, "run")
    # Prefaulted: a first store into fresh pool memory spends most of its
    # time zeroing pages (measured on the 2-core VM).
    server = Server(name, rundir, a.pool_bytes, a.page_size, "--copy-threads", str(a.copy_threads),
                    "--backend", "host", "--prefault")
    results = os.path.join(work, "results.jsonl")
    deadline = time.monotonic() + a.total_s
    try:
        for phase in a.phases.split(","):
            left = deadline - time.monotonic()
            if left < 90:
                result["errors"].append(f"phase {phase} skipped: {left:.0f} s left")
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "child", "--phase", phase, "--server", name,
                   "--runtime-dir", rundir, "--server-pid", str(server.proc.pid), "--model-dir", model_dir,
                   "--results", results, "--lengths", ",".join(map(str, a.lengths)),
                   "--page-size", str(a.page_size), "--device-tokens", str(a.device_tokens),
                   "--hicache-gb", str(a.hicache_gb)] + (["--cuda-graph"] if a.cuda_graph else [])
            with open(os.path.join(a.log_dir, f"sglang-{phase}.log"), "w") as log:
                p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    rc = p.wait(left)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    rc = "timeout"
            if rc != 0:
                result["errors"].append(f"phase {phase}: exit {rc} (see sglang-{phase}.log)")
    finally:
        result["server_stats"] = server.stats()
        server.stop()
        if os.path.exists(results):
            with open(results) as f:
                result["records"] = [json.loads(line) for line in f]
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(report(result))
    return 0 if not result["errors"] else 1


def report(result: dict) -> str:
    """Time to first token by prompt, and the first token against the cold one."""
    recs = result["records"]
    rows = ["prompt   cold     host    kvring  restart  ms; |dlogprob| vs cold: kvring restart control; stored"]
    for n in result["config"]["lengths"]:
        by = {r["step"]: r for r in recs if r.get("len") == n}

        def ms(step):
            r = by.get(step)
            return f"{r['ttft_ms']:8.1f}" if r else "       -"

        def d(step):
            r, c = by.get(step), by.get("cold")
            if not r or not c or r.get("first_logprob") is None or c.get("first_logprob") is None:
                return "     -"
            return f"{abs(r['first_logprob'] - c['first_logprob']):.4f}"

        src = {s: (by.get(s) or {}).get("cached_from") for s in ("host", "kvring", "restart")}
        rows.append(f"{n:6d} {ms('cold')} {ms('host')} {ms('kvring')} {ms('restart')}   "
                    f"{d('kvring')} {d('restart')} {d('control')}   {json.dumps(src)}")
    for r in recs:
        if r["step"].startswith("server_"):
            rows.append(f"{r['step']}: {r['len']} tokens in {r['ttft_ms']:.1f} ms, cached {r['cached_from']}, "
                        f"first logprob {r['first_logprob']}")
    if result["errors"]:
        rows.append("errors: " + "; ".join(result["errors"]))
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "child"):
        s = sub.add_parser(name)
        s.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=[2048, 10000, 30000])
        s.add_argument("--page-size", type=int, default=64)
        s.add_argument("--device-tokens", type=int, default=40960,
                       help="SGLang's GPU pool (max_total_tokens); at most twice the model's context")
        s.add_argument("--hicache-gb", type=float, default=12)
        s.add_argument("--cuda-graph", action="store_true")
    r = sub.choices["run"]
    r.add_argument("--out", required=True)
    r.add_argument("--log-dir", default=".")
    r.add_argument("--pool-bytes", default="24GiB")
    r.add_argument("--copy-threads", type=int, default=8)
    r.add_argument("--phases", default="a,b")
    r.add_argument("--total-s", type=float, default=540)
    c = sub.choices["child"]
    for flag in ("--phase", "--server", "--runtime-dir", "--model-dir", "--results"):
        c.add_argument(flag, required=True)
    c.add_argument("--server-pid", type=int, required=True)
    a = p.parse_args()
    return run(a) if a.cmd == "run" else child(a)


if __name__ == "__main__":
    sys.exit(main())
