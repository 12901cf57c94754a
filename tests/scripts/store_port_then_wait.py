"""A rank that writes the store's port to ``<AUTH_DIR>/port<rank>`` and waits for ``<AUTH_DIR>/go``
(at most 60 s); imports no torch."""

import os
import time

folder, rank = os.environ["AUTH_DIR"], os.environ["RANK"]
with open(os.path.join(folder, f"port{rank}.tmp"), "w") as fh:
    fh.write(os.environ["MASTER_PORT"])
os.rename(os.path.join(folder, f"port{rank}.tmp"), os.path.join(folder, f"port{rank}"))
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"rank {rank} finished", flush=True)
