"""Parallel text loading (HF `datasets`), Multi30k's download, and length-bucketed token batches
(reading and checking the text lines themselves: text.py).

A data directory holds `{split}.{lang}` or `{split}.{lang}.gz` files, one sentence per line,
line i of the source file translating line i of the target file (the Multi30k task-1 layout).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mtx.checkpoint import fsync_dir
from mtx.config import DataConfig, user_path
from mtx.errors import DataError
from mtx.text import read_parallel
from mtx.tokenizer import BOS, BPE, EOS, PAD

if TYPE_CHECKING:  # torch where tensors are made: `compare` and `plot` read text with this module (stop 69)
    import datasets
    import torch

log = logging.getLogger(__name__)

MULTI30K_SOURCE = "https://github.com/multi30k/dataset/raw/master/data/task1/raw"
MULTI30K_URL = MULTI30K_SOURCE + "/{split}.{lang}.gz"
MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_LANGS = ("en", "de", "fr", "cs")
# the official test splits and their languages: `mtx eval` fetches one that the data directory lacks
MULTI30K_TESTS = {
    "test_2016_flickr": ("en", "de", "fr", "cs"),
    "test_2017_flickr": ("en", "de", "fr"),
    "test_2017_mscoco": ("en", "de", "fr"),
    "test_2018_flickr": ("en", "de", "fr", "cs"),
}


def is_test_split(split: str) -> bool:
    """Whether `split` is a test split (the official Multi30k ones, or any named test*): never
    one to choose a checkpoint or a setting on."""
    return split in MULTI30K_TESTS or split.lower().startswith("test")


def warn_if_validating_on_train(cfg: DataConfig) -> None:
    """Warn where data.valid_split is the training split: what is scored, and chosen, on it is the
    training data (mtx train; choose_on_val since stop 64, where it chose on train without a word)."""
    if cfg.valid_split == cfg.train_split:
        log.warning(
            "data.valid_split is the training split (%r): val loss and BLEU measure the training data, "
            "and best.pt, patience and choices made on them will favour overfitting",
            cfg.train_split,
        )


_REPO_ROOT = Path(__file__).resolve().parent.parent
# the shared copy from the working directory, and beside the checkout that runs (an editable
# install's; an installed package has no checkout around it)
_SHARED_COPIES = (
    Path("../shared/data/multi30k"),
    *([_REPO_ROOT.parent / "shared/data/multi30k"] if (_REPO_ROOT / "pyproject.toml").is_file() else []),
)


def _find_split_file(data_dir: Path, split: str, lang: str) -> Path | None:
    """The file of one side of one split, plain or gzipped; None where there is neither."""
    return next((data_dir / n for n in (f"{split}.{lang}", f"{split}.{lang}.gz") if (data_dir / n).is_file()), None)


_BOTH_FORMS_NOTED: set[Path] = set()  # plain files read beside a .gz of the same name, warned once


def split_file(data_dir: Path, split: str, lang: str) -> Path:
    """The file of one side of one split, plain or gzipped (the plain one where both are there,
    with a warning: they may differ)."""
    path = _find_split_file(data_dir, split, lang)
    packed = data_dir / f"{split}.{lang}.gz"
    if path is not None and path != packed and packed.is_file() and path not in _BOTH_FORMS_NOTED:
        _BOTH_FORMS_NOTED.add(path)  # (stop 57: the plain file was read without a word)
        log.warning(
            "%s: both %s and %s are here; reading %s (remove the other)", data_dir, path.name, packed.name, path.name
        )
    if path is not None:
        return path
    for odd in (data_dir / f"{split}.{lang}", packed):  # (stop 57: "no train.de or train.de.gz" for a directory)
        if odd.exists() or odd.is_symlink():
            raise DataError(
                f"{odd}: not a regular file (a directory, a broken link or a device); {split}.{lang} is read "
                "from a text file"
            )
    raise DataError(
        f"{data_dir}: no {split}.{lang} or {split}.{lang}.gz (split {split!r} missing, or language {lang!r} not in it)"
    )


def available_splits(data_dir: Path, src_lang: str, tgt_lang: str) -> list[str]:
    """Splits that have both a source and a target file."""
    names = set()
    for path in data_dir.iterdir():
        name = path.name.removesuffix(".gz")
        split, _, lang = name.rpartition(".")
        if split and lang == src_lang:
            names.add(split)
    out = []
    for split in sorted(names):
        try:
            split_file(data_dir, split, tgt_lang)
        except DataError:
            continue
        out.append(split)
    return out


def multi30k_cache() -> Path:
    """Where mtx downloads Multi30k: `$XDG_CACHE_HOME/mtx/multi30k` (default `~/.cache/mtx/multi30k`)."""
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "mtx" / "multi30k"
    try:
        home = Path.home()
    except RuntimeError:  # (stop 67: a traceback, as with `env -i` under a user id with no passwd entry)
        raise DataError(
            "no place for Multi30k's download: $HOME is unset and this user has no home directory; "
            "set $XDG_CACHE_HOME, or $MTX_DATA_DIR (or data.dir) to a local copy"
        ) from None
    return home / ".cache" / "mtx" / "multi30k"


def download_reason(error: BaseException) -> str:
    """Why a download failed, in a few words: the network error among `error`'s causes, where
    there is one (stop 63: a machine without a network was told "FileNotFoundError: URL",
    fsspec's wrapping of the failed name lookup, which reads as a file missing upstream; stop 67:
    so was a proxy's refusal, and a connection that timed out)."""
    chain, seen = [error], 0
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and seen < 20:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
        seen += 1
    causes = chain[1:]
    if lookup := next((e for e in chain if isinstance(e, socket.gaierror)), None):
        return f"no network: the host name cannot be resolved ({lookup.strerror or lookup})"
    if proxy := next((e for e in causes if type(e).__name__ == "ClientHttpProxyError"), None):
        status, message = getattr(proxy, "status", ""), getattr(proxy, "message", "")
        return f"the proxy refused it: {status} {message}".rstrip()
    if slow := next((e for e in causes if isinstance(e, TimeoutError)), None):
        return f"no answer within {DOWNLOAD_TIMEOUT_S} s: {_gist(slow)}"
    if lost := next((e for e in causes if isinstance(e, ConnectionError)), None):
        return f"no connection: {_gist(lost)}"
    return _gist(error)


def _gist(error: BaseException) -> str:
    return type(error).__name__ + (": " + str(error).splitlines()[0][:120] if str(error).strip() else "")


# a connection that stays silent this long fails (stop 67: a proxy or firewall that accepted it and
# sent nothing hung `mtx train` and `mtx eval` with no end)
DOWNLOAD_TIMEOUT_S = 30


def _timeouts() -> dict[str, Any]:
    """fsspec's HTTP options for `datasets`: a connection, and each read, give up after
    `DOWNLOAD_TIMEOUT_S`."""
    try:
        import aiohttp
    except ImportError:  # pragma: no cover (fsspec's HTTP needs it)
        return {}
    timeout = aiohttp.ClientTimeout(total=None, connect=DOWNLOAD_TIMEOUT_S, sock_read=DOWNLOAD_TIMEOUT_S)
    return {protocol: {"client_kwargs": {"timeout": timeout}} for protocol in ("http", "https")}


def download_multi30k(
    dest: Path, files: Sequence[tuple[str, str]] = (), fix: str = "set data.dir to a local copy"
) -> Path:
    """Fetch public Multi30k task-1 raw files into `dest` (needs a network): the (split, lang)
    `files`, by default every language of train, val and test_2016_flickr. Each file appears
    whole or not at all; a failure is a `DataError` that ends with `fix`."""
    import datasets

    wanted = files or [(split, lang) for split in MULTI30K_SPLITS for lang in MULTI30K_LANGS]
    urls = {f"{split}.{lang}.gz": MULTI30K_URL.format(split=split, lang=lang) for split, lang in wanted}
    log.info("downloading Multi30k task-1 files to %s: %s", dest, ", ".join(urls))
    try:
        # its own copies beside mtx's (stop 67: an empty $XDG_CACHE_HOME, as a CI variable that expands
        # to nothing, made `datasets` download into ./huggingface of the working directory)
        downloads = str(dest.resolve().parent / "downloads")
        config = datasets.DownloadConfig(cache_dir=downloads, storage_options=_timeouts())
        local = datasets.DownloadManager(dataset_name="multi30k", download_config=config).download(urls)
    except Exception as e:  # network errors come in many classes
        raise DataError(f"cannot download Multi30k from {MULTI30K_SOURCE} ({download_reason(e)}); {fix}") from None
    dest.mkdir(parents=True, exist_ok=True)
    for name, path in local.items():
        tmp = dest / f".{name}.{os.getpid()}.tmp"  # one per process: two fetching at once never share one
        try:
            with open(tmp, "wb") as f:  # on the disk before its name is (stop 67: a power cut could leave it torn)
                f.write(Path(path).read_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest / name)
        finally:  # a full disk leaves no partial file behind
            tmp.unlink(missing_ok=True)
    fsync_dir(dest)
    return dest


def _needed(cfg: DataConfig) -> list[tuple[str, str]]:
    """The (split, language) files training reads: train and val of its languages, and the train
    split of each extra source language."""
    pair = [
        (split, lang)
        for split in dict.fromkeys([cfg.train_split, cfg.valid_split])
        for lang in (cfg.src_lang, cfg.tgt_lang)
    ]
    return pair + [(cfg.train_split, lang) for lang in cfg.extra_src_langs]


def training_files(folder: Path, cfg: DataConfig) -> list[Path]:
    """The paths, plain and gzipped, that the splits and languages training reads have in `folder`."""
    return [folder / f"{split}.{lang}{gz}" for split, lang in _needed(cfg) for gz in ("", ".gz")]


def _missing(folder: Path, files: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (split, language) files of `files` that `folder` holds neither plain nor gzipped."""
    return [(split, lang) for split, lang in files if _find_split_file(folder, split, lang) is None]


def _names(files: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{split}.{lang}" for split, lang in files)


def resolve_data_dir(cfg: DataConfig) -> Path:
    """`data.dir`, or for "auto" the first of: $MTX_DATA_DIR (which must then hold every file the
    config reads), the shared local copy, the download cache, each used only when it holds them
    all; else the files the cache lacks are downloaded into it (a cache that a failed or
    interrupted download left half-filled is completed, not taken as it is)."""
    if cfg.dir != "auto":
        path = user_path(cfg.dir, "data.dir")
        if path.exists() and not path.is_dir():
            raise DataError(f"data.dir: {path} is a file, not a directory; set data.dir to the data files' directory")
        if not path.is_dir():
            # (stop 68's probe: a config's `../data` looked for beside the config, unsaid)
            here = (
                ""
                if path.is_absolute()
                else f" (a relative data.dir is read from the working directory: {path.absolute()})"
            )
            fix = "set data.dir to the data files' directory"
            raise DataError(f"data.dir: directory {path} does not exist{here}; {fix}")
        return path.resolve()
    needed = _needed(cfg)
    env = os.environ.get("MTX_DATA_DIR")
    if env:
        lacking = _missing(user_path(env, "$MTX_DATA_DIR"), needed)
        if lacking:
            raise DataError(
                f"$MTX_DATA_DIR={env} lacks {_names(lacking)} (plain or .gz); point it at a directory that "
                "holds them, or unset it"
            )
        return user_path(env, "$MTX_DATA_DIR").resolve()
    for path in _SHARED_COPIES:
        if not _missing(path, needed):
            return path.resolve()
    cache = multi30k_cache()
    lacking = _missing(cache, needed)
    if not lacking:
        return cache.resolve()
    outside = [(s, lang) for s, lang in lacking if s not in MULTI30K_SPLITS or lang not in MULTI30K_LANGS]
    if outside:
        raise DataError(
            f"data.dir auto finds Multi30k only ({', '.join(MULTI30K_SPLITS)} in {', '.join(MULTI30K_LANGS)}), "
            f"not {_names(outside)}; set data.dir to a directory that holds them"
        )
    # a first download fetches every Multi30k file (other directions need no second one); a
    # half-filled cache, only what it lacks
    everything = [(split, lang) for split in MULTI30K_SPLITS for lang in MULTI30K_LANGS]
    fetch = _missing(cache, everything) if cache.is_dir() and any(cache.iterdir()) else everything
    # every place looked in (stop 67: the copy beside the checkout, which `make` relies on, went unsaid)
    shared: dict[Path, str] = {}  # each once: from the checkout's root the two are one folder
    for path in _SHARED_COPIES:
        shared.setdefault(path.resolve(), str(path))
    places = ", ".join(["$MTX_DATA_DIR", *(shared.values() or ["../shared/data/multi30k"])]) + f" or {cache}"
    fix = f"put {_names(lacking)} (.gz or plain) into {places}, or set data.dir to a local copy"
    return download_multi30k(cache, fetch, fix).resolve()


def eval_split_files(data_dir: Path, split: str, src_lang: str, tgt_lang: str) -> tuple[Path, Path]:
    """The source and target files of `split` in `data_dir`. An official Multi30k test split that
    is not there (test_2017_flickr, test_2017_mscoco, test_2018_flickr: the shared copy and a first
    download hold test_2016_flickr only) comes from mtx's download cache, fetched into it first if
    needed; `data_dir` itself is never written."""

    def both(folder: Path) -> tuple[Path, Path]:
        return split_file(folder, split, src_lang), split_file(folder, split, tgt_lang)

    try:
        return both(data_dir)
    except DataError:
        if split not in MULTI30K_TESTS:
            raise
    has = MULTI30K_TESTS[split]
    for lang, other in ((src_lang, tgt_lang), (tgt_lang, src_lang)):
        if lang in has:
            continue
        if _find_split_file(data_dir, split, lang) is None:
            raise DataError(
                f"{data_dir}: no {split}.{lang}, and Multi30k's {split} has no {lang!r} side (it has {', '.join(has)})"
            )
        # the user's own side in a language Multi30k's set lacks: the other is theirs to give too
        # (stop 67: the error named the side that was there)
        raise DataError(f"{data_dir}: no {split}.{other} beside {split}.{lang}; put it there, or pass --src/--ref")
    cache = multi30k_cache()
    # said each time, not only when fetched (stop 61: a run on the user's own corpus, whose data
    # directory has no test_2016_flickr, was scored on Multi30k's from the cache without a word)
    log.warning(
        "%s is not in %s: the official Multi30k %s is scored, from %s (fetched there first if not there)",
        split,
        data_dir,
        split,
        cache,
    )
    try:
        return both(cache)
    except DataError:
        pass
    # only the side the cache lacks (stop 67: both were fetched again, and both named)
    lacking = [lang for lang in dict.fromkeys((src_lang, tgt_lang)) if _find_split_file(cache, split, lang) is None]
    names = " and ".join(f"{split}.{lang}.gz" for lang in lacking)
    download_multi30k(
        cache, [(split, lang) for lang in lacking], f"put {names} in {data_dir} or {cache}, or pass --src/--ref"
    )
    return both(cache)


def load_corpus(data_dir: Path, cfg: DataConfig, splits: Sequence[str]) -> datasets.DatasetDict:
    """Load the given splits as a `datasets.DatasetDict` with `src` and `tgt` text columns."""
    import datasets

    out = {}
    for split in splits:
        src, tgt = read_parallel(split_file(data_dir, split, cfg.src_lang), split_file(data_dir, split, cfg.tgt_lang))
        out[split] = datasets.Dataset.from_dict({"src": src, "tgt": tgt})
    return datasets.DatasetDict(out)


def extra_source_texts(data_dir: Path, cfg: DataConfig) -> tuple[list[str], list[str]]:
    """The train split's pairs from each of `cfg.extra_src_langs` to the target language, one
    language after the other (many-to-one training, train.extra_sources); none when unset."""
    src: list[str] = []
    tgt: list[str] = []
    for lang in cfg.extra_src_langs:
        lines = read_parallel(
            split_file(data_dir, cfg.train_split, lang), split_file(data_dir, cfg.train_split, cfg.tgt_lang)
        )
        src += lines[0]
        tgt += lines[1]
    return src, tgt


def texts(split: datasets.Dataset) -> tuple[list[str], list[str]]:
    """(source lines, target lines) of a loaded split as plain lists."""
    columns = split.to_dict()
    return columns["src"], columns["tgt"]


@dataclass
class Batch:
    """Padded id tensors of one batch. src ends with EOS; tgt_in = BOS + y; tgt_out = y + EOS."""

    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T)
    tgt_out: torch.Tensor  # (B, T)
    n_src_tokens: int
    n_tgt_tokens: int

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(
            self.src.to(device, non_blocking=nb),
            self.tgt_in.to(device, non_blocking=nb),
            self.tgt_out.to(device, non_blocking=nb),
            self.n_src_tokens,
            self.n_tgt_tokens,
        )


def pad_ids(seqs: Sequence[Sequence[int]], prefix: int | None = None, suffix: int | None = None) -> torch.Tensor:
    """Right-pad id lists into a (B, L) LongTensor, optionally adding a first/last token."""
    import torch

    extra = (prefix is not None) + (suffix is not None)
    width = max(len(s) for s in seqs) + extra
    out = np.full((len(seqs), width), PAD, dtype=np.int64)
    for i, s in enumerate(seqs):
        start = 0
        if prefix is not None:
            out[i, 0] = prefix
            start = 1
        out[i, start : start + len(s)] = s
        if suffix is not None:
            out[i, start + len(s)] = suffix
    return torch.from_numpy(out)


class ParallelIds:
    """A tokenised split: id lists per sentence, and the lengths batching sorts by."""

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], rows: list[int] | None = None) -> None:
        self.src_ids = src_ids
        self.tgt_ids = tgt_ids
        self.rows = rows if rows is not None else list(range(len(src_ids)))  # `encode`: the input pairs kept
        self.src_lens = np.array([len(s) + 1 for s in src_ids], dtype=np.int64)  # + EOS
        self.tgt_lens = np.array([len(t) + 1 for t in tgt_ids], dtype=np.int64)  # + BOS/EOS

    @classmethod
    def encode(
        cls, src: Sequence[str], tgt: Sequence[str], src_tok: BPE, tgt_tok: BPE, max_len: int = 0, read: int = 0
    ) -> ParallelIds:
        """Tokenise; with max_len > 0, drop pairs longer than max_len tokens on either side (`rows`:
        the indices of the pairs kept). A line far longer than max_len pieces, or than `read`, the
        most pieces of a line its readers use where max_len is 0, is cut before it is tokenised
        (`BPE.encode_batch`)."""
        cut = max_len or read
        src_ids, tgt_ids = src_tok.encode_batch(src, cut), tgt_tok.encode_batch(tgt, cut)
        keep = list(range(len(src_ids)))
        if max_len:
            keep = [i for i in keep if len(src_ids[i]) <= max_len and len(tgt_ids[i]) <= max_len]
            if len(keep) < len(src_ids):
                log.info("skipped %d pairs longer than %d tokens", len(src_ids) - len(keep), max_len)
            src_ids = [src_ids[i] for i in keep]
            tgt_ids = [tgt_ids[i] for i in keep]
        return cls(src_ids, tgt_ids, keep)

    def resegmented(
        self, src: Sequence[str], tgt: Sequence[str], src_tok: BPE, tgt_tok: BPE, max_len: int
    ) -> ParallelIds:
        """These pairs (`src`, `tgt`: their texts) tokenised again, by tokenizers with BPE-dropout;
        a pair whose new pieces exceed max_len on either side, or leave a side empty (a model's
        translation decoded to nothing but special pieces), keeps its pieces here, so that every
        epoch trains on the same pairs, the long ones too.

        (stop 63: each epoch's dropout segmentation was filtered by data.max_len again; its pieces
        are more, so the longest pairs dropped out, 24% of train at max_len 40 and dropout 0.3)"""
        src_ids, tgt_ids = src_tok.encode_batch(src), tgt_tok.encode_batch(tgt)
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
            if len(s) > max_len or len(t) > max_len or not s or not t:
                src_ids[i], tgt_ids[i] = self.src_ids[i], self.tgt_ids[i]
        return ParallelIds(src_ids, tgt_ids)

    def __len__(self) -> int:
        return len(self.src_ids)

    def both_ways(self) -> ParallelIds:
        """Every pair src->tgt, then every pair reversed, tgt->src (one joint vocabulary)."""
        return ParallelIds(self.src_ids + self.tgt_ids, self.tgt_ids + self.src_ids)

    def __add__(self, other: ParallelIds) -> ParallelIds:
        """These pairs, then `other`'s."""
        return ParallelIds(self.src_ids + other.src_ids, self.tgt_ids + other.tgt_ids)

    def target_vocabulary(self) -> torch.Tensor:
        """Sorted ids of the target pieces that occur (`model.restrict_output`)."""
        import torch

        return torch.tensor(sorted({i for s in self.tgt_ids for i in s}), dtype=torch.long)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat int32 ids and per-sentence lengths of both sides (for a checkpoint)."""
        import torch

        out = {}
        for side, ids in (("src", self.src_ids), ("tgt", self.tgt_ids)):
            out[side] = torch.tensor([i for s in ids for i in s], dtype=torch.int32)
            out[f"{side}_lens"] = torch.tensor([len(s) for s in ids], dtype=torch.int64)
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> ParallelIds:
        """Inverse of `to_tensors`."""
        sides = []
        for side in ("src", "tgt"):
            ends = np.cumsum(t[f"{side}_lens"].numpy())
            sides.append([a.tolist() for a in np.split(t[side].numpy(), ends[:-1])])
        return cls(*sides)

    def batch(self, indices: Sequence[int]) -> Batch:
        src = [self.src_ids[i] for i in indices]
        tgt = [self.tgt_ids[i] for i in indices]
        return Batch(
            src=pad_ids(src, suffix=EOS),
            tgt_in=pad_ids(tgt, prefix=BOS),
            tgt_out=pad_ids(tgt, suffix=EOS),
            n_src_tokens=int(self.src_lens[indices].sum()),
            n_tgt_tokens=int(self.tgt_lens[indices].sum()),
        )


def plan_batches(
    src_lens: np.ndarray, tgt_lens: np.ndarray, batch_tokens: int, seed: int | None = None
) -> list[np.ndarray]:
    """Group sentence indices into batches of at most `batch_tokens` padded tokens per side.

    Sentences are sorted by source length and, within equal source lengths, by target length
    in alternating direction (so neighbouring groups meet at similar target lengths); equal keys
    are shuffled by `seed`, and so is the order of the batches. Without a seed the plan is fixed.
    """
    n = len(src_lens)
    rng = np.random.default_rng(seed) if seed is not None else None
    tie = rng.random(n) if rng is not None else np.arange(n)
    snake = np.where(src_lens % 2 == 0, tgt_lens, -tgt_lens)
    order = np.lexsort((tie, snake, src_lens))
    batches: list[np.ndarray] = []
    start, max_s, max_t = 0, 0, 0
    for pos, idx in enumerate(order):
        s, t = int(src_lens[idx]), int(tgt_lens[idx])
        new_s, new_t = max(max_s, s), max(max_t, t)
        if pos > start and max(new_s, new_t) * (pos - start + 1) > batch_tokens:
            batches.append(order[start:pos])
            start, new_s, new_t = pos, s, t
        max_s, max_t = new_s, new_t
    if start < n:
        batches.append(order[start:])
    if rng is not None:
        rng.shuffle(batches)
    return batches


def padding_fraction(data: ParallelIds, batches: Sequence[np.ndarray]) -> float:
    """Share of padded positions over both sides, for a batch plan."""
    real = padded = 0
    for b in batches:
        s, t = data.src_lens[b], data.tgt_lens[b]
        real += int(s.sum() + t.sum())
        padded += len(b) * int(s.max() + t.max())
    return 1.0 - real / max(padded, 1)


def epoch_plan(data: ParallelIds, batch_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """One training epoch's batch plan (all ranks'), shuffled by (seed, epoch)."""
    return plan_batches(data.src_lens, data.tgt_lens, batch_tokens, seed=seed * 100003 + epoch)


def median_batch(data: ParallelIds, batch_tokens: int) -> Batch:
    """A batch of `batch_tokens` of median length: the middle one of the plan without a seed, which
    is in length order (the training pass that `train.amp: auto` times on a CPU)."""
    plan = plan_batches(data.src_lens, data.tgt_lens, batch_tokens)
    return data.batch(plan[len(plan) // 2])


def epoch_batches(
    data: ParallelIds,
    batch_tokens: int,
    seed: int,
    epoch: int,
    start: int = 0,
    rank: int = 0,
    world_size: int = 1,
    plan: list[np.ndarray] | None = None,
) -> Iterator[Batch]:
    """The batches of one training epoch from batch index `start`, shuffled by (seed, epoch);
    `plan`, where given, is that epoch's `epoch_plan` (made once by a caller that also counts it).

    With several ranks, each takes a disjoint, equally long share of the epoch's batches, dealt
    round-robin (the last `len(plan) % world_size` batches are dropped): after `start` batches on
    every rank exactly the first `start * world_size` batches of the plan have been used, so a
    run can resume on another number of ranks.
    """
    if plan is None:
        plan = epoch_plan(data, batch_tokens, seed, epoch)
    per_rank = len(plan) // world_size
    for indices in plan[rank : per_rank * world_size : world_size][start:]:
        yield data.batch(indices)


def epoch_length(data: ParallelIds, batch_tokens: int, seed: int, epoch: int, world_size: int = 1) -> int:
    """The number of batches each of `world_size` ranks takes from one epoch."""
    return len(epoch_plan(data, batch_tokens, seed, epoch)) // world_size
