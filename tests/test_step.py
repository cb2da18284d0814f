"""The compiled decoding step (mtx/step.py): it compiles, it computes what the same code does
as Python, and where TorchScript fails the Python code runs."""

from __future__ import annotations

import logging

import pytest
import torch

import mtx.model
from mtx import step
from mtx.model import Seq2Seq, make_src_mask
from mtx.tokenizer import BOS
from tests.test_model import NORMS, V, _model, _src


def test_decoding_steps_are_compiled_with_torchscript() -> None:
    """On this torch the step compiles: a failure would fall back to Python silently (but for a
    log line) and cost the speed measured in docs/speed.md."""
    assert isinstance(step.compiled_step(), torch.jit.ScriptFunction)


def _steps_with_beams(model: Seq2Seq, k: int, float32_self: bool = False) -> torch.Tensor:
    """Logits of 8 cached steps of 2 sentences x `k` rows sharing one memory row per sentence,
    rows reordered between steps as beam search does."""
    gen = torch.Generator().manual_seed(3)
    src = _src()
    mask = make_src_mask(src)
    memory = model.encode(src, mask)
    cache = model.new_cache(float32_self)
    tokens = torch.full((2 * k, 1), BOS)
    out = []
    for _ in range(8):
        logits = model.decode(tokens, memory, mask, cache)[:, -1]
        out.append(logits)
        tokens = torch.randint(4, V, (2 * k, 1), generator=gen)
        within = torch.randint(0, k, (2, k), generator=gen)  # each sentence's beams from its own rows
        cache.reorder((within + torch.arange(2)[:, None] * k).view(-1))
    return torch.stack(out)


@pytest.mark.parametrize("k", [1, 3])
@NORMS
def test_compiled_step_equals_the_python_step(
    pre_norm: bool, scale_norm: bool, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bit for bit: the compiled and the Python step run the same operators; every cached
    one-position step of a CPU model goes through the compiled one."""
    model = _model(pre_norm, scale_norm=scale_norm)
    calls = []

    def counted() -> object:
        calls.append(1)
        return step.compiled_step()

    with torch.inference_mode(), model.packed_weights():
        monkeypatch.setattr(mtx.model, "compiled_step", counted)
        compiled = _steps_with_beams(model, k)
        monkeypatch.setattr(mtx.model, "compiled_step", lambda: step.decoder_step)
        python = _steps_with_beams(model, k)
    assert len(calls) == 8
    assert torch.equal(compiled, python)


@pytest.mark.parametrize("float32_self", [False, True])
def test_compiled_bf16_step_with_packed_layers_equals_the_python_step(
    float32_self: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With bf16 weights every decoder layer multiplies by its prepacked copy where the CPU
    packs bf16 (`Seq2Seq.packed_weights`), inside the compiled step too."""
    model = _model().to(torch.bfloat16)
    with torch.inference_mode(), model.packed_weights():
        compiled = _steps_with_beams(model, 3, float32_self)
        monkeypatch.setattr(mtx.model, "compiled_step", lambda: step.decoder_step)
        python = _steps_with_beams(model, 3, float32_self)
    assert compiled.dtype == torch.bfloat16
    assert torch.equal(compiled, python)


def test_step_runs_as_python_where_torchscript_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail(_fn: object) -> object:
        raise RuntimeError("\nno TorchScript in this build")

    monkeypatch.setattr(torch.jit, "script", fail)
    step.compiled_step.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="mtx.step"):
            assert step.compiled_step() is step.decoder_step
        assert "decoding steps run uncompiled: TorchScript failed (no TorchScript in this build)" in caplog.text
    finally:
        step.compiled_step.cache_clear()  # the next caller compiles again
