"""`mtx` command line: parse arguments, load config or run, call the library.

User mistakes end as one line `mtx: error: ...` on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple, NoReturn

from mtx import ONEDNN_CACHE, __version__, default_onednn_cache
from mtx.config import (
    AT_MOST,
    MAX_LENGTH_PENALTY,
    PRECISIONS,
    QUANTIZATIONS,
    STOPS,
    DecodeConfig,
    config_text,
    expand_user,
    name_problem,
)
from mtx.errors import (
    STOP_SIGNALS,
    ConfigError,
    DataError,
    MtxError,
    Terminated,
    command_line,
    memory_advice,
    named_os_errors,
    not_found,
    os_error_line,
    stderr_or_null,
    take_signals,
)
from mtx.outputs import (
    a_file_or_its_twin,
    binary_stdin,
    check_file_path,
    check_output,
    check_parents,
    data_files,
    is_stdout,
    not_a_runs_file,
    release_stdout,
    resolved_path,
    same_file,
    stdin_is_stdout,
    training_data,
    utf8_stdout,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from tqdm import tqdm

    from mtx.checkpoint import LoadedRun
    from mtx.config import Config
    from mtx.evaluate import PairedResult, Scores

log = logging.getLogger("mtx")

STDIN_BUFFER_LINES = 10_000  # `mtx translate`: most lines of standard input translated and written at a time


CGROUP = Path("/sys/fs/cgroup")  # where a container sees its own cgroup (v2; v1's cpu controller under cpu/)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the OS tells it, and at most a cgroup
    CPU quota rounded up (`docker --cpus 2`, a Kubernetes CPU limit), which torch's own thread count
    does not read: on a machine of many cores it ran as many threads in a 2-CPU container."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cpus if quota is None else max(1, min(cpus, quota))


def cgroup_cpu_quota(root: Path | None = None) -> int | None:
    """The CPUs of this cgroup's quota, rounded up: cgroup v2's cpu.max ("150000 100000": 2), else
    v1's cpu.cfs_quota_us over cpu.cfs_period_us; None where there is none ("max", -1) or it
    cannot be read (not Linux)."""
    root = CGROUP if root is None else root
    try:
        quota, period = (root / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota, period = ((root / "cpu" / f"cpu.cfs_{name}_us").read_text() for name in ("quota", "period"))
        except OSError:
            return None
    try:
        share = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # "max": no quota
        return None
    return math.ceil(share) if share > 0 else None


def set_threads(threads: int) -> None:
    """torch's CPU threads: `threads`, or where 0 torch's own choice, at most the CPUs mtx may use
    (torch counts the machine's cores, not a container's quota)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    elif torch.get_num_threads() > (cpus := usable_cpus()):
        torch.set_num_threads(cpus)


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


class _DecodeSettings(NamedTuple):
    """translate's and eval's search settings: the options given, else the run's decode section."""

    beam: int
    alpha: float  # the GNMT length penalty
    batch_tokens: int
    workers: int
    stop: str
    one_space: bool  # each source line read by `mtx.data.one_spaced`
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
    from mtx.data import checked_line, stream_lines

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
    from mtx.data import eval_split_files, read_parallel, warn_of_invisible_ends, warn_unless_nfc

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
    from mtx.data import read_lines, warn_of_invisible_ends
    from mtx.evaluate import (
        MAX_RESAMPLING_BYTES,
        MIN_BOOTSTRAP,
        PAIRED_SAMPLES,
        most_resampled_sentences,
        most_resamples,
        resampling_bytes,
        resampling_seed_problem,
    )

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


def zero_width_terminal(stream: Any) -> bool:
    """Whether `stream` is a terminal that reports 0 columns (a pseudo-terminal never sized:
    `script`'s, some containers'), where tqdm draws a bar 0 characters wide, nothing at all."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns == 0
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), closed
        return False


def _progress_bar(desc: str, total: int | None, show: bool = True) -> tqdm:
    """A tqdm bar of sentences on stderr, where stderr is a terminal (a log file gets none) and
    `show`; it leaves no line behind. A terminal of no width gets it 80 columns wide (stop 66)."""
    from tqdm import tqdm

    size = {"ncols": 80, "nrows": 24} if zero_width_terminal(sys.stderr) else {}  # (0 rows: tqdm shows nothing)
    return tqdm(total=total, desc=desc, unit=" sent", leave=False, disable=None if show else True, **size)


def _interval(mean: float | None, ci: float | None) -> str:
    """` ± CI (95% interval, bootstrap mean M)` after a score, where bootstrap resampling gave one."""
    return "" if ci is None else f" ± {ci:.2f} (95% interval, bootstrap mean {mean:.2f})"


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
