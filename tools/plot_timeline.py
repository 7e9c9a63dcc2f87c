"""Draw a training timeline (a Chrome trace from megatron_snake/timeline.py) as a PNG.

One row per thread (main thread on top), each span a bar coloured by its category; a span
nested in another (a drive read inside a store get, a compute inside a sweep) is drawn
thinner, on top of it. It also prints, per thread, the seconds it was busy in the window
(the union of its spans) and that as a fraction of the window, plus the main thread's
seconds of compute.

Get a trace from a training run or from the overlap benchmark:

    python examples/pretrain_gpt.py --snake-offload ... --snake-trace trace.json
    python tools/bench_overlap.py --trace trace.json

then

    python tools/plot_timeline.py trace.json timeline.png [--start 2.5 --end 4] [--title T]

``--start`` and ``--end`` are seconds from the earliest span.
"""

from __future__ import annotations

import argparse
import json
import sys

# Compute, drive and wait get colours that stand out; the rest are quieter.
COLOURS = {
    "compute": "tab:blue", "device": "navy", "drive": "tab:orange", "wait": "tab:red",
    "sweep": "lightsteelblue", "step": "gainsboro", "step boundary": "dimgray",
    "weights": "tab:cyan", "store": "tab:olive", "host copy": "gold", "link": "darkkhaki",
    "optimizer": "tab:green", "cpu adamw": "tab:purple", "collective": "tab:pink",
}
OTHER_COLOUR = "tab:brown"


def fail(message: str) -> None:
    print(f"plot_timeline: {message}", file=sys.stderr)
    raise SystemExit(2)


def busy_seconds(spans) -> float:
    """Length of the union of ``(start, end)`` intervals: overlapping spans count once."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def load_trace(path: str):
    """(thread names in row order, spans as dicts with thread/name/cat/start/end seconds)."""
    try:
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        names = {e["tid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        order = {e["tid"]: e["args"]["sort_index"] for e in events
                 if e["ph"] == "M" and e["name"] == "thread_sort_index"}
        spans = [{"thread": names.get(e["tid"], str(e["tid"])), "name": e["name"],
                  "cat": e.get("cat", ""), "start": e["ts"] / 1e6,
                  "end": (e["ts"] + e["dur"]) / 1e6} for e in events if e["ph"] == "X"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        fail(f"{path} is not a timeline trace from megatron_snake/timeline.py "
             f"({type(error).__name__}: {error})")
    if not spans:
        fail(f"{path} has no spans")
    tids = sorted(set(names) | set(order), key=lambda tid: (order.get(tid, tid), tid))
    threads = [names.get(tid, str(tid)) for tid in tids]
    threads += sorted({s["thread"] for s in spans} - set(threads))
    return threads, spans


def clip(spans, window_start: float, window_end: float):
    """The spans overlapping the window, cut to it."""
    return [dict(s, start=max(s["start"], window_start), end=min(s["end"], window_end))
            for s in spans if s["end"] > window_start and s["start"] < window_end]


def with_depths(spans):
    """(depth, span) for one thread's spans: 0 for top-level, 1 inside one, and so on."""
    open_ends, result = [], []
    for s in sorted(spans, key=lambda s: (s["start"], -s["end"])):
        while open_ends and open_ends[-1] <= s["start"]:
            open_ends.pop()   # spans on one thread nest, so the innermost closes first
        result.append((len(open_ends), s))
        open_ends.append(s["end"])
    return result


def print_table(threads, spans, window: float) -> None:
    print(f"{'thread':<28} {'busy s':>9} {'busy %':>7}  (window {window:.3f} s)")
    for thread in threads:
        mine = [s for s in spans if s["thread"] == thread]
        busy = busy_seconds((s["start"], s["end"]) for s in mine)
        line = f"{thread:<28} {busy:>9.3f} {100 * busy / window:>6.1f}%"
        if thread == "MainThread":
            compute = busy_seconds((s["start"], s["end"]) for s in mine
                                   if s["cat"] == "compute")
            line += f"  compute {compute:.3f} s"
        print(line)


def draw(threads, spans, window_start, window_end, title, out_path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        fail("matplotlib is missing: pip install matplotlib")
    fig, ax = plt.subplots(figsize=(14, max(3.0, 1 + 0.5 * len(threads))))
    for row, thread in enumerate(threads):
        # Outer spans first, inner ones thinner on top, so nested work stays visible.
        for depth, s in sorted(with_depths([s for s in spans if s["thread"] == thread]),
                               key=lambda pair: pair[0]):
            height = 0.8 * 0.7 ** depth
            ax.broken_barh([(s["start"], s["end"] - s["start"])], (row - height / 2, height),
                           facecolors=COLOURS.get(s["cat"], OTHER_COLOUR), linewidth=0)
    ax.set_yticks(range(len(threads)), threads)
    ax.set_ylim(len(threads) - 0.5, -0.5)   # first thread on top
    ax.set_xlim(window_start, window_end)
    ax.set_xlabel("seconds from the first span")
    ax.set_title(title)
    present = sorted({s["cat"] for s in spans})
    ax.legend(handles=[Patch(color=COLOURS.get(c, OTHER_COLOUR), label=c) for c in present],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120, bbox_inches="tight")   # keeps the legend whole
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Chrome trace JSON written by --snake-trace / --trace")
    parser.add_argument("out", help="PNG to write")
    parser.add_argument("--start", type=float, help="window start, s from the first span")
    parser.add_argument("--end", type=float, help="window end, s from the first span")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)

    threads, spans = load_trace(args.trace)
    first = min(s["start"] for s in spans)
    spans = [dict(s, start=s["start"] - first, end=s["end"] - first) for s in spans]
    window_start = args.start if args.start is not None else 0.0
    window_end = args.end if args.end is not None else max(s["end"] for s in spans)
    if window_end <= window_start:
        fail(f"empty window: --start {window_start} --end {window_end}")
    spans = clip(spans, window_start, window_end)

    print_table(threads, spans, window_end - window_start)
    draw(threads, spans, window_start, window_end, args.title or args.trace, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
