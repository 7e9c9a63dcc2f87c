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

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

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


class MeasuredOffloader(SavedTensorOffloader):
    """The offloader, reporting every saved tensor and every read back to a Residency."""

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
    offloader = MeasuredOffloader(store, a.tier, params=model.parameters(),
                                  min_bytes=a.min_bytes, prefetch_depth=a.prefetch_depth)

    def baseline():
        megatron_forward_backward(model, batches)

    def ours():
        activation_offload_forward_backward(model, batches, offloader=offloader)

    runs = [("baseline", baseline), ("offload", ours)]
    times = {name: [] for name, _ in runs}
    for i in range(a.warmup + a.steps):
        for name, fn in runs[i % 2:] + runs[:i % 2]:   # alternate the order
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

    def attach_offload(res):
        offloader.residency = res

    base_peak, base_cuda, base_saved = _measure(baseline, model, device, attach_baseline)
    stats_before = dict(vars(offloader.stats))
    off_peak, off_cuda, off_saved = _measure(ours, model, device, attach_offload)
    stats = {k: v - stats_before[k] for k, v in vars(offloader.stats).items()}
    model.zero_grad(set_to_none=True)

    r = {"seq": seq, "micro_batch_size": mbs, "micro_batches": a.micro_batches,
         "tokens_per_step": seq * mbs * a.micro_batches,
         "baseline_s": statistics.median(times["baseline"]),
         "offload_s": statistics.median(times["offload"]),
         "baseline_peak_bytes": base_peak, "offload_peak_bytes": off_peak,
         "baseline_saved_bytes": base_saved, "offload_stats_measured_step": stats,
         "all_s": times}
    if device.type == "cuda":
        r["baseline_cuda_peak_bytes"], r["offload_cuda_peak_bytes"] = base_cuda, off_cuda
        r["peak_ratio"] = off_cuda / base_cuda
        r["saved_peak_ratio"] = off_peak / base_peak
    else:
        r["peak_ratio"] = off_peak / base_peak
    r["time_ratio"] = r["offload_s"] / r["baseline_s"]
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
        with TensorStore(root, rank=0, host_memory_limit=a.host_memory, device=device) as store:
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
                    st = r["offload_stats_measured_step"]
                    print(f"seq {seq:5d} mbs {mbs} M {a.micro_batches}: step baseline "
                          f"{r['baseline_s'] * 1e3:8.1f} ms offload {r['offload_s'] * 1e3:8.1f} "
                          f"ms ({r['time_ratio']:.3f}) | peak activations baseline "
                          f"{_peak(r, 'baseline') / 2**20:7.1f} MiB offload "
                          f"{_peak(r, 'offload') / 2**20:7.1f} MiB ({r['peak_ratio']:.3f}) | "
                          f"offloaded {st['offloaded']}/{st['saves']} saves, "
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
    peak_geo = statistics.geometric_mean([r["peak_ratio"] for r in results])
    time_geo = statistics.geometric_mean([r["time_ratio"] for r in results])
    with open(a.json_out, "w") as f:
        json.dump({"device": str(device), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "args": vars(a), "cases": results,
                   "spend_freed_memory": spend,
                   "peak_measure": "cuda_max_memory_allocated" if device.type == "cuda"
                   else "saved_tensor_residency",
                   "peak_ratio_geomean": peak_geo, "time_ratio_geomean": time_geo}, f, indent=1)
    distributed.shutdown()
    print(f"ratio offload/baseline (geometric mean over {len(results)} cases): peak activation "
          f"memory {peak_geo:.3f} | step time {time_geo:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
