"""tasks.py's real datasets: vendored GSM8K offline, field mappings over jsonl/json/parquet, the three gold formats, bad-row
policies, hub fallback, train/held-out splitting, and prompt formatting with and without a chat template."""

import json
import logging
import os
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tasks
from tasks import DataError, FieldMap, chat_prompt, load_math_dataset, load_task_splits

torch.set_num_threads(1)
GSM8K_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "data", "gsm8k")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


# --- GSM8K, vendored ------------------------------------------------------------------------------------------


def test_gsm8k_offline_test_split_matches_raw_file():
    ds = load_math_dataset("gsm8k", split="test")
    assert ds.column_names == ["prompt_id", "question", "answer"] and len(ds) == 1319
    with open(os.path.join(GSM8K_DIR, "test.jsonl")) as f:
        raw = [json.loads(line) for line in f]
    assert ds["prompt_id"] == list(range(1319))
    assert ds["question"] == [r["question"].strip() for r in raw]
    for gold, r in zip(ds["answer"], raw):
        final_line = r["answer"].strip().splitlines()[-1]
        assert final_line.startswith("#### ") and gold == final_line[5:].replace(",", "")
        assert gold.lstrip("-").isdigit()
    assert ds[0]["answer"] == "18"


def test_gsm8k_hub_failure_falls_back_to_vendored(monkeypatch, caplog):
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*args):
        raise ConnectionError("no network")

    monkeypatch.setattr(tasks, "_read_hub", unreachable)
    with caplog.at_level(logging.WARNING, logger="tasks"):
        ds = load_math_dataset("gsm8k", split="train", max_rows=10)
    assert len(ds) == 10 and "reading vendored" in caplog.text
    with pytest.raises(DataError, match="DeepScaleR-Preview-Dataset"):  # no vendored copy: a clear error
        load_math_dataset("deepscaler", split="train")
    with pytest.raises(ValueError, match="splits"):
        load_math_dataset("deepscaler", split="test")


def test_hub_id_with_field_mapping(monkeypatch):
    calls = []

    def fake_hub(hub_id, config, split):
        calls.append((hub_id, config, split))
        return list(enumerate([{"problem": "1+1?", "answer": "2"}, {"problem": "x?", "answer": None}], start=1))

    monkeypatch.setattr(tasks, "_read_hub", fake_hub)
    ds = load_math_dataset("someone/deepscaler-like", "train", FieldMap("problem", "answer"))
    assert calls == [("someone/deepscaler-like", None, "train")]
    assert ds.to_list() == [{"prompt_id": 0, "question": "1+1?", "answer": "2"}]


# --- local files, mappings and gold formats ---------------------------------------------------------------------


def test_local_jsonl_field_mapping_and_formats(tmp_path):
    plain = write_jsonl(tmp_path / "p.jsonl", [{"q": " What is 2+3? ", "a": 5}, {"q": "Half of 1?", "a": "\\frac12"}])
    ds = load_math_dataset(plain, fields=FieldMap("q", "a"))
    assert ds.to_list() == [
        {"prompt_id": 0, "question": "What is 2+3?", "answer": "5"},
        {"prompt_id": 1, "question": "Half of 1?", "answer": "\\frac12"},
    ]
    math_style = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"problem": "P1", "solution": "First $\\boxed{2}$ is wrong; so $x=\\boxed{\\frac{1}{\\sqrt{2}}}$."},
            {"problem": "P2", "solution": "The answer is $\\fbox{(1,2)}$"},
        ],
    )
    ds = load_math_dataset(math_style, fields=FieldMap("problem", "solution", "boxed"))
    assert ds["answer"] == ["\\frac{1}{\\sqrt{2}}", "(1,2)"]
    gsm_style = write_jsonl(tmp_path / "g.jsonl", [{"question": "Q", "answer": "2*500=1000\n#### 1,000"}])
    assert load_math_dataset(gsm_style, fields=FieldMap(answer_format="gsm8k"))["answer"] == ["1000"]
    with pytest.raises(ValueError, match="answer_format"):
        FieldMap(answer_format="latex")


def test_parquet_json_and_directory_splits(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    write_jsonl(tmp_path / "train.jsonl", rows[:3])
    with open(tmp_path / "all.json", "w") as f:
        json.dump(rows, f)
    from_parquet = load_math_dataset(str(tmp_path), split="test").to_list()
    from_json = load_math_dataset(str(tmp_path / "all.json")).to_list()
    assert from_parquet == from_json == [{"prompt_id": i, **r} for i, r in enumerate(rows)]
    assert len(load_math_dataset(str(tmp_path), split="train")) == 3
    with pytest.raises(FileNotFoundError, match="split 'validation'.*" + str(tmp_path)):
        load_math_dataset(str(tmp_path), split="validation")


def test_missing_path_is_named(tmp_path):
    missing = str(tmp_path / "nope" / "train.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist: " + missing):
        load_math_dataset(missing)


# --- bad rows -------------------------------------------------------------------------------------------------

BAD_ROWS = [
    {"question": "ok 1", "answer": "1"},
    {"question": "no answer"},
    "{not json",
    {"question": "", "answer": "3"},
    [1, 2],
    {"question": "ok 2", "answer": "2"},
    {"question": "x", "answer": True},
]


def test_on_bad_row_skip_counts_and_keeps_ids(tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with caplog.at_level(logging.WARNING, logger="tasks"):
        ds = load_math_dataset(path, on_bad_row="skip")
    assert ds.to_list() == [
        {"prompt_id": 0, "question": "ok 1", "answer": "1"},
        {"prompt_id": 5, "question": "ok 2", "answer": "2"},
    ]
    warnings = [r for r in caplog.records if r.name == "tasks"]
    assert len(warnings) == 1 and "skipped 5 of 7 rows" in warnings[0].getMessage()


def test_on_bad_row_fail_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.raises(DataError, match=f"{path}: row 2: missing field 'answer'"):
        load_math_dataset(path, on_bad_row="fail")
    only_json_error = write_jsonl(tmp_path / "j.jsonl", [BAD_ROWS[0], BAD_ROWS[2]])
    with pytest.raises(DataError, match="row 2: invalid JSON"):
        load_math_dataset(only_json_error, on_bad_row="fail")
    no_box = write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "P", "solution": "x = 3"}])
    with pytest.raises(DataError, match="row 1: field 'solution' has no \\\\boxed"):
        load_math_dataset(no_box, fields=FieldMap("problem", "solution", "boxed"), on_bad_row="fail")


def test_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", BAD_ROWS[:1])
    with pytest.raises(ValueError, match="on_bad_row"):
        load_math_dataset(path, on_bad_row="ignore")
    with pytest.raises(ValueError, match="no usable rows.*question='problem'"):
        load_math_dataset(path, fields=FieldMap("problem", "answer"))
    with pytest.raises(ValueError, match="max_rows"):
        load_math_dataset(path, max_rows=0)


# --- train / held-out splits for the config -----------------------------------------------------------------


def data_cfg(task, num_test=3, seed=0, question_field="question", answer_field="answer"):
    return SimpleNamespace(
        task=task,
        num_test=num_test,
        seed=seed,
        question_field=question_field,
        answer_field=answer_field,
        on_bad_row="skip",
    )


def test_load_task_splits_single_file_holds_out_by_seed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"p": f"q{i}", "s": str(i)} for i in range(20)])
    train, test = load_task_splits(data_cfg(path, 4, seed=1, question_field="p", answer_field="s"))
    again, _ = load_task_splits(data_cfg(path, 4, seed=1, question_field="p", answer_field="s"))
    other, _ = load_task_splits(data_cfg(path, 4, seed=2, question_field="p", answer_field="s"))
    assert len(test) == 4 and len(train) == 16 and train == again and train != other
    assert sorted(r["prompt_id"] for r in train + test) == list(range(20))
    assert all(r["answer"] == str(r["prompt_id"]) for r in train + test)


def test_load_task_splits_gsm8k_ids_unique():
    train, test = load_task_splits(data_cfg("gsm8k"))
    assert (len(train), len(test)) == (7473, 1319)
    ids = [r["prompt_id"] for r in train + test]
    assert len(set(ids)) == len(ids)


# --- prompts --------------------------------------------------------------------------------------------------


def tiny_tokenizer(chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def test_chat_prompt_with_and_without_chat_template():
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    chat = chat_prompt(tiny_tokenizer(template), "  What is 2+2? ")
    assert chat == f"<|user|>What is 2+2?\n{tasks.INSTRUCTION}<|end|><|assistant|>"
    plain = chat_prompt(tiny_tokenizer(), "What is 2+2?")
    assert plain == chat_prompt(None, "What is 2+2?") == f"Question: What is 2+2?\n{tasks.INSTRUCTION}\nAnswer:"
    assert "\\boxed{}" in tasks.INSTRUCTION
    with pytest.raises(ValueError, match="non-empty question"):
        chat_prompt(None, "   ")
