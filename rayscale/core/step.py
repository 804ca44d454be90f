"""One control period as one pure function: ``step(context) -> result`` with the new state inside.

Like Ray Serve's ``autoscaling_policy.py`` (a policy is a function of one context that returns its decision
and its state), everything the decision depends on comes in through ``StepContext`` and everything it
changes goes out in ``StepResult``: no I/O, no clock. The live controller (rayscale.controller.loop) and the
simulator (rayscale.sim.policies) call this same function with the same ``Settings``; they differ only in
where the signals and the cluster view come from and where the actions go (a provider).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, is_dataclass, replace

from rayscale.core.act import Action, BackOff, Gang, GangPhase, Key, decide
from rayscale.core.catalog import Catalog
from rayscale.core.estimate import (
    Correction,
    Demand,
    DemandState,
    alone_shares,
    correction_smoothing,
    estimate,
    prefix_scales,
    update_corrections,
)
from rayscale.core.feedback import Delivered, delivered
from rayscale.core.forecast import FORECASTERS, Forecaster, Seasonal, line_ahead, rise_room
from rayscale.core.frozen import replaced
from rayscale.core.plan import AloneShares, Plan, PlannerMemory, bursts_last, plan
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals, RequestMix
from rayscale.core.spot import SpotRecord, observe, rates

ZoneKey = tuple[str, str, str]  # (flavor, zone, capacity type)


@dataclass(frozen=True)
class ServeView:
    """Serve's replicas as observed, per (model, flavor): the target it was told, how many exist (starting
    and stopping ones too) and how many serve (RUNNING: they take requests; None: not observed, then the
    existing ones count)."""

    target: Mapping[tuple[str, str], int]
    running: Mapping[tuple[str, str], int]
    serving: Mapping[tuple[str, str], int] | None = None


@dataclass(frozen=True)
class StepState:
    """What one step hands the next. Losing it (a restart) only slows the controller down: what exists is
    read back from the cluster, never from here."""

    memory: PlannerMemory = field(default_factory=PlannerMemory)
    corrections: Mapping[tuple[str, str], Correction] = field(default_factory=dict)
    demands: Mapping[str, Demand] | None = None  # last period's: where the estimator's searches start
    unavailable: Mapping[ZoneKey, float] = field(default_factory=dict)  # backed-off zones, until when
    rate_history: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # per history window
    next_history_s: float | None = None  # when the next history sample is due
    last_mix: Mapping[str, RequestMix] = field(default_factory=dict)
    horizon_s: float | None = None  # the forecaster's look-ahead, worked out from the catalog once
    delivered: Mapping[str, Delivered] = field(default_factory=dict)  # SLO attainment so far, smoothed
    spot: SpotRecord = field(default_factory=SpotRecord)  # spot interruptions seen (rayscale.core.spot)


@dataclass(frozen=True)
class StepContext:
    now: float
    catalog: Catalog
    signals: Mapping[str, ModelSignals]  # observed, per model
    gangs: tuple[Gang, ...]  # the cluster view, ``serving`` filled in from Serve
    serve: ServeView | None  # None: Serve's state is unknown, so nothing is changed
    settings: Settings
    state: StepState = field(default_factory=StepState)
    # The provider drains gangs (rayscale.core.act.DrainGang): spot the plan no longer counts on is moved onto
    # on-demand capacity and released, not kept until a scale-down or an interruption takes it.
    can_drain: bool = False


@dataclass(frozen=True)
class StepResult:
    plan: Plan
    demands: Mapping[str, Demand]
    actions: tuple[Action, ...]
    state: StepState
    signals: Mapping[str, ModelSignals]  # as the estimator saw them (with history and the last mix)


def step(ctx: StepContext) -> StepResult:
    """Observe's signals in; the plan and the actions that move the cluster towards it out."""
    cfg, state, catalog = ctx.settings, ctx.state, ctx.catalog
    signals, history, next_history_s, last_mix = _with_history(ctx)
    corrections = update_corrections(catalog, dict(signals), dict(state.corrections),
                                     smoothing=correction_smoothing(cfg.period_s), kv=cfg.estimate.kv_correction)
    horizon_s = state.horizon_s if state.horizon_s is not None else horizon_of(catalog, cfg)
    forecaster = _forecaster(cfg, horizon_s)
    demands = estimate(catalog, dict(signals), corrections, forecaster, cfg.estimate,
                       None if state.demands is None else dict(state.demands))
    alone_share = _alone_share(catalog, demands, corrections, cfg, signals)
    before = _after_interruptions(ctx)
    demands = _with_burst_room(demands, signals, cfg, horizon_s)
    demands = _with_feedback(demands, before, cfg, ctx.now, signals)
    demands = _with_rise(demands, signals, cfg, horizon_s)
    demands = _with_smooth_utilization(demands, before, cfg, signals, horizon_s)
    current: dict[Key, int] = {}
    ready_serving: dict[Key, int] = {}
    failed, ready = GangPhase.FAILED, GangPhase.READY
    for g in ctx.gangs:
        if g.phase != failed and not g.draining:
            # The plan counts replicas: a gang holds as many as Serve runs on it (several on a packed node),
            # and at least the one it was ordered for.
            key = g.key
            current[key] = current.get(key, 0) + max(g.serving, 1)
            if g.phase == ready:
                ready_serving[key] = ready_serving.get(key, 0) + g.serving
    unavailable = {k: u for k, u in state.unavailable.items() if u > ctx.now}
    spot = observe(state.spot, ctx.gangs, ctx.now, cfg.spot)
    result, memory = plan(catalog, demands, current, unavailable, ctx.now, state.memory, cfg.planner,
                          rates(spot, cfg.spot, catalog.flavors), ready_serving if ctx.can_drain else None,
                          alone_share)
    demands = _with_alone_shares(demands, result.alone_shares)
    record = _delivered(ctx, before, signals, result, demands)
    actions: tuple[Action, ...] = ()
    if ctx.serve is not None:
        serving = ctx.serve.running if ctx.serve.serving is None else ctx.serve.serving
        actions = tuple(decide(catalog, result.target(), list(ctx.gangs), dict(ctx.serve.target),
                               dict(ctx.serve.running), unavailable, ctx.now, cfg.act, dict(serving),
                               result.replica_rps(), ctx.can_drain))
    for a in actions:
        if isinstance(a, BackOff):
            unavailable[(a.flavor, a.zone, a.capacity_type)] = a.until_s
    new_state = StepState(memory, corrections, demands, unavailable, history, next_history_s, last_mix, horizon_s,
                          record, spot)
    return StepResult(result, demands, actions, new_state, signals)


def _alone_share(catalog: Catalog, demands: Mapping[str, Demand], corrections: Mapping[tuple[str, str], Correction],
                 cfg: Settings, signals: Mapping[str, ModelSignals]) -> AloneShares:
    """The plan's alone_shares, worked out on the estimate's demands (before feedback and utilisation scale
    their capacities: a share is of the pooled capacity both scale alike), only for the pairs it asks."""
    scales: list[Mapping[tuple[str, str], float]] = []

    def shares(pairs: Sequence[tuple[str, str]]) -> Mapping[tuple[str, str], float]:
        if not scales:
            scales.append(prefix_scales(catalog, dict(signals)))
        return alone_shares(catalog, demands, pairs, corrections, cfg.estimate, scales[0])
    return shares


def _with_alone_shares(demands: Mapping[str, Demand], shares: Mapping[tuple[str, str], float]) -> dict[str, Demand]:
    """The demands with the plan's alone shares (Demand.alone_share), for the ingress's weights."""
    per: dict[str, dict[str, float]] = {}
    for (m, f), x in shares.items():
        per.setdefault(m, {})[f] = x
    return {m: replace(d, alone_share=per[m]) if m in per else d for m, d in demands.items()}


def _after_interruptions(ctx: StepContext) -> Mapping[str, Delivered]:
    """The state's delivered attainment, where a model lost a spot gang that was serving (READY at the last
    step, FAILED now) with its factor back at 1 or above and its record as young as the loss. A relaxed
    factor was earned by the fleet as it stood; a notice takes a replica away for a whole start-up, and
    the replacement and the next rise ordered at 0.8 of the modelled need leave the fleet short of it (the
    dev chat ramp at 1 notice per node-hour, seed 4: three replicas served 8.5 req/s at a TTFT p95 of 6-8 s
    for five minutes while three more started). The factor relaxes again once the record is
    ``FeedbackSettings.relax_after_s`` old."""
    lost = {g.model for g in ctx.gangs if g.phase == GangPhase.FAILED and g.name in ctx.state.spot.ready}
    out = dict(ctx.state.delivered)
    for model in lost & out.keys():
        out[model] = replace(out[model], factor=max(out[model].factor, 1.0), since_s=ctx.now)
    return out


def _delivered(ctx: StepContext, before: Mapping[str, Delivered], signals: Mapping[str, ModelSignals], result: Plan,
               demands: Mapping[str, Demand]) -> dict[str, Delivered]:
    """``before`` (the state's delivered attainment) with this window's. A model's record starts once its fleet first
    stands as planned (as many replicas serving as the plan wants, none pending): misses while the first
    capacity starts say nothing about how it is sized; nor do those of a model served best effort (no
    flavor meets its SLO for the mix), which more replicas would not buy back."""
    out = dict(before)
    serving: dict[str, int] = {}
    pending: set[str] = set()
    for g in ctx.gangs:
        if g.phase == GangPhase.READY:
            serving[g.model] = serving.get(g.model, 0) + g.serving
        elif g.phase == GangPhase.PENDING:
            pending.add(g.model)
    wanted: dict[str, int] = {}
    for e in result.entries:
        wanted[e.model] = wanted.get(e.model, 0) + e.replicas
    standing = {m for m, n in serving.items() if n > 0 and n >= wanted.get(m, 0) and m not in pending}
    for name, sig in signals.items():
        if sig.freshness != Freshness.FRESH or (name not in out and name not in standing):
            continue
        if (d := demands.get(name)) is not None and d.best_effort:
            continue
        rec = delivered(out.get(name), sig, ctx.settings.window_s, ctx.now, ctx.settings.estimate.attainment,
                        ctx.settings.feedback)
        if rec is not None:
            out[name] = rec
    return out


def _with_smooth_utilization(demands: Mapping[str, Demand], record: Mapping[str, Delivered], cfg: Settings,
                             signals: Mapping[str, ModelSignals], horizon_s: float) -> dict[str, Demand]:
    """Each demand whose bursts last a minute or more (Demand.burst_sharpness) with its replicas' capacities
    at ``estimate.smooth_target_utilization`` in place of ``target_utilization`` (rps is linear in it), once
    its SLO record has earned it (its feedback factor is below 1, rayscale.core.feedback) and while its
    arrivals are not growing into the headroom given up: their line over ``rise_window_s`` rises less than
    that share within one start-up. A slow ramp grows into its headroom while the next replica starts."""
    smooth, target = cfg.estimate.smooth_target_utilization, cfg.estimate.target_utilization
    if smooth is None or smooth == target:
        return dict(demands)
    k = smooth / target
    out = dict(demands)
    for name, d in demands.items():
        rec = record.get(name)
        if not bursts_last(cfg.planner, d) or rec is None or rec.factor >= 1.0:
            continue
        if _grows_by(signals.get(name), cfg, horizon_s) >= k or _rising(d, signals.get(name), cfg) is not None:
            continue
        out[name] = replace(d, capacity={f: c._replace(rps=c.rps * k) for f, c in d.capacity.items()},
                            fallback={f: c._replace(rps=c.rps * k) for f, c in d.fallback.items()},
                            reason=f"{d.reason}; replicas at {smooth:.0%} utilisation (bursts last, SLO met)")
    return out


def _grows_by(sig: ModelSignals | None, cfg: Settings, horizon_s: float) -> float:
    """How many times its value now the arrival rate's line over ``rise_window_s`` reaches one horizon
    ahead (1: flat; inf with too short a history to tell; 1 where the line is off)."""
    n = round(cfg.rise_window_s / cfg.history_window_s)
    if n < 3:
        return 1.0
    if sig is None or len(sig.rate_history) < n:
        return math.inf
    now = line_ahead(sig.rate_history[-n:], 0.0)
    return line_ahead(sig.rate_history[-n:], horizon_s / cfg.history_window_s) / now if now > 0 else math.inf


def _with_feedback(demands: Mapping[str, Demand], record: Mapping[str, Delivered], cfg: Settings, now: float,
                   signals: Mapping[str, ModelSignals]) -> dict[str, Demand]:
    """Each sized demand times its model's SLO feedback factor (rayscale.core.feedback); its burst floor
    too when the factor is above 1, or below it (to ``burst_floor_min_factor`` at most) with
    ``relax_burst_floor`` and a record as old as the floor's arrivals (and at the goal, without
    ``floor_trim_below_goal``). Below 1, never below the arrivals of
    the last ``floor_window_s`` (``_sustained_rate``), and while the demand rises above the peak hold's level
    (``_rising``) only on that level (``rise_trims_held``; else not at all), its burst floor untrimmed, and
    a scale-down keeps capacity for the demand untrimmed (``rise_keeps_untrimmed``, as ``Demand.rise_rps``).
    Trimmed on a level, the demand says so (``Demand.slo_slack``)."""
    out = dict(demands)
    for name, d in demands.items():
        rec = record.get(name)
        if not cfg.feedback.enabled or rec is None or rec.factor == 1.0 or rec.attainment is None:
            continue
        if d.state != DemandState.OK or d.rps <= 0:
            continue
        factor = rec.factor
        why = f"{d.reason}; x{factor:.2f} for the {100 * rec.attainment:.2f}% of requests meeting the SLO"
        aged = cfg.feedback.relax_burst_floor and rec.age_s(now) >= cfg.burst_history_s
        covers = aged and (cfg.feedback.floor_trim_below_goal or rec.attainment >= cfg.estimate.attainment)
        burst = max(factor, cfg.feedback.burst_floor_min_factor) if factor > 1.0 or covers else 1.0
        if factor < 1.0 and aged and not covers and d.burst_rps > 0:
            why += ", burst floor whole: the record is below the goal"
        rps = d.rps * factor
        level = _rising(d, signals.get(name), cfg) if factor < 1.0 else None
        if level is not None:
            if not cfg.feedback.rise_trims_held:
                out[name] = replace(d, reason=f"{why}, not applied: rising above the {level:.2f} req/s held")
                continue
            rps, burst = d.rps - level * (1.0 - factor), 1.0
            why += f", on the {level:.2f} req/s held only: rising above it"
            if cfg.feedback.rise_keeps_untrimmed:
                d = replace(d, rise_rps=max(d.rise_rps, d.rps))
        arriving = _sustained_rate(signals.get(name), cfg.feedback.floor_window_s, cfg.history_window_s,
                                   cfg.window_s)
        floor = None if arriving is None else arriving * cfg.feedback.floor_share
        if factor < 1.0 and floor is not None and rps < floor:
            rps = min(d.rps, floor)
            share = "" if cfg.feedback.floor_share == 1.0 else f"{cfg.feedback.floor_share:.0%} of "
            why += f", not below {share}the {arriving:.2f} req/s arriving"
        out[name] = replace(d, rps=rps, burst_rps=d.burst_rps * burst, reason=why,
                            slo_slack=factor < 1.0 and level is None)
    return out


def _with_burst_room(demands: Mapping[str, Demand], signals: Mapping[str, ModelSignals], cfg: Settings,
                     horizon_s: float) -> dict[str, Demand]:
    """Each burst floor, scaled down where the rate history's busiest window of the hour the floor replays is
    above what the arrivals could climb back to within one forecast horizon: the rate now (plus two Poisson
    deviations of its window) plus the history's largest rise in that long (Settings.hold_rise_room). The
    floor of a level that has fallen follows it, as the peak hold does. Both ends are read on the same
    clock-aligned windows: a minute-long burst split across two of them shows half its height in each, and
    read against the floor's busiest 60 s of any alignment it would look like a level that had fallen."""
    out = dict(demands)
    if not cfg.hold_rise_room:
        return out
    windows = max(1, round(horizon_s / cfg.history_window_s))
    replayed = max(1, round(cfg.burst_history_s / cfg.history_window_s))
    for name, d in demands.items():
        sig = signals.get(name)
        if d.burst_rps <= 0 or sig is None or sig.arrival_rate_rps is None or not sig.rate_history:
            continue
        busiest = max(sig.rate_history[-replayed:])
        now = sig.arrival_rate_rps
        room = _could_be_arriving(now, cfg.window_s) + rise_room(sig.rate_history, windows)
        if room < busiest:
            out[name] = replace(d, burst_rps=d.burst_rps * room / busiest)
    return out


def _with_rise(demands: Mapping[str, Demand], signals: Mapping[str, ModelSignals], cfg: Settings,
               horizon_s: float) -> dict[str, Demand]:
    """Each sized demand with the rate its recent line reaches one forecast horizon ahead (Demand.rise_rps),
    where that is above the demand and what a scale-down keeps already: what a scale-down keeps capacity for
    (Settings.rise_window_s)."""
    out = dict(demands)
    n = round(cfg.rise_window_s / cfg.history_window_s)
    if n < 3:
        return out
    for name, d in demands.items():
        sig = signals.get(name)
        if d.state != DemandState.OK or sig is None or len(sig.rate_history) < n:
            continue
        rise = line_ahead(sig.rate_history[-n:], horizon_s / cfg.history_window_s)
        if rise > max(d.rps, d.rise_rps):
            out[name] = replace(d, rise_rps=rise)
    return out


def _rising(d: Demand, sig: ModelSignals | None, cfg: Settings) -> float | None:
    """The level a demand rises above by more than ``FeedbackSettings.rise_above`` (the highest arrival rate
    of the last ``peak_hold_s``, or now), or None when it does not: a forecast's trend or season above every
    rate the fleet has been sized for, or a backlog; with ``rise_needs_arrivals``, only while the arrivals
    now are within ``rise_above`` of that level."""
    rise = cfg.feedback.rise_above
    if rise is None or sig is None or sig.arrival_rate_rps is None:
        return None
    held = sig.rate_history[-_peak_windows(cfg):]
    level = max((sig.arrival_rate_rps, *held))
    if cfg.feedback.rise_needs_arrivals and sig.arrival_rate_rps * (1.0 + rise) < level:
        return None
    return level if d.rps > level * (1.0 + rise) else None


def _could_be_arriving(rate: float, window_s: float) -> float:
    """The highest rate the arrivals could have now, read as ``rate`` over ``window_s``: two Poisson standard
    deviations above it."""
    return rate + 2.0 * math.sqrt(rate / max(window_s, 1e-9))


def _sustained_rate(sig: ModelSignals | None, window_s: float, history_window_s: float,
                    rate_window_s: float) -> float | None:
    """The arrival rate sustained over the last ``window_s`` and still arriving: the mean of the rate
    history's samples that span it, but no more than the rate arriving now could be (the signals' rate, over
    ``rate_window_s``, plus two Poisson standard deviations: once a burst as long as the window ends, the
    samples are the burst itself, and a fleet ordered for it lands after it has gone; the rate's own noise
    must not lower the floor of a steady ramp); the signals' rate before there are any samples; None with
    no window or no rate."""
    if window_s <= 0 or sig is None or sig.arrival_rate_rps is None:
        return None
    now = sig.arrival_rate_rps
    recent = sig.rate_history[-max(1, round(window_s / history_window_s)):]
    if not recent:
        return now
    return min(statistics.fmean(recent), _could_be_arriving(now, rate_window_s))


def _with_history(ctx: StepContext) -> tuple[dict[str, ModelSignals], dict[str, tuple[float, ...]],
                                             float | None, dict[str, RequestMix]]:
    """Signals with the forecaster's rate history and the last seen mix; the state's new history.

    One sample per ``history_window_s``, taken from the arrival counts of that window when the signals
    carry them (the controller counts arrivals per period; the simulator counts the trace), otherwise the
    window's arrival rate."""
    cfg, state = ctx.settings, ctx.state
    due = state.next_history_s is None or ctx.now + 1e-9 >= state.next_history_s
    next_s = (ctx.now + cfg.history_window_s) if due else state.next_history_s
    history = dict(state.rate_history)
    last_mix = dict(state.last_mix)
    out: dict[str, ModelSignals] = {}
    for name, sig in ctx.signals.items():
        rate = sig.arrival_rate_rps
        if sig.freshness != Freshness.FRESH or rate is None:
            out[name] = sig
            continue
        # A window in which no request finished has no mix; the last one seen is a far better guess than
        # the generic default (long outputs), which would size replicas for a load that is not there.
        if sig.mix is not None:
            last_mix[name] = sig.mix
        elif name in last_mix:
            sig = replace(sig, mix=last_mix[name])
        past = history.get(name, ())
        out[name] = replaced(sig, rate_history=past)  # a thousand models a period: no __init__
        sample = _window_rate(sig, cfg.history_window_s) if due else None
        if sample is not None:
            history[name] = (*past, sample)[-cfg.history_len:]
    return out, history, next_s, last_mix


def _window_rate(sig: ModelSignals, window_s: float) -> float | None:
    """The arrival rate over the last whole window; None while the counts cover less than one (a rate over
    the first seconds after a start is noise that the trend would extrapolate a start-up horizon ahead)."""
    counts, bin_s = sig.arrival_counts, sig.arrival_bin_s
    if bin_s <= 0:
        return float(sig.arrival_rate_rps or 0.0)
    k = max(1, round(window_s / bin_s))
    return float(sum(counts[-k:])) / (k * bin_s) if len(counts) >= k else None


def forecaster_for(catalog: Catalog, settings: Settings) -> Forecaster:
    """The settings' forecaster, looking as far ahead as ordered capacity takes to serve."""
    return _forecaster(settings, horizon_of(catalog, settings))


def horizon_of(catalog: Catalog, settings: Settings) -> float:
    if settings.forecast_horizon_s is not None:
        return settings.forecast_horizon_s
    starts = [catalog.flavors[f].node_startup_s + catalog.profile(m, f).startup_s
              for m, spec in catalog.models.items() for f in spec.parallelism if f in catalog.flavors]
    return float(statistics.median(starts)) if starts else 0.0


@functools.lru_cache(maxsize=32)
def _forecaster(cfg: Settings, horizon_s: float) -> Forecaster:
    fc = FORECASTERS[cfg.forecaster]
    window_s = cfg.history_window_s
    if is_dataclass(fc) and not isinstance(fc, type) and hasattr(fc, "horizon"):
        fc = replace(fc, horizon=max(1, round(horizon_s / window_s)), flat_start=cfg.trend_start == "flat",
                     spike_windows=cfg.spike_windows)
    if isinstance(fc, Seasonal) and fc.peak_window > 0:
        fc = replace(fc, peak_window=_peak_windows(cfg), hold_rise_room=cfg.hold_rise_room)
    return fc


def _peak_windows(cfg: Settings) -> int:
    """The peak hold in rate-history windows (at least one)."""
    return max(1, round(cfg.peak_hold_s / cfg.history_window_s))
