"""Tests of tools/plot_timeline.py: a recorded Timeline drawn as a PNG, the busy-time union,
and the one-line error on a file that is not a trace.

Run: python -m pytest -q tests/test_plot_timeline.py
"""

import importlib.util
import json
import os
import threading
import time

import pytest

import megatron_snake.timeline as timeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT_TIMELINE = os.path.join(REPO, "tools", "plot_timeline.py")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("plot_timeline", PLOT_TIMELINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_seconds_merges_overlaps(tool):
    assert tool.busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert tool.busy_seconds([(3, 4), (0, 5)]) == pytest.approx(5.0)   # contained
    assert tool.busy_seconds([]) == 0.0


def test_draws_a_recorded_timeline(tool, tmp_path, capsys):
    pytest.importorskip("matplotlib")

    def store_worker():
        with timeline.span("put weights", "store"):
            with timeline.span("drive write weights", "drive"):
                time.sleep(0.02)

    with timeline.recording() as recorded:
        worker = threading.Thread(target=store_worker, name="snake-store-write-0")
        worker.start()
        with timeline.span("forward sweep", "sweep"):
            for mb in range(2):
                with timeline.span(f"F u0 mb{mb}", "compute"):
                    time.sleep(0.01)
            with timeline.span("store.wait", "wait"):
                worker.join()
    trace, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    trace.write_text(json.dumps(recorded.chrome_trace()))

    tool.main([str(trace), str(png), "--title", "test"])

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000
    table = capsys.readouterr().out
    main_line = next(line for line in table.splitlines() if line.startswith("MainThread"))
    assert "compute" in main_line
    assert float(main_line.split("compute")[1].split()[0]) >= 0.02
    assert any(line.startswith("snake-store-write-0") for line in table.splitlines())


def test_not_a_trace_is_a_one_line_error(tool, tmp_path, capsys):
    bad = tmp_path / "not_a_trace.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit) as exit_info:
        tool.main([str(bad), str(tmp_path / "out.png")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert str(bad) in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "out.png").exists()
