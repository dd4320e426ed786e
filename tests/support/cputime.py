"""`--cpu-durations=N`: the N tests that cost the most CPU (user + sys of pytest and of every process under it:
torchrun agents and their ranks, spawned workers, CLIs, long-lived helpers such as the reward verifier), beside
their wall time. On a shared machine wall time follows the neighbours' load; CPU seconds follow the test."""

import os
import resource
import time
from pathlib import Path

import pytest

_costs: list[tuple[float, float, str]] = []


def _live_descendants_cpu_s() -> float:
    """utime + stime of the processes under this one that are still running (the rest are in RUSAGE_CHILDREN)."""
    parent, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)] = int(fields[1])
            cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    me, total = os.getpid(), 0.0
    for pid in cpu:
        p = parent.get(pid)
        while p and p != me:
            p = parent.get(p)
        total += cpu[pid] if p == me else 0.0
    return total


def _cpu_s() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage) + _live_descendants_cpu_s()


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N", help="show the N costliest tests in CPU s")


_started: dict[str, tuple[float, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _started[item.nodeid] = (_cpu_s(), time.perf_counter())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and item.nodeid in _started:  # the cost rides on the report: xdist sends it home
        cpu, wall = _started.pop(item.nodeid)
        outcome.get_result().user_properties.append(("cost_s", (_cpu_s() - cpu, time.perf_counter() - wall)))


def pytest_runtest_logreport(report):
    for name, value in report.user_properties if report.when == "teardown" else ():
        if name == "cost_s":
            _costs.append((*value, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _costs:
        return
    total_cpu, total_wall = sum(c for c, _, _ in _costs), sum(w for _, w, _ in _costs)
    terminalreporter.write_sep("=", f"costliest {n or len(_costs)} tests in CPU seconds (setup + call + teardown)")
    for cpu, wall, nodeid in sorted(_costs, reverse=True)[: n or None]:
        terminalreporter.write_line(f"{cpu:8.1f} cpu s {wall:8.1f} wall s  {nodeid}")
    terminalreporter.write_line(f"{total_cpu:8.1f} cpu s {total_wall:8.1f} wall s  all {len(_costs)} tests")
