"""Text lines as mtx reads them: UTF-8 files (plain or gzip; other compressions named with the
tool that opens them), each line cleaned of the invisible characters an editor adds, checked, and
warned of where a score would read it otherwise; sources read with one space and the training
data's punctuation; standard input streamed in chunks, each answered before the next is read."""

from __future__ import annotations

import gzip
import logging
import os
import re
import select
import unicodedata
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from mtx.errors import DataError, not_found
from mtx.punctuation import folded

log = logging.getLogger(__name__)


# what compressed data begins with; what it is; the tool that decompresses a file, and one to a pipe
_COMPRESSIONS = [
    (re.compile(rb"\x1f\x8b"), "gzip-compressed", "gunzip -k", "zcat"),
    (re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"), "bzip2-compressed", "bunzip2 -k", "bzcat"),  # a block or the end
    (re.compile(rb"\xfd7zXZ\x00"), "xz-compressed", "unxz -k", "xzcat"),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd-compressed", "unzstd", "zstdcat"),
    (re.compile(rb"PK\x03\x04"), "a zip archive's", "unzip", "unzip -p"),
]


def _compression(raw: bytes) -> tuple[str, str, str] | None:
    """How `raw` is compressed (`_COMPRESSIONS`' kind and tools), or None."""
    return next((found[1:] for found in _COMPRESSIONS if found[0].match(raw)), None)


def read_lines(path: str | Path, allow_empty: bool = False, as_scored: bool = False) -> list[str]:
    """Read a UTF-8 text file (optionally .gz), one sentence per line, cleaned by `clean_line`;
    `as_scored`: only stripped of trailing whitespace, as sacreBLEU reads references and system
    outputs (invisible characters kept), for the texts `mtx eval` scores."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        compressed = _compression(raw)  # (stop 62: "not valid UTF-8; re-encode the file")
        if compressed:
            raise DataError(
                f"{path}: {compressed[0]} data; mtx reads plain or gzip files, so decompress it ({compressed[1]})"
            )
    except FileNotFoundError:
        raise DataError(not_found(path, "file")) from None
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: damaged compressed data behind a good header
        raise DataError(f"{path}: cannot read ({e})") from None
    lines = text_lines(raw, str(path), "the file", str.rstrip if as_scored else clean_line)
    if not allow_empty:
        for i, line in enumerate(lines):
            if not line:
                raise DataError(f"{path}: line {i + 1} is empty; remove empty lines from the data")
    return lines


def _not_utf8(source: str, line: int, what: str) -> DataError:
    return DataError(f"{source}: line {line} is not valid UTF-8; re-encode {what} as UTF-8")


BOM = "\ufeff"  # the byte order mark some editors (Windows Notepad) put before UTF-8 text
# characters that show nothing and that `str.strip` keeps: the byte order mark (also read as a
# zero-width no-break space), zero-width space, non-joiner, joiner and word joiner
INVISIBLE = BOM + "\u200b\u200c\u200d\u2060"


def clean_line(text: str) -> str:
    """A line as mtx reads it: stripped of whitespace and of a byte order mark before it (one
    starts each file that Notepad saved, and so each joined file's first line after `cat`); a line
    of invisible characters alone (zero-width spaces) is empty (stop 54: it was translated as a
    sentence, and passed the data's empty-line check), whitespace between them too (stop 55), and
    invisible characters at either end go with the whitespace (stop 62: a left-to-right mark, which
    bidi-aware editors put before a line, made a translation of another sentence)."""
    start, end = 0, len(text)
    while start < end and stripped(text[start]):
        start += 1
    while end > start and stripped(text[end - 1]):
        end -= 1
    return text[start:end]


# invisible characters that `one_spaced` drops inside a line: the soft hyphen, the zero-width
# space, the word joiner and the zero-width no-break space (a byte order mark), which show nothing
# and mean nothing to a translation. The zero-width joiner and non-joiner stay: they change how
# Persian and Indic words and emoji are drawn.
DROPPED_INSIDE = dict.fromkeys(map(ord, "\u00ad\u200b\u2060\ufeff"))
_SPACES = re.compile(r"\s+")  # str.isspace's characters: tabs, no-break and ideographic spaces, ...


def one_spaced(text: str) -> str:
    """A source line as decoding reads it by default (`decode.normalize_spaces`): `clean_line`'s,
    with every run of whitespace inside it one space and `DROPPED_INSIDE` gone (stop 72; stop 62's
    probe: 10% of test_2016_flickr's spaces typed as no-break spaces cost the d_model 256 model
    4.4 BLEU, and `Ein  Mann` with two spaces was translated with a phrase twice). Training reads
    its data as written (`clean_line`), so that earlier runs are trained again as they were."""
    return _SPACES.sub(" ", clean_line(text.translate(DROPPED_INSIDE)))


def read_sources(texts: Sequence[str], one_space: bool, folds: Mapping[str, str] | None = None) -> list[str]:
    """Source lines as decoding reads them: `one_spaced` (`decode.normalize_spaces`), else
    `clean_line`, and with `folds` their punctuation as the training data writes it
    (`mtx.punctuation.folded`, `decode.normalize_punctuation`)."""
    texts = [(one_spaced if one_space else clean_line)(text) for text in texts]
    return folded(texts, folds) if folds else texts


def scored_text(refs: Sequence[str]) -> list[str]:
    """References as far as a score can tell them apart: their whitespace ends go, which
    sacreBLEU's tokenizers and chrF drop; invisible characters at the ends stay (they change the
    score). For the digests that keep scores on different references apart."""
    return [ref.strip() for ref in refs]


def stripped(char: str) -> bool:
    """Whether `clean_line` drops `char` at a line's ends: whitespace or `_invisible`."""
    return char.isspace() or _invisible(char)


# format characters that are drawn (the prepended concatenation marks: Arabic number signs, the
# end of ayah, ...): a line of them is not empty
_SHOWN_FORMAT = frozenset("\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f\u0890\u0891\u08e2\U000110bd\U000110cd")


# the combining grapheme joiner, and letters drawn as blanks: the Hangul fillers and the blank
# braille pattern (stop 62: a line of them was translated as a sentence)
_BLANK_LETTERS = frozenset("\u034f\u115f\u1160\u3164\uffa0\u2800")


def _invisible(char: str) -> bool:
    """Whether `char` shows nothing by itself: the `INVISIBLE` characters, every other Unicode
    format character (category Cf: left-to-right and right-to-left marks, bidi controls, the
    soft hyphen, invisible operators), control characters (Cc: NUL, escape, DEL), `_BLANK_LETTERS`
    and variation selectors."""
    return (
        char in INVISIBLE
        or (unicodedata.category(char) in ("Cf", "Cc") and char not in _SHOWN_FORMAT)
        or char in _BLANK_LETTERS
        or "\ufe00" <= char <= "\ufe0f"
        or "\U000e0100" <= char <= "\U000e01ef"
    )


def checked_line(text: str, source: str, number: int, what: str, clean: Callable[[str], str] = clean_line) -> str:
    """`clean(text)`, and a carriage return left inside it a `DataError` (stop 53: a file of
    CR-only line ends was read as one line, a whole corpus as one pair; stop 54: on standard
    input too)."""
    line = clean(text)
    if "\0" in line:  # (stop 64: UTF-16 text without a BOM is valid UTF-8 where it is ASCII; translated as garbage)
        raise DataError(
            f"{source}: line {number} holds a NUL byte: UTF-16 text (a NUL beside each letter) or binary data; "
            f"re-encode {what} as UTF-8 text"
        )
    if "\r" in line:
        raise DataError(
            f"{source}: line {number} holds a carriage return: a line break inside a line (a spreadsheet cell's), "
            f"or lines that end in CR alone (classic Mac OS), which are not read as lines; remove it, "
            f"or convert {what} to LF or CRLF line ends"
        )
    return line


def text_lines(raw: bytes, source: str, what: str, clean: Callable[[str], str] = clean_line) -> list[str]:
    """UTF-8 bytes -> lines as `clean` cleans them (a last newline ends the last line, it does
    not start an empty one); bytes that are not UTF-8 are a `DataError` naming `source` and the
    line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(source, raw[: e.start].count(b"\n") + 1, what) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [checked_line(line, source, i, what, clean) for i, line in enumerate(lines, 1)]


def warn_of_invisible_ends(lines: Sequence[str], source: str, what: str = "reference") -> None:
    """Warn where scored lines (`read_lines(as_scored=True)`) begin or end with invisible
    characters: they are scored as they are, as sacreBLEU scores the same file, and cost BLEU
    and chrF, since translations never hold them (stop 63: mtx removed them without a word, and
    printed 24.26 where sacreBLEU on the same files gave 19.78)."""
    count = sum(clean_line(line) != line.strip() for line in lines)
    if count:
        log.warning(
            "%s: %d of %d %s lines begin or end with invisible characters (a byte order mark, zero-width "
            "spaces, direction marks, control characters): they are scored as they are, as sacreBLEU scores "
            "this file, and lower BLEU and chrF; remove them from the file for a fair score",
            source,
            count,
            len(lines),
            what,
        )


def warn_unless_nfc(lines: Sequence[str], source: str) -> None:
    """Warn where reference lines are not in Unicode NFC form: mtx's translations are (its
    tokenizer normalises to NFC), so BLEU and chrF against the same text in another form (NFD,
    as some macOS tools write) come out lower, 80 instead of 100 for val.de (stop 54)."""
    count = sum(not unicodedata.is_normalized("NFC", line) for line in lines)
    if count:
        log.warning(
            "%s: %d of %d reference lines are not in Unicode NFC form, which mtx's translations are: BLEU "
            "and chrF against them are lower than against the same text in NFC; normalise the references "
            "to NFC (Python: unicodedata.normalize('NFC', line))",
            source,
            count,
            len(lines),
        )


def _raw_lines(stream: BinaryIO) -> Iterator[tuple[bytes, bool]]:
    """The lines of `stream` (bytes, without the newline), each with whether more input could be
    read at once: for a pipe or terminal, whether its file descriptor has data waiting; for
    anything that cannot be polled (a file object without one, Windows pipes), always True."""
    try:
        fd = stream.fileno()
        select.select([fd], [], [], 0)
    except (OSError, ValueError):  # io.UnsupportedOperation is an OSError
        for line in stream:
            yield line.removesuffix(b"\n"), True
        return
    pending: list[bytes] = []  # a line's parts read so far: joined once its end comes (stop 64: joined
    # at every read, 64 KiB at a time, a 64 MB line without a newline took 83 s, against 16 s for 16 MB)
    while data := _read_waiting(fd):
        if b"\n" not in data:
            pending.append(data)
            continue
        *complete, rest = data.split(b"\n")
        complete[0] = b"".join([*pending, complete[0]])
        pending = [rest] if rest else []
        for i, line in enumerate(complete, 1):
            yield line, i < len(complete) or bool(select.select([fd], [], [], 0)[0])
    if pending:
        yield b"".join(pending), False


def _read_waiting(fd: int) -> bytes:
    """The next bytes of `fd`, waiting for them where it is non-blocking (stop 64: "mtx: error:
    Resource temporarily unavailable" as soon as a non-blocking pipe was empty for a moment)."""
    while True:
        try:
            return os.read(fd, 1 << 16)
        except BlockingIOError:
            select.select([fd], [], [])


def stream_lines(stream: BinaryIO, chunk: int, source: str, what: str) -> Iterator[tuple[int, list[str]]]:
    """Lines of a binary stream, cleaned and checked as `text_lines` does, with the number of
    lines before them, in lists of at most `chunk` lines: a list is yielded once it is full or the
    stream has nothing more to read at that moment, so that a writer who waits for each answer
    (a terminal, a slow pipe) gets it, while a file or a fast pipe comes in full lists. Bytes
    that are not UTF-8 are a `DataError` naming `source` and the line."""
    lines: list[str] = []
    before = 0
    for number, (raw, more) in enumerate(_raw_lines(stream), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            compressed = number == 1 and _compression(raw)
            if compressed:  # (stop 64: "re-encode the input as UTF-8" for `mtx translate < f.gz`)
                kind, _, pipe = compressed
                raise DataError(f"{source}: {kind} data; decompress it first ({pipe} FILE | mtx ...)") from None
            raise _not_utf8(source, number, what) from None
        lines.append(checked_line(line, source, number, what))
        if len(lines) == chunk or not more:
            yield before, lines
            before, lines = number, []
    if lines:
        yield before, lines


def read_parallel(
    src_path: Path, tgt_path: Path, allow_empty: bool = False, as_scored: bool = False
) -> tuple[list[str], list[str]]:
    """Two aligned files -> (source lines, target lines), checked for equal length; empty lines
    only with `allow_empty` (a test set scored by `mtx eval`); `as_scored`: the target lines as
    sacreBLEU reads references (`read_lines`)."""
    src, tgt = read_lines(src_path, allow_empty), read_lines(tgt_path, allow_empty, as_scored)
    if len(src) != len(tgt):
        raise DataError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; "
            "parallel files must have the same number of lines"
        )
    if not src:
        raise DataError(f"{src_path}: the file is empty")
    return src, tgt
