from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import mtx.model
from mtx.config import ModelConfig
from mtx.data import Batch, ParallelIds, pad_ids
from mtx.loss import label_smoothed_loss
from mtx.model import Seq2Seq, make_src_mask, sinusoidal_positions
from mtx.tokenizer import BOS, EOS, PAD

V = 50


def _model(
    pre_norm: bool = True, dropout: float = 0.0, joint: bool = True, tie: bool = True, scale_norm: bool = False
) -> Seq2Seq:
    """A small model; `scale_norm`: ScaleNorm layers and FixNorm embeddings instead of LayerNorm."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=dropout,
        pre_norm=pre_norm, tie_embeddings=tie, max_positions=64,
        norm="scale" if scale_norm else "layer", fix_norm=scale_norm,
    )  # fmt: skip
    return Seq2Seq(cfg, V, V if joint else V + 7, joint_vocab=joint).eval()


def _trained_norms(model: Seq2Seq) -> Seq2Seq:
    """`model` with a gain and bias of its own in every norm, as after training: a new model's
    norms are all alike, so one norm's weights read in another's place went unseen (stop 69's
    mutation probe: the cached step's post-LN cross-attention on the self-attention's norm, and the
    pre-LN final norm on a layer's, passed every test)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5)).add_(torch.randn_like(p) * 0.3)
    return model


# (pre_norm, scale_norm): pre-LN, post-LN, and pre-norm with ScaleNorm + FixNorm
NORMS = pytest.mark.parametrize(("pre_norm", "scale_norm"), [(True, False), (False, False), (True, True)])


SRC_IDS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _src() -> torch.Tensor:
    return pad_ids(SRC_IDS, suffix=EOS)


def _batch(src: list[list[int]], tgt: list[list[int]]) -> Batch:
    """A training batch of these source and target pieces, built as training builds its batches."""
    return ParallelIds(src, tgt).batch(range(len(src)))


@NORMS
def test_padding_does_not_change_encoder_or_decoder_outputs(pre_norm: bool, scale_norm: bool) -> None:
    model = _model(pre_norm, scale_norm=scale_norm)
    src = _src()
    tgt = torch.tensor([[BOS, 20, 21], [BOS, 22, 23]])
    logits = model(src, tgt)
    wider = torch.cat([src, torch.full((2, 4), PAD)], dim=1)  # more padding
    assert torch.allclose(model(wider, tgt), logits, atol=1e-5)
    noisy = src.clone()
    noisy[1, 4:] = 30  # garbage where the mask says padding
    mask = make_src_mask(src)
    assert torch.allclose(
        model.decode(tgt, model.encode(noisy, mask), mask), logits, atol=1e-5
    )  # masked keys are ignored


def test_decoder_does_not_look_ahead() -> None:
    model = _model()
    src = _src()
    tgt = torch.tensor([[BOS, 20, 21, 22], [BOS, 23, 24, 25]])
    changed = tgt.clone()
    changed[:, 2:] = 40
    a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[:, :2], b[:, :2], atol=1e-6)
    assert not torch.allclose(a[:, 2:], b[:, 2:])


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@NORMS
def test_cached_and_uncached_decoder_logits_agree(pre_norm: bool, scale_norm: bool, device: str) -> None:
    model = _trained_norms(_model(pre_norm, scale_norm=scale_norm)).to(device)
    src = _src().to(device)
    tgt = torch.tensor([[BOS, 20, 21, 22, 23], [BOS, 24, 25, 26, 27]], device=device)
    mask = make_src_mask(src)
    memory = model.encode(src, mask)
    full = model.decode(tgt, memory, mask)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(tgt.shape[1])]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    # cross-attention keys/values cached contiguous: later steps read them without a copy
    assert all(t.is_contiguous() for kv in cache.cross_kv if kv is not None for t in kv)
    # several new positions after a cached prefix
    cache = model.new_cache()
    first = model.decode(tgt[:, :2], memory, mask, cache)
    rest = model.decode(tgt[:, 2:], memory, mask, cache)
    assert torch.allclose(torch.cat([first, rest], dim=1), full, atol=1e-5)


@pytest.mark.parametrize("float32_self", [False, True])
def test_bf16_decoding_attends_in_float32(float32_self: bool) -> None:
    """A model cast to bf16 decodes with float32 cross-attention keys/values in the cache (its
    products run in float32 on CPU), self-attention ones in float32 only where the cache asks
    (greedy), and its cached step-by-step logits stay within bf16 rounding of the float32
    model's, as the uncached bf16 ones do."""
    model = _model()
    half = _model().to(torch.bfloat16)
    src = _src()
    tgt = torch.tensor([[BOS, 20, 21, 22, 23], [BOS, 24, 25, 26, 27]])
    mask = make_src_mask(src)
    want = model.decode(tgt, model.encode(src, mask), mask)
    memory = half.encode(src, mask)
    cache = half.new_cache(float32_self)
    steps = torch.cat([half.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(tgt.shape[1])], dim=1)
    assert steps.dtype == torch.bfloat16
    for kvs, dtype in (
        (cache.cross_kv, torch.float32),
        (cache.self_kv, torch.float32 if float32_self else torch.bfloat16),
    ):
        for kv in kvs:
            assert kv is not None and all(t.dtype == dtype and t.is_contiguous() for t in kv)
    uncached = half.decode(tgt, memory, mask)
    scale = want.abs().max()
    assert (steps.float() - want).abs().max() < 0.05 * scale
    assert (uncached.float() - want).abs().max() < 0.05 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_steps_ignore_the_memory_at_padded_positions(dtype: torch.dtype) -> None:
    """Cached decoding steps (cross-attention keys/values made once, in float32 for bf16 weights)
    give the same logits whatever the memory holds where the source is padding."""
    model = _model().to(dtype)
    src = _src()
    mask = make_src_mask(src)
    assert not mask[1].all()  # the second sentence is padded
    memory = model.encode(src, mask)
    garbage = memory.clone()
    garbage[1, 4:] = 1e3 * torch.randn_like(garbage[1, 4:])
    tgt = torch.tensor([[BOS, 20, 21, 22], [BOS, 24, 25, 26]])
    for float32_self in (False, True):
        steps = []
        for mem in (memory, garbage):
            cache = model.new_cache(float32_self)
            steps.append(torch.cat([model.decode(tgt[:, t : t + 1], mem, mask, cache) for t in range(4)], dim=1))
        assert torch.allclose(steps[0].float(), steps[1].float(), atol=1e-6)


@pytest.mark.parametrize("inference", [True, False])
def test_cache_follows_reorders_and_drops(inference: bool) -> None:
    """Rows reordered, repeated and dropped between steps as in beam search (sometimes twice
    before the next step), over 45 steps: every step's logits equal those of decoding each
    row's whole history without a cache."""
    with torch.inference_mode(inference):  # decoding runs in inference mode; autograd still works
        _decode_with_reorders(_model())


def _decode_with_reorders(model: Seq2Seq) -> None:
    gen = torch.Generator().manual_seed(1)
    src = pad_ids([[5, 6, 7, 8, 9], [10, 11, 12], [13, 14], [15, 16, 17, 18]], suffix=EOS)
    mask = make_src_mask(src)
    memory = model.encode(src, mask)
    history = torch.full((4, 1), BOS)
    cache = model.new_cache()
    for step in range(45):
        cached = model.decode(history[:, -1:], memory, mask, cache)[:, -1]
        assert torch.allclose(cached, model.decode(history, memory, mask)[:, -1], atol=1e-4), step
        history = torch.cat([history, torch.randint(4, V, (len(history), 1), generator=gen)], dim=1)
        for _ in range(2 if step % 7 == 3 else 1):
            n = len(history) - (step == 20)  # one row finishes at step 20
            rows = torch.randint(0, len(history), (n,), generator=gen)
            history, memory, mask = history[rows], memory[rows], mask[rows]
            cache.reorder(rows, rows)
    assert cache.length == 45


@pytest.mark.parametrize("cached", [True, False])
def test_beams_sharing_one_memory_row_equal_an_expanded_memory(cached: bool) -> None:
    """Beam search gives K target rows per sentence and one memory row: the same logits as K copies."""
    model, k = _model(), 3
    src = _src()
    mask = make_src_mask(src)
    memory = model.encode(src, mask)
    tgt = torch.randint(4, V, (2 * k, 4))
    tgt[:, 0] = BOS
    expand = torch.arange(2).repeat_interleave(k)
    if cached:
        shared_cache, expanded_cache = model.new_cache(), model.new_cache()
        shared = [model.decode(tgt[:, t : t + 1], memory, mask, shared_cache) for t in range(tgt.shape[1])]
        expanded = [
            model.decode(tgt[:, t : t + 1], memory[expand], mask[expand], expanded_cache) for t in range(tgt.shape[1])
        ]
        shared, expanded = torch.cat(shared, dim=1), torch.cat(expanded, dim=1)
    else:
        shared, expanded = model.decode(tgt, memory, mask), model.decode(tgt, memory[expand], mask[expand])
    assert torch.allclose(shared, expanded, atol=1e-5)


def test_weight_tying() -> None:
    """Tied: the logits are products with the target embedding itself (the source one too with a
    joint vocabulary), and a loss on them trains that embedding; untied: their own projection."""
    joint = _model(joint=True)
    assert joint.src_embed is joint.tgt_embed and joint.output_proj is None
    split = _model(joint=False)
    assert split.src_embed is not split.tgt_embed and split.output_proj is None
    untied = _model(tie=False)
    assert untied.output_proj is not None
    for model, table in ((joint, joint.src_embed), (split, split.tgt_embed), (untied, untied.output_proj)):
        weight = table.tokens.weight if table is not untied.output_proj else table.weight
        assert model.output_weight.data_ptr() == weight.data_ptr()
        states = torch.randn(3, model.cfg.d_model)
        assert torch.equal(model.project(states), states @ weight.t())
        model.project(states).sum().backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0
    assert split.project(torch.randn(2, split.cfg.d_model)).shape == (2, V + 7)  # the target vocabulary
    assert split.src_embed.tokens.weight.grad is None  # the source embedding is not the output


def test_sinusoidal_positions_are_vaswanis_and_added_to_scaled_embeddings() -> None:
    """The table is rebuilt at every load (not saved): its values are pinned here, so a change
    cannot silently break trained checkpoints. PE(p, 2i) = sin(p / 10000^(2i/D)), PE(p, 2i+1) =
    cos(the same); an embedding is the token's row times sqrt(D) plus its position's row."""
    table = sinusoidal_positions(50, 8)
    assert table[0].tolist() == [0.0, 1.0] * 4
    pos = torch.arange(50, dtype=torch.float64)[:, None]
    angle = pos / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert torch.allclose(table[:, 0::2].double(), angle.sin(), atol=1e-5)
    assert torch.allclose(table[:, 1::2].double(), angle.cos(), atol=1e-5)
    assert table[1, 0].item() == pytest.approx(math.sin(1.0)) and table[1, 7].item() == pytest.approx(math.cos(1e-3))
    model = _model()
    ids = torch.tensor([[5, 6, 7, 8]])
    embed = model.src_embed
    want = embed.tokens.weight[ids] * math.sqrt(model.cfg.d_model) + sinusoidal_positions(64, 32)[:4]
    assert torch.allclose(embed(ids), want, atol=1e-6)
    later = want - sinusoidal_positions(64, 32)[:4] + sinusoidal_positions(64, 32)[3:7]  # a cached step's offset
    assert torch.allclose(embed(ids, offset=3), later, atol=1e-6)


@NORMS
def test_overfits_one_batch(pre_norm: bool, scale_norm: bool) -> None:
    torch.manual_seed(0)
    model = _model(pre_norm, dropout=0.0, scale_norm=scale_norm).train()
    src = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    tgt = [[20, 21, 22], [23, 24, 25, 26], [27, 28], [29, 30, 31, 32, 33]]
    batch = _batch(src, tgt)
    # FixNorm bounds the logits by the final ScaleNorm's gain, which Adam grows by about lr a step
    opt = torch.optim.Adam(model.parameters(), lr=3e-2 if scale_norm else 3e-3)
    for _ in range(150):
        loss = label_smoothed_loss(model, batch, 0.0) / batch.n_tgt_tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02


def test_scale_norm_and_fix_norm() -> None:
    """ScaleNorm outputs have length g (sqrt(D) at first, in float32 whatever the input's type);
    with FixNorm every token enters at length sqrt(D) before positions are added, the output
    projection's rows have unit length and the logits are the final states' products with them."""
    model = _model(scale_norm=True)
    norm = model.decoder_norm
    assert isinstance(norm, mtx.model.ScaleNorm)
    x = torch.randn(3, 5, 32) * 7
    lengths = torch.linalg.vector_norm(norm(x), dim=-1)
    assert torch.allclose(lengths, torch.full_like(lengths, 32**0.5), atol=1e-4)
    assert norm(x.bfloat16()).dtype == torch.bfloat16
    with torch.no_grad():
        norm.gain.fill_(3.0)
    assert torch.allclose(torch.linalg.vector_norm(norm(x), dim=-1), torch.full((3, 5), 3.0), atol=1e-4)
    embed = model.src_embed
    with torch.no_grad():
        embed.tokens.weight[7].mul_(5.0)  # a long row enters at the same length as the others
    ids = torch.tensor([[6, 7, PAD]])
    vectors = embed(ids) - embed.positions[:3]
    assert torch.allclose(torch.linalg.vector_norm(vectors[0, :2], dim=-1), torch.full((2,), 32**0.5), atol=1e-4)
    assert torch.equal(vectors[0, 2], torch.zeros(32))  # PAD's zero row stays zero
    rows = torch.linalg.vector_norm(model.output_weight[1:], dim=-1)  # row 0 is PAD's zero row
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)
    states = torch.randn(2, 4, 32)
    want = states @ torch.nn.functional.normalize(model.output_table, dim=-1).T
    assert torch.allclose(model.project(states), want, atol=1e-5)
    # the first step's gradients are of the usual size (stop 53: the zero PAD row's normalisation
    # made their norm about 1e9, and clipping then scaled the update of every weight to nothing)
    model.train()
    batch = _batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]])
    label_smoothed_loss(model, batch, 0.1).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) < 100
    assert torch.equal(model.tgt_embed.tokens.weight.grad[PAD], torch.zeros(32))


@pytest.mark.parametrize("pre_norm", [True, False])
def test_cpu_explicit_attention_matches_sdpa(pre_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training on CPU takes explicit products + softmax for short sequences; loss and every
    gradient equal those of SDPA's kernels (padding masks, causal decoder self-attention)."""
    model = _model(pre_norm).train()
    batch = _batch(SRC_IDS, [[20, 21, 22], [23, 24, 25, 26]])

    def loss_and_grads(max_keys: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(mtx.model, "CPU_MATH_MAX_KEYS", max_keys)
        model.zero_grad()
        loss = label_smoothed_loss(model, batch, 0.1)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    explicit_loss, explicit_grads = loss_and_grads(64)
    sdpa_loss, sdpa_grads = loss_and_grads(0)
    assert torch.allclose(explicit_loss, sdpa_loss, rtol=1e-5)
    for a, b in zip(explicit_grads, sdpa_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_sdpa_never_offered_cudnn_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call of a forward pass (the path CUDA takes) allows its kernels without cuDNN
    attention, whose per-shape plans cost 190 ms each on a GPU (stop 46), and still allows the
    math kernel, so that every device and dtype has one."""
    offered = []

    def recording(backends: list[SDPBackend]) -> object:
        offered.append(list(backends))
        return sdpa_kernel(backends)

    monkeypatch.setattr(mtx.model, "sdpa_kernel", recording)
    monkeypatch.setattr(mtx.model, "CPU_MATH_MAX_KEYS", 0)  # SDPA on CPU too
    label_smoothed_loss(_model(True).train(), _batch(SRC_IDS, [[20, 21, 22], [23, 24, 25, 26]]), 0.1).backward()
    assert len(offered) == 3 * 2  # the tiny model's encoder self-, decoder self- and cross-attention x 2 layers
    assert all(SDPBackend.CUDNN_ATTENTION not in b and SDPBackend.MATH in b for b in offered), offered


def test_attention_dropout_on_the_explicit_path() -> None:
    """model.attention_dropout drops attention weights in training only: outputs vary between
    training passes and match the dropout-free model in eval."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, attention_dropout=0.5
    )
    model = Seq2Seq(cfg, V, V, joint_vocab=True)
    src, tgt = _src(), torch.tensor([[BOS, 20, 21], [BOS, 22, 23]])
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))
    plain = Seq2Seq(dataclasses.replace(cfg, attention_dropout=0.0), V, V, joint_vocab=True)
    plain.load_state_dict(model.state_dict())
    assert torch.allclose(model.eval()(src, tgt), plain.eval()(src, tgt), atol=1e-6)


@pytest.mark.parametrize("restricted", [False, True])
def test_packed_output_projection_matches_plain_and_ends_with_its_block(restricted: bool) -> None:
    """Searches project with a prepacked copy of the output weight (CPU float32 inference inside
    `packed_weights`): the same logits as F.linear; outside the block, or under autograd, the
    plain product of the current weights."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)
    model = Seq2Seq(cfg, 300, 300, joint_vocab=True, output_ids=torch.arange(4, 300, 2) if restricted else None)
    states = torch.randn(6, 3, 32)
    want = torch.nn.functional.linear(states, model.output_weight)
    with model.packed_weights():
        assert (model._packed_output is not None) == mtx.model._can_pack
        bias = torch.randn(want.shape[-1])
        with torch.inference_mode():
            got, got_biased = model.project(states), model.project(states, bias)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        assert torch.allclose(got_biased, want + bias, atol=1e-5)
        logits = model.project(states.requires_grad_())  # autograd: the plain, differentiable product
        (grad,) = torch.autograd.grad(logits.sum(), states)
        assert grad.shape == states.shape
        packed = model._packed_output
        with model.packed_weights():  # nested (a search inside translate_ids' block): the same copy
            assert model._packed_output is packed
        assert model._packed_output is packed
    assert model._packed_output is None
    with torch.no_grad():
        model.output_table.mul_(1.5)
    with torch.inference_mode():  # after the block: the current weights
        assert torch.allclose(model.project(states), torch.nn.functional.linear(states, model.output_weight))


@pytest.mark.skipif(not mtx.model._can_pack, reason="this torch build cannot pack weights for oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_decoders_pack_every_linear_layer_and_decode_as_plain(dtype: torch.dtype) -> None:
    """Inside `packed_weights` a bf16 model's decoder linear layers multiply by packed copies of
    their weights (float32 ones do not: slower for small products), with the logits of the plain
    products; the copies go when the block ends."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=2, dropout=0.0)
    model = Seq2Seq(cfg, V, V, joint_vocab=True).eval().to(dtype)
    src, tgt = _src(), torch.tensor([[BOS, 20, 21], [BOS, 22, 23]])
    layers = [m for m in model.decoder_layers.modules() if isinstance(m, mtx.model.Linear)]
    assert len(layers) == 2 * 7  # per layer: qkv and out (self), q, kv and out (cross), fc1 and fc2
    with torch.inference_mode():
        plain = model(src, tgt)
        with model.packed_weights():
            packs = dtype == torch.bfloat16 and dtype in mtx.model._packable_dtypes()  # native bf16 only
            assert all((m.packed is not None) == packs for m in layers)
            assert all(m.packed is None for m in model.encoder_layers.modules() if isinstance(m, mtx.model.Linear))
            packed = model(src, tgt)
    assert all(m.packed is None for m in layers)
    assert torch.allclose(packed.float(), plain.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)
