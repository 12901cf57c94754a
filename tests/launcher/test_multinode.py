"""Two "nodes" as Linux network namespaces joined by a veth pair, one rank each.

Each namespace has its own address; the launcher of node 0 hosts the rendezvous on its
address only, and the job's weights equal those of the same job on one node.
"""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_toy.py")
ADDR = ("10.213.7.1", "10.213.7.2")  # exist only inside the namespaces this test creates


def _sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _netns_unavailable() -> str | None:
    if not sys.platform.startswith("linux") or shutil.which("ip") is None:
        return "needs Linux with iproute2's `ip`"
    probe = f"dptprobe{uuid.uuid4().hex[:6]}"
    out = _sh("ip", "netns", "add", probe)
    if out.returncode != 0:
        return f"cannot create network namespaces here ({out.stderr.strip()}); run as root"
    _sh("ip", "netns", "del", probe)
    return None


@pytest.fixture
def two_nodes():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    names = (f"dpta{tag}", f"dptb{tag}")
    veth = (f"va{tag}", f"vb{tag}")
    try:
        for n in names:
            assert _sh("ip", "netns", "add", n).returncode == 0
        assert _sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]).returncode == 0
        for n, v, a in zip(names, veth, ADDR):
            for cmd in (("ip", "link", "set", v, "netns", n),
                        ("ip", "-n", n, "addr", "add", f"{a}/24", "dev", v),
                        ("ip", "-n", n, "link", "set", v, "up"),
                        ("ip", "-n", n, "link", "set", "lo", "up")):
                out = _sh(*cmd)
                assert out.returncode == 0, (cmd, out.stderr)
        yield names
    finally:
        for n in names:
            _sh("ip", "netns", "del", n)


def _launch(ns, node_rank, port, nproc=1, script=SCRIPT):
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "dptrain", "run", "--nnodes", "2",
           "--node-rank", str(node_rank), "--nproc-per-node", str(nproc), "--master-addr", ADDR[0],
           "--master-port", str(port), "--timeout", "30", script]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _run_both(nodes) -> list[tuple[str, str]]:
    """(stdout, stderr) of each node's launcher, after checking that each exited 0."""
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=120))
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err
    return outs


def _digests(stdout: str) -> set[str]:
    return {line.rsplit("digest ", 1)[1] for line in stdout.splitlines() if "digest" in line}


def test_two_namespace_nodes_train_like_one_node(two_nodes):
    port = 29611
    outs = _run_both([_launch(two_nodes[0], 0, port), _launch(two_nodes[1], 1, port)])
    assert "[rank0] rank 0 world 2" in outs[0][0] and "[rank1] rank 1 world 2" in outs[1][0]
    # Without a secret, each launcher says once that the job is open to its network, and how to close it.
    warning = (f"dptrain run: warning: this job spans nodes without a secret, so anything that can reach "
               f"{ADDR[0]}:{port} can read its rendezvous store, stop it, or join it as a rank. Give every node the "
               f"same secret: --secret-file FILE")
    assert [err.count(warning) for _, err in outs] == [1, 1], outs
    multi = _digests(outs[0][0]) | _digests(outs[1][0])
    single = subprocess.run([sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", SCRIPT],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert single.returncode == 0, single.stderr
    assert len(multi) == 1 and multi == _digests(single.stdout)


def test_node_0_keeps_the_store_up_until_every_node_has_finished(two_nodes):
    # Node 0's launcher hosts the store. It used to close it as soon as its own rank exited;
    # node 1, whose rank was still finishing, then found the store gone, stopped its rank as if
    # node 0 had failed, and exited 1 after a successful run.
    script = os.path.join(ROOT, "tests", "scripts", "late_finisher.py")
    outs = _run_both([_launch(two_nodes[0], 0, 29613, script=script), _launch(two_nodes[1], 1, 29613, script=script)])
    assert "[rank0] rank 0 finished, sum 2" in outs[0][0] and "[rank1] rank 1 finished, sum 2" in outs[1][0]
    assert "unreachable" not in outs[1][1]


def test_torchrun_c10d_style_the_same_command_on_every_node(two_nodes):
    # torchrun's multi-node recipe: every node runs one identical command, without --node-rank.
    # The node that owns the endpoint's address hosts the store and is node 0; the other is 1.
    script = os.path.join(ROOT, "tests", "scripts", "late_finisher.py")
    cmd = [sys.executable, "-m", "dptrain", "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"{ADDR[0]}:29614", "--rdzv-id", "job42", "--timeout", "30", script]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["LATE_S"] = "0"
    # node 1 first: it waits for node 0's store, then takes the next number
    nodes = [subprocess.Popen(["ip", "netns", "exec", ns] + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env) for ns in (two_nodes[1], two_nodes[0])][::-1]
    outs = _run_both(nodes)
    assert "[rank0] rank 0 finished, sum 2, run job42" in outs[0][0], outs[0]
    assert "[rank1] rank 1 finished, sum 2, run job42" in outs[1][0], outs[1]
