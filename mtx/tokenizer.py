"""Byte-level BPE (HF `tokenizers`): training on the train split, saving, loading, round trip.

Byte-level pieces never produce <unk> and decode back to the exact input text (after Unicode
NFC normalisation, and `encode_batch`'s `clean_line` of its ends), so detokenisation needs no
heuristics.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mtx.config import TokenizerConfig
from mtx.errors import CheckpointError, process_limit
from mtx.text import read_sources

log = logging.getLogger(__name__)
T = TypeVar("T")

PAD, BOS, EOS, UNK = 0, 1, 2, 3
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines splits
_LINE_BREAKS = re.compile(f"[{LINE_BREAKS}]+")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def serial_if_no_threads(call: Callable[[], T]) -> T:
    """`call()`, a `tokenizers` function that runs on its pool of threads; where that pool could
    not start (a low limit on processes, `ulimit -u`: stop 67's probe, a Rust panic's traceback),
    it runs again on the calling thread (`TOKENIZERS_PARALLELISM=false`), with a warning."""
    try:
        return call()
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        if type(e).__name__ != "PanicException" or "thread pool" not in str(e):
            raise
        said = re.search(r'message: "([^"]*)"', str(e))  # the system's reason: "Resource temporarily unavailable"
        reason = said.group(1) if said else "its thread pool did not start"
    limit = process_limit("RLIMIT_NPROC")
    log.warning(
        "tokenizers could not start its threads (%s; the limit on processes is %s): tokenizing on one thread",
        reason,
        "unlimited" if limit is None else f"ulimit -u {limit}",
    )
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return call()


def _tokenizers_before_0_20() -> bool:
    """Whether the installed tokenizers predates 0.20, which changed how tokenizer.json stores the merges."""
    major, minor = (int(part) for part in re.findall(r"\d+", tokenizers.__version__)[:2])
    return (major, minor) < (0, 20)


class BPE:
    """A trained tokenizer plus the conventions mtx relies on (special ids, stripping)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        for expected, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != expected:
                raise CheckpointError(f"tokenizer: special token {token} must have id {expected}")
        # the text "</s>" (or <pad>, <s>, <unk>) in a sentence is text, not the control token: HF
        # tokenizers matches added tokens in raw text even without add_special_tokens
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_batch(
        self,
        texts: Sequence[str],
        max_pieces: int = 0,
        one_space: bool = False,
        folds: Mapping[str, str] | None = None,
    ) -> list[list[int]]:
        """Text -> ids without specials (callers add BOS/EOS where their role needs them), each
        text read as mtx reads a line (`mtx.text.clean_line`: whitespace and invisible characters
        at its ends dropped), so that a program calling this gets the ids `mtx translate` decodes
        (stop 68's probe: a byte order mark before each val line cost such a program 12 BLEU).

        With `max_pieces` (callers that read only the first `max_pieces` pieces and whether there
        are more), a text too long for that is cut first (`head`), so that memory follows what is
        read: tokenizers takes about 37 bytes per input byte, and a 32 MB one-word line took 6.8 GB
        (stop 65). The first `max_pieces` ids are those of the whole text, and a cut text keeps more.

        With `one_space`, each text is read as decoding reads a source line (`mtx.text.one_spaced`:
        runs of whitespace inside it one space too; `decode.normalize_spaces`), and with `folds`
        each of its characters read as another (`mtx.punctuation.folds`: `decode.normalize_punctuation`)."""
        texts = read_sources(texts, one_space, folds)
        if max_pieces:
            texts = [self.head(text, max_pieces + 1) for text in texts]
        encoded = serial_if_no_threads(lambda: self.tokenizer.encode_batch(texts, add_special_tokens=False))
        return [e.ids for e in encoded]

    @functools.cached_property
    def _longest_piece(self) -> int:
        """The most bytes one piece spells (byte-level pieces: one character a byte)."""
        return max(len(token) for token in self.tokenizer.get_vocab())

    def head(self, text: str, pieces: int) -> str:
        """The start of `text` that holds at least its first `pieces` pieces, as tokenised whole.

        A piece spells at most `_longest_piece` bytes of the NFC text, and NFC makes at most 4
        characters one (a letter and three marks it composes with; stop 65: a decomposed line, cut
        at a count of its characters, held two thirds of the pieces asked for), so the first
        `4 x pieces x _longest_piece` characters hold at least `pieces` pieces. The cut is made at
        the first space after them that follows a letter or digit: the pre-tokenizer splits there
        and NFC composes nothing across it, so the words before it keep their pieces. A word with
        no such space within 4 times that length (a 32 MB run of letters, not a sentence) is cut
        inside; BPE's pieces of a word can depend on all of it, so those read may then differ."""
        enough = 4 * pieces * self._longest_piece
        if len(text) <= enough:
            return text
        end = 4 * enough
        space = text.find(" ", enough, end)
        while space != -1 and not text[space - 1].isalnum():
            space = text.find(" ", space + 1, end)
        return text[: space if space != -1 else end]

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Ids -> text; special tokens are dropped, and a line break that byte-level pieces can
        spell (newline, carriage return, U+2028, ...) becomes a space, so that a translation is
        always one line of a hypotheses file."""
        texts = serial_if_no_threads(lambda: self.tokenizer.decode_batch([list(x) for x in ids]))
        return [_LINE_BREAKS.sub(" ", t).strip() for t in texts]

    def with_dropout(self, p: float) -> BPE:
        """A copy that skips each merge with probability `p` (BPE-dropout, Provilkov et al.,
        2020): the same vocabulary, a random segmentation on every call. For training text only."""
        spec = json.loads(self.tokenizer.to_str())
        spec["model"]["dropout"] = p  # set at construction: the setter leaves the merge cache on
        return BPE(Tokenizer.from_str(json.dumps(spec)))

    def fingerprint(self) -> str:
        """Stable hash of the vocabulary, stored in checkpoints to catch mismatches."""
        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        """Write the tokenizer file whole or not at all, as checkpoints are written (synced to disk
        before the rename: stop 57, it was renamed unsynced); a failure (a full disk) is a one-line
        `CheckpointError` (stop 54: the tokenizers library's bare Exception, a traceback)."""
        from mtx.checkpoint import atomic_write_text  # (which imports this module)

        atomic_write_text(Path(path), self.tokenizer.to_str(pretty=True))

    @classmethod
    def load(cls, path: str | Path) -> BPE:
        """Read a tokenizer file; read by Python, not `Tokenizer.from_file`, whose path must be valid
        UTF-8 (a run directory named in other bytes, as Linux allows, could not be loaded)."""
        try:
            return cls(Tokenizer.from_str(Path(path).read_text(encoding="utf-8")))
        except CheckpointError as e:  # special tokens at other ids: name the file
            raise CheckpointError(f"{path}: {e}") from None
        except Exception as e:  # tokenizers raises plain Exception on parse errors
            if "untagged enum ModelWrapper" in str(e) and _tokenizers_before_0_20():
                # 0.19 cannot read the merges as 0.20+ writes them: say so, it read as a damaged file
                raise CheckpointError(
                    f"{path}: cannot load tokenizer ({e}): the file needs tokenizers>=0.20, "
                    f"{tokenizers.__version__} is installed (pip install 'tokenizers>=0.20')"
                ) from None
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None


# a line longer is left out of BPE training (stop 65: a word of 1 MB trained for minutes, and Ctrl-C
# waited for it; the merges' time grows with the square of a word's length); Multi30k's longest line
# is 254 characters (257 bytes)
BPE_LONGEST_LINE = 20_000


def train_bpe(texts: Iterable[str], cfg: TokenizerConfig, lang: str = "") -> BPE:
    """Train byte-level BPE with NFC normalisation and the four mtx special tokens (`lang`: the
    language its log lines name, for one of two separate vocabularies)."""
    of = f" of {lang}" if lang else ""  # (stop 63: the two lines of separate vocabularies looked alike)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(texts)  # read again where the first try could not start its threads
    long = 0

    def sentences() -> Iterator[str]:
        nonlocal long
        long = 0
        for text in texts:
            if len(text) <= BPE_LONGEST_LINE:
                yield text
            else:
                long += 1

    serial_if_no_threads(lambda: tokenizer.train_from_iterator(sentences(), trainer=trainer))
    if long:
        log.warning(
            "%d training line(s)%s longer than %d characters left out of BPE training: a run of text that long "
            "is no sentence (a file's lines joined?), and a long word in it trains for minutes (the merges' time "
            "grows with the square of a word's length)",
            long,
            of,
            BPE_LONGEST_LINE,
        )
    if tokenizer.get_vocab_size() < cfg.vocab_size:
        log.warning(
            "trained BPE%s: %d pieces, fewer than tokenizer.vocab_size=%d (the training text has no more merges "
            "seen tokenizer.min_frequency=%d times); the model is built for %d",
            of,
            tokenizer.get_vocab_size(),
            cfg.vocab_size,
            cfg.min_frequency,
            tokenizer.get_vocab_size(),
        )
    else:
        log.info("trained BPE%s: %d pieces", of, tokenizer.get_vocab_size())
    return BPE(tokenizer)


def tokenizer_paths(run_dir: Path, joint: bool, src_lang: str, tgt_lang: str) -> tuple[Path, Path]:
    """Where a run keeps its tokenizer(s): one joint file, or one per language."""
    if joint:
        path = run_dir / "tokenizer.json"
        return path, path
    return run_dir / f"tokenizer.{src_lang}.json", run_dir / f"tokenizer.{tgt_lang}.json"


def train_or_load(
    run_dir: Path,
    cfg: TokenizerConfig,
    src_lang: str,
    tgt_lang: str,
    src_texts: Sequence[str],
    tgt_texts: Sequence[str],
) -> tuple[BPE, BPE]:
    """Load the run's tokenizer(s) when present, else train on the given train texts and save."""
    src_path, tgt_path = tokenizer_paths(run_dir, cfg.joint, src_lang, tgt_lang)
    if src_path.exists() and tgt_path.exists():
        return BPE.load(src_path), BPE.load(tgt_path)
    if cfg.joint:
        tok = train_bpe(list(src_texts) + list(tgt_texts), cfg)
        tok.save(src_path)
        return tok, tok
    src_tok, tgt_tok = train_bpe(src_texts, cfg, src_lang), train_bpe(tgt_texts, cfg, tgt_lang)
    src_tok.save(src_path)
    tgt_tok.save(tgt_path)
    return src_tok, tgt_tok


def load_run_tokenizers(run_dir: Path, joint: bool, src_lang: str, tgt_lang: str) -> tuple[BPE, BPE]:
    src_path, tgt_path = tokenizer_paths(run_dir, joint, src_lang, tgt_lang)
    for path in (src_path, tgt_path):
        if not path.exists():
            raise CheckpointError(f"{run_dir}: no {path.name}; is this an mtx run directory?")
    return BPE.load(src_path), BPE.load(tgt_path)
