"""The ext_proc handler's ordering races, on a scripted stream (real gRPC is in test_e2e)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from devtools import pooled
from sidecar import codec
from sidecar.admission import AdmissionController
from sidecar.classes import PriorityClass
from sidecar.completion import ResponsePathService
from sidecar.config import BUILTIN_CLASSES, DEFAULT_POOL
from sidecar.metrics import Metrics
from sidecar.scheduler import Scheduler

RESPONSE_HEADERS = ep.ProcessingRequest(response_headers=ep.HttpHeaders()).SerializeToString()


def request_headers(aid: str) -> bytes:
    r = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
    md = struct_pb2.Struct()
    md.update({codec.ADMISSION_ID_KEY: aid})
    r.metadata_context.filter_metadata[codec.AUTHZ_NAMESPACE].CopyFrom(md)
    return bytes(r.SerializeToString())


class ScriptedStream:
    """Stands in for the grpc.aio context: reads from a queue, records writes."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[bytes] = asyncio.Queue()
        self.writes: list[str] = []
        self.closed = False

    async def read(self) -> bytes:
        return await self.incoming.get()

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise RuntimeError("write after the RPC finished")
        await asyncio.sleep(0)
        self.writes.append(ep.ProcessingResponse.FromString(data).WhichOneof("response"))


async def test_preemption_in_the_same_turn_as_response_headers_is_still_delivered() -> None:
    classes = {c: replace(x, reserved_floor=0, reserved_per_slot=0.0)
               for c, x in BUILTIN_CLASSES.items()}
    ctl = AdmissionController(Scheduler(classes, 2, time.monotonic,
                                        preemptible_on_admit=False), lease_secs=30)
    await ctl.admit(PriorityClass.INTERACTIVE, "t")
    victim = (await ctl.admit(PriorityClass.BULK, "t")).admission.id
    stream = ScriptedStream()
    stream.incoming.put_nowait(request_headers(victim))
    handler = asyncio.ensure_future(
        ResponsePathService(pooled.single(ctl)).process(None, stream))  # type: ignore[arg-type]
    for _ in range(5):
        await asyncio.sleep(0)
    assert stream.writes == ["request_headers"]
    # The worker's response headers arrive and, in the same loop turn, a system
    # request preempts the victim: the 503 must still be written, once.
    stream.incoming.put_nowait(RESPONSE_HEADERS)
    assert (await ctl.admit(PriorityClass.SYSTEM, "t")).preempted
    await asyncio.wait_for(handler, 2)
    stream.closed = True
    for _ in range(5):
        await asyncio.sleep(0)
    assert stream.writes == ["request_headers", "immediate_response"]
    ctl.close()


async def test_victim_preempted_before_its_request_headers_never_reaches_a_worker() -> None:
    classes = {c: replace(x, reserved_floor=0, reserved_per_slot=0.0)
               for c, x in BUILTIN_CLASSES.items()}
    ctl = AdmissionController(Scheduler(classes, 1, time.monotonic,
                                        preemptible_on_admit=False), lease_secs=30)
    victim = (await ctl.admit(PriorityClass.BULK, "t")).admission.id
    queued = asyncio.ensure_future(ctl.admit(PriorityClass.INTERACTIVE, "t"))
    await asyncio.sleep(0)
    stream = ScriptedStream()
    stream.incoming.put_nowait(request_headers(victim))
    await asyncio.wait_for(ResponsePathService(pooled.single(ctl)).process(None, stream), 2)  # type: ignore[arg-type]
    # the queued interactive request took the slot when the stop channel opened, and
    # the victim is answered 503 instead of being let through to a worker
    assert stream.writes == ["immediate_response"]
    assert (await asyncio.wait_for(queued, 1)).preempted
    ctl.close()


class BrokenStream(ScriptedStream):
    """Envoy's side went away: every write after the first fails."""

    async def write(self, data: bytes) -> None:
        if self.writes:
            raise ConnectionResetError("stream reset")
        await super().write(data)


async def test_a_preemption_that_cannot_be_written_is_counted() -> None:
    classes = {c: replace(x, reserved_floor=0, reserved_per_slot=0.0)
               for c, x in BUILTIN_CLASSES.items()}
    metrics = Metrics(tenant_top_n=4)
    ctl = AdmissionController(Scheduler(classes, 1, time.monotonic,
                                        preemptible_on_admit=False), lease_secs=30,
                              metrics=metrics.pool(DEFAULT_POOL))
    victim = (await ctl.admit(PriorityClass.BULK, "t")).admission.id
    stream = BrokenStream()
    stream.incoming.put_nowait(request_headers(victim))
    handler = asyncio.ensure_future(
        ResponsePathService(pooled.single(ctl, metrics), metrics).process(
            None, stream))  # type: ignore[arg-type]

    async def let_through() -> None:
        while stream.writes != ["request_headers"]:
            await asyncio.sleep(0)

    await asyncio.wait_for(let_through(), 2)
    assert (await ctl.admit(PriorityClass.SYSTEM, "t")).preempted
    stream.incoming.put_nowait(None)  # type: ignore[arg-type]  # the stream ends (EOF)
    await asyncio.wait_for(handler, 2)
    assert metrics.registry.get_sample_value(
        "smg_sidecar_preemption_delivery_failed_total") == 1
    assert metrics.registry.get_sample_value(
        "smg_scheduler_admit_total", {"class": "bulk", "outcome": "preempted"}) == 1
    ctl.close()
