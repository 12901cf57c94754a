"""What an outsider gets from a job's rendezvous port: ``python store_probe.py HOST PORT``.

Prints one JSON object: what torch's own ``TCPStore`` client read, and every byte a raw socket
got back after it asked, in TCPStore's protocol, to stop the job (``launcher/failed/0``), to
arrive as a node (``launcher/arrivals``) and to read that key.
"""

import datetime
import json
import socket
import struct
import sys

host, port = sys.argv[1], int(sys.argv[2])
out = {}

import torch.distributed as dist  # noqa: E402

try:
    store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=1))
    out["torch_read"] = store.get("launcher/arrivals").decode()
except Exception as exc:  # noqa: BLE001 - what it raised is the answer
    out["torch_error"] = type(exc).__name__


def blob(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


VALIDATE, SET, GET, ADD = 0, 1, 3, 4
stop = b"on node 1: rank 1 (local rank 0) exited with code 1 (written from outside the job)"
request = (struct.pack("<BI", VALIDATE, 0x3C85F7CE) + bytes([SET]) + blob(b"/launcher/failed/0") + blob(stop)
           + bytes([ADD]) + blob(b"/launcher/arrivals") + struct.pack("<q", 1)
           + bytes([GET]) + blob(b"/launcher/arrivals"))
got = b""
with socket.create_connection((host, port), timeout=3) as sock:
    sock.sendall(request)
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                out["raw_closed"] = True
                break
            got += chunk
    except ConnectionResetError:
        out["raw_closed"] = True
    except socket.timeout:  # the connection stayed open: the answers (if any) are all there is
        out["raw_closed"] = False
out["raw_answer"] = got.hex()
print(json.dumps(out), flush=True)
