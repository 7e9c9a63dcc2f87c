"""The version check: which Megatron-LM releases the plug-in supports, and the check that
refuses others.

The releases, and the fragments of their source the plug-in relies on, are
``megatron_snake.releases``' table. Megatron-LM has no version of its own for
``megatron/training``: the project's version is ``megatron/core/package_info.py`` of the
checkout, which need not be the ``megatron.core`` that is imported (the runner imports an
installed megatron-core of the checkout's series). So the check has three parts, and
reports what it found in one line:

1. the checkout's ``megatron/core/package_info.py``, read as text (importing it could import
   the wrong ``megatron.core``), when the checkout has one: a supported release;
2. the imported ``megatron.core.__version__``: the same release's series;
3. every Megatron-LM function the plug-in wraps or replaces must still contain the fragments
   of its source listed for that release (``releases.WRAPPED``), so an upstream change fails
   loudly, naming the function, instead of silently bypassing the plug-in. Sources are read
   from the files as text (``ast``), so the check imports nothing of ``megatron.training``
   (whose import needs triton, and may happen only after the CPU patches).
"""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_snake import releases
from megatron_snake.errors import UserError
from megatron_snake.releases import Release, Wrapped

SUPPORTED = releases.SUPPORTED


class MegatronLMVersionError(UserError, RuntimeError):
    """The Megatron-LM (or megatron.core) found is not one the plug-in supports."""


def check_megatron_lm(checkout_dir) -> Release:
    """The release of ``checkout_dir``; raises MegatronLMVersionError (one line) unless it is
    a supported Megatron-LM, the imported megatron.core is of the same release, and the
    fragments of that release hold."""
    checkout = Path(checkout_dir)
    found = checkout_version(checkout)
    release = releases.release_of(found) if found is not None else None
    if found is not None and release is None:
        _refuse(f"found Megatron-LM {found} at {checkout} (megatron/core/package_info.py)")
    import megatron.core

    core = getattr(megatron.core, "__version__", "unknown")
    where = Path(megatron.core.__file__).parent
    core_release = releases.release_of(core)
    if core_release is None:
        _refuse(f"found megatron.core {core} imported from {where}")
    if release is not None and core_release is not release:
        _refuse(f"found Megatron-LM {found} at {checkout} but megatron.core {core} imported "
                f"from {where}: install megatron-core {release.series}.x, or remove that one")
    release = core_release
    if not (checkout / "megatron" / "training").is_dir():
        _refuse(f"found no megatron/training in {checkout}")
    parsed = {}  # path -> (text, tree): each file is parsed once
    problems = [p for site in releases.wrapped_for(release.series)
                if (p := _site_problem(site, checkout, parsed))]
    if problems:
        _refuse(f"found a Megatron-LM {release.series} at {checkout} where " + "; ".join(problems))
    return release


def supported(version: str) -> bool:
    return releases.release_of(version) is not None


def checkout_version(checkout: Path) -> str | None:
    """The version in the checkout's megatron/core/package_info.py, or None if it has none
    (read as text: ``releases.version_at``)."""
    return releases.version_at(Path(checkout))


def _refuse(found: str):
    raise MegatronLMVersionError(f"megatron_snake.megatron_lm supports {SUPPORTED}; {found}")


def _site_problem(site: Wrapped, checkout: Path, parsed: dict) -> str | None:
    name = f"{site.module}.{site.qualname}" if site.qualname else site.module
    path = _module_file(site.module, checkout)
    if path is None:
        return f"{site.module} is missing"
    if path not in parsed:
        text = path.read_text()
        try:
            parsed[path] = text, ast.parse(text)
        except SyntaxError:
            return f"{path} does not parse"
    source = source_of(*parsed[path], site.qualname)
    if source is None:
        return f"{name} is missing"
    if not releases.contains(source, site.fragment):
        return f"{name} no longer contains {site.fragment!r}"
    return None


def _module_file(module: str, checkout: Path) -> Path | None:
    parts = module.split(".")
    if parts[:2] == ["megatron", "core"]:
        import megatron.core  # the imported one: that is what runs

        root = Path(megatron.core.__file__).parent.parent.parent
    else:
        root = checkout
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def source_of(text: str, tree: ast.Module, qualname: str) -> str | None:
    """The source of ``qualname`` (``"f"``, ``"Class.method"``; ``""``: the whole module) in
    a module's text (parsed as ``tree``), or None when it is not defined there."""
    if not qualname:
        return text
    body = tree.body
    node = None
    for part in qualname.split("."):
        node = next((d for d in _definitions(body) if d.name == part), None)
        if node is None:
            return None
        body = node.body
    return ast.get_source_segment(text, node)


def _definitions(body):
    """Functions and classes defined in ``body``, also inside if/try/with blocks."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield stmt
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    yield from _definitions(inner)
