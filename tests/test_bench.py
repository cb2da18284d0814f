"""The benchmarks' own claims: for decoding, the same outputs with and without the cache, the
whole-vocabulary rows it adds for a run with a restricted softmax and the bf16 rows where the CPU
has native bf16 (every row in bf16 with `--precision bf16`); for training, a matrix-product bound
no lower than the speed-up it measured, and bf16 rows for both models where the CPU has native
bf16."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mtx.device import BF16_MIN_SPEEDUP, BF16_MIN_STEP_SPEEDUP
from mtx.errors import ConfigError, memory_advice, run_script

from .conftest import REPO, TINY_CONFIG, script_in_process

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_decode.py"
TRAIN_SCRIPT = SCRIPT.with_name("bench_train.py")


def _bench(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[list[str], dict]:
    args = ["--run", str(run), "--sentences", "24", "--batch-sentences", "8", *extra]
    code, out, err = script_in_process(SCRIPT, args, monkeypatch, capsys)
    assert code == 0, err
    lines = out.splitlines()
    return lines, json.loads(lines[-1])


def test_bench_decode_times_the_whole_vocabulary_beside_a_restricted_softmax(
    tiny_restricted_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines, result = _bench(tiny_restricted_run, monkeypatch, capsys)
    assert result["cached_equals_uncached"] == {"greedy": True, "beam5": True}
    assert result["greedy_tok_per_s"] > 0 and result["beam5_tok_per_s"] > 0
    assert set(result["restricted_output_speedup"]) == {"greedy", "beam5"}
    assert all(ratio > 0 for ratio in result["restricted_output_speedup"].values())
    # the whole-vocabulary copy keeps the other pieces at -inf: the same outputs, short of float ties
    assert all(share >= 0.9 for share in result["restricted_output_identical"].values())
    assert any(line.startswith("beam 5, whole vocab") for line in lines)
    assert any(line.startswith("restricted softmax:") for line in lines)
    # fairseq's stop timed beside the exact one
    finished = result["beam5_stop_finished"]
    assert finished["tok_per_s"] > 0 and finished["slowdown_vs_greedy"] > 0 and 0 <= finished["identical"] <= 1
    assert any(line.startswith("beam 5, stop finished") for line in lines)


def test_bench_decode_adds_no_whole_vocabulary_rows_to_a_whole_vocabulary_run(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines, result = _bench(tiny_run, monkeypatch, capsys, "--rounds", "2", "--turn-batches", "1")
    assert result["cached_equals_uncached"] == {"greedy": True, "beam5": True}
    assert len(result["beam5_slowdown_vs_greedy_per_round"]) == 2
    assert "2 pass(es)" in lines[0] and "turns of" in lines[0]
    assert result["restricted_output_speedup"] is None and result["restricted_output_identical"] is None
    assert not any("whole vocab" in line for line in lines)
    # bf16 rows (--precision bf16) exactly where the CPU has native bf16
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert result["bf16"]["greedy_tok_per_s"] > 0 and result["bf16"]["beam5_slowdown_vs_greedy"] > 0
        assert any(line.startswith("beam 5, bf16") for line in lines)
    else:
        # the table (the last line, JSON, always has the key "bf16")
        assert result["bf16"] is None and not any("bf16" in line for line in lines[:-1])


def test_bench_decode_in_bf16_times_every_row_in_bf16(
    tiny_restricted_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        code, _, err = script_in_process(SCRIPT, ["--precision", "bf16"], monkeypatch, capsys)
        assert code != 0 and "needs a CPU with native bf16" in err
        return
    lines, result = _bench(tiny_restricted_run, monkeypatch, capsys, "--precision", "bf16")
    assert result["precision"] == "bf16" and "bf16 weights" in lines[0]
    assert result["bf16"] is None and not any(line.startswith("greedy, bf16") for line in lines)  # no mixed rows
    assert result["greedy_tok_per_s"] > 0 and result["beam5_tok_per_s"] > 0
    assert all(ratio > 0 for ratio in result["restricted_output_speedup"].values())  # the whole vocabulary in bf16


def test_bench_train_bounds_the_speedup_by_the_matrix_products(
    small_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The time of mtx's matrix products alone is part of its step, so the bound it gives on the
    speed-up over the reference is no lower than the speed-up measured (tiny config, 2 steps)."""
    args = ["--config", str(TINY_CONFIG), "--set", f"data.dir={small_data}", "--steps", "2", "--warmup", "1"]
    args += ["--set", "train.amp=auto"]  # the bf16 rows below (the tiny config trains in fp32)
    code, out, err = script_in_process(TRAIN_SCRIPT, args, monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out.splitlines()[-1])
    assert 0.0 < result["mtx_gemm_fraction"] < 1.0
    measured = result["mtx_fp32_tgt_tok_per_s"] / result["reference_tgt_tok_per_s"]
    assert result["gemm_bound_vs_reference"] > measured > 0.0
    assert "with every other op free" in out
    # bf16 rows, the reference's among them, exactly where the CPU has native bf16
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for key in ("reference_bf16_tgt_tok_per_s", "speedup_vs_reference_bf16"):
        assert (result[key] is not None) == native_bf16
        assert result[key] is None or result[key] > 0.0
    # what train.amp auto chooses here, and the timings it chose by (0 without native bf16; the
    # model's pass timed only where the products are fast)
    fast_products = result["cpu_bf16_speedup"] >= BF16_MIN_SPEEDUP
    assert (result["bf16_pass_speedup"] is not None) == fast_products
    fast_pass = fast_products and result["bf16_pass_speedup"] >= BF16_MIN_STEP_SPEEDUP
    assert result["amp_auto"] == ("bf16" if fast_pass else "fp32")
    assert (result["cpu_bf16_speedup"] > 0.0) == native_bf16


def test_bench_gpu_decodes_the_same_outputs_in_every_fp32_row(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/bench_gpu.py (run with --device cpu here): 12 rows, and in fp32 the batch size and
    the cache change no output."""
    script = SCRIPT.with_name("bench_gpu.py")
    args = ["--run", str(tiny_run), "--device", "cpu", "--sentences", "6"]
    code, out, err = script_in_process(script, args, monkeypatch, capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["dtype"], r["beam"], r["cache"], r["batch_tokens"]) for r in rows[:3]] == [
        ("float32", 1, True, 4000),
        ("float32", 1, True, 32000),
        ("float32", 1, False, 4000),
    ]
    assert len(rows) == 12 and all(r["tok_per_s"] > 0 and r["mean_len"] >= 1 for r in rows)
    assert [r["same_as_first"] for r in rows if r["dtype"] == "float32"] == [None, 6, 6] * 2


def test_bench_ctranslate2_converts_through_mtx_export(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/bench_ctranslate2.py: its CTranslate2 model is `mtx export`'s, and greedy decodes as mtx does."""
    pytest.importorskip("ctranslate2", reason="no CTranslate2 on this platform (the optional extra mtx[export])")
    script = SCRIPT.with_name("bench_ctranslate2.py")
    args = ["--run", str(tiny_run), "--sentences", "16", "--rounds", "1", "--beam", "2", "--threads", "1"]
    code, out, err = script_in_process(script, args, monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(out.splitlines()[-1])
    # the tiny model's outputs often run to the length cap, which CTranslate2 applies per batch
    assert result["greedy_agreement_ended"] >= 0.9 and result["ct2_greedy_tok_per_s"] > 0, result
    # no more threads for CTranslate2 than --threads (stop 53: 2 workers of 1 thread against mtx's 1)
    assert result["ct2_greedy_workers"] == result["ct2_beam_workers"] == 1


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_decode.py", ["--run", "{tmp}/nowhere"], "{tmp}/nowhere: run directory not found"),
        ("bench_gpu.py", ["--run", "{tmp}/nowhere", "--device", "cpu"], "{tmp}/nowhere: run directory not found"),
        # a ~ the shell left (after --run=) is expanded, as mtx's own options do (stop 63: ~/x not found)
        ("bench_decode.py", ["--run=~/nowhere"], "{tmp}/nowhere: run directory not found"),
        ("bench_gpu.py", ["--run", "{tmp}", "--device", "nosuch"], "--device: unknown device 'nosuch'"),
        ("bench_train.py", ["--config", "{tmp}/none.yaml"], "{tmp}/none.yaml: config file not found"),
        # an empty split (stop 53: a division by zero after decoding nothing)
        ("bench_gpu.py", ["--run", "{run}", "--device", "cpu", "--data-dir", "{tmp}"], "{tmp}/test_2016_flickr.de"),
        # fewer batches than steps to time (stop 53: a division by zero)
        ("bench_train.py", ["--config", "{tiny}", "--set", "data.dir={data}", "--steps", "999"], "{data}: train makes"),
        # the config to train, checked before training (stop 55: mtx train's error line, then the script's)
        ("bench_decode.py", ["--config", "{tmp}/none.yaml"], "{tmp}/none.yaml: config file not found"),
        ("bench_decode.py", ["--set", "train.max_stepz=4"], "--set: unknown key train.max_stepz"),
    ],
)
def test_benchmarks_report_a_user_mistake_in_one_line(
    tmp_path: Path,
    tiny_run: Path,
    mini_data: Path,
    script: str,
    args: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for lang in ("de", "en"):
        (tmp_path / f"test_2016_flickr.{lang}").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path))
    names = {"tmp": tmp_path, "run": tiny_run, "data": mini_data, "tiny": TINY_CONFIG}
    argv = [a.format(**names) for a in args]
    code, _, err = script_in_process(SCRIPT.with_name(script), argv, monkeypatch, capsys)
    prog = script.removesuffix(".py")
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: {message.format(**names)}"), err


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # (stop 61: the last of two values was taken without a word)
        ("bench_decode.py", ["--sentences", "3", "--sentences", "7"], "argument --sentences: given twice"),
        ("choose_on_val.py", ["--run", "r", "--last", "2", "--last", "3"], "argument --last: given twice"),
        # mtx's largest beam (stop 61: 100,000 ran out of memory after minutes, with a traceback)
        ("bench_onmt.py", ["--run", "r", "--beam", "100000"], "argument --beam: must be in 1..1000 (as mtx takes)"),
        ("bench_ctranslate2.py", ["--run", "r", "--beam", "1001"], "argument --beam: must be in 1..1000"),
        ("choose_on_val.py", ["--run", "r", "--beam", "5,100000"], "argument --beam: beam sizes must be at most 1,000"),
    ],
)
def test_scripts_refuse_an_option_twice_and_a_beam_mtx_refuses(
    script: str, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = script_in_process(SCRIPT.with_name(script), args, monkeypatch, capsys)
    assert code == 2 and err.startswith(f"{script.removesuffix('.py')}: error: {message}"), err
    assert err.count("\n") == 1 and err.endswith(f" (see {script} --help)\n"), err


def test_bench_train_finds_its_default_config_from_any_directory(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stop 61: run from outside the checkout, its relative default was "config file not found".
    Here the default config is read, and stops at the data check (too few batches for the steps)."""
    monkeypatch.chdir(tmp_path)
    args = ["--set", f"data.dir={mini_data}", "--steps", "999"]
    code, _, err = script_in_process(SCRIPT.with_name("bench_train.py"), args, monkeypatch, capsys)
    assert code == 1 and f"bench_train: error: {mini_data}: train makes" in err, err


def test_bench_decode_cuts_a_source_to_the_positions_as_eval_does(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A source longer than model.max_positions is cut, with mtx eval's warning (stop 55: a traceback)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    config = run / "config.yaml"
    data_dir = yaml.safe_load(config.read_text())["data"]["dir"]
    config.write_text(config.read_text().replace(data_dir, str(tmp_path)))
    (tmp_path / "long.de").write_text("Ein Hund.\n" + "Hund " * 400 + "\n")
    (tmp_path / "long.en").write_text("A dog.\nA dog.\n")
    args = ["--run", str(run), "--split", "long", "--threads", "1", "--batch-sentences", "1"]
    code, out, err = script_in_process(SCRIPT, args, monkeypatch, capsys)
    assert code == 0, err
    assert "1 input sentence(s) longer than" in err and json.loads(out.splitlines()[-1])["greedy_tok_per_s"] > 0


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_decode.py", ["--threads", "100000"], "argument --threads: must be in 1.."),
        (
            "bench_ctranslate2.py",
            ["--run", ".", "--beam", "0"],
            "argument --beam: must be in 1..1000 (as mtx takes), got 0",
        ),
        ("bench_train.py", ["--steps", "-2"], "argument --steps: must be >= 1, got -2"),
        ("bench_train.py", ["--compile", "--warmup", "0"], "torch.compile compiles in the first step"),
        # --set configures the run trained without --run; it was ignored beside --run
        ("bench_decode.py", ["--run", ".", "--set", "model.d_model=256"], "--set changes the config of the run"),
        ("bench_decode.py", ["--run", ".", "--config", "x.yaml"], "--config is the config trained when --run"),
    ],
)
def test_benchmarks_refuse_counts_out_of_range_before_any_work(
    script: str, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One error line, exit code 2, before any work (100,000 threads crashed OpenMP); the line is
    all, and names the script as its other errors do (stop 69's probe: argparse's usage block above
    it, `choose_on_val.py:` there and `choose_on_val:` for the others)."""
    code, _, err = script_in_process(SCRIPT.with_name(script), args, monkeypatch, capsys)
    name = script.removesuffix(".py")
    assert code == 2 and err == f"{name}: error: {message}" + err.split(message, 1)[1], err
    assert err.count("\n") == 1 and err.endswith(f" (see {script} --help)\n"), err


def _raise(error: BaseException) -> Callable[[], None]:
    def main() -> None:
        raise error

    return main


@pytest.mark.parametrize(
    ("error", "code", "stderr"),
    [
        (ConfigError("c.yaml: train.max_step: unknown key"), 1, "bench: error: c.yaml: train.max_step: unknown key\n"),
        (IsADirectoryError(21, "Is a directory", "out/best.pt"), 1, "bench: error: out/best.pt: Is a directory\n"),
        (OSError(28, "No space left on device"), 1, "bench: error: No space left on device\n"),
        (KeyboardInterrupt(), 130, "bench: interrupted\n"),
        (
            MemoryError(),
            1,
            f"bench: error: out of memory; {memory_advice('free memory, or use a machine with more')}\n",
        ),
        (BrokenPipeError(32, "Broken pipe"), 141, ""),
    ],
)
def test_scripts_end_as_mtx_does(
    error: BaseException, code: int, stderr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The scripts' `run_script` turns what `mtx` turns into one line (or a quiet exit) the same way."""
    with pytest.raises(SystemExit) as exit_info:
        run_script("bench", _raise(error))
    assert exit_info.value.code == code
    assert capsys.readouterr().err == stderr


def test_scripts_let_bugs_raise() -> None:
    """Anything else is a bug in mtx, whose traceback must reach the user."""
    with pytest.raises(ZeroDivisionError):
        run_script("bench", _raise(ZeroDivisionError("division by zero")))


ONMT_SCRIPT = SCRIPT.with_name("bench_onmt.py")
ECHO = Path(shutil.which("echo") or "/bin/echo")
# OpenNMT-py 3.5.1's state dict of a 2+2-layer Transformer, recorded from `build_base_model` with
# bench_onmt's options (d_model 16, 4 heads, FFN 32, 10 pieces, shared and tied embeddings):
# layer 0 of each stack stands for every layer; D, F and V for d_model, FFN and vocabulary sizes
ONMT_ATTENTION = [f"{{attn}}.linear_{n}.{w}" for n in ("keys", "values", "query") for w in ("weight", "bias")]
ONMT_TOP = {
    "encoder.embeddings.make_embedding.emb_luts.0.weight": ("V", "D"),
    "encoder.embeddings.make_embedding.pe.pe": (5000, 1, "D"),
    "encoder.layer_norm.weight": ("D",),
    "encoder.layer_norm.bias": ("D",),
    "decoder.embeddings.make_embedding.emb_luts.0.weight": ("V", "D"),
    "decoder.embeddings.make_embedding.pe.pe": (5000, 1, "D"),
    "decoder.layer_norm.weight": ("D",),
    "decoder.layer_norm.bias": ("D",),
}
ONMT_ENCODER_LAYER = {
    **{name.format(attn="self_attn"): ("D", "D") if name.endswith("weight") else ("D",) for name in ONMT_ATTENTION},
    "self_attn.final_linear.weight": ("D", "D"),
    "self_attn.final_linear.bias": ("D",),
    "feed_forward.w_1.weight": ("F", "D"),
    "feed_forward.w_1.bias": ("F",),
    "feed_forward.w_2.weight": ("D", "F"),
    "feed_forward.w_2.bias": ("D",),
    "feed_forward.layer_norm.weight": ("D",),
    "feed_forward.layer_norm.bias": ("D",),
    "layer_norm.weight": ("D",),
    "layer_norm.bias": ("D",),
}
ONMT_DECODER_LAYER = {
    **{k: v for k, v in ONMT_ENCODER_LAYER.items() if not k.startswith("layer_norm.")},
    "layer_norm_1.weight": ("D",),
    "layer_norm_1.bias": ("D",),
    **{name.format(attn="context_attn"): ("D", "D") if name.endswith("weight") else ("D",) for name in ONMT_ATTENTION},
    "context_attn.final_linear.weight": ("D", "D"),
    "context_attn.final_linear.bias": ("D",),
    "layer_norm_2.weight": ("D",),
    "layer_norm_2.bias": ("D",),
}


def _onmt_module(monkeypatch: pytest.MonkeyPatch) -> dict:
    import runpy

    monkeypatch.syspath_prepend(str(ONMT_SCRIPT.parent))
    return runpy.run_path(str(ONMT_SCRIPT), run_name="bench_onmt")


def _tiny_seq2seq(joint_vocab: bool = True, output_ids: torch.Tensor | None = None, **changes: Any) -> Any:
    from mtx.config import ModelConfig
    from mtx.model import Seq2Seq

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=4, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, **changes)
    return Seq2Seq(cfg, 10, 10, joint_vocab=joint_vocab, output_ids=output_ids).eval()


def test_bench_onmt_writes_opennmt_pys_names_shapes_and_mtxs_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/bench_onmt.py's conversion: OpenNMT-py 3.5.1's layout (recorded above), each
    projection the right slice of mtx's fused ones, and mtx's position table."""
    module = _onmt_module(monkeypatch)
    model = _tiny_seq2seq()
    state, generator = module["onmt_state"](model)
    sizes = {"D": 16, "F": 32, "V": 10}
    want = dict(ONMT_TOP)
    for i in range(2):
        want |= {f"encoder.transformer.{i}.{k}": v for k, v in ONMT_ENCODER_LAYER.items()}
        want |= {f"decoder.transformer_layers.{i}.{k}": v for k, v in ONMT_DECODER_LAYER.items()}
    assert {k: tuple(t.shape) for k, t in state.items()} == {
        k: tuple(sizes.get(d, d) for d in v) for k, v in want.items()
    }
    assert {k: tuple(t.shape) for k, t in generator.items()} == {"weight": (10, 16), "bias": (10,)}
    layer = model.decoder_layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.detach().split(16)
    prefix = "decoder.transformer_layers.1"
    assert torch.equal(state[f"{prefix}.self_attn.linear_query.weight"], q)
    assert torch.equal(state[f"{prefix}.self_attn.linear_keys.weight"], k)
    assert torch.equal(state[f"{prefix}.self_attn.linear_values.weight"], v)
    keys, values = layer.cross_attn.kv_proj.bias.detach().split(16)
    assert torch.equal(state[f"{prefix}.context_attn.linear_keys.bias"], keys)
    assert torch.equal(state[f"{prefix}.context_attn.linear_values.bias"], values)
    assert torch.equal(state[f"{prefix}.layer_norm_2.weight"], layer.sub_cross.norm.weight.detach())
    positions = state["decoder.embeddings.make_embedding.pe.pe"][: model.cfg.max_positions, 0]
    assert torch.equal(positions, model.tgt_embed.positions)
    assert torch.equal(generator["weight"], model.output_table.detach()) and not generator["bias"].any()
    options = module["onmt_options"](model)
    assert options["share_embeddings"] and options["share_decoder_embeddings"] and options["norm_eps"] == 1e-5


def test_bench_onmt_shares_what_mtx_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Untied and separate-vocabulary models keep their own tables; a restricted softmax's
    left-out pieces get the bias that rules them out, as `mtx export` gives CTranslate2."""
    module = _onmt_module(monkeypatch)
    untied = _tiny_seq2seq(tie_embeddings=False)
    state, generator = module["onmt_state"](untied)
    options = module["onmt_options"](untied)
    assert not options["share_embeddings"] and not options["share_decoder_embeddings"]
    assert torch.equal(generator["weight"], untied.output_proj.weight.detach())
    assert not torch.equal(state["decoder.embeddings.make_embedding.emb_luts.0.weight"], generator["weight"])
    options = module["onmt_options"](_tiny_seq2seq(joint_vocab=False))
    assert not options["share_embeddings"] and options["share_decoder_embeddings"]
    _, generator = module["onmt_state"](_tiny_seq2seq(output_ids=torch.tensor([4, 5, 6])))  # EOS and UNK join them
    assert generator["bias"].tolist() == [-65000.0] * 2 + [0.0] * 5 + [-65000.0] * 3


@pytest.mark.parametrize("changes", [{"pre_norm": False}, {"norm": "scale"}, {"fix_norm": True}])
def test_bench_onmt_refuses_models_opennmt_py_cannot_express(
    changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenNMT-py 3.5's Transformer is pre-norm with LayerNorm only: post-norm, ScaleNorm and FixNorm are refused."""
    from mtx.errors import MtxError

    with pytest.raises(MtxError, match="OpenNMT-py's Transformer is pre-norm with LayerNorm"):
        _onmt_module(monkeypatch)["onmt_options"](_tiny_seq2seq(**changes))


def test_bench_onmt_refuses_what_opennmt_py_cannot_run_in_one_line(
    tmp_path: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--onmt-python` missing, a directory, a Python without OpenNMT-py or not a Python: one line each."""
    import sys

    fake = tmp_path / "fake" / "onmt"  # another OpenNMT-py release, found by the last case only
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "3.4.0"\n')
    for python, message in (
        (tmp_path / "nowhere" / "python", f"--onmt-python {tmp_path}/nowhere/python: no such file"),
        (Path(sys.executable), f"--onmt-python: {sys.executable} cannot import OpenNMT-py"),
        (tmp_path, f"--onmt-python {tmp_path}: is a directory"),
        (ECHO, f"--onmt-python {ECHO} is not a Python running the worker"),  # a program that is not Python
        (Path(sys.executable), f"--onmt-python: {sys.executable} has OpenNMT-py 3.4.0; this benchmark needs 3.5"),
    ):
        if "3.4.0" in message:
            monkeypatch.setenv("PYTHONPATH", str(fake.parent))
        args = ["--run", str(tiny_run), "--onmt-python", str(python), "--sentences", "4", "--threads", "1"]
        code, _, err = script_in_process(ONMT_SCRIPT, args, monkeypatch, capsys)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith(f"bench_onmt: error: {message}"), err


@pytest.mark.skipif(not os.environ.get("MTX_ONMT_PYTHON"), reason="set MTX_ONMT_PYTHON to a python with OpenNMT-py 3.5")
def test_bench_onmt_decodes_greedy_as_mtx_does(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With OpenNMT-py installed: the converted model's greedy outputs are mtx's."""
    args = ["--run", str(tiny_run), "--onmt-python", os.environ["MTX_ONMT_PYTHON"], "--sentences", "16"]
    code, out, err = script_in_process(
        ONMT_SCRIPT, [*args, "--rounds", "1", "--beam", "2", "--threads", "1"], monkeypatch, capsys
    )
    assert code == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result["greedy_agreement_ended"] is None or result["greedy_agreement_ended"] >= 0.9, result
    assert result["onmt_greedy_tok_per_s"] > 0 and result["onmt_beam_tok_per_s"] > 0, result


def test_bench_train_reference_drops_out_where_mtx_does() -> None:
    """stop 64: nn.Transformer's one `dropout` also dropped the attention probabilities and the FFN's
    hidden layer at model.dropout, where mtx's model (and the shipped configs) drop nothing: extra
    work counted as mtx's speed-up. The reference takes model.attention_dropout and
    model.activation_dropout there (-1: model.dropout), and model.dropout on the residual branches."""
    import runpy

    from mtx.config import ModelConfig

    bench = runpy.run_path(str(TRAIN_SCRIPT), run_name="bench_train")
    for attention, activation, expected in ((0.0, 0.0, 0.0), (0.2, -1.0, 0.3), (0.0, 0.1, 0.1)):
        cfg = ModelConfig(d_model=16, d_ff=32, dropout=0.3, attention_dropout=attention, activation_dropout=activation)
        reference = bench["ReferenceTransformer"](cfg, 40).transformer
        layers = [*reference.encoder.layers, *reference.decoder.layers]
        assert [layer.dropout.p for layer in layers] == [expected] * len(layers)
        assert {layer.dropout1.p for layer in layers} == {0.3}  # the residual branches
        rates = {m.dropout for m in reference.modules() if isinstance(m, torch.nn.MultiheadAttention)}
        assert rates == {attention}


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("train.device=cuda", "train.device='cuda' is not timed by bench_train: bench_train times training on the CPU"),
        ("tokenizer.joint=false", "tokenizer.joint=false is not timed by bench_train: the reference shares"),
        ("model.tie_embeddings=false", "model.tie_embeddings=false is not timed by bench_train"),
        ("model.norm=scale", "model.norm='scale' is not timed by bench_train: nn.Transformer has LayerNorm only"),
        ("model.fix_norm=true", "model.fix_norm=true is not timed"),
        ("train.rdrop=0.5", "train.rdrop=0.5 is not timed by bench_train: the timed step has no R-Drop"),
        ("train.word_dropout=0.1", "train.word_dropout=0.1 is not timed"),
        ("train.tgt_word_dropout=0.1", "train.tgt_word_dropout=0.1 is not timed"),
        ("train.accum_steps=2", "train.accum_steps=2 is not timed"),
        ("tokenizer.bpe_dropout=0.1", "tokenizer.bpe_dropout=0.1 is not timed"),
        ("train.amp=fp16", "train.amp: fp16 is for CUDA"),
    ],
)
def test_bench_train_refuses_keys_it_would_not_time(
    key: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stop 64: these keys were validated, then ignored or applied to mtx only (rc 0, no word), so
    the models timed were not the ones asked for. One line naming the key, before any data is read."""
    args = ["--config", str(TINY_CONFIG), "--set", f"data.dir={tmp_path}", "--set", key]
    code, _, err = script_in_process(TRAIN_SCRIPT, args, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"bench_train: error: {message}"), err


def test_bench_train_honours_train_amp_threads_and_counts_the_softmax_as_mtx_train(
    small_data: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """stop 64: train.amp fp32 still timed (and could choose) bf16 rows, train.threads was ignored
    for --threads' default, and the restricted softmax's size left out EOS and UNK (635 against
    mtx train's 637). torch's profiler lines no longer stand above the table."""
    from mtx.config import load_config
    from mtx.data import ParallelIds, load_corpus, texts
    from mtx.model import Seq2Seq
    from mtx.tokenizer import train_bpe

    sets = [f"data.dir={small_data}", "train.amp=fp32", "train.threads=1", "model.restrict_output=true"]
    args = ["--config", str(TINY_CONFIG), "--steps", "1", "--warmup", "1"]
    for item in sets:
        args += ["--set", item]
    code, out, err = script_in_process(TRAIN_SCRIPT, args, monkeypatch, capfd)  # torch's C++ writes to fd 2
    assert code == 0, err
    assert "USDT" not in err and "profiler_start" not in err
    lines = out.splitlines()
    result = json.loads(lines[-1])
    assert "on the CPU, 1 threads" in lines[0]
    assert not any("bf16" in name for name in result["best_setting"].split())
    assert result["reference_bf16_tgt_tok_per_s"] is None and result["restricted_output_bf16_tgt_tok_per_s"] is None
    assert not any(line.startswith(("mtx bf16", "reference bf16")) for line in lines)
    cfg = load_config(TINY_CONFIG, sets)
    src, tgt = texts(load_corpus(small_data, cfg.data, ["train"])["train"])
    tok = train_bpe(src + tgt, cfg.tokenizer)
    ids = ParallelIds.encode(src, tgt, tok, tok, cfg.data.max_len)
    model = Seq2Seq(cfg.model, tok.vocab_size, tok.vocab_size, joint_vocab=True, output_ids=ids.target_vocabulary())
    expected = f"softmax over {len(model.output_ids)} of {tok.vocab_size} target pieces"
    assert any(expected in line for line in lines), out


def test_bench_decode_says_faster_than_greedy_below_one() -> None:
    """stop 64: a ratio of seconds below 1 read "0.96x slower than greedy"."""
    import runpy

    against_greedy = runpy.run_path(str(SCRIPT), run_name="bench_decode")["against_greedy"]
    assert against_greedy(2.5) == "2.50x slower than greedy"
    assert against_greedy(1.0) == "1.00x slower than greedy"
    assert against_greedy(0.8) == "1.25x faster than greedy"


_SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name != "onmt_worker.py")


# each script's --help, run as `python script --help` runs it, in one process: one import of torch
# and one compiling of its modules for -OO, not one a script (stop 71: 42 s -> 17 s of the suite)
_HELP_OF_EACH = """
import contextlib, io, json, os, runpy, sys, traceback
for path in sys.argv[1:]:
    sys.argv, out, err = [path, "--help"], io.StringIO(), io.StringIO()
    sys.path[0] = os.path.dirname(path)  # as `python script` puts its folder first
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code, err = 1, io.StringIO(traceback.format_exc())
    print(json.dumps([path, code, "usage:" in out.getvalue(), err.getvalue()]), flush=True)
"""


def test_scripts_start_with_docstrings_stripped() -> None:
    """`python -OO` (PYTHONOPTIMIZE=2, set by some production images) strips docstrings, and every
    script built its --help from its own: an AttributeError at any start (stop 67)."""
    paths = [str(REPO / "scripts" / script) for script in _SCRIPTS]
    r = subprocess.run([sys.executable, "-OO", "-c", _HELP_OF_EACH, *paths], capture_output=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr.decode()
    results = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert [path for path, *_ in results] == paths, r.stderr.decode()
    for path, code, usage, err in results:
        assert code == 0 and usage, f"{path}: exit {code}\n{err}"


def test_bench_decode_reports_the_seconds_and_outputs_it_timed(
    tiny_restricted_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every number of the table and the JSON line is computed from what the timed passes measured:
    each setting's decoding takes a set time per batch on a clock of the test's own and gives set
    outputs, so each rate, ratio and share is known exactly; every row timed is in the table and no
    other (stop 70's mutants: seconds summed over passes, a ratio upside down, another row's
    seconds, EOS not counted or tokens counted in every pass, a share over the batches: the tests
    checked only that the numbers were positive). The 1-worker rows' outputs differ here from the
    default layout's: their tok/s counted the default rows' tokens (stop 70)."""
    import time
    from collections import defaultdict

    import mtx.search

    per_batch = {  # seconds per batch of each row, in the first pass (twice that in the second)
        "greedy": 1.0,
        "greedy, 1 worker": 1.25,
        "greedy, no cache": 2.5,
        "beam 5": 3.0,
        "beam 5, 1 worker": 3.5,
        "beam 5, no cache": 8.0,
        "beam 5, stop finished": 2.0,
        "greedy, bf16": 0.75,
        "beam 5, bf16": 2.25,
        "greedy, whole vocab": 1.5,
        "beam 5, whole vocab": 4.5,
    }
    rows = {  # (beam, cache, workers, stop, weights) -> row
        (1, True, 0, "exact", "fp32"): "greedy",
        (1, True, 1, "exact", "fp32"): "greedy, 1 worker",
        (1, False, 1, "exact", "fp32"): "greedy, no cache",
        (5, True, 0, "exact", "fp32"): "beam 5",
        (5, True, 1, "exact", "fp32"): "beam 5, 1 worker",
        (5, False, 1, "exact", "fp32"): "beam 5, no cache",
        (5, True, 0, "finished", "fp32"): "beam 5, stop finished",
        (1, True, 0, "exact", "bf16"): "greedy, bf16",
        (5, True, 0, "exact", "bf16"): "beam 5, bf16",
        (1, True, 0, "exact", "whole"): "greedy, whole vocab",
        (5, True, 0, "exact", "whole"): "beam 5, whole vocab",
    }
    clock = [0.0]
    batches_done: dict[str, int] = defaultdict(int)
    outputs: dict[str, list[list[int]]] = defaultdict(list)  # the first pass's, in batch order

    def timed(fn: Any, batches: list, workers: int, device: torch.device, model: torch.nn.Module) -> list:
        """Each sentence's output: as many pieces as a function of the row and its place, so rows
        agree on some sentences and not on others (and the 1-worker rows differ from the default
        layout's, as other thread counts may make them: a near tie goes the other way)."""
        dtype = next(model.parameters()).dtype
        weights = "whole" if type(model).__name__ == "WholeVocabulary" else str(dtype).removeprefix("torch.")
        weights = "fp32" if weights == "float32" else "bf16" if weights == "bfloat16" else weights
        kw = fn.keywords
        row = rows[kw["beam"], kw["cache"], workers, kw["stop"], weights]
        first_pass = batches_done[row] < n_batches
        first = batches_done[row] % n_batches * 8  # the sentence each batch starts with
        hyps = [
            [
                [7] * ((first + i) % (3 + len(row) % 3) + (2 if "worker" in row and i == 0 else 1))
                for i in range(len(batch))
            ]
            for batch in batches
        ]
        clock[0] += per_batch[row] * len(batches) * (1 if first_pass else 2)
        batches_done[row] += len(batches)
        if first_pass:
            outputs[row] += [h for batch in hyps for h in batch]
        return hyps

    n, n_batches = 24, 3
    monkeypatch.setattr(mtx.search, "in_workers", timed)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    lines, result = _bench(tiny_restricted_run, monkeypatch, capsys, "--rounds", "2", "--turn-batches", "1")
    monkeypatch.undo()
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    timed_rows = [row for row in per_batch if native_bf16 or "bf16" not in row]
    assert set(outputs) == set(timed_rows) and all(batches_done[row] == 2 * n_batches for row in timed_rows)
    seconds = {row: per_batch[row] * n_batches * 1.5 for row in timed_rows}  # per pass: (1 + 2) / 2
    tokens = {row: sum(len(h) + 1 for h in outputs[row]) for row in timed_rows}  # + EOS, one pass
    assert all(len(outputs[row]) == n for row in timed_rows)
    head = next(i for i, line in enumerate(lines) if line.startswith("setting "))
    assert lines[head + 1 : head + 1 + len(timed_rows)] == [  # every row timed, in order, and no other
        f"{row:20s} {n / seconds[row]:8.1f} {tokens[row] / seconds[row]:10.0f} {tokens[row] / n:9.2f} "
        f"{seconds[row]:8.2f}"
        for row in timed_rows
    ]
    assert lines[head + 1 + len(timed_rows)].startswith("cached == uncached == 1-worker outputs:")

    def rate(row: str, over: str | None = None) -> float:
        return round(tokens[row] / seconds[over or row], 1)

    def ratio(a: str, b: str) -> float:
        return round(seconds[a] / seconds[b], 3)

    def share(a: str, b: str) -> float:
        return round(sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True)) / n, 4)

    expected = {
        "greedy_sent_per_s": round(n / seconds["greedy"], 2),
        "beam5_sent_per_s": round(n / seconds["beam 5"], 2),
        "greedy_tok_per_s": rate("greedy"),
        "beam5_tok_per_s": rate("beam 5"),
        "greedy_tok_per_s_1_worker": rate("greedy, 1 worker"),  # its own output tokens (stop 70: greedy's)
        "beam5_tok_per_s_1_worker": rate("beam 5, 1 worker"),
        "beam5_cache_speedup": ratio("beam 5, no cache", "beam 5, 1 worker"),
        "greedy_cache_speedup": ratio("greedy, no cache", "greedy, 1 worker"),
        "beam5_slowdown_vs_greedy": ratio("beam 5", "greedy"),
        "beam5_slowdown_vs_greedy_per_round": [ratio("beam 5", "greedy")] * 2,  # alike in both passes
        "cached_equals_uncached": {
            "greedy": outputs["greedy"] == outputs["greedy, no cache"] == outputs["greedy, 1 worker"],
            "beam5": outputs["beam 5"] == outputs["beam 5, no cache"] == outputs["beam 5, 1 worker"],
        },
        "beam5_stop_finished": {
            "tok_per_s": rate("beam 5, stop finished"),
            "slowdown_vs_greedy": ratio("beam 5, stop finished", "greedy"),
            "identical": share("beam 5", "beam 5, stop finished"),
        },
        "precision": "fp32",
        "bf16": {
            "greedy_tok_per_s": rate("greedy, bf16"),
            "greedy_speedup": ratio("greedy", "greedy, bf16"),
            "greedy_identical": share("greedy", "greedy, bf16"),
            "beam5_tok_per_s": rate("beam 5, bf16"),
            "beam5_speedup": ratio("beam 5", "beam 5, bf16"),
            "beam5_identical": share("beam 5", "beam 5, bf16"),
            "beam5_slowdown_vs_greedy": ratio("beam 5, bf16", "greedy, bf16"),
        }
        if native_bf16
        else None,
        "restricted_output_speedup": {
            "greedy": ratio("greedy, whole vocab", "greedy"),
            "beam5": ratio("beam 5, whole vocab", "beam 5"),
        },
        "restricted_output_identical": {
            "greedy": share("greedy", "greedy, whole vocab"),
            "beam5": share("beam 5", "beam 5, whole vocab"),
        },
    }
    assert result == expected
    finished = next(line for line in lines if line.startswith("beam 5, stop finished (decode.stop):"))
    assert finished.startswith("beam 5, stop finished (decode.stop): 1.500x the exact stop's speed, 2.00x slower")


def test_side_by_side_rates_count_each_rows_own_output_tokens() -> None:
    """mtx's 1-worker tok/s in bench_ctranslate2's and bench_onmt's JSON counted the default
    layout's output tokens over the 1-worker row's seconds (stop 70), a number no pass measured
    where the two layouts' outputs differ."""
    import runpy

    side = runpy.run_path(str(SCRIPT), run_name="bench_decode")["MtxSide"]
    tokens = {"mtx greedy": 100, "mtx greedy, 1 worker": 90}
    seconds = {"mtx greedy": 2.0, "mtx greedy, 1 worker": 3.0}
    assert side.rates("greedy", "greedy", tokens, seconds) == {
        "mtx_greedy_tok_per_s": 50.0,
        "mtx_greedy_tok_per_s_1_worker": 30.0,
    }
