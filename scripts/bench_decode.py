"""Decoding speed on test_2016_flickr: greedy and beam 5, with and without the KV cache.

All settings decode the same sentences in the same batches, timed alternately per turn of
`--turn-batches` batches for each default decoding thread, in an order reversed every other turn
(A B C D, D C B A, A B C D, ...) so that machine noise and the order hit them alike; `mtx eval`
hands all its batches to the threads at once, which a turn of one batch per thread (stop 30 and
before) did not show: a thread that ends its batch first waits for the other. "greedy" and
"beam 5" are what `mtx eval` runs: on CPU with 2+ threads, 2 threads decoding their own batches
side by side with half the intra-op threads each (`decode.workers`, auto); the ", 1 worker" rows
decode one batch at a time with all the threads, as mtx did before.
When the run's model restricts its softmax to the target pieces of train
(`model.restrict_output`), the same weights with the softmax computed over the whole vocabulary
are timed beside it (cached greedy and beam 5; the other pieces at -inf, so the outputs stay the
same), which measures what the restriction buys in decoding.
On a CPU with native bf16 (AVX-512 BF16, AMX), the same weights cast to bf16 (`--precision bf16`)
are timed beside them too (cached greedy and beam 5). "beam 5, stop finished" is beam 5 with
fairseq's stop (`decode.stop: finished`: once 5 hypotheses have finished) instead of the exact one.
Without `--run`, a run is trained first (tiny config unless `--config` is given; `--set`
overrides apply to it). `--rounds N` makes N such passes over the split and reports seconds per
pass (one pass of a 2-core machine shared with others moved the beam/greedy ratio by 0.5 between
two runs); the JSON lists the ratio of each pass. The last line is JSON for scripts.

    python scripts/bench_decode.py [--run runs/NAME] [--config FILE] [--set KEY=VALUE ...]
        [--threads 2] [--batch-sentences 64] [--turn-batches 4] [--sentences 1000] [--no-length-cap]
        [--rounds 1] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx import default_onednn_cache  # noqa: E402
from mtx.checkpoint import LoadedRun, load_run  # noqa: E402
from mtx.cli import add_set_option, int_in, path_arg, script_parser, thread_count  # noqa: E402
from mtx.cli import main as mtx_main  # noqa: E402
from mtx.config import AT_MOST, load_config  # noqa: E402
from mtx.data import pad_ids, split_file  # noqa: E402
from mtx.errors import MtxError, run_script  # noqa: E402
from mtx.export import outside_bias  # noqa: E402
from mtx.model import Seq2Seq  # noqa: E402
from mtx.search import (  # noqa: E402
    beam_search,
    decode_workers,
    greedy_search,
    in_workers,
    max_output_lengths,
    within_positions,
)
from mtx.text import read_parallel  # noqa: E402
from mtx.threads import usable_cpus  # noqa: E402
from mtx.tokenizer import EOS  # noqa: E402

# name -> (beam, cache, workers); 0 workers: the default (decode.workers auto)
SETTINGS = {
    "greedy": (1, True, 0),
    "greedy, 1 worker": (1, True, 1),
    "greedy, no cache": (1, False, 1),
    "beam 5": (5, True, 0),
    "beam 5, 1 worker": (5, True, 1),
    "beam 5, no cache": (5, False, 1),
}
BF16 = {"greedy, bf16": 1, "beam 5, bf16": 5}  # cached, default workers; CPUs with native bf16 only
WHOLE_VOCAB = {"greedy, whole vocab": 1, "beam 5, whole vocab": 5}  # cached, default workers; restricted runs only


def against_greedy(seconds_ratio: float) -> str:
    """A setting's seconds over greedy's in words: "N x slower than greedy", or faster below 1
    (stop 64: "0.96x slower than greedy" for a stop that beat greedy on a barely trained model)."""
    if seconds_ratio >= 1:
        return f"{seconds_ratio:.2f}x slower than greedy"
    return f"{1 / seconds_ratio:.2f}x faster than greedy"


def split_batches(
    run: LoadedRun, split: str, sentences: int, batch_sentences: int
) -> tuple[int, list[list[list[int]]]]:
    """How many sentences of `split` (the first `sentences`, or all when 0), and their source ids
    sorted by length and cut into batches of `batch_sentences`."""
    cfg = run.cfg
    src, _ = read_parallel(
        split_file(Path(cfg.data.dir), split, cfg.data.src_lang),
        split_file(Path(cfg.data.dir), split, cfg.data.tgt_lang),
    )
    if sentences:
        src = src[:sentences]
    # as `mtx eval` reads them (stop 55: a traceback)
    ids = within_positions(run.encode_sources(src), run.model)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    return len(ids), [[ids[i] for i in order[j : j + batch_sentences]] for j in range(0, len(order), batch_sentences)]


def decode_tokens(
    model: Seq2Seq,
    batch: torch.Tensor,
    beam: int,
    a: float,
    b: int,
    alpha: float,
    cache: bool = True,
    stop: str = "exact",
) -> list[list[int]]:
    """Output ids of a padded (B, S) batch: greedy for beam 1, else the best of a beam search."""
    if beam == 1:
        return [h.tokens for h in greedy_search(model, batch, a, b, use_cache=cache)]
    return [h[0].tokens for h in beam_search(model, batch, beam, alpha, a, b, use_cache=cache, stop=stop)]


def decode_all(
    model: Seq2Seq,
    batches: list[torch.Tensor],
    beam: int,
    a: float,
    b: int,
    alpha: float,
    cache: bool = True,
    workers: int = 0,
    stop: str = "exact",
) -> list[list[int]]:
    """`decode_tokens` over padded batches, on `workers` decoding threads as `mtx eval` runs them
    (0: its default; `in_workers`); the output ids of every sentence, in batch order."""
    decode = functools.partial(decode_tokens, model, beam=beam, a=a, b=b, alpha=alpha, cache=cache, stop=stop)
    return [hyp for hyps in in_workers(decode, batches, workers, torch.device("cpu"), model) for hyp in hyps]


def add_side_by_side_options(parser: argparse.ArgumentParser) -> None:
    """The options the side-by-side benchmarks (bench_ctranslate2.py, bench_onmt.py) share."""
    parser.add_argument("--split", default="test_2016_flickr", help="the split decoded (default: %(default)s)")
    parser.add_argument(
        "--threads",
        type=thread_count(),
        default=min(2, usable_cpus()),
        help="CPU threads of each engine (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-sentences", type=int_in(1), default=64, help="sentences per batch (default: %(default)s)"
    )
    parser.add_argument(
        "--beam",
        type=int_in(1, AT_MOST["decode.beam"], "as mtx takes"),  # (stop 61: 100,000 ran out of memory after minutes)
        default=5,
        help="the beam row's width (default: %(default)s)",
    )
    parser.add_argument("--sentences", type=int_in(0), default=0, help="first N sentences only (0: all)")
    parser.add_argument("--rounds", type=int_in(1), default=2, help="timed passes over the split per setting")


# one timed pass over every batch: (beam, layout) -> (seconds, output ids in batch order)
Pass = Callable[[int, int], tuple[float, list[list[int]]]]


def passes_in_turns(
    settings: dict[str, tuple[Pass, int, int]], rounds: int
) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """For the side-by-side benchmarks: each setting's pass once to warm up, then `rounds` turns
    of one whole pass per setting (an engine's idle threads keep spinning for a while after it
    returns, so per-batch turns would time the interference); the seconds summed per setting,
    and its outputs."""
    for fn, beam, layout in settings.values():
        fn(beam, layout)
    seconds = dict.fromkeys(settings, 0.0)
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for name, (fn, beam, layout) in settings.items():
            took, outputs[name] = fn(beam, layout)
            seconds[name] += took
    return seconds, outputs


def print_rows(
    settings: Iterable[str], seconds: dict[str, float], outputs: dict[str, list[list[int]]], rounds: int
) -> dict[str, int]:
    """The table of sentences/s, output tokens/s (pieces + EOS), mean length and seconds of
    `rounds` passes per setting; the output tokens per setting."""
    decoded = rounds * len(next(iter(outputs.values())))  # sentences decoded per setting
    tokens = {name: rounds * sum(len(h) + 1 for h in outs) for name, outs in outputs.items()}
    print(f"{'setting':32s} {'sent/s':>8s} {'out tok/s':>10s} {'mean len':>9s} {'seconds':>8s}")
    for name in settings:
        print(f"{name:32s} {decoded / seconds[name]:8.1f} {tokens[name] / seconds[name]:10.0f} ", end="")
        print(f"{tokens[name] / decoded:9.2f} {seconds[name]:8.2f}")
    return tokens


def side_by_side_report(
    run: LoadedRun,
    args: argparse.Namespace,
    engine: tuple[str, str],
    settings: Iterable[str],
    seconds: dict[str, float],
    outputs: dict[str, list[list[int]]],
) -> tuple[dict[str, int], dict[str, float]]:
    """A side-by-side benchmark's header, table and share of outputs alike: `engine` is the other
    engine's setting prefix and its name with version (("ctranslate2", "CTranslate2 4.6.0")). The
    output tokens per setting, and the share of same outputs per search ("greedy", "beam K")."""
    m, n = run.cfg.model, len(outputs["mtx greedy"])
    print(f"{args.run}: {m.d_model}d {m.n_encoder_layers}+{m.n_decoder_layers} layers, ", end="")
    print(f"{run.tgt_tok.vocab_size} BPE; {args.split} ({n} sentences, {args.rounds} passes), ", end="")
    print(f"{args.threads} threads, batches of {args.batch_sentences}; {engine[1]} float32")
    tokens = print_rows(settings, seconds, outputs, args.rounds)
    kinds = ("greedy", f"beam {args.beam}")
    pairs = {kind: zip(outputs[f"mtx {kind}"], outputs[f"{engine[0]} {kind}"], strict=True) for kind in kinds}
    same = {kind: sum(x == y for x, y in pairs[kind]) / n for kind in kinds}
    name = engine[1].split()[0]
    print(f"same output as {name}: greedy {100 * same[kinds[0]]:.1f}%, {kinds[1]} {100 * same[kinds[1]]:.1f}%")
    return tokens, same


class MtxSide:
    """mtx's half of a side-by-side benchmark (bench_ctranslate2.py, bench_onmt.py): the split's
    source ids in batches (`batches`, `n` sentences), padded with EOS for mtx (`padded`), each
    sentence's and each batch's most output pieces (`caps` in batch order, `limits`: mtx's cap
    counts EOS, the other engines' do not), its settings and its timed passes."""

    def __init__(self, run: LoadedRun, args: argparse.Namespace) -> None:
        cfg = run.cfg
        self.run = run
        self.n, self.batches = split_batches(run, args.split, args.sentences, args.batch_sentences)
        self.a, self.b, self.alpha = cfg.decode.max_len_a, cfg.decode.max_len_b, cfg.decode.length_penalty
        self.padded = [pad_ids(x, suffix=EOS) for x in self.batches]
        caps = [max_output_lengths(x, self.a, self.b, run.model) - 1 for x in self.padded]
        self.limits = [int(c.max()) for c in caps]
        self.caps = [c for x in caps for c in x.tolist()]

    def decode(self, beam: int, workers: int) -> tuple[float, list[list[int]]]:
        """One timed pass over every batch on `workers` decoding threads (0: mtx's default)."""
        start = time.perf_counter()
        out = decode_all(self.run.model, self.padded, beam, self.a, self.b, self.alpha, workers=workers)
        return time.perf_counter() - start, out

    def settings(self, kind: str, beam: int) -> dict[str, tuple[Pass, int, int]]:
        """mtx's rows of one search: its default thread layout and 1 worker on all threads."""
        return {f"mtx {kind}": (self.decode, beam, 0), f"mtx {kind}, 1 worker": (self.decode, beam, 1)}

    @staticmethod
    def rates(kind: str, key: str, tokens: dict[str, int], seconds: dict[str, float]) -> dict[str, float]:
        """The JSON keys of mtx's output tokens/s in one search, in both layouts (each its own tokens)."""
        one = f"mtx {kind}, 1 worker"
        return {
            f"mtx_{key}_tok_per_s": round(tokens[f"mtx {kind}"] / seconds[f"mtx {kind}"], 1),
            f"mtx_{key}_tok_per_s_1_worker": round(tokens[one] / seconds[one], 1),
        }

    @staticmethod
    def against(
        kind: str, key: str, tokens: dict[str, int], seconds: dict[str, float], layouts: list[str], short: str
    ) -> tuple[str, dict[str, float]]:
        """The other engine's faster row of one search (of `layouts`, those timed), and the JSON
        keys of the search: mtx's rates, that row's output tokens/s (`SHORT_KEY_tok_per_s`) and
        mtx's sentences/s over it."""
        theirs = min((name for name in layouts if name in seconds), key=seconds.__getitem__)
        return theirs, MtxSide.rates(kind, key, tokens, seconds) | {
            f"{short}_{key}_tok_per_s": round(tokens[theirs] / seconds[theirs], 1),
            # the same sentences in each pass: a ratio of sentences/s (of time), not of output
            # tokens/s, since the two engines' outputs differ in length (stop 55: quoted beside tok/s)
            f"{key}_sent_per_s_ratio_mtx_over_{short}": round(seconds[theirs] / seconds[f"mtx {kind}"], 3),
        }

    @staticmethod
    def conclude(summary: dict[str, object], agree: float | None) -> None:
        """The JSON line; then an error where fewer than 90% of the greedy outputs mtx ended agree
        (`agreement`): the two engines do not run the same model."""
        print(json.dumps(summary))
        if agree is not None and agree < 0.9:
            raise MtxError("greedy outputs disagree on over 10% of sentences; the conversion is wrong")

    def agreement(
        self, outputs: dict[str, list[list[int]]], engine: tuple[str, str], same: dict[str, float], beam: str
    ) -> tuple[dict[str, float | None], float | None]:
        """Prints how many greedy outputs mtx ended before its length cap and the share of those
        the other engine (`engine` as `side_by_side_report` takes it) gives alike; the agreement
        keys of the JSON line, and that share (None: none ended). Another engine caps a batch
        where mtx caps each sentence: only the greedy outputs mtx ended must agree (all of them,
        but for near ties)."""
        ours, theirs = outputs["mtx greedy"], outputs[f"{engine[0]} greedy"]
        ended = [i for i, (hyp, cap) in enumerate(zip(ours, self.caps, strict=True)) if len(hyp) < cap]
        agree = sum(ours[i] == theirs[i] for i in ended) / len(ended) if ended else None
        shown = f"{agree:.1%}" if agree is not None else "nothing to compare"  # (an untrained model ends none)
        name = engine[1].split()[0]
        print(f"greedy outputs that mtx ended before its length cap: {len(ended)}, the same in {name}: {shown}")
        keys = {"greedy_agreement": round(same["greedy"], 4), "beam_agreement": round(same[beam], 4)}
        return keys | {"greedy_agreement_ended": round(agree, 4) if agree is not None else None}, agree


class WholeVocabulary(Seq2Seq):
    """A restricted run's model, the same weights, its logits over every target piece with the
    pieces outside its softmax at -inf: the restricted model's outputs at the cost of a
    whole-vocabulary softmax (its untrained rows would otherwise win)."""

    def __init__(self, run: LoadedRun) -> None:
        cfg = run.cfg
        super().__init__(cfg.model, run.src_tok.vocab_size, run.tgt_tok.vocab_size, joint_vocab=cfg.tokenizer.joint)
        self.load_state_dict({k: v for k, v in run.model.state_dict().items() if k != "output_ids"})
        self.register_buffer("outside", outside_bias(run.model, float("-inf")), persistent=False)
        self.eval()

    def project(self, states: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return super().project(states, self.outside if bias is None else bias + self.outside)


def main() -> None:
    parser = script_parser("bench_decode", (__doc__ or "").split("\n\n")[0])
    parser.add_argument("--run", type=path_arg, help="trained run directory (default: train one)")
    parser.add_argument(
        "--config", help="config to train when --run is not given (default: this checkout's configs/tiny.yaml)"
    )
    add_set_option(parser, "a config key of the run trained when --run is not given (repeatable)")
    parser.add_argument("--split", default="test_2016_flickr", help="the split decoded (default: %(default)s)")
    parser.add_argument(
        "--threads", type=thread_count(), default=min(2, usable_cpus()), help="CPU threads (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-sentences", type=int_in(1), default=64, help="sentences per batch (default: %(default)s)"
    )
    parser.add_argument("--sentences", type=int_in(0), default=0, help="first N sentences only (0: all)")
    parser.add_argument("--no-length-cap", action="store_true", help="a looser length cap: 1.5*src + decode.max_len_b")
    parser.add_argument(
        "--turn-batches",
        type=int_in(1),
        default=4,
        help="batches per default decoding thread in each setting's turn (1: the layout before stop 31)",
    )
    parser.add_argument(
        "--rounds",
        type=int_in(1),
        default=1,
        help="passes over the split, each alternating the settings (seconds per pass)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the weights' type of every row, as `mtx eval --precision` (bf16: CPUs with native bf16 only); "
        "fp32 adds two bf16 rows beside it where the CPU has native bf16",
    )
    args = parser.parse_args()
    default_onednn_cache()  # oneDNN's kernel cache as mtx's commands set it
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if args.precision == "bf16" and not native_bf16:
        parser.error("--precision bf16 needs a CPU with native bf16 (AVX-512 BF16 or AMX); this one emulates it")

    if args.run is not None and args.overrides:
        parser.error("--set changes the config of the run trained when --run is not given; a trained run is as it is")
    if args.run is not None and args.config is not None:  # (stop 53: ignored)
        parser.error("--config is the config trained when --run is not given; a trained run has its own")
    args.config = args.config or str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")

    torch.set_num_threads(args.threads)
    run_dir = args.run
    if run_dir is None:
        # the config and --set checked first: a mistake is one line, not mtx train's line and ours (stop 55)
        load_config(args.config, args.overrides)
        # one run per config and overrides: another --set, or another config of the same file name
        # (stop 55: it was timed as the first), trains its own run instead of timing this one
        recipe = Path(args.config).read_bytes() + "\n".join(args.overrides).encode()
        run_dir = Path("runs") / f"bench_decode_{Path(args.config).stem}_{hashlib.sha1(recipe).hexdigest()[:8]}"
        # a run stopped before its end (Ctrl-C) is resumed to it, not timed half-trained (stop 53);
        # a finished one's resume trains nothing
        if (run_dir / "checkpoints" / "last.pt").is_file():
            train_args = ["train", "--run-dir", str(run_dir), "--resume"]
        else:
            train_args = ["train", "--config", args.config, "--run-dir", str(run_dir)]
            for override in args.overrides:
                train_args += ["--set", override]
        trained = mtx_main(train_args)
        if trained == 130:
            raise KeyboardInterrupt  # run_script's one line, exit code 130
        if trained != 0:  # mtx train said why, in one line
            raise SystemExit(trained)
    run = load_run(run_dir)
    cfg = run.cfg
    n, id_batches = split_batches(run, args.split, args.sentences, args.batch_sentences)
    batches = [pad_ids(batch, suffix=EOS) for batch in id_batches]
    a = 1.5 if args.no_length_cap else cfg.decode.max_len_a
    b = cfg.decode.max_len_b
    alpha = cfg.decode.length_penalty

    # `--precision bf16`: every row, the uncached ones too, decodes with the weights cast to bf16,
    # as `mtx eval --precision bf16` runs, and no fp32 model shares the process (what else runs in
    # the process moved a setting's rate by up to 1.35x in stop 29: docs/speed.md)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = run.model.to(dtype)
    # name -> (model, beam, cache, workers, stop)
    settings = {name: (model, *setting, "exact") for name, setting in SETTINGS.items()}
    # fairseq's stop beside the exact one (`decode.stop: finished`, once 5 hypotheses have finished)
    settings["beam 5, stop finished"] = (model, 5, True, 0, "finished")
    mixed_bf16 = native_bf16 and args.precision == "fp32"
    if mixed_bf16:  # two bf16 rows beside the fp32 ones (emulated, so not timed, elsewhere)
        half = copy.deepcopy(run.model).to(torch.bfloat16)
        settings |= {name: (half, beam, True, 0, "exact") for name, beam in BF16.items()}
        decode_tokens(half, batches[0], 5, a, b, alpha)  # warm up
    if run.model.output_ids is not None:
        whole = WholeVocabulary(run).to(dtype)
        settings |= {name: (whole, beam, True, 0, "exact") for name, beam in WHOLE_VOCAB.items()}
        decode_tokens(whole, batches[0], 5, a, b, alpha)  # warm up
    decode_tokens(model, batches[0], 5, a, b, alpha)  # warm up
    threads = decode_workers(0, torch.device("cpu"))  # the default's decoding threads
    group = args.turn_batches * threads  # batches per turn
    rounds: list[dict[str, float]] = []  # seconds of each setting, per pass over the split
    out_tokens = dict.fromkeys(settings, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in settings}
    names = list(settings)
    turns = 0
    for r in range(args.rounds):
        rounds.append(dict.fromkeys(settings, 0.0))
        for first in range(0, len(batches), group):
            turn = batches[first : first + group]
            # the order reversed every other turn (A B C D, D C B A, ...): in a fixed order the
            # setting that follows another ran up to 1.06x faster than the same code before it (stop 32)
            for name in names if turns % 2 == 0 else names[::-1]:
                model, beam, cache, workers, stop = settings[name]
                start = time.perf_counter()
                hyps = decode_all(model, turn, beam, a, b, alpha, cache, workers, stop)
                rounds[-1][name] += time.perf_counter() - start
                if r == 0:  # decoding is deterministic: the first pass's outputs stand for all
                    out_tokens[name] += sum(len(h) + 1 for h in hyps)  # + EOS
                    outputs[name] += hyps
            turns += 1
    seconds = {name: sum(t[name] for t in rounds) / len(rounds) for name in settings}  # per pass

    print(f"{run_dir}: {cfg.model.d_model}d {cfg.model.n_encoder_layers}+{cfg.model.n_decoder_layers} layers, ", end="")
    print(f"{run.tgt_tok.vocab_size} BPE; {args.split} ({n} sentences), {args.threads} threads ", end="")
    print(f"({threads} decoding threads by default, turns of {group} batches), ", end="")
    print(f"{args.precision} weights, batches of {args.batch_sentences} sentences, max length {a}*src+{b}; ", end="")
    print(f"seconds per pass, {args.rounds} pass(es)")
    print(f"{'setting':20s} {'sent/s':>8s} {'out tok/s':>10s} {'mean len':>9s} {'seconds':>8s}")
    for name in settings:
        print(
            f"{name:20s} {n / seconds[name]:8.1f} {out_tokens[name] / seconds[name]:10.0f} "
            f"{out_tokens[name] / n:9.2f} {seconds[name]:8.2f}"
        )
    same = {
        "greedy": outputs["greedy"] == outputs["greedy, no cache"] == outputs["greedy, 1 worker"],
        "beam5": outputs["beam 5"] == outputs["beam 5, no cache"] == outputs["beam 5, 1 worker"],
    }
    print(f"cached == uncached == 1-worker outputs: greedy {same['greedy']}, beam 5 {same['beam5']}", end="")
    # with bf16 weights the cached steps attend in float32 (`Attention.forward`), uncached ones in bf16
    print(" (bf16: cached steps attend in float32, uncached ones in bf16)" if args.precision == "bf16" else "")
    finished_same = sum(x == y for x, y in zip(outputs["beam 5"], outputs["beam 5, stop finished"], strict=True))
    finished_ratio = seconds["beam 5, stop finished"] / seconds["greedy"]
    print(
        f"beam 5, stop finished (decode.stop): {seconds['beam 5'] / seconds['beam 5, stop finished']:.3f}x the exact "
        f"stop's speed, {against_greedy(finished_ratio)}, outputs identical for {finished_same} of {n}"
    )

    def tok_per_s(name: str) -> float:
        """A row's output tokens/s, from its own outputs and seconds (stop 70: the 1-worker keys took
        the default layout's tokens over the 1-worker seconds, a rate no pass measured)."""
        return round(out_tokens[name] / seconds[name], 1)

    bf16: dict[str, float] = {}
    if mixed_bf16:
        for key, fp32, half_name in (("greedy", "greedy", "greedy, bf16"), ("beam5", "beam 5", "beam 5, bf16")):
            bf16[f"{key}_tok_per_s"] = tok_per_s(half_name)
            bf16[f"{key}_speedup"] = round(seconds[fp32] / seconds[half_name], 3)
            agree = sum(x == y for x, y in zip(outputs[fp32], outputs[half_name], strict=True))
            bf16[f"{key}_identical"] = round(agree / n, 4)
            print(f"bf16 weights, {key}: {bf16[f'{key}_speedup']:.3f}x fp32, outputs identical for {agree} of {n}")
        bf16["beam5_slowdown_vs_greedy"] = round(seconds["beam 5, bf16"] / seconds["greedy, bf16"], 3)
    restricted: dict[str, float] = {}
    identical: dict[str, float] = {}
    if run.model.output_ids is not None:
        print(f"restricted softmax: {len(run.model.output_ids)} of {run.tgt_tok.vocab_size} target pieces")
        for key, mine, whole_name in (
            ("greedy", "greedy", "greedy, whole vocab"),
            ("beam5", "beam 5", "beam 5, whole vocab"),
        ):
            restricted[key] = round(seconds[whole_name] / seconds[mine], 3)
            agree = sum(x == y for x, y in zip(outputs[mine], outputs[whole_name], strict=True))
            identical[key] = round(agree / n, 4)
            print(f"  {key}: {restricted[key]:.3f}x the whole vocabulary's speed, outputs identical for {agree} of {n}")
    print(
        json.dumps(
            {
                "greedy_sent_per_s": round(n / seconds["greedy"], 2),
                "beam5_sent_per_s": round(n / seconds["beam 5"], 2),
                "greedy_tok_per_s": tok_per_s("greedy"),
                "beam5_tok_per_s": tok_per_s("beam 5"),
                "greedy_tok_per_s_1_worker": tok_per_s("greedy, 1 worker"),
                "beam5_tok_per_s_1_worker": tok_per_s("beam 5, 1 worker"),
                # the cache on its own: both sides decode one batch at a time
                "beam5_cache_speedup": round(seconds["beam 5, no cache"] / seconds["beam 5, 1 worker"], 3),
                "greedy_cache_speedup": round(seconds["greedy, no cache"] / seconds["greedy, 1 worker"], 3),
                "beam5_slowdown_vs_greedy": round(seconds["beam 5"] / seconds["greedy"], 3),
                "beam5_slowdown_vs_greedy_per_round": [round(t["beam 5"] / t["greedy"], 3) for t in rounds],
                "cached_equals_uncached": same,
                "beam5_stop_finished": {
                    "tok_per_s": tok_per_s("beam 5, stop finished"),
                    "slowdown_vs_greedy": round(finished_ratio, 3),
                    "identical": round(finished_same / n, 4),
                },
                "precision": args.precision,
                "bf16": bf16 or None,  # the two bf16 rows of an fp32 run, where the CPU has native bf16
                "restricted_output_speedup": restricted or None,
                "restricted_output_identical": identical or None,
            }
        )
    )


if __name__ == "__main__":
    run_script("bench_decode", main)
