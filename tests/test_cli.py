"""Argument parsing of the dptrain command and the sbatch file it writes."""

import subprocess
import sys

import pytest

from dptrain.cli import build_parser, main


def test_run_flags_accept_both_spellings():
    p = build_parser()
    a = p.parse_args(["run", "--nproc-per-node", "4", "--master_port", "1234", "--node-rank", "1", "--nnodes", "2",
                      "--master-addr", "10.0.0.1", "train.py", "--lr", "0.1"])
    assert (a.nproc_per_node, a.master_port, a.node_rank, a.nnodes, a.master_addr) == (4, 1234, 1, 2, "10.0.0.1")
    assert a.program == "train.py" and a.args == ["--lr", "0.1"]
    b = p.parse_args(["run", "--nproc_per_node=auto", "--log_ranks", "0,2", "-m", "pkg.mod"])
    assert b.nproc_per_node >= 1 and b.log_ranks == [0, 2] and b.module and b.program == "pkg.mod"


def test_python_dash_m_dptrain_works():
    out = subprocess.run([sys.executable, "-m", "dptrain", "run", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout


def test_slurm_script(tmp_path, capsys):
    target = tmp_path / "job.sbatch"
    assert main(["slurm-script", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--time", "00:05:00",
                 "-o", str(target), "train.py", "--epochs", "3"]) == 0
    text = target.read_text()
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=00:05:00",
                 "srun --kill-on-bad-exit=1 python -u train.py --epochs 3"]:
        assert line in text
    assert main(["slurm-script", "--nodes", "1", "train.py"]) == 0
    assert "#SBATCH --ntasks-per-node=1" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--gpus-per-node", "4", "--ntasks-per-node", "2"], "differs from --gpus-per-node 4"),
    (["--time", "soon"], "is not a Slurm time limit"),
])
def test_slurm_script_rejects_bad_input(args, message, capsys):
    assert main(["slurm-script", *args, "train.py"]) == 2
    assert message in capsys.readouterr().err
