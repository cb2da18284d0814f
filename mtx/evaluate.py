"""sacreBLEU and chrF with their signatures; the logic behind `mtx eval`.

Validation during training calls `corpus_scores` too, so a val BLEU printed by `mtx train` is
computed exactly as `mtx eval` computes it (cased, detokenised text, 13a tokenisation).

With `bootstrap` resamples, each score also gets sacreBLEU's 95% confidence interval (resampling
the sentences with replacement, seeded, so a rerun prints the same interval), and `paired_tests`
runs sacreBLEU's paired bootstrap test of a system against other systems' outputs on the same
sentences: how often the observed difference would arise by chance.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import _compute_p_value
from sacrebleu.utils import sum_of_lists

MIN_BOOTSTRAP = 100  # fewer resamples give intervals too rough to print
PAIRED_SAMPLES = 1000  # resamples of a paired test when none are asked for (sacreBLEU's default)
# What resampling holds (since stop 75 mtx resamples sacreBLEU's statistics itself, a resample at a
# time): each resampled sentence's int64 index, and each sentence's statistics (both systems' with
# --paired, as lists and float32 arrays) beside the n-gram counts of one chunk of references.
# Measured (peak resident size): 25,000 sentences x 1,000 resamples 0.38-0.41 GB, x 4,000 0.99 GB
# (7.8 bytes a resampled sentence); 250,000 sentences x 100 paired 0.72 GB. sacreBLEU's own took
# 80 bytes a resampled sentence, all at once (2.29-2.30 GB at 25,000 x 1,000; stop 53: tracemalloc)
BYTES_PER_RESAMPLED = 10
BYTES_PER_SENTENCE = 2_000
MAX_RESAMPLING_BYTES = 2 * 2**30  # the most eval's resampling may take


def resampling_bytes(samples: int, sentences: int) -> int:
    """About how much memory `samples` resamples of `sentences` sentences take (bootstrap or paired)."""
    return sentences * (samples * BYTES_PER_RESAMPLED + BYTES_PER_SENTENCE)


def most_resamples(sentences: int) -> int:
    """The most resamples of `sentences` sentences within `MAX_RESAMPLING_BYTES`."""
    return max(0, (MAX_RESAMPLING_BYTES // sentences - BYTES_PER_SENTENCE) // BYTES_PER_RESAMPLED)


def most_resampled_sentences() -> int:
    """The most sentences that `MIN_BOOTSTRAP` resamples may take within `MAX_RESAMPLING_BYTES`."""
    return MAX_RESAMPLING_BYTES // (MIN_BOOTSTRAP * BYTES_PER_RESAMPLED + BYTES_PER_SENTENCE)


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    # with bootstrap resampling: each score's resampled mean and the half-width of its 95% interval
    bleu_mean: float | None = None
    bleu_ci: float | None = None
    chrf_mean: float | None = None
    chrf_ci: float | None = None
    # BLEU's parts, as sacreBLEU's verbose line gives them (stop 63: not shown, though they tell a
    # too-short output, BP below 1, from a poor one)
    bleu_precisions: tuple[float, ...] = ()
    bleu_bp: float = 1.0
    hyp_len: int = 0  # words after 13a tokenisation, hypotheses and references
    ref_len: int = 0

    @property
    def bleu_details(self) -> str:
        """sacreBLEU's verbose part of BLEU, the n-gram precisions, brevity penalty and lengths:
        `57.0/31.5/17.7/9.9 (BP = 1.000 ratio = 1.024 hyp_len = 13606 ref_len = 13289)`."""
        precisions = "/".join(f"{p:.1f}" for p in self.bleu_precisions)
        ratio = self.hyp_len / self.ref_len if self.ref_len else 0.0
        lengths = f"ratio = {ratio:.3f} hyp_len = {self.hyp_len} ref_len = {self.ref_len}"
        return f"{precisions} (BP = {self.bleu_bp:.3f} {lengths})"

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {
            "bleu": round(self.bleu, 2),
            "chrf": round(self.chrf, 2),
            "bleu_signature": self.bleu_signature,
            "chrf_signature": self.chrf_signature,
            "bleu_details": self.bleu_details,
        }
        for key in ("bleu_mean", "bleu_ci", "chrf_mean", "chrf_ci"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(value, 2)
        return out


def _metrics(lowercase: bool = False) -> tuple[BLEU, CHRF]:
    """BLEU (13a, cased unless `lowercase`) and chrF as mtx scores them, in `corpus_scores` and `paired_tests`."""
    return BLEU(tokenize="13a", lowercase=lowercase), CHRF()


# sentences scored at a time: sacreBLEU holds each sentence's reference n-grams until the corpus is
# scored, about 22 KB a sentence (stop 68's probe: an eval of 290,000 sentences peaked at 7.9 GB,
# 6.3 GB of it scoring); a chunk's statistics, whole numbers, are kept (summed where nothing is
# resampled) and its n-grams freed before the next chunk is read
SCORE_CHUNK = 10_000


def _chunks(hypotheses: Sequence[str], references: Sequence[str]) -> Iterator[tuple[list[str], list[list[str]]]]:
    for start in range(0, len(hypotheses), SCORE_CHUNK):
        chunk = slice(start, start + SCORE_CHUNK)
        yield list(hypotheses[chunk]), [list(references[chunk])]


def _sentence_statistics(metric: BLEU | CHRF, hypotheses: Sequence[str], references: Sequence[str]) -> list[Any]:
    """`metric`'s statistics of each sentence, as `metric._extract_corpus_statistics` of the whole
    gives them (one sentence's never depend on another's), read `SCORE_CHUNK` sentences at a time."""
    return [
        stats
        for hyps, refs in _chunks(hypotheses, references)
        for stats in metric._extract_corpus_statistics(hyps, refs)
    ]


def _score_in_chunks(metric: BLEU | CHRF, hypotheses: Sequence[str], references: Sequence[str]) -> Any:
    """`metric.corpus_score` of the whole, from the statistics of `SCORE_CHUNK` sentences at a
    time, each chunk's summed before the next is read: the same sums of whole numbers, so the
    same score and signature (tests/test_evaluate.py), in memory of one chunk."""
    totals = [
        sum_of_lists(metric._extract_corpus_statistics(hyps, refs)) for hyps, refs in _chunks(hypotheses, references)
    ]
    return metric._aggregate_and_compute(totals)


def _resampling_seed() -> int | None:
    """sacreBLEU's seed for resampling: `$SACREBLEU_SEED` (checked by `resampling_seed_problem`),
    12345 where it is unset, None (the OS's entropy) where it is `none`, as sacreBLEU reads it."""
    seed = os.environ.get("SACREBLEU_SEED", "12345")
    return None if seed.lower() == "none" else int(seed)


def _resampled_scores(metric: BLEU | CHRF, stats: list[Any], indices: np.ndarray) -> Iterator[Any]:
    """`metric`'s score of each resample (a row of `indices` into the sentences' `stats`), as
    sacreBLEU computes them: the same sums of the same float32 rows, taken one resample at a time
    instead of from one (resamples x sentences x statistics) array (80 bytes a resampled sentence)."""
    table = np.array(stats, dtype="float32")
    for rows in indices:
        yield metric._compute_score_from_stats(table[rows].sum(0))


def _bootstrap_score(metric: BLEU | CHRF, hypotheses: Sequence[str], references: Sequence[str], n: int) -> Any:
    """`metric.corpus_score(..., n_bootstrap=n)`: the score and sacreBLEU's resampled mean and 95%
    interval (its seeded draws of the sentences, and the seed in the signature), with the
    statistics read in chunks (`_sentence_statistics`) and each resample summed on its own."""
    stats = _sentence_statistics(metric, hypotheses, references)
    score = metric._aggregate_and_compute(stats)
    seed = _resampling_seed()
    indices = np.random.default_rng(seed).choice(len(stats), size=(n, len(stats)), replace=True)
    # sacreBLEU's `Score.estimate_ci` (the 2.5th and 97.5th percentiles' half-distance, the mean) of
    # the resampled scores alone, without a Score object of each resample held at once
    resampled = sorted(s.score for s in _resampled_scores(metric, stats, indices))
    low = len(resampled) // 40
    score._ci = 0.5 * (resampled[len(resampled) - low - 1] - resampled[low])
    score._mean = statistics.mean(resampled)
    metric.n_bootstrap, metric.seed = n, str(os.environ.get("SACREBLEU_SEED", "12345")).lower()
    return score


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False, bootstrap: int = 0
) -> Scores:
    """Corpus BLEU (13a, cased unless `lowercase`) and chrF of detokenised text; with `bootstrap`
    resamples (at least `MIN_BOOTSTRAP`), their 95% confidence intervals too."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = _metrics(lowercase)
    if bootstrap > 1:
        b, c = (_bootstrap_score(metric, hypotheses, references, bootstrap) for metric in (bleu, chrf))
    else:  # (one chunk: `corpus_score`'s own sums)
        b, c = (_score_in_chunks(metric, hypotheses, references) for metric in (bleu, chrf))
    spread: dict[str, float] = {}
    if bootstrap > 1:
        spread = {
            "bleu_mean": float(b._mean),
            "bleu_ci": float(b._ci),
            "chrf_mean": float(c._mean),
            "chrf_ci": float(c._ci),
        }
    return Scores(
        b.score,
        c.score,
        str(bleu.get_signature()),
        str(chrf.get_signature()),
        **spread,
        bleu_precisions=tuple(b.precisions),
        bleu_bp=b.bp,
        hyp_len=b.sys_len,
        ref_len=b.ref_len,
    )


@dataclass(frozen=True)
class PairedResult:
    """This system against one other on the same sentences (paired bootstrap resampling)."""

    name: str
    bleu: float  # the other system's scores
    chrf: float
    bleu_delta: float  # this system's minus the other's
    chrf_delta: float
    bleu_p: float  # p-values: how often resampling gives a difference as large by chance (1.0: identical outputs)
    chrf_p: float

    def as_dict(self) -> dict[str, float | str]:
        return {k: v if isinstance(v, str) else round(v, 4 if k.endswith("_p") else 2) for k, v in vars(self).items()}


def resampling_seed_problem() -> str | None:
    """What is wrong with `$SACREBLEU_SEED`, which sacreBLEU's resampling reads (mtx passes none), or
    None: a value that is not a whole number ended `eval --bootstrap` in a traceback after decoding,
    and 0, which sacreBLEU's paired test takes for no seed while its signature says seed:0, made
    p-values that changed from run to run (stop 68's probe). `none` is sacreBLEU's own unseeded
    choice, and its signatures say so."""
    seed = os.environ.get("SACREBLEU_SEED")
    if seed is None or seed.lower() == "none":  # (as sacreBLEU reads it)
        return None
    try:
        value = int(seed)
    except ValueError:
        return (
            f"SACREBLEU_SEED={seed!r}: sacreBLEU's resampling seed must be a whole number, or none; unset it for 12345"
        )
    if value == 0:
        return "SACREBLEU_SEED=0: sacreBLEU's paired test reads 0 as no seed; set another number, or unset it for 12345"
    if value < 0:  # (numpy's generator: "expected non-negative integer", a traceback after decoding)
        return f"SACREBLEU_SEED={seed!r}: sacreBLEU's resampling seed must not be negative; unset it for 12345"
    return None


def paired_tests(
    hypotheses: Sequence[str], others: Sequence[tuple[str, Sequence[str]]], references: Sequence[str], samples: int
) -> list[PairedResult]:
    """sacreBLEU's paired bootstrap test (`samples` resamples, seeded) of `hypotheses` against each
    named other system's output, cased BLEU (13a) and chrF."""
    for name, other in others:
        if len(other) != len(hypotheses):
            raise ValueError(f"{name}: {len(other)} lines for {len(hypotheses)} hypotheses")
    results: list[PairedResult] = []
    if not others:
        return results
    bleu, chrf = _metrics()
    # this system's statistics, read once for all the others (sacreBLEU's test reads them again for each)
    mine = [_sentence_statistics(metric, hypotheses, references) for metric in (bleu, chrf)]
    for name, other in others:
        stats = [
            (_sentence_statistics(metric, other, references), ours)
            for metric, ours in zip((bleu, chrf), mine, strict=True)
        ]
        # sentence by sentence the same statistics (identical outputs, or outputs that differ only
        # in what the metric's tokenisation drops, such as spaces): every resample differs by 0,
        # which sacreBLEU's test (MultEval's rule) scores p ~ 0; nothing to test, p = 1
        same = [other_stats == this_stats for other_stats, this_stats in stats]
        if all(same):
            b, c = (metric._aggregate_and_compute(ours).score for metric, ours in zip((bleu, chrf), mine, strict=True))
            results.append(PairedResult(name, b, c, 0.0, 0.0, 1.0, 1.0))
            continue
        # sacreBLEU's paired bootstrap test (`PairedTest(..., test_type="bs")`, the other system its
        # baseline, the same seeded draws for both metrics), each resample summed on its own
        draws = np.random.default_rng(_resampling_seed() or None)
        indices = draws.choice(len(hypotheses), size=(samples, len(hypotheses)), replace=True)
        other_scores, deltas, p_values = [], [], []
        for metric, (other_stats, this_stats), same_stats in zip((bleu, chrf), stats, same, strict=True):
            other_score = metric._aggregate_and_compute(other_stats).score
            this_score = metric._aggregate_and_compute(this_stats).score
            other_resampled, this_resampled = (
                np.fromiter(
                    (s.score for s in _resampled_scores(metric, sentences, indices)),
                    dtype=float,
                    count=samples,
                )
                for sentences in (other_stats, this_stats)
            )
            differences = np.abs(this_resampled - other_resampled)
            p = _compute_p_value(differences - differences.mean(), abs(other_score - this_score))
            other_scores.append(other_score)
            deltas.append(this_score - other_score)
            p_values.append(1.0 if same_stats else p)
        results.append(PairedResult(name, *other_scores, *deltas, *p_values))
    return results
