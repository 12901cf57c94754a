"""Live rank output under `dptrain run`: carriage returns rendered line-wise, prefix intact.

Unit tests drive the relay through real pipes into fake streams; end-to-end tests run the
launcher on a pseudo-terminal (a live, in-place bar per rank) and on a pipe (throttled
progress lines), with a script that draws a tqdm-like bar and waits for a go-ahead file.
"""

import collections
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from dptrain.launcher.relay import Console, Relay, _Splitter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRESS = os.path.join(ROOT, "tests", "scripts", "progress.py")


def screen(data: str, columns: int = 100) -> list[str]:
    """The lines a terminal shows after ``data``: handles \\r, \\n, ESC[K, ESC[nA and ESC[J."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[(\d*)([A-Za-z])|(\r)|(\n)|([^\x1b\r\n])", data):
        count, code, cr, lf, char = token
        if cr:
            col = 0
        elif lf:
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif code == "K":
            lines[row] = lines[row][:col]
        elif code == "A":
            row = max(0, row - int(count or 1))
        elif code == "J":
            lines[row] = lines[row][:col]
            del lines[row + 1 :]
        elif char:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + char + line[col + 1 :]
            col = min(col + 1, columns - 1)
    return [line for line in lines if line] if lines[-1] == "" else lines


class FakeStream(io.TextIOWrapper):
    def __init__(self, tty: bool):
        super().__init__(io.BytesIO(), encoding="utf-8")
        self._tty = tty

    def isatty(self):
        return self._tty

    def text(self) -> str:
        self.flush()
        return self.buffer.getvalue().decode()


def relay_pipes(tty: bool, ranks=(0,), every_s=60.0):
    """One relay per rank on its stderr; returns (console's stderr, writers, relays, tails)."""
    out, err = FakeStream(tty), FakeStream(tty)
    console = Console(out, err)
    writers, relays, tails = [], [], []
    for rank in ranks:
        r, w = os.pipe()
        tail = collections.deque(maxlen=10)
        relays.append(Relay(os.fdopen(r, "rb"), rank, 1, console, True, tail, every_s=every_s))
        writers.append(w)
        tails.append(tail)
    return err, writers, relays, tails


def finish(writers, relays):
    for w in writers:
        os.close(w)
    for relay in relays:
        relay.join(10)


@pytest.mark.parametrize("chunks, lines, shown", [
    ([b"a\nb\n"], [b"a", b"b"], b""),
    ([b"\r 10%", b"\r 20%", b"\n"], [b" 20%"], b""),
    ([b"abc\r\n"], [b"abc"], b""),  # Windows line ending
    ([b"\r 10%\r 20%\r"], [], b" 20%"),
    ([b"partial li", b"ne\nnext"], [b"partial line"], b"next"),
])
def test_splitter_finishes_lines_and_keeps_the_line_in_progress(chunks, lines, shown):
    s = _Splitter()
    finished = [line for chunk in chunks for line in s.feed(chunk)]
    assert finished == lines and s.shown() == shown


def test_without_terminal_updates_become_throttled_prefixed_lines():
    err, (w,), relays, _ = relay_pipes(tty=False, every_s=60.0)
    for i in range(50):
        os.write(w, f"\r{i:3d}%|{'#' * (i // 5):<10}|".encode())
    os.write(w, b"\r100%|##########|\n")
    finish([w], relays)
    lines = err.text().splitlines()
    assert "\r" not in err.text()
    assert all(line.startswith("[rank0] ") for line in lines)
    # the first update (at once), then nothing for 60 s but the final state
    assert len(lines) <= 2 and lines[-1] == "[rank0] 100%|##########|", lines


def eventually(condition, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_without_terminal_the_newest_update_is_written_when_its_turn_comes():
    err, (w,), relays, _ = relay_pipes(tty=False, every_s=2.0)
    os.write(w, b"\rstep 1")
    assert eventually(lambda: "step 1" in err.text())  # the first update: at once
    os.write(w, b"\rstep 2\rstep 3")  # then nothing more: the newest must still come out
    assert eventually(lambda: "step 3" in err.text())
    assert err.text().splitlines() == ["[rank0] step 1", "[rank0] step 3"]
    finish([w], relays)
    assert err.text().splitlines() == ["[rank0] step 1", "[rank0] step 3"]  # not twice


def test_output_left_without_a_newline_is_never_lost():
    err, (w,), relays, (tail,) = relay_pipes(tty=False)
    os.write(w, b"Traceback ...\nRuntimeError: boom")  # the rank dies before its newline
    finish([w], relays)
    assert err.text().splitlines() == ["[rank0] Traceback ...", "[rank0] RuntimeError: boom"]
    assert list(tail) == ["Traceback ...", "RuntimeError: boom"]


def test_on_a_terminal_each_rank_redraws_its_own_line_in_place():
    err, (w0, w1), relays, _ = relay_pipes(tty=True, ranks=(0, 1))
    os.write(w0, b"\rep 1: 10%")
    assert eventually(lambda: screen(err.text()) == ["[rank0] ep 1: 10%"])
    os.write(w1, b"\rep 1: 20%")
    os.write(w0, b"\rep 1: 30%")
    assert eventually(lambda: screen(err.text()) == ["[rank0] ep 1: 30%", "[rank1] ep 1: 20%"]), err.text()
    # As tqdm.write does: back to the start of the bar, the line, then the bar again. The
    # line goes above the lines in progress.
    os.write(w1, b"\ra finished line\n\rep 1: 40%")
    expected = ["[rank1] a finished line", "[rank0] ep 1: 30%", "[rank1] ep 1: 40%"]
    assert eventually(lambda: screen(err.text()) == expected), err.text()
    os.write(w0, b"\rep 1: 100%\n")
    expected = ["[rank1] a finished line", "[rank0] ep 1: 100%", "[rank1] ep 1: 40%"]
    assert eventually(lambda: screen(err.text()) == expected), err.text()
    finish([w0, w1], relays)  # rank 1 ends without finishing its line: it stays, for good
    assert screen(err.text()) == expected


# ----------------------------------------------------------------------- end to end --


def _launch(stdout, stderr, tmp_path, extra_env=None):
    env = dict(os.environ, DPTRAIN_PROGRESS_EVERY_S="0.5", **(extra_env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "dptrain", "run", "--nproc-per-node", "2", PROGRESS, str(tmp_path / "go")],
        stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
    )


def _read_until(fd, buf: bytearray, needles, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(n in buf for n in needles):
        assert time.monotonic() < deadline, f"never saw {needles}; got {bytes(buf)!r}"
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal closed
            chunk = b""
        assert chunk, f"output ended before {needles}; got {bytes(buf)!r}"
        buf += chunk


def _read_to_end(fd, buf: bytearray) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk


def test_a_terminal_shows_every_ranks_bar_live_with_its_prefix(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = _launch(slave, slave, tmp_path)
    os.close(slave)
    buf = bytearray()
    try:
        # Live: both bars are on screen while the ranks still wait for the go-ahead.
        _read_until(master, buf, [b"[rank0] step 5/5 |#####|", b"[rank1] step 5/5 |#####|"])
        (tmp_path / "go").touch()
        _read_to_end(master, buf)
    finally:
        (tmp_path / "go").touch()
        proc.kill() if proc.poll() is None else None
        os.close(master)
    assert proc.wait(60) == 0
    text = buf.decode()
    assert "[rank0] progress mode tty" in text and "[rank1] progress mode tty" in text
    assert all(m.start() >= 8 and text[m.start() - 8 : m.start() - 1] in ("[rank0]", "[rank1]")
               for m in re.finditer(r"step \d/5", text)), "a redraw lost its [rankN] prefix"
    shown = screen(text)
    assert "[rank0] step 5/5 |#####| done" in shown and "[rank1] step 5/5 |#####| done" in shown
    assert not any(re.fullmatch(r"\[rank\d\] step [0-4]/5.*", line) for line in shown)  # redrawn, not kept


def test_without_a_terminal_progress_is_a_line_now_and_then(tmp_path):
    proc = _launch(subprocess.PIPE, subprocess.PIPE, tmp_path)
    buf = bytearray()
    try:
        # The newest state arrives by itself after DPTRAIN_PROGRESS_EVERY_S, while the
        # ranks write nothing more.
        _read_until(proc.stderr.fileno(), buf, [b"[rank0] step 5/5 |#####|\n", b"[rank1] step 5/5 |#####|\n"])
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        (tmp_path / "go").touch()
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0
    text = buf.decode() + err.decode()
    assert "\r" not in text
    for rank in (0, 1):
        mine = [line for line in text.splitlines() if line.startswith(f"[rank{rank}] step")]
        assert 2 <= len(mine) <= 4, mine  # not a line per update (that would be 7)
        assert mine[-2:] == [f"[rank{rank}] step 5/5 |#####|", f"[rank{rank}] step 5/5 |#####| done"]
        assert f"[rank{rank}] progress mode lines" in out.decode()
