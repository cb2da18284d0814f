from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from mtx.checkpoint import load_run
from mtx.cli import main
from mtx.errors import CheckpointError
from mtx.punctuation import COUNTS_FILE, GROUPS, RARE, folded, folds, load_folds, punctuation_counts, save_counts

from .conftest import tiny_args


def _train_counts(shared_data: Path, lang: str) -> dict[str, int]:
    with gzip.open(shared_data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
        return punctuation_counts(f.read().splitlines())


def test_multi30k_sources_read_the_forms_their_training_data_writes(shared_data: Path) -> None:
    """Each language's own forms (stop 73): French apostrophes typed `’` (17 times in train.fr,
    `'` 14,884) and guillemets read as `'` and `"`; German keeps its `„` and `“` (178, 188) and
    its `"` (45) and en dashes (70), which the model has learned, and reads a rare `”` as `“`."""
    fr, de, en = (folds(_train_counts(shared_data, lang)) for lang in ("fr", "de", "en"))
    assert fr["\u2019"] == fr["\u2018"] == fr["`"] == "'" and fr["\u00ab"] == fr["\u00bb"] == fr["\u201c"] == '"'
    assert de["\u2019"] == "'" and de["\u201d"] == "\u201c" and de["\u2014"] == "\u2013"
    assert not {'"', "'", "\u201e", "\u201c", "\u2013", "-"} & set(de)
    assert en["\u201c"] == en["\u201d"] == '"' and en["\u2019"] == "'" and en["\u2010"] == "-"
    assert not {'"', "'", "-", "\u2013", "\u2014"} & set(en)  # (no en dash in train.en: nothing to read it as)


def test_folds_read_only_rare_characters_as_their_groups_commonest() -> None:
    """A character is read as another only where the data has (nearly) never seen it, and as the
    commonest of its group, itself seen `RARE` times and 10 times as often; never across groups."""
    assert folds({}) == {} and folds({"'": RARE - 1}) == {}
    assert folds({"'": RARE, "\u2019": 1})["\u2019"] == "'"
    assert "\u2019" not in folds({"'": RARE, "\u2019": RARE // 2 + 1})  # not 10 times as common
    assert "\u2019" not in folds({"'": 10_000, "\u2019": RARE})  # learned
    assert folds({"\u2019": 500})["'"] == "\u2019"  # the data's form, not ASCII's
    counts = {"'": 300, "\u2018": 3, '"': 40, "\u201c": 2, "-": 100, "\u2013": 25}
    read_as = folds(counts)
    for char, target in read_as.items():
        group = next(g for g in GROUPS if char in g)
        assert target in group and counts.get(char, 0) < RARE and counts[target] == max(counts.get(c, 0) for c in group)
    assert read_as["\u2014"] == "\u2013" and "\u2013" not in read_as and "-" not in read_as
    assert folded(["l\u2019homme \u201cdit\u201d \u2018a\u2019", "", "x"], read_as) == ["l'homme \"dit\" 'a'", "", "x"]


def test_a_runs_counts_round_trip_and_a_damaged_file_is_one_line(tmp_path: Path) -> None:
    """The counts are the run's source language's; a run trained before them has none (None: its
    data is counted instead), and a file that is not mtx's is a one-line error that says what to do."""
    assert load_folds(tmp_path, "fr") is None  # no file: a run of before stop 73
    counts = {"'": 500, "\u2019": 2}
    save_counts(tmp_path, "fr", counts)
    assert load_folds(tmp_path, "fr") == folds(counts) and load_folds(tmp_path, "en") == {}
    path = tmp_path / COUNTS_FILE
    for text in ("{", '{"lang": "fr", "counts": {"x": -1}}', "[1]", '{"lang": "fr", "counts": {"x": 1.5}}'):
        path.write_text(text)
        with pytest.raises(CheckpointError, match=f"{COUNTS_FILE}: .*delete it to read punctuation as written") as e:
            load_folds(tmp_path, "fr")
        assert "\n" not in str(e.value)
    path.write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="cannot read it"):
        load_folds(tmp_path, "fr")
    save_counts(tmp_path, "fr", {"\u00ab": 3, '"': 400})
    assert json.loads(path.read_text())["counts"] == {"\u00ab": 3, '"': 400}


def test_the_shipped_configs_sources_read_as_written(shared_data: Path) -> None:
    """The shipped configs translate from de and en: no val or test_2016_flickr line of theirs holds
    a character their training data folds, so README's scores stand (stop 73); val.fr's one `’` does."""
    for lang in ("de", "en", "fr"):
        read_as = folds(_train_counts(shared_data, lang))
        for split in ("val", "test_2016_flickr"):
            with gzip.open(shared_data / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
            changed = sum(a != b for a, b in zip(lines, folded(lines, read_as), strict=True))
            assert changed == (1 if (lang, split) == ("fr", "val") else 0), (lang, split)


def test_training_writes_its_sources_counts_and_a_resume_writes_them_where_missing(
    mini_data: Path, tmp_path: Path
) -> None:
    """A new run's counts are its train split's sources'; a run trained before stop 73 (no counts
    file) decodes with its train split's, counted where its data directory still has them (else
    reads punctuation as written), and gets the file at its resume."""
    run = tmp_path / "run"
    common = ("--set", "train.eval_every=2", "--set", "train.eval_sentences=5")
    assert main(tiny_args(mini_data, run, *common, "--set", "train.max_steps=2")) == 0
    train_de = (mini_data / "train.de").read_text(encoding="utf-8").splitlines()
    saved = json.loads((run / COUNTS_FILE).read_text(encoding="utf-8"))
    assert saved == {"lang": "de", "counts": punctuation_counts(train_de)} and saved["counts"]
    (run / COUNTS_FILE).unlink()
    assert load_run(run).folds == folds(saved["counts"]) and load_run(run).folds["\u2010"] == "-"
    config = (run / "config.yaml").read_text(encoding="utf-8")
    assert str(mini_data) in config
    gone = tmp_path / "data"
    shutil.copytree(mini_data, gone)
    (gone / "train.de").unlink()
    (run / "config.yaml").write_text(config.replace(str(mini_data), str(gone)), encoding="utf-8")
    assert load_run(run).folds == {}  # (its data gone: as written)
    (run / "config.yaml").write_text(config, encoding="utf-8")
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]) == 0
    assert json.loads((run / COUNTS_FILE).read_text(encoding="utf-8")) == saved
