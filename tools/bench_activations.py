"""Peak activation memory on the compute device and step time: Megatron-Core's schedule with
and without SSDTrain-style activation offload (``SavedTensorOffloader``), same process.

Both variants run ``forward_backward_no_pipelining`` with pretrain_gpt's loss on the same
GPT and micro-batches (forward and backward, no optimizer), alternating order step by step;
the offload variant wraps every forward step in the offloader (tier ``--tier``, default
nvme, under ``--dir``). For each sequence length and micro-batch size it reports the median
step time of ``--steps`` steps after ``--warmup``, the peak activation bytes, and the ratios
ours/baseline; the geometric means of the two ratios are printed last. Raw figures go to
``--json-out``.

Peak activation memory, measured in one extra step per variant (not timed):

- CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocated bytes before the step
  (after ``reset_peak_memory_stats``): everything the step allocates on the GPU, gradients
  and transients included.
- Every device (the only figure on the CPU, which has no allocator peak): *saved-tensor
  residency*. Every tensor autograd saves for backward is seen at pack time (the baseline
  through an identity ``saved_tensors_hooks`` pair around the whole step; the offload
  variant through a subclass of the offloader whose ``_pack`` reports each tensor, kept or
  offloaded, before it is replaced by a record). Its *storage* is registered once (dedup by
  storage data_ptr, guarded by a weak reference to that very storage object, as the
  offloader does) and counted, ``nbytes``, for exactly as long as the storage is alive:
  a weak-reference callback subtracts it when the last reference anywhere (autograd, the
  model's forward, Megatron's schedule, the store's forwarding source while the write is
  running) goes. A read back from the tier (on unpack or prefetch) is counted from the
  moment the read is issued (its destination is allocated then) and, once it completes, as
  its storage until that is freed. Parameters (and tensors sharing their storage) are not
  activations and are not counted. The peak is the maximum of the running total, taken at
  every increase, so it is the exact maximum of this quantity. Without offload it is the
  classic activation footprint (the sum of saved storages at the end of the last forward
  when backward follows immediately); with offload it shows what offload really frees:
  an offloaded tensor still counts while anything keeps it alive.
  Not counted: temporaries that are never saved, gradients, and the store's staging pool
  (fixed-size host memory; on a GPU machine it is not device memory).

Spending the freed memory (the GPU part's second figure, computed from the same grid on any
device): for each sequence length and baseline micro-batch size b, the largest measured
micro-batch b' > b whose offload peak fits in the baseline's peak at b, and the throughput
(tokens/s) ratio of offload at b' over baseline at b.

    OMP_NUM_THREADS=1 python tools/bench_activations.py                 # CPU grid
    python tools/bench_activations.py --layers 24 --hidden 2048 --heads 16 \\
        --seqs 1024,2048 --micro-batch-sizes 1,2,4 --bf16            # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from megatron_snake.offload.adaptive import AdaptiveOffloader  # noqa: E402
from megatron_snake.offload.saved_tensors import SavedTensorOffloader  # noqa: E402
from megatron_snake.storage.store import TensorStore  # noqa: E402
from megatron_snake.training import distributed  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402
from megatron_snake.training.model import build_gpt_model  # noqa: E402
from megatron_snake.training.step import (  # noqa: E402
    activation_offload_forward_backward, megatron_forward_backward)


# ---------------------------------------------------------------------- accounting

class Residency:
    """Running total of the bytes of registered storages still alive; max of it."""

    def __init__(self, params=()):
        self._lock = threading.RLock()   # a storage may die under it
        self._live = {}               # (device, data_ptr) -> (weakref to storage, nbytes)
        self.param_slots = {(p.device, p.untyped_storage().data_ptr()) for p in params}
        self.total = 0
        self.peak = 0
        self.registered = 0           # storages registered
        self.registered_bytes = 0

    def _bump(self, nbytes):          # under the lock
        self.total += nbytes
        self.peak = max(self.peak, self.total)

    def is_param(self, t) -> bool:
        return isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad) or \
            (t.device, t.untyped_storage().data_ptr()) in self.param_slots

    def add_storage(self, storage, device):
        slot = (device, storage.data_ptr())
        nbytes = storage.nbytes()
        with self._lock:
            old = self._live.get(slot)
            if old is not None and old[0]() is storage:
                return                # already counted (a second save of this storage)

            def gone(ref, slot=slot, nbytes=nbytes):
                with self._lock:
                    self.total -= nbytes
                    if self._live.get(slot, (None,))[0] is ref:
                        del self._live[slot]

            self._live[slot] = (weakref.ref(storage, gone), nbytes)
            self.registered += 1
            self.registered_bytes += nbytes
            self._bump(nbytes)

    def add_saved(self, t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided \
                or t.device.type == "meta" or self.is_param(t):
            return
        self.add_storage(t.untyped_storage(), t.device)

    def add_pending(self, nbytes):
        with self._lock:
            self._bump(nbytes)

    def settle_pending(self, nbytes, result):
        """A read issued with add_pending finished: count its storage instead."""
        with self._lock:
            self.total -= nbytes
        if isinstance(result, torch.Tensor):
            self.add_storage(result.untyped_storage(), result.device)

    def hooks(self):
        """Identity saved-tensor hooks that only account (the baseline)."""
        def pack(t):
            self.add_saved(t)
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class _Measured:
    """An offloader, reporting every saved tensor and every read back to a Residency."""

    residency: Residency | None = None

    def _pack(self, t):
        if self.residency is not None:
            self.residency.add_saved(t)
        return super()._pack(t)

    def _fetch(self, entry):
        super()._fetch(entry)
        res = self.residency
        if res is None:
            return
        nbytes = entry.nbytes
        res.add_pending(nbytes)

        def done(fut):
            try:
                result = fut.result()
            except BaseException:  # noqa: BLE001 - the unpack surfaces the error itself
                result = None
            res.settle_pending(nbytes, result)

        fut = entry.fetch._future          # the store's Handle: a Future, or a finished
        if hasattr(fut, "add_done_callback"):   # _Done (forwarded from memory on the CPU)
            fut.add_done_callback(done)
        else:
            done(fut)


class MeasuredOffloader(_Measured, SavedTensorOffloader):
    """Policy all: every saved tensor over --min-bytes."""


class MeasuredAdaptive(_Measured, AdaptiveOffloader):
    """Policy adaptive: profiled during the warm-up, then only what its plan hides."""


# ---------------------------------------------------------------------- the emulated drive

class _Handle:
    def __init__(self, future):
        self._future = future

    def done(self):
        return self._future.done()

    def wait(self, prefetched=False):
        return self._future.result()


class EmulatedDrive:
    """The store behind one drive of ``read_Bps`` / ``write_Bps`` (``--drive-mbps``): this
    CPU computes about 2000x slower than an H100, so its real drive hides traffic an H100's
    would not; slowed by that much, the bytes a step moves stand to its compute as on an
    H100. One worker runs every put, get and delete in order (one FIFO queue, as one
    drive), sleeping bytes / rate before handing it to the real store. A get of a record
    whose write is still queued is served from the write's source, as the store forwards."""

    def __init__(self, store, read_Bps: float, write_Bps: float):
        self._store, self.read_Bps, self.write_Bps = store, read_Bps, write_Bps
        self.device = store.device
        self._worker = ThreadPoolExecutor(max_workers=1)
        self._queued = {}                # key -> the source of a write not yet done
        self._nbytes = {}

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put(self, key, tensor, tier="nvme", kind="misc"):
        nbytes = tensor.numel() * tensor.element_size()
        self._queued[key], self._nbytes[key] = tensor, nbytes

        def write():
            time.sleep(nbytes / self.write_Bps)
            self._store.put(key, tensor, tier=tier, kind=kind).wait()
            self._queued.pop(key, None)
        return _Handle(self._worker.submit(write))

    def get(self, key, device=None):
        source = self._queued.get(key)
        if source is not None:
            done = Future()
            done.set_result(source.clone())
            return _Handle(done)

        def read():
            time.sleep(self._nbytes[key] / self.read_Bps)
            return self._store.get(key, device=device).wait()
        return _Handle(self._worker.submit(read))

    def delete(self, key):
        def delete():
            self._nbytes.pop(key, None)
            return self._store.delete(key).wait()
        return _Handle(self._worker.submit(delete))

    def synchronize(self):
        self._worker.submit(lambda: None).result()
        self._store.synchronize()


# ---------------------------------------------------------------------- the benchmark

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _measure(fn, model, device, attach):
    """One untimed step under the accounting; -> (saved-tensor peak, CUDA peak or None)."""
    res = Residency(model.parameters())
    model.zero_grad(set_to_none=True)
    cuda_peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    attach(res)
    try:
        fn()
    finally:
        attach(None)
    if device.type == "cuda":
        torch.cuda.synchronize()
        cuda_peak = torch.cuda.max_memory_allocated(device) - before
    return res.peak, cuda_peak, res.registered_bytes


def bench_case(model, seq, mbs, a, device, store):
    vocab = a.vocab
    batches = random_microbatches(a.micro_batches, mbs, seq, vocab, device=device)
    kinds = {"all": MeasuredOffloader, "adaptive": MeasuredAdaptive}
    extra = {"adaptive": {"profile_iters": a.warmup, "log": print}, "all": {}}
    offloaders = {p: kinds[p](store, a.tier, params=model.parameters(), min_bytes=a.min_bytes,
                              prefetch_depth=a.prefetch_depth, **extra[p])
                  for p in a.policies}

    def baseline():
        megatron_forward_backward(model, batches)

    def offload(policy):
        return lambda: activation_offload_forward_backward(model, batches,
                                                           offloader=offloaders[policy])

    runs = [("baseline", baseline)] + [(p, offload(p)) for p in a.policies]
    times = {name: [] for name, _ in runs}
    for i in range(a.warmup + a.steps):
        k = i % len(runs)
        for name, fn in runs[k:] + runs[:k]:   # rotate the order
            model.zero_grad(set_to_none=True)
            t = _timed(fn, device)
            if i >= a.warmup:
                times[name].append(t)

    holder = {}

    def attach_baseline(res):
        if res is not None:
            holder["hooks"] = res.hooks()
            holder["hooks"].__enter__()
        else:
            holder.pop("hooks").__exit__(None, None, None)

    base_peak, base_cuda, base_saved = _measure(baseline, model, device, attach_baseline)
    r = {"seq": seq, "micro_batch_size": mbs, "micro_batches": a.micro_batches,
         "tokens_per_step": seq * mbs * a.micro_batches,
         "baseline_s": statistics.median(times["baseline"]),
         "baseline_peak_bytes": base_peak, "baseline_saved_bytes": base_saved,
         "all_s": times, "policies": {}}
    if device.type == "cuda":
        r["baseline_cuda_peak_bytes"] = base_cuda
    for policy, offloader in offloaders.items():
        def attach(res, offloader=offloader):
            offloader.residency = res

        stats_before = dict(vars(offloader.stats))
        # a plan that offloads nothing runs without the offloader's hooks: its saved tensors
        # are measured as the baseline's are
        peak, cuda, _ = _measure(offload(policy), model, device,
                                 attach_baseline if offloader.leaves_all
                                 else attach)
        stats = {k: v - stats_before[k] for k, v in vars(offloader.stats).items()}
        model.zero_grad(set_to_none=True)
        p = {"offload_s": statistics.median(times[policy]), "offload_peak_bytes": peak,
             "offload_stats_measured_step": stats}
        if device.type == "cuda":
            p["offload_cuda_peak_bytes"] = cuda
            p["peak_ratio"], p["saved_peak_ratio"] = cuda / base_cuda, peak / base_peak
        else:
            p["peak_ratio"] = peak / base_peak
        p["time_ratio"] = p["offload_s"] / r["baseline_s"]
        r["policies"][policy] = p
    # the first policy's figures at the top level too (spend_freed_memory, older readers)
    r.update(r["policies"][a.policies[0]])
    return r


def _peak(r, which):
    return r.get(f"{which}_cuda_peak_bytes", r[f"{which}_peak_bytes"])


def spend_freed_memory(results):
    """Per seq and baseline micro-batch b: offload at the largest b' whose peak fits in the
    baseline's peak at b; throughput ratio (tokens/s) offload@b' / baseline@b."""
    out = []
    for base in results:
        fits = [r for r in results if r["seq"] == base["seq"]
                and _peak(r, "offload") <= _peak(base, "baseline")]
        best = max(fits, key=lambda r: r["micro_batch_size"], default=None)
        if best is None or best["micro_batch_size"] <= base["micro_batch_size"]:
            continue                  # nothing larger fits: no freed memory to spend
        tput_base = base["tokens_per_step"] / base["baseline_s"]
        tput_off = best["tokens_per_step"] / best["offload_s"]
        out.append({"seq": base["seq"], "baseline_micro_batch": base["micro_batch_size"],
                    "offload_micro_batch": best["micro_batch_size"],
                    "throughput_ratio": tput_off / tput_base})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None,
                   help="offload directory (default: a temporary directory, removed after)")
    p.add_argument("--tier", default="nvme", choices=["host", "nvme"],
                   help="offload tier (host: on a CPU the pool is the same memory, no saving)")
    p.add_argument("--min-bytes", type=int, default=64 << 10,
                   help="saved tensors smaller than this stay in memory (default 64 KiB)")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--policies", default="all,adaptive",
                   help="offload policies to compare with the baseline, the first also "
                        "spends the freed memory (default all,adaptive)")
    p.add_argument("--drive-mbps", type=float, default=None,
                   help="emulate a drive of this many MB/s each way (EmulatedDrive), for "
                        "an H100's compute-to-drive ratio on a CPU (default: the real one)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seqs", default="128,256,512")
    p.add_argument("--micro-batch-sizes", default="1,2")
    p.add_argument("--micro-batches", type=int, default=2, help="M per step")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--host-memory", type=int, default=256 << 20,
                   help="the store's host staging pool in bytes")
    p.add_argument("--json-out", default="bench_activations.json")
    a = p.parse_args(argv)
    a.policies = a.policies.split(",")
    if not set(a.policies) <= {"all", "adaptive"} or a.warmup < 1:
        p.error("--policies takes all and/or adaptive; --warmup (the adaptive profile) >= 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = distributed.resolve_device(a.device)
    distributed.initialize(device=device, seed=1234)
    seqs = [int(x) for x in a.seqs.split(",")]
    sizes = [int(x) for x in a.micro_batch_sizes.split(",")]
    made = a.dir is None
    root = tempfile.mkdtemp(prefix="bench_activations_") if made else a.dir
    os.makedirs(root, exist_ok=True)
    results = []
    try:
        with TensorStore(root, rank=0, host_memory_limit=a.host_memory, device=device) as real:
            store = real if a.drive_mbps is None else \
                EmulatedDrive(real, a.drive_mbps * 1e6, a.drive_mbps * 1e6)
            for seq in seqs:
                args = parse_args(["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
                                   "--num-attention-heads", str(a.heads), "--seq-length",
                                   str(seq), "--hidden-dropout", "0", "--attention-dropout", "0"]
                                  + (["--bf16"] if a.bf16 else []))
                model = build_gpt_model(args, a.vocab, device)
                if a.bf16:  # as in training: Megatron's wrapper feeds the bf16 weights
                    model = Float16Module(model.config, model)
                for mbs in sizes:
                    r = bench_case(model, seq, mbs, a, device, store)
                    results.append(r)
                    for policy, pr in r["policies"].items():
                        st = pr["offload_stats_measured_step"]
                        print(f"seq {seq:5d} mbs {mbs} M {a.micro_batches}: step baseline "
                              f"{r['baseline_s'] * 1e3:8.1f} ms {policy} "
                              f"{pr['offload_s'] * 1e3:8.1f} ms ({pr['time_ratio']:.3f}) | "
                              f"peak activations baseline {_peak(r, 'baseline') / 2**20:7.1f} "
                              f"MiB {policy} {_peak(pr, 'offload') / 2**20:7.1f} MiB "
                              f"({pr['peak_ratio']:.3f}) | offloaded "
                              f"{st['offloaded']}/{st['saves']} saves, "
                              f"{st['bytes_written'] / 2**20:.1f} MiB written, dedup "
                              f"{st['dedup_hits']}, forwarded {st['forwarded']}", flush=True)
                del model
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)
    spend = spend_freed_memory(results)
    for s in spend:
        print(f"spend freed memory, seq {s['seq']}: offload at micro-batch "
              f"{s['offload_micro_batch']} fits in baseline's peak at micro-batch "
              f"{s['baseline_micro_batch']}: throughput ratio {s['throughput_ratio']:.3f}")
    geo = {policy: {f"{what}_ratio_geomean": statistics.geometric_mean(
        [r["policies"][policy][f"{what}_ratio"] for r in results]) for what in ("peak", "time")}
        for policy in a.policies}
    with open(a.json_out, "w") as f:
        json.dump({"device": str(device), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "args": vars(a), "cases": results,
                   "spend_freed_memory": spend,
                   "peak_measure": "cuda_max_memory_allocated" if device.type == "cuda"
                   else "saved_tensor_residency",
                   "policies": geo, **geo[a.policies[0]]}, f, indent=1)
    distributed.shutdown()
    for policy, g in geo.items():
        print(f"ratio {policy}/baseline (geometric mean over {len(results)} cases): peak "
              f"activation memory {g['peak_ratio_geomean']:.3f} | step time "
              f"{g['time_ratio_geomean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
