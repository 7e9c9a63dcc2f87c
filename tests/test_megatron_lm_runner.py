"""The Megatron-LM plug-in's scaffolding, without a Megatron-LM checkout: the version check
against fake checkouts, the releases table, the runner's command line and sys.path order,
and the CPU patch table. (tests/megatron_lm runs the real pretrain_gpt.py when
MEGATRON_LM_DIR is set.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_snake import releases
from megatron_snake.compat import megatron_lm_on_cpu
from megatron_snake.compat.megatron_on_cpu import PatchedSiteMoved
from megatron_snake.errors import UserError
from megatron_snake.megatron_lm import __main__ as runner
from megatron_snake.megatron_lm import version
from megatron_snake.megatron_lm.version import MegatronLMVersionError, check_megatron_lm
from megatron_snake.releases import CpuSite, Wrapped


def fake_checkout(root, version_parts=(0, 16, 1), files=None):
    """A directory shaped like a Megatron-LM checkout: package_info.py and the given files."""
    major, minor, patch = version_parts
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text(f'MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ""\n'
                    "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n"
                    "__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])\n")
    (root / "megatron" / "training").mkdir()
    for relpath, text in (files or {}).items():
        (root / relpath).write_text(textwrap.dedent(text))
    return root


INSTALLED = releases.imported()   # the megatron-core installed here (CI: 0.16.1)
SUPPORTED_TAGS = ("core_v0.16.1", "core_v0.17.0", "core_v0.18.0", "core_v0.19.0")


# --- the version check -----------------------------------------------------------------------

def test_checkout_version_is_read_as_text(tmp_path):
    assert version.checkout_version(fake_checkout(tmp_path)) == "0.16.1"
    assert version.checkout_version(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("found, series", [("0.16.1", "0.16"), ("0.17.0rc0", "0.17"),
                                           ("0.18.0", "0.18"), ("0.19.1", "0.19"),
                                           ("0.19.2", "0.19")])
def test_each_supported_release_is_accepted(found, series):
    """Each release's version as its package_info.py says it (core_v0.17.0's says 0.17.0rc0,
    core_v0.19.0's 0.19.1) and megatron-core's patch releases."""
    assert releases.release_of(found).series == series


@pytest.mark.parametrize("found", ["0.15.3", "0.20.0", "1.16.1", "(unreadable)", ""])
def test_another_release_is_not(found):
    assert releases.release_of(found) is None


def test_another_megatron_lm_is_refused_in_one_line_naming_the_supported_list(tmp_path):
    with pytest.raises(MegatronLMVersionError) as exc:
        check_megatron_lm(fake_checkout(tmp_path, (0, 20, 0)))
    msg = str(exc.value)
    assert isinstance(exc.value, UserError) and isinstance(exc.value, RuntimeError)
    assert "\n" not in msg
    assert all(tag in msg for tag in SUPPORTED_TAGS), msg
    assert "found Megatron-LM 0.20.0 at" in msg


def test_a_checkout_of_another_series_than_the_imported_megatron_core_is_refused(tmp_path):
    other = next(r for r in releases.RELEASES if r is not INSTALLED)
    major, minor = map(int, other.series.split("."))
    with pytest.raises(MegatronLMVersionError) as exc:
        check_megatron_lm(fake_checkout(tmp_path, (major, minor, 0)))
    msg = str(exc.value)
    assert "\n" not in msg and f"install megatron-core {other.series}.x" in msg, msg


def test_another_imported_megatron_core_is_refused(tmp_path, monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.15.2")
    with pytest.raises(MegatronLMVersionError, match=r"found megatron.core 0.15.2 imported from /"):
        check_megatron_lm(fake_checkout(tmp_path))


def test_a_wrapped_function_that_changed_upstream_is_named(tmp_path, monkeypatch):
    root = fake_checkout(tmp_path, files={"megatron/training/training.py": """
        def train():
            forward_backward_func = get_forward_backward_func()

        def evaluate():
            forward_backward_func = get_forward_backward_func(vp_stage=0)
        """})
    monkeypatch.setattr(releases, "WRAPPED", (
        Wrapped("megatron.training.training", "train", "forward_backward_func = get_forward_backward_func()"),
        Wrapped("megatron.training.training", "evaluate", "forward_backward_func = get_forward_backward_func()"),
        Wrapped("megatron.training.training", "get_model", "def get_model("),
        Wrapped("megatron.training.arguments", "parse_args", "parser = extra_args_provider(parser)"),
    ))
    with pytest.raises(MegatronLMVersionError) as exc:
        check_megatron_lm(root)
    msg = str(exc.value)
    assert "\n" not in msg and "core_v0.16.1" in msg
    assert "found a Megatron-LM 0.16 at" in msg
    assert ("megatron.training.training.evaluate no longer contains "
            "'forward_backward_func = get_forward_backward_func()'") in msg
    assert "megatron.training.training.get_model is missing" in msg
    assert "megatron.training.arguments is missing" in msg
    assert "training.train " not in msg  # the one that matches is not reported


def test_fragments_ignore_formatting_and_find_methods(tmp_path, monkeypatch):
    root = fake_checkout(tmp_path, files={"megatron/training/training.py": """
        try:
            class Trainer:
                def step(self):
                    losses = forward_backward_func(
                        model=model,
                        forward_only=False,
                    )
        except ImportError:
            pass
        """})
    monkeypatch.setattr(releases, "WRAPPED", (
        Wrapped("megatron.training.training", "Trainer.step",
                "losses = forward_backward_func(model=model, forward_only=False,)"),
        Wrapped("megatron.training.training", "", "class Trainer:"),
    ))
    check_megatron_lm(root)


def test_a_fragment_of_another_release_is_not_checked(tmp_path, monkeypatch):
    root = fake_checkout(tmp_path, files={"megatron/training/training.py": "def train():\n    pass\n"})
    later = releases.since(releases.SERIES[-1]) if INSTALLED.series != releases.SERIES[-1] \
        else releases.until(releases.SERIES[-2])
    monkeypatch.setattr(releases, "WRAPPED", (
        Wrapped("megatron.training.training", "train", "a line of another release", later),))
    check_megatron_lm(root)


@pytest.mark.parametrize("source", [
    "from megatron.training.checkpointing import load_checkpoint\n",
    "from megatron.training.checkpointing import (\n    checkpoint_exists,\n    load_checkpoint,\n)\n",
    "try:\n    from megatron.training.checkpointing import save_checkpoint, load_checkpoint\n"
    "except ImportError:\n    pass\n"])
def test_an_import_fragment_matches_any_import_of_the_name(source):
    assert releases.contains(source, "from megatron.training.checkpointing import load_checkpoint")


@pytest.mark.parametrize("source", [
    "from megatron.training.checkpointing import save_checkpoint\n",
    "from megatron.training.checkpointing_v2 import load_checkpoint\n",
    "load_checkpoint = None  # from megatron.training.checkpointing import load_checkpoint\n"])
def test_an_import_fragment_does_not_match_another_import(source):
    assert not releases.contains(source, "from megatron.training.checkpointing import load_checkpoint")


def test_a_relative_import_fragment_matches_the_relative_import():
    source = "from .utils import (\n    print_rank_0,\n    print_rank_last,\n)\n"
    assert releases.contains(source, "from .utils import print_rank_last")
    assert not releases.contains(source, "from megatron.training.utils import print_rank_last")


def test_the_releases_table():
    """One row per supported release, oldest first, each its own series; every fragment
    holds in at least one of them, and names only supported series."""
    assert tuple(r.tag for r in releases.RELEASES) == SUPPORTED_TAGS
    assert releases.SERIES == ("0.16", "0.17", "0.18", "0.19")
    assert releases.MEGATRON_CORE_REQUIREMENT == "megatron-core>=0.16.1,<0.20"
    with open(os.path.join(ROOT, "setup.py")) as f:   # what pip resolves: the same range
        assert f'"{releases.MEGATRON_CORE_REQUIREMENT}",' in f.read()
    for table in (releases.WRAPPED, releases.CPU_SITES):
        assert len(set(table)) == len(table)
        for site in table:
            assert site.module.startswith("megatron.") and site.fragment.strip()
            assert site.releases and set(site.releases) <= set(releases.SERIES), site


def test_megatron_core_sites_match_the_installed_megatron_core(tmp_path):
    """The entries read from megatron.core (the runner's dataset-helpers skip) need no
    checkout: they hold against the installed megatron-core here."""
    core_sites = [s for s in releases.wrapped_for(INSTALLED.series)
                  if s.module.startswith("megatron.core")]
    assert core_sites
    parsed = {}
    assert [version._site_problem(s, tmp_path, parsed) for s in core_sites] == [None] * len(core_sites)


# --- the CPU patches' table ------------------------------------------------------------------

@pytest.mark.parametrize("series, patches", [("0.16", "ABDEFGHI"), ("0.17", "ABEFGH"),
                                             ("0.18", "ABEFGH"), ("0.19", "ABEFGH")])
def test_the_cpu_patches_of_each_release(series, patches):
    """D (the legacy fused kernels) and I (triton's batch-invariant kernels) are 0.16's
    only: 0.17 removed the one and guards the other's import itself."""
    assert releases.cpu_patches_for(series) == patches


def test_cpu_patch_sites_in_megatron_core_match():
    for site in releases.cpu_sites_for(INSTALLED.series):
        if site.module.startswith("megatron.core"):
            assert releases.contains(megatron_lm_on_cpu._source(site), site.fragment), site.name


def test_a_moved_cpu_patch_site_fails_loudly(tmp_path, monkeypatch):
    (tmp_path / "fake_mlm_initialize.py").write_text("def initialize_megatron():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(megatron_lm_on_cpu, "_provide_triton_stub", lambda: None)
    monkeypatch.setattr(releases, "CPU_SITES", (
        CpuSite("fake_mlm_initialize", "initialize_megatron", "assert torch.cuda.is_available()", "A"),
        CpuSite("fake_mlm_initialize", "_set_random_seed", "if torch.cuda.device_count() > 0:", "B"),
    ))
    with pytest.raises(PatchedSiteMoved) as exc:
        megatron_lm_on_cpu.check_patched_sites()
    msg = str(exc.value)
    assert ("patch A: fake_mlm_initialize.initialize_megatron no longer contains "
            "'assert torch.cuda.is_available()'") in msg
    assert "patch B: fake_mlm_initialize._set_random_seed is gone" in msg
    assert f"Megatron-LM {INSTALLED.series}" in msg and "megatron_snake/releases.py" in msg


# --- the runner: sys.path -------------------------------------------------------------------

@pytest.fixture
def dirs(tmp_path):
    """Two Megatron-LM checkouts, a plain working directory and a site-packages (which has
    megatron/core too, but no megatron/training)."""
    made = {}
    for name in ("checkout", "other_checkout", "work", "site"):
        made[name] = str(tmp_path / name)
        os.makedirs(made[name])
    for name in ("checkout", "other_checkout"):
        for sub in ("core", "training"):
            os.makedirs(os.path.join(made[name], "megatron", sub))
    os.makedirs(os.path.join(made["site"], "megatron", "core"))
    return made


def test_the_checkout_goes_last_when_launched_from_inside_it(dirs):
    ckpt, site = dirs["checkout"], dirs["site"]
    # `python -m` from inside the checkout: the cwd comes first, and its megatron/core would win.
    assert runner.runner_sys_path([ckpt, site], ckpt, cwd=ckpt) == [site, ckpt]
    assert runner.runner_sys_path(["", site], ckpt, cwd=ckpt) == [site, ckpt]


def test_a_plain_working_directory_stays_first(dirs):
    ckpt, work, site = dirs["checkout"], dirs["work"], dirs["site"]
    assert runner.runner_sys_path([work, site], ckpt, cwd=work) == [work, site, ckpt]


def test_another_checkout_as_working_directory_is_dropped(dirs):
    ckpt, other, site = dirs["checkout"], dirs["other_checkout"], dirs["site"]
    assert runner.runner_sys_path([other, site], ckpt, cwd=other) == [site, ckpt]


def test_checkouts_on_pythonpath_move_after_site_packages(dirs, tmp_path):
    ckpt, other, work, site = dirs["checkout"], dirs["other_checkout"], dirs["work"], dirs["site"]
    link = str(tmp_path / "link_to_checkout")
    os.symlink(ckpt, link)
    path = [work, ckpt, other, site, link + "/"]
    assert runner.runner_sys_path(path, ckpt, cwd=work) == [work, site, other, ckpt]


def _with_megatron_core(directory, minor):
    fake_checkout_info = os.path.join(directory, "megatron", "core")
    os.makedirs(fake_checkout_info, exist_ok=True)
    with open(os.path.join(fake_checkout_info, "__init__.py"), "w"):
        pass
    with open(os.path.join(fake_checkout_info, "package_info.py"), "w") as f:
        f.write(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\nPRE_RELEASE = ''\n")


@pytest.mark.parametrize("installed, first", [(19, False), (16, True), (None, True)],
                         ids=["same_series", "another_series", "none"])
def test_the_checkouts_own_megatron_core_when_the_installed_one_is_another_release(
        dirs, installed, first):
    """A core_v0.19.0-like checkout: an installed megatron-core 0.19.x is imported (the
    checkout last); one of another series, or none, and the checkout's own comes first."""
    ckpt, work, site = dirs["checkout"], dirs["work"], dirs["site"]
    _with_megatron_core(ckpt, 19)
    if installed is not None:
        _with_megatron_core(site, installed)
    else:
        os.rename(os.path.join(site, "megatron"), os.path.join(site, "not_megatron"))
    path = runner.runner_sys_path([ckpt, work, site], ckpt, cwd=ckpt)
    assert path == ([ckpt, work, site] if first else [work, site, ckpt])
    # a script outside the checkout, which comes from PYTHONPATH
    path = runner.runner_sys_path([work, ckpt, site], work, cwd=work)
    assert path == ([ckpt, site, work] if first else [site, ckpt, work])


# --- the runner: command line and errors -----------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_module(args, cwd, **env):
    """The runner of this repository (its root on PYTHONPATH) in a child."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SNAKE_DEBUG")}
    return subprocess.run([sys.executable, "-m", "megatron_snake.megatron_lm", *args], cwd=cwd,
                          env={**environ, "PYTHONPATH": ROOT, **env}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, problem", [
    ([], "no SCRIPT given"),
    (["missing.py", "--lr", "1e-3"], "SCRIPT 'missing.py' does not exist"),
    (["notes.txt"], "SCRIPT must be a Python file (.py), got 'notes.txt'"),
    (["d.py"], "SCRIPT 'd.py' is a directory, not a Python file"),
])
def test_usage_errors_are_one_line_with_status_2(tmp_path, args, problem):
    (tmp_path / "notes.txt").write_text("not a script")
    (tmp_path / "d.py").mkdir()
    result = _run_module(args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("megatron_snake.megatron_lm: error: " + problem)
    assert "usage: python -m megatron_snake.megatron_lm SCRIPT.py" in lines[0]


def test_help_prints_usage(tmp_path):
    result = _run_module(["--help"], cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("usage: ")


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None,
                    reason="a Megatron-LM training package is importable here")
def test_no_megatron_lm_is_refused_in_one_line(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    result = _run_module([str(script)], cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "megatron.training is not importable" in lines[0]
    assert "core_v0.16.1" in lines[0]
    debug = _run_module([str(script)], cwd=tmp_path, SNAKE_DEBUG="1")
    assert "Traceback" in debug.stderr and "MegatronLMVersionError" in debug.stderr


@pytest.fixture
def in_process_runner(monkeypatch):
    """runner.main in this process, with a no-op install() and sys.path/argv restored."""
    import megatron_snake.megatron_lm as plugin

    monkeypatch.setattr(plugin, "install", lambda: None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv("SNAKE_DEBUG", raising=False)
    return runner.main


def test_the_script_runs_as_main_with_its_arguments(tmp_path, in_process_runner, capsys):
    script = tmp_path / "entry.py"
    script.write_text("import sys\nif __name__ == '__main__':\n"
                      "    print('argv', sys.argv[1:], sys.path[-1])\n")
    assert in_process_runner([str(script), "--lr", "1e-3"]) == 0
    assert capsys.readouterr().out == f"argv ['--lr', '1e-3'] {tmp_path}\n"


def test_a_user_error_in_the_script_is_one_line_with_its_status(tmp_path, in_process_runner,
                                                                 capsys, monkeypatch):
    script = tmp_path / "entry.py"
    script.write_text("from megatron_snake.errors import UserError\n"
                      "class FlagError(UserError):\n    exit_status = 3\n"
                      "raise FlagError('--snake-offload-dir /nowhere does not exist')\n")
    assert in_process_runner([str(script)]) == 3
    err = capsys.readouterr().err
    assert err == "megatron_snake.megatron_lm: error: --snake-offload-dir /nowhere does not exist\n"
    monkeypatch.setenv("SNAKE_DEBUG", "1")
    with pytest.raises(UserError, match="does not exist"):
        in_process_runner([str(script)])


@pytest.mark.parametrize("body", ["", "import sys\nsys.exit(0)\n"], ids=["empty", "exits_0"])
def test_a_script_that_never_calls_pretrain_with_snake_offload_fails_in_one_line(
        tmp_path, in_process_runner, capsys, body):
    """An empty pretrain_gpt.py (or one that is not Megatron-LM's) with --snake-offload would
    end with exit status 0 having trained and offloaded nothing."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(body)
    assert in_process_runner([str(script), "--snake-offload"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron_snake.megatron_lm: error: "
                                                   "--snake-offload: pretrain_gpt.py ended "
                                                   "without calling Megatron-LM's pretrain()"), err


def test_without_snake_offload_or_with_pretrain_called_the_script_ends_as_it_does(
        tmp_path, in_process_runner, capsys, monkeypatch):
    import megatron_snake.megatron_lm.hooks as hooks

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    assert in_process_runner([str(script)]) == 0
    assert in_process_runner([str(script), "--snake-offload", "--help"]) == 0
    monkeypatch.setattr(hooks, "_pretrain_called", True)
    assert in_process_runner([str(script), "--snake-offload"]) == 0
    assert capsys.readouterr().err == ""
