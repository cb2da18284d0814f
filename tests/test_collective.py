"""mtx.collective: what the Trainer's ranks tell each other, on two gloo ranks and in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtx.collective import Collective
from mtx.device import Ranks
from mtx.errors import ConfigError, MtxError


def test_in_one_process_every_call_gives_back_its_own_value() -> None:
    comm = Collective(Ranks(), torch.device("cpu"))
    comm.barrier()
    assert comm.sum([2.0, 3.5]) == [2.0, 3.5]
    assert (comm.largest(4), comm.smallest(4)) == (4, 4)
    assert comm.in_order(["a", "b", "c"], 3) == ["a", "b", "c"]
    assert comm.gathered({"x": 1}) is None
    assert comm.from_main({"k": [1, 2]}) == {"k": [1, 2]}
    assert comm.flag_from_main(True) is True and comm.flag_from_main(False) is False
    assert comm.made_by_main(lambda: [7]) == [7]
    comm.stop_all_where(None, MtxError("never raised"))
    with pytest.raises(ConfigError, match="mine"):
        comm.stop_all_where(ConfigError("mine"), MtxError("other"))


def collective_worker(rank: int, store: Path, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        comm = Collective(Ranks(rank, rank, 2), torch.device("cpu"))
        made: list[int] = []
        items = [f"item{i}" for i in range(5)]  # rank 0 takes 0, 2, 4 and rank 1 takes 1, 3
        seen: dict[str, object] = {
            "sum": comm.sum([1.0 + rank, 2**40 + rank]),  # float64: 2**40 + 1 stays exact
            "largest": comm.largest(10 * rank + 3),
            "smallest": comm.smallest(10 * rank + 3),
            "in_order": comm.in_order(items[rank::2], len(items)),
            "gathered": comm.gathered({"rank": rank}),
            "from_main": comm.from_main(f"from rank {rank}"),
            "flag_from_main": [comm.flag_from_main(rank == 0), comm.flag_from_main(rank == 1)],
            "made_by_main": comm.made_by_main(lambda: made.append(rank) or [rank, 99]),
            "made_here": made,
        }
        comm.stop_all_where(None, MtxError("not raised: no rank has an error"))
        try:
            comm.stop_all_where(ConfigError("rank 1's own") if rank == 1 else None, MtxError("another rank's"))
        except MtxError as e:
            seen["stopped_by"] = str(e)
        comm.barrier()
        (out / f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_on_rank_0s_values_sums_shares_in_order_and_one_ranks_error(tmp_path: Path) -> None:
    mp.spawn(collective_worker, args=(tmp_path / "store", tmp_path), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen["sum"] == [3.0, 2**41 + 1]
        assert (seen["largest"], seen["smallest"]) == (13, 3)
        assert seen["in_order"] == [f"item{i}" for i in range(5)]
        assert seen["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert seen["from_main"] == "from rank 0"
        assert seen["flag_from_main"] == [True, False]
        assert seen["made_by_main"] == [0, 99]
        assert seen["made_here"] == ([0] if rank == 0 else [])  # made on rank 0 alone
        assert seen["stopped_by"] == ("rank 1's own" if rank == 1 else "another rank's")
