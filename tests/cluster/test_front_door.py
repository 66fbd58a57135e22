"""The front door (HAProxy) in front of a stand-in upstream: it passes requests and streams
through, and refuses generation requests with the ingress's 429 while the flag says full."""

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from cluster.ports import free_port
from cluster.serve.front_door import FrontDoor, FrontDoorFlag
from cluster.serve.openai_protocol import error_body


class Upstream(BaseHTTPRequestHandler):
    """Stands in for Serve's HTTP proxy: /health, and a three-event SSE stream on any POST."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/v1/slow":  # answers nothing until the client is gone (or 30 s pass)
            self.connection.settimeout(30)
            try:
                closed = self.connection.recv(1) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False
            self.server.hang_ups.append(time.monotonic() if closed else None)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(3):
            self.wfile.write(f"data: {i}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def front_door():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    upstream.hang_ups = []
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    door = FrontDoor("127.0.0.1", free_port(), upstream.server_address[1], max_pending_requests=32)
    door.start()
    door.upstream = upstream
    yield door
    door.stop()
    upstream.shutdown()


def post(door, path: str) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{door.port}{path}", json={"prompt": "hi"}, timeout=10)


def test_passes_requests_and_streams_through_while_not_full(front_door):
    assert requests.get(f"http://127.0.0.1:{front_door.port}/health", timeout=10).text == "ok"
    r = post(front_door, "/v1/completions")
    assert r.status_code == 200
    assert [line for line in r.text.split("\n") if line] == ["data: 0", "data: 1", "data: 2", "data: [DONE]"]


def test_refuses_generation_with_the_ingress_429_while_full_and_admits_again_after(front_door):
    flag = FrontDoorFlag(str(front_door.dir))
    flag.set_full(True)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(front_door, path)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1" and r.headers["x-pagoda-refused-by"] == "front-door"
        assert r.json() == error_body("more than 32 requests are waiting; retry later", "rate_limit_error")
    # everything else still passes: health, models, status
    assert requests.get(f"http://127.0.0.1:{front_door.port}/health", timeout=10).status_code == 200
    assert post(front_door, "/v1/pagoda/other").status_code == 200
    flag.set_full(False)
    assert post(front_door, "/v1/completions").status_code == 200


def test_a_client_that_hangs_up_while_waiting_closes_the_upstream_request(front_door):
    """A request waiting in the engine (nothing answered yet) is cancelled when its client goes."""
    client = socket.create_connection(("127.0.0.1", front_door.port))
    client.sendall(b"POST /v1/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    time.sleep(0.5)
    hung_up = time.monotonic()
    client.close()
    deadline = time.monotonic() + 10
    while not front_door.upstream.hang_ups:
        assert time.monotonic() < deadline, "the upstream request outlived its client"
        time.sleep(0.05)
    (closed_at,) = front_door.upstream.hang_ups
    assert closed_at is not None and closed_at - hung_up < 2


def test_stop_ends_haproxy_and_removes_its_directory(front_door):
    front_door.stop()
    assert front_door.process.poll() is not None and not front_door.dir.exists()


def test_a_flag_without_a_front_door_never_raises(tmp_path):
    flag = FrontDoorFlag(str(tmp_path))  # no admin socket there
    flag.set_full(True)
    flag.set_full(False)
    assert not flag.full
