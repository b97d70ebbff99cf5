"""A real valkey-server for the ledger's tests (no fake Redis), and helpers around it.

Import the fixtures into a test module: ``from tests.ledger_support import valkey_server``.
One server per test session; each test starts from an empty database (FLUSHALL).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as redis

from devtools.valkey import ValkeyServer


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    server = ValkeyServer(tmp_path_factory.mktemp("valkey"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def connect(server: ValkeyServer) -> redis.Redis:
    return redis.Redis(port=server.port, decode_responses=True)


@pytest.fixture
async def client(valkey_server: ValkeyServer) -> AsyncIterator[redis.Redis]:
    c = connect(valkey_server)
    await c.flushall()
    try:
        yield c
    finally:
        await c.aclose()


# ------------------------------------------------------------- calls with one bad field
# What a runtime credential could send the ledger directly (FCALL), one field at a time:
# tests/test_ledger_inputs.py checks each is refused and changes nothing, and the
# differential test mixes them into its sequences.

BAD_NUMBERS = ("inf", "-inf", "nan", "1e20", "-1", "many")
BAD_INTEGERS = (*BAD_NUMBERS, "1.5")
BAD_NAMES = ("a b", "{a}", "x" * 129)

# field -> (op it rides on, bad values). Weights may be as large as a float (1e20 is a
# weight like any other), so theirs are the rest.
FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "seen": ("tick", BAD_INTEGERS),
    "settle": ("tick", BAD_NUMBERS),
    "incarnation": ("tick", ("a b", "{a}", "x" * 65)),
    "caller": ("tick", BAD_NAMES),
    "now": ("tick", BAD_NUMBERS),  # the test build's clock (production takes none)
    "ttl": ("heartbeat", (*BAD_NUMBERS, "0")),
    "capacity": ("heartbeat", BAD_INTEGERS),
    "reservation": ("heartbeat", BAD_INTEGERS),
    "keep_ended": ("heartbeat", BAD_NUMBERS),
    "heartbeat settle": ("heartbeat", BAD_NUMBERS),
    "reserved_floor": ("heartbeat", BAD_INTEGERS),
    "reserved_per_slot": ("heartbeat", BAD_NUMBERS),
    "queue_size": ("heartbeat", BAD_INTEGERS),
    "queue_timeout_secs": ("heartbeat", BAD_NUMBERS),
    "starvation_threshold_secs": ("heartbeat", BAD_NUMBERS),
    "max_queued_per_tenant": ("heartbeat", BAD_INTEGERS),
    "tenant weight": ("heartbeat", ("inf", "-inf", "nan", "0", "-1", "many")),
    "replica": ("heartbeat", BAD_NAMES),
    "min_age": ("resync", BAD_NUMBERS),
    "order": ("resync", (*BAD_INTEGERS, "0")),
    "holding class": ("resync", ("inf", "-inf", "nan", "1e20", "-3", "many", "1.5", "4")),
    "class": ("arrive", (*BAD_INTEGERS, "4")),
    "id": ("arrive", ("", "x" * 257)),
    "reason": ("release", ("inf", "-1", "replica_expired", "")),
    "multi count": ("multi", ("inf", "-inf", "nan", "1e20", "-1", "many", "0", "99")),
}
# Where each class field sits in encode_class's text (the settings' first eight fields).
CLASS_FIELDS = ("reserved_floor", "reserved_per_slot", "queue_size", "queue_timeout_secs",
                "starvation_threshold_secs", "can_preempt", "fair_queuing",
                "max_queued_per_tenant")


def bad_call(led: Any, field: str, value: str) -> list[Any]:
    """FCALL's arguments after the function name, as ``led`` (a registered FleetLedger)
    would send the field's op, with ``field`` set to ``value``."""
    from sidecar.coordination.ledger import prefix

    op = FIELDS[field][0]
    now = "" if led._clock is None else repr(float(led._clock()))
    header = [op, now, str(led.generation), repr(float(led.settle)), led.replica,
              led.incarnation]
    args: list[Any]
    if op == "tick":
        args = []
    elif op == "arrive":
        args = [led.replica, "bad-input-id", "1", "t"]
    elif op == "release":
        args = ["bad-input-id", "completed"]
    elif op == "multi":
        args = ["2", "release", "bad-input-id", "completed", "1", "tick"]
    else:
        args = list(led._heartbeat_args(led._capacity, False, 1.0))
        if op == "resync":
            args += ["0.0", str(led.resyncs + 1), "held-id", "1", "0", "0", "t"]
    if field in ("seen", "settle", "incarnation", "caller", "now"):
        header[{"now": 1, "seen": 2, "settle": 3, "caller": 4, "incarnation": 5}[field]] = value
    elif field in ("ttl", "keep_ended", "heartbeat settle", "min_age", "order", "replica"):
        args[{"replica": 0, "ttl": 1, "keep_ended": 9, "heartbeat settle": 10,
              "min_age": 11, "order": 12}[field]] = value
    elif field in ("capacity", "reservation"):
        report = args[2].split(" ")
        report[0 if field == "capacity" else 1] = value
        args[2] = " ".join(report)
    elif field in CLASS_FIELDS:
        text = args[4].split(" ")  # class 0 (bulk)
        text[CLASS_FIELDS.index(field)] = value
        args[4] = " ".join(text)
    elif field == "tenant weight":
        # class 0 under fair queuing with one weighted tenant "w"
        text = args[4].split(" ")[:8]
        text[6] = "1"
        args[4] = " ".join(text) + f" {value} 1 w"
    elif field == "holding class":
        args[14] = value
    elif field == "class":
        args[2] = value
    elif field in ("id", "reason"):
        args[1] = value  # arrive's id, release's reason
    elif field == "multi count":
        args[0] = value
    return [1, prefix(led_fleet(led), led.pool), *header, *args]


def led_fleet(led: Any) -> str:
    """The fleet id a FleetLedger was made for (from its notification key)."""
    key: str = led.events_key
    return key[key.index("{") + 1:key.index("}")]


async def keyspace(c: redis.Redis, fleet: str) -> dict[str, bytes]:
    """Every key of ``fleet`` as DUMP has it (compare two to see that nothing changed)."""
    return {k: await c.execute_command("DUMP", k, NEVER_DECODE=True)
            for k in sorted(await c.keys(f"pg:{{{fleet}}}*"))}
