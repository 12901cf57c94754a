import os
import sys

# Tests import helpers as `tests._dist`; ranks started by the harness need the same path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_report_header(config):
    # The fault-tolerance tests' kill points come from a fixed seed; say which, so a run can be repeated.
    from tests.test_fault_tolerance import POINTS, SEED

    return f"kill points (DPTRAIN_KILL_SEED={SEED}): " + ", ".join(f"rank {r} at batch {b}" for r, b in POINTS)


def pytest_configure(config):
    # DPTRAIN_TEST_TIMING=<path>: per-file wall and CPU time of the run (tests/_timing.py).
    path = os.environ.get("DPTRAIN_TEST_TIMING")
    if path:
        from tests._timing import TimingPlugin

        config.pluginmanager.register(TimingPlugin(path), "dptrain-timing")
