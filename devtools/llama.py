"""A real llama.cpp ``llama-server`` on loopback, serving a tiny random-weight model.

The binary is built from the source vendored in PyPI's llama-cpp-python sdist by
``devtools/build-llama-server.sh`` (``make llama-server``) into a cache directory
outside the work tree. The model is written here with PyPI's ``gguf`` package: a
llama-architecture network with random weights and a byte-level vocabulary, small
enough to write in a second and to generate ~100 tokens/s on one core. Its text is
noise; what matters is that the engine's scheduler, slots, endpoints and
connection handling are the real ones.

:class:`LlamaFleet` has the shape :class:`devtools.stack.Stack` expects of a fleet
(``start``/``stop``, ``urls``, ``addresses``, ``workers[i].healthy``), so the
end-to-end harness runs a real Envoy and sidecar in front of real engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.httpclient import HTTP_ERRORS
from devtools.httpclient import get as http_get
from devtools.proc import die_with_parent

REPO = Path(__file__).resolve().parents[1]
LLAMA_VERSION = "0.3.36"  # llama-cpp-python sdist pinned in devtools/build-llama-server.sh


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LLAMA_SERVER_CACHE")
                or Path(base) / "priority-gate" / f"llama-server-{LLAMA_VERSION}")


def llama_server_binary() -> str | None:
    """``$LLAMA_SERVER_BIN``, else the build script's cache, else ``llama-server`` on PATH."""
    for c in (os.environ.get("LLAMA_SERVER_BIN"), str(default_cache() / "bin" / "llama-server"),
              shutil.which("llama-server")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def write_tiny_model(path: Path, *, layers: int = 8, dim: int = 512, heads: int = 8,
                     ff: int = 1024, context: int = 4096, seed: int = 0) -> Path:
    """A llama-architecture GGUF with random F16 weights and a 259-token byte vocabulary
    (``<unk>``, ``<s>``, ``</s>`` and the 256 byte tokens SentencePiece falls back to)."""
    import gguf  # only the real-engine tests need it
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [
        gguf.TokenType.BYTE] * 256
    vocab = len(tokens)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("priority-gate tiny random llama")
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(dim // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)

    def weight(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", weight(vocab, dim))
    w.add_tensor("output_norm.weight", ones(dim))
    w.add_tensor("output.weight", weight(vocab, dim))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(dim))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", weight(dim, dim))
        w.add_tensor(p + "ffn_norm.weight", ones(dim))
        w.add_tensor(p + "ffn_gate.weight", weight(ff, dim))
        w.add_tensor(p + "ffn_up.weight", weight(ff, dim))
        w.add_tensor(p + "ffn_down.weight", weight(dim, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LlamaServer:
    """One ``llama-server`` process: ``--parallel`` slots, optional ``--api-key-file``.

    ``healthy`` is what :class:`devtools.stack.Stack` waits for in Envoy's view of the
    cluster (every worker of a started fleet answers its health check).
    """

    def __init__(self, binary: str, model: Path | None, workdir: Path, *, name: str = "llama",
                 parallel: int = 4, context: int = 8192, metrics: bool = True,
                 api_key_file: Path | None = None, extra_args: Sequence[str] = ()) -> None:
        self.binary = binary
        self.model = model
        self.workdir = workdir
        self.name = name
        self.parallel = parallel
        self.context = context
        self.metrics = metrics
        self.api_key_file = api_key_file
        self.extra_args = list(extra_args)
        self.host = "127.0.0.1"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / f"{name}.log"
        self.healthy = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [self.binary, "--host", self.host, "--port", str(self.port),
                "--parallel", str(self.parallel), "-c", str(self.context),
                "--threads", "1", "--threads-http", "4", "--no-webui"]
        if self.model is not None:
            argv += ["-m", str(self.model)]
        if self.metrics:
            argv.append("--metrics")
        if self.api_key_file is not None:
            argv += ["--api-key-file", str(self.api_key_file)]  # the key itself never in argv
        return argv + self.extra_args

    async def start(self, timeout: float = 60.0) -> None:
        for attempt in range(3):
            self.port = _free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(die_with_parent(self.argv()), stdout=log,
                                             stderr=log, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            try:
                await self.wait_ready(timeout)
                return
            except RuntimeError:
                if attempt == 2:
                    raise
                self.stop_now()

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(*HTTP_ERRORS):
                status, _ = await http_get(f"{self.url}/health", 0.5)
                if status == 200:
                    return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"llama-server not ready: {self.log.read_text()[-3000:]}")

    def stop_now(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    async def stop(self) -> None:
        self.stop_now()

    async def slots_processing(self) -> int:
        """How many slots the engine itself says are processing (``GET /slots``)."""
        headers = self.auth_headers()
        status, body = await http_get(f"{self.url}/slots{self._model_query()}", 2.0,
                                      headers=headers)
        if status != 200:
            raise RuntimeError(f"/slots answered {status}: {body[:200]!r}")
        return sum(1 for s in json.loads(body) if s.get("is_processing"))

    async def metric(self, name: str) -> float:
        """One of the engine's own Prometheus gauges (``--metrics``)."""
        status, body = await http_get(f"{self.url}/metrics{self._model_query()}", 2.0,
                                      headers=self.auth_headers())
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        for line in body.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rpartition(" ")[2])
        raise KeyError(name)

    def _model_query(self) -> str:
        # A router (no -m) answers these per model; the tests' model is "tiny".
        return "?model=tiny" if self.model is None else ""

    def auth_headers(self) -> dict[str, str]:
        if self.api_key_file is None:
            return {}
        return {"Authorization": "Bearer " + self.api_key_file.read_text().strip()}


class LlamaFleet:
    """``n`` llama-servers on one tiny model: a fleet :class:`devtools.stack.Stack` can front."""

    def __init__(self, n: int = 1, *, workdir: Path | None = None, model: Path | None = None,
                 router: bool = False, **server_kwargs: object) -> None:
        binary = llama_server_binary()
        if binary is None:
            raise FileNotFoundError("no llama-server binary: run `make llama-server` "
                                    "(or set LLAMA_SERVER_BIN)")
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="smg-llama-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = model or write_tiny_model(self.workdir / "tiny.gguf")
        served: Path | None = self.model
        if router:
            # Router mode: no model at start; the engine lists the directory's models and
            # loads one (in a child process) when a request names it ("tiny").
            models = self.workdir / "models"
            models.mkdir(exist_ok=True)
            link = models / "tiny.gguf"
            if not link.exists():
                link.symlink_to(self.model.resolve())
            extra = [*server_kwargs.pop("extra_args", ()), "--models-dir", str(models)]  # type: ignore[misc]
            server_kwargs["extra_args"] = extra
            served = None
        self.workers = [LlamaServer(binary, served, self.workdir, name=f"llama{i + 1}",
                                    **server_kwargs)  # type: ignore[arg-type]
                        for i in range(n)]

    async def start(self) -> None:
        try:
            await asyncio.gather(*(w.start() for w in self.workers))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for w in self.workers:
            w.stop_now()

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(w.host, w.port) for w in self.workers]
