"""The decoding benchmark's own claims: the same outputs with and without the cache, and the
whole-vocabulary rows it adds for a run with a restricted softmax."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_decode.py"


def _bench(run: Path) -> tuple[list[str], dict]:
    args = [sys.executable, str(SCRIPT), "--run", str(run), "--sentences", "24", "--batch-sentences", "8"]
    lines = subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()
    return lines, json.loads(lines[-1])


def test_bench_decode_times_the_whole_vocabulary_beside_a_restricted_softmax(tiny_restricted_run: Path) -> None:
    lines, result = _bench(tiny_restricted_run)
    assert result["cached_equals_uncached"] == {"greedy": True, "beam5": True}
    assert result["greedy_tok_per_s"] > 0 and result["beam5_tok_per_s"] > 0
    assert set(result["restricted_output_speedup"]) == {"greedy", "beam5"}
    assert all(ratio > 0 for ratio in result["restricted_output_speedup"].values())
    # the whole-vocabulary copy keeps the other pieces at -inf: the same outputs, short of float ties
    assert all(share >= 0.9 for share in result["restricted_output_identical"].values())
    assert any(line.startswith("beam 5, whole vocab") for line in lines)
    assert any(line.startswith("restricted softmax:") for line in lines)


def test_bench_decode_adds_no_whole_vocabulary_rows_to_a_whole_vocabulary_run(tiny_run: Path) -> None:
    lines, result = _bench(tiny_run)
    assert result["cached_equals_uncached"] == {"greedy": True, "beam5": True}
    assert result["restricted_output_speedup"] is None and result["restricted_output_identical"] is None
    assert not any("whole vocab" in line for line in lines)
