"""Windowed aggregation of engine, ingress and Serve metrics into the core's ModelSignals (pure: samples in,
signals out).

Input is a sequence of scrapes: each a timestamp and the parsed series of every replica's engine metrics
(vLLM names as Ray exports them, ``ray_vllm_*``, labelled with model, flavor and ReplicaId). Counters
and histograms are differenced over the window (a counter that went down was reset: its new value is
the delta); gauges take the newest value. A model whose newest sample is older than ``stale_after_s``
is STALE; one never seen is MISSING; a model whose counters stood still is FRESH with zero load.

Freshness is the engines'. The ingress's series (``ray_rayscale_ingress_*``: in flight, waiting for a first
byte, accepted, TTFT from arrival to first byte, held while no replica of the model can serve) and Serve's
router queues (``ray_serve_deployment_queued_queries``) see what waits before an engine, and are attached
whatever the engines' freshness: a model whose engine metrics are missing while the ingress holds its
requests is loaded, not idle.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from rayscale.core.settings import MIX_MAX_S
from rayscale.core.signals import MIX_QUANTILES, FlavorObservation, Freshness, ModelSignals, RequestMix
from rayscale.serve.metrics import (
    INGRESS_ARRIVALS,
    INGRESS_EXPORTED,
    INGRESS_IN_FLIGHT,
    INGRESS_PREFIX,
    INGRESS_TTFT,
    INGRESS_WAITING,
    SERVE_QUEUED_EXPORTED,
)
from rayscale.serve.readiness import HELD_EXPORTED

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]  # (metric name, sorted labels)

P = "ray_vllm_"
TTFT = P + "time_to_first_token_seconds"
TPOT = P + "request_time_per_output_token_seconds"
E2E = P + "e2e_request_latency_seconds"
PREFILL = P + "request_prefill_time_seconds"  # scheduled -> first token: TTFT without the queue
PROMPT = P + "prompt_tokens_total"
GEN = P + "generation_tokens_total"
PROMPT_HIST = P + "request_prompt_tokens"
GEN_HIST = P + "request_generation_tokens"  # per finished request: the exact output mean of the window
RUNNING = P + "num_requests_running"
WAITING = P + "num_requests_waiting"
KV = P + "kv_cache_usage_perc"
# vLLM's prefix cache counters (vllm:prefix_cache_queries / _hits, in prompt tokens), as Ray exports them.
PREFIX_QUERIES = P + "prefix_cache_queries_total"
PREFIX_HITS = P + "prefix_cache_hits_total"

IN_FLIGHT = INGRESS_EXPORTED[INGRESS_IN_FLIGHT]
ING_WAITING = INGRESS_EXPORTED[INGRESS_WAITING]
ACCEPTED = INGRESS_EXPORTED[INGRESS_ARRIVALS]
CLIENT_TTFT = INGRESS_EXPORTED[INGRESS_TTFT]
HELD = HELD_EXPORTED  # held by the ingress: no replica of the model can serve yet (starting or at zero)
SERVE_QUEUED = SERVE_QUEUED_EXPORTED
# The ingress deployment's name (rayscale.serve.app.INGRESS_NAME): the proxy's router queues for it before
# the request's model is known.
INGRESS_DEPLOYMENT = "ingress"
# What the scraper keeps of each node's exposition.
PREFIXES = (P, INGRESS_PREFIX, SERVE_QUEUED)


@dataclass(frozen=True)
class Scrape:
    t: float
    series: dict[SeriesKey, float]
    ok: bool = True  # False: the source could not be read at t (its series are absent, not zero)


def labels(**kv: str) -> Labels:
    return tuple(sorted(kv.items()))


def _label(lbls: Labels, key: str) -> str:
    for k, v in lbls:
        if k == key:
            return v
    return ""


@dataclass
class _Acc:
    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buckets: dict[str, dict[float, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    gauges: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    replicas: set[str] = field(default_factory=set)


def _delta(new: float, old: float | None) -> float:
    if old is None or new < old:  # first sight in the window or a reset: count from zero
        return new if old is not None else 0.0
    return new - old


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (linear inside a bucket)."""
    if not buckets:
        return None
    bs = sorted(buckets.items())
    total = bs[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return bs[-1][0]


def histogram_share(x: float, buckets: dict[float, float]) -> float | None:
    """Share of a histogram's observations at or below ``x`` (linear inside a bucket: the inverse of
    ``histogram_quantile``); None without observations."""
    bs = sorted(buckets.items())
    if not bs or bs[-1][1] <= 0:
        return None
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if x < le:
            inside = 0.0 if math.isinf(le) else (x - prev_le) / (le - prev_le)
            return (prev_c + inside * (c - prev_c)) / bs[-1][1]
        prev_le, prev_c = le, c
    return 1.0


def met_share(ttft_buckets: dict[float, float], tpot_buckets: dict[float, float],
              targets: tuple[float, float]) -> float | None:
    """Share of a window's requests within both SLO targets (TTFT, TPOT) from the two latency histograms.
    The histograms do not pair a request's TTFT with its TPOT, so a request missing both may count twice:
    the share is a lower bound (1 minus the sum of the misses)."""
    ttft = histogram_share(targets[0], ttft_buckets)
    tpot = histogram_share(targets[1], tpot_buckets)
    if ttft is None:
        return None
    return max(ttft - (1.0 - tpot if tpot is not None else 0.0), 0.0)


def prefix_hit_rate(counters: dict[str, float]) -> float | None:
    """Prompt tokens found cached over those looked up, from the window's counter deltas; None when either
    counter is missing (prefix caching off, an engine that does not export them) or nothing was looked up:
    an unobserved hit rate is never read as 0 or guessed."""
    queries, hits = counters.get(PREFIX_QUERIES), counters.get(PREFIX_HITS)
    if queries is None or hits is None or queries <= 0:
        return None
    return min(max(hits / queries, 0.0), 1.0)


def _quantiles(buckets: dict[float, float]) -> tuple[float, ...] | None:
    """A token histogram's lengths at MIX_QUANTILES, for the estimator's tail terms; None without one."""
    qs = [histogram_quantile(u, buckets) for u in MIX_QUANTILES]
    return None if any(q is None for q in qs) else tuple(max(q or 0.0, 1.0) for q in qs)


def _longest(buckets: dict[float, float]) -> float | None:
    """The upper bound of a token histogram's highest bucket that gained observations (the longest length
    is at most that); None without observations or with some past the last finite bound."""
    bs = sorted(buckets.items())
    if not bs or bs[-1][1] <= 0:
        return None
    top = next(le for le, c in bs if c >= bs[-1][1])
    return None if math.isinf(top) else top


# What a request mix is computed from: older scrapes are kept trimmed to these (``mix_only``).
_MIX_SERIES = (PROMPT, GEN, TTFT + "_count", E2E + "_count", PROMPT_HIST, GEN_HIST)


def mix_only(scrape: Scrape) -> Scrape:
    """``scrape`` with only the series a request mix is computed from (no latency histograms or gauges)."""
    return Scrape(scrape.t, {k: v for k, v in scrape.series.items() if k[0].startswith(_MIX_SERIES)}, scrape.ok)


def _mix(first: Scrape, last: Scrape, model: str) -> tuple[RequestMix | None, float]:
    """The request mix of ``model`` between two scrapes, and how many finished requests it is from."""
    c: dict[str, float] = defaultdict(float)
    b: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for (name, lbls), v in last.series.items():
        if not name.startswith(_MIX_SERIES) or _label(lbls, "model") != model:
            continue
        d = _delta(v, first.series.get((name, lbls)))
        if name.endswith("_bucket"):
            b[name[: -len("_bucket")]][float(_label(lbls, "le") or "inf")] += d
        else:
            c[name] += d
    started, done, finished = c[TTFT + "_count"], c[E2E + "_count"], c[GEN_HIST + "_count"]
    if not started or not (finished or done):
        return None, finished or done
    # Engines without the histogram: tokens generated over requests finished (ramps overstate it).
    output_mean = c[GEN_HIST + "_sum"] / finished if finished else c[GEN] / done
    prompt_mean = c[PROMPT] / started
    p95 = histogram_quantile(0.95, b.get(PROMPT_HIST, {}))
    return RequestMix(prompt_mean, max(output_mean, 1.0), p95 or 2.0 * prompt_mean,
                      _quantiles(b.get(PROMPT_HIST, {})), _quantiles(b.get(GEN_HIST, {})),
                      _longest(b.get(PROMPT_HIST, {}))), finished or done


def _mix_span(ok: Sequence[Scrape], first: Scrape, last: Scrape, model: str, min_requests: int,
              max_s: float) -> RequestMix | None:
    """The mix from the latest scrape before ``first`` (within ``max_s`` of ``last``) after which at least
    ``min_requests`` finished, or from the earliest kept if none: a 30 s window at a few requests a second
    holds too few for the tail quantiles the estimator reads, and their noise swings capacity by replicas."""
    mix, n = _mix(first, last, model)
    if n >= min_requests:
        return mix
    older = [s for s in ok if last.t - max_s <= s.t < first.t]
    if not older:
        return mix
    # Finished requests since a scrape fall as the scrape gets later: the last start still holding enough.
    lo, hi = 0, len(older) - 1
    if _mix(older[0], last, model)[1] >= min_requests:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _mix(older[mid], last, model)[1] >= min_requests:
                lo = mid
            else:
                hi = mid - 1
    wide, _ = _mix(older[lo], last, model)
    return wide or mix


def arrival_rate(first: Scrape, last: Scrape, model: str) -> float:
    """Requests of ``model`` per second between two scrapes: the larger of what reached the engines (first
    tokens, admitted and prefilled, plus the growth of their queues) and what the ingress accepted."""
    def total(s: Scrape, name: str) -> float:
        return sum(v for (n, lb), v in s.series.items() if n == name and _label(lb, "model") == model)

    started = 0.0
    for (n, lb), v in last.series.items():
        if n == TTFT + "_count" and _label(lb, "model") == model:
            started += _delta(v, first.series.get((n, lb)))
    dt = max(last.t - first.t, 1e-9)
    engines = max(0.0, started + total(last, WAITING) - total(first, WAITING)) / dt
    # Requests held before the engines (Serve's queues, the ingress) count from their arrival at the ingress.
    return max(engines, _accepted_rate(first, last, model))


@dataclass(frozen=True)
class IngressView:
    """One model's load as the ingress and Serve's routers see it (before any engine)."""

    in_flight: float  # accepted by the ingress, not finished
    waiting: float  # not yet answered by an engine: the ingress's waiting, or engines' plus Serve's queues
    arrival_rate_rps: float | None  # requests the ingress accepted per second; None: under two scrapes
    client_ttft_p95_s: float | None  # arrival at the ingress -> first byte, over the window
    age_s: float
    held: float = 0.0  # of in_flight and waiting: held until a replica of the model can serve
    # The client TTFT histogram's counts over the window (cumulative per ``le``), for the SLO met share.
    client_ttft_buckets: dict[float, float] = field(default_factory=dict)


def _model_of(deployment: str) -> str:
    """A flavor deployment's model (``{model}--{flavor}``, rayscale.serve.config.deployment_name)."""
    model, sep, _ = deployment.rpartition("--")
    return model if sep else ""


def serve_queued(scrape: Scrape) -> dict[str, float]:
    """Requests Serve's routers hold per deployment (summed over handles): every replica is at
    max_ongoing_requests. Keyed by deployment name."""
    out: dict[str, float] = defaultdict(float)
    for (name, lbls), v in scrape.series.items():
        if name == SERVE_QUEUED:
            out[_label(lbls, "deployment")] += v
    return dict(out)


def _ingress_total(s: Scrape, name: str, model: str) -> float | None:
    vals = [v for (n, lb), v in s.series.items() if n == name and _label(lb, "model") == model]
    return sum(vals) if vals else None


def _accepted_rate(first: Scrape, last: Scrape, model: str) -> float:
    got = 0.0
    for (n, lb), v in last.series.items():
        if n == ACCEPTED and _label(lb, "model") == model:
            got += _delta(v, first.series.get((n, lb)))
    return got / max(last.t - first.t, 1e-9)


def ingress_views(ok: Sequence[Scrape], now: float, window_s: float, stale_after_s: float,
                  fast_window_s: float | None = None) -> dict[str, IngressView]:
    """Per model with fresh ingress series: in flight and waiting (newest scrape holding them), accepted
    requests per second and client TTFT p95 over the window (the rate as ``aggregate``'s, fast window
    included). The proxy's queue for the ingress is split over models by their share of in-flight."""
    newest: dict[str, Scrape] = {}
    for s in ok:
        for (name, lbls) in s.series:
            if name.startswith(INGRESS_PREFIX) and (m := _label(lbls, "model")):
                newest[m] = s
    newest = {m: s for m, s in newest.items() if now - s.t <= stale_after_s}
    win = [s for s in ok if s.t >= now - window_s]
    out: dict[str, IngressView] = {}
    for m, s in newest.items():
        # Held requests are in flight and waiting too; counted apart, they are load even where the
        # ingress's other series are missing (a model at zero replicas has no engine to report them).
        held = _ingress_total(s, HELD, m) or 0.0
        in_flight = max(_ingress_total(s, IN_FLIGHT, m) or 0.0, held)
        queued = serve_queued(s)
        engines_queue = sum(v for d, v in queued.items() if _model_of(d) == m) + _engine_waiting(s, m)
        waiting = max(_ingress_total(s, ING_WAITING, m) or 0.0, engines_queue, held)
        rate = ttft = None
        if len(win) >= 2:
            first, last = win[0], win[-1]
            rate = _accepted_rate(first, last, m)
            if fast_window_s is not None:
                recent = [x for x in win if x.t <= last.t - fast_window_s]
                if recent and recent[-1] is not first:
                    rate = max(rate, _accepted_rate(recent[-1], last, m))
            buckets: dict[float, float] = defaultdict(float)
            for (n, lb), v in last.series.items():
                if n == CLIENT_TTFT + "_bucket" and _label(lb, "model") == m:
                    buckets[float(_label(lb, "le") or "inf")] += _delta(v, first.series.get((n, lb)))
            ttft = histogram_quantile(0.95, buckets)
        out[m] = IngressView(in_flight, waiting, rate, ttft, now - s.t, held, dict(buckets) if ttft is not None else {})
    # The proxy's router holds requests for the ingress before their model is known.
    total = sum(v.in_flight for v in out.values())
    for m, view in out.items():
        at_proxy = serve_queued(newest[m]).get(INGRESS_DEPLOYMENT, 0.0)
        if at_proxy and total > 0:
            share = at_proxy * view.in_flight / total
            out[m] = replace(view, in_flight=view.in_flight + share, waiting=view.waiting + share)
    return out


def _engine_waiting(s: Scrape, model: str) -> float:
    return sum(v for (n, lb), v in s.series.items() if n == WAITING and _label(lb, "model") == model)


def _with_ingress(sig: ModelSignals, view: IngressView | None) -> ModelSignals:
    """``sig`` with what waits before the engines: waiting is the larger of the engines' and the ingress's
    view (each request counted once), arrivals the larger of the engines' and the ingress's count."""
    if view is None:
        return sig
    rate = sig.arrival_rate_rps
    if view.arrival_rate_rps is not None:
        rate = view.arrival_rate_rps if rate is None else max(rate, view.arrival_rate_rps)
    return replace(sig, waiting=max(sig.waiting or 0.0, view.waiting), in_flight=view.in_flight,
                   arrival_rate_rps=rate, client_ttft_p95_s=view.client_ttft_p95_s)


def aggregate(scrapes: Sequence[Scrape], now: float, window_s: float = 30.0, stale_after_s: float = 20.0,
              models: Iterable[str] = (), fast_window_s: float | None = None, mix_min_requests: int = 0,
              mix_max_s: float = MIX_MAX_S,
              slo_targets: Mapping[str, tuple[float, float]] | None = None) -> dict[str, ModelSignals]:
    """ModelSignals per model from the scrapes within ``window_s`` of ``now``.

    The request mix reaches back past the window, over scrapes up to ``mix_max_s`` old (they may carry
    only the ``mix_only`` series), until it holds ``mix_min_requests`` finished requests.

    With ``fast_window_s``, the arrival rate is the larger of the rates over the whole window and over
    its last ``fast_window_s``: a load step shows within seconds instead of after half a window, while a
    drop still takes the whole window (and then the planner's downscale delay) to lower it.

    ``slo_targets``: per model, its (TTFT, TPOT) targets; the window's finished requests and the share of
    them within both (``met_share``, TTFT as clients see it where the ingress reports it) are then filled in.
    """
    ok = [s for s in scrapes if s.ok]
    views = ingress_views(ok, now, window_s, stale_after_s, fast_window_s)
    last_seen = _last_seen(ok)
    win = [s for s in ok if s.t >= now - window_s]
    out: dict[str, ModelSignals] = {}
    all_models = set(models) | set(last_seen) | set(views)
    if len(win) < 2:
        for m in all_models:
            fresh = Freshness.MISSING if m not in last_seen else Freshness.STALE
            age = now - last_seen[m] if m in last_seen else None
            out[m] = _with_ingress(ModelSignals(m, fresh, age), views.get(m))
        return out
    per_model, per_flavor = _accumulated(win[0], win[-1])
    busiest = _busiest(win)
    for m in all_models:
        age = now - last_seen[m] if m in last_seen else None
        if age is None or age > stale_after_s:
            fresh = Freshness.MISSING if age is None else Freshness.STALE
            out[m] = _with_ingress(ModelSignals(m, fresh, age), views.get(m))
            continue
        a = per_model.get(m, _Acc())
        arrivals = arrival_rate(win[0], win[-1], m)
        if fast_window_s is not None:
            recent = [s for s in win if s.t <= win[-1].t - fast_window_s]
            if recent and recent[-1] is not win[0]:
                arrivals = max(arrivals, arrival_rate(recent[-1], win[-1], m))
        view = views.get(m)
        finished = a.counters.get(TPOT + "_count")
        met = None
        if slo_targets and m in slo_targets and finished:
            ttft_buckets = (view.client_ttft_buckets if view and view.client_ttft_buckets
                            else a.buckets.get(TTFT, {}))
            met = met_share(ttft_buckets, a.buckets.get(TPOT, {}), slo_targets[m])
        out[m] = _with_ingress(ModelSignals(
            model=m, freshness=Freshness.FRESH, age_s=age, arrival_rate_rps=arrivals,
            mix=_mix_span(ok, win[0], win[-1], m, mix_min_requests, mix_max_s),
            waiting=sum(a.gauges.get(WAITING, [])), running=sum(a.gauges.get(RUNNING, [])),
            ttft_p95_s=histogram_quantile(0.95, a.buckets.get(TTFT, {})),
            tpot_p95_s=histogram_quantile(0.95, a.buckets.get(TPOT, {})),
            kv_usage=max(a.gauges.get(KV, [0.0])), per_flavor=_flavor_observations(m, per_flavor, busiest),
            prefix_hit_rate=prefix_hit_rate(a.counters), finished=finished if met is not None else None, slo_met=met,
        ), view)
    return out


def _last_seen(ok: Sequence[Scrape]) -> dict[str, float]:
    """Per model, the time of the newest scrape that carried one of its engines' series."""
    last_seen: dict[str, float] = {}
    for s in ok:
        for (name, lbls) in s.series:
            m = _label(lbls, "model")
            if m and name.startswith(P):
                last_seen[m] = max(last_seen.get(m, -math.inf), s.t)
    return last_seen


def _accumulated(first: Scrape, last: Scrape) -> tuple[dict[str, _Acc], dict[tuple[str, str], _Acc]]:
    """The engines' series between the window's first and last scrape, per model and per (model, flavor):
    histogram buckets and counters as increases, gauges as the last scrape's values."""
    per_model: dict[str, _Acc] = defaultdict(_Acc)
    per_flavor: dict[tuple[str, str], _Acc] = defaultdict(_Acc)
    for (name, lbls), v in last.series.items():
        m, f = _label(lbls, "model"), _label(lbls, "flavor")
        if not m or not name.startswith(P):
            continue
        accs = (per_model[m], per_flavor[(m, f)])
        rep = _label(lbls, "ReplicaId")
        old = first.series.get((name, lbls))
        for acc in accs:
            if rep:
                acc.replicas.add(rep)
        if name.endswith("_bucket"):
            le = float(_label(lbls, "le") or "inf")
            for acc in accs:
                acc.buckets[name[: -len("_bucket")]][le] += _delta(v, old)
        elif name.endswith(("_total", "_count", "_sum")):
            for acc in accs:
                acc.counters[name] += _delta(v, old)
        else:
            for acc in accs:
                acc.gauges[name].append(v)
    return per_model, per_flavor


def _busiest(win: Sequence[Scrape]) -> dict[tuple[str, str], float]:
    """Per (model, flavor), the largest of its replicas' mean running sequences over the window's scrapes
    (the batch its requests decoded at)."""
    running_of: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for s in win:
        for (name, lbls), v in s.series.items():
            if name == RUNNING:
                running_of[(_label(lbls, "model"), _label(lbls, "flavor"), _label(lbls, "ReplicaId"))].append(v)
    busiest: dict[tuple[str, str], float] = {}
    for (m, f, _), vs in running_of.items():
        busiest[(m, f)] = max(busiest.get((m, f), 0.0), sum(vs) / len(vs))
    return busiest


def _flavor_observations(model: str, per_flavor: Mapping[tuple[str, str], _Acc],
                         busiest: Mapping[tuple[str, str], float]) -> dict[str, FlavorObservation]:
    """What each flavor serving ``model`` reports over the window (the corrections' input)."""
    flav = {}
    for (m, f), fa in per_flavor.items():
        if m != model or not f:
            continue
        n = len(fa.replicas)
        fs = fa.counters.get(TTFT + "_count", 0.0)
        pn = fa.counters.get(PREFILL + "_count", 0.0)
        flav[f] = FlavorObservation(
            replicas=n,
            running_per_replica=sum(fa.gauges.get(RUNNING, [])) / n if n else None,
            running_max_replica=busiest.get((m, f)),
            ttft_p95_s=histogram_quantile(0.95, fa.buckets.get(TTFT, {})),
            tpot_p95_s=histogram_quantile(0.95, fa.buckets.get(TPOT, {})),
            prompt_mean=fa.counters.get(PROMPT, 0.0) / fs if fs else None,
            completed=fa.counters.get(TPOT + "_count", 0.0),
            # A histogram's _sum/_count is exact where its buckets (from 0.3 s) are too coarse.
            prefill_mean_s=fa.counters.get(PREFILL + "_sum", 0.0) / pn if pn else None,
            prefix_hit_rate=prefix_hit_rate(fa.counters),
            kv_usage=sum(kv) / len(kv) if (kv := fa.gauges.get(KV)) else None,
        )
    return flav


def exposition_of(text: str, prefix: str | tuple[str, ...]) -> str:
    """The lines of a Prometheus text exposition that ``parse_prometheus`` keeps: samples named ``prefix...``
    and their families' HELP and TYPE lines. A Ray node's exposition is mostly Ray's own metrics (a node
    serving one model: 853 KB, 2,505 lines, 241 kept), which prometheus_client's parser takes 130 ms to read
    per node and period, against 18 ms for the kept lines (bench/results/parse_metrics.md). Exact: a family's
    samples are named after it, and the text format escapes newlines inside HELP text and label values."""
    keep = []
    for line in text.split("\n"):
        s = line.lstrip()
        if s.startswith("#"):
            parts = s.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2].startswith(prefix):
                keep.append(s)
        elif s.startswith(prefix):
            keep.append(s)
    return "\n".join(keep) + "\n" if keep else ""


def parse_prometheus(text: str, prefix: str | tuple[str, ...] = PREFIXES) -> dict[SeriesKey, float]:
    """Series of a Prometheus text exposition whose names start with ``prefix`` (one or a tuple)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[SeriesKey, float] = {}
    for fam in text_string_to_metric_families(exposition_of(text, prefix)):
        for s in fam.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out
