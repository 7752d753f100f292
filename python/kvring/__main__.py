"""`python -m kvring ...` and the `kvring` / `kvring-inspect` scripts: the
same command lines as the Rust binaries, run from the native module."""

import sys

from . import _native


def main() -> None:
    """`kvring ...` (serve, ping, demo, inspect, ...)."""
    sys.exit(_native.main(["kvring", *sys.argv[1:]]))


def inspect() -> None:
    """`kvring-inspect ...`."""
    sys.exit(_native.inspect_main(["kvring-inspect", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
