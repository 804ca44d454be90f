"""Forecasters: the pluggable part of estimation. Plain functions of a rate history (oldest first)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Forecaster = Callable[[Sequence[float], float], float]
"""(rate history, current rate) -> rate to provision for over the next start-up horizon."""


def last_value(history: Sequence[float], current: float) -> float:
    return current


@dataclass(frozen=True)
class TrendSeasonal:
    """Holt's linear trend with an optional seasonal term (additive Holt-Winters), run over the history.

    ``horizon`` windows ahead is roughly replica start-up time / window length: capacity ordered now
    arrives then. Never forecasts below the current rate: a falling forecast must not cause a scale-down
    that the observed load does not justify (scale-down stays reactive).
    """

    alpha: float = 0.5
    beta: float = 0.2
    gamma: float = 0.1
    season: int = 0  # windows per season; 0 disables the seasonal term
    horizon: int = 6

    def __call__(self, history: Sequence[float], current: float) -> float:
        xs = [*history, current]
        if len(xs) < 3:
            return current
        level, trend = xs[0], xs[1] - xs[0]
        m = self.season if self.season and len(xs) >= 2 * self.season else 0
        seasonal = [x - sum(xs[:m]) / m for x in xs[:m]] if m else []
        for i, x in enumerate(xs[1:], start=1):
            s = seasonal[i % m] if m else 0.0
            prev_level = level
            level = self.alpha * (x - s) + (1 - self.alpha) * (level + trend)
            trend = self.beta * (level - prev_level) + (1 - self.beta) * trend
            if m:
                seasonal[i % m] = self.gamma * (x - level) + (1 - self.gamma) * s
        ahead = len(xs) - 1 + self.horizon
        f = level + self.horizon * trend + (seasonal[ahead % m] if m else 0.0)
        return max(current, f)


FORECASTERS: dict[str, Forecaster] = {"last": last_value, "trend": TrendSeasonal()}
