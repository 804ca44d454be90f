"""The LOAD.yaml that `rayscale plan` reads: a snapshot of signals, current replicas and back-offs.

Plain pydantic models; rayscale.config reads the file. Methods turn it into core inputs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rayscale.core.signals import Freshness, ModelSignals, RequestMix


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelLoad(_M):
    rate_rps: float | None = Field(default=None, ge=0, description="arrivals per second; omit when unknown")
    prompt_mean: float = Field(default=1024, gt=0)
    output_mean: float = Field(default=128, gt=0)
    prompt_p95: float | None = Field(default=None, gt=0)
    waiting: float = Field(default=0, ge=0)
    stale_s: float | None = Field(default=None, ge=0, description="age of the newest sample if stale")
    history: list[float] = Field(default_factory=list, description="past rates, oldest first")


class CurrentReplicas(_M):
    model: str
    flavor: str
    capacity_type: str = "on-demand"
    replicas: int = Field(ge=0)


class Unavailable(_M):
    flavor: str
    zone: str
    capacity_type: str = "on-demand"
    until_s: float = Field(default=float("inf"), description="clock value the back-off ends at")


class LoadFile(_M):
    now_s: float = 0.0
    models: dict[str, ModelLoad] = Field(default_factory=dict)
    current: list[CurrentReplicas] = Field(default_factory=list)
    unavailable: list[Unavailable] = Field(default_factory=list)

    def signals(self) -> dict[str, ModelSignals]:
        out = {}
        for name, m in self.models.items():
            mix = RequestMix(m.prompt_mean, m.output_mean, m.prompt_p95 or m.prompt_mean)
            if m.rate_rps is None or m.stale_s is not None:
                fresh = Freshness.STALE if m.stale_s is not None else Freshness.MISSING
                out[name] = ModelSignals(name, fresh, m.stale_s, None, mix)
            else:
                out[name] = ModelSignals(name, Freshness.FRESH, 0.0, m.rate_rps, mix, waiting=m.waiting,
                                         rate_history=tuple(m.history))
        return out

    def current_map(self) -> dict[tuple[str, str, str], int]:
        return {(c.model, c.flavor, c.capacity_type): c.replicas for c in self.current}

    def unavailable_map(self) -> dict[tuple[str, str, str], float]:
        return {(u.flavor, u.zone, u.capacity_type): u.until_s for u in self.unavailable}
