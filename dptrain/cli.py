"""Argument parsing for the ``dptrain`` command (``python -m dptrain`` too).

``dptrain run`` mirrors torchrun's flags; both ``--nproc-per-node`` and ``--nproc_per_node``
spellings are accepted, as torchrun accepts them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that says where help is."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--a-b`` together with its ``--a_b`` spelling."""
    spellings = [name]
    if "-" in name[2:]:
        spellings.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*spellings, **kwargs)


def _nproc(value: str) -> int:
    if value in ("auto", "gpu", "cpu"):
        import torch

        if value != "cpu" and torch.cuda.is_available():
            return torch.cuda.device_count()
        if value == "gpu":
            raise argparse.ArgumentTypeError("--nproc-per-node gpu: no CUDA device is visible; use a number")
        return os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}; e.g. --nproc-per-node 2")
    return n


def _ranks(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks like 0 or 0,2, got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dptrain", description="Data-parallel training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    run = sub.add_parser(
        "run",
        help="launch a training script on several processes (like torchrun)",
        description="Start N ranks of a script with torchrun's environment; stop them all if one fails.",
    )
    _flag(run, "--nproc-per-node", type=_nproc, default=1, metavar="N|auto", help="ranks on this node (default 1)")
    _flag(run, "--nnodes", type=int, default=1, help="number of nodes (default 1)")
    _flag(run, "--node-rank", type=int, default=0, help="index of this node (default 0)")
    _flag(run, "--master-addr", default=None, help="address of node 0 (required with --nnodes > 1)")
    _flag(run, "--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    _flag(run, "--log-ranks", type=_ranks, default=None, metavar="R[,R...]", help="show only these ranks' output")
    _flag(run, "--max-restarts", type=int, default=0, help="restart the whole job this many times on failure")
    _flag(run, "--timeout", type=float, default=None, help="seconds a collective may wait (default 600)")
    run.add_argument("--debug", action="store_true", help="cross-check every collective across ranks")
    _flag(run, "--standalone", action="store_true", help="accepted for torchrun compatibility (single node)")
    run.add_argument("-m", "--module", action="store_true", help="run the program as a module (python -m)")
    run.add_argument("program", help="the training script (or module with -m)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    slurm = sub.add_parser("slurm-script", help="write an sbatch file that runs a script with srun")
    _flag(slurm, "--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    _flag(slurm, "--gpus-per-node", type=int, default=0, help="GPUs (and ranks) per node (default 0: CPU)")
    _flag(slurm, "--ntasks-per-node", type=int, default=None, help="ranks per node (default: GPUs per node, or 1)")
    _flag(slurm, "--cpus-per-task", type=int, default=4, help="CPU cores per rank (default 4)")
    _flag(slurm, "--job-name", default="dptrain", help="job name (default dptrain)")
    _flag(slurm, "--time", default="01:00:00", help="time limit (default 01:00:00)")
    _flag(slurm, "--partition", default=None, help="partition to submit to")
    slurm.add_argument("-o", "--output", default=None, help="write here instead of printing")
    slurm.add_argument("program", help="the training script")
    slurm.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dptrain`` console script."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "run":
        from dptrain.launch import LaunchConfig, run_job

        try:
            config = LaunchConfig(
                program=ns.program,
                args=list(ns.args),
                nproc_per_node=ns.nproc_per_node,
                nnodes=ns.nnodes,
                node_rank=ns.node_rank,
                master_addr=ns.master_addr,
                master_port=ns.master_port,
                module=ns.module,
                log_ranks=ns.log_ranks,
                max_restarts=ns.max_restarts,
                timeout=ns.timeout,
                debug=ns.debug,
            )
            return run_job(config)
        except ValueError as exc:
            print(f"dptrain run: error: {exc}", file=sys.stderr)
            return 2
    if ns.command == "slurm-script":
        from dptrain.slurm import render_sbatch

        try:
            text = render_sbatch(ns)
        except ValueError as exc:
            print(f"dptrain slurm-script: error: {exc}", file=sys.stderr)
            return 2
        if ns.output:
            with open(ns.output, "w") as fh:
                fh.write(text)
        else:
            sys.stdout.write(text)
        return 0
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
