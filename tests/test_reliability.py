"""Nothing lost, nothing executed: exact resume, stop signals, kill -9, safe loads, clear errors."""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mtx import device as device_module
from mtx import loss as loss_module
from mtx import rundir as rundir_module
from mtx import search
from mtx import state as state_module
from mtx import train as train_module
from mtx.checkpoint import (
    FORMAT_VERSION,
    check_direction,
    load_checkpoint,
    load_run,
    load_run_config,
    run_dir_lock,
)
from mtx.cli import main
from mtx.config import TokenizerConfig, load_config
from mtx.data import ParallelIds, epoch_length
from mtx.errors import MtxError, command_line, memory_advice, own_command
from mtx.text import read_lines
from mtx.tokenizer import train_bpe

from .conftest import REPO, TINY_CONFIG, main_in_process, script_in_process, tiny_args
from .test_cli import assert_one_line_error, mtx_here


def mini_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny run on the CPU: resumes are asserted bit-identical, which CUDA's kernels do not
    promise (attention's backward may add in a different order each run)."""
    common = ("--set", "train.eval_sentences=10", "--set", "train.log_every=1", "--set", "train.device=cpu")
    return tiny_args(data_dir, run_dir, *common, *extra)


def load_weights_only(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def snapshot(*roots: Path) -> dict[str, str]:
    """Path -> content hash of every file under the roots ("dir" for a directory, so that one
    left behind, even empty, is seen)."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for root in roots
        for p in root.rglob("*")
    }


def copy_run(src: Path, dest: Path, checkpoints: tuple[str, ...] = ("last.pt",)) -> Path:
    """A copy of a run directory with only the given checkpoints (so tests can damage it)."""
    (dest / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "tokenizer.json"):
        shutil.copy(src / name, dest / name)
    for name in checkpoints:
        shutil.copy(src / "checkpoints" / name, dest / "checkpoints" / name)
    return dest


def train_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().split("\n")[:-1] if '"event": "train"' in line)


def start(stderr: Path, *args: str, ignored: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """`python -m mtx ARGS` in the background, stderr to a file (a full pipe would stall it), with
    the `ignored` signals ignored as `nohup` and a shell's background jobs start it."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}

    def ignore() -> None:
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)

    with open(stderr, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "mtx", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=ignore,  # noqa: PLW1509 - no threads are started before the fork here
        )


def wait_for(
    condition: Callable[[], bool], proc: subprocess.Popen[bytes], poll: float = 0.05, timeout: float = 120.0
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for training progress")
        time.sleep(poll)


# -- exact resume ------------------------------------------------------------------------------
def test_resume_is_bit_identical_across_epoch_boundaries(tmp_path: Path, mini_data: Path) -> None:
    common = ("--set", "train.eval_every=10", "--set", "train.keep_last=2", "--set", "train.ema=0.9")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(mini_args(mini_data, straight, *common, "--set", "train.max_steps=40")) == 0
    assert main(mini_args(mini_data, split, *common, "--set", "train.max_steps=20")) == 0
    middle = load_weights_only(split / "checkpoints" / "last.pt")["state"]
    assert main(["train", "--run-dir", str(split), "--resume", "--set", "train.max_steps=40"]) == 0

    a = load_weights_only(straight / "checkpoints" / "last.pt")
    b = load_weights_only(split / "checkpoints" / "last.pt")
    # the resume point is inside an epoch and the second half crosses epoch boundaries
    assert middle["step"] == 20 and middle["epoch"] >= 1 and middle["batch"] > 0
    assert a["state"]["epoch"] > middle["epoch"]
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for k, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][k][name]) for name, v in state.items())
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["rng"]["python"] == b["rng"]["python"]
    assert a["ema"]["updates"] == b["ema"]["updates"] == 40
    assert all(torch.equal(x, y) for x, y in zip(a["ema"]["averages"], b["ema"]["averages"], strict=True))
    assert {k: v for k, v in a["state"].items() if k not in ("elapsed", "window_seconds")} == {
        k: v for k, v in b["state"].items() if k not in ("elapsed", "window_seconds")
    }

    # the checkpoints: last, best, the last train.keep_last step files, the moving average,
    # weights-only loadable with version, config and vocabulary fingerprint, identical in both runs
    names = sorted(p.name for p in (split / "checkpoints").iterdir())
    assert names == ["best.pt", "ema.pt", "last.pt", "step_30.pt", "step_40.pt"]
    assert names == sorted(p.name for p in (straight / "checkpoints").iterdir())
    for name in names:
        ckpt = load_weights_only(split / "checkpoints" / name)
        assert ckpt["format_version"] == FORMAT_VERSION and ckpt["vocab"] == a["vocab"]
        assert ckpt["config"]["model"]["d_model"] == 64
        other = load_weights_only(straight / "checkpoints" / name)
        assert all(torch.equal(ckpt["model"][k], other["model"][k]) for k in other["model"])
    # after resume the metrics log continues without gaps or duplicates
    events = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"] == list(range(1, 41))
    assert [e["step"] for e in events if e["event"] == "valid"] == [10, 20, 30, 40]
    # with the same numbers as the straight run's, times aside
    timed = ("tgt_tok_per_s", "elapsed_s")
    straight_events = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in e.items() if k not in timed} for e in events] == [
        {k: v for k, v in e.items() if k not in timed} for e in straight_events
    ]

    # train.ema off from here: ema.pt stays the average of step 40, and the log says so (stop 57: silent)
    ema = (split / "checkpoints" / "ema.pt").read_bytes()
    assert (
        main(["train", "--run-dir", str(split), "--resume", "--set", "train.ema=0", "--set", "train.max_steps=41"]) == 0
    )
    assert "ema" not in load_weights_only(split / "checkpoints" / "last.pt")
    assert (split / "checkpoints" / "ema.pt").read_bytes() == ema
    assert (
        "train.ema is 0 from step 40: checkpoints/ema.pt stays the moving average of step 40"
        in (split / "train.log").read_text()
    )


def test_a_run_ending_between_log_lines_resumes_to_the_straight_runs_log(tmp_path: Path, mini_data: Path) -> None:
    """stop 56: a run ending at a step short of train.log_every logged its last steps and closed
    the window, so its resume logged the rest of that window alone (steps 7 and 8 where a straight
    run logs 8). The last steps are logged as a partial record that a resume replaces."""
    every = ("--set", "train.log_every=4", "--set", "train.eval_every=7")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(mini_args(mini_data, straight, *every, "--set", "train.max_steps=14")) == 0
    assert main(mini_args(mini_data, split, *every, "--set", "train.max_steps=7")) == 0
    timed = ("tgt_tok_per_s", "elapsed_s")

    def records(run: Path) -> list[dict]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in timed} for line in lines]

    first = records(split)
    assert [(e["event"], e["step"], e.get("partial")) for e in first] == [
        ("train", 4, None),
        ("train", 7, True),  # steps 5-7, the last of the run
        ("valid", 7, None),
    ]
    assert main(["train", "--run-dir", str(split), "--resume", "--set", "train.max_steps=14"]) == 0
    assert records(split) == records(straight)  # steps 5-8 in one record, then 9-12, then 13-14 partial
    assert [(e["step"], e.get("partial")) for e in records(split) if e["event"] == "train"] == [
        (4, None),
        (8, None),
        (12, None),
        (14, True),
    ]


def test_bpe_dropout_resegments_each_epoch_and_a_resumed_epoch_keeps_its_own(tmp_path: Path, mini_data: Path) -> None:
    run = tmp_path / "run"
    drop = ("--set", "tokenizer.bpe_dropout=0.1", "--set", "train.eval_every=12")
    assert main(mini_args(mini_data, run, *drop, "--set", "train.max_steps=12")) == 0
    ckpt = load_weights_only(run / "checkpoints" / "last.pt")
    state, saved = ckpt["state"], dict(ckpt["epoch_ids"])
    assert saved.pop("epoch") == state["epoch"] >= 1 and state["batch"] > 0  # stopped inside an epoch

    trainer = train_module.Trainer(load_config(run / "config.yaml"), run, resume=True)
    resumed = trainer.pairs.of_epoch(state["epoch"], trainer.state)
    assert resumed.src_ids == ParallelIds.from_tensors(saved).src_ids  # the same batches go on
    fresh = trainer.pairs.of_epoch(state["epoch"] + 1, trainer.state)
    assert fresh.tgt_ids != resumed.tgt_ids and fresh.tgt_ids != trainer.pairs.train_ids.tgt_ids
    assert trainer.tgt_tok.decode_batch(fresh.tgt_ids) == trainer.pairs.train_texts[1]  # same sentences, resegmented
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=14"]) == 0


def test_bpe_dropout_resegments_the_extra_source_pairs_and_the_models_translations_too(
    tmp_path: Path, mini_data: Path, shared_data: Path
) -> None:
    """BPE-dropout reached train's own pairs only: the (fr, en) pairs of data.extra_src_langs and
    train.diversify's pairs kept the plain segmentation every epoch, and with them half or more
    of an epoch's targets (stop 65). A resumed epoch goes on over the segmentation it began with."""
    data = shutil.copytree(mini_data, tmp_path / "data")
    with gzip.open(shared_data / "train.fr.gz", "rt", encoding="utf-8") as f:
        (data / "train.fr").write_text("".join(next(f) for _ in range(400)), encoding="utf-8")
    run = tmp_path / "run"
    common = ("--set", "data.extra_src_langs=[fr]", "--set", "train.extra_sources=0.9", "--set", "train.eval_every=30")
    drop = ("--set", "tokenizer.bpe_dropout=0.1", "--set", "train.max_steps=3")
    assert main(mini_args(data, run, *common, *drop)) == 0
    ckpt = load_weights_only(run / "checkpoints" / "last.pt")
    assert (ckpt["state"]["epoch"], ckpt["state"]["batch"]) == (0, 3) and "epoch_extra_ids" in ckpt

    trainer = train_module.Trainer(load_config(run / "config.yaml"), run, resume=True)
    real, extra, synthetic = trainer.pairs.segmented(0, trainer.state)  # the resumed epoch's, from last.pt
    assert extra is not None and synthetic is None
    assert extra.src_ids == ParallelIds.from_tensors(ckpt["epoch_extra_ids"]).src_ids
    plain = trainer.pairs.extra_ids
    assert plain is not None and extra.src_ids != plain.src_ids and extra.tgt_ids != plain.tgt_ids
    assert trainer.src_tok.decode_batch(extra.src_ids) == trainer.pairs.extra_texts[0] == read_lines(data / "train.fr")
    assert trainer.tgt_tok.decode_batch(extra.tgt_ids) == trainer.pairs.extra_texts[1]
    # the model's translations (here train's pairs reversed stand in for them), from their text
    trainer.pairs.synthetic, trainer.state.diversified_epoch = trainer.pairs.train_ids.both_ways(), 1
    trainer.state.extra_source_epochs = 2  # as planned at epoch 1's start
    _, extra, synthetic = trainer.pairs.segmented(1, trainer.state)
    assert extra is not None and extra.src_ids != plain.src_ids  # a fresh segmentation
    assert synthetic is not None and synthetic.src_ids != trainer.pairs.synthetic.src_ids
    assert (
        trainer.tgt_tok.decode_batch(synthetic.tgt_ids) == trainer.pairs.train_texts[1] + trainer.pairs.train_texts[0]
    )
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=5"]) == 0


def test_an_epochs_leftover_micro_batches_make_one_smaller_update_and_resume_exactly(
    tmp_path: Path, mini_data: Path
) -> None:
    """With train.accum_steps, the batches an epoch has left after its last full update make one
    more update (stop 63: they were dropped, and up to accum_steps - 1 batches of every epoch
    were never trained on); a run stopped right after it resumes into the same weights."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("--set", "train.accum_steps=4", "--set", "train.max_epochs=2", "--set", "train.eval_every=1000")
    assert main(mini_args(mini_data, straight, *common)) == 0
    trainer = train_module.Trainer(load_config(straight / "config.yaml"), straight, resume=True)
    tc = trainer.cfg.train
    batches = [epoch_length(trainer.pairs.train_ids, tc.batch_tokens, tc.seed, epoch) for epoch in (0, 1)]
    assert any(b % 4 for b in batches)  # an epoch with leftovers (9 batches an epoch or so)
    a = load_weights_only(straight / "checkpoints" / "last.pt")
    assert a["state"]["step"] == sum(math.ceil(b / 4) for b in batches) and a["state"]["epoch"] == 2
    # stopped after the first epoch's last (smaller) update, then resumed to the end
    first = math.ceil(batches[0] / 4)
    assert main(mini_args(mini_data, split, *common, "--set", f"train.max_steps={first}")) == 0
    assert main(["train", "--run-dir", str(split), "--resume", "--set", "train.max_steps=10000"]) == 0
    b = load_weights_only(split / "checkpoints" / "last.pt")
    assert b["state"]["step"] == a["state"]["step"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def straight_and_split_at_25(tmp_path: Path, data: Path, *common: str) -> tuple[dict, dict]:
    """A run of 70 steps, and one stopped at step 25 and resumed to 70, which must end in the
    same weights and state. Returns (the straight run's last.pt, the split run's state at 25)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = (*common, "--set", "train.eval_every=25")
    assert main(mini_args(data, straight, *common, "--set", "train.max_steps=70")) == 0
    assert main(mini_args(data, split, *common, "--set", "train.max_steps=25")) == 0
    middle = load_weights_only(split / "checkpoints" / "last.pt")["state"]
    assert main(["train", "--run-dir", str(split), "--resume", "--set", "train.max_steps=70"]) == 0
    a = load_weights_only(straight / "checkpoints" / "last.pt")
    b = load_weights_only(split / "checkpoints" / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert {k: v for k, v in a["state"].items() if k not in ("elapsed", "window_seconds")} == {
        k: v for k, v in b["state"].items() if k not in ("elapsed", "window_seconds")
    }
    return a, middle


def test_bidirectional_epochs_train_both_ways_then_one_way_and_resume_exactly(tmp_path: Path, mini_data: Path) -> None:
    # the epochs that start within 0.75 of the 70 steps train both ways; the split run stops at
    # step 25, inside its second epoch (both ways, about 18 batches each), and resumes to step 70
    a, middle = straight_and_split_at_25(tmp_path, mini_data, "--set", "train.bidirectional=0.75")
    assert middle["epoch"] == 1 and middle["batch"] > 0 and middle["both_ways_epochs"] == 2
    # the epochs that started past 0.75 of the budget: src->tgt only
    n_both = a["state"]["both_ways_epochs"]
    assert 2 <= n_both < a["state"]["epoch"]
    trainer = train_module.Trainer(load_config(tmp_path / "split" / "config.yaml"), tmp_path / "split", resume=True)
    one_way, both = trainer.pairs.of_epoch(n_both, trainer.state), trainer.pairs.of_epoch(n_both - 1, trainer.state)
    assert one_way is trainer.pairs.train_ids and len(both) == 2 * len(one_way)
    assert both.src_ids[len(one_way) :] == one_way.tgt_ids and both.tgt_ids[len(one_way) :] == one_way.src_ids


def test_extra_source_languages_join_the_first_epochs_and_resume_exactly(
    tmp_path: Path, mini_data: Path, shared_data: Path
) -> None:
    # de->en with French as a second source: the epochs that start within 0.85 of the 70 steps
    # add the 400 (fr, en) pairs (21 batches an epoch with them: epoch 1 starts at 0.84 of the
    # split run's 25 steps); the split run stops inside epoch 1 and resumes to step 70
    data = shutil.copytree(mini_data, tmp_path / "data")
    with gzip.open(shared_data / "train.fr.gz", "rt", encoding="utf-8") as f:
        (data / "train.fr").write_text("".join(next(f) for _ in range(400)), encoding="utf-8")
    common = ("--set", "data.extra_src_langs=[fr]", "--set", "train.extra_sources=0.85")
    a, middle = straight_and_split_at_25(tmp_path, data, *common)
    assert middle["epoch"] == 1 and middle["batch"] > 0 and middle["extra_source_epochs"] == 2
    n_extra = a["state"]["extra_source_epochs"]  # epoch 3 started at 0.9 of the 70 steps: without them
    assert n_extra == a["state"]["epoch"] == 3 and a["state"]["batch"] > 0
    trainer = train_module.Trainer(load_config(tmp_path / "split" / "config.yaml"), tmp_path / "split", resume=True)
    real, extra = trainer.pairs.train_ids, trainer.pairs.extra_ids
    assert extra is not None and trainer.pairs.of_epoch(n_extra, trainer.state) is real
    first = trainer.pairs.of_epoch(n_extra - 1, trainer.state)
    assert first.src_ids == real.src_ids + extra.src_ids and first.tgt_ids == real.tgt_ids + extra.tgt_ids
    # the same English targets, French sources through the (de+en) source tokenizer
    french = read_lines(data / "train.fr")
    assert extra.tgt_ids == real.tgt_ids and trainer.src_tok.decode_batch(extra.src_ids) == french


def test_an_epochs_setup_counts_in_the_loops_time_but_not_in_throughput(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.diversify's translations and BPE-dropout's segmentations are made as an epoch starts:
    the time budget counts them, tgt_tok_per_s does not (stop 63: a window with them logged a fifth
    of its neighbours' rate). Each epoch's setup is made to take 1,000 s of a shifted clock."""
    clock, shift = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + shift[0])
    plan = train_module.Trainer._plan_diversify

    def slow_plan(self: train_module.Trainer) -> None:
        plan(self)
        shift[0] += 1000.0

    monkeypatch.setattr(train_module.Trainer, "_plan_diversify", slow_plan)
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=25", "--set", "train.eval_every=100")) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    epochs = train[-1]["epoch"] + 1
    assert len(train) == 25 and epochs >= 3 and shift[0] == 1000.0 * epochs
    assert train[-1]["elapsed_s"] > 1000.0 * epochs  # the loop's time
    # a step has at most train.batch_tokens=1500 target tokens: a window holding 1,000 s would
    # show under 1.5 tok/s; every one is faster than 1,500 tokens in 500 s
    assert min(r["tgt_tok_per_s"] for r in train) > 3.0


def test_diversify_adds_the_models_translations_and_resumes_exactly(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two-way epochs of about 18 batches: epoch 2 starts at step 36, past half of the 70 steps (and
    # of the split run's 45), so both runs translate train there; the split run stops inside it
    common = ("--set", "train.bidirectional=0.5", "--set", "train.diversify=0.5", "--set", "train.ema=0.99")
    common += ("--set", "train.eval_every=35")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(mini_args(mini_data, straight, *common, "--set", "train.max_steps=70")) == 0
    assert main(mini_args(mini_data, split, *common, "--set", "train.max_steps=45")) == 0
    middle = load_weights_only(split / "checkpoints" / "last.pt")
    assert middle["state"]["diversified_epoch"] == middle["state"]["epoch"] == 2 and middle["state"]["batch"] > 0
    assert "synthetic" in middle
    assert main(["train", "--run-dir", str(split), "--resume", "--set", "train.max_steps=70"]) == 0

    a = load_weights_only(straight / "checkpoints" / "last.pt")
    b = load_weights_only(split / "checkpoints" / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["synthetic"][k], b["synthetic"][k]) for k in a["synthetic"])

    trainer = train_module.Trainer(load_config(tmp_path / "split" / "config.yaml"), tmp_path / "split", resume=True)
    real, synthetic = trainer.pairs.train_ids, trainer.pairs.synthetic
    assert synthetic is not None and len(real) < len(synthetic) <= 2 * len(real)
    assert (
        trainer.pairs.of_epoch(1, trainer.state).src_ids == real.src_ids + real.tgt_ids
    )  # before: the real pairs both ways
    later = trainer.pairs.of_epoch(2, trainer.state)
    assert later.src_ids == real.src_ids + synthetic.src_ids and later.tgt_ids == real.tgt_ids + synthetic.tgt_ids
    # forward pairs keep a real source, backward pairs a real target; the model's side is its own
    forward = [(s, t) for s, t in zip(synthetic.src_ids, synthetic.tgt_ids, strict=True) if s in real.src_ids]
    backward = [(s, t) for s, t in zip(synthetic.src_ids, synthetic.tgt_ids, strict=True) if t in real.tgt_ids]
    assert forward and backward and len(forward) + len(backward) >= len(synthetic)
    assert set(map(tuple, real.tgt_ids)) != {tuple(t) for _, t in forward}

    # --resume --set train.diversify=0 leaves them out from here on (stop 53: every later epoch
    # kept them), from the next epoch, since the current one's plan held them
    off = ["train", "--run-dir", str(split), "--resume", "--set", "train.diversify=0", "--set", "train.max_steps=75"]
    assert main(off) == 0
    after = load_weights_only(split / "checkpoints" / "last.pt")
    assert "synthetic" not in after and after["state"]["diversified_epoch"] == -1
    assert after["state"]["epoch"] == b["state"]["epoch"] + 1
    assert "train.diversify changed in the middle of epoch" in (split / "train.log").read_text()
    # and it cannot start in a run never trained both ways (the model translates tgt -> src)
    one_way = tmp_path / "one_way"
    assert main(mini_args(mini_data, one_way, "--set", "train.max_steps=25", "--set", "train.eval_every=100")) == 0
    both = ["--set", "train.bidirectional=0.9", "--set", "train.diversify=0.5", "--set", "train.max_steps=60"]
    result = mtx_here(monkeypatch, "train", "--run-dir", str(one_way), "--resume", *both)
    assert_one_line_error(result, "train.diversify translates train both ways with the model")


@pytest.mark.parametrize("change", ["train.seed=2", "train.batch_tokens=2000"])
def test_a_resume_that_changes_the_batch_plan_mid_epoch_goes_on_from_the_next_epoch(
    tmp_path: Path, mini_data: Path, change: str
) -> None:
    """The position in an epoch counts batches of its plan; another seed or batch size makes
    another plan, whose rest would give some pairs twice that epoch and others not at all
    (stop 53: 674 of 2,000 pairs skipped and 627 seen twice for a new seed)."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=3", "--set", "train.eval_every=100")) == 0
    before = load_weights_only(run / "checkpoints" / "last.pt")["state"]
    assert (before["epoch"], before["batch"]) == (0, 3)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", change, "--set", "train.max_steps=4"]) == 0
    after = load_weights_only(run / "checkpoints" / "last.pt")["state"]
    assert (after["step"], after["epoch"], after["batch"]) == (4, 1, 1)
    key = change.split("=")[0]
    assert (
        f"{key} changed in the middle of epoch 0: training goes on from the start of epoch 1"
        in (run / "train.log").read_text()
    )


def test_a_last_pt_of_an_older_mtx_resumes_where_it_stopped(tmp_path: Path, mini_data: Path) -> None:
    """A key added since a last.pt was saved trained as its default: every last.pt saved before
    data.extra_src_langs went on from the next epoch, "changed in the middle of epoch 0" (stop 64)."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=3", "--set", "train.eval_every=100")) == 0
    path = run / "checkpoints" / "last.pt"
    ckpt = load_weights_only(path)
    del ckpt["config"]["data"]["extra_src_langs"]  # as saved before the key was added
    torch.save(ckpt, path)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]) == 0
    after = load_weights_only(path)["state"]
    assert (after["step"], after["epoch"], after["batch"]) == (4, 0, 4)
    assert "changed in the middle" not in (run / "train.log").read_text()


def test_a_signal_stopped_last_pt_of_an_mtx_before_stop_54_is_validated_where_its_metrics_say(
    tmp_path: Path, mini_data: Path
) -> None:
    """An mtx before stop 54 kept no validated_step, and saved last.pt at any step when a signal
    stopped it. Stop 67: such a step was taken as validated, so a resume said "the save of step 3
    was cut short after last.pt", made an unvalidated step_3.pt and skipped the last validation.
    metrics.jsonl's "valid" records tell which steps were validated."""
    run = tmp_path / "run"
    sets = ["--set", "train.max_steps=3", "--set", "train.eval_every=2", "--set", "train.keep_last=5"]
    assert main(mini_args(mini_data, run, *sets)) == 0
    path, metrics = run / "checkpoints" / "last.pt", run / "metrics.jsonl"
    ckpt = load_weights_only(path)
    del ckpt["state"]["validated_step"]  # as an mtx before stop 54 saved it, stopped at step 3
    torch.save(ckpt, path)
    (run / "checkpoints" / "step_3.pt").unlink()
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(line for line in lines if not ('"valid"' in line and '"step": 3,' in line)))
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=3"]) == 0
    assert "cut short" not in (run / "train.log").read_text()
    valid = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"valid"' in line]
    assert valid == [2, 3] and (run / "checkpoints" / "step_3.pt").is_file()  # step 3 validated now


def test_a_last_pt_whose_training_state_is_malformed_is_one_line(
    tmp_path: Path, mini_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hand-edited last.pt files that every load check passed ended a resume in a traceback (stop 64)."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=3", "--set", "train.eval_every=100")) == 0
    path = run / "checkpoints" / "last.pt"
    good = load_weights_only(path)
    cases = [
        ({"config": [1, 2]}, "its config is not a mapping of sections"),
        ({"state": [1]}, "its training state is not a mapping"),
        ({"state": {**good["state"], "step": "abc"}}, "its training state's step is 'abc', not a count"),
        ({"state": {**good["state"], "epoch": -1}}, "its training state's epoch is -1, not a count"),
        # the first mtx kept no numpy state (stop 65: "cannot restore the training state (KeyError: 'numpy')")
        ({"rng": {k: v for k, v in good["rng"].items() if k != "numpy"}}, "saved by an early mtx"),
    ]
    for change, needle in cases:
        torch.save({**good, **change}, path)
        capsys.readouterr()
        assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{path}: {needle}" in err, err


def test_a_resume_on_other_training_data_goes_on_from_the_next_epoch(tmp_path: Path, mini_data: Path) -> None:
    """The plan's position means nothing over other pairs (stop 54: a replaced train split, or
    another data.dir, went on at the old position); the same data in another directory is the
    same plan."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=3", "--set", "train.eval_every=100")) == 0
    same = shutil.copytree(mini_data, tmp_path / "same")
    resume = ["train", "--run-dir", str(run), "--resume"]
    assert main([*resume, "--set", f"data.dir={same}", "--set", "train.max_steps=4"]) == 0
    state = load_weights_only(run / "checkpoints" / "last.pt")["state"]
    assert (state["step"], state["epoch"], state["batch"]) == (4, 0, 4)
    other = shutil.copytree(mini_data, tmp_path / "other")
    for lang in ("de", "en"):  # the same pairs in another order
        lines = (other / f"train.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
        (other / f"train.{lang}").write_text("".join(lines[::-1]), encoding="utf-8")
    assert main([*resume, "--set", f"data.dir={other}", "--set", "train.max_steps=5"]) == 0
    state = load_weights_only(run / "checkpoints" / "last.pt")["state"]
    assert (state["step"], state["epoch"], state["batch"]) == (5, 1, 1)
    log = (run / "train.log").read_text()
    assert "the training data changed in the middle of epoch 0: training goes on from the start of epoch 1" in log
    assert log.count("changed in the middle of epoch") == 1


def test_a_resume_on_other_val_pairs_is_refused(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """best.pt is kept for the highest val BLEU: a resume whose data.dir holds other val pairs
    compared BLEU over different sentences, and replaced best.pt with a checkpoint that was not
    better on the same ones. A last.pt saved before the val pairs' digest was kept resumes."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_every=1")) == 0
    other = shutil.copytree(mini_data, tmp_path / "other")
    refs = (other / "val.en").read_text(encoding="utf-8").splitlines(keepends=True)
    (other / "val.en").write_text("".join(["A dog runs.\n", *refs[1:]]), encoding="utf-8")
    resume = ["train", "--run-dir", str(run), "--resume", "--set", f"data.dir={other}", "--set", "train.max_steps=4"]
    before = snapshot(run)
    result = mtx_here(monkeypatch, *resume)
    assert_one_line_error(
        result,
        "the val pairs differ from those best.pt was chosen on",
        f"data.dir is {other}, the run validated in {mini_data}",
        f"--run-dir NEW --set data.dir={other} --set train.init_from={run}",
    )
    assert snapshot(run) == before
    # references that differ in invisible ends alone: another val BLEU (stop 65: resumed as the same)
    invisible = shutil.copytree(mini_data, tmp_path / "invisible")
    (invisible / "val.en").write_text("".join(r.rstrip("\n") + "\u200b\n" for r in refs), encoding="utf-8")
    result = mtx_here(monkeypatch, *resume[:-3], f"data.dir={invisible}", "--set", "train.max_steps=4")
    assert_one_line_error(result, "the val pairs differ from those best.pt was chosen on")
    assert snapshot(run) == before
    last = run / "checkpoints" / "last.pt"
    assert load_weights_only(run / "checkpoints" / "best.pt")["val_digest"] == load_weights_only(last)["val_digest"]
    old = load_weights_only(last)
    digest = old.pop("val_digest")
    torch.save(old, last)
    assert mtx_here(monkeypatch, *resume).returncode == 0
    resumed = load_weights_only(last)
    assert resumed["step"] == 4 and resumed["val_digest"] != digest  # the new val pairs' from here on


def test_keep_last_removes_only_step_checkpoints_training_wrote(tmp_path: Path, mini_data: Path) -> None:
    """train.keep_last counted and removed every `step_*.pt`: a user's `step_1_backup.pt` went
    first, as the oldest step."""
    run = tmp_path / "run"
    sets = ["train.max_steps=1", "train.eval_every=1", "train.keep_last=1", "train.eval_sentences=2"]
    assert main(mini_args(mini_data, run, *[a for s in sets for a in ("--set", s)])) == 0
    ckpts = run / "checkpoints"
    mine = ["step_1_backup.pt", "step_x.pt", "step_.pt"]
    for name in mine:
        shutil.copyfile(ckpts / "step_1.pt", ckpts / name)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=3"]) == 0
    assert sorted(p.name for p in ckpts.glob("step_*")) == sorted(["step_3.pt", *mine])
    # keep_last 0 on resume keeps none (stop 61: step_3.pt stayed, and `mtx average` took it for the run's last)
    assert (
        main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4", "--set", "train.keep_last=0"])
        == 0
    )
    assert sorted(p.name for p in ckpts.glob("step_*")) == sorted(mine)


def test_a_stop_between_log_lines_resumes_the_log_window_and_validates_its_last_step(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stop 54: after a stop between two train records the resumed run's first record averaged the
    steps since the resume alone; and a run so stopped, resumed with train.max_steps lowered to
    where it stopped, ended without validating that step (no best.pt, "best_val_bleu": -1.0)."""
    every = ["--set", "train.log_every=5", "--set", "train.eval_every=10"]
    straight = tmp_path / "straight"
    assert main(mini_args(mini_data, straight, *every, "--set", "train.max_steps=10")) == 0
    real = train_module.Trainer.train_step

    def stop_in_step_7(self: train_module.Trainer, group: object) -> object:
        if self.state.step == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop stops after this step, at step 7
        return real(self, group)

    with monkeypatch.context() as m:
        m.setattr(train_module.Trainer, "train_step", stop_in_step_7)
        assert main(mini_args(mini_data, tmp_path / "split", *every, "--set", "train.max_steps=10")) == 128 + 15
    assert load_weights_only(tmp_path / "split" / "checkpoints" / "last.pt")["state"]["window_steps"] == 2
    for name in ("lowered", "budget"):  # the same stopped run, resumed three ways
        shutil.copytree(tmp_path / "split", tmp_path / name)
    assert main(["train", "--run-dir", str(tmp_path / "split"), "--resume"]) == 0
    timed = ("tgt_tok_per_s", "elapsed_s")

    def records(run: Path) -> list[dict]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in timed} for line in lines]

    assert records(tmp_path / "split") == records(straight)  # the step-10 record: steps 6-10, as straight
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "lowered"), "--resume", "--set", "train.max_steps=7"]) == 0
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done["step"] == 7 and done["best_val_bleu"] >= 0, done
    assert (tmp_path / "lowered" / "checkpoints" / "best.pt").is_file()
    assert [e["step"] for e in records(tmp_path / "lowered") if e["event"] == "valid"] == [7]
    # resumed again, it has nothing left to do, and validates nothing twice
    assert main(["train", "--run-dir", str(tmp_path / "lowered"), "--resume", "--set", "train.max_steps=7"]) == 0
    assert [e["step"] for e in records(tmp_path / "lowered") if e["event"] == "valid"] == [7]
    # the same with a time budget already used: it validates step 7 and trains no step (stop 55: step
    # 8 was trained, since the budget is checked after a step)
    assert main(["train", "--run-dir", str(tmp_path / "budget"), "--resume", "--set", "train.max_minutes=1e-6"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 7
    assert [e["step"] for e in records(tmp_path / "budget") if e["event"] == "valid"] == [7]
    assert "done: reached train.max_minutes=1e-06, at step 7" in (tmp_path / "budget" / "train.log").read_text()


def test_checkpoints_without_bpe_dropout_hold_no_segmentation(tiny_run: Path) -> None:
    assert "epoch_ids" not in load_weights_only(tiny_run / "checkpoints" / "last.pt")


def test_full_disks_read_only_disks_and_unreadable_files_are_named_in_one_line(
    tmp_path: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 54: torch.save on a full disk raises RuntimeError ("unexpected pos"), a traceback; a
    read-only disk's error came from removing the temporary file, naming it and not the file; an
    unreadable checkpoint was called corrupted; a tokenizer save on a full disk was a traceback."""
    from mtx import checkpoint as ckpt_io
    from mtx.errors import CheckpointError
    from mtx.tokenizer import BPE

    path = tmp_path / "last.pt"
    ckpt_io.atomic_save({"step": 1}, path)

    def full_disk(obj: object, f: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1531840 vs 1531728")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", full_disk)
        with pytest.raises(
            CheckpointError, match=r"last.pt: cannot write \(\[enforce fail.*MiB left on its disk\); the previous"
        ):
            ckpt_io.atomic_save({"step": 2}, path)
    assert load_weights_only(path) == {"step": 1} and [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    # a file-size limit is named as such (stop 63: "... MiB left on its disk" was said of `ulimit -f`)
    resource = pytest.importorskip("resource")
    code = (
        "import torch; from pathlib import Path; from mtx import checkpoint as c\n"
        f"c.atomic_save({{'w': torch.zeros(400_000)}}, Path({str(tmp_path / 'big.pt')!r}))\n"
    )
    limited = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, resource.RLIM_INFINITY)),
    )
    assert limited.returncode != 0 and "big.pt: cannot write (File too large" in limited.stderr.decode()
    assert "ulimit -f" in limited.stderr.decode() and not (tmp_path / "big.pt").exists()

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(30, "Read-only file system", str(self))

    def no_open(*args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system", str(args[0]))

    with monkeypatch.context() as m:
        m.setattr(Path, "unlink", read_only)
        m.setattr("builtins.open", no_open)
        m.setattr(os, "open", no_open)  # (stop 66: the temporary file is made locked, through os.open)
        with pytest.raises(CheckpointError, match=r"^.*/last.pt: cannot write \(Read-only file system\); the previous"):
            ckpt_io.atomic_save({"step": 2}, path)

    def unreadable(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    with monkeypatch.context() as m:
        m.setattr(ckpt_io.zipfile, "ZipFile", unreadable)
        with pytest.raises(CheckpointError, match=r"last.pt: cannot read \(Permission denied\)$"):
            load_checkpoint(path)

    tok = BPE.load(tiny_run / "tokenizer.json")

    def full(fd: int) -> None:  # where a full disk shows up on a file system that allocates late
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # written and synced before the rename, as a checkpoint (stop 57: unsynced)
        m.setattr(ckpt_io.os, "fsync", full)
        # (stop 58: a first save said "the previous file is unchanged" too)
        with pytest.raises(CheckpointError, match=r"tok.json: cannot write \(No space left on device\); nothing was"):
            tok.save(tmp_path / "tok.json")
        m.undo()
        tok.save(tmp_path / "tok.json")
        m.setattr(ckpt_io.os, "fsync", full)
        with pytest.raises(CheckpointError, match=r"tok.json: cannot write \(No space left on device\); the prev"):
            tok.save(tmp_path / "tok.json")
    assert BPE.load(tmp_path / "tok.json").fingerprint() == tok.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "tok.json"]


def test_a_second_training_on_a_run_directory_in_use_is_refused(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stop 54: a second start took a live start, still setting up, for a dead one and deleted its
    config and tokenizer; both then wrote the same checkpoints and metrics.jsonl."""
    run = tmp_path / "run"
    first = start(tmp_path / "stderr", *mini_args(mini_data, run, "--set", "train.max_steps=100000"))
    try:
        wait_for(lambda: (run / "config.yaml").is_file(), first)  # held from before its config is written
        config = (run / "config.yaml").read_text()
        for argv in (mini_args(mini_data, run, "--set", "train.seed=2"), ["train", "--run-dir", str(run), "--resume"]):
            assert main(argv) == 1
            err = capsys.readouterr().err.strip().splitlines()
            busy = (  # the process named (stop 68's probe: torchrun's ranks, left by its kill -9, were not)
                f"{run}: another mtx command is using this run directory (process {first.pid}: mtx train, "
                "average --as-best or choose_on_val --apply); wait for it to end, or choose another --run-dir"
            )
            assert err[-1] == "mtx: error: " + busy
        assert (run / "config.yaml").read_text() == config and first.poll() is None
        wait_for(lambda: train_lines(run) >= 1, first)
        assert main(["train", "--run-dir", str(run), "--resume"]) == 1
        # nor does a chosen average replace best.pt meanwhile (training replaces it too)
        assert main(["average", "--run", str(run), "--as-best"]) == 1
        assert (
            capsys.readouterr()
            .err.strip()
            .splitlines()[-1]
            .endswith(
                f"another mtx command is using this run directory (process {first.pid}: mtx train, average "
                "--as-best or choose_on_val --apply); best.pt can be changed once it has ended"
            )
        )
        # nor choose_on_val --apply, refused before it decodes (stop 65: after scoring every candidate)
        script = REPO / "scripts" / "choose_on_val.py"
        code, out, err = script_in_process(script, ["--run", str(run), "--apply"], monkeypatch, capsys)
        assert code == 1 and out == "", out
        assert err.strip().splitlines() == [
            f"choose_on_val: error: {run}: another mtx command is using this run directory (process {first.pid}: "
            "mtx train, average --as-best or choose_on_val --apply); best.pt can be changed once it has ended"
        ]
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM, (tmp_path / "stderr").read_text()
    # the lock goes with the process: the run resumes
    steps = load_weights_only(run / "checkpoints" / "last.pt")["step"] + 1
    assert main(["train", "--run-dir", str(run), "--resume", "--set", f"train.max_steps={steps}"]) == 0


# -- stop signals and kill -9 -------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_stop_signal_saves_and_tells_how_to_resume(tmp_path: Path, mini_data: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / os.fsdecode(b"run \xfc")  # an old Latin-1 archive's name: typed back as $'run \374'
    args = mini_args(mini_data, run_dir, "--set", "train.max_steps=100000", "--set", "train.eval_every=1000")
    proc = start(tmp_path / "stderr", *args)
    wait_for(lambda: train_lines(run_dir) >= 3, proc)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    err_text = (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + sig, err_text
    assert "Traceback" not in err_text
    step = load_weights_only(run_dir / "checkpoints" / "last.pt")["step"]
    assert step >= 3
    # the command as this process was started, typed again (stop 62: `mtx`, not on a make user's PATH)
    again = command_line(*own_command(str(REPO / "mtx" / "__main__.py")), "train", "--run-dir", run_dir, "--resume")
    assert err_text.rstrip().splitlines()[-1] == (
        f"mtx: training stopped by {sig.name} at step {step}; checkpoint saved. Resume with: {again}"
    )
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--set", f"train.max_steps={step + 3}"]) == 0
    assert load_weights_only(run_dir / "checkpoints" / "last.pt")["step"] == step + 3


def test_a_command_to_copy_is_read_back_by_a_shell_as_the_same_words(tmp_path: Path) -> None:
    """A run directory whose name is not UTF-8 was named with `\\udcfc` in the "Resume with"
    command, which no shell reads back; one with a newline split the one-line message (stop 67)."""
    words = [os.fsdecode(b"caf\xe9 \xfcab"), "a\nb", "it's", "x\\y", "caf\u00e9 run", "$HOME", "tab\there", "\\\udcff'"]
    line = command_line(*words)
    assert line.isprintable()  # one line, café as it is typed
    assert command_line("caf\u00e9 run") == "'caf\u00e9 run'" and command_line("a\nb") == "$'a\\012b'"
    script = tmp_path / "echo.sh"
    script.write_text(f"printf '%s\\0' {line}\n", encoding="utf-8")
    out = subprocess.run(["bash", str(script)], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [os.fsencode(word) for word in words]


def test_a_run_directory_moved_while_training_is_saved_in_its_new_place(tmp_path: Path, mini_data: Path) -> None:
    """The next save made the old path again, with checkpoints alone, and the moved directory's
    last.pt stayed at the step of the move (stop 65)."""
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    # saves at steps 10, 20, ...: the move at step 3 or so does not race one being written
    args = mini_args(mini_data, run_dir, "--set", "train.max_steps=100000", "--set", "train.eval_every=10")
    proc = start(tmp_path / "stderr", *args)
    try:
        wait_for(lambda: train_lines(run_dir) >= 3, proc)
        run_dir.rename(moved)
        at_move = load_weights_only(moved / "checkpoints" / "last.pt")["step"]
        wait_for(lambda: load_weights_only(moved / "checkpoints" / "last.pt")["step"] >= at_move + 4, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert f"{run_dir} was moved to {moved} while training: the run is saved there from now on" in err
    assert not run_dir.exists()
    step = load_weights_only(moved / "checkpoints" / "last.pt")["step"]
    last_line = err.rstrip().splitlines()[-1]
    assert f"at step {step}; checkpoint saved. Resume with: " in last_line and str(moved) in last_line
    assert main(["train", "--run-dir", str(moved), "--resume", "--set", f"train.max_steps={step + 1}"]) == 0
    # removed: a one-line error at the next save, and no directory made again at its path
    gone = tmp_path / "gone"
    # (no save between step 3 and 20: rmtree does not race a checkpoint being written)
    proc = start(tmp_path / "stderr_gone", *mini_args(mini_data, gone, "--set", "train.eval_every=20"))
    try:
        wait_for(lambda: train_lines(gone) >= 3, proc)
        shutil.rmtree(gone)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    err = (tmp_path / "stderr_gone").read_text()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert f"mtx: error: {gone}: the run directory was removed or replaced while training" in err.splitlines()[-1]
    assert not gone.exists()


def test_a_save_cut_short_after_last_pt_is_completed_on_resume(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A validation saved step_N.pt, ema.pt and best.pt before last.pt, so a kill -9 or a second
    Ctrl-C in last.pt's write left them ahead of it; a resume that went another way kept a best.pt
    and step checkpoints of steps the run never reached (stop 66). Now last.pt is written first,
    and a resume makes again what a cut-short save did not write."""
    common = ["--set", "train.eval_every=10", "--set", "train.keep_last=2", "--set", "train.ema=0.9"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(mini_args(mini_data, straight, *common, "--set", "train.max_steps=20")) == 0
    files = train_module.Trainer._save_step_files

    def killed_at_10(trainer: train_module.Trainer, which: list[str]) -> None:
        if trainer.state.step == 10:
            raise RuntimeError("killed")
        files(trainer, which)

    monkeypatch.setattr(train_module.Trainer, "_save_step_files", killed_at_10)
    with pytest.raises(RuntimeError, match="killed"):
        main(mini_args(mini_data, cut, *common, "--set", "train.max_steps=20"))
    monkeypatch.undo()
    ckpts = cut / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.pt"]  # nothing of step 10 but last.pt
    assert load_weights_only(ckpts / "last.pt")["step"] == 10
    capsys.readouterr()
    assert main(["train", "--run-dir", str(cut), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "the save of step 10 was cut short after last.pt: step_10.pt, ema.pt, best.pt made again from it" in err
    names = ["last.pt", "step_10.pt", "step_20.pt", "ema.pt", "best.pt"]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(names)
    for name in names:
        a, b = (load_weights_only(run / "checkpoints" / name) for run in (straight, cut))
        assert a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name


def test_a_best_pt_an_mtx_before_stop_66_left_ahead_of_last_pt_is_set_aside_on_resume(
    tmp_path: Path, mini_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An mtx before stop 66 wrote step_N.pt, ema.pt and best.pt before last.pt: a kill in
    last.pt's write left them a validation ahead. Stop 66 removed such step checkpoints on resume,
    but kept best.pt: a resume that went another way reported its best at an earlier step while
    best.pt held the killed course's later step (stop 67). It is kept under another name, and the
    step checkpoint of the run's best is best.pt again; ema.pt ahead goes, as step checkpoints do."""
    run = tmp_path / "run"
    common = ["--set", "train.eval_every=10", "--set", "train.keep_last=5", "--set", "train.ema=0.9"]
    assert main(mini_args(mini_data, run, *common, "--set", "train.max_steps=20")) == 0
    ckpts = run / "checkpoints"
    last_20 = (ckpts / "last.pt").read_bytes()
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=30"]) == 0
    shutil.copy(ckpts / "step_30.pt", ckpts / "best.pt")  # the killed validation's best (pre-66 order)
    (ckpts / "last.pt").write_bytes(last_20)  # killed in last.pt's write: step 20's stays
    best_step = load_weights_only(ckpts / "last.pt")["state"]["best_step"]
    # with train.ema now 0, the moving average is not written again: ema.pt stays, named by its own step
    off = shutil.copytree(run, tmp_path / "off")
    capsys.readouterr()
    ema_off = ["train", "--run-dir", str(off), "--resume", "--set", "train.max_steps=25", "--set", "train.ema=0"]
    assert main(ema_off) == 0
    assert "ema.pt stays the moving average of step 30" in capsys.readouterr().err
    assert load_weights_only(off / "checkpoints" / "ema.pt")["step"] == 30
    resume = ["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=20"]  # nothing left to train
    assert main(resume) == 0
    err = capsys.readouterr().err
    assert "removed step_30.pt, ema.pt: saved after last.pt's step 20 by a run cut short" in err
    assert f"it is kept as best_ahead_step_30.pt, and best.pt is step_{best_step}.pt again" in err
    assert load_weights_only(ckpts / "best_ahead_step_30.pt")["step"] == 30
    assert (ckpts / "best.pt").samefile(ckpts / f"step_{best_step}.pt")
    assert load_weights_only(ckpts / "ema.pt")["step"] == 20  # made again from last.pt


def test_fp16_loss_scale_overflows_are_not_taken_for_non_finite_steps(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a GPU without native bf16, `train.amp: auto` trains in fp16 with a loss scaler, which
    skips the update of a step whose scaled gradients overflow, and lowers its scale: each such
    step was warned of as "non-finite loss or gradient" and counted toward train.max_bad_steps
    (stop 68's probe, simulated). fp16 and its scaler on the CPU here, the scale started at 2^40."""
    real = torch.amp.GradScaler
    monkeypatch.setattr(train_module, "amp_dtype", lambda device, amp: torch.float16)
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device, enabled: real(device, 2.0**40, enabled=enabled))
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=4", "--set", "train.eval_every=4")) == 0
    err = capsys.readouterr().err
    assert "non-finite" not in err and err.count("fp16 loss scale lowered to") > 10, err  # above max_bad_steps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records if r["event"] == "train"][-1] == err.count("fp16 loss scale lowered")


def test_a_step_checkpoint_rotated_out_by_a_course_cut_short_is_not_called_a_save_cut_short(
    tmp_path: Path, mini_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An mtx before stop 66, with keep_last 1, wrote step_20.pt and removed step_10.pt before a
    kill in last.pt's write left step 10's: the resume made step_10.pt again, rightly, but said
    that the save of step 10 had been cut short, a save that was whole (stop 67 review)."""
    run = tmp_path / "run"
    common = ["--set", "train.eval_every=10", "--set", "train.keep_last=1"]
    assert main(mini_args(mini_data, run, *common, "--set", "train.max_steps=10")) == 0
    ckpts = run / "checkpoints"
    last_10 = (ckpts / "last.pt").read_bytes()
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=20"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "last.pt", "step_20.pt"]
    (ckpts / "last.pt").write_bytes(last_10)  # killed in last.pt's write (pre-66 order)
    (ckpts / "best.pt").unlink()
    shutil.copy(ckpts / "last.pt", ckpts / "best.pt")  # step 10's best, as it was
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=10"]) == 0
    err = capsys.readouterr().err
    assert "removed step_20.pt: saved after last.pt's step 10 by a run cut short" in err
    assert "step_10.pt made again from last.pt's step 10: the run cut short went on past it" in err
    assert "the save of step 10 was cut short" not in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "last.pt", "step_10.pt"]
    assert load_weights_only(ckpts / "step_10.pt")["step"] == 10


def test_a_setting_changed_on_resume_is_not_taken_for_a_save_cut_short(
    tmp_path: Path, mini_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.ema or keep_last turned on at a resume made ema.pt (the current weights labelled a
    moving average) or a step checkpoint, with a warning that a save had been cut short (stop 66
    review)."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=10", "--set", "train.keep_last=0")) == 0
    capsys.readouterr()
    resume = ["train", "--run-dir", str(run), "--resume", "--set", "train.ema=0.9", "--set", "train.keep_last=2"]
    assert main(resume) == 0
    assert "cut short" not in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "last.pt"]


def test_the_final_line_names_where_a_moved_run_directory_went(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run moved while training and finished there: `mtx train`'s JSON line named the path it
    was started with, which no longer held the run (stop 66)."""
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    follow = train_module.Trainer._follow_run_dir

    def move_at_step_10(trainer: train_module.Trainer) -> None:
        if trainer.state.step == 10 and run_dir.exists():
            run_dir.rename(moved)
        follow(trainer)

    monkeypatch.setattr(train_module.Trainer, "_follow_run_dir", move_at_step_10)
    args = mini_args(mini_data, run_dir, "--set", "train.max_steps=20", "--set", "train.eval_every=10")
    done = main_in_process(args, None, monkeypatch)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.decode().splitlines()[-1])["run_dir"] == str(moved)
    assert not run_dir.exists() and load_weights_only(moved / "checkpoints" / "last.pt")["step"] == 20


def test_signals_ignored_at_start_stay_ignored(tmp_path: Path, mini_data: Path) -> None:
    """`nohup mtx train ... &` saved and stopped when its terminal closed (SIGHUP), and a shell
    script's background job on Ctrl-C (SIGINT): mtx took over the signals those ignore (stop 62)."""
    run_dir = tmp_path / "run"
    args = mini_args(mini_data, run_dir, "--set", "train.max_steps=40", "--set", "train.eval_every=1000")
    proc = start(tmp_path / "stderr", *args, ignored=(signal.SIGHUP, signal.SIGINT))
    wait_for(lambda: train_lines(run_dir) >= 2, proc)
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    err_text = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0 and "received" not in err_text, err_text
    assert load_weights_only(run_dir / "checkpoints" / "last.pt")["step"] == 40


def test_a_stop_signal_in_the_last_validation_lets_the_run_end_complete(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal is taken before the next step; in the last step's validation there is none left:
    the run ends complete, exit 0, and says the signal came as it was ending (stop 57: it said
    "saving a checkpoint and stopping", then "done" without a word on the signal)."""
    validate = train_module.Trainer._evaluate

    def interrupted(self: train_module.Trainer, metrics: object) -> bool:
        os.kill(os.getpid(), signal.SIGTERM)  # caught by mtx's handler, which sets the stop flag
        return validate(self, metrics)

    monkeypatch.setattr(train_module.Trainer, "_evaluate", interrupted)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=3", "--set", "train.eval_every=3")) == 0
    assert "SIGTERM came as the run was ending: it is complete" in capsys.readouterr().err
    last = load_weights_only(run / "checkpoints" / "last.pt")["state"]
    assert last["step"] == last["validated_step"] == 3


def test_a_second_signal_stops_at_once_and_says_what_was_kept(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second Ctrl-C ended in "mtx: interrupted" under the first's "saving a checkpoint and
    stopping", with nothing on what was kept or how to go on (stop 66)."""
    validate = train_module.Trainer._evaluate

    def interrupted_twice(self: train_module.Trainer, metrics: object) -> bool:
        signal.raise_signal(signal.SIGINT)  # sets the stop flag
        signal.raise_signal(signal.SIGINT)  # stops at once
        return validate(self, metrics)

    monkeypatch.setattr(train_module.Trainer, "_evaluate", interrupted_twice)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=20", "--set", "train.eval_every=10")) == 130
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(
        "mtx: training stopped at once by a second SIGINT, without saving; last.pt is from step 0. Resume with: "
    ), last
    monkeypatch.undo()
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0

    def terminated_then_interrupted(self: train_module.Trainer, metrics: object) -> bool:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        return validate(self, metrics)

    monkeypatch.setattr(train_module.Trainer, "_evaluate", terminated_then_interrupted)
    other = tmp_path / "other"
    assert main(mini_args(mini_data, other, "--set", "train.max_steps=20", "--set", "train.eval_every=10")) == 130
    last = capsys.readouterr().err.splitlines()[-1]
    assert "training stopped at once by SIGINT after SIGTERM, without saving; last.pt is from step 0." in last
    # and outside the loop: in the first save of a new run (stop 66 review: still "mtx: interrupted")
    monkeypatch.undo()
    save = train_module.Trainer.save

    def interrupted_in_first_save(self: train_module.Trainer) -> None:
        if self.state.step == 0:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        save(self)

    monkeypatch.setattr(train_module.Trainer, "save", interrupted_in_first_save)
    assert main(mini_args(mini_data, tmp_path / "third", "--set", "train.max_steps=2")) == 130
    last = capsys.readouterr().err.splitlines()[-1]
    assert "training stopped at once by a second SIGINT, without saving; nothing was saved. Resume with" in last


def test_kill_9_never_leaves_a_torn_checkpoint(tmp_path: Path, mini_data: Path) -> None:
    """SIGKILL while last.pt or a step checkpoint is being written, and between saves."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    args = mini_args(
        mini_data,
        run_dir,
        "--set",
        "train.max_steps=100000",
        "--set",
        "train.eval_every=1",
        "--set",
        "train.keep_last=2",
    )

    def saving(prefix: str) -> Callable[[], bool]:
        return lambda: ckpts.is_dir() and any(n.startswith(prefix) for n in os.listdir(ckpts))

    killed_mid_save = 0
    moments = [".last.pt.tmp.", ".step_", None]  # kill while this file is being written; None: any time
    for i, prefix in enumerate(moments):
        resume = ["train", "--run-dir", str(run_dir), "--resume"]
        proc = start(tmp_path / "stderr", *(resume if i else args))
        done = train_lines(run_dir)
        wait_for(lambda: train_lines(run_dir) >= done + 2, proc)  # noqa: B023 - evaluated in this iteration
        if prefix:
            wait_for(saving(prefix), proc, poll=0.0002)
        proc.kill()
        proc.wait(timeout=60)
        leftovers = [p for p in ckpts.iterdir() if ".tmp." in p.name]
        killed_mid_save += bool(leftovers)
        for path in ckpts.glob("*.pt"):
            assert "model" in load_weights_only(path), path
            load_checkpoint(path)  # complete archive, CRC checked
    assert killed_mid_save >= 1  # the cleanup of a torn temporary file was exercised

    step = load_weights_only(ckpts / "last.pt")["step"]
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--set", f"train.max_steps={step + 2}"]) == 0
    assert load_weights_only(ckpts / "last.pt")["step"] == step + 2
    assert not [p for p in ckpts.iterdir() if ".tmp." in p.name]


# -- non-finite steps ----------------------------------------------------------------------------
def poison_loss(monkeypatch: pytest.MonkeyPatch, bad_calls: Callable[[int], bool]) -> None:
    """Make the training loss NaN on the chosen (1-based) training forward passes."""
    real = loss_module.label_smoothed_loss
    calls = [0]

    def loss(model: torch.nn.Module, batch: object, smoothing: float) -> torch.Tensor:
        value = real(model, batch, smoothing)
        if model.training:
            calls[0] += 1
            if bad_calls(calls[0]):
                return value * float("nan")
        return value

    monkeypatch.setattr(loss_module, "label_smoothed_loss", loss)


def test_isolated_non_finite_steps_are_skipped_and_counted(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison_loss(monkeypatch, lambda n: n in (5, 6))
    run_dir = tmp_path / "run"
    assert main(mini_args(mini_data, run_dir, "--set", "train.max_steps=12", "--set", "train.max_bad_steps=3")) == 0
    ckpt = load_weights_only(run_dir / "checkpoints" / "last.pt")
    assert ckpt["state"]["step"] == 12 and ckpt["state"]["skipped_steps"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["skipped_steps"] for e in events if e["event"] == "train"][-1] == 2


def test_diverging_training_stops_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    poison_loss(monkeypatch, lambda n: n > 12)
    run_dir = tmp_path / "run"
    args = mini_args(mini_data, run_dir, "--set", "train.max_steps=30", "--set", "train.eval_every=10")
    assert main([*args, "--set", "train.max_bad_steps=3"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtx: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert "3 non-finite steps in a row after step 12 (train.max_bad_steps)" in lines[0]
    assert "last.pt from step 10 kept" in lines[0] and "train.lr" in lines[0]
    # fp32 is advised only to a run that is not in fp32 already (stop 64)
    assert ("use train.amp=fp32" in lines[0]) != ("precision fp32" in (run_dir / "train.log").read_text())
    # train.log says why the run ended too (stop 63: only stderr did)
    logged = (run_dir / "train.log").read_text().splitlines()[-1]
    assert " ERROR error: 3 non-finite steps in a row after step 12" in logged
    last = load_weights_only(run_dir / "checkpoints" / "last.pt")
    step_10 = load_weights_only(run_dir / "checkpoints" / "step_10.pt")
    assert last["step"] == 10 and last["state"]["skipped_steps"] == 0
    assert all(torch.equal(last["model"][k], step_10["model"][k]) for k in last["model"])
    assert all(torch.isfinite(v).all() for v in last["model"].values())


def test_out_of_memory_in_a_training_step_or_a_decode_is_one_line(
    tmp_path: Path, mini_data: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An allocation that fails in a step (a GPU's most common failure, possibly thousands of steps
    in) or a decode was a 20-40-line traceback with no word on what to lower (stop 63). A step
    that fails before its update saves last.pt as it stood before the step, and a resume with
    nothing changed goes on as a run that never failed (stop 65: last.pt stayed at the last
    validation); one that fails inside the update, whose weights are half-new, keeps last.pt."""
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def out_of_memory_in_step_14(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 14:  # after step 14's forward and backward: dropout drew, gradients are there
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return clip(*args, **kwargs)

    common = ("--set", "train.eval_every=10", "--set", "train.ema=0.9")
    straight, failed = tmp_path / "straight", tmp_path / "failed"
    assert main(mini_args(mini_data, straight, *common, "--set", "train.max_steps=20")) == 0
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", out_of_memory_in_step_14)
    assert main(mini_args(mini_data, failed, *common, "--set", "train.max_steps=20")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtx: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert "out of memory on cpu after step 13 (train.batch_tokens=1500)" in lines[0]
    assert "last.pt saved at step 13" in lines[0] and "--resume --set train.batch_tokens=N (a new batch" in lines[0]
    assert "out of memory" in (failed / "train.log").read_text().splitlines()[-1]
    saved = load_weights_only(failed / "checkpoints" / "last.pt")
    saved_epoch = saved["state"]["epoch"]
    assert lines[0].endswith(f"goes on from epoch {saved_epoch + 1}, the rest of epoch {saved_epoch} not trained on)")
    assert saved["step"] == 13 and saved["state"]["batch"] > 0  # inside an epoch
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    assert main(["train", "--run-dir", str(failed), "--resume"]) == 0
    a = load_weights_only(straight / "checkpoints" / "last.pt")
    b = load_weights_only(failed / "checkpoints" / "last.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for k, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][k][name]) for name, v in state.items())
    assert all(torch.equal(x, y) for x, y in zip(a["ema"]["averages"], b["ema"]["averages"], strict=True))
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["rng"]["python"] == b["rng"]["python"]
    timed = ("elapsed", "window_seconds")
    assert {k: v for k, v in a["state"].items() if k not in timed} == {
        k: v for k, v in b["state"].items() if k not in timed
    }

    update = state_module.MovingAverage.update

    def out_of_memory_in_update_12(self: state_module.MovingAverage) -> None:
        if self.updates == 11:  # step 12's weights are new, its moving average not yet
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        update(self)

    monkeypatch.setattr(state_module.MovingAverage, "update", out_of_memory_in_update_12)
    half = tmp_path / "half"
    assert main(mini_args(mini_data, half, *common, "--set", "train.max_steps=20")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtx: error:")]
    assert len(lines) == 1 and "after step 11 " in lines[0] and "last.pt from step 10 is kept" in lines[0], err
    assert "a new batch size" not in lines[0]  # last.pt's position is not this step's
    assert load_weights_only(half / "checkpoints" / "last.pt")["step"] == 10

    def no_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(search, "greedy_search", no_memory)
    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", "Ein Hund.")
    assert_one_line_error(r, "out of memory decoding on cpu in batches of", "lower --batch-tokens")
    # in training's validation: not --batch-tokens, which `mtx train` refuses, and what is kept (stop 68's probe)
    capsys.readouterr()
    validating = tmp_path / "validating"
    assert main(mini_args(mini_data, validating, *common, "--set", "train.max_steps=20")) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mtx: error:")]
    assert len(lines) == 1 and "after step 10; lower decode.batch_tokens; last.pt from step 0 is kept" in lines[0]
    assert lines[0].endswith("--resume --set decode.batch_tokens=N") and "--batch-tokens" not in lines[0]
    ending = tmp_path / "ending"  # the validation of a run's last step, between two of every eval_every
    assert main(mini_args(mini_data, ending, *common, "--set", "train.max_steps=5")) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mtx: error:")]
    assert len(lines) == 1 and "after step 5; lower decode.batch_tokens" in lines[0], lines


# -- nothing executed ----------------------------------------------------------------------------
class _RunsCode:
    """Unpickling this calls os.system: what a weights-only load must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_malicious_checkpoints_are_refused_without_running_code(
    tmp_path: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    good = load_weights_only(tiny_run / "checkpoints" / "last.pt")
    zip_evil = tmp_path / "evil.pt"
    torch.save({**good, "extra": _RunsCode(marker)}, zip_evil)
    raw_evil = tmp_path / "evil_raw.pt"
    raw_evil.write_bytes(pickle.dumps({"format_version": FORMAT_VERSION, "model": _RunsCode(marker)}, protocol=2))

    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--checkpoint", str(zip_evil), "Ein Hund.")
    assert_one_line_error(r, "evil.pt", "refused to load", "posix.system")
    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--checkpoint", str(raw_evil), "Ein Hund.")
    assert_one_line_error(r, "evil_raw.pt", "refused to load")
    run_copy = copy_run(tiny_run, tmp_path / "run")
    shutil.copy(zip_evil, run_copy / "checkpoints" / "last.pt")
    before = snapshot(run_copy)
    assert_one_line_error(mtx_here(monkeypatch, "train", "--run-dir", str(run_copy), "--resume"), "refused to load")
    assert snapshot(run_copy) == before
    assert not marker.exists()

    torch.load(zip_evil, weights_only=False)  # proof that the payload is live: an unsafe load runs it
    assert marker.exists()


def test_yaml_tags_that_would_run_code_are_rejected(
    tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    config = tmp_path / "evil.yaml"
    config.write_text(f'train:\n  max_steps: !!python/object/apply:os.system ["touch {marker}"]\n')
    assert_one_line_error(
        mtx_here(monkeypatch, "train", "--config", str(config)), "evil.yaml", "python/object/apply:os.system"
    )
    r = mtx_here(
        monkeypatch,
        *tiny_args(
            small_data, tmp_path / "r", "--set", f'train.max_steps=!!python/object/apply:os.system ["touch {marker}"]'
        ),
    )
    assert_one_line_error(r, "train.max_steps must be an integer")
    assert not marker.exists() and not (tmp_path / "r").exists()


# -- an existing run is never overwritten ---------------------------------------------------------
def test_existing_run_is_not_overwritten(tiny_run: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot(tiny_run)
    assert_one_line_error(mtx_here(monkeypatch, *tiny_args(small_data, tiny_run)), "already holds a run", "--resume")
    assert snapshot(tiny_run) == before


# -- bad input catalogue, through the CLI ---------------------------------------------------------
def _data_copy(small_data: Path, dest: Path, edit: Callable[[Path], None]) -> Path:
    shutil.copytree(small_data, dest)
    edit(dest)
    return dest


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _legacy_format(path: Path) -> None:
    torch.save(load_weights_only(path), path, _use_new_zipfile_serialization=False)


def _directory_instead(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _central_entry_flip(offset: int, mask: int) -> Callable[[Path], None]:
    """Flip bits of one field of the 11th member's central-directory entry, which the CRC check
    does not cover: offset 38 (mask 0x10) the directory attribute, 10 the compression method."""

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        entry = [m.start() for m in re.finditer(b"PK\x01\x02", data)][10]
        data[entry + offset] ^= mask
        path.write_bytes(bytes(data))

    return flip


def _edited(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """A checkpoint rewritten by torch.save after `edit` of its contents (a crafted file)."""

    def rewrite(path: Path) -> None:
        ckpt = load_weights_only(path)
        edit(ckpt)
        torch.save(ckpt, path)

    return rewrite


def _doubling_list(depth: int) -> list:
    """[x, x] nested `depth` deep: a few hundred bytes in a pickle, 2**depth leaves when printed."""
    value: list = [0]
    for _ in range(depth):
        value = [value, value]
    return value


def _nan_weights(ckpt: dict) -> None:
    ckpt["model"]["tgt_embed.tokens.weight"][3, 1] = float("nan")


def _bomb_n_heads(ckpt: dict) -> None:
    ckpt["config"]["model"]["n_heads"] = _doubling_list(40)


def _weights_as(make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def edit(ckpt: dict) -> None:
        ckpt["model"]["decoder_norm.weight"] = make(ckpt["model"]["decoder_norm.weight"])

    return edit


def _other_tokenizer(run: Path, small_data: Path) -> None:
    lines = (small_data / "val.en").read_text(encoding="utf-8").splitlines()
    train_bpe([line[::-1] for line in lines], TokenizerConfig(vocab_size=1000)).save(run / "tokenizer.json")


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def _link(run: Path, link: Path) -> Path:
    """A symbolic link to `run`'s config.yaml, beside an average of it in its checkpoints/."""
    shutil.copy(run / "checkpoints" / "last.pt", run / "checkpoints" / "average_last1.pt")
    link.symlink_to(run / "config.yaml")
    return link


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# (name, setup(tmp, small_data, tiny_run) -> (argv, stdin), needles in the error line)
def _resumed_with(*settings: str) -> Callable[[Path, Path, Path], tuple[list[str], None]]:
    """A bad-input case's setup: `--resume` of a copy of the tiny run with `--set` of each setting."""

    def setup(tmp: Path, data: Path, run: Path) -> tuple[list[str], None]:
        sets = [arg for setting in settings for arg in ("--set", setting)]
        return ["train", "--run-dir", str(copy_run(run, tmp / "run")), "--resume", *sets], None

    return setup


BAD_INPUTS: list[tuple[str, Callable[[Path, Path, Path], tuple[list[str], bytes | None]], tuple[str, ...]]] = [
    (
        "malformed YAML",
        lambda t, d, r: (["train", "--config", str(_write(t / "c.yaml", "train:\n  max_steps: [1\n"))], None),
        ("c.yaml", "malformed YAML at line"),
    ),
    (
        "unknown key in YAML",
        lambda t, d, r: (["train", "--config", str(_write(t / "c.yaml", "train:\n  max_step: 3\n"))], None),
        ("c.yaml", "unknown key train.max_step", "did you mean train.max_steps"),
    ),
    (
        "a key twice in YAML (PyYAML would keep the last silently)",
        lambda t, d, r: (
            ["train", "--config", str(_write(t / "c.yaml", "train:\n  max_steps: 3\n  max_steps: 5\n"))],
            None,
        ),
        ("c.yaml", "line 3", "key 'max_steps' appears twice"),
    ),
    (
        "--run-dir holding other files",
        lambda t, d, r: (tiny_args(d, _write(t / "notes.txt", "mine").parent), None),
        ("directory holds other files, not an mtx run", "choose a new or empty --run-dir"),
    ),
    (
        "unknown key in --set",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "model.dmodel=8"), None),
        ("unknown key model.dmodel", "did you mean model.d_model"),
    ),
    (
        "wrong type in YAML",
        lambda t, d, r: (["train", "--config", str(_write(t / "c.yaml", "model:\n  d_model: big\n"))], None),
        ("model.d_model must be an integer", "'big'"),
    ),
    (
        "wrong type in --set",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "train.max_steps=abc"), None),
        ("train.max_steps must be an integer",),
    ),
    (
        "zero size",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "train.batch_tokens=0"), None),
        ("train.batch_tokens must be > 0",),
    ),
    (
        "negative size",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "model.d_model=-64"), None),
        ("model.d_model must be > 0",),
    ),
    (
        "NaN in --set",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "train.lr=nan"), None),
        ("train.lr must be a finite number, got 'nan'",),
    ),
    (
        "seed out of range",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "train.seed=-1"), None),
        ("train.seed must be in [0, 2**32), got -1",),
    ),
    (
        "data.max_len below every training pair (found after the tokenizer is trained)",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "data.max_len=1"), None),
        ("data.max_len=1: all", "training pairs are longer than that in BPE tokens; raise data.max_len"),
    ),
    (
        "more accumulation steps than an epoch has batches",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "train.accum_steps=100000"), None),
        ("fewer than train.accum_steps=100000: lower train.accum_steps or train.batch_tokens",),
    ),
    (
        "d_model not divisible by n_heads",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "model.n_heads=3"), None),
        ("model.d_model (64) must be divisible by model.n_heads (3)",),
    ),
    (
        "missing data directory",
        lambda t, d, r: (tiny_args(t / "nowhere", t / "r"), None),
        ("data.dir", "nowhere", "does not exist"),
    ),
    (
        "missing split",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "data.valid_split=dev"), None),
        ("dev.de", "split 'dev' missing"),
    ),
    (
        "missing extra source language",
        lambda t, d, r: (
            tiny_args(d, t / "r", "--set", "data.extra_src_langs=[fr]", "--set", "train.extra_sources=0.5"),
            None,
        ),
        ("train.fr", "language 'fr' not in it"),
    ),
    (
        "mismatched line counts",
        lambda t, d, r: (
            tiny_args(_data_copy(d, t / "d", lambda p: _drop_last(p / "val.en")), t / "r"),
            None,
        ),
        ("val.de has 200 lines", "val.en has 199", "same number of lines"),
    ),
    (
        "a data file that is a directory (stop 57: 'no val.en or val.en.gz')",
        lambda t, d, r: (tiny_args(_data_copy(d, t / "d", lambda p: _directory_instead(p / "val.en")), t / "r"), None),
        ("val.en: not a regular file (a directory, a broken link or a device)",),
    ),
    (
        "empty line in data",
        lambda t, d, r: (tiny_args(_data_copy(d, t / "d", lambda p: _blank_line(p / "train.de", 7)), t / "r"), None),
        ("train.de: line 7 is empty",),
    ),
    (
        "non-UTF-8 bytes in data",
        lambda t, d, r: (tiny_args(_data_copy(d, t / "d", lambda p: _bad_bytes(p / "train.en", 5)), t / "r"), None),
        ("train.en: line 5 is not valid UTF-8",),
    ),
    (
        "non-UTF-8 bytes on translate's standard input",
        lambda t, d, r: (["translate", "--run", str(r)], b"Ein Hund.\n\xff\xfe\n"),
        ("standard input: line 2 is not valid UTF-8",),
    ),
    (
        "non-UTF-8 bytes in a translate argument",
        lambda t, d, r: (["translate", "--run", str(r), "Ein Hund.", os.fsdecode(b"\xff\xfe")], None),
        ("TEXT argument 2 is not valid UTF-8",),
    ),
    (
        "translate --beam 0",
        lambda t, d, r: (["translate", "--run", str(r), "--beam", "0", "x"], None),
        ("--beam must be from 1 to 1,000, got 0",),
    ),
    (
        "translate --length-penalty nan",
        lambda t, d, r: (["translate", "--run", str(r), "--length-penalty", "nan", "x"], None),
        ("--length-penalty must be a number from 0 to 10, got nan",),
    ),
    (
        "translate --length-penalty 1000 (a float overflow in the search: a traceback before stop 53)",
        lambda t, d, r: (["translate", "--run", str(r), "--beam", "3", "--length-penalty", "1000", "x"], None),
        ("--length-penalty must be a number from 0 to 10, got 1000.0",),
    ),
    (
        "translate --threads beyond this machine's CPUs (a few thousand crashed OpenMP)",
        lambda t, d, r: (["translate", "--run", str(r), "--threads", "100000", "x"], None),
        ("--threads must be 0 (torch's choice) to", "got 100000"),
    ),
    (
        "eval --output a directory (found before decoding)",
        lambda t, d, r: (["eval", "--run", str(r), "--data-dir", str(d), "--output", str(t)], None),
        ("--output", "is a directory; give the hypotheses file's path"),
    ),
    (
        "eval --workers -1",
        lambda t, d, r: (["eval", "--run", str(r), "--workers", "-1"], None),
        ("--workers must be >= 0",),
    ),
    (
        "run directory without checkpoints (translate)",
        lambda t, d, r: (["translate", "--run", str(copy_run(r, t / "run", ())), "x"], None),
        ("no checkpoints yet",),
    ),
    (
        "run directory without checkpoints (resume)",
        lambda t, d, r: (["train", "--run-dir", str(copy_run(r, t / "run", ())), "--resume"], None),
        ("nothing to resume", "--config"),
    ),
    (
        "resume a run that lost its last.pt (stop 54: the advice sent the user to a start refused in place)",
        lambda t, d, r: (
            [
                "train",
                "--run-dir",
                str(_write(copy_run(r, t / "run", ("best.pt",)) / "metrics.jsonl", "").parent),
                "--resume",
            ],
            None,
        ),
        ("cannot resume: checkpoints/last.pt is missing", "--run-dir NEW --set train.init_from=", "best.pt"),
    ),
    (
        "eval --output over another run's last.pt (stop 54: only the --run's files were protected)",
        lambda t, d, r: (
            [
                "eval",
                "--run",
                str(r),
                "--data-dir",
                str(d),
                "--output",
                str(copy_run(r, t / "o") / "checkpoints" / "last.pt"),
            ],
            None,
        ),
        ("is one of the files of the run", "pass --output with another path"),
    ),
    (
        "eval --output through a link to another run's config (stop 54: written through)",
        lambda t, d, r: (
            ["eval", "--run", str(r), "--data-dir", str(d), "--output", str(_link(copy_run(r, t / "o"), t / "l.yaml"))],
            None,
        ),
        ("l.yaml is one of the files of the run",),
    ),
    (
        "average --out over another run's best.pt",
        lambda t, d, r: (
            ["average", "--run", str(r), "--out", str(copy_run(r, t / "o", ("best.pt",)) / "checkpoints" / "best.pt")],
            None,
        ),
        ("--out", "is one of the files of the run", "give another path for the average"),
    ),
    (
        "average --out over another run's average",
        lambda t, d, r: (
            [
                "average",
                "--run",
                str(r),
                "--out",
                str(_link(copy_run(r, t / "o"), t / "l.yaml").parent / "o" / "checkpoints" / "average_last1.pt"),
            ],
            None,
        ),
        ("average_last1.pt is one of the files of the run",),
    ),
    (
        "average of a run directory that does not exist",
        lambda t, d, r: (["average", "--run", str(t / "nowhere")], None),
        ("nowhere: run directory not found",),
    ),
    (
        "resume a run directory that does not exist",
        lambda t, d, r: (["train", "--run-dir", str(t / "nowhere"), "--resume"], None),
        ("run directory not found",),
    ),
    (
        "truncated checkpoint (translate)",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _truncate)), "x"], None),
        ("last.pt: truncated or corrupted checkpoint",),
    ),
    (
        "truncated checkpoint (resume)",
        lambda t, d, r: (["train", "--run-dir", str(_damaged(r, t, _truncate)), "--resume"], None),
        ("last.pt: truncated or corrupted checkpoint",),
    ),
    (
        "a whole checkpoint in torch's legacy format (called truncated or corrupted before stop 64)",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _legacy_format)), "x"], None),
        ("last.pt: a plain pickle or torch's legacy (pre-1.6) format, not the zip archive",),
    ),
    (
        "a checkpoint without format_version ('format None is not supported' before stop 64)",
        lambda t, d, r: (
            ["translate", "--run", str(_damaged(r, t, _edited(lambda c: c.pop("format_version")))), "x"],
            None,
        ),
        ("last.pt: not an mtx checkpoint (no format_version)",),
    ),
    (
        "a checkpoint without its vocabulary's fingerprint ('fingerprint mismatch' before stop 64)",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _edited(lambda c: c.pop("vocab")))), "x"], None),
        ("last.pt: no vocabulary fingerprint ('vocab')",),
    ),
    (
        "bit-flipped checkpoint",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _flip_byte)), "x"], None),
        ("last.pt: corrupted checkpoint", "CRC"),
    ),
    (
        "a directory bit flipped in the archive's central directory (another tensor's numbers loaded before stop 62)",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _central_entry_flip(38, 0x10))), "x"], None),
        ("last.pt: corrupted checkpoint (the archive's entry for archive/data/", "is not as torch.save writes it"),
    ),
    (
        "a compression-method bit flipped (a NotImplementedError traceback before stop 62)",
        lambda t, d, r: (["train", "--run-dir", str(_damaged(r, t, _central_entry_flip(10, 0x01))), "--resume"], None),
        ("last.pt: ",),
    ),
    (
        "NaN weights (beam search's IndexError traceback, greedy's empty lines before stop 62)",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _edited(_nan_weights))), "x"], None),
        ("last.pt: ", "tokens.weight holds NaN or infinite weights"),
    ),
    (
        "a checkpoint's n_heads a list of 2**40 shared items (its error message hung, growing, before stop 62)",
        lambda t, d, r: (["translate", "--run", str(_damaged(r, t, _edited(_bomb_n_heads))), "x"], None),
        ("last.pt: the checkpoint was trained with model.n_heads=[[[[...], [...]], [[...], [...]]], [[[",),
    ),
    *[
        (
            f"{kind} weights (a traceback or a silent cast before stop 62)",
            lambda t, d, r, make=make: (
                ["translate", "--run", str(_damaged(r, t, _edited(_weights_as(make)))), "x"],
                None,
            ),
            ("last.pt: ", needle),
        )
        for kind, make, needle in [
            ("sparse", torch.Tensor.to_sparse, "not an mtx checkpoint (decoder_norm.weight is a sparse_coo float32"),
            ("meta", lambda w: w.to("meta"), "not an mtx checkpoint (decoder_norm.weight is a strided float32 meta"),
            ("complex", lambda w: w.to(torch.complex64), "decoder_norm.weight is a strided complex64 tensor"),
            ("integer", lambda w: w.long(), "decoder_norm.weight holds torch.int64 numbers, the model torch.float32"),
        ]
    ],
    (
        "checkpoint from another vocabulary",
        lambda t, d, r: (["translate", "--run", str(_other_vocab(r, t, d)), "x"], None),
        ("vocabulary differs",),
    ),
    (
        "checkpoint of another model shape",
        lambda t, d, r: (["translate", "--run", str(_other_shape(r, t)), "x"], None),
        ("the checkpoint was trained with model.d_ff=128, the run's config has 256",),
    ),
    (
        "checkpoint of another n_heads (no shape changes: it loaded into the wrong model before stop 53)",
        lambda t, d, r: (["translate", "--run", str(_other_setting(r, t, "n_heads: 4", "n_heads: 8")), "x"], None),
        ("last.pt: the checkpoint was trained with model.n_heads=4, the run's config has 8",),
    ),
    (
        "checkpoint without FixNorm (no shape changes)",
        lambda t, d, r: (
            ["translate", "--run", str(_other_setting(r, t, "fix_norm: false", "fix_norm: true")), "x"],
            None,
        ),
        ("the checkpoint was trained with model.fix_norm=False, the run's config has True",),
    ),
    (
        "checkpoint of an older mtx, before model.fix_norm, in a FixNorm run (stop 67: decoded as one)",
        lambda t, d, r: (
            [
                "translate",
                "--run",
                str(_edit_run(_saved_without(r, t, "model", "fix_norm"), "fix_norm: false", "fix_norm: true")),
                "x",
            ],
            None,
        ),
        ("the checkpoint was trained with model.fix_norm=False, the run's config has True",),
    ),
    (
        "resume of an older mtx's run, before model.fix_norm, turning it on (stop 67: it trained on as FixNorm)",
        lambda t, d, r: (
            [
                "train",
                "--run-dir",
                str(_saved_without(r, t, "model", "fix_norm")),
                "--resume",
                "--set",
                "model.fix_norm=true",
            ],
            None,
        ),
        ("--resume cannot change model.fix_norm", "False", "True"),
    ),
    (
        "resume changing the model shape",
        _resumed_with("model.d_ff=256"),
        ("--resume cannot change model.d_ff", "128", "256"),
    ),
    (
        "resume changing the optimizer",
        _resumed_with("train.optimizer=adamw"),
        ("--resume cannot change train.optimizer", "'adam'", "'adamw'"),
    ),
    (
        "resume changing the model shape, with lines logged while the data is read (stop 55: train.log)",
        _resumed_with("model.d_ff=256", "data.max_len=8"),
        ("--resume cannot change model.d_ff", "128", "256"),
    ),
    (
        "resume changing the val sentences best.pt was chosen on (stop 55)",
        _resumed_with("train.eval_sentences=2"),
        (
            "the val pairs differ from those best.pt was chosen on (train.eval_sentences is 2, the run validated on",
            "resume with --set train.eval_sentences=100, or start a new run from it: ",  # (stop 63: not said)
            "--run-dir NEW --set train.eval_sentences=2 --set train.init_from=",
        ),
    ),
    (
        "resume changing the length cap best.pt's val BLEU was scored under (stop 66)",
        _resumed_with("decode.max_len_b=3"),
        ("--resume cannot change decode.max_len_b (the run was trained with 10, now 3); start a new run for that",),
    ),
    (
        "resume changing tokenizer.joint (stop 55: 'no tokenizer.de.json; is this an mtx run directory?')",
        _resumed_with("tokenizer.joint=false"),
        ("--resume cannot change tokenizer.joint", "True", "False"),
    ),
    # stop 56, found by fuzzing: each of these was a traceback, a wrong blame or a silent default
    (
        "a ~user that does not exist in data.dir (stop 56: Path.expanduser's traceback)",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "data.dir=~no_such_user_mtx/x"), None),
        ("data.dir: cannot expand ~no_such_user_mtx", "no such user"),
    ),
    (
        "a vocabulary size the tokenizers library aborts the process for (stop 56: exit 134)",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "tokenizer.vocab_size=1000000000"), None),
        ("tokenizer.vocab_size must be at most 1,000,000, got 1,000,000,000",),
    ),
    (
        "a model that cannot be allocated (stop 56: the allocator's traceback after the tokenizer)",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "model.d_model=65536", "--set", "model.d_ff=1048576"), None),
        ("the model does not fit in memory on cpu", "model.d_ff 1048576", "make it smaller"),
    ),
    (
        "YAML nested thousands deep (stop 56: a 2,990-line RecursionError)",
        lambda t, d, r: (["train", "--config", str(_write(t / "c.yaml", "train: " + "[" * 5000 + "]" * 5000))], None),
        ("c.yaml: malformed YAML: nested too deeply",),
    ),
    (
        "an empty config file (stop 56: trained the defaults, 10,000 steps)",
        lambda t, d, r: (["train", "--config", str(_write(t / "c.yaml", "# nothing yet\n"))], None),
        ("c.yaml: the config is empty",),
    ),
    (
        "--set without a key (stop 56: 'unknown key ' and nothing after it)",
        lambda t, d, r: (tiny_args(d, t / "r", "--set", "=5"), None),
        ("--set '=5': no key before '='",),
    ),
    (
        "an emptied config.yaml of a run (stop 56: blamed the checkpoint for d_model 64 against 256)",
        lambda t, d, r: (["translate", "--run", str(_emptied_config(r, t)), "Hallo"], None),
        ("config.yaml: no data, tokenizer, model, train, decode sections", "restore it from a copy"),
    ),
    (
        "eval --split given a path (stop 56: read files elsewhere and wrote its hypotheses beside them)",
        lambda t, d, r: (["eval", "--run", str(r), "--split", str(d / "val")], None),
        ("--split takes a split name", "for files use --src/--ref"),
    ),
    (
        "best.pt a directory (stop 56: translate took last.pt without a word)",
        lambda t, d, r: (["translate", "--run", str(_best_a_directory(r, t)), "Hallo"], None),
        ("best.pt: a directory, not a checkpoint file",),
    ),
    (
        "a beam too wide to allocate (stop 56: 1e10 was a traceback, 1e8 ran for minutes)",
        lambda t, d, r: (["translate", "--run", str(r), "--beam", "10000000000", "Hallo"], None),
        ("--beam must be from 1 to 1,000, got 10000000000",),
    ),
    (
        "resume with metrics.jsonl a directory (stop 58: config.yaml took the --set first)",
        lambda t, d, r: (
            [
                "train",
                "--run-dir",
                str(_mkdir(copy_run(r, t / "run") / "metrics.jsonl").parent),
                "--resume",
                "--set",
                "train.max_steps=300",
            ],
            None,
        ),
        ("metrics.jsonl: not a file", "move it away"),
    ),
    (
        "--run-dir a dangling symbolic link (stop 58: 'File exists')",
        lambda t, d, r: (tiny_args(d, _symlink(t / "run", t / "gone")), None),
        ("run: a symbolic link to", "gone, which does not exist", "choose another --run-dir"),
    ),
]


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def _best_a_directory(run: Path, tmp: Path) -> Path:
    copy = copy_run(run, tmp / "run")
    (copy / "checkpoints" / "best.pt").mkdir()
    return copy


def _emptied_config(run: Path, tmp: Path) -> Path:
    copy = copy_run(run, tmp / "run")
    (copy / "config.yaml").write_text("")
    return copy


def _drop_last(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("".join(lines[:-1]), encoding="utf-8")


def _blank_line(path: Path, line: int) -> None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[line - 1] = "\n"
    path.write_text("".join(lines), encoding="utf-8")


def _bad_bytes(path: Path, line: int) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = b"Ein \xff\xfe Hund\n"
    path.write_bytes(b"".join(lines))


def _damaged(run: Path, tmp: Path, damage: Callable[[Path], None]) -> Path:
    copy = copy_run(run, tmp / "run")
    damage(copy / "checkpoints" / "last.pt")
    return copy


def _other_vocab(run: Path, tmp: Path, small_data: Path) -> Path:
    copy = copy_run(run, tmp / "run")
    _other_tokenizer(copy, small_data)
    return copy


def _saved_without(run: Path, tmp: Path, section: str, key: str) -> Path:
    """A copy of `run` whose last.pt is an older mtx's, from before `section.key` existed."""
    copy = copy_run(run, tmp / "run")
    last = copy / "checkpoints" / "last.pt"
    ckpt = load_weights_only(last)
    del ckpt["config"][section][key]
    torch.save(ckpt, last)
    return copy


def _other_setting(run: Path, tmp: Path, old: str, new: str) -> Path:
    return _edit_run(copy_run(run, tmp / "run"), old, new)


def _edit_run(run: Path, old: str, new: str) -> Path:
    _edit(run / "config.yaml", old, new)
    return run


def test_a_restricted_checkpoint_of_a_larger_vocabulary_is_a_one_line_error(
    tiny_restricted_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run's restricted-output checkpoint whose pieces lie beyond this run's vocabulary:
    the model was built from its output ids before the vocabularies were compared, a traceback
    (stop 53)."""
    ckpt = load_weights_only(tiny_restricted_run / "checkpoints" / "last.pt")
    ckpt["vocab"] = "another:vocabulary"
    ckpt["model"]["output_ids"] = torch.cat([ckpt["model"]["output_ids"], torch.tensor([5000])])
    other = tmp_path / "other.pt"
    torch.save(ckpt, other)
    result = mtx_here(monkeypatch, "translate", "--run", str(tiny_restricted_run), "--checkpoint", str(other), "x")
    assert_one_line_error(result, f"{other}: vocabulary differs from the run's tokenizer")


def _other_shape(run: Path, tmp: Path) -> Path:
    copy = copy_run(run, tmp / "run")
    _edit(copy / "config.yaml", "d_ff: 128", "d_ff: 256")
    return copy


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_error_and_changes_nothing(
    case: tuple, tmp_path: Path, small_data: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, setup, needles = case
    argv, stdin = setup(tmp_path, small_data, tiny_run)
    # run from an empty directory of tmp_path: a file made relative to the working directory is seen
    # too (stop 69's probe: they ran from the checkout, which was not looked at)
    (tmp_path / "cwd").mkdir()
    before = snapshot(tmp_path, tiny_run)
    assert_one_line_error(main_in_process(argv, stdin, monkeypatch, tmp_path / "cwd"), *needles)
    assert snapshot(tmp_path, tiny_run) == before  # nothing created, changed or removed


class GoneReader(io.StringIO):
    """Standard error whose reader has gone (`mtx train 2>&1 | tee log`, tee killed): EPIPE."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_training_goes_on_when_standard_error_cannot_be_written(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 55: the progress bar's next write ended the run with exit 141, and the steps since the
    last checkpoint were lost; now the bar ends, training goes on and train.log keeps the record."""
    monkeypatch.setattr(sys, "stderr", GoneReader())
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=6", "--set", "train.eval_every=6")) == 0
    assert load_weights_only(run / "checkpoints" / "last.pt")["step"] == 6
    assert "done: reached train.max_steps=6, at step 6" in (run / "train.log").read_text()


def test_a_failed_start_leaves_its_empty_directory_for_the_fixed_config(
    tmp_path: Path, mini_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setup error found after the run directory was written (here: after the tokenizer was
    trained) removes what that start wrote, so the same --run-dir takes the corrected config."""
    run = tmp_path / "run"
    run.mkdir()
    assert main(mini_args(mini_data, run, "--set", "data.max_len=1")) == 1
    assert "raise data.max_len" in capsys.readouterr().err
    assert run.is_dir() and not any(run.iterdir())  # it was there, empty: it stays, empty
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_every=2")) == 0


class FullDisk(io.StringIO):
    """A file on a full disk: every write fails with ENOSPC."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        """A descriptor whose writes fail alike (metrics.jsonl is written through its descriptor)."""
        if not os.path.exists("/dev/full"):
            pytest.skip("needs /dev/full")
        if not hasattr(self, "fd"):
            self.fd = os.open("/dev/full", os.O_WRONLY)
        return self.fd

    def close(self) -> None:
        if hasattr(self, "fd"):
            os.close(self.__dict__.pop("fd"))
        super().close()


def test_a_train_log_that_cannot_be_written_is_one_warning(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 58: train.log on a full disk printed logging's traceback ("--- Logging error ---") at
    every record, and its close in the cleanup replaced the error that had stopped a failed start
    (`raise data.max_len` became `No space left on device`) and left the half-made run behind."""
    monkeypatch.setattr(logging.FileHandler, "_open", lambda self: FullDisk(self.baseFilename))
    run = tmp_path / "run"
    warning = (
        f"{run / 'train.log'}: cannot write (No space left on device); the run's messages go to standard error only"
    )
    failed = main_in_process(mini_args(mini_data, run, "--set", "data.max_len=1"), None, monkeypatch)
    err = failed.stderr.decode()
    assert failed.returncode == 1 and err.splitlines()[-1].startswith("mtx: error: data.max_len=1: all 400"), err
    assert err.splitlines().count(warning) == 1 and "Logging error" not in err and "Traceback" not in err, err
    assert not run.exists()
    steps = ("--set", "train.max_steps=2", "--set", "train.eval_every=2")
    done = main_in_process(mini_args(mini_data, run, *steps), None, monkeypatch)
    err = done.stderr.decode()
    assert done.returncode == 0 and err.splitlines().count(warning) == 1 and "Logging error" not in err, err
    assert load_weights_only(run / "checkpoints" / "last.pt")["step"] == 2


def test_a_metrics_log_that_cannot_be_written_is_named_in_one_line(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 58: a full disk at a metrics.jsonl record said `mtx: error: No space left on device`,
    naming no file."""
    real_open = Path.open

    def full_metrics(self: Path, mode: str = "r", *args: object, **kwargs: object) -> object:
        if self.name == "metrics.jsonl" and mode == "a":
            return FullDisk(str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full_metrics)
    run = tmp_path / "run"
    result = main_in_process(mini_args(mini_data, run, "--set", "train.max_steps=2"), None, monkeypatch)
    assert_one_line_error(result, f"mtx: error: {run / 'metrics.jsonl'}: No space left on device")
    assert load_weights_only(run / "checkpoints" / "last.pt")["step"] == 0  # saved before the first record


def test_commands_to_copy_quote_their_paths(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands mtx gives to resume, restart or start from a run work when pasted into a shell
    (stop 58: a run directory with a space or `$` in its name was not quoted)."""
    run = tmp_path / "a run's $dir"
    real = train_module.Trainer.train_step

    def stop_in_step_1(self: train_module.Trainer, group: object) -> object:
        if self.state.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop stops after this step
        return real(self, group)

    with monkeypatch.context() as m:
        m.setattr(train_module.Trainer, "train_step", stop_in_step_1)
        assert main(mini_args(mini_data, run, "--set", "train.eval_every=2")) == 128 + signal.SIGTERM

    def pasted(after: str) -> list[str]:
        return shlex.split(capsys.readouterr().err.strip().splitlines()[-1].split(after, 1)[1])

    resume = pasted("Resume with: ")
    assert resume == ["mtx", "train", "--run-dir", str(run), "--resume"]
    assert main([*resume[1:], "--set", "train.max_steps=2"]) == 0
    (run / "checkpoints" / "last.pt").unlink()
    assert main(["train", "--run-dir", str(run), "--resume"]) == 1
    best = run / "checkpoints" / "best.pt"
    config = ["mtx", "train", "--config", str(run / "config.yaml"), "--run-dir"]
    assert pasted("start a new run from one: ") == [*config, "NEW", "--set", f"train.init_from={best}"]
    shutil.rmtree(run / "checkpoints")
    # a run that trained (its metrics.jsonl) without checkpoints cannot be started over: stop 69's
    # probe found "no checkpoints yet; train it first" and a command that was refused
    lost = r"holds no best.pt or last.pt, though the run trained \(its metrics.jsonl says so\): "
    with pytest.raises(MtxError, match=lost + r"put them back, or train again in a new --run-dir$"):
        load_run(run)
    (run / "checkpoints").mkdir()  # a step file left: it is named (stop 69's review)
    (run / "checkpoints" / "step_2.pt").write_bytes(b"")
    with pytest.raises(MtxError, match=lost + rf"give its newest step checkpoint \({re.escape(str(run))}/checkpoints"):
        load_run(run)
    shutil.rmtree(run / "checkpoints")
    assert main([*config[1:], str(run)]) == 1 and "already holds a run" in capsys.readouterr().err
    # while a training holds the run (setting up: no checkpoint yet), that command would be refused
    with (
        run_dir_lock(run),
        pytest.raises(
            MtxError,
            match=rf"using this run directory \(process {os.getpid()}: mtx train, average --as-best or choose_on_val "
            r"--apply\); its first",
        ),
    ):
        load_run(run)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(MtxError, match="no checkpoints yet; train it first: ") as refused:
        load_run(run)
    assert shlex.split(str(refused.value).split("train it first: ")[1]) == [*config, str(run)]
    assert main(["train", "--run-dir", str(run), "--resume"]) == 1
    assert pasted("start it again with: ") == [*config, str(run)]


@pytest.mark.parametrize(
    "error",
    [RuntimeError("boom"), KeyboardInterrupt(), signal.SIGTERM],
    ids=["unexpected error", "Ctrl-C", "SIGTERM"],
)
def test_any_failure_while_setting_up_leaves_no_half_made_run(
    tmp_path: Path,
    mini_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: BaseException | signal.Signals,
) -> None:
    """Not only mtx's own setup errors: anything that stops a new run before its first checkpoint
    (here while building the model, after config.yaml and the tokenizer were written) removes what
    it wrote; before, the corrected command was refused as "already holds a run" and --resume as
    "nothing to resume". A stop signal while setting up stops at once (stop 53: it was held until
    setup ended, then a step-0 run was saved and kept)."""

    def fail(*args: object, **kwargs: object) -> None:
        if isinstance(error, signal.Signals):
            signal.raise_signal(error)
            time.sleep(30)  # not reached: the signal stops setting up at once
        raise error

    monkeypatch.setattr(train_module.ckpt_io, "build_model", fail)
    run = tmp_path / "new" / "run"  # (stop 58: the directories made above the run were left)
    if isinstance(error, signal.Signals):
        assert main(mini_args(mini_data, run)) == 128 + error
        assert capsys.readouterr().err.splitlines()[-1] == (
            "mtx: training stopped by SIGTERM while setting up; nothing was saved"
        )
    elif isinstance(error, KeyboardInterrupt):
        assert main(mini_args(mini_data, run)) == 130
    else:
        with pytest.raises(RuntimeError, match="boom"):
            main(mini_args(mini_data, run))
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_every=2")) == 0


def test_a_stop_signal_before_the_model_is_made_stops_at_once(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal while the run directory was checked and prepared was only flagged: the tokenizer
    trained, step 0 was saved and the new run kept (stop 66). A resume stopped there keeps its
    last.pt as it was."""
    digest = train_module.val_digest

    def signalled(*args: object) -> str:
        signal.raise_signal(sig)
        return digest(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "val_digest", signalled)
    run = tmp_path / "new" / "run"
    for sig, argv in (
        (signal.SIGINT, mini_args(mini_data, run)),
        (signal.SIGTERM, ["train", "--run-dir", str(tmp_path / "old"), "--resume", "--set", "train.max_steps=4"]),
    ):
        if sig == signal.SIGTERM:
            monkeypatch.undo()
            assert main(mini_args(mini_data, tmp_path / "old", "--set", "train.max_steps=2")) == 0
            before = snapshot(tmp_path / "old" / "checkpoints")
            capsys.readouterr()
            monkeypatch.setattr(train_module, "val_digest", signalled)
        assert main(argv) == 128 + sig
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == f"mtx: training stopped by {sig.name} while setting up; nothing was saved"
        assert "trained BPE" not in err
    assert not (tmp_path / "new").exists()
    assert snapshot(tmp_path / "old" / "checkpoints") == before


def test_a_start_killed_before_its_first_checkpoint_starts_again_with_any_config(
    tmp_path: Path, mini_data: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kill -9` (or a machine going down) while the tokenizer trains leaves config.yaml, a
    tokenizer and train.log, no checkpoint, and no cleanup runs. The hint of `--resume` (start it
    again with its config.yaml) works, and so does a corrected config (stop 52: it was refused as
    "already holds a run", so only removing the directory got out); a run with a checkpoint is
    still never replaced."""
    run = tmp_path / "run"
    steps = ("--set", "train.max_steps=2", "--set", "train.eval_every=2")
    assert main(mini_args(mini_data, run, *steps)) == 0
    shutil.rmtree(run / "checkpoints")  # as a start killed before its first save leaves it
    (run / "metrics.jsonl").unlink()
    assert main(["train", "--run-dir", str(run), "--resume"]) == 1  # nothing to resume: the hint
    assert main(["train", "--config", str(run / "config.yaml"), "--run-dir", str(run), *steps]) == 0
    shutil.rmtree(run / "checkpoints")
    (run / "metrics.jsonl").unlink()
    other = ("--set", "model.d_model=32", "--set", "tokenizer.vocab_size=500")
    capsys.readouterr()
    assert main(mini_args(mini_data, run, *steps, *other)) == 0
    assert "held a start that ended before its first checkpoint, with another config" in capsys.readouterr().err
    assert load_run_config(run).model.d_model == 32 and load_checkpoint(run / "checkpoints" / "last.pt")
    assert_one_line_error(mtx_here(monkeypatch, *mini_args(mini_data, run, *steps)), "already holds a run")
    shutil.rmtree(run / "checkpoints")  # its checkpoints gone, its learning curve kept: still a run
    before = snapshot(run)
    assert main(mini_args(mini_data, run, *steps)) == 1 and "already holds a run" in capsys.readouterr().err
    assert snapshot(run) == before


def test_a_resume_below_the_runs_step_is_refused_and_changes_nothing(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--resume --set train.max_steps=N` below the step reached: before, it validated again,
    appended a second validation of the same step to metrics.jsonl and saved N as the config."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = {k: v for k, v in snapshot(run).items() if not k.endswith("train.log")}
    result = mtx_here(monkeypatch, "train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=50")
    assert_one_line_error(result, "the run is at step 200, past train.max_steps=50", "larger train.max_steps")
    assert {k: v for k, v in snapshot(run).items() if not k.endswith("train.log")} == before


def test_devices_this_machine_lacks_are_one_line_errors() -> None:
    """torch.device accepts mps, meta or cuda:7 anywhere; they failed later with a traceback."""
    cases = [("nosuch", "unknown device 'nosuch'"), ("meta", "unsupported device 'meta'")]
    if not torch.backends.mps.is_available():
        cases.append(("mps", "mps requested but this machine has no usable MPS device (use auto or cpu)"))
    count = torch.cuda.device_count()
    if count:
        cases.append((f"cuda:{count}", f"cuda:{count} but this machine has {count} CUDA device(s)"))
    else:
        cases.append(("cuda:7", "cuda requested but no CUDA device is available"))
    for name, message in cases:
        with pytest.raises(MtxError, match=f"^--device: {re.escape(message)}"):
            device_module.pick_device(name, "--device")
    assert device_module.pick_device("cpu", "--device") == torch.device("cpu")


def test_val_pairs_beyond_the_positions_are_left_out_of_the_val_loss(tmp_path: Path, mini_data: Path) -> None:
    """Training pairs are held to data.max_len, val pairs were not: one longer than
    model.max_positions allows crashed the val loss at the first validation (BLEU truncates its
    source, as translate does). A val split that is the training split is warned about."""
    run = tmp_path / "run"
    extra = ["model.max_positions=20", "data.max_len=18", "data.valid_split=train", "train.eval_sentences=0"]
    extra += ["train.max_steps=2", "train.eval_every=2"]
    assert main(mini_args(mini_data, run, *[a for key in extra for a in ("--set", key)])) == 0
    log = (run / "train.log").read_text()
    assert "data.valid_split is the training split ('train'): val loss and BLEU measure the training data" in log
    assert "done: reached train.max_steps=2, at step 2; best val BLEU" in log  # where it ended, and the best
    left_out = re.search(r"(\d+) of 400 val pairs are longer than model.max_positions \(20\) allows", log)
    assert left_out and 0 < int(left_out.group(1)) < 400, log
    assert "were truncated" not in log  # said once, above (stop 66: again at every validation)
    valid = [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["event"] == "valid"]
    assert valid and all(math.isfinite(e["val_loss"]) for e in valid)


def test_a_resume_records_a_new_data_dir_as_the_directory_used(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--resume --set data.dir=data` recorded `data` as given, so `mtx eval` run from another
    directory found other data there, or none."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_every=2")) == 0
    shutil.copytree(mini_data, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--run-dir", "run", "--resume", "--set", "train.max_steps=3", "--set", "data.dir=data"]) == 0
    assert load_config(run / "config.yaml").data.dir == str((tmp_path / "data").resolve())


def test_a_run_saved_without_fp16_resumes_in_fp16(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disabled loss scaler saves an empty state, which an fp16 run's scaler refused to load, so
    a CPU or bf16 run could not be resumed where train.amp gives fp16 (a GPU without bf16).
    fp16 autocast is CUDA's; here the CPU stands in for it. The resume also drops a metrics line
    whose step is not a number (it was a TypeError) and keeps the others."""
    run = tmp_path / "run"
    assert main(mini_args(mini_data, run, "--set", "train.max_steps=2", "--set", "train.eval_every=2")) == 0
    assert load_checkpoint(run / "checkpoints" / "last.pt")["scaler"] == {}
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"event": "note", "step": "two"}\n[1, 2]\n')
    monkeypatch.setattr(train_module, "amp_dtype", lambda device, amp: torch.float16)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.max_steps=4"]) == 0
    assert load_checkpoint(run / "checkpoints" / "last.pt")["scaler"]["scale"] > 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(e, dict) and isinstance(e.get("step"), int) for e in events)
    assert max(e["step"] for e in events) == 4


def test_hand_edited_run_files_are_read_without_a_traceback(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's config.yaml that is not UTF-8 (UnicodeDecodeError, not an OSError), a checkpoint
    whose config is not a mapping (AttributeError), and `train.init_from: ~/...`, which was taken
    literally while data.dir expanded ~."""
    odd = tmp_path / "odd"
    (odd / "checkpoints").mkdir(parents=True)
    (odd / "config.yaml").write_bytes(b"\xff\xfe")
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    # no checkpoint: a start killed before its first save, which a new start replaces (stop 52)
    rundir_module.prepare_run_dir(odd, cfg, resume=False)
    assert load_run_config(odd) == cfg
    for config in ([1, 2], {"data": "de-en"}):
        check_direction({"config": config}, odd / "x.pt", cfg)  # nothing to check against: no error
    monkeypatch.setenv("HOME", str(tiny_run.parent))
    init = load_run_config(tiny_run, [f"train.init_from=~/{tiny_run.name}"])
    assert rundir_module.init_source(init) == (tiny_run, tiny_run / "checkpoints" / "best.pt")


def test_an_epoch_without_an_update_is_an_error_not_an_endless_loop(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The training loop's own check, for an epoch smaller than the first (which setup checks)."""
    monkeypatch.setattr(train_module, "epoch_length", lambda *args: 10**6)  # past the setup's check
    assert main(mini_args(mini_data, tmp_path / "run", "--set", "train.accum_steps=100000")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mtx: error: an epoch of ") and "fewer than train.accum_steps=100000" in err[-1]


def test_documented_non_errors(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty input line gives an empty output line; an overlong one is truncated with a warning."""
    long = " ".join(["Ein Mann fährt Fahrrad."] * 80)
    r = mtx_here(
        monkeypatch,
        "translate",
        "--run",
        str(tiny_run),
        "--beam",
        "1",
        "--buffer-lines",
        "2",  # the long line in the second buffer: still named by its line in the input
        stdin=f"Ein Hund.\n\n{long}\n".encode(),
    )
    err = r.stderr.decode()
    out = r.stdout.decode().split("\n")
    assert r.returncode == 0 and "mtx: error" not in err, err
    assert len(out) == 4 and out[0] and out[1] == "" and out[2] and out[3] == ""
    assert "1 input sentence(s) longer than 159 tokens were truncated (model.max_positions): line(s) 3\n" in err


def test_translating_with_a_step_0_checkpoint_is_warned(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Until its first validation a run has only the last.pt saved as it starts: translate and eval
    used those untrained weights without a word (stop 62)."""
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "checkpoints" / "best.pt").unlink(missing_ok=True)
    last = load_weights_only(run / "checkpoints" / "last.pt")
    torch.save({**last, "step": 0}, run / "checkpoints" / "last.pt")
    capsys.readouterr()
    assert main(["translate", "--run", str(run), "Ein Hund."]) == 0
    assert "last.pt is from step 0: the run has not trained yet" in capsys.readouterr().err


def test_a_run_that_lost_its_config_gets_it_back_on_resume(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run with its checkpoints but no config.yaml was "not an mtx run directory", with no way
    back (stop 62): translate says how, and --resume writes it from last.pt."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").unlink()
    capsys.readouterr()
    assert main(["translate", "--run", str(run), "x"]) == 1
    assert "config.yaml is missing, though the run's checkpoints are here" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    assert "config.yaml was missing; written again from" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == config


def test_out_of_memory_under_an_address_space_limit_says_to_raise_it(
    tmp_path: Path, mini_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under `ulimit -v` (batch systems' memory cap) oneDNN's failed allocation, "could not create a
    primitive", was a 47-line traceback that lost the steps since the last validation, and an
    allocator's failure said to lower train.batch_tokens, which did not help: torch's libraries
    reserve address space beyond the batches. Python's own MemoryError was a traceback (stop 67)."""
    import resource

    limit = 3 * 2**30
    getrlimit = resource.getrlimit
    monkeypatch.setattr(
        resource, "getrlimit", lambda which: (limit, limit) if which == resource.RLIMIT_AS else getrlimit(which)
    )
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def no_primitive_in_step_4(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("could not create a primitive")
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", no_primitive_in_step_4)
    assert main(mini_args(mini_data, tmp_path / "run", "--set", "train.max_steps=10")) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtx: error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert "out of memory on cpu after step 3" in lines[0] and "last.pt saved at step 3" in lines[0]
    assert "3.0 GiB of address space at most (ulimit -v 3145728)" in lines[0] and "ulimit -v unlimited" in lines[0]
    assert memory_advice("lower it", "cuda:0") == "lower it"  # a GPU's memory is not the address space
    # a last.pt whose config lacks a whole section (hand-edited) is not taken for an older mtx's
    rundir_module.check_unchanged({}, load_config(TINY_CONFIG), tmp_path / "last.pt")
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)

    def no_memory(*args: object) -> None:
        raise MemoryError

    monkeypatch.setattr(train_module, "load_corpus", no_memory)
    assert main(mini_args(mini_data, tmp_path / "other", "--set", "train.max_steps=10")) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("mtx: error: out of memory; this process may use 3.0 GiB"), err


def test_a_test_over_the_timeout_ends_the_run_and_is_named_first(tmp_path: Path) -> None:
    """pytest-timeout (pyproject.toml) ends the run at a hang; conftest's hook names the test, its
    parametrized case included, before the stacks, also where capsys holds the test's output (stop
    70: a hang took all of CI's 90 minutes, and the plugin's report named only a function)."""
    pytest.importorskip("pytest_timeout", exc_type=ImportError)
    hang = tmp_path / "test_hang.py"
    hang.write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.parametrize('case', ['one'])\n"
        "def test_sleeps(case, capsys):\n    print('held by capsys')\n    time.sleep(120)\n",
        encoding="utf-8",
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    command += ["-o", "timeout=2", "-o", "timeout_method=thread", str(hang)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first == "test_hang.py::test_sleeps[one]: over the timeout of 2 s; every thread's stack follows", first
    assert "Timeout" in done.stdout and "time.sleep(120)" in done.stdout
