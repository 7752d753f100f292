"""A real model's KV round trip on the GPU (skipped without one): the
10,000-token case of `bench/bench_ttft.py`, whose assertions are the test
(retrieved KV gives the baseline's logits bit for bit, other KV changes
them, a server SIGKILLed during a retrieve neither holds the engine's stream
nor changes the recomputed logits)."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_ttft.py")


def test_a_llama_3_8b_shaped_models_kv_round_trips_through_kvring(tmp_path):
    out = tmp_path / "ttft.json"
    r = subprocess.run(
        [sys.executable, BENCH, "--tokens", "10000", "--repeats", "1", "--pool", "4GiB",
         "--json", str(out)],
        timeout=600, capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    res = json.loads(out.read_text())
    assert res["ttft"]["10000"]["logits_identical"]
    assert res["other_kv_max_abs_diff"] > 0
    assert res["server_killed"]["load_reported_failed"]
    assert res["server_killed"]["recomputed_logits_identical"]
