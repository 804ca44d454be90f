"""The simulated cloud behind the provider interface, as Karpenter's ``cloudprovider/fake`` stands behind its.

It implements ``rayscale.cluster.actuator.Actuator`` over ``rayscale.sim.cloud.Cluster``'s named gangs, plus the
Serve side the controller reads and sets (``ServeView``, ``set_replicas``), so the simulator runs the product's
own ``rayscale.core.step.step`` and applies its actions the way the controller does
(``rayscale.cluster.actuator.apply_actions``): launch timeouts, back-offs, make-before-break, drain order and
gang drains (Serve's replica migration) are the product's, not a second copy. A gang reports as ``serving`` the Serve replicas on it (a packed gang
holds up to its shape's slots; rayscale.sim.cloud places them as Serve does).

What the cloud does on its own follows Karpenter's AWS provider: a capacity error fails the gang (the claim
is deleted; the controller backs the zone off and replaces it), a spot interruption notice fails it too
while its replica drains, and the node goes two minutes later.
"""

from __future__ import annotations

from rayscale.core.act import CreateGang, Gang, GangPhase
from rayscale.core.step import ServeView
from rayscale.sim.cloud import Cluster, GangState

_PENDING = (GangState.WAITING, GangState.PROVISIONING)


class SimulatedServe:
    """The Actuator methods of a provider whose Serve lives in the simulated cluster itself: nothing moves,
    nothing re-submits its config, nothing to close."""

    def serve_dashboard(self) -> str | None:
        return None

    def sync_serve_targets(self, targets: dict[str, dict[str, int]]) -> list[str]:
        return []

    def close(self) -> None:
        return None


class SimProvider(SimulatedServe):
    can_drain = True  # Serve in the simulated cloud moves a drained gang's replicas (Cluster.drain_named)

    def __init__(self, cluster: Cluster, model: str) -> None:
        self.cluster = cluster
        self.model = model
        self.now = 0.0  # the simulated clock, set by the simulation before each step

    def gangs(self, now: float) -> list[Gang]:
        """Every gang the controller holds, as a provider reports them (reads change nothing)."""
        out = []
        for g in self.cluster.named():
            assert g.name is not None
            failed = bool(g.failed) or g.state == GangState.FAILED
            phase = GangPhase.FAILED if failed else (GangPhase.PENDING if g.state in _PENDING else GangPhase.READY)
            out.append(Gang(
                name=g.name, model=self.model, flavor=g.flavor, capacity_type=g.capacity_type, zone=g.zone or "",
                instance_type=g.shape.instance_type, nodes=g.shape.nodes, phase=phase, created_s=g.t_created,
                serving=len(g.replicas), reason=g.failed,
                node_ids=tuple(str(n.id) for n in g.nodes if n.t_ready is not None), draining=g.draining,
            ))
        return out

    def create_gang(self, action: CreateGang, now: float) -> None:
        self.cluster.create_named(action.name, action.flavor, action.capacity_type, action.zone, now)

    def delete_gang(self, name: str) -> None:
        self.cluster.delete_named(name, self.now)

    def drain_gang(self, name: str) -> None:
        self.cluster.drain_named(name, self.now)

    def serve_view(self) -> ServeView:
        running: dict[tuple[str, str], int] = {}
        serving: dict[tuple[str, str], int] = {}
        # Every replica Serve still runs, those draining on a deleted gang included (until they finish).
        for g in self.cluster.gangs.values():
            if g.name is not None and g.replicas:
                mf = (self.model, g.flavor)
                running[mf] = running.get(mf, 0) + len(g.replicas)
                serving[mf] = serving.get(mf, 0) + sum(r.state == GangState.LIVE for r in g.replicas)
        target = {(self.model, f): n for f, n in self.cluster.serve_target.items()}
        return ServeView(target, running, serving)

    def set_replicas(self, model: str, flavor: str, replicas: int) -> None:
        self.cluster.set_serve_target(flavor, replicas, self.now)
