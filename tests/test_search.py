from __future__ import annotations

import contextlib
import copy
import math
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtx import errors, search
from mtx.checkpoint import LoadedRun, load_run
from mtx.config import ModelConfig
from mtx.data import pad_ids
from mtx.model import Ensemble, Seq2Seq, make_src_mask
from mtx.search import (
    beam_search,
    forced_log_probs,
    greedy_search,
    length_penalty,
    top_candidates,
    translate_ids,
    within_positions,
)
from mtx.text import read_lines
from mtx.tokenizer import BOS, EOS, PAD


@pytest.fixture(scope="module", params=["whole vocabulary", "restricted output", "ensemble"])
def run(request: pytest.FixtureRequest) -> LoadedRun:
    """Every search test runs on a model with the whole target vocabulary as output, on one
    whose softmax covers only train's target pieces (logit columns != token ids), and on an
    ensemble of two checkpoints of the latter (its last weights and their moving average)."""
    if request.param == "whole vocabulary":
        return load_run(request.getfixturevalue("tiny_run"))
    run_dir = request.getfixturevalue("tiny_restricted_run")
    if request.param == "restricted output":
        return load_run(run_dir)
    return load_run(run_dir, [run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "ema.pt"])


@pytest.fixture(scope="module")
def src_ids(run: LoadedRun, small_data: Path) -> list[list[int]]:
    return run.src_tok.encode_batch(read_lines(small_data / "val.de")[:40])


@pytest.mark.parametrize("vocab", [8000, 8003, 70, 12])
def test_block_top_candidates_equal_a_full_topk(vocab: int) -> None:
    torch.manual_seed(vocab)
    m, k, n = 7, 5, 10
    log_probs = torch.randn(m, k, vocab) * 4
    log_probs[0, :, : vocab - 3] = float("-inf")  # a row forced to end: few finite tokens
    scores = torch.randn(m, k) * 10
    scores[1, 1:] = float("-inf")  # first step: only beam 0 is alive
    want = (scores[:, :, None] + log_probs).view(m, k * vocab).topk(n, dim=1)
    values, index = top_candidates(scores, log_probs, n)
    assert torch.equal(values, want.values)
    finite = torch.isfinite(want.values)  # -inf candidates tie, so any of them may come back
    assert torch.equal(index[finite], want.indices[finite])


@pytest.mark.parametrize("vocab", [8000, 8003, 130, 70, 12])
def test_row_max_equals_max_with_the_first_index_on_ties(vocab: int) -> None:
    torch.manual_seed(vocab)
    values = torch.randn(9, vocab).round(decimals=1)  # many ties
    values[0, : vocab - 2] = float("-inf")  # a row forced to end: its best in the last block
    values[1, :] = 0.0  # all tied: the first column
    values[2, -1] = 100.0  # the best in the last column (a short last block where vocab % 64)
    want = values.max(dim=1)
    best, column = search.row_max(values)
    assert torch.equal(best, want.values)
    assert torch.equal(column, values.argmax(dim=1))
    assert int(column[1]) == 0 and int(column[2]) == vocab - 1


@pytest.mark.parametrize("vocab", [8000, 70, 3])
def test_first_step_ranks_one_row_as_k_rows_with_dead_beams(vocab: int) -> None:
    """Beam search's first step decodes one row per sentence, not K equal ones: its 2K
    candidates (padded with -inf ones when the vocabulary is smaller) are those that K rows, all
    but the first dead, would give."""
    torch.manual_seed(vocab)
    m, k = 4, 5
    log_probs = torch.randn(m, 1, vocab).log_softmax(dim=-1)
    dead = torch.full((m, k), float("-inf"))
    dead[:, 0] = 0.0
    want_values, want_index = top_candidates(dead, log_probs.expand(m, k, vocab).contiguous(), 2 * k)
    values, index = top_candidates(torch.zeros(m, 1), log_probs, 2 * k)
    assert torch.equal(values, want_values)
    finite = torch.isfinite(want_values)
    assert finite.sum() == m * min(2 * k, vocab)
    assert torch.equal(index[finite], want_index[finite])  # beam 0: the same flat index


def _batch(ids: list[list[int]]) -> torch.Tensor:
    return pad_ids(ids, suffix=EOS)


def test_beam_one_equals_greedy(run: LoadedRun, src_ids: list[list[int]]) -> None:
    src = _batch(src_ids)
    greedy = greedy_search(run.model, src, 1.2, 10)
    beam = beam_search(run.model, src, 1, 0.0, 1.2, 10)
    assert [h.tokens for h in greedy] == [b[0].tokens for b in beam]
    assert [h.log_prob for h in greedy] == pytest.approx([b[0].log_prob for b in beam], abs=1e-4)


@pytest.mark.parametrize("kind", ["whole vocabulary", "restricted output", "ensemble"])
@pytest.mark.parametrize("alpha", [0.0, 1.4])
def test_an_exhaustive_beam_returns_the_best_sequences_found_by_enumeration(kind: str, alpha: float) -> None:
    """Against an independent reference: every output of up to 4 tokens (EOS included) of a
    small random model (an ensemble: the mean of two models' probabilities, each model run on
    its own), scored by recomputing each whole prefix. A beam as wide as all of them must return
    the best 10 in order, with their scores, whatever the exact stop leaves out."""
    torch.manual_seed(7)
    cfg = ModelConfig(
        d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2, dropout=0.0, max_positions=16
    )
    restricted = kind == "restricted output"
    output_ids = torch.arange(4, 20, 3) if restricted else None  # 6 pieces + EOS + UNK: 8 columns
    vocab = 20 if restricted else 7
    members = [
        Seq2Seq(cfg, vocab, vocab, True, output_ids=output_ids).eval() for _ in range(2 if kind == "ensemble" else 1)
    ]
    with torch.no_grad():  # peakier distributions than an untrained model's: fewer near-ties
        for m in members:
            m.src_embed.tokens.weight.mul_(3.0)
    model = Ensemble(members) if kind == "ensemble" else members[0]
    src = _batch([[4, 5, 6], [5, 4], [6]])
    columns = 8 if restricted else 7
    emitted = columns - model.unemitted_columns  # the whole vocabulary's PAD and BOS never are (stop 56)
    cap, beam = 4, emitted * (emitted - 1) ** 2  # all candidates of the widest step in the top `beam`
    found = beam_search(model, src, beam, alpha, 0.0, cap, nbest=10)
    tokens = members[0].output_tokens(torch.arange(columns)).tolist()
    with torch.no_grad():
        for i in range(src.shape[0]):
            one = src[i : i + 1]
            mask = make_src_mask(one)
            memories = [m.encode(one, mask) for m in members]
            scored: list[tuple[float, list[int]]] = []
            prefixes: list[tuple[list[int], float]] = [([], 0.0)]
            for length in range(1, cap + 1):
                tgt = torch.tensor([[BOS, *p] for p, _ in prefixes])
                n = len(prefixes)
                each = [
                    m.decode(tgt, mem.expand(n, -1, -1), mask.expand(n, *mask.shape[1:]), None)[:, -1].log_softmax(-1)
                    for m, mem in zip(members, memories, strict=True)
                ]
                lp = torch.stack(each).logsumexp(dim=0) - math.log(len(members))  # log of the mean probability
                grown = []
                for (prefix, total), row in zip(prefixes, lp.tolist(), strict=True):
                    for column, token in enumerate(tokens):
                        if token in (PAD, BOS):  # never emitted (stop 56)
                            continue
                        if token == EOS:
                            scored.append(((total + row[column]) / length_penalty(length, alpha), prefix))
                        elif length < cap:
                            grown.append(([*prefix, token], total + row[column]))
                prefixes = grown
            scored.sort(key=lambda x: x[0], reverse=True)
            assert [h.tokens for h in found[i]] == [p for _, p in scored[:10]]
            assert [h.score for h in found[i]] == pytest.approx([x for x, _ in scored[:10]], abs=1e-5)


def test_bf16_weights_decode_close_to_fp32(run: LoadedRun, src_ids: list[list[int]]) -> None:
    """`--precision bf16`: the model cast to bf16 decodes through the same searches, scores in
    float32. Its products round to 8 bits, so the exact invariants of fp32 (beam 1 is greedy,
    batching changes nothing) hold only up to close calls that the rounding flips: most outputs
    equal the fp32 ones and beam 1 mostly equals greedy, the cost of the opt-in."""
    half = copy.deepcopy(run.model).to(torch.bfloat16)
    src = _batch(src_ids)
    greedy = greedy_search(half, src, 1.2, 10)
    beam = beam_search(half, src, 1, 0.0, 1.2, 10)
    fp32 = greedy_search(run.model, src, 1.2, 10)
    assert all(isinstance(h.log_prob, float) and h.log_prob <= 0.0 for h in greedy)
    same_as_beam = sum(g.tokens == b[0].tokens for g, b in zip(greedy, beam, strict=True))
    same_as_fp32 = sum(g.tokens == f.tokens for g, f in zip(greedy, fp32, strict=True))
    # the tiny model's many near-ties (26-31 of 40 when written) make this a floor, not a rate;
    # on trained models 90-95% of bf16 outputs equal fp32's (docs/speed.md)
    assert same_as_beam >= len(src_ids) // 2 and same_as_fp32 >= len(src_ids) // 2


@pytest.mark.parametrize("beam", [1, 5])
def test_batched_equals_one_at_a_time(run: LoadedRun, src_ids: list[list[int]], beam: int) -> None:
    batched = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=100_000)
    single = [translate_ids(run.model, [s], beam, 1.0, 1.2, 10, batch_tokens=100_000)[0] for s in src_ids]
    assert [h[0].tokens for h in batched] == [h[0].tokens for h in single]
    small_batches = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=60)
    assert [h[0].tokens for h in small_batches] == [h[0].tokens for h in batched]


@pytest.mark.parametrize("beam", [1, 5])
def test_decoding_threads_change_no_output(run: LoadedRun, src_ids: list[list[int]], beam: int) -> None:
    """Batches decoded by threads side by side (`workers`, at most torch's threads) come back in
    input order with the hypotheses of one thread, and torch's thread count is what it was."""
    threads = torch.get_num_threads()
    one = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=60, nbest=beam, workers=1)
    for workers in (2, 3):
        several = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=60, nbest=beam, workers=workers)
        for a, b in zip(one, several, strict=True):
            assert [h.tokens for h in a] == [h.tokens for h in b]
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
        assert torch.get_num_threads() == threads


def test_decoding_threads_are_threads_with_their_share_of_torchs(
    tiny_run: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`workers=2` decodes on two threads other than the caller's, each with half of torch's
    intra-op threads; `workers=1` on the caller's thread with all of them."""
    run = load_run(tiny_run)
    src_ids = run.src_tok.encode_batch(read_lines(small_data / "val.de")[:40])
    seen: list[tuple[int, int]] = []
    greedy = search.greedy_search

    def recording(*args: object, **kwargs: object) -> list[search.Hypothesis]:
        seen.append((threading.get_ident(), torch.get_num_threads()))
        return greedy(*args, **kwargs)

    monkeypatch.setattr(search, "greedy_search", recording)
    threads = torch.get_num_threads()
    assert threads >= 2  # conftest: 2
    translate_ids(run.model, src_ids, 1, 1.0, 1.2, 10, batch_tokens=60, workers=2)
    assert len(seen) > 4 and {n for _, n in seen} == {threads // 2}
    assert len({t for t, _ in seen}) == 2 and threading.get_ident() not in {t for t, _ in seen}
    seen.clear()
    translate_ids(run.model, src_ids, 1, 1.0, 1.2, 10, batch_tokens=60, workers=1)
    assert {t for t, _ in seen} == {threading.get_ident()} and {n for _, n in seen} == {threads}


def test_progress_counts_every_sentence_once(tiny_run: Path) -> None:
    """`progress` (a progress bar's update) hears of every input once, empty ones included, from
    two decoding threads, and in batches: one report per batch."""
    model = load_run(tiny_run).model
    src_ids = [[5 + i % 7] * (1 + i % 9) for i in range(40)] + [[]]
    reports: list[int] = []
    translate_ids(model, src_ids, 1, 1.0, 1.2, 10, batch_tokens=60, workers=2, progress=reports.append)
    assert sum(reports) == len(src_ids) and reports[0] == 1 and 2 < len(reports) < len(src_ids)


def test_an_error_in_a_decoding_thread_stops_the_rest(tiny_run: Path) -> None:
    """An error (or Ctrl-C) while threads decode ends the call with that error; the batches not
    started yet are dropped rather than decoded first, and torch's thread count is restored."""
    model = load_run(tiny_run).model
    threads, calls = torch.get_num_threads(), []

    def decode(batch: int) -> int:
        calls.append(batch)
        if batch == 39:  # the first batch handed out (last batch first)
            raise RuntimeError("batch 39 failed")
        time.sleep(0.05)
        return batch

    with pytest.raises(RuntimeError, match="batch 39 failed"):
        search.in_workers(decode, list(range(40)), 2, torch.device("cpu"), model)
    assert len(calls) < 10
    assert torch.get_num_threads() == threads
    assert search.in_workers(lambda b: 2 * b, list(range(5)), 2, torch.device("cpu"), model) == [0, 2, 4, 6, 8]


def test_an_error_or_ctrl_c_stops_the_batches_being_decoded_at_their_next_step(tiny_run: Path) -> None:
    """Ctrl-C waited for every running batch (a minute at large --batch-tokens), and a second one
    in that wait aborted the process (stop 64): the running batches now stop at their next step."""
    model = load_run(tiny_run).model
    src = pad_ids([[5, 6, 7]], suffix=EOS)
    memory = model.encode(src, make_src_mask(src))
    running, steps = threading.Event(), []

    def decode(batch: int) -> int:
        if batch == 0:  # decodes "forever": one step after another until it is given up
            with contextlib.suppress(search._Cancelled):
                while len(steps) < 100_000:
                    search._next_log_probs(model, src[:, :1], memory, make_src_mask(src), None)
                    steps.append(1)
                    running.set()
            return batch
        running.wait(60)
        raise RuntimeError("batch 1 failed")  # the result waited for first (last batch first)

    with torch.inference_mode(), pytest.raises(RuntimeError, match="batch 1 failed"):
        search.in_workers(decode, [0, 1], 2, torch.device("cpu"), model)
    assert 0 < len(steps) < 100_000  # given up, not decoded to its end


def test_stop_signals_within_signals_deferred_arrive_after_it() -> None:
    reached = False
    with pytest.raises(KeyboardInterrupt), errors.signals_deferred():
        signal.raise_signal(signal.SIGINT)
        reached = True
    assert reached


def test_decoding_threads_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert search.decode_workers(0, cpu) == 2
    assert search.decode_workers(3, cpu) == 3
    assert search.decode_workers(0, torch.device("cuda")) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert search.decode_workers(0, cpu) == 1
    assert search.decode_workers(2, cpu) == 1  # never more threads than torch's


@pytest.mark.parametrize("beam", [1, 4])
def test_cached_equals_uncached(run: LoadedRun, src_ids: list[list[int]], beam: int) -> None:
    cached = translate_ids(run.model, src_ids[:20], beam, 1.0, 1.2, 10, 100_000, nbest=beam)
    uncached = translate_ids(run.model, src_ids[:20], beam, 1.0, 1.2, 10, 100_000, nbest=beam, use_cache=False)
    for a, b in zip(cached, uncached, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_nbest_sorted_and_first_is_one_best(run: LoadedRun, src_ids: list[list[int]]) -> None:
    nbest = translate_ids(run.model, [[], *src_ids], 4, 1.0, 1.2, 10, 100_000, nbest=4)
    best = translate_ids(run.model, [[], *src_ids], 4, 1.0, 1.2, 10, 100_000, nbest=1)
    assert [h.tokens for h in nbest[0]] == [[]] * 4  # an empty input: K empty translations, as many as any
    for hyps, one in zip(nbest, best, strict=True):
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True) and len(hyps) == 4
        assert hyps[0].tokens == one[0].tokens
        if hyps[0].tokens:  # four different translations, not one beam four times
            assert len({tuple(h.tokens) for h in hyps}) == 4
        for h in hyps:  # score is the length-normalised log-probability
            assert h.score == pytest.approx(h.log_prob / length_penalty(len(h.tokens) + 1, 1.0), abs=1e-5)


def test_forced_decoding_gives_the_searches_own_scores(run: LoadedRun, src_ids: list[list[int]]) -> None:
    """`mtx score`'s teacher-forced log-probability of a search's output is the log-probability
    the search summed for it, step by step through the KV cache: for greedy and for each of a
    4-best list, whatever the batch."""
    nbest = translate_ids(run.model, src_ids, 4, 1.0, 1.2, 10, 100_000, nbest=4)
    greedy = translate_ids(run.model, src_ids, 1, 1.0, 1.2, 10, 100_000)
    hyps = [h for hs in nbest + greedy for h in hs]
    pairs_src = [s for s, hs in zip(src_ids * 2, nbest + greedy, strict=True) for _ in hs]
    one_batch = forced_log_probs(run.model, pairs_src, [h.tokens for h in hyps], 100_000)
    one_at_a_time = forced_log_probs(run.model, pairs_src, [h.tokens for h in hyps], 1)
    assert one_batch == pytest.approx([h.log_prob for h in hyps], abs=1e-4)
    assert one_at_a_time == pytest.approx(one_batch, abs=1e-4)
    beams = len(hyps) - len(greedy)
    for h, forced in zip(hyps[:beams], one_batch[:beams], strict=True):  # beam's: length-normalised
        assert forced / length_penalty(len(h.tokens) + 1, 1.0) == pytest.approx(h.score, abs=1e-4)
    assert len({len(h.tokens) for h in hyps}) > 3  # outputs of many lengths, padded in one batch


@pytest.mark.parametrize("beam", [1, 4])
def test_searches_never_emit_pad_or_bos(beam: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Label smoothing gives PAD and BOS probability, so an undertrained model may rank them
    first; their text is empty, so a translation lost a word to each and an n-best list could
    hold one text twice (stop 56). Here they get the top logits at every step: both searches,
    cached and not, must pass them over."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)
    model = Seq2Seq(cfg, 12, 12, True).eval()
    decode = model.decode

    def preferring_specials(*args: object, **kwargs: object) -> torch.Tensor:
        logits = decode(*args, **kwargs)  # type: ignore[arg-type]
        logits[..., PAD] += 50.0
        logits[..., BOS] += 40.0
        return logits

    monkeypatch.setattr(model, "decode", preferring_specials)
    for use_cache in (True, False):
        found = translate_ids(model, [[4, 5, 6], [7], [8, 9]], beam, 1.0, 0.0, 6, 1000, nbest=beam, use_cache=use_cache)
        for hyps in found:
            assert all(PAD not in h.tokens and BOS not in h.tokens for h in hyps)
            assert len({tuple(h.tokens) for h in hyps}) == beam and all(math.isfinite(h.score) for h in hyps)


def _count_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the decoder rows of each search into the last entry of the list returned (append
    a 0 to start the next count)."""
    rows = [0]
    next_log_probs = search._next_log_probs

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        out = next_log_probs(*args, **kwargs)
        rows[-1] += out.shape[0]
        return out

    monkeypatch.setattr(search, "_next_log_probs", counting)
    return rows


def test_stopping_at_the_nbest_th_finished_hypothesis_changes_no_output(
    run: LoadedRun, src_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1-best search stops once its best finished hypothesis cannot be beaten: the same
    output and score as a search that waits for `beam` of them, from fewer decoded rows."""
    rows = _count_rows(monkeypatch)
    src = _batch(src_ids)
    results = []
    for nbest in (5, 1):
        if results:
            rows.append(0)
        results.append(beam_search(run.model, src, 5, 1.4, 1.2, 10, nbest=nbest))
    waited, early = results
    assert [h[0].tokens for h in early] == [h[0].tokens for h in waited]
    assert [h[0].score for h in early] == pytest.approx([h[0].score for h in waited], abs=1e-5)
    assert rows[1] < rows[0]


@pytest.mark.parametrize("nbest", [1, 5])
def test_the_finished_stop_scores_at_most_the_exact_stop(
    run: LoadedRun, src_ids: list[list[int]], nbest: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stop="finished"` (fairseq's rule: stop once `beam` hypotheses have finished) keeps the
    hypotheses a search run to the length cap finishes by then: sorted n-best lists whose best
    scores at most the exact stop's best (below it for some sentence of the tiny models), from fewer
    decoded rows, the same output whether decoded in one batch or alone."""
    src = _batch(src_ids)
    rows = _count_rows(monkeypatch)
    exact = beam_search(run.model, src, 5, 1.4, 1.2, 10, nbest=nbest)
    rows.append(0)
    finished = beam_search(run.model, src, 5, 1.4, 1.2, 10, nbest=nbest, stop="finished")
    assert rows[1] < rows[0]  # fewer decoded rows: the rule is applied, not the exact stop again
    assert any(f[0].score < e[0].score - 1e-5 for e, f in zip(exact, finished, strict=True))
    for e, f in zip(exact, finished, strict=True):
        assert len(f) == nbest and [h.score for h in f] == sorted((h.score for h in f), reverse=True)
        assert f[0].score <= e[0].score + 1e-5
        for h in f:  # score is the length-normalised log-probability
            assert h.score == pytest.approx(h.log_prob / length_penalty(len(h.tokens) + 1, 1.4), abs=1e-5)
    single = [beam_search(run.model, _batch([s]), 5, 1.4, 1.2, 10, nbest=nbest, stop="finished")[0] for s in src_ids]
    assert [[h.tokens for h in hyps] for hyps in single] == [[h.tokens for h in hyps] for hyps in finished]
    with pytest.raises(ValueError, match="stop must be one of"):
        beam_search(run.model, src, 5, 1.4, 1.2, 10, stop="early")


def test_output_length_cap_and_empty_input(run: LoadedRun, src_ids: list[list[int]]) -> None:
    hyps = translate_ids(run.model, [[], *src_ids[:5]], 3, 1.0, 0.0, 3, 100_000)
    assert hyps[0][0].tokens == []
    assert all(len(h[0].tokens) <= 2 for h in hyps)  # at most 3 outputs, EOS included
    # an untrained tiny model runs to the cap: exactly 2 pieces, not an EOS forced a step early
    assert [len(h[0].tokens) for h in hyps[1:]] == [2] * 5


def test_length_penalty_and_output_cap_values(tiny_run: Path) -> None:
    """The formulas themselves, pinned to numbers: GNMT's ((5 + |Y|) / 6) ** alpha, and a cap of
    floor(a * source length + b) tokens (the source's EOS counted), within the model's positions."""
    assert length_penalty(7, 1.4) == pytest.approx(2**1.4)
    assert length_penalty(3, 0.0) == 1.0 and length_penalty(1, 1.0) == 1.0
    model = load_run(tiny_run).model
    src = _batch([[5] * 9, [5] * 2, [5] * 200])  # 10, 3 and 201 positions with EOS
    caps = search.max_output_lengths(src, 1.2, 10, model).tolist()
    assert caps == [22, 13, model.cfg.max_positions - 1]
    assert search.max_output_lengths(src, 0.0, 0, model).tolist() == [1, 1, 1]
    # whole decimal products are not floored one short (stop 53: float32 made 1.3 * 90 + 10 a cap of 126)
    src = _batch([[5] * 89, [5] * 99, [5] * 49])  # 90, 100 and 50 positions
    assert search.max_output_lengths(src, 1.3, 10, model).tolist() == [127, 140, 75]
    assert search.max_output_lengths(_batch([[5] * 49, [5] * 29]), 2.1, 0, model).tolist() == [105, 63]
    # a huge a ("no cap") is the positions' cap (stop 54: int64 overflowed to a negative cap, so 1)
    assert search.max_output_lengths(src, 1e20, 10, model).tolist() == [model.cfg.max_positions - 1] * 3


def test_overlong_input_is_truncated_with_a_warning(run: LoadedRun, caplog: pytest.LogCaptureFixture) -> None:
    long = [7] * (run.model.cfg.max_positions + 20)
    hyps = translate_ids(run.model, [long], 2, 1.0, 1.2, 10, 100_000)
    assert len(hyps) == 1 and "truncated (model.max_positions): line(s) 1\n" in caplog.text + "\n"
    # the lines cut are named by their number in the input, the first ten of them
    caplog.clear()
    cut = within_positions([[7]] + [long] * 12, run.model, first_line=101)
    assert [len(s) for s in cut] == [1] + [run.model.cfg.max_positions - 1] * 12
    assert "12 input sentence(s)" in caplog.text and "line(s) 102, 103, 104" in caplog.text
    assert "110, 111 and 2 more" in caplog.text


def test_restricted_output_emits_only_its_tokens(tiny_restricted_run: Path, small_data: Path) -> None:
    run = load_run(tiny_restricted_run)
    allowed = set(run.model.output_ids.tolist())
    assert len(allowed) < run.tgt_tok.vocab_size and EOS in allowed
    src_ids = run.src_tok.encode_batch(read_lines(small_data / "val.de")[:40])
    for beam in (1, 4):
        hyps = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=100_000, nbest=beam)
        tokens = {t for hs in hyps for h in hs for t in h.tokens}
        assert tokens and tokens <= allowed


@pytest.mark.parametrize("fixture", ["tiny_run", "tiny_restricted_run"])
def test_an_ensemble_of_one_model_twice_decodes_as_the_model(fixture: str, request: pytest.FixtureRequest) -> None:
    run = load_run(request.getfixturevalue(fixture))
    twice = Ensemble([run.model, copy.deepcopy(run.model)])
    src_ids = run.src_tok.encode_batch(read_lines(request.getfixturevalue("small_data") / "val.de")[:20])
    for beam in (1, 4):
        alone = translate_ids(run.model, src_ids, beam, 1.0, 1.2, 10, batch_tokens=100_000, nbest=beam)
        ensembled = translate_ids(twice, src_ids, beam, 1.0, 1.2, 10, batch_tokens=100_000, nbest=beam)
        assert [[h.tokens for h in hs] for hs in ensembled] == [[h.tokens for h in hs] for hs in alone]
        scores = [h.score for hs in ensembled for h in hs]
        assert scores == pytest.approx([h.score for hs in alone for h in hs], abs=1e-4)


def test_an_ensemble_differs_from_its_members_and_checks_their_outputs(
    tiny_run: Path, tiny_restricted_run: Path
) -> None:
    last, ema = (load_run(tiny_run, [tiny_run / "checkpoints" / name]).model for name in ("last.pt", "ema.pt"))
    src = _batch([[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    tgt = torch.tensor([[BOS, 30, 31], [BOS, 40, 41]])  # any prefixes
    mask = make_src_mask(src)
    ensemble = Ensemble([last, ema])
    memory = ensemble.encode(src, mask)
    assert memory.shape[-1] == 2 * last.cfg.d_model
    got = ensemble.decode(tgt, memory, mask)
    # the mean of the members' probabilities, not of their log-probabilities
    probs = [torch.softmax(m.decode(tgt, m.encode(src, mask), mask), dim=-1) for m in (last, ema)]
    assert not torch.allclose(probs[0], probs[1], atol=1e-3)
    assert torch.allclose(got, ((probs[0] + probs[1]) / 2).log(), atol=1e-5)
    assert torch.allclose(got.exp().sum(-1), torch.ones(2, 3), atol=1e-5)
    with pytest.raises(ValueError, match="output columns"):
        Ensemble([last, load_run(tiny_restricted_run).model])
    with pytest.raises(ValueError, match="at least 2"):
        Ensemble([last])


def test_an_nbest_list_holds_each_text_once() -> None:
    """Byte-level pieces spell one text in several ways ("a" and "Ġa" both decode to "a"), and an
    n-best list showed such a text twice. With `text_key` the segmentations of one text count once,
    at the best score; the 1-best is unchanged and every list still holds `nbest` entries. Here a
    coarse key (the set of tokens) makes many sequences one "text"."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)
    model = Seq2Seq(cfg, 12, 12, True).eval()
    srcs = [[4, 5, 6], [7], [8, 9], [], [10, 11, 4, 5]]

    def text(ids: list[int]) -> tuple[int, ...]:
        return tuple(sorted(set(ids)))

    for stop in ("exact", "finished"):
        plain = translate_ids(model, srcs, 6, 1.0, 0.0, 6, 1000, nbest=6, stop=stop)
        once = translate_ids(model, srcs, 6, 1.0, 0.0, 6, 1000, nbest=6, stop=stop, text_key=text)
        best = translate_ids(model, srcs, 6, 1.0, 0.0, 6, 1000, nbest=1, stop=stop)
        texts = [[len({text(h.tokens) for h in hyps})] for hyps in plain]
        for hyps, one, count, every in zip(once, best, texts, plain, strict=True):
            assert len(hyps) == 6 and hyps[0].tokens == one[0].tokens
            assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
            count.append(len({text(h.tokens) for h in hyps}))
            # each text at its best segmentation's score (other segmentations only fill a list of
            # fewer texts); stop 69's mutation probe: keeping the worse one passed
            for key in {text(h.tokens) for h in hyps}:
                kept = max(h.score for h in hyps if text(h.tokens) == key)
                assert all(p.score <= kept + 1e-6 for p in every if text(p.tokens) == key)
        # more different texts wherever the plain list repeated one, all 6 in some
        assert all(b >= a for a, b in texts) and any(a < b == 6 for a, b in texts), texts
        assert [h.tokens for h in once[3]] == [[]] * 6  # an empty input: as before


class _TwoSpellings:
    """A model over 8 columns whose outputs are fixed by the last token: after BOS, b (0.35), a
    (0.30), a' (0.30, another spelling of a), EOS; a and a' end; b ends or goes on to c, which
    ends. Two segmentations of "a" finish at the first step."""

    cfg = SimpleNamespace(max_positions=50)
    eos_column = EOS
    unemitted_columns = 2

    def encode(self, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(src.shape[0], src.shape[1], 4)

    def new_cache(self, float32_self: bool = False) -> None:
        return None

    def output_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        return columns

    @contextlib.contextmanager
    def packed_weights(self) -> Iterator[None]:
        yield

    nexts = {BOS: {6: 0.35, 4: 0.30, 5: 0.30, EOS: 0.05}, 4: {EOS: 0.999}, 5: {EOS: 0.999}, 6: {EOS: 0.5, 7: 0.5}}
    nexts[7] = {EOS: 0.999}

    def decode(self, tokens: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor, cache: None) -> torch.Tensor:
        out = torch.full((tokens.shape[0], tokens.shape[1], 8), -30.0)
        for i, last in enumerate(tokens[:, -1].tolist()):
            for column, p in self.nexts.get(last, {}).items():
                out[i, -1, column] = math.log(p)
        return out


def test_fairseqs_stop_counts_every_finished_hypothesis_with_an_nbest_list_of_texts() -> None:
    """--stop finished ends a sentence once `beam` hypotheses have finished; with --nbest's
    text_key it counted different texts only, ran on, and found another 1-best (stop 63)."""
    words = {4: "a", 5: "a", 6: "b", 7: "c"}

    def text(ids: list[int]) -> str:
        return " ".join(words.get(t, "?") for t in ids)

    src = torch.tensor([[9, 9, EOS]])
    for stop in ("finished", "exact"):
        one = beam_search(_TwoSpellings(), src, 3, 10.0, 1.2, 10, nbest=1, stop=stop)[0]  # type: ignore[arg-type]
        many = beam_search(_TwoSpellings(), src, 3, 10.0, 1.2, 10, nbest=3, stop=stop, text_key=text)[0]  # type: ignore[arg-type]
        assert text(many[0].tokens) == text(one[0].tokens) and many[0].score == pytest.approx(one[0].score)
    # fairseq's stop ends once three hypotheses have finished, "a" the best of them;
    # the exact search goes on to a longer, better output
    first = beam_search(_TwoSpellings(), src, 3, 10.0, 1.2, 10, nbest=1, stop="finished")[0]  # type: ignore[arg-type]
    assert text(first[0].tokens) == "a" and len(one[0].tokens) > 1 and one[0].score > first[0].score


class _LongerWins(_TwoSpellings):
    """After BOS: EOS (0.6) or 4 (0.4), which goes on to 5, 6, 7 and EOS at 0.999 each: with the
    length penalty's alpha 2, the longer output wins (-0.331 against -0.511)."""

    nexts = {BOS: {EOS: 0.6, 4: 0.4}, 4: {5: 0.999}, 5: {6: 0.999}, 6: {7: 0.999}, 7: {EOS: 0.999}}


def test_the_exact_stop_waits_for_a_running_hypothesis_that_the_length_penalty_can_lift() -> None:
    """A running hypothesis's best normalised score is bounded at the longest length it can reach:
    stop 69's mutation probe bounded it at the next step's, which ended the search after step 1
    with the worse output, and no test saw it."""
    src = torch.tensor([[9, 9, EOS]])
    for stop in ("exact", "finished"):
        found = beam_search(_LongerWins(), src, 2, 2.0, 0.0, 6, nbest=1, stop=stop)[0]  # type: ignore[arg-type]
        assert found[0].tokens == ([4, 5, 6, 7] if stop == "exact" else [])
    assert found[0].score == pytest.approx(math.log(0.6))  # fairseq's stop: the first `beam` finished


def test_greedy_stops_at_the_length_cap_and_the_last_position() -> None:
    """Greedy keeps beam search's cap: a model that never chooses EOS gives cap - 1 pieces (EOS
    is the cap-th output), and a cap past the positions stops at the last one (stop 69's mutation
    probe: greedy forcing EOS a step late was caught only by one sentence of the trained run)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, max_positions=16)
    model = Seq2Seq(cfg, 40, 40, joint_vocab=True).eval()
    with torch.no_grad():
        model.tgt_embed.tokens.weight[EOS].zero_()  # EOS's logit 0: never the arg-max of this model
    hyps = translate_ids(model, [[5, 6, 7], [8], [9, 10]], 1, 1.0, 0.0, 3, 1000)
    assert [len(h[0].tokens) for h in hyps] == [2, 2, 2]
    hyps = translate_ids(model, [[5, 6, 7]], 1, 1.0, 1e20, 0, 1000)  # no cap but the positions
    assert len(hyps[0][0].tokens) == 16 - 2


def _textbook_beam(model: Seq2Seq, src: list[int], k: int, alpha: float, cap: int) -> list[tuple[list[int], float]]:
    """Beam search as described, without a cache, run to the length cap: each step's 2k best
    candidates; an EOS among the first k finishes (its score over the GNMT penalty), the k best
    others go on."""
    s = torch.tensor([[*src, EOS]])
    mask = make_src_mask(s)
    memory = model.encode(s, mask)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for step in range(1, cap + 1):
        tgt = torch.tensor([[BOS, *prefix] for prefix, _ in beams])
        n = len(beams)
        lp = model.decode(tgt, memory.expand(n, -1, -1), mask.expand(n, -1, -1, -1))[:, -1].float().log_softmax(-1)
        lp[:, : model.unemitted_columns] = float("-inf")
        if step == cap:  # only EOS at the cap
            lp[:, :EOS] = lp[:, EOS + 1 :] = float("-inf")
        candidates = sorted(
            ((total + float(lp[b, v]), b, v) for b, (_, total) in enumerate(beams) for v in range(lp.shape[1])),
            key=lambda c: -c[0],
        )[: 2 * k]
        finished += [
            (beams[b][0], score / length_penalty(step, alpha))
            for score, b, v in candidates[:k]
            if v == EOS and score > float("-inf")
        ]
        beams = [(beams[b][0] + [v], score) for score, b, v in candidates if v != EOS][:k]
    return sorted(finished, key=lambda f: -f[1])


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("nbest", [1, 3])
def test_beam_search_equals_a_textbook_beam_search(alpha: float, nbest: int) -> None:
    """Against an independent beam search with a beam narrower than the vocabulary (stop 69's
    mutation probe: finishing an EOS from all 2k candidates, not the first k, passed every test)."""
    torch.manual_seed(3)
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2, max_positions=32)
    model = Seq2Seq(cfg, 12, 12, joint_vocab=True).eval()
    with torch.no_grad():
        model.src_embed.tokens.weight.mul_(3.0)
    sources = [[4, 5, 6], [7, 8], [9], [10, 11, 4, 5], [6, 6], [11, 9, 8], [5], [8, 4]]
    k, cap = 3, 7
    with torch.inference_mode():
        found = beam_search(model, pad_ids(sources, suffix=EOS), k, alpha, 0.0, cap, nbest=nbest)
        for hyps, src in zip(found, sources, strict=True):
            want = _textbook_beam(model, src, k, alpha, cap)[:nbest]
            assert [h.tokens for h in hyps] == [tokens for tokens, _ in want]
            assert [h.score for h in hyps] == pytest.approx([score for _, score in want], abs=1e-5)
