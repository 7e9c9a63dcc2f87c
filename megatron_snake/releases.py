"""The Megatron releases megatron_snake supports, and everything that differs between them.

One row per Megatron-LM release (``RELEASES``); the megatron-core of a release is its
``series`` (0.19.x for core_v0.19.0). The plug-in (``megatron_snake.megatron_lm``), the CPU
patches (``megatron_snake.compat``) and the own loop read what differs from here:

- ``WRAPPED``: the fragments of Megatron-LM's source that the plug-in's replacements rely on
  (``megatron_lm/version.py`` checks them), each with the releases it holds in;
- ``CPU_SITES`` and ``CORE_CPU_SITES``: the fragments the CPU patches of Megatron-LM's
  training package (``compat/megatron_lm_on_cpu.py``, lettered) and of megatron-core
  (``compat/megatron_on_cpu.py``, numbered) stand in for; a patch is applied in a release
  where it has a site;
- ``Release.triton_at_import``: megatron-core modules that import triton at their top for
  kernels the snake never launches (loaded with a stand-in where triton is missing);
- ``Release.needs_typing_override``: Megatron-LM code that imports ``typing.override``
  (Python 3.12) on a Python without it;
- ``Release.common_in_dcp``: where a torch_dist checkpoint keeps its common state
  (``training/safe_dcp.py`` reads both layouts).

Moving the window to another release is a change of this module alone: a row in
``RELEASES``, the ranges of the fragments that still hold, new fragments where upstream
changed, and the tests' ``tests/megatron_lm`` run against its checkout.

A fragment matches a function's source with all whitespace removed (a reformatted call
still matches, a changed one does not), and ``from M import N`` matches any import of N
from M, parenthesised or not.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class Release:
    """A Megatron-LM release: its git tag, commit and date, and its megatron-core series."""

    tag: str
    commit: str
    date: str
    series: str                              # megatron-core major.minor
    triton_at_import: tuple[str, ...] = ()   # megatron.core modules whose top imports triton
    needs_typing_override: bool = False      # imports typing.override (Python >= 3.12)
    # a torch_dist save puts the common state (flags, iteration) in the DCP files, not in
    # common.pt, and dist_checkpointing.load takes no common strategy (training/safe_dcp.py)
    common_in_dcp: bool = True


_PAGED_STASH = "megatron.core.transformer.moe.paged_stash"

RELEASES: tuple[Release, ...] = (
    Release("core_v0.16.1", "55ac708251", "2026-03-16", "0.16", common_in_dcp=False),
    Release("core_v0.17.0", "9539a12e1b", "2026-04-14", "0.17"),
    Release("core_v0.18.0", "ba7b5ebce1", "2026-06-22", "0.18",
            triton_at_import=(_PAGED_STASH,), needs_typing_override=True),
    Release("core_v0.19.0", "5be9626709", "2026-08-19", "0.19",
            triton_at_import=(f"{_PAGED_STASH[:-len('paged_stash')]}ops.paged_stash",),
            needs_typing_override=True),
)
SERIES = tuple(r.series for r in RELEASES)
SUPPORTED = ("Megatron-LM " + ", ".join(r.tag for r in RELEASES)
             + f" (megatron-core {SERIES[0]}.x to {SERIES[-1]}.x)")
# setup.py's install_requires: the megatron-core versions the releases above are tested with
MEGATRON_CORE_REQUIREMENT = f"megatron-core>={RELEASES[0].tag[len('core_v'):]},<0.{int(SERIES[-1].split('.')[1]) + 1}"


def series_of(version: str) -> str:
    """``"0.19"`` for ``"0.19.1"``, ``"0.17.0rc0"``; "" for what is no version."""
    m = re.match(r"(\d+)\.(\d+)(?:\.|$)", version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def release_of(version: str) -> Release | None:
    """The supported release of a megatron-core (or checkout) version, or None."""
    return next((r for r in RELEASES if r.series == series_of(version)), None)


def version_at(root: Path) -> str | None:
    """The version in ``root/megatron/core/package_info.py`` (a checkout, or site-packages),
    or None where there is none; "(unreadable)" where it cannot be read.

    Read as text: its ``__version__`` is built from literal MAJOR/MINOR/PATCH/PRE_RELEASE,
    and importing it could import another ``megatron.core``."""
    path = Path(root) / "megatron" / "core" / "package_info.py"
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


def check_installed_megatron_core() -> Release:
    """The release of the megatron-core ``import megatron.core`` will find (read, not
    imported); a UserError (one line) where there is none, or another: what the own loop
    (examples/pretrain_gpt.py) checks first."""
    import importlib.util

    from megatron_snake.errors import UserError

    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise UserError(f"megatron-core is not installed: pip install "
                        f"'{MEGATRON_CORE_REQUIREMENT}' (megatron_snake supports {SUPPORTED})")
    where = Path(spec.origin).parent
    found = version_at(where.parent.parent)
    release = release_of(found or "")
    if release is None:
        raise UserError(f"megatron_snake supports megatron-core {SERIES[0]}.x to "
                        f"{SERIES[-1]}.x ({SUPPORTED}); found megatron-core {found} at {where}: "
                        f"pip install '{MEGATRON_CORE_REQUIREMENT}'")
    return release


def imported() -> Release:
    """The release of the imported megatron.core (one of RELEASES: the version checks have
    refused any other before it is asked)."""
    import megatron.core

    release = release_of(getattr(megatron.core, "__version__", ""))
    if release is None:
        from megatron_snake.errors import UserError

        raise UserError(f"megatron_snake supports {SUPPORTED}; megatron.core "
                        f"{getattr(megatron.core, '__version__', '?')} is imported")
    return release


def since(series: str) -> tuple[str, ...]:
    return SERIES[SERIES.index(series):]


def until(series: str) -> tuple[str, ...]:
    return SERIES[:SERIES.index(series) + 1]


ALL = SERIES


class Wrapped(NamedTuple):
    """A Megatron-LM function (``qualname`` in ``module``; "" for the module itself) whose
    source must contain ``fragment`` in the ``releases`` (megatron-core series) given."""

    module: str
    qualname: str
    fragment: str
    releases: tuple[str, ...] = ALL


_T = "megatron.training.training"
_I = "megatron.training.initialize"
_A = "megatron.training.arguments"

# One line per fragment. megatron.core modules are read from the imported megatron.core,
# everything else from the Megatron-LM checkout.
WRAPPED: tuple[Wrapped, ...] = (
    # The schedule: train() and evaluate() look the module global up at call time.
    Wrapped(_T, "", "from megatron.core.pipeline_parallel import get_forward_backward_func"),
    Wrapped(_T, "train", "forward_backward_func = get_forward_backward_func("),
    Wrapped(_T, "evaluate", "forward_backward_func = get_forward_backward_func("),
    Wrapped(_T, "train", "= train_step(forward_step_func, train_data_iterator, model, optimizer, "
                         "opt_param_scheduler, config, forward_backward_func, iteration=iteration"),
    Wrapped(_T, "train_step", "losses_reduced = forward_backward_func("
            "forward_step_func=forward_step_func, data_iterator=data_iterator, model=model, "
            "num_microbatches=get_num_microbatches(), seq_length=args.seq_length, "
            "micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length, "
            "forward_only=False, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, "
            "force_all_reduce=save_wgrads_in_this_iteration,"),
    # 0.19: the chunk's pg_collection (SnakeModelChunk reaches the GPTModel's) and the
    # schedule's new keywords (the snake schedule takes them)
    Wrapped(_T, "train_step", "p2p_communicator=p2p_communicator, pg_collection=pg_collection,)",
            since("0.19")),
    Wrapped(_T, "train_step", 'pg_collection = get_attr_wrapped_model(model[0], "pg_collection")',
            since("0.19")),
    Wrapped(_T, "train_step", "update_successful, grad_norm, num_zeros_in_grad = optimizer.step()"),
    # Model and optimizer build (hooks.py binds the call to the function's own signature).
    Wrapped(_T, "pretrain", "model, optimizer, opt_param_scheduler = setup_model_and_optimizer("
                            "model_provider, model_type, checkpointing_context=checkpointing_context)",
            until("0.18")),
    Wrapped(_T, "pretrain", "model, optimizer, opt_param_scheduler = setup_model_and_optimizer("
                            "model_type, model_provider_func=model_provider, "
                            "checkpointing_context=checkpointing_context, cfg_container=cfg_container,",
            since("0.19")),
    Wrapped(_T, "setup_model_and_optimizer",
            "get_model(model_provider_func, model_type, wrap_with_ddp=wrap_with_ddp"),
    # 0.19: without a model provider the model is the config container's builder's
    Wrapped(_T, "setup_model_and_optimizer", "builder_cls = model_config.get_builder_cls()",
            since("0.19")),
    Wrapped(_T, "setup_model_and_optimizer", "builder = builder_cls(model_config)",
            since("0.19")),
    Wrapped("megatron.training.models.gpt", "GPTModelBuilder.build_model",
            "def build_model(self, pg_collection: ProcessGroupCollection, pre_process: bool | "
            "None = None, post_process: bool | None = None, vp_stage: int | None = None,)",
            since("0.19")),
    Wrapped(_T, "setup_model_and_optimizer", "optimizer = get_megatron_optimizer("),
    Wrapped(_T, "setup_model_and_optimizer", "= load_checkpoint("),
    Wrapped(_T, "get_model", "def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, "
                             "wrap_with_ddp=True, config=None, pg_collection=None)"),
    # Checkpoints: pretrain() and save_checkpoint_and_time() use the training-module names.
    Wrapped(_T, "", "from megatron.training.checkpointing import load_checkpoint"),
    Wrapped(_T, "", "from megatron.training.checkpointing import save_checkpoint"),
    Wrapped(_T, "save_checkpoint_and_time", "save_checkpoint("),
    # Flags: until 0.17 initialize_megatron() parses and validates with the module globals
    # it imported; from 0.18 the entry script calls arguments.parse_and_validate_args, which
    # uses the arguments module's own.
    Wrapped(_I, "", "from megatron.training.arguments import parse_args", until("0.17")),
    Wrapped(_I, "", "from megatron.training.arguments import validate_args", until("0.17")),
    Wrapped(_I, "initialize_megatron", "args = parse_args(extra_args_provider, ignore_unknown_args)",
            until("0.17")),
    Wrapped(_I, "initialize_megatron", "validate_args(args, args_defaults)", until("0.17")),
    Wrapped(_A, "parse_and_validate_args",
            "args = parse_args(extra_args_provider, ignore_unknown_args)", since("0.18")),
    Wrapped(_A, "parse_and_validate_args", "validate_args(args, args_defaults)", since("0.18")),
    Wrapped(_A, "parse_args", "def parse_args(extra_args_provider=None, ignore_unknown_args=False)"),
    Wrapped(_A, "parse_args", "parser = extra_args_provider(parser)"),
    Wrapped("megatron.training.inprocess_restart", "maybe_wrap_for_inprocess_restart",
            "args = arguments.parse_args(ignore_unknown_args=True)"),
    # The log lines users (and tests/megatron_lm) read.
    Wrapped(_T, "training_log", "log_string += ' {}: {:.6E} |'.format(key, avg)"),
    Wrapped(_T, "training_log", "log_string += f' grad norm: {grad_norm:.3f} |'"),
    # hooks.py: the schedule and the log suffix.
    Wrapped(_T, "setup_model_and_optimizer",
            "opt_param_scheduler = get_optimizer_param_scheduler(optimizer)"),
    Wrapped(_T, "training_log", "print_rank_last(log_string)"),
    Wrapped(_T, "", "from .utils import print_rank_last"),
    Wrapped("megatron.training.checkpointing", "get_rng_state",
            "def get_rng_state(ckpt_format: str, tp_group: torch.distributed.ProcessGroup, "
            "pp_group: torch.distributed.ProcessGroup"),
    # model.py: each decoder layer reported as it is built (the streamed build).
    Wrapped("megatron.core.transformer.transformer_block", "TransformerBlock._build_layers",
            "module = build_module("),
    # The runner's dataset-helpers skip (megatron_snake.megatron_lm._skip_dataset_helpers_make).
    Wrapped(_I, "_compile_dependencies", "from megatron.core.datasets.utils import compile_helpers"),
    Wrapped("megatron.core.datasets.utils", "compile_helpers",
            'command = ["make", "-C", os.path.abspath(os.path.dirname(__file__))]'),
)


class CpuSite(NamedTuple):
    """A Megatron-LM function (``""``: the module itself) whose source must contain
    ``fragment`` for the CPU patch ``patch`` (compat/megatron_lm_on_cpu.py) to hold."""

    module: str
    qualname: str
    fragment: str
    patch: str
    releases: tuple[str, ...] = ALL

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


BATCH_INVARIANT_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

CPU_SITES: tuple[CpuSite, ...] = (
    CpuSite(_I, "initialize_megatron", 'assert torch.cuda.is_available(), "Megatron requires CUDA."', "A"),
    CpuSite(_T, "", "from megatron.training.initialize import initialize_megatron", "A"),
    CpuSite(_I, "_initialize_distributed", "device_count = torch.cuda.device_count()", "B"),
    CpuSite(_I, "_initialize_distributed", "if device_count > 0:", "B"),
    CpuSite(_I, "_set_random_seed", "if torch.cuda.device_count() > 0:", "B"),
    CpuSite(_I, "initialize_megatron",
            "_initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store", "B"),
    # 0.17 dropped the legacy fused kernels (and their nvcc probe)
    CpuSite(_I, "_compile_dependencies", "fused_kernels.load(args)", "D", until("0.16")),
    CpuSite("megatron.legacy.fused_kernels", "load", "_get_cuda_bare_metal_version(", "D",
            until("0.16")),
    CpuSite(_T, "get_model", "ddp_stream = torch.cuda.Stream()", "E"),
    CpuSite(_T, "get_model", "torch.cuda.current_stream().wait_stream(ddp_stream)", "E"),
    # 0.19: pretrain_gpt.py's model comes from the config's builder, wrapped in DDP here
    CpuSite("megatron.training.models.dist_utils", "_ddp_wrap", "ddp_stream = torch.cuda.Stream()",
            "E", since("0.19")),
    CpuSite("megatron.training.models.dist_utils", "_ddp_wrap",
            "torch.cuda.current_stream().wait_stream(ddp_stream)", "E", since("0.19")),
    CpuSite("megatron.core.rerun_state_machine", "RerunStateMachine._save_state",
            '"cuda_rng_state": torch.cuda.get_rng_state(),', "F"),
    CpuSite("megatron.core.rerun_state_machine", "RerunStateMachine._restore_state",
            'torch.cuda.set_rng_state(rng_state["cuda_rng_state"])', "F"),
    CpuSite("megatron.training.checkpointing", "get_rng_state",
            "'cuda_rng_state': torch.cuda.get_rng_state(),", "F"),
    CpuSite("megatron.training.checkpointing", "load_checkpoint",
            "torch.cuda.set_rng_state(rng_state['cuda_rng_state'])", "F"),
    CpuSite(_T, "pretrain", "build_train_valid_test_data_iterators(train_valid_test_dataset_provider", "G"),
    CpuSite(_T, "build_train_valid_test_data_iterators", "RerunDataIterator(iter(dataloader))", "G"),
    CpuSite(_A, "validate_args", "get_device_arch_version() < 10", "H"),
    CpuSite(_A, "validate_args", "os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') == \"1\"", "H"),
    CpuSite("megatron.training.utils", "get_device_arch_version",
            "torch.cuda.get_device_properties(", "H"),
    # 0.17 guards its triton import itself
    CpuSite(_I, "", f"from {BATCH_INVARIANT_KERNELS} import enable_batch_invariant_mode", "I", until("0.16")),
)


_RANDOM = "megatron.core.tensor_parallel.random"

# compat/megatron_on_cpu.py's patches of megatron-core (numbered as there)
CORE_CPU_SITES: tuple[CpuSite, ...] = (
    CpuSite(_RANDOM, "model_parallel_cuda_manual_seed",
            "_CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME", "1"),
    CpuSite(_RANDOM, "CudaRNGStatesTracker.add", "torch.cuda.get_rng_state()", "1"),
    CpuSite(_RANDOM, "CudaRNGStatesTracker.fork", "_set_cuda_rng_state(self.states_[name]", "1"),
    CpuSite(_RANDOM, "_get_all_rng_states", "_get_cuda_rng_state(", "1"),
    CpuSite(_RANDOM, "_set_all_rng_states", "_set_cuda_rng_state(", "1"),
    CpuSite(_RANDOM, "initialize_rng_tracker", "if _CUDA_RNG_STATE_TRACKER_INITIALIZED:", "1"),
    CpuSite("megatron.core.models.common.embeddings.rotary_pos_embedding",
            "RotaryEmbedding.get_emb", "torch.cuda.current_device()", "2"),
    CpuSite("megatron.core.utils", "GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device()", "2"),
    CpuSite("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator._communicate",
            "torch.cuda.synchronize()", "3"),
    CpuSite("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
            'device="cuda"', "4"),
    CpuSite("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
            "param.type() == 'torch.cuda.FloatTensor'", "5"),
    CpuSite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._build_model_and_main_param_groups",
            "model_param.type() == 'torch.cuda.FloatTensor'", "5"),
    CpuSite("megatron.core.distributed.param_and_grad_buffer",
            "_ParamAndGradBucketGroup.start_grad_sync",
            "current_stream = torch.cuda.current_stream()", "6", since("0.19")),
)


def core_cpu_sites_for(series: str) -> tuple[CpuSite, ...]:
    return tuple(s for s in CORE_CPU_SITES if series in s.releases)


def core_cpu_patches_for(series: str) -> str:
    return "".join(sorted({s.patch for s in core_cpu_sites_for(series)}))


def wrapped_for(series: str) -> tuple[Wrapped, ...]:
    return tuple(w for w in WRAPPED if series in w.releases)


def cpu_sites_for(series: str) -> tuple[CpuSite, ...]:
    return tuple(s for s in CPU_SITES if series in s.releases)


def cpu_patches_for(series: str) -> str:
    """The letters of the CPU patches that apply in a release: those with a site in it."""
    return "".join(sorted({s.patch for s in cpu_sites_for(series)}))


_IMPORT = re.compile(r"from\s+([\w.]+)\s+import\s+(\w+)\Z")


def contains(source: str, fragment: str) -> bool:
    """Whether ``source`` holds ``fragment`` (whitespace ignored; ``from M import N``
    matched by any import of N from M in ``source``)."""
    m = _IMPORT.match(fragment.strip())
    if m:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return False
        return any(isinstance(node, ast.ImportFrom)
                   and "." * node.level + (node.module or "") == m.group(1)
                   and any(alias.name == m.group(2) for alias in node.names)
                   for node in ast.walk(tree))
    return _squeeze(fragment) in _squeeze(source)


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)
