from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtx.search
from mtx.checkpoint import (
    atomic_save,
    average_checkpoints,
    best_single,
    clean_stale_tmp,
    load_checkpoint,
    load_run,
    make_best,
    restore_best_single,
    save_new_best,
    step_checkpoints,
)
from mtx.cli import main
from mtx.config import config_text, load_config
from mtx.errors import CheckpointError, import_failed
from mtx.plot import run_labels

from .conftest import TINY_CONFIG, script_in_process
from .test_cli import assert_one_line_error, mtx_here


@pytest.fixture()
def run_copy(tiny_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    return out


def test_average_is_the_elementwise_mean(run_copy: Path) -> None:
    steps = step_checkpoints(run_copy)
    assert len(steps) >= 2
    avg = average_checkpoints(steps[-2:])
    a, b = (load_checkpoint(p)["model"] for p in steps[-2:])
    for key, value in avg["model"].items():
        assert torch.allclose(value, (a[key] + b[key]) / 2, atol=1e-6), key


def test_an_average_of_several_is_the_mean_of_all_of_them(run_copy: Path) -> None:
    """Four checkpoints of one run (made from one by moving its weights apart): every float
    tensor is the mean of the four, in its own dtype; other tensors are kept; the step is the
    newest one's."""
    ckpt = load_checkpoint(step_checkpoints(run_copy)[-1])
    torch.manual_seed(0)
    paths, models = [], []
    for i in range(4):
        model = {k: v + i * torch.randn_like(v) if v.is_floating_point() else v for k, v in ckpt["model"].items()}
        paths.append(run_copy / "checkpoints" / f"step_{1000 + i}.pt")
        atomic_save({**ckpt, "model": model, "step": 1000 + i}, paths[-1])
        models.append(model)
    avg = average_checkpoints(paths)
    assert avg["model"].keys() == ckpt["model"].keys() and avg["step"] == 1003
    assert any(not torch.equal(models[0][k], models[3][k]) for k in ckpt["model"])
    for key, value in avg["model"].items():
        assert value.dtype == ckpt["model"][key].dtype, key
        want = torch.stack([m[key].double() for m in models]).mean(0)
        assert torch.allclose(value.double(), want, atol=1e-6), key


def test_average_command_as_best_keeps_the_old_best(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpts = run_copy / "checkpoints"
    old_best = (ckpts / "best.pt").read_bytes()
    assert main(["average", "--run", str(run_copy), "--last", "2", "--as-best"]) == 0
    assert "averaged 2 checkpoints" in capsys.readouterr().out
    assert (ckpts / "best_single.pt").read_bytes() == old_best
    assert load_checkpoint(ckpts / "best.pt")["averaged_from"] == [p.name for p in step_checkpoints(run_copy)[-2:]]
    assert main(["translate", "--run", str(run_copy), "--beam", "2", "Ein Hund läuft."]) == 0


def _read(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_an_outdated_best_single_beside_trainings_own_best_is_not_the_best_single(tmp_path: Path) -> None:
    """stop 67: an mtx before stop 53 left best_single.pt when training saved a newer best.pt
    (as a `save_new_best` killed before removing it still can). best_single() returned it because
    it existed: choose_on_val scored step 50's single as "the start" where best.pt was training's
    step-200 best, and `--apply` replaced that better best.pt with an average, printing a gain.
    Which file holds training's single is read from best.pt."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    atomic_save({"step": 200}, ckpts / "best.pt")  # training's own best, saved after the choice
    atomic_save({"step": 50}, ckpts / "best_single.pt")  # the outdated single of the earlier choice
    assert best_single(tmp_path) == ckpts / "best.pt"
    atomic_save({"step": 50, "averaged_from": ["step_40.pt", "step_50.pt"]}, ckpts / "best.pt")
    assert best_single(tmp_path) == ckpts / "best_single.pt"  # a chosen average holds best.pt
    (ckpts / "best.pt").write_bytes(b"PK\x03\x04 torn")
    assert best_single(tmp_path) == ckpts / "best_single.pt"  # unreadable: the names decide, as before


def test_a_resumed_run_keeps_the_chosen_average_beside_its_new_best(tmp_path: Path) -> None:
    """best_single.pt exists only while a chosen average holds best.pt: training's next best
    moves the average to best_average.pt (before, it overwrote it, and a later --as-best kept
    the outdated best_single.pt and overwrote the newer best single)."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    atomic_save({"step": 40}, ckpts / "best.pt")  # training's best
    make_best(tmp_path, {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]})
    assert best_single(tmp_path) == ckpts / "best_single.pt"
    assert save_new_best(tmp_path, {"step": 60}) == ckpts / "best_average.pt"  # resumed training improved
    assert _read(ckpts / "best_average.pt")["averaged_from"] == ["step_30.pt", "step_40.pt"]
    assert best_single(tmp_path) == ckpts / "best.pt" and not (ckpts / "best_single.pt").exists()
    make_best(tmp_path, {"step": 60, "averaged_from": ["step_50.pt", "step_60.pt"]})
    assert _read(ckpts / "best_single.pt")["step"] == 60  # the newer single, not step 40's
    assert restore_best_single(tmp_path) == ckpts / "best.pt" and _read(ckpts / "best.pt")["step"] == 60
    assert not (ckpts / "best_single.pt").exists() and save_new_best(tmp_path, {"step": 80}) is None
    # the chosen average that restore_best_single took out of best.pt was kept (before, it was gone)
    assert _read(ckpts / "best_average.pt")["averaged_from"] == ["step_50.pt", "step_60.pt"]
    make_best(tmp_path, {"step": 80, "averaged_from": ["step_70.pt", "step_80.pt"]})
    make_best(tmp_path, {"step": 80, "averaged_from": ["step_60.pt", "step_80.pt"]})  # a newer choice
    assert _read(ckpts / "best_average.pt")["averaged_from"] == ["step_70.pt", "step_80.pt"]
    assert _read(ckpts / "best_single.pt")["step"] == 80 and not list(ckpts.glob(".*"))


def test_a_new_best_killed_mid_save_loses_no_chosen_average(tmp_path: Path) -> None:
    """stop 55, a helper's kill -9 after each rename of training's save of a new best.pt over a
    chosen average: the average set aside under a temporary name was removed as a dead writer's,
    and the outdated best_single.pt made the new best.pt pass for the average, so the next new
    best replaced the average in best_average.pt."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    average = {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]}
    dead = 2**22 + 17  # above Linux's largest pid: no process
    # killed after best.pt was replaced, before the set-aside average was renamed
    atomic_save({"step": 60}, ckpts / "best.pt")
    atomic_save({"step": 40}, ckpts / "best_single.pt")
    atomic_save(average, ckpts / f".best_average.pt.aside.tmp.{dead}")
    assert clean_stale_tmp(ckpts) == [] and _read(ckpts / "best_average.pt") == average
    # killed after that rename, before the outdated single was removed (the state above, now)
    assert save_new_best(tmp_path, {"step": 80}) is None and not (ckpts / "best_single.pt").exists()
    assert _read(ckpts / "best_average.pt") == average and _read(ckpts / "best.pt") == {"step": 80}
    # killed before best.pt was replaced: the set-aside name is a spare name of best.pt, and goes
    make_best(tmp_path, average)
    os.link(ckpts / "best.pt", ckpts / f".best_average.pt.aside.tmp.{dead}")
    assert clean_stale_tmp(ckpts) == [ckpts / f".best_average.pt.aside.tmp.{dead}"]
    assert _read(ckpts / "best.pt") == average and _read(ckpts / "best_single.pt") == {"step": 80}
    # a torn best.pt is replaced, not read: it stopped training at its next best (the review of stop 55)
    (ckpts / "best_single.pt").unlink()
    (ckpts / "best.pt").write_bytes(b"PK\x03\x04 torn")
    assert save_new_best(tmp_path, {"step": 90}) is None and _read(ckpts / "best.pt") == {"step": 90}


# a process that holds `flock` on each file named, as a live writer does, until its stdin closes
_HOLD = (
    "import fcntl, sys\n"
    "files = [open(p, 'rb') for p in sys.argv[1:]]\n"
    "for f in files: fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
)


def _run_checkpoints(tmp_path: Path) -> Path:
    """A run's checkpoints/ (beside its config.yaml: every save there cleans it wholesale)."""
    (tmp_path / "config.yaml").write_text("{}\n")
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    atomic_save({"step": 40}, ckpts / "best.pt")
    return ckpts


def test_a_live_writers_temporary_file_is_kept_whatever_its_pid_says(tmp_path: Path) -> None:
    """stop 66: a temporary file was taken for a dead writer's by its process id alone, and a
    writer in another PID namespace (another container, or host of a shared disk) has an id that
    is not alive here: `mtx average` removed training's `.last.pt.tmp.PID` mid-save, and training
    stopped. A file its writer holds locked is kept, the set-aside average too; once the writer
    is gone, the next save removes the one and puts the other in place."""
    ckpts = _run_checkpoints(tmp_path)
    dead = 2**22 + 17  # above Linux's largest pid: no process here
    writing, aside = ckpts / f".last.pt.tmp.{dead}", ckpts / f".best_average.pt.aside.tmp.{dead}"
    average = {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]}
    atomic_save(average, aside)
    writing.write_bytes(b"half a checkpoint")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(writing), str(aside)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        atomic_save({"step": 50}, ckpts / "step_50.pt")
        assert clean_stale_tmp(ckpts) == [] and writing.read_bytes() == b"half a checkpoint"
        assert _read(aside) == average and not (ckpts / "best_average.pt").exists()
    finally:
        holder.communicate(b"\n", timeout=60)
    atomic_save({"step": 60}, ckpts / "step_60.pt")
    assert not writing.exists() and not aside.exists() and _read(ckpts / "best_average.pt") == average


def test_a_dead_writers_temporary_file_goes_whatever_its_pid_says(tmp_path: Path) -> None:
    """stop 66: a dead writer whose process id is alive here (in a container mtx is PID 1, which
    always is) left its temporary file for ever, and a set-aside chosen average stayed hidden. A
    file nobody holds locked is a dead writer's, even one named after this very process."""
    ckpts = _run_checkpoints(tmp_path)
    average = {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]}
    atomic_save(average, ckpts / ".best_average.pt.aside.tmp.1")
    for pid in (1, os.getppid(), os.getpid()):
        (ckpts / f".ema.pt.tmp.{pid}").write_bytes(b"half a checkpoint")
    atomic_save({"step": 50}, ckpts / "step_50.pt")
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "best_average.pt", "step_50.pt"]
    assert _read(ckpts / "best_average.pt") == average


def test_a_writers_temporary_file_removed_before_it_was_locked_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cleaner can lock and remove a writer's new temporary file before the writer locks it: the
    writer sees that its name is gone and makes it again (a save and best.pt's second name)."""
    ckpts = _run_checkpoints(tmp_path)
    flock, taken = fcntl.flock, []

    def cleaner_first(fd: int, op: int) -> None:
        for path in ckpts.glob(".*.tmp.*"):  # the first temporary file locked is removed just before
            if len(taken) < 2 and path.name not in taken and path.stat().st_ino == os.fstat(fd).st_ino:
                taken.append(path.name)
                path.unlink()
        flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", cleaner_first)
    atomic_save({"step": 50}, ckpts / "step_50.pt")
    make_best(tmp_path, {"step": 50, "averaged_from": ["step_40.pt", "step_50.pt"]})
    assert taken == [f".step_50.pt.tmp.{os.getpid()}", f".best_single.pt.tmp.{os.getpid()}"]
    assert _read(ckpts / "step_50.pt") == {"step": 50} and _read(ckpts / "best_single.pt") == {"step": 40}
    assert _read(ckpts / "best.pt")["averaged_from"] == ["step_40.pt", "step_50.pt"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "best_single.pt", "step_50.pt"]


def test_without_flock_the_pid_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the file system has no `flock` (some network file systems), a temporary file's
    process id decides as before stop 66: a dead one's goes, a live one's stays."""
    ckpts = _run_checkpoints(tmp_path)

    def no_locks(fd: int, op: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # the run directory's lock (make_best's)
            return flock(fd, op)
        raise OSError(errno.ENOLCK, "No locks available")

    flock = fcntl.flock

    monkeypatch.setattr(fcntl, "flock", no_locks)
    dead, alive = ckpts / f".last.pt.tmp.{2**22 + 17}", ckpts / f".last.pt.tmp.{os.getppid()}"
    for path in (dead, alive):
        path.write_bytes(b"half a checkpoint")
    atomic_save({"step": 50}, ckpts / "step_50.pt")
    make_best(tmp_path, {"step": 50, "averaged_from": ["step_40.pt", "step_50.pt"]})
    assert sorted(p.name for p in ckpts.iterdir()) == [alive.name, "best.pt", "best_single.pt", "step_50.pt"]


def test_a_failed_or_interrupted_choice_leaves_best_pt_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """make_best moved best.pt to best_single.pt before writing the average: a full disk or Ctrl-C
    during the write left no best.pt, and translate silently decoded with last.pt."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    atomic_save({"step": 40}, ckpts / "best.pt")

    def full_disk(obj: object, f: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="best.pt: cannot write .No space left on device.; the previous file is"):
        make_best(tmp_path, {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]})
    monkeypatch.undo()
    assert _read(ckpts / "best.pt") == {"step": 40} and sorted(p.name for p in ckpts.iterdir()) == ["best.pt"]
    make_best(tmp_path, {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]})

    def interrupted(obj: object, f: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_new_best(tmp_path, {"step": 60})
    monkeypatch.undo()
    assert _read(ckpts / "best.pt")["averaged_from"] == ["step_30.pt", "step_40.pt"]  # whole, still the average
    assert _read(ckpts / "best_single.pt") == {"step": 40}
    # a failed write of a newer average leaves the earlier best_average.pt as it was
    atomic_save({"step": 20, "averaged_from": ["step_10.pt", "step_20.pt"]}, ckpts / "best_average.pt")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError):
        make_best(tmp_path, {"step": 40, "averaged_from": ["step_20.pt", "step_40.pt"]})
    monkeypatch.undo()
    assert _read(ckpts / "best_average.pt")["averaged_from"] == ["step_10.pt", "step_20.pt"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "best_average.pt", "best_single.pt"]


def test_a_written_best_pt_whose_directory_sync_fails_keeps_the_single(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write is renamed into place before the directory is synced: a failure (or Ctrl-C) there
    means best.pt is already the average, so training's single must stay as best_single.pt."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    atomic_save({"step": 40}, ckpts / "best.pt")

    def sync_fails(directory: Path) -> None:
        if "averaged_from" in _read(ckpts / "best.pt"):  # best.pt's sync (best_single.pt's went before)
            raise OSError(5, "Input/output error")

    monkeypatch.setattr("mtx.checkpoint.fsync_dir", sync_fails)
    with pytest.raises(CheckpointError):
        make_best(tmp_path, {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]})
    monkeypatch.undo()
    assert "averaged_from" in _read(ckpts / "best.pt") and _read(ckpts / "best_single.pt") == {"step": 40}


def test_a_spare_best_single_name_left_by_a_killed_choice_is_not_taken_for_an_average(tmp_path: Path) -> None:
    """A make_best killed after naming the single best_single.pt, before writing best.pt, leaves
    two names of the single: the next choice must not file the single as best_average.pt."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    atomic_save({"step": 40}, ckpts / "best.pt")
    os.link(ckpts / "best.pt", ckpts / "best_single.pt")
    assert best_single(tmp_path).samefile(ckpts / "best_single.pt")  # either name holds the single
    make_best(tmp_path, {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]})
    assert _read(ckpts / "best_single.pt") == {"step": 40} and not (ckpts / "best_average.pt").exists()
    restore_best_single(tmp_path)  # the average is kept; the single is best.pt again
    assert _read(ckpts / "best.pt") == {"step": 40} and "averaged_from" in _read(ckpts / "best_average.pt")
    os.link(ckpts / "best.pt", ckpts / "best_single.pt")  # a spare name again: nothing holds an average
    assert save_new_best(tmp_path, {"step": 60}) is None and "averaged_from" in _read(ckpts / "best_average.pt")


def test_average_of_more_than_the_kept_checkpoints_says_so(
    run_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # checkpoints/ that cannot be listed (stop 63: "the run has not validated yet"); simulated, as
    # root lists any directory
    import os

    folder = run_copy / "checkpoints"
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != folder and access(path, mode))
    assert main(["average", "--run", str(run_copy)]) == 1
    assert f"{folder}: cannot list the checkpoints (permission denied)" in capsys.readouterr().err
    monkeypatch.undo()
    kept = len(step_checkpoints(run_copy))
    assert main(["average", "--run", str(run_copy), "--last", str(kept + 5)]) == 0
    out, err = capsys.readouterr()
    assert f"averaged {kept} checkpoints" in out
    assert f"--last {kept + 5}" in err and "train.keep_last" in err
    assert (run_copy / "checkpoints" / f"average_last{kept}.pt").is_file()
    # none left of a run that validated (a copy without them; stop 69's probe: "the run has not
    # validated yet"); none yet: a run stopped before its first validation (stop 55: keep_last was blamed)
    for path in step_checkpoints(run_copy):
        path.unlink()
    assert main(["average", "--run", str(run_copy)]) == 1
    gone = "one is written at each validation; the run validated, and its step files are gone"
    assert gone in capsys.readouterr().err
    metrics = run_copy / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(True) if '"valid"' not in line))
    assert main(["average", "--run", str(run_copy)]) == 1
    assert "one is written at each validation, and the run has not validated yet" in capsys.readouterr().err
    config = run_copy / "config.yaml"
    config.write_text(config.read_text().replace("keep_last: 3\n", "keep_last: 0\n"))
    assert main(["average", "--run", str(run_copy)]) == 1
    assert "no checkpoints/step_N.pt to average (train with train.keep_last > 0)" in capsys.readouterr().err


def test_average_and_translate_with_a_restricted_output(tiny_restricted_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_restricted_run, run)
    assert main(["average", "--run", str(run), "--last", "2", "--as-best"]) == 0
    best = load_checkpoint(run / "checkpoints" / "best.pt")["model"]
    assert torch.equal(best["output_ids"], load_checkpoint(step_checkpoints(run)[-1])["model"]["output_ids"])
    assert main(["translate", "--run", str(run), "--beam", "3", "Ein Hund läuft."]) == 0
    ema = load_run(run, [run / "checkpoints" / "ema.pt"])  # the moving average keeps output_ids too
    assert torch.equal(ema.model.output_ids, best["output_ids"])
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace("restrict_output: true", "restrict_output: false")
    )
    assert main(["translate", "--run", str(run), "Ein Hund läuft."]) != 0  # one-line error, no traceback


@pytest.mark.parametrize("name", ["best.pt", "last.pt", "step_200.pt", "best_single.pt"])
def test_average_never_writes_over_a_checkpoint_training_keeps(
    run_copy: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out naming best.pt, last.pt or a step checkpoint replaced it with the average (with --as-best
    the real best single checkpoint was lost too): a one-line error, and nothing changes."""
    ckpts = run_copy / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    assert main(["average", "--run", str(run_copy), "--last", "2", "--out", str(ckpts / name), "--as-best"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"mtx: error: --out {ckpts / name}: training writes and reads that file; write the average elsewhere "
        "(the default, or --as-best to make it best.pt while keeping the best single checkpoint)"
    )
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before


def test_average_out_removes_no_other_programs_temporary_files(
    run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A save into a directory the user chose removed every `.NAME.tmp.PID` of a dead process
    there, another program's too: only those of the file it writes go."""
    out = tmp_path / "mine"
    out.mkdir()
    dead = 2**22 + 17  # above Linux's largest pid: no process
    others = [f".notes.txt.tmp.{dead}", f".avg.pt.tmp.{dead}.part", f".avg.pt.tmp.x{dead}", f"..avg.pt.tmp.{dead}"]
    for name in [*others, f".avg.pt.tmp.{dead}"]:
        (out / name).write_bytes(b"partial")
    assert main(["average", "--run", str(run_copy), "--last", "2", "--out", str(out / "avg.pt")]) == 0
    assert "averaged 2 checkpoints" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(["avg.pt", *others])


def test_average_refuses_checkpoints_of_another_run(run_copy: Path, tmp_path: Path) -> None:
    steps = step_checkpoints(run_copy)
    other = load_checkpoint(steps[-1])
    other["vocab"] = "different"
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not from the same run"):
        average_checkpoints([steps[-1], tmp_path / "other.pt"])
    assert main(["average", "--run", str(tmp_path / "nowhere")]) != 0


@pytest.mark.parametrize(
    "setting, needle", [("n_heads", "model.n_heads=2, the run's config has 4"), ("src_lang", "en->de")]
)
def test_average_checks_every_member_against_the_run(
    run_copy: Path, setting: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step_N.pt of another direction or n_heads, older than the run's own, was averaged in
    without a word, and a newer one was refused naming the run's own file (stop 62)."""
    steps = step_checkpoints(run_copy)
    foreign = load_checkpoint(steps[0])
    if setting == "n_heads":
        foreign["config"]["model"]["n_heads"] = 2
    else:
        foreign["config"]["data"]["src_lang"], foreign["config"]["data"]["tgt_lang"] = "en", "de"
    path = steps[0].with_name("step_1.pt")
    torch.save(foreign, path)
    before = sorted(p.name for p in path.parent.iterdir())
    assert main(["average", "--run", str(run_copy), "--last", str(len(steps) + 1)]) == 1
    err = capsys.readouterr().err
    assert f"mtx: error: {path}: " in err and needle in err, err
    assert sorted(p.name for p in path.parent.iterdir()) == before


def test_plot_writes_a_png(run_copy: Path) -> None:
    out = run_copy / "curves.png"
    assert main(["plot", "--run", str(run_copy)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_names_the_train_loss_each_run_trained_on(run_copy: Path, tmp_path: Path) -> None:
    """Every run's train loss was "label-smoothed", a run without smoothing too, and R-Drop's KL
    term was unsaid: curves that do not compare looked alike (stop 68's probe)."""
    from mtx.plot import train_loss_name

    plain = shutil.copytree(run_copy, tmp_path / "plain")
    text = (plain / "config.yaml").read_text()
    assert "label_smoothing: 0.1" in text and "rdrop: 0.0" in text
    (plain / "config.yaml").write_text(text.replace("label_smoothing: 0.1", "label_smoothing: 0.0"))
    rdrop = shutil.copytree(run_copy, tmp_path / "rdrop")
    (rdrop / "config.yaml").write_text(text.replace("rdrop: 0.0", "rdrop: 5.0"))
    assert train_loss_name(run_copy) == "train loss (label smoothing 0.1)"
    assert train_loss_name(plain) == "train loss"
    assert train_loss_name(rdrop) == "train loss (label smoothing 0.1, with R-Drop's term, train.rdrop 5)"
    assert train_loss_name(tmp_path / "none") == "train loss"
    out = tmp_path / "p.svg"
    assert main(["plot", "--run", str(plain), "--run", str(rdrop), "--out", str(out)]) == 0
    svg = out.read_text()  # (matplotlib writes each text as a comment beside its glyphs)
    assert "plain: train loss -->" in svg
    assert "rdrop: train loss (label smoothing 0.1, with R-Drop's term, train.rdrop 5)" in svg


def test_choose_on_val_scores_the_split_training_validated_on(
    run_copy: Path,
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It read the split named `val` whatever data.valid_split said."""
    data = tmp_path / "data"
    shutil.copytree(small_data, data)
    for lang in ("de", "en"):
        lines = (data / f"val.{lang}").read_text().splitlines()[:6]
        (data / f"dev.{lang}").write_text("".join(line + "\n" for line in lines))
    config = run_copy / "config.yaml"
    text = config.read_text()
    assert "valid_split: val\n" in text
    config.write_text(text.replace("valid_split: val\n", "valid_split: dev\n").replace(str(small_data), str(data)))
    script = Path(__file__).resolve().parent.parent / "scripts" / "choose_on_val.py"
    run_args = ["--run", str(run_copy)]
    code, out, err = script_in_process(
        script, [*run_args, "--last", "2", "--length-penalty", "1.0"], monkeypatch, capsys
    )
    assert code == 0, err
    assert out.startswith(f"{run_copy}: dev (6 sentences), beam ") and out.splitlines()[0].endswith(", fp32")
    # in the run's decode.precision, as mtx eval decodes it (stop 55: always fp32)
    config.write_text(config.read_text().replace("precision: fp32\n", "precision: bf16\n"))
    decoded = []
    search_translate = mtx.search.translate

    def recorded(model: torch.nn.Module, *rest: object, **options: object) -> list[str]:
        decoded.append(next(model.parameters()).dtype)
        return search_translate(model, *rest, **options)

    monkeypatch.setattr(mtx.search, "translate", recorded)
    code, out, err = script_in_process(
        script, [*run_args, "--last", "2", "--length-penalty", "1.0", "--beam", "1"], monkeypatch, capsys
    )
    assert code == 0, err
    assert out.splitlines()[0].endswith(", bf16") and len(decoded) >= 3 and set(decoded) == {torch.bfloat16}
    # a run stopped before its first validation has no best.pt: it starts from last.pt, as eval does
    (run_copy / "checkpoints" / "best.pt").unlink()
    code, out, err = script_in_process(script, run_args, monkeypatch, capsys)
    assert code == 0, err
    assert "\nlast checkpoint (last.pt, step " in out and "against the start (last checkpoint," in out
    # never a test split, whatever the config says (stop 53: it chose on test_2016_flickr)
    config.write_text(config.read_text().replace("valid_split: dev\n", "valid_split: test_2016_flickr\n"))
    code, _, err = script_in_process(script, run_args, monkeypatch, capsys)
    assert code == 1 and err.strip() == (
        f"choose_on_val: error: {run_copy}: data.valid_split is test_2016_flickr, a test split; choose_on_val "
        "chooses on validation data only (a run that validates on val: data.valid_split: val)"
    )


def test_choose_on_val_scores_averages_and_penalties_then_applies_the_choice(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = Path(__file__).resolve().parent.parent / "scripts" / "choose_on_val.py"
    args = ["--run", str(run_copy), "--last", "2,9", "--length-penalty", "0.6,1.0", "--beam", "1", "--ensemble", "2,9"]
    code, out, err = script_in_process(script, [*args, "--apply"], monkeypatch, capsys)
    assert code == 0, err
    lines = out.splitlines()
    # sizes beyond the run's step checkpoints are said to be left out (stop 57: without a word)
    n = len(step_checkpoints(run_copy))
    for option in ("--last", "--ensemble"):
        assert f"note: {option} 9: more than the run's {n} step checkpoints; left out" in err
    assert any(line.startswith("best single") for line in lines)
    assert any(line.startswith("average of the last 2:") for line in lines)
    assert any(line.startswith("moving average (ema.pt, decay 0.99):") for line in lines)
    assert any(line.startswith("ensemble of the last 2:") for line in lines)
    choice = json.loads(lines[-1])
    assert choice["length_penalty"] in (0.6, 1.0)
    scan = lines.index(f"{choice['chosen']}, the best candidate, at other settings:")
    assert lines[scan + 1].startswith("  length penalty")
    penalties = [float(line.rsplit(": ", 1)[1]) for line in lines if line.startswith("  length penalty")]
    beams = [float(line.rsplit(": ", 1)[1]) for line in lines if line.startswith("  beam 1 (length penalty")]
    assert len(penalties) == 2 and len(beams) == 1
    assert choice["val_bleu"] == pytest.approx(max(*penalties, *beams), abs=0.01)
    assert choice["beam"] == (1 if beams[0] > max(penalties) else load_run(run_copy).cfg.decode.beam)
    # the choice tested against where it started: the best single checkpoint at the config's settings
    start = float(next(line for line in lines if line.startswith("best single")).rsplit(": ", 1)[1])
    assert choice["start_val_bleu"] == pytest.approx(start, abs=0.01) and 0 < choice["gain_p_value"] <= 1
    tested = next(line for line in lines if line.startswith("against the start (best single, length penalty"))
    assert f"{start:.2f} -> {choice['val_bleu']:.2f}" in tested and f"p = {choice['gain_p_value']:.4f}" in tested
    best = load_checkpoint(run_copy / "checkpoints" / "best.pt")
    assert ("averaged_from" in best) == (choice["chosen"] == "average of the last 2")
    assert ("ema_decay" in best) == (choice["chosen"] == "moving average")
    kept_single = choice["chosen"] in ("best single", "ensemble of the last 2")  # an ensemble is not a best.pt
    assert (run_copy / "checkpoints" / "best_single.pt").is_file() == (not kept_single)
    assert ("checkpoints" in choice) == (choice["chosen"] == "ensemble of the last 2")
    if choice["chosen"] == "average of the last 2":  # the files (stop 65: only "the last 2", which moves on)
        assert choice["averaged_from"] == [str(p) for p in step_checkpoints(run_copy)[-2:]]
    assert lines[0].startswith(f"{run_copy}: val (") and " sentences), beam " in lines[0]
    # the user mistakes, in this process (each a subprocess spent 2-3 s importing torch)
    run_args = ["--run", str(run_copy)]
    code, _, err = script_in_process(script, [*run_args, "--ensemble", "1"], monkeypatch, capsys)
    assert code == 2 and "an ensemble has at least 2 checkpoints" in err
    for option, value, want in (
        ("--beam", "2.5", "whole numbers >= 1, got '2.5'"),
        ("--last", "3,2.5", "whole numbers >= 1, got '3,2.5'"),
        ("--length-penalty", "1.0,-1", "numbers from 0 to 10, got '1.0,-1'"),
        ("--length-penalty", "nan", "numbers from 0 to 10, got 'nan'"),
        ("--length-penalty", "1,500", "numbers from 0 to 10, got '1,500'"),
    ):
        code, _, err = script_in_process(script, [*run_args, f"{option}={value}"], monkeypatch, capsys)
        assert code == 2 and f"argument {option}: expected comma-separated {want}" in err
    code, _, err = script_in_process(script, [*run_args, "--device", "nosuch"], monkeypatch, capsys)
    assert code == 1 and err.strip().splitlines() == [
        "choose_on_val: error: --device: unknown device 'nosuch' (use auto, cpu, cuda, cuda:N or mps)"
    ]
    code, _, err = script_in_process(script, ["--run", str(run_copy / "nowhere")], monkeypatch, capsys)
    assert code == 1 and err.strip().splitlines() == [
        f"choose_on_val: error: {run_copy / 'nowhere'}: run directory not found"
    ]
    gone = run_copy.parent / "gone"  # the run's data moved away (stop 57: "no val.de or val.de.gz")
    (run_copy / "config.yaml").write_text(config_text(load_config(run_copy / "config.yaml", [f"data.dir={gone}"])))
    code, _, err = script_in_process(script, run_args, monkeypatch, capsys)
    assert code == 1 and err.strip().splitlines() == [
        f"choose_on_val: error: {run_copy}: its data.dir {gone} is not a directory here; set it in the run's "
        "config.yaml"
    ]


def fake_run(path: Path, step_seconds: float, val_losses: list[float]) -> Path:
    """A run directory holding only metrics.jsonl: a validation every 100 steps."""
    path.mkdir()
    events = []
    for i, val_loss in enumerate(val_losses, 1):
        step, elapsed = 100 * i, 100 * i * step_seconds
        events.append({"event": "train", "step": step, "loss": val_loss + 1, "lr": 1e-3, "elapsed_s": elapsed})
        valid = {"val_loss": val_loss, "val_bleu": 10.0 * i, "elapsed_s": elapsed}
        events.append({"event": "valid", "step": step, **valid})
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "tra')
    return path


def test_metrics_not_as_mtx_writes_them_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = fake_run(tmp_path / "good", 0.1, [3.0, 2.0])
    bad = fake_run(tmp_path / "bad", 0.1, [3.0])
    with (bad / "metrics.jsonl").open("a") as f:  # after the torn line, which is skipped
        f.write('\n[1, 2]\n{"event": "valid", "step": 200, "val_loss": 1.0, "val_bleu": "high", "elapsed_s": 9}\n')
    for argv in (["compare", "--run", str(good), "--run", str(bad)], ["plot", "--run", str(bad)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "metrics.jsonl: line 5: a valid event without a number 'val_bleu'" in err


def test_metrics_past_what_json_and_floats_take_are_skipped_or_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """stop 61: arrays nested 100,000 deep (RecursionError) and an integer of 400 digits (OverflowError)
    in a hand-edited metrics.jsonl were tracebacks."""
    good = fake_run(tmp_path / "good", 0.1, [3.0, 2.0])
    deep = fake_run(tmp_path / "deep", 0.1, [3.0, 2.0])
    with (deep / "metrics.jsonl").open("a") as f:
        f.write("\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    assert main(["compare", "--run", str(good), "--run", str(deep)]) == 0  # the line skipped, as a torn one
    capsys.readouterr()
    huge = fake_run(tmp_path / "huge", 0.1, [3.0])
    with (huge / "metrics.jsonl").open("a") as f:
        f.write('\n{"event": "valid", "step": 200, "val_loss": 1' + "0" * 400 + ', "val_bleu": 1, "elapsed_s": 9}\n')
    for argv in (["compare", "--run", str(good), "--run", str(huge)], ["plot", "--run", str(huge)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "line 4: a valid event without a number 'val_loss' (got 1000" in err, err
        assert len(err) < 250


def test_plot_keeps_the_old_image_when_the_new_cannot_be_written_and_writes_to_standard_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture
) -> None:
    """stop 61: the image was written in place, so a full disk left it cut short and the old one
    lost; `--out -` wrote a file named -.png."""
    run = fake_run(tmp_path / "a", 0.1, [3.0, 2.0])
    out = tmp_path / "c.png"
    assert main(["plot", "--run", str(run), "--out", str(out)]) == 0
    old = out.read_bytes()
    capsysbinary.readouterr()

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        assert main(["plot", "--run", str(run), "--x", "time", "--out", str(out)]) == 1
    err = capsysbinary.readouterr().err.decode()
    assert err == f"mtx: error: {out}: cannot write (No space left on device); the previous file is unchanged\n"
    assert out.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["a", "c.png"]
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "--run", str(run), "--out", "-"]) == 0
    assert capsysbinary.readouterr().out[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "-.png").exists()


def test_compare_lines_runs_up_at_equal_steps_and_equal_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # the second run's steps take half as long: at the first run's step 200 (40 s) it has validated step 400
    slow = fake_run(tmp_path / "slow", 0.2, [3.0, 2.0, 1.5])
    fast = fake_run(tmp_path / "fast", 0.1, [3.5, 2.5, 2.2, 1.9, 1.8, 1.7])
    assert main(["compare", "--run", str(slow), "--run", str(fast)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["100", "200", "300"]
    # step, minutes, slow's loss / BLEU, fast's at the same step, fast's at the same time (its step)
    assert rows[1] == ["200", "0.7", "2.000", "/", "20.00", "2.500", "/", "20.00", "1.900", "/", "40.00", "(400)"]
    assert rows[2][-4:] == ["1.700", "/", "60.00", "(600)"]
    assert main(["compare", "--run", str(slow)]) == 1  # one run: nothing to compare
    # a run that has not validated yet: "-" beside the others (stop 65: the whole table was refused)
    new = fake_run(tmp_path / "new", 0.1, [])
    (new / "metrics.jsonl").write_text('{"event": "train", "step": 50, "loss": 5.0, "lr": 1e-3, "elapsed_s": 5}\n')
    assert main(["compare", "--run", str(slow), "--run", str(new)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "note: new has no validation yet" and [r.split()[-2:] for r in out[3:]] == [["-", "-"]] * 3
    assert main(["compare", "--run", str(new), "--run", str(slow)]) == 1  # its validations would be the rows
    assert capsys.readouterr().err.startswith(f"mtx: error: {new}/metrics.jsonl holds no validation yet; give a run")


def test_compare_and_plot_read_their_runs_without_importing_torch(tmp_path: Path) -> None:
    """`compare` and `plot` read metrics.jsonl, config.yaml and the val files: stop 69's probe found
    them importing torch for text and file helpers since stop 57 (compare 0.3 s -> 2.3 s alone)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.de").write_text("Ein Hund.\nZwei Hunde.\n")
    (data / "val.en").write_text("A dog.\nTwo dogs.\n")
    runs = [fake_run(tmp_path / name, 0.1, [3.0, 2.0]) for name in ("a", "b")]
    for run, lang in zip(runs, ("de", "en"), strict=True):  # different directions: the val files are read
        other = "en" if lang == "de" else "de"
        overrides = [f"data.dir={data}", f"data.src_lang={lang}", f"data.tgt_lang={other}"]
        (run / "config.yaml").write_text(config_text(load_config(TINY_CONFIG, overrides)))
    program = (
        "import sys; from mtx.cli import main; "
        f"assert main(['compare', '--run', {str(runs[0])!r}, '--run', {str(runs[1])!r}]) == 0; "
        f"assert main(['plot', '--run', {str(runs[0])!r}, '--run', {str(runs[1])!r}, '--out', "
        f"{str(tmp_path / 'ab.png')!r}]) == 0; "
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "validate on different data (a: de->en, val (2 sentences" in r.stdout
    assert r.stdout.splitlines()[-1] == "False"  # torch not imported
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_compare_tells_apart_runs_of_one_name_and_says_when_their_val_data_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Columns were headed by the directory name alone (`base` twice), and runs of different
    directions or val splits were set side by side as if their scores compared."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = fake_run(tmp_path / "a" / "base", 0.1, [3.0, 2.0])
    second = fake_run(tmp_path / "b" / "base", 0.1, [3.0, 2.0])
    de_en = config_text(load_config(TINY_CONFIG))  # whole config.yaml files, as mtx train writes them
    (first / "config.yaml").write_text(de_en)
    (second / "config.yaml").write_text(config_text(load_config(TINY_CONFIG, ["data.src_lang=en", "data.tgt_lang=de"])))
    assert main(["compare", "--run", str(first), "--run", str(second)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "note: the runs validate on different data (a/base: de->en, val (100 sentences); b/base: en->de, val "
        "(100 sentences)): their scores do not compare"
    )
    assert lines[2].split()[2:5] == ["a/base", "b/base", "(same"]
    # plot draws their BLEU on one axis: it says so too (stop 65: compare alone did)
    assert main(["plot", "--run", str(first), "--run", str(second), "--out", str(tmp_path / "ab.png")]) == 0
    assert "the runs validate on different data (a/base: de->en" in capsys.readouterr().err
    # a run given through a link is named as given (stop 61: by its target's name, `base` twice)
    (tmp_path / "linked").symlink_to(first)
    assert run_labels([first, tmp_path / "linked"]) == ["base", "linked"]
    (second / "config.yaml").write_text(de_en)
    assert main(["compare", "--run", str(first), "--run", str(second)]) == 0
    assert not capsys.readouterr().out.splitlines()[1].startswith("note:")
    # stop 57: by the val sentences, where both runs' files are here, not by what the configs say
    for name, second_line in (("one", "Zwei Hunde."), ("two", "Drei Katzen.")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "val.de").write_text(f"Ein Hund.\n{second_line}\n")
        (tmp_path / name / "val.en").write_text("A dog.\nTwo dogs.\n")

    def configure(run: Path, data_dir: str, sentences: int) -> None:
        sets = [f"data.dir={tmp_path / data_dir}", f"train.eval_sentences={sentences}"]
        (run / "config.yaml").write_text(config_text(load_config(TINY_CONFIG, sets)))

    configure(first, "one", 0)
    configure(second, "one", 2)  # all of val, said otherwise: the same sentences, no note
    assert main(["compare", "--run", str(first), "--run", str(second)]) == 0
    assert not capsys.readouterr().out.splitlines()[1].startswith("note:")
    configure(second, "two", 0)  # val files of one name with other sentences: a note
    assert main(["compare", "--run", str(first), "--run", str(second)]) == 0
    note = capsys.readouterr().out.splitlines()[1]
    assert note.startswith("note: the runs validate on different data (a/base: de->en, val (2 sentences, digest ")
    # references that differ in invisible ends alone score differently (stop 65: the same digest)
    (tmp_path / "zw").mkdir()
    (tmp_path / "zw" / "val.de").write_text("Ein Hund.\nZwei Hunde.\n")
    (tmp_path / "zw" / "val.en").write_text("A dog.\u200b\nTwo dogs.\u200b\n")
    configure(second, "zw", 0)
    assert main(["compare", "--run", str(first), "--run", str(second)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("note: the runs validate on different data")
    configure(second, "moved", 0)  # files not here: the configs' settings decide, alike
    assert main(["compare", "--run", str(first), "--run", str(second)]) == 0
    assert not capsys.readouterr().out.splitlines()[1].startswith("note:")


def test_plot_never_writes_over_a_runs_file_nor_takes_a_directory_for_a_file(
    run_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 57: `--out` a link to a run's metrics.jsonl or best.pt was written through, a PNG in
    their place; `--out figs/` wrote figs.png, `average --out avgs/` a file named avgs."""
    for name in ("metrics.jsonl", "checkpoints/best.pt"):
        link = tmp_path / f"{name.replace('/', '_')}.png"
        link.symlink_to(run_copy / name)
        before = (run_copy / name).read_bytes()
        r = mtx_here(monkeypatch, "plot", "--run", str(run_copy), "--out", str(link))
        assert_one_line_error(r, f"--out {link} is one of the files of the run {run_copy}")
        assert (run_copy / name).read_bytes() == before
    for argv in (["plot", "--run", str(run_copy)], ["average", "--run", str(run_copy), "--last", "2"]):
        r = mtx_here(monkeypatch, *argv, "--out", f"{tmp_path}/figs/")
        assert r.returncode == 2 and r.stderr.decode().splitlines() == [
            f"mtx: error: argument --out: '{tmp_path}/figs/' ends in '/', a directory; give a file path "
            f"(see mtx {argv[0]} --help)"
        ]
    assert not (tmp_path / "figs").exists() and not (tmp_path / "figs.png").exists()


def test_plot_draws_several_runs_against_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run's curves, against minutes of training with `--x time` (stop 69's probe: the test
    checked only that a PNG was written, and passed with --x ignored or one run drawn)."""
    import matplotlib.pyplot as plt

    runs = [fake_run(tmp_path / name, seconds, [3.0, 2.0]) for name, seconds in (("a", 0.3), ("b", 0.6))]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # the figure, kept to be read
    out = tmp_path / "both.png"
    assert main(["plot", "--run", str(runs[0]), "--run", str(runs[1]), "--x", "time", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loss, bleu, lr = figures[0].axes
    assert [line.get_label() for line in bleu.get_lines()] == ["a", "b"]
    assert [list(line.get_xdata()) for line in bleu.get_lines()] == [[0.5, 1.0], [1.0, 2.0]]  # minutes
    assert [list(line.get_ydata()) for line in bleu.get_lines()] == [[10.0, 20.0]] * 2
    assert len(loss.get_lines()) == 4 and len(lr.get_lines()) == 2 and lr.get_xlabel() == "minutes of training"
    # PostScript draws no transparency: nothing is transparent, and matplotlib says nothing (stop 69's probe)
    assert main(["plot", "--run", str(runs[0]), "--run", str(runs[1]), "--out", str(tmp_path / "both.eps")]) == 0
    assert "transparency" not in capsys.readouterr().err and (tmp_path / "both.eps").read_bytes()[:4] == b"%!PS"


def test_plot_writes_the_type_out_names_and_says_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = fake_run(tmp_path / "a", 0.1, [3.0, 2.0])
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "curves.svg")]) == 0
    assert (tmp_path / "curves.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")
    # no suffix: a PNG, at the path printed (matplotlib would add .png unseen)
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "curves")]) == 0
    printed = capsys.readouterr().out.split()[-1]
    assert printed == str(tmp_path / "curves.png") and Path(printed).read_bytes()[:4] == b"\x89PNG"
    # a type matplotlib cannot write: one line, no file
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "curves.txt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "cannot write .txt files" in err and ".svg" in err
    assert not (tmp_path / "curves.txt").exists()


def test_a_type_matplotlib_fails_to_write_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 56: `--out curves.pgf` without LaTeX installed ended in matplotlib's 85-line traceback
    (pgf is among the types matplotlib lists; its writer runs xelatex). Here the writer fails as
    it does there, whatever this machine has installed; an earlier file of that name stays."""
    from matplotlib.figure import Figure

    def no_latex(self: Figure, *args: object, **kwargs: object) -> None:
        raise RuntimeError("'xelatex' not found.  Install it or change rcParams['pgf.texsystem'] to an available TeX")

    monkeypatch.setattr(Figure, "savefig", no_latex)
    run = fake_run(tmp_path / "a", 0.1, [3.0, 2.0])
    earlier = tmp_path / "curves.pgf"
    earlier.write_text("kept")
    assert main(["plot", "--run", str(run), "--out", str(earlier)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "curves.pgf: matplotlib cannot write it: 'xelatex' not found" in err, err
    # the directories it made for the image go again (stop 57: they stayed)
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "sub" / "dir" / "y.pgf")]) == 1
    assert "matplotlib cannot write it" in capsys.readouterr().err and not (tmp_path / "sub").exists()
    assert earlier.read_text() == "kept"


def test_choose_on_val_scores_references_as_mtx_eval_and_warns_of_choosing_on_train(
    run_copy: Path,
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """stop 64: it scored references stripped of invisible ends (a left-to-right mark before each
    line: val BLEU 3.76 where its printed `mtx eval` command gave 2.10), and chose on the training
    split without a word where data.valid_split was train. Now eval's references and warnings, and
    mtx train's warning."""
    from mtx.evaluate import corpus_scores

    data = tmp_path / "data"
    data.mkdir()
    clean = (small_data / "val.en").read_text(encoding="utf-8").splitlines()[:100]
    (data / "dev.en").write_text("".join(f"\u200e{line}\n" for line in clean), encoding="utf-8")
    (data / "dev.de").write_text("".join((small_data / "val.de").read_text().splitlines(True)[:100]))
    config = run_copy / "config.yaml"
    text = config.read_text().replace(str(small_data), str(data))
    text = text.replace("valid_split: val\n", "valid_split: dev\n").replace("split: train\n", "split: dev\n")
    config.write_text(text)  # validated, and trained, on dev
    outputs = []
    search_translate = mtx.search.translate

    def recorded(*args: object, **options: object) -> list[str]:
        outputs.append(search_translate(*args, **options))
        return outputs[-1]

    monkeypatch.setattr(mtx.search, "translate", recorded)
    script = Path(__file__).resolve().parent.parent / "scripts" / "choose_on_val.py"
    args = ["--run", str(run_copy), "--last", "", "--ensemble", "", "--length-penalty", ""]
    code, out, err = script_in_process(script, args, monkeypatch, capsys)
    assert code == 0, err
    assert "data.valid_split is the training split ('dev'): val loss and BLEU measure the training data" in err
    assert f"{data / 'dev.en'}: 100 of 100 reference lines begin or end with invisible characters" in err
    result = json.loads(out.splitlines()[-1])
    marked = [round(corpus_scores(text, [f"\u200e{line}" for line in clean]).bleu, 2) for text in outputs]
    # the start (best.pt, decoded first) and the choice among best.pt and ema.pt, as eval scores them
    assert result["start_val_bleu"] == marked[0] < round(corpus_scores(outputs[0], clean).bleu, 2)
    assert result["val_bleu"] == max(marked)


def test_an_optional_package_missing_or_broken_is_told_apart() -> None:
    """A matplotlib built for numpy 1 beside numpy 2 was "needs matplotlib: pip install", which
    changed nothing (stop 64)."""
    missing = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    assert str(import_failed(missing, "matplotlib", "mtx plot needs", "pip install 'mtx[plot]'")) == (
        "mtx plot needs matplotlib: pip install 'mtx[plot]'"
    )
    broken = ImportError("numpy.core.multiarray failed to import\nmore")
    assert str(import_failed(broken, "matplotlib", "mtx plot needs", "pip install 'mtx[plot]'")) == (
        "matplotlib is installed but cannot be imported (numpy.core.multiarray failed to import); reinstall or "
        "upgrade it: pip install 'mtx[plot]'"
    )
    # a module it needs that is missing is not the package itself
    inner = ModuleNotFoundError("No module named 'kiwisolver'", name="kiwisolver")
    assert "matplotlib is installed but cannot be imported" in str(import_failed(inner, "matplotlib", "x", "y"))


def test_every_rename_of_a_best_change_is_followed_by_a_directory_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 67 (read from the code: a power cut cannot be tested here): best_single.pt's new
    name, the set-aside average's rename to best_average.pt and the single's return to best.pt
    were not followed by a sync of checkpoints/, so a power cut could lose the name."""
    import mtx.checkpoint

    ckpts = _run_checkpoints(tmp_path)
    events: list[str] = []
    replace, sync_dir = os.replace, mtx.checkpoint.fsync_dir

    def logged_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        replace(src, dst)
        events.append(Path(dst).name)

    def logged_sync_dir(directory: Path) -> None:
        sync_dir(directory)
        events.append(f"sync {directory.name}")

    monkeypatch.setattr(os, "replace", logged_replace)
    monkeypatch.setattr(mtx.checkpoint, "fsync_dir", logged_sync_dir)
    make_best(tmp_path, {"step": 40, "averaged_from": ["step_30.pt", "step_40.pt"]})  # best_single.pt linked
    make_best(tmp_path, {"step": 40, "averaged_from": ["step_20.pt", "step_40.pt"]})  # best_average.pt set aside
    restore_best_single(tmp_path)
    monkeypatch.undo()
    assert {"best.pt", "best_single.pt", "best_average.pt"} <= set(events)
    renames = [i for i, event in enumerate(events) if not event.startswith("sync")]
    assert all(events[i + 1] == "sync checkpoints" for i in renames), events
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "best_average.pt"]


def test_a_run_named_in_bytes_that_are_not_utf8_or_in_cjk_is_printed_and_drawn(run_copy: Path, tmp_path: Path) -> None:
    """A directory of an old Latin-1 archive has a name that is not UTF-8, which Python hands over
    as lone surrogates: under a UTF-8 locale (strict standard output) average and compare ended in
    a traceback after their work, eval too after scoring, and plot in matplotlib's; train.log
    stopped at the first message naming it (stop 67). Such a path is printed as its own bytes."""
    from mtx.runlog import RunLog

    odd = shutil.copytree(run_copy, tmp_path / os.fsdecode(b"run \xfc"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8:strict"}  # as en_US.UTF-8's
    for args in (
        ["average", "--run", str(odd), "--last", "1"],
        ["compare", "--run", str(odd), "--run", str(run_copy)],
        ["plot", "--run", str(odd), "--run", str(run_copy), "--out", str(tmp_path / "p.png")],
    ):
        r = subprocess.run([sys.executable, "-m", "mtx", *args], capture_output=True, env=env, timeout=300)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
        assert b"run \xfc" in r.stdout or args[0] == "plot", r.stdout
    assert (tmp_path / "p.png").stat().st_size > 0
    # a name the font cannot draw (CJK): matplotlib's warning per glyph was a traceback under -W error
    cjk = shutil.copytree(run_copy, tmp_path / "\u65e5\u672c\u8a9e")
    plot = ["plot", "--run", str(cjk), "--out", str(tmp_path / "cjk.png")]
    r = subprocess.run([sys.executable, "-W", "error", "-m", "mtx", *plot], capture_output=True, env=env, timeout=300)
    assert r.returncode == 0 and b"Glyph" not in r.stderr, r.stderr.decode()
    log = RunLog(tmp_path / "train.log")
    log.emit(logging.makeLogRecord({"msg": f"found {odd}", "levelno": logging.INFO}))
    log.emit(logging.makeLogRecord({"msg": "the next line", "levelno": logging.INFO}))
    log.close()
    assert not log.failed and (tmp_path / "train.log").read_text().endswith("the next line\n")


def test_the_glyph_warnings_of_every_matplotlib_wording_are_quiet() -> None:
    """matplotlib before 3.9 (pyproject allows 3.8.4) says "missing from current font", later ones
    "missing from font(s) X": both are quiet in `plot` (stop 67 review: the first was not)."""
    import warnings

    from mtx.plot import _no_glyph_warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _no_glyph_warnings():
            for ending in ("current font.", "font(s) DejaVu Sans."):
                warnings.warn(f"Glyph 26085 (\\N{{CJK UNIFIED IDEOGRAPH-65E5}}) missing from {ending}", stacklevel=1)
        with pytest.raises(UserWarning):
            warnings.warn("another warning", stacklevel=1)


# -- stop 69's second mutation probe: behaviour no test pinned ------------------------------------


def test_step_checkpoints_are_in_step_order_past_a_power_of_ten(tmp_path: Path) -> None:
    """keep_last rotation and `mtx average --last` take the newest by step: step_1000 is newer
    than step_999 and step_200 (sorted by name it came first, and rotation removed it)."""
    from mtx.checkpoint import step_checkpoints

    (tmp_path / "checkpoints").mkdir()
    for step in (200, 999, 1000, 1200, 10000):
        (tmp_path / "checkpoints" / f"step_{step}.pt").write_bytes(b"x")
    assert [p.name for p in step_checkpoints(tmp_path)] == [
        "step_200.pt",
        "step_999.pt",
        "step_1000.pt",
        "step_1200.pt",
        "step_10000.pt",
    ]


def test_an_average_refuses_members_whose_whole_number_tensors_differ(tmp_path: Path) -> None:
    """Integer tensors (a restricted model's output_ids) cannot be averaged: members that differ
    in one are not from the same run (averaging kept the first's and mixed two models)."""
    from mtx.checkpoint import FORMAT_VERSION, CheckpointError, atomic_save, average_checkpoints

    paths = []
    for i, ids in enumerate(([4, 5, 6], [4, 5, 7])):
        model = {"w": torch.full((2, 2), float(i)), "output_ids": torch.tensor(ids)}
        paths.append(tmp_path / f"step_{i + 1}.pt")
        payload = {"format_version": FORMAT_VERSION, "model": model, "config": {}, "vocab": "v", "step": i + 1}
        atomic_save(payload, paths[-1])
    with pytest.raises(CheckpointError, match="output_ids differs"):
        average_checkpoints(paths)
    same = {"w": torch.ones(2, 2), "output_ids": torch.tensor([4, 5, 6])}
    atomic_save({"format_version": FORMAT_VERSION, "model": same, "config": {}, "vocab": "v", "step": 3}, paths[1])
    assert torch.equal(average_checkpoints(paths)["model"]["w"], torch.full((2, 2), 0.5))


def test_average_of_exactly_the_kept_checkpoints_adds_no_note(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The note says --last asked for more step checkpoints than the run has; asking for as many
    as it has is no such case (stop 70's mutant: noted at equal counts too)."""
    kept = len(step_checkpoints(run_copy))
    assert main(["average", "--run", str(run_copy), "--last", str(kept)]) == 0
    out, err = capsys.readouterr()
    assert f"averaged {kept} checkpoints" in out and "note:" not in err


def test_plot_of_several_runs_writes_compare_png_and_standard_output_gets_the_image_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture
) -> None:
    """Several runs without --out: compare.png in the working directory, its path printed; with
    `--out -` standard output holds the image and nothing after it (stop 70's mutants: the first
    run's curves.png replaced, and the path printed after the image)."""
    runs = [fake_run(tmp_path / name, 0.1, [3.0, 2.0]) for name in ("a", "b")]
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "--run", str(runs[0]), "--run", str(runs[1])]) == 0
    assert capsysbinary.readouterr().out.decode().splitlines() == ["compare.png"]
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG" and not (runs[0] / "curves.png").exists()
    assert main(["plot", "--run", str(runs[0]), "--out", "-"]) == 0
    image = capsysbinary.readouterr().out
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and image.endswith(b"IEND\xaeB`\x82")  # the PNG's last chunk


def test_plot_takes_an_image_suffix_in_capitals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out curves.PNG` is a PNG, as .png is (stop 70's mutant: refused as a type matplotlib cannot write)."""
    run = fake_run(tmp_path / "a", 0.1, [3.0, 2.0])
    assert main(["plot", "--run", str(run), "--out", str(tmp_path / "curves.PNG")]) == 0
    assert (tmp_path / "curves.PNG").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.split()[-1] == str(tmp_path / "curves.PNG")


def test_metrics_with_true_or_false_for_a_number_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """JSON's true is a Python bool, an int: a hand-edited `"val_bleu": true` was drawn as 1 (stop
    70's mutant: the bool check dropped, no test failed)."""
    run = fake_run(tmp_path / "run", 0.1, [3.0])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('\n{"event": "valid", "step": 200, "val_loss": 1.0, "val_bleu": true, "elapsed_s": 9}\n')
    assert main(["plot", "--run", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 4: a valid event without a number 'val_bleu' (got True)" in err, err


def test_compare_at_equal_time_takes_the_last_validation_in_the_files_order(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Where a metrics.jsonl's training times do not rise line by line (a validation redone after
    a resume from an earlier checkpoint, in a file not trimmed at the resume, as before the trim or
    joined by hand), the table takes at equal time the last validation in the file at or before
    that time, as it says, not the one latest in time (stop 70's mutant: no test failed)."""
    first = fake_run(tmp_path / "first", 0.3, [3.0, 2.0])  # validations at 30 s and 60 s
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    events = [
        {"event": "valid", "step": 100, "val_loss": 3.5, "val_bleu": 5.0, "elapsed_s": 10.0},
        {"event": "valid", "step": 200, "val_loss": 3.2, "val_bleu": 6.0, "elapsed_s": 30.0},
        {"event": "valid", "step": 200, "val_loss": 2.9, "val_bleu": 7.0, "elapsed_s": 25.0},  # redone from 100
    ]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["compare", "--run", str(first), "--run", str(resumed)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[0][0] == "100" and rows[0][-4:] == ["2.900", "/", "7.00", "(200)"]  # at 30 s


def test_choose_on_val_chooses_and_reports_by_the_scores_it_measured(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The choice and its JSON from known val BLEUs: each candidate (in the order the script scores
    them), length penalty and beam gets a set score, so which one wins is not left to a tiny model's
    near ties (stop 70's mutants: the worst penalty taken, the beams compared at the config's
    penalty instead of the chosen one, the candidate's score reported for the final setting, and
    the "not applied" line dropped, each passed the tests)."""
    import types

    import mtx.evaluate

    models: list[object] = []  # candidates in the order first decoded: best single, average, ema, ensemble
    base = [10.0, 12.0, 11.0, 11.5]
    at_settings = {(1, 0.6, 4): 12.5, (1, 1.4, 4): 13.0, (1, 1.4, 1): 12.0, (1, 1.4, 8): 12.5}

    def translate(model: object, tgt_tok: object, src_ids: list, beam: int, alpha: float, *rest: object, **kw: object):
        if not any(m is model for m in models):
            models.append(model)
        i = next(i for i, m in enumerate(models) if m is model)
        bleu = at_settings.get((i, alpha, beam), base[i] if (alpha, beam) == (1.0, 4) else 0.0)
        return [f"{bleu}"] * len(src_ids)

    def corpus_scores(text: list[str], refs: list[str]) -> types.SimpleNamespace:
        return types.SimpleNamespace(bleu=float(text[0]))

    def paired_tests(final: list[str], others: list, refs: list[str], samples: int) -> list[types.SimpleNamespace]:
        start = float(others[0][1][0])
        return [types.SimpleNamespace(bleu=start, bleu_delta=float(final[0]) - start, bleu_p=0.25)]

    monkeypatch.setattr(mtx.search, "translate", translate)
    monkeypatch.setattr(mtx.evaluate, "corpus_scores", corpus_scores)
    monkeypatch.setattr(mtx.evaluate, "paired_tests", paired_tests)
    assert load_run(run_copy).cfg.decode.beam == 4 and load_run(run_copy).cfg.decode.length_penalty == 1.0
    script = Path(__file__).resolve().parent.parent / "scripts" / "choose_on_val.py"
    args = ["--run", str(run_copy), "--last", "2", "--ensemble", "2", "--length-penalty", "0.6,1.4", "--beam", "1,8"]
    code, out, err = script_in_process(script, args, monkeypatch, capsys)
    assert code == 0, err
    assert len(models) == 4  # the best single, the average of 2, the moving average, the ensemble of 2
    lines = out.splitlines()
    assert lines[1:5] == [
        f"best single (best.pt, step {load_checkpoint(run_copy / 'checkpoints' / 'best.pt')['step']}): 10.00",
        "average of the last 2: 12.00",
        "moving average (ema.pt, decay 0.99): 11.00",
        "ensemble of the last 2: 11.50",
    ]
    assert lines[5:10] == [
        "average of the last 2, the best candidate, at other settings:",
        "  length penalty 0.6: 12.50",
        "  length penalty 1.4: 13.00",
        "  beam 1 (length penalty 1.4): 12.00",
        "  beam 8 (length penalty 1.4): 12.50",
    ]
    assert lines[10] == "chosen: average of the last 2, length penalty 1.4, beam 4: val BLEU 13.00"
    assert lines[11] == (
        "against the start (best single, length penalty 1, beam 4): 10.00 -> 13.00 (+3.00), paired bootstrap p = 0.2500"
    )
    assert lines[12] == (
        "not applied: run again with --apply to make the average of the last 2 the run's best.pt, then decode "
        "with --length-penalty 1.4 --beam 4"
    )
    result = json.loads(lines[-1])
    assert {k: result[k] for k in ("chosen", "length_penalty", "beam", "val_bleu", "start_val_bleu")} == {
        "chosen": "average of the last 2",
        "length_penalty": 1.4,
        "beam": 4,
        "val_bleu": 13.0,
        "start_val_bleu": 10.0,
    }
    assert result["gain_p_value"] == 0.25
    assert result["averaged_from"] == [str(p) for p in step_checkpoints(run_copy)[-2:]]


def test_choose_on_val_takes_a_length_penalty_of_0_and_refuses_counts_of_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A length penalty of 0 (raw log-probabilities) is one mtx takes; a beam, an average or an
    ensemble of 0 is a mistake, not the config's beam or nothing (stop 70's mutants: 0 refused as a
    penalty, or taken as a count: `--beam 0` scored the config's beam as "beam 0")."""
    import runpy

    script = Path(__file__).resolve().parent.parent / "scripts" / "choose_on_val.py"
    names = runpy.run_path(str(script), run_name="choose_on_val")
    assert names["penalties"]("0,1.5,10") == [0.0, 1.5, 10.0]
    assert names["counts"]("1,4") == [1, 4]
    for option in ("--beam", "--last", "--ensemble"):
        code, _, err = script_in_process(script, ["--run", "r", f"{option}=4,0"], monkeypatch, capsys)
        assert code == 2 and f"argument {option}: expected comma-separated whole numbers >= 1, got '4,0'" in err
