from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.stack import Stack, StackConfig

StackFactory = Callable[..., Awaitable[Stack]]


async def settle(stack: Stack, timeout: float = 8.0) -> dict[str, float]:
    """Wait until the sidecar reports nothing in flight and nothing queued."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        m = await stack.metrics()
        inflight = sum(v for k, v in m.items() if k.startswith("smg_scheduler_inflight{"))
        depth = sum(v for k, v in m.items() if k.startswith("smg_scheduler_queue_depth{"))
        if inflight == 0 and depth == 0:
            return m
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not settled: inflight={inflight} queued={depth}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[StackFactory]:
    stacks: list[Stack] = []

    async def factory(**kw: Any) -> Stack:
        stack = Stack(StackConfig(**kw), workdir=tmp_path)
        stacks.append(stack)
        await stack.start()
        return stack

    yield factory
    try:
        for stack in stacks:
            if stack.sidecar is not None:
                # Every end-to-end test ends with no slot held and nothing queued.
                await settle(stack)
    finally:
        for stack in stacks:
            await stack.stop()
