"""Time to the first step: from starting the launcher until every rank has joined the job.

``dptrain run`` against ``torchrun`` on a hello-world script, alternating runs (A B A B ...)
so that a drifting machine affects both alike; the median of each and the ratio of medians.
The script prints, on every rank, the wall time since the launcher started at three points:
the rank's Python started, torch imported, ``dptrain.init()`` returned (the job can take its
first step). The figure is the slowest rank's ``init`` time.

    .venv/bin/python benchmarks/first_step.py --runs 10 --nproc 2

``--nodes 2`` (root, Linux): two "nodes" as network namespaces joined by a veth pair (as in
``tests/launcher/test_multinode.py``), one ``dptrain run`` each, started together; a job with
a secret (``--secret-file``: node 0's gate, node 1's forwarder, the handshake) against the
same job without one, alternating. The figure is the slowest rank's ``init`` time of both nodes.

    .venv/bin/python benchmarks/first_step.py --nodes 2 --runs 10 --nproc 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HELLO = """
import os, time
t0 = float(os.environ["FIRST_STEP_T0"])
started = time.time() - t0
import torch
imported = time.time() - t0
import dptrain
dptrain.init()
print(f"FIRST_STEP {started:.3f} {imported:.3f} {time.time() - t0:.3f}", flush=True)
dptrain.shutdown()
"""


def one_run(cmd: list[str], script: str) -> tuple[float, float]:
    """(slowest rank's time to init, whole process wall time) of one launch."""
    t0 = time.time()
    env = {**os.environ, "FIRST_STEP_T0": repr(t0), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, script], capture_output=True, text=True, env=env, timeout=300)
    wall = time.time() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{done.stderr[-2000:]}")
    inits = [float(m.group(3)) for m in re.finditer(r"FIRST_STEP ([\d.]+) ([\d.]+) ([\d.]+)", done.stdout)]
    return max(inits), wall


def _times(stdout: str) -> list[tuple[float, float]]:
    """(time to init, seconds inside ``dptrain.init()``) of each rank that printed."""
    return [(float(m.group(3)), float(m.group(3)) - float(m.group(2)))
            for m in re.finditer(r"FIRST_STEP ([\d.]+) ([\d.]+) ([\d.]+)", stdout)]


def one_run_two_nodes(cmds: list[list[str]], script: str, ranks: int) -> tuple[float, float, float]:
    """(slowest rank's time to init over both nodes, wall time until both launchers exited, the
    longest ``dptrain.init()`` call: the part of it that the store's path costs)."""
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(FIRST_STEP_T0=repr(t0), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*cmd, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for cmd in cmds]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=300))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    wall = time.time() - t0
    inits = [t for out, _ in outs for t in _times(out)]
    if any(proc.returncode for proc in procs) or len(inits) != ranks:
        raise RuntimeError(f"{cmds[0]} failed:\n" + "\n".join(err[-2000:] for _, err in outs))
    return max(t for t, _ in inits), wall, max(call for _, call in inits)


class _Namespaces:
    """Two network namespaces joined by a veth pair (10.213.70.1 and .2); removed on exit."""

    ADDR = ("10.213.70.1", "10.213.70.2")

    def __enter__(self):
        tag = f"{os.getpid() % 100000}"
        self.names, veth = (f"fsa{tag}", f"fsb{tag}"), (f"fva{tag}", f"fvb{tag}")
        sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, timeout=30)  # noqa: E731
        for n in self.names:
            sh("ip", "netns", "add", n)
        sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, a in zip(self.names, veth, self.ADDR):
            sh("ip", "link", "set", v, "netns", n)
            sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", v)
            sh("ip", "-n", n, "link", "set", v, "up")
            sh("ip", "-n", n, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc):
        for n in self.names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


def two_nodes(args, py: str, script: str, tmp: str) -> None:
    secret = os.path.join(tmp, "job.secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
        fh.write(os.urandom(32).hex())
    with _Namespaces() as ns:
        def cmds(port: int, extra: list[str]) -> list[list[str]]:
            return [["ip", "netns", "exec", name, py, "-m", "dptrain", "run", "--nnodes", "2", "--node-rank",
                     str(rank), "--nproc-per-node", str(args.nproc), "--master-addr", ns.ADDR[0], "--master-port",
                     str(port), *extra] for rank, name in enumerate(ns.names)]

        kinds = [("without a secret", []), ("with a secret", [f"--secret-file={secret}"])]
        ranks = 2 * args.nproc
        for name, extra in kinds:  # warm the page cache
            one_run_two_nodes(cmds(29700, extra), script, ranks)
        results = {name: [] for name, _ in kinds}
        for i in range(args.runs):
            for j, (name, extra) in enumerate(kinds[:: 1 if i % 2 == 0 else -1]):
                results[name].append(one_run_two_nodes(cmds(29701 + 2 * i + j, extra), script, ranks))
    print(f"{args.runs} alternating runs, 2 namespace nodes x {args.nproc} rank(s), load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| job | median time to first step (s) | median whole run (s) | median longest `dptrain.init()` (s) |")
    print("| --- | --- | --- | --- |")
    med = {}
    for name, rows in results.items():
        med[name] = [statistics.median(r[k] for r in rows) for k in range(3)]
        print(f"| {name} | {med[name][0]:.3f} | {med[name][1]:.3f} | {med[name][2]:.3f} |")
    pairs = list(zip(results["without a secret"], results["with a secret"]))
    first, call = ([(b[k] - a[k]) * 1000 for a, b in pairs] for k in (0, 2))
    low, _, high = statistics.quantiles(first, n=4)
    print(f"paired differences (with - without), medians: first step {statistics.median(first):+.0f} ms (quartiles "
          f"{low:+.0f}, {high:+.0f}), dptrain.init() {statistics.median(call):+.0f} ms; ratio of medians (first step) "
          f"{med['with a secret'][0] / med['without a secret'][0]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1, choices=[1, 2],
                   help="2: two network-namespace nodes, with a secret against without (root, Linux)")
    args = p.parse_args()
    py = sys.executable
    if args.nodes == 2:
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "hello.py")
            with open(script, "w") as fh:
                fh.write(HELLO)
            two_nodes(args, py, script, tmp)
        return
    ours = [py, "-m", "dptrain", "run", "--nproc-per-node", str(args.nproc)]
    theirs = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "hello.py")
        with open(script, "w") as fh:
            fh.write(HELLO)
        one_run(ours, script), one_run(theirs, script)  # warm the page cache
        results = {"dptrain run": [], "torchrun": []}
        for i in range(args.runs):
            order = [("dptrain run", ours), ("torchrun", theirs)][:: 1 if i % 2 == 0 else -1]
            for name, cmd in order:
                results[name].append(one_run(cmd, script))
    print(f"{args.runs} alternating runs, {args.nproc} ranks, load average {os.getloadavg()[0]:.1f}")
    print("| launcher | median time to first step (s) | median whole run (s) |")
    print("| --- | --- | --- |")
    med = {}
    for name, rows in results.items():
        med[name] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        print(f"| {name} | {med[name][0]:.2f} | {med[name][1]:.2f} |")
    print(f"ratio dptrain run / torchrun: first step {med['dptrain run'][0] / med['torchrun'][0]:.3f}, "
          f"whole run {med['dptrain run'][1] / med['torchrun'][1]:.3f}")


if __name__ == "__main__":
    main()
