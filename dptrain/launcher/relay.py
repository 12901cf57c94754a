"""How ``dptrain run`` shows its ranks' output: every line under a ``[rankN]`` prefix, live.

[Note: carriage returns]
A progress bar (tqdm, the Trainer's) redraws one line by writing ``\\r`` and the new text,
without a newline. Read line by line from a pipe, a whole epoch of redraws would arrive as
one line at its end, each ``\\r`` overwriting the ``[rankN]`` prefix. So the relay reads
chunks as they come and splits them on ``\\r`` and ``\\n``: text followed by ``\\n`` is a
finished line; text after a ``\\r`` is an update of the line in progress. Where the update
goes depends on who watches:

* a terminal: each rank's line in progress is drawn in place (``[rank0] 42%|####  |``),
  one line per rank at the bottom of the screen, each cut to the terminal's width so that
  the cursor can find them again; a finished line of any rank (or of the launcher) erases
  them, is written, and they are drawn again below it;
* a pipe or a file: updates become ordinary prefixed lines, at most one per rank and
  stream every ``DPTRAIN_PROGRESS_EVERY_S`` seconds (default 5), always the newest, and
  the last state is never dropped -- so a log of a long epoch shows its progress without
  a line per step.

Bytes pass through undecoded (``\\r`` and ``\\n`` never occur inside a UTF-8 sequence);
only an in-place line is decoded, to be cut to the terminal's width.
"""

from __future__ import annotations

import collections
import os
import re
import select
import threading
import time
from typing import IO

from dptrain.runtime import settings as _settings

_SPLIT = re.compile(rb"(\r|\n)")
_MAX_LIVE = 16  # lines in progress shown at once on a terminal


def open_log(path: str) -> int:
    """A rank's log file under ``--log-dir``, opened to append (made if absent): a file descriptor.

    dptrain names this file itself, inside the user's folder, so a link there is refused rather
    than followed (what the rank prints would be appended to the file it points to), and a FIFO or
    a device is refused without waiting for a reader (see [Note: opening a file dptrain did not
    make] in ``dptrain.runtime.settings``).

    Raises:
        dptrain.runtime.settings.NotRegularFile: ``path`` is a link, a FIFO, a directory, a device.
        OSError: it cannot be made or written.
    """
    return _settings.open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666, follow=False)


def _isatty(stream: IO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class Console:
    """The launcher's stdout and stderr, shared by the relays of every rank.

    On a terminal it keeps the lines in progress of all ranks (one per rank, in rank
    order) at the bottom, redrawn in place; a finished line of any rank, or of the
    launcher, first erases them, is written, and they are drawn again below it.
    """

    def __init__(self, out: IO, err: IO) -> None:
        self.lock = threading.Lock()
        self._streams = (out, err)
        self.tty = (_isatty(out), _isatty(err))
        self._area = 1 if self.tty[1] else 0  # the stream the lines in progress are drawn on
        self._live: dict[object, tuple[int, bytes]] = {}  # owner -> (rank, prefixed text)
        self._drawn = 0  # lines in progress now on screen
        self._broken = [False, False]  # a terminal that hung up: stop writing, keep draining

    def _write(self, index: int, data: bytes) -> None:
        if self._broken[index] or not data:
            return
        stream = self._streams[index]
        try:
            target = getattr(stream, "buffer", None)
            if target is not None:
                target.write(data)
            else:
                stream.write(data.decode("utf-8", "replace"))
            stream.flush()
        except Exception:  # noqa: BLE001 - a hung-up terminal, a closed or odd stream
            # Stop writing there, but keep reading: a rank blocked on a full pipe would hang.
            self._broken[index] = True

    def size(self, index: int) -> tuple[int, int]:
        """(columns, rows) of stream ``index`` if it is a terminal ((80, 24) when it cannot tell)."""
        try:
            size = os.get_terminal_size(self._streams[index].fileno())
            columns, rows = size.columns, size.lines
        except (OSError, ValueError, AttributeError):
            columns, rows = 0, 0
        return columns if columns > 0 else 80, rows if rows > 0 else 24

    def _erase(self) -> bytes:
        if not self._drawn:
            return b""
        up = b"\x1b[%dA" % (self._drawn - 1) if self._drawn > 1 else b""
        self._drawn = 0
        return b"\r" + up + b"\x1b[J"  # to the first line in progress, clear to the end of the screen

    def _draw(self) -> bytes:
        columns, rows = self.size(self._area)
        entries = [text for _, text in sorted(self._live.values(), key=lambda e: e[0])]
        room = max(1, min(len(entries), rows - 1, _MAX_LIVE))
        if len(entries) > room:
            entries = entries[: room - 1] + [f"... and {len(entries) - room + 1} more".encode()]
        # Cut to the width: a line that wraps would not be found again by the cursor moves.
        cut = [e.decode("utf-8", "replace")[: columns - 1].encode("utf-8") + b"\x1b[K" for e in entries]
        self._drawn = len(cut)
        return b"\n".join(cut)

    def emit(self, owner: object, index: int, lines: list[bytes], live: bytes | None = None, rank: int = 0) -> None:
        """Write finished ``lines`` to stream ``index``; on a terminal, show ``live`` in place.

        ``live`` None leaves ``owner``'s line in progress as it is; ``b""`` removes it.
        """
        with self.lock:
            changed = False
            if live:
                self._live[owner] = (rank, live)
                changed = True
            elif live is not None and owner in self._live:
                del self._live[owner]
                changed = True
            if not lines and not changed:
                return
            chunks = [(self._area, self._erase())]
            if lines:
                chunks.append((index, b"".join(line + b"\n" for line in lines)))
            if self._live:
                chunks.append((self._area, self._draw()))
            merged: list[tuple[int, bytes]] = []
            for where, data in chunks:  # one write per stream where possible: less flicker
                if merged and merged[-1][0] == where:
                    merged[-1] = (where, merged[-1][1] + data)
                else:
                    merged.append((where, data))
            for where, data in merged:
                self._write(where, data)


class _Splitter:
    """Cuts a byte stream into finished lines and the state of the line in progress."""

    def __init__(self) -> None:
        self.current = b""  # text since the last \r or \n
        self.live = b""  # the text a \r ended: the line in progress as last drawn
        self.after_cr = False  # the line in progress has been redrawn at least once
        self.completed = False  # the last feed finished a line that had been redrawn

    def feed(self, data: bytes) -> list[bytes]:
        finished = []
        self.completed = False
        for piece in _SPLIT.split(data):
            if piece == b"\n":
                # "text\r\n" finishes "text"; a bare "\r" then "\n" finishes what was drawn.
                finished.append(self.current if self.current or not self.after_cr else self.live)
                self.completed = self.completed or self.after_cr
                self.current, self.live, self.after_cr = b"", b"", False
            elif piece == b"\r":
                if self.current:
                    self.live, self.current = self.current, b""
                self.after_cr = True
            else:
                self.current += piece
        return finished

    def shown(self) -> bytes:
        """What a terminal would show on the line in progress now."""
        return self.current or self.live

    def update(self) -> bytes:
        """The newest redrawn state of the line in progress (b"" when there is none)."""
        return self.shown() if self.after_cr else b""


class Relay:
    """Reads one output pipe of one rank and shows it under ``[rankN]`` on the console.

    Keeps the last finished lines (``tail``) for the failure report even when the rank's
    output is not shown (``--log-ranks``).
    """

    def __init__(self, pipe: IO[bytes], rank: int, index: int, console: Console, show: bool,
                 tail: collections.deque | None = None, every_s: float | None = None,
                 log_path: str | None = None) -> None:
        self._pipe = pipe
        # ``--log-dir`` with ``--tee``/``--redirects``: every byte, as the rank wrote it, also
        # goes to this file (carriage returns included, as a terminal would have received them).
        self._log = os.fdopen(open_log(log_path), "ab", buffering=0) if log_path else None
        self._rank = rank
        self._prefix = f"[rank{rank}] ".encode()
        # torch prints an uncaught exception in a rank as "[rank1]: Traceback ..."; under our
        # own prefix that would read "[rank1] [rank1]: Traceback", so torch's copy is dropped.
        self._torch_prefix = f"[rank{rank}]:".encode()
        self._index = index
        self._console = console
        self._show = show
        self._tty = show and console.tty[index]
        self._every_s = _settings.get("DPTRAIN_PROGRESS_EVERY_S") if every_s is None else every_s
        self._split = _Splitter()
        self._pending = b""  # lines mode: newest update not yet written
        self._last_emit = float("-inf")
        self._emitted = b""  # lines mode: the update written last
        self.tail = tail
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dptrain-relay-{rank}-{index}")
        self._thread.start()

    def renumber(self, rank: int) -> None:
        """Show the rank's lines under its new number from now on (see ``resize``)."""
        self._rank = rank
        self._prefix = f"[rank{rank}] ".encode()
        self._torch_prefix = f"[rank{rank}]:".encode()

    def _run(self) -> None:
        fd = self._pipe.fileno()
        poller = select.poll()  # not select(): that fails on descriptors above 1023
        poller.register(fd, select.POLLIN)
        while True:
            if self._pending:
                # Lines mode: write a held-back update once its turn comes, data or not.
                wait = self._last_emit + self._every_s - time.monotonic()
                if wait <= 0 or not poller.poll(wait * 1000):
                    self._write_lines([], self._take_pending())
                    continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            self._write_log(data)
            try:
                self._on_data(data)
            except Exception as exc:  # noqa: BLE001 - never stop reading: the rank would block
                self._show = False
                self._console.emit(self, 1, [self._prefix + f"(output no longer shown: {exc!r})".encode()])
        self._on_end()
        self._pipe.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _write_log(self, data: bytes) -> None:
        if self._log is None:
            return
        try:
            self._log.write(data)
        except OSError as exc:  # a full disk must not stop the rank (its pipe would fill) or the console
            self._log.close()
            self._log = None
            self._console.emit(self, 1, [self._prefix + f"(log file no longer written: {exc})".encode()])

    def _remember(self, lines: list[bytes]) -> None:
        if self.tail is not None:
            self.tail.extend(line.decode("utf-8", "replace") for line in lines)

    def _take_pending(self) -> bytes:
        pending, self._pending = self._pending, b""
        if pending:
            self._last_emit = time.monotonic()
            self._emitted = pending
        return pending

    def _own(self, line: bytes) -> bytes:
        if line.startswith(self._torch_prefix):
            return line[len(self._torch_prefix):].removeprefix(b" ")
        return line

    def _on_data(self, data: bytes) -> None:
        finished = [self._own(line) for line in self._split.feed(data)]
        self._remember(finished)
        if not self._show:
            return
        if self._tty:
            shown = self._split.shown()
            self._console.emit(self, self._index, [self._prefix + line for line in finished],
                               live=self._prefix + shown if shown.strip() else b"", rank=self._rank)
            return
        due = time.monotonic() - self._last_emit >= self._every_s
        before = b""
        if finished:
            # The state drawn before these lines: shown if its turn has come, unless the
            # first of them is that very line, finished.
            before = self._take_pending() if due and not self._split.completed else b""
            self._pending = self._emitted = b""
        update = self._split.update()
        if update.strip():
            self._pending = update
        after = self._take_pending() if due and not before else b""
        self._write_lines(finished, before, after)

    def _write_lines(self, finished: list[bytes], before: bytes = b"", after: bytes = b"") -> None:
        lines = [before] if before else []
        lines += finished
        if after:
            lines.append(after)
        if lines:
            self._console.emit(self, self._index, [self._prefix + line for line in lines])

    def _on_end(self) -> None:
        # The rank is gone: whatever it left on its unfinished line is its last word.
        last = self._split.shown()
        last = last if last.strip() else b""
        if last:
            self._remember([last])
        if not self._show:
            return
        if self._tty:
            self._console.emit(self, self._index, [self._prefix + last] if last else [], live=b"")
        elif last and last != self._emitted:
            self._write_lines([last])

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
