"""The bench's latency proxy (a process of its own) in front of a real HTTP server: each answer's first byte is late
by the delay asked for, on every request of a kept-alive connection, and a connection's answers are paced."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dali_pipes.bench.latency_proxy import read_count

BODY = b"x" * (2 << 20)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = BODY if self.path == "/big" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def start_proxy(upstream: int, delay_ms: float, mb_s: float = 0, count=None) -> tuple[subprocess.Popen, int]:
    args = [sys.executable, "-m", "dali_pipes.bench.latency_proxy", str(upstream), str(delay_ms), str(mb_s)]
    args += [str(count)] if count else []
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    return process, int(process.stdout.readline())


def timed_gets(port: int, paths: list[str]) -> list[float]:
    """Seconds of each GET, one after another on one kept-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    took = []
    for path in paths:
        start = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200 and response.read() == (BODY if path == "/big" else b"ok")
        took.append(time.perf_counter() - start)
    conn.close()
    return took


def test_each_answer_is_late_by_the_delay_and_paced(upstream):
    direct = timed_gets(upstream, ["/small", "/small"])
    assert max(direct) < 0.15
    process, port = start_proxy(upstream, 200)
    try:
        assert all(0.2 <= t < 0.6 for t in timed_gets(port, ["/small", "/small", "/small"]))
    finally:
        process.terminate()
        process.wait(timeout=10)
    process, port = start_proxy(upstream, 0, mb_s=4)  # 2 MiB at 4 MB/s: about half a second
    try:
        (took,) = timed_gets(port, ["/big"])
        assert took >= len(BODY) / 4e6 - 0.05
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_count_file_holds_the_bytes_and_answers_forwarded(upstream, tmp_path):
    # The scale-out suite reads each simulated node's downloads here: every answer's bytes, headers included.
    count = tmp_path / "node0.count"
    process, port = start_proxy(upstream, 0, count=count)
    try:
        assert read_count(count) == (0, 0)
        timed_gets(port, ["/big", "/small", "/small"])
        size, answers = read_count(count)
        assert answers == 3
        assert len(BODY) + 2 * len(b"ok") < size < len(BODY) + 4 + 3 * 400  # three short header blocks
    finally:
        process.terminate()
        process.wait(timeout=10)
