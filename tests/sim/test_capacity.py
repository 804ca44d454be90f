"""Capacity at the SLO measured on the simulated engine (the oracle's yardstick)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayscale.config import load_catalog
from rayscale.core.estimate import replica_capacity
from rayscale.core.signals import RequestMix, length_quantiles
from rayscale.sim.capacity import CapacitySettings, Probe, batch_limit, cheapest_capacity, measure_capacity
from rayscale.sim.engine import EngineConfig

CAT = load_catalog()
SLO = CAT.models["mistral-7b"].slo
SMALL = CapacitySettings(pool_sequences=64, requests_per_sequence=8, min_requests=400, iterations=5)
RNG = np.random.default_rng(0)
CHAT_P = np.clip(RNG.lognormal(np.log(1000), 0.6, 4000), 10, 6000).astype(np.int64)
CHAT_O = np.clip(RNG.lognormal(np.log(100), 0.6, 4000), 1, 1000).astype(np.int64)
CODE_P = np.clip(RNG.lognormal(np.log(1500), 0.8, 4000), 10, 7400).astype(np.int64)
CODE_O = np.clip(RNG.lognormal(np.log(15), 1.0, 4000), 1, 500).astype(np.int64)


def mix(p, o):
    return RequestMix(float(p.mean()), float(o.mean()), float(np.percentile(p, 95)))


def test_measured_rate_meets_the_slo_and_the_next_step_does_not():
    prof = CAT.profile("mistral-7b", "a10g")
    m = measure_capacity(prof, SLO, CHAT_P, CHAT_O, EngineConfig(), SMALL, seed=1)
    assert m.rps > 0 and m.attainment >= SMALL.attainment
    assert m.below_rps > m.rps and m.below_rps <= m.rps * 1.2
    probe = Probe(prof, SLO, CHAT_P, CHAT_O, EngineConfig(), SMALL, seed=1)
    assert probe.replicas == m.replicas and probe.requests == m.requests
    assert not probe.meets(m.below_rps)
    assert m.replicas == math.ceil(SMALL.pool_sequences / batch_limit(prof, SLO, CHAT_P, CHAT_O))


def test_estimator_tracks_the_engine_with_chunked_prefill_and_not_without():
    """The estimator's tail model is of chunked prefill (prompts stall decodes, wait for each other): on a
    prompt-heavy mix on a slow-prefill flavor, where the mean-value model said 1.6x-3.8x, it lands near
    what the engine sustains. With prefill free (no contention at all) the engine sustains far more."""
    prof = CAT.profile("mistral-7b", "a10g")
    code = RequestMix(float(CODE_P.mean()), float(CODE_O.mean()), float(np.percentile(CODE_P, 95)),
                      length_quantiles(CODE_P), length_quantiles(CODE_O))
    model = replica_capacity(prof, SLO, code, target_utilization=1.0).rps
    # A pool of ten replicas: the model is of Ray Serve's router spreading load over several (one or two
    # replicas queue more, a hundred less; bench/capacity_error.py has both ends).
    pool = CapacitySettings(pool_sequences=256, requests_per_sequence=6, min_requests=1000, iterations=5)
    on = measure_capacity(prof, SLO, CODE_P, CODE_O, EngineConfig(), pool, guess_rps=model)
    off = measure_capacity(prof, SLO, CODE_P, CODE_O, EngineConfig(prefill_contention=False), SMALL, guess_rps=model)
    assert on.replicas == 10
    assert 0.75 * on.rps <= model <= 1.33 * on.rps
    assert off.rps > 2 * model


def test_cheapest_capacity_settles_dominated_flavors_with_one_run():
    offers = []
    for f in ("a10g", "inf2", "l40s", "h100"):
        prof = CAT.profile("mistral-7b", f)
        guess = replica_capacity(prof, SLO, mix(CHAT_P, CHAT_O), target_utilization=1.0).rps
        price = {"a10g": 0.7, "inf2": 0.53, "l40s": 1.3, "h100": 55.04}[f]
        offers.append((prof, price, guess))
    out = cheapest_capacity(offers, SLO, CHAT_P, CHAT_O, EngineConfig(), SMALL)
    assert set(out) == {"a10g", "inf2", "l40s", "h100"}
    price = {p.flavor: usd for p, usd, _ in offers}
    measured = {f: m for f, m in out.items() if not m.dominated}
    best = min(price[f] / m.rps for f, m in measured.items() if m.rps > 0)
    assert out["h100"].dominated and out["h100"].runs == 1
    for f, m in out.items():
        if m.dominated:
            # It misses the SLO at the rate that would have matched the best $/req known at the time.
            assert m.rps == 0 and price[f] / m.below_rps >= best * (1 - 1e-9)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="attainment"):
        CapacitySettings(attainment=1.5)
    with pytest.raises(ValueError, match="pool_sequences"):
        CapacitySettings(pool_sequences=0)
