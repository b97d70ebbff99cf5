"""The status page: the sidecar's state at a glance, on the admin port.

``GET /status.json`` is :meth:`StatusPage.view` as JSON; ``GET /status`` is the same view
as an HTML page that reloads itself every :data:`REFRESH_SECS` (no script: a
``<meta http-equiv="refresh">``). One path builds both, over ``Runtime.pools`` (a sidecar
without named pools has one pool, ``default``): per pool its admission mode and any
legacy fallback, its capacity with the source and each worker's share (engine, refused
probes), and per class the in-flight, queued and oldest wait, the reservation, the
admitted / refused / preempted totals and their rates; then the fleet and its ledger, the
edge switches, the tenants refused most, shadow mode's verdict, and the live config (path,
digest, generation, the last reload's result).

The numbers are the metrics': every count and gauge is read from the sidecar's own
registry in one collect (what a scrape of ``/metrics`` sees at that moment), so the page
never tells another story than the dashboard. Rates are over the last
:data:`WINDOW_SECS`, from samples of those counters taken every :data:`STEP_SECS`
(:class:`RateWindow`). What only the pools know (workers' engines, shadow mode's refused
tenants, the edge shares, the fleet's share) is read from them.

Read-only and bounded: at most :data:`MAX_WORKERS` workers per pool and
:data:`MAX_TENANTS` tenants are listed (the rest counted), strings are clipped, and
nothing secret is shown: no worker credential, no coordination URL or password, no
admission id (a worker URL loses any user-info). Every string in the HTML is escaped.
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry

from sidecar import logs
from sidecar.classes import HIGH_TO_LOW
from sidecar.logs import SHADOW_REFUSALS
from sidecar.priority_yaml import ConfigError, PriorityConfig
from sidecar.scheduler import Outcome

if TYPE_CHECKING:
    from sidecar.app import Runtime
    from sidecar.pools import Pool

log = logs.get("sidecar.status")

REFRESH_SECS = 5
WINDOW_SECS = 60.0
STEP_SECS = 5.0
MIN_RATE_SECS = 1.0  # a rate over less time than this is not shown
MAX_WORKERS = 64
MAX_TENANTS = 10
MAX_TEXT = 200
OUTCOMES = tuple(o.value for o in Outcome)


def clip(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def public_url(url: str) -> str:
    """``url`` without user-info (a password in a worker URL is never shown)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.username is None and parts.password is None:
        return clip(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return clip(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))


class Samples:
    """Every sample of one registry collect, by sample name (what ``/metrics`` shows)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._by_name: dict[str, list[tuple[Mapping[str, str], float]]] = {}
        for family in registry.collect():
            for s in family.samples:
                self._by_name.setdefault(s.name, []).append((s.labels, s.value))

    def where(self, name: str, **labels: str) -> list[tuple[Mapping[str, str], float]]:
        """The samples of ``name`` whose labels include ``labels``."""
        return [(ls, v) for ls, v in self._by_name.get(name, ())
                if all(ls.get(k) == want for k, want in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0: none)."""
        return sum(v for _, v in self.where(name, **labels))

    def current(self, name: str, label: str, **labels: str) -> str | None:
        """A one-hot gauge's current value of ``label`` (the series at 1), or None."""
        for ls, v in self.where(name, **labels):
            if v == 1:
                return ls.get(label)
        return None


Key = tuple[str, ...]


class RateWindow:
    """Counter samples over the last ``window`` seconds, one per ``step`` at most; a rate is
    the increase since the oldest one over the time since (None until ``min_secs``)."""

    def __init__(self, *, window: float = WINDOW_SECS, step: float = STEP_SECS,
                 min_secs: float = MIN_RATE_SECS) -> None:
        self.window = window
        self.step = step
        self.min_secs = min_secs
        self._samples: deque[tuple[float, dict[Key, float]]] = deque()

    def observe(self, now: float, values: Mapping[Key, float]) -> None:
        if self._samples and now - self._samples[-1][0] < self.step:
            return
        self._samples.append((now, dict(values)))
        # The base is the oldest sample still inside the window (or the newest older one).
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()

    def rates(self, now: float, values: Mapping[Key, float]) -> Callable[[Key], float | None]:
        if not self._samples:
            return lambda key: None
        t0, base = self._samples[0]
        dt = now - t0
        if dt < self.min_secs:
            return lambda key: None
        return lambda key: round(max(0.0, values.get(key, 0.0) - base.get(key, 0.0)) / dt, 4)

    def covered(self, now: float) -> float:
        """Seconds a rate asked for at ``now`` is over (0: none yet)."""
        return now - self._samples[0][0] if self._samples else 0.0


def _counters(s: Samples, pool_labels: Callable[[str], dict[str, str]],
              pools: Iterable[str]) -> dict[Key, float]:
    """The counters the page shows rates of, keyed for :class:`RateWindow`."""
    out: dict[Key, float] = {}
    for p in pools:
        pl = pool_labels(p)
        for ls, v in s.where("smg_scheduler_admit_total", **pl):
            out[("admit", p, ls["class"], ls["outcome"])] = v
        for ls, v in s.where("smg_sidecar_shadow_admit_total", **pl):
            out[("shadow", p, ls["class"], ls["outcome"])] = v
    for ls, v in s.where("smg_sidecar_tenant_rejected_total"):
        out[("tenant", ls["class"], ls["tenant"], ls["outcome"])] = v
    return out


@dataclass(frozen=True, slots=True)
class ReloadResult:
    at: float  # wall clock
    ok: bool
    sha256: str = ""
    error: str = ""


class StatusPage:
    """``/status`` and ``/status.json`` over a :class:`~sidecar.app.Runtime`."""

    def __init__(self, runtime: Runtime, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._rt = runtime
        self._clock = clock
        self._wall = wall_clock
        self._started = clock()
        self._rates = RateWindow()
        self.last_reload: ReloadResult | None = None

    # ------------------------------------------------------------------ fed by the runtime

    def reloaded(self, cfg: PriorityConfig) -> None:
        self.last_reload = ReloadResult(self._wall(), True, sha256=cfg.digest)

    def reload_failed(self, exc: ConfigError) -> None:
        self.last_reload = ReloadResult(self._wall(), False, error=clip(str(exc), 300))

    async def run(self) -> None:
        """Sample the counters every step, so rates are there on the first look."""
        while True:
            try:
                self.sample()
            except Exception:  # a page's rates are not worth the sidecar: say so, go on
                log.exception("status_sample_failed")
            await asyncio.sleep(self._rates.step)

    def sample(self) -> None:
        s = Samples(self._rt.metrics.registry)
        self._rates.observe(self._clock(), _counters(s, self._pool_labels, self._rt.pools.names))

    # ------------------------------------------------------------------ the view

    def _pool_labels(self, name: str) -> dict[str, str]:
        return {"pool": name} if self._rt.metrics.named_pools else {}

    def view(self) -> dict[str, Any]:
        """The whole page as plain data (``/status.json``)."""
        rt = self._rt
        now = self._clock()
        s = Samples(rt.metrics.registry)
        counters = _counters(s, self._pool_labels, rt.pools.names)
        self._rates.observe(now, counters)
        rate = self._rates.rates(now, counters)
        cfg = rt.watcher.current if rt.watcher is not None else rt.settings.scheduler.priority
        fleet = rt.settings.fleet
        last = self.last_reload
        return {
            "generated_at": _iso(self._wall()),
            "uptime_secs": round(now - self._started, 1),
            "rate_window_secs": round(self._rates.covered(now), 1),
            "config": {
                "path": clip(cfg.source) if cfg.source is not None else None,
                "sha256": cfg.digest,
                "generation": int(s.value("smg_sidecar_config_generation")),
                "reloads_ok": int(s.value("smg_sidecar_config_reload_total", result="ok")),
                "reloads_failed": int(s.value("smg_sidecar_config_reload_total",
                                              result="error")),
                "last_reload": None if last is None else {
                    "at": _iso(last.at), "result": "ok" if last.ok else "error",
                    "sha256": last.sha256 or None, "error": last.error or None},
            },
            "modes": {
                "scheduler_enabled": rt.settings.scheduler.scheduler_enabled,
                "shadow": rt.settings.scheduler.shadow,
                "edge_shed": rt.edge is not None,
                "coordination": "fleet" if fleet.coordination_url is not None
                                else "in-process",
            },
            "fleet": None if fleet.coordination_url is None else {
                "fleet_id": clip(fleet.fleet_id), "replica_id": clip(fleet.replica_id),
                "library": s.current("smg_sidecar_coordination_library_state", "state"),
                "server_checks": {ls["check"]: ls["result"] for ls, v in
                                  s.where("smg_sidecar_coordination_server_check") if v == 1},
            },
            "envoy": {
                "access_log_streams": int(s.value("smg_sidecar_envoy_access_log_streams")),
                "owners_alive": int(s.value("smg_sidecar_envoy_owners_alive")),
                "features": {ls["feature"]: ls["state"] for ls, v in
                             s.where("smg_sidecar_envoy_feature") if v == 1},
                "overload_shed": {c.label: int(s.value("smg_sidecar_overload_shed_total",
                                                       **{"class": c.label}))
                                  for c in HIGH_TO_LOW},
            },
            "pools": [self._pool(p, s, rate) for p in rt.pools],
            "tenants_refused": self._tenants(s, rate),
        }

    def _pool(self, p: Pool, s: Samples, rate: Callable[[Key], float | None]
              ) -> dict[str, Any]:
        pl = self._pool_labels(p.name)
        fallback = [(ls["mode"], ls["reason"]) for ls, v in
                    s.where("smg_sidecar_admission_fallback", **pl) if v == 1]
        workers = p.reading.workers
        waits = p.controller.snapshot().classes  # the oldest wait is in no metric
        classes = []
        for c in HIGH_TO_LOW:
            cl = {**pl, "class": c.label}
            classes.append({
                "class": c.label,
                "inflight": int(s.value("smg_scheduler_inflight", **cl)),
                "queued": int(s.value("smg_scheduler_queue_depth", **cl)),
                "queue_limit": int(s.value("smg_scheduler_queue_size_limit", **cl)),
                "reserved": int(s.value("smg_sidecar_reserved_slots", **cl)),
                "pressure": round(s.value("smg_scheduler_class_capacity_pressure", **cl), 4),
                "oldest_wait_secs": round(waits[c].oldest_wait, 3),
                "totals": {o: int(s.value("smg_scheduler_admit_total", **cl, outcome=o))
                           for o in OUTCOMES},
                "rates": {o: rate(("admit", p.name, c.label, o)) for o in OUTCOMES},
            })
        fleet = p.fleet
        return {
            "name": p.name,
            "mode": s.current("smg_sidecar_admission_mode", "mode", **pl),
            "fallback": None if not fallback else {"mode": fallback[0][0],
                                                   "reason": fallback[0][1]},
            "preemption_suspended": s.value("smg_sidecar_preemption_suspended", **pl) == 1,
            "uncancellable_workers": [public_url(u) for u in p.uncancellable[:MAX_WORKERS]],
            "capacity": int(s.value("smg_sidecar_capacity", **pl)),
            "capacity_source": s.current("smg_sidecar_capacity_source", "source", **pl),
            "healthy_workers": int(s.value("smg_sidecar_healthy_workers", **pl)),
            "workers_known": p.reading.total,
            "engine_excess": int(s.value("smg_sidecar_engine_excess", **pl)),
            "utilization": round(s.value("smg_scheduler_utilization", **pl), 4),
            "workers": [{
                "url": public_url(w.url), "engine": clip(w.engine, 32),
                "capacity": w.capacity, "saturated": w.saturated,
                "probe_refused": [{"endpoint": clip(e, 64), "reason": clip(r, 64)}
                                  for e, r in w.problems[:8]],
            } for w in workers[:MAX_WORKERS]],
            "workers_not_listed": max(0, len(workers) - MAX_WORKERS),
            "classes": classes,
            "fleet": None if fleet is None else {
                "state": s.current("smg_sidecar_coordination_state", "state", **pl),
                "live_replicas": int(s.value("smg_sidecar_live_replicas", **pl)),
                "fleet_capacity": fleet.fleet_capacity,
                "degraded_share": fleet.share,
                "inflight": {c.label: int(s.value("smg_sidecar_fleet_inflight", **pl,
                                                  **{"class": c.label})) for c in HIGH_TO_LOW},
            },
            "edge": None if p.edge is None else {
                "shares": {c.label: round(v, 4) for c, v in p.edge.shares().items()},
                "shed": {c.label: int(s.value("smg_sidecar_edge_shed_total", **pl,
                                              **{"class": c.label}))
                         for c in p.edge.shares()},
            },
            "shadow": None if p.shadow is None else self._shadow(p, s, rate),
        }

    def _shadow(self, p: Pool, s: Samples, rate: Callable[[Key], float | None]
                ) -> dict[str, Any]:
        """Predicted (what enforcement would have done) against real (all admitted)."""
        pl = self._pool_labels(p.name)
        summary = p.shadow.summary if p.shadow is not None else None
        classes = []
        for c in HIGH_TO_LOW:
            cl = {**pl, "class": c.label}
            totals = {o: int(s.value("smg_sidecar_shadow_admit_total", **cl, outcome=o))
                      for o in OUTCOMES if o != Outcome.CLIENT_CANCELLED.value}
            refused = sum(totals.get(o, 0) for o in SHADOW_REFUSALS)
            decided = refused + totals["admitted"]
            classes.append({
                "class": c.label,
                "would_be": totals,
                "would_refuse_pct": round(100.0 * refused / decided, 3) if decided else 0.0,
                "would_be_rates": {o: rate(("shadow", p.name, c.label, o)) for o in totals},
                "would_be_inflight": int(s.value("smg_sidecar_shadow_inflight", **cl)),
                "would_be_queued": int(s.value("smg_sidecar_shadow_queue_depth", **cl)),
                "real_admitted": int(s.value("smg_scheduler_admit_total", **cl,
                                             outcome="admitted")),
                "real_inflight": int(s.value("smg_scheduler_inflight", **cl)),
            })
        tenants: list[dict[str, Any]] = []
        if summary is not None:
            top = sorted(summary.refused_by_tenant.items(), key=lambda kv: (-kv[1], kv[0]))
            tenants = [{"class": c, "tenant": clip(t, 64), "would_refuse": n}
                       for (c, t), n in top[:MAX_TENANTS]]
        return {"classes": classes, "refused_tenants": tenants,
                "refused_tenants_not_listed": max(0, (len(summary.refused_by_tenant)
                                                      if summary else 0) - MAX_TENANTS)}

    def _tenants(self, s: Samples, rate: Callable[[Key], float | None]) -> dict[str, Any]:
        """The (class, tenant) pairs refused most: recent rate first, then total."""
        by: dict[tuple[str, str], dict[str, Any]] = {}
        for ls, v in s.where("smg_sidecar_tenant_rejected_total"):
            key = (ls["class"], ls["tenant"])
            row = by.setdefault(key, {"class": key[0], "tenant": clip(key[1], 64), "total": 0,
                                      "rate": None, "by_outcome": {}})
            row["total"] += int(v)
            row["by_outcome"][ls["outcome"]] = int(v)
            r = rate(("tenant", key[0], key[1], ls["outcome"]))
            if r is not None:
                row["rate"] = round((row["rate"] or 0.0) + r, 4)
        rows = [r for r in by.values() if r["total"] > 0]
        rows.sort(key=lambda r: (-(r["rate"] or 0.0), -r["total"], r["class"], r["tenant"]))
        return {"top": rows[:MAX_TENANTS], "not_listed": max(0, len(rows) - MAX_TENANTS)}

    # ------------------------------------------------------------------ rendering

    def json(self) -> bytes:
        return json.dumps(self.view(), sort_keys=False).encode()

    def html(self) -> str:
        return render_html(self.view())


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------- HTML

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#1b1b1b;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .3em}h2{font-size:1.15em;margin:1.2em 0 .3em}
h3{font-size:1em;margin:.8em 0 .2em}
table{border-collapse:collapse;margin:.2em 0 .6em;background:#fff}
th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}
th:first-child,td:first-child,.names2 td:nth-child(2),.names2 th:nth-child(2)
{text-align:left}th{background:#eee}
.bad{background:#fdd;color:#900;font-weight:600}.warn{background:#ffe9b3}
.ok{color:#070}.dim{color:#777}.kv span{margin-right:1.2em}
section.pool{border-left:4px solid #4a7;padding-left:.8em;margin:.8em 0}
section.pool.legacy{border-color:#c33}
"""


def _e(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return html.escape(str(value), quote=True)


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}/s"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], *, names: int = 1) -> str:
    """``rows``' cells are HTML already (escaped by the caller); the first ``names``
    columns are text (left-aligned), the rest numbers."""
    h = "".join(f"<th>{_e(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="names{names}"><tr>{h}</tr>{b}</table>'


def _flag(text: str, cls: str) -> str:
    return f'<span class="{cls}">{_e(text)}</span>'


def _pool_html(p: Mapping[str, Any]) -> str:
    out = []
    legacy = p["mode"] == "legacy"
    out.append(f'<section class="pool{" legacy" if legacy else ""}">')
    out.append(f"<h2>Pool {_e(p['name'])}</h2>")
    flags = [f"<span>mode: <b>{_e(p['mode'])}</b></span>"]
    if p["fallback"] is not None:
        fb = p["fallback"]
        flags.append(_flag(f"legacy fallback: {fb['mode']} ({fb['reason']})", "bad"))
    if p["preemption_suspended"]:
        flags.append(_flag("preemption suspended (" + ", ".join(p["uncancellable_workers"])
                           + ")", "warn"))
    source = p["capacity_source"]
    flags.append(f"<span>capacity: <b>{_e(p['capacity'])}</b> from "
                 + (_flag(str(source), "bad") if source == "fallback" else _e(source))
                 + "</span>")
    flags.append(f"<span>healthy workers: {_e(p['healthy_workers'])} of "
                 f"{_e(p['workers_known'])}</span>")
    flags.append(f"<span>utilization: {_e(p['utilization'])}</span>")
    if p["engine_excess"]:
        flags.append(_flag(f"engine excess: {p['engine_excess']}", "warn"))
    out.append('<p class="kv">' + "".join(flags) + "</p>")
    out.append(_table(
        ["class", "in flight", "queued", "queue limit", "reserved", "oldest wait",
         "pressure", "admitted", "queue full", "queue timeout", "preempted", "cancelled"],
        ([_e(c["class"]), _e(c["inflight"]), _e(c["queued"]), _e(c["queue_limit"]),
          _e(c["reserved"]), _e(f"{c['oldest_wait_secs']:.1f}s"), _e(c["pressure"])]
         + [_e(c["totals"][o]) + f' <span class="dim">{_e(_rate(c["rates"][o]))}</span>'
            for o in OUTCOMES]
         for c in p["classes"])))
    if p["workers"]:
        out.append(_table(
            ["worker", "engine", "capacity", "saturated", "probes refused"],
            ([_e(w["url"]), _e(w["engine"]), _e(w["capacity"]), _e(w["saturated"]),
              (_flag(", ".join(f"{x['endpoint']}: {x['reason']}" for x in w["probe_refused"]),
                     "bad") if w["probe_refused"] else "—")]
             for w in p["workers"]), names=2))
        if p["workers_not_listed"]:
            out.append(f'<p class="dim">{_e(p["workers_not_listed"])} more workers</p>')
    fleet = p["fleet"]
    if fleet is not None:
        state = fleet["state"]
        out.append('<p class="kv"><span>ledger: '
                   + (_flag(str(state), "bad") if state != "ok" else _flag("ok", "ok"))
                   + f"</span><span>live replicas: {_e(fleet['live_replicas'])}</span>"
                   f"<span>fleet capacity: {_e(fleet['fleet_capacity'])}</span>"
                   f"<span>degraded share: {_e(fleet['degraded_share'])}</span>"
                   "<span>fleet in flight: " + _e(", ".join(
                       f"{k} {v}" for k, v in fleet["inflight"].items())) + "</span></p>")
    edge = p["edge"]
    if edge is not None:
        out.append('<p class="kv">edge switch: ' + "".join(
            f"<span>{_e(k)} {_e(round(100 * v, 1))}% shed at Envoy "
            f"({_e(edge['shed'][k])} so far)</span>" for k, v in edge["shares"].items())
            + "</p>")
    shadow = p["shadow"]
    if shadow is not None:
        out.append("<h3>Shadow: what enforcement would have done</h3>")
        out.append(_table(
            ["class", "would admit", "would refuse (full)", "would refuse (timeout)",
             "would preempt", "would refuse %", "would be in flight / queued",
             "real admitted", "real in flight"],
            ([_e(c["class"])]
             + [_e(c["would_be"][o]) for o in ("admitted", "rejected_queue_full",
                                               "rejected_queue_timeout", "preempted")]
             + [(_flag(f"{c['would_refuse_pct']}%", "bad")
                 if c["would_refuse_pct"] and c["class"] in ("system", "interactive")
                 else _e(f"{c['would_refuse_pct']}%")),
                _e(f"{c['would_be_inflight']} / {c['would_be_queued']}"),
                _e(c["real_admitted"]), _e(c["real_inflight"])]
             for c in shadow["classes"])))
        if shadow["refused_tenants"]:
            out.append(_table(["class", "tenant", "would refuse"],
                              ([_e(t["class"]), _e(t["tenant"]), _e(t["would_refuse"])]
                               for t in shadow["refused_tenants"]), names=2))
    out.append("</section>")
    return "".join(out)


def render_html(v: Mapping[str, Any]) -> str:
    """The page: every value escaped, no script, reloads itself."""
    cfg, modes, env = v["config"], v["modes"], v["envoy"]
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f'<meta http-equiv="refresh" content="{REFRESH_SECS}">',
        "<title>priority-gate status</title>", f"<style>{_STYLE}</style></head><body>",
        "<h1>priority-gate status</h1>",
        f'<p class="dim">{_e(v["generated_at"])} · up {_e(v["uptime_secs"])} s · rates over '
        f'the last {_e(v["rate_window_secs"])} s · reloads every {REFRESH_SECS} s · '
        '<a href="status.json">JSON</a> · <a href="metrics">metrics</a></p>',
    ]
    last = cfg["last_reload"]
    reload_text = ("none since start" if last is None else
                   _flag(f"ok at {last['at']}", "ok") if last["result"] == "ok" else
                   _flag(f"rejected at {last['at']}: {last['error']}", "bad"))
    parts.append(
        '<p class="kv">'
        f"<span>config: <b>{_e(cfg['path'] or 'built-in')}</b></span>"
        f"<span>sha256: {_e(cfg['sha256'])}</span>"
        f"<span>generation: {_e(cfg['generation'])}</span>"
        f"<span>last reload: {reload_text}</span></p>")
    mode_flags = [f"<span>scheduler: {_e(modes['scheduler_enabled'])}</span>",
                  f"<span>coordination: {_e(modes['coordination'])}</span>",
                  f"<span>edge shedding: {_e(modes['edge_shed'])}</span>"]
    if modes["shadow"]:
        mode_flags.insert(0, _flag("SHADOW MODE: nothing is refused", "warn"))
    parts.append('<p class="kv">' + "".join(mode_flags) + "</p>")
    fleet = v["fleet"]
    if fleet is not None:
        parts.append(
            f'<p class="kv"><span>fleet: {_e(fleet["fleet_id"])}</span>'
            f'<span>replica: {_e(fleet["replica_id"])}</span>'
            f'<span>ledger library: {_e(fleet["library"])}</span>'
            + "".join(f"<span>{_e(k)}: {_e(r)}</span>"
                      for k, r in fleet["server_checks"].items()) + "</p>")
    absent = [f for f, st in env["features"].items() if st == "absent"]
    parts.append(
        f'<p class="kv"><span>Envoy access-log streams: {_e(env["access_log_streams"])}'
        f'</span><span>Envoys alive: {_e(env["owners_alive"])}</span>'
        + (_flag("absent: " + ", ".join(absent), "bad") if absent else "")
        + (_flag("overload sheds: " + ", ".join(f"{k} {n}" for k, n in
                                                 env["overload_shed"].items() if n), "bad")
           if any(env["overload_shed"].values()) else "") + "</p>")
    parts.extend(_pool_html(p) for p in v["pools"])
    tenants = v["tenants_refused"]
    parts.append("<h2>Tenants refused most</h2>")
    if tenants["top"]:
        parts.append(_table(
            ["class", "tenant", "refused", "rate", "by outcome"],
            ([_e(t["class"]), _e(t["tenant"]), _e(t["total"]), _e(_rate(t["rate"])),
              _e(", ".join(f"{o} {n}" for o, n in sorted(t["by_outcome"].items())))]
             for t in tenants["top"]), names=2))
        if tenants["not_listed"]:
            parts.append(f'<p class="dim">{_e(tenants["not_listed"])} more</p>')
    else:
        parts.append('<p class="ok">none refused since start</p>')
    parts.append("</body></html>")
    return "".join(parts)
