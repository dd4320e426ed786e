"""The docs and code speak of the project as it is: no numbered history of earlier runs (that lives in git)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# narrations of how the project was built, not of what it does
HISTORY = re.compile(r"\bsessions? \d|\bthe issue'?s\b|\blent for \d+ min|\bsuperseded\b|\bCI failure of\b", re.I)


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def test_no_numbered_history_in_docs_and_code():
    files = [f for f in tracked("*.md", "*.py") if f != Path(__file__).resolve()]  # its examples below match
    assert any(f.name == "README.md" for f in files)  # the scan sees the tree
    hits = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for f in files
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, "history belongs in git, not in the docs:\n" + "\n".join(hits)


def test_the_history_pattern_catches_what_it_is_for():
    for text in ("Session 7: 1.79x", "lent for 15 minutes in session 8", "the issue's workload", "superseded"):
        assert HISTORY.search(text), text
    for text in ("a rollout session", "the issue tracker", "sessions of training"):
        assert not HISTORY.search(text), text
