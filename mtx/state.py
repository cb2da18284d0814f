"""What a checkpoint keeps of training besides the weights and the optimizer: the loop's position
and counters (`TrainState`), every random generator's state, the seeds of each rank, and the
moving average of the weights (train.ema)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class TrainState:
    step: int = 0  # optimizer updates done
    epoch: int = 0
    batch: int = 0  # batches of `epoch` consumed (by each rank)
    world_size: int = 1  # ranks that `batch` counts for
    best_bleu: float = -1.0
    best_step: int = 0
    evals_without_gain: int = 0  # validations on the train.eval_every cadence since patience_best_bleu rose
    # the best val BLEU of those validations: patience counts them alone, so a run ending between
    # them (max_steps, max_minutes, a signal) and resumed decides as a straight run (stop 62)
    patience_best_bleu: float = -1.0
    skipped_steps: int = 0
    bad_steps_in_row: int = 0
    elapsed: float = 0.0  # training seconds over all sessions
    both_ways_epochs: int = 0  # the first epochs, trained on every pair both ways (train.bidirectional)
    diversified_epoch: int = -1  # the first epoch that adds the model's translations of train (train.diversify)
    extra_source_epochs: int = 0  # the first epochs, with data.extra_src_langs' pairs added (train.extra_sources)
    validated_step: int = -1  # the last step validated (a checkpoint from before stop 54: from metrics.jsonl)
    # the log window open at the save (steps since the last train record, their loss and target
    # tokens, its training seconds): a resume mid-window logs the window a straight run logs
    window_steps: int = 0
    window_loss: float = 0.0
    window_tokens: int = 0
    window_seconds: float = 0.0


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU, CUDA) generator states, in types a weights-only load accepts."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # the states of the devices this machine has: a run saved where torch saw more GPUs (a
        # shared server, a torchrun job on 4) resumes where it sees fewer (stop 63: IndexError)
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int, step: int) -> int:
    """Torch seed for the dropout of rank > 0, distinct per (seed, rank, step); rank 0 keeps `seed`."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


class MovingAverage:
    """Exponential moving average of a model's weights (Polyak averaging), a smoother alternative
    to averaging step checkpoints: after every applied update, avg <- d * avg + (1 - d) * w with
    d = min(decay, (1 + n) / (10 + n)) at the n-th update, so the random initial weights fade fast.
    Tied weights are averaged once; buffers are the model's own."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.model = model
        self.decay = decay
        self.updates = 0
        self.params = list(model.parameters())
        self.averages = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.averages, self.params, 1.0 - d)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with every parameter replaced by its average."""
        average_of = {p.data_ptr(): a for p, a in zip(self.params, self.averages, strict=True)}
        return {k: average_of.get(v.data_ptr(), v) for k, v in self.model.state_dict().items()}

    def to_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "averages": self.averages}

    def load(self, saved: dict[str, Any]) -> None:
        averages = saved["averages"]
        shapes = [tuple(a.shape) for a in averages]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError("the saved moving average does not match the model's parameters")
        self.updates = int(saved["updates"])
        self.averages = [a.to(p.device, p.dtype) for a, p in zip(averages, self.params, strict=True)]
