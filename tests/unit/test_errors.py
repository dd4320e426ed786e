"""Every concept's error derives from HexrlError, so the train script ends a run on it with one line and its exit
code; nothing it must catch is listed by hand."""

import importlib
import inspect
from pathlib import Path

import pytest

from errors import HexrlError
from parallel.channel import Aborted

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("parallel", "planner", "cpu_bench")
RUNTIME = sorted(ROOT.glob("*.py")) + [p for d in PACKAGES for p in sorted((ROOT / d).glob("*.py"))]


def defined_exceptions(module) -> list[type]:
    return [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if c.__module__ == module.__name__ and issubclass(c, BaseException)
    ]


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_error_type_derives_from_hexrl_error(path):
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    module = importlib.import_module(name)
    for exc in defined_exceptions(module):
        if exc is Aborted:  # the head's stop signal: the head reports why
            continue
        assert issubclass(exc, HexrlError), f"{name}.{exc.__name__} does not derive from errors.HexrlError"


def test_the_concepts_have_their_errors():
    found = {
        c.__name__
        for p in RUNTIME
        for c in defined_exceptions(importlib.import_module(".".join(p.relative_to(ROOT).with_suffix("").parts)))
    }
    for name in ("ConfigError", "PlanError", "SpecError", "DataError", "StalenessError", "CheckpointError"):
        assert name in found
