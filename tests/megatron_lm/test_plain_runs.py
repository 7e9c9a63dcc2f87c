"""Megatron-LM's own pretrain_gpt.py, without --snake-offload, through the plug-in's runner:
it trains on the CPU, imports the megatron.core of the checkout's release, and a torch_dist
checkpoint resumes to the same losses. (Skips unless MEGATRON_LM_DIR names a checkout of a
supported release; see conftest.py.)"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap

import pytest

from megatron_snake import releases

from .conftest import ROOT, TINY_FLAGS, assert_trained


def installed_series() -> str:
    """The series of the megatron-core installed beside this interpreter (not imported: the
    checkout's may be the one to import)."""
    code = ("import importlib.util, os, sys; from megatron_snake import releases; "
            "spec = importlib.util.find_spec('megatron.core'); "
            "print(releases.series_of(releases.version_at(os.path.dirname(os.path.dirname("
            "os.path.dirname(spec.origin)))) or '') if spec else '')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT).stdout.strip()


def test_the_checkout_passes_the_version_check(megatron_lm_dir, release):
    # In a child: the checkout's megatron.core may be the one to import
    code = (f"import sys; sys.path.insert(0, {str(megatron_lm_dir)!r}); "
            "from megatron_snake.megatron_lm.version import check_megatron_lm; "
            f"print(check_megatron_lm({str(megatron_lm_dir)!r}).tag)")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split()[-1] == release.tag


def test_the_cpu_patch_sites_match_the_checkout(megatron_lm_dir):
    # In a child: importing megatron.training here would change this process for other tests.
    code = (f"import sys; sys.path.insert(0, {str(megatron_lm_dir)!r}); "
            "from megatron_snake.compat import megatron_lm_on_cpu; "
            "megatron_lm_on_cpu.check_patched_sites()")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


def test_the_runner_imports_the_megatron_core_of_the_checkouts_release(pretrain_gpt,
                                                                       megatron_lm_dir, release):
    """The installed megatron-core where it is of the checkout's series, else the checkout's
    own megatron/core: the runner's first line says which."""
    run = pretrain_gpt(*TINY_FLAGS, "--train-iters", "1", "--eval-iters", "0").check()
    line = re.search(r"> megatron_snake.megatron_lm: Megatron-LM at (\S+) \((\S+)'s series\), "
                     r"megatron.core (\S+) from (\S+)", run.output)
    assert line, run.output[-4000:]
    assert (line.group(1), line.group(2)) == (str(megatron_lm_dir), release.tag)
    assert releases.series_of(line.group(3)) == release.series
    own = str(megatron_lm_dir / "megatron" / "core")
    assert (line.group(4) == own) == (installed_series() != release.series), line.group(0)


def test_one_process_trains_from_inside_the_checkout(pretrain_gpt, megatron_lm_dir):
    """Launched from the checkout, `-m` puts it first on sys.path; the runner still imports
    the installed megatron-core (whose dataset helpers are built)."""
    assert_trained(pretrain_gpt(*TINY_FLAGS, cwd=megatron_lm_dir))


@pytest.mark.parametrize("parallel", [[], ["--tensor-model-parallel-size", "2"]],
                         ids=["data_parallel", "tensor_parallel"])
def test_two_processes_train(torchrun_pretrain_gpt, parallel):
    assert_trained(torchrun_pretrain_gpt(*TINY_FLAGS, *parallel))


@pytest.mark.parametrize("first", ["install", "import_megatron_training"])
def test_a_custom_entry_script_installs_the_plugin_itself(pretrain_gpt, megatron_lm_dir, tmp_path,
                                                          first, release):
    """``snake.install()`` at the top of a script of one's own, before megatron.training is
    imported, or after it (which needs triton: the CPU patch I cannot come first then). The
    checkout goes after site-packages where the installed megatron-core is of its release,
    before it (its own megatron/core) otherwise."""
    if first == "import_megatron_training" and importlib.util.find_spec("triton") is None:
        pytest.skip("importing megatron.training before install() needs triton")
    where = "append" if installed_series() == release.series else "insert(0, "
    script = tmp_path / "my_pretrain.py"
    script.write_text(textwrap.dedent(f"""\
        import runpy, sys
        sys.path.{where}({str(megatron_lm_dir)!r}){"" if where == "append" else ")"}
        {"import megatron.training" if first != "install" else ""}
        import megatron_snake.megatron_lm as snake
        snake.install()
        runpy.run_path({str(megatron_lm_dir / "pretrain_gpt.py")!r}, run_name="__main__")
        """))
    assert_trained(pretrain_gpt(*TINY_FLAGS, script=script, runner=False))


def test_a_torch_dist_checkpoint_resumes_to_the_same_losses(pretrain_gpt, tmp_path, needs_psutil):
    """Train 10 iterations saving at 5 and 10, then resume from 5: iterations 6-10 and the
    evaluations repeat exactly (dropout is on: the RNG states come back too)."""
    ckpt = ["--ckpt-format", "torch_dist", "--save-interval", "5"]
    whole = pretrain_gpt(*TINY_FLAGS, *ckpt, "--save", str(tmp_path / "a"))
    assert_trained(whole)
    assert (tmp_path / "a" / "iter_0000005").is_dir()
    resumed = pretrain_gpt(*TINY_FLAGS, *ckpt, "--load", str(tmp_path / "a"), "--ckpt-step", "5",
                           "--save", str(tmp_path / "b")).check()

    assert sorted(resumed.losses) == [6, 7, 8, 9, 10], resumed.output[-4000:]
    for i in (6, 8, 9, 10):
        assert resumed.losses[i] == whole.losses[i], i
    # Megatron-LM logs the second iteration of a run as the mean of the first two.
    assert resumed.losses[7] == pytest.approx((whole.losses[6] + whole.losses[7]) / 2, rel=2e-6)
    assert {i: resumed.grad_norms[i] for i in range(6, 11)} == \
        {i: whole.grad_norms[i] for i in range(6, 11)}
    for key in ((10, ""), (10, "validation"), (10, "test")):
        assert resumed.validation[key] == whole.validation[key], key
