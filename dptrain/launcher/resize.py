"""In-place recovery across nodes: a node lost for good (``--recovery in-place``, several nodes).

[Note: a node lost for good]
A rank that dies on a node whose launcher lives is replaced by that launcher (see ``inplace``).
When the whole node goes -- its launcher and its ranks -- nobody is there to replace them, so
node 0's launcher, which hosts the store and cannot be the node lost, decides instead:

* every launcher adds to its *beat* (``recovery/node-beat/<node id>`` among the attempt's keys)
  every ``BEAT_S`` seconds, from a thread with its own connection, so that a watch loop busy
  with a replacement never looks like a dead node;
* node 0 reads the beats once a second; a node whose beat has not moved for ``lost_s``
  seconds (three rank heartbeat intervals and a second, as for a rank's heartbeat; the
  survivors wait for a new generation longer than that, see ``dptrain.train.recovery``) is
  lost;
* with ``--nnodes MIN:MAX``, at least MIN nodes left, restarts left, and every rank able to
  go on in place on another world size (``recovery/resizable/<rank>``, written by a Trainer
  whose loaders can re-split an epoch), node 0 takes the next generation number and writes a
  *resize* generation: the nodes left, in their order (node 0 first, the others as they
  were), the ranks' new numbers (``renumber``: old -> new; ranks keep their order, so node
  0's never change) and the new world size. The survivors' ranks re-form the process group at
  that size, without a restart, and their Trainer shares the rest of the epoch out anew (see
  ``dptrain.train.recovery``);
* every launcher applies each resize generation as it appears (``Nodes.catch_up``, once a
  second, and before it takes a generation of its own for a replacement, so that the rank it
  names is in the numbering of the generation before): its node rank, first rank and world
  size, and its ranks' numbers and environment (``RANK``, ``WORLD_SIZE``, ...: a replacement
  starts with them). A launcher left out of a resize (it was cut off, not dead) stops its
  ranks and ends;
* otherwise (a fixed ``--nnodes``, fewer than MIN nodes left, a rank that cannot resize, no
  restart left) node 0 reports the failure and every launcher restarts the job the usual way,
  where membership decides again which nodes take part.

A resize counts as one restart of ``--max-restarts``, as a replacement does.

[Note: a node coming back]
With ``--nnodes MIN:MAX`` a launcher that starts while an attempt runs registers at it (see
``membership``) and, left out of the attempt's members, waits. Node 0 reads the attempt's
arrivals once a second; one from a launcher that was never a member (a new token) and whose
node is not a member lets it in, while there is room under MAX and every rank can resize:
node 0 writes a resize generation with the new nodes appended (their ranks take the next
numbers; no rank is renumbered; ``joining`` names the new ranks), then
``launcher/elastic/<attempt>/admitted/<token>`` with the nodes and the generation. The
launcher so admitted starts its ranks in that generation (``DPTRAIN_GENERATION``), as
replacements: they build the script's model and Trainer and wait in the group's rendezvous
(``dptrain.runtime.regroup.form``). The running ranks must meet them at a step boundary -- nothing
fails to bring them there -- so every ``ADMIT_EVERY_STEPS`` optimizer steps (see
``dptrain.train.recovery``) and at each epoch end they check (``DPTRAIN_RECOVERY_ADMIT``, set
for the ranks of an elastic job): rank 0 asks the store whether a newer generation is
announced and all its newcomers have arrived
(``dptrain.runtime.regroup.newcomers_ready``), and one all-reduce of that answer makes every rank
take the same decision at the same step. Then they re-form the group and the newcomers get a
live rank's state (see ``dptrain.train.recovery``). Waiting for the newcomers to arrive first
keeps the running ranks from idling through their start. A newcomer that arrives after the
job has finished (``recovery/finished``) exits 0. Letting a node in is not a restart: node 0
counts admissions (``recovery/admissions``) apart from the generations that recover failures.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from dptrain.runtime.heartbeat import recovery_key
from dptrain.runtime.join import ranks_text
from dptrain.launcher import store_values
from dptrain.launcher.membership import PREFIX, admitted_key, max_arrivals, place, ranks_of
from dptrain.launcher.rendezvous import failed_key
from dptrain.launcher.store import StoreClient
from dptrain.launcher.watch import publish

__all__ = ["Nodes", "BEAT_S", "ENTRY_WAIT_S"]

#: Seconds between two beats of a launcher.
BEAT_S = 0.5
#: Seconds a generation number may be taken before its entry is written (``Nodes.catch_up`` before a
#: replacement waits that long for it).
ENTRY_WAIT_S = 5.0
#: The variables of a rank's environment that a resize changes, and where their values come from.
_RANK_VARS = {"RANK": "rank", "ROLE_RANK": "rank", "GROUP_RANK": "node_rank", "WORLD_SIZE": "world_size",
              "ROLE_WORLD_SIZE": "world_size", "GROUP_WORLD_SIZE": "num_nodes"}


class _Beat:
    """Adds 1 to ``key`` every ``BEAT_S`` seconds on a daemon thread, over a connection of its own."""

    def __init__(self, store_at: tuple, timeout: float, key: str) -> None:
        host, port, secret = store_at
        self._client = StoreClient(host, port, timeout=timeout, secret=secret)
        self._key = key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dptrain-node-beat")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._client.add(self._key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            self._stop.wait(BEAT_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._client.close()


def start_beat(job: Any, attempt: int) -> _Beat:
    """This node's launcher beats for ``attempt`` from now on (node 0 counts the beats, see
    ``Nodes._look_for_lost``); ``job``: the launcher's ``_Job``, its store served already."""
    return _Beat(job.store_at, job.config.wait_s, recovery_key(attempt, f"node-beat/{job.config.node_rank}"))


class Nodes:
    """One launcher's side of [Note: a node lost for good] for one attempt (``recovery``: its
    ``InPlaceRecovery``). ``tick`` runs once a second in the watch loop; ``close`` at its end.
    ``beat``: this node's beat for ``attempt``, started already (see ``start_beat``)."""

    def __init__(self, recovery: Any, attempt: int, beat: _Beat | None = None) -> None:
        job = recovery.job
        config = job.config
        self.recovery, self.job, self.attempt = recovery, job, attempt
        self.node_id = config.node_rank
        if job.elastic is not None:
            self.members = [dict(m) for m in job.elastic.members]
        else:
            self.members = [{"node": i, "nproc": config.nproc_per_node, "token": "0"} for i in range(config.nnodes)]
        self.applied = recovery.joined_at  # every generation after the one this node's ranks started in
        self._tokens = {m["token"] for m in self.members}  # launchers that were members: never let in again
        self._arrivals_read = 0  # arrivals at this attempt read so far (node 0)
        self._waiting: list[dict] = []  # launchers that arrived while the attempt runs, not let in yet
        self.lost_s = recovery.fresh_s  # the survivors wait longer than this for a new generation
        self.dropped: str | None = None  # why this node was left out of the job (it then ends)
        self._seen: dict[int, tuple[int, float]] = {}  # node id -> (its beat, since when it has not moved)
        if beat is None and config.nnodes > 1:
            beat = start_beat(job, attempt)
        self._beat = beat

    def _beat_key(self, node: int) -> str:
        return recovery_key(self.attempt, f"node-beat/{node}")

    def close(self) -> None:
        if self._beat is not None:
            self._beat.close()

    # -- every launcher ------------------------------------------------------------------------
    def tick(self) -> str | None:
        """Apply the resizes announced so far; node 0 also looks for lost nodes. Returns a failure
        text when the attempt must end (this node was left out, or node 0 restarts the job)."""
        self.catch_up()
        if self.dropped is not None:
            return self.dropped
        if self.node_id != 0:
            return None
        ended = self._look_for_lost() if len(self.members) > 1 else None
        if ended is None and self.job.elastic is not None:
            self._look_for_arrivals()
        return ended

    def catch_up(self, upto: int | None = None, wait_s: float = 0.0) -> None:
        """Apply every generation announced (before ``upto``, when given) that is not applied yet;
        wait up to ``wait_s`` seconds for one whose number was taken but whose entry is not written yet."""
        store, warn = self.job.store, self.job.warnings
        last = self.recovery._count(self.attempt) if upto is None else upto - 1
        deadline = time.monotonic() + wait_s
        while self.applied < last:
            g = self.applied + 1
            entry = store_values.read(store, recovery_key(self.attempt, f"generation/{g}"), store_values.generation,
                                      warn)
            if entry is None:
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.01)
                continue
            if entry["kind"] == "resize":
                self._apply(entry)
            self.applied = g

    def _apply(self, entry: dict) -> None:
        """A resize: this node's new place, its ranks' new numbers (see the Note)."""
        job = self.job
        layout = place(entry["nodes"], self.node_id)
        self.members = [dict(n) for n in entry["nodes"]]
        if layout is None:
            self.dropped = (f"node {self.node_id} was left out of the job: {entry['why']}; its ranks are "
                            f"stopped (start it again to rejoin the job at its next restart)")
            return
        job.layout = layout
        exits = job.watching.exits if job.watching is not None else {}
        for proc in job.ranks:
            new = layout.rank_base + proc.local_rank
            if new != proc.rank and proc.rank in exits:
                exits[new] = exits.pop(proc.rank)
            proc.renumber(new)
            values = {"rank": new, "node_rank": layout.node_rank, "world_size": layout.world_size,
                      "num_nodes": layout.num_nodes}
            proc.environ.update({name: str(values[field]) for name, field in _RANK_VARS.items()})
        self.recovery.forget_progress(renumbered=True)  # heartbeats are read by rank number

    # -- node 0 --------------------------------------------------------------------------------
    def _look_for_lost(self) -> str | None:
        store, now = self.job.store, time.monotonic()
        lost = []
        for m in self.members:
            if m["node"] == self.node_id:
                continue
            beat = int(store.add(self._beat_key(m["node"]), 0))
            seen = self._seen.get(m["node"])
            if seen is None or seen[0] != beat:
                self._seen[m["node"]] = (beat, now)
                continue
            # A node that has not beaten yet may still be starting: it gets three times as long.
            if now - seen[1] >= (self.lost_s if beat else 3 * self.lost_s):
                lost.append(m)
        return self._lose(lost, now) if lost else None

    def _lose(self, lost: list[dict], now: float) -> str | None:
        """Resize the job without the ``lost`` nodes, or end the attempt (see the Note)."""
        job, config = self.job, self.job.config
        gone = {m["node"] for m in lost}
        old = ranks_of(self.members)
        left = [m for m in self.members if m["node"] not in gone]
        lost_ranks = [r for m in lost for r in old[m["node"]]]
        silent = max(now - self._seen[m["node"]][1] for m in lost)
        what = (f"node(s) {', '.join(str(n) for n in sorted(gone))} (rank(s) {ranks_text(lost_ranks)}) stopped "
                f"answering: no sign of life from its launcher for {silent:.0f}s")
        why_not = self._why_not_resize(left)
        generation = None
        if why_not is None:
            generation = job.store.add(recovery_key(self.attempt, "count"), 1)
            restart = self.recovery.restarts_spent(self.attempt)
            if restart > config.max_restarts:
                why_not = f"no restart is left (--max-restarts {config.max_restarts})"
        if why_not is not None:
            text = f"{what}; {why_not}"
            publish(job.store, failed_key(self.attempt), store_values.failure_text(config.node_rank, text))
            self.recovery.why_not = ("resize", f"in-place recovery cannot go on without a node: {why_not}")
            return text
        new = ranks_of(left)
        renumber = [[o, n] for m in left for o, n in zip(old[m["node"]], new[m["node"]])]
        world = sum(m["nproc"] for m in left)
        entry = {"kind": "resize", "nodes": left, "why": what, "renumber": renumber, "world_size": world,
                 "lost": sorted(gone), "rank": lost_ranks, "time": time.time(), "spare": False}
        job.store.set(recovery_key(self.attempt, f"generation/{generation}"), json.dumps(entry))
        moved = [(o, n) for o, n in renumber if o != n]
        renamed = f"; rank(s) {', '.join(f'{o}->{n}' for o, n in moved)} renumbered" if moved else ""
        job.log(f"dptrain run: {what}; in-place recovery: the job goes on without it, with {world} rank(s) on "
                f"node(s) {', '.join(str(m['node']) for m in left)} (generation {generation}, restart {restart} of "
                f"{config.max_restarts}){renamed}; the other ranks keep running")
        for m in lost:
            self._seen.pop(m["node"], None)
        self.catch_up()  # this launcher's own place changes too (its world size, at least)
        return None

    def _look_for_arrivals(self) -> None:
        """Let launchers that arrived at this attempt while it runs into it (see [Note: a node
        coming back]), as many as ``--nnodes MIN:MAX`` has room for."""
        job, config, store = self.job, self.job.config, self.job.store
        base = f"{PREFIX}/{self.attempt}"
        count = min(int(store.add(f"{base}/arrivals", 0)), max_arrivals(config.nnodes))
        while self._arrivals_read < count:
            i = self._arrivals_read + 1
            entry = store_values.read(store, f"{base}/arrival/{i}", store_values.arrival, job.warnings)
            if entry is None:
                break  # its number is taken, its entry not written yet: read it at the next tick
            self._arrivals_read = i
            known = {m["node"] for m in self.members} | {a["node"] for a in self._waiting}
            if entry["token"] not in self._tokens and entry["node"] not in known:
                self._waiting.append(entry)
        room = config.nnodes - len(self.members)
        if not self._waiting or room <= 0:
            return
        blocker = self.recovery._blocker(self.attempt, resizing=True, growing=True)
        if blocker is not None:
            self.recovery.why_not = ("admit", f"node(s) {', '.join(str(a['node']) for a in self._waiting)} arrived, "
                                              f"but the job cannot take them in place: {blocker[1].split(';')[0]}; "
                                              f"they join at the next restart")
            self.recovery.say_why_not()
            return
        self._admit(self._waiting[:room])
        self._waiting = self._waiting[room:]

    def _admit(self, chosen: list[dict]) -> None:
        job, config, store = self.job, self.job.config, self.job.store
        nodes = self.members + chosen
        old, new = ranks_of(self.members), ranks_of(nodes)
        joining = [r for a in chosen for r in new[a["node"]]]
        world = sum(m["nproc"] for m in nodes)
        ids = ", ".join(str(a["node"]) for a in chosen)
        what = f"node(s) {ids} arrived (rank(s) {ranks_text(joining)})"
        store.add(recovery_key(self.attempt, "admissions"), 1)  # first: a node let in is not a restart
        generation = store.add(recovery_key(self.attempt, "count"), 1)
        entry = {"kind": "resize", "nodes": nodes, "why": what, "world_size": world, "joining": joining,
                 "renumber": [[r, r] for ranks in old.values() for r in ranks], "rank": joining, "time": time.time(),
                 "spare": False}
        store.set(recovery_key(self.attempt, f"generation/{generation}"), json.dumps(entry))
        for a in chosen:
            store.set(admitted_key(self.attempt, a["token"]), json.dumps({"nodes": nodes, "generation": generation}))
            self._tokens.add(a["token"])
        job.log(f"dptrain run: {what}; in-place recovery lets it in: the job goes on with {world} rank(s) on node(s) "
                f"{', '.join(str(m['node']) for m in nodes)} from the first step boundary after its ranks are ready "
                f"(generation {generation}); they get the training state from a live rank")
        self.catch_up()

    def _why_not_resize(self, left: list[dict]) -> str | None:
        """Why the job cannot go on in place without the lost nodes, or None."""
        config = self.job.config
        if self.job.elastic is None:
            return (f"a job of --nnodes {config.nnodes} cannot go on without a node (with --nnodes MIN:MAX it goes on "
                    f"in place on the nodes left); restarting all ranks")
        if len(left) < (config.min_nodes or config.nnodes):
            return (f"{len(left)} node(s) are left, fewer than the {config.min_nodes} of --nnodes "
                    f"{config.min_nodes}:{config.nnodes}; restarting all ranks")
        blocker = self.recovery._blocker(self.attempt, resizing=True)
        return None if blocker is None else blocker[1]

