"""Where training and decoding run: the device, the ranks of a torchrun job and their process
group, and mixed precision (the autocast dtype, and whether this CPU multiplies faster in bf16)."""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mtx.errors import MtxError


def pick_device(name: str, key: str = "train.device") -> torch.device:
    """`auto` prefers cuda, then mps, then cpu; explicit names are checked (errors name `key`)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MtxError(f"{key}: unknown device {name!r} (use auto, cpu, cuda, cuda:N or mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MtxError(f"{key}: cuda requested but no CUDA device is available (use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise MtxError(
                f"{key}: {name} but this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise MtxError(f"{key}: mps requested but this machine has no usable MPS device (use auto or cpu)")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise MtxError(f"{key}: unsupported device {name!r} (use auto, cpu, cuda, cuda:N or mps)")
    return device


# Collectives wait this long for a rank before the job fails instead of hanging; the longest
# legitimate waits are for rank 0's work alone: checkpoint writes and scoring the val translations.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun job; rank 0 of 1 when started without torchrun."""

    rank: int = 0
    local_rank: int = 0  # rank on this machine: the CUDA device index
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Ranks:
        """RANK, LOCAL_RANK and WORLD_SIZE as torchrun sets them."""
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        try:
            rank, local_rank, world_size = (int(os.environ.get(n, d)) for n, d in zip(names, (0, 0, 1), strict=True))
        except ValueError:
            raise MtxError("RANK, LOCAL_RANK and WORLD_SIZE must be integers (torchrun sets them)") from None
        if world_size < 1 or not 0 <= rank < world_size:
            raise MtxError(f"RANK {rank} and WORLD_SIZE {world_size} do not fit (torchrun sets them)")
        return cls(rank, local_rank, world_size)


def rank_device(name: str, ranks: Ranks) -> torch.device:
    """`pick_device`, except that under torchrun each process takes cuda:LOCAL_RANK (or the cpu)."""
    device = pick_device(name)
    if ranks.world_size == 1:
        return device
    if device.type == "cuda":
        if name not in ("auto", "cuda"):
            raise MtxError(f"train.device: {name} under torchrun; use cuda or auto (rank r takes cuda:LOCAL_RANK)")
        if ranks.local_rank >= torch.cuda.device_count():
            raise MtxError(
                f"LOCAL_RANK {ranks.local_rank} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                "start at most that many processes per node (--nproc_per_node)"
            )
        return torch.device("cuda", ranks.local_rank)
    if device.type != "cpu":
        raise MtxError(f"train.device: distributed training runs on cuda or cpu, not {device.type}")
    return device


def barrier(ranks: Ranks, device: torch.device) -> None:
    """Wait until every rank is here (nothing to wait for in a single process)."""
    if ranks.world_size > 1:
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


LAUNCHER_POLL = 0.5  # seconds between a torchrun rank's looks at whether torchrun still runs


def stop_with_launcher(poll: float = LAUNCHER_POLL) -> threading.Thread | None:
    """Under torchrun: a daemon thread that sends this rank SIGTERM once, when torchrun's process
    has ended, as by `kill -9` (torchrun passes its own SIGTERM and SIGINT on, but a killed torchrun
    cannot, and its ranks trained on, holding the run directory's lock: stop 68's probe). The rank
    then stops as on any SIGTERM: every rank at the same step, last.pt saved. (Linux's parent-death
    signal, tried first, came once for each of torchrun's threads as they ended, and a rank read
    the second as a second Ctrl-C: stopped without saving.) None where not under torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.name != "posix":
        return None
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:  # an orphan's parent becomes a reaper
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="mtx torchrun watch", daemon=True)
    thread.start()
    return thread


def start_process_group(device: torch.device, ranks: Ranks) -> None:
    """NCCL on CUDA, gloo on CPU; the rendezvous address comes from torchrun's environment."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:  # (stop 64: torch's 31-line traceback for a WORLD_SIZE left from another job)
        raise MtxError(
            f"WORLD_SIZE={ranks.world_size} is set but {' and '.join(missing)} not: start multi-process training "
            "with torchrun, or unset WORLD_SIZE and RANK"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )


def amp_dtype(device: torch.device, amp: str) -> torch.dtype | None:
    """Autocast dtype for `train.amp` on this device; None means plain fp32."""
    if amp == "fp32":
        return None
    if device.type == "cuda":
        if amp == "fp16":
            return torch.float16
        # bf16 where the GPU computes in it (Ampere on), else fp16 and its scaler: since torch 2.3
        # `is_bf16_supported()` also says True where bf16 is only emulated, slowly (stop 63: a T4
        # or V100 trained in emulated bf16, the fp16 path never taken)
        with torch.cuda.device(device):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
            asked = amp == "bf16" and torch.cuda.is_bf16_supported()  # emulated, if asked for by name
        return torch.bfloat16 if native or asked else torch.float16
    if device.type == "cpu":
        if amp == "fp16":
            raise MtxError("train.amp: fp16 is for CUDA; on CPU use bf16, fp32 or auto")
        if amp == "auto" and cpu_bf16_speedup() < BF16_MIN_SPEEDUP:
            return None
        return torch.bfloat16
    if amp == "fp16":  # (stop 63: trained in bf16 without a word, where CPU refused)
        raise MtxError(f"train.amp: fp16 is for CUDA; on {device.type} use bf16, fp32 or auto")
    return None if amp == "auto" else torch.bfloat16


# bf16 autocast pays for its casts only where bf16 products are well ahead: training went 1.48-1.73x
# faster on Zen 4 (products 2.5x) and 1.14-1.57x with AMX (5.5-9x), but 0.66x on a Xeon whose bf16
# products ran at 0.55x float32's (docs/speed.md, stops 27, 35 and 45)
BF16_MIN_SPEEDUP = 1.5


@functools.cache
def cpu_bf16_speedup() -> float:
    """How many times faster this CPU multiplies in bf16 than in float32 on torch's threads
    (best of 5 timings of a 512 x 256 x 1024 product, under 0.1 s once per process), or 0.0
    where it has no native bf16 (AVX2: emulated, many times slower).

    Native bf16 is not enough: a CPU with AVX-512 BF16 but no AMX tiles (or tiles that a
    hypervisor hides) can run bf16 products slower than float32 ones."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0.0
    best = {torch.float32: math.inf, torch.bfloat16: math.inf}
    # its own generator: torch's, drawn from, moved a resumed run's dropout masks off a straight
    # run's where `train.amp: bf16` timed here after last.pt's state was restored (stop 68's probe)
    own = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pairs = {
            dtype: (torch.randn(512, 256, generator=own).to(dtype), torch.randn(1024, 256, generator=own).to(dtype))
            for dtype in best
        }
        for x, w in pairs.values():
            torch.nn.functional.linear(x, w)  # oneDNN builds its kernel on the first call
        for _ in range(5):  # the two types alternate, so that noise on a shared machine hits both
            for dtype, (x, w) in pairs.items():
                start = time.perf_counter()
                for _ in range(3):
                    torch.nn.functional.linear(x, w)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


# where bf16 products are fast, train.amp auto also needs the model's own training pass this much
# faster in bf16. The pass, timed alone, runs ahead of whole training steps (the optimizer's update
# stays fp32, and a run's batches come in many shapes, each a new bf16 kernel). On stop 71's Xeon
# with AMX: d_model 64 (tiny) passes 0.89-0.91x, trained 0.44x (stop 70); the de->en config's
# d_model 128 1.14-1.39x, trained 0.77x over 400 steps with oneDNN's default cache, and 1.06-1.12x
# at 2.9x the peak memory with mtx's larger one (stop 72); d_model 256 1.98x, trained 1.3x
BF16_MIN_STEP_SPEEDUP = 1.5


def bf16_step_speedup(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> float:
    """How many times faster a training pass of `model` (`step()`: its forward to the loss, then
    the backward) runs under bf16 autocast than in float32 on the CPU: best of 2 after a warm-up
    each, the two alternating so that a shared machine's noise hits both. The random generators
    (dropout's) and the gradients (none) are left as they were."""
    best = {False: math.inf, True: math.inf}
    with torch.random.fork_rng(devices=[]):
        for rep in range(3):
            for bf16 in best:
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = step()
                loss.backward()
                if rep:
                    best[bf16] = min(best[bf16], time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
    return best[False] / best[True]


def auto_cpu_amp(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> tuple[torch.dtype | None, float | None]:
    """`train.amp: auto` on the CPU for `model`: bf16 where this CPU's bf16 products are fast
    (`cpu_bf16_speedup`) and a training pass of the model (`bf16_step_speedup`) then runs at least
    BF16_MIN_STEP_SPEEDUP times as fast as in float32, else None (float32); with the pass's
    measured speedup, None where the products already said float32 (not timed)."""
    if amp_dtype(torch.device("cpu"), "auto") is None:
        return None, None
    speedup = bf16_step_speedup(model, step)
    return (torch.bfloat16 if speedup >= BF16_MIN_STEP_SPEEDUP else None), speedup


def slow_bf16(device: torch.device) -> str | None:
    """How this CPU runs bf16 products where they are slower than float32's ("emulated (no native
    bf16)", "at 0.55x the speed of fp32"), for a warning; None where they are not, or off the CPU."""
    speed = cpu_bf16_speedup() if device.type == "cpu" else 1.0
    if speed >= 1:
        return None
    return f"at {speed:.2f}x the speed of fp32" if speed else "emulated (no native bf16)"


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[Any]:
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
