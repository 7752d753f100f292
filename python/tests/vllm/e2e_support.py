"""Helpers and fixtures for the end-to-end tests of kvring's vLLM connector
(conftest.py registers the fixtures and hooks; the tests import helpers from
here, a module name no other conftest.py can shadow).

These tests run only inside the vLLM environment that ensure_env.sh makes
(run.sh does everything). Every process they start is in its own process
group, is waited for with a deadline, and is killed (the whole group) at the
latest when the test session ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "engine.py")
MAKE_MODEL = os.path.join(HERE, "make_tiny_model.py")
PY = sys.executable

# Where the tiny models are cached between runs (scratch: under /tmp).
CACHE_DIR = os.environ.get("KVRING_VLLM_TEST_CACHE", "/tmp/kvring-vllm-tests")
# One engine process takes 35-60 s on the 2-core CI machine, twice that when
# two run at once; past this it is considered hung.
ENGINE_TIMEOUT_S = float(os.environ.get("KVRING_VLLM_ENGINE_TIMEOUT_S", "300"))
SERVER_START_TIMEOUT_S = 30.0
CMD_TIMEOUT_S = 60.0

NO_VLLM_REASON = (
    "vLLM is not importable by this Python ({}): these tests run inside the "
    "vLLM CPU environment; use python/tests/vllm/run.sh WHEEL (or "
    "`$(python/tests/vllm/ensure_env.sh)/bin/python -m pytest python/tests/vllm`)"
).format(PY)


def require_vllm():
    """Skips the calling test module when vLLM is not installed here. (This
    directory is itself named vllm: with its parent on sys.path it would
    import as an empty namespace package, so a real package is required.)"""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin in (None, "namespace"):
        pytest.skip(NO_VLLM_REASON, allow_module_level=True)
    return pytest.importorskip("vllm", reason=NO_VLLM_REASON)


def require_kvring_vllm():
    """kvring's connector must be importable in the vLLM environment: a
    missing or broken install is a failure, not a skip (run.sh installs the
    wheel; a skip would hide that it did not)."""
    error = None
    try:
        import kvring.vllm  # noqa: F401
    except Exception as e:  # reported as the failure, outside this handler
        error = e
    if error is not None:
        pytest.fail(f"`import kvring.vllm` fails in the vLLM environment ({PY}): {error!r}; "
                    "install the kvring wheel there (run.sh does)", pytrace=False)
    return sys.modules["kvring.vllm"]


def tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"<{path}: {e}>"


def expected_cached(tokens, stored_prompts, chunk: int = 256) -> int:
    """Tokens a connector can load: the leading full chunks found in the
    server, leaving at least one prompt token to compute."""
    best = 0
    for p in stored_prompts:
        n = 0
        for x, y in zip(tokens, p, strict=False):
            if x != y:
                break
            n += 1
        best = max(best, n // chunk * chunk)
    return min(best, (len(tokens) - 1) // chunk * chunk)


def grep(path: str, *needles: str, limit: int = 40) -> list[str]:
    """Lines of a log holding any of `needles` (for evidence in messages)."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if any(n in line for n in needles):
                    out.append(line.rstrip()[:400])
                    if len(out) >= limit:
                        break
    except OSError:
        pass
    return out


def by_name(result, phase) -> dict:
    """An engine run's requests of one phase, by prompt name."""
    return {r["name"]: r for r in result["requests"] if r["phase"] == phase}


def connector_stats(result) -> dict:
    """The connector's counters of an engine run, summed over its phases."""
    total: dict = {}
    for p in result["phases"]:
        for k, v in (p.get("connector_stats") or {}).items():
            total[k] = total.get(k, 0) + v
    return total


def evidence(result) -> str:
    """The connector's lines (and errors) of an engine run's log."""
    return "\n".join(grep(result["log"], "kvring", "Kvring", "Traceback", "Error", "hybrid")[-25:])


def pytest_configure(config):
    # A CI watchdog stops pytest with SIGTERM: turn it into KeyboardInterrupt
    # so that the session's teardown still kills every process group started.
    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)


def group_members(pgid: int) -> list[str]:
    """`pid cmdline` of every live process in process group `pgid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            # fields after the parenthesised command: state ppid pgrp ...
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out.append(f"{d} {cmd[:200]}")
        except (OSError, ValueError, IndexError):
            continue
    return out


class Procs:
    """Every process group a test started, killed at the end of the session."""

    def __init__(self):
        self.live: list[subprocess.Popen] = []

    def popen(self, argv, log_path, env=None) -> subprocess.Popen:
        log = open(log_path, "ab")
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        finally:
            log.close()
        self.live.append(p)
        return p

    @staticmethod
    def kill_group(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> None:
        for p in self.live:
            if p.poll() is None:
                self.kill_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The group may outlive its leader (vLLM's engine core, worker).
            self.kill_group(p, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.live.clear()


@pytest.fixture(scope="session")
def procs():
    ps = Procs()
    yield ps
    ps.reap()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------- models


@pytest.fixture(scope="session")
def tiny_models():
    """Two tiny Llamas with the same config and tokenizer, weights of seeds 0
    and 1, cached under CACHE_DIR (made in parallel, ~8 s each)."""
    require_vllm()
    dirs = {seed: os.path.join(CACHE_DIR, "models", f"tiny-llama-s{seed}") for seed in (0, 1)}
    os.makedirs(os.path.join(CACHE_DIR, "models"), exist_ok=True)

    def make(seed):
        r = subprocess.run([PY, MAKE_MODEL, dirs[seed], "--seed", str(seed)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"make_tiny_model.py seed {seed} failed:\n{r.stdout}\n{r.stderr}")

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(make, dirs))
    return dirs


# ---------------------------------------------------------------- engines


TIMINGS: list = []  # (tag, result) of every engine run that finished


def pytest_terminal_summary(terminalreporter):
    if not TIMINGS:
        return
    tr = terminalreporter
    tr.section("vLLM engine runs (seconds)")
    tr.write_line(f"{'run':10s} {'process':>8s} {'import':>7s} {'LLM()':>7s} {'exit':>6s}  phases")
    for tag, r in TIMINGS:
        phases = " ".join(f"{p['wall_s']:.2f}" for p in r.get("phases", []))
        tr.write_line(f"{tag:10s} {r.get('process_wall_s', 0):8.1f} {r.get('import_s', 0):7.1f} "
                      f"{r.get('llm_init_s', 0):7.1f} {r.get('shutdown_s', 0):6.1f}  {phases}")


class EngineFailed(AssertionError):
    pass


class EngineRun:
    """One engine.py process; `result()` waits for it and reads its JSON."""

    def __init__(self, procs: Procs, tag: str, workdir: str, model: str, phases,
                 connector=None, runtime_dir=None, pause_after=(), extra_args=()):
        self.tag = tag
        self.dir = os.path.join(workdir, tag)
        os.makedirs(self.dir, exist_ok=True)
        self.out = os.path.join(self.dir, "result.json")
        self.log = os.path.join(self.dir, "engine.log")
        self.control = os.path.join(self.dir, "control")
        os.makedirs(self.control, exist_ok=True)
        prompts = os.path.join(self.dir, "prompts.json")
        with open(prompts, "w") as f:
            json.dump({"phases": phases}, f)
        argv = [PY, ENGINE, "--model", model, "--prompts", prompts, "--out", self.out]
        if connector:
            argv += ["--connector", connector]
        if runtime_dir:
            argv += ["--runtime-dir", runtime_dir]
        if pause_after:
            argv += ["--control-dir", self.control]
            for i in pause_after:
                argv += ["--pause-after", str(i)]
        argv += list(extra_args)
        self.argv = argv
        self.t0 = time.monotonic()
        self.deadline = self.t0 + ENGINE_TIMEOUT_S
        self.proc = procs.popen(argv, self.log)
        self._result = None

    def _fail(self, why: str):
        raise EngineFailed(f"engine run '{self.tag}' {why}\ncommand: {' '.join(self.argv)}\n"
                           f"--- last lines of {self.log}:\n{tail(self.log)}")

    def partial(self) -> dict:
        try:
            with open(self.out) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def wait_paused(self, phase: int) -> dict:
        flag = os.path.join(self.control, f"paused-{phase}")
        while not os.path.exists(flag):
            if self.proc.poll() is not None:
                self._fail(f"exited with status {self.proc.returncode} before pausing after phase {phase}")
            if time.monotonic() > self.deadline:
                Procs.kill_group(self.proc)
                self._fail(f"did not reach the pause after phase {phase} within {ENGINE_TIMEOUT_S}s")
            time.sleep(0.1)
        return self.partial()

    def resume(self, phase: int) -> None:
        open(os.path.join(self.control, f"resume-{phase}"), "w").close()

    def result(self) -> dict:
        if self._result is not None:
            return self._result
        try:
            self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            Procs.kill_group(self.proc)
            self.proc.wait(10)
            self._fail(f"did not finish within {ENGINE_TIMEOUT_S}s (killed)")
        wall = round(time.monotonic() - self.t0, 1)
        # What of its process group outlives it by more than a grace period
        # (multiprocessing's resource tracker takes a moment to notice).
        grace = time.monotonic() + 10
        while (leftovers := group_members(self.proc.pid)) and time.monotonic() < grace:
            time.sleep(0.2)
        Procs.kill_group(self.proc)  # leftovers of its group, if any
        r = self.partial()
        r["leftover_processes"] = leftovers
        if self.proc.returncode != 0 or not r.get("complete"):
            self._fail(f"exited with status {self.proc.returncode}, result complete={r.get('complete')}")
        r["process_wall_s"] = wall
        r["log"] = self.log
        with open(self.out, "w") as f:  # with what only the test knows, for post mortems
            json.dump(r, f, indent=1)
        self._result = r
        TIMINGS.append((self.tag, r))
        return r


@pytest.fixture(scope="session")
def engine_factory(procs, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("engines"))

    def start(tag, model, phases, **kw) -> EngineRun:
        return EngineRun(procs, tag, work, model, phases, **kw)

    return start


# ---------------------------------------------------------------- kvring server


class KvringServer:
    """A real `python -m kvring serve` (or $KVRING_BIN serve) process."""

    def __init__(self, procs: Procs, base_dir: str, pool_bytes="256MiB", chunk_tokens=256, extra_args=()):
        self.name = unique("kvt")
        self.runtime_dir = os.path.join(base_dir, self.name)
        os.makedirs(self.runtime_dir, mode=0o700)
        os.chmod(self.runtime_dir, 0o700)  # the server refuses anything else
        self.log = os.path.join(base_dir, self.name + ".log")
        self.chunk_tokens = chunk_tokens
        binary = os.environ.get("KVRING_BIN")
        cmd = [binary] if binary else [PY, "-m", "kvring"]
        self.argv = cmd + ["serve", "--name", self.name, "--runtime-dir", self.runtime_dir,
                           "--pool-bytes", str(pool_bytes), "--chunk-tokens", str(chunk_tokens),
                           "--backend", "host", *extra_args]
        self._procs = procs
        self.proc = procs.popen(self.argv, self.log)
        self._wait_ready()

    def restart(self) -> None:
        """Stops the server (SIGTERM) and starts a new one of the same name,
        empty, returning once it answers."""
        self.stop()
        self.proc = self._procs.popen(self.argv, self.log)
        self._wait_ready()

    def _wait_ready(self):
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvring server exited with {self.proc.returncode} at start:\n"
                                     f"{tail(self.log)}")
            try:
                with self.client() as c:
                    c.stats()
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.1)
        raise AssertionError(f"kvring server {self.name} not answering after "
                             f"{SERVER_START_TIMEOUT_S}s ({last!r}):\n{tail(self.log)}")

    def client(self):
        import kvring

        return kvring.Client(self.name, runtime_dir=self.runtime_dir,
                             connect_timeout=5.0, call_timeout=10.0)

    def stats(self) -> dict:
        with self.client() as c:
            return dict(c.stats())

    def clear(self) -> dict:
        with self.client() as c:
            return dict(c.clear())

    def inspect(self) -> dict:
        """`python -m kvring inspect show NAME --json` (works on a dead
        server's segment too: a post-mortem view)."""
        binary = os.environ.get("KVRING_INSPECT_BIN")
        cmd = [binary] if binary else [PY, "-m", "kvring", "inspect"]
        env = dict(os.environ, KVRING_RUNTIME_DIR=self.runtime_dir)
        r = subprocess.run(cmd + ["show", self.name, "--json"], capture_output=True,
                           text=True, timeout=CMD_TIMEOUT_S, env=env)
        assert r.returncode == 0, f"kvring inspect show failed ({r.returncode}): {r.stderr}"
        return json.loads(r.stdout)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP, returning once /proc says it is stopped."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.001)
        raise AssertionError(f"kvring server {self.name} not stopped 10 s after SIGSTOP")

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                Procs.kill_group(self.proc)
                self.proc.wait(5)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        # A SIGKILLed server leaves its segment behind (readable post mortem);
        # it is ours (unique name): remove it.
        seg = f"/dev/shm/kvring-{os.getuid()}-{self.name}"
        if os.path.exists(seg):
            os.unlink(seg)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kvring_server_factory(procs, tmp_path_factory):
    """Starts kvring servers (unique names, runtime dirs under tmp); stops
    them and removes what they leave at the end of the session."""
    base = str(tmp_path_factory.mktemp("kvring"))
    servers: list[KvringServer] = []

    def start(**kw) -> KvringServer:
        s = KvringServer(procs, base, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.cleanup()
