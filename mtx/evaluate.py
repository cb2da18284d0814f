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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest
from sacrebleu.utils import sum_of_lists

MIN_BOOTSTRAP = 100  # fewer resamples give intervals too rough to print
PAIRED_SAMPLES = 1000  # resamples of a paired test when none are asked for (sacreBLEU's default)
# sacreBLEU resamples all at once: per resampled sentence an int64 index and the sentence's
# statistics as float32 (chrF's 18), 80 bytes; measured with tracemalloc on val at 1,000 and 4,000
# resamples: 81-83 bytes, for corpus_scores and paired_tests alike (stop 53)
BYTES_PER_RESAMPLED = 84
MAX_RESAMPLED = 25_000_000  # most resampled sentences (resamples x sentences): about 2 GiB


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


# sentences scored at a time without resampling: sacreBLEU holds each sentence's statistics and
# its reference's n-grams until the corpus is scored, about 22 KB a sentence (stop 68's probe: an
# eval of 290,000 sentences peaked at 7.9 GB, 6.3 GB of it scoring)
SCORE_CHUNK = 10_000


def _score_in_chunks(metric: BLEU | CHRF, hypotheses: Sequence[str], references: Sequence[str]) -> Any:
    """`metric.corpus_score` of the whole, from the statistics of `SCORE_CHUNK` sentences at a
    time, each chunk's summed before the next is read: the same sums of whole numbers, so the
    same score and signature (tests/test_evaluate.py), in memory of one chunk."""
    totals = []
    for start in range(0, len(hypotheses), SCORE_CHUNK):
        chunk = slice(start, start + SCORE_CHUNK)
        stats = metric._extract_corpus_statistics(list(hypotheses[chunk]), [list(references[chunk])])
        totals.append(sum_of_lists(stats))
    return metric._aggregate_and_compute(totals)


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False, bootstrap: int = 0
) -> Scores:
    """Corpus BLEU (13a, cased unless `lowercase`) and chrF of detokenised text; with `bootstrap`
    resamples (at least `MIN_BOOTSTRAP`), their 95% confidence intervals too."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = _metrics(lowercase)
    n = max(bootstrap, 1)
    if n == 1 and len(hypotheses) > SCORE_CHUNK:
        b, c = (_score_in_chunks(metric, hypotheses, references) for metric in (bleu, chrf))
    else:
        b = bleu.corpus_score(list(hypotheses), [list(references)], n_bootstrap=n)
        c = chrf.corpus_score(list(hypotheses), [list(references)], n_bootstrap=n)
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
    results = []
    for name, other in others:
        if len(other) != len(hypotheses):
            raise ValueError(f"{name}: {len(other)} lines for {len(hypotheses)} hypotheses")
        bleu, chrf = _metrics()
        # sentence by sentence the same statistics (identical outputs, or outputs that differ only
        # in what the metric's tokenisation drops, such as spaces): every resample differs by 0,
        # which sacreBLEU's test (MultEval's rule) scores p ~ 0; nothing to test, p = 1
        same = [_same_statistics(metric, hypotheses, other, references) for metric in (bleu, chrf)]
        if all(same):
            scores = corpus_scores(hypotheses, references)
            results.append(PairedResult(name, scores.bleu, scores.chrf, 0.0, 0.0, 1.0, 1.0))
            continue
        test = PairedTest(
            [(name, list(other)), ("this", list(hypotheses))],
            {"BLEU": bleu, "chrF": chrf},
            [list(references)],
            test_type="bs",
            n_samples=samples,
        )
        _, scores = test()
        (b_other, b_this), (c_other, c_this) = scores["BLEU"], scores["chrF2"]
        results.append(
            PairedResult(
                name,
                b_other.score,
                c_other.score,
                b_this.score - b_other.score,
                c_this.score - c_other.score,
                1.0 if same[0] else b_this.p_value,
                1.0 if same[1] else c_this.p_value,
            )
        )
    return results


def _same_statistics(
    metric: BLEU | CHRF, hypotheses: Sequence[str], other: Sequence[str], references: Sequence[str]
) -> bool:
    """Whether two systems' outputs give `metric` the same statistics for every sentence."""
    if list(other) == list(hypotheses):
        return True
    refs = [list(references)]
    return metric._extract_corpus_statistics(list(hypotheses), refs) == metric._extract_corpus_statistics(
        list(other), refs
    )
