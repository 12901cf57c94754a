"""PyTorch's own DDP and DistributedSampler tests, run against dptrain's classes.

The tests are ``DistributedTest._DistTestBase`` from the installed wheel
(``torch/testing/_internal/distributed/distributed_test.py``), run the way PyTorch's
``test/distributed/test_distributed_spawn.py`` runs them: gloo, two ranks, one spawned
process per rank (``BACKEND=gloo WORLD_SIZE=2``, a fresh ``TEMP_DIR`` per test). Before
any test runs, ``torch.nn.parallel.DistributedDataParallel`` and the suite's own
``DistributedDataParallel`` / ``DistributedSampler`` names are replaced by dptrain's, in
the parent and in every spawned rank (each rank re-imports this file).

Selected: every test whose body (or a ``self._helper`` it calls) names
``DistributedDataParallel`` or ``DistributedSampler``. Without GPUs the GPU-marked tests
run on CPU (see [Note: the CPU shim]); those listed in ``gpu_only.txt`` are counted as
skipped without spawning anything. A test listed in ``private.txt`` reads PyTorch's
private internals (its C++ reducer, its logger): when it fails it counts as "private", not
as a failure. A test whose ranks pass but one of which dies at exit (a negative exit code)
counts as "abort at exit".

Needs ``expecttest`` (PyTorch's test utilities import it; the make target installs it).

    make test-torch-suite                                   # everything, about 18 minutes on 2 cores
    python tests/torch_suite/run_torch_suite.py -k static_graph
    python tests/torch_suite/run_torch_suite.py --slice 1/4 --json out.json

Exit status: 0 when nothing failed (aborts at exit count as failures) other than the listed
private tests.
"""

from __future__ import annotations

import os
import sys
import tempfile

# The suite reads these at import time (and each spawned rank re-imports this file).
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="dptrain-torch-suite-"))
for _sub in ("barrier", "test_dir"):
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], _sub), exist_ok=True)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import unittest  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import dptrain  # noqa: E402
from dptrain.parallel.ddp import DistributedDataParallel  # noqa: E402  (imported before the swap: it keeps torch's class)

import torch.testing._internal.distributed.distributed_test as suite  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


# [Note: the CPU shim]
# Most of the suite's DDP tests are written for one GPU per rank (``skip_if_lt_x_gpu(2)``,
# ``model.cuda(rank)``, ``device_ids=[rank]``, ``torch.rand(..., device=rank)``), although
# gloo runs them on CPU just as well. Without GPUs (``--cpu-shim``, the default then) the
# runner lets those tests run and points every CUDA device at the CPU: the GPU skip lets
# CPU through (its ``allow_cpu``), ``.cuda()`` and ``torch.cuda.set_device`` do nothing, a
# torch function mode maps ``device=<cuda>`` arguments to "cpu", and ``device_ids`` /
# ``output_device`` are dropped for a CPU module (both DDPs refuse them there). What only
# a GPU has (streams, events, NCCL, CUDA amp) still fails: such tests are listed in
# ``private.txt``'s neighbour ``gpu_only.txt`` and counted as skipped.


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuDDP(DistributedDataParallel):
    """dptrain's DDP with a GPU test's ``device_ids`` dropped for a CPU module."""

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids, output_device, *args, **kwargs)


def _open_gpu_skips() -> None:
    """Flip the ``allow_cpu`` of every ``skip_if_lt_x_gpu`` wrapper on the suite's tests."""
    for name in dir(DistributedTest._DistTestBase):
        fn = getattr(DistributedTest._DistTestBase, name)
        while callable(fn):
            code = getattr(fn, "__code__", None)
            if code is not None and code.co_filename.endswith("common_distributed.py") and fn.__closure__:
                for var, cell in zip(code.co_freevars, fn.__closure__):
                    if var == "allow_cpu":
                        cell.cell_contents = True
            fn = getattr(fn, "__wrapped__", None)


def cpu_shim() -> type:
    """Apply [Note: the CPU shim]; returns the DDP class to swap in."""
    _open_gpu_skips()
    torch.cuda.set_device = lambda device: None
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: 0
    module_to = torch.nn.Module.to

    def to_cpu(self, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return module_to(self, *args, **kwargs)

    torch.nn.Module.to = to_cpu
    _CudaToCpu().__enter__()
    return _CpuDDP


def swap_in_dptrain(ddp_class: type) -> None:
    """Put dptrain's DDP and sampler where the suite (and code it calls) looks them up."""
    torch.nn.parallel.DistributedDataParallel = ddp_class
    suite.DistributedDataParallel = ddp_class
    suite.DistributedSampler = dptrain.DistributedSampler


CPU_SHIM = os.environ.setdefault("DPTRAIN_TORCH_SUITE_CPU_SHIM", "0" if torch.cuda.is_available() else "1") == "1"
swap_in_dptrain(cpu_shim() if CPU_SHIM else DistributedDataParallel)

HERE = os.path.dirname(os.path.abspath(__file__))
_NAMES = re.compile(r"\bDistributed(DataParallel|Sampler)\b")
_HELPER = re.compile(r"self\.(_[A-Za-z0-9_]+)\(")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """test_distributed_spawn.py's class, plus a check of every rank's exit code."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _check_return_codes(self, fn, elapsed_time) -> None:
        # PyTorch's check looks at rank 0's exit code only; a rank whose test body passed (no
        # error exit code from any rank) and that then died at interpreter exit (SIGABRT:
        # -6) is a failure for users all the same: "abort at exit".
        codes = [p.exitcode for p in self.processes]
        if self.TEST_ERROR_EXIT_CODE not in codes and None not in codes:
            for i, code in enumerate(codes):
                if code < 0:
                    raise AssertionError(f"abort at exit: process {i} ended with exit code {code}")
        super()._check_return_codes(fn, elapsed_time)


def _source(name: str) -> str:
    fn = getattr(DistributedTest._DistTestBase, name, None)
    try:
        return inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return ""


def _uses_our_classes(name: str, depth: int = 3) -> bool:
    seen, frontier = set(), [name]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            src = _source(n)
            if _NAMES.search(src):
                return True
            nxt += [h for h in _HELPER.findall(src) if h not in seen]
            seen.update(nxt)
        frontier = nxt
    return False


def _needs_gpu(name: str) -> bool:
    src = _source(name)
    head = src.split("def ", 1)[0]  # the decorators
    if torch.cuda.is_available() or CPU_SHIM:
        return False
    return "skip_if_lt_x_gpu" in head or "skip_if_no_gpu" in head or "require_n_gpus_for_nccl_backend" in head


def selected_tests() -> list[str]:
    names = sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))
    return [n for n in names if _uses_our_classes(n)]


def read_list(filename: str) -> dict[str, str]:
    """``private.txt`` / ``gpu_only.txt``: ``test_name  reason`` per line; '#' starts a comment."""
    out = {}
    with open(os.path.join(HERE, filename)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, reason = line.partition(" ")
                out[name] = reason.strip()
    return out


class _Result(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, tuple[str, str]] = {}

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[test._testMethodName] = ("passed", "")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[test._testMethodName] = ("failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[test._testMethodName] = ("failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[test._testMethodName] = ("skipped", reason)


def reason(text: str) -> str:
    """The line of a failure that says what went wrong (a rank's exception, not the harness's)."""
    lines = [ln.strip() for ln in text.splitlines()]
    found = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*: ", ln) and "exited with error code" not in ln]
    return (found[-1] if found else lines[-1] if lines else "")[:200]


def classify(outcomes: dict[str, tuple[str, str]], private: dict[str, str]) -> dict[str, list[str]]:
    tally: dict[str, list[str]] = {k: [] for k in ("passed", "private", "abort at exit", "failed", "skipped")}
    for name, (status, text) in sorted(outcomes.items()):
        if status == "failed" and "abort at exit" in text:
            status = "abort at exit"
        elif status == "failed" and name in private:
            status = "private"
        tally[status].append(name)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default=None, help="only tests whose name contains this")
    parser.add_argument("--slice", default="1/1", help="i/n: the i-th of n equal slices of the selection")
    parser.add_argument("--json", default=None, help="write the per-test outcomes here")
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    args = parser.parse_args(argv)
    names = selected_tests()
    if args.k:
        names = [n for n in names if args.k in n]
    i, n = (int(x) for x in args.slice.split("/"))
    names = names[i - 1 :: n]
    if args.list:
        print("\n".join(names))
        return 0
    private = read_list("private.txt")
    gpu_only = read_list("gpu_only.txt") if CPU_SHIM else {}
    outcomes: dict[str, tuple[str, str]] = {}
    runnable = []
    for name in names:
        if _needs_gpu(name) or name in gpu_only:
            outcomes[name] = ("skipped", "needs a GPU: " + gpu_only.get(name, "skip_if_lt_x_gpu"))
        else:
            runnable.append(name)
    start = time.monotonic()
    suite_ = unittest.TestSuite(TestDistBackendWithSpawn(name) for name in runnable)
    runner = unittest.TextTestRunner(resultclass=_Result, verbosity=2, stream=sys.stderr)
    result = runner.run(suite_)
    outcomes.update(result.outcomes)
    tally = classify(outcomes, private)
    elapsed = time.monotonic() - start
    print(f"\ntorch {torch.__version__}, {len(names)} selected tests in {elapsed:.0f} s")
    for status, tests in tally.items():
        print(f"  {status}: {len(tests)}")
        if status in ("failed", "abort at exit", "private"):
            for t in tests:
                why = private.get(t, "") if status == "private" else reason(outcomes[t][1])
                print(f"    {t}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "seconds": round(elapsed), "outcomes": outcomes,
                       "tally": tally}, f, indent=1)
    return 0 if not tally["failed"] and not tally["abort at exit"] else 1


if __name__ == "__main__":
    sys.exit(main())
