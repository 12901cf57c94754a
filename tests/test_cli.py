"""Argument parsing of the dptrain command and the sbatch file it writes."""

import os
import subprocess
import sys

import shlex
import sys

import pytest

from dptrain.cli import build_parser, main, parse_args
from tests._dist import left_in_tmpdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_flags_accept_both_spellings():
    p = build_parser()
    a = p.parse_args(["run", "--nproc-per-node", "4", "--master_port", "1234", "--node-rank", "1", "--nnodes", "2",
                      "--master-addr", "10.0.0.1", "train.py", "--lr", "0.1"])
    assert (a.nproc_per_node, a.master_port, a.node_rank, a.nnodes, a.master_addr) == (4, 1234, 1, (None, 2), "10.0.0.1")
    assert a.program == "train.py" and a.args == ["--lr", "0.1"]
    b = p.parse_args(["run", "--nproc_per_node=auto", "--log_ranks", "0,2", "-m", "pkg.mod"])
    assert b.nproc_per_node >= 1 and b.log_ranks == [0, 2] and b.module and b.program == "pkg.mod"


def test_nnodes_min_max_makes_an_elastic_job(capsys):
    ns = build_parser().parse_args(["run", "--nnodes", "1:3", "--join-timeout", "5", "train.py"])
    assert ns.nnodes == (1, 3) and ns.join_timeout == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--nnodes", "one:3", "train.py"])
    assert "expected a number of nodes like 2, or MIN:MAX like 1:4, got 'one:3'" in capsys.readouterr().err
    script = os.path.join(ROOT, "tests", "scripts", "dump_env.py")
    assert main(["run", "--nnodes", "3:2", "--master-addr", "10.0.0.1", "--master-port", "29500", script]) == 2
    assert "--nnodes 3:2: the minimum must be between 1 and the maximum" in capsys.readouterr().err


@pytest.mark.parametrize("argv, launcher, program, script_args", [
    (["train.py", "--log", "x"], {}, "train.py", ["--log", "x"]),  # not --log-ranks
    (["-m", "pkg.mod", "--nproc-per-node", "3"], {"module": True}, "pkg.mod", ["--nproc-per-node", "3"]),
    (["--nproc-per-node=2", "--log-ranks", "1", "train.py", "--log-ranks", "0", "-m", "--help", "--", "x"],
     {"nproc_per_node": 2, "log_ranks": [1]}, "train.py", ["--log-ranks", "0", "-m", "--help", "--", "x"]),
    (["--max_restarts", "1", "--", "train.py", "--timeout", "5"], {"max_restarts": 1}, "train.py", ["--timeout", "5"]),
])
def test_words_after_the_script_belong_to_the_script(argv, launcher, program, script_args):
    ns = parse_args(["run", *argv])
    assert ns.program == program and ns.args == script_args
    for name, value in launcher.items():
        assert getattr(ns, name) == value


def test_launcher_flags_are_never_abbreviated(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["run", "--nproc", "2", "train.py"])
    assert info.value.code == 2
    assert "unrecognized arguments: --nproc" in capsys.readouterr().err


def test_a_script_gets_flags_that_look_like_the_launchers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", "--log-ranks", "1",
         os.path.join(ROOT, "tests", "scripts", "hello_module.py"), "--log", "x", "--nproc-per-node", "3"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[rank1] module rank 1 args ['--log', 'x', '--nproc-per-node', '3']"
    assert not left_in_tmpdir(tmp_path)  # the launcher's temporary directory is gone


def test_python_dash_m_dptrain_works():
    out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout


def test_slurm_script(tmp_path, capsys):
    target = tmp_path / "job.sbatch"
    assert main(["slurm-script", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--time", "00:05:00",
                 "--per-task", "-o", str(target), "train.py", "--epochs", "3"]) == 0
    text = target.read_text()
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=00:05:00",
                 # this environment's interpreter, never a bare `python` (issue: a job must not run another Python)
                 f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -u train.py --epochs 3",
                 "#SBATCH --signal=USR1@90", "#SBATCH --requeue"]:
        assert line in text
    assert "MASTER_PORT" not in text  # dptrain.init derives the rendezvous from Slurm's variables
    assert main(["slurm-script", "--nodes", "1", "train.py"]) == 0
    assert "#SBATCH --ntasks-per-node=1" in capsys.readouterr().out


def test_slurm_script_on_several_nodes_runs_a_launcher_per_node_with_a_secret_by_default(capsys):
    """One task per rank joins through rank 0's torch store, which nothing can guard: not the default."""
    assert main(["slurm-script", "--nodes", "2", "--gpus-per-node", "4", "train.py"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --ntasks-per-node=1" in text and "-m dptrain run --nnodes 2 --nproc-per-node 4" in text
    assert "DPTRAIN_SECRET_FILE" in text and "umask 077" in text
    assert main(["slurm-script", "--nodes", "2", "--per-node", "--per-task", "train.py"]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_slurm_script_per_node_runs_the_launcher_on_each_node(capsys):
    assert main(["slurm-script", "--nodes", "3", "--gpus-per-node", "8", "--per-node", "--no-requeue",
                 "train.py", "--tag", "a $b"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --cpus-per-task=32" in text
    assert "#SBATCH --requeue" not in text and "#SBATCH --signal=USR1@90" in text
    assert (f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -u -m dptrain run --nnodes 3 --nproc-per-node 8 "
            f"--master-addr \"$MASTER_ADDR\" --master-port \"$MASTER_PORT\" train.py --tag 'a $b'") in text


def test_node_rank_defaults_to_slurms_inside_a_job(monkeypatch):
    from dptrain.launcher import rendezvous

    monkeypatch.setenv("SLURM_NODEID", "2")
    assert rendezvous.default_node_rank(3) == 2 and rendezvous.default_node_rank(1) == 0
    monkeypatch.delenv("SLURM_NODEID")
    assert rendezvous.default_node_rank(3) == 0


def test_help_shows_examples_and_version(capsys):
    for words in (["--help"], ["run", "--help"], ["slurm-script", "--help"], ["env", "--help"]):
        with pytest.raises(SystemExit):
            main(words)
        out = capsys.readouterr().out
        assert "example" in out and "dptrain " in out, words
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("dptrain 0.")


def test_env_report_lists_what_a_bug_report_needs(capsys, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for piece in ("versions:", "torch: ", "python: ", "nccl", "backends:", "gloo: True", "hardware:", "cpu cores:",
                  "environment variables:", "MASTER_ADDR: 127.0.0.1", "gloo interface:", "shared memory (/dev/shm)",
                  "ip netns:", "slurm:"):
        assert piece in out, piece


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--gpus-per-node", "4", "--ntasks-per-node", "2"], "differs from --gpus-per-node 4"),
    (["--time", "soon"], "is not a Slurm time limit"),
])
def test_slurm_script_rejects_bad_input(args, message, capsys):
    assert main(["slurm-script", *args, "train.py"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--rdzv-endpoint", "10.0.0.1:1234", "--node-rank", "1", "--nnodes", "2"], ("10.0.0.1", 1234, 1)),
        (["--rdzv-endpoint", "node0"], ("node0", 29500, 0)),  # torchrun's static default port
        (["--rdzv_endpoint=node0", "--rdzv_backend=c10d"], ("node0", 29400, 0)),  # one node: rank 0
        (["--master-addr", "h", "--master-port", "7", "--rdzv-endpoint", "h:7"], ("h", 7, 0)),
    ],
)
def test_torchruns_rendezvous_flags(flags, expected):
    from dptrain.cli import _rendezvous

    assert _rendezvous(parse_args(["run", *flags, "t.py"])) == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rdzv-endpoint", "h:x"], "the port must be a number"),
        (["--rdzv-endpoint", "h:1", "--master-port", "2"], "name different places"),
        (["--rdzv-backend", "c10d", "--nnodes", "2"], "needs --rdzv-endpoint HOST:PORT"),
        (["--rdzv-backend", "c10d", "--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "give each node its own"),
    ],
)
def test_torchruns_rendezvous_flags_refuse_what_cannot_work(flags, message, capsys):
    assert main(["run", *flags, "t.py"]) == 2
    assert message in capsys.readouterr().err
