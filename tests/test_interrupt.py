"""A survivor stops its step when its launcher signals a peer's death (see [Note: stopping a step at
once] in dptrain.runtime.interrupt): the signal only sets a flag; the flag is acted on at a module's forward
or a gradient hook, only inside an armed step, and only when the store shows a newer generation.

One process, no launcher: the tests send SIGURG to themselves and stand in for the launcher's
announcement with a HashStore.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
from torch import nn

from dptrain.runtime import interrupt as _interrupt, regroup as _regroup, env
from dptrain.runtime.errors import CollectiveError


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not installed the handler, with a store of generation 0; restored after."""
    before = signal.getsignal(_interrupt.SIGNAL)
    monkeypatch.setattr(_interrupt, "_INSTALLED", [False])
    monkeypatch.setattr(_interrupt, "PENDING", [False])  # the reducer reads its own alias; not used here
    monkeypatch.setattr(_interrupt, "_ARMED", [False])
    store = torch.distributed.HashStore()
    monkeypatch.setattr(env._STATE, "store", store)
    monkeypatch.setattr(env._STATE, "generation", 0)
    yield store
    signal.signal(_interrupt.SIGNAL, before)


def _announce(store, generation, **said):
    store.set(_regroup.generation_key(generation), json.dumps(said))


def _signal_self():
    os.kill(os.getpid(), _interrupt.SIGNAL)
    # The handler runs in the main thread at its next bytecode; this loop gives it that chance.
    for _ in range(1000):
        if _interrupt.PENDING[0]:
            return
    raise AssertionError("the handler did not run")


def test_the_signal_only_sets_a_flag_and_is_ignored_without_the_handler(fresh):
    assert signal.getsignal(_interrupt.SIGNAL) in (signal.SIG_DFL, signal.SIG_IGN, None)
    os.kill(os.getpid(), _interrupt.SIGNAL)  # default: ignored, the process goes on
    assert not _interrupt.PENDING[0]
    assert _interrupt.install() and _interrupt.installed() and _interrupt.install()  # idempotent
    _interrupt.arm()
    _signal_self()  # nothing raised from the handler, even armed
    assert _interrupt.PENDING[0]


def test_a_handler_of_the_scripts_own_is_left_alone(fresh):
    seen = []
    signal.signal(_interrupt.SIGNAL, lambda *a: seen.append(1))
    assert not _interrupt.install()
    os.kill(os.getpid(), _interrupt.SIGNAL)
    for _ in range(1000):
        if seen:
            break
    assert seen and not _interrupt.PENDING[0]


def test_only_the_main_thread_installs_it(fresh):
    got = []
    t = threading.Thread(target=lambda: got.append(_interrupt.install()))
    t.start()
    t.join()
    assert got == [False] and not _interrupt.installed()


def test_check_raises_only_armed_and_only_for_a_newer_generation(fresh):
    store = fresh
    _interrupt.install()
    _signal_self()
    _interrupt.check()  # not armed: nothing, and the note is kept for the next armed point
    assert _interrupt.PENDING[0]
    _interrupt.arm()
    _interrupt.check()  # armed, but no generation after 0: a stray signal, forgotten
    assert not _interrupt.PENDING[0]
    _signal_self()
    _announce(store, 1, kind="resize", joining=[2])  # a node let in: it joins at a step boundary
    _interrupt.check()
    assert not _interrupt.PENDING[0]
    _signal_self()
    _announce(store, 2, rank=1, why="was killed by SIGKILL")
    with pytest.raises(_interrupt.PeerLost, match="rank 1 was killed by SIGKILL.*generation 2") as caught:
        _interrupt.check()
    assert isinstance(caught.value, CollectiveError)  # what the Trainer recovers from
    env._STATE.generation = 2  # the recovery done: a note left from it is stale
    _signal_self()
    _interrupt.check()
    assert not _interrupt.PENDING[0]


def test_a_forward_stops_at_the_next_module_once_a_signal_came(fresh):
    store = fresh
    _interrupt.install()
    _announce(store, 1, rank=1, why="was killed by SIGKILL")
    ran = []

    class Step(nn.Module):
        def __init__(self, name, signal_here=False):
            super().__init__()
            self.name, self.signal_here = name, signal_here

        def forward(self, x):
            ran.append(self.name)
            if self.signal_here:
                _signal_self()
            return x + 1

    model = nn.Sequential(Step("a"), Step("b", signal_here=True), Step("c"), Step("d"))
    handles = _interrupt.watch_modules(model)
    assert len(handles) == 5  # the Sequential and its four
    assert model(torch.zeros(2)).tolist() == [4.0, 4.0]  # not armed: the whole forward runs
    assert ran == ["a", "b", "c", "d"] and _interrupt.PENDING[0]
    _interrupt.check()  # (not armed: kept)
    _interrupt.PENDING[0] = False
    ran.clear()
    _interrupt.arm()
    with pytest.raises(_interrupt.PeerLost):
        model(torch.zeros(2))
    assert ran == ["a", "b"]  # stopped before "c"
    for h in handles:
        h.remove()
    _interrupt.disarm()


def test_no_hooks_on_a_compiled_model(fresh):
    model = nn.Sequential(nn.Linear(2, 2))
    compiled = torch.compile(model)
    assert _interrupt.watch_modules(compiled) == []
    assert not model[0]._forward_pre_hooks


def test_a_deep_model_is_watched_at_its_blocks_only(fresh):
    # A hooked module leaves torch's fast path: the check stops at the first MAX_WATCHED modules, breadth first.
    blocks = [nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)]) for _ in range(10)]
    model = nn.Sequential(nn.ModuleList(blocks), *blocks)
    handles = _interrupt.watch_modules(model)
    assert len(handles) == _interrupt.MAX_WATCHED == 32
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    assert model in hooked and all(b in hooked for b in blocks) and not model[0]._forward_pre_hooks
    assert all(len(m._forward_pre_hooks) == 1 for m in hooked)  # a block in two parents: hooked once
    for h in handles:
        h.remove()
