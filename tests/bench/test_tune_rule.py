"""bench.tune's rule: SLO first (wherever any variant meets 99%), then the cheapest steady state."""

from __future__ import annotations

from typing import Any

from bench.tune import SHIPPED, choose, verdict_of


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


def _with_cold(rows: list[dict[str, Any]], cold: dict[int, float]) -> list[dict[str, Any]]:
    return [{**r, "slo": cold[r["case"]]} if r["start"] == "cold" else r for r in rows]


def test_at_equal_cost_a_from_cold_gain_where_shipped_misses_99_ships_unless_it_loses_elsewhere() -> None:
    shipped = _with_cold(_rows(SHIPPED, {0: 0.995, 1: 0.995}, 10.0), {0: 0.977, 1: 0.999})
    gain = _with_cold(_rows("gain", {0: 0.995, 1: 0.995}, 10.05), {0: 0.985, 1: 0.9985})
    best, why = choose(shipped + gain, [0, 1])
    assert best == "gain" and why["gain"].startswith("chosen: from cold +0.80 pt")
    # More than 1% dearer, too small a gain, or a loss of over 0.1 pt from cold elsewhere: shipped stays.
    dear = _with_cold(_rows("gain", {0: 0.995, 1: 0.995}, 10.2), {0: 0.985, 1: 0.999})
    small = _with_cold(_rows("gain", {0: 0.995, 1: 0.995}, 10.0), {0: 0.980, 1: 0.999})
    loses = _with_cold(_rows("gain", {0: 0.995, 1: 0.995}, 10.0), {0: 0.985, 1: 0.997})
    for variant in (dear, small, loses):
        assert choose(shipped + variant, [0, 1])[0] == SHIPPED
    # A gain where shipped already meets 99% from cold is no reason to change.
    met = _with_cold(_rows(SHIPPED, {0: 0.995}, 10.0), {0: 0.991})
    assert choose(met + _with_cold(_rows("gain", {0: 0.995}, 10.0), {0: 0.999}), [0])[0] == SHIPPED


def test_rows_without_the_shipped_settings_get_no_verdict_instead_of_an_error() -> None:
    why, line = verdict_of(_rows("other", {0: 0.995}, 10.0), [0])
    assert why == {} and "not applied" in line
    why, line = verdict_of(_rows(SHIPPED, {0: 0.995}, 10.0) + _rows("other", {0: 0.995}, 8.0), [0])
    assert line == "**Chosen: other.**" and why["other"] == "chosen"
