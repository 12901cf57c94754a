"""What the store's check of a loopback peer's uid costs (issue 46, point 6).

The store reads ``/proc/net/tcp`` and ``/proc/net/tcp6`` once per batch of accepted loopback
connections (see [Note: only the job's own user on loopback] in
``dptrain.launcher._admission``), never per request. Measured here, with the check on and off
(``StoreServer(check_uid=...)``), each round with a fresh server in this process:

* connect: a new ``StoreClient`` (connect, TCPStore's handshake, a ping answered), the median of
  ``--connects`` clients made one after the other;
* request: one ``get`` round trip on an open connection, the median of ``--requests``.

Rounds go in pairs (on, off, then off, on, ...) so that a drifting machine affects both alike,
after one round of each that is not counted. ``--idle N`` first opens N idle loopback
connections, so that the kernel's table is as long as on a busy host (each lists two lines).

    .venv/bin/python benchmarks/store_uid_check.py --pairs 7 --idle 0
    .venv/bin/python benchmarks/store_uid_check.py --pairs 7 --idle 2000
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dptrain.launcher.rendezvous import listen_on  # noqa: E402
from dptrain.launcher.store import StoreClient, StoreServer  # noqa: E402


def one_round(check: bool, connects: int, requests: int) -> tuple[float, float]:
    """Median seconds of a connect and of a request, with the uid check ``check``."""
    server = StoreServer(listen_on("127.0.0.1", 0), check_uid=check)
    assert (server.uid is not None) == check or not check, "no /proc/net/tcp here: nothing to measure"
    try:
        times = []
        for _ in range(connects):
            t0 = time.perf_counter()
            client = StoreClient("127.0.0.1", server.port, timeout=10)
            times.append(time.perf_counter() - t0)
            client.close()
        client = StoreClient("127.0.0.1", server.port, timeout=10)
        client.set("k", "v")
        per_request = []
        for _ in range(requests):
            t0 = time.perf_counter()
            client.get("k")
            per_request.append(time.perf_counter() - t0)
        client.close()
        return statistics.median(times), statistics.median(per_request)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--connects", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--idle", type=int, default=0, help="idle loopback connections held open meanwhile")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    idle = []
    if args.idle:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(args.idle)
        for _ in range(args.idle):
            idle.append(socket.create_connection(holder.getsockname()))
            idle.append(holder.accept()[0])
    with open("/proc/net/tcp") as fh:
        lines = sum(1 for _ in fh) - 1
    one_round(True, 20, 200)
    one_round(False, 20, 200)
    results = {True: [], False: []}
    for i in range(args.pairs):
        for check in ((True, False) if i % 2 == 0 else (False, True)):
            results[check].append(one_round(check, args.connects, args.requests))
    on_c, off_c = [r[0] for r in results[True]], [r[0] for r in results[False]]
    on_r, off_r = [r[1] for r in results[True]], [r[1] for r in results[False]]
    print(f"/proc/net/tcp lines: {lines}; {args.pairs} pairs, {args.connects} connects and {args.requests} "
          f"requests a round")
    print("| | check on (median) | check off (median) | on / off (median of pairs) |")
    print("| --- | --- | --- | --- |")
    print(f"| connect | {statistics.median(on_c) * 1e6:.0f} us | {statistics.median(off_c) * 1e6:.0f} us | "
          f"{statistics.median(a / b for a, b in zip(on_c, off_c)):.3f} |")
    print(f"| request | {statistics.median(on_r) * 1e6:.1f} us | {statistics.median(off_r) * 1e6:.1f} us | "
          f"{statistics.median(a / b for a, b in zip(on_r, off_r)):.3f} |")
    for sock in idle:
        sock.close()


if __name__ == "__main__":
    main()
