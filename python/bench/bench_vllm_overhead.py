"""The vLLM connector's cost when nothing hits: a real vLLM engine (CPU, the
tiny test model) generating for prompts it has never seen, without a
connector, with a connector that does nothing (`tests/vllm/noop_connector.py`:
what vLLM itself spends on having one) and with kvring's, in one run.
Engines alternate (baseline, no-op, kvring, baseline, ...), each running a
warm-up phase and then `--phases` phases of `--prompts` fresh prompts; a
phase's wall time covers its prefills, decode steps and, with kvring, every
lookup (all misses) and every store of the prompts' full chunks. Reported:
per side the median phase throughput (generated tokens/s), and kvring over
the baseline and over the no-op connector.

    VENV/bin/python bench/bench_vllm_overhead.py [--rounds 3] [--json]

VENV is the vLLM environment of tests/vllm/ensure_env.sh, with the kvring
wheel installed. A benchmark: nothing is asserted.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_TESTS = os.path.join(HERE, "..", "tests", "vllm")


def run_engine(model, prompts_file, out, server=None, noop=False):
    cmd = [sys.executable, os.path.join(VLLM_TESTS, "engine.py"), "--model", model,
           "--prompts", prompts_file, "--out", out, "--max-tokens", str(ARGS.max_tokens)]
    if server:
        cmd += ["--connector", server[0], "--runtime-dir", server[1]]
    if noop:
        cmd += ["--noop-connector"]
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run(cmd, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def phases_file(seed, d):
    rng = random.Random(seed)
    phases = [[{"name": f"p{i}-{j}", "token_ids": [rng.randrange(3, 1024)
                                                   for _ in range(ARGS.prompt_tokens)]}
               for j in range(ARGS.prompts)] for i in range(ARGS.phases + 1)]
    path = os.path.join(d, f"prompts-{seed}.json")
    with open(path, "w") as f:
        json.dump({"phases": phases}, f)
    return path


def throughputs(result):
    out = []
    for ph in result["phases"][1:]:  # phase 0 warms up
        tokens = sum(len(r["output_token_ids"]) for r in result["requests"]
                     if r["phase"] == ph["index"])
        out.append(tokens / ph["wall_s"])
    return out


def main():
    d = tempfile.mkdtemp(prefix="kvring-bench-vllm-")
    model = os.path.join(tempfile.gettempdir(), "kvring-vllm-tests", "models", "tiny-seed0")
    subprocess.run([sys.executable, os.path.join(VLLM_TESTS, "make_tiny_model.py"), model],
                   check=True, stdout=subprocess.DEVNULL)
    base, noop, kv, hits = [], [], [], 0
    for r in range(ARGS.rounds):
        res = run_engine(model, phases_file(1000 + 3 * r, d), os.path.join(d, f"base-{r}.json"))
        base += throughputs(res)
        res = run_engine(model, phases_file(1002 + 3 * r, d), os.path.join(d, f"noop-{r}.json"),
                         noop=True)
        noop += throughputs(res)
        name = f"bench-vllm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        rd = tempfile.mkdtemp(prefix="kvring-bench-rt-")
        os.chmod(rd, 0o700)
        srv = subprocess.Popen([sys.executable, "-m", "kvring", "serve", "--name", name,
                                "--runtime-dir", rd, "--backend", "host", "--pool-bytes",
                                "1GiB", *ARGS.server_arg], stdout=subprocess.DEVNULL)
        try:
            res = run_engine(model, phases_file(1001 + 3 * r, d),
                             os.path.join(d, f"kvring-{r}.json"), (name, rd))
            kv += throughputs(res)
            hits += sum(r2["num_cached_tokens"] or 0 for r2 in res["requests"])
        finally:
            srv.terminate()
            srv.wait(30)
        print(f"round {r}: baseline {statistics.median(base):.1f} tok/s, no-op connector "
              f"{statistics.median(noop):.1f}, kvring {statistics.median(kv):.1f}", file=sys.stderr)
    out = {
        "bench": "vllm_connector_overhead",
        "prompts_per_phase": ARGS.prompts, "prompt_tokens": ARGS.prompt_tokens,
        "max_tokens": ARGS.max_tokens, "phases": len(base), "server_args": ARGS.server_arg,
        "baseline_tok_s": {"median": statistics.median(base), "min": min(base), "max": max(base)},
        "noop_connector_tok_s": {"median": statistics.median(noop), "min": min(noop),
                                 "max": max(noop)},
        "kvring_tok_s": {"median": statistics.median(kv), "min": min(kv), "max": max(kv)},
        "kvring_over_baseline": statistics.median(kv) / statistics.median(base),
        "kvring_over_noop_connector": statistics.median(kv) / statistics.median(noop),
        "noop_connector_over_baseline": statistics.median(noop) / statistics.median(base),
        "cached_tokens_with_kvring": hits,
    }
    print(json.dumps(out) if ARGS.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phases", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an argument for the kvring server (repeat), e.g. --server-arg=--spin-us=0")
    ap.add_argument("--json", action="store_true")
    ARGS = ap.parse_args()
    main()
