"""Does llama-server free a slot when a *streamed* request's client leaves before its first token?

``bench.llama_cancel`` measures a non-streamed victim: llama.cpp notices a closed
connection only after a second with no result of any task, so while anything else
streams, the victim runs to its end. A streamed request is answered differently: its
response head goes out with its first token, so a client that left is seen then, and
the task is cancelled. Here, directly against one real ``llama-server`` with 2 slots:

1. A (1,500 tokens) and B (3,000 tokens) stream in both slots;
2. V is sent (it waits in the engine's queue) and its client hangs up, as an Envoy
   reset after a preemption would; C (5 tokens) is sent behind it;
3. when A ends, its slot goes to V. How long after A's end C gets its first token says
   what V cost: its prefill and one token if it was cancelled at its first token, its
   whole generation (or B's end) if it ran on.

Both with V streamed and with V not streamed, ``--repeats`` times each. Writes
bench/out/qos-cancel.txt.

    python -m bench.qos.streamed_cancel [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp

from bench._util import OUT, loadavg
from bench.llama_cancel import wait_idle
from devtools.llama import LlamaFleet


def body(tokens: int, stream: bool) -> bytes:
    return json.dumps({"max_tokens": tokens, "ignore_eos": True, "stream": stream,
                       "cache_prompt": False,
                       "messages": [{"role": "user", "content": "hello there"}]}).encode()


async def read(s: aiohttp.ClientSession, url: str, tokens: int, stream: bool,
               first: asyncio.Future[float] | None = None) -> float:
    """Send one request and read it to its end; its first body bytes resolve ``first``;
    returns when it ended."""
    async with s.post(f"{url}/v1/chat/completions", data=body(tokens, stream)) as r:
        async for _ in r.content.iter_any():
            if first is not None and not first.done():
                first.set_result(time.monotonic())
    return time.monotonic()


async def one(url: str, victim_streams: bool) -> float:
    """Seconds from A's end to C's first byte."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        a = asyncio.ensure_future(read(s, url, 1500, True))
        b = asyncio.ensure_future(read(s, url, 3000, True))
        await asyncio.sleep(0.5)
        v = asyncio.ensure_future(read(s, url, 3000, victim_streams))
        await asyncio.sleep(0.5)
        v.cancel()  # the client goes away before the victim's first byte
        with contextlib.suppress(asyncio.CancelledError):
            await v
        c_first: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        c = asyncio.ensure_future(read(s, url, 5, True, c_first))
        a_end = await a
        took = await c_first - a_end
        await c
        b.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await b
    return took


async def run(repeats: int) -> str:
    fleet = LlamaFleet(1, workdir=Path(tempfile.mkdtemp(prefix="smg-qos-cancel-")),
                       parallel=2)
    await fleet.start()
    lines = [f"llama-server, 2 slots, both streaming; a third request's client hangs up while "
             f"it waits in the engine's queue; seconds from the first slot's end to the first "
             f"byte of a 5-token request queued behind it (load average {loadavg()})"]
    try:
        url = fleet.urls[0]
        for streams in (True, False):
            runs = []
            for _ in range(repeats):
                await wait_idle(url)
                runs.append(await one(url, streams))
            lines.append(f"  victim {'streamed    ' if streams else 'not streamed'} "
                         + "  ".join(f"{t:6.2f} s" for t in runs))
    finally:
        await fleet.stop()
        shutil.rmtree(fleet.workdir, ignore_errors=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    text = asyncio.run(run(args.repeats))
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "qos-cancel.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
