"""Who am I under ``torchrun``, ``dptrain run`` or ``dptrain.spawn``: torchrun's worker variables.

``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, plus ``GROUP_RANK`` (the node), ``TORCHELASTIC_RESTART_COUNT`` and
``TORCHELASTIC_USE_AGENT_STORE`` (the launcher hosts the store). A hand-written environment
often sets only the first two and the master address: every process is then taken to be
on one node.
"""

from __future__ import annotations

from typing import Any, Mapping

from dptrain.environments._vars import int_var, optional_int

__all__ = ["applies", "read", "HINT"]

HINT = (
    "launch with `dptrain run --nproc-per-node N script.py` or `torchrun --nproc-per-node N script.py`, "
    "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process"
)


def applies(env: Mapping[str, str]) -> bool:
    return any(name in env for name in ("RANK", "WORLD_SIZE"))


def read(env: Mapping[str, str]) -> dict[str, Any]:
    """The World's fields from torchrun's variables.

    Raises:
        ValueError: a variable is missing, malformed or inconsistent (named, with its value).
    """
    world = int_var(env, "WORLD_SIZE", minimum=1, hint=HINT)
    rank = int_var(env, "RANK", hint=HINT)
    if rank >= world:
        raise ValueError(
            f"environment variable RANK={rank} is not below WORLD_SIZE={world}; ranks run from 0 to {world - 1}: {HINT}"
        )
    local_world = int_var(env, "LOCAL_WORLD_SIZE", minimum=1, hint=HINT) if "LOCAL_WORLD_SIZE" in env else world
    local = int_var(env, "LOCAL_RANK", hint=HINT) if "LOCAL_RANK" in env else rank % local_world
    if local >= local_world:
        raise ValueError(f"environment variable LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}; {HINT}")
    addr = port = None
    # Required at two ranks or more; a launcher's world of one gives them too (and then gets
    # its process group, see dptrain.init), a hand-set RANK=0 WORLD_SIZE=1 need not.
    if world > 1 or ("MASTER_ADDR" in env and "MASTER_PORT" in env):
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise ValueError(f"environment variable MASTER_ADDR is not set (WORLD_SIZE={world}); {HINT}")
        port = int_var(env, "MASTER_PORT", minimum=1, hint=HINT)
        if port > 65535:
            raise ValueError(f"environment variable MASTER_PORT={port} is not a TCP port (1..65535)")
    # A restart by the launcher, or a requeue by Slurm of a job that runs a launcher inside.
    attempt = optional_int(env, "TORCHELASTIC_RESTART_COUNT")
    restarts = attempt + optional_int(env, "SLURM_RESTART_COUNT")
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": local,
        "local_world_size": local_world,
        "node_rank": optional_int(env, "GROUP_RANK", rank // local_world),
        "master_addr": addr,
        "master_port": port,
        "source": "torchrun",
        "use_agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        "restart_count": restarts,
        "launch_attempt": attempt,
    }
