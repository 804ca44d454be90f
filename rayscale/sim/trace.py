"""Request traces: read, generate and reshape arrival processes with prompt and output lengths.

A :class:`Trace` is three parallel numpy arrays (arrival time in seconds from the trace start, prompt
tokens, output tokens), sorted by arrival. Every operation returns a new trace and never reads the clock;
random ones take a seed, so the simulator and the load generator see the same requests for the same
inputs. The only I/O is reading the file handed to :func:`load_trace`.

Formats read:
- Azure LLM inference trace CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` where TIMESTAMP is a date
  time (``2023-11-16 18:17:03.9799600``) or a number of seconds;
- Mooncake JSONL: one object a line with ``timestamp`` (milliseconds), ``input_length``, ``output_length``
  and optionally ``hash_ids``: one id per ``HASH_BLOCK_TOKENS``-token block of the prompt, equal ids where
  requests share a prefix (the simulator's prefix cache reads them; a line without them shares nothing).
A CSV may also use the Mooncake column names and a JSONL line the Azure keys (or ``arrival_s``,
``prompt_tokens``, ``output_tokens``, the names of this module). BurstGPT's CSV (``Timestamp`` in seconds,
``Request tokens``, ``Response tokens``; a failed request has 0 response tokens) and the usage names of
OpenAI-style logs (``input_tokens``, ``completion_tokens``) read as they are.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from rayscale.core.catalog import RequestMixSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# Per request, its prompt's block hashes as a tuple of ints (an object array: requests have different
# lengths, and tuples of Python ints are what the simulator's prefix cache looks up without conversion).
HashArray = npt.NDArray[np.object_]
# Tokens per hash block in Mooncake traces (its FAST'25 release: one hash per 512-token block).
HASH_BLOCK_TOKENS = 512
TraceFormat = Literal["azure-csv", "mooncake-jsonl"]


class TraceFormatError(ValueError):
    """A trace file that cannot be read; names the file, the line (1-based) and the field."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, field: str | None, reason: str):
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}, line {line}"
        what = f", field {field!r}" if field else ""
        super().__init__(f"bad trace {where}{what}: {reason}")

    def __reduce__(self) -> tuple[type[TraceFormatError], tuple[str, int | None, str | None, str]]:
        # Pickle rebuilds an exception from its args (the message alone): a bench's process pool would
        # raise a TypeError in place of this error, and the file and field it names would be lost.
        return (type(self), (self.path, self.line, self.field, self.reason))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives (seconds from the trace start) and how big it is."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # prompt block hashes (shared prefixes); empty: not known


@dataclass(frozen=True, slots=True)
class TraceStats:
    requests: int
    duration_s: float
    rate_per_s: float
    prompt_tokens_mean: float
    prompt_tokens_p50: float
    prompt_tokens_p95: float
    output_tokens_mean: float
    output_tokens_p50: float
    output_tokens_p95: float


@dataclass(frozen=True, eq=False)
class Trace:
    """A request trace: parallel arrays sorted by arrival time; use the constructors, not ``Trace(...)``.

    ``hash_ids``, when the source has them (Mooncake), holds each request's prompt block hashes, one per
    ``hash_block_tokens`` tokens; every operation carries them along with the request they belong to."""

    arrival_s: FloatArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    name: str = "trace"
    hash_ids: HashArray | None = None
    hash_block_tokens: int = HASH_BLOCK_TOKENS

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError("trace arrays differ in length")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ValueError("trace hash_ids differ in length from the requests")
        if self.hash_block_tokens < 1:
            raise ValueError(f"hash_block_tokens must be >= 1, got {self.hash_block_tokens}")
        if n and not np.all(np.isfinite(self.arrival_s)):
            raise ValueError("trace arrival times must be finite")
        if n > 1 and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("trace arrival times must be sorted; build traces with Trace.from_arrays")
        if n and (self.prompt_tokens.min() < 0 or self.output_tokens.min() < 0):
            raise ValueError("token counts must be non-negative")
        for arr in (self.arrival_s, self.prompt_tokens, self.output_tokens, self.hash_ids):
            if arr is not None:
                arr.setflags(write=False)  # shared between traces derived from one another

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_arrays(
        cls,
        arrival_s: Sequence[float] | npt.ArrayLike,
        prompt_tokens: Sequence[int] | npt.ArrayLike,
        output_tokens: Sequence[int] | npt.ArrayLike,
        name: str = "trace",
        hash_ids: Sequence[Sequence[int]] | HashArray | None = None,
        hash_block_tokens: int = HASH_BLOCK_TOKENS,
    ) -> Trace:
        """Builds a trace from unsorted arrays (stable sort by arrival, so ties keep their order)."""
        arr = np.asarray(arrival_s, dtype=np.float64)
        pt = np.asarray(prompt_tokens, dtype=np.int64)
        ot = np.asarray(output_tokens, dtype=np.int64)
        order = np.argsort(arr, kind="stable")
        hashes = None if hash_ids is None else hash_array(hash_ids)[order]
        return cls(arr[order].copy(), pt[order].copy(), ot[order].copy(), name, hashes, hash_block_tokens)

    @classmethod
    def from_requests(cls, requests: Sequence[TraceRequest], name: str = "trace",
                      hash_block_tokens: int = HASH_BLOCK_TOKENS) -> Trace:
        hashes = [r.hash_ids for r in requests] if any(r.hash_ids for r in requests) else None
        return cls.from_arrays(
            [r.arrival_s for r in requests],
            [r.prompt_tokens for r in requests],
            [r.output_tokens for r in requests],
            name,
            hashes,
            hash_block_tokens,
        )

    # --- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __iter__(self) -> Iterator[TraceRequest]:
        cols = (self.arrival_s.tolist(), self.prompt_tokens.tolist(), self.output_tokens.tolist())
        hashes = self.hash_ids.tolist() if self.hash_ids is not None else [()] * len(self)
        for a, p, o, h in zip(*cols, hashes, strict=True):
            yield TraceRequest(a, p, o, h)

    def __getitem__(self, i: int) -> TraceRequest:
        h = self.hash_ids[i] if self.hash_ids is not None else ()
        return TraceRequest(float(self.arrival_s[i]), int(self.prompt_tokens[i]), int(self.output_tokens[i]), h)

    def requests(self) -> list[TraceRequest]:
        return list(self)

    @property
    def duration_s(self) -> float:
        """Time of the last arrival (arrivals are relative to the trace start)."""
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def stats(self) -> TraceStats:
        n = len(self)
        if n == 0:
            return TraceStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        dur = self.duration_s
        pq = np.percentile(self.prompt_tokens, [50, 95])
        oq = np.percentile(self.output_tokens, [50, 95])
        return TraceStats(
            requests=n,
            duration_s=dur,
            rate_per_s=n / dur if dur > 0 else float("inf"),
            prompt_tokens_mean=float(self.prompt_tokens.mean()),
            prompt_tokens_p50=float(pq[0]),
            prompt_tokens_p95=float(pq[1]),
            output_tokens_mean=float(self.output_tokens.mean()),
            output_tokens_p50=float(oq[0]),
            output_tokens_p95=float(oq[1]),
        )

    def request_mix(self) -> RequestMixSpec:
        """The trace's request shape as a model declares it (models.yaml request_mix): mean prompt, mean
        output (at least one token, as served) and p95 prompt."""
        if len(self) == 0:
            raise ValueError(f"trace {self.name!r} has no requests")
        return RequestMixSpec(prompt_mean=max(float(self.prompt_tokens.mean()), 1.0),
                              output_mean=float(np.maximum(self.output_tokens, 1).mean()),
                              prompt_p95=max(float(np.percentile(self.prompt_tokens, 95)), 1.0))

    def _with(self, arrival_s: FloatArray, prompt: IntArray, output: IntArray, suffix: str,
              hashes: HashArray | None) -> Trace:
        """A derived trace; ``hashes``: the new requests' block hashes (None exactly when this trace has none)."""
        return Trace.from_arrays(arrival_s, prompt, output, f"{self.name}|{suffix}", hashes, self.hash_block_tokens)

    def _hashes(self, idx: IntArray | slice | None = None) -> HashArray | None:
        """This trace's block hashes of the requests ``idx`` (all when None); None when it has none."""
        if self.hash_ids is None:
            return None
        return self.hash_ids if idx is None else self.hash_ids[idx]

    def _fresh_copies(self, idx: IntArray, copy: IntArray) -> HashArray | None:
        """Hashes of requests ``idx`` where copy number ``copy`` > 0 gets ids no other request has: a copy is
        another user sending a request of the same shape, not the same prompt again (which would read as a
        full prefix-cache hit that the traffic never had)."""
        if self.hash_ids is None:
            return None
        out = self.hash_ids[idx]
        if not np.any(copy > 0):
            return out
        stride = 1 + max((max(h) for h in self.hash_ids if h), default=0)
        out = out.copy()
        for k in np.flatnonzero(copy > 0).tolist():
            off = int(copy[k]) * stride
            out[k] = tuple(h + off for h in out[k])
        return out

    # --- operations ---------------------------------------------------------------------------

    def time_scale(self, factor: float) -> Trace:
        """Multiplies every arrival time by ``factor`` (0.1: ten times faster, same requests)."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"time scale factor must be positive and finite, got {factor}")
        return self._with(self.arrival_s * factor, self.prompt_tokens, self.output_tokens, f"x{factor:g}t",
                          self._hashes())

    def compress(self, speedup: float) -> Trace:
        """Replays ``speedup`` times faster: ``compress(10)`` turns an hour into six minutes."""
        if not (speedup > 0 and math.isfinite(speedup)):
            raise ValueError(f"speedup must be positive and finite, got {speedup}")
        return self.time_scale(1.0 / speedup)

    def rate_scale(self, factor: float, seed: int = 0, jitter_s: float | None = None) -> Trace:
        """Scales the request rate by ``factor`` over the same time span.

        Below 1 each request is kept with probability ``factor`` (independent thinning keeps a Poisson
        process Poisson). Above 1 each request is kept ``floor(factor)`` times plus once more with the
        fractional probability; copies arrive up to ``jitter_s`` later (default: the mean gap between
        arrivals) so that they do not all land at the same instant, with block hashes of their own.
        """
        if not (factor >= 0 and math.isfinite(factor)):
            raise ValueError(f"rate scale factor must be non-negative and finite, got {factor}")
        rng = np.random.default_rng(seed)
        n = len(self)
        whole = math.floor(factor)
        counts = np.full(n, whole, dtype=np.int64) + (rng.random(n) < (factor - whole)).astype(np.int64)
        idx = np.repeat(np.arange(n), counts)
        arrival = self.arrival_s[idx].copy()
        # Copy number of each kept request: 0 for the first instance of its original.
        copy = np.arange(len(idx)) - np.repeat(np.cumsum(counts) - counts, counts)
        if factor > 1 and len(idx):
            if jitter_s is None:
                jitter_s = self.duration_s / max(n - 1, 1)
            # the first instance of each original request stays where it was; copies move later
            first = np.ones(len(idx), dtype=bool)
            first[1:] = idx[1:] != idx[:-1]
            shift = rng.random(len(idx)) * jitter_s
            arrival = np.where(first, arrival, np.minimum(arrival + shift, self.duration_s))
        return self._with(arrival, self.prompt_tokens[idx], self.output_tokens[idx], f"x{factor:g}r",
                          self._fresh_copies(idx, copy))

    def repeat(self, times: int, gap_s: float | None = None) -> Trace:
        """Plays the trace ``times`` times back to back, ``gap_s`` apart (default: the mean gap); each pass
        has block hashes of its own (more traffic of the same kind, not the same prompts again)."""
        if times < 1:
            raise ValueError(f"repeat needs times >= 1, got {times}")
        if gap_s is None:
            gap_s = self.duration_s / max(len(self) - 1, 1) if len(self) > 1 else 1.0
        if gap_s < 0:
            raise ValueError(f"gap_s must be >= 0, got {gap_s}")
        period = self.duration_s + gap_s
        offsets = np.repeat(np.arange(times, dtype=np.float64) * period, len(self))
        idx = np.tile(np.arange(len(self)), times)
        return self._with(
            np.tile(self.arrival_s, times) + offsets,
            np.tile(self.prompt_tokens, times),
            np.tile(self.output_tokens, times),
            f"repeat{times}",
            self._fresh_copies(idx, np.repeat(np.arange(times), len(self))),
        )

    def resample(self, seed: int, bin_s: float = 10.0) -> Trace:
        """Another draw of the same traffic: per ``bin_s`` bin a Poisson number of arrivals with the bin's
        count as its mean, spread uniformly over the bin, each with the lengths of a request drawn from the
        same bin. The rate's shape over the day, the
        within-minute bursts and the request mix stay; which requests arrive when does not."""
        if not bin_s > 0:
            raise ValueError(f"bin_s must be > 0, got {bin_s}")
        if not len(self):
            return self
        rng = np.random.default_rng(seed)
        bins = np.floor(self.arrival_s / bin_s).astype(np.int64)
        nb = int(bins[-1]) + 1
        counts = np.bincount(bins, minlength=nb)
        drawn = rng.poisson(counts)
        which = np.repeat(np.arange(nb), drawn)
        start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        # Poisson draws are 0 where the bin's count is 0: every drawn arrival has requests of its bin to copy
        pick = start[which] + np.floor(rng.random(len(which)) * counts[which]).astype(np.int64)
        arrival = (which + rng.random(len(which))) * bin_s
        order = np.argsort(arrival, kind="stable")
        hashes = self._hashes(pick[order])  # a request drawn twice is the same prompt twice: its hashes too
        return self._with(arrival[order], self.prompt_tokens[pick][order], self.output_tokens[pick][order],
                          f"resample{seed}", hashes)

    def then(self, other: Trace, gap_s: float | None = None) -> Trace:
        """This trace, then ``other`` ``gap_s`` after its end (default: this trace's mean gap). Block hashes
        stay as they are: equal ids in both are the same prefix."""
        if gap_s is None:
            gap_s = self.duration_s / max(len(self) - 1, 1) if len(self) > 1 else 1.0
        offset = self.duration_s + gap_s
        return self._with(np.concatenate([self.arrival_s, other.arrival_s + offset]),
                          np.concatenate([self.prompt_tokens, other.prompt_tokens]),
                          np.concatenate([self.output_tokens, other.output_tokens]), f"then({other.name})",
                          _joined_hashes(self, other))

    def window(self, start_s: float = 0.0, end_s: float | None = None, rebase: bool = True) -> Trace:
        """Requests arriving in ``[start_s, end_s)``; with ``rebase`` the window starts at time 0."""
        lo = int(np.searchsorted(self.arrival_s, start_s, side="left"))
        hi = len(self) if end_s is None else int(np.searchsorted(self.arrival_s, end_s, side="left"))
        arrival = self.arrival_s[lo:hi] - (start_s if rebase else 0.0)
        return self._with(arrival, self.prompt_tokens[lo:hi], self.output_tokens[lo:hi], f"[{start_s:g},{end_s})",
                          self._hashes(slice(lo, hi)))

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        return self._with(self.arrival_s[:n], self.prompt_tokens[:n], self.output_tokens[:n], f"head{n}",
                          self._hashes(slice(None, n)))

    def rebase(self) -> Trace:
        """Shifts arrivals so that the first request arrives at time 0."""
        if not len(self):
            return self
        return self._with(self.arrival_s - self.arrival_s[0], self.prompt_tokens, self.output_tokens, "rebase",
                          self._hashes())

    def clip_tokens(
        self,
        max_prompt: int | None = None,
        max_output: int | None = None,
        min_prompt: int = 1,
        min_output: int = 1,
        max_total: int | None = None,
    ) -> Trace:
        """Clips token lengths into bounds; ``max_total`` caps prompt + output (a model's max length)
        by shortening the prompt first, keeping at least ``min_prompt`` prompt tokens."""
        prompt = np.clip(self.prompt_tokens, min_prompt, max_prompt)
        output = np.clip(self.output_tokens, min_output, max_output)
        if max_total is not None:
            if max_total < min_prompt + min_output:
                raise ValueError(f"max_total {max_total} leaves no room for {min_prompt}+{min_output} tokens")
            output = np.minimum(output, max_total - min_prompt)
            prompt = np.minimum(prompt, max_total - output)
        # A shortened prompt keeps its hashes: the prefix cache reads only the blocks within the prompt.
        return self._with(self.arrival_s, prompt, output, "clip", self._hashes())

    def concat(self, other: Trace, offset_s: float | None = None) -> Trace:
        """Appends ``other`` starting ``offset_s`` after this trace's start (default: right after its end)."""
        off = self.duration_s if offset_s is None else offset_s
        return Trace.from_arrays(
            np.concatenate([self.arrival_s, other.arrival_s + off]),
            np.concatenate([self.prompt_tokens, other.prompt_tokens]),
            np.concatenate([self.output_tokens, other.output_tokens]),
            f"{self.name}+{other.name}",
            _joined_hashes(self, other),
            self.hash_block_tokens,
        )


def hash_array(rows: Sequence[Sequence[int]] | HashArray) -> HashArray:
    """Per request block hashes as an object array of int tuples (one already is returned as it is)."""
    if isinstance(rows, np.ndarray) and rows.dtype == object:
        return rows
    out = np.empty(len(rows), dtype=object)
    for i, h in enumerate(rows):
        out[i] = tuple(int(x) for x in h)
    return out


def _joined_hashes(a: Trace, b: Trace) -> HashArray | None:
    """The hashes of ``a``'s requests then ``b``'s (empty for a trace without them); None if neither has any."""
    if a.hash_ids is None and b.hash_ids is None:
        return None
    if a.hash_ids is not None and b.hash_ids is not None and a.hash_block_tokens != b.hash_block_tokens:
        raise ValueError(f"traces hash {a.hash_block_tokens} and {b.hash_block_tokens} tokens a block: not joinable")
    empty = hash_array([()] * 0)
    parts = [t.hash_ids if t.hash_ids is not None else hash_array([()] * len(t)) for t in (a, b)]
    return np.concatenate([empty, *parts])


# --- token length distributions for generated traces ----------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Log-normal token lengths with a given median, clipped to ``[low, high]``."""

    median: float
    sigma: float = 0.8
    low: int = 1
    high: int = 8192

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or self.low < 0 or self.high < self.low:
            raise ValueError(f"invalid length distribution {self}")

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        x = rng.lognormal(math.log(self.median), self.sigma, n) if self.sigma > 0 else np.full(n, self.median)
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)


DEFAULT_PROMPT = LengthDist(median=1000, sigma=1.0, low=8, high=8000)
DEFAULT_OUTPUT = LengthDist(median=100, sigma=0.9, low=1, high=2000)


def _inhomogeneous(
    rate_fn: Callable[[FloatArray], FloatArray],
    max_rate: float,
    duration_s: float,
    seed: int,
    prompt: LengthDist,
    output: LengthDist,
    name: str,
) -> Trace:
    """Poisson arrivals with time-varying rate, by thinning a homogeneous process at ``max_rate``."""
    if duration_s < 0 or max_rate < 0:
        raise ValueError("duration and rate must be non-negative")
    rng = np.random.default_rng(seed)
    n_candidates = int(rng.poisson(max_rate * duration_s))
    t = np.sort(rng.random(n_candidates) * duration_s)
    if max_rate > 0 and n_candidates:
        keep = rng.random(n_candidates) * max_rate < rate_fn(t)
        t = t[keep]
    n = len(t)
    return Trace.from_arrays(t, prompt.sample(rng, n), output.sample(rng, n), name)


def poisson(
    rate_per_s: float,
    duration_s: float,
    seed: int = 0,
    prompt: LengthDist = DEFAULT_PROMPT,
    output: LengthDist = DEFAULT_OUTPUT,
) -> Trace:
    """Poisson arrivals at a constant rate."""
    return _inhomogeneous(
        lambda t: np.full_like(t, rate_per_s), rate_per_s, duration_s, seed, prompt, output,
        f"poisson({rate_per_s:g}/s,{duration_s:g}s,seed={seed})",
    )


def diurnal(
    base_rate_per_s: float,
    peak_rate_per_s: float,
    period_s: float,
    duration_s: float,
    seed: int = 0,
    peak_at_s: float | None = None,
    prompt: LengthDist = DEFAULT_PROMPT,
    output: LengthDist = DEFAULT_OUTPUT,
) -> Trace:
    """A sinusoidal day: rate goes from ``base`` to ``peak`` (at ``peak_at_s``, default mid-period) and back."""
    if period_s <= 0 or peak_rate_per_s < base_rate_per_s:
        raise ValueError("diurnal needs period_s > 0 and peak >= base")
    peak_at = period_s / 2 if peak_at_s is None else peak_at_s
    amp = peak_rate_per_s - base_rate_per_s

    def rate(t: FloatArray) -> FloatArray:
        return base_rate_per_s + amp * (1 + np.cos(2 * np.pi * (t - peak_at) / period_s)) / 2

    return _inhomogeneous(
        rate, peak_rate_per_s, duration_s, seed, prompt, output,
        f"diurnal({base_rate_per_s:g}-{peak_rate_per_s:g}/s,{period_s:g}s,seed={seed})",
    )


def bursts(
    base_rate_per_s: float,
    burst_rate_per_s: float,
    every_s: float,
    burst_s: float,
    duration_s: float,
    seed: int = 0,
    first_at_s: float | None = None,
    prompt: LengthDist = DEFAULT_PROMPT,
    output: LengthDist = DEFAULT_OUTPUT,
) -> Trace:
    """A steady rate with periodic bursts: ``burst_rate`` for ``burst_s`` every ``every_s`` seconds."""
    if every_s <= 0 or burst_s < 0 or burst_s > every_s:
        raise ValueError("bursts needs every_s > 0 and 0 <= burst_s <= every_s")
    first = every_s / 2 if first_at_s is None else first_at_s

    def rate(t: FloatArray) -> FloatArray:
        phase = np.mod(t - first, every_s)
        in_burst = (t >= first) & (phase < burst_s)
        return np.where(in_burst, burst_rate_per_s, base_rate_per_s)

    return _inhomogeneous(
        rate, max(base_rate_per_s, burst_rate_per_s), duration_s, seed, prompt, output,
        f"bursts({base_rate_per_s:g}/{burst_rate_per_s:g}/s every {every_s:g}s,seed={seed})",
    )


# --- readers --------------------------------------------------------------------------------------

_ARRIVAL_KEYS = ("TIMESTAMP", "timestamp", "arrival_s")
_PROMPT_KEYS = ("ContextTokens", "input_length", "prompt_tokens", "Request tokens", "input_tokens")
_OUTPUT_KEYS = ("GeneratedTokens", "output_length", "output_tokens", "Response tokens", "completion_tokens")
_HASH_KEY = "hash_ids"


def detect_format(path: str | os.PathLike[str], text: str | None = None) -> TraceFormat:
    """By extension (.csv, .jsonl/.json/.ndjson), else by the first non-blank character."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if ".csv" in suffixes:
        return "azure-csv"
    if any(s in (".jsonl", ".json", ".ndjson") for s in suffixes):
        return "mooncake-jsonl"
    head = (text if text is not None else _read_text(path)[:4096]).lstrip()
    if head.startswith("{"):
        return "mooncake-jsonl"
    if head:
        return "azure-csv"
    raise TraceFormatError(path, None, None, "file is empty")


def load_trace(path: str | os.PathLike[str], fmt: TraceFormat | None = None, name: str | None = None) -> Trace:
    """Reads an Azure CSV or Mooncake JSONL trace; arrivals are rebased so the first one is at 0 s."""
    text = _read_text(path)
    fmt = fmt or detect_format(path, text)
    name = name or Path(path).stem
    if fmt == "azure-csv":
        return _parse_csv(path, text, name)
    if fmt == "mooncake-jsonl":
        return _parse_jsonl(path, text, name)
    raise ValueError(f"unknown trace format {fmt!r}")


def _read_text(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: spreadsheet exports start with a BOM
            return f.read()
    except FileNotFoundError:
        raise TraceFormatError(path, None, None, "no such file") from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(path, None, None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TraceFormatError(path, None, None, f"cannot read: {e.strerror}") from None


def _pick(path: str | os.PathLike[str], line: int, names: Sequence[str], choices: Sequence[str]) -> str:
    for c in choices:
        if c in names:
            return c
    lower = {n.lower(): n for n in names}
    for c in choices:
        if c.lower() in lower:
            return lower[c.lower()]
    raise TraceFormatError(path, line, choices[0], f"missing column (expected one of {', '.join(choices)})")


def _tokens(path: str | os.PathLike[str], line: int, field: str, raw: object) -> int:
    if isinstance(raw, bool):
        raise TraceFormatError(path, line, field, f"expected a token count, got {raw!r}")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    elif isinstance(raw, str):
        s = raw.strip()
        try:
            value = int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                raise TraceFormatError(path, line, field, f"expected a token count, got {raw!r}") from None
            if not f.is_integer():
                raise TraceFormatError(path, line, field, f"expected a whole token count, got {raw!r}") from None
            value = int(f)
    else:
        raise TraceFormatError(path, line, field, f"expected a token count, got {raw!r}")
    if value < 0:
        raise TraceFormatError(path, line, field, f"token count must be >= 0, got {value}")
    return value


def _seconds(path: str | os.PathLike[str], line: int, field: str, raw: object, unit_s: float) -> float | datetime:
    """A number (scaled by ``unit_s``) or an ISO date time; the caller rebases both to the first row."""
    if isinstance(raw, str) and len(raw) > 18 and raw[4:5] == "-":
        try:  # fast path: Azure's date times
            dt = datetime.fromisoformat(raw)
            if dt.tzinfo is None:
                return dt
        except ValueError:
            pass
    if isinstance(raw, bool) or raw is None:
        raise TraceFormatError(path, line, field, f"expected a time, got {raw!r}")
    if isinstance(raw, int | float):
        value = float(raw) * unit_s
    elif isinstance(raw, str):
        s = raw.strip()
        try:
            value = float(s) * unit_s
        except ValueError:
            try:
                dt = datetime.fromisoformat(s)
            except ValueError:
                raise TraceFormatError(path, line, field, f"expected a time, got {raw!r}") from None
            # aware times go to naive UTC so that rows with different offsets compare correctly
            return dt.astimezone(UTC).replace(tzinfo=None) if dt.tzinfo is not None else dt
    else:
        raise TraceFormatError(path, line, field, f"expected a time, got {raw!r}")
    if not math.isfinite(value):
        raise TraceFormatError(path, line, field, f"time must be finite, got {raw!r}")
    return value


def _finish(
    path: str | os.PathLike[str],
    name: str,
    times: list[float | datetime],
    lines: list[int],
    field: str,
    prompt: list[int],
    output: list[int],
    hashes: list[tuple[int, ...]] | None = None,
) -> Trace:
    if not times:
        raise TraceFormatError(path, None, None, "no requests in file")
    first = times[0]
    if isinstance(first, datetime):
        t0 = first
        rel: list[float] = []
        for t, ln in zip(times, lines, strict=True):
            if not isinstance(t, datetime):
                raise TraceFormatError(path, ln, field, "mixes numbers and date times")
            rel.append((t - t0).total_seconds())
    else:
        rel = []
        for t, ln in zip(times, lines, strict=True):
            if isinstance(t, datetime):
                raise TraceFormatError(path, ln, field, "mixes numbers and date times")
            rel.append(t)
    arr = np.asarray(rel, dtype=np.float64)
    arr -= arr.min()  # out-of-order rows are sorted, not dropped; the earliest one is time 0
    return Trace.from_arrays(arr, np.asarray(prompt, np.int64), np.asarray(output, np.int64), name, hashes)


def _parse_csv(path: str | os.PathLike[str], text: str, name: str) -> Trace:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    header_line = 0
    for row in reader:
        if row and any(c.strip() for c in row):
            header = [c.strip() for c in row]
            header_line = reader.line_num
            break
    if header is None:
        raise TraceFormatError(path, None, None, "file is empty")
    t_key = _pick(path, header_line, header, _ARRIVAL_KEYS)
    p_key = _pick(path, header_line, header, _PROMPT_KEYS)
    o_key = _pick(path, header_line, header, _OUTPUT_KEYS)
    ti, pi, oi = header.index(t_key), header.index(p_key), header.index(o_key)
    unit = 1.0  # CSV numbers are seconds
    times: list[float | datetime] = []
    lines: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    for row in reader:
        ln = reader.line_num
        if not row or not any(c.strip() for c in row):
            continue  # blank lines carry no request
        if len(row) != len(header):
            missing = header[len(row)] if len(row) < len(header) else None
            raise TraceFormatError(
                path, ln, missing, f"expected {len(header)} columns ({','.join(header)}), got {len(row)}"
            )
        times.append(_seconds(path, ln, t_key, row[ti], unit))
        lines.append(ln)
        try:  # fast path for the common case; _tokens explains anything unusual
            p, o = int(row[pi]), int(row[oi])
            if p < 0 or o < 0:
                raise ValueError
        except ValueError:
            p, o = _tokens(path, ln, p_key, row[pi]), _tokens(path, ln, o_key, row[oi])
        prompt.append(p)
        output.append(o)
    return _finish(path, name, times, lines, t_key, prompt, output)


def _parse_jsonl(path: str | os.PathLike[str], text: str, name: str) -> Trace:
    times: list[float | datetime] = []
    lines: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    hashes: list[tuple[int, ...]] = []
    t_key = _ARRIVAL_KEYS[1]
    for ln, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TraceFormatError(path, ln, None, f"invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(path, ln, None, f"expected a JSON object, got {type(obj).__name__}")
        keys = list(obj)
        t_key = _pick(path, ln, keys, _ARRIVAL_KEYS)
        p_key = _pick(path, ln, keys, _PROMPT_KEYS)
        o_key = _pick(path, ln, keys, _OUTPUT_KEYS)
        # Mooncake timestamps are milliseconds; arrival_s and Azure's TIMESTAMP are seconds
        unit = 1e-3 if t_key == "timestamp" else 1.0
        times.append(_seconds(path, ln, t_key, obj[t_key], unit))
        lines.append(ln)
        prompt.append(_tokens(path, ln, p_key, obj[p_key]))
        output.append(_tokens(path, ln, o_key, obj[o_key]))
        hashes.append(_hash_ids(path, ln, obj.get(_HASH_KEY)))
    return _finish(path, name, times, lines, t_key, prompt, output, hashes if any(hashes) else None)


def _hash_ids(path: str | os.PathLike[str], line: int, raw: object) -> tuple[int, ...]:
    """A line's ``hash_ids``: a list of integers (absent: no known blocks, so nothing shared)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in raw):
        raise TraceFormatError(path, line, _HASH_KEY, f"expected a list of integers, got {str(raw)[:40]!r}")
    return tuple(raw)
