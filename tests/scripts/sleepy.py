"""Print a line, then sleep; used for Ctrl-C and stall reports."""
import os
import time

import dptrain

dptrain.init()
print(f"sleeping {dptrain.rank()} pid {os.getpid()}", flush=True)
time.sleep(600)
