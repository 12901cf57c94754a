"""The torch versions dptrain supports: an older torch is refused at ``import dptrain`` with a
message that names the version found and the fix; the supported one imports."""

import os
import subprocess
import sys

import pytest

from dptrain.runtime import torch_version as _torch_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_oldest_supported_torch_passes_and_an_older_one_is_refused():
    _torch_version.check(_torch_version.MIN_TORCH)
    _torch_version.check((_torch_version.MIN_TORCH[0] + 1, 0))
    with pytest.raises(ImportError, match=r"dptrain needs torch 2\.4 or newer, but torch 2\.3 is installed; upgrade"):
        _torch_version.check((2, 3))


def test_import_dptrain_with_an_old_torch_says_which_and_how_to_fix(tmp_path):
    # Package metadata that says torch 2.3.1, found before the real one: what an environment
    # with that torch looks like to `import dptrain` (which reads the version without importing torch).
    info = tmp_path / "torch-2.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.1\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "-c", "import dptrain"], capture_output=True, text=True, env=env,
                         timeout=60, cwd=tmp_path)
    assert out.returncode != 0
    assert ("ImportError: dptrain needs torch 2.4 or newer, but torch 2.3.1 is installed; "
            "upgrade it in this environment (pip install 'torch>=2.4')") in out.stderr, out.stderr


def test_the_installed_torch_is_supported_and_read_without_importing_it():
    code = "import sys, dptrain; from dptrain.runtime import torch_version as v; print(v.installed(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    import torch

    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert out.stdout.split() == [f"({major},", f"{minor})", "False"], out.stdout + out.stderr


def test_older_than_compares_the_installed_torch_and_counts_an_unknown_one_as_new(monkeypatch):
    found = _torch_version.installed()
    assert _torch_version.older_than((found[0], found[1] + 1))
    assert not _torch_version.older_than(found)
    monkeypatch.setattr(_torch_version, "installed", lambda: None)  # a source build without metadata
    assert not _torch_version.older_than((99, 0))
