"""Choose a run's final checkpoint and length penalty on val, never on a test split.

Scores on the run's validation split (data.valid_split, the one training validated on), with
the run's beam size: the best single checkpoint (last.pt where the run stopped before its first
validation), then the average of the last N step checkpoints for each N in `--last`, and the
moving average of the weights (checkpoints/ema.pt, when trained with train.ema), and the
ensemble of the last N step checkpoints for each N in `--ensemble` (decoded together, `mtx eval
--checkpoint A --checkpoint B ...`), all with the config's length penalty; then, on the best of
those, each length penalty in `--length-penalty`, then, with the best penalty, each beam size in
`--beam` (default: the config's only). BLEU is computed as `mtx eval` computes it. The choice is
then tested against where it started, the best single checkpoint at the config's penalty and
beam: sacreBLEU's paired bootstrap test (1,000 resamples of val) says whether its gain could be
chance. A gain found by picking the best of many settings on val is an optimistic estimate of
that setting's gain on new data, however small its p-value; the test sets tell. With `--apply`
the chosen average becomes the run's best.pt (the single best is kept as best_single.pt; not
while the run trains); a chosen ensemble leaves best.pt alone and the script prints the `mtx
eval` command that decodes it. The last line is JSON for scripts.

    python scripts/choose_on_val.py --run runs/NAME [--last 3,4,5,7,10] [--ensemble 2,4]
        [--length-penalty 0.6,1.0,1.4] [--beam 5,8,12] [--threads 2] [--device auto] [--apply]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.checkpoint import (  # noqa: E402
    BEST_SINGLE,
    LoadedRun,
    average_checkpoints,
    best_single,
    check_best_changeable,
    checkpoint_dir,
    load_checkpoint,
    load_run,
    make_best,
    member_check,
    restore_best_single,
    step_checkpoints,
)
from mtx.cli import path_arg, script_parser, thread_count  # noqa: E402
from mtx.config import AT_MOST, MAX_LENGTH_PENALTY  # noqa: E402
from mtx.data import is_test_split, split_file, warn_if_validating_on_train  # noqa: E402
from mtx.device import pick_device  # noqa: E402
from mtx.errors import MtxError, command_line, environment_mtx, run_script  # noqa: E402
from mtx.evaluate import PAIRED_SAMPLES, corpus_scores, paired_tests, resampling_seed_problem  # noqa: E402
from mtx.model import Ensemble, Seq2Seq  # noqa: E402
from mtx.search import translate  # noqa: E402
from mtx.text import read_parallel, warn_of_invisible_ends, warn_unless_nfc  # noqa: E402
from mtx.threads import usable_cpus  # noqa: E402


def penalties(text: str) -> list[float]:
    """'0.6,1.0' -> [0.6, 1.0], finite and >= 0; an argparse type, so a bad list is a one-line usage error."""
    bad = argparse.ArgumentTypeError(f"expected comma-separated numbers from 0 to {MAX_LENGTH_PENALTY:g}, got {text!r}")
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise bad from None
    if not all(math.isfinite(v) and 0 <= v <= MAX_LENGTH_PENALTY for v in values):
        raise bad
    return values


def counts(text: str) -> list[int]:
    """'5,8' -> [5, 8]: beam sizes or checkpoint counts; an argparse type like `penalties`."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1, got {text!r}")
    return [int(x) for x in parts]


def beams(text: str) -> list[int]:
    """'5,8' -> [5, 8], each at most mtx's largest beam (stop 61: 100,000 ran out of memory after
    every candidate had been scored, and a beam above it gave an `mtx eval` command mtx refuses)."""
    values = counts(text)
    if any(v > AT_MOST["decode.beam"] for v in values):
        raise argparse.ArgumentTypeError(f"beam sizes must be at most {AT_MOST['decode.beam']:,}, got {text!r}")
    return values


def val_bleu(
    model: Seq2Seq | Ensemble, run: LoadedRun, src_ids: list[list[int]], refs: list[str], alpha: float, beam: int = 0
) -> tuple[float, list[str]]:
    """Val BLEU of `model` (of `run`) at length penalty `alpha` and `beam` (0: the config's), and
    its translations. In the run's `decode.precision`, as `mtx eval` decodes it (stop 55: always in
    fp32, so a bf16 run's chosen val BLEU was not the one its printed eval command gives)."""
    dc = run.cfg.decode
    beam = beam or dc.beam
    model.to(torch.bfloat16 if dc.precision == "bf16" else torch.float32)  # scores stay float32 (search.py)
    text = translate(
        model,
        run.tgt_tok,
        src_ids,
        beam,
        alpha,
        dc.max_len_a,
        dc.max_len_b,
        dc.batch_tokens,
        workers=dc.workers,
        stop=dc.stop,
    )
    return corpus_scores(text, refs).bleu, text


def main() -> None:
    parser = script_parser("choose_on_val", (__doc__ or "").split("\n")[0])
    parser.add_argument("--run", type=path_arg, required=True, help="run directory written by mtx train")
    parser.add_argument(
        "--last",
        type=counts,
        default="3,4,5,7,10",
        help="averages of the newest N step checkpoints to try, comma-separated (default: 3,4,5,7,10)",
    )
    parser.add_argument(
        "--length-penalty",
        type=penalties,
        default="0.6,0.8,1.0,1.2,1.4,1.6,2.0",
        help="length penalties to try on the best checkpoint, comma-separated (default: 0.6,0.8,1.0,1.2,1.4,1.6,2.0)",
    )
    parser.add_argument(
        "--beam", type=beams, default="", help="beam sizes to try, comma-separated (default: the config's)"
    )
    parser.add_argument(
        "--ensemble",
        type=counts,
        default="2,4",
        help="ensembles of the newest N step checkpoints to try, comma-separated (default: 2,4)",
    )
    parser.add_argument(
        "--threads",
        type=thread_count(),
        default=min(2, usable_cpus()),
        help=f"CPU threads, at most the CPUs here (default: {min(2, usable_cpus())})",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--apply", action="store_true", help="make the chosen average the run's best.pt")
    args = parser.parse_args()
    # the sizes asked for, whose absence is noted (the defaults suit a longer run than most)
    args.asked = {
        d: getattr(args, d) for d in ("last", "ensemble") if getattr(args, d) != counts(parser.get_default(d))
    }
    if any(n < 2 for n in args.ensemble):
        parser.error(f"argument --ensemble: an ensemble has at least 2 checkpoints, got {args.ensemble}")
    torch.set_num_threads(args.threads)
    choose(args)


def choose(args: argparse.Namespace) -> None:
    if problem := resampling_seed_problem():  # its paired test (stop 68's probe: p changed between runs)
        raise MtxError(problem)
    ckpts = checkpoint_dir(args.run)
    if args.apply and args.run.is_dir():  # refused now rather than after minutes of decoding (load_run
        check_best_changeable(args.run)  # says where the run directory is none)
    single = best_single(args.run)
    # a run stopped before its first validation has no best.pt: start from last.pt, as eval does
    start_name = "best single" if single.is_file() else "last checkpoint"
    if not single.is_file():
        single = ckpts / "last.pt"
    device = pick_device(args.device, "--device")
    run = load_run(args.run, [single], device)
    cfg = run.cfg
    data_dir = Path(cfg.data.dir)
    split = cfg.data.valid_split  # the split training validated on (`val` on Multi30k)
    if is_test_split(split):  # (stop 53: it scored, and chose, on it)
        raise MtxError(
            f"{args.run}: data.valid_split is {split}, a test split; choose_on_val chooses on validation data "
            "only (a run that validates on val: data.valid_split: val)"
        )
    if not data_dir.is_dir():  # (stop 57: "no val.de or val.de.gz")
        raise MtxError(f"{args.run}: its data.dir {data_dir} is not a directory here; set it in the run's config.yaml")
    warn_if_validating_on_train(cfg.data)  # (stop 64: it chose on train, as "val BLEU", without a word)
    ref_file = split_file(data_dir, split, cfg.data.tgt_lang)
    # the references as sacreBLEU reads them, with mtx eval's warnings (stop 64: stripped of invisible
    # ends, a val BLEU of 3.76 where the printed mtx eval command gave 2.10)
    src, refs = read_parallel(split_file(data_dir, split, cfg.data.src_lang), ref_file, as_scored=True)
    warn_unless_nfc(refs, str(ref_file))
    warn_of_invisible_ends(refs, str(ref_file))
    src_ids = run.encode_sources(src)  # as mtx eval reads them
    alpha = cfg.decode.length_penalty
    # how many sentences: training's val BLEU scores train.eval_sentences of them, greedy (stop 65: unsaid)
    print(
        f"{args.run}: {split} ({len(src)} sentences), beam {cfg.decode.beam}, length penalty {alpha:g}, "
        f"{cfg.decode.precision}"
    )

    texts: dict[tuple[str, float, int], list[str]] = {}  # (candidate, penalty, beam) -> val translations

    def score(name: str, model: Seq2Seq | Ensemble, a: float = alpha, beam: int = 0) -> float:
        bleu, texts[name, a, beam or cfg.decode.beam] = val_bleu(model, run, src_ids, refs, a, beam)
        return bleu

    def with_weights(payload: dict) -> Seq2Seq:
        model = copy.deepcopy(run.model)
        model.load_state_dict(payload["model"])
        return model

    steps = step_checkpoints(args.run)
    single_ckpt = load_checkpoint(single)
    # candidate name -> (model, what it is saved as: the checkpoint payload --apply writes, or an
    # ensemble's member files, val BLEU)
    candidates: dict[str, tuple[Seq2Seq | Ensemble, dict | list[Path], float]] = {}

    def add(name: str, model: Seq2Seq | Ensemble, saved: dict | list[Path], detail: str = "") -> None:
        candidates[name] = (model, saved, score(name, model))
        print(f"{name}{detail}: {candidates[name][2]:.2f}")

    add(start_name, run.model, single_ckpt, f" ({single.name}, step {single_ckpt.get('step')})")
    for n in sorted(set(args.last)):
        if 1 <= n <= len(steps):
            payload = average_checkpoints(steps[-n:], member_check(cfg, run.src_tok, run.tgt_tok))
            add(f"average of the last {n}", with_weights(payload), payload)
    if (ckpts / "ema.pt").is_file():  # the moving average of the weights (train.ema)
        payload = load_checkpoint(ckpts / "ema.pt")
        add("moving average", with_weights(payload), payload, f" (ema.pt, decay {payload.get('ema_decay')})")
    for n in sorted(set(args.ensemble)):
        if 2 <= n <= len(steps):
            add(f"ensemble of the last {n}", load_run(args.run, steps[-n:], device).model, steps[-n:])
    for option, sizes in getattr(args, "asked", {}).items():
        beyond = sorted(n for n in set(sizes) if n > len(steps))  # (stop 57: left out without a word)
        if beyond:
            print(
                f"note: --{option} {', '.join(map(str, beyond))}: more than the run's {len(steps)} step checkpoints; "
                "left out",
                file=sys.stderr,
            )
    name = max(candidates, key=lambda k: candidates[k][2])
    model, chosen, bleu = candidates[name]
    penalties = {alpha: bleu}
    if args.length_penalty or args.beam:  # (stop 57: the lines stood under the last candidate, not this one)
        print(f"{name}, the best candidate, at other settings:")
    for a in args.length_penalty:
        if a not in penalties:
            penalties[a] = score(name, model, a)
        print(f"  length penalty {a:g}: {penalties[a]:.2f}")
    best_alpha = max(penalties, key=lambda a: penalties[a])
    beams = {cfg.decode.beam: penalties[best_alpha]}
    for b in args.beam:
        if b not in beams:
            beams[b] = score(name, model, best_alpha, b)
        print(f"  beam {b} (length penalty {best_alpha:g}): {beams[b]:.2f}")
    best_beam = max(beams, key=lambda b: beams[b])
    print(f"chosen: {name}, length penalty {best_alpha:g}, beam {best_beam}: val BLEU {beams[best_beam]:.2f}")
    result: dict[str, object] = {
        "chosen": name,
        "length_penalty": best_alpha,
        "beam": best_beam,
        "val_bleu": round(beams[best_beam], 2),
    }
    start, final = texts[start_name, alpha, cfg.decode.beam], texts[name, best_alpha, best_beam]
    (test,) = paired_tests(final, [("the start", start)], refs, PAIRED_SAMPLES)
    print(
        f"against the start ({start_name}, length penalty {alpha:g}, beam {cfg.decode.beam}): "
        f"{test.bleu:.2f} -> {beams[best_beam]:.2f} ({test.bleu_delta:+.2f}), paired bootstrap p = {test.bleu_p:.4f}"
        + (" (identical translations)" if final == start else "")
    )
    result["start_val_bleu"], result["gain_p_value"] = round(test.bleu, 2), round(test.bleu_p, 4)
    if isinstance(chosen, list):  # an ensemble is decoded from its checkpoints: best.pt stays as it is
        result["checkpoints"] = [str(p) for p in chosen]
        flags = [word for p in chosen for word in ("--checkpoint", p)]
        decode = ("--length-penalty", f"{best_alpha:g}", "--beam", best_beam)
        print(f"decode it with: {command_line(*environment_mtx(), 'eval', '--run', args.run, *flags, *decode)}")
        if args.apply:
            print(
                "--apply: an ensemble is several checkpoints, not one best.pt; "
                f"{checkpoint_dir(args.run) / 'best.pt'} is unchanged"
            )
    else:
        if "averaged_from" in chosen:  # the files, which the run's next steps make other "last N" (stop 65: unsaid)
            result["averaged_from"] = [str(ckpts / name) for name in chosen["averaged_from"]]
        if args.apply and chosen is not single_ckpt:
            print(f"{make_best(args.run, chosen)} is now the {name}")
        elif args.apply and single.name == BEST_SINGLE:  # an earlier average was best.pt
            print(f"{single} is now {restore_best_single(args.run)} again")
        elif args.apply:  # (stop 65: nothing was said)
            print(f"--apply: the {start_name} ({single}) was chosen; nothing to change")
        elif chosen is not single_ckpt or single.name == BEST_SINGLE:  # (stop 69's probe: left unsaid)
            print(
                f"not applied: run again with --apply to make the {name} the run's best.pt, then decode with "
                f"--length-penalty {best_alpha:g} --beam {best_beam}"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    run_script("choose_on_val", main)
