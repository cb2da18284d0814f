"""What the ranks of a torchrun job tell each other while training: rank 0's values and choices,
sums, shares gathered back in order, and errors that stop every rank at once. In a single process
each call is a no-op that returns this process's own value, so the Trainer calls them alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mtx.device import Ranks, barrier
from mtx.errors import MtxError

T = TypeVar("T")


class Collective:
    """The collectives of `ranks`' process group, their tensors on `device` (gloo's CPU, NCCL's
    GPU). Every rank must make the same calls in the same order."""

    def __init__(self, ranks: Ranks, device: torch.device) -> None:
        self.ranks, self.device = ranks, device

    @property
    def alone(self) -> bool:
        return self.ranks.world_size == 1

    def barrier(self) -> None:
        """Wait until every rank is here."""
        barrier(self.ranks, self.device)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of a few numbers over the ranks (float64 keeps token counts exact)."""
        if self.alone:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def largest(self, value: int) -> int:
        """The largest of the ranks' `value`s."""
        return self._reduced(value, dist.ReduceOp.MAX)

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' `value`s."""
        return self._reduced(value, dist.ReduceOp.MIN)

    def _reduced(self, value: int, op: Any) -> int:
        if self.alone:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def in_order(self, mine: list[Any], n: int) -> list[Any]:
        """The `n` items that the ranks share out (rank r takes items r, r + world_size, ...; `mine`
        its own), gathered back in order on every rank."""
        world = self.ranks.world_size
        if world == 1:
            return mine
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, mine)
        return [shares[i % world][i // world] for i in range(n)]

    def gathered(self, mine: Any) -> list[Any] | None:
        """Every rank's `mine` (any picklable object; rank r's at index r), or None in a single process."""
        if self.alone:
            return None
        out: list[Any] = [None] * self.ranks.world_size
        dist.all_gather_object(out, mine)
        return out

    def from_main(self, value: T) -> T:
        """Rank 0's `value` (any picklable object) on every rank."""
        if self.alone:
            return value
        box = [value if self.ranks.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]  # type: ignore[return-value]

    def flag_from_main(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (the others wait here for rank 0), without pickling."""
        if self.alone:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.broadcast(t, src=0)
        return bool(t.item())

    def made_by_main(self, make: Callable[[], T]) -> T:
        """`make()` run on rank 0 only, its result sent to the other ranks."""
        made = self.from_main(make() if self.ranks.is_main else None)
        assert made is not None
        return made

    def stop_all_where(self, mine: MtxError | None, other: MtxError) -> None:
        """Every rank stops where one has an error (`mine`, on that rank): `other` on the rest."""
        if self.alone:
            if mine is not None:
                raise mine
            return
        flag = torch.tensor([float(mine is not None)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if mine is not None:
            raise mine
        if flag.item():
            raise other
