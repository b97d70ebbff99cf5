"""Where the gRPC server listens: ``HOST:PORT`` on TCP, or ``unix:///path``.

The loopback TCP port can be called by every process in the pod's network
namespace (all its containers). A Unix socket narrows that to processes that can
reach the file and have permission on it: ``--grpc-socket-mode`` (default
``0660``: the sidecar's user and group; Envoy runs as that user or in that group,
or shares the volume with ``fsGroup``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config imports this module: --help must not load grpc
    import grpc

UNIX_PREFIX = "unix://"
DEFAULT_SOCKET_MODE = 0o660


@dataclass(frozen=True, slots=True)
class GrpcListen:
    host: str = ""
    port: int = 0
    path: str | None = None  # a Unix socket path instead of host:port

    def __str__(self) -> str:
        return f"{UNIX_PREFIX}{self.path}" if self.path is not None else f"{self.host}:{self.port}"


def parse(value: str) -> GrpcListen:
    """``HOST:PORT`` or ``unix:///absolute/path``; ValueError otherwise."""
    if value.startswith("unix:"):
        if not value.startswith(UNIX_PREFIX):
            raise ValueError(f"a Unix socket is unix:///absolute/path, got {value!r}")
        path = value[len(UNIX_PREFIX):]
        if not path.startswith("/") or path.endswith("/") or "\x00" in path:
            raise ValueError(f"a Unix socket is unix:///absolute/path, got {value!r}")
        if len(path.encode()) > 107:  # sun_path holds 108 bytes with the NUL
            raise ValueError(f"Unix socket path over 107 bytes: {value!r}")
        return GrpcListen(path=path)
    try:
        host, port = host_port(value)
    except ValueError:
        raise ValueError(f"expected HOST:PORT or unix:///path, got {value!r}") from None
    return GrpcListen(host=host, port=port)


def host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host may be bracketed) as ``(host, port)``; ValueError otherwise.

    The one parser of ``--grpc-listen`` and ``--http-listen`` addresses: what start-up
    validates is what the servers bind.
    """
    host, sep, port = value.rpartition(":")
    # isascii: "²".isdigit() is true, yet int() refuses it.
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def parse_mode(value: str) -> int:
    """An octal permission mode such as ``0660``; ValueError otherwise."""
    try:
        mode = int(value, 8)
    except ValueError:
        raise ValueError(f"expected an octal mode such as 0660, got {value!r}") from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"expected an octal mode 0000..0777, got {value!r}")
    return mode


def bind(server: grpc.aio.Server, listen: GrpcListen, socket_mode: int) -> int:
    """Bind ``server``; returns the TCP port (0 for a Unix socket).

    grpc raises RuntimeError when the address cannot be bound; a path holding
    something other than a socket raises OSError.

    A Unix socket is created with ``socket_mode`` from the start (umask set around
    the bind, so there is no moment with wider permissions); a stale socket left by
    a killed process is replaced, any other file at the path is refused.
    """
    if listen.path is None:
        port = server.add_insecure_port(f"{listen.host}:{listen.port}")  # RuntimeError if taken
        if port == 0:
            raise OSError(f"cannot bind --grpc-listen {listen}")
        return port
    path = listen.path
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"--grpc-listen {listen}: {path} exists and is not a socket")
        os.unlink(path)
    old = os.umask(0o777 & ~socket_mode)
    try:
        server.add_insecure_port(f"unix:{path}")  # RuntimeError if it cannot
    finally:
        os.umask(old)
    return 0
