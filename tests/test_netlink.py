"""The two-namespace link harness of benchmarks/netlink.py, at a small scale (root, Linux).

A link shaped to 20 Mbit/s makes communication dominate a small MLP: ``compression="auto"``
must choose PowerSGD there, and PowerSGD with one bucket per layer must keep the replicas
identical over several runs (its collectives issued in one order on both nodes, checked by
``DPTRAIN_DEBUG=1``). One job does all of it: starting Python and torch on two nodes costs
more than the training. The namespaces are gone afterwards, also when the block raises.
"""

import os
import re
import subprocess
import threading
import time

import pytest

from benchmarks import netlink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_compressed.py")


@pytest.fixture(scope="module")
def usable():
    reason = netlink.unavailable()
    if reason:
        pytest.skip(f"two-namespace link not available: {reason}")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _digests(results, run):
    found = {}
    for r in results:
        for rank, choice, digest in re.findall(rf"rank (\d) run {run} \w+ choice (\S+) digest (\w+)", r.stdout):
            found[rank] = (choice, digest)
    return found


def test_link_is_shaped_used_and_removed(usable):
    with netlink.TwoNodeLink("20mbit") as link:
        names = link.namespaces
        assert all(n in _namespaces() for n in names)
        results = link.run([SCRIPT, "auto:1:14", "powersgd:3"], timeout_s=150, env=dict(os.environ, DPTRAIN_DEBUG="1"))
        stats = link.qdisc_stats(0)
    assert not any(n in _namespaces() for n in names)
    assert "tbf" in stats and "rate 20Mbit" in stats
    assert int(re.search(r"Sent (\d+) bytes", stats).group(1)) > 2_000_000  # the gradients went through it
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert 'compression="auto" chose PowerSGD rank 4 (2 nodes' in results[0].stdout, results[0].stdout
    for run in range(4):  # run 0: auto; 1-3: PowerSGD with a bucket per layer
        d = _digests(results, run)
        assert set(d) == {"0", "1"} and d["0"] == d["1"], (run, d)
        assert d["0"][0] == "powersgd" if run == 0 else d["0"][0] == "None"


def test_link_is_removed_when_the_block_raises(usable):
    with pytest.raises(RuntimeError, match="boom"):
        with netlink.TwoNodeLink("100mbit") as link:
            names = link.namespaces
            raise RuntimeError("boom")
    assert not any(n in _namespaces() for n in names)


def test_a_stopped_run_leaves_no_process_behind(usable):
    # Stop the link while a job runs: its launchers and their ranks all go. A rank is a child
    # of its launcher, in another process group: a SIGKILL to the launcher alone left it behind.
    sleepy = os.path.join(ROOT, "tests", "scripts", "sleepy.py")
    with netlink.TwoNodeLink("100mbit") as link:
        job = threading.Thread(target=link.run, args=([sleepy],), kwargs={"timeout_s": 120}, daemon=True)
        job.start()
        pids: list[str] = []
        deadline = time.monotonic() + 60
        while len(pids) < 4 and time.monotonic() < deadline:  # a launcher and a rank per node
            time.sleep(0.5)
            pids = [p for n in link.namespaces for p in subprocess.run(
                ["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()]
        assert len(pids) >= 4, f"the job did not start within 60s: {pids}"
        link.close()
        job.join(30)
    assert not job.is_alive()
    left = [pid for pid in pids if _running(pid)]
    assert not left, f"still running after the link closed: {left}"


def _running(pid: str) -> bool:
    # A killed rank whose launcher died first is re-parented to PID 1, and in a container PID 1
    # may never reap it: a zombie still answers kill(pid, 0) but runs nothing and holds no
    # resources, so it counts as gone. Reading /proc tells the two apart.
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_delay_needs_netem(usable):
    ok, why = netlink.netem_status()
    if ok:
        with netlink.TwoNodeLink("100mbit", delay="1ms") as link:
            assert "delay" in subprocess.run(link.exec_argv(0, ["tc", "qdisc", "show"]), capture_output=True,
                                             text=True).stdout
    else:
        assert "netem is not available" in why
        with pytest.raises(netlink.LinkError, match="netem is not available"):
            netlink.TwoNodeLink("100mbit", delay="1ms").__enter__()


def test_rates_are_checked():
    assert netlink.rate_bits_per_s("1gbit") == 1e9 and netlink.rate_bits_per_s("2.5Mbit") == 2.5e6
    with pytest.raises(netlink.LinkError, match="write it like 1gbit"):
        netlink.rate_bits_per_s("fast")
