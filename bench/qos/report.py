"""Figures, goals and the plot of bench.qos, from the client's records and the engine's samples.

Definitions (one place):

* TTFT: first token received minus request sent, client side. Interactive percentiles
  are over every interactive request sent, a refused or timed-out one counting as never
  answered (infinite): a limiter that refuses interactive requests does not get a better
  percentile for it (the percentile over the answered ones alone is shown beside it);
* inter-token latency: gaps between a request's consecutive tokens;
* bulk completed: ended ``ok`` within the window; refused: a 429/503 other than a queue
  timeout; timed out: the client's timeout or the sidecar's ``scheduler_queue_timeout``;
  open: still waiting or streaming when the window closed;
* bulk tokens/s: bulk tokens received within the window, over the window;
* bulk waits at instant t: some bulk request was sent and has neither a token nor an end;
* engine busy while bulk waits: over the engine's /metrics samples taken while bulk
  waits, the share with at least one slot processing (``llamacpp:requests_processing``
  >= 1), and the mean share of its slots processing (what an idle reserved slot costs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench._util import pct
from bench.qos.workload import BULK, INTERACTIVE, Workload

QUEUE_TIMEOUT = "scheduler_queue_timeout"
GOAL_TTFT_RATIO = 1.5
GOAL_BULK_SHARE = 0.995
GOAL_BUSY = 0.95
BASELINE, UNPROTECTED, ALTERNATIVES = "S0", "S1", ("S1", "S2", "S3")


def outcome(rec: dict[str, Any]) -> str:
    """completed | refused | timed out | open | failed (error, cut)."""
    if rec["outcome"] == "ok":
        return "completed"
    if rec["outcome"] == "timeout" or rec["code"] == QUEUE_TIMEOUT:
        return "timed out"
    if rec["outcome"] == "refused":
        return "refused"
    return "open" if rec["outcome"] == "open" else "failed"


def ttfts(recs: Iterable[dict[str, Any]], unanswered: bool = False) -> list[float]:
    """TTFT of each request that got a token; ``unanswered``: also +inf for each that
    ended without one (refused, timed out, failed)."""
    return [r["tokens"][0] - r["sent"] if r["tokens"] else math.inf for r in recs
            if r["tokens"] or (unanswered and r["outcome"] != "open")]


def gaps(recs: Iterable[dict[str, Any]]) -> list[float]:
    return [b - a for r in recs for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]


def bulk_waiting(bulk: Sequence[dict[str, Any]], t: float) -> bool:
    for r in bulk:
        until = r["tokens"][0] if r["tokens"] else r["end"]
        if r["sent"] <= t and (math.isnan(until) or t < until):
            return True
    return False


def run_figures(res: dict[str, Any], slots: int) -> dict[str, Any]:
    """One scenario's run: its lists (for pooling) and counts."""
    w = res["window"]
    recs = res["records"]
    inter = [r for r in recs if r["cls"] == INTERACTIVE]
    bulk = [r for r in recs if r["cls"] == BULK]
    counts = {cls: {k: 0 for k in ("sent", "completed", "refused", "timed out", "open",
                                   "failed")} for cls in (INTERACTIVE, BULK)}
    for r in recs:
        c = counts[r["cls"]]
        c["sent"] += 1
        o = outcome(r)
        if o == "completed" and r["end"] > w and r["cls"] == BULK:
            o = "open"  # finished after the window: not completed within it
        c[o] += 1
    short = sum(1 for r in recs if r["outcome"] == "ok" and len(r["tokens"]) != r["expected"])
    samples = [s for s in res["engine"] if 0.0 <= s["t"] - res["t0"] <= w]
    waiting = [s for s in samples if bulk_waiting(bulk, s["t"] - res["t0"])]
    tokens_engine = float("nan")
    if len(samples) >= 2:
        span = samples[-1]["t"] - samples[0]["t"]
        tokens_engine = (samples[-1]["tokens_predicted_total"]
                         - samples[0]["tokens_predicted_total"]) / span
    return {
        "ttft": {INTERACTIVE: ttfts(inter), BULK: ttfts(bulk)},
        "ttft_all": ttfts(inter, unanswered=True),
        "itl": {INTERACTIVE: gaps(inter), BULK: gaps(bulk)},
        "counts": counts, "short_streams": short,
        "bulk_tokens": sum(1 for r in bulk for t in r["tokens"] if t <= w),
        "window": w,
        "samples": len(samples), "waiting_samples": len(waiting),
        "busy_any": [1.0 if s["requests_processing"] >= 1 else 0.0 for s in waiting],
        "slot_share": [s["requests_processing"] / slots for s in waiting],
        "slot_share_all": [s["requests_processing"] / slots for s in samples],
        "deferred": [s["requests_deferred"] for s in waiting],
        "engine_tokens_per_s": tokens_engine,
        "cpu": res["cpu"],
    }


def queue_wait(fronts: Sequence[dict[str, float]], cls: str) -> dict[str, float]:
    """The sidecar's own queue-wait histogram for ``cls``, summed over runs: the mean
    and the upper bucket bound holding the 50th/99th percentile (whole sidecar life:
    the window plus the warm-up before and the drain after it)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for m in fronts:
        for k, v in m.items():
            if f'class="{cls}"' not in k:
                continue
            if k.startswith("smg_scheduler_queue_wait_seconds_bucket{"):
                le = float(k.split('le="')[1].split('"')[0])
                buckets[le] = buckets.get(le, 0.0) + v
            elif k.startswith("smg_scheduler_queue_wait_seconds_sum"):
                total += v
            elif k.startswith("smg_scheduler_queue_wait_seconds_count"):
                count += v
    out = {"count": count, "mean_ms": total / count * 1e3 if count else math.nan}
    for q in (0.5, 0.99):
        bound = math.nan
        for le, n in sorted(buckets.items()):
            if count and n >= q * count:
                bound = le
                break
        out[f"p{round(q * 100)}_le_ms"] = bound * 1e3
    return out


def split_ttft(res: dict[str, Any]) -> tuple[list[float], list[float], int]:
    """Interactive TTFT of the requests the sidecar admitted at once and of those it
    queued: the client's records joined, in arrival order, with the sidecar's arrivals
    (its slot trace). A refused or unanswered request, or counts that do not match,
    leave the pair out; the last value is how many were left out."""
    arrivals = res.get("sidecar_waits", {}).get(INTERACTIVE, [])
    recs = sorted((r for r in res["records"] if r["cls"] == INTERACTIVE),
                  key=lambda r: r["sent"])
    if not arrivals or len(arrivals) != len(recs):
        return [], [], len(recs)
    at_once: list[float] = []
    queued: list[float] = []
    left = 0
    for rec, (_, wait) in zip(recs, arrivals, strict=True):
        if not rec["tokens"]:
            left += 1
            continue
        (queued if wait > 0 else at_once).append(rec["tokens"][0] - rec["sent"])
    return at_once, queued, left


def victim_share(res: dict[str, Any]) -> float:
    """Share of the window in which some bulk request was admitted by the sidecar and had
    no token yet: when a preemption (allowed only before the first byte, which
    llama.cpp sends with the first token) would have found a victim. Bulk arrivals
    from the slot trace joined in order with the client's bulk records (one FIFO
    queue; the backlog sent at once may pair up out of order, which moves single spans
    but hardly their union); nan when there are more arrivals than records."""
    arrivals = res.get("sidecar_waits", {}).get(BULK, [])
    recs = sorted((r for r in res["records"] if r["cls"] == BULK), key=lambda r: r["sent"])
    recs = recs[:len(arrivals)]  # FIFO: the ones admitted are the first ones sent
    if not arrivals or len(arrivals) != len(recs):
        return math.nan
    w, t0 = float(res["window"]), float(res["t0_wall"])
    spans = sorted((arrived + wait - t0, r["tokens"][0] if r["tokens"] else r["end"])
                   for (arrived, wait), r in zip(arrivals, recs, strict=True))
    covered, reach = 0.0, 0.0
    for a, b in spans:
        a, b = max(a, reach, 0.0), min(b, w)
        if b > a:
            covered += b - a
            reach = b
    return covered / w


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(results: list[dict[str, Any]], w: Workload, slots: int,
              names: Sequence[str]) -> dict[str, Any]:
    """Per scenario, the rounds pooled (percentiles over all samples, counts summed), the
    per-round values of the headline figures, and the goals."""
    del w
    out: dict[str, Any] = {}
    by_round: dict[str, dict[int, dict[str, Any]]] = {}
    for name in names:
        by_round[name] = {r["round"]: run_figures(r, slots) for r in results
                          if r["scenario"] == name}
        runs = list(by_round[name].values())
        if not runs:
            continue
        pooled: dict[str, Any] = {"rounds": len(runs)}
        for cls in (INTERACTIVE, BULK):
            t = [x for r in runs for x in r["ttft"][cls]]
            g = [x for r in runs for x in r["itl"][cls]]
            pooled[cls] = {
                "ttft_samples": len(t), "ttft_mean_ms": _mean(t) * 1e3,
                **{f"ttft_p{q}_ms": pct(t, q / 100) * 1e3 for q in (50, 95, 99)},
                "itl_samples": len(g), "itl_p50_ms": pct(g, 0.5) * 1e3,
                "itl_p99_ms": pct(g, 0.99) * 1e3,
                "counts": {k: sum(r["counts"][cls][k] for r in runs)
                           for k in runs[0]["counts"][cls]}}
        t_all = [x for r in runs for x in r["ttft_all"]]
        pooled[INTERACTIVE].update({f"ttft_all_p{q}_ms": pct(t_all, q / 100) * 1e3
                                    for q in (50, 95, 99)})
        seconds = sum(r["window"] for r in runs)
        pooled["bulk_tokens_per_s"] = sum(r["bulk_tokens"] for r in runs) / seconds
        # Per second of engine CPU: the box is shared, and the engine's share of a core
        # moves between scenarios with the other jobs' load; this takes that out.
        pooled["bulk_tokens_per_engine_cpu_s"] = sum(r["bulk_tokens"] for r in runs) / sum(
            r["cpu"]["engine"] * r["window"] for r in runs)
        pooled["short_streams"] = sum(r["short_streams"] for r in runs)
        pooled["waiting_samples"] = sum(r["waiting_samples"] for r in runs)
        pooled["busy_any"] = _mean([x for r in runs for x in r["busy_any"]])
        pooled["slot_share"] = _mean([x for r in runs for x in r["slot_share"]])
        pooled["slot_share_all"] = _mean([x for r in runs for x in r["slot_share_all"]])
        pooled["deferred_mean"] = _mean([x for r in runs for x in r["deferred"]])
        pooled["engine_tokens_per_s"] = _mean([r["engine_tokens_per_s"] for r in runs])
        pooled["cpu"] = {k: _mean([r["cpu"][k] for r in runs]) for k in runs[0]["cpu"]}
        mine = [r for r in results if r["scenario"] == name]
        if any(r.get("slot_time") for r in mine):
            pooled["slot_time"] = {k: _mean([r["slot_time"][k] for r in mine])
                                   for k in mine[0]["slot_time"]}
            pooled["queue_wait"] = {cls: queue_wait([r["front"] for r in mine], cls)
                                    for cls in (INTERACTIVE, BULK)}
            for cls in (INTERACTIVE, BULK):
                waits = [w for r in mine for _, w in r.get("sidecar_waits", {}).get(cls, [])]
                pooled["queue_wait"][cls].update({
                    "admitted": len(waits), "trace_mean_ms": _mean(waits) * 1e3,
                    "trace_p50_ms": pct(waits, 0.5) * 1e3,
                    "trace_p99_ms": pct(waits, 0.99) * 1e3,
                    "waited": sum(1 for x in waits if x > 0)})
            pooled["victim_share"] = _mean([v for r in mine
                                            if not math.isnan(v := victim_share(r))])
            splits = [split_ttft(r) for r in mine]
            at_once = [x for a, _, _ in splits for x in a]
            queued = [x for _, q, _ in splits for x in q]
            pooled["ttft_split"] = {
                "at_once": len(at_once), "at_once_p50_ms": pct(at_once, 0.5) * 1e3,
                "at_once_p99_ms": pct(at_once, 0.99) * 1e3,
                "queued": len(queued), "queued_p50_ms": pct(queued, 0.5) * 1e3,
                "queued_p99_ms": pct(queued, 0.99) * 1e3,
                "left_out": sum(n for _, _, n in splits)}
        pooled["per_round"] = {
            "interactive_ttft_p99_ms": [pct(r["ttft_all"], 0.99) * 1e3 for r in runs],
            "bulk_completed": [r["counts"][BULK]["completed"] for r in runs],
            "bulk_tokens_per_s": [r["bulk_tokens"] / r["window"] for r in runs]}
        out[name] = pooled
    for s in out.values():
        base = out.get(BASELINE, {}).get(INTERACTIVE, {}).get("ttft_all_p99_ms", math.nan)
        s["ttft_p99_ratio"] = s[INTERACTIVE]["ttft_all_p99_ms"] / base
        if UNPROTECTED in out:
            ref = out[UNPROTECTED]
            s["bulk_completed_vs_s1"] = (s[BULK]["counts"]["completed"]
                                         / max(1, ref[BULK]["counts"]["completed"]))
            s["bulk_tokens_vs_s1"] = (s["bulk_tokens_per_s"]
                                      / max(1e-9, ref["bulk_tokens_per_s"]))
            s["bulk_per_cpu_vs_s1"] = (s["bulk_tokens_per_engine_cpu_s"]
                                       / max(1e-9, ref["bulk_tokens_per_engine_cpu_s"]))
    for name, s in out.items():
        s["paired"] = paired(by_round, name)
    return out


def _p99(f: dict[str, Any]) -> float:
    return pct(f["ttft_all"], 0.99) * 1e3


def _tokens(f: dict[str, Any]) -> float:
    return float(f["bulk_tokens"]) / float(f["window"])


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if math.isinf(b):
        return math.nan if math.isinf(a) else 0.0
    return math.inf if math.isinf(a) else a / b if b > 0 else math.nan


def median(xs: Iterable[float]) -> float:
    ys = sorted(x for x in xs if not math.isnan(x))
    if not ys:
        return math.nan
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def paired(by_round: dict[str, dict[int, dict[str, Any]]], name: str) -> dict[str, Any]:
    """Per round, this scenario against S0, S1 and the alternatives of the same round
    (the same requests, minutes apart on the same box), and the median over rounds:
    the box's load moves the engine's speed between rounds far more than within one."""
    mine = by_round.get(name, {})

    def against(other: str, f: Any) -> list[float]:
        theirs = by_round.get(other, {})
        return [f(mine[r], theirs[r]) for r in sorted(mine) if r in theirs]

    out: dict[str, Any] = {
        "ttft_p99_vs_s0": against(BASELINE, lambda a, b: _ratio(_p99(a), _p99(b))),
        "bulk_completed_vs_s1": against(UNPROTECTED, lambda a, b: _ratio(
            a["counts"][BULK]["completed"], b["counts"][BULK]["completed"])),
        "bulk_tokens_vs_s1": against(UNPROTECTED, lambda a, b: _ratio(_tokens(a), _tokens(b)))}
    for alt in ALTERNATIVES:
        out[f"ttft_p99_vs_{alt}"] = against(alt, lambda a, b: _ratio(_p99(a), _p99(b)))
        out[f"bulk_tokens_vs_{alt}"] = against(alt, lambda a, b: _ratio(_tokens(a),
                                                                        _tokens(b)))
    out["median"] = {k: median(v) for k, v in out.items()}
    return out


def problems(summary: dict[str, Any], names: Sequence[str], bulk: Sequence[str],
             gate: Sequence[str]) -> list[str]:
    """What says a scenario did not really run: missing, no interactive request timed, no
    bulk token, no engine sample taken while bulk waited, a sidecar that admitted
    nothing or left no slot trace. Empty when the report can be read."""
    out = []
    for name in names:
        s = summary.get(name)
        if s is None:
            out.append(f"{name}: no run")
            continue
        i = s[INTERACTIVE]
        if i["counts"]["sent"] == 0 or math.isnan(i["ttft_all_p99_ms"]):
            out.append(f"{name}: no interactive request timed")
        if name in bulk:
            if s[BULK]["counts"]["sent"] == 0 or not s["bulk_tokens_per_s"] > 0:
                out.append(f"{name}: no bulk token received")
            if s["waiting_samples"] == 0:
                out.append(f"{name}: no engine sample while bulk waited")
        if name in gate:
            if "slot_time" not in s or not s["slot_time"]["held"] > 0:
                out.append(f"{name}: the sidecar's slot trace holds no admission")
            if not s.get("queue_wait", {}).get(INTERACTIVE, {}).get("admitted", 0) > 0:
                out.append(f"{name}: the sidecar admitted no interactive request")
    return out


def goals(summary: dict[str, Any], name: str) -> list[tuple[str, bool, bool | None]]:
    """The goals for one (priority-gate) scenario: (what, met on the rounds pooled, met on
    the median of the per-round paired ratios; None where there is no ratio)."""
    s = summary[name]
    m = s["paired"]["median"]
    out: list[tuple[str, bool, bool | None]] = [
        (f"interactive TTFT p99 <= {GOAL_TTFT_RATIO}x S0's: pooled "
         f"{_x(s['ttft_p99_ratio'])}, median of the rounds {_x(m['ttft_p99_vs_s0'])}",
         s["ttft_p99_ratio"] <= GOAL_TTFT_RATIO, m["ttft_p99_vs_s0"] <= GOAL_TTFT_RATIO),
        (f"bulk completed >= {GOAL_BULK_SHARE:.1%} of S1's: pooled "
         f"{s.get('bulk_completed_vs_s1', math.nan):.1%}, median of the rounds "
         f"{m['bulk_completed_vs_s1']:.1%}",
         s.get("bulk_completed_vs_s1", 0.0) >= GOAL_BULK_SHARE,
         m["bulk_completed_vs_s1"] >= GOAL_BULK_SHARE)]
    for alt in ALTERNATIVES:
        if alt in summary:
            a = summary[alt]
            mine, theirs = s[INTERACTIVE]["ttft_all_p99_ms"], a[INTERACTIVE]["ttft_all_p99_ms"]
            out.append((
                f"TTFT p99 below {alt}'s at >= its bulk tokens/s: pooled {_ms(mine)} vs "
                f"{_ms(theirs)} ms at {s['bulk_tokens_per_s']:.1f} vs "
                f"{a['bulk_tokens_per_s']:.1f} tokens/s; median of the rounds "
                f"{_x(m[f'ttft_p99_vs_{alt}'])} its p99 at {_x(m[f'bulk_tokens_vs_{alt}'])} "
                "its tokens/s",
                mine < theirs and s["bulk_tokens_per_s"] >= a["bulk_tokens_per_s"],
                m[f"ttft_p99_vs_{alt}"] < 1 and m[f"bulk_tokens_vs_{alt}"] >= 1))
    out.append((f"engine busy >= {GOAL_BUSY:.0%} while bulk waits, a slot processing: "
                f"{s['busy_any']:.1%}", s["busy_any"] >= GOAL_BUSY, None))
    out.append((f"engine busy >= {GOAL_BUSY:.0%} while bulk waits, share of its slots "
                f"processing: {s['slot_share']:.1%}", s["slot_share"] >= GOAL_BUSY, None))
    return out


def _x(r: float) -> str:
    return "—" if math.isnan(r) else "∞" if math.isinf(r) else f"{r:.2f}x"


def one_line(res: dict[str, Any], w: Workload, slots: int) -> str:
    f = run_figures(res, slots)
    i, b = f["counts"][INTERACTIVE], f["counts"][BULK]
    t = f["ttft_all"]
    note = ""
    if "adaptive_warmup_secs" in res:
        warm = res["adaptive_warmup_secs"]
        note = ("; its first minRTT not done within the warm-up" if warm is None
                else f"; its first minRTT done after {warm:.0f} s of warm-up")
    return (f"round {res['round'] + 1} {res['scenario']:<5} interactive TTFT p50 "
            f"{_ms(pct(t, 0.5) * 1e3):>6} p99 {_ms(pct(t, 0.99) * 1e3):>6} ms "
            f"({i['completed']} of {i['sent']} answered); bulk done {b['completed']:3} "
            f"refused {b['refused']:3} timed out {b['timed out']:2}, "
            f"{f['bulk_tokens'] / w.seconds:5.1f} tok/s; slots busy while bulk waits "
            f"{_mean(f['slot_share']):.0%}; cpu "
            + " ".join(f"{k} {v:.0%}" for k, v in f["cpu"].items())
            + f"; load {res['loadavg']}{note}")


def _ms(x: float) -> str:
    return "—" if math.isnan(x) else "∞" if math.isinf(x) else f"{x:,.0f}"


def table(summary: dict[str, Any], titles: dict[str, str], gate: Sequence[str] = ()
          ) -> list[str]:
    rounds = max(s["rounds"] for s in summary.values())
    lines = ["", f"  Interactive ({rounds} round(s) pooled; TTFT and inter-token latency "
             "measured by the client, ms; TTFT over every request sent, a refused or "
             "timed-out one counted as never answered, ∞):", "",
             "| scenario | TTFT p50 | p95 | p99 | p99 / S0 (median of the rounds' ratios) | "
             "p99 per round | p99 of those "
             "answered | ITL p99 | sent | completed | refused | timed out |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        i = s[INTERACTIVE]
        c = i["counts"]
        ratio = s["ttft_p99_ratio"]
        lines.append(
            f"| {name} {titles.get(name, '')} | {_ms(i['ttft_all_p50_ms'])} | "
            f"{_ms(i['ttft_all_p95_ms'])} | {_ms(i['ttft_all_p99_ms'])} | "
            f"{_x(ratio)} ({_x(s['paired']['median']['ttft_p99_vs_s0'])}) | "
            + ", ".join(_ms(x) for x in s["per_round"]["interactive_ttft_p99_ms"])
            + f" | {_ms(i['ttft_p99_ms'])} | {_ms(i['itl_p99_ms'])} | {c['sent']} | "
            f"{c['completed']} | "
            f"{c['refused']} | {c['timed out']} |")
    lines += ["", "  Bulk and the engine (busy: the engine's own /metrics, sampled every "
              "0.25 s while bulk waits; CPU: share of one core over the window):", "",
              "| scenario | bulk sent | completed (vs S1; median of the rounds' ratios) | "
              "per round | refused | timed out | "
              "open at end | TTFT p50 / p99 ms | tokens/s (vs S1) | per engine CPU-s (vs S1) "
              "| ITL p99 | engine busy | slots busy | engine queue | CPU envoy / sidecar / "
              "client / engine |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        b = s[BULK]
        c = b["counts"]
        cpu = s["cpu"]
        if c["sent"] == 0:
            lines.append(f"| {name} | 0 | — | — | — | — | — | — | — | — | — | — | "
                         f"{s['slot_share_all']:.0%} (all samples) | — | "
                         f"{cpu['envoy']:.0%} / — / {cpu['client']:.0%} / "
                         f"{cpu['engine']:.0%} |")
            continue
        lines.append(
            f"| {name} | {c['sent']} | {c['completed']} ({s['bulk_completed_vs_s1']:.1%}; "
            f"{s['paired']['median']['bulk_completed_vs_s1']:.1%}) | "
            + ", ".join(str(x) for x in s["per_round"]["bulk_completed"])
            + f" | {c['refused']} | {c['timed out']} | {c['open']} | "
            f"{_ms(b['ttft_p50_ms'])} / {_ms(b['ttft_p99_ms'])} | "
            f"{s['bulk_tokens_per_s']:.1f} ({s['bulk_tokens_vs_s1']:.1%}) | "
            f"{s['bulk_tokens_per_engine_cpu_s']:.0f} ({s['bulk_per_cpu_vs_s1']:.1%}) | "
            f"{_ms(b['itl_p99_ms'])} | {s['busy_any']:.1%} | {s['slot_share']:.1%} | "
            f"{s['deferred_mean']:.1f} | {cpu['envoy']:.0%} / "
            + (f"{cpu['sidecar']:.0%}" if "sidecar" in cpu else "—")
            + f" / {cpu['client']:.0%} / {cpu['engine']:.0%} |")
    gated = [n for n in gate if n in summary and "slot_time" in summary[n]]
    if gated:
        lines += ["", "  priority-gate's side (the sidecar's slot trace, bench/slots.py: slot "
                  "time over the window, 'held' being admission to release, i.e. the engine's "
                  "time and the loop's legs together; queue waits of the requests admitted "
                  "from the window's start on, drain included):", "",
                  "| scenario | slots held | the engine's own slots processing | idle, kept "
                  "for interactive's reservation | "
                  "idle, a waiter could take it | idle, nobody waiting | interactive: queued / "
                  "admitted | its queue wait mean / p50 / p99 | TTFT p50 / p99 of those "
                  "admitted at once | of those queued | bulk queue wait mean | a bulk "
                  "request admitted and before its first token (a preemption victim) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in gated:
            st, qw = summary[name]["slot_time"], summary[name]["queue_wait"]
            sp = summary[name]["ttft_split"]
            qi = qw[INTERACTIVE]
            lines.append(
                f"| {name} | {st['held']:.1%} | {summary[name]['slot_share_all']:.1%} | "
                f"{st['idle_reserved']:.1%} | "
                f"{st['idle_takeable']:.1%} | {st['idle_none_waiting']:.1%} | "
                f"{qi['waited']} / {qi['admitted']} | {_ms(qi['trace_mean_ms'])} / "
                f"{_ms(qi['trace_p50_ms'])} / {_ms(qi['trace_p99_ms'])} ms | "
                f"{_ms(sp['at_once_p50_ms'])} / {_ms(sp['at_once_p99_ms'])} ms | "
                f"{_ms(sp['queued_p50_ms'])} / {_ms(sp['queued_p99_ms'])} ms | "
                f"{_ms(qw[BULK]['trace_mean_ms'])} ms | "
                f"{summary[name]['victim_share']:.0%} of the time |")
    for name in gate:
        if name in summary:
            lines += ["", f"  Goals, {name} (verdict on the rounds pooled / on the median "
                      "of the per-round paired ratios):"]
            for text, pooled, med in goals(summary, name):
                verdict = ("PASS" if pooled else "FAIL") + " / " + (
                    "—   " if med is None else "PASS" if med else "FAIL")
                lines.append(f"    {verdict}  {text}")
    short = sum(s["short_streams"] for s in summary.values())
    lines.append(f"\n  streams that ended ok with fewer or more tokens than asked: {short}")
    return lines


def plot(results: list[dict[str, Any]], w: Workload, names: Sequence[str], path: Path
         ) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.9 * rows), sharex=True, sharey=True,
                             squeeze=False)
    floor = 0.01  # refusals are drawn here (they have no first token)
    for ax, name in zip(axes.flat, names, strict=False):
        runs = [r for r in results if r["scenario"] == name]
        start = 0.0
        while start < w.seconds:
            ax.axvspan(start, min(w.seconds, start + w.on_secs), color="0.92", lw=0)
            start += w.on_secs + w.off_secs
        for cls, color, size in ((BULK, "tab:orange", 6), (INTERACTIVE, "tab:blue", 9)):
            recs = [x for r in runs for x in r["records"] if x["cls"] == cls]
            got = [x for x in recs if x["tokens"]]
            ax.scatter([x["sent"] for x in got], [x["tokens"][0] - x["sent"] for x in got],
                       s=size, color=color, alpha=0.6, lw=0, label=f"{cls} TTFT")
            no = [x for x in recs if not x["tokens"] and x["outcome"] != "open"]
            if no:
                ax.scatter([x["sent"] for x in no], [floor] * len(no), marker="x", s=14,
                           color=color, alpha=0.8, label=f"{cls} refused / timed out")
        t = ttfts([x for r in runs for x in r["records"] if x["cls"] == INTERACTIVE],
                  unanswered=True)
        ax.set_title(f"{name}: interactive TTFT p99 {_ms(pct(t, 0.99) * 1e3)} ms", fontsize=10)
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, max(w.bulk_timeout, w.interactive_timeout))
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("request sent at (s into the window; grey: interactive burst)")
    for ax in axes[:, 0]:
        ax.set_ylabel("time to first token (s)")
    seen: dict[str, Any] = {}
    for ax in axes.flat[:len(names)]:
        handles, labels = ax.get_legend_handles_labels()
        for handle, label in zip(handles, labels, strict=True):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen.keys()), loc="upper center", ncol=4,
               fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
