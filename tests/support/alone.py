"""`@pytest.mark.alone`: a test that times the wall clock runs with no other test beside it.

Under pytest-xdist (`-n 2`, as .ci/run runs the suite) every test holds a shared lock and an `alone` test an
exclusive one, for its whole protocol (set-up, call, tear-down: a module fixture's run counts). A gate taken first
makes it fair: once an `alone` test waits, no new test starts until it has run. Waiting for the other worker's test
to end costs that worker's time, so a module's `alone` tests run first in it and one after another keep the lock:
one wait per module, not per test. Without xdist this costs nothing."""

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

_kept = None  # (gate, room) an `alone` test left locked for the next one on this worker


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs with no other test beside it (it times the wall clock)")


def _is_alone(item) -> bool:
    return item.get_closest_marker("alone") is not None


def pytest_collection_modifyitems(items):
    first_seen: dict[str, int] = {}
    for it in items:
        first_seen.setdefault(it.nodeid.split("::")[0], len(first_seen))
    # stable: modules keep their order, and so do the tests on each side of the split
    items.sort(key=lambda it: (first_seen[it.nodeid.split("::")[0]], not _is_alone(it)))


def _lock_files() -> tuple[Path, Path] | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one id shared by the workers of one run
    if run is None:
        return None
    base = Path(tempfile.gettempdir()) / f"hexrl-tests-{run}"
    return base.with_suffix(".gate"), base.with_suffix(".room")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _kept
    files = _lock_files()
    if files is None:
        yield
        return
    alone = _is_alone(item)
    if _kept is not None:  # the last test was `alone` and so is this one (see below): the lock is held already
        (gate, room), _kept = _kept, None
    else:
        gate, room = (open(f, "a") for f in files)  # noqa: SIM115 (closed below, after the test)
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if alone and nextitem is not None and _is_alone(nextitem):
            _kept = (gate, room)
        else:
            for f in (room, gate):
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
