"""A real S3-protocol server on 127.0.0.1 (moto's server mode) behind a small proxy that injects faults.

The clients under test (s3fs, through dali-pipes) talk to the proxy; the proxy forwards every request
to the moto server unchanged unless a fault rule matches it:

- ``slowdown``: answer ``503 SlowDown`` (S3's throttling answer) instead of forwarding;
- ``drop``: forward, then send the headers and only half of the body and close the connection;
- ``deny``: answer ``403 InvalidAccessKeyId``, as S3 does for keys it does not know;
- ``stall``: wait :attr:`FaultProxy.stall` seconds before forwarding (a slow or hung server);
- ``corrupt``: forward, then send the whole body with one byte changed (damaged on the way, not at the source),
  which the client's check of the object's stored checksum finds; ``corrupt-bare``: the same without the
  checksum headers, as from a store that keeps none (only the manifest's SHA-256 finds it).

Each rule applies to requests whose method and path match, ``times`` times (``None``: always).
Tests also write into the bucket straight through moto's endpoint (``direct_options``), as another
client would (a truncated object, a shard deleted between manifest and download).
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACCESS_KEY = "AKIATESTDALIPIPES0001"
SECRET_KEY = "testsecret-not-a-real-one"


@dataclass
class Fault:
    """One fault rule: ``action`` on requests of ``method`` whose path matches ``path`` (a regex)."""

    action: str
    method: str = "GET"
    path: str = ".*"
    times: int | None = 1
    seen: int = 0


class FaultProxy:
    """An HTTP proxy in front of ``upstream`` (host, port) that injects the faults of :attr:`rules`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.rules: list[Fault] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of each ranged GET
        self.stall = 1.0
        # Set by clear(): a request stalled by a rule just cleared goes on at once, instead of waking up to
        # 60 s later inside another test (whose tracemalloc, seeing every thread, once counted its 1.5 MB).
        self._released = threading.Event()
        handler = _handler(self)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, action: str, *, method: str = "GET", path: str = ".*", times: int | None = 1) -> Fault:
        fault = Fault(action, method, path, times)
        with self.lock:
            self.rules.append(fault)
        return fault

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
            self.requests.clear()
            self.ranges.clear()
            self._released.set()
            self._released = threading.Event()

    def wait_stalled(self) -> None:
        """Wait :attr:`stall` seconds, or until :meth:`clear` ends the stall."""
        with self.lock:
            released = self._released
        released.wait(self.stall)

    def match(self, method: str, path: str) -> str | None:
        with self.lock:
            self.requests.append((method, path))
            for fault in self.rules:
                if (
                    fault.method == method
                    and re.search(fault.path, path)
                    and (fault.times is None or fault.seen < fault.times)
                ):
                    fault.seen += 1
                    return fault.action
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _any(self) -> None:
            body = self._body()
            if self.command == "GET" and self.headers.get("Range"):
                with proxy.lock:
                    proxy.ranges.append((self.path, self.headers["Range"]))
            action = proxy.match(self.command, self.path)
            if action == "slowdown":
                return self._error(503, "SlowDown", "Please reduce your request rate.")
            if action == "deny":
                return self._error(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist.")
            if action == "stall":
                proxy.wait_stalled()
            status, headers, data = self._forward(body)
            if action in ("corrupt", "corrupt-bare") and len(data) > 1:
                data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :]
                if action == "corrupt-bare":
                    headers = [(k, v) for k, v in headers if not k.lower().startswith("x-amz-checksum")]
            if action == "drop" and len(data) > 1:
                self._send(status, headers, data[: len(data) // 2], length=len(data))
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            self._send(status, headers, data)
            return None

        def _forward(self, body: bytes):
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length")
            }
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            dropped = ("transfer-encoding", "connection") + (() if self.command == "HEAD" else ("content-length",))
            out = [(k, v) for k, v in response.getheaders() if k.lower() not in dropped]
            conn.close()
            return response.status, out, data

        def _send(self, status: int, headers, data: bytes, length: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()

        def _error(self, status: int, code: str, message: str) -> None:
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message></Error>'
            )
            self._send(status, [("Content-Type", "application/xml")], xml.encode())

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler


def options(endpoint: str, **extra) -> dict:
    """``storage_options`` for s3fs against ``endpoint``: test keys, short timeouts, few botocore retries."""
    config = {"connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 2, "mode": "standard"}}
    return {
        "endpoint_url": endpoint,
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": config,
        "skip_instance_cache": True,
        "use_listings_cache": False,
        **extra,
    }


class S3Server:
    """moto's threaded server and the fault proxy in front of it, with a bucket per test made on demand."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.proxy = FaultProxy((host, port))
        self._count = 0

    @property
    def options(self) -> dict:
        """``storage_options`` through the proxy (faults apply)."""
        return options(self.proxy.url)

    @property
    def direct_options(self) -> dict:
        """``storage_options`` straight to moto (no faults): for the test's own reads and writes."""
        return options(self.endpoint)

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(**self.direct_options)

    def new_bucket(self) -> str:
        self._count += 1
        name = f"bucket-{self._count}"
        self.fs().mkdir(name)
        return name

    def close(self) -> None:
        self.proxy.close()
        self.moto.stop()
