from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtx.config import Config, config_text, from_dict, load_config, to_dict
from mtx.errors import ConfigError

from .conftest import REPO


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    (tmp_path / "c.yaml").write_text(config_text(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg
    assert from_dict(to_dict(cfg)) == cfg


# a value other than the default for the keys that a generic one does not fit, and the other keys
# each of them needs
OTHER_VALUES: dict[str, object] = {
    "data.dir": "/data/multi30k", "data.src_lang": "no", "data.tgt_lang": "fr", "data.extra_src_langs": ["fr", "cs"],
    "data.valid_split": "test_2016_flickr", "model.d_model": 512, "model.n_heads": 8, "model.norm": "scale",
    "train.schedule": "linear", "train.optimizer": "adamw", "train.amp": "bf16", "train.device": "cpu",
    "train.adam_betas": [0.8, 0.99], "train.init_from": "~/runs/other", "train.diversify": 0.3,
    "decode.stop": "finished", "decode.precision": "bf16",
}  # fmt: skip
NEEDS: dict[str, dict[str, object]] = {
    "data.extra_src_langs": {"train.extra_sources": 0.5},
    "train.diversify": {"train.bidirectional": 0.5},
    "train.dropout_start": {"train.dropout_warmup": 100},
    "train.extra_sources": {"data.extra_src_langs": ["fr"]},
}


def _other_value(key: str, default: object) -> list[object]:
    if key in OTHER_VALUES:
        return [OTHER_VALUES[key]]
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, default * 2 + 2]
    if isinstance(default, float):
        return [v for v in (default + 0.25, default / 2, 0.5) if v != default]
    return [f"other-{key}"]


def test_every_key_round_trips_through_yaml(tmp_path: Path) -> None:
    """Each key set to a value other than its default (with the keys it needs) is saved and
    loaded back as that value: no key is dropped, retyped or reset on the way."""
    defaults = to_dict(Config())
    for section, values in defaults.items():
        for name, default in values.items():
            key = f"{section}.{name}"
            for value in _other_value(key, default):
                raw = to_dict(Config())
                raw[section][name] = value
                for other, v in NEEDS.get(key, {}).items():
                    raw[other.split(".")[0]][other.split(".")[1]] = v
                try:
                    cfg = from_dict(raw)
                    break
                except ConfigError:
                    continue
            else:
                pytest.fail(f"no valid other value for {key}: add one to OTHER_VALUES")
            assert to_dict(cfg)[section][name] == value != default, key
            (tmp_path / "c.yaml").write_text(config_text(cfg))
            assert load_config(tmp_path / "c.yaml") == cfg, key


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_load(name: str) -> None:
    assert isinstance(load_config(REPO / "configs" / name), Config)


def test_unknown_key_names_file_key_and_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_step: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "train.max_step" in msg and "did you mean train.max_steps" in msg
    assert "\n" not in msg


def test_unknown_section(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trian:\n  max_steps: 10\n")
    with pytest.raises(ConfigError, match="unknown key trian.*did you mean train"):
        load_config(path)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("model:\n  d_model: big\n", "model.d_model must be an integer"),
        ("model:\n  pre_norm: 1\n", "model.pre_norm must be true or false"),
        ("train:\n  batch_tokens: 0\n", r"train.batch_tokens must be > 0"),
        ("train:\n  lr: -1\n", r"train.lr must be > 0"),
        ("train:\n  lr: .nan\n", "train.lr must be a finite number, got nan"),
        ("decode:\n  length_penalty: .inf\n", "decode.length_penalty must be a finite number, got inf"),
        ("data:\n  dir: ''\n", "data.dir must not be empty"),  # it read the current directory (stop 53)
        ("data:\n  valid_split: ' '\n", "data.valid_split must not be empty"),
        # larger penalties overflowed a float in the search (a traceback; stop 53)
        ("decode:\n  length_penalty: 11\n", "decode.length_penalty must be at most 10, got 11.0"),
        # integers past 2**53 overflowed the lr schedule's floats (a traceback after last.pt; stop 53)
        ("train:\n  warmup_steps: 1" + "0" * 320 + "\n", r"train.warmup_steps must be at most 2\*\*53 in size"),
        ("train:\n  max_steps: 1e300\n", r"train.max_steps must be at most 2\*\*53 in size"),
        ("train:\n  adam_betas: [0.9, .nan]\n", "train.adam_betas must be a finite number"),
        ("model:\n  d_model: 100\n  n_heads: 3\n", "divisible by model.n_heads"),
        ("model:\n  dropout: 1.5\n", r"model.dropout must be in \[0, 1\)"),
        ("tokenizer:\n  bpe_dropout: 1.0\n", r"tokenizer.bpe_dropout must be in \[0, 1\)"),
        ("train:\n  ema: 1.0\n", r"train.ema must be in \[0, 1\)"),
        ("train:\n  rdrop: -1\n", r"train.rdrop must be >= 0"),
        (
            "model:\n  dropout: 0\n  activation_dropout: 0\ntrain:\n  rdrop: 5\n",
            "train.rdrop needs model.dropout, model.attention_dropout or model.activation_dropout above 0",
        ),
        ("train:\n  dropout_start: 2\n", r"train.dropout_start must be in \[0, 1\)"),
        ("train:\n  word_dropout: 1.0\n", r"train.word_dropout must be in \[0, 1\)"),
        ("train:\n  bidirectional: 1.0\n", r"train.bidirectional must be in \[0, 1\)"),
        ("tokenizer:\n  joint: false\ntrain:\n  bidirectional: 0.3\n", "train.bidirectional needs tokenizer.joint"),
        ("model:\n  restrict_output: true\ntrain:\n  bidirectional: 0.3\n", "needs model.restrict_output: false"),
        ("train:\n  extra_sources: 0.5\n", r"train.extra_sources needs data.extra_src_langs"),
        ("data:\n  extra_src_langs: [fr]\n", "data.extra_src_langs is set but train.extra_sources is 0"),
        ("data:\n  extra_src_langs: [fr, en]\ntrain:\n  extra_sources: 0.5\n", r"got \['fr', 'en'\]"),
        ("data:\n  extra_src_langs: fr\n", "data.extra_src_langs must be a list of strings"),
        ("train:\n  diversify: 0.5\n", r"train.diversify needs train.bidirectional >= train.diversify, got 0 < 0.5"),
        ("train:\n  bidirectional: 0.33\n  diversify: 0.5\n", "got 0.33 < 0.5"),
        ("train:\n  bidirectional: 0.3\n  diversify: 1.5\n", r"train.diversify must be in \[0, 1\)"),
        ("train:\n  dropout_warmup: 100\n  compile: true\n", "train.dropout_warmup needs train.compile: false"),
        ("train:\n  amp: fp8\n", "train.amp must be one of"),
        ("decode:\n  precision: fp16\n", "decode.precision must be one of"),
        ("decode:\n  stop: early\n", "decode.stop must be one of"),
        ("model:\n  norm: rms\n", "model.norm must be one of"),
        ("model:\n  activation_dropout: 1.0\n", r"model.activation_dropout must be -1 \(as model.dropout\) or in"),
        ("model:\n  activation_dropout: -0.5\n", r"got -0.5"),
        ("train: [1, 2]\n", "section train must be a mapping"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("train:\n  max_steps: [1\n", "malformed YAML at line"),
        ("train:\n  adam_eps: 0\n", r"train.adam_eps must be > 0"),  # Adam's 0/0 on a zero gradient
        ("decode:\n  max_len_a: 0\n  max_len_b: 1\n", "leave room for EOS only after a one-piece source"),
        ("decode:\n  max_len_a: 0.5\n  max_len_b: 0\n", "decode.max_len_a 0.5 and decode.max_len_b 0 leave room"),
        ("data:\n  src_lang: no\n", r'data.src_lang must be a string, got False; .* quote it \(e.g. src_lang: "no"\)'),
        # stop 54: a string key took YAML's reading of unquoted text (data.dir 010 named directory 8)
        ("data:\n  dir: 0x10\n", r"data.dir must be a string, got 16: YAML reads some unquoted text as a number"),
        # stop 62: YAML 1.1's octal numbers: max_steps 010 trained 8 steps without a word
        ("data:\n  dir: 010\n", r"line 2, column 8: YAML 1.1 reads 010 as the octal number 8; write 10 without"),
        ("train:\n  max_steps: 0100\n", "YAML 1.1 reads 0100 as the octal number 64; write 100 without the leading"),
        ("train:\n  adam_betas: [0.9, 0_17]\n", "YAML 1.1 reads 0_17 as the octal number 15; write 17"),
        ("data:\n  valid_split: 2016.10\n", r"data.valid_split must be a string, got 2016.1: .* quote it"),
        ("data:\n  dir: 2024-01-05\n", r"data.dir must be a string, got the date 2024-01-05: .* quote it"),
        ("train:\n  lr: 0.1 \x1b[0m\n", r"line 2 holds the control character '\\x1b', which YAML does not allow"),
        ("\u00a0 lr: 0.1\n", r"unknown key '\\xa0 lr' \(did you mean train.lr\?\)"),
        ("train:\n  LR: 0.1\n", r"unknown key train.LR \(did you mean train.lr\?\)"),
        # tracebacks before: PyYAML's ValueError for an invalid date and for an integer past Python's
        # 4,300-digit limit, an OverflowError for an integer beyond a float, a ValueError showing one
        ("train:\n  init_from: 2023-02-29\n", r"line 2, column 14: 2023-02-29 is not a valid date \(day is out of"),
        ("train:\n  lr: 2023-13-01\n", r"2023-13-01 is not a valid date \(month must be in 1\.\.12\)"),
        ("train:\n  max_steps: 1" + "0" * 5000 + "\n", r"line 2, column 14: the integer 1000.* more than 4,300 digits"),
        ("train:\n  lr: 1" + "0" * 400 + "\n", r"train.lr must be a finite number, got 1000.*0 \(401 characters\)$"),
        ("data:\n  dir: 0x" + "f" * 4000 + "\n", "data.dir must be a string, got an integer of 16,000 bits"),
        ("train:\n  max_steps: !!int abc\n", "line 2, column 14: abc is not a valid int"),
        ("train:\n  compile: !!bool maybe\n", "maybe is not a valid bool"),
        # YAML 1.1's base-60 numbers: 1:30 was 90 minutes without a word
        ("train:\n  max_minutes: 1:30\n", r"line 2, column 16: YAML 1.1 reads 1:30 as the base-60 number 90; write"),
        ("train:\n  max_minutes: 1:30:00\n", "YAML 1.1 reads 1:30:00 as the base-60 number 5400"),
        ("train:\n  lr: 0:0.5\n", "YAML 1.1 reads 0:0.5 as the base-60 number 0.5"),
        ("data:\n  dir: 12:30\n", "YAML 1.1 reads 12:30 as the base-60 number 750; .* or quote it if it is text"),
        # a dropout_start without a ramp did nothing
        ("train:\n  dropout_start: 0.1\n", "train.dropout_start is set but train.dropout_warmup is 0"),
        (
            "train.lr: 0.1\n",
            r"train.lr: a config file nests each key in its section; write 'train:' and under it '  lr: \.\.\.'$",
        ),
        (
            "train: [&a [1, 2, 3, 4, 5, 6, 7, 8], [*a, *a, *a, *a, *a, *a, *a, *a]]\n",
            r"section train must be a mapping, got \[\[1, 2, 3, 4, 5, 6, \.\.\.\], \[\[1, 2, 3, 4, 5, 6, \.\.\.\], "
            r"\[1, 2\.\.\.$",
        ),
        ("{}\n", "the config is empty"),  # as an empty file: not the defaults' 10,000 steps
        ("data:\n  dir: [a, b]\n", r"data.dir must be a string, got \['a', 'b'\]$"),
        ("train:\n  schedule: {a: 1}\n", r"train.schedule must be a string, got \{'a': 1\}$"),
        # a file system that ignores case (macOS, Windows) reads train.EN as train.en (stop 67: a copying model)
        ("data:\n  src_lang: EN\n  tgt_lang: en\n", r"data.src_lang and data.tgt_lang are both 'EN' \(and 'en'\)$"),
        (
            "data:\n  extra_src_langs: [fr, DE]\ntrain:\n  extra_sources: 0.5\n",
            r"data.extra_src_langs must list other languages than data.src_lang and data.tgt_lang, each once",
        ),
        (
            "data:\n  extra_src_langs: [fr, FR]\ntrain:\n  extra_sources: 0.5\n",
            r"data.extra_src_langs must list other languages than data.src_lang and data.tgt_lang, each once",
        ),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path: Path, text: str, pattern: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_overrides_convert_to_field_types() -> None:
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        ["train.max_steps=7", "train.lr=1e-3", "model.pre_norm=false", "train.adam_betas=[0.9, 0.99]"],
    )
    assert cfg.train.max_steps == 7 and cfg.train.lr == 1e-3 and cfg.model.pre_norm is False
    assert cfg.train.adam_betas == (0.9, 0.99)
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0  # int -> float
    # YAML 1.1 reads 1e4 as a string; as for floats, an integer key takes it when it is whole
    assert load_config(None, ["train.max_steps=1e4"]).train.max_steps == 10_000
    with pytest.raises(ConfigError, match="train.max_steps must be an integer, got '1e-1'"):
        load_config(None, ["train.max_steps=1e-1"])
    with pytest.raises(ConfigError, match="train.clip_norm must be a finite number, got 'inf'"):
        load_config(None, ["train.clip_norm=inf"])
    # a string key takes the text as typed (stop 53: YAML made data.dir=010 the directory 8, 1:20
    # the number 80, and cut "my data #2" at the comment); quotes are taken off
    sets = ["data.dir=/x/010", "data.train_split=1:20", "data.valid_split=my val #2", "data.src_lang=no"]
    data = load_config(None, [*sets, "data.tgt_lang='0x1f'"]).data
    assert (data.train_split, data.valid_split, data.src_lang, data.tgt_lang) == ("1:20", "my val #2", "no", "0x1f")
    assert load_config(None, ["data.dir=010"]).data.dir.endswith("010")


def test_override_errors() -> None:
    with pytest.raises(ConfigError, match="did you mean model.d_model"):
        load_config(None, ["model.dmodel=8"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.max_steps"])
    with pytest.raises(ConfigError, match="train.max_steps must be an integer"):
        load_config(None, ["train.max_steps=abc"])


@pytest.mark.parametrize(
    "setting, pattern",
    [
        # tracebacks before (ValueError, OverflowError)
        ("train.max_steps=2023-02-29", r"--set train.max_steps: 2023-02-29 is not a valid date \(day is out of range"),
        ("train.adam_betas=[0.9, 2023-02-30]", "--set train.adam_betas: 2023-02-30 is not a valid date"),
        ("train.lr=1" + "0" * 5000, r"--set train.lr: the integer 1000.* \(5,001 characters\) has more than 4,300"),
        ("train.lr=1" + "0" * 400, r"train.lr must be a finite number, got 1000.*0 \(401 characters\)$"),
        ("train.max_steps=0x" + "f" * 4000, r"max_steps must be at most 2\*\*53 in size, got an integer of 16,000 bit"),
        ("train.max_minutes=1:30", "--set train.max_minutes: YAML 1.1 reads 1:30 as the base-60 number 90"),
        ("train.max_minutes='1:30'", "train.max_minutes must be a number, got '1:30'"),
        ("train.dropout_start=0.1", "train.dropout_start is set but train.dropout_warmup is 0; set the updates"),
        ("train.seed=0042", "--set train.seed: YAML 1.1 reads 0042 as the octal number 34; write 42 without"),
    ],
)
def test_bad_override_values_are_one_line_errors(setting: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(REPO / "configs" / "tiny.yaml", [setting])
    assert "\n" not in str(e.value) and len(str(e.value)) < 300  # no 5,000-digit value


@pytest.mark.parametrize("section", ["5", "[1, 2]", "abc"])
def test_an_override_into_a_section_that_is_not_a_mapping(tmp_path: Path, section: str) -> None:
    """`train: 5` in the file and `--set train.lr=0.1` was a TypeError traceback, then blamed on --set
    (stop 64)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  d_model: 64\ntrain: {section}\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: section train must be a mapping, got "):
        load_config(path, ["train.lr=0.1"])


def test_a_config_not_in_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin.yaml"
    path.write_bytes("train:\n  lr: 0.1\n# réglages\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.yaml: line 3 is not valid UTF-8; save the config as UTF-8$"):
        load_config(path)


def test_list_items_and_extra_languages_are_checked_as_names() -> None:
    """A path among data.extra_src_langs was taken, then missing as train.../x/train.fr; a list
    item's error showed an example that was itself refused (stop 62)."""
    sets = ["train.extra_sources=0.1"]
    with pytest.raises(ConfigError, match=r"each of data.extra_src_langs must be a name within the data directory"):
        load_config(None, [*sets, 'data.extra_src_langs=["../x/train.fr"]'])
    example = re.escape('(e.g. extra_src_langs: ["..."])')
    with pytest.raises(ConfigError, match=rf"each item of data.extra_src_langs must be a string, got 1: .*{example}$"):
        load_config(None, [*sets, "data.extra_src_langs=[1]"])


def test_octal_digits_that_read_the_same_and_other_bases_are_taken() -> None:
    """Only a leading zero that changes the number is refused: 07 is 7 either way, 0800 is no octal
    number (YAML 1.1 leaves it text, read as 800), and 0x/0b spell their base."""
    sets = ["train.max_steps=07", "train.eval_every=0800", "train.log_every=0x10", "train.seed=0b11"]
    t = load_config(None, sets).train
    assert (t.max_steps, t.eval_every, t.log_every, t.seed) == (7, 800, 16, 3)


def test_a_list_of_a_billion_aliased_items_is_refused_at_once(tmp_path: Path) -> None:
    """A 400-byte file whose aliases nest to 10^9 numbers: the error message built the whole list's
    repr, and `mtx train` hung while its memory grew (stop 62)."""
    text = "train:\n  lr: [&l0 [1,1,1,1,1,1,1,1,1,1]"
    for i in range(1, 9):
        text += f", &l{i} [{','.join([f'*l{i - 1}'] * 10)}]"
    path = tmp_path / "bomb.yaml"
    path.write_text(text + "]\n")
    with pytest.raises(ConfigError, match=r"train.lr must be a number, got \[\[1, 1, 1, 1, 1, 1, \.\.\.\], \[\[") as e:
        load_config(path)
    assert len(str(e.value)) < 200


def test_text_with_colons_and_dates_stays_text(tmp_path: Path) -> None:
    """Refusing base-60 numbers and invalid dates leaves quoted values, paths and URLs with colons,
    valid dates and a string key's --set text alone, and a dropout_start with its ramp works."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  dir: /data/12:30\n  train_split: '1:30'\n  valid_split: \"2023-02-29\"\n"
        "train:\n  init_from: http://host:8080/run\n  max_minutes: 90\n  dropout_warmup: 100\n  dropout_start: 0.05\n"
    )
    cfg = load_config(path)
    assert (cfg.data.dir, cfg.data.train_split, cfg.data.valid_split) == ("/data/12:30", "1:30", "2023-02-29")
    assert cfg.train.init_from == "http://host:8080/run" and cfg.train.max_minutes == 90.0
    assert (cfg.train.dropout_warmup, cfg.train.dropout_start) == (100, 0.05)
    sets = ["data.dir=12:30", "data.train_split=2023-02-29", "train.max_steps=1_000", "train.lr=1.5e-3"]
    cfg = load_config(path, sets)
    assert (cfg.data.dir, cfg.data.train_split) == ("12:30", "2023-02-29")
    assert (cfg.train.max_steps, cfg.train.lr) == (1000, 1.5e-3)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/c.yaml")


def test_a_section_given_as_a_key_names_its_keys() -> None:
    with pytest.raises(ConfigError, match=r"--set train=5: train is a section; set one of its keys, e\.g\. train\."):
        load_config(REPO / "configs" / "tiny.yaml", ["train=5"])


def test_a_saved_run_with_an_unramped_dropout_start_still_loads(tmp_path: Path) -> None:
    """A run trained before dropout_start without dropout_warmup was refused (the setting did
    nothing) keeps loading for translate, eval and resume; a new --set on it is refused."""
    raw = to_dict(Config())
    raw["train"]["dropout_start"] = 0.1
    path = tmp_path / "config.yaml"
    path.write_text(config_text(from_dict(raw)))
    assert load_config(path, whole=True).train.dropout_start == 0.1
    with pytest.raises(ConfigError, match="train.dropout_start is set but train.dropout_warmup is 0"):
        load_config(path)
    with pytest.raises(ConfigError, match="train.dropout_start is set but train.dropout_warmup is 0"):
        load_config(path, ["train.max_steps=5"], whole=True)


def test_rdrop_counts_the_ffns_own_dropout_as_dropout() -> None:
    """A model whose only dropout is model.activation_dropout draws two different R-Drop passes:
    it was refused as having no dropout (stop 65)."""
    cfg = from_dict({"model": {"dropout": 0, "activation_dropout": 0.3}, "train": {"rdrop": 1}})
    assert (cfg.model.activation_dropout, cfg.train.rdrop) == (0.3, 1.0)
    with pytest.raises(ConfigError, match="train.rdrop needs model.dropout, model.attention_dropout or"):
        from_dict({"model": {"dropout": 0}, "train": {"rdrop": 1}})  # -1: model.dropout's rate, 0


def test_a_keys_error_names_where_the_value_came_from(tmp_path: Path) -> None:
    """A bad value in the file was blamed on "FILE (with --set)" whenever a --set was given (stop 62)."""
    path = tmp_path / "c.yaml"
    path.write_text('model:\n  pre_norm: "false"\ntrain:\n  max_steps: 5\n')
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: model\.pre_norm must be true or false, got 'false'$"):
        load_config(path, ["train.max_steps=2"])
    with pytest.raises(ConfigError, match=r"^--set: model\.pre_norm must be true or false, got 'maybe'$"):
        load_config(path, ["model.pre_norm=maybe"])
    # unknown keys and range checks too (stop 63: still "FILE (with --set)" for a file's own mistake)
    path.write_text("train:\n  lr: -1\n  LR: 0.1\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: unknown key train\.LR \(did you mean train\.lr\?\)$"):
        load_config(path, ["train.seed=2"])
    path.write_text("train:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: train\.lr must be > 0, got -1\.0$"):
        load_config(path, ["train.seed=2"])
    with pytest.raises(ConfigError, match=r"^--set: train\.seed must be in \[0, 2\*\*32\), got -2$"):
        load_config(path, ["train.seed=-2", "train.lr=0.1"])
    with pytest.raises(ConfigError, match=r"^--set: unknown key trian\.lr \(did you mean train\.lr\?\)$"):
        load_config(path, ["trian.lr=0.1"])
    # a check across keys that the file and --set both gave names both
    path.write_text("model:\n  d_model: 64\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml \(with --set\): model\.d_model \(64\) must be divisible"):
        load_config(path, ["model.n_heads=5"])
    # keys a message names only to explain, or at their defaults, are not blamed (stop 66: each of
    # these, given by --set alone, was blamed on "FILE (with --set)")
    path.write_text("model:\n  dropout: 0.1\n")
    for overrides, start in (
        (["model.activation_dropout=1.5"], "model.activation_dropout must be -1"),
        (["train.dropout_start=0.2"], "train.dropout_start is set but train.dropout_warmup is 0"),
        (["train.rdrop=1", "model.dropout=0"], "train.rdrop needs model.dropout"),
    ):
        with pytest.raises(ConfigError, match=rf"^--set: {re.escape(start)}"):
            load_config(path, overrides)


def test_a_files_section_mistake_is_blamed_on_the_file_whatever_is_set(tmp_path: Path) -> None:
    """Section-level mistakes of the file were blamed on --set or "FILE (with --set)" (stop 64)."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 5\ndecode: 5\n")
    for sets in (["decode.beam=3"], ["train.max_steps=3"], []):
        with pytest.raises(ConfigError, match=r"^.*c\.yaml: section decode must be a mapping, got 5$"):
            load_config(path, sets)
    path.write_text("train:\n  max_steps: 5\ntrain.lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: train\.lr: a config file nests each key in its section"):
        load_config(path, ["decode.beam=3"])


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("train.warmup", "train.warmup_steps"),
        ("train.beam", "decode.beam"),
        ("train.dropout", "model.dropout"),
        ("model.lr", "train.lr"),
        ("train.learning_rate", "train.lr"),
        ("train.grad_accum", "train.accum_steps"),
        ("train.max_len", "data.max_len"),
        ("train.max_step", "train.max_steps"),
        ("decode.beam_size", "decode.beam"),
        ("lr", "train.lr"),
        # misspelt and in another section (kept in stop 69, whose first fix lost them)
        ("train.max_position", "model.max_positions"),
        ("decode.n_head", "model.n_heads"),
        ("model.warmup_step", "train.warmup_steps"),
        # a leaf that two sections hold: the section's own on a tie (stop 70's mutant: the other's)
        ("decode.batch_tokns", "decode.batch_tokens"),
        ("train.batch_tokns", "train.batch_tokens"),
    ],
)
def test_did_you_mean_looks_in_other_sections_and_other_tools_names_first(key: str, meant: str) -> None:
    """difflib alone suggested train.amp for train.warmup and train.ema for train.beam (stop 64)."""
    with pytest.raises(
        ConfigError, match=rf"^--set: unknown key {re.escape(key)} \(did you mean {re.escape(meant)}\?\)$"
    ):
        load_config(None, [f"{key}=1"])


@pytest.mark.parametrize("key", ["train.foo", "decode.xyz", "train.", "model.bogus"])
def test_an_unknown_key_of_a_known_section_is_not_sent_to_the_section(key: str) -> None:
    """`train.foo` said "did you mean train?", which is refused as a section (stop 69's probe):
    a key of a known section is matched against that section's keys only, and none close is no hint."""
    with pytest.raises(ConfigError, match=rf"^--set: unknown key {re.escape(key)}$"):
        load_config(None, [f"{key}=1"])


def test_merges_whose_outcome_depends_on_the_yaml_version_are_refused(tmp_path: Path) -> None:
    """`<<: [{lr: 0.001}, {lr: 0.5}]` trained at 0.5 with PyYAML 6.0.4, at 0.001 with 6.0.3 (stop 64)."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  <<: [{lr: 0.001, max_steps: 2}, {lr: 0.5}]\n")
    with pytest.raises(ConfigError, match=r"line 2, column 3: two of the mappings merged by '<<' set 'lr'"):
        load_config(path)
    path.write_text("train:\n  <<: {lr: 0.001}\n  <<: {max_steps: 3}\n")
    with pytest.raises(ConfigError, match=r"line 3, column 3: the merge key '<<' appears twice in one mapping"):
        load_config(path)
    path.write_text("train:\n  <<: [{lr: 0.001}, {max_steps: 3}]\n  lr: 0.1\n")  # an override after the merge
    cfg = load_config(path)
    assert (cfg.train.lr, cfg.train.max_steps) == (0.1, 3)


def test_an_adam_eps_that_is_zero_in_float32_is_refused_and_odd_values_read_well() -> None:
    """1e-46 passed the > 0 check and was 0 in float32: every step non-finite (stop 64)."""
    with pytest.raises(ConfigError, match=r"^--set: train\.adam_eps must be at least 1\.18e-38 .*got 1e-46"):
        load_config(None, ["train.adam_eps=1e-46"])
    assert load_config(None, ["train.adam_eps=1e-30"]).train.adam_eps == 1e-30
    with pytest.raises(ConfigError, match=r"train\.max_steps must be at most 2\*\*53 in size, got 9007199254740993$"):
        load_config(None, ['train.max_steps="9007199254740993"'])  # (it was rounded through a float, and taken)
    assert load_config(None, ['train.max_steps=" 200 "']).train.max_steps == 200
    with pytest.raises(ConfigError, match=r"train\.max_steps must be an integer, got the date 2024-01-05$"):
        load_config(None, ["train.max_steps=2024-01-05"])
    with pytest.raises(ConfigError, match=r"train\.adam_betas must be a list of 2 numbers, got \[0\.9\]$"):
        load_config(None, ["train.adam_betas=[0.9]"])
    with pytest.raises(ConfigError, match=r"data\.src_lang must not begin or end with a space, got 'de\\xa0'$"):
        from_dict({"data": {"src_lang": "de\u00a0"}})
    with pytest.raises(
        ConfigError, match=r"data\.valid_split must be a name without control characters, got 'va\\nl'$"
    ):
        from_dict({"data": {"valid_split": "va\nl"}})


def test_range_checks_refuse_exactly_past_their_bounds() -> None:
    """Each bound a message states holds the value it names and refuses the next one (stop 70's
    mutants: `>=` for `>` or one-off bounds passed every test)."""
    from mtx.config import AT_MOST, MAX_INT

    assert load_config(None, [f"train.max_steps={MAX_INT}"]).train.max_steps == MAX_INT  # "at most 2**53"
    with pytest.raises(ConfigError, match=r"train\.max_steps must be at most 2\*\*53 in size"):
        load_config(None, [f"train.max_steps={MAX_INT + 1}"])
    # every size at its largest together (a head of 64, even), and each one past it alone
    largest = {
        "tokenizer": {"vocab_size": AT_MOST["tokenizer.vocab_size"]},
        "model": {k.split(".")[1]: v for k, v in AT_MOST.items() if k.startswith("model.")},
        "decode": {"beam": AT_MOST["decode.beam"]},
    }
    cfg = from_dict(largest)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.decode.beam) == (65_536, 1_024, 1_000)
    for key, most in AT_MOST.items():
        section, name = key.split(".")
        raw = {s: dict(v) for s, v in largest.items()}
        raw[section][name] = most + 2  # (+2: d_model and the head stay even)
        with pytest.raises(ConfigError, match=rf"{re.escape(key)} must be at most {most:,}, got {most + 2:,}$"):
            from_dict(raw)
    assert from_dict({"train": {"seed": 2**32 - 1}}).train.seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"train\.seed must be in \[0, 2\*\*32\), got 4294967296$"):
        from_dict({"train": {"seed": 2**32}})
    assert from_dict({"tokenizer": {"vocab_size": 300}}).tokenizer.vocab_size == 300
    with pytest.raises(ConfigError, match=r"tokenizer\.vocab_size must be >= 300 \(256 bytes \+ specials\), got 299$"):
        from_dict({"tokenizer": {"vocab_size": 299}})
    for betas in ([1.0, 0.98], [0.9, 1.0], [0.9, -0.1]):
        with pytest.raises(ConfigError, match=r"train\.adam_betas must both be in \[0, 1\)$"):
            from_dict({"train": {"adam_betas": betas}})
    # "needs train.bidirectional >= train.diversify": equal is enough
    assert from_dict({"train": {"bidirectional": 0.5, "diversify": 0.5}}).train.diversify == 0.5
    # data.max_len pieces + BOS/EOS fill model.max_positions exactly
    assert from_dict({"data": {"max_len": 254}, "model": {"max_positions": 256}}).data.max_len == 254
    with pytest.raises(ConfigError, match=r"data\.max_len \+ 2 \(257\) exceeds model\.max_positions \(256\)$"):
        from_dict({"data": {"max_len": 255}, "model": {"max_positions": 256}})
    with pytest.raises(ConfigError, match=r"model\.d_model / model\.n_heads must be even$"):
        from_dict({"model": {"d_model": 12, "n_heads": 4}})  # heads of 3


def test_a_set_value_is_taken_without_the_spaces_and_quotes_around_it() -> None:
    """`--set data.src_lang= fr` and `--set data.tgt_lang="de"` name the languages fr and de, as
    YAML reads the other keys' values (stop 70's mutants: the space, or double quotes, kept)."""
    data = load_config(None, ["data.src_lang= fr ", 'data.tgt_lang="de"', "data.valid_split='dev'"]).data
    assert (data.src_lang, data.tgt_lang, data.valid_split) == ("fr", "de", "dev")
    assert load_config(None, ["train.lr = 0.5 "]).train.lr == 0.5
