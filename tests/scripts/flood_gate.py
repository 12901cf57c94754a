"""Hold ``COUNT`` silent connections to ``HOST:PORT`` for ``SECONDS`` (an outsider's flood).

Each connection reads what it is sent (a gate's challenge) and says nothing; one the other side
closes is opened again at once, so the flood stays as large as the other side lets it be.
Writes ``READY`` (a path) once the first ``COUNT`` are open, and prints how many were opened in all.
"""

import os
import resource
import selectors
import socket
import sys
import time

host, port, count, seconds, ready = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
selector = selectors.DefaultSelector()
opened = 0


def open_one() -> None:
    global opened
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except OSError:
        time.sleep(0.01)
        return
    sock.setblocking(False)
    selector.register(sock, selectors.EVENT_READ)
    opened += 1


while opened < count:
    open_one()
open(ready, "w").close()
end = time.monotonic() + seconds
while time.monotonic() < end:
    for key, _ in selector.select(timeout=0.1):
        try:
            chunk = key.fileobj.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            selector.unregister(key.fileobj)
            key.fileobj.close()
            open_one()
print(f"opened {opened}", flush=True)
