"""A scaling study from the cost model: model sizes x nodes x drives per node x global batch.

    python tools/scaling_study.py --out docs/img/scaling [--profiles h100_4x_gen4 h100_8x_gen5]

For every point it predicts the best parallel layout (tensor-parallel size within a node,
pipeline stages, data parallelism for the rest; micro-batch 1; every state on the drives,
unit inputs placed as `auto` places them: device, then host, then drive) with
megatron_snake/planner, and writes:
- ``study.csv``: one row per point and layout kept (the fastest that fits);
- ``throughput.png``: tokens/s and MFU against nodes;
- ``breakdown.png``: each resource's seconds per step at one node and at the most nodes;
- ``saturation.png``: the global batch from which the step is compute-bound;
- ``capacity.png``: the drive capacity a node needs.
It runs in a minute or two on a laptop: arithmetic only.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

from megatron_snake.planner import DoesNotFit, load_profile, predict  # noqa: E402

# name: (layers, hidden, heads): GPT-3's shapes (175B), LLaMA's (7B to 65B)
MODELS = {"7B": (32, 4096, 32), "13B": (40, 5120, 40), "30B": (60, 6656, 52),
          "65B": (80, 8192, 64), "175B": (96, 12288, 96)}
NODES = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (512, 1024, 2048)          # sequences of 2048 tokens: 1M to 4M tokens a step
SATURATION_BATCHES = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SEQ, VOCAB, HOST_POOL = 2048, 51200, "128GiB"


def workload(model: str, gpus: int, tp: int, pp: int, batch: int):
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.workload import workload_from_args

    layers, hidden, heads = MODELS[model]
    args = parse_args([
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
        str(heads), "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--micro-batch-size", "1", "--global-batch-size", str(batch), "--bf16",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--snake-offload", "--snake-host-memory-limit", HOST_POOL,
        "--snake-activation-tier", "auto"], world_size=gpus)
    return workload_from_args(args, VOCAB)


def layouts(model: str, gpus: int, per_node: int, batch: int):
    layers, hidden, heads = MODELS[model]
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if tp > per_node or gpus % (tp * pp) or layers % pp or heads % tp or \
                    batch % (gpus // (tp * pp)):
                continue
            yield tp, pp


def best(model: str, nodes: int, hw, batch: int):
    """(layout, prediction) of the fastest layout that fits, or (None, reason)."""
    gpus = nodes * hw.gpus_per_node
    found, reason = None, "no layout divides the batch"
    for tp, pp in layouts(model, gpus, hw.gpus_per_node, batch):
        w = workload(model, gpus, tp, pp, batch)
        try:
            pred = predict(w, hw)
        except DoesNotFit as exc:
            reason = str(exc).split(":")[0]
            continue
        if found is None or pred.step_time_s < found[1].step_time_s:
            found = ((tp, pp, w.dp, w.group_size), pred)
    return found if found else (None, reason)


def compute_bound(pred) -> bool:
    """Compute is the busiest resource in both sweeps."""
    b = pred.breakdown
    return all(b[s]["compute"] >= max(v for k, v in b[s].items()
                                      if k not in ("time", "fill", "compute"))
               for s in ("forward", "backward"))


def study(profiles: list[str]) -> list[dict]:
    rows = []
    for name in profiles:
        hw = load_profile(name)
        for model in MODELS:
            for nodes in NODES:
                for batch in BATCHES:
                    layout, pred = best(model, nodes, hw, batch)
                    row = {"profile": name, "model": model, "nodes": nodes,
                           "global_batch": batch}
                    if layout is None:
                        rows.append({**row, "fits": False, "reason": pred})
                        continue
                    tp, pp, dp, g = layout
                    b = pred.breakdown
                    rows.append({
                        **row, "fits": True, "tp": tp, "pp": pp, "dp": dp, "group_size": g,
                        "step_s": pred.step_time_s, "tokens_per_s": pred.tokens_per_s,
                        "mfu": pred.mfu, "bubble_s": pred.bubble_s,
                        "compute_bound": compute_bound(pred),
                        "drive_per_node_TB": pred.drive_capacity_per_node / 1e12,
                        **{f"{r}_s": b["forward"][r] + b["backward"][r]
                           for r in ("compute", "copy", "host", "drive", "cpu_adam",
                                     "dp_comm")}})
    return rows


def saturation(profiles: list[str]) -> list[dict]:
    """The smallest global batch (sequences) whose step is compute-bound."""
    out = []
    for name in profiles:
        hw = load_profile(name)
        for model in MODELS:
            for nodes in NODES:
                found = None
                for batch in SATURATION_BATCHES:
                    layout, pred = best(model, nodes, hw, batch)
                    if layout is not None and compute_bound(pred):
                        found = batch
                        break
                out.append({"profile": name, "model": model, "nodes": nodes,
                            "saturating_batch": found})
    return out


def drive_need(profile: str, models=("7B", "65B"), batches=(16, 64, 256)) -> list[dict]:
    """On one GPU of ``profile``: the drive read rate (writes scaled as the profile's) from
    which the step reaches 0.9 of its compute-bound time, and the fraction the profile's own
    drive reaches, per sequences of a step."""
    hw = load_profile(profile).with_(gpus_per_node=1, drive_capacity=1e15)
    ratio = hw.drive_write_Bps / hw.drive_read_Bps
    one = hw.with_(drive_read_Bps=hw.drive_read_Bps / load_profile(profile).gpus_per_node,
                   drive_write_Bps=hw.drive_write_Bps / load_profile(profile).gpus_per_node)
    out = []
    for model in models:
        for batch in batches:
            w = workload(model, 1, 1, 1, batch)
            ideal = predict(w, hw.with_(drive_read_Bps=1e15, drive_write_Bps=1e15),
                            check=False).step_time_s
            need = next((gb for gb in (x / 2 for x in range(1, 400))
                         if ideal / predict(w, hw.with_(drive_read_Bps=gb * 1e9,
                                                        drive_write_Bps=gb * 1e9 * ratio),
                                            check=False).step_time_s >= 0.9), None)
            out.append({"model": model, "sequences": batch, "read_GBps_for_0.9": need,
                        "fraction_with_one_gpus_share": ideal / predict(
                            w, one, check=False).step_time_s})
    return out


def plots(rows: list[dict], sat: list[dict], out: str, profiles: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = BATCHES[len(BATCHES) // 2]
    fig, axes = plt.subplots(2, len(profiles), figsize=(6 * len(profiles), 8), squeeze=False)
    for col, name in enumerate(profiles):
        for model in MODELS:
            pts = [r for r in rows if r["profile"] == name and r["model"] == model
                   and r["global_batch"] == batch and r["fits"]]
            xs = [r["nodes"] for r in pts]
            axes[0][col].plot(xs, [r["tokens_per_s"] for r in pts], marker="o", label=model)
            axes[1][col].plot(xs, [r["mfu"] for r in pts], marker="o", label=model)
        axes[0][col].set(xscale="log", yscale="log", xlabel="nodes", ylabel="tokens/s",
                         title=f"{name}, {batch} x {SEQ} tokens a step")
        axes[1][col].set(xscale="log", xlabel="nodes", ylabel="MFU", ylim=(0, 0.5))
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=110)

    resources = ("compute", "drive", "copy", "host", "cpu_adam", "dp_comm")
    fig, axes = plt.subplots(1, len(profiles), figsize=(7 * len(profiles), 4), squeeze=False)
    for col, name in enumerate(profiles):
        pts = [r for r in rows if r["profile"] == name and r["global_batch"] == batch
               and r["fits"] and r["nodes"] in (1, NODES[-1])]
        labels = [f"{r['model']}\n{r['nodes']} node(s)" for r in pts]
        width = 0.8 / len(resources)
        for i, res in enumerate(resources):
            axes[0][col].bar([j + i * width for j in range(len(pts))],
                             [r[f"{res}_s"] for r in pts], width, label=res)
        axes[0][col].scatter([j + 0.4 - width / 2 for j in range(len(pts))],
                             [r["step_s"] for r in pts], color="black", marker="_", s=400,
                             label="step", zorder=3)
        axes[0][col].set_xticks([j + 0.4 - width / 2 for j in range(len(pts))], labels,
                                fontsize=7)
        axes[0][col].set(yscale="log", ylabel="seconds per step (both sweeps)", title=name)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "breakdown.png"), dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, style in zip(profiles, ("-", "--")):
        for model in MODELS:
            pts = [s for s in sat if s["profile"] == name and s["model"] == model
                   and s["saturating_batch"]]
            axes[0].plot([s["nodes"] for s in pts], [s["saturating_batch"] for s in pts],
                         style, marker="o", label=f"{model}, {name}")
            cap = [r for r in rows if r["profile"] == name and r["model"] == model
                   and r["global_batch"] == batch and r["fits"]]
            axes[1].plot([r["nodes"] for r in cap], [r["drive_per_node_TB"] for r in cap],
                         style, marker="o", label=f"{model}, {name}")
    axes[0].set(xscale="log", yscale="log", xlabel="nodes",
                ylabel="global batch (sequences) from which compute-bound")
    axes[1].set(xscale="log", yscale="log", xlabel="nodes", ylabel="drive per node (TB)")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "saturation_capacity.png"), dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for study.csv and the PNGs")
    p.add_argument("--profiles", nargs="+", default=["h100_4x_gen4", "h100_8x_gen5"])
    p.add_argument("--drive-need", action="store_true",
                   help="only print, per GPU, the drive bandwidth for 0.9 of compute-bound")
    a = p.parse_args(argv)
    if a.drive_need:
        for row in drive_need(a.profiles[0]):
            print(row)
        return 0
    os.makedirs(a.out, exist_ok=True)
    rows = study(a.profiles)
    sat = saturation(a.profiles)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k)
                  if k in rows[0] else 99)
    with open(os.path.join(a.out, "study.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(a.out, "saturation.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(sat[0]))
        writer.writeheader()
        writer.writerows(sat)
    plots(rows, sat, a.out, a.profiles)
    fits = [r for r in rows if r["fits"]]
    print(f"{len(fits)} of {len(rows)} points fit; written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
