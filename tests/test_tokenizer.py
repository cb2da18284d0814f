from __future__ import annotations

import json
import logging
import os
import random
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mtx.config import DataConfig, TokenizerConfig
from mtx.data import ParallelIds, load_corpus, texts
from mtx.errors import CheckpointError
from mtx.export import exported_tokenizer
from mtx.punctuation import GROUPS, folded, load_folds
from mtx.text import clean_line, one_spaced, read_lines, stripped
from mtx.tokenizer import BOS, BPE, EOS, PAD, UNK, train_bpe, train_or_load


def test_round_trip_over_the_val_split(shared_data: Path) -> None:
    cfg = DataConfig(dir=str(shared_data))
    corpus = load_corpus(shared_data, cfg, ["train", "val"])
    train_src, train_tgt = texts(corpus["train"])
    tok = train_bpe(train_src[:5000] + train_tgt[:5000], TokenizerConfig(vocab_size=2000))
    for lines in texts(corpus["val"]):
        ids = tok.encode_batch(lines)
        assert UNK not in {i for seq in ids for i in seq}
        assert tok.decode_batch(ids) == lines
    assert [tok.tokenizer.token_to_id(t) for t in ("<pad>", "<s>", "</s>", "<unk>")] == [PAD, BOS, EOS, UNK]


def test_nfc_normalisation_and_unseen_characters() -> None:
    tok = train_bpe(["Ein Mann fährt Fahrrad."] * 10, TokenizerConfig(vocab_size=300, min_frequency=1))
    decomposed = "fa\u0308hrt"  # NFD a + combining diaeresis
    assert tok.decode_batch(tok.encode_batch([decomposed])) == ["fährt"]
    assert tok.decode_batch(tok.encode_batch(["Ωμέγα 😀"])) == ["Ωμέγα 😀"]


def test_special_tokens_written_in_text_are_text_and_outputs_are_one_line(tmp_path: Path) -> None:
    """ "</s>" or "<pad>" typed in a sentence are characters, not EOS or PAD (stop 53: a <pad> in a
    source was masked as padding, an "</s>" ended it); a piece that spells a line break decodes to
    a space, so a translation never splits across lines of a hypotheses file."""
    tok = train_bpe(["Ein Mann fährt Fahrrad."] * 10, TokenizerConfig(vocab_size=300, min_frequency=1))
    tok.save(tmp_path / "tokenizer.json")
    for t in (tok, BPE.load(tmp_path / "tokenizer.json"), tok.with_dropout(0.1)):
        text = "Ein <pad> Mann </s> fährt <s> <unk> Fahrrad."
        (ids,) = t.encode_batch([text])
        assert not {PAD, BOS, EOS, UNK} & set(ids)
        assert t.decode_batch([ids]) == [text]
    pieces = tok.encode_batch(["a\nb\r\nc\u2028d\x0be"])[0]
    (out,) = tok.decode_batch([pieces])
    assert out == "a b c d e" and len(out.splitlines()) == 1


def test_per_language_tokenizers_are_saved_and_reloaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = TokenizerConfig(vocab_size=300, joint=False, min_frequency=1)
    with caplog.at_level(logging.INFO, logger="mtx.tokenizer"):
        src, tgt = train_or_load(tmp_path, cfg, "de", "en", ["Hallo Welt"] * 5, ["Hello world"] * 5)
    assert "trained BPE of de: " in caplog.text and "trained BPE of en: " in caplog.text  # (stop 63)
    assert (tmp_path / "tokenizer.de.json").is_file() and (tmp_path / "tokenizer.en.json").is_file()
    src2, tgt2 = train_or_load(tmp_path, cfg, "de", "en", [], [])
    assert src2.fingerprint() == src.fingerprint() and tgt2.fingerprint() == tgt.fingerprint()
    assert src.fingerprint() != tgt.fingerprint()
    assert isinstance(BPE.load(tmp_path / "tokenizer.de.json"), BPE)


def test_a_tokenizer_in_a_directory_named_in_bytes_other_than_utf8_is_saved_and_loaded(tmp_path: Path) -> None:
    """Linux allows any bytes in a file name, and `tokenizers`' `from_file` takes a UTF-8 path
    (stop 58: the tokenizer of such a run directory could not be loaded)."""
    run = tmp_path / os.fsdecode(b"run \xff")
    try:
        run.mkdir()
    except OSError:
        pytest.skip("this file system takes UTF-8 names only")
    tok = train_bpe(["Ein Mann fährt Fahrrad."] * 10, TokenizerConfig(vocab_size=300, min_frequency=1))
    tok.save(run / "tokenizer.json")
    assert BPE.load(run / "tokenizer.json").fingerprint() == tok.fingerprint()


def test_bpe_dropout_resegments_over_the_same_vocabulary(shared_data: Path) -> None:
    cfg = DataConfig(dir=str(shared_data))
    train_src, train_tgt = texts(load_corpus(shared_data, cfg, ["train"])["train"])
    tok = train_bpe(train_src[:5000] + train_tgt[:5000], TokenizerConfig(vocab_size=2000))
    lines = train_src[:300]
    plain = tok.encode_batch(lines)
    drop = tok.with_dropout(0.1)
    first, second = drop.encode_batch(lines), drop.encode_batch(lines)
    assert drop.fingerprint() == tok.fingerprint()
    assert first != second and first != plain  # a fresh random segmentation on every call
    assert sum(map(len, plain)) < sum(map(len, first))  # skipped merges leave more, shorter pieces
    assert drop.decode_batch(first) == lines
    assert tok.encode_batch(lines) == plain  # the tokenizer it was copied from is unchanged
    # an epoch's dropout segmentation keeps every pair data.max_len kept, a pair whose new pieces
    # are too many keeping its plain ones (stop 63: filtered again, the longest pairs dropped out)
    kept = ParallelIds.encode(lines, lines, tok, tok, max_len=20)
    texts_kept = [lines[i] for i in kept.rows]
    assert 0 < len(kept) < len(lines) and all(len(plain[i]) <= 20 for i in kept.rows)
    again = kept.resegmented(texts_kept, texts_kept, tok.with_dropout(0.5), tok.with_dropout(0.5), 20)
    assert len(again) == len(kept) and max(map(len, again.src_ids + again.tgt_ids)) <= 20
    fell_back = [i for i, s in enumerate(again.src_ids) if s == kept.src_ids[i]]
    assert len(fell_back) < len(kept) and tok.decode_batch(again.src_ids) == texts_kept


def test_a_tokenizer_file_with_other_special_ids_is_named_and_a_small_vocabulary_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The special-token error named no file; a vocab_size the text cannot fill was an info line."""
    with caplog.at_level(logging.WARNING, logger="mtx.tokenizer"):
        tok = train_bpe(["Ein Mann fährt Fahrrad."] * 10, TokenizerConfig(vocab_size=100_000, min_frequency=1))
    assert f"trained BPE: {tok.vocab_size} pieces, fewer than tokenizer.vocab_size=100000" in caplog.text
    spec = json.loads(tok.tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab["<pad>"], vocab["<s>"] = vocab["<s>"], vocab["<pad>"]
    for added in spec["added_tokens"]:
        added["id"] = {"<pad>": 1, "<s>": 0}.get(added["content"], added["id"])
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match=r"^.*/tokenizer\.json: tokenizer: special token <pad> must have id 0$"):
        BPE.load(tmp_path / "tokenizer.json")


def test_a_tokenizer_file_from_tokenizers_0_20_on_0_19_names_the_version_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokenizers 0.19 cannot read 0.20's merges; its enum error read as a damaged file (stop 64)."""
    import mtx.tokenizer

    tok = train_bpe(["Ein Mann fährt Fahrrad."] * 10, TokenizerConfig(vocab_size=300, min_frequency=1))
    tok.save(tmp_path / "tokenizer.json")
    enum_error = "data did not match any variant of untagged enum ModelWrapper at line 4032 column 3"

    def from_str(text: str) -> None:
        raise Exception(enum_error)

    monkeypatch.setattr(mtx.tokenizer.Tokenizer, "from_str", from_str)
    with pytest.raises(CheckpointError) as plain:  # on 0.20+ the same error means a damaged file
        BPE.load(tmp_path / "tokenizer.json")
    assert str(plain.value).endswith(f"tokenizer.json: cannot load tokenizer ({enum_error})")
    monkeypatch.setattr(mtx.tokenizer.tokenizers, "__version__", "0.19.1")
    with pytest.raises(CheckpointError, match=r"needs tokenizers>=0\.20, 0\.19\.1 is installed"):
        BPE.load(tmp_path / "tokenizer.json")


def test_a_long_line_is_cut_before_tokenising_and_keeps_the_pieces_read(shared_data: Path) -> None:
    """Decoding reads a source's first model.max_positions - 1 pieces (and whether there are more),
    training whether a pair has more than data.max_len; the whole line was tokenised first, about
    37 bytes of memory per input byte (stop 65: 6.8 GB for a 32 MB one-word line)."""
    cfg = DataConfig(dir=str(shared_data))
    val_src, val_tgt = texts(load_corpus(shared_data, cfg, ["val"])["val"])
    tok = train_bpe(val_src + val_tgt, TokenizerConfig(vocab_size=2000))
    assert tok.encode_batch(val_src, 200) == tok.encode_batch(val_src)  # lines short enough: as they were
    seps = [" ", "  ", "\t", " - ", "\u00a0", " 12 ", "e\u0301 ", ", "]  # doubled spaces, digits, NFD e + accent
    long_lines = [
        "".join(line + seps[i % len(seps)] for i, line in enumerate(val_src[start:])) for start in (0, 7, 300)
    ]
    long_lines.append("a" * 1_000_000)  # one word: cut inside, far past the pieces read
    long_lines.append("Ein " + "Fahrrad" * 200_000 + " fährt.")
    for pieces in (5, 40, 255):
        whole = tok.encode_batch(long_lines)
        cut = tok.encode_batch(long_lines, pieces)
        for text, full, ids in zip(long_lines, whole, cut, strict=True):
            assert len(tok.head(text, pieces + 1)) < len(text)
            assert pieces < len(ids) < len(full) and ids[:pieces] == full[:pieces]
        for full, ids in zip(whole[:3], cut[:3], strict=True):  # cut at a space: a prefix of the whole
            assert ids == full[: len(ids)]
    kept = ParallelIds.encode(long_lines + val_src[:5], long_lines + val_tgt[:5], tok, tok, max_len=40)
    assert kept.rows == list(range(len(long_lines), len(long_lines) + 5))
    # decomposed text, which NFC makes shorter, over pieces of composed letters (stop 65: a cut
    # counted in characters held two thirds of the pieces asked for)
    word = "\u01fa" * 16 + "A"  # Ǻ x 16: decomposed, A + ring + acute x 16
    tok = train_bpe([" ".join([word] * 20)] * 200, TokenizerConfig(vocab_size=300))
    text = " ".join([unicodedata.normalize("NFD", word)] * 1000)
    whole, cut = tok.encode_batch([text])[0], tok.encode_batch([text], 159)[0]
    assert len(whole) == 1000 and 159 < len(cut) < 1000 and cut == whole[: len(cut)]


def test_the_exported_tokenizers_read_and_write_a_line_as_mtx_does(tiny_run: Path, small_data: Path) -> None:
    """`mtx export`'s tokenizer files: a line's invisible ends, the special tokens' text in it
    and line breaks in the output are treated as mtx treats them (stop 65: the files kept a
    direction mark before a line, read `</s>` in it as the end of sentence, and the README had
    each user strip the ends by hand)."""
    tok = BPE.load(tiny_run / "tokenizer.json")
    source = Tokenizer.from_str(exported_tokenizer(tok, source=True).to_str())  # as a user loads the file
    target = Tokenizer.from_str(exported_tokenizer(tok, source=False).to_str())
    ends = [c for c in map(chr, range(0x3100)) if stripped(c)] + ["\ufeff", "\U000e0001", "\U000e0100"]
    rng = random.Random(0)
    lines = read_lines(small_data / "val.de")[:200]
    for line in lines:
        text = "".join(rng.choices(ends, k=rng.randint(0, 3))) + line + "".join(rng.choices(ends, k=rng.randint(0, 3)))
        if rng.random() < 0.3:
            text = text.replace(" ", rng.choice([" </s> ", " <unk><pad> ", "\u200b", "\t\t"]), 1)
        assert source.encode(text, add_special_tokens=False).ids == tok.encode_batch([clean_line(text)])[0], text
    breaks = [i for piece, i in tok.tokenizer.get_vocab().items() if "Ċ" in piece or "č" in piece]  # \n, \r bytes
    for _ in range(300):
        ids = rng.choices(range(tok.vocab_size), k=rng.randint(0, 10)) + rng.choices(breaks + [EOS, UNK], k=2)
        rng.shuffle(ids)
        assert target.decode(ids).strip() == tok.decode_batch([ids])[0]
    assert target.encode("Ein </s> Mann", add_special_tokens=False).ids[1] == EOS  # the target's specials stay special


def test_the_exported_source_tokenizer_reads_spaces_and_punctuation_as_decoding_does(
    tiny_run: Path, small_data: Path
) -> None:
    """Under `decode.normalize_spaces` (stop 72) the exported source file reads a line as
    `encode_batch(one_space=True)` does: runs of whitespace inside it one space, soft hyphens and
    zero-width spaces gone, its ends as before; and under `decode.normalize_punctuation` (stop 73)
    the punctuation the run's training sources lack as `encode_batch(folds=...)` reads it."""
    tok = BPE.load(tiny_run / "tokenizer.json")
    read_as = load_folds(tiny_run, "de")
    assert read_as['"'] == "\u201c"  # (the slice's train.de: `"` twice, `“` 20 times)
    source = Tokenizer.from_str(exported_tokenizer(tok, True, True, read_as).to_str())
    marks = "".join(GROUPS)
    spaces = ["  ", "\t", "\u00a0", " \u3000 ", "\u2009", "\x0b\x0c", " \u200b "]
    inside = ["\u00ad", "\u200b", "\u2060", "\ufeff", "\u200c"]
    rng = random.Random(0)
    changed = 0
    for line in read_lines(small_data / "val.de")[:200]:
        first, *words = line.split(" ")
        text = first + "".join((rng.choice(spaces) if rng.random() < 0.3 else " ") + word for word in words)
        cut = rng.randrange(len(text) + 1)
        text = rng.choice(spaces) + text[:cut] + rng.choice(inside) + text[cut:] + rng.choice(["", " \u200e"])
        text = "".join(rng.choice(marks) if char == " " and rng.random() < 0.2 else char for char in text)
        want = tok.encode_batch([text], one_space=True, folds=read_as)[0]
        assert source.encode(text, add_special_tokens=False).ids == want, repr(text)
        assert want == tok.encode_batch(folded([one_spaced(text)], read_as))[0]
        changed += want != tok.encode_batch([text])[0]
    assert changed > 150  # read as written, nearly every line's pieces differ


def test_a_line_too_long_for_a_sentence_is_left_out_of_bpe_training(caplog: pytest.LogCaptureFixture) -> None:
    """A 1 MB line trained BPE for minutes, its merges' cost growing with its square, and Ctrl-C
    waited for them (stop 65)."""
    lines = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."] * 20
    cfg = TokenizerConfig(vocab_size=300, min_frequency=1)
    with caplog.at_level(logging.WARNING):
        tok = train_bpe([*lines, "Fahrrad" * 3_000], cfg, "de")
    assert tok.tokenizer.get_vocab() == train_bpe(lines, cfg).tokenizer.get_vocab()
    assert "1 training line(s) of de longer than 20000 characters left out of BPE training" in caplog.text


# -- stop 69's second mutation probe: behaviour no test pinned ------------------------------------


def test_a_vocabularys_fingerprint_is_the_one_earlier_mtx_saved() -> None:
    """Checkpoints store the tokenizers' fingerprint and every load compares it: a change to
    how it is computed makes every earlier run's checkpoints "not from this run". Pinned here on a
    hand-made vocabulary (no BPE training, so no library version enters it)."""
    from tokenizers import Tokenizer, models

    from mtx.tokenizer import BPE, SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, "a", "b", "ab", "Ġc", "z"])}
    tok = BPE(Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>")))
    assert tok.fingerprint() == PINNED_FINGERPRINT


PINNED_FINGERPRINT = "47cd9268333313ae"  # computed by the stop-69 snapshot


def test_a_joint_vocabulary_is_trained_on_both_sides_and_separate_ones_on_their_own(tmp_path: Path) -> None:
    from mtx.config import TokenizerConfig
    from mtx.tokenizer import train_or_load

    src = ["der Hund und die Katze spielen im Garten"] * 50
    tgt = ["the dog and the cat are playing in the garden"] * 50
    cfg = TokenizerConfig(vocab_size=400, joint=True)
    joint, _ = train_or_load(tmp_path / "j", cfg, "de", "en", src, tgt)
    assert "Ġgarden" in joint.tokenizer.get_vocab() and "ĠGarten" in joint.tokenizer.get_vocab()
    (tmp_path / "s").mkdir()
    sep = TokenizerConfig(vocab_size=400, joint=False)
    de, en = train_or_load(tmp_path / "s", sep, "de", "en", src, tgt)
    assert "ĠGarten" in de.tokenizer.get_vocab() and "Ġgarden" not in de.tokenizer.get_vocab()
    from mtx.tokenizer import BPE

    assert "Ġgarden" in BPE.load(tmp_path / "s" / "tokenizer.en.json").tokenizer.get_vocab()


def test_encode_batch_reads_a_line_as_mtx_reads_it() -> None:
    from mtx.config import TokenizerConfig
    from mtx.tokenizer import train_bpe

    tok = train_bpe(["eine Gruppe von Männern"] * 20, TokenizerConfig(vocab_size=300))
    assert tok.encode_batch(["\ufeffeine Gruppe\u200b  "]) == tok.encode_batch(["eine Gruppe"])


def test_min_frequency_leaves_out_merges_seen_fewer_times() -> None:
    """tokenizer.min_frequency reaches BPE training (stop 69's mutation probe: fixed at 2, it passed
    every test): a pair seen twice is merged at 2, not at 3."""
    texts = ["ab"] * 2 + ["cd"] * 5
    config = {n: TokenizerConfig(vocab_size=300, min_frequency=n) for n in (2, 3)}
    vocabs = {n: train_bpe(texts, cfg).tokenizer.get_vocab() for n, cfg in config.items()}
    assert "Ġab" in vocabs[2] and "Ġab" not in vocabs[3]
    assert "Ġcd" in vocabs[2] and "Ġcd" in vocabs[3]


def test_tokenizing_goes_on_one_thread_where_its_threads_cannot_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under a low `ulimit -u` tokenizers' thread pool panics (pyo3's PanicException, a
    BaseException: stop 67's probe, a traceback); mtx tokenizes again on the calling thread with
    a warning (checked as user nobody under `ulimit -u 4`: the translation, after Rust's panic
    message). Other exceptions pass through."""
    from mtx import tokenizer as tokenizer_module

    class PanicException(BaseException):  # as pyo3 names it
        pass

    calls: list[str | None] = []  # TOKENIZERS_PARALLELISM at each call

    def pool_fails_once() -> str:
        calls.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        if len(calls) == 1:
            raise PanicException(
                "The global thread pool has not been initialized.: ThreadPoolBuildError { kind: IOError(Os { "
                'code: 11, kind: WouldBlock, message: "Resource temporarily unavailable" }) }'
            )
        return "done"

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # (and restored after the test)
    with caplog.at_level(logging.WARNING):
        assert tokenizer_module.serial_if_no_threads(pool_fails_once) == "done"
    assert calls == ["true", "false"]
    assert "tokenizers could not start its threads (Resource temporarily unavailable; the limit" in caplog.text

    def other() -> str:
        raise PanicException("index out of bounds")

    with pytest.raises(PanicException):
        tokenizer_module.serial_if_no_threads(other)
    with pytest.raises(KeyboardInterrupt):
        tokenizer_module.serial_if_no_threads(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
