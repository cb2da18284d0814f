"""mtx beside CTranslate2: decoding speed of one trained model on the same machine.

Converts a trained mtx run to a CTranslate2 model (float32, the same weights), then decodes
test_2016_flickr with both in the same batches, greedy and beam 5, on the same number of threads.
Settings take turns by whole passes over the split (`--rounds` of them), not by batch: each
engine's idle worker threads keep spinning for a while after it returns and would slow the other
engine's next batch, so per-batch turns measure the interference more than either engine.
CTranslate2 runs in a child process and times itself there: a Translator in the same process as
torch made torch about 2.5x slower even while the Translator was idle.
Prints sentences/s, output tokens/s, mean output length and how often the two give the same
output (greedy must agree almost always, or the conversion is wrong); the last line is JSON.
Needs `pip install ctranslate2` (not a dependency of mtx).

    python scripts/bench_ctranslate2.py --run runs/NAME [--threads 2] [--batch-sentences 64]
        [--beam 5] [--sentences N] [--split test_2016_flickr] [--rounds 2]

The two engines differ in what they do besides speed: CTranslate2 normalises beam scores by
length ** alpha where mtx uses the GNMT penalty, and stops a sentence once its best beam has
ended, where mtx stops only when no running beam can still win; mean output lengths are printed
so that tokens/s can be read with that in mind.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import decode_tokens, outside_bias, split_batches  # noqa: E402

from mtx.checkpoint import LoadedRun, load_run  # noqa: E402
from mtx.data import pad_ids  # noqa: E402
from mtx.search import max_output_lengths  # noqa: E402
from mtx.tokenizer import BPE, EOS  # noqa: E402


def _np(t: torch.Tensor) -> Any:
    return t.detach().float().cpu().numpy()


def _linear(spec: Any, module: torch.nn.Linear) -> None:
    spec.weight = _np(module.weight)
    if module.bias is not None:
        spec.bias = _np(module.bias)


def _norm(spec: Any, module: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(module.weight), _np(module.bias)


def _vocab(tok: BPE) -> list[str]:
    by_id = sorted(tok.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    tokens[0] = "<blank>"  # CTranslate2's name for the padding token (id 0, as in mtx)
    return tokens


def convert(run: LoadedRun, out_dir: Path) -> None:
    """Write `run`'s model as a CTranslate2 Transformer (float32) to `out_dir`."""
    from ctranslate2.specs import transformer_spec

    model, cfg = run.model, run.model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.pre_norm
    )
    for side, emb in ((spec.encoder, model.src_embed), (spec.decoder, model.tgt_embed)):
        (side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings).weight = _np(emb.tokens.weight)
        side.scale_embeddings = True  # by sqrt(d_model), as mtx does
        side.position_encodings.encodings = _np(emb.positions)  # mtx interleaves sin/cos
    if cfg.pre_norm:
        _norm(spec.encoder.layer_norm, model.encoder_norm)
        _norm(spec.decoder.layer_norm, model.decoder_norm)
    layers = [
        (s, layer, layer.sub_attn.norm) for s, layer in zip(spec.encoder.layer, model.encoder_layers, strict=True)
    ]
    layers += [
        (s, layer, layer.sub_self.norm) for s, layer in zip(spec.decoder.layer, model.decoder_layers, strict=True)
    ]
    for s, layer, self_norm in layers:
        _linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
        _linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        _norm(s.self_attention.layer_norm, self_norm)
        _linear(s.ffn.linear_0, layer.ffn.fc1)
        _linear(s.ffn.linear_1, layer.ffn.fc2)
        _norm(s.ffn.layer_norm, layer.sub_ffn.norm)
    for s, layer in zip(spec.decoder.layer, model.decoder_layers, strict=True):
        _linear(s.attention.linear[0], layer.cross_attn.q_proj)
        _linear(s.attention.linear[1], layer.cross_attn.kv_proj)
        _linear(s.attention.linear[2], layer.cross_attn.out_proj)
        _norm(s.attention.layer_norm, layer.sub_cross.norm)
    projection = model.output_table
    spec.decoder.projection.weight = _np(projection)
    if model.output_ids is not None:  # model.restrict_output: the other pieces can never be produced
        spec.decoder.projection.bias = _np(outside_bias(model, -1e9))
        print(
            f"note: mtx's softmax covers {len(model.output_ids)} of {projection.shape[0]} target pieces "
            "(model.restrict_output); CTranslate2 gets all of them, the others at a bias of -1e9"
        )
    spec.register_source_vocabulary(_vocab(run.src_tok))
    spec.register_target_vocabulary(_vocab(run.tgt_tok))
    spec.config.add_source_eos = True  # mtx's encoder input ends with EOS
    spec.config.decoder_start_token = "<s>"
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    spec.validate()
    spec.optimize(quantization="float32")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))


def _ct2_worker(conn: Any, model_dir: str, threads: int, batches: list[Any], alpha: float) -> None:
    """Child process: decode every batch with CTranslate2 for each beam size asked, timing it."""
    import ctranslate2

    translator = ctranslate2.Translator(
        model_dir, device="cpu", compute_type="float32", intra_threads=threads, inter_threads=1
    )
    while (beam := conn.recv()) is not None:
        start = time.perf_counter()
        out = []
        for tokens, limit in batches:
            results = translator.translate_batch(
                tokens,
                beam_size=beam,
                length_penalty=alpha if beam > 1 else 0.0,
                max_decoding_length=limit,
                max_batch_size=0,
            )
            out += [r.hypotheses[0] for r in results]
        conn.send((time.perf_counter() - start, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="trained mtx run directory")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sentences", type=int, default=64)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=0, help="first N sentences only (0: all)")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes over the split per setting")
    args = parser.parse_args()
    try:
        import ctranslate2
    except ImportError:
        sys.exit("bench_ctranslate2: needs CTranslate2; run: pip install ctranslate2")

    torch.set_num_threads(args.threads)
    run = load_run(args.run)
    cfg = run.cfg
    n, batches = split_batches(run, args.split, args.sentences, args.batch_sentences)
    a, b, alpha = cfg.decode.max_len_a, cfg.decode.max_len_b, cfg.decode.length_penalty
    src_vocab, tgt_vocab = _vocab(run.src_tok), _vocab(run.tgt_tok)
    tgt_index = {t: i for i, t in enumerate(tgt_vocab)}

    padded = [pad_ids(x, suffix=EOS) for x in batches]
    limits = [int(max_output_lengths(x, a, b, run.model).max()) - 1 for x in padded]  # mtx's limit counts EOS
    ct2_batches = [([[src_vocab[i] for i in s] for s in x], limit) for x, limit in zip(batches, limits, strict=True)]

    def mtx_pass(beam: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        out = [hyp for x in padded for hyp in decode_tokens(run.model, x, beam, a, b, alpha)]
        return time.perf_counter() - start, out

    with tempfile.TemporaryDirectory() as tmp:
        convert(run, Path(tmp) / "ct2")
        # CTranslate2 runs in its own process: a Translator in this one slows torch's threads
        # about 2.5x even while it is idle (measured), which would time the clash, not mtx
        parent, child = mp.get_context("spawn").Pipe()
        worker = mp.get_context("spawn").Process(
            target=_ct2_worker, args=(child, str(Path(tmp) / "ct2"), args.threads, ct2_batches, alpha), daemon=True
        )
        worker.start()

        def ct2_pass(beam: int) -> tuple[float, list[list[int]]]:
            parent.send(beam)
            seconds, tokens = parent.recv()  # timed inside the worker
            return seconds, [[tgt_index[t] for t in hyp] for hyp in tokens]

        settings = {
            "mtx greedy": (mtx_pass, 1),
            "ctranslate2 greedy": (ct2_pass, 1),
            f"mtx beam {args.beam}": (mtx_pass, args.beam),
            f"ctranslate2 beam {args.beam}": (ct2_pass, args.beam),
        }
        for fn, beam in settings.values():  # warm up
            fn(beam)
        seconds = dict.fromkeys(settings, 0.0)
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, (fn, beam) in settings.items():
                took, outputs[name] = fn(beam)
                seconds[name] += took
        parent.send(None)
        worker.join()

    decoded = n * args.rounds  # sentences decoded per setting
    tokens = {name: args.rounds * sum(len(h) + 1 for h in outs) for name, outs in outputs.items()}  # + EOS
    m = cfg.model
    print(f"{args.run}: {m.d_model}d {m.n_encoder_layers}+{m.n_decoder_layers} layers, ", end="")
    print(f"{run.tgt_tok.vocab_size} BPE; {args.split} ({n} sentences, {args.rounds} passes), ", end="")
    print(f"{args.threads} threads, ", end="")
    print(f"batches of {args.batch_sentences}; CTranslate2 {ctranslate2.__version__} float32")
    print(f"{'setting':22s} {'sent/s':>8s} {'out tok/s':>10s} {'mean len':>9s} {'seconds':>8s}")
    for name in settings:
        print(f"{name:22s} {decoded / seconds[name]:8.1f} {tokens[name] / seconds[name]:10.0f} ", end="")
        print(f"{tokens[name] / decoded:9.2f} {seconds[name]:8.2f}")
    beam_name = f"beam {args.beam}"
    same = {
        kind: sum(x == y for x, y in zip(outputs[f"mtx {kind}"], outputs[f"ctranslate2 {kind}"], strict=True)) / n
        for kind in ("greedy", beam_name)
    }
    print(f"same output as CTranslate2: greedy {100 * same['greedy']:.1f}%, {beam_name} {100 * same[beam_name]:.1f}%")
    summary = {
        "mtx_greedy_tok_per_s": round(tokens["mtx greedy"] / seconds["mtx greedy"], 1),
        "ct2_greedy_tok_per_s": round(tokens["ctranslate2 greedy"] / seconds["ctranslate2 greedy"], 1),
        "mtx_beam_tok_per_s": round(tokens[f"mtx {beam_name}"] / seconds[f"mtx {beam_name}"], 1),
        "ct2_beam_tok_per_s": round(tokens[f"ctranslate2 {beam_name}"] / seconds[f"ctranslate2 {beam_name}"], 1),
        "greedy_speed_ratio_mtx_over_ct2": round(seconds["ctranslate2 greedy"] / seconds["mtx greedy"], 3),
        "beam_speed_ratio_mtx_over_ct2": round(seconds[f"ctranslate2 {beam_name}"] / seconds[f"mtx {beam_name}"], 3),
        "greedy_agreement": round(same["greedy"], 4),
        "beam_agreement": round(same[beam_name], 4),
    }
    print(json.dumps(summary))
    if same["greedy"] < 0.9:
        sys.exit("bench_ctranslate2: greedy outputs disagree on over 10% of sentences; the conversion is wrong")


if __name__ == "__main__":
    main()
