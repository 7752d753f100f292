"""Fixtures of the Python API tests: a real kvring server (the package's own
`python -m kvring serve`, host backend) under a unique name and runtime
directory, stopped at the end of each test."""

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

import kvring


class Server:
    """A `kvring serve` child process."""

    def __init__(self, *args: str, backend: str = "host", restart_of: "Server | None" = None) -> None:
        """A new server; `restart_of`: under the name and in the runtime
        directory of that one (stopped), as a restart is."""
        if restart_of is None:
            self.name = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.dir = tempfile.mkdtemp(prefix="kvring-pytest-")
            os.chmod(self.dir, 0o700)
        else:
            self.name, self.dir = restart_of.name, restart_of.dir
        self.log = open(os.path.join(self.dir, "server.log"), "a+")
        # A server whose runtime directory a restart reuses leaves it.
        self.keep_dir = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvring", "serve", "--name", self.name,
             "--runtime-dir", self.dir, "--backend", backend, *args],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    kvring.Client(self.name, runtime_dir=self.dir, connect_timeout=0.2).close()
                    return
                except kvring.NoServer:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"server did not start: {self.output()}") from None
        except BaseException:
            self.stop()
            raise

    def client(self, **kw) -> kvring.Client:
        return kvring.Client(self.name, runtime_dir=self.dir, **kw)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        if not self.keep_dir:
            subprocess.run(["rm", "-rf", self.dir], check=False)


#: 64-token chunks, a 64 MiB pool, one copy thread: what the API tests use.
SERVER_ARGS = ("--chunk-tokens", "64", "--pool-bytes", "64MiB", "--copy-threads", "1")


@pytest.fixture
def server():
    s = Server(*SERVER_ARGS)
    yield s
    s.stop()
