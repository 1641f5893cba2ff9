"""A real S3-protocol server on loopback for tests and benchmarks, and a fault-injecting proxy.

:func:`moto_server` starts moto's standalone server (``ThreadedMotoServer``,
from ``moto[server]``) on a free loopback port: the clients under test talk
HTTP to it through s3fs and botocore, as they would to S3. :class:`FaultProxy`
sits between them: it forwards each request, or, at configured rates, drops
the connection without an answer or answers ``503 SlowDown``, and counts the
bytes of object data that pass each way.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import random
import re
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


# Runs the server in a process of its own until its standard input closes; prints its endpoint.
_SERVER_PROCESS = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def moto_server(*, own_process: bool = False) -> Iterator[str]:
    """A moto S3 server on a free loopback port; yields its endpoint URL.

    ``own_process``: run it in a child process, so that its request handling
    does not share this process's interpreter lock with the client under test
    (as a real S3 endpoint does not): what benchmarks time.
    """
    if own_process:
        child = subprocess.Popen([sys.executable, "-c", _SERVER_PROCESS], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            yield child.stdout.readline().strip()
        finally:
            child.stdin.close()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        return
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


class FaultProxy:
    """An HTTP proxy on loopback to ``upstream`` that fails requests on purpose.

    Requests whose method and path match ``only`` (a regex on ``"METHOD
    /path?query"``; default: every request) are dropped (the connection
    closed unanswered) with probability ``drop_rate``, else answered ``503
    SlowDown`` with probability ``error_rate``; the rest are forwarded.
    ``fetched`` and ``sent`` count the object bytes of forwarded GET
    replies and PUT/POST bodies, per path, ``requests`` the forwarded
    requests by method, and ``log`` lists them (``"METHOD /path?query"``) in
    the order their answers came.

    Conditional PUTs (``If-Match``, ``If-None-Match``) are forwarded one at a
    time: moto checks the condition and then writes, where S3 does both as
    one atomic step, so two writers racing for one object would otherwise
    both succeed there.
    """

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.drop_rate = 0.0
        self.error_rate = 0.0
        self.only = re.compile("")
        self.fetched: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()  # forwarded, by method
        self.log: list[str] = []
        self.part_puts = 0  # parts of multipart uploads forwarded
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._conditional = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def set_faults(self, drop_rate: float = 0.0, error_rate: float = 0.0, only: str = "") -> None:
        self.drop_rate, self.error_rate, self.only = drop_rate, error_rate, re.compile(only)

    def reset_counts(self) -> None:
        with self._lock:
            self.fetched.clear()
            self.sent.clear()
            self.faults.clear()
            self.requests.clear()
            self.log.clear()
            self.part_puts = 0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        path = request.path.split("?")[0]
        with self._lock:
            roll = self._random.random() if self.only.search(f"{request.command} {request.path}") \
                else 1.0
        if roll < self.drop_rate:
            with self._lock:
                self.faults["drop"] += 1
            request.close_connection = True
            with contextlib.suppress(OSError):
                request.connection.shutdown(socket.SHUT_RDWR)
            return
        if roll < self.drop_rate + self.error_rate:
            with self._lock:
                self.faults["503"] += 1
            request.send_response(503, "Slow Down")
            request.send_header("Content-Type", "application/xml")
            request.send_header("Content-Length", str(len(SLOW_DOWN)))
            request.end_headers()
            request.wfile.write(SLOW_DOWN)
            return
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("expect", "connection", "keep-alive", "transfer-encoding")}
        conditional = request.command == "PUT" and any(
            k.lower() in ("if-match", "if-none-match") for k in headers)
        upstream = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            with self._conditional if conditional else contextlib.nullcontext():
                upstream.request(request.command, request.path, body=body, headers=headers)
                reply = upstream.getresponse()
                data = reply.read()
            with self._lock:  # counted before the client has its answer, and can reset them
                self.requests[request.command] += 1
                self.log.append(f"{request.command} {request.path}")
                if request.command == "GET" and reply.status < 300:
                    self.fetched[path] += len(data)
                elif request.command in ("PUT", "POST"):
                    self.sent[path] += len(body)
                    self.part_puts += "partNumber=" in request.path
            request.send_response(reply.status, reply.reason)
            for key, value in reply.getheaders():
                if key.lower() not in ("connection", "keep-alive", "transfer-encoding",
                                       "content-length", "date", "server"):
                    request.send_header(key, value)
            request.send_header("Content-Length", reply.getheader("Content-Length", str(len(data)))
                                if request.command == "HEAD" else str(len(data)))
            request.end_headers()
            if request.command != "HEAD":
                request.wfile.write(data)
        finally:
            upstream.close()
