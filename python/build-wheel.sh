#!/usr/bin/env bash
# Builds the kvring wheel: the `kvring` binary (release, jemalloc, the CUDA
# backend; stripped) copied into the package as kvring/bin/kvring, then the
# abi3 wheel with maturin, which carries it beside the native module.
#
#   python/build-wheel.sh MATURIN OUTDIR   # prints the wheel's path
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 MATURIN OUTDIR" >&2
    exit 2
fi
maturin="$1"
out="$2"
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."

cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p kvring-cli --bin kvring
target="$(cargo metadata --format-version 1 --no-deps --manifest-path "$root/Cargo.toml" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
mkdir -p "$here/kvring/bin"
strip -o "$here/kvring/bin/kvring" "$target/release/kvring"

mkdir -p "$out"
out="$(cd "$out" && pwd)"   # maturin runs from python/; keep OUTDIR the caller's
rm -f "$out"/kvring-*.whl
(cd "$here" && "$maturin" build --release --quiet -o "$out" >&2)
ls "$out"/kvring-*.whl
