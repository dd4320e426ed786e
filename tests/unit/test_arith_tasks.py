"""The synthetic tasks (tasks.py): `arith` (the CPU demo: two operations) and `arith_tail` (chains of 2 to 40
operations, long-tailed response lengths), scored by reward_math as the run scores them."""

import random
from types import SimpleNamespace

import pytest
from tiny import ROOT
from transformers import AutoTokenizer

import tasks
from reward_math import score


def chain_value(p: tasks.Problem) -> int:
    value = p.terms[0]
    for op, t in zip(p.ops, p.terms[1:]):
        value = value + t if op == "+" else value - t
        assert value >= 0  # a story: nobody holds a negative number of apples
    return value


@pytest.mark.parametrize("task", tasks.TASKS)
def test_problems_are_stories_with_right_answers_and_worked_solutions(task):
    train, test = tasks.arith_splits(2000, 200, seed=3, task=task)
    assert len(train) == 2000 and len(test) == 200
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert [r["prompt_id"] for r in test + train] == list(range(2200))
    for row in train[:500] + test:
        p = tasks.problem_from_row(row)
        assert len(p.terms) == len(p.ops) + 1 and 2 <= len(p.ops) <= tasks.TAIL_MAX_OPS
        assert p.answer == chain_value(p) and p.question.count(",") == len(p.ops)  # one clause per operation
        solution = tasks.worked_solution(p)
        assert solution.count("=") == len(p.ops) and score(solution, row["answer"]) == 1.0
    if task == "arith":
        assert all(len(r["ops"]) == 2 for r in train)


def test_mistakes_change_answers_at_their_rate():
    """On chains of any length a slip gives a wrong answer: one slip with probability 0.5 (random), or slips only
    where the problem invites one (systematic: a first-step subtraction, a carry or borrow in any step)."""
    rows = tasks.arith_splits(3000, 0, seed=0, task="arith_tail")[0]
    rng = random.Random(0)
    wrong = {m: 0 for m in ("random", "systematic")}
    for row in rows:
        for m in wrong:
            wrong[m] += score(tasks.worked_solution(tasks.problem_from_row(row), rng, 0.5, m), row["answer"]) == 0.0
    assert 0.40 < wrong["random"] / len(rows) < 0.60  # exactly one slip with probability 0.5, and it always shows
    assert 0.2 < wrong["systematic"] / len(rows) < wrong["random"] / len(rows) + 0.3


def test_tail_response_lengths_are_long_tailed():
    """Tokens of a correct worked solution (+ EOS) under the shipped tokenizer: median ~30, p99 over 300."""
    tok = AutoTokenizer.from_pretrained(ROOT / "exp/tiny-model")
    rows = tasks.arith_splits(4000, 0, seed=1, task="arith_tail")[0]
    lengths = sorted(len(tok(tasks.worked_solution(tasks.problem_from_row(r)))["input_ids"]) + 1 for r in rows)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * (len(lengths) - 1))]
    assert 20 <= median <= 40 and p99 >= 300, (median, p99)
    demo = tasks.arith_splits(500, 0, seed=1)[0]
    demo_lengths = [len(tok(tasks.worked_solution(tasks.problem_from_row(r)))["input_ids"]) + 1 for r in demo]
    assert max(demo_lengths) < 40  # the demo: short, uniform responses


def test_load_task_builds_both_synthetic_tasks():
    for task in tasks.TASKS:
        cfg = SimpleNamespace(task=task, num_train=100, num_test=20, seed=0)
        train, test = tasks.load_task(cfg, tokenizer=None)
        assert len(train) == 100 and len(test) == 20
        assert all(r["prompt"] == tasks.format_prompt(r["question"]) for r in train + test)
