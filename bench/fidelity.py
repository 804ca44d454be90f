"""Issue 6 (fidelity): calibrate the tiny model's profile on the real vLLM CPU engine, then replay one slice
of the Azure code trace through the real engine and through the simulator's engine model, and compare
per-request TTFT and TPOT (p50, p95; goal: within 10%).

    .venv/bin/python -m bench.fidelity --out bench/results/fidelity.md --plot bench/results/fidelity.png

~4 minutes with the default 2-minute replay (engine start 0.5-1 min, calibration 2 x ~20 s). Raw
measurements go to --raw; ``--from-raw`` re-renders the report (and ``--write-profile`` writes the fitted
profile into rayscale/data/profiles.yaml) without the engine. The measurements behind
bench/results/fidelity.md are kept in bench/results/fidelity.raw.json: ``--raw bench/results/fidelity.raw.json
--from-raw`` compares a changed simulator with them without vLLM. Run it on a quiet machine: the report warns
when the client could not send on time or the load average exceeded the cores.

1. Calibration (rayscale.engines.calibrate): one vLLM AsyncLLM in this process with the engine arguments
   Serve deploys the tiny model with; TTFT at batch 1 for several prompt lengths, inter-token latency with
   1..32 requests decoding together, and the time of one iteration prefilling 1..16 prompts together (the
   per-prompt engine cost prefill_seq_s), once before and once after the replay; least-squares fit of the
   Profile's latency model on both.
2. Real replay: the slice's requests, open loop at their (time-compressed) arrival times, straight into
   the same AsyncLLM (no HTTP, no Serve: this measures the engine, see bench/serving_overhead.py for the
   serving stack). Prompts are random token ids of the trace's lengths; ``ignore_eos`` makes every output
   exactly the trace's length. TTFT counts from the scheduled arrival; TPOT = (last token - first token) /
   (output tokens - 1), as in the simulator.
3. Simulation: rayscale.sim.engine.make_engine with the calibrated profile, one replica from t = 0, no
   controller; once with the default fluid engine model (a compiled pass per tick), once with the iteration-level
   model (``EngineConfig(model="iteration")``: vLLM V1's scheduler, one engine iteration at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import git_state, machine

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("RAYSCALE_TRACE", "/work/shared/traces/azure_llm_2023_code.csv"))
PROFILES = ROOT / "rayscale" / "data" / "profiles.yaml"
GOAL = 0.10
DRAIN_S = 120.0  # after the last arrival, wait at most this long for the real engine to finish


def log(msg: str) -> None:
    print(f"[fidelity {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the request slice ---------------------------------------------------------------------------------


def trace_slice(minutes: float, rate_scale: float, start_s: float, prompt_scale: float, max_prompt: int,
                max_output: int, max_model_len: int) -> Any:
    """``minutes`` of wall time: the trace window [start, start + minutes x 60 x rate_scale) compressed
    ``rate_scale`` times (every request of the window kept, in order), prompts scaled by ``prompt_scale``
    (the trace's code prompts, ~2k tokens, would saturate the tiny model's prefill at a few requests per
    second; scaling keeps the shape of their distribution, clipping would not), lengths clipped to fit."""
    from rayscale.sim.trace import Trace, load_trace

    span = minutes * 60.0 * rate_scale
    tr = load_trace(TRACE).window(start_s, start_s + span).compress(rate_scale)
    prompt = np.maximum(np.round(tr.prompt_tokens * prompt_scale), 1).astype(np.int64)
    tr = Trace.from_arrays(tr.arrival_s, prompt, tr.output_tokens, f"{tr.name}|prompt x{prompt_scale:g}")
    # At least 2 output tokens: every request then has a TPOT in both paths.
    return tr.clip_tokens(max_prompt=max_prompt, max_output=max_output, min_output=2, max_total=max_model_len)


# --- real engine -----------------------------------------------------------------------------------------


@dataclass
class Observed:
    """Per-request results of one path, indexed like the trace; NaN where a request failed."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    t_fin_s: np.ndarray  # from the replay start
    failed: int
    lag_s: np.ndarray | None = None  # real path: how late the client sent each request


async def replay(engine: Any, tr: Any, seed: int, timeout_s: float) -> Observed:
    from tqdm import tqdm

    from rayscale.engines.calibrate import random_prompt, stream_request

    vocab = int(engine.model_config.get_vocab_size())
    rng = np.random.default_rng(seed)
    n = len(tr)
    prompts = [random_prompt(rng, int(p), vocab) for p in tr.prompt_tokens]  # built before the clock starts
    out = tr.output_tokens.tolist()
    arr = tr.arrival_s.tolist()
    ttft, tpot, tfin, lag = (np.full(n, np.nan) for _ in range(4))
    failed = 0
    bar = tqdm(total=n, unit="req", desc="real engine", leave=False, mininterval=1.0)
    t0 = time.perf_counter() + 0.2

    async def one(i: int) -> None:
        nonlocal failed
        sched = t0 + arr[i]
        await asyncio.sleep(max(0.0, sched - time.perf_counter()))
        lag[i] = time.perf_counter() - sched
        try:
            st = await stream_request(engine, prompts[i], out[i], timeout_s)
        except (TimeoutError, RuntimeError) as e:
            failed += 1
            log(f"request {i} failed: {e}")
            return
        finally:
            bar.update(1)
        ttft[i] = st[0][0] - sched
        tpot[i] = (st[-1][0] - st[0][0]) / (out[i] - 1)
        tfin[i] = st[-1][0] - t0

    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), tr.duration_s + DRAIN_S)
    finally:
        bar.close()
    return Observed(ttft, tpot, tfin, failed, lag)


# --- simulator -------------------------------------------------------------------------------------------


# Report name -> EngineConfig.model.
VARIANTS = {"sim (fluid)": "fluid", "sim (iteration)": "iteration"}


def simulate(tr: Any, profile: Any, max_num_batched_tokens: int, model: str, tick_s: float) -> Observed:
    """One replica from t = 0 and no controller: the simulator's engine model ``model`` stepped directly."""
    from rayscale.sim.engine import DONE, EngineConfig, make_engine

    cfg = EngineConfig(tick_s=tick_s, model=model, max_num_batched_tokens=max_num_batched_tokens)
    eng = make_engine(tr.arrival_s, tr.prompt_tokens, tr.output_tokens, cfg, max_kv_tokens=profile.kv_tokens)
    eng.add_replica(profile, 0)
    n, t, end = len(tr), 0.0, tr.duration_s + DRAIN_S
    while t < end and (eng.in_flight or eng.q_head < n):
        eng.step(t, tick_s)
        t += tick_s
    done = eng.status == DONE
    return Observed(
        np.where(done, eng.ttft, np.nan).astype(np.float64),
        np.where(done, eng.tpot, np.nan).astype(np.float64),
        np.where(done, eng.t_fin, np.nan),
        int((~done).sum()),
    )


# --- report ------------------------------------------------------------------------------------------------


def pcts(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if not len(x):
        return float("nan"), float("nan")
    p50, p95 = np.percentile(x, [50, 95])
    return float(p50), float(p95)


def in_flight(tr: Any, o: Observed) -> float:
    """Mean requests in the engine (queued or running) over the replay, by Little's law."""
    ok = np.isfinite(o.t_fin_s)
    end = float(np.nanmax(o.t_fin_s)) if ok.any() else 0.0
    return float(np.sum(o.t_fin_s[ok] - tr.arrival_s[ok]) / end) if end > 0 else float("nan")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def err(sim: float, real: float) -> float:
    return (sim - real) / real


def errors(sim: Observed, real: Observed) -> list[str]:
    """(sim - real) / real of TTFT p50, TTFT p95, TPOT p50, TPOT p95, formatted."""
    return [f"{err(pcts(getattr(sim, a))[k], pcts(getattr(real, a))[k]):+.1%}" for a in ("ttft_s", "tpot_s")
            for k in (0, 1)]


def comparison(real: Observed, sims: dict[str, Observed]) -> tuple[str, dict[str, bool]]:
    metrics = [("TTFT p50 (ms)", "ttft_s", 0), ("TTFT p95 (ms)", "ttft_s", 1),
               ("TPOT p50 (ms)", "tpot_s", 0), ("TPOT p95 (ms)", "tpot_s", 1)]  # fmt: skip
    headers = ["metric", "real vLLM"]
    for name in sims:
        headers += [name, "error"]
    rows, ok = [], dict.fromkeys(sims, True)
    for label, attr, k in metrics:
        r = pcts(getattr(real, attr))[k]
        row: list[Any] = [label, ms(r)]
        for name, s in sims.items():
            v = pcts(getattr(s, attr))[k]
            e = err(v, r)
            ok[name] &= abs(e) <= GOAL
            row += [ms(v), f"{e:+.1%}"]
        rows.append(row)
    return md_table(headers, rows), ok


def reproducibility(raw: dict[str, Any], real: Observed) -> list[str]:
    """Report lines for ``--real-repeats``: the later replays against the first, as the simulator is."""
    again = raw.get("real_again") or []
    if not again:
        return []
    reps = {f"real, replay {i + 2}": Observed(**{k: np.asarray(r[k], dtype=np.float64)
                                                 for k in ("ttft_s", "tpot_s", "t_fin_s", "lag_s")},
                                              failed=r["failed"]) for i, r in enumerate(again)}  # fmt: skip
    tab, _ = comparison(real, reps)
    return ["The same replay again on the same engine, back to back (`--real-repeats`), against the first: the "
            "real engine's own spread on this machine, a floor under any model's error.\n", tab + "\n"]


def plot(real: Observed, sims: dict[str, Observed], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {"real vLLM": real, **sims}
    styles = {"real vLLM": dict(color="k", lw=2.2)}
    for i, (attr, label) in enumerate((("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"))):
        for name, o in series.items():
            x = np.sort(getattr(o, attr)[np.isfinite(getattr(o, attr))]) * 1e3
            if len(x):
                ax[i].plot(x, np.arange(1, len(x) + 1) / len(x), label=name, **styles.get(name, dict(lw=1.4)))
        ax[i].set_xscale("log")
        ax[i].set_xlabel(label)
        ax[i].set_ylabel("fraction of requests")
        for q in (0.5, 0.95):
            ax[i].axhline(q, color="grey", lw=0.6, ls=":")
        ax[i].grid(alpha=0.3, which="both")
        ax[i].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions() -> dict[str, str]:
    import ray
    import torch
    import vllm

    return {"ray": ray.__version__, "vllm": vllm.__version__, "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def profile_yaml(p: Any) -> str:
    """The profiles.yaml entry, in that file's two-line flow style; the optional prefill terms only when set
    (0 is their default, and most profiles have not measured them)."""
    extra = "".join(f"{k}: {getattr(p, k):g}, " for k in ("prefill_quadratic_s", "prefill_seq_s", "prefill_iteration_s")
                    if getattr(p, k))
    return (f"  - {{model: {p.model}, flavor: {p.flavor}, prefill_tokens_per_s: {p.prefill_tokens_per_s:g}, "
            f"overhead_s: {p.overhead_s:g}, {extra}itl_alpha_s: {p.itl_alpha_s:g}, itl_beta_s: {p.itl_beta_s:g}, "
            f"max_num_seqs: {p.max_num_seqs}, "
            + (f"max_num_batched_tokens: {p.max_num_batched_tokens}, " if p.max_num_batched_tokens else "")
            + f"kv_tokens: {p.kv_tokens}, startup_s: {p.startup_s:g},\n"
            f"     source: {json.dumps(p.source)}}}\n")


def write_profile(p: Any, path: Path = PROFILES) -> None:
    """Replace the (model, flavor) entry of profiles.yaml, then check that the catalog still loads."""
    from rayscale.config import load_catalog

    text = path.read_text()
    pat = re.compile(rf"^  - \{{model: {re.escape(p.model)}, flavor: {re.escape(p.flavor)},.*\n\s+source: .*\}}\n",
                     re.MULTILINE)
    new, k = pat.subn(lambda _m: profile_yaml(p), text)
    if k != 1:
        raise SystemExit(f"{path}: expected one {p.model}/{p.flavor} entry, found {k}")
    path.write_text(new)
    load_catalog(profiles=path)


def source_string(raw: dict[str, Any]) -> str:
    """The profile's ``source:``: how to reproduce it, where, when."""
    a = raw["args"]
    return (f"measured: python -m bench.fidelity --minutes {a['minutes']:g} --rate-scale {a['rate_scale']:g} "
            f"(calibration before and after the replay), on a shared {raw.get('cores') or '?'}-core dev machine with "
            f"other work running, vLLM CPU {raw['versions']['vllm']}, {raw.get('date', '?')}")


def caution(raw: dict[str, Any], lag95: float) -> list[str]:
    """A warning when the machine, not the engine, set the pace: the client itself could not send on time,
    or other processes kept more runnable threads than there are cores."""
    cores = int(raw.get("cores") or 0)
    load = max(float(raw[k].split("/")[0]) for k in ("load_before", "load_after"))
    why = []
    if lag95 > MAX_LAG_S:
        why.append(f"the client sent requests up to {ms(lag95)} ms late (p95; > {ms(MAX_LAG_S)} ms)")
    if cores and load > cores:
        why.append(f"the 1-minute load average reached {load:.1f} on {cores} cores")
    if not why:
        return []
    return [f"**Caution: {' and '.join(why)}. Other work competed with the engine for the cores, and not the "
            "same way during calibration and replay; the errors below then measure the machine more than the "
            "model. Re-run on a quiet machine.**\n"]


ANALYSIS = """## Where the engine models and vLLM differ structurally

- **Fluid vs iteration.** The fluid model (the simulator's default, a compiled pass per tick, fast enough for
  day-long runs) shares a replica's prefill rate among its prompts within a tick and charges decode for
  it, a whole `max_num_batched_tokens` chunk per iteration when the tick's prefill backlog exceeds what
  the tick can clear; prompts finish one after another. The iteration model (`EngineConfig(model=
  "iteration")`, rayscale.sim.iteration) steps vLLM V1's scheduler instead: each iteration serves the
  running decodes first, then waiting prompts FIFO within the token budget (the last one chunked); every
  prompt completed in an iteration gets its first token when that iteration ends, and a request arriving
  mid-iteration waits for the next one. So a burst of prompts shares one long iteration, and the decodes
  running beside it slow down by exactly the prompt tokens pending.
- **Iteration cost.** itl_alpha_s + itl_beta_s d for d decodes, plus 2 prefill_quadratic_s S for their S
  context tokens (decode attention, the quadratic prefill term's per-token counterpart), plus
  prefill_iteration_s when it carries prompt tokens, plus per prompt chunk of k tokens (c already computed) prefill_seq_s + k /
  prefill_tokens_per_s + prefill_quadratic_s (k² + 2kc); an iteration with prompts only starts from
  min(itl_alpha_s + prefill_iteration_s, overhead_s - prefill_seq_s), and the rest of overhead_s is a
  constant client-side latency. The quadratic term is attention, which makes prefill convex
  in the prompt on CPU; a line fitted over 16..1024 tokens was off by up to 3.5 ms. prefill_seq_s is
  measured (the prefill-batch rounds), not fitted to the replay: it sets how much a burst of short prompts
  costs (in an offline trial on an earlier replay, 0 vs 1.3 ms moved the iteration model's TTFT p50 by ~25%).
- **Still not modelled.** *Frontend CPU contention*: the AsyncLLM front end (this process: input
  processing, output handling, streaming), the engine core and the CPU worker share two cores. Calibration
  measures them at low load; under the replay's load the front end's per-request and per-token work takes
  CPU from the engine, which the model's constant client latency and fitted slopes do not follow.
  *Client send lag*: the real client sends late when it is busy (the send-lag percentiles above), and TTFT
  counts from the scheduled arrival; the simulator's arrivals are exact. *Warm-up*: the engine is warmed by
  the calibration, but allocator growth and first-seen shapes during the replay, and the machine's share
  changing between calibration and replay (compare the before/after fits), have no counterpart in the
  simulator. *Fluid model*: it has no iterations, so it charges neither prefill_iteration_s nor decode
  attention.
"""
MAX_LAG_S = 0.010


# --- main ----------------------------------------------------------------------------------------------------

SLICE_ARGS = ("minutes", "rate_scale", "start_s", "prompt_scale", "max_prompt", "max_output")
SENSITIVITY_TICKS_S = (0.002, 0.02, 0.25)


async def measure_all(args: argparse.Namespace, engine_args: dict[str, Any], tr: Any) -> dict[str, Any]:
    """Everything that needs the engine, as plain JSON-able data (the report is rendered from it)."""
    from rayscale.engines.calibrate import CalibrationPlan, measure, start_engine

    t = time.perf_counter()
    engine = start_engine(engine_args)
    up_s = time.perf_counter() - t
    log(f"engine up in {up_s:.1f} s")
    try:
        plan = CalibrationPlan(seed=args.seed)
        before = await measure(engine, plan, progress=log)
        log(f"calibration samples in {before.wall_s:.1f} s; replaying {len(tr)} requests over {tr.duration_s:.0f} s")
        t = time.perf_counter()
        real = await replay(engine, tr, args.seed + 1, timeout_s=tr.duration_s + DRAIN_S)
        replay_s = time.perf_counter() - t
        # The same replay again, back to back: how far the real engine is from itself on this machine.
        again = []
        for i in range(1, args.real_repeats):
            log(f"replay {i + 1}/{args.real_repeats}")
            again.append(await replay(engine, tr, args.seed + 1, timeout_s=tr.duration_s + DRAIN_S))
        # Measured again after the replay: on a shared machine the two differ when other load came or went,
        # and the fit uses both, so that it describes the machine the replay ran on.
        after = await measure(engine, replace(plan, seed=args.seed + 2, warmup_requests=0), progress=log)
    finally:
        engine.shutdown()
    assert before.limits is not None

    def floats(a: np.ndarray | None) -> list[float]:
        return [] if a is None else [float(x) for x in a]

    return {
        "engine_up_s": up_s,
        "plan": asdict(plan),
        "samples": {"ttft": before.ttft + after.ttft, "itl": before.itl + after.itl,
                    "prefill_batch": before.prefill_batch + after.prefill_batch,
                    "prefill_batch_dropped": before.prefill_batch_dropped + after.prefill_batch_dropped,
                    **{k: {"ttft": x.ttft, "itl": x.itl, "prefill_batch": x.prefill_batch,
                           "prefill_batch_dropped": x.prefill_batch_dropped} for k, x in (("before", before),
                                                                                          ("after", after))},
                    "limits": asdict(before.limits), "wall_s": before.wall_s + after.wall_s},
        "real": {"ttft_s": floats(real.ttft_s), "tpot_s": floats(real.tpot_s), "t_fin_s": floats(real.t_fin_s),
                 "lag_s": floats(real.lag_s), "failed": real.failed, "wall_s": replay_s},
        "real_again": [{"ttft_s": floats(o.ttft_s), "tpot_s": floats(o.tpot_s), "t_fin_s": floats(o.t_fin_s),
                        "lag_s": floats(o.lag_s), "failed": o.failed} for o in again],
    }  # fmt: skip


def _tuples(xs: list[Any]) -> list[tuple[int, float]]:
    return [(int(a), float(b)) for a, b in xs]


def calibrate_part(part: dict[str, Any], batch_prompt_tokens: int) -> Any:
    """The fit of one set of samples; without prefill-batch samples (raw files from before them)
    prefill_seq_s is 0."""
    from rayscale.engines.calibrate import fit_profile_params

    pb = part.get("prefill_batch")
    return fit_profile_params(_tuples(part["ttft"]), _tuples(part["itl"]), None if pb is None else _tuples(pb),
                              batch_prompt_tokens)


@dataclass(frozen=True)
class _Fit:
    """What render needs of one calibration: the samples, the engine's limits and the profile fitted on both."""

    raw: dict[str, Any]
    tr: Any
    lim: Any
    n_pb: int
    cal: Any
    profile: Any
    real: Observed


def _fit(raw: dict[str, Any]) -> _Fit:
    from rayscale.engines.calibrate import (
        TINY_MAX_MODEL_LEN,
        CalibrationPlan,
        EngineLimits,
        calibrated_profile,
    )

    a, sm, rr = raw["args"], raw["samples"], raw["real"]
    tr = trace_slice(**{k: a[k] for k in SLICE_ARGS}, max_model_len=TINY_MAX_MODEL_LEN)
    lim = EngineLimits(**sm["limits"])
    n_pb = int(raw["plan"].get("prefill_batch_prompt_tokens", CalibrationPlan.prefill_batch_prompt_tokens))
    cal = calibrate_part(sm, n_pb)
    real = Observed(**{k: np.asarray(rr[k], dtype=np.float64) for k in ("ttft_s", "tpot_s", "t_fin_s", "lag_s")},
                    failed=rr["failed"])
    return _Fit(raw, tr, lim, n_pb, cal, calibrated_profile(cal, lim, source_string(raw)), real)


def _sims(f: _Fit, profile: Any, tick: float) -> dict[str, Observed]:
    return {name: simulate(f.tr, profile, f.lim.max_num_batched_tokens, model, tick)
            for name, model in VARIANTS.items()}  # fmt: skip


def _fit_table(f: _Fit) -> str:
    """The fitted profile's parameters, each with what it was fitted from."""
    profile, cal, lim, n_pb = f.profile, f.cal, f.lim, f.n_pb
    tf, itf, bf = cal.ttft_fit, cal.itl_fit, cal.batch_fit
    held = f" (fit held {' and '.join(tf.held_at_zero)} at 0)" if tf.constrained else ""
    if bf is not None:
        assert cal.prefill_seq_raw_s is not None
        seq_from = (f"prefill-batch slope {bf.slope * 1e3:.3f} ms/prompt - n/R - q n² at n = {n_pb}"
                    + (f"; {cal.prefill_seq_clip} from {cal.prefill_seq_raw_s * 1e3:+.3f} ms"
                       if cal.prefill_seq_clip else ""))  # fmt: skip
        seq_r2 = f"{bf.r2:.4f}"
    else:
        seq_from, seq_r2 = "not measured (raw file from before the prefill-batch measurement): 0", ""
    rows: list[list[Any]] = [
        ["overhead_s", f"{profile.overhead_s * 1e3:.2f} ms", "TTFT at 0 prompt tokens, batch 1" + held,
         f"{tf.r2:.4f}"],
        ["prefill_tokens_per_s", f"{profile.prefill_tokens_per_s:.0f}", "1 / TTFT linear coefficient", ""],
        ["prefill_quadratic_s", f"{profile.prefill_quadratic_s:.3g} s/token²", "TTFT quadratic coefficient", ""],
        ["prefill_seq_s", f"{profile.prefill_seq_s * 1e3:.3f} ms", seq_from, seq_r2],
        ["prefill_iteration_s", f"{profile.prefill_iteration_s * 1e3:.3f} ms",
         "prefill-batch base - itl_s(1)" if bf is not None else "not measured: 0", ""],
        ["itl_alpha_s", f"{profile.itl_alpha_s * 1e3:.3f} ms", "ITL intercept", f"{itf.r2:.4f}"],
        ["itl_beta_s", f"{profile.itl_beta_s * 1e3:.4f} ms", "ITL slope per running sequence", ""],
        ["max_num_seqs", profile.max_num_seqs, "engine scheduler config", ""],
        ["kv_tokens", profile.kv_tokens, f"engine: {lim.kv_blocks} KV blocks x {lim.block_size} tokens", ""],
    ]  # fmt: skip
    return md_table(["parameter", "value", "from", "R²"], rows)


def _sample_tables(f: _Fit) -> tuple[str, str]:
    """The TTFT and ITL medians per x against their fits."""
    sm, tf, itf = f.raw["samples"], f.cal.ttft_fit, f.cal.itl_fit
    ttft_tab = md_table(
        ["prompt tokens", "samples", "median TTFT (ms)", "quadratic fit (ms)", "residual (ms)"],
        [[int(x), sum(1 for p, _ in sm["ttft"] if p == x), ms(y), ms(tf(x)), f"{r * 1e3:+.2f}"]
         for x, y, r in zip(tf.x, tf.y, tf.residuals, strict=True)])  # fmt: skip
    itl_tab = md_table(
        ["running batch", "samples", "median ITL (ms)", "fit (ms)", "residual (ms)"],
        [[int(x), sum(1 for b, _ in sm["itl"] if b == x), f"{y * 1e3:.3f}", f"{itf(x) * 1e3:.3f}",
          f"{r * 1e3:+.3f}"] for x, y, r in zip(itf.x, itf.y, itf.residuals, strict=True)])  # fmt: skip
    return ttft_tab, itl_tab


_NO_BATCH = ("**This raw file predates the prefill-batch measurement: prefill_seq_s is not measured and is 0** "
             "(the iteration model then charges a prompt only its tokens, and puts all of overhead_s outside the "
             "engine). Re-run the benchmark to measure it.\n")


def _batch_section(f: _Fit) -> tuple[str, str]:
    """The prefill-batch rounds: their table and the text that says how they were taken and kept."""
    sm, plan, cal, n_pb, bf = f.raw["samples"], f.raw["plan"], f.cal, f.n_pb, f.cal.batch_fit
    if bf is None:
        return "", _NO_BATCH
    dropped = [(int(k), str(w)) for k, w in sm.get("prefill_batch_dropped", [])]
    batch_tab = md_table(
        ["prompts k", "samples", "dropped", "median iteration (ms)", "fit (ms)", "residual (ms)"],
        [[int(x), sum(1 for k, _ in sm["prefill_batch"] if k == x), sum(1 for k, _ in dropped if k == x),
          f"{y * 1e3:.3f}", f"{bf(x) * 1e3:.3f}", f"{r * 1e3:+.3f}"]
         for x, y, r in zip(bf.x, bf.y, bf.residuals, strict=True)])  # fmt: skip
    reasons: dict[str, int] = {}
    for _, w in dropped:
        reasons[w] = reasons.get(w, 0) + 1
    n_rounds = len(sm["prefill_batch"]) + len(dropped)
    itl1 = cal.itl_fit(1)
    batch_text = (
        f"Prefill batch: a blocker request ({plan['blocker_prompt_tokens']} prompt tokens, 2 output tokens), "
        f"then {plan['blocker_lead_s'] * 1e3:g} ms later k requests of {n_pb} prompt tokens and 1 output "
        "token, sent without waiting between them: they reach the engine core while the blocker's prefill "
        "runs, and vLLM V1 schedules them all in the next iteration, after the blocker's decode token. The "
        "sample is the median of their first-token times minus the blocker's first token, on the engine core's "
        "clock (vLLM's per-request stats; the client's clock mixed in its own delays); a round counts only "
        "when the k first tokens and the blocker's second lie within "
        f"{plan['prefill_batch_max_spread']:.2g} of that time of each other. k in "
        f"{tuple(plan['prefill_batch_sizes'])}, {plan['prefill_batch_repeats']} rounds each, interleaved. "
        f"Dropped: {len(dropped)} of {n_rounds} rounds"
        + (" (" + "; ".join(f"{w}: {c}" for w, c in sorted(reasons.items())) + ")" if reasons else "")
        + f". Fit: iteration(k) = {bf.intercept * 1e3:.3f} ms + k x {bf.slope * 1e3:.3f} ms. Consistency: the "
        f"base should be one decode's iteration, itl_s(1) = {itl1 * 1e3:.3f} ms "
        f"({bf.intercept / itl1 - 1:+.0%}); the slope is prefill_seq_s + n/R ({n_pb / cal.prefill_tokens_per_s * 1e3:.3f} ms) "
        f"+ q n² ({cal.prefill_quadratic_s * n_pb**2 * 1e3:.3f} ms).\n"
    )  # fmt: skip
    return batch_tab, batch_text


def _by_calibration(f: _Fit, sim_tick_s: float) -> tuple[str, str]:
    """Each calibration alone: its fit (how much the machine changed between them), and the same replay
    simulated with it (how much of the error is that change rather than the model)."""
    from rayscale.engines.calibrate import CalibrationError, calibrated_profile

    sm, drift_rows, by_cal_rows = f.raw["samples"], [], []
    for label, part in (("before the replay", sm.get("before")), ("after the replay", sm.get("after")),
                        ("both (used)", sm)):
        if not part or not part["ttft"]:
            continue
        try:
            c = calibrate_part(part, f.n_pb)
            p_part = calibrated_profile(c, f.lim, source_string(f.raw))
        except CalibrationError as e:
            drift_rows.append([label, f"no fit: {e}", "", "", "", "", ""])
            continue
        seq = ("not measured" if c.batch_fit is None else f"{c.prefill_seq_s * 1e3:.3f}"
               + (f" ({c.prefill_seq_clip} from {c.prefill_seq_raw_s * 1e3:+.3f})" if c.prefill_seq_clip else ""))
        drift_rows.append([label, f"{c.overhead_s * 1e3:.2f}", f"{c.prefill_tokens_per_s:.0f}",
                           f"{c.prefill_quadratic_s * 1e9:.1f}", seq, f"{c.itl_alpha_s * 1e3:.3f}",
                           f"{c.itl_beta_s * 1e3:.4f}"])  # fmt: skip
        by_cal_rows += [[label, name, *errors(s, f.real)] for name, s in _sims(f, p_part, sim_tick_s).items()]
    drift_tab = md_table(["calibration", "overhead (ms)", "prefill tokens/s", "q (ns/token²)", "prefill_seq (ms)",
                          "ITL alpha (ms)", "ITL beta (ms)"], drift_rows)  # fmt: skip
    by_cal_tab = md_table(["calibration", "variant", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95"], by_cal_rows)
    return drift_tab, by_cal_tab


def _sensitivity(f: _Fit, sims: dict[str, Observed], sim_tick_s: float) -> str:
    """How much the answer depends on the simulator's tick (the fluid model is a fluid model per tick; the
    iteration model's tick only batches its admissions)."""
    rows = []
    for tick in SENSITIVITY_TICKS_S:
        for name, s in (sims if tick == sim_tick_s else _sims(f, f.profile, tick)).items():
            rows.append([f"{tick * 1e3:g}", name, *errors(s, f.real), f"{in_flight(f.tr, s):.2f}"])
    return md_table(["tick (ms)", "variant", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "mean in engine"],
                    rows)


def _calibration_lines(f: _Fit, drift_tab: str) -> list[str]:
    """The report's title, provenance and calibration section."""
    raw, lim = f.raw, f.lim
    a, sm, rr, plan, v = raw["args"], raw["samples"], raw["real"], raw["plan"], raw["versions"]
    ttft_tab, itl_tab = _sample_tables(f)
    batch_tab, batch_text = _batch_section(f)
    return [
        "# Simulator fidelity: tiny Qwen2 on vLLM CPU vs the simulator's engine models (issue 6)\n",
        f"- command: `{raw['cmd']}` ({raw['wall_s']:.0f} s wall: engine start {raw['engine_up_s']:.0f} s, "
        f"calibration {sm['wall_s']:.0f} s, replay {rr['wall_s']:.0f} s)",
        f"- machine: {raw['machine']}; load average (1/5/15 min) before {raw['load_before']}, after "
        f"{raw['load_after']}",
        *([f"- simulator side re-run on these measurements: {raw['rendered']}"] if raw.get("rendered") else []),
        f"- versions: ray {v['ray']}, vllm {v['vllm']} (CPU build), torch {v['torch']}, python {v['python']}",
        f"- engine: vllm AsyncLLM in the benchmark process (engine core in a child process) with the tiny model's "
        f"serving arguments {json.dumps(raw['engine_args'])}; max_num_batched_tokens {lim.max_num_batched_tokens}, "
        f"chunked prefill {'on' if lim.chunked_prefill else 'off'}, prefix caching at vLLM's default (random "
        "prompts never hit it)\n",
        "## Calibration\n",
        f"TTFT of one request alone (1 output token) at each prompt length, {plan['prefill_repeats']} rounds; "
        f"ITL while b requests ({plan['itl_prompt_tokens']}-token prompts, {plan['itl_output_tokens']} output "
        f"tokens, started together) all decode, at least {plan['itl_repeats']} rounds per b and "
        f"~{plan['itl_min_samples']} requests: per request, tokens over time between the last first token and the "
        "first finish, so the batch is exactly b. Least squares through the medians per x "
        "(`rayscale.engines.calibrate`): TTFT quadratic in the prompt (overhead_s >= 0, prefill_quadratic_s >= 0), "
        f"ITL and prefill-batch iterations linear. Greedy sampling, ignore_eos, random prompt ids from seed "
        f"{a['seed']}. Measured once before and once after the replay and fitted on both; the fits of each alone "
        "show how much the machine changed meanwhile.\n",
        _fit_table(f) + "\n",
        drift_tab + "\n",
        ttft_tab + "\n",
        itl_tab + "\n",
        batch_text,
        *([batch_tab + "\n"] if batch_tab else []),
        "profiles.yaml entry:\n\n```yaml\n" + profile_yaml(f.profile) + "```\n",
    ]  # fmt: skip


def _replay_lines(f: _Fit, sims: dict[str, Observed], sim_tick_s: float, by_cal_tab: str) -> list[str]:
    """The replay section: the slice, how each side ran, and the errors."""
    raw, tr, real, mnbt = f.raw, f.tr, f.real, f.lim.max_num_batched_tokens
    a, st = raw["args"], tr.stats()
    cmp_tab, ok = comparison(real, sims)
    lag50, lag95 = pcts(real.lag_s) if real.lag_s is not None else (float("nan"),) * 2
    conc = {"real vLLM": in_flight(tr, real), **{k: in_flight(tr, v) for k, v in sims.items()}}
    failed = {"real vLLM": real.failed, **{k: v.failed for k, v in sims.items()}}
    verdict = "; ".join(f"**{k}: {'meets' if good else 'misses'}** the ≤ {GOAL:.0%} goal on all four"
                        for k, good in ok.items())
    window = f"[{a['start_s']:g}, {a['start_s'] + a['minutes'] * 60 * a['rate_scale']:g})"
    return [
        "## Replay: real engine vs simulator\n",
        f"Slice: {TRACE.name}, arrivals in {window} s compressed {a['rate_scale']:g}x (`Trace.window(...)"
        f".compress({a['rate_scale']:g})`: every request of the window, in order, at {a['rate_scale']:g} times "
        f"the trace's rate); prompt lengths x {a['prompt_scale']:g} (the shape of the trace's distribution, "
        f"scaled to the tiny engine), clipped to {a['max_prompt']}; outputs clipped to [2, {a['max_output']}]. "
        f"{st.requests} requests over {st.duration_s:.0f} s ({st.rate_per_s:.1f} req/s); prompt tokens mean "
        f"{st.prompt_tokens_mean:.0f} (p50 {st.prompt_tokens_p50:.0f}, p95 {st.prompt_tokens_p95:.0f}), output "
        f"tokens mean {st.output_tokens_mean:.1f} (p50 {st.output_tokens_p50:.0f}, p95 {st.output_tokens_p95:.0f}); "
        f"{np.mean(np.diff(tr.arrival_s) < 0.005):.0%} of inter-arrival gaps under 5 ms.\n",
        "Real: open loop, each request sent at its arrival time to the same AsyncLLM (random prompt ids of the "
        "trace's length, greedy, ignore_eos); TTFT from the scheduled arrival to the first streamed token, "
        f"TPOT = (last - first token) / (output - 1). Client send lag p50 {ms(lag50)} ms, p95 {ms(lag95)} ms. "
        "Simulator: `rayscale.sim.engine.make_engine`, one replica with the profile above from t = 0, no "
        f"controller, tick {sim_tick_s * 1e3:g} ms. \"sim (fluid)\" is `EngineConfig(max_num_batched_tokens={mnbt})`, "
        "the simulator's default engine model: per tick, a replica's prompts share its prefill rate and take "
        "engine time from decode (chunked prefill). \"sim (iteration)\" is `EngineConfig(model=\"iteration\", "
        f"max_num_batched_tokens={mnbt})`: vLLM V1's scheduler one engine iteration at a time, with the "
        "iteration cost of the profile (next section).\n",
        *caution(raw, lag95),
        cmp_tab + "\n",
        "Mean requests in the engine (Little's law): " + ", ".join(f"{k} {x:.2f}" for k, x in conc.items())
        + "; failed: " + ", ".join(f"{k} {x}" for k, x in failed.items()) + ".\n",
        verdict + ".\n",
        *reproducibility(raw, real),
        "Error (sim - real) / real with each calibration alone (the machine's speed between them is in the "
        "drift table above):\n",
        by_cal_tab + "\n",
        "Error (sim - real) / real by simulator tick:\n",
        _sensitivity(f, sims, sim_tick_s) + "\n",
    ]  # fmt: skip


def render(raw: dict[str, Any], out: str | None, plot_path: str | None, sim_tick_s: float,
           update_profiles: bool) -> str:
    f = _fit(raw)
    sims = _sims(f, f.profile, sim_tick_s)
    drift_tab, by_cal_tab = _by_calibration(f, sim_tick_s)
    lines = _calibration_lines(f, drift_tab) + _replay_lines(f, sims, sim_tick_s, by_cal_tab)
    if plot_path:
        png, a, st = Path(plot_path), raw["args"], f.tr.stats()
        plot(f.real, sims, png, f"{st.requests} requests of {TRACE.name} ({a['rate_scale']:g}x): tiny Qwen2 on "
             f"vLLM CPU vs simulator (tick {sim_tick_s * 1e3:g} ms)")
        lines.append(f"![TTFT and TPOT CDFs, real vs simulated]({png.name})\n")
    lines.append(ANALYSIS)
    text = "\n".join(lines)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        log(f"wrote {out}")
    if update_profiles:
        write_profile(f.profile)
        log(f"updated {PROFILES.relative_to(ROOT)}")
    return text


def main(argv: list[str] | None = None) -> int:
    from rayscale.engines.calibrate import TINY_MAX_MODEL_LEN, tiny_engine_args
    from rayscale.sim.engine import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown report here")
    ap.add_argument("--plot", help="write the TTFT/TPOT CDF plot (PNG) here")
    ap.add_argument("--minutes", type=float, default=2.0, help="wall minutes of replay (default 2)")
    ap.add_argument("--rate-scale", type=float, default=6.0,
                    help="time compression of the trace slice: X times its request rate, same requests (default 6)")
    ap.add_argument("--start-s", type=float, default=0.0, help="slice start, seconds into the trace (default 0)")
    ap.add_argument("--prompt-scale", type=float, default=0.125, help="prompt lengths times this (default 1/8)")
    ap.add_argument("--max-prompt", type=int, default=1024, help="prompt tokens clipped to this (default 1024)")
    ap.add_argument("--max-output", type=int, default=128, help="output tokens clipped to this (default 128)")
    ap.add_argument("--sim-tick-s", type=float, default=EngineConfig().tick_s,
                    help="simulator tick (default: the simulator's own, %(default)s s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real-repeats", type=int, default=1,
                    help="replay the slice this many times on the real engine, back to back (default 1)")
    ap.add_argument("--raw", default=os.path.join(tempfile.gettempdir(), "fidelity.raw.json"),
                    help="measurements are saved here (default %(default)s)")
    ap.add_argument("--from-raw", action="store_true", help="only re-render the report from --raw")
    ap.add_argument("--write-profile", action="store_true",
                    help=f"replace the tiny-qwen2/cpu entry of {PROFILES.relative_to(ROOT)} with the measured one")
    args = ap.parse_args(argv)
    raw_path = Path(args.raw)
    if args.from_raw:
        raw = json.loads(raw_path.read_text())
        cmd = ".venv/bin/python -m bench.fidelity " + " ".join(argv if argv is not None else sys.argv[1:])
        raw["rendered"] = f"`{cmd.strip()}` with rayscale git {git_state()}, {time.strftime('%Y-%m-%d')}"
    else:
        t0 = time.perf_counter()
        cmd = ".venv/bin/python -m bench.fidelity " + " ".join(argv if argv is not None else sys.argv[1:])
        temp_dir = tempfile.mkdtemp(prefix="rs-fidelity-", dir="/tmp")
        # The tiny model and vLLM's scratch files in a private dir (other sessions share this machine).
        os.environ.setdefault("RAYSCALE_CACHE_DIR", os.path.join(temp_dir, "cache"))
        os.environ["TMPDIR"] = temp_dir
        load_before = loadavg()
        try:
            engine_args = tiny_engine_args()
            tr = trace_slice(**{k: getattr(args, k) for k in SLICE_ARGS}, max_model_len=TINY_MAX_MODEL_LEN)
            if not len(tr):
                raise SystemExit("the trace slice is empty")
            raw = asyncio.run(measure_all(args, engine_args, tr))
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raw.update(
            cmd=cmd.strip(), args={k: getattr(args, k) for k in (*SLICE_ARGS, "seed")}, machine=machine(),
            load_before=load_before, load_after=loadavg(), versions=versions(),
            engine_args={k: x for k, x in engine_args.items() if k != "model"},
            date=time.strftime("%Y-%m-%d"), wall_s=time.perf_counter() - t0, cores=os.cpu_count(),
        )  # fmt: skip
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(json.dumps(raw))
        log(f"raw measurements in {raw_path}")
    print(render(raw, args.out, args.plot, args.sim_tick_s, args.write_profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
