"""Argument parsing for the ``dptrain`` command (``python -m dptrain`` too).

``dptrain run`` mirrors torchrun's flags; both ``--nproc-per-node`` and ``--nproc_per_node``
spellings are accepted, as torchrun accepts them. The launcher's flags come before the
script; every word after the script is the script's, passed on untouched
(``dptrain run train.py --log x`` gives ``--log x`` to ``train.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main", "build_parser", "parse_args"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that says where help is.

    Never abbreviates: ``--log`` must not be taken for ``--log-ranks``. (A script's own
    arguments never reach it anyway: see :func:`_split_at_program`.)
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.value_options: dict[str, bool] = {}  # option spelling -> it consumes the next word

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _flag(parser: _Parser, *names: str, **kwargs) -> None:
    """Add an option; ``--a-b`` also gets its ``--a_b`` spelling."""
    spellings = list(names)
    for name in names:
        if name.startswith("--") and "-" in name[2:]:
            spellings.append("--" + name[2:].replace("-", "_"))
    action = parser.add_argument(*spellings, **kwargs)
    parser.value_options.update({s: action.nargs != 0 for s in spellings})


def _split_at_program(words: Sequence[str], takes_value: dict[str, bool]) -> tuple[list[str], list[str]]:
    """Split ``[launcher options..., program, script args...]`` after the program.

    Everything after the program belongs to the script, verbatim: argparse would otherwise
    read a script's ``--log`` as ours, or fail on it. An unknown option before the program
    stays on the launcher's side, where argparse rejects it with a clear message.
    """
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return list(words[: i + 2]), list(words[i + 2 :])
        if not word.startswith("-") or word == "-":
            return list(words[: i + 1]), list(words[i + 1 :])
        name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
        attached = "=" in word if word.startswith("--") else len(word) > 2
        i += 2 if takes_value.get(name) and not attached else 1
    return list(words), []


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


def _nnodes(value: str) -> tuple[int | None, int]:
    """``N`` (exactly N nodes) or ``MIN:MAX`` (elastic) -> (min or None, max)."""
    low, sep, high = value.partition(":")
    try:
        return (int(low), int(high)) if sep else (None, int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes like 2, or MIN:MAX like 1:4, got {value!r}") from None


_MAIN_EXAMPLES = """examples:
  dptrain run --nproc-per-node 2 train.py --lr 0.1     # two ranks on this machine
  dptrain run --nproc-per-node auto -m mypackage.train  # one rank per GPU (or per core)
  dptrain slurm-script --nodes 2 --gpus-per-node 4 train.py > job.sbatch
  dptrain env                                          # what a bug report needs
"""

_RUN_EXAMPLES = """examples:
  dptrain run --nproc-per-node 2 train.py --lr 0.1
  dptrain run --nproc-per-node 4 --max-restarts 3 train.py        # restart the whole job on failure
  # a Trainer script: replace only the failed rank, from a process kept ready; the others keep running
  dptrain run --nproc-per-node 4 --max-restarts 3 --recovery in-place --spares 1 train.py
  dptrain run --log-ranks 0 --nproc-per-node 8 train.py           # show only rank 0's output
  dptrain run --profile --nproc-per-node 2 train.py               # per-rank step report (Trainer)
  # two machines (run on each, with node 0's address, and the same secret on each):
  (umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > job.secret)   # once; copy it to every node
  dptrain run --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 --secret-file job.secret train.py
  dptrain run --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500 --secret-file job.secret train.py
  # or torchrun's way: the same command on every machine, nodes numbered as they arrive
  dptrain run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 train.py
  # elastic: go on with at least 1 of 2 nodes when one is lost (the Trainer resumes on the smaller world)
  dptrain run --nnodes 1:2 --max-restarts 3 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py

Every word after the script is the script's. Each rank gets torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), so the same script also runs under torchrun.
"""

_SLURM_EXAMPLES = """examples:
  dptrain slurm-script --nodes 2 --gpus-per-node 4 train.py --epochs 10 > job.sbatch && sbatch job.sbatch   # dptrain run per node, a secret
  dptrain slurm-script --nodes 4 --ntasks-per-node 2 --partition cpu train.py -o job.sbatch
  dptrain slurm-script --nodes 2 --gpus-per-node 8 --per-task train.py     # srun one task per rank, no launcher (no secret)

The file asks Slurm for SIGUSR1 90 s before the end (--signal=USR1@90) and allows a
requeue (--requeue): the Trainer then checkpoints, requeues the job and resumes when it runs again.
"""


def _std_spec(value: str) -> int | dict[int, int]:
    """torchrun's ``--redirects``/``--tee``: ``3`` for every local rank, or ``0:1,1:2`` per local rank."""
    def level(text: str) -> int:
        if text.strip() not in ("0", "1", "2", "3"):
            raise argparse.ArgumentTypeError(
                f"expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or LOCAL_RANK:N,..., got {value!r}")
        return int(text)

    if ":" not in value:
        return level(value)
    spec = {}
    for part in value.split(","):
        rank, _, text = part.partition(":")
        if not rank.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected LOCAL_RANK:N pairs like 0:1,1:2, got {value!r}")
        spec[int(rank)] = level(text)
    return spec


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("dptrain")
    except metadata.PackageNotFoundError:
        from dptrain import __version__

        return __version__


def _slurm_parser(sub, examples) -> argparse.ArgumentParser:
    """``dptrain slurm-script``'s flags."""
    slurm = sub.add_parser("slurm-script", help="write an sbatch file that runs a script with srun",
                           description="Write an sbatch file, requeued on preemption: on several nodes one srun task per "
                                       "node runs `dptrain run` with a fresh secret for the job (--per-task: one "
                                       "task per rank instead); on one node one task per rank.", epilog=_SLURM_EXAMPLES, formatter_class=examples)
    _flag(slurm, "--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    _flag(slurm, "--gpus-per-node", type=int, default=0, help="GPUs (and ranks) per node (default 0: CPU)")
    _flag(slurm, "--ntasks-per-node", type=int, default=None, help="ranks per node (default: GPUs per node, or 1)")
    _flag(slurm, "--cpus-per-task", type=int, default=4, help="CPU cores per rank (default 4)")
    _flag(slurm, "--job-name", default="dptrain", help="job name (default dptrain)")
    _flag(slurm, "--time", default="01:00:00", help="time limit (default 01:00:00)")
    _flag(slurm, "--partition", default=None, help="partition to submit to")
    _flag(slurm, "--per-node", action="store_true",
          help="one srun task per node running `dptrain run` for its ranks, with a fresh secret for the job "
               "(the default on several nodes)")
    _flag(slurm, "--per-task", action="store_true",
          help="one srun task per rank, each joining through rank 0's torch store, which anything on the "
               "network can reach (the default on one node)")
    _flag(slurm, "--no-requeue", dest="requeue", action="store_false",
          help="do not ask Slurm to requeue the job on preemption")
    _flag(slurm, "-o", "--output", default=None, help="write here instead of printing")
    slurm.add_argument("program", help="the training script")
    slurm.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return slurm


def build_parser() -> argparse.ArgumentParser:
    examples = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="dptrain", description="Data-parallel training for PyTorch: launch, Slurm scripts, diagnostics.",
                     epilog=_MAIN_EXAMPLES, formatter_class=examples)
    parser.add_argument("--version", action="version", version=f"dptrain {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    run = sub.add_parser(
        "run",
        help="launch a training script on several processes (like torchrun)",
        description="Start N ranks of a script with torchrun's environment; stop them all if one fails (with "
                    "--recovery in-place: replace that one only).",
        epilog=_RUN_EXAMPLES, formatter_class=examples,
    )
    _flag(run, "--nproc-per-node", type=_nproc, default=1, metavar="N|auto", help="ranks on this node (default 1)")
    _flag(run, "--nnodes", type=_nnodes, default=(None, 1), metavar="N|MIN:MAX",
          help="number of nodes (default 1); MIN:MAX restarts on fewer nodes when one is lost (elastic)")
    _flag(run, "--join-timeout", type=float, default=30.0,
          help="elastic jobs: seconds node 0 waits at each (re)start for nodes beyond MIN (default 30)")
    _flag(run, "--node-rank", type=int, default=None,
          help="index of this node (default: SLURM_NODEID inside a Slurm job, else 0)")
    _flag(run, "--master-addr", default=None, help="address of node 0 (required with --nnodes > 1)")
    _flag(run, "--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    _flag(run, "--log-ranks", type=_ranks, default=None, metavar="R[,R...]", help="show only these ranks' output")
    _flag(run, "--max-restarts", type=int, default=0,
          help="restart the whole job this many times on failure (with --recovery in-place: replace a failed rank "
               "this many times, whole-job restarts included)")
    _flag(run, "--recovery", default="restart", choices=["restart", "in-place"],
          help="what a failure costs: restart stops every rank and restarts them all (default); in-place replaces "
               "only the failed or stalled rank and the others keep running (a dptrain.Trainer script on every rank; "
               "else the whole job restarts, and says why once)")
    _flag(run, "--spares", type=int, default=0, metavar="N",
          help="with --recovery in-place: keep N processes per node that have imported torch and dptrain, ready to "
               "replace a failed rank without a Python start (default 0)")
    _flag(run, "--timeout", type=float, default=None,
          help="seconds a collective may wait (default 600); with --recovery in-place, a rank that makes no progress "
               "for longer while another waits for it is ended and replaced")
    _flag(run, "--debug", action="store_true", help="cross-check every collective across ranks")
    _flag(run, "--profile", action="store_true",
          help="per-rank step report: the Trainer times data, forward, backward, exposed communication, optimizer")
    _flag(run, "--rdzv-endpoint", default=None, metavar="HOST[:PORT]",
          help="torchrun's spelling of --master-addr/--master-port (port default: 29400 with c10d, else 29500)")
    _flag(run, "--rdzv-backend", default="static", choices=["static", "c10d"],
          help="c10d: every node runs the same command without --node-rank; the node owning the endpoint's "
               "address hosts the store and is node 0, the others are numbered as they arrive (default static)")
    _flag(run, "--rdzv-id", default=None, help="the job's id, given to the ranks as TORCHELASTIC_RUN_ID")
    _flag(run, "--secret-file", default=None, metavar="FILE",
          help="across nodes: a file (chmod 600) holding the job's secret, the same on every node; without it "
               "anything that reaches --master-addr:--master-port can read, stop or join the job (default: "
               "DPTRAIN_SECRET_FILE, else DPTRAIN_SECRET, else none)")
    _flag(run, "--log-dir", default=None, help="with --tee/--redirects: where the ranks' log files go "
          "(<dir>/<run id>/attempt_<k>/<local rank>/stdout.log, stderr.log; default: a new temporary folder)")
    _flag(run, "-t", "--tee", type=_std_spec, default=0, metavar="N|R:N,...",
          help="also write the ranks' output to log files: 1 stdout, 2 stderr, 3 both (per local rank: 0:3,1:2)")
    _flag(run, "-r", "--redirects", type=_std_spec, default=0, metavar="N|R:N,...",
          help="write the ranks' output to log files instead of the console (same values as --tee)")
    _flag(run, "--standalone", action="store_true", help="accepted for torchrun compatibility (single node)")
    _flag(run, "-m", "--module", action="store_true", help="run the program as a module (python -m)")
    run.add_argument("program", help="the training script (or module with -m)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    slurm = _slurm_parser(sub, examples)
    sub.add_parser("env", help="print what a bug report needs (versions, backends, GPUs, network, Slurm)",
                   description="Print dptrain, torch, Python, CUDA/NCCL versions, the backends, GPUs, cores, the "
                               "distributed environment variables, gloo's network interface, and whether shared "
                               "memory, network namespaces and Slurm are present.",
                   epilog="example:\n  dptrain env > env.txt     # attach to the bug report", formatter_class=examples)
    parser.script_commands = {"run": run, "slurm-script": slurm}  # type: ignore[attr-defined]
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a ``dptrain`` command line; the words after the script are the script's, untouched.

    Example:
        >>> parse_args(["run", "--nproc-per-node", "2", "train.py", "--log", "x"]).args
        ['--log', 'x']
    """
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((i for i, w in enumerate(words) if not w.startswith("-")), None)
    script_args: list[str] = []
    sub = parser.script_commands.get(words[command]) if command is not None else None  # type: ignore[attr-defined]
    if sub is not None:
        head, script_args = _split_at_program(words[command + 1 :], sub.value_options)
        words = words[: command + 1] + head
    ns = parser.parse_args(words)
    if sub is not None:
        ns.args = script_args
    return ns


def _rendezvous(ns: argparse.Namespace, secret: bytes | None = None) -> tuple[str | None, int | None, int]:
    """(master address, master port, node rank) from the flags, torchrun's rendezvous spellings included.

    The node rank, when not given, is the launcher's to find (see ``dptrain.launcher.rendezvous.node_rank``);
    ``secret`` is the job's, for a c10d arrival.
    """
    addr, port = ns.master_addr, ns.master_port
    if ns.rdzv_endpoint:
        host, _, text = ns.rdzv_endpoint.rpartition(":") if ":" in ns.rdzv_endpoint else (ns.rdzv_endpoint, "", "")
        try:
            given = int(text) if text else (29400 if ns.rdzv_backend == "c10d" else 29500)
        except ValueError:
            raise ValueError(f"--rdzv-endpoint {ns.rdzv_endpoint!r}: the port must be a number, e.g. node0:29400") from None
        if (addr and addr != host) or (port and port != given):
            raise ValueError("--rdzv-endpoint and --master-addr/--master-port name different places; give one of them")
        addr, port = host, given
    from dptrain.launcher.rendezvous import node_rank

    return addr, port, node_rank(ns.node_rank, ns.rdzv_backend, addr, port, ns.nnodes, ns.timeout, secret)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dptrain`` console script."""
    ns = parse_args(argv)
    if ns.command == "run":
        from dptrain.launcher.auth import load_secret
        from dptrain.launcher.job import LaunchConfig, run_job
        from dptrain.launcher.preflight import check_settings

        try:
            check_settings(ns)  # a bad DPTRAIN_* value is its one line, before the secret is read
            secret = load_secret(ns.secret_file)
            master_addr, master_port, node_rank = _rendezvous(ns, secret)
            config = LaunchConfig(
                program=ns.program,
                args=list(ns.args),
                nproc_per_node=ns.nproc_per_node,
                nnodes=ns.nnodes[1],
                min_nodes=ns.nnodes[0],
                join_timeout=ns.join_timeout,
                node_rank=node_rank,
                master_addr=master_addr,
                master_port=master_port,
                run_id=ns.rdzv_id,
                log_dir=ns.log_dir,
                redirects=ns.redirects,
                tee=ns.tee,
                module=ns.module,
                log_ranks=ns.log_ranks,
                max_restarts=ns.max_restarts,
                recovery=ns.recovery,
                spares=ns.spares,
                timeout=ns.timeout,
                debug=ns.debug,
                profile=ns.profile,
                secret=secret,
            )
            return run_job(config)
        except ValueError as exc:
            print(f"dptrain run: error: {exc}", file=sys.stderr)
            return 2
    if ns.command == "slurm-script":
        from dptrain.launcher.sbatch import render_sbatch

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
    if ns.command == "env":
        from dptrain.envreport import format_report

        sys.stdout.write(format_report())
        return 0
    return 2  # argparse rejects unknown commands before this


if __name__ == "__main__":
    sys.exit(main())
