"""reward_math: the whole GSM8K test split, MATH-convention equivalences, fast path == math-verify, adversarial
inputs bounded in time, RewardPool (inline fast path, kill-and-replace on timeout), pass@k against brute force."""

import itertools
import json
import math
import os
import time
from fractions import Fraction

import pytest
import torch

import reward_math as rm
from reward_math import RewardPool, ScoreDetails, ScoreLimits, avg_at_k, pass_at_k, scaled, score, score_details

torch.set_num_threads(1)
GSM8K_TEST = os.path.join(os.path.dirname(__file__), "..", "..", "data", "gsm8k", "test.jsonl")
PATIENT = ScoreLimits(timeout_s=30.0)  # equivalence tests judge math, not speed: no spurious timeouts under load
POWER_TOWER = "\\boxed{10^{10^{10^{10}}}}"  # sympy evaluates integer powers eagerly: never finishes


@pytest.fixture(scope="module", autouse=True)
def warm_verifier():
    rm.warm_up()  # worker startup (imports + sympy warm-up) is not what the timing tests measure
    yield


# --- acceptance 1: every GSM8K reference solution scores 1.0, altered final number scores 0.0 -----------------


@pytest.mark.alone  # times the wall clock
def test_gsm8k_test_split_reference_solutions():
    with open(GSM8K_TEST) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1319
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        solution = row["answer"]
        head, gold = solution.rsplit("####", 1)
        gold = gold.strip()
        assert score(solution, gold) == 1.0, (i, gold)
        altered_value = Fraction(gold.replace(",", "")) + 1
        altered = f"{head}#### {altered_value}"
        details = score_details(altered, gold)
        assert details == ScoreDetails(0.0, str(altered_value), "wrong"), (i, details)
    assert time.perf_counter() - t0 < 10.0  # all on the fast path: no math-verify round trips


# --- extraction ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{3}, then corrected: \\boxed{4}", "4"),
        ("\\fbox{\\sqrt{\\{2\\}}}", "\\sqrt{\\{2\\}}"),
        ("Hence the answer is $\\boxed 5$.", "5"),
        ("The answer is \\boxed{7}.", "7"),
        ("#### 1,234\n", "1,234"),
        ("#### 18. That is all.", "18"),
        ("work... \\boxed{12 then the model ran out of tokens\n#### 11", "11"),
        ("The answer is 3.5.", "3.5"),
        ("The final answer is: $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}"),
        ("**Answer:** 42", "42"),
        ("Answer = -7", "-7"),
        ("\\boxed{}\n#### 9", "9"),
        ("no final answer here, 3 + 4 = 7", None),
        ("\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}", None),  # content longer than max_answer_chars
    ],
)
def test_extract_answer(response, expected):
    assert rm.extract_answer(response) == expected


def test_synthetic_task_answers_and_partial_matches():
    assert score("3 * -4 = -12, so \\boxed{-12}", "-12") == 1.0
    assert score("\\boxed{12}", "-12") == 0.0
    assert score("\\boxed{123}", "12") == 0.0  # prefix of the gold is not a match
    assert score("\\boxed{12}", "1") == 0.0
    assert score("12 is it. \\boxed{4}", "12") == 0.0  # numbers elsewhere in the response do not count
    assert score_details("I think 12", "12") == ScoreDetails(0.0, None, "no_answer")
    assert score_details("The answer is 12}", "12") == ScoreDetails(0.0, "12}", "parse_error")  # unbalanced


# --- the fast path: exact, and agrees with math-verify --------------------------------------------------------

FAST_PAIRS = [
    ("1,000", "1000"),
    ("\\$18.90", "18.9"),
    ("$18.90", "18.09"),
    ("10\\%", "0.1"),
    ("10%", "10"),
    ("10\\%", "1"),
    ("-3", "3"),
    ("-3", "-3.0"),
    (".5", "0.5"),
    ("007", "7"),
    ("5\\text{ cm}", "5"),
    ("5 \\text{ cm}^2", "5"),
    ("2.50", "2.5"),
    ("1,450,000", "1450000"),
    ("3", "3.0000001"),
]


@pytest.mark.parametrize("answer, gold", FAST_PAIRS)
def test_fast_path_agrees_with_math_verify(answer, gold, monkeypatch):
    expected = rm.verify_unbounded(answer, gold)  # in-process math-verify: these inputs are benign
    monkeypatch.setattr(rm, "verify_with_timeout", lambda *a: pytest.fail("fast path fell through to the worker"))
    assert score_details(f"\\boxed{{{answer}}}", gold).reason == expected


def test_fast_path_exactness_and_separators(monkeypatch):
    monkeypatch.setattr(rm, "verify_with_timeout", lambda *a: pytest.fail("fast path fell through to the worker"))
    assert score("\\boxed{123456789012345678901}", "123456789012345678901") == 1.0
    assert score("\\boxed{123456789012345678901}", "123456789012345678902") == 0.0  # no float rounding
    assert score("\\boxed{1{,}000}", "1000") == 1.0
    assert score("\\boxed{\u22125}", "-5") == 1.0  # unicode minus
    assert score("The answer is 18 dollars.", "18") == 1.0
    assert rm._parse_plain_number("3 million") is None and rm._parse_plain_number("5 or 6") is None
    assert rm._parse_plain_number("1,2") is None  # a tuple, not a thousands separator


# --- acceptance 2: MATH answer conventions through math-verify ------------------------------------------------

EQUIVALENT = [
    ("\\frac{3}{4}", "\\dfrac{3}{4}"),
    ("\\frac{3}{4}", "\\tfrac34"),
    ("\\frac{3}{4}", "0.75"),
    ("\\frac{3}{4}", "3/4"),
    ("\\$18.90", "\\$18.9"),
    ("10\\%", "10"),
    ("5\\text{ cm}", "5"),
    (".5", "\\frac12"),
    ("(1,2)", "(1, 2)"),
    ("[0,1)", "[0, 1)"),
    ("(-\\infty, 2]", "(-\\infty,2]"),
    ("1,2,3", "3, 2, 1"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
    ("2^{10}", "1024"),
    ("5", "x=5"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
]
NOT_EQUIVALENT = [
    ("\\frac{3}{4}", "\\frac{4}{3}"),
    ("\\frac{3}{4}", "0.76"),
    ("\\$18.90", "18.09"),
    ("10\\%", "1"),
    ("(1,2)", "(2,1)"),
    ("[0,1)", "(0,1)"),
    ("[0,1)", "[0,1]"),
    ("x^2+2x+1", "x^2+2x"),
    ("1,2,3", "1,2"),
    ("\\sqrt{2}", "2"),
    ("\\pi", "3.14159"),
    ("-\\frac{1}{2}", "\\frac{1}{2}"),
    ("2x", "x^2"),
]


@pytest.mark.parametrize("gold, answer", EQUIVALENT)
def test_equivalent_forms(gold, answer):
    details = score_details(f"Therefore the answer is $\\boxed{{{answer}}}$.", gold, PATIENT)
    assert details == ScoreDetails(1.0, answer, "correct")


@pytest.mark.parametrize("gold, answer", NOT_EQUIVALENT)
def test_non_equivalent_forms(gold, answer):
    details = score_details(f"Therefore the answer is $\\boxed{{{answer}}}$.", gold, PATIENT)
    assert details == ScoreDetails(0.0, answer, "wrong")


def test_scale_words_are_not_units():
    assert score("The answer is 3 million.", "3", PATIENT) == 0.0


def test_gold_given_as_full_solution():
    assert score("\\boxed{\\frac{1}{2}}", "so $x = \\boxed{\\dfrac{1}{2}}$", PATIENT) == 1.0
    assert score("\\boxed{18}", "9 * 2 = 18\n#### 18") == 1.0


# --- acceptance 3: adversarial inputs return 0.0 within 2 s each ------------------------------------------------

ADVERSARIAL = [
    ("10k nested braces, closed", "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"),
    ("10k nested braces, unclosed", "\\boxed{" + "{" * 10_000),
    ("1 MB response", "x" * 1_000_000 + "\\boxed{1}"),
    ("1 MB of box commands", "\\boxed{" * 150_000),
    ("deep frac nest", "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}"),
    ("power tower", POWER_TOWER),
    ("answer-is tail of 2k spaces", "the answer is" + " " * 1_000_000),
    ("unbalanced LaTeX", "\\boxed{\\frac{\\sqrt{}{}}{\\left(\\right.}^{_^_}}"),
    ("huge factorial", "\\boxed{(10^{9})!}"),
]


@pytest.mark.alone  # times the wall clock
@pytest.mark.parametrize("name, response", ADVERSARIAL, ids=[n for n, _ in ADVERSARIAL])
def test_adversarial_inputs_are_bounded(name, response):
    rm.warm_up()  # a previous case may have killed the worker: time the call, not a worker's startup
    t0 = time.perf_counter()
    details = score_details(response, "1")
    elapsed = time.perf_counter() - t0
    assert details.reward == 0.0, details
    assert elapsed < 2.0, f"{name}: {elapsed:.2f}s"
    assert score("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", PATIENT) == 1.0  # the verifier still works afterwards


def test_timeout_reason_and_recovery():
    details = score_details(POWER_TOWER, "5", ScoreLimits(timeout_s=0.5))
    assert details == ScoreDetails(0.0, "10^{10^{10^{10}}}", "timeout")
    assert rm._cache.get(("10^{10^{10^{10}}}", "5")) is None  # timeouts are not cached


def test_bad_input_errors():
    with pytest.raises(TypeError, match="response: str, gold: str"):
        score(None, "1")
    with pytest.raises(TypeError, match="int"):
        score("\\boxed{1}", 1)
    with pytest.raises(ValueError, match="gold answer is empty"):
        score("\\boxed{1}", "  ")
    with pytest.raises(ValueError, match="unbalanced braces"):
        score("\\boxed{x}", "\\frac{1}{2")


def test_scaled():
    assert scaled(1.0, correct=5, wrong=-5) == 5 and scaled(0.0, correct=5, wrong=-5) == -5
    assert scaled(score_details("\\boxed{2}", "2"), correct=5, wrong=-5) == 5
    with pytest.raises(ValueError, match="0/1 reward"):
        scaled(0.5)


# --- RewardPool -----------------------------------------------------------------------------------------------


@pytest.mark.alone  # times the wall clock
def test_reward_pool_matches_score_details_and_kills_timeouts():
    jobs = {
        "fast-right": ("\\boxed{-12}", "-12"),
        "fast-wrong": ("#### 7", "8"),
        "none": ("hmm", "1"),
        "slow-right": ("\\boxed{\\frac{6}{8}}", "0.75"),
        "slow-wrong": ("\\boxed{[0,1]}", "[0,1)"),
        "tower": (POWER_TOWER.replace("10", "9"), "5"),
        "after-tower": ("\\boxed{(y+1)^2}", "y^2+2y+1"),
    }
    with RewardPool(num_workers=1, limits=ScoreLimits(timeout_s=1.0)) as pool:
        pool.submit("fast-right", *jobs["fast-right"])
        t0 = time.perf_counter()
        first = pool.poll()  # fast path answers inline: available without waiting for any worker
        assert time.perf_counter() - t0 < 0.05
        assert [(k, d.reason) for k, d, _ in first] == [("fast-right", "correct")]
        for key in list(jobs)[1:]:
            pool.submit(key, *jobs[key])
        t0 = time.perf_counter()
        second = pool.poll()
        assert time.perf_counter() - t0 < 0.05  # poll never blocks on the slow jobs
        assert {"fast-wrong", "none"} <= {k for k, _, _ in second}
        assert pool.pending == len(jobs) - 1 - len(second)
        results = first + second + pool.drain(timeout_s=120)
        assert pool.pending == 0
        got = {key: details for key, details, _ in results}
        assert set(got) == set(jobs)
        assert got["tower"].reason == "timeout" and pool.num_timeouts == 1
        for key in ("fast-right", "fast-wrong", "none", "slow-right", "slow-wrong", "after-tower"):
            assert got[key] == score_details(*jobs[key], PATIENT), key  # replacement worker scored 'after-tower'
        assert pool.reward_s == pytest.approx(sum(s for _, _, s in results))
        assert got["tower"] == ScoreDetails(0.0, "9^{9^{9^{9}}}", "timeout")
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit("late", "\\boxed{1}", "1")
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0)


def test_dead_workers_are_replaced():
    rm.warm_up()
    os.kill(rm._shared_verifier.process.pid, 9)  # the idle shared worker dies from outside
    rm._shared_verifier.process.wait()
    assert score("\\boxed{\\frac{3}{9}}", "\\frac{1}{3}", PATIENT) == 1.0
    with RewardPool(num_workers=1, limits=ScoreLimits(timeout_s=60.0)) as pool:
        pool.submit("tower", POWER_TOWER, "5")  # busy for minutes: we kill it mid-job
        while pool._workers[0].job is None:
            pool.poll()
            time.sleep(0.05)
        os.kill(pool._workers[0].process.pid, 9)
        pool.submit("next", "\\boxed{\\frac{4}{12}}", "\\frac{1}{3}")
        got = {key: details.reason for key, details, _ in pool.drain(timeout_s=120)}
    assert got == {"tower": "parse_error", "next": "correct"}


# --- evaluation metrics ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_matches_brute_force(n, c, k):
    samples = [1] * c + [0] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in d) for d in draws) / len(draws)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_large_and_bad_input():
    assert pass_at_k(200, 10, 1) == pytest.approx(10 / 200)
    assert pass_at_k(1000, 1, 100) == pytest.approx(1 - math.comb(999, 100) / math.comb(1000, 100))
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(*bad)
    with pytest.raises(TypeError, match="int"):
        pass_at_k(4.0, 2, 1)


def test_avg_at_k():
    assert avg_at_k([1.0, 0.0, 1.0, 1.0], 4) == 0.75
    assert avg_at_k([1.0, 0.0, 1.0, 1.0], 2) == 0.5
    with pytest.raises(ValueError, match="avg_at_k"):
        avg_at_k([1.0], 2)


def test_adversarial_model_outputs_score_zero_in_bounded_time():
    from reward_math import score, warm_up

    attacks = [
        "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
        "\\boxed{9^{9^{9^{9^{9^{9}}}}}}",
        "x" * 1_000_000 + "\\boxed{4}",
        "\\boxed{" + "1" * 100_000 + "}",
        "\\boxed{__import__('os').system('echo pwned')}",
        "\\boxed{\\frac{1}{0}}",
        "\x00\\boxed{}",
    ]
    for text in attacks:
        warm_up()  # a previous attack may have had the worker killed: time the call, not a worker's startup
        t0 = time.perf_counter()
        assert score(text, "4") == 0.0, text[:60]
        assert time.perf_counter() - t0 < 10.0, text[:60]
