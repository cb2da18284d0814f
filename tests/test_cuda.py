"""The CUDA paths: skipped where torch sees no CUDA device (CI, the 2-core CPU machines), run on a
GPU machine when one is lent (`python -m pytest tests/test_cuda.py`). They check what the CPU
tests cannot: the unfused loss and the search on the GPU against the CPU, bf16 autocast and
fp16 with its scaler in real training, resume, and a run trained on CUDA decoding on the CPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from mtx.checkpoint import load_run
from mtx.data import Batch, pad_ids
from mtx.loss import label_smoothed_loss
from mtx.model import make_src_mask
from mtx.plot import read_metrics
from mtx.search import beam_search, greedy_search, translate_ids
from mtx.text import read_lines
from mtx.tokenizer import BOS, EOS

from .conftest import tiny_args
from .test_cli import mtx
from .test_model import _batch, _model  # the small seeded model of the CPU model tests (vocabulary 50)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    """Full float32 products on the GPU, so that its results can be held to the CPU's."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _three_pairs() -> Batch:
    return _batch([[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], [[20, 21, 22], [23, 24], [25, 26, 27, 28]])


def test_loss_and_gradients_on_cuda_equal_the_fused_cpu_ones() -> None:
    """On CUDA the loss goes through the materialised logits (`SmoothedCrossEntropy`), on the CPU
    through the fused projection: the same loss and gradients."""
    cpu_model = _model()
    gpu_model = copy.deepcopy(cpu_model).to(CUDA)
    batch = _three_pairs()
    results = []
    for model, device in ((cpu_model, CPU), (gpu_model, CUDA)):
        loss = label_smoothed_loss(model, batch.to(device), 0.1)
        loss.backward()
        results.append((loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}))
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-5)
    assert cpu_grads.keys() == gpu_grads.keys()
    for name, grad in cpu_grads.items():
        assert torch.allclose(gpu_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_decoder_logits_on_cuda_equal_the_cpu_ones() -> None:
    """The decoder's logits on CUDA are the CPU's (cached == uncached decoding on CUDA is
    tests/test_model.py's test, parametrised over the devices)."""
    model, src = _model(), _three_pairs().src
    tgt = torch.tensor([[BOS, 20, 21, 22], [BOS, 23, 24, 25], [BOS, 26, 27, 28]])
    logits = {}
    for device in (CPU, CUDA):
        model.to(device)
        mask = make_src_mask(src.to(device))
        logits[device.type] = model.decode(tgt.to(device), model.encode(src.to(device), mask), mask).cpu()
    assert torch.allclose(logits["cuda"], logits["cpu"], atol=1e-4)


@pytest.mark.parametrize("beam", [1, 5])
def test_search_on_cuda(tiny_run: Path, small_data: Path, beam: int) -> None:
    """On the GPU: beam 1 is greedy, batching changes no output, and the outputs are the CPU's
    (float32 both sides; the tiny model's near-ties may flip a few)."""
    run = load_run(tiny_run, device=CUDA)
    src_ids = run.src_tok.encode_batch(read_lines(small_data / "val.de")[:40])
    src = pad_ids(src_ids, suffix=EOS).to(CUDA)
    if beam == 1:
        greedy = greedy_search(run.model, src, 1.2, 10)
        beam_one = beam_search(run.model, src, 1, 0.0, 1.2, 10)
        assert [h.tokens for h in greedy] == [b[0].tokens for b in beam_one]
    batched = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=100_000, nbest=beam)
    small = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=60, nbest=beam)
    single = [translate_ids(run.model, [s], beam, 1.0, 1.2, 10, batch_tokens=100_000)[0] for s in src_ids]
    assert [h[0].tokens for h in small] == [h[0].tokens for h in batched] == [h[0].tokens for h in single]
    for hyps in batched:  # n-best sorted by score
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    on_cpu = translate_ids(load_run(tiny_run).model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=100_000)
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(batched, on_cpu, strict=True))
    assert same >= len(src_ids) - 2, f"{same} of {len(src_ids)} outputs equal the CPU's"


@pytest.mark.parametrize("amp", ["auto", "fp16"])
def test_train_resume_and_decode_on_cuda(tmp_path: Path, small_data: Path, amp: str) -> None:
    """`mtx train` on CUDA (bf16 autocast by default, fp16 with its loss scaler on request), then
    --resume, then translate and eval on the GPU and on the CPU from the same checkpoint."""
    run_dir = tmp_path / "run"
    steps = ["--set", "train.max_steps=60", "--set", "train.eval_every=30", "--set", f"train.amp={amp}"]
    r = mtx(*tiny_args(small_data, run_dir, "--set", "train.device=cuda", *steps))
    assert r.returncode == 0, r.stderr.decode()
    log = (run_dir / "train.log").read_text()
    native = torch.cuda.is_bf16_supported(including_emulation=False)  # (stop 63: emulated bf16 not chosen)
    precision = "float16" if amp == "fp16" else "bfloat16" if native else "float16"
    assert f"device cuda, precision {precision}," in log, log[:2000]
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert bool(ckpt["scaler"].get("scale")) == (precision == "float16"), ckpt["scaler"]
    r = mtx("train", "--run-dir", str(run_dir), "--resume", "--set", "train.max_steps=90")
    assert r.returncode == 0, r.stderr.decode()
    events = read_metrics(run_dir)
    losses = [e["loss"] for e in events if e["event"] == "train"]
    assert losses and all(loss == loss and loss < 20 for loss in losses), losses  # finite
    assert [e["step"] for e in events if e["event"] == "valid"] == [30, 60, 90]
    assert losses[-1] < losses[0]

    r = mtx("translate", "--run", str(run_dir), "--device", "cuda", "--beam", "3", "Ein Mann fährt Fahrrad.")
    assert r.returncode == 0 and len(r.stdout.decode().splitlines()) == 1, r.stderr.decode()
    scores = {}
    for device in ("cuda", "cpu"):
        r = mtx("eval", "--run", str(run_dir), "--device", device, "--split", "val", "--json")
        assert r.returncode == 0, r.stderr.decode()
        scores[device] = json.loads(r.stdout)["bleu"]
    assert scores["cuda"] == pytest.approx(scores["cpu"], abs=0.5), scores
    r = mtx("eval", "--run", str(run_dir), "--device", "cuda", "--split", "val", "--precision", "bf16", "--json")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["bleu"] == pytest.approx(scores["cuda"], abs=2.0)


def test_a_cpu_run_resumes_on_cuda_in_fp16(tmp_path: Path, small_data: Path) -> None:
    """A run saved without fp16 (here on the CPU in fp32) holds an empty loss-scaler state, which an
    fp16 run's scaler refused to load: the resume failed (stop 51). It now starts a fresh scaler;
    a device this machine lacks is a one-line error before anything is written."""
    run_dir = tmp_path / "run"
    steps = ["--set", "train.max_steps=20", "--set", "train.eval_every=20", "--set", "train.device=cpu"]
    r = mtx(*tiny_args(small_data, run_dir, "--set", "train.amp=fp32", *steps))
    assert r.returncode == 0, r.stderr.decode()
    on_gpu = ["--set", "train.max_steps=40", "--set", "train.device=cuda", "--set", "train.amp=fp16"]
    r = mtx("train", "--run-dir", str(run_dir), "--resume", *on_gpu)
    assert r.returncode == 0, r.stderr.decode()
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["state"]["step"] == 40 and ckpt["scaler"]["scale"] > 0
    assert "device cuda, precision float16," in (run_dir / "train.log").read_text()
    count = torch.cuda.device_count()
    r = mtx("train", "--run-dir", str(run_dir), "--resume", "--set", f"train.device=cuda:{count}")
    assert r.returncode == 1 and r.stderr.decode().strip() == (
        f"mtx: error: train.device: cuda:{count} but this machine has {count} CUDA device(s), "
        f"cuda:0 to cuda:{count - 1}"
    ), r.stderr.decode()


def test_compiled_training_on_cuda(tmp_path: Path, small_data: Path) -> None:
    run_dir = tmp_path / "run"
    steps = ["--set", "train.max_steps=40", "--set", "train.eval_every=40", "--set", "train.compile=true"]
    r = mtx(*tiny_args(small_data, run_dir, "--set", "train.device=cuda", *steps))
    assert r.returncode == 0, r.stderr.decode()
    losses = [e["loss"] for e in read_metrics(run_dir) if e["event"] == "train"]
    assert losses and losses[-1] < losses[0], losses
