"""`@pytest.mark.alone`: a test that times the wall clock runs with no other test beside it.

Under pytest-xdist (`-n 2`, as .ci/run runs the suite) every test holds a shared lock and an `alone` test an
exclusive one, for its whole protocol (set-up, call, tear-down: a module fixture's run counts). A gate taken first
makes it fair: once an `alone` test waits, no new test starts until it has run. Without xdist this costs nothing."""

import fcntl
import os
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs with no other test beside it (it times the wall clock)")


def _lock_files() -> tuple[Path, Path] | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one id shared by the workers of one run
    if run is None:
        return None
    base = Path(tempfile.gettempdir()) / f"hexrl-tests-{run}"
    return base.with_suffix(".gate"), base.with_suffix(".room")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    files = _lock_files()
    if files is None:
        yield
        return
    gate, room = (open(f, "a") for f in files)  # noqa: SIM115 (closed below, after the test)
    alone = item.get_closest_marker("alone") is not None
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        for f in (room, gate):
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
