"""What each epoch trains on: train's pairs, each also reversed in the first epochs
(train.bidirectional; BiT, Ding et al., 2021), the pairs of the extra source languages in the first
epochs (train.extra_sources), the model's translations of train from the epoch that made them on
(train.diversify; Nguyen et al., 2020), and with tokenizer.bpe_dropout a fresh segmentation of each
per epoch, drawn on rank 0 and sent to the other ranks. The Trainer decides the phases (`TrainState`
keeps where each ends) and makes the translations; last.pt keeps them and the current epoch's
segmentation, so that a resumed epoch goes on over the same pairs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mtx.collective import Collective
from mtx.config import Config
from mtx.data import ParallelIds
from mtx.state import TrainState
from mtx.tokenizer import BPE

log = logging.getLogger(__name__)

Texts = tuple[list[str], list[str]]


class EpochPairs:
    """The training pairs as encoded (`train_ids`, `extra_ids`, `synthetic`), the texts of the pairs
    kept (BPE-dropout segments them afresh), and the segmentation of the epoch last asked for."""

    def __init__(
        self,
        cfg: Config,
        comm: Collective,
        toks: tuple[BPE, BPE],
        train: Texts,
        extra: Texts,
    ) -> None:
        """Encodes train's pairs and the extra source languages' (none where data.extra_src_langs is
        empty) with the run's (src, tgt) tokenizers, leaving out pairs longer than data.max_len."""
        self.cfg, self.comm = cfg, comm
        self.src_tok, self.tgt_tok = toks
        max_len = cfg.data.max_len
        self.train_ids = ParallelIds.encode(*train, self.src_tok, self.tgt_tok, max_len)
        self.train_texts = ([train[0][i] for i in self.train_ids.rows], [train[1][i] for i in self.train_ids.rows])
        self.extra_ids: ParallelIds | None = None  # (extra language, tgt) pairs (train.extra_sources)
        if cfg.data.extra_src_langs:
            self.extra_ids = ParallelIds.encode(*extra, self.src_tok, self.tgt_tok, max_len)
            if comm.ranks.is_main:
                log.info(
                    "%d extra training pairs from %s (train.extra_sources=%g of the budget)",
                    len(self.extra_ids),
                    "/".join(cfg.data.extra_src_langs),
                    cfg.train.extra_sources,
                )
        kept = self.extra_ids.rows if self.extra_ids is not None else []
        self.extra_texts = ([extra[0][i] for i in kept], [extra[1][i] for i in kept])
        self.synthetic: ParallelIds | None = None  # the model's translations of train (train.diversify)
        # (epoch, its BPE-dropout segmentation of train's pairs, of the extra-source pairs and of the
        # model's translations, the last two None where the epoch has none: `segmented`)
        self.segmentation: tuple[int, ParallelIds, ParallelIds | None, ParallelIds | None] | None = None
        self._dropout_toks: tuple[BPE, BPE] | None = None  # (src, tgt) tokenizers with BPE-dropout

    def of_epoch(self, epoch: int, state: TrainState) -> ParallelIds:
        """The training ids of `epoch` (`segmented`): train's pairs, each also reversed in the first
        `state.both_ways_epochs` epochs; the extra source languages' pairs added in the first
        `state.extra_source_epochs` epochs; the model's translations of train added from
        `state.diversified_epoch` on."""
        ids, extra, synthetic = self.segmented(epoch, state)
        if epoch < state.both_ways_epochs:
            ids = ids.both_ways()
        if extra is not None:
            ids = ids + extra
        if synthetic is not None:
            ids = ids + synthetic
        return ids

    def segmented(self, epoch: int, state: TrainState) -> tuple[ParallelIds, ParallelIds | None, ParallelIds | None]:
        """Train's pairs, and the extra-source pairs and the model's translations that `epoch` adds
        (None where it adds none): as encoded, or with tokenizer.bpe_dropout a fresh segmentation
        of each per epoch, drawn on rank 0 and sent to the other ranks (stop 65: the extra-source
        and translated pairs kept the plain one, and with them half or more of an epoch's
        targets). The translations are segmented afresh from their text."""
        extra = self.extra_ids if self.extra_ids is not None and epoch < state.extra_source_epochs else None
        synthetic = self.synthetic if self.synthetic is not None and epoch >= state.diversified_epoch else None
        p = self.cfg.tokenizer.bpe_dropout
        if not p:
            return self.train_ids, extra, synthetic
        if self.segmentation is None or self.segmentation[0] != epoch:

            def segment(ids: ParallelIds, texts: Callable[[], Texts]) -> ParallelIds:
                def make() -> ParallelIds:
                    if self._dropout_toks is None:  # built once; each encode draws a fresh segmentation
                        src_tok = self.src_tok.with_dropout(p)
                        tgt_tok = src_tok if self.tgt_tok is self.src_tok else self.tgt_tok.with_dropout(p)
                        self._dropout_toks = (src_tok, tgt_tok)
                    return ids.resegmented(*texts(), *self._dropout_toks, self.cfg.data.max_len)

                return self.comm.made_by_main(make)

            def translated() -> Texts:
                assert synthetic is not None
                return self.src_tok.decode_batch(synthetic.src_ids), self.tgt_tok.decode_batch(synthetic.tgt_ids)

            self.segmentation = (
                epoch,
                segment(self.train_ids, lambda: self.train_texts),
                segment(extra, lambda: self.extra_texts) if extra is not None else None,
                segment(synthetic, translated) if synthetic is not None else None,
            )
        _, real, extra_seg, synthetic_seg = self.segmentation
        # a last.pt saved before stop 65 holds train's segmentation alone: its epoch goes on with
        # the other pairs as encoded, as it began
        if extra is not None and extra_seg is not None:
            extra = extra_seg
        if synthetic is not None and synthetic_seg is not None:
            synthetic = synthetic_seg
        return real, extra, synthetic

    def longest(self) -> ParallelIds:
        """The pairs of the longest epoch these settings make (the model's translations taken as
        long as train both ways until they are made), as encoded (without BPE-dropout's longer
        segmentations)."""
        tc = self.cfg.train
        longest = self.train_ids.both_ways() if tc.bidirectional else self.train_ids
        if self.extra_ids is not None:
            longest = longest + self.extra_ids
        if self.synthetic is not None or tc.diversify:
            longest = longest + (self.synthetic if self.synthetic is not None else self.train_ids.both_ways())
        return longest

    def to_checkpoint(self) -> dict[str, Any]:
        """last.pt's entries: the current epoch's segmentation (a resumed epoch goes on over it) and
        the model's translations (a resumed run trains on the same ones)."""
        out: dict[str, Any] = {}
        if self.segmentation is not None:
            epoch, real, extra, synthetic = self.segmentation
            out["epoch_ids"] = {"epoch": epoch, **real.to_tensors()}
            if extra is not None:
                out["epoch_extra_ids"] = extra.to_tensors()
            if synthetic is not None:
                out["epoch_synthetic_ids"] = synthetic.to_tensors()
        if self.synthetic is not None:
            out["synthetic"] = self.synthetic.to_tensors()
        return out

    def load_checkpoint(self, ckpt: dict[str, Any]) -> None:
        """What `to_checkpoint` saved in last.pt (`ckpt`); a segmentation only under tokenizer.bpe_dropout."""
        if "epoch_ids" in ckpt and self.cfg.tokenizer.bpe_dropout:
            saved = dict(ckpt["epoch_ids"])
            extra, synthetic = (ckpt.get(key) for key in ("epoch_extra_ids", "epoch_synthetic_ids"))
            self.segmentation = (
                int(saved.pop("epoch")),
                ParallelIds.from_tensors(saved),
                ParallelIds.from_tensors(extra) if extra is not None else None,
                ParallelIds.from_tensors(synthetic) if synthetic is not None else None,
            )
        if "synthetic" in ckpt:
            self.synthetic = ParallelIds.from_tensors(ckpt["synthetic"])
