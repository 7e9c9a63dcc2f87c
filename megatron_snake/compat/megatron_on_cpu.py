"""Megatron-Core (0.16 to 0.19: ``megatron_snake.releases``) on a CPU-only torch: the six
patches, in one place.

Megatron-Core assumes CUDA in a few places. On a machine whose compute device is the CPU
we patch exactly these (docs/megatron_on_cpu.md says what each stands in for):

1. RNG tracker: Megatron's tracker saves and restores the CUDA generator. On CPU, dropout
   draws from the CPU generator, so the tracker must fork that one (it runs on every
   attention-dropout call, so it has to really work, not just not crash).
2. ``torch.cuda.current_device()`` is used as a device in ~175 places: return ``"cpu"`` in
   the thread that runs Megatron (the one that applied the patches; CPU autograd runs there
   too). Other threads keep torch's answer, so a store's copy streams still work where a
   GPU is present.
3. Pipeline p2p calls ``torch.cuda.synchronize()``: a no-op on CPU.
4. Hard-coded ``device="cuda"``, ``.to("cuda")`` and ``.cuda()``: a TorchFunctionMode maps
   them to the CPU.
5. Megatron's optimizers test ``param.type() == "torch.cuda.FloatTensor"``: the same mode
   answers CUDA type names for CPU floating tensors.

6. megatron-core 0.19's DDP bucket waits on ``torch.cuda.current_stream()`` for CUDA-graph
   events before it reduces: a stream that waits for nothing, in the same threads as 2.

``megatron_snake.releases.CORE_CPU_SITES`` lists a source fragment of every Megatron site
these patches stand in for, with the releases it holds in; ``check_patched_sites()`` (and a
test) fail loudly when a site moves or changes.
Nothing here is applied when a GPU is the compute device. Where a GPU is present but the
compute device is the CPU (the CPU suite on a GPU machine), patches 2 and 4 hold in the
patching thread only.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading

import torch
from torch.overrides import TorchFunctionMode

from megatron_snake import releases

_applied = False
_lock = threading.Lock()


class PatchedSiteMoved(RuntimeError):
    pass


def _source(site: releases.CpuSite) -> str:
    obj = importlib.import_module(site.module)
    for part in site.qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def check_patched_sites() -> None:
    """Raise PatchedSiteMoved naming every site whose source no longer matches."""
    import megatron.core

    problems = []
    version = getattr(megatron.core, "__version__", "unknown")
    release = releases.release_of(version)
    if release is None:
        problems.append(f"megatron-core is {version}, the CPU patches were written for "
                        f"{releases.SUPPORTED}")
    for site in releases.core_cpu_sites_for(release.series) if release else ():
        try:
            src = _source(site)
        except (ImportError, AttributeError) as exc:
            problems.append(f"patch {site.patch}: {site.name} is gone ({exc})")
            continue
        if not releases.contains(src, site.fragment):
            problems.append(f"patch {site.patch}: {site.name} no longer contains "
                            f"{site.fragment!r}")
    if problems:
        raise PatchedSiteMoved(
            "megatron_snake's Megatron-Core-on-CPU patches no longer match this megatron-core "
            f"(install {releases.MEGATRON_CORE_REQUIREMENT} or update "
            "megatron_snake/compat/megatron_on_cpu.py):\n  "
            + "\n  ".join(problems))


# --- patch 1: an RNG tracker that forks the CPU generator ---------------------------------

def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG states, kept for the CPU generator (dropout on CPU uses it)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _install_cpu_rng():
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _make_cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Megatron's activation checkpointing saves/restores "the CUDA state" next to the CPU
    # one; on CPU they are the same generator.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


# --- patches 4 and 5: one TorchFunctionMode ----------------------------------------------

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Maps ``device="cuda"``, ``.to("cuda")`` and ``.cuda()`` to the CPU, and answers
    CUDA type names from ``Tensor.type()`` for CPU float tensors (Megatron's optimizers
    check them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].to("cpu", **{k: v for k, v in kwargs.items() if k == "non_blocking"})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


_mode = None


def _current_device_for(megatron_thread: int):
    """Patch 2: "cpu" for Megatron's thread (and everywhere when torch has no GPU); torch's
    own answer in other threads, which torch's CUDA calls there rely on."""
    original = torch.cuda.current_device

    def current_device():
        if threading.get_ident() == megatron_thread or not torch.cuda.is_available():
            return "cpu"
        return original()

    return current_device


class _NoStream:
    """Patch 6: the CPU's one stream, which waits for nothing."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def _current_stream_for(megatron_thread: int):
    original = torch.cuda.current_stream

    def current_stream(*args, **kwargs):
        if threading.get_ident() == megatron_thread or not torch.cuda.is_available():
            return _NoStream()
        return original(*args, **kwargs)

    return current_stream


def apply(device: torch.device | str | None = None) -> bool:
    """Patch Megatron-Core for a CPU compute device. Returns True if patches are active.

    Idempotent. Does nothing (returns False) when the compute device is a GPU.
    """
    global _applied, _mode
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type != "cpu":
        return False
    with _lock:
        if _applied:
            return True
        check_patched_sites()
        _install_cpu_rng()
        torch.cuda.current_device = _current_device_for(threading.get_ident())  # patch 2
        torch.cuda.synchronize = lambda *args, **kwargs: None  # patch 3
        if "6" in releases.core_cpu_patches_for(releases.imported().series):
            torch.cuda.current_stream = _current_stream_for(threading.get_ident())
        _mode = CudaToCpuMode()
        _mode.__enter__()  # stays active for the life of the process (this thread)
        _applied = True
        return True


def is_applied() -> bool:
    return _applied
