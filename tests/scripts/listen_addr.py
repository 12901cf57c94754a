"""Print the local address that the rendezvous port listens on (from /proc/net/tcp)."""
import os
import socket
import struct

import dptrain

dptrain.init()
port = int(os.environ["MASTER_PORT"])
found = []
for line in open("/proc/net/tcp").read().splitlines()[1:]:
    local, state = line.split()[1], line.split()[3]
    addr, p = local.split(":")
    if int(p, 16) == port and state == "0A":
        found.append(socket.inet_ntoa(struct.pack("<I", int(addr, 16))))
print("LISTEN " + ",".join(sorted(set(found))), flush=True)
