"""Errors that reach the user as one line (no traceback) with a non-zero exit code."""

from __future__ import annotations

import contextlib
import datetime
import os
import reprlib
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 3, 6, 6, 4, 4
_SHORT.maxstring = _SHORT.maxother = 60


def shown(value: Any) -> str:
    """`repr(value)` for an error line, cut short: YAML reads 0x followed by 4,000 digits as an integer
    whose repr fails (Python's 4,300-digit limit on int -> str). A list or mapping is shown from its
    first few items: YAML's aliases make a 400-byte file a list of 10^9 numbers, whose whole repr
    was built for the message, hanging `mtx train` while its memory grew; a checkpoint's
    shared references do the same (stop 62)."""
    if isinstance(value, (list, tuple, dict, set)):
        text = _SHORT.repr(value)
        return text if len(text) <= 60 else f"{text[:57]}..."
    if isinstance(value, datetime.date):  # YAML's 2024-01-05 (stop 64: "datetime.date(2024, 1, 5)")
        return f"the date {value.isoformat()}"
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= 60 else f"{text[:40]}...{text[-10:]} ({len(text):,} characters)"


class MtxError(Exception):
    """A problem the user can fix: bad config, bad data, bad run directory."""

    exit_code = 1
    prefix = "error: "  # printed as `mtx: error: <message>`
    report = True  # False: exit with exit_code, print nothing (a torchrun rank other than 0)


class ConfigError(MtxError):
    """Invalid config file, key, type or value. `keys`: the dotted keys whose values are at fault,
    where the message names others too (as an explanation), for `config.attributed`."""

    def __init__(self, message: str, keys: tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        self.keys = keys


class DataError(MtxError):
    """Missing, malformed or inconsistent data files."""


class CheckpointError(MtxError):
    """Missing, corrupted, unsafe or mismatched checkpoint."""


class Interrupted(MtxError):
    """Training stopped by SIGINT/SIGTERM after saving a checkpoint; exit code 128 + signal."""

    prefix = ""

    def __init__(self, message: str, signum: int, report: bool = True) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
        self.report = report


# besides SIGINT (Ctrl-C): `kill`, `timeout` and job schedulers send SIGTERM, a closed terminal SIGHUP
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def take_signals(handler: Callable[[int, Any], None], signals: tuple[int, ...]) -> dict[int, Any]:
    """`handler` for each of `signals` that this process does not ignore, and their old handlers. An
    ignored one stays ignored: `nohup` ignores SIGHUP and a shell's background job SIGINT (stop 62:
    `nohup mtx train ... &` saved and stopped when its terminal closed)."""
    return {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN}


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and the stop signals that arrive within are delivered when it ends, to the handlers
    there were: a wait for threads that a KeyboardInterrupt must not cut (CPython may then let the
    interpreter end while a thread still runs torch code, which aborts the process)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    caught: list[int] = []
    old = take_signals(lambda signum, frame: caught.append(signum), (signal.SIGINT, *STOP_SIGNALS))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def import_failed(e: ImportError, package: str, needs: str, install: str) -> MtxError:
    """The error for an optional `package` that `e` stopped: "`needs` PACKAGE: `install`" where it
    is not installed, what went wrong where it is but cannot be imported (stop 64: a matplotlib
    built for numpy 1 beside numpy 2 was "needs matplotlib", and installing it changed nothing)."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").partition(".")[0] == package:
        return MtxError(f"{needs} {package}: {install}")
    gist = str(e).splitlines()[0][:150] if str(e) else e.__class__.__name__
    return MtxError(f"{package} is installed but cannot be imported ({gist}); reinstall or upgrade it: {install}")


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside training's own handling: it unwinds as Ctrl-C does (what a
    failed command made is removed again), then `mtx: stopped by SIGNAL`, exit code 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def command_line(*words: object) -> str:
    """A command for the user to copy, each word quoted as a POSIX shell needs it: a run directory
    with a space or `$` in its name gave a command that did not work when pasted."""
    return " ".join(_shell_word(str(word)) for word in words)


def _shell_word(word: str) -> str:
    """`word` quoted for a shell. One with bytes that are not UTF-8 (a path's, held as surrogate
    escapes) or with characters that cannot be shown on one line (a newline) is written in the
    `$'...'` quoting of bash, zsh, ksh and POSIX.1-2024 (not dash's), its bytes as three octal
    digits, `\\374`, which no following character can extend: such a run directory was named with
    `\\udcfc` in the "Resume with" command, which no shell reads back (stop 67)."""
    if word.isprintable():
        return shlex.quote(word)
    quoted = []
    for char in word:
        if char in "\\'":
            quoted.append("\\" + char)
        elif char.isprintable():
            quoted.append(char)
        else:
            try:
                raw = os.fsencode(char)
            except UnicodeEncodeError:  # a lone surrogate that no byte makes
                raw = char.encode("utf-8", "surrogatepass")
            quoted.extend(f"\\{byte:03o}" for byte in raw)
    return "$'" + "".join(quoted) + "'"


def own_command(argv0: str | None = None) -> list[str]:
    """How this mtx was started, as the user can type it again: `mtx` where that is the one on
    PATH, else the path it was started by (`make train` runs `.venv/bin/mtx`, which a shell
    without the venv activated does not find: stop 62), or `PYTHON -m mtx`."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    name = os.path.basename(argv0)
    if name == "mtx":
        found = shutil.which("mtx")
        return ["mtx"] if found and os.path.exists(argv0) and os.path.samefile(found, argv0) else [argv0]
    if name == "__main__.py" and os.path.basename(os.path.dirname(argv0)) == "mtx":
        return [_this_environments("python") or sys.executable, "-m", "mtx"]
    return ["mtx"]


def environment_mtx() -> list[str]:
    """The mtx of this Python's environment, for a script to print: `mtx` where PATH finds it,
    else its path (`.venv/bin/mtx`), else `PYTHON -m mtx` (stop 63: choose_on_val.py printed a
    bare `mtx`, which a shell without the venv activated does not find)."""
    if _this_environments("mtx"):
        return ["mtx"]
    beside = os.path.join(os.path.dirname(sys.executable), "mtx")
    return [beside] if os.access(beside, os.X_OK) else [sys.executable, "-m", "mtx"]


def torchrun_command() -> list[str]:
    """`torchrun` where PATH finds this environment's, else `PYTHON -m torch.distributed.run`."""
    if _this_environments("torchrun"):
        return ["torchrun"]
    return [_this_environments("python") or sys.executable, "-m", "torch.distributed.run"]


def _this_environments(name: str) -> str | None:
    """`name` where PATH finds it in this Python's own directory (the same environment), else None."""
    found = shutil.which(name)
    here = os.path.dirname(os.path.abspath(sys.executable))
    return name if found is not None and os.path.dirname(os.path.abspath(found)) == here else None


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: torch.OutOfMemoryError (a GPU's), the
    RuntimeError of the CPU allocator ("DefaultCPUAllocator: can't allocate memory"), or, under an
    address-space limit, oneDNN's "could not create a primitive" (stop 67: under `ulimit -v` a
    47-line traceback, and the steps since the last validation lost)."""
    if type(error).__name__ == "OutOfMemoryError":
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    failed = "could not create a primitive" in text and process_limit("RLIMIT_AS") is not None
    return failed or "can't allocate memory" in text or "out of memory" in text


def process_limit(which: str) -> int | None:
    """This process's limit `which`, a `resource` name (`RLIMIT_AS`: its address space, `ulimit
    -v`, batch systems' memory cap; `RLIMIT_FSIZE`: a file's size, `ulimit -f`), or None where
    there is none (or no `resource`: Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover (Windows)
        return None
    limit = resource.getrlimit(getattr(resource, which))[0]
    return None if limit in (-1, resource.RLIM_INFINITY) else limit


def memory_advice(usual: str, device: object = "cpu") -> str:
    """What to do when memory ran out on `device`: `usual` (lower a batch size), or, on the CPU
    under an address-space limit, raising that limit: torch's CPU libraries reserve address space
    beyond what a batch needs, so a smaller batch did not help (stop 67: 1,500, 300 and 200 tokens
    failed alike). A GPU's memory is not the process's address space."""
    limit = process_limit("RLIMIT_AS")
    if limit is None or str(device).split(":")[0] != "cpu":
        return usual
    return (
        f"this process may use {limit / 2**30:.1f} GiB of address space at most (ulimit -v {limit // 1024}), "
        "and torch's libraries reserve more than the batches take (a tiny model 3-4 GiB): raise or lift "
        f"that limit (ulimit -v unlimited, or the batch system's memory request); else {usual}"
    )


def not_found(path: os.PathLike[str] | str, what: str) -> str:
    """`PATH: WHAT not found`, or for a symbolic link to nothing where it points: `--resume` on a
    run directory linked to a removed disk said "run directory not found" of a link that is there."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path}: a symbolic link to {os.readlink(path)}, which does not exist"
    if what.endswith("directory") and os.path.exists(path) and not os.path.isdir(path):
        return f"{path}: not a {what} (a file)"  # (stop 61: "run directory not found" of a file that is there)
    return f"{path}: {what} not found"


def os_error_line(prog: str, e: OSError) -> str:
    """The one line for a path that cannot be created, read or written, or a full disk:
    `PROG: error: PATH: REASON`."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{prog}: error: {where}{e.strerror or e}"


@contextlib.contextmanager
def stderr_or_null() -> Iterator[None]:
    """Standard error, or where it is closed (`2>&-`) /dev/null in its place while a command runs:
    tqdm, logging's lines and `print(file=sys.stderr)` fall back to standard output, into the
    translations, where `sys.stderr` is None, and the progress bar raised an error that could not
    be seen (stop 68's probe: `mtx eval 2>&-` and `mtx translate < in > out 2>&-` exited 1 with no
    output; a warning became a line of translate's output, and `train`'s JSON line came after its log)."""
    if sys.stderr is not None:
        yield
        return
    sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        yield
    finally:
        null, sys.stderr = sys.stderr, None
        null.close()


def run_script(prog: str, main: Callable[[], None]) -> None:
    """Run a script's `main` as `mtx` runs a command: a user mistake (an `MtxError`) exits with
    the one line `PROG: error: MESSAGE` and the error's exit code instead of a traceback, an
    `OSError` (a path that cannot be written, a full disk) with the path and reason and exit code
    1, Ctrl-C with 130 and a closed output pipe with 141."""
    with stderr_or_null():
        _run_script(prog, main)


def _run_script(prog: str, main: Callable[[], None]) -> None:
    try:
        main()
    except MtxError as e:
        if e.report:
            print(f"{prog}: {e.prefix}{e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(141)
    except MemoryError:  # as mtx's own commands say it (stop 69's probe: a script's was a traceback)
        advice = memory_advice("free memory, or use a machine with more")
        print(f"{prog}: error: out of memory; {advice}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        print(os_error_line(prog, e), file=sys.stderr)
        sys.exit(1)


@contextlib.contextmanager
def named_os_errors(name: str) -> Iterator[None]:
    """An error writing to an opened stream (a full disk: `No space left on device`) names the
    stream or file, which the system's error does not."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), name) from None
