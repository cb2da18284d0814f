"""One cached decoding step through every decoder layer, compiled with TorchScript on CPU.

A cached step of greedy or beam search feeds one token per row through the decoder: at d_model
256 with 3 layers some 650 small operator calls, whose dispatch from Python is much of a step's
time at greedy's batch sizes (stop 30, 1 thread: a fixed 3.6 ms a step against 0.16 ms a row),
and with two decoding threads each call also takes Python's interpreter lock. Compiled with
TorchScript the step runs its calls from C++ without the lock (docs/speed.md, stop 44). The
functions here are plain torch code that TorchScript compiles; where it cannot (a torch without
it), and on CUDA (whose TorchScript fusers may change the arithmetic), the same code runs as
Python; that form passed tests/test_cuda.py on an H200 (stop 46).

Weights arrive as flat lists in the order of `DecoderLayer.step_weights`, with optional prepacked
copies of the linear layers' weights (`Seq2Seq.packed_weights`: with bf16 weights on CPU).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through a weight prepacked by `torch.ops.mkldnn._reorder_linear_weight`."""
    # TorchScript's name for Scalar: the op's `Scalar?[] scalars` takes no list of floats
    scalars: list[number | None] = []  # noqa: F821
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", scalars, "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through `packed` where it holds a copy of the weight in x's dtype."""
    if packed is not None and packed.dtype == x.dtype:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def scale_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """`g * x / ||x||` over the last dimension, the norm in float32 (`mtx.model.ScaleNorm`)."""
    norm = torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True).clamp(min=eps)
    return (x * (gain / norm)).to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, is_scale: bool) -> torch.Tensor:
    """LayerNorm, or ScaleNorm with gain `weight` (then `bias` is not read)."""
    if is_scale:
        return scale_norm(x, weight, eps)
    return F.layer_norm(x, [x.shape[-1]], weight, bias, eps)


def split_heads(x: torch.Tensor, n: int, heads: int) -> list[torch.Tensor]:
    """(B, L, n*D) -> n tensors of (B, H, L, Dh)."""
    b, length, _ = x.shape
    return x.view(b, length, n, heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def select_and_append(past: torch.Tensor, rows: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """`torch.cat([past.index_select(0, rows), new], dim=2)`, on CPU in one copy of `past` instead
    of two (1.4-2x faster for a beam step's 320 rows of 5-20 positions, 1 thread). Elsewhere, and
    where autograd records (out= has no autograd), the two copies."""
    fused = past.device.type == "cpu" and not (torch.is_grad_enabled() and (past.requires_grad or new.requires_grad))
    if rows is None:
        return torch.cat([past, new], dim=2)
    if not fused:
        return torch.cat([past.index_select(0, rows), new], dim=2)
    b, h, t, d = past.shape
    out = past.new_empty(rows.shape[0], h, t + new.shape[2], d)
    torch.index_select(past, 0, rows, out=out[:, :, :t])
    out[:, :, t:] = new
    return out


def _self_attention(
    x: torch.Tensor,
    w: list[torch.Tensor],
    packed: list[torch.Tensor | None],
    past: tuple[torch.Tensor, torch.Tensor] | None,
    rows: torch.Tensor | None,
    heads: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, 1, D) -> its self-attention output and the layer's keys/values with this position."""
    b, _, d = x.shape
    dh = d // heads
    q, k, v = split_heads(linear(x, w[0], w[1], packed[0]).to(dtype), 3, heads)  # (B, H, 1, Dh) each
    if past is not None:
        k, v = select_and_append(past[0], rows, k), select_and_append(past[1], rows, v)  # (B, H, t, Dh)
    s = k.shape[2]
    kt = k.reshape(b * heads, s, dh).transpose(1, 2)
    # beta 0: the input (a view of the right shape, no allocation) is ignored, only the scale applies
    scores = torch.baddbmm(kt[:, :1], q.reshape(b * heads, 1, dh), kt, beta=0.0, alpha=dh**-0.5)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # (B*H, 1, t)
    y = torch.bmm(probs, v.reshape(b * heads, s, dh))  # (B*H, 1, Dh)
    return linear(y.reshape(b, 1, d).to(x.dtype), w[2], w[3], packed[1]), k, v


def _cross_attention(
    x: torch.Tensor,
    w: list[torch.Tensor],
    packed: list[torch.Tensor | None],
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """(B, 1, D) queries to (N, H, S, Dh) cached keys/values, B = N x G: the G rows of a
    sentence's beams share its memory row; `bias` (N, H, 1, S) is 0 / -inf at source padding."""
    b, _, d = x.shape
    dh = d // heads
    n, _, s, _ = k.shape
    group = b // n
    q = linear(x, w[0], w[1], packed[0]).to(k.dtype)  # (B, 1, D)
    if group == 1:
        q = q.view(n * heads, 1, dh)
    else:
        q = q.view(n, group, heads, dh).transpose(1, 2).reshape(n * heads, group, dh)
    kt = k.view(n * heads, s, dh).transpose(1, 2)
    scores = torch.baddbmm(bias.view(n * heads, 1, s), q, kt, alpha=dh**-0.5)  # (N*H, G, S)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    y = torch.bmm(probs, v.reshape(n * heads, s, dh))  # (N*H, G, Dh)
    if group > 1:
        y = y.view(n, heads, group, dh).transpose(1, 2)
    return linear(y.reshape(b, 1, d).to(x.dtype), w[2], w[3], packed[1])


def decoder_step(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    packed: list[torch.Tensor | None],
    self_kv: list[tuple[torch.Tensor, torch.Tensor] | None],
    rows: list[torch.Tensor | None],
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]],
    cross_bias: torch.Tensor,
    heads: int,
    pre_norm: bool,
    is_scale: bool,
    eps: float,
    self_dtype: torch.dtype,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(B, 1, D) embedded tokens -> (B, 1, D) final decoder states, and per layer the
    self-attention keys/values with this position appended (after selecting `rows` of the
    past ones). Per layer, `weights` holds `DecoderLayer.step_weights`' 18 tensors, `packed` 6
    optional packed copies; a pre-norm stack's final norm's weight and bias follow. What `DecoderLayer.forward` computes
    with a cache and one new position, its products as batched products of 3-D views, the
    score scale inside them and the source mask as an additive bias."""
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(len(cross_kv)):
        w = weights[i * 18 : (i + 1) * 18]  # (TorchScript reads no global constants)
        p = packed[i * 6 : (i + 1) * 6]
        h = norm(x, w[0], w[1], eps, is_scale) if pre_norm else x
        y, k, v = _self_attention(h, w[2:6], p[0:2], self_kv[i], rows[i], heads, self_dtype)
        new_kv.append((k, v))
        x = x + y if pre_norm else norm(x + y, w[0], w[1], eps, is_scale)
        h = norm(x, w[6], w[7], eps, is_scale) if pre_norm else x
        y = _cross_attention(h, w[8:12], p[2:4], cross_kv[i][0], cross_kv[i][1], cross_bias, heads)
        x = x + y if pre_norm else norm(x + y, w[6], w[7], eps, is_scale)
        h = norm(x, w[12], w[13], eps, is_scale) if pre_norm else x
        y = linear(F.relu(linear(h, w[14], w[15], p[4])), w[16], w[17], p[5])
        x = x + y if pre_norm else norm(x + y, w[12], w[13], eps, is_scale)
    if pre_norm:  # a pre-norm stack ends in a norm; post-norm outputs are already normalised
        x = norm(x, weights[-2], weights[-1], eps, is_scale)
    return x, new_kv


@functools.cache
def compiled_step() -> Callable[..., tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """`decoder_step` compiled with TorchScript (once per process), or `decoder_step` itself where
    this torch cannot compile it."""
    try:
        with warnings.catch_warnings():  # TorchScript is deprecated in recent torch, and still the fastest here
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(decoder_step)
    except Exception as error:  # noqa: BLE001 (any failure leaves the same code to run as Python)
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        log.info("decoding steps run uncompiled: TorchScript failed (%s)", reason)
        return decoder_step
