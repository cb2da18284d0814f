"""Training throughput: mtx vs a plain `torch.nn.Transformer` of identical size, side by side.

Both models see the same real Multi30k batches from mtx's batcher, the same tied embeddings,
sinusoidal positions and Adam; settings are timed alternately (A B C A B C ...) so that machine
noise hits all of them alike. The last line is JSON for scripts.

    python scripts/bench_train.py [--config configs/multi30k_de_en.yaml] [--set KEY=VALUE ...]
        [--steps 12] [--warmup 3] [--threads 2] [--compile] [--ablate]

The reference applies the config's dropouts where mtx's model does: model.dropout on the embeddings
and residual branches, model.attention_dropout on the attention probabilities and
model.activation_dropout on the FFN's hidden layer (stop 64: nn.Transformer's one `dropout` put
model.dropout on the last two as well, extra work counted as mtx's speed-up). Keys that change a
step but that the reference cannot build, or that this benchmark does not time (train.device other
than the CPU, tokenizer.joint false, tokenizer.bpe_dropout, model.tie_embeddings false, model.norm
scale, model.fix_norm, train.rdrop, train.word_dropout, train.tgt_word_dropout, train.accum_steps),
are refused with an error naming them; train.amp picks the precisions timed (fp32: no bf16 rows) and
train.threads the threads, where --threads is not given. Keys outside a step are not used: the run's
length and schedule, validation, checkpoints, the moving average (train.ema), train.dropout_warmup
(the rates are timed at their full value) and how epochs mix the data (train.bidirectional,
train.diversify, train.extra_sources).

`--ablate` also times mtx with one of its speed changes undone at a time (torch's dropout,
unfused loss, loss over all padded positions, for-loop Adam, zeroed instead of freed gradients),
which measures what each change buys on this machine.

It then runs mtx fp32 over the timed batches once more under the torch profiler and sums the time
of its matrix products (mm, addmm, bmm, ...): the step's time if every other operation were free.
The reference's step time over that is the most mtx could gain on the reference at these FLOPs
(`gemm_bound_vs_reference`), whatever is done to the elementwise ops, softmax, norms and loss.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx import default_onednn_cache  # noqa: E402
from mtx.cli import add_set_option, int_in, script_parser, thread_count  # noqa: E402
from mtx.config import Config, ModelConfig, load_config  # noqa: E402
from mtx.data import (  # noqa: E402
    Batch,
    ParallelIds,
    load_corpus,
    median_batch,
    padding_fraction,
    plan_batches,
    resolve_data_dir,
    texts,
)
from mtx.device import amp_dtype, auto_cpu_amp, autocast, cpu_bf16_speedup  # noqa: E402
from mtx.errors import ConfigError, MtxError, run_script, shown  # noqa: E402
from mtx.loss import label_smoothed_loss, training_loss  # noqa: E402
from mtx.model import Dropout, Seq2Seq, make_src_mask, sinusoidal_positions  # noqa: E402
from mtx.threads import usable_cpus  # noqa: E402
from mtx.tokenizer import PAD, train_bpe  # noqa: E402
from mtx.train import _thread_count, make_optimizer  # noqa: E402


class ReferenceTransformer(nn.Module):
    """The plain PyTorch way: nn.Transformer, dense float causal mask, full padded logits."""

    def __init__(self, cfg: ModelConfig, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False)
        self.scale = math.sqrt(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        with _quiet_reference():
            self.transformer = nn.Transformer(
                d_model=cfg.d_model,
                nhead=cfg.n_heads,
                num_encoder_layers=cfg.n_encoder_layers,
                num_decoder_layers=cfg.n_decoder_layers,
                dim_feedforward=cfg.d_ff,
                dropout=cfg.dropout,
                batch_first=True,
                norm_first=cfg.pre_norm,
            )
        # nn.Transformer's `dropout` also drops attention probabilities and the FFN's hidden layer;
        # mtx's model takes model.attention_dropout / model.activation_dropout there (-1: model.dropout)
        # (stop 64: the reference did that extra dropout at model.dropout, and its cost was counted as
        # mtx's speed-up, 5-14% of the ratio at the shipped sizes)
        activation = cfg.dropout if cfg.activation_dropout < 0 else cfg.activation_dropout
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout.p = activation  # the FFN's hidden layer (_ff_block); dropout1-3 stay residual
            for attention in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                if attention is not None:
                    attention.dropout = cfg.attention_dropout  # nn.MultiheadAttention's rate on its probabilities

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embed(ids) * self.scale + self.positions[: ids.shape[1]])

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=src.device)
        with _quiet_reference():
            out = self.transformer(
                self._embed(src),
                self._embed(tgt_in),
                tgt_mask=causal,
                src_key_padding_mask=src == PAD,
                tgt_key_padding_mask=tgt_in == PAD,
                memory_key_padding_mask=src == PAD,
            )
        return F.linear(out, self.embed.weight)


@contextlib.contextmanager
def _quiet_reference() -> Iterator[None]:
    """Without torch's two warnings about the reference's plain usage (no nested tensors with
    pre-norm; a float causal mask beside boolean padding masks), which said nothing about the
    benchmark and stood above its table (stop 57). The reference stays as a user writes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor is True", UserWarning)
        warnings.filterwarnings("ignore", "Support for mismatched key_padding_mask", UserWarning)
        yield


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: torch 2.13's profiler writes `USDT: ... profiler_start` and
    `profiler_stop` there from C++, lines that stood above the table (stop 64). An exception still
    propagates, and is reported once the descriptor is back."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# keys that change what a training step computes and that this benchmark does not build, with why
# (stop 64: they were validated, then ignored or applied to mtx only: the models timed were not the
# ones asked for); refused where they differ from the default, train.device where it is not the CPU
NOT_TIMED = {
    "train.device": "bench_train times training on the CPU only; set it to cpu or auto",
    "tokenizer.joint": "the reference shares one vocabulary and embedding between the languages (joint: true)",
    "tokenizer.bpe_dropout": "the timed batches are segmented once, without BPE-dropout",
    "model.tie_embeddings": "the reference ties its embeddings and output layer (tie_embeddings: true)",
    "model.norm": "nn.Transformer has LayerNorm only",
    "model.fix_norm": "nn.Transformer has no FixNorm",
    "train.rdrop": "the timed step has no R-Drop",
    "train.word_dropout": "the timed step has no word dropout",
    "train.tgt_word_dropout": "the timed step has no word dropout",
    "train.accum_steps": "the timed step updates after every batch",
}


def refuse_untimed(cfg: Config) -> None:
    """A ConfigError naming the first key of NOT_TIMED that `cfg` sets."""
    default = Config()
    for key, why in NOT_TIMED.items():
        section, name = key.split(".")
        value, usual = getattr(getattr(cfg, section), name), getattr(getattr(default, section), name)
        if value != usual and not (key == "train.device" and value == "cpu"):
            text = str(value).lower() if isinstance(value, bool) else shown(value)
            raise ConfigError(f"{key}={text} is not timed by bench_train: {why}")


def matmul_flops(cfg: ModelConfig, batch: Batch, vocab: int) -> float:
    """Matrix-multiply FLOPs of one training step (forward x 3), from the shapes."""
    d, f = cfg.d_model, cfg.d_ff
    b, s = batch.src.shape
    t = batch.tgt_in.shape[1]
    enc = cfg.n_encoder_layers * (b * s * (4 * d * d + 2 * d * f) + 2 * b * s * s * d)
    dec = cfg.n_decoder_layers * (
        b * t * (4 * d * d + 2 * d * d + 2 * d * f) + b * s * 2 * d * d + 2 * b * t * t * d + 2 * b * t * s * d
    )
    out = batch.n_tgt_tokens * d * vocab
    return 3 * 2 * (enc + dec + out)


def matmul_peak(dtype: torch.dtype, tokens: int, d: int, f: int) -> float:
    """Best measured GFLOP/s of the step's typical GEMM shapes in `dtype`."""
    best = 0.0
    for m, k, n in ((tokens, d, f), (tokens, f, d), (tokens, d, 3 * d)):
        a, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(2):
            a @ w
        start = time.perf_counter()
        for _ in range(5):
            a @ w
        best = max(best, 5 * 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return best


GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm"}


def gemm_seconds(step: Callable[[Batch], None], batches: list[Batch]) -> float:
    """Time spent in matrix products while `step` runs over `batches` (torch profiler, self time)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(batch)
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6


@functools.cache
def compiled_loss() -> Callable[..., torch.Tensor]:
    """What `train.compile: true` trains with; made on first use, as torch.compile imports its
    compiler (2-3 s, and 10 s under `python -OO` where bytecode is not cached) and --help needs none."""
    return training_loss(compiled=True)


# --ablate: each undoes one of mtx's speed changes (the model's own, or the training step's)
ABLATIONS = {
    "torch dropout": "nn.Dropout (bernoulli_ masks) instead of mtx's 16-bit-slice masks",
    "unfused loss": "F.cross_entropy on the non-padding logits instead of the fused chunked loss",
    "padded loss": "all B x T positions projected to the vocabulary, F.cross_entropy(ignore_index)",
    "for-loop Adam": "torch.optim.Adam(foreach=False) instead of fused=True",
    "zeroed grads": "zero_grad(set_to_none=False)",
}


def with_torch_dropout(model: Seq2Seq) -> Seq2Seq:
    """`model` with every mtx Dropout swapped for torch.nn.Dropout of the same rate."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Dropout):
                setattr(module, name, nn.Dropout(child.p))
    return model


def _mtx_loss(model: Seq2Seq, batch: Batch, smoothing: float, ablation: str, compiled: bool) -> torch.Tensor:
    if ablation not in ("unfused loss", "padded loss"):
        return (compiled_loss() if compiled else label_smoothed_loss)(model, batch, smoothing)
    src_mask = make_src_mask(batch.src)
    states = model.decoder_states(batch.tgt_in, model.encode(batch.src, src_mask), src_mask)
    target = batch.tgt_out
    if ablation == "unfused loss":
        keep = target != PAD
        states, target = states[keep], target[keep]
    logits = model.project(states)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        target.reshape(-1),
        ignore_index=PAD,
        label_smoothing=smoothing,
        reduction="sum",
    )


def make_step(
    model: nn.Module, cfg: Config, amp: torch.dtype | None, reference: bool, ablation: str = "", compiled: bool = False
) -> Callable[[Batch], None]:
    device = torch.device("cpu")
    if reference or ablation == "for-loop Adam":  # foreach=False: what torch picks for CPU tensors anyway
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, foreach=False)
    else:
        optimizer = make_optimizer(model, cfg.train, device)
    smoothing = cfg.train.label_smoothing
    set_to_none = not reference and ablation != "zeroed grads"

    def step(batch: Batch) -> None:
        model.train()
        with autocast(device, amp):
            if reference:
                logits = model(batch.src, batch.tgt_in)
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(),
                    batch.tgt_out.reshape(-1),
                    ignore_index=PAD,
                    label_smoothing=smoothing,
                    reduction="sum",
                )
            else:
                loss = _mtx_loss(model, batch, smoothing, ablation, compiled)
        (loss / batch.n_tgt_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def main() -> None:
    parser = script_parser("bench_train", (__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--config",
        default=str(Path(__file__).resolve().parent.parent / "configs" / "multi30k_de_en.yaml"),
        help="the config timed (default: the checkout's configs/multi30k_de_en.yaml)",
    )
    add_set_option(parser, "a config key (repeatable)")
    parser.add_argument("--steps", type=int_in(1), default=12, help="timed steps per setting")
    parser.add_argument("--warmup", type=int_in(0), default=3, help="untimed steps per setting")
    parser.add_argument(
        "--threads",
        type=thread_count(),
        help=f"CPU threads (default: train.threads where set, else {min(2, usable_cpus())})",
    )
    parser.add_argument("--compile", action="store_true", help="also time mtx under torch.compile")
    parser.add_argument("--ablate", action="store_true", help="also time mtx with each speed change undone")
    args = parser.parse_args()
    default_onednn_cache()  # oneDNN's kernel cache as mtx's commands set it

    cfg = load_config(args.config, args.overrides)
    refuse_untimed(cfg)
    if args.threads is None:  # (stop 64: train.threads was validated, then ignored)
        args.threads = _thread_count(cfg.train.threads) if cfg.train.threads else min(2, usable_cpus())
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    amp = amp_dtype(cpu, cfg.train.amp)  # what mtx train trains in here; fp16: its error
    if (args.compile or cfg.train.compile) and args.warmup == 0:  # (stop 55: 15 tok/s and "0.0 s" of compiling)
        parser.error("torch.compile compiles in the first step: --warmup 0 would time the compiling; give 1 or more")
    data_dir = resolve_data_dir(cfg.data)
    src, tgt = texts(load_corpus(data_dir, cfg.data, [cfg.data.train_split])[cfg.data.train_split])
    tok = train_bpe(src + tgt, cfg.tokenizer)
    ids = ParallelIds.encode(src, tgt, tok, tok, cfg.data.max_len)
    plan = plan_batches(ids.src_lens, ids.tgt_lens, cfg.train.batch_tokens, seed=cfg.train.seed)
    if len(plan) < args.warmup + args.steps:  # a small train split (stop 53: a division by zero after the warmup)
        raise MtxError(
            f"{data_dir}: {cfg.data.train_split} makes {len(plan)} batches of train.batch_tokens="
            f"{cfg.train.batch_tokens}, fewer than --warmup {args.warmup} + --steps {args.steps}; "
            "lower them or train.batch_tokens"
        )
    batches = [ids.batch(p) for p in plan[: args.warmup + args.steps]]
    vocab = tok.vocab_size

    torch.manual_seed(cfg.train.seed)
    settings: dict[str, tuple[nn.Module, torch.dtype | None, bool]] = {
        "reference fp32 (nn.Transformer)": (ReferenceTransformer(cfg.model, vocab), None, True),
        "mtx fp32": (Seq2Seq(cfg.model, vocab, vocab, joint_vocab=True), None, False),
    }
    # without native bf16 (AVX-512 bf16/AMX) autocast emulates it, many times slower than fp32:
    # train.amp auto then trains in fp32, and timing bf16 would only measure the emulation
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # what train.amp auto trains in on this CPU: mtx train's timing, of this model on a batch of median length
    timed_model, timed_batch = settings["mtx fp32"][0], median_batch(ids, cfg.train.batch_tokens)
    auto_amp, pass_speedup = auto_cpu_amp(
        timed_model, lambda: label_smoothed_loss(timed_model, timed_batch, cfg.train.label_smoothing)
    )
    if cfg.train.amp == "auto":  # mtx train's choice takes the model's pass into account too
        amp = auto_amp
    ref_bf16 = "reference bf16 autocast"
    # train.amp fp32 times fp32 only, bf16 times bf16 even where emulated, as mtx train then trains
    # (stop 64: the bf16 rows were timed, and could be best_setting, whatever train.amp said)
    time_bf16 = cfg.train.amp == "bf16" or (cfg.train.amp == "auto" and native_bf16)
    if time_bf16:
        settings["mtx bf16 autocast"] = (Seq2Seq(cfg.model, vocab, vocab, joint_vocab=True), torch.bfloat16, False)
        # the same precision on both sides: what mtx buys beyond the autocast anyone can switch on
        settings[ref_bf16] = (ReferenceTransformer(cfg.model, vocab), torch.bfloat16, True)
    compile_seconds = None
    if args.compile or cfg.train.compile:
        model = Seq2Seq(cfg.model, vocab, vocab, joint_vocab=True)
        settings[f"mtx {'bf16' if amp else 'fp32'} + torch.compile"] = (model, amp, False)
    # model.restrict_output shrinks the output layer: not the reference's size, so it is timed
    # beside the others but left out of speedup_vs_reference
    restricted = "mtx fp32, restricted output"
    restricted_bf16 = "mtx bf16, restricted output"
    output_ids = ids.target_vocabulary()
    softmax_size = vocab
    if cfg.model.restrict_output:
        model = Seq2Seq(cfg.model, vocab, vocab, joint_vocab=True, output_ids=output_ids)
        settings[restricted] = (model, None, False)
        # the model's own count, EOS and UNK included, as mtx train logs it (stop 64: 635 against 637)
        softmax_size = len(model.output_ids)
        if time_bf16:  # what training with the shipped de->en config runs on such a CPU
            model = Seq2Seq(cfg.model, vocab, vocab, joint_vocab=True, output_ids=output_ids)
            settings[restricted_bf16] = (model, torch.bfloat16, False)
    ablations = {}
    if args.ablate:
        for what in ABLATIONS:
            model = Seq2Seq(cfg.model, vocab, vocab, joint_vocab=True)
            name = f"mtx fp32 - {what}"
            settings[name] = (with_torch_dropout(model) if what == "torch dropout" else model, None, False)
            ablations[name] = what
    steps = {
        name: make_step(m, cfg, amp, ref, ablations.get(name, ""), compiled="compile" in name)
        for name, (m, amp, ref) in settings.items()
    }

    for name, step in steps.items():
        start = time.perf_counter()
        for batch in batches[: args.warmup]:
            step(batch)
        if "compile" in name:
            compile_seconds = time.perf_counter() - start
    seconds = dict.fromkeys(steps, 0.0)
    for batch in batches[args.warmup :]:
        for name, step in steps.items():  # alternate settings on every batch
            start = time.perf_counter()
            step(batch)
            seconds[name] += time.perf_counter() - start

    timed = batches[args.warmup :]
    gemm_s = gemm_seconds(steps["mtx fp32"], timed)
    tgt_tokens = sum(b.n_tgt_tokens for b in timed)
    all_tokens = tgt_tokens + sum(b.n_src_tokens for b in timed)
    flops = {
        name: sum(matmul_flops(cfg.model, b, softmax_size if "restricted" in name else vocab) for b in timed)
        for name in steps
    }
    tokens_per_batch = int(sum(b.tgt_out.numel() for b in timed) / len(timed))
    peaks = {
        dt: matmul_peak(dt, tokens_per_batch, cfg.model.d_model, cfg.model.d_ff)
        for dt in ((torch.float32, torch.bfloat16) if time_bf16 else (torch.float32,))
    }
    pad = padding_fraction(ids, plan)

    print(
        f"{len(timed)} timed steps per setting on the CPU, {args.threads} threads, "
        f"{tgt_tokens / len(timed):.0f} target tokens/batch"
    )
    if time_bf16:
        bf16_peak = f"bf16 {peaks[torch.bfloat16]:.0f} GFLOP/s"
    else:
        bf16_peak = "bf16 not timed (train.amp fp32)" if native_bf16 else "no native bf16 on this CPU (not timed)"
    print(f"matmul peak measured here: fp32 {peaks[torch.float32]:.0f} GFLOP/s, {bf16_peak}")
    amp_auto = "bf16" if auto_amp else "fp32"
    timing = f"bf16 products at {cpu_bf16_speedup():.2f}x the speed of fp32"
    if pass_speedup is not None:
        timing += f", this model's training pass at {pass_speedup:.2f}x"
    print(f"train.amp auto trains in {amp_auto} here (its timing: {timing})")
    print(f"{'setting':34s} {'tgt tok/s':>10s} {'src+tgt tok/s':>14s} {'GFLOP/s':>8s} {'of peak':>8s} {'vs ref':>7s}")
    ref_name = next(iter(steps))
    rates = {name: tgt_tokens / s for name, s in seconds.items()}
    for name, s in seconds.items():
        amp = settings[name][1]
        gflops = flops[name] / s / 1e9
        peak = peaks[amp or torch.float32]
        print(
            f"{name:34s} {rates[name]:10.0f} {all_tokens / s:14.0f} {gflops:8.0f} {gflops / peak:8.0%} "
            f"{rates[name] / rates[ref_name]:6.2f}x"
        )
    if compile_seconds is not None:
        print(f"torch.compile warmup (compile + {args.warmup} steps): {compile_seconds:.1f} s")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS of this process (all models together): {peak_rss:.2f} GiB; padding {pad:.1%}")
    for name, what in ablations.items():
        print(f"{name}: {ABLATIONS[what]}; mtx fp32 is {rates['mtx fp32'] / rates[name]:.2f}x as fast")
    gemm_bound = seconds[ref_name] / gemm_s
    print(
        f"mtx fp32 matrix products alone (profiled): {gemm_s / len(timed) * 1e3:.0f} ms a step, "
        f"{gemm_s / seconds['mtx fp32']:.0%} of its step ({seconds['mtx fp32'] / len(timed) * 1e3:.0f} ms); "
        f"the reference's step {seconds[ref_name] / len(timed) * 1e3:.0f} ms: with every other op free, "
        f"mtx fp32 would be at most {gemm_bound:.2f}x the reference"
    )
    if restricted in rates:
        print(
            f"{restricted}: softmax over {softmax_size} of {vocab} target pieces (model.restrict_output); "
            f"{rates[restricted] / rates['mtx fp32']:.2f}x mtx fp32 (not counted as speedup_vs_reference)"
        )
    if ref_bf16 in rates:
        print(
            f"same precision on both sides: mtx bf16 autocast {rates['mtx bf16 autocast'] / rates[ref_bf16]:.2f}x "
            f"the reference in bf16 autocast (which is {rates[ref_bf16] / rates[ref_name]:.2f}x its fp32)"
        )
    not_mtx = (ref_name, ref_bf16, restricted, restricted_bf16)
    best = max((n for n in rates if n not in not_mtx and n not in ablations), key=rates.get)
    print(
        json.dumps(
            {
                "speedup_vs_reference": round(rates[best] / rates[ref_name], 3),
                "best_setting": best,
                # what train.amp auto trains in on this CPU, from its timings of bf16 against fp32: of
                # products, then (where they are fast) of this model's training pass
                "amp_auto": amp_auto,
                "cpu_bf16_speedup": round(cpu_bf16_speedup(), 3),
                "bf16_pass_speedup": None if pass_speedup is None else round(pass_speedup, 3),
                "mtx_tgt_tok_per_s": round(rates[best], 1),
                "reference_tgt_tok_per_s": round(rates[ref_name], 1),
                "mtx_fp32_tgt_tok_per_s": round(rates["mtx fp32"], 1),
                "padding_fraction": round(pad, 4),
                "mtx_gemm_fraction": round(gemm_s / seconds["mtx fp32"], 3),
                "gemm_bound_vs_reference": round(gemm_bound, 3),
                "peak_rss_gib": round(peak_rss, 3),
                "compile_seconds": None if compile_seconds is None else round(compile_seconds, 1),
                "restricted_output_tgt_tok_per_s": round(rates[restricted], 1) if restricted in rates else None,
                "restricted_output_bf16_tgt_tok_per_s": (
                    round(rates[restricted_bf16], 1) if restricted_bf16 in rates else None
                ),
                "reference_bf16_tgt_tok_per_s": round(rates[ref_bf16], 1) if ref_bf16 in rates else None,
                "speedup_vs_reference_bf16": (
                    round(rates["mtx bf16 autocast"] / rates[ref_bf16], 3) if ref_bf16 in rates else None
                ),
                "ablation_gains": {what: round(rates["mtx fp32"] / rates[n], 3) for n, what in ablations.items()},
            }
        )
    )


if __name__ == "__main__":
    run_script("bench_train", main)
