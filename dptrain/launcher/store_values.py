"""What the launcher reads from the rendezvous store, checked before it is used.

[Note: the store is not trusted]
Whatever can reach the store's port can write any key: a rank's heartbeat, a node's arrival,
another node's failure report. A job with a secret lets only its own connections in (see
[Note: only the job gets in] in ``auth``), but a job across nodes without one, a rank's bug, or
anyone logged in on a node (loopback is not guarded) can still write there, so the launcher
treats every value it reads as input from outside. Each kind of value has one parser here
that returns it in the shape the launcher uses, or raises ``Malformed``; ``read`` treats a
malformed value as absent and says so in one warning line (``Warnings``: one per key, a few
keys per kind, so a writer of bad values cannot flood the log). A value written by something
else therefore neither crashes the launcher (a ``KeyError`` in the watch loop used to end
the job) nor ends the job: only a well-formed failure report does (``failure_report``).
Text that reaches the console loses its control characters first (``clean``), so a value
cannot move the cursor, clear the screen or recolour the terminal.

This module imports only the standard library: the store server uses ``clean`` too.
"""

from __future__ import annotations

import json
import math
import re
import sys
import unicodedata
from typing import Any, Callable, TypeVar

__all__ = ["Malformed", "Warnings", "clean", "read", "heartbeat", "left_note", "arrival", "members",
           "attempt_number", "generation", "admission", "failure_text", "failure_report", "fallback_note"]

T = TypeVar("T")

MAX_RAW = 64 * 1024  # no value the launcher reads is longer; a longer one is not parsed at all
MAX_TEXT = 2000  # characters of a failure report or an error the launcher shows

# [Note: counts past what a job can have]
# Every count a value carries is bounded by what a job can be, not by the 2**63 of a C integer:
# an arrival claiming 2**62 ranks had node 0 build a list of that many rank numbers
# (``membership.ranks_of``). ``dptrain run`` refuses the same bounds for its own flags (``preflight``), so a
# value this job's launchers write always passes.
#: Linux's ceiling on the kernel's pid_max (PID_MAX_LIMIT): no machine runs more tasks at once.
PID_MAX_LIMIT = 1 << 22
#: The most ranks one node can start (--nproc-per-node): each takes 3 tasks, its process and two
#: relay threads of its launcher (``preflight.TASKS_PER_RANK``), so no machine starts more.
MAX_NPROC_PER_NODE = PID_MAX_LIMIT // 3
#: The most ranks of a job (and so of nodes, each running one at least): node 0's store holds a
#: connection for each, and Linux's default ceiling on one process's open files (fs.nr_open)
#: is 2**20 -- ten times the largest jobs trained today.
MAX_WORLD_SIZE = 1 << 20
#: The most generations of in-place recovery: a generation reaches its ranks as DPTRAIN_GENERATION,
#: which takes at most this (``dptrain.runtime.settings``).
MAX_GENERATION = 10**9
#: A counter a rank keeps (collectives entered, steps): it grows by one, and 2**53 (a million a
#: second for 285 years) is the largest whole number every JSON reader keeps exact.
MAX_COUNTER = 2**53
#: Process ids are a C int (pid_t) on every system.
MAX_PID = 2**31 - 1

_CSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # a terminal escape sequence: removed whole, not just its ESC
_FAILURE = re.compile(r"on node (\d{1,9}): \S")
_TOKEN = re.compile(r"[0-9a-f]{1,64}")


class Malformed(ValueError):
    """A value in the store that is not what the launcher writes or reads there."""


def clean(text: str | bytes, limit: int = MAX_TEXT) -> str:
    """``text`` on one line without control characters, cut to ``limit`` characters.

    Removes terminal escape sequences whole, then every character of Unicode's category C
    (control characters, newlines and tabs, format characters such as bidirectional overrides,
    unassigned code points). Bytes are decoded as UTF-8, invalid sequences replaced.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "replace")
    text = "".join(ch for ch in _CSI.sub("", text) if unicodedata.category(ch)[0] != "C")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Warnings:
    """Says once per key that a malformed value was ignored, for at most ``keys_per_kind``
    keys of each kind; after that, once per kind, that further ones go unreported.

    ``log`` prints one launcher line (default: standard error).
    """

    def __init__(self, log: Callable[[str], None] | None = None, keys_per_kind: int = 5) -> None:
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.keys_per_kind = keys_per_kind
        self._seen: dict[str, set[str]] = {}

    def __call__(self, kind: str, key: str, why: str) -> None:
        seen = self._seen.setdefault(kind, set())
        if key in seen or len(seen) > self.keys_per_kind:
            return
        seen.add(key)
        if len(seen) > self.keys_per_kind:
            self.log(f"dptrain run: further malformed values in the rendezvous store ({kind}) are ignored without "
                     f"a warning")
            return
        self.log(clean(f"dptrain run: ignored a malformed {kind} in the rendezvous store (key {key!r}): {why}; "
                       f"something other than this job's dptrain wrote it", limit=400))


def read(store: Any, name: str, parse: Callable[[bytes], T], warn: Warnings) -> T | None:
    """The value of key ``name`` as ``parse`` returns it; None when the key is absent or its
    value is malformed (said once through ``warn``). Errors of the store itself (it is gone)
    pass through to the caller."""
    if not store.check([name]):
        return None
    raw = store.get(name)
    try:
        return parse(raw)
    except Malformed as exc:
        warn(_KINDS.get(parse, "value"), name, str(exc))
        return None


# -- the values -------------------------------------------------------------------------------
def _json_object(raw: bytes) -> dict:
    if len(raw) > MAX_RAW:
        raise Malformed(f"{len(raw)} bytes, more than the {MAX_RAW} any such value has")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested too deep
        raise Malformed(f"not JSON ({_short(exc)}): {_short(raw)}") from None
    if not isinstance(value, dict):
        raise Malformed(f"a JSON {type(value).__name__}, not an object: {_short(raw)}")
    return value


def _whole(obj: dict, name: str, maximum: int, minimum: int = 0, default: int | None = None) -> int:
    """The whole number ``obj[name]`` in ``minimum``..``maximum`` (see [Note: counts past what a job can have])."""
    if name not in obj and default is not None:
        return default
    value = _field(obj, name)
    if type(value) is not int or not minimum <= value <= maximum:  # bool is an int, but not a count
        raise Malformed(f"{name!r} is {_short(json.dumps(value))}, not a whole number from {minimum} to {maximum}")
    return value


def _text(obj: dict, name: str, limit: int) -> str:
    value = _field(obj, name)
    if not isinstance(value, str) or len(value) > limit:
        raise Malformed(f"{name!r} is {_short(json.dumps(value))}, not a text of at most {limit} characters")
    return value


def _field(obj: dict, name: str) -> Any:
    if name not in obj:
        raise Malformed(f"no {name!r} in {_short(json.dumps(obj))}")
    return obj[name]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, (bytes, bytearray)) else str(value)
    return clean(text, limit)


def heartbeat(raw: bytes) -> dict:
    """A rank's heartbeat (``hb/<rank>``, see [Note: heartbeats] in ``dptrain.runtime.heartbeat``):
    collectives entered (``seq``), the one it is in (``op``, "" outside any), the Trainer's
    steps (``ticks``), DDP's synced steps (``ddp_steps``, 0 if absent), the process that wrote
    it (``pid``, None if absent: a heartbeat left by a rank that was since replaced is not its
    replacement's), whether a collective of its own failed (``failed``, False if absent) and when
    it was written (``t``, the rank's clock; None if absent)."""
    obj = _json_object(raw)
    pid = obj.get("pid")
    return {"seq": _whole(obj, "seq", MAX_COUNTER), "ticks": _whole(obj, "ticks", MAX_COUNTER),
            "ddp_steps": _whole(obj, "ddp_steps", MAX_COUNTER, default=0), "op": clean(_text(obj, "op", 500), 200),
            "pid": pid if type(pid) is int and 0 < pid <= MAX_PID else None,
            "failed": obj.get("failed") is True, "t": _time(obj)}


def left_note(raw: bytes) -> dict:
    """What a rank wrote as it left (``left/<rank>``): its DDP steps, whether a collective of its own had
    failed, and when (``t``, the rank's clock; None if absent)."""
    obj = _json_object(raw)
    failed = obj.get("after_failure", False)
    if not isinstance(failed, bool):
        raise Malformed(f"'after_failure' is {_short(json.dumps(failed))}, not true or false")
    return {"ddp_steps": _whole(obj, "ddp_steps", MAX_COUNTER, default=0), "after_failure": failed, "t": _time(obj)}


def _time(obj: dict) -> float | None:
    """An optional ``t`` (seconds since the epoch) of a rank's value; None when absent or not a number."""
    t = obj.get("t")
    return float(t) if type(t) in (int, float) and math.isfinite(t) else None


def _arrival_fields(obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise Malformed(f"a node entry that is a JSON {type(obj).__name__}, not an object")
    token = _text(obj, "token", 64)
    if not _TOKEN.fullmatch(token):
        raise Malformed(f"'token' is {_short(token)!r}, not a hexadecimal token")
    # A node id is its --node-rank, below --nnodes, which is at most MAX_WORLD_SIZE.
    return {"node": _whole(obj, "node", MAX_WORLD_SIZE - 1),
            "nproc": _whole(obj, "nproc", MAX_NPROC_PER_NODE, minimum=1), "token": token}


def arrival(raw: bytes) -> dict:
    """A launcher's arrival at an elastic attempt (see ``membership``): node id, ranks, token."""
    return _arrival_fields(_json_object(raw))


def members(raw: bytes) -> dict:
    """Node 0's decision for an elastic attempt: ``{"nodes": [arrival, ...]}`` in node-rank
    order, with distinct node ids; or ``{"error": text}``."""
    obj = _json_object(raw)
    if "error" in obj:
        return {"error": clean(_text(obj, "error", MAX_TEXT))}
    return {"nodes": _nodes(obj)}


def _nodes(obj: dict) -> list[dict]:
    nodes = obj.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise Malformed("no list of nodes")
    chosen = [_arrival_fields(n) for n in nodes]
    ids = [n["node"] for n in chosen]
    if len(set(ids)) != len(ids):
        raise Malformed(f"node ids {_short(ids)}, not distinct")
    world = sum(n["nproc"] for n in chosen)
    if world > MAX_WORLD_SIZE:
        raise Malformed(f"{len(chosen)} nodes of {world} ranks in all, more than the {MAX_WORLD_SIZE} a job can have")
    return chosen


def admission(raw: bytes) -> dict:
    """Node 0 letting a launcher into a running attempt (see ``resize``): the attempt's nodes as
    they are from ``generation`` on, ``{"nodes": [arrival, ...], "generation": g}``."""
    obj = _json_object(raw)
    return {"nodes": _nodes(obj), "generation": _whole(obj, "generation", MAX_GENERATION, minimum=1)}


def generation(raw: bytes) -> dict:
    """A generation of in-place recovery (``recovery/generation/<g>``): ``{"kind": "replace"}``
    for a rank replaced by its own node's launcher (see ``inplace``), or, for the job's nodes
    changing (see ``resize``), ``{"kind": "resize", "nodes": [arrival, ...], "why": text}`` with
    the nodes in their new order."""
    obj = _json_object(raw)
    if obj.get("kind") != "resize":
        return {"kind": "replace"}
    return {"kind": "resize", "nodes": _nodes(obj), "why": clean(_text(obj, "why", MAX_TEXT))}


def attempt_number(raw: bytes) -> int:
    """The attempt node 0 has opened (``launcher/elastic/current``): decimal digits."""
    if not re.fullmatch(rb"[0-9]{1,9}", raw):
        raise Malformed(f"{_short(raw)}, not an attempt number")
    return int(raw)


def failure_text(node_rank: int, what: str) -> str:
    """The failure report a launcher writes for a rank of its own (``launcher/failed/<attempt>``)."""
    return clean(f"on node {node_rank}: {what}")


def failure_report(raw: bytes) -> str:
    """Another node's failure report, as ``failure_text`` wrote it: UTF-8 text on one line,
    "on node N: ...", without control characters."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed(f"not UTF-8 text: {_short(raw)}") from None
    if len(text) > MAX_TEXT or not _FAILURE.match(text) or clean(text) != text:
        raise Malformed(f"not a launcher's report 'on node N: ...' on one line without control characters: "
                        f"{_short(raw)}")
    return text


def fallback_note(raw: bytes) -> str:
    """Why a rank cannot recover in place (``recovery/fallback``, see ``inplace``): text the
    launcher shows, on one line without control characters, at most 500 characters."""
    if len(raw) > MAX_RAW:
        raise Malformed(f"{len(raw)} bytes, more than the {MAX_RAW} any such value has")
    text = clean(raw, 500).strip()
    if not text:
        raise Malformed(f"no text: {_short(raw)}")
    return text


_KINDS = {heartbeat: "heartbeat", left_note: "note of a rank that left", arrival: "elastic arrival",
          members: "list of an attempt's nodes", attempt_number: "attempt number",
          failure_report: "failure report", generation: "in-place recovery generation",
          admission: "admission to a running attempt", fallback_note: "in-place recovery fallback note"}
