"""Choosing the shipped settings on the dev split only, by a stated rule.

    .venv/bin/python -m bench.tune [--seeds 0,1,2] [--jobs 2] [--draws 1] [--variants A,B] [--no-shipped] [--out F]
                                   [--from-log F]

Each variant is the shipped settings (rayscale/data/settings.yaml) with one or two knobs changed. Every
variant runs the product (``rayscale``, no request mix declared) on the dev traffic of bench.eval_split only
(the held-out cases are never run here), per seed in steady state (warmed up on ``--draws`` other draws), in steady
state with the controller restarted 30 min before scoring (as the product does, it reads back the checkpoint
it saved in its last period: rate history, corrections, SLO feedback's record; rayscale.core.checkpoint),
and from cold.

Rule: among the variants whose mean SLO attainment on every dev trace is >= 99% or no more than 0.1 pt below
the shipped settings' (seed noise; but >= 99% where the shipped settings miss 99% and some variant meets it),
both in steady state and after the restart, and
whose from-cold mean is no more than one point below the shipped settings' on any dev trace, ship the one with
the lowest steady-state cost summed over the dev traces (mean over seeds), if that is at least 1% below the
shipped settings' (else the shipped ones stay). Where none is that much cheaper, a variant that costs at most
1% more in steady state and raises the from-cold mean by at least half a point on a dev trace where the shipped
settings miss 99% from cold, while no from-cold mean falls more than 0.1 pt below the shipped settings', ships
(the largest such rise; the issue's from-cold goal is to come within a point of the clairvoyant plan). The
held-out split then reports it (bench.eval_split). From
cold here means each variant starts from the fleet it orders for the first 30 s. (The 0.1-pt clause was added
when the shipped settings themselves missed 99% on the Azure code trace: without it the rule could not prefer
a variant that meets the SLO as well and costs less. The restart clause was added when SLO feedback's record
turned out to carry the warm-up's start-up misses into the scored hour: a factor relaxed over a calm half
hour, as after a restart, met 96.6% on the Azure code trace where the steady state said 99%. The 0.1-pt
clause let shipped settings that miss 99% stay for being cheaper where a variant met it, until the long-prompt
day joined dev; since then a variant must meet 99% there. The from-cold clause was added after the 10-min
rise variant of tune_rise_down.md met 98.48% from cold on the fast ramp, where the shipped settings met 97.71%
and the clairvoyant plan 99.26%, at 0.1% more: the rule had no way to prefer a from-cold gain at equal cost.)
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import machine, span
from bench.eval_split import CASES, MODEL, RESTART_BEFORE_S, case_run, model_of
from rayscale.core.settings import Settings
from rayscale.sim.policies import RayscalePolicy
from rayscale.sim.simulator import SimConfig, simulate
from rayscale.tables import format_table

SHIPPED = "shipped"
TIE = 0.01  # a variant must be this much cheaper than the shipped settings to replace them
SLO_SLACK = 0.001  # where the shipped settings miss 99%, a variant may be this much below them (seed noise)
COLD_GAIN = 0.005  # a from-cold rise this large, where the shipped settings miss 99% from cold, is worth up to TIE


def variants() -> dict[str, Settings]:
    s = Settings()
    return {SHIPPED: s, **_forecast_variants(s), **_feedback_variants(s), **_planner_variants(s)}


def _forecast_variants(s: Settings) -> dict[str, Settings]:
    """Variants of the signals, the forecast, the utilisation and the burst floor."""
    est, pl = s.estimate, s.planner
    return {
        # The arrival rate also read over the last 10 s of the window, the larger of the two counting
        # (bench/results/tune_fast_window.md).
        "fast window 10 s": replace(s, fast_window_s=10.0),
        "utilization 0.9": replace(s, estimate=replace(est, target_utilization=0.9)),
        "utilization 0.85": replace(s, estimate=replace(est, target_utilization=0.85)),
        "utilization 0.8 where bursts last": replace(s, estimate=replace(est, smooth_target_utilization=None)),
        "no burst floor": replace(s, estimate=replace(est, burst_floor=False)),
        # Shipped since kv_correction.md: the batch a flavor's KV cache holds counts the tokens its running
        # sequences were seen to hold (Correction.kv); without, the mix's mean request.
        "KV bound by the mean request": replace(s, estimate=replace(est, kv_correction=False)),
        "seasonal (no peak hold)": replace(s, forecaster="seasonal"),
        "last value": replace(s, forecaster="last"),
        "trend starts flat": replace(s, trend_start="flat"),
        # The trend fitted on each minute's rate as the lowest of it and the two before it: a burst of a minute
        # or two is the burst floor's and the peak hold's, not a trend (rayscale.core.forecast.without_spikes).
        "trend ignores 1-2 minute spikes": replace(s, spike_windows=3),
        "scale-down delay 300 s": replace(s, planner=replace(pl, downscale_delay_s=300.0)),
        # Shipped since tune_rise_room.md: the peak hold and the burst floor hold at most the rate now plus the
        # largest rise the history shows within one forecast horizon (Settings.hold_rise_room).
        "peak hold and burst floor without rise room": replace(s, hold_rise_room=False),
        "peak hold 60 min": replace(s, peak_hold_s=3600.0),
        "peak hold 20 min": replace(s, peak_hold_s=1200.0),
        "peak hold 10 min": replace(s, peak_hold_s=600.0),
        "burst floor over 30 min": replace(s, burst_history_s=1800.0),
        "burst floor over 30 min and peak hold 20 min": replace(s, burst_history_s=1800.0, peak_hold_s=1200.0),
        # Shipped: 15 min. What is ordered also waits on the window and the history's minute before the rise
        # shows (held-out fast day from cold, 3 seeds: 95.0% at the median start-up, 97.4% at 15 min, 98.4%
        # at 20; bench/results/tune_horizon.md).
        "forecast at the median start-up": replace(s, forecast_horizon_s=None),  # shipped before tune_horizon.md
        "forecast 20 min ahead": replace(s, forecast_horizon_s=1200.0),
    }


def _feedback_variants(s: Settings) -> dict[str, Settings]:
    """Variants of SLO feedback and of what a scale-down keeps of a rise."""
    fb = s.feedback
    return {
        "no SLO feedback": replace(s, feedback=replace(fb, enabled=False)),
        "feedback relax 0.2/h": replace(s, feedback=replace(fb, relax_per_h=0.2)),
        "feedback relax 0.4/h": replace(s, feedback=replace(fb, relax_per_h=0.4)),
        "feedback relax above 0.5": replace(s, feedback=replace(fb, relax_above=0.5)),
        "feedback min 0.7": replace(s, feedback=replace(fb, min_factor=0.7)),
        "feedback min 0.8": replace(s, feedback=replace(fb, min_factor=0.8)),  # shipped before tune_min_factor.md
        "feedback tighten 1.0/h": replace(s, feedback=replace(fb, tighten_per_h=1.0)),
        # Shipped since tune_draws2.md: the factor relaxes only once the record has read slack for 30 min on end
        # (FeedbackSettings.relax_hold_s); without, it relaxes whenever the record reads slack.
        "feedback relaxes without a hold": replace(s, feedback=replace(fb, relax_hold_s=None)),
        "feedback relaxes after 60 min of slack + tighten 1.0/h": replace(s, feedback=replace(
            fb, relax_hold_s=3600.0, tighten_per_h=1.0)),
        # A relaxed factor returns to 1 once the record holds 1.5x the allowed misses (restore_below).
        "feedback restores 1 at 1.5x the misses": replace(s, feedback=replace(fb, restore_below=-0.5)),
        "feedback trims the burst floor to 0.75": replace(s, feedback=replace(fb, burst_floor_min_factor=0.75)),
        # Shipped since tune_floor_goal.md: a record below the goal leaves the burst floor whole while the factor
        # climbs back to 1 (FeedbackSettings.floor_trim_below_goal); this variant trims it then too.
        "burst floor trimmed while the record is below the goal": replace(s, feedback=replace(
            fb, floor_trim_below_goal=True)),
        "feedback max 1.25": replace(s, feedback=replace(fb, max_factor=1.25)),
        "feedback 60 min": replace(s, feedback=replace(fb, time_constant_s=3600.0)),
        "feedback relaxes a young record": replace(s, feedback=replace(fb, relax_after_s=0.0)),
        "feedback below arrivals": replace(s, feedback=replace(fb, floor_window_s=0.0)),
        "feedback floor over 1 min": replace(s, feedback=replace(fb, floor_window_s=60.0)),
        "feedback floor over 11 min": replace(s, feedback=replace(fb, floor_window_s=660.0)),
        "feedback floor at 0.9 of arrivals": replace(s, feedback=replace(fb, floor_share=0.9)),
        "feedback floor at 0.95 of arrivals": replace(s, feedback=replace(fb, floor_share=0.95)),
        "feedback caps a window at 2x the misses": replace(s, feedback=replace(fb, window_miss_cap=2.0)),
        "window cap 5x": replace(s, feedback=replace(fb, window_miss_cap=5.0)),
        "rise needs arrivals + window cap 5x": replace(s, feedback=replace(fb, rise_needs_arrivals=True,
                                                                           window_miss_cap=5.0)),
        "rise needs arrivals + window cap 5x + tighten 1.0/h": replace(s, feedback=replace(
            fb, rise_needs_arrivals=True, window_miss_cap=5.0, tighten_per_h=1.0)),
        "rise needs arrivals + window cap 5x + tighten 1.0/h + max 1.25": replace(s, feedback=replace(
            fb, rise_needs_arrivals=True, window_miss_cap=5.0, tighten_per_h=1.0, max_factor=1.25)),
        "rise needs arrivals": replace(s, feedback=replace(fb, rise_needs_arrivals=True)),
        # The factor not applied at all on a rise, the level held included (bench/results/tune_rise_trim.md).
        "rise untrimmed": replace(s, feedback=replace(fb, rise_trims_held=False)),
        "scale-down on a rise for the trimmed demand": replace(s, feedback=replace(fb, rise_keeps_untrimmed=False)),
        # The gate at the level held itself: the factor trims the demand up to that level, the rest whole (a
        # demand continuous in the forecast, where a gate at 20% over the level jumps).
        "trim up to the level held": replace(s, feedback=replace(fb, rise_above=0.0)),
        "rise needs arrivals + window cap 2x": replace(s, feedback=replace(fb, rise_needs_arrivals=True,
                                                                          window_miss_cap=2.0)),
        "rise needs arrivals + window cap 2x + floor trim 0.9": replace(s, feedback=replace(
            fb, rise_needs_arrivals=True, window_miss_cap=2.0, burst_floor_min_factor=0.9)),
        "feedback leaves the burst floor": replace(s, feedback=replace(fb, relax_burst_floor=False)),
        "feedback relaxes the burst floor to 0.7": replace(s, feedback=replace(fb, min_factor=0.7)),
        "feedback applied on rises": replace(s, feedback=replace(fb, rise_above=None)),
        "scale-down keeps no rise": replace(s, rise_window_s=0.0),
        "scale-down keeps the 10-min rise": replace(s, rise_window_s=600.0),  # shipped since tune_rise_down.md
        "scale-down keeps the 20-min rise": replace(s, rise_window_s=1200.0),
        "feedback not applied 0.1 over the level held": replace(s, feedback=replace(fb, rise_above=0.1)),
        "feedback not applied 0.3 over the level held": replace(s, feedback=replace(fb, rise_above=0.3)),
    }


def _planner_variants(s: Settings) -> dict[str, Settings]:
    """Variants of the planner's bands, tolerances and moves, and of the request mix's span."""
    pl = s.planner
    return {
        "hysteresis band 0.1": replace(s, planner=replace(pl, hysteresis_band=0.1)),
        "hysteresis band 0.15": replace(s, planner=replace(pl, hysteresis_band=0.15)),
        "band 0.1 where bursts last a minute": replace(s, planner=replace(pl, smooth_hysteresis_band=0.1)),
        "band 0.15 where bursts last a minute": replace(s, planner=replace(pl, smooth_hysteresis_band=0.15)),
        "scale-up tolerance 0.03": replace(s, planner=replace(pl, scale_up_tolerance=0.03)),
        "scale-up tolerance 0.05": replace(s, planner=replace(pl, scale_up_tolerance=0.05)),
        "scale-up tolerance 0.1": replace(s, planner=replace(pl, scale_up_tolerance=0.1)),
        # Where SLO feedback found slack on a level (PlannerSettings.slack_scale_up_tolerance; shipped 0.1).
        "no scale-up tolerance for slack": replace(s, planner=replace(pl, slack_scale_up_tolerance=0.0)),
        "scale-up tolerance 0.05 for slack": replace(s, planner=replace(pl, slack_scale_up_tolerance=0.05)),
        "scale-up tolerance 0.15 for slack": replace(s, planner=replace(pl, slack_scale_up_tolerance=0.15)),
        # A scale-down that starts replicas elsewhere (a finer or cheaper flavor) must save this much over
        # dropping running ones alone (shipped 0.15, bench/results/scale_down_moves.md): the dev chat hour
        # kept 3 L40S where 2 L40S and inf2 would have saved 6%.
        "scale-down moves for a 5% saving": replace(s, planner=replace(pl, scale_down_move_saving=0.05)),
        "scale-down moves for any saving": replace(s, planner=replace(pl, scale_down_move_saving=0.0)),
        "no moves while steady": replace(s, planner=replace(pl, steady_moves=False)),
        # A 30-s reading above the hour's busiest minute and burst rate (EstimateSettings.current_within_busiest_minute).
        "rate now within the hour's busiest minute": replace(s, estimate=replace(
            s.estimate, current_within_busiest_minute=True)),
        # A flavor deployment of one replica counted at what it serves alone (PlannerSettings.alone_capacity;
        # tune_alone.md ran it as the shipped settings, against "one replica counted pooled").
        "one replica counted alone": replace(s, planner=replace(pl, alone_capacity=True)),
        "mix over >= 2000 requests (up to 30 min)": replace(s, mix_min_requests=2000, mix_max_s=1800.0),
        "mix over >= 3000 requests (up to 30 min)": replace(s, mix_min_requests=3000, mix_max_s=1800.0),
    }


STARTS = ("steady", "restart", "cold")


def one(variant: str, case: int, seed: int, start: str, draws: int = 1) -> dict[str, Any]:
    cat, trace, warm = case_run(case, seed, start != "cold", draws=draws)
    t0 = time.perf_counter()
    settings = variants()[variant]
    policy = RayscalePolicy(settings, restart_at_s=warm - RESTART_BEFORE_S if start == "restart" else None)
    r = simulate(cat, trace, policy, SimConfig(model=model_of(case), seed=seed, warmup_s=warm, settings=settings))
    print(f"  {variant} / {CASES[case][1]} seed={seed} {start}: "
          f"{100 * r.slo_attainment:.2f}% ${r.cost_usd:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"variant": variant, "case": case, "seed": seed, "start": start, "slo": r.slo_attainment,
            "usd": r.cost_usd}


def choose(rows: list[dict[str, Any]], cases: list[int]) -> tuple[str, dict[str, str]]:
    """The rule of the module docstring; per variant, why it was not chosen."""
    def mean(v: str, c: int, start: str, key: str) -> float:
        return statistics.mean(r[key] for r in rows if (r["variant"], r["case"], r["start"]) == (v, c, start))
    names = sorted({r["variant"] for r in rows})
    def bar(c: int, start: str) -> float:
        shipped = mean(SHIPPED, c, start, "slo")
        if shipped < 0.99 and any(mean(v, c, start, "slo") >= 0.99 for v in names):
            return 0.99
        return min(0.99, shipped - SLO_SLACK)

    why: dict[str, str] = {}
    ok = []
    for v in names:
        low = [f"{CASES[c][1]} ({start})" for c in cases for start in ("steady", "restart")
               if mean(v, c, start, "slo") < bar(c, start)]
        cold = [CASES[c][1] for c in cases if mean(v, c, "cold", "slo") < mean(SHIPPED, c, "cold", "slo") - 0.01]
        if low:
            why[v] = "SLO < 99% (and below shipped) on " + ", ".join(low)
        elif cold:
            why[v] = "from cold > 1 pt below shipped on " + ", ".join(cold)
        else:
            ok.append((sum(mean(v, c, "steady", "usd") for c in cases), v))
    shipped = next((cost for cost, v in ok if v == SHIPPED), None)
    best = min(ok)[1] if ok else SHIPPED
    if shipped is not None and min(ok)[0] > (1 - TIE) * shipped:
        gains = [(_cold_gain(mean, v, cases), v) for cost, v in ok if v != SHIPPED and cost <= (1 + TIE) * shipped]
        gain, v = max(gains, default=(0.0, SHIPPED))
        best = v if gain >= COLD_GAIN else SHIPPED  # no variant is clearly cheaper nor clearly better from cold
        if best != SHIPPED:
            why[best] = f"chosen: from cold +{100 * gain:.2f} pt where shipped misses 99%"
    for cost, v in ok:
        if v == best and v in why:
            continue
        why[v] = "chosen" if v == best else (f"steady ${cost:.2f}, not {TIE:.0%} below shipped" if shipped is not None
                                             and v != SHIPPED and cost > (1 - TIE) * shipped else f"steady ${cost:.2f}")
    return best, why


def _cold_gain(mean: Any, v: str, cases: list[int]) -> float:
    """The largest from-cold rise of ``v`` over the shipped settings on a dev trace where they miss 99% from
    cold; 0 where ``v`` falls more than SLO_SLACK below them from cold anywhere."""
    diff = {c: mean(v, c, "cold", "slo") - mean(SHIPPED, c, "cold", "slo") for c in cases}
    if min(diff.values()) < -SLO_SLACK:
        return 0.0
    return max((d for c, d in diff.items() if mean(SHIPPED, c, "cold", "slo") < 0.99), default=0.0)


def table(rows: list[dict[str, Any]], cases: list[int], why: dict[str, str]) -> str:
    out = []
    for v in variants():
        for c in cases:
            for start in STARTS:
                sel = [r for r in rows if (r["variant"], r["case"], r["start"]) == (v, c, start)]
                if sel:
                    out.append([v, CASES[c][1], start, span([r["slo"] for r in sel], True),
                                span([r["usd"] for r in sel], False), why.get(v, "") if c == cases[0] and start
                                == STARTS[0] else ""])
    return format_table(["variant", "traffic", "start", "SLO min/mean/max", "$ min/mean/max", "verdict"], out)


_LINE = re.compile(r"^  (?P<v>.+) / (?P<label>.+) seed=(?P<seed>\d+) (?P<mode>steady|restart|cold): (?P<slo>[\d.]+)% "
                   r"\$(?P<usd>[\d.]+)")


def rows_from_log(text: str) -> list[dict[str, Any]]:
    """The rows a run printed (its progress lines): to re-apply the rule without re-running."""
    case_of = {label: i for i, (_, label, *_rest) in enumerate(CASES)}
    return [{"variant": m["v"], "case": case_of[m["label"]], "seed": int(m["seed"]), "start": m["mode"],
             "slo": float(m["slo"]) / 100, "usd": float(m["usd"])}
            for m in map(_LINE.match, text.splitlines()) if m]


def verdict_of(rows: list[dict[str, Any]], cases: list[int]) -> tuple[dict[str, str], str]:
    """Per variant why it was (not) chosen, and the report's verdict line; without the shipped settings' rows
    (a --no-shipped run) the rule cannot be applied, and the line says so."""
    if not any(r["variant"] == SHIPPED for r in rows):
        return {}, "**No shipped rows: the rule was not applied** (join them from another run's log with --from-log)."
    best, why = choose(rows, cases)
    if why.get(best, "").startswith("chosen"):
        return why, f"**Chosen: {best}.**"
    return why, (f"**Chosen: {best}.** No variant meets the rule on every dev trace, the shipped settings included ("
                 f"{why.get(best, '')}): they stay, and the shortfall is reported as such.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--draws", type=int, default=1, help="draws of the traffic the steady state warms up on")
    ap.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--out", default="bench/results/tune.md")
    ap.add_argument("--from-log", help="re-apply the rule to a run's printed progress lines instead of running")
    ap.add_argument("--no-shipped", action="store_true",
                    help="leave the shipped settings out (their rows from another run, joined with --from-log)")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    names = [v for v in variants() if not args.variants or v in args.variants.split(",")
             or (v == SHIPPED and not args.no_shipped)]
    cases = [i for i, c in enumerate(CASES) if c[0] == "dev"]
    jobs = [(v, c, s, st, args.draws) for v in names for c in cases for s in seeds for st in STARTS]
    print(f"{len(jobs)} runs on {args.jobs} processes", flush=True)
    t0 = time.perf_counter()
    if args.from_log:
        rows = rows_from_log(Path(args.from_log).read_text())
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(one, *zip(*jobs, strict=True)))
    how = (f"rule applied to the rows printed in {args.from_log}" if args.from_log
           else f"{time.perf_counter() - t0:.0f} s on {args.jobs} processes")
    why, verdict = verdict_of(rows, cases)
    command = " ".join(["python -m bench.tune", *(shlex.quote(a) for a in sys.argv[1:])])
    text = (f"# Tuning the shipped settings on the dev split\n\n{machine()}; `{command}` ({how}); model {MODEL}, shipped "
            "catalog, on-demand only.\n\n" + __doc__.split("\n\n", 2)[2] + f"\n{verdict}\n\n```\n"
            + table(rows, cases, why) + "\n```\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
