"""Several models in one simulation: each with its own trace, engine and replicas, on one simulated cloud whose
NodePool limits they share.

Each model runs in its own ``Simulation`` (its trace, engine and gangs), and all of them tick in lockstep on
one clock. How the policies see the others:

- ``rayscale``: one ``rayscale.core.step.step`` per control period for every model together, as the controller
  runs it: signals per model, the cluster view of every model's gangs, one plan that shares each flavor's
  NodePool limits by the catalog's priorities. Its actions go through ``apply_actions`` to one provider
  (``FleetProvider``) that hands each gang to its model's simulated cloud.
- ``stock``, ``static-best`` and ``static-peak``: each model its own fleet, configured and searched alone as an
  operator running one deployment per model would (static-best and static-peak act through the same act
  step as rayscale, per model: rayscale.sim.fleet_act). Nothing stops their fleets from adding up past a
  shared limit; the result says where they did (``FlavorUse``).

The run ends for all models together, once every model's trace has drained, so every model's cost covers
the same span. With ``SimConfig.same_start`` (``rayscale simulate`` from cold, by default) every policy starts
each model from the same fleet: the one the shipped step orders for that model's first signal window. ``clairvoyant`` and ``fluid-bound`` stay single-model (``rayscale simulate --trace``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rayscale.cluster.actuator import apply_actions
from rayscale.core import feedback
from rayscale.core.act import CreateGang, Gang
from rayscale.core.catalog import Catalog
from rayscale.core.chunk import pin_chunks
from rayscale.core.estimate import Demand
from rayscale.core.settings import Settings
from rayscale.core.signals import ModelSignals
from rayscale.core.step import ServeView, StepContext, StepState, step
from rayscale.sim.fleet_act import FleetActor, start_warm
from rayscale.sim.policies import Policy, StockConfig, ingress_weights, make_policy
from rayscale.sim.provider import SimProvider, SimulatedServe
from rayscale.sim.simulator import SimConfig, SimResult, Simulation
from rayscale.sim.trace import Trace

MULTI_POLICIES = ("rayscale", "stock", "static-best")  # what --policy all runs with several models
SINGLE_ONLY = ("clairvoyant", "fluid-bound", "oracle")
SEED_STRIDE = 7919  # model i's cloud draws use seed + i * stride: independent, and model 0's match a lone run


@dataclass(frozen=True)
class FlavorUse:
    """Peak use of one flavor's NodePool over the run, every model together, against its limits."""

    flavor: str
    peak_devices: int
    peak_nodes: int
    limit_devices: int | None
    limit_nodes: int | None

    @property
    def exceeded(self) -> bool:
        """More than the limit: fleets sized without the others' would not all have fitted."""
        return ((self.limit_devices is not None and self.peak_devices > self.limit_devices)
                or (self.limit_nodes is not None and self.peak_nodes > self.limit_nodes))

    @property
    def binds(self) -> bool:
        """At or past the limit at some point of the run."""
        return ((self.limit_devices is not None and self.peak_devices >= self.limit_devices)
                or (self.limit_nodes is not None and self.peak_nodes >= self.limit_nodes))

    def describe(self) -> str:
        lim = " ".join(f"{n}/{lim} {what}" for n, lim, what in (
            (self.peak_devices, self.limit_devices, "devices"), (self.peak_nodes, self.limit_nodes, "nodes"))
            if lim is not None)
        return f"{self.flavor} {lim}" + (" EXCEEDED" if self.exceeded else "")


@dataclass
class MultiResult:
    policy: str
    per_model: dict[str, SimResult]
    usage: tuple[FlavorUse, ...]
    wall_s: float

    @property
    def cost_usd(self) -> float:
        return sum(r.cost_usd for r in self.per_model.values())

    def binding(self) -> list[FlavorUse]:
        return [u for u in self.usage if u.binds]

    def summaries(self) -> list[dict[str, Any]]:
        """The --json objects: one per model, each with the run's total cost and the limits that bound."""
        out = []
        for r in self.per_model.values():
            d = r.summary()
            d.update(run_cost_usd=round(self.cost_usd, 6), run_models=sorted(self.per_model),
                     limits_bind=[u.flavor for u in self.binding()],
                     limits_exceeded=[u.flavor for u in self.usage if u.exceeded])
            out.append(d)
        return out


class _Usage:
    """Samples the nodes every model's cloud holds per flavor (lingering ones too: they count against
    NodePool limits), keeping the peak."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.peak: dict[str, tuple[int, int]] = {}

    def sample(self, sims: list[Simulation]) -> None:
        devices: Counter[str] = Counter()
        nodes: Counter[str] = Counter()
        for s in sims:
            for n in s.cluster.nodes.values():
                if n.t_end is None:
                    devices[n.flavor] += n.devices
                    nodes[n.flavor] += 1
        for f in devices:
            d, k = self.peak.get(f, (0, 0))
            self.peak[f] = (max(d, devices[f]), max(k, nodes[f]))

    def result(self) -> tuple[FlavorUse, ...]:
        out = []
        for f, (d, k) in sorted(self.peak.items()):
            lim = self.catalog.flavors[f].limits
            out.append(FlavorUse(f, d, k, lim.devices, lim.nodes))
        return tuple(out)


class FleetProvider(SimulatedServe):
    """One provider over every model's simulated cloud: the controller's single actuator and Serve view,
    each gang and replica target routed to its model's ``SimProvider``."""

    can_drain = True

    def __init__(self, providers: Mapping[str, SimProvider]) -> None:
        self.providers = dict(providers)

    def set_now(self, now: float) -> None:
        for p in self.providers.values():
            p.now = now

    def gangs(self, now: float) -> list[Gang]:
        return [g for p in self.providers.values() for g in p.gangs(now)]

    def create_gang(self, action: CreateGang, now: float) -> None:
        self.providers[action.model].create_gang(action, now)

    def delete_gang(self, name: str) -> None:
        for p in self.providers.values():  # idempotent: only the cloud holding the name acts
            p.delete_gang(name)

    def drain_gang(self, name: str) -> None:
        for p in self.providers.values():
            p.drain_gang(name)

    def serve_view(self) -> ServeView:
        target: dict[tuple[str, str], int] = {}
        running: dict[tuple[str, str], int] = {}
        serving: dict[tuple[str, str], int] = {}
        for p in self.providers.values():
            v = p.serve_view()
            target.update(v.target)
            running.update(v.running)
            serving.update(v.serving or {})
        return ServeView(target, running, serving)

    def set_replicas(self, model: str, flavor: str, replicas: int) -> None:
        self.providers[model].set_replicas(model, flavor, replicas)


class FleetController:
    """The product's step for every model at once: one call per control period, whichever model's
    simulation reaches the period first (all tick on one clock)."""

    def __init__(self, catalog: Catalog, settings: Settings) -> None:
        self.catalog, self.settings = catalog, settings
        self.state = StepState()
        self.sims: dict[str, Simulation] = {}
        self.provider: FleetProvider | None = None
        self.shortfall_periods: Counter[str] = Counter()
        self.created: list[CreateGang] = []  # every gang ordered, for the record
        self.demands: Mapping[str, Demand] | None = None  # the last step's, for the ingress weights
        self._last = -1.0

    def attach(self, sims: Mapping[str, Simulation]) -> None:
        self.sims = dict(sims)
        self.provider = FleetProvider({m: SimProvider(s.cluster, m) for m, s in sims.items()})

    def warm_start(self) -> None:
        """The fleet the initial loads need, live at t=0 (as RayscalePolicy.warm_start does for one model);
        with SimConfig.same_start, each model's shared first fleet, the one the baselines start from."""
        if self._last >= 0:
            return
        self._last = 0.0
        if any(s.cfg.same_start for s in self.sims.values()):
            for sim in self.sims.values():
                FleetActor(sim).warm({})
            return
        result = self._step(0.0, {m: s.initial_signals() for m, s in self.sims.items()})
        for m, sim in self.sims.items():
            mine = [a for a in result.actions if isinstance(a, CreateGang) and a.model == m]
            start_warm(sim.cluster, mine, {a.flavor: result.plan.replicas(m, a.flavor) for a in mine})

    def control(self, now: float) -> None:
        if now <= self._last + 1e-9:
            return  # another model's simulation already ran this period's step
        self._last = now
        result = self._step(now, {m: s.signals(now) for m, s in self.sims.items()})
        for m in {a.model for a in result.actions if isinstance(a, CreateGang)}:
            self.sims[m].cluster.scale_up_events += 1
        for s in result.plan.shortfalls:
            if s.unmet_rps > 0 or s.missing_replicas > 0:
                self.shortfall_periods[s.model] += 1
        assert self.provider is not None
        apply_actions(result.actions, self.provider, self.provider.set_replicas, now)

    def _step(self, now: float, signals: dict[str, ModelSignals]) -> Any:
        assert self.provider is not None
        self.provider.set_now(now)
        ctx = StepContext(now, self.catalog, signals, tuple(self.provider.gangs(now)), self.provider.serve_view(),
                          self.settings, self.state, self.provider.can_drain)
        result = step(ctx)
        self.state, self.demands = result.state, result.demands
        self.created.extend(a for a in result.actions if isinstance(a, CreateGang))
        return result


class _Member(Policy):
    """One model's share of the fleet controller: its simulation asks, the controller acts for all."""

    name = "rayscale"

    def __init__(self, controller: FleetController, model: str) -> None:
        self.controller, self.model = controller, model
        self._weights: dict[str, float] | None = None

    def warm_start(self, sim: Simulation) -> None:
        self.controller.warm_start()

    def flavor_weights(self, sim: Simulation) -> dict[str, float] | None:
        if self.controller.demands is not None:
            self._weights = ingress_weights(sim, self.controller.demands, self._weights)
        return self._weights

    def control(self, now: float, sim: Simulation) -> None:
        self.controller.control(now)

    def extra(self) -> dict[str, Any]:
        mine = {m: r for m, r in self.controller.state.delivered.items() if m == self.model}
        return {"shortfall_periods": self.controller.shortfall_periods.get(self.model, 0), **feedback.report(mine)}


@dataclass(frozen=True)
class MultiConfig:
    """What one multi-model run shares: the simulation settings (its ``model`` is ignored; each model gets
    its own seed offset) and the stock policy's configuration."""

    sim: SimConfig = field(default_factory=SimConfig)
    stock: StockConfig = field(default_factory=StockConfig)
    # Per model, when its scoring starts (its warm-up draw's length: rayscale.sim.sources.with_warmup_draw);
    # a model not named here uses sim.warmup_s.
    warmup_s: Mapping[str, float] = field(default_factory=dict)


def check_models(catalog: Catalog, traces: Mapping[str, Trace], policy: str) -> None:
    if not traces:
        raise ValueError("no models to simulate")
    unknown = sorted(set(traces) - set(catalog.models))
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; allowed: {sorted(catalog.models)}")
    if policy in SINGLE_ONLY:
        raise ValueError(f"policy {policy} runs one model at a time (rayscale simulate --trace); "
                         f"with several models: {', '.join((*MULTI_POLICIES, 'static-peak'))}")


class MultiSimulation:
    """Every model of ``traces`` (model -> its trace) under ``policy``, together on one clock and cloud."""

    def __init__(self, catalog: Catalog, traces: Mapping[str, Trace], policy: str,
                 cfg: MultiConfig = MultiConfig()) -> None:
        check_models(catalog, traces, policy)
        self.catalog, self.cfg = catalog, cfg
        self.models = list(traces)
        settings = cfg.sim.settings
        self.controller: FleetController | None = None
        if policy == "rayscale":
            # The chunk every replica runs is the one rayscale deploys, as Simulation pins it for one model.
            cat = pin_chunks(catalog.subset(self.models), tuned=True, default=cfg.sim.engine.max_num_batched_tokens)
            self.controller = FleetController(cat, settings)
        self.sims: dict[str, Simulation] = {}
        for i, m in enumerate(self.models):
            pol = (_Member(self.controller, m) if self.controller is not None
                   else make_policy(policy, settings, cfg.stock))
            sim_cfg = replace(cfg.sim, model=m, seed=cfg.sim.seed + i * SEED_STRIDE,
                              warmup_s=cfg.warmup_s.get(m, cfg.sim.warmup_s))
            self.sims[m] = Simulation(catalog, traces[m], pol, sim_cfg)
        if self.controller is not None:
            self.controller.attach(self.sims)

    def run(self) -> MultiResult:
        t0 = time.perf_counter()
        usage = _Usage(self.catalog)
        members = list(self.sims.values())
        for s in members:
            s.begin()
        period, next_sample = self.cfg.sim.control_period_s, 0.0
        while True:
            if next_sample <= members[0].now + 1e-9:
                usage.sample(members)
                next_sample += period
            for s in members:
                s.tick()
            if all(s.done() for s in members):
                break
        per_model = {m: s.end() for m, s in self.sims.items()}
        for m, r in per_model.items():
            r.extra["priority"] = self.catalog.models[m].priority
        return MultiResult(per_model[self.models[0]].policy, per_model, usage.result(), time.perf_counter() - t0)


def simulate_models(catalog: Catalog, traces: Mapping[str, Trace], policy: str,
                    cfg: MultiConfig = MultiConfig()) -> MultiResult:
    """Run ``policy`` for every model of ``traces`` (model -> its trace) together on one clock and cloud."""
    return MultiSimulation(catalog, traces, policy, cfg).run()


def render_multi(results: list[MultiResult]) -> str:
    """A table per policy (one row per model and a total), then the NodePool limits each run reached."""
    from rayscale.tables import format_table

    head = ["model", "priority", "requests", "SLO met", "TTFT p95 s", "TPOT p95 s", "failed", "rejected",
            "cost $", "accel h", "scale-ups"]
    parts = []
    for res in results:
        rows: list[list[Any]] = []
        for m, r in res.per_model.items():
            rows.append([m, r.extra.get("priority", ""), r.requests, f"{100 * r.slo_attainment:.2f}%", r.ttft_p95_s,
                         r.tpot_p95_s, r.failed_requests, r.rejected_requests, r.cost_usd, r.accelerator_hours,
                         r.scale_up_events])
        rs = list(res.per_model.values())
        n = sum(r.requests for r in rs)
        met = sum(r.slo_attainment * r.requests for r in rs) / n if n else 0.0
        rows.append(["total", "", n, f"{100 * met:.2f}%", "", "", sum(r.failed_requests for r in rs),
                     sum(r.rejected_requests for r in rs), res.cost_usd, sum(r.accelerator_hours for r in rs),
                     sum(r.scale_up_events for r in rs)])
        parts.append(format_table(head, rows, title=f"policy {res.policy} ({res.wall_s:.1f} s)"))
        bound = res.binding()
        if bound:
            parts.append(f"{res.policy}: NodePool limits reached (peak/limit): "
                         + ", ".join(u.describe() for u in bound))
        else:
            parts.append(f"{res.policy}: no NodePool limit reached")
        for m, r in res.per_model.items():
            if r.extra.get("shortfall_periods"):
                parts.append(f"{res.policy}: {m} had demand the plan could not place in "
                             f"{r.extra['shortfall_periods']} control periods")
    for m, r in (results[0].per_model.items() if results else ()):
        if r.rejected_requests:
            parts.append(f"WARNING: {m}: {r.rejected_requests} requests rejected, not served: their prompt does not "
                         "fit the model's context (max_model_len), as vLLM rejects them; no SLO column counts them")
    starts = {m: r.extra["start_fleet"] for m, r in results[0].per_model.items()
              if "start_fleet" in r.extra} if results else {}
    parts.append("every policy starts from the same on-demand fleet live at t=0: "
                 + ", ".join(f"{m} {f or 'none'}" for m, f in starts.items()) if starts
                 else "each policy starts from its own fleet")
    return "\n".join(parts)
