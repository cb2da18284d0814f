"""The decoding commands of `mtx`: translate, eval and score (their options are parsed in cli.py),
and what they share: the search settings from the options and the run's decode section, the run
loaded at its precision, the progress bar. Their checks run before torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mtx.config import AT_MOST, MAX_LENGTH_PENALTY, DecodeConfig, name_problem
from mtx.errors import DataError, MtxError, command_line, named_os_errors, not_found
from mtx.outputs import (
    binary_stdin,
    check_output,
    data_files,
    is_stdout,
    resolved_path,
    same_file,
    stdin_is_stdout,
    training_data,
)
from mtx.runlog import zero_width_terminal
from mtx.threads import set_threads, usable_cpus

if TYPE_CHECKING:
    from tqdm import tqdm

    from mtx.checkpoint import LoadedRun
    from mtx.config import Config
    from mtx.evaluate import PairedResult, Scores

log = logging.getLogger("mtx")


class _DecodeSettings(NamedTuple):
    """translate's and eval's search settings: the options given, else the run's decode section."""

    beam: int
    alpha: float  # the GNMT length penalty
    batch_tokens: int
    workers: int
    stop: str
    one_space: bool  # each source line read by `mtx.text.one_spaced`
    fold: bool  # and its punctuation by the run's `mtx.punctuation.folds`


def _decode_settings(args: argparse.Namespace, cfg_decode: DecodeConfig) -> _DecodeSettings:
    beam = args.beam if args.beam is not None else cfg_decode.beam
    # + 0.0: -0 is 0 (stop 70's probe: "length penalty -0" in the header and JSON, a file named lp0)
    alpha = (args.length_penalty if args.length_penalty is not None else cfg_decode.length_penalty) + 0.0
    batch_tokens = args.batch_tokens if args.batch_tokens is not None else cfg_decode.batch_tokens
    workers = args.workers if args.workers is not None else cfg_decode.workers
    stop = args.stop or cfg_decode.stop
    if not 1 <= beam <= AT_MOST["decode.beam"]:  # (stop 56: 1e10 was a traceback, 1e8 ran for minutes)
        raise MtxError(f"--beam must be from 1 to {AT_MOST['decode.beam']:,}, got {beam}")
    if not (math.isfinite(alpha) and 0 <= alpha <= MAX_LENGTH_PENALTY):
        raise MtxError(f"--length-penalty must be a number from 0 to {MAX_LENGTH_PENALTY:g}, got {alpha}")
    if batch_tokens < 1:
        raise MtxError(f"--batch-tokens must be >= 1, got {batch_tokens}")
    if workers < 0:
        raise MtxError(f"--workers must be >= 0 (0: auto), got {workers}")
    one_space = cfg_decode.normalize_spaces and not args.keep_spaces
    fold = cfg_decode.normalize_punctuation and not args.keep_punctuation
    return _DecodeSettings(beam, alpha, batch_tokens, workers, stop, one_space, fold)


def _precision(args: argparse.Namespace, cfg: Config) -> str:
    """The decoding precision: --precision, else the run's decode.precision."""
    return args.precision or cfg.decode.precision


def _settings(args: argparse.Namespace) -> tuple[Config, _DecodeSettings]:
    """The run's config and the decoding settings, checked before torch is imported (a mistake
    is reported in a fraction of a second, not after seconds of imports)."""
    from mtx.config import load_run_config

    cfg = load_run_config(args.run)
    cpus = usable_cpus()
    if not 0 <= args.threads <= cpus:  # too many: slow, and past a few thousand a crash in OpenMP
        raise MtxError(
            f"--threads must be 0 (torch's choice) to {cpus} (the CPUs mtx may use here), got {args.threads}"
        )
    return cfg, _decode_settings(args, cfg.decode)


def _load(args: argparse.Namespace) -> LoadedRun:
    import torch

    from mtx.checkpoint import load_run
    from mtx.device import pick_device, slow_bf16

    set_threads(args.threads)
    device = pick_device(args.device, "--device")
    run = load_run(args.run, args.checkpoint, device)
    if _precision(args, run.cfg) == "bf16":
        if how := slow_bf16(device):
            log.warning("bf16 products run %s on this CPU: --precision fp32 decodes faster", how)
        run.model.to(torch.bfloat16)  # log-probabilities and scores stay float32 (search.py)
    return run


def _names_a_file(text: str) -> bool:
    """Whether `text` names an existing file; text that cannot be a path is not one (stop 66: a
    sentence of over 255 bytes without a space, as Chinese or Japanese is written, was refused
    with "File name too long")."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def _utf8_argument(text: str, i: int) -> str:
    """TEXT argument `i` as UTF-8 text. Argument bytes the locale's encoding cannot decode arrive as
    lone surrogates: UTF-8 read under an ASCII locale (`LC_ALL=C` with `PYTHONUTF8=0`) is decoded
    from its bytes (stop 67: refused as "not valid UTF-8"); other bytes are an error."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            return os.fsencode(text).decode("utf-8")
        except (UnicodeError, ValueError):
            raise MtxError(f"TEXT argument {i} is not valid UTF-8; re-encode it as UTF-8") from None


def cmd_translate(args: argparse.Namespace) -> int:
    """`mtx translate`: translate TEXT arguments or standard input with a run, a line per input line."""
    from_stdin = not args.text or args.text == ["-"]
    texts = _check_translate_input(args, from_stdin)
    _, settings = _settings(args)
    if not 1 <= args.nbest <= settings.beam:
        raise MtxError(f"--nbest must be between 1 and --beam ({settings.beam}), got {args.nbest}")
    terminal, show_bar, chunks = _translate_input(args, texts, from_stdin)
    run = _load(args)
    if terminal:
        log.info("type a sentence and press Enter to translate it; Ctrl-D ends")
    short = _write_translations(args, run, settings, chunks, show_bar)
    if short:
        # (stop 62: a short length cap, or an output vocabulary of fewer pieces than --nbest, left
        # fewer different texts than asked, and the lists repeated texts without a word)
        log.warning(
            "%d input(s) have fewer than --nbest %d different translations within the length cap "
            "(decode.max_len_a, decode.max_len_b) and the output vocabulary: their lists repeat a text "
            "(another segmentation of it) or are shorter",
            short,
            args.nbest,
        )
    return 0


def _check_translate_input(args: argparse.Namespace, from_stdin: bool) -> list[str]:
    """translate's TEXT arguments (as UTF-8) or standard input, checked before the run's config is read."""
    texts = args.text
    if args.buffer_lines < 1:  # (stop 64: with TEXT arguments it was taken without a word)
        raise MtxError(f"--buffer-lines must be >= 1, got {args.buffer_lines}")
    if not from_stdin and "-" in texts:  # (stop 64: `- -` was "mixed with TEXT arguments")
        what = "given twice" if set(texts) == {"-"} else "mixed with TEXT arguments"
        raise MtxError(f"'-' (read standard input) cannot be {what}")
    if len(texts) == 1 and not from_stdin and " " not in texts[0] and _names_a_file(texts[0]):
        # (stop 64: `mtx translate notes.de` translated the file's name, as other tools' --input does not)
        log.warning(
            "TEXT %r names a file, but is translated as text; to translate the file, give it on standard input (< %s)",
            texts[0],
            command_line(texts[0]),
        )
    if from_stdin and sys.stdin is None:  # (stop 54: an AttributeError's traceback)
        raise MtxError("standard input is closed; give the sentences as TEXT arguments or on standard input")
    if from_stdin and stdin_is_stdout():
        # (stop 61: `mtx translate < f >> f` read its own translations back and translated them
        # without end, filling the disk; `cat f >> f` refuses too)
        raise MtxError("standard input and standard output are the same file; write the translations to another file")
    if not from_stdin:
        texts = [_utf8_argument(text, i) for i, text in enumerate(texts, 1)]
    return texts


def _translate_input(
    args: argparse.Namespace, texts: list[str], from_stdin: bool
) -> tuple[bool, bool, Iterable[tuple[int, list[str]]]]:
    """Whether a terminal types the input, whether a progress bar shows, and the input's lines in chunks."""
    from mtx.text import checked_line, stream_lines

    if from_stdin:
        terminal = sys.stdin.isatty()
        # a file or pipe in and out: a bar of the lines done on the terminal's stderr
        show_bar = not terminal and not sys.stdout.isatty()
        return terminal, show_bar, stream_lines(binary_stdin(), args.buffer_lines, "standard input", "the input")
    # a TEXT holding line breaks (`"$(cat notes.txt)"`) is its lines, as on standard input
    # (stop 62: translated as one sentence, its line breaks as pieces)
    # (stop 64: one with CR-only line breaks, refused on standard input, was one sentence)
    lines = [
        checked_line(part, f"TEXT argument {i}", number, "the text")
        for i, text in enumerate(texts, 1)
        for number, part in enumerate(text.removesuffix("\n").split("\n"), 1)
    ]
    return False, False, [(0, lines)]


def _write_translations(
    args: argparse.Namespace,
    run: LoadedRun,
    settings: _DecodeSettings,
    chunks: Iterable[tuple[int, list[str]]],
    show_bar: bool,
) -> int:
    """Each chunk translated and written to standard output; returns how many inputs' n-best lists are short."""
    from mtx.search import translate_ids

    dc = run.cfg.decode
    out = sys.stdout
    short = 0  # inputs whose n-best list repeats a text: fewer different ones were found
    with _progress_bar("translating", None, show_bar) as bar:
        for before, lines in chunks:  # from standard input: each as soon as it has been read
            hyps = translate_ids(
                run.model,
                run.encode_sources(lines, settings.one_space, settings.fold),
                settings.beam,
                settings.alpha,
                dc.max_len_a,
                dc.max_len_b,
                settings.batch_tokens,
                nbest=args.nbest,
                use_cache=not args.no_cache,
                workers=settings.workers,
                stop=settings.stop,
                progress=bar.update,
                # an n-best list of different texts: segmentations of one text count once
                text_key=(lambda ids: run.tgt_tok.decode_batch([ids])[0]) if args.nbest > 1 else None,
                first_line=before + 1,
            )
            with named_os_errors("standard output"):
                for i, h in enumerate(hyps, before):
                    if args.nbest == 1:
                        out.write(run.tgt_tok.decode_batch([h[0].tokens])[0] + "\n")
                    else:
                        found = run.tgt_tok.decode_batch([x.tokens for x in h])
                        short += bool(lines[i - before]) and len(set(found)) < args.nbest
                        for text, hyp in zip(found, h, strict=True):
                            out.write(f"{i} ||| {text} ||| {score_text(hyp.score)}\n")
                out.flush()
    return short


def _hypotheses_name(args: argparse.Namespace, split: str, settings: _DecodeSettings, cfg: Config) -> str:
    """`eval`'s default hypotheses file: SPLIT.beamN.LANG for the run's own checkpoint in fp32 with
    the run's length penalty; the checkpoints given, another length penalty, the inexact stop, bf16
    and sources read as written against the run's `decode.normalize_spaces` (`spaces`) or
    `decode.normalize_punctuation` (`punctuation`) add their tags, so those outputs do not replace it."""
    from mtx.checkpoint import checkpoint_dir

    tags = []
    if args.checkpoint:
        stems = "+".join(_checkpoint_tag(path, args.run) for path in args.checkpoint)
        tags.append(stems if len(stems) <= 100 else f"ensemble{len(args.checkpoint)}")
        own = checkpoint_dir(args.run).resolve()
        single_plus = len(args.checkpoint) == 1 and "+" in stems
        if len(stems) > 100 or single_plus or any(path.parent.resolve() != own for path in args.checkpoint):
            # a shortened name, or a checkpoint of another folder (a/base and b/base are both
            # "base"), carries a digest of the paths (stop 54: two ensembles shared ensemble2),
            # as does one checkpoint named like an ensemble (stop 62: a+b.pt's file was a and b's)
            paths = "\n".join(str(path.resolve()) for path in args.checkpoint)
            tags.append(hashlib.sha1(paths.encode("utf-8")).hexdigest()[:8])
    beam, alpha = settings.beam, settings.alpha
    tags.append(f"beam{beam}")
    if beam > 1 and alpha != cfg.decode.length_penalty:
        alpha += 0.0  # -0.0 -> 0.0 (not "lp-0")
        short = f"{alpha:g}"  # lp2, lp0.6 as before; the exact value where 6 digits would round it
        tags.append(f"lp{short if float(short) == alpha else repr(alpha)}")
    if beam > 1 and settings.stop == "finished":
        tags.append("finished")
    if _precision(args, cfg) != "fp32":
        tags.append(_precision(args, cfg))
    if settings.one_space != cfg.decode.normalize_spaces:
        tags.append("spaces")
    if settings.fold != cfg.decode.normalize_punctuation:
        tags.append("punctuation")
    return ".".join([split, *tags, cfg.data.tgt_lang])


def score_text(score: float) -> str:
    """An n-best score with 4 decimals, or 4 significant digits below 1 in size: at large length
    penalties every score lies near 0, and 4 decimals printed them all as -0.0000 (stop 62)."""
    # `#`: trailing zeros kept, so every score below 1 shows 4 digits (stop 63: -0.5, -1 for -0.99996)
    return f"{score:.4f}" if score == 0 or abs(score) >= 1 else f"{score:#.4g}"


def _source_tag(args: argparse.Namespace, name: str, run_data_dir: str = "") -> str:
    """What eval's default hypotheses file is named after: the split of the run's data directory;
    else the split or `--src` file's name with a digest of the path read (`val.de.1a2b3c4d`), so
    that d1/val.de and d2/val.de, or val of another --data-dir, do not share a file."""
    if args.src is not None:
        path = args.src
    # realpath, not Path.resolve: a loop of symbolic links raised RuntimeError there (Python < 3.13;
    # stop 70's probe: a run whose data.dir had become one, a traceback after the model loaded)
    elif args.data_dir is not None and os.path.realpath(args.data_dir) != os.path.realpath(run_data_dir):
        path = args.data_dir
    else:
        return name
    digest = hashlib.sha1(os.path.realpath(path).encode("utf-8")).hexdigest()[:8]
    # a long --src name is cut (the digest keeps it apart): with the tags added it passed the
    # 255 bytes a file name may have (stop 61: "File name too long" for a name the user never chose)
    short = name.encode("utf-8")[:100].decode("utf-8", "ignore")
    return f"{short}.{digest}"


def _checkpoint_tag(path: Path, run_dir: Path) -> str:
    """A checkpoint's name in a hypotheses file: its stem (`step_8000`) in the run's own
    checkpoints/, else prefixed by its run's (or directory's) name (`other-best`), so that another
    run's best.pt does not share the name of this run's."""
    from mtx.checkpoint import checkpoint_dir

    stem = path.name.removesuffix(".pt")
    folder = path.parent.resolve()
    if folder == checkpoint_dir(run_dir).resolve():
        return stem
    owner = folder.parent if folder == checkpoint_dir(folder.parent) else folder
    return f"{owner.name}-{stem}"


def cmd_eval(args: argparse.Namespace) -> int:
    """`mtx eval`: translate a test set with a run and print its sacreBLEU scores."""
    _check_eval_options(args)
    cfg, settings = _settings(args)
    # the data, the other systems' outputs and --output are checked before the model is loaded
    data = _read_eval_set(args, cfg)
    _warn_of_seen_split(args, cfg, data.name)
    samples, others = _bootstrap_and_paired(args, data)
    output = _hypotheses_path(args, cfg, data, settings)
    run = _load(args)
    text = _decode_hypotheses(args, cfg, run, data, settings, output)
    _report_scores(args, cfg, run, data, settings, output, text, others, samples)
    return 0


def _check_eval_set_options(args: argparse.Namespace) -> None:
    """--split or --src/--ref (eval's and score's), checked before any file is read; --split gets its default."""
    if (args.src is None) != (args.ref is None):
        raise MtxError("--src and --ref go together (source file and reference file)")
    if args.src is not None and (args.split is not None or args.data_dir is not None):
        raise MtxError("--src/--ref replace --split and --data-dir; give one or the other")
    for option, path in (("--src", args.src), ("--ref", args.ref)):
        if path == Path("-"):  # (stop 64: "-: file not found")
            raise MtxError(f"{option} takes a file; for standard input give {option} /dev/stdin")
    if args.split is None:  # (an empty --split "" is a mistake, not the default)
        args.split = "test_2016_flickr"
    if name_problem(args.split):  # (stop 56: a path read files elsewhere and wrote its hypotheses there)
        raise MtxError(
            f"--split takes a split name such as val or test_2016_flickr, got {args.split!r}; for files use --src/--ref"
        )


def _check_eval_options(args: argparse.Namespace) -> None:
    """eval's options that need no file read, checked before the run's config; --split gets its default."""
    from mtx.evaluate import MIN_BOOTSTRAP

    _check_eval_set_options(args)
    if args.bootstrap and args.bootstrap < MIN_BOOTSTRAP:
        raise MtxError(f"--bootstrap must be 0 (off) or at least {MIN_BOOTSTRAP} resamples, got {args.bootstrap}")
    resolved = [resolved_path("--paired", path) for path in args.paired]  # (a.en and x/../a.en are one file)
    repeated = next((path for i, path in enumerate(args.paired) if resolved[i] in resolved[:i]), None)
    if repeated is not None:  # (stop 69's probe: its test was printed twice without a word)
        raise MtxError(f"--paired {repeated} is given twice; give each system's output once")


class _EvalSet(NamedTuple):
    """What eval scores: its name (the split, or the --src file's), its lines, the files read, the split's files."""

    name: str
    src: list[str]
    ref: list[str]
    src_file: Path
    ref_file: Path
    split_files: tuple[Path | None, Path | None]


def _read_eval_set(args: argparse.Namespace, cfg: Config, as_scored: bool = True) -> _EvalSet:
    """The lines of --src/--ref, else of the split in the data directory; warnings about the references.
    `as_scored`: the references as sacreBLEU reads them (else cleaned as training reads its targets)."""
    from mtx.data import eval_split_files
    from mtx.text import read_parallel, warn_of_invisible_ends, warn_unless_nfc

    if args.src is not None:
        # a blank segment translates to an empty line, as in translate (stop 62: refused, and
        # removing it made the hypotheses one line short of other systems' for --paired)
        src, ref = read_parallel(args.src, args.ref, allow_empty=True, as_scored=as_scored)
        name = args.src.name.removesuffix(".gz")
        split_files: tuple[Path | None, Path | None] = (None, None)
    else:
        data_dir = args.data_dir or Path(cfg.data.dir)
        if not data_dir.is_dir():
            raise MtxError(f"{not_found(data_dir, 'data directory')}; pass --data-dir DIR or --src/--ref files")
        split_files = eval_split_files(data_dir, args.split, cfg.data.src_lang, cfg.data.tgt_lang)
        src, ref = read_parallel(*split_files, allow_empty=True, as_scored=as_scored)
        name = args.split
    src_file, ref_file = args.src or split_files[0], args.ref or split_files[1]  # the files read
    warn_unless_nfc(ref, str(ref_file))
    warn_of_invisible_ends(ref, str(ref_file))
    return _EvalSet(name, src, ref, src_file, ref_file, split_files)


def _warn_of_seen_split(args: argparse.Namespace, cfg: Config, name: str) -> None:
    """A warning where eval scores what the run was trained on, or the test split it was validated on."""
    from mtx.data import is_test_split

    data = cfg.data

    def scoring(split: str) -> bool:
        """Whether the source scored is the run's `split`: named by --split, or given as its file."""
        if args.src is None:
            return args.split == split
        return same_file(args.src, [Path(data.dir) / f"{split}.{data.src_lang}{gz}" for gz in ("", ".gz")])

    if scoring(data.train_split):
        # (stop 61: scored without a word)
        log.warning(
            "%s is what the run was trained on (data.train_split %r): its score measures memory, not translation",
            name,
            cfg.data.train_split,
        )
    if is_test_split(data.valid_split) and scoring(data.valid_split):
        # (stop 63: training warned, eval scored best.pt on the same split without a word)
        log.warning(
            "%s is the run's data.valid_split (%r): its best.pt, patience and validations were chosen on it, "
            "so its score is not a fair test",
            name,
            data.valid_split,
        )


def _bootstrap_and_paired(args: argparse.Namespace, data: _EvalSet) -> tuple[int, list[tuple[str, list[str]]]]:
    """The bootstrap resamples and the other systems' outputs (--paired: name, lines), checked before decoding."""
    from mtx.evaluate import (
        MAX_RESAMPLING_BYTES,
        MIN_BOOTSTRAP,
        PAIRED_SAMPLES,
        most_resampled_sentences,
        most_resamples,
        resampling_bytes,
        resampling_seed_problem,
    )
    from mtx.text import read_lines, warn_of_invisible_ends

    samples = args.bootstrap or (PAIRED_SAMPLES if args.paired else 0)
    if samples and (problem := resampling_seed_problem()):  # before decoding (stop 68's probe: after it)
        raise MtxError(problem)
    if samples and (need := resampling_bytes(samples, len(data.src))) > MAX_RESAMPLING_BYTES:  # before decoding
        most = most_resamples(len(data.src))
        # (stop 68's probe: past 250,000 sentences it advised a count below the least one allowed)
        fix = (
            f"pass --bootstrap {most} or fewer"
            if most >= MIN_BOOTSTRAP
            else f"they take at most {most_resampled_sentences():,} sentences; score a sample of the lines"
        )
        paired = "" if args.bootstrap else " (--paired's test)"
        raise MtxError(
            f"{samples} bootstrap resamples{paired} of {len(data.src)} sentences take {need / 2**30:.1f} GiB; {fix}"
        )
    # the other systems' outputs, read and counted before decoding: a wrong file fails at once
    others = [(str(path), read_lines(path, allow_empty=True, as_scored=True)) for path in args.paired]
    for path, lines in others:
        warn_of_invisible_ends(lines, f"--paired {path}", "output")
    for path, lines in others:
        if len(lines) != len(data.src):
            counted = f"{len(lines)} line{'s' * (len(lines) != 1)}"
            raise MtxError(f"--paired {path}: {counted} for the {len(data.src)} sentences of {data.name}")
    return samples, others


def _hypotheses_path(args: argparse.Namespace, cfg: Config, data: _EvalSet, settings: _DecodeSettings) -> Path:
    """Where eval writes its hypotheses (--output, else RUN/eval/...), checked before the model
    loads (stop 71: a bad --output failed only after it had loaded)."""
    from mtx.checkpoint import checkpoint_dir, run_files

    source = _source_tag(args, data.name, cfg.data.dir)
    output = args.output
    if output is None:
        output = args.run / "eval" / _hypotheses_name(args, source, settings, cfg)
    name = data.name
    check_output(
        output,
        {
            "the --paired file": args.paired,
            "the --src file": [args.src],
            "the --ref file": [args.ref],
            f"the {name} split's source file": [data.split_files[0]],
            f"the {name} split's reference file": [data.split_files[1]],
            # the --checkpoint files, else the run's default one, which lies in checkpoints/
            "a checkpoint": [*args.checkpoint, *checkpoint_dir(args.run).glob("*")],
            "one of the run's own files": run_files(args.run),
            # the text the run was trained and validated on, in its data directory or the one
            # read (a hypotheses file replaced train.en there)
            "the run's training or validation data": training_data(cfg, [Path(cfg.data.dir), args.data_dir]),
            "a data file of the data directory": data_files([Path(cfg.data.dir), args.data_dir]),
        },
    )
    return output


def _decode_hypotheses(
    args: argparse.Namespace, cfg: Config, run: LoadedRun, data: _EvalSet, settings: _DecodeSettings, output: Path
) -> list[str]:
    """The source lines translated, and written to `output` (`-`: standard output)."""
    from mtx.checkpoint import atomic_write_text
    from mtx.plot import parent_directories, replaced_at
    from mtx.search import translate

    to_stdout = str(output) == "-"  # (stop 54: a file named "-"; translate reads "-" as standard input)
    # the directories made for the hypotheses file go again if decoding or writing fails
    with contextlib.nullcontext() if to_stdout else parent_directories(output):
        with _progress_bar(f"decoding {data.name}", len(data.src)) as bar:
            text = translate(
                run.model,
                run.tgt_tok,
                run.encode_sources(data.src, settings.one_space, settings.fold),
                settings.beam,
                settings.alpha,
                cfg.decode.max_len_a,
                cfg.decode.max_len_b,
                settings.batch_tokens,
                use_cache=not args.no_cache,
                workers=settings.workers,
                stop=settings.stop,
                progress=bar.update,
            )
        if to_stdout or is_stdout(output):  # opened again, it would be written from its start (stop 54)
            with named_os_errors("standard output"):
                sys.stdout.write("".join(t + "\n" for t in text))
                sys.stdout.flush()
        elif (target := replaced_at(output)) is None:  # a device or pipe
            with named_os_errors(str(output)), open(output, "w", encoding="utf-8") as f:
                f.write("".join(t + "\n" for t in text))
        else:
            atomic_write_text(target, "".join(t + "\n" for t in text))
    return text


def _report_scores(
    args: argparse.Namespace,
    cfg: Config,
    run: LoadedRun,
    data: _EvalSet,
    settings: _DecodeSettings,
    output: Path,
    text: list[str],
    others: list[tuple[str, list[str]]],
    samples: int,
) -> None:
    """The hypotheses scored (and tested against --paired's), printed as one JSON object (--json) or as lines."""
    from mtx.evaluate import corpus_scores, paired_tests

    beam, alpha, stop = settings.beam, settings.alpha, settings.stop
    scores = corpus_scores(text, data.ref, bootstrap=args.bootstrap)
    paired = paired_tests(text, others, data.ref, samples) if others else []
    result: dict[str, Any] = {
        "split": data.name,
        "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}",
        "beam": beam,
        "length_penalty": alpha if beam > 1 else None,  # (greedy has none)
        "stop": stop,
        **_how_read(args, cfg, run, data, settings),
        **scores.as_dict(),
        "hypotheses": str(output),
    }
    low = None
    if args.lowercase:
        low = corpus_scores(text, data.ref, lowercase=True, bootstrap=args.bootstrap)
        result["bleu_lowercase"] = round(low.bleu, 2)
        result["bleu_lowercase_signature"] = low.bleu_signature
        if low.bleu_ci is not None:
            result["bleu_lowercase_mean"] = round(low.bleu_mean, 2)
            result["bleu_lowercase_ci"] = round(low.bleu_ci, 2)
    if paired:
        result["paired"] = [r.as_dict() for r in paired]
        result["paired_resamples"] = samples
    # the scores: an error here is standard output's (stop 54: a full disk was not named)
    with named_os_errors("standard output"):
        if args.json:
            print(json.dumps(result))
        else:
            _print_scores(result, scores, low, paired)


def _how_read(
    args: argparse.Namespace, cfg: Config, run: LoadedRun, data: _EvalSet, settings: _DecodeSettings
) -> dict[str, Any]:
    """What eval's and score's JSON say of how the pairs were read and decoded."""
    return {
        "precision": _precision(args, cfg),
        "normalize_spaces": settings.one_space,
        "normalize_punctuation": settings.fold,
        "punctuation_read_as": run.source_folds(settings.fold),  # {character: the one it was read as}
        # the files decoded with, the run's default one too (stop 63: [] unless --checkpoint was given)
        "checkpoints": [str(p) for p in run.checkpoints],
        "src_file": str(data.src_file),
        "ref_file": str(data.ref_file),
        "sentences": len(data.src),
    }


def _print_scores(result: dict[str, Any], scores: Scores, low: Scores | None, paired: list[PairedResult]) -> None:
    """eval's `result` as lines: what was decoded and how, BLEU (and its parts), chrF, the paired tests."""
    beam, stop = result["beam"], result["stop"]
    search_note = f", length penalty {result['length_penalty']:g}" if beam > 1 else ""
    search_note += ", stop finished" if beam > 1 and stop == "finished" else ""
    # sources read as written, where the run reads them otherwise (the file's `spaces`, `punctuation` tags)
    search_note += "" if result["normalize_spaces"] else ", spaces as written"
    search_note += "" if result["normalize_punctuation"] else ", punctuation as written"
    print(
        f"{result['split']} {result['direction']} beam {beam}{search_note}, {result['precision']} "
        f"({result['sentences']} sentences, {', '.join(result['checkpoints'])})"
    )
    print(f"BLEU {scores.bleu:6.2f}{_interval(scores.bleu_mean, scores.bleu_ci)}  {scores.bleu_signature}")
    print(f"     {scores.bleu_details}")
    if low is not None:
        print(f"BLEU {low.bleu:6.2f}{_interval(low.bleu_mean, low.bleu_ci)}  {low.bleu_signature}  (lowercased)")
    print(f"chrF {scores.chrf:6.2f}{_interval(scores.chrf_mean, scores.chrf_ci)}  {scores.chrf_signature}")
    for r in paired:
        print(
            f"against {r.name}: BLEU {r.bleu:.2f} -> {scores.bleu:.2f} ({r.bleu_delta:+.2f}, p = {r.bleu_p:.4f}), "
            f"chrF {r.chrf:.2f} -> {scores.chrf:.2f} ({r.chrf_delta:+.2f}, p = {r.chrf_p:.4f})"
        )
    if paired:
        print(
            f"(paired bootstrap, {result['paired_resamples']} resamples: p is how often chance alone gives a "
            "difference as large)"
        )
    print(f"hypotheses: {result['hypotheses']}")


def cmd_score(args: argparse.Namespace) -> int:
    """`mtx score`: each pair's log-probability of its reference under the run's model, and the perplexity."""
    _check_eval_set_options(args)
    cfg, settings = _settings(args)
    data = _read_eval_set(args, cfg, as_scored=False)  # the references as training reads its targets
    run = _load(args)
    from mtx.search import forced_log_probs, length_penalty, within_positions

    src_ids = within_positions(run.encode_sources(data.src, settings.one_space, settings.fold), run.model)
    limit = run.model.cfg.max_positions - 1
    tgt_ids = run.tgt_tok.encode_batch(data.ref, limit)
    long = [i for i, t in enumerate(tgt_ids, 1) if len(t) > limit]
    if long:
        raise DataError(
            f"{data.ref_file}: {len(long)} reference(s) longer than the model's {limit} positions "
            f"(model.max_positions - 1), line(s) {', '.join(map(str, long[:10]))}; score shorter lines"
        )
    outside = run.pieces_outside_output(tgt_ids)
    if outside:  # (model.restrict_output)
        log.warning(
            "%d reference piece(s) are outside the run's output vocabulary (model.restrict_output): scored as "
            "<unk>, as training's val loss scores them",
            outside,
        )
    with _progress_bar(f"scoring {data.name}", len(src_ids)) as bar:
        log_probs = forced_log_probs(run.model, src_ids, tgt_ids, settings.batch_tokens, progress=bar.update)
    lengths = [len(t) + 1 for t in tgt_ids]  # EOS included
    scores = [lp / length_penalty(n, settings.alpha) for lp, n in zip(log_probs, lengths, strict=True)]
    pieces, total = sum(lengths), sum(log_probs)
    result: dict[str, Any] = {
        "split": data.name,
        "direction": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}",
        "length_penalty": settings.alpha,
        **_how_read(args, cfg, run, data, settings),
        "pieces": pieces,  # EOS included
        "log_prob": total,
        "log_prob_per_piece": total / pieces,
        "perplexity": math.exp(-total / pieces),
    }
    with named_os_errors("standard output"):
        if args.json:
            print(json.dumps({**result, "scores": scores, "log_probs": log_probs, "lengths": lengths}))
        else:
            sys.stdout.write("".join(score_text(x) + "\n" for x in scores))
            sys.stdout.flush()
    if not args.json:
        log.info(
            "%s %s: %d pairs, %d target pieces (EOS included), log-probability %.4f a piece, perplexity %.2f (%s, %s)",
            data.name,
            result["direction"],
            len(scores),
            pieces,
            result["log_prob_per_piece"],
            result["perplexity"],
            result["precision"],
            ", ".join(result["checkpoints"]),
        )
    return 0


def _progress_bar(desc: str, total: int | None, show: bool = True) -> tqdm:
    """A tqdm bar of sentences on stderr, where stderr is a terminal (a log file gets none) and
    `show`; it leaves no line behind. A terminal of no width gets it 80 columns wide (stop 66)."""
    from tqdm import tqdm

    size = {"ncols": 80, "nrows": 24} if zero_width_terminal(sys.stderr) else {}  # (0 rows: tqdm shows nothing)
    return tqdm(total=total, desc=desc, unit=" sent", leave=False, disable=None if show else True, **size)


def _interval(mean: float | None, ci: float | None) -> str:
    """` ± CI (95% interval, bootstrap mean M)` after a score, where bootstrap resampling gave one."""
    return "" if ci is None else f" ± {ci:.2f} (95% interval, bootstrap mean {mean:.2f})"
