"""Pipeline bubble and weight traffic of the snake schedule against their formulas, for
snake group sizes G in {1, 2, 4, M}, in one run.

``--stages`` processes (gloo, one thread each) train the same GPT split into pipeline
stages with ``--snake-offload``'s state (weights, fp32 gradients and AdamW states on the
NVMe tier). Per stage and step:

- bubble: the fraction of the step the stage spends blocked in pipeline send / receive
  (timed through Megatron's ``config.timers`` hooks in its P2PCommunicator); predicted
  (p - 1) / (M/G + p - 1). The fraction spent inside unit compute (the schedule's
  ``compute_event`` hook) is reported too: the rest is weight I/O and the optimizer.
- weight bytes read from NVMe: the store's own counter for kind "weights"; predicted
  (M/G) x (bytes of the units the stage runs forward + bytes of all its units), since a
  stage loads every unit once per group per sweep (the loss unit of the last stage only in
  backward).

The bubble formula assumes equal stage times and free communication; on CPU, stages share
cores and gloo p2p is not free, so the measured bubble is read against it, not expected to
equal it. Raw figures go to ``--json-out``; the last line prints measured / predicted
weight bytes (geometric mean over G) and the bubble of each G.

    python tools/bench_pipeline.py --stages 2 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megatron_snake.schedule.unit_store import InMemoryStore  # noqa: E402
from megatron_snake.training.distributed import free_port, local_rank_env  # noqa: E402


class P2PTimers:
    """Megatron's ``config.timers`` interface, summing the time its P2PCommunicator spends
    in each send / receive: a stage blocked there is idle, which is the bubble."""

    def __init__(self):
        self.total_s, self._start = 0.0, {}

    def __call__(self, name, log_level=0):
        timers = self

        class _Timer:
            def start(self):
                timers._start[name] = time.perf_counter()

            def stop(self):
                timers.total_s += time.perf_counter() - timers._start.pop(name)

        return _Timer()


class TimedCheckpoints(InMemoryStore):
    """In-memory unit checkpoints that also time every compute event of the schedule."""

    def __init__(self):
        super().__init__()
        self.compute_s = 0.0

    def compute_event(self, sweep, unit, microbatch):
        bench = self

        class _Timer:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                bench.compute_s += time.perf_counter() - self.start

        return _Timer()


def _stage_main(rank, world, port, a, out_dir):
    os.environ.update(local_rank_env(rank, world, port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megatron_snake.models.gpt_units import GPTUnits
    from megatron_snake.storage.store import TensorStore
    from megatron_snake.schedule.unit_store import CombinedStore
    from megatron_snake.schedule.vertical import vertical_forward_backward
    from megatron_snake.training import distributed
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.data import random_microbatches
    from megatron_snake.training.model import build_gpt_model
    from megatron_snake.training.offloaded_state import build_offloaded_state

    args = parse_args([
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", "8", "--seq-length", str(a.seq),
        "--micro-batch-size", str(a.micro_batch),
        "--global-batch-size", str(a.micro_batch * a.microbatches),
        "--pipeline-model-parallel-size", str(world), "--untie-embeddings-and-output-weights",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--snake-offload",
        "--snake-param-tier", "nvme", "--snake-optimizer-tier", "nvme", "--device", "cpu"])
    device = distributed.resolve_device("cpu")
    distributed.initialize(device=device, pipeline_model_parallel_size=world, seed=1)
    gpt = build_gpt_model(args, 512, device)
    units = GPTUnits(gpt, 1)
    elem = 4
    unit_bytes = [sum(p.numel() for p in units.unit_parameters(u)) * elem
                  for u in range(units.num_units)]
    forward_bytes = sum(unit_bytes) - (unit_bytes[-1] if units.owns_head(units.num_units - 1)
                                       else 0)
    mbs = random_microbatches(a.microbatches, a.micro_batch, a.seq, 512, seed=0)  # every stage
    sizes = sorted({g for g in (1, 2, 4, a.microbatches) if a.microbatches % g == 0})
    results = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as root, \
            TensorStore(root, rank=rank, device=device) as store:
        state = build_offloaded_state(args, gpt, store, device)
        weights_read = lambda: store.counters.by_kind.get("weights", {}).get("nvme", [0, 0])[0]  # noqa: E731
        for group_size in sizes:
            walls, bubbles, busy, reads = [], [], [], []
            for step in range(a.warmup + a.steps):
                ckpts, gpt.config.timers = TimedCheckpoints(), P2PTimers()
                dist.barrier()
                before, start = weights_read(), time.perf_counter()
                vertical_forward_backward(gpt, mbs, group_size=group_size,
                                          store=CombinedStore(ckpts, state.weights))
                state.optimizer.step()
                wall = time.perf_counter() - start
                if step >= a.warmup:
                    walls.append(wall)
                    bubbles.append(gpt.config.timers.total_s / wall)
                    busy.append(ckpts.compute_s / wall)
                    reads.append(weights_read() - before)
            groups = a.microbatches // group_size
            results[group_size] = dict(
                step_s=statistics.median(walls), bubble=statistics.median(bubbles),
                compute_fraction=statistics.median(busy),
                bubble_predicted=(world - 1) / (groups + world - 1),
                weight_read_bytes=statistics.median(reads),
                weight_read_predicted=groups * (forward_bytes + sum(unit_bytes)))
        state.optimizer.flush()
        state.optimizer.close()
    with open(os.path.join(out_dir, f"stage{rank}.json"), "w") as f:
        json.dump(results, f)
    distributed.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir)")
    p.add_argument("--json-out", default="bench_pipeline.json")
    a = p.parse_args(argv)
    if a.layers % a.stages:
        p.error(f"--layers {a.layers} is not divisible by --stages {a.stages}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_stage_main, args=(a.stages, free_port(), a, out_dir), nprocs=a.stages,
                 join=True)
        stages = [json.load(open(os.path.join(out_dir, f"stage{r}.json")))
                  for r in range(a.stages)]
    print(f"{'G':>3} {'stage':>5} {'step s':>8} {'compute':>7} {'bubble':>7} {'predicted':>9} "
          f"{'weights read MiB':>16} {'predicted':>9}")
    ratios = []
    for g in stages[0]:
        for rank, st in enumerate(stages):
            r = st[g]
            ratios.append(r["weight_read_bytes"] / r["weight_read_predicted"])
            print(f"{g:>3} {rank:>5} {r['step_s']:8.3f} {r['compute_fraction']:7.3f} "
                  f"{r['bubble']:7.3f} "
                  f"{r['bubble_predicted']:9.3f} {r['weight_read_bytes'] / 2**20:16.2f} "
                  f"{r['weight_read_predicted'] / 2**20:9.2f}")
    with open(a.json_out, "w") as f:
        json.dump({"config": vars(a), "stages": stages}, f, indent=1)
    geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    bubbles = ", ".join(f"G={g}: {max(st[g]['bubble'] for st in stages):.2f} "
                        f"(formula {stages[0][g]['bubble_predicted']:.2f})" for g in stages[0])
    print(f"bubble (worst stage) {bubbles}")
    print(f"weight bytes read, measured / predicted (geomean over G and stages): {geomean:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
