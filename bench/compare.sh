#!/usr/bin/env bash
# Measures two revisions side by side.
#
#   bench/compare.sh [OLD [NEW]]        (default: HEAD~1 HEAD)
#
# Each revision is checked out in its own git worktree (target/compare/old and
# target/compare/new) and built there with `cargo build --release --workspace
# --bins`; its binaries are taken from that worktree's target/release. Then
# `kvring-bench ring`, `jobs` and `kv` run with short settings, several rounds,
# old and new alternating (old first in odd rounds, new first in even ones),
# and the script prints, per metric, the median of each side, the range of
# each side, and new/old. The JSON line of every run is kept under
# target/compare/run-<time>/, with each run's stderr.
#
# kvring-bench starts its kvring servers by re-executing itself (the hidden
# `serve-child` subcommand), so it needs no other binary; the side's
# target/release is still put first on PATH, so that a revision whose bench
# looks a `kvring` binary up by name gets its own.
#
# Environment:
#   ROUNDS      rounds per benchmark and side (default 5)
#   BENCHES     which subcommands (default "ring jobs kv")
#   RING_ARGS   default "--iters 50000 --pipelined 1000000 --rounds 3"
#   JOBS_ARGS   default "--iters 50000"
#   KV_ARGS     default "--passes 3 --lookups 5000"
#               (flag-value pairs; a flag a revision's subcommand does not
#               list in its --help is left out for that revision)
#   SEED        1 (default): a worktree without a target/ starts from a copy
#               of this checkout's target/release, so dependencies are not
#               rebuilt; 0: build from nothing
#   COMPARE_DIR default <repository>/target/compare
#
# With the defaults a comparison runs in about 6 minutes on a 2-core machine,
# after the builds. The worktrees stay for the next comparison (which then
# builds incrementally); `git worktree remove --force target/compare/old`
# (and .../new) removes them.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
old_rev=${1:-HEAD~1}
new_rev=${2:-HEAD}
rounds=${ROUNDS:-5}
benches=${BENCHES:-ring jobs kv}
ring_args=${RING_ARGS:---iters 50000 --pipelined 1000000 --rounds 3}
jobs_args=${JOBS_ARGS:---iters 50000}
kv_args=${KV_ARGS:---passes 3 --lookups 5000}
dir=${COMPARE_DIR:-$root/target/compare}

old_sha=$(git -C "$root" rev-parse --verify "$old_rev^{commit}")
new_sha=$(git -C "$root" rev-parse --verify "$new_rev^{commit}")
mkdir -p "$dir"

say() { printf '%s\n' "$*" >&2; }

# prepare SIDE SHA: check SHA out in $dir/SIDE and build it there.
prepare() {
    local side=$1 sha=$2 wt=$dir/$1
    if [ -e "$wt/.git" ]; then
        git -C "$wt" checkout -q --detach "$sha"
    else
        # -f: also when an earlier worktree there was deleted but is still
        # registered.
        git -C "$root" worktree add -q -f --detach "$wt" "$sha"
    fi
    if [ "${SEED:-1}" = 1 ] && [ ! -d "$wt/target/release" ] && [ -d "$root/target/release" ]; then
        say "$side: seeding $wt/target/release from $root/target/release"
        mkdir -p "$wt/target"
        tar -C "$root/target" --exclude=release/incremental -cf - release | tar -C "$wt/target" -xf -
    fi
    say "$side: building $(git -C "$wt" log -1 --format='%h %s' | cut -c1-72)"
    (cd "$wt" && cargo build --release --workspace --bins)
    if [ ! -x "$wt/target/release/kvring-bench" ]; then
        say "$side: no kvring-bench under $wt/target/release"
        exit 1
    fi
    say "$side: binaries: $(cd "$wt/target/release" && find . -maxdepth 1 -type f -perm -u+x -printf '%f ')"
}

prepare old "$old_sha"
prepare new "$new_sha"

# args_for SIDE BIN SUB "FLAG VALUE ...": the pairs whose flag SUB's --help
# lists, one word a line.
args_for() {
    local side=$1 bin=$2 sub=$3 help
    help=$("$bin" "$sub" --help 2>/dev/null || true)
    # shellcheck disable=SC2086 # flag-value pairs, split on blanks
    set -- $4
    while [ $# -ge 2 ]; do
        if grep -q -- "$1\b" <<<"$help"; then
            printf '%s\n%s\n' "$1" "$2"
        else
            say "  ($side: $sub has no $1; left out)"
        fi
        shift 2
    done
}

run_dir=$dir/run-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$run_dir"
cat >"$run_dir/revisions.txt" <<EOF
old $old_rev $old_sha
new $new_rev $new_sha
EOF
say "results: $run_dir"

# run_one SIDE BENCH ROUND
run_one() {
    local side=$1 bench=$2 round=$3 wt=$dir/$1 spec
    local bin=$wt/target/release/kvring-bench
    case $bench in
    ring) spec=$ring_args ;;
    jobs) spec=$jobs_args ;;
    kv) spec=$kv_args ;;
    *)
        say "unknown benchmark $bench"
        exit 2
        ;;
    esac
    local args
    mapfile -t args < <(args_for "$side" "$bin" "$bench" "$spec")
    local log=$run_dir/$side-$bench-$round
    local t0=$SECONDS
    if ! PATH=$wt/target/release:$PATH timeout 600 "$bin" "$bench" --json "${args[@]}" >"$log.out" 2>"$log.err"; then
        say "  $side $bench round $round failed; see $log.err"
        return
    fi
    tail -n 1 "$log.out" >>"$run_dir/$side-$bench.jsonl"
    say "  $side $bench round $round: $((SECONDS - t0)) s"
}

for round in $(seq 1 "$rounds"); do
    if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
    say "round $round/$rounds ($order)"
    for bench in $benches; do
        for side in $order; do
            run_one "$side" "$bench" "$round"
        done
    done
done

python3 - "$run_dir" $benches <<'EOF'
import json, os, statistics, sys

run_dir, benches = sys.argv[1], sys.argv[2:]
# Leaves that are settings, counts or ranges, not figures.
SKIP_KEYS = {"samples", "min", "max", "rounds", "kept", "taken", "tolerance",
             "iterations", "passes", "payload_bytes", "chunks", "chunks_per_job",
             "copy_threads", "client", "server", "max_other_cpu_share"}
SKIP_PARTS = {"geometry", "block_round_trips", "pinned_cpus", "build", "transports"}

def leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if path and path[-1] not in SKIP_KEYS and not SKIP_PARTS & set(path):
            yield ".".join(path), float(obj)

def load(side, bench):
    runs = []
    p = os.path.join(run_dir, f"{side}-{bench}.jsonl")
    if os.path.exists(p):
        for line in open(p):
            try:
                runs.append(dict(leaves(json.loads(line))))
            except json.JSONDecodeError:
                pass
    return runs

def fmt(x):
    if x != x:
        return "-"
    a = abs(x)
    return f"{x:.0f}" if a >= 100 else f"{x:.3g}"

summary = {}
print(f"{'metric':<52} {'old median (min-max)':>26} {'new median (min-max)':>26} {'new/old':>8}")
for bench in benches:
    old, new = load("old", bench), load("new", bench)
    print(f"== {bench}: {len(old)} old runs, {len(new)} new runs")
    names = [k for k in (old[0] if old else {}) if any(k in r for r in new)]
    for name in names:
        o = [r[name] for r in old if name in r]
        n = [r[name] for r in new if name in r]
        mo, mn = statistics.median(o), statistics.median(n)
        ratio = mn / mo if mo else float("nan")
        summary[f"{bench}.{name}"] = {"old": o, "new": n, "old_median": mo,
                                     "new_median": mn, "new_over_old": ratio}
        cell = lambda v, m: f"{fmt(m)} ({fmt(min(v))}-{fmt(max(v))})"
        print(f"{bench + '.' + name:<52} {cell(o, mo):>26} {cell(n, mn):>26} {ratio:>8.3f}")
    only = sorted(set().union(*old, *new) - set(names)) if old or new else []
    if only:
        summary[f"{bench}.one_side_only"] = only
        shown = ", ".join(only[:6]) + (", ..." if len(only) > 6 else "")
        print(f"   ({len(only)} metrics on one side only, listed in summary.json: {shown})")
with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(f"per-run JSON lines and summary.json: {run_dir}")
EOF
