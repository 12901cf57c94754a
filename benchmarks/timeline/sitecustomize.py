"""Loaded by every Python that ``benchmarks/recovery_timeline.py`` starts (it puts this folder on
PYTHONPATH): when ``DPTRAIN_TIMELINE_DIR`` is set, the functions of dptrain's in-place recovery
named in ``WATCHED`` log when they are entered and left, one line each, to
``$DPTRAIN_TIMELINE_DIR/<pid>.log``::

    <time.time()> <indent>> module.function
    <time.time()> <indent>< module.function

The functions are wrapped as their modules are first imported (an import hook), so nothing of
dptrain changes and a process that never imports them logs only its start. A measuring aid for
the benchmark, not part of the package.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys
import threading
import time

#: module -> its functions, or {class: its methods}, to time.
WATCHED = {
    "dptrain.runtime.env": ["init", "_reform"],
    "dptrain.runtime.exit": ["settle_before_destroy"],
    "dptrain.runtime.interrupt": ["_on_signal", "check"],
    "dptrain._shm.group": ["abort_all", "close_all"],
    "dptrain.comm": ["all_gather_object", "broadcast_object", "broadcast", "barrier"],
    "dptrain.runtime.regroup": ["form", "wait_for_generation", "cut_connections"],
    "dptrain._shm.segment": ["open_segment", "_create", "_attach"],
    "dptrain.train.recovery": [{"InPlaceRecovery": ["recover", "join", "_exchange_and_restore", "_restore", "_let_go",
                                                        "_drop_step", "_pack_early", "commit", "prepare_step"]}],
    "dptrain.train.trainer": ["check_equal_batches", {"Trainer": ["__init__", "fit", "_after_micro_batches"]}],
    "dptrain.train.state": [{"TrainState": ["begin_epoch"]}],
    "dptrain.seeding": ["seed_everything"],
    "dptrain.data.loader": ["prepare_dataloader"],
    "dptrain.train._transfer": ["pack_state", "broadcast_state", "map_state_file"],
    "dptrain.runtime.tensors": ["unpack"],
    "dptrain.parallel.ddp._recovery": ["rejoin", "adopt_reducer_layout"],
    "dptrain.parallel.ddp.setup": ["verify_same_model"],
    "dptrain.checkpoint": ["load_model_state"],
    "dptrain.parallel.ddp.api": [{"DistributedDataParallel": ["__init__", "_rejoin", "_leave_group", "_build_reducer"]}],
    "dptrain.launcher.inplace": [{"InPlaceRecovery": ["_replace", "_blocker", "_bury", "_stop_steps", "_assign"]}],
    "dptrain.launcher.spare": ["run_task", "_become", "join_to_the_end"],
}


def _install(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    out = [None, None]  # the pid the file was opened for, the file: a forked child (a spare, a rank) opens its own
    depth = threading.local()

    def log(line: str) -> None:
        if out[0] != os.getpid():
            out[:] = [os.getpid(), open(os.path.join(folder, f"{os.getpid()}.log"), "a", buffering=1)]
        out[1].write(f"{time.time():.4f} {line}\n")

    def timed(fn, name):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            d = getattr(depth, "d", 0)
            depth.d = d + 1
            log(f"{'  ' * d}> {name}")
            try:
                return fn(*args, **kwargs)
            finally:
                depth.d = d
                log(f"{'  ' * d}< {name}")
        return wrapper

    def wrap_module(name, module):
        short = name.rsplit(".", 1)[-1]
        for entry in WATCHED[name]:
            if isinstance(entry, str):
                if hasattr(module, entry):
                    setattr(module, entry, timed(getattr(module, entry), f"{short}.{entry}"))
                continue
            for cls_name, methods in entry.items():
                cls = getattr(module, cls_name, None)
                for m in methods if cls is not None else ():
                    if m in cls.__dict__:
                        setattr(cls, m, timed(cls.__dict__[m], f"{cls_name}.{m}"))

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in WATCHED:
                return None
            sys.meta_path.remove(self)  # find the real spec without this finder
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                wrap_module(name, module)
            spec.loader.exec_module = exec_module
            return spec

    log(f"start {' '.join(sys.argv[:2])}")
    sys.meta_path.insert(0, Finder())


if os.environ.get("DPTRAIN_TIMELINE_DIR"):
    _install(os.environ["DPTRAIN_TIMELINE_DIR"])
