"""With CUDA present, a job that says CPU stays on the CPU: nothing picks CUDA because it
exists (the first GPU machine that ran the suite found comm hooks, the Trainer and the data
loader doing so). This CPU-only machine plays a GPU machine through ``tests/fake_cuda``:
``torch.cuda.is_available()`` is True there, and any real use of CUDA fails at once."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_cpu_job_on_a_machine_with_cuda_never_touches_cuda():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "fake_cuda"), ROOT]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "cpu_job_with_cuda_present.py")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["ok", "ok"], out.stdout + out.stderr[-2000:]
