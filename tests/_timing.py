"""Per-file wall and CPU time of a test run, for telling what a change to the suite bought.

Enabled by ``DPTRAIN_TEST_TIMING=<path>`` (off otherwise; it costs a walk of /proc per test)::

    DPTRAIN_TEST_TIMING=/tmp/t.tsv .venv/bin/python -m pytest -q -p no:cacheprovider tests
    .venv/bin/python tests/_timing.py /tmp/t.tsv            # the table, slowest first

Wall time alone misleads on a shared machine (it is mostly waiting when others compute), so
each test's CPU time is measured too: user+system time of the pytest process and of every
process under it. A process's own counters plus its ``cutime``/``cstime`` (what its reaped
children used) in /proc/<pid>/stat cover the ranks a fork server started and reaped, which
``getrusage(RUSAGE_CHILDREN)`` of the pytest process would not see until the server exits.
A process that was orphaned (re-parented to init) before the end of a test is not counted.

Under pytest-xdist every worker writes ``<path>.<worker id>``; the table merges them.
``DPTRAIN_TEST_TIMING_BY=test`` makes one row per test instead of per file.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, seconds of CPU: own + reaped children), for every process we can read."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields follow the last ')'.
        fields = data[data.rindex(b")") + 2:].split()
        ppid = int(fields[1])
        utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        out[int(name)] = (ppid, (utime + stime + cutime + cstime) / _TICK)
    return out


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds used so far by ``root`` (default: this process) and every live process under it."""
    root = os.getpid() if root is None else root
    stats = _proc_stats()
    children = defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


class TimingPlugin:
    """Adds up wall and CPU time per test file; writes one ``file<TAB>tests<TAB>wall<TAB>cpu`` line each."""

    def __init__(self, path: str):
        self.path = path
        self.per_test = os.environ.get("DPTRAIN_TEST_TIMING_BY") == "test"
        self.files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        # A hookwrapper: setup, call and teardown of the test (its fixtures included) are measured.
        w0, c0 = time.monotonic(), tree_cpu_seconds()
        yield
        entry = self.files[item.nodeid if self.per_test else item.nodeid.split("::", 1)[0]]
        entry[0] += 1
        entry[1] += time.monotonic() - w0
        entry[2] += tree_cpu_seconds() - c0

    def pytest_sessionfinish(self, session):
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = f"{self.path}.{worker}" if worker else self.path
        with open(path, "w") as f:
            for name, (n, wall, cpu) in sorted(self.files.items()):
                f.write(f"{name}\t{n}\t{wall:.2f}\t{cpu:.2f}\n")


def read_table(path: str) -> dict[str, list[float]]:
    """The table written by :class:`TimingPlugin` at ``path`` (and by its xdist workers), merged."""
    folder, base = os.path.split(os.path.abspath(path))
    files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for name in sorted(os.listdir(folder)):
        if name != base and not name.startswith(base + "."):
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                test_file, n, wall, cpu = line.rstrip("\n").rsplit("\t", 3)
                entry = files[test_file]
                entry[0] += int(n)
                entry[1] += float(wall)
                entry[2] += float(cpu)
    return files


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python tests/_timing.py TABLE   (a file written under DPTRAIN_TEST_TIMING)")
    files = read_table(argv[0])
    width = max(60, min(110, max((len(name) for name in files), default=0)))
    print(f"{'file':{width}s} {'tests':>5s} {'wall s':>8s} {'CPU s':>8s}")
    column = 2 if os.environ.get("DPTRAIN_TEST_TIMING_SORT") == "cpu" else 1  # slowest first, by CPU or wall
    for name, (n, wall, cpu) in sorted(files.items(), key=lambda kv: -kv[1][column]):
        print(f"{name[:width]:{width}s} {n:5d} {wall:8.1f} {cpu:8.1f}")
    n, wall, cpu = (sum(v[i] for v in files.values()) for i in range(3))
    print(f"{'total':{width}s} {int(n):5d} {wall:8.1f} {cpu:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
