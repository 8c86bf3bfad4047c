from __future__ import annotations

import os, signal, socket, time
import pytest
import trio
from kit import Arena
from responsive import while_responsive
from sandbox import Policy

pytestmark = pytest.mark.usefixtures("confined")

_LINGER = """
import struct
s = socket.socket()
s.connect(('127.0.0.1', PORT))
s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 4))
s.setblocking(False)
sent = 0
try:
    while True:
        sent += s.send(b'x' * 65536)
except BlockingIOError:
    pass
x, y = socket.socketpair()
socket.send_fds(x, [b'a'], [s.fileno()])
s.close(); x.close()
broker = sys.modules['sandbox._netbroker']._installed._sock
t0 = time.monotonic()
socket.send_fds(broker, [b'\\0'], [y.fileno()])
y.close()
time.sleep(0.5)
result = sent
"""

async def test_linger(arena: Arena) -> None:
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(8)  # never accepts, never reads
    port = sink.getsockname()[1]
    try:
        policy = Policy(network=(f"127.0.0.1:{port}",))
        t0 = time.monotonic()
        result = await while_responsive(arena, lambda: arena.attack(_LINGER.replace("PORT", str(port)), policy=policy))
        print("\n###", result, time.monotonic() - t0)
    finally:
        sink.close()
