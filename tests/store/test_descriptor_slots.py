"""FileStore's descriptor slots (``max_open``): a task waiting for one is woken when one frees.

The interleaving that hung ``test_turnstile_descriptors_do_not_leak`` under load, made
deterministic: every open transcript is in use by a ``delete`` (so an opener parks in
``_make_room``), then the delete takes the transcript out of the open table and lets its
lock go. Nothing else happens afterwards, so only that release can wake the opener.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from kernel.store import FileStore, SessionKey, _disk


async def _hold_flock_elsewhere(root: Path, key: SessionKey) -> int:
    """Take ``key``'s session lock on an open file description of our own, as another
    process appending would; the store's next take of it then waits."""
    fd = os.open(_disk.session_dir(str(root), key), os.O_RDONLY | os.O_DIRECTORY)
    await trio.to_thread.run_sync(fcntl.flock, fd, fcntl.LOCK_EX)
    return fd


async def _parked(store: FileStore) -> int:
    await trio.testing.wait_all_tasks_blocked()
    return store._room.statistics().tasks_waiting


@pytest.mark.parametrize("subpath", [None, "subagents/a"], ids=["main", "child"])
async def test_an_opener_waiting_for_room_is_woken_when_a_delete_frees_the_last_slot(
    tmp_path: Path, subpath: str | None
) -> None:
    main, other = SessionKey("p", "busy"), SessionKey("p", "other")
    busy = main if subpath is None else main.child(subpath)
    async with FileStore(tmp_path, max_open=1) as store:
        await store.append(busy, [{"type": "t", "uuid": "b1"}])
        assert store.open_files == 1
        fd = await _hold_flock_elsewhere(tmp_path, busy)
        deleted = trio.Event()
        appended = trio.Event()

        async def delete() -> None:
            assert await store.delete(busy)
            deleted.set()

        async def append() -> None:
            await store.append(other, [{"type": "t", "uuid": "o1"}])
            appended.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(delete)  # holds busy's lock, waits for the session lock
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(append)  # the only slot is busy's, in use: parks
            assert await _parked(store) == 1
            os.close(fd)  # the other "process" is done: the delete goes on
            await deleted.wait()
            # The slot is free and nothing else will run: the opener must have been woken.
            assert await _parked(store) == 0, "the opener missed the wake-up"
            with trio.fail_after(60):  # a hang guard, not a measurement
                await appended.wait()
        assert store.open_files == 1
        assert await store.load(busy) is None
        assert await store.load(other) == [{"type": "t", "uuid": "o1"}]
