"""What the offloaded AdamW's update holds in host memory outside the pinned pool, per
precision mode and layout size, measured: peak RSS (the OS's) during the updates of a few
steps over the RSS before them, with a pool of ``--pool-buffers`` buffers (all of them
allocated before the baseline is read) too small to hold any part's state, so that every
loan the update takes is a copy outside it.

The optimizer is the run's (``OffloadedAdamW`` over a ``TensorStore`` on ``--dir``, every
state on the drive), over ``--layouts`` flat layouts of ``--elements`` parameters each; its
new working weights go to the store as the run's ``OffloadedUnits.publish`` puts them. The
gradients are made before the baseline. With ``--clip-grad`` above 0 every layout's
backward part is updated speculatively (the run's default, ``--snake-speculate auto``, with
room on the drive). Each line prints the measured bytes, their ratio to the largest part,
and what the pre-flight counts for the same layouts (``preflight.UpdateBytes``). The peak includes the freed
heap glibc keeps for reuse (up to ``host_heap.HEAP_RETAIN_BYTES``), which the pre-flight
counts apart.

    python tools/bench_update_memory.py --dir /tmp/um --elements 8M,32M --json-out um.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.optim.offloaded_adamw import OffloadedAdamW  # noqa: E402
from megatron_snake.optim.precision import Precision  # noqa: E402
from megatron_snake.optim.dp_shards import DataParallel  # noqa: E402
from megatron_snake.optim.unit_params import SHARED, FlatLayout, Segment, UnitParams  # noqa: E402
from megatron_snake.storage import TensorStore  # noqa: E402
from megatron_snake.storage.host_heap import (bound_host_heap, keep_heap_trimmed,  # noqa: E402
                                              release_free_heap, resident_bytes)
from megatron_snake.storage.host_pool import DEFAULT_BUFFER_BYTES  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.preflight import UpdateBytes  # noqa: E402

# the precision modes, by their flags
MODES = {
    "fp32": [],
    "bf16 remainders": ["--bf16", "--use-precision-aware-optimizer"],
    "bf16 remainders + bf16 moments": ["--bf16", "--use-precision-aware-optimizer",
                                       "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
}


def _count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _layouts(count: int, elements: int, dtype: torch.dtype) -> UnitParams:
    units = []
    for i in range(count):
        param = torch.nn.Parameter(torch.randn(elements).to(dtype) * 0.02)
        units.append(FlatLayout(i, [Segment(f"w{i}", param, 0, elements, True, param.shape,
                                            i)]))
    return UnitParams(units, FlatLayout(SHARED, []), None)


class _Peak:
    """The highest RSS seen by a thread that samples it every ``period_s``."""

    def __init__(self, period_s: float = 0.002):
        self.period_s, self.peak, self._stop = period_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure(root: str, mode: str, elements: int, layouts: int, clip: float, alpha: float,
            steps: int, pool_buffers: int) -> dict:
    args = parse_args(["--snake-offload", "--clip-grad", str(clip), "--snake-alpha",
                       str(alpha), *MODES[mode]])
    precision = Precision.from_args(args)
    params = _layouts(layouts, elements, precision.params)
    with TensorStore(root, rank=0, host_memory_limit=pool_buffers * DEFAULT_BUFFER_BYTES) \
            as store, keep_heap_trimmed():
        taken = store.pool.acquire(pool_buffers)      # every buffer made before the baseline
        store.pool.release(taken)

        def publish(key, part, master, soon=False, name="w"):
            # what OffloadedUnits.publish does with the new weights of a unit on the drive
            store.put_converted((name, key, part), master, precision.params, tier="nvme",
                                kind="weights")

        opt = OffloadedAdamW(params, store, lr=1e-3, weight_decay=0.1, clip_grad=clip,
                             alpha=alpha, precision=precision, on_weights=publish,
                             speculate=tuple(lay.key for lay in params.units) if clip else ())
        gen = torch.Generator().manual_seed(0)
        grads = [[torch.randn(elements, generator=gen) * 1e-3 for _ in params.units]
                 for _ in range(steps + 1)]

        def step(gs):
            for lay, g in zip(reversed(params.units), reversed(gs)):
                opt.gradient_ready(lay.key, g)
            opt.step()
            opt.flush()
            store.synchronize()

        step(grads[0])                                # warm-up: scratch, first records
        del grads[0]
        release_free_heap()      # what the warm-up freed is not there to be reused
        baseline = resident_bytes()
        with _Peak() as peak:
            for gs in grads:
                step(gs)
        opt.close()
    counted = UpdateBytes.of(args, precision, params, DataParallel())
    return {"mode": mode, "elements": elements, "layouts": layouts, "clip": clip,
            "alpha": alpha, "largest_part": counted.largest, "baseline_bytes": baseline,
            "outside_pool_bytes": peak.peak - baseline,
            "preflight_update_bytes": counted.nbytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir)")
    p.add_argument("--elements", default="8M,32M", help="parameters per layout, a list")
    p.add_argument("--layouts", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"of {list(MODES)}")
    p.add_argument("--clip-grads", default="1.0,0", help="a list: 0 is no clip, so no "
                   "speculative update")
    p.add_argument("--alpha", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--pool-buffers", type=int, default=4)
    p.add_argument("--json-out", default="bench_update_memory.json")
    a = p.parse_args(argv)
    bound_host_heap()
    torch.set_num_threads(1)
    root = a.dir or tempfile.mkdtemp(prefix="bench_update_memory_")
    rows = []
    for mode in a.modes.split(","):
        for elements in map(_count, a.elements.split(",")):
            for clip in map(float, a.clip_grads.split(",")):
                row = measure(root, mode, elements, a.layouts, clip, a.alpha, a.steps,
                              a.pool_buffers)
                rows.append(row)
                print(f"{mode:32s} layout {elements / 2**20:5.1f}M clip {clip:3.1f}: outside "
                      f"the pool {row['outside_pool_bytes'] / 2**20:7.1f} MiB = "
                      f"{row['outside_pool_bytes'] / row['largest_part']:5.1f} B x the largest "
                      f"part ({row['largest_part'] / 2**20:.1f}M); the pre-flight counts "
                      f"{row['preflight_update_bytes'] / 2**20:7.1f} MiB",
                      flush=True)
    with open(a.json_out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
