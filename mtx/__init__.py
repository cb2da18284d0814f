"""mtx: train, run and score Transformer translation models on Multi30k."""

__version__ = "0.1.0"
