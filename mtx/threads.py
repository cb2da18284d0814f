"""The CPUs mtx may use (affinity and a container's cgroup quota, which torch does not read) and
torch's thread count set within them. Imports torch only to set its threads."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")  # where a container sees its own cgroup (v2; v1's cpu controller under cpu/)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the OS tells it, and at most a cgroup
    CPU quota rounded up (`docker --cpus 2`, a Kubernetes CPU limit), which torch's own thread count
    does not read: on a machine of many cores it ran as many threads in a 2-CPU container."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cpus if quota is None else max(1, min(cpus, quota))


def cgroup_cpu_quota(root: Path | None = None) -> int | None:
    """The CPUs of this cgroup's quota, rounded up: cgroup v2's cpu.max ("150000 100000": 2), else
    v1's cpu.cfs_quota_us over cpu.cfs_period_us; None where there is none ("max", -1) or it
    cannot be read (not Linux)."""
    root = CGROUP if root is None else root
    try:
        quota, period = (root / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota, period = ((root / "cpu" / f"cpu.cfs_{name}_us").read_text() for name in ("quota", "period"))
        except OSError:
            return None
    try:
        share = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # "max": no quota
        return None
    return math.ceil(share) if share > 0 else None


def set_threads(threads: int) -> None:
    """torch's CPU threads: `threads`, or where 0 torch's own choice, at most the CPUs mtx may use
    (torch counts the machine's cores, not a container's quota)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    elif torch.get_num_threads() > (cpus := usable_cpus()):
        torch.set_num_threads(cpus)
