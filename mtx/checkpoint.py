"""Run-directory layout, atomic checkpoint writes and safe (weights-only) loads.

A run directory holds everything needed to translate: the resolved `config.yaml`, the
tokenizer file(s) and `checkpoints/{last,best,step_N}.pt`. Checkpoints are written to a
temporary file in the same directory, flushed, fsynced and renamed over the old file, so a
crash at any moment leaves either the previous or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtx.config import Config, load_config
from mtx.errors import CheckpointError
from mtx.model import Seq2Seq
from mtx.tokenizer import BPE, load_run_tokenizers

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_checkpoints(run_dir: Path) -> list[Path]:
    """`checkpoints/step_N.pt` files, oldest step first."""
    paths = checkpoint_dir(run_dir).glob("step_*.pt")
    return sorted(paths, key=lambda p: int(p.stem.split("_", 1)[1]) if p.stem.split("_", 1)[1].isdigit() else -1)


def atomic_save(obj: dict[str, Any], path: Path) -> None:
    """torch.save to `path` so that readers only ever see a complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load with `weights_only=True`: tensors and plain containers only, never code."""
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unsupported content"
        raise CheckpointError(
            f"{path}: refused to load: the file holds objects other than weights ({first[:120]}); "
            "only load checkpoints you trust, written by mtx"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint ({e.__class__.__name__})") from None
    if not isinstance(obj, dict) or "model" not in obj:
        raise CheckpointError(f"{path}: not an mtx checkpoint (no 'model' weights)")
    version = obj.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {version!r} is not supported (expected {FORMAT_VERSION})")
    return obj


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> Config:
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: run directory not found")
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {CONFIG_FILE}; is this an mtx run directory?")
    return load_config(path, overrides)


def shape_fingerprint(model: Seq2Seq) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def check_compatible(ckpt: dict[str, Any], path: Path, vocab: str, model: Seq2Seq) -> None:
    """One-line errors when a checkpoint's vocabulary or model shape differs from the run's."""
    if ckpt.get("vocab") != vocab:
        raise CheckpointError(f"{path}: vocabulary differs from the run's tokenizer (fingerprint mismatch)")
    expected = shape_fingerprint(model)
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
    model: Seq2Seq
    src_tok: BPE
    tgt_tok: BPE
    checkpoint: Path


def build_model(cfg: Config, src_tok: BPE, tgt_tok: BPE) -> Seq2Seq:
    return Seq2Seq(cfg.model, src_tok.vocab_size, tgt_tok.vocab_size, joint_vocab=cfg.tokenizer.joint)


def load_run(run_dir: Path, checkpoint: Path | None = None, device: torch.device | None = None) -> LoadedRun:
    """Model and tokenizers of a run, from `checkpoint` or best.pt (else last.pt)."""
    cfg = load_run_config(run_dir)
    src_tok, tgt_tok = load_run_tokenizers(run_dir, cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang)
    if checkpoint is None:
        ckpts = checkpoint_dir(run_dir)
        candidates = [ckpts / "best.pt", ckpts / "last.pt"]
        checkpoint = next((p for p in candidates if p.is_file()), None)
        if checkpoint is None:
            raise CheckpointError(f"{run_dir}: no checkpoints yet (train first: mtx train --run-dir {run_dir})")
    ckpt = load_checkpoint(checkpoint)
    model = build_model(cfg, src_tok, tgt_tok)
    check_compatible(ckpt, checkpoint, vocab_fingerprint(src_tok, tgt_tok), model)
    model.load_state_dict(ckpt["model"])
    model.eval()
    if device is not None:
        model.to(device)
    return LoadedRun(cfg, model, src_tok, tgt_tok, checkpoint)
