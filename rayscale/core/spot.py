"""Spot availability: the interruptions seen so far discount what a spot replica is worth.

An interrupted spot node takes its replica away for as long as a replacement takes to serve: the node's
start-up plus the replica's, counted from the notice (the step orders the replacement at the notice, and
AWS's two-minute notice is shorter than any start-up in the catalog). Interrupted at ``rate`` per node-hour,
a gang of ``nodes`` spot nodes then serves about a = 1 / (1 + rate x nodes x lead time) of the time. The
planner counts a spot replica as a x its capacity (rayscale.core.plan), so it holds the spot replicas that
cover what interruptions take away, or on-demand ones where that makes spot no longer the cheaper.

Nobody knows the rate ahead: AWS publishes buckets of monthly interruption frequency (the Spot Instance
Advisor's "<5%" to ">20%" of instances a month, about 1e-4 to 3e-4 per node-hour), and a reclaim wave is
far above them for an hour. So the step learns it per flavor: the spot gangs it saw go from READY to
FAILED over the spot node-hours it saw READY, both decayed by ``time_constant_s`` so that a bad spell is
followed and then forgotten, starting from ``prior_per_node_h`` worth ``prior_node_h`` node-hours.
A flavor with no interruption seen counts at full capacity: the plan is what it was without this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rayscale.core.act import Gang, GangPhase
from rayscale.core.catalog import CapacityType


@dataclass(frozen=True)
class SpotSettings:
    enabled: bool = True
    prior_per_node_h: float = 0.001  # interruptions per node-hour before any are seen
    prior_node_h: float = 4.0  # how many node-hours the prior is worth
    time_constant_s: float = 21600.0  # what was seen fades over this long

    def __post_init__(self) -> None:
        checks = {"prior_per_node_h": self.prior_per_node_h >= 0, "prior_node_h": self.prior_node_h > 0,
                  "time_constant_s": self.time_constant_s > 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SpotSettings.{name} is out of range, got {getattr(self, name)}")


@dataclass(frozen=True)
class SpotPool:
    """One flavor's spot record: interruptions seen and the node-hours they came out of, both decayed."""

    interruptions: float = 0.0
    node_h: float = 0.0


@dataclass(frozen=True)
class SpotRecord:
    pools: Mapping[str, SpotPool] = field(default_factory=dict)  # per flavor
    ready: Mapping[str, tuple[str, int]] = field(default_factory=dict)  # spot gangs READY at the last
    # observation: name -> (flavor, nodes)
    at_s: float | None = None  # when that was


def observe(record: SpotRecord, gangs: Iterable[Gang], now: float, settings: SpotSettings) -> SpotRecord:
    """The record with the time since the last observation: the spot node-hours of the gangs READY then,
    and those of them that have FAILED since (an interruption notice, or a node lost) as interruptions."""
    dt = 0.0 if record.at_s is None else max(now - record.at_s, 0.0)
    decay = math.exp(-dt / settings.time_constant_s)
    exposed: dict[str, float] = {}
    for flavor, nodes in record.ready.values():
        exposed[flavor] = exposed.get(flavor, 0.0) + nodes * dt / 3600.0
    lost: dict[str, float] = {}
    ready: dict[str, tuple[str, int]] = {}
    for g in gangs:
        if g.capacity_type != CapacityType.SPOT:
            continue
        if g.phase == GangPhase.READY:
            ready[g.name] = (g.flavor, g.nodes)
        elif g.phase == GangPhase.FAILED and g.name in record.ready:
            lost[g.flavor] = lost.get(g.flavor, 0.0) + 1.0
    pools = {}
    for f in set(record.pools) | set(exposed) | set(lost):
        p = record.pools.get(f, SpotPool())
        pools[f] = SpotPool(p.interruptions * decay + lost.get(f, 0.0), p.node_h * decay + exposed.get(f, 0.0))
    return SpotRecord(pools, ready, now)


def rates(record: SpotRecord, settings: SpotSettings, flavors: Iterable[str]) -> dict[str, float]:
    """Interruptions per spot node-hour of the flavors where some were seen, pulled towards the prior by its
    weight. A flavor with none seen is left out: at the prior alone a replica would count at over 99.9%,
    and the planner skips the arithmetic for it. Empty when disabled: spot then counts at full capacity."""
    if not settings.enabled:
        return {}
    prior = settings.prior_per_node_h * settings.prior_node_h
    out = {}
    for f in flavors:
        p = record.pools.get(f)
        if p is not None and p.interruptions > 1e-6:
            out[f] = (prior + p.interruptions) / (settings.prior_node_h + p.node_h)
    return out


def availability(rate_per_node_h: float, nodes: int, lead_s: float) -> float:
    """Share of the time a spot replica of ``nodes`` nodes serves when each node is interrupted at
    ``rate_per_node_h`` and a replacement takes ``lead_s`` to serve."""
    return 1.0 / (1.0 + rate_per_node_h * nodes * lead_s / 3600.0)
