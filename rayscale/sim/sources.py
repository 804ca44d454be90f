"""Trace specs for the CLI: a file path, or a generated trace.

    PATH                                  Azure CSV or Mooncake JSONL (rayscale.sim.trace.load_trace)
    gen:poisson[:rate=5,hours=1]          constant-rate Poisson arrivals
    gen:diurnal[:base=1,peak=12,hours=24,period_h=24]
                                          sinusoidal day from base to peak requests/s
    gen:bursty[:base=2,burst=12,every_s=1800,burst_s=300,hours=4]
                                          steady rate with periodic bursts
Common keys: seed (default: the --seed), prompt (median prompt tokens, 1000), output (median output
tokens, 100). Unknown generators or keys are an error that lists the allowed ones.
"""

from __future__ import annotations

from collections.abc import Callable

from rayscale.sim.trace import (
    DEFAULT_OUTPUT,
    DEFAULT_PROMPT,
    LengthDist,
    Trace,
    bursts,
    diurnal,
    load_trace,
    poisson,
)

_DEFAULTS: dict[str, dict[str, float]] = {
    "poisson": {"rate": 5.0, "hours": 1.0},
    "diurnal": {"base": 1.0, "peak": 12.0, "hours": 24.0, "period_h": 24.0},
    "bursty": {"base": 2.0, "burst": 12.0, "every_s": 1800.0, "burst_s": 300.0, "hours": 4.0},
}
_COMMON = ("seed", "prompt", "output")


class TraceSpecError(ValueError):
    pass


def parse_gen(spec: str, seed: int = 0) -> Trace:
    body = spec[len("gen:"):]
    kind, _, args = body.partition(":")
    if kind not in _DEFAULTS:
        raise TraceSpecError(f"--trace {spec!r}: unknown generator {kind!r}; allowed: {', '.join(_DEFAULTS)}")
    vals = dict(_DEFAULTS[kind])
    vals.update({"seed": float(seed), "prompt": DEFAULT_PROMPT.median, "output": DEFAULT_OUTPUT.median})
    for part in filter(None, args.split(",")):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or key not in vals:
            raise TraceSpecError(f"--trace {spec!r}: bad field {part!r}; allowed keys for {kind}: "
                                 f"{', '.join([*_DEFAULTS[kind], *_COMMON])} (as key=value)")
        try:
            vals[key] = float(raw)
        except ValueError:
            raise TraceSpecError(f"--trace {spec!r}: field {key!r} must be a number, got {raw!r}") from None
    prompt = LengthDist(vals["prompt"], DEFAULT_PROMPT.sigma, DEFAULT_PROMPT.low, DEFAULT_PROMPT.high)
    output = LengthDist(vals["output"], DEFAULT_OUTPUT.sigma, DEFAULT_OUTPUT.low, DEFAULT_OUTPUT.high)
    dur = vals["hours"] * 3600.0
    s = int(vals["seed"])
    makers: dict[str, Callable[[], Trace]] = {
        "poisson": lambda: poisson(vals["rate"], dur, s, prompt, output),
        "diurnal": lambda: diurnal(vals["base"], vals["peak"], vals["period_h"] * 3600.0, dur, s,
                                   prompt=prompt, output=output),
        "bursty": lambda: bursts(vals["base"], vals["burst"], vals["every_s"], vals["burst_s"], dur, s,
                                 prompt=prompt, output=output),
    }
    try:
        return makers[kind]()
    except ValueError as e:
        raise TraceSpecError(f"--trace {spec!r}: {e}") from None


def load_spec(spec: str, seed: int = 0, time_scale: float = 1.0, rate_scale: float = 1.0,
              repeat: int = 1, resample: bool = False) -> Trace:
    """A trace from a path or gen: spec, reshaped: time scale, then rate scale, then repeat. ``resample``: a
    file trace becomes the ``seed``-th draw of its traffic (Trace.resample); a generator draws per seed anyway."""
    tr = parse_gen(spec, seed) if spec.startswith("gen:") else load_trace(spec)
    if resample and not spec.startswith("gen:"):
        tr = tr.resample(seed)
    if time_scale != 1.0:
        tr = tr.time_scale(time_scale)
    if rate_scale != 1.0:
        tr = tr.rate_scale(rate_scale, seed=seed)
    if repeat != 1:
        tr = tr.repeat(repeat)
    if len(tr) == 0:
        raise TraceSpecError(f"--trace {spec!r}: no requests after scaling")
    return tr


WARMUP_SEED_OFFSET = 1000  # the warm-up draw's seed: never one a scored run uses


def with_warmup_draw(spec: str, seed: int, time_scale: float = 1.0, rate_scale: float = 1.0,
                     draws: int = 1) -> tuple[Trace, float]:
    """Steady state without hindsight: another draw of the same traffic (seed + 1000) to warm up on, then the
    scored draw (``seed``; a file trace is resampled for both). Returns the trace and when scoring starts.
    ``draws`` > 1 warms up on that many draws, the further ones (seeds + 3000, + 5000, ...; never a seed
    another run uses) before the first: a longer past for the state that remembers hours (SLO feedback)."""
    if draws < 1:
        raise ValueError(f"with_warmup_draw: draws must be at least 1, got {draws}")
    seeds = [seed + WARMUP_SEED_OFFSET * (2 * k + 1) for k in reversed(range(draws))]
    warm = load_spec(spec, seeds[0], time_scale, rate_scale, resample=True)
    for s in seeds[1:]:
        warm = warm.then(load_spec(spec, s, time_scale, rate_scale, resample=True))
    scored = load_spec(spec, seed, time_scale, rate_scale, resample=True)
    both = warm.then(scored)
    return both, float(both.arrival_s[len(warm)])
