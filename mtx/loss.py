"""The training loss: label-smoothed cross-entropy (summed over target tokens, with R-Drop's
symmetric KL term where train.rdrop is set), computed in row blocks so that the (tokens x vocab)
probabilities are never held whole."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mtx.data import Batch
from mtx.model import Seq2Seq, make_src_mask
from mtx.tokenizer import PAD


def label_smoothed_loss(model: Seq2Seq, batch: Batch, smoothing: float) -> torch.Tensor:
    """Sum of label-smoothed cross-entropy over the non-padding target positions.

    Only non-padding decoder states are projected to the vocabulary (the V-way projection
    and softmax are the most expensive part of the step)."""
    src_mask = make_src_mask(batch.src)
    memory = model.encode(batch.src, src_mask)
    states = model.decoder_states(batch.tgt_in, memory, src_mask)  # (B, T, D)
    keep = batch.tgt_out != PAD
    states, target = states[keep], model.output_columns(batch.tgt_out[keep])  # (N, D), (N,)
    weight = model.output_weight
    if states.device.type == "cpu" and not torch.compiler.is_compiling():
        device = states.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else states.dtype
        need_grad = torch.is_grad_enabled() and (states.requires_grad or weight.requires_grad)
        return ProjectedSmoothedCrossEntropy.apply(states.to(dtype), weight.to(dtype), target, smoothing, need_grad)
    return SmoothedCrossEntropy.apply(model.project(states), target, smoothing)  # (N, V) logits


def rdrop_loss(model: Seq2Seq, batch: Batch, smoothing: float, alpha: float) -> torch.Tensor:
    """R-Drop (Liang et al., 2021): the batch passes through the model twice in one forward, with
    independent dropout masks; the loss is the mean of the two passes' summed label-smoothed
    cross-entropies plus `alpha` / 4 times the summed symmetric KL divergence between their
    output distributions (the paper's CE1 + CE2 + alpha / 2 (KL(P1||P2) + KL(P2||P1)), halved so
    that the cross-entropy keeps the scale of `label_smoothed_loss`). Each step costs about twice
    as much. On CPU the projection and loss are fused (`ProjectedRDropLoss`, in float32); elsewhere
    the (2, N, V) log-probabilities are materialised."""
    src, tgt_in = torch.cat([batch.src, batch.src]), torch.cat([batch.tgt_in, batch.tgt_in])
    src_mask = make_src_mask(src)
    states = model.decoder_states(tgt_in, model.encode(src, src_mask), src_mask)  # (2B, T, D)
    keep = batch.tgt_out != PAD
    states = states.unflatten(0, (2, -1))[:, keep]  # (2, N, D)
    target = model.output_columns(batch.tgt_out[keep])[:, None]  # (N, 1)
    weight = model.output_weight
    if states.device.type == "cpu" and not torch.compiler.is_compiling():
        need_grad = torch.is_grad_enabled() and (states.requires_grad or weight.requires_grad)
        return ProjectedRDropLoss.apply(states.float(), weight.float(), target, smoothing, alpha, need_grad)
    return _rdrop_of_logits(model.project(states), target, smoothing, alpha)


def _rdrop_of_logits(logits: torch.Tensor, target: torch.Tensor, smoothing: float, alpha: float) -> torch.Tensor:
    """The R-Drop loss of (2, N, V) logits of two passes and (N, 1) target columns."""
    logp = logits.float().log_softmax(dim=-1)
    nll = -(1.0 - smoothing) * logp.gather(2, target.expand(2, -1, -1)).sum() - smoothing * logp.mean(dim=-1).sum()
    kl = ((logp[0].exp() - logp[1].exp()) * (logp[0] - logp[1])).sum()  # KL(P1||P2) + KL(P2||P1)
    return nll / 2 + alpha / 4 * kl


def training_loss(compiled: bool, rdrop: float = 0.0) -> Callable[[Seq2Seq, Batch, float], torch.Tensor]:
    """The loss function training calls: `label_smoothed_loss` (`rdrop_loss` with weight
    `rdrop` > 0), or with `train.compile` that function compiled with the model inside
    (compiling the model alone would compile only `forward`, which training does not call).
    scripts/bench_train.py times this same object."""
    loss = label_smoothed_loss if rdrop == 0 else functools.partial(rdrop_loss, alpha=rdrop)
    return torch.compile(loss) if compiled else loss


def _smoothed_block_loss(lse: torch.Tensor, picked: torch.Tensor, mean: torch.Tensor, eps: float) -> torch.Tensor:
    """Summed smoothed loss of a block of rows from its logsumexp, target logit and mean logit."""
    return ((1.0 - eps) * (lse - picked) + eps * (lse - mean)).sum()


def _smoothed_block_grad_(probs: torch.Tensor, target: torch.Tensor, eps: float, scale: float = 1.0) -> None:
    """(R, V) softmax -> in place, the loss gradient: softmax minus (`scale` times) the smoothed
    one-hot of (R, 1) target."""
    probs.sub_(scale * eps / probs.shape[1]).scatter_add_(
        1, target, torch.full(target.shape, scale * (eps - 1.0), dtype=probs.dtype, device=probs.device)
    )


def _loss_block_rows(device: torch.device) -> int:
    """Rows per block of `SmoothedCrossEntropy`: 128 on the CPU, where an (R, V) block stays in
    cache; elsewhere a few large blocks, since each block costs a handful of kernel launches."""
    return 128 if device.type == "cpu" else 8192


class SmoothedCrossEntropy(torch.autograd.Function):
    """Sum of label-smoothed cross-entropy of (N, V) logits, fused and chunked over rows.

    Same value and gradient as `F.cross_entropy(logits.float(), target, label_smoothing=eps,
    reduction="sum")`, but each block of rows is upcast, reduced and differentiated while it is
    in cache, and the gradient (softmax - smoothed one-hot) is written once in the logits' dtype:
    the unfused version makes about ten full passes over the N x V matrix."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
        ctx.smoothing = smoothing
        if torch.compiler.is_compiling():  # `train.compile`: one functional block (see `_compiled_grad`)
            with torch.autocast(logits.device.type, enabled=False):
                z = logits.float()
                lse = torch.logsumexp(z, dim=-1)
                total = _smoothed_block_loss(lse, z.gather(1, target[:, None]).squeeze(1), z.mean(dim=-1), smoothing)
            ctx.save_for_backward(logits, target, lse)
            return total
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        block = _loss_block_rows(logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for i in range(0, logits.shape[0], block):
                z = logits[i : i + block].float()  # (R, V)
                rows_lse = torch.logsumexp(z, dim=-1)
                lse[i : i + block] = rows_lse
                picked = z.gather(1, target[i : i + block, None]).squeeze(1)
                total += _smoothed_block_loss(rows_lse, picked, z.mean(dim=-1), smoothing)
        ctx.save_for_backward(logits, target, lse)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, target, lse = ctx.saved_tensors
        eps = ctx.smoothing
        if torch.compiler.is_compiling():
            return SmoothedCrossEntropy._compiled_grad(logits, target, lse, eps, grad), None, None
        out = torch.empty_like(logits)
        in_place = logits.dtype == torch.float32  # softmax in `out` itself: no (R, V) temporaries (1.4x)
        block = _loss_block_rows(logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for i in range(0, logits.shape[0], block):
                rows = slice(i, i + block)
                if in_place:
                    p = torch.sub(logits[rows], lse[rows, None], out=out[rows]).exp_()  # softmax (R, V)
                else:
                    p = torch.exp(logits[rows].float() - lse[rows, None])
                _smoothed_block_grad_(p, target[rows, None], eps)
                p.mul_(grad)
                if not in_place:
                    out[rows] = p
        return out, None, None

    @staticmethod
    def _compiled_grad(
        logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, eps: float, grad: torch.Tensor
    ) -> torch.Tensor:
        """The gradient as `torch.compile` traces it: whole, with no writes into slices of a
        buffer. Traced, the blocked version's writes into `out[rows]` gave wrong gradients (zeros)
        under torch 2.11 on the CPU in fp32 (its inductor has known wrong gradients around slice
        writes); inductor fuses and tiles this form itself."""
        with torch.autocast(logits.device.type, enabled=False):
            p = torch.exp(logits.float() - lse[:, None])
            _smoothed_block_grad_(p, target[:, None], eps)
            return (p * grad).to(logits.dtype)


class ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """`SmoothedCrossEntropy` of the logits `states @ weight.T`, computed block by block of rows
    so that the (N, V) logits never exist whole (CPU).

    Each block's logits go into one reused (R, V) buffer and are reduced and turned into the
    gradient in place while in cache; the gradients of `states` and `weight` are computed in the
    forward (the loss is the last node of the graph) and scaled in the backward. Materialising
    the (N, V) logits and their gradient instead meant two fresh ~130 MB buffers per step, whose
    first touch (page faults) cost more than the arithmetic on them."""

    ROWS = 256

    @staticmethod
    def forward(
        ctx: Any, states: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, smoothing: float, need_grad: bool
    ) -> torch.Tensor:
        n, vocab = states.shape[0], weight.shape[0]
        rows = ProjectedSmoothedCrossEntropy.ROWS
        total = torch.zeros((), dtype=torch.float32, device=states.device)
        d_states = torch.empty_like(states) if need_grad else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        buffer = torch.empty(min(rows, n), vocab, dtype=states.dtype, device=states.device)
        with torch.autocast(states.device.type, enabled=False):
            for i in range(0, n, rows):
                h, t = states[i : i + rows], target[i : i + rows, None]  # (R, D), (R, 1)
                z = torch.mm(h, weight.t(), out=buffer[: h.shape[0]]).float()  # (R, V) logits
                picked, mean, top = z.gather(1, t), z.mean(dim=-1, keepdim=True), z.amax(dim=-1, keepdim=True)
                e = z.sub_(top).exp_()  # in place: logsumexp would allocate an (R, V) temporary
                norm = e.sum(dim=-1, keepdim=True)
                lse = top + norm.log()
                total += _smoothed_block_loss(lse, picked, mean, smoothing)
                if d_states is None or d_weight is None:
                    continue
                g = e.div_(norm)  # softmax
                _smoothed_block_grad_(g, t, smoothing)
                g = g.to(states.dtype)
                torch.mm(g, weight, out=d_states[i : i + rows])
                if d_weight.dtype == g.dtype:
                    d_weight.addmm_(g.t(), h)
                else:  # low precision: products in it, the sum over blocks in float32
                    d_weight += torch.mm(g.t(), h)
        ctx.save_for_backward(d_states, d_weight)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        d_states, d_weight = ctx.saved_tensors
        if d_states is None:
            raise RuntimeError("ProjectedSmoothedCrossEntropy was called with need_grad=False")
        return d_states * grad.to(d_states.dtype), (d_weight * grad).to(d_states.dtype), None, None, None


class ProjectedRDropLoss(torch.autograd.Function):
    """`rdrop_loss` of (2, N, D) float32 states of two passes and a (V, D) output weight, fused
    block by block of rows on CPU like `ProjectedSmoothedCrossEntropy` (the unfused loss over
    materialised (2, N, V) log-probabilities made a d_model 128 step 3.7x as slow as without R-Drop).

    With log-probabilities l1, l2, probabilities p1, p2, d = l1 - l2 and the symmetric KL
    sum(p1 - p2) * d, the gradient of the KL term with respect to the first pass's logits is
    p1 * (d - E_p1[d]) + (p1 - p2), and with respect to the second's -p2 * (d - E_p2[d]) - (p1 - p2)."""

    ROWS = 256

    @staticmethod
    def forward(
        ctx: Any,
        states: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        smoothing: float,
        alpha: float,
        need_grad: bool,
    ) -> torch.Tensor:
        n, vocab = states.shape[1], weight.shape[0]
        rows, a4 = ProjectedRDropLoss.ROWS, alpha / 4
        total = torch.zeros((), dtype=torch.float32, device=states.device)
        d_states = torch.empty_like(states) if need_grad else None
        d_weight = torch.zeros_like(weight) if need_grad else None
        l1, l2, p1, p2, g = (torch.empty(min(rows, n), vocab, device=states.device) for _ in range(5))
        with torch.autocast(states.device.type, enabled=False):
            for i in range(0, n, rows):
                h1, h2, t = states[0, i : i + rows], states[1, i : i + rows], target[i : i + rows]
                r = h1.shape[0]
                a, b, q1, q2, gr = l1[:r], l2[:r], p1[:r], p2[:r], g[:r]
                for h, z, q in ((h1, a, q1), (h2, b, q2)):  # z <- log-softmax of the logits, q <- softmax
                    torch.mm(h, weight.t(), out=z)
                    z.sub_(z.amax(dim=-1, keepdim=True))  # shifted logits: their logsumexp is log(norm)
                    picked, mean = z.gather(1, t), z.mean(dim=-1, keepdim=True)
                    norm = torch.exp(z, out=q).sum(dim=-1, keepdim=True)
                    lse = norm.log()
                    total += _smoothed_block_loss(lse, picked, mean, smoothing) / 2
                    z.sub_(lse)
                    q.div_(norm)
                a.sub_(b)  # d = l1 - l2
                torch.sub(q1, q2, out=b)  # delta = p1 - p2
                total += a4 * torch.dot(a.view(-1), b.view(-1))
                if d_states is None or d_weight is None:
                    continue
                for q, sign, h, k in ((q1, 1.0, h1, 0), (q2, -1.0, h2, 1)):
                    expect = torch.bmm(q[:, None, :], a[:, :, None]).view(r, 1)  # E_q[d]
                    torch.sub(a, expect, out=gr).mul_(sign * a4).add_(0.5).mul_(q).add_(b, alpha=sign * a4)
                    _smoothed_block_grad_(gr, t, smoothing, scale=0.5)  # the two cross-entropies' half
                    torch.mm(gr, weight, out=d_states[k, i : i + rows])
                    d_weight.addmm_(gr.t(), h)
        ctx.save_for_backward(d_states, d_weight)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None, None]:
        d_states, d_weight = ctx.saved_tensors
        if d_states is None:
            raise RuntimeError("ProjectedRDropLoss was called with need_grad=False")
        return d_states * grad, d_weight * grad, None, None, None, None


class TokenLoss(torch.nn.Module):
    """A Seq2Seq and its summed label-smoothed loss as one module.

    DistributedDataParallel synchronises the gradients of what its wrapped module's forward
    computed, so the loss, not only the logits, has to come out of a forward. The batch passes
    through DDP unchanged (it must already be on the device)."""

    def __init__(
        self, model: Seq2Seq, loss_fn: Callable[[Seq2Seq, Batch, float], torch.Tensor], smoothing: float
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.smoothing = smoothing

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.loss_fn(self.model, batch, self.smoothing)
