"""Writes one line to stdout and one to stderr, and a progress bar's carriage returns."""
import os
import sys

rank = os.environ["RANK"]
print(f"out from {rank}", flush=True)
sys.stderr.write(f"10%\r50%\r100%\nerr from {rank}\n")
sys.stderr.flush()
