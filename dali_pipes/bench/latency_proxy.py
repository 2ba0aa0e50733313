"""A TCP proxy that gives a local server the latency of a real object store: the bench's S3 rows go through it.

A server on the loopback interface answers at once; a real S3 region answers a GET after some
20 to 50 ms (the first byte), and one connection carries some tens of MB/s. Against the first,
parallel downloads gain nothing that one connection does not already have; against the second,
waiting is most of the time of a sequential copy. This proxy, run as a process of its own
(``python -m dali_pipes.bench.latency_proxy UPSTREAM_PORT DELAY_MS [MB_PER_S]``, printing the port it
listens on), forwards every connection to ``127.0.0.1:UPSTREAM_PORT`` and, on each connection:

- holds the first byte of each answer until ``DELAY_MS`` after its request arrived (an HTTP/1.1
  client sends its next request on a connection only once the answer is read, so each request
  is delayed once);
- with ``MB_PER_S``, paces each answer to at most that many MB (10^6 bytes) per second.

Connection set-up itself is not delayed.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

#: Bytes moved per read; also the granularity of the pacing.
_BLOCK = 1 << 20


@dataclass
class _Exchange:
    """The state of one connection: when the request now waiting for its answer arrived (``None``: none waits)."""

    asked: float | None = None


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
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _Exchange, delay: float, rate: float | None
) -> None:
    loop = asyncio.get_running_loop()
    started, sent = loop.time(), 0
    try:
        while data := await reader.read(_BLOCK):
            if state.asked is not None:  # the first bytes of an answer
                await asyncio.sleep(max(0.0, state.asked + delay - loop.time()))
                state.asked = None
                started, sent = loop.time(), 0
            if rate:
                sent += len(data)
                await asyncio.sleep(max(0.0, started + sent / rate - loop.time()))
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def serve(upstream_port: int, delay: float, rate: float | None) -> None:
    """Listen on a free loopback port, print it, and forward every connection (see the module docstring)."""

    async def connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            client_writer.close()
            return
        state = _Exchange()
        await asyncio.gather(
            _requests(client_reader, server_writer, state),
            _answers(server_reader, client_writer, state, delay, rate),
            return_exceptions=True,
        )

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    """``UPSTREAM_PORT DELAY_MS [MB_PER_S]``."""
    port, delay_ms = int(argv[0]), float(argv[1])
    rate = float(argv[2]) * 1e6 if len(argv) > 2 and float(argv[2]) > 0 else None
    asyncio.run(serve(port, delay_ms / 1000.0, rate))


if __name__ == "__main__":
    main(sys.argv[1:])
