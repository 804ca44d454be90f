"""Seeds change the arrivals of a trace file, and steady state warms up on other arrivals (no hindsight)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rayscale.sim.sources import WARMUP_SEED_OFFSET, load_spec, with_warmup_draw
from rayscale.sim.trace import Trace

AZURE = str(Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_code.csv")


def test_a_resample_keeps_the_traffic_but_not_the_arrivals() -> None:
    base = load_spec(AZURE)
    a, b = load_spec(AZURE, seed=1, resample=True), load_spec(AZURE, seed=2, resample=True)
    assert load_spec(AZURE, seed=1).arrival_s.tolist() == base.arrival_s.tolist()  # no --resample: the file
    assert a.arrival_s.tolist() != b.arrival_s.tolist()
    assert len(a) != len(b) and abs(len(a) - len(base)) < 4 * np.sqrt(len(base))
    for tr in (a, b):  # the minute-by-minute rate and the request mix stay those of the file
        per_min = np.bincount((tr.arrival_s // 60).astype(int), minlength=61)[:60]
        base_min = np.bincount((base.arrival_s // 60).astype(int), minlength=61)[:60]
        assert np.corrcoef(per_min, base_min)[0, 1] > 0.8
        assert abs(tr.prompt_tokens.mean() / base.prompt_tokens.mean() - 1) < 0.1
    assert load_spec(AZURE, seed=1, resample=True).arrival_s.tolist() == a.arrival_s.tolist()  # a seed is a draw


def test_the_warm_up_is_another_draw_and_scoring_starts_after_it() -> None:
    both, start = with_warmup_draw(AZURE, seed=3)
    warm = load_spec(AZURE, seed=3 + WARMUP_SEED_OFFSET, resample=True)
    scored = load_spec(AZURE, seed=3, resample=True)
    assert len(both) == len(warm) + len(scored) and start > warm.duration_s
    tail = both.arrival_s[len(warm):] - start
    assert np.allclose(tail, scored.arrival_s - scored.arrival_s[0])
    assert warm.arrival_s.tolist() != scored.arrival_s.tolist()
    gen, gstart = with_warmup_draw("gen:poisson:rate=2,hours=0.1", seed=0)
    assert isinstance(gen, Trace) and 0 < gstart < gen.duration_s


def test_a_longer_warm_up_adds_older_draws_before_the_same_last_one() -> None:
    one, start1 = with_warmup_draw("gen:poisson:rate=2,hours=0.1", seed=4)
    two, start2 = with_warmup_draw("gen:poisson:rate=2,hours=0.1", seed=4, draws=2)
    older = load_spec("gen:poisson:rate=2,hours=0.1", seed=4 + 3 * WARMUP_SEED_OFFSET, resample=True)
    assert len(two) == len(one) + len(older) and start2 > start1 + 0.9 * older.duration_s
    # The draw just before scoring and the scored draw are those of the one-draw warm-up.
    n_warm = int(np.searchsorted(one.arrival_s, start1))
    last = two.arrival_s[len(older):len(older) + n_warm]
    assert np.allclose(last - last[0], one.arrival_s[:n_warm] - one.arrival_s[0])
    assert np.allclose(two.arrival_s[len(older) + n_warm:] - start2, one.arrival_s[n_warm:] - start1)
    assert np.allclose(two.arrival_s[:len(older)] - two.arrival_s[0], older.arrival_s - older.arrival_s[0])
    with pytest.raises(ValueError, match="draws must be at least 1"):
        with_warmup_draw("gen:poisson:rate=2,hours=0.1", seed=4, draws=0)
