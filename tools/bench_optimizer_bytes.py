"""Drive bytes per parameter per step of the offloaded AdamW in each precision mode, from the
store's own counters, and the loss of a small GPT trained in each mode (a PNG).

Modes (``--use-precision-aware-optimizer`` and Megatron-LM's dtype flags, bf16 training):

* ``fp32``: today's fp32 master weights and moments (12 B per parameter, fused update);
* ``remainders``: the flag alone: bf16 weights + 16-bit remainders as the masters (exact);
* ``remainders + bf16 moments``: and ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``;
* ``remainders + fp16 moments`` (approximate, scaled per tensor), with ``--loss``.

**Bytes.** The same GPT (``--layers``, ``--hidden``) is trained offloaded with the weights and
the optimizer state on the drive (``--snake-offload-dir``), the host pool at the size the
pre-flight gives this run (or ``--host-memory``), modes alternating, ``--steps`` measured
after ``--warmup`` steps. Per mode: the drive's bytes read and written per parameter per
step (the store's ``counters``, whole and per kind of state), in the steady state: a step
runs the updates of the step before in its forward sweep (clipping is on, Megatron's
default), so each step holds one update of every part.

**Loss.** ``--loss-steps`` iterations of a small GPT per mode through ``pretrain`` (mock data,
the same seed and batches), the curves in one PNG (``--png``, matplotlib) beside fp32's,
with each mode's difference from fp32 below.

Raw figures go to ``--json-out``; the last lines are each mode's bytes per parameter per
step over fp32's.

    OMP_NUM_THREADS=1 python tools/bench_optimizer_bytes.py --dir /tmp/x --json-out b.json \\
        --png docs/img/precision_loss.png
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.training.arguments import parse_args  # noqa: E402

PRECISE = ["--use-precision-aware-optimizer"]
MODES = {
    "fp32": [],
    "remainders": PRECISE,
    "remainders + bf16 moments": [*PRECISE, "--exp-avg-dtype", "bf16",
                                  "--exp-avg-sq-dtype", "bf16"],
    "remainders + fp16 moments": [*PRECISE, "--exp-avg-dtype", "fp16",
                                  "--exp-avg-sq-dtype", "fp16"],
}
BYTE_MODES = ["fp32", "remainders", "remainders + bf16 moments"]
KINDS = ("optim", "weights", "grad", "activations")


def model_flags(a, *, layers: int, hidden: int, seq: int, mbs: int, gbs: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(max(1, hidden // 64)), "--seq-length", str(seq),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--bf16",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
            "--lr-warmup-iters", "10", "--lr-decay-style", "cosine", "--device", "cpu",
            "--seed", "1234", "--num-workers", "0"]


def measure_bytes(a, root: str) -> dict:
    """Per mode: drive bytes per parameter per step (total and per kind), modes alternating
    step by step over one built run each."""
    from megatron_snake.training import distributed, preflight
    from megatron_snake.training.build import build_run
    from megatron_snake.training.data import random_microbatches
    from megatron_snake.training.tokenizer import (build_tokenizer, padded_vocab_size,
                                                     tokenizer_flags)

    device = distributed.resolve_device("cpu")
    distributed.initialize(device=device, seed=1234)
    flags = model_flags(a, layers=a.layers, hidden=a.hidden, seq=a.seq,
                        mbs=a.micro_batch_size, gbs=a.micro_batch_size * a.micro_batches)
    out = {}
    with contextlib.ExitStack() as stack:
        runs = {}
        for mode in BYTE_MODES:
            d = os.path.join(root, mode.replace(" ", "_").replace("+", "p"))
            os.makedirs(d, exist_ok=True)
            extra = ["--snake-host-memory-limit", a.host_memory] if a.host_memory else []
            args = parse_args([*flags, "--snake-offload", "--snake-offload-dir", d,
                               "--snake-alpha", str(a.alpha), *extra, *MODES[mode]])
            tok = build_tokenizer(**tokenizer_flags(args))
            vocab = padded_vocab_size(tok.vocab_size, args.make_vocab_size_divisible_by, 1)
            pf = preflight.estimate(args, vocab)
            args.snake_host_memory_limit = pf.pool_bytes   # as pretrain's pre-flight sets it
            distributed.set_seed(args.seed)
            run = stack.enter_context(build_run(args, device, vocab, log=lambda *x: None))
            runs[mode] = (run, pf, vocab)
            out[mode] = {"params": pf.params_rank, "pool_bytes": pf.pool_bytes,
                         "preflight_optimizer_bytes": pf.nvme_optimizer,
                         "preflight_gradient_bytes": pf.nvme_gradients,
                         "state_bytes_per_param": pf.nvme_optimizer / pf.params_rank,
                         "steps": []}
        for step in range(a.warmup + a.steps):
            batches = random_microbatches(a.micro_batches, a.micro_batch_size, a.seq,
                                          runs[BYTE_MODES[0]][2], seed=step)
            for mode in BYTE_MODES:
                run, pf, _ = runs[mode]
                store = run.tensor_store
                before = copy.deepcopy(store.counters.snapshot())
                t0 = time.perf_counter()
                run.step(batches)
                # (a step's figure holds the updates of the step before, run in its forward
                # sweep: in the steady state, one update of every part per step)
                run.optimizer.wait_running()
                store.synchronize()
                seconds = time.perf_counter() - t0
                after = store.counters.snapshot()
                if step < a.warmup:
                    continue
                kinds = {}
                for kind in KINDS:
                    rw = [x - y for x, y in zip(
                        after["by_kind"].get(kind, {}).get("nvme", [0, 0]),
                        before["by_kind"].get(kind, {}).get("nvme", [0, 0]))]
                    kinds[kind] = rw
                read = after["read"]["nvme"] - before["read"]["nvme"]
                written = after["written"]["nvme"] - before["written"]["nvme"]
                out[mode]["steps"].append({"read": read, "written": written, "kinds": kinds,
                                           "seconds": seconds})
    for mode, rec in out.items():
        n, steps = rec["params"], rec["steps"]
        rec["drive_bytes_per_param_per_step"] = statistics.median(
            (s["read"] + s["written"]) / n for s in steps)
        rec["by_kind_per_param_per_step"] = {
            kind: [statistics.median(s["kinds"][kind][i] / n for s in steps) for i in (0, 1)]
            for kind in KINDS}
    distributed.shutdown()
    return out


def loss_curves(a, root: str) -> dict:
    """``--loss-steps`` iterations of the small GPT per mode (pretrain, mock data)."""
    from megatron_snake.training.loop import pretrain

    flags = model_flags(a, layers=a.loss_layers, hidden=a.loss_hidden, seq=a.loss_seq,
                        mbs=2, gbs=8)
    curves = {}
    for mode in MODES:
        d = tempfile.mkdtemp(dir=root)
        args = parse_args([*flags, "--train-iters", str(a.loss_steps), "--log-interval",
                           str(a.loss_steps), "--snake-offload", "--snake-offload-dir", d,
                           *MODES[mode]])
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            curves[mode] = pretrain(args)
        print(f"loss curve {mode}: {len(curves[mode])} steps, last {curves[mode][-1]:.4f}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return curves


def plot(curves: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    base = curves["fp32"]
    for i, (mode, losses) in enumerate(curves.items()):
        steps = range(1, len(losses) + 1)
        color = f"C{i}"   # a mode's colour is the same in both panels
        top.plot(steps, losses, label=mode, color=color, lw=1.4 if mode == "fp32" else 1.0,
                 ls="-" if mode in ("fp32", "remainders") else "--")
        if mode != "fp32":
            bottom.plot(steps, [x - y for x, y in zip(losses, base)], label=mode,
                        color=color, lw=1.0)
    top.set_ylabel("lm loss")
    top.set_title(title)
    top.legend()
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.legend(fontsize="small")
    bottom.set_xlabel("iteration")
    bottom.set_ylabel("loss - fp32's")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="offload directory (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=0.25)
    ap.add_argument("--host-memory", default=None,
                    help="--snake-host-memory-limit (default: the pre-flight's for the run)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--loss-steps", type=int, default=300)
    ap.add_argument("--loss-layers", type=int, default=4)
    ap.add_argument("--loss-hidden", type=int, default=128)
    ap.add_argument("--loss-seq", type=int, default=128)
    ap.add_argument("--no-loss", action="store_true", help="bytes only")
    ap.add_argument("--png", default=None, help="the loss curves' PNG")
    ap.add_argument("--json-out", default="bench_optimizer_bytes.json")
    a = ap.parse_args(argv)

    with contextlib.ExitStack() as stack:
        root = a.dir or stack.enter_context(tempfile.TemporaryDirectory())
        result = {"machine": platform.node(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "args": vars(a)}
        result["bytes"] = measure_bytes(a, root)
        if not a.no_loss:
            result["loss"] = loss_curves(a, root)
            if a.png:
                plot(result["loss"], a.png,
                     f"{a.loss_layers}-layer GPT, hidden {a.loss_hidden}, bf16, offloaded: "
                     "loss per optimizer precision")
                print(f"wrote {a.png}")
    with open(a.json_out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.json_out}")
    base = result["bytes"]["fp32"]["drive_bytes_per_param_per_step"]
    for mode, rec in result["bytes"].items():
        kinds = ", ".join(f"{k} r/w {r:.2f}/{w:.2f}" for k, (r, w) in
                          rec["by_kind_per_param_per_step"].items())
        print(f"{mode:28s} drive {rec['drive_bytes_per_param_per_step']:6.2f} B/param/step "
              f"({kinds}); state {rec['state_bytes_per_param']:.0f} B/param")
    if "loss" in result:
        for mode, losses in result["loss"].items():
            tail = losses[-20:]
            print(f"loss {mode:28s} mean of the last 20 steps {sum(tail) / len(tail):.4f}")
    for mode in BYTE_MODES[1:]:   # ratios last
        print(f"drive bytes per parameter per step, {mode} / fp32: "
              f"{result['bytes'][mode]['drive_bytes_per_param_per_step'] / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
