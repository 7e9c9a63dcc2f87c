"""Where the GPU waits in one steady offloaded training step, and what the host does then.

Trains a GPT (about 1B parameters by default: 16 layers, hidden 2048, sequence 2048, 8
micro-batches of 1, bf16) with ``--snake-offload`` (weights, fp32 gradients, master weights
and Adam moments on the nvme tier under ``--dir``), built as ``tools/bench_step.py`` builds
its offloaded run. After ``--warmup`` steps it records ONE step (forward/backward sweeps +
``optimizer.step()`` + a final synchronize) with ``torch.profiler`` (CPU + CUDA) and writes
to ``--out-dir``:

* ``trace.json.gz``: the Chrome trace (open it in Perfetto or chrome://tracing);
* ``gaps.json``: step time, GPU busy time (union of every kernel, memcpy and memset on any
  stream), idle fraction, and every GPU idle gap longer than ``--gap-ms`` inside the step,
  each with what the host threads were doing during it: ``record_function`` annotations
  (the library's ``snake/...`` ranges first when present) and top-level ops, aggregated by
  name, the ones covering most of the gap first;
* ``timeline.png``: a GPU row (busy intervals), one row per host thread with its
  annotations, the gaps shaded and the largest labelled.

It prints the device's time by kind (kernels, each kind of copy with its bytes and rate), the
largest gaps and, last, ``gpu idle fraction: X (no kernel running: Y)``: the share of the
step with no device work at all, and the share with no kernel running (copies alone do not
train).
The default run took about 110 s end to end on an H100 (imports 15 s, building the offloaded
state 12 s, two warm-up steps 37 s, the recorded step 24 s, export + analysis 10 s, with the
pure-Python I/O engine); ``--warmup 1`` saves one step.

    python tools/gpu_trace.py --dir /nvme/scratch --out-dir trace_1b
    python tools/gpu_trace.py --device cpu --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batches 2 --out-dir /tmp/trace_smoke
    python tools/gpu_trace.py --analyze trace_1b/trace.json.gz --out-dir trace_1b_again

On ``--device cpu`` (a smoke test of the whole pipeline) the "device" row is the main
thread's top-level CPU ops and a gap is time the main thread spends outside any op.
Flags this tool does not know go to megatron_snake's own parser (e.g. ``--clip-grad 0``,
``--snake-group-size 4``, ``--snake-checkpoint-interval 2``). ``--analyze`` redoes the
analysis and the plot from a saved trace, without training.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import sys
import threading
import time
import warnings
from collections import defaultdict

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle.*")

import torch  # noqa: E402

STEP_MARK = "gpu_trace/step"          # the recorded step, on the main thread
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
SNAKE = "snake/"


# --- command line --------------------------------------------------------------------
def parse_cli(argv=None):
    """This tool's flags, and the rest (for megatron_snake's parser)."""
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=8, help="M, per step")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary of the random tokens")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for cuda, off (fp32) for cpu")
    p.add_argument("--param-tier", choices=["host", "nvme", "auto"], default="nvme")
    p.add_argument("--optimizer-tier", choices=["host", "nvme", "auto"], default="nvme")
    p.add_argument("--activation-tier", choices=["device", "host", "nvme", "auto"],
                   default="nvme")
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the recorded one")
    p.add_argument("--gap-ms", type=float, default=1.0, help="smallest idle gap reported")
    p.add_argument("--out-dir", default="gpu_trace_out")
    p.add_argument("--top", type=int, default=15, help="gaps printed and labelled")
    p.add_argument("--no-all-threads", action="store_true",
                   help="profile only the threads torch follows by default (the main thread "
                   "and autograd's), not the optimizer worker and the store's threads")
    p.add_argument("--analyze", metavar="TRACE", default=None,
                   help="analyse this saved trace (.json or .json.gz) instead of training")
    return p.parse_known_args(argv)


def megatron_flags(a, extra: list[str]) -> list[str]:
    """megatron_snake flags of the run (``extra`` last, so it overrides)."""
    bf16 = a.bf16 if a.bf16 is not None else a.device == "cuda"
    flags = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
             "--num-attention-heads", str(a.num_attention_heads),
             "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.micro_batch_size * a.micro_batches),
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--untie-embeddings-and-output-weights", "--device", a.device,
             "--snake-offload", "--snake-param-tier", a.param_tier,
             "--snake-optimizer-tier", a.optimizer_tier,
             "--snake-activation-tier", a.activation_tier]
    if a.dir:
        flags += ["--snake-offload-dir", a.dir]
    return flags + (["--bf16"] if bf16 else []) + extra


# --- the recorded step ---------------------------------------------------------------
def profiler_config(all_threads: bool):
    """Kineto options: every thread (the optimizer worker, the store's threads), and no
    Python event objects on exit (the trace is analysed from its JSON). Older torch lacks
    some of them: fall back to what it has."""
    from torch._C._profiler import _ExperimentalConfig

    wanted = dict(profile_all_threads=True) if all_threads else {}
    for kwargs in ({**wanted, "trace_only": True}, wanted, {"trace_only": True}, {}):
        try:
            return _ExperimentalConfig(**kwargs), kwargs
        except TypeError:
            continue
    return None, {}


def thread_names() -> dict[str, str]:
    """Native thread id -> Python thread name, for the threads alive now."""
    return {str(t.native_id): t.name for t in threading.enumerate() if t.native_id}


def record_step(a, args, device, trace_path: str) -> dict:
    """Build the offloaded run, warm it up, record one step into ``trace_path``. Returns
    what the title and gaps.json say about the run."""
    from megatron_snake.training.build import build_run
    from megatron_snake.training.data import random_microbatches

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def step(mbs):
        run.step(mbs)   # annotated snake/forward_backward and snake/optimizer step
        with torch.profiler.record_function("gpu_trace/synchronize"):
            sync()

    t0 = time.perf_counter()
    with build_run(args, device, a.vocab, log=lambda line: print(line, flush=True)) as run:
        state, n_params = run.offloaded, run.n_params
        print(f"> run built in {time.perf_counter() - t0:.1f} s", flush=True)
        warm = []
        for i in range(a.warmup + 1):
            mbs = random_microbatches(args.num_microbatches, args.micro_batch_size,
                                      args.seq_length, a.vocab, seed=i, device=device)
            sync()
            if i < a.warmup:
                t0 = time.perf_counter()
                step(mbs)
                warm.append(time.perf_counter() - t0)
                print(f"> warm-up step {i}: {warm[-1]:.3f} s", flush=True)
        config, used = profiler_config(not a.no_all_threads)
        activities = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities, record_shapes=False,
                                    with_stack=False, experimental_config=config) as prof:
            with torch.profiler.record_function(STEP_MARK):
                t0 = time.perf_counter()
                step(mbs)
                step_s = time.perf_counter() - t0
            info = {"params": n_params, "device": str(device),
                    "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "layers": args.num_layers, "hidden": args.hidden_size,
                    "seq": args.seq_length, "micro_batch_size": args.micro_batch_size,
                    "micro_batches": args.num_microbatches,
                    "dtype": str(args.params_dtype).replace("torch.", ""),
                    "tiers": {"param": state.tiers.params,
                              "optimizer": state.tiers.optimizer,
                              "activation": args.snake_activation_tier},
                    "checkpoint_interval": args.snake_checkpoint_interval,
                    "alpha": args.snake_alpha, "clip_grad": args.clip_grad,
                    "warmup_step_s": warm, "host_step_s": step_s,
                    "profiler_options": sorted(used), "threads": thread_names()}
            try:
                prof.add_metadata_json("gpu_trace", json.dumps(info))
            except (AttributeError, RuntimeError):
                pass   # the analysis falls back to what the trace itself says
        print(f"> recorded step: {step_s:.3f} s on the host clock", flush=True)
        t0 = time.perf_counter()
        prof.export_chrome_trace(trace_path)
        print(f"> trace written in {time.perf_counter() - t0:.1f} s: {trace_path}",
              flush=True)
    return info


# --- reading the trace ---------------------------------------------------------------
def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def complete_events(trace: dict) -> list[dict]:
    """Duration events (``ph: X``) with numeric times; ``ts``/``dur`` in microseconds."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "ts" in e:
            try:
                e["ts"], e["dur"] = float(e["ts"]), float(e.get("dur", 0.0))
            except (TypeError, ValueError):
                continue
            e["cat"] = str(e.get("cat", "")).lower()
            e["thread"] = str(e.get("tid"))
            out.append(e)
    return out


def run_info(trace: dict) -> dict:
    """What record_step stored in the trace's metadata (empty for a foreign trace)."""
    raw = trace.get("gpu_trace")
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}


def trace_thread_names(trace: dict) -> dict[str, str]:
    """tid -> name from the trace's ``thread_name`` metadata events."""
    names = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[str(e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return names


def thread_label(thread: str, names: dict[str, str]) -> str:
    """'snake-adamw_0 (1234)'; kineto's own names already say 'thread 1234 (python)'."""
    name = names.get(thread, "")
    return name if thread in name else f"{name or 'thread'} ({thread})"


def merge(intervals) -> list[list[float]]:
    """Union of [start, end] intervals, sorted."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def top_level(events: list[dict]) -> list[dict]:
    """Events not nested in another of ``events`` on the same thread."""
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e["thread"]].append(e)
    out = []
    for evs in by_thread.values():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def clip(intervals, lo: float, hi: float):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def find_gaps(busy, lo: float, hi: float, min_us: float) -> list[tuple[float, float]]:
    """Idle stretches of [lo, hi] not covered by ``busy`` (merged), at least min_us long."""
    gaps, t = [], lo
    for s, e in busy:
        if s - t >= min_us:
            gaps.append((t, s))
        t = max(t, e)
    if hi - t >= min_us:
        gaps.append((t, hi))
    return gaps


class IntervalIndex:
    """Events of one kind on one thread, for 'which overlap [lo, hi]' queries."""

    def __init__(self, events):
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]
        self.max_end, m = [], float("-inf")
        for e in self.events:
            m = max(m, e["ts"] + e["dur"])
            self.max_end.append(m)

    def overlapping(self, lo: float, hi: float):
        first = bisect.bisect_right(self.max_end, lo)
        last = bisect.bisect_left(self.starts, hi)
        for e in self.events[first:last]:
            if e["ts"] + e["dur"] > lo:
                yield e


def host_events(events, window):
    """The host events a gap is explained by: annotations (not the step mark), top-level
    CPU ops and CUDA runtime/driver calls, per thread, inside the window."""
    lo, hi = window
    inside = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    notes = [e for e in inside if e["cat"] == "user_annotation" and e.get("name") != STEP_MARK]
    ops = top_level([e for e in inside if e["cat"] == "cpu_op"])
    runtime = [e for e in inside if e["cat"] in RUNTIME_CATS]
    return notes, ops, runtime


def issuing_threads(runtime, main: str) -> set[str]:
    """Threads that talk to the GPU (launches, copies, syncs), and the main thread."""
    return {e["thread"] for e in runtime} | {main}


def attribute(gap, indexes, issuing: set[str], names: dict[str, str]) -> list[dict]:
    """Host activity overlapping ``gap``, aggregated per (thread, name): the entries
    covering most of the gap first; among equal cover, threads that issue GPU work, then
    snake/ annotations, then the innermost (shortest) event."""
    lo, hi = gap
    length = hi - lo
    agg = {}
    for (thread, kind), index in indexes.items():
        for e in index.overlapping(lo, hi):
            key = (thread, e.get("name", "?"))
            overlap = min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])
            a = agg.setdefault(key, {"thread": thread, "thread_name": names.get(thread, ""),
                                     "name": key[1], "kind": kind, "overlap_ms": 0.0,
                                     "count": 0, "shortest_ms": float("inf")})
            a["overlap_ms"] += overlap / 1e3
            a["count"] += 1
            a["shortest_ms"] = min(a["shortest_ms"], e["dur"] / 1e3)
    out = []
    for a in agg.values():
        a["cover"] = min(1.0, a["overlap_ms"] * 1e3 / length)
        if a["cover"] >= 0.001:   # not the odd launch or query at the gap's edge
            out.append(a)
    out.sort(key=lambda a: (-round(a["cover"] * 20), a["thread"] not in issuing,
                            not a["name"].startswith(SNAKE), a["shortest_ms"]))
    for a in out:
        a["overlap_ms"], a["shortest_ms"] = round(a["overlap_ms"], 3), round(a["shortest_ms"], 3)
        a["cover"] = round(a["cover"], 3)
    return out


def gap_label(host: list[dict], issuing: set[str]) -> str:
    """One line: the first entry, and when it is an annotation the op under it on the
    same thread that covers at least half the gap."""
    if not host:
        return "(no traced host event: Python or untraced native code)"
    first = host[0]
    label = first["name"] + (f" x{first['count']}" if first["count"] > 1 else "")
    if first["thread"] not in issuing:
        label += f" [{first['thread_name'] or 'thread ' + first['thread']}]"
    if first["kind"] == "annotation":
        under = next((h for h in host[1:] if h["thread"] == first["thread"] and
                      h["kind"] != "annotation" and h["cover"] >= 0.5), None)
        if under:
            label += " > " + under["name"] + (f" x{under['count']}" if under["count"] > 1
                                              else "")
        else:
            label += " > (no traced op on this thread: Python or an untraced wait)"
    return label


def analyse(trace: dict, gap_ms: float) -> dict:
    """Step window, device busy intervals, idle gaps and their host activity."""
    events = complete_events(trace)
    marks = [e for e in events if e.get("name") == STEP_MARK]
    if not marks:
        raise SystemExit(f"no '{STEP_MARK}' range in the trace: was it written by this tool?")
    mark = max(marks, key=lambda e: e["dur"])
    main = mark["thread"]
    device_events = [e for e in events if e["cat"] in DEVICE_CATS]
    cpu_mode = not device_events
    lo = mark["ts"]
    hi = max([lo + mark["dur"]] + [e["ts"] + e["dur"] for e in device_events
                                   if lo <= e["ts"] <= lo + mark["dur"]])
    if cpu_mode:   # the main thread's top-level ops play the device
        device_events = top_level([e for e in events if e["cat"] == "cpu_op" and
                                   e["thread"] == main])
    busy = merge(clip([(e["ts"], e["ts"] + e["dur"]) for e in device_events], lo, hi))
    busy_us = sum(e - s for s, e in busy)
    per_stream = defaultdict(float)
    for e in device_events:
        s, t = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if t > s:
            per_stream[f"{e.get('pid')}/{e['thread']}"] += (t - s) / 1e3
    gaps = find_gaps(busy, lo, hi, gap_ms * 1e3)
    kernels = merge(clip([(e["ts"], e["ts"] + e["dur"]) for e in device_events
                          if e["cat"] == "kernel"], lo, hi))
    compute_us = sum(e - s for s, e in kernels)

    names = {**trace_thread_names(trace), **run_info(trace).get("threads", {})}
    names[main] = "main"
    notes, ops, runtime = host_events(events, (lo, hi))
    issuing = issuing_threads(runtime, main) if not cpu_mode else {main}
    indexes = {}
    for kind, evs in (("annotation", notes), ("op", ops), ("runtime", runtime)):
        by_thread = defaultdict(list)
        for e in evs:
            by_thread[e["thread"]].append(e)
        for thread, te in by_thread.items():
            indexes[(thread, kind)] = IntervalIndex(te)
    gap_rows = []
    for i, g in enumerate(gaps):
        host = attribute(g, indexes, issuing, names)
        gap_rows.append({"index": i, "start_ms": round((g[0] - lo) / 1e3, 3),
                         "duration_ms": round((g[1] - g[0]) / 1e3, 3),
                         "host": gap_label(host, issuing), "host_activity": host[:8]})
    step_us = hi - lo
    idle_us = step_us - busy_us
    return {
        "run": run_info(trace),
        "device_row": "cpu ops of the main thread (CPU smoke test)" if cpu_mode
        else "all CUDA kernels, memcpys and memsets, every stream",
        "step_ms": step_us / 1e3, "busy_ms": busy_us / 1e3, "idle_ms": idle_us / 1e3,
        "idle_fraction": idle_us / step_us if step_us > 0 else 0.0,
        "gap_threshold_ms": gap_ms,
        "gaps_over_threshold_ms": sum(g["duration_ms"] for g in gap_rows),
        "busy_ms_per_stream": {k: round(v, 3) for k, v in sorted(per_stream.items())},
        # idle of the kernels alone: a copy stream busy while no kernel runs is still a
        # GPU waiting to compute
        "compute_idle_fraction": 1.0 - compute_us / (hi - lo) if hi > lo and not cpu_mode
        else None,
        "device_work": device_work(device_events, lo, hi) if not cpu_mode else [],
        "threads": {t: names.get(t, "") for t in sorted(issuing | {e["thread"] for e in notes})},
        "issuing_threads": sorted(issuing),
        "snake_annotations": sum(e["name"].startswith(SNAKE) for e in notes),
        "gaps": gap_rows,
        # for the plot only (not written to gaps.json)
        "_window": (lo, hi), "_busy": busy, "_notes": notes, "_ops": ops, "_main": main,
        "_names": names, "_issuing": issuing,
    }


def device_work(events, lo: float, hi: float) -> list[dict]:
    """The step's device time by kind, the most first: kernels, and each kind of copy
    (``Memcpy HtoD (Pageable -> Device)``...) with its bytes and rate, which tells a copy
    from pageable memory (a few GB/s, a host core busy) from a pinned one at once."""
    kinds = {}
    for e in events:
        s, t = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if t <= s:
            continue
        name = "kernels" if e["cat"] == "kernel" else e.get("name", e["cat"])
        k = kinds.setdefault(name, {"kind": name, "ms": 0.0, "count": 0, "bytes": 0})
        k["ms"] += (t - s) / 1e3
        k["count"] += 1
        k["bytes"] += int((e.get("args") or {}).get("bytes", 0))
    for k in kinds.values():
        k["ms"] = round(k["ms"], 3)
        k["GBps"] = round(k["bytes"] / (k["ms"] * 1e6), 2) if k["bytes"] and k["ms"] else None
    return sorted(kinds.values(), key=lambda k: -k["ms"])


# --- output --------------------------------------------------------------------------
def title_of(r: dict) -> str:
    run = r["run"]
    if not run:
        return f"step {r['step_ms']:.1f} ms, GPU idle {r['idle_fraction']:.1%}"
    tiers = run["tiers"]
    return (f"{run['params'] / 1e9:.2f}B params (L{run['layers']} h{run['hidden']} "
            f"s{run['seq']}, M={run['micro_batches']} x {run['micro_batch_size']}, "
            f"{run['dtype']}) on {run['device_name']}; weights/optimizer/checkpoints on "
            f"{tiers['param']}/{tiers['optimizer']}/{tiers['activation']}\n"
            f"step {r['step_ms']:.1f} ms, device busy {r['busy_ms']:.1f} ms, idle "
            f"{r['idle_fraction']:.1%} ({len(r['gaps'])} gaps > {r['gap_threshold_ms']:g} ms)")


def depths(events) -> list[int]:
    """Nesting depth of each event among ``events`` of one thread (sorted by start)."""
    out, stack = [], []
    for e in events:
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        out.append(len(stack))
        stack.append(e["ts"] + e["dur"])
    return out


def color_of(name: str):
    """One colour per kind of annotation: the first word after 'snake/' (F, B, ...)."""
    import matplotlib

    word = name.removeprefix(SNAKE).split(" ")[0]
    return matplotlib.colormaps["tab10"](sum(map(ord, word)) % 10)


def host_rows(r: dict, limit: int = 10) -> list[tuple[str, list[dict], bool]]:
    """(label, events, annotations?) per host row: threads with snake/ annotations (else
    with any annotation), main thread first; then the threads without such annotations
    that issue GPU work or run ops for at least 1% of the step, with their top-level ops."""
    notes, names = r["_notes"], r["_names"]
    snake = [e for e in notes if e["name"].startswith(SNAKE)]
    by_thread = defaultdict(list)
    for e in snake or notes:
        by_thread[e["thread"]].append(e)
    rows = [(thread_label(t, names), by_thread[t], True)
            for t in sorted(by_thread, key=lambda t: (t != r["_main"], -len(by_thread[t])))]
    ops = defaultdict(list)
    for e in r["_ops"]:
        if e["thread"] not in by_thread:
            ops[e["thread"]].append(e)
    lo, hi = r["_window"]
    busy = {t: sum(e["dur"] for e in evs) for t, evs in ops.items()}
    for t in sorted(ops, key=lambda t: (t not in r["_issuing"], -busy[t])):
        if t in r["_issuing"] or busy[t] >= 0.01 * (hi - lo):
            rows.append((thread_label(t, names) + " ops", ops[t], False))
    return rows[:limit]


def plot(r: dict, path: str, top: int) -> None:
    """The timeline PNG: device row on top, host rows below, gaps shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = r["_window"]
    ms = lambda t: (t - lo) / 1e3   # noqa: E731
    rows = host_rows(r)
    n = 1 + len(rows)
    fig, ax = plt.subplots(figsize=(22, 1.6 + 0.7 * n))
    y_of = lambda i: n - 1 - i      # noqa: E731  (row 0 at the top)
    ax.broken_barh([(ms(s), (e - s) / 1e3) for s, e in r["_busy"]], (y_of(0) - 0.4, 0.8),
                   color="tab:green", linewidth=0)
    span = (hi - lo) / 1e3
    for i, (_, evs, annotated) in enumerate(rows, start=1):
        evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))
        bars = defaultdict(list)   # (depth, colour) -> [(start, width)]: one call each
        for e, d in zip(evs, depths(evs)):
            start, width = ms(max(e["ts"], lo)), (min(e["ts"] + e["dur"], hi) -
                                                  max(e["ts"], lo)) / 1e3
            bars[(d, color_of(e["name"]) if annotated else "0.6")].append((start, width))
            h = max(0.8 - 0.2 * d, 0.2)
            if annotated and width > 0.02 * span:
                ax.text(start + width / 2, y_of(i) + h / 2 - 0.05,
                        e["name"].removeprefix(SNAKE), fontsize=6, ha="center", va="top",
                        clip_on=True)
        for (d, color), spans in sorted(bars.items(), key=lambda kv: kv[0][0]):
            h = max(0.8 - 0.2 * d, 0.2)
            ax.broken_barh(spans, (y_of(i) - h / 2, h), color=color, linewidth=0.2,
                           edgecolor="k" if annotated else color)
    largest = sorted(r["gaps"], key=lambda g: -g["duration_ms"])[:top]
    for g in r["gaps"]:
        ax.axvspan(g["start_ms"], g["start_ms"] + g["duration_ms"], color="red", alpha=0.2,
                   linewidth=0)
    for k, g in enumerate(sorted(largest, key=lambda g: g["start_ms"])):
        ax.text(g["start_ms"] + g["duration_ms"] / 2, n - 0.55 + 0.25 * (k % 2),
                f"#{g['index']} {g['duration_ms']:.1f}", fontsize=6, ha="center",
                va="bottom", color="darkred")   # alternate heights: neighbours stay legible
    device = "device (main-thread CPU ops)" if r["device_row"].startswith("cpu") \
        else "GPU (all streams)"
    ax.set_yticks([y_of(i) for i in range(n)], [device] + [label for label, _, _ in rows],
                  fontsize=7)
    ax.set_ylim(-0.6, n)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"ms since step start (red: device idle > {r['gap_threshold_ms']:g} ms; "
                  "labels: gap # and ms)")
    ax.set_title(title_of(r), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_json(r: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump({k: v for k, v in r.items() if not k.startswith("_")}, f, indent=1)


def idle_line(r: dict) -> str:
    """The last line: the share of the step with no device work at all, and (on a GPU) the
    share with no kernel running, the idle that matters for throughput."""
    if r["device_row"].startswith("cpu"):
        return f"gpu idle fraction: {r['idle_fraction']:.4f} (CPU smoke test: main-thread " \
            "idle between ops)"
    if r["compute_idle_fraction"] is None:     # an empty step
        return f"gpu idle fraction: {r['idle_fraction']:.4f}"
    return f"gpu idle fraction: {r['idle_fraction']:.4f} (no kernel running: " \
        f"{r['compute_idle_fraction']:.4f})"


def print_table(r: dict, top: int) -> None:
    print(f"device row: {r['device_row']}")
    print(f"step {r['step_ms']:.1f} ms, busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms "
          f"({len(r['gaps'])} gaps > {r['gap_threshold_ms']:g} ms: "
          f"{r['gaps_over_threshold_ms']:.1f} ms); snake/ annotations in the trace: "
          f"{r['snake_annotations']}")
    for k in r.get("device_work", []):
        rate = f", {k['bytes'] / 1e9:.2f} GB at {k['GBps']:.1f} GB/s" if k["GBps"] else ""
        print(f"  {k['kind']}: {k['ms']:.1f} ms in {k['count']}{rate}")
    largest = sorted(r["gaps"], key=lambda g: -g["duration_ms"])[:top]
    if largest:
        print(f"{'#':>5} {'start ms':>10} {'ms':>8}  host activity (other threads)")
    for g in largest:
        others = [h for h in g["host_activity"][1:] if h["cover"] >= 0.05 and
                  h["thread"] != g["host_activity"][0]["thread"]][:2]
        extra = "; ".join(f"{h['thread_name'] or h['thread']}: {h['name']} "
                          f"{h['cover']:.0%}" for h in others)
        print(f"{g['index']:>5} {g['start_ms']:>10.2f} {g['duration_ms']:>8.2f}  {g['host']}"
              + (f"  ({extra})" if extra else ""))


def main(argv=None) -> int:
    a, extra = parse_cli(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    trace_path = a.analyze
    if trace_path is None:
        from megatron_snake.training import distributed
        from megatron_snake.training.arguments import parse_args

        args = parse_args(megatron_flags(a, extra))
        device = distributed.resolve_device(a.device)
        distributed.initialize(device=device, seed=args.seed)
        trace_path = os.path.join(a.out_dir, "trace.json.gz")
        try:
            record_step(a, args, device, trace_path)
        finally:
            distributed.shutdown()
    elif extra:
        raise SystemExit(f"--analyze takes no training flags: {' '.join(extra)}")
    t0 = time.perf_counter()
    r = analyse(load_trace(trace_path), a.gap_ms)
    write_json(r, os.path.join(a.out_dir, "gaps.json"))
    plot(r, os.path.join(a.out_dir, "timeline.png"), a.top)
    print(f"> analysed in {time.perf_counter() - t0:.1f} s: "
          f"{os.path.join(a.out_dir, 'gaps.json')}, {os.path.join(a.out_dir, 'timeline.png')}")
    print_table(r, a.top)
    print(idle_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
