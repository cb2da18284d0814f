"""The commands a user types, run as real processes: outputs, files and exit codes."""

from __future__ import annotations

import argparse
import ast
import contextlib
import errno
import fcntl
import io
import json
import logging
import math
import os
import pty
import re
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import pytest
import sacrebleu
import torch

from mtx.cli import build_parser, int_in, main
from mtx.cli_decode import _decode_settings, _hypotheses_name, _settings, _source_tag, score_text
from mtx.config import Config, DecodeConfig, config_text, load_config, load_run_config
from mtx.errors import MtxError
from mtx.outputs import check_output, data_files, stdin_is_stdout, training_data, utf8_stdout
from mtx.text import read_lines
from mtx.threads import cgroup_cpu_quota, set_threads, usable_cpus

from .conftest import REPO, TINY_CONFIG, FakeMulti30k, main_in_process, tiny_args


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "2"}


def mtx(*args: str, stdin: bytes | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "mtx", *args], input=stdin, capture_output=True, cwd=cwd, env=_child_env(), timeout=600
    )


def mtx_here(
    monkeypatch: pytest.MonkeyPatch, *args: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`mtx()` through the same entry point in this process: a process spends 2-3 s importing torch."""
    return main_in_process(list(args), stdin, monkeypatch)


def assert_one_line_error(result: subprocess.CompletedProcess[bytes], *needles: str) -> None:
    err = result.stderr.decode()
    assert result.returncode != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("mtx: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


def test_train_translate_eval_round_trip(tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training and a first translation as a user's processes; the other commands on the run
    through the same entry point in this process (a process spends 2-3 s importing torch)."""
    run_dir = tmp_path / "run"
    r = mtx(*tiny_args(small_data, run_dir, "--set", "train.max_steps=30", "--set", "train.eval_every=15"))
    assert r.returncode == 0, r.stderr.decode()
    summary = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert summary["step"] == 30
    files = ("config.yaml", "tokenizer.json", "metrics.jsonl", "train.log", "checkpoints/last.pt")
    for name in (*files, "checkpoints/best.pt"):
        assert (run_dir / name).is_file(), name
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {e["event"] for e in events} == {"train", "valid"}
    assert [e["step"] for e in events if e["event"] == "valid"] == [15, 30]
    assert f"data:\n  dir: {small_data}" in (run_dir / "config.yaml").read_text()  # resolved

    r = mtx("translate", "--run", str(run_dir), "Ein Mann fährt Fahrrad.", "Zwei Hunde.")
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout.decode().splitlines()) == 2

    r = mtx_here(monkeypatch, "translate", "--run", str(run_dir), "--beam", "1", stdin=b"Ein Hund.\n\nEine Frau.\n")
    out = r.stdout.decode().split("\n")
    assert r.returncode == 0 and len(out) == 4 and out[1] == "" and out[0] and out[2]

    r = mtx_here(monkeypatch, "translate", "--run", str(run_dir), "--beam", "3", "--nbest", "2", "Ein Hund.")
    lines = r.stdout.decode().splitlines()
    assert r.returncode == 0 and len(lines) == 2 and all(line.startswith("0 ||| ") for line in lines)
    # at a length penalty near the largest allowed every score lies near 0: 4 decimals printed
    # them all as -0.0000 (stop 62)
    r = mtx_here(
        monkeypatch,
        "translate",
        "--run",
        str(run_dir),
        "--beam",
        "3",
        "--nbest",
        "3",
        "--length-penalty",
        "9.5",
        "Ein Hund.",
    )
    scores = [float(line.rsplit(" ||| ", 1)[1]) for line in r.stdout.decode().splitlines()]
    assert (
        r.returncode == 0 and len(scores) == 3 and all(s < 0 for s in scores) and scores == sorted(scores, reverse=True)
    )

    r = mtx_here(monkeypatch, "eval", "--run", str(run_dir), "--beam", "2", "--lowercase")
    text = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp" in text and "case:lc" in text and "chrF" in text
    hyp_file = run_dir / "eval" / "test_2016_flickr.beam2.en"
    assert len(hyp_file.read_text().splitlines()) == 100

    r = mtx_here(monkeypatch, "eval", "--run", str(run_dir), "--beam", "2", "--stop", "finished", "--json")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["stop"] == "finished"
    assert len((run_dir / "eval" / "test_2016_flickr.beam2.finished.en").read_text().splitlines()) == 100

    src, ref = str(small_data / "val.de"), str(small_data / "val.en")
    r = mtx_here(monkeypatch, "eval", "--run", str(run_dir), "--src", src, "--ref", ref, "--json", "--lowercase")
    result = json.loads(r.stdout.decode())
    assert r.returncode == 0 and result["sentences"] == 200 and 0 <= result["bleu"] <= 100
    # the scores are sacreBLEU's own of the hypotheses written against the references given
    assert re.fullmatch(r"val\.de\.[0-9a-f]{8}\.beam\d+\.en", Path(result["hypotheses"]).name)
    hyps = Path(result["hypotheses"]).read_text(encoding="utf-8").splitlines()
    refs = (small_data / "val.en").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) == 200
    assert result["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    assert result["bleu_lowercase"] == round(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score, 2)
    assert result["chrf"] == round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2)

    # a second train into the same directory is refused and changes nothing
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    r = mtx_here(monkeypatch, *tiny_args(small_data, run_dir))
    assert_one_line_error(r, "already holds a run", "--resume")
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before


def test_int_in_bounds_whole_numbers() -> None:
    parse = int_in(1, 4, "the CPUs here")
    assert parse("1") == 1 and parse("4") == 4
    for text, message in (("0", "must be in 1..4 (the CPUs here), got 0"), ("5", "got 5"), ("2.5", "whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse(text)
    assert int_in(0)("1000000") == 1000000 and usable_cpus() >= 1


def test_a_cgroup_cpu_quota_bounds_the_cpus_and_torchs_default_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container limited to 2 CPUs (`docker --cpus 2`) on a machine of many cores, torch's
    default ran as many threads as the machine has cores; the quota was not read (stop 67's probe,
    by reading)."""
    import torch

    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    v2.mkdir()
    for cpu_max, cpus in (("150000 100000\n", 2), ("100000 100000", 1), ("1000 100000", 1), ("max 100000", None)):
        (v2 / "cpu.max").write_text(cpu_max)
        assert cgroup_cpu_quota(v2) == cpus, cpu_max
    for quota, cpus in (("50000", 1), ("300000", 3), ("-1", None)):
        (v1 / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
        (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        assert cgroup_cpu_quota(v1) == cpus, quota
    assert cgroup_cpu_quota(tmp_path / "none") is None
    (v2 / "cpu.max").write_text("garbled")
    assert cgroup_cpu_quota(v2) is None
    affinity = len(os.sched_getaffinity(0))
    (v2 / "cpu.max").write_text("100000 100000")
    monkeypatch.setattr("mtx.threads.CGROUP", v2)
    assert usable_cpus() == 1
    (v2 / "cpu.max").write_text("100000000 100000")  # a quota above the affinity: the affinity
    assert usable_cpus() == affinity
    (v2 / "cpu.max").write_text("100000 100000")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # torch's choice on a bigger machine
        set_threads(0)
        assert torch.get_num_threads() == 1
        set_threads(3)  # asked for: as asked (--threads is checked against the CPUs before)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_help_lists_every_option() -> None:
    """Every option of mtx and of each command is in its help, `-v` in each command's too (taken
    after the command since stop 69); stop 69's probe: 4 options were checked, by 9 processes."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in [parser, *commands.values()]:
        text = command.format_help()
        options = [option for action in command._actions for option in action.option_strings]
        assert "--verbose" in options and all(option in text for option in options), command.prog
    assert build_parser().parse_args(["compare", "--run", "a", "--run", "b", "-v"]).verbose
    assert not build_parser().parse_args(["compare", "--run", "a", "--run", "b"]).verbose
    r = mtx("--help")  # as a process
    assert r.returncode == 0 and all(name in r.stdout.decode() for name in commands)
    assert b"int8" in mtx("export", "--help").stdout


def test_usage_mistakes_are_one_line_that_points_to_the_commands_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """stop 57: argparse printed the command's usage (seven lines for translate) above its error,
    and an unknown option of a command pointed to `mtx --help`. Exit code 2, argparse's."""
    cases = [
        (["translate", "--beam", "x", "a"], "argument --beam: invalid int value: 'x' (see mtx translate --help)"),
        (["eval", "--run", "r", "--bogus", "x"], "unrecognized arguments: --bogus x (see mtx eval --help)"),
        (["--bogus", "eval", "--run", "r"], "unrecognized arguments: --bogus (see mtx --help)"),
        (["translate", "a"], "the following arguments are required: --run (see mtx translate --help)"),
        (["trian"], "argument COMMAND: invalid choice: 'trian' (choose from 'train', "),
    ]
    for argv, message in cases:
        r = mtx_here(monkeypatch, *argv)
        err = r.stderr.decode().splitlines()
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("mtx: error: ") and message in err[0], err
    r = mtx("translate", "--beam", "x", "a")  # as a process
    assert r.returncode == 2 and r.stderr.decode().splitlines() == [f"mtx: error: {cases[0][1]}"]


@pytest.mark.parametrize(
    "make_args, needles",
    [
        (lambda d, t: ["train", "--config", str(t / "bad.yaml")], ["bad.yaml", "train.max_step", "max_steps"]),
        (lambda d, t: [*tiny_args(t / "missing", t / "r")], ["does not exist", "data.dir"]),
        (lambda d, t: [*tiny_args(d, t / "r", "--set", "model.n_heads=3")], ["divisible"]),
        (lambda d, t: ["translate", "--run", str(t / "nowhere"), "hi"], ["run directory not found"]),
        (lambda d, t: ["train", "--run-dir", str(t / "r2"), "--resume"], ["run directory not found"]),
    ],
)
def test_user_mistakes_are_one_line_errors(tmp_path: Path, small_data: Path, make_args, needles) -> None:  # noqa: ANN001
    (tmp_path / "bad.yaml").write_text("train:\n  max_step: 3\n")
    assert_one_line_error(mtx(*make_args(small_data, tmp_path)), *needles)


def test_config_values_that_were_tracebacks_or_silent_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe of `mtx train --config X --set KEY=VALUE` found tracebacks (an invalid date, an integer
    past Python's 4,300 digits, `--set train.lr=...` where the file gives train as a list) and values
    taken silently (YAML 1.1's base-60 1:30 as 90, a config of `{}` as the defaults)."""
    cases = [
        ("train:\n  max_steps: 10\n", ["train.max_steps=2023-02-29"], "--set train.max_steps: 2023-02-29 is not"),
        ("train:\n  init_from: 2023-02-29\n", [], "c.yaml: malformed YAML at line 2, column 14: 2023-02-29 is not"),
        ("train:\n  max_steps: 10\n", ["train.lr=1" + "0" * 5000], "--set train.lr: the integer 1000"),
        ("train: [1, 2]\n", ["train.lr=0.1"], "c.yaml: section train must be a mapping, got [1, 2]"),
        ("train:\n  max_minutes: 1:30\n", [], "YAML 1.1 reads 1:30 as the base-60 number 90"),
        ("train:\n  max_steps: 10\n", ["train.max_minutes=1:30"], "YAML 1.1 reads 1:30 as the base-60 number 90"),
        ("train:\n  dropout_start: 0.1\n", [], "train.dropout_start is set but train.dropout_warmup is 0"),
        ("{}\n", [], "c.yaml: the config is empty"),
        ("train:\n", [], "c.yaml: the config is empty: its sections (train) set no key"),
        ("train: {}\nmodel:\n", ["train.lr=0.1"], "c.yaml: the config is empty: its sections (train, model) set"),
    ]
    config, run = tmp_path / "c.yaml", tmp_path / "run"
    for text, settings, needle in cases:
        config.write_text(text)
        sets = [arg for setting in settings for arg in ("--set", setting)]
        r = mtx_here(monkeypatch, "train", "--config", str(config), "--run-dir", str(run), *sets)
        assert_one_line_error(r, needle)
        assert not run.exists()


def test_a_run_directory_linked_to_nothing_is_named_as_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--resume`, translate, average and plot on a run directory that is a symbolic link to a
    directory now gone (an unmounted disk) said "run directory not found" of a link that is there."""
    run = tmp_path / "run"
    run.symlink_to(tmp_path / "gone")
    expected = f"{run}: a symbolic link to {tmp_path / 'gone'}, which does not exist"
    for argv in (
        ["train", "--run-dir", str(run), "--resume"],
        ["translate", "--run", str(run), "hi"],
        ["average", "--run", str(run)],
        ["plot", "--run", str(run)],
    ):
        assert_one_line_error(mtx_here(monkeypatch, *argv), expected)
    assert run.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize(("speedup", "warning"), [(0.0, "emulated"), (0.6, "at 0.60x the speed of fp32"), (2.5, None)])
def test_bf16_decoding_warns_where_bf16_products_are_slow(
    tiny_run: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    speedup: float,
    warning: str | None,
) -> None:
    """`--precision bf16` still decodes in bf16 (the model's weights are bf16 in the search;
    fp32 without the option), and says when this CPU's measured bf16 products are slower than
    fp32's (`mtx.device.cpu_bf16_speedup`)."""
    from mtx import device, search
    from mtx.cli import main

    monkeypatch.setattr(device, "cpu_bf16_speedup", lambda: speedup)
    dtypes = []
    translate_ids = search.translate_ids

    def recording(model: torch.nn.Module, *args: object, **kwargs: object) -> object:
        dtypes.append(next(model.parameters()).dtype)
        return translate_ids(model, *args, **kwargs)

    monkeypatch.setattr(search, "translate_ids", recording)
    args = ["translate", "--run", str(tiny_run), "--device", "cpu", "--precision", "bf16", "Ein Mann."]
    assert main(args) == 0  # the CPU even where the run trained on a GPU: the warning is the CPU's
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1
    assert main(args[:-3] + args[-1:]) == 0 and dtypes == [torch.bfloat16, torch.float32]
    capsys.readouterr()
    warned = [line for line in err.splitlines() if "--precision fp32 decodes faster" in line]
    assert len(warned) == (warning is not None), err
    assert warning is None or warning in warned[0]


def _start_translate(run: Path, *args: str, stdin: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "mtx", "translate", "--run", str(run), *args]
    pipe = subprocess.PIPE
    return subprocess.Popen(command, stdin=stdin, stdout=pipe, stderr=pipe, cwd=REPO, env=_child_env())


def _read_line(stream: IO[bytes], seconds: float = 120) -> str:
    """One line of a child's output, failing if it has not come after `seconds`."""
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no output line after {seconds} s"
    return stream.readline().decode()


SENTENCES = ["Ein Mann fährt Fahrrad.", "", "Zwei Hunde spielen im Schnee.", "Eine Frau liest.", "Ein Kind lacht."]


def test_translate_and_eval_read_a_sources_whitespace_as_one_space(
    tiny_run: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Doubled spaces, tabs, no-break spaces, soft hyphens and zero-width spaces inside a source
    line are read as the one space training saw (stop 72; stop 62's probe: no-break spaces for 10%
    of test_2016_flickr's spaces cost 4.4 BLEU); `--keep-spaces` reads them as written, its eval
    file tagged so that it does not replace the default one."""
    spaced = [s.replace(" ", "  \u00a0", 1).replace(" ", "\t") + "\u200b" if s else s for s in SENTENCES]
    spaced[0] = spaced[0].replace("Fahrrad", "Fahr\u00adrad")
    options = ("translate", "--run", str(tiny_run), "--beam", "2", "--nbest", "2")
    plain = mtx_here(monkeypatch, *options, *SENTENCES)
    assert plain.returncode == 0, plain.stderr.decode()
    assert mtx_here(monkeypatch, *options, *spaced).stdout == plain.stdout
    # as written: other pieces, so other scores
    kept = mtx_here(monkeypatch, *options, "--keep-spaces", *spaced)
    assert kept.returncode == 0 and kept.stdout != plain.stdout, kept.stderr.decode()

    lines = read_lines(small_data / "val.de")[:40]
    (tmp_path / "src.de").write_text("".join(line.replace(" ", " \u00a0") + "\n" for line in lines), encoding="utf-8")
    (tmp_path / "plain.de").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    (tmp_path / "ref.en").write_text("".join(line + "\n" for line in read_lines(small_data / "val.en")[:40]))

    def scores(src: str, *extra: str) -> dict[str, Any]:
        argv = ["eval", "--run", str(tiny_run), "--src", str(tmp_path / src), "--ref", str(tmp_path / "ref.en")]
        r = mtx_here(monkeypatch, *argv, "--beam", "1", "--json", *extra)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    normal, as_written, plain_scores = scores("src.de"), scores("src.de", "--keep-spaces"), scores("plain.de")
    assert normal["normalize_spaces"] and not as_written["normalize_spaces"]
    assert normal["bleu"] == plain_scores["bleu"] != as_written["bleu"]
    assert Path(as_written["hypotheses"]).name.split(".")[-3:] == ["beam1", "spaces", "en"]
    assert Path(as_written["hypotheses"]).read_text() != Path(normal["hypotheses"]).read_text()


def test_translate_and_eval_read_punctuation_the_training_sources_lack_as_they_write_it(
    tiny_run: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quotes the run's training sources (nearly) never have are read as the form they have (stop
    73: the tiny run's train.de slice has `"` twice and `“` 20 times, so `"` is read as `“`; stop 67's
    probe: French apostrophes typed `’` cost a fr->en model 1.75 BLEU on the lines that hold one);
    `--keep-punctuation` reads them as written, its eval file tagged, and eval's JSON says which."""
    quoted = [f'Er sagt "{s}"' if s else s for s in SENTENCES]
    options = ("translate", "--run", str(tiny_run), "--beam", "2", "--nbest", "2")
    plain = mtx_here(monkeypatch, *options, *(s.replace('"', "\u201c") for s in quoted))
    assert plain.returncode == 0, plain.stderr.decode()
    assert mtx_here(monkeypatch, *options, *quoted).stdout == plain.stdout
    kept = mtx_here(monkeypatch, *options, "--keep-punctuation", *quoted)
    assert kept.returncode == 0 and kept.stdout != plain.stdout, kept.stderr.decode()

    lines = [f'"{line}"' for line in read_lines(small_data / "val.de")[:40]]
    (tmp_path / "src.de").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    (tmp_path / "ref.en").write_text("".join(line + "\n" for line in read_lines(small_data / "val.en")[:40]))
    argv = ["eval", "--run", str(tiny_run), "--src", str(tmp_path / "src.de"), "--ref", str(tmp_path / "ref.en")]
    runs = [mtx_here(monkeypatch, *argv, "--beam", "1", "--json", *extra) for extra in ([], ["--keep-punctuation"])]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr.decode()
    normal, as_written = (json.loads(r.stdout) for r in runs)
    assert normal["normalize_punctuation"] and normal["punctuation_read_as"]['"'] == "\u201c"
    assert not as_written["normalize_punctuation"] and as_written["punctuation_read_as"] == {}
    assert Path(as_written["hypotheses"]).name.split(".")[-3:] == ["beam1", "punctuation", "en"]
    assert Path(as_written["hypotheses"]).read_text() != Path(normal["hypotheses"]).read_text()
    lines = mtx_here(monkeypatch, *argv, "--keep-punctuation", "--keep-spaces").stdout.decode().splitlines()
    assert lines[0].startswith("src.de de-en beam 4, length penalty 1, spaces as written, punctuation as written, fp32")


def test_translate_streams_standard_input(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard input in batches of --buffer-lines, the same outputs as all lines at once; a batch
    also ends where the input pauses, so a writer who waits for each line's translation gets it,
    through a pipe and at a terminal."""
    whole = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "2", "--nbest", "2", *SENTENCES)
    assert whole.returncode == 0, whole.stderr.decode()
    chunked = mtx_here(
        monkeypatch, "translate", "--run", str(tiny_run), "--beam", "2", "--nbest", "2", "--buffer-lines", "2",
        stdin="".join(s + "\n" for s in SENTENCES).encode(),
    )  # fmt: skip
    assert chunked.returncode == 0, chunked.stderr.decode()
    assert chunked.stdout == whole.stdout  # the n-best numbers count lines across chunks
    numbers = [int(line.split(" ||| ")[0]) for line in whole.stdout.decode().splitlines()]
    assert numbers == sorted(numbers) and set(numbers) == set(range(len(SENTENCES))), numbers
    expected = (
        mtx_here(monkeypatch, "translate", "--run", str(tiny_run), *SENTENCES[:2])
        .stdout.decode()
        .splitlines(keepends=True)
    )

    child = _start_translate(tiny_run)  # the default 10,000 lines: the pause ends each batch
    try:
        for sentence, translation in zip(SENTENCES[:2], expected, strict=True):
            child.stdin.write(sentence.encode() + b"\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            assert _read_line(child.stdout) == translation  # type: ignore[arg-type]
        child.stdin.close()  # type: ignore[union-attr]
        assert child.wait(timeout=120) == 0, child.stderr.read().decode()  # type: ignore[union-attr]
    finally:
        child.kill()

    controller, terminal = pty.openpty()
    child = _start_translate(tiny_run, stdin=terminal)
    os.close(terminal)
    try:
        os.write(controller, SENTENCES[0].encode() + b"\n")
        assert _read_line(child.stdout) == expected[0]  # type: ignore[arg-type]
        os.write(controller, b"\x04")  # Ctrl-D at the start of a line: the end of the input
        assert child.wait(timeout=120) == 0
        assert "Ctrl-D ends" in child.stderr.read().decode()  # type: ignore[union-attr]
    finally:
        child.kill()
        os.close(controller)


def test_translate_writes_utf8_whatever_the_locale_and_invisible_lines_are_empty(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 54: under a locale of another encoding a translation outside it stopped with a
    traceback (and one inside it was written in a file mtx then refused); a zero-width space or a
    byte order mark alone was translated as a sentence."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    assert main(["translate", "--run", str(tiny_run), "--beam", "1", "\u200b", SENTENCES[0], " \ufeff"]) == 0
    sys.stdout.flush()
    lines = raw.getvalue().decode("utf-8").split("\n")
    assert len(lines) == 4 and lines[0] == lines[2] == lines[3] == "" and lines[1]
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw := io.BytesIO(), encoding="ascii"))
    utf8_stdout()
    print("Zwei M\u00e4nner")
    sys.stdout.flush()
    assert raw.getvalue() == "Zwei M\u00e4nner\n".encode()


def test_eval_shows_a_progress_bar_on_a_terminal_only(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr a terminal: a bar of the sentences decoded, cleared at the end; the scores on stdout
    are those of a run without one (not a terminal: no bar)."""
    args = ["eval", "--run", str(tiny_run), "--split", "val", "--beam", "1", "--json"]
    assert main([*args, "--output", str(tmp_path / "a.en")]) == 0
    plain = capsys.readouterr()
    assert "decoding" not in plain.err
    command = [sys.executable, "-m", "mtx", *args, "--output", str(tmp_path / "b.en")]
    shown, out = _on_a_terminal(command, columns=100)  # tqdm needs a width
    scores = json.loads(out)
    assert shown.startswith(b"\rdecoding val:   0%") and b"/200 [" in shown and shown.endswith(b" \r")  # cleared
    assert {k: v for k, v in scores.items() if k != "hypotheses"} == {
        k: v for k, v in json.loads(plain.out).items() if k != "hypotheses"
    }


def test_training_on_a_terminal_of_no_width_logs_its_windows_as_lines(tmp_path: Path, mini_data: Path) -> None:
    """A pseudo-terminal never sized (`script`'s, some containers') reports 0 columns: tqdm drew
    a bar 0 characters wide, and the run showed no progress at all (stop 66)."""
    extra = ["train.max_steps=20", "train.eval_every=20", "train.log_every=10", "train.eval_sentences=10"]
    args = tiny_args(mini_data, tmp_path / "run", *(a for key in extra for a in ("--set", key)))
    shown, _ = _on_a_terminal([sys.executable, "-m", "mtx", *args], columns=0)  # a terminal never sized
    assert re.search(rb"step 10/20: loss [\d.]+, lr [\d.e+-]+, \d+ tgt tok/s", shown), shown.decode()
    # eval's bar is drawn 80 columns wide there
    evaluate = ["eval", "--run", str(tmp_path / "run"), "--split", "val", "--beam", "1"]
    evaluate += ["--output", str(tmp_path / "hyps.en")]
    shown, _ = _on_a_terminal([sys.executable, "-m", "mtx", *evaluate], columns=0)
    assert b"decoding val:" in shown, shown.decode()


def test_training_on_a_terminal_counts_to_the_epochs_end_and_logs_its_windows_to_train_log(
    tmp_path: Path, mini_data: Path
) -> None:
    """With train.max_epochs, the bar counted to train.max_steps ("39/10000 [00:04<20:52]" for a
    run that ended 5 s after it started), and a run started on a terminal wrote none of its window
    lines (loss, lr, tgt tok/s) to train.log, where README says they are (stop 68's probe)."""
    run = tmp_path / "run"
    extra = ["train.max_steps=10000", "train.max_epochs=2", "train.eval_every=10000", "train.log_every=2"]
    args = tiny_args(mini_data, run, *(a for key in [*extra, "train.eval_sentences=10"] for a in ("--set", key)))
    shown, _ = _on_a_terminal([sys.executable, "-m", "mtx", *args], columns=100)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in records)
    assert 10 < last < 30 and b"/10000" not in shown, shown.decode()
    assert re.findall(rb"\| *\d+/(\d+) \[", shown)[-1] == str(last).encode(), shown.decode()
    assert b"tgt tok/s" not in shown  # the bar shows them on the terminal
    log = (run / "train.log").read_text()
    windows = [r for r in records if r["event"] == "train"]
    assert len(re.findall(rf"step \d+/{last}: loss [\d.]+, lr [\d.e+-]+, \d+ tgt tok/s", log)) == len(windows), log


def test_training_on_a_terminal_clears_its_bar_before_a_log_line(tmp_path: Path, mini_data: Path) -> None:
    """The bar is drawn through `UntilReaderGone(sys.stderr)`, which tqdm did not take for stderr,
    so a log line was not preceded by the bar's clearing: each validation's line ran on from the
    bar's text, and a frozen bar stayed above (stop 67, a probe of terminals)."""
    extra = ["train.max_steps=20", "train.eval_every=10", "train.eval_sentences=10"]
    args = tiny_args(mini_data, tmp_path / "run", *(a for key in extra for a in ("--set", key)))
    shown, _ = _on_a_terminal([sys.executable, "-m", "mtx", *args], columns=100)
    assert re.search(rb"\r +\rstep 10: val loss", shown), shown.decode()
    assert not re.search(rb"\]step 10: val loss", shown), shown.decode()


def test_outputs_through_descriptors_are_written_through_and_links_keep_modes(tmp_path: Path) -> None:
    """/dev/stderr and /dev/fd/N name an open file that a new file renamed over its name would not
    reach (a TemporaryFile's descriptor got nothing); a file replaced keeps its mode (a 0600 file
    became 0644); a loop of links is one line, not a traceback (stop 66 review)."""
    from mtx.checkpoint import atomic_write_text
    from mtx.plot import replaced_at

    with tempfile.TemporaryFile(dir=tmp_path) as f:
        assert replaced_at(Path(f"/dev/fd/{f.fileno()}")) is None
    assert replaced_at(Path("/dev/stderr")) is None
    private = tmp_path / "private.en"
    private.write_text("old\n")
    private.chmod(0o600)
    (tmp_path / "link.en").symlink_to(private)
    target = replaced_at(tmp_path / "link.en")
    assert target == private
    atomic_write_text(target, "new\n")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and private.read_text() == "new\n"
    (tmp_path / "a.en").symlink_to(tmp_path / "b.en")
    (tmp_path / "b.en").symlink_to(tmp_path / "a.en")
    with pytest.raises(MtxError, match="a.en: a loop of symbolic links; pass --output with another path$"):
        check_output(tmp_path / "a.en", {})


def _on_a_terminal(command: list[str], columns: int) -> tuple[bytes, bytes]:
    """What `command` showed on a terminal of `columns` as its standard error (0: one never sized),
    and its standard output; it must succeed."""
    controller, terminal = pty.openpty()
    if columns:
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=terminal, cwd=REPO, env=_child_env())
    os.close(terminal)
    shown = b""
    try:
        while chunk := _read_terminal(controller):
            shown += chunk
        out = child.stdout.read()  # type: ignore[union-attr]
        assert child.wait(timeout=120) == 0
    finally:
        child.kill()
        os.close(controller)
    return shown, out


def _read_terminal(controller: int) -> bytes:
    """What the child wrote to its terminal since the last call; b"" once it has closed it."""
    ready, _, _ = select.select([controller], [], [], 120)
    assert ready, "the terminal stayed silent for 120 s"
    try:
        return os.read(controller, 65536)
    except OSError:  # Linux: EIO once the child's side is closed
        return b""


def test_paths_that_cannot_be_written_are_one_line_errors(
    tmp_path: Path, small_data: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory, export directory or hypothesis file under a regular file: the path and
    the system's reason in one line, exit 1, before any work is spent."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert_one_line_error(
        mtx_here(monkeypatch, *tiny_args(small_data, blocker / "run")),
        f"--run-dir {blocker / 'run'}: {blocker} is a file, not a directory",
    )
    exported = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(blocker / "ct2"))
    assert_one_line_error(exported, f"--out {blocker / 'ct2'}: {blocker} is a file, not a directory")
    hypotheses = mtx_here(
        monkeypatch, "eval", "--run", str(tiny_run), "--split", "val", "--output", str(blocker / "h.en")
    )
    assert_one_line_error(hypotheses, f"--output {blocker / 'h.en'}: {blocker} is a file, not a directory")
    assert blocker.read_text() == "x"


def test_eval_that_fails_leaves_no_directories_it_made(
    tmp_path: Path, tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding interrupted (Ctrl-C) after the directories for --output were made: they go again
    (stop 58: an empty `out/sub/` stayed), and one that was there stays; a finished eval keeps them."""
    import mtx.search

    def interrupted(*args: object, **kwargs: object) -> list[str]:
        raise KeyboardInterrupt

    kept = tmp_path / "kept"
    kept.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(mtx.search, "translate", interrupted)
        for parent in (tmp_path / "out" / "sub", kept / "sub"):
            r = mtx_here(
                monkeypatch, "eval", "--run", str(tiny_run), "--split", "val", "--output", str(parent / "h.en")
            )
            assert r.returncode == 130 and r.stderr.decode() == "mtx: interrupted\n", r.stderr.decode()
    assert not (tmp_path / "out").exists() and sorted(tmp_path.iterdir()) == [kept] and not any(kept.iterdir())
    r = mtx_here(
        monkeypatch, "eval", "--run", str(tiny_run), "--split", "val", "--output", str(tmp_path / "new" / "h.en")
    )
    assert r.returncode == 0 and (tmp_path / "new" / "h.en").is_file()


def test_output_paths_that_are_not_files_or_not_what_the_command_takes_are_one_line_errors(
    tmp_path: Path, small_data: Path, tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stop 52, each found by running the README's commands: `average --out` a device or pipe
    (it was replaced by a regular file, /dev/null included), a directory or a path under a file;
    `plot --out` a directory (it wrote DIR.png beside it); `export` with two --checkpoint (it
    exported the last) or --out a file; `eval --src` beside --split (ignored); a checkpoint or
    data directory that is of the other kind; a full disk names the stream written."""
    blocker, pipe = tmp_path / "a_file", tmp_path / "a_pipe"
    blocker.write_text("x")
    os.mkfifo(pipe)
    ckpts = tiny_run / "checkpoints"

    def refused(argv: list[str], message: str) -> None:
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert err.startswith("mtx: error: ") and len(err.splitlines()) == 1 and message in err, err

    average = ["average", "--run", str(tiny_run), "--last", "2", "--out"]
    refused([*average, str(pipe)], f"--out {pipe} is not a regular file")
    refused([*average, str(tmp_path)], f"--out {tmp_path} is a directory")
    refused([*average, str(blocker / "avg.pt")], f"{blocker} is a file, not a directory")
    assert stat.S_ISFIFO(pipe.stat().st_mode) and blocker.read_text() == "x"
    refused(["plot", "--run", str(tiny_run), "--out", str(tmp_path)], f"--out {tmp_path} is a directory")
    assert not tmp_path.with_suffix(".png").exists()
    two = ["--checkpoint", str(ckpts / "step_100.pt"), "--checkpoint", str(ckpts / "step_200.pt")]
    refused(["export", "--run", str(tiny_run), *two], "export takes one --checkpoint")
    refused(["export", "--run", str(tiny_run), "--out", str(blocker)], f"--out {blocker} is a file")
    src = ["--src", str(small_data / "val.de"), "--ref", str(small_data / "val.en")]
    refused(["eval", "--run", str(tiny_run), "--split", "val", *src], "--src/--ref replace --split")
    refused(["translate", "--run", str(tiny_run), "--checkpoint", str(ckpts), "x"], "a directory, not a checkpoint")
    data = ["--set", f"data.dir={blocker}"]
    refused(tiny_args(small_data, tmp_path / "run", *data), f"data.dir: {blocker} is a file, not a directory")
    if Path("/dev/full").exists():  # Linux: every write fails with ENOSPC
        (tmp_path / "s.de").write_text("Ein Hund.\nZwei M\u00e4nner.\n")
        (tmp_path / "s.en").write_text("A dog.\nTwo men.\n")
        files = ["--src", str(tmp_path / "s.de"), "--ref", str(tmp_path / "s.en"), "--beam", "1"]
        # stdout buffered, as for a user (stop 54: eval's and compare's scores were written at exit,
        # after main, so Python's "Exception ignored" block and exit code 120 instead of the one line)
        env = {k: v for k, v in _child_env().items() if k != "PYTHONUNBUFFERED"}
        for args in (["translate", "Ein Hund."], ["eval", *files], ["compare", "--run", str(tiny_run)]):
            with open("/dev/full", "wb") as out:
                argv = [sys.executable, "-m", "mtx", args[0], "--run", str(tiny_run), *args[1:]]
                full = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, cwd=REPO, env=env, timeout=600)
            assert full.returncode == 1 and "Exception ignored" not in full.stderr.decode(), full.stderr.decode()
            assert_one_line_error(full, "standard output: No space left on device")
        # stop 55: argparse drops the OSError of its help text (exit 0, unbuffered) or leaves it to
        # Python's flush at exit (120 and "Exception ignored", buffered)
        for help_args, child_env in (
            (["--help"], env),
            (["translate", "--help"], {**env, "PYTHONUNBUFFERED": "1"}),
            (["--version"], env),
        ):
            with open("/dev/full", "wb") as out:
                argv = [sys.executable, "-m", "mtx", *help_args]
                full = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, cwd=REPO, env=child_env, timeout=600)
            assert full.returncode == 1 and "Exception ignored" not in full.stderr.decode(), full.stderr.decode()
            assert_one_line_error(full, "standard output: No space left on device")


def test_standard_streams_closed_or_named_as_files(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 54: a closed standard input or output was a traceback; eval --output /dev/stdout with
    stdout redirected to a file wrote the hypotheses from the file's start, and the scores over
    them; plot --out /dev/stdout wrote /dev/stdout.png."""
    closed_in = subprocess.run(
        [sys.executable, "-m", "mtx", "translate", "--run", str(tiny_run)],
        capture_output=True, cwd=REPO, env=_child_env(), timeout=600, preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert_one_line_error(closed_in, "standard input is closed")
    closed_out = subprocess.run(
        [sys.executable, "-m", "mtx", "translate", "--run", str(tiny_run), "Ein Hund."],
        capture_output=True, cwd=REPO, env=_child_env(), timeout=600, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert_one_line_error(closed_out, "standard output is closed")
    (tmp_path / "s.de").write_text("Ein Hund.\nZwei M\u00e4nner.\nEine Frau.\n")
    (tmp_path / "s.en").write_text("A dog.\nTwo men.\nA woman.\n")
    files = ["--src", str(tmp_path / "s.de"), "--ref", str(tmp_path / "s.en"), "--beam", "1"]
    with open(tmp_path / "all.txt", "wb") as out:
        argv = [sys.executable, "-m", "mtx", "eval", "--run", str(tiny_run), *files, "--output", "/dev/stdout"]
        done = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, cwd=REPO, env=_child_env(), timeout=600)
    assert done.returncode == 0, done.stderr.decode()
    lines = (tmp_path / "all.txt").read_text().splitlines()
    hyps = mtx_here(
        monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", stdin=(tmp_path / "s.de").read_bytes()
    )
    assert lines[:3] == hyps.stdout.decode().splitlines() and lines[3].startswith("s.de de-en beam 1")
    assert lines[-1] == "hypotheses: /dev/stdout"
    dash = mtx("eval", "--run", str(tiny_run), *files, "--output", "-", cwd=tmp_path)  # "-": standard output too
    assert dash.stdout.decode().splitlines() == [*lines[:-1], "hypotheses: -"] and not (tmp_path / "-").exists()
    image = mtx("plot", "--run", str(tiny_run), "--out", "/dev/stdout")  # through a pipe, which PNG cannot seek
    assert image.returncode == 0 and image.stdout.startswith(b"\x89PNG\r\n\x1a\n"), image.stderr.decode()
    assert image.stdout.endswith(b"IEND\xaeB`\x82")  # the image alone: no path printed after it
    assert not Path("/dev/stdout.png").exists()


def test_a_closed_standard_error_loses_no_output_and_adds_none(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With standard error closed (`2>&-`), eval and translate from a pipe exited 1 with no output
    (the progress bar wrote to None), and log lines and notes went to standard output: a warning
    became a line of translate's output (stop 68's probe; stop 54 had seen to the error line alone)."""

    def closed_2(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, "-m", "mtx", *args]
        return subprocess.run(  # (a pipe to its standard input, as a script's `mtx translate < in > out`)
            argv, input=stdin, capture_output=True, cwd=tmp_path, env=_child_env(), timeout=600,
            preexec_fn=lambda: os.close(2),
        )  # fmt: skip

    lines = b"Ein Hund.\nEine Frau.\n"
    want = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", stdin=lines).stdout
    piped = closed_2("translate", "--run", str(tiny_run), "--beam", "1", stdin=lines)
    assert piped.returncode == 0 and piped.stdout == want and len(want.splitlines()) == 2
    (tmp_path / "s.de").write_bytes(lines)
    warned = closed_2("translate", "--run", str(tiny_run), "--beam", "1", "s.de")  # "names a file": a warning
    assert warned.returncode == 0 and len(warned.stdout.splitlines()) == 1, warned.stdout
    (tmp_path / "s.en").write_text("A dog.\nA woman.\n")
    files = ["--src", "s.de", "--ref", "s.en", "--beam", "1", "--json", "--output", "hyps.txt"]
    scored = closed_2("eval", "--run", str(tiny_run), *files)
    assert scored.returncode == 0 and json.loads(scored.stdout)["bleu"] >= 0
    assert (tmp_path / "hyps.txt").read_bytes() == want
    usage = closed_2("translate", "--beam", "x")  # argparse's usage error: its own exit code
    assert usage.returncode == 2 and usage.stdout == b""
    helped = subprocess.run(  # --help with standard output closed: no traceback, exit 0
        [sys.executable, "-m", "mtx", "--help"], capture_output=True, env=_child_env(), timeout=600,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert helped.returncode == 0 and b"Traceback" not in helped.stderr and b"usage: mtx" in helped.stderr


def test_translate_errors_on_a_finished_run(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_one_line_error(
        mtx_here(monkeypatch, "translate", "--run", str(tiny_run), stdin=b"ok\n\xff\n"), "line 2 is not valid UTF-8"
    )
    # the lines before a bad one are translated and written, then the error
    r = mtx_here(
        monkeypatch, "translate", "--run", str(tiny_run), "--buffer-lines", "1", stdin=b"Ein Mann.\nEin Hund.\n\xff\n"
    )
    assert_one_line_error(r, "standard input: line 3 is not valid UTF-8")
    assert len(r.stdout.decode().splitlines()) == 2
    no_buffer = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--buffer-lines", "0", stdin=b"x\n")
    assert_one_line_error(no_buffer, "--buffer-lines must be >= 1, got 0")
    assert_one_line_error(
        mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "2", "--nbest", "3", "x"), "--nbest"
    )
    assert_one_line_error(mtx_here(monkeypatch, "eval", "--run", str(tiny_run), "--split", "nosuch"), "nosuch")
    bad_device = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), "--device", "nosuch")
    assert_one_line_error(bad_device, "--device: unknown device 'nosuch'")


def test_translates_arguments_as_standard_input_is_read_and_says_what_it_guesses(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop 64: a TEXT with CR-only line breaks was one sentence (refused on standard input), a
    TEXT naming a file was translated without a word, `- -` was "mixed with TEXT arguments",
    `eval --src -` "not found", and a run without best.pt decoded last.pt silently."""
    translate = ["translate", "--run", str(tiny_run)]
    cr = mtx_here(monkeypatch, *translate, "Ein Mann.", "Ein Hund.\rEine Katze.")
    assert_one_line_error(cr, "TEXT argument 2: line 1 holds a carriage return")
    named = tmp_path / "notes.de"
    named.write_text("Ein Mann.\n")
    r = mtx_here(monkeypatch, *translate, str(named))
    assert r.returncode == 0 and len(r.stdout.decode().splitlines()) == 1
    assert f"names a file, but is translated as text; to translate the file, give it on standard input (< {named})" in (
        r.stderr.decode()
    )
    # a sentence of over 255 bytes without a space is text, not a name too long (stop 66)
    unspaced = mtx_here(monkeypatch, *translate, "日本語の文章" * 20)
    assert unspaced.returncode == 0 and len(unspaced.stdout.decode().splitlines()) == 1, unspaced.stderr
    assert_one_line_error(
        mtx_here(monkeypatch, *translate, "-", "-"), "'-' (read standard input) cannot be given twice"
    )
    assert_one_line_error(mtx_here(monkeypatch, *translate, "--buffer-lines", "0", "x"), "--buffer-lines must be >= 1")
    src_dash = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), "--src", "-", "--ref", str(named))
    assert_one_line_error(src_dash, "--src takes a file; for standard input give --src /dev/stdin")
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "best.pt").unlink()
    r = mtx_here(monkeypatch, "translate", "--run", str(run), "Ein Mann.")
    assert r.returncode == 0
    assert re.search(
        r"no best.pt, though the run validated \(best val BLEU [\d.]+ at step \d+\): decoding with last.pt",
        (r.stderr.decode()),
    )


def test_outputs_never_replace_data_or_land_inside_another_run(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop 64: `average --out` wrote checkpoints over the run's val.en.gz, the plain twin of its
    train.en.gz and any text file; `train --run-dir RUN/checkpoints/step_80.pt` made a run there
    (RUN's training then failed at step 80 on every resume); `export --out -` made a directory "-";
    a WORLD_SIZE without torchrun's rendezvous variables was a traceback."""
    data = Path(load_run_config(tiny_run).data.dir)
    val = next(data.glob("val.*"))
    text = tmp_path / "notes.txt"
    text.write_text("keep me\n")
    average = ["average", "--run", str(tiny_run), "--last", "1", "--out"]
    for out, needle in (
        (val, "is a data file of the run's data directory"),
        (data / "train.en" if (data / "train.en.gz").exists() else data / "train.en.gz", "data file"),
        (text, "exists and is not a checkpoint"),
    ):
        before = out.read_bytes() if out.exists() else None
        assert_one_line_error(mtx_here(monkeypatch, *average, str(out)), f"--out {out}", needle)
        assert (out.read_bytes() if out.exists() else None) == before
    inside = tiny_run / "checkpoints" / "step_800.pt"
    r = mtx_here(monkeypatch, *tiny_args(data, inside))
    assert_one_line_error(r, f"--run-dir {inside} is one of the files of the run {tiny_run}")
    assert not inside.exists()
    under_a_file = mtx_here(monkeypatch, *tiny_args(data, text / "run"))
    assert_one_line_error(under_a_file, f"--run-dir {text / 'run'}: {text} is a file, not a directory")
    monkeypatch.chdir(tmp_path)
    dash = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", "-")
    assert_one_line_error(dash, "--out - (standard output) cannot take an exported model")
    assert not (tmp_path / "-").exists() and not (REPO / "-").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    r = mtx_here(monkeypatch, *tiny_args(data, tmp_path / "run2"))
    assert_one_line_error(r, "WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT not")


def test_a_non_blocking_standard_output_takes_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where standard output was non-blocking (O_NONBLOCK, which any process sharing the pipe may
    set), what the pipe could not take at once was dropped and mtx exited 0 (stop 64: 2,304 of
    3,000 translations)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with os.fdopen(read_end, "rb") as reader, open(write_end, "w", encoding="utf-8", closefd=False) as writer:
        monkeypatch.setattr(sys, "stdout", writer)
        utf8_stdout()
        got: list[bytes] = []
        thread = threading.Thread(target=lambda: (time.sleep(0.3), got.append(reader.read())))
        thread.start()  # a reader that comes late: the pipe's 64 KiB fill up first
        for i in range(20_000):
            sys.stdout.write(f"line {i}\n")
        sys.stdout.flush()
        os.close(write_end)
        thread.join(timeout=60)
    assert got and got[0].decode().splitlines() == [f"line {i}" for i in range(20_000)]


def test_eval_never_writes_over_a_file_it_reads_or_another_systems_hypotheses(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default hypotheses file names the checkpoints given, so a checkpoint compared through
    --paired with the run's own eval keeps both files (before, both were val.beam1.en: the
    other system's file was overwritten after it was read). A hypotheses file that is one of the
    command's inputs, or in a directory that cannot be written, is a one-line error before decoding."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    common = ["eval", "--run", str(run), "--split", "val", "--beam", "1", "--device", "cpu", "--json"]
    assert main(common) == 0
    own = run / "eval" / "val.beam1.en"
    first = own.read_bytes()
    assert main([*common, "--checkpoint", str(run / "checkpoints" / "step_100.pt"), "--paired", str(own)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["hypotheses"] == str(run / "eval" / "val.step_100.beam1.en") and len(result["paired"]) == 1
    assert own.read_bytes() == first

    def refused(args: list[str], message: str) -> None:
        # checked before the model loads (stop 71: after it)
        monkeypatch.setattr("mtx.checkpoint.load_run", lambda *a, **k: pytest.fail("loaded before the check"))
        monkeypatch.setattr("mtx.search.translate", lambda *a, **k: pytest.fail("decoded before the check"))
        assert main(args) == 1
        assert capsys.readouterr().err.strip() == f"mtx: error: {message}"
        monkeypatch.undo()

    refused(
        [*common, "--paired", str(own)],
        f"the hypotheses file {own} is the --paired file; pass --output with another path",
    )
    src, ref = tmp_path / "val.de", tmp_path / "val.en"
    src.write_text("Ein Hund.\n")
    ref.write_text("A dog.\n")
    plain = [c for c in common if c not in ("--split", "val")]
    refused(
        [*plain, "--src", str(src), "--ref", str(ref), "--output", str(ref)],
        f"the hypotheses file {ref} is the --ref file; pass --output with another path",
    )
    assert own.read_bytes() == first and ref.read_text() == "A dog.\n"
    # stop 53: with --split the split's files were not checked, nor the run's checkpoints, config
    # and tokenizer, so --output could replace any of them; average --out the run's config too
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.de").write_text("Ein Hund.\n")
    (data / "val.en").write_text("A dog.\n")
    for output, what in (
        (data / "val.en", "the val split's reference file"),
        (data / "val.de", "the val split's source file"),
        (run / "checkpoints" / "best.pt", "a checkpoint"),
        (run / "checkpoints" / "step_100.pt", "a checkpoint"),
        (run / "config.yaml", "one of the run's own files"),
        (run / "tokenizer.json", "one of the run's own files"),
    ):
        before = output.read_bytes()
        message = f"the hypotheses file {output} is {what}; pass --output with another path"
        refused([*common, "--data-dir", str(data), "--output", str(output)], message)
        assert output.read_bytes() == before
    outside = tmp_path / "outside.pt"  # a --checkpoint outside the run's checkpoints/
    shutil.copyfile(run / "checkpoints" / "step_100.pt", outside)
    message = f"the hypotheses file {outside} is a checkpoint; pass --output with another path"
    refused([*common, "--checkpoint", str(outside), "--output", str(outside)], message)
    assert outside.read_bytes() == (run / "checkpoints" / "step_100.pt").read_bytes()
    config = (run / "config.yaml").read_bytes()
    assert main(["average", "--run", str(run), "--last", "2", "--out", str(run / "config.yaml")]) == 1
    assert "is one of the run's own files" in capsys.readouterr().err
    assert (run / "config.yaml").read_bytes() == config
    # a device or a symbolic link is written through, not replaced by a regular file
    assert main([*common, "--output", os.devnull]) == 0 and not Path(os.devnull).is_file()
    (tmp_path / "target.en").write_text("")
    (tmp_path / "link.en").symlink_to(tmp_path / "target.en")
    assert main([*common, "--output", str(tmp_path / "link.en")]) == 0
    assert (tmp_path / "link.en").is_symlink() and (tmp_path / "target.en").read_bytes() == first
    capsys.readouterr()
    monkeypatch.setattr(os, "access", lambda *a: False)  # (a read-only directory; root may write any other)
    refused(
        [*common, "--output", str(tmp_path / "out" / "h.en")],
        f"the hypotheses file {tmp_path / 'out' / 'h.en'}: cannot write to {tmp_path / 'out'}; "
        "pass --output with a writable path",
    )


def test_verbose_adds_the_traceback_of_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README: `mtx -v` shows the traceback behind a one-line error (stop 53: only a path that could
    not be written had one; mtx's own errors printed the line alone)."""
    args = ["translate", "--run", str(tmp_path / "nowhere"), "x"]
    assert main(args) == 1
    plain = capsys.readouterr().err
    assert plain == f"mtx: error: {tmp_path / 'nowhere'}: run directory not found\n"
    assert main(["-v", *args]) == 1
    verbose = capsys.readouterr().err
    assert "Traceback (most recent call last)" in verbose and verbose.endswith(plain)


def test_eval_names_hypotheses_by_checkpoint_length_penalty_stop_and_precision(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml")

    def name(*argv: str) -> str:
        args = build_parser().parse_args(["eval", "--run", "r", *argv])
        return _hypotheses_name(args, "val", _decode_settings(args, replace(cfg.decode, beam=1)), cfg)

    assert name() == "val.beam1.en"
    # sources read as written, against the run's decode.normalize_spaces (stop 72)
    assert name("--keep-spaces") == "val.beam1.spaces.en"
    # and punctuation as written, against decode.normalize_punctuation (stop 73)
    assert name("--keep-punctuation", "--keep-spaces") == "val.beam1.spaces.punctuation.en"
    assert name("--beam", "5", "--length-penalty", "0.6") == "val.beam5.lp0.6.en"
    assert name("--beam", "5", "--stop", "finished", "--precision", "bf16") == "val.beam5.finished.bf16.en"
    assert name("--beam", "1", "--stop", "finished") == "val.beam1.en"  # greedy has no stop to name
    assert name("--checkpoint", "r/checkpoints/step_7.pt", "--checkpoint", "r/checkpoints/avg.pt") == (
        "val.step_7+avg.beam1.en"
    )
    # another run's checkpoint (or a file elsewhere) is named by its run (stop 52: another run's
    # best.pt and this run's shared val.best.beam1.en)
    # with a digest of the paths (stop 54: a/base's and b/base's best.pt shared a name, as did two
    # ensembles of long names)
    assert re.fullmatch(
        r"val\.other-best\.[0-9a-f]{8}\.beam1\.en", name("--checkpoint", "runs/other/checkpoints/best.pt")
    )
    assert re.fullmatch(r"val\.saved-avg\.[0-9a-f]{8}\.beam1\.en", name("--checkpoint", "saved/avg.pt"))
    assert name("--checkpoint", "a/base/checkpoints/best.pt") != name("--checkpoint", "b/base/checkpoints/best.pt")
    long = [["--checkpoint", f"r/checkpoints/{'x' * 60}{i}.pt"] for i in range(4)]
    assert re.fullmatch(r"val\.ensemble2\.[0-9a-f]{8}\.beam1\.en", name(*long[0], *long[1]))
    assert name(*long[0], *long[1]) != name(*long[2], *long[3])
    # one checkpoint named like an ensemble (stop 62: an average saved as step_7+avg.pt replaced the
    # ensemble's hypotheses)
    assert re.fullmatch(
        r"val\.step_7\+avg\.[0-9a-f]{8}\.beam1\.en", name("--checkpoint", "r/checkpoints/step_7+avg.pt")
    )
    # another length penalty than the run's is named (stop 52: it replaced the run's own file)
    assert name("--beam", "5", "--length-penalty", "2") == "val.beam5.lp2.en"
    assert name("--beam", "5", "--length-penalty", "0.6", "--stop", "finished") == "val.beam5.lp0.6.finished.en"
    assert name("--beam", "5", "--length-penalty", str(cfg.decode.length_penalty)) == "val.beam5.en"
    assert name("--beam", "1", "--length-penalty", "2") == "val.beam1.en"  # greedy has no penalty
    # penalties that 6 significant digits cannot tell apart are named apart (both were lp0.6, one
    # system's hypotheses replacing the other's), and -0 is 0
    assert name("--beam", "5", "--length-penalty", "0.6000001") == "val.beam5.lp0.6000001.en"
    assert name("--beam", "5", "--length-penalty", "1.0000001") == "val.beam5.lp1.0000001.en"
    assert name("--beam", "5", "--length-penalty", "-0") == name("--beam", "5", "--length-penalty", "0")
    assert name("--beam", "5", "--length-penalty", "0") == "val.beam5.lp0.en"

    # a --src file is named with a digest of its path (stop 53: d1/val.de and d2/val.de shared a file)
    def source(path: str) -> str:
        return _source_tag(build_parser().parse_args(["eval", "--run", "r", "--src", path, "--ref", "x.en"]), "val.de")

    assert re.fullmatch(r"val\.de\.[0-9a-f]{8}", source("d1/val.de"))
    assert source("d1/val.de") == source("d1/../d1/val.de") != source("d2/val.de")
    assert _source_tag(build_parser().parse_args(["eval", "--run", "r"]), "val", "data") == "val"
    # so is the split of a --data-dir other than the run's (it replaced the run's own val file)
    other = build_parser().parse_args(["eval", "--run", "r", "--data-dir", "d2"])
    own = build_parser().parse_args(["eval", "--run", "r", "--data-dir", "data/../data"])
    assert re.fullmatch(r"val\.[0-9a-f]{8}", _source_tag(other, "val", "data"))
    assert _source_tag(own, "val", "data") == "val"

    # a long --src name is cut, the digest keeping it apart (stop 61: with the tags added, a legal
    # 248-character name became a file name too long to write); a character is never cut in two
    def named(path: str) -> str:
        args = build_parser().parse_args(["eval", "--run", "r", "--src", path, "--ref", "x.en"])
        return _source_tag(args, Path(path).name)  # as cmd_eval names a --src file

    long = named("s" * 245 + ".de")
    assert re.fullmatch(r"s{100}\.[0-9a-f]{8}", long) and long != named("x/" + "s" * 245 + ".de")
    assert named("ä" * 120)[:-9] == "ä" * 50

    # a run whose data.dir is now a loop of symbolic links is named, not a traceback (stop 70's probe:
    # Path.resolve raised RuntimeError there, after the model loaded)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert re.fullmatch(r"val\.[0-9a-f]{8}", _source_tag(other, "val", str(loop)))


def test_eval_and_translate_in_bf16(tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--precision bf16 decodes with the weights cast to bf16 and says so; a bad value is refused."""
    r = mtx_here(
        monkeypatch, "eval", "--run", str(tiny_run), "--precision", "bf16", "--json", "--output", str(tmp_path / "h.en")
    )
    assert r.returncode == 0, r.stderr.decode()
    result = json.loads(r.stdout)
    assert result["precision"] == "bf16" and result["sentences"] == 100 and result["bleu"] >= 0.0
    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--precision", "bf16", "--beam", "2", "Ein Mann.")
    assert r.returncode == 0 and len(r.stdout.decode().splitlines()) == 1
    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--precision", "fp16", "x")
    assert r.returncode == 2 and "--precision" in r.stderr.decode()


def test_eval_decodes_an_ensemble_of_checkpoints(
    tiny_run: Path, tiny_restricted_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two --checkpoint flags decode as one ensemble; a member trained otherwise is a one-line error."""
    ckpts = tiny_run / "checkpoints"
    out = tmp_path / "hyps.en"
    both = ["--checkpoint", str(ckpts / "last.pt"), "--checkpoint", str(ckpts / "ema.pt")]
    r = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), *both, "--output", str(out))
    assert r.returncode == 0, r.stderr.decode()
    assert f"{ckpts / 'last.pt'}, {ckpts / 'ema.pt'}" in r.stdout.decode().splitlines()[0]
    assert len(out.read_text().splitlines()) == 100  # the small slice's test_2016_flickr
    other = ["--checkpoint", str(tiny_restricted_run / "checkpoints" / "last.pt")]
    assert_one_line_error(mtx_here(monkeypatch, "eval", "--run", str(tiny_run), *both[:2], *other), "restrict_output")
    # the same vocabulary trained the other way round (a joint vocabulary loads either direction)
    reverse = torch.load(ckpts / "last.pt", weights_only=True)
    data = reverse["config"]["data"]
    data["src_lang"], data["tgt_lang"] = data["tgt_lang"], data["src_lang"]
    torch.save(reverse, tmp_path / "reverse.pt")
    for extra in ([], both[:2]):
        r = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), *extra, "--checkpoint", str(tmp_path / "reverse.pt"))
        assert_one_line_error(r, "the checkpoint translates en->de, the run de->en")


def test_eval_scores_an_official_test_split_beyond_the_local_copy(
    tiny_run: Path, multi30k_server: FakeMulti30k, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--split test_2017_flickr` on a run whose data directory lacks it: fetched into the cache, scored."""
    assert main(["eval", "--run", str(tiny_run), "--split", "test_2017_flickr", "--beam", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "test_2017_flickr" and result["sentences"] == 200  # the fake's copy of val
    assert len((tiny_run / "eval" / "test_2017_flickr.beam1.en").read_text().splitlines()) == 200
    assert multi30k_server.requested == ["test_2017_flickr.de.gz", "test_2017_flickr.en.gz"]
    assert main(["eval", "--run", str(tiny_run), "--split", "test_2017_mscoco", "--beam", "1"]) == 1
    assert "cannot download Multi30k" in capsys.readouterr().err  # the fake has no test_2017_mscoco


def test_eval_refuses_an_empty_split_and_a_write_protected_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --split "" evaluated the default test_2016_flickr without a word
    for split in ("", " "):
        result = mtx_here(monkeypatch, "eval", "--run", str(tmp_path / "no-run"), "--split", split)
        assert_one_line_error(result, f"--split takes a split name such as val or test_2016_flickr, got {split!r}")
    # a write-protected file was replaced (through a new file and a rename) and left writable
    kept = tmp_path / "kept.en"
    kept.write_text("my translations\n")
    kept.chmod(0o444)
    with pytest.raises(MtxError, match=r"kept.en is write-protected .*; pass --output with another path$"):
        check_output(kept, {})
    assert kept.read_text() == "my translations\n"
    kept.chmod(0o644)
    check_output(kept, {})  # writable: replaced as before


def test_eval_scores_blank_segments_and_refuses_empty_paths(
    tiny_run: Path, tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test set's blank segment was refused ("remove empty lines"), and removing it made the
    hypotheses one line short of other systems' for --paired; a path option given "" was "." (eval
    --data-dir "" scored the working directory's files) (stop 62)."""
    src = (small_data / "val.de").read_text(encoding="utf-8").splitlines()[:4]
    ref = (small_data / "val.en").read_text(encoding="utf-8").splitlines()[:4]
    src[1] = ref[1] = ""
    (tmp_path / "s.de").write_text("\n".join(src) + "\n", encoding="utf-8")
    (tmp_path / "r.en").write_text("\n".join(ref) + "\n", encoding="utf-8")
    out = tmp_path / "h.en"
    args = ["eval", "--run", str(tiny_run), "--src", str(tmp_path / "s.de"), "--ref", str(tmp_path / "r.en")]
    r = mtx_here(monkeypatch, *args, "--beam", "1", "--output", str(out))
    assert r.returncode == 0, r.stderr.decode()
    hyps = out.read_text(encoding="utf-8").split("\n")
    assert len(hyps) == 5 and hyps[1] == "" and all(hyps[i] for i in (0, 2, 3))
    for option in ("--data-dir", "--checkpoint", "--output"):
        bad = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), option, "")
        assert bad.returncode == 2 and f"argument {option}: a path must not be empty".encode() in bad.stderr
    assert_one_line_error(
        mtx_here(monkeypatch, "eval", "--run", str(tiny_run), "--data-dir", str(tmp_path / "s.de")),
        "s.de: not a data directory (a file); pass --data-dir DIR",
    )


def test_outputs_through_links_and_in_checkpoints_are_checked_before_the_work(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 61: a link to a write-protected file was written through (as root), a link into a
    missing directory and an output under a link to nothing failed only after decoding or with
    the system's "File exists", and a new file in a run's checkpoints/ was written once and then
    refused as a checkpoint."""
    kept = tmp_path / "kept.en"
    kept.write_text("mine\n")
    kept.chmod(0o444)
    (tmp_path / "to_kept.en").symlink_to(kept)
    with pytest.raises(MtxError, match=r"to_kept.en is write-protected .*; pass --output with another path$"):
        check_output(tmp_path / "to_kept.en", {})
    (tmp_path / "dangling.en").symlink_to(tmp_path / "gone" / "dir" / "h.en")
    with pytest.raises(
        MtxError, match=r"dangling.en: a symbolic link to .*gone/dir/h.en, whose directory does not exist"
    ):
        check_output(tmp_path / "dangling.en", {})
    (tmp_path / "dd").symlink_to(tmp_path / "nowhere")
    with pytest.raises(MtxError, match=r"dd/h.en: .*dd: a symbolic link to .*nowhere, which does not exist$"):
        check_output(tmp_path / "dd" / "h.en", {})
    (tmp_path / "new.en").symlink_to(tmp_path / "new_target.en")  # a link to a file to be made: written through
    check_output(tmp_path / "new.en", {})
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    with pytest.raises(MtxError, match=r"is one of the files of the run"):
        check_output(run / "checkpoints" / "hyp.en", {})
    # average and plot: the same checks on --out, nothing written
    for argv in (["average", "--run", str(run), "--last", "2"], ["plot", "--run", str(run)]):
        r = mtx_here(monkeypatch, *argv, "--out", str(kept))
        assert_one_line_error(r, f"--out {kept} is write-protected (no write permission); pass --out with another path")
        r = mtx_here(monkeypatch, *argv, "--out", str(tmp_path / "dd" / "x"))
        assert_one_line_error(r, f"{tmp_path / 'dd'}: a symbolic link to {tmp_path / 'nowhere'}, which does not exist")
    assert kept.read_text() == "mine\n" and not (tmp_path / "nowhere").exists()
    r = mtx_here(monkeypatch, "average", "--run", str(run), "--last", "2", "--out", "-")
    assert_one_line_error(r, "--out - (standard output) cannot take an average")
    assert not (REPO / "-").exists()


def test_an_output_through_a_link_to_a_file_is_replaced_whole_or_not_at_all(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written through the link, a full disk cut the file it named short (3,000 lines to 731, a
    PNG to 10 KB) where the file's own path kept it (stop 66)."""
    old = "".join(f"{i}\n" for i in range(3000))
    for argv, name in (
        (["eval", "--run", str(tiny_run), "--split", "val", "--beam", "1", "--output"], "hyps.en"),
        (["plot", "--run", str(tiny_run), "--out"], "curves.png"),
    ):
        target, link = tmp_path / name, tmp_path / f"link_{name}"
        target.write_text(old)
        link.symlink_to(target)
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
            r = mtx_here(m, *argv, str(link))
        assert_one_line_error(r, "No space left on device); the previous file is unchanged")
        assert target.read_text() == old and link.is_symlink()
        assert mtx_here(monkeypatch, *argv, str(link)).returncode == 0
        assert link.is_symlink() and target.read_bytes() != old.encode()


def test_a_command_stopped_by_sigterm_or_sighup_cleans_up_and_says_so(
    tiny_run: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 61: SIGTERM or SIGHUP during eval ended it without a word, leaving the directories it
    had made for its output (Ctrl-C removed them)."""
    import mtx.search

    for sig in (signal.SIGTERM, signal.SIGHUP):

        def killed(*args: object, _sig: int = sig, **kwargs: object) -> None:
            os.kill(os.getpid(), _sig)  # handled in this (the main) thread before kill returns
            raise AssertionError("the signal did not stop the command")

        monkeypatch.setattr(mtx.search, "translate", killed)
        out = tmp_path / "made" / "sub" / "h.en"
        src, ref = small_data / "val.de", small_data / "val.en"
        r = mtx_here(
            monkeypatch, "eval", "--run", str(tiny_run), "--src", str(src), "--ref", str(ref), "--output", str(out)
        )
        assert r.returncode == 128 + sig, r.stderr.decode()
        assert r.stderr.decode().splitlines()[-1] == f"mtx: stopped by {sig.name}"
        assert not (tmp_path / "made").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


def test_translate_refuses_standard_input_and_output_as_one_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 61: `mtx translate < f >> f` read its own translations back, without end."""
    f = tmp_path / "both.txt"
    f.write_text("Ein Hund.\n")
    with f.open("r", encoding="utf-8") as stdin, f.open("a", encoding="utf-8") as stdout:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(["translate", "--run", str(tmp_path / "no-run")]) == 1
    assert f.read_text() == "Ein Hund.\n"
    with f.open("r", encoding="utf-8") as stdin, (tmp_path / "other.txt").open("w") as stdout:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.setattr(sys, "stdout", stdout)
        assert not stdin_is_stdout()


def test_an_option_given_twice_and_a_tilde_in_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stop 61: `eval --run a --run b` scored b alone without a word (argparse keeps the last); `~`
    after `--run-dir=`, which the shell leaves, made a directory named `~`."""
    for argv in (["eval", "--run", "a", "--run", "b"], ["average", "--run", "a", "--last", "1", "--last", "2"]):
        r = mtx_here(monkeypatch, *argv)
        assert r.returncode == 2 and r.stderr.decode().splitlines() == [
            f"mtx: error: argument {argv[-2]}: given twice; give it once (see mtx {argv[0]} --help)"
        ]
    assert build_parser().parse_args(["plot", "--run", "a", "--run", "b"]).run == [Path("a"), Path("b")]  # repeatable
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["train", "--run-dir=~/runs/x", "--config", "~/c.yaml"])
    assert (args.run_dir, args.config) == (tmp_path / "runs" / "x", tmp_path / "c.yaml")
    assert build_parser().parse_args(["plot", "--run=~/r", "--out=~/p.png"]).out == tmp_path / "p.png"
    r = mtx_here(monkeypatch, "translate", "--run=~nosuchuser61/r", "hi")
    assert r.returncode == 2 and "cannot expand ~nosuchuser61 in '~nosuchuser61/r' (no such user)" in r.stderr.decode()
    (tmp_path / "c.yaml").touch()
    r = mtx_here(monkeypatch, "translate", "--run", str(tmp_path / "c.yaml"), "hi")
    assert_one_line_error(r, f"{tmp_path / 'c.yaml'}: not a run directory (a file)")


def test_eval_output_never_replaces_the_training_data(tmp_path: Path) -> None:
    # a hypotheses file replaced train.en of the data directory (only the split read was protected)
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    for name in ("train.en", "val.de.gz", "test_x.en"):
        (tmp_path / name).write_text("data\n")
    folders = [tmp_path, None, tmp_path / "none"]
    data = {
        "the run's training or validation data": training_data(cfg, folders),
        "a data file of the data directory": data_files(folders),
    }
    # val.de: the plain twin of val.de.gz, which mtx would read before it (stop 63: written, and
    # every later eval scored against the hypotheses)
    for name in ("train.en", "val.de.gz", "val.de"):
        with pytest.raises(MtxError, match=rf"{name} is the run's training or validation data; pass --output"):
            check_output(tmp_path / name, data)
    # another split's file, or its twin (stop 63: eval --split val wrote over test_2016_flickr.de.gz)
    for name in ("test_x.en", "test_x.en.gz"):
        with pytest.raises(MtxError, match=rf"{name} is a data file of the data directory; pass --output"):
            check_output(tmp_path / name, data)
    assert all((tmp_path / name).read_text() == "data\n" for name in ("train.en", "val.de.gz", "test_x.en"))
    for name in ("test_x.beam5.en", "hyp.en", "notes"):  # names of no file there, or of no data file
        check_output(tmp_path / name, data)


def test_training_on_a_test_split_and_scoring_the_training_split_are_warned(
    tiny_run: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 61: training warned of validating on a test split but not of training on one, and eval
    scored the run's own training data without a word."""
    import mtx.search

    r = mtx_here(
        monkeypatch,
        *tiny_args(small_data, tmp_path / "run", "--set", "data.train_split=test_2016_flickr"),
        *("--set", "train.max_steps=1", "--set", "train.eval_sentences=2", "--set", "tokenizer.vocab_size=300"),
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "data.train_split is a test split ('test_2016_flickr')" in r.stderr.decode()
    monkeypatch.setattr(
        mtx.search, "translate", lambda model, tok, ids, *a, **k: ["a"] * len(ids)
    )  # scored, not decoded
    for how in (["--split", "train"], ["--src", str(small_data / "train.de"), "--ref", str(small_data / "train.en")]):
        r = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), *how, "--output", str(tmp_path / "h.en"))
        assert r.returncode == 0, r.stderr.decode()
        assert "is what the run was trained on (data.train_split 'train')" in r.stderr.decode()
    r = mtx_here(monkeypatch, "eval", "--run", str(tiny_run), "--split", "val", "--output", str(tmp_path / "h.en"))
    assert r.returncode == 0 and "trained on" not in r.stderr.decode() and "valid_split" not in r.stderr.decode()
    # a test split the run validated on: its checkpoints were chosen on it (stop 63: not warned)
    (tmp_path / "run" / "config.yaml").write_text(
        (tmp_path / "run" / "config.yaml").read_text().replace("valid_split: val", "valid_split: test_2016_flickr")
    )
    test_files = ["--src", str(small_data / "test_2016_flickr.de"), "--ref", str(small_data / "test_2016_flickr.en")]
    for how in (["--split", "test_2016_flickr"], test_files):
        r = mtx_here(monkeypatch, "eval", "--run", str(tmp_path / "run"), *how, "--output", str(tmp_path / "h.en"))
        assert r.returncode == 0, r.stderr.decode()
        assert "is the run's data.valid_split ('test_2016_flickr')" in r.stderr.decode()
        assert "not a fair test" in r.stderr.decode()


def test_score_text_keeps_four_significant_digits_near_zero() -> None:
    assert [score_text(x) for x in (0.0, -12.34567, -1.0, -0.123456, -3.21e-7, -0.5, -6.6e-5)] == [
        "0.0000",
        "-12.3457",
        "-1.0000",
        "-0.1235",
        "-3.210e-07",
        "-0.5000",  # trailing zeros kept: 4 digits in every row (stop 63: -0.5, -6.6e-05)
        "-6.600e-05",
    ]


def test_nbest_lists_that_repeat_a_text_are_warned(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fewer different texts than --nbest exist (a short length cap, a small output
    vocabulary), the lists repeat a text: said in one warning, counting the non-empty inputs
    (stop 62; before, without a word)."""
    import mtx.search
    from mtx.search import Hypothesis

    def two_segmentations(model, src_ids, *args, nbest: int = 1, **kwargs):  # noqa: ANN001, ANN202
        return [[Hypothesis([5], -1.0, -1.0), Hypothesis([5], -2.0, -2.0)] if ids else [] for ids in src_ids]

    monkeypatch.setattr(mtx.search, "translate_ids", two_segmentations)
    r = mtx_here(
        monkeypatch, "translate", "--run", str(tiny_run), "--beam", "2", "--nbest", "2", stdin=b"Ein Hund.\n\n"
    )
    err = r.stderr.decode()
    assert r.returncode == 0 and len(r.stdout.decode().splitlines()) == 2, err
    assert "1 input(s) have fewer than --nbest 2 different translations" in err


def test_checkpoint_paths_that_name_no_file_say_what_they_name(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run-relative --checkpoint and a FIFO or device were "not found" (stop 62)."""
    name = sorted((tiny_run / "checkpoints").glob("step_*.pt"))[-1].name
    for given in (name, f"checkpoints/{name}"):
        r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--checkpoint", given, "x")
        meant = tiny_run / "checkpoints" / name
        assert_one_line_error(r, f"{given}: checkpoint not found (paths are from the working directory: {meant}?)")
    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--checkpoint", "/dev/null", "x")
    assert_one_line_error(r, "/dev/null: not a regular file")


def test_commands_to_paste_start_mtx_as_it_was_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make train` runs .venv/bin/mtx: its resume line said `mtx ...`, which a shell without the
    venv does not find (stop 62)."""
    from mtx.errors import own_command

    script = tmp_path / "bin" / "mtx"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert own_command(str(script)) == [str(script)]
    monkeypatch.setenv("PATH", str(script.parent))
    assert own_command(str(script)) == ["mtx"]
    assert own_command(str(REPO / "mtx" / "__main__.py")) == [sys.executable, "-m", "mtx"]
    assert own_command("/usr/bin/pytest") == ["mtx"]
    # a script's printed command: this environment's mtx (stop 63: choose_on_val.py said `mtx`)
    from mtx.errors import environment_mtx

    monkeypatch.setenv("PATH", "/nonexistent")
    beside = Path(sys.executable).parent / "mtx"
    assert environment_mtx() == ([str(beside)] if os.access(beside, os.X_OK) else [sys.executable, "-m", "mtx"])
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert environment_mtx() == (["mtx"] if beside.exists() else [sys.executable, "-m", "mtx"])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_train_continues_a_run_that_has_a_checkpoint(tiny_run: Path, tmp_path: Path) -> None:
    """An interrupted `make train` could not be continued by make: `make train` refused the run
    directory, and `ARGS=--resume` came with --config (stop 62)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    bin_dir = Path(sys.executable).parent  # this environment's mtx; -o: its install taken as done
    argv = ["make", "-s", "-o", ".venv/.mtx-installed", "train", f"BIN={bin_dir}", f"RUN_DIR={run}"]
    r = subprocess.run([*argv, "ARGS=--set train.max_steps=201"], cwd=REPO, capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert f"make train: {run} holds a run: continuing it" in r.stdout.decode()
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == 201


def test_a_text_argument_holding_line_breaks_is_its_lines(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mtx translate "$(cat f)"` was one sentence, its line breaks pieces of it (stop 62)."""
    r = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", "Ein Hund.\nEine Frau.\r\n", "Zwei.")
    piped = mtx_here(
        monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", stdin=b"Ein Hund.\nEine Frau.\nZwei.\n"
    )
    assert r.returncode == 0 and r.stdout == piped.stdout and len(r.stdout.decode().splitlines()) == 3


def test_translate_and_eval_refuse_their_input_before_importing_torch(tmp_path: Path) -> None:
    """A mistake in an option, the run's config, a TEXT argument, eval's data or a --paired file ends
    the command before torch is imported (2-3 s alone; over 10 s on a busy machine): TEXT arguments,
    eval's data and --paired files, and export's options, were checked after it (stop 70: torch now
    comes with the model)."""
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run.mkdir()
    (data / "val.de").write_text("Ein Hund.\nZwei Hunde.\n")
    (data / "val.en").write_text("A dog.\nTwo dogs.\n")
    (run / "config.yaml").write_text(config_text(load_config(TINY_CONFIG, [f"data.dir={data}"])))
    (tmp_path / "one.en").write_text("a\n")
    cases = {
        "--beam must be from 1": ["translate", "--beam", "0", "x"],
        "TEXT argument 1: line 1 holds a carriage return": ["translate", "a\rb"],
        "--split takes a split name": ["eval", "--split", "../x"],
        "no nosuch.de or nosuch.de.gz": ["eval", "--split", "nosuch"],
        "nodir: data directory not found": ["eval", "--data-dir", str(tmp_path / "nodir")],
        "one.en: 1 line for the 2 sentences of val": ["eval", "--split", "val", "--paired", str(tmp_path / "one.en")],
        "export takes one --checkpoint": ["export", "--checkpoint", "a.pt", "--checkpoint", "b.pt"],
        "--out - (standard output) cannot take an exported model": ["export", "--out", "-"],
    }
    argvs = [[argv[0], "--run", str(run), *argv[1:]] for argv in cases.values()]
    program = f"import sys\nfrom mtx.cli import main\nfor argv in {argvs!r}: assert main(argv) == 1\n"
    program += "print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path, env=_child_env())
    assert r.returncode == 0, r.stderr
    errors = r.stderr.splitlines()
    assert len(errors) == len(cases) and all(e.startswith("mtx: error: ") for e in errors), r.stderr
    for needle, error in zip(cases, errors, strict=True):
        assert needle in error, error
    assert r.stdout == "False\n"  # torch not imported


def test_a_paired_file_that_is_a_loop_of_links_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """eval resolves --paired files to find one given twice: a loop of symbolic links ended it in a
    RuntimeError's traceback (stop 70)."""
    (tmp_path / "loop").symlink_to("loop")
    r = mtx_here(monkeypatch, "eval", "--run", str(tmp_path / "run"), "--paired", str(tmp_path / "loop"))
    if sys.version_info < (3, 13):
        assert_one_line_error(r, f"--paired {tmp_path / 'loop'}: a loop of symbolic links; pass --paired with another")
    else:  # Python 3.13's Path.resolve leaves a loop as it is: the next mistake is the one named
        assert_one_line_error(r, "run directory not found")


def test_torchs_info_lines_are_held_back_before_torch_has_set_its_loggers() -> None:
    """A signal in the middle of torch's import left its loggers unset: at exit, torch's FakeTensor
    statistics (log.info in an atexit hook) printed three lines after mtx's one (stop 63)."""
    code = (
        "import logging, sys\n"
        "from mtx.cli import _setup_logging\n"
        "assert 'torch' not in sys.modules\n"
        "_setup_logging(False)\n"
        "logging.getLogger('torch._subclasses.fake_tensor').info('FakeTensor cache stats:')\n"
        "logging.getLogger('mtx').info('mtx line')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=REPO, check=False)
    assert r.returncode == 0 and r.stderr.decode().splitlines() == ["mtx line"], r.stderr.decode()


def test_a_removed_working_directory_is_one_line(tmp_path: Path) -> None:
    """A shell left in a directory that `rm -rf` removed: torch's import failed with "Intel oneMKL
    FATAL ERROR: Cannot load libtorch_cpu.so", which reads as a broken install (stop 67)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); sys.argv[1:] = ['--help']; import mtx"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=_child_env())
    assert r.returncode == 1 and r.stderr.decode().strip() == (
        "mtx: error: the working directory no longer exists (it was removed); cd to one that does"
    ), r.stderr.decode()
    # a program that had torch before its directory went goes on: the import ended it (stop 68's probe)
    gone.mkdir()
    code = code.replace("import os", "import torch, os").replace("import mtx", "import mtx.cli; print('imported')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=_child_env())
    assert r.returncode == 0 and r.stdout == b"imported\n", r.stderr.decode()


def test_commands_run_with_a_larger_onednn_kernel_cache_unless_the_environment_sets_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """oneDNN's default 1,024 kernels slowed bf16 training as a run went on (stop 72: 1.29x
    slower in six alternating runs): each command runs with 8,192 where the environment leaves it
    unset, which its child processes (torchrun's ranks) inherit, and leaves the caller's
    environment as it was; a size the user sets is kept."""
    import mtx.cli as cli

    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    seen: list[str | None] = []

    def command(argv: list[str] | None) -> int:
        seen.append(os.environ.get(name))
        return 0

    monkeypatch.setattr(cli, "_main", command)
    monkeypatch.delenv(name, raising=False)
    assert main(["translate"]) == 0 and seen == ["8192"] and name not in os.environ
    monkeypatch.setenv(name, "2048")
    assert main(["translate"]) == 0 and seen == ["8192", "2048"] and os.environ[name] == "2048"


def test_main_leaves_the_calling_programs_logging_as_it_was(tiny_run: Path, tmp_path: Path) -> None:
    """`main` replaced the root logger's handlers and raised its level for good: a program that
    runs it lost its own log file's lines, and other libraries' were muted; the run's train.log
    took the lines other threads of the program logged (stop 68's probe)."""
    from mtx.runlog import RunLog

    root = logging.getLogger()
    mine = logging.FileHandler(tmp_path / "app.log")
    handlers, level = [*root.handlers, mine], root.level
    root.addHandler(mine)
    try:
        root.setLevel(logging.DEBUG)
        threads = torch.get_num_threads()
        stdout = (sys.stdout, sys.stdout.encoding, sys.stdout.errors)
        assert stdout[2] != "surrogateescape"  # what `main` sets for itself
        other = 1 if threads > 1 else 2
        if other > usable_cpus():
            other = threads
        assert main(["translate", "--run", str(tiny_run), "--beam", "1", "--threads", str(other), "Ein Hund."]) == 0
        assert root.handlers == handlers and root.level == logging.DEBUG and torch.get_num_threads() == threads
        assert (sys.stdout, sys.stdout.encoding, sys.stdout.errors) == stdout
        assert logging.getLogger("sacrebleu").level == logging.NOTSET
        logging.getLogger("app").info("after mtx")
    finally:
        root.removeHandler(mine)
        mine.close()
        root.setLevel(level)
    assert (tmp_path / "app.log").read_text().splitlines()[-1] == "after mtx"
    run_log = RunLog(tmp_path / "train.log")
    lines = [("app", "the training thread's"), ("mtx.train", "mtx's, from a worker"), ("app", "another thread's")]

    def emit(name: str, message: str) -> None:
        run_log.handle(logging.makeLogRecord({"name": name, "msg": message, "levelno": logging.INFO}))

    emit(*lines[0])
    for line in lines[1:]:
        other = threading.Thread(target=emit, args=line)
        other.start()
        other.join()
    run_log.close()
    assert (tmp_path / "train.log").read_text().splitlines() == [lines[0][1], lines[1][1]]


def test_the_readmes_python_example_translates_as_the_command_does(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's "From Python" code, run as written on a run, gives `mtx translate`'s output, a
    byte order mark and direction marks at a line's ends read as the command reads them (stop
    68's probe: the library's route kept them, 12 BLEU lost on val), and whitespace inside a line
    too (stop 72)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    code = readme.split("**From Python.**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'Path("runs/tiny")' in code
    sentences = ["Ein Mann f\u00e4hrt Fahrrad.", "Zwei Hunde spielen im Schnee."]
    marked = ["\ufeff" + sentences[0].replace(" ", "\u00a0 ") + " \t", "\u200e" + sentences[1] + "\u200f"]
    code = code.replace('Path("runs/tiny")', f"Path({str(tiny_run)!r})").replace(
        json.dumps(sentences, ensure_ascii=False), repr(marked)
    )
    assert repr(marked) in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    got = ast.literal_eval(printed.getvalue())
    cfg = load_run_config(tiny_run)
    beam = str(cfg.decode.beam)
    want = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", beam, *sentences).stdout.decode()
    assert got == want.splitlines() and len(got) == 2


def test_text_only_standard_streams_as_a_notebook_has_them(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A program running `main` with a standard input or output of text alone (`io.StringIO`,
    Jupyter's): translate from standard input and `plot --out -` ended in an AttributeError
    (stop 68's probe)."""
    lines = "Ein Hund.\nEine Frau.\n"
    want = mtx("translate", "--run", str(tiny_run), "--beam", "1", stdin=lines.encode()).stdout.decode()
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert main(["translate", "--run", str(tiny_run), "--beam", "1"]) == 0
    assert capsys.readouterr().out == want and len(want.splitlines()) == 2
    monkeypatch.setattr(sys, "stdout", text := io.StringIO())
    assert main(["plot", "--run", str(tiny_run), "--out", "-"]) == 1
    assert "--out -: standard output takes text only here, not an image; give --out FILE" in capsys.readouterr().err
    assert text.getvalue() == ""


def test_python_m_mtx_cli_runs_the_command_line() -> None:
    """`python -m mtx.cli translate ...` did nothing and exited 0 (stop 68's probe)."""
    r = subprocess.run([sys.executable, "-m", "mtx.cli", "--version"], capture_output=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.decode().split() == ["mtx", __import__("mtx").__version__], r.stdout


def test_a_utf8_argument_under_an_ascii_locale_is_translated(tiny_run: Path) -> None:
    """Under `LC_ALL=C` with `PYTHONUTF8=0` Python decodes arguments as ASCII, so a UTF-8 TEXT
    arrived as lone surrogates and was refused as "not valid UTF-8" (stop 67); it is read from
    its bytes, as standard input is."""
    text = "Ein Mann f\u00e4hrt Fahrrad."
    ascii_env = {**_child_env(), "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    args = [sys.executable, "-m", "mtx", "translate", "--run", str(tiny_run), "--beam", "1"]
    under_c = subprocess.run([*args, text], capture_output=True, timeout=300, env=ascii_env)
    plain = subprocess.run(args, input=f"{text}\n".encode(), capture_output=True, timeout=300, env=_child_env())
    assert under_c.returncode == 0 and under_c.stdout == plain.stdout, under_c.stderr.decode()


def test_decoding_options_take_their_bounds_and_refuse_the_next_value(tmp_path: Path) -> None:
    """--beam, --length-penalty, --batch-tokens, --workers and --threads at the edges of what they
    take, checked before torch is imported (stop 70's mutants: a bound moved by one passed every test)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_text(Config()))

    def settings(*argv: str) -> tuple[int, float, int, int, str, bool, bool]:
        args = build_parser().parse_args(["translate", "--run", str(run), *argv, "x"])
        cfg, decoding = _settings(args)
        assert decoding == _decode_settings(args, cfg.decode)
        return decoding

    edges = ["--beam", "1000", "--length-penalty", "10", "--batch-tokens", "1", "--workers", "0"]
    assert settings(*edges, "--threads", str(usable_cpus())) == (1000, 10.0, 1, 0, "exact", True, True)
    assert settings("--length-penalty", "0", "--beam", "1", "--keep-spaces") == (
        1, 0.0, DecodeConfig().batch_tokens, 0, "exact", False, True
    )  # fmt: skip
    assert settings("--keep-punctuation")[-2:] == (True, False)
    # -0 is taken as 0 (stop 70's probe: eval's header and JSON said "-0" of a file named lp0)
    assert str(settings("--length-penalty", "-0", "--beam", "2")[1]) == "0.0"
    for argv, message in (
        (["--beam", "1001"], "--beam must be from 1 to 1,000, got 1001"),
        (["--beam", "0"], "--beam must be from 1 to 1,000, got 0"),
        (["--length-penalty", "10.001"], "--length-penalty must be a number from 0 to 10, got 10.001"),
        (["--length-penalty", "-0.5"], "--length-penalty must be a number from 0 to 10, got -0.5"),
        (["--batch-tokens", "0"], "--batch-tokens must be >= 1, got 0"),
        (["--workers", "-1"], "--workers must be >= 0 (0: auto), got -1"),
        (["--threads", str(usable_cpus() + 1)], f"--threads must be 0 (torch's choice) to {usable_cpus()}"),
    ):
        with pytest.raises(MtxError, match=re.escape(message)):
            settings(*argv)


def test_eval_shortens_checkpoint_tags_past_100_characters_only() -> None:
    """A tag of exactly 100 characters is kept as it is (stop 70's mutant: cut at 100)."""
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    for stem, expected in (("x" * 100, "val." + "x" * 100 + ".beam1.en"), ("x" * 101, None)):
        args = build_parser().parse_args(["eval", "--run", "r", "--checkpoint", f"r/checkpoints/{stem}.pt"])
        name = _hypotheses_name(args, "val", _decode_settings(args, replace(cfg.decode, beam=1)), cfg)
        if expected is None:
            assert re.fullmatch(r"val\.ensemble1\.[0-9a-f]{8}\.beam1\.en", name), name
        else:
            assert name == expected


def test_a_lone_dash_reads_standard_input(tiny_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TEXT `-` is standard input, as no TEXT is (stop 70's mutant: `-` translated as the text "-")."""
    lines = b"Ein Hund.\nZwei Katzen.\n"
    dash = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", "-", stdin=lines)
    plain = mtx_here(monkeypatch, "translate", "--run", str(tiny_run), "--beam", "1", stdin=lines)
    assert dash.returncode == 0 and len(dash.stdout.decode().splitlines()) == 2, dash.stderr.decode()
    assert dash.stdout == plain.stdout


def test_every_commands_help_is_ascii() -> None:
    """Help is written before mtx makes standard output UTF-8, and a character outside ASCII in
    it was a UnicodeEncodeError's traceback for `mtx translate --help` where standard output takes
    ASCII only (PYTHONIOENCODING=ascii; stop 73: the `’` of --keep-punctuation's help)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"train", "translate", "eval", "export"} <= set(commands)
    for name, command in commands.items():
        assert command.format_help().isascii(), name
    assert parser.format_help().isascii()


def test_score_prints_each_pairs_score_and_training_val_loss_as_its_perplexity(
    tiny_run: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mtx score` (forced decoding): a line per pair, the score `translate --nbest` would give that
    output (log-probability over the GNMT penalty); its log-probability per piece is the val loss
    training computes (no smoothing) for the same checkpoint and pairs."""
    import numpy as np

    from mtx.checkpoint import load_run
    from mtx.data import ParallelIds, plan_batches
    from mtx.loss import label_smoothed_loss
    from mtx.search import length_penalty
    from mtx.text import read_sources

    last = tiny_run / "checkpoints" / "last.pt"
    args = ["score", "--run", str(tiny_run), "--checkpoint", str(last), "--data-dir", str(small_data), "--split", "val"]
    lines, as_json = mtx_here(monkeypatch, *args), mtx_here(monkeypatch, *args, "--json", "--length-penalty", "0.5")
    assert lines.returncode == 0 and as_json.returncode == 0, lines.stderr.decode() + as_json.stderr.decode()
    result = json.loads(as_json.stdout)
    assert result["sentences"] == len(result["scores"]) == 200 and result["length_penalty"] == 0.5
    alpha = load_run_config(tiny_run).decode.length_penalty
    assert lines.stdout.decode().splitlines() == [
        score_text(lp / length_penalty(n, alpha)) for lp, n in zip(result["log_probs"], result["lengths"], strict=True)
    ]
    assert result["scores"] == pytest.approx(
        [lp / length_penalty(n, 0.5) for lp, n in zip(result["log_probs"], result["lengths"], strict=True)]
    )
    assert f"perplexity {result['perplexity']:.2f}" in lines.stderr.decode()

    run = load_run(tiny_run, [last])
    cfg = run.cfg
    src = read_sources(read_lines(small_data / "val.de"), cfg.decode.normalize_spaces, run.folds)
    ids = ParallelIds.encode(src, read_lines(small_data / "val.en"), run.src_tok, run.tgt_tok)
    rows, loss, pieces = np.arange(len(ids)), 0.0, 0
    with torch.no_grad():
        for batch in plan_batches(ids.src_lens, ids.tgt_lens, cfg.train.batch_tokens):
            b = ids.batch(rows[batch])
            loss, pieces = loss + label_smoothed_loss(run.model.eval(), b, 0.0).item(), pieces + b.n_tgt_tokens
    assert result["pieces"] == pieces == sum(result["lengths"])
    assert result["log_prob_per_piece"] == pytest.approx(-loss / pieces, abs=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(loss / pieces), rel=1e-5)


def test_score_refuses_what_it_cannot_score_in_one_line(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("Ein Hund.\nZwei Katzen.\n", encoding="utf-8")
    ref.write_text("A dog.\n", encoding="utf-8")
    run = ["score", "--run", str(tiny_run)]
    assert_one_line_error(mtx_here(monkeypatch, *run, "--src", str(src)), "--src and --ref go together")
    assert_one_line_error(mtx_here(monkeypatch, *run, "--src", str(src), "--ref", str(ref)), "has 2 lines", "has 1")
    ref.write_text("A dog.\n" + "dog " * 400 + "\n", encoding="utf-8")  # more pieces than the 160 positions
    assert_one_line_error(
        mtx_here(monkeypatch, *run, "--src", str(src), "--ref", str(ref)), f"{ref}: 1 reference(s) longer", "line(s) 2"
    )
    assert mtx_here(monkeypatch, *run, "--beam", "4").returncode == 2  # no search: a usage error

    def out_of_memory(*args: object, **kwargs: object) -> list[float]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    from mtx import search

    monkeypatch.setattr(search, "_forced_sums", out_of_memory)  # a batch's pass
    ref.write_text("A dog.\nTwo cats.\n", encoding="utf-8")
    assert_one_line_error(
        mtx_here(monkeypatch, *run, "--src", str(src), "--ref", str(ref), "--batch-tokens", "900"),
        "out of memory scoring on cpu in batches of 900 tokens",
        "lower --batch-tokens",
    )


def test_score_counts_the_reference_pieces_a_restricted_softmax_cannot_give(
    tiny_restricted_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("Ein Hund.\nZwei Katzen.\n", encoding="utf-8")
    ref.write_text("A dog \u2603.\nTwo cats.\n", encoding="utf-8")  # a snowman: pieces train's targets never have
    result = mtx_here(monkeypatch, "score", "--run", str(tiny_restricted_run), "--src", str(src), "--ref", str(ref))
    assert result.returncode == 0, result.stderr.decode()
    assert re.search(r"\d+ reference piece\(s\) are outside the run's output vocabulary", result.stderr.decode())
    assert len(result.stdout.decode().splitlines()) == 2
    ref.write_text("A dog.\nTwo cats.\n", encoding="utf-8")
    plain = mtx_here(monkeypatch, "score", "--run", str(tiny_restricted_run), "--src", str(src), "--ref", str(ref))
    assert plain.returncode == 0 and "outside the run's output vocabulary" not in plain.stderr.decode()
