"""Distributed training on CPU (DDP over gloo): 2 ranks take the 1-rank step; torchrun end to end.

Every run sets `train.device=cpu`: with `auto` on a machine with one GPU, rank 1 would find no GPU of
its own (`rank_device`'s error)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from mtx.config import Config, load_config
from mtx.data import Batch, ParallelIds, epoch_batches, plan_batches
from mtx.device import Ranks
from mtx.errors import ConfigError, DataError, MtxError, Terminated, command_line, torchrun_command
from mtx.rundir import prepare_run_dir
from mtx.train import Trainer

from .conftest import REPO, TINY_CONFIG, main_in_process, tiny_args
from .test_reliability import train_lines, wait_for

ACCUM = (2, 2, 2, 1)  # micro-batches per rank in each of the compared optimizer steps
BATCH_TOKENS = 500  # B: each rank's micro-batch; the 1-rank run takes both ranks' together


def test_rank_shards_are_dealt_round_robin_so_resume_can_change_the_rank_count() -> None:
    n = 999
    lens = np.random.default_rng(0).integers(1, 40, size=(2, n))
    ids = ParallelIds([[1000 + i] * lens[0, i] for i in range(n)], [[4] * t for t in lens[1]])

    def shards(world_size: int, start: int = 0) -> list[list[frozenset[int]]]:
        """Each rank's batches from `start`, as sets of sentence numbers (the first source id)."""
        return [
            [frozenset(b.src[:, 0].tolist()) for b in epoch_batches(ids, 400, 1, 0, start, rank, world_size)]
            for rank in range(world_size)
        ]

    plan = shards(1)[0]
    assert len(plan) > 20 and len(set().union(*plan)) == n
    for world_size in (2, 3):
        per_rank = shards(world_size)
        assert {len(s) for s in per_rank} == {len(plan) // world_size}  # no rank waits at an epoch's end
        dealt = [batch for step in zip(*per_rank, strict=True) for batch in step]
        assert dealt == plan[: len(dealt)]  # disjoint, and in plan order across the ranks
    # 7 batches on each of 2 ranks used plan[:14]; on 3 ranks the run continues at batch 5 of each
    # share (plan[15:]), skipping fewer batches than there are ranks and repeating none
    resumed = shards(3, start=-(-7 * 2 // 3))
    assert [batch for step in zip(*resumed, strict=True) for batch in step] == plan[15 : 3 * (len(plan) // 3)]


def equivalence_config(data_dir: Path) -> Config:
    # no clipping: a wrongly scaled gradient would be clipped back to the same unit norm on both sides
    overrides = [
        "model.dropout=0.0",
        "train.amp=fp32",
        "train.eval_sentences=10",
        "train.device=cpu",
        "train.clip_norm=0",
    ]
    return load_config(TINY_CONFIG, [f"data.dir={data_dir}", *overrides])


def step_batches(trainer: Trainer, step: int, rank: int, world_size: int) -> list[Batch]:
    """Rank `rank`'s micro-batches of `step`; with world_size 1, all ranks' batches of a micro-step as one."""
    ids = trainer.pairs.train_ids
    plan = plan_batches(ids.src_lens, ids.tgt_lens, BATCH_TOKENS, seed=7)
    first = sum(ACCUM[:step])
    micro = [plan[2 * m : 2 * m + 2] for m in range(first, first + ACCUM[step])]  # (rank 0's, rank 1's)
    if world_size == 1:
        return [ids.batch(np.concatenate(pair)) for pair in micro]
    return [ids.batch(pair[rank]) for pair in micro]


def run_steps(trainer: Trainer, rank: int, world_size: int, bucket_calls: list[int]) -> dict[str, object]:
    """The steps of ACCUM: each step's loss, gradients (as the optimizer sees them) and all-reduces."""
    grads: list[list[torch.Tensor]] = []
    calls_at_step: list[int] = []

    def record(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
        calls_at_step.append(len(bucket_calls))

    trainer.optimizer.register_step_pre_hook(record)
    losses = []
    for step in range(len(ACCUM)):
        loss, _, applied = trainer.train_step(step_batches(trainer, step, rank, world_size))
        assert applied
        losses.append(loss)
    calls = np.diff([0, *calls_at_step]).tolist()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    return {"losses": losses, "grads": grads, "weights": weights, "bucket_calls": calls}


def counting_allreduce(calls, bucket):  # unannotated: DDP rejects the string annotations of this module
    """DDP's own all-reduce of a gradient bucket, counted."""
    calls.append(1)
    return allreduce_hook(None, bucket)


def destroy_after_freeing() -> None:
    """`dist.destroy_process_group()` once the worker's Trainer is gone (the worker deletes it):
    DDP's reducer holds the group, and a group whose threads end at interpreter exit instead of
    here can abort the rank ("terminate called without an active exception", SIGABRT), as
    `mtx.train.train` frees its Trainer for the same reason (a stop 60 CI run failed this way)."""
    gc.collect()
    dist.destroy_process_group()


def equivalence_worker(rank: int, world_size: int, data_dir: Path, run_dir: Path, store: Path, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        trainer = Trainer(equivalence_config(data_dir), run_dir, resume=False, ranks=Ranks(rank, rank, world_size))
        bucket_calls: list[int] = []
        trainer.loss_module.register_comm_hook(bucket_calls, counting_allreduce)
        torch.save(run_steps(trainer, rank, world_size, bucket_calls), out / f"rank{rank}.pt")
        del trainer
    finally:
        destroy_after_freeing()


def test_two_ranks_take_the_single_process_step(tmp_path: Path, mini_data: Path) -> None:
    """Gradients and losses of 2 ranks x B tokens equal 1 rank on the same 2B tokens (fp32, no dropout)."""
    ddp_run, single_run = tmp_path / "ddp", tmp_path / "single"
    ddp_run.mkdir()
    single_run.mkdir()
    mp.spawn(equivalence_worker, args=(2, mini_data, ddp_run, tmp_path / "store", tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]

    shutil.copy(ddp_run / "tokenizer.json", single_run / "tokenizer.json")  # the same vocabulary
    trainer = Trainer(equivalence_config(mini_data), single_run, resume=False)
    single = run_steps(trainer, 0, 1, [])

    # DDP keeps the replicas identical: the same averaged gradients and weights on both ranks
    for a, b in zip(ranks[0]["grads"] + [ranks[0]["weights"]], ranks[1]["grads"] + [ranks[1]["weights"]], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # ... and they are the single-process step on the two ranks' batches put together
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
    # Adam divides each element by its own gradient scale, so float noise on a near-zero gradient
    # can move a weight by up to the learning rate (here 6e-5 at step 1 to 2.4e-4 at step 4): the
    # first step's gradients are taken at the same weights, later ones at weights that may differ
    # that much (torch 2.4.1: up to 1e-5 apart at step 4; torch 2.13 within 1e-7)
    for step, (ddp_grads, single_grads) in enumerate(zip(ranks[0]["grads"], single["grads"], strict=True)):
        atol = 1e-7 if step == 0 else 1e-4
        for x, y in zip(ddp_grads, single_grads, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=atol, msg=lambda m, s=step: f"step {s + 1}: {m}")
    for x, y in zip(ranks[0]["weights"], single["weights"], strict=True):
        torch.testing.assert_close(x, y, rtol=0.0, atol=1e-4)
    # accumulation all-reduces once per update: a step of 2 micro-batches as often as a step of 1
    calls = ranks[0]["bucket_calls"]
    assert calls[-1] > 0 and calls[1:-1] == [calls[-1]] * (len(ACCUM) - 2), calls


def clock_worker(rank: int, data_dir: Path, run_dir: Path, store: Path, out: Path) -> None:
    """The linear schedule under a time budget, each rank's clock on its own training time."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = load_config(
            TINY_CONFIG,
            [
                f"data.dir={data_dir}",
                "train.amp=fp32",
                "train.device=cpu",
                "train.schedule=linear",
                "train.warmup_steps=1",
                "train.max_minutes=1",
            ],
        )
        trainer = Trainer(cfg, run_dir, resume=False, ranks=Ranks(rank, rank, 2))
        rates = []
        for step in range(3):
            trainer.state.elapsed = 6.0 * (step + 1) + 3.0 * rank  # rank 1's clock 3 s ahead
            trainer.train_step(step_batches(trainer, step, rank, 2))
            trainer.state.step += 1
            rates.append(trainer.optimizer.param_groups[0]["lr"])
        weights = [p.detach().clone() for p in trainer.model.parameters()]
        torch.save({"rates": rates, "weights": weights}, out / f"clock{rank}.pt")
        del trainer
    finally:
        destroy_after_freeing()


def test_ranks_take_rank_0s_time_for_the_learning_rate(tmp_path: Path, mini_data: Path) -> None:
    """The linear schedule under train.max_minutes read each rank's own clock: the ranks applied
    different rates to the same gradient, and the replicas drifted apart (stop 66)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mp.spawn(clock_worker, args=(mini_data, run_dir, tmp_path / "store", tmp_path), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"clock{r}.pt", weights_only=True) for r in (0, 1))
    lr = load_config(TINY_CONFIG).train.lr
    # rank 0's 6, 12 and 18 s of a 60 s budget: 0.9, 0.8 and 0.7 of the rate
    assert rank0["rates"] == rank1["rates"] == pytest.approx([lr * 0.9, lr * 0.8, lr * 0.7])
    assert all(torch.equal(a, b) for a, b in zip(rank0["weights"], rank1["weights"], strict=True))


def sharing_worker(rank: int, world_size: int, data_dir: Path, init_from: Path, run_dir: Path, out: Path) -> None:
    """`validate` and train.diversify's `_translate_train` on `world_size` ranks, started from a
    trained run; the moving average (kept on rank 0) holds the trained weights, the model itself
    halved weights, so a rank translating with its own model instead would give other outputs."""
    import mtx.train

    scored: list[list[str]] = []
    real_scores = mtx.train.corpus_scores

    def recording(text: list[str], refs: list[str], **kwargs: object) -> object:
        scored.append(list(text))
        return real_scores(text, refs, **kwargs)

    mtx.train.corpus_scores = recording
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world_size)
    try:
        overrides = [f"train.init_from={init_from}", "train.eval_sentences=30", "train.ema=0.99", "train.device=cpu"]
        cfg = load_config(TINY_CONFIG, [f"data.dir={data_dir}", *overrides])
        if rank == 0:
            prepare_run_dir(run_dir, cfg, resume=False)  # the other run's tokenizer copied
        trainer = Trainer(cfg, run_dir, resume=False, ranks=Ranks(rank, rank, world_size))
        result = trainer.validate()
        trained = [p.detach().clone() for p in trainer.model.parameters()]
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(0.5)
        if trainer.ema is not None:
            trainer.ema.averages = trained
        real = trainer.pairs.train_ids  # 60 of them both ways are enough, and take seconds
        trainer.pairs.train_ids = ParallelIds(real.src_ids[:60], real.tgt_ids[:60])
        synthetic = trainer._translate_train()
        record = {"result": result, "scored": scored, "synthetic": [synthetic.src_ids, synthetic.tgt_ids]}
        torch.save(record, out / f"share{world_size}_{rank}.pt")
        del trainer
    finally:
        if world_size > 1:
            destroy_after_freeing()


def test_ranks_share_validation_and_diversify_with_the_single_process_result(
    tmp_path: Path, mini_data: Path, tiny_run: Path
) -> None:
    """Stop 58: rank 0 alone validated and translated train for train.diversify while the other
    ranks waited (up to the process group's timeout). Each rank now takes every second sentence:
    the same val translations, BLEU and chrF as one process, the loss within float rounding, and
    the same synthetic pairs on every rank, translated with rank 0's moving average."""
    for world_size in (1, 2):
        run_dir = tmp_path / f"run{world_size}"
        run_dir.mkdir()
        args = (world_size, mini_data, tiny_run, run_dir, tmp_path)
        mp.spawn(sharing_worker, args=args, nprocs=world_size, join=True)
    single, rank0, rank1 = (torch.load(tmp_path / f"share{n}.pt", weights_only=True) for n in ("1_0", "2_0", "2_1"))
    assert rank1["result"] is None and rank1["scored"] == []  # rank 0 alone scores
    assert rank0["scored"] == single["scored"] and len(single["scored"][0]) == 30
    assert len(set(single["scored"][0])) > 20  # translations that differ: an order mixed up would show
    for key in ("val_bleu", "val_chrf"):
        assert rank0["result"][key] == single["result"][key]
    assert rank0["result"]["val_loss"] == pytest.approx(single["result"]["val_loss"], rel=1e-6)
    assert rank0["synthetic"] == rank1["synthetic"] == single["synthetic"]
    assert len(single["synthetic"][0]) > 60  # most of the 2 x 60 translations kept
    assert len({tuple(ids) for ids in single["synthetic"][1][:60]}) > 40  # forward translations that differ


def amp_worker(rank: int, data_dir: Path, run_dir: Path, store: Path, out: Path) -> None:
    """A rank whose own bf16 timing differs from the other's (rank 0: fast, rank 1: slow)."""
    import mtx.device

    mtx.device.cpu_bf16_speedup = lambda: 2.5 if rank == 0 else 0.6

    def pass_speedup(model: object, step: object) -> float:  # rank 0 alone times the model's pass
        assert rank == 0, "rank 1 timed the model's pass"
        return 2.0

    mtx.device.bf16_step_speedup = pass_speedup
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = load_config(
            TINY_CONFIG, [f"data.dir={data_dir}", "train.amp=auto", "train.eval_sentences=10", "train.device=cpu"]
        )
        trainer = Trainer(cfg, run_dir, resume=False, ranks=Ranks(rank, rank, 2))
        (out / f"amp{rank}.txt").write_text(str(trainer.amp))
        del trainer
    finally:
        destroy_after_freeing()


def test_ranks_train_in_rank_0s_choice_of_precision(tmp_path: Path, mini_data: Path) -> None:
    """`train.amp: auto` on CPU: each rank times bf16 products itself, rank 0 the model's training
    pass too, and rank 0's choice holds for every rank."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mp.spawn(amp_worker, args=(mini_data, run_dir, tmp_path / "store", tmp_path), nprocs=2, join=True)
    assert [(tmp_path / f"amp{r}.txt").read_text() for r in (0, 1)] == ["torch.bfloat16"] * 2


def config_worker(rank: int, data_dir: Path, run_dir: Path, store: Path, out: Path) -> None:
    """Rank 1 with another train.max_steps, and its own copy of the data (another data.dir)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    own = [f"data.dir={data_dir if rank == 0 else out / 'copy'}", "train.threads=1", "train.device=cpu"]
    cfg = load_config(TINY_CONFIG, [*own, *(["train.max_steps=20"] if rank else [])])
    try:
        Trainer(cfg, run_dir, resume=False, ranks=Ranks(rank, rank, 2))
    except ConfigError as e:
        (out / f"error{rank}.txt").write_text(str(e))
    finally:
        destroy_after_freeing()


def test_ranks_with_different_configs_stop_at_once(tmp_path: Path, mini_data: Path) -> None:
    """stop 55: a --set given on one machine only hung the job when that rank ended first; the keys a
    machine may set for itself (data.dir, train.threads) may differ."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(mini_data, tmp_path / "copy")
    mp.spawn(config_worker, args=(mini_data, run_dir, tmp_path / "store", tmp_path), nprocs=2, join=True)
    same = "give every process the same config and --set"
    assert (tmp_path / "error1.txt").read_text() == f"rank 1's config differs from rank 0's at train.max_steps; {same}"
    assert (tmp_path / "error0.txt").read_text().startswith("another rank's config differs from rank 0's")


def data_worker(rank: int, data_dir: Path, run_dir: Path, store: Path, out: Path) -> None:
    """Rank 1 with its own copy of the data (another data.dir), one train pair shorter."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    own = [f"data.dir={data_dir if rank == 0 else out / 'copy'}", "train.threads=1", "train.device=cpu"]
    try:
        Trainer(load_config(TINY_CONFIG, own), run_dir, resume=False, ranks=Ranks(rank, rank, 2))
    except DataError as e:
        (out / f"error{rank}.txt").write_text(str(e))
    finally:
        destroy_after_freeing()


def test_ranks_with_different_data_stop_at_once(tmp_path: Path, mini_data: Path) -> None:
    """data.dir is each machine's own, and each rank's data was never compared with rank 0's: a
    shorter copy on one machine hung a train.max_epochs job at that rank's epoch end, and without
    an epoch limit each rank trained and validated on its own pairs (stop 68's probe)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    copy = shutil.copytree(mini_data, tmp_path / "copy")
    for lang in ("de", "en"):
        lines = (copy / f"train.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
        (copy / f"train.{lang}").write_text("".join(lines[:-1]), encoding="utf-8")
    mp.spawn(data_worker, args=(mini_data, run_dir, tmp_path / "store", tmp_path), nprocs=2, join=True)
    same = "give every machine the same data"
    assert (tmp_path / "error1.txt").read_text() == f"rank 1's data ({copy}) differs from rank 0's; {same}"
    other = f"another rank's data differs from rank 0's (its error names it); {same}"
    assert (tmp_path / "error0.txt").read_text() == other


def first_save_worker(rank: int, data_dir: Path, run_dir: Path, store: Path, out: Path) -> None:
    """Rank 0 cannot write step 0's last.pt (a full disk): its process ends."""
    import mtx.checkpoint

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cfg = load_config(TINY_CONFIG, [f"data.dir={data_dir}", "train.threads=1", "train.device=cpu"])
    trainer = Trainer(cfg, run_dir, resume=False, ranks=Ranks(rank, rank, 2))
    if rank == 0:
        mtx.checkpoint.atomic_save = full
        try:
            trainer.fit()
        except OSError:
            os._exit(1)  # as the process ends after its one line
    try:
        trainer.fit()
    except MtxError as e:
        (out / "error1.txt").write_text(str(e))
    del trainer
    os._exit(0)


def test_rank_0_failing_to_write_step_0_leaves_one_line_on_the_others(tmp_path: Path, mini_data: Path) -> None:
    """Step 0's save was outside the lost-peer handling: rank 0 failing to write it (a full disk)
    left gloo's traceback on rank 1, and its line would have named "step None" (stop 68's probe)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    context = mp.start_processes(
        first_save_worker, args=(mini_data, run_dir, tmp_path / "store", tmp_path), nprocs=2, join=False
    )
    for process in context.processes:
        process.join(timeout=300)
    error = (tmp_path / "error1.txt").read_text()
    assert error.startswith("another process of this torchrun job ended (") and error.endswith("); nothing was saved")


def test_a_lost_peers_line_says_where_a_moved_run_directory_is_not(tmp_path: Path) -> None:
    """Rank 0 alone follows a run directory moved while training: where it was then lost, rank 1's
    "Resume with" named the old path as the run's (stop 68's probe: "run directory not found")."""
    from types import SimpleNamespace

    gone = tmp_path / "moved_away"
    trainer = SimpleNamespace(saved_step=150, run_dir=gone, _resume_command=lambda: f"mtx train --run-dir {gone}")
    line = str(Trainer._peer_lost_error(trainer, RuntimeError("[x.cc:1] Connection closed by peer [h]:1")))  # type: ignore[arg-type]
    assert line.startswith("another process of this torchrun job ended (Connection closed by peer [h]:1); ")
    assert (
        f"{gone} was moved while training, and the run is kept where it went, as last.pt saved it at step 150" in line
    )
    trainer.run_dir = tmp_path
    assert "was moved" not in str(Trainer._peer_lost_error(trainer, RuntimeError("Connection closed by peer")))  # type: ignore[arg-type]


def torchrun(*args: str) -> subprocess.CompletedProcess[bytes]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*command, "-m", "mtx", *args], capture_output=True, cwd=REPO, env=env, timeout=600)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory, mini_data: Path) -> tuple[Path, str]:
    """A run trained by 2 processes through torchrun to step 10, then resumed by torchrun to step
    20 (validated at both), with BPE-dropout (rank 0 segments each epoch and sends it to rank 1) and
    a moving average of the weights (rank 0 alone keeps and saves it); the resume's stderr. Shared,
    as each torchrun start takes 8-10 s on 2 cores; a test that changes the run works on a copy."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    common = ("--set", "train.eval_every=10", "--set", "train.log_every=5", "--set", "train.accum_steps=2")
    common += ("--set", "tokenizer.bpe_dropout=0.1", "--set", "train.ema=0.9", "--set", "train.device=cpu")
    r = torchrun(
        *tiny_args(mini_data, run_dir, *common, "--set", "train.max_steps=10", "--set", "train.eval_sentences=20")
    )
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    r = torchrun("train", "--run-dir", str(run_dir), "--resume", "--set", "train.max_steps=20")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return run_dir, r.stderr.decode()


def test_torchrun_resumes_an_old_last_pt_by_its_validations_and_a_refused_resume_is_one_line_a_rank(
    tmp_path: Path, torchrun_run: tuple[Path, str]
) -> None:
    """Under torchrun a last.pt of an mtx before stop 54, which a signal stopped between
    validations, was still taken as validated at its step ("the save of step 20 was cut short",
    no validation); a resume that rank 0 refused left rank 1's 30-line traceback of gloo (stop
    68's probe)."""
    run_dir = tmp_path / "run"
    shutil.copytree(torchrun_run[0], run_dir)
    refused = torchrun("train", "--run-dir", str(run_dir), "--resume", "--set", "model.d_ff=256")
    err = refused.stderr.decode()
    assert refused.returncode != 0 and "[rank1]:" not in err, err[-3000:]  # (torchrun's own traceback follows)
    lines = sorted(line for line in err.splitlines() if line.startswith("mtx: "))
    assert len(lines) == 2 and "--resume cannot change model.d_ff" in lines[0], err[-3000:]
    assert lines[1].startswith("mtx: error: another process of this torchrun job ended while setting up (")
    # as an mtx before stop 54 left it: stopped at step 20 before its validation, no validated_step
    last = run_dir / "checkpoints" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    del ckpt["state"]["validated_step"]
    torch.save(ckpt, last)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records if (r["event"], r["step"]) != ("valid", 20)))
    (run_dir / "checkpoints" / "step_20.pt").unlink()
    r = torchrun("train", "--run-dir", str(run_dir), "--resume")
    err = r.stderr.decode()
    assert r.returncode == 0 and "cut short" not in err and "step 20: val loss" in err, err[-3000:]
    assert [(r["event"], r["step"]) for r in map(json.loads, metrics.read_text().splitlines())][-1] == ("valid", 20)
    assert (run_dir / "checkpoints" / "step_20.pt").is_file()


def test_torchrun_trains_resumes_and_translates(
    torchrun_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 processes through torchrun: rank 0 alone writes the run; --resume continues it; it translates."""
    run_dir, err = torchrun_run
    names = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}
    assert names == {
        "config.yaml",
        "tokenizer.json",
        "source_punctuation.json",
        "metrics.jsonl",
        "train.log",
        "checkpoints",
        *(f"checkpoints/{n}.pt" for n in ("last", "best", "ema", "step_10", "step_20")),
    }
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["ema"]["updates"] == 20
    # one writer: every event once, one log line per event
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"] == [5, 10, 15, 20]
    assert [e["step"] for e in events if e["event"] == "valid"] == [10, 20]
    log_text = (run_dir / "train.log").read_text()
    assert log_text.count("resumed from") == 1 and log_text.count("done: reached train.max_steps=20") == 1
    assert log_text.count("DDP over 2 ranks (gloo)") == 2 and err.count("step 20: val loss") == 1

    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["state"]["step"] == 20 and last["state"]["world_size"] == 2
    assert last["epoch_ids"]["epoch"] == last["state"]["epoch"]
    rng = last["rng_per_rank"]
    assert len(rng) == 2 and torch.equal(rng[0]["torch"], last["rng"]["torch"])
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])  # each rank draws its own dropout masks

    r = main_in_process(
        ["translate", "--run", str(run_dir), "--beam", "2", "Ein Mann fährt Fahrrad."], None, monkeypatch
    )
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout.decode().splitlines()) == 1 and r.stdout.decode().strip()


# what a torchrun job prints to resume it: torchrun as this environment has it, 2 processes
TORCHRUN_RESUME = (*torchrun_command(), "--standalone", "--nproc_per_node", "2", "-m", "mtx", "train")


def start_torchrun(
    stderr: Path, data: Path, run_dir: Path, *settings: str, start_new_session: bool = False
) -> subprocess.Popen[bytes]:
    """A 2-process torchrun training of the tiny config in the background, to 100,000 steps."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mtx"]
    args = tiny_args(data, run_dir, "--set", "train.device=cpu", "--set", "train.log_every=1")
    for setting in ("train.max_steps=100000", *settings):
        args += ["--set", setting]
    with stderr.open("wb") as err:
        return subprocess.Popen(
            [*command, *args],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=start_new_session,
        )


def test_ctrl_c_to_torchrun_saves_once_and_rank_0_alone_reports(tmp_path: Path, mini_data: Path) -> None:
    """A terminal's Ctrl-C goes to its foreground process group: torchrun, which passes it on to
    the ranks (each in a session of its own). Every rank stops at the same step with last.pt saved,
    and rank 0 alone reports it (stop 53; before, each rank printed both lines)."""
    run_dir, stderr = tmp_path / "run", tmp_path / "stderr"
    # its own process group, as a terminal's foreground job
    proc = start_torchrun(stderr, mini_data, run_dir, "train.eval_every=100000", start_new_session=True)
    wait_for(lambda: train_lines(run_dir) >= 2, proc, timeout=300)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    text = stderr.read_text()
    step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert step >= 2, text[-3000:]
    assert text.count("received SIGINT: saving a checkpoint") == 1, text[-3000:]
    # the command continues the run in as many processes (stop 62: the plain one, in a single process)
    again = "Resume with: " + command_line(*TORCHRUN_RESUME, "--run-dir", run_dir, "--resume")
    assert text.count(f"mtx: training stopped by SIGINT at step {step}; checkpoint saved. {again}\n") == 1, text[-3000:]
    assert "mtx: interrupted" not in text


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's ranks through /proc")
def test_kill_9_of_torchrun_stops_its_ranks_with_last_pt_saved(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun passes SIGTERM and SIGINT on to its ranks, but a torchrun killed cannot: its ranks
    trained on, holding the run directory's lock (stop 68's probe). Each rank now sends itself
    SIGTERM once torchrun has ended, and stops as on any SIGTERM: at the same step, last.pt saved."""
    run_dir, stderr = tmp_path / "run", tmp_path / "stderr"
    proc = start_torchrun(stderr, mini_data, run_dir, "train.eval_every=100000")
    wait_for(lambda: train_lines(run_dir) >= 2, proc, timeout=300)
    ranks = _children(proc.pid)
    assert len(ranks) == 2
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 120
    while (left := [pid for pid in ranks if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # (not to train on after a failed test)
        os.kill(pid, signal.SIGKILL)
    text = stderr.read_text()
    assert not left, text[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert step >= 2, text[-3000:]
    assert text.count(f"mtx: training stopped by SIGTERM at step {step}; checkpoint saved.") == 1, text[-3000:]
    resume = ["train", "--run-dir", str(run_dir), "--resume", "--set", f"train.max_steps={step + 1}"]
    assert main_in_process(resume, None, monkeypatch).returncode == 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's ranks through /proc")
def test_a_rank_killed_leaves_one_line_on_what_was_kept(tmp_path: Path, mini_data: Path) -> None:
    """A rank killed (kill -9, out of memory): rank 0 printed gloo's 28-line traceback and nothing
    on what was kept or how to go on (stop 62)."""
    run_dir, stderr = tmp_path / "run", tmp_path / "stderr"
    proc = start_torchrun(stderr, mini_data, run_dir, "train.eval_every=2", "train.eval_sentences=5")
    wait_for(lambda: (run_dir / "checkpoints" / "best.pt").exists() and train_lines(run_dir) >= 3, proc, timeout=300)
    ranks = sorted(_children(proc.pid))
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)  # started second: rank 1
    proc.wait(timeout=120)
    text = stderr.read_text()
    lines = [line for line in text.splitlines() if line.startswith("mtx: error: ")]
    assert len(lines) == 1 and "[rank0]:" not in text, text[-3000:]
    step = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert lines[0].startswith("mtx: error: another process of this torchrun job ended (")
    again = command_line(*TORCHRUN_RESUME, "--run-dir", run_dir, "--resume")
    assert lines[0].endswith(f"the run is kept as last.pt saved it at step {step}. Resume with: {again}")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_stop_before_training_takes_the_signals_is_reported_by_rank_0_alone(
    rank: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stop 66's open item: every rank of a torchrun job gets the terminal's Ctrl-C, and one in
    the job's first seconds (torch still importing, before training takes the signals) was
    reported by each rank. Rank 0 speaks for the job, as it does later; other commands always speak."""
    import mtx.cli

    def stopped(args: object) -> int:
        raise KeyboardInterrupt

    def terminated(args: object) -> int:
        raise Terminated(signal.SIGTERM)

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setitem(mtx.cli.COMMANDS, "train", stopped)
    assert mtx.cli.main(["train", "--config", str(TINY_CONFIG)]) == 130
    assert capsys.readouterr().err == ("mtx: interrupted\n" if rank == "0" else "")
    monkeypatch.setitem(mtx.cli.COMMANDS, "train", terminated)
    assert mtx.cli.main(["train", "--config", str(TINY_CONFIG)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ("mtx: stopped by SIGTERM\n" if rank == "0" else "")
    monkeypatch.setitem(mtx.cli.COMMANDS, "translate", stopped)
    assert mtx.cli.main(["translate", "--run", "r", "Hallo"]) == 130
    assert capsys.readouterr().err == "mtx: interrupted\n"
