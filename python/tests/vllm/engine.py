"""Runs one real vLLM engine (CPU) over prompt sets and writes what happened as
JSON. Run it as its own process with the vLLM environment's Python:

    VENV/bin/python engine.py --model DIR --prompts PROMPTS.json --out RESULT.json
        [--connector NAME --runtime-dir DIR [--timeout-s 10] [--extra K=V ...]]
        [--control-dir DIR --pause-after N ...]
        [--prefix-caching] [--kv-events JSON] [--reset-connector-before N ...]

PROMPTS.json: {"phases": [[{"name": "a0", "token_ids": [...]}, ...], ...]}.
Each phase is one `LLM.generate()` call over its prompts (a batch), in order.

--pause-after N (repeatable) with --control-dir D: once phase N (0-based) has
finished and the result so far is written, the driver creates D/paused-N and
waits for D/resume-N before it starts phase N+1 (up to --pause-timeout
seconds; past that it exits with status 3). A test uses the pause to act on
the kvring server between two phases of one engine, e.g. SIGKILL it.

--kv-events JSON turns vLLM's KV events on (its KVEventsConfig, e.g. a zmq
publisher's endpoint); --prefix-caching turns vLLM's own prefix cache on
(off by default, so that only the connector caches); --reset-connector-before
N calls `LLM.reset_prefix_cache(reset_connector=True)` before phase N.

RESULT.json is rewritten after every phase (so a crash leaves what was done):
per request its prompt token ids, output token ids, num_cached_tokens,
finish_reason, kv_transfer_params and latencies from vLLM's request stats;
per phase the wall time of its generate() call, the vLLM counters that
concern cached tokens and the KV connector (from LLM.get_metrics()), and the
connector's own stats as vLLM aggregated them (KVConnectorStats).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_args(argv):
    ap = argparse.ArgumentParser(description="one vLLM CPU engine run")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file of phases of prompts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--connector", metavar="NAME", help="kvring server name (enables KvringConnector)")
    ap.add_argument("--noop-connector", action="store_true",
                    help="a connector that does nothing (noop_connector.py): vLLM's own cost of one")
    ap.add_argument("--runtime-dir", help="kvring runtime directory")
    ap.add_argument("--timeout-s", type=float, default=10.0, help="kvring.timeout_s")
    ap.add_argument("--extra", action="append", default=[], metavar="KEY=JSON",
                    help="more kv_connector_extra_config entries (value parsed as JSON, else a string)")
    ap.add_argument("--load-failure-policy", choices=["recompute", "fail"],
                    help="KVTransferConfig.kv_load_failure_policy (default: vLLM's)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto", help="dummy: vLLM's random weights (a config-only model)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="tokens a step computes at most (a long prompt's prefill is chunked)")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache on")
    ap.add_argument("--kv-events", metavar="JSON", help="vLLM's KVEventsConfig as JSON (KV events on)")
    ap.add_argument("--reset-connector-before", type=int, action="append", default=[], metavar="N",
                    help="reset vLLM's prefix cache and the connector's before phase N")
    ap.add_argument("--control-dir")
    ap.add_argument("--pause-after", type=int, action="append", default=[])
    ap.add_argument("--pause-timeout", type=float, default=120.0)
    return ap.parse_args(argv)


def _json_value(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


# Counters of LLM.get_metrics() worth keeping: cached-token accounting and
# anything a KV connector registers.
_METRIC_KEYS = ("prefix_cache", "prompt_tokens", "external", "kv_connector", "kvring",
                "kv_transfer", "preemption", "request_success", "corrupted")


def _metrics(llm) -> dict:
    out: dict = {}
    try:
        snapshot = llm.get_metrics()
    except Exception as e:  # stats disabled or unavailable: say so
        return {"error": repr(e)}
    for m in snapshot:
        if not any(k in m.name for k in _METRIC_KEYS):
            continue
        labels = {k: v for k, v in m.labels.items() if k not in ("model_name", "engine")}
        key = m.name + ("" if not labels else json.dumps(labels, sort_keys=True))
        if hasattr(m, "value"):
            out[key] = m.value
        elif hasattr(m, "count"):
            out[key] = {"count": m.count, "sum": m.sum}
        elif hasattr(m, "values"):
            out[key] = list(m.values)
    return out


def _connector_stats(llm):
    """What the connector reported through vLLM's KV-connector stats since the
    last call (its `build_kv_connector_stats` class, summed), read from the
    logging stat logger's accumulator and reset there. None when vLLM keeps
    no such accumulator (no connector, stats off, another vLLM layout)."""
    lm = getattr(llm.llm_engine, "logger_manager", None)
    found, out = False, {}
    for top in getattr(lm, "stat_loggers", None) or []:
        for sl in [top, *getattr(top, "per_engine_stat_loggers", {}).values()]:
            kl = getattr(sl, "kv_connector_logging", None)
            if kl is None or not hasattr(kl, "transfer_stats_accumulator"):
                continue
            found = True
            acc = kl.transfer_stats_accumulator
            if acc is not None and not acc.is_empty():
                for k, v in acc.reduce().items():
                    out[k] = out.get(k, 0) + v if isinstance(v, (int, float)) else v
            kl.reset()
    return out if found else None


def _request_record(o, phase: int, name: str) -> dict:
    c = o.outputs[0]
    rec = {
        "name": name,
        "phase": phase,
        "request_id": o.request_id,
        "prompt_token_ids": list(o.prompt_token_ids or []),
        "output_token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "num_cached_tokens": o.num_cached_tokens,
        "kv_transfer_params": o.kv_transfer_params,
        "finished": o.finished,
    }
    s = o.metrics
    if s is not None:
        # queued/scheduled/first/last are the engine core's monotonic clock
        # (one clock for all processes of this machine).
        q, sch, first, last = (getattr(s, k, 0.0) for k in
                               ("queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts"))
        rec["latency_s"] = round(last - q, 4) if last and q else None
        rec["queue_s"] = round(sch - q, 4) if sch and q else None
        rec["first_token_s"] = round(first - q, 4) if first and q else None
        rec["num_preemptions"] = getattr(s, "num_preemptions", None)
    return rec


def _wait_resume(control_dir: str, phase: int, timeout: float) -> float:
    open(os.path.join(control_dir, f"paused-{phase}"), "w").close()
    go = os.path.join(control_dir, f"resume-{phase}")
    t0 = time.monotonic()
    while not os.path.exists(go):
        if time.monotonic() - t0 > timeout:
            print(f"engine.py: no {go} within {timeout}s, giving up", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.05)
    return time.monotonic() - t0


def main(argv=None) -> int:
    args = _parse_args(argv if argv is not None else sys.argv[1:])
    if args.pause_after and not args.control_dir:
        print("--pause-after needs --control-dir", file=sys.stderr)
        return 2
    # Must be set before vllm is imported; the engine core and the worker are
    # spawned children and inherit them.
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # keep vLLM's ZMQ/gloo on loopback
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache

    with open(args.prompts) as f:
        phases = json.load(f)["phases"]

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    result: dict = {
        "pid": os.getpid(),
        "vllm_version": vllm.__version__,
        "model": args.model,
        "connector": args.connector,
        "import_s": round(time.perf_counter() - t0, 2),
        "phases": [],
        "requests": [],
        "complete": False,
    }

    kw = {}
    if args.noop_connector:
        from vllm.config import KVTransferConfig

        # Spawned engine processes import the module by name.
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NoopConnector", kv_connector_module_path="noop_connector", kv_role="kv_both")
    elif args.connector:
        from vllm.config import KVTransferConfig

        extra = {
            "kvring.name": args.connector,
            "kvring.autostart": False,
            "kvring.timeout_s": args.timeout_s,
        }
        if args.runtime_dir:
            extra["kvring.runtime_dir"] = args.runtime_dir
        for item in args.extra:
            k, _, v = item.partition("=")
            extra[k] = _json_value(v)
        ktc = {
            "kv_connector": "KvringConnector",
            "kv_connector_module_path": "kvring.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if args.load_failure_policy:
            ktc["kv_load_failure_policy"] = args.load_failure_policy
        result["kv_transfer_config"] = ktc
        kw["kv_transfer_config"] = KVTransferConfig(**ktc)

    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events))
    t1 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        # Off unless asked, so that only the connector can produce cached tokens.
        enable_prefix_caching=args.prefix_caching,
        seed=0,
        # On, for RequestOutput.metrics and LLM.get_metrics().
        disable_log_stats=False,
        **kw,
    )
    result["llm_init_s"] = round(time.perf_counter() - t1, 2)
    result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    result["metrics_at_start"] = _metrics(llm)
    _write_json(args.out, result)

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, phase in enumerate(phases):
        if i in args.reset_connector_before:
            result.setdefault("resets", []).append(
                {"before_phase": i, "ok": llm.reset_prefix_cache(reset_connector=True)})
        inputs = [{"prompt_token_ids": list(p["token_ids"])} for p in phase]
        w0, t2 = time.time(), time.perf_counter()
        outs = llm.generate(inputs, sp, use_tqdm=False)
        wall = time.perf_counter() - t2
        recs = [_request_record(o, i, p["name"]) for o, p in zip(outs, phase, strict=True)]
        result["requests"].extend(recs)
        result["phases"].append({
            "index": i,
            "names": [p["name"] for p in phase],
            "start_unix": w0,
            "wall_s": round(wall, 4),
            "metrics": _metrics(llm),
            "connector_stats": _connector_stats(llm),
        })
        _write_json(args.out, result)
        print(f"engine.py: phase {i}: {len(phase)} requests in {wall:.3f}s, cached "
              f"{[r['num_cached_tokens'] for r in recs]}", file=sys.stderr, flush=True)
        if i in args.pause_after and i + 1 < len(phases):
            result["phases"][-1]["paused_s"] = round(
                _wait_resume(args.control_dir, i, args.pause_timeout), 3)

    t3 = time.perf_counter()
    del llm  # shuts the engine core and worker down
    import gc

    gc.collect()
    result["shutdown_s"] = round(time.perf_counter() - t3, 2)
    result["complete"] = True
    _write_json(args.out, result)
    return 0


# vLLM on CPU spawns its engine core and worker: guard the entry point.
if __name__ == "__main__":
    sys.exit(main())
