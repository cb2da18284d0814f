"""Shared fixtures: the real Multi30k copy, a small slice of it, and one tiny trained run."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import mtx.data
from mtx.cli import main
from mtx.data import MULTI30K_URL

REPO = Path(__file__).resolve().parent.parent
# CTranslate2 multiplies int8 through oneDNN on CPUs other than Intel's (MKL on Intel's). On an AMD
# EPYC (Zen 3, AVX2; stop 56) that path scored the tiny test model's greedy outputs 0.059 nats a
# token off on average (at most 0.38; 14 of 100 decoded alike) against MKL's 0.003 (0.02; 80 of
# 100). The export tests check mtx's conversion, not the engine's kernels: MKL's path everywhere
os.environ.setdefault("CT2_USE_MKL", "1")


def _local_multi30k() -> Path:
    """$MTX_DATA_DIR, else the copy beside the checkout, else the download cache that `make train`
    fills (stop 62: a clone elsewhere, whose training had downloaded the data, failed half the
    tests), as `data.dir: auto` looks; the copy beside the checkout where none holds it."""
    beside = REPO.parent / "shared" / "data" / "multi30k"
    if os.environ.get("MTX_DATA_DIR"):
        return Path(os.environ["MTX_DATA_DIR"])
    return next((p for p in (beside, mtx.data.multi30k_cache()) if (p / "train.de.gz").is_file()), beside)


SHARED_DATA = _local_multi30k()

# the tests stop commands with signals as a terminal does: a suite started in the background (a
# shell's `&` ignores SIGINT, `nohup` SIGHUP) takes them back, for itself and the commands it
# starts, since mtx leaves a signal it was started ignoring ignored (stop 62;
# test_signals_ignored_at_start_stay_ignored starts its command ignoring them on purpose)
for _sig in (signal.SIGHUP, signal.SIGTERM):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, signal.SIG_DFL)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
TINY_CONFIG = REPO / "configs" / "tiny.yaml"


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # (without pytest-timeout: no timeout, no error)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's thread method (pyproject.toml's timeout_method), saying first which test ran
    over: the plugin's report, every thread's stack, names a function but not its parametrized case,
    and `pytest -q` prints no names. (The signal method, SIGALRM, names it and goes on to the next
    test, but runs only between the main thread's Python steps, and a hung mp.spawn rank then kept
    pytest from exiting after its summary: stop 70's scratch tests.)"""
    if settings.method != "thread":
        return None  # the plugin's own
    import pytest_timeout

    def expired() -> None:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # capsys's capture and the run's own: the line reaches the terminal
            capture.suspend(in_=True)
        item.config.get_terminal_writer().line(
            f"{item.nodeid}: over the timeout of {settings.timeout:g} s; every thread's stack follows"
        )
        pytest_timeout.timeout_timer(item, settings)  # the stacks, then the whole run ends (os._exit(1))

    timer = threading.Timer(settings.timeout, expired)
    timer.name = f"pytest_timeout {item.nodeid}"
    item.cancel_timeout = lambda: (timer.cancel(), timer.join())  # what the plugin's cancel hook calls
    timer.start()
    return True


torch.set_num_threads(2)


def _head(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f) for _ in range(n)]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "train.de.gz").is_file():
        pytest.fail(f"the Multi30k copy is missing at {SHARED_DATA} (set MTX_DATA_DIR to a folder of its .gz files)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    """Plain-text slice of the real data: 3000 train, 200 val, 100 test pairs (de, en)."""
    out = tmp_path_factory.mktemp("multi30k_small")
    for split, n in (("train", 3000), ("val", 200), ("test_2016_flickr", 100)):
        for lang in ("de", "en"):
            lines = _head(shared_data / f"{split}.{lang}.gz", n)
            (out / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def mini_data(tmp_path_factory: pytest.TempPathFactory, small_data: Path) -> Path:
    """400 train pairs of the small slice: about 9 batches an epoch at the tiny config's batch_tokens,
    a few seconds to tokenise and start on each of several ranks."""
    out = tmp_path_factory.mktemp("multi30k_mini")
    for split, n in (("train", 400), ("val", 30), ("test_2016_flickr", 30)):
        for lang in ("de", "en"):
            lines = (small_data / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
            (out / f"{split}.{lang}").write_text("".join(lines[:n]), encoding="utf-8")
    return out


def tiny_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TINY_CONFIG),
        "--run-dir",
        str(run_dir),
        "--set",
        f"data.dir={data_dir}",
        *extra,
    ]


def main_in_process(
    argv: list[str], stdin: bytes | None, monkeypatch: pytest.MonkeyPatch, cwd: Path = REPO
) -> subprocess.CompletedProcess[bytes]:
    """`mtx ARGV` through its entry point in this process, as test_cli's `mtx()` runs it in a new
    one (a process imports torch in 2-3 s: 40 cases took 77 s of the suite), from `cwd`: its exit
    code and standard streams. An exception that would print a traceback fails the test with it;
    the working directory and standard input are restored by `monkeypatch`, torch's threads here."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"))
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors and --help, as a process ends on them
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(argv, code, out.getvalue().encode(), err.getvalue().encode())


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, small_data: Path) -> Path:
    """A tiny model trained for 200 steps on the small slice, with a moving average of its weights
    (shared by decoding tests)."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    args = tiny_args(
        small_data, run_dir, "--set", "train.max_steps=200", "--set", "train.eval_every=100", "--set", "train.ema=0.99"
    )
    assert main(args) == 0
    return run_dir


@pytest.fixture(scope="session")
def tiny_restricted_run(tmp_path_factory: pytest.TempPathFactory, small_data: Path) -> Path:
    """The tiny run with its softmax over the target pieces of train only (model.restrict_output),
    and a moving average of its weights."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny_restricted"
    args = tiny_args(
        small_data,
        run_dir,
        "--set",
        "train.max_steps=200",
        "--set",
        "train.eval_every=100",
        "--set",
        "model.restrict_output=true",
        "--set",
        "train.ema=0.99",
    )
    assert main(args) == 0
    return run_dir


class FakeMulti30k:
    """`datasets.DownloadManager` serving Multi30k's URLs from a local folder (no network in tests);
    a file the folder lacks fails as a missing URL does, and every requested name is recorded."""

    def __init__(self, server: Path) -> None:
        self.server, self.requested, self.cache_dirs = server, [], []

    def __call__(self, dataset_name: str, download_config: Any = None) -> FakeMulti30k:
        assert dataset_name == "multi30k"
        self.cache_dirs.append(download_config.cache_dir)  # where `datasets` keeps its own copies
        return self

    def download(self, urls: dict[str, str]) -> dict[str, str]:
        self.requested += list(urls)
        out = {}
        for name, url in urls.items():
            split, lang = name.removesuffix(".gz").rsplit(".", 1)
            assert url == MULTI30K_URL.format(split=split, lang=lang)
            if not (self.server / name).is_file():
                raise FileNotFoundError(f"Couldn't find file at {url}")
            out[name] = str(self.server / name)
        return out


@pytest.fixture
def multi30k_server(tmp_path: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch) -> FakeMulti30k:
    """A fake Multi30k server with train, val and the official test splits (each a slice of the small
    data's own split, so lines differ between them), an empty $XDG_CACHE_HOME and no local copy."""
    server = tmp_path / "server"
    server.mkdir()
    sources = {"train": "train", "val": "val", "test_2016_flickr": "test_2016_flickr", "test_2017_flickr": "val"}
    for split, source in sources.items():
        for lang in ("de", "en"):
            text = (small_data / f"{source}.{lang}").read_text(encoding="utf-8")
            (server / f"{split}.{lang}.gz").write_bytes(gzip.compress(text.encode()))
    fake = FakeMulti30k(server)
    import datasets  # a dependency of mtx: missing, an error, not a skip (stop 69's probe)

    monkeypatch.setattr(datasets, "DownloadManager", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MTX_DATA_DIR", raising=False)
    monkeypatch.setattr(mtx.data, "_SHARED_COPIES", ())
    return fake


def script_in_process(
    script: Path, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """Run `scripts/NAME.py ARGS` as its `__main__` does, in the test process (a subprocess
    spends 2-3 s importing torch): its exit code, standard output and standard error. For a
    script's argument checks and one-line errors; torch's thread count is restored after."""
    import logging
    import runpy

    capsys.readouterr()  # runpy runs the file as __main__, with sys.argv and sys.path as a shell gives them
    monkeypatch.setattr("sys.argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))
    # logging as in a new process: warnings and errors alone, on stderr (earlier tests' `mtx`
    # commands in this process configured INFO)
    loggers = [logging.getLogger(), logging.getLogger("mtx")]
    saved = [(logger, logger.level, logger.handlers[:]) for logger in loggers]
    loggers[0].setLevel(logging.WARNING)
    loggers[1].setLevel(logging.NOTSET)
    for logger in loggers:
        logger.handlers.clear()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()  # (bench_train seeds torch's generator)
    try:
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        for logger, level, handlers in saved:
            logger.setLevel(level)
            logger.handlers[:] = handlers
    out, err = capsys.readouterr()
    return code, out, err
