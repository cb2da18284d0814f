"""Greedy and beam search over batches of sentences, sharing the decoder KV cache code.

Both searches drop sentences from the batch as soon as they are finished, so a batch costs
what its longest output costs only for the sentences still running. Both take a `Seq2Seq` or an
`Ensemble` of them (same seam: `encode`, `decode`, `new_cache`, `output_tokens`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

from mtx.config import STOPS
from mtx.data import pad_ids
from mtx.errors import MtxError, memory_advice, out_of_memory, signals_deferred
from mtx.model import Ensemble, EnsembleCache, KVCache, Seq2Seq, make_src_mask
from mtx.tokenizer import BOS, BPE, EOS, PAD

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # output ids, without BOS/EOS
    score: float  # length-normalised log-probability (raw for greedy)
    log_prob: float  # sum of token log-probabilities, EOS included


def max_output_lengths(src: torch.Tensor, a: float, b: int, model: Seq2Seq | Ensemble) -> torch.Tensor:
    """Per sentence: most output tokens (EOS included), `a * src_len + b`, within positions.

    In float64 with a margin, so that a product whose decimal value is whole is not floored one
    short (float32 gave 1.3 * 90 + 10 = 126.99..., a cap of 126 for 127); on the CPU, since
    Apple's MPS has no float64 (stop 63: every decode on a Mac's default device was a TypeError)."""
    src_lens = (src != PAD).sum(dim=1).cpu()
    limit = model.cfg.max_positions - 1
    # clamped before the conversion: a huge `a` (1e20, "no cap") overflowed int64 to a negative
    # cap, and every translation was empty (stop 54)
    return (src_lens.double() * a + b + 1e-9).floor().clamp(min=1, max=limit).long()


def length_penalty(length: int | torch.Tensor, alpha: float) -> float | torch.Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


_worker = threading.local()  # a decoding thread's `cancel` event (`in_workers`)


class _Cancelled(Exception):
    """A decoding thread's batch given up at a step, the command stopping (`in_workers`)."""


def _next_log_probs(
    model: Seq2Seq | Ensemble,
    tokens: torch.Tensor,
    memory: torch.Tensor,
    src_mask: torch.Tensor,
    cache: KVCache | EnsembleCache | None,
) -> torch.Tensor:
    """(N, t) prefixes -> (N, V) float32 log-probabilities of the next token (V: the model's
    output columns, `Seq2Seq.output_tokens`), -inf for PAD and BOS (`unemitted_columns`). With a
    cache only the last token is fed; without one the whole prefix is recomputed."""
    cancel = getattr(_worker, "cancel", None)
    if cancel is not None and cancel.is_set():  # the command is stopping (`in_workers`)
        raise _Cancelled
    feed = tokens[:, -1:] if cache is not None else tokens
    logits = model.decode(feed, memory, src_mask, cache)[:, -1].float()  # (N, V)
    if logits.device.type != "cpu":
        log_probs = torch.log_softmax(logits, dim=-1)
    else:  # in place: no second (N, V) buffer to write (beam 5 at d_model 256: 320 x 8,000 floats a step)
        log_probs = torch.log_softmax(logits, dim=-1, out=logits)
    if model.unemitted_columns:
        log_probs[:, : model.unemitted_columns] = float("-inf")
    return log_probs


def top_candidates(
    scores: torch.Tensor, log_probs: torch.Tensor, n: int, block: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `n` best `scores[i, j] + log_probs[i, j, v]` of each group i, sorted, with their flat
    indices j * V + v: the same as `(scores[:, :, None] + log_probs).view(m, -1).topk(n)`, ties aside.

    Cheaper than that topk: each block of `block` tokens is summarised by its maximum (a fast
    vectorised reduction), and only the elements of the `n` best blocks are ranked; any element
    of the top n lies in one of them, since each better block holds at least one better element.
    Groups of fewer than `n` elements (beam search's first step: one row over a tiny vocabulary)
    are padded with -inf candidates of index 0.
    """
    m, k, vocab = log_probs.shape
    n_blocks = vocab // block
    if k * n_blocks < n:  # tiny vocabulary: rank everything
        top, index = (scores[:, :, None] + log_probs).view(m, k * vocab).topk(min(n, k * vocab), dim=1)
        pad = n - top.shape[1]
        if pad:
            top = torch.cat([top, top.new_full((m, pad), float("-inf"))], dim=1)
            index = torch.cat([index, index.new_zeros(m, pad)], dim=1)
        return top, index
    maxima = _block_maxima(log_probs, block)
    n_blocks = maxima.shape[-1]
    best_blocks = (maxima + scores[:, :, None]).view(m, k * n_blocks).topk(n, dim=1).indices  # (m, n)
    beam = torch.div(best_blocks, n_blocks, rounding_mode="floor")
    column = (best_blocks % n_blocks)[:, :, None] * block + torch.arange(block, device=log_probs.device)
    flat = (beam[:, :, None] * vocab + column.clamp(max=vocab - 1)).view(m, n * block)
    values = log_probs.reshape(m, k * vocab).gather(1, flat).view(m, n, block) + scores.gather(1, beam)[:, :, None]
    values = values.masked_fill(column >= vocab, float("-inf")).view(m, n * block)
    top, position = values.topk(n, dim=1)
    return top, flat.gather(1, position)


def _block_maxima(values: torch.Tensor, block: int) -> torch.Tensor:
    """(..., V) -> (..., ceil(V / block)): the maximum of each `block` columns of the last
    dimension, a shorter last block included."""
    vocab = values.shape[-1]
    full = vocab // block * block
    maxima = values[..., :full].unflatten(-1, (vocab // block, block)).amax(dim=-1)
    if full < vocab:  # a shorter last block
        maxima = torch.cat([maxima, values[..., full:].amax(dim=-1, keepdim=True)], dim=-1)
    return maxima


def row_max(values: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`values.max(dim=1)` of an (N, V) tensor, the first column on ties, through block maxima:
    `amax` over blocks of `block` columns is a fast vectorised reduction where `max` with indices
    is not (64 x 8,000 floats, 1 thread: 26 against 435 us), then only the first best block of
    each row is searched."""
    vocab = values.shape[1]
    if vocab // block < 2:
        return values.max(dim=1)
    first = _block_maxima(values, block).argmax(dim=1)  # the first block that holds the row's maximum
    # its columns (a short last block repeats the last column, after the first one)
    column = (first[:, None] * block + torch.arange(block, device=values.device)).clamp(max=vocab - 1)
    window = values.gather(1, column)
    position = window.argmax(dim=1, keepdim=True)
    return window.gather(1, position).squeeze(1), column.gather(1, position).squeeze(1)


def _drop_rows(keep: torch.Tensor, cache: KVCache | EnsembleCache | None, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Keep rows `keep` of every per-row tensor and of the cache (self and cross)."""
    if cache is not None:
        cache.reorder(keep, keep)
    return [t.index_select(0, keep) for t in tensors]


def _force_eos(log_probs: torch.Tensor, rows: list[int], eos_column: int) -> None:
    """Rows that reached their length limit may only end: every other token gets -inf."""
    index = torch.tensor(rows, dtype=torch.long, device=log_probs.device)
    eos = log_probs[index, eos_column]
    log_probs[index] = float("-inf")
    log_probs[index, eos_column] = eos


P = ParamSpec("P")
R = TypeVar("R")
B = TypeVar("B")


def _packed_weights(search: Callable[P, R]) -> Callable[P, R]:
    """Run a search with the model's weights prepacked (`Seq2Seq.packed_weights`), packed once
    per call: the weights cannot change during it."""

    @functools.wraps(search)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        model = args[0] if args else kwargs["model"]
        with model.packed_weights():
            return search(*args, **kwargs)

    return run


@torch.inference_mode()
@_packed_weights
def greedy_search(
    model: Seq2Seq | Ensemble, src: torch.Tensor, max_len_a: float, max_len_b: int, use_cache: bool = True
) -> list[Hypothesis]:
    """Arg-max decoding of a (B, S) batch, one hypothesis per sentence."""
    n = src.shape[0]
    src_mask = make_src_mask(src)
    memory = model.encode(src, src_mask)
    max_lens = max_output_lengths(src, max_len_a, max_len_b, model).tolist()
    # one row per sentence, reordered only when sentences end: self-attention may go float32 (bf16 weights)
    cache = model.new_cache(float32_self=True) if use_cache else None
    rows = list(range(n))  # original sentence of each running row
    tokens = torch.full((n, 1), BOS, dtype=torch.long, device=src.device)
    sums = torch.zeros(n, device=src.device)
    results: list[Hypothesis | None] = [None] * n
    step = 0
    while rows:
        step += 1
        log_probs = _next_log_probs(model, tokens, memory, src_mask, cache)
        forced = [i for i, r in enumerate(rows) if max_lens[r] <= step]
        if forced:
            _force_eos(log_probs, forced, model.eos_column)
        best, column = row_max(log_probs)  # one row per sentence: cheaper than top_candidates
        token = model.output_tokens(column)
        sums = sums + best
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        ended = token.tolist()
        done = [i for i, t in enumerate(ended) if t == EOS]
        if done:
            totals = sums.tolist()
            for i in done:
                results[rows[i]] = Hypothesis(tokens[i, 1:-1].tolist(), totals[i], totals[i])
            keep = [i for i, t in enumerate(ended) if t != EOS]
            rows = [rows[i] for i in keep]
            if rows:
                index = torch.tensor(keep, dtype=torch.long, device=src.device)
                tokens, sums, memory, src_mask = _drop_rows(index, cache, tokens, sums, memory, src_mask)
    return [r for r in results if r is not None]


@torch.inference_mode()
@_packed_weights
def beam_search(
    model: Seq2Seq | Ensemble,
    src: torch.Tensor,
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    nbest: int = 1,
    use_cache: bool = True,
    stop: str = "exact",
    text_key: Callable[[list[int]], object] | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search of a (B, S) batch; per sentence the `nbest` best hypotheses.

    With `text_key` (ids -> their text), hypotheses of one text count once, at the best score of
    its segmentations: byte-level pieces spell one text in several ways ("a" and "Ġa" both
    decode to "a"), and an n-best list showed such a text twice. Where the search finds fewer
    than `nbest` texts, the list is filled with the best of the others.

    A finished hypothesis comes from an EOS among the top `beam` candidates of a step. A
    sentence stops once it holds `nbest` finished hypotheses and no running one can still beat
    the `nbest`-th best of them, so the list returned is the one that running to the length cap
    would return: log-probabilities only fall, so a running hypothesis' best reachable score is
    its current log-probability over the largest length penalty it could reach. (Waiting for
    `beam` finished hypotheses when fewer are returned would only decode rows that cannot
    change the result.)

    With `stop="finished"` a sentence stops instead once `beam` hypotheses have finished, as
    fairseq does: they are among those a search run to the length cap finishes, so its best
    scores at most the exact one (tests/test_search.py); on the models measured it decoded
    1.1-1.35x faster and gave the exact output for 93-95% of sentences (docs/speed.md).
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest ({nbest}) must lie in 1..beam ({beam})")
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {', '.join(STOPS)}, got {stop!r}")
    k = beam
    n = src.shape[0]
    device = src.device
    src_mask = make_src_mask(src)
    memory = model.encode(src, src_mask)
    max_lens = max_output_lengths(src, max_len_a, max_len_b, model).tolist()
    # memory and src_mask keep one row per sentence: the decoder's cross-attention serves the K
    # beam rows of a sentence from it (rows g*K .. g*K+K-1 belong to sentence group g)
    cache = model.new_cache() if use_cache else None
    sentences = list(range(n))  # original sentence of each running group of `width` rows
    # the first step has one row per sentence (its K beams would all be the same BOS prefix);
    # its 2K best candidates fill the K beams, every later step has K rows per sentence
    width = 1
    tokens = torch.full((n, 1), BOS, dtype=torch.long, device=device)
    scores = torch.zeros(n, 1, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    seen: list[dict[object, int]] = [{} for _ in range(n)]  # with text_key: text -> its place in finished
    repeats: list[list[Hypothesis]] = [[] for _ in range(n)]  # with text_key: the segmentations passed over
    step = 0
    while sentences:
        step += 1
        m = len(sentences)
        log_probs = _next_log_probs(model, tokens, memory, src_mask, cache)  # (m*width, V)
        vocab = log_probs.shape[-1]
        forced = [g * width + j for g, sent in enumerate(sentences) if max_lens[sent] <= step for j in range(width)]
        if forced:
            _force_eos(log_probs, forced, model.eos_column)
        top_scores, top_index = top_candidates(scores, log_probs.view(m, width, vocab), 2 * k)  # (m, 2K), sorted
        top_beam = torch.div(top_index, vocab, rounding_mode="floor")
        top_token = model.output_tokens(top_index % vocab)
        is_eos = top_token == EOS

        eos_top = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])
        if eos_top.any():
            penalty = length_penalty(step, alpha)
            for i, j in eos_top.nonzero().tolist():
                row = i * width + int(top_beam[i, j])
                raw = float(top_scores[i, j])
                hyp = Hypothesis(tokens[row, 1:].tolist(), raw / penalty, raw)
                sent = sentences[i]
                if text_key is None:
                    finished[sent].append(hyp)
                    continue
                key = text_key(hyp.tokens)
                place = seen[sent].setdefault(key, len(finished[sent]))
                if place == len(finished[sent]):
                    finished[sent].append(hyp)
                elif hyp.score > finished[sent][place].score:
                    repeats[sent].append(finished[sent][place])
                    finished[sent][place] = hyp
                else:
                    repeats[sent].append(hyp)

        # continue with the K best candidates that do not end here; where fewer than K do (an
        # output vocabulary of at most K columns), EOS candidates fill the beam as dead rows
        order = (is_eos.long() * (2 * k) + torch.arange(2 * k, device=device)).argsort(dim=1)[:, :k]
        scores = top_scores.gather(1, order).masked_fill(is_eos.gather(1, order), float("-inf"))  # (m, K), sorted
        rows = (torch.arange(m, device=device)[:, None] * width + top_beam.gather(1, order)).view(-1)
        tokens = torch.cat([tokens.index_select(0, rows), top_token.gather(1, order).view(-1, 1)], dim=1)
        width = k

        best_alive = scores[:, 0].tolist()
        keep = []
        for i, sent in enumerate(sentences):
            if stop == "finished":  # every finished hypothesis counts, as without text_key (stop 63:
                # with --nbest only different texts counted, and the search ran on past fairseq's stop)
                done = len(finished[sent]) + len(repeats[sent]) >= k
            else:
                done = len(finished[sent]) >= nbest and _cannot_improve(
                    finished[sent], nbest, best_alive[i], max_lens[sent], step, alpha
                )
            if not done and step < max_lens[sent]:
                keep.append(i)
        if len(keep) < m:
            groups = torch.tensor(keep, dtype=torch.long, device=device)
            keep_rows = (groups[:, None] * k + torch.arange(k, device=device)).view(-1)
            tokens = tokens.index_select(0, keep_rows)
            memory, src_mask = memory.index_select(0, groups), src_mask.index_select(0, groups)
            if cache is not None:  # the beam reordering and the drop in one copy of the cache
                cache.reorder(rows.index_select(0, keep_rows), groups)
            scores = scores.index_select(0, groups)
            sentences = [sentences[i] for i in keep]
        elif cache is not None:
            cache.reorder(rows)

    out = []
    for hyps, others in zip(finished, repeats, strict=True):
        if len(hyps) < nbest:  # fewer texts than asked for: the best other segmentations fill the list
            hyps += sorted(others, key=lambda h: h.score, reverse=True)[: nbest - len(hyps)]
        hyps.sort(key=lambda h: h.score, reverse=True)
        out.append(hyps[:nbest])
    return out


def _cannot_improve(
    finished: list[Hypothesis], rank: int, best_alive: float, max_len: int, step: int, alpha: float
) -> bool:
    """True when no running hypothesis can beat the `rank`-th best finished one."""
    if best_alive == float("-inf"):
        return True
    nth = sorted((h.score for h in finished), reverse=True)[rank - 1]
    # best_alive <= 0 and can only fall; its best normalised score uses the largest penalty
    bound = best_alive / length_penalty(max_len if best_alive < 0 else step + 1, alpha)
    return bound <= nth


def _decode_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Sentence indices sorted by length, packed so that sentences * max length <= budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def within_positions(
    src_ids: Sequence[Sequence[int]], model: Seq2Seq | Ensemble, first_line: int = 1
) -> list[list[int]]:
    """Source ids cut to the model's positions (room left for EOS), with a warning that names the
    lines cut (numbered from `first_line`), the first ten of them."""
    limit = model.cfg.max_positions - 1
    cut = [i for i, s in enumerate(src_ids, first_line) if len(s) > limit]
    if cut:
        # (stop 63: the warning gave only a count, and finding the lines meant tokenising the input)
        where = ", ".join(map(str, cut[:10])) + (f" and {len(cut) - 10} more" if len(cut) > 10 else "")
        log.warning(
            "%d input sentence(s) longer than %d tokens were truncated (model.max_positions): line(s) %s",
            len(cut),
            limit,
            where,
        )
    return [list(s[:limit]) for s in src_ids]


def translate_ids(
    model: Seq2Seq | Ensemble,
    src_ids: Sequence[Sequence[int]],
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    batch_tokens: int,
    nbest: int = 1,
    use_cache: bool = True,
    workers: int = 0,
    stop: str = "exact",
    progress: Callable[[int], object] | None = None,
    text_key: Callable[[list[int]], object] | None = None,
    first_line: int = 1,
) -> list[list[Hypothesis]]:
    """Decode many tokenised sentences (without EOS) in length-sorted batches; input order kept.
    `text_key`: as `beam_search`'s (an n-best list of different texts).

    Empty inputs give `nbest` empty hypotheses; inputs longer than the model's positions are
    truncated (with a warning). Batches are decoded on `workers` threads (0: auto, see
    `decode_workers`); the hypotheses do not depend on it (tests/test_search.py). `progress`,
    where given, is called with each count of sentences done (a progress bar's `update`).
    `first_line`: the input line number of `src_ids[0]`, for the truncation warning.
    """
    device = next(model.parameters()).device
    src_ids = within_positions(src_ids, model, first_line)
    # an empty input's only translation is empty: `nbest` of it, so that every input gets as many
    results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] * nbest for _ in src_ids]
    todo = [i for i, s in enumerate(src_ids) if s]
    model.eval()
    done_lock = threading.Lock()  # decoding threads report their progress one at a time
    if progress is not None and len(todo) < len(src_ids):
        progress(len(src_ids) - len(todo))  # the empty inputs

    def decode(batch: list[int]) -> list[list[Hypothesis]]:
        src = pad_ids([src_ids[todo[j]] for j in batch], suffix=EOS).to(device)
        if beam == 1:
            hyps = [[h] for h in greedy_search(model, src, max_len_a, max_len_b, use_cache)]
        else:
            hyps = beam_search(model, src, beam, alpha, max_len_a, max_len_b, nbest, use_cache, stop, text_key)
        if progress is not None:
            with done_lock:
                progress(len(batch))
        return hyps

    batches = _decode_batches([len(src_ids[i]) + 1 for i in todo], batch_tokens)
    with _out_of_memory_as(f"decoding on {device} in batches of {batch_tokens} source tokens with beam {beam}", device):
        decoded = in_workers(decode, batches, workers, device, model)
    for batch, hyps in zip(batches, decoded, strict=True):
        for j, h in zip(batch, hyps, strict=True):
            results[todo[j]] = h
    return results


@torch.inference_mode()
def forced_log_probs(
    model: Seq2Seq | Ensemble,
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    batch_tokens: int,
    progress: Callable[[int], object] | None = None,
) -> list[float]:
    """Per pair, the log-probability the model gives the target: its pieces, then EOS, each after
    the ones before (teacher forcing), summed as a search sums its output's (`Hypothesis.log_prob`).
    Both sides must fit the model's positions (`max_positions - 1` pieces); an empty source is
    read as EOS alone. Pairs go in length-sorted batches of about `batch_tokens` tokens; running
    out of memory is `DecodeOutOfMemory`, as in `translate_ids`."""
    device = next(model.parameters()).device
    model.eval()
    sums = [0.0] * len(src_ids)
    lengths = [max(len(s), len(t)) + 1 for s, t in zip(src_ids, tgt_ids, strict=True)]
    with _out_of_memory_as(f"scoring on {device} in batches of {batch_tokens} tokens", device):
        for batch in _decode_batches(lengths, batch_tokens):
            for i, total in zip(batch, _forced_sums(model, src_ids, tgt_ids, batch, device), strict=True):
                sums[i] = total
            if progress is not None:
                progress(len(batch))
    return sums


def _forced_sums(
    model: Seq2Seq | Ensemble,
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    batch: list[int],
    device: torch.device,
) -> list[float]:
    """`forced_log_probs` of the pairs `batch` indexes, in one teacher-forced pass."""
    src = pad_ids([src_ids[i] for i in batch], suffix=EOS).to(device)
    tgt_in = pad_ids([tgt_ids[i] for i in batch], prefix=BOS).to(device)
    tgt_out = pad_ids([tgt_ids[i] for i in batch], suffix=EOS).to(device)
    src_mask = make_src_mask(src)
    logits = model.decode(tgt_in, model.encode(src, src_mask), src_mask).float()
    log_probs = torch.log_softmax(logits, dim=-1)  # as `_next_log_probs` takes each step's
    if model.unemitted_columns:
        log_probs[..., : model.unemitted_columns] = float("-inf")
    picked = log_probs.gather(-1, model.output_columns(tgt_out)[..., None]).squeeze(-1)
    return picked.masked_fill(tgt_out == PAD, 0.0).sum(dim=1).tolist()


@contextlib.contextmanager
def _out_of_memory_as(doing: str, device: torch.device) -> Iterator[None]:
    """Running out of memory inside is `DecodeOutOfMemory`: "out of memory DOING" and what to lower
    (stop 63: a 20-line traceback, with no word on what to lower)."""
    try:
        yield
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        where = f"out of memory {doing}"
        advice = memory_advice("lower --batch-tokens (decode.batch_tokens)", device)
        raise DecodeOutOfMemory(f"{where}; {advice}", where) from None


class DecodeOutOfMemory(MtxError):
    """Decoding ran out of memory; `where`: what it decoded, for a caller's own advice (`mtx train`
    has no --batch-tokens)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def decode_workers(workers: int, device: torch.device) -> int:
    """Decoding threads for `workers` (0: auto): on CPU with 2+ torch threads, 2, else 1; on
    CPU never more than torch's threads, which they share.

    Two threads that each decode their own batches with half the intra-op threads beat one
    thread with all of them: a decoding step's products are small (one row per sentence or
    beam), and 2-way intra-op parallelism splits them poorly (measured, README "Speed")."""
    if device.type != "cpu":
        return max(workers, 1)
    return min(workers or 2, max(torch.get_num_threads(), 1))


def in_workers(
    fn: Callable[[B], R],
    batches: Sequence[B],
    workers: int,
    device: torch.device,
    model: Seq2Seq | Ensemble,
) -> list[R]:
    """[fn(b) for b in batches], on `decode_workers(workers, device)` threads that split torch's
    intra-op threads between them, last batch first (`_decode_batches` ends with the longest).
    The weights are packed once for all batches (`Seq2Seq.packed_weights`); torch's thread count
    is restored after. On an error or Ctrl-C the batches being decoded stop at their next step
    and those not yet started are dropped (stop 64: Ctrl-C waited for every running batch, up to
    a minute, and a second Ctrl-C in that wait aborted the process: "terminate called without an
    active exception"); stop signals in that short wait are delivered after it."""
    workers = min(decode_workers(workers, device), len(batches))
    threads = torch.get_num_threads()
    with model.packed_weights():
        if workers <= 1:
            return [fn(b) for b in batches]
        cancel = threading.Event()

        def start() -> None:
            torch.set_num_threads(max(1, threads // workers))
            _worker.cancel = cancel

        pool = ThreadPoolExecutor(workers, initializer=start)
        try:
            return list(pool.map(fn, batches[::-1]))[::-1]
        finally:
            cancel.set()
            with signals_deferred():
                pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)  # the BLAS thread count is process-wide


def translate(
    model: Seq2Seq | Ensemble,
    tgt_tok: BPE,
    src_ids: Sequence[Sequence[int]],
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    batch_tokens: int,
    use_cache: bool = True,
    workers: int = 0,
    stop: str = "exact",
    progress: Callable[[int], object] | None = None,
) -> list[str]:
    """1-best translations of token-id sentences as detokenised text, order kept (`progress`:
    as `translate_ids`).

    What `mtx eval`, validation during training and scripts/choose_on_val.py score, so all
    three turn ids into text the same way."""
    hyps = translate_ids(
        model,
        src_ids,
        beam,
        alpha,
        max_len_a,
        max_len_b,
        batch_tokens,
        1,
        use_cache=use_cache,
        workers=workers,
        stop=stop,
        progress=progress,
    )
    return tgt_tok.decode_batch([h[0].tokens for h in hyps])
