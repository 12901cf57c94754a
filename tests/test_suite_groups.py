"""The suite's serial groups hold under pytest-xdist: every test of a group runs on one worker
(tests/conftest.py, [Note: the groups are the scheduler's, not markers]). They did not on pytest
9.2 with xdist's own loadgroup, and nothing failed: the namespace and kill tests simply ran side
by side on every worker."""
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import GROUPS, ROOT, xdist_group

pytest.importorskip("xdist")

# A stand-in suite: files at the paths of two groups' files and of ungrouped ones, each test a pass
# (no torch: three xdist workers start in a fraction of a second), scheduled by the suite's own hook.
FILES = {
    "tests/test_netlink.py": "namespaces",
    "tests/launcher/test_auth.py": "namespaces",
    "tests/test_clean_exit.py": "kills",
    "tests/launcher/test_membership.py": "kills",
    "tests/test_quick.py": None,
    "tests/parallel/test_other.py": None,
}
CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(ROOT, "tests", "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
"""


def test_the_groups_are_named_by_file():
    for path, group in FILES.items():
        assert xdist_group(f"{path}::test_x[a::b]") == group
    assert xdist_group("tests/launcher/test_warm_server.py::test_x") == "template-servers"
    assert all(path.startswith("tests/") and os.path.exists(os.path.join(ROOT, path))
               for files in GROUPS.values() for path in files)


def test_each_group_runs_on_one_worker_and_the_rest_spread(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for path in FILES:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(4)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DPTRAIN_TEST_TIMING"))}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup",
                          "-v", "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+)", out.stdout, re.M)
    assert len(ran) == 4 * len(FILES), out.stdout
    workers = {}
    for worker, nodeid in ran:
        path = nodeid.split("::", 1)[0]
        workers.setdefault(FILES[path] or path, set()).add(worker)
    assert len(workers["namespaces"]) == 1 and len(workers["kills"]) == 1, workers
    assert len(set().union(*workers.values())) > 1, workers  # the rest is not all on one worker
