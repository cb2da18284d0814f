"""mtx: train, run and score Transformer translation models on Multi30k."""

import os as _os

__version__ = "0.1.0"

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
