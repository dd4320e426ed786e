"""The synthetic math task of the CPU demo: seeded multi-step arithmetic word problems.

Each problem chains three numbers (1-30) with + and -, phrased as a short story; the gold answer
is an integer and the model must end with `\\boxed{N}`. Worked solutions come in two flavours:
correct ones, and ones carrying a typical mistake (a flipped operation in the first step, or an
off-by-one last step). The warm start is trained on a mix of both, so the model is *capable but
unsharp*: its samples are often right (high pass@k) but its greedy answer often is not — exactly
the situation RL sharpens (see README, "How the tiny model was made").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import datasets

NAMES = ["Ann", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
ITEMS = ["apples", "stamps", "coins", "books", "shells", "cards", "pens", "beads", "marbles", "eggs"]
GAIN = ["buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more"]
LOSS = ["gives away {n}", "loses {n}", "sells {n}", "uses {n}"]
PROMPT_PREFIX = "Q: "
PROMPT_SUFFIX = "\nA:"


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    terms: tuple[int, int, int]
    ops: tuple[str, str]  # each '+' or '-'


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def sample_problem(rng: random.Random) -> Problem:
    """Three terms, two operations, every intermediate result non-negative (it is a story)."""
    while True:
        a, b, c = (rng.randint(1, 30) for _ in range(3))
        ops = (rng.choice("+-"), rng.choice("+-"))
        mid = _apply(a, ops[0], b)
        end = _apply(mid, ops[1], c)
        if mid >= 0 and end >= 0:
            break
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    verbs = [rng.choice(GAIN if op == "+" else LOSS).format(n=n) for op, n in zip(ops, (b, c))]
    question = f"{name} has {a} {item}, {verbs[0]}, then {verbs[1]}. How many {item} now?"
    return Problem(question, end, (a, b, c), ops)


def _needs_carry(a: int, op: str, b: int) -> bool:
    """Does a + b carry (or a - b borrow) in the units digit?"""
    return (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)


def worked_solution(
    p: Problem, rng: random.Random | None = None, mistake_rate: float = 0.0, mistakes: str = "systematic"
) -> str:
    """` a+b=m. m-c=r. \\boxed{r}`, possibly with a typical mistake.

    mistakes="systematic" (the warm start's): with probability `mistake_rate`, a subtraction in the first
    step is done as an addition, and, independently, a carry/borrow in either step is forgotten (±10).
    Such slips are tied to features of the problem, so for those problems the *most likely* answer is
    wrong (greedy fails) while correct answers keep a large share (sampling succeeds) — capable but
    unsharp. mistakes="random": one slip (flipped first operation or an off-by-one last step) with
    probability `mistake_rate`, anywhere."""
    (a, b, c), (op1, op2) = p.terms, p.ops
    slip = rng is not None and rng.random() < mistake_rate
    if mistakes == "random":
        kind = rng.choice(["flip", "off_by_one"]) if slip else None
        if kind == "flip":
            op1 = "-" if op1 == "+" else "+"
        mid = _apply(a, op1, b)
        end = _apply(mid, op2, c) + (rng.choice([-1, 1]) if kind == "off_by_one" else 0)
        return f" {a}{op1}{b}={mid}. {mid}{op2}{c}={end}. \\boxed{{{end}}}"
    if slip and op1 == "-":
        op1 = "+"
    mid = _apply(a, op1, b)
    if rng is not None and _needs_carry(a, op1, b) and rng.random() < mistake_rate:
        mid += -10 if op1 == "+" else 10
    end = _apply(mid, op2, c)
    if rng is not None and _needs_carry(mid, op2, c) and rng.random() < mistake_rate:
        end += -10 if op2 == "+" else 10
    return f" {a}{op1}{b}={mid}. {mid}{op2}{c}={end}. \\boxed{{{end}}}"


def format_prompt(question: str) -> str:
    return f"{PROMPT_PREFIX}{question}{PROMPT_SUFFIX}"


def make_arith_dataset(num_train: int, num_test: int, seed: int = 0) -> datasets.DatasetDict:
    """Disjoint train/test splits (no question text appears in both) with columns
    prompt_id, question, answer (gold as a string), solution (a correct worked solution)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < num_train + num_test:
        p = sample_problem(rng)
        if p.question in seen:
            continue
        seen.add(p.question)
        rows.append(
            {
                "question": p.question,
                "answer": str(p.answer),
                "solution": worked_solution(p),
                "terms": list(p.terms),
                "ops": "".join(p.ops),
            }
        )
    for i, row in enumerate(rows):
        row["prompt_id"] = i
    return datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[num_test:]), "test": datasets.Dataset.from_list(rows[:num_test])}
    )


def problem_from_row(row: dict) -> Problem:
    return Problem(row["question"], int(row["answer"]), tuple(row["terms"]), tuple(row["ops"]))


def load_task(data_cfg, tokenizer) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows as dicts with prompt_id, question, answer and prompt (the text the model
    sees). `arith` is built here; GSM8K / MATH / DeepScaleR / local files go through math_data."""
    if data_cfg.task == "arith":
        ds = make_arith_dataset(data_cfg.num_train, data_cfg.num_test, data_cfg.seed)
        train, test = list(ds["train"]), list(ds["test"])
        for row in train + test:
            row["prompt"] = format_prompt(row["question"])
        return train, test
    import math_data  # real math datasets (GSM8K, MATH, DeepScaleR, jsonl/parquet)

    train, test = math_data.load_task_splits(data_cfg)
    for row in train + test:
        row["prompt"] = math_data.chat_prompt(tokenizer, row["question"])
    return train, test[: data_cfg.num_test] if data_cfg.num_test else test
