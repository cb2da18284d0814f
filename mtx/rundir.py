"""A training run's directory before training: the checks of a new start and of a resume (the
config keys a resume may not change, the data and val pairs it was planned on, train.init_from),
and the directory a start writes."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mtx import checkpoint as ckpt_io
from mtx.config import Config, config_text, to_dict, user_path
from mtx.data import resolve_data_dir
from mtx.errors import CheckpointError, MtxError, command_line, own_command, shown
from mtx.text import scored_text
from mtx.tokenizer import tokenizer_paths

log = logging.getLogger(__name__)


def remove_contents(run_dir: Path, keep_dir: bool) -> None:
    """Undo a failed start in a directory that it found missing or empty (no checkpoint yet)."""
    if not keep_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in run_dir.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def data_digest(*columns: Sequence[str]) -> str:
    """A short hash of the training texts (each column's lines in order), stored in last.pt: the
    data a run's epochs were planned over. Stop 54: a resume on a replaced train split, or another
    data.dir, went on at the old plan's position in a plan of other pairs."""
    digest = hashlib.sha256()
    for column in columns:
        digest.update(b"%d\n" % len(column))
        digest.update("\n".join(column).encode("utf-8"))
    return digest.hexdigest()[:16]


def val_digest(cfg: Config, valid_src: Sequence[str], valid_tgt: Sequence[str], valid_refs: Sequence[str]) -> str:
    """A short hash of the val pairs that val BLEU is scored on (the first `train.eval_sentences`),
    stored in the run's checkpoints: a resume on other val pairs would compare their BLEU with
    best.pt's, scored on the old ones. The references count as they are scored (`valid_refs`,
    `read_lines(as_scored=True)`; their whitespace ends aside, which sacreBLEU's tokenizers drop)
    where that is not as the model reads them (stop 65: references that differed in invisible ends
    alone, which move BLEU, passed as the same; where they are the same, the hash is that of the
    runs before: Multi30k's val.fr has lines that start with a space)."""
    n_val = cfg.train.eval_sentences or len(valid_src)
    src, tgt, refs = valid_src[:n_val], valid_tgt[:n_val], scored_text(valid_refs[:n_val])
    return data_digest(src, tgt) if refs == list(tgt) else data_digest(src, tgt, refs)


def _check_same_val(last: dict[str, Any], digest: str, cfg: Config, run_dir: Path, path: Path) -> None:
    """Refuse a resume whose val pairs differ from those best.pt was chosen on (a last.pt saved
    before its digest was kept is not checked). A changed data.dir with other val files replaced
    best.pt by a checkpoint that was not better on the same data."""
    saved = last.get("val_digest")
    if saved is None or saved == digest:
        return
    data = last.get("config", {}).get("data", {})
    old_dir = data.get("dir") if isinstance(data, dict) else None
    old_n = last.get("config", {}).get("train", {}).get("eval_sentences")
    # the new run's command, quoted and starting mtx as it was started (stop 63: a bare `mtx` and
    # unquoted paths, which a run directory with a space or quote in its name broke)
    start = [*own_command(), "train", "--config", run_dir / ckpt_io.CONFIG_FILE, "--run-dir", "NEW"]
    if old_n is not None and old_n != cfg.train.eval_sentences:
        what = f"train.eval_sentences is {cfg.train.eval_sentences}, the run validated on {old_n}"
        keep = f"resume with --set train.eval_sentences={old_n}"
        start += ["--set", f"train.eval_sentences={cfg.train.eval_sentences}"]
    else:
        if old_dir is not None and old_dir != cfg.data.dir:
            what = f"data.dir is {cfg.data.dir}, the run validated in {old_dir}"
        else:
            what = f"the {cfg.data.valid_split} files in {cfg.data.dir} changed"
        keep = "resume on the run's own val files"
        start += ["--set", f"data.dir={cfg.data.dir}"]
    raise CheckpointError(
        f"{path}: the val pairs differ from those best.pt was chosen on ({what}), so their BLEU cannot be "
        f"compared with best.pt's; {keep}, or start a new run from it: "
        f"{command_line(*start, '--set', f'train.init_from={run_dir}')}"
    )


def unfinished_start(run_dir: Path) -> bool:
    """Whether `run_dir` holds a start that ended before its first checkpoint (killed with
    `kill -9`, or a machine that went down, while the tokenizer trained): a config.yaml, and
    neither a checkpoint nor a metrics.jsonl (opened after the first save), so nothing trained
    and no learning curve to lose."""
    return (
        (run_dir / ckpt_io.CONFIG_FILE).is_file()
        and not (run_dir / "metrics.jsonl").exists()
        and not any(ckpt_io.checkpoint_dir(run_dir).glob("*.pt"))
    )


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to overwrite another run, or to resume one that has no last.pt; writes nothing.

    A start that ended before its first checkpoint (`unfinished_start`) may be started again in
    its directory, with its own config or another one."""
    config_path = run_dir / ckpt_io.CONFIG_FILE
    if resume:
        if (ckpt_io.checkpoint_dir(run_dir) / "last.pt").is_file():
            return
        if not run_dir.is_dir() or unfinished_start(run_dir) or not config_path.is_file():
            start = command_line(*own_command(), "train", "--config", config_path, "--run-dir", run_dir)
            raise MtxError(f"{run_dir}: nothing to resume (no checkpoints/last.pt); start it again with: {start}")
        # a run that trained, and lost last.pt: starting it again in place is refused below, so the
        # advice is a new run from what is left (stop 54: each error sent the user to the other)
        # best.pt, else the newest step (stop 69's probe: directory order named step_30 before step_40)
        best, steps = ckpt_io.checkpoint_dir(run_dir) / "best.pt", ckpt_io.step_checkpoints(run_dir)[::-1]
        others = sorted(p for p in ckpt_io.checkpoint_dir(run_dir).glob("*.pt") if p != best and p not in steps)
        kept = [best] * best.is_file() + steps + others
        missing = f"{run_dir}: cannot resume: checkpoints/last.pt is missing"
        if not kept:
            raise MtxError(f"{missing}; train it again in a new --run-dir")
        start = command_line(
            *own_command(), "train", "--config", config_path, "--run-dir", "NEW", "--set", f"train.init_from={kept[0]}"
        )
        raise MtxError(f"{missing}; to train on, start a new run from one: {start}")
    for path in (run_dir, *run_dir.parents):  # (mkdir said only "File exists")
        if path.is_symlink() and not path.exists():
            raise MtxError(
                f"{path}: a symbolic link to {os.readlink(path)}, which does not exist; create that directory "
                "or choose another --run-dir"
            )
    if run_dir.exists() and not run_dir.is_dir():
        raise MtxError(f"{run_dir}: exists and is not a directory; choose another --run-dir")
    if run_dir.exists() and any(run_dir.iterdir()) and not unfinished_start(run_dir):
        if not config_path.is_file():
            raise MtxError(f"{run_dir}: directory holds other files, not an mtx run; choose a new or empty --run-dir")
        raise MtxError(
            f"{run_dir}: run directory already holds a run; continue it with --resume or choose a new --run-dir"
        )


def prepare_run_dir(run_dir: Path, cfg: Config, resume: bool, val: str | None = None) -> dict[str, Any] | None:
    """Check the run directory; for a new run, create it and write the resolved config (and, with
    `train.init_from`, copy the other run's tokenizer into it).

    On resume nothing is written here: `fit` records the config only once the checkpoint has
    been restored, so a failed resume changes nothing. The --set changes a resume refuses are
    found here, before train.log is opened (stop 55: the data's log lines were written to it);
    the last.pt read for them is returned, for the restore to use rather than read it again.
    `val`: the `val_digest` of the val pairs a resume would validate on, checked against last.pt's."""
    check_run_dir(run_dir, resume)
    if resume:
        metrics = run_dir / "metrics.jsonl"  # read, trimmed and appended to: checked before anything is written
        if (metrics.exists() or metrics.is_symlink()) and not metrics.is_file():
            raise MtxError(f"{metrics}: not a file; the run's metrics are appended there: move it away, then resume")
        path = ckpt_io.checkpoint_dir(run_dir) / "last.pt"
        last = ckpt_io.load_checkpoint(path)
        check_resumable(last, path)
        check_unchanged(last.get("config", {}), cfg, path, val is not None and "val_digest" in last)
        if val is not None:
            _check_same_val(last, val, cfg, run_dir, path)
        check_below_max_steps(last.get("state", {}).get("step", 0), cfg, path)
        return last
    source = init_source(cfg)
    if run_dir.is_dir() and unfinished_start(run_dir):
        previous = (run_dir / ckpt_io.CONFIG_FILE).read_text(encoding="utf-8", errors="replace")
        if previous != config_text(cfg):
            note = "%s held a start that ended before its first checkpoint, with another config: starting anew"
            log.warning(note, run_dir)
        for path in ckpt_io.run_files(run_dir):  # what a start writes before its first save
            path.unlink(missing_ok=True)
        shutil.rmtree(ckpt_io.checkpoint_dir(run_dir), ignore_errors=True)  # no .pt: temporary files at most
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = tokenizer_paths(run_dir, cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang)
    for path in set(paths):
        path.unlink(missing_ok=True)  # a failed start's tokenizer may be torn: train it again
    if source is not None:  # the weights belong to the other run's pieces: its tokenizer, not a new one
        originals = tokenizer_paths(source[0], cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang)
        for original, path in set(zip(originals, paths, strict=True)):
            ckpt_io.atomic_write_text(path, original.read_text(encoding="utf-8"))
    ckpt_io.atomic_write_text(run_dir / ckpt_io.CONFIG_FILE, config_text(cfg))
    return None


def resolve_config(cfg: Config) -> Config:
    """The config as the run will record it: `data.dir` replaced by the directory actually used."""
    return replace(cfg, data=replace(cfg.data, dir=str(resolve_data_dir(cfg.data))))


# keys an epoch's batch plan depends on (besides the rank count): changed by --resume mid-epoch,
# the run goes on from the next epoch
PLAN_KEYS = (
    ("train", "seed"),
    ("train", "batch_tokens"),
    ("data", "max_len"),
    ("data", "train_split"),
    ("data", "extra_src_langs"),
)


# the Adam settings a resume may change: config key -> parameter group key
ADAM_SETTINGS = {"adam_betas": "betas", "adam_eps": "eps", "weight_decay": "weight_decay"}


_FIXED_ON_RESUME = {  # keys that the tokenizer, the weights or the optimizer state depend on
    "tokenizer": tuple(to_dict(Config())["tokenizer"]),
    "model": tuple(k for k in to_dict(Config())["model"] if "dropout" not in k),
    "data": ("src_lang", "tgt_lang", "valid_split"),
    # the optimizer state holds its parameter groups; init_from starts a new run only (stop 55: set on
    # resume, it was recorded in config.yaml and never read); best.pt's val BLEU is of the val
    # sentences it was scored on (stop 55: 2 sentences' 3.51 beat 100 sentences' 2.90)
    "train": ("optimizer", "init_from", "eval_sentences"),
    # and of the outputs' length cap it was scored under (stop 66: a cap of 3 pieces set on resume
    # scored 0.00 while the val loss fell, and best.pt stayed at the old cap's best)
    "decode": ("max_len_a", "max_len_b"),
}


def config_changes(saved: dict[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (its value in last.pt's config `saved`, its value in `cfg`) for every key that a
    resume changes, in the config's order: the run trained with the old values up to the resume.
    A key that an older mtx's last.pt lacks trained as its default (stop 64: every run saved
    before data.extra_src_langs went on from the next epoch, "data.extra_src_langs changed")."""
    default = to_dict(Config())
    return {
        f"{section}.{key}": (old, value)
        for section, values in to_dict(cfg).items()
        for key, value in values.items()
        if (old := saved.get(section, {}).get(key, default[section][key])) != value
    }


def check_resumable(last: dict[str, Any], path: Path) -> None:
    """A last.pt's config and training position of the right shapes (stop 64: a hand-edited one,
    that every load check passed, ended a resume in a traceback)."""
    config, state = last.get("config", {}), last.get("state", {})
    if not isinstance(config, dict) or not all(isinstance(section, dict) for section in config.values()):
        raise CheckpointError(f"{path}: its config is not a mapping of sections; is this a last.pt of mtx train?")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: its training state is not a mapping; is this a last.pt of mtx train?")
    for key in ("step", "epoch", "batch"):
        value = state.get(key, 0)
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{path}: its training state's {key} is {shown(value)}, not a count; is it damaged?")
    rng = last.get("rng")
    if isinstance(rng, dict) and "torch" in rng and "numpy" not in rng:  # (stop 65: "KeyError: 'numpy'")
        raise CheckpointError(
            f"{path}: saved by an early mtx, before numpy's random state was kept, so it cannot be resumed "
            "exactly; start a new run"
        )


def check_unchanged(saved: dict[str, Any], cfg: Config, path: Path, val_digest_kept: bool = False) -> None:
    """On resume, refuse --set changes to keys the weights, tokenizer, optimizer state or best.pt's
    comparisons depend on. Where last.pt keeps the val pairs' digest, it decides on
    train.eval_sentences (`_check_same_val`): 0 and 5,000 of 1,014 val pairs are the same pairs."""
    # a key an older mtx's last.pt lacks trained as its default, as `config_changes` takes it (stop 67:
    # it was passed over, and `--set model.fix_norm=true` turned FixNorm on for a trained model)
    changes = config_changes(saved, cfg)
    for section, keys in _FIXED_ON_RESUME.items():
        if not isinstance(saved.get(section), dict):  # a section it lacks whole: not an older mtx's
            continue
        for key in keys:
            if val_digest_kept and (section, key) == ("train", "eval_sentences"):  # (stop 62: refused)
                continue
            if f"{section}.{key}" in changes:
                old, new = changes[f"{section}.{key}"]
                raise CheckpointError(
                    f"{path}: --resume cannot change {section}.{key} (the run was trained with {old!r}, "
                    f"now {new!r}); start a new run for that"
                )


# keys whose values may differ between the machines of one job: where each keeps the data, its cores
PER_MACHINE = frozenset({"data.dir", "train.threads"})


def flat_config(tree: dict[str, Any]) -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}."""
    return {f"{section}.{key}": value for section, keys in tree.items() for key, value in keys.items()}


def check_below_max_steps(step: int, cfg: Config, path: Path) -> None:
    """A resume past train.max_steps is a mistake, not a run to end: refused before anything is written."""
    if step > cfg.train.max_steps:
        raise MtxError(
            f"{path}: the run is at step {step}, past train.max_steps={cfg.train.max_steps}; "
            "resume with a larger train.max_steps (the run is unchanged)"
        )


# keys the copied tokenizer and the loaded weights depend on: a run started from another must share them
_SAME_AS_INIT = {section: keys for section, keys in _FIXED_ON_RESUME.items() if section not in ("train", "decode")}
_SAME_AS_INIT["tokenizer"] = tuple(k for k in _SAME_AS_INIT["tokenizer"] if k != "bpe_dropout")
_SAME_AS_INIT["data"] = ("src_lang", "tgt_lang")  # a run started from another may validate elsewhere


def init_source(cfg: Config) -> tuple[Path, Path] | None:
    """`train.init_from` as (the other run's directory, the checkpoint to start from), checked
    against `cfg` without writing anything; None when it is not set."""
    if not cfg.train.init_from:
        return None
    path = user_path(cfg.train.init_from, "train.init_from")
    # where it is, not how it was written: `best.pt` given inside RUN/checkpoints was taken for a
    # file outside a run's checkpoints/ (its parent's parent compared as the relative `.`); a linked
    # checkpoint file stays the file of the run it is linked from
    full = path.resolve() if path.is_dir() else path.parent.resolve() / path.name
    if path.is_dir() and full.name == "checkpoints" and (full.parent / ckpt_io.CONFIG_FILE).is_file():
        raise MtxError(
            f"train.init_from: {path} is a run's checkpoints directory; give the run directory ({full.parent}) "
            f"or one checkpoint file in it ({full / 'best.pt'})"
        )
    if path.is_dir():
        run_dir = full
        checkpoint = ckpt_io.default_checkpoint(run_dir)
        if checkpoint is None:
            if not (run_dir / ckpt_io.CONFIG_FILE).is_file():  # (stop 69's review: "train it first" of no run)
                raise MtxError(f"train.init_from: {path} is not a run directory (no config.yaml) nor a checkpoint")
            raise MtxError(f"train.init_from: {ckpt_io.no_checkpoint(path)}")
    elif path.is_file() and full.parent.name == "checkpoints":
        checkpoint, run_dir = full, full.parent.parent  # RUN/checkpoints/NAME.pt
    elif path.is_file():
        raise MtxError(
            f"train.init_from: {path} is a file outside a run's checkpoints/; give a run directory or "
            "RUN/checkpoints/NAME.pt"
        )
    else:
        raise MtxError(f"train.init_from: {path} not found; give a run directory or a checkpoint file of one")
    saved = to_dict(ckpt_io.load_run_config(run_dir))
    now = to_dict(cfg)
    for section, keys in _SAME_AS_INIT.items():
        for key in keys:
            if saved[section][key] != now[section][key]:
                raise MtxError(
                    f"train.init_from: {run_dir} was trained with {section}.{key}={saved[section][key]!r}, this "
                    f"config has {now[section][key]!r}; set it alike (its weights and tokenizer depend on it)"
                )
    for original in tokenizer_paths(run_dir, cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang):
        if not original.is_file():
            raise MtxError(f"train.init_from: {run_dir} has no {original.name}; is it an mtx run directory?")
    return run_dir, checkpoint


def open_directory(identity: tuple[int, int]) -> Path | None:
    """The path of a directory this process holds open, by its (device, inode), where the system
    says it (Linux's /proc/self/fd); None where it does not, or the directory was removed."""
    try:
        handles = list(Path("/proc/self/fd").iterdir())
    except OSError:
        return None
    for handle in handles:
        try:
            found = os.stat(handle)  # what the handle is open on
            if (found.st_dev, found.st_ino) == identity and os.path.isdir(handle):
                target = os.readlink(handle)
                if not target.endswith(" (deleted)") and os.path.isdir(target):
                    return Path(target)
        except OSError:
            continue
    return None
