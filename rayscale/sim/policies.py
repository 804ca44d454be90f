"""Scaling policies the simulator compares. None of them copies the core's policy:

- ``rayscale``: the product's own ``rayscale.core.step.step`` with the shipped settings, fed ModelSignals built
  from the simulated metrics every control period, acting through the simulated cloud's provider;
- ``stock``: Ray Serve's own autoscaling policy functions (replica_queue_length_autoscaling_policy,
  _apply_scaling_factors, _apply_delay_logic with the simulated clock), configured as a competent operator
  would (StockPolicy), then KubeRay + Karpenter: the cheapest instance that fits one pending pod, batched
  (idle 1 s, max 10 s), idle nodes linger (KubeRay idleTimeoutSeconds 60 s + consolidateAfter 30 s),
  graceful shutdown 20 s;
- ``static-best``, ``clairvoyant`` (rayscale.sim.baselines): the cheapest fixed fleet and the cheapest
  per-minute plan with perfect knowledge of arrivals that reach the SLO goal by replay in the same engine;
- ``static-peak``: the core planner fed the trace's peak rate (60 s windows) from start to end;
- ``fluid-bound`` (alias ``oracle``): perfect foresight (the next minute's true rate), instant nodes, no
  capacity errors or interruptions, sized by the per-replica capacity at the SLO *measured* on the simulated
  engine (rayscale.sim.capacity); its reported cost is the fluid integral (fractional replicas of the cheapest
  $/req offering, each priced as its share of the node it packs into, spot at the flavor's spot share), with
  no SLO claim: its latency comes from running a different (integer) plan.

Every policy but ``stock`` acts the way the product acts: rayscale through its step's actions, the others by
handing their replica targets to the same act step (``rayscale.core.act.decide``, rayscale.sim.fleet_act), so
replicas pack onto nodes (eight TP=1 on a p5.48xlarge), make before break and replace lost gangs by one set
of rules. ``stock`` models another stack, so it keeps its own path (StockPolicy says why).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from rayscale.cluster.actuator import apply_actions
from rayscale.core import checkpoint, feedback
from rayscale.core.act import CreateGang, Key
from rayscale.core.catalog import CapacityType, Catalog
from rayscale.core.estimate import (
    Correction,
    Demand,
    EstimateSettings,
    estimate,
    prior_mix,
)
from rayscale.core.forecast import FORECASTERS, Forecaster
from rayscale.core.gangs import gang_shape
from rayscale.core.plan import PlannerMemory, PlannerSettings, plan
from rayscale.core.route import flavor_weights
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals, RequestMix, length_quantiles
from rayscale.core.spot import rates
from rayscale.core.step import StepContext, StepResult, StepState, step
from rayscale.sim.capacity import CapacitySettings, MeasuredCapacity, cheapest_capacity
from rayscale.sim.cloud import ActuatorConfig
from rayscale.sim.engine import p95
from rayscale.sim.fleet_act import FleetActor, first_fleet, share_usd_per_h, start_warm
from rayscale.sim.provider import SimProvider

if TYPE_CHECKING:  # the simulator imports the policies it runs: for annotations only, or a cycle
    from rayscale.sim.simulator import Simulation

# What `rayscale simulate --policy all` runs; static-peak and the alias oracle (= fluid-bound) on request.
POLICIES = ("rayscale", "stock", "static-best", "clairvoyant", "fluid-bound")
ALIASES = {"oracle": "fluid-bound"}


@dataclass(frozen=True)
class StockConfig:
    """Ray Serve's autoscaling settings and the KubeRay/Karpenter chain. None: configured from the catalog as
    StockPolicy's docstring says (the best single flavor, 75% of its concurrency at the SLO, ...)."""

    flavor: str | None = None
    target_ongoing_requests: float | None = None
    target_share: float = 0.75  # of one replica's concurrency at the SLO
    max_ongoing_requests: int | None = None  # None: 2x the target, rounded up
    max_replicas: int | None = None  # None: the flavor's NodePool limit in replicas (never the binding cap)
    tuned_chunk: bool = True  # the prefill chunk rayscale picks (rayscale.core.chunk); False: vLLM's default
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    autoscaler_delay_s: float = 5.0  # Ray autoscaler sees the pending actor, KubeRay patches the worker group
    idle_timeout_s: float = 60.0  # KubeRay idleTimeoutSeconds
    consolidate_after_s: float = 30.0  # Karpenter consolidateAfter for empty nodes
    graceful_shutdown_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ValueError(f"stock target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if not 0 < self.target_share <= 1:
            raise ValueError(f"stock target_share must be in (0, 1], got {self.target_share}")


@dataclass(frozen=True)
class StockSetup:
    """What StockPolicy.configure chose, and from what."""

    flavor: str
    usd_per_rps: float  # $/h per req/s at the SLO (estimator), on-demand, cheapest fitting instance
    capacity_rps: float  # one replica at the SLO, estimator
    concurrency: float  # sequences one replica runs at that load (estimator)
    target_ongoing_requests: float
    max_ongoing_requests: int
    max_replicas: int


class Policy:
    name = "policy"
    actuator = ActuatorConfig()
    slot_cap: int | None = None  # per-replica admission cap (Ray Serve max_ongoing_requests)
    # Replicas run the prefill chunk rayscale picks for the declared mix (rayscale.core.chunk); False: vLLM's default.
    tuned_chunk = True

    def flavors(self, catalog: Catalog, model: str) -> list[str]:
        return sorted(catalog.models[model].parallelism)

    def warm_start(self, sim: Simulation) -> None:
        """Place the replicas this policy would run at the trace's initial load, live at t=0."""

    def control(self, now: float, sim: Simulation) -> None:
        raise NotImplementedError

    def flavor_weights(self, sim: Simulation) -> dict[str, float] | None:
        """The weights this policy's ingress routes by, per flavor (None: the simulation's default,
        Simulation._route)."""
        return None

    def extra(self) -> dict[str, Any]:
        return {}


def ingress_weights(sim: Simulation, demands: Mapping[str, Demand],
                    previous: dict[str, float] | None) -> dict[str, float] | None:
    """The weights the controller pushes to the ingress for ``sim``'s model: the replicas serving now times
    the estimator's per-replica capacity (rayscale.core.route.flavor_weights), pushed only while their sum is
    positive (rayscale.controller.loop), else the ingress keeps ``previous``."""
    serving = {(sim.model, f): n for f, n in sim.cluster.live_by_flavor().items()}
    w = flavor_weights(serving, demands).get(sim.model, {})
    return w if sum(w.values()) > 0 else previous


class _Planned(NamedTuple):
    targets: dict[tuple[str, str], int]  # replicas per (flavor, capacity type)
    memory: PlannerMemory
    usd_per_h: float
    demands: dict[str, Demand]  # the next period's ``previous`` (where the estimator's searches start)


def _plan_targets(catalog: Catalog, model: str, signals: ModelSignals, now: float, memory: PlannerMemory | None,
                  corrections: dict[tuple[str, str], Correction], forecaster: Forecaster, est: EstimateSettings,
                  settings: PlannerSettings, current: dict[Key, int], unavailable: dict[tuple[str, str, str], float] | None = None,
                  previous: dict[str, Demand] | None = None) -> _Planned:
    demands = estimate(catalog, {model: signals}, corrections, forecaster, est, previous)
    p, mem = plan(catalog, demands, current, unavailable, now, memory, settings)
    return _Planned({(e.flavor, e.capacity_type): e.replicas for e in p.entries if e.model == model}, mem,
                    p.usd_per_h, demands)


class RayscalePolicy(Policy):
    """The product: ``rayscale.core.step.step`` with the given settings (the shipped ones by default), acting
    through the simulated cloud's provider (rayscale.sim.provider) as the controller acts through its own.
    ``restart_at_s``: the controller restarts then; the cluster it reads back is unchanged. As the controller
    does (rayscale.controller.loop), it saves a checkpoint every ``checkpoint_every_s`` and the restarted one
    reads the last back through the same codec (rayscale.core.checkpoint); ``checkpoint_every_s=None``: the
    checkpoint is lost and the restart starts blind (no rate history, corrections or SLO feedback's record)."""

    name = "rayscale"

    def __init__(self, settings: Settings | None = None, restart_at_s: float | None = None,
                 checkpoint_every_s: float | None = checkpoint.CHECKPOINT_EVERY_S) -> None:
        self.settings = settings or Settings()
        self.state = StepState()
        self.provider: SimProvider | None = None
        self.restart_at_s = restart_at_s
        self.checkpoint_every_s = checkpoint_every_s
        self._checkpoint: str | None = None
        self._next_save_s = 0.0
        self.last: StepResult | None = None  # the last step's result (its plan and why), for benches that look in
        self._weights: dict[str, float] | None = None

    def _step(self, now: float, sim: Simulation, signals: ModelSignals, warm: bool = False) -> None:
        provider = self.provider
        assert provider is not None
        provider.now = now
        ctx = StepContext(now, sim.catalog, {sim.model: signals}, tuple(provider.gangs(now)),
                          provider.serve_view(), self.settings, self.state, provider.can_drain)
        result = step(ctx)
        self.state, self.last = result.state, result
        if warm:  # the fleet this load needs, already up and serving at t=0
            flavors = {a.flavor for a in result.actions if isinstance(a, CreateGang)}
            start_warm(sim.cluster, result.actions, {f: result.plan.replicas(sim.model, f) for f in flavors}, now)
            return
        if any(isinstance(a, CreateGang) for a in result.actions):
            sim.cluster.scale_up_events += 1
        apply_actions(result.actions, provider, provider.set_replicas, now)

    def flavor_weights(self, sim: Simulation) -> dict[str, float] | None:
        """The controller's routing weights (rayscale.controller.loop pushes them to the ingress when their
        sum is positive; the ingress keeps the last): replicas serving times the estimator's per-replica
        capacity (rayscale.core.route.flavor_weights)."""
        if self.last is not None:
            self._weights = ingress_weights(sim, self.last.demands, self._weights)
        return self._weights

    def warm_start(self, sim: Simulation) -> None:
        self.provider = SimProvider(sim.cluster, sim.model)
        if sim.cfg.same_start:
            FleetActor(sim).warm({})
            return
        self._step(0.0, sim, sim.initial_signals(), warm=True)

    def control(self, now: float, sim: Simulation) -> None:
        if self.restart_at_s is not None and now >= self.restart_at_s:
            self.state, self.restart_at_s = self._restored(now), None
        self._step(now, sim, sim.signals(now))
        if self.restart_at_s is not None and self.checkpoint_every_s is not None and now >= self._next_save_s:
            # The simulator counts arrivals from the trace itself, so the checkpoint carries the state alone.
            self._checkpoint = checkpoint.dumps(checkpoint.Checkpoint(now, self.state))
            self._next_save_s = now + self.checkpoint_every_s

    def _restored(self, now: float) -> StepState:
        if self._checkpoint is None:
            return StepState()
        cp = checkpoint.loads(self._checkpoint, "the simulated controller's checkpoint")
        return cp.state if cp.usable_at(now, checkpoint.max_age_s(self.settings)) is None else StepState()

    def extra(self) -> dict[str, Any]:
        """Where SLO feedback left each model (rayscale.core.feedback): its factor on demand and the
        smoothed attainment that moved it; and the spot interruptions per node-hour the step learned per
        flavor (rayscale.core.spot.rates: only flavors it saw interrupted)."""
        out: dict[str, Any] = dict(feedback.report(self.state.delivered))
        learned = rates(self.state.spot, self.settings.spot, sorted(self.state.spot.pools))
        out.update({f"spot_interruptions_per_node_h_{f}": r for f, r in learned.items()})
        return out


class StaticPeakPolicy(Policy):
    """The core planner fed the trace's peak rate every period; acts through ``decide`` (rayscale.sim.fleet_act)."""

    name = "static-peak"

    def __init__(self, settings: Settings | None = None):
        settings = settings or Settings()
        self.planner, self.est = settings.planner, settings.estimate
        self.memory: PlannerMemory | None = None
        self.sig: ModelSignals | None = None
        self.demands: dict[str, Demand] | None = None
        self.actor: FleetActor | None = None

    def warm_start(self, sim: Simulation) -> None:
        peak = sim.peak_rate()
        self.sig = ModelSignals(sim.model, Freshness.FRESH, 0.0, peak, sim.trace_mix(), waiting=0.0)
        self.actor = FleetActor(sim)
        targets, self.memory, _, self.demands = _plan_targets(sim.catalog, sim.model, self.sig, 0.0, None, {},
                                                              FORECASTERS["last"], self.est, self.planner, {})
        self.actor.warm(targets)

    def control(self, now: float, sim: Simulation) -> None:
        # Same peak demand every period: the planner only acts to replace lost (interrupted) replicas.
        assert self.sig is not None and self.actor is not None
        targets, self.memory, _, self.demands = _plan_targets(
            sim.catalog, sim.model, self.sig, now, self.memory, {}, FORECASTERS["last"], self.est,
            self.planner, self.actor.current(), dict(self.actor.unavailable), self.demands)
        self.actor.act(targets, now)


class OraclePolicy(Policy):
    """Perfect foresight, instant nodes, fluid packing: a lower bound on cost for the same SLO.

    Method (bench/results/sim_policies.md repeats it):

    1. Capacity at the SLO is *measured*, not predicted: for every flavor, rayscale.sim.capacity finds
       the largest arrival rate per replica at which a pool of replicas of the very Engine and
       EngineConfig the simulation runs, fed Poisson arrivals of this trace's own requests, serves
       ``capacity.attainment`` (99%) of them within both SLO targets. The estimator's profile model is
       not used for sizing: against this engine it is off by up to 3x (with chunked prefill it predicts
       more than a replica sustains at 99% per-request attainment on slow-prefill flavors; without it,
       less), and a bound must not inherit that error (the policies under test do; rayscale's corrections
       chase it). Flavors are measured cheapest-first by the model's guess; a flavor that misses the SLO
       at the rate it would need to be cheaper per request than one already measured is settled with
       that one run (``cheapest_capacity``) and left out of the integer plan.
    2. Perfect foresight: every control period the oracle knows the true arrival rate of the next
       ``lookahead_s``.
    3. Fluid packing, instant nodes: its reported cost is the integral of rate / capacity replicas of the
       offering with the lowest $ per request/s (fractional replicas, started and stopped instantly;
       spot at the flavor's maximum spot share), so it pays for no idle capacity, no start-up, no rounding
       and no headroom. Poisson arrivals are smoother than the traces' (their within-minute bursts need
       more capacity, never less), and the measuring pool (about 2,048 concurrent sequences: 64 A10G
       or 16 L40S replicas of a 7B) is about as large as the largest pools the policies run here.

    Its latency columns come from running its integer plan (the core planner fed the true next-minute
    rate, or the last half minute's if higher, and the measured capacities at the estimator's target
    utilisation; no hysteresis, instant nodes); that plan's cost is reported as ``integer_cost_usd``:
    what perfect foresight and instant nodes would cost with whole replicas.
    """

    name = "fluid-bound"
    actuator = ActuatorConfig(provision_delay_s=0.0, instant=True, drain_timeout_s=3600.0)

    def __init__(self, lookahead_s: float = 60.0, settings: Settings | None = None,
                 capacity: CapacitySettings | None = None) -> None:
        settings = settings or Settings()
        planner = settings.planner
        self.lookahead_s = lookahead_s
        self.est = settings.estimate
        # No hysteresis: with instant nodes the oracle follows demand exactly.
        self.planner = PlannerSettings(hysteresis_band=0.0, downscale_headroom=0.0, downscale_delay_s=0.0,
                                       min_dwell_s=0.0, dwell_covers_startup=False,
                                       exact_max_vars=planner.exact_max_vars,
                                       solver=planner.solver)
        self.capacity_settings = capacity
        self.capacity: dict[str, MeasuredCapacity] = {}
        self.fluid_usd = 0.0
        self.fluid_dev_h = 0.0
        self.memory: PlannerMemory | None = None
        self._demands: dict[str, Demand] | None = None
        self._last: float | None = None
        self._rate = (0.0, 0.0)
        self._per_rps = (math.inf, 0.0)  # ($/h, devices) per request/s of the cheapest offering
        self.actor: FleetActor | None = None

    def measure(self, sim: Simulation) -> None:
        """Capacity at the SLO per flavor, measured with the simulation's own Engine configuration."""
        settings = self.capacity_settings or sim.cfg.oracle_capacity
        mix = sim.trace_mix()
        d = estimate(sim.catalog, {sim.model: ModelSignals(sim.model, Freshness.FRESH, 0.0, 1.0, mix)}, None,
                     FORECASTERS["last"], replace(self.est, target_utilization=1.0))[sim.model]
        offers, price, devices = [], {}, {}
        for f in sim.flavors:
            # A replica costs its share of the node it packs into (eight TP=1 replicas share a p5.48xlarge).
            fl = sim.catalog.flavors[f]
            shape = sim.cluster.shape(f, CapacityType.ON_DEMAND.value)
            usd = share_usd_per_h(sim.catalog, sim.model, f, CapacityType.ON_DEMAND.value)
            if CapacityType.SPOT in fl.capacity_types and fl.spot_max_share > 0:
                spot = share_usd_per_h(sim.catalog, sim.model, f, CapacityType.SPOT.value)
                usd = (1 - fl.spot_max_share) * usd + fl.spot_max_share * spot
            price[f] = usd
            devices[f] = shape.nodes * fl.instance(shape.instance_type).devices / shape.slots
            guess = d.capacity[f].rps if f in d.capacity and d.capacity[f].feasible else 0.0
            offers.append((sim.catalog.profile(sim.model, f), usd, guess))
        self.capacity = cheapest_capacity(offers, sim.spec.slo, sim.prompt, sim.output, sim.cfg.engine, settings,
                                          sim.cfg.seed)
        best = (math.inf, 0.0)
        for f, c in self.capacity.items():
            if c.rps > 0 and price[f] / c.rps < best[0]:
                best = (price[f] / c.rps, devices[f] / c.rps)
        self._per_rps = best

    def _signals(self, sim: Simulation, now: float) -> ModelSignals:
        # Near the end of the trace the window is cut at the last arrival (no phantom drop to zero).
        end = float(sim.arr[-1])
        rate, mix = sim.future_load(now, max(min(self.lookahead_s, end - now), sim.cfg.control_period_s))
        return ModelSignals(sim.model, Freshness.FRESH, 0.0, rate, mix, waiting=0.0)

    def _fluid(self, rate: float) -> tuple[float, float]:
        """($/h, devices) of fractional replicas of the cheapest offering for this rate."""
        if not math.isfinite(self._per_rps[0]):
            return 0.0, 0.0
        return rate * self._per_rps[0], rate * self._per_rps[1]

    def _targets(self, sim: Simulation, now: float) -> dict[tuple[str, str], int]:
        sig = self._signals(sim, now)
        self._rate = self._fluid(sig.arrival_rate_rps or 0.0)
        # The integer plan also keeps what the last half minute brought: replicas still busy with a burst
        # that just ended must not be drained onto the few that remain (the fluid bound needs no such care).
        lo, hi = sim.count_arrivals(now - 30.0, now)
        sig = replace(sig, arrival_rate_rps=max(sig.arrival_rate_rps or 0.0, (hi - lo) / 30.0))
        self._demands = estimate(sim.catalog, {sim.model: sig}, None, FORECASTERS["last"], self.est,
                                 self._demands)
        d = self._demands[sim.model]
        caps = {}
        for f, cap in d.capacity.items():
            m = self.capacity.get(f)
            if m is None:
                caps[f] = cap
            elif m.rps > 0:
                caps[f] = cap._replace(rps=m.rps * self.est.target_utilization, reason="")
            else:
                why = (f"measured: costlier per request than the cheapest flavor (< {m.below_rps:.3g} req/s)"
                       if m.dominated else "measured: misses the SLO even nearly idle")
                caps[f] = cap._replace(rps=0.0, reason=why)
        d = replace(d, capacity=caps)
        assert self.actor is not None
        p, self.memory = plan(sim.catalog, {sim.model: d}, self.actor.current(), None, now, self.memory,
                              self.planner)
        return {(e.flavor, e.capacity_type): e.replicas for e in p.entries if e.model == sim.model}

    def warm_start(self, sim: Simulation) -> None:
        self.measure(sim)
        self._last = 0.0
        self.actor = FleetActor(sim)
        self.actor.warm(self._targets(sim, 0.0))

    def control(self, now: float, sim: Simulation) -> None:
        self.accrue(now)
        assert self.actor is not None
        self.actor.act(self._targets(sim, now), now)

    def accrue(self, now: float) -> None:
        if self._last is not None and now > self._last:
            h = (now - self._last) / 3600.0
            self.fluid_usd += self._rate[0] * h
            self.fluid_dev_h += self._rate[1] * h
        self._last = now

    def mark_warmup(self, now: float) -> None:
        """The simulation's warm-up ends at ``now``: the bound counts from here."""
        self.accrue(now)
        self.fluid_usd = self.fluid_dev_h = 0.0

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fluid_cost_usd": self.fluid_usd, "fluid_accelerator_hours": self.fluid_dev_h}
        out.update({f"capacity_rps_{f}": c.rps for f, c in sorted(self.capacity.items())})
        return out


class StockPolicy(Policy):
    """Ray Serve's own autoscaling policy code, configured as a competent operator would configure it.

    Configuration procedure (``configure``, from the catalog alone: no trace statistics):

    1. Flavor: the model's best single flavor, the lowest $ per req/s at the SLO. Capacity per replica is
       the estimator's (rayscale.core.estimate at target utilisation 1.0) for the model's declared request
       mix (models.yaml ``request_mix``, or ``--request-mix``); price is Karpenter's cheapest instance that
       fits one replica (rayscale.core.gangs.gang_shape), on-demand.
    2. ``target_ongoing_requests``: ``target_share`` (75%) of one replica's concurrency at the SLO, the
       estimator's batch at that capacity (Little's law: capacity x latency). ``--stock-target X`` overrides
       it (a sweep draws a cost-vs-SLO curve).
    3. ``max_ongoing_requests``: 2x the target, rounded up (queueing at the replica, not the proxy).
    4. ``max_replicas``: the flavor's NodePool limit in replicas, so the cluster's limit binds before Serve's;
       ``min_replicas``: the model's, at least 1. Delays and look-back: Serve's defaults.

    Replicas run the prefill chunk rayscale picks (the same chunk rule as every policy; ``tuned_chunk=False``
    gives vLLM's default) on on-demand capacity only.

    Unlike the other policies it does not act through ``rayscale.core.act.decide``: it models the stack an
    operator runs without rayscale, where Ray's autoscaler asks for one worker pod per pending replica and
    Karpenter launches the cheapest instance that fits that one pod (batched, idle nodes lingering and
    reused), so each replica gets a node of its own (``Cluster.set_target``), priced whole
    (``replica_usd_per_h``).
    """

    name = "stock"

    def __init__(self, cfg: StockConfig = StockConfig()) -> None:
        self.cfg = cfg
        self.tuned_chunk = cfg.tuned_chunk
        self.actuator = ActuatorConfig(
            provision_delay_s=cfg.autoscaler_delay_s, karpenter_batch=True,
            node_linger_s=cfg.idle_timeout_s + cfg.consolidate_after_s, reuse_idle_nodes=True,
            drain_timeout_s=cfg.graceful_shutdown_timeout_s,
        )
        self.setup: StockSetup | None = None
        self.target = 0
        self.peak_target = 0
        self.state: dict[str, Any] = {}
        self._ray: Any = None
        self.others: list[tuple[str, str]] = []  # the shared start fleet's other (flavor, capacity type)s

    @property
    def flavor(self) -> str:
        assert self.setup is not None, "StockPolicy.configure runs first (Simulation calls flavors())"
        return self.setup.flavor

    def configure(self, catalog: Catalog, model: str) -> StockSetup:
        """Steps 1-4 of the class docstring."""
        spec = catalog.models[model]
        mix = prior_mix(catalog, model)
        d = estimate(catalog.subset([model]), {model: ModelSignals(model, Freshness.FRESH, 0.0, 1.0, mix)}, None,
                     FORECASTERS["last"], EstimateSettings(target_utilization=1.0, burst_floor=False))[model]
        if self.cfg.flavor is not None and self.cfg.flavor not in spec.parallelism:
            raise ValueError(f"stock policy: model {model} has no flavor {self.cfg.flavor!r}; "
                             f"allowed: {sorted(spec.parallelism)}")
        names = [self.cfg.flavor] if self.cfg.flavor is not None else sorted(spec.parallelism)
        best: tuple[float, str] | None = None
        for f in names:
            c = d.capacity.get(f)
            usd = replica_usd_per_h(catalog, model, f, CapacityType.ON_DEMAND)
            per = usd / c.rps if c is not None and c.rps > 0 else math.inf
            if best is None or per < best[0]:
                best = (per, f)
        assert best is not None
        flavor = best[1]
        cap = d.capacity[flavor]
        target = self.cfg.target_ongoing_requests or max(self.cfg.target_share * cap.batch, 1.0)
        max_ongoing = self.cfg.max_ongoing_requests or math.ceil(2 * target)
        self.setup = StockSetup(flavor, best[0], cap.rps, cap.batch, target, max_ongoing,
                                self.cfg.max_replicas or limit_replicas(catalog, model, flavor))
        self.slot_cap = max_ongoing
        return self.setup

    def flavors(self, catalog: Catalog, model: str) -> list[str]:
        return [self.configure(catalog, model).flavor]

    def _load_ray(self, sim: Simulation) -> None:
        try:
            from ray.serve import autoscaling_policy as ap
            from ray.serve._private.common import DeploymentID
            from ray.serve.config import AutoscalingConfig, AutoscalingContext
        except ImportError as e:  # pragma: no cover - ray is a hard dependency
            raise RuntimeError(f"the stock policy calls Ray Serve's autoscaling code: {e}") from e
        spec, setup = sim.catalog.models[sim.model], self.setup
        assert setup is not None
        conf = AutoscalingConfig(
            min_replicas=max(1, spec.min_replicas), max_replicas=max(setup.max_replicas, 1),
            target_ongoing_requests=setup.target_ongoing_requests, upscale_delay_s=self.cfg.upscale_delay_s,
            downscale_delay_s=self.cfg.downscale_delay_s, look_back_period_s=self.cfg.look_back_period_s,
        )
        self._ray = (ap, DeploymentID(sim.model, "sim"), conf, AutoscalingContext)

    def warm_start(self, sim: Simulation) -> None:
        self._load_ray(sim)
        _, _, conf, _ = self._ray
        # Steady state at the initial load: ongoing = rate x latency (Little), replicas = ongoing / target.
        rate, mix = sim.future_load(0.0, 60.0)
        prof = sim.catalog.profile(sim.model, self.flavor)
        latency = prof.ttft_s(mix.prompt_mean) + max(mix.output_mean - 1, 0) * prof.itl_s(2)
        n = math.ceil(rate * latency / conf.target_ongoing_requests)
        self.target = self.peak_target = min(max(n, conf.min_replicas), conf.max_replicas)
        start = first_fleet(sim) if sim.cfg.same_start else {(self.flavor, CapacityType.ON_DEMAND.value): self.target}
        for (f, ct), k in sorted(start.items()):
            for _ in range(k):
                sim.cluster.place_warm(f, ct, 0.0)
        self.others = sorted(set(start) - {(self.flavor, CapacityType.ON_DEMAND.value)})
        if sim.cfg.same_start:  # Serve's autoscaler starts from the replicas the shared fleet runs of its flavor
            self.target = start.get((self.flavor, CapacityType.ON_DEMAND.value), 0)

    def decide(self, now: float, ongoing: float, running_replicas: int) -> int:
        """Ray Serve's default policy as `_apply_autoscaling_config` wraps it, on the simulated clock."""
        ap, dep, conf, ctx_cls = self._ray
        ctx = ctx_cls(
            deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name,
            current_num_replicas=running_replicas, target_num_replicas=self.target, running_replicas=[],
            total_num_requests=ongoing, total_queued_requests=None, aggregated_metrics={}, raw_metrics={},
            capacity_adjusted_min_replicas=conf.min_replicas, capacity_adjusted_max_replicas=conf.max_replicas,
            policy_state=dict(self.state), last_scale_up_time=None, last_scale_down_time=None,
            current_time=now, config=conf,
        )
        cold = ap._get_cold_start_scale_up_replicas(ctx)
        if cold is not None:
            decision = cold
        else:
            desired, _ = ap.replica_queue_length_autoscaling_policy(ctx)
            desired = ap._apply_scaling_factors(desired, ctx.current_num_replicas, conf)
            if ctx.current_num_replicas == 0 and desired > 0:
                decision = desired
            else:
                # Ray reads time.time() here unless _now is given: the simulated clock goes in instead.
                decision, self.state = ap._apply_delay_logic(max(0, desired), self.target, conf, self.state,
                                                             _now=now)
        decision = math.ceil(decision)
        return int(min(max(decision, conf.min_replicas), conf.max_replicas))  # AutoscalingState.apply_bounds

    def control(self, now: float, sim: Simulation) -> None:
        ongoing = sim.mean_ongoing(now, self.cfg.look_back_period_s)
        self.target = self.decide(now, ongoing, sim.cluster.live_count())
        self.peak_target = max(self.peak_target, self.target)
        sim.cluster.set_target(self.flavor, CapacityType.ON_DEMAND.value, self.target, now)
        if self.others and sim.cluster.live_by_flavor().get(self.flavor, 0) >= 1:
            # A shared start fleet on other flavors: the operator retires it once this deployment serves.
            for f, ct in self.others:
                sim.cluster.set_target(f, ct, 0, now)
            self.others = []

    def extra(self) -> dict[str, Any]:
        s = self.setup
        if s is None:
            return {}
        return {"stock_flavor": s.flavor, "stock_target_ongoing_requests": s.target_ongoing_requests,
                "stock_max_ongoing_requests": s.max_ongoing_requests, "stock_max_replicas": s.max_replicas,
                "stock_peak_replicas": self.peak_target, "stock_concurrency_at_slo": s.concurrency,
                "stock_capacity_rps": s.capacity_rps}


def replica_usd_per_h(catalog: Catalog, model: str, flavor: str, ct: CapacityType) -> float:
    """One replica's $/h on Karpenter's cheapest instance that fits it (its gang: nodes x instance price)."""
    shape = gang_shape(catalog, model, flavor, ct)
    return shape.nodes * catalog.price(flavor, shape.instance_type, ct)


def limit_replicas(catalog: Catalog, model: str, flavor: str, cap: int = 1000, packed: bool = False) -> int:
    """Most replicas of ``model`` the flavor's NodePool limits hold (``cap`` when unlimited): one per gang, or
    ``packed``, as many as the gangs' slots (the act step packs replicas onto nodes)."""
    shape = gang_shape(catalog, model, flavor)
    fl = catalog.flavors[flavor]
    devices = shape.nodes * fl.instance(shape.instance_type).devices
    n = cap
    if fl.limits.devices is not None:
        n = min(n, fl.limits.devices // max(devices, 1) * (shape.slots if packed else 1))
    if fl.limits.nodes is not None:
        n = min(n, fl.limits.nodes // max(shape.nodes, 1) * (shape.slots if packed else 1))
    return n


def make_policy(name: str, settings: Settings | None = None, stock: StockConfig | None = None) -> Policy:
    """A policy by name (POLICIES, static-peak, or the alias oracle); rayscale, static-peak and fluid-bound plan
    with ``settings`` (the shipped ones by default); ``stock`` configures the stock policy."""
    from rayscale.sim.baselines import ClairvoyantPolicy, StaticBestPolicy

    name = ALIASES.get(name, name)
    if name == "rayscale":
        return RayscalePolicy(settings)
    if name == "stock":
        return StockPolicy(stock or StockConfig())
    if name == "static-peak":
        return StaticPeakPolicy(settings)
    if name == "fluid-bound":
        return OraclePolicy(settings=settings)
    if name == "static-best":
        return StaticBestPolicy()
    if name == "clairvoyant":
        return ClairvoyantPolicy()
    raise ValueError(f"unknown policy {name!r}; allowed: {', '.join((*POLICIES, 'static-peak', *ALIASES))}, all")


def window_mix(prompt: np.ndarray, output: np.ndarray) -> RequestMix | None:
    if len(prompt) == 0:
        return None
    return RequestMix(float(prompt.mean()), float(max(output.mean(), 1.0)), p95(prompt), length_quantiles(prompt),
                      length_quantiles(output), float(prompt.max()))
