"""Gangs: the set of nodes one replica needs, provisioned and released as one unit.

Tensor parallelism stays inside a node (NVLink / NeuronLink); pipeline stages may span nodes. A gang is
always one instance type in one zone: TP=4 fits one g5.12xlarge, never four g5.xlarge; PP=2 x TP=8 is two
p4d.24xlarge. A replica that needs fewer devices than a node has shares it: a single-node gang holds
``slots`` replicas (eight TP=1 replicas on one 8-GPU p5.48xlarge, two TP=4), a gang spanning nodes holds
one. Among the instance types that fit, the cheapest per replica at full packing wins (fewest idle devices,
then the smaller node, on a tie), so a flavor whose only instance is an 8-GPU node is priced at an eighth
of it per TP=1 replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from rayscale.core.catalog import CapacityType, Catalog, Flavor, Parallelism


class GangError(ValueError):
    pass


@dataclass(frozen=True)
class GangShape:
    instance_type: str
    nodes: int
    devices_per_node: int  # devices each node contributes to the replica (<= the instance's devices)
    tp: int
    pp: int
    # Replicas one gang holds: a single node holds as many as its devices fit (whole TP x PP groups); a gang
    # spanning nodes holds one (pipeline stages across nodes leave no whole node to share).
    slots: int = 1

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def gangs_for(self, replicas: int) -> int:
        """Gangs ``replicas`` replicas need at full packing."""
        return -(-max(replicas, 0) // self.slots)


def gang_options(flavor: Flavor, par: Parallelism) -> list[GangShape]:
    """Every instance type of the flavor that can hold one replica, as a gang shape."""
    out = []
    for it in flavor.instance_types:
        cores_per_node = it.devices * it.cores_per_device
        if par.tp > cores_per_node:
            continue  # a TP group never spans nodes
        stages_per_node = cores_per_node // par.tp
        nodes = math.ceil(par.pp / stages_per_node)
        used_cores = par.tp * math.ceil(par.pp / nodes)
        # A TP group never straddles a device: a replica takes whole devices, and a node holds as many
        # replicas as its devices fit.
        per_node = math.ceil(used_cores / it.cores_per_device)
        slots = it.devices // per_node if nodes == 1 else 1
        out.append(GangShape(it.name, nodes, per_node, par.tp, par.pp, max(slots, 1)))
    return out


def gang_shape(catalog: Catalog, model: str, flavor: str,
               capacity_type: CapacityType = CapacityType.ON_DEMAND) -> GangShape:
    try:
        return gang_shape_for(catalog, flavor, catalog.models[model].parallelism[flavor], capacity_type)
    except GangError as e:
        raise GangError(f"{model} on {flavor}: {e}") from None


def gang_shape_for(catalog: Catalog, flavor: str, par: Parallelism,
                   capacity_type: CapacityType = CapacityType.ON_DEMAND) -> GangShape:
    """The cheapest gang for a parallelism on a flavor: depends only on (flavor, tp, pp, capacity type),
    so callers that plan many models cache it on that key."""
    fl = catalog.flavors[flavor]
    options = gang_options(fl, par)
    if not options:
        biggest = max(it.devices * it.cores_per_device for it in fl.instance_types)
        raise GangError(f"tp={par.tp} needs {par.tp} devices in one node; largest {flavor} instance has {biggest}")

    def key(g: GangShape) -> tuple[float, int, int, str]:
        it = fl.instance(g.instance_type)
        idle = g.nodes * it.devices - g.devices * g.slots
        per_replica = g.nodes * catalog.price(flavor, g.instance_type, capacity_type) / g.slots
        return (per_replica, idle, it.devices, g.instance_type)

    return options[0] if len(options) == 1 else min(options, key=key)


def choose_zone(flavor: Flavor, capacity_type: CapacityType, unavailable: Iterable[tuple[str, str, str]],
                taken: dict[str, int] | None = None) -> str | None:
    """The zone for a new gang: the first available zone, preferring the one with fewest gangs already.

    ``unavailable`` holds (flavor, zone, capacity_type) triples currently backed off after capacity errors.
    Returns None when every zone is backed off.
    """
    blocked = {z for f, z, c in unavailable if f == flavor.name and c == capacity_type.value}
    zones = [z for z in flavor.zones if z not in blocked]
    if not zones:
        return None
    taken = taken or {}
    return min(zones, key=lambda z: (taken.get(z, 0), flavor.zones.index(z)))
