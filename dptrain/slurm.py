"""``dptrain slurm-script``: write an sbatch file that runs a dptrain script on Slurm.

The file starts one task per rank with ``srun``; each task finds its rank, the world size,
its local rank and the master address from Slurm's variables (see ``dptrain.env``), so no
``torchrun`` runs inside the allocation and no rendezvous endpoint has to be spelled out.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

__all__ = ["render_sbatch"]


def render_sbatch(ns: Any) -> str:
    """Render the sbatch file for the parsed ``dptrain slurm-script`` arguments.

    Args:
        ns: an object with ``nodes``, ``gpus_per_node``, ``ntasks_per_node``,
            ``cpus_per_task``, ``job_name``, ``time``, ``partition``, ``program``, ``args``.

    Returns:
        The text of the batch script.

    Raises:
        ValueError: a count is below 1 or the time limit is malformed.

    Example:
        $ dptrain slurm-script --nodes 2 --gpus-per-node 4 train.py --epochs 10 > job.sbatch
        $ sbatch job.sbatch
    """
    if ns.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {ns.nodes}")
    if ns.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {ns.gpus_per_node}")
    tasks = ns.ntasks_per_node or max(ns.gpus_per_node, 1)
    if tasks < 1:
        raise ValueError(f"--ntasks-per-node must be >= 1, got {tasks}")
    if ns.gpus_per_node and tasks != ns.gpus_per_node:
        raise ValueError(
            f"--ntasks-per-node {tasks} differs from --gpus-per-node {ns.gpus_per_node}; "
            f"dptrain runs one rank per GPU, so give the same number (or leave --ntasks-per-node out)"
        )
    if not re.fullmatch(r"(\d+-)?\d{1,3}(:\d\d){0,2}", ns.time):
        raise ValueError(f"--time {ns.time!r} is not a Slurm time limit such as 01:00:00 or 2-00:00:00")
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", ns.job_name)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={safe_name}",
        f"#SBATCH --nodes={ns.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
    ]
    if ns.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={ns.gpus_per_node}")
    lines.append(f"#SBATCH --cpus-per-task={ns.cpus_per_task}")
    if ns.partition:
        lines.append(f"#SBATCH --partition={ns.partition}")
    lines += [
        f"#SBATCH --time={ns.time}",
        f"#SBATCH --output={safe_name}_%j.out",
        "",
        f"# {ns.nodes * tasks} ranks: {ns.nodes} node(s) x {tasks} task(s). Each task reads SLURM_PROCID,",
        "# SLURM_NTASKS and SLURM_LOCALID in dptrain.init(); node 0 hosts the rendezvous store.",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 20000))",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
        "",
        "srun --kill-on-bad-exit=1 python -u " + " ".join(shlex.quote(a) for a in [ns.program, *ns.args]),
        "",
    ]
    return "\n".join(lines)
