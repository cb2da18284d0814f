"""Encoder-decoder Transformer written from scratch, with a decoder KV cache.

Dimension glossary used in shape comments:
    B batch, S source length, T target length, H heads, Dh head dim (D / H),
    D model dim (d_model), F feed-forward dim (d_ff), V vocabulary size.

Masks are boolean and True where attention is allowed. The source mask has shape (B, 1, 1, S)
and broadcasts over heads and queries; the decoder's causal mask is never materialised:
`scaled_dot_product_attention(is_causal=True)` applies it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtx.config import ModelConfig
from mtx.step import compiled_step, decoder_step, linear, packed_linear, scale_norm, select_and_append, split_heads
from mtx.tokenizer import EOS, PAD, UNK

_CPU_LOW_PRECISION = [SDPBackend.MATH]
# On CPU, attention over at most this many keys runs as explicit products + softmax (measured
# forward + backward, 4,096-token batches, 4 heads of 32: 2.0x / 1.25x / 1.55x faster than SDPA
# at 12 / 22 / 40 keys, even at 80, 0.73x at 160)
CPU_MATH_MAX_KEYS = 64
# cuDNN attention is left out: it builds a plan for every new (batch, length) shape, 190 ms per
# shape against 1.2 ms for the memory-efficient kernel (H200, bf16), and length-bucketed batches
# bring new shapes for hundreds of steps: with it GPU training took 72 s for its first 400 steps,
# without it 15 s, the same losses (docs/speed.md, stop 46)
_ANY_BACKEND = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout. On CPU the keep-mask comes from 16-bit slices of 64-bit random words,
    several times cheaper than `bernoulli_` (which dominated CPU training steps); p is rounded
    to a multiple of 1/65536."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
    threshold = min(round(p * 65536), 65535)  # p just below 1 keeps 1 in 65536, not none (a division by 0)
    keep = words.view(torch.int16)[:n].view(x.shape) >= threshold - 32768
    return x * keep.to(x.dtype).mul_(65536 / (65536 - threshold))


class Dropout(nn.Module):
    """`fixed`: a rate of its own (model.activation_dropout), not model.dropout's, so
    train.dropout_warmup (`mtx.train.set_dropout`) leaves it alone."""

    def __init__(self, p: float, fixed: bool = False) -> None:
        super().__init__()
        self.p = p
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


# Searches on CPU multiply by copies of weights prepacked for oneDNN (the ops torch.compile's CPU
# backend uses for frozen weights), packed once per search call, or once per `translate_ids` call
# for all its batches (`Seq2Seq.packed_weights`): the output weight in float32 and bf16, and with
# bf16 weights every decoder linear layer too. Measured alternating per batch on test_2016_flickr,
# 2 AVX2 cores, identical outputs: the float32 output weight packed, greedy 1.14x and beam 5 1.06x
# faster at d_model 256 with an 8k softmax, 1.10x and 1.08x at d_model 128 with 4,180 outputs.
# Packing every float32 linear layer was slower at d_model 128 (greedy 0.77x): for small products
# oneDNN's ~20 us more per call outweighs its faster kernel. With bf16 weights on Zen 4 (AVX-512
# BF16) the plain product repacks the weight at every call (1-row products of a decoding step:
# 35-59 against 21-28 us), so there every decoder layer is packed: bf16 greedy 1.10x on 1 thread,
# 1.07x as `mtx eval` batches on 2, beam 5 0.99-1.04x (docs/speed.md, stop 30).
_PACK_ROWS_HINT = 64
_can_pack = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
_PACK_LAYERS_DTYPES = (torch.bfloat16,)  # weight types whose decoder layers are packed too


@functools.cache
def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """float32, and bf16 where the CPU has native bf16 (AVX-512 BF16, AMX): elsewhere oneDNN
    would emulate it, and bf16 decoding does not pay there anyway."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An (out, in) CPU weight packed for `mtx.step.packed_linear`, or None where that is not possible
    (another device or dtype, see `_packable_dtypes`, or a torch build whose ops fail: then never
    tried again)."""
    global _can_pack
    if not _can_pack or weight.device.type != "cpu" or weight.dtype not in _packable_dtypes():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
    except RuntimeError:
        _can_pack = False
        return None


def _uses_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    """Whether a product of x may go through `packed`: one for x's dtype, and autograd not
    recording (the packed product has no gradient)."""
    return packed is not None and x.dtype == packed.dtype and not torch.is_grad_enabled()


class Linear(nn.Linear):
    """`nn.Linear` that multiplies by `packed`, a prepacked copy of its weight, where one is set
    (inside `Seq2Seq.packed_weights`) and autograd does not record."""

    packed: torch.Tensor | None = None

    def inference_packed(self) -> torch.Tensor | None:
        """`packed` where autograd does not record (the packed product has no gradient), else None."""
        return None if self.packed is None or torch.is_grad_enabled() else self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.inference_packed())


def make_src_mask(src: torch.Tensor) -> torch.Tensor:
    """(B, S) ids -> (B, 1, 1, S) bool mask, False at padding."""
    return (src != PAD)[:, None, None, :]


class KVCache:
    """Per-layer decoder keys/values: self-attention grows by one step per call, cross-attention
    keys/values are computed from the memory once and then reused. In beam search the K beams
    of a sentence are K self-attention rows but share one row of cross-attention keys/values."""

    def __init__(self, n_layers: int, float32_self: bool = False) -> None:
        """`float32_self`: with 16-bit weights on CPU, self-attention in float32 too (see
        `Attention.forward`), for searches that do not reorder the cache at every step."""
        self.float32_self = float32_self
        self.self_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.cross_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        # (B, H, 1, S) additive source mask (0 / -inf) of the cached decoding steps' cross-attention,
        # made once per batch from its source mask and shared by every layer (`mtx.step.decoder_step`)
        self.cross_bias: torch.Tensor | None = None
        # rows of self_kv[i] still to select (`reorder`), applied in the copy that appends (`extend`)
        self.pending_rows: list[torch.Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        """Number of target positions already decoded."""
        first = self.self_kv[0]
        return 0 if first is None else first[0].shape[2]

    def reorder(self, index: torch.Tensor, cross_index: torch.Tensor | None = None) -> None:
        """Keep rows `index` of the self-attention keys/values (beam reordering), and rows
        `cross_index` of the cross-attention ones (dropping finished sentences). The
        self-attention rows are selected lazily, by the next `extend`, in the same copy that
        appends the new position."""
        for i, kv in enumerate(self.self_kv):
            if kv is not None:
                pending = self.pending_rows[i]
                self.pending_rows[i] = index if pending is None else pending.index_select(0, index)
        if cross_index is not None:
            for i, kv in enumerate(self.cross_kv):
                if kv is not None:
                    self.cross_kv[i] = (kv[0].index_select(0, cross_index), kv[1].index_select(0, cross_index))
            if self.cross_bias is not None:
                self.cross_bias = self.cross_bias.index_select(0, cross_index)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, L, Dh) new keys/values to layer `layer`'s self-attention cache (after
        its pending row selection); returns all its keys and values."""
        past = self.self_kv[layer]
        if past is not None:
            rows, self.pending_rows[layer] = self.pending_rows[layer], None
            k, v = select_and_append(past[0], rows, k), select_and_append(past[1], rows, v)
        self.self_kv[layer] = (k, v)
        return k, v


def sinusoidal_positions(n_positions: int, d_model: int) -> torch.Tensor:
    """(P, D) table of sin/cos position encodings (Vaswani et al., section 3.5)."""
    pos = torch.arange(n_positions, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(D), plus sinusoidal positions, then dropout. With
    `fix_norm` each token's vector is first brought to unit length (FixNorm)."""

    def __init__(
        self, vocab_size: int, d_model: int, max_positions: int, dropout: float, fix_norm: bool = False
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.scale = math.sqrt(d_model)
        self.fix_norm = fix_norm
        self.register_buffer("positions", sinusoidal_positions(max_positions, d_model), persistent=False)
        self.dropout = Dropout(dropout)

    def forward(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        length = ids.shape[1]
        if offset + length > self.positions.shape[0]:
            raise ValueError(
                f"sequence of {offset + length} positions exceeds model.max_positions ({self.positions.shape[0]})"
            )
        vectors = self.tokens(ids)  # (B, L, D); PAD's zero row stays zero under normalize
        if self.fix_norm:
            vectors = F.normalize(vectors, dim=-1)
        x = vectors * self.scale + self.positions[offset : offset + length]
        return self.dropout(x)


class Attention(nn.Module):
    """Multi-head attention through SDPA; self-attention uses one fused QKV projection,
    cross-attention a query projection and a fused KV projection of the memory."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, cross: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.cross = cross
        self.dropout = dropout
        if cross:
            self.q_proj = Linear(d_model, d_model)
            self.kv_proj = Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = Linear(d_model, 3 * d_model)
        self.out_proj = Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """(B, L, n*D) -> n tensors of (B, H, L, Dh)."""
        return tuple(split_heads(x, n, self.n_heads))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        memory: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        length = x.shape[1]
        attn_dtype = self._attention_dtype(x, cache)
        if self.cross:
            (q,) = self._heads(self.q_proj(x).to(attn_dtype), 1)
            k, v = (
                self._cross_kv(memory, cache, layer, attn_dtype)
                if cache is not None
                else self._heads(self.kv_proj(memory), 2)
            )
            group = q.shape[0] // k.shape[0]
            if group > 1:  # beam search: the `group` beams of a sentence share its memory
                return self._merge_heads(_grouped_attention(q, k, v, mask, group), x)
        else:
            q, k, v = self._heads(self.qkv_proj(x).to(attn_dtype), 3)  # (B, H, L, Dh) each
            if cache is not None:
                prefix = cache.self_kv[layer] is not None
                k, v = cache.extend(layer, k, v)
                if prefix:  # the queries follow cached positions: no plain causal flag
                    if is_causal and length > 1:  # several new queries: explicit bottom-right mask
                        mask = _causal_mask(length, k.shape[2], x.device)
                    is_causal = False
        # explicit products + softmax beat SDPA's kernels for one decoding step (2-3x) and, on CPU,
        # for the short sequences of sentence-level MT, forward and backward (1.2-2x up to 40 keys)
        if (length == 1 and not self.training) or (q.device.type == "cpu" and k.shape[2] <= CPU_MATH_MAX_KEYS):
            if is_causal:
                causal = _causal_mask(length, k.shape[2], x.device)
                mask = causal if mask is None else mask & causal
            p = self.dropout if self.training else 0.0
            return self._merge_heads(_math_attention(q, k, v, mask, p), x)
        # CPU flash attention is slow in bf16 for short sequences; the math backend is ~4x faster
        backend = _CPU_LOW_PRECISION if q.device.type == "cpu" and q.dtype != torch.float32 else _ANY_BACKEND
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal
            )  # (B, H, L, Dh)
        return self._merge_heads(y, x)

    def _attention_dtype(self, x: torch.Tensor, cache: KVCache | None) -> torch.dtype:
        """The dtype attention runs in: `x`'s, except when decoding with bf16/fp16 weights on
        CPU, where cross-attention runs in float32 over cached float32 keys/values (CPU's 16-bit
        batched products of a decoding step's small shapes are ~3x slower: 140 against 44 us for
        64 rows x 4 heads x 20 keys), and self-attention too where the cache asks (greedy); beam
        search copies its self-attention cache at every step, twice the bytes in float32 (5%
        slower), so there it stays 16-bit."""
        if cache is None or x.device.type != "cpu" or x.dtype == torch.float32:
            return x.dtype
        return torch.float32 if self.cross or cache.float32_self else x.dtype

    def _cross_kv(
        self, memory: torch.Tensor | None, cache: KVCache, layer: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cross-attention keys/values, (B, H, S, Dh) each: computed from the
        memory once per sentence and cached in `dtype`, contiguous, so that every later step
        multiplies by them without a copy."""
        kv = cache.cross_kv[layer]
        if kv is None:
            assert memory is not None
            k, v = (t.to(dtype).contiguous() for t in self._heads(self.kv_proj(memory), 2))
            kv = cache.cross_kv[layer] = (k, v)
        return kv

    def _merge_heads(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B, H, L, Dh) attention outputs -> (B, L, D) in `x`'s dtype, through the output projection."""
        return self.out_proj(y.transpose(1, 2).reshape(x.shape).to(x.dtype))


def _causal_mask(length: int, total: int, device: torch.device) -> torch.Tensor:
    """(L, S) bool: the last `length` of `total` positions attend to themselves and before."""
    return torch.ones(length, total, dtype=torch.bool, device=device).tril(total - length)


def _math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float = 0.0
) -> torch.Tensor:
    """dropout_p(softmax(q k^T / sqrt(Dh))) v: (B, H, L, Dh) -> (B, H, L, Dh); the softmax in
    float32. Every query must be allowed at least one key."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, L, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return dropout(probs, p, training=p > 0.0) @ v


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, group: int
) -> torch.Tensor:
    """Attention of (B*G, H, L, Dh) queries to (B, H, S, Dh) keys/values, where the G query rows
    of each group share one key/value row: (B*G, H, L, Dh). Keys and values are read once per
    group instead of G times, and no G-fold copy of the memory is made."""
    bg, heads, length, dh = q.shape
    n = bg // group
    q = q.view(n, group, heads, length, dh).transpose(1, 2).reshape(n, heads, group * length, dh)
    y = _math_attention(q, k, v, mask)  # (B, H, G*L, Dh)
    return y.view(n, heads, group, length, dh).transpose(1, 2).reshape(bg, heads, length, dh)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float, activation_dropout: float = -1.0) -> None:
        super().__init__()
        self.fc1 = Linear(d_model, d_ff)
        self.fc2 = Linear(d_ff, d_model)
        # activation_dropout -1: the rate of model.dropout, which train.dropout_warmup ramps too
        self.dropout = Dropout(dropout) if activation_dropout < 0 else Dropout(activation_dropout, fixed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(x))))  # (B, L, D) -> (B, L, F) -> (B, L, D)


class ScaleNorm(nn.Module):
    """`g * x / ||x||` over the last dimension with one learned gain g, initialised to sqrt(D)
    (Nguyen & Salazar, 2019). The norm is taken in float32 whatever the input's type."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((1,), math.sqrt(d_model)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_norm(x, self.gain, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer `model.norm` names: LayerNorm or ScaleNorm."""
    return ScaleNorm(cfg.d_model) if cfg.norm == "scale" else nn.LayerNorm(cfg.d_model)


class Sublayer(nn.Module):
    """Residual wrapper: pre-norm `x + f(N(x))` or post-norm `N(x + f(x))`, N as `make_norm`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x: torch.Tensor, y_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(y_of(self.norm(x)))
        return self.norm(x + self.dropout(y_of(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.activation_dropout)
        self.sub_attn = Sublayer(cfg)
        self.sub_ffn = Sublayer(cfg)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.sub_attn(x, lambda h: self.self_attn(h, mask=src_mask))
        return self.sub_ffn(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=False)
        self.cross_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.activation_dropout)
        self.sub_self = Sublayer(cfg)
        self.sub_cross = Sublayer(cfg)
        self.sub_ffn = Sublayer(cfg)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        x = self.sub_self(x, lambda h: self.self_attn(h, is_causal=True, cache=cache, layer=layer))
        x = self.sub_cross(x, lambda h: self.cross_attn(h, mask=src_mask, memory=memory, cache=cache, layer=layer))
        return self.sub_ffn(x, self.ffn)

    def linears(self) -> list[Linear]:
        """The linear layers a cached step multiplies by, in `mtx.step.decoder_step`'s order."""
        a, c, f = self.self_attn, self.cross_attn, self.ffn
        return [a.qkv_proj, a.out_proj, c.q_proj, c.out_proj, f.fc1, f.fc2]

    def step_weights(self) -> list[torch.Tensor]:
        """The 18 tensors `mtx.step.decoder_step` reads per layer: each sublayer's norm, then
        the weight and bias of its linear layers."""
        qkv, out, q, cross_out, fc1, fc2 = ((m.weight, m.bias) for m in self.linears())
        return [
            *_norm_weights(self.sub_self.norm),
            *qkv,
            *out,
            *_norm_weights(self.sub_cross.norm),
            *q,
            *cross_out,
            *_norm_weights(self.sub_ffn.norm),
            *fc1,
            *fc2,
        ]


def _norm_weights(norm: nn.Module) -> list[torch.Tensor]:
    """A norm's weight and bias for `mtx.step.norm` (ScaleNorm: its gain twice)."""
    return [norm.gain, norm.gain] if isinstance(norm, ScaleNorm) else [norm.weight, norm.bias]


class Seq2Seq(nn.Module):
    """The Transformer: `encode(src, src_mask)` and `decode(tgt, memory, src_mask, cache)`."""

    def __init__(
        self,
        cfg: ModelConfig,
        src_vocab_size: int,
        tgt_vocab_size: int,
        joint_vocab: bool,
        output_ids: torch.Tensor | None = None,
    ) -> None:
        """`output_ids`: the target ids the output softmax covers (`model.restrict_output`; EOS
        and UNK are always added), None for the whole target vocabulary."""
        super().__init__()
        self.cfg = cfg
        self.output_ids: torch.Tensor | None
        self.register_buffer("output_ids", None)  # None: not in the state dict
        self.eos_column = EOS
        # PAD and BOS, the only ids below EOS, are the first logit columns where the softmax has
        # them: never a target, but label smoothing gives them mass, so a search must rule them
        # out (the text would drop them: an n-best list held the same text twice, stop 56)
        self.unemitted_columns = EOS
        if output_ids is not None:  # sorted ids; column c of the logits is token output_ids[c]
            ids = torch.cat([output_ids.long().flatten().cpu(), torch.tensor([EOS, UNK])]).unique()
            if int(ids[0]) < 0 or int(ids[-1]) >= tgt_vocab_size:
                raise ValueError(f"output_ids must lie in [0, {tgt_vocab_size}), got {ids[0]}..{ids[-1]}")
            self.output_ids = ids  # assigning a tensor to a registered buffer name sets the buffer
            self.register_buffer("_columns", torch.empty(tgt_vocab_size, dtype=torch.long), persistent=False)
            self._index_output_ids()
            # loading a state dict replaces output_ids: the columns follow
            self.register_load_state_dict_post_hook(lambda module, _keys: module._index_output_ids())
        self.src_embed = Embedding(src_vocab_size, cfg.d_model, cfg.max_positions, cfg.dropout, cfg.fix_norm)
        share_src_tgt = cfg.tie_embeddings and joint_vocab
        self.tgt_embed = (
            self.src_embed
            if share_src_tgt
            else Embedding(tgt_vocab_size, cfg.d_model, cfg.max_positions, cfg.dropout, cfg.fix_norm)
        )
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # pre-LN stacks need a final norm; post-LN outputs are already normalised
        self.encoder_norm = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = make_norm(cfg) if cfg.pre_norm else nn.Identity()
        self.output_proj = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
        self._packed_output: torch.Tensor | None = None  # set inside `packed_weights` only
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.d_model**-0.5)
                with torch.no_grad():
                    module.weight[PAD].zero_()

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) ids -> (B, S, D) memory."""
        x = self.src_embed(src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decoder_states(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T) target ids -> (B, T, D) final decoder states; with a cache, `tgt` holds only
        the new positions and is placed after the cached ones."""
        offset = cache.length if cache is not None else 0
        x = self.tgt_embed(tgt, offset)
        if cache is not None and tgt.shape[1] == 1 and not self.training:
            return self._cached_step(x, memory, src_mask, cache)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, src_mask, cache, i)
        return self.decoder_norm(x)

    def _cached_step(
        self, x: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """(B, 1, D) embedded new position -> (B, 1, D) final decoder states, through
        `mtx.step.decoder_step` (compiled on CPU); the cross-attention keys/values and their
        source bias are made on the first step of a batch."""
        layers = list(self.decoder_layers)
        cross_dtype = layers[0].cross_attn._attention_dtype(x, cache)
        cross_kv = [layer.cross_attn._cross_kv(memory, cache, i, cross_dtype) for i, layer in enumerate(layers)]
        if cache.cross_bias is None:
            k = cross_kv[0][0]  # (B, H, S, Dh)
            bias = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[2])
            cache.cross_bias = bias.masked_fill_(~src_mask, float("-inf"))
        weights: list[torch.Tensor] = []
        packed: list[torch.Tensor | None] = []
        for layer in layers:
            weights += layer.step_weights()
            packed += [m.inference_packed() for m in layer.linears()]
        if self.cfg.pre_norm:
            weights += _norm_weights(self.decoder_norm)
        step = compiled_step() if x.device.type == "cpu" else decoder_step
        norm = layers[0].sub_self.norm
        x, self_kv = step(
            x,
            weights,
            packed,
            cache.self_kv,
            cache.pending_rows,
            cross_kv,
            cache.cross_bias,
            self.cfg.n_heads,
            self.cfg.pre_norm,
            isinstance(norm, ScaleNorm),
            norm.eps,
            layers[0].self_attn._attention_dtype(x, cache),
        )
        cache.self_kv = list(self_kv)
        cache.pending_rows = [None] * len(layers)
        return x

    @property
    def output_table(self) -> torch.Tensor:
        """(V_tgt, D) rows of every target piece: the target embedding when tied, else the
        output projection's weight (whatever `output_ids` restricts the softmax to)."""
        return self.tgt_embed.tokens.weight if self.output_proj is None else self.output_proj.weight

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, D) weight of the output projection; with `output_ids`, only their rows of
        `output_table` (V = len(output_ids)); with `model.fix_norm`, each row at unit length."""
        weight = self.output_table
        if self.output_ids is not None:  # select first: only the kept rows need normalising
            weight = weight.index_select(0, self.output_ids)
        if not self.cfg.fix_norm:
            return weight
        if self.output_ids is None and self.output_proj is None:
            # the tied table's PAD row is zero (padding_idx), and normalising a zero row has a
            # gradient of 1/eps: the first step's gradient norm was about 1e9, so clipping scaled
            # every other gradient to nothing. PAD is never a target: its row gets no gradient
            weight = torch.cat([weight[: PAD + 1].detach(), weight[PAD + 1 :]])
        return F.normalize(weight, dim=-1)

    def project(self, states: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(..., D) decoder states -> (..., V) logits (tied to the target embedding by default),
        plus an optional (V,) logit bias."""
        packed = self._packed_output
        if _uses_packed(states, packed):  # then the restricted weight is not gathered (`output_weight`)
            return packed_linear(states, packed, bias)
        return F.linear(states, self.output_weight, bias)

    @contextlib.contextmanager
    def packed_weights(self) -> Iterator[None]:
        """Within the block, CPU inference projects with a prepacked copy of the output weight
        (float32 or bf16), and with bf16 weights every decoder linear layer with a prepacked
        copy of its own (the weights must not change inside it: searches wrap one call in it).
        Nested blocks reuse the outer one's copies, so decoding threads inside one block share them."""
        if self._packed_output is not None:
            yield
            return
        self._packed_output = _pack_weight(self.output_weight)
        layers = [m for m in self.decoder_layers.modules() if isinstance(m, Linear)]
        if self._packed_output is None or self._packed_output.dtype not in _PACK_LAYERS_DTYPES:
            layers = []
        try:
            for m in layers:
                m.packed = _pack_weight(m.weight)
            yield
        finally:
            self._packed_output = None
            for m in layers:
                m.packed = None

    def _index_output_ids(self) -> None:
        """Token id -> logit column (UNK's column for ids outside `output_ids`)."""
        ids = self.output_ids
        assert ids is not None
        self._columns.fill_(int(torch.searchsorted(ids, torch.tensor(UNK, device=ids.device))))
        self._columns[ids] = torch.arange(len(ids), device=ids.device)
        self.eos_column = int(self._columns[EOS])
        self.unemitted_columns = int((ids < EOS).sum())

    def output_columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> their logit columns (ids outside `output_ids` -> UNK's column)."""
        return ids if self.output_ids is None else self._columns[ids]

    def output_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Logit columns -> target token ids."""
        return columns if self.output_ids is None else self.output_ids[columns]

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """(B, T) target ids -> (B, T, V) logits (columns: see `output_tokens`)."""
        return self.project(self.decoder_states(tgt, memory, src_mask, cache))

    def new_cache(self, float32_self: bool = False) -> KVCache:
        return KVCache(len(self.decoder_layers), float32_self)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher-forced (B, T, V) logits."""
        src_mask = make_src_mask(src)
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask)


class EnsembleCache:
    """One KV cache per ensemble member, reordered together."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    @property
    def length(self) -> int:
        return self.caches[0].length

    def reorder(self, index: torch.Tensor, cross_index: torch.Tensor | None = None) -> None:
        for cache in self.caches:
            cache.reorder(index, cross_index)


class Ensemble(nn.Module):
    """Several models over one target vocabulary decoding as one: the next-token distribution is
    the mean of the members' distributions (checkpoint ensembles, Sennrich et al., 2016).

    Search sees the `Seq2Seq` seam: `encode` concatenates the members' memories along D, so the
    searches' row selection (dropping finished sentences) applies to all members at once, and
    `decode` returns log mean probabilities (already normalised, so a log-softmax keeps them).
    """

    def __init__(self, members: list[Seq2Seq]) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least 2 models, got {len(members)}")
        first = members[0]
        for m in members[1:]:
            same_rows = m.output_table.shape[0] == first.output_table.shape[0]
            same_ids = (m.output_ids is None) == (first.output_ids is None) and (
                m.output_ids is None or torch.equal(m.output_ids, first.output_ids)
            )
            if not (same_rows and same_ids):
                raise ValueError("ensemble members must share the target vocabulary and output columns")
        self.members = nn.ModuleList(members)
        # the tightest position limit of any member bounds the output length
        self.cfg = min((m.cfg for m in members), key=lambda c: c.max_positions)
        self.eos_column = first.eos_column
        self.unemitted_columns = first.unemitted_columns
        self._widths = [m.cfg.d_model for m in members]

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) ids -> (B, S, sum of the members' D) memories side by side."""
        return torch.cat([m.encode(src, src_mask) for m in self.members], dim=-1)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: EnsembleCache | None = None,
    ) -> torch.Tensor:
        """(B, T) target ids -> (B, T, V) float32 log of the members' mean next-token probability."""
        memories = memory.split(self._widths, dim=-1)
        caches = cache.caches if cache is not None else [None] * len(self.members)
        log_probs = torch.stack(
            [
                torch.log_softmax(m.decode(tgt, mem, src_mask, c).float(), dim=-1)
                for m, mem, c in zip(self.members, memories, caches, strict=True)
            ]
        )  # (N, B, T, V)
        return torch.logsumexp(log_probs, dim=0) - math.log(len(self.members))

    def output_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        return self.members[0].output_tokens(columns)

    def output_columns(self, ids: torch.Tensor) -> torch.Tensor:
        return self.members[0].output_columns(ids)

    @contextlib.contextmanager
    def packed_weights(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(m.packed_weights())
            yield

    def new_cache(self, float32_self: bool = False) -> EnsembleCache:
        return EnsembleCache([m.new_cache(float32_self) for m in self.members])
