"""Measure this machine as a planner hardware profile (megatron_snake/planner/hardware.py).

    python tools/calibrate.py <pretrain_gpt.py flags> --output PROFILE.json
    torchrun --nproc-per-node 2 tools/calibrate.py <flags> --output PROFILE.json  # + collectives

For the model shape the flags give it times one decoder layer's forward and backward on the
compute device (a 3-layer model of that shape is built; the FLOP/s is Megatron's count over
the time, forward + backward = 3 forwards), the output layer with its loss apart (the last
layer's unit less a middle one: a softmax over the vocabulary runs at its own rate), a dense
matmul (the peak, for MFU), the drive through the store in --snake-offload-dir (the engine
the run would use; medians of three 256 MiB passes each way), the layer again while the
store keeps the drive busy (the share of compute time the I/O takes: on a CPU device they
share the cores), a real offloaded step of the flags' layout at a width where its FLOPs and
bytes are next to nothing (its host time per unit pass and per unit visit), on a CPU
device the layer and the output layer again inside a real offloaded step with host tiers
(the rates the profile keeps: there the cores are shared with the store and the CPU AdamW;
the rates timed alone stay as ``*_alone``), copies onto the device and within host
memory, the fused CPU AdamW, and with several ranks an all-reduce. Capacities are the
machine's: device and host memory, the offload drive's size. The profile says where every
figure came from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_snake.models.gpt_units import GPTUnits  # noqa: E402
from megatron_snake.planner import Hardware  # noqa: E402
from megatron_snake.storage.directory import file_system_groups  # noqa: E402
from megatron_snake.storage.host_heap import bound_host_heap  # noqa: E402
from megatron_snake.storage.safe_files import write_file_atomically  # noqa: E402
from megatron_snake.training import calibration, distributed  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402
from megatron_snake.training.model import build_gpt_model  # noqa: E402
from megatron_snake.training.workload import (layer_flops_of,  # noqa: E402
                                              output_layer_flops)
from megatron_snake.training.offloaded_state import open_store  # noqa: E402
from megatron_snake.training.tokenizer import (  # noqa: E402
    build_tokenizer, padded_vocab_size, tokenizer_flags)


def _timing_model(args, device, vocab: int, seq: int, micro_batch: int):
    """A 3-layer model of the flags' shape as units, an input of one micro-batch of
    ``micro_batch`` x ``seq`` tokens for its middle unit, and the micro-batch's context."""
    shape = argparse.Namespace(**{**vars(args), "num_layers": 3, "snake_checkpoint_interval": 1,
                                  "pipeline_model_parallel_size": 1, "seq_length": seq,
                                  "micro_batch_size": micro_batch,
                                  "max_position_embeddings": max(seq, args.seq_length)})
    units = GPTUnits(build_gpt_model(shape, vocab, device), 1)
    batch = random_microbatches(1, micro_batch, seq, vocab, seed=0, device=device)[0]
    tokens = seq // (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    hidden = torch.randn(tokens, micro_batch, args.hidden_size, device=device,
                         dtype=args.params_dtype, requires_grad=True)
    return units, hidden, units.context(batch, seq_length=seq)


def _unit_seconds(args, device, vocab: int, seq: int, micro_batch: int,
                  seconds: float = 1.0) -> tuple[float, float]:
    """Forward + backward seconds of a decoder layer alone, and of the last layer with the
    output layer and its loss (the middle and the last unit of ``_timing_model``): medians
    of enough passes to last about ``seconds`` each (a machine's speed moves from one second
    to the next; a short burst times it at its best)."""
    units, hidden, ctx = _timing_model(args, device, vocab, seq, micro_batch)

    def timed(unit):
        repeats = min(200, max(3, math.ceil(seconds / calibration.unit_seconds(
            units, unit, hidden, ctx, 1)[1])))
        return calibration.unit_seconds(units, unit, hidden, ctx, repeats)[1]
    return timed(1), timed(2)


def device_rates(args, device, vocab: int) -> dict:
    """Achieved TFLOP/s of one layer's forward + backward beside the fixed cost, of the
    output layer with its loss, dense matmul TFLOP/s, and the fixed seconds of one unit pass
    (a pass of a one-token micro-batch, a third of its forward + backward)."""
    overhead = _unit_seconds(args, device, vocab, seq=1, micro_batch=1)[0] / 3
    layer, last = _unit_seconds(args, device, vocab, args.seq_length, args.micro_batch_size)
    flops = layer_flops_of(args) * args.micro_batch_size * args.seq_length
    achieved = 3 * flops / max(layer - 3 * overhead, layer / 10) / 1e12
    peak = max(calibration.matmul_tflops(2048, args.params_dtype, device), achieved)
    if last - layer < layer / 20:
        print(f"> warning: the last unit took {last:.4f} s against {layer:.4f} s for a layer: "
              "the output layer's time is within the noise; its rate is capped at the "
              "matmul peak", flush=True)
    head = 3 * output_layer_flops(args, vocab) / max(last - layer, 1e-9) / 1e12
    return {"device_tflops": achieved, "head_tflops": min(head, peak),
            "device_peak_tflops": peak, "unit_overhead_s": overhead}


# A width where a step's FLOPs and bytes are next to nothing: what is left is host time
PROBE_FLAGS = ["--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "8",
               "--kv-channels", "8", "--ffn-hidden-size", "256", "--seq-length", "1",
               "--micro-batch-size", "1", "--pipeline-model-parallel-size", "1"]


def _probe_step_seconds(flags: list[str], dp: int, device, vocab: int, microbatches: int,
                        warmup: int = 3, steps: int = 4) -> tuple[float, int, int]:
    """Median seconds of a real offloaded step of the flags' layout (layers, checkpoint
    interval, alpha, tiers, clipping) at ``PROBE_FLAGS``' width with ``microbatches``
    one-token micro-batches (one snake group) on ``dp`` data-parallel ranks, its unit visits
    and its passes in layers."""
    from megatron_snake.training.build import build_run
    args = parse_args(flags + PROBE_FLAGS + [
        "--global-batch-size", str(microbatches * dp), "--snake-group-size",
        str(microbatches)], world_size=dist.get_world_size())
    batches = random_microbatches(microbatches, 1, 1, vocab, seed=0, device=device)
    times = []
    with build_run(args, device, vocab, rank=dist.get_rank(), log=lambda line: None) as run:
        for _ in range(warmup + steps):
            calibration.synchronize(device)
            start = time.perf_counter()
            run.step(batches)
            calibration.synchronize(device)
            times.append(time.perf_counter() - start)
        layers = [max(1, len(u)) for u in run.offloaded.units.unit_layers]
    # the forward sweep stops before the last unit (it turns in place); the backward sweep
    # recomputes and backpropagates every unit: three passes. Passes count in layers (the
    # planner's unit_overhead_s is a one-layer unit's)
    visits = 2 * len(layers) - 1
    passes = microbatches * (sum(layers[:-1]) + 3 * sum(layers))
    return statistics.median(times[warmup:]), visits, passes


def step_overheads(flags: list[str], dp: int, device, vocab: int, bare_pass_s: float
                   ) -> dict:
    """Host seconds of a real step beside its FLOPs and bytes: per one-layer unit pass on
    one micro-batch (the compute's own fixed cost and the store's work for the unit input:
    saved, read back, dropped) and per unit visit in a sweep (acquiring and releasing the
    weights, handing the gradient and the update on; the step boundary's share). Two probe
    steps of 1 and 3 micro-batches: the difference is the passes', the rest the visits'.
    A unit pass costs at least ``bare_pass_s``, the pass timed alone."""
    one, visits, passes_one = _probe_step_seconds(flags, dp, device, vocab, 1)
    three, _, passes_three = _probe_step_seconds(flags, dp, device, vocab, 3)
    per_pass = max(bare_pass_s, (three - one) / (passes_three - passes_one))
    per_visit = max(0.0, (one - passes_one * per_pass) / visits)
    return {"unit_overhead_s": per_pass, "unit_visit_s": per_visit}


def step_compute_rates(flags: list[str], device, vocab: int, bare_pass_s: float,
                       warmup: int = 2, steps: int = 2) -> dict:
    """Achieved TFLOP/s of a unit's layers and of the output layer with its loss inside a
    real offloaded step: a CPU device computes on the cores that the store's copies and the
    CPU AdamW share, so a layer timed alone is faster than the same layer in a step. The
    step is the flags' (shape, micro-batches, clipping, alpha) with three units and every
    tier on the host, so that the drive's own toll stays in ``io_compute_slowdown``. The
    layers' time is the middle unit's forward, recompute and backward spans (the
    timeline's) less the bare cost of each layer pass; the output layer's is the last
    unit's backward-sweep spans less the middle unit's."""
    from megatron_snake import timeline
    from megatron_snake.training.build import build_run
    world = dist.get_world_size()
    shape = parse_args(flags, world_size=world)
    k = shape.snake_checkpoint_interval
    per_rank = shape.global_batch_size // (shape.micro_batch_size * shape.data_parallel_size)
    # one stage: every rank data-parallel, each with the flags' micro-batches per rank
    batch = per_rank * shape.micro_batch_size * world // shape.tensor_model_parallel_size
    args = parse_args(flags + ["--num-layers", str(3 * k), "--pipeline-model-parallel-size",
                               "1", "--global-batch-size", str(batch), "--snake-schedule",
                               "vertical", "--snake-param-tier", "host",
                               "--snake-optimizer-tier", "host", "--snake-activation-tier",
                               "host"], world_size=world)
    batches = random_microbatches(per_rank, args.micro_batch_size, args.seq_length, vocab,
                                  seed=0, device=device)
    with build_run(args, device, vocab, rank=dist.get_rank(), log=lambda line: None) as run:
        for _ in range(warmup):
            run.step(batches)
        with timeline.recording() as recorded:
            for _ in range(steps):
                run.step(batches)
    spent = {}   # "F u1", "B u1", "B u2": seconds over the recorded steps
    for s in recorded.spans:
        if s["cat"] == "compute" and s["thread"] == "MainThread":
            key = " ".join(s["name"].split()[:2])
            spent[key] = spent.get(key, 0.0) + s["end"] - s["start"]
    layers = spent["F u1"] + spent["B u1"]
    passes = 4 * per_rank * k * steps     # forward, then recompute + backward: 4 forwards
    flops = passes * layer_flops_of(args) * args.micro_batch_size * args.seq_length
    head = 3 * per_rank * steps * output_layer_flops(args, vocab)
    head_s = spent["B u2"] - spent["B u1"]
    if head_s < spent["B u1"] / 20:
        print(f"> warning: inside the step the last unit took {spent['B u2']:.4f} s against "
              f"{spent['B u1']:.4f} s for a middle one: the output layer's time is within "
              "the noise; its rate is capped at the matmul peak", flush=True)
    return {"device_tflops": flops / max(layers - passes * bare_pass_s, layers / 10) / 1e12,
            "head_tflops": head / max(head_s, 1e-9) / 1e12}


def io_compute_slowdown(args, device, vocab: int, store, seconds: float = 0.3,
                        rounds: int = 3) -> float:
    """The share of a layer's forward + backward time that the store's drive I/O takes from
    it while both run (they share the host's cores: on a CPU device, most of them): the
    median over ``rounds`` of a timing alone then beside the I/O, each the median of enough
    passes to last about ``seconds``."""
    units, hidden, ctx = _timing_model(args, device, vocab, args.seq_length,
                                       args.micro_batch_size)

    def layer(repeats):
        return calibration.unit_seconds(units, 1, hidden, ctx, repeats)[1]

    def beside_io(repeats):
        stop = threading.Event()
        io = threading.Thread(target=calibration.keep_drive_busy, args=(store, stop),
                              name="calibrate-io", daemon=True)
        io.start()
        try:
            return layer(repeats)
        finally:
            stop.set()
            io.join()

    repeats = min(200, max(3, math.ceil(seconds / layer(3))))
    shares = [1 - layer(repeats) / beside_io(repeats) for _ in range(rounds)]
    return max(0.0, statistics.median(shares))


def memory_bytes(device) -> tuple[int, int]:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, host
    return host, host     # the CPU computes in host memory


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="calibrate.py", allow_abbrev=False,
                                description="Measure a planner hardware profile; other flags "
                                "are pretrain_gpt.py's")
    p.add_argument("--output", required=True, help="the profile JSON to write")
    p.add_argument("--name", default=None, help="the profile's name (default: the host's)")
    ours, flags = p.parse_known_args(argv)
    if "--snake-offload" not in flags:
        flags.append("--snake-offload")
    args = parse_args(flags)
    device = distributed.resolve_device(args.device)
    distributed.initialize(device=device,
                           tensor_model_parallel_size=args.tensor_model_parallel_size,
                           seed=args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = build_tokenizer(**tokenizer_flags(args))
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    # the heap's policy of a run (offloaded_state.open_store): on the CPU, activations are
    # served by the same allocator settings in the run and here
    bound_host_heap()
    print("> timing a layer and the output layer on the compute device ...", flush=True)
    rates = device_rates(args, device, vocab)
    print("> the drive through the store, host copies, CPU AdamW ...", flush=True)
    with open_store(args, device, rank) as store:
        passes = [calibration.drive_rates(store) for _ in range(3)]
        drive_read = statistics.median(r["read"] for r in passes)
        drive_write = statistics.median(r["write"] for r in passes)
        # striped over --snake-offload-dir's directories: the rates above are all of
        # them together; the capacity is each file system's once
        paths = [d.path for d in store.dirs]
        capacity = sum(v.f_blocks * v.f_frsize for v in (
            os.statvfs(paths[group[0]]) for group in file_system_groups(paths)))
        drives = len(store.dirs)
        print("> a layer beside the drive's I/O ...", flush=True)
        rates["io_compute_slowdown"] = io_compute_slowdown(args, device, vocab, store)
        engine = getattr(store.engine, "name", type(store.engine).__name__)
    print("> a real step's host time per unit pass and unit visit ...", flush=True)
    bare_pass_s = rates["unit_overhead_s"]
    rates.update(step_overheads(flags, args.data_parallel_size, device, vocab,
                                rates["unit_overhead_s"]))
    compute = "one layer timed alone"
    if device.type == "cpu":   # on a GPU the host's spans time launches, not kernels
        print("> a layer inside a real step (host tiers) ...", flush=True)
        in_step = step_compute_rates(flags, device, vocab, bare_pass_s)
        rates["device_tflops_alone"] = rates["device_tflops"]
        rates["head_tflops_alone"] = rates["head_tflops"]
        rates.update(in_step)
        # the output layer's share is a difference of two spans: within the noise, capped
        rates["head_tflops"] = min(rates["head_tflops"], rates["device_peak_tflops"])
        rates["device_peak_tflops"] = max(rates["device_peak_tflops"], rates["device_tflops"])
        compute = "a unit's layers and the output layer inside a real step with host tiers"
    host_copy = calibration.copy_rate()
    pcie = calibration.copy_rate(device=device) if device.type == "cuda" else host_copy
    adam = calibration.adamw_rate()
    bus, collectives = 1e12, "not measured (one process: run under torchrun)"
    if world > 1:
        bus = calibration.allreduce_bus_rate(device=device)
        collectives = f"all-reduce bus bandwidth over {world} ranks ({dist.get_backend()})"
    device_memory, host_memory = memory_bytes(device)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    hw = Hardware(
        name=ours.name or socket.gethostname(), gpus_per_node=per_node,
        **rates, device_memory=device_memory,
        pcie_Bps=pcie, drive_read_Bps=drive_read, drive_write_Bps=drive_write,
        drives=drives, drive_capacity=capacity, host_memory=host_memory,
        host_copy_Bps=host_copy, cpu_adam_params_per_s=adam, intra_node_Bps=bus,
        inter_node_Bps=bus,
        source=(f"measured by tools/calibrate.py on {socket.gethostname()} "
                f"{datetime.datetime.now().isoformat(timespec='seconds')}: {device.type} "
                f"device, {compute}, hidden {args.hidden_size}, seq {args.seq_length}, "
                f"micro-batch {args.micro_batch_size}, {args.params_dtype}; drive through "
                f"the store ({engine} engine); "
                f"collectives: {collectives}"))
    if rank == 0:
        write_file_atomically(ours.output, (json.dumps(hw.to_dict(), indent=2) + "\n").encode(),
                              what="hardware profile (--output)")
        print(json.dumps(hw.to_dict(), indent=2))
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
