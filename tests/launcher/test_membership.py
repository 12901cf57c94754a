"""Elastic membership in the rendezvous store: who takes part in each attempt, in-process.

Launchers are threads here, each with its own client of one store; the test across two
network namespaces (tests/launcher/test_elastic.py) runs the same protocol between real launchers.
"""

import datetime
import threading

import pytest
from torch import distributed as dist

from dptrain.launcher.membership import Elastic, Membership
from dptrain.launcher.rendezvous import free_port


@pytest.fixture
def store():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    yield lambda: dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=20))
    del server


def _node(store, node, lines, nproc=2, min_nodes=1, max_nodes=3, join_timeout=0.5, timeout=10.0):
    return Elastic(store(), node, nproc, min_nodes, max_nodes, join_timeout, timeout, lines.append, lambda: None)


def _in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_all_nodes_join_and_get_ranks_in_node_order(store):
    lines = []
    nodes = [_node(store, n, lines, nproc=n + 1) for n in (0, 2, 1)]
    threads = [_in_thread(e.join, 0) for e in nodes[1:]]
    mine = nodes[0].join(0)
    for t, _ in threads:
        t.join(10)
    two, one = (out["value"] for _, out in threads)
    assert mine == Membership(node_rank=0, rank_base=0, num_nodes=3, world_size=6, nodes=(0, 1, 2))
    assert one == Membership(node_rank=1, rank_base=1, num_nodes=3, world_size=6, nodes=(0, 1, 2))
    assert two == Membership(node_rank=2, rank_base=3, num_nodes=3, world_size=6, nodes=(0, 1, 2))
    assert lines == []  # everyone came: nothing to report


def test_a_late_node_waits_and_is_admitted_at_the_next_restart(store):
    lines = []
    coordinator, late = _node(store, 0, lines, max_nodes=2), _node(store, 1, lines, max_nodes=2)
    assert coordinator.join(0).world_size == 2  # alone after the join timeout
    assert "attempt 0 runs on 1 of at most 2 nodes (node(s) 0), 2 rank(s)" in lines[-1]
    assert late.first_attempt() == 0 and late.join(0) is None  # attempt 0 started without it
    waiting, result = _in_thread(late.wait_for_next, 0)
    waiting.join(0.5)
    assert waiting.is_alive()  # no restart yet: it keeps waiting
    coordinator.store.set("launcher/failed/0", "on node 0: rank 0 exited with code 1")
    waiting.join(10)
    assert result["value"] is True
    joining, result = _in_thread(late.join, 1)
    assert coordinator.join(1).nodes == (0, 1)
    joining.join(10)
    assert result["value"] == Membership(node_rank=1, rank_base=2, num_nodes=2, world_size=4, nodes=(0, 1))


def test_a_node_left_out_ends_when_the_job_ends(store):
    lines = []
    coordinator, late = _node(store, 0, lines, max_nodes=2), _node(store, 1, lines, max_nodes=2)
    coordinator.join(0)
    assert late.join(0) is None
    coordinator.finish()
    assert late.wait_for_next(0) is False
    assert "node 1 was not admitted to attempt 0" in lines[-1]


def test_fewer_nodes_than_the_minimum_is_an_error_on_every_node(store):
    lines = []
    coordinator = _node(store, 0, lines, min_nodes=2, max_nodes=2, join_timeout=0.2, timeout=0.6)
    with pytest.raises(ValueError, match=r"only 1 node\(s\) joined attempt 0 within \d+s, fewer than the 2 that "
                                         r"--nnodes 2:2 needs"):
        coordinator.join(0)
    with pytest.raises(ValueError, match="fewer than the 2"):
        _node(store, 1, lines, min_nodes=2, max_nodes=2).join(0)


def test_two_nodes_with_one_node_rank_are_reported(store):
    lines = []
    nodes = [_node(store, n, lines, max_nodes=3) for n in (0, 1, 1)]
    threads = [_in_thread(e.join, 0) for e in nodes[1:]]
    threads[0][0].join(0.2)
    members = nodes[0].join(0)
    for t, _ in threads:
        t.join(10)
    assert members.nodes == (0, 1) and sorted(out["value"] is None for _, out in threads) == [False, True]
    assert "two launchers use --node-rank 1" in lines[0]
