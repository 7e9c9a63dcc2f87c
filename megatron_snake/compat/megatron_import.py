"""What a newer megatron-core needs before it is first imported on a machine without triton,
or on Python 3.11. ``prepare()`` runs when ``megatron_snake`` is imported (its
``__init__``), so it comes before any ``import megatron`` of this project's code.

megatron-core from 0.18 imports triton at the top of one module of MoE kernels
(``releases.Release.triton_at_import``), on the import path of ``megatron.core`` itself. The
snake never launches those kernels (``--num-experts`` is refused with ``--snake-offload``),
and a CPU-only torch has no triton. Where triton is missing, those modules alone are
loaded with a stand-in ``triton`` visible to them only (through their ``__builtins__``),
never in ``sys.modules``: torch decides whether it can compile with triton by importing
it, and must keep finding none. Launching one of the kernels raises a UserError.

Megatron-LM's training package from 0.18 imports ``typing.override`` (Python 3.12); on an
older Python ``typing_extensions``' is put there (the same decorator).

The release is read from the megatron-core that ``import megatron.core`` will find
(its ``package_info.py``, as text): nothing of megatron is imported here.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import typing
from pathlib import Path

import megatron_snake.releases as releases
from megatron_snake.errors import UserError

_prepared_for: set[str] = set()


def prepare(core_dir: Path | None = None) -> releases.Release | None:
    """Prepare the import of the megatron-core in ``core_dir`` (a ``megatron/core``
    directory; default: the one ``import megatron.core`` finds). Returns its release, or
    None where it is none of the supported ones (nothing is done then)."""
    core_dir = core_dir or _core_dir()
    if core_dir is None:
        return None
    release = releases.release_of(releases.version_at(core_dir.parent.parent) or "")
    if release is None:
        return None
    missing = [m for m in release.triton_at_import if m not in _prepared_for]
    if missing and not _importable("triton"):
        sys.meta_path.insert(0, _TritonStandInFinder(missing))
        _prepared_for.update(missing)
    if release.needs_typing_override and not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    return release


def _core_dir() -> Path | None:
    if "megatron.core" in sys.modules:
        return None   # imported already: too late to prepare, nothing to do
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _StandIn:
    """Anything of triton's: attributes, calls and decorators (``@triton.jit``,
    ``tl.constexpr``) give stand-ins; launching a kernel (``kernel[grid](...)``) refuses."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn()

    def __call__(self, *args, **kwargs):
        return _StandIn()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise UserError("a triton kernel of megatron-core was launched, and triton is "
                            "not installed (pip install triton)")
        return launch


_TRITON = _StandIn()


def _import_with_stand_in(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == "triton" or name.startswith("triton.")):
        return _TRITON
    return builtins.__import__(name, globals, locals, fromlist, level)


_BUILTINS = dict(vars(builtins), __import__=_import_with_stand_in)


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__dict__["__builtins__"] = _BUILTINS   # its `import triton` finds the stand-in
        exec(self.loader.get_code(module.__name__), module.__dict__)


class _TritonStandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules):
        self.modules = set(modules)

    def find_spec(self, name, path, target=None):
        if name not in self.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _StandInLoader(spec.loader)
        return spec
