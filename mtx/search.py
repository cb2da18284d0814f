"""Greedy and beam search over batches of sentences, sharing the decoder KV cache code.

Both searches drop sentences from the batch as soon as they are finished, so a batch costs
what its longest output costs only for the sentences still running; both can also decode many
sentences as a stream (`decode_stream`, continuous batching): the next sentences join the
running batch as others end, so that few decoding steps run only a few long outputs
(`translate_ids` does so for cached greedy decoding).
Both take a `Seq2Seq` or an `Ensemble` of them (same seam: `encode`, `decode`, `new_cache`,
`output_tokens`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
import torch.nn.functional as F

from mtx.data import pad_ids
from mtx.model import Ensemble, EnsembleCache, KVCache, Seq2Seq, make_src_mask
from mtx.tokenizer import BOS, BPE, EOS, PAD

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # output ids, without BOS/EOS
    score: float  # length-normalised log-probability (raw for greedy)
    log_prob: float  # sum of token log-probabilities, EOS included


def max_output_lengths(src: torch.Tensor, a: float, b: int, model: Seq2Seq | Ensemble) -> torch.Tensor:
    """Per sentence: most output tokens (EOS included), `a * src_len + b`, within positions."""
    src_lens = (src != PAD).sum(dim=1)
    limit = model.cfg.max_positions - 1
    return (src_lens.float() * a + b).floor().long().clamp(min=1, max=limit)


def length_penalty(length: int | torch.Tensor, alpha: float) -> float | torch.Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (Wu et al., 2016)."""
    return ((5.0 + length) / 6.0) ** alpha


def _next_log_probs(
    model: Seq2Seq | Ensemble,
    tokens: torch.Tensor,
    memory: torch.Tensor,
    src_mask: torch.Tensor,
    cache: KVCache | EnsembleCache | None,
) -> torch.Tensor:
    """(N, t) prefixes -> (N, V) float32 log-probabilities of the next token (V: the model's
    output columns, `Seq2Seq.output_tokens`). With a cache only
    the last token is fed; without one the whole prefix is recomputed."""
    feed = tokens[:, -1:] if cache is not None else tokens
    logits = model.decode(feed, memory, src_mask, cache)[:, -1].float()  # (N, V)
    if logits.device.type != "cpu":
        return torch.log_softmax(logits, dim=-1)
    # on CPU in place: no second (N, V) buffer to write (beam 5 at d_model 256: 320 x 8,000 floats a step)
    return torch.log_softmax(logits, dim=-1, out=logits)


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
    return _greedy(model, _once(src), src.shape[0], max_len_a, max_len_b, use_cache)


def _once(src: torch.Tensor) -> Callable[[int, int], torch.Tensor | None]:
    """An `admit` for the searches that hands out `src` at the first call and nothing after."""
    batches = iter([src])
    return lambda running, width: next(batches, None)


@torch.inference_mode()
@_packed_weights
def decode_stream(
    model: Seq2Seq | Ensemble,
    src_ids: Sequence[Sequence[int]],
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    batch_tokens: int,
    max_rows: int = 0,
    nbest: int = 1,
    device: torch.device | None = None,
) -> list[list[Hypothesis]]:
    """Greedy (`beam` 1) or beam search of many sentences (ids without EOS, decoded in the order
    given: sort them by length) with continuous batching and the KV cache: the running batch
    holds at most `max_rows` sentences (0: no limit) and sentences * longest source <=
    `batch_tokens` (at least one), and once a quarter of them have ended (`REFILL_SHARE`), the
    next sentences join it. Fewer decoding steps than separate batches, whose last steps run a
    few long outputs each; the same hypotheses (tests/test_search.py). Per sentence the `nbest`
    best."""
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest ({nbest}) must lie in 1..beam ({beam})")
    device = device or next(model.parameters()).device
    queue = list(range(len(src_ids)))[::-1]  # next sentence last
    width_of = [len(s) + 1 for s in src_ids]  # + EOS

    def admit(running: int, width: int) -> torch.Tensor | None:
        if not queue:
            return None
        cap = max(1, batch_tokens // max(width, width_of[queue[-1]]))  # sentences the budget holds
        if max_rows:
            cap = min(cap, max_rows)
        if running > cap - max(1, cap // REFILL_SHARE):  # refill once a share of them have ended
            return None
        rows: list[int] = []
        while queue and running + len(rows) < cap:
            wider = max(width, width_of[queue[-1]])
            if (running or rows) and (running + len(rows) + 1) * wider > batch_tokens:
                break
            rows.append(queue.pop())
            width = wider
        if not rows:
            return None
        return pad_ids([src_ids[i] for i in rows], suffix=EOS).to(device)

    if beam == 1:
        return [[h] for h in _greedy(model, admit, len(src_ids), max_len_a, max_len_b, use_cache=True)]
    return _beam(model, admit, len(src_ids), beam, alpha, max_len_a, max_len_b, nbest, use_cache=True)


def _greedy(
    model: Seq2Seq | Ensemble,
    admit: Callable[[int, int], torch.Tensor | None],
    n: int,
    max_len_a: float,
    max_len_b: int,
    use_cache: bool,
) -> list[Hypothesis]:
    """Greedy search over sentences that `admit(running rows, source width)` hands out as padded
    (B, S) batches, numbered in the order handed out, whenever the running batch asks; n in all.

    Each row keeps its own step count, length limit and positions: a batch that joins takes its
    first step on its own (encoder, cross-attention keys/values, BOS), then its rows join the
    running ones (`KVCache.append_rows`) and step with them. Without a cache only one batch may
    be handed out (the whole prefix is fed again at every step)."""
    results: list[Hypothesis | None] = [None] * n
    admitted = 0
    rows: list[int] = []  # sentence of each running row
    steps: list[int] = []  # tokens each row has decoded
    limits: list[int] = []  # most tokens each row may decode (EOS included)
    cache: KVCache | EnsembleCache | None = None
    tokens = sums = src_mask = memory = torch.empty(0)
    while True:
        src = admit(len(rows), src_mask.shape[-1] if rows else 0)
        if src is not None:
            m = src.shape[0]
            # one row per sentence, reordered only when sentences end: self-attention may go float32 (bf16 weights)
            new_mask, new_memory, new_cache, log_probs = _first_step(model, src, bool(rows), use_cache, True)
            new_limits = max_output_lengths(src, max_len_a, max_len_b, model).tolist()
            best, token = _pick(model, log_probs, [1] * m, new_limits)
            if not rows:
                cache, tokens, sums, src_mask = new_cache, token[:, None], best, new_mask
                memory = new_memory if cache is None else new_memory[:0, :0]  # cached: only its width is read
            else:
                tokens, src_mask = _join(cache, tokens, src_mask, new_cache, token[:, None], new_mask)
                sums = torch.cat([sums, best])
            rows += range(admitted, admitted + m)
            admitted += m
            steps += [1] * m
            limits += new_limits
        elif not rows:
            break
        else:
            feed = tokens[:, -1:] if cache is not None else F.pad(tokens, (1, 0), value=BOS)
            log_probs = _next_log_probs(model, feed, memory, src_mask, cache)
            steps = [s + 1 for s in steps]
            best, token = _pick(model, log_probs, steps, limits)
            sums = sums + best
            tokens = torch.cat([tokens, token[:, None]], dim=1)
        ended = tokens[:, -1].tolist()
        done = [i for i, t in enumerate(ended) if t == EOS]
        if not done:
            continue
        totals = sums.tolist()
        for i in done:
            results[rows[i]] = Hypothesis(tokens[i, tokens.shape[1] - steps[i] : -1].tolist(), totals[i], totals[i])
        keep = [i for i, t in enumerate(ended) if t != EOS]
        rows, steps, limits = [rows[i] for i in keep], [steps[i] for i in keep], [limits[i] for i in keep]
        if rows:
            index = torch.tensor(keep, dtype=torch.long, device=tokens.device)
            tokens, sums, src_mask = _drop_rows(index, cache, tokens, sums, src_mask)
            tokens = tokens[:, tokens.shape[1] - max(steps) :]  # the cache drops the same padding
            if cache is None:
                memory = memory.index_select(0, index)
    assert admitted == n, f"{admitted} of {n} sentences handed out"
    return [r for r in results if r is not None]


def _first_step(
    model: Seq2Seq | Ensemble, src: torch.Tensor, joining: bool, use_cache: bool, float32_self: bool
) -> tuple[torch.Tensor, torch.Tensor, KVCache | EnsembleCache | None, torch.Tensor]:
    """A batch's first decoding step, on its own (one row per sentence, fed BOS): its source
    mask, memory, new cache (None without `use_cache`) and (B, V) log-probabilities. `joining`:
    running rows are waiting for it, which needs the cache."""
    if joining and not use_cache:
        raise ValueError("without a cache, a search decodes one batch")
    mask = make_src_mask(src)
    memory = model.encode(src, mask)
    cache = model.new_cache(float32_self) if use_cache else None
    bos = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=src.device)
    return mask, memory, cache, _next_log_probs(model, bos, memory, mask, cache)


def _join(
    cache: KVCache | EnsembleCache | None,
    tokens: torch.Tensor,
    src_mask: torch.Tensor,
    new_cache: KVCache | EnsembleCache | None,
    new_tokens: torch.Tensor,
    new_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that took their first step on their own join the running ones: their cache's rows
    after the running ones' (`append_rows`), their tokens left-padded and the source masks
    right-padded to a common width. Returns the tokens and the source mask of all rows."""
    assert cache is not None and new_cache is not None
    cache.append_rows(new_cache)
    tokens = torch.cat([tokens, F.pad(new_tokens, (tokens.shape[1] - new_tokens.shape[1], 0), value=PAD)])
    width = max(src_mask.shape[-1], new_mask.shape[-1])
    return tokens, torch.cat([_pad_mask(src_mask, width), _pad_mask(new_mask, width)])


def _pick(
    model: Seq2Seq | Ensemble, log_probs: torch.Tensor, steps: list[int], limits: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's best next token and its log-probability; rows at their length limit may only end."""
    forced = [i for i, (s, m) in enumerate(zip(steps, limits, strict=True)) if m <= s]
    if forced:
        _force_eos(log_probs, forced, model.eos_column)
    best, column = row_max(log_probs)  # one row per sentence: cheaper than top_candidates
    return best, model.output_tokens(column)


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(B, 1, 1, S) source mask padded with False up to `width` keys."""
    gap = width - mask.shape[-1]
    return mask if gap <= 0 else torch.cat([mask, mask.new_zeros(*mask.shape[:-1], gap)], dim=-1)


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
) -> list[list[Hypothesis]]:
    """Batched beam search of a (B, S) batch; per sentence the `nbest` best hypotheses.

    A finished hypothesis comes from an EOS among the top `beam` candidates of a step. A
    sentence stops once it holds `nbest` finished hypotheses and no running one can still beat
    the `nbest`-th best of them, so the list returned is the one that running to the length cap
    would return: log-probabilities only fall, so a running hypothesis' best reachable score is
    its current log-probability over the largest length penalty it could reach. (Waiting for
    `beam` finished hypotheses when fewer are returned would only decode rows that cannot
    change the result.)
    """
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest ({nbest}) must lie in 1..beam ({beam})")
    return _beam(model, _once(src), src.shape[0], beam, alpha, max_len_a, max_len_b, nbest, use_cache)


def _beam(
    model: Seq2Seq | Ensemble,
    admit: Callable[[int, int], torch.Tensor | None],
    n: int,
    k: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    nbest: int,
    use_cache: bool,
) -> list[list[Hypothesis]]:
    """Beam search over sentences that `admit(running sentences, source width)` hands out as
    padded (B, S) batches (see `_greedy`); per sentence the `nbest` best hypotheses.

    Rows g*K .. g*K+K-1 are the beams of running sentence g; the source mask, the memory and the
    cross-attention keys/values keep one row per sentence, which the decoder's cross-attention
    serves to its K beams. A batch that joins takes its first step on its own, one row per
    sentence (its K beams would all be the same BOS prefix), whose 2K best candidates fill the K
    beams; then its rows join the running ones and step with them, each sentence with its own
    step count, length limit and length penalty."""
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    admitted = 0
    sentences: list[int] = []  # sentence of each running group of K rows
    steps: list[int] = []  # steps each sentence has taken
    limits: list[int] = []  # most tokens each sentence may decode (EOS included)
    cache: KVCache | EnsembleCache | None = None
    tokens = scores = src_mask = memory = torch.empty(0)  # tokens: (rows, t) decoded after BOS
    while True:
        src = admit(len(sentences), src_mask.shape[-1] if sentences else 0)
        if src is not None:
            m = src.shape[0]
            new_mask, new_memory, new_cache, log_probs = _first_step(model, src, bool(sentences), use_cache, False)
            new = list(range(admitted, admitted + m))
            new_limits = max_output_lengths(src, max_len_a, max_len_b, model).tolist()
            no_tokens = torch.empty(m, 0, dtype=torch.long, device=src.device)
            new_tokens, new_scores, rows = _beam_step(
                model, log_probs, log_probs.new_zeros(m, 1), no_tokens, new, [1] * m, new_limits, finished, k, alpha
            )
            if new_cache is not None:
                new_cache.reorder(rows)  # one row per sentence -> K
            if not sentences:
                cache, tokens, scores, src_mask = new_cache, new_tokens, new_scores, new_mask
                memory = new_memory if cache is None else new_memory[:0, :0]  # cached: only its width is read
            else:
                tokens, src_mask = _join(cache, tokens, src_mask, new_cache, new_tokens, new_mask)
                scores = torch.cat([scores, new_scores])
            sentences += new
            admitted += m
            steps += [1] * m
            limits += new_limits
        elif not sentences:
            break
        else:
            feed = tokens[:, -1:] if cache is not None else F.pad(tokens, (1, 0), value=BOS)
            log_probs = _next_log_probs(model, feed, memory, src_mask, cache)  # (m*K, V)
            steps = [s + 1 for s in steps]
            tokens, scores, rows = _beam_step(
                model, log_probs, scores, tokens, sentences, steps, limits, finished, k, alpha
            )
            if cache is not None:
                cache.reorder(rows)  # lazily: applied with the drop below in one copy

        best_alive = scores[:, 0].tolist()
        keep = [
            i
            for i, sent in enumerate(sentences)
            if steps[i] < limits[i]
            and not (
                len(finished[sent]) >= nbest
                and _cannot_improve(finished[sent], nbest, best_alive[i], limits[i], steps[i], alpha)
            )
        ]
        if len(keep) == len(sentences):
            continue
        sentences, steps, limits = [sentences[i] for i in keep], [steps[i] for i in keep], [limits[i] for i in keep]
        if not sentences:
            continue
        groups = torch.tensor(keep, dtype=torch.long, device=tokens.device)
        keep_rows = (groups[:, None] * k + torch.arange(k, device=tokens.device)).view(-1)
        tokens = tokens.index_select(0, keep_rows)
        tokens = tokens[:, tokens.shape[1] - max(steps) :]  # the cache drops the same padding
        scores, src_mask = scores.index_select(0, groups), src_mask.index_select(0, groups)
        if cache is not None:
            cache.reorder(keep_rows, groups)
        else:
            memory = memory.index_select(0, groups)

    out = []
    for hyps in finished:
        hyps.sort(key=lambda h: h.score, reverse=True)
        out.append(hyps[:nbest])
    return out


def _beam_step(
    model: Seq2Seq | Ensemble,
    log_probs: torch.Tensor,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    sentences: list[int],
    steps: list[int],
    limits: list[int],
    finished: list[list[Hypothesis]],
    k: int,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of `_beam` for m sentences of `width` rows each: (m*width, V) log-probabilities,
    (m, width) running scores and (m*width, t) tokens -> the K best continuations that do not end
    here: (m*K, t+1) tokens, (m, K) scores, sorted, and the (m*K,) rows they continue. Candidates
    that end among the K best are added to `finished` with their length penalty."""
    m, width = scores.shape
    vocab = log_probs.shape[-1]
    forced = [g * width + j for g in range(m) if limits[g] <= steps[g] for j in range(width)]
    if forced:
        _force_eos(log_probs, forced, model.eos_column)
    top_scores, top_index = top_candidates(scores, log_probs.view(m, width, vocab), 2 * k)  # (m, 2K), sorted
    top_beam = torch.div(top_index, vocab, rounding_mode="floor")
    top_token = model.output_tokens(top_index % vocab)
    is_eos = top_token == EOS

    eos_top = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])
    if eos_top.any():
        t = tokens.shape[1]
        for i, j in eos_top.nonzero().tolist():
            row = i * width + int(top_beam[i, j])
            raw = float(top_scores[i, j])
            decoded = tokens[row, t - (steps[i] - 1) :].tolist() if steps[i] > 1 else []
            finished[sentences[i]].append(Hypothesis(decoded, raw / length_penalty(steps[i], alpha), raw))

    # continue with the K best candidates that do not end here
    order = (is_eos.long() * (2 * k) + torch.arange(2 * k, device=scores.device)).argsort(dim=1)[:, :k]
    rows = (torch.arange(m, device=scores.device)[:, None] * width + top_beam.gather(1, order)).view(-1)
    tokens = torch.cat([tokens.index_select(0, rows), top_token.gather(1, order).view(-1, 1)], dim=1)
    return tokens, top_scores.gather(1, order), rows


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


def translate_ids(
    model: Seq2Seq | Ensemble,
    src_ids: Sequence[Sequence[int]],
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: int,
    batch_tokens: int,
    nbest: int = 1,
    device: torch.device | None = None,
    use_cache: bool = True,
    workers: int = 0,
) -> list[list[Hypothesis]]:
    """Decode many tokenised sentences (without EOS) in length-sorted batches; input order kept.

    Empty inputs give one empty hypothesis; inputs longer than the model's positions are
    truncated (with a warning). Batches are decoded on `workers` threads (0: auto, see
    `decode_workers`); the hypotheses do not depend on it (tests/test_search.py). Cached greedy
    decoding runs `DECODE_STREAMS` streams of continuous batching (`decode_stream`) instead of
    separate batches; `batch_tokens` bounds each stream's running batch.
    """
    device = device or next(model.parameters()).device
    limit = model.cfg.max_positions - 1  # room for EOS
    truncated = sum(len(s) > limit for s in src_ids)
    if truncated:
        log.warning("%d input sentence(s) longer than %d tokens were truncated (model.max_positions)", truncated, limit)
    src_ids = [list(s[:limit]) for s in src_ids]
    results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] for _ in src_ids]
    todo = [i for i, s in enumerate(src_ids) if s]
    model.eval()

    def decode(batch: list[int]) -> list[list[Hypothesis]]:
        if stream:
            sentences = [src_ids[todo[j]] for j in batch]
            return decode_stream(model, sentences, beam, alpha, max_len_a, max_len_b, batch_tokens, 0, nbest, device)
        src = pad_ids([src_ids[todo[j]] for j in batch], suffix=EOS).to(device)
        if beam == 1:
            return [[h] for h in greedy_search(model, src, max_len_a, max_len_b, use_cache)]
        return beam_search(model, src, beam, alpha, max_len_a, max_len_b, nbest, use_cache)

    stream = beam == 1 and use_cache  # beam search: see DECODE_STREAMS
    if stream:  # continuous batching: DECODE_STREAMS streams, whatever the workers
        by_length = sorted(range(len(todo)), key=lambda j: len(src_ids[todo[j]]))
        batches = [by_length[i::DECODE_STREAMS] for i in range(DECODE_STREAMS)]
    else:
        batches = _decode_batches([len(src_ids[i]) + 1 for i in todo], batch_tokens)
    for batch, hyps in zip(batches, in_workers(decode, batches, workers, device, model), strict=True):
        for j, h in zip(batch, hyps, strict=True):
            results[todo[j]] = h
    return results


# A stream's running batch takes the next sentences once 1 / REFILL_SHARE of what it holds have
# ended (each refill costs an encoder call and a decoding step of its own)
REFILL_SHARE = 4
# Cached greedy decoding runs a split as this many streams of continuous batching, sentences
# dealt out alternately by length: one per decoding thread on CPU (`decode_workers`), and the same
# number elsewhere, so that which sentences share a batch, and with it every output, does not
# depend on the number of threads. Beam search keeps separate batches: its exact stop already
# ends most sentences of a batch close together, so streams saved no steps (107 decoder calls
# against 102 for batches of 64, test_2016_flickr, d_model 256) and paid for their joins
# (0.87-0.91x at batches of 64; 1.07x at d_model 256 and 1.00x at 128 in 4,000-token batches;
# docs/speed.md, stop 31).
DECODE_STREAMS = 2


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
    is restored after."""
    workers = min(decode_workers(workers, device), len(batches))
    threads = torch.get_num_threads()
    with model.packed_weights():
        if workers <= 1:
            return [fn(b) for b in batches]
        pool = ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(max(1, threads // workers),))
        try:
            return list(pool.map(fn, batches[::-1]))[::-1]
        finally:  # on an error or Ctrl-C, the batches not yet started are dropped, not decoded first
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
    device: torch.device | None = None,
    use_cache: bool = True,
    workers: int = 0,
) -> list[str]:
    """1-best translations of token-id sentences as detokenised text, order kept.

    What `mtx eval`, validation during training and scripts/choose_on_val.py score, so all
    three turn ids into text the same way."""
    hyps = translate_ids(
        model, src_ids, beam, alpha, max_len_a, max_len_b, batch_tokens, 1, device, use_cache=use_cache, workers=workers
    )
    return tgt_tok.decode_batch([h[0].tokens for h in hyps])
