"""A kernel in its own process, for the test that kills a kernel: it starts a worker,
prints the worker's pid and the spare process's pid, and waits to be killed."""

from __future__ import annotations

import sys

import trio

from sandbox import Policy, open_worker_pool


async def main(workspace: str, plugin: str) -> None:
    async with open_worker_pool(workspace) as pool:
        worker = await pool.start(plugin, policy=Policy())
        while pool._spare is None:  # noqa: ASYNC110 (the spare starts in the background)
            await trio.sleep(0.01)
        print(worker.pid, pool._spare.pid, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2])
