"""Gang slots on Kubernetes: which (model, flavor) gangs need one, and the worker group of each slot.

A multi-node replica's placement group must land inside one gang (docs/design.md, "Gangs reach Ray"):
Serve confines each slot deployment ``{model}--{flavor}--slot{k}`` to Ray nodes labelled
``{rayscale.io/flavor: f, rayscale.io/model: m, rayscale.io/gang-slot: k}``
(``rayscale.serve.config.slot_label_selector``). On Kubernetes a Ray node's labels come from its worker
group, the same for every pod of the group, so each slot gets its own worker group:

- its ``labels`` are those three; KubeRay passes a worker group's ``labels`` to ``ray start --labels``
  and copies them onto the pods (ray-project/kuberay ``ray-operator/controllers/ray/common/pod.go``:
  ``updateRayStartParamsLabels`` and ``mergeLabels`` in ``BuildPod``; ``validateRayGroupLabels`` in
  ``utils/validation.go`` refuses ``rayStartParams.labels`` beside them), and Ray 2.60's ``ray start``
  parses ``--labels "k=v,..."`` into the node's labels (``ray/scripts/scripts.py`` ``start``,
  ``parse_node_labels_string`` in ``ray/_private/label_utils.py``);
- its pods select Nodes with the same model and slot labels, which the actuator puts on the gang's
  NodeClaims (Karpenter copies a claim's labels to its Node at registration,
  kubernetes-sigs/karpenter ``pkg/controllers/nodeclaim/lifecycle/registration.go``), so the pods of
  slot k run only on the nodes of the gang that holds slot k;
- it is sized by the actuator to that one gang (``maxReplicas`` = the gang's nodes).

A (model, flavor) gets slots when the gang ``decide`` orders for it (``gang_shape``, on-demand prices as
the plan uses) spans nodes; K is the most such gangs that can run at once: the model's
``max_replicas`` (one replica per gang), bounded by the flavor's device and node limits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from rayscale.cluster.kube.naming import deployable, worker_group_name
from rayscale.core.catalog import Catalog
from rayscale.core.gangs import GangError, gang_shape

_MAX_LABEL = 63  # a group name is the value of KubeRay's ray.io/group pod label


@dataclass(frozen=True)
class SlotFlavor:
    """A (model, flavor) served through gang slots, with the gang shape its slot groups run."""

    model: str
    flavor: str
    instance_type: str
    nodes: int  # members of one gang
    slots: int  # K: one worker group and one Serve deployment per slot

    def group(self, slot: int) -> str:
        return slot_group_name(self.flavor, self.instance_type, self.model, slot)


def slot_group_name(flavor: str, instance_type: str, model: str, slot: int) -> str:
    """The worker group of one gang slot: ``{flavor}-{instance type}-{model}-slot{k}`` (63 characters at
    most: a long one keeps its head and ends in a digest of the whole)."""
    name = f"{worker_group_name(flavor, instance_type)}-{model}-slot{slot}"
    if len(name) <= _MAX_LABEL:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    tail = f"-{digest}-slot{slot}"
    return name[:_MAX_LABEL - len(tail)].rstrip("-.") + tail


def slot_flavor(catalog: Catalog, model: str, flavor: str) -> SlotFlavor | None:
    """The slots of a (model, flavor) whose gang spans nodes; None for a single-node one (or one that
    is not on Kubernetes, or that no instance type fits)."""
    m, fl = catalog.models.get(model), catalog.flavors.get(flavor)
    if m is None or fl is None or flavor not in m.parallelism or not deployable(fl):
        return None
    try:
        shape = gang_shape(catalog, model, flavor)
    except GangError:
        return None
    if shape.nodes <= 1:
        return None
    caps = [m.max_replicas]
    if fl.limits.devices is not None:
        caps.append(fl.limits.devices // (shape.nodes * fl.instance(shape.instance_type).devices))
    if fl.limits.nodes is not None:
        caps.append(fl.limits.nodes // shape.nodes)
    # At least one: a multi-node flavor is always confined, even where its limits leave room for none.
    return SlotFlavor(model, flavor, shape.instance_type, shape.nodes, max(1, min(caps)))


def slot_flavors(catalog: Catalog) -> list[SlotFlavor]:
    """Every (model, flavor) of the catalog served through gang slots, sorted."""
    out = []
    for model in sorted(catalog.models):
        for flavor in sorted(catalog.models[model].parallelism):
            s = slot_flavor(catalog, model, flavor)
            if s is not None:
                out.append(s)
    return out
