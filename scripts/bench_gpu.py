"""Decoding speed of a trained run on a GPU, and what each SDPA kernel's first call at a new shape costs.

    python scripts/bench_gpu.py --run runs/bench_d256 [--device cuda] [--sentences N]

Decoding: `mtx.search.translate_ids` (what `mtx eval` runs) over the split's source sentences, fp32
and bf16 weights, greedy and beam 5, with the KV cache at batches of 4,000 and 32,000 source
tokens and without it at 4,000; cached rows take the best of 2 timed passes after a warm-up pass,
uncached ones one pass. Each row is one line of JSON (`same_as_first`: outputs equal to the first
row of its precision and beam). Then, on CUDA, the mean time of the first and of a second call of
`F.scaled_dot_product_attention` with a padding mask at 24 new lengths, each kernel alone: cuDNN
attention builds a plan per shape (190 ms on an H200, stop 46), the reason mtx leaves it out.

The numbers of docs/speed.md's stop-46 section came from this code on an H200 (torch
2.11.0+cu130). `--device cpu` runs it anywhere (the test suite does, on a tiny run).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtx.checkpoint import load_run  # noqa: E402
from mtx.cli import int_in, path_arg, script_parser  # noqa: E402
from mtx.data import resolve_data_dir, split_file  # noqa: E402
from mtx.device import pick_device  # noqa: E402
from mtx.errors import run_script  # noqa: E402
from mtx.search import translate_ids  # noqa: E402
from mtx.text import read_parallel  # noqa: E402


def decode_rows(run_dir: Path, data_dir: Path | None, split: str, sentences: int, device: torch.device) -> None:
    """Print one JSON line per setting (the module docstring's rows)."""
    run = load_run(run_dir, device=device)
    data_dir = data_dir or resolve_data_dir(run.cfg.data)
    # read_parallel refuses an empty split (stop 53: a division by zero after decoding nothing)
    lines, _ = read_parallel(
        *(split_file(data_dir, split, lang) for lang in (run.cfg.data.src_lang, run.cfg.data.tgt_lang))
    )
    src = run.encode_sources(lines)  # as mtx eval reads them
    src = src[:sentences] if sentences else src
    d = run.cfg.decode
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    first: dict[tuple[str, int], list[list[int]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = run.model.to(dtype)
        for beam in (1, 5):
            for cache, batch_tokens in ((True, 4000), (True, 32000), (False, 4000)):
                args = (model, src, beam, d.length_penalty, d.max_len_a, d.max_len_b, batch_tokens)
                if cache:  # warm-up pass
                    translate_ids(*args, use_cache=cache)
                best = float("inf")
                for _ in range(2 if cache else 1):
                    sync()
                    start = time.perf_counter()
                    hyps = translate_ids(*args, use_cache=cache)
                    sync()
                    best = min(best, time.perf_counter() - start)
                tokens = [h[0].tokens for h in hyps]
                n_out = sum(len(t) + 1 for t in tokens)  # + EOS
                key = (str(dtype).removeprefix("torch."), beam)
                same = sum(a == b for a, b in zip(first[key], tokens, strict=True)) if key in first else None
                first.setdefault(key, tokens)
                row = {
                    "dtype": key[0],
                    "beam": beam,
                    "cache": cache,
                    "batch_tokens": batch_tokens,
                    "s": round(best, 3),
                    "sent_per_s": round(len(src) / best, 1),
                    "tok_per_s": round(n_out / best),
                    "mean_len": round(n_out / len(src), 2),
                    "same_as_first": same,
                }
                print(json.dumps(row), flush=True)


def sdpa_first_calls(device: torch.device) -> dict[str, float | str]:
    """Mean ms of the first and second call at each of 24 new lengths, bf16, (64, 4, L, 64), padding mask."""
    result: dict[str, float | str] = {}
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        try:
            firsts, agains = [], []
            for length in range(5, 29):
                q = torch.randn(64, 4, length, 64, device=device, dtype=torch.bfloat16)
                mask = torch.ones(64, 1, 1, length, dtype=torch.bool, device=device)
                with sdpa_kernel([backend]):
                    for times in (firsts, agains):
                        # the device's own stream (stop 63: cuda:0's, whatever --device cuda:N timed)
                        torch.cuda.synchronize(device)
                        start = time.perf_counter()
                        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
                        torch.cuda.synchronize(device)
                        times.append(time.perf_counter() - start)
            result[f"sdpa_{name}_first_ms"] = round(1e3 * sum(firsts) / len(firsts), 3)
            result[f"sdpa_{name}_again_ms"] = round(1e3 * sum(agains) / len(agains), 3)
        except RuntimeError as e:  # a kernel this GPU or torch build lacks
            result[f"sdpa_{name}"] = str(e).splitlines()[0][:200]
    return result


def main() -> None:
    parser = script_parser("bench_gpu", (__doc__ or "").split("\n")[0])
    parser.add_argument("--run", type=path_arg, required=True, help="trained run directory")
    parser.add_argument("--data-dir", type=path_arg, help="folder of the split's files (default: the run's data.dir)")
    parser.add_argument("--split", default="test_2016_flickr", help="the split decoded (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, cpu (default: cuda)")
    parser.add_argument("--sentences", type=int_in(0), default=0, help="first N sentences only (0: all)")
    args = parser.parse_args()
    device = pick_device(args.device, "--device")
    decode_rows(args.run, args.data_dir, args.split, args.sentences, device)
    if device.type == "cuda":
        print(json.dumps(sdpa_first_calls(device)))


if __name__ == "__main__":
    run_script("bench_gpu", main)
