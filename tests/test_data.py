from __future__ import annotations

import argparse
import bz2
import gzip
import io
import lzma
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mtx.config import DataConfig
from mtx.data import (
    ParallelIds,
    available_splits,
    download_reason,
    epoch_batches,
    epoch_length,
    eval_split_files,
    is_test_split,
    load_corpus,
    multi30k_cache,
    padding_fraction,
    plan_batches,
    resolve_data_dir,
    texts,
)
from mtx.errors import DataError
from mtx.text import clean_line, one_spaced, read_lines, stream_lines, text_lines, warn_unless_nfc
from mtx.tokenizer import BOS, EOS, PAD

from .conftest import FakeMulti30k


def test_loads_the_shared_multi30k_copy(shared_data: Path) -> None:
    cfg = DataConfig(dir=str(shared_data))
    corpus = load_corpus(resolve_data_dir(cfg), cfg, ["train", "val", "test_2016_flickr"])
    assert [len(corpus[s]) for s in ("train", "val", "test_2016_flickr")] == [29000, 1014, 1000]
    assert corpus["train"][0]["src"].startswith("Zwei junge weiße Männer")
    assert corpus["train"][0]["tgt"].startswith("Two young, White males")
    assert set(available_splits(shared_data, "de", "en")) == {"train", "val", "test_2016_flickr"}


def test_loads_plain_and_gz_files_from_a_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "train.fr").write_text("Bonjour.\nMerci.\n", encoding="utf-8")
    with gzip.open(tmp_path / "train.en.gz", "wt", encoding="utf-8") as f:
        f.write("Hello.\nThanks.\n")
    cfg = DataConfig(dir=str(tmp_path), src_lang="en", tgt_lang="fr")
    ds = load_corpus(tmp_path, cfg, ["train"])["train"]
    assert ds["src"] == ["Hello.", "Thanks."] and ds["tgt"] == ["Bonjour.", "Merci."]
    assert not caplog.records
    # both forms of one file: the plain one, with a warning, once (stop 57: without a word)
    (tmp_path / "train.en").write_text("Hi.\nThanks!\n", encoding="utf-8")
    for _ in range(2):
        assert load_corpus(tmp_path, cfg, ["train"])["train"]["src"] == ["Hi.", "Thanks!"]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{tmp_path}: both train.en and train.en.gz are here; reading train.en (remove the other)"
    ]


def test_data_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DataConfig(dir=str(tmp_path), src_lang="de", tgt_lang="en")
    with pytest.raises(DataError, match="does not exist; set data.dir"):
        resolve_data_dir(DataConfig(dir=str(tmp_path / "nope")))
    # a relative one is read from the working directory, which the line says (stop 68's probe: it did not)
    monkeypatch.chdir(tmp_path)
    here = rf"\.\./data does not exist \(a relative data.dir is read from the working directory: {tmp_path}/"
    with pytest.raises(DataError, match=here):
        resolve_data_dir(DataConfig(dir="../data"))
    with pytest.raises(DataError, match="split 'train' missing"):
        load_corpus(tmp_path, cfg, ["train"])
    (tmp_path / "train.de").write_text("a\nb\nc\n")
    (tmp_path / "train.en").write_text("a\nb\n")
    with pytest.raises(DataError, match="has 3 lines but .* has 2"):
        load_corpus(tmp_path, cfg, ["train"])
    (tmp_path / "train.en").write_text("a\n\nc\n")
    with pytest.raises(DataError, match="line 2 is empty"):
        load_corpus(tmp_path, cfg, ["train"])
    (tmp_path / "train.en").write_bytes(b"a\nb\n\xff\xfe\n")
    with pytest.raises(DataError, match="line 3 is not valid UTF-8"):
        load_corpus(tmp_path, cfg, ["train"])
    (tmp_path / "val.de").write_text("")
    (tmp_path / "val.en").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_corpus(tmp_path, cfg, ["val"])
    whole = gzip.compress(b"Ein Hund rennt durch das Gras.\n" * 50)
    (tmp_path / "train.en").unlink()
    (tmp_path / "train.en.gz").write_bytes(whole[: len(whole) // 2])  # cut short: EOFError
    with pytest.raises(DataError, match=r"train.en.gz: cannot read \(Compressed file ended"):
        load_corpus(tmp_path, cfg, ["train"])
    damaged = bytearray(whole)
    damaged[10] = 0xFF  # a good header, then damaged compressed data: zlib.error, not an OSError
    (tmp_path / "train.en.gz").write_bytes(bytes(damaged))
    with pytest.raises(
        DataError, match=r"train.en.gz: cannot read \(Error -3 while decompressing data: invalid block type"
    ):
        load_corpus(tmp_path, cfg, ["train"])


def test_read_lines_strips_and_keeps_count(tmp_path: Path) -> None:
    (tmp_path / "x").write_text(" a \r\nb\n")
    assert read_lines(tmp_path / "x") == ["a", "b"]


def test_text_lines_keeps_inner_empty_lines_and_names_the_source() -> None:
    # an inner empty line stays (read_lines then refuses it in data files)
    assert text_lines(b" a \r\n\nb", "standard input", "the input") == ["a", "", "b"]
    assert text_lines(b"", "standard input", "the input") == []
    # a byte order mark before the first line (Windows Notepad's UTF-8) is not part of it
    assert text_lines("\ufeffEin Hund.\nb".encode(), "x", "the file") == ["Ein Hund.", "b"]
    with pytest.raises(DataError, match=r"^standard input: line 2 is not valid UTF-8; re-encode the input as UTF-8$"):
        text_lines(b"ok\n\xff\n", "standard input", "the input")
    # CR-only line ends (classic Mac OS) read a whole file as one line (stop 53): an error instead
    with pytest.raises(DataError, match=r"^train.de: line 1 holds a carriage return: .* convert the file to LF"):
        text_lines(b"Ein Hund.\rEine Katze.\r", "train.de", "the file")
    assert text_lines(b"a\r\nb\r\n", "x", "the file") == ["a", "b"]  # CRLF is fine
    # stop 54: a byte order mark starting a later line (files joined by cat) is not part of it, and a
    # line of invisible characters alone is empty (it was translated as a sentence)
    joined = "\ufeffa\n\ufeffb \u200bc\n\u200b\n \ufeff\u2060 \n\u200dd\u200d\n"
    # stop 62: invisible characters at either end go with the whitespace (a left-to-right mark
    # before a line made the translation of another sentence); inside a line they stay
    assert text_lines(joined.encode(), "x", "the file") == ["a", "b \u200bc", "", "", "d"]
    assert text_lines("\u200eEin Mann.\u200f\n\ufeff\ufeffZwei\u2060\n".encode(), "x", "the file") == [
        "Ein Mann.",
        "Zwei",
    ]
    # stop 55: with whitespace between invisible characters too
    spaced = "\u200b \u200b \u200b\n\u200b\u00a0\u200b\u00a0\u200b\n"
    assert text_lines(spaced.encode(), "x", "the file") == ["", ""]
    # stop 62: letters drawn as blanks (Hangul fillers, the blank braille pattern), at the ends of
    # a line with text too
    blanks = "\u3164\u3164\n\u2800 \u2800\n\uffa0\u115f\u1160\n\u3164\ud55c\n"
    assert text_lines(blanks.encode(), "x", "the file") == ["", "", "", "\ud55c"]


def test_invisible_lines_are_empty_data_lines_and_references_not_in_nfc_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "x.en").write_text("A dog.\n\u200b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"x.en: line 2 is empty; remove empty lines from the data$"):
        read_lines(tmp_path / "x.en")
    warn_unless_nfc(["F\u00e4hrt.", "ok"], "ref.de")
    assert not caplog.records
    warn_unless_nfc(["Fa\u0308hrt.", "ok", "Gru\u0308n"], "ref.de")  # NFD, as some macOS tools write
    (record,) = caplog.records
    assert record.getMessage().startswith("ref.de: 2 of 3 reference lines are not in Unicode NFC form")


@pytest.mark.parametrize("chunk", [1, 2, 3, 10])
def test_stream_lines_chunks_what_text_lines_reads(chunk: int) -> None:
    """`mtx translate`'s standard input: the lines of `text_lines`, in chunks, numbered across them."""
    raw = "\ufeff a \r\n\nb\nc d\n e"
    chunks = list(stream_lines(io.BytesIO(raw.encode()), chunk, "standard input", "the input"))
    assert [line for _, lines in chunks for line in lines] == text_lines(raw.encode(), "standard input", "the input")
    assert chunks[0][1][0] == "a"  # without the byte order mark
    assert [len(lines) for _, lines in chunks[:-1]] == [chunk] * (len(chunks) - 1)
    assert [before for before, _ in chunks] == list(range(0, 5, chunk))
    assert list(stream_lines(io.BytesIO(b""), chunk, "standard input", "the input")) == []
    bad = stream_lines(io.BytesIO(b"ok\nok\n\xff\n"), chunk, "standard input", "the input")
    with pytest.raises(DataError, match=r"^standard input: line 3 is not valid UTF-8; re-encode the input as UTF-8$"):
        list(bad)
    # CR-only line ends on standard input too (stop 54: three sentences were translated as one)
    cr = stream_lines(io.BytesIO(b"ok\nEin Hund.\rEine Katze.\r"), chunk, "standard input", "the input")
    with pytest.raises(DataError, match=r"^standard input: line 2 holds a carriage return: .* convert the input to LF"):
        list(cr)


def test_stream_lines_from_a_pipe_fills_batches_and_ends_one_where_the_input_pauses() -> None:
    """Through a real pipe: what is written at once comes in full lists; a line followed by a
    pause comes alone, without waiting for more (the reader would otherwise block for ever)."""
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as reader, os.fdopen(write_end, "wb") as writer:
        writer.write(b"a\nb\nc\nd\ne\n")
        writer.flush()
        lines = stream_lines(reader, 2, "standard input", "the input")
        assert [next(lines), next(lines)] == [(0, ["a", "b"]), (2, ["c", "d"])]
        got: list[tuple[int, list[str]]] = []
        thread = threading.Thread(target=lambda: got.append(next(lines)))
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive() and got == [(4, ["e"])]  # the pause ends its list
        writer.write(b"f\r\n g")  # the last line needs no newline
        writer.close()
        assert list(lines) == [(5, ["f", "g"])]


def test_a_nul_inside_a_line_and_compressed_standard_input_are_named() -> None:
    """UTF-16 text without a BOM is valid UTF-8 where it is ASCII, a NUL beside each letter: it was
    translated as garbage, one output line more than the input's (stop 64); compressed data on
    standard input was told to be re-encoded as UTF-8."""
    utf16 = "Ein Mann.\nZwei Hunde.\n".encode("utf-16-le")
    with pytest.raises(DataError, match=r"^standard input: line 1 holds a NUL byte: UTF-16 text .* as UTF-8 text$"):
        list(stream_lines(io.BytesIO(utf16), 10, "standard input", "the input"))
    with pytest.raises(DataError, match=r"^f: line 2 holds a NUL byte"):
        text_lines(b"ok\nEin\x00 Mann\n", "f", "the file")
    assert text_lines(b"ok\x00\n", "f", "the file") == ["ok"]  # at a line's end, one of the control characters dropped
    for compress, pipe in ((gzip.compress, "zcat"), (bz2.compress, "bzcat"), (lzma.compress, "xzcat")):
        packed = stream_lines(io.BytesIO(compress(b"Ein Mann.\n" * 50)), 10, "standard input", "the input")
        with pytest.raises(
            DataError, match=rf"^standard input: \w+-compressed data; decompress it first \({pipe} FILE"
        ):
            list(packed)


def test_a_line_read_in_many_parts_is_joined_once_whole() -> None:
    """A line arriving in many reads (a long one without a newline yet) is joined when it ends:
    it was joined again at every 64 KiB read (stop 64: 83 s for a 64 MB line)."""
    read_end, write_end = os.pipe()
    parts = [b"ab", b"cd", b"e\nf", b"g", b"\n\nh", b"i"]
    with os.fdopen(read_end, "rb") as reader:

        def write() -> None:
            with os.fdopen(write_end, "wb", buffering=0) as writer:
                for part in parts:
                    writer.write(part)
                    time.sleep(0.02)

        thread = threading.Thread(target=write)
        thread.start()
        lines = [line for _, chunk in stream_lines(reader, 10, "standard input", "the input") for line in chunk]
        thread.join(timeout=30)
    assert lines == ["abcde", "fg", "", "hi"]


def test_a_non_blocking_standard_input_is_waited_for() -> None:
    """A non-blocking pipe (an event loop's, passed on) ended `mtx translate` with "Resource
    temporarily unavailable" as soon as it was empty for a moment (stop 64)."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    with os.fdopen(read_end, "rb") as reader, os.fdopen(write_end, "wb") as writer:
        lines = stream_lines(reader, 10, "standard input", "the input")
        got: list[tuple[int, list[str]]] = []
        thread = threading.Thread(target=lambda: got.extend(lines))
        thread.start()
        time.sleep(0.2)  # the reader finds the pipe empty first
        writer.write(b"a\nb\n")
        writer.close()
        thread.join(timeout=30)
        assert not thread.is_alive() and got == [(0, ["a", "b"])]


def _lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(3, 40, n)
    return src, np.clip(src + rng.integers(-5, 6, n), 2, None)


def test_batches_respect_budget_and_cover_every_sentence_once() -> None:
    src, tgt = _lengths(5000)
    plan = plan_batches(src, tgt, 600, seed=3)
    seen = np.concatenate(plan)
    assert sorted(seen.tolist()) == list(range(5000))
    for b in plan:
        assert len(b) * max(src[b].max(), tgt[b].max()) <= 600


def test_shuffle_is_seeded_and_changes_per_epoch() -> None:
    src, tgt = _lengths(2000)
    a = plan_batches(src, tgt, 500, seed=1)
    b = plan_batches(src, tgt, 500, seed=1)
    c = plan_batches(src, tgt, 500, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=False))
    # an epoch's batches: each sentence's first id names it; the same (seed, epoch) gives the
    # same order, the next epoch another, and every epoch covers every sentence once
    ids = ParallelIds([[10 + i] * (s - 1) for i, s in enumerate(src)], [[4] * (t - 1) for t in tgt])

    def order(epoch: int) -> list[int]:
        return [i for batch in epoch_batches(ids, 500, seed=1, epoch=epoch) for i in (batch.src[:, 0] - 10).tolist()]

    first = order(0)
    assert first == order(0) and sorted(first) == list(range(2000))
    assert order(1) != first and sorted(order(1)) == list(range(2000))


def test_padding_is_small_on_multi30k_train(shared_data: Path) -> None:
    """Real BPE lengths of Multi30k train: bucketing keeps padding under 5% at ~4k tokens."""
    from mtx.config import TokenizerConfig
    from mtx.tokenizer import train_bpe

    cfg = DataConfig(dir=str(shared_data))
    src, tgt = texts(load_corpus(shared_data, cfg, ["train"])["train"])
    tok = train_bpe(src + tgt, TokenizerConfig(vocab_size=8000))
    ids = ParallelIds.encode(src, tgt, tok, tok)
    for seed in (None, 1):
        plan = plan_batches(ids.src_lens, ids.tgt_lens, 4096, seed=seed)
        assert padding_fraction(ids, plan) < 0.05


def test_batch_tensors_and_rank_shards() -> None:
    ids = ParallelIds([[5, 6, 7], [8]], [[9], [10, 11]])
    batch = ids.batch([0, 1])
    assert batch.src.tolist() == [[5, 6, 7, EOS], [8, EOS, PAD, PAD]]
    assert batch.tgt_in.tolist() == [[BOS, 9, PAD], [BOS, 10, 11]]
    assert batch.tgt_out.tolist() == [[9, EOS, PAD], [10, 11, EOS]]
    assert batch.n_src_tokens == 6 and batch.n_tgt_tokens == 5
    back = ParallelIds.from_tensors(ids.to_tensors())  # as a checkpoint keeps a BPE-dropout epoch
    assert back.src_ids == ids.src_ids and back.tgt_ids == ids.tgt_ids
    assert back.tgt_lens.tolist() == ids.tgt_lens.tolist()

    both = ids.both_ways()  # train.bidirectional: every pair, then every pair reversed
    assert both.src_ids == [[5, 6, 7], [8], [9], [10, 11]] and both.tgt_ids == [[9], [10, 11], [5, 6, 7], [8]]
    assert both.src_lens.tolist() == [4, 2, 2, 3] and both.tgt_lens.tolist() == [2, 3, 4, 2]

    src, tgt = _lengths(999)
    ids = ParallelIds([[4] * (s - 1) for s in src], [[4] * (t - 1) for t in tgt])
    shards = [list(epoch_batches(ids, 400, seed=1, epoch=0, rank=r, world_size=2)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == epoch_length(ids, 400, 1, 0, world_size=2)


def test_auto_data_downloads_multi30k_once_into_the_cache(
    multi30k_server: FakeMulti30k, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = multi30k_server
    for lang in ("fr", "cs"):  # the fake serves de and en only: add the rest, as the real server has them
        for split in ("train", "val", "test_2016_flickr"):
            (fake.server / f"{split}.{lang}.gz").write_bytes(gzip.compress(b"x\n"))
    cache = tmp_path / "cache" / "mtx" / "multi30k"
    # each file is on the disk before its name, and the names after (stop 67: a power cut could tear them)
    events: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (fsync(fd), events.append("fsync")))
    monkeypatch.setattr(os, "replace", lambda a, b: (replace(a, b), events.append(Path(b).name)))
    assert resolve_data_dir(DataConfig(dir="auto")) == cache.resolve()
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert fake.cache_dirs == [str(cache.resolve().parent / "downloads")]  # (an empty $XDG_CACHE_HOME: the cwd's)
    # each file, then the folder
    assert sorted(events[1::2]) == sorted(fake.requested) and events[0::2] == ["fsync"] * 13
    assert sorted(fake.requested) == sorted(
        f"{s}.{lang}.gz" for s in ("train", "val", "test_2016_flickr") for lang in ("en", "de", "fr", "cs")
    )
    assert sorted(p.name for p in cache.iterdir()) == sorted(fake.requested)  # whole files, no .tmp left
    assert resolve_data_dir(DataConfig(dir="auto")) == cache.resolve() and len(fake.requested) == 12  # cached


def test_auto_data_completes_a_half_filled_cache_and_names_what_it_lacks(
    multi30k_server: FakeMulti30k, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download stopped after some files (a full disk, Ctrl-C) left a cache that one present file
    (train.en) passed as complete: every later run failed on a missing split and none fetched it.
    A wrong $MTX_DATA_DIR was passed over silently, for other data."""
    fake = multi30k_server
    # the shared copies looked in, none there, are named (stop 67: the one beside the checkout was not)
    monkeypatch.setattr("mtx.data._SHARED_COPIES", (Path("../no/copy"), tmp_path / "beside" / "multi30k"))
    cache = tmp_path / "cache" / "mtx" / "multi30k"
    cache.mkdir(parents=True)
    (cache / "train.en.gz").write_bytes((fake.server / "train.en.gz").read_bytes())
    (cache / "val.de").write_text("x\n")  # plain files count too
    cfg = DataConfig(dir="auto")
    with pytest.raises(DataError) as e:  # the fake serves de and en only: fr and cs fail to download
        resolve_data_dir(cfg)
    assert str(e.value).endswith(
        f"put train.de, val.en (.gz or plain) into $MTX_DATA_DIR, ../no/copy, {tmp_path / 'beside' / 'multi30k'} "
        f"or {cache}, or set "
        "data.dir to a local copy"
    )
    # from the checkout's root the two shared copies are one folder: named once
    monkeypatch.setattr("mtx.data._SHARED_COPIES", (tmp_path / "one", tmp_path / "x" / ".." / "one"))
    with pytest.raises(DataError, match=f"into \\$MTX_DATA_DIR, {tmp_path / 'one'} or {cache}, or set"):
        resolve_data_dir(cfg)
    for lang in ("fr", "cs"):
        for split in ("train", "val", "test_2016_flickr"):
            (fake.server / f"{split}.{lang}.gz").write_bytes(gzip.compress(b"x\n"))
    fake.requested.clear()
    assert resolve_data_dir(cfg) == cache.resolve()
    assert "train.en.gz" not in fake.requested and "val.de.gz" not in fake.requested and len(fake.requested) == 10
    assert load_corpus(cache, cfg, ["train"])["train"].num_rows == 3000
    monkeypatch.setenv("MTX_DATA_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match=r"MTX_DATA_DIR=.*/elsewhere lacks train.de, train.en, val.de, val.en \(plain"):
        resolve_data_dir(cfg)
    extra = tmp_path / "extra"  # an extra source language is read from the train split only
    extra.mkdir()
    for name in ("train.de", "train.en", "val.de", "val.en", "train.fr"):
        (extra / name).write_text("x\n")
    monkeypatch.setenv("MTX_DATA_DIR", str(extra))
    assert resolve_data_dir(DataConfig(dir="auto", extra_src_langs=("fr",))) == extra.resolve()
    with pytest.raises(DataError, match=r"finds Multi30k only .* not dev.de, dev.en; set data.dir"):
        monkeypatch.delenv("MTX_DATA_DIR")
        resolve_data_dir(DataConfig(dir="auto", valid_split="dev"))


def test_eval_fetches_an_official_test_split_the_data_dir_lacks(
    multi30k_server: FakeMulti30k, small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = multi30k_server
    before = sorted(p.name for p in small_data.iterdir())
    src, tgt = eval_split_files(small_data, "test_2017_flickr", "de", "en")
    cache = tmp_path / "cache" / "mtx" / "multi30k"
    assert (src, tgt) == (cache / "test_2017_flickr.de.gz", cache / "test_2017_flickr.en.gz")
    assert read_lines(tgt) == read_lines(small_data / "val.en")  # the fake's test_2017_flickr
    assert fake.requested == ["test_2017_flickr.de.gz", "test_2017_flickr.en.gz"]
    caplog.clear()
    assert eval_split_files(small_data, "test_2017_flickr", "de", "en") == (src, tgt) and len(fake.requested) == 2
    # said when taken from the cache too (stop 61: a run on the user's own corpus was scored on
    # Multi30k's test_2016_flickr from the cache without a word)
    assert f"test_2017_flickr is not in {small_data}: the official Multi30k test_2017_flickr is scored" in caplog.text
    # a split the data directory holds is read from there, whatever the cache holds
    assert eval_split_files(small_data, "test_2016_flickr", "de", "en")[0] == small_data / "test_2016_flickr.de"
    assert sorted(p.name for p in small_data.iterdir()) == before  # the data directory is never written


def test_eval_split_errors_name_the_fix(multi30k_server: FakeMulti30k, small_data: Path, tmp_path: Path) -> None:
    fake = multi30k_server
    with pytest.raises(DataError, match=r"no test_2099\.de or test_2099\.de\.gz"):  # not an official split
        eval_split_files(small_data, "test_2099", "de", "en")
    with pytest.raises(DataError, match=r"Multi30k's test_2017_mscoco has no 'cs' side \(it has en, de, fr\)"):
        eval_split_files(small_data, "test_2017_mscoco", "cs", "en")
    # the user's own Czech side, no English one: the error named the Czech file, which was there (stop 67)
    own = shutil.copytree(small_data, tmp_path / "own")
    (own / "test_2017_flickr.cs").write_text("Pes.\n")
    for src, tgt in (("cs", "en"), ("en", "cs")):
        with pytest.raises(DataError, match=r"no test_2017_flickr\.en beside test_2017_flickr\.cs; put it there, or"):
            eval_split_files(own, "test_2017_flickr", src, tgt)
    assert fake.requested == []
    # the fake has no test_2018_flickr: a failed download names the files, where to put them, and --src/--ref
    with pytest.raises(
        DataError,
        match=r"cannot download Multi30k .*\(FileNotFoundError: Couldn't find file at .*\); "
        r"put test_2018_flickr\.de\.gz and test_2018_flickr\.en\.gz in .* or .*, or pass --src/--ref",
    ):
        eval_split_files(small_data, "test_2018_flickr", "de", "en")
    assert not (tmp_path / "cache" / "mtx" / "multi30k").exists()  # nothing half-written
    # one side in the cache already: only the other is fetched and named (stop 67: both were)
    cache = tmp_path / "cache" / "mtx" / "multi30k"
    cache.mkdir(parents=True)
    (cache / "test_2018_flickr.en").write_text("A dog.\n")
    with pytest.raises(DataError, match=r"; put test_2018_flickr\.de\.gz in .* or .*, or pass --src/--ref"):
        eval_split_files(small_data, "test_2018_flickr", "de", "en")
    assert fake.requested[-1:] == ["test_2018_flickr.de.gz"]


def test_a_failed_download_without_a_network_says_so() -> None:
    """fsspec reports a failed name lookup as FileNotFoundError(URL), which read as a file missing
    upstream (stop 63); the root cause is named instead."""
    import socket

    def chained(*errors: BaseException) -> BaseException:
        for outer, inner in zip(errors, errors[1:], strict=False):
            outer.__cause__ = inner
        return errors[0]

    url = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/test_2017_flickr.de.gz"
    lookup = socket.gaierror(-2, "Name or service not known")
    no_dns = chained(FileNotFoundError(url), OSError("Cannot connect to host github.com:443"), lookup)
    assert download_reason(no_dns) == "no network: the host name cannot be resolved (Name or service not known)"
    refused = chained(FileNotFoundError(url), ConnectionRefusedError(111, "Connection refused"))
    assert download_reason(refused) == "no connection: ConnectionRefusedError: [Errno 111] Connection refused"
    assert download_reason(FileNotFoundError(url)) == f"FileNotFoundError: {url}"  # a real 404


def test_a_failed_write_leaves_no_partial_file(
    multi30k_server: FakeMulti30k, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):  # `mtx` prints it as one line (tests/test_cli.py)
        eval_split_files(small_data, "test_2017_flickr", "de", "en")
    assert list((tmp_path / "cache" / "mtx" / "multi30k").iterdir()) == []


def test_test_splits_are_known_by_name() -> None:
    """What choose_on_val refuses to choose on, and training warns about validating on."""
    assert all(map(is_test_split, ["test_2016_flickr", "test_2017_mscoco", "test_2018_flickr", "test", "Test2020"]))
    assert not any(map(is_test_split, ["val", "dev", "train", "valid_test_like"]))


def test_lines_of_other_invisible_format_characters_are_empty() -> None:
    # a left-to-right or right-to-left mark, a soft hyphen, a bidi control, a variation selector
    # alone showed nothing but was translated as a sentence (and passed the data's empty-line
    # check), where a zero-width space alone was already an empty line
    for invisible in (
        "\u200e",
        "\u200f",
        "\u00ad",
        "\u202a\u202c",
        "\u2061",
        "\ufe0f",
        "\u034f",
        " \u200e \u200f ",
        "\x00",
        "\x1b\x7f",
    ):
        assert clean_line(invisible) == "", repr(invisible)
    # at either end of a line with text they go too since stop 62; inside it they stay
    assert text_lines("\u200e\nDer Hund.\u200e\n\u200fa\na\u200fb\n".encode(), "x", "the file") == [
        "",
        "Der Hund.",
        "a",
        "a\u200fb",
    ]


def test_one_spaced_reads_whitespace_inside_a_line_as_one_space(shared_data: Path) -> None:
    """Decoding's reading of a source line (stop 72; stop 62's probe: no-break spaces for 10% of
    test_2016_flickr's spaces cost 4.4 BLEU, a doubled space made a phrase twice): each run of
    whitespace of any kind inside the line is one space, and the soft hyphen, zero-width space,
    word joiner and zero-width no-break space go; the zero-width joiners that shape Indic and
    Persian words and emoji stay; the ends go as `clean_line` drops them."""
    assert (
        one_spaced("\u200e Ein\u00a0 Mann\tf\u00e4hrt  Fahr\u00adrad\u200b.\u3000\ufeff")
        == "Ein Mann f\u00e4hrt Fahrrad."
    )
    assert one_spaced("Ein \u200b Mann\u2060,\x0b\x1c\u2028 \u202fder") == "Ein Mann, der"
    assert one_spaced("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 \U0001f468\u200d\U0001f4bb") == (
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 \U0001f468\u200d\U0001f4bb"
    )
    assert one_spaced("\u200b \u00ad") == "" and one_spaced("") == ""
    # the sources of README's test scores are read as before (French, a target there, has 3 lines
    # of doubled spaces)
    for lang, changed in (("de", 0), ("en", 0), ("fr", 3), ("cs", 0)):
        lines = read_lines(shared_data / f"test_2016_flickr.{lang}.gz")
        assert sum(one_spaced(line) != line for line in lines) == changed, lang
    assert one_spaced(one_spaced("a \t\u00a0b ")) == one_spaced("a \t\u00a0b ") == "a b"


def test_files_compressed_otherwise_than_gzip_are_named_so(tmp_path: Path) -> None:
    """bzip2 data behind a .gz name was "not valid UTF-8; re-encode it" (stop 62); text that
    merely starts as a bzip2 header does is text."""
    import bz2
    import lzma

    for name, data, kind in [
        ("a.de.gz", bz2.compress(b"Ein Hund.\n"), "bzip2-compressed"),
        ("b.de", lzma.compress(b"Ein Hund.\n"), "xz-compressed"),
    ]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=rf"{name}: {kind} data; mtx reads plain or gzip files, so decompress it"):
            read_lines(tmp_path / name)
    (tmp_path / "c.de").write_text("BZh9 is a word\n")
    assert read_lines(tmp_path / "c.de") == ["BZh9 is a word"]


def test_no_home_directory_is_one_line_naming_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """`env -i` under a user id with no passwd entry (a container's `--user 12345`): $HOME unset
    and no home directory, so `Path.home()` raised, a traceback where the download cache was
    reached; `~/x` said "no such user" (stop 67)."""
    from mtx.config import user_path
    from mtx.errors import ConfigError

    def no_home(*args: object) -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr(Path, "expanduser", no_home)
    with pytest.raises(DataError, match=r"\$HOME is unset .*; set \$XDG_CACHE_HOME, or \$MTX_DATA_DIR"):
        multi30k_cache()
    with pytest.raises(ConfigError, match=r"cannot expand ~ in '~/x' \(\$HOME is unset and this user has no home"):
        user_path("~/x", "--run-dir")
    with pytest.raises(ConfigError, match=r"cannot expand ~nobody9 in '~nobody9/x' \(no such user\)"):
        user_path("~nobody9/x", "--run-dir")
    # the command line's path options say the same (stop 69's probe: `--run ~/x` said "no such user")
    from mtx.cli import path_arg

    with pytest.raises(argparse.ArgumentTypeError, match=r"^cannot expand ~ in '~/x' \(\$HOME is unset and this"):
        path_arg("~/x")
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert multi30k_cache() == Path("/cache/mtx/multi30k")


def _local_proxy(answer: bytes | None) -> tuple[str, Callable[[], None]]:
    """A proxy on this machine that answers each connection with `answer`, or never (None)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            held.append(conn)
            if answer is not None:
                conn.recv(65536)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()

    def close() -> None:
        for conn in [*held, server]:
            conn.close()

    return f"http://127.0.0.1:{server.getsockname()[1]}", close


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (None, "no answer within 1 s: ConnectionTimeoutError"),
        (b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n", "the proxy refused it: 407"),
    ],
)
def test_a_silent_or_refusing_proxy_ends_the_download_with_its_reason(
    answer: bytes | None, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy or firewall that accepted the connection and sent nothing hung `mtx train` and `mtx
    eval` with no end; a proxy's refusal (407, 403) was "FileNotFoundError: URL", which reads as a
    file missing upstream (stop 67)."""
    import mtx.data

    proxy, close = _local_proxy(answer)
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.setattr(mtx.data, "DOWNLOAD_TIMEOUT_S", 1)
    started = time.monotonic()
    try:
        with pytest.raises(DataError, match=f"cannot download Multi30k from .*\\({reason}"):
            mtx.data.download_multi30k(tmp_path / "mtx" / "multi30k", [("val", "en")])
    finally:
        close()
    assert time.monotonic() - started < 60
    assert not (tmp_path / "mtx" / "multi30k" / "val.en.gz").exists()


# -- stop 69's second mutation probe: behaviour no test pinned ------------------------------------


def _lens(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(3, 40, n)
    return src, np.clip(src + rng.integers(-5, 6, n), 2, None)


def test_a_seeded_plan_shuffles_the_batch_order_and_the_batches_contents() -> None:
    """plan_batches' docstring: equal keys are shuffled by the seed, and so is the order of the
    batches. Without the order shuffle every epoch ran from the shortest batches to the longest;
    without the tie shuffle every epoch had the same batches, only reordered."""
    src, tgt = _lens(3000)
    plan = plan_batches(src, tgt, 400, seed=1)
    lengths = np.array([src[b].max() for b in plan])
    rho = np.corrcoef(np.arange(len(plan)), np.argsort(np.argsort(lengths)))[0, 1]
    assert abs(rho) < 0.3  # not sorted by length
    other = plan_batches(src, tgt, 400, seed=2)
    assert {tuple(sorted(b.tolist())) for b in plan} != {tuple(sorted(b.tolist())) for b in other}


def test_rank_shards_are_dealt_round_robin_from_the_plan() -> None:
    """epoch_batches: after k batches on each of w ranks, exactly the plan's first k * w are used
    (so a run resumes on another number of ranks)."""
    from mtx.data import epoch_batches, epoch_plan

    src, tgt = _lens(999)
    ids = ParallelIds([[4] * (s - 1) for s in src], [[5] * (t - 1) for t in tgt])
    plan = epoch_plan(ids, 400, 1, 0)
    for world in (2, 3):
        for rank in range(world):
            got = [b.n_src_tokens for b in epoch_batches(ids, 400, 1, 0, rank=rank, world_size=world)]
            want = [int(ids.src_lens[plan[k * world + rank]].sum()) for k in range(len(plan) // world)]
            assert got == want


def test_padding_fraction_counts_each_sides_own_padding() -> None:
    from mtx.data import padding_fraction

    ids = ParallelIds([[4] * 9, [4] * 1], [[5] * 1, [5] * 3])  # lengths with EOS: src 10, 2; tgt 2, 4
    # real 10 + 2 + 2 + 4 = 18 of padded 2 * (10 + 4) = 28
    assert padding_fraction(ids, [np.array([0, 1])]) == pytest.approx(1 - 18 / 28)


def test_a_batch_may_hold_exactly_batch_tokens() -> None:
    src = np.full(8, 10)
    assert [len(b) for b in plan_batches(src, src, 40)] == [4, 4]


# -- stop 69's third mutation probe: the training loop's untested behaviour ------------------------


class _WordTok:
    """A stand-in tokenizer: one piece per word (id 10 + the word's length), what encode_batch needs."""

    def __init__(self, extra: int = 0) -> None:
        self.extra = extra  # pieces added to every line (a BPE-dropout segmentation's longer pieces)

    def encode_batch(self, texts, cut: int = 0):  # noqa: ANN001, ANN201
        return [[10 + len(w) for w in t.split()] + [11] * self.extra for t in texts]


def test_max_len_keeps_pairs_of_exactly_max_len_and_drops_a_pair_long_on_either_side() -> None:
    """data.max_len: "drop pairs longer than max_len tokens on either side" (ParallelIds.encode):
    a side of exactly max_len pieces is kept, a target longer than max_len drops its pair."""
    from mtx.data import ParallelIds

    src = ["a b c", "a b", "a", "a b c d"]
    tgt = ["x y", "x y z w", "x y z", "x"]
    ids = ParallelIds.encode(src, tgt, _WordTok(), _WordTok(), max_len=3)
    assert ids.rows == [0, 2]
    assert [len(s) for s in ids.src_ids] == [3, 1] and [len(t) for t in ids.tgt_ids] == [2, 3]


def test_a_bpe_dropout_segmentation_longer_than_max_len_on_the_target_side_keeps_the_old_pieces() -> None:
    """ParallelIds.resegmented: a pair whose new pieces exceed max_len on either side keeps its pieces."""
    from mtx.data import ParallelIds

    src, tgt = ["a b", "a b"], ["x y", "x"]
    old = ParallelIds.encode(src, tgt, _WordTok(), _WordTok(), max_len=3)
    new = old.resegmented(src, tgt, _WordTok(), _WordTok(extra=1), max_len=3)
    # one piece more on each target: 3 and 2 pieces, within max_len, taken
    assert [len(t) for t in new.tgt_ids] == [3, 2]
    longer = old.resegmented(src, tgt, _WordTok(), _WordTok(extra=2), max_len=3)
    # pair 0's target would be 4 pieces: the pair keeps its old pieces; pair 1's is 3: new
    assert [len(t) for t in longer.tgt_ids] == [2, 3]
    assert longer.tgt_ids[0] == old.tgt_ids[0]
