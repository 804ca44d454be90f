"""The simulation loop: trace -> engine ticks, cloud events and one policy, on a simulated clock.

Every ``control_period_s`` the policy sees what a controller would see (ModelSignals built from the
simulated metrics over the last ``signal_window_s``; Ray Serve's ongoing-request average for the stock
policy) and sets replica targets; the cloud model turns targets into gangs of nodes with delays; the
engine advances every replica by one tick. Pure and deterministic for a given trace, config and seed.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from rayscale.core.catalog import Catalog
from rayscale.core.chunk import pin_chunks
from rayscale.core.estimate import EstimateSettings, estimate
from rayscale.core.forecast import FORECASTERS
from rayscale.core.gangs import GangError, gang_shape
from rayscale.core.settings import Settings
from rayscale.core.signals import FlavorObservation, Freshness, ModelSignals, RequestMix, length_quantiles
from rayscale.sim.capacity import CapacitySettings
from rayscale.sim.cloud import CloudConfig, CloudTotals, Cluster
from rayscale.sim.engine import BY_FLAVOR, DONE, FAILED, STOPPED, EngineConfig, make_engine, p95
from rayscale.sim.policies import OraclePolicy, Policy, make_policy, window_mix
from rayscale.sim.trace import Trace


@dataclass(frozen=True)
class SimConfig:
    model: str = "mistral-7b"
    seed: int = 0
    # The product's settings (rayscale.core.settings): the control period, the signal windows, the request
    # mix's reach and the forecaster's history are the controller's; rayscale's policy runs them verbatim.
    settings: Settings = field(default_factory=Settings)
    drain_tail_s: float = 900.0  # after the last arrival, run until everything finished or this long
    # Requests arriving before this are served but not scored, and cost accrues from it on: a controller
    # that has run for a while has a fleet and a rate history; a simulation starting empty has neither.
    # With --repeat 2 and the trace's length, the second pass is measured in steady state.
    warmup_s: float = 0.0
    timeline_bucket_s: float = 60.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    # How the oracle measures per-replica capacity at the SLO (rayscale.sim.capacity).
    oracle_capacity: CapacitySettings = field(default_factory=CapacitySettings)
    cloud: CloudConfig = field(default_factory=CloudConfig)
    # From cold, every policy starts from the same fleet: the one the shipped step orders for the first
    # signal window (rayscale.sim.fleet_act.first_fleet), live at t=0 on on-demand capacity; each policy then
    # moves it where it wants from its first period on. False: each policy starts from its own fleet.
    same_start: bool = False

    def __post_init__(self) -> None:
        if not self.timeline_bucket_s > 0:
            raise ValueError(f"timeline_bucket_s must be > 0, got {self.timeline_bucket_s}")
        if not self.warmup_s >= 0:
            raise ValueError(f"warmup_s must be >= 0, got {self.warmup_s}")

    @property
    def control_period_s(self) -> float:
        return self.settings.period_s

    @property
    def signal_window_s(self) -> float:
        return self.settings.window_s


@dataclass
class SimResult:
    policy: str
    trace: str
    model: str
    requests: int
    slo_attainment: float
    ttft_p95_s: float
    tpot_p95_s: float
    cost_usd: float
    accelerator_hours: float
    idle_node_hours: float
    failed_requests: int
    scale_up_events: int
    wall_s: float
    sim_s: float = 0.0
    node_hours: float = 0.0
    capacity_errors: int = 0
    spot_interruptions: int = 0
    rejected_requests: int = 0  # longer than the model's max_model_len: rejected as vLLM does, not SLO misses
    ticks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    timeline: dict[str, Any] = field(default_factory=dict, repr=False)

    def summary(self) -> dict[str, Any]:
        """The --json object: every scalar field (timeline left out)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if k == "timeline":
                continue
            out[k] = round(v, 6) if isinstance(v, float) else v
        out.update({k: round(v, 6) if isinstance(v, float) else v for k, v in out.pop("extra").items()})
        return out


def _multi_node(catalog: Catalog, model: str, flavor: str) -> bool:
    """Whether a replica of ``model`` on ``flavor`` spans nodes (a flavor no gang fits never launches)."""
    try:
        return gang_shape(catalog, model, flavor).nodes > 1
    except GangError:
        return False


class Simulation:
    def __init__(self, catalog: Catalog, trace: Trace, policy: Policy, cfg: SimConfig = SimConfig()) -> None:
        if cfg.model not in catalog.models:
            raise ValueError(f"unknown model {cfg.model!r}; allowed: {sorted(catalog.models)}")
        if len(trace) == 0:
            raise ValueError(f"trace {trace.name!r} has no requests")
        if cfg.warmup_s > 0 and cfg.warmup_s >= float(trace.arrival_s[-1]):
            raise ValueError(f"warmup_s {cfg.warmup_s:g} s leaves no request of trace {trace.name!r} to score "
                             f"(its last arrives at {float(trace.arrival_s[-1]):.0f} s)")
        # One model is simulated. The catalog's others would be planned every period without signals: held
        # at min_replicas as replicas that never start here, they counted against NodePool limits this
        # model shares and took 40% of the estimator's time (18 offerings of 4 models, not this one's 7).
        catalog = catalog.subset([cfg.model])
        # Each replica runs the prefill chunk its policy deploys: rayscale picks one per flavor for the declared
        # request mix, the stock stack runs vLLM's default (rayscale.core.chunk).
        catalog = pin_chunks(catalog, tuned=policy.tuned_chunk, default=cfg.engine.max_num_batched_tokens)
        self.catalog, self.trace, self.policy, self.cfg = catalog, trace, policy, cfg
        self.model = cfg.model
        # SimConfig.same_start's fleet, once rayscale.sim.fleet_act.first_fleet has worked it out.
        self.start_fleet: dict[tuple[str, str], int] | None = None
        self.spec = catalog.models[cfg.model]
        self.rng = np.random.default_rng(cfg.seed)
        flavors = policy.flavors(catalog, cfg.model)
        max_kv = max(catalog.profile(cfg.model, f).kv_tokens for f in flavors)
        if cfg.same_start:  # the shared start fleet may run where this policy would not
            flavors = sorted(set(flavors) | set(self.spec.parallelism))
        # A prompt that leaves no room in the model's context is rejected as vLLM rejects it (400, never
        # queued, counted apart from SLO misses); an output that would overrun it stops at the limit.
        limit = self.spec.max_model_len
        served = trace.prompt_tokens < limit if limit else np.ones(len(trace), dtype=bool)
        self.rejected_s = trace.arrival_s[~served]
        self.arr = trace.arrival_s[served]
        self.prompt = trace.prompt_tokens[served]
        out = trace.output_tokens[served]
        self.output = np.maximum(np.minimum(out, limit - self.prompt) if limit else out, 1)
        if len(self.arr) == 0:
            raise ValueError(f"trace {trace.name!r}: every request is longer than {cfg.model}'s max_model_len {limit}")
        hashes = trace.hash_ids[served] if trace.hash_ids is not None else None  # prefix caches (sim.prefix)
        self.engine = make_engine(self.arr, self.prompt, self.output, cfg.engine, max_kv_tokens=max_kv,
                                  hash_ids=hashes, block_tokens=trace.hash_block_tokens, seed=cfg.seed)
        self.cluster = Cluster(catalog, cfg.model, self.engine, flavors, self.rng, cfg.cloud, policy.actuator,
                               slot_cap=policy.slot_cap)
        self.flavors = flavors
        # Multi-node flavors: a Serve deployment per gang slot, so each request takes one replica and waits for it.
        self._slotted = [_multi_node(catalog, cfg.model, f) for f in flavors]
        self._done: deque[tuple[float, np.ndarray]] = deque()  # (tick end, finished trace indices)
        self._ongoing: deque[tuple[float, float]] = deque()
        self._ongoing_sum = 0.0
        self._last_mix: RequestMix | None = None
        self._counts: tuple[float, tuple[float, ...]] = (-1.0, ())  # (window end, arrival counts)
        self._guess: dict[str, float] | None = None
        self._samples: list[tuple[float, float, dict[str, int], int]] = []

    # --- what the policies may look at --------------------------------------------------------

    def typical_startup_s(self) -> float:
        fl = [self.catalog.flavors[f].node_startup_s + self.catalog.profile(self.model, f).startup_s
              for f in self.flavors]
        return float(np.median(fl))

    def count_arrivals(self, lo_t: float, hi_t: float) -> tuple[int, int]:
        """Trace indices [lo, hi) of the arrivals in [lo_t, hi_t)."""
        return self._count(lo_t, hi_t)

    def _count(self, lo_t: float, hi_t: float) -> tuple[int, int]:
        return (int(np.searchsorted(self.arr, lo_t, side="left")), int(np.searchsorted(self.arr, hi_t, side="left")))

    def arrival_counts(self, now: float) -> tuple[float, ...]:
        """Arrivals per control period over the burst_history_s (from t=0 on) up to the last whole history
        window, oldest first. Whole windows: the same tuple for a minute, so the estimator's burst rate of it
        is computed once a minute, not every period (an hour's statistic; 12 s of a simulated day's 120)."""
        st = self.cfg.settings
        b = st.period_s
        end = math.floor(now / st.history_window_s) * st.history_window_s
        if self._counts[0] == end:
            return self._counts[1]
        n = min(int(st.burst_history_s / b), int(end / b))
        out: tuple[float, ...] = ()
        if n > 0:
            idx = np.searchsorted(self.arr, end - b * np.arange(n, -1, -1), side="left")
            out = tuple(np.diff(idx).astype(float).tolist())
        self._counts = (end, out)
        return out

    def future_load(self, now: float, window_s: float) -> tuple[float, RequestMix]:
        """Perfect foresight: the true arrival rate and mix of [now, now + window_s)."""
        lo, hi = self._count(now, now + window_s)
        mix = window_mix(self.prompt[lo:hi], self.output[lo:hi]) or self.trace_mix()
        return (hi - lo) / window_s, mix

    def trace_mix(self) -> RequestMix:
        mix = window_mix(self.prompt, self.output)
        assert mix is not None
        return mix

    def peak_rate(self, window_s: float = 60.0) -> float:
        """Highest arrival rate over any window_s-long window starting at an arrival."""
        ends = np.searchsorted(self.arr, self.arr + window_s, side="left")
        return float((ends - np.arange(len(self.arr))).max()) / window_s

    def initial_signals(self) -> ModelSignals:
        rate, mix = self.future_load(0.0, self.cfg.signal_window_s)
        return ModelSignals(self.model, Freshness.FRESH, 0.0, rate, mix, waiting=0.0)

    def mean_ongoing(self, now: float, look_back_s: float) -> float:
        """Ray Serve's total_num_requests: running + queued, averaged over the look-back window."""
        q = self._ongoing
        while q and q[0][0] < now - look_back_s:
            self._ongoing_sum -= q.popleft()[1]
        return self._ongoing_sum / len(q) if q else 0.0

    def signals(self, now: float) -> ModelSignals:
        """What the observe shell would hand the core: one window of aggregated metrics."""
        w = min(self.cfg.signal_window_s, max(now, self.cfg.control_period_s))
        lo, hi = self._count(now - w, now)
        rate = (hi - lo) / w
        fast = self.cfg.settings.fast_window_s
        if fast is not None and fast < w:  # as the controller reads it (rayscale.signals.window.aggregate)
            f_lo, f_hi = self._count(now - fast, now)
            rate = max(rate, (f_hi - f_lo) / fast)
        k = self.cfg.settings.mix_min_requests
        span = self.cfg.settings.mix_max_s if k else 0.0
        while self._done and self._done[0][0] < now - max(self.cfg.signal_window_s, span):
            self._done.popleft()
        cut = now - self.cfg.signal_window_s
        recent = [d for _, d in itertools.takewhile(lambda td: td[0] >= cut, reversed(self._done))][::-1]
        done = np.concatenate(recent) if recent else np.zeros(0, dtype=np.int64)
        # The mix reaches back past the window to k requests: a 30 s window at a few req/s holds too few
        # for its tail quantiles, and their noise swings the capacity estimate by a replica.
        mix_lo, finished = lo, done
        if hi - lo < k:
            mix_lo = max(hi - k, self._count(now - span, now)[0])
        if len(done) < k:
            finished = self._last_finished(k)
        if hi > lo:
            # Prompt lengths are known at arrival, output lengths only once requests finish.
            out = (self.output[finished] if len(finished) else
                   (self.output[lo:hi] if self._last_mix is None else None))
            last = self._last_mix
            out_mean = float(out.mean()) if out is not None else (last.output_mean if last else 1.0)
            out_q = length_quantiles(out) if out is not None else (last.output_quantiles if last else None)
            p = self.prompt[mix_lo:hi]
            self._last_mix = RequestMix(float(p.mean()), max(out_mean, 1.0), p95(p), length_quantiles(p), out_q,
                                        float(p.max()))
        eng = self.engine
        ttft = eng.ttft[done]
        tpot = eng.tpot[done][self.output[done] > 1]
        per_flavor = self._per_flavor(done, now)
        return ModelSignals(
            self.model, Freshness.FRESH, 0.0, rate, self._last_mix,
            waiting=float(eng.waiting), running=float(eng.in_flight),
            ttft_p95_s=p95(ttft) if len(ttft) else None,
            tpot_p95_s=p95(tpot) if len(tpot) else None,
            kv_usage=eng.kv_usage(), per_flavor=per_flavor,
            arrival_counts=self.arrival_counts(now), arrival_bin_s=self.cfg.control_period_s,
            prefix_hit_rate=eng.prefix_hit_rate(now, self.cfg.signal_window_s),
            finished=float(len(done)), slo_met=self._met_share(done),
        )

    def _per_flavor(self, done: npt.NDArray[np.int64], now: float) -> dict[str, FlavorObservation]:
        """What each flavor with live replicas reports over the window (its finished requests ``done``)."""
        eng = self.engine
        per_flavor: dict[str, FlavorObservation] = {}
        live = self.cluster.live_by_flavor()
        fl_of = eng.flavor_of[done]
        for i, f in enumerate(self.flavors):
            n = live.get(f, 0)
            if n == 0:
                continue
            sel = done[fl_of == i]
            sel_tpot = eng.tpot[sel][self.output[sel] > 1]
            per_flavor[f] = FlavorObservation(
                replicas=n,
                running_per_replica=self._running_on(i) / n,
                ttft_p95_s=p95(eng.ttft[sel]) if len(sel) else None,
                tpot_p95_s=p95(sel_tpot) if len(sel_tpot) else None,
                prompt_mean=float(self.prompt[sel].mean()) if len(sel) else None,
                completed=float(len(sel)),
                # TTFT without the queue: from admission onto a replica to the first token.
                prefill_mean_s=(float(np.mean(eng.ttft[sel] - eng.queue_s[sel], dtype=np.float64))
                                if len(sel) else None),
                prefix_hit_rate=eng.prefix_hit_rate(now, self.cfg.signal_window_s, i),
                kv_usage=self._kv_usage_on(i),
            )
        return per_flavor

    def _route(self) -> None:
        """With a routing by flavor (EngineConfig.routing, engine.BY_FLAVOR), the engine routes by the weights
        the policy's ingress would hold: the policy's own (Policy.flavor_weights; rayscale's are the
        controller's), else each flavor's live replicas times the estimator's per-replica capacity for the
        trace's mix, the formula of rayscale.core.route.flavor_weights."""
        if self.cfg.engine.routing not in BY_FLAVOR:
            return
        w = self.policy.flavor_weights(self)
        if w is None:
            live, cap = self.cluster.live_by_flavor(), self.guessed_capacity()
            w = {f: live.get(f, 0) * cap.get(f, 0.0) for f in self.flavors}
        self.engine.set_flavor_weights([w.get(f, 0.0) for f in self.flavors], self._slotted)

    def guessed_capacity(self) -> dict[str, float]:
        """The estimator's req/s per replica at the SLO for the trace's mix (0: infeasible), once."""
        if self._guess is None:
            sig = ModelSignals(self.model, Freshness.FRESH, 0.0, 1.0, self.trace_mix())
            d = estimate(self.catalog, {self.model: sig}, None, FORECASTERS["last"],
                         EstimateSettings(target_utilization=1.0, burst_floor=False))[self.model]
            self._guess = {f: (c.rps if c.feasible else 0.0) for f, c in d.capacity.items() if f in self.flavors}
        return self._guess

    def _met_share(self, done: np.ndarray) -> float | None:
        """Share of these finished (or failed) requests within both SLO targets, read as the controller reads
        it from two histograms that do not pair a request's TTFT with its TPOT (rayscale.signals.window.
        met_share): one minus the TTFT misses minus the TPOT misses, a request missing both counted twice."""
        if not len(done):
            return None
        slo, eng = self.spec.slo, self.engine
        ttft_ok = (eng.status[done] == DONE) & (eng.ttft[done] <= slo.ttft_p95_s + 1e-9)
        tpot_ok = (self.output[done] <= 1) | (eng.tpot[done] <= slo.tpot_p95_s + 1e-9)
        return max(float(ttft_ok.mean()) - (1.0 - float(tpot_ok.mean())), 0.0)

    def _last_finished(self, k: int) -> np.ndarray:
        """Trace indices of the last ``k`` requests to finish (fewer if the kept span holds fewer)."""
        parts, n = [], 0
        for _, d in reversed(self._done):
            parts.append(d)
            n += len(d)
            if n >= k:
                break
        out = np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)
        return out[-k:] if len(out) > k else out

    def _live_on(self, flavor_index: int) -> npt.NDArray[np.bool_]:
        eng = self.engine
        return (eng.r_flavor[: eng.nr] == flavor_index) & (eng.r_state[: eng.nr] != STOPPED)

    def _running_on(self, flavor_index: int) -> float:
        return float(self.engine.r_run[: self.engine.nr][self._live_on(flavor_index)].sum())

    def _kv_usage_on(self, flavor_index: int) -> float | None:
        eng, sel = self.engine, self._live_on(flavor_index)
        cap = float(eng.r_kvcap[: eng.nr][sel].sum())
        return float(eng.r_kv[: eng.nr][sel].sum()) / cap if cap > 0 else None

    # --- the loop ------------------------------------------------------------------------------

    def run(self, progress: bool = False) -> SimResult:
        self.begin(progress)
        while True:
            self.tick()
            if self.done():
                break
        return self.end()

    def begin(self, progress: bool = False) -> None:
        """Warm-start the policy and open the clock; ``tick`` then advances it one engine tick at a time (the
        multi-model simulation, rayscale.sim.multi, ticks several of these in lockstep)."""
        self._t0 = time.perf_counter()
        self.policy.warm_start(self)
        self.cluster.advance(0.0)
        self._route()
        self._next_control = self.cfg.control_period_s
        self._next_sample = 0.0
        self.now = 0.0
        self.ticks = 0
        self._bar = _progress(float(self.arr[-1]), progress)
        self._books: CloudTotals | None = None  # the cloud's books when the warm-up ended

    def tick(self) -> None:
        """One engine tick: the warm-up's books, the policy's period, a timeline sample, cloud events, engine."""
        cfg, eng, cl, T = self.cfg, self.engine, self.cluster, self.now
        if self._books is None and cfg.warmup_s > 0 and cfg.warmup_s <= T + 1e-9:
            self._books = cl.snapshot(T)
            if isinstance(self.policy, OraclePolicy):
                self.policy.mark_warmup(T)
        if self._next_control <= T + 1e-9:
            self.policy.control(T, self)
            self._route()
            self._next_control += cfg.control_period_s
        if self._next_sample <= T + 1e-9:
            self._samples.append((T, cl.usd_per_h(), cl.live_by_flavor(), eng.waiting + eng.in_flight))
            self._next_sample += cfg.timeline_bucket_s
        cl.advance(T)
        res = eng.step(T, cfg.engine.tick_s)
        T = self.now = T + cfg.engine.tick_s
        self.ticks += 1
        if len(res.done):
            self._done.append((T, res.done))
        ongoing = float(eng.waiting + eng.in_flight)
        self._ongoing.append((T, ongoing))
        self._ongoing_sum += ongoing
        if len(self._ongoing) > 4096:  # keep the window bounded even if nobody reads it
            self.mean_ongoing(T, 600.0)
        if self._bar is not None and self.ticks % 400 == 0:
            self._bar.update(min(T, float(self.arr[-1])) - self._bar.n)

    def done(self) -> bool:
        """Every request finished after the last arrival, or the drain tail ran out."""
        last, T = float(self.arr[-1]), self.now
        if last < T and self.engine.q_head >= len(self.arr) and self.engine.in_flight == 0:
            return True
        return last + self.cfg.drain_tail_s < T

    def end(self) -> SimResult:
        """Close the books at the current time and score the run."""
        T, bar = self.now, self._bar
        if bar is not None:
            bar.update(max(float(self.arr[-1]) - bar.n, 0))
            bar.close()
        if isinstance(self.policy, OraclePolicy):
            self.policy.accrue(T)
        self.engine.fail_unfinished(T)
        totals = self.cluster.finish(T)
        if self._books is not None:
            totals = totals - self._books
        return self._result(T, self.ticks, time.perf_counter() - self._t0, totals)

    def _result(self, end: float, ticks: int, wall: float, totals: Any) -> SimResult:
        eng = self.engine
        slo = self.spec.slo
        scored = self.arr >= self.cfg.warmup_s  # every request without a warm-up
        # A single-token answer has no inter-token time: it meets the TPOT SLO by definition.
        tpot_ok = np.where(self.output > 1, eng.tpot <= slo.tpot_p95_s + 1e-9, True)
        ok_all = (eng.status == DONE) & (eng.ttft <= slo.ttft_p95_s + 1e-9) & tpot_ok  # the timeline shows all
        ok = ok_all & scored
        done = (eng.status == DONE) & scored
        ttft = eng.ttft[done]
        tpot = eng.tpot[done & (self.output > 1)]
        n = int(scored.sum())
        extra = self.policy.extra()
        lags = self.cluster.replacement_lags_s
        if self.cluster.spot_interruptions:
            # notice -> the next replica live; the notice gives 120 s, so a lag above that is serving lost
            extra["replacement_lag_p50_s"] = float(np.median(lags)) if lags else math.nan
            extra["replacement_lag_max_s"] = max(lags) if lags else math.nan
        if self.cfg.same_start:
            from rayscale.sim.fleet_act import first_fleet

            extra["start_fleet"] = "+".join(f"{f}:{n}" for (f, _), n in sorted(first_fleet(self).items()))
        if self.cfg.warmup_s > 0:
            extra["warmup_s"] = self.cfg.warmup_s
            extra["requests_warmup"] = len(self.arr) - n
        cost, dev_h = totals.cost_usd, totals.accelerator_hours
        if isinstance(self.policy, OraclePolicy):
            extra = {**{k: v for k, v in extra.items()
                        if k.startswith(("capacity_", "warmup_", "requests_", "start_"))},
                     "integer_cost_usd": cost, "integer_accelerator_hours": dev_h}
            cost, dev_h = self.policy.fluid_usd, self.policy.fluid_dev_h
        if eng.prefix is not None and eng.prefix.total_queries:  # vLLM's prefix cache hits / queries, whole run
            extra["prefix_hit_rate"] = eng.prefix.total_hits / eng.prefix.total_queries
        return SimResult(
            policy=self.policy.name, trace=self.trace.name, model=self.model, requests=n,
            slo_attainment=float(ok.sum()) / n,
            ttft_p95_s=p95(ttft) if len(ttft) else math.nan,
            tpot_p95_s=p95(tpot) if len(tpot) else math.nan,
            cost_usd=cost, accelerator_hours=dev_h, idle_node_hours=max(totals.idle_node_hours, 0.0),  # not -1e-13
            failed_requests=int(((eng.status == FAILED) & scored).sum()), scale_up_events=totals.scale_up_events,
            wall_s=wall, sim_s=end, node_hours=totals.node_hours, capacity_errors=totals.capacity_errors,
            spot_interruptions=totals.spot_interruptions, ticks=ticks, extra=extra,
            rejected_requests=int((self.rejected_s >= self.cfg.warmup_s).sum()),
            timeline=self._timeline(end, ok_all),
        )

    def _timeline(self, end: float, ok: np.ndarray) -> dict[str, Any]:
        """Per-bucket load, replicas per flavor, latency and cost, for plots and the notebook."""
        b = self.cfg.timeline_bucket_s
        nb = max(1, math.ceil(end / b))
        edges = np.arange(nb + 1) * b
        arrivals = np.histogram(self.arr, edges)[0] / b
        eng = self.engine
        fin = np.isfinite(eng.t_fin)
        bucket = np.minimum((eng.t_fin[fin] // b).astype(np.int64), nb - 1)
        ttft_p95 = np.full(nb, np.nan)
        tpot_p95 = np.full(nb, np.nan)
        att = np.full(nb, np.nan)
        tt, tp, okf, outf = eng.ttft[fin], eng.tpot[fin], ok[fin], self.output[fin]
        order = np.argsort(bucket, kind="stable")
        bs = bucket[order]
        starts = np.searchsorted(bs, np.arange(nb), side="left")
        stops = np.searchsorted(bs, np.arange(nb), side="right")
        for k in range(nb):
            idx = order[starts[k]:stops[k]]
            if not len(idx):
                continue
            x = tt[idx]
            x = x[np.isfinite(x)]
            if len(x):
                ttft_p95[k] = p95(x)
            y = tp[idx][outf[idx] > 1]
            y = y[np.isfinite(y)]
            if len(y):
                tpot_p95[k] = p95(y)
            att[k] = okf[idx].mean()
        t_s = np.array([s[0] for s in self._samples])
        replicas = {f: np.array([s[2].get(f, 0) for s in self._samples]) for f in self.flavors}
        return {
            "bucket_s": b, "t_s": edges[:-1], "arrival_rps": arrivals, "ttft_p95_s": ttft_p95,
            "tpot_p95_s": tpot_p95, "slo_attainment": att,
            "sample_t_s": t_s, "usd_per_h": np.array([s[1] for s in self._samples]),
            "replicas": {f: v for f, v in replicas.items() if v.any()},
            "ongoing": np.array([s[3] for s in self._samples]),
        }


def _progress(total: float, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, unit="sim-s", unit_scale=True, leave=False, desc="simulating")


def simulate(catalog: Catalog, trace: Trace, policy: str | Policy, cfg: SimConfig = SimConfig(),
             progress: bool = False) -> SimResult:
    """Run one policy over a trace. ``policy`` is a name (rayscale, stock, static-peak, oracle) or a Policy."""
    pol = (make_policy(policy, cfg.settings)
           if isinstance(policy, str) else policy)
    return Simulation(catalog, trace, pol, cfg).run(progress)
