"""Engine-free cost of one transformer decode step and one prefill, for a model of Mistral-7B's shape.

``python -m bench.gpu_step`` (or ``python bench/gpu_step.py``) builds random bf16 weights of Mistral-7B's shape
(32 layers, hidden 4096, 32 query heads, 8 KV heads, head_dim 128, SwiGLU MLP 14336, RMSNorm, vocab 32000, about
14.5 GB) directly on the device and times:

- decode: one new token for each of B sequences at context L over a preallocated contiguous KV cache per layer,
  replayed from a CUDA graph (as vLLM replays its decode steps) and run eagerly; then ``alpha + beta x B`` is
  fitted to the graph times and printed next to the profile's ``itl_alpha_s`` / ``itl_beta_s``;
- prefill: one forward of a single P-token prompt with causal attention, and a batch of prompts; tokens/s is
  printed next to the profile's ``prefill_tokens_per_s``.

It is a lower bound on what vLLM's step costs at the same batch and context: no paged attention, no scheduler,
no sampling, no detokenisation, unfused norms and activations, random weights. ``--tiny`` runs a tiny shape on
the CPU in seconds (the test suite does). Only torch and the standard library are needed (pyyaml, if present,
reads ``rayscale/data/profiles.yaml`` for the comparison), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "rayscale" / "data" / "profiles.yaml"
PROFILE_KEY = ("mistral-7b", "h100")
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        per_layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self, elt: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * elt


MISTRAL_7B = Shape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000)
TINY = Shape("tiny", 2, 256, 4, 2, 64, 512, 1000)


@dataclass
class Plan:
    shape: Shape
    device: torch.device
    dtype: torch.dtype
    batches: list[int]
    contexts: list[int]
    prompts: list[int]
    prefill_batch: tuple[int, int]  # (sequences, tokens each)
    repeats: int
    warmup: int
    use_graphs: bool


@dataclass
class Budget:
    limit_s: float
    start: float = field(default_factory=time.perf_counter)

    def used(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> bool:
        return self.used() > self.limit_s


@dataclass
class DecodeRecord:
    context: int
    batch: int
    graph_ms: float | None
    eager_ms: float | None
    kv_gib: float
    note: str = ""


@dataclass
class PrefillRecord:
    sequences: int
    tokens_each: int
    ms: float | None
    tokens_per_s: float | None
    note: str = ""


@dataclass
class Fit:
    context: int
    source: str  # "graph" or "eager"
    alpha_s: float
    beta_s: float
    r2: float
    points: int


@dataclass
class Results:
    meta: dict[str, Any]
    attention: dict[str, Any] = field(default_factory=dict)
    decode: list[DecodeRecord] = field(default_factory=list)
    prefill: list[PrefillRecord] = field(default_factory=list)
    fits: list[Fit] = field(default_factory=list)
    profile: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class Model:
    shape: Shape
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor  # [max_pos, head_dim]
    sin: torch.Tensor
    decode_attn: str = "fold"  # "fold" (query group folded into the query axis) or "native" (enable_gqa)
    prefill_attn: str = "repeat"  # "native" (enable_gqa) or "repeat" (repeat_interleave K/V heads)


def log(msg: str) -> None:
    print(f"[gpu_step] {msg}", flush=True)


# ---------------------------------------------------------------- weights


def _rand(shape: tuple[int, ...], plan: Plan, std: float) -> torch.Tensor:
    return torch.empty(shape, device=plan.device, dtype=plan.dtype).normal_(0.0, std)


def _ones(n: int, plan: Plan) -> torch.Tensor:
    return torch.ones(n, device=plan.device, dtype=plan.dtype)


def rope_tables(shape: Shape, max_pos: int, plan: Plan, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, shape.head_dim, 2, device=plan.device, dtype=torch.float32) / shape.head_dim)
    angles = torch.outer(torch.arange(max_pos, device=plan.device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(plan.dtype), angles.sin().to(plan.dtype)


def build_model(plan: Plan, max_pos: int) -> Model:
    """Random weights made in place on the device (never through host memory); fused QKV and gate/up as vLLM."""
    s = plan.shape
    qkv_out = (s.heads + 2 * s.kv_heads) * s.head_dim
    layers = [LayerWeights(ln1=_ones(s.hidden, plan),
                           qkv=_rand((qkv_out, s.hidden), plan, 0.5 / math.sqrt(s.hidden)),
                           o=_rand((s.hidden, s.heads * s.head_dim), plan, 0.5 / math.sqrt(s.hidden)),
                           ln2=_ones(s.hidden, plan),
                           gate_up=_rand((2 * s.ffn, s.hidden), plan, 0.5 / math.sqrt(s.hidden)),
                           down=_rand((s.hidden, s.ffn), plan, 0.5 / math.sqrt(s.ffn)))
              for _ in range(s.layers)]
    cos, sin = rope_tables(s, max_pos, plan)
    return Model(s, _rand((s.vocab, s.hidden), plan, 1.0), layers, _ones(s.hidden, plan),
                 _rand((s.vocab, s.hidden), plan, 0.5 / math.sqrt(s.hidden)), cos, sin)


def model_bytes(m: Model) -> int:
    tensors = [m.embed, m.norm, m.lm_head] + [t for lw in m.layers for t in asdict_tensors(lw)]
    return sum(t.numel() * t.element_size() for t in tensors)


def asdict_tensors(lw: LayerWeights) -> list[torch.Tensor]:
    return [lw.ln1, lw.qkv, lw.o, lw.ln2, lw.gate_up, lw.down]


# ---------------------------------------------------------------- forward


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, lw.down)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, native_gqa: bool) -> torch.Tensor:
    if native_gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, s: Shape, mode: str) -> torch.Tensor:
    """q [B, H, D] against the cache [B, Hkv, L+1, D]. "fold": the G query heads sharing a KV head become G
    query rows of that head (exact for one new token, no mask, no K/V copy); "native": enable_gqa."""
    b = q.shape[0]
    if mode == "fold":
        out = sdpa(q.view(b, s.kv_heads, s.group, s.head_dim), kc, vc, causal=False, native_gqa=False)
    else:
        out = sdpa(q.view(b, s.heads, 1, s.head_dim), kc, vc, causal=False, native_gqa=True)
    return out.reshape(b, s.heads * s.head_dim)


def decode_layer(h: torch.Tensor, lw: LayerWeights, cache: tuple[torch.Tensor, torch.Tensor], m: Model,
                 pos: int) -> torch.Tensor:
    s, b = m.shape, h.shape[0]
    q, k, v = F.linear(rms_norm(h, lw.ln1), lw.qkv).split(
        [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
    cos, sin = m.cos[pos], m.sin[pos]
    q = rope(q.reshape(b, s.heads, s.head_dim), cos, sin)
    kc, vc = cache
    kc[:, :, pos] = rope(k.reshape(b, s.kv_heads, s.head_dim), cos, sin)
    vc[:, :, pos] = v.reshape(b, s.kv_heads, s.head_dim)
    h = h + F.linear(decode_attention(q, kc, vc, s, m.decode_attn), lw.o)
    return h + mlp(rms_norm(h, lw.ln2), lw)


def decode_step(m: Model, tokens: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                pos: int) -> torch.Tensor:
    """One new token for each of B sequences whose first ``pos`` tokens are cached; returns logits [B, vocab]."""
    h = F.embedding(tokens, m.embed)
    for lw, cache in zip(m.layers, caches, strict=True):
        h = decode_layer(h, lw, cache, m, pos)
    return F.linear(rms_norm(h, m.norm), m.lm_head)


def prefill_layer(h: torch.Tensor, lw: LayerWeights, m: Model) -> torch.Tensor:
    s, (n, p, _) = m.shape, h.shape
    q, k, v = F.linear(rms_norm(h, lw.ln1), lw.qkv).split(
        [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
    cos, sin = m.cos[:p].unsqueeze(1), m.sin[:p].unsqueeze(1)
    q = rope(q.view(n, p, s.heads, s.head_dim), cos, sin).transpose(1, 2)
    k = rope(k.view(n, p, s.kv_heads, s.head_dim), cos, sin).transpose(1, 2)
    v = v.view(n, p, s.kv_heads, s.head_dim).transpose(1, 2)
    native = m.prefill_attn == "native"
    if not native:
        k, v = k.repeat_interleave(s.group, dim=1), v.repeat_interleave(s.group, dim=1)
    out = sdpa(q, k, v, causal=True, native_gqa=native).transpose(1, 2).reshape(n, p, s.heads * s.head_dim)
    h = h + F.linear(out, lw.o)
    return h + mlp(rms_norm(h, lw.ln2), lw)


def prefill(m: Model, tokens: torch.Tensor) -> torch.Tensor:
    """N prompts of P tokens [N, P]; logits of each prompt's last token only, as vLLM computes them."""
    h = F.embedding(tokens, m.embed)
    for lw in m.layers:
        h = prefill_layer(h, lw, m)
    return F.linear(rms_norm(h[:, -1], m.norm), m.lm_head)


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], plan: Plan, budget: Budget, repeats: int | None = None) -> float:
    """Median of ``repeats`` timed calls after ``plan.warmup`` untimed ones (CUDA events on a GPU,
    perf_counter on the CPU). Stops repeating once the budget is spent (at least one timed call)."""
    for _ in range(plan.warmup):
        fn()
    sync(plan.device)
    samples: list[float] = []
    for _ in range(repeats or plan.repeats):
        if plan.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
        if budget.over():
            break
    return statistics.median(samples)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream, then capture one call (the recipe in PyTorch's CUDA graphs docs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- attention probes


def native_gqa_supported(device: torch.device) -> bool:
    q = torch.zeros(1, 4, 2, 8, device=device)
    kv = torch.zeros(1, 2, 2, 8, device=device)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def _probe(fn: Callable[[], object], plan: Plan, budget: Budget) -> float | None:
    try:
        return time_ms(fn, plan, budget, repeats=5)
    except (RuntimeError, TypeError) as err:
        log(f"attention probe failed: {str(err).splitlines()[0][:120]}")
        return None


def choose_attention(m: Model, plan: Plan, budget: Budget) -> dict[str, Any]:
    """Times the candidate GQA forms at a representative size and keeps the faster: decode "fold" vs "native"
    (enable_gqa), prefill "native" vs "repeat" (repeat_interleave the K/V heads, a copy)."""
    s, native = m.shape, native_gqa_supported(plan.device)
    b, ctx, p = min(8, max(plan.batches)), plan.contexts[0] + 1, min(2048, max(plan.prompts))
    q1 = _rand((b, s.heads, s.head_dim), plan, 1.0)
    kc, vc = _rand((b, s.kv_heads, ctx, s.head_dim), plan, 1.0), _rand((b, s.kv_heads, ctx, s.head_dim), plan, 1.0)
    dec = {"fold": _probe(lambda: decode_attention(q1, kc, vc, s, "fold"), plan, budget)}
    if native:
        dec["native"] = _probe(lambda: decode_attention(q1, kc, vc, s, "native"), plan, budget)
    qp = _rand((1, s.heads, p, s.head_dim), plan, 1.0)
    kp, vp = _rand((1, s.kv_heads, p, s.head_dim), plan, 1.0), _rand((1, s.kv_heads, p, s.head_dim), plan, 1.0)
    pre = {"repeat": _probe(lambda: sdpa(qp, kp.repeat_interleave(s.group, 1), vp.repeat_interleave(s.group, 1),
                                         True, False), plan, budget)}
    if native:
        pre["native"] = _probe(lambda: sdpa(qp, kp, vp, True, True), plan, budget)
    m.decode_attn = _fastest(dec, "fold")
    m.prefill_attn = _fastest(pre, "repeat")
    gqa = m.prefill_attn == "native"
    kp, vp = (kp, vp) if gqa else (kp.repeat_interleave(s.group, 1), vp.repeat_interleave(s.group, 1))
    return {"enable_gqa_supported": native, "decode_probe_ms": dec, "prefill_probe_ms": pre,
            "decode": m.decode_attn, "prefill": m.prefill_attn, "probe_sizes": {"batch": b, "context": ctx, "prompt": p},
            "decode_backends_accepting": accepting_backends(lambda: decode_attention(q1, kc, vc, s, m.decode_attn)),
            "prefill_backends_accepting": accepting_backends(lambda: sdpa(qp, kp, vp, True, gqa))}


def accepting_backends(fn: Callable[[], object]) -> list[str]:
    """Which SDPA kernels accept the call when forced (CUDA only): says whether the default dispatch could pick
    flash/cuDNN/memory-efficient attention or fell back to the unfused math one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    ok = []
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")  # each refusing kernel warns why
                fn()
            ok.append(name)
        except RuntimeError:
            pass
    return ok


def _fastest(times: dict[str, float | None], default: str) -> str:
    ok = {k: v for k, v in times.items() if v is not None}
    return min(ok, key=lambda k: ok[k]) if ok else default


# ---------------------------------------------------------------- decode


def fitting_batches(plan: Plan, context: int) -> tuple[list[int], list[int]]:
    """(batches whose KV cache fits next to the weights with a margin, batches that do not)."""
    per_seq = plan.shape.kv_bytes_per_token(torch.finfo(plan.dtype).bits // 8) * (context + 1)
    if plan.device.type == "cuda":
        free_bytes = torch.cuda.mem_get_info(plan.device)[0] - 4 * GIB
    else:
        import os

        free_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    fit = [b for b in plan.batches if b * per_seq <= free_bytes]
    return fit, [b for b in plan.batches if b not in fit]


def alloc_cache(plan: Plan, batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    s = plan.shape
    dims = (batch, s.kv_heads, context + 1, s.head_dim)
    return [(_rand(dims, plan, 1.0), _rand(dims, plan, 1.0)) for _ in range(s.layers)]


def time_decode(m: Model, plan: Plan, budget: Budget, caches: list[tuple[torch.Tensor, torch.Tensor]],
                batch: int, context: int) -> DecodeRecord:
    views = [(k[:batch], v[:batch]) for k, v in caches]
    tokens = torch.randint(0, m.shape.vocab, (batch,), device=plan.device)
    kv_gib = batch * (context + 1) * m.shape.kv_bytes_per_token(torch.finfo(plan.dtype).bits // 8) / GIB
    rec = DecodeRecord(context, batch, None, None, round(kv_gib, 3))

    def step() -> torch.Tensor:
        return decode_step(m, tokens, views, context)

    if plan.use_graphs:
        try:
            graph = capture_graph(step)
            rec.graph_ms = time_ms(graph.replay, plan, budget)
            del graph
        except RuntimeError as err:
            rec.note = f"graph failed: {str(err).splitlines()[0][:100]}"
            log(rec.note)
        free(plan.device)
    if not budget.over():
        rec.eager_ms = time_ms(step, plan, budget, repeats=max(3, plan.repeats // 3))
    return rec


def run_decode(m: Model, plan: Plan, budget: Budget, res: Results, context: int) -> None:
    fit, too_big = fitting_batches(plan, context)
    for b in too_big:
        res.skipped.append(f"decode B={b} L={context}: KV cache does not fit")
        log(f"skip decode B={b} L={context}: KV cache does not fit")
    if not fit:
        return
    caches = alloc_cache(plan, max(fit), context)
    try:
        for b in fit:
            if budget.over():
                res.skipped.append(f"decode B={b} L={context}: budget spent")
                continue
            try:
                rec = time_decode(m, plan, budget, caches, b, context)
            except RuntimeError as err:  # torch.cuda.OutOfMemoryError is one
                res.skipped.append(f"decode B={b} L={context}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
                log(res.skipped[-1])
                free(plan.device)
                continue
            res.decode.append(rec)
            log(f"decode L={context} B={b:4d}: graph {_ms(rec.graph_ms)}  eager {_ms(rec.eager_ms)}  "
                f"(KV {rec.kv_gib:.2f} GiB, {budget.used():.0f} s)")
    finally:
        del caches
        free(plan.device)


# ---------------------------------------------------------------- prefill


def time_prefill(m: Model, plan: Plan, budget: Budget, n: int, p: int) -> PrefillRecord:
    tokens = torch.randint(0, m.shape.vocab, (n, p), device=plan.device)
    repeats = max(2, min(plan.repeats, int(2e5 // (n * p)) or 2))
    ms = time_ms(lambda: prefill(m, tokens), plan, budget, repeats=repeats)
    return PrefillRecord(n, p, ms, n * p / (ms / 1e3))


def run_prefill(m: Model, plan: Plan, budget: Budget, res: Results) -> None:
    shapes = [(1, p) for p in plan.prompts] + [plan.prefill_batch]
    for n, p in shapes:
        if budget.over():
            res.skipped.append(f"prefill {n}x{p}: budget spent")
            continue
        try:
            rec = time_prefill(m, plan, budget, n, p)
        except RuntimeError as err:  # torch.cuda.OutOfMemoryError is one
            rec = PrefillRecord(n, p, None, None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
        free(plan.device)
        res.prefill.append(rec)
        log(f"prefill {n}x{p}: {_ms(rec.ms)}  {rec.tokens_per_s or 0:,.0f} tokens/s ({budget.used():.0f} s)")


# ---------------------------------------------------------------- fit and profile


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, r^2)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, (1.0 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def fit_decode(records: list[DecodeRecord]) -> list[Fit]:
    """Per context: step seconds = alpha + beta x B on the graph times (eager where no graph ran)."""
    fits = []
    for ctx in sorted({r.context for r in records}):
        rows = [r for r in records if r.context == ctx]
        source = "graph" if all(r.graph_ms is not None for r in rows) else "eager"
        pts = [(r.batch, r.graph_ms if source == "graph" else r.eager_ms) for r in rows]
        pts_ok = [(float(b), t / 1e3) for b, t in pts if t is not None]
        if len({b for b, _ in pts_ok}) < 2:
            continue
        a, b, r2 = fit_line([p[0] for p in pts_ok], [p[1] for p in pts_ok])
        fits.append(Fit(ctx, source, a, b, r2, len(pts_ok)))
    return fits


def load_profile(path: Path = PROFILES, key: tuple[str, str] = PROFILE_KEY) -> dict[str, Any] | None:
    """The (model, flavor) row of rayscale's profiles.yaml, read with plain pyyaml; None where pyyaml or the file
    is missing (the script must run on a machine with only torch)."""
    try:
        import yaml
    except ImportError:
        return None
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    for row in (doc or {}).get("profiles", []):
        if (row.get("model"), row.get("flavor")) == key:
            keep = ("model", "flavor", "prefill_tokens_per_s", "itl_alpha_s", "itl_beta_s", "source")
            return {k: row.get(k) for k in keep}
    return None


# ---------------------------------------------------------------- report

LOWER_BOUND = (
    "This is an engine-free lower bound, not a vLLM measurement: random weights, one contiguous KV cache per layer "
    "(no paged attention, no block tables), no scheduler, no sampling or detokenisation, no HTTP or streaming, "
    "unfused RMSNorm/SiLU/RoPE (vLLM fuses them) and every sequence at the same context. A vLLM decode step at the "
    "same batch and context does the same GEMMs and reads the same KV bytes, plus paged-attention indexing, "
    "sampling and its scheduler's CPU time (partly overlapped), and steps that carry a prefill chunk (chunked "
    "prefill) take longer still; so vLLM's inter-token latency should sit above these step times, and the "
    "profile's itl_alpha_s/itl_beta_s (fitted to end-to-end ITL under mixed traffic) above them again. Decode cost "
    "also grows with context (each sequence's KV is read every step), which the profile's beta does not model.")


def _ms(x: float | None) -> str:
    return f"{x:8.3f} ms" if x is not None else "       - "


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def decode_table(res: Results) -> list[str]:
    wbytes = float(res.meta.get("weights_gib", 0.0)) * GIB
    lines = ["| context L | batch B | graph step ms | eager step ms | tokens/s (graph) | GB/s moved (graph) | KV GiB |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res.decode:
        moved = None if r.graph_ms is None else (wbytes + r.kv_gib * GIB) / (r.graph_ms / 1e3) / 1e9
        tps = None if r.graph_ms is None else r.batch / (r.graph_ms / 1e3)
        lines.append(f"| {r.context} | {r.batch} | {_num(r.graph_ms, '.3f')} | {_num(r.eager_ms, '.3f')} | "
                     f"{_num(tps, ',.0f')} | {_num(moved, ',.0f')} | {r.kv_gib:.2f} |")
    return lines


def prefill_table(res: Results) -> list[str]:
    flop_per_token = 2.0 * float(res.meta.get("params", 0))
    lines = ["| prompts x tokens | ms | tokens/s | TFLOP/s (2 x params x tokens, attention excluded) |",
             "| --- | ---: | ---: | ---: |"]
    for r in res.prefill:
        tflops = None if r.tokens_per_s is None else r.tokens_per_s * flop_per_token / 1e12
        lines.append(f"| {r.sequences} x {r.tokens_each} | {_num(r.ms, '.2f')} | {_num(r.tokens_per_s, ',.0f')} | "
                     f"{_num(tflops, '.1f')} |{' ' + r.note if r.note else ''}")
    return lines


def fit_table(res: Results) -> list[str]:
    lines = ["| context L | fitted on | alpha ms | beta ms per sequence | r^2 | points |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {f.context} | {f.source} | {1e3 * f.alpha_s:.3f} | {1e3 * f.beta_s:.4f} | {f.r2:.4f} | {f.points} |"
              for f in res.fits]
    return lines


def compare_table(res: Results) -> list[str]:
    prof = res.profile
    if not prof:
        return ["(profile for mistral-7b on h100 not found: no pyyaml or no rayscale/data/profiles.yaml)"]
    lines = [f"Profile ({prof['model']}, {prof['flavor']}): {prof.get('source', '')}", ""]
    if res.meta.get("shape") != prof["model"]:
        lines += [f"(the {res.meta.get('shape')} shape is not {prof['model']}: the comparison only shows the format)", ""]
    lines += ["| quantity | this benchmark | profile | profile / benchmark |", "| --- | ---: | ---: | ---: |"]

    def row(name: str, ours: float | None, theirs: float, fmt: str) -> None:
        ratio = "-" if not ours else f"{theirs / ours:.2f}"
        lines.append(f"| {name} | {_num(ours, fmt)} | {format(theirs, fmt)} | {ratio} |")

    alpha, beta = float(prof["itl_alpha_s"]), float(prof["itl_beta_s"])
    if res.fits:
        f = res.fits[0]
        row(f"itl_alpha_s (L={f.context})", f.alpha_s, alpha, ".5f")
        row(f"itl_beta_s (L={f.context})", f.beta_s, beta, ".6f")
    first = [r for r in res.decode if res.decode and r.context == res.decode[0].context]
    for r in first:
        ours = r.graph_ms if r.graph_ms is not None else r.eager_ms
        row(f"step s at B={r.batch} (L={r.context})", None if ours is None else ours / 1e3, alpha + beta * r.batch,
            ".5f")
    for p in res.prefill:
        row(f"prefill_tokens_per_s ({p.sequences} x {p.tokens_each})", p.tokens_per_s,
            float(prof["prefill_tokens_per_s"]), ",.0f")
    return lines


def render(res: Results) -> str:
    m = res.meta
    head = [f"# Engine-free decode step and prefill: {m['shape']} shape on {m['device_name']}", "",
            f"- device: {m['device_name']} ({m['device']}); torch {m['torch']}, CUDA {m['cuda']}; {m['date']}",
            f"- command: `{m['command']}`",
            f"- shape: {m['shape_detail']}; {m['dtype']}; weights {m.get('weights_gib', 0):.2f} GiB "
            f"({m.get('params', 0) / 1e6:,.1f} M params) made on the device in {m.get('init_s', 0):.1f} s",
            f"- attention: {res.attention or 'not chosen'}",
            f"- timing: median of up to {m['repeats']} runs after {m['warmup']} warm-up "
            f"({'CUDA events; decode replayed from one CUDA graph per batch' if m['device'] == 'cuda' else 'perf_counter, no CUDA graphs'}); "
            f"budget {m['budget_s']:.0f} s, used {m.get('used_s', 0):.0f} s",
            "", f"**{LOWER_BOUND}**", ""]
    body = ["## Decode step (one new token for each of B sequences at context L)", "", *decode_table(res), "",
            "## Fit: step time = alpha + beta x B", "", *fit_table(res), "",
            "## Prefill", "", *prefill_table(res), "",
            "## Against rayscale's profile", "", *compare_table(res), ""]
    if res.skipped:
        body += ["## Skipped", "", *[f"- {s}" for s in res.skipped], ""]
    return "\n".join(head + body)


def write(res: Results, out: Path, js: Path) -> None:
    res.fits = fit_decode(res.decode)
    out.parent.mkdir(parents=True, exist_ok=True)
    js.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(res))
    js.write_text(json.dumps(asdict(res), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--tiny", action="store_true", help="tiny shape that runs on a CPU in seconds")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_step.md"))
    ap.add_argument("--json", default=None, help="raw numbers (default: --out with .json)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop adding measurements after this long")
    ap.add_argument("--batches", type=_ints, default=None, help="decode batch sizes, e.g. 1,8,32")
    ap.add_argument("--context", type=_ints, default=None, help="decode context lengths L, e.g. 1024,4096")
    ap.add_argument("--prompts", type=_ints, default=None, help="single-prompt prefill lengths")
    ap.add_argument("--prefill-batch", default=None, help="NxP: N prompts of P tokens in one forward")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-graphs", action="store_true", help="time decode eagerly only")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    device = torch.device(want)
    tiny = args.tiny
    n, p = (args.prefill_batch or ("2x64" if tiny else "8x1024")).lower().split("x")
    return Plan(shape=TINY if tiny else MISTRAL_7B, device=device,
                dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype],
                batches=args.batches or ([1, 4] if tiny else [1, 8, 32, 64, 128, 256]),
                contexts=args.context or ([128] if tiny else [1024]),
                prompts=args.prompts or ([64, 128] if tiny else [512, 2048, 8192]),
                prefill_batch=(int(n), int(p)),
                repeats=args.repeats or (5 if tiny else 20), warmup=args.warmup or (1 if tiny else 3),
                use_graphs=device.type == "cuda" and not args.no_graphs)


def describe(plan: Plan, args: argparse.Namespace, command: str) -> dict[str, Any]:
    s, dev = plan.shape, plan.device
    import platform

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    return {"device": dev.type, "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": command,
            "shape": s.name, "shape_detail": f"{s.layers} layers, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV "
            f"heads x {s.head_dim}, SwiGLU {s.ffn}, vocab {s.vocab}", "dtype": str(plan.dtype).replace("torch.", ""),
            "repeats": plan.repeats, "warmup": plan.warmup, "budget_s": args.budget_s,
            "gpu_total_gib": torch.cuda.get_device_properties(dev).total_memory / GIB if dev.type == "cuda" else None}


def run_phases(plan: Plan, budget: Budget, res: Results, out: Path, js: Path) -> None:
    t0 = time.perf_counter()
    log(f"making {plan.shape.params() / 1e6:,.1f} M random {plan.dtype} parameters on {plan.device}")
    max_pos = max([*plan.prompts, plan.prefill_batch[1], *(c + 1 for c in plan.contexts)])
    model = build_model(plan, max_pos)
    sync(plan.device)
    res.meta.update(init_s=time.perf_counter() - t0, params=plan.shape.params(), weights_gib=model_bytes(model) / GIB)
    log(f"weights {res.meta['weights_gib']:.2f} GiB in {res.meta['init_s']:.1f} s")
    res.attention = choose_attention(model, plan, budget)
    free(plan.device)
    log(f"attention: decode {model.decode_attn}, prefill {model.prefill_attn} ({res.attention})")
    run_decode(model, plan, budget, res, plan.contexts[0])
    write(res, out, js)
    run_prefill(model, plan, budget, res)
    write(res, out, js)
    for ctx in plan.contexts[1:]:
        run_decode(model, plan, budget, res, ctx)
        write(res, out, js)


def main(argv: list[str] | None = None) -> int:
    command = shlex.join(sys.orig_argv) if argv is None else f"bench.gpu_step.main({argv!r})"
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    plan = make_plan(args)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    js = Path(args.json) if args.json else out.with_suffix(".json")
    budget = Budget(args.budget_s)
    res = Results(meta=describe(plan, args, command), profile=load_profile())
    log(f"{res.meta['device_name']}, torch {res.meta['torch']}, CUDA {res.meta['cuda']}; budget {args.budget_s:.0f} s")
    try:
        with torch.inference_mode():
            run_phases(plan, budget, res, out, js)
    finally:
        res.meta["used_s"] = budget.used()
        if plan.device.type == "cuda":
            res.meta["peak_gib"] = torch.cuda.max_memory_allocated(plan.device) / GIB
        write(res, out, js)
        print("\n".join(["", *decode_table(res), "", *fit_table(res), "", *prefill_table(res), "",
                         *compare_table(res), ""]), flush=True)
        log(f"wrote {out} and {js} ({budget.used():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
