"""Hierarchical DiLoCo on two nodes (network namespaces) of two ranks each: DDP inside each
node, the outer exchange between the nodes, one rail per local rank. Root and iproute2 are
needed; without them the test is skipped with the reason."""

import os
import re

import pytest

from benchmarks import netlink

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "node_diloco.py")


def test_two_nodes_of_two_ranks_sync_between_nodes_and_match_the_flat_arithmetic():
    reason = netlink.unavailable()
    if reason:
        pytest.skip(f"two-namespace link not available: {reason}")
    with netlink.TwoNodeLink("10gbit") as link:
        results = link.run([SCRIPT], nproc_per_node=2, timeout_s=240, env=dict(os.environ))
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    out = "".join(r.stdout for r in results)
    assert sorted(re.findall(r"TOPOLOGY rank (\d) replicas (\d) node_size (\d)", out)) == [
        (str(r), "2", "2") for r in range(4)]
    synced = re.findall(r"SYNCED rank (\d) at_sync (\w+) between (\w+) maxdiff (\S+)", out)
    assert len(synced) == 4
    for _, at_sync, between, diff in synced:
        assert at_sync == "True" and between == "True"
        assert float(diff) < 1e-5  # DDP's mean of two half-batch gradients against one whole-batch gradient
    for _, hier, flat, params in re.findall(r"BYTES rank (\d) hierarchical (\d+) flat (\d+) params (\d+)", out):
        n = int(params)
        # Each rank sends its half of the model across the rail of 2 nodes (fp32 ring: 2 (n-1)/n B),
        # instead of a ring share of the whole model among 4 replicas.
        assert int(hier) == 2 * 1 * (4 * -(-n // 2)) // 2
        assert int(flat) == 2 * 3 * 4 * n // 4
