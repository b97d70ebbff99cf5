"""Mixed priorities on a real engine: interactive bursts beside a bulk backlog, six fronts.

A real llama.cpp ``llama-server`` (the binary ``devtools/build-llama-server.sh`` builds;
4 slots, its default, one thread) serves a random-weight llama written with ``gguf``
(devtools/llama.py). The model is the ``medium`` one by default (12 layers, width 768,
171 MB): on this box it answers a short prompt's first token in ~0.1 s and then
generates a token every 6-17 ms per stream, ~200 tokens/s in all, the time scales of a
GPU serving a large model (llm-d's baseline: TTFT 73-97 ms, inter-token p99 25 ms). The
project's ``small`` test model (8 x 512) is 5-10x faster, which would make the proxy's
fixed per-request costs look 5-10x larger than they are in production. The workload
(bench/qos/workload.py) is llm-d-batch-gateway's shape scaled to that engine; the
scenarios (bench/qos/scenarios.py) are the fronts an operator could deploy.

Per round, every scenario runs the same seeded requests against the same engine, in
alternating order (S0..S5, then S5..S0), so drift on the shared box hits all alike; the
engine is idle (its own /metrics) before each. The load client (bench/qos/client.py)
streams every response and times each token; the driver reads the engine's /metrics
every 0.25 s (slots processing, requests deferred: the engine's own account of its
busy time and queue). Reported per scenario: interactive TTFT p50/p95/p99 and the
ratio of p99 to S0's, inter-token p99, bulk completed / refused / timed out / still
open at the window's end, bulk tokens/s received, the engine's busy time while bulk
waits, and the CPU of Envoy, the sidecar, the client and the engine. Writes
bench/out/qos.txt, qos.json, qos.png and each scenario's rendered configuration under
bench/out/qos-configs/.

    python -m bench.qos [--quick] [--rounds 6] [--seconds 30] [--on-secs 7.5] [--seed N]
                        [--model medium|small] [--scenarios S0,S1,...]
                        [--interactive-rps R --bulk-rps R]   (skip the calibration)

Without rates, each round starts with a calibration: the engine's token rate with every
slot busy on bulk requests (T tokens/s; the engine's speed moves with the shared box's
load, so each round measures it anew). Interactive bursts then ask for a fifth of it
(T x 0.2 / 16-token outputs), bulk for 1.2x what the engine can serve (T x 1.2 / mean
bulk output), and S3's bucket lets through 0.8x of that capacity. Each round's line
gives its rates; ``--interactive-rps R --bulk-rps R`` reruns with fixed ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import slots as slot_trace
from bench._util import OUT, communicate, loadavg
from bench.qos import report
from bench.qos.scenarios import (
    BY_NAME,
    ENVOY,
    RATELIMIT_SHARE,
    SCENARIOS,
    Scenario,
    envoy_bootstrap,
    priority_yaml,
    reservation,
)
from bench.qos.workload import BULK, Request, Workload, bulk_tokens, schedule
from devtools.httpclient import HTTP_ERRORS
from devtools.httpclient import get as http_get
from devtools.llama import LlamaFleet, LlamaServer, llama_server_binary, write_tiny_model
from devtools.proc import die_with_parent
from devtools.stack import REPO, Stack, StackConfig, envoy_binary, free_port, terminate
from sidecar.slottrace import ENV as SLOT_TRACE_ENV

MODELS: dict[str, dict[str, int]] = {
    "medium": {"layers": 12, "dim": 768, "heads": 12, "ff": 2048},
    "small": {"layers": 8, "dim": 512, "heads": 8, "ff": 1024},  # the tests' model
}
SLOTS = 4  # llama-server's own default (--parallel -1 = 4)
POLL_SECS = 0.25
INTERACTIVE_SHARE = 0.2  # of the engine's tokens/s, during a burst
BULK_OVERLOAD = 1.2  # bulk arrivals / what the engine serves
HEALTH_INTERVAL = 1.0  # the sidecar's default --health-interval-secs; Envoy's checks alike
CONFIGS = "qos-configs"
# Many short rounds rather than a few long ones: on the shared box the other jobs' load
# comes in spikes, and each scenario should meet as many of them as the others.
FULL = {"rounds": 6, "seconds": 30.0, "on_secs": 7.5, "calibrate_secs": 10.0,
        "interactive_timeout": 30.0}
# A shape check in a few minutes: one round, and interactive requests stuck in an
# engine's FIFO queue given up after 15 s rather than 30 (the drain after the window).
QUICK = {"rounds": 1, "seconds": 20.0, "on_secs": 5.0, "calibrate_secs": 5.0,
         "interactive_timeout": 15.0}


class SharedEngine:
    """The running llama-server fleet, handed to each :class:`Stack` without giving it the
    engine's life: the stack neither starts nor stops it (one engine for all scenarios)."""

    def __init__(self, fleet: LlamaFleet) -> None:
        self.fleet = fleet

    @property
    def workers(self) -> list[LlamaServer]:
        return self.fleet.workers

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return self.fleet.addresses

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name.removeprefix("llamacpp:")] = float(value)
    return out


async def engine_metrics(url: str) -> dict[str, float]:
    status, body = await http_get(f"{url}/metrics", 2.0)
    if status != 200:
        raise RuntimeError(f"engine /metrics answered {status}")
    return parse_metrics(body.decode())


async def engine_idle(url: str, timeout: float = 300.0) -> float:
    """Wait until the engine runs and defers nothing (its own /metrics); seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(*HTTP_ERRORS):
            m = await engine_metrics(url)
            if m.get("requests_processing") == 0 and m.get("requests_deferred") == 0:
                return time.monotonic() - t0
        await asyncio.sleep(0.25)
    raise TimeoutError(f"engine {url} still busy after {timeout:.0f} s")


async def poll_engine(url: str, samples: list[dict[str, float]], stop: asyncio.Event) -> None:
    """The engine's /metrics every POLL_SECS, stamped with the monotonic clock the client
    also uses (one CLOCK_MONOTONIC for every process)."""
    while not stop.is_set():
        with contextlib.suppress(*HTTP_ERRORS):
            m = await engine_metrics(url)
            m["t"] = time.monotonic()
            samples.append(m)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_SECS)


WARMUP_LIMIT_SECS = 180.0
MIN_RTT_STATS = ("http.ingress.adaptive_concurrency.gradient_controller."
                 "min_rtt_calculation_active", "http.ingress.adaptive_concurrency."
                 "gradient_controller.min_rtt_msecs")


async def warm_adaptive(front: EnvoyAlone, w: Workload, seed: int, workdir: Path, tag: str
                        ) -> float | None:
    """Drive the round's kind of traffic through S2's filter until its first minRTT
    measurement is done (a fresh Envoy starts with one: the limit pinned at its floor
    until 50 whole streams have ended), so that the window sees the controller at work
    rather than its start-up. Seconds it took, or None if not done within
    WARMUP_LIMIT_SECS."""
    reqs = schedule(replace(w, seconds=WARMUP_LIMIT_SECS), seed)
    spec = {"tag": f"{tag}-warm", "port": front.listen_port, "window": WARMUP_LIMIT_SECS,
            "timeouts": {"interactive": w.interactive_timeout, "bulk": w.bulk_timeout},
            "requests": requests_json(reqs), "pids": [], "warmup": 0,
            "out": str(workdir / f"result-{tag}-warm.json")}
    path = workdir / f"client-{tag}-warm.json"
    path.write_text(json.dumps(spec))
    proc = await asyncio.create_subprocess_exec(
        *die_with_parent([sys.executable, "-m", "bench.qos.client", str(path)]),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, cwd=REPO)
    t0 = time.monotonic()
    took = None
    try:
        while time.monotonic() - t0 < WARMUP_LIMIT_SECS and proc.returncode is None:
            with contextlib.suppress(*HTTP_ERRORS):
                stats = await front.stats()
                if (stats.get(MIN_RTT_STATS[0]) == 0 and stats.get(MIN_RTT_STATS[1], 0) > 0):
                    took = time.monotonic() - t0
                    break
            await asyncio.sleep(0.5)
    finally:
        if proc.returncode is None:
            proc.kill()  # its connections close: Envoy resets them, no latency sample
        await proc.wait()
    return took


async def run_client(spec: dict[str, Any], workdir: Path, timeout: float) -> dict[str, Any]:
    path = workdir / f"client-{spec['tag']}.json"
    spec = {**spec, "out": str(workdir / f"result-{spec['tag']}.json")}
    path.write_text(json.dumps(spec))
    proc = await asyncio.create_subprocess_exec(
        *die_with_parent([sys.executable, "-m", "bench.qos.client", str(path)]),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    _, err = await communicate(proc, timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"load client failed ({proc.returncode}): {err.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return result


def requests_json(reqs: list[Request]) -> list[list[Any]]:
    return [[r.at, r.cls, r.prompt, r.tokens, r.seed] for r in reqs]


class EnvoyAlone:
    """A plain Envoy (bench/qos/scenarios.py's bootstrap) in front of the engine."""

    def __init__(self, scenario: Scenario, workdir: Path, fleet: LlamaFleet,
                 bulk_rps_limit: float) -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.fleet = fleet
        self.bulk_rps_limit = bulk_rps_limit
        self.proc: subprocess.Popen[bytes] | None = None
        self.listen_port = self.admin_port = 0
        self.config_text = ""

    async def start(self) -> None:
        for attempt in range(3):
            self.listen_port, self.admin_port = free_port(), free_port()
            self.config_text = envoy_bootstrap(
                self.scenario, listen_port=self.listen_port, admin_port=self.admin_port,
                workers=self.fleet.addresses, slots=SLOTS, bulk_rps_limit=self.bulk_rps_limit,
                health_interval_secs=HEALTH_INTERVAL)
            cfg = self.workdir / f"envoy-{self.scenario.name}.yaml"
            cfg.write_text(self.config_text)
            log = self.workdir / f"envoy-{self.scenario.name}.log"
            with open(log, "ab") as f:
                self.proc = subprocess.Popen(
                    die_with_parent([envoy_binary(), "-c", str(cfg), "--concurrency", "1",
                                     "-l", "warning", "--disable-hot-restart"]),
                    stdout=f, stderr=f, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                await self.wait_ready(log)
                return
            except RuntimeError:
                terminate(self.proc)
                if attempt == 2:
                    raise

    async def wait_ready(self, log: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        stat = "cluster.workers.membership_healthy"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(*HTTP_ERRORS):
                status, body = await http_get(
                    f"http://127.0.0.1:{self.admin_port}/stats?filter=^{stat}$", 0.5)
                if status == 200 and body.decode().strip().endswith(": 1"):
                    return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"envoy not ready: {log.read_text()[-2000:]}")

    async def stats(self) -> dict[str, float]:
        _, body = await http_get(
            f"http://127.0.0.1:{self.admin_port}/stats?filter=adaptive_concurrency|"
            "rate_limit|upstream_rq_retry$", 2.0)
        out = {}
        for line in body.decode().splitlines():
            name, _, value = line.partition(": ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
        return out

    async def stop(self) -> None:
        terminate(self.proc)
        self.proc = None


def gate_stack(scenario: Scenario, workdir: Path, fleet: LlamaFleet, w: Workload) -> Stack:
    cfg = StackConfig(
        workers=len(fleet.workers), max_running_requests=None,
        priority_yaml=priority_yaml(w.bulk_timeout, scenario.priority_overrides),
        # Anonymous clients may ask for interactive (no tenant ceilings in this bench).
        sidecar_args=("--priority-scheduler-default-max-class", "interactive",
                      *scenario.sidecar_args),
        health_interval_secs=HEALTH_INTERVAL, log_level="warning",
        edge_shed=scenario.edge_shed)
    stack = Stack(cfg, workdir=workdir / scenario.name, engines=SharedEngine(fleet))
    stack.workdir.mkdir(parents=True, exist_ok=True)
    trace = stack.workdir / "slots.trace"
    trace.unlink(missing_ok=True)
    stack.config.extra_env[SLOT_TRACE_ENV] = str(trace)
    return stack


SIDECAR_KEEP = ("smg_scheduler_admit_total", "smg_sidecar_edge_shed_total",
                "smg_sidecar_preemption_suspended", "smg_scheduler_preemption_total",
                "smg_sidecar_capacity", "smg_sidecar_reserved_slots",
                "smg_scheduler_queue_wait_seconds")


def slot_breakdown(stack: Stack, t0_wall: float, window: float, reserved: int
                   ) -> dict[str, float]:
    """The sidecar's own account of its slots over the window (bench.slots, from its slot
    trace): shares of slot-seconds held by an admission, idle while a request waited
    (kept for interactive's unused reservation, or a gap a waiter could have taken) and
    idle with nobody waiting. There are no worker records here (the engine is real), so
    'held' is admission to release, engine time and the loop's two legs together."""
    trace = slot_trace.read_trace(Path(stack.config.extra_env[SLOT_TRACE_ENV]))
    b = slot_trace.account(trace, [], SLOTS, t0_wall, t0_wall + window,
                           reserved={"interactive": reserved})
    total = b.slot_seconds
    return {"held": b.total("to worker") / total,
            "idle_reserved": b.idle_reserved / total,
            "idle_takeable": (b.idle_waiting - b.idle_reserved) / total,
            "idle_none_waiting": b.idle / total}


def sidecar_waits(stack: Stack, t0_wall: float) -> dict[str, list[tuple[float, float]]]:
    """Per class, (arrival, queue wait) of each request the sidecar saw from the window's
    start on and admitted (a wait of 0: at once), in arrival order, from the slot
    trace's Q and A lines (wall clock)."""
    trace = slot_trace.read_trace(Path(stack.config.extra_env[SLOT_TRACE_ENV]))
    queued: dict[str, float] = {}
    out: dict[str, list[tuple[float, float]]] = {}
    for t, kind, aid, cls in trace:
        if kind == "Q":
            queued[aid] = t
        elif kind == "A":
            arrived = queued.pop(aid, t)
            if arrived >= t0_wall:
                out.setdefault(cls, []).append((arrived, t - arrived))
    for rows in out.values():
        rows.sort()
    return out


async def run_scenario(scenario: Scenario, reqs: list[Request], fleet: LlamaFleet,
                       w: Workload, workdir: Path, tag: str, bulk_rps_limit: float,
                       configs: Path | None, warmup_seed: int = 0) -> dict[str, Any]:
    url = fleet.urls[0]
    idle = await engine_idle(url)
    front: EnvoyAlone | Stack
    if scenario.front == ENVOY:
        front = EnvoyAlone(scenario, workdir, fleet, bulk_rps_limit)
    else:
        front = gate_stack(scenario, workdir, fleet, w)
    await front.start()
    samples: list[dict[str, float]] = []
    stop = asyncio.Event()
    warmed: float | None = None
    adaptive = isinstance(front, EnvoyAlone) and scenario.envoy_filter == "adaptive_concurrency"
    if isinstance(front, EnvoyAlone) and adaptive:
        try:
            warmed = await warm_adaptive(front, w, warmup_seed, workdir, tag)
            await engine_idle(url)
        except BaseException:
            await front.stop()
            raise
    try:
        if isinstance(front, Stack):
            assert front.envoy is not None and front.sidecar is not None
            port, pids = front.listen_port, [front.envoy.pid, front.sidecar.pid]
        else:
            assert front.proc is not None
            port, pids = front.listen_port, [front.proc.pid, 0]
        engine = fleet.workers[0].proc
        assert engine is not None
        spec = {"tag": tag, "port": port, "window": w.seconds,
                "timeouts": {"interactive": w.interactive_timeout, "bulk": w.bulk_timeout},
                "requests": requests_json(reqs), "pids": [*[p for p in pids if p], engine.pid]}
        poller = asyncio.ensure_future(poll_engine(url, samples, stop))
        la = loadavg()
        result = await run_client(spec, workdir, w.seconds + w.interactive_timeout + 120)
        stop.set()
        await poller
        cpu = dict(zip(["envoy", "sidecar", "engine"] if pids[1] else ["envoy", "engine"],
                       result["cpu"], strict=True))
        extra: dict[str, float] = {}
        if isinstance(front, Stack):
            m = await front.metrics()
            extra = {k: v for k, v in m.items() if k.startswith(SIDECAR_KEEP)}
        else:
            extra = await front.stats()
        if configs is not None:
            save_configs(scenario, front, configs)
    finally:
        stop.set()
        await front.stop()
    slot_time: dict[str, float] = {}
    waits: dict[str, list[tuple[float, float]]] = {}
    if isinstance(front, Stack):  # stopped: the trace is flushed
        slot_time = slot_breakdown(front, result["t0_wall"], result["window"],
                                   reservation(SLOTS, scenario.priority_overrides))
        waits = sidecar_waits(front, result["t0_wall"])
    return {"scenario": scenario.name, "tag": tag, "loadavg": la, "idle_wait": idle,
            "t0": result["t0"], "window": result["window"], "records": result["records"],
            "cpu": {**cpu, "client": result["client_cpu"]}, "engine": samples,
            "t0_wall": result["t0_wall"], "front": extra, "slot_time": slot_time,
            "sidecar_waits": waits, **({"adaptive_warmup_secs": warmed} if adaptive else {})}


def save_configs(scenario: Scenario, front: EnvoyAlone | Stack, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(front, EnvoyAlone):
        (d / f"{scenario.name}-envoy.yaml").write_text(front.config_text)
        return
    (d / f"{scenario.name}-envoy.yaml").write_text(front.envoy_config.read_text())
    (d / f"{scenario.name}-priority.yaml").write_text(front.priority_path.read_text())
    argv = front.sidecar_argv()
    at = argv.index("sidecar")  # python -m sidecar ...: the flags, not the interpreter
    (d / f"{scenario.name}-sidecar.args").write_text(
        "priority-sidecar " + " ".join(argv[at + 1:]) + "\n")


async def calibrate(url: str, w: Workload, seconds: float, seed: int, workdir: Path
                    ) -> float:
    """Tokens/s the engine streams with every slot busy, on bulk's own requests (sent
    straight to the engine, more than it can serve, all at once)."""
    rng = random.Random(f"{seed}/calibrate")
    reqs = [Request(0.0, BULK, w.bulk_prompt, bulk_tokens(rng, w), rng.randrange(1 << 30))
            for _ in range(int(seconds * 8) + 2 * SLOTS)]
    port = int(url.rpartition(":")[2])
    spec = {"tag": "calibrate", "port": port, "window": seconds,
            "timeouts": {"interactive": seconds + 30, "bulk": seconds + 30},
            "requests": requests_json(reqs), "pids": [], "warmup": 2}
    res = await run_client(spec, workdir, seconds + 120)
    skip = min(2.0, seconds / 4)  # the first prefills: not the steady state
    n = sum(1 for r in res["records"] for t in r["tokens"] if skip <= t <= seconds)
    await engine_idle(url)
    return n / (seconds - skip)


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def mean_bulk_tokens(w: Workload) -> float:
    rng = random.Random(0)
    return statistics.fmean(bulk_tokens(rng, w) for _ in range(100_000))


async def run(args: argparse.Namespace) -> int:
    binary = llama_server_binary()
    if binary is None:
        print("qos: no llama-server binary: run `make llama-server` (or set LLAMA_SERVER_BIN)")
        return 1
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or "S0" not in names or "S1" not in names:
        print(f"qos: scenarios must include S0 and S1 and be among {sorted(BY_NAME)}; "
              f"got {names}")
        return 2
    scenarios = [BY_NAME[n] for n in names]
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    w = Workload(seconds=args.seconds, on_secs=args.on_secs, off_secs=args.on_secs,
                 interactive_timeout=args.interactive_timeout)
    workdir = Path(tempfile.mkdtemp(prefix="smg-qos-"))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    model = write_tiny_model(workdir / f"qos-{args.model}.gguf", **MODELS[args.model])
    fleet = LlamaFleet(1, workdir=workdir, model=model, parallel=SLOTS)
    await fleet.start()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    try:
        mean_bulk = mean_bulk_tokens(w)
        fixed = bool(args.interactive_rps and args.bulk_rps)
        say(f"qos: {time.strftime('%F %T')}, load average {loadavg()}; llama-server "
            f"{Path(binary).parent.parent.name}, {SLOTS} slots, 1 thread, model "
            f"{args.model} {MODELS[args.model]} ({model.stat().st_size / 1e6:.0f} MB)")
        rates = (f"{args.interactive_rps:.2f} req/s" if fixed else
                 f"{INTERACTIVE_SHARE:.0%} of the engine's tokens/s (calibrated each round)")
        say(f"  workload: {w.seconds:g} s windows; interactive {w.interactive_prompt}-token "
            f"prompts, {w.interactive_tokens}-token outputs, at {rates} for {w.on_secs:g} s "
            f"then a fifteenth of that for {w.off_secs:g} s; bulk {w.bulk_prompt}-token "
            f"prompts, outputs lognormal mean {w.bulk_mean:g} sd {w.bulk_sd:g} in "
            f"[{w.bulk_min}, {w.bulk_max}] (mean {mean_bulk:.1f}), a backlog of {w.backlog} "
            f"then {BULK_OVERLOAD:g}x the engine's bulk capacity; timeouts interactive "
            f"{w.interactive_timeout:g} s, bulk {w.bulk_timeout:g} s")
        say(f"  S3's bucket: {RATELIMIT_SHARE:g}x the engine's bulk capacity, bursts of "
            f"{SLOTS}; S4/S5 reserve {reservation(SLOTS)} of {SLOTS} slots for interactive")
        say(f"  rerun: python -m bench.qos --rounds {args.rounds} --seconds {w.seconds:g} "
            f"--on-secs {w.on_secs:g} --interactive-timeout {w.interactive_timeout:g} "
            f"--calibrate-secs {args.calibrate_secs:g} --seed {seed} --model {args.model} "
            f"--scenarios "
            f"{args.scenarios}" + (f" --interactive-rps {args.interactive_rps:g} --bulk-rps "
                                   f"{args.bulk_rps:g}" if fixed else "")
            + "  (--interactive-rps R --bulk-rps R: a round's rates, without calibrating)")
        results: list[dict[str, Any]] = []
        rounds: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            # The engine's speed moves with the box's other load: each round's rates come
            # from the engine as it is then, and the round's scenarios share them.
            tok_s = None
            if fixed:
                wr = replace(w, interactive_rps=args.interactive_rps, bulk_rps=args.bulk_rps)
            else:
                tok_s = await calibrate(fleet.urls[0], w, args.calibrate_secs, seed + rnd,
                                        workdir)
                wr = replace(w, interactive_rps=INTERACTIVE_SHARE * tok_s / w.interactive_tokens,
                             bulk_rps=BULK_OVERLOAD * tok_s / mean_bulk)
            limit = RATELIMIT_SHARE * wr.bulk_rps / BULK_OVERLOAD
            say(f"  round {rnd + 1}: "
                + (f"engine {tok_s:.0f} tokens/s with every slot busy; " if tok_s else "")
                + f"interactive {wr.interactive_rps:.2f} req/s in bursts ({wr.off_rps:.2f} "
                f"between), bulk {wr.bulk_rps:.2f} req/s, S3's bucket {limit:.2f} req/s; "
                f"load average {loadavg()}")
            rounds.append({"round": rnd, "tokens_per_s": tok_s, "bucket_rps": limit,
                           "workload": wr.as_dict()})
            reqs = schedule(wr, seed + rnd)
            order = scenarios if rnd % 2 == 0 else scenarios[::-1]
            for sc in order:
                mine = reqs if sc.bulk else [r for r in reqs if r.cls != BULK]
                res = await run_scenario(sc, mine, fleet, wr, workdir, f"{rnd}-{sc.name}",
                                         limit, out_dir / CONFIGS if rnd == 0 else None,
                                         warmup_seed=seed + 1000 + rnd)
                res["round"] = rnd
                results.append(res)
                say("  " + report.one_line(res, wr, SLOTS))
        summary = report.summarize(results, w, SLOTS, [s.name for s in scenarios])
        for line in report.table(summary, {s.name: s.title for s in scenarios},
                                 [s.name for s in scenarios if s.front != ENVOY]):
            say(line)
        bad = report.problems(summary, [s.name for s in scenarios],
                              [s.name for s in scenarios if s.bulk],
                              [s.name for s in scenarios if s.front != ENVOY])
        for line in bad:
            say(f"  NOT RUN: {line}")
        plot = report.plot(results, w, [s.name for s in scenarios],
                           out_dir / f"{args.out}.png")
        say(f"  plot: {shown(plot)}; configs: {shown(out_dir / CONFIGS)}/; "
            f"{time.monotonic() - t_start:.0f} s in all, load average {loadavg()}")
        (out_dir / f"{args.out}.json").write_text(json.dumps({
            "workload": w.as_dict(), "seed": seed, "model": args.model, "slots": SLOTS,
            "rounds": rounds, "summary": summary, "runs": results}))
        (out_dir / f"{args.out}.txt").write_text("\n".join(lines) + "\n")
    finally:
        await fleet.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the model file is 171 MB
    return 1 if bad else 0


TABLES_START = "\n  Interactive ("


def rerender(path: Path) -> int:
    """The tables, goals and plot again from a run's JSON (OUT.json), with the run's own
    header and per-run lines from OUT.txt beside it: for a report that changed after
    the run, without running it again."""
    data = json.loads(path.read_text())
    txt = path.with_suffix(".txt")
    head = txt.read_text().split(TABLES_START)[0].rstrip("\n").splitlines()
    names = list(data["summary"])
    gate = [n for n in names if n in BY_NAME and BY_NAME[n].front != ENVOY]
    w = Workload(**data["workload"])
    summary = report.summarize(data["runs"], w, data["slots"], names)
    lines = head + report.table(summary, {n: BY_NAME[n].title for n in names}, gate)
    bad = report.problems(summary, names, [n for n in names if BY_NAME[n].bulk], gate)
    lines += [f"  NOT RUN: {line}" for line in bad]
    plot = report.plot(data["runs"], w, names, path.with_suffix(".png"))
    lines.append(f"  plot: {shown(plot)} (tables and plot rendered again from "
                 f"{shown(path)} on {time.strftime('%F %T')})")
    print("\n".join(lines))
    data["summary"] = summary
    path.write_text(json.dumps(data))
    txt.write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one round of 20 s windows, 5 s phases, 5 s calibration (flags "
                        "given explicitly win)")
    p.add_argument("--rounds", type=int, default=None, help="default 6")
    p.add_argument("--seconds", type=float, default=None,
                   help="each scenario's window (default 30)")
    p.add_argument("--on-secs", type=float, default=None,
                   help="length of an interactive burst and of the pause after it "
                        "(default 7.5)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", choices=tuple(MODELS), default="medium")
    p.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS))
    p.add_argument("--interactive-rps", type=float, default=0.0)
    p.add_argument("--bulk-rps", type=float, default=0.0)
    p.add_argument("--calibrate-secs", type=float, default=None, help="default 10")
    p.add_argument("--interactive-timeout", type=float, default=None,
                   help="the client gives up on an interactive request after this long "
                        "(default 30)")
    p.add_argument("--out", default="qos", help="OUT.txt, .json, .png in --out-dir")
    p.add_argument("--out-dir", default=str(OUT), help="default bench/out")
    p.add_argument("--from-json", metavar="OUT.json",
                   help="run nothing: render the tables and plot again from a run's JSON")
    args = p.parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json))
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return asyncio.run(run(args))
