"""Shared memory inside each node of a job across nodes (dptrain/_shm/nodes.py).

Two network namespaces are two nodes (their own network, as a real second machine; see
benchmarks/netlink.py), two ranks in each. Root and iproute2 are needed; without them the
test is skipped with the reason.
"""

import os
import re
import time

import pytest

from benchmarks import netlink
from dptrain._shm.nodes import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "node_shm.py")
KILL = os.path.join(ROOT, "tests", "scripts", "node_shm_kill.py")


def test_the_layout_needs_two_nodes_of_the_same_size_of_at_least_two():
    assert layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert layout(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]  # ranks need not be numbered by node
    assert layout(["a", "a", "a", "a"]) is None  # one node: the flat shared-memory group does it
    assert layout(["a", "b", "c"]) is None  # one rank per node: nothing to share
    assert layout(["a", "a", "b"]) is None  # uneven nodes


def _run(env_extra, script=SCRIPT, ok=True):
    reason = netlink.unavailable()
    if reason:
        pytest.skip(f"two-namespace link not available: {reason}")
    env = dict(os.environ, STEPS="4", **env_extra)
    with netlink.TwoNodeLink("10gbit") as link:
        try:
            results = link.run([script], nproc_per_node=2, timeout_s=240, env=env)
        except TimeoutError as stuck:
            pytest.fail(f"the two-node job did not end; each node's last output: "
                        f"{[(o + e)[-6000:] for o, e in zip(stuck.outputs, stuck.errors)]}")
    out = "".join(r.stdout for r in results)
    if ok:
        assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
        return out
    return results


def test_two_nodes_of_two_ranks_sum_in_shared_memory_in_a_fixed_order_and_train_like_torch():
    out = _run({})
    assert sorted(re.findall(r"CHOICE rank (\d) node_groups (\w+)", out)) == [(str(r), "True") for r in range(4)]
    assert sorted(re.findall(r"PRIMITIVE rank (\d) bitwise (\w+)", out)) == [(str(r), "True") for r in range(4)]
    assert sorted(re.findall(r"REUSE rank (\d) (\w+)", out)) == [(str(r), "True") for r in range(4)]
    assert sorted(re.findall(r"REQUIRED rank (\d) (\w+)", out)) == [(str(r), "True") for r in range(4)]
    trained = re.findall(r"TRAINED rank (\d) maxdiff (\S+) replicas_identical (\w+)", out)
    assert len(trained) == 4
    for _, diff, identical in trained:
        assert identical == "True"
        assert float(diff) < 1e-5  # another summation order than gloo's ring: rounding only


def test_dptrain_shm_nodes_0_keeps_gloo():
    out = _run({"DPTRAIN_SHM_NODES": "0"})
    assert sorted(re.findall(r"CHOICE rank (\d) node_groups (\w+)", out)) == [(str(r), "False") for r in range(4)]
    assert "PRIMITIVE" not in out


def test_a_rank_that_dies_mid_all_reduce_ends_both_nodes_naming_it():
    shm_before = set(os.listdir("/dev/shm"))
    results = _run({}, script=KILL, ok=False)
    out, err = "".join(r.stdout for r in results), "".join(r.stderr for r in results)
    assert "CHOICE rank 3 node_groups True" in out
    assert "trained past" not in out
    assert [r.returncode != 0 for r in results] == [True, True]
    assert "rank 3 (local rank 1" in err and "exited with code 7" in err
    # No segment of this job is left. Only segment names count ("dptrain-<token>"; a recovery folder
    # is another job's), and a name seen once is looked for again: a job running beside this test
    # names its segments for the few ms of their construction only.
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("dptrain-")}
    if left:
        time.sleep(2)
        left &= set(os.listdir("/dev/shm"))
    assert not left
