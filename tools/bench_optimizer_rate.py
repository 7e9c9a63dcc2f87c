"""The offloaded AdamW's update rate per precision mode, against today's fused fp32 update.

Each mode updates the same layout (one transformer layer's parameters at ``--hidden``, plus
its biases and norms) from states held in memory: no drive, no store, only the update
(``HostUpdate.run``: the native one-pass kernel where it is built, else torch's passes,
``optim/host_kernel.py``; ``SNAKE_ADAMW_ISA=torch`` picks those). ``--chunk-elements``
sizes the torch path's fp32 chunks (the precision-aware modes load each chunk of each state
into fp32, run the fused kernel, and round it back). Modes alternate, round after round, so
a slow second of this shared machine lands on all of them alike; each mode's figure is
its median.

The rate is parameters per second and GB/s of state: the bytes one update reads and
writes of the stored states (master weights, or under remainders the int16 remainder and
the bf16 working weight it pairs with, and both moments), plus the gradient it reads, in
their dtypes: 28 B per parameter in fp32, 14 for remainders with bf16 moments. Raw
figures go to ``--json-out``; the last lines are each mode's rate over fp32's.

    OMP_NUM_THREADS=1 python tools/bench_optimizer_rate.py --json-out rate.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.optim import host_kernel  # noqa: E402
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW, StepHyper  # noqa: E402
from megatron_snake.optim.parts import LANE_ELEMENTS, PARTS  # noqa: E402
from megatron_snake.optim.precision import FP8, REMAINDER, Precision  # noqa: E402
from megatron_snake.optim.unit_params import FlatLayout, Segment, UnitParams  # noqa: E402
from megatron_snake.storage.store import TensorStore  # noqa: E402

BF16 = torch.bfloat16
MODES = {
    "fp32": Precision(params=BF16),
    "remainders": Precision(params=BF16, master=REMAINDER),
    "remainders + bf16 moments": Precision(params=BF16, master=REMAINDER, exp_avg=BF16,
                                           exp_avg_sq=BF16),
    "remainders + fp16 moments": Precision(params=BF16, master=REMAINDER,
                                           exp_avg=torch.float16, exp_avg_sq=torch.float16),
    "remainders + fp8 moments": Precision(params=BF16, master=REMAINDER, exp_avg=FP8,
                                          exp_avg_sq=FP8),
    "remainders + bf16 moments + bf16 grads": Precision(params=BF16, master=REMAINDER,
                                                        exp_avg=BF16, exp_avg_sq=BF16,
                                                        grad=BF16),
}


def layer_layout(hidden: int) -> UnitParams:
    """One GPT layer of the local spec (LayerNorms, QKV, proj, fc1, fc2 with biases)."""
    shapes = [("input_layernorm.weight", (hidden,)), ("input_layernorm.bias", (hidden,)),
              ("linear_qkv.weight", (3 * hidden, hidden)), ("linear_qkv.bias", (3 * hidden,)),
              ("linear_proj.weight", (hidden, hidden)), ("linear_proj.bias", (hidden,)),
              ("pre_mlp_layernorm.weight", (hidden,)), ("pre_mlp_layernorm.bias", (hidden,)),
              ("linear_fc1.weight", (4 * hidden, hidden)), ("linear_fc1.bias", (4 * hidden,)),
              ("linear_fc2.weight", (hidden, 4 * hidden)), ("linear_fc2.bias", (hidden,))]
    segments, offset = [], 0
    for index, (name, shape) in enumerate(shapes):
        param = torch.nn.Parameter(torch.empty(0))
        numel = 1
        for n in shape:
            numel *= n
        segments.append(Segment(name, param, offset, numel, len(shape) > 1 and
                                not name.endswith("bias"), torch.Size(shape), index))
        offset += numel
    return UnitParams(units=[FlatLayout(0, segments)], shared=FlatLayout("shared", []),
                      shared_owner=None)


class Initial:
    """The layer's first values (random, std 0.02), without holding its parameters."""

    def __init__(self, numel: int):
        self.values = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 0.02

    def flat(self, layout, *, dtype, device="cpu"):
        return self.values.to(dtype)


def states(opt: OffloadedAdamW, precision: Precision, numel: int) -> dict:
    """One part's lent states as the update takes them (whole tensors, as one host buffer
    would lend them), in the mode's dtypes, with the scales of a scaled dtype in place."""
    g = torch.Generator().manual_seed(1)
    master = torch.randn(numel, generator=g) * 0.02
    lent = {"grad": [(torch.randn(numel, generator=g) * 1e-3).to(precision.grad)]}
    for name in ("exp_avg", "exp_avg_sq"):
        values = torch.rand(numel, generator=g) * (1e-3 if name == "exp_avg" else 1e-6)
        lent[name] = [opt.states.encode(name, 0, "bwd", values)]
    if precision.remainders:
        from megatron_snake.optim.precision import split_flat

        hi, rem = split_flat(master)
        lent["master"], lent["w"] = [rem], [hi]
    else:
        lent["master"] = [opt.states.encode("master", 0, "bwd", master)]
    return lent


def bytes_per_param(p: Precision) -> int:
    """State bytes one update reads and writes, and the gradient it reads."""
    weights = 2 * 2 if p.remainders else 0   # the bf16 high halves, read and replaced
    return 2 * p.state_bytes + weights + p.grad_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024,
                    help="hidden size of the layer updated (12.6M parameters at 1024)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every mode, alternating")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--chunk-elements", type=int, nargs="+",
                    default=[host_kernel.CHUNK_ELEMENTS],
                    help="the chunked update's scratch batch (elements, multiples of "
                         f"{LANE_ELEMENTS}); several: each precision-aware "
                         "mode at each, alternating (default: CHUNK_ELEMENTS)")
    ap.add_argument("--json-out", default="bench_optimizer_rate.json")
    a = ap.parse_args(argv)
    for c in a.chunk_elements:
        if c <= 0 or c % LANE_ELEMENTS:
            ap.error(f"--chunk-elements {c}: a positive multiple of "
                     f"{LANE_ELEMENTS}")
    # (label, mode, chunk elements): fp32 runs the fused kernel, which has no chunks
    variants = []
    for mode in a.modes:
        chunks = [None] if MODES[mode].fp32 else a.chunk_elements
        for c in chunks:
            label = mode if c is None or len(a.chunk_elements) == 1 else f"{mode} @ {c}"
            variants.append((label, mode, c))

    params = layer_layout(a.hidden)
    numel = params.units[0].numel
    runs: dict = {label: [] for label, _, _ in variants}
    default_chunk = host_kernel.CHUNK_ELEMENTS
    with tempfile.TemporaryDirectory() as tmp, \
            TensorStore(tmp, rank=0, host_memory_limit=1 << 30) as store:
        opts, lent = {}, {}
        for label, mode, _ in variants:
            # alpha 0: one part holds the layout; the records stay small, on no drive
            opts[label] = OffloadedAdamW(params, store, lr=1e-4, weight_decay=0.1, alpha=0.0,
                                         tier="host", precision=MODES[mode],
                                         initial=Initial(numel), weight_records=False)
            for name in ("master", "exp_avg", "exp_avg_sq"):
                for part in PARTS:
                    store.delete((name, 0, part))   # only the lent copies below are used
            lent[label] = states(opts[label], MODES[mode], numel)
        store.synchronize()
        for rnd in range(a.rounds + 1):          # round 0 warms up (scratch, page faults)
            for label, mode, chunk in variants:
                opt, hyper = opts[label], StepHyper(rnd + 1, 1e-4, 0.1)
                # each optimizer sizes its scratch at its first update, at this chunk
                host_kernel.CHUNK_ELEMENTS = chunk or default_chunk
                t0 = time.perf_counter()
                # under remainders the working weights replaced in place, as the worker does
                opt.host_update.run(0, "bwd", hyper, None, lent[label], lambda *_: None,
                                    weights_out=lent[label].get("w"))
                seconds = time.perf_counter() - t0
                if rnd:
                    runs[label].append(seconds)
        host_kernel.CHUNK_ELEMENTS = default_chunk
        for opt in opts.values():
            opt.close()

    result = {"machine": platform.node(), "processor": platform.processor(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "hidden": a.hidden, "params": numel, "rounds": a.rounds,
              "chunk_elements": a.chunk_elements, "modes": {}}
    labels = [label for label, _, _ in variants]
    base = statistics.median(runs[labels[0]]) if labels else 1.0
    for label, mode, chunk in variants:
        median = statistics.median(runs[label])
        nbytes = bytes_per_param(MODES[mode])
        result["modes"][label] = {"mode": mode, "chunk_elements": chunk,
            "seconds": runs[label], "median_s": median, "params_per_s": numel / median,
            "bytes_per_param": nbytes, "gb_per_s": numel * nbytes / median / 1e9,
            "params_per_s_ratio_to_first": base / median}
        print(f"{label:52s} {median * 1e3:8.1f} ms  {numel / median / 1e6:7.1f} M params/s "
              f"{numel * nbytes / median / 1e9:6.2f} GB/s of state ({nbytes} B/param)")
    with open(a.json_out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.json_out}")
    for label in labels[1:]:   # ratios last: params/s of the mode over fp32's
        print(f"rate {label} / {labels[0]}: "
              f"{result['modes'][label]['params_per_s_ratio_to_first']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
