"""How in-place recovery moves the state from its source to the other members (issue 32):
through a file in the launcher's folder on /dev/shm when every member is on the source's node,
over the process group otherwise or when a member cannot map that file -- the same bytes
either way, and never a file left behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from dptrain.train import _transfer as transfer
from tests._dist import run_ranks

def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g).to(torch.float64)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(300, 70, generator=g)}}, "lr": 0.1},
        "loader": {"epoch": 3, "generator": torch.Generator().manual_seed(9).get_state()},
        "seq": 17,
    }


def _transfer(rank, folder, one_node, unmappable):
    if rank in unmappable:
        transfer.map_state_file = lambda path, nbytes: None
    packed = transfer.pack_state(_state(rank), folder) if rank == 0 else None
    made = os.listdir(folder)
    got, route = transfer.broadcast_state(packed, 0, rank, one_node)
    want = _state(rank)
    same = (torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
            and torch.equal(got["optimizer"]["state"][0]["momentum_buffer"],
                            want["optimizer"]["state"][0]["momentum_buffer"])
            and torch.equal(got["loader"]["generator"], want["loader"]["generator"])
            and got["seq"] == 17 and got["optimizer"]["lr"] == 0.1)
    # What lives on is writable memory of this rank's own: an update changes nothing of the others'.
    momentum = got["optimizer"]["state"][0]["momentum_buffer"]
    momentum.add_(float(rank))
    torch.distributed.barrier()
    moved = float(momentum[0, 0] - want["optimizer"]["state"][0]["momentum_buffer"][0, 0])
    return made, same, moved, os.listdir(folder), route


@pytest.mark.parametrize("one_node, unmappable", [(True, ()), (False, ()), (True, (2,))],
                         ids=["through-dev-shm", "another-node", "a-member-cannot-map"])
def test_the_state_reaches_every_member_bit_for_bit_and_leaves_no_file(one_node, unmappable):
    folder = tempfile.mkdtemp(prefix="dptrain_test_state_", dir="/dev/shm")
    try:
        results = run_ranks(_transfer, 3, folder, one_node, unmappable, env={"DPTRAIN_SHM": "1"})
    finally:
        left = os.listdir(folder)
        shutil.rmtree(folder, ignore_errors=True)
    route = "through /dev/shm" if one_node and not unmappable else "over the process group"
    for rank, (made, same, moved, after, how) in enumerate(results):
        assert how == route, rank
        if rank == 0:
            assert len(made) == 1 and made[0].startswith(transfer.STATE_FILE_PREFIX)  # packed into the file
        assert same, rank
        assert moved == pytest.approx(float(rank))
        assert after == []
    assert left == []


def test_the_state_is_packed_into_a_file_only_on_dev_shm_with_shared_memory_on(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "transfer_device", lambda: torch.device("cpu"))  # no process group here
    monkeypatch.setenv("DPTRAIN_SHM", "1")
    assert transfer.pack_state(_state(0), str(tmp_path))[4] is None  # on disk: sent over the group
    assert list(tmp_path.iterdir()) == []
    folder = tempfile.mkdtemp(prefix="dptrain_test_state_", dir="/dev/shm")
    try:
        monkeypatch.setenv("DPTRAIN_SHM", "0")
        assert transfer.pack_state(_state(0), folder)[4] is None
        monkeypatch.setenv("DPTRAIN_SHM", "1")
        state, skeleton, meta, buffer, path = transfer.pack_state(_state(0), folder)
        assert os.path.dirname(path) == folder and os.stat(path).st_size == buffer.numel()
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
        with open(path, "rb") as f:
            assert f.read() == bytes(buffer.numpy())  # the buffer is the file
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_state_packed_on_a_thread_is_the_state_packed_at_once_and_a_discarded_one_leaves_no_file(monkeypatch):
    # A survivor packs on a thread while it re-forms the group (see _transfer.PackedEarly).
    class DDP:  # what the thread asks of the model: the new reducer's segment, for a given world size
        def __init__(self):
            self.asked = []

        def _prepare_rejoin(self, directory, world_size):
            self.asked.append((directory, world_size))
            return False

    monkeypatch.setenv("DPTRAIN_SHM", "1")
    folder = tempfile.mkdtemp(prefix="dptrain_test_state_", dir="/dev/shm")
    try:
        ddp = DDP()
        early = transfer.PackedEarly(lambda: _state(0), folder, torch.device("cpu"), ddp, 3)
        state, skeleton, meta, buffer, path = early.take()
        assert early.take() is None and ddp.asked == [(folder, 3)]  # taken once
        got = bytes(buffer.numpy())
        transfer.remove(path)
        now = transfer.pack_state(_state(0), folder, torch.device("cpu"))
        assert got == bytes(now[3].numpy()) and skeleton == now[1]
        transfer.remove(now[4])
        transfer.PackedEarly(lambda: _state(0), folder, torch.device("cpu"), ddp, 3).discard()
        assert os.listdir(folder) == []
        broken = transfer.PackedEarly(lambda: 1 / 0, folder, torch.device("cpu"), ddp, 3)
        assert broken.take() is None  # the main thread packs instead
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_received_weights_die_on_a_thread_not_on_the_way_to_the_next_step():
    import threading
    import time
    import weakref

    class Weights(dict):  # (a dict cannot be weakly referenced)
        pass

    died_on = []
    weights = Weights(w=torch.ones(4))
    weakref.finalize(weights, lambda: died_on.append(threading.current_thread()))
    holder = [weights]
    del weights
    transfer.release_later(holder)
    deadline = time.monotonic() + 10
    while not died_on and time.monotonic() < deadline:
        time.sleep(0.001)
    assert died_on and died_on[0] is not threading.main_thread() and holder == []
