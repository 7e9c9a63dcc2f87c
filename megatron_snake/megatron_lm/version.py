"""The version pin: which Megatron-LM the plug-in supports, and the check that refuses others.

Megatron-LM has no version of its own for ``megatron/training``: the project's version is
``megatron/core/package_info.py`` of the checkout, which need not be the ``megatron.core``
that is imported (the runner imports the installed megatron-core). So the check has three
parts, and reports what it found in one line:

1. the checkout's ``megatron/core/package_info.py``, read as text (importing it could import
   the wrong ``megatron.core``), when the checkout has one;
2. the imported ``megatron.core.__version__``;
3. every Megatron-LM function the plug-in wraps or replaces must still contain a fragment of
   its source (``WRAPPED``), so an upstream change fails loudly, naming the function, instead
   of silently bypassing the plug-in. Sources are read from the files as text (``ast``), so
   the check imports nothing of ``megatron.training`` (whose import needs triton, and may
   happen only after the CPU patches). Fragments are compared with all whitespace removed:
   a reformatted call still matches, a changed one does not.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

from megatron_snake.errors import UserError

SUPPORTED_TAG = "core_v0.16.1"
SUPPORTED_SERIES = "0.16"  # megatron-core 0.16.x
SUPPORTED = f"Megatron-LM {SUPPORTED_TAG} (megatron-core {SUPPORTED_SERIES}.x)"


class MegatronLMVersionError(UserError, RuntimeError):
    """The Megatron-LM (or megatron.core) found is not the one the plug-in supports."""


class Wrapped(NamedTuple):
    """A Megatron-LM function (``qualname`` in ``module``; "" for the module itself) whose
    source must contain ``fragment`` for the plug-in's replacement of it to hold."""

    module: str
    qualname: str
    fragment: str


_T = "megatron.training.training"

# One line per fragment. megatron.core modules are read from the imported megatron.core,
# everything else from the Megatron-LM checkout.
WRAPPED: tuple[Wrapped, ...] = (
    # The schedule: train() and evaluate() look the module global up at call time.
    Wrapped(_T, "", "from megatron.core.pipeline_parallel import get_forward_backward_func"),
    Wrapped(_T, "train", "forward_backward_func = get_forward_backward_func()"),
    Wrapped(_T, "evaluate", "forward_backward_func = get_forward_backward_func()"),
    Wrapped(_T, "train", "= train_step(forward_step_func, train_data_iterator, model, optimizer, "
                         "opt_param_scheduler, config, forward_backward_func, iteration=iteration)"),
    Wrapped(_T, "train_step", "losses_reduced = forward_backward_func("
            "forward_step_func=forward_step_func, data_iterator=data_iterator, model=model, "
            "num_microbatches=get_num_microbatches(), seq_length=args.seq_length, "
            "micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length, "
            "forward_only=False, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, "
            "force_all_reduce=save_wgrads_in_this_iteration,)"),
    Wrapped(_T, "train_step", "update_successful, grad_norm, num_zeros_in_grad = optimizer.step()"),
    # Model and optimizer build.
    Wrapped(_T, "pretrain", "model, optimizer, opt_param_scheduler = setup_model_and_optimizer("
                            "model_provider, model_type, checkpointing_context=checkpointing_context)"),
    Wrapped(_T, "setup_model_and_optimizer",
            "model = get_model(model_provider_func, model_type, wrap_with_ddp=wrap_with_ddp)"),
    Wrapped(_T, "setup_model_and_optimizer", "optimizer = get_megatron_optimizer("),
    Wrapped(_T, "setup_model_and_optimizer", "= load_checkpoint("),
    Wrapped(_T, "get_model", "def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, "
                             "wrap_with_ddp=True, config=None, pg_collection=None)"),
    # Checkpoints: pretrain() and save_checkpoint_and_time() use the training-module names.
    Wrapped(_T, "", "from megatron.training.checkpointing import load_checkpoint"),
    Wrapped(_T, "", "from megatron.training.checkpointing import save_checkpoint"),
    Wrapped(_T, "save_checkpoint_and_time", "save_checkpoint("),
    # Flags: initialize_megatron() parses with the module global parse_args.
    Wrapped("megatron.training.initialize", "",
            "from megatron.training.arguments import parse_args, validate_args"),
    Wrapped("megatron.training.initialize", "initialize_megatron",
            "args = parse_args(extra_args_provider, ignore_unknown_args)"),
    Wrapped("megatron.training.arguments", "parse_args",
            "def parse_args(extra_args_provider=None, ignore_unknown_args=False)"),
    Wrapped("megatron.training.arguments", "parse_args", "parser = extra_args_provider(parser)"),
    Wrapped("megatron.training.inprocess_restart", "maybe_wrap_for_inprocess_restart",
            "args = arguments.parse_args(ignore_unknown_args=True)"),
    # The log lines users (and tests/megatron_lm) read.
    Wrapped(_T, "training_log", "log_string += ' {}: {:.6E} |'.format(key, avg)"),
    Wrapped(_T, "training_log", "log_string += f' grad norm: {grad_norm:.3f} |'"),
    # hooks.py: the flags' check after Megatron-LM's own, the schedule and the log suffix.
    Wrapped("megatron.training.initialize", "initialize_megatron",
            "validate_args(args, args_defaults)"),
    Wrapped(_T, "setup_model_and_optimizer",
            "opt_param_scheduler = get_optimizer_param_scheduler(optimizer)"),
    Wrapped(_T, "training_log", "print_rank_last(log_string)"),
    Wrapped(_T, "", "print_rank_last,"),
    Wrapped("megatron.training.checkpointing", "get_rng_state",
            "def get_rng_state(ckpt_format: str, tp_group: torch.distributed.ProcessGroup, "
            "pp_group: torch.distributed.ProcessGroup)"),
    # model.py: each decoder layer reported as it is built (the streamed build).
    Wrapped("megatron.core.transformer.transformer_block", "TransformerBlock._build_layers",
            "module = build_module("),
    # The runner's dataset-helpers skip (megatron_snake.megatron_lm._skip_dataset_helpers_make).
    Wrapped("megatron.training.initialize", "_compile_dependencies",
            "from megatron.core.datasets.utils import compile_helpers"),
    Wrapped("megatron.core.datasets.utils", "compile_helpers",
            'command = ["make", "-C", os.path.abspath(os.path.dirname(__file__))]'),
)


def check_megatron_lm(checkout_dir) -> None:
    """Raise MegatronLMVersionError (one line) unless ``checkout_dir`` is the supported
    Megatron-LM and the imported megatron.core is the matching megatron-core."""
    checkout = Path(checkout_dir)
    found = checkout_version(checkout)
    if found is not None and not supported(found):
        _refuse(f"found Megatron-LM {found} at {checkout} (megatron/core/package_info.py)")
    import megatron.core

    core = getattr(megatron.core, "__version__", "unknown")
    if not supported(core):
        _refuse(f"found megatron.core {core} imported from {Path(megatron.core.__file__).parent}")
    if not (checkout / "megatron" / "training").is_dir():
        _refuse(f"found no megatron/training in {checkout}")
    parsed = {}  # path -> (text, tree): each file is parsed once
    problems = [p for site in WRAPPED if (p := _site_problem(site, checkout, parsed))]
    if problems:
        _refuse(f"found a Megatron-LM at {checkout} where " + "; ".join(problems))


def supported(version: str) -> bool:
    return version.startswith(SUPPORTED_SERIES + ".")


def checkout_version(checkout: Path) -> str | None:
    """The version in the checkout's megatron/core/package_info.py, or None if it has none.

    Read as text: its ``__version__`` is built from literal MAJOR/MINOR/PATCH/PRE_RELEASE."""
    path = Path(checkout) / "megatron" / "core" / "package_info.py"
    if not path.is_file():
        return None
    values = {}
    try:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        values[target.id] = node.value.value
    except (SyntaxError, ValueError, OSError):
        return "(unreadable)"
    if isinstance(values.get("__version__"), str):
        return values["__version__"]
    try:
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"
    except KeyError:
        return "(unreadable)"


def _refuse(found: str):
    raise MegatronLMVersionError(f"megatron_snake.megatron_lm supports {SUPPORTED} only; {found}")


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
    if _squeeze(site.fragment) not in _squeeze(source):
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


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)
