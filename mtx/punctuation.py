"""Punctuation typed one way and trained another: a source's quotes, apostrophes and dashes read as
the training data writes them.

A word processor types `’` where Multi30k's French has `'` (14,884 times in train.fr, `’` 17), and
stop 67's probe measured what that costs: 1.75 BLEU on the 384 lines of test_2016_flickr.fr that
hold an apostrophe. Which form a language's data uses is the data's own choice (train.de quotes
with `„` and `“`, train.en with `"`), so nothing is folded by a fixed table: training counts the
source side's characters of each group below (`source_punctuation.json` in the run directory), and
decoding reads a character the data (nearly) never had as the one of its group the data has most
(`folds`, under `decode.normalize_punctuation`). Training reads its data as written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from mtx.errors import CheckpointError, MtxError

COUNTS_FILE = "source_punctuation.json"

# characters typed for one another; the first of each group is ASCII's (it wins a tie)
GROUPS = (
    "'\u2019\u2018\u201a\u201b\u02bc\u00b4`\u2032",  # apostrophes and single quotes: ' ’ ‘ ‚ ‛ ʼ ´ ` ′
    '"\u201c\u201d\u201e\u201f\u00ab\u00bb\u2033',  # double quotes and guillemets: " “ ” „ ‟ « » ″
    "-\u2010\u2011\u2012\u2212",  # hyphens and the minus sign: - ‐ ‑ ‒ −
    "\u2013\u2014",  # the en and em dashes (a dash between words is not a hyphen inside one)
)
# a character seen fewer times than this in the training sources is one the model has not learned
# (train.fr's 17 `’`); one seen more is read as written (train.de's 70 en dashes, 45 `"` beside 188 `“`)
RARE = 20
# and the form it is read as must be this many times as common as it (and not rare itself)
COMMONER = 10


def punctuation_counts(texts: Iterable[str]) -> dict[str, int]:
    """How often each character of `GROUPS` occurs in `texts` (those that occur)."""
    text = "\n".join(texts)
    counts = {char: text.count(char) for group in GROUPS for char in group}
    return {char: n for char, n in counts.items() if n}


def folds(counts: Mapping[str, int]) -> dict[str, str]:
    """{character: the one decoding reads it as}: each character of a group seen fewer than `RARE`
    times, read as the group's commonest where that is seen `COMMONER` times as often and `RARE`
    times at least."""
    read_as = {}
    for group in GROUPS:
        common = max(group, key=lambda char: counts.get(char, 0))  # (a tie: the first, ASCII's)
        for char in group:
            seen, commoner = counts.get(char, 0), counts.get(common, 0)
            if char != common and seen < RARE and commoner >= max(RARE, COMMONER * seen):
                read_as[char] = common
    return read_as


def folded(texts: Sequence[str], read_as: Mapping[str, str]) -> list[str]:
    """`texts` with each character of `read_as` (`folds`) replaced by the one it is read as."""
    table = str.maketrans(dict(read_as))
    return [text.translate(table) for text in texts]


def counted_folds(data_dir: Path, split: str, lang: str) -> dict[str, str]:
    """`folds` of the `split` sources in `data_dir`, for a run trained before its counts were saved
    (stop 73); none where that file cannot be read (a run copied without its data)."""
    from mtx.data import split_file  # (mtx.data imports the tokenizer, which imports this module)
    from mtx.text import read_lines  # (which imports this module)

    try:
        return folds(punctuation_counts(read_lines(split_file(data_dir, split, lang))))
    except (MtxError, OSError):
        return {}


def save_counts(run_dir: Path, lang: str, counts: Mapping[str, int]) -> None:
    """Write the training sources' counts for decoding (`load_folds`), whole or not at all."""
    from mtx.checkpoint import atomic_write_text  # (mtx.checkpoint imports this module)

    atomic_write_text(run_dir / COUNTS_FILE, json.dumps({"lang": lang, "counts": dict(counts)}, indent=1) + "\n")


def load_folds(run_dir: Path, lang: str) -> dict[str, str] | None:
    """The run's `folds` for sources in `lang` (none for counts of another language); None for a run
    trained before stop 73, which has no counts file. A damaged file is a one-line error."""
    path = run_dir / COUNTS_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it ({e}); delete it to read punctuation as written") from None
    counts = saved.get("counts") if isinstance(saved, dict) else None
    if not (
        isinstance(counts, dict)
        and isinstance(saved.get("lang"), str)
        and all(isinstance(k, str) and type(n) is int and n >= 0 for k, n in counts.items())
    ):
        raise CheckpointError(
            f'{path}: not mtx\'s counts of punctuation ({{"lang": ..., "counts": {{character: count}}}}); '
            "delete it to read punctuation as written"
        )
    return folds(counts) if saved["lang"] == lang else {}
