"""The heartbeat thread is inside a slow store write when it is told to stop; the process
must still exit cleanly (not in std::terminate, from a thread left in a C++ call)."""
import datetime
import time

import torch.distributed as dist

from dptrain.runtime import heartbeat as _heartbeat

server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))


class SlowStore:
    """Each write takes 3 s of store calls, as a write to a store on a starved machine can."""

    def set(self, key, value):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            client.set(key, value)


_heartbeat.start(SlowStore(), 0, interval=0.01)
time.sleep(0.3)
_heartbeat.stop()
print("stopped", flush=True)
