"""What a confined worker can send the kernel over its channels (the call channel, fd 3,
and the network broker's).

A frame the kernel cannot take, or one past the bounds of
``sandbox._protocol.FROM_WORKER``, costs that worker only: the pool goes on, and the
kernel's loop decodes a bounded amount (counted by tests/security/frame_counter.py, not
timed). No descriptor reaches the kernel, on either channel. Each test is one attempt
made from inside a real confined worker, with the widest policy that matters for it.
"""

from __future__ import annotations

import platform

import pytest
import trio
from kit import PLUGINS, Arena

from kernel.executor import run_tool_calls
from kernel.messages import Observation, ToolCall
from plugins import remote_tools
from sandbox import Policy, _protocol, open_worker_pool
from tests.security.frame_counter import assert_decoding_bounded, decoded_frames

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]


# -- costly frames back to back -------------------------------------------------------------
#
# FROM_WORKER bounds the cost of one frame (~50 ms for 8 MiB of 1 000-digit integers), and
# docs/security.md says such a frame freezes the kernel "once". Nothing else bounded how
# many: a result frame for an id no call is waiting for was decoded in full, then dropped
# without a word (pool._dispatch: "a call that was cancelled meanwhile" -- but a cancelled
# call kills its worker, so such a frame is always forged). A worker re-sends the same
# 8 MiB buffer as fast as the socket takes it: the kernel's Trio thread would decode ~20
# of them a second, for as long as the worker lives (between calls too, from a thread it
# left running).


_WIDE = Policy(subprocess=True)


_FRAME_STORM = """
import struct, threading
item = b'9' * 1000
n = (8 * 1024 * 1024 - 200) // 1001
body = b'{"type":"result","id":987654321,"ok":true,"value":[' + b','.join([item] * n) + b']}'
frame = struct.pack('!I', len(body)) + body
channel = socket.socket(fileno=os.dup(3))
deadline = time.monotonic() + SECONDS
sent = 0
while time.monotonic() < deadline:
    channel.sendall(frame)
    sent += 1
result = sent
"""


async def _storm(arena: Arena, seconds: float) -> tuple[str, Observation]:
    code = _FRAME_STORM.replace("SECONDS", str(seconds))
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        attacker = await pool.start(str(PLUGINS / "attack.py"), policy=_WIDE)
        bystander = await pool.start(str(PLUGINS / "attack.py"), name="bystander")
        box: list[Observation] = []

        async def attack() -> None:
            [obs] = await run_tool_calls(
                [ToolCall("a", "attack", {"code": code})], remote_tools(attacker)
            )
            box.append(obs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attack)
            await trio.sleep(seconds / 2)
            [check] = await run_tool_calls(
                [ToolCall("b", "attack", {"code": "result = 1"})], remote_tools(bystander)
            )
    return box[0].content, check


async def test_max_cost_frames_back_to_back_do_not_monopolise_the_kernel(arena: Arena) -> None:
    with decoded_frames() as decoded:
        result, check = await _storm(arena, 4.0)
    # One worker may cost the kernel's loop a frame now and then, not most of its time:
    # the first forged frame is decoded (~50 ms, once), and its worker is killed for it.
    costly = [size for size, _ in decoded if size > _protocol.COSTLY_BODY]
    assert len(costly) <= 1, f"the kernel decoded {len(costly)} forged frames: {result[:80]}"
    assert_decoding_bounded(decoded)
    assert "broke the protocol" in result, result
    assert check.content == "ALLOWED: 1", check.content
    arena.assert_nothing_seen([result, check.content])
