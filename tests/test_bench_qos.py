"""bench.qos: the workload it sends, the client that times it, the report's own checks,
and (``llama``) the smallest real run, every scenario of it.

The client is checked against a scripted SSE server that cuts its bytes at random
points (HTTP chunks across events, events across TCP writes; the seed is printed), so
the token count cannot come out right by accident of framing. The report's shape check
is checked both ways: it passes a complete run and names a scenario that did not run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from bench.qos import main as qos_main
from bench.qos import report
from bench.qos.client import Client
from bench.qos.scenarios import ENVOY, SCENARIOS, envoy_bootstrap, priority_yaml, reservation
from bench.qos.workload import (
    BANNED_TOKENS,
    BULK,
    INTERACTIVE,
    Request,
    Workload,
    body,
    bulk_tokens,
    schedule,
)
from devtools.llama import llama_server_binary
from sidecar.config import parse_priority_config
from tests.sidecar_proc import free_port
from tests.test_k8s import _envoy_bin

# ----------------------------------------------------------------------------- workload


def test_schedule_is_seeded_and_the_baseline_is_its_interactive_part() -> None:
    w = Workload(seconds=60)
    a, b, c = schedule(w, 7), schedule(w, 7), schedule(w, 8)
    assert a == b and a != c
    assert [r for r in a if r.cls == INTERACTIVE] == schedule(w, 7, bulk=False)
    assert [r.at for r in a] == sorted(r.at for r in a)
    assert sum(1 for r in a if r.cls == BULK and r.at == 0.0) == w.backlog


def test_schedule_rates_follow_the_phases() -> None:
    w = Workload(seconds=4000, on_secs=10, off_secs=10, interactive_rps=3.0, bulk_rps=2.0)
    reqs = schedule(w, 1)
    on = sum(1 for r in reqs if r.cls == INTERACTIVE and w.phase_on(r.at))
    off = sum(1 for r in reqs if r.cls == INTERACTIVE and not w.phase_on(r.at))
    bulk = sum(1 for r in reqs if r.cls == BULK) - w.backlog
    # 2000 s of each phase: 6,000 and 400 expected; 2 bulk req/s over 4000 s: 8,000.
    assert 5600 < on < 6400, on
    assert 320 < off < 480, off
    assert 7600 < bulk < 8400, bulk


def test_bulk_lengths_are_the_clipped_lognormal() -> None:
    w = Workload()
    rng = random.Random(3)
    xs = [bulk_tokens(rng, w) for _ in range(50_000)]
    assert min(xs) >= w.bulk_min and max(xs) <= w.bulk_max
    assert min(xs) == w.bulk_min and max(xs) == w.bulk_max  # both clips are reached
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
    assert 60 < mean < 67, mean  # 64 before clipping
    assert 38 < sd < 50, sd


def test_body_asks_for_exactly_the_tokens_in_ascii() -> None:
    req = Request(0.0, BULK, 64, 37, 5)
    b = json.loads(body(req))
    assert b["stream"] is True and b["max_tokens"] == 37 and b["ignore_eos"] is True
    assert b["cache_prompt"] is False
    assert len(b["messages"][0]["content"]) == 64
    assert {t for t, allowed in b["logit_bias"] if allowed is False} == set(BANNED_TOKENS)
    assert all(3 + byte in BANNED_TOKENS for byte in range(0x80, 0x100))
    assert not any(3 + byte in BANNED_TOKENS for byte in range(0x20, 0x7F))


def test_s4_classes_fit_and_reserve_what_the_report_says() -> None:
    for overrides in ({}, {"interactive": {"reserved_floor": 2}}):
        text = priority_yaml(60.0, overrides)
        cfg = parse_priority_config(text)
        assert cfg.max_queue_timeout() == 60.0
        assert reservation(4, overrides) == (2 if overrides else 1)


# ------------------------------------------------------------------------------ client

TOKEN = ('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"%s"}}],'
         '"object":"chat.completion.chunk"}\n\n')
ROLE = ('data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
        '"content":null}}],"object":"chat.completion.chunk"}\n\n')
REFUSAL = b'{"error":{"code":"scheduler_queue_full"}}'
CUT, HANG, LONG, REFUSE = 1001, 1002, 1003, 1004


class ScriptedEngine:
    """An SSE server whose answer depends on max_tokens: N tokens (N < 1000), a stream cut
    after 3 tokens, no answer, a 5 s stream, or a 429; its bytes cut at random points."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.first_token_after = 0.05

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        tokens = json.loads(await reader.readexactly(length))["max_tokens"]
        try:
            if tokens == HANG:
                await reader.read()  # until the client hangs up
            elif tokens == REFUSE:
                writer.write(b"HTTP/1.1 429 Too Many Requests\r\nx-smg-error-code: "
                             b"scheduler_queue_full\r\ncontent-length: "
                             + str(len(REFUSAL)).encode() + b"\r\n\r\n" + REFUSAL)
            else:
                await self.stream(writer, tokens)
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def stream(self, writer: asyncio.StreamWriter, tokens: int) -> None:
        await asyncio.sleep(self.first_token_after)
        n = 3 if tokens == CUT else 50 if tokens == LONG else tokens
        events = ROLE + "".join(TOKEN % self.rng.choice(['"', "a", "\\\\", " ", "\\n"])
                                for _ in range(n))
        if tokens != CUT:
            events += "data: [DONE]\n\n"
        # HTTP chunks cut at random points (an event across chunks, chunks of two events),
        # then the bytes written in random pieces with pauses.
        data, i = bytearray(), 0
        raw = events.encode()
        while i < len(raw):
            size = self.rng.randint(1, 120)
            data += f"{size if i + size <= len(raw) else len(raw) - i:x}\r\n".encode()
            data += raw[i:i + size] + b"\r\n"
            i += size
        if tokens != CUT:
            data += b"0\r\n\r\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        pause = 0.1 if tokens == LONG else 0.002
        j = 0
        while j < len(data):
            size = self.rng.randint(1, 60)
            writer.write(bytes(data[j:j + size]))
            await writer.drain()
            j += size
            if self.rng.random() < 0.3:
                await asyncio.sleep(pause)


async def run_client(port: int, reqs: list[Request], window: float) -> dict[str, Any]:
    spec = {"port": port, "window": window, "timeouts": {INTERACTIVE: 2.0, BULK: 60.0},
            "requests": [[r.at, r.cls, r.prompt, r.tokens, r.seed] for r in reqs]}
    return await Client(spec).run(warmup=0)


async def test_client_counts_every_token_whatever_the_framing() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    engine = ScriptedEngine(seed)
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rng = random.Random(seed)
    wanted = [rng.randint(1, 80) for _ in range(30)]
    reqs = [Request(i * 0.01, INTERACTIVE, 8, n, i) for i, n in enumerate(wanted)]
    reqs += [Request(0.0, INTERACTIVE, 8, CUT, 100), Request(0.0, INTERACTIVE, 8, HANG, 101),
             Request(0.0, BULK, 8, REFUSE, 102), Request(0.0, BULK, 8, LONG, 103)]
    async with server:
        res = await run_client(port, reqs, window=0.5)
    recs = res["records"]
    assert len(recs) == len(reqs)
    by_expected: dict[int, list[dict[str, Any]]] = {}
    for r in recs:
        by_expected.setdefault(r["expected"], []).append(r)
    for n in wanted:
        for r in by_expected[n]:
            assert r["outcome"] == "ok" and r["status"] == 200, r
            assert len(r["tokens"]) == n, (seed, n, len(r["tokens"]))
            assert r["tokens"] == sorted(r["tokens"])
            assert r["tokens"][0] - r["sent"] >= engine.first_token_after - 0.005
    (cut,) = by_expected[CUT]
    assert cut["outcome"] == "cut" and len(cut["tokens"]) == 3
    (hang,) = by_expected[HANG]
    assert hang["outcome"] == "timeout" and hang["tokens"] == []
    assert 1.9 < hang["end"] - hang["sent"] < 3.0, hang  # the interactive timeout, 2 s
    (refused,) = by_expected[REFUSE]
    assert (refused["outcome"], refused["status"], refused["code"]) == (
        "refused", 429, "scheduler_queue_full")
    (long,) = by_expected[LONG]
    # Still streaming when the window closed and the interactive ones had all ended.
    assert long["outcome"] == "open" and 0 < len(long["tokens"]) < 50, long
    assert res["window"] == 0.5 and res["client_cpu"] >= 0


async def test_client_says_error_when_nothing_listens() -> None:
    res = await run_client(free_port(), [Request(0.0, INTERACTIVE, 8, 4, 0)], window=0.2)
    (rec,) = res["records"]
    assert rec["outcome"] == "error" and rec["status"] == 0 and rec["tokens"] == []


# ------------------------------------------------------------------------------ report


def _run(name: str, *, refused: int = 0, ttft: float = 0.1, engine: bool = True,
         bulk: bool = True) -> dict[str, Any]:
    """A synthetic run: interactive requests answered after ``ttft`` (``refused`` of them
    429), bulk requests streaming, the engine's samples."""
    recs = []
    for i in range(20):
        at = i * 0.5
        if i < refused:
            recs.append({"cls": INTERACTIVE, "at": at, "expected": 4, "sent": at,
                         "status": 429, "code": "x", "tokens": [], "end": at,
                         "outcome": "refused"})
        else:
            recs.append({"cls": INTERACTIVE, "at": at, "expected": 4, "sent": at,
                         "status": 200, "code": "",
                         "tokens": [at + ttft + 0.01 * k for k in range(4)],
                         "end": at + ttft + 0.05, "outcome": "ok"})
    if bulk:
        for i in range(5):
            recs.append({"cls": BULK, "at": 0.0, "expected": 8, "sent": 0.0, "status": 200,
                         "code": "", "tokens": [1.0 + i + 0.1 * k for k in range(8)],
                         "end": 2.0 + i, "outcome": "ok"})
    samples = [{"t": 100.0 + k * 0.25, "requests_processing": 4.0, "requests_deferred": 1.0,
                "tokens_predicted_total": 10.0 * k} for k in range(40)] if engine else []
    return {"scenario": name, "round": 0, "window": 10.0, "t0": 100.0, "records": recs,
            "engine": samples, "cpu": {"envoy": 0.1, "engine": 0.5, "client": 0.01},
            "front": {}, "loadavg": "0 0 0"}


def test_ttft_counts_refusals_as_never_answered() -> None:
    runs = [_run("S0", bulk=False), _run("S1"), _run("S2", refused=5)]
    s = report.summarize(runs, Workload(seconds=10), 4, ["S0", "S1", "S2"])
    assert s["S2"][INTERACTIVE]["ttft_p99_ms"] == pytest.approx(100.0)  # the answered
    assert math.isinf(s["S2"][INTERACTIVE]["ttft_all_p99_ms"])
    assert math.isinf(s["S2"]["ttft_p99_ratio"])
    assert s["S1"]["ttft_p99_ratio"] == pytest.approx(1.0)
    assert s["S1"][BULK]["counts"]["completed"] == 5
    assert s["S1"]["bulk_tokens_per_s"] == pytest.approx(4.0)  # 40 tokens in 10 s
    assert s["S1"]["slot_share"] == pytest.approx(1.0)


def test_shape_check_names_what_did_not_run() -> None:
    names = ["S0", "S1", "S2"]
    w = Workload(seconds=10)
    good = report.summarize([_run("S0", bulk=False), _run("S1"), _run("S2")], w, 4, names)
    assert report.problems(good, names, ["S1", "S2"], []) == []
    text = "\n".join(report.table(good, {}, []))
    assert "| S2 " in text and "| S1 " in text
    bad = report.summarize([_run("S0", bulk=False), _run("S1", engine=False)], w, 4, names)
    found = report.problems(bad, names, ["S1", "S2"], ["S1"])
    assert "S2: no run" in found
    assert "S1: no engine sample while bulk waited" in found
    assert "S1: the sidecar's slot trace holds no admission" in found


def test_envoy_bootstraps_pass_envoy_validate(tmp_path: Path) -> None:
    envoy = _envoy_bin()
    if envoy is None:
        pytest.skip("no Envoy binary (set ENVOY_BIN or run `make envoy`)")
    for sc in SCENARIOS:
        if sc.front != ENVOY:
            continue
        cfg = tmp_path / f"{sc.name}.yaml"
        cfg.write_text(envoy_bootstrap(sc, listen_port=free_port(), admin_port=free_port(),
                                       workers=[("127.0.0.1", free_port())], slots=4,
                                       bulk_rps_limit=2.5))
        out = subprocess.run([str(envoy), "--mode", "validate", "-c", str(cfg),
                              "--disable-hot-restart", "--log-level", "warn"],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, (sc.name, out.stdout + out.stderr)


# ---------------------------------------------------------------- the real engine, smallest

NO_LLAMA = llama_server_binary() is None and not os.environ.get("CI")


@pytest.mark.llama
@pytest.mark.e2e
@pytest.mark.skipif(NO_LLAMA, reason="no llama-server binary: `make llama-server` builds it")
def test_smallest_real_run_runs_every_scenario(tmp_path: Path) -> None:
    """Every scenario, one short round on the small model: the report is complete and
    each scenario's figures come from samples (the shape check inside returns 1 if not)."""
    t = time.monotonic()
    rc = qos_main(["--model", "small", "--rounds", "1", "--seconds", "4", "--on-secs", "2",
                   "--calibrate-secs", "3", "--seed", "11", "--out-dir", str(tmp_path)])
    text = (tmp_path / "qos.txt").read_text()
    assert rc == 0, text
    data = json.loads((tmp_path / "qos.json").read_text())
    names = [s.name for s in SCENARIOS]
    assert list(data["summary"]) == names
    (rnd,) = data["rounds"]
    expected = sum(1 for r in schedule(Workload(**rnd["workload"]), 11)
                   if r.cls == INTERACTIVE)
    for name in names:
        s = data["summary"][name]
        assert s[INTERACTIVE]["counts"]["sent"] == expected, name
        assert f"| {name} " in text
    for run in data["runs"]:
        assert run["engine"], run["scenario"]  # the engine's /metrics were read
        if run["scenario"] in ("S4", "S5"):
            # llama.cpp cannot cancel: the sidecar suspended preemption, reserved 1 slot.
            assert run["front"]["smg_sidecar_preemption_suspended"] == 1
            assert run["front"]['smg_sidecar_reserved_slots{class="interactive"}'] == 1
    assert (tmp_path / "qos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rerun: python -m bench.qos" in text
    assert sorted(p.name for p in (tmp_path / "qos-configs").iterdir()) == sorted(
        [f"{n}-envoy.yaml" for n in names]
        + [f"{n}-{part}" for n in ("S4", "S5") for part in ("priority.yaml", "sidecar.args")])
    # The report renders again from the JSON alone, the same tables.
    tables = text[text.index("Interactive ("):text.index("streams that ended ok")]
    assert qos_main(["--from-json", str(tmp_path / "qos.json")]) == 0
    again = (tmp_path / "qos.txt").read_text()
    assert again[again.index("Interactive ("):again.index("streams that ended ok")] == tables
    print(f"smallest run: {time.monotonic() - t:.0f} s")
