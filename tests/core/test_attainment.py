"""The tail model behind replica capacity: its compound-Poisson TPOT term against a Monte Carlo of the same
assumptions, monotone in load, and the mix's quantiles (observed or log-normal) it reads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rayscale.config import load_catalog
from rayscale.core.attainment import (
    ROUTER_CHOICES,
    RTOL,
    WEIGHTS,
    at_load,
    largest_load,
    late_share,
    lognormal_quantiles,
    mix_quantiles,
    tpot_quantile,
)
from rayscale.core.estimate import Correction, replica_capacity, rows_of, tpot_at, tpot_p95_at
from rayscale.core.signals import MIX_QUANTILES, RequestMix, length_quantiles

CAT = load_catalog()
SLO_ = CAT.models["mistral-7b"].slo
RNG = np.random.default_rng(0)
CODE_P = np.clip(RNG.lognormal(np.log(1500), 0.8, 20000), 10, 7400)
CODE_O = np.clip(RNG.lognormal(np.log(15), 1.0, 20000), 1, 500)
CODE = RequestMix(float(CODE_P.mean()), float(CODE_O.mean()), float(np.percentile(CODE_P, 95)),
                  length_quantiles(CODE_P), length_quantiles(CODE_O))


@pytest.mark.parametrize("flavor", ["inf2", "a10g", "l40s"])
@pytest.mark.parametrize("batch", [0.5, 2.0, 6.0])
def test_tpot_tail_matches_a_monte_carlo_of_its_own_assumptions(flavor: str, batch: float) -> None:
    """The closed form (an atom at zero plus a log-normal for the stall sum) against sampling the same
    process: per output node, Poisson prompts over its decode, each prompt's engine time from the mix."""
    prof = CAT.profile("mistral-7b", flavor)
    at = at_load(rows_of([prof], [SLO_], [CODE], [Correction()]), np.array([batch]))
    assert at.tpot_miss[0] == pytest.approx(_sampled_tpot_miss(prof, batch, at, seed=1), abs=0.002, rel=0.15)


def _sampled_tpot_miss(prof, batch: float, at, seed: int) -> float:  # type: ignore[no-untyped-def]
    """The TPOT misses of the tail model's assumptions, sampled: per output node, Poisson prompts over its
    decode (at the rate the router sends to a busy replica), each prompt's engine time from the mix; a stall
    breaks the TPOT only in a step whose decode batch (Poisson around ``batch``) leaves less room than one
    chunk of the profile's (vLLM's default where it pins none)."""
    p, o = (np.array(q) for q in mix_quantiles(CODE))
    s = prof.itl_s(batch)
    engine = prof.prefill_seq_s + p / prof.prefill_tokens_per_s + prof.prefill_quadratic_s * p * p
    chunk = prof.max_num_batched_tokens or 2048
    cap = prof.prefill_seq_s + chunk / prof.prefill_tokens_per_s + prof.prefill_quadratic_s * chunk * chunk
    rate, tpot_mean = float(at.rps[0]), float(at.tpot_mean_s[0])
    rng = np.random.default_rng(seed)
    n = 200_000
    miss = 0.0
    for w, out in zip(WEIGHTS, o, strict=True):
        if out <= 1:
            continue
        lam = rate * min(batch, 1.0) ** (ROUTER_CHOICES - 1) * tpot_mean * (out - 1)
        k = rng.poisson(lam, n)
        picks = rng.choice(len(p), size=int(k.sum()), p=WEIGHTS)
        stall = np.bincount(np.repeat(np.arange(n), k), weights=engine[picks], minlength=n)
        fits = prof.itl_alpha_s + prof.itl_beta_s * np.maximum(rng.poisson(batch, n), 1) + cap <= SLO_.tpot_p95_s
        miss += w * float(np.mean(~fits & (s + stall / (out - 1) > SLO_.tpot_p95_s)))
    return miss


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(CAT.models["mistral-7b"].parallelism)), st.floats(0.01, 100), st.floats(1.05, 3))
# Near saturation the late prompts and the waits overlap: summed, the TTFT miss share read 1.00036 here.
@example("l4", 25.890625, 2.0)
def test_misses_grow_with_load(flavor: str, batch: float, more: float) -> None:
    rows = rows_of([CAT.profile("mistral-7b", flavor)], [SLO_], [CODE], [Correction()])
    lo, hi = at_load(rows, np.array([batch])), at_load(rows, np.array([batch * more]))
    assert hi.rps[0] > lo.rps[0]
    assert 0.0 <= lo.ttft_miss[0] <= 1.0 and 0.0 <= lo.tpot_miss[0] <= 1.0
    assert hi.ttft_miss[0] >= lo.ttft_miss[0] - 1e-12 and hi.tpot_miss[0] >= lo.tpot_miss[0] - 1e-12


def test_search_finds_the_crossing_to_its_tolerance_on_every_row() -> None:
    """The batched false-position search, on every shipped flavor under mixes from short chat to long code
    and corrections either way: the load it returns meets the allowance, and a load two tolerances above
    it does not (unless the KV/max_num_seqs bound is what stops it); the TPOT quantile likewise brackets the
    share it is asked for."""
    flavors = sorted(CAT.models["mistral-7b"].parallelism)
    mixes = [CODE, RequestMix(300, 400, 900), RequestMix(4000, 50, 7000), RequestMix(1000, 200, 3000)]
    cases = [(f, m, c) for f in flavors for m in mixes for c in (Correction(), Correction(1.5, 1.3),
                                                                 Correction(0.7, 0.8))]
    rows = rows_of([CAT.profile("mistral-7b", f) for f, _, _ in cases], [SLO_] * len(cases),
                   [m for _, m, _ in cases], [c for _, _, c in cases])
    high = np.full(len(cases), 256.0)
    batch = largest_load(rows, high, 0.01)
    searched = batch > 0
    assert searched.sum() > len(cases) // 2  # most cases have a load to find
    assert np.all(at_load(rows, np.where(searched, batch, 1.0)).miss[searched] <= 0.01 + 1e-12)
    above = np.minimum(batch * (1 + RTOL) ** 2, high)
    inside = searched & (batch < high)
    assert np.all(at_load(rows, above).miss[inside] > 0.01)
    # Row by row, the same answers: a row's search depends on that row alone.
    one = [float(largest_load(rows_of([CAT.profile("mistral-7b", f)], [SLO_], [m], [c]), high[:1], 0.01)[0])
           for f, m, c in cases]
    assert batch.tolist() == one
    # The TPOT p95 at half the capacity: 5% of the multi-token requests miss it, fewer miss 2 tolerances above.
    load = np.where(searched, batch / 2, 1.0)
    t = tpot_quantile(rows, load)
    multi = ((rows.output > 1) * WEIGHTS).sum(axis=1)
    share = at_load(rows_of([CAT.profile("mistral-7b", f) for f, _, _ in cases], [SLO_.model_copy(
        update={"tpot_p95_s": float(x) * (1 + 1e-9)}) for x in t], [m for _, m, _ in cases],
        [c for _, _, c in cases]), load)  # (a hair above: at exactly no stall, the model counts a miss)
    assert np.all(share.tpot_miss <= 0.05 * multi + 1e-12)
    lower = at_load(rows_of([CAT.profile("mistral-7b", f) for f, _, _ in cases], [SLO_.model_copy(
        update={"tpot_p95_s": float(x)}) for x in t / (1 + RTOL) ** 2], [m for _, m, _ in cases],
        [c for _, _, c in cases]), load)
    stalls = t > rows.corr_tpot * (rows.alpha + rows.beta * np.maximum(load, 1.0)) * (1 + RTOL) ** 2
    assert stalls.sum() > len(cases) // 2  # most p95s include a stall; the rest are a decode iteration
    assert np.all(lower.tpot_miss[stalls] > 0.05 * multi[stalls])


def test_share_of_prompts_too_long_to_prefill_in_time_follows_the_sample() -> None:
    """The late share read off the nine quantile nodes against the share of the sample's own prompts past p*,
    for budgets whose p* runs from the median to past the longest node."""
    prompts = np.random.default_rng(3).lognormal(np.log(1500), 0.8, 200_000)
    mix = RequestMix(float(prompts.mean()), 15.0, float(np.percentile(prompts, 95)), length_quantiles(prompts))
    rows = rows_of([CAT.profile("mistral-7b", "inf2")], [SLO_], [mix], [Correction()])
    per_token = 1.0 / rows.prefill_tokens_per_s
    for p_star in np.quantile(prompts, [0.5, 0.8, 0.93, 0.97, 0.98, 0.99, 0.995, 0.998]):
        budget = p_star * per_token + rows.quad_s * p_star * p_star
        sampled = float(np.mean(prompts > p_star))
        assert float(late_share(rows, budget, per_token)[0]) == pytest.approx(sampled, rel=0.25, abs=5e-4)
    assert late_share(rows, np.array([0.0]), per_token)[0] == 1.0


def test_the_prompt_tail_ends_at_the_longest_prompt() -> None:
    """Past the top node the share falls to 0 at the window's longest prompt, continuous at the node, where
    a log-normal's tail would count prompts past any the window had late (the generator clips at 8k)."""
    prompts = np.minimum(np.random.default_rng(4).lognormal(np.log(1000), 0.8, 200_000), 12_000)
    q = length_quantiles(prompts)
    ended, unended = (RequestMix(float(prompts.mean()), 15.0, float(np.percentile(prompts, 95)), q, None, end)
                      for end in (float(prompts.max()), None))
    rows = rows_of([CAT.profile("mistral-7b", "inf2")] * 2, [SLO_] * 2, [ended, unended], [Correction()] * 2)
    per_token = 1.0 / rows.prefill_tokens_per_s
    for p_star in (q[-1] * 0.999, q[-1] * 1.001, 9000.0, 10_000.0, 11_000.0, 11_990.0, 12_000.0, 15_000.0):
        budget = p_star * per_token + rows.quad_s * p_star * p_star
        share = late_share(rows, budget, per_token)
        sampled = float(np.mean(prompts > p_star))
        assert share[0] == pytest.approx(sampled, abs=1e-3)
        if p_star < q[-1]:
            assert share[0] == share[1]  # below the top node the end changes nothing
    at_end = 12_000.0 * per_token + rows.quad_s * 12_000.0**2
    assert late_share(rows, at_end, per_token)[0] == 0.0 < late_share(rows, at_end, per_token)[1]
    near = [late_share(rows, x * per_token + rows.quad_s * x * x, per_token)[0] for x in (q[-1] * 0.999, q[-1] * 1.001)]
    assert abs(near[0] - near[1]) < 1e-4  # continuous at the top node


def test_the_longest_prompts_cross_the_ttft_budget_gradually() -> None:
    """As a window's longest prompts grow past what inf2 prefills within the TTFT target, the misses grow by
    a fraction of a point per step: counting the top node (1% of requests, a 99% SLO's whole allowance) late
    whole flipped a flavor's capacity 10-20x between periods on a few prompts."""
    quantiles = np.array(mix_quantiles(CODE)[0])
    prof = CAT.profile("mistral-7b", "inf2")
    longest = np.linspace(0.8, 1.25, 46) * SLO_.ttft_p95_s * prof.prefill_tokens_per_s
    mixes = [RequestMix(CODE.prompt_mean, CODE.output_mean, CODE.prompt_p95,
                        (*quantiles[:-1], max(top, quantiles[-2])), CODE.output_quantiles) for top in longest]
    rows = rows_of([prof] * len(mixes), [SLO_] * len(mixes), mixes, [Correction()] * len(mixes))
    miss = at_load(rows, np.full(len(mixes), 1.0)).ttft_miss
    assert miss[0] < miss[-1] - 0.003  # the top prompts do cross the budget within the sweep
    assert float(np.max(np.abs(np.diff(miss)))) < 0.002


def test_slow_prefill_costs_a_prompt_heavy_mix_most() -> None:
    """The mean model priced inf2 within 8% of L40S per request on a chat mix and the engine measured 1.9x
    (bench/results/capacity_error.md); the tail model sees the gap."""
    chat_p = np.clip(RNG.lognormal(np.log(1000), 1.0, 20000), 8, 8000)
    chat_o = np.clip(RNG.lognormal(np.log(100), 0.9, 20000), 1, 2000)
    chat = RequestMix(float(chat_p.mean()), float(chat_o.mean()), float(np.percentile(chat_p, 95)),
                      length_quantiles(chat_p), length_quantiles(chat_o))
    usd = {"inf2": 0.76, "l40s": 1.86}
    per_req = {f: usd[f] / replica_capacity(CAT.profile("mistral-7b", f), SLO_, chat, target_utilization=1.0).rps
               for f in usd}
    assert per_req["inf2"] > 1.5 * per_req["l40s"]


def test_quantiles_observed_or_lognormal() -> None:
    # A log-normal's nodes through its own mean and p95 give back that distribution's quantiles.
    x = RNG.lognormal(np.log(1000), 0.8, 400_000)
    fit = lognormal_quantiles(float(x.mean()), float(np.percentile(x, 95)))
    assert np.allclose(fit, np.quantile(x, MIX_QUANTILES), rtol=0.03)
    # The mix's own quantiles win; without them prompts stop at 1.5x their p95, outputs at least one token.
    assert mix_quantiles(CODE) == (CODE.prompt_quantiles, CODE.output_quantiles)
    bare = RequestMix(2000.0, 3.0, 7000.0)
    p, o = mix_quantiles(bare)
    assert max(p) == pytest.approx(10500.0) and min(o) == 1.0 and len(p) == len(MIX_QUANTILES)
    with pytest.raises(ValueError, match="prompt_quantiles: expected 9 lengths"):
        RequestMix(1.0, 1.0, 1.0, prompt_quantiles=(1.0, 2.0))
    assert sum(WEIGHTS) == pytest.approx(1.0)


def test_predicted_tpot_p95_is_what_the_model_calls_the_95th_percentile() -> None:
    """The correction's yardstick: at the TPOT p95 the model predicts, 5% of multi-token requests miss."""
    prof = CAT.profile("mistral-7b", "inf2")
    for batch in (0.5, 3.0, 10.0):
        p95 = tpot_p95_at(prof, SLO_, CODE, batch)
        multi = float(((np.array(CODE.output_quantiles) > 1) * WEIGHTS).sum())

        def miss(t: float, batch: float = batch) -> float:
            rows = rows_of([prof], [SLO_.model_copy(update={"tpot_p95_s": t})], [CODE], [Correction()])
            return float(at_load(rows, np.array([batch])).tpot_miss[0])

        assert miss(p95) <= 0.05 * multi < miss(0.98 * p95)  # resolved to ~1%
        assert p95 > tpot_at(prof, batch, CODE)  # the tail is above the mean request


def _search_cases() -> tuple[list[tuple[str, RequestMix, Correction]], np.ndarray]:
    flavors = sorted(CAT.models["mistral-7b"].parallelism)
    mixes = [CODE, RequestMix(300, 400, 900), RequestMix(4000, 50, 7000)]
    cases = [(f, m, c) for f in flavors for m in mixes for c in (Correction(), Correction(1.5, 1.3))]
    return cases, np.full(len(cases), 256.0)


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the tail model's calls (one call evaluates every point of a search step) and, second, the
    points they evaluated."""
    import rayscale.core.attainment as att

    calls = [0, 0]
    real = att.at_load

    def counted(rows, batch, alone=False):  # type: ignore[no-untyped-def]
        calls[0] += 1
        calls[1] += len(batch)
        return real(rows, batch, alone)

    monkeypatch.setattr(att, "at_load", counted)
    return calls


def test_a_guess_from_last_period_ends_the_search_in_two_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control loop passes last period's answers: unchanged inputs give the same answer exactly (no drift
    of a step per period) after two evaluations a row (the guess and a step from it), one where the answer
    was the cap, in two calls; a guess that is off, near, far or past the cap, still gives an answer to the
    search's tolerance."""
    cases, high = _search_cases()
    rows = rows_of([CAT.profile("mistral-7b", f) for f, _, _ in cases], [SLO_] * len(cases),
                   [m for _, m, _ in cases], [c for _, _, c in cases])
    calls = _calls(monkeypatch)
    cold = largest_load(rows, high, 0.01)
    cold_calls = calls[0]
    searched = (cold > 0) & (cold < high)
    assert searched.sum() > len(cases) // 2
    capped = int((cold == high).sum())  # within the SLO at the cap (KV cache, max_num_seqs): one evaluation
    assert capped > 0
    calls[:] = [0, 0]
    warm = largest_load(rows, high, 0.01, guess=cold)
    assert calls == [2, 2 * len(cases) - capped]
    assert calls[0] < cold_calls
    assert warm.tolist() == cold.tolist()
    # Every guess at the cap, as after a period whose answers all were: the capped rows stay, the others
    # step down from it to an answer within the tolerance.
    for factor in (1.004, 1 / 1.004, 3.0, 1 / 3.0, 1e9):
        got = largest_load(rows, high, 0.01, guess=cold * factor)
        assert np.all(at_load(rows, np.where(searched, got, 1.0)).miss[searched] <= 0.01 + 1e-12)
        above = np.minimum(got * (1 + RTOL) ** 2, high)
        assert np.all(at_load(rows, above).miss[searched] > 0.01)
        assert np.all(np.abs(got[searched] / cold[searched] - 1) <= 2 * RTOL)
        assert np.all(got[cold == high] == high[cold == high])
    # The TPOT quantile likewise: its answer is the upper end, and a guess at it holds it.
    load = np.where(cold > 0, cold / 2, 1.0)
    t = tpot_quantile(rows, load)
    calls[:] = [0, 0]
    assert tpot_quantile(rows, load, guess=t).tolist() == t.tolist()
    assert calls == [2, 2 * len(cases)]
    off = tpot_quantile(rows, load, guess=t * 1.5)
    assert np.all(np.abs(off / t - 1) <= 2 * RTOL)


@pytest.mark.parametrize(("chunk", "batch"), [(512, 1.0), (1024, 1.0), (1024, 4.0), (1024, 12.0), (1536, 4.0),
                                               (2048, 1.0), (2048, 4.0)])
def test_a_gap_stalls_at_most_one_chunk(chunk: int, batch: float) -> None:
    """Chunked prefill caps what one decode step can wait: one chunk's prefill. A stall breaks a TPOT only in
    a step whose decode batch K leaves less room than a chunk; K is Poisson around the load. The closed form
    against a Monte Carlo of those assumptions, on the L40S (a 2,048-token chunk there is 0.14 s, past the
    0.1 s target whatever the batch; 1,024 fits beside up to k* = 26 decoding sequences)."""
    prof = CAT.profile("mistral-7b", "l40s").model_copy(update={"max_num_batched_tokens": chunk})
    rows = rows_of([prof], [SLO_], [CODE], [Correction()])
    at = at_load(rows, np.array([batch]))
    uncapped = at_load(rows_of([prof.model_copy(update={"max_num_batched_tokens": 10**9})], [SLO_], [CODE],
                               [Correction()]), np.array([batch]))
    assert at.ttft_miss[0] < 1.0  # a stable load: the prefill server keeps up
    miss = _sampled_tpot_miss(prof, batch, at, seed=2)
    assert at.tpot_miss[0] <= uncapped.tpot_miss[0] + 1e-12
    if chunk >= 1536:  # a chunk alone is over the target: the cap never helps
        assert at.tpot_miss[0] == pytest.approx(uncapped.tpot_miss[0], rel=1e-9)
    if chunk <= 1024 and batch <= 4.0:  # far below k*: practically no prefill stall breaks a TPOT
        assert at.tpot_miss[0] < 1e-6 < uncapped.tpot_miss[0]
    assert at.tpot_miss[0] == pytest.approx(miss, abs=0.002, rel=0.15)
