"""Scaling policies the simulator compares. None of them copies the core's policy:

- ``rayscale``: rayscale.core.estimate.estimate / update_corrections and rayscale.core.plan.plan with its
  PlannerMemory, fed ModelSignals built from the simulated metrics every control period;
- ``stock``: Ray Serve's default autoscaling policy, Ray's own functions (replica_queue_length_autoscaling_policy,
  _apply_scaling_factors, _apply_delay_logic with the simulated clock), then KubeRay + Karpenter: one GPU
  flavor (a10g), the cheapest instance that fits one pending pod, batched (idle 1 s, max 10 s), idle nodes
  linger (KubeRay idleTimeoutSeconds 60 s + consolidateAfter 30 s), graceful shutdown 20 s;
- ``static-peak``: the core planner fed the trace's peak rate (60 s windows) from start to end;
- ``oracle``: perfect foresight (the next minute's true rate and mix), instant nodes, no capacity errors or
  interruptions; its reported cost is the fluid lower bound (fractional replicas of the cheapest $/req
  offering, spot at the flavor's spot share), and its latency comes from running the integer plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rayscale.core.catalog import CapacityType, Catalog
from rayscale.core.estimate import Correction, EstimateSettings, estimate, update_corrections
from rayscale.core.forecast import FORECASTERS, Forecaster, TrendSeasonal
from rayscale.core.plan import PlannerMemory, PlannerSettings, plan
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.sim.cloud import ActuatorConfig
from rayscale.sim.engine import p95

if TYPE_CHECKING:
    from rayscale.sim.simulator import Simulation

POLICIES = ("rayscale", "stock", "static-peak", "oracle")
_PLANNER = PlannerSettings()
_EST = EstimateSettings()


@dataclass(frozen=True)
class StockConfig:
    """Ray Serve defaults (FACTS.md) plus the KubeRay/Karpenter chain."""

    flavor: str = "a10g"
    target_ongoing_requests: float = 2.0
    max_ongoing_requests: int = 5
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    autoscaler_delay_s: float = 5.0  # Ray autoscaler sees the pending actor, KubeRay patches the worker group
    idle_timeout_s: float = 60.0  # KubeRay idleTimeoutSeconds
    consolidate_after_s: float = 30.0  # Karpenter consolidateAfter for empty nodes
    graceful_shutdown_timeout_s: float = 20.0


class Policy:
    name = "policy"
    actuator = ActuatorConfig()
    slot_cap: int | None = None  # per-replica admission cap (Ray Serve max_ongoing_requests)

    def flavors(self, catalog: Catalog, model: str) -> list[str]:
        return sorted(catalog.models[model].parallelism)

    def warm_start(self, sim: Simulation) -> None:
        """Place the replicas this policy would run at the trace's initial load, live at t=0."""

    def control(self, now: float, sim: Simulation) -> None:
        raise NotImplementedError

    def extra(self) -> dict[str, Any]:
        return {}


def _apply(sim: Simulation, targets: dict[tuple[str, str], int], now: float) -> None:
    """Make the cluster match per-(flavor, capacity type) targets, make-before-break like the act step:
    scale-ups start at once and extra replicas that are not serving yet are cancelled, but live replicas
    are only drained once nothing of this model is still starting (a flavor swap keeps the old replicas
    serving until the new ones are live). Unlisted offerings go to zero."""
    cl = sim.cluster
    keys = sorted(set(targets) | {(f, ct) for (_, f, ct) in cl.current()})
    for f, ct in keys:
        if targets.get((f, ct), 0) >= cl.count(f, ct):
            cl.set_target(f, ct, targets.get((f, ct), 0), now)
    for f, ct in keys:
        want = targets.get((f, ct), 0)
        if want < cl.count(f, ct):
            cl.set_target(f, ct, max(want, cl.count(f, ct, live_only=True)), now)  # cancel what is not live
    if not cl.starting():
        for f, ct in keys:
            want = targets.get((f, ct), 0)
            if want < cl.count(f, ct):
                cl.set_target(f, ct, want, now)


def _plan_targets(catalog: Catalog, model: str, signals: ModelSignals, sim: Simulation, now: float,
                  memory: PlannerMemory | None, corrections: dict[tuple[str, str], Correction],
                  forecaster: Forecaster, est: EstimateSettings, settings: PlannerSettings,
                  unavailable: dict[tuple[str, str, str], float] | None = None,
                  ) -> tuple[dict[tuple[str, str], int], PlannerMemory, float]:
    demands = estimate(catalog, {model: signals}, corrections, forecaster, est)
    p, mem = plan(catalog, demands, sim.cluster.current(), unavailable, now, memory, settings)
    return {(e.flavor, e.capacity_type): e.replicas for e in p.entries if e.model == model}, mem, p.usd_per_h


class RayscalePolicy(Policy):
    name = "rayscale"

    def __init__(self, forecaster: str = "trend", planner: PlannerSettings = _PLANNER,
                 est: EstimateSettings = _EST, startup_horizon_s: float | None = None) -> None:
        self.forecaster_name = forecaster
        self.planner = planner
        self.est = est
        self.memory: PlannerMemory | None = None
        self.corrections: dict[tuple[str, str], Correction] = {}
        self.horizon_s = startup_horizon_s
        self.fc: Forecaster = FORECASTERS["last"]

    def warm_start(self, sim: Simulation) -> None:
        if self.forecaster_name not in FORECASTERS:
            raise ValueError(f"unknown forecaster {self.forecaster_name!r}; allowed: {sorted(FORECASTERS)}")
        self.fc = FORECASTERS[self.forecaster_name]
        if self.forecaster_name == "trend":
            # Look as far ahead as ordered capacity takes to arrive (node start + replica start).
            horizon = self.horizon_s if self.horizon_s is not None else sim.typical_startup_s()
            self.fc = TrendSeasonal(horizon=max(1, round(horizon / sim.cfg.history_window_s)))
        sig = sim.initial_signals()
        targets, self.memory, _ = _plan_targets(sim.catalog, sim.model, sig, sim, 0.0, None, {}, self.fc,
                                                self.est, self.planner)
        for (f, ct), n in sorted(targets.items()):
            for _ in range(n):
                sim.cluster.place_warm(f, ct, 0.0)

    def control(self, now: float, sim: Simulation) -> None:
        sig = sim.signals(now)
        self.corrections = update_corrections(sim.catalog, {sim.model: sig}, self.corrections)
        targets, self.memory, _ = _plan_targets(sim.catalog, sim.model, sig, sim, now, self.memory,
                                                self.corrections, self.fc, self.est, self.planner,
                                                dict(sim.cluster.unavailable))
        _apply(sim, targets, now)


class StaticPeakPolicy(Policy):
    name = "static-peak"

    def __init__(self, planner: PlannerSettings = _PLANNER, est: EstimateSettings = _EST):
        self.planner, self.est = planner, est
        self.memory: PlannerMemory | None = None
        self.sig: ModelSignals | None = None

    def warm_start(self, sim: Simulation) -> None:
        peak = sim.peak_rate()
        self.sig = ModelSignals(sim.model, Freshness.FRESH, 0.0, peak, sim.trace_mix(), waiting=0.0)
        targets, self.memory, _ = _plan_targets(sim.catalog, sim.model, self.sig, sim, 0.0, None, {},
                                                FORECASTERS["last"], self.est, self.planner)
        for (f, ct), n in sorted(targets.items()):
            for _ in range(n):
                sim.cluster.place_warm(f, ct, 0.0)

    def control(self, now: float, sim: Simulation) -> None:
        # Same peak demand every period: the planner only acts to replace lost (interrupted) replicas.
        assert self.sig is not None
        targets, self.memory, _ = _plan_targets(sim.catalog, sim.model, self.sig, sim, now, self.memory, {},
                                                FORECASTERS["last"], self.est, self.planner,
                                                dict(sim.cluster.unavailable))
        _apply(sim, targets, now)


class OraclePolicy(Policy):
    name = "oracle"
    actuator = ActuatorConfig(provision_delay_s=0.0, instant=True, drain_timeout_s=3600.0)

    def __init__(self, lookahead_s: float = 60.0, est: EstimateSettings = _EST,
                 planner: PlannerSettings = _PLANNER) -> None:
        self.lookahead_s = lookahead_s
        self.est = est
        # No hysteresis: with instant nodes the oracle follows demand exactly.
        self.planner = PlannerSettings(hysteresis_band=0.0, downscale_delay_s=0.0, min_dwell_s=0.0,
                                       exact_max_vars=planner.exact_max_vars, solver=planner.solver)
        self.fluid_usd = 0.0
        self.fluid_dev_h = 0.0
        self._last: float | None = None
        self._rate = (0.0, 0.0)

    def _signals(self, sim: Simulation, now: float) -> ModelSignals:
        rate, mix = sim.future_load(now, self.lookahead_s)
        return ModelSignals(sim.model, Freshness.FRESH, 0.0, rate, mix, waiting=0.0)

    def _fluid(self, sim: Simulation, sig: ModelSignals) -> tuple[float, float]:
        """($/h, devices) of the cheapest fractional capacity for this demand."""
        d = estimate(sim.catalog, {sim.model: sig}, None, FORECASTERS["last"], self.est)[sim.model]
        best = (math.inf, 0.0)
        for f, cap in d.capacity.items():
            if not cap.feasible:
                continue
            fl = sim.catalog.flavors[f]
            shape = sim.cluster.shape(f, CapacityType.ON_DEMAND.value)
            od = shape.nodes * sim.catalog.price(f, shape.instance_type, CapacityType.ON_DEMAND)
            price = od
            if CapacityType.SPOT in fl.capacity_types and fl.spot_max_share > 0:
                spot = shape.nodes * sim.catalog.price(f, shape.instance_type, CapacityType.SPOT)
                price = (1 - fl.spot_max_share) * od + fl.spot_max_share * spot
            per_rps = price / cap.rps
            if per_rps < best[0]:
                devices = shape.nodes * fl.instance(shape.instance_type).devices
                best = (per_rps, devices / cap.rps)
        if not math.isfinite(best[0]):
            return 0.0, 0.0
        return d.rps * best[0], d.rps * best[1]

    def warm_start(self, sim: Simulation) -> None:
        self._last = 0.0
        sig = self._signals(sim, 0.0)
        self._rate = self._fluid(sim, sig)
        targets, self.memory, _ = _plan_targets(sim.catalog, sim.model, sig, sim, 0.0, None, {},
                                                FORECASTERS["last"], self.est, self.planner)
        for (f, ct), n in sorted(targets.items()):
            for _ in range(n):
                sim.cluster.place_warm(f, ct, 0.0)

    def control(self, now: float, sim: Simulation) -> None:
        self.accrue(now)
        sig = self._signals(sim, now)
        self._rate = self._fluid(sim, sig)
        targets, self.memory, _ = _plan_targets(sim.catalog, sim.model, sig, sim, now, self.memory, {},
                                                FORECASTERS["last"], self.est, self.planner)
        _apply(sim, targets, now)

    def accrue(self, now: float) -> None:
        if self._last is not None and now > self._last:
            h = (now - self._last) / 3600.0
            self.fluid_usd += self._rate[0] * h
            self.fluid_dev_h += self._rate[1] * h
        self._last = now

    def extra(self) -> dict[str, Any]:
        return {"fluid_cost_usd": self.fluid_usd, "fluid_accelerator_hours": self.fluid_dev_h}


class StockPolicy(Policy):
    name = "stock"

    def __init__(self, cfg: StockConfig = StockConfig()) -> None:
        self.cfg = cfg
        self.slot_cap = cfg.max_ongoing_requests
        self.actuator = ActuatorConfig(
            provision_delay_s=cfg.autoscaler_delay_s, karpenter_batch=True,
            node_linger_s=cfg.idle_timeout_s + cfg.consolidate_after_s, reuse_idle_nodes=True,
            drain_timeout_s=cfg.graceful_shutdown_timeout_s,
        )
        self.target = 0
        self.state: dict[str, Any] = {}
        self._ray: Any = None

    def flavors(self, catalog: Catalog, model: str) -> list[str]:
        if self.cfg.flavor not in catalog.models[model].parallelism:
            raise ValueError(f"stock policy: model {model} has no flavor {self.cfg.flavor!r}; "
                             f"allowed: {sorted(catalog.models[model].parallelism)}")
        return [self.cfg.flavor]

    def _load_ray(self, sim: Simulation) -> None:
        try:
            from ray.serve import autoscaling_policy as ap
            from ray.serve._private.common import DeploymentID
            from ray.serve.config import AutoscalingConfig, AutoscalingContext
        except ImportError as e:  # pragma: no cover - ray is a hard dependency
            raise RuntimeError(f"the stock policy calls Ray Serve's autoscaling code: {e}") from e
        spec = sim.catalog.models[sim.model]
        conf = AutoscalingConfig(
            min_replicas=max(1, spec.min_replicas), max_replicas=spec.max_replicas,
            target_ongoing_requests=self.cfg.target_ongoing_requests, upscale_delay_s=self.cfg.upscale_delay_s,
            downscale_delay_s=self.cfg.downscale_delay_s, look_back_period_s=self.cfg.look_back_period_s,
        )
        self._ray = (ap, DeploymentID(sim.model, "sim"), conf, AutoscalingContext)

    def warm_start(self, sim: Simulation) -> None:
        self._load_ray(sim)
        _, _, conf, _ = self._ray
        # Steady state at the initial load: ongoing = rate x latency (Little), replicas = ongoing / target.
        rate, mix = sim.future_load(0.0, 60.0)
        prof = sim.catalog.profile(sim.model, self.cfg.flavor)
        latency = prof.ttft_s(mix.prompt_mean) + max(mix.output_mean - 1, 0) * prof.itl_s(2)
        n = math.ceil(rate * latency / self.cfg.target_ongoing_requests)
        self.target = min(max(n, conf.min_replicas), conf.max_replicas)
        for _ in range(self.target):
            sim.cluster.place_warm(self.cfg.flavor, CapacityType.ON_DEMAND.value, 0.0)

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
        sim.cluster.set_target(self.cfg.flavor, CapacityType.ON_DEMAND.value, self.target, now)


def make_policy(name: str, planner: PlannerSettings = _PLANNER, forecaster: str = "trend") -> Policy:
    if name == "rayscale":
        return RayscalePolicy(forecaster=forecaster, planner=planner)
    if name == "stock":
        return StockPolicy()
    if name == "static-peak":
        return StaticPeakPolicy(planner=planner)
    if name == "oracle":
        return OraclePolicy(planner=planner)
    raise ValueError(f"unknown policy {name!r}; allowed: {', '.join(POLICIES)}, all")


def window_mix(prompt: np.ndarray, output: np.ndarray) -> RequestMix | None:
    if len(prompt) == 0:
        return None
    return RequestMix(float(prompt.mean()), float(max(output.mean(), 1.0)), p95(prompt))
