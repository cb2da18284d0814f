"""Scores as `mtx eval` prints them: sacreBLEU's signatures, bootstrap intervals, paired tests."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

from mtx.cli import main
from mtx.evaluate import BYTES_PER_RESAMPLED, PairedResult, corpus_scores, paired_tests


@pytest.fixture(scope="module")
def refs(shared_data: Path) -> list[str]:
    with gzip.open(shared_data / "val.en.gz", "rt", encoding="utf-8") as f:
        return [line.strip() for line, _ in zip(f, range(300), strict=False)]


def drop_words(lines: list[str], p: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(w for w in line.split() if rng.random() >= p) for line in lines]


def test_scores_are_sacrebleus_own_with_its_signatures(refs: list[str]) -> None:
    """BLEU (13a, cased; lowercased on request) and chrF (not chrF++) as sacreBLEU computes
    them, with sacreBLEU's signatures."""
    import sacrebleu

    hyps = drop_words(refs, 0.3, 0)
    scores, low = corpus_scores(hyps, refs), corpus_scores(hyps, refs, lowercase=True)
    assert scores.bleu == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert low.bleu == sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score
    assert scores.chrf == sacrebleu.corpus_chrf(hyps, [refs]).score
    version = sacrebleu.__version__
    assert scores.bleu_signature == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{version}"
    assert low.bleu_signature == f"nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:{version}"
    assert scores.chrf_signature == f"nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:{version}"
    # sacreBLEU's verbose part: n-gram precisions, brevity penalty, lengths (stop 63: not shown)
    assert scores.bleu_details == sacrebleu.corpus_bleu(hyps, [refs])._verbose
    assert "BP = " in scores.bleu_details and scores.bleu_bp < 1  # words dropped: too short


def test_scores_made_in_chunks_are_the_whole_corpus_scores(refs: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `SCORE_CHUNK` sentences (without resampling) the statistics are summed a chunk at a
    time (stop 68's probe: sacreBLEU's held 7.9 GB for 290,000 sentences): every number and
    signature is the whole corpus's, to the last digit."""
    import mtx.evaluate

    hyps = drop_words(refs, 0.3, 0)
    whole = corpus_scores(hyps, refs)
    monkeypatch.setattr(mtx.evaluate, "SCORE_CHUNK", 7)  # 300 sentences: 43 chunks, the last of 6
    chunked = corpus_scores(hyps, refs)
    assert chunked == whole and 20 < whole.bleu < 80 and whole.bleu_bp < 1  # every field: scores, lengths, details


def test_bootstrap_intervals_are_seeded_and_bracket_the_score(refs: list[str]) -> None:
    hyps = drop_words(refs, 0.3, 0)
    plain, resampled = corpus_scores(hyps, refs), corpus_scores(hyps, refs, bootstrap=200)
    assert resampled.bleu == plain.bleu and resampled.chrf == plain.chrf  # the score itself is unchanged
    assert "bs:200|seed:12345" in resampled.bleu_signature and "bs:" not in plain.bleu_signature
    assert plain.bleu_ci is None and "bleu_ci" not in plain.as_dict()
    for score, mean, ci in (
        (resampled.bleu, resampled.bleu_mean, resampled.bleu_ci),
        (resampled.chrf, resampled.chrf_mean, resampled.chrf_ci),
    ):
        assert 0 < ci < 10 and abs(mean - score) < ci
    assert corpus_scores(hyps, refs, bootstrap=200) == resampled  # seeded: a rerun prints the same interval


def test_paired_test_finds_a_real_difference_and_none_between_identical_outputs(refs: list[str]) -> None:
    good, bad = drop_words(refs, 0.1, 1), drop_words(refs, 0.4, 2)
    better, same = paired_tests(good, [("bad", bad), ("good again", list(good))], refs, 200)
    assert better.name == "bad" and better.bleu == pytest.approx(corpus_scores(bad, refs).bleu)
    assert better.bleu_delta == pytest.approx(corpus_scores(good, refs).bleu - better.bleu) and better.bleu_delta > 10
    assert better.bleu_p < 0.05 and better.chrf_p < 0.05
    assert (same.bleu_delta, same.chrf_delta, same.bleu_p, same.chrf_p) == (0.0, 0.0, 1.0, 1.0)
    # outputs that differ only in spacing give both metrics the same statistics sentence by
    # sentence: no difference to test, p = 1 (stop 53; sacreBLEU's rule gave p = 0.005, "significant")
    spaced = [line.replace(" ", "  ").replace(".", " .") for line in good]
    assert sum(a != b for a, b in zip(spaced, good, strict=True)) > 250
    (respaced,) = paired_tests(good, [("spaced", spaced)], refs, 200)
    assert (respaced.bleu_delta, respaced.chrf_delta, respaced.bleu_p, respaced.chrf_p) == (0.0, 0.0, 1.0, 1.0)
    # a small difference is not called significant: one sentence changed among 300
    nearly = [*good[:-1], bad[-1]]
    (close,) = paired_tests(good, [("nearly", nearly)], refs, 200)
    assert 0 < abs(close.bleu_delta) < 0.5 and close.bleu_p > 0.05
    assert set(better.as_dict()) == {"name", "bleu", "chrf", "bleu_delta", "chrf_delta", "bleu_p", "chrf_p"}


def test_eval_prints_intervals_and_paired_tests(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = tmp_path / "greedy.en"
    args = ["eval", "--run", str(tiny_run), "--split", "val", "--beam", "1"]
    assert main([*args, "--output", str(first), "--bootstrap", "100", "--json", "--lowercase"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"bleu_mean", "bleu_ci", "chrf_mean", "chrf_ci"} <= set(result) and "bs:100" in result["bleu_signature"]
    # what was decoded and scored, named (stop 63: "checkpoints" was [] for the run's default one)
    assert result["checkpoints"] == [str(tiny_run / "checkpoints" / "best.pt")]
    assert result["ref_file"].endswith("val.en") and result["src_file"].endswith("val.de")
    assert result["length_penalty"] is None and "BP = " in result["bleu_details"]  # greedy has no length penalty
    # the lowercased BLEU gets its interval too (stop 52)
    assert {"bleu_lowercase_mean", "bleu_lowercase_ci"} <= set(result)
    assert "case:lc" in result["bleu_lowercase_signature"] and "bs:100" in result["bleu_lowercase_signature"]
    # the same decoding against its own earlier output: identical, so no difference and p = 1
    assert main([*args, "--output", str(tmp_path / "again.en"), "--paired", str(first)]) == 0
    out = capsys.readouterr().out
    assert f"against {first}: BLEU {result['bleu']:.2f} -> {result['bleu']:.2f} (+0.00, p = 1.0000)" in out
    assert "paired bootstrap, 1000 resamples" in out
    assert "beam 1, fp32" in out and "length penalty" not in out and "     " + result["bleu_details"] in out
    assert main([*args[:-2], "--beam", "2", "--json", "--output", str(tmp_path / "b2.en"), "--paired", str(first)]) == 0
    beam2 = json.loads(capsys.readouterr().out)
    assert beam2["length_penalty"] == 1.0 and beam2["paired_resamples"] == 1000
    assert main([*args[:-2], "--beam", "2", "--length-penalty", "0.6", "--output", str(tmp_path / "b2.en")]) == 0
    assert "beam 2, length penalty 0.6, fp32" in capsys.readouterr().out
    # mistakes are one line, before decoding
    (tmp_path / "short.en").write_text("a\nb\n")
    assert main([*args, "--paired", str(tmp_path / "short.en")]) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"mtx: error: --paired {tmp_path / 'short.en'}: 2 lines for the 200 sentences of val"
    )
    (tmp_path / "one.en").write_text("a\n")  # (stop 69's probe: "1 lines")
    assert main([*args, "--paired", str(tmp_path / "one.en")]) == 1
    assert "one.en: 1 line for the 200 sentences of val" in capsys.readouterr().err
    # one file twice: its test was printed twice without a word (stop 69's probe)
    assert main([*args, "--paired", str(first), "--paired", str(first)]) == 1
    assert capsys.readouterr().err == f"mtx: error: --paired {first} is given twice; give each system's output once\n"
    assert main([*args, "--bootstrap", "10"]) == 1
    assert "--bootstrap must be 0 (off) or at least 100" in capsys.readouterr().err
    # resamples past 2 GiB (before, found after decoding, if memory allowed): 200 x (2,000,000 x 10 + 2,000) bytes
    assert main([*args, "--bootstrap", "2000000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2000000 bootstrap resamples of 200 sentences take 3.7 GiB" in err
    assert "pass --bootstrap 1073541 or fewer" in err  # (2 GiB / 200 - 2,000) / 10
    # where fewer than the least resamples fit, it said to pass that fewer (stop 68's probe, at 290,000 lines)
    import mtx.evaluate

    monkeypatch.setattr(mtx.evaluate, "MAX_RESAMPLING_BYTES", 200 * (99 * 10 + 2_000))  # 99 resamples of 200 fit
    for option, named in (("--bootstrap", "100 bootstrap resamples of"), ("--paired", "(--paired's test) of")):
        assert main([*args, option, "100" if option == "--bootstrap" else str(first)]) == 1
        err = capsys.readouterr().err
        assert named in err and err.strip().endswith("they take at most 199 sentences; score a sample of the lines")
    monkeypatch.setattr(mtx.evaluate, "MAX_RESAMPLING_BYTES", 200 * (100 * 10 + 2_000))  # 100 fit
    assert main([*args, "--bootstrap", "100", "--json"]) == 0
    capsys.readouterr()


def test_the_bootstrap_memory_guard_counts_what_resampling_holds(
    refs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """eval refuses resamples whose memory would run out after decoding; its bytes per resampled
    sentence must cover what resampling allocates (stop 53: counted as 8, the indices alone, where
    sacreBLEU held about 80, so the 2 GB limit let through 20 GB). Since stop 75 mtx resamples
    sacreBLEU's statistics a resample at a time: the indices alone grow with the resamples."""
    import tracemalloc

    import mtx.evaluate

    hyps, other = drop_words(refs, 0.3, 0), drop_words(refs, 0.3, 1)
    resampled = mtx.evaluate._resampled_scores

    def measured(*args: Any) -> Any:
        tracemalloc.reset_peak()  # from here: what resampling holds (the references' n-grams are freed)
        return resampled(*args)

    monkeypatch.setattr(mtx.evaluate, "_resampled_scores", measured)
    # sacreBLEU's tokenizers keep the last 65,536 sentences they split (an LRU cache): where earlier
    # tests' scoring had pushed these out, the first measured call also counted their entries
    # (stop 61: 96 bytes a sentence after the whole of test_cli.py, 80 alone)
    paired_tests(hyps, [("o", other)], refs, 100)

    def peak(n: int, paired: bool) -> int:
        tracemalloc.start()
        try:
            if paired:
                paired_tests(hyps, [("o", other)], refs, n)
            else:
                corpus_scores(hyps, refs, bootstrap=n)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    for paired in (False, True):  # bytes per resampled sentence: the growth from 1,000 to 3,000 resamples
        fewer = peak(1_000, paired)  # (a run's peak moves by some 0.3 MB: 4.8 MB of growth measures it)
        per_sentence = (peak(3_000, paired) - fewer) / (2_000 * len(refs))
        assert 6 < per_sentence <= BYTES_PER_RESAMPLED, (paired, per_sentence)  # the indices: 8


def test_references_are_scored_as_sacrebleu_reads_them(
    tiny_run: Path, shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Invisible characters at a reference line's ends are kept, with a warning: BLEU is what the
    sacreBLEU CLI gives for the same files (stop 63: they were removed without a word, 24.26
    printed where sacreBLEU gave 19.78)."""
    import sacrebleu

    with gzip.open(shared_data / "val.de.gz", "rt", encoding="utf-8") as f:
        src = [line.strip() for line, _ in zip(f, range(40), strict=False)]
    with gzip.open(shared_data / "val.en.gz", "rt", encoding="utf-8") as f:
        refs = [line.strip() for line, _ in zip(f, range(40), strict=False)]
    (tmp_path / "src.de").write_text("\n".join(src) + "\n", encoding="utf-8")
    marked = ["\u200e" + r + "\u200b " for r in refs[:30]] + refs[30:]  # a direction mark, a zero-width space
    (tmp_path / "ref.en").write_text("\ufeff" + "\n".join(marked) + "\n", encoding="utf-8")
    hyps = tmp_path / "hyps.en"
    args = ["eval", "--run", str(tiny_run), "--src", str(tmp_path / "src.de"), "--beam", "1", "--json"]
    assert main([*args, "--ref", str(tmp_path / "ref.en"), "--output", str(hyps)]) == 0
    out, err = capsys.readouterr()
    scored = json.loads(out)
    hyp_lines = hyps.read_text(encoding="utf-8").splitlines()
    as_read = ["\ufeff" + marked[0].rstrip()] + [r.rstrip() for r in marked[1:]]
    assert scored["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyp_lines, [as_read]).score, abs=0.005)
    assert "30 of 40 reference lines begin or end with invisible characters" in err
    # the clean file: no warning, a higher score; another system's output is read the same way
    (tmp_path / "clean.en").write_text("\n".join(refs) + "\n", encoding="utf-8")
    (tmp_path / "other.en").write_text("\n".join("\u200b" + h for h in hyp_lines) + "\n", encoding="utf-8")
    assert main([*args, "--ref", str(tmp_path / "clean.en"), "--paired", str(tmp_path / "other.en")]) == 0
    out, err = capsys.readouterr()
    clean = json.loads(out)
    assert clean["bleu"] > scored["bleu"] and "reference lines begin or end" not in err
    assert f"--paired {tmp_path / 'other.en'}: 40 of 40 output lines begin or end with invisible" in err


def test_a_resampling_seed_that_sacrebleu_misreads_is_refused_before_decoding(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """sacreBLEU reads $SACREBLEU_SEED: `abc` ended `eval --bootstrap` in a traceback after
    decoding, and 0 left its paired test unseeded (p changed from run to run) while the signature
    said seed:0 (stop 68's probe)."""
    from mtx.evaluate import resampling_seed_problem

    args = ["eval", "--run", str(tiny_run), "--split", "val", "--beam", "1", "--bootstrap", "100"]
    for seed, said in (
        ("abc", "SACREBLEU_SEED='abc': sacreBLEU's resampling seed"),
        ("0", "reads 0 as no seed"),
        ("-5", "SACREBLEU_SEED='-5': sacreBLEU's resampling seed must not be negative"),
    ):
        monkeypatch.setenv("SACREBLEU_SEED", seed)
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "decoding" not in err, err
    for fine in ("none", "None", "7"):
        monkeypatch.setenv("SACREBLEU_SEED", fine)
        assert resampling_seed_problem() is None
    monkeypatch.delenv("SACREBLEU_SEED")
    assert resampling_seed_problem() is None


# -- stop 69's second mutation probe: behaviour no test pinned ------------------------------------


@pytest.mark.parametrize("chunk", [10_000, 7])
def test_each_scores_interval_is_sacrebleus_own_for_that_metric(
    refs: list[str], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printed 95% intervals are sacreBLEU's, each metric's own (BLEU's and chrF's differ:
    a mix-up still satisfies 0 < ci < 10 and |mean - score| < ci), to the last digit, with the
    signature's seed and resamples, whether the statistics are read whole or a chunk at a time
    (since stop 75 mtx resamples sacreBLEU's statistics itself, one resample at a time)."""
    from sacrebleu.metrics import BLEU, CHRF

    import mtx.evaluate

    monkeypatch.setattr(mtx.evaluate, "SCORE_CHUNK", chunk)  # 7: 300 sentences in 43 chunks
    hyps = drop_words(refs, 0.3, 0)
    got = corpus_scores(hyps, refs, bootstrap=200)
    bleu, chrf = BLEU(tokenize="13a"), CHRF()
    b, c = bleu.corpus_score(hyps, [refs], n_bootstrap=200), chrf.corpus_score(hyps, [refs], n_bootstrap=200)
    assert abs(b._ci - c._ci) > 0.05  # the two intervals can be told apart
    assert (got.bleu_mean, got.bleu_ci, got.chrf_mean, got.chrf_ci) == (b._mean, b._ci, c._mean, c._ci)
    assert (got.bleu, got.chrf) == (b.score, c.score)
    assert (got.bleu_signature, got.chrf_signature) == (str(bleu.get_signature()), str(chrf.get_signature()))


def _sacrebleus_paired_test(this: list[str], other: list[str], refs: list[str]) -> dict:
    """sacreBLEU's own paired bootstrap test (300 resamples) of `this` against `other`, by metric."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    test = PairedTest(
        [("other", other), ("this", this)], {"BLEU": BLEU(tokenize="13a"), "chrF": CHRF()}, [refs], "bs", 300
    )
    return test()[1]


@pytest.mark.parametrize("chunk", [10_000, 7])
def test_each_paired_p_value_is_sacrebleus_own_for_that_metric(
    refs: list[str], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paired test's p-values are sacreBLEU's paired bootstrap of each metric (to the last
    digit, its statistics read whole or a chunk at a time): where BLEU's difference is not
    significant and chrF's is, they differ."""
    import mtx.evaluate

    monkeypatch.setattr(mtx.evaluate, "SCORE_CHUNK", chunk)
    good = drop_words(refs, 0.1, 1)
    # the other system: the same words, some misspelt by one letter (chrF sees the letters right)
    rng = random.Random(5)
    other = [" ".join(w[:-1] + "x" if len(w) > 5 and rng.random() < 0.01 else w for w in line.split()) for line in good]
    (result,) = paired_tests(good, [("other", other)], refs, 300)
    scores = _sacrebleus_paired_test(good, other, refs)
    (b_other, b_this), (c_other, c_this) = scores["BLEU"], scores["chrF2"]
    assert (result.bleu_p, result.chrf_p) == (b_this.p_value, c_this.p_value)
    assert (result.bleu, result.chrf) == (b_other.score, c_other.score)
    assert (result.bleu_delta, result.chrf_delta) == (b_this.score - b_other.score, c_this.score - c_other.score)
    assert result.bleu_p != result.chrf_p  # the test tells them apart
    # against several systems at once (this one's statistics read once): each as against it alone
    assert paired_tests(good, [("refs", refs), ("other", other), ("same", good)], refs, 300) == [
        *paired_tests(good, [("refs", refs)], refs, 300),
        result,
        PairedResult("same", (own := corpus_scores(good, refs)).bleu, own.chrf, 0.0, 0.0, 1.0, 1.0),
    ]
    # --json prints them to 4 places (0.0066 is not 0.01), the scores to 2
    printed = result.as_dict()
    assert printed["bleu_p"] == round(result.bleu_p, 4) and printed["chrf_p"] == round(result.chrf_p, 4)


def test_a_paired_test_where_only_chrf_can_tell_the_systems_apart(refs: list[str]) -> None:
    """Two outputs that differ only in words no reference holds give BLEU the same statistics
    sentence by sentence (p = 1, no difference) but not chrF, whose test is sacreBLEU's own."""
    from mtx.evaluate import paired_tests

    base = drop_words(refs, 0.1, 1)
    this = [line + " qqqqq" for line in base]
    other = [line + (" dogsx" if i % 3 == 0 else " qqqqq") for i, line in enumerate(base)]
    (result,) = paired_tests(this, [("other", other)], refs, 300)
    assert (result.bleu_delta, result.bleu_p) == (0.0, 1.0)
    c_other, c_this = _sacrebleus_paired_test(this, other, refs)["chrF2"]
    assert result.chrf_delta == pytest.approx(c_this.score - c_other.score) and result.chrf_delta != 0
    assert result.chrf_p == pytest.approx(c_this.p_value) and result.chrf_p < 1
