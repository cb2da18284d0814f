"""Typed, frozen configuration: YAML -> Config, dotted overrides, strict validation.

Defaults live only in the dataclass fields below. Unknown keys, wrong types and out-of-range
values are `ConfigError`s that name the file, the dotted key and, for typos, the closest key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mtx.errors import CheckpointError, ConfigError, command_line, not_found, own_command
from mtx.errors import shown as _shown


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel text comes from and which direction to translate."""

    dir: str = "auto"  # local dir of {split}.{lang}[.gz]; "auto": shared copy, else download
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_split: str = "train"
    valid_split: str = "val"
    max_len: int = 128  # training pairs with more BPE tokens on either side are skipped
    # more source languages of the train split (e.g. [fr, cs] on Multi30k), each paired with the
    # same target sentences, for many-to-one training in the epochs train.extra_sources covers;
    # encoded with the source tokenizer, which is trained without them
    extra_src_langs: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenizerConfig:
    """Byte-level BPE trained on the train split only."""

    vocab_size: int = 8000
    joint: bool = True  # one vocabulary for both languages (enables full weight tying)
    min_frequency: int = 2
    # BPE-dropout on training sentences (train's, data.extra_src_langs', train.diversify's), a fresh
    # segmentation each epoch
    bpe_dropout: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Encoder-decoder Transformer shape (names as in Vaswani et al.)."""

    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    n_encoder_layers: int = 3
    n_decoder_layers: int = 3
    dropout: float = 0.1
    attention_dropout: float = 0.0
    # dropout on the FFN's hidden ReLU output; -1: model.dropout (fairseq's activation_dropout,
    # which is 0 there by default)
    activation_dropout: float = -1.0
    pre_norm: bool = True
    # layer: LayerNorm | scale: ScaleNorm, g * x / ||x|| with one learned g per norm (Nguyen &
    # Salazar, 2019, "Transformers without Tears")
    norm: str = "layer"
    # FixNorm (Nguyen & Chiang, 2018): every word embedding used at unit length (times sqrt(D) at
    # the input), so the logits are the final decoder state's dot products with unit vectors
    fix_norm: bool = False
    tie_embeddings: bool = True  # tgt embedding == output projection (and == src when joint)
    # softmax only over the target-side pieces of the training data (+ EOS, UNK): a joint BPE
    # vocabulary holds many pieces of the source language that the target never uses
    restrict_output: bool = False
    max_positions: int = 256


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule, precision and bookkeeping."""

    max_steps: int = 10000
    max_epochs: int = 0  # 0: no epoch limit
    max_minutes: float = 0.0  # wall-time budget of the training loop (resumes included); 0: none
    batch_tokens: int = 4096
    accum_steps: int = 1
    lr: float = 7e-4
    schedule: str = "inverse_sqrt"  # inverse_sqrt | noam | constant | linear (to zero at the budget's end)
    warmup_steps: int = 1000
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    optimizer: str = "adam"  # adam (weight decay added to the gradient) | adamw (decoupled decay, Loshchilov & Hutter)
    weight_decay: float = 0.0  # adamw: matrices and embeddings only, not biases or norm gains
    label_smoothing: float = 0.1
    dropout_warmup: int = 0  # steps over which model.dropout ramps up linearly from dropout_start; 0: constant
    dropout_start: float = 0.0  # the dropout rate at step 1 when dropout_warmup > 0
    rdrop: float = 0.0  # R-Drop: weight of the symmetric KL between two dropout passes of each batch; 0: off
    # word dropout (Sennrich & Zhang, 2019): each source / decoder-input piece of a training batch
    # replaced by UNK with this probability (BOS, EOS and padding kept); 0: off
    word_dropout: float = 0.0
    tgt_word_dropout: float = 0.0
    # bidirectional training (BiT, Ding et al., 2021): the epochs that start within this fraction
    # of the budget (train.max_steps, or train.max_minutes when that comes first) train on every
    # pair both ways, src->tgt and tgt->src (needs tokenizer.joint); later epochs src->tgt only
    bidirectional: float = 0.0
    # data diversification (Nguyen et al., 2020): at the first epoch that starts past this fraction
    # of the budget, the model (its moving average with train.ema) translates train greedily both
    # ways, and every later epoch adds (src, its translation) and (tgt's translation, tgt) to the
    # real pairs; needs train.bidirectional >= it (the model must still know tgt->src); 0: off
    diversify: float = 0.0
    # many-to-one training: the epochs that start within this fraction of the budget add the
    # (extra language, tgt) pairs of data.extra_src_langs to the training pairs; 0: off
    extra_sources: float = 0.0
    clip_norm: float = 1.0  # 0: no clipping
    amp: str = "auto"  # auto | bf16 | fp16 | fp32
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    threads: int = 0  # CPU intra-op threads; 0: torch's default, at most the CPUs here (affinity, cgroup quota)
    compile: bool = False
    seed: int = 1
    log_every: int = 50
    eval_every: int = 1000
    eval_sentences: int = 0  # the first N val sentences, for the val loss and BLEU during training; 0: all
    patience: int = 0  # stop after this many evals without a better val BLEU; 0: never
    keep_last: int = 10  # step checkpoints kept in checkpoints/ (for averaging)
    ema: float = 0.0  # decay of a moving average of the weights, saved as checkpoints/ema.pt; 0: none
    max_bad_steps: int = 10  # consecutive non-finite steps before training stops
    # fine-tuning: start from another run's weights and tokenizer instead of a random init and a new
    # BPE; a run directory (its best.pt, else last.pt) or a checkpoint file; the optimizer, the
    # schedule (warmup included) and the step count start afresh; "": off
    init_from: str = ""


STOPS = ("exact", "finished")  # decode.stop, beam search's stopping rules (mtx.search.beam_search)
PRECISIONS = ("fp32", "bf16")  # decode.precision, the weights' type in decoding
# `mtx export`'s CTranslate2 weight types (mtx.export)
QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16")


@dataclass(frozen=True)
class DecodeConfig:
    """Search settings used by translate/eval and validation."""

    beam: int = 5
    length_penalty: float = 1.0  # GNMT alpha; 0: raw log-prob
    max_len_a: float = 1.2
    max_len_b: int = 10
    batch_tokens: int = 4000  # decode batch budget in source tokens
    workers: int = 0  # threads decoding batches side by side, sharing torch's; 0: auto (2 on CPU with 2+ threads)
    precision: str = "fp32"  # fp32 | bf16: the weights' type in translate/eval (validation decodes in fp32)
    # beam search's stop: exact (once no running hypothesis can beat the best finished ones: the
    # output of running to the length cap) | finished (once `beam` hypotheses have finished, as
    # fairseq stops: faster, and may miss a better hypothesis still running)
    stop: str = "exact"
    # a source line's runs of whitespace inside it (tabs, no-break spaces, doubled spaces) read as
    # one space, and soft hyphens and zero-width spaces dropped (`mtx.text.one_spaced`); false:
    # read as written, as training reads its data (`--keep-spaces`)
    normalize_spaces: bool = True
    # a source's quotes, apostrophes and dashes that the training sources (nearly) never have read
    # as the form they have (`mtx.punctuation.folds`: `’` as `'` for Multi30k's French); false:
    # read as written, as training reads its data (`--keep-punctuation`)
    normalize_punctuation: bool = True


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "train.schedule": ("inverse_sqrt", "noam", "constant", "linear"),
    "train.amp": ("auto", "bf16", "fp16", "fp32"),
    "decode.precision": PRECISIONS,
    "decode.stop": STOPS,
    "train.optimizer": ("adam", "adamw"),
    "model.norm": ("layer", "scale"),
}
_POSITIVE = {
    "tokenizer.vocab_size",
    "tokenizer.min_frequency",
    "model.d_model",
    "model.n_heads",
    "model.d_ff",
    "model.n_encoder_layers",
    "model.n_decoder_layers",
    "model.max_positions",
    "data.max_len",
    "train.max_steps",
    "train.batch_tokens",
    "train.accum_steps",
    "train.lr",
    "train.adam_eps",
    "train.log_every",
    "train.eval_every",
    "train.max_bad_steps",
    "decode.beam",
    "decode.batch_tokens",
}
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch
_NON_NEGATIVE = {
    "train.max_epochs",
    "train.max_minutes",
    "train.warmup_steps",
    "train.weight_decay",
    "train.rdrop",
    "train.dropout_warmup",
    "train.clip_norm",
    "train.threads",
    "train.eval_sentences",
    "train.patience",
    "train.keep_last",
    "decode.length_penalty",
    "decode.max_len_a",
    "decode.max_len_b",
    "decode.workers",
}
MAX_INT = 2**53  # integer keys: larger values overflow the floats they meet
# sizes far beyond any model this tool trains, refused before a tokenizer or model is built: the
# tokenizers library aborted the process at tokenizer.vocab_size 1e9 (a 70 GB allocation), and
# model.d_ff 1e12 or a search at decode.beam 1e10 ended in a traceback (stop 56)
AT_MOST = {
    "tokenizer.vocab_size": 1_000_000,
    "model.d_model": 65_536,
    "model.d_ff": 1_048_576,
    "model.n_heads": 1_024,
    "model.n_encoder_layers": 1_000,
    "model.n_decoder_layers": 1_000,
    "model.max_positions": 1_000_000,
    "decode.beam": 1_000,
}
# GNMT length penalties in use lie in 0.6-2; ((5 + |Y|) / 6) ** alpha overflows a float past about
# 190 at Multi30k's lengths, so larger values are refused rather than crash a decode
MAX_LENGTH_PENALTY = 10.0
_UNIT_INTERVAL = {
    "tokenizer.bpe_dropout",
    "model.dropout",
    "model.attention_dropout",
    "train.label_smoothing",
    "train.ema",
    "train.dropout_start",
    "train.word_dropout",
    "train.tgt_word_dropout",
    "train.bidirectional",
    "train.diversify",
    "train.extra_sources",
}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, hint: Any, key: str, where: str) -> Any:
    """Check/convert one YAML or --set value to the field's declared type."""
    bad = ConfigError(f"{where}: {key} must be {_type_name(hint)}, got {_shown(value)}")
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[T, ...]: any length
            return tuple(_convert(v, args[0], f"each item of {key}", where) for v in value)
        if len(value) != len(args):
            raise bad
        return tuple(_convert(v, a, key, where) for v, a in zip(value, args, strict=True))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, str):  # YAML 1.1 reads 1e4 (no dot) as a string
            try:  # digits alone as an integer (stop 64: "9007199254740993" was rounded through a float)
                value = int(value) if value.strip().lstrip("+-").isdigit() else float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad
        if abs(value) > MAX_INT:  # would overflow the float arithmetic it meets (a schedule, a bar)
            raise ConfigError(f"{where}: {key} must be at most 2**53 in size, got {_shown(value)}")
        return value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer of 309 digits or more
                raise ConfigError(f"{where}: {key} must be a finite number, got {_shown(value)}") from None
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
        if not math.isfinite(number):  # YAML's .nan/.inf, or --set x=nan: every key has 0 as its "off"
            raise ConfigError(f"{where}: {key} must be a finite number, got {_shown(value)}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple, dict)):
            raise bad
        if isinstance(value, bool):  # YAML 1.1 reads no, yes, on, off, n, y as booleans
            raise ConfigError(
                f"{where}: {key} must be a string, got {value!r}; YAML reads an unquoted no/yes/on/off as "
                f"true or false, so quote it (e.g. {_quoted_example(key, 'no')})"
            )
        # YAML's reading of unquoted text: 010 is 8, 1_000 is 1000, 2016.10 is 2016.1, 2024-01-05 a
        # date, ~ nothing (stop 54: the number's text was taken, data.dir 010 naming directory 8)
        raise ConfigError(
            f"{where}: {key} must be a string, got {_shown(value)}: YAML reads some unquoted text as a number, "
            f"a date or null; quote it as you mean it (e.g. {_quoted_example(key)})"
        )
    raise bad


def _quoted_example(key: str, value: str = "...") -> str:
    """`name: "value"`, or `name: ["value"]` for an item of a list key (stop 62: the example for
    data.extra_src_langs was itself refused)."""
    name = key.rpartition(".")[2]
    return f'{name}: ["{value}"]' if key.startswith("each item of ") else f'{name}: "{value}"'


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(args[0], str(args[0]))
        if len(set(args)) == 1 and args[0] in (int, float):  # (stop 64: "a list of float, float")
            return f"a list of {len(args)} {'numbers' if args[0] is float else 'integers'}"
        return "a list of " + ", ".join(a.__name__ for a in args)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in _section_types().items() for f in dataclasses.fields(cls)]


def _section_types() -> dict[str, type]:
    hints = _hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


# other tools' names for mtx's keys (fairseq, OpenNMT-py, JoeyNMT, Hugging Face), for "did you mean"
_OTHER_NAMES = {
    "learning_rate": "train.lr",
    "warmup": "train.warmup_steps",
    "warmup_updates": "train.warmup_steps",
    "grad_accum": "train.accum_steps",
    "gradient_accumulation_steps": "train.accum_steps",
    "update_freq": "train.accum_steps",
    "accum_count": "train.accum_steps",
    "max_update": "train.max_steps",
    "train_steps": "train.max_steps",
    "max_epoch": "train.max_epochs",
    "epochs": "train.max_epochs",
    "max_tokens": "train.batch_tokens",
    "batch_size": "train.batch_tokens",
    "clip_grad_norm": "train.clip_norm",
    "max_grad_norm": "train.clip_norm",
    "bf16": "train.amp",
    "fp16": "train.amp",
    "beam_size": "decode.beam",
    "lenpen": "decode.length_penalty",
    "ema_decay": "train.ema",
    "dim": "model.d_model",
    "hidden_size": "model.d_model",
    "embed_dim": "model.d_model",
    "heads": "model.n_heads",
    "ffn_dim": "model.d_ff",
    "ff_size": "model.d_ff",
}


def _closest_key(key: str) -> str | None:
    """The known key an unknown `key` most likely meant, regardless of case: another tool's name
    for it, the key of another section with its name (train.beam: decode.beam), the one key of
    its section that it begins (train.warmup: train.warmup_steps), else the closest spelling
    (stop 64: difflib alone answered train.amp for train.warmup and train.ema for train.beam)."""
    keys = _all_keys()
    lowered = key.strip().lower()
    section, _, leaf = lowered.rpartition(".")
    leaves = [k.rpartition(".")[2] for k in keys]
    known = {leaf: k for leaf, k in zip(leaves, keys, strict=True) if leaves.count(leaf) == 1}
    if lowered in known.values() or lowered in _section_types():
        return lowered  # a key or section in other case: TRAIN.LR
    if leaf in _OTHER_NAMES:
        return _OTHER_NAMES[leaf]
    if leaf in known:  # a key put outside its section, or in another one: lr, model.lr
        return known[leaf]
    begun = [k for k in keys if k.startswith(f"{section}.{leaf}")] if section and len(leaf) >= 3 else []
    if len(begun) == 1:
        return begun[0]
    if section in _section_types():  # a key, not a section (stop 69's probe: train.foo "did you mean train?"):
        # the closest leaf of any section's, its own on a tie (train.max_position: model.max_positions)
        ratio, _, best = max(
            (difflib.SequenceMatcher(None, leaf, k.rpartition(".")[2]).ratio(), k.startswith(f"{section}."), k)
            for k in keys
        )
        return best if leaf and ratio >= 0.75 else None
    known |= {k.lower(): k for k in keys + list(_section_types())}
    close = difflib.get_close_matches(lowered, list(known), n=1, cutoff=0.5)
    return known[close[0]] if close else None


def _unknown(key: str, where: str) -> ConfigError:
    """The error for an unknown key, with the closest known one (`_closest_key`); a key with
    invisible characters (a non-breaking space) is shown quoted (stop 54)."""
    close = _closest_key(key)
    hint = f" (did you mean {close}?)" if close and close != key else ""
    shown = key if key.isprintable() and key.isascii() and key == key.strip() else repr(key)
    return ConfigError(f"{where}: unknown key {shown}{hint}")


def from_dict(raw: Any, where: str = "config", file_where: str | None = None, set_keys: Iterable[str] = ()) -> Config:
    """Build a validated Config from nested dicts (e.g. parsed YAML). A key's own error names
    `file_where` (the file) unless --set gave it (`set_keys`); checks across keys name `where`."""
    set_keys = set(set_keys)
    given = set_keys | {key.partition(".")[0] for key in set_keys}  # --set's keys and their sections

    def origin(dotted: str) -> str:
        """Where a key's (or a top-level name's) own error points: --set where it gave it, else the file."""
        return "--set" if dotted in given else file_where or where

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file_where or where}: the top level must be a mapping of sections, got {_shown(raw)}")
    sections = _section_types()
    built = {}
    for name, value in raw.items():
        if name not in sections:
            section, _, key = str(name).partition(".")
            if section in sections and key in _hints(sections[section]):
                # (stop 62: "unknown key train.lr (did you mean train.lr?)" for --set's dotted name)
                raise ConfigError(  # (stop 64: these three, the file's, were blamed on "FILE (with --set)")
                    f"{file_where or where}: {name}: a config file nests each key in its section; write '{section}:' "
                    f"and under it '  {key}: ...'"
                )
            raise _unknown(str(name), origin(str(name)))
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{file_where or where}: section {name} must be a mapping, got {_shown(value)}")
        cls = sections[name]
        hints = _hints(cls)
        kwargs = {}
        for key, item in value.items():
            dotted = f"{name}.{key}"
            if key not in hints:  # (stop 63: a file's unknown key was blamed on "FILE (with --set)")
                raise _unknown(dotted, origin(dotted))
            # (stop 62: a file's bad value was blamed on "FILE (with --set)" whenever --set was given)
            kwargs[key] = _convert(item, hints[key], dotted, origin(dotted))
        built[name] = cls(**kwargs)
    cfg = Config(**built)
    try:
        validate(cfg, where)
    except ConfigError as e:
        raise ConfigError(attributed(str(e), where, file_where, set_keys, e.keys, given_keys(raw))) from None
    return cfg


def given_keys(raw: dict[str, Any]) -> set[str]:
    """The dotted keys a raw config (a file's, with --set applied) gives values for."""
    return {f"{name}.{key}" for name, section in raw.items() if isinstance(section, dict) for key in section}


_DOTTED_KEY = re.compile(r"\b(?:data|tokenizer|model|train|decode)\.[a-z_]+")


def attributed(
    message: str,
    where: str,
    file_where: str | None,
    set_keys: Iterable[str],
    keys: Iterable[str] | None = None,
    given: set[str] | None = None,
) -> str:
    """A check's error `message` ("WHERE: ...") naming where the keys at fault came from: the file
    where none came from --set, "--set" where all did, WHERE ("FILE (with --set)") where both
    gave some (stop 63: `train.lr: -1` in a file was blamed on "FILE (with --set)" whenever any
    --set was given). The keys at fault are `keys`, else those the message names, of them only
    those `given` holds where it is given: a key at its default came from neither (stop 66:
    `--set train.dropout_start=0.2` alone was blamed on the file too, for the default
    train.dropout_warmup the message names)."""
    if file_where is None or not message.startswith(f"{where}: "):
        return message
    keys = set(keys if keys is not None else _DOTTED_KEY.findall(message))
    if given is not None:
        keys &= given
    from_set = keys & set(set_keys)
    if not keys or (from_set and from_set != keys):
        return message
    return f"{'--set' if from_set else file_where}: {message.removeprefix(f'{where}: ')}"


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) suitable for YAML."""

    def plain(x: Any) -> Any:
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x

    return {
        s.name: {k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, s.name)).items()}
        for s in dataclasses.fields(cfg)
    }


def expand_user(text: str) -> Path:
    """`text` as a path, with a leading ~ or ~user expanded; a ConfigError (without a key) says why
    one cannot be: `user_path` and the command line's path options share it (stop 69's probe: the
    options still said "no such user" for stop 67's case)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        user = text.split("/", 1)[0]
        # (stop 67: `~` with $HOME unset and a user id without a passwd entry said "no such user")
        why = "no such user" if user != "~" else "$HOME is unset and this user has no home directory"
        raise ConfigError(f"cannot expand {user} in {text!r} ({why}); give the path in full") from None


def user_path(text: str, key: str) -> Path:
    """`text` as a path, with a leading ~ or ~user expanded; a user that does not exist is an error
    naming `key` (stop 56: `data.dir=~nouser/x` was a traceback from `Path.expanduser`)."""
    try:
        return expand_user(text)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a split or language name inside the data directory (a file name's
    part, not a path: stop 56's `mtx eval --split /elsewhere/val` read files outside it and wrote
    its hypotheses beside them), or None."""
    if not name.strip():
        return f"must not be empty, got {name!r}"
    if name != name.strip():  # (stop 64: `de` and a no-break space looked for "train.de .gz")
        return f"must not begin or end with a space, got {name!r}"
    if not name.isprintable():  # (stop 64: a line break in --split made a two-line error)
        return f"must be a name without control characters, got {name!r}"
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        return f"must be a name within the data directory, not a path, got {name!r}"
    return None


def validate(cfg: Config, where: str = "config") -> None:
    """Range and consistency checks that types alone cannot express."""
    flat = {f"{s}.{k}": v for s, sec in to_dict(cfg).items() for k, v in sec.items()}
    for key, allowed in _CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"{where}: {key} must be one of {', '.join(allowed)}, got {flat[key]!r}")
    for key in _POSITIVE:
        if flat[key] <= 0:
            raise ConfigError(f"{where}: {key} must be > 0, got {flat[key]!r}")
    for key in _NON_NEGATIVE:
        if flat[key] < 0:
            raise ConfigError(f"{where}: {key} must be >= 0, got {flat[key]!r}")
    for key, most in AT_MOST.items():
        if flat[key] > most:
            raise ConfigError(f"{where}: {key} must be at most {most:,}, got {flat[key]:,}")
    for key in _UNIT_INTERVAL:
        if not 0.0 <= flat[key] < 1.0:
            raise ConfigError(f"{where}: {key} must be in [0, 1), got {flat[key]!r}")
    for key in ("data.dir", "data.src_lang", "data.tgt_lang", "data.train_split", "data.valid_split"):
        if not str(flat[key]).strip():  # (stop 53: an empty data.dir read the current directory)
            raise ConfigError(f"{where}: {key} must not be empty")
    for key in ("data.src_lang", "data.tgt_lang", "data.train_split", "data.valid_split"):
        problem = name_problem(flat[key])
        if problem:
            raise ConfigError(f"{where}: {key} {problem}")
    if cfg.decode.length_penalty > MAX_LENGTH_PENALTY:
        raise ConfigError(
            f"{where}: decode.length_penalty must be at most {MAX_LENGTH_PENALTY:g}, got {cfg.decode.length_penalty}"
        )
    if not 0 <= cfg.train.seed < 2**32:
        raise ConfigError(f"{where}: train.seed must be in [0, 2**32), got {cfg.train.seed}")
    m = cfg.model
    if m.activation_dropout != -1.0 and not 0.0 <= m.activation_dropout < 1.0:
        raise ConfigError(
            f"{where}: model.activation_dropout must be -1 (as model.dropout) or in [0, 1), "
            f"got {m.activation_dropout!r}",
            keys=("model.activation_dropout",),
        )
    if m.d_model % m.n_heads:
        raise ConfigError(f"{where}: model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"{where}: model.d_model / model.n_heads must be even")
    if m.d_model % 2:
        raise ConfigError(f"{where}: model.d_model must be even (sinusoidal positions)")
    # compared without case: a file system that ignores it (macOS, Windows) reads train.EN as train.en
    # (stop 67: `src_lang: EN`, `tgt_lang: en` trained a copying model there)
    if cfg.data.src_lang.casefold() == cfg.data.tgt_lang.casefold():
        raise ConfigError(
            f"{where}: data.src_lang and data.tgt_lang are both {cfg.data.src_lang!r}"
            + ("" if cfg.data.src_lang == cfg.data.tgt_lang else f" (and {cfg.data.tgt_lang!r})")
        )
    extra = cfg.data.extra_src_langs
    folded = [lang.casefold() for lang in extra]
    for lang in extra:
        problem = name_problem(lang)
        if problem:  # (stop 62: a path was taken, then missing as the file train.../other/train.fr)
            raise ConfigError(f"{where}: each of data.extra_src_langs {problem}")
        mains = (cfg.data.src_lang.casefold(), cfg.data.tgt_lang.casefold())
        if lang.casefold() in mains or folded.count(lang.casefold()) > 1:  # (empty: name_problem)
            raise ConfigError(
                f"{where}: data.extra_src_langs must list other languages than data.src_lang and data.tgt_lang, "
                f"each once, got {list(extra)}"
            )
    if cfg.train.extra_sources and not extra:
        raise ConfigError(f"{where}: train.extra_sources needs data.extra_src_langs (e.g. [fr, cs])")
    if extra and not cfg.train.extra_sources:
        raise ConfigError(
            f"{where}: data.extra_src_langs is set but train.extra_sources is 0; set the fraction of the budget "
            "that trains on them (e.g. 0.5)"
        )
    if cfg.tokenizer.vocab_size < 300:
        raise ConfigError(
            f"{where}: tokenizer.vocab_size must be >= 300 (256 bytes + specials), got {cfg.tokenizer.vocab_size}"
        )
    if not 0.0 <= cfg.train.adam_betas[0] < 1.0 or not 0.0 <= cfg.train.adam_betas[1] < 1.0:
        raise ConfigError(f"{where}: train.adam_betas must both be in [0, 1)")
    if cfg.train.adam_eps < FLOAT32_TINY:
        # (stop 64: 1e-46 passed the > 0 check and was 0 in float32: Adam's 0/0 on rows without a gradient)
        raise ConfigError(
            f"{where}: train.adam_eps must be at least {FLOAT32_TINY:.3g} (float32's smallest normal number, "
            f"as the optimizer holds it), got {cfg.train.adam_eps!r}; the default is 1e-9"
        )
    if m.restrict_output and cfg.tokenizer.bpe_dropout:
        raise ConfigError(
            f"{where}: model.restrict_output needs tokenizer.bpe_dropout: 0 (BPE-dropout makes pieces the "
            "output vocabulary, read off the deterministic segmentation of train, does not hold)"
        )
    if cfg.train.bidirectional and not cfg.tokenizer.joint:
        raise ConfigError(
            f"{where}: train.bidirectional needs tokenizer.joint: true (a reversed pair feeds target pieces "
            "to the encoder and source pieces to the softmax)"
        )
    if cfg.train.bidirectional and m.restrict_output:
        raise ConfigError(
            f"{where}: train.bidirectional needs model.restrict_output: false (the reversed pairs' targets "
            "are source pieces, outside a softmax over the target pieces of train)"
        )
    if cfg.train.diversify and cfg.train.bidirectional < cfg.train.diversify:
        raise ConfigError(
            f"{where}: train.diversify needs train.bidirectional >= train.diversify, got "
            f"{cfg.train.bidirectional:g} < {cfg.train.diversify:g} (the model back-translates train's targets, "
            "so it must still be training tgt->src then)"
        )
    # model.activation_dropout is dropout too: -1 follows model.dropout, above 0 a rate of its own
    # (stop 65: a model whose only dropout was the FFN's was refused as having none)
    if cfg.train.rdrop and not (m.dropout or m.attention_dropout or m.activation_dropout > 0):
        raise ConfigError(
            f"{where}: train.rdrop needs model.dropout, model.attention_dropout or model.activation_dropout "
            "above 0 (without dropout its two passes are the same and it only doubles the cost of a step)"
        )
    if cfg.train.dropout_warmup and cfg.train.compile:
        raise ConfigError(
            f"{where}: train.dropout_warmup needs train.compile: false (each new dropout rate recompiles the model)"
        )
    # the shortest source the searches see is one piece and EOS (empty lines skip them): a cap
    # of 1 there leaves room for EOS only (an empty translation, and an n-best list of one)
    if math.floor(2 * cfg.decode.max_len_a + cfg.decode.max_len_b + 1e-9) < 2:
        raise ConfigError(
            f"{where}: decode.max_len_a {cfg.decode.max_len_a:g} and decode.max_len_b {cfg.decode.max_len_b:g} "
            "leave room for EOS only after a one-piece source (its cap is max_len_a * 2 + max_len_b, EOS counted), "
            "so its translation would be empty; raise them (the shipped configs use 1.2 and 10)"
        )
    if cfg.data.max_len + 2 > m.max_positions:
        raise ConfigError(
            f"{where}: data.max_len + 2 ({cfg.data.max_len + 2}) exceeds model.max_positions ({m.max_positions})"
        )


def parse_override(text: str) -> tuple[str, str]:
    """`key=value` -> (key, the value's text, stripped)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. train.max_steps=200")
    key, _, value = text.partition("=")
    if not key.strip():
        raise ConfigError(f"--set {text!r}: no key before '='; expected KEY=VALUE, e.g. train.max_steps=200")
    return key.strip(), value.strip()


def _override_value(key: str, text: str) -> Any:
    """The YAML reading of a --set value (its text, if it is not valid YAML)."""
    if not text:
        return text
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader
    except _ScalarError as e:  # an invalid date, a base-60 number, ...
        raise ConfigError(f"--set {key}: {e.problem}") from None
    except yaml.YAMLError:
        return text
    except RecursionError:  # (stop 56: a value of 3,000 nested brackets was a 3,000-line traceback)
        raise ConfigError(f"--set {key}: the value is nested too deeply") from None


def apply_overrides(
    raw: dict[str, Any], overrides: list[str], where: str = "--set", file_where: str = "config"
) -> None:
    """Apply dotted `section.key=value` overrides to a raw nested dict (read from `file_where`), in place."""
    valid = set(_all_keys())
    for text in overrides:  # a key given twice: the last wins, as for any repeated option
        key, text_value = parse_override(text)
        if key in _section_types():
            example = next(k for k in _all_keys() if k.startswith(f"{key}."))
            raise ConfigError(f"{where} {text}: {key} is a section; set one of its keys, e.g. {example}=...")
        if key not in valid:
            raise _unknown(key, where)
        section, name = key.split(".", 1)
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):  # (`train: 5` in the file: a traceback; stop 64: blamed on --set)
            raise ConfigError(f"{file_where}: section {section} must be a mapping, got {_shown(raw[section])}")
        if _hints(_section_types()[section])[name] is str and not text_value.startswith(("'", '"')):
            # a string key takes the text as typed: YAML would read data.dir=010 as 8, 1:20 as 80,
            # and cut "a #2" at the comment (stop 53); quotes still work
            raw[section][name] = text_value
        else:
            raw[section][name] = _override_value(key, text_value)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it would keep the last
    silently: `max_steps: 3` then `max_steps: 5` trains 5 steps), a base-60 number, and a scalar
    that is not what its tag says (see `_scalar`)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    merged = False
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
            if merged:  # (stop 64: the last `<<` won, as a repeated key would, which is refused)
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "the merge key '<<' appears twice in one mapping; list the mappings in one '<<: [...]'",
                    key_node.start_mark,
                )
            merged = True
            _check_merge(value_node, key_node.start_mark)
            continue
        key = loader.construct_object(key_node)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: construct_mapping says so below
            continue
        if repeated:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping; keep one", key_node.start_mark
            )
        seen.add(key)
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


def _check_merge(value: yaml.Node, mark: yaml.Mark) -> None:
    """Refuse a merge whose outcome depends on the PyYAML version (stop 64: `<<: [{lr: 0.001},
    {lr: 0.5}]` trained at 0.5 with PyYAML 6.0.4, at 0.001 with 6.0.3 and the YAML spec): a list
    of mappings that set one key twice."""
    if not isinstance(value, yaml.SequenceNode):
        return
    seen: set[str] = set()
    for item in value.value:
        for key_node, _ in item.value if isinstance(item, yaml.MappingNode) else []:
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"two of the mappings merged by '<<' set {key_node.value!r}, and YAML tools differ on which "
                    "one wins; set it in one of them",
                    mark,
                )
            seen.add(key_node.value)


class _ScalarError(yaml.constructor.ConstructorError):
    """A scalar that YAML 1.1 reads as no value or as one the user may not mean (`_scalar`)."""


_SCALARS = {
    "int": yaml.constructor.SafeConstructor.construct_yaml_int,
    "float": yaml.constructor.SafeConstructor.construct_yaml_float,
    "bool": yaml.constructor.SafeConstructor.construct_yaml_bool,
    "timestamp": yaml.constructor.SafeConstructor.construct_yaml_timestamp,
}


def _scalar(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> Any:
    """YAML 1.1's int, float, bool and timestamp scalars, with a `_ScalarError` at the value's line
    where PyYAML raised a ValueError traceback (an invalid date such as 2023-02-29, an integer past
    Python's 4,300 digits, `!!int abc`), and for base-60 numbers: YAML 1.1 reads `max_minutes: 1:30`
    as 90 without a word."""
    kind = node.tag.rpartition(":")[2]
    text = loader.construct_scalar(node)
    shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"
    try:
        value = _SCALARS[kind](loader, node)
    except (ValueError, LookupError, AttributeError) as e:
        if kind == "timestamp":
            reason = f" ({e})" if isinstance(e, ValueError) else ""  # day is out of range for month
            problem = f"{shown} is not a valid date{reason}; quote it if it is text"
        elif kind == "int" and sum(c.isdigit() for c in text) > 4300:
            problem = f"the integer {shown} has more than 4,300 digits, more than any setting takes"
        else:
            problem = f"{shown} is not a valid {kind}"
        raise _ScalarError(None, None, problem, node.start_mark) from None
    digits = text.lstrip("+-").replace("_", "")
    if kind == "int" and len(digits) > 1 and digits[0] == "0" and digits[1].isdigit() and value != int(text, 10):
        # (stop 62: `max_steps: 010` trained 8 steps, `--set train.seed=0042` seeded 34)
        raise _ScalarError(
            None,
            None,
            f"YAML 1.1 reads {shown} as the octal number {value}; write {int(text, 10)} without the leading zero, "
            "or quote it if it is text",
            node.start_mark,
        )
    if kind in ("int", "float") and ":" in text:
        raise _ScalarError(
            None,
            None,
            f"YAML 1.1 reads {shown} as the base-60 number {value:g}; write the plain number you mean, "
            "or quote it if it is text",
            node.start_mark,
        )
    return value


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
for _kind in _SCALARS:
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_kind}", _scalar)


def _only_empty_sections(raw: Any) -> bool:
    """Whether a config's top level names known sections only, each left empty (`train:`)."""
    sections = _section_types()
    return isinstance(raw, dict) and bool(raw) and all(k in sections and v in (None, {}) for k, v in raw.items())


def load_config(path: str | Path | None, overrides: list[str] | None = None, whole: bool = False) -> Config:
    """Read a YAML config (or defaults when path is None) and apply --set overrides. `whole`: a run's
    config.yaml, which mtx train writes with every section: one missing means the file was cut
    or emptied, and the defaults in its place were blamed on the checkpoint (stop 56: "trained
    with model.d_model=64, the run's config has 256" for an emptied config.yaml). Keys may be
    missing: a run of an earlier mtx lacks the keys added since, which take their defaults."""
    raw: Any = {}
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(not_found(path, "config file")) from None
        except UnicodeDecodeError as e:  # (stop 62: named a byte position, not a line)
            line = e.object[: e.start].count(b"\n") + 1
            raise ConfigError(f"{path}: line {line} is not valid UTF-8; save the config as UTF-8") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e})") from None
        try:
            raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader
        except yaml.reader.ReaderError as e:  # a control character (stop 54: "invalid YAML" alone)
            char = e.character if isinstance(e.character, str) else chr(e.character)
            line = text[: e.position].count("\n") + 1
            raise ConfigError(
                f"{path}: line {line} holds the control character {char!r}, which YAML does not allow "
                "(pasted terminal colours?); remove it"
            ) from None
        except RecursionError:  # (stop 56: a 2,990-line traceback)
            raise ConfigError(f"{path}: malformed YAML: nested too deeply") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "invalid YAML"
            raise ConfigError(f"{path}: malformed YAML{at}: {problem}") from None
        if (raw is None or raw == {}) and not whole:  # (stop 56: an empty file trained the defaults: 10,000 steps)
            raise ConfigError(
                f"{path}: the config is empty; give at least one section (configs/tiny.yaml is a small example)"
            )
        if _only_empty_sections(raw) and not whole:  # (stop 59: `train:` alone trained the defaults too)
            raise ConfigError(
                f"{path}: the config is empty: its sections ({', '.join(raw)}) set no key; give at least one "
                "(configs/tiny.yaml is a small example)"
            )
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        missing = [name for name in _section_types() if whole and not isinstance(raw.get(name), dict)]
        if missing:
            raise CheckpointError(
                f"{path}: no {', '.join(missing)} section{'s' if len(missing) > 1 else ''}; mtx train writes "
                "the whole config, so the file was cut short or emptied: restore it from a copy"
            )
    file_where = where
    if overrides:
        apply_overrides(raw, overrides, file_where=where)
        where = f"{where} (with --set)"
    set_keys = [parse_override(text)[0] for text in overrides or []]
    cfg = from_dict(raw, where, file_where, set_keys)
    if cfg.train.dropout_start and not cfg.train.dropout_warmup and (overrides or not whole):
        # (it was ignored without a word; a run saved so still translates and resumes as it trained)
        message = (
            f"{where}: train.dropout_start is set but train.dropout_warmup is 0; set the updates over which "
            "dropout rises from it to model.dropout (e.g. 4000), or drop train.dropout_start"
        )
        fault = ("train.dropout_start", "train.dropout_warmup")
        raise ConfigError(attributed(message, where, file_where, set_keys, fault, given_keys(raw)))
    return cfg


def config_text(cfg: Config) -> str:
    """The YAML a run records as its config.yaml, which `load_config` reads back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


CONFIG_FILE = "config.yaml"  # a run directory's resolved config


def load_run_config(run_dir: Path, overrides: list[str] | None = None) -> Config:
    """A run directory's config (with `--set` overrides), read without importing torch."""
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise CheckpointError(not_found(run_dir, "run directory"))
    if not path.is_file():
        if (run_dir / "checkpoints" / "last.pt").is_file():  # (stop 62: "is this an mtx run directory?")
            raise CheckpointError(
                f"{run_dir}: {CONFIG_FILE} is missing, though the run's checkpoints are here; restore it from a "
                f"copy, or let `{command_line(*own_command(), 'train', '--run-dir', run_dir, '--resume')}` write "
                "it from last.pt (it trains on if the run has not ended)"
            )
        raise CheckpointError(f"{run_dir}: no {CONFIG_FILE}; is this an mtx run directory?")
    return load_config(path, overrides, whole=True)
