"""In-place recovery of the Trainer's DiLoCo (issue 48): a rank dies mid-round, every rank rolls
back to the newest round snapshot all of them hold, a replacement takes the dead rank's replica
from the files it left, and the run ends bit for bit where an uninterrupted one ends.

The jobs are ``tests/scripts/train_inplace.py`` with ``STRATEGY=diloco`` under ``dptrain run
--recovery in-place`` on 2 ranks (gloo, CPU), checked by ``tests.test_inplace_recovery._check``:
no survivor restarted, one recovery line per kill, no checkpoint read, every rank's final
replica (weights and buffers) and history equal to the uninterrupted run's; here also the
replicas' common (outer) weights.
"""

from __future__ import annotations

import json
import types

import torch

from dptrain.train import resize, rollback
from tests.test_inplace_recovery import _check, _finals, _run, _same

PLAIN = {"sync_every": 4}
# Streaming: 2 fragments (fragment 0 starts its exchange at steps 2, 6, ..., fragment 1 at 4, 8, ...),
# each applied one step later, in int8: an exchange is in flight at most steps.
STREAMING = {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1, "compression": "int8"}


def _diloco(tmp_path, name, kills, settings, ckpt=False, **extra):
    out = tmp_path / name
    log = _run(out, 2, ";".join(kills), tmp_path / f"{name}-ckpt" if ckpt else None, STRATEGY="diloco",
               DILOCO=json.dumps(settings), **extra)
    return out, log


def _same_common(out, reference_out):
    finals, reference = _finals(out), _finals(reference_out)
    for rank, ref in reference.items():
        assert _same(finals[rank]["common"], ref["common"]), f"rank {rank}'s outer weights differ"


def test_diloco_recovers_in_place_bitwise_from_kills_mid_round_in_a_step_and_in_an_outer_exchange(tmp_path):
    ref, _ = _diloco(tmp_path, "ref", [], PLAIN, ckpt=True)
    # Rounds end at steps 4, 8, 12 (the epoch's last), ...: rank 1 dies mid-round (step 6's forward),
    # rank 0 inside step 11's optimizer step, rank 1's replacement inside step 16's outer exchange.
    kills = ["1:0:forward:6", "0:0:optimizer:11", "1:1:sync:16"]
    out, log = _diloco(tmp_path, "out", kills, PLAIN, ckpt=True)
    reference = _finals(ref)
    _check(out, log, reference, kills)
    _same_common(out, ref)
    said = [line for line in log.splitlines() if line.startswith("[rank0] dptrain: recovered in place")]
    assert ["round snapshot at step 4 " in said[0], "at step 8 " in said[1], "at step 12 " in said[2]] == [True] * 3, said
    assert all("took the dead rank's replica, inner optimizer and DiLoCo state" in line for line in said)
    landed = json.loads((out / "killed-rank1-gen1.json").read_text())
    assert "step" in landed["stack"] and landed["fragment"] == 0  # inside DiLoCo's step, its exchange started
    # Every round point wrote a snapshot (24 steps / 4, the fit's start, 2 epoch ends) in the reference.
    assert reference[0]["rounds"]["written"] == 9 and reference[0]["rounds"]["bytes"] > 0


def test_streaming_diloco_recovers_in_place_bitwise_with_exchanges_in_flight(tmp_path):
    ref, _ = _diloco(tmp_path, "ref", [], STREAMING)
    # Round points at inner steps 1, 5, 9, ... (the last fragment's exchange applied). Rank 1 dies right
    # after starting fragment 0's exchange at step 6 (in flight until 7), rank 0 in step 9's forward and
    # its replacement inside step 13's optimizer step.
    kills = ["1:0:sync:6", "0:0:forward:9", "0:2:optimizer:13"]
    out, log = _diloco(tmp_path, "out", kills, STREAMING)
    _check(out, log, _finals(ref), kills)
    _same_common(out, ref)
    said = [line for line in log.splitlines() if line.startswith("[rank0] dptrain: recovered in place")]
    assert ["at step 5 " in said[0], "at step 5 " in said[1], "at step 9 " in said[2]] == [True] * 3, said


def test_a_diloco_replacement_without_its_round_snapshots_falls_back_to_restarting_the_job(tmp_path):
    ref, _ = _diloco(tmp_path, "ref", [], PLAIN, ckpt=True)
    out, log = _diloco(tmp_path, "out", ["1:0:forget:6"], PLAIN, ckpt=True)
    assert "the ranks hold no DiLoCo round snapshot of one and the same commit" in log, log
    assert "restarting all ranks" in log and "recovered in place" not in log
    finals = _finals(out)
    for rank, ref_final in _finals(ref).items():  # resumed from the newest checkpoint, bit for bit too
        assert _same(finals[rank]["state"], ref_final["state"])


def test_diloco_says_what_it_cannot_recover_in_place():
    from dptrain.train.strategy import _DiLoCoStrategy

    node = _DiLoCoStrategy(torch.device("cpu"), {"replica": "node"})
    plain = _DiLoCoStrategy(torch.device("cpu"), {"replica": "rank"})
    assert "replica='node'" in rollback.obstacle(types.SimpleNamespace(strategy=node))
    assert "diloco_kwargs={'replica': 'rank'}" in rollback.obstacle(types.SimpleNamespace(strategy=node))
    assert rollback.obstacle(types.SimpleNamespace(strategy=plain)) is None
    # A lost node (--nnodes MIN:MAX) cannot shrink a DiLoCo job in place: the reason names the fallback.
    why = resize.obstacle(types.SimpleNamespace(strategy=plain, train_loader=None))
    assert why is not None and "same world size only" in why and "checkpoint" in why


def test_round_points_and_the_target_all_members_hold():
    def rounds(step, every, delay):
        snaps = rollback.RoundSnapshots.__new__(rollback.RoundSnapshots)
        snaps.diloco = types.SimpleNamespace(inner_step=step, sync_every=every, fragment_sync_delay=delay)
        return snaps

    assert [s for s in range(1, 13) if rounds(s, 4, 0).due(True)] == [4, 8, 12]
    assert [s for s in range(1, 13) if rounds(s, 4, 1).due(True)] == [1, 5, 9]
    assert rounds(3, 4, 0).due(False)  # fit's start is always one
    pick = rollback.RoundSnapshots.pick
    assert pick(None, [{"has": [4, 8]}, {"has": [8, 13]}, {"has": [4, 8]}]) == 8
    assert pick(None, [{"has": [4, 8]}, {"has": []}]) is None
