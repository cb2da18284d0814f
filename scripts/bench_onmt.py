"""mtx beside OpenNMT-py: decoding speed of one trained model on the same machine.

Converts a trained mtx run to an OpenNMT-py 3.5 checkpoint (the same float32 weights under
OpenNMT-py's names: its pre-norm Transformer, interleaved sinusoidal positions, embeddings scaled
by sqrt(d_model), LayerNorm eps 1e-5, biases on every projection), then decodes test_2016_flickr
with both in the same batches, greedy and beam 5, on the same number of threads. OpenNMT-py runs
in a child process under its own Python (`--onmt-python`: OpenNMT-py pins torch<2.3 and needs
packages mtx does not), scripts/onmt_worker.py, which loads the checkpoint as `onmt_translate
-model` does and times itself there. Settings take turns by whole passes over the split
(`--rounds` of them), as in bench_ctranslate2.py: an engine's idle threads keep spinning for a
while after it returns. mtx runs in both of its thread layouts (its default of 2 decoding
workers, and 1 worker on all threads); OpenNMT-py decodes one batch at a time on all threads.

Prints sentences/s, output tokens/s (output pieces + EOS, as bench_decode.py counts), mean
output length and how often the two give the same output (greedy must agree almost always where
mtx ended a sentence before its length cap, or the conversion is wrong); the last line is JSON.

The two engines search alike but not the same (onmt/translate/beam_search.py, 3.5.1): OpenNMT-py's
GNMT penalty counts the start token in the length (`length_penalty(step + 1)` with `step =
len(alive_seq)`, BOS included), so its beam 5 ranks lengths a little differently; it stops a
sentence once its best beam has ended (`finish_flag = self.is_finished_list[i][0]`) where mtx
stops only when no running beam can still win; its greedy is timed both ways a user can run it:
`-beam_size 1` (its default path, a beam search of width 1) and GreedySearch (`-random_sampling_topk
1`, the argmax at each step), and the JSON takes the faster; it caps the batch's output length
(`max_length`, set here to the longest of mtx's per-sentence caps in the batch) where mtx caps each
sentence.

Set up OpenNMT-py (its own virtual environment; `--no-deps` keeps its torch<2.3 pin from
pulling another torch, and leaves out its training and serving dependencies):

    python3 -m venv onmt-venv
    onmt-venv/bin/pip install torch==2.13.0
    onmt-venv/bin/pip install --no-deps OpenNMT-py==3.5.1
    onmt-venv/bin/pip install 'pyonmttok>=1.37,<2' numpy configargparse pyahocorasick rapidfuzz regex

    python scripts/bench_onmt.py --run runs/NAME --onmt-python onmt-venv/bin/python [--threads 2]
        [--batch-sentences 64] [--beam 5] [--sentences N] [--split test_2016_flickr] [--rounds 2]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import MtxSide, add_side_by_side_options, passes_in_turns, side_by_side_report  # noqa: E402

from mtx.checkpoint import load_run  # noqa: E402
from mtx.cli import path_arg, script_parser  # noqa: E402
from mtx.errors import MtxError, run_script  # noqa: E402
from mtx.export import ctranslate2_vocabulary, outside_bias  # noqa: E402
from mtx.model import Seq2Seq, sinusoidal_positions  # noqa: E402
from mtx.tokenizer import EOS  # noqa: E402

WORKER = Path(__file__).resolve().with_name("onmt_worker.py")
ONMT_POSITIONS = 5000  # rows of OpenNMT-py's position table (PositionalEncoding's max_len)


def onmt_options(model: Seq2Seq) -> dict[str, Any]:
    """The OpenNMT-py model options of `model` that differ from OpenNMT-py's defaults."""
    cfg = model.cfg
    if cfg.norm != "layer" or cfg.fix_norm or not cfg.pre_norm:
        raise MtxError(
            "OpenNMT-py's Transformer is pre-norm with LayerNorm: benchmark a run with model.pre_norm true, "
            "model.norm layer and model.fix_norm false"
        )
    return {
        "encoder_type": "transformer",
        "decoder_type": "transformer",
        "enc_layers": cfg.n_encoder_layers,
        "dec_layers": cfg.n_decoder_layers,
        "hidden_size": cfg.d_model,
        "enc_hid_size": cfg.d_model,
        "dec_hid_size": cfg.d_model,
        "word_vec_size": cfg.d_model,
        "src_word_vec_size": cfg.d_model,
        "tgt_word_vec_size": cfg.d_model,
        "heads": cfg.n_heads,
        "transformer_ff": cfg.d_ff,
        "position_encoding": True,
        "position_encoding_type": "SinusoidalInterleaved",  # mtx's table: sin at even, cos at odd
        "share_embeddings": model.tgt_embed is model.src_embed,
        "share_decoder_embeddings": model.output_proj is None,
        "add_qkvbias": True,
        "add_ffnbias": True,
        "layer_norm": "standard",
        "norm_eps": 1e-5,  # torch.nn.LayerNorm's, which mtx uses
        "pos_ffn_activation_fn": "relu",
        "self_attn_type": "scaled-dot",
        "model_task": "seq2seq",
        "dropout": [0.0],
        "attention_dropout": [0.0],
    }


def _linear(state: dict[str, torch.Tensor], name: str, weight: torch.Tensor, bias: torch.Tensor) -> None:
    state[f"{name}.weight"], state[f"{name}.bias"] = weight.detach().float().clone(), bias.detach().float().clone()


def _norm(state: dict[str, torch.Tensor], name: str, norm: torch.nn.Module) -> None:
    assert isinstance(norm, torch.nn.LayerNorm)
    _linear(state, name, norm.weight, norm.bias)


def onmt_state(model: Seq2Seq) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`model`'s weights under OpenNMT-py 3.5's names: the model's state and the generator's."""
    state: dict[str, torch.Tensor] = {}
    d = model.cfg.d_model
    positions = sinusoidal_positions(ONMT_POSITIONS, d)[:, None, :]  # its first rows are mtx's table
    for side, emb in (("encoder", model.src_embed), ("decoder", model.tgt_embed)):
        state[f"{side}.embeddings.make_embedding.emb_luts.0.weight"] = emb.tokens.weight.detach().float().clone()
        state[f"{side}.embeddings.make_embedding.pe.pe"] = positions.clone()

    def split(prefix: str, parts: tuple[str, ...], proj: torch.nn.Linear) -> None:  # mtx's fused projections
        for part, w, b in zip(parts, proj.weight.split(d), proj.bias.split(d), strict=True):
            _linear(state, f"{prefix}.linear_{part}", w, b)

    def self_attention(prefix: str, proj: torch.nn.Linear, out: torch.nn.Linear) -> None:
        split(prefix, ("query", "keys", "values"), proj)
        _linear(state, f"{prefix}.final_linear", out.weight, out.bias)

    def feed_forward(prefix: str, layer: torch.nn.Module) -> None:
        _linear(state, f"{prefix}.w_1", layer.ffn.fc1.weight, layer.ffn.fc1.bias)
        _linear(state, f"{prefix}.w_2", layer.ffn.fc2.weight, layer.ffn.fc2.bias)
        _norm(state, f"{prefix}.layer_norm", layer.sub_ffn.norm)

    for i, layer in enumerate(model.encoder_layers):
        prefix = f"encoder.transformer.{i}"
        self_attention(f"{prefix}.self_attn", layer.self_attn.qkv_proj, layer.self_attn.out_proj)
        _norm(state, f"{prefix}.layer_norm", layer.sub_attn.norm)
        feed_forward(f"{prefix}.feed_forward", layer)
    _norm(state, "encoder.layer_norm", model.encoder_norm)
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"decoder.transformer_layers.{i}"
        self_attention(f"{prefix}.self_attn", layer.self_attn.qkv_proj, layer.self_attn.out_proj)
        _norm(state, f"{prefix}.layer_norm_1", layer.sub_self.norm)
        cross = layer.cross_attn
        _linear(state, f"{prefix}.context_attn.linear_query", cross.q_proj.weight, cross.q_proj.bias)
        split(f"{prefix}.context_attn", ("keys", "values"), cross.kv_proj)
        _linear(state, f"{prefix}.context_attn.final_linear", cross.out_proj.weight, cross.out_proj.bias)
        _norm(state, f"{prefix}.layer_norm_2", layer.sub_cross.norm)
        feed_forward(f"{prefix}.feed_forward", layer)
    _norm(state, "decoder.layer_norm", model.decoder_norm)
    # mtx's output layer has no bias; a restricted softmax's left-out pieces get one that rules them out
    table = model.output_table.detach().float()
    bias = outside_bias(model) if model.output_ids is not None else torch.zeros(table.shape[0])
    generator = {"weight": table.clone(), "bias": bias}
    return state, generator


class OnmtWorker:
    """scripts/onmt_worker.py under `python`, answering one JSON line per request."""

    def __init__(self, python: Path, weights: Path, threads: int, log: IO[str]) -> None:
        self.log, self.python = log, python
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), str(weights), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=os.environ | {"PYTHONNOUSERSITE": "1"},
        )
        ready = self.ask(None)
        if "error" in ready:
            raise MtxError(f"--onmt-python: {ready['error']}")
        self.version = str(ready["ready"])

    def ask(self, request: dict[str, Any] | None) -> dict[str, Any]:
        """Send `request` (None: only read the next answer) and return the answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if request is not None:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            last = (self.log.read().strip().splitlines() or ["(nothing on its standard error)"])[-1]
            raise MtxError(f"the OpenNMT-py worker ended with exit code {self.proc.returncode}: {last}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise MtxError(
                f"--onmt-python {self.python} is not a Python running the worker: it printed {line.strip()[:80]!r}"
            ) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("{}\n")
            self.proc.stdin.close()
            self.proc.wait()


def check_python(path: Path) -> Path:
    """`--onmt-python`: an executable file."""
    if path.is_dir():
        raise MtxError(f"--onmt-python {path}: is a directory (give its bin/python)")
    if not path.is_file():
        raise MtxError(f"--onmt-python {path}: no such file (give the python of a virtual environment with OpenNMT-py)")
    if not os.access(path, os.X_OK):
        raise MtxError(f"--onmt-python {path}: not executable")
    return path


def main() -> None:
    parser = script_parser("bench_onmt", (__doc__ or "").split("\n\n")[0])
    parser.add_argument("--run", type=path_arg, required=True, help="trained mtx run directory")
    parser.add_argument(
        "--onmt-python", type=path_arg, required=True, help="python of a virtual environment with OpenNMT-py 3.5"
    )
    add_side_by_side_options(parser)
    args = parser.parse_args()
    python = check_python(args.onmt_python)

    torch.set_num_threads(args.threads)
    run = load_run(args.run)
    if not isinstance(run.model, Seq2Seq):
        raise MtxError("bench_onmt takes one checkpoint; average several first (mtx average)")
    options = onmt_options(run.model)
    mtx = MtxSide(run, args)
    onmt_batches = [
        {"src": [s + [EOS] for s in x], "limit": limit} for x, limit in zip(mtx.batches, mtx.limits, strict=True)
    ]

    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "worker.log", "w+") as log:
        weights = Path(tmp) / "weights.pt"
        model_state, generator = onmt_state(run.model)
        vocab = {"src_vocab": ctranslate2_vocabulary(run.src_tok), "tgt_vocab": ctranslate2_vocabulary(run.tgt_tok)}
        torch.save({"model": model_state, "generator": generator, "options": options} | vocab, weights)
        worker = OnmtWorker(python, weights, args.threads, log)
        try:
            worker.ask({"batches": onmt_batches})

            def onmt_pass(beam: int, sampling: int) -> tuple[float, list[list[int]]]:
                reply = worker.ask({"beam": beam, "alpha": mtx.alpha, "sampling": bool(sampling)})
                return reply["seconds"], reply["outputs"]  # timed inside the worker

            beam_name = f"beam {args.beam}"
            settings = {}
            for kind, beam in (("greedy", 1), (beam_name, args.beam)):
                settings |= mtx.settings(kind, beam) | {f"opennmt-py {kind}": (onmt_pass, beam, 0)}
                if beam == 1:
                    settings["opennmt-py greedy, GreedySearch"] = (onmt_pass, 1, 1)
            seconds, outputs = passes_in_turns(settings, args.rounds)
        finally:
            worker.close()

    engine = ("opennmt-py", f"OpenNMT-py {worker.version}")
    tokens, same = side_by_side_report(run, args, engine, settings, seconds, outputs)
    summary: dict[str, float | None] = {}
    for kind, key in (("greedy", "greedy"), (beam_name, "beam")):
        layouts = [f"opennmt-py {kind}", f"opennmt-py {kind}, GreedySearch"]
        onmt, keys = mtx.against(kind, key, tokens, seconds, layouts, "onmt")  # its faster path
        summary |= keys | {
            f"onmt_{key}_search": "GreedySearch" if onmt.endswith("GreedySearch") else "BeamSearch",
            f"{key}_sent_per_s_ratio_mtx_1_worker_over_onmt": round(
                seconds[onmt] / seconds[f"mtx {kind}, 1 worker"], 3
            ),
        }
    keys, agree = mtx.agreement(outputs, engine, same, beam_name)
    pairs = zip(outputs["opennmt-py greedy"], outputs["opennmt-py greedy, GreedySearch"], strict=True)
    searches = sum(x == y for x, y in pairs)
    print(f"OpenNMT-py's two greedy searches give the same output for {searches} of {mtx.n}")
    mtx.conclude(summary | keys, agree)


if __name__ == "__main__":
    run_script("bench_onmt", main)
