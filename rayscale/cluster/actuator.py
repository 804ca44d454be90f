"""The cloud-provider interface the controller acts through (Karpenter's split: one interface, many clouds).

An actuator owns nodes only. It creates and deletes whole gangs and reports every gang it owns, rebuilt
from the world (labels) on each call, so a restarted controller needs no memory of its own. Serve
replicas are not its business; the controller joins the two views.
"""

from __future__ import annotations

from typing import Protocol

from rayscale.controller.act import CreateGang, Gang

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
    def gangs(self, now: float) -> list[Gang]:
        """Every gang this actuator owns, with its phase; ``Gang.node_ids`` lists members that are up."""
        ...

    def create_gang(self, action: CreateGang, now: float) -> None:
        """Start provisioning all nodes of the gang. Idempotent: an existing gang name is left alone."""
        ...

    def delete_gang(self, name: str) -> None:
        """Release every node of the gang. Idempotent."""
        ...

    def close(self) -> None: ...
