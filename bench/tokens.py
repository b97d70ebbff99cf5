"""Token budgets: what they cost the Check path, which channel carries a request's size
and its usage, and how far the estimate is from a real engine's count.

  (a) The Check over gRPC (bench.check_throughput's client, its own process): the sidecar
      with token accounting off vs on, the Check carrying (plain) only its headers,
      (fields) json_to_metadata's max_tokens too, (body N) the request body, N bytes. Closed
      loop, rounds alternating, medians; ratios against "off, plain" of the same run.
  (b) Through a real Envoy (bench.e2e's stack): the Envoy filters off (no token
      accounting) vs the shipped channel (json_to_metadata + the Lua usage reader, budgets
      on) vs with_request_body (the body in the Check), small and 16 KiB requests, and
      streamed responses of 64 chunks (the Lua filter sees each chunk). Envoy's CPU per
      request is the channels' cost.
  (c) With ``--llama``: the estimate against a real llama-server's usage (its tiny model's
      byte-level vocabulary: a token per byte), read from the sidecar's own
      smg_sidecar_token_estimate_ratio, as an operator would.

    python -m bench.tokens [--seconds 2] [--rounds 3] [--quick] [--llama]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from envoy.service.auth.v3 import external_auth_pb2

from bench import check_throughput as ct
from bench._util import loadavg, run_client, terminate
from bench.codec import check_request_bytes
from bench.e2e import summary
from bench.httpload import through_envoy
from sidecar import codec

BUDGETS = """
tokens: {default_max_tokens: 256}
tenant_policies:
  "auth:acme": {budgets: {minute: 1000000000, month: 1000000000}}
"""


def chat_body(size: int) -> str:
    """A chat request of about ``size`` bytes (one user message), max_tokens 128."""
    base = {"model": "m", "max_tokens": 128, "messages": [{"role": "user", "content": ""}]}
    pad = max(0, size - len(json.dumps(base)))
    base["messages"][0]["content"] = ("lorem ipsum " * (pad // 12 + 1))[:pad]  # type: ignore[index]
    return json.dumps(base)


def check_variant(kind: str) -> bytes:
    """The bench's CheckRequest (10 headers, JWT metadata), plus what a channel adds."""
    req = external_auth_pb2.CheckRequest.FromString(check_request_bytes())
    if kind == "fields":
        req.attributes.metadata_context.filter_metadata[codec.REQUEST_NAMESPACE].update(
            {"max_tokens": 128})
    elif kind.startswith("body"):
        body = chat_body(int(kind[4:])).encode()
        req.attributes.request.http.raw_body = body
        req.attributes.request.http.headers["content-length"] = str(len(body))
    out: bytes = req.SerializeToString()
    return out


def client(spec: dict[str, object]) -> dict[str, object]:
    """The check_throughput client with this run's CheckRequest."""
    data = check_variant(str(spec["variant"]))
    ct.check_request_bytes = lambda: data  # type: ignore[assignment]
    return asyncio.run(ct._checks(spec))


def decode_cost() -> None:
    """What the sidecar does per Check for each channel, in process, one thread: decode
    the CheckRequest, read the token facts, estimate (best of 5 runs of 2,000)."""
    import timeit

    from sidecar.tokens import TokenSettings, estimate

    settings = TokenSettings()
    print("(a0) per Check in process: codec.decode_check + token_facts + estimate, best of 5")
    base = 0.0
    for variant in ("plain", "fields", "body4096", "body32768"):
        data = check_variant(variant)

        def one(data: bytes = data) -> None:
            estimate(codec.token_facts(codec.decode_check(data)), settings)
        us = min(timeit.repeat(one, number=2000, repeat=5)) / 2000 * 1e6
        base = base or us
        print(f"    {variant:<10} {len(data):>6} B  {us:>6.1f} us  x{us / base:.2f}")


def check_path(seconds: float, rounds: int) -> None:
    print("(a) the Check over gRPC: closed loop, 32 callers, each allowed Check released by "
          "its ALS entry; sidecar CPU per Check = server cpu / rate")
    off = ct.start_sidecar(name="off")
    on = ct.start_sidecar(priority_yaml=BUDGETS, name="on")
    points = [("off", off, "plain"), ("on", on, "plain"), ("on", on, "fields"),
              ("on", on, "body4096"), ("on", on, "body32768")]
    rps: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    try:
        for i in range(rounds):
            for name, server, variant in points if i % 2 == 0 else points[::-1]:
                r = run_client("bench.tokens", {
                    "kind": "check", "port": server.port, "server_pid": server.pid,
                    "seconds": seconds, "concurrency": 32, "variant": variant}, timeout=120)
                key = f"{name}, {variant}"
                rps.setdefault(key, []).append(ct.num(r, "rps"))
                cpu.setdefault(key, []).append(ct.num(r, "server_cpu") / max(1.0, ct.num(
                    r, "rps")) * 1e6)
                print(f"    round {i} {key:<16} {ct.fmt(r)}")
        base = statistics.median(rps["off, plain"])
        base_cpu = statistics.median(cpu["off, plain"])
        print(f"  medians of {rounds} rounds (load {loadavg()}):")
        for key in rps:
            m, c = statistics.median(rps[key]), statistics.median(cpu[key])
            print(f"    {key:<16} {m:>7,.0f} Checks/s  x{m / base:.2f}   "
                  f"{c:>5.0f} us cpu/Check  ({c - base_cpu:+.0f} us)")
    finally:
        terminate(off.proc)  # type: ignore[arg-type]
        terminate(on.proc)  # type: ignore[arg-type]


async def through_envoy_part(seconds: float, rounds: int) -> None:
    from devtools.stack import Stack, StackConfig

    print("(b) through Envoy (concurrency 1), 2 fake workers, 16 keep-alive connections; "
          "Envoy CPU per request = envoy cpu / rate")

    def config(tokens: bool, body: int | None) -> StackConfig:
        return StackConfig(workers=2, max_running_requests=1000, service_time=0.0,
                           preemption=False, log_level="warning", health_interval_secs=1.0,
                           edge_shed=False, envoy_tokens=tokens, with_request_body=body,
                           priority_yaml=BUDGETS if tokens else "", completion_tokens=64)
    stacks = {"off": Stack(config(False, None)), "fields": Stack(config(True, None)),
              "body": Stack(config(True, 65536))}
    head = {"x-smg-tenant": "auth:acme"}
    shapes = {"small": chat_body(120), "16 KiB": chat_body(16384),
              "stream 64": json.dumps({"model": "m", "max_tokens": 64, "stream": True,
                                       "stream_options": {"include_usage": True},
                                       "messages": [{"role": "user", "content": "hi"}]})}
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for stack in stacks.values():
            await stack.start()
            for w in stack.fleet.workers:  # type: ignore[attr-defined]
                w.stream_interval = 0.0
        for i in range(rounds):
            order = list(stacks.items()) if i % 2 == 0 else list(stacks.items())[::-1]
            for shape, body in shapes.items():
                for name, stack in order:
                    if name == "body" and shape == "stream 64":
                        continue  # the same Lua channel as "fields"
                    s = summary(await through_envoy(
                        stack, seconds, [{"name": "t", "headers": head}], concurrency=16,
                        body=body))
                    got.setdefault((name, shape), []).append(s)
                    print(f"    round {i} {name:<6} {shape:<9} {s['rps']:>6,.0f} req/s  p50 "
                          f"{s['p50'] * 1e6:>6.0f} us  envoy {s['envoy_cpu']:.0%} sidecar "
                          f"{s['authz_cpu']:.0%}  non-200 {s['non200']:.0f}")
        print(f"  medians of {rounds} rounds (load {loadavg()}):")
        for shape in shapes:
            base = got[("off", shape)]
            b_rps = statistics.median(x["rps"] for x in base)
            b_env = statistics.median(x["envoy_cpu"] / x["rps"] for x in base) * 1e6
            b_p50 = statistics.median(x["p50"] for x in base) * 1e6
            for name in stacks:
                if (name, shape) not in got:
                    continue
                xs = got[(name, shape)]
                r = statistics.median(x["rps"] for x in xs)
                env = statistics.median(x["envoy_cpu"] / x["rps"] for x in xs) * 1e6
                side = statistics.median(x["authz_cpu"] / x["rps"] for x in xs) * 1e6
                p50 = statistics.median(x["p50"] for x in xs) * 1e6
                print(f"    {shape:<9} {name:<6} {r:>6,.0f} req/s x{r / b_rps:.2f}  p50 "
                      f"{p50:>5.0f} us ({p50 - b_p50:+.0f})  envoy {env:>4.0f} us/req "
                      f"({env - b_env:+.0f})  sidecar {side:>4.0f} us/req")
    finally:
        for stack in stacks.values():
            await stack.stop()


async def llama_part() -> None:
    from devtools.httpclient import request
    from devtools.llama import LlamaFleet, llama_server_binary
    from devtools.stack import Stack, StackConfig

    if llama_server_binary() is None:
        print("(c) skipped: no llama-server binary (make llama-server)")
        return
    print("(c) the estimate against a real llama-server's usage, through Envoy and the "
          "sidecar (default bytes_per_token 4; the tiny model's vocabulary is bytes)")
    work = Path(tempfile.mkdtemp(prefix="smg-tokens-llama-"))
    stack = Stack(StackConfig(workers=1, priority_yaml=BUDGETS, edge_shed=False,
                              log_level="warning"), workdir=work,
                  engines=LlamaFleet(1, workdir=work / "engines", parallel=2))
    ratios: list[float] = []
    try:
        await stack.start()
        for i, size in enumerate((60, 200, 600, 1500, 3000) * 2):
            n = 4 + 6 * (i % 5)
            stream = i % 2 == 1
            doc = json.loads(chat_body(size))
            doc.update({"model": "tiny", "max_tokens": n, "stream": stream})
            if stream:
                doc["stream_options"] = {"include_usage": True}
            body = json.dumps(doc).encode()
            r = await request(stack.listen_port, headers={"x-smg-tenant": "auth:acme"},
                              body=body, timeout=120)
            if stream:
                chunks = [json.loads(line[6:]) for line in r.body.decode().splitlines()
                          if line.startswith("data: {")]
                usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
            else:
                usage = r.json()["usage"]
            est = math.ceil(len(body) / 4) + n
            ratios.append(usage["total_tokens"] / est)
            kind = "stream" if stream else "json"
            print(f"    body {len(body):>5} B  max_tokens {n:>2}  {kind:<6}"
                  f" estimate {est:>5}  usage {usage['prompt_tokens']:>5} + "
                  f"{usage['completion_tokens']:>2} = {usage['total_tokens']:>5}  "
                  f"ratio {usage['total_tokens'] / est:.2f}")
        # Each request's final access-log entry settles it: wait for all of them.
        m = await stack.metrics()
        for _ in range(100):
            if m.get('smg_sidecar_token_estimate_ratio_count{class="default"}', 0.0) >= len(
                    ratios):
                break
            await asyncio.sleep(0.1)
            m = await stack.metrics()
        count = m.get('smg_sidecar_token_estimate_ratio_count{class="default"}', 0.0)
        total = m.get('smg_sidecar_token_estimate_ratio_sum{class="default"}', 0.0)
        low = m.get('smg_sidecar_token_estimate_ratio_bucket{class="default",le="1.1"}', 0.0)
        print(f"  the sidecar's histogram: {count:.0f} settled, mean ratio "
              f"{total / max(1.0, count):.2f}, {count - low:.0f} under-estimated by over 10 %; "
              f"client-side median ratio {statistics.median(ratios):.2f}")
    finally:
        await stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=2.0, help="per point")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 s points, 1 round")
    p.add_argument("--llama", action="store_true", help="also (c), against llama-server")
    p.add_argument("--only", choices=("check", "envoy", "llama"), default=None)
    p.add_argument("--client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        print(json.dumps(client(json.loads(args.client))))
        return 0
    seconds, rounds = (1.0, 1) if args.quick else (args.seconds, args.rounds)
    print(f"tokens: {sys.argv[0]} (load {loadavg()})")
    if args.only in (None, "check"):
        decode_cost()
        check_path(seconds, rounds)
    if args.only in (None, "envoy"):
        asyncio.run(through_envoy_part(seconds, rounds))
    if args.llama or args.only == "llama":
        asyncio.run(llama_part())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

