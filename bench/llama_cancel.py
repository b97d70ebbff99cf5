"""Does a real llama-server free a slot when its client goes away? (``make llama-server`` first)

What preemption relies on: Envoy closes the victim's upstream connection and the engine
stops it. Against llama.cpp's server, directly (no Envoy, no sidecar): two long
non-streamed requests fill its two slots, one client hangs up (what a preemption does),
and a short request arrives at once. How long that request takes shows whether the slot
was freed, under the conditions the reference names:

- ``idle``: nothing else produces a result while the engine runs;
- ``polled``: ``/slots`` is asked every 0.2 s (a scrape, the saturation guard);
- ``stream``: the other request streams tokens instead;
- ``no hang-up``: nobody hangs up; the short request waits for a slot to end (what
  queueing without preemption costs).

    .venv/bin/python -m bench.llama_cancel [--tokens 1500]

Writes bench/out/llama_cancel.txt. Figures are seconds on this machine; compare rows of
one run. Whether a hang-up frees the slot depends on whether a second passes with no
result of any task, so the same case can go either way: hence the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from devtools.llama import LlamaFleet

OUT = Path(__file__).parent / "out" / "llama_cancel.txt"


def body(tokens: int, stream: bool = False) -> bytes:
    return json.dumps({"max_tokens": tokens, "ignore_eos": True, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


async def one_case(url: str, case: str, tokens: int) -> tuple[float, int]:
    """(seconds until the short request answered, slots processing when it arrived)."""
    async with aiohttp.ClientSession() as s:
        chat = f"{url}/v1/chat/completions"
        victim = asyncio.ensure_future(s.post(chat, data=body(tokens)))
        other = asyncio.ensure_future(s.post(chat, data=body(tokens, stream=case == "stream")))
        await asyncio.sleep(1.0)  # both are generating
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set():
                async with s.get(f"{url}/slots") as r:
                    await r.read()
                await asyncio.sleep(0.2)

        poller = asyncio.ensure_future(poll()) if case == "polled" else None
        if case != "no hang-up":
            victim.cancel()  # the client goes away, as Envoy's reset does on a preemption
            with contextlib.suppress(asyncio.CancelledError):
                await victim
        async with s.get(f"{url}/slots") as r:
            busy = sum(1 for x in await r.json() if x.get("is_processing"))
        t0 = time.monotonic()
        async with s.post(chat, data=body(5)) as r:
            await r.read()
        took = time.monotonic() - t0
        stop.set()
        if poller is not None:
            await poller
        for task in (other, victim):
            if not task.done():
                with contextlib.suppress(Exception):
                    resp = await task
                    await resp.read()
                    resp.close()
            elif not task.cancelled() and task.exception() is None:
                task.result().close()
    return took, busy


async def wait_idle(url: str) -> None:
    """Until no slot of the llama-server at ``url`` is processing."""
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(f"{url}/slots") as r:
                if not any(x.get("is_processing") for x in await r.json()):
                    return
            await asyncio.sleep(0.2)


async def run(tokens: int, repeats: int) -> str:
    fleet = LlamaFleet(1, workdir=Path(tempfile.mkdtemp(prefix="smg-llama-cancel-")),
                       parallel=2)
    await fleet.start()
    lines = [f"llama-server, 2 slots, two {tokens}-token requests running; "
             "seconds until a 5-token request answers"]
    try:
        url = fleet.urls[0]
        for case in ("idle", "polled", "stream", "no hang-up"):
            runs = []
            for _ in range(repeats):
                await wait_idle(url)
                runs.append(await one_case(url, case, tokens))
            lines.append(f"  {case:<11} " + "  ".join(f"{t:6.2f} s" for t, _ in runs)
                         + "   (slots processing when it arrived: "
                         + ", ".join(str(b) for _, b in runs) + ")")
    finally:
        await fleet.stop()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=3, help="runs of each case")
    args = p.parse_args(argv)
    text = asyncio.run(run(args.tokens, args.repeats))
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
