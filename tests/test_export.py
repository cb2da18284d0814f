"""`mtx export`: a run as a CTranslate2 model. CTranslate2 must score mtx's own translations as
mtx does (the conversion is right for every model variant), decode what mtx decodes, and the
command must refuse what it cannot do in one line."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from mtx.checkpoint import load_run
from mtx.cli import main
from mtx.errors import MtxError
from mtx.export import export_ctranslate2
from mtx.search import max_output_lengths, translate_ids
from mtx.text import read_lines
from mtx.tokenizer import EOS

from .conftest import tiny_args
from .test_cli import assert_one_line_error, mtx_here

# a CTranslate2 that is installed and fails to import is an error, not this skip (stop 69's probe:
# pytest before 8.2 skipped on any ImportError)
ctranslate2 = pytest.importorskip(
    "ctranslate2",
    reason="no CTranslate2 on this platform (the optional extra mtx[export])",
    exc_type=ModuleNotFoundError,
)

VARIANTS = {
    "pre-norm, joint, tied": [],
    "post-norm, separate vocabularies, untied": [
        "model.pre_norm=false",
        "tokenizer.joint=false",
        "model.tie_embeddings=false",
    ],
    "ScaleNorm, FixNorm, restricted softmax": ["model.norm=scale", "model.fix_norm=true", "model.restrict_output=true"],
}


def _pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.id_to_token(i) for i in ids]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ctranslate2_scores_mtx_translations_as_mtx_does(tmp_path: Path, small_data: Path, variant: str) -> None:
    """The sum of CTranslate2's token log-probabilities (EOS included) of mtx's greedy output ==
    mtx's own, sentence by sentence: every weight went where CTranslate2 reads it."""
    run_dir = tmp_path / "run"
    sets = [x for key in VARIANTS[variant] for x in ("--set", key)]
    assert main(tiny_args(small_data, run_dir, "--set", "train.max_steps=30", *sets)) == 0
    run = load_run(run_dir)
    out = export_ctranslate2(run, tmp_path / "ct2")
    src_tok = Tokenizer.from_file(str(out / "source_tokenizer.json"))
    tgt_tok = Tokenizer.from_file(str(out / "target_tokenizer.json"))

    src_ids = run.src_tok.encode_batch(read_lines(small_data / "val.de")[:40])
    hyps = [h[0] for h in translate_ids(run.model, src_ids, 1, 1.0, 1.2, 10, 4000)]
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=2)
    scored = translator.score_batch([_pieces(src_tok, s) for s in src_ids], [_pieces(tgt_tok, h.tokens) for h in hyps])
    for hyp, result in zip(hyps, scored, strict=True):
        assert result.tokens[-1] == "</s>" and len(result.tokens) == len(hyp.tokens) + 1
        assert sum(result.log_probs) == pytest.approx(hyp.log_prob, abs=1e-3), (variant, hyp.tokens)


def test_exported_model_decodes_what_mtx_decodes(tiny_run: Path, small_data: Path, tmp_path: Path) -> None:
    """Greedy decoding with mtx's length cap: the same outputs, through the files a user gets
    (the exported tokenizers turn text into pieces and pieces back into text); int8 is smaller
    and scores and decodes close to it."""
    run = load_run(tiny_run)
    out = export_ctranslate2(run, tmp_path / "f32")
    info = json.loads((out / "mtx_export.json").read_text())
    assert info["quantization"] == "float32" and info["src_lang"] == "de" and info["tgt_lang"] == "en"
    assert info["checkpoint"] == str(tiny_run / "checkpoints" / "best.pt")
    src_tok = Tokenizer.from_file(str(out / "source_tokenizer.json"))
    tgt_tok = Tokenizer.from_file(str(out / "target_tokenizer.json"))
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=2)

    texts = read_lines(small_data / "val.de")[:100]
    dc = run.cfg.decode
    hyps = [
        h[0]
        for h in translate_ids(run.model, run.src_tok.encode_batch(texts), 1, 1.0, dc.max_len_a, dc.max_len_b, 4000)
    ]
    expected = run.tgt_tok.decode_batch([h.tokens for h in hyps])
    pieces = [src_tok.encode(t, add_special_tokens=False).tokens for t in texts]

    def greedy(translator: ctranslate2.Translator) -> dict[int, str]:
        got: dict[int, str] = {}
        # mtx caps each sentence at a * (pieces + EOS) + b tokens, EOS included; CTranslate2 caps a batch
        by_length = itertools.groupby(
            sorted(range(len(texts)), key=lambda i: len(pieces[i])), key=lambda i: len(pieces[i])
        )
        for length, group in by_length:
            group = list(group)
            src = torch.full((1, length + 1), EOS)
            cap = int(max_output_lengths(src, dc.max_len_a, dc.max_len_b, run.model)[0]) - 1
            results = translator.translate_batch([pieces[i] for i in group], beam_size=1, max_decoding_length=cap)
            for i, r in zip(group, results, strict=True):
                got[i] = tgt_tok.decode([tgt_tok.token_to_id(p) for p in r.hypotheses[0]]).strip()
        return got

    got = greedy(translator)
    same = sum(got[i] == expected[i] for i in range(len(texts)))
    assert same >= 98, f"{same} of {len(texts)} outputs equal mtx's"

    # int8: smaller, and close to the float model: it scores mtx's outputs within a few hundredths
    # of a nat per token (stop 52: at most 0.009) and decodes most of them (77 of 100)
    small = export_ctranslate2(run, tmp_path / "int8", "int8")
    assert (small / "model.bin").stat().st_size < 0.6 * (out / "model.bin").stat().st_size
    int8 = ctranslate2.Translator(str(small), device="cpu", intra_threads=2)
    scored = int8.score_batch(pieces, [[tgt_tok.id_to_token(i) for i in h.tokens] for h in hyps])
    for hyp, result in zip(hyps, scored, strict=True):
        assert abs(sum(result.log_probs) - hyp.log_prob) / (len(hyp.tokens) + 1) < 0.05, hyp.tokens
    got = greedy(int8)
    assert sum(got[i] == expected[i] for i in range(len(texts))) >= 50


def test_export_command_and_its_refusals(tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # what a killed export leaves (SIGTERM and kill -9 skip its cleanup) goes; a running one's stays
    # (another machine's, on a shared filesystem, stays too: whether its process lives is unknown here).
    # A running export holds a lock on its staging directory: stop 66, the process id in its name
    # decided, and another PID namespace's (a container's) is alive or dead here at random
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    (tmp_path / f".old.partial-{host}-{gone.pid}").mkdir()
    (tmp_path / f".old.partial-{host}-{gone.pid}" / "model.bin").write_bytes(b"x" * 1000)
    (tmp_path / f".container.partial-{host}-1").mkdir()  # a killed export that was PID 1 in its container
    kept = [f".busy.partial-{host}-{gone.pid}", f".other.partial-elsewhere-{gone.pid}"]
    for name in kept:
        (tmp_path / name).mkdir()
    hold = (
        "import fcntl, os, sys\n"
        "fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    # another export that still runs, in another container: its pid is not alive here
    busy = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path / kept[0])], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert busy.stdout is not None and busy.stdout.readline() == b"held\n"
    r = mtx_here(
        monkeypatch, "export", "--run", str(tiny_run), "--out", str(tmp_path / "ct2"), "--quantization", "int8"
    )
    assert r.returncode == 0, r.stderr.decode()
    busy.communicate(b"\n", timeout=60)
    assert sorted(p.name for p in tmp_path.glob(".*partial*")) == sorted(kept)
    for name in kept:
        (tmp_path / name).rmdir()
    assert json.loads(r.stdout) == {"ctranslate2_model": str(tmp_path / "ct2"), "quantization": "int8"}
    written = sorted(p.name for p in (tmp_path / "ct2").iterdir())
    assert {"model.bin", "config.json", "source_tokenizer.json", "target_tokenizer.json", "mtx_export.json"} <= set(
        written
    )
    again = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(tmp_path / "ct2"))
    assert_one_line_error(again, "already exists and is not empty")
    assert sorted(p.name for p in (tmp_path / "ct2").iterdir()) == written  # nothing overwritten
    # a directory named in bytes other than UTF-8, as Linux allows (stop 58: the tokenizers' save, a traceback)
    odd = tmp_path / os.fsdecode(b"ct2 \xff")
    assert mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(odd)).returncode == 0
    assert sorted(p.name for p in odd.iterdir()) == written
    assert (odd / "target_tokenizer.json").read_bytes() == (tmp_path / "ct2" / "target_tokenizer.json").read_bytes()
    assert_one_line_error(
        mtx_here(monkeypatch, "export", "--run", str(tmp_path / "nowhere")), "run directory not found"
    )
    elsewhere = ["--checkpoint", str(tmp_path / "no.pt"), "--out", str(tmp_path / "x")]
    missing = mtx_here(monkeypatch, "export", "--run", str(tiny_run), *elsewhere)
    assert_one_line_error(missing, "no.pt")
    assert not (tmp_path / "x").exists()
    bad = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--quantization", "int4")
    assert bad.returncode == 2 and b"invalid choice: 'int4'" in bad.stderr

    checkpoints = sorted((tiny_run / "checkpoints").glob("step_*.pt"))[:2]
    with pytest.raises(MtxError, match="one checkpoint"):
        export_ctranslate2(load_run(tiny_run, checkpoints), tmp_path / "ensemble")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if it were not installed
    with pytest.raises(MtxError, match=r"pip install ctranslate2"):
        export_ctranslate2(load_run(tiny_run), tmp_path / "none")
    assert not (tmp_path / "ensemble").exists() and not (tmp_path / "none").exists()
    assert not list(tmp_path.glob(".*partial*"))  # no staging directory left behind


def test_export_refuses_links_the_working_directory_and_a_runs_names_before_converting(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each was refused after the conversion, naming the hidden staging directory or saying
    "Not a directory" / "Invalid argument"; a directory named like a future step_N.pt stopped
    the run's training at that step (stop 62)."""
    import mtx.export

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted before refusing")

    monkeypatch.setattr(mtx.export, "ctranslate2_spec", no_conversion)
    (tmp_path / "dangle").symlink_to(tmp_path / "nothere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "to_empty").symlink_to("empty")
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for out, needle in [
        ("dangle", "dangle is a symbolic link (to "),
        ("to_empty", "to_empty is a symbolic link (to empty); give the directory itself as --out"),
        ("run/checkpoints/step_999.pt", "is one of the files of the run"),
    ]:
        r = mtx_here(monkeypatch, "export", "--run", str(run), "--out", str(tmp_path / out))
        assert_one_line_error(r, needle)
    monkeypatch.chdir(tmp_path / "empty")
    with pytest.raises(MtxError, match=r"^\. is the working directory; give a new directory as --out$"):
        export_ctranslate2(load_run(run), Path("."))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangle", "empty", "run", "to_empty"]
    assert not list((tmp_path / "empty").iterdir())


def test_export_refuses_a_used_out_or_a_missing_ctranslate2_before_loading_the_model(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --out in use, a dangling link as --out and a missing CTranslate2 are one line each,
    before the checkpoint is read (stop 71: a large model loaded first, for seconds)."""
    import mtx.checkpoint

    def no_load(*args: object) -> None:
        raise AssertionError("loaded the model before refusing")

    monkeypatch.setattr(mtx.checkpoint, "load_run", no_load)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "model.bin").write_bytes(b"x")
    (tmp_path / "dangle").symlink_to(tmp_path / "nothere")
    export = ["export", "--run", str(tiny_run), "--out"]
    assert_one_line_error(mtx_here(monkeypatch, *export, str(tmp_path / "used")), "already exists and is not empty")
    assert_one_line_error(mtx_here(monkeypatch, *export, str(tmp_path / "dangle")), "is a symbolic link")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if it were not installed
    assert_one_line_error(mtx_here(monkeypatch, *export, str(tmp_path / "new")), "pip install ctranslate2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangle", "used"]
    assert (tmp_path / "used" / "model.bin").read_bytes() == b"x"


def test_a_failed_export_names_its_directory_and_leaves_none(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk was "mtx: error: File too large" with no path, and the directories made for
    --out were left (stop 62)."""
    from ctranslate2.specs.model_spec import ModelSpec

    def full_disk(self: object, path: str) -> None:
        Path(path, "model.bin").write_bytes(b"x" * 100)
        raise OSError(28, "No space left on device")  # as CTranslate2 raises it: no file name

    monkeypatch.setattr(ModelSpec, "save", full_disk)
    out = tmp_path / "new1" / "new2" / "model"
    assert_one_line_error(
        mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(out)), f"{out}: ", "No space left"
    )
    assert not list(tmp_path.iterdir())


def test_an_export_is_on_the_disk_before_its_name_is(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 67 (read from the code: a power cut cannot be tested here): the staging directory's
    files were renamed to --out unsynced, so a power cut could leave --out with empty or torn
    files. Every file and the staging directory are synced before the rename, the parent after."""
    import mtx.export

    events: list[tuple[str, str]] = []
    fsync, sync_dir, rename = os.fsync, mtx.export.fsync_dir, Path.rename

    def logged_fsync(fd: int) -> None:
        fsync(fd)
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))

    def logged_sync_dir(directory: Path) -> None:
        sync_dir(directory)
        events.append(("sync dir", directory.name))

    def logged_rename(self: Path, target: Path) -> Path:
        events.append(("rename", Path(target).name))
        return rename(self, target)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(mtx.export, "fsync_dir", logged_sync_dir)
    monkeypatch.setattr(Path, "rename", logged_rename)
    out = export_ctranslate2(load_run(tiny_run), tmp_path / "ct2")
    monkeypatch.undo()
    renamed = events.index(("rename", "ct2"))
    staging = events[renamed - 1][1]
    assert events[renamed - 1] == ("sync dir", staging) and staging.startswith(".ct2.")
    synced = {name for kind, name in events[:renamed] if kind == "fsync"}
    assert synced == {p.name for p in out.iterdir()} | {staging}
    assert events[renamed + 1 :] == [("fsync", tmp_path.name), ("sync dir", tmp_path.name)]


def test_an_export_error_names_the_place_the_user_gave_not_the_staging_folder(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop 63's open item: on a read-only run directory the error named the staging folder
    (`RUN/.ctranslate2-float32.partial-HOST-PID: Read-only file system`), a name the user never
    gave and that is gone once the error is shown. It names --out, and a file's place in it."""
    mkdir, write_text = Path.mkdir, Path.write_text

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        if ".partial-" in self.name:
            raise OSError(30, "Read-only file system", str(self))
        mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", read_only)
    out = tmp_path / "ct2"
    r = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(out))
    assert_one_line_error(r, f"mtx: error: {out}: Read-only file system")

    def taken(self: Path, *args: object, **kwargs: object) -> None:  # another export's staging folder
        if ".partial-" in self.name:
            raise FileExistsError(17, "File exists", str(self))
        mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", taken)
    r = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(out))
    assert_one_line_error(r, f"mtx: error: {out}: another export to it is under way (its staging folder")
    monkeypatch.setattr(Path, "mkdir", mkdir)

    def no_room(self: Path, *args: object, **kwargs: object) -> int:
        if self.name == "target_tokenizer.json":
            raise OSError(28, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", no_room)
    r = mtx_here(monkeypatch, "export", "--run", str(tiny_run), "--out", str(out))
    assert_one_line_error(r, f"mtx: error: {out / 'target_tokenizer.json'}: No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_info_file_holds_the_runs_decoding_settings(
    tiny_run: Path, tiny_restricted_run: Path, tmp_path: Path
) -> None:
    """mtx_export.json tells a CTranslate2 user the run's beam, length penalty and length cap, and
    whether its softmax is restricted (stop 70's mutants: another key's value, or the flag inverted,
    passed every test), and the punctuation its source tokenizer reads as the data writes it."""
    for run_dir, restricted in ((tiny_run, False), (tiny_restricted_run, True)):
        run = load_run(run_dir)
        info = json.loads((export_ctranslate2(run, tmp_path / run_dir.name) / "mtx_export.json").read_text())
        dc = run.cfg.decode
        assert dc.length_penalty != dc.max_len_a  # (so that one read for the other shows)
        assert info["decode"] == {
            "beam": dc.beam,
            "length_penalty": dc.length_penalty,
            "max_len_a": dc.max_len_a,
            "max_len_b": dc.max_len_b,
        }
        assert info["restricted_output"] is restricted
        assert info["source_punctuation_read_as"] == run.folds and run.folds['"'] == "\u201c"  # (stop 73)
