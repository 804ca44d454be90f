"""Names shared by `rayscale render` and the Kubernetes actuator, so the manifests and the objects the
actuator writes always agree (NodePool, EC2NodeClass, RayCluster worker group, node labels)."""

from __future__ import annotations

from rayscale.core.catalog import AcceleratorKind, Flavor

HEAD_POOL = "ray-head"  # x86 CPU pool for the Ray head and the controller
NEURON_POOL = "neuron"  # one pool for every Neuron flavor (trn1, inf2)
GPU_NODECLASS = "gpu"
NEURON_NODECLASS = "neuron"
HEAD_NODECLASS = "ray-head"
HEAD_TAINT_KEY = "rayscale.io/ray-head"

# Set by the actuator on a gang's Nodes once every member is Initialized: Ray worker pods select it, so
# they never land on half a gang, and no NodePool can satisfy it, so Karpenter never launches a node
# for a Pending Ray worker pod (rayscale is the only one that creates accelerator nodes).
LABEL_RAY_WORKER = "rayscale.io/ray-worker"
LABEL_MEMBER = "rayscale.io/member"
LABEL_NODEPOOL = "karpenter.sh/nodepool"
ANN_DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
# Durable steps of the gang state machine, on the NodeClaims (a restarted controller resumes from them).
ANN_COMPLETE = "rayscale.io/gang-complete"  # on member 0 once every member was created
ANN_DELETING = "rayscale.io/deleting"  # the gang is being released (set by delete_gang)
ANN_DRAINING = "rayscale.io/draining"  # its Ray nodes were drained (set by drain_gang once Ray accepted)
# "<phase>@<controller time>" on member 0 once the gang was READY: when it entered its phase, so a ready
# gang whose worker pod restarts gets a fresh launch timeout instead of looking stuck since creation.
ANN_PHASE_SINCE = "rayscale.io/phase-since"

L_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
L_ZONE = "topology.kubernetes.io/zone"
L_CAPACITY_TYPE = "karpenter.sh/capacity-type"


def deployable(flavor: Flavor) -> bool:
    """Flavors that exist on Kubernetes (the local CPU flavor is this machine only)."""
    return flavor.kind != AcceleratorKind.CPU


def nodepool_name(flavor: Flavor) -> str:
    return NEURON_POOL if flavor.kind == AcceleratorKind.NEURON else flavor.name


def nodeclass_name(flavor: Flavor) -> str:
    return NEURON_NODECLASS if flavor.kind == AcceleratorKind.NEURON else GPU_NODECLASS


def worker_group_name(flavor: str, instance_type: str) -> str:
    """One worker group per (flavor, instance type): a pod must ask for all the node's devices so that
    a tensor-parallel group sees them in one Ray node, and a group's pod template has one size."""
    return f"{flavor}-{instance_type.replace('.', '-')}"


def claim_name(gang: str, member: int) -> str:
    return f"{gang}-{member}"
