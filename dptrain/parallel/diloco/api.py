"""DiLoCo: local inner steps, a rare outer step on the replicas' averaged pseudo-gradients.

[Note: the arithmetic of a sync]
Each fragment keeps fp32 "outer" weights: the fragment's weights at the start of its round,
the same on every replica. At the fragment's sync a rank computes its pseudo-gradient
``outer - current`` in fp32, the replicas average it (``_exchange.py``: one sum, then one
division, the same bits everywhere), it becomes the ``.grad`` of the outer weights, and a
``torch.optim.SGD`` (lr ``outer_lr``, ``outer_momentum``, Nesterov) steps them. The model's
weights then take the new outer weights (cast to their dtype), mixed as ``alpha * local +
(1 - alpha) * outer`` when ``fragment_update_alpha`` is above 0. With ``alpha`` 0 every
replica leaves a sync with the same bits.

[Note: buffers]
At the end of each round (every ``sync_every`` steps, and in :meth:`DiLoCo.sync_now`) the
floating-point buffers (BatchNorm's running statistics) are averaged over the replicas and
the others (``num_batches_tracked``) copied from the first replica, so every replica
evaluates alike.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import nn

from dptrain import comm
from dptrain.runtime import env
from dptrain.parallel.ddp import _recovery as ddp_recovery
from dptrain.parallel.diloco import _codec, _fragments, _groups
from dptrain.parallel.diloco._exchange import Exchange

__all__ = ["DiLoCo", "check_trainer_settings", "TRAINER_KEYS"]


class DiLoCo:
    """Train replicas apart for ``sync_every`` inner steps, then take one outer step together.

    DiLoCo (Douillard et al., 2023): each replica takes ``sync_every`` (H) steps of its own
    optimizer (the paper: AdamW) alone; then the replicas average their pseudo-gradients
    (the round's starting weights minus the current weights) and take one outer Nesterov SGD
    step from the starting weights. Communication drops H-fold against DDP, which suits
    replicas joined by slow links (clusters, clouds, continents). Streaming DiLoCo's options
    sync the model in fragments, in turn, overlap each exchange with the next
    ``fragment_sync_delay`` inner steps, and send the pseudo-gradients in fewer bits.

    Call :meth:`step` after every inner ``optimizer.step()``. A plain model makes every rank
    a replica (exchanging over ``group``, default the world); a
    :class:`dptrain.DistributedDataParallel` model over the ranks of one node (see
    :func:`dptrain.parallel.diloco.node_group`) makes each node a replica, trained
    synchronously inside, and the nodes exchange through one group per local rank.

    Args:
        model: the ``nn.Module`` trained (or its DDP wrapper); its parameters and buffers are
            copied from the first replica here, so every replica starts alike.
        inner_optimizer: the optimizer of the inner steps (its parameters must be the
            model's); DiLoCo never steps it and keeps its state across rounds.
        sync_every: H, inner steps between two syncs of each fragment. Default 500.
        outer_lr: the outer SGD's learning rate. Default 0.7.
        outer_momentum: the outer SGD's momentum. Default 0.9.
        nesterov: Nesterov momentum for the outer SGD (ignored when ``outer_momentum`` is 0).
            Default True.
        num_fragments: parts of the model that sync in turn, staggered over the round.
            Default 1 (the whole model every H steps).
        fragment_sync_delay: tau, inner steps between a fragment's exchange starting and its
            result being applied (0: at once, blocking). Must be below ``sync_every``. Default 0.
        fragment_update_alpha: alpha, the weight of the local weights when a fragment takes the
            outer weights: ``alpha * local + (1 - alpha) * outer``. Default 0.0.
        compression: the pseudo-gradients' form on the wire: ``"fp32"`` (default), ``"bf16"``,
            ``"int8"`` or ``"int4"`` (per block of 128 elements, one fp32 scale).
        group: the process group of the exchange, every rank a replica. Default None: the
            world, or the rails between DDP groups for a DDP model.

    Attributes:
        bytes_sent: bytes this rank sent between replicas in outer exchanges (pseudo-gradients
            and buffers), counted as the ring algorithms send them: ``2 (n-1)/n * B`` for an
            all-reduce of B bytes over n replicas, ``(n-1) * B`` for an all-gather of B each.
        node_bytes_sent: bytes sent inside a node to share the averaged slices (hierarchical).
        num_syncs: fragment exchanges applied so far (with one fragment: outer steps taken).

    Raises:
        ValueError: ``sync_every < 1``, ``outer_lr <= 0``, ``outer_momentum`` outside [0, 1),
            ``num_fragments`` outside [1, min(sync_every, parameters)], ``fragment_sync_delay``
            outside [0, sync_every), ``fragment_update_alpha`` outside [0, 1], an unknown
            ``compression``, or an optimizer over parameters that are not the model's.
        RuntimeError: under a launcher without a process group (call ``dptrain.init()``).

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> diloco = dptrain.DiLoCo(model, opt, sync_every=100)
        >>> for x, y in loader:
        ...     loss_fn(model(x), y).backward()
        ...     opt.step(); opt.zero_grad()
        ...     diloco.step()
        >>> diloco.sync_now()        # every replica the same, e.g. before evaluating
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, sync_every: int = 500,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, num_fragments: int = 1,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0, compression: str = "fp32",
                 group: Any = None) -> None:
        _check_settings(sync_every, outer_lr, outer_momentum, num_fragments, fragment_sync_delay,
                        fragment_update_alpha)
        if not isinstance(model, nn.Module):
            raise TypeError(f"DiLoCo needs the nn.Module trained, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo needs the inner torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        env.check_joined("dptrain.DiLoCo")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = int(sync_every)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov)
        self.num_fragments = int(num_fragments)
        self.fragment_sync_delay = int(fragment_sync_delay)
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.compression = _codec.check_codec(compression)
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("DiLoCo: the model has no trainable parameters (none with requires_grad)")
        _check_optimizer(inner_optimizer, self._params)
        self._fragments = _fragments.split(self._params, self.num_fragments)
        self._offsets = _fragments.offsets(self.sync_every, self.num_fragments)
        self._group = group  # the user's exchange group, or None: the world (followed by _follow_world)
        self._topology = _groups.topology_for(model, group)
        self._buffers = [b for b in model.buffers()]
        with torch.no_grad():
            # Every replica starts from the first one's weights -- except in a process that replaces a dead
            # rank (``dptrain run --recovery in-place``): the others are not building anything, and its
            # replica comes from the dead rank's round snapshot (see dptrain.train.rollback).
            if not self._topology.alone and not ddp_recovery.is_joining():
                comm.broadcast_coalesced([p.data for p in self._params] + self._buffers, src=0,
                                         group=self._topology.outer, name="DiLoCo: the first replica's weights")
            self._outer = [p.detach().to(torch.float32, copy=True) for p in self._params]
        momentum = self.outer_momentum
        self._outer_optimizers = [
            torch.optim.SGD([self._outer[i] for i in frag], lr=self.outer_lr, momentum=momentum,
                            nesterov=self.nesterov and momentum > 0)
            for frag in self._fragments
        ]
        self._step = 0  # inner steps taken
        self._pending: list[tuple[int, int, Exchange]] = []  # (fragment, step it applies at, exchange)
        self.bytes_sent = 0
        self.node_bytes_sent = 0
        self.num_syncs = 0

    # ------------------------------------------------------------------ the loop
    @property
    def num_replicas(self) -> int:
        """Replicas that average their pseudo-gradients (nodes for a DDP-per-node model)."""
        return self._topology.outer_size

    @property
    def inner_step(self) -> int:
        """Inner steps taken so far (what :meth:`step` counted)."""
        return self._step

    def parameters(self) -> list[torch.Tensor]:
        """The model's trainable parameters, in the order DiLoCo keeps its outer weights."""
        return list(self._params)

    @contextlib.contextmanager
    def outer_weights(self) -> Iterator[None]:
        """Within the block, the model holds the outer weights -- the replicas' common weights of
        the last sync of each fragment, the same on every replica -- and its own afterwards.

        For evaluating or saving the common model in the middle of a round without syncing.

        Example:
            >>> with diloco.outer_weights():
            ...     torch.save(model.state_dict(), "common.pt")
        """
        with torch.no_grad():
            local = [p.detach().clone() for p in self._params]
            for p, outer in zip(self._params, self._outer):
                p.copy_(outer)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self._params, local):
                    p.copy_(mine)

    def step(self) -> None:
        """Count one inner step; sync the fragments whose turn it is.

        Applies the exchanges that were started ``fragment_sync_delay`` steps ago, starts
        those due at this step (every fragment's once per ``sync_every`` steps) and, at
        the end of each round, averages the buffers. Every replica must call it equally often.

        Raises:
            CollectiveError: a replica failed or stalled past the timeout during an exchange.
        """
        self._step += 1
        self._apply_due()
        for f in _fragments.due(self._step, self.sync_every, self._offsets):
            self._launch(f, self._step + self.fragment_sync_delay)
        self._apply_due()  # with no delay, the exchanges just started
        if self._step % self.sync_every == 0:
            self._sync_buffers()

    def sync_now(self) -> None:
        """Sync every fragment now and wait for it: afterwards every replica holds the same weights.

        Applies the exchanges in flight first, then averages every fragment's pseudo-gradient
        and takes its outer step (ignoring ``fragment_sync_delay``), and the buffers. The
        schedule goes on from the current step. Use it before evaluating or saving a final
        model. A fragment that no replica changed since its last sync keeps its weights (no
        outer step: momentum alone would move them), so calling it twice changes nothing.
        Collective: every replica calls it at the same point.
        """
        for f, _, exchange in sorted(self._pending, key=lambda e: e[1]):
            self._apply(f, exchange)
        self._pending = []
        for f in range(self.num_fragments):
            self._apply(f, self._exchange(f))
        self._sync_buffers()

    def _exchange(self, f: int) -> Exchange:
        with torch.no_grad():
            delta = torch.cat([(self._outer[i] - self._params[i].detach().float()).reshape(-1)
                               for i in self._fragments[f]])
        exchange = Exchange(delta, self._topology, self.compression,
                            f"DiLoCo outer exchange of fragment {f} at inner step {self._step}")
        self.bytes_sent += exchange.bytes_sent
        return exchange

    def _launch(self, f: int, apply_at: int) -> None:
        self._pending.append((f, apply_at, self._exchange(f)))

    def _apply_due(self) -> None:
        due = [e for e in self._pending if e[1] <= self._step]
        self._pending = [e for e in self._pending if e[1] > self._step]
        for f, _, exchange in due:
            self._apply(f, exchange)

    def _apply(self, f: int, exchange: Exchange) -> None:
        mean = exchange.result()
        self.node_bytes_sent += exchange.node_bytes_sent
        frag = self._fragments[f]
        alpha = self.fragment_update_alpha
        if not bool(mean.any()):
            # No replica moved since the fragment's last sync (sync_now() right after one, or before any
            # inner step): the outer weights stand. An SGD step on a zero gradient would still move them
            # by its momentum. The mean is the same bits on every replica, so all skip alike.
            with torch.no_grad():
                for i in frag:
                    self._params[i].copy_(self._outer[i])
            self.num_syncs += 1
            return
        with torch.no_grad():
            offset = 0
            for i in frag:
                n = self._outer[i].numel()
                self._outer[i].grad = mean[offset : offset + n].view_as(self._outer[i]).clone()
                offset += n
            self._outer_optimizers[f].step()
            for i in frag:
                self._outer[i].grad = None
                p = self._params[i]
                if alpha == 0.0:
                    p.copy_(self._outer[i])
                else:
                    p.copy_(torch.lerp(self._outer[i], p.detach().float(), alpha))
        self.num_syncs += 1

    def _sync_buffers(self) -> None:
        top = self._topology
        if top.alone or not self._buffers:
            return
        floats = [b for b in self._buffers if b.is_floating_point()]
        others = [b for b in self._buffers if not b.is_floating_point()]
        with torch.no_grad():
            if floats:
                flat = torch.cat([b.detach().float().reshape(-1) for b in floats])
                comm.all_reduce(flat, "sum", group=top.outer)
                flat.div_(top.outer_size)
                self.bytes_sent += 2 * (top.outer_size - 1) * flat.numel() * 4 // top.outer_size
                offset = 0
                for b in floats:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
            if others:
                comm.broadcast_coalesced(others, src=0, group=top.outer, name="DiLoCo: the first replica's buffers")

    def _drop_in_flight(self) -> None:
        """Forget the exchanges in flight without waiting for them: their process group is broken (a
        replica died) and the state is about to be rolled back (see dptrain.train.rollback)."""
        self._pending = []

    def _follow_world(self, node: Any = None) -> None:
        """In-place recovery re-formed the world (see [Note: DiLoCo without a node] and [Note:
        DiLoCo's node replicas, recovered in place] in dptrain.train.rollback): exchange over the
        re-formed world from now on, among the replicas present. Collective (every member calls it,
        as after a re-form); the exchanges in flight are dropped (their group is gone). ``node``
        (default None: the DDP's own group): a DDP model's new node group, made after the re-form.

        Raises:
            RuntimeError: DiLoCo was built with a ``group`` of the user's, which cannot follow.
        """
        if self._group is not None:
            raise RuntimeError("DiLoCo built with a process group of its own cannot follow a re-formed world; build "
                               "it with group=None to go on without a lost node in place")
        self._pending = []
        self._topology = _groups.topology_for(self.model, None, node)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """DiLoCo's whole state: the step, the outer weights, the outer optimizers' momentum,
        the exchanges not yet applied (their averaged result) and the byte counters.

        The model's weights and the inner optimizer are not in it: save them as usual. An
        exchange still in flight is waited for, so every replica must call this at the same
        step (as a checkpoint does).
        """
        pending = [{"fragment": f, "apply_at": at, "mean": exchange.result().detach().cpu().clone()}
                   for f, at, exchange in self._pending]
        self.node_bytes_sent += sum(exchange.node_bytes_sent for _, _, exchange in self._pending)
        for _, _, exchange in self._pending:
            exchange.node_bytes_sent = 0  # counted once
        return {
            "step": self._step,
            "outer": [t.detach().cpu().clone() for t in self._outer],
            "outer_optimizers": [opt.state_dict() for opt in self._outer_optimizers],
            "pending": pending,
            "bytes_sent": self.bytes_sent,
            "node_bytes_sent": self.node_bytes_sent,
            "num_syncs": self.num_syncs,
            "settings": self._settings(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (on a DiLoCo built with the same settings).

        Raises:
            ValueError: the state was saved with another ``sync_every``, ``num_fragments`` or
                ``fragment_sync_delay``, or for parameters of other shapes; the message names it.
        """
        saved = state_dict.get("settings", {})
        for key, value in self._settings().items():
            if key in saved and saved[key] != value:
                raise ValueError(f"DiLoCo state saved with {key}={saved[key]!r} cannot resume with {key}={value!r}; "
                                 f"build DiLoCo with {key}={saved[key]!r} to resume it")
        outer = state_dict["outer"]
        shapes = [tuple(t.shape) for t in outer]
        if shapes != [tuple(t.shape) for t in self._outer]:
            raise ValueError(f"DiLoCo state holds outer weights of shapes {shapes}, but this model's trainable "
                             f"parameters have {[tuple(t.shape) for t in self._outer]}; load it into the same model")
        for _, _, exchange in self._pending:
            exchange.result()  # a collective in flight must end on every rank before it is dropped
        with torch.no_grad():
            for mine, theirs in zip(self._outer, outer):
                mine.copy_(theirs)
        for opt, sd in zip(self._outer_optimizers, state_dict["outer_optimizers"]):
            opt.load_state_dict(sd)
        device = self._outer[0].device
        self._pending = [(e["fragment"], e["apply_at"],
                          Exchange.finished(e["mean"].to(device), f"DiLoCo fragment {e['fragment']} (restored)"))
                         for e in state_dict["pending"]]
        self._step = int(state_dict["step"])
        self.bytes_sent = int(state_dict.get("bytes_sent", 0))
        self.node_bytes_sent = int(state_dict.get("node_bytes_sent", 0))
        self.num_syncs = int(state_dict.get("num_syncs", 0))

    def _settings(self) -> dict:
        return {"sync_every": self.sync_every, "num_fragments": self.num_fragments,
                "fragment_sync_delay": self.fragment_sync_delay}

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, "
                f"nesterov={self.nesterov}, num_fragments={self.num_fragments}, "
                f"fragment_sync_delay={self.fragment_sync_delay}, fragment_update_alpha={self.fragment_update_alpha}, "
                f"compression={self.compression!r}, replicas={self.num_replicas})")


def _check_settings(sync_every: Any, outer_lr: Any, outer_momentum: Any, num_fragments: Any,
                    fragment_sync_delay: Any, fragment_update_alpha: Any) -> None:
    """ValueError naming the first setting out of range, with its value and the range."""
    def whole(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"DiLoCo({name}={value!r}) must be a whole number")
        return value

    if whole("sync_every", sync_every) < 1:
        raise ValueError(f"DiLoCo(sync_every={sync_every}) must be >= 1: the inner steps between two outer syncs "
                         f"(the paper uses 500; 1 syncs every step, like DDP)")
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        raise ValueError(f"DiLoCo(outer_lr={outer_lr!r}) must be a number > 0 (the paper uses 0.7; 1.0 without "
                         f"momentum takes the replicas' average as it is)")
    if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
        raise ValueError(f"DiLoCo(outer_momentum={outer_momentum!r}) must be in [0, 1) (the paper uses 0.9)")
    if not 1 <= whole("num_fragments", num_fragments) <= sync_every:
        raise ValueError(f"DiLoCo(num_fragments={num_fragments}) must be in [1, sync_every={sync_every}]: each "
                         f"fragment syncs at its own step of the round")
    if not 0 <= whole("fragment_sync_delay", fragment_sync_delay) < sync_every:
        raise ValueError(f"DiLoCo(fragment_sync_delay={fragment_sync_delay}) must be in [0, sync_every="
                         f"{sync_every}): a fragment's exchange is applied before its next one starts")
    if not (isinstance(fragment_update_alpha, (int, float)) and 0 <= fragment_update_alpha <= 1):
        raise ValueError(f"DiLoCo(fragment_update_alpha={fragment_update_alpha!r}) must be in [0, 1] "
                         f"(0: take the outer weights; 0.5: the mean of local and outer)")


def _check_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    mine = {id(p) for p in params}
    stray = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if stray:
        raise ValueError(f"DiLoCo: the inner optimizer steps {stray} tensor(s) that are not trainable parameters of "
                         f"the model; build the optimizer over model.parameters() of the model passed to DiLoCo")


#: The keys of ``TrainerConfig(diloco_kwargs=...)``: DiLoCo's settings and where replicas are.
TRAINER_KEYS = ("sync_every", "outer_lr", "outer_momentum", "nesterov", "num_fragments", "fragment_sync_delay",
                "fragment_update_alpha", "compression", "replica")


def check_trainer_settings(kwargs: dict) -> dict:
    """``TrainerConfig(diloco_kwargs=kwargs)`` checked as :class:`DiLoCo` would check them, with
    DiLoCo's defaults filled in; ValueError naming an unknown key or a value out of range."""
    unknown = sorted(set(kwargs) - set(TRAINER_KEYS))
    if unknown:
        raise ValueError(f"TrainerConfig(diloco_kwargs=...) does not know {unknown}; use {list(TRAINER_KEYS)}")
    full = {"sync_every": 500, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "num_fragments": 1,
            "fragment_sync_delay": 0, "fragment_update_alpha": 0.0, "compression": "fp32", "replica": "rank", **kwargs}
    if full["replica"] not in ("rank", "node"):
        raise ValueError(f"TrainerConfig(diloco_kwargs={{'replica': {full['replica']!r}}}) must be 'rank' (every rank "
                         f"a replica) or 'node' (DDP inside each node, DiLoCo between nodes)")
    _check_settings(full["sync_every"], full["outer_lr"], full["outer_momentum"], full["num_fragments"],
                    full["fragment_sync_delay"], full["fragment_update_alpha"])
    _codec.check_codec(full["compression"])
    return full
