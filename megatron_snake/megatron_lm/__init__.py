"""megatron_snake as a plug-in for Megatron-LM's own ``pretrain_gpt.py`` (the releases of
``megatron_snake.releases``: core_v0.16.1 to core_v0.19.0).

Run a Megatron-LM entry script through the runner (docs/megatron_lm.md)::

    torchrun ... -m megatron_snake.megatron_lm /path/to/Megatron-LM/pretrain_gpt.py <flags> --snake-offload ...

or, in a script of one's own, install the plug-in at its top::

    import megatron_snake.megatron_lm as snake
    snake.install()

This module imports nothing of Megatron at import time: the runner must arrange
``sys.path`` (which ``megatron.core`` wins) before the first ``megatron`` import.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from pathlib import Path

from megatron_snake.compat import megatron_import
from megatron_snake.megatron_lm.version import MegatronLMVersionError, check_megatron_lm

__all__ = ["install", "MegatronLMVersionError", "checkout_dir"]

_installed = False
_lock = threading.Lock()


def install() -> None:
    """Install the plug-in into Megatron-LM's training package. Idempotent.

    Prepares the import of a newer megatron-core where triton or ``typing.override`` is
    missing (``compat.megatron_import``); refuses (MegatronLMVersionError, one line) a
    Megatron-LM that is not a supported release, or a megatron.core of another release;
    on a machine without CUDA applies the CPU patches (Megatron-Core's, then Megatron-LM's);
    skips the dataset helpers' ``make`` where it cannot work; then installs the plug-in's
    replacements (``hooks.install``), which change nothing without ``--snake-offload``.

    Call it before ``megatron.training`` is imported where triton is not installed (the CPU
    patch I must come first); otherwise before or after: the patches replace module
    globals that Megatron-LM looks up at call time. Names a script bound itself before
    (``from megatron.training.training import get_model``) keep the originals."""
    global _installed
    with _lock:
        if _installed:
            return
        checkout = checkout_dir()
        # again: the runner may have changed which megatron.core will be imported
        megatron_import.prepare()
        release = check_megatron_lm(checkout)
        import megatron.core
        import torch

        if not torch.cuda.is_available():
            _apply_cpu_patches()
        _skip_dataset_helpers_make()
        import megatron_snake.megatron_lm.hooks as hooks

        hooks.install()
        _installed = True
        if os.environ.get("RANK", "0") == "0":   # which code runs, said once
            print(f"> megatron_snake.megatron_lm: Megatron-LM at {checkout} ({release.tag}'s "
                  f"series), megatron.core {megatron.core.__version__} from "
                  f"{Path(megatron.core.__file__).parent}", flush=True)


def checkout_dir() -> Path:
    """The Megatron-LM checkout ``megatron.training`` is (or will be) imported from.

    Located without importing megatron.training (its import needs triton, or patch I)."""
    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        from megatron_snake.megatron_lm.version import SUPPORTED

        raise MegatronLMVersionError(
            "megatron.training is not importable: run an entry script of a Megatron-LM "
            f"checkout ({SUPPORTED}) through python -m megatron_snake.megatron_lm, "
            "or put that checkout on sys.path")
    return Path(spec.origin).resolve().parent.parent.parent  # <checkout>/megatron/training/__init__.py


def _apply_cpu_patches() -> None:
    from megatron_snake.compat import megatron_lm_on_cpu, megatron_on_cpu

    # Patch H leaves validate_args requiring this for TP/CP > 1 (as on Hopper GPUs).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        megatron_on_cpu.apply("cpu")
        megatron_lm_on_cpu.apply()
    except megatron_on_cpu.PatchedSiteMoved as exc:
        # The version check passed, yet a patched site differs: still the user's Megatron-LM.
        raise MegatronLMVersionError(str(exc)) from exc


def _skip_dataset_helpers_make() -> None:
    """Patch C, on every device. On rank 0 ``_compile_dependencies`` runs
    ``compile_helpers()``: ``make -C <megatron/core/datasets>``, ``sys.exit(1)`` on failure.
    The installed megatron-core wheel ships the built ``helpers_cpp`` but no Makefile, so
    that make always fails, GPU or not. Skip it exactly then (no Makefile, helpers present);
    a checkout's megatron.core (with its Makefile) keeps Megatron-LM's own build."""
    import megatron.core.datasets.utils as U

    if (Path(U.__file__).parent / "Makefile").exists():
        return
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return  # nothing built either: keep Megatron-LM's own failure
    orig = U.compile_helpers

    @functools.wraps(orig)  # releases.WRAPPED checks its source
    def compile_helpers():
        return None

    U.compile_helpers = compile_helpers
