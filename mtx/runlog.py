"""What a training run shows and keeps as it goes: train.log (`RunLog`), the lines of
metrics.jsonl, the progress bar, and the warnings held until train.log is open."""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from mtx.errors import named_os_errors

log = logging.getLogger(__name__)


def append_record(metrics: Any, record: dict[str, Any]) -> None:
    """Write a record to metrics.jsonl (None on ranks other than 0) as one line or none: a write
    cut short (a full disk) is taken back, and the error names the file (stop 63: a torn last line
    broke JSON Lines readers until a resume trimmed it)."""
    if metrics is None:
        return
    line = (json.dumps(record) + "\n").encode("utf-8")
    fd = metrics.fileno()  # written past the text layer: its buffer never holds half a line
    with named_os_errors(metrics.name):
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            if os.write(fd, line) < len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            with suppress(OSError):
                os.ftruncate(fd, end)
            raise


def zero_width_terminal(stream: Any) -> bool:
    """Whether `stream` is a terminal that reports 0 columns (a pseudo-terminal never sized:
    `script`'s, some containers'), where tqdm draws a bar 0 characters wide, nothing at all."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns == 0
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), closed
        return False


def progress_bar(seconds_left: Callable[[], float] | None, **options: Any) -> Any:
    """A tqdm bar of steps whose time left is at most `seconds_left()`, what train.max_minutes
    leaves, where that ends the run before the bar's total (stop 64: it counted to max_steps, 1:29:32
    left in a run whose budget ended 15 s later); None: tqdm's own estimate."""
    from tqdm import tqdm

    class BudgetBar(tqdm):
        @property
        def format_dict(self) -> dict[str, Any]:
            values = super().format_dict
            if seconds_left is None:
                return values
            n, total, elapsed = values["n"], values["total"], values["elapsed"]
            rate = values["rate"] or ((n - values["initial"]) / elapsed if elapsed else None)
            left = max(0.0, seconds_left())
            if rate:
                left = min(left, (total - n) / rate)
            # `remaining` reaches format_meter's fields, and the format names it (its default has it built in)
            values["remaining"] = self.format_interval(left)
            values["bar_format"] = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
            return values

    return BudgetBar(**options)


class UntilReaderGone:
    """A text stream that stops writing, quietly, once it cannot be written (its reader gone: a
    `mtx train ... 2>&1 | tee log` whose tee was killed). The progress bar then ends and training
    goes on, train.log keeping its record (stop 55: the bar's next write ended the run with exit
    141, and the steps since the last checkpoint were lost)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        self._try(lambda: self.stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._try(lambda: self.stream.flush())

    def _try(self, action: Callable[[], object]) -> None:
        if not self.gone:
            try:
                action()
            except (OSError, ValueError, AttributeError):  # a closed file; no stream (None)
                self.gone = True

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding: the stream's
        return getattr(self.stream, name)

    # the stream it wraps, to tqdm: a log line written to that stream (`tqdm.write`) clears the bar
    # first and draws it again after (stop 67: on a terminal every log line ran on from the bar's
    # text, and each validation left a frozen bar behind)
    def __eq__(self, other: object) -> bool:
        stream = other.stream if isinstance(other, UntilReaderGone) else other
        return stream is self.stream

    def __hash__(self) -> int:
        return hash(self.stream)


class HeldWarnings(logging.Handler):
    """Keeps the warnings logged while the data is read, before train.log can be opened."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RunLog(logging.FileHandler):
    """The run's train.log. A record that cannot be written there (a full disk, a train.log that
    is a directory) is one warning on standard error, and the log stops while training goes on:
    logging's own report was a traceback at every record ("--- Logging error ---"), and a close
    that failed in the cleanup hid the error that had stopped the run and skipped the removal of
    a failed start."""

    def __init__(self, path: Path) -> None:
        # (stop 67: a message naming a path of bytes that are not UTF-8 stopped the log for good)
        super().__init__(path, encoding="utf-8", errors="backslashreplace", delay=True)
        self.path = path
        self.failed = False
        self.thread = threading.get_ident()  # training's

    def filter(self, record: logging.LogRecord) -> bool:
        """mtx's records, and the training thread's: not those that other threads of a program that
        runs `mtx.cli.main` log on their own loggers (stop 68's probe: a host's heartbeat thread
        wrote its lines into the run's train.log)."""
        name = record.name or ""  # (None in mtx's own `makeLogRecord`s)
        # (a thread of None: a program that turned logging.logThreads off)
        ours = name == "mtx" or name.startswith("mtx.") or record.thread in (self.thread, None)
        return ours and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        try:
            super().emit(record)  # (FileHandler opens the file here, outside StreamHandler's try)
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord | None) -> None:
        if self.failed:
            return
        self.failed = True
        error = sys.exc_info()[1]
        stream, self.stream = self.stream, None
        with suppress(OSError, ValueError):  # what it still buffers cannot be written either
            if stream is not None:
                stream.close()
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        log.warning("%s: cannot write (%s); the run's messages go to standard error only", self.path, reason)

    def close(self) -> None:
        try:
            super().close()
        except (OSError, ValueError):
            self.handleError(None)
