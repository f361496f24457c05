"""Where a conversion's streaming time goes, thread by thread: a diagnostic, not a benchmark (it times
nothing against a goal, and its wrappers cost a little).

    python tests/bench/timeline.py record OUT.json convert SRC -o DIR --target marlin [...]
    python tests/bench/timeline.py show OUT.json [--bin 0.1]

``record`` runs mocli in this process with the writer's writes and copies, the hashing (from memory and
read back), the main thread's hand-over to the writer (``Writer.put``: time waiting for a lane), the
worker round trips (``Workers._remote``) and the calls that wait for an idle worker (``Workers.call``)
wrapped, and writes every interval. ``show`` prints each kind's total time, bytes and rate per thread,
then per time bin how many threads were in each kind at once: lanes busy near their number with the main
thread waiting in ``put`` near 1 means the writer bounds the run; ``remote`` well under the worker count
with ``call`` above it means the workers wait for slots.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

KINDS = ("write", "copy", "hash", "readback", "put", "remote", "call")


def record(out: str, argv: list[str]) -> None:
    from mocli import workers
    from mocli.io import shard_writer
    from mocli.stream import hashing, writer

    events: list[tuple[str, str, float, float, int]] = []
    t0 = time.perf_counter()

    def timed(kind: str, fn, nbytes=lambda args, result: 0):
        def wrapper(*args, **kwargs):
            a = time.perf_counter()
            result = fn(*args, **kwargs)
            events.append((kind, threading.current_thread().name, a - t0, time.perf_counter() - t0,
                           nbytes(args, result)))
            return result
        return wrapper

    sw = shard_writer.ShardWriter
    sw.write = timed("write", sw.write, lambda args, r: r[0])
    sw.copy = timed("copy", sw.copy, lambda args, r: r)
    hash_range = hashing.hash_range
    hashing.hash_range = timed("readback", lambda h, *a, **k: hash_range(getattr(h, "h", h), *a, **k),
                               lambda args, r: args[3] - args[2])  # the bytes read back count once
    new_hasher = hashing.new_hasher

    class Hasher:  # the digest object's update, timed (a C type: wrapped, not patched)
        def __init__(self, h) -> None:
            self.h = h
            self.update = timed("hash", h.update, lambda args, r: memoryview(args[0]).nbytes)

        def __getattr__(self, name: str):
            return getattr(self.h, name)

    hashing.new_hasher = lambda *a, **k: Hasher(new_hasher(*a, **k))
    writer.Writer.put = timed("put", writer.Writer.put)
    workers.Workers._remote = timed("remote", workers.Workers._remote, lambda args, r: args[-1].nin)
    workers.Workers.call = timed("call", workers.Workers.call)
    exit_ = os._exit

    def dump(code: int = 0) -> None:  # the CLI leaves through os._exit: write first
        with open(out, "w") as f:
            json.dump(events, f)
        exit_(code)

    os._exit = dump
    from mocli.cli import main

    try:
        main(argv)
    except SystemExit as e:
        dump(e.code if isinstance(e.code, int) else 1)


def show(path: str, width: float) -> None:
    with open(path) as f:
        events = json.load(f)
    if not events:
        print("no events: did the command stream any units?")
        return
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for kind, thread, a, b, n in events:
        who = thread if kind in ("write", "copy", "hash", "readback", "put") else "(all threads)"
        totals[kind, who][0] += b - a
        totals[kind, who][1] += n
    for (kind, who), (t, n) in sorted(totals.items()):
        rate = f"{n / 2**30 / t:6.2f} GiB/s" if n and t else ""
        print(f"{kind:9s} {who:26s} {t:7.3f} s {n / 2**30:7.2f} GiB {rate}")
    end = max(e[3] for e in events)
    busy = {k: [0.0] * (int(end / width) + 1) for k in KINDS}
    for kind, _, a, b, _ in events:
        i = int(a / width)
        while a < b:
            e = min(b, (i + 1) * width)
            busy[kind][i] += e - a
            a, i = e, i + 1
    first = min((e[2] for e in events if e[0] == "put"), default=0.0)
    print(f"first unit handed to the writer at {first:.3f} s; threads in each kind at once, per {width} s:")
    print("    at " + " ".join(f"{k:>8s}" for k in KINDS))
    for i in range(int(first / width), len(busy["write"])):
        print(f"{i * width:6.2f} " + " ".join(f"{busy[k][i] / width:8.2f}" for k in KINDS))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run mocli with its stages timed")
    rec.add_argument("out")
    rec.add_argument("argv", nargs=argparse.REMAINDER, help="mocli's arguments")
    sh = sub.add_parser("show", help="print a recorded timeline")
    sh.add_argument("path")
    sh.add_argument("--bin", type=float, default=0.1, help="seconds per row")
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.out, a.argv)
    else:
        show(a.path, a.bin)


if __name__ == "__main__":
    main()
