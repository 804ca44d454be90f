"""Calibrate a latency profile (rayscale.core.catalog.Profile) on the real vLLM engine.

Three layers, kept apart so that the fit can be tested without an engine:

- :func:`fit_profile_params`, pure: least-squares lines through measured samples,
  TTFT(prompt) = overhead_s + prompt / prefill_tokens_per_s at batch 1, and
  ITL(batch) = itl_alpha_s + itl_beta_s x batch;
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rayscale.core.catalog import Profile
from rayscale.engines.vllm_engine import CPU_ENGINE_DEFAULTS, resolve_source

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

TINY_SOURCE = "builtin:tiny-qwen2"
# The tiny model's served context (ModelDeployment's default, deployments/local-tiny.yaml).
TINY_MAX_MODEL_LEN = 2048
# Token ids 0..2 are the tokenizer's special tokens; random prompts stay clear of them.
FIRST_PLAIN_TOKEN = 3


class CalibrationError(ValueError):
    """The samples cannot give a usable profile (too few points, a slope of the wrong sign, ...)."""


# --- pure fitting --------------------------------------------------------------------------------------


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
class Calibration:
    """Fitted latency parameters, with the two fits they come from."""

    overhead_s: float
    prefill_tokens_per_s: float
    itl_alpha_s: float
    itl_beta_s: float
    ttft_fit: LineFit  # x: prompt tokens, y: TTFT s (batch 1)
    itl_fit: LineFit  # x: running batch, y: inter-token latency s


def fit_line(
    x: Sequence[float], y: Sequence[float], what: str, min_points: int = 3, nonneg_intercept: bool = False
) -> LineFit:
    """Least squares through the median y of each distinct x.

    Medians per x, not every sample: on a shared machine a single slow sample should not tilt the line.
    At least ``min_points`` distinct x are required (two points always fit exactly and say nothing).
    With ``nonneg_intercept`` the fit is constrained to intercept >= 0: the objective is convex, so when the
    free intercept comes out negative the constrained optimum is the line through the origin.
    """
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise CalibrationError(f"{what}: x and y must be 1-d and of equal length, got {xs.shape} and {ys.shape}")
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
        raise CalibrationError(f"{what}: samples must be finite")
    ux = np.unique(xs)
    if len(ux) < min_points:
        raise CalibrationError(
            f"{what}: need samples at >= {min_points} distinct x values to fit a line, got {len(ux)} "
            f"({ux.tolist()})"
        )
    my = np.array([float(np.median(ys[xs == v])) for v in ux])
    a = np.column_stack([np.ones_like(ux), ux])
    (intercept, slope), *_ = np.linalg.lstsq(a, my, rcond=None)
    constrained = bool(nonneg_intercept and intercept < 0)
    if constrained:
        intercept, slope = 0.0, float(ux @ my / (ux @ ux))
    pred = intercept + slope * ux
    res = my - pred
    ss_tot = float(np.sum((my - my.mean()) ** 2))
    r2 = 1.0 - float(np.sum(res**2)) / ss_tot if ss_tot > 0 else 0.0
    return LineFit(float(intercept), float(slope), r2, tuple(ux.tolist()), tuple(my.tolist()), tuple(res.tolist()),
                   constrained)


def fit_profile_params(
    ttft_samples: Sequence[tuple[int, float]], itl_samples: Sequence[tuple[int, float]]
) -> Calibration:
    """(overhead_s, prefill_tokens_per_s) from ``(prompt_tokens, ttft_s)`` measured at batch 1, and
    (itl_alpha_s, itl_beta_s) from ``(batch, itl_s)`` measured with ``batch`` requests decoding together.
    """
    if not ttft_samples or not itl_samples:
        raise CalibrationError("need both TTFT and ITL samples")
    # overhead_s >= 0. Prefill cost on CPU grows faster than linearly with the prompt (attention), so
    # long prompts can pull the free intercept below zero.
    tf = fit_line([p for p, _ in ttft_samples], [t for _, t in ttft_samples], "TTFT vs prompt tokens",
                  nonneg_intercept=True)  # fmt: skip
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
    return Calibration(
        overhead_s=tf.intercept,
        prefill_tokens_per_s=1.0 / tf.slope,
        itl_alpha_s=itf.intercept,
        itl_beta_s=itf.slope,
        ttft_fit=tf,
        itl_fit=itf,
    )


# --- the engine ----------------------------------------------------------------------------------------


def tiny_engine_args(max_model_len: int = TINY_MAX_MODEL_LEN, **overrides: Any) -> dict[str, Any]:
    """vLLM engine arguments of the served tiny model on CPU: the same defaults Serve deploys it with."""
    model, source_kwargs = resolve_source(TINY_SOURCE)
    return {"model": model, **CPU_ENGINE_DEFAULTS, **source_kwargs, "max_model_len": max_model_len, **overrides}


def start_engine(engine_args: dict[str, Any]) -> AsyncLLM:
    """An AsyncLLM in this process (its engine core runs in a child process, spawned)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))


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
    engine: AsyncLLM, prompt_ids: list[int], max_tokens: int, timeout_s: float
) -> list[tuple[float, int]]:
    """Runs one request; returns ``(perf_counter time, tokens so far)`` at each streamed output.

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
    """What to measure. The defaults take ~15 s on the tiny model on two cores."""

    # Up to the longest prompt bench.fidelity replays: the line is fitted where it is used.
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
    warmup_requests: int = 4
    seed: int = 0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.itl_output_tokens < 8:
            raise ValueError("itl_output_tokens must be >= 8 to leave a steady decode window")
        if min(self.prefill_repeats, self.itl_repeats) < 1:
            raise ValueError("repeats must be >= 1")


@dataclass
class Samples:
    """Raw measurements: TTFT at batch 1 per prompt length, and per-request ITL per batch size."""

    ttft: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, TTFT s)
    itl: list[tuple[int, float]] = field(default_factory=list)  # (batch, ITL s)
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


async def measure(
    engine: AsyncLLM,
    plan: CalibrationPlan = CalibrationPlan(),
    progress: Callable[[str], None] | None = None,
) -> Samples:
    """TTFT at batch 1 for each prompt length, then ITL at each batch size, on an otherwise idle engine."""
    t0 = time.perf_counter()
    limits = engine_limits(engine)
    vocab = int(engine.model_config.get_vocab_size())
    rng = np.random.default_rng(plan.seed)
    timeout = plan.request_timeout_s
    say = progress or (lambda _m: None)
    max_prompt = int(engine.model_config.max_model_len) - 1
    lens = [p for p in plan.prompt_lens if p <= max_prompt]
    if not lens:
        raise ValueError(f"every prompt length in {plan.prompt_lens} exceeds max_model_len - 1 = {max_prompt}")
    too_big = [b for b in plan.batch_sizes if b > limits.max_num_seqs]
    if too_big:
        raise ValueError(f"batch sizes {too_big} exceed the engine's max_num_seqs {limits.max_num_seqs}")

    # Warm-up: first calls allocate buffers and fill caches; the longest prompt and a batch at least once.
    for i in range(plan.warmup_requests):
        await stream_request(engine, random_prompt(rng, lens[-1 - i % len(lens)], vocab), 8, timeout)
    if plan.warmup_requests:
        await asyncio.gather(*(stream_request(engine, random_prompt(rng, 16, vocab), 8, timeout)
                               for _ in range(max(plan.batch_sizes))))  # fmt: skip

    samples = Samples(limits=limits)
    # One token: TTFT is the whole request, and nothing else runs meanwhile (batch 1).
    for rep in range(plan.prefill_repeats):
        for p in lens:
            prompt = random_prompt(rng, p, vocab)
            await asyncio.sleep(plan.prefill_gap_s)
            t_send = time.perf_counter()
            stamps = await stream_request(engine, prompt, 1, timeout)
            samples.ttft.append((p, stamps[0][0] - t_send))
        say(f"prefill round {rep + 1}/{plan.prefill_repeats}")
    rounds = {b: max(plan.itl_repeats, -(-plan.itl_min_samples // b)) for b in plan.batch_sizes}
    for rep in range(max(rounds.values())):
        # Batch sizes interleaved round by round: a burst of load from elsewhere hits them all alike.
        for b in plan.batch_sizes:
            if rep >= rounds[b]:
                continue
            streams = await asyncio.gather(*(
                stream_request(engine, random_prompt(rng, plan.itl_prompt_tokens, vocab), plan.itl_output_tokens,
                               timeout)
                for _ in range(b)))  # fmt: skip
            samples.itl += [(b, x) for x in steady_itl(streams)]
        say(f"decode round {rep + 1}/{max(rounds.values())}")
    samples.wall_s = time.perf_counter() - t0
    return samples


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
    return Profile(
        model=model,
        flavor=flavor,
        prefill_tokens_per_s=round(cal.prefill_tokens_per_s, 0),
        overhead_s=round(cal.overhead_s, 5),
        itl_alpha_s=round(cal.itl_alpha_s, 6),
        itl_beta_s=round(cal.itl_beta_s, 7),
        max_num_seqs=limits.max_num_seqs,
        kv_tokens=limits.kv_tokens,
        startup_s=startup_s,
        source=source,
    )
