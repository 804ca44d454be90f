"""The cloud-provider interface the controller acts through (Karpenter's split: one interface, many clouds).

An actuator owns nodes only. It creates and deletes whole gangs and reports every gang it owns, rebuilt
from the world (labels) on each call, so a restarted controller needs no memory of its own. Serve
replicas are not its business; the controller joins the two views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from rayscale.core.act import Action, CreateGang, DeleteGang, DrainGang, Gang, SetReplicas

# Labels every rayscale-owned node / NodeClaim carries; the same keys locally and on Kubernetes.
LABEL_OWNER = "rayscale.io/owned-by"
LABEL_GANG = "rayscale.io/gang"
LABEL_MODEL = "rayscale.io/model"
LABEL_FLAVOR_KEY = "rayscale.io/flavor"
LABEL_CAPACITY = "rayscale.io/capacity-type"
LABEL_ZONE = "rayscale.io/zone"
LABEL_SIZE = "rayscale.io/gang-size"
LABEL_CREATED = "rayscale.io/created-at"
OWNER = "rayscale"


class Actuator(Protocol):
    # Whether drain_gang works here: the step moves replicas off a gang only through a provider that can.
    can_drain: bool

    def gangs(self, now: float) -> list[Gang]:
        """Every gang this actuator owns, with its phase; ``Gang.node_ids`` lists members that are up."""
        ...

    def create_gang(self, action: CreateGang, now: float) -> None:
        """Start provisioning all nodes of the gang. Idempotent: an existing gang name is left alone."""
        ...

    def delete_gang(self, name: str) -> None:
        """Release every node of the gang. Idempotent."""
        ...

    def drain_gang(self, name: str) -> None:
        """Drain every node of the gang through Ray (rayscale.core.act.DrainGang); the gang then reports
        ``draining``. Idempotent."""
        ...

    def sync_serve_targets(self, targets: dict[str, dict[str, int]]) -> list[str]:
        """Serve's replica targets (application -> deployment -> replicas) after this period, for an
        actuator whose platform re-submits Serve's config (KubeRay's RayService); the others keep nothing
        and return []. Errors as text: the next period writes again."""
        ...

    def serve_dashboard(self) -> str | None:
        """The Ray dashboard Serve is read and scaled through now, where the platform moves it (a RayService's
        driven cluster: the active one, or the pending one on first deploy, before KubeRay makes the
        RayService's own Service); None: the one the controller was given. A read: it changes nothing."""
        ...

    def close(self) -> None: ...


def apply_actions(actions: Iterable[Action], actuator: Actuator, set_replicas: Callable[[str, str, int], None],
                  now: float) -> list[str]:
    """Carry out one step's actions in order (the step orders gangs before replicas, drains before
    releases); a failed action is reported and the others still run. BackOff lives in the step's state."""
    errors = []
    for a in actions:
        try:
            if isinstance(a, CreateGang):
                actuator.create_gang(a, now)
            elif isinstance(a, DeleteGang):
                actuator.delete_gang(a.name)
            elif isinstance(a, DrainGang):
                actuator.drain_gang(a.name)
            elif isinstance(a, SetReplicas):
                set_replicas(a.model, a.flavor, a.replicas)
        except Exception as e:  # one failed action must not stop the others or the loop
            errors.append(f"{type(a).__name__} {a}: {e}")
    return errors
