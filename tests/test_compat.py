"""Megatron-Core on a CPU-only torch: the five patches work, and moving a patched site is
caught loudly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_snake.compat import megatron_on_cpu


def test_patched_sites_match_the_installed_megatron_core():
    megatron_on_cpu.check_patched_sites()  # raises PatchedSiteMoved on any mismatch


def test_moved_site_fails_loudly(monkeypatch):
    from megatron_snake import releases

    site = releases.CORE_CPU_SITES[0]
    moved = site._replace(fragment="a line Megatron no longer has")
    gone = site._replace(qualname="function_renamed_upstream")
    monkeypatch.setattr(releases, "CORE_CPU_SITES", (moved, gone))
    with pytest.raises(megatron_on_cpu.PatchedSiteMoved) as exc:
        megatron_on_cpu.check_patched_sites()
    msg = str(exc.value)
    assert "no longer contains 'a line Megatron no longer has'" in msg
    assert "function_renamed_upstream is gone" in msg
    assert "megatron-core>=0.16.1,<0.20" in msg


def test_version_mismatch_is_reported(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(megatron_on_cpu.PatchedSiteMoved, match="megatron-core is 0.99.0"):
        megatron_on_cpu.check_patched_sites()


def test_not_applied_for_a_gpu_device():
    assert megatron_on_cpu.apply(torch.device("cuda")) is False


def test_cpu_patches_in_effect(megatron_world):
    assert megatron_on_cpu.is_applied()
    assert torch.cuda.current_device() == "cpu"                       # patch 2
    torch.cuda.synchronize()                                          # patch 3: no-op
    assert torch.zeros(3, device="cuda").device.type == "cpu"         # patch 4
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"          # patch 5
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2, dtype=torch.int64).type() == "torch.LongTensor"


def test_rng_tracker_forks_the_cpu_generator(megatron_world):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_snake.training.distributed import set_seed

    set_seed(3)
    tracker = get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {"data-parallel-rng", "model-parallel-rng",
                                         "expert-parallel-rng"}
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default stream"
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b), "the tracked stream must advance between forks"
    set_seed(3)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), a), "same seed, same tracked stream"
    # The tracked stream differs from the default stream of the same seed.
    set_seed(3)
    assert not torch.equal(torch.rand(4), a)


def test_megatron_full_recompute_runs_on_cpu(megatron_world):
    """Megatron's CheckpointFunction saves/restores 'CUDA' RNG state: patched to the CPU's."""
    from conftest import build_model, make_microbatches, megatron_forward_backward, tiny_args

    model = build_model(tiny_args("--hidden-dropout", "0.1"), megatron_world)
    cfg = model.config
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = \
        "full", "uniform", 1  # Megatron's uniform method needs interval | layers
    try:
        losses = megatron_forward_backward(model, make_microbatches(2))
    finally:
        cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None
    assert all(torch.isfinite(l) for l in losses)
    assert all(p.grad is not None for p in model.parameters())


KERNELS = """\
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def copy_kernel(src, dst, N: tl.constexpr):
    tl.store(dst, tl.load(src))


def launch(src, dst):
    copy_kernel[(1,)](src, dst, BLOCK)
"""


def test_a_module_importing_triton_at_its_top_loads_with_a_stand_in(tmp_path, monkeypatch):
    """megatron-core 0.18's import path imports triton for MoE kernels: where triton is
    missing, such a module (named by the release's row) loads, its kernels refuse when
    launched, and triton stays unimportable for everyone else (torch asks)."""
    import importlib.util
    import sys

    from megatron_snake import releases
    from megatron_snake.compat import megatron_import
    from megatron_snake.errors import UserError

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed here: no stand-in is needed")
    (tmp_path / "snake_test_kernels.py").write_text(KERNELS)
    core = tmp_path / "site" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 18\nPATCH = 0\nPRE_RELEASE = ''\n")
    row = dataclasses.replace(releases.release_of("0.18.0"), triton_at_import=("snake_test_kernels",))
    monkeypatch.setattr(releases, "RELEASES", tuple(row if r.series == "0.18" else r
                                                    for r in releases.RELEASES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    with pytest.raises(ImportError):
        __import__("snake_test_kernels")   # without the stand-in
    sys.modules.pop("snake_test_kernels", None)
    assert megatron_import.prepare(core) is row
    kernels = __import__("snake_test_kernels")
    try:
        assert kernels.BLOCK == 1024
        with pytest.raises(UserError, match="triton is not installed"):
            kernels.launch(None, None)
        assert "triton" not in sys.modules and importlib.util.find_spec("triton") is None
    finally:
        sys.modules.pop("snake_test_kernels", None)
        megatron_import._prepared_for.discard("snake_test_kernels")


def test_typing_override_is_provided_for_a_release_that_imports_it(tmp_path, monkeypatch):
    import typing

    from megatron_snake.compat import megatron_import

    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\nPRE_RELEASE = ''\n")
    monkeypatch.delattr(typing, "override", raising=False)
    monkeypatch.setattr(megatron_import, "_prepared_for", set(megatron_import._prepared_for))
    monkeypatch.setattr(megatron_import.sys, "meta_path", list(megatron_import.sys.meta_path))
    assert megatron_import.prepare(core).series == "0.19"

    @typing.override
    def method():
        return 1

    assert method() == 1


@pytest.mark.parametrize("minor", [15, 20, None], ids=["0.15", "0.20", "none"])
def test_the_own_loop_refuses_another_megatron_core_in_one_line(tmp_path, minor):
    """examples/pretrain_gpt.py checks the megatron-core it would import before importing it
    (another release may not import at all): one line naming what it found and the range."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    core = tmp_path / "site" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise SystemExit('the check must come before this')\n")
    if minor is not None:
        (core / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 2\n"
                                              "PRE_RELEASE = ''\n")
    else:   # no megatron-core at all: a directory that is not one
        (core / "__init__.py").unlink()
        core.rename(tmp_path / "site" / "megatron" / "not_core")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), root]))
    if minor is None:   # hide the installed one too: only our site and the repository
        env["PYTHONNOUSERSITE"] = "1"
        code = ("import sys, runpy; sys.path[:] = [p for p in sys.path if 'site-packages' "
                f"not in p]; sys.argv = ['pretrain_gpt.py']; runpy.run_path("
                f"{os.path.join(root, 'examples', 'pretrain_gpt.py')!r}, run_name='__main__')")
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, os.path.join(root, "examples", "pretrain_gpt.py")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), proc.stderr
    assert "megatron-core>=0.16.1,<0.20" in lines[0]
    if minor is not None:
        assert f"found megatron-core 0.{minor}.2 at {core}" in lines[0], lines[0]
    else:
        assert "megatron-core is not installed" in lines[0], lines[0]
