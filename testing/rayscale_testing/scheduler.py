"""Shared pieces of the test stand-ins: clocks, the controller thread loop, and a pod scheduler.

``PodScheduler`` plays kube-scheduler and kubelet on the emulator: it binds Pending pods to Ready
nodes whose labels satisfy the pod's nodeSelector and required node affinity, whose taints the pod
tolerates and whose allocatable resources still fit the pod's requests; bound pods turn Running
after ``start_delay``; pods whose node is gone are deleted (pod GC). Pods that fit nowhere stay
Pending with ``PodScheduled=False, reason Unschedulable``, as in a real cluster. Pods for which
``external_kubelet(pod)`` is true are only bound: another stand-in runs them and sets their status
(``rayscale_testing.raypods`` runs Ray worker pods as real Ray nodes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from rayscale_testing.kubeapi import ApiError, Store, WatchEvent, now_rfc3339

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told: with ``step()`` calls it makes a stand-in deterministic."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds


def wait_for(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Poll until predicate() is truthy and return it; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class StandIn:
    """A level-triggered controller loop over the emulator store.

    ``step()`` reconciles everything once (call it directly for deterministic tests); ``start()`` runs
    it in a thread, woken by store changes to the watched types or every ``tick`` seconds.
    """

    watched: tuple[str, ...] = ()

    def __init__(self, store: Store, *, clock: Clock | None = None, tick: float = 0.02) -> None:
        self.store = store
        self.clock: Clock = clock or MonotonicClock()
        self.tick = tick
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._keys = {store.type_for(t).key for t in self.watched}
        self.errors: list[BaseException] = []

    def _on_event(self, ev: WatchEvent) -> None:
        if ev.type_key in self._keys:
            self._wake.set()

    def step(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.step()
            except ApiError as e:
                # Conflicts and races with other writers: the next pass re-reads and retries.
                log.debug("%s: %s", type(self).__name__, e)
            except Exception as e:  # keep running; tests can assert on .errors
                log.exception("%s step failed", type(self).__name__)
                self.errors.append(e)
            self._wake.wait(self.tick)

    def start(self) -> StandIn:
        self.store.add_listener(self._on_event)
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self.store.remove_listener(self._on_event)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> StandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------
# scheduling helpers


def parse_quantity(q: Any) -> Decimal:
    from kubernetes.utils.quantity import parse_quantity as pq

    return Decimal(pq(q))


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """Sum of container requests; a limit without a request counts as the request (API defaulting)."""
    total: dict[str, Decimal] = {}
    for c in (pod.get("spec") or {}).get("containers") or ():
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for k, v in merged.items():
            total[k] = total.get(k, Decimal(0)) + parse_quantity(v)
    return total


def _match_expr(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator", ""), expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt") and key in labels:
        try:
            a, b = int(labels[key]), int(values[0])
        except (ValueError, IndexError):
            return False
        return a > b if op == "Gt" else a < b
    return False


def node_matches_pod(node: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """nodeSelector, required node affinity and taints (NoSchedule and NoExecute)."""
    labels = node["metadata"].get("labels") or {}
    spec = pod.get("spec") or {}
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    terms = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms")
    )
    if terms and not any(all(_match_expr(e, labels) for e in t.get("matchExpressions") or ()) for t in terms):
        return False
    tolerations = spec.get("tolerations") or ()
    for taint in (node.get("spec") or {}).get("taints") or ():
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_tolerates(t, taint) for t in tolerations):
            return False
    return True


def _tolerates(tol: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if tol.get("effect") and tol["effect"] != taint.get("effect"):
        return False
    if tol.get("operator") == "Exists":
        return not tol.get("key") or tol["key"] == taint.get("key")
    return tol.get("key") == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or "")


def node_ready(node: Mapping[str, Any]) -> bool:
    if node["metadata"].get("deletionTimestamp") or (node.get("spec") or {}).get("unschedulable"):
        return False
    conds = (node.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def set_condition(
    conds: list[Obj], type_: str, status: str, reason: str = "", message: str = "", **extra: Any
) -> bool:
    """Set a condition in place (lastTransitionTime moves only when status does); True if changed."""
    for c in conds:
        if c.get("type") == type_:
            if (
                c.get("status") == status
                and c.get("reason", "") == reason
                and c.get("message", "") == message
            ):
                return False
            if c.get("status") != status:
                c["lastTransitionTime"] = now_rfc3339()
            c.update(status=status, reason=reason, message=message, **extra)
            return True
    conds.append(
        {
            "type": type_,
            "status": status,
            "lastTransitionTime": now_rfc3339(),
            "reason": reason,
            "message": message,
            **extra,
        }
    )
    return True


@dataclass
class _Bound:
    at: float


class PodScheduler(StandIn):
    """kube-scheduler and kubelet for the emulator (see the module docstring)."""

    watched = ("pods", "nodes")

    def __init__(
        self,
        store: Store,
        *,
        start_delay: float = 0.0,
        clock: Clock | None = None,
        tick: float = 0.02,
        external_kubelet: Callable[[Obj], bool] | None = None,
    ) -> None:
        super().__init__(store, clock=clock, tick=tick)
        self.start_delay = start_delay
        self.external_kubelet = external_kubelet
        self._bound: dict[str, _Bound] = {}

    def step(self) -> None:
        nodes, _ = self.store.list("nodes")
        by_name = {n["metadata"]["name"]: n for n in nodes}
        pods, _ = self.store.list("pods")
        used: dict[str, dict[str, Decimal]] = {}
        for p in pods:
            node_name = (p.get("spec") or {}).get("nodeName")
            phase = (p.get("status") or {}).get("phase")
            if node_name and phase not in ("Succeeded", "Failed"):
                acc = used.setdefault(node_name, {})
                for k, v in pod_requests(p).items():
                    acc[k] = acc.get(k, Decimal(0)) + v
        now = self.clock.now()
        for p in pods:
            meta = p["metadata"]
            uid = meta["uid"]
            ns, name = meta["namespace"], meta["name"]
            if meta.get("deletionTimestamp"):
                continue
            node_name = (p.get("spec") or {}).get("nodeName")
            if node_name and node_name not in by_name:
                self._delete_pod(ns, name)  # pod GC: its node is gone
                continue
            if not node_name:
                target = self._pick_node(p, nodes, used)
                if target is None:
                    self._mark_unschedulable(p)
                    continue
                node_name = target["metadata"]["name"]
                req = pod_requests(p)
                acc = used.setdefault(node_name, {})
                for k, v in req.items():
                    acc[k] = acc.get(k, Decimal(0)) + v
                try:
                    self.store.patch("pods", name, {"spec": {"nodeName": node_name}}, ns)
                except ApiError:
                    continue
                self._bound[uid] = _Bound(now)
                status = dict(p.get("status") or {})
                conds = list(status.get("conditions") or [])
                set_condition(conds, "PodScheduled", "True")
                status["conditions"] = conds
                self.store.patch("pods", name, {"status": status}, ns, subresource="status")
                p = self.store.get("pods", name, ns)
            if self.external_kubelet is not None and self.external_kubelet(p):
                continue  # bound; its kubelet is another stand-in
            bound = self._bound.setdefault(uid, _Bound(now))
            if (p.get("status") or {}).get("phase") == "Pending" and now - bound.at >= self.start_delay:
                self._run(p, by_name[node_name])

    def _pick_node(
        self, pod: Obj, nodes: Iterable[Obj], used: Mapping[str, Mapping[str, Decimal]]
    ) -> Obj | None:
        req = pod_requests(pod)
        for n in nodes:
            if not node_ready(n) or not node_matches_pod(n, pod):
                continue
            alloc = (n.get("status") or {}).get("allocatable") or {}
            u = used.get(n["metadata"]["name"], {})
            if all(
                parse_quantity(alloc.get(k, "0")) - u.get(k, Decimal(0)) >= v for k, v in req.items() if v > 0
            ):
                return n
        return None

    def _mark_unschedulable(self, pod: Obj) -> None:
        status = dict(pod.get("status") or {})
        conds = list(status.get("conditions") or [])
        if set_condition(conds, "PodScheduled", "False", "Unschedulable", "0 nodes are available"):
            status["conditions"] = conds
            meta = pod["metadata"]
            self.store.patch(
                "pods", meta["name"], {"status": status}, meta["namespace"], subresource="status"
            )

    def _run(self, pod: Obj, node: Obj) -> None:
        meta = pod["metadata"]
        status = dict(pod.get("status") or {})
        conds = list(status.get("conditions") or [])
        set_condition(conds, "Initialized", "True")
        set_condition(conds, "ContainersReady", "True")
        set_condition(conds, "Ready", "True")
        addresses = (node.get("status") or {}).get("addresses") or [{}]
        n = sum(ord(ch) for ch in meta["uid"]) % 250 + 2
        status.update(
            phase="Running",
            conditions=conds,
            hostIP=addresses[0].get("address", "10.0.0.1"),
            podIP=f"10.1.{len(self._bound) % 250}.{n}",
            startTime=now_rfc3339(),
        )
        self.store.patch("pods", meta["name"], {"status": status}, meta["namespace"], subresource="status")

    def _delete_pod(self, ns: str, name: str) -> None:
        try:
            self.store.delete("pods", name, ns)
        except ApiError as e:
            if e.code != 404:
                raise
