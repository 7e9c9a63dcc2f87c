"""The headline: offloaded training of a GPT whose training state is >= 3x (and >= 10x) the
GPU memory it is given, against Megatron training the same GPT without offload and without
a limit, with Megatron's full recompute and without recompute.

Every run is the one pretrain_gpt builds (``build_run``), on random tokens, in this process:

* **Megatron** (no ``--snake-offload``, no memory limit): Megatron's DDP, optimizer and
  schedule, stepped with full recompute (``recompute_granularity full``, method
  ``uniform``, one layer per checkpoint: what ``--recompute-granularity full
  --recompute-method uniform --recompute-num-layers 1`` sets) and without recompute, on the
  same built model (the config's recompute fields are switched between the two).
* **offloaded** (``--snake-offload``), under ``torch.cuda.set_per_process_memory_fraction``
  so that the training state (bf16 weights 2 + fp32 gradient 4 + fp32 master weights and
  Adam moments 12 bytes per parameter) is ``--state-ratios`` (3 and 10) times the memory
  given; ``--snake-gpu-memory-limit`` tells the run half of that memory, at most all but
  1.75 GiB (units pinned on the device within it; the rest is left for the activations
  inside a unit, attention's scores without flash attention and the logits' fp32 copies),
  and is left out where that is under 1 GiB.
  Weights, optimizer state and unit inputs on the host tier by default (``--snake-flags``):
  this VM's drive moves 2-3 GB/s, which no batch that fits the time box would hide.

The runs alternate: Megatron then offloaded 3x, the next round offloaded 3x then Megatron,
offloaded 10x last in each, for as many rounds as ``--time-budget`` allows (the first
round's pair always runs; the JSON is written after every run, so a run cut short keeps
what came before it). Figures per run:
tokens/s and model TFLOP/s per GPU by Megatron's formula (``model_flops_per_iteration``:
Megatron-LM 0.16.1's ``num_floating_point_operations``, recompute not counted as useful
work) over the timed steps, the device's peak allocation, and for the offloaded runs the
share of the optimizer's update time hidden behind compute (1 - time the step waited for an
update / time the updates took). The summary takes the median over rounds; the ratios are
offloaded tokens/s / Megatron's, with full recompute and without.

The batch: the saturating one (``saturating_m``), the fewest micro-batches whose compute
hides the state's per-step time: the host link's bytes (weights in both sweeps, fp32
gradients back, at the measured pinned copy rate) behind the whole step, and the offloaded
run's own update (a probe: an offloaded run at 3x of --probe-mb micro-batches, one warm-up
and one timed step) behind the forward sweep alone, as these runs clip (a quarter of the
step); c is Megatron's step with full recompute per micro-batch (a probe step on its run
first); at most what fits ``--max-step-s`` per Megatron step. The update is measured, not
taken from ``calibration.adamw_rate``: on an H200 the fused AdamW alone ran at 4.2G
parameters/s (on every core), the run's update (unscale and clip, AdamW, the new bf16
weights) at 1.3G, and the M chosen from the former left the optimizer exposed. ``--micro-batches`` sets M
instead (no probe).

The model (``size_model``): hidden 2048, 16 heads, sequence 2048, micro-batch 1, vocabulary
32768, bf16, untied embeddings; the most layers (a multiple of 4, at most ``--max-layers``
32) for which Megatron's run without recompute (18 bytes of state per parameter, the
activations of one micro-batch kept whole: s*b*h*(34 + 5*a*s/h) bytes a layer, three fp32
copies of the logits) fits in ``--memory-share`` (0.45) of the device's memory. An H100
(79.2 GiB) gets 24 layers (1.34B parameters, 24.1 GB of state: 8.0 GB given at 3x, 2.4 GB
at 10x), an H200 (139.8 GiB) 32 (1.74B, 31.3 GB). The cap keeps a round (three builds,
4 steps a mode) near 70 s on an H100 (the 24-layer Megatron step of 16 sequences with full
recompute took 2.1 s there, 2026-11-23), so two or three rounds fit the 290 s budget
tools/gpu_check.sh gives it.

``--trace-dir DIR``: instead, record one steady step of the offloaded run at the headline's
batch and 3x memory fraction (read from ``--from`` the headline's JSON) with
``tools/gpu_trace.py``'s profiler and analysis: DIR/trace.json.gz, gaps.json (the GPU's
idle share and every gap over ``--gap-ms`` with what the host did), timeline.png; the last
line is ``gpu idle fraction: X (no kernel running: Y)``.

``--device cpu`` (the default without CUDA) runs the same code on tiny sizes as a smoke
test (no memory fraction: a CPU has none), e.g. ``tools/gpu_check.sh``'s dry run:

    python tools/bench_headline.py --dir /nvme/scratch --json-out headline.json   # GPU
    python tools/bench_headline.py --dir /nvme/scratch --trace-dir trace --from headline.json
    python tools/bench_headline.py --device cpu --layers 2 --hidden 64 --heads 4 --seq 64 \\
        --vocab 1024 --micro-batches 2 --json-out /tmp/h.json                        # smoke

Prints one line per run, the JSON, and last ``ratio tokens/s offloaded (3x) / Megatron:
full recompute R1, no recompute R2``.
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
# The share of a full-recompute step's device work in its forward sweep: a forward of the
# four a micro-batch costs (the forward, then in the backward sweep the recompute and the
# backward, twice a forward: the activations' and the weights' gradients)
FORWARD_SHARE = 0.25


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


def gpt_flags(a, layers: int, num_mb: int) -> list[str]:
    flags = ["--num-layers", str(layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
             "--max-position-embeddings", str(a.seq),
             "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.micro_batch_size * num_mb),
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--untie-embeddings-and-output-weights", "--seed", "1234"]
    return flags + (["--bf16"] if a.bf16 else [])


def offload_flags(a, layers: int, num_mb: int, given: int | None, host_limit: int,
                  root: str) -> list[str]:
    flags = gpt_flags(a, layers, num_mb) + [
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
    return result


def figures(a, layers: int, num_mb: int, r: dict) -> dict:
    """tokens/s and model TFLOP/s per GPU of the median timed step."""
    step = statistics.median(r["step_s"])
    tokens = num_mb * a.micro_batch_size * a.seq
    r.update(median_step_s=step, tokens_per_s=tokens / step,
             tflops_per_gpu=flops_per_sequence(a, layers) * num_mb * a.micro_batch_size
             / step / 1e12)
    return r


def megatron_run(a, device, layers: int, num_mb: int | None, modes, probe: bool) -> dict:
    """Megatron without offload, no limit: the probe (full recompute, M = --probe-mb) when
    asked, then ``modes`` in order at ``num_mb`` (None: chosen from the probe by
    ``a.choose_m``)."""
    from megatron_snake.models.gpt_units import unwrap_model
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run

    out = {"kind": "megatron", "modes": {}}
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.reset_peak_memory_stats(device)
    args = parse_args(gpt_flags(a, layers, num_mb or a.probe_mb))
    with build_run(args, device, a.vocab, log=lambda line: None) as run:
        out["build_s"] = time.perf_counter() - t0
        config = unwrap_model(run.model).config

        def recompute(mode):
            full = mode == "full"
            config.recompute_granularity = "full" if full else None
            config.recompute_method = "uniform" if full else None
            config.recompute_num_layers = 1 if full else None

        if probe:
            recompute("full")
            p = timed_steps(run, a, device, a.probe_mb, 1, 1, seed0=100)
            out["probe"] = {"micro_batches": a.probe_mb, "step_s": p["step_s"][0],
                            "per_micro_batch_s": p["step_s"][0] / a.probe_mb}
        if num_mb is None:
            num_mb = a.choose_m(out["probe"]["per_micro_batch_s"])
        out["micro_batches"] = num_mb
        for mode in modes:
            recompute(mode)
            r = timed_steps(run, a, device, num_mb, a.warmup, a.steps, seed0=0)
            out["modes"][mode] = figures(a, layers, num_mb, r)
        recompute("none")
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) \
        if device.type == "cuda" else 0
    return out


def offloaded_run(a, device, layers: int, num_mb: int, ratio: float, sizing: dict,
                  root: str, warmup: int | None = None, steps: int | None = None) -> dict:
    """--snake-offload under a memory fraction giving state / memory given = ratio;
    ``warmup`` and ``steps`` default to --warmup and --steps."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run

    out = {"kind": f"offloaded_{ratio:g}x", "state_ratio_asked": ratio,
           "micro_batches": num_mb}
    given = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        given = int(sizing["state_bytes"] / ratio * 0.99)   # strictly above the ratio
        fraction = given / total
        torch.cuda.empty_cache()
        out.update(device_memory_given_bytes=given, memory_fraction=fraction,
                   state_ratio=sizing["state_bytes"] / given,
                   allocated_before_bytes=torch.cuda.memory_allocated(device))
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        torch.cuda.reset_peak_memory_stats(device)
    host = host_limit_bytes(a, sizing, num_mb)
    flags = offload_flags(a, layers, num_mb, given, host, root)
    out["flags"] = flags
    t0 = time.perf_counter()
    try:
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
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if device.type == "cuda":
            out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
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
    ratio): it replaces the AdamW's alone in ``calib``."""
    r = offloaded_run(a, device, layers, a.probe_mb, a.state_ratios[0], sizing, root,
                      warmup=1, steps=1)
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
    """One steady offloaded step at the headline's M and 3x memory, through gpu_trace."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gpu_trace
    from megatron_snake.training import distributed
    from megatron_snake.training.arguments import parse_args

    src = {}
    if a.from_json and os.path.exists(a.from_json):
        with open(a.from_json) as f:
            src = json.load(f)
    sizing = src.get("sizing") or size_model(a, torch.cuda.get_device_properties(device)
                                             .total_memory if device.type == "cuda" else None)
    layers = sizing["layers"]
    num_mb = a.micro_batches or src.get("micro_batches") or a.trace_default_mb
    ratio = min(a.state_ratios)
    os.makedirs(a.trace_dir, exist_ok=True)
    root = a.dir or tempfile.mkdtemp(prefix="bench_headline_")
    os.makedirs(root, exist_ok=True)
    given = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        given = int(sizing["state_bytes"] / ratio * 0.99)
        torch.cuda.set_per_process_memory_fraction(given / total, device)
    args = parse_args(offload_flags(a, layers, num_mb, given,
                                    host_limit_bytes(a, sizing, num_mb), root))
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
def summarize(runs: list[dict], ratios) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    s = {}
    for mode in MEGATRON_MODES:
        ms = [r["modes"][mode] for r in runs if r["kind"] == "megatron" and mode in r["modes"]]
        s[f"megatron_{mode}"] = {"tokens_per_s": med(m["tokens_per_s"] for m in ms),
                                 "tflops_per_gpu": med(m["tflops_per_gpu"] for m in ms),
                                 "runs": len(ms)}
    for ratio in ratios:
        key = f"offloaded_{ratio:g}x"
        os_ = [r for r in runs if r["kind"] == key and "tokens_per_s" in r]
        s[key] = {"tokens_per_s": med(r["tokens_per_s"] for r in os_),
                  "tflops_per_gpu": med(r["tflops_per_gpu"] for r in os_),
                  "hidden_share": med(r.get("hidden_share") for r in os_),
                  "runs": len(os_), "trained": any(r.get("trained") for r in os_),
                  "errors": [r["error"] for r in runs if r["kind"] == key and "error" in r]}
        for mode in MEGATRON_MODES:
            base = s[f"megatron_{mode}"]["tokens_per_s"]
            mine = s[key]["tokens_per_s"]
            s[key][f"ratio_vs_megatron_{mode}"] = mine / base if base and mine else None
    return s


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
        report["summary"] = summarize(report["runs"], a.state_ratios)
        report["elapsed_s"] = time.perf_counter() - t_start
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    distributed.initialize(device=device, seed=1234)
    calib = calibrate(a, device, sizing)
    report["saturation"] = {"calibration": calib}
    if not a.micro_batches:
        t0 = time.perf_counter()
        probe = probe_update(a, device, layers, sizing, root, calib)
        report["saturation"]["offloaded_probe"] = probe
        write()
        print(f"> probe offloaded ({time.perf_counter() - t0:.0f} s, M {a.probe_mb}): update "
              f"{fmt(probe['update_s'])} s a step, link {calib['link_s']:.3f} s, AdamW alone "
              f"{calib['adamw_s']:.3f} s" + (f"; {probe['error']}" if probe["error"] else ""),
              flush=True)

    def choose_m(per_mb_s):
        """The saturating M of these runs, clipped at --clip-grad's default 1.0; the
        unclipped one is recorded beside it."""
        how = {name: saturating_m(a, calib["update_s"], calib["link_s"], per_mb_s,
                                  clipped=clipped)[1]
               for name, clipped in (("clipped", True), ("unclipped", False))}
        m = how["clipped"]["chosen"]
        report["saturation"].update(how, chosen=m, per_micro_batch_s=per_mb_s)
        return m

    a.choose_m = choose_m
    durations: dict[str, list[float]] = {}
    guess = {"megatron": a.guess_megatron_s, "offloaded": a.guess_offloaded_s}

    def attempt(kind: str, fn, *, must: bool = False) -> dict | None:
        family = kind.split("_")[0]
        estimate = max(durations.get(family, [guess[family]]))
        elapsed = time.perf_counter() - t_start
        if not must and elapsed + estimate > a.time_budget:
            print(f"> {kind}: skipped ({elapsed:.0f} s gone, about {estimate:.0f} s needed, "
                  f"budget {a.time_budget:.0f} s)", flush=True)
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
        durations.setdefault(family, []).append(r["wall_s"])
        report["runs"].append(r)
        write()
        print_run(r, sizing)
        return r

    num_mb = a.micro_batches or None
    rnd = 0
    try:
        for rnd in range(a.rounds):
            # Megatron and the first offloaded run (the headline pair) swap places each
            # round; the other offloaded runs come last. In the first round the pair always
            # runs; every other run only while --time-budget allows it.
            pair = [("megatron", None), (f"offloaded_{a.state_ratios[0]:g}x",
                                         a.state_ratios[0])]
            order = (pair if rnd % 2 == 0 else pair[::-1]) + \
                [(f"offloaded_{ratio:g}x", ratio) for ratio in a.state_ratios[1:]]
            ran = 0
            for kind, ratio in order:
                if ratio is None:
                    modes = MEGATRON_MODES if rnd % 2 == 0 else MEGATRON_MODES[::-1]
                    fn = (lambda modes=modes: megatron_run(a, device, layers, num_mb, modes,
                                                           probe=num_mb is None))
                else:
                    fn = (lambda ratio=ratio: offloaded_run(a, device, layers, num_mb, ratio,
                                                            sizing, root))
                r = attempt(kind, fn, must=rnd == 0 and (kind, ratio) in pair)
                if r is None:
                    continue
                ran += 1
                if kind == "megatron" and r.get("micro_batches"):
                    num_mb = report["micro_batches"] = r["micro_batches"]
                elif kind == "megatron" and num_mb is None:
                    raise SystemExit(f"Megatron's run failed: {r.get('error')}")
            if not ran:
                break
    finally:
        write()
        distributed.shutdown()
    s = report["summary"]
    print(json.dumps(report, indent=1, default=str))
    head = s.get(f"offloaded_{min(a.state_ratios):g}x", {})
    for ratio in a.state_ratios:
        o = s[f"offloaded_{ratio:g}x"]
        print(f"offloaded, state {ratio:g}x the memory given: "
              + (f"{o['tokens_per_s']:.0f} tokens/s, {tf(o['tflops_per_gpu'])} TFLOP/s per "
                 f"GPU, optimizer hidden {o['hidden_share']:.1%}, / Megatron full recompute "
                 f"{fmt(o['ratio_vs_megatron_full'])}, / no recompute "
                 f"{fmt(o['ratio_vs_megatron_none'])}" if o["tokens_per_s"] else
                 f"no figure ({'; '.join(o['errors']) or 'not run'})"), flush=True)
    for mode in MEGATRON_MODES:
        m = s[f"megatron_{mode}"]
        if m["tokens_per_s"]:
            print(f"Megatron, {'full recompute' if mode == 'full' else 'no recompute'}: "
                  f"{m['tokens_per_s']:.0f} tokens/s, {tf(m['tflops_per_gpu'])} TFLOP/s per GPU")
    print(f"ratio tokens/s offloaded ({min(a.state_ratios):g}x) / Megatron: full recompute "
          f"{fmt(head.get('ratio_vs_megatron_full'))}, no recompute "
          f"{fmt(head.get('ratio_vs_megatron_none'))}")
    return 0


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def tf(x: float) -> str:
    """TFLOP/s: one decimal, significant digits below 0.1 (a CPU smoke test's)."""
    return f"{x:.1f}" if x >= 0.1 or x == 0 else f"{x:.2g}"


def print_run(r: dict, sizing: dict) -> None:
    head = f"> round {r['round']} {r['kind']:14s} ({r['wall_s']:.0f} s"
    if "error" in r:
        print(f"{head}): FAILED {r['error'][:300]}", flush=True)
        return
    head += f", build {r.get('build_s', 0):.1f} s, M {r.get('micro_batches')})"
    if r["kind"] == "megatron":
        probe = r.get("probe")
        if probe:
            head += f" probe {probe['per_micro_batch_s'] * 1e3:.0f} ms per micro-batch;"
        for mode, m in r["modes"].items():
            head += (f" {mode}: {m['tokens_per_s']:.0f} tokens/s "
                     f"{tf(m['tflops_per_gpu'])} TFLOP/s;")
        print(head + f" peak {r['peak_allocated_bytes'] / 2**30:.1f} GiB", flush=True)
        return
    given = r.get("device_memory_given_bytes")
    print(f"{head} {r['tokens_per_s']:.0f} tokens/s {tf(r['tflops_per_gpu'])} TFLOP/s, "
          f"optimizer hidden {r.get('hidden_share', float('nan')):.1%}, peak "
          f"{r.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB"
          + ("" if given is None else f" of {given / 2**30:.2f} given (state "
             f"{r['state_ratio']:.2f}x)") + f", losses {[round(x, 3) for x in r['losses']]}"
          + update_phases(r), flush=True)


def update_phases(r: dict) -> str:
    """The timed steps' update seconds a step, by phase, and the optimizer's threads."""
    phases, steps = r.get("update_phase_s"), len(r.get("step_s", ())) or 1
    if not phases:
        return ""
    return (f"; update {r['update_s'] / steps:.3f} s a step on {r['optimizer_threads']} "
            "threads (" + ", ".join(f"{k} {v / steps:.3f}" for k, v in phases.items()) + ")")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
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
                   help="M per step (default: the saturating batch, from a probe)")
    p.add_argument("--probe-mb", type=int, default=2, help="M of the probe step")
    p.add_argument("--margin", type=float, default=1.25,
                   help="compute / state time at the saturating batch")
    p.add_argument("--min-micro-batches", type=int, default=2)
    p.add_argument("--max-micro-batches", type=int, default=32)
    p.add_argument("--max-step-s", type=float, default=3.0,
                   help="cap on M: Megatron's full-recompute step at most this long")
    p.add_argument("--state-ratios", type=float, nargs="+", default=[3.0, 10.0],
                   help="training state / device memory given, one offloaded run each")
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
    p.add_argument("--json-out", default="bench_headline.json")
    g = p.add_argument_group("the trace (--trace-dir)")
    g.add_argument("--trace-dir", default=None,
                   help="record one steady offloaded step into this directory instead")
    g.add_argument("--from", dest="from_json", default=None,
                   help="the headline's JSON: its model and M")
    g.add_argument("--trace-default-mb", type=int, default=8,
                   help="M when neither --micro-batches nor --from gives one")
    g.add_argument("--gap-ms", type=float, default=1.0)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from megatron_snake.training import distributed

    device = distributed.resolve_device(a.device)
    if a.bf16 is None:
        a.bf16 = device.type == "cuda"
    if a.trace_dir:
        return trace(a, device)
    return compare(a, device)


if __name__ == "__main__":
    sys.exit(main())
