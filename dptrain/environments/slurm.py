"""Who am I under Slurm's ``srun`` (without torchrun): Slurm's task variables.

``SLURM_PROCID`` (rank), ``SLURM_NTASKS`` (world size), ``SLURM_LOCALID`` (local rank),
``SLURM_NODEID`` and ``SLURM_TASKS_PER_NODE``; the master is the first host of
``SLURM_JOB_NODELIST`` (a host-list expression such as ``node[01-04,07]``, expanded by
:func:`expand_nodelist`) and the port is derived from the job id (:func:`master_port`), so
every task agrees on the rendezvous without talking. ``SLURM_RESTART_COUNT`` counts requeues.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from dptrain.environments._vars import int_var, optional_int

__all__ = ["applies", "read", "expand_nodelist", "master_port", "tasks_per_node", "node_id", "PORT_BASE", "PORT_SPAN"]

HINT = "run the script with `srun` inside an allocation (see `dptrain slurm-script`)"

# [Note: the port rule] Every task of a job must agree on the port without talking: it is
# derived from the job id, above the well-known ports and below the ephemeral range, so two
# jobs sharing a node rarely collide. The sbatch files of `dptrain slurm-script` use it too.
PORT_BASE = 15000
PORT_SPAN = 20000


def master_port(job_id: int) -> int:
    """The rendezvous port of Slurm job ``job_id`` (see the port rule above).

    Example:
        >>> master_port(123456)
        18456
    """
    return PORT_BASE + job_id % PORT_SPAN


def node_id(env: Mapping[str, str]) -> int | None:
    """This node's index in the job (``SLURM_NODEID``), or None outside a Slurm job step."""
    raw = env.get("SLURM_NODEID", "")
    return int(raw) if raw.isdigit() else None


def applies(env: Mapping[str, str]) -> bool:
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and env.get("SLURM_NTASKS") != "1"


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm node list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm node list {text!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_range(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"bad range {item!r} in Slurm node list {whole!r}")
            width = len(lo)  # node[01-04] keeps its zero padding
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            out.append(item)
        else:
            raise ValueError(f"bad element {item!r} in Slurm node list {whole!r}")
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list expression into host names, in order.

    Args:
        nodelist: a value of ``SLURM_JOB_NODELIST`` such as ``"node[01-04,07],gpu-a"`` or
            ``"rack[1-2]-n[1-2]"``.

    Returns:
        The host names, e.g. ``["node01", "node02", "node03", "node04", "node07", "gpu-a"]``.

    Raises:
        ValueError: on unbalanced brackets or malformed ranges.

    Example:
        >>> expand_nodelist("node[01-02,07]")
        ['node01', 'node02', 'node07']
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        expansions = [""]
        for match in re.finditer(r"([^\[]+)|\[([^\]]*)\]", part):
            literal, bracket = match.groups()
            pieces = [literal] if literal is not None else _expand_range(bracket, nodelist)
            expansions = [prefix + piece for prefix in expansions for piece in pieces]
        hosts.extend(expansions)
    return hosts


def tasks_per_node(env: Mapping[str, str], node_rank: int) -> int:
    """Tasks on node ``node_rank``, from ``SLURM_TASKS_PER_NODE`` ("4(x2),3": 4 on each of two nodes, then 3)."""
    raw = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if not raw:
        return 1
    counts: list[int] = []
    for item in raw.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"environment variable SLURM_TASKS_PER_NODE={raw!r} is not understood")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_rank, len(counts) - 1)]


def read(env: Mapping[str, str]) -> dict[str, Any]:
    """The World's fields from Slurm's variables.

    Raises:
        ValueError: a variable is missing, malformed or inconsistent (named, with its value).
    """
    world = int_var(env, "SLURM_NTASKS", minimum=1, hint=HINT)
    rank = int_var(env, "SLURM_PROCID", hint=HINT)
    if rank >= world:
        raise ValueError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world}; {HINT}")
    local = int_var(env, "SLURM_LOCALID", hint=HINT) if "SLURM_LOCALID" in env else 0
    node_rank = optional_int(env, "SLURM_NODEID")
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError(f"neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; {HINT}")
        addr = expand_nodelist(nodelist)[0]
    port = int_var(env, "MASTER_PORT", minimum=1, hint=HINT) if "MASTER_PORT" in env else master_port(
        optional_int(env, "SLURM_JOB_ID"))
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": local,
        "local_world_size": max(tasks_per_node(env, node_rank), local + 1),
        "node_rank": node_rank,
        "master_addr": addr,
        "master_port": port,
        "source": "slurm",
        "restart_count": optional_int(env, "SLURM_RESTART_COUNT"),
    }
