"""Learning curves of runs (`mtx plot`) and their comparison at equal steps and equal training
time (`mtx compare`), from each run's `metrics.jsonl`.

Plotting needs matplotlib, the optional extra `mtx[plot]`; comparing needs nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import io
import itertools
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from mtx.errors import MtxError, import_failed, named_os_errors, not_found

log = logging.getLogger(__name__)

X_AXES = ("step", "time")


# what `mtx plot` and `mtx compare` read from each event mtx train writes
NEEDED = {"train": ("step", "loss", "lr", "elapsed_s"), "valid": ("step", "val_loss", "val_bleu", "elapsed_s")}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The events of `metrics.jsonl`; a torn last line (a killed run) is skipped."""
    return [event for _, event in _numbered_events(run_dir)]


def _numbered_events(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise MtxError(not_found(run_dir, "run directory"))
    if not path.is_file():
        raise MtxError(f"{run_dir}: no metrics.jsonl; is this an mtx run directory?")
    events = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # (stop 61: arrays nested 100,000 deep, a traceback)
            continue
        if isinstance(event, dict):
            events.append((number, event))
    return events


def _as_float(value: float) -> bool:
    """Whether a JSON number converts to a float (stop 61: an integer of 400 digits was a traceback)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _events(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train events, valid events) of a run; a run with neither, or an event without a number
    that plotting needs, is an error."""
    events: dict[str, list[dict[str, Any]]] = {"train": [], "valid": []}
    for number, event in _numbered_events(run_dir):
        kind = event.get("event")
        if kind not in events:
            continue
        for key in NEEDED[kind]:
            value = event.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not _as_float(value):
                got = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
                raise MtxError(
                    f"{run_dir / 'metrics.jsonl'}: line {number}: a {kind} event without a number {key!r} "
                    f"(got {got}); the file is not as mtx train writes it"
                )
        events[kind].append(event)
    if not events["train"] and not events["valid"]:
        raise MtxError(f"{run_dir}/metrics.jsonl holds no train or valid events yet")
    return events["train"], events["valid"]


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, with as many parent directories as it takes to tell runs apart
    (`a/base` and `b/base`, not `base` twice)."""
    # absolute, links kept: a linked run is named as given (stop 61: by its target's name)
    parts = [Path(os.path.abspath(r)).parts for r in run_dirs]
    depth = 1
    while depth < max(len(p) for p in parts) and len({p[-depth:] for p in parts}) < len(parts):
        depth += 1
    return [str(Path(*p[-depth:])) for p in parts]


@contextlib.contextmanager
def _no_glyph_warnings() -> Iterator[None]:
    """A run name in a script the font lacks (CJK) is drawn as boxes, without matplotlib's warning
    for each glyph, which `-W error` (CI) made a traceback (stop 67)."""
    with warnings.catch_warnings():
        # "missing from font(s) X" since matplotlib 3.9, "missing from current font" before
        warnings.filterwarnings("ignore", r"Glyph \d+ .*missing from (current )?font", UserWarning)
        yield


def _drawable(name: str) -> str:
    """A run's path as text a font can draw: the bytes of a name that is not UTF-8 (a Latin-1
    archive's, which Python hands over as lone surrogates) shown as U+FFFD (stop 67: matplotlib
    stopped with a traceback)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class _ValData(NamedTuple):
    direction: str
    split: str
    asked: int  # train.eval_sentences (0: all)
    sentences: str  # those validated on, counted where the files are here ("all" where not)
    digest: str | None  # of those sentence pairs; None where the files cannot be read here


def _validation_data(run_dir: Path) -> _ValData | None:
    """What a run validates on, from its config.yaml and the val files it names; the digest is None
    where the files cannot be read here (or `data.dir` is not an absolute path, which would be
    read from here), and the whole is None where the config cannot be. (Stop 57: from the config
    alone, two runs on different val files of one name looked alike, and `eval_sentences` 0 and
    100 on a val split of 100 looked different.)"""
    from mtx.config import load_run_config
    from mtx.data import split_file
    from mtx.text import read_parallel, scored_text

    try:
        cfg = load_run_config(run_dir)
    except MtxError:  # no config.yaml, or one that does not load
        return None
    data, n = cfg.data, cfg.train.eval_sentences
    direction = f"{data.src_lang}->{data.tgt_lang}"
    try:
        if not Path(data.dir).is_absolute():
            raise OSError("a data.dir relative to where training ran")
        files = (split_file(Path(data.dir), data.valid_split, lang) for lang in (data.src_lang, data.tgt_lang))
        src, tgt = read_parallel(*files, as_scored=True)  # (stop 65: cleaned, invisible ends that move BLEU were lost)
    except (MtxError, OSError):
        return _ValData(direction, data.valid_split, n, f"{n or 'all'}", None)
    pairs = list(zip(src, scored_text(tgt), strict=True))[: n or None]
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:8]
    return _ValData(direction, data.valid_split, n, str(len(pairs)), digest)


def train_loss_name(run_dir: Path) -> str:
    """What a run's train loss is, from its config.yaml (its settings now: a resume may have
    changed them): the loss trained on, label smoothing's and R-Drop's terms included (stop 68's
    probe: every run's was "label-smoothed", a run without smoothing too, and R-Drop's term
    unsaid, so curves that do not compare looked as if they did)."""
    from mtx.config import load_run_config

    try:
        train = load_run_config(run_dir).train
    except MtxError:
        return "train loss"
    terms = [f"label smoothing {train.label_smoothing:g}"] if train.label_smoothing else []
    terms += [f"with R-Drop's term, train.rdrop {train.rdrop:g}"] if train.rdrop else []
    return f"train loss ({', '.join(terms)})" if terms else "train loss"


def different_data(labels: Sequence[str], run_dirs: Sequence[Path]) -> str | None:
    """The note that the runs validate on different data, whose scores do not compare (`compare`,
    `plot`), or None where they validate on the same."""
    data = {label: _validation_data(run_dir) for label, run_dir in zip(labels, run_dirs, strict=True)}
    known = [d for d in data.values() if d is not None]
    # where every run's val files were read, the sentences decide; else what the configs say
    by_digest = all(d.digest for d in known)
    if len({(d.direction, d.digest) if by_digest else (d.direction, d.split, d.asked) for d in known}) < 2:
        return None
    described = "; ".join(
        f"{label}: {d.direction}, {d.split} ({d.sentences} sentences{f', digest {d.digest}' if d.digest else ''})"
        for label, d in data.items()
        if d
    )
    return f"the runs validate on different data ({described}): their scores do not compare"


def plot_runs(run_dirs: Sequence[Path], out: Path, x: str = "step") -> Path:
    """Write an image (PNG unless `out`'s suffix names another type) with train/val loss, val
    BLEU and learning rate of each run against update steps (`x="step"`) or minutes of training
    (`x="time"`, the loop's wall time, resumes included: what `train.max_minutes` budgets).
    Returns the path written."""
    if x not in X_AXES:
        raise MtxError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as e:
        raise import_failed(e, "matplotlib", "mtx plot needs", "pip install 'mtx[plot]'") from None
    out = _image_path(out, FigureCanvasAgg.get_supported_filetypes())
    runs = [(run_dir, *_events(run_dir)) for run_dir in run_dirs]

    def xs(events: list[dict[str, Any]]) -> list[float]:
        return [e["step"] if x == "step" else e["elapsed_s"] / 60 for e in events]

    def faded(color: str, alpha: float) -> tuple[float, ...]:
        """`color` at `alpha` over white, opaque: PostScript has no transparency (stop 69's probe:
        matplotlib's warning on every .eps and .ps plot, and curves drawn at full strength)."""
        return tuple(1 - alpha * (1 - c) for c in matplotlib.colors.to_rgb(color))

    labels = run_labels(run_dirs)
    if len(run_dirs) > 1 and (different := different_data(labels, run_dirs)):  # (stop 65: compare said it, plot not)
        log.warning("%s", different)
    labels = [_drawable(label) for label in labels]
    fig, (ax_loss, ax_bleu, ax_lr) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for i, (label, (run_dir, train, valid)) in enumerate(zip(labels, runs, strict=True)):
        color = f"C{i % 10}"
        name = "" if len(runs) == 1 else f"{label}: "
        train_label = f"{name}{train_loss_name(run_dir)}"
        one = "." if len(train) == 1 else None  # a line of one point is not drawn (stop 65: blank panels)
        ax_loss.plot(xs(train), [e["loss"] for e in train], color=faded(color, 0.5), label=train_label, marker=one)
        ax_loss.plot(xs(valid), [e["val_loss"] for e in valid], "o-", color=color, ms=3, label=f"{name}val loss")
        ax_bleu.plot(xs(valid), [e["val_bleu"] for e in valid], "o-", color=color, ms=3, label=label)
        ax_lr.plot(xs(train), [e["lr"] for e in train], color=color, marker=one)
    ax_loss.set_ylabel("loss per target token")
    ax_loss.legend(fontsize="small", framealpha=1)
    ax_bleu.set_ylabel("val BLEU (greedy)")
    if len(runs) > 1:
        ax_bleu.legend(fontsize="small", framealpha=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("update step" if x == "step" else "minutes of training")
    for ax in (ax_loss, ax_bleu, ax_lr):
        ax.grid(color=faded(matplotlib.rcParams["grid.color"], 0.3))
    fig.suptitle(_drawable(", ".join(str(r) for r in run_dirs)))
    with _no_glyph_warnings():
        fig.tight_layout()
    to_stdout = str(out) == "-"
    image_type = "png" if to_stdout else out.suffix[1:].lower() or "png"
    try:
        # the image is made first: matplotlib's PNG writer cannot seek in a device or pipe, and a
        # file written in place was left cut short by a full disk (stop 61: the old image lost)
        image = io.BytesIO()
        with _no_glyph_warnings():
            fig.savefig(image, dpi=100, format=image_type)
        if to_stdout:
            binary = getattr(sys.stdout, "buffer", None)
            if binary is None:  # (stop 68's probe: a notebook's standard output, an AttributeError)
                raise MtxError("--out -: standard output takes text only here, not an image; give --out FILE")
            with named_os_errors("standard output"):
                binary.write(image.getvalue())
                binary.flush()
            return out
        with parent_directories(out):  # (stop 57: a failed plot left the directories it had made)
            if (target := replaced_at(out)) is not None:  # a new file renamed over the old one
                from mtx.checkpoint import atomic_write_bytes

                atomic_write_bytes(target, image.getvalue())
            else:
                with named_os_errors(str(out)), open(out, "wb") as f:  # (a full disk: the system's error names no file)
                    f.write(image.getvalue())
    except (RuntimeError, ValueError) as e:  # matplotlib's own (stop 56: .pgf without LaTeX was a traceback)
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise MtxError(f"--out {out}: matplotlib cannot write it: {lines[0]}") from None
    finally:
        plt.close(fig)
    return out


@contextlib.contextmanager
def parent_directories(path: Path) -> Iterator[None]:
    """Make `path`'s missing parent directories for the block; where the block fails, remove
    those it made again (the ones still empty), so that a failed command leaves none behind."""
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]  # the deepest first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for directory in made:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def written_through(path: Path) -> bool:
    """Whether an output `path` is written by opening it (`/dev/null`, `/dev/stdout`, a pipe, a
    symbolic link) rather than replaced by a new regular file: `eval --output`'s and `plot --out`'s
    rule (stop 54: `plot --out /dev/stdout` wrote /dev/stdout.png)."""
    return path.is_symlink() or (path.exists() and not path.is_file())


def replaced_at(path: Path) -> Path | None:
    """Where an output is written as a new file renamed into place: `path`, or for a symbolic
    link to a regular file (or to none yet) the file it names, so that a failed write leaves the
    old file whole and the link in place (stop 66: written through the link, a full disk cut the
    file it named short); None where it is opened and written as it is (a device, a pipe)."""
    if not written_through(path):
        return path
    if not path.is_symlink() or _through_descriptors(path):
        return None
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a loop (refused earlier, by `_check_file_path`)
        return None
    if not path.exists():  # a link to a file to be made
        return target
    # (exists() and is_file() follow the link as the system does)
    return target if path.is_file() and os.path.samefile(path, target) else None


def _through_descriptors(path: Path) -> bool:
    """Whether a link chain from `path` passes through /proc or /dev/fd: `/dev/stderr`, `/dev/fd/3`
    name an open file, which a new file renamed over its name would not reach (stop 66 review: a
    log given as `--output /dev/stderr 2>>log` was replaced, and a `TemporaryFile`'s descriptor got
    nothing)."""
    here = Path(os.path.abspath(path))
    for _ in range(40):
        if str(here).startswith(("/proc/", "/dev/fd/")):
            return True
        if not here.is_symlink():
            return False
        here = Path(os.path.abspath(here.parent / os.readlink(here)))
    return True  # a chain this long (or a loop): left as it is


def _image_path(out: Path, formats: Iterable[str]) -> Path:
    """`out`, with `.png` added where it has no suffix (matplotlib would add it unseen), unless it
    is a link, device or pipe (`/dev/stdout`: stop 54 wrote /dev/stdout.png), written through as PNG; an
    image type matplotlib cannot write is a one-line error. `-` is standard output (PNG)."""
    if str(out) == "-" or written_through(out):
        return out
    if not out.suffix:
        return out.with_suffix(".png")
    if out.suffix[1:].lower() not in formats:
        raise MtxError(
            f"--out {out}: matplotlib cannot write {out.suffix} files; use one of "
            + ", ".join(f".{f}" for f in sorted(formats))
        )
    return out


def _lookups(valid: list[dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], list[float], list[int]]:
    """For `compare_runs`, in O(n log n) rather than a scan per row (stop 54: two runs of 3,000
    validations, 1.18 s -> 0.08 s): each step's first validation; the validations' times sorted;
    and for each prefix of that order, the largest file index in it."""
    by_step: dict[int, dict[str, Any]] = {}
    for e in valid:
        by_step.setdefault(e["step"], e)
    order = sorted(range(len(valid)), key=lambda i: valid[i]["elapsed_s"])
    last_before = list(itertools.accumulate(order, max))
    return by_step, [valid[i]["elapsed_s"] for i in order], last_before


def compare_runs(run_dirs: Sequence[Path]) -> list[str]:
    """A text table: at each validation of the first run, its val loss and greedy val BLEU, and
    each other run's at the same step and at the same training time (its last validation at or
    before that time). Comparing at equal time is what matters for a run with a time budget and
    a change that makes steps dearer or cheaper."""
    if len(run_dirs) < 2:
        raise MtxError("mtx compare needs at least two runs (--run A --run B)")
    valids = [_events(run_dir)[1] for run_dir in run_dirs]
    if not valids[0]:  # its validations are the rows
        raise MtxError(f"{run_dirs[0]}/metrics.jsonl holds no validation yet; give a run that has validated first")
    labels = run_labels(run_dirs)
    head = ["step", "min", labels[0]]
    for label in labels[1:]:
        head += [f"{label} (same step)", "(same time: step)"]
    rows = [head]

    def cell(e: dict[str, Any] | None) -> str:
        return "-" if e is None else f"{e['val_loss']:.3f} / {e['val_bleu']:.2f}"

    lookups = [_lookups(other) for other in valids[1:]]
    for e in valids[0]:
        row = [str(e["step"]), f"{e['elapsed_s'] / 60:.1f}", cell(e)]
        for other, (by_step, times, last_before) in zip(valids[1:], lookups, strict=True):
            same_step = by_step.get(e["step"])
            # the last validation (in the file's order) at or before this one's training time
            at = bisect.bisect_right(times, e["elapsed_s"])
            same_time = other[last_before[at - 1]] if at else None
            row += [cell(same_step), "-" if same_time is None else f"{cell(same_time)} ({same_time['step']})"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    title = "val loss / greedy val BLEU at each validation of the first run; min: minutes of training"
    # another run without one yet shows "-" (stop 65: the whole table was refused)
    notes = [f"note: {label} has no validation yet" for label, valid in zip(labels, valids, strict=True) if not valid]
    different = different_data(labels, run_dirs)
    if different:
        notes.append(f"note: {different}")
    return [title, *notes] + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
