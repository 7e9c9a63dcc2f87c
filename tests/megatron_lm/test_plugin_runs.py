"""Megatron-LM's own pretrain_gpt.py with ``--snake-offload`` against the same command without
it: the same printed losses, gradient norms and evaluation losses (dropout 0, fp32, 10
iterations) at one rank and under torchrun with TP 2, PP 2 and DP 2; checkpoints that load
both ways between plain and plug-in runs, also across a tensor-parallel change, each going
on as Megatron-LM's own resume does; a forward step of one's own whose loss function reports
one more value; the refusals. (Skips unless MEGATRON_LM_DIR names a checkout of a supported
release; see conftest.py.)

Each run costs 10-90 s on a CPU, so each is launched once per module (``Runs``) and shared by
the tests that read it.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

from .conftest import (TINY_FLAGS, Run, assert_trained, launch_pretrain_gpt, parse_log,
                       refuse_pretrain_gpt)

# Dropout off: the snake draws each unit's dropout masks in its own order (docs/megatron_lm.md).
FLAGS = [*TINY_FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0"]
SAVE = ["--ckpt-format", "torch_dist", "--save-interval", "5"]
TOLERANCE = 1e-5

# name -> (processes, flags on top of FLAGS). Two processes take 4 micro-batches of 2 per step
# (2 per data-parallel rank with DP 2).
PARALLEL = {
    "tp2": (2, ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
    "dp2": (2, ["--global-batch-size", "8"]),
}


class Runs:
    """The module's runs, each launched the first time a test asks for it."""

    def __init__(self, megatron_lm_dir: Path, directory: Path):
        self.checkout, self.dir = megatron_lm_dir, directory
        self._done: dict[str, Run] = {}

    def get(self, name: str, *flags: str, nproc: int = 1, **kwargs) -> Run:
        if name not in self._done:
            self._done[name] = launch_pretrain_gpt(self.checkout, self.dir / f"{name}.log", *flags,
                                                   nproc=nproc, **kwargs)
        return self._done[name]

    def ckpt(self, name: str) -> Path:
        return self.dir / f"ckpt_{name}"

    # One rank, saving at 5 and 10: the reference of the one-rank tests and the checkpoints
    # the loading tests start from.
    def plain(self) -> Run:
        return self.get("plain", *FLAGS, *SAVE, "--save", str(self.ckpt("plain")))

    def plugin(self) -> Run:
        return self.get("plugin", *FLAGS, *SAVE, "--save", str(self.ckpt("plugin")),
                        "--snake-offload")


@pytest.fixture(scope="module")
def runs(megatron_lm_dir, tmp_path_factory) -> Runs:
    if importlib.util.find_spec("psutil") is None:
        pytest.skip("psutil is not installed: megatron-core's torch_dist checkpoint writer needs "
                    "it for the plain runs' saves (without it the save hangs)")
    return Runs(megatron_lm_dir, tmp_path_factory.mktemp("plugin_runs"))


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


def assert_same_numbers(run: Run, reference: Run, iterations=range(1, 11),
                        evaluations=((5, ""), (10, ""), (10, "validation"), (10, "test"))) -> None:
    """``run`` printed ``reference``'s losses, grad norms and evaluation losses (within 1e-5)."""
    run.check()
    assert sorted(run.losses) == list(iterations), run.output[-4000:]
    for i in iterations:
        assert close(run.losses[i], reference.losses[i]), \
            f"iteration {i}: lm loss {run.losses[i]} against {reference.losses[i]}"
        assert close(run.grad_norms[i], reference.grad_norms[i]), \
            f"iteration {i}: grad norm {run.grad_norms[i]} against {reference.grad_norms[i]}"
    for key in evaluations:
        assert close(run.validation[key], reference.validation[key]), \
            f"evaluation {key}: {run.validation[key]} against {reference.validation[key]}"


def assert_resumed_from_5(run: Run, uninterrupted: Run) -> None:
    """``run`` loaded iteration 5 and went on to ``uninterrupted``'s iterations 6-10 and final
    evaluations. Megatron-LM logs a run's second iteration as the mean of its first two (its
    interval sums start at the first iteration), so the resumed 7 is the mean of 6 and 7."""
    expected = Run(0, "", dict(uninterrupted.losses), uninterrupted.grad_norms,
                   uninterrupted.validation)
    expected.losses[7] = (uninterrupted.losses[6] + uninterrupted.losses[7]) / 2
    assert_same_numbers(run, expected, iterations=range(6, 11),
                        evaluations=((10, ""), (10, "validation"), (10, "test")))


def test_one_rank_equals_plain(runs):
    assert_trained(runs.plain())
    assert_same_numbers(runs.plugin(), runs.plain())
    assert " snake: " in runs.plugin().output   # the plug-in's suffix: it did run


def test_the_preflight_counts_the_model_megatron_lm_builds(runs):
    """Megatron-LM's --num-query-groups is 1 unless --group-query-attention is given; the
    pre-flight (and --snake-auto's planner) must count one key/value group per head then."""
    output = runs.plugin().check().output
    planned = re.search(r"> pre-flight \(from the flags[^:]*: ([0-9,]+) parameters \(([0-9.]+)M\)",
                        output)
    built = re.search(r"> megatron_snake: ([0-9.]+)M parameters on this rank", output)
    assert planned and built, output[-4000:]
    assert planned.group(2) == built.group(1), (planned.group(0), built.group(0))


@pytest.mark.parametrize("name", list(PARALLEL))
def test_two_processes_equal_plain(runs, name):
    nproc, flags = PARALLEL[name]
    plain = runs.get(f"plain_{name}", *FLAGS, *flags, nproc=nproc)
    assert_trained(plain)
    plugin = runs.get(f"plugin_{name}", *FLAGS, *flags, "--snake-offload", nproc=nproc)
    assert_same_numbers(plugin, plain)
    assert " snake: " in plugin.output


def test_clip_grad_and_snake_alpha_stated_explicitly(runs):
    """--clip-grad 1.0 is Megatron-LM's default (the plain run clips with it: its grad norms
    are above 1) and 0.25 the snake's: stated, they change nothing."""
    plain = runs.plain()
    assert max(plain.grad_norms.values()) > 1.0   # clipping is at work
    run = runs.get("plugin_clip_alpha", *FLAGS, "--clip-grad", "1.0", "--snake-alpha", "0.25",
                   "--snake-offload")
    assert re.search(r"^  clip_grad \.+ 1\.0$", run.output, re.M)
    assert re.search(r"^  snake_alpha \.+ 0\.25$", run.output, re.M)
    assert_same_numbers(run, plain)


# Checkpoints both ways. The reference of every resumed run is Megatron-LM's own resume of
# its own checkpoint (plain_from_plain), not the uninterrupted run: Megatron-LM itself does not
# always resume a mock-data run to the uninterrupted losses, and what is asked of the plug-in
# is what Megatron-LM does. All load iteration 5 of a run saved at 5 and 10 (torch_dist).
LATER = ((10, ""), (10, "validation"), (10, "test"))


def resumed(runs, name: str, source: str, *flags: str, nproc: int = 1) -> Run:
    return runs.get(name, *FLAGS, "--load", str(runs.ckpt(source)), "--ckpt-step", "5",
                    *flags, nproc=nproc)


def megatron_lms_own_resume(runs) -> Run:
    runs.plain().check()
    assert (runs.ckpt("plain") / "iter_0000005").is_dir()
    reference = resumed(runs, "plain_from_plain", "plain").check()
    assert sorted(reference.losses) == [6, 7, 8, 9, 10], reference.output[-4000:]
    return reference


def test_the_plugin_continues_its_own_checkpoint(runs):
    assert_same_numbers(runs.plugin(), runs.plain())
    assert (runs.ckpt("plugin") / "iter_0000005").is_dir()
    run = resumed(runs, "plugin_from_plugin", "plugin", "--snake-offload")
    assert_same_numbers(run, megatron_lms_own_resume(runs), iterations=range(6, 11),
                        evaluations=LATER)


def test_plain_megatron_lm_continues_the_plugins_checkpoint(runs):
    """The plug-in writes Megatron-LM's own rng_state beside its own: a plain run loads it all."""
    runs.plugin().check()
    run = resumed(runs, "plain_from_plugin", "plugin")
    assert "RNG state not loaded" not in run.output
    assert " snake: " not in run.output
    assert_same_numbers(run, megatron_lms_own_resume(runs), iterations=range(6, 11),
                        evaluations=LATER)


def test_the_plugin_continues_a_plain_checkpoint(runs):
    """A plain run's RNG state holds numpy objects, which the plug-in does not unpickle: it says
    so and goes on with its own RNG (the same numbers here: dropout is off)."""
    run = resumed(runs, "plugin_from_plain", "plain", "--snake-offload")
    assert "RNG state not loaded: " in run.output
    assert_same_numbers(run, megatron_lms_own_resume(runs), iterations=range(6, 11),
                        evaluations=LATER)


def test_checkpoints_both_ways_across_a_tensor_parallel_change(runs):
    """The one-rank checkpoints resharded at load into TP 2 (torch_dist): the plug-in goes on
    from the plain one, and plain Megatron-LM from the plug-in's, to the numbers Megatron-LM
    prints going on from its own at TP 2. (Those are not always near its one-rank resume:
    Megatron-LM 0.18's TP 2 resume of this checkpoint printed 5.08 at iteration 6 against
    4.39 at one rank; 0.16's and 0.17's stayed within 1e-3.)"""
    runs.plain().check()
    runs.plugin().check()
    tp2 = ["--tensor-model-parallel-size", "2"]
    reference = resumed(runs, "plain_tp2_from_plain", "plain", *tp2, nproc=2)
    plugin = resumed(runs, "plugin_tp2_from_plain", "plain", *tp2, "--snake-offload", nproc=2)
    plain = resumed(runs, "plain_tp2_from_plugin", "plugin", *tp2, nproc=2)
    for run in (plugin, plain):
        assert_same_numbers(run, reference, iterations=range(6, 11), evaluations=LATER)


# pretrain_gpt.py's forward step wrapped so that its loss function reports one more value,
# then the checkout's own `if __name__ == "__main__":` block run in pretrain_gpt's namespace
# (how pretrain is called changed in 0.18 and 0.19; the entry script of one's own follows its
# release). pretrain_gpt is imported from the checkout (on PYTHONPATH).
CUSTOM_SCRIPT = '''\
"""pretrain_gpt.py with a loss function that also reports twice the lm loss."""
import torch

import pretrain_gpt

forward_step_of_pretrain_gpt = pretrain_gpt.forward_step


def forward_step(data_iterator, model, return_schedule_plan=False):
    output_tensor, loss_func = forward_step_of_pretrain_gpt(data_iterator, model,
                                                            return_schedule_plan)

    def loss_func_reporting_x2(output_tensor):
        loss, num_tokens, report = loss_func(output_tensor)
        numerator, denominator = report["lm loss"]   # Megatron's [sum, tokens]
        report["lm loss x2"] = torch.stack([2 * numerator, denominator])
        return loss, num_tokens, report

    return output_tensor, loss_func_reporting_x2


if __name__ == "__main__":
    pretrain_gpt.forward_step = forward_step
    with open(pretrain_gpt.__file__) as f:
        source = f.read()
    main = source[source.index('if __name__ == "__main__":'):]
    exec(compile(main.replace('if __name__ == "__main__":', "if True:", 1),
                 pretrain_gpt.__file__, "exec"), vars(pretrain_gpt))
'''

_X2 = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*\blm loss x2: ([-+0-9.Ee]+) \|")
_X2_EVALUATION = re.compile(r"validation loss at iteration (\d+)(?: on (\w+) set)? \|.*"
                            r"\blm loss x2 value: ([-+0-9.Ee]+) \|")


def test_a_custom_forward_step_reports_an_extra_value(runs):
    script = runs.dir / "custom_pretrain_gpt.py"
    script.write_text(CUSTOM_SCRIPT)
    custom, evaluations = {}, {}
    for name, extra in (("plain", []), ("plugin", ["--snake-offload"])):
        run = runs.get(f"custom_{name}", *FLAGS, *extra, script=script,
                       pythonpath=runs.checkout).check()
        custom[name] = {int(m.group(1)): float(m.group(2)) for m in _X2.finditer(run.output)}
        assert sorted(custom[name]) == list(range(1, 11)), run.output[-4000:]
        for i, x2 in custom[name].items():
            assert math.isclose(x2, 2 * run.losses[i], rel_tol=2e-6), (name, i)
        evaluations[name] = {(int(m.group(1)), m.group(2) or ""): float(m.group(3))
                             for m in _X2_EVALUATION.finditer(run.output)}
        assert set(evaluations[name]) == {(5, ""), (10, ""), (10, "validation"), (10, "test")}
        # The rest is pretrain_gpt.py's: the same numbers as the plain run of the checkout's script.
        assert_same_numbers(run, runs.plain())
    for i in range(1, 11):
        assert close(custom["plugin"][i], custom["plain"][i]), \
            f"iteration {i}: lm loss x2 {custom['plugin'][i]} against {custom['plain'][i]}"
    for key, x2 in evaluations["plain"].items():
        assert close(evaluations["plugin"][key], x2), f"evaluation {key}: lm loss x2"


@pytest.mark.parametrize("flags, named, series", [
    (["--snake-offload", "--recompute-granularity", "full"], "--recompute-granularity", None),
    (["--snake-offload", "--ckpt-format", "torch"], "--ckpt-format", None),
    (["--snake-alpha", "0.3"], "--snake-alpha", None),
    (["--snake-offload", "--check-for-large-grads"], "--check-for-large-grads", None),
    # Megatron-LM's own checks of these are AssertionError tracebacks
    (["--snake-offload", "--save", "ckpt"], "--save", None),
    (["--snake-offload", "--ckpt-convert-format", "torch"], "--ckpt-convert-format", None),
    (["--snake-offload", "--use-legacy-models"], "--use-legacy-models", ("0.16", "0.17")),
], ids=["recompute_granularity", "ckpt_format_torch", "snake_alpha_without_offload",
        "check_for_large_grads", "save_without_save_interval", "ckpt_convert_format",
        "use_legacy_models"])
def test_refusals(megatron_lm_dir, tmp_path, release, flags, named, series):
    if series is not None and release.series not in series:
        pytest.skip(f"{named} is not a flag of Megatron-LM {release.series}")
    result = refuse_pretrain_gpt(megatron_lm_dir, tmp_path, *FLAGS, *flags)
    assert result.returncode == 2, result.stderr[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr[-4000:]
    assert errors[0].startswith(f"pretrain_gpt.py: error: {named}: "), errors[0]
    assert not parse_log(result.stdout)[0], "it trained"


@pytest.mark.parametrize("body", ["", "print('not Megatron-LM')\n"], ids=["empty", "another"])
def test_a_script_that_never_calls_pretrain_says_the_plugin_was_not_used(megatron_lm_dir,
                                                                          tmp_path, body):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(body)
    run = launch_pretrain_gpt(megatron_lm_dir, tmp_path / "never.log", *FLAGS, "--snake-offload",
                              script=script, pythonpath=megatron_lm_dir)
    assert run.returncode == 1, run.output[-4000:]
    errors = [line for line in run.output.splitlines() if "error" in line.lower()]
    assert errors == ["megatron_snake.megatron_lm: error: --snake-offload: pretrain_gpt.py ended "
                      "without calling Megatron-LM's pretrain(): nothing was trained or "
                      "offloaded, the plug-in was never used (run Megatron-LM's pretrain_gpt.py, "
                      "or a script that calls megatron.training.pretrain)"], run.output[-4000:]
