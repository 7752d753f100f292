#!/usr/bin/env bash
# CI entry point of the vLLM end-to-end tests:
#   python/tests/vllm/run.sh path/to/kvring-*.whl [extra pytest args]
# Makes (or reuses) the vLLM CPU environment, installs the given kvring wheel
# into it, and runs the tests in this directory with that environment's
# Python. About 15 minutes on a 2-core machine once the environment exists.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
wheel="${1:?usage: run.sh KVRING_WHEEL [pytest args...]}"
shift
[ -f "$wheel" ] || { echo "run.sh: no such wheel: $wheel" >&2; exit 2; }

venv="$("$here/ensure_env.sh")"
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"
"$venv/bin/python" -c "import kvring, kvring.vllm; print('kvring', kvring.__version__, 'in', '$venv')"

# Scratch (pytest's tmp dirs, the cached tiny models) under /tmp.
export TMPDIR="${TMPDIR:-/tmp}"
cd "$here"
# Whole run under a watchdog, on top of each test's own process deadlines.
exec timeout --kill-after=30 "${KVRING_VLLM_TESTS_TIMEOUT_S:-1500}" \
    "$venv/bin/python" -m pytest "$here" --rootdir "$here" --confcutdir "$here" \
    -v -p no:cacheprovider -rfEs "$@"
