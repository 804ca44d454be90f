"""The planner's optimisation problem and its answer: offerings (ways to run a replica), each model's need,
the shared limits, and the replica counts a solver returns (rayscale.core.solver solves it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

from rayscale.core.catalog import CapacityType

# Demand differences below this (req/s) are noise: not worth a replica, not reported as unmet.
RPS_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Offering:
    """One way to run a replica of a model: flavor, capacity type, the gang it needs and what it gives.

    A gang holds ``slots`` replicas (rayscale.core.gangs.GangShape.slots): a replica costs its share of the
    gang, and NodePool limits count the whole gangs the replicas pack into."""

    model: str
    flavor: str
    capacity_type: CapacityType
    usd_per_h: float  # one replica: the gang's price / slots
    rps: float  # capacity of one replica
    devices: int  # devices the gang's nodes carry (what NodePool limits count)
    nodes: int  # nodes of one gang
    lb: int = 0
    ub: int = 10**6
    slots: int = 1  # replicas one gang holds


class OfferingTable(Sequence[Offering]):
    """Offerings in column form: what ``plan()`` builds for thousands of (model, flavor) pairs without
    creating one object each. Items are made on access; ``unit`` (optional) numbers (model, flavor) groups
    whose on-demand and spot offerings differ only in capacity type, price and bounds."""

    def __init__(self, model: list[str], flavor: list[str], capacity_type: list[CapacityType],
                 usd_per_h: list[float], rps: list[float], devices: list[int], nodes: list[int], lb: list[int],
                 ub: list[int], unit: list[int] | None = None, slots: list[int] | None = None) -> None:
        self.model, self.flavor, self.capacity_type = model, flavor, capacity_type
        self.usd_per_h, self.rps, self.devices, self.nodes, self.lb, self.ub = usd_per_h, rps, devices, nodes, lb, ub
        self.unit = unit
        self.slots = slots if slots is not None else [1] * len(model)

    def __len__(self) -> int:
        return len(self.model)

    def with_bounds(self, lb: list[int], ub: list[int]) -> OfferingTable:
        """The same offerings with other bounds (the columns shared, not copied)."""
        return OfferingTable(self.model, self.flavor, self.capacity_type, self.usd_per_h, self.rps, self.devices,
                             self.nodes, lb, ub, self.unit, self.slots)

    def _item(self, j: int) -> Offering:
        return Offering(self.model[j], self.flavor[j], self.capacity_type[j], self.usd_per_h[j], self.rps[j],
                        self.devices[j], self.nodes[j], self.lb[j], self.ub[j], self.slots[j])

    @overload
    def __getitem__(self, j: int) -> Offering: ...

    @overload
    def __getitem__(self, j: slice) -> list[Offering]: ...

    def __getitem__(self, j: int | slice) -> Offering | list[Offering]:
        if isinstance(j, slice):
            return [self._item(i) for i in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self._item(j)


@dataclass(frozen=True)
class ModelNeed:
    model: str
    rps: float
    min_replicas: int
    max_replicas: int
    priority: int


@dataclass(frozen=True)
class Problem:
    needs: Sequence[ModelNeed]
    offerings: Sequence[Offering]
    device_limits: dict[str, int] = field(default_factory=dict)  # flavor -> devices
    node_limits: dict[str, int] = field(default_factory=dict)  # flavor -> nodes
    spot_share: dict[str, float] = field(default_factory=dict)  # flavor -> most replicas of a model on spot


@dataclass(frozen=True)
class Solution:
    counts: dict[int, int]  # offering index -> replicas (only > 0)
    unmet_rps: dict[str, float]  # model -> demand not covered (limits or max_replicas)
    usd_per_h: float
    method: str
    # model -> replicas short of min_replicas (only > 0): limits can forbid a floor too, and it must show
    missing_min: dict[str, int] = field(default_factory=dict)



def _columns(offs: Sequence[Offering]) -> tuple[Sequence[str], Sequence[float], Sequence[int], Sequence[float]]:
    """Model, req/s, slots and $/h per offering: an OfferingTable's own columns (not an Offering built per
    access, thousands of them in a 1,000-model plan)."""
    if isinstance(offs, OfferingTable):
        return offs.model, offs.rps, offs.slots, offs.usd_per_h
    return [o.model for o in offs], [o.rps for o in offs], [o.slots for o in offs], [o.usd_per_h for o in offs]


def finish(p: Problem, counts: dict[int, int], method: str) -> Solution:
    """The solution of ``counts`` (offering index -> replicas): its cost in whole gangs, unmet demand and
    missing floors."""
    cap: dict[str, float] = {n.model: 0.0 for n in p.needs}
    have: dict[str, int] = {n.model: 0 for n in p.needs}
    cost = 0.0
    model, rps, slots, usd = _columns(p.offerings)
    for j, k in counts.items():
        m = model[j]
        cap[m] += k * rps[j]
        have[m] += k
        cost += -(-k // slots[j]) * slots[j] * usd[j]  # whole gangs
    unmet = {n.model: n.rps - cap[n.model] for n in p.needs if cap[n.model] < n.rps - RPS_TOLERANCE}
    missing = {n.model: floor - have[n.model] for n in p.needs
               if have[n.model] < (floor := min(n.min_replicas, n.max_replicas))}
    return Solution(counts, unmet, cost, method, missing)

