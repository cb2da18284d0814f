"""mtx beside CTranslate2: decoding speed of one trained model on the same machine.

Converts a trained mtx run to a CTranslate2 model (float32, the same weights), then decodes
test_2016_flickr with both in the same batches, greedy and beam 5, on the same number of threads.
Settings take turns by whole passes over the split (`--rounds` of them), not by batch: each
engine's idle worker threads keep spinning for a while after it returns and would slow the other
engine's next batch, so per-batch turns measure the interference more than either engine.
CTranslate2 runs in a child process and times itself there: a Translator in the same process as
torch made torch about 2.5x slower even while the Translator was idle.
Each engine runs in both of its thread layouts: all threads on one batch at a time (intra-op
only; mtx's ", 1 worker", CTranslate2's `intra_threads=threads`), and batches side by side on
2 workers with half the threads each (mtx's default on CPU, `decode.workers`; CTranslate2's
`inter_threads=2`, batches submitted asynchronously). The ratios in the JSON line set mtx's
default beside CTranslate2's faster layout.
Prints sentences/s, output tokens/s, mean output length and how often the two give the same
output (greedy must agree almost always where mtx ended a sentence before its length cap, which
CTranslate2 applies per batch, or the conversion is wrong); the last line is JSON.
Needs CTranslate2 (`pip install ctranslate2`, the optional extra `mtx[export]` that the Makefile installs).

    python scripts/bench_ctranslate2.py --run runs/NAME [--threads 2] [--batch-sentences 64]
        [--beam 5] [--sentences N] [--split test_2016_flickr] [--rounds 2]

The two engines differ in what they do besides speed: CTranslate2 normalises beam scores by
length ** alpha where mtx uses the GNMT penalty, and stops a sentence once its best beam has
ended, where mtx stops only when no running beam can still win; mean output lengths are printed
so that tokens/s can be read with that in mind.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import MtxSide, add_side_by_side_options, passes_in_turns, side_by_side_report  # noqa: E402

from mtx.checkpoint import LoadedRun, load_run  # noqa: E402
from mtx.cli import path_arg, script_parser  # noqa: E402
from mtx.errors import MtxError, run_script  # noqa: E402
from mtx.export import OUTSIDE_BIAS, ctranslate2_vocabulary, export_ctranslate2  # noqa: E402
from mtx.search import decode_workers  # noqa: E402


def convert(run: LoadedRun, out_dir: Path) -> None:
    """Write `run`'s model as a CTranslate2 Transformer (float32) to `out_dir`, as `mtx export` does."""
    if run.model.output_ids is not None:
        print(
            f"note: mtx's softmax covers {len(run.model.output_ids)} of {run.model.output_table.shape[0]} target "
            f"pieces (model.restrict_output); CTranslate2 gets all of them, the others at a bias of {OUTSIDE_BIAS:g}"
        )
    export_ctranslate2(run, out_dir)


def _ct2_worker(conn: Any, model_dir: str, threads: int, batches: list[Any], alpha: float) -> None:
    """Child process: for each (beam size, workers) asked, decode every batch with CTranslate2
    (`inter_threads=workers`, the threads split between them), timing it. One Translator at a
    time, so that no idle thread pool competes with the timed one."""
    import ctranslate2

    translator, layout = None, 0
    while (request := conn.recv()) is not None:
        beam, workers = request
        if workers != layout:
            translator = None  # the previous Translator and its threads go before the next starts
            layout = workers
            translator = ctranslate2.Translator(
                model_dir,
                device="cpu",
                compute_type="float32",
                intra_threads=max(1, threads // workers),
                inter_threads=workers,
            )
        start = time.perf_counter()
        jobs = [
            translator.translate_batch(
                tokens,
                beam_size=beam,
                length_penalty=alpha if beam > 1 else 0.0,
                max_decoding_length=limit,
                max_batch_size=0,
                asynchronous=workers > 1,  # a job per batch, taken by whichever worker is free
            )
            for tokens, limit in batches
        ]
        out = [(r.result() if workers > 1 else r).hypotheses[0] for results in jobs for r in results]
        conn.send((time.perf_counter() - start, out))


def main() -> None:
    parser = script_parser("bench_ctranslate2", (__doc__ or "").split("\n\n")[0])
    parser.add_argument("--run", type=path_arg, required=True, help="trained mtx run directory")
    add_side_by_side_options(parser)
    args = parser.parse_args()
    try:
        import ctranslate2
    except ImportError:
        raise MtxError("needs CTranslate2; run: pip install ctranslate2") from None

    torch.set_num_threads(args.threads)
    # mtx's default layout, at least 2 workers, but never more threads than --threads (stop 53: with
    # --threads 1, CTranslate2's 2 workers of 1 thread ran against mtx's 1 thread)
    side_by_side = min(args.threads, max(2, decode_workers(0, torch.device("cpu"))))
    run = load_run(args.run)
    cfg = run.cfg
    if cfg.model.norm != "layer" or cfg.model.fix_norm:
        raise MtxError(
            "the run's model uses model.norm=scale or model.fix_norm, which this side-by-side "
            "benchmark does not cover (mtx export converts them); benchmark a run with LayerNorm and fix_norm false"
        )
    mtx = MtxSide(run, args)
    src_vocab, tgt_vocab = ctranslate2_vocabulary(run.src_tok), ctranslate2_vocabulary(run.tgt_tok)
    tgt_index = {t: i for i, t in enumerate(tgt_vocab)}
    ct2_batches = [
        ([[src_vocab[i] for i in s] for s in x], limit) for x, limit in zip(mtx.batches, mtx.limits, strict=True)
    ]

    with tempfile.TemporaryDirectory() as tmp:
        convert(run, Path(tmp) / "ct2")
        # CTranslate2 runs in its own process: a Translator in this one slows torch's threads
        # about 2.5x even while it is idle (measured), which would time the clash, not mtx
        parent, child = mp.get_context("spawn").Pipe()
        worker = mp.get_context("spawn").Process(
            target=_ct2_worker, args=(child, str(Path(tmp) / "ct2"), args.threads, ct2_batches, mtx.alpha), daemon=True
        )
        worker.start()

        def ct2_pass(beam: int, workers: int) -> tuple[float, list[list[int]]]:
            parent.send((beam, workers))
            seconds, tokens = parent.recv()  # timed inside the worker
            return seconds, [[tgt_index[t] for t in hyp] for hyp in tokens]

        beam_name = f"beam {args.beam}"
        settings = {}
        for kind, beam in (("greedy", 1), (beam_name, args.beam)):
            settings |= mtx.settings(kind, beam) | {f"ctranslate2 {kind}": (ct2_pass, beam, 1)}
            if side_by_side > 1:
                settings[f"ctranslate2 {kind}, {side_by_side} workers"] = (ct2_pass, beam, side_by_side)
        seconds, outputs = passes_in_turns(settings, args.rounds)
        parent.send(None)
        worker.join()

    engine = ("ctranslate2", f"CTranslate2 {ctranslate2.__version__}")
    tokens, same = side_by_side_report(run, args, engine, settings, seconds, outputs)
    summary: dict[str, float | None] = {}
    for kind, key in (("greedy", "greedy"), (beam_name, "beam")):
        layouts = [f"ctranslate2 {kind}", f"ctranslate2 {kind}, {side_by_side} workers"]
        ct2, keys = mtx.against(kind, key, tokens, seconds, layouts, "ct2")  # its faster layout
        summary |= keys | {f"ct2_{key}_workers": 1 if ct2 == f"ctranslate2 {kind}" else side_by_side}
    keys, agree = mtx.agreement(outputs, engine, same, beam_name)
    mtx.conclude(summary | keys, agree)


if __name__ == "__main__":
    run_script("bench_ctranslate2", main)
