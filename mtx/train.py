"""Training: the LR schedule, the loop, validation, checkpoints (the loss: loss.py; the device
and precision: device.py; the run directory's checks: rundir.py; train.log, metrics.jsonl and the
progress bar: runlog.py; the stop signals and the loop's clock: clock.py; the loop's position, the
random states and the moving average of the weights: state.py; what each epoch trains on:
epochs.py).

`fit` owns the loop; everything it needs to continue exactly where it stopped (model,
optimizer, scaler, RNG states, step, epoch and batch position) goes into `last.pt`.

Launched by `torchrun` with WORLD_SIZE > 1, every process trains one replica under
DistributedDataParallel on its share of each epoch's batches and of each validation; rank 0
alone writes the run directory.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mtx import checkpoint as ckpt_io
from mtx import device as devices
from mtx import punctuation
from mtx.clock import PauseClock, StopRequest
from mtx.collective import Collective
from mtx.config import Config, TrainConfig, config_text, to_dict
from mtx.data import (
    Batch,
    ParallelIds,
    epoch_batches,
    epoch_length,
    epoch_plan,
    extra_source_texts,
    is_test_split,
    load_corpus,
    median_batch,
    padding_fraction,
    plan_batches,
    resolve_data_dir,
    split_file,
    texts,
    warn_if_validating_on_train,
)
from mtx.device import (
    Ranks,
    amp_dtype,
    autocast,
    barrier,
    rank_device,
    slow_bf16,
    start_process_group,
)
from mtx.epochs import EpochPairs
from mtx.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    Interrupted,
    MtxError,
    command_line,
    memory_advice,
    named_os_errors,
    out_of_memory,
    own_command,
    torchrun_command,
)
from mtx.evaluate import corpus_scores
from mtx.loss import TokenLoss, label_smoothed_loss, training_loss
from mtx.model import Dropout, Seq2Seq
from mtx.plot import parent_directories, read_metrics
from mtx.rundir import (
    ADAM_SETTINGS,
    PER_MACHINE,
    PLAN_KEYS,
    check_below_max_steps,
    check_resumable,
    check_run_dir,
    check_unchanged,
    config_changes,
    data_digest,
    flat_config,
    init_source,
    open_directory,
    prepare_run_dir,
    remove_contents,
    resolve_config,
    val_digest,
)
from mtx.runlog import HeldWarnings, RunLog, UntilReaderGone, append_record, progress_bar, zero_width_terminal
from mtx.search import DecodeOutOfMemory, translate, translate_ids
from mtx.state import MovingAverage, TrainState, rank_seed, rng_state, seed_everything, set_rng_state
from mtx.text import read_lines, read_sources, warn_of_invisible_ends, warn_unless_nfc
from mtx.threads import set_threads, usable_cpus
from mtx.tokenizer import BPE, UNK, load_run_tokenizers, train_or_load

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


def learning_rate(step: int, cfg: TrainConfig, d_model: int, elapsed: float = 0.0) -> float:
    """LR for (1-based) update `step`, `elapsed` training seconds into the run.

    `inverse_sqrt`: linear warmup then inverse square root decay. `noam`: the same shape scaled
    as in Vaswani et al., lr * d_model^-0.5 * min(...). `linear`: lr * min(step / warmup, the
    fraction of the budget left before this update), where the budget ends at train.max_steps or
    after train.max_minutes, whichever comes first, so the rate reaches zero as training ends even
    when the time budget stops it (the warmup ramp meets the decay a little below `lr`). The last
    update of the step budget still moves the weights, at lr / max_steps (stop 61: its rate was 0,
    so a run made max_steps - 1 updates and a 1-step fine-tune none)."""
    step = max(step, 1)
    warmup = max(cfg.warmup_steps, 1)
    ramp = min(1.0, step / warmup)
    if cfg.schedule == "constant":
        return cfg.lr * ramp
    if cfg.schedule == "linear":
        return cfg.lr * max(0.0, min(ramp, 1.0 - budget_used(step - 1, cfg, elapsed)))
    factor = min(step / warmup, math.sqrt(warmup / step))
    if cfg.schedule == "noam":
        return cfg.lr * d_model**-0.5 * warmup**-0.5 * factor
    return cfg.lr * factor


def budget_used(step: int, cfg: TrainConfig, elapsed: float) -> float:
    """The fraction of the training budget used after `step` updates and `elapsed` seconds: of
    train.max_steps, or of train.max_minutes when that runs out first."""
    used = step / cfg.max_steps
    if cfg.max_minutes:
        used = max(used, elapsed / (60 * cfg.max_minutes))
    return used


def dropout_rate(step: int, cfg: TrainConfig, final: float) -> float:
    """model.dropout (`final`) for (1-based) update `step`: with train.dropout_warmup it rises
    linearly from train.dropout_start at step 1 to `final` at step dropout_warmup, then stays.
    Rounded to 1e-4 so that runs and resumes set the same rates."""
    if not cfg.dropout_warmup or step >= cfg.dropout_warmup:
        return final
    frac = (max(step, 1) - 1) / max(cfg.dropout_warmup - 1, 1)
    return round(cfg.dropout_start + (final - cfg.dropout_start) * frac, 4)


def drop_words(ids: torch.Tensor, p: float) -> torch.Tensor:
    """Word dropout: each piece of (B, L) `ids` replaced by UNK with probability `p`; the special
    ids (padding, BOS, EOS, UNK) are kept. A new tensor; `ids` itself is not changed."""
    if p <= 0.0:
        return ids
    drop = (torch.rand(ids.shape, device=ids.device) < p) & (ids > UNK)
    return ids.masked_fill(drop, UNK)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Set the rate of every residual/embedding/FFN dropout (model.dropout) in `model`; an FFN
    dropout with a rate of its own (model.activation_dropout >= 0) keeps it."""
    for module in model.modules():
        if isinstance(module, Dropout) and not module.fixed:
            module.p = p


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """Adam or AdamW with the fused (single-kernel) update where the device has one. AdamW decays
    the matrices and embeddings only (parameters of 2+ dimensions), not biases or norm gains."""
    fused = {"fused": True} if device.type in ("cuda", "cpu") else {}
    common = {"lr": cfg.lr, "betas": cfg.adam_betas, "eps": cfg.adam_eps, **fused}
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), weight_decay=cfg.weight_decay, **common)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, **common)


# what to do where a training step does not fit in memory
_LOWER_BATCH = "lower train.batch_tokens (raising train.accum_steps keeps an update's tokens)"

_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def _peer_lost(error: BaseException) -> bool:
    """Whether a collective failed because another rank's process is gone (killed, out of memory)."""
    return any(sign in str(error) for sign in _PEER_LOST)


def _first_line(error: BaseException) -> str:
    """The gist of a collective's error: its first line, the file position gloo puts first cut off."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\] ", "", line).split(". ")[0][:200]


def too_few_batches(pairs: int, batches: int, tc: TrainConfig, world_size: int) -> str:
    """The error for an epoch with fewer batches than one update takes."""
    per_rank = f" per rank ({world_size} ranks)" if world_size > 1 else ""
    return (
        f"an epoch of {pairs} training pairs makes {batches} batches of train.batch_tokens={tc.batch_tokens}"
        f"{per_rank}, fewer than train.accum_steps={tc.accum_steps}: lower train.accum_steps or train.batch_tokens"
    )


class Trainer:
    """Holds a run's model, optimizer and data; `fit` runs the loop.

    With `ranks.world_size > 1` (the process group started) it is one replica of a DDP job:
    every rank calls the same methods in the same order, and only rank 0 writes files."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        resume: bool,
        corpus: datasets.DatasetDict | None = None,
        ranks: Ranks | None = None,
        extra_texts: tuple[list[str], list[str]] | None = None,
        last: dict[str, Any] | None = None,
    ) -> None:
        """`last`: the run's last.pt where the caller has loaded it already (`prepare_run_dir`)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.resumed = resume
        # what a resume's changes do, said once training goes on (stop 66: a resume that trained
        # nothing logged them as taking effect "from now on", while config.yaml kept the old values)
        self.resume_notes: list[tuple[int, str]] = []
        self.saved_with = {"step": False, "ema": False}  # last.pt's run made step checkpoints, ema.pt
        self.ranks = ranks = ranks or Ranks()
        self.saved_step: int | None = None  # step of the newest last.pt
        self.end_step = cfg.train.max_steps  # where the run ends, as far as known (`_epochs_end`)
        tc = cfg.train
        if ranks.is_main:  # another node cannot tell whether a writer's pid is alive
            for path in ckpt_io.clean_stale_tmp(ckpt_io.checkpoint_dir(run_dir)):
                log.info("removed %s, left by an interrupted save", path)
        set_threads(_thread_count(tc.threads) if tc.threads else 0)
        seed_everything(tc.seed)
        self.device = rank_device(tc.device, ranks)
        self.comm = Collective(ranks, self.device)
        self._check_same_config()
        self.amp_resumed = False  # train.amp auto's choice on CPU taken from last.pt (`_keep_cpu_precision`)
        self.bf16_step: float | None = None  # train.amp auto on CPU: a training pass's bf16 speedup, where timed

        data_dir = resolve_data_dir(cfg.data)
        if corpus is None:
            corpus = load_corpus(data_dir, cfg.data, [cfg.data.train_split, cfg.data.valid_split])
        train_src, train_tgt = texts(corpus[cfg.data.train_split])
        valid_src, valid_tgt = texts(corpus[cfg.data.valid_split])
        self.src_tok, self.tgt_tok = self._run_tokenizers(train_src, train_tgt)
        self.folds = self._source_folds(train_src)  # the punctuation validation reads as eval does
        self._encode_training_pairs(data_dir, train_src, train_tgt, extra_texts)  # pairs, data_digest
        self._check_same_data(data_dir, data_digest([self.data_digest], valid_src, valid_tgt))
        self.setup_seconds = 0.0  # of epochs' setup since the fit loop last took it (`_micro_batches`)
        self.updating = False  # inside a step's optimizer update (`train_step`): the weights are half-new
        self.scale_overflow = False  # the last step's update skipped by fp16's loss scaler (`train_step`)
        self.clock = PauseClock()  # the training loop's time (`fit` runs it)
        # the directory itself, wherever it is moved (rank 0 writes; another machine's ranks may not see it)
        self.run_dir_id = (os.stat(run_dir).st_dev, os.stat(run_dir).st_ino) if ranks.is_main else (-1, -1)
        if ranks.is_main:
            self._warn_of_splits()
        self._encode_val_pairs(data_dir, valid_src, valid_tgt)  # valid_refs, val_digest, valid_ids, valid_loss_rows

        self.model = self._build_model()
        self.amp = self._agreed_amp()  # (on CPU, auto times this model's training pass)
        self.vocab = ckpt_io.vocab_fingerprint(self.src_tok, self.tgt_tok)
        if tc.init_from and not resume:  # before the optimizer and the moving average see the weights
            self._init_weights(init_source(cfg)[1])
        self.optimizer = make_optimizer(self.model, tc, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp == torch.float16)
        loss_fn = training_loss(tc.compile, tc.rdrop)
        self.loss_module: torch.nn.Module = TokenLoss(self.model, loss_fn, tc.label_smoothing)
        if ranks.world_size > 1:  # DDP copies rank 0's initial weights to every rank
            self.loss_module = DistributedDataParallel(
                self.loss_module, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.state = TrainState(world_size=ranks.world_size)
        # only rank 0 writes checkpoints, so only rank 0 keeps the average (every rank has the same weights)
        self.ema = MovingAverage(self.model, tc.ema) if tc.ema and ranks.is_main else None
        if resume:
            self._restore(last)
        elif ranks.rank:
            torch.manual_seed(rank_seed(tc.seed, ranks.rank, 0))  # each rank its own dropout masks

    def _agreed_amp(self) -> torch.dtype | None:
        """train.amp's dtype on this device; under DDP, the one that every rank takes."""
        tc, ranks = self.cfg.train, self.ranks
        amp = amp_dtype(self.device, tc.amp)
        if tc.amp == "auto" and self.device.type == "cpu" and ranks.is_main and not self.resumed:
            # this model's pass, timed (stop 71: bf16 products alone chose bf16 for a d_model 64 model
            # that then trained 2.25x slower); a resume goes on as the run was trained (`_restore`)
            try:
                amp, self.bf16_step = devices.auto_cpu_amp(self.model, self._median_batch_loss())
            except RuntimeError as e:  # the CPU allocator's failure: one line, before anything trained
                if not out_of_memory(e):
                    raise
                raise MtxError(
                    f"out of memory on {self.device} in a training pass (train.batch_tokens={tc.batch_tokens}), "
                    f"timed for train.amp auto before the first step; {memory_advice(_LOWER_BATCH, self.device)}"
                ) from None
        if tc.amp == "auto" and self.device.type == "cpu" and ranks.world_size > 1:
            # each rank timed bf16 on its own (`cpu_bf16_speedup`): rank 0's choice holds for all
            amp = torch.bfloat16 if self.comm.flag_from_main(amp is not None) else None
        elif tc.amp == "auto" and ranks.world_size > 1:
            # each GPU's own: bf16 where it computes it natively, else fp16 with the loss scaler; the
            # job takes the one every rank has (stop 68's probe, simulated: bf16 and fp16 ranks averaged
            # scaled and unscaled gradients, and the replicas drifted apart from the first update)
            kinds = [None, torch.float16, torch.bfloat16]
            amp = kinds[self.comm.smallest(kinds.index(amp))]
        return amp

    def _median_batch_loss(self) -> Callable[[], torch.Tensor]:
        """The training loss of a batch of median length (`median_batch`)."""
        tc = self.cfg.train
        batch = median_batch(self.pairs.train_ids, tc.batch_tokens).to(self.device)
        return lambda: label_smoothed_loss(self.model, batch, tc.label_smoothing)

    def _run_tokenizers(self, train_src: list[str], train_tgt: list[str]) -> tuple[BPE, BPE]:
        """The run's (src, tgt) tokenizers: a new run's trained (or loaded) by rank 0, then loaded by the rest."""
        cfg, run_dir, ranks = self.cfg, self.run_dir, self.ranks
        if ranks.is_main and not self.resumed:
            toks = train_or_load(run_dir, cfg.tokenizer, cfg.data.src_lang, cfg.data.tgt_lang, train_src, train_tgt)
        self.comm.barrier()  # rank 0 has trained and saved a new run's tokenizer before the others load it
        if self.resumed or not ranks.is_main:  # a run that has weights never retrains its tokenizer
            toks = load_run_tokenizers(run_dir, cfg.tokenizer.joint, cfg.data.src_lang, cfg.data.tgt_lang)
        return toks

    def _source_folds(self, train_src: list[str]) -> dict[str, str]:
        """`mtx.punctuation.folds` of the training sources, whose counts rank 0 saves for decoding
        in a new run, and in a resumed one that has none (trained before stop 73)."""
        counts = punctuation.punctuation_counts(train_src)
        saved = (self.run_dir / punctuation.COUNTS_FILE).exists()
        if self.ranks.is_main and (not self.resumed or not saved):
            punctuation.save_counts(self.run_dir, self.cfg.data.src_lang, counts)
        return punctuation.folds(counts)

    def _encode_training_pairs(
        self,
        data_dir: Path,
        train_src: list[str],
        train_tgt: list[str],
        extra_texts: tuple[list[str], list[str]] | None,
    ) -> None:
        """Sets `pairs` (what each epoch trains on) and data_digest; refuses too little to train on."""
        cfg, tc, ranks = self.cfg, self.cfg.train, self.ranks
        if extra_texts is None:
            extra_texts = extra_source_texts(data_dir, cfg.data)
        self.pairs = EpochPairs(cfg, self.comm, (self.src_tok, self.tgt_tok), (train_src, train_tgt), extra_texts)
        train_ids = self.pairs.train_ids
        if not len(train_ids):
            raise MtxError(
                f"data.max_len={cfg.data.max_len}: all {len(train_src)} training pairs are longer than that "
                "in BPE tokens; raise data.max_len"
            )
        batches = epoch_length(train_ids, tc.batch_tokens, tc.seed, 0, ranks.world_size)
        if batches < tc.accum_steps:  # an epoch shorter than one update: refused (its only update a leftover)
            raise MtxError(too_few_batches(len(train_ids), batches, tc, ranks.world_size))
        # what the epochs' plans are made of: a resume mid-epoch on other data starts the next epoch
        self.data_digest = data_digest(train_src, train_tgt, *extra_texts)

    def _warn_of_splits(self) -> None:
        """Warn where the splits trained or validated on make the scores unfair (rank 0's job)."""
        data = self.cfg.data
        warn_if_validating_on_train(data)
        if is_test_split(data.train_split):  # (stop 61: not a word)
            log.warning(
                "data.train_split is a test split (%r): the model learns the sentences it would be tested on, "
                "so no score on that split is a fair test; train on train",
                data.train_split,
            )
        if is_test_split(data.valid_split):
            log.warning(
                "data.valid_split is a test split (%r): best.pt and patience are then chosen on it, and its "
                "score is no longer a fair test; validate on val",
                data.valid_split,
            )

    def _encode_val_pairs(self, data_dir: Path, valid_src: list[str], valid_tgt: list[str]) -> None:
        """Sets valid_refs, val_digest, valid_ids, valid_loss_rows; refuses a val set no pair of which fits."""
        cfg, ranks = self.cfg, self.ranks
        n_val = cfg.train.eval_sentences or len(valid_src)
        # val BLEU and chrF score the references as sacreBLEU reads the file, as `mtx eval` does, with
        # its warning; the val loss keeps the cleaned targets the model trains on (stop 64: training
        # scored references stripped of invisible ends, a val BLEU that mtx eval did not give)
        ref_file = split_file(data_dir, cfg.data.valid_split, cfg.data.tgt_lang)
        self.valid_refs = read_lines(ref_file, as_scored=True)[:n_val]
        self.val_digest = val_digest(cfg, valid_src, valid_tgt, self.valid_refs)  # what best.pt's BLEU was scored on
        if ranks.is_main:
            warn_unless_nfc(self.valid_refs, f"{cfg.data.valid_split}.{cfg.data.tgt_lang}")
            warn_of_invisible_ends(self.valid_refs, str(ref_file))
        # the sources as `mtx eval` reads them (decode.normalize_spaces, decode.normalize_punctuation);
        # a val line beyond the positions is cut before tokenising (stop 65: a 32 MB line took 4.2 GB)
        read_as = self.folds if cfg.decode.normalize_punctuation else None
        valid_src = read_sources(valid_src[:n_val], cfg.decode.normalize_spaces, read_as)
        self.valid_ids = ParallelIds.encode(
            valid_src[:n_val], valid_tgt[:n_val], self.src_tok, self.tgt_tok, read=cfg.model.max_positions - 1
        )
        # the val loss is over the pairs the model's positions hold (EOS or BOS added to each side);
        # BLEU is over all of them, longer sources truncated as `mtx translate` does
        longest = np.maximum(self.valid_ids.src_lens, self.valid_ids.tgt_lens)  # EOS / BOS included
        self.valid_loss_rows = np.flatnonzero(longest <= cfg.model.max_positions)
        if not len(self.valid_loss_rows):
            shortest = int(np.argmin(longest))  # tokenised whole here: the val set's lines were cut (stop 65)
            whole = ParallelIds.encode([valid_src[shortest]], [valid_tgt[shortest]], self.src_tok, self.tgt_tok)
            raise MtxError(
                f"every val pair is longer than model.max_positions ({cfg.model.max_positions}) allows "
                f"(the shortest needs {max(whole.src_lens[0], whole.tgt_lens[0])} positions); raise model.max_positions"
            )
        if len(self.valid_loss_rows) < len(self.valid_ids) and ranks.is_main:
            log.warning(
                "%d of %d val pairs are longer than model.max_positions (%d) allows and are left out of the val "
                "loss (val BLEU translates them, truncated)",
                len(self.valid_ids) - len(self.valid_loss_rows),
                len(self.valid_ids),
                cfg.model.max_positions,
            )

    def _build_model(self) -> Seq2Seq:
        """The model on the device (an out-of-memory said in one line), its restricted output said."""
        cfg = self.cfg
        output_ids = self.pairs.train_ids.target_vocabulary() if cfg.model.restrict_output else None
        try:
            model = ckpt_io.build_model(cfg, self.src_tok, self.tgt_tok, output_ids).to(self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError is one; so is the CPU allocator's failure
            if not out_of_memory(e):
                raise
            m = cfg.model
            raise MtxError(
                f"the model does not fit in memory on {self.device} (model.d_model {m.d_model}, model.d_ff "
                f"{m.d_ff}, model.max_positions {m.max_positions}, {self.tgt_tok.vocab_size} target pieces); "
                + memory_advice("make it smaller", self.device)
            ) from None
        if model.output_ids is not None and self.ranks.is_main:
            val_pieces = torch.tensor([i for s in self.valid_ids.tgt_ids for i in s], dtype=torch.long)
            outside = int((~torch.isin(val_pieces, model.output_ids.cpu())).sum())
            log.info(
                "output softmax over %d of %d target pieces (model.restrict_output); val: %d of %d target "
                "pieces lie outside it and count as UNK in the val loss",
                len(model.output_ids),
                self.tgt_tok.vocab_size,
                outside,
                len(val_pieces),
            )
        return model

    # -- what the ranks agree on (`self.comm`: no-ops in a single process) --------------------
    @contextlib.contextmanager
    def _peer_lost_said(self) -> Iterator[None]:
        """A collective that failed because another rank of the job ended, said in one line (gloo's
        own error is a long traceback that does not say so)."""
        try:
            yield
        except RuntimeError as e:
            if self.ranks.world_size > 1 and _peer_lost(e):
                raise self._peer_lost_error(e) from None
            raise

    def _check_same_config(self) -> None:
        """Every rank trains rank 0's config, but for the keys a machine may set for itself (stop
        55: a `--set train.max_steps` given on one machine only hung the job at that rank's end)."""
        if self.ranks.world_size == 1:
            return
        main, mine = flat_config(self.comm.from_main(to_dict(self.cfg))), flat_config(to_dict(self.cfg))
        differ = [key for key, value in main.items() if key not in PER_MACHINE and mine.get(key) != value]
        same = "give every process the same config and --set"
        self.comm.stop_all_where(
            ConfigError(f"rank {self.ranks.rank}'s config differs from rank 0's at {', '.join(differ)}; {same}")
            if differ
            else None,
            ConfigError(f"another rank's config differs from rank 0's (its error names the keys); {same}"),
        )

    def _check_same_data(self, data_dir: Path, digest: str) -> None:
        """Every rank trains and validates on rank 0's pairs (`digest`, of the train, extra-source
        and val texts): `data.dir` is each machine's own (stop 68's probe: a shorter train copy on
        one machine hung a train.max_epochs job at that rank's epoch end, with nothing saved)."""
        if self.ranks.world_size == 1:
            return
        same = "give every machine the same data"
        self.comm.stop_all_where(
            DataError(f"rank {self.ranks.rank}'s data ({data_dir}) differs from rank 0's; {same}")
            if self.comm.from_main(digest) != digest
            else None,
            DataError(f"another rank's data differs from rank 0's (its error names it); {same}"),
        )

    # -- checkpoints -----------------------------------------------------------------------
    def _payload(self, full: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": ckpt_io.FORMAT_VERSION,
            "model": self.model.state_dict(),
            "config": to_dict(self.cfg),
            "vocab": self.vocab,
            "step": self.state.step,
            "val_digest": self.val_digest,
        }
        if full:
            out.update(
                optimizer=self.optimizer.state_dict(),
                scaler=self.scaler.state_dict(),
                rng=rng_state(),
                state=asdict(self.state),
            )
            out.update(self.pairs.to_checkpoint())
            if self.ema is not None:
                out["ema"] = self.ema.to_dict()
            out["data_digest"] = self.data_digest
            if self.cfg.train.amp == "auto" and self.device.type == "cpu":  # the timed choice, kept on resume
                out["cpu_amp"] = "bf16" if self.amp == torch.bfloat16 else "fp32"
        return out

    def save(self) -> None:
        """Write the full training state to last.pt (atomically).

        Under DDP every rank calls it: rank 0 writes, with each rank's RNG states, while the
        others wait, so that none exits (and torchrun stops the job) while last.pt is written."""
        rng_per_rank = self.comm.gathered(rng_state())
        if self.ranks.is_main:
            self._follow_run_dir()
            payload = self._payload(full=True)
            if rng_per_rank is not None:
                payload["rng_per_rank"] = rng_per_rank
            ckpt_io.atomic_save(payload, ckpt_io.checkpoint_dir(self.run_dir) / "last.pt")
        self.comm.barrier()
        self.saved_step = self.state.step

    def _init_weights(self, path: Path) -> None:
        """`train.init_from`: the weights of another run's checkpoint (its tokenizer is this run's
        copy); the softmax restriction (`model.restrict_output`) stays this run's own."""
        ckpt = ckpt_io.load_checkpoint(path)
        weights = dict(ckpt["model"])
        if self.model.output_ids is not None:
            weights["output_ids"] = self.model.output_ids
        ckpt_io.check_compatible({**ckpt, "model": weights}, path, self.vocab, self.model)
        self.model.load_state_dict(weights)
        log.info(
            "initialised from %s (its step %s): weights and tokenizer; optimizer, schedule and steps start afresh",
            path,
            ckpt.get("step", "?"),  # every checkpoint's top level (the training state only in last.pt)
        )

    def _keep_cpu_precision(self, saved: str | None) -> None:
        """`train.amp: auto` on CPU goes on in the precision the run was trained in, where this CPU
        has native bf16: its choice comes from timing bf16 products, which a busy machine can tip
        either way between sessions (stop 54: a bf16 run resumed in fp32 after a timing of 0.82x).
        A CPU without native bf16 (emulated: many times slower) goes on in fp32."""
        if saved is None or self.cfg.train.amp != "auto" or self.device.type != "cpu":
            return
        keep = torch.bfloat16 if saved == "bf16" and devices.cpu_bf16_speedup() > 0 else None
        self.amp_resumed = True
        if keep != self.amp:
            log.info("train.amp auto: going on in %s, as the run was trained", saved if keep else "fp32")
            self.amp = keep

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        """The optimizer's moments from last.pt, under this config's Adam settings: torch's
        load_state_dict puts back the saved betas, eps and weight decay (stop 64: `--resume --set
        train.weight_decay=0.1` was written to config.yaml and never used). The rate is set at
        every step; `config_changes` logs what changed."""
        settings = [{key: group[key] for key in ADAM_SETTINGS.values()} for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)

    def _restore(self, ckpt: dict[str, Any] | None = None) -> None:
        """Continue from last.pt (`ckpt`, where loaded already): weights, optimizer, scaler, RNG
        states and data position."""
        path = ckpt_io.checkpoint_dir(self.run_dir) / "last.pt"
        ckpt = ckpt if ckpt is not None else ckpt_io.load_checkpoint(path)
        missing = [k for k in ("optimizer", "scaler", "rng", "state", "config") if k not in ckpt]
        if missing:
            raise CheckpointError(f"{path}: holds weights only (no {', '.join(missing)}); resuming needs a last.pt")
        check_resumable(ckpt, path)
        check_unchanged(ckpt["config"], self.cfg, path, "val_digest" in ckpt)
        # what the validation at last.pt's step wrote beside it, by the settings it ran with
        saved_keep = ckpt["config"].get("train", {}).get("keep_last")
        self.saved_with = {"step": isinstance(saved_keep, int) and saved_keep > 0, "ema": "ema" in ckpt}
        ckpt_io.check_compatible(ckpt, path, self.vocab, self.model)
        self.model.load_state_dict(ckpt["model"])
        try:
            self._load_optimizer(ckpt["optimizer"])
            if ckpt["scaler"]:  # empty when saved without fp16: a run resumed in fp16 starts a fresh scaler
                self.scaler.load_state_dict(ckpt["scaler"])
            self.state = TrainState(**ckpt["state"])
            if "patience_best_bleu" not in ckpt["state"]:  # saved before stop 62
                self.state.patience_best_bleu = self.state.best_bleu
            self.pairs.load_checkpoint(ckpt)
            self._keep_cpu_precision(ckpt.get("cpu_amp"))
            if self.ema is not None and "ema" in ckpt:
                self.ema.load(ckpt["ema"])
            elif self.ema is not None:  # train.ema turned on at resume: the average starts here
                self.ema = MovingAverage(self.model, self.ema.decay)
            elif "ema" in ckpt and self.ranks.is_main and (ckpt_io.checkpoint_dir(self.run_dir) / "ema.pt").is_file():
                # (stop 57: it stayed without a word, an average of an earlier step beside new ones)
                self.resume_notes.append(
                    (
                        logging.INFO,
                        f"train.ema is 0 from step {self.state.step}: checkpoints/ema.pt stays the moving average "
                        f"of step {ckpt_io.saved_step(ckpt_io.checkpoint_dir(self.run_dir) / 'ema.pt')}",
                    )
                )
            rng_per_rank = ckpt.get("rng_per_rank") or [ckpt["rng"]]
            same_ranks = len(rng_per_rank) == self.ranks.world_size
            restored = rng_per_rank[self.ranks.rank] if same_ranks else ckpt["rng"]
            set_rng_state(restored)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"{path}: cannot restore the training state ({e.__class__.__name__}: {str(e)[:100]})"
            ) from None
        if "validated_step" not in ckpt["state"]:  # saved before stop 54 (a collective: outside the try above)
            # rank 0 reads metrics.jsonl for every rank (stop 68's probe: under torchrun its step was taken)
            validated = self._validated_before_54() if self.ranks.is_main else None
            self.state.validated_step = self.comm.from_main(validated)
        check_below_max_steps(self.state.step, self.cfg, path)
        if not same_ranks and self.ranks.rank:
            torch.manual_seed(rank_seed(self.cfg.train.seed, self.ranks.rank, self.state.step))
        elif self.ranks.rank and self.device.type == "cuda" and "cuda" not in restored:
            # saved where there was no CUDA (ranks on CPUs, resumed on GPUs): every rank's CUDA
            # generator held train.seed, and all drew the same dropout masks (stop 63, by reading)
            torch.cuda.manual_seed(rank_seed(self.cfg.train.seed, self.ranks.rank, self.state.step))
        if self.state.world_size != self.ranks.world_size:
            # each rank consumed `batch` batches of its round-robin share: the plan's first
            # batch * old_world batches; continue after them (skipping fewer than world_size)
            st, old = self.state, self.state.world_size
            st.batch, st.world_size = -(-st.batch * old // self.ranks.world_size), self.ranks.world_size
            log.info("the run was trained on %d rank(s), continues on %d", old, self.ranks.world_size)
        saved, st, tc = ckpt["config"], self.state, self.cfg.train
        changes = config_changes(saved, self.cfg)
        changed = [f"{section}.{key}" for section, key in PLAN_KEYS if f"{section}.{key}" in changes]
        if ckpt.get("data_digest", self.data_digest) != self.data_digest:  # (stop 54: went on at the old position)
            changed.append("the training data")
        if self.pairs.synthetic is not None and not tc.diversify:  # (stop 53: they stayed in every later epoch)
            self.pairs.synthetic, st.diversified_epoch = None, -1
            self.resume_notes.append(
                (logging.INFO, "train.diversify=0: the model's translations of train are left out from here on")
            )
            changed.append("train.diversify")
        planned = st.epoch + (1 if st.batch else 0)  # epochs whose pairs are settled
        for key, count in (("bidirectional", st.both_ways_epochs), ("extra_sources", st.extra_source_epochs)):
            old = saved.get("train", {}).get(key)
            if isinstance(old, (int, float)) and getattr(tc, key) > old and count < planned and self.ranks.is_main:
                self.resume_notes.append(
                    (
                        logging.WARNING,
                        f"train.{key} raised on resume has no effect: its phase holds only the first epochs, "
                        f"and epoch {count} was trained without it",
                    )
                )
        if tc.diversify and not st.both_ways_epochs and planned:
            raise MtxError(
                f"{path}: train.diversify translates train both ways with the model, which this run never "
                "trained both ways (train.bidirectional from its first epoch); start a new run for it"
            )
        if changed and self.state.batch:
            # the rest of the epoch's plan under the new settings is not the rest of the old one:
            # it would give some pairs a second time this epoch and others not at all
            if self.ranks.is_main:
                self.resume_notes.append(
                    (
                        logging.WARNING,
                        f"{', '.join(changed)} changed in the middle of epoch {st.epoch}: training goes on from "
                        f"the start of epoch {st.epoch + 1}",
                    )
                )
            st.epoch, st.batch = st.epoch + 1, 0
        self.saved_step = self.state.step
        if self.ranks.is_main:  # (stop 65: only the Adam settings were logged; config.yaml holds the new values only)
            for key, (old, new) in changes.items():
                self.resume_notes.append(
                    (logging.INFO, f"{key}: {old!r} until step {self.state.step}, {new!r} from now on")
                )
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)", path, self.state.step, self.state.epoch, self.state.batch
        )

    def _validated_before_54(self) -> int:
        """The last step validated, for a last.pt of an mtx before stop 54, which did not keep it:
        the last "valid" record of metrics.jsonl up to last.pt's step. Such an mtx saved last.pt
        at any step when a signal stopped it (stop 67: that step was taken as validated, a save
        "cut short" was reported and an unvalidated step_N.pt made). Without a readable
        metrics.jsonl, last.pt's step, as before. Rank 0's under DDP (`_restore` sends it)."""
        step = self.state.step
        try:
            events = read_metrics(self.run_dir)
        except (MtxError, OSError):
            return step
        valid = [
            e["step"] for e in events if e.get("event") == "valid" and type(e.get("step")) is int and e["step"] <= step
        ]
        return max(valid, default=-1)

    def _trim_metrics(self) -> None:
        """Drop metrics logged after the restored step (they will be logged again), partial train
        records (their window goes on, `_log_window`) and torn lines."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step", 0) if isinstance(record, dict) else None
            if isinstance(record, dict) and record.get("partial") is True:
                continue
            if isinstance(step, (int, float)) and not isinstance(step, bool) and step <= self.state.step:
                kept.append(line + "\n")  # (a line without a numeric step goes, like a torn one)
        ckpt_io.atomic_write_text(path, "".join(kept))

    def _follow_run_dir(self) -> None:
        """Where the run directory was moved (renamed) while training, save in its new place from
        now on (stop 65: the next save made the old path again, with checkpoints alone, and the
        moved directory's last.pt stayed behind). Found through this process's open handle on
        the directory (`mtx train` holds its lock), where the system names it (Linux's /proc);
        otherwise, or where it was removed, an error."""
        try:
            now = os.stat(self.run_dir)
            if (now.st_dev, now.st_ino) == self.run_dir_id:
                return
        except OSError:
            pass
        moved = open_directory(self.run_dir_id)
        if moved is None:
            raise MtxError(
                f"{self.run_dir}: the run directory was removed or replaced while training, and where it went "
                f"cannot be found; its last.pt is from step {self.saved_step}"
            )
        log.warning("%s was moved to %s while training: the run is saved there from now on", self.run_dir, moved)
        self.run_dir = moved

    def _score(self, bleu: float) -> bool:
        """Take a validation's BLEU into the best and patience counts; True for a new best."""
        st = self.state
        new_best = bleu > st.best_bleu
        if new_best:
            st.best_bleu, st.best_step = bleu, st.step
        # (stop 62: a run's last validation between two of the cadence counted toward patience, so a
        # run trained in two parts stopped where a straight run of the same config trained on)
        if st.step % self.cfg.train.eval_every == 0:
            if bleu > st.patience_best_bleu:
                st.patience_best_bleu, st.evals_without_gain = bleu, 0
            else:
                st.evals_without_gain += 1
        return new_best

    def _save_step_files(self, which: Collection[str]) -> None:
        """A validated step's files beside last.pt, those of `which` ("step": step_N.pt, "ema":
        ema.pt, "best": best.pt, at a new best), and the pruning of older step checkpoints. All
        are made from the state that last.pt holds, and written after it, so that a save cut short
        (kill -9, a second Ctrl-C) leaves none of them ahead of last.pt; `_complete_step_files`
        makes what is missing on resume (stop 66: they were written first, and a resume that went
        another way kept a best.pt and step checkpoints of steps the run never reached)."""
        self._follow_run_dir()
        ckpts = ckpt_io.checkpoint_dir(self.run_dir)
        payload = self._payload(full=False)
        keep = self.cfg.train.keep_last
        if keep and "step" in which:
            ckpt_io.atomic_save(payload, ckpts / f"step_{self.state.step}.pt")
        # 0 keeps none: a run resumed with keep_last 0 kept its earlier step checkpoints, which
        # `mtx average` then averaged as if they were the run's last (stop 61)
        steps = ckpt_io.step_checkpoints(self.run_dir)
        for old in steps[:-keep] if keep else steps:
            old.unlink()
        if self.ema is not None and "ema" in which:
            ckpt_io.atomic_save(
                {**payload, "model": self.ema.model_state(), "ema_decay": self.ema.decay}, ckpts / "ema.pt"
            )
        if "best" in which:
            kept = ckpt_io.save_new_best(self.run_dir, payload)
            if kept is not None:
                log.info("best.pt held an average chosen after training; it is kept as %s", kept)

    def _complete_step_files(self) -> None:
        """On resume at a validated step: the files its validation writes after last.pt, by the
        settings it ran with, where a save cut short did not write them, made again from last.pt's
        state; step checkpoints of later steps (another course, cut short) go. A setting changed on
        resume (train.ema, keep_last) makes nothing here: its files come with the next validation."""
        st, ckpts = self.state, ckpt_io.checkpoint_dir(self.run_dir)
        ahead = [p for p in ckpt_io.step_checkpoints(self.run_dir) if ckpt_io.step_number(p) > st.step]
        for path in ahead:
            path.unlink()
        # an mtx before stop 66 wrote ema.pt first too: while the moving average goes on, it is written
        # again (now, or at the next validation); with train.ema now 0 it stays, as it would
        if self.ema is not None and (ckpt_io.saved_step(ckpts / "ema.pt") or 0) > st.step:
            ahead.append(ckpts / "ema.pt")
            (ckpts / "ema.pt").unlink()
        if ahead:
            names = ", ".join(p.name for p in ahead)
            log.warning("removed %s: saved after last.pt's step %d by a run cut short", names, st.step)
        best = ckpt_io.set_aside_best_ahead(self.run_dir, st.step, st.best_step)
        if best is not None:
            aside, earlier = best
            if earlier is not None:
                now = f"best.pt is {earlier.name} again"
            elif st.best_step == st.step == st.validated_step:
                now = "best.pt is made again from last.pt"
            else:
                now = f"the run's best so far (step {st.best_step}) was not kept: best.pt is made at its next best"
            log.warning(
                "best.pt was saved after last.pt's step %d by a run cut short: it is kept as %s, and %s",
                st.step,
                aside.name,
                now,
            )
        if st.validated_step != st.step or not st.step:
            return
        step_file = ckpts / f"step_{st.step}.pt"
        missing = {
            "step": self.saved_with["step"] and bool(self.cfg.train.keep_last) and not step_file.is_file(),
            "ema": self.saved_with["ema"] and self.ema is not None and ckpt_io.saved_step(ckpts / "ema.pt") != st.step,
            "best": st.best_step == st.step and ckpt_io.training_best_step(self.run_dir) != st.step,
        }
        names = {"step": step_file.name, "ema": "ema.pt", "best": "best.pt"}
        if any(missing.values()):
            made = ", ".join(names[key] for key, gone in missing.items() if gone)
            if ahead or best is not None:  # that course went on past this step, and its keep_last rotated
                # step_N.pt out (stop 67 review: "the save was cut short", of a save that was whole)
                log.warning("%s made again from last.pt's step %d: the run cut short went on past it", made, st.step)
            else:
                log.warning("the save of step %d was cut short after last.pt: %s made again from it", st.step, made)
            self._save_step_files([key for key, gone in missing.items() if gone])

    # -- one update ------------------------------------------------------------------------
    def _micro_batches(self) -> Iterator[list[Batch]]:
        """Groups of `accum_steps` batches, advancing epochs; state.epoch/batch track position."""
        tc = self.cfg.train
        group: list[Batch] = []
        while True:
            if tc.max_epochs and self.state.epoch >= tc.max_epochs:
                return
            started = self.clock.now()
            if self.state.batch == 0:
                self._plan_phases()
                self._plan_diversify()
            ids = self.pairs.of_epoch(self.state.epoch, self.state)
            plan = epoch_plan(ids, tc.batch_tokens, tc.seed, self.state.epoch)
            batches = epoch_batches(
                ids,
                tc.batch_tokens,
                tc.seed,
                self.state.epoch,
                self.state.batch,
                self.ranks.rank,
                self.ranks.world_size,
                plan=plan,
            )
            if tc.max_epochs:
                self.end_step = self._epochs_end(len(plan))
            # the epoch's setup (train.diversify's translations, a BPE-dropout segmentation): the
            # loop's time, but not training throughput (stop 63: a window with it logged 1,871
            # tgt tok/s between windows of 9,500)
            self.setup_seconds += self.clock.now() - started
            seen, whole_epoch = 0, self.state.batch == 0
            for batch in batches:
                group.append(batch)
                seen += 1
                if len(group) == tc.accum_steps:
                    self.state.batch += len(group)
                    yield group
                    group = []
            if whole_epoch and seen < tc.accum_steps:  # not one whole update (as checked at the start)
                pairs = len(self.pairs.of_epoch(self.state.epoch, self.state))
                raise MtxError(too_few_batches(pairs, seen, tc, self.ranks.world_size))
            if group:
                # an epoch's leftover micro-batches make one smaller update (stop 63: they were
                # dropped, up to accum_steps - 1 batches of every epoch never trained on); the loss
                # is normalised by the group's own target tokens, and resume stays exact (the
                # position is then the epoch's end)
                self.state.batch += len(group)
                yield group
                group = []
            self.state.epoch += 1
            self.state.batch = 0

    def _epochs_end_estimate(self) -> int | None:
        """About the step that train.max_epochs ends the run at (None without it, or reached): the
        epochs' length that of the longest epoch these settings make (the model's translations
        taken as long as train both ways until they are made), without BPE-dropout's longer
        segmentations. `_epochs_end` tells it exactly for each epoch as it starts."""
        tc, st = self.cfg.train, self.state
        if not tc.max_epochs or st.epoch >= tc.max_epochs:
            return None
        batches = epoch_length(self.pairs.longest(), tc.batch_tokens, tc.seed, st.epoch, self.ranks.world_size)
        return st.step + (tc.max_epochs - st.epoch) * -(-batches // tc.accum_steps)

    def _epochs_end(self, batches: int) -> int:
        """The step that train.max_epochs ends the run at (at most train.max_steps), from this
        epoch's `batches` (on all ranks), later epochs taken as long: the progress bar's end (stop
        68's probe: it counted to train.max_steps, "39/10000 [00:04<20:52]" in a run that ended 5 s
        after it started)."""
        tc, st = self.cfg.train, self.state
        per_rank = batches // self.ranks.world_size
        left = -(-(per_rank - st.batch) // tc.accum_steps)  # an epoch's leftover batches: one more update
        later = (tc.max_epochs - st.epoch - 1) * -(-per_rank // tc.accum_steps)
        return min(tc.max_steps, st.step + left + later)

    def _plan_phases(self) -> None:
        """At the start of an epoch: whether it still trains both ways (train.bidirectional; BiT,
        Ding et al., 2021) and on the extra source languages (train.extra_sources)."""
        st, tc, data = self.state, self.cfg.train, self.cfg.data
        st.both_ways_epochs = self._phase_end(
            tc.bidirectional, st.both_ways_epochs, "train.bidirectional", f"{data.src_lang}->{data.tgt_lang} only"
        )
        st.extra_source_epochs = self._phase_end(
            tc.extra_sources,
            st.extra_source_epochs,
            "train.extra_sources",
            f"no {'/'.join(data.extra_src_langs)} sources",
        )

    def _phase_end(self, fraction: float, epochs: int, key: str, after: str) -> int:
        """The number of first epochs a phase covers (`epochs` so far): the current epoch joins it
        while every earlier epoch did and less than `fraction` of the budget is used. The counts
        are part of the state, so a resume replays the epoch."""
        st = self.state
        if not fraction or epochs < st.epoch:
            return epochs
        used = budget_used(st.step, self.cfg.train, st.elapsed)
        if self.comm.flag_from_main(used < fraction):  # ranks' clocks differ
            return st.epoch + 1
        if self.ranks.is_main:  # the share used, not the fraction: a phase holds whole epochs (stop 65)
            log.info(
                "epoch %d: %s from here on (%s=%g; %.2f of the budget used at step %d)",
                st.epoch,
                after,
                key,
                fraction,
                used,
                st.step,
            )
        return epochs

    def _plan_diversify(self) -> None:
        """At the start of an epoch: with train.diversify, once that fraction of the budget is
        used, the model translates train both ways, and this epoch and every later one add the
        synthetic pairs to the real ones (data diversification, Nguyen et al., 2020). The pairs
        are made by all ranks together (`_translate_train`) and saved in last.pt, so a resume
        reuses them."""
        st, tc = self.state, self.cfg.train
        if not tc.diversify or st.diversified_epoch >= 0:
            return
        if not self.comm.flag_from_main(budget_used(st.step, tc, st.elapsed) >= tc.diversify):
            return
        self.pairs.synthetic, st.diversified_epoch = self._translate_train(), st.epoch

    @torch.no_grad()
    def _translate_train(self) -> ParallelIds:
        """(src, its translation) and (tgt's back-translation, tgt) for every training pair:
        greedy, with the moving average's weights when train.ema keeps one. Empty outputs and
        outputs longer than data.max_len are left out.

        Under DDP every rank translates every world_size-th sentence with rank 0's teacher (the
        moving average lives on rank 0) and all ranks put the translations together in order."""
        start = time.perf_counter()
        world = self.ranks.world_size
        teacher = self.model
        if self.cfg.train.ema:
            teacher = copy.deepcopy(self.model)
            if self.ema is not None:  # rank 0
                teacher.load_state_dict(self.ema.model_state())
            if world > 1:  # in place: a state_dict's tensors are the module's own
                for tensor in teacher.state_dict().values():
                    dist.broadcast(tensor, src=0)
        dc, real = self.cfg.decode, self.pairs.train_ids
        limit = self.cfg.data.max_len

        def greedy(sentences: list[list[int]]) -> list[list[int]]:
            share = sentences[self.ranks.rank :: world]
            hyps = translate_ids(
                teacher, share, 1, 0.0, dc.max_len_a, dc.max_len_b, dc.batch_tokens, workers=dc.workers
            )
            return self.comm.in_order([h[0].tokens for h in hyps], len(sentences))

        def kept(outputs: list[list[int]]) -> list[int]:
            return [i for i, out in enumerate(outputs) if 0 < len(out) <= limit]

        forward, backward = greedy(real.src_ids), greedy(real.tgt_ids)
        fwd, bwd = kept(forward), kept(backward)
        synthetic = ParallelIds(
            [real.src_ids[i] for i in fwd] + [backward[i] for i in bwd],
            [forward[i] for i in fwd] + [real.tgt_ids[i] for i in bwd],
        )
        log.info(
            "epoch %d, step %d: %d forward and %d backward translations of train added (train.diversify=%g), "
            "made in %.0f s",
            self.state.epoch,
            self.state.step,
            len(fwd),
            len(bwd),
            self.cfg.train.diversify,
            time.perf_counter() - start,
        )
        return synthetic

    def train_step(self, group: list[Batch]) -> tuple[float, int, bool]:
        """Forward/backward over the micro-batches, then one optimizer update.

        Under DDP the gradient equals the single-process gradient of all ranks' batches put
        together: each rank's summed loss is divided by the step's target tokens over all ranks
        divided by the number of ranks, since DDP averages the ranks' gradients. Only the last
        micro-batch's backward all-reduces; the others accumulate locally (`no_sync`).

        Returns (mean loss per target token, target tokens, whether the update was applied),
        both over all ranks."""
        tc = self.cfg.train
        world = self.ranks.world_size
        self.model.train()
        if tc.dropout_warmup:
            set_dropout(self.model, dropout_rate(self.state.step + 1, tc, self.cfg.model.dropout))
        # rank 0's training time too, for every rank: the linear schedule's rate reads it, and the
        # ranks' clocks differ (stop 66: each rank set its own rate, and the replicas drifted apart)
        own_elapsed = self.state.elapsed if self.ranks.is_main else 0.0
        n_tokens, elapsed = self.comm.sum([sum(b.n_tgt_tokens for b in group), own_elapsed])
        self.state.elapsed = elapsed
        tokens_per_rank = n_tokens / world
        total = 0.0
        for i, batch in enumerate(group):
            batch = batch.to(self.device)
            if tc.word_dropout or tc.tgt_word_dropout:
                src, tgt_in = drop_words(batch.src, tc.word_dropout), drop_words(batch.tgt_in, tc.tgt_word_dropout)
                batch = replace(batch, src=src, tgt_in=tgt_in)
            accumulate = world > 1 and i < len(group) - 1
            with self.loss_module.no_sync() if accumulate else nullcontext():  # type: ignore[operator]
                with autocast(self.device, self.amp):
                    loss = self.loss_module(batch)
                self.scaler.scale(loss / tokens_per_rank).backward()
            total += loss.item()
        total = self.comm.sum([total])[0]
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm or float("inf"))
        finite = math.isfinite(total) and bool(torch.isfinite(grad_norm))
        # fp16's loss scaler tries a larger scale every so often and skips the update that then
        # overflows: its own working, not a fault (stop 68's probe: warned of as non-finite, and
        # counted toward train.max_bad_steps), while the scale stays above fairseq's floor, 1e-4,
        # below which the gradients themselves are not finite
        scaled = self.scaler.is_enabled() and self.scaler.get_scale() >= 2e-4
        self.scale_overflow = not finite and math.isfinite(total) and scaled
        for g in self.optimizer.param_groups:
            g["lr"] = learning_rate(self.state.step + 1, tc, self.cfg.model.d_model, self.state.elapsed)
        self.updating = True  # from here an allocation that fails leaves the weights half-updated
        if finite or self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # the fp16 scaler itself skips non-finite steps
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if finite and self.ema is not None:
            self.ema.update()
        self.updating = False
        return total / n_tokens, int(n_tokens), finite

    # -- validation ------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float] | None:
        """Teacher-forced val loss (no smoothing) and greedy val BLEU/chrF as `mtx eval` scores.

        Under DDP every rank takes every world_size-th val sentence, and rank 0 gathers the
        translations in order and scores them: the ranks share the work instead of waiting for
        rank 0, and BLEU is the same as one process's (a sentence's translation does not depend on its batch); the
        loss sums are added up. Rank 0 gets the scores, the other ranks None."""
        self.model.eval()
        world = self.ranks.world_size
        share = slice(self.ranks.rank, None, world)
        loss_sum, n_tokens = 0.0, 0
        rows = self.valid_loss_rows[share]
        for indices in plan_batches(
            self.valid_ids.src_lens[rows], self.valid_ids.tgt_lens[rows], self.cfg.train.batch_tokens
        ):
            batch = self.valid_ids.batch(rows[indices]).to(self.device)
            with autocast(self.device, self.amp):
                loss_sum += label_smoothed_loss(self.model, batch, 0.0).item()
            n_tokens += batch.n_tgt_tokens
        dc = self.cfg.decode
        src_ids = self.valid_ids.src_ids
        # cut as translate cuts them, without its warning at every validation and for each rank's
        # share (stop 66); setting up said how many pairs are longer
        limit = self.cfg.model.max_positions - 1
        text = translate(
            self.model,
            self.tgt_tok,
            [s[:limit] for s in src_ids[share]],
            1,
            dc.length_penalty,
            dc.max_len_a,
            dc.max_len_b,
            dc.batch_tokens,
            workers=dc.workers,
        )
        loss_sum, n_tokens = self.comm.sum([loss_sum, n_tokens])
        text = self.comm.in_order(text, len(src_ids))
        if not self.ranks.is_main:
            return None
        scores = corpus_scores(text, self.valid_refs)
        return {"val_loss": loss_sum / n_tokens, "val_bleu": scores.bleu, "val_chrf": scores.chrf}

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, stop: StopRequest | None = None) -> TrainState:
        """Train to train.max_steps (or max_epochs, max_minutes, patience).

        A stop signal saves last.pt and raises Interrupted.

        Under DDP every rank runs this loop in step: the same number of batches per epoch, the
        stop signal agreed at each step, validation shared out and scored on rank 0."""
        if stop is None:
            with StopRequest() as own:
                return self.fit(own)
        try:
            with self.clock:
                return self._fit(stop)
        except DecodeOutOfMemory as e:
            # validation's decoding (the last one's too) or train.diversify's (stop 68's probe:
            # "lower --batch-tokens", which `mtx train` refuses, and nothing on what was kept)
            saved = self.saved_step
            kept = f"last.pt from step {saved} is kept" if saved is not None else "nothing was saved"
            advice = memory_advice("lower decode.batch_tokens", self.device)
            raise MtxError(
                f"{e.where}, after step {self.state.step}; {advice}; {kept}. "
                f"Resume with: {self._resume_command()} --set decode.batch_tokens=N"
            ) from None
        except KeyboardInterrupt:
            if stop.signal is None:
                raise
            # a second signal: at once, without saving (stop 66: "mtx: interrupted" followed the
            # first signal's "saving a checkpoint and stopping", with nothing on what was kept)
            first, second = (signal.Signals(s).name for s in (stop.signal, stop.second or stop.signal))
            which = f"a second {first}" if second == first else f"{second} after {first}"
            kept = f"last.pt is from step {self.saved_step}" if self.saved_step is not None else "nothing was saved"
            raise Interrupted(
                f"training stopped at once by {which}, without saving; {kept}. Resume with: {self._resume_command()}",
                stop.second or stop.signal,
                report=self.ranks.is_main,
            ) from None

    def _fit(self, stop: StopRequest) -> TrainState:
        """`fit`'s work, a second stop signal aside."""
        tc = self.cfg.train
        st = self.state
        limit, done = self._begin_session()
        if done:
            return st
        self._log_setup(limit)
        metrics = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8") if self.ranks.is_main else None
        self.end_step = min(tc.max_steps, self._epochs_end_estimate() or tc.max_steps)
        bar = self._progress_bar()
        window_start = self.clock.now()  # of this session's part of the log window (st.window_*)
        self._logged_step = -1  # of this session's last train record (`_log_window`)
        last_time = self.clock.now()
        stop_reason = f"reached train.max_steps={tc.max_steps}" if limit is None else f"reached {limit}"
        before: tuple[int, int, dict[str, Any]] | None = None
        try:
            groups = self._micro_batches()
            # a limit already reached (a stop between validations, resumed with its limit at or
            # below what it used) trains no step: only that step's validation is left (stop 55:
            # a used train.max_minutes trained one more step, checked after it)
            while st.step < tc.max_steps and limit is None:
                self._stop_if_signalled(stop, window_start)
                group = next(groups, None)
                window_start += self.setup_seconds  # `_micro_batches`' epoch setup left out of the window
                self.setup_seconds = 0.0
                if group is None:
                    stop_reason = f"reached train.max_epochs={tc.max_epochs}"
                    break
                # where the step starts, for last.pt if it runs out of memory before its update: inside
                # an epoch, whose setup (`_micro_batches`) is done and drew nothing since the last step
                inside = self.ranks.world_size == 1 and st.batch > len(group)
                before = (st.epoch, st.batch - len(group), rng_state()) if inside else None
                loss, tokens, applied = self.train_step(group)
                before = None
                now = self.clock.now()
                st.elapsed += now - last_time
                last_time = now
                if not applied:
                    self._skip_update()
                    continue
                st.bad_steps_in_row = 0
                st.step += 1
                st.window_tokens += tokens
                st.window_loss += loss
                st.window_steps += 1
                if bar.total != self.end_step:  # (train.max_epochs: its estimate, made again each epoch)
                    bar.total = self.end_step
                bar.update(1)
                if st.step % tc.log_every == 0 or st.step == tc.max_steps:
                    seconds = st.window_seconds + self.clock.now() - window_start
                    if self._log_window(seconds, bar, metrics, partial=st.step % tc.log_every != 0):
                        window_start = self.clock.now()
                at_eval = st.step % tc.eval_every == 0 or st.step == tc.max_steps
                if at_eval:
                    st.window_seconds += self.clock.now() - window_start  # saved with last.pt
                    out_of_patience = self._evaluate(metrics)
                    now = self.clock.now()
                    st.elapsed += now - last_time  # validating and saving are the loop's time (max_minutes)
                    window_start = now  # but not training throughput (tgt_tok_per_s)
                    last_time = now
                    if out_of_patience:
                        stop_reason = f"no val BLEU gain in {tc.patience} evaluations (train.patience)"
                        break
                if self._out_of_time():
                    stop_reason = f"used the time budget train.max_minutes={tc.max_minutes:g}"
                    break
            st.window_seconds += self.clock.now() - window_start  # a later resume's first window
            if st.window_steps and self._logged_step != st.step:  # a stop between train records logs its last steps
                self._log_window(st.window_seconds, bar, metrics, partial=True)
            if st.validated_step != st.step:  # stopped between validations
                self._evaluate(metrics)
                st.elapsed += self.clock.now() - last_time
        except RuntimeError as e:
            if out_of_memory(e):
                raise self._out_of_memory_error(e, before, window_start) from None
            if self.ranks.world_size > 1 and _peer_lost(e):
                raise self._peer_lost_error(e) from None
            raise
        finally:
            bar.close()
            if metrics is not None:
                with named_os_errors(metrics.name):
                    metrics.close()
        with self._peer_lost_said():  # (stop 66: rank 0 failing in the last validation's files left rank 1 here)
            self.save()
        if stop.signal is not None:  # it came in the last step or validation: nothing was left to stop
            log.info("%s came as the run was ending: it is complete", signal.Signals(stop.signal).name)
        log.info(
            "done: %s, at step %d; best val BLEU %.2f at step %d; %.0f s of training",
            stop_reason,
            st.step,
            st.best_bleu,
            st.best_step,
            st.elapsed,
        )
        return st

    def _begin_session(self) -> tuple[str | None, bool]:
        """Save a new run's first last.pt or take up a resumed run: (limit reached already, nothing left to do)."""
        st = self.state
        if not self.resumed:
            with self._peer_lost_said():  # (stop 68's probe: rank 0 failing to write it left gloo's traceback here)
                self.save()  # from here on the run can always be resumed
            return None, False
        if self.ranks.is_main:
            self._complete_step_files()
        limit = self._limit_reached()
        # nothing to train: a repeated validation would count toward patience; but a run stopped
        # between validations, resumed with its limit lowered to where it stopped, validates that
        # step as an ending run does (stop 54: no best.pt, and a best val BLEU of -1.0 printed)
        if limit is not None and st.validated_step == st.step:
            kept = " (the --set changes were not applied: the run keeps its config.yaml)" if self.resume_notes else ""
            log.info("done: the run already reached %s, at step %d; raise it to train on%s", limit, st.step, kept)
            return limit, True
        for level, note in self.resume_notes:
            log.log(level, note)
        if self.ranks.is_main:  # the --set changes, recorded once they take effect (stop 55: also where
            # nothing was left to train, which changes no file but train.log); metrics.jsonl first,
            # whose records past last.pt's step are logged again anyway
            self._trim_metrics()  # likewise (stop 56: it dropped the partial record of such a run)
            ckpt_io.atomic_write_text(self.run_dir / ckpt_io.CONFIG_FILE, config_text(self.cfg))
        return limit, False

    def _log_setup(self, limit: str | None) -> None:
        """Say what the session trains, and how (`limit`: one a resumed run has reached already)."""
        tc, train_ids = self.cfg.train, self.pairs.train_ids
        pad = padding_fraction(train_ids, plan_batches(train_ids.src_lens, train_ids.tgt_lens, tc.batch_tokens))
        n_params = sum(p.numel() for p in self.model.parameters())
        precision = str(self.amp).replace("torch.", "") if self.amp else "fp32"
        if tc.amp == "auto" and self.device.type == "cpu" and devices.cpu_bf16_speedup() > 0:
            # a resumed run keeps its precision: the timing no longer chose it (stop 55: "bf16 (... 0.82x
            # as fast as fp32)" read as a choice against the timing)
            why = "as the run was trained; " if self.amp_resumed else ""
            speed = f"bf16 products {devices.cpu_bf16_speedup():.2f}x as fast as fp32 on this CPU"
            if self.bf16_step is not None:
                speed += f", this model's training pass {self.bf16_step:.2f}x"
            precision += f" (train.amp auto: {why}{speed})"
        log.info(
            "device %s, precision %s, %d parameters, %d training pairs, %d val sentences, padding %.1f%%",
            self.device,
            precision,
            n_params,
            len(train_ids),
            len(self.valid_ids),
            100 * pad,
        )
        if tc.bidirectional and budget_used(self.state.step, tc, self.state.elapsed) < tc.bidirectional:
            log.info(  # (stop 65: the log said 29,000 pairs, and nothing of the reversed ones before the phase ended)
                "train.bidirectional=%g: epochs train %s->%s too, twice the pairs, until %g of the budget is used",
                tc.bidirectional,
                self.cfg.data.tgt_lang,
                self.cfg.data.src_lang,
                tc.bidirectional,
            )
        if (
            tc.amp == "bf16" and self.amp == torch.bfloat16 and (how := slow_bf16(self.device))
        ):  # (stop 57: 9.5x, Zen 3)
            log.warning("bf16 products run %s on this CPU: train.amp fp32 trains faster", how)
        if self.ranks.world_size > 1:
            log.info(
                "DDP over %d ranks (%s): train.batch_tokens=%d per rank, x %d ranks x %d accum_steps per update",
                self.ranks.world_size,
                dist.get_backend(),
                tc.batch_tokens,
                self.ranks.world_size,
                tc.accum_steps,
            )
        if self.ranks.is_main and limit is None:
            self._warn_of_settings()

    def _progress_bar(self) -> Any:
        """The session's bar of steps, from the state's step to `end_step` (none on rank > 0)."""
        tc, st = self.cfg.train, self.state
        return progress_bar(
            (lambda: 60 * tc.max_minutes - st.elapsed) if tc.max_minutes else None,
            total=self.end_step,
            initial=st.step,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            # None: no bar where stderr is not a terminal (`nohup`, `> log 2>&1`: stop 63, the bar's
            # carriage-return updates filled such a log, one a second); a line per log window instead,
            # as on a terminal that reports no width (stop 66: `script`'s, some containers'), where
            # tqdm drew a bar 0 characters wide and the run showed no progress at all
            disable=None if self.ranks.is_main and not zero_width_terminal(sys.stderr) else True,
            file=UntilReaderGone(sys.stderr),
        )

    def _stop_if_signalled(self, stop: StopRequest, window_start: float) -> None:
        """Where any rank received a stop signal: last.pt saved, and Interrupted raised on every rank."""
        st = self.state
        signum = self.comm.largest(stop.signal or 0) or None  # any rank's, agreed by all
        if signum is None:
            return
        st.window_seconds += self.clock.now() - window_start
        self.save()
        again = self._resume_command()
        raise Interrupted(
            f"training stopped by {signal.Signals(signum).name} at step {st.step}; "
            f"checkpoint saved. Resume with: {again}",
            signum,
            report=self.ranks.is_main,
        )

    def _skip_update(self) -> None:
        """Count a step whose update was skipped (fp16's scaler, or non-finite: train.max_bad_steps in a row stop)."""
        st = self.state
        st.skipped_steps += 1
        if self.scale_overflow:
            if self.ranks.is_main:
                scale = self.scaler.get_scale()
                log.info("fp16 loss scale lowered to %g after step %d: its update skipped", scale, st.step)
            return
        st.bad_steps_in_row += 1
        if self.ranks.is_main:  # (stop 66: once per rank)
            log.warning("non-finite loss or gradient after step %d: update skipped", st.step)
        if st.bad_steps_in_row >= self.cfg.train.max_bad_steps:
            error = MtxError(
                f"{st.bad_steps_in_row} non-finite steps in a row after step {st.step} "
                f"(train.max_bad_steps); training stopped, checkpoints/last.pt from step "
                f"{self.saved_step} kept; lower train.lr" + (" or use train.amp=fp32" if self.amp is not None else "")
            )  # (stop 64: fp32 was advised to runs already in fp32)
            error.report = self.ranks.is_main  # every rank stops alike (stop 68's probe: once each)
            raise error

    def _out_of_memory_error(
        self, error: RuntimeError, before: tuple[int, int, dict[str, Any]] | None, window_start: float
    ) -> MtxError:
        """The one-line error for a step out of memory; last.pt saved first where `before` says where it began."""
        # (stop 63: a batch too large for the device was a 30-line traceback, with no word
        # on what to lower; one can come thousands of steps in, as batches differ in length)
        st, tc = self.state, self.cfg.train
        after, saved = "", False
        if before is not None and not self.updating:
            st.window_seconds += self.clock.now() - window_start
            error.__traceback__ = None  # the failed step's tensors go before last.pt is written
            saved = self._save_before_step(*before)
            if self.saved_step == st.step:  # inside epoch st.epoch: a new plan skips its rest
                # (stop 65: unsaid, and the position just saved was lost to it)
                after = (
                    f" (a new batch size makes a new plan of batches: the run goes on from epoch "
                    f"{st.epoch + 1}, the rest of epoch {st.epoch} not trained on)"
                )
        if saved:
            kept = f"last.pt saved at step {st.step}"
        elif self.saved_step is not None:
            kept = f"last.pt from step {self.saved_step} is kept"
        else:
            kept = "no last.pt was saved yet"
        return MtxError(
            f"out of memory on {self.device} after step {st.step} "
            f"(train.batch_tokens={tc.batch_tokens}); {memory_advice(_LOWER_BATCH, self.device)}; {kept}. "
            f"Resume with: {self._resume_command()} --set train.batch_tokens=N{after}"
        )

    def _peer_lost_error(self, error: BaseException) -> MtxError:
        """The one line for a collective that failed because another rank's process ended (stop
        62: rank 0 printed gloo's 28-line traceback, and nothing on what was kept)."""
        if self.saved_step is None:  # (in step 0's save: nothing to resume)
            return MtxError(f"another process of this torchrun job ended ({_first_line(error)}); nothing was saved")
        if not self.run_dir.exists():
            # moved while training: rank 0 followed it, and this rank cannot tell where (stop 68's
            # probe: the command named the old path, "run directory not found" when pasted)
            return MtxError(
                f"another process of this torchrun job ended ({_first_line(error)}); {self.run_dir} was moved "
                f"while training, and the run is kept where it went, as last.pt saved it at step {self.saved_step}. "
                f"Resume with that directory in: {self._resume_command()}"
            )
        return MtxError(
            f"another process of this torchrun job ended ({_first_line(error)}); the run is kept as "
            f"last.pt saved it at step {self.saved_step}. Resume with: {self._resume_command()}"
        )

    def _warn_of_settings(self) -> None:
        """Say once, as training starts, where settings train otherwise than they read: a dropout
        ramp that falls, and a budget fraction (train.schedule linear, the phases) counted of
        train.max_steps in a run that train.max_epochs ends first (`_epochs_end_estimate`)."""
        tc, st = self.cfg.train, self.state
        final = self.cfg.model.dropout
        if tc.dropout_warmup > 1 and tc.dropout_start > final and st.step < tc.dropout_warmup:
            # (stop 65: annealing may be meant, but the ramp is documented as rising; no word was said)
            log.warning(
                "train.dropout_start %g is above model.dropout %g: the dropout rate falls from %g to %g over "
                "the first %d updates (train.dropout_warmup) rather than rising",
                tc.dropout_start,
                final,
                tc.dropout_start,
                final,
                tc.dropout_warmup,
            )
        fractions = [
            name
            for name, on in (
                ("train.schedule linear", tc.schedule == "linear"),
                (f"train.bidirectional={tc.bidirectional:g}", tc.bidirectional > 0),
                (f"train.extra_sources={tc.extra_sources:g}", tc.extra_sources > 0),
                (f"train.diversify={tc.diversify:g}", tc.diversify > 0),
            )
            if on
        ]
        steps = self._epochs_end_estimate()
        if steps is None or not fractions:
            return
        if steps < tc.max_steps:  # (stop 65: a linear rate ended such a run at 0.96 of its peak, unsaid)
            effects = ["the rate does not decay to zero"] if tc.schedule == "linear" else []
            effects += ["a phase may cover every epoch"] if len(fractions) > len(effects) else []
            log.warning(
                "train.max_epochs=%d ends the run by about step %d, before train.max_steps=%d, the budget of %s: "
                "%s; set train.max_steps to about the run's length",
                tc.max_epochs,
                steps,
                tc.max_steps,
                " and ".join(fractions),
                " and ".join(effects),
            )

    def _save_before_step(self, epoch: int, batch: int, rng: dict[str, Any]) -> bool:
        """After a step ran out of memory before its update: last.pt as it stood before the step,
        its batches and random states too, so that a resume with nothing changed goes on as if the
        step had not failed (stop 65: last.pt stayed at the last validation, up to
        train.eval_every steps behind). Whether it was saved (a failure is a warning)."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.state.epoch, self.state.batch = epoch, batch
        set_rng_state(rng)
        try:
            self.save()
        except (MtxError, OSError, RuntimeError) as e:
            log.warning("could not save last.pt after running out of memory: %s", _first_line(e))
            return False
        return True

    def _log_window(self, seconds: float, bar: Any, metrics: Any, partial: bool = False) -> bool:
        """Write the train record of the steps since the last one (their `seconds` of training) to
        metrics.jsonl and the progress bar; True where it starts a new window.

        A `partial` record (a run's last steps, short of `train.log_every`) leaves its window open
        in last.pt and is marked so: a resume drops it (`_trim_metrics`) and logs the whole
        window where a straight run does, so that both logs are the same (stop 56: a resume of a
        run stopped at step 20 with log_every 7 logged steps 20 and 21 for the straight run's 21)."""
        st = self.state
        record = {
            "event": "train",
            "step": st.step,
            "epoch": self._trained_epoch(),
            "loss": st.window_loss / st.window_steps,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tgt_tok_per_s": st.window_tokens / seconds,
            "elapsed_s": st.elapsed,
            "skipped_steps": st.skipped_steps,
            **({"partial": True} if partial else {}),
        }
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tgt_tok_per_s']:.0f}")
        if self.ranks.is_main:  # in train.log; on standard error where no bar shows it (stderr not a terminal)
            log.info(  # (stop 68's probe: a run started on a terminal left a train.log without them)
                "step %d/%d: loss %.3f, lr %.2e, %.0f tgt tok/s",
                st.step,
                self.end_step,
                record["loss"],
                record["lr"],
                record["tgt_tok_per_s"],
                extra={"file_only": not bar.disable},
            )
        append_record(metrics, record)
        self._logged_step = st.step  # (a partial record leaves the window open)
        if partial:
            return False
        st.window_steps, st.window_loss, st.window_tokens, st.window_seconds = 0, 0.0, 0, 0.0
        return True

    def _trained_epoch(self) -> int:
        """The epoch of the last step trained, for its records: at an epoch's first batch (0) the
        position is past the end of the epoch before (stop 65: a run ended by train.max_epochs=2
        logged its last steps and validation under epoch 2, which never ran)."""
        st = self.state
        return st.epoch - 1 if st.batch == 0 and st.epoch > 0 else st.epoch

    def _limit_reached(self) -> str | None:
        """The limit a resumed run had already reached (it trains no further), if any."""
        tc, st = self.cfg.train, self.state
        if st.step >= tc.max_steps:
            return f"train.max_steps={tc.max_steps}"
        if tc.max_epochs and st.epoch >= tc.max_epochs:
            return f"train.max_epochs={tc.max_epochs}"
        if tc.max_minutes and st.elapsed >= 60 * tc.max_minutes:
            return f"train.max_minutes={tc.max_minutes:g}"
        if tc.patience and st.evals_without_gain >= tc.patience:
            return f"train.patience={tc.patience} (no val BLEU gain in its last {st.evals_without_gain} evaluations)"
        return None

    def _out_of_time(self) -> bool:
        """True once the loop has used train.max_minutes (rank 0's clock, asked every log_every steps under DDP)."""
        budget = self.cfg.train.max_minutes
        if not budget or (self.ranks.world_size > 1 and self.state.step % self.cfg.train.log_every):
            return False
        return self.comm.flag_from_main(self.state.elapsed >= 60 * budget)

    def _resume_command(self) -> str:
        """The command that continues this run as it was started: under torchrun, torchrun with as
        many processes, since `train.batch_tokens` counts per process (stop 62: the plain command
        printed for a torchrun job went on in one process, each update with half the tokens)."""
        resume = ("train", "--run-dir", self.run_dir, "--resume")
        world = self.ranks.world_size
        if world == 1:
            return command_line(*own_command(), *resume)
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:  # one machine
            return command_line(*torchrun_command(), "--standalone", "--nproc_per_node", world, "-m", "mtx", *resume)
        return f"torchrun as this job was started ({world} processes) -m mtx {command_line(*resume)}"

    def _evaluate(self, metrics: Any) -> bool:
        """Validate, log, save step/best/last checkpoints; True when patience ran out.

        Every rank validates its share (`validate`); rank 0 scores, logs and saves, and the
        others wait for its patience verdict."""
        st = self.state
        out_of_patience = new_best = False
        st.validated_step = st.step
        result = self.validate()
        if result is not None:  # rank 0
            epoch = self._trained_epoch()
            record = {"event": "valid", "step": st.step, "epoch": epoch, **result, "elapsed_s": st.elapsed}
            new_best = self._score(result["val_bleu"])
            record["best_bleu"] = st.best_bleu
            message = (
                f"step {st.step}: val loss {result['val_loss']:.3f}, val BLEU {result['val_bleu']:.2f} "
                f"(best {st.best_bleu:.2f} at step {st.best_step})"
            )
            log.info(message)
            append_record(metrics, record)
            out_of_patience = bool(self.cfg.train.patience) and st.evals_without_gain >= self.cfg.train.patience
        out_of_patience = self.comm.flag_from_main(out_of_patience)
        self.save()
        if result is not None:
            self._save_step_files(["step", "ema", "best"] if new_best else ["step", "ema"])
        return out_of_patience


def _thread_count(threads: int) -> int:
    """`train.threads`, at most the CPUs here: more only slows training, and a few thousand crash
    OpenMP. A config moves between machines, so a larger value is a warning, not an error."""
    cpus = usable_cpus()
    if threads > cpus:
        log.warning("train.threads=%d is more than the %d CPUs here: training uses %d threads", threads, cpus, cpus)
    return min(threads, cpus)


def fit(cfg: Config, run_dir: Path, resume: bool = False) -> tuple[TrainState, Path]:
    """Train the config into `run_dir` (resuming from its last.pt when asked). Returns the final
    state and where the run is now: `run_dir`, or its new place where it was moved while training.

    The run directory, device, precision and data are checked before anything is written.
    Under torchrun (WORLD_SIZE > 1) every process runs this with the same arguments and trains
    one DDP replica; rank 0 alone writes the run directory and logs."""
    ranks = Ranks.from_env()
    devices.stop_with_launcher()  # (a torchrun killed: its ranks stop too)
    # the device first: `train.device: cuda` on a machine without CUDA started the whole Multi30k
    # download before it was refused (stop 62)
    device = rank_device(cfg.train.device, ranks)
    amp_dtype(device, cfg.train.amp)
    cfg = resolve_config(cfg)  # on resume too: a --set data.dir is recorded as the directory used
    if ranks.is_main and run_dir.is_dir():  # in use: said first, before what its state would say
        with ckpt_io.run_dir_lock(run_dir):
            pass
    check_run_dir(run_dir, resume)
    existed = run_dir.is_dir()
    new_dir = not resume and not (existed and any(run_dir.iterdir()))  # this call writes all it holds
    failed_start = False
    if not resume:
        source = init_source(cfg)  # a bad train.init_from is an error before anything is written
        if source is not None:  # recorded as the checkpoint it is: a relative path in config.yaml was
            # another run's, or none, once the config was used from another directory
            cfg = replace(cfg, train=replace(cfg.train, init_from=str(source[1])))
    data_dir = Path(cfg.data.dir)  # resolved above
    mtx_log = logging.getLogger("mtx")
    early = HeldWarnings()  # the data's warnings, for train.log once it is open (stop 62: lost there)
    mtx_log.addHandler(early)
    try:
        corpus = load_corpus(data_dir, cfg.data, [cfg.data.train_split, cfg.data.valid_split])
        extra_texts = extra_source_texts(data_dir, cfg.data)  # like the corpus: read before anything is written
    finally:
        mtx_log.removeHandler(early)
    if ranks.world_size > 1:
        start_process_group(device, ranks)
    level = mtx_log.level
    handler = None
    last = None  # the run's last.pt on resume, read by rank 0 to check the --set changes
    # the stop signals are caught from here to the end, cleanup included: a stop during setup stops
    # at once (nothing to save yet), one during training at the next step, after saving last.pt
    with StopRequest(announce=ranks.is_main) as stop, ExitStack() as held:
        # while setting up, a signal stops at once (stop 66: one before the Trainer was made was
        # only flagged: the tokenizer trained and step 0 was saved before the run stopped)
        stop.at_once = True
        setting_up = True
        try:
            barrier(ranks, device)  # every rank has checked the run directory before rank 0 writes to it
            if ranks.is_main:
                # the run directory and those above it that this start makes: a failed start removes them
                held.enter_context(parent_directories(run_dir / ckpt_io.CONFIG_FILE))
                held.enter_context(ckpt_io.run_dir_lock(run_dir))  # until training ends, its cleanup included
                try:  # a new run's config.yaml not written: the tokenizer copied for init_from went with it
                    refs = read_lines(split_file(data_dir, cfg.data.valid_split, cfg.data.tgt_lang), as_scored=True)
                    val = val_digest(cfg, *texts(corpus[cfg.data.valid_split]), refs)
                    last = prepare_run_dir(run_dir, cfg, resume, val)
                except BaseException:  # (stop 59: it stayed, and the next start refused the directory)
                    failed_start = new_dir
                    raise
                handler = RunLog(run_dir / "train.log")
                handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
                logging.getLogger().addHandler(handler)
                for record in early.records:
                    handler.handle(record)
            else:
                mtx_log.setLevel(logging.WARNING)  # rank 0 reports for the job
            try:
                trainer = Trainer(cfg, run_dir, resume, corpus, ranks, extra_texts, last)
                del last  # the whole checkpoint, optimizer state included: not held while training
            except BaseException as e:  # a setup error (bad data for this config), or a stop: leave no half-made run
                failed_start = new_dir and ranks.is_main
                if isinstance(e, RuntimeError) and ranks.world_size > 1 and _peer_lost(e):
                    # rank 0 refused the resume, say, and ended (stop 68's probe: gloo's 30-line traceback here)
                    raise MtxError(
                        f"another process of this torchrun job ended while setting up ({_first_line(e)}); "
                        "its error says why"
                    ) from None
                raise
            finally:
                stop.at_once = False
            setting_up = False
            try:
                return trainer.fit(stop), trainer.run_dir
            finally:
                # DDP's reducer holds the process group: free it (and any reference cycle through
                # it) here, so the group's threads end inside destroy_process_group below and not at
                # interpreter exit, where a rank could abort ("terminate called without an active
                # exception") after training had finished; one process has no group (stop 69's
                # probe: 0.4 s after "done:")
                del trainer
                if ranks.world_size > 1:
                    gc.collect()
        except KeyboardInterrupt:
            if stop.signal is None or not setting_up:  # (a second signal while training stops at once)
                raise
            failed_start = new_dir and ranks.is_main  # a new run's start leaves nothing
            name = signal.Signals(stop.signal).name
            message = f"training stopped by {name} while setting up; nothing was saved"
            raise Interrupted(message, stop.signal, report=ranks.is_main) from None
        except MtxError as e:
            if handler is not None and not isinstance(e, Interrupted):  # (a stop by signal is logged)
                # the log says why the run ended (stop 63: train.max_bad_steps' stop, or an epoch
                # too short for an update, was said on stderr alone, and train.log just ended)
                handler.handle(
                    logging.makeLogRecord({"levelno": logging.ERROR, "levelname": "ERROR", "msg": f"error: {e}"})
                )
            raise
        finally:
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()
            mtx_log.setLevel(level)
            if failed_start:
                remove_contents(run_dir, keep_dir=existed)
            if ranks.world_size > 1:
                dist.destroy_process_group()
