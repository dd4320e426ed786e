"""Rule-based reward for math answers: extraction, a fast exact path, and math-verify behind a kill switch.

The reward decides what the policy learns, so this file is careful about three failure modes:
  * false negatives on equivalent forms  -> math-verify (sympy) decides equivalence of LaTeX answers;
  * false positives on partial matches   -> we extract ONE final answer (last \boxed{}, `#### N`, "the answer is")
                                            and compare it whole, never substring-search the response;
  * hangs on pathological LaTeX          -> hard caps on lengths/nesting before any parsing, and math-verify runs
                                            in a worker process that is killed when it exceeds its time bound
                                            (its own process: math-verify's own SIGALRM timeouts fail in threads).

Plain numbers (`18`, `-3`, `1,450,000`, `\\$18.90`, `10\\%`, `.5`) never reach math-verify: they are compared exactly
as rationals in-process. That fast path covers GSM8K and our synthetic arithmetic task and keeps throughput high.

Public API: score, score_details, ScoreDetails, ScoreLimits, scaled, extract_answer, last_boxed, RewardPool,
pass_at_k, avg_at_k, warm_up.


The slow path, math-verify in a killable worker process: math-verify's own timeouts use SIGALRM, which only
works on the main thread of the main interpreter, so it runs with its timeouts disabled, in a fresh interpreter (subprocess, not multiprocessing: it never forks a parent
holding CUDA/NCCL state, nor re-imports the caller's __main__) that the caller kills when it exceeds its bound.

Protocol: the worker prints `ready`, then answers each JSON line [answer, gold] on stdin with one line,
`correct`, `wrong` or `parse_error`, until stdin closes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from errors import HexrlError

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


class RewardError(HexrlError, ValueError):
    """A gold answer the scorer cannot use, or a math-verify worker that does not start."""


class VerifierProcess:
    """One killable math-verify worker. States: starting -> ready (idle) <-> busy; killed on timeout."""

    def __init__(self, memory_budget_bytes: int = 2 << 30):
        code = (
            f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import reward_math; reward_math.worker_main({int(memory_budget_bytes)})"
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
                raise RewardError(
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
                raise RewardError(f"reward worker did not start within {startup_timeout_s:.0f}s")
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


REASONS = ("correct", "wrong", "no_answer", "timeout", "parse_error")


@dataclass(frozen=True)
class ScoreDetails:
    reward: float  # 1.0 correct, 0.0 otherwise
    extracted: str | None  # the final answer we pulled out of the response (None if there was none)
    reason: str  # one of REASONS


@dataclass(frozen=True)
class ScoreLimits:
    max_response_chars: int = 200_000  # longer responses are rejected outright (parse_error), never scanned
    max_answer_chars: int = 1_000  # an extracted answer (or gold) longer than this is not parsed
    max_brace_depth: int = 32  # deeper nesting is pathological for the LaTeX parser
    timeout_s: float = 1.0  # wall-clock bound on one math-verify call (worker is killed past it)


DEFAULT_LIMITS = ScoreLimits()

# ----------------------------------------------------------------------------------------------------------------
# Extraction: one final answer per response.

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"(?:final\s+answer|the\s+answer|answer)\s*(?:is\s*:?|:|=)\s*", re.IGNORECASE)
_ANSWER_IS_WINDOW = 2_000  # the "answer is" regex only looks at the response tail: bounded work per call
_SENTENCE_END = re.compile(r"\.(?=\s|$)")


def _find_last_box(text: str, max_chars: int) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces), or None.

    None also when the last box is unclosed or its content exceeds max_chars: the scan is bounded by max_chars,
    so 10k nested braces cost O(max_chars), not O(n^2)."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd_len = len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")
    i = start + cmd_len
    if i < len(text) and text[i] == " ":  # MATH's `\boxed 5` form: a single token after a space
        m = re.match(r" +([^\s$]+)", text[i : i + max_chars + 8])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth, end = 0, min(len(text), i + max_chars + 2)
    for j in range(i, end):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unclosed (truncated generation) or longer than max_chars


def last_boxed(text: str, max_chars: int = DEFAULT_LIMITS.max_answer_chars) -> str | None:
    """Content of the last complete \\boxed{...} / \\fbox{...} in text (MATH solutions keep their gold there)."""
    content = _find_last_box(text, max_chars)
    return content.strip() if content is not None and content.strip() else None


def _strip_math_delimiters(ans: str) -> str:
    ans = ans.strip().strip("*").strip()  # markdown bold around the answer
    for left, right in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if len(ans) >= len(left) + len(right) and ans.startswith(left) and ans.endswith(right):
            ans = ans[len(left) : len(ans) - len(right)].strip()
            break
    return ans.rstrip(".").strip()


def extract_answer(response: str, limits: ScoreLimits = DEFAULT_LIMITS) -> str | None:
    """The response's final answer: last \\boxed{}/\\fbox{}, else the last `#### N`, else the last "answer is X".

    Priority (not position) decides between forms, so "the answer is \\boxed{5}" yields 5."""
    boxed = _find_last_box(response, limits.max_answer_chars)
    if boxed is not None and _strip_math_delimiters(boxed):
        return _strip_math_delimiters(boxed)
    hashes = response.rfind("####")
    if hashes >= 0:
        line = response[hashes + 4 : hashes + 4 + limits.max_answer_chars + 1].split("\n", 1)[0]
        end = _SENTENCE_END.search(line)
        ans = _strip_math_delimiters(line[: end.start()] if end else line)
        if ans:
            return ans
    tail = response[-_ANSWER_IS_WINDOW:]
    last = None
    for match in _ANSWER_IS.finditer(tail):
        last = match
    if last is not None:
        rest = tail[last.end() :].split("\n", 1)[0]
        end = _SENTENCE_END.search(rest)
        ans = _strip_math_delimiters(rest[: end.start()] if end else rest)
        boxed_inside = _find_last_box(ans, limits.max_answer_chars)
        ans = _strip_math_delimiters(boxed_inside) if boxed_inside is not None else ans
        if ans:
            return ans
    return None


def _normalize_gold(gold: str, limits: ScoreLimits) -> str:
    """Gold is normally a bare answer; accept a full solution too (MATH `\\boxed{}` or GSM8K `#### N`)."""
    if "\\boxed" in gold or "\\fbox" in gold or "####" in gold:
        extracted = extract_answer(gold, limits)
        if extracted is not None:
            return extracted
    return _strip_math_delimiters(gold)


# ----------------------------------------------------------------------------------------------------------------
# Fast path: plain numbers compared exactly as rationals, no sympy.

_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")
_LATEX_UNIT = re.compile(r"\\(?:text|mbox|mathrm|textrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?$")
_UNIT_WORDS = re.compile(r"(?:\s+[A-Za-z]+\.?){1,3}$")
# Trailing words that change the meaning of the number before them: never strip these as "units".
_NOT_UNIT_WORDS = {
    "or",
    "and",
    "to",
    "plus",
    "minus",
    "times",
    "over",
    "divided",
    "by",
    "of",
    "not",
    "i",
    "x",
    "y",
    "n",
    "k",
    "e",
    "pi",
    "mod",
    "per",
    "more",
    "less",
    "than",
    "about",
    "approximately",
    "dozen",
    "hundred",
    "thousand",
    "million",
    "billion",
    "trillion",
    "hundreds",
    "thousands",
    "millions",
}


@dataclass(frozen=True)
class _Number:
    value: Fraction
    percent: bool


def _parse_plain_number(ans: str) -> _Number | None:
    """`-1,234.5`, `\\$18.90`, `10\\%`, `.5`, `5\\text{ cm}`, `18 dollars` -> exact value; anything else -> None."""
    s = ans.strip().replace("\u2212", "-").replace("{,}", ",").replace("\\,", "").replace("\\!", "")
    s = _LATEX_UNIT.sub("", s).strip()
    words = _UNIT_WORDS.search(s)
    if words and not any(w.lower().rstrip(".") in _NOT_UNIT_WORDS for w in words.group(0).split()):
        s = s[: words.start()].strip()
    percent = False
    for sign in ("\\%", "%"):
        if s.endswith(sign):
            s, percent = s[: -len(sign)].strip(), True
            break
    s = s.replace("\\$", "").replace("$", "").replace(" ", "")
    if not s or not any(ch.isdigit() for ch in s) or _PLAIN_NUMBER.fullmatch(s) is None:
        return None
    return _Number(Fraction(s.replace(",", "")), percent)


def _numbers_equal(a: _Number, b: _Number) -> bool:
    if a.percent == b.percent:
        return a.value == b.value
    # One side has %, the other not: accept both readings ("10%" == "10" == "0.1"), as math-verify does.
    pct, plain = (a, b) if a.percent else (b, a)
    return plain.value == pct.value or plain.value == pct.value / 100


# ----------------------------------------------------------------------------------------------------------------
# caps before any parsing


def _brace_depth(s: str) -> int:
    """Deepest {} nesting, or -1 if the braces do not balance (we wrap answers in \\boxed{...} for parsing,
    so an unbalanced answer like `3}` could otherwise close the box early)."""
    depth = deepest = 0
    for c in s:
        if c == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif c == "}":
            depth -= 1
            if depth < 0:
                return -1
    return deepest if depth == 0 else -1


# ----------------------------------------------------------------------------------------------------------------
# Scoring.


class _ResultCache:
    """Small LRU of slow-path verdicts: GRPO groups repeat the same (answer, gold) pairs many times."""

    def __init__(self, capacity: int = 65_536):
        self.capacity, self._items = capacity, OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> str | None:
        with self._lock:
            reason = self._items.get(key)
            if reason is not None:
                self._items.move_to_end(key)
            return reason

    def put(self, key: tuple[str, str], reason: str) -> None:
        with self._lock:
            self._items[key] = reason
            if len(self._items) > self.capacity:
                self._items.popitem(last=False)


_cache = _ResultCache()


def _details(reason: str, extracted: str | None) -> ScoreDetails:
    return ScoreDetails(1.0 if reason == "correct" else 0.0, extracted, reason)


def _prepare(response: str, gold: str, limits: ScoreLimits) -> ScoreDetails | tuple[str, str]:
    """Everything before math-verify: validation, caps, extraction, fast path.

    Returns a final ScoreDetails, or the (answer, gold) pair that still needs math-verify."""
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(
            f"score expects (response: str, gold: str), got ({type(response).__name__}, {type(gold).__name__})"
        )
    if not gold.strip():
        raise RewardError("gold answer is empty")
    if len(response) > limits.max_response_chars:
        return _details("parse_error", None)
    answer = extract_answer(response, limits)
    if answer is None:
        return _details("no_answer", None)
    gold = _normalize_gold(gold, limits)
    if len(answer) > limits.max_answer_chars:
        return _details("parse_error", answer[: limits.max_answer_chars])
    answer_number, gold_number = _parse_plain_number(answer), _parse_plain_number(gold)
    if answer_number is not None and gold_number is not None:
        return _details("correct" if _numbers_equal(answer_number, gold_number) else "wrong", answer)
    if len(gold) > limits.max_answer_chars:
        raise RewardError(f"gold answer is {len(gold)} chars, over max_answer_chars={limits.max_answer_chars}")
    if not 0 <= _brace_depth(answer) <= limits.max_brace_depth:
        return _details("parse_error", answer)
    if _brace_depth(gold) < 0:
        raise RewardError(f"gold answer has unbalanced braces: {gold[:80]!r}")
    if answer == gold:  # identical strings are equivalent whatever they parse to
        return _details("correct", answer)
    cached = _cache.get((answer, gold))
    if cached is not None:
        return _details(cached, answer)
    return answer, gold


def score_details(response: str, gold: str, limits: ScoreLimits = DEFAULT_LIMITS) -> ScoreDetails:
    """Score one response against its gold answer. Never hangs: slow cases are bounded by limits.timeout_s."""
    prepared = _prepare(response, gold, limits)
    if isinstance(prepared, ScoreDetails):
        return prepared
    answer, gold_answer = prepared
    reason = verify_with_timeout(answer, gold_answer, limits.timeout_s)
    if reason != "timeout":  # a timeout may be CPU contention, not the input: let a later call retry
        _cache.put((answer, gold_answer), reason)
    return _details(reason, answer)


def score(response: str, gold: str, limits: ScoreLimits = DEFAULT_LIMITS) -> float:
    """1.0 if the response's final answer is equivalent to gold, else 0.0."""
    return score_details(response, gold, limits).reward


def scaled(reward: float | ScoreDetails, correct: float = 1.0, wrong: float = 0.0) -> float:
    """Map a 0/1 reward onto the caller's scale, e.g. AReaL's scaled(r, correct=5, wrong=-5)."""
    value = reward.reward if isinstance(reward, ScoreDetails) else reward
    if value not in (0.0, 1.0):
        raise ValueError(f"scaled expects a 0/1 reward, got {value!r}")
    return correct if value == 1.0 else wrong


# ----------------------------------------------------------------------------------------------------------------
# Reward as a pipeline stage: scoring off the generation loop's critical path.


class RewardPool:
    """Non-blocking scorer: submit(key, response, gold) now, poll() later for [(key, ScoreDetails, seconds)].

    Fast-path answers (plain numbers, no answer, cache hits) are scored inline at submit, without IPC; the rest
    queue for `num_workers` math-verify processes. A worker that exceeds limits.timeout_s is killed and replaced
    and its job answers reason 'timeout', reward 0. `seconds` is each job's service time (inline compute, or
    dispatch-to-verdict for a worker job); `reward_s` is their running sum, for the planner's cost model."""

    def __init__(self, num_workers: int = 2, limits: ScoreLimits = DEFAULT_LIMITS, memory_budget_bytes: int = 2 << 30):
        if num_workers < 1:
            raise ValueError(f"RewardPool needs num_workers >= 1, got {num_workers}")
        self.limits, self.memory_budget_bytes = limits, memory_budget_bytes
        self._workers = [VerifierProcess(memory_budget_bytes) for _ in range(num_workers)]
        self._queue: deque[tuple[Hashable, str, str]] = deque()  # (key, answer, gold) awaiting a free worker
        self._done: list[tuple[Hashable, ScoreDetails, float]] = []
        self._in_flight = 0
        self.reward_s = 0.0
        self.num_timeouts = 0
        self._closed = False

    @property
    def pending(self) -> int:
        """Jobs submitted but not yet returned by poll()."""
        return self._in_flight + len(self._done)

    def submit(self, key: Hashable, response: str, gold: str) -> None:
        if self._closed:
            raise RuntimeError("RewardPool.submit after close()")
        t0 = time.perf_counter()
        prepared = _prepare(response, gold, self.limits)  # bad input raises here, at the caller
        if isinstance(prepared, ScoreDetails):
            self._finish(key, prepared, time.perf_counter() - t0)
            return
        answer, gold_answer = prepared
        self._queue.append((key, answer, gold_answer))
        self._in_flight += 1
        self._dispatch()

    def wait_ready(self, startup_timeout_s: float = 120.0) -> None:
        """Block until every worker has imported math-verify, so a first slow-path job does not pay for it."""
        for worker in self._workers:
            worker.wait_ready(startup_timeout_s)

    def poll(self, wait_s: float = 0.0) -> list[tuple[Hashable, ScoreDetails, float]]:
        """Finished jobs since the last poll, in completion order. With wait_s > 0, waits up to that long for at
        least one (returns [] if none came); never blocks otherwise."""
        deadline = time.monotonic() + wait_s
        self._collect()
        self._dispatch()
        while not self._done and self._in_flight and time.monotonic() < deadline:
            self._wait_for_workers(deadline)
            self._collect()
            self._dispatch()
        done, self._done = self._done, []
        return done

    def drain(self, timeout_s: float | None = None) -> list[tuple[Hashable, ScoreDetails, float]]:
        """Block until every submitted job is finished (or timeout_s passes) and return them."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results = self.poll()
        while self._in_flight and (deadline is None or time.monotonic() < deadline):
            results += self.poll(wait_s=0.01 if deadline is None else max(0.0, deadline - time.monotonic()))
        return results

    def _wait_for_workers(self, deadline: float) -> None:
        """Sleep until a worker answers (or says ready), at most 10 ms: a job's timeout is then seen within 10 ms."""
        wait_s = min(0.01, max(0.0, deadline - time.monotonic()))
        waiting = [w for w in self._workers if w.job is not None or not w.ready]
        if waiting:
            select.select([w.process.stdout for w in waiting], [], [], wait_s)
        else:
            time.sleep(wait_s)

    def _finish(self, key: Hashable, details: ScoreDetails, seconds: float) -> None:
        self._done.append((key, details, seconds))
        self.reward_s += seconds

    def _collect(self) -> None:
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            if worker.job is None:
                continue
            key, answer, gold_answer, started = worker.job
            if worker.has_result():
                reason = worker.recv()
                worker.job = None
                _cache.put((answer, gold_answer), reason)
                self._in_flight -= 1
                self._finish(key, _details(reason, answer), time.monotonic() - started)
                if worker.dead:  # crashed mid-job: replace it
                    self._workers[i] = VerifierProcess(self.memory_budget_bytes)
            elif now - started > self.limits.timeout_s:
                worker.kill()
                self._workers[i] = VerifierProcess(self.memory_budget_bytes)
                self.num_timeouts += 1
                self._in_flight -= 1
                self._finish(key, _details("timeout", answer), now - started)

    def _dispatch(self) -> None:
        for i in range(len(self._workers)):
            while self._queue and self._workers[i].job is None and self._workers[i].poll_ready():
                key, answer, gold_answer = self._queue.popleft()
                cached = _cache.get((answer, gold_answer))  # an identical job may have finished meanwhile
                if cached is not None:
                    self._in_flight -= 1
                    self._finish(key, _details(cached, answer), 0.0)
                    continue
                try:
                    self._workers[i].send(answer, gold_answer)
                except OSError:  # the idle worker died (killed from outside): requeue, replace it
                    self._queue.appendleft((key, answer, gold_answer))
                    self._workers[i] = VerifierProcess(self.memory_budget_bytes)
                    break
                self._workers[i].job = (key, answer, gold_answer, time.monotonic())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for worker in self._workers:
                worker.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ----------------------------------------------------------------------------------------------------------------
# Evaluation metrics over scored samples.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): P(at least one of k draws without replacement from n samples, c correct,
    is correct) = 1 - C(n-c, k) / C(n, k), computed as a stable product."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"pass_at_k: {name} must be an int, got {type(value).__name__}")
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def avg_at_k(rewards: Sequence[float], k: int) -> float:
    """avg@k: the mean reward of the first k samples of one prompt (k <= number of samples)."""
    if not 1 <= k <= len(rewards):
        raise ValueError(f"avg_at_k needs 1 <= k <= len(rewards)={len(rewards)}, got k={k}")
    return sum(rewards[:k]) / k
