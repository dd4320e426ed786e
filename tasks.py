"""The tasks the policy learns: the CPU demo's synthetic arithmetic, and real math datasets.

The synthetic tasks: seeded multi-step arithmetic word problems.
Each problem chains numbers (1-30) with + and -, phrased as a short story; the gold answer is an
integer and the model must end with `\boxed{N}`. `arith` (the CPU demo) chains three numbers, so every
response is ~26 tokens; `arith_tail` draws the number of operations from a lognormal (2 to 40: TAIL_* below),
so response lengths are long-tailed (median 27 tokens, p99 ~340) as in reasoning RL, where a
synchronous step waits for its longest sample. Worked solutions come in two flavours:
correct ones, and ones carrying a typical mistake (a flipped operation in the first step, or an
off-by-one last step). The warm start is trained on a mix of both, so the model is *capable but
unsharp*: its samples are often right (high pass@k) but its greedy answer often is not — exactly
the situation RL sharpens (see README, "How the tiny model was made").

Real math datasets as (prompt_id, question, answer) rows, and the prompt the policy sees (`load_task` picks).

Sources: a preset name (gsm8k, math, math500, deepscaler), a hub id (through `datasets.load_dataset`), or a local
jsonl/json/parquet file or a directory holding `{split}.jsonl|json|parquet`. A field mapping says which columns
hold the question and the answer, and how the gold answer is written in that column:
  plain  the column is the answer (DeepScaleR `answer`, our synthetic task);
  gsm8k  a worked solution ending in `#### N` (GSM8K `answer`): gold = N without thousands separators;
  boxed  a worked solution whose last `\boxed{}` holds the answer (MATH `solution`).
GSM8K is vendored under data/gsm8k (MIT, OpenAI) and read from there when the hub is off (HF_DATASETS_OFFLINE=1)
or unreachable. Rows that lack a field are skipped and counted (one warning line) or fail loudly, naming file,
row and field. The returned `datasets.Dataset` has columns prompt_id (int: the row's index in its source, so ids
survive skipped rows), question and answer (gold string, scored by reward_math).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import reward_math
from errors import HexrlError

if TYPE_CHECKING:  # imported where used: a rank that loads no data skips its ~3 s import
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
    terms: tuple[int, ...]  # one more than ops
    ops: tuple[str, ...]  # each '+' or '-'


# arith_tail: operations per problem ~ lognormal(median TAIL_MEDIAN_OPS, sigma TAIL_SIGMA) clipped to [2, TAIL_MAX_OPS];
# a step of the worked solution is ~9 tokens, so responses have a median of 27 tokens and a p99 of ~340
TAIL_MEDIAN_OPS, TAIL_SIGMA, TAIL_MAX_OPS = 2.5, 1.1, 40
TASKS = ("arith", "arith_tail")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def num_ops(task: str, rng: random.Random) -> int:
    if task == "arith":
        return 2
    return min(TAIL_MAX_OPS, max(2, round(rng.lognormvariate(math.log(TAIL_MEDIAN_OPS), TAIL_SIGMA))))


def sample_problem(rng: random.Random, n_ops: int = 2) -> Problem:
    """n_ops + 1 terms, n_ops operations, every intermediate result non-negative (it is a story)."""
    while True:
        terms = [rng.randint(1, 30) for _ in range(n_ops + 1)]
        ops = [rng.choice("+-") for _ in range(n_ops)]
        value, ok = terms[0], True
        for op, t in zip(ops, terms[1:]):
            value = _apply(value, op, t)
            ok = ok and value >= 0
        if ok:
            break
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    verbs = [rng.choice(GAIN if op == "+" else LOSS).format(n=n) for op, n in zip(ops, terms[1:])]
    question = f"{name} has {terms[0]} {item}, {', '.join(verbs[:-1])}, then {verbs[-1]}. How many {item} now?"
    return Problem(question, value, tuple(terms), tuple(ops))


def _needs_carry(a: int, op: str, b: int) -> bool:
    """Does a + b carry (or a - b borrow) in the units digit?"""
    return (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)


def worked_solution(
    p: Problem, rng: random.Random | None = None, mistake_rate: float = 0.0, mistakes: str = "systematic"
) -> str:
    """` a+b=m. m-c=r. \\boxed{r}` (one step per operation), possibly with a typical mistake.

    mistakes="systematic" (the warm start's): with probability `mistake_rate`, a subtraction in the first
    step is done as an addition, and, independently, a carry/borrow in any step is forgotten (±10).
    Such slips are tied to features of the problem, so for those problems the *most likely* answer is
    wrong (greedy fails) while correct answers keep a large share (sampling succeeds) — capable but
    unsharp. mistakes="random": one slip (flipped first operation or an off-by-one last step) with
    probability `mistake_rate`, anywhere."""
    ops = list(p.ops)
    slip = rng is not None and rng.random() < mistake_rate
    if mistakes == "random":
        kind = rng.choice(["flip", "off_by_one"]) if slip else None
        if kind == "flip":
            ops[0] = "-" if ops[0] == "+" else "+"
    elif slip and ops[0] == "-":
        ops[0] = "+"
    steps, value = [], p.terms[0]
    for i, (op, t) in enumerate(zip(ops, p.terms[1:])):
        result = _apply(value, op, t)
        if mistakes == "random":
            last = i == len(ops) - 1
            result += rng.choice([-1, 1]) if last and kind == "off_by_one" else 0
        elif rng is not None and _needs_carry(value, op, t) and rng.random() < mistake_rate:
            result += -10 if op == "+" else 10
        steps.append(f"{value}{op}{t}={result}.")
        value = result
    return f" {' '.join(steps)} \\boxed{{{value}}}"


def format_prompt(question: str) -> str:
    return f"{PROMPT_PREFIX}{question}{PROMPT_SUFFIX}"


def arith_splits(num_train: int, num_test: int, seed: int = 0, task: str = "arith") -> tuple[list[dict], list[dict]]:
    """Disjoint train/test rows (no question text appears in both) with fields prompt_id, question, answer (gold
    as a string), solution (a correct worked solution), terms, ops. Plain dicts: every rank builds them at start-up,
    and a `datasets.Dataset` round trip would cost it the import of datasets."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < num_train + num_test:
        p = sample_problem(rng, num_ops(task, rng))
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
    return rows[num_test:], rows[:num_test]


def problem_from_row(row: dict) -> Problem:
    return Problem(row["question"], int(row["answer"]), tuple(row["terms"]), tuple(row["ops"]))


def load_task(data_cfg, tokenizer, max_prompt_tokens: int | None = None) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows as dicts with prompt_id, question, answer and prompt (the text the model
    sees). `arith` is built here; GSM8K / MATH / DeepScaleR / local files go through load_task_splits below.
    A prompt longer than `max_prompt_tokens` tokens is a bad row (data.on_bad_row: skipped and counted, or an
    error naming it): the rollout could not generate for it."""
    if data_cfg.task in TASKS:
        train, test = arith_splits(data_cfg.num_train, data_cfg.num_test, data_cfg.seed, data_cfg.task)
        for row in train + test:
            row["prompt"] = format_prompt(row["question"])
    else:
        train, test = load_task_splits(data_cfg)
        for row in train + test:
            row["prompt"] = chat_prompt(tokenizer, row["question"])
        test = test[: data_cfg.num_test] if data_cfg.num_test else test
    if max_prompt_tokens is not None:
        train, test = (
            _within(rows, tokenizer, max_prompt_tokens, data_cfg.on_bad_row, s)
            for rows, s in ((train, "train"), (test, "test"))
        )
        if not train:
            raise DataError(f"{data_cfg.task}: no train prompt fits in {max_prompt_tokens} tokens")
    return train, test


def _within(rows: list[dict], tokenizer, limit: int, on_bad_row: str, split: str) -> list[dict]:
    if not rows:
        return rows
    lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in rows])["input_ids"]]
    long = [(r, n) for r, n in zip(rows, lengths) if n > limit]
    if long and on_bad_row == "fail":
        row, n = long[0]
        raise DataError(
            f"{split} prompt {row['prompt_id']} has {n} tokens, more than the {limit} allowed (data.max_prompt_tokens, "
            f"and rollout.max_seq_len - rollout.max_new_tokens); {len(long)} such rows"
        )
    if long:
        log.warning("%s: skipped %d of %d prompts longer than %d tokens", split, len(long), len(rows), limit)
    return [r for r, n in zip(rows, lengths) if n <= limit]


log = logging.getLogger(__name__)
REPO_ROOT = os.path.dirname(os.path.abspath(__file__))
ANSWER_FORMATS = ("plain", "gsm8k", "boxed")
LOCAL_EXTENSIONS = (".jsonl", ".json", ".parquet")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class FieldMap:
    question: str = "question"
    answer: str = "answer"
    answer_format: str = "plain"  # plain | gsm8k | boxed (see module docstring)

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise DataError(f"answer_format must be one of {ANSWER_FORMATS}, got {self.answer_format!r}")


@dataclass(frozen=True)
class DatasetSpec:
    hub_id: str
    config: str | None
    fields: FieldMap
    splits: tuple[str, ...]  # the splits the source offers
    local_dir: str | None = None  # vendored copy, used when the hub is unavailable


PRESETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec(
        "openai/gsm8k",
        "main",
        FieldMap("question", "answer", "gsm8k"),
        ("train", "test"),
        local_dir=os.path.join(REPO_ROOT, "data", "gsm8k"),
    ),
    "math": DatasetSpec(
        "DigitalLearningGmbH/MATH-lighteval", "default", FieldMap("problem", "solution", "boxed"), ("train", "test")
    ),
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", None, FieldMap("problem", "solution", "boxed"), ("test",)),
    "deepscaler": DatasetSpec(
        "agentica-org/DeepScaleR-Preview-Dataset", None, FieldMap("problem", "answer", "plain"), ("train",)
    ),
}


class DataError(HexrlError, ValueError):
    """A dataset cannot be loaded or used: a row lacks a usable question or answer (raised with
    on_bad_row='fail'), a file or hub dataset is unreadable, a split does not exist, too few rows remain."""

    same_on_every_rank = True


# ----------------------------------------------------------------------------------------------------------------
# Reading raw rows: (row number, dict) from local files or the hub.


def _looks_like_path(source: str) -> bool:
    return source.endswith(LOCAL_EXTENSIONS) or source.startswith(("/", "./", "../", "~")) or os.path.exists(source)


def _local_file_for_split(directory: str, split: str) -> str:
    for ext in LOCAL_EXTENSIONS:
        path = os.path.join(directory, split + ext)
        if os.path.isfile(path):
            return path
    tried = ", ".join(split + ext for ext in LOCAL_EXTENSIONS)
    raise FileNotFoundError(f"no file for split {split!r} in {directory} (looked for {tried})")


def _read_local(path: str, split: str) -> tuple[str, list[tuple[int, object]]]:
    """(file actually read, [(1-based row number, raw row)]). A directory is resolved to its split's file."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"math dataset path does not exist: {path}")
    if os.path.isdir(path):
        path = _local_file_for_split(path, split)
    if path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as e:
                    rows.append((number, _InvalidJson(str(e))))
        return path, rows
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        return path, list(enumerate(data, start=1))
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return path, list(enumerate(pq.read_table(path).to_pylist(), start=1))
    raise DataError(f"unsupported math dataset file {path}: expected one of {LOCAL_EXTENSIONS}")


@dataclass(frozen=True)
class _InvalidJson:
    error: str


def _hub_offline() -> bool:
    return any(
        os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _read_hub(hub_id: str, config: str | None, split: str) -> list[tuple[int, object]]:
    import datasets

    ds = datasets.load_dataset(hub_id, config, split=split)
    return list(enumerate(ds, start=1))


# ----------------------------------------------------------------------------------------------------------------
# Raw row -> (question, gold answer).


def _field(raw: dict, name: str) -> str | None:
    value = raw.get(name)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):  # jsonl written by hand often stores numeric answers as numbers
        value = str(value)
    return value.strip() if isinstance(value, str) and value.strip() else None


def _question_and_gold(raw: object, fields: FieldMap) -> tuple[str, str]:
    """Raises DataError(problem) for an unusable row."""
    if isinstance(raw, _InvalidJson):
        raise DataError(f"invalid JSON ({raw.error})")
    if not isinstance(raw, dict):
        raise DataError(f"row is a {type(raw).__name__}, not an object")
    question, answer = _field(raw, fields.question), _field(raw, fields.answer)
    if question is None:
        raise DataError(f"missing field {fields.question!r}")
    if answer is None:
        raise DataError(f"missing field {fields.answer!r}")
    if fields.answer_format == "gsm8k":
        if "####" not in answer:
            raise DataError(f"field {fields.answer!r} has no '####' final-answer marker")
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    elif fields.answer_format == "boxed":
        answer = reward_math.last_boxed(answer)
        if answer is None:
            raise DataError(f"field {fields.answer!r} has no \\boxed{{}} final answer")
    if not answer:
        raise DataError(f"field {fields.answer!r} has an empty final answer")
    return question, answer


def _build(
    rows: list[tuple[int, object]], fields: FieldMap, origin: str, on_bad_row: str, max_rows: int | None
) -> datasets.Dataset:
    prompt_ids, questions, answers, bad = [], [], [], 0
    for number, raw in rows:
        if max_rows is not None and len(prompt_ids) >= max_rows:
            break
        try:
            question, answer = _question_and_gold(raw, fields)
        except DataError as e:
            if on_bad_row == "fail":
                raise DataError(f"{origin}: row {number}: {e}") from None
            bad += 1
            continue
        prompt_ids.append(number - 1)
        questions.append(question)
        answers.append(answer)
    if bad:
        log.warning("%s: skipped %d of %d rows missing %r/%r", origin, bad, len(rows), fields.question, fields.answer)
    if not prompt_ids:
        raise DataError(
            f"{origin}: no usable rows ({bad} bad of {len(rows)}); check the field mapping "
            f"question={fields.question!r} answer={fields.answer!r}"
        )
    import datasets

    features = datasets.Features(
        {"prompt_id": datasets.Value("int64"), "question": datasets.Value("string"), "answer": datasets.Value("string")}
    )
    return datasets.Dataset.from_dict(
        {"prompt_id": prompt_ids, "question": questions, "answer": answers}, features=features
    )


# ----------------------------------------------------------------------------------------------------------------
# Public entry points.


def load_math_dataset(
    source: str,
    split: str = "train",
    fields: FieldMap | None = None,
    on_bad_row: str = "skip",
    max_rows: int | None = None,
) -> datasets.Dataset:
    """Rows (prompt_id, question, answer) from a preset, a hub id, or a local file/directory (see module doc).

    `fields` overrides the preset's mapping (default for hub ids and files: question/answer, plain)."""
    if on_bad_row not in ("skip", "fail"):
        raise DataError(f"on_bad_row must be 'skip' or 'fail', got {on_bad_row!r}")
    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows must be >= 1, got {max_rows}")
    if not isinstance(source, str) or not source:
        raise DataError(f"math dataset source must be a preset name, hub id or path, got {source!r}")
    spec = PRESETS.get(source.lower())
    if spec is not None:
        fields = fields or spec.fields
        if split not in spec.splits:
            raise DataError(f"{source} has splits {spec.splits}, not {split!r}")
        if spec.local_dir is not None and _hub_offline():
            origin, rows = _read_local(spec.local_dir, split)
            return _build(rows, fields, origin, on_bad_row, max_rows)
        try:
            rows = _read_hub(spec.hub_id, spec.config, split)
        except Exception as e:  # no network, no cache, hub outage: the vendored copy is the same data
            if spec.local_dir is None:
                raise DataError(
                    f"cannot load {spec.hub_id} ({type(e).__name__}: {e}); download it into the "
                    "datasets cache or pass a local jsonl/parquet path"
                ) from None
            log.warning("%s unavailable (%s); reading vendored %s", spec.hub_id, type(e).__name__, spec.local_dir)
            origin, rows = _read_local(spec.local_dir, split)
            return _build(rows, fields, origin, on_bad_row, max_rows)
        return _build(rows, fields, f"{spec.hub_id}[{split}]", on_bad_row, max_rows)
    fields = fields or FieldMap()
    if _looks_like_path(source):
        origin, rows = _read_local(source, split)
        return _build(rows, fields, origin, on_bad_row, max_rows)
    try:
        rows = _read_hub(source, None, split)
    except Exception as e:
        raise DataError(
            f"cannot load hub dataset {source!r} split {split!r} ({type(e).__name__}: {e}); "
            "if it is a local path, check that it exists"
        ) from None
    return _build(rows, fields, f"{source}[{split}]", on_bad_row, max_rows)


def _available_splits(source: str) -> tuple[str, ...]:
    spec = PRESETS.get(source.lower())
    if spec is not None:
        return spec.splits
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return tuple(
            s for s in ("train", "test") if any(os.path.isfile(os.path.join(path, s + e)) for e in LOCAL_EXTENSIONS)
        )
    return ("train",)  # a single file or a hub id: its train split, held out below


def load_task_splits(data_cfg) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for config.DataConfig: task is a preset, hub id or path.

    A source with train and test splits uses both (test prompt_ids are offset past train's so ids stay unique);
    a single-split source is shuffled with data_cfg.seed and its first num_test rows are held out."""
    task = data_cfg.task
    fields = None if task.lower() in PRESETS else FieldMap(data_cfg.question_field, data_cfg.answer_field)
    splits = _available_splits(task)
    if "train" in splits and "test" in splits:
        train = load_math_dataset(task, "train", fields, data_cfg.on_bad_row).to_list()
        test = load_math_dataset(task, "test", fields, data_cfg.on_bad_row).to_list()
        offset = max(row["prompt_id"] for row in train) + 1
        return train, [{**row, "prompt_id": row["prompt_id"] + offset} for row in test]
    rows = load_math_dataset(task, splits[0], fields, data_cfg.on_bad_row).to_list()
    random.Random(data_cfg.seed).shuffle(rows)
    if data_cfg.num_test <= 0:
        return rows, []
    num_test = min(data_cfg.num_test, len(rows) - 1)
    if num_test < 1:
        raise DataError(f"{task}: {len(rows)} usable rows cannot be split into train and held-out sets")
    return rows[num_test:], rows[:num_test]


def chat_prompt(tokenizer, question: str, instruction: str = INSTRUCTION) -> str:
    """The text the policy sees: the tokenizer's chat template when it has one, else a plain Q/A template.
    Either way the model is told to put its final answer in \\boxed{} (what reward_math extracts first)."""
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"chat_prompt needs a non-empty question string, got {question!r}")
    content = f"{question.strip()}\n{instruction}" if instruction else question.strip()
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return f"Question: {content}\nAnswer:"
