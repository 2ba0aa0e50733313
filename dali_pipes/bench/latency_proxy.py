"""A TCP proxy that gives a local server the latency of a real object store: the bench's S3 rows go through it.

A server on the loopback interface answers at once; a real S3 region answers a GET after some
20 to 50 ms (the first byte), and one connection carries some tens of MB/s. Against the first,
parallel downloads gain nothing that one connection does not already have; against the second,
waiting is most of the time of a sequential copy. This proxy, run as a process of its own
(``python -m dali_pipes.bench.latency_proxy UPSTREAM_PORT DELAY_MS [MB_PER_S [COUNT_FILE]]``, printing the port
it listens on), forwards every connection to ``127.0.0.1:UPSTREAM_PORT`` and, on each connection:

- holds the first byte of each answer until ``DELAY_MS`` after its request arrived (an HTTP/1.1
  client sends its next request on a connection only once the answer is read, so each request
  is delayed once);
- with ``MB_PER_S``, paces each answer to at most that many MB (10^6 bytes) per second.

Connection set-up itself is not delayed. With ``COUNT_FILE``, the bytes of all answers forwarded so far
(HTTP headers and bodies: what a client downloaded through this proxy) and the number of answers are kept
in that file, rewritten after every block (:func:`read_count` reads it): the scale-out suite runs one proxy
per simulated node and reads what each node downloaded there.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: Bytes moved per read; also the granularity of the pacing.
_BLOCK = 1 << 20


@dataclass
class _Exchange:
    """The state of one connection: when the request now waiting for its answer arrived (``None``: none waits)."""

    asked: float | None = None


class Counter:
    """The bytes and the answers forwarded to clients, kept in a file (``None``: not kept)."""

    def __init__(self, path: str | None) -> None:
        self.bytes = self.answers = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) if path else None
        self._write()

    def add(self, size: int, answer: bool) -> None:
        self.bytes += size
        self.answers += int(answer)
        self._write()

    def _write(self) -> None:
        if self._fd is not None:  # fixed width: a reader never sees a shorter, half-replaced line
            os.pwrite(self._fd, f"{self.bytes:20d} {self.answers:20d}\n".encode(), 0)


def read_count(path: str | os.PathLike) -> tuple[int, int]:
    """``(bytes, answers)`` a proxy started with ``COUNT_FILE=path`` has forwarded so far."""
    size, answers = Path(path).read_text().split()
    return int(size), int(answers)


async def _requests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _Exchange) -> None:
    loop = asyncio.get_running_loop()
    try:
        while data := await reader.read(_BLOCK):
            if state.asked is None:
                state.asked = loop.time()
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _answers(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    state: _Exchange,
    delay: float,
    rate: float | None,
    counter: Counter,
) -> None:
    loop = asyncio.get_running_loop()
    started, sent = loop.time(), 0
    try:
        while data := await reader.read(_BLOCK):
            first = state.asked is not None
            if first:  # the first bytes of an answer
                await asyncio.sleep(max(0.0, state.asked + delay - loop.time()))
                state.asked = None
                started, sent = loop.time(), 0
            counter.add(len(data), first)
            if rate:
                sent += len(data)
                await asyncio.sleep(max(0.0, started + sent / rate - loop.time()))
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def serve(upstream_port: int, delay: float, rate: float | None, count_file: str | None = None) -> None:
    """Listen on a free loopback port, print it, and forward every connection (see the module docstring)."""
    counter = Counter(count_file)

    async def connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            client_writer.close()
            return
        state = _Exchange()
        await asyncio.gather(
            _requests(client_reader, server_writer, state),
            _answers(server_reader, client_writer, state, delay, rate, counter),
            return_exceptions=True,
        )

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    """``UPSTREAM_PORT DELAY_MS [MB_PER_S [COUNT_FILE]]``."""
    port, delay_ms = int(argv[0]), float(argv[1])
    rate = float(argv[2]) * 1e6 if len(argv) > 2 and float(argv[2]) > 0 else None
    asyncio.run(serve(port, delay_ms / 1000.0, rate, argv[3] if len(argv) > 3 else None))


if __name__ == "__main__":
    main(sys.argv[1:])
