"""A trained run as a CTranslate2 model: the same weights for a C++ engine that decodes without
torch (`mtx export`).

The directory holds CTranslate2's files (`model.bin`, `config.json`, the vocabularies), the run's
tokenizers as `source_tokenizer.json` / `target_tokenizer.json` (HF `tokenizers` files: they turn
text into the pieces CTranslate2 reads and its output pieces back into text), and `mtx_export.json`
(what was exported, and mtx's decoding settings). It is written beside its final place and renamed
into it, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, normalizers

from mtx import __version__
from mtx.checkpoint import LoadedRun, abandoned, fsync_dir, make_held
from mtx.config import QUANTIZATIONS
from mtx.errors import MtxError, import_failed, named_os_errors
from mtx.model import Ensemble, ScaleNorm, Seq2Seq
from mtx.plot import parent_directories
from mtx.text import DROPPED_INSIDE, stripped
from mtx.tokenizer import BPE, LINE_BREAKS

# the logit bias of target pieces a `model.restrict_output` softmax leaves out: exp(-65000) is 0 in
# any float type, and -65000 fits float16 (-1e9 did not: numpy warned of an overflow on the cast)
OUTSIDE_BIAS = -65000.0
INFO_FILE = "mtx_export.json"


def _np(t: torch.Tensor) -> Any:
    return t.detach().float().cpu().numpy()


def _linear(spec: Any, module: torch.nn.Linear) -> None:
    spec.weight = _np(module.weight)
    if module.bias is not None:
        spec.bias = _np(module.bias)


def _char_class(wanted: Callable[[str], bool]) -> str:
    """A regex class, in the syntax of the Oniguruma engine that `tokenizers` runs, of the code
    points for which `wanted` is true."""
    ranges: list[tuple[int, int]] = []
    for code in range(sys.maxunicode + 1):
        if wanted(chr(code)):
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))
    return "[" + "".join(f"\\x{{{a:X}}}" + (f"-\\x{{{b:X}}}" if b > a else "") for a, b in ranges) + "]"


def exported_tokenizer(
    tok: BPE, source: bool, one_space: bool = False, folds: Mapping[str, str] | None = None
) -> Tokenizer:
    """`tok` as a `tokenizers` file that reads and writes a line as mtx does.

    - The characters `mtx.text.clean_line` drops at either end of a line (whitespace, a byte order
      mark, direction marks, other invisible characters) go before NFC, as in mtx (stop 65: the
      file left them, and a line after a direction mark got another translation).
    - A line break that pieces spell decodes as a space, as `BPE.decode_batch` makes it; strip the
      decoded text's ends, as mtx does.
    - On the source side, the special tokens' text (`</s>`, `<unk>`) in a line is text, as mtx
      reads it (`encode_special_tokens`, which the file does not keep: stop 65, `Ein </s> Mann`
      was read as an end of sentence). The target side keeps them as special tokens, so that
      decoding drops them as mtx does.
    - With `one_space` (a source read under `decode.normalize_spaces`), the characters
      `mtx.text.one_spaced` drops inside a line go first, and each run of whitespace inside it is
      one space.
    - With `folds` (the run's `mtx.punctuation.folds`, under `decode.normalize_punctuation`), each
      of their characters is read as the one it folds to, before NFC as in mtx."""
    edge, breaks = _patterns()
    spec = json.loads(tok.tokenizer.to_str())
    if source:
        spec["added_tokens"] = []
    out = Tokenizer.from_str(json.dumps(spec))
    inside, spaces = _one_space_patterns()
    steps = [normalizers.Replace(Regex(inside), "")] if one_space else []
    steps.append(normalizers.Replace(Regex(edge), ""))
    if one_space:
        steps.append(normalizers.Replace(Regex(spaces), " "))
    steps += [normalizers.Replace(char, read_as) for char, read_as in (folds or {}).items()]
    out.normalizer = normalizers.Sequence([*steps, out.normalizer])  # (NFC last, as in mtx)
    out.decoder = decoders.Sequence([out.decoder, decoders.Replace(Regex(breaks), " ")])
    return out


@functools.cache
def _patterns() -> tuple[str, str]:
    """(what `clean_line` drops at a line's ends, a run of line breaks) as `tokenizers` regexes."""
    edge = _char_class(stripped)
    return f"\\A{edge}+|{edge}+\\z", _char_class(lambda c: c in LINE_BREAKS) + "+"


@functools.cache
def _one_space_patterns() -> tuple[str, str]:
    """(what `one_spaced` drops inside a line, a run of whitespace) as `tokenizers` regexes."""
    return _char_class(lambda c: ord(c) in DROPPED_INSIDE), _char_class(str.isspace) + "+"


def ctranslate2_vocabulary(tok: BPE) -> list[str]:
    """The pieces of `tok` by id, as CTranslate2 names them."""
    by_id = sorted(tok.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    tokens[0] = "<blank>"  # CTranslate2's name for the padding token (id 0, as in mtx)
    return tokens


def outside_bias(model: Seq2Seq, value: float = OUTSIDE_BIAS) -> torch.Tensor:
    """(V_tgt,) logit bias of a restricted model (`model.restrict_output`): 0 at the pieces its
    softmax covers, `value` at the others."""
    assert model.output_ids is not None
    bias = torch.full((model.output_table.shape[0],), value)
    bias[model.output_ids.cpu()] = 0.0
    return bias


def ctranslate2_spec(model: Seq2Seq, src_tok: BPE, tgt_tok: BPE) -> Any:
    """`model` as a CTranslate2 TransformerSpec (float32 weights, not yet quantised)."""
    from ctranslate2.specs import transformer_spec

    cfg = model.cfg
    scale_norm = cfg.norm == "scale"
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.pre_norm, rms_norm=scale_norm
    )
    d = cfg.d_model

    def norm(target: Any, module: torch.nn.Module) -> None:
        if isinstance(module, ScaleNorm):  # g * x / ||x|| == RMSNorm with gain g / sqrt(D)
            target.gamma = _np(module.gain.detach().expand(d) / math.sqrt(d))
        else:
            target.gamma, target.beta = _np(module.weight), _np(module.bias)

    def unit_rows(weight: torch.Tensor) -> torch.Tensor:  # FixNorm: every embedding used at unit length
        return F.normalize(weight, dim=-1) if cfg.fix_norm else weight

    for side, emb in ((spec.encoder, model.src_embed), (spec.decoder, model.tgt_embed)):
        embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        embeddings.weight = _np(unit_rows(emb.tokens.weight))
        side.scale_embeddings = True  # by sqrt(d_model), as mtx does
        side.position_encodings.encodings = _np(emb.positions)  # mtx interleaves sin/cos
    if cfg.pre_norm:
        norm(spec.encoder.layer_norm, model.encoder_norm)
        norm(spec.decoder.layer_norm, model.decoder_norm)
    layers = [
        (s, layer, layer.sub_attn.norm) for s, layer in zip(spec.encoder.layer, model.encoder_layers, strict=True)
    ]
    layers += [
        (s, layer, layer.sub_self.norm) for s, layer in zip(spec.decoder.layer, model.decoder_layers, strict=True)
    ]
    for s, layer, self_norm in layers:
        _linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
        _linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        norm(s.self_attention.layer_norm, self_norm)
        _linear(s.ffn.linear_0, layer.ffn.fc1)
        _linear(s.ffn.linear_1, layer.ffn.fc2)
        norm(s.ffn.layer_norm, layer.sub_ffn.norm)
    for s, layer in zip(spec.decoder.layer, model.decoder_layers, strict=True):
        _linear(s.attention.linear[0], layer.cross_attn.q_proj)
        _linear(s.attention.linear[1], layer.cross_attn.kv_proj)
        _linear(s.attention.linear[2], layer.cross_attn.out_proj)
        norm(s.attention.layer_norm, layer.sub_cross.norm)
    spec.decoder.projection.weight = _np(unit_rows(model.output_table))
    if model.output_ids is not None:  # model.restrict_output: the other pieces can never be produced
        spec.decoder.projection.bias = _np(outside_bias(model))
    spec.register_source_vocabulary(ctranslate2_vocabulary(src_tok))
    spec.register_target_vocabulary(ctranslate2_vocabulary(tgt_tok))
    spec.config.add_source_eos = True  # mtx's encoder input ends with EOS
    spec.config.decoder_start_token = "<s>"
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's and ScaleNorm's
    spec.validate()
    return spec


def _staging_tag() -> str:
    """`partial-HOST-PID`: this export's staging directory is `.NAME.partial-HOST-PID`."""
    return f"partial-{socket.gethostname()}-{os.getpid()}"


def _remove_dead_exports(directory: Path) -> None:
    """Remove the staging directories of this machine's exports whose process is gone: a kill -9,
    or a SIGTERM, which ends the process without unwinding its cleanup. Another machine's (a
    shared filesystem) stay. An export holds a lock on its staging directory until it is renamed,
    and one nobody holds is a dead export's (stop 66: the process id in its name decided, and
    one of another PID namespace, a container's, was taken for alive or dead at random; it
    decides where the file system has no locks)."""
    for path in directory.glob(f".*.partial-{glob.escape(socket.gethostname())}-*"):
        if not path.is_dir():
            continue
        with abandoned(path, path.name.rsplit("-", 1)[1]) as gone:
            if gone:
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _named_as_out(staging: Path, out_dir: Path) -> Iterator[None]:
    """An error that names the staging directory, or a file in it, names its place in `out_dir`
    instead: the user gave that name, and the staging one is gone once the error is shown (stop
    63: a read-only run directory was "RUN/.ctranslate2-float32.partial-HOST-PID: Read-only file
    system")."""
    try:
        yield
    except OSError as e:
        name = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes)) else None
        if name is None or not (name == str(staging) or name.startswith(f"{staging}{os.sep}")):
            raise
        if isinstance(e, FileExistsError) and name == str(staging):  # another export's, live or not removable
            raise MtxError(
                f"{out_dir}: another export to it is under way (its staging folder {staging} is there); "
                "wait for it to end, or remove that folder if no export runs"
            ) from None
        raise OSError(e.errno, e.strerror, str(out_dir) + name[len(str(staging)) :]) from None


def _make_staging(staging: Path) -> int | None:
    """Make the staging directory `staging`, locked (`make_held`): its open descriptor, to close
    once the export is over, or None where the file system has no locks."""

    def make() -> int | None:
        staging.mkdir()
        try:
            return os.open(staging, os.O_RDONLY)
        except OSError:  # a system that opens no directory (Windows) has no `flock` either
            return None

    fd, held = make_held(staging, make)
    if fd is not None and not held:
        os.close(fd)
        return None
    return fd


def check_export(out_dir: Path, quantization: str) -> None:
    """What `export_ctranslate2` refuses that needs no model (the quantization, an --out in use,
    CTranslate2 missing): mtx export checks it before it loads the model (stop 71: after)."""
    if quantization not in QUANTIZATIONS:
        raise MtxError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if out_dir.is_symlink():  # (stop 62: refused after the conversion, naming the staging directory)
        raise MtxError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}); give the directory itself as --out")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MtxError(f"{out_dir} already exists and is not empty; pick a new --out (nothing is overwritten)")
    if out_dir.exists() and out_dir.samefile(Path.cwd()):  # (stop 62: "Invalid argument" after the conversion)
        raise MtxError(f"{out_dir} is the working directory; give a new directory as --out")
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        raise import_failed(
            e, "ctranslate2", "mtx export needs", "pip install ctranslate2 (or pip install 'mtx[export]')"
        ) from None


def export_ctranslate2(run: LoadedRun, out_dir: Path, quantization: str = "float32") -> Path:
    """Write `run`'s model, tokenizers and an info file as a CTranslate2 model directory
    `out_dir`, which must not exist yet (or be empty)."""
    if isinstance(run.model, Ensemble):
        raise MtxError("export takes one checkpoint; average several first (mtx average) and export the average")
    check_export(out_dir, quantization)
    spec = ctranslate2_spec(run.model, run.src_tok, run.tgt_tok)
    spec.optimize(quantization=quantization)
    # a failed export leaves neither the directories it made nor its staging directory, and its
    # error names --out (stop 62: a full disk was "File too large" alone, the parents were left)
    staging = out_dir.parent / f".{out_dir.name}.{_staging_tag()}"
    with parent_directories(out_dir), named_os_errors(str(out_dir)), _named_as_out(staging, out_dir):
        # this export's own name included (stop 66: it was removed whoever held it, and two
        # containers' exports can share a host name and a process id)
        _remove_dead_exports(out_dir.parent)
        held = _make_staging(staging)  # a leftover of its name went above, unless a live export holds it
        try:
            _write_model(run, spec, staging, out_dir, quantization)
        finally:
            if held is not None:
                os.close(held)
    return out_dir


def _sync_files(directory: Path) -> None:
    """Write `directory`'s files and their names to the disk (`fsync`)."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)


def _write_model(run: LoadedRun, spec: Any, staging: Path, out_dir: Path, quantization: str) -> None:
    """The model directory, written in `staging` and then renamed to `out_dir`."""
    try:
        spec.save(str(staging))
        # written by Python: `tokenizers`' save takes a UTF-8 path only (an --out named in other bytes)
        for tok, name in ((run.src_tok, "source_tokenizer.json"), (run.tgt_tok, "target_tokenizer.json")):
            source = name.startswith("source")
            folds = run.source_folds() if source else None
            exported = exported_tokenizer(tok, source, source and run.cfg.decode.normalize_spaces, folds)
            (staging / name).write_text(exported.to_str(pretty=True), encoding="utf-8")
        cfg = run.cfg
        info = {
            "mtx_version": __version__,
            "checkpoint": str(run.checkpoints[0].resolve()),  # from any directory
            "quantization": quantization,
            "src_lang": cfg.data.src_lang,
            "tgt_lang": cfg.data.tgt_lang,
            "decode": {
                "beam": cfg.decode.beam,
                "length_penalty": cfg.decode.length_penalty,
                "max_len_a": cfg.decode.max_len_a,
                "max_len_b": cfg.decode.max_len_b,
            },
            "restricted_output": run.model.output_ids is not None,
            # what source_tokenizer.json reads as the training sources write it (decode.normalize_punctuation)
            "source_punctuation_read_as": run.source_folds(),
        }
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _sync_files(staging)  # (stop 67: a power cut after the rename could leave empty or torn files)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        staging.rename(out_dir)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
