"""`mtx` command line: parse arguments, load config or run, call the library (the decoding
commands translate, eval and score: cli_decode.py).

User mistakes end as one line `mtx: error: ...` on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from mtx import ONEDNN_CACHE, __version__, default_onednn_cache
from mtx.cli_decode import cmd_eval, cmd_score, cmd_translate
from mtx.config import PRECISIONS, QUANTIZATIONS, STOPS, config_text, expand_user
from mtx.errors import (
    STOP_SIGNALS,
    ConfigError,
    MtxError,
    Terminated,
    memory_advice,
    named_os_errors,
    os_error_line,
    stderr_or_null,
    take_signals,
)
from mtx.outputs import (
    a_file_or_its_twin,
    check_file_path,
    check_parents,
    data_files,
    is_stdout,
    not_a_runs_file,
    release_stdout,
    same_file,
    utf8_stdout,
)
from mtx.threads import usable_cpus

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("mtx")

STDIN_BUFFER_LINES = 10_000  # `mtx translate`: most lines of standard input translated and written at a time


def int_in(low: int, high: int | None = None, note: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high] (no upper bound when high is None);
    `note` says what the bound is, e.g. "the CPUs here"."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}{f' ({note})' if note else ''}, got {value}")
        return value

    return parse


def thread_count() -> Callable[[str], int]:
    """An argparse type for the scripts' --threads: 1 to the CPUs this process may use (more only
    slows them, and a few thousand crash OpenMP)."""
    return int_in(1, usable_cpus(), "the CPUs here")


class _TqdmHandler(logging.StreamHandler):
    """Log lines that do not tear an active tqdm progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        if getattr(record, "file_only", False):  # training's window line, which its progress bar shows
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never raise
            self.handleError(record)


def _setup_logging(verbose: bool) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # torch's too: a signal in the middle of its import left its loggers unset, and at exit its
    # FakeTensor statistics printed three lines after mtx's one (stop 63: in every command)
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.NOTSET if verbose else logging.WARNING)


_NOISY = ("datasets", "fsspec", "filelock", "urllib3", "httpx", "huggingface_hub", "sacrebleu", "torch")


def add_set_option(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`: mtx train's and the benchmarks'."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def _add_decode_options(p: argparse.ArgumentParser, search: bool = True) -> None:
    """The options of the commands that decode with a run; without `search` (`mtx score`), not the
    search's own (--beam, --workers, --no-cache, --stop)."""
    p.add_argument("--run", required=True, type=path_arg, help="run directory written by mtx train")
    p.add_argument(
        "--checkpoint",
        type=path_arg,
        action="append",
        default=[],
        help="checkpoint file (default: the run's best.pt, else last.pt); repeat it to decode with the "
        "ensemble of several checkpoints of the run (mean of their next-token probabilities)",
    )
    if search:
        p.add_argument("--beam", type=int, help="beam size; 1 = greedy (default: the run's decode.beam)")
    p.add_argument("--length-penalty", type=float, help="GNMT length penalty alpha (default: decode.length_penalty)")
    p.add_argument("--batch-tokens", type=int, help="decode batch size in source tokens (default: decode.batch_tokens)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument(
        "--threads", type=int, default=0, help="CPU threads, at most the CPUs here (default: torch's choice)"
    )
    if search:
        p.add_argument(
            "--workers",
            type=int,
            help="threads decoding batches side by side, sharing --threads (default: decode.workers; 0: auto)",
        )
        p.add_argument("--no-cache", action="store_true", help="recompute the decoder over the whole prefix each step")
    p.add_argument(
        "--keep-spaces",
        action="store_true",
        help="read the source's whitespace as written (default: decode.normalize_spaces: runs of whitespace, "
        "no-break spaces and tabs too, read as one space; soft hyphens and zero-width spaces dropped)",
    )
    p.add_argument(
        "--keep-punctuation",
        action="store_true",
        help="read the source's quotes, apostrophes and dashes as written (default: decode.normalize_punctuation: "
        "one the run's training sources (nearly) never have read as the form they have, e.g. a typographic "
        "apostrophe as ')",
    )
    if search:
        p.add_argument(
            "--stop",
            choices=STOPS,
            help="beam search's stop (default: decode.stop): exact, once no running hypothesis can beat the best "
            "finished one; finished, once --beam hypotheses have finished (fairseq's rule: faster, may score lower)",
        )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="decode with the weights in this type (default: decode.precision); bf16 pays on CPUs whose bf16 "
        "products are fast (AMX, Zen 4's AVX-512 BF16; a warning says where they are slow) and on GPUs for "
        "models big enough to be bound by their products (at d_model 256 an H200 decoded slower in bf16)",
    )
    if not search:  # what `_decode_settings` reads of the search's options
        p.set_defaults(beam=1, workers=None, no_cache=False, stop=None)


class _StoreOnce(argparse._StoreAction):
    """argparse's `store`, except that an option given twice is a usage error: argparse keeps the
    last silently, and `eval --run a --run b` scored b alone (stop 61)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        given = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in given:
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice; give it once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option)


def script_parser(name: str, description: str) -> argparse.ArgumentParser:
    """A script's parser, as mtx's own: a usage mistake is one line that begins with `name`, as
    `run_script`'s errors do (stop 69's probe: argparse's usage block above it, and the script
    named two ways), and an option that takes one value may be given once."""
    parser = _Parser(description=description)
    parser.name = name
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that help and version text that cannot be written is an error:
    argparse drops the OSError, so `mtx --help > /dev/full` printed nothing and exited 0 (stop 55);
    and a usage mistake is one line, as mtx's other errors are (stop 57: `--beam x` printed the
    seven-line usage of translate above it). Subcommands' parsers are of the same class
    (`add_subparsers` makes them so). An option that takes one value may be given once (`_StoreOnce`)."""

    name = "mtx"  # what its errors begin with (a script's name: `script_parser`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if message:
            (file or sys.stderr).write(message)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.name}: error: {message} (see {self.prog} --help)\n")  # 2: argparse's code for usage

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """argparse's, except that an unknown option points to its command's help, not mtx's."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            argv = list(sys.argv[1:] if args is None else args)
            command = getattr(namespace, "command", None)
            commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
            before = command in argv and extras[0] in argv and argv.index(extras[0]) < argv.index(command)
            parser = self if before else commands.get(command, self)  # `mtx --bogus train`: mtx's own options
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace


def path_arg(text: str) -> Path:
    """A path option's value, with a leading ~ or ~user expanded as in `data.dir`: the shell
    leaves it after `--run-dir=` or in quotes (stop 61: a directory named `~` was made in the
    working directory, and `--run=~/runs/x` was "not found")."""
    if not text:  # (stop 62: Path("") is ".": --data-dir "" scored the working directory's files)
        raise argparse.ArgumentTypeError("a path must not be empty")
    try:
        return expand_user(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def file_path(text: str) -> Path:
    """An output file's path: one that ends in a separator means a directory (stop 57: `average
    --out avgs/` wrote a file named avgs, `plot --out figs/` figs.png), an argparse error."""
    if text.endswith(("/", os.sep)) and text not in ("/", os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} ends in {text[-1]!r}, a directory; give a file path")
    return path_arg(text)


def build_parser() -> argparse.ArgumentParser:
    """mtx's parser: its own options, and each command's parser with that command's options."""
    parser = _Parser(
        prog="mtx",
        description="Train Transformer translation models on Multi30k, translate, and score with sacreBLEU.",
    )
    parser.add_argument("--version", action="version", version=f"mtx {__version__}")
    verbose = parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, and the traceback behind an error"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(sub)
    _add_translate_parser(sub)
    _add_eval_parser(sub)
    _add_score_parser(sub)
    _add_average_parser(sub)
    _add_export_parser(sub)
    _add_plot_parser(sub)
    _add_compare_parser(sub)
    for p in sub.choices.values():  # after the command too, as peers take it (stop 69's probe: refused there)
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose.help)
    return parser


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx train`: train a model from a YAML config, or resume a run."""
    p = sub.add_parser(
        "train", help="train a model from a YAML config", description="Train a model from a YAML config."
    )
    p.add_argument("--config", type=path_arg, help="YAML config, e.g. configs/multi30k_de_en.yaml")
    p.add_argument("--run-dir", type=path_arg, help="run directory (default: runs/<config name>)")
    add_set_option(p, "override a config key by its dotted name, e.g. --set train.max_steps=200 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from checkpoints/last.pt")


def _add_translate_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx translate`: translate TEXT arguments or standard input with a run."""
    p = sub.add_parser(
        "translate",
        help="translate sentences with a trained run",
        description="Translate each TEXT argument, or each line of standard input (no TEXT, or TEXT '-'). "
        "One output line per input line; empty input lines give empty output lines.",
    )
    _add_decode_options(p)
    p.add_argument(
        "--nbest",
        type=int,
        default=1,
        help="print the K best translations per input as 'i ||| text ||| score' (score: log-probability, EOS "
        "included, over the GNMT length penalty; default 1: plain lines)",
    )
    p.add_argument(
        "--buffer-lines",
        type=int,
        default=STDIN_BUFFER_LINES,
        help="translate standard input in batches of at most this many lines (default: "
        f"{STDIN_BUFFER_LINES}), each written before the next is read; fewer whenever the input pauses, so "
        "that a terminal or a slow pipe gets each line's translation at once",
    )
    p.add_argument("text", nargs="*", help="sentences to translate ('-' or none: read standard input)")


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx eval`: translate a test split (or --src/--ref files) and score it."""
    p = sub.add_parser(
        "eval",
        help="translate a test split and score it with sacreBLEU",
        description="Translate a split of the run's data directory (or --src/--ref files) and print cased, "
        "detokenised sacreBLEU and chrF with their signatures.",
    )
    _add_decode_options(p)
    _add_eval_set_options(p)
    p.add_argument("--lowercase", action="store_true", help="also report lowercased BLEU")
    p.add_argument(
        "--output",
        type=file_path,
        help="where to write hypotheses (default: RUN/eval/SPLIT.beamN.LANG; -: standard output)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=0,
        metavar="N",
        help="also print 95%% confidence intervals of BLEU and chrF from N bootstrap resamples of the sentences "
        "(sacreBLEU's, seeded; 1000 is usual; default 0: none)",
    )
    p.add_argument(
        "--paired",
        type=path_arg,
        action="append",
        default=[],
        metavar="FILE",
        help="another system's translations of the same sentences (e.g. an earlier eval's hypotheses file): "
        "paired bootstrap test of the difference, cased BLEU and chrF (repeatable; --bootstrap N resamples, "
        "default 1000)",
    )
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object")


def _add_eval_set_options(p: argparse.ArgumentParser) -> None:
    """eval's and score's pairs: a split of the data directory, or --src/--ref files."""
    p.add_argument(
        "--split",
        help="split name in the data directory (default: test_2016_flickr); the official Multi30k test sets "
        "test_2017_flickr, test_2017_mscoco and test_2018_flickr are downloaded into $XDG_CACHE_HOME/mtx/multi30k "
        "(default ~/.cache/mtx/multi30k) "
        "if the directory lacks them",
    )
    p.add_argument("--data-dir", type=path_arg, help="data directory (default: the one the run was trained on)")
    p.add_argument("--src", type=path_arg, help="source file (plain or .gz), instead of --split")
    p.add_argument("--ref", type=path_arg, help="reference file (plain or .gz), with --src")


def _add_score_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx score`: the model's log-probability of each reference (forced decoding)."""
    p = sub.add_parser(
        "score",
        help="score given translations with a run (forced decoding) and give their perplexity",
        description="Print, a line per pair of a split (or of --src/--ref files), the log-probability the run's "
        "model gives the reference (its pieces and EOS) over the GNMT length penalty, as translate --nbest scores "
        "its own outputs; then, on standard error, the pieces' mean log-probability and perplexity.",
    )
    _add_decode_options(p, search=False)
    _add_eval_set_options(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the totals, and each pair's score and log-probability",
    )


def _add_average_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx average`: average a run's newest step checkpoints."""
    p = sub.add_parser(
        "average",
        help="average the last step checkpoints of a run",
        description="Average the weights of a run's newest checkpoints/step_N.pt files.",
    )
    p.add_argument("--run", required=True, type=path_arg, help="run directory")
    p.add_argument("--last", type=int, default=5, help="how many of the newest step checkpoints (default: 5)")
    p.add_argument("--out", type=file_path, help="output file (default: RUN/checkpoints/average_lastN.pt)")
    p.add_argument(
        "--as-best",
        action="store_true",
        help="also make it the run's best.pt (training's best is kept as best_single.pt; an average that "
        "best.pt held, as best_average.pt)",
    )


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx export`: write a run's model as a CTranslate2 model."""
    p = sub.add_parser(
        "export",
        help="write a run's model as a CTranslate2 model (needs ctranslate2)",
        description="Write a run's model (best.pt, or --checkpoint) as a CTranslate2 model directory with the "
        "run's tokenizers, for decoding without torch; --quantization int8 makes it smaller and faster on CPUs.",
    )
    p.add_argument("--run", required=True, type=path_arg, help="run directory written by mtx train")
    p.add_argument(
        "--checkpoint",
        type=path_arg,
        action="append",
        default=[],
        help="checkpoint file (default: the run's best.pt, else last.pt); one: average several first",
    )
    p.add_argument("--out", type=path_arg, help="new directory to write (default: RUN/ctranslate2-QUANTIZATION)")
    p.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="float32", help="CTranslate2 weight type (default: float32)"
    )


def _add_plot_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx plot`: an image of one run's learning curves, or several runs'."""
    p = sub.add_parser(
        "plot",
        help="plot learning curves of one run or several",
        description="Write an image (PNG) of losses, val BLEU and learning rate; several --run draw their curves "
        "together.",
    )
    p.add_argument("--run", required=True, type=path_arg, action="append", help="run directory (repeatable)")
    p.add_argument(
        "--out",
        type=file_path,
        help="output image: PNG, or the type its suffix names, e.g. .svg or .pdf; -: standard output, PNG "
        "(default: RUN/curves.png; several runs: compare.png)",
    )
    p.add_argument(
        "--x",
        choices=("step", "time"),
        default="step",
        help="x axis: update steps or minutes of training (default: step)",
    )


def _add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """`mtx compare`: runs' val loss and BLEU side by side."""
    p = sub.add_parser(
        "compare",
        help="compare runs' val loss and BLEU at equal steps and equal training time",
        description="Print, at each validation of the first run, its val loss and greedy val BLEU and each "
        "other run's at the same step and at the same training time.",
    )
    p.add_argument("--run", required=True, type=path_arg, action="append", help="run directory (at least two)")


def cmd_train(args: argparse.Namespace) -> int:
    from mtx.config import load_config, load_run_config

    if args.resume:
        if args.run_dir is None:
            raise MtxError("--resume needs --run-dir DIR (the run to continue)")
        if args.config is not None:
            raise MtxError(
                "--resume continues with the run's own config.yaml; drop --config (use --set to change keys)"
            )
        _restore_config(args.run_dir)
        cfg = load_run_config(args.run_dir, args.overrides)
    else:
        if args.config is None:
            raise MtxError("train needs --config FILE (e.g. configs/multi30k_de_en.yaml), or --run-dir DIR --resume")
        cfg = load_config(args.config, args.overrides)
    # torch is imported only now: a config error is reported in a fraction of a second
    from mtx.device import Ranks
    from mtx.train import fit

    run_dir = args.run_dir or Path("runs") / args.config.stem
    if not args.resume:  # (stop 64: a run made at RUN/checkpoints/step_80.pt stopped RUN's training at step 80)
        check_parents("--run-dir", run_dir)  # (stop 64: "Not a directory" after torch's import)
        not_a_runs_file(run_dir, f"--run-dir {run_dir}", "choose another --run-dir")
    # where the run directory was moved while training, the line names its new place (stop 66)
    state, run_dir = fit(cfg, run_dir, resume=args.resume)
    if not Ranks.from_env().is_main:  # under torchrun only rank 0 reports
        return 0
    print(json.dumps({"run_dir": str(run_dir), "step": state.step, "best_val_bleu": round(state.best_bleu, 2)}))
    return 0


def _restore_config(run_dir: Path) -> None:
    """A resumed run whose config.yaml is gone gets it back from last.pt, which holds the config
    it trained with (stop 62: the run was called "not an mtx run directory")."""
    from mtx.config import CONFIG_FILE

    last = run_dir / "checkpoints" / "last.pt"
    if (run_dir / CONFIG_FILE).exists() or (run_dir / CONFIG_FILE).is_symlink() or not last.is_file():
        return
    from mtx.checkpoint import atomic_write_text, load_checkpoint, run_dir_lock
    from mtx.config import from_dict

    with run_dir_lock(run_dir):  # not while a training sets the run up
        cfg = from_dict(load_checkpoint(last).get("config"), f"{last}'s config")
        atomic_write_text(run_dir / CONFIG_FILE, config_text(cfg))
    log.warning("%s: %s was missing; written again from %s", run_dir, CONFIG_FILE, last)


def cmd_export(args: argparse.Namespace) -> int:
    if len(args.checkpoint) > 1:
        raise MtxError("export takes one --checkpoint; average several first (mtx average) and export the average")
    if args.out is not None:
        if str(args.out) == "-":  # (stop 64: a directory named "-")
            raise MtxError("--out - (standard output) cannot take an exported model, a directory; give a new directory")
        check_parents("--out", args.out)
        if args.out.exists() and not args.out.is_dir():
            raise MtxError(f"--out {args.out} is a file; give a new directory for the exported model")
        # (stop 62: a directory named like a future step_N.pt stopped training at that step)
        not_a_runs_file(args.out, f"--out {args.out}", "give a new directory for the exported model")
    # torch is imported only now: a mistake in an option is reported in a fraction of a second
    from mtx.checkpoint import load_run
    from mtx.export import check_export, export_ctranslate2

    out = args.out or args.run / f"ctranslate2-{args.quantization}"
    check_export(out, args.quantization)  # before the model loads: a used --out fails at once
    run = load_run(args.run, args.checkpoint)
    export_ctranslate2(run, out, args.quantization)
    print(json.dumps({"ctranslate2_model": str(out), "quantization": args.quantization}))
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from mtx.checkpoint import average_run, run_files
    from mtx.config import load_run_config

    if args.out is not None:
        if str(args.out) == "-":  # (stop 61: a file named "-")
            raise MtxError("--out - (standard output) cannot take an average, a checkpoint file; give a file path")
        check_file_path("--out", args.out, "the average's file path")
        if args.out.exists() and not args.out.is_file():  # a device or a pipe: never replaced by a file
            raise MtxError(f"--out {args.out} is not a regular file; give a file path for the average")
        if same_file(args.out, run_files(args.run)):
            raise MtxError(f"--out {args.out} is one of the run's own files; give another path for the average")
        not_a_runs_file(args.out, f"--out {args.out}", "give another path for the average", own_run=args.run)
        # (stop 64: a text file, the run's val.en.gz or the plain twin of its train.en.gz became a checkpoint)
        if a_file_or_its_twin(args.out, data_files([Path(load_run_config(args.run).data.dir)])):
            raise MtxError(f"--out {args.out} is a data file of the run's data directory; give another path")
        if args.out.is_file() and not zipfile.is_zipfile(args.out):
            raise MtxError(f"--out {args.out} exists and is not a checkpoint; give a new path for the average")
    out, chosen = average_run(args.run, args.last, args.out, args.as_best)
    what = "1 checkpoint (a copy of its weights)" if len(chosen) == 1 else f"{len(chosen)} checkpoints"
    print(f"averaged {what} ({', '.join(p.name for p in chosen)}) into {out}")
    if len(chosen) < args.last:
        print(
            f"note: --last {args.last} asked for more step checkpoints than the run has ({len(chosen)}: one a "
            "validation, the newest train.keep_last kept), so all of them were averaged",
            file=sys.stderr,
        )
    if args.as_best:
        print(f"{args.run / 'checkpoints' / 'best.pt'} is now the average")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from mtx.plot import plot_runs

    default = args.run[0] / "curves.png" if len(args.run) == 1 else Path("compare.png")
    to_stdout = str(args.out) == "-"  # (stop 61: it wrote a file named -.png)
    if args.out is not None and not to_stdout:
        check_file_path("--out", args.out, "the image's file path")
    out = args.out or default
    if not to_stdout:
        not_a_runs_file(out, f"--out {out}", "give another path for the image")
        to_stdout = is_stdout(out)  # the image itself goes there: no path after it
    written = plot_runs(args.run, out, args.x)
    if not to_stdout:
        print(written)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from mtx.plot import compare_runs

    table = compare_runs(args.run)
    with named_os_errors("standard output"):
        print("\n".join(table))
    return 0


COMMANDS = {
    "train": cmd_train,
    "translate": cmd_translate,
    "export": cmd_export,
    "eval": cmd_eval,
    "score": cmd_score,
    "average": cmd_average,
    "plot": cmd_plot,
    "compare": cmd_compare,
}


def main(argv: list[str] | None = None) -> int:
    """Run one `mtx` command; returns its exit code (argparse's `--help`, `--version` and usage
    errors raise SystemExit, as a command line's parser does)."""
    with stderr_or_null(), _callers_state_kept():
        return _main(argv)


@contextlib.contextmanager
def _callers_state_kept() -> Iterator[None]:
    """What a command changes for its process, as it was before, for a program that runs `main`
    (stop 68's probe): the root logger's handlers and level and the quieted libraries' levels (its
    log file stopped getting lines, other libraries' were muted for good), standard output's
    object and encoding (switched to UTF-8 for good), torch's thread count (`--threads`), and the
    environment's oneDNN cache size, set for the command where the caller left it unset."""
    onednn = default_onednn_cache()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in _NOISY}
    stdout = sys.stdout
    encoding = (getattr(stdout, "encoding", None), getattr(stdout, "errors", None))
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    try:
        yield
    finally:
        if onednn is None:
            os.environ.pop(ONEDNN_CACHE[0], None)
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)
        if sys.stdout is not stdout:  # `utf8_stdout`'s writer that waits on a non-blocking descriptor
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            sys.stdout = stdout
        if stdout is not None and hasattr(stdout, "reconfigure") and (stdout.encoding, stdout.errors) != encoding:
            with contextlib.suppress(OSError, ValueError, LookupError):
                stdout.reconfigure(encoding=encoding[0], errors=encoding[1])
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = None
    try:
        try:
            with named_os_errors("standard output"):  # help or version text that cannot be written
                args = parser.parse_args(argv)
        except SystemExit as done:  # --help, --version (0); a usage error (2, on standard error)
            if done.code == 0 and sys.stdout is not None:  # the help text in the buffer, written now (stop 55)
                with named_os_errors("standard output"):
                    sys.stdout.flush()
            raise
        _setup_logging(args.verbose)
        if sys.stdout is None:  # (stop 54: translate's traceback after decoding; eval's scores lost)
            raise MtxError("standard output is closed; mtx writes its results there (redirect it to a file)")
        utf8_stdout()
        with _stop_signals():
            code = COMMANDS[args.command](args)
        with named_os_errors("standard output"):  # what print() left in the buffer (eval's scores)
            sys.stdout.flush()
        return code
    except MtxError as e:
        if args is not None and args.verbose:
            log.exception("the traceback, for -v")
        if e.report:
            print(f"mtx: {e.prefix}{e}", file=sys.stderr)
        return e.exit_code
    except Terminated as e:
        if _speaks_for_the_job(args):
            print(f"mtx: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        if _speaks_for_the_job(args):
            print("mtx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 141
    except MemoryError:  # Python's own allocation (stop 67: a traceback under `ulimit -v` while the data loaded)
        print(f"mtx: error: out of memory; {memory_advice('free memory, or use a machine with more')}", file=sys.stderr)
        return 1
    except OSError as e:  # a path that cannot be created, read or written; a full disk
        if args is not None and args.verbose:
            log.exception("the traceback, for -v")
        print(os_error_line("mtx", e), file=sys.stderr)
        return 1
    finally:
        release_stdout()


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM (`kill`, `timeout`, a job scheduler) and SIGHUP (a closed terminal) stop a command
    as Ctrl-C does, so that what it made is cleaned up and it says so in one line (stop 61: eval
    killed by SIGTERM left the directories it had made for its output, and said nothing).
    Training saves a checkpoint on them instead (`StopRequest`, which takes them over)."""

    def stop(signum: int, frame: object) -> None:
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    old = take_signals(stop, STOP_SIGNALS)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _speaks_for_the_job(args: argparse.Namespace | None) -> bool:
    """Whether this process says that a signal stopped it: every rank of a torchrun job gets the
    terminal's Ctrl-C, and rank 0 speaks for them all (stop 67: a signal before training took the
    signals, in a job's first seconds, was reported once per rank)."""
    rank = os.environ.get("RANK", "0").strip()
    return args is None or args.command != "train" or not rank.isdigit() or int(rank) == 0


if __name__ == "__main__":  # `python -m mtx.cli` as `python -m mtx` (stop 68's probe: it did nothing, exit 0)
    raise SystemExit(main())
