"""tools/gpu_check.sh's time budget, checked without a GPU: each part is one command of a
lent GPU machine (at most 540 s, set-up included), so the time boxes of a part's steps must
add up to at most 480 s, and the parts and the steps the issue asked for must be there.
Also bench_headline.py's sizing rule and saturating batch, which the headline's box
relies on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "tools"))

PART_BUDGET_S = 540          # one command, set-up included
STEP_BOXES_S = 480           # the steps' boxes of one part together
# the parts in order of value, and their steps, the most valuable first
EXPECTED = {
    "headline": ["headline", "headline_trace", "optimizer_threads"],
    "plugin": ["plugin_exact", "plugin_bench"],
    "suite": ["gpu_tests", "host_kernel", "demo", "bench_schedule", "bench_zenflow"],
    "zero": ["zero_install", "zero_ops", "zero_m16", "zero_m4_1"],
    "io": ["bench_io", "act_host", "gds_reason", "act_nvme"],
    "plan": ["validate_planner"],
}


def _script() -> str:
    with open(SCRIPT) as f:
        return f.read()


def _logical_lines(text: str) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def parts() -> dict[str, list[tuple[str, int, str]]]:
    """part -> [(step, box seconds, the step's command line)], from each part_NAME()."""
    out, current = {}, None
    for line in _logical_lines(_script()):
        m = re.match(r"part_(\w+)\(\)\s*\{", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        if current is not None and line.startswith("}"):
            current = None
            continue
        m = re.match(r"\s*step\s+(\S+)\s+(\d+)\s+(.*)", line)
        if current is not None and m:
            current.append((m.group(1), int(m.group(2)), m.group(3)))
    return out


def test_parts_are_declared_in_order_of_value():
    m = re.search(r'^PARTS="([^"]+)"', _script(), re.M)
    assert m, "PARTS=... missing from gpu_check.sh"
    assert m.group(1).split() == list(EXPECTED)


@pytest.mark.parametrize("part", list(EXPECTED))
def test_each_part_has_its_steps_in_order(part):
    found = parts()
    assert part in found, f"no part_{part}() in gpu_check.sh"
    names = [name for name, _, _ in found[part]]
    assert names == EXPECTED[part]


@pytest.mark.parametrize("part", list(EXPECTED))
def test_each_part_fits_one_command(part):
    boxes = [box for _, box, _ in parts()[part]]
    assert sum(boxes) <= STEP_BOXES_S, f"{part}: boxes {boxes} add up to {sum(boxes)} s"
    limit = int(re.search(r"PART_LIMIT=\$\{SNAKE_GPU_PART_LIMIT:-(\d+)\}", _script()).group(1))
    assert sum(boxes) < limit <= PART_BUDGET_S


def test_every_step_runs_a_file_that_exists():
    for part, steps in parts().items():
        for name, _, command in steps:
            for path in re.findall(r"\b((?:tools|examples)/[\w./]+\.py|tests/gpu)\b", command):
                assert os.path.exists(os.path.join(ROOT, path)), f"{part}/{name}: {path}"


def test_docs_table_matches_the_script():
    """docs/benchmarks.md's table of the parts names each step with its box: the same."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        docs = f.read()
    for part, steps in parts().items():
        row = re.search(rf"^\| `{part}` \| (.*?) \|", docs, re.M)
        assert row, f"docs/benchmarks.md: no row for the part {part}"
        documented = [(name, int(box)) for name, box in re.findall(r"`(\w+)` \((\d+)\)",
                                                                     row.group(1))]
        assert documented == [(name, box) for name, box, _ in steps], part


def test_headline_budget_leaves_room_in_its_box():
    """bench_headline.py starts no run it expects to end past --time-budget: the box must
    leave room for the run in flight to end and the JSON to be written."""
    (_, box, command), = [s for s in parts()["headline"] if s[0] == "headline"]
    budget = int(re.search(r"--time-budget (\d+)", command).group(1))
    assert budget + 30 <= box


def test_script_parses_and_refuses_unknown_parts(tmp_path):
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    for part in ("bench", "nonsense"):
        r = subprocess.run(["bash", SCRIPT, str(tmp_path / "out"), part],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "part" in r.stderr


def test_headline_model_sizes_by_device_memory():
    import bench_headline as bh

    a = bh.parser().parse_args([])
    h100 = bh.size_model(a, int(79.2 * 2**30))
    h200 = bh.size_model(a, int(139.8 * 2**30))
    assert (h100["layers"], h200["layers"]) == (24, 32)
    for s, total in ((h100, 79.2 * 2**30), (h200, 139.8 * 2**30)):
        assert s["megatron_bytes_estimate"] <= a.memory_share * total
    # a smaller device gets fewer layers, never fewer than 4
    assert bh.size_model(a, 40 * 2**30)["layers"] < 24
    assert bh.size_model(a, 8 * 2**30)["layers"] == 4
    assert bh.size_model(bh.parser().parse_args(["--layers", "6"]), None)["layers"] == 6


def test_saturating_batch_covers_the_state_time_within_the_caps():
    import bench_headline as bh

    a = bh.parser().parse_args([])
    # without clipping the update hides behind the whole step: 1.25 x 0.8 / 0.1 = 10
    m, how = bh.saturating_m(a, update_s=0.8, link_s=0.1, per_mb_s=0.1, clipped=False)
    assert m == 10 and how["wanted"] == 10 and how["hidden_behind_share"] == 1.0
    m, _ = bh.saturating_m(a, update_s=10.0, link_s=0.1, per_mb_s=0.2, clipped=False)
    assert m == 15                                      # wants 63: --max-step-s 3
    m, _ = bh.saturating_m(a, update_s=0.01, link_s=0.0, per_mb_s=0.2, clipped=False)
    assert m == a.min_micro_batches                     # never under the minimum


def test_saturating_batch_with_clipping_hides_the_update_behind_the_forward_sweep():
    """With clipping the whole update waits for the norm and runs in the next forward sweep
    (a quarter of a full-recompute step's device work): four times the micro-batches of the
    unclipped batch; the host link's copies spread over the whole step either way."""
    import bench_headline as bh

    a = bh.parser().parse_args([])
    assert bh.FORWARD_SHARE == 0.25
    clipped, how = bh.saturating_m(a, update_s=0.2, link_s=0.1, per_mb_s=0.1, clipped=True)
    unclipped, _ = bh.saturating_m(a, update_s=0.2, link_s=0.1, per_mb_s=0.1, clipped=False)
    assert (clipped, unclipped) == (10, 3)              # 1.25 x 0.8 / 0.1; 1.25 x 0.2 / 0.1
    assert how["hidden_behind_share"] == 0.25 and how["state_s"] == pytest.approx(0.8)
    # the link bound is the same clipped or not
    for clip in (True, False):
        m, _ = bh.saturating_m(a, update_s=0.05, link_s=0.5, per_mb_s=0.1, clipped=clip)
        assert m == 7                                   # 1.25 x 0.5 / 0.1 = 6.25
    m, how = bh.saturating_m(a, update_s=1.0, link_s=0.1, per_mb_s=0.2, clipped=True)
    assert how["wanted"] == 25 and m == 15              # the time cap still holds


def test_offloaded_runs_leave_room_for_activations():
    """The device limit the offloaded run is told: half the memory given, never the last
    1.25 GiB of it, none where under 1 GiB would remain (an H100 at 10x)."""
    import bench_headline as bh

    a = bh.parser().parse_args([])
    state = bh.size_model(a, int(79.2 * 2**30))["state_bytes"]
    given3, given10 = int(state / 3 * 0.99), int(state / 10 * 0.99)
    assert bh.gpu_limit_bytes(a, given3) == int(0.5 * given3)
    assert bh.gpu_limit_bytes(a, given10) is None
    assert bh.gpu_limit_bytes(a, None) is None
    flags = bh.offload_flags(a, 24, 8, given3, 8 << 30, "/tmp/x")
    assert flags[flags.index("--snake-gpu-memory-limit") + 1] == str(int(0.5 * given3))
    assert "--snake-gpu-memory-limit" not in bh.offload_flags(a, 24, 8, given10, 8 << 30, "/x")


def test_next_names_the_first_unmeasured_part_and_a_stale_one(tmp_path):
    """tools/gpu_next_part.py: an unmeasured part is due; a part measured at a commit is due
    again once a later commit touches its paths, and current before that."""
    import gpu_next_part
    repo = tmp_path / "repo"
    (repo / "code").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "code" / "a.py").write_text("1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert gpu_next_part.why_due("-", ["code"], root=str(repo)) == "never measured"
    assert gpu_next_part.why_due(first, ["code"], root=str(repo)) is None
    (repo / "other.txt").write_text("x\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "two"], check=True)
    assert gpu_next_part.why_due(first, ["code"], root=str(repo)) is None
    (repo / "code" / "a.py").write_text("2\n")
    subprocess.run([*git, "commit", "-qam", "three"], check=True)
    assert gpu_next_part.why_due(first, ["code"], root=str(repo)).startswith("1 commit(s)")


def test_the_parts_table_names_every_part_in_order_and_existing_paths():
    import gpu_next_part
    rows = gpu_next_part.read_table()
    assert [part for part, _, _ in rows] == list(EXPECTED)
    for part, _, paths in rows:
        for path in paths:
            assert os.path.exists(os.path.join(ROOT, path)), (part, path)
