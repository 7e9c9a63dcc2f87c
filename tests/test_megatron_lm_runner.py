"""The Megatron-LM plug-in's scaffolding, without a Megatron-LM checkout: the version pin
against fake checkouts, the runner's command line and sys.path order, and the CPU patch
table. (tests/megatron_lm runs the real pretrain_gpt.py when MEGATRON_LM_DIR is set.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_snake.compat import megatron_lm_on_cpu
from megatron_snake.compat.megatron_on_cpu import PatchedSiteMoved
from megatron_snake.errors import UserError
from megatron_snake.megatron_lm import __main__ as runner
from megatron_snake.megatron_lm import version
from megatron_snake.megatron_lm.version import MegatronLMVersionError, Wrapped, check_megatron_lm


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


# --- the version pin -------------------------------------------------------------------------

def test_checkout_version_is_read_as_text(tmp_path):
    assert version.checkout_version(fake_checkout(tmp_path)) == "0.16.1"
    assert version.checkout_version(tmp_path / "elsewhere") is None


def test_another_megatron_lm_is_refused_in_one_line(tmp_path):
    with pytest.raises(MegatronLMVersionError) as exc:
        check_megatron_lm(fake_checkout(tmp_path, (0, 17, 0)))
    msg = str(exc.value)
    assert isinstance(exc.value, UserError) and isinstance(exc.value, RuntimeError)
    assert "\n" not in msg
    assert "core_v0.16.1" in msg and "found Megatron-LM 0.17.0 at" in msg


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
    monkeypatch.setattr(version, "WRAPPED", (
        Wrapped("megatron.training.training", "train", "forward_backward_func = get_forward_backward_func()"),
        Wrapped("megatron.training.training", "evaluate", "forward_backward_func = get_forward_backward_func()"),
        Wrapped("megatron.training.training", "get_model", "def get_model("),
        Wrapped("megatron.training.arguments", "parse_args", "parser = extra_args_provider(parser)"),
    ))
    with pytest.raises(MegatronLMVersionError) as exc:
        check_megatron_lm(root)
    msg = str(exc.value)
    assert "\n" not in msg and "core_v0.16.1" in msg
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
    monkeypatch.setattr(version, "WRAPPED", (
        Wrapped("megatron.training.training", "Trainer.step",
                "losses = forward_backward_func(model=model, forward_only=False,)"),
        Wrapped("megatron.training.training", "", "class Trainer:"),
    ))
    check_megatron_lm(root)


def test_wrapped_table_is_one_line_per_fragment():
    assert len(set(version.WRAPPED)) == len(version.WRAPPED)
    for site in version.WRAPPED:
        assert site.module.startswith("megatron.") and site.fragment.strip()


def test_megatron_core_sites_match_the_installed_megatron_core(tmp_path):
    """The entries read from megatron.core (the runner's dataset-helpers skip) need no
    checkout: they hold against the installed megatron-core here."""
    core_sites = [s for s in version.WRAPPED if s.module.startswith("megatron.core")]
    assert core_sites
    parsed = {}
    assert [version._site_problem(s, tmp_path, parsed) for s in core_sites] == [None] * len(core_sites)


# --- the CPU patches' table ------------------------------------------------------------------

def test_every_cpu_patch_is_keyed_on_a_site():
    assert {site.patch for site in megatron_lm_on_cpu.PATCHED_SITES} == set("ABDEFGHI")


def test_cpu_patch_sites_in_megatron_core_match():
    for site in megatron_lm_on_cpu.PATCHED_SITES:
        if site.module.startswith("megatron.core"):
            assert site.fragment in site.source(), site.name


def test_a_moved_cpu_patch_site_fails_loudly(tmp_path, monkeypatch):
    (tmp_path / "fake_mlm_initialize.py").write_text("def initialize_megatron():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(megatron_lm_on_cpu, "_provide_triton_stub", lambda: None)
    Site = megatron_lm_on_cpu.PatchedSite
    monkeypatch.setattr(megatron_lm_on_cpu, "PATCHED_SITES", (
        Site("fake_mlm_initialize", "initialize_megatron", "assert torch.cuda.is_available()", "A"),
        Site("fake_mlm_initialize", "_set_random_seed", "if torch.cuda.device_count() > 0:", "B"),
    ))
    with pytest.raises(PatchedSiteMoved) as exc:
        megatron_lm_on_cpu.check_patched_sites()
    msg = str(exc.value)
    assert ("patch A: fake_mlm_initialize.initialize_megatron no longer contains "
            "'assert torch.cuda.is_available()'") in msg
    assert "patch B: fake_mlm_initialize._set_random_seed is gone" in msg
    assert "core_v0.16.1" in msg


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


# --- the runner: command line and errors -----------------------------------------------------

def _run_module(args, cwd, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SNAKE_DEBUG")}
    return subprocess.run([sys.executable, "-m", "megatron_snake.megatron_lm", *args], cwd=cwd,
                          env={**environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, problem", [
    ([], "no SCRIPT given"),
    (["missing.py", "--lr", "1e-3"], "SCRIPT 'missing.py' does not exist"),
    (["notes.txt"], "SCRIPT must be a Python file (.py), got 'notes.txt'"),
])
def test_usage_errors_are_one_line_with_status_2(tmp_path, args, problem):
    (tmp_path / "notes.txt").write_text("not a script")
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
