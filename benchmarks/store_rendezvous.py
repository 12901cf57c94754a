"""The rendezvous store at thousands of ranks: dptrain's server against torch's, simulated ranks.

A job's ranks all meet in node 0's store at the same moment. Each simulated rank here does
what an NCCL start does there, with torch's own ``TCPStore`` client: connect, rank 0 sets the
unique id and the other N-1 get it, then a barrier (every rank adds 1 to a counter; the last
sets a key that every rank waits for). The figure is the wall time from the signal to start
until the last rank is through the barrier.

Both servers are hosted as the launcher hosts them (``RendezvousServer``, ``DPTRAIN_STORE``
python or torch), each round in a fresh process; the ranks are threads of ``--procs`` worker
processes started once. Rounds alternate (ours, torch's, torch's, ours, ...) so that a
drifting machine affects both alike, after one round of each that is not counted (a
process's first connections wait for a host-name lookup); the table gives medians, the median of the paired
ratios, the server's CPU seconds, and how many connections overflowed the listen backlog
(each waits about a second for its SYN to be sent again).

    .venv/bin/python benchmarks/store_rendezvous.py --ranks 1024 2048 4096 --pairs 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVER = """
import sys
from dptrain.launcher.rendezvous import RendezvousServer
server = RendezvousServer("127.0.0.1", 0, int(sys.argv[1]), timeout_s=120)
server.serve()
print(server.port, flush=True)
sys.stdin.readline()
server.close()
"""


# -- a worker process: some of the simulated ranks, as threads ----------------------------------
def _rank(port: int, rank: int, world: int, ready: threading.Barrier, go: threading.Event, out: list) -> None:
    import torch.distributed as dist

    ready.wait()
    go.wait()
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=120))
        if rank == 0:
            store.set("unique_id", b"x" * 128)  # an ncclUniqueId is 128 bytes
        else:
            store.get("unique_id")
        if store.add("arrived", 1) == world:
            store.set("all_arrived", "1")
        store.wait(["all_arrived"])
        out.append(time.monotonic())
    except Exception as exc:  # noqa: BLE001 - counted, and the round reported as failed
        out.append(f"rank {rank}: {type(exc).__name__}: {str(exc)[:200]}")


def worker(first: int, count: int) -> None:
    """Ranks ``first``..``first+count-1`` of each round: ``round PORT WORLD`` on stdin, then ``go``."""
    import torch.distributed  # noqa: F401 - imported once, before any round

    print("ready", flush=True)
    for line in sys.stdin:
        port, world = (int(x) for x in line.split()[1:3])
        ready = threading.Barrier(count + 1)
        go = threading.Event()
        out: list = []
        threads = [threading.Thread(target=_rank, args=(port, first + i, world, ready, go, out), daemon=True)
                   for i in range(count)]
        for t in threads:
            t.start()
        ready.wait()
        print("armed", flush=True)
        sys.stdin.readline()  # "go"
        go.set()
        for t in threads:
            t.join()
        errors = [x for x in out if isinstance(x, str)]
        print(f"done {max(x for x in out if not isinstance(x, str)) if len(errors) < len(out) else 0!r} "
              f"{len(errors)} {errors[0] if errors else ''}", flush=True)


# -- the driver ---------------------------------------------------------------------------------
def _listen_overflows() -> int:
    """TcpExtListenOverflows of this network namespace: connections a full backlog turned away."""
    with open("/proc/net/netstat") as fh:
        lines = fh.read().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:]))["ListenOverflows"])
    return 0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(which: str, world: int, workers: list[subprocess.Popen]) -> dict:
    env = {**os.environ, "DPTRAIN_STORE": which, "PYTHONPATH": ROOT}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(world)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        for w in workers:
            w.stdin.write(f"round {port} {world}\n")
            w.stdin.flush()
        for w in workers:
            assert w.stdout.readline().strip() == "armed"
        overflows, cpu = _listen_overflows(), _cpu_s(server.pid)
        t0 = time.monotonic()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        ends, errors = [], []
        for w in workers:
            _, end, failed, *first = w.stdout.readline().split(maxsplit=3)
            ends.append(float(end))
            if int(failed):
                errors.append(f"{failed} failed, e.g. {first[0] if first else ''}")
        return {"s": max(ends) - t0, "cpu": _cpu_s(server.pid) - cpu, "overflows": _listen_overflows() - overflows,
                "errors": errors}
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--pairs", type=int, default=5, help="paired rounds per world size")
    parser.add_argument("--procs", type=int, default=8, help="worker processes the ranks are spread over")
    ns = parser.parse_args()
    print(f"torch store clients as threads of {ns.procs} processes; {os.cpu_count()} cores; "
          f"net.core.somaxconn={open('/proc/sys/net/core/somaxconn').read().strip()}", flush=True)
    rows = []
    for world in ns.ranks:
        share = [world // ns.procs + (1 if i < world % ns.procs else 0) for i in range(ns.procs)]
        workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(sum(share[:i])), str(n)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
                   for i, n in enumerate(share)]
        try:
            for w in workers:
                assert w.stdout.readline().strip() == "ready"
            for which in ("python", "torch"):  # warm-up, not counted: the first connections look up host names
                one_round(which, world, workers)
            results = {"python": [], "torch": []}
            for pair in range(ns.pairs):
                for which in (("python", "torch") if pair % 2 == 0 else ("torch", "python")):
                    r = one_round(which, world, workers)
                    results[which].append(r)
                    print(f"  {world} ranks, {'ours' if which == 'python' else 'torch'}: {r['s']:.3f} s, server "
                          f"{r['cpu']:.2f} CPU s, {r['overflows']} listen overflows {'; '.join(r['errors'])}",
                          flush=True)
        finally:
            for w in workers:
                w.kill()
        ours, theirs = results["python"], results["torch"]
        ratios = [a["s"] / b["s"] for a, b in zip(ours, theirs)]
        rows.append((world, *(statistics.median(r["s"] for r in rs) for rs in (ours, theirs)),
                     statistics.median(ratios), *(statistics.median(r["cpu"] for r in rs) for rs in (ours, theirs)),
                     *(statistics.median(r["overflows"] for r in rs) for rs in (ours, theirs))))
    print("\n| ranks | ours (s) | torch's (s) | ours / torch (median of pairs) | server CPU s, ours | torch's "
          "| listen overflows, ours | torch's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for world, a, b, ratio, ca, cb, oa, ob in rows:
        print(f"| {world} | {a:.3f} | {b:.3f} | {ratio:.2f} | {ca:.2f} | {cb:.2f} | {oa:.0f} | {ob:.0f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
