"""The headline: offloaded training of a GPT whose training state is several times the GPU
memory it is given, against what a Megatron-LM user would run instead: Megatron without
offload and without a limit (with its full recompute and without recompute), and Megatron's
own CPU offload of its optimizer with the same memory given; over the micro-batches per
step M (the curve), with gradient clipping on and off.

Every run is the one pretrain_gpt builds (``build_run``), on random tokens, in this process:

* **Megatron** (no ``--snake-offload``, no memory limit): Megatron's DDP, optimizer and
  schedule, stepped with full recompute (``recompute_granularity full``, method
  ``uniform``, one layer per checkpoint: what ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1`` sets) and without recompute, at each
  clip of ``--clip-grads``, on the same built model (the config's recompute fields and the
  optimizer's ``clip_grad`` are switched between them).
* **Megatron's CPU offload** (``CPU_OFFLOAD_FLAGS``: ``--optimizer-cpu-offload
  --optimizer-offload-fraction 1.0 --overlap-cpu-optimizer-d2h-h2d
  --use-precision-aware-optimizer --use-distributed-optimizer``, Megatron-Core's
  ``HybridDeviceOptimizer``) with full recompute, under the memory fraction that makes the
  state ``--cpu-offload-ratios`` (2 and 3) times the memory given, as ours gets. On the
  device it keeps the bf16 weights and the fp32 gradient buffer, 6 of the 18 bytes a
  parameter: at 3x that is all the memory given, so it is expected to run out of memory
  there and to fit at 2x. It needs CUDA: on the CPU its figure is "not run: <why>".
* **offloaded** (``--snake-offload``), under ``torch.cuda.set_per_process_memory_fraction``
  so that the training state (bf16 weights 2 + fp32 gradient 4 + fp32 master weights and
  Adam moments 12 bytes per parameter) is ``--state-ratios`` (3 and 2) times the memory
  given; ``--snake-gpu-memory-limit`` tells the run half of that memory, at most all but
  1.75 GiB (units pinned on the device within it; the rest is left for the activations
  inside a unit, attention's scores without flash attention and the logits' fp32 copies),
  and is left out where that is under 1 GiB.
  Weights, optimizer state and unit inputs on the host tier by default (``--snake-flags``):
  this VM's drive moves 2-3 GB/s, which no batch that fits the time box would hide.

A run that does not fit (CUDA out of memory) is recorded with the figure "out of memory at
N x" in place of its tokens/s, and the others go on; Megatron's CPU offload is not tried
again at another M at a ratio where it failed (its activations do not grow with M).

The runs come in order of value (``plan``), each only while ``--time-budget`` allows it
(the first round's headline pair always runs; the JSON is written after every run, so a run
cut short keeps what came before it): the headline pair at the headline's M and first clip
(Megatron, which also measures every other clip on its build, and ours at the first state
ratio); Megatron's CPU offload at each ratio, then ours at the other state ratios; ours at
the other clips; then the curve, each M of ``--curve`` in turn (Megatron, ours, Megatron's
CPU offload), then ours at the other clips over it. A pair swaps places in odd rounds and
from one M to the next; ``--rounds`` repeats the whole order. ``--stages`` runs a part of
it (a second command can add the curve: ``--stages curve``). Figures per run: tokens/s and
model TFLOP/s per GPU by Megatron's formula (``model_flops_per_iteration``: Megatron-LM
0.16.1's ``num_floating_point_operations``, recompute not counted as useful work) over the
timed steps, the device's peak allocation, and for the offloaded runs the share of the
optimizer's update time hidden behind compute (1 - time the step waited for an update /
time the updates took). The summary takes the median over rounds of each line of the curve
(a system at a setting and a clip) at each M, and the ratios of ours to each baseline at
the same M and clip; ``summary.megatron_full``, ``megatron_none`` and ``offloaded_<r>x``
stay the headline's (its M, its first clip). ``--plot FILE`` draws tokens/s over M and the
ratios; ``--from JSON [JSON ...] --plot FILE`` draws earlier runs' without training (the
headline's and a second call's curve as one run).

The headline's batch: the saturating one (``saturating_m``), the fewest micro-batches
whose compute hides the state's per-step time: the host link's bytes (weights in both
sweeps, fp32 gradients back, at the measured pinned copy rate) behind the whole step, and
the offloaded run's own update (a probe: an offloaded run at the first ratio of --probe-mb
micro-batches, one warm-up and one timed step) behind the forward sweep alone with clipping
(a quarter of the step) and behind the whole step without; c is Megatron's step with full
recompute per micro-batch (a probe step on its run first); at most what fits
``--max-step-s`` per Megatron step. The update is measured, not taken from
``calibration.adamw_rate``: on an H200 the fused AdamW alone ran at 4.2G parameters/s (on
every core), the run's update (unscale and clip, AdamW, the new bf16 weights) at 1.3G, and
the M chosen from the former left the optimizer exposed. ``--micro-batches`` sets M
instead (no probe).

The model (``size_model``): hidden 2048, 16 heads, sequence 2048, micro-batch 1, vocabulary
32768, bf16, untied embeddings; the most layers (a multiple of 4, at most ``--max-layers``
32) for which Megatron's run without recompute (18 bytes of state per parameter, the
activations of one micro-batch kept whole: s*b*h*(34 + 5*a*s/h) bytes a layer, three fp32
copies of the logits) fits in ``--memory-share`` (0.45) of the device's memory. An H100
(79.2 GiB) gets 24 layers (1.34B parameters, 24.1 GB of state: 8.0 GB given at 3x), an
H200 (139.8 GiB) 32 (1.74B, 31.3 GB).

``--trace-dir DIR``: instead, record one steady step of the offloaded run at the headline's
batch, first state ratio and first clip (read from ``--from`` the headline's JSON) with
``tools/gpu_trace.py``'s profiler and analysis: DIR/trace.json.gz, gaps.json (the GPU's
idle share and every gap over ``--gap-ms`` with what the host did), timeline.png; the last
line is ``gpu idle fraction: X (no kernel running: Y)``.

``--device cpu`` (the default without CUDA) runs the same code on tiny sizes as a smoke
test (no memory fraction: a CPU has none), e.g. ``tools/gpu_check.sh``'s dry run:

    python tools/bench_headline.py --dir /nvme/scratch --json-out headline.json \\
        --plot headline_curve.png                                                    # GPU
    python tools/bench_headline.py --dir /nvme/scratch --trace-dir trace --from headline.json
    python tools/bench_headline.py --from headline.json --plot docs/img/headline_curve.png
    python tools/bench_headline.py --device cpu --layers 2 --hidden 64 --heads 4 --seq 64 \\
        --vocab 1024 --micro-batches 2 --curve 3 --json-out /tmp/h.json            # smoke

Prints one line per run, the JSON, each line of the curve and its ratios, Megatron's CPU
offload, each clip, and last ``ratio tokens/s offloaded (3x) / Megatron: full recompute
R1, no recompute R2``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
# Both systems' runs in this process allocate with expandable segments (what memory-bound
# Megatron-LM runs set): at 10x the offloaded run's few GiB went out of memory on an H200
# with 0.45 GiB reserved in blocks too small to reuse.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STATE_BYTES_PER_PARAM = 18   # bf16 weights 2 + fp32 gradient 4 + fp32 master and moments 12
MEGATRON_MODES = ("full", "none")
# Megatron-LM's CPU offload of its optimizer, the first thing its user tries when the state
# does not fit: Megatron-Core's HybridDeviceOptimizer, every state on the host, its copies
# overlapped (Megatron-LM requires the precision-aware optimizer for it, which requires the
# distributed optimizer)
CPU_OFFLOAD_FLAGS = ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                     "--optimizer-offload-fraction", "1.0", "--overlap-cpu-optimizer-d2h-h2d",
                     "--use-precision-aware-optimizer"]
# The share of a full-recompute step's device work in its forward sweep: a forward of the
# four a micro-batch costs (the forward, then in the backward sweep the recompute and the
# backward, twice a forward: the activations' and the weights' gradients)
FORWARD_SHARE = 0.25
# what a run measures, in order of value (--stages)
STAGES = ("headline", "cpu_offload", "clip", "curve")


# --- the model and its sizes ---------------------------------------------------------
def layer_params(h: int) -> int:
    """One GPT layer: QKV and output projections, the 4h MLP, two norms, biases."""
    return 12 * h * h + 13 * h


def other_params(a) -> int:
    """Word embeddings and the untied output layer, learned positions, the final norm."""
    return 2 * a.vocab * a.hidden + a.seq * a.hidden + 2 * a.hidden


def params_of(a, layers: int) -> int:
    return layers * layer_params(a.hidden) + other_params(a)


def megatron_bytes(a, layers: int) -> int:
    """Device memory of Megatron's run without recompute: the state and one micro-batch's
    activations (Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) a layer, no flash attention),
    with three fp32 copies of the logits."""
    s, b, h = a.seq, a.micro_batch_size, a.hidden
    activations = int(s * b * h * (34 + 5 * a.heads * s / h))
    logits = 3 * 4 * s * b * a.vocab
    return STATE_BYTES_PER_PARAM * params_of(a, layers) + layers * activations + logits


def size_model(a, total_bytes: int | None) -> dict:
    """The layers: ``--layers``, else the most (a multiple of 4, at most --max-layers) whose
    Megatron run without recompute fits in --memory-share of the device (CPU: 2)."""
    if a.layers:
        layers, rule = a.layers, "--layers"
    elif total_bytes is None:
        layers, rule = 2, "CPU smoke test"
    else:
        room = a.memory_share * total_bytes
        fit = max(l for l in range(1, 1024) if megatron_bytes(a, l) <= room or l == 1)
        layers = max(4, min(a.max_layers, fit) // 4 * 4)
        rule = (f"most layers (multiple of 4, <= {a.max_layers}) with Megatron's run without "
                f"recompute in {a.memory_share:.0%} of {total_bytes / 2**30:.1f} GiB: "
                f"{fit} fit")
    n = params_of(a, layers)
    return {"layers": layers, "rule": rule, "params": n,
            "state_bytes": STATE_BYTES_PER_PARAM * n,
            "megatron_bytes_estimate": megatron_bytes(a, layers)}


def gpt_flags(a, layers: int, num_mb: int, clip: float | None = None) -> list[str]:
    """pretrain_gpt's flags of the GPT, ``num_mb`` micro-batches a step; ``clip``:
    --clip-grad (None: its default, 1.0)."""
    flags = ["--num-layers", str(layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
             "--max-position-embeddings", str(a.seq),
             "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.micro_batch_size * num_mb),
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--untie-embeddings-and-output-weights", "--seed", "1234"]
    if clip is not None:
        flags += ["--clip-grad", f"{clip:g}"]
    return flags + (["--bf16"] if a.bf16 else [])


def offload_flags(a, layers: int, num_mb: int, given: int | None, host_limit: int,
                  root: str, clip: float | None = None) -> list[str]:
    flags = gpt_flags(a, layers, num_mb, clip) + [
        "--snake-offload", "--snake-offload-dir", root,
        "--snake-host-memory-limit", str(host_limit)] + a.snake_flags.split()
    if a.optimizer_threads:
        flags += ["--snake-optimizer-threads", str(a.optimizer_threads)]
    limit = gpu_limit_bytes(a, given)
    if limit:
        flags += ["--snake-gpu-memory-limit", str(limit)]
    return flags


def gpu_limit_bytes(a, given: int | None) -> int | None:
    """--snake-gpu-memory-limit for the offloaded run (units pinned on the device within
    it): --limit-share of the memory given, at most all of it but --headroom-gib (the
    activations inside a unit, the logits and their fp32 copies); none when that leaves
    under 1 GiB (nothing worth pinning: every unit is then read from the host)."""
    if given is None or a.limit_share <= 0:
        return None
    limit = min(int(a.limit_share * given), given - int(a.headroom_gib * 2**30))
    return limit if limit >= 1 << 30 else None


def host_limit_bytes(a, sizing: dict, num_mb: int) -> int:
    """The host pool: the state, the step's unit inputs, a margin, rounded up to GiB."""
    ckpt = (sizing["layers"] - 1) * num_mb * a.seq * a.micro_batch_size * a.hidden * \
        (2 if a.bf16 else 4)
    need = 1.5 * sizing["state_bytes"] + ckpt + (2 << 30)
    return int(math.ceil(need / 2**30)) << 30


# --- one timed run ---------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=None)
def _flops_per_sequence(flags: tuple, vocab: int, mbs: int) -> float:
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.train_log import model_flops_per_iteration

    return model_flops_per_iteration(parse_args(list(flags)), vocab) / mbs


def flops_per_sequence(a, layers: int) -> float:
    """Megatron's model FLOPs of one sequence, forward and backward, no recompute."""
    return _flops_per_sequence(tuple(gpt_flags(a, layers, 1)), a.vocab, a.micro_batch_size)


def timed_steps(run, a, device, num_mb: int, warmup: int, steps: int, seed0: int) -> dict:
    """warmup + steps steps of ``num_mb`` micro-batches: seconds of each timed step, the
    losses, and (offloaded) the optimizer's update and blocked seconds over the timed
    steps."""
    from megatron_snake.schedule.loss import report_losses
    from megatron_snake.training.data import random_microbatches

    opt, times, losses = run.optimizer, [], []
    update0 = blocked0 = 0.0
    phases0: dict = {}
    for i in range(warmup + steps):
        mbs = random_microbatches(num_mb, a.micro_batch_size, a.seq, a.vocab,
                                  seed=seed0 + i, device=device)
        sync(device)
        if i == warmup:
            update0, blocked0 = getattr(opt, "update_s", 0.0), getattr(opt, "blocked_s", 0.0)
            phases0 = dict(getattr(opt, "update_phase_s", {}))
            traffic0 = run.tensor_store.copies.traffic.snapshot() \
                if getattr(run, "tensor_store", None) is not None else None
        t0 = time.perf_counter()
        out = run.step(mbs)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if out.reports:
            losses.append(float(torch.stack(report_losses(out.reports)).mean()))
    result = {"step_s": times, "losses": losses}
    if hasattr(opt, "update_s"):   # before the run's end applies what is still deferred
        update, blocked = opt.update_s - update0, opt.blocked_s - blocked0
        result.update(update_s=update, blocked_s=blocked,
                      hidden_share=1.0 - blocked / max(update, 1e-9),
                      update_phase_s={name: s - phases0.get(name, 0.0)
                                      for name, s in opt.update_phase_s.items()},
                      optimizer_threads=opt.threads)
    if getattr(run, "tensor_store", None) is not None and steps:
        # host memory read and written per parameter of this rank per timed step, by pass
        result["host_bytes_per_param_step"] = run.tensor_store.copies.traffic.per_parameter_step(
            traffic0, sum(lay.numel for lay in opt.layouts.values()), steps)
    return result


def host_bytes(r: dict) -> str:
    """The offloaded run's host memory traffic per parameter per timed step, by pass."""
    from megatron_snake.storage.copies import describe_per_parameter
    per = r.get("host_bytes_per_param_step")
    return f"; host memory {describe_per_parameter(per)}" if per else ""


def figures(a, layers: int, num_mb: int, r: dict) -> dict:
    """tokens/s and model TFLOP/s per GPU of the median timed step."""
    step = statistics.median(r["step_s"])
    tokens = num_mb * a.micro_batch_size * a.seq
    r.update(median_step_s=step, tokens_per_s=tokens / step,
             tflops_per_gpu=flops_per_sequence(a, layers) * num_mb * a.micro_batch_size
             / step / 1e12)
    return r


def set_recompute(config, mode: str) -> None:
    """Megatron's full recompute (what ``--recompute-granularity full --recompute-method
    uniform --recompute-num-layers 1`` sets) or none, on the built model's config."""
    full = mode == "full"
    config.recompute_granularity = "full" if full else None
    config.recompute_method = "uniform" if full else None
    config.recompute_num_layers = 1 if full else None


def set_clip(optimizer, clip: float) -> None:
    """Megatron's optimizer reads ``config.clip_grad`` at each step (0: no clipping)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.config.clip_grad = clip


def memory_given(sizing: dict, ratio: float) -> int:
    """The device memory that makes the training state ``ratio`` times it, strictly."""
    return int(sizing["state_bytes"] / ratio * 0.99)


@contextmanager
def device_memory(device, out: dict, given: int | None):
    """Run under ``set_per_process_memory_fraction`` of ``given`` bytes (None: the whole
    device) and record the peak allocation in ``out``; nothing on a CPU."""
    if device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    if given is not None:
        out.update(device_memory_given_bytes=given, memory_fraction=given / total,
                   allocated_before_bytes=torch.cuda.memory_allocated(device))
    torch.cuda.set_per_process_memory_fraction(1.0 if given is None else given / total,
                                               device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def failure(exc: BaseException, ratio: float | None) -> dict:
    """A run that raised: its error, and where the device ran out of memory the figure
    "out of memory at N x" that the summary and the plot show in its place."""
    out = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in str(exc):
        out["figure"] = "out of memory" + ("" if ratio is None else f" at {ratio:g}x")
    return out


def megatron_run(a, device, layers: int, num_mb: int | None, *, modes, clips,
                 probe: bool = False, ratio: float | None = None,
                 sizing: dict | None = None) -> dict:
    """Megatron's own run: without offload and without a limit, or (``ratio``) with
    Megatron-LM's CPU offload of its optimizer (``CPU_OFFLOAD_FLAGS``, full recompute: its
    activations are what is left on the device) under the memory fraction that makes the
    state ``ratio`` times the memory given, as the offloaded run gets. The probe (full
    recompute, M = --probe-mb) when asked, then at ``num_mb`` (None: chosen from the probe
    by ``a.choose_m``) each clip of ``clips`` with each mode of ``modes``, on one build: the
    clip and the recompute are fields of the optimizer's and the model's configs."""
    from megatron_snake.models.gpt_units import unwrap_model
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run
    from megatron_snake.training.optimizer import check_cpu_offload_device

    offload = ratio is not None
    out = {"kind": f"cpu_offload_{ratio:g}x" if offload else "megatron",
           "system": "cpu_offload" if offload else "megatron", "micro_batches": num_mb,
           "state_ratio_asked": ratio, "clips": list(clips), "modes_asked": list(modes),
           "modes": {}, "by_clip": {}}
    flags = gpt_flags(a, layers, num_mb or a.probe_mb, clips[0])
    given = None
    if offload:
        try:
            check_cpu_offload_device(device.type)
        except ValueError as exc:
            out["figure"] = f"not run: {exc}"
            return out
        flags += CPU_OFFLOAD_FLAGS
        given = memory_given(sizing, ratio)
        out["state_ratio"] = sizing["state_bytes"] / given
    out["flags"] = flags
    t0 = time.perf_counter()
    try:
        with device_memory(device, out, given):
            args = parse_args(flags)
            with build_run(args, device, a.vocab, log=lambda line: None) as run:
                out["build_s"] = time.perf_counter() - t0
                config = unwrap_model(run.model).config
                if probe:
                    set_recompute(config, "full")
                    p = timed_steps(run, a, device, a.probe_mb, 1, 1, seed0=100)
                    out["probe"] = {"micro_batches": a.probe_mb, "step_s": p["step_s"][0],
                                    "per_micro_batch_s": p["step_s"][0] / a.probe_mb}
                if num_mb is None:
                    num_mb = a.choose_m(out["probe"]["per_micro_batch_s"])
                out["micro_batches"] = num_mb
                for clip in clips:
                    set_clip(run.optimizer, clip)
                    by_mode = out["by_clip"].setdefault(f"{clip:g}", {})
                    for mode in modes:
                        set_recompute(config, mode)
                        r = timed_steps(run, a, device, num_mb, a.warmup, a.steps, seed0=0)
                        by_mode[mode] = figures(a, layers, num_mb, r)
                set_recompute(config, "none")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - recorded with what came before
        out.update(failure(exc, ratio))
    out["modes"] = out["by_clip"].get(f"{clips[0]:g}", {})
    out["trained"] = any(m.get("losses") and all(map(math.isfinite, m["losses"]))
                         for by_mode in out["by_clip"].values() for m in by_mode.values())
    return out


def offloaded_run(a, device, layers: int, num_mb: int, ratio: float, sizing: dict,
                  root: str, clip: float, warmup: int | None = None,
                  steps: int | None = None) -> dict:
    """--snake-offload under a memory fraction giving state / memory given = ratio;
    ``warmup`` and ``steps`` default to --warmup and --steps."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run

    out = {"kind": f"offloaded_{ratio:g}x", "system": "offloaded",
           "state_ratio_asked": ratio, "micro_batches": num_mb, "clip_grad": clip}
    given = memory_given(sizing, ratio) if device.type == "cuda" else None
    if given is not None:
        out["state_ratio"] = sizing["state_bytes"] / given
    host = host_limit_bytes(a, sizing, num_mb)
    flags = offload_flags(a, layers, num_mb, given, host, root, clip)
    out["flags"] = flags
    t0 = time.perf_counter()
    try:
        with device_memory(device, out, given):
            args = parse_args(flags)
            with build_run(args, device, a.vocab, log=lambda line: None) as run:
                try:
                    out["build_s"] = time.perf_counter() - t0
                    r = timed_steps(run, a, device, num_mb,
                                    a.warmup if warmup is None else warmup,
                                    a.steps if steps is None else steps, seed0=0)
                    out.update(figures(a, layers, num_mb, r))
                finally:
                    release_gradient_hooks(run.model)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - recorded with what came before
        out.update(failure(exc, ratio))
    out["trained"] = bool(out.get("losses")) and all(map(math.isfinite, out["losses"]))
    return out


def release_gradient_hooks(model) -> None:
    """Drop the offloaded weights' post-accumulate-grad hooks. Each holds the run's
    OffloadedUnits (and through it the store, the optimizer and the device tensors) from
    the parameter's C++ side, a cycle Python's collector cannot see: without this, an
    offloaded run's device memory stays allocated until the process ends, and the next run
    under a smaller memory fraction starts out of memory."""
    for p in model.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            hooks.clear()


# --- the saturating batch ---------------------------------------------------------------
def calibrate(a, device, sizing: dict) -> dict:
    """The per-step state times of the offloaded run: the update (the CPU AdamW over every
    parameter, until ``probe_update`` measures the run's own) and the host link's bytes
    (weights read in both sweeps, fp32 gradients written back)."""
    from megatron_snake.training.calibration import adamw_rate, copy_rate

    numel = (32 << 20) if device.type == "cuda" else (1 << 20)
    adamw = adamw_rate(numel)
    link = copy_rate(256 << 20 if device.type == "cuda" else 16 << 20,
                     device if device.type == "cuda" else None)
    n = sizing["params"]
    elem = 2 if a.bf16 else 4
    adamw_s = n / adamw
    link_s = max(2 * elem * n, 4 * n) / link
    return {"adamw_params_per_s": adamw, "link_bytes_per_s": link, "adamw_s": adamw_s,
            "link_s": link_s, "update_s": adamw_s, "state_s": max(adamw_s, link_s)}


def probe_update(a, device, layers: int, sizing: dict, root: str, calib: dict) -> dict:
    """The offloaded run's own update seconds per step (a short run at the first state
    ratio and clip): it replaces the AdamW's alone in ``calib``."""
    r = offloaded_run(a, device, layers, a.probe_mb, a.state_ratios[0], sizing, root,
                      a.clip_grads[0], warmup=1, steps=1)
    probe = {"micro_batches": a.probe_mb, "update_s": r.get("update_s"),
             "step_s": (r.get("step_s") or [None])[0], "error": r.get("error")}
    if r.get("update_s"):
        calib["update_s"] = r["update_s"]
        calib["state_s"] = max(calib["link_s"], r["update_s"])
    return probe


def saturating_m(a, update_s: float, link_s: float, per_mb_s: float, *,
                 clipped: bool) -> tuple[int, dict]:
    """The fewest micro-batches whose device work hides the offloaded run's state time,
    with --margin: M = ceil(margin x max(link_s, update_s / share) / c), c Megatron's
    full-recompute step per micro-batch (the vertical schedule's device work is the same),
    at most what --max-step-s and --max-micro-batches allow, at least --min-micro-batches.

    The host link's copies (weights in both sweeps, gradients back) spread over the whole
    step. The update does not, with clipping: it needs the step's global gradient norm,
    known only at the step boundary, so all of it is deferred to the next forward sweep,
    where each unit's update must end before its forward reads the new weights. It hides
    behind the forward sweep alone, share = FORWARD_SHARE (a quarter of the step with full
    recompute). Without clipping (and where a speculative update holds, the norm within
    the clip) each unit's update starts when its gradient is final, in the backward sweep,
    and only its alpha share waits for the next forward sweep: it hides behind the whole
    step, share = 1."""
    share = FORWARD_SHARE if clipped else 1.0
    need_s = max(link_s, update_s / share)
    want = math.ceil(a.margin * need_s / max(per_mb_s, 1e-9))
    cap = max(a.min_micro_batches, int(a.max_step_s / max(per_mb_s, 1e-9)))
    m = max(a.min_micro_batches, min(want, cap, a.max_micro_batches))
    return m, {"wanted": want, "time_cap": cap, "chosen": m, "clipped": clipped,
               "hidden_behind_share": share, "state_s": need_s}


# --- the trace of one steady step --------------------------------------------------------
def trace(a, device) -> int:
    """One steady offloaded step at the headline's M, state ratio and clip (the first of
    --state-ratios and --clip-grads), through gpu_trace."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gpu_trace
    from megatron_snake.training import distributed
    from megatron_snake.training.arguments import parse_args

    src = {}
    if a.from_json and os.path.exists(a.from_json[0]):
        with open(a.from_json[0]) as f:
            src = json.load(f)
    sizing = src.get("sizing") or size_model(a, torch.cuda.get_device_properties(device)
                                             .total_memory if device.type == "cuda" else None)
    layers = sizing["layers"]
    num_mb = a.micro_batches or src.get("micro_batches") or a.trace_default_mb
    ratio = a.state_ratios[0]
    os.makedirs(a.trace_dir, exist_ok=True)
    root = a.dir or tempfile.mkdtemp(prefix="bench_headline_")
    os.makedirs(root, exist_ok=True)
    given = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        given = memory_given(sizing, ratio)
        torch.cuda.set_per_process_memory_fraction(given / total, device)
    args = parse_args(offload_flags(a, layers, num_mb, given,
                                    host_limit_bytes(a, sizing, num_mb), root,
                                    a.clip_grads[0]))
    print(f"> trace: {layers} layers, {sizing['params'] / 1e9:.2f}B parameters, M {num_mb}, "
          f"state {ratio:g}x the memory given"
          + ("" if given is None else f" ({given / 2**30:.2f} GiB)"), flush=True)
    distributed.initialize(device=device, seed=1234)
    path = os.path.join(a.trace_dir, "trace.json.gz")
    ns = argparse.Namespace(warmup=a.warmup, vocab=a.vocab, no_all_threads=False)
    try:
        info = gpu_trace.record_step(ns, args, device, path)
    finally:
        distributed.shutdown()
    r = gpu_trace.analyse(gpu_trace.load_trace(path), a.gap_ms)
    r["headline"] = {"micro_batches": num_mb, "state_ratio": ratio, "given_bytes": given,
                     "run": {k: v for k, v in info.items() if k != "threads"}}
    gpu_trace.write_json(r, os.path.join(a.trace_dir, "gaps.json"))
    try:
        gpu_trace.plot(r, os.path.join(a.trace_dir, "timeline.png"), 15)
    except Exception as exc:  # noqa: BLE001 - the figures matter more than the picture
        print(f"> no timeline.png: {exc}", flush=True)
    gpu_trace.print_table(r, 15)
    print(gpu_trace.idle_line(r))
    return 0


# --- the comparison ------------------------------------------------------------------------
def series_key(system: str, clip: float, ratio: float | None = None,
               mode: str | None = None) -> str:
    """One line of the curve: a system at one setting (Megatron's recompute mode, or the
    state's ratio to the memory given) and one clip."""
    name = f"megatron_{mode}" if system == "megatron" else f"{system}_{ratio:g}x"
    return f"{name} clip {clip:g}"


def series_label(key: str, short: bool = False) -> str:
    """What a curve line is, in words."""
    name, clip = key.split(" clip ")
    if name.startswith("megatron_"):
        what = ("Megatron, full recompute" if name == "megatron_full"
                else "Megatron, no recompute")
    else:
        system, ratio = name.rsplit("_", 1)
        what = {"offloaded": "ours", "cpu_offload": "Megatron's CPU offload"}[system] + \
            (f" {ratio}" if short else f", state {ratio} the memory given")
    return what + (", no clip" if float(clip) == 0 else f", clip {clip}")


def curve_points(runs: list[dict]) -> dict:
    """Every run's figures by curve line and M: {key: {M: {"figures": [...], "failures":
    [...]}}}; a failure is the run's figure ("out of memory at 3x", "not run: ...") or its
    error."""
    out: dict = {}

    def add(key, m, fig, fail):
        slot = out.setdefault(key, {}).setdefault(m, {"figures": [], "failures": []})
        if fig and fig.get("tokens_per_s"):
            slot["figures"].append(fig)
        else:
            slot["failures"].append(fail or "no figure")

    for r in runs:
        m, system = r.get("micro_batches"), r.get("system")
        if m is None or system is None:
            continue
        fail = r.get("figure") or (f"failed: {r['error'][:160]}" if "error" in r else None)
        if system == "offloaded":
            add(series_key(system, r["clip_grad"], r["state_ratio_asked"]), m, r, fail)
            continue
        for clip in r["clips"]:
            measured = r["by_clip"].get(f"{clip:g}", {})
            for mode in r["modes_asked"]:
                key = series_key(system, clip, r["state_ratio_asked"], mode)
                add(key, m, measured.get(mode), fail)
    return out


def summarize(runs: list[dict], a, m0: int | None) -> dict:
    """Medians over rounds of every curve line at every M, the ratios of ours to each
    baseline at the same M and clip, and the headline's figures at its M and first clip
    (the keys docs and tools read: megatron_full, megatron_none, offloaded_<r>x)."""
    points = curve_points(runs)

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def at(key, m) -> dict:
        slot = points.get(key, {}).get(m, {"figures": [], "failures": []})
        figs = slot["figures"]
        return {"tokens_per_s": med(f["tokens_per_s"] for f in figs),
                "tflops_per_gpu": med(f["tflops_per_gpu"] for f in figs), "runs": len(figs),
                "figure": None if figs else next(iter(slot["failures"]), None)}

    def ratio(mine, base):
        return mine / base if mine and base else None

    c0 = a.clip_grads[0]
    s: dict = {"micro_batches": m0, "clip_grad": c0}
    for mode in MEGATRON_MODES:
        s[f"megatron_{mode}"] = at(series_key("megatron", c0, mode=mode), m0)
    for r in a.state_ratios:
        o = at(series_key("offloaded", c0, r), m0)
        mine = [x for x in runs if x.get("kind") == f"offloaded_{r:g}x"
                and x.get("clip_grad") == c0 and x.get("micro_batches") == m0]
        o.update(hidden_share=med(x.get("hidden_share") for x in mine),
                 trained=any(x.get("trained") for x in mine),
                 errors=[x["error"] for x in mine if "error" in x])
        for mode in MEGATRON_MODES:
            o[f"ratio_vs_megatron_{mode}"] = ratio(o["tokens_per_s"],
                                                   s[f"megatron_{mode}"]["tokens_per_s"])
        s[f"offloaded_{r:g}x"] = o
    for r in a.cpu_offload_ratios:
        c = at(series_key("cpu_offload", c0, r), m0)
        ours = at(series_key("offloaded", c0, r), m0)["tokens_per_s"]
        c["ratio_offloaded_vs_this"] = ratio(ours, c["tokens_per_s"])
        s[f"cpu_offload_{r:g}x"] = c
    s["by_clip"] = {}
    for clip in a.clip_grads:
        ours = at(series_key("offloaded", clip, a.state_ratios[0]), m0)["tokens_per_s"]
        row = {"offloaded": ours}
        for mode in MEGATRON_MODES:
            base = at(series_key("megatron", clip, mode=mode), m0)["tokens_per_s"]
            row[f"megatron_{mode}"] = base
            row[f"ratio_vs_megatron_{mode}"] = ratio(ours, base)
        s["by_clip"][f"{clip:g}"] = row
    s["curve"] = {key: {"label": series_label(key),
                        "points": [{"micro_batches": m, **at(key, m)} for m in sorted(ms)]}
                  for key, ms in points.items()}
    s["curve_ratios"] = {}
    for key in points:
        if not key.startswith("offloaded_"):
            continue
        name, clip = key.split(" clip ")
        for base in (f"megatron_full clip {clip}", f"megatron_none clip {clip}",
                     f"cpu_offload_{name.split('_')[1]} clip {clip}"):
            both = sorted(set(points[key]) & set(points.get(base, {})))
            rs = [{"micro_batches": m,
                   "ratio": ratio(at(key, m)["tokens_per_s"], at(base, m)["tokens_per_s"])}
                  for m in both]
            rs = [x for x in rs if x["ratio"] is not None]
            if rs:
                s["curve_ratios"][f"{key} / {base}"] = rs
    return s


def plan(a, rnd: int, report: dict):
    """The runs of round ``rnd`` in order of value, as (stage, family, kind, M (None: the
    headline's), clip, ratio): the headline pair (Megatron, plain, every clip on one build;
    ours at the first state ratio and clip); Megatron's CPU offload at each of
    --cpu-offload-ratios and ours at the other state ratios; ours at the other clips; then
    the curve: at each other M Megatron and ours, Megatron's CPU offload at the ratios where
    it has not failed yet (its activations do not grow with M), then ours at the other
    clips. A pair swaps places in odd rounds and from one M to the next. A generator: the
    curve reads the headline's M and the failures when it gets there."""
    c0, r0 = a.clip_grads[0], a.state_ratios[0]

    def pair(items, odd):
        return items[::-1] if odd else items

    if "headline" in a.stages:
        yield from pair([("headline", "megatron", "megatron", None, None, None),
                         ("headline", "offloaded", f"offloaded_{r0:g}x", None, c0, r0)],
                        rnd % 2)
    if "cpu_offload" in a.stages:
        for r in a.cpu_offload_ratios:
            yield ("cpu_offload", "cpu_offload", f"cpu_offload_{r:g}x", None, None, r)
        for r in a.state_ratios[1:]:
            yield ("cpu_offload", "offloaded", f"offloaded_{r:g}x", None, c0, r)
    if "clip" in a.stages:
        for clip in a.clip_grads[1:]:
            yield ("clip", "offloaded", f"offloaded_{r0:g}x", None, clip, r0)
    if "curve" not in a.stages:
        return
    ms = [m for m in a.curve if m != report["micro_batches"]]
    for i, m in enumerate(ms):
        yield from pair([("curve", "megatron", "megatron", m, None, None),
                         ("curve", "offloaded", f"offloaded_{r0:g}x", m, c0, r0)],
                        (i + rnd) % 2)
        for r in a.cpu_offload_ratios:
            kind = f"cpu_offload_{r:g}x"
            if not any(x.get("kind") == kind and ("figure" in x or "error" in x)
                       for x in report["runs"]):
                yield ("curve", "cpu_offload", kind, m, None, r)
    for clip in a.clip_grads[1:]:
        for m in ms:
            yield ("curve", "offloaded", f"offloaded_{r0:g}x", m, clip, r0)


def compare(a, device) -> int:
    from megatron_snake.training import distributed

    t_start = time.perf_counter()
    cuda = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    sizing = size_model(a, total)
    layers = sizing["layers"]
    root = a.dir or tempfile.mkdtemp(prefix="bench_headline_")
    os.makedirs(root, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "device_memory_bytes": total, "args": vars(a).copy(), "sizing": sizing,
              "micro_batches": a.micro_batches or None, "saturation": None, "runs": [],
              "summary": None}
    report["args"].pop("choose_m", None)
    print(f"> {report['device']}: {layers} layers ({sizing['rule']}), "
          f"{sizing['params'] / 1e9:.3f}B parameters, training state "
          f"{sizing['state_bytes'] / 1e9:.1f} GB", flush=True)

    def write():
        report["summary"] = summarize(report["runs"], a, report["micro_batches"])
        report["elapsed_s"] = time.perf_counter() - t_start
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    distributed.initialize(device=device, seed=1234)
    calib = calibrate(a, device, sizing)
    report["saturation"] = {"calibration": calib}
    if not a.micro_batches and "headline" in a.stages:   # the headline's M is chosen
        t0 = time.perf_counter()
        probe = probe_update(a, device, layers, sizing, root, calib)
        report["saturation"]["offloaded_probe"] = probe
        write()
        print(f"> probe offloaded ({time.perf_counter() - t0:.0f} s, M {a.probe_mb}): update "
              f"{fmt(probe['update_s'])} s a step, link {calib['link_s']:.3f} s, AdamW alone "
              f"{calib['adamw_s']:.3f} s" + (f"; {probe['error']}" if probe["error"] else ""),
              flush=True)

    def choose_m(per_mb_s):
        """The saturating M for the first clip; the other's is recorded beside it."""
        how = {name: saturating_m(a, calib["update_s"], calib["link_s"], per_mb_s,
                                  clipped=clipped)[1]
               for name, clipped in (("clipped", True), ("unclipped", False))}
        m = how["clipped" if a.clip_grads[0] > 0 else "unclipped"]["chosen"]
        report["saturation"].update(how, chosen=m, per_micro_batch_s=per_mb_s)
        return m

    a.choose_m = choose_m
    durations: dict[str, list[tuple[float, int]]] = {}
    guess = {"megatron": a.guess_megatron_s, "offloaded": a.guess_offloaded_s,
             "cpu_offload": a.guess_cpu_offload_s}

    def estimate(family: str, m: int | None) -> float:
        """The family's longest run so far, scaled up to ``m`` micro-batches (the steps
        grow with M, the build does not: an overestimate), or the guess before one ran."""
        seen = durations.get(family)
        if not seen:
            return guess[family]
        return max(w * max(1.0, (m or mm) / mm) for w, mm in seen)

    def attempt(family: str, kind: str, m: int | None, fn, *, must: bool) -> dict | None:
        need = estimate(family, m)
        elapsed = time.perf_counter() - t_start
        if not must and elapsed + need > a.time_budget:
            print(f"> {kind} at M {m}: skipped ({elapsed:.0f} s gone, about {need:.0f} s "
                  f"needed, budget {a.time_budget:.0f} s)", flush=True)
            return None
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the other runs go on
            r = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        r["wall_s"] = time.perf_counter() - t0
        r["round"] = rnd
        if r.get("micro_batches"):
            durations.setdefault(family, []).append((r["wall_s"], r["micro_batches"]))
        report["runs"].append(r)
        write()
        print_run(r, sizing)
        return r

    rnd = 0
    try:
        for rnd in range(a.rounds):
            ran = 0
            for stage, family, kind, m, clip, ratio in plan(a, rnd, report):
                m = m or report["micro_batches"]
                modes = MEGATRON_MODES if rnd % 2 == 0 else MEGATRON_MODES[::-1]
                if family == "offloaded":
                    fn = functools.partial(offloaded_run, a, device, layers, m, ratio, sizing,
                                           root, clip)
                else:
                    fn = functools.partial(megatron_run, a, device, layers, m,
                                           modes=modes if ratio is None else ("full",),
                                           clips=a.clip_grads, probe=m is None, ratio=ratio,
                                           sizing=sizing)
                # the headline pair always runs in the first round; Megatron's CPU offload
                # off a GPU only records why it cannot run, at no cost
                must = (rnd == 0 and stage == "headline") or \
                    (family == "cpu_offload" and not cuda)
                r = attempt(family, kind, m, fn, must=must)
                if r is None:
                    continue
                ran += 1
                r["stage"] = stage
                if m is None:   # the headline's Megatron run chose M from its probe
                    if not r.get("micro_batches"):
                        raise SystemExit(f"Megatron's run failed: {r.get('error')}")
                    report["micro_batches"] = r["micro_batches"]
            if not ran:
                break
    finally:
        write()
        distributed.shutdown()
        if a.plot:
            draw(report, a.plot)
    print(json.dumps(report, indent=1, default=str))
    print_summary(report["summary"], a)
    return 0


def print_summary(s: dict, a) -> None:
    """The curve, Megatron's CPU offload, each clip, and last the headline's ratios."""
    for key, line in s["curve"].items():
        print(f"{line['label']}: " + "; ".join(
            f"M {p['micro_batches']} " + (f"{p['tokens_per_s']:.0f} tokens/s"
                                          if p["tokens_per_s"] else p["figure"])
            for p in line["points"]))
    for key, rs in s["curve_ratios"].items():
        mine, base = key.split(" / ")
        print(f"ratio {series_label(mine, short=True)} / {series_label(base, short=True)}: "
              + "; ".join(f"M {x['micro_batches']} {x['ratio']:.3f}" for x in rs))
    for r in a.cpu_offload_ratios:
        c = s[f"cpu_offload_{r:g}x"]
        print(f"Megatron's CPU offload, state {r:g}x the memory given: "
              + (f"{c['tokens_per_s']:.0f} tokens/s, {tf(c['tflops_per_gpu'])} TFLOP/s per "
                 f"GPU, ours at {r:g}x / it {fmt(c['ratio_offloaded_vs_this'])}"
                 if c["tokens_per_s"] else c["figure"] or "not run"))
    for clip, row in s["by_clip"].items():
        print(f"clip {clip}: ours ({a.state_ratios[0]:g}x) / Megatron: full recompute "
              f"{fmt(row['ratio_vs_megatron_full'])}, no recompute "
              f"{fmt(row['ratio_vs_megatron_none'])}")
    for r in a.state_ratios:
        o = s[f"offloaded_{r:g}x"]
        print(f"offloaded, state {r:g}x the memory given: "
              + (f"{o['tokens_per_s']:.0f} tokens/s, {tf(o['tflops_per_gpu'])} TFLOP/s per "
                 f"GPU, optimizer hidden {fmt_share(o['hidden_share'])}, / Megatron full "
                 f"recompute {fmt(o['ratio_vs_megatron_full'])}, / no recompute "
                 f"{fmt(o['ratio_vs_megatron_none'])}" if o["tokens_per_s"] else
                 f"no figure ({'; '.join(o['errors']) or o['figure'] or 'not run'})"),
              flush=True)
    for mode in MEGATRON_MODES:
        m = s[f"megatron_{mode}"]
        if m["tokens_per_s"]:
            print(f"Megatron, {'full recompute' if mode == 'full' else 'no recompute'}: "
                  f"{m['tokens_per_s']:.0f} tokens/s, {tf(m['tflops_per_gpu'])} TFLOP/s per GPU")
    head = s[f"offloaded_{a.state_ratios[0]:g}x"]
    print(f"ratio tokens/s offloaded ({a.state_ratios[0]:g}x) / Megatron: full recompute "
          f"{fmt(head['ratio_vs_megatron_full'])}, no recompute "
          f"{fmt(head['ratio_vs_megatron_none'])}")


# --- the plot ------------------------------------------------------------------------------
def plot_curve(report: dict, path: str) -> None:
    """tokens/s over M, one line per system and setting (dashed: no clip), above the ratios
    of ours to each baseline at the same M and clip; lines without a figure at some M are
    named below with why (out of memory at N x, not run: ...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, (top, low) = plt.subplots(2, 1, figsize=(9, 9), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    def style(name: str, clip_off: bool, colours: dict) -> dict:
        """One colour per system and setting (or pair of them); the clip off dashed."""
        colour = colours.setdefault(name, f"C{len(colours) % 10}")
        return {"color": colour, "linestyle": "--" if clip_off else "-", "marker": "o"}

    lines, pairs = {}, {}
    notes, ms = {}, set()
    for key, line in s["curve"].items():
        pts = [p for p in line["points"] if p["tokens_per_s"]]
        ms.update(p["micro_batches"] for p in line["points"])
        if pts:
            top.plot([p["micro_batches"] for p in pts], [p["tokens_per_s"] for p in pts],
                     label=line["label"],
                     **style(key.split(" clip ")[0], key.endswith(" clip 0"), lines))
        for p in line["points"]:
            if not p["tokens_per_s"]:   # once per system and setting, whatever the clip
                what = series_label(key).rsplit(", ", 1)[0]
                notes.setdefault(f"{what}: {p['figure'][:90]}", []).append(p["micro_batches"])
    for key, rs in s["curve_ratios"].items():
        mine, base = key.split(" / ")
        x, y = [r["micro_batches"] for r in rs], [r["ratio"] for r in rs]
        low.plot(x, y, label=f"{series_label(mine, short=True)} / "
                 f"{series_label(base, short=True)}",
                 **style(f"{mine.split(' clip ')[0]}/{base.split(' clip ')[0]}",
                         mine.endswith(" clip 0"), pairs))
        for xi, yi in zip(x, y):
            low.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(0, 5),
                         ha="center", fontsize=7)
    if ms:
        low.set_xticks(sorted(ms))
    low.axhline(1.0, color="grey", linewidth=0.8)
    top.set_ylabel("tokens/s")
    low.set_ylabel("tokens/s, ours / baseline")
    low.set_xlabel("micro-batches per step (M)")
    for ax in (top, low):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    sizing = report["sizing"]
    title = (f"{report['device']}: {sizing['layers']}-layer GPT, {sizing['params'] / 1e9:.2f}B "
             f"parameters, training state {sizing['state_bytes'] / 1e9:.1f} GB")
    if report["device"] == "cpu":
        title += "\nCPU smoke test: not a measurement"
    fig.suptitle(title, fontsize=10)
    notes = [f"M {', '.join(map(str, sorted(set(m))))}, {text}" for text, m in notes.items()][:10]
    if notes:
        fig.text(0.01, 0.005, "\n".join(notes), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.015 * len(notes), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merged(paths: list[str]) -> dict:
    """Earlier runs' JSONs as one report: the first's model, M and settings, and every run
    of each, summarized again (the curve's second call adds its M to the headline's)."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    report = dict(reports[0], runs=[r for rep in reports for r in rep["runs"]])
    if len(reports) > 1:
        report["summary"] = summarize(report["runs"], argparse.Namespace(**report["args"]),
                                      report["micro_batches"])
    return report


def draw(report: dict, path: str) -> None:
    try:
        plot_curve(report, path)
        print(f"> plot: {path}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the figures matter more than the picture
        print(f"> no plot: {type(exc).__name__}: {exc}", flush=True)


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def fmt_share(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def tf(x: float) -> str:
    """TFLOP/s: one decimal, significant digits below 0.1 (a CPU smoke test's)."""
    return f"{x:.1f}" if x >= 0.1 or x == 0 else f"{x:.2g}"


def print_run(r: dict, sizing: dict) -> None:
    head = f"> round {r['round']} {r['kind']:16s} ({r['wall_s']:.0f} s"
    if "tokens_per_s" not in r and not any(r.get("by_clip", {}).values()):
        why = r.get("figure") or f"FAILED {r.get('error', '')[:300]}"
        print(f"{head}, M {r.get('micro_batches')}): {why}", flush=True)
        return
    head += f", build {r.get('build_s', 0):.1f} s, M {r.get('micro_batches')})"
    given = r.get("device_memory_given_bytes")
    memory = (f" peak {r.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB"
              + ("" if given is None else f" of {given / 2**30:.2f} given (state "
                 f"{r['state_ratio']:.2f}x)"))
    if "by_clip" in r:
        probe = r.get("probe")
        if probe:
            head += f" probe {probe['per_micro_batch_s'] * 1e3:.0f} ms per micro-batch;"
        for clip, by_mode in r["by_clip"].items():
            for mode, m in by_mode.items():
                head += (f" clip {clip} {mode}: {m['tokens_per_s']:.0f} tokens/s "
                         f"{tf(m['tflops_per_gpu'])} TFLOP/s;")
        print(head + memory + (f"; then {r['error'][:200]}" if "error" in r else ""),
              flush=True)
        return
    print(f"{head} clip {r['clip_grad']:g}: {r['tokens_per_s']:.0f} tokens/s "
          f"{tf(r['tflops_per_gpu'])} TFLOP/s, optimizer hidden "
          f"{fmt_share(r.get('hidden_share'))},{memory}, losses "
          f"{[round(x, 3) for x in r['losses']]}" + update_phases(r) + host_bytes(r),
          flush=True)


def update_phases(r: dict) -> str:
    """The timed steps' update seconds a step, by phase, and the optimizer's threads."""
    phases, steps = r.get("update_phase_s"), len(r.get("step_s", ())) or 1
    if not phases:
        return ""
    return (f"; update {r['update_s'] / steps:.3f} s a step on {r['optimizer_threads']} "
            "threads (" + ", ".join(f"{k} {v / steps:.3f}" for k, v in phases.items()) + ")")


class OneLineParser(argparse.ArgumentParser):
    """A refused flag is one line naming it, without argparse's usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bench_headline.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--layers", type=int, default=0, help="default: sized by device memory")
    p.add_argument("--max-layers", type=int, default=32)
    p.add_argument("--memory-share", type=float, default=0.45,
                   help="of the device's memory, for Megatron's run without recompute")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for cuda, off (fp32) for cpu")
    p.add_argument("--micro-batches", type=int, default=0,
                   help="the headline's M per step (default: the saturating batch, from a "
                        "probe)")
    p.add_argument("--curve", default="3,6,9,12,18",
                   help="more M per step, comma-separated, for the curve (off: the "
                        "headline's M only)")
    p.add_argument("--clip-grads", default="1.0,0",
                   help="--clip-grad values, comma-separated, the headline's first (0: off)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help="what to run, in this order of value: " + ", ".join(STAGES))
    p.add_argument("--probe-mb", type=int, default=2, help="M of the probe step")
    p.add_argument("--margin", type=float, default=1.25,
                   help="compute / state time at the saturating batch")
    p.add_argument("--min-micro-batches", type=int, default=2)
    p.add_argument("--max-micro-batches", type=int, default=32)
    p.add_argument("--max-step-s", type=float, default=3.0,
                   help="cap on M: Megatron's full-recompute step at most this long")
    p.add_argument("--state-ratios", type=float, nargs="+", default=[3.0, 2.0],
                   help="training state / device memory given, one offloaded run each; the "
                        "first is the headline's")
    p.add_argument("--cpu-offload-ratios", type=float, nargs="*", default=[2.0, 3.0],
                   help="the same for Megatron's CPU offload of its optimizer (none: not run)")
    p.add_argument("--limit-share", type=float, default=0.5,
                   help="--snake-gpu-memory-limit as a share of the memory given (0: none)")
    p.add_argument("--headroom-gib", type=float, default=1.75,
                   help="memory given kept out of --snake-gpu-memory-limit")
    p.add_argument("--snake-flags", default="--snake-param-tier host --snake-optimizer-tier "
                   "host --snake-activation-tier host",
                   help="more pretrain_gpt flags for the offloaded runs")
    p.add_argument("--optimizer-threads", type=int, default=0,
                   help="--snake-optimizer-threads of the offloaded runs (default: its own)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run and mode")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run and mode")
    p.add_argument("--rounds", type=int, default=3, help="at most, within --time-budget")
    p.add_argument("--time-budget", type=float, default=280.0,
                   help="seconds: a run starts only if it should end within them")
    p.add_argument("--guess-megatron-s", type=float, default=45.0,
                   help="a Megatron run's seconds before one has been timed")
    p.add_argument("--guess-offloaded-s", type=float, default=60.0,
                   help="an offloaded run's seconds before one has been timed")
    p.add_argument("--guess-cpu-offload-s", type=float, default=60.0,
                   help="a run of Megatron's CPU offload's seconds before one has been timed")
    p.add_argument("--json-out", default="bench_headline.json")
    p.add_argument("--plot", default=None,
                   help="draw tokens/s over M and the ratios into this PNG (with --from: "
                        "from that JSON, no training)")
    g = p.add_argument_group("the trace (--trace-dir)")
    g.add_argument("--trace-dir", default=None,
                   help="record one steady offloaded step into this directory instead")
    g.add_argument("--from", dest="from_json", nargs="+", default=None,
                   help="the headline's JSON: its model and M (--trace-dir), or its figures "
                        "(--plot: several are drawn as one run)")
    g.add_argument("--trace-default-mb", type=int, default=8,
                   help="M when neither --micro-batches nor --from gives one")
    g.add_argument("--gap-ms", type=float, default=1.0)
    return p


def numbers(p, flag: str, text: str, kind, low: float) -> list:
    """A comma-separated flag's values, each ``kind`` and at least ``low``, distinct."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag}: {text!r} is not a comma-separated list of {kind.__name__} values")
    if not values or len(set(values)) < len(values) or \
            not all(math.isfinite(v) and v >= low for v in values):
        p.error(f"{flag}: {text!r}: give distinct values, each at least {low:g}")
    return values


def parse(argv=None) -> argparse.Namespace:
    """The flags, each list checked, with one line naming the flag at fault."""
    p = parser()
    a = p.parse_args(argv)
    a.curve = [] if a.curve.strip().lower() == "off" else \
        numbers(p, "--curve", a.curve, int, 1)
    a.clip_grads = numbers(p, "--clip-grads", a.clip_grads, float, 0)
    a.stages = [x.strip() for x in a.stages.split(",") if x.strip()]
    if not a.stages or not set(a.stages) <= set(STAGES):
        p.error(f"--stages: give some of {', '.join(STAGES)}, comma-separated")
    for flag in ("--state-ratios", "--cpu-offload-ratios"):
        values = getattr(a, flag[2:].replace("-", "_"))
        if not all(math.isfinite(v) and v > 0 for v in values):
            p.error(f"{flag}: each must be a number > 0, got {values}")
    if "--clip-grad" in a.snake_flags.split():
        p.error("--snake-flags: give the clip with --clip-grads (each run sets --clip-grad)")
    if "headline" not in a.stages and not a.micro_batches and \
            {"cpu_offload", "clip"} & set(a.stages):
        p.error("--stages: without headline, cpu_offload and clip need --micro-batches (the "
                "headline's M)")
    if a.from_json and not (a.trace_dir or a.plot):
        p.error("--from: reads a headline JSON for --trace-dir or --plot; add one")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.plot and a.from_json and not a.trace_dir:   # a plot of earlier runs
        plot_curve(merged(a.from_json), a.plot)
        print(f"> plot: {a.plot}")
        return 0
    from megatron_snake.training import distributed

    device = distributed.resolve_device(a.device)
    if a.bf16 is None:
        a.bf16 = device.type == "cuda"
    if a.trace_dir:
        return trace(a, device)
    return compare(a, device)


if __name__ == "__main__":
    sys.exit(main())
