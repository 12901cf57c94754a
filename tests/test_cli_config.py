"""dptrain.train.parse_config (issue 45, point 3): settings from YAML files plus command-line
overrides, built into the script's dataclasses; one line for each mistake; the resolved
settings written beside the checkpoints as config.yaml."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import dptrain
from dptrain.train import Trainer, TrainerConfig, cli_config, parse_config
from dptrain.train.checkpointer import CONFIG_NAME, Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
yaml = pytest.importorskip("yaml", reason="PyYAML comes with jsonargparse: pip install 'dptrain[config]'")
needs_jsonargparse = pytest.mark.skipif(
    importlib.util.find_spec("jsonargparse") is None,
    reason="jsonargparse is not installed: pip install 'dptrain[config]' (it is in the test extra)",
)


@dataclasses.dataclass
class Opt:
    lr: float = 0.1
    """learning rate of the toy optimizer"""
    betas: tuple[float, float] = (0.9, 0.99)


@dataclasses.dataclass
class ModelArgs:
    n_layer: int = 4
    """transformer blocks"""
    dropout: float | None = 0.1
    opt: Opt = dataclasses.field(default_factory=Opt)


@pytest.fixture(autouse=True)
def _forget_resolved(monkeypatch):
    # parse_config remembers its settings in the process; no other test may find them.
    monkeypatch.setattr(cli_config, "_resolved", None)


def _write(path, content) -> str:
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return str(path)


def _parse(*args: str):
    return parse_config(trainer=TrainerConfig, model=ModelArgs, args=list(args))


# ---------------------------------------------------------------- what it builds -----


@needs_jsonargparse
def test_defaults_then_files_in_order_then_options_wherever_they_stand(tmp_path):
    first = _write(tmp_path / "first.yaml", {"trainer": {"strategy": "ddp", "batch_size": 8, "seed": 5},
                                              "model": {"n_layer": 6, "opt": {"lr": 0.5}}})
    second = _write(tmp_path / "second.yaml", {"trainer": {"strategy": "none"}, "model": {"opt": {"lr": 0.3}}})
    # The options come first on this line, yet win over both files.
    cfg = _parse("--trainer.batch_size", "16", "--model.opt.lr=0.2", "--config", first, "--model.dropout", "null",
                 "--config", second)
    assert isinstance(cfg.trainer, TrainerConfig) and isinstance(cfg.model, ModelArgs)
    assert cfg.trainer.strategy == "none"  # the second file over the first
    assert cfg.trainer.batch_size == 16 and cfg.model.opt.lr == 0.2  # the options over both
    assert cfg.trainer.seed == 5 and cfg.model.n_layer == 6  # the first file where nothing else says
    assert cfg.model.dropout is None and cfg.model.opt.betas == (0.9, 0.99)
    assert cfg.trainer.num_workers == TrainerConfig().num_workers  # a default
    assert cfg["model"] is cfg.model
    with pytest.raises(AttributeError, match="groups are"):
        cfg.data


@needs_jsonargparse
def test_an_instance_gives_the_defaults():
    cfg = parse_config(trainer=TrainerConfig(strategy="none", batch_size=32), args=["--trainer.seed", "3"])
    assert (cfg.trainer.strategy, cfg.trainer.batch_size, cfg.trainer.seed) == ("none", 32, 3)


@needs_jsonargparse
def test_the_resolved_settings_are_complete_and_read_back_the_same(tmp_path):
    cfg = _parse("--trainer.max_grad_norm", "1.5", "--model.dropout", "null", "--model.n_layer", "2")
    data = cfg.to_dict()
    assert set(data) == {"trainer", "model"}
    # Every field, read from the class now (TrainerConfig gains fields), defaults and nulls included.
    assert set(data["trainer"]) == {f.name for f in dataclasses.fields(TrainerConfig)}
    assert data["trainer"]["max_grad_norm"] == 1.5 and data["trainer"]["strategy"] is None
    assert data["model"] == {"n_layer": 2, "dropout": None, "opt": {"lr": 0.1, "betas": [0.9, 0.99]}}
    assert yaml.safe_load(cfg.to_yaml()) == data
    # The process remembers them (for config.yaml and the trackers), as a copy.
    assert cli_config.resolved() == data
    cli_config.resolved()["model"]["n_layer"] = 99
    assert cli_config.resolved()["model"]["n_layer"] == 2
    again = _parse("--config", _write(tmp_path / "resolved.yaml", cfg.to_yaml()))
    assert again.trainer == cfg.trainer and again.model == cfg.model and again.to_dict() == data


@needs_jsonargparse
def test_values_yaml_cannot_hold_are_left_out_and_named():
    @dataclasses.dataclass
    class WithObjects:
        steps: int = 3
        trackers: list = dataclasses.field(default_factory=lambda: [object()])
        metric: object = max

    cfg = parse_config(run=WithObjects, args=["--run.steps", "5"])
    assert cfg.run.steps == 5 and len(cfg.run.trackers) == 1  # the object is kept in the dataclass
    assert cfg.left_out == ["run.trackers"]
    assert cfg.to_dict() == {"run": {"steps": 5, "metric": "builtins.max"}}
    assert cfg.to_yaml().startswith("# not in this file (set in the script, not from a config): run.trackers\n")


@needs_jsonargparse
def test_help_shows_every_field_with_its_type_default_and_docstring(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse("--help")
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # the help wraps at the terminal's width
    for f in dataclasses.fields(TrainerConfig):
        assert f"--trainer.{f.name} " in out
    # TrainerConfig's fields are documented in its docstring's Attributes: section ...
    assert "--trainer.strategy STRATEGY how the model is replicated" in out
    assert "(type: int, default: 0)" in out
    # ... ModelArgs' by attribute docstrings, nested dataclasses included.
    assert "--model.n_layer N_LAYER transformer blocks (type: int, default: 4)" in out
    assert "--model.opt.lr LR learning rate of the toy optimizer (type: float, default: 0.1)" in out
    assert "--config CONFIG" in out and "--print_config" in out


@needs_jsonargparse
def test_print_config_prints_the_resolved_yaml_and_exits(capsys):
    expected = _parse("--model.n_layer", "7").to_dict()
    with pytest.raises(SystemExit) as exit_:
        _parse("--print_config", "--model.n_layer", "7")
    assert exit_.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == expected


@needs_jsonargparse
def test_help_and_print_config_are_said_by_rank_0_only(capsys, monkeypatch):
    if dptrain.is_initialized():
        pytest.skip("a process group of another test is still up")
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    for flag in ("--help", "--print_config"):
        with pytest.raises(SystemExit) as exit_:
            _parse(flag)
        assert exit_.value.code == 0
        assert capsys.readouterr() == ("", "")


# ------------------------------------------------------- one line for each mistake -----

_MISTAKES = {
    "unknown option": (["--trainer.batch_sise", "3"], None,
                       ["unknown option --trainer.batch_sise", "did you mean --trainer.batch_size?"]),
    "unknown nested option": (["--model.opt.lrr", "3"], None, ["did you mean --model.opt.lr?"]),
    "unknown group": (["--trainr.seed", "3"], None, ["unknown option --trainr.seed", "did you mean --trainer.seed?"]),
    "stray argument": (["stray"], None, ["unexpected argument 'stray'", "--<group>.<key>"]),
    "bad type": (["--trainer.batch_size", "abc"], None,
                 ["--trainer.batch_size='abc' on the command line is not a valid int | None"]),
    "bad tuple": (["--model.opt.betas", "[1, 2, 3]"], None,
                  ["--model.opt.betas='[1, 2, 3]'", "tuple[float, float]", "2 elements"]),
    "refused by __post_init__": (["--trainer.strategy", "dpp"], None,
                                 ["TrainerConfig(strategy='dpp')", "['ddp', 'fsdp'", "(--trainer.strategy on the"]),
    "unknown key in a file": ([], {"trainer": {"batch_sise": 3}}, ["unknown key 'trainer.batch_sise' in ", "run.yaml",
                                                                   "did you mean 'trainer.batch_size'?"]),
    "unknown nested key in a file": ([], {"model": {"opt": {"lrr": 1}}},
                                     ["unknown key 'model.opt.lrr'", "did you mean 'model.opt.lr'?"]),
    "unknown group in a file": ([], {"trainr": {"seed": 1}}, ["unknown key 'trainr'", "did you mean 'trainer'?"]),
    "no close key": ([], {"model": {"zzz": 1}},
                     ["unknown key 'model.zzz'", "the keys of model are: dropout, n_layer, opt"]),
    "bad type in a file": ([], {"model": {"n_layer": "six"}},
                           ["model.n_layer='six' in ", "run.yaml is not a valid int"]),
    "refused in a file": ([], {"trainer": {"nan_policy": "ignore"}},
                          ["nan_policy='ignore'", "['stop', 'skip', 'off']", "(trainer.nan_policy in "]),
    "a group that is not a mapping": ([], {"trainer": 3}, ["trainer in ", "is 3, but it is a group of settings"]),
    "not YAML": ([], "model: {n_layer: [1}\n", ["run.yaml is not valid YAML at line 1"]),
    "not a mapping": ([], "[1, 2]\n", ["run.yaml holds a list", "keys of the top level (model, trainer)"]),
    "empty file": ([], "", ["run.yaml holds nothing"]),
}


@needs_jsonargparse
@pytest.mark.parametrize("case", sorted(_MISTAKES))
def test_each_mistake_is_one_line_and_exit_status_2(case, tmp_path, capsys):
    args, content, wanted = _MISTAKES[case]
    if content is not None:
        args = ["--config", _write(tmp_path / "run.yaml", content), *args]
    with pytest.raises(SystemExit) as exit_:
        _parse(*args)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err  # one line: no usage, no traceback
    assert err.startswith(f"{os.path.basename(sys.argv[0])}: error: ")
    for fragment in wanted:
        assert fragment in err, (fragment, err)
    assert cli_config.resolved() is None  # nothing is remembered from a refused command line


@needs_jsonargparse
def test_exit_on_error_false_raises_the_line_instead():
    with pytest.raises(ValueError, match=r"^unknown option --trainer.batch_sise; did you mean --trainer.batch_size\?$"):
        parse_config(trainer=TrainerConfig, args=["--trainer.batch_sise", "3"], exit_on_error=False)


@needs_jsonargparse
def test_a_group_must_be_a_dataclass():
    with pytest.raises(ValueError, match="a group is a dataclass"):
        parse_config(trainer=dict, args=[])
    with pytest.raises(ValueError, match="at least one group"):
        parse_config(args=[])
    with pytest.raises(ValueError, match="'config' cannot name a group"):
        parse_config(config=TrainerConfig, args=[])


def test_without_jsonargparse_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # `import jsonargparse` fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'dptrain\[config\]'"):
        parse_config(trainer=TrainerConfig, args=[])


_SCRIPT = """
import dataclasses, sys
import dptrain, dptrain.train
from dptrain.train import TrainerConfig, parse_config

# The optional extra is imported by parse_config only, never by `import dptrain` / `import dptrain.train`.
print("imported:", sorted(m for m in sys.modules if m.split(".")[0] in ("jsonargparse", "docstring_parser")))

@dataclasses.dataclass
class ModelArgs:
    n_layer: int = 4

cfg = parse_config(trainer=TrainerConfig, model=ModelArgs)
print("parsed", cfg.trainer.keep_last, cfg.model.n_layer)
"""


@needs_jsonargparse
def test_a_script_prints_one_line_and_exits_2_and_imports_jsonargparse_only_then(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script), "--model.n_layer", "2", "--trainer.keep_last", "-1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2 and done.stdout == "imported: []\n"
    assert done.stderr == ("train.py: error: TrainerConfig(keep_last=-1) must be an integer >= 0 "
                           "(--trainer.keep_last on the command line)\n")


# ------------------------------------------------------------ config.yaml of a run -----


@needs_jsonargparse
def test_a_trainer_run_writes_its_resolved_settings_as_config_yaml(tmp_path):
    cdir = tmp_path / "ckpt"
    run = _write(tmp_path / "run.yaml", {"trainer": {"strategy": "none", "batch_size": 4, "verbose": False},
                                         "model": {"n_layer": 2}})
    cfg = _parse("--config", run, "--trainer.checkpoint_dir", str(cdir), "--trainer.progress", "false",
                 "--model.opt.lr", "0.05")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    Trainer(model, torch.optim.SGD(model.parameters(), lr=cfg.model.opt.lr), data, nn.MSELoss(), cfg.trainer).fit(
        max_epochs=1)
    saved = (cdir / CONFIG_NAME).read_text()
    assert saved.startswith("# The settings of this run")
    assert yaml.safe_load(saved) == cfg.to_dict()
    assert yaml.safe_load(saved)["trainer"]["batch_size"] == 4 and yaml.safe_load(saved)["model"]["opt"]["lr"] == 0.05
    # `--config config.yaml` gives the same settings back.
    again = _parse("--config", str(cdir / CONFIG_NAME))
    assert again.trainer == cfg.trainer and again.model == cfg.model


def _prepare(cdir) -> Checkpointer:
    cp = Checkpointer(str(cdir), 3, rank=0, world_size=1)
    cp.prepare()
    return cp


def _kept_configs(cdir) -> list[str]:
    return sorted(n for n in os.listdir(cdir) if n.startswith("config-"))


@needs_jsonargparse
def test_a_run_with_the_same_settings_leaves_config_yaml_alone(tmp_path):
    cdir = tmp_path / "ckpt"
    _prepare(cdir)
    assert not (cdir / CONFIG_NAME).exists()  # without parse_config no config.yaml
    _parse("--model.n_layer", "3")
    _prepare(cdir)
    before = os.stat(cdir / CONFIG_NAME)
    _parse("--model.n_layer", "3")  # a resumed (or restarted) run: the same settings
    _prepare(cdir)
    after = os.stat(cdir / CONFIG_NAME)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert _kept_configs(cdir) == []


@needs_jsonargparse
def test_a_resume_with_other_settings_keeps_the_earlier_config_under_another_name(tmp_path, capsys):
    cdir = tmp_path / "ckpt"
    _parse("--model.n_layer", "3")
    cp = _prepare(cdir)
    cp.resume_candidates(False, 0)
    cp.save({"model": {"w": torch.zeros(2)}}, epoch=1, step=4)
    earlier = (cdir / CONFIG_NAME).read_text()
    _parse("--model.n_layer", "5", "--trainer.max_grad_norm", "1.0")  # resumed with other settings
    cp = _prepare(cdir)
    path, _ = cp.read_first_readable(cp.resume_candidates("auto", 0), map_location="cpu")
    assert path == str(cdir / "ckpt-e0001-s000000004.pt")
    assert yaml.safe_load((cdir / CONFIG_NAME).read_text()) == cli_config.resolved()
    kept = _kept_configs(cdir)
    assert len(kept) == 1 and (cdir / kept[0]).read_text() == earlier
    assert capsys.readouterr().err.count(f"kept as {str(cdir / kept[0])!r}") == 1
    _parse("--model.n_layer", "7")  # and again: the second earlier one gets a name of its own
    _prepare(cdir)
    assert len(_kept_configs(cdir)) == 2


@contextlib.contextmanager
def _deadline(seconds: float):
    """Fail instead of hanging, should a FIFO ever be opened for reading."""

    def expire(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@needs_jsonargparse
@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_what_is_not_a_plain_config_yaml_is_kept_and_never_followed(tmp_path, kind):
    cdir = tmp_path / "ckpt"
    cdir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    planted = cdir / CONFIG_NAME
    if kind == "link":
        planted.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(planted)
    else:
        planted.mkdir()
        (planted / "inside.txt").write_text("kept\n")
    _parse("--model.n_layer", "3")
    with _deadline(10):
        _prepare(cdir)
    assert victim.read_text() == "someone else's file\n"
    assert not planted.is_symlink() and planted.is_file()
    assert yaml.safe_load(planted.read_text()) == cli_config.resolved()
    (kept,) = _kept_configs(cdir)
    check = {"link": os.path.islink, "fifo": lambda p: os.path.exists(p) and not os.path.isfile(p),
             "folder": lambda p: os.path.isfile(os.path.join(p, "inside.txt"))}[kind]
    assert check(str(cdir / kept))


@needs_jsonargparse
@pytest.mark.parametrize("same", [False, True], ids=["other settings", "same settings"])
def test_a_fresh_start_moves_the_earlier_runs_config_with_its_checkpoints(tmp_path, same, capsys):
    cdir = tmp_path / "ckpt"
    _parse("--model.n_layer", "3")
    earlier = cli_config.resolved()
    cp = _prepare(cdir)
    cp.resume_candidates(False, 0)
    cp.save({"model": {"w": torch.zeros(2)}}, epoch=1, step=4)
    _parse("--model.n_layer", "3" if same else "9")
    capsys.readouterr()
    cp = _prepare(cdir)
    assert cp.resume_candidates(False, 0) == []  # a fresh start: the earlier run is moved aside
    said = capsys.readouterr().err
    assert "kept as" not in said and f"with {'a copy of ' if same else ''}its {CONFIG_NAME}" in said, said
    (aside,) = [n for n in os.listdir(cdir) if n.startswith("previous-run-")]
    assert sorted(os.listdir(cdir / aside)) == ["ckpt-e0001-s000000004.pt", CONFIG_NAME]
    assert yaml.safe_load((cdir / aside / CONFIG_NAME).read_text()) == earlier
    assert yaml.safe_load((cdir / CONFIG_NAME).read_text()) == cli_config.resolved()
    assert _kept_configs(cdir) == []


# ----------------------------------------------------------- under `dptrain run` -----

_RANKS_SCRIPT = """
import dataclasses
import torch
from torch import nn
import dptrain
from dptrain.train import Trainer, TrainerConfig, parse_config

@dataclasses.dataclass
class DataArgs:
    n: int = 8
    \"\"\"samples\"\"\"

cfg = parse_config(trainer=TrainerConfig, data=DataArgs)
dptrain.init()
torch.manual_seed(0)
model = nn.Linear(3, 1)
data = torch.utils.data.TensorDataset(torch.randn(cfg.data.n, 3), torch.randn(cfg.data.n, 1))
Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, nn.MSELoss(), cfg.trainer).fit(max_epochs=1)
print(f"rank {dptrain.rank()}: batch_size={cfg.trainer.batch_size} n={cfg.data.n} strategy={cfg.trainer.strategy}")
dptrain.shutdown()
"""


@needs_jsonargparse
def test_two_ranks_under_dptrain_run_read_the_file_and_the_override(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_RANKS_SCRIPT))
    cdir = tmp_path / "ckpt"
    run = _write(tmp_path / "run.yaml", {"trainer": {"strategy": "ddp", "batch_size": 2, "checkpoint_dir": str(cdir),
                                                     "verbose": False, "progress": False}, "data": {"n": 8}})
    launcher = os.path.join(os.path.dirname(sys.executable), "dptrain")
    command = [launcher] if os.path.exists(launcher) else [sys.executable, "-m", "dptrain"]
    done = subprocess.run([*command, "run", "--nproc-per-node", "2", str(script), "--config", run, "--data.n", "12"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: batch_size=2 n=12 strategy=ddp" in done.stdout, done.stdout
    saved = yaml.safe_load((cdir / CONFIG_NAME).read_text())
    assert saved["data"] == {"n": 12} and saved["trainer"]["batch_size"] == 2
    assert _kept_configs(cdir) == []  # written once, by rank 0
