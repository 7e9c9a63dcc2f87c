"""Megatron-LM's training package (core_v0.16.1 to core_v0.19.0) on a CPU-only torch: the patches,
in one place.

``megatron_on_cpu`` patches Megatron-Core. Megatron-LM's own ``megatron.training`` and
``megatron.legacy`` (what ``pretrain_gpt.py`` runs) assume CUDA in a few more places; these
patches stand in for exactly those, only when torch has no CUDA (docs/megatron_on_cpu.md,
"Megatron-LM's training package", says what each one is for):

A. ``allow_no_cuda``: ``initialize_megatron`` asserts ``torch.cuda.is_available()``.
B. ``distributed_init``: with ``torch.cuda.device_count() == 0`` Megatron-LM builds no
   model-parallel groups and seeds no model-parallel RNG.
D. ``fused_kernels``: ``fused_kernels.load`` runs ``CUDA_HOME + "/bin/nvcc"`` (0.16 only).
E. ``get_model_streams``: ``get_model`` (0.19: also the builder's ``_ddp_wrap``) wraps DDP
   in a ``torch.cuda.Stream``.
F. ``cuda_rng_state``: the rerun state machine and checkpoints save and restore the CUDA
   generator.
G. ``data_iterators_rng_neutral``: the data iterators are built after the checkpoint's RNG
   state is restored, and draw from the generator dropout uses on the CPU.
H. ``device_arch_version``: ``validate_args`` asks the GPU's architecture for TP/CP > 1.
I. ``stub_batch_invariant_kernels``: only when triton is not installed (0.16 only: 0.17
   guards its triton import itself).

(C, the ``make`` of the dataset helpers, is not CPU-specific: ``megatron_snake.megatron_lm``
handles it on every device.)

Which patches a release needs, and the fragment of Megatron-LM's source each stands in for,
is ``megatron_snake.releases.CPU_SITES`` (a patch applies in a release where it has a site).
Replaced functions are wrapped with ``functools.wraps`` so that ``inspect.getsource`` still
shows Megatron-LM's source: ``check_patched_sites`` then works before and after ``apply``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import sys
import threading
import types

import torch

from megatron_snake import releases
from megatron_snake.compat import megatron_on_cpu
from megatron_snake.compat.megatron_on_cpu import PatchedSiteMoved
from megatron_snake.errors import UserError

_applied = False
_lock = threading.Lock()
_BIK = releases.BATCH_INVARIANT_KERNELS


def _source(site: releases.CpuSite) -> str:
    obj = importlib.import_module(site.module)
    for part in filter(None, site.qualname.split(".")):
        obj = getattr(obj, part)
    return inspect.getsource(obj)  # follows functools.wraps to the original


def _release() -> releases.Release:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    release = releases.release_of(version)
    if release is None:
        raise PatchedSiteMoved(f"megatron_snake's Megatron-LM-on-CPU patches are written for "
                               f"{releases.SUPPORTED}; megatron.core is {version}")
    return release


def check_patched_sites() -> releases.Release:
    """The release of the imported megatron.core; raises PatchedSiteMoved naming every site
    of its patches whose source no longer matches."""
    release = _release()
    patches = releases.cpu_patches_for(release.series)
    if "I" in patches:
        _provide_triton_stub()
    problems = []
    for site in releases.cpu_sites_for(release.series):
        try:
            src = _source(site)
        except (ImportError, AttributeError, TypeError, OSError) as exc:
            problems.append(f"patch {site.patch}: {site.name} is gone ({exc})")
            continue
        if not releases.contains(src, site.fragment):
            problems.append(f"patch {site.patch}: {site.name} no longer contains {site.fragment!r}")
    if problems:
        raise PatchedSiteMoved(
            "megatron_snake's Megatron-LM-on-CPU patches no longer match this Megatron-LM "
            f"{release.series} (use one of {releases.SUPPORTED}, or update "
            "megatron_snake/releases.py and megatron_snake/compat/megatron_lm_on_cpu.py):\n  "
            + "\n  ".join(problems))
    return release


def apply() -> bool:
    """Patch Megatron-LM's training package for a CPU compute device (after Megatron-Core's
    patches, which it applies first). Returns True if the patches are active.

    Idempotent. Does nothing (returns False) when torch has CUDA. Must run before
    ``megatron.training`` is first imported where triton is not installed (patch I)."""
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        megatron_on_cpu.apply("cpu")
        # imports the training package (after patch I where needed)
        series = check_patched_sites().series
        patches = releases.cpu_patches_for(series)
        for letter, patch in (("A", _allow_no_cuda), ("B", _distributed_init),
                              ("D", _fused_kernels), ("E", lambda: _get_model_streams(series)),
                              ("F", _cuda_rng_state), ("G", _data_iterators_rng_neutral),
                              ("H", _device_arch_version)):
            if letter in patches:
                patch()
        _applied = True
        return True


def is_applied() -> bool:
    return _applied


# --- I: triton --------------------------------------------------------------------------

def _provide_triton_stub() -> None:
    """Patch I. ``megatron/training/initialize.py`` imports ``enable_batch_invariant_mode``
    at module level from a megatron.core module that imports triton (for its kernels); the
    function is only called with ``--batch-invariant-mode``. Where triton is not installed,
    that module is replaced by a stub whose function refuses, before megatron.training is
    imported (later it is too late: the import has failed already)."""
    if "megatron.training" in sys.modules or _BIK in sys.modules or _importable("triton"):
        return
    stub = types.ModuleType(_BIK)
    stub.__doc__ = "megatron_snake's stand-in: triton is not installed (megatron_lm_on_cpu, patch I)."

    def enable_batch_invariant_mode(*args, **kwargs):
        raise UserError("--batch-invariant-mode needs triton, which is not installed "
                        "(pip install triton)")

    stub.enable_batch_invariant_mode = enable_batch_invariant_mode
    sys.modules[_BIK] = stub


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --- A, B, D, E: start-up ---------------------------------------------------------------

def _allow_no_cuda() -> None:
    """A. ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless called with
    ``allow_no_cuda=True``, and ``pretrain()`` calls it without. Every name it is reachable
    by (the module, the package, training.py's import) gets the wrapper."""
    import megatron.training
    import megatron.training.initialize as I
    import megatron.training.training as T

    orig = I.initialize_megatron

    @functools.wraps(orig)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return orig(*args, **kwargs)

    I.initialize_megatron = T.initialize_megatron = initialize_megatron
    megatron.training.initialize_megatron = initialize_megatron


@contextlib.contextmanager
def _one_cuda_device():
    """Inside: ``torch.cuda.device_count()`` answers 1 and ``torch.cuda.set_device`` does
    nothing (Megatron-LM's start-up decides "a GPU is present" by ``device_count() > 0``)."""
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def _distributed_init() -> None:
    """B. ``_initialize_distributed`` builds the TP/PP/DP groups only ``if device_count > 0``
    and ``_set_random_seed`` seeds the model-parallel RNG tracker only ``if
    torch.cuda.device_count() > 0``: both run with one "device" (the CPU). The ``cuda:0``
    device id this gives only reaches the in-process-restart NCCL warm-up, which does
    nothing without ``--inprocess-restart``."""
    import megatron.training.initialize as I

    for name in ("_initialize_distributed", "_set_random_seed"):
        orig = getattr(I, name)

        @functools.wraps(orig)
        def with_one_device(*args, _orig=orig, **kwargs):
            with _one_cuda_device():
                return _orig(*args, **kwargs)

        setattr(I, name, with_one_device)


def _fused_kernels() -> None:
    """D. ``fused_kernels.load`` first asks nvcc for its version through
    ``cpp_extension.CUDA_HOME``, which is None on a CPU build of torch (a TypeError). At this
    tag it builds no kernel (its list is empty): skip it."""
    import megatron.legacy.fused_kernels as F

    @functools.wraps(F.load)
    def load(args):
        return None

    F.load = load


class _NoStream:
    """Stands in for a ``torch.cuda.Stream`` in ``get_model`` (the CPU has one stream)."""

    def wait_stream(self, other):
        pass


def _get_model_streams(series: str) -> None:
    """E. ``get_model`` (and from 0.19 the config builder's ``_ddp_wrap``) builds the DDP
    wrappers on a side ``torch.cuda.Stream()`` and syncs it with
    ``torch.cuda.current_stream()``; both raise on a CPU build (``torch.cuda.stream(s)`` is
    already a no-op there). Only for the duration of each function with a site of E."""
    for module_name, qualname in dict.fromkeys(
            (s.module, s.qualname) for s in releases.cpu_sites_for(series) if s.patch == "E"):
        module = importlib.import_module(module_name)
        orig = getattr(module, qualname)

        @functools.wraps(orig)
        def without_streams(*args, _orig=orig, **kwargs):
            saved = torch.cuda.Stream, torch.cuda.current_stream
            torch.cuda.Stream = _NoStream
            torch.cuda.current_stream = lambda *a, **k: _NoStream()
            try:
                return _orig(*args, **kwargs)
            finally:
                torch.cuda.Stream, torch.cuda.current_stream = saved

        setattr(module, qualname, without_streams)


# --- F, G: random number generators -------------------------------------------------------

def _cuda_rng_state() -> None:
    """F. The rerun state machine (every ``train_step`` unless ``--rerun-mode disabled``) and
    checkpoint save/load store and restore ``torch.cuda.get_rng_state()``. On the CPU "the
    CUDA generator" is the CPU one (as in megatron_on_cpu's tracker): a checkpoint then holds
    the CPU state twice, restored twice."""
    get_orig, set_orig = torch.cuda.get_rng_state, torch.cuda.set_rng_state

    @functools.wraps(get_orig)
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @functools.wraps(set_orig)
    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state, torch.cuda.set_rng_state = get_rng_state, set_rng_state


def _data_iterators_rng_neutral() -> None:
    """G. ``pretrain()`` builds the data iterators after the checkpoint (and its RNG state)
    is loaded, and creating each DataLoader iterator draws its base seed from the default
    generator. On a GPU dropout does not use that generator; on the CPU hidden dropout does,
    so a resumed run's dropout masks would differ from the uninterrupted run's. The
    generator is put back after the iterators are built, in every run, so both agree."""
    import megatron.training.training as T

    orig = T.build_train_valid_test_data_iterators

    @functools.wraps(orig)
    def build_train_valid_test_data_iterators(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return orig(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    T.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators


# --- H: GPU architecture --------------------------------------------------------------------

def _device_arch_version() -> None:
    """H. With TP > 1 or CP > 1, ``validate_args`` asks ``get_device_arch_version()``
    (``torch.cuda.get_device_properties``). Answer 0, "no GPU architecture": it then requires
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as on Hopper and older GPUs, which
    ``megatron_snake.megatron_lm.install`` sets by default on the CPU."""
    import megatron.training.arguments as A

    @functools.wraps(A.get_device_arch_version)
    def get_device_arch_version():
        return 0

    A.get_device_arch_version = get_device_arch_version
