"""The reconcile loop: observe -> estimate -> plan -> act, one decision record per period.

The controller is the only writer of Serve replica counts and of nodes. It keeps no state it cannot
lose: gangs come from the actuator (labels), replicas from Serve; what it remembers (metric window,
planner timers, profile corrections, back-offs) only shapes how fast it moves, never what exists. That
memory is checkpointed to a store every period and read back when the controller starts or takes the
Lease over (rayscale.core.checkpoint), so a restart does not start it blind.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rayscale.cluster.actuator import Actuator, apply_actions
from rayscale.controller.checkpoint import StateStore
from rayscale.controller.serve_client import ServeClient, ServeSnapshot, deployment_name
from rayscale.controller.slots import slot_targets, slot_weights
from rayscale.core.act import Action, Gang, GangPhase, SetReplicas
from rayscale.core.catalog import Catalog
from rayscale.core.checkpoint import (
    CHECKPOINT_EVERY_S,
    SAVE_TIME_SHARE,
    Checkpoint,
    CheckpointError,
    dumps,
    loads,
    max_age_s,
)
from rayscale.core.chunk import pin_chunks
from rayscale.core.feedback import Delivered
from rayscale.core.route import flavor_weights
from rayscale.core.settings import Settings
from rayscale.core.signals import Freshness, ModelSignals
from rayscale.core.step import ServeView, StepContext, StepState, step
from rayscale.serve.config import slot_deployment_name
from rayscale.signals.scrape import MetricsScraper
from rayscale.signals.window import Scrape, aggregate, arrival_rate, mix_only


@dataclass
class ControllerConfig:
    """The shell's own knobs; every decision knob is in ``settings`` (rayscale.core.settings)."""

    settings: Settings = field(default_factory=Settings)
    app_name: str = "rayscale"  # Serve application holding the flavor deployments (if Serve cannot say)
    decision_log: Path | None = None
    state_store: StateStore | None = None  # where the checkpoint is kept; None: a restart starts blind
    checkpoint_every_s: float = CHECKPOINT_EVERY_S


@dataclass
class DecisionRecord:
    t: float
    signals: dict[str, dict[str, Any]]
    plan: dict[str, Any]
    actions: list[dict[str, Any]]
    errors: list[str]
    durations_ms: dict[str, float]
    gangs: dict[str, str]  # name -> phase
    serve: dict[str, int]  # "model--flavor" -> target replicas
    # flavor -> {"pending"/"ready"/"failed": gangs, "nodes": nodes in ready gangs}
    by_flavor: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a reader should know that is not an error

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str, sort_keys=True)


def _by_flavor(gangs: list[Gang]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"pending": 0, "ready": 0, "failed": 0, "nodes": 0})
    for g in gangs:
        out[g.flavor][g.phase.value] += 1
        if g.phase == GangPhase.READY:
            out[g.flavor]["nodes"] += g.nodes
    return dict(out)


def _feedback_summary(rec: Delivered | None) -> dict[str, Any]:
    """SLO feedback's record of a model (rayscale.core.feedback): the smoothed share of requests within the
    SLO and the factor it puts on demand; nothing before the record starts."""
    if rec is None or rec.attainment is None:
        return {}
    return {"slo_delivered": round(rec.attainment, 5), "demand_factor": round(rec.factor, 4)}


def _sig_summary(s: ModelSignals) -> dict[str, Any]:
    d: dict[str, Any] = {"freshness": s.freshness.value}
    for k in ("arrival_rate_rps", "waiting", "running", "ttft_p95_s", "tpot_p95_s", "kv_usage", "age_s", "in_flight",
              "client_ttft_p95_s", "finished", "slo_met"):
        v = getattr(s, k)
        if v is not None:
            d[k] = round(float(v), 4)
    if s.mix:
        d["prompt_mean"], d["output_mean"] = round(s.mix.prompt_mean, 1), round(s.mix.output_mean, 1)
    return d


def record_line(r: DecisionRecord) -> str:
    """One line per period for a terminal: plan cost, gangs per flavor and phase, replicas, actions."""
    gangs = " ".join(f"{f}:{c['ready']}r/{c['pending']}p" + (f"/{c['failed']}f" if c["failed"] else "")
                     for f, c in sorted(r.by_flavor.items())) or "-"
    replicas = " ".join(f"{k}={n}" for k, n in sorted(r.serve.items())) or "-"
    acts = [a["type"] + ":" + str(a.get("name") or a.get("replicas")) for a in r.actions]
    errs = f" errors={r.errors}" if r.errors else ""
    errs += f" notes={r.notes}" if r.notes else ""
    short = [f"{s['model']}" + (f" {s['unmet_rps']:.2f}req/s" if s["unmet_rps"] > 0 else "")
             + (f" {s['missing_replicas']}<min" if s.get("missing_replicas") else "")
             for s in r.plan.get("shortfalls", [])]
    shorts = f" SHORTFALL {'; '.join(short)}" if short else ""
    # the load each model is planned for, or that it is not known (then the plan holds, never reads zero)
    load = " ".join(f"{m}=" + (f"{s['arrival_rate_rps']:.2f}req/s" if s.get("freshness") == "fresh"
                               and "arrival_rate_rps" in s else f"{s.get('freshness', 'missing')}")
                    for m, s in sorted(r.signals.items())) or "-"
    return (f"[{r.t:.0f}] load {load} plan ${r.plan.get('usd_per_h', 0):.2f}/h gangs {gangs} replicas {replicas} "
            f"actions={acts}{errs}{shorts}")


class Controller:
    def __init__(self, catalog: Catalog, actuator: Actuator, serve: ServeClient, scraper: MetricsScraper,
                 config: ControllerConfig | None = None, clock: Callable[[], float] = time.time,
                 weights_sink: Callable[[str, str, dict[str, float]], Any] | None = None,
                 leader: Callable[[], bool] | None = None):
        # The estimator models each flavor at the prefill chunk its deployment runs: the one rayscale picks
        # (rayscale.core.chunk), which `rayscale render` writes into the serve config, or the profile's own.
        self.catalog = pin_chunks(catalog)
        self.actuator = actuator
        self.serve = serve
        self.scraper = scraper
        self.config = config or ControllerConfig()
        self.clock = clock
        self.scrapes: deque[Scrape] = deque()
        self.mix_scrapes: deque[Scrape] = deque()  # older than the window's, trimmed to the mix's series
        self.state = StepState()
        settings = self.config.settings
        self.arrivals: dict[str, deque[float]] = defaultdict(
            lambda: deque(maxlen=max(int(settings.burst_history_s / settings.period_s), 1)))
        self._last_ok: Scrape | None = None
        self.records: list[DecisionRecord] = []
        self._stop = threading.Event()
        self._listeners: list[Callable[[DecisionRecord], None]] = []
        self._standby: list[Callable[[], None]] = []
        if self.config.decision_log:
            Path(self.config.decision_log).parent.mkdir(parents=True, exist_ok=True)
        # Routing weights per model over its flavors (the ingress spreads requests by them).
        self.weights_sink = weights_sink
        # One writer: when given, a period acts only while this returns True (a Lease held on Kubernetes,
        # rayscale.cluster.kube.lease); a replica that does not hold it waits and changes nothing.
        self.leader = leader
        self._weights: dict[str, dict[str, float]] = {}
        self._on_moved: list[Callable[[str], None]] = []
        self._followed: str | None = None  # the dashboard every on_serve_moved listener has followed to
        # Per gang-slot flavor, the 0-or-1 target of each slot deployment as last set (what KubeRay keeps).
        self._slot_targets: dict[tuple[str, str], dict[int, int]] = {}
        self._restored = False  # the checkpoint was read back since this replica began acting
        self._next_save_s: float | None = None

    def on_record(self, fn: Callable[[DecisionRecord], None]) -> None:
        self._listeners.append(fn)

    def on_standby(self, fn: Callable[[], None]) -> None:
        """``fn`` runs each period this replica waits for the Lease instead of acting."""
        self._standby.append(fn)

    def on_serve_moved(self, fn: Callable[[str], None]) -> None:
        """``fn(dashboard_url)`` when the cluster Serve is read from moves (Actuator.serve_dashboard): a
        RayService's first cluster, then each cut-over; the command reconnects its Ray driver there."""
        self._on_moved.append(fn)

    # --- one period -----------------------------------------------------------------------------------
    def reconcile(self) -> DecisionRecord:
        cfg = self.config.settings
        t0 = self.clock()
        dur: dict[str, float] = {}
        errors: list[str] = []
        notes: list[str] = []
        if not self._restored:
            notes += self._restore(t0, errors)

        s = time.perf_counter()
        signals, gangs, serve = self._observe(t0, errors)
        dur["observe"] = (time.perf_counter() - s) * 1000

        s = time.perf_counter()
        view = ServeView(serve.target, serve.running, serve.serving) if serve.ok else None
        result = step(StepContext(t0, self.catalog, signals, tuple(gangs), view, cfg, self.state,
                                  self.actuator.can_drain))
        self.state = result.state
        dur["step"] = (time.perf_counter() - s) * 1000
        errors += self._save(t0)

        s = time.perf_counter()
        if serve.ok:
            errors += self._apply(result.actions, serve, t0, gangs)
            errors += self._route(dict(result.demands), serve)
            errors += self._keep_targets(result.actions, serve)
        dur["act"] = (time.perf_counter() - s) * 1000

        rec = DecisionRecord(
            t=round(t0, 3),
            signals={m: {**_sig_summary(sig), **_feedback_summary(result.state.delivered.get(m))}
                     for m, sig in result.signals.items()},
            plan=result.plan.to_dict(),
            actions=[{"type": type(a).__name__, **a.__dict__} for a in result.actions],
            errors=errors,
            durations_ms={k: round(v, 2) for k, v in dur.items()},
            gangs={g.name: g.phase.value for g in gangs},
            serve={f"{m}--{f}": n for (m, f), n in sorted(serve.target.items())},
            by_flavor=_by_flavor(gangs),
            notes=notes,
        )
        self._publish(rec)
        return rec

    def _observe(self, t0: float, errors: list[str]) -> tuple[dict[str, ModelSignals], list[Gang], ServeSnapshot]:
        """The period's signals, gangs (each with the replicas Serve runs on its nodes) and Serve's state;
        what failed is appended to ``errors``."""
        cfg = self.config.settings
        scrape = self.scraper.scrape(t0)
        errors += self.scraper.errors
        signals = aggregate(self._remember(scrape, t0), t0, cfg.window_s, cfg.stale_after_s,
                            self.catalog.models, fast_window_s=cfg.fast_window_s,
                            mix_min_requests=cfg.mix_min_requests, mix_max_s=cfg.mix_max_s,
                            slo_targets={m: (spec.slo.ttft_p95_s, spec.slo.tpot_p95_s)
                                         for m, spec in self.catalog.models.items()})
        signals = {m: self._with_arrivals(sig) for m, sig in signals.items()}
        gangs = self.actuator.gangs(t0)
        self._follow_serve(errors)
        serve = self.serve.snapshot()
        if not serve.ok:
            errors.append(serve.error)
        if serve.ok:
            gangs = [replace(g, serving=sum(serve.per_node.get(n, 0) for n in g.node_ids)) for g in gangs]
        else:
            errors.append("act skipped: Serve state unknown, nothing is changed")
        return signals, gangs, serve

    def _follow_serve(self, errors: list[str]) -> None:
        """Serve read from the cluster the actuator drives now (a RayService's cut-over), and the listeners told."""
        moved_to = self.actuator.serve_dashboard()
        if moved_to and moved_to != self._followed:
            self.serve.point_at(moved_to)
            try:
                for fn in self._on_moved:
                    fn(moved_to)
                self._followed = moved_to
            except Exception as e:  # a head not up yet: the next period tries again
                errors.append(f"following the driven cluster to {moved_to}: {e}")

    def _publish(self, rec: DecisionRecord) -> None:
        self.records.append(rec)
        if self.config.decision_log:
            with open(self.config.decision_log, "a") as f:
                f.write(rec.to_json() + "\n")
        for fn in self._listeners:
            fn(rec)

    def _restore(self, now: float, errors: list[str]) -> list[str]:
        """Read the last checkpoint back into this controller's memory; notes on what was restored. A
        checkpoint that cannot be read or is too old is set aside, never half applied."""
        self._restored = True
        store, cfg = self.config.state_store, self.config.settings
        if store is None:
            return []
        try:
            text = store.read()
            if text is None:
                return [f"no checkpoint in {store.where}: starting without history"]
            cp = loads(text, store.where)
        except CheckpointError as e:
            errors.append(f"checkpoint set aside, starting without history: {e}")
            return []
        except Exception as e:  # the store is unreachable: the next period tries again, and saves nothing over it
            self._restored = False
            errors.append(f"reading the checkpoint from {store.where}: {e}")
            return []
        why = cp.usable_at(now, max_age_s(cfg))
        if why is not None:
            return [f"checkpoint in {store.where} set aside: {why}"]
        self.state = cp.state
        if now - cp.t < cfg.burst_history_s:
            for m, counts in cp.arrivals.items():
                if m in self.catalog.models:
                    self.arrivals[m].clear()
                    self.arrivals[m].extend(counts)
        return [f"restored the checkpoint taken {now - cp.t:.0f} s ago from {store.where}"]

    def _save(self, now: float) -> list[str]:
        store = self.config.state_store
        if store is None or not self._restored or (self._next_save_s is not None and now < self._next_save_s):
            return []
        self._next_save_s = now + self.config.checkpoint_every_s
        cp = Checkpoint(now, self.state, {m: tuple(round(c, 3) for c in d) for m, d in self.arrivals.items()})
        started = time.perf_counter()
        try:
            store.write(dumps(cp))
        except Exception as e:  # the next save tries again; losing it only slows a restart down
            return [f"saving the checkpoint to {store.where}: {e}"]
        # A thousand models' checkpoint is ~6 MB of JSON (bench/results/checkpoint_size.md): saved every
        # period it would take a fifth of the loop and rewrite megabytes of ConfigMaps every few seconds.
        spent = time.perf_counter() - started
        self._next_save_s = max(self._next_save_s, now + spent / SAVE_TIME_SHARE)
        return []

    def _remember(self, scrape: Scrape, now: float) -> list[Scrape]:
        """The scrapes the next aggregate reads: whole ones for the window (and a margin), older ones
        trimmed to the request mix's series for as long as the mix may reach back."""
        cfg = self.config.settings
        self.scrapes.append(scrape)
        if scrape.ok:
            prev = self._last_ok
            if prev is not None and scrape.t > prev.t:
                # Per period-long bin: a failed scrape in between leaves no bin of zeros, and the interval
                # it widened counts at its rate (missing metrics never read as no load).
                for m in self.catalog.models:
                    self.arrivals[m].append(arrival_rate(prev, scrape, m) * cfg.period_s)
            self._last_ok = scrape
        while self.scrapes and self.scrapes[0].t < now - 4 * cfg.window_s:
            old = self.scrapes.popleft()
            if cfg.mix_min_requests and old.ok:
                self.mix_scrapes.append(mix_only(old))
        while self.mix_scrapes and self.mix_scrapes[0].t < now - cfg.mix_max_s:
            self.mix_scrapes.popleft()
        return [*self.mix_scrapes, *self.scrapes]

    def _with_arrivals(self, sig: ModelSignals) -> ModelSignals:
        """The signals with the arrivals counted per period (the burst floor's and the history's input)."""
        if sig.freshness != Freshness.FRESH:
            return sig
        return replace(sig, arrival_counts=tuple(self.arrivals[sig.model]),
                       arrival_bin_s=self.config.settings.period_s)

    def _apply(self, actions: tuple[Action, ...], serve: ServeSnapshot, now: float,
               gangs: list[Gang] | None = None) -> list[str]:
        def scale(model: str, flavor: str, replicas: int) -> None:
            app = serve.app_of.get((model, flavor), self.config.app_name)
            if (model, flavor) in serve.slots:
                self._scale_slots(app, model, flavor, replicas, serve, gangs or [])
            else:
                self.serve.scale(app, model, flavor, replicas)

        errors = apply_actions(actions, self.actuator, scale, now)
        # A slot flavor the step left alone still follows its gangs: a slot whose gang is gone or not up
        # gives its replica to a ready gang's slot (its replica could only wait there).
        set_now = {(a.model, a.flavor) for a in actions if isinstance(a, SetReplicas)}
        for (m, f), current in sorted(serve.slots.items()):
            if (m, f) not in set_now:
                try:
                    scale(m, f, sum(current.values()))
                except Exception as e:  # the next period tries again
                    errors.append(f"slots {m}--{f}: {e}")
        return errors

    def _scale_slots(self, app: str, model: str, flavor: str, replicas: int, serve: ServeSnapshot,
                     gangs: list[Gang]) -> None:
        """A multi-node flavor: one 0-or-1 target per gang slot deployment (rayscale.controller.slots)."""
        current = serve.slots[(model, flavor)]
        mine = [g for g in gangs if (g.model, g.flavor) == (model, flavor)]
        wanted = slot_targets(replicas, mine, current)
        self._slot_targets[(model, flavor)] = wanted
        for k, n in wanted.items():
            if current.get(k) != n:
                self.serve.scale_slot(app, model, flavor, k, n)

    def _keep_targets(self, actions: tuple[Action, ...], serve: ServeSnapshot) -> list[str]:
        """Serve's targets after this period's SetReplicas, to an actuator that keeps them where another
        controller re-submits Serve's config from (the Kubernetes actuator with a RayService: KubeRay
        re-submits serveConfigV2, rayscale.cluster.kube.rayservice)."""
        targets = dict(serve.target)
        targets.update({(a.model, a.flavor): a.replicas for a in actions if isinstance(a, SetReplicas)})
        by_app: dict[str, dict[str, int]] = defaultdict(dict)
        for (m, f), n in targets.items():
            app = by_app[serve.app_of.get((m, f), self.config.app_name)]
            if (m, f) in serve.slots:  # a gang-slot flavor's deployments are its slots (set by _scale_slots)
                for k, per_slot in self._slot_targets.get((m, f), serve.slots[(m, f)]).items():
                    app[slot_deployment_name(m, f, k)] = per_slot
            else:
                app[deployment_name(m, f)] = n
        try:
            return self.actuator.sync_serve_targets(dict(by_app))
        except Exception as e:  # the next period writes them again
            return [f"keeping Serve targets: {e}"]

    def _route(self, demands: dict[str, Any], serve: ServeSnapshot) -> list[str]:
        """Push the core's routing weights (of the replicas serving now, rayscale.core.route) to the ingress
        when they change."""
        if self.weights_sink is None:
            return []
        errors = []
        for m, w in sorted(flavor_weights(serve.serving, demands).items()):
            if not w:
                continue
            app = serve.app_of.get((m, next(iter(w))), self.config.app_name)
            # The ingress routes a multi-node flavor by its gang slot deployments, those whose replica serves.
            w = slot_weights(w, {f: serve.slots_serving.get((m, f), {}) for f in w if (m, f) in serve.slots})
            if self._weights.get(m) != w and sum(w.values()) > 0:
                try:
                    self.weights_sink(app, m, w)
                    self._weights[m] = w
                except Exception as e:
                    errors.append(f"weights {m}: {e}")
        return errors

    # --- running ------------------------------------------------------------------------------------
    def run(self, duration_s: float | None = None) -> None:
        """Reconcile every period until stop() (or for duration_s); a failing period is logged, not fatal."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            start = time.monotonic()
            try:
                if self.leader is None or self.leader():
                    self.reconcile()
                else:
                    self._restored = False  # a successor may act and save: read its checkpoint on taking over
                    for fn in self._standby:
                        fn()
            except Exception as e:  # keep the loop alive; the record of the next period says more
                self.records.append(DecisionRecord(self.clock(), {}, {}, [], [f"reconcile failed: {e!r}"], {},
                                                   {}, {}))
            self._stop.wait(max(0.0, self.config.settings.period_s - (time.monotonic() - start)))

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name="rayscale-controller", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()

    def gangs(self) -> list[Gang]:
        return self.actuator.gangs(self.clock())
