"""`python -m kvring ...` and the `kvring` / `kvring-inspect` scripts: the
`kvring` binary this package carries (`kvring/bin/kvring`, the same build
as the Rust one: jemalloc, the CUDA backend), run in place of this
interpreter, so there is one server however it is started and a signal
sent to this process reaches it."""

import os
import sys
from pathlib import Path

BINARY = Path(__file__).resolve().parent / "bin" / "kvring"


def _exec(argv: list[str]) -> None:
    if not os.access(BINARY, os.X_OK):
        sys.stderr.write(
            f"kvring: {BINARY} is missing or not executable: this kvring package was "
            "built without its server binary (python/build-wheel.sh builds a wheel with it)\n"
        )
        sys.exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(BINARY, argv)


def main() -> None:
    """`kvring ...` (serve, ping, demo, inspect, ...)."""
    _exec(["kvring", *sys.argv[1:]])


def inspect() -> None:
    """`kvring-inspect ...` (the same as `kvring inspect ...`)."""
    _exec(["kvring-inspect", "inspect", *sys.argv[1:]])


if __name__ == "__main__":
    main()
