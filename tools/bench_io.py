#!/usr/bin/env python
"""Storage benchmark: the tensor store against fio on the same file system.

    python tools/bench_io.py --dir /nvme/scratch --size 4GiB [--json-out io.json]

1. fio (io_uring, --direct=1, the same request size and queue depth): sequential write,
   then sequential read of a file of --size. This is the drive's physical limit.
2. The store: --size bytes put to the nvme tier as --tensor-size tensors (split into
   host-buffer records, each sent as --block requests, --qd in flight), then read back with
   get(). Checksums are computed and verified as in training. Engines: auto (the default
   the store picks), the other native backend, and the pure-Python fallback.
3. Checksum cost (GB/s, one core) of the candidates available here.
4. GPU (when CUDA is available): host<->GPU through the pinned pool vs a plain pinned
   tensor.copy_(non_blocking=True); NVMe<->GPU end to end; GDS when kvikio works.
Prints the figures, the raw figures as JSON (and to --json-out), and last the line
`ratio ours/fio: write W read R` (target >= 0.95 both).
"""

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.storage.engine import crc32c_native, native_available  # noqa: E402
from megatron_snake.storage.sizes import parse_size  # noqa: E402
from megatron_snake.storage.store import TensorStore  # noqa: E402

def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ---------------------------------------------------------------- fio

def run_fio(directory, size, block, qd, rw):
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "bench_io_fio.dat")
    cmd = ["fio", "--name=snake", f"--filename={path}", f"--size={size}", f"--bs={block}",
           f"--iodepth={qd}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}",
           "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"fio failed: {out.stderr.strip()[:300]}", file=sys.stderr)
        return None
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0][rw if rw in ("read", "write") else "write"]
    return {"GBps": job["bw_bytes"] / 1e9, "cmd": " ".join(cmd)}


# ---------------------------------------------------------------- store

def run_store(directory, size, tensor_bytes, engine, qd, block, buffer_bytes, host_limit, window):
    n = max(1, size // tensor_bytes)
    numel = tensor_bytes // 4
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, generator=gen)
               for _ in range(2)]
    outs = [torch.empty(numel, dtype=torch.int32) for _ in range(window)]
    res = {"engine": engine, "tensors": n, "tensor_bytes": tensor_bytes}
    with TensorStore(directory, rank=0, host_memory_limit=host_limit, engine=engine,
                     buffer_bytes=buffer_bytes, queue_depth=qd, chunk_bytes=block,
                     workers=window) as store:
        res["engine_name"] = store.engine.name
        store.preallocate("bench", n * (tensor_bytes + tensor_bytes // buffer_bytes * 4096 + 8192))
        t0 = time.perf_counter()
        pending = []
        for i in range(n):
            if len(pending) >= window:
                pending.pop(0).wait()
            pending.append(store.put(i, sources[i % 2], tier="nvme", kind="bench"))
        for h in pending:
            h.wait()
        t_write = time.perf_counter() - t0
        res["direct"] = store._all_direct()
        t0 = time.perf_counter()
        pending = []
        for i in range(n):
            if len(pending) >= window:
                pending.pop(0).wait()
            pending.append(store.get(i, out=outs[i % window]))
        for h in pending:
            h.wait()
        t_read = time.perf_counter() - t0
        ok = torch.equal(store.get(n - 1).wait(), sources[(n - 1) % 2])
        res.update(write_GBps=gbps(n * tensor_bytes, t_write), read_GBps=gbps(n * tensor_bytes, t_read),
                   verified=ok, summary=store.summary(), blocked_s=store.counters.blocked_s)
    return res


# ---------------------------------------------------------------- checksum cost

def checksum_cost(nbytes=256 << 20):
    m = mmap.mmap(-1, nbytes)
    m.write(os.urandom(1 << 20) * (nbytes >> 20))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    cands = {"zlib.crc32": lambda: zlib.crc32(m)}
    native = crc32c_native()
    if native is not None:
        cands["crc32c (native, SSE4.2)"] = lambda: native(addr, nbytes)
    try:
        import xxhash
        cands["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64_intdigest(m)
    except ImportError:
        pass
    out = {}
    for name, fn in cands.items():
        fn()
        t0 = time.perf_counter()
        fn()
        out[name] = gbps(nbytes, time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------- GPU

def gpu_part(directory, size, buffer_bytes, host_limit):
    out = {}
    dev = torch.device("cuda")
    nbytes = min(size, 1 << 30)
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinned.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        d2h = time.perf_counter() - t0
        t0 = time.perf_counter()
        x.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        h2d = time.perf_counter() - t0
    out["plain_pinned_d2h_GBps"], out["plain_pinned_h2d_GBps"] = gbps(nbytes, d2h), gbps(nbytes, h2d)
    with TensorStore(directory, rank=0, host_memory_limit=max(host_limit, 2 * nbytes),
                     buffer_bytes=buffer_bytes) as store:
        for rep in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            store.put("g", x, tier="host").wait()
            d2h = time.perf_counter() - t0
            t0 = time.perf_counter()
            y = store.get("g", device=dev).wait()
            torch.cuda.synchronize()
            h2d = time.perf_counter() - t0
            store.delete("g").wait()
        assert torch.equal(x, y)
        out["pool_d2h_GBps"], out["pool_h2d_GBps"] = gbps(nbytes, d2h), gbps(nbytes, h2d)
        out["pool_vs_plain_d2h"] = out["pool_d2h_GBps"] / out["plain_pinned_d2h_GBps"]
        out["pool_vs_plain_h2d"] = out["pool_h2d_GBps"] / out["plain_pinned_h2d_GBps"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        store.put("n", x, tier="nvme").wait()
        out["gpu_to_nvme_GBps"] = gbps(nbytes, time.perf_counter() - t0)
        t0 = time.perf_counter()
        y = store.get("n", device=dev).wait()
        torch.cuda.synchronize()
        out["nvme_to_gpu_GBps"] = gbps(nbytes, time.perf_counter() - t0)
        assert torch.equal(x, y)
    with TensorStore(directory, rank=0, host_memory_limit=host_limit, buffer_bytes=buffer_bytes,
                     engine="gds") as store:
        if store.gds is None:
            out["gds"] = "not available (see log)"
        else:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            store.put("d", x, tier="nvme").wait()
            out["gds_write_GBps"] = gbps(nbytes, time.perf_counter() - t0)
            t0 = time.perf_counter()
            y = store.get("d", device=dev).wait()
            torch.cuda.synchronize()
            out["gds_read_GBps"] = gbps(nbytes, time.perf_counter() - t0)
            assert torch.equal(x, y)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="a directory on the drive to measure (default: a temp dir)")
    ap.add_argument("--size", type=parse_size, default=4 << 30, help="bytes per phase (default 4GiB)")
    ap.add_argument("--block", type=parse_size, default=1 << 20, help="request size (default 1MiB)")
    ap.add_argument("--qd", type=int, default=32, help="requests in flight (default 32)")
    ap.add_argument("--tensor-size", type=parse_size, default=64 << 20, help="bytes per put (default 64MiB)")
    ap.add_argument("--buffer-bytes", type=parse_size, default=8 << 20, help="host buffer / record size")
    ap.add_argument("--host-memory-limit", type=parse_size, default=1 << 30)
    ap.add_argument("--window", type=int, default=4, help="store operations in flight")
    ap.add_argument("--fallback-size", type=parse_size, default=None,
                    help="bytes for the Python-fallback run (default min(size, 1GiB))")
    ap.add_argument("--engines", default=None,
                    help="comma list (default auto, the other native backend, python)")
    ap.add_argument("--repeat", type=int, default=3, help="fio/store alternations (medians compared)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    directory = args.dir or tempfile.mkdtemp(prefix="bench_io_")
    os.makedirs(directory, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_io_", dir=directory)
    fstype = subprocess.run(["df", "-T", work], capture_output=True, text=True).stdout.split("\n")[1:2]
    figures = {"size": args.size, "block": args.block, "qd": args.qd, "dir": directory,
               "fs": fstype[0].split()[1] if fstype and fstype[0] else "?",
               "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
                          f"kernel {platform.release()}", "torch": torch.__version__}
    print(f"bench_io: {args.size / 2**30:.2f} GiB per phase, {args.block >> 10} KiB requests, "
          f"qd {args.qd}, dir {directory} ({figures['fs']})")
    try:
        if args.engines:
            engines = args.engines.split(",")
        else:
            engines = ["auto"] + (["threads"] if native_available() else []) + ["python"]
        # fio and the store's default engine alternate --repeat times (the drive of a VM is
        # noisy); medians are compared. The other engines run once each.
        fio_runs, ours_runs = [], []
        for rep in range(args.repeat):
            fw = run_fio(work, args.size, args.block, args.qd, "write")
            fr = run_fio(work, args.size, args.block, args.qd, "read")
            try:
                os.unlink(os.path.join(work, "bench_io_fio.dat"))
            except FileNotFoundError:
                pass
            r = run_store(work, args.size, args.tensor_size, engines[0], args.qd, args.block,
                          args.buffer_bytes, args.host_memory_limit, args.window)
            if fw and fr:
                fio_runs.append((fw["GBps"], fr["GBps"]))
                print(f"[{rep}] fio       write {fw['GBps']:.3f} GB/s   read {fr['GBps']:.3f} GB/s")
            ours_runs.append(r)
            print(f"[{rep}] store {engines[0]:7s} ({r['engine_name']}{'' if r['direct'] else ', buffered'}) "
                  f"write {r['write_GBps']:.3f} GB/s   read {r['read_GBps']:.3f} GB/s   verified {r['verified']}")
        fio_w = fio_r = None
        if fio_runs:
            fio_w = {"GBps": median([a for a, _ in fio_runs]), "runs": [a for a, _ in fio_runs],
                     "cmd": fw["cmd"].replace("--rw=read", "--rw=write")}
            fio_r = {"GBps": median([b for _, b in fio_runs]), "runs": [b for _, b in fio_runs],
                     "cmd": fr["cmd"]}
            print(f"fio       write {fio_w['GBps']:.3f} GB/s   read {fio_r['GBps']:.3f} GB/s   (median)")
        else:
            print("fio       not available: install fio for the physical-limit reference")
        figures["fio"] = {"write": fio_w, "read": fio_r}
        ours = dict(ours_runs[-1])
        ours["write_runs"] = [r["write_GBps"] for r in ours_runs]
        ours["read_runs"] = [r["read_GBps"] for r in ours_runs]
        ours["write_GBps"], ours["read_GBps"] = median(ours["write_runs"]), median(ours["read_runs"])
        figures["store"] = {engines[0]: ours}
        print(f"store {engines[0]:7s} write {ours['write_GBps']:.3f} GB/s   read {ours['read_GBps']:.3f} GB/s"
              f"   (median)\n          {ours['summary']}")
        for eng in engines[1:]:
            size = args.size if eng != "python" else (args.fallback_size or min(args.size, 1 << 30))
            r = run_store(work, size, args.tensor_size, eng, args.qd, args.block,
                          args.buffer_bytes, args.host_memory_limit, args.window)
            figures["store"][eng] = r
            print(f"store {eng:7s} ({r['engine_name']}{'' if r['direct'] else ', buffered'}) "
                  f"write {r['write_GBps']:.3f} GB/s   read {r['read_GBps']:.3f} GB/s   "
                  f"({size / 2**30:.2f} GiB, verified {r['verified']})")

        figures["checksum_GBps"] = checksum_cost()
        print("checksum  " + "   ".join(f"{k} {v:.2f} GB/s" for k, v in figures["checksum_GBps"].items()))

        if torch.cuda.is_available():
            figures["gpu"] = gpu_part(work, args.size, args.buffer_bytes, args.host_memory_limit)
            print("gpu       " + "   ".join(f"{k} {v if isinstance(v, str) else f'{v:.3f}'}"
                                            for k, v in figures["gpu"].items()))
        else:
            figures["gpu"] = "no CUDA device"
            print("gpu       no CUDA device: GPU part skipped")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ours = figures["store"].get(engines[0])
    if fio_w and fio_r and ours:
        figures["ratio"] = {"write": ours["write_GBps"] / fio_w["GBps"], "read": ours["read_GBps"] / fio_r["GBps"]}
        # each store run against the fio run just before it (robust to a drifting drive)
        figures["ratio_pairwise_median"] = {
            "write": median([o / f for o, f in zip(ours["write_runs"], fio_w["runs"])]),
            "read": median([o / f for o, f in zip(ours["read_runs"], fio_r["runs"])])}
    text = json.dumps(figures, indent=1, default=str)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    if "ratio" in figures:
        pw = figures["ratio_pairwise_median"]
        print(f"ratio ours/fio: write {figures['ratio']['write']:.2f} read {figures['ratio']['read']:.2f}"
              f"   (median of pairwise ratios: write {pw['write']:.2f} read {pw['read']:.2f})")
    else:
        print("ratio ours/fio: n/a (fio missing or failed)")


if __name__ == "__main__":
    main()
