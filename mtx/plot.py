"""Learning curves of a run (`mtx plot`): losses, val BLEU and learning rate against steps.

Needs matplotlib, the optional extra `mtx[plot]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtx.errors import MtxError


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The events of `metrics.jsonl`; a torn last line (a killed run) is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise MtxError(f"{run_dir}: no metrics.jsonl; is this an mtx run directory?")
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def plot_run(run_dir: Path, out: Path) -> Path:
    """Write a PNG with train/val loss, val BLEU and learning rate against update steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MtxError("mtx plot needs matplotlib: pip install 'mtx[plot]'") from None
    events = read_metrics(run_dir)
    train = [e for e in events if e.get("event") == "train"]
    valid = [e for e in events if e.get("event") == "valid"]
    if not train and not valid:
        raise MtxError(f"{run_dir}/metrics.jsonl holds no train or valid events yet")

    fig, (ax_loss, ax_bleu, ax_lr) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax_loss.plot([e["step"] for e in train], [e["loss"] for e in train], label="train loss (label-smoothed)")
    ax_loss.plot([e["step"] for e in valid], [e["val_loss"] for e in valid], "o-", label="val loss")
    ax_loss.set_ylabel("loss per target token")
    ax_loss.legend()
    ax_bleu.plot([e["step"] for e in valid], [e["val_bleu"] for e in valid], "o-", color="tab:green")
    ax_bleu.set_ylabel("val BLEU (greedy)")
    ax_lr.plot([e["step"] for e in train], [e["lr"] for e in train], color="tab:red")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("update step")
    for ax in (ax_loss, ax_bleu, ax_lr):
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
