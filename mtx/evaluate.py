"""sacreBLEU and chrF with their signatures; the logic behind `mtx eval`.

Validation during training calls `corpus_scores` too, so a val BLEU printed by `mtx train` is
computed exactly as `mtx eval` computes it (cased, detokenised text, 13a tokenisation).

With `bootstrap` resamples, each score also gets sacreBLEU's 95% confidence interval (resampling
the sentences with replacement, seeded, so a rerun prints the same interval), and `paired_tests`
runs sacreBLEU's paired bootstrap test of a system against other systems' outputs on the same
sentences: how often the observed difference would arise by chance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

MIN_BOOTSTRAP = 100  # fewer resamples give intervals too rough to print
PAIRED_SAMPLES = 1000  # resamples of a paired test when none are asked for (sacreBLEU's default)
# most resampled sentences (resamples x sentences): sacreBLEU draws them all at once as int64
# indices, so this many take 2 GB
MAX_RESAMPLED = 250_000_000


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

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {
            "bleu": round(self.bleu, 2),
            "chrf": round(self.chrf, 2),
            "bleu_signature": self.bleu_signature,
            "chrf_signature": self.chrf_signature,
        }
        for key in ("bleu_mean", "bleu_ci", "chrf_mean", "chrf_ci"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(value, 2)
        return out


def _metrics(lowercase: bool = False) -> tuple[BLEU, CHRF]:
    """BLEU (13a, cased unless `lowercase`) and chrF as mtx scores them, in `corpus_scores` and `paired_tests`."""
    return BLEU(tokenize="13a", lowercase=lowercase), CHRF()


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False, bootstrap: int = 0
) -> Scores:
    """Corpus BLEU (13a, cased unless `lowercase`) and chrF of detokenised text; with `bootstrap`
    resamples (at least `MIN_BOOTSTRAP`), their 95% confidence intervals too."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = _metrics(lowercase)
    n = max(bootstrap, 1)
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
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()), **spread)


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


def paired_tests(
    hypotheses: Sequence[str], others: Sequence[tuple[str, Sequence[str]]], references: Sequence[str], samples: int
) -> list[PairedResult]:
    """sacreBLEU's paired bootstrap test (`samples` resamples, seeded) of `hypotheses` against each
    named other system's output, cased BLEU (13a) and chrF."""
    results = []
    for name, other in others:
        if len(other) != len(hypotheses):
            raise ValueError(f"{name}: {len(other)} lines for {len(hypotheses)} hypotheses")
        if list(other) == list(hypotheses):  # sacreBLEU's test gives a zero difference p ~ 0 (MultEval's rule)
            same = corpus_scores(hypotheses, references)
            results.append(PairedResult(name, same.bleu, same.chrf, 0.0, 0.0, 1.0, 1.0))
            continue
        bleu, chrf = _metrics()
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
                b_this.p_value,
                c_this.p_value,
            )
        )
    return results
