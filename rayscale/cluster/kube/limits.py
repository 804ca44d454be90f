"""NodePool ``limits`` for the claims rayscale creates itself.

Karpenter checks a pool's limits only before it creates a claim of its own (kubernetes-sigs/karpenter
``pkg/controllers/provisioning/provisioner.go`` ``Create``: ``Spec.Limits.ExceededBy`` over the pool's
resources from cluster state); a claim someone else creates is counted in the pool's resources
(``pkg/controllers/state/cluster.go``) but never blocked. So the actuator does the check for its gangs:
the pool's usage (every claim labelled with the pool, rayscale's or Karpenter's, until it is gone, as
cluster state counts a node until it is removed) plus the whole gang must stay within every limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from rayscale.core.catalog import Catalog, Flavor

Obj = dict[str, Any]
# Karpenter counts nodes as a resource of their own in pool limits and status.resources.
NODES = "nodes"
_SUFFIX = {
    "": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50,
}
_QUANTITY = re.compile(r"^([0-9.]+(?:[eE][-+]?[0-9]+)?)(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$")


def parse_quantity(text: str | int | float) -> float:
    """A Kubernetes resource quantity (``64``, ``500m``, ``128Gi``) as a number."""
    m = _QUANTITY.match(str(text).strip())
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""]


def shape_of(flavor: Flavor, instance_type: str) -> dict[str, float]:
    """One node of ``instance_type``: what Karpenter will count for it once launched."""
    it = flavor.instance(instance_type)
    out = {NODES: 1.0, "cpu": float(it.vcpu), "memory": it.memory_gib * 2.0**30}
    if flavor.resource_name != "cpu":
        out[flavor.resource_name] = float(it.devices)
    return out


def resources_of(claim: Obj, catalog: Catalog) -> dict[str, float]:
    """A claim's resources: its ``status.capacity`` once launched, else its instance type's shape from the
    catalog (a claim not yet launched counts too: it will be), else just the node."""
    capacity = (claim.get("status") or {}).get("capacity") or {}
    if capacity:
        out = {k: parse_quantity(v) for k, v in capacity.items() if k != "pods"}
        return {**out, NODES: 1.0}
    itype = next((r["values"][0] for r in (claim.get("spec") or {}).get("requirements") or ()
                  if r.get("key") == "node.kubernetes.io/instance-type" and r.get("values")), "")
    for fl in catalog.flavors.values():
        if any(it.name == itype for it in fl.instance_types):
            return shape_of(fl, itype)
    return {NODES: 1.0}


def pool_usage(claims: Iterable[Obj], catalog: Catalog) -> dict[str, float]:
    total: dict[str, float] = {}
    for c in claims:
        for k, v in resources_of(c, catalog).items():
            total[k] = total.get(k, 0.0) + v
    return total


def exceeded(limits: Mapping[str, Any], usage: Mapping[str, float], extra: Mapping[str, float]) -> list[str]:
    """The limits that ``usage + extra`` would pass, as ``resource usage+extra > limit`` strings."""
    out = []
    for name, limit in sorted(limits.items()):
        want = usage.get(name, 0.0) + extra.get(name, 0.0)
        if extra.get(name, 0.0) and want > parse_quantity(limit):
            out.append(f"{name} {usage.get(name, 0.0):g}+{extra.get(name, 0.0):g} > {limit}")
    return out
