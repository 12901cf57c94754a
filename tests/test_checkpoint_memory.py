"""An FSDP checkpoint never brings another rank's optimizer shard into a rank's memory."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

import dptrain
from dptrain.data import prepare_dataloader
from dptrain.parallel.fsdp import ParamCountPolicy
from dptrain.train import Trainer, TrainerConfig
from tests._dist import run_ranks

# Fresh ranks for every call (tests/_dist.py): a rank's memory is measured: memory an earlier body
# freed would hide what this one allocates.
FRESH_RANKS = True

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


class _PeakRSS:
    """Samples this process's resident memory every millisecond while active."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _save_and_measure(rank, cdir):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])  # 16 units of 1 MiB: 16 MiB of weights
    data = torch.utils.data.TensorDataset(torch.randn(8, 512), torch.randn(8, 512))
    config = TrainerConfig(strategy="fsdp", checkpoint_dir=cdir, verbose=False, nan_policy="off",
                           fsdp_kwargs={"auto_wrap_policy": ParamCountPolicy(100_000)})
    t = Trainer(model, lambda p: torch.optim.Adam(p, lr=1e-3), prepare_dataloader(data, 4), nn.MSELoss(), config)
    t.fit(1)  # Adam's state now exists: 2 x 16 MiB over 2 ranks, 16 MiB per rank
    shard = sum(v.numel() * v.element_size() for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    t.save_checkpoint()  # warm-up: the first save allocates buffers that stay
    with _PeakRSS() as m:
        path = t.save_checkpoint(os.path.join(cdir, "ckpt-e0009-s000000009.pt"))
    return {"shard": shard, "growth": m.peak - m.base, "files": sorted(os.listdir(cdir)), "path": path}


def test_fsdp_checkpoint_save_holds_only_this_ranks_optimizer_shard(tmp_path):
    results = run_ranks(_save_and_measure, 2, str(tmp_path), timeout=180)
    weights = 16 * 2**20 + 16 * 512 * 4  # the full model, which rank 0 gathers to write it
    for rank, r in enumerate(results):
        assert r["shard"] >= 16 * 2**20 - 2**16  # half of Adam's 32 MiB
        # Receiving the other rank's shard (what an all-gather of optimizer states did) would add
        # at least a whole shard; writing one's own shard to its file adds far less.
        allowed = r["shard"] / 2 + (weights if rank == 0 else 0)
        assert r["growth"] < allowed, f"rank {rank} grew by {r['growth'] / 2**20:.1f} MiB during the save"
    names = results[0]["files"]
    assert "rank0-of-2.ckpt-e0009-s000000009.pt" in names and "rank1-of-2.ckpt-e0009-s000000009.pt" in names
    state = dptrain.checkpoint.load(results[0]["path"])
    assert state["sharded"] == ["optimizer"] and "optimizer" not in state and len(state["model"]) == 32
