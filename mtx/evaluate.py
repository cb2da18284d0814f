"""sacreBLEU and chrF with their signatures; the logic behind `mtx eval`.

Validation during training calls `corpus_scores` too, so a val BLEU printed by `mtx train` is
computed exactly as `mtx eval` computes it (cased, detokenised text, 13a tokenisation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sacrebleu.metrics import BLEU, CHRF


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str

    def as_dict(self) -> dict[str, float | str]:
        return {
            "bleu": round(self.bleu, 2),
            "chrf": round(self.chrf, 2),
            "bleu_signature": self.bleu_signature,
            "chrf_signature": self.chrf_signature,
        }


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False) -> Scores:
    """Corpus BLEU (13a, cased unless `lowercase`) and chrF of detokenised text."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu = BLEU(tokenize="13a", lowercase=lowercase)
    chrf = CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()))
