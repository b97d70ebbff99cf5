"""``--grpc-listen unix:///path``: the sidecar on a Unix socket, Envoy on a pipe.

The loopback TCP port can be called by every process in the pod; the socket only
by processes with permission on the file (``--grpc-socket-mode``, default 0660).
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import grpc
import pytest
from envoy.service.auth.v3 import external_auth_pb2

from devtools.httpclient import request
from sidecar import listen
from sidecar.app import build_runtime
from sidecar.config import ConfigError, parse_settings
from tests.conftest import StackFactory, assert_denied, complete_held, settle, until
from tests.grpc_client import admission_id, check_request
from tests.test_e2e import hold, inflight_is

PRIORITY = """
classes:
  system: {reserved_floor: 0}
  interactive: {reserved_floor: 0, reserved_per_slot: 0.0}
  default: {reserved_per_slot: 0.0, queue_size: 0}
"""


@pytest.mark.e2e
async def test_envoy_reaches_the_sidecar_on_a_unix_socket(make_stack: StackFactory) -> None:
    stack = await make_stack(priority_yaml=PRIORITY, workers=1, max_running_requests=1,
                             grpc_unix=True)
    assert stack.grpc_socket is not None
    st = os.stat(stack.grpc_socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    # Check (admit, then 429 with the contract body), ext_proc and the access log all
    # travel over the socket: the slot is released at the end.
    busy = await hold(stack, "busy")
    m = await until(stack, inflight_is("default", 1))
    assert m['smg_sidecar_ext_proc_streams_total{admitted="true"}'] == 1
    assert_denied(await request(stack.listen_port), 429, "scheduler_queue_full", "2")
    await complete_held(stack, busy, "busy")
    m = await settle(stack)
    assert m['smg_sidecar_released_total{class="default",reason="completed"}'] == 1


async def test_socket_mode_is_applied_and_a_stale_socket_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "g.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # what a killed sidecar leaves behind
    stale.close()
    settings = parse_settings([
        "--grpc-listen", f"unix://{sock}", "--grpc-socket-mode", "0600",
        "--http-listen", "127.0.0.1:0", "--worker-capacity-override", "2"])
    app = await build_runtime(settings)
    try:
        await app.serve()
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            check = channel.unary_unary(
                "/envoy.service.auth.v3.Authorization/Check",
                request_serializer=external_auth_pb2.CheckRequest.SerializeToString,
                response_deserializer=external_auth_pb2.CheckResponse.FromString)
            resp = await check(check_request({}), timeout=5)
            assert resp.status.code == 0 and len(admission_id(resp)) == 32
    finally:
        await app.stop()
    assert not sock.exists()  # removed on stop


def test_listen_values_are_checked() -> None:
    assert listen.parse("unix:///run/pg/grpc.sock") == listen.GrpcListen(path="/run/pg/grpc.sock")
    assert listen.parse("[::1]:9001") == listen.GrpcListen(host="::1", port=9001)
    for bad in ("unix:relative.sock", "unix://relative", "unix:///" + "x" * 120, "9001"):
        with pytest.raises(ConfigError):
            parse_settings(["--grpc-listen", bad])
    for bad in ("rw", "0999", "01777"):
        with pytest.raises(ConfigError):
            parse_settings(["--grpc-socket-mode", bad])
    assert parse_settings(["--grpc-socket-mode", "0640"]).grpc_socket_mode == 0o640


async def test_a_file_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    settings = parse_settings(["--grpc-listen", f"unix://{path}", "--http-listen",
                               "127.0.0.1:0", "--worker-capacity-override", "2"])
    with pytest.raises(OSError, match="not a socket"):
        await build_runtime(settings)
    assert path.read_text() == "keep me"
