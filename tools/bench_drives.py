#!/usr/bin/env python
"""Does the store's rate grow with the drives it is striped over?

    sudo python tools/bench_drives.py [--drives 1,2,4] [--rate 100MB] [--repeat 3]
                                      [--json-out drives.json]

Emulates four slow drives on this machine's one disk (tools/emulated_drives.py: loop
devices, each throttled to ``--rate`` each way by the blkio cgroup; needs root), then, for
each drive count N in turn, writes ``--per-drive`` x N through one TensorStore striped
over N of their directories (``--record`` records, all put at once) and reads it back,
timing each direction; the data read is checked bit-exact after the timing. The counts
alternate in each round (forward, then backward) and repeat ``--repeat`` times; the disk is
noisy, so the medians are compared. Prints each N's median rates, and last the ratio of
each to one drive's (the goal: at least 0.9 x N), with the raw figures in JSON.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from emulated_drives import EmulatedDrives, why_not  # noqa: E402
from megatron_snake.storage import TensorStore  # noqa: E402
from megatron_snake.storage.sizes import parse_size  # noqa: E402


def measure(dirs, per_drive, record, engine, src):
    """(write B/s, read B/s) of ``per_drive`` x len(dirs) bytes through a store over dirs."""
    count = per_drive * len(dirs) // record
    with TensorStore(dirs, engine=engine, device="cpu", host_memory_limit=1 << 30) as store:
        t0 = time.perf_counter()
        for h in [store.put(("r", i), src, tier="nvme") for i in range(count)]:
            h.wait()
        t1 = time.perf_counter()
        got = [h.wait() for h in [store.get(("r", i)) for i in range(count)]]
        t2 = time.perf_counter()
        assert all(torch.equal(g, src) for g in got), "a record did not read back bit-exact"
        drive = store.summary().rsplit("| ", 1)[-1]
    nbytes = count * record
    return nbytes / (t1 - t0), nbytes / (t2 - t1), drive


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drives", default="1,2,4", help="drive counts, comma-separated")
    p.add_argument("--rate", default="100MB", help="each drive's throttle, each way, per second")
    p.add_argument("--per-drive", default="512MiB", help="bytes written and read per drive")
    p.add_argument("--record", default="256MiB", help="bytes per record")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--engine", default="auto")
    p.add_argument("--image-dir", default=None, help="where the drives' image files go "
                   "(default: the temporary directory)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    counts = [int(n) for n in a.drives.split(",")]
    rate, per_drive, record = (parse_size(x) for x in (a.rate, a.per_drive, a.record))
    if 1 not in counts:
        p.error("--drives must include 1: the rates are compared with one drive's")
    reason = why_not()
    if reason:
        sys.exit(f"bench_drives: cannot run here: {reason}")
    src = torch.randint(0, 256, (record,), dtype=torch.uint8, generator=torch.Generator().
                        manual_seed(0))
    runs = []
    # room for one drive's share plus the files' growth step and the file system's own
    size = per_drive + (512 << 20)
    with EmulatedDrives(max(counts), rate, size=size, parent=a.image_dir) as dirs:
        for r in range(a.repeat):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                w, rd, drive = measure(dirs[:n], per_drive, record, a.engine, src)
                runs.append(dict(round=r, drives=n, write_Bps=w, read_Bps=rd))
                print(f"round {r} drives {n}: write {w / 1e6:.1f} MB/s, read {rd / 1e6:.1f} "
                      f"MB/s ({drive})", flush=True)
    med = {n: {way: statistics.median(x[f"{way}_Bps"] for x in runs if x["drives"] == n)
               for way in ("write", "read")} for n in counts}
    ratio = {n: {way: med[n][way] / med[1][way] for way in med[n]} for n in counts}
    out = dict(date=time.strftime("%Y-%m-%d"), machine=f"{platform.node()}, "
               f"{os.cpu_count()} cores, {platform.release()}", rate_Bps_per_drive=rate,
               per_drive_bytes=per_drive, record_bytes=record, engine=drive, runs=runs,
               median_Bps=med, ratio_to_one_drive=ratio, command=" ".join(sys.argv))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    for n in counts:
        print(f"drives {n}: median write {med[n]['write'] / 1e6:.1f} MB/s, read "
              f"{med[n]['read'] / 1e6:.1f} MB/s")
    print("ratio to one drive (goal >= 0.9 x N): " + "; ".join(
        f"{n} drives write {ratio[n]['write']:.2f} read {ratio[n]['read']:.2f} "
        f"({ratio[n]['write'] / n:.2f} / {ratio[n]['read'] / n:.2f} of N)"
        for n in counts if n != 1))


if __name__ == "__main__":
    main()
