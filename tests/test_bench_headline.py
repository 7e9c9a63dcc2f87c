"""tools/bench_headline.py without a GPU: the order its runs come in (the most valuable
first, so --time-budget cuts the least valuable), the summary and the plot of a synthetic
run (no training), out of memory as a figure, its flags refused with one line, and one tiny
run on the CPU end to end (Megatron's CPU offload recorded as not run there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_headline as bh  # noqa: E402

TINY = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64",
        "--vocab", "1024"]


def _order(a, rnd, report):
    return [(stage, kind, m, clip) for stage, _, kind, m, clip, _ in bh.plan(a, rnd, report)]


def test_runs_come_in_order_of_value():
    a = bh.parse(["--curve", "3,6,9"])
    report = {"micro_batches": 9, "runs": []}
    assert _order(a, 0, report) == [
        ("headline", "megatron", None, None), ("headline", "offloaded_3x", None, 1.0),
        ("cpu_offload", "cpu_offload_2x", None, None),
        ("cpu_offload", "cpu_offload_3x", None, None),
        ("cpu_offload", "offloaded_2x", None, 1.0),
        ("clip", "offloaded_3x", None, 0.0),
        # the curve: M 9 is the headline's; each pair swaps places from one M to the next
        ("curve", "megatron", 3, None), ("curve", "offloaded_3x", 3, 1.0),
        ("curve", "cpu_offload_2x", 3, None), ("curve", "cpu_offload_3x", 3, None),
        ("curve", "offloaded_3x", 6, 1.0), ("curve", "megatron", 6, None),
        ("curve", "cpu_offload_2x", 6, None), ("curve", "cpu_offload_3x", 6, None),
        ("curve", "offloaded_3x", 3, 0.0), ("curve", "offloaded_3x", 6, 0.0)]
    # the next round: the headline pair the other way round
    assert _order(a, 1, report)[:2] == [("headline", "offloaded_3x", None, 1.0),
                                        ("headline", "megatron", None, None)]
    # Megatron's CPU offload that ran out of memory (or could not run) is not tried again
    report["runs"] = [{"kind": "cpu_offload_3x", "figure": "out of memory at 3x"}]
    assert [k for _, k, m, _ in _order(a, 0, report) if m] == [
        "megatron", "offloaded_3x", "cpu_offload_2x", "offloaded_3x", "megatron",
        "cpu_offload_2x", "offloaded_3x", "offloaded_3x"]
    # --stages picks what runs; --curve off: the headline's M only
    a = bh.parse(["--stages", "headline,clip", "--curve", "off"])
    assert _order(a, 0, report) == [
        ("headline", "megatron", None, None), ("headline", "offloaded_3x", None, 1.0),
        ("clip", "offloaded_3x", None, 0.0)]


def _megatron(m, tps, clips=(1.0, 0.0), ratio=None, **extra):
    """A Megatron run's record: ``tps`` {(clip, mode): tokens/s}."""
    system = "megatron" if ratio is None else "cpu_offload"
    modes = ("full", "none") if ratio is None else ("full",)
    by_clip = {}
    for (clip, mode), t in tps.items():
        by_clip.setdefault(f"{clip:g}", {})[mode] = {"tokens_per_s": t, "tflops_per_gpu": t / 100}
    return {"kind": system if ratio is None else f"cpu_offload_{ratio:g}x", "system": system,
            "micro_batches": m, "state_ratio_asked": ratio, "clips": list(clips),
            "modes_asked": list(modes), "by_clip": by_clip, **extra}


def _ours(m, tps, ratio=3.0, clip=1.0):
    return {"kind": f"offloaded_{ratio:g}x", "system": "offloaded", "micro_batches": m,
            "state_ratio_asked": ratio, "clip_grad": clip, "tokens_per_s": tps,
            "tflops_per_gpu": tps / 100, "hidden_share": 0.9, "trained": True}


def synthetic_report(runs=None) -> dict:
    """Two rounds at the headline's M 9, one curve point at M 6; Megatron's CPU offload
    trains at 2x and runs out of memory at 3x."""
    runs = SYNTHETIC_RUNS if runs is None else runs
    a = bh.parse(["--curve", "6,9"])
    return {"device": "NVIDIA H200 (synthetic)", "sizing": {"layers": 32, "params": 1.75e9,
                                                          "state_bytes": 31.5e9},
            "args": vars(a), "micro_batches": 9, "runs": runs,
            "summary": bh.summarize(runs, a, 9)}


SYNTHETIC_RUNS = [
    _megatron(9, {(1.0, "full"): 1000, (1.0, "none"): 1500, (0.0, "full"): 1010,
                  (0.0, "none"): 1520}),
    _megatron(9, {(1.0, "full"): 1100, (1.0, "none"): 1500, (0.0, "full"): 1030,
                  (0.0, "none"): 1480}),
    _ours(9, 800), _ours(9, 900), _ours(9, 1000, clip=0.0), _ours(9, 850, ratio=2.0),
    _megatron(9, {(1.0, "full"): 500, (0.0, "full"): 520}, ratio=2.0),
    {**_megatron(9, {}, ratio=3.0), "error": "OutOfMemoryError: CUDA out of memory.",
     "figure": "out of memory at 3x"},
    # the curve's other M
    _megatron(6, {(1.0, "full"): 950, (1.0, "none"): 1400, (0.0, "full"): 960,
                  (0.0, "none"): 1410}),
    _ours(6, 600),
    _megatron(6, {(1.0, "full"): 450, (0.0, "full"): 470}, ratio=2.0),
]


def test_summary_keeps_the_headline_fields_and_adds_the_curve():
    s = synthetic_report()["summary"]
    # the headline's fields (docs and the trace read them): medians at M 9, clip 1
    assert s["megatron_full"]["tokens_per_s"] == 1050 and s["megatron_full"]["runs"] == 2
    assert s["offloaded_3x"]["tokens_per_s"] == 850
    assert s["offloaded_3x"]["ratio_vs_megatron_full"] == pytest.approx(850 / 1050)
    assert s["offloaded_3x"]["ratio_vs_megatron_none"] == pytest.approx(850 / 1500)
    # Megatron's CPU offload at the same memory given, and out of memory as its figure
    assert s["cpu_offload_2x"]["tokens_per_s"] == 500
    assert s["cpu_offload_2x"]["ratio_offloaded_vs_this"] == pytest.approx(850 / 500)
    assert s["cpu_offload_3x"]["tokens_per_s"] is None
    assert s["cpu_offload_3x"]["figure"] == "out of memory at 3x"
    # clipping off against Megatron's clipping off
    assert s["by_clip"]["0"]["ratio_vs_megatron_full"] == pytest.approx(1000 / 1020)
    # the curve: every line over M, and ours against each baseline at the same M and clip
    line = s["curve"]["offloaded_3x clip 1"]
    assert [(p["micro_batches"], p["tokens_per_s"]) for p in line["points"]] == \
        [(6, 600), (9, 850)]
    assert s["curve"]["cpu_offload_3x clip 1"]["points"][0]["figure"] == \
        "out of memory at 3x"
    ratios = s["curve_ratios"]["offloaded_3x clip 1 / megatron_full clip 1"]
    assert [(r["micro_batches"], round(r["ratio"], 3)) for r in ratios] == \
        [(6, round(600 / 950, 3)), (9, round(850 / 1050, 3))]
    assert "offloaded_3x clip 1 / cpu_offload_3x clip 1" not in s["curve_ratios"]
    assert s["curve_ratios"]["offloaded_2x clip 1 / cpu_offload_2x clip 1"] == \
        [{"micro_batches": 9, "ratio": pytest.approx(850 / 500)}]


def test_the_plot_of_a_synthetic_json(tmp_path):
    report = tmp_path / "headline.json"
    report.write_text(json.dumps(synthetic_report()))
    png = tmp_path / "curve.png"
    assert bh.main(["--from", str(report), "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_second_calls_curve_joins_the_headlines(tmp_path):
    """The curve's second call (--stages curve) writes its own JSON: drawn with the
    headline's, the two are summarized as one run."""
    paths = [str(tmp_path / "headline.json"), str(tmp_path / "curve.json")]
    for path, runs in zip(paths, (SYNTHETIC_RUNS[:8], SYNTHETIC_RUNS[8:])):
        with open(path, "w") as f:
            json.dump(synthetic_report(runs), f)
    alone = bh.merged(paths[:1])["summary"]["curve"]["offloaded_3x clip 1"]["points"]
    both = bh.merged(paths)["summary"]
    assert [p["micro_batches"] for p in alone] == [9]
    assert [p["micro_batches"] for p in both["curve"]["offloaded_3x clip 1"]["points"]] == \
        [6, 9]
    assert both == synthetic_report()["summary"]


def test_out_of_memory_is_a_figure_not_a_crash():
    oom = bh.failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                     3.0)
    assert oom["figure"] == "out of memory at 3x" and "CUDA out of memory" in oom["error"]
    assert bh.failure(RuntimeError("CUDA out of memory. Tried"), 2.0)["figure"] == \
        "out of memory at 2x"
    assert "figure" not in bh.failure(RuntimeError("host pool exhausted"), 3.0)


@pytest.mark.parametrize("flags,named", [
    (["--curve", "3,x"], "--curve"), (["--curve", "0"], "--curve"),
    (["--clip-grads", "1,-1"], "--clip-grads"), (["--clip-grads", "1,1"], "--clip-grads"),
    (["--stages", "headline,bogus"], "--stages"),
    (["--stages", "cpu_offload"], "--stages"),          # no headline and no --micro-batches
    (["--state-ratios", "0"], "--state-ratios"),
    (["--snake-flags", "--clip-grad 0"], "--snake-flags"),
    (["--from", "h.json"], "--from"),
])
def test_bad_flags_get_one_line_naming_the_flag(capsys, flags, named):
    with pytest.raises(SystemExit) as exc:
        bh.parse(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


def test_a_tiny_run_on_the_cpu(tmp_path):
    """The whole tool at tiny sizes: the headline pair, Megatron's CPU offload recorded as
    not run (it needs CUDA), one more M on the curve, the JSON, the plot, the ratio last."""
    out, png = tmp_path / "h.json", tmp_path / "h.png"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_headline.py"), *TINY,
         "--rounds", "1", "--warmup", "0", "--steps", "1", "--micro-batches", "2",
         "--curve", "3", "--clip-grads", "1", "--state-ratios", "3",
         "--cpu-offload-ratios", "2", "--dir", str(tmp_path / "off"),
         "--json-out", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith(
        "ratio tokens/s offloaded (3x) / Megatron: full recompute ")
    s = json.loads(out.read_text())["summary"]
    assert s["offloaded_3x"]["tokens_per_s"] > 0 and s["offloaded_3x"]["trained"]
    assert s["cpu_offload_2x"]["figure"].startswith("not run: --optimizer-cpu-offload")
    for key in ("megatron_full clip 1", "megatron_none clip 1", "offloaded_3x clip 1"):
        assert [p["micro_batches"] for p in s["curve"][key]["points"]] == [2, 3]
    assert png.read_bytes()[:4] == b"\x89PNG"
