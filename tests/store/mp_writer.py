"""A writer process for tests/store/test_multiprocess.py and bench/bench_store.py.

    python mp_writer.py ROOT WRITER SESSIONS COUNT [--durability D] [--big N]
                        [--uuids shared] [--quiet] [--start-at T] [--verify]

Appends COUNT batches to sessions ``p/s0..s{SESSIONS-1}`` round-robin, and
prints ``<time.monotonic()> <session> <seq>`` after each append returns (its
acknowledgement; CLOCK_MONOTONIC is one clock for every process on Linux).
Every entry carries ``writer``, ``seq`` (per writer, across sessions) and
``size`` (entries in its batch). ``--big N``: every Nth batch carries 20-200
KiB of padding (a multi-page ``write()``). ``--uuids shared``: uuids do not
name the writer, so two writers append the same uuids. A COUNT of 0 runs
until killed.
"""

from __future__ import annotations

import argparse
import sys
import time

import trio

from kernel.store import FileStore, SessionKey


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("writer")
    p.add_argument("sessions", type=int)
    p.add_argument("count", type=int)
    p.add_argument("--durability", default="flush")
    p.add_argument("--big", type=int, default=0)
    p.add_argument("--uuids", default="own")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--verify", action="store_true", help="at the end, load: all acked there?")
    p.add_argument("--start-at", type=float, default=0.0, help="a time.monotonic() to wait for")
    args = p.parse_args()
    keys = [SessionKey("p", f"s{n}") for n in range(args.sessions)]
    out = sys.stdout
    async with FileStore(args.root, durability=args.durability) as store:
        await trio.sleep(max(0.0, args.start_at - time.monotonic()))  # start together
        seq = 0
        while args.count == 0 or seq < args.count:
            size = 1 + seq % 3
            pad = ""
            if args.big and seq % args.big == args.big - 1:
                pad = "x" * (20_000 + (seq * 7919) % 180_000)
            prefix = "u" if args.uuids == "shared" else args.writer
            batch = [
                {
                    "type": "t",
                    "uuid": f"{prefix}-{seq}-{j}",
                    "writer": args.writer,
                    "seq": seq,
                    "size": size,
                    "pad": pad,
                }
                for j in range(size)
            ]
            n = seq % len(keys)
            await store.append(keys[n], batch)
            if not args.quiet:
                out.write(f"{time.monotonic()} {n} {seq}\n")
                out.flush()
            seq += 1
        if args.verify:  # this process's own load sees all it acknowledged
            for n, key in enumerate(keys):
                got = {e["seq"] for e in await store.load(key) or [] if e["writer"] == args.writer}
                missing = set(range(n, seq, len(keys))) - got
                if missing:
                    sys.exit(f"{key}: acknowledged but not loaded: {sorted(missing)[:10]}")
    if args.quiet:  # for the bench: how many, and when the last was acknowledged
        out.write(f"{seq} {time.monotonic()}\n")


if __name__ == "__main__":
    trio.run(main)
