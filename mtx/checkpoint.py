"""Run-directory layout, atomic checkpoint writes and safe (weights-only) loads.

A run directory holds everything needed to translate: the resolved `config.yaml`, the
tokenizer file(s) and `checkpoints/{last,best,step_N}.pt`. Checkpoints are written to a
temporary file in the same directory, flushed, fsynced and renamed over the old file, so a
crash at any moment leaves either the previous or the new checkpoint, never a torn one.
Temporary files left by a writer that was killed mid-save are removed at the next save (in any
other directory than a run's checkpoints/, the next save of the same file). A writer holds an
exclusive `flock` on its temporary file until it has renamed it, so a file nobody holds is one
whose writer is gone, whatever its process id says here (stop 66); where the file system has no
`flock`, the process id in the name decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import logging
import os
import pickle
import re
import shutil
import stat
import time
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mtx.config import CONFIG_FILE, Config, ModelConfig, load_run_config
from mtx.errors import CheckpointError, MtxError, command_line, not_found, own_command, process_limit, shown
from mtx.punctuation import COUNTS_FILE, counted_folds, load_folds
from mtx.tokenizer import BPE, load_run_tokenizers

if TYPE_CHECKING:  # torch where checkpoints are read or written: `plot` uses the file helpers (stop 69)
    import torch

    from mtx.model import Ensemble, Seq2Seq

try:
    import fcntl  # writers' locks on their temporary files (not on Windows: the process id decides)
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

FORMAT_VERSION = 1


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def run_files(run_dir: Path) -> list[Path]:
    """A run's own files besides its checkpoints: config.yaml, metrics.jsonl, train.log, the
    tokenizer(s) and the sources' punctuation counts, which its commands read or training writes."""
    names = (CONFIG_FILE, "metrics.jsonl", "train.log", COUNTS_FILE)
    return [run_dir / name for name in names] + sorted(run_dir.glob("tokenizer*.json"))


# the name of a step checkpoint training writes; any other file in checkpoints/ is the user's (a
# `step_4_backup.pt` was taken for the oldest step checkpoint, and train.keep_last removed it)
_STEP_NAME = re.compile(r"step_(\d+)\.pt")
_BEST_AHEAD = re.compile(r"best_ahead_step_(\d+)\.pt")


def step_checkpoints(run_dir: Path) -> list[Path]:
    """`checkpoints/step_N.pt` files (N digits only), oldest step first."""
    steps = []
    for path in checkpoint_dir(run_dir).glob("step_*.pt"):
        found = _STEP_NAME.fullmatch(path.name)
        if found and path.is_file():
            steps.append((int(found.group(1)), path))
    return [path for _, path in sorted(steps)]


def step_number(path: Path) -> int:
    """N of a `step_N.pt` that `step_checkpoints` lists."""
    found = _STEP_NAME.fullmatch(path.name)
    assert found is not None
    return int(found.group(1))


def saved_step(path: Path) -> int | None:
    """The step a checkpoint was saved at; None where there is none or it cannot be read."""
    return _step_of(_top_level(path) if path.is_file() else None)


def _step_of(top: dict[str, Any] | None) -> int | None:
    """The step of a checkpoint's top level (`_top_level`), or None."""
    step = top.get("step") if top is not None else None
    return step if isinstance(step, int) else None


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, fix: str = "wait for it to end, or choose another --run-dir") -> Iterator[None]:
    """Hold an exclusive lock on the run directory (`flock` on the directory itself; the system
    releases it when the process ends, `kill -9` included), or raise a one-line error that ends
    with `fix`: `mtx train` holds it while it runs. Stop 54: a second start took the first one's
    config and tokenizer for a dead start's and deleted them, and both trainings then wrote the
    same checkpoints and metrics.jsonl. Without `fcntl` (Windows) there is no lock."""
    if fcntl is None:
        yield
        return
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # (stop 63: "an mtx train" was said where another `average --as-best` held it)
            holder = _lock_holder(fd)
            which = f"process {holder}: " if holder is not None else ""
            raise CheckpointError(
                f"{run_dir}: another mtx command is using this run directory ({which}mtx train, average --as-best "
                f"or choose_on_val --apply); {fix}"
            ) from None
        yield
    finally:
        os.close(fd)


def _lock_holder(fd: int) -> int | None:
    """The process that holds the `flock` on `fd`'s file, from Linux's /proc/locks (None where it
    cannot be told): a torchrun job killed with -9 leaves its ranks training on, and the refusal
    named none of them (stop 68's probe)."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where and fields[4].isdigit():
                    return int(fields[4]) or None  # (0: a process of another PID namespace)
    except OSError:  # not Linux
        pass
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def left_by_dead_process(pid: str) -> bool:
    """Whether `pid`, read off a temporary file's name, is another process of this machine that
    is gone (so what it was writing will never be finished). Only where a file cannot be locked:
    a process id is this PID namespace's, and a container's (stop 66)."""
    return pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))


# how long a writer waits for the lock on its new temporary file: a cleaner holds it for a moment
# (it found the name before the writer locked it); a live writer of the same name (a process of
# the same id in another PID namespace) holds it until its rename
_LOCK_WAIT_S = 10.0


def hold_new(fd: int, tmp: Path) -> bool | None:
    """Lock the temporary file `fd`, just made as `tmp`, for its writer: True once held with `tmp`
    still naming it, False where a cleaner removed or replaced that name in between (make it
    again), None where the file system has no `flock` (the process id in the name is then the
    sign of life). A live writer holding it past `_LOCK_WAIT_S` is an error: its file is not ours."""
    if fcntl is None:
        return None
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.EBUSY, f"another process is writing {tmp.name}") from None
            time.sleep(0.02)
        except OSError:  # ENOLCK, EOPNOTSUPP: some network file systems
            return None
    return _still_names(tmp, fd)


def _still_names(path: Path, fd: int) -> bool:
    """Whether `path` names the file open as `fd` (a cleaner's removal, or a writer's rename, may
    have moved the name on since it was opened)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


_TRIES = 5  # makings of a temporary name that a cleaner removed before its maker locked it


def make_held(name: Path, make: Callable[[], int | None]) -> tuple[int | None, bool]:
    """Make the temporary name `name` with `make` and lock it for its maker (`hold_new`), made
    again where a cleaner removed it before the lock was taken. `make` makes it (a file, a hard
    link, a directory) and returns a descriptor open on it, or None where what it made cannot be
    opened (no lock then). Returns that descriptor and whether it is locked (False: the file
    system has no `flock`, and the process id in the name is the sign of life). One loop for the
    three kinds of name (stop 67: each had its own)."""
    for _ in range(_TRIES):
        fd = make()
        if fd is None:
            return None, False
        try:
            held = hold_new(fd, name)
        except BaseException:
            os.close(fd)
            raise
        if held is not False:
            return fd, bool(held)
        os.close(fd)
    raise OSError(errno.EAGAIN, f"{name.name} was removed {_TRIES} times as it was made")


def _create_locked(tmp: Path) -> tuple[IO[bytes], bool]:
    """`tmp` opened empty for writing, and whether this process holds its lock (`make_held`)."""
    # not truncated before it is locked: a live writer of the same name keeps its file
    fd, held = make_held(tmp, lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | _CLOEXEC, 0o666))
    assert fd is not None  # os.open gives one
    try:
        os.ftruncate(fd, 0)
        return os.fdopen(fd, "wb"), held
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def abandoned(path: Path, pid: str) -> Iterator[bool]:
    """Whether the temporary file `path` is a dead writer's, holding its lock while true: its
    writer held it until its rename, so a file whose lock can be taken is one nobody will finish.
    Where it cannot be locked (no `flock`), the process id `pid` of its name decides. Stop 66: the
    id alone decided, and a process id is only its PID namespace's: a live writer in another
    container (or on another host of a shared disk) had its file removed mid-save, and a dead one
    whose id is alive here (a container's mtx is PID 1) left its file for ever."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        yield False
        return
    except OSError:
        yield left_by_dead_process(pid)
        return
    try:
        if fcntl is None:
            yield left_by_dead_process(pid)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # its writer lives
            return
        except OSError:
            yield left_by_dead_process(pid)
            return
        yield _still_names(path, fd)
    finally:
        os.close(fd)


def clean_stale_tmp(directory: Path, name: str | None = None) -> list[Path]:
    """Remove `.NAME.tmp.PID` files left by writers that died mid-save (e.g. `kill -9`); with
    `name`, only those of that file; a writer is told dead by its lock (`abandoned`). Only a run's
    checkpoints/ is mtx's alone: in a directory the user chose (`eval --output`, `average --out`)
    another program's `.x.tmp.123` was removed. A chosen average that a new best.pt's save had set
    aside (`_save_best`) is not such a file: where best.pt was replaced before the kill, it is the
    average's only copy, and it is put in its place (stop 55: it was removed, and the average was
    lost)."""
    removed = []
    if not directory.is_dir():
        return removed
    for path in directory.glob(f".{glob.escape(name)}.tmp.*" if name else ".*.tmp.*"):
        pid = path.name.removeprefix(f".{name}.tmp.") if name else path.name.rsplit(".", 1)[1]
        if not pid.isdigit():  # not a name mtx gives (`.x.tmp.123.part` is another program's)
            continue
        with abandoned(path, pid) as gone:
            if not gone:
                continue
            best = directory / BEST
            if ".aside.tmp." in path.name and not (best.is_file() and best.samefile(path)):
                os.replace(path, directory / path.name.removeprefix(".").split(".aside.tmp.")[0])
            else:
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def fsync_dir(directory: Path) -> None:
    """Make `directory`'s entries (a rename's new name) survive a power cut."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object], hold: bool = False) -> IO[bytes] | None:
    """Write through a same-directory temporary file, fsync, rename over `path`, fsync the directory.
    The temporary file is locked from its making until after its rename (stop 66: see `abandoned`);
    with `hold`, the lock is kept, on `path` now, and its open file returned for the caller to close."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    # (a first save said "the previous file is unchanged" where there was none)
    kept = "the previous file is unchanged" if os.path.exists(path) else "nothing was written"
    f, held, done, ok = None, False, False, False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        in_checkpoints = path.parent.name == "checkpoints" and (path.parent.parent / CONFIG_FILE).is_file()
        clean_stale_tmp(path.parent, None if in_checkpoints else path.name)
        f, held = _create_locked(tmp)
        with contextlib.suppress(OSError):  # the file it replaces keeps its mode (stop 66: a 0600 file became 0644)
            os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
        write(f)
        f.flush()
        os.fsync(f.fileno())
        if not held:  # nothing to hold (and Windows renames no open file)
            f.close()
        os.replace(tmp, path)
        done = True
        fsync_dir(path.parent)
        ok = True
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write ({e.strerror or e}); {kept}") from None
    except RuntimeError as e:  # torch.save's writer on a full disk: "unexpected pos ..." (stop 54: a traceback)
        raise CheckpointError(f"{path}: cannot write ({_write_failure(e, tmp)}); {kept}") from None
    finally:
        if f is not None and not done:  # removed while still locked: no cleaner takes it for a dead writer's
            # a read-only file system: nothing was written (stop 54: unlink's error hid the real one)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if f is not None and not (hold and held and ok):
            f.close()
    return f if hold and held else None


def _write_failure(error: RuntimeError, tmp: Path) -> str:
    """Why torch.save's writer failed, which its error does not say ("unexpected pos ..."): the
    process's file-size limit where the file reached it (stop 63: "67979 MiB left on its disk"
    was said of a `ulimit -f`), a full disk, or torch's words and the room left."""
    size = tmp.stat().st_size if tmp.exists() else 0
    limit = process_limit("RLIMIT_FSIZE")
    if limit is not None and size + 2**20 >= limit:
        return f"File too large: the file-size limit of this process (ulimit -f) is {limit / 2**20:.1f} MiB"
    free = shutil.disk_usage(tmp.parent).free
    if free < 2**26:  # under 64 MiB
        return f"No space left on device: {free / 2**20:.1f} MiB left on its disk"
    return f"{str(error).splitlines()[0][:120]}; {free / 2**20:.1f} MiB left on its disk"


def atomic_save(obj: dict[str, Any], path: Path) -> None:
    """torch.save to `path` so that readers only ever see a complete file (old or new)."""
    import torch

    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: Path, text: str) -> None:
    """Replace a small text file (e.g. config.yaml) atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace a file (an image) atomically: a failed write leaves the old one."""
    _atomic_write(path, lambda f: f.write(data))


def _refusal_detail(message: str) -> str:
    """What the weights-only unpickler refused, from torch's long error text."""
    found = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", message, re.IGNORECASE)
    if found:
        return f"a reference to {found.group(1)}"
    found = re.search(r"Unsupported operand (\d+)", message)
    if found:
        return f"pickle opcode {found.group(1)}"
    return "objects other than tensors and plain containers"


def _unlike_torch_save(archive: zipfile.ZipFile) -> str | None:
    """A member whose central-directory entry torch.save never writes: compressed, encrypted, or
    marked a directory. The CRC check does not cover these fields, and torch's reader takes such
    an entry differently from Python's: one flipped bit of the directory attribute loaded another
    tensor's numbers, without a word (stop 62)."""
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or info.external_attr & 0x10:
            return info.filename
    return None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load with `weights_only=True`: tensors and plain containers only, never code.

    The file must be a complete torch.save zip archive whose members pass their CRC check,
    so truncated or bit-flipped files are errors rather than silently wrong weights."""
    import torch

    if path.is_dir():
        raise CheckpointError(f"{path}: a directory, not a checkpoint file; give RUN/checkpoints/NAME.pt")
    if path.exists() and not path.is_file():  # (stop 62: a FIFO or /dev/null was "not found")
        raise CheckpointError(f"{path}: not a regular file; give RUN/checkpoints/NAME.pt")
    if not path.is_file():
        raise CheckpointError(not_found(path, "checkpoint"))
    removed = f"{path}: removed as mtx began to read it (a training's train.keep_last?)"
    try:
        with zipfile.ZipFile(path) as archive:
            odd_member, bad_member = _unlike_torch_save(archive), archive.testzip()
    except PermissionError as e:  # (stop 54: called corrupted, which could get a good file deleted)
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except FileNotFoundError:  # (stop 62: "truncated or corrupted" of a file a training had just removed)
        raise CheckpointError(removed) from None
    except Exception:  # noqa: BLE001 - whatever a damaged archive raises (stop 62: NotImplementedError, zlib.error)
        with open(path, "rb") as f:
            head = f.read(2)
        if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # a pickle's protocol mark, not a zip's "PK"
            raise CheckpointError(  # (stop 64: called corrupted, which could get a good file deleted)
                f"{path}: a plain pickle or torch's legacy (pre-1.6) format, not the zip archive that torch.save "
                "writes and mtx reads; refused to load"
            ) from None
        raise CheckpointError(
            f"{path}: truncated or corrupted checkpoint (not a complete torch.save archive); refused to load"
        ) from None
    if bad_member is not None:
        raise CheckpointError(f"{path}: corrupted checkpoint ({bad_member} fails its CRC check); refused to load")
    if odd_member is not None:
        raise CheckpointError(
            f"{path}: corrupted checkpoint (the archive's entry for {odd_member} is not as torch.save writes it); "
            "refused to load"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it holds {_refusal_detail(str(e))}, which could run code when unpickled; "
            "only use checkpoints written by mtx"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(removed) from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged archive raises in torch's reader
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint ({e.__class__.__name__})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise CheckpointError(f"{path}: not an mtx checkpoint (no 'model' weights)")
    if not all(isinstance(v, torch.Tensor) for v in obj["model"].values()):
        raise CheckpointError(f"{path}: not an mtx checkpoint ('model' holds values other than tensors)")
    version = obj.get("format_version")
    if version is None:  # (stop 64: "checkpoint format None is not supported", as if of another version)
        raise CheckpointError(f"{path}: not an mtx checkpoint (no format_version): only use checkpoints written by mtx")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {shown(version)} is not supported (expected {FORMAT_VERSION})"
        )
    for name, weights in obj["model"].items():
        if weights.layout != torch.strided or weights.is_meta or weights.is_complex():  # (stop 62: tracebacks)
            kind = f"{weights.layout} {weights.dtype}".replace("torch.", "") + (" meta" if weights.is_meta else "")
            raise CheckpointError(f"{path}: not an mtx checkpoint ({name} is a {kind} tensor)")
        # (stop 62: beam search ended in an IndexError traceback, greedy printed empty lines, and
        # init_from trained on, advising a lower rate; mtx's training skips non-finite updates)
        if weights.is_floating_point() and not bool(torch.isfinite(weights).all()):
            raise CheckpointError(f"{path}: {name} holds NaN or infinite weights; this model cannot translate")
    return obj


def check_same_model(ckpt: dict[str, Any], path: Path, vocab: str, model_cfg: ModelConfig) -> None:
    """One-line errors when a checkpoint's vocabulary or model settings differ from the run's,
    before a model is built for it. The settings that change no parameter's shape (`n_heads`,
    `fix_norm`, `pre_norm`, `max_positions`) loaded silently into the wrong model before stop 53."""
    if "vocab" not in ckpt:  # (stop 64: "fingerprint mismatch" of a file that has none)
        raise CheckpointError(f"{path}: no vocabulary fingerprint ('vocab'); only use checkpoints written by mtx")
    if ckpt.get("vocab") != vocab:
        raise CheckpointError(
            f"{path}: vocabulary differs from the run's tokenizer (fingerprint mismatch); "
            "the checkpoint belongs to another run"
        )
    saved = ckpt.get("config")
    saved_model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(saved_model, dict):
        return  # (checked where the weights' shapes are)
    default = dataclasses.asdict(ModelConfig())
    for key, value in dataclasses.asdict(model_cfg).items():
        if "dropout" in key:  # dropout rates are the run's own to choose
            continue
        # a key an older mtx's checkpoint lacks was its default (stop 67: it was passed over, and a
        # FixNorm run decoded an older run's checkpoint as a FixNorm one)
        old = saved_model.get(key, default[key])
        if (list(old) if isinstance(old, tuple) else old) != (list(value) if isinstance(value, tuple) else value):
            raise CheckpointError(
                f"{path}: the checkpoint was trained with model.{key}={shown(old)}, the run's config has {value!r}; "
                "the checkpoint belongs to another run"
            )


def check_compatible(ckpt: dict[str, Any], path: Path, vocab: str, model: Seq2Seq) -> None:
    """One-line errors when a checkpoint's vocabulary, model settings or shapes differ from the run's."""
    check_same_model(ckpt, path, vocab, model.cfg)
    check_shapes(ckpt, path, model)


def check_shapes(ckpt: dict[str, Any], path: Path, model: Seq2Seq) -> None:
    """A one-line error when a checkpoint's weights do not fit `model` (names, shapes, and numbers
    of the same kind: stop 62, integer weights were cast to floats without a word)."""
    state = model.state_dict()
    expected = {k: list(v.shape) for k, v in state.items()}
    for key, weights in ckpt["model"].items():
        if key in state and weights.is_floating_point() != state[key].is_floating_point():
            raise CheckpointError(f"{path}: {key} holds {weights.dtype} numbers, the model {state[key].dtype}")
    got = {k: list(v.shape) for k, v in ckpt["model"].items()}
    if got != expected:
        names = sorted(set(got) ^ set(expected))
        if names:
            detail = f"parameters present in only one of them: {', '.join(names[:3])}"
        else:
            key = next(k for k in expected if got[k] != expected[k])
            detail = f"{key} has shape {got[key]}, the config gives {expected[key]}"
        raise CheckpointError(f"{path}: model shape differs from the run's config ({detail})")


def vocab_fingerprint(src_tok: BPE, tgt_tok: BPE) -> str:
    return f"{src_tok.fingerprint()}:{tgt_tok.fingerprint()}"


@dataclass
class LoadedRun:
    cfg: Config
    model: Seq2Seq | Ensemble
    src_tok: BPE
    tgt_tok: BPE
    checkpoints: list[Path]
    # {character: the one a source's is read as} (`mtx.punctuation.folds`, of the run's training sources)
    folds: dict[str, str] = dataclasses.field(default_factory=dict)

    def encode_sources(
        self, lines: Sequence[str], one_space: bool | None = None, fold: bool | None = None
    ) -> list[list[int]]:
        """Source lines -> ids as `mtx translate` and `mtx eval` read them: whitespace as one space
        (`one_space`, default decode.normalize_spaces) and punctuation the training data lacks read
        as it has it (`fold`, default decode.normalize_punctuation), each line cut at the model's
        positions."""
        one_space = self.cfg.decode.normalize_spaces if one_space is None else one_space
        return self.src_tok.encode_batch(lines, self.model.cfg.max_positions - 1, one_space, self.source_folds(fold))

    def source_folds(self, fold: bool | None = None) -> dict[str, str]:
        """The characters a source is read as others by (`folds`) where `fold` (default
        decode.normalize_punctuation), else none."""
        fold = self.cfg.decode.normalize_punctuation if fold is None else fold
        return self.folds if fold else {}

    def pieces_outside_output(self, tgt_ids: Sequence[Sequence[int]]) -> int:
        """How many of these target pieces the model cannot output (`model.restrict_output`: its
        softmax covers train's target pieces only)."""
        first = self.model.members[0] if hasattr(self.model, "members") else self.model
        if first.output_ids is None:
            return 0
        allowed = set(first.output_ids.tolist())
        return sum(piece not in allowed for ids in tgt_ids for piece in ids)


def build_model(cfg: Config, src_tok: BPE, tgt_tok: BPE, output_ids: torch.Tensor | None = None) -> Seq2Seq:
    """The run's model; `output_ids` (`model.restrict_output`) come from training or a checkpoint."""
    from mtx.model import Seq2Seq

    return Seq2Seq(
        cfg.model, src_tok.vocab_size, tgt_tok.vocab_size, joint_vocab=cfg.tokenizer.joint, output_ids=output_ids
    )


def saved_output_ids(ckpt: dict[str, Any], path: Path, cfg: Config) -> torch.Tensor | None:
    """The output vocabulary a checkpoint was trained with (None: the whole target vocabulary)."""
    ids = ckpt["model"].get("output_ids")
    if (ids is not None) != cfg.model.restrict_output:
        raise CheckpointError(
            f"{path}: model.restrict_output is {cfg.model.restrict_output} in the run's config "
            f"but the checkpoint was trained {'with' if ids is not None else 'without'} it"
        )
    return ids


def check_direction(ckpt: dict[str, Any], path: Path, cfg: Config) -> None:
    """One-line error when a checkpoint was trained for another language pair or direction than
    the run's (a joint vocabulary would load it without complaint and decode the wrong way)."""
    config = ckpt.get("config")
    data = config.get("data") if isinstance(config, dict) else None
    saved = (data.get("src_lang"), data.get("tgt_lang")) if isinstance(data, dict) else (None, None)
    run = cfg.data.src_lang, cfg.data.tgt_lang
    if None not in saved and saved != run:
        if not all(isinstance(lang, str) for lang in saved):
            raise CheckpointError(f"{path}: not an mtx checkpoint (its data.src_lang or data.tgt_lang is no name)")
        raise CheckpointError(
            f"{path}: the checkpoint translates {saved[0]}->{saved[1]}, the run {run[0]}->{run[1]}; "
            "pass a checkpoint of this run"
        )


def default_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a run decodes or starts from by default: best.pt, else last.pt; None where
    neither is there. Whatever best.pt is, it is the one taken: a best.pt that is a directory or a
    dangling link is an error when loaded, not a silent fall back to last.pt (stop 56)."""
    ckpts = checkpoint_dir(run_dir)
    return next((p for p in (ckpts / "best.pt", ckpts / "last.pt") if p.exists() or p.is_symlink()), None)


def no_checkpoint(run_dir: Path) -> str:
    """Why a run has no best.pt or last.pt to load, and what to do: train it, or where it trained
    (a metrics.jsonl: its checkpoints were deleted, or left out of a copy), train it again in a new
    directory, since training refuses to start over a run that trained (stop 69's probe: "no
    checkpoints yet; train it first" gave a command that this refusal answered)."""
    if (run_dir / "metrics.jsonl").exists():
        steps = step_checkpoints(run_dir)
        kept = f"give its newest step checkpoint ({steps[-1]}) instead, " if steps else ""
        return (
            f"{run_dir}: its checkpoints/ holds no best.pt or last.pt, though the run trained (its metrics.jsonl "
            f"says so): {kept}put them back, or train again in a new --run-dir"
        )
    start = command_line(*own_command(), "train", "--config", run_dir / CONFIG_FILE, "--run-dir", run_dir)
    return f"{run_dir}: no checkpoints yet; train it first: {start}"


def load_run(run_dir: Path, checkpoints: Sequence[Path] = (), device: torch.device | None = None) -> LoadedRun:
    """Model and tokenizers of a run, from `checkpoints` or best.pt (else last.pt); two or more
    checkpoints (of this run's vocabulary) decode as one `Ensemble`."""
    from mtx.model import Ensemble

    cfg = load_run_config(run_dir)
    src_tok, tgt_tok = load_run_tokenizers(run_dir, cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang)
    defaulted = not checkpoints
    if defaulted:
        default = default_checkpoint(run_dir)
        if default is None:
            # (stop 62: "train it first" while a training was setting it up, which refused that command)
            with run_dir_lock(run_dir, "its first checkpoint is saved once it has set up; try again then"):
                pass
            raise CheckpointError(no_checkpoint(run_dir))
        checkpoints = [default]
    members = []
    check = member_check(cfg, src_tok, tgt_tok)
    for path in checkpoints:
        meant = next((c for c in (checkpoint_dir(run_dir) / path, run_dir / path) if c.is_file()), None)
        if not path.is_absolute() and not path.exists() and not path.is_symlink() and meant is not None:
            # (stop 62: `--checkpoint step_20.pt` was "not found", the run's own file beside it)
            raise CheckpointError(f"{not_found(path, 'checkpoint')} (paths are from the working directory: {meant}?)")
        ckpt = load_checkpoint(path)
        if ckpt.get("step") == 0 and path.name == "last.pt":  # (stop 62: step 0's weights, without a word)
            logging.getLogger("mtx").warning(
                "%s is from step 0: the run has not trained yet (its weights are the ones it starts from, "
                "random or train.init_from's); its next checkpoint comes at its first validation",
                path,
            )
        state = ckpt.get("state") if isinstance(ckpt.get("state"), dict) else {}
        if defaulted and path.name == "last.pt" and state.get("best_step"):  # (stop 64: without a word)
            logging.getLogger("mtx").warning(
                "%s: no best.pt, though the run validated (best val BLEU %.2f at step %s): decoding with last.pt "
                "(step %s)",
                run_dir,
                state.get("best_bleu", float("nan")),
                state["best_step"],
                ckpt.get("step"),
            )
        check(ckpt, path)
        member = build_model(cfg, src_tok, tgt_tok, saved_output_ids(ckpt, path, cfg))
        check_shapes(ckpt, path, member)
        member.load_state_dict(ckpt["model"])
        member.eval()
        if device is not None:
            member.to(device)
        members.append(member)
    folds = load_folds(run_dir, cfg.data.src_lang)
    if folds is None:  # a run trained before stop 73: its train split's counts, where its data is still there
        folds = counted_folds(Path(cfg.data.dir), cfg.data.train_split, cfg.data.src_lang)
    if len(members) == 1:
        return LoadedRun(cfg, members[0], src_tok, tgt_tok, list(checkpoints), folds)
    try:
        ensemble = Ensemble(members)
    except ValueError as e:  # restricted softmaxes over different pieces
        raise CheckpointError(f"{', '.join(map(str, checkpoints))}: {e}") from None
    return LoadedRun(cfg, ensemble, src_tok, tgt_tok, list(checkpoints), folds)


def member_check(cfg: Config, src_tok: BPE, tgt_tok: BPE) -> Callable[[dict[str, Any], Path], None]:
    """The checks of a checkpoint against its run (direction, vocabulary, model settings), made of
    each member by `load_run` and by an average: before stop 62 an average compared only its first
    member's settings, so a step_N.pt of another direction or n_heads was averaged in silently."""
    vocab = vocab_fingerprint(src_tok, tgt_tok)

    def check(ckpt: dict[str, Any], path: Path) -> None:
        check_direction(ckpt, path, cfg)
        check_same_model(ckpt, path, vocab, cfg.model)  # before a model is built for it

    return check


def average_checkpoints(
    paths: list[Path], check: Callable[[dict[str, Any], Path], None] | None = None
) -> dict[str, Any]:
    """Element-wise mean of the model weights of several checkpoints of one run, each first given
    to `check` (`member_check`) where one is passed.

    Averaging the last few checkpoints of a run smooths the noise of the final updates and
    usually adds a little BLEU (Vaswani et al. averaged the last 5 or 20)."""
    import torch

    if not paths:
        raise CheckpointError("no checkpoints to average")
    first = last = load_checkpoint(paths[0])
    if check is not None:
        check(first, paths[0])
    sums = {k: v.double().clone() if v.is_floating_point() else v for k, v in first["model"].items()}
    for path in paths[1:]:
        ckpt = last = load_checkpoint(path)
        if check is not None:
            check(ckpt, path)
        if ckpt.get("vocab") != first.get("vocab") or ckpt["model"].keys() != sums.keys():
            raise CheckpointError(f"{path}: not from the same run as {paths[0]} (vocabulary or parameters differ)")
        for k, v in ckpt["model"].items():
            if v.shape != sums[k].shape:
                raise CheckpointError(f"{path}: {k} has shape {list(v.shape)}, {paths[0]} has {list(sums[k].shape)}")
            if v.is_floating_point():
                sums[k] += v.double()
            elif not torch.equal(v, sums[k]):  # e.g. output_ids
                raise CheckpointError(f"{path}: {k} differs from that of {paths[0]} (not from the same run)")
    dtypes = {k: v.dtype for k, v in first["model"].items()}
    averaged = {k: (v / len(paths)).to(dtypes[k]) if v.is_floating_point() else v for k, v in sums.items()}
    return {
        "format_version": FORMAT_VERSION,
        "model": averaged,
        "config": first["config"],
        "vocab": first["vocab"],
        "step": last["step"] if type(last.get("step")) is int else 0,  # the newest averaged step
        "averaged_from": [p.name for p in paths],
    }


def _validated(run_dir: Path) -> bool:
    """Whether the run's metrics.jsonl records a validation (one that cannot be read: no)."""
    from mtx.plot import read_metrics

    try:
        return any(event.get("event") == "valid" for event in read_metrics(run_dir))
    except (MtxError, OSError):
        return False


def average_run(run_dir: Path, last: int, out: Path | None, as_best: bool) -> tuple[Path, list[Path]]:
    """Average the run's `last` newest step checkpoints into `out` (and optionally best.pt).

    The previous best.pt is kept as best_single.pt, so nothing is lost."""
    if not run_dir.is_dir():  # (stop 54: "no checkpoints/step_N.pt to average")
        raise CheckpointError(not_found(run_dir, "run directory"))
    if as_best:  # said before the average is made (make_best holds the lock to change best.pt)
        with run_dir_lock(run_dir, _WHILE_TRAINING):
            pass
    folder = checkpoint_dir(run_dir)
    if folder.is_dir() and not os.access(folder, os.R_OK | os.X_OK):
        # (stop 63: glob hid the permission error, and the run "had not validated yet")
        raise CheckpointError(f"{folder}: cannot list the checkpoints (permission denied); make it readable")
    steps = step_checkpoints(run_dir)
    if not steps:  # (stop 55: keep_last was blamed for a run that had not validated yet)
        if load_run_config(run_dir).train.keep_last == 0:
            why = "train with train.keep_last > 0"
        elif _validated(run_dir):  # (stop 69's probe: "has not validated yet" of a run copied without them)
            why = "one is written at each validation; the run validated, and its step files are gone"
        else:
            why = "one is written at each validation, and the run has not validated yet"
        raise CheckpointError(f"{run_dir}: no checkpoints/step_N.pt to average ({why})")
    if last < 1:
        raise CheckpointError(f"--last must be >= 1, got {last}")
    chosen = steps[-last:]
    out = out or checkpoint_dir(run_dir) / f"average_last{len(chosen)}.pt"
    if _training_file(out, run_dir):
        raise CheckpointError(
            f"--out {out}: training writes and reads that file; write the average elsewhere "
            "(the default, or --as-best to make it best.pt while keeping the best single checkpoint)"
        )
    cfg = load_run_config(run_dir)
    src_tok, tgt_tok = load_run_tokenizers(run_dir, cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang)
    payload = average_checkpoints(chosen, member_check(cfg, src_tok, tgt_tok))
    model = build_model(cfg, src_tok, tgt_tok, saved_output_ids(payload, chosen[-1], cfg))
    check_shapes(payload, chosen[-1], model)
    atomic_save(payload, out)
    if as_best:
        make_best(run_dir, payload)
    return out, chosen


def any_runs_file(path: Path) -> Path | None:
    """The run whose own file or training checkpoint `path` is, whichever run that is (stop 54:
    eval --output and average --out checked the --run's files only, and wrote over another
    run's last.pt); None for any other path. A link is followed (it is written through), and in a
    run's checkpoints/ any file there is counted, an average_lastN.pt too, and any new one (stop
    61: eval wrote its hypotheses there once, and refused the same command the second time)."""
    path = Path(os.path.realpath(path))
    run = path.parent.parent
    if (run / CONFIG_FILE).is_file() and (
        _training_file(path, run) or (path.parent.name == "checkpoints" and not path.is_dir())
    ):
        return run
    if (path.parent / CONFIG_FILE).is_file() and same_path(path, run_files(path.parent)):
        return path.parent
    return None


def same_path(path: Path, others: Iterable[Path]) -> bool:
    """Whether `path` names one of `others` (existing or not: a run's train.log may be missing)."""
    here = os.path.realpath(path)
    return any(os.path.realpath(o) == here for o in others)


def _training_file(path: Path, run_dir: Path) -> bool:
    """Whether `path` is one of the checkpoints training keeps (best, last, ema, step_N and
    best.pt's bookkeeping), which an average must not replace."""
    ckpts = checkpoint_dir(run_dir)
    if not (path.parent.is_dir() and ckpts.is_dir() and path.parent.samefile(ckpts)):
        return False
    name = path.name
    kept = name in ("last.pt", "ema.pt", BEST, BEST_SINGLE, BEST_AVERAGE) or _STEP_NAME.fullmatch(name) is not None
    return kept or _BEST_AHEAD.fullmatch(name) is not None  # (`set_aside_best_ahead`'s)


# best.pt is training's best single checkpoint, unless `make_best` put a chosen average there:
# then training's is best_single.pt, which exists only while that is so. A chosen average that
# leaves best.pt (a newer choice, the single restored, training's next best) is kept as
# best_average.pt. best.pt itself is only ever replaced atomically, never moved away first, so
# an interrupted or failed change leaves it whole.
BEST, BEST_SINGLE, BEST_AVERAGE = "best.pt", "best_single.pt", "best_average.pt"


def _link(src: Path, dst: Path, hold: bool = False) -> IO[bytes] | None:
    """Make `dst` a second name of `src` (a hard link: checkpoints are only ever replaced, never
    written in place), or a copy where the filesystem has no hard links; atomically either way.
    Its temporary name is locked as `_atomic_write`'s is; with `hold`, `dst` stays locked (a file
    that must not be taken for a dead writer's) and its open file is returned for the caller to
    close. A hard link shares its lock with `src`: only these temporary names are ever locked."""
    if dst.exists() and dst.samefile(src):
        if not hold:
            return None
        dst.unlink()  # a temporary name of this process id that no one holds: made again, locked
    tmp = dst.with_name(f".{dst.name}.tmp.{os.getpid()}")

    def make() -> int:
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError as e:
            raise _NoHardLinks from e
        return os.open(src, os.O_RDONLY | _CLOEXEC)  # the file `tmp` names (`make_held` checks it)

    try:
        fd, held = make_held(tmp, make)
    except _NoHardLinks:
        with open(src, "rb") as source:
            return _atomic_write(dst, lambda out: shutil.copyfileobj(source, out), hold)
    except BaseException:  # (a live holder of the file past `_LOCK_WAIT_S`): this name is not left behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    assert fd is not None  # `make` gives one
    f = os.fdopen(fd, "rb")
    try:
        os.replace(tmp, dst)
        fsync_dir(dst.parent)  # (stop 67: the new name could be lost to a power cut)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        f.close()
        raise
    if hold and held:
        return f
    f.close()
    return None


class _NoHardLinks(Exception):
    """The file system makes no hard links (`_link` copies instead)."""


def _average_in_best(ckpts: Path) -> bool:
    """Whether a chosen average (or moving average) holds best.pt; training's single is then
    best_single.pt. A best_single.pt that is best.pt itself (a `make_best` killed between its two
    steps) is a spare name, and one beside training's own best.pt (a `save_new_best` killed before
    it removed it) is outdated: either goes. Which best.pt holds is read from it, not from the
    names (stop 55: the outdated single made training's new best.pt pass for the average, and it
    replaced the average in best_average.pt)."""
    best, single = ckpts / BEST, ckpts / BEST_SINGLE
    if not best.is_file():
        return single.is_file()
    if single.is_file() and single.samefile(best):
        single.unlink()
        return False
    top = _top_level(best)
    if top is None:  # unreadable: the names decide, and a save replaces it (a torn best.pt stopped training)
        return single.is_file()
    chosen = not _AVERAGE_KEYS.isdisjoint(top)
    if not chosen:
        single.unlink(missing_ok=True)
    return chosen


def _top_level(path: Path) -> dict[str, Any] | None:
    """A checkpoint's top level, its tensors mapped rather than read; None where it cannot be read."""
    import torch

    try:
        top = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 (truncated, bit-flipped or unreadable: no answer, not a stop)
        return None
    return top if isinstance(top, dict) else None


# what an average's payload (`average_checkpoints`) and the moving average's (ema.pt) carry, and
# training's own checkpoints do not
_AVERAGE_KEYS = frozenset({"averaged_from", "ema_decay"})


def _save_best(ckpts: Path, payload: dict[str, Any], keep: Path | None) -> None:
    """`payload` as best.pt; with `keep`, what best.pt held is kept under that name. best_single.pt
    (training's single) is linked before best.pt is replaced, so that no interruption can lose it;
    best_average.pt (an earlier average) is set aside under a temporary name and renamed once the
    new best.pt is written, so that a failed write leaves it as it was."""
    best = ckpts / BEST
    before = best.stat().st_ino if best.is_file() else None
    early = keep is not None and keep.name == BEST_SINGLE
    aside = None if keep is None or early else keep.with_name(f".{keep.name}.aside.tmp.{os.getpid()}")
    held = None
    if before is not None and keep is not None:
        # the set-aside name stays locked until it is renamed: no other process's save takes it
        # for a dead writer's and puts it in place early (stop 66)
        held = _link(best, keep if early else aside, hold=not early)
    try:
        try:
            atomic_save(payload, best)
        except BaseException:
            if not best.is_file() or best.stat().st_ino == before:  # best.pt as it was: undo the second name
                if early and before is not None:
                    keep.unlink(missing_ok=True)
                if aside is not None:
                    aside.unlink(missing_ok=True)
                raise
            if aside is not None and aside.exists():  # written; only the directory's sync failed
                os.replace(aside, keep)
            raise
        if aside is not None and aside.exists():
            os.replace(aside, keep)
            fsync_dir(ckpts)  # (stop 67: the rename could be lost to a power cut)
    finally:
        if held is not None:
            held.close()


def make_best(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write `payload` (an average) as the run's best.pt; the best single checkpoint that training
    saved there is kept as best_single.pt (an earlier chosen average there as best_average.pt),
    so nothing is lost, whenever it is interrupted."""
    ckpts = checkpoint_dir(run_dir)
    with run_dir_lock(run_dir, _WHILE_TRAINING):  # training replaces best.pt too
        _save_best(ckpts, payload, ckpts / (BEST_AVERAGE if _average_in_best(ckpts) else BEST_SINGLE))
    return ckpts / BEST


# (stop 54: a chosen average made best.pt while training saved a new best could lose best_single.pt)
_WHILE_TRAINING = "best.pt can be changed once it has ended"


def check_best_changeable(run_dir: Path) -> None:
    """Refuse at once where `make_best` would be refused at the end: a command that decodes for
    minutes before it changes best.pt asks first (stop 65: choose_on_val --apply on a run in
    training scored every candidate, then failed)."""
    with run_dir_lock(run_dir, _WHILE_TRAINING):
        pass


def _own_best(ckpts: Path) -> dict[str, Any] | None:
    """best.pt's top level where it is training's own single checkpoint; None where best.pt is
    missing, unreadable or a chosen average (or moving average)."""
    top = _top_level(ckpts / BEST) if (ckpts / BEST).is_file() else None
    return top if top is not None and _AVERAGE_KEYS.isdisjoint(top) else None


def training_best_step(run_dir: Path) -> int | None:
    """The step of training's own best single checkpoint: best.pt's, or best_single.pt's where a
    chosen average holds best.pt (stop 66 review: an average of the same step passed for it)."""
    ckpts = checkpoint_dir(run_dir)
    top = _own_best(ckpts)
    return _step_of(top) if top is not None else saved_step(ckpts / BEST_SINGLE)


def set_aside_best_ahead(run_dir: Path, last_step: int, best_step: int) -> tuple[Path, Path | None] | None:
    """Where training's own best.pt is of a step beyond last.pt's (`last_step`), a course cut short
    wrote it (an mtx before stop 66 saved best.pt before last.pt, and a kill in last.pt's write left
    it ahead): it is renamed `best_ahead_step_N.pt`, kept but no longer taken for this run's best,
    and the step checkpoint of the run's best (`best_step`) becomes best.pt where one is kept.
    Returns (the new name, that step checkpoint or None), or None where best.pt is not ahead
    (stop 67: a resume that went another way reported step 50's score as its best while best.pt
    was the killed course's step 150)."""
    ckpts = checkpoint_dir(run_dir)
    step = _step_of(_own_best(ckpts))
    if step is None or step <= last_step:
        return None
    aside = ckpts / f"best_ahead_step_{step}.pt"
    os.replace(ckpts / BEST, aside)
    fsync_dir(ckpts)
    earlier = ckpts / f"step_{best_step}.pt"
    if saved_step(earlier) != best_step:
        return aside, None
    _link(earlier, ckpts / BEST)
    return aside, earlier


def best_single(run_dir: Path) -> Path:
    """Training's best single checkpoint: best_single.pt while a chosen average holds best.pt, as
    read from best.pt. A best_single.pt beside training's own best.pt is outdated (an mtx before
    stop 53 left it when training saved a newer best; a `save_new_best` killed before removing
    it): stop 67, choose_on_val took it for the start, and `--apply` replaced a better best.pt."""
    ckpts = checkpoint_dir(run_dir)
    single = ckpts / BEST_SINGLE
    return single if single.is_file() and _own_best(ckpts) is None else ckpts / BEST


def restore_best_single(run_dir: Path) -> Path:
    """Make training's best single checkpoint best.pt again (undo `make_best`); the average that
    held best.pt is kept as best_average.pt."""
    ckpts = checkpoint_dir(run_dir)
    best, single = ckpts / BEST, ckpts / BEST_SINGLE
    with run_dir_lock(run_dir, _WHILE_TRAINING):
        if _average_in_best(ckpts):
            if best.is_file():
                _link(best, ckpts / BEST_AVERAGE)
            os.replace(single, best)
            fsync_dir(ckpts)
    return best


def save_new_best(run_dir: Path, payload: dict[str, Any]) -> Path | None:
    """Training's new best single checkpoint into best.pt. Where a chosen average held best.pt
    (a run resumed after `mtx average --as-best`), that average is kept as best_average.pt and
    its path returned, and best_single.pt, now outdated, goes."""
    ckpts = checkpoint_dir(run_dir)
    kept = ckpts / BEST_AVERAGE if _average_in_best(ckpts) and (ckpts / BEST).is_file() else None
    _save_best(ckpts, payload, kept)
    (ckpts / BEST_SINGLE).unlink(missing_ok=True)
    return kept
