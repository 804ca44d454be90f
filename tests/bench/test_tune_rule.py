"""bench.tune's rule: SLO first (wherever any variant meets 99%), then the cheapest steady state."""

from __future__ import annotations

from typing import Any

from bench.tune import SHIPPED, choose


def _rows(variant: str, slo: dict[int, float], usd: float) -> list[dict[str, Any]]:
    return [{"variant": variant, "case": c, "seed": 0, "start": start, "slo": s, "usd": usd}
            for c, s in slo.items() for start in ("steady", "restart", "cold")]


def test_shipped_settings_that_miss_where_a_variant_meets_the_slo_give_way_to_it() -> None:
    rows = _rows(SHIPPED, {0: 0.995, 1: 0.97}, 10.0) + _rows("fix", {0: 0.995, 1: 0.992}, 11.0)
    best, why = choose(rows, [0, 1])
    assert best == "fix" and why["fix"] == "chosen"
    assert SHIPPED in why and "SLO < 99%" in why[SHIPPED]


def test_where_no_variant_meets_the_slo_one_within_a_tenth_of_a_point_of_shipped_may_win_on_cost() -> None:
    rows = (_rows(SHIPPED, {0: 0.995, 1: 0.985}, 10.0) + _rows("cheaper", {0: 0.995, 1: 0.9845}, 9.0)
            + _rows("worse", {0: 0.995, 1: 0.98}, 8.0))
    best, why = choose(rows, [0, 1])
    assert best == "cheaper"
    assert "SLO < 99%" in why["worse"]


def test_a_variant_less_than_one_percent_cheaper_keeps_the_shipped_settings() -> None:
    best, _ = choose(_rows(SHIPPED, {0: 0.995}, 10.0) + _rows("close", {0: 0.995}, 9.95), [0])
    assert best == SHIPPED
