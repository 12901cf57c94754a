"""``dptrain slurm-script``: write an sbatch file that runs a dptrain script on Slurm.

On one node the file starts one task per rank with ``srun``; each task finds its rank, the
world size, its local rank and the master address from Slurm's variables (see
:mod:`dptrain.environments.slurm`), so no ``torchrun`` runs inside the allocation and no
rendezvous endpoint has to be spelled out. On several nodes (or with ``--per-node``) one task
per node runs ``dptrain run`` for that node's ranks instead, and the file gives the job a
secret of its own: it writes a fresh one (``umask 077``: a file only the user can read, in the
job's folder, which every node sees), hands its path to every node's launcher
(``DPTRAIN_SECRET_FILE``, which srun passes on) and removes it when the job ends, so that
nothing else on the cluster's network can read, stop or join the job (see [Note: only the job
gets in] in :mod:`dptrain.launcher.auth`). ``--per-task`` keeps one task per rank on several
nodes too; with no launcher to hold it, rank 0 hosts torch's store, open to the network, and
the file says so. Either way the job asks for SIGUSR1 90 s before its end and may be
requeued: the Trainer checkpoints, requeues and later resumes.
"""

from __future__ import annotations

import re
import shlex
import sys
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
        ValueError: a count is below 1, the time limit is malformed, or both ``--per-node`` and
            ``--per-task`` are given.

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
    per_task = bool(getattr(ns, "per_task", False))
    if per_task and getattr(ns, "per_node", False):
        raise ValueError("--per-node and --per-task exclude each other: give one (or neither for the default)")
    # Several nodes: a launcher per node by default, the only form whose store a secret guards
    # (torch's TCPStore in rank 0, which one task per rank joins, cannot authenticate).
    per_node = bool(getattr(ns, "per_node", False)) or (ns.nodes > 1 and not per_task)
    python = shlex.quote(sys.executable)  # this environment's interpreter, not whatever `python` is there
    script = " ".join(shlex.quote(a) for a in [ns.program, *ns.args])
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={safe_name}",
        f"#SBATCH --nodes={ns.nodes}",
        f"#SBATCH --ntasks-per-node={1 if per_node else tasks}",
    ]
    if ns.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={ns.gpus_per_node}")
    lines.append(f"#SBATCH --cpus-per-task={ns.cpus_per_task * (tasks if per_node else 1)}")
    if ns.partition:
        lines.append(f"#SBATCH --partition={ns.partition}")
    lines += [f"#SBATCH --time={ns.time}", f"#SBATCH --output={safe_name}_%j.out"]
    # SIGUSR1 90 s before the end reaches every task: the Trainer checkpoints and requeues.
    lines.append("#SBATCH --signal=USR1@90")
    if getattr(ns, "requeue", True):
        lines.append("#SBATCH --requeue")
    lines += ["", f"export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}}"]
    if per_node:
        lines[-1] = f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_PER_TASK:-{tasks}}} / {tasks} ))"
        lines += [
            "",
            f"# {ns.nodes} node(s) x {tasks} rank(s): one task per node runs `dptrain run` for its ranks. The",
            "# rendezvous is node 0's first host and the port dptrain derives from the job id.",
            "MASTER_ADDR=$(" + python + " -c 'import os; from dptrain.environments.slurm import expand_nodelist; "
            "print(expand_nodelist(os.environ[\"SLURM_JOB_NODELIST\"])[0])')",
            "MASTER_PORT=$(" + python + " -c 'import os; from dptrain.environments.slurm import master_port; "
            "print(master_port(int(os.environ[\"SLURM_JOB_ID\"])))')",
            "",
        ]
        if ns.nodes > 1:  # one node listens on 127.0.0.1 only and needs none
            lines += [
                "# A fresh secret for this run, readable by you only: without it nothing on the network can read,",
                "# stop or join the job. Every node's launcher reads it (srun passes DPTRAIN_SECRET_FILE on).",
                "export DPTRAIN_SECRET_FILE=\"$PWD/.dptrain-$SLURM_JOB_ID.secret\"",
                "rm -f \"$DPTRAIN_SECRET_FILE\"",
                "trap 'rm -f \"$DPTRAIN_SECRET_FILE\"' EXIT",
                "(umask 077 && " + python + " -c 'import secrets; print(secrets.token_hex(32))' > "
                "\"$DPTRAIN_SECRET_FILE\")",
                "",
            ]
        lines += [
            # Each task's node rank is its SLURM_NODEID, which `dptrain run` reads when --node-rank is omitted.
            f"srun --kill-on-bad-exit=1 {python} -u -m dptrain run --nnodes {ns.nodes} --nproc-per-node {tasks} "
            f"--master-addr \"$MASTER_ADDR\" --master-port \"$MASTER_PORT\" {script}",
            "",
        ]
    else:
        lines += [
            "",
            f"# {ns.nodes * tasks} ranks: {ns.nodes} node(s) x {tasks} task(s). Each task finds its rank, the world,",
            "# its local rank, node 0's address and the job's port from Slurm's variables in dptrain.init().",
            "# Rank 0 hosts the rendezvous store with torch's TCPStore, which anything on the cluster's network can",
            "# reach; without --per-task, dptrain slurm-script runs dptrain run on each node, with a secret for the job.",
            f"srun --kill-on-bad-exit=1 {python} -u {script}",
            "",
        ]
    return "\n".join(lines)
