"""Calibrate a latency profile (rayscale.core.catalog.Profile) on the real vLLM engine.

Three layers, kept apart so that the fit can be tested without an engine:

- :func:`fit_profile_params`, pure: least-squares fits through measured samples,
  TTFT(prompt) = overhead_s + prompt / prefill_tokens_per_s + prefill_quadratic_s x prompt^2 at batch 1,
  ITL(batch) = itl_alpha_s + itl_beta_s x batch, and the time of one engine iteration that prefills k
  prompts together, whose slope in k beyond the prompts' own prefill is the per-prompt cost prefill_seq_s;
- :func:`measure`, async I/O: drives a vLLM ``AsyncLLM`` in this process (warm-up, random prompts from a
  fixed seed, ``ignore_eos`` so that every request yields exactly ``max_tokens``) and returns raw samples;
- :func:`calibrated_profile`: the fit plus the engine's actual limits (max_num_seqs, KV capacity) as a
  validated ``Profile``.

``python -m bench.fidelity`` runs all three on the builtin tiny Qwen2 model and then checks the profile by
replaying a trace slice through both the engine and the simulator.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from rayscale.core.catalog import Profile
from rayscale.engines.vllm_engine import CPU_ENGINE_DEFAULTS, resolve_source

if TYPE_CHECKING:
    # vLLM's public name for its engine (vllm.AsyncLLMEngine is vllm.v1.engine.async_llm.AsyncLLM).
    from vllm import AsyncLLMEngine as AsyncLLM

TINY_SOURCE = "builtin:tiny-qwen2"
# The tiny model's served context (ModelDeployment's default, deployments/local-tiny.yaml).
TINY_MAX_MODEL_LEN = 2048
# Token ids 0..2 are the tokenizer's special tokens; random prompts stay clear of them.
FIRST_PLAIN_TOKEN = 3


class CalibrationError(ValueError):
    """The samples cannot give a usable profile (too few points, a slope of the wrong sign, ...)."""


# --- pure fitting --------------------------------------------------------------------------------------


def _medians(x: Sequence[float], y: Sequence[float], what: str, min_points: int, shape: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """Distinct x ascending and the median y at each; loud about what cannot be fitted."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise CalibrationError(f"{what}: x and y must be 1-d and of equal length, got {xs.shape} and {ys.shape}")
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
        raise CalibrationError(f"{what}: samples must be finite")
    ux = np.unique(xs)
    if len(ux) < min_points:
        raise CalibrationError(
            f"{what}: need samples at >= {min_points} distinct x values to fit a {shape}, got {len(ux)} "
            f"({ux.tolist()})"
        )
    return ux, np.array([float(np.median(ys[xs == v])) for v in ux])


def _r2(my: np.ndarray, res: np.ndarray) -> float:
    ss_tot = float(np.sum((my - my.mean()) ** 2))
    return 1.0 - float(np.sum(res**2)) / ss_tot if ss_tot > 0 else 0.0


@dataclass(frozen=True)
class LineFit:
    """y = intercept + slope x, by ordinary least squares through the per-x medians."""

    intercept: float
    slope: float
    r2: float
    x: tuple[float, ...]  # distinct x values, ascending
    y: tuple[float, ...]  # median y at each x
    residuals: tuple[float, ...]  # y - fit at each x
    constrained: bool = False  # the unconstrained intercept was negative: refit with intercept 0

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class QuadFit:
    """y = intercept + slope x + quad x^2, least squares through the per-x medians, intercept >= 0, quad >= 0
    (:func:`fit_quadratic`)."""

    intercept: float
    slope: float
    quad: float
    r2: float
    x: tuple[float, ...]  # distinct x values, ascending
    y: tuple[float, ...]  # median y at each x
    residuals: tuple[float, ...]  # y - fit at each x
    held_at_zero: tuple[str, ...] = ()  # "intercept" / "quad": held at 0 to keep the fit feasible

    @property
    def constrained(self) -> bool:
        return bool(self.held_at_zero)

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x + self.quad * x * x


@dataclass(frozen=True)
class Calibration:
    """Fitted latency parameters, with the fits they come from."""

    overhead_s: float
    prefill_tokens_per_s: float
    itl_alpha_s: float
    itl_beta_s: float
    ttft_fit: QuadFit  # x: prompt tokens, y: TTFT s (batch 1)
    itl_fit: LineFit  # x: running batch, y: inter-token latency s
    prefill_quadratic_s: float = 0.0
    prefill_seq_s: float = 0.0  # 0 without prefill-batch samples
    # x: prompts prefilled together (batch_prompt_tokens each), y: that engine iteration's time s.
    batch_fit: LineFit | None = None
    batch_prompt_tokens: int = 0
    prefill_seq_raw_s: float | None = None  # before clipping to [0, overhead_s]
    prefill_seq_clip: str = ""  # "", "raised to 0" or "capped at overhead_s"
    # The prefill-batch line's base over itl_s(1) (its iteration also carries one decode), at least 0.
    prefill_iteration_s: float = 0.0


def fit_line(
    x: Sequence[float], y: Sequence[float], what: str, min_points: int = 3, nonneg_intercept: bool = False
) -> LineFit:
    """Least squares through the median y of each distinct x.

    Medians per x, not every sample: on a shared machine a single slow sample should not tilt the line.
    At least ``min_points`` distinct x are required (two points always fit exactly and say nothing).
    With ``nonneg_intercept`` the fit is constrained to intercept >= 0: the objective is convex, so when the
    free intercept comes out negative the constrained optimum is the line through the origin.
    """
    ux, my = _medians(x, y, what, min_points, "line")
    a = np.column_stack([np.ones_like(ux), ux])
    (intercept, slope), *_ = np.linalg.lstsq(a, my, rcond=None)
    constrained = bool(nonneg_intercept and intercept < 0)
    if constrained:
        intercept, slope = 0.0, float(ux @ my / (ux @ ux))
    res = my - (intercept + slope * ux)
    return LineFit(float(intercept), float(slope), _r2(my, res), tuple(ux.tolist()), tuple(my.tolist()),
                   tuple(res.tolist()), constrained)  # fmt: skip


def fit_quadratic(x: Sequence[float], y: Sequence[float], what: str, min_points: int = 3) -> QuadFit:
    """Least squares y = a + b x + c x^2 through the per-x medians, with a >= 0 and c >= 0.

    Quadratic because prefill is convex in the prompt on CPU (attention): a line fitted over 16..1024
    tokens was off by +-1.5-3.5 ms and pulled the intercept (overhead_s) down. The objective is convex,
    so the constrained optimum is the best feasible one among the fits with each subset of {a, c} held
    at 0 (the free fit first: when it is feasible it is the answer).

    When that optimum has b <= 0 the line (c = 0, a >= 0) is taken instead if its slope is positive: a
    hockey stick (TTFT flat for short prompts on a small model, then convex) fits best with b < 0, which
    leaves no prefill rate, yet every prompt token costs something. A b <= 0 that remains (TTFT falling with
    the prompt) is returned for the caller to refuse.
    """
    ux, my = _medians(x, y, what, min_points, "quadratic")
    scale = float(np.max(np.abs(ux))) or 1.0  # columns of comparable size: x^2 reaches ~1e6 tokens^2
    u = ux / scale
    cols = {"intercept": np.ones_like(u), "slope": u, "quad": u * u}

    def solve(held: tuple[str, ...]) -> tuple[float, dict[str, float], tuple[str, ...]]:
        free = [k for k in cols if k not in held]
        sol, *_ = np.linalg.lstsq(np.column_stack([cols[k] for k in free]), my, rcond=None)
        coef = dict.fromkeys(cols, 0.0) | {k: float(v) for k, v in zip(free, sol, strict=True)}
        return float(np.sum((my - sum(coef[k] * cols[k] for k in cols)) ** 2)), coef, held

    best: tuple[float, dict[str, float], tuple[str, ...]] | None = None
    subsets: tuple[tuple[str, ...], ...] = ((), ("quad",), ("intercept",), ("intercept", "quad"))
    for held in subsets:
        fit = solve(held)
        if fit[1]["intercept"] < 0 or fit[1]["quad"] < 0:
            continue
        if best is None or fit[0] < best[0]:
            best = fit
        if not held:
            break
    assert best is not None  # slope alone is always feasible
    if best[1]["slope"] <= 0:
        line = solve(("quad",))
        line = line if line[1]["intercept"] >= 0 else solve(("intercept", "quad"))
        best = line if line[1]["slope"] > 0 else best
    _, coef, held = best
    a, b, c = coef["intercept"], coef["slope"] / scale, coef["quad"] / scale**2
    res = my - (a + b * ux + c * ux * ux)
    return QuadFit(a, b, c, _r2(my, res), tuple(ux.tolist()), tuple(my.tolist()), tuple(res.tolist()), held)


def fit_prefill_seq(
    batch_samples: Sequence[tuple[int, float]], prompt_tokens: int, ttft: QuadFit
) -> tuple[LineFit, float]:
    """The iteration-time line over k (prompts of ``prompt_tokens`` prefilled together) and the per-prompt
    engine cost it implies, unclipped: slope - n / R - q n^2 (R and q from the lone-prompt TTFT fit).

    Why measured this way: a lone prompt's TTFT cannot tell engine time per prompt from client latency
    (both land in overhead_s), but k prompts sharing one iteration pay the engine part k times.
    """
    if prompt_tokens < 1:
        raise CalibrationError(f"prefill batch: prompt_tokens must be >= 1, got {prompt_tokens}")
    bf = fit_line([k for k, _ in batch_samples], [t for _, t in batch_samples], "prefill iteration vs prompts")
    if bf.slope <= 0:
        raise CalibrationError(
            f"prefill iteration vs prompts: slope {bf.slope:.3g} s/prompt is not positive; the prompts did not "
            "share one iteration, or the machine was too noisy"
        )
    n = float(prompt_tokens)
    return bf, bf.slope - n * ttft.slope - ttft.quad * n * n


def fit_profile_params(
    ttft_samples: Sequence[tuple[int, float]],
    itl_samples: Sequence[tuple[int, float]],
    prefill_batch_samples: Sequence[tuple[int, float]] | None = None,
    batch_prompt_tokens: int = 64,
) -> Calibration:
    """(overhead_s, prefill_tokens_per_s, prefill_quadratic_s) from ``(prompt_tokens, ttft_s)`` measured at
    batch 1, (itl_alpha_s, itl_beta_s) from ``(batch, itl_s)`` measured with ``batch`` requests decoding
    together, and prefill_seq_s from ``(k, iteration_s)`` of k prompts of ``batch_prompt_tokens`` prefilled
    in one iteration (:func:`fit_prefill_seq`; None, as in raw files from before it: prefill_seq_s = 0).
    """
    if not ttft_samples or not itl_samples:
        raise CalibrationError("need both TTFT and ITL samples")
    tf = fit_quadratic([p for p, _ in ttft_samples], [t for _, t in ttft_samples], "TTFT vs prompt tokens")
    if tf.slope <= 0:
        raise CalibrationError(
            f"TTFT vs prompt tokens: slope {tf.slope:.3g} s/token is not positive, so there is no prefill "
            "rate; measure longer prompts (or on a quieter machine)"
        )
    itf = fit_line([b for b, _ in itl_samples], [t for _, t in itl_samples], "ITL vs batch")
    if itf.slope <= 0:
        raise CalibrationError(
            f"ITL vs batch: slope {itf.slope:.3g} s/sequence is not positive; measure larger batches "
            "(or on a quieter machine)"
        )
    if itf.intercept <= 0:
        raise CalibrationError(f"ITL vs batch: intercept {itf.intercept:.3g} s must be positive (itl_alpha_s)")
    seq, bf, raw, clip, pit = 0.0, None, None, "", 0.0
    if prefill_batch_samples is not None:
        if not prefill_batch_samples:
            raise CalibrationError("prefill batch: no samples (every round dropped?)")
        bf, raw = fit_prefill_seq(prefill_batch_samples, batch_prompt_tokens, tf)
        seq = min(max(raw, 0.0), tf.intercept)  # part of the lone prompt's overhead_s (Profile's invariant)
        clip = "raised to 0" if raw < 0 else "capped at overhead_s" if raw > tf.intercept else ""
        # An iteration with prompts and one decode, less the prompts' own cost, against a decode-only one.
        pit = max(bf.intercept - itf(1), 0.0)
    return Calibration(
        overhead_s=tf.intercept,
        prefill_tokens_per_s=1.0 / tf.slope,
        itl_alpha_s=itf.intercept,
        itl_beta_s=itf.slope,
        ttft_fit=tf,
        itl_fit=itf,
        prefill_quadratic_s=tf.quad,
        prefill_seq_s=seq,
        batch_fit=bf,
        batch_prompt_tokens=batch_prompt_tokens if bf is not None else 0,
        prefill_seq_raw_s=raw,
        prefill_seq_clip=clip,
        prefill_iteration_s=pit,
    )


# --- the engine ----------------------------------------------------------------------------------------


def tiny_engine_args(max_model_len: int = TINY_MAX_MODEL_LEN, **overrides: Any) -> dict[str, Any]:
    """vLLM engine arguments of the served tiny model on CPU: the same defaults Serve deploys it with."""
    model, source_kwargs = resolve_source(TINY_SOURCE)
    return {"model": model, **CPU_ENGINE_DEFAULTS, **source_kwargs, "max_model_len": max_model_len, **overrides}


def start_engine(engine_args: dict[str, Any]) -> AsyncLLM:
    """An AsyncLLM in this process (its engine core runs in a child process, spawned)."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**engine_args))


@dataclass(frozen=True)
class EngineLimits:
    """What the running engine was actually configured with (after vLLM's own defaults)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    block_size: int
    kv_blocks: int | None

    @property
    def kv_tokens(self) -> int | None:
        return self.kv_blocks * self.block_size if self.kv_blocks else None


def engine_limits(engine: AsyncLLM) -> EngineLimits:
    cfg = engine.vllm_config
    # The engine core reports its KV block count back to the client at start-up.
    return EngineLimits(
        max_num_seqs=int(cfg.scheduler_config.max_num_seqs),
        max_num_batched_tokens=int(cfg.scheduler_config.max_num_batched_tokens),
        chunked_prefill=bool(getattr(cfg.scheduler_config, "enable_chunked_prefill", False)),
        block_size=int(cfg.cache_config.block_size),
        kv_blocks=int(cfg.cache_config.num_gpu_blocks) if cfg.cache_config.num_gpu_blocks else None,
    )


_ids = itertools.count()


async def stream_request(
    engine: AsyncLLM, prompt_ids: list[int], max_tokens: int, timeout_s: float,
    on_output: Callable[[Any], None] | None = None,
) -> list[tuple[float, int]]:
    """Runs one request; returns ``(perf_counter time, tokens so far)`` at each streamed output, and hands
    each ``RequestOutput`` to ``on_output``.

    Greedy and ``ignore_eos``: the output is exactly ``max_tokens`` long. Aborted after ``timeout_s``.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    rid = f"cal-{next(_ids)}"
    stamps: list[tuple[float, int]] = []

    async def run() -> None:
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), sp, rid):
            stamps.append((time.perf_counter(), len(out.outputs[0].token_ids)))
            if on_output is not None:
                on_output(out)

    try:
        # Cancelling the generator makes AsyncLLM abort the request in the engine core.
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"request {rid} ({len(prompt_ids)} prompt tokens) not done after {timeout_s:g} s") from None
    if not stamps or stamps[-1][1] != max_tokens:
        raise RuntimeError(f"request {rid}: expected {max_tokens} tokens, got {stamps[-1][1] if stamps else 0}")
    return stamps


def random_prompt(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    # Fresh random ids per request: no prefix-cache hits, as with distinct real prompts.
    return rng.integers(FIRST_PLAIN_TOKEN, vocab_size, size=n).tolist()


@dataclass(frozen=True)
class CalibrationPlan:
    """What to measure. The defaults take ~20 s on the tiny model on two cores."""

    # Up to the longest prompt bench.fidelity replays: the curve is fitted where it is used.
    prompt_lens: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    prefill_repeats: int = 7
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    itl_prompt_tokens: int = 16
    itl_output_tokens: int = 64
    itl_repeats: int = 5
    # Small batches get more rounds, so every batch size has about this many per-request samples.
    itl_min_samples: int = 16
    # TTFT probes go out after this idle gap, as arrivals find the engine: sent back to back, they meet its
    # worker threads still spinning and measure ~1-1.5 ms less on the tiny model.
    prefill_gap_s: float = 0.02
    # Prefill batch: k prompts of prefill_batch_prompt_tokens sent while a blocker's prefill runs, so that
    # vLLM schedules all k in the next iteration (with the blocker's first decode); prefill_seq_s is the
    # slope of that iteration's time in k beyond the prompts' own prefill.
    prefill_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    prefill_batch_prompt_tokens: int = 64
    prefill_batch_repeats: int = 7
    blocker_prompt_tokens: int = 512
    # The k go out this long after the blocker, so that the engine core has already scheduled it alone;
    # a few ms of the blocker's ~15 ms prefill.
    blocker_lead_s: float = 0.002
    # A round counts when the k first tokens (and the blocker's second) lie within this fraction of the
    # iteration time of each other: all came out of one iteration.
    prefill_batch_max_spread: float = 1 / 3
    warmup_requests: int = 4
    seed: int = 0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.itl_output_tokens < 8:
            raise ValueError("itl_output_tokens must be >= 8 to leave a steady decode window")
        if min(self.prefill_repeats, self.itl_repeats, self.prefill_batch_repeats) < 1:
            raise ValueError("repeats must be >= 1")
        if not self.prefill_batch_sizes or min(self.prefill_batch_sizes) < 1:
            raise ValueError("prefill_batch_sizes must be non-empty and >= 1")
        if min(self.prefill_batch_prompt_tokens, self.blocker_prompt_tokens) < 1:
            raise ValueError("prefill_batch_prompt_tokens and blocker_prompt_tokens must be >= 1")
        if not 0 < self.prefill_batch_max_spread < 1:
            raise ValueError("prefill_batch_max_spread must be in (0, 1)")


@dataclass
class Samples:
    """Raw measurements: TTFT at batch 1 per prompt length, per-request ITL per batch size, and the time of
    one iteration prefilling k prompts together."""

    ttft: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, TTFT s)
    itl: list[tuple[int, float]] = field(default_factory=list)  # (batch, ITL s)
    prefill_batch: list[tuple[int, float]] = field(default_factory=list)  # (prompts k, iteration s)
    prefill_batch_dropped: list[tuple[int, str]] = field(default_factory=list)  # (k, why) of rounds not used
    limits: EngineLimits | None = None
    wall_s: float = 0.0


def steady_itl(streams: Sequence[list[tuple[float, int]]]) -> list[float]:
    """Per-request inter-token latency while *all* requests of a batch decode together.

    The window runs from the last first token (every prefill done) to the first request's end, so the
    batch is exactly ``len(streams)`` throughout; outputs that carry several tokens count as that many.
    """
    lo = max(s[0][0] for s in streams)
    hi = min(s[-1][0] for s in streams)
    out = []
    for s in streams:
        inside = [(t, n) for t, n in s if lo <= t <= hi]
        if len(inside) >= 2 and inside[-1][1] > inside[0][1]:
            out.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
    return out


def prefill_batch_iteration(
    blocker_first: float, blocker_second: float, firsts: Sequence[float], max_spread: float = 1 / 3
) -> float | str:
    """The time of the iteration that prefilled the k prompts (the median of their first-token times
    ``firsts`` minus the blocker's first token), or why this round does not show one such iteration.

    Checks the assumption rather than trusting it: if some prompt reached the engine too early (it joined
    the blocker's prefill) or too late (a later iteration), the first tokens are spread over iterations, or
    the blocker's second token (its decode, scheduled first in the same iteration) comes apart from them.
    """
    if min(blocker_first, blocker_second, *firsts) <= 0:
        return "engine timestamps missing"
    mid = float(np.median(firsts))
    it = mid - blocker_first
    if it <= 0:
        return "prompts done with the blocker's prefill"
    if max(firsts) - min(firsts) > max_spread * it:
        return "prompts' first tokens spread over iterations"
    if abs(blocker_second - mid) > max_spread * it:
        return "blocker's decode token apart from the prompts"
    return it


def _engine_token_times(out: Any) -> tuple[float, float]:
    """(first, last) token time of a finished request on the engine core's clock: when the engine core
    emitted the outputs of those iterations (vLLM's per-request stats, on unless disable_log_stats).

    The engine's clock, not the client's: the client stamps the blocker's first token while it is still
    busy submitting the k prompts, which moved the measured iteration by several ms either way (down to
    less than one decode iteration).
    """
    m = getattr(out, "metrics", None)
    if m is None or not hasattr(m, "first_token_ts"):
        raise RuntimeError("the prefill-batch measurement needs vLLM's request stats (disable_log_stats=False)")
    return float(m.first_token_ts), float(m.last_token_ts)


async def measure(
    engine: AsyncLLM,
    plan: CalibrationPlan = CalibrationPlan(),
    progress: Callable[[str], None] | None = None,
) -> Samples:
    """TTFT at batch 1 for each prompt length, ITL at each batch size, then the prefill-batch iterations
    (:func:`prefill_batch_iteration`), on an otherwise idle engine."""
    t0 = time.perf_counter()
    limits = engine_limits(engine)
    run = _Run(engine, plan, np.random.default_rng(plan.seed), int(engine.model_config.get_vocab_size()),
               progress or (lambda _m: None))
    lens = _checked_lengths(plan, limits, int(engine.model_config.max_model_len) - 1)
    # Warm-up: first calls allocate buffers and fill caches; the longest prompt and a batch at least once.
    for i in range(plan.warmup_requests):
        await run.request(lens[-1 - i % len(lens)], 8)
    if plan.warmup_requests:
        await asyncio.gather(*(run.request(16, 8) for _ in range(max(plan.batch_sizes))))
    samples = Samples(limits=limits)
    await _prefill_rounds(run, lens, samples)
    await _decode_rounds(run, samples)
    await _prefill_batch_rounds(run, samples)
    samples.wall_s = time.perf_counter() - t0
    return samples


@dataclass
class _Run:
    """One calibration's engine, plan, random prompts and progress line."""

    engine: AsyncLLM
    plan: CalibrationPlan
    rng: np.random.Generator
    vocab: int
    say: Callable[[str], None]

    def prompt(self, tokens: int) -> list[int]:
        return random_prompt(self.rng, tokens, self.vocab)

    def request(self, prompt_tokens: int, output_tokens: int) -> Coroutine[Any, Any, list[tuple[float, int]]]:
        """A request on a new random prompt, drawn now (not when it is awaited: the draws keep their order)."""
        return stream_request(self.engine, self.prompt(prompt_tokens), output_tokens, self.plan.request_timeout_s)


def _checked_lengths(plan: CalibrationPlan, limits: EngineLimits, max_prompt: int) -> list[int]:
    """The plan's prompt lengths that fit ``max_prompt``; ValueError where the plan does not fit the engine."""
    lens = [p for p in plan.prompt_lens if p <= max_prompt]
    if not lens:
        raise ValueError(f"every prompt length in {plan.prompt_lens} exceeds max_model_len - 1 = {max_prompt}")
    too_big = [b for b in plan.batch_sizes if b > limits.max_num_seqs]
    if too_big:
        raise ValueError(f"batch sizes {too_big} exceed the engine's max_num_seqs {limits.max_num_seqs}")
    # The blocker's prefill must be one iteration of its own, and the k prompts plus its decode token the next.
    n_pb, kmax = plan.prefill_batch_prompt_tokens, max(plan.prefill_batch_sizes)
    if plan.blocker_prompt_tokens > min(max_prompt - 1, limits.max_num_batched_tokens) or n_pb > max_prompt:
        raise ValueError(f"blocker_prompt_tokens {plan.blocker_prompt_tokens} / prefill_batch_prompt_tokens {n_pb} "
                         f"must fit max_model_len and one iteration ({limits.max_num_batched_tokens} tokens)")
    if kmax * n_pb + 1 > limits.max_num_batched_tokens or kmax + 1 > limits.max_num_seqs:
        raise ValueError(f"{kmax} prompts of {n_pb} tokens and the blocker's decode do not fit one iteration "
                         f"(max_num_batched_tokens {limits.max_num_batched_tokens}, max_num_seqs "
                         f"{limits.max_num_seqs})")
    return lens


async def _prefill_rounds(run: _Run, lens: list[int], samples: Samples) -> None:
    """One token per request: TTFT is the whole request, and nothing else runs meanwhile (batch 1)."""
    plan = run.plan
    for rep in range(plan.prefill_repeats):
        for p in lens:
            prompt = run.prompt(p)
            await asyncio.sleep(plan.prefill_gap_s)
            t_send = time.perf_counter()
            stamps = await stream_request(run.engine, prompt, 1, plan.request_timeout_s)
            samples.ttft.append((p, stamps[0][0] - t_send))
        run.say(f"prefill round {rep + 1}/{plan.prefill_repeats}")


async def _decode_rounds(run: _Run, samples: Samples) -> None:
    """Steady inter-token latency at each batch size, the sizes interleaved round by round: a burst of load
    from elsewhere hits them all alike."""
    plan = run.plan
    rounds = {b: max(plan.itl_repeats, -(-plan.itl_min_samples // b)) for b in plan.batch_sizes}
    for rep in range(max(rounds.values())):
        for b in plan.batch_sizes:
            if rep >= rounds[b]:
                continue
            streams = await asyncio.gather(*(run.request(plan.itl_prompt_tokens, plan.itl_output_tokens)
                                             for _ in range(b)))
            samples.itl += [(b, x) for x in steady_itl(streams)]
        run.say(f"decode round {rep + 1}/{max(rounds.values())}")


async def _prefill_batch_rounds(run: _Run, samples: Samples) -> None:
    """The iteration that prefills k prompts beside a blocker's decode token (prefill_batch_iteration), the
    k interleaved as the decode rounds. With warm-up, one round more, not kept: the first round after the
    decode rounds came out ~2-7 ms slow at every k on the tiny model."""
    plan, timeout = run.plan, run.plan.request_timeout_s
    for rep in range(-1 if plan.warmup_requests else 0, plan.prefill_batch_repeats):
        for k in plan.prefill_batch_sizes:
            blocker = run.prompt(plan.blocker_prompt_tokens)
            prompts = [run.prompt(plan.prefill_batch_prompt_tokens) for _ in range(k)]
            last: list[Any] = [None] * (k + 1)  # each request's latest RequestOutput
            await asyncio.sleep(plan.prefill_gap_s)
            tb = asyncio.create_task(stream_request(run.engine, blocker, 2, timeout, partial(last.__setitem__, 0)))
            await asyncio.sleep(plan.blocker_lead_s)
            # Tasks start in order and each submits before its first real wait: no await between the k.
            tk = [asyncio.create_task(stream_request(run.engine, p, 1, timeout, partial(last.__setitem__, i + 1)))
                  for i, p in enumerate(prompts)]
            await asyncio.gather(tb, *tk)
            (b1, b2), *ts = (_engine_token_times(o) for o in last)
            r = prefill_batch_iteration(b1, b2, [t for t, _ in ts], plan.prefill_batch_max_spread)
            if rep < 0:
                continue
            if isinstance(r, str):
                samples.prefill_batch_dropped.append((k, r))
            else:
                samples.prefill_batch.append((k, r))
        run.say(f"prefill-batch round {rep + 1}/{plan.prefill_batch_repeats} "  # 0: the warm-up round
                f"({len(samples.prefill_batch_dropped)} rounds dropped so far)")


def calibrated_profile(
    cal: Calibration,
    limits: EngineLimits,
    source: str,
    model: str = "tiny-qwen2",
    flavor: str = "cpu",
    startup_s: float = 20.0,
) -> Profile:
    """The profile the fit describes, with the engine's own batch and KV limits."""
    if limits.kv_tokens is None:
        raise CalibrationError("the engine did not report its KV cache size")
    overhead = round(cal.overhead_s, 5)
    return Profile(
        model=model,
        flavor=flavor,
        prefill_tokens_per_s=round(cal.prefill_tokens_per_s, 0),
        overhead_s=overhead,
        prefill_quadratic_s=float(f"{cal.prefill_quadratic_s:.3g}"),
        prefill_seq_s=min(round(cal.prefill_seq_s, 6), overhead),  # rounding must keep it within overhead_s
        prefill_iteration_s=round(cal.prefill_iteration_s, 6),
        itl_alpha_s=round(cal.itl_alpha_s, 6),
        itl_beta_s=round(cal.itl_beta_s, 7),
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,  # measured with this chunk: pinned to it
        kv_tokens=limits.kv_tokens,
        startup_s=startup_s,
        source=source,
    )
