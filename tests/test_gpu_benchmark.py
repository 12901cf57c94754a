"""``benchmarks/gpu_step.py`` runs where it used to crash: one rank, PyTorch's DDP beside ours
("Default process group has not been initialized" on a one-GPU machine). On this CPU
machine the same script runs over gloo (``--cpu``), tiny, only to show that it completes and
prints both ratios; its timings mean nothing here and are not checked."""

import os
import re
import subprocess
import sys

from dptrain.runtime import torch_version as _torch_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_benchmark_runs_on_one_rank_and_prints_both_ratios():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_step.py"), "--cpu", "--nproc", "1", "--width", "32",
           "--depth", "1", "--heads", "2", "--vocab", "64", "--context", "8", "--steps", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 rank(s) on CPU (gloo)" in out.stdout
    assert re.search(r"\| dptrain DDP \| [0-9.]+ \| [0-9.]+ \|", out.stdout), out.stdout
    if not _torch_version.older_than((2, 6)):
        assert re.search(r"\| dptrain FSDP \| [0-9.]+ \| [0-9.]+ \|", out.stdout), out.stdout
    else:  # FSDP2 needs CUDA before torch 2.6: ours is timed alone, and the table says why
        assert re.search(r"\| dptrain FSDP \| [0-9.]+ \| n/a: torch .*'s FSDP2 needs CUDA", out.stdout), out.stdout
