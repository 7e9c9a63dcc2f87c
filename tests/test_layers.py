"""The package layering, read from the sources (every import, lazy ones included), so that a
later change cannot quietly reintroduce a cycle or an upward import.

Bottom to top (docs/design.md draws it): storage, compat and the planner (import nothing of
ours but the timeline and the errors; the planner not even torch), placement, models,
schedule, optim, offload, training, and the Megatron-LM plug-in (megatron_lm). A package may
import only packages of lower layers; the module graph has no cycle.
``megatron_snake.timeline``, which every layer records into, ``megatron_snake.errors``,
whose UserError every layer raises, and ``megatron_snake.emulated_device``, whose clock the
store follows under tools/bench_overlap.py, import nothing of ours.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megatron_snake"
LAYERS = [{"storage", "compat", "planner"}, {"placement"}, {"models"}, {"schedule"}, {"optim"},
          {"offload"}, {"training"}, {"megatron_lm"}]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
# the C modules, each in the layer of the one module that binds it
NATIVE = {"megatron_snake._snake_aio": "storage",     # the I/O engine: storage/engine.py
          "megatron_snake._snake_adamw": "optim"}     # the host update: optim/host_kernel.py


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every megatron_snake module this file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("megatron_snake"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_snake"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules or m in NATIVE} - {name}
            for name, path in modules.items()}


def _package(module: str) -> str | None:
    if module in NATIVE:
        return NATIVE[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYER_OF) else None


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER_OF), f"give each package a layer here: {packages ^ set(LAYER_OF)}"


def test_packages_import_only_lower_layers():
    wrong = []
    for module, targets in _graph().items():
        source = _package(module)
        if source is None:          # megatron_snake/__init__.py: the public entry point
            continue
        for target in targets:
            pkg = _package(target)
            if pkg is not None and pkg != source and LAYER_OF[pkg] >= LAYER_OF[source]:
                wrong.append(f"{module} imports {target} ({source} may import only layers "
                             f"below layer {LAYER_OF[source]})")
    assert not wrong, "\n".join(wrong)


def test_the_module_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", ["timeline.py", "emulated_device.py", "errors.py"])
def test_the_modules_every_layer_uses_import_nothing_of_ours(module):
    assert _imports(PACKAGE / module) == set(), \
        f"every layer may use megatron_snake/{module}: it must import none of them"
