"""Two "nodes" on one machine: network namespaces joined by a veth pair shaped to a given rate.

Most multi-node jobs outside big clusters talk over ordinary Ethernet, where the gradient
all-reduce, not compute, sets the pace. This harness reproduces such a link on one Linux
machine (root, iproute2): two network namespaces, one veth pair between them, each end's
egress shaped by a token bucket (``tc qdisc ... tbf``) to ``--rate``, optionally delayed by
``netem`` (one way, so the round trip gains twice ``--delay``). It runs a program across
them as two nodes with ``dptrain run --nnodes 2`` (node 0 hosts the rendezvous on its own
address) and removes everything afterwards -- on success, on an error, on Ctrl-C and on
SIGTERM. The addresses exist only inside the namespaces; nothing on the host changes.

    sudo python benchmarks/netlink.py --rate 1gbit -- benchmarks/compression.py --steps 20
    sudo python benchmarks/netlink.py --rate 100mbit --delay 5ms --nproc-per-node 2 -- train.py --lr 0.1
    sudo python benchmarks/netlink.py --cleanup     # remove namespaces a SIGKILLed run left behind

From Python (tests, other benchmarks)::

    from benchmarks.netlink import TwoNodeLink
    with TwoNodeLink(rate="1gbit") as link:
        results = link.run(["benchmarks/compression.py", "--steps", "5"])
    assert all(r.returncode == 0 for r in results)

netem is a kernel module that some kernels (and most containers' kernels) lack; the harness
detects it (:func:`netem_status`) and refuses ``--delay`` with the reason instead of running
an undelayed link that claims a delay.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "dptlink"  # namespace names: dptlink-<pid>-<tag>-<node>
SUBNET = "10.213.9"  # node k has SUBNET.(k+1)/24, inside its namespace only
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$", re.IGNORECASE)
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class LinkError(RuntimeError):
    """The link could not be built (not root, no iproute2, no netem for a delay, bad rate)."""


@dataclass
class NodeResult:
    """What one node's ``dptrain run`` left: its exit code and its whole output."""

    node: int
    returncode: int
    stdout: str
    stderr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(("ip",) + args, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise LinkError(f"`ip {' '.join(args)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def rate_bits_per_s(rate: str) -> float:
    """``"1gbit"`` -> 1e9. tc's units (bit, kbit, mbit, gbit, tbit; decimal).

    Raises:
        LinkError: a rate tc would not read the same way.
    """
    m = _RATE.match(rate.strip())
    if not m:
        raise LinkError(f"rate {rate!r} is not a tc rate; write it like 1gbit, 100mbit or 500kbit")
    bits = float(m.group(1)) * _BITS[m.group(2).lower()]
    if bits <= 0:
        raise LinkError(f"rate {rate!r} must be positive")
    return bits


def unavailable() -> str | None:
    """Why two namespaces cannot be built here, or None when they can (Linux, iproute2, root)."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces; this is {sys.platform}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` on PATH (apt-get install iproute2)"
    probe = f"{PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"cannot create network namespaces here ({out.stderr.strip()}); run as root"
    _ip("netns", "del", probe, check=False)
    return None


def netem_status() -> tuple[bool, str]:
    """(whether ``tc qdisc ... netem`` works in this kernel, a one-line explanation)."""
    ns = f"{PREFIX}-probe-{uuid.uuid4().hex[:6]}"
    if _ip("netns", "add", ns, check=False).returncode != 0:
        return False, "cannot create a namespace to probe netem (not root?)"
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                              "delay", "1ms"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return True, "netem available"
        return False, f"netem is not available in this kernel ({out.stderr.strip()}); links get no added delay"
    finally:
        _ip("netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete namespaces of this harness whose creating process is gone; returns their names."""
    out = _ip("netns", "list", check=False)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(rf"^{PREFIX}-(\d+)-", name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its harness still runs: not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


class TwoNodeLink:
    """Two namespaces joined by one veth pair, each direction shaped to ``rate``.

    Args:
        rate: tc rate of each direction, e.g. ``"1gbit"`` (default), ``"100mbit"``.
        delay: one-way netem delay (``"5ms"``); None for none. Default None.
        burst_bytes: token bucket depth; default: 1 ms at ``rate``, at least 64 KiB plus one
            frame (a veth hands over segmentation-offloaded packets of up to 64 KiB).
        queue_ms: the shaper's queue, in milliseconds at ``rate`` (at least 512 KiB, so a
            slow link does not drop the 64 KiB segments TCP hands a veth and stall on
            retransmission timeouts). Default 20.

    Raises:
        LinkError: not root / no iproute2 (see :func:`unavailable`), a malformed rate or
            delay, or a delay on a kernel without netem.

    Example:
        >>> with TwoNodeLink("100mbit") as link:
        ...     print(link.describe())
        ...     link.run(["train.py", "--epochs", "1"])
    """

    def __init__(self, rate: str = "1gbit", delay: str | None = None, burst_bytes: int | None = None,
                 queue_ms: float = 20.0) -> None:
        self.rate = rate
        self.rate_bits = rate_bits_per_s(rate)
        if delay is not None and not _DELAY.match(delay.strip()):
            raise LinkError(f"delay {delay!r} is not a tc time; write it like 5ms or 200us")
        self.delay = delay
        self.burst_bytes = burst_bytes or max(int(self.rate_bits / 8 / 1000), 64 * 1024 + 1600)
        self.queue_ms = queue_ms
        self.queue_bytes = max(int(self.rate_bits / 8 * queue_ms / 1000), 512 * 1024)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.namespaces = (f"{PREFIX}-{tag}-0", f"{PREFIX}-{tag}-1")
        short = uuid.uuid4().hex[:8]
        self.veths = (f"dlk{short}a", f"dlk{short}b")  # interface names: 15 characters at most
        self.addrs = (f"{SUBNET}.1", f"{SUBNET}.2")
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "TwoNodeLink":
        reason = unavailable()
        if reason:
            raise LinkError(reason)
        if self.delay is not None:
            ok, why = netem_status()
            if not ok:
                raise LinkError(f"--delay {self.delay} asked for, but {why}; run without a delay")
        self._up = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addrs):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, veth)

    def _shape(self, ns: str, veth: str) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", str(self.burst_bytes), "limit", str(self.queue_bytes)]
        if self.delay is None:
            cmds = [["root"] + tbf]
        else:  # netem delays, tbf (its child) shapes what leaves the delay line
            cmds = [["root", "handle", "1:", "netem", "delay", self.delay], ["parent", "1:", "handle", "10:"] + tbf]
        for cmd in cmds:
            out = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth] + cmd,
                                 capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise LinkError(f"`tc qdisc add dev {veth} {' '.join(cmd)}` failed in {ns}: {out.stderr.strip()}")

    def close(self) -> None:
        """Stop every process in the namespaces and delete both (the veth pair goes with them).

        The launchers get SIGTERM first (each stops its ranks, as on Ctrl-C), then whatever is
        still inside a namespace -- a rank whose launcher died first included -- gets SIGKILL.
        """
        for p in self._procs:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                try:
                    p.wait(timeout=10)  # reap it: an unreaped launcher lingers as our zombie child
                except subprocess.TimeoutExpired:
                    pass
        self._procs = []
        if self._up:
            for ns in self.namespaces:
                _kill_namespace(ns)
                _ip("netns", "del", ns, check=False)
            self._up = False

    # ------------------------------------------------------------------ use
    def describe(self) -> str:
        """One line: the namespaces, addresses and shaping, for logs and RESULTS.md."""
        delay = f"netem delay {self.delay} each way" if self.delay else "no added delay"
        return (f"2 namespaces ({self.namespaces[0]}, {self.namespaces[1]}), veth {self.addrs[0]} <-> "
                f"{self.addrs[1]}, tbf {self.rate} burst {self.burst_bytes} B queue {self.queue_bytes} B "
                f"each direction, {delay}")

    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]] + list(argv)

    def run(self, program: Sequence[str], nproc_per_node: int = 1, port: int = 29500, timeout_s: float = 1800,
            env: dict | None = None, echo: bool = False, run_args: Sequence[str] = ()) -> list[NodeResult]:
        """Run ``program`` (a script and its arguments, or ``-m module ...``) as two nodes.

        Each node is ``dptrain run --nnodes 2 --node-rank K --nproc-per-node N
        --master-addr <node 0's address>`` inside its namespace. Returns both nodes' results
        (node 0 first); ``timeout_s`` stops both and raises ``TimeoutError`` (its ``outputs``:
        what each node printed).
        """
        environ = dict(os.environ if env is None else env)
        environ.pop("GLOO_SOCKET_IFNAME", None)  # the launcher picks the veth that routes to node 0
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, environ.get("PYTHONPATH")) if p)
        outputs: list[list[list[str]]] = [[[], []], [[], []]]
        threads = []
        for node in (0, 1):
            argv = [sys.executable, "-m", "dptrain", "run", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", str(nproc_per_node), "--master-addr", self.addrs[0],
                    "--master-port", str(port), *run_args, *program]
            p = subprocess.Popen(self.exec_argv(node, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=ROOT, env=environ, start_new_session=True)
            self._procs.append(p)
            for stream, sink in ((p.stdout, outputs[node][0]), (p.stderr, outputs[node][1])):
                t = threading.Thread(target=_pump, args=(stream, sink, echo, f"[node{node}] "), daemon=True)
                t.start()
                threads.append(t)
        deadline = time.monotonic() + timeout_s
        procs = list(self._procs[-2:])
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                error = TimeoutError(f"the two-node run did not finish within {timeout_s:g}s: {' '.join(program)}")
                error.outputs = ["".join(outputs[n][0]) for n in (0, 1)]  # what each node printed so far
                error.errors = ["".join(outputs[n][1]) for n in (0, 1)]  # ... and on its stderr
                raise error from None
        for t in threads:
            t.join(timeout=10)
        return [NodeResult(n, p.returncode, "".join(outputs[n][0]), "".join(outputs[n][1]))
                for n, p in enumerate(procs)]

    def qdisc_stats(self, node: int) -> str:
        """``tc -s qdisc show`` of node ``node``'s veth: bytes sent, drops, overlimits."""
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[node], "tc", "-s", "qdisc", "show", "dev",
                              self.veths[node]], capture_output=True, text=True, timeout=30)
        return out.stdout.strip()


def _kill_namespace(ns: str, wait_s: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` and wait until the namespace lists none.

    SIGKILL is delivered asynchronously: a process can still be exiting when ``kill`` returns,
    and a rank forked in the meantime would be missed, so this repeats until the list is empty
    (an exited process leaves the list at once, even while it waits, a zombie, to be reaped).
    """
    deadline = time.monotonic() + wait_s
    while True:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each node runs in its own session
    except ProcessLookupError:
        pass


def _pump(stream, sink: list, echo: bool, prefix: str) -> None:
    for line in stream:
        sink.append(line)
        if echo:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `with`, which removes the link


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Everything after -- is the program and its arguments.")
    ap.add_argument("--rate", default="1gbit", help="rate of each direction, tc syntax (default 1gbit)")
    ap.add_argument("--delay", default=None, help="one-way delay, e.g. 5ms (needs netem)")
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before both nodes are killed")
    ap.add_argument("--cleanup", action="store_true", help="only remove namespaces left by killed runs")
    ap.add_argument("program", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        ap.error("give the program to run after --, e.g. -- benchmarks/compression.py")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    cleanup_stale()
    try:
        with TwoNodeLink(args.rate, args.delay) as link:
            print(f"netlink: {link.describe()}", flush=True)
            results = link.run(program, nproc_per_node=args.nproc_per_node, timeout_s=args.timeout, echo=True)
    except LinkError as exc:
        print(f"netlink: error: {exc}", file=sys.stderr)
        return 2
    for r in results:
        if r.returncode != 0:
            print(f"netlink: node {r.node} exited with {r.returncode}\n{r.stderr[-3000:]}", file=sys.stderr)
    return max(abs(r.returncode) for r in results)


if __name__ == "__main__":
    sys.exit(main())
