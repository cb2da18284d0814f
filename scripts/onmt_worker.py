"""OpenNMT-py's side of scripts/bench_onmt.py: runs under OpenNMT-py's own Python (a separate
virtual environment with OpenNMT-py 3.5 and its torch), never imports mtx.

    python onmt_worker.py WEIGHTS THREADS

WEIGHTS is the file bench_onmt.py wrote: OpenNMT-py's parameter names and tensors, the two
vocabularies and the model options that differ from OpenNMT-py's defaults. This worker makes an
OpenNMT-py checkpoint of it (every training option at OpenNMT-py's default but those), saves it
beside WEIGHTS and loads it as `onmt_translate -model` does (`build_translator`). Then it answers
JSON lines on standard input with JSON lines on standard output (its own prints go to standard
error): first {"ready": VERSION} or {"error": MESSAGE}; {"batches": [{"src": [[ids]], "limit": N}]}
sets the batches (source ids with mtx's EOS; `limit`, the most output tokens of that batch);
{"beam": K, "alpha": A, "sampling": false} decodes every batch once, timed (`sampling` true,
with beam 1: OpenNMT-py's GreedySearch), and answers {"seconds": S, "outputs":
[[ids]]} (each best hypothesis without its EOS, in batch order); {} ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

# the real standard output carries the answers only; whatever OpenNMT-py prints goes to stderr
ANSWERS = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)


def answer(message: dict[str, Any]) -> None:
    ANSWERS.write(json.dumps(message) + "\n")
    ANSWERS.flush()


def checkpoint(weights: Path) -> Path:
    """Write OpenNMT-py's checkpoint of `weights` beside it and return its path."""
    import torch
    from onmt import opts
    from onmt.utils.parse import ArgumentParser

    saved = torch.load(weights, map_location="cpu", weights_only=True)
    parser = ArgumentParser()
    opts.train_opts(parser)
    options = parser.parse_known_args(["-data", "{}", "-src_vocab", "unused"])[0]  # every default
    options.__dict__.update(saved["options"])
    vocab = {"src": saved["src_vocab"], "tgt": saved["tgt_vocab"], "data_task": "seq2seq"}
    vocab["decoder_start_token"] = "<s>"
    path = weights.with_name("onmt_model.pt")
    state = {"model": saved["model"], "generator": saved["generator"], "vocab": vocab, "opt": options}
    torch.save(state, path)
    return path


def translator(model: Path) -> Any:
    """OpenNMT-py's Translator of `model`, built from `onmt_translate`'s own options."""
    import torch
    from onmt import opts
    from onmt.translate.translator import build_translator
    from onmt.utils.parse import ArgumentParser

    torch.serialization.add_safe_globals([argparse.Namespace])  # the options saved in the checkpoint
    parser = ArgumentParser()
    opts.translate_opts(parser)
    args = ["-model", str(model), "-src", "unused", "-max_length_ratio", "0", "-length_penalty", "wu"]
    options = parser.parse_args(args)
    ArgumentParser.validate_translate_opts(options)
    return build_translator(options, report_score=False, out_file=open(os.devnull, "w"))


def tensors(batches: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """The batches as `translate_batch` takes them (source ids right-padded with OpenNMT-py's
    padding id 0, and their lengths), each with its output cap."""
    import torch

    out = []
    for b in batches:
        src = torch.zeros(len(b["src"]), max(len(s) for s in b["src"]), 1, dtype=torch.long)
        for i, s in enumerate(b["src"]):
            src[i, : len(s), 0] = torch.tensor(s)
        out.append(({"src": src, "srclen": torch.tensor([len(s) for s in b["src"]])}, b["limit"]))
    return out


def decode(
    tr: Any, batches: list[tuple[dict[str, Any], int]], beam: int, alpha: float, sampling: bool = False
) -> tuple[float, list[list[int]]]:
    """Every batch through `translate_batch` with beam `beam`, timed. Beam 1 is OpenNMT-py's
    default path for `-beam_size 1`, a beam search of one; with `sampling`, its GreedySearch
    (`-random_sampling_topk 1`: the argmax at each step)."""
    from onmt.translate import GNMTGlobalScorer

    tr.beam_size = beam
    tr.sample_from_topk = 1 if sampling else 0
    tr.global_scorer = GNMTGlobalScorer(alpha if beam > 1 else 0.0, 0.0, "wu" if beam > 1 else "none", "none")
    eos = tr._tgt_eos_idx
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for batch, limit in batches:
        tr.max_length = limit
        results = tr.translate_batch(batch, attn_debug=False)
        for hyps in results["predictions"]:
            ids = hyps[0].tolist()
            outputs.append(ids[:-1] if ids and ids[-1] == eos else ids)
    return time.perf_counter() - start, outputs


def main() -> None:
    weights, threads = Path(sys.argv[1]), int(sys.argv[2])
    warnings.simplefilter("ignore")  # OpenNMT-py's deprecation and no-op penalty warnings
    try:
        for name in ("spacy", "fasttext"):  # imported by OpenNMT-py's transforms, unused here
            sys.modules.setdefault(name, types.ModuleType(name))
        import onmt
        import torch
    except ImportError as e:
        answer({"error": f"{sys.executable} cannot import OpenNMT-py ({e}); install OpenNMT-py==3.5.1 there"})
        return
    version = str(getattr(onmt, "__version__", "of no version"))
    if not version.startswith("3.5."):  # the names, options and checkpoint format written are 3.5's
        answer({"error": f"{sys.executable} has OpenNMT-py {version}; this benchmark needs 3.5 (OpenNMT-py==3.5.1)"})
        return
    torch.set_num_threads(threads)
    tr = translator(checkpoint(weights))
    answer({"ready": onmt.__version__, "torch": torch.__version__})
    batches: list[tuple[dict[str, Any], int]] = []
    with torch.inference_mode():
        for line in sys.stdin:
            request = json.loads(line)
            if not request:
                return
            if "batches" in request:
                batches = tensors(request["batches"])  # once, not in every timed pass
                answer({"batches": len(batches)})
            else:
                seconds, outputs = decode(
                    tr, batches, request["beam"], request["alpha"], request.get("sampling", False)
                )
                answer({"seconds": seconds, "outputs": outputs})


if __name__ == "__main__":
    main()
