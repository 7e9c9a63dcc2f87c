#!/usr/bin/env python
"""Does the drive lose rate when reads and writes run at once, or when the cores are busy?

    python tools/bench_drive_mix.py --dir /nvme/scratch [--size 1GiB] [--json-out mix.json]

A step of the vertical schedule reads and writes the drive at once while the host computes,
and tools/bench_overlap.py prices its drive bytes at rates probed one direction at a time on
idle cores. This measures, through the store (its engine, records and checksums), in turn:
- ``--size`` written, then read back (the two in turn: the baseline);
- ``--size`` read while another ``--size`` is written (ours: the step's mix);
each with the cores idle, then beside ``--busy-threads`` threads (two) busy with matmuls
(the host's compute) or, with ``--busy copy``, copying memory (the store's and the
optimizer's memory traffic).
Repeats ``--repeat`` times, alternating, and prints the median of mixed ÷ in turn last
(below 1: the mix costs nothing), with the raw figures in JSON.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.storage.sizes import parse_size  # noqa: E402
from megatron_snake.storage.store import TensorStore  # noqa: E402
from megatron_snake.training.calibration import drive_rates  # noqa: E402


def _puts(store, tag, records, data):
    for handle in [store.put((tag, i), data, tier="nvme", kind="bench") for i in range(records)]:
        handle.wait()


def _gets(store, tag, records):
    for handle in [store.get((tag, i)) for i in range(records)]:
        handle.wait()


def _drop(store, tag, records):
    for i in range(records):
        store.delete((tag, i)).wait()


def one_round(store, size: int, record: int) -> dict:
    """In turn: the store's own drive probe (``drive_rates``, what tools/bench_overlap.py
    prices its roofline with). Mixed: the records ``_puts(store, "a", ...)`` left on the
    drive read while as many are written."""
    rates = drive_rates(store, size, record)
    in_turn_s = size / rates["write"] + size / rates["read"]
    n = size // record
    data = torch.empty(record, dtype=torch.uint8).random_()
    start = time.perf_counter()
    writer = threading.Thread(target=_puts, args=(store, "b", n, data))
    writer.start()
    _gets(store, "a", n)
    writer.join()
    mixed_s = time.perf_counter() - start
    _drop(store, "b", n)
    return {"write_GBps": rates["write"] / 1e9, "read_GBps": rates["read"] / 1e9,
            "in_turn_s": in_turn_s, "mixed_s": mixed_s, "mixed_over_in_turn": mixed_s / in_turn_s}


class BusyCores:
    """``threads`` threads until stopped, each multiplying matrices (``work`` "matmul": the
    host's compute) or copying a 64 MiB buffer ("copy": memory traffic) beside the I/O."""

    def __init__(self, work: str = "matmul", threads: int = 2):
        self.work, self.count = work, threads

    def __enter__(self):
        self.stop = threading.Event()

        def burn():
            if self.work == "copy":
                src = torch.ones(64 << 20, dtype=torch.uint8)
                dst = torch.empty_like(src)
                while not self.stop.is_set():
                    dst.copy_(src)
            else:
                a = torch.randn(512, 512)
                while not self.stop.is_set():
                    a @ a
        self.threads = [threading.Thread(target=burn, daemon=True) for _ in range(self.count)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the drive to measure")
    p.add_argument("--size", type=parse_size, default=1 << 30, help="bytes each way (1GiB)")
    p.add_argument("--record", type=parse_size, default=48 << 20,
                   help="bytes per put (48MiB: a unit's record of the overlap benchmark)")
    p.add_argument("--busy", choices=("matmul", "copy"), default="matmul",
                   help="what the busy threads do: matmuls (compute) or memory copies")
    p.add_argument("--busy-threads", type=int, default=2, help="busy threads (2)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    if not os.path.isdir(a.dir):
        p.error(f"--dir {a.dir} does not exist: create it on the drive to measure")
    if a.busy_threads < 1:
        p.error(f"--busy-threads {a.busy_threads}: give 1 or more")
    if a.size < a.record:
        p.error(f"--size {a.size} is below one --record ({a.record} bytes): raise --size")
    a.size -= a.size % a.record   # whole records, so that every rate counts what moved
    torch.set_num_threads(1)   # the busy threads' work, one core each
    rounds = {"idle": [], "busy": []}
    with TensorStore(a.dir, host_memory_limit=2 * a.record + (1 << 30), device="cpu") as store:
        _puts(store, "a", a.size // a.record, torch.empty(a.record, dtype=torch.uint8).random_())
        for r in range(a.repeat):
            rounds["idle"].append(one_round(store, a.size, a.record))
            with BusyCores(a.busy, a.busy_threads):
                rounds["busy"].append(one_round(store, a.size, a.record))
            for cores in ("idle", "busy"):
                x = rounds[cores][-1]
                print(f"round {r + 1}, cores {cores}: write {x['write_GBps']:.2f} GB/s, read "
                      f"{x['read_GBps']:.2f} GB/s, in turn {x['in_turn_s']:.2f} s, mixed "
                      f"{x['mixed_s']:.2f} s", flush=True)
    summary = {cores: {key: statistics.median(x[key] for x in xs) for key in xs[0]}
               for cores, xs in rounds.items()}
    results = {"config": vars(a), "rounds": rounds, "medians": summary}
    print(json.dumps(results, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"busy cores / idle cores, each direction alone: write "
          f"{summary['busy']['write_GBps'] / summary['idle']['write_GBps']:.2f}, read "
          f"{summary['busy']['read_GBps'] / summary['idle']['read_GBps']:.2f}")
    print(f"mixed / in turn (median): cores idle {summary['idle']['mixed_over_in_turn']:.2f}, "
          f"cores busy {summary['busy']['mixed_over_in_turn']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
