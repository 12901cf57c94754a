"""Draws a tqdm-like bar with `\\r` and no newline on stderr, then waits for the file named
by its argument before it finishes the bar with a newline. Prints the DPTRAIN_PROGRESS it got."""
import os
import sys
import time

import dptrain

world = dptrain.init()
gate = sys.argv[1]
print(f"progress mode {os.environ.get('DPTRAIN_PROGRESS')}", flush=True)
for i in range(6):
    sys.stderr.write(f"\rstep {i}/5 |{'#' * i:<5}|")
    sys.stderr.flush()
while not os.path.exists(gate):
    time.sleep(0.05)
sys.stderr.write("\rstep 5/5 |#####| done\n")
sys.stderr.flush()
dptrain.shutdown()
