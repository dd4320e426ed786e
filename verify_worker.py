"""math-verify in a killable worker process: the slow path of reward_math.py.

math-verify's own timeouts use SIGALRM, which only works on the main thread of the main interpreter, so it runs
here with its timeouts disabled, in a fresh interpreter (subprocess, not multiprocessing: it never forks a parent
holding CUDA/NCCL state, nor re-imports the caller's __main__) that the caller kills when it exceeds its bound.

Protocol: the worker prints `ready`, then answers each JSON line [answer, gold] on stdin with one line,
`correct`, `wrong` or `parse_error`, until stdin closes.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

REPLIES = ("correct", "wrong", "parse_error")


def verify_unbounded(answer: str, gold: str) -> str:
    """'correct' / 'wrong' / 'parse_error' from math-verify. May run forever on pathological input."""
    from math_verify import parse, verify

    try:
        gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        answer_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=None)
        if not gold_parsed or not answer_parsed:
            return "parse_error"
        return "correct" if verify(gold_parsed, answer_parsed, timeout_seconds=None) else "wrong"
    except Exception:  # sympy raises a zoo of exception types on malformed input
        return "parse_error"


def _silence_math_verify_logs() -> None:
    # math-verify warns on every call that its timeout is disabled; we enforce the bound by killing the worker.
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


_WARMUP_PAIRS = (
    ("(x+1)^2", "x^2+2x+1"),
    ("[0,1)", "(0,1)"),
    ("\\dfrac{3}{4}", "0.75"),
    ("10\\%", "0.1"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("\\text{B}", "B"),
    ("x=5", "5"),
)


def worker_main(memory_budget_bytes: int) -> None:
    """Worker process: import once, say ready, then answer JSON lines [answer, gold] -> reason until stdin closes.

    Runs in a fresh interpreter (subprocess, not multiprocessing): it never re-imports the caller's __main__
    (a training script with torch/CUDA), and it is safe to start from any thread of a CUDA/NCCL process."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)  # private channel; stray prints from libraries go to stderr
    os.dup2(2, 1)
    try:  # die with the parent, even while stuck inside sympy
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _silence_math_verify_logs()
    import math_verify  # noqa: F401  (import cost paid before 'ready', not inside a timed job)

    try:  # cap address space so a huge sympy integer (10^{10^{10}}) fails with MemoryError instead of OOMing
        import resource

        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (current + memory_budget_bytes, resource.RLIM_INFINITY))
    except (OSError, ValueError, ImportError):
        pass
    for answer, gold in _WARMUP_PAIRS:  # sympy imports simplify/sets lazily: pay that before 'ready', not in a job
        verify_unbounded(answer, gold)
    protocol.write("ready\n")
    for line in sys.stdin:
        try:
            answer, gold = json.loads(line)
            reason = verify_unbounded(answer, gold)
        except MemoryError:
            reason = "parse_error"
        protocol.write(reason + "\n")


class VerifierProcess:
    """One killable math-verify worker. States: starting -> ready (idle) <-> busy; killed on timeout."""

    def __init__(self, memory_budget_bytes: int = 2 << 30):
        code = (
            f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import verify_worker; verify_worker.worker_main({int(memory_budget_bytes)})"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            close_fds=True,
        )
        self.ready = False
        self.dead = False
        self.job: tuple | None = None  # (key, answer, gold, started_at) while busy

    def _readable(self, wait_s: float) -> bool:
        return bool(select.select([self.process.stdout], [], [], wait_s)[0])

    def poll_ready(self) -> bool:
        if not self.ready and self._readable(0):
            msg = self.recv()
            if msg != "ready":
                raise RuntimeError(
                    f"reward worker failed during startup (exit code {self.process.poll()}); "
                    "check that math-verify imports in a fresh interpreter"
                )
            self.ready = True
        return self.ready

    def wait_ready(self, startup_timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + startup_timeout_s
        while not self.poll_ready():
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"reward worker did not start within {startup_timeout_s:.0f}s")
            self._readable(0.05)

    def send(self, answer: str, gold: str) -> None:
        self.process.stdin.write(json.dumps([answer, gold]) + "\n")
        self.process.stdin.flush()

    def has_result(self, wait_s: float = 0.0) -> bool:
        return self._readable(wait_s)

    def recv(self) -> str:
        line = self.process.stdout.readline()  # one short line, written whole: never blocks once readable
        if not line:  # EOF: the worker died (crash, OOM kill); the job that killed it scores parse_error
            self.dead = True
            return "parse_error"
        line = line.strip()
        return line if line in REPLIES or line == "ready" else "parse_error"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.process.stdin.close()  # EOF ends the worker's loop
            self.process.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=5)
        self._close_pipes()


_shared_verifier: VerifierProcess | None = None
_shared_pid: int | None = None
_shared_lock = threading.Lock()


def _shared() -> VerifierProcess:
    """The process-wide worker (a forked child gets its own); call with _shared_lock held."""
    global _shared_verifier, _shared_pid
    if _shared_verifier is None or _shared_pid != os.getpid():
        _shared_verifier, _shared_pid = VerifierProcess(), os.getpid()
    return _shared_verifier


def verify_with_timeout(answer: str, gold: str, timeout_s: float) -> str:
    """math-verify in the process-wide shared worker; kills and replaces it past timeout_s.

    The bound covers the verification only; a worker that is still starting (imports) is waited for first."""
    global _shared_verifier
    with _shared_lock:
        verifier = _shared()
        verifier.wait_ready()
        try:
            verifier.send(answer, gold)
        except OSError:  # the idle worker died (killed from outside): start another and retry once
            verifier = _shared_verifier = VerifierProcess()
            verifier.wait_ready()
            verifier.send(answer, gold)
        if verifier.has_result(timeout_s):
            reason = verifier.recv()
            if verifier.dead:
                _shared_verifier = VerifierProcess()
            return reason
        verifier.kill()
        _shared_verifier = VerifierProcess()  # replacement starts importing now, in the background
        return "timeout"


def warm_up(wait: bool = True) -> None:
    """Start the shared math-verify worker now, so the first slow-path score does not pay its startup.
    wait=False only spawns it (its imports then overlap the caller's own start-up)."""
    with _shared_lock:
        verifier = _shared()
        if wait:
            verifier.wait_ready()
