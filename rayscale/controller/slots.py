"""Gang slots: the controller's side of confining a multi-node replica to one gang.

A multi-node (model, flavor) is served by one Serve deployment per gang slot (rayscale.serve.config:
``{model}--{flavor}--slot{k}``, its placement group confined to nodes labelled with slot k), and the
actuator gives each new gang the lowest slot no live gang of its (model, flavor) holds. The core still
decides replicas per (model, flavor); this module turns such a count into one 0-or-1 target per slot, and
a flavor's routing weight into weights per slot deployment, as the ingress routes by them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rayscale.core.act import Gang, GangPhase
from rayscale.serve.config import SEP, SLOT_PREFIX


def slot_key(flavor: str, slot: int) -> str:
    """The ingress's routing key of a slot deployment (rayscale.serve.app.routes)."""
    return f"{flavor}{SEP}{SLOT_PREFIX}{slot}"


def slot_targets(replicas: int, gangs: Iterable[Gang], current: Mapping[int, int]) -> dict[int, int]:
    """One target per slot deployment for ``replicas`` replicas of one multi-node (model, flavor).

    Only a slot whose gang is READY gets a replica (Serve would otherwise hold a placement group pending).
    Slots that run one keep it (no replica moves); new replicas go to the oldest ready gangs; a scale-down
    empties the newest gangs first, the ones decide's release picks among those that serve nothing. Every
    slot deployment ``current`` lists gets a target, 0 where it gets no replica."""
    ready = sorted((g for g in gangs if g.phase == GangPhase.READY and g.slot is not None and g.slot in current),
                   key=lambda g: (g.created_s, g.name))
    keep = [g for g in ready if current.get(g.slot or 0, 0) > 0]
    chosen = (keep + [g for g in ready if g not in keep])[:max(replicas, 0)]
    on = {g.slot for g in chosen}
    return {k: int(k in on) for k in sorted(current)}


def slot_weights(weights: Mapping[str, float], slots: Mapping[str, Mapping[int, int]]) -> dict[str, float]:
    """A model's routing weights with each multi-node flavor's share split evenly over its slot
    deployments that run a replica (``slots``: flavor -> slot -> replicas, those serving where the
    controller routes); other flavors as given."""
    out: dict[str, float] = {}
    for flavor, w in weights.items():
        per_slot = slots.get(flavor)
        if per_slot is None:
            out[flavor] = w
            continue
        running = [k for k, n in sorted(per_slot.items()) if n > 0]
        for k in per_slot:
            out[slot_key(flavor, k)] = w / len(running) if k in running else 0.0
    return out
