"""A really full disk under the FileStore: a small tmpfs, not a patched ``write``.

An append that does not fit fails with a clear ``StoreError``, nothing already
acknowledged is lost or damaged, and once space is freed appends go on, in order.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel.errors import StoreError
from kernel.store import FileStore

from .conformance import MAIN, entry


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (as root: CI runs as root here)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


async def test_a_full_disk_refuses_the_append_and_keeps_what_was_stored(
    small_disk: Path,
) -> None:
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"b" * 64 * 1024)
    acknowledged = []
    async with FileStore(small_disk / "sessions") as store:
        with pytest.raises(StoreError, match="No space left on device"):
            for n in range(10_000):
                batch = [entry(n, pad="x" * 2_000)]
                await store.append(MAIN, batch)
                acknowledged += batch
        assert acknowledged, "the disk filled before anything was stored"
        assert await store.load(MAIN) == acknowledged
        # Someone frees space: appends go on right after the last acknowledged one.
        ballast.unlink()
        more = [entry(len(acknowledged) + i, pad="y" * 2_000) for i in range(5)]
        await store.append(MAIN, more)
        assert await store.load(MAIN) == acknowledged + more
    async with FileStore(small_disk / "sessions") as reopened:
        assert await reopened.load(MAIN) == acknowledged + more
