from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtx import clock as clock_module
from mtx import device as device_module
from mtx import loss as loss_module
from mtx import rundir as rundir_module
from mtx import runlog as runlog_module
from mtx import train as train_module
from mtx.cli import main
from mtx.config import Config, ModelConfig, TrainConfig, load_config
from mtx.data import Batch
from mtx.device import BF16_MIN_SPEEDUP, BF16_MIN_STEP_SPEEDUP, amp_dtype, cpu_bf16_speedup
from mtx.errors import MtxError
from mtx.loss import (
    ProjectedRDropLoss,
    ProjectedSmoothedCrossEntropy,
    SmoothedCrossEntropy,
    _rdrop_of_logits,
    label_smoothed_loss,
    rdrop_loss,
    training_loss,
)
from mtx.model import Dropout, FeedForward, Seq2Seq, dropout
from mtx.punctuation import folds, load_folds, punctuation_counts
from mtx.state import MovingAverage, rng_state, set_rng_state
from mtx.tokenizer import BOS, EOS, PAD, UNK
from mtx.train import drop_words, dropout_rate, learning_rate, make_optimizer, set_dropout

from .conftest import REPO, tiny_args


def test_inverse_sqrt_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=100)
    lrs = [learning_rate(s, cfg, 256) for s in (1, 50, 100, 400, 10000)]
    assert lrs[0] == pytest.approx(1e-5) and lrs[1] == pytest.approx(5e-4) and lrs[2] == pytest.approx(1e-3)
    assert lrs[3] == pytest.approx(5e-4) and lrs[4] == pytest.approx(1e-4)
    noam = TrainConfig(lr=2.0, warmup_steps=100, schedule="noam")
    assert learning_rate(100, noam, 256) == pytest.approx(2.0 * 256**-0.5 * 100**-0.5)
    constant = TrainConfig(lr=1e-3, warmup_steps=10, schedule="constant")
    assert learning_rate(5, constant, 256) == pytest.approx(5e-4) and learning_rate(500, constant, 256) == 1e-3


def test_linear_schedule_reaches_zero_at_the_end_of_steps_or_minutes() -> None:
    by_steps = TrainConfig(lr=1e-3, warmup_steps=100, max_steps=1000, schedule="linear")
    assert learning_rate(50, by_steps, 256) == pytest.approx(5e-4)  # warmup ramp
    assert learning_rate(501, by_steps, 256) == pytest.approx(5e-4)  # half the steps left before it
    # the last update still moves the weights (stop 61: its rate was 0); after it, the rate is 0
    assert learning_rate(1000, by_steps, 256) == pytest.approx(1e-6) and learning_rate(1001, by_steps, 256) == 0.0
    one_step = TrainConfig(lr=1e-3, warmup_steps=1, max_steps=1, schedule="linear")  # a 1-step fine-tune
    assert learning_rate(1, one_step, 256) == pytest.approx(1e-3)
    timed = TrainConfig(lr=1e-3, warmup_steps=100, max_steps=1000, max_minutes=10, schedule="linear")
    assert learning_rate(201, timed, 256, elapsed=0.0) == pytest.approx(8e-4)  # steps used up faster
    assert learning_rate(200, timed, 256, elapsed=450.0) == pytest.approx(2.5e-4)  # 3/4 of the minutes used
    assert learning_rate(200, timed, 256, elapsed=900.0) == 0.0  # past the budget: never negative


def test_dropout_ramps_from_start_to_model_dropout_then_stays() -> None:
    ramp = TrainConfig(dropout_warmup=101, dropout_start=0.1)
    rates = [dropout_rate(s, ramp, 0.3) for s in (1, 51, 101, 5000)]
    assert rates == [pytest.approx(0.1), pytest.approx(0.2), 0.3, 0.3]
    assert dropout_rate(1, TrainConfig(), 0.3) == 0.3  # no warmup: constant
    model = Seq2Seq(
        ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1), 50, 50, joint_vocab=True
    )
    set_dropout(model, 0.17)
    rates_in_model = {m.p for m in model.modules() if isinstance(m, Dropout)}
    assert rates_in_model == {0.17}  # embeddings, residual branches and FFNs all follow


def test_activation_dropout_is_the_ffn_rate_of_its_own() -> None:
    """model.activation_dropout sets the rate on the FFN's hidden ReLU; the default (-1) is
    model.dropout's. A rate of its own stays put when train.dropout_warmup moves model.dropout."""
    shape = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_encoder_layers": 2, "n_decoder_layers": 1, "dropout": 0.3}

    def ffn_and_other_rates(model: Seq2Seq) -> tuple[set[float], set[float]]:
        ffn = {m.dropout for m in model.modules() if isinstance(m, FeedForward)}
        return {m.p for m in ffn}, {m.p for m in model.modules() if isinstance(m, Dropout) and m not in ffn}

    assert ffn_and_other_rates(Seq2Seq(ModelConfig(**shape), 50, 50, joint_vocab=True)) == ({0.3}, {0.3})
    model = Seq2Seq(ModelConfig(**shape, activation_dropout=0.0), 50, 50, joint_vocab=True)
    assert ffn_and_other_rates(model) == ({0.0}, {0.3})
    set_dropout(model, 0.17)
    assert ffn_and_other_rates(model) == ({0.0}, {0.17})
    # no dropout on the hidden ReLU: in training mode an FFN is then a deterministic function
    model.train()
    ffn = model.encoder_layers[0].ffn
    x = torch.randn(3, 5, 16)
    assert torch.equal(ffn(x), ffn(x))


def test_adamw_decays_matrices_only_and_apart_from_the_gradient() -> None:
    """With zero gradients Adam's step is zero, so what moves is the decay alone: AdamW shrinks
    each matrix by lr * weight_decay and leaves biases and norm gains; Adam's decay goes through
    the adaptive step (about lr per element, whatever the weight's size)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    before = [p.detach().clone() for p in net.parameters()]
    opt = make_optimizer(net, TrainConfig(lr=0.1, optimizer="adamw", weight_decay=0.5), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, old in zip(net.parameters(), before, strict=True):
        expected = old * (1 - 0.1 * 0.5) if p.dim() >= 2 else old
        assert torch.allclose(p.detach(), expected, atol=1e-7)
    coupled = torch.nn.Linear(4, 3)
    old = coupled.weight.detach().clone()
    opt = make_optimizer(coupled, TrainConfig(lr=0.1, weight_decay=0.5), torch.device("cpu"))
    assert type(opt) is torch.optim.Adam
    for p in coupled.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    step = (old - coupled.weight.detach()).abs()
    assert torch.allclose(step, torch.full_like(step, 0.1), rtol=1e-3)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_smoothed_loss_matches_cross_entropy(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(300, 1000) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, 1000, (300,))
    fused = SmoothedCrossEntropy.apply(logits, target, 0.1)
    (grad_fused,) = torch.autograd.grad(fused * 0.5, logits)
    plain = F.cross_entropy(logits.float(), target, label_smoothing=0.1, reduction="sum")
    (grad_plain,) = torch.autograd.grad(plain * 0.5, logits)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)
    assert grad_fused.dtype == dtype
    assert torch.allclose(grad_fused.float(), grad_plain.float(), atol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_projected_loss_matches_cross_entropy_of_the_full_logits(dtype: torch.dtype, tol: float) -> None:
    """Blocks of rows (600 = 256 + 256 + 88) through one reused buffer: the value and both
    gradients of the cross-entropy of the materialised logits."""
    torch.manual_seed(0)
    states = torch.randn(600, 64).requires_grad_()
    weight = (torch.randn(1000, 64) * 0.3).requires_grad_()
    target = torch.randint(0, 1000, (600,))
    fused = ProjectedSmoothedCrossEntropy.apply(states.to(dtype), weight.to(dtype), target, 0.1, True)
    grads = torch.autograd.grad(fused * 0.5, (states, weight))
    logits = (states.to(dtype) @ weight.to(dtype).t()).float()
    plain = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="sum")
    expected = torch.autograd.grad(plain * 0.5, (states, weight))
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)
    for got, want in zip(grads, expected, strict=True):
        assert torch.allclose(got, want, atol=tol * want.abs().max().item())
    with torch.no_grad():  # validation: the value alone
        value = ProjectedSmoothedCrossEntropy.apply(states, weight, target, 0.0, False)
        assert value.item() == pytest.approx(F.cross_entropy(states @ weight.t(), target, reduction="sum").item())


def test_restricted_output_loss_is_cross_entropy_over_the_chosen_rows() -> None:
    """model.restrict_output: logit column c is token output_ids[c]; the fused CPU loss equals
    F.cross_entropy of those columns, and its gradient reaches the tied embedding's rows."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)
    vocab = 300
    output_ids = torch.arange(4, vocab, 2)  # even pieces only (EOS and UNK get added)
    model = Seq2Seq(cfg, vocab, vocab, joint_vocab=True, output_ids=output_ids)
    ids = model.output_ids
    assert ids.tolist() == sorted({2, 3, *output_ids.tolist()}) and model.eos_column == 0
    assert torch.equal(model.output_tokens(model.output_columns(ids)), ids)
    assert model.output_columns(torch.tensor([5, 3])).tolist() == [1, 1]  # outside -> UNK's column
    src = torch.randint(4, vocab, (3, 7))
    tgt = ids[torch.randint(2, len(ids), (3, 6))]
    tgt[0, 4:] = PAD  # padding positions add nothing to the loss
    batch = Batch(src, torch.cat([torch.full((3, 1), 1), tgt[:, :-1]], 1), tgt, 21, 16)
    loss = label_smoothed_loss(model, batch, 0.1)
    (grad,) = torch.autograd.grad(loss, model.tgt_embed.tokens.weight)
    logits = model(batch.src, batch.tgt_in)
    assert logits.shape == (3, 6, len(ids))
    columns = model.output_columns(tgt).masked_fill(tgt == PAD, -100)
    want = F.cross_entropy(
        logits.reshape(-1, len(ids)), columns.reshape(-1), ignore_index=-100, label_smoothing=0.1, reduction="sum"
    )
    (want_grad,) = torch.autograd.grad(want, model.tgt_embed.tokens.weight)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-5)


def _rdrop_model_and_batch(dropout_p: float) -> tuple[Seq2Seq, Batch]:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=dropout_p)
    model = Seq2Seq(cfg, 300, 300, joint_vocab=True, output_ids=torch.arange(4, 300, 2))
    src = torch.randint(4, 300, (3, 7))
    tgt = model.output_ids[torch.randint(2, len(model.output_ids), (3, 6))]
    tgt[0, 4:] = 0  # padding: the loss must skip it
    tgt_in = torch.cat([torch.full((3, 1), 1), tgt[:, :-1]], 1)
    return model, Batch(src, tgt_in, tgt, 21, int((tgt != 0).sum()))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_compiled_loss_gives_the_eager_loss_and_gradients() -> None:
    """`train.compile`: the loss compiled with the model inside (which takes the unfused
    `SmoothedCrossEntropy` path, as on CUDA) gives the eager (fused on CPU) loss and gradients."""
    model, batch = _rdrop_model_and_batch(0.0)
    compiled = training_loss(compiled=True)(model, batch, 0.1)
    got = torch.autograd.grad(compiled, list(model.parameters()))
    eager = label_smoothed_loss(model, batch, 0.1)
    want = torch.autograd.grad(eager, list(model.parameters()))
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-5)


def test_fused_rdrop_loss_matches_the_loss_of_the_full_logits() -> None:
    torch.manual_seed(0)
    n, dim, vocab = 300, 16, 50  # more rows than one block
    states = torch.randn(2, n, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    target = torch.randint(0, vocab, (n, 1))
    fused = ProjectedRDropLoss.apply(states, weight, target, 0.1, 5.0, True)
    fused_grads = torch.autograd.grad(fused * 0.5, (states, weight))
    want = _rdrop_of_logits(states @ weight.t(), target, 0.1, 5.0)
    want_grads = torch.autograd.grad(want * 0.5, (states, weight))
    assert fused.item() == pytest.approx(want.item(), rel=1e-5)
    for got, ref in zip(fused_grads, want_grads, strict=True):
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_rdrop_without_dropout_is_the_plain_loss_whatever_its_weight() -> None:
    model, batch = _rdrop_model_and_batch(0.0)
    want = label_smoothed_loss(model, batch, 0.1)
    (want_grad,) = torch.autograd.grad(want, model.tgt_embed.tokens.weight)
    for alpha in (0.0, 5.0):  # two identical passes: the KL term is zero
        loss = rdrop_loss(model, batch, 0.1, alpha)
        (grad,) = torch.autograd.grad(loss, model.tgt_embed.tokens.weight)
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
        assert torch.allclose(grad, want_grad, atol=1e-5)


def test_rdrop_adds_a_positive_kl_term_linear_in_its_weight() -> None:
    model, batch = _rdrop_model_and_batch(0.3)
    losses = {}
    for alpha in (0.0, 1.0, 2.0):
        torch.manual_seed(1)  # the same two dropout masks for each weight
        losses[alpha] = rdrop_loss(model, batch, 0.1, alpha).item()
    kl = losses[1.0] - losses[0.0]
    assert kl > 1e-3  # two different dropout masks give two different distributions
    assert losses[2.0] - losses[0.0] == pytest.approx(2 * kl, rel=1e-4)


def test_moving_average_follows_its_formula_and_averages_a_tied_weight_once() -> None:
    torch.manual_seed(0)
    model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1), 50, 50, True)
    ema = MovingAverage(model, decay=0.9)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for n in range(1, 31):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        d = min(0.9, (1 + n) / (10 + n))
        for name, p in model.named_parameters():
            expected[name] = d * expected[name] + (1 - d) * p.detach()
    state = ema.model_state()
    assert state.keys() == model.state_dict().keys()
    for name, _ in model.named_parameters():
        assert torch.allclose(state[name], expected[name], atol=1e-5), name
        assert not torch.equal(state[name], model.state_dict()[name])
    # joint vocabulary: source and target embeddings are one tensor, averaged once, under both names
    assert state["src_embed.tokens.weight"] is state["tgt_embed.tokens.weight"]
    fresh = MovingAverage(model, decay=0.9)
    fresh.load(ema.to_dict())
    assert fresh.updates == 30 and all(torch.equal(a, b) for a, b in zip(fresh.averages, ema.averages, strict=True))


def test_fast_dropout_keeps_the_right_share_and_scale() -> None:
    torch.manual_seed(0)
    x = torch.ones(200_000)
    y = dropout(x, 0.3, training=True)
    assert (y > 0).float().mean().item() == pytest.approx(0.7, abs=0.005)
    assert y.mean().item() == pytest.approx(1.0, abs=0.01)
    assert torch.equal(dropout(x, 0.3, training=False), x)
    torch.manual_seed(1)
    a = dropout(x, 0.3, training=True)
    torch.manual_seed(1)
    assert torch.equal(a, dropout(x, 0.3, training=True))  # seeded by torch's generator
    # a rate just below 1 (the config takes [0, 1)) keeps 1 in 65,536 (stop 53: a division by zero)
    y = dropout(torch.ones(1_000_000), 0.999995, training=True)
    assert 0 < int((y > 0).sum()) < 40 and y.max().item() == 65536.0


def _final_loss(run_dir: Path) -> float:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "train"][-1]["loss"]


def test_bf16_converges_like_fp32(
    tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.amp bf16 trains under bf16 autocast (fp32 without it) and learns as fp32 does; where
    this CPU's bf16 products are slower than fp32's, a warning says so (stop 57: none, and 9.5x
    as slow on Zen 3, which emulates them)."""
    losses, autocast, warned = {}, {"fp32": [], "bf16": []}, {}
    real = loss_module.label_smoothed_loss

    def recording(model: torch.nn.Module, batch: object, smoothing: float) -> torch.Tensor:
        if model.training:
            on = torch.is_autocast_enabled("cpu")
            autocast[amp].append(torch.get_autocast_dtype("cpu") if on else torch.float32)
        return real(model, batch, smoothing)

    monkeypatch.setattr(loss_module, "label_smoothed_loss", recording)
    for amp in ("fp32", "bf16"):
        run = tmp_path / amp
        # the CPU's autocast is what is recorded; auto would pick a GPU where there is one (stop 54).
        # Small steps and a short validation: a CPU without native bf16 (Zen 3) emulates its
        # products some 10x slower than fp32's (stop 57: 80 steps of 1,500 tokens took 50 s)
        args = tiny_args(
            small_data, run, "--set", "train.max_steps=40", "--set", f"train.amp={amp}", "--set", "train.device=cpu"
        )
        small = ["train.batch_tokens=800", "train.warmup_steps=20", "train.eval_every=40", "train.eval_sentences=20"]
        capsys.readouterr()
        assert main([*args, *(arg for key in small for arg in ("--set", key))]) == 0
        losses[amp] = _final_loss(run)
        warned[amp] = "bf16 products run" in capsys.readouterr().err
    assert losses["fp32"] < 5.8  # it did learn (starts near ln(1000) = 6.9)
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.1)
    assert losses["bf16"] != losses["fp32"]  # bf16's rounding: not the same run twice
    assert set(autocast["fp32"]) == {torch.float32} and set(autocast["bf16"]) == {torch.bfloat16}
    assert warned == {"fp32": False, "bf16": cpu_bf16_speedup() < 1}


def test_cpu_bf16_speedup_is_measured_once_and_is_zero_without_native_bf16() -> None:
    speedup = cpu_bf16_speedup()
    assert cpu_bf16_speedup.cache_info().currsize == 1 and cpu_bf16_speedup() == speedup  # once per process
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert 0.05 < speedup < 100  # a timed ratio of two real products
    else:
        assert speedup == 0.0


def test_gpu_precision_and_random_states_where_the_hardware_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated GPUs (stop 63): `auto` takes fp16 where bf16 is only emulated (a T4 or V100);
    fp16 elsewhere than CUDA is refused (MPS trained bf16 without a word); a last.pt that holds
    two GPUs' random states resumes where torch sees one (IndexError)."""
    import contextlib

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for native, auto in ((True, torch.bfloat16), (False, torch.float16)):
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n or including_emulation
        )
        assert amp_dtype(cuda, "auto") is auto and amp_dtype(cuda, "bf16") is torch.bfloat16
        assert amp_dtype(cuda, "fp16") is torch.float16
    with pytest.raises(MtxError, match="train.amp: fp16 is for CUDA; on mps use bf16, fp32 or auto"):
        amp_dtype(torch.device("mps"), "fp16")
    restored: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: restored.append(index))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.get_rng_state()] * 2)
    saved = rng_state()  # as on a machine where torch saw two GPUs
    assert len(saved["cuda"]) == 2
    set_rng_state(saved)
    assert restored == [0]


@pytest.mark.parametrize(("speedup", "expected"), [(0.0, None), (0.6, None), (1.49, None), (2.5, torch.bfloat16)])
def test_auto_trains_in_bf16_only_where_bf16_products_are_measured_fast(
    monkeypatch: pytest.MonkeyPatch, speedup: float, expected: torch.dtype | None
) -> None:
    """`train.amp: auto` on CPU follows the measured bf16 speed (a Xeon with AVX-512 BF16 but no
    AMX ran bf16 products at 0.55x fp32 and trained 0.66x as fast in bf16); an explicit bf16 is kept."""
    monkeypatch.setattr(device_module, "cpu_bf16_speedup", lambda: speedup)
    cpu = torch.device("cpu")
    assert amp_dtype(cpu, "auto") is expected
    assert (speedup >= BF16_MIN_SPEEDUP) == (expected is not None)
    assert amp_dtype(cpu, "bf16") is torch.bfloat16 and amp_dtype(cpu, "fp32") is None


@pytest.mark.parametrize(
    ("products", "model_pass", "expected"),
    [(1.49, 5.0, None), (2.5, 0.77, None), (2.5, 1.49, None), (2.5, 1.5, torch.bfloat16), (2.5, 2.1, torch.bfloat16)],
)
def test_auto_trains_in_bf16_only_where_the_models_own_pass_is_measured_fast(
    monkeypatch: pytest.MonkeyPatch, products: float, model_pass: float, expected: torch.dtype | None
) -> None:
    """Fast bf16 products are not enough: on a CPU with AMX the tiny config's d_model 64 model
    trained 2.25x slower in bf16 (stop 70), its training pass timed at 0.77x (stop 71). The pass is
    timed only where the products are fast."""
    timed: list[float] = []

    def pass_speedup(model: torch.nn.Module, step: object) -> float:
        timed.append(model_pass)
        return model_pass

    monkeypatch.setattr(device_module, "cpu_bf16_speedup", lambda: products)
    monkeypatch.setattr(device_module, "bf16_step_speedup", pass_speedup)
    amp, speedup = device_module.auto_cpu_amp(torch.nn.Linear(2, 2), lambda: torch.zeros(()))
    assert amp is expected
    assert (speedup, timed) == ((None, []) if products < BF16_MIN_SPEEDUP else (model_pass, [model_pass]))
    assert (expected is not None) == (products >= BF16_MIN_SPEEDUP and model_pass >= BF16_MIN_STEP_SPEEDUP)


def test_out_of_memory_in_autos_timed_pass_is_one_line_and_leaves_no_run(
    tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pass `train.amp: auto` times is a training batch's: where it does not fit, the one line
    of a step that does not, before anything trained, and the new run's directory is removed."""

    def no_memory(model: object, step: object) -> float:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(device_module, "cpu_bf16_speedup", lambda: 2.5)
    monkeypatch.setattr(device_module, "bf16_step_speedup", no_memory)
    run = tmp_path / "run"
    assert main(tiny_args(small_data, run, "--set", "train.amp=auto", "--set", "train.device=cpu")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtx: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "out of memory on cpu in a training pass (train.batch_tokens=1500), timed for train.amp auto" in lines[0]
    assert "lower train.batch_tokens" in lines[0] and not run.exists()


def test_a_models_pass_is_timed_without_moving_the_generators_or_leaving_gradients() -> None:
    """The timing runs dropout's draws on a fork of the generators: a run that times its pass
    draws the masks of one that does not; no gradient is left for the first update to add to."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1000)).train()
    x = torch.randn(256, 64)
    calls = []

    def step() -> torch.Tensor:
        calls.append(torch.is_autocast_enabled("cpu"))
        return model(x).float().logsumexp(-1).sum()

    state = torch.get_rng_state()
    speedup = device_module.bf16_step_speedup(model, step)
    assert speedup > 0 and math.isfinite(speedup)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert calls == [False, True] * 3  # a warm-up each, then two timed each, alternating


@pytest.mark.parametrize(
    ("first", "then"), [(2.5, 1.2), (1.2, 2.5)], ids=["bf16 run, fp32 timing", "fp32 run, bf16 timing"]
)
def test_auto_precision_on_cpu_goes_on_as_the_run_was_trained(
    tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch, first: float, then: float
) -> None:
    """The bf16 timing decides a run's precision once: a resume keeps it (stop 54: a busy machine
    timed 0.82x on resume and a bf16 run went on in fp32), where the CPU has native bf16."""
    run = tmp_path / "run"
    base = ["--set", "train.device=cpu", "--set", "train.amp=auto", "--set", "train.eval_every=1000"]
    monkeypatch.setattr(device_module, "cpu_bf16_speedup", lambda: first)
    passes: list[float] = []
    monkeypatch.setattr(device_module, "bf16_step_speedup", lambda model, step: passes.append(2.0) or 2.0)
    assert main(tiny_args(small_data, run, *base, "--set", "train.max_steps=2")) == 0
    trained = "bf16" if first >= BF16_MIN_SPEEDUP else "fp32"
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["cpu_amp"] == trained
    log_text = (run / "train.log").read_text()
    if trained == "bf16":  # the model's pass timed where the products were fast, and said
        assert passes == [2.0] and f"bf16 products {first:.2f}x as fast as fp32 on this CPU, this model's " in log_text
        assert "training pass 2.00x)" in log_text
    else:
        assert passes == [] and "training pass" not in log_text
    monkeypatch.setattr(device_module, "cpu_bf16_speedup", lambda: then)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=3"]) == 0
    resumed = (run / "train.log").read_text().split(" INFO done: ")[1]  # the resumed session's lines
    assert f"train.amp auto: going on in {trained}, as the run was trained" in resumed
    assert ("precision bfloat16" in resumed) == (trained == "bf16")
    # the timing printed beside the kept precision, not as what chose it (stop 55)
    assert f"(train.amp auto: as the run was trained; bf16 products {then:.2f}x as fast as fp32" in resumed
    assert len(passes) == (trained == "bf16")  # a resume goes on as trained: it does not time the pass again
    # without native bf16 (emulated, many times slower) a bf16 run goes on in fp32
    monkeypatch.setattr(device_module, "cpu_bf16_speedup", lambda: 0.0)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]) == 0
    assert "precision fp32" in (run / "train.log").read_text().split(" INFO done: ")[2]


@pytest.mark.parametrize(
    "regulariser", [["train.rdrop=1.0"], ["train.word_dropout=0.2", "train.tgt_word_dropout=0.1"]], ids=str
)
def test_regularised_training_learns(
    tmp_path: Path, small_data: Path, regulariser: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training with R-Drop or word dropout learns, and each step applies the configured one
    (R-Drop's loss with its weight; word dropout at its rates on both sides)."""
    calls: list[tuple[str, float]] = []
    rdrop, words = loss_module.rdrop_loss, train_module.drop_words

    def recording_rdrop(*args: object, alpha: float, **kwargs: object) -> torch.Tensor:
        calls.append(("rdrop", alpha))
        return rdrop(*args, alpha=alpha, **kwargs)

    def recording_words(ids: torch.Tensor, p: float) -> torch.Tensor:
        calls.append(("words", p))
        return words(ids, p)

    monkeypatch.setattr(loss_module, "rdrop_loss", recording_rdrop)
    monkeypatch.setattr(train_module, "drop_words", recording_words)
    run = tmp_path / "run"
    extra = ["train.max_steps=80", "train.eval_every=80", "train.log_every=20", *regulariser]
    assert main(tiny_args(small_data, run, *[a for s in extra for a in ("--set", s)])) == 0
    assert _final_loss(run) < 5.5  # it learned (starts near ln(1000) = 6.9), R-Drop's KL term included
    if "train.rdrop=1.0" in regulariser:
        assert len(calls) >= 80 and set(calls) == {("rdrop", 1.0)}  # every step's loss
    else:
        assert len(calls) >= 160 and set(calls) == {("words", 0.2), ("words", 0.1)}  # source and target


def test_word_dropout_replaces_pieces_by_unk_and_keeps_special_ids() -> None:
    torch.manual_seed(0)
    ids = torch.randint(4, 1000, (200, 50))
    ids[:, 0], ids[:, -1], ids[:, -5:-1] = BOS, EOS, PAD
    assert drop_words(ids, 0.0) is ids
    dropped = drop_words(ids, 0.3)
    changed = dropped != ids
    assert (dropped[changed] == UNK).all()
    assert not changed[:, [0, -5, -4, -3, -2, -1]].any()  # BOS, padding and EOS stay
    assert changed.float().mean().item() == pytest.approx(0.3 * 44 / 50, abs=0.01)
    assert (ids > UNK)[:, 1:-5].all()  # the input itself is unchanged


def test_time_budget_stops_early_then_validates_and_saves(tmp_path: Path, small_data: Path) -> None:
    run = tmp_path / "budget"
    extra = ("--set", "train.max_steps=100000", "--set", "train.eval_every=100000", "--set", "train.max_minutes=0.002")
    assert main(tiny_args(small_data, run, *extra, "--set", "train.log_every=1000")) == 0
    log_text = (run / "train.log").read_text()
    assert "used the time budget train.max_minutes=0.002" in log_text
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = torch.load(run / "checkpoints" / "last.pt", weights_only=False)["step"]
    assert 0 < step < 100000
    assert (run / "checkpoints" / "best.pt").is_file()  # the final validation ran and kept a best model
    assert all(e["step"] <= step for e in events)
    assert [e["step"] for e in events if e["event"] == "valid"] == [step]  # the last step, recorded for mtx plot
    assert [e["step"] for e in events if e["event"] == "train"][-1] == step  # its last steps' loss too (stop 56)
    assert_resume_trains_nothing(run, "train.max_minutes=0.002")


def assert_resume_trains_nothing(run: Path, limit: str) -> None:
    """`--resume` of a run that ended on `limit` changes none of its files but train.log (stop 53:
    it trained and validated again, a step per resume on a time budget, and a repeated validation
    counted toward patience)."""
    files = sorted(p for p in run.rglob("*") if p.is_file() and p.name != "train.log")
    before = [p.read_bytes() for p in files]
    # a --set too: config.yaml records it only once it takes effect (stop 55: it was rewritten)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "decode.beam=1"]) == 0
    assert [p.read_bytes() for p in files] == before
    assert sorted(p for p in run.rglob("*") if p.is_file() and p.name != "train.log") == files
    assert f"done: the run already reached {limit}" in (run / "train.log").read_text()


def test_max_epochs_stops_at_an_epoch_boundary(tmp_path: Path, mini_data: Path) -> None:
    run = tmp_path / "epochs"
    extra = ["--set", "train.max_steps=100000", "--set", "train.max_epochs=1", "--set", "train.eval_sentences=5"]
    assert main(tiny_args(mini_data, run, *extra)) == 0
    last = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    assert (last["state"]["epoch"], last["state"]["batch"]) == (1, 0) and 0 < last["step"] < 100
    assert "done: reached train.max_epochs=1" in (run / "train.log").read_text()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"][-1] == last["step"]  # stop 56: was unlogged
    # the last train record and the validation carry the epoch trained (stop 65: epoch 1, which never ran)
    assert {e["epoch"] for e in events} == {0} and events[-1]["event"] == "valid"
    assert_resume_trains_nothing(run, "train.max_epochs=1")


def test_a_phases_end_line_gives_the_share_of_the_budget_used(tmp_path: Path, mini_data: Path) -> None:
    """The line read "train.bidirectional=0.3 of the budget used at step 18", though 18 of the 20
    steps had been used: a phase holds whole epochs, so it may cover more than its fraction (stop 65)."""
    run = tmp_path / "run"
    both = ["--set", "train.bidirectional=0.3", "--set", "train.max_steps=20", "--set", "train.eval_sentences=5"]
    assert main(tiny_args(mini_data, run, *both)) == 0
    line = re.search(
        r"epoch 1: de->en only from here on \(train\.bidirectional=0\.3; (\d\.\d\d) of the budget used at step (\d+)\)",
        (run / "train.log").read_text(),
    )
    assert line is not None and float(line[1]) == round(int(line[2]) / 20, 2) > 0.3
    # and the start says the first epochs train both ways (stop 65: "N training pairs" alone)
    start = "train.bidirectional=0.3: epochs train en->de too, twice the pairs, until 0.3 of the budget is used"
    assert start in (run / "train.log").read_text()


def test_settings_that_train_otherwise_than_they_read_are_warned_of(tmp_path: Path, mini_data: Path) -> None:
    """A linear rate counts train.max_steps, which train.max_epochs may never reach (stop 65: the
    run ended at 0.96 of the peak rate without a word), and a dropout ramp from above model.dropout
    falls; once each, at the start, and not where they do not apply."""
    run = tmp_path / "run"
    settings = ["train.schedule=linear", "train.max_epochs=1", "train.max_steps=1000", "train.eval_sentences=5"]
    settings += ["model.dropout=0", "train.dropout_warmup=100", "train.dropout_start=0.2"]
    assert main(tiny_args(mini_data, run, *(arg for s in settings for arg in ("--set", s)))) == 0
    steps = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"]
    log = (run / "train.log").read_text()
    assert (
        f"train.max_epochs=1 ends the run by about step {steps}, before train.max_steps=1000, the budget of "
        "train.schedule linear: the rate does not decay to zero; set train.max_steps" in log
    )
    assert "train.dropout_start 0.2 is above model.dropout 0: the dropout rate falls from 0.2 to 0" in log
    # the steps end first, and the dropout ramp starts from 0
    resume = ["train", "--run-dir", str(run), "--resume", "--set", "train.max_epochs=3"]
    assert main([*resume, "--set", f"train.max_steps={steps + 2}", "--set", "train.dropout_start=0"]) == 0
    log = (run / "train.log").read_text()
    assert log.count("ends the run by about step") == 1 and log.count("the dropout rate falls") == 1


def test_logged_throughput_leaves_out_validation_and_elapsed_time_counts_it(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a clock where a step takes 1 s and a validation 100 s: every logged tgt_tok_per_s is
    its window's tokens over 2 s (stop 53: the window after a validation counted it, so one log
    in four of the shipped configs was slowed down), and elapsed_s counts each validation when it
    ends (it came one step late, and the last one never)."""
    clock = [0.0]
    # the loop's clock (PauseClock) reads it
    monkeypatch.setattr(clock_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    tokens: list[int] = []
    step, validate = train_module.Trainer.train_step, train_module.Trainer.validate

    def timed_step(self: train_module.Trainer, group: object) -> tuple[float, int, bool]:
        loss, n, applied = step(self, group)
        clock[0] += 1.0
        tokens.append(n)
        return loss, n, applied

    def timed_validation(self: train_module.Trainer) -> dict[str, float]:
        clock[0] += 100.0
        return validate(self)

    monkeypatch.setattr(train_module.Trainer, "train_step", timed_step)
    monkeypatch.setattr(train_module.Trainer, "validate", timed_validation)
    sets = ["train.max_steps=8", "train.log_every=2", "train.eval_every=3", "train.eval_sentences=5", "train.amp=fp32"]
    run = tmp_path / "run"
    assert main(tiny_args(mini_data, run, *[a for s in sets for a in ("--set", s)], "--set", "train.device=cpu")) == 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logs = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in logs] == [2, 4, 6, 8]
    for e in logs:
        assert e["tgt_tok_per_s"] == pytest.approx(sum(tokens[e["step"] - 2 : e["step"]]) / 2.0)
        assert e["elapsed_s"] == pytest.approx(e["step"] + 100.0 * ((e["step"] - 1) // 3))  # validations before
    valid = [(e["step"], e["elapsed_s"]) for e in events if e["event"] == "valid"]
    assert valid == [(3, 3.0), (6, 106.0), (8, 208.0)]  # each recorded as its validation starts
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["state"]["elapsed"] == 308.0


def test_patience_stops_when_val_bleu_stops_improving(tmp_path: Path, small_data: Path) -> None:
    run = tmp_path / "patience"
    # an lr of 1e-12 leaves the model, hence val BLEU, unchanged: the 2nd validation brings no gain
    extra = ["--set", "train.max_steps=1000", "--set", "train.eval_every=2", "--set", "train.patience=1"]
    assert main(tiny_args(small_data, run, *extra, "--set", "train.lr=1e-12", "--set", "train.eval_sentences=20")) == 0
    assert "no val BLEU gain in 1 evaluations (train.patience)" in (run / "train.log").read_text()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "valid"] == [2, 4]
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=False)["step"] == 4
    assert_resume_trains_nothing(run, "train.patience=1")


def test_patience_decides_as_a_straight_run_when_the_run_is_trained_in_parts(tmp_path: Path, small_data: Path) -> None:
    """The validation a run makes where it ends between two of the cadence counted toward patience:
    a run trained to step 3 and resumed to 1000 said it had ended on patience at step 3, and
    refused to train on, where the straight run of test_patience_... stops at 4 (stop 62)."""
    run = tmp_path / "parts"
    extra = ["--set", "train.eval_every=2", "--set", "train.patience=1", "--set", "train.lr=1e-12"]
    extra += ["--set", "train.eval_sentences=20"]
    assert main(tiny_args(small_data, run, *extra, "--set", "train.max_steps=3")) == 0
    assert "done: reached train.max_steps=3, at step 3" in (run / "train.log").read_text()
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=1000"]) == 0
    assert "no val BLEU gain in 1 evaluations (train.patience), at step 4" in (run / "train.log").read_text()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "valid"] == [2, 3, 4]


def test_init_from_starts_a_new_run_from_another_runs_weights_and_tokenizer(
    tmp_path: Path, small_data: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.init_from: the other run's best.pt weights and a copy of its tokenizer, step 0, a fresh
    optimizer; through `mtx train` it trains on from the other run's loss, not from scratch."""
    from mtx.config import load_config
    from mtx.plot import read_metrics
    from mtx.rundir import prepare_run_dir
    from mtx.train import Trainer

    from .conftest import TINY_CONFIG

    run_dir = tmp_path / "ft"
    cfg = load_config(TINY_CONFIG, [f"data.dir={small_data}", f"train.init_from={tiny_run}"])
    prepare_run_dir(run_dir, cfg, resume=False)
    assert (run_dir / "tokenizer.json").read_bytes() == (tiny_run / "tokenizer.json").read_bytes()
    trainer = Trainer(cfg, run_dir, resume=False)
    best = torch.load(tiny_run / "checkpoints" / "best.pt", weights_only=True)["model"]
    assert trainer.model.state_dict().keys() == best.keys()
    assert all(torch.equal(v, best[k]) for k, v in trainer.model.state_dict().items())
    assert trainer.state.step == 0 and not trainer.optimizer.state  # the optimizer starts afresh

    ft = tmp_path / "ft_cli"
    monkeypatch.chdir(tiny_run.parent)  # given relative, recorded as the checkpoint used (it was as typed)
    args = tiny_args(small_data, ft, "--set", f"train.init_from={tiny_run.name}", "--set", "train.max_steps=20")
    assert main([*args, "--set", "train.eval_every=20"]) == 0
    best_step = torch.load(tiny_run / "checkpoints" / "best.pt", weights_only=True)["step"]
    used = tiny_run.resolve() / "checkpoints" / "best.pt"
    assert f"initialised from {used} (its step {best_step})" in (ft / "train.log").read_text()
    assert load_config(ft / "config.yaml").train.init_from == str(used)
    first = [e["loss"] for e in read_metrics(ft) if e["event"] == "train"][0]
    scratch = [e["loss"] for e in read_metrics(tiny_run) if e["event"] == "train"]
    assert first < scratch[0] - 1.5 and first < scratch[-1] + 0.5, (first, scratch)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.init_from={tmp}/nowhere"], "{tmp}/nowhere not found"),
        (["train.init_from={run}/config.yaml"], "config.yaml is a file outside a run's checkpoints/"),
        (["train.init_from={run}/checkpoints"], "is a run's checkpoints directory; give the run directory ({run})"),
        # (stop 69's review: "train it first" of a directory that is no run)
        (["train.init_from={tmp}"], "{tmp} is not a run directory (no config.yaml) nor a checkpoint"),
        (["train.init_from={run}", "model.d_model=32"], "was trained with model.d_model=64, this config has 32"),
        (["train.init_from={run}", "data.src_lang=en", "data.tgt_lang=de"], "was trained with data.src_lang='de'"),
        (["train.init_from={run}", "tokenizer.vocab_size=900"], "tokenizer.vocab_size=1000"),
    ],
)
def test_init_from_mistakes_are_one_line_and_write_nothing(
    tmp_path: Path, small_data: Path, tiny_run: Path, sets: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .test_cli import assert_one_line_error, mtx_here

    extra = [x for s in sets for x in ("--set", s.format(tmp=tmp_path, run=tiny_run))]
    result = mtx_here(monkeypatch, *tiny_args(small_data, tmp_path / "ft", *extra))
    assert_one_line_error(result, "train.init_from: ", message.format(tmp=tmp_path, run=tiny_run))
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("existed", [False, True])
def test_a_start_whose_config_cannot_be_written_leaves_nothing(
    tmp_path: Path, small_data: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch, existed: bool
) -> None:
    """A new run whose config.yaml could not be written (a full disk) kept the tokenizer it had
    copied for train.init_from, and the next start refused the directory as "not an mtx run"."""
    from mtx import checkpoint as ckpt_io

    from .test_cli import assert_one_line_error, mtx_here

    write = ckpt_io.atomic_write_text

    def full_disk(path: Path, text: str) -> None:
        if path.name == "config.yaml":
            raise OSError(28, "No space left on device", str(path))
        write(path, text)

    monkeypatch.setattr(ckpt_io, "atomic_write_text", full_disk)
    run = tmp_path / "out" / "ft"
    if existed:
        run.mkdir(parents=True)
    result = mtx_here(monkeypatch, *tiny_args(small_data, run, "--set", f"train.init_from={tiny_run}"))
    assert_one_line_error(result, f"{run / 'config.yaml'}: No space left on device")
    assert (list(run.iterdir()) == []) if existed else not (tmp_path / "out").exists()


def test_init_from_a_path_relative_to_the_working_directory(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`best.pt` given inside RUN/checkpoints was taken for a file outside a run's checkpoints/:
    the run and its checkpoint are found where the path leads, however it is written."""
    from mtx.config import load_config
    from mtx.rundir import init_source

    from .conftest import TINY_CONFIG

    run, best = tiny_run.resolve(), tiny_run.resolve() / "checkpoints" / "best.pt"
    for cwd, init_from in (
        (run / "checkpoints", "best.pt"),
        (run / "checkpoints", "../checkpoints/best.pt"),
        (run, "."),
    ):
        monkeypatch.chdir(cwd)
        assert init_source(load_config(TINY_CONFIG, [f"train.init_from={init_from}"])) == (run, best), init_from


def test_train_threads_beyond_the_cpus_warn_and_use_the_cpus(caplog: pytest.LogCaptureFixture) -> None:
    """A config's train.threads may come from a bigger machine: a warning, not an error, and not
    the 100,000 OpenMP threads that crashed `mtx translate --threads`."""
    from mtx.threads import usable_cpus

    cpus = usable_cpus()
    with caplog.at_level("WARNING", logger="mtx.train"):
        assert train_module._thread_count(1) == 1 and not caplog.records
        assert train_module._thread_count(100_000) == cpus
    assert f"train.threads=100000 is more than the {cpus} CPUs here" in caplog.text


def test_training_clips_the_gradient_and_updates_at_the_scheduled_rate(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `mtx train`: `train.clip_norm` scales each step's gradient down to that norm
    (never up; 0: no clipping), and each update runs at the schedule's rate for its own
    (1-based) step, warmup included."""
    from mtx.config import load_config

    from .conftest import TINY_CONFIG

    seen: list[tuple[float, float]] = []  # (gradient norm, learning rate) at each update
    make = train_module.make_optimizer

    def recording(*args: object, **kwargs: object) -> torch.optim.Optimizer:
        optimizer = make(*args, **kwargs)

        def record(opt: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
            grads = [p.grad.norm() for group in opt.param_groups for p in group["params"] if p.grad is not None]
            seen.append((float(torch.linalg.vector_norm(torch.stack(grads))), opt.param_groups[0]["lr"]))

        optimizer.register_step_pre_hook(record)
        return optimizer

    monkeypatch.setattr(train_module, "make_optimizer", recording)

    def first_steps(clip: float) -> tuple[list[float], list[float]]:
        seen.clear()
        sets = ["model.dropout=0.0", "train.max_steps=3", f"train.clip_norm={clip}", "train.eval_sentences=5"]
        sets += ["train.device=cpu", "train.amp=fp32"]
        args = tiny_args(mini_data, tmp_path / f"clip{clip}", *[a for s in sets for a in ("--set", s)])
        assert main(args) == 0
        return [n for n, _ in seen], [lr for _, lr in seen]

    free, rates = first_steps(0.0)
    tc = load_config(TINY_CONFIG).train
    assert rates == pytest.approx([learning_rate(k, tc, 64) for k in (1, 2, 3)], rel=1e-12)
    assert rates[0] < rates[1] < rates[2] <= tc.lr  # warming up from the first update on
    assert free[0] > 0.05  # a gradient worth clipping
    clipped, _ = first_steps(free[0] / 10)
    assert clipped[0] == pytest.approx(free[0] / 10, rel=1e-5)  # the same first gradient, scaled down
    assert all(n <= free[0] / 10 * (1 + 1e-5) for n in clipped)
    loose, _ = first_steps(free[0] * 10)
    assert loose[0] == pytest.approx(free[0], rel=1e-6)  # below the bound: untouched


def test_the_datas_warnings_reach_train_log(tmp_path: Path, mini_data: Path) -> None:
    """Logged as the data is read, before train.log is opened, they reached standard error only:
    the run's record did not say which of two files it trained on (stop 62)."""
    data = tmp_path / "data"
    shutil.copytree(mini_data, data)
    plain = data / "train.de"
    (data / f"{plain.name}.gz").write_bytes(gzip.compress(plain.read_bytes()))
    run = tmp_path / "run"
    assert main(tiny_args(data, run, "--set", "train.max_steps=2", "--set", "train.eval_sentences=5")) == 0
    assert f"both {plain.name} and {plain.name}.gz are here; reading {plain.name}" in (run / "train.log").read_text()


def test_resume_takes_eval_sentences_that_pick_the_same_val_pairs(tmp_path: Path, mini_data: Path) -> None:
    """5,000 and 0 (all) of 30 val pairs are the same pairs: the resume was refused (stop 62)."""
    run = tmp_path / "run"
    assert main(tiny_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_sentences=5000")) == 0
    resume = ["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]
    assert main([*resume, "--set", "train.eval_sentences=0"]) == 0
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == 4


def test_a_resume_trains_on_with_the_adam_settings_it_was_given(tmp_path: Path, mini_data: Path) -> None:
    """torch's load_state_dict put back the saved betas, eps and weight decay: a resume's --set of
    them was written to config.yaml and never used (stop 64)."""
    run = tmp_path / "run"
    assert main(tiny_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.optimizer=adamw")) == 0
    changes = ["train.weight_decay=0.05", "train.adam_betas=[0.8, 0.9]", "train.adam_eps=1e-6"]
    resume = ["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]
    assert main([*resume, *(arg for change in changes for arg in ("--set", change))]) == 0
    groups = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in groups] == [
        ((0.8, 0.9), 1e-6, 0.05),
        ((0.8, 0.9), 1e-6, 0.0),  # AdamW's biases and norm gains stay undecayed
    ]
    log = (run / "train.log").read_text()
    assert "train.weight_decay: 0.0 until step 2, 0.05 from now on" in log
    assert "train.adam_betas: [0.9, 0.98] until step 2, [0.8, 0.9] from now on" in log


def test_a_resume_logs_every_key_it_changes(tmp_path: Path, mini_data: Path) -> None:
    """Only the Adam settings were logged; config.yaml, rewritten with the new values, read as if
    the whole run had trained with them (stop 65)."""
    run = tmp_path / "run"
    assert main(tiny_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_sentences=5")) == 0
    changes = ["train.lr=0.01", "train.label_smoothing=0.3", "model.dropout=0.4", "train.schedule=linear"]
    resume = ["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=3"]
    assert main([*resume, *(arg for change in changes for arg in ("--set", change))]) == 0
    log = (run / "train.log").read_text().splitlines()
    lines = [line.split(" INFO ", 1)[1] for line in log if "from now on" in line]
    assert lines == [
        "model.dropout: 0.1 until step 2, 0.4 from now on",
        "train.max_steps: 2 until step 2, 3 from now on",
        "train.lr: 0.003 until step 2, 0.01 from now on",
        "train.schedule: 'inverse_sqrt' until step 2, 'linear' from now on",
        "train.label_smoothing: 0.1 until step 2, 0.3 from now on",
    ]
    # a resume with nothing left to train changes nothing, and says so rather than "from now on"
    # (stop 66: the lines were logged, config.yaml kept the old values, and the next resume used them)
    config = (run / "config.yaml").read_text()
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.lr=0.02"]) == 0
    assert (run / "config.yaml").read_text() == config
    log = (run / "train.log").read_text().splitlines()
    assert not any("0.02 from now on" in line for line in log) and log[-1].endswith(
        "done: the run already reached train.max_steps=3, at step 3; raise it to train on "
        "(the --set changes were not applied: the run keeps its config.yaml)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_a_device_that_is_not_here_is_refused_before_the_data_is_sought(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train.device: cuda` on a machine without CUDA started the whole Multi30k download before it
    was refused (stop 62): here $MTX_DATA_DIR lacks the files, which would be said first."""
    monkeypatch.setenv("MTX_DATA_DIR", str(tmp_path))
    argv = ["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(tmp_path / "run")]
    assert main([*argv, "--set", "train.device=cuda"]) == 1
    assert "cuda requested but no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_metrics_record_cut_short_by_a_full_disk_is_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk tore metrics.jsonl's last line, which broke JSON Lines readers (stop 63)."""
    import os

    path = tmp_path / "metrics.jsonl"
    with path.open("a", encoding="utf-8") as metrics:
        runlog_module.append_record(metrics, {"event": "train", "step": 1})
        write = os.write
        monkeypatch.setattr(os, "write", lambda fd, data: write(fd, data[:10]))  # the disk fills midway
        with pytest.raises(OSError, match="No space left on device") as full:
            runlog_module.append_record(metrics, {"event": "train", "step": 2})
        assert full.value.filename == str(path)
    assert path.read_text(encoding="utf-8") == '{"event": "train", "step": 1}\n'


def test_validation_scores_references_as_mtx_eval_reads_them(
    tmp_path: Path,
    small_data: Path,
    tiny_run: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """stop 64: training's val BLEU scored references stripped of invisible ends (a left-to-right
    mark before each line), while `mtx eval` scores them as sacreBLEU reads the file: two val BLEUs
    for one checkpoint. Now the same references as eval's, with its warning; the val loss keeps the
    cleaned targets."""
    from mtx.config import load_config
    from mtx.evaluate import corpus_scores
    from mtx.rundir import prepare_run_dir
    from mtx.train import Trainer

    from .conftest import TINY_CONFIG

    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    clean = (small_data / "val.en").read_text(encoding="utf-8").splitlines()[:100]
    (data / "val.en").write_text("".join(f"\u200e{line}\n" for line in clean), encoding="utf-8")
    sources = (small_data / "val.de").read_text().splitlines()[:100]
    # the sources read as `mtx eval` reads them (decode.normalize_spaces: stop 72), quotes too
    # (decode.normalize_punctuation: stop 73; the slice's train.de has `"` twice, `“` 20 times)
    quoted = [f'"{line}"' if i % 2 else line for i, line in enumerate(sources)]
    (data / "val.de").write_text("".join(line.replace(" ", "\u00a0 ", 1) + "\n" for line in quoted))
    cfg = load_config(TINY_CONFIG, [f"data.dir={data}", f"train.init_from={tiny_run}", "train.eval_sentences=0"])
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, cfg, resume=False)
    trainer = Trainer(cfg, run_dir, resume=False)
    assert f"{data / 'val.en'}: 100 of 100 reference lines begin or end with invisible characters" in caplog.text
    assert trainer.valid_ids.tgt_ids == trainer.tgt_tok.encode_batch(clean)  # the val loss's targets
    read = [line.replace('"', "\u201c") for line in quoted]
    assert trainer.valid_ids.src_ids == trainer.src_tok.encode_batch(read, one_space=True)  # (val.de's 120\xa0cm)
    train_de = (data / "train.de").read_text(encoding="utf-8").splitlines()
    assert load_folds(run_dir, "de") == folds(punctuation_counts(train_de)) == trainer.folds
    assert load_folds(run_dir, "de")['"'] == "\u201c" and not load_folds(run_dir, "en")  # (counts of de)
    outputs = []

    def recorded(*args: object, **options: object) -> list[str]:
        outputs.append(translate(*args, **options))
        return outputs[-1]

    translate = train_module.translate
    monkeypatch.setattr(train_module, "translate", recorded)
    scores = trainer.validate()
    marked = corpus_scores(outputs[0], [f"\u200e{line}" for line in clean])
    assert scores is not None and scores["val_bleu"] == marked.bleu and scores["val_chrf"] == marked.chrf
    assert marked.bleu < corpus_scores(outputs[0], clean).bleu  # the test tells the two apart


def test_progress_bar_time_left_ends_with_the_time_budget() -> None:
    """stop 64: with train.max_minutes the bar's time left counted to train.max_steps (1:29:32 left
    in a run whose budget ended 15 s later). It is at most what the budget leaves, and tqdm's own
    estimate where max_steps comes first."""
    import io

    from mtx.runlog import progress_bar

    options = {"file": io.StringIO(), "mininterval": 0, "unit": "step", "ncols": 120}
    bar = progress_bar(lambda: 30.0, total=2**50, **options)  # max_steps out of reach in 30 s at any rate
    bar.update(10)
    bar.set_postfix(loss="4.000")
    assert "10/1125899906842624 [00:00<00:30, " in str(bar) and "loss=4.000" in str(bar), str(bar)
    bar = progress_bar(lambda: 3600.0, total=10, **options)  # max_steps reached first: nothing left
    bar.update(10)
    assert "10/10 [00:00<00:00, " in str(bar), str(bar)
    bar = progress_bar(lambda: -5.0, total=2**50, **options)  # the budget used: never a negative time
    bar.update(1)
    assert "<00:00, " in str(bar), str(bar)


def test_the_val_digest_tells_apart_references_that_score_differently() -> None:
    """Invisible ends move BLEU and count (stop 65: they passed as the same val data); whitespace
    ends do not, and keep the digest runs saved before (Multi30k's val.fr has lines that start
    with a space: a first fix refused the resume of every en->fr run)."""
    src, tgt = ["Ein Hund.", "Zwei Hunde."], ["A dog.", "Two dogs."]
    plain = rundir_module.val_digest(Config(), src, tgt, tgt)
    assert plain == rundir_module.data_digest(src, tgt)
    assert rundir_module.val_digest(Config(), src, tgt, [" A dog.", "Two dogs.\u00a0 "]) == plain
    assert rundir_module.val_digest(Config(), src, tgt, ["A dog.\u200b", "Two dogs."]) != plain


def test_the_training_clock_leaves_out_a_stopped_process(tmp_path: Path) -> None:
    """Ctrl-Z or `kill -STOP` of `mtx train` spent its train.max_minutes budget: a run stopped for
    40 s of a 30 s budget trained 167 steps of its 553, and its linear rate ended at 73% of the
    peak (stop 68's probe). The loop's clock stands still while the process is stopped."""
    # (mtx.clock imports no torch: the child starts in a tenth of a second; its stops are told from
    # a busy GIL by a gap of 1 s here, 5 s in training)
    child = (
        "import time\n"
        "from mtx.clock import PauseClock\n"
        "PauseClock.GAP = 1.0\n"
        "with PauseClock() as clock:\n"
        "    start, wall = clock.now(), time.perf_counter()\n"
        "    print('ready', flush=True)\n"
        "    while time.perf_counter() - wall < 4:\n"
        "        time.sleep(0.01)\n"
        "    print(round(clock.now() - start, 2), flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(0.5)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        proc.send_signal(signal.SIGCONT)
        counted = float(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert 1.0 < counted < 2.2, counted  # 4 s of wall time, 2.5 of them stopped


def test_timing_bf16_draws_nothing_from_torchs_generator() -> None:
    """`train.amp: bf16` timed bf16 products after a resume had restored last.pt's random state, and
    the timing's random inputs moved every later dropout mask off a straight run's (stop 68's
    probe: step 60's loss 5.369212 against 5.368715). (A CPU without native bf16 times nothing.)"""
    state = torch.get_rng_state()
    device_module.cpu_bf16_speedup.__wrapped__()
    assert torch.equal(torch.get_rng_state(), state)


def test_a_resume_without_last_pt_suggests_best_pt_else_the_newest_step(tmp_path: Path) -> None:
    """The new run to start from a run that lost last.pt: best.pt, else the newest step_N.pt by its
    number (stop 69's probe: directory order named step_30.pt where step_40.pt was there)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text("")
    for name in ("step_30.pt", "step_100.pt", "step_20.pt", "mine.pt"):
        (run / "checkpoints" / name).write_bytes(b"")

    def suggested() -> str:
        with pytest.raises(MtxError, match="cannot resume: checkpoints/last.pt is missing") as refused:
            rundir_module.check_run_dir(run, resume=True)
        return str(refused.value).rsplit("train.init_from=", 1)[1]

    assert suggested() == str(run / "checkpoints" / "step_100.pt")
    (run / "checkpoints" / "best.pt").write_bytes(b"")
    assert suggested() == str(run / "checkpoints" / "best.pt")


# -- stop 69's second mutation probe: behaviour no test pinned ------------------------------------


def _trainer(tmp_path: Path, mini_data: Path, *sets: str) -> train_module.Trainer:
    run = tmp_path / "run"
    common = ["train.max_steps=1", "train.eval_sentences=5", "train.device=cpu", "train.amp=fp32", "model.dropout=0.0"]
    args = tiny_args(mini_data, run, *[a for s in (*common, *sets) for a in ("--set", s)])
    assert main(args) == 0
    return train_module.Trainer(load_config(run / "config.yaml"), run, resume=True)


def _update_of(trainer: train_module.Trainer, group: list) -> tuple[list[torch.Tensor], float, int]:
    """The gradient (after clipping) an update of `group` applies, and train_step's loss and tokens."""
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    seen: list[list[torch.Tensor]] = []
    handle = trainer.optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.append([p.grad.detach().clone() for g in opt.param_groups for p in g["params"]])
    )
    try:
        loss, tokens, applied = trainer.train_step(group)
    finally:
        handle.remove()
        trainer.model.load_state_dict(weights)  # the next call starts from the same weights
    assert applied
    return seen[0], loss, tokens


def test_accumulated_micro_batches_give_the_gradient_of_their_union(tmp_path: Path, mini_data: Path) -> None:
    """train.accum_steps: an update of micro-batches of different target lengths has the gradient
    (and per-token loss) of one batch of all their sentences, every target token weighted alike;
    normalising each micro-batch by its own tokens weights a short batch's tokens more."""
    trainer = _trainer(tmp_path, mini_data, "train.clip_norm=0")
    ids = trainer.pairs.train_ids
    order = np.argsort(ids.tgt_lens)
    short, long = list(order[:3]), list(order[-12:])  # few short targets, many long ones
    whole_grad, whole_loss, whole_tokens = _update_of(trainer, [ids.batch(short + long)])
    parts_grad, parts_loss, parts_tokens = _update_of(trainer, [ids.batch(short), ids.batch(long)])
    assert parts_tokens == whole_tokens == int(ids.tgt_lens[short + long].sum())
    assert parts_loss == pytest.approx(whole_loss, rel=1e-5)
    for a, b in zip(whole_grad, parts_grad, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_validation_loss_is_plain_cross_entropy_per_target_token(tmp_path: Path, mini_data: Path) -> None:
    """README: a valid record's val_loss is plain (unsmoothed) cross-entropy per target token."""
    trainer = _trainer(tmp_path, mini_data, "train.label_smoothing=0.3")
    result = trainer.validate()
    model = trainer.model.eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for i in trainer.valid_loss_rows:
            batch = trainer.valid_ids.batch([i])
            logits = model(batch.src, batch.tgt_in)  # (1, T, V)
            nll += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), model.output_columns(batch.tgt_out).flatten(), reduction="sum"
            ).item()
            tokens += batch.n_tgt_tokens
    assert result is not None and result["val_loss"] == pytest.approx(nll / tokens, rel=1e-4)


@pytest.mark.parametrize("src_p, tgt_p", [(0.5, 0.0), (0.0, 0.5)])
def test_word_dropout_hits_its_own_side_and_never_the_targets_the_loss_scores(
    tmp_path: Path, mini_data: Path, src_p: float, tgt_p: float
) -> None:
    """train.word_dropout replaces source pieces by UNK, train.tgt_word_dropout the decoder's
    input pieces; the target pieces the loss scores (tgt_out) are never replaced."""
    from mtx.tokenizer import UNK

    trainer = _trainer(tmp_path, mini_data, f"train.word_dropout={src_p}", f"train.tgt_word_dropout={tgt_p}")
    seen = []
    real = trainer.loss_module.forward
    trainer.loss_module.forward = lambda batch: (seen.append(batch), real(batch))[1]
    ids = trainer.pairs.train_ids
    batch = ids.batch(list(range(40)))
    trainer.train_step([batch])
    (used,) = seen
    src_unk, tgt_unk = (used.src == UNK).float().mean().item(), (used.tgt_in == UNK).float().mean().item()
    assert (src_unk > 0.2) == (src_p > 0) and (tgt_unk > 0.2) == (tgt_p > 0)
    assert (src_unk == 0) == (src_p == 0) and (tgt_unk == 0) == (tgt_p == 0)
    assert torch.equal(used.tgt_out, batch.tgt_out)


# -- stop 69's third mutation probe: the training loop's untested behaviour ------------------------


def test_each_update_trains_at_the_dropout_its_step_is_documented_to_have(tmp_path: Path, mini_data: Path) -> None:
    """train.dropout_warmup: update 1 runs at train.dropout_start and update dropout_warmup at
    model.dropout (dropout_rate's docstring), so update k's forward passes see dropout_rate(k)."""
    trainer = _trainer(tmp_path, mini_data, "model.dropout=0.3", "train.dropout_warmup=4", "train.dropout_start=0.0")
    drops = [m for m in trainer.model.modules() if isinstance(m, Dropout) and not m.fixed]
    assert drops
    seen: list[float] = []
    real = trainer.loss_module.forward
    trainer.loss_module.forward = lambda batch: (seen.append(drops[0].p), real(batch))[1]
    batch = trainer.pairs.train_ids.batch(list(range(8)))
    trainer.state.step = 0  # from the first update
    for _ in range(5):
        trainer.train_step([batch])
        trainer.state.step += 1  # as the loop counts an applied update
    assert seen == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.3], abs=1e-4)


def test_a_finite_loss_with_a_non_finite_gradient_is_skipped_and_leaves_weights_and_average(
    tmp_path: Path, mini_data: Path
) -> None:
    """A step whose loss is finite but whose gradient is not (an overflow in the backward pass) is
    a non-finite step: not applied (the weights stay as they were, finite), and the moving
    average (train.ema: "after every applied update") neither moves nor counts it."""
    trainer = _trainer(tmp_path, mini_data, "train.ema=0.9")
    assert trainer.ema is not None
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    updates, averages = trainer.ema.updates, [a.clone() for a in trainer.ema.averages]
    param = next(p for p in trainer.model.parameters() if p.dim() >= 2)
    handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        loss, tokens, applied = trainer.train_step([trainer.pairs.train_ids.batch(list(range(8)))])
    finally:
        handle.remove()
    assert torch.isfinite(torch.tensor(loss)) and tokens > 0
    assert not applied
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
    assert trainer.ema.updates == updates
    assert all(torch.equal(a, b) for a, b in zip(trainer.ema.averages, averages, strict=True))


def test_train_logs_step_of_end_counts_the_epochs_leftover_update(tmp_path: Path, mini_data: Path) -> None:
    """train.max_epochs with train.accum_steps: an epoch's leftover micro-batches make one more
    update, and the "step k/END" of train.log (and the progress bar's total) counts it: in the
    last epoch END is the step the run ends at."""
    import math
    import re

    from mtx.data import epoch_length

    run = tmp_path / "run"
    sets = ["train.accum_steps=4", "train.max_epochs=2", "train.eval_every=1000", "train.max_steps=100000"]
    sets += ["train.eval_sentences=5", "train.log_every=1", "train.device=cpu"]
    assert main(tiny_args(mini_data, run, *[a for s in sets for a in ("--set", s)])) == 0
    trainer = train_module.Trainer(load_config(run / "config.yaml"), run, resume=True)
    tc = trainer.cfg.train
    batches = [epoch_length(trainer.pairs.train_ids, tc.batch_tokens, tc.seed, epoch) for epoch in (0, 1)]
    assert batches[1] % 4, batches  # the last epoch has leftovers (else this test tells nothing)
    final = sum(math.ceil(b / 4) for b in batches)
    lines = re.findall(r"step (\d+)/(\d+): loss", (run / "train.log").read_text())
    assert int(lines[-1][0]) == final
    last_epoch = [int(end) for step, end in lines if int(step) > math.ceil(batches[0] / 4)]
    assert last_epoch and set(last_epoch) == {final}


def test_patience_takes_a_tie_for_no_gain_stops_after_exactly_patience_evaluations_and_stays_stopped(
    tmp_path: Path, mini_data: Path
) -> None:
    """train.patience=2: "no val BLEU gain in 2 evaluations" - an evaluation that only equals the
    best so far is no gain, the run stops at the 2nd evaluation without a gain, and a resume of
    the stopped run trains nothing (it already reached train.patience)."""
    import json
    from dataclasses import replace

    run = tmp_path / "run"
    _trainer(tmp_path, mini_data, "train.eval_every=1", "train.patience=2", "train.lr=1e-12")
    cfg = load_config(run / "config.yaml")
    cfg = replace(cfg, train=replace(cfg.train, max_steps=20))
    trainer = train_module.Trainer(cfg, run, resume=True)
    bleus = iter([60.0, 60.0, 59.0, 60.0, 61.0, 62.0, 63.0] + [64.0 + i for i in range(20)])
    trainer.validate = lambda: {"val_loss": 1.0, "val_bleu": next(bleus), "val_chrf": 1.0}  # type: ignore[method-assign]
    trainer.fit()
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [(e["step"], e["val_bleu"]) for e in valid if e["event"] == "valid"]
    # step 1's real validation, then 60 (a gain), 60 (a tie: no gain), 59 (no gain): stopped at step 4
    assert [s for s, _ in valid] == [1, 2, 3, 4] and [b for _, b in valid[1:]] == [60.0, 60.0, 59.0]
    assert trainer.state.step == 4 and trainer.state.evals_without_gain == 2
    again = train_module.Trainer(cfg, run, resume=True)
    again.fit()
    assert again.state.step == 4
