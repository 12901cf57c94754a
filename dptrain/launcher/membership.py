"""Elastic membership: which nodes take part in each attempt of a job (``--nnodes MIN:MAX``).

[Note: elastic attempts]
With a fixed ``--nnodes N`` every attempt runs on the same N nodes, and a node that is gone
for good ends the job. With ``--nnodes MIN:MAX`` the node set is decided again at the start
of every attempt, in the rendezvous store that node 0's launcher hosts:

1. node 0 opens attempt k (``<prefix>/current = k``);
2. every launcher that wants to take part registers (an arrival number from ``add``, then
   its node id, its number of ranks and a token unique to that launcher);
3. node 0 waits until MAX nodes have arrived, or until ``join_timeout`` seconds have passed
   with at least MIN of them, and writes the members in node-id order (itself first):
   their order gives every node its node rank and its first global rank for attempt k;
4. a launcher that arrived too late is not a member: it waits for the next restart (the
   key ``launcher/failed/<k>`` that every restart starts from) and registers again, so a
   node that comes back is admitted at the next restart. When the job ends, node 0 writes
   ``<prefix>/done``, and a node still waiting ends too.

A lost node shows up as a failure of the ranks that talk to it (their connections close,
or their collective times out); the job restarts (``--max-restarts``), and the node that
does not come back within ``join_timeout`` is left out: the ranks start as a smaller world
and the Trainer resumes from the newest checkpoint on the new world size, where its sampler
gives every sample not yet seen in the epoch to exactly one rank. Node 0 hosts the store,
so it cannot be the node that is lost (as with torchrun's built-in rendezvous).

Every value read here is checked (see [Note: the store is not trusted] in ``store_values``):
an arrival, a list of members or an attempt number that is not what a launcher writes is
ignored, with one warning line, as if it were not there.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Callable

from dptrain.launcher import store_values
from dptrain.launcher.rendezvous import failed_key
from dptrain.launcher.store_values import Warnings

PREFIX = "launcher/elastic"
DONE = f"{PREFIX}/done"
_POLL_S = 0.2


def max_arrivals(max_nodes: int) -> int:
    """Arrivals node 0 reads per attempt: every node's, with room for launchers started twice."""
    return 4 * max_nodes + 16


@dataclasses.dataclass(frozen=True)
class Membership:
    """This node's place in one attempt: its node rank, the first global rank of its ranks,
    how many nodes and ranks the attempt has, and the node ids of the nodes left out."""

    node_rank: int
    rank_base: int
    num_nodes: int
    world_size: int
    nodes: tuple[int, ...]


def ranks_of(nodes: list[dict]) -> dict[int, list[int]]:
    """node id -> the global ranks of its processes, for ``nodes`` (arrivals) in node-rank order."""
    out, base = {}, 0
    for n in nodes:
        out[n["node"]] = list(range(base, base + n["nproc"]))
        base += n["nproc"]
    return out


def place(nodes: list[dict], node_id: int) -> Membership | None:
    """``node_id``'s place among ``nodes`` (arrivals in node-rank order); None when it is not among them."""
    ids = [n["node"] for n in nodes]
    if node_id not in ids:
        return None
    return Membership(node_rank=ids.index(node_id), rank_base=ranks_of(nodes)[node_id][0], num_nodes=len(nodes),
                      world_size=sum(n["nproc"] for n in nodes), nodes=tuple(ids))


def admitted_key(attempt: int, token: str) -> str:
    """Where node 0 lets a launcher into ``attempt`` while it runs (see ``resize``)."""
    return f"{PREFIX}/{attempt}/admitted/{token}"


class Elastic:
    """One launcher's side of the protocol in the note above.

    ``store`` is the rendezvous store; ``node_id`` this launcher's ``--node-rank`` (0: the
    coordinator); ``log`` prints a launcher line; ``interrupted`` raises when a signal
    arrived (waits call it between polls); ``warnings`` reports malformed values (default: one
    of its own, through ``log``).
    """

    def __init__(self, store: Any, node_id: int, nproc: int, min_nodes: int, max_nodes: int,
                 join_timeout: float, timeout: float, log: Callable[[str], None],
                 interrupted: Callable[[], None], warnings: Warnings | None = None) -> None:
        self.store = store
        self.node_id = node_id
        self.nproc = nproc
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.join_timeout = join_timeout
        self.timeout = timeout
        self.log = log
        self.interrupted = interrupted
        self.warn = warnings or Warnings(log)
        self.token = uuid.uuid4().hex
        self.last_nodes: tuple[int, ...] | None = None
        self.members: list[dict] = []  # the nodes of the attempt joined last, in node-rank order
        self.admitted: tuple[Membership, int] | None = None  # let into a running attempt: (place, generation)

    @property
    def coordinator(self) -> bool:
        return self.node_id == 0

    # ---- the attempt to join
    def first_attempt(self) -> int:
        """The attempt this launcher can join first: 0 for node 0, else the one node 0 has opened."""
        if self.coordinator:
            return 0
        return self._wait_for(f"{PREFIX}/current", store_values.attempt_number, self.timeout, "node 0 to open the job")

    def join(self, attempt: int) -> Membership | None:
        """Register for ``attempt`` and return this node's place in it (None: not admitted)."""
        if self.coordinator:
            self.store.set(f"{PREFIX}/current", str(attempt))
        base = f"{PREFIX}/{attempt}"
        arrival = self.store.add(f"{base}/arrivals", 1)
        self.store.set(f"{base}/arrival/{arrival}",
                       json.dumps({"node": self.node_id, "nproc": self.nproc, "token": self.token}))
        if self.coordinator:
            members = self._decide(attempt)
        else:
            members = self._wait_for(f"{base}/members", store_values.members, self.timeout + self.join_timeout,
                                     f"node 0 to start attempt {attempt}")
        if "error" in members:
            raise ValueError(members["error"])
        if not any(m["token"] == self.token for m in members["nodes"]):
            return None
        self.members = list(members["nodes"])
        return place(self.members, self.node_id)

    def _arrivals(self, base: str) -> list[dict]:
        count = int(self.store.add(f"{base}/arrivals", 0))
        if count > max_arrivals(self.max_nodes):
            self.warn("arrivals counter", f"{base}/arrivals", f"{count} arrivals; a job of at most {self.max_nodes} "
                      f"nodes reads the first {max_arrivals(self.max_nodes)}")
            count = max_arrivals(self.max_nodes)
        found = []
        for i in range(1, count + 1):
            # An arrival number is taken just before its entry is written: one may be missing yet.
            entry = store_values.read(self.store, f"{base}/arrival/{i}", store_values.arrival, self.warn)
            if entry is not None:
                found.append(entry)
        return found

    def _decide(self, attempt: int) -> dict:
        """Node 0: wait for the nodes of ``attempt``, then write who takes part."""
        base = f"{PREFIX}/{attempt}"
        t0 = time.monotonic()
        while True:
            self.interrupted()
            arrived = self._arrivals(base)
            waited = time.monotonic() - t0
            distinct = {a["node"] for a in arrived}
            if len(distinct) >= self.max_nodes or (len(distinct) >= self.min_nodes and waited >= self.join_timeout):
                break
            if waited >= max(self.timeout, self.join_timeout):
                error = (f"only {len(distinct)} node(s) joined attempt {attempt} within {waited:.0f}s, fewer than "
                         f"the {self.min_nodes} that --nnodes {self.min_nodes}:{self.max_nodes} needs")
                self.store.set(f"{base}/members", json.dumps({"error": error}))
                raise ValueError(error)
            time.sleep(_POLL_S)
        chosen, seen = [], {}
        for a in sorted(arrived, key=lambda a: a["node"]):
            if a["node"] in seen:
                self.log(f"dptrain run: two launchers use --node-rank {a['node']}; the second is left out "
                         f"(give every node its own --node-rank)")
                continue
            seen[a["node"]] = a
            chosen.append(a)
        chosen = chosen[: self.max_nodes]
        members = {"nodes": chosen}
        self.store.set(f"{base}/members", json.dumps(members))
        nodes = tuple(a["node"] for a in chosen)
        if nodes != self.last_nodes and (self.last_nodes is not None or len(nodes) < self.max_nodes):
            gone = sorted(set(self.last_nodes or ()) - set(nodes))
            why = f"; node(s) {', '.join(map(str, gone))} did not rejoin within {self.join_timeout:.0f}s" if gone else ""
            self.log(f"dptrain run: attempt {attempt} runs on {len(nodes)} of at most {self.max_nodes} nodes "
                     f"(node(s) {', '.join(map(str, nodes))}), {sum(a['nproc'] for a in chosen)} rank(s){why}")
        self.last_nodes = nodes
        return members

    # ---- waiting outside the job
    def wait_for_next(self, attempt: int, in_place: bool = False) -> bool:
        """A node left out of ``attempt``: wait until it restarts (True), node 0 lets it into the
        running attempt (True, with ``admitted`` set; ``in_place``: in-place recovery, see
        ``resize``), or the job ends (False)."""
        self.admitted = None
        when = "at the next restart" + (", or at a step boundary once node 0 lets it in" if in_place else "")
        self.log(f"dptrain run: node {self.node_id} was not admitted to attempt {attempt} (it started without "
                 f"this node); waiting to join {when}")
        while True:
            self.interrupted()
            try:
                if self.store.check([DONE]):
                    return False
                if self.store.check([failed_key(attempt)]):
                    return True
                let_in = (store_values.read(self.store, admitted_key(attempt, self.token), store_values.admission,
                                            self.warn) if in_place else None)
            except Exception:  # noqa: BLE001 - node 0's store is gone: the job is over
                return False
            if let_in is not None and (layout := place(let_in["nodes"], self.node_id)) is not None:
                self.members = list(let_in["nodes"])
                self.admitted = (layout, let_in["generation"])
                return True
            time.sleep(_POLL_S)

    def finish(self) -> None:
        """Node 0, at the end of the job: nodes still waiting to be admitted end too."""
        try:
            self.store.set(DONE, "1")
        except Exception:  # noqa: BLE001 - best effort
            pass

    def _wait_for(self, name: str, parse: Callable[[bytes], Any], timeout: float, what: str) -> Any:
        """The value of ``name`` once it is there and well-formed (see ``store_values``)."""
        t0 = time.monotonic()
        while (value := store_values.read(self.store, name, parse, self.warn)) is None:
            self.interrupted()
            if time.monotonic() - t0 > timeout:
                raise ValueError(f"node {self.node_id} waited {timeout:.0f}s for {what}; is node 0's launcher "
                                 f"running with the same --nnodes MIN:MAX?")
            time.sleep(_POLL_S)
        return value
