"""Where mtx commands write, checked before the work: an output path must not be one of the
command's inputs, a run's own file or a data file, nor lie under a file or a broken link; and
standard input and output as files (one file for both, a non-blocking pipe, UTF-8 whatever the
locale, a full disk at exit)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mtx.errors import MtxError, not_found

if TYPE_CHECKING:
    from mtx.config import Config


def check_parents(option: str, path: Path) -> None:
    """An output path under a regular file (`afile/x.en`) or under a symbolic link to nothing is
    one line naming that file or link, not the system's "File exists" or "Not a directory" about
    another name."""
    for parent in path.parents:
        if parent.is_symlink() and not parent.exists():  # (stop 61: "dd: File exists")
            raise MtxError(f"{option} {path}: {not_found(parent, 'directory')}")
        if parent.exists():
            if not parent.is_dir():
                raise MtxError(f"{option} {path}: {parent} is a file, not a directory")
            return


def resolved_path(option: str, path: Path) -> Path:
    """`path.resolve()`, where a loop of symbolic links (RuntimeError before Python 3.13) is a one-line error."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # (stop 66 review, stop 70: a traceback)
        raise MtxError(f"{option} {path}: a loop of symbolic links; pass {option} with another path") from None


def check_file_path(option: str, path: Path, what: str) -> None:
    """An output file's path that is a directory (the error asks for `what`), or lies under a
    regular file, is a one-line error."""
    if path.is_dir():
        raise MtxError(f"{option} {path} is a directory; give {what}")
    resolved_path(option, path)
    if path.is_symlink() and not path.exists() and not path.resolve().parent.is_dir():
        # written through, the link would fail after the work (stop 61: after all the decoding)
        raise MtxError(f"{option} {path}: a symbolic link to {os.readlink(path)}, whose directory does not exist")
    check_parents(option, path)
    if path.is_file() and not path.stat().st_mode & 0o222:  # a link to such a file too (stop 61)
        # replaced through a new file and a rename, or written through a link by root, it would
        # be overwritten whatever its mode (stop 61: average --out replaced a chmod 444 file)
        raise MtxError(f"{option} {path} is write-protected (no write permission); pass {option} with another path")


def same_file(path: Path, others: Iterable[Path | None]) -> bool:
    return path.exists() and any(o is not None and o.exists() and path.samefile(o) for o in others)


def not_a_runs_file(path: Path, named: str, fix: str, own_run: Path | None = None) -> None:
    """`path` (`named` so in the error) must be no run's own file or checkpoint, a link into one
    included (it is written through), except for files in `own_run`: eval's, average's and plot's
    outputs (stop 54: another run's last.pt was written over; stop 57: plot's, a run's best.pt)."""
    from mtx.checkpoint import any_runs_file

    other_run = any_runs_file(path)
    if other_run is not None and not (own_run is not None and same_file(other_run, [own_run])):
        # (stop 69's probe: a step_N.pt not yet written was called one of its files)
        raise MtxError(f"{named} is one of the files of the run {other_run}, or a name it writes; {fix}")


def check_output(output: Path, inputs: dict[str, Iterable[Path | None]]) -> None:
    """Before decoding, so that a bad output path fails at once: `output` must be a file path in a
    writable directory (or one to be made), none of the files this command reads (`inputs`:
    what each is -> paths), and no run's own file or checkpoint; `-` is standard output."""
    from mtx.plot import replaced_at

    if str(output) == "-":
        return
    check_file_path("--output", output, "the hypotheses file's path")
    for what, paths in inputs.items():
        if a_file_or_its_twin(output, [p for p in paths if p is not None]):
            raise MtxError(f"the hypotheses file {output} is {what}; pass --output with another path")
    not_a_runs_file(output, f"the hypotheses file {output}", "pass --output with another path")
    target = replaced_at(output)
    if target is None:  # a device or pipe: it is opened as it is, not replaced
        return
    # the directory, or the nearest one above it where it is to be made (`parent_directories`)
    nearest = next(d for d in (target.parent, *target.parent.parents) if d.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise MtxError(
            f"the hypotheses file {output}: cannot write to {target.parent}; pass --output with a writable path"
        )


def _gz_twin(path: Path) -> Path:
    """`f.gz` for `f`, `f` for `f.gz`: the other form of a data file, which mtx would read too."""
    return path.with_name(path.name.removesuffix(".gz")) if path.name.endswith(".gz") else Path(f"{path}.gz")


def a_file_or_its_twin(path: Path, files: list[Path]) -> bool:
    """Whether `path` is one of `files`, or the plain or gzipped twin of one where that is not
    there yet: mtx reads the plain one of the two first (stop 63: --output DATA/val.en beside
    val.en.gz was written, and every later eval scored against it, BLEU 100)."""
    from mtx.checkpoint import same_path

    return same_file(path, files) or same_path(path, [*files, *map(_gz_twin, files)])


_DATA_FILE = re.compile(r"[^.]+\.[^.]+(\.gz)?")  # SPLIT.LANG or SPLIT.LANG.gz


def data_files(folders: Iterable[Path | None]) -> list[Path]:
    """Every file of the form SPLIT.LANG[.gz] in each of `folders` that is a directory: a data
    directory's splits, all of them (stop 63: eval --split val wrote over test_2016_flickr.de.gz)."""
    return [
        path
        for folder in folders
        if folder is not None and folder.is_dir()
        for path in sorted(folder.iterdir())
        if _DATA_FILE.fullmatch(path.name) and path.is_file()
    ]


def training_data(cfg: Config, folders: Iterable[Path | None]) -> list[Path]:
    """The files (plain and gzipped) of the splits and languages `cfg` trains and validates on, in
    each of `folders` that is a directory."""
    from mtx.data import training_files

    return [
        path
        for folder in folders
        if folder is not None and folder.is_dir()
        for path in training_files(folder, cfg.data)
    ]


def is_stdout(path: Path) -> bool:
    """Whether `path` is the file standard output writes to (`/dev/stdout`, or the file it is
    redirected to)."""
    try:
        ours, theirs = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):  # no such path; a stream without a descriptor
        return False
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


class _EncodedLines:
    """A text stream's lines as UTF-8 bytes, for a standard input that has no bytes beneath it
    (`io.StringIO`, a notebook's): no descriptor, so `stream_lines` reads it line by line."""

    def __init__(self, text: IO[str]) -> None:
        self.text = text

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a text stream")

    def __iter__(self) -> Iterator[bytes]:
        return (line.encode("utf-8", "surrogateescape") for line in self.text)


def binary_stdin() -> Any:
    """Standard input's bytes (stop 68's probe: one that holds text only, as a program running `main`
    may set, ended in an AttributeError)."""
    buffer = getattr(sys.stdin, "buffer", None)
    return buffer if buffer is not None else _EncodedLines(sys.stdin)


def stdin_is_stdout() -> bool:
    """Whether standard input and standard output are one regular file (`< f >> f`)."""
    try:
        ours, theirs = os.fstat(sys.stdin.fileno()), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor
        return False
    return stat.S_ISREG(ours.st_mode) and (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


def utf8_stdout() -> None:
    """Standard output in UTF-8, as mtx reads its input, whatever the locale says (stop 54: on a
    locale of another encoding, such as Windows' code page for a redirected stream, a translation
    with a character outside it stopped with a traceback after decoding, and one inside it was
    written in a file that mtx itself then refused as not UTF-8)."""
    # a path of bytes that are not UTF-8 (an old Latin-1 archive's), which Python hands over as lone
    # surrogates, is written as its own bytes (stop 67: eval's scores, average's and compare's lines
    # ended in a traceback under a UTF-8 locale, whose stdout is strict, after the work was done)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8", errors="surrogateescape")
    with contextlib.suppress(OSError, ValueError):  # no descriptor (a test's capture): nothing to wait on
        fd = sys.stdout.fileno()
        if not os.get_blocking(fd):
            sys.stdout.flush()
            sys.stdout = io.TextIOWrapper(
                io.BufferedWriter(_WaitingWriter(fd)),
                encoding="utf-8",
                errors="surrogateescape",
                line_buffering=sys.stdout.line_buffering,
            )


class _WaitingWriter(io.RawIOBase):
    """A file descriptor that each write waits for where it is non-blocking (O_NONBLOCK, which
    any process sharing the pipe or terminal may set): Python's own standard output then drops
    what the pipe cannot take at once (stop 64: translate wrote 2,304 of 3,000 lines and exited
    0; eval's scores were lost). The descriptor stays open when this is closed."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data: Any) -> int:
        while True:
            try:
                return os.write(self.fd, data)
            except BlockingIOError:
                select.select([], [self.fd], [])


def release_stdout() -> None:
    """Where standard output cannot take what is left in its buffer (a full disk), point it at
    /dev/null: Python's own flush at exit would fail again, print an "Exception ignored" block
    and exit with 120 instead of mtx's error line and code (stop 54)."""
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
