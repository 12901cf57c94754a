"""A module run with `dptrain run -m`."""
import sys

import dptrain

dptrain.init()
print(f"module rank {dptrain.rank()} args {sys.argv[1:]}", flush=True)
