"""Multi-rank tests of dptrain.data: exact evaluation, resume across world sizes, main_process_first.

Every rank imports this module to find its function, so it imports nothing slow at the top
(no pytest, no sklearn): that would cost seconds per rank.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.utils.data as tud

import dptrain
from dptrain import comm
from dptrain.data import DistributedSampler, gather_results, main_process_first, prepare_dataloader
from tests._dist import run_ranks, set_event, wait_event


class Scored(tud.Dataset):
    """Deterministic features and binary labels; the same on every rank."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 3, generator=g)
        self.y = (torch.rand(n, generator=g) < 0.4).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _model(x):
    # Elementwise on each row's own features, so a row's output does not depend on which
    # other rows share its batch: the comparison below tests the data path, not BLAS.
    score = torch.sigmoid(2.0 * x[:, 0] - x[:, 1] * x[:, 1] + 0.5 * x[:, 2])
    return score, (x[:, 0] > x[:, 2]).long()


def _eval_rank(rank, n, batch_size, dst):
    loader = prepare_dataloader(Scored(n), batch_size, mode="eval")
    scores, classes = [], []
    for x, _ in loader:
        s, c = _model(x)
        scores.append(s)
        classes.append(c)
    idx = loader.sampler.indices()
    return (
        len(idx),
        gather_results(scores, idx, dst=dst, num_samples=n),
        gather_results(classes, idx, dst=dst, num_samples=n),
    )


def _check_exact_eval(world, n, batch_size, dst):
    from sklearn.metrics import roc_auc_score

    results = run_ranks(_eval_rank, world, n, batch_size, dst)
    ds = Scored(n)
    ref_scores, ref_classes = _model(ds.x)
    shard_lens = [r[0] for r in results]
    assert sum(shard_lens) == n and max(shard_lens) - min(shard_lens) <= 1  # uneven, nothing repeated
    for rank, (_, scores, classes) in enumerate(results):
        if dst is not None and rank != dst:
            assert scores is None and classes is None
            continue
        assert torch.equal(scores, ref_scores) and torch.equal(classes, ref_classes)
        labels = ds.y.numpy()
        acc = (classes == ds.y).double().mean().item()
        assert acc == (ref_classes == ds.y).double().mean().item()
        if 0 < labels.sum() < len(labels):
            assert roc_auc_score(labels, scores.numpy()) == roc_auc_score(labels, ref_scores.numpy())


def test_exact_eval_on_2_ranks():
    _check_exact_eval(2, 11, 3, None)


def test_exact_eval_on_3_ranks():
    _check_exact_eval(3, 10, 4, None)


def test_exact_eval_on_4_ranks_to_rank_0():
    _check_exact_eval(4, 13, 2, 0)


def test_exact_eval_with_fewer_samples_than_ranks():
    _check_exact_eval(4, 3, 2, None)  # rank 3 evaluates nothing and still takes part
    _check_exact_eval(3, 2, 1, None)  # rank 2 evaluates nothing
    _check_exact_eval(3, 1, 2, 2)  # only rank 0 has a sample; rank 2, which has none, gets the result


def _tiny_dev_set_rank(rank, n):
    """Evaluate as the Trainer does, with ``torch.empty(0)`` where a rank had no batch."""
    import torch.nn.functional as F

    loader = prepare_dataloader(Scored(n), 4, mode="eval")
    shard = (len(loader), len(loader.sampler), loader.sampler.indices(), list(loader))
    logits, labels = [], []
    for x, y in loader:
        logits.append(torch.stack(_model(x)[0:1] * 2, dim=1))  # (rows, 2) float32
        labels.append(y)  # int64
    out = torch.cat(logits) if logits else torch.empty(0)
    tgt = torch.cat(labels) if labels else torch.empty(0)  # float32 on the empty rank
    idx = loader.sampler.indices()
    all_out, all_tgt = gather_results(out, idx, num_samples=n), gather_results(tgt, idx, num_samples=n)
    empty_list = gather_results([], idx, num_samples=n) if not logits else gather_results(logits, idx)
    return shard, all_out, all_tgt, F.cross_entropy(all_out, all_tgt).item(), empty_list


def test_dev_set_smaller_than_the_world_evaluates_on_every_rank():
    import torch.nn.functional as F

    for n in (2, 1):
        results = run_ranks(_tiny_dev_set_rank, 3, n)
        ds = Scored(n)
        ref_out = torch.stack(_model(ds.x)[0:1] * 2, dim=1)
        ref_loss = F.cross_entropy(ref_out, ds.y).item()
        for rank, (shard, out, tgt, loss, from_list) in enumerate(results):
            if rank >= n:  # beyond the dataset: an empty shard, not an error
                assert shard == (0, 0, [], [])
            else:
                assert shard[:3] == (1, 1, [rank])
            assert torch.equal(out, ref_out) and torch.equal(tgt, ds.y) and tgt.dtype == torch.int64
            assert loss == ref_loss
            assert torch.equal(from_list, ref_out)


def _all_empty_rank(rank, n):
    loader = prepare_dataloader(Scored(n), 2, mode="eval")
    idx = loader.sampler.indices()
    return (
        len(loader),
        gather_results(torch.empty(0, 4, dtype=torch.float64), idx, num_samples=0),
        gather_results(torch.empty(0, 4), idx, dst=1),
    )


def test_every_rank_with_zero_rows_gives_an_empty_result_of_the_known_shape():
    results = run_ranks(_all_empty_rank, 3, 0)  # an empty dev set: no rank has a sample
    for rank, (num_batches, out, to_dst) in enumerate(results):
        assert num_batches == 0 and out.shape == (0, 4) and out.dtype == torch.float64
        assert (to_dst.shape == (0, 4)) if rank == 1 else to_dst is None


def _conflicting_layouts_rank(rank, case):
    values = {
        "stated shape": [torch.ones(2, 3), torch.empty(0, 4), torch.empty(0)],
        "rows": [torch.ones(2, 3), torch.ones(1, 3, dtype=torch.float64), torch.empty(0)],
        "no layout": [[], [], []],
    }[case][rank]
    try:
        gather_results(values, list(range(len(values))))
    except ValueError as exc:
        return str(exc)
    return None


def test_conflicting_layouts_raise_on_every_rank_and_name_the_ranks():
    expected = {
        "stated shape": "got rank 0: ((3,), float32), rank 1: ((4,), float32, 0 rows)",
        "rows": "got rank 0: ((3,), float32), rank 1: ((3,), float64)",
        "no layout": "empty list on every rank",
    }
    for case, text in expected.items():
        for rank, msg in enumerate(run_ranks(_conflicting_layouts_rank, 3, case)):
            assert msg is not None and msg.startswith(f"rank {rank}: ") and text in msg, (case, msg)


def _uneven_with_empty_rank(rank, rows):
    t = torch.arange(rows[rank] * 3, dtype=torch.float32).reshape(rows[rank], 3) + 100 * rank
    return [x.clone() for x in comm.all_gather_uneven(t)]


def test_all_gather_uneven_with_zero_rows_on_some_or_all_ranks():
    for rows in ([2, 0, 1], [0, 0, 0], [0, 3, 0]):
        expected = [torch.arange(r * 3, dtype=torch.float32).reshape(r, 3) + 100 * k for k, r in enumerate(rows)]
        for got in run_ranks(_uneven_with_empty_rank, 3, rows):
            assert [g.shape for g in got] == [e.shape for e in expected]
            assert all(torch.equal(g, e) for g, e in zip(got, expected))


def _padded_eval_rank(rank, n):
    # the training partition (pad=True) repeats samples; gather_results keeps each once
    sampler = DistributedSampler(Scored(n), shuffle=True, seed=3)
    idx = list(sampler)
    ds = Scored(n)
    return gather_results(_model(ds.x[idx])[0], idx, num_samples=n)


def test_gather_drops_padding_repeats_across_ranks():
    n = 7
    results = run_ranks(_padded_eval_rank, 3, n)
    ref = _model(Scored(n).x)[0]
    assert all(torch.equal(r, ref) for r in results)


def _train_part(rank, n, batch_size, stop_after, state):
    loader = prepare_dataloader(Scored(n), batch_size, seed=5)
    if state is not None:
        loader.load_state_dict(state)
    loader.set_epoch(2)
    seen = []
    for b, (x, _) in enumerate(loader):
        # identify the samples by their features (the dataset has no duplicates)
        seen += [int(torch.nonzero((Scored(n).x == row).all(1))[0]) for row in x]
        if stop_after is not None and b + 1 == stop_after:
            break
    states = comm.all_gather_object(loader.state_dict()["sampler"])
    return seen, DistributedSampler.merge_states(states)


def test_resume_on_fewer_ranks_sees_exactly_the_unseen_samples():
    n = 29
    first = run_ranks(_train_part, 3, n, 2, 2, None)  # 3 ranks, 2 batches of 2 each, then stop
    seen = [i for s, _ in first for i in s]
    assert len(seen) == 12 and len(set(seen)) == 12
    merged = first[0][1]
    assert merged["consumed"] == [4, 4, 4] and merged["num_replicas"] == 3
    second = run_ranks(_train_part, 2, n, 3, None, merged)  # 2 ranks finish the epoch
    rest = [i for s, _ in second for i in s]
    unseen = set(range(n)) - set(seen)
    assert set(rest) == unseen and len(rest) == len(unseen) + (-len(unseen)) % 2
    assert len(second[0][0]) == len(second[1][0])  # equal shards: lockstep DDP can finish the epoch


def _mpf_rank(rank, marker_dir, local, fail):
    world = dptrain.get_world()
    if local:
        # pretend to be 2 nodes of 2 ranks: leaders are ranks 0 and 2
        from dptrain.runtime import env

        env._STATE.world = dataclasses.replace(world, local_rank=rank % 2, local_world_size=2, node_rank=rank // 2)
    node = rank // 2 if local else 0
    leader = (rank % 2 == 0) if local else rank == 0
    marker = os.path.join(marker_dir, f"ready.{node}")
    n = dptrain.world_size()
    followers = [r for r in range(n) if (r // 2 == node and r % 2 != 0)] if local else list(range(1, n))
    if not leader:
        set_event(os.path.join(marker_dir, f"arrived.{rank}"))
    try:
        with main_process_first(local=local):
            if leader:
                # A slow download: it ends only once every follower has come to the gate, so a
                # follower let through early would find no marker.
                for r in followers:
                    wait_event(os.path.join(marker_dir, f"arrived.{r}"))
                if fail:
                    raise OSError("download failed")
                with open(marker, "w") as f:
                    f.write("x")
                return ("led", True)
            return ("followed", all(os.path.exists(os.path.join(marker_dir, f"ready.{k}")) for k in range(node + 1)))
    except Exception as exc:  # noqa: BLE001 - the test checks which error each rank got
        return (type(exc).__name__, str(exc))


def _check_leader_first(tmp_path, local):
    results = run_ranks(_mpf_rank, 4, str(tmp_path), local, False)
    leaders = {0, 2} if local else {0}
    for rank, (role, ok) in enumerate(results):
        assert role == ("led" if rank in leaders else "followed") and ok is True
    ready = ["ready.0", "ready.1"] if local else ["ready.0"]
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ready")) == ready


def test_main_process_first_runs_rank_0_first(tmp_path):
    _check_leader_first(tmp_path, local=False)


def test_main_process_first_local_runs_each_node_leader_first(tmp_path):
    _check_leader_first(tmp_path, local=True)


def test_main_process_first_failure_on_rank_zero_does_not_hang(tmp_path):
    results = run_ranks(_mpf_rank, 3, str(tmp_path), False, True, timeout=60)
    assert results[0] == ("OSError", "download failed")
    for rank in (1, 2):
        kind, msg = results[rank]
        assert kind == "RuntimeError" and f"rank {rank}:" in msg and "failed on rank 0: OSError: download failed" in msg
    assert sorted(os.listdir(tmp_path)) == ["arrived.1", "arrived.2"]  # no marker
