"""mtx: train, run and score Transformer translation models on Multi30k."""

import os as _os

__version__ = "0.1.0"

# oneDNN's cache of compiled kernels (1,024 by default, one per operation, shape and type): a
# training run's batches come in many shapes, and with the default bf16 training on a CPU slowed
# down as kernels were evicted and compiled again. At 8,192, stop 72's six runs alternating on a Xeon
# with AMX trained the de->en config 1.29x faster in bf16 with 0.5 GB less memory (docs/speed.md).
ONEDNN_CACHE = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")


def default_onednn_cache() -> str | None:
    """Sets oneDNN's kernel cache to `ONEDNN_CACHE`'s size unless the environment sets it; returns
    the variable's value before (None: unset). oneDNN reads it at its first kernel, so a process
    that has run one keeps the size it had."""
    name, size = ONEDNN_CACHE
    before = _os.environ.get(name)
    _os.environ.setdefault(name, size)
    return before


# checked before torch is imported, which fails there as a broken install would (stop 67: "Intel
# oneMKL FATAL ERROR: Cannot load libtorch_cpu.so")
_GONE = "mtx: error: the working directory no longer exists (it was removed); cd to one that does"
try:
    _os.getcwd()
except FileNotFoundError:
    # a program that imported torch before its directory went can use mtx (stop 68's probe: the
    # import ended that program, past its `except Exception`)
    if "torch" not in __import__("sys").modules:
        raise SystemExit(_GONE) from None
