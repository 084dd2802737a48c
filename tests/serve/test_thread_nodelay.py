"""The bound socket makes uvicorn's accepted connections TCP_NODELAY.

asyncio sets TCP_NODELAY on an accepted socket only when its proto says TCP, and an
accepted socket inherits the listening socket's proto. With proto 0 every non-streamed
answer (headers, then body: two writes) waited for the client's delayed ACK — 40 ms a
request on loopback.
"""

from __future__ import annotations

import asyncio
import socket

from kvfence.serve.thread import bind


def test_accepted_connections_are_nodelay() -> None:
    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            try:
                return await asyncio.wait_for(seen, timeout=10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0
