"""A hot spare keeps memory its C library can hand to the script without fresh pages
(see [Note: a spare's memory is warm] in ``dptrain.launcher.spare``)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = (14 << 20) // 4096

PROBE = """
import resource, sys
from dptrain.launcher.spare import _warm_heap
if sys.argv[1] == "warm":
    _warm_heap()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = bytearray(14 << 20)  # zero-filled: every page touched
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="what glibc keeps of freed memory")
def test_after_the_warm_up_a_new_block_needs_few_fresh_pages():
    cold, warm = _faults("cold"), _faults("warm")
    assert cold > PAGES // 2, cold  # a fresh process: each page of a 14 MiB block is new (the premise)
    assert warm < PAGES // 4, warm  # a warmed spare: from what its heap kept
