"""Every Python block of README.md and docs/*.md runs as written, and every link lands.

The convention, for whoever writes the guides:

- A block fenced ```python is a complete script: it defines every name it uses and
  runs on the CPU, alone, in a few seconds. The test writes it to ``block.py`` in an empty
  directory and runs it there as ``python block.py`` would, with ``PYTHONPATH`` at the
  checkout and ``OMP_NUM_THREADS=1``, outside any launcher or Slurm job (in a child forked
  from a parent that imported torch and dptrain already, see tests/_warm.py): a block meant for several ranks
  (``dptrain.init()``, DDP, FSDP) runs as a world of one. Keep such blocks tiny (a few steps,
  small tensors); they all share the suite's time.
- A Python block that cannot run here (it needs several nodes, a GPU with no CPU fallback, a
  file the test cannot provide) is fenced ```python no-run instead. Use it rarely: at most
  ``MAX_NO_RUN`` of them, and prefer a block that falls back to the CPU.
- Shell commands are fenced ```bash, program output ```text (or a bare fence);
  neither is run here. The README's Quick start commands are run by tests/test_readme.py.

The README's first block (``## A data-parallel script``) is run by tests/test_readme.py, alone
and on two ranks, so it is not run again here. Each block is one test item, named by file and
line; a failure names the block's first line and shows the end of its output. The blocks run
two at a time (one per core of a CI machine), started when the first of them is asked for.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import queue
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

from tests._warm import WarmRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
MAX_NO_RUN = 2
BLOCK_TIMEOUT_S = 120
PARALLEL = 2

# Blocks run by another test, by (file, the heading right above the block).
RUN_ELSEWHERE = {("README.md", "## A data-parallel script"): "tests/test_readme.py runs it alone and on two ranks"}

_FENCE = re.compile(r"^```(.*)$")


class Block(NamedTuple):
    path: str  # relative to the checkout
    line: int  # the line of the opening fence, from 1
    info: str  # the fence's info string: "python", "python no-run", "bash", ...
    heading: str  # the nearest heading above the block
    code: str

    @property
    def first_line(self) -> str:
        return next((line for line in self.code.splitlines() if line.strip()), "")

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks(path: str) -> list[Block]:
    """Every fenced block of one Markdown file, with its fence's info string."""
    blocks, heading, opened, body = [], "", None, []
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (number, fence.group(1).strip()), []
            elif line.startswith("#"):
                heading = line
        elif fence and not fence.group(1).strip():
            blocks.append(Block(path, opened[0], opened[1], heading, "\n".join(body) + "\n"))
            opened = None
        else:
            body.append(line)
    assert opened is None, f"{path}:{opened[0]}: a code block is never closed"
    return blocks


ALL_BLOCKS = [b for path in DOCS for b in _blocks(path)]
PYTHON = [b for b in ALL_BLOCKS if b.info == "python"]
TO_RUN = [b for b in PYTHON if (b.path, b.heading) not in RUN_ELSEWHERE]


def test_the_blocks_follow_the_convention():
    assert "docs/ddp.md" in DOCS and "docs/trainer.md" in DOCS, f"the guides moved? found {DOCS}"
    odd = [f"{b.name} ```{b.info}" for b in ALL_BLOCKS if b.info.startswith("py") and b.info not in ("python", "python no-run")]
    assert not odd, f"fence Python as ```python (run) or ```python no-run (not run), not: {odd}"
    no_run = [b.name for b in ALL_BLOCKS if b.info == "python no-run"]
    assert len(no_run) <= MAX_NO_RUN, f"{len(no_run)} blocks are not run ({no_run}); make them runnable on the CPU"
    for (path, heading), why in RUN_ELSEWHERE.items():
        assert [b for b in PYTHON if (b.path, b.heading) == (path, heading)], f"{path} has no block under {heading!r} ({why})"


def _clean_env() -> dict[str, str]:
    """This environment without what would make a block join a job: a world of one."""
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


#: What the warm parents import once: the interpreter's start and these imports (torch's, DDP's
#: torch._dynamo) are not what a block tests, and cost more CPU than most blocks themselves.
PRELOAD = ["numpy", "torch", "torch.distributed", "dptrain", "dptrain.runtime.env", "dptrain.comm",
           "dptrain.parallel.ddp", "dptrain.train", "dptrain.data"]


def _run(block: Block, where: str, warm: queue.Queue) -> subprocess.CompletedProcess:
    """``python block.py`` in ``where``: a child forked from a warm parent (tests/_warm.py) that
    runs the block as its ``__main__``, as a fresh interpreter would."""
    script = os.path.join(where, "block.py")
    with open(script, "w") as f:
        f.write(block.code)
    out = os.path.join(where, "output.txt")
    runner = warm.get()
    try:
        rc = runner.run(script, cwd=where, out=out, timeout=BLOCK_TIMEOUT_S)
    finally:
        warm.put(runner)
    with open(out, errors="replace") as f:
        text = f.read()
    if rc == -1:
        text = f"still running after {BLOCK_TIMEOUT_S}s\n{text}"
    return subprocess.CompletedProcess([sys.executable, script], rc, text, "")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected block started at once, two at a time; a test waits for its own. Under xdist
    the file's tests all run on one worker (its group in tests/conftest.py): every worker running
    some of them would run every block."""
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("block"), Block)]
    warm: queue.Queue = queue.Queue()
    runners = [WarmRunner(env=_clean_env(), preload=PRELOAD) for _ in range(min(PARALLEL, len(selected)))]
    for runner in runners:
        warm.put(runner)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {b.name: pool.submit(_run, b, str(tmp_path_factory.mktemp("block")), warm) for b in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    for runner in runners:
        runner.close()


@pytest.mark.parametrize("block", TO_RUN, ids=[b.name for b in TO_RUN])
def test_the_block_runs_as_written(block, runs):
    done = runs[block.name].result()
    assert done.returncode == 0, (
        f"the block at {block.name} (under {block.heading!r}), which begins {block.first_line!r}, "
        f"exited with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    )


# ------------------------------------------------------------------------------- links --


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    in_block, out = False, set()
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                in_block = not in_block
            elif not in_block and line.startswith("#"):
                out.add(_anchor(line))
    return out


def test_every_link_points_at_a_file_and_heading_that_exist():
    broken = []
    for path in DOCS:
        text = open(os.path.join(ROOT, path)).read()
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # links only in prose
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file_part)) if file_part \
                else os.path.join(ROOT, path)
            if not os.path.exists(dest):
                broken.append(f"{path}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{path}: {target} (no such heading in {os.path.relpath(dest, ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)
