"""``python -m megatron_snake.megatron_lm SCRIPT.py [ARGS...]``: run a Megatron-LM entry
script (``pretrain_gpt.py``) as ``__main__`` with the plug-in installed.

In order: ``sys.argv`` becomes ``[SCRIPT, *ARGS]``; ``sys.path`` is arranged so that an
installed megatron-core of the checkout's release series is imported (else the checkout's
own ``megatron/core``) while ``megatron.training`` and the script's own modules
(``gpt_builders``, ``model_provider``) come from the script's checkout
(``runner_sys_path``); ``megatron_snake.megatron_lm.install()``; then the script runs. A
refusal (``megatron_snake.errors.UserError``) is one line on one rank, with its exit status
(2 for a wrong command line); ``SNAKE_DEBUG=1`` keeps the traceback.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys
import types

from megatron_snake import errors, releases

PROG = "megatron_snake.megatron_lm"
USAGE = f"usage: python -m {PROG} SCRIPT.py [SCRIPT ARGS...] (SCRIPT: e.g. Megatron-LM's pretrain_gpt.py)"


class UsageError(errors.UserError):
    exit_status = 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        script, script_args = _script(argv)
        script_dir = os.path.dirname(script)
        sys.path[:] = runner_sys_path(sys.path, script_dir, os.getcwd())
        _check_training_package(script_dir)
        sys.argv = [script, *script_args]  # before install(): hooks may read the flags
        from megatron_snake.megatron_lm import install

        install()
        try:
            run_as_main(script)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        _check_the_plugin_ran(script, script_args)
    except errors.UserError as exc:
        if errors.debugging():
            raise
        return errors.report(exc, prog=PROG)
    return 0


def _script(argv: list[str]) -> tuple[str, list[str]]:
    if not argv:
        raise UsageError(f"no SCRIPT given; {USAGE}")
    script = os.path.abspath(argv[0])
    if not script.endswith(".py"):
        raise UsageError(f"SCRIPT must be a Python file (.py), got {argv[0]!r}; {USAGE}")
    if os.path.isdir(script):
        raise UsageError(f"SCRIPT {argv[0]!r} is a directory, not a Python file; {USAGE}")
    if not os.path.isfile(script):
        raise UsageError(f"SCRIPT {argv[0]!r} does not exist; {USAGE}")
    return script, argv[1:]


def run_as_main(script: str) -> None:
    """``runpy.run_path(script, run_name="__main__")``, but with ``__spec__`` naming
    ``megatron_snake.megatron_lm.child``: what a process the run spawns imports as its main
    module instead of the script (child.py says why). A function the script defines is not
    found in such a process by name (``__main__.f``); megatron-core sends it none."""
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=builtins, __loader__=None,
                         __package__=None, __cached__=None,
                         __spec__=importlib.util.find_spec("megatron_snake.megatron_lm.child"))
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _check_the_plugin_ran(script: str, script_args: list[str]) -> None:
    """With --snake-offload, a script that ends (exit status 0) without reaching Megatron-LM's
    pretrain() trained and offloaded nothing: that is said, and the run fails (unless the
    flags asked for --help)."""
    import megatron_snake.megatron_lm.hooks as hooks

    asked_for_help = any(a in ("-h", "--help") for a in script_args)
    if "--snake-offload" in script_args and not asked_for_help and not hooks.pretrain_called():
        raise errors.UserError(
            f"--snake-offload: {os.path.basename(script)} ended without calling Megatron-LM's "
            "pretrain(): nothing was trained or offloaded, the plug-in was never used (run "
            "Megatron-LM's pretrain_gpt.py, or a script that calls megatron.training.pretrain)")


def runner_sys_path(path: list[str], script_dir: str, cwd: str) -> list[str]:
    """``sys.path`` for running a script of the checkout ``script_dir``.

    An installed megatron-core of the checkout's release series is imported when there is
    one: ``python pretrain_gpt.py`` would put the checkout first, and the checkout's
    ``megatron/core`` (no built dataset helpers; make needs pybind11) would shadow it:
    ``megatron/`` is a namespace package in both places and each subpackage comes from the
    first directory that has it. So Megatron-LM checkouts go to the END, the script's own
    last and once (``megatron.training``, ``megatron.legacy``, ``gpt_builders`` and
    ``model_provider`` exist only there). Where the installed megatron-core is of another
    series, or there is none, the script's checkout (for a script outside one: the first
    checkout on the path) goes FIRST instead: its own ``megatron/core`` is the one that
    matches its training code. ``-m`` puts the current
    directory first: it is dropped when it is a checkout (launching from inside the
    checkout is the usual way). Other entries keep their order."""
    def same(entry: str, directory: str) -> bool:
        return os.path.realpath(entry or cwd) == os.path.realpath(directory)

    rest = list(path)
    if rest and same(rest[0], cwd) and _is_checkout(cwd):
        rest = rest[1:]
    rest = [entry for entry in rest if not same(entry, script_dir)]
    checkouts = [entry for entry in rest if _is_checkout(entry or cwd)]
    others = [entry for entry in rest if entry not in checkouts]
    # the checkout megatron.training will come from: the script's, else the first listed
    training = script_dir if _is_checkout(script_dir) else next(iter(checkouts), None)
    if training is not None and _needs_own_core(others, training or cwd, cwd):
        return ([script_dir] if training == script_dir else [training]) + others + \
            [c for c in checkouts if c != training] + \
            ([] if training == script_dir else [script_dir])
    return others + checkouts + [script_dir]


def _needs_own_core(path: list[str], checkout: str, cwd: str) -> bool:
    """Whether the megatron-core ``path`` would import is not of the release series of
    ``checkout``."""
    wanted = releases.series_of(releases.version_at(checkout) or "")
    if not wanted:
        return False
    for entry in path:
        if os.path.isfile(os.path.join(entry or cwd, "megatron", "core", "__init__.py")):
            return releases.series_of(releases.version_at(entry or cwd) or "") != wanted
    return True


def _is_checkout(directory: str) -> bool:
    """A Megatron-LM checkout (site-packages has megatron/core but no megatron/training)."""
    return all(os.path.isdir(os.path.join(directory, "megatron", sub)) for sub in ("core", "training"))


def _check_training_package(script_dir: str) -> None:
    """The script's checkout must be the one ``megatron.training`` comes from (another
    checkout earlier on PYTHONPATH would win over the appended one)."""
    if not os.path.isdir(os.path.join(script_dir, "megatron", "training")):
        return  # a script of one's own: megatron.training comes from wherever it is found
    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None else None
    ours = os.path.join(script_dir, "megatron", "training", "__init__.py")
    if origin and os.path.realpath(origin) != os.path.realpath(ours):
        raise errors.UserError(
            f"megatron.training would be imported from {os.path.dirname(origin)}, not from the "
            f"checkout of the script ({script_dir}): remove the other checkout from PYTHONPATH")


if __name__ == "__main__":
    sys.exit(main())
