"""The ``--snake-*`` flags and their rules: one source for this project's own entry point
(``arguments.py``) and for the Megatron-LM plug-in (``megatron_snake.megatron_lm``), which
adds the same flags to Megatron-LM's parser and checks them with the same functions.

``add_snake_args`` is Megatron-LM's ``extra_args_provider`` (it takes and returns the
parser). ``validate_snake_args`` fills the derived defaults and refuses a bad value or
combination, naming the flag (``fail``: the parser's one-line usage error); it needs the
Megatron flags both entry points have (batch sizes, parallel sizes, layers, precision,
``--train-iters``) and ``args.num_microbatches`` / ``args.data_parallel_size`` computed.
A rule about one component's value lives beside that component (``check_alpha``,
``check_checkpoint_interval``, ``snake_groups``, ``ZenFlowSettings``, ...) and is called
from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from megatron_snake.errors import FlagError
from megatron_snake.models.gpt_units import check_checkpoint_interval
from megatron_snake.optim.cpu_threads import check_optimizer_threads
from megatron_snake.optim.offloaded_adamw import check_device_optimizer_share
from megatron_snake.optim.parts import check_alpha
from megatron_snake.optim.zenflow import ZenFlowSettings
from megatron_snake.planner.hardware import load_profile
from megatron_snake.schedule.pipeline import default_group_size, snake_groups
from megatron_snake.storage.directory import named_twice
from megatron_snake.storage.errors import OffloadError
from megatron_snake.storage.host_pool import (DEFAULT_POOL_CAP_BYTES, check_host_memory_limit,
                                              physical_memory_bytes)
from megatron_snake.storage.sizes import parse_size

SNAKE_SCHEDULES = ("vertical", "horizontal")
# Flags of the offloaded state: their defaults apply with --snake-offload, and given
# without it they are an error.
OFFLOAD_ONLY_DEFAULTS = {"--snake-param-tier": "nvme", "--snake-optimizer-tier": "nvme",
                         "--snake-alpha": 0.25, "--snake-gpu-memory-limit": None,
                         "--snake-speculate": "auto", "--snake-device-optimizer-share": "auto"}
# The settings --snake-auto chooses: given with it, they are an error (not silently ignored).
AUTO_CHOSEN_FLAGS = ("--snake-group-size", "--snake-alpha", "--snake-checkpoint-interval",
                     "--snake-param-tier", "--snake-optimizer-tier", "--snake-activation-tier")
SNAKE_TIERS = ("device", "host", "nvme")
ACTIVATION_TIERS = SNAKE_TIERS + ("auto",)
IO_ENGINES = ("auto", "uring", "threads", "python", "gds")
ZENFLOW_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ZenFlowSettings)}
DEFAULT_TRACE_ITERATION = 2   # the first steady iteration


def fail(parser: argparse.ArgumentParser, flag: str, message: str):
    parser.error(f"{flag}: {message}")


def check_rule(parser: argparse.ArgumentParser, rule, *values):
    """Apply a component's own rule to flag values; its ValueError (which names the flag)
    becomes the usage error."""
    try:
        return rule(*values)
    except (ValueError, OffloadError) as exc:
        parser.error(str(exc))


def add_snake_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The --snake-* flags, in their two groups. Each help says its default itself
    ("default: ..."): Megatron-LM's parser shows no defaults of its own."""
    g = p.add_argument_group("megatron_snake")
    g.add_argument("--snake-offload", action="store_true",
                   help="train with the snake schedule over the tiered store")
    g.add_argument("--snake-checkpoint-interval", type=int, default=1,
                   help="layers loaded and recomputed as one unit (default: %(default)s)")
    g.add_argument("--snake-schedule", default="vertical", choices=SNAKE_SCHEDULES,
                   help="micro-batch order: vertical (snake) or horizontal (ablation) "
                        "(default: %(default)s)")
    g.add_argument("--snake-group-size", type=int, default=None,
                   help="micro-batches per snake group (default: all; fewer with PP > 1)")
    g.add_argument("--snake-offload-dir", default=None,
                   help="directory (or {rank} template) for offloaded state; a,b: "
                        "one per drive (default: a temporary one)")
    g.add_argument("--snake-activation-tier", default=None, choices=ACTIVATION_TIERS,
                   help="where unit inputs wait for backward "
                        "(default: auto if vertical, else nvme)")
    g.add_argument("--snake-profile-iters", type=int, default=2,
                   help="iterations profiled for auto tier, adaptive offload (default: %(default)s)")
    g.add_argument("--snake-plan-json", default=None,
                   help="auto tier's plan (default: in --snake-offload-dir)")
    g.add_argument("--snake-activation-offload", action="store_true",
                   help="SSDTrain: offload the tensors autograd saves")
    g.add_argument("--snake-activation-offload-policy", default=None,
                   choices=("adaptive", "all"),
                   help="saves the plan hides, or all (default: adaptive; all in units)")
    g.add_argument("--snake-activation-offload-min-bytes", type=int, default=1 << 20,
                   help="saved tensors smaller than this stay in memory (default: 1 MiB)")
    g.add_argument("--snake-param-tier", default=None, choices=("host", "nvme", "auto"),
                   help="where units' weights wait between uses (default: "
                        f"{OFFLOAD_ONLY_DEFAULTS['--snake-param-tier']})")
    g.add_argument("--snake-optimizer-tier", default=None, choices=("host", "nvme", "auto"),
                   help="where master weights, Adam moments and gradients live (default: "
                        f"{OFFLOAD_ONLY_DEFAULTS['--snake-optimizer-tier']})")
    g.add_argument("--snake-alpha", type=float, default=None,
                   help="share of each unit's update deferred to the next forward sweep "
                        f"(default: {OFFLOAD_ONLY_DEFAULTS['--snake-alpha']})")
    g.add_argument("--snake-gpu-memory-limit", default=None,
                   help="device memory the run may use, e.g. 40GiB (default: no limit)")
    g.add_argument("--snake-host-memory-limit", default=None,
                   help="host buffer pool limit, e.g. 4GiB (default: what the run needs, "
                        f"at most {DEFAULT_POOL_CAP_BYTES >> 30}GiB)")
    g.add_argument("--snake-speculate", default=None, choices=("auto", "off"),
                   help="update during backward before the clip's verdict, redo on a miss "
                        "(default: auto)")
    g.add_argument("--snake-device-optimizer-share", default=None, metavar="auto|F",
                   help="first units' optimizer on the device: share F, or auto: what the "
                        "GPU limit leaves (default: auto)")
    g.add_argument("--snake-optimizer-threads", type=int, default=None, metavar="N",
                   help="CPU threads of the host optimizer (default: half the cores, at most "
                        "OMP_NUM_THREADS)")
    g.add_argument("--snake-auto", action="store_true",
                   help="for --snake-hardware, choose group size, alpha, unit size and tiers")
    g.add_argument("--snake-hardware", default=None, metavar="PROFILE",
                   help="a shipped profile's name or a tools/calibrate.py JSON")
    g.add_argument("--snake-dry-run", action="store_true",
                   help="print and check the bytes each tier needs, then exit")
    g.add_argument("--snake-trace", default=None, metavar="FILE",
                   help="write a Chrome trace of one iteration to FILE")
    g.add_argument("--snake-trace-iteration", type=int, default=None,
                   help="iteration --snake-trace records, from 1 (default: "
                        f"{DEFAULT_TRACE_ITERATION})")
    g.add_argument("--snake-log-details", action="store_true",
                   help="every figure on the log line (default: a compact set)")
    g.add_argument("--snake-io-engine", default="auto", choices=IO_ENGINES,
                   help="how offloaded bytes reach the drive (default: %(default)s)")

    g = p.add_argument_group("ZenFlow (approximate: important columns at once, the rest late)")
    g.add_argument("--snake-zenflow", action="store_true",
                   help="APPROXIMATE optimizer: ZenFlow (docs/zenflow.md)")
    g.add_argument("--snake-zenflow-topk-ratio", type=float, default=None,
                   help="share of columns updated at once "
                        f"(default: {ZENFLOW_DEFAULTS['topk_ratio']})")
    g.add_argument("--snake-zenflow-select-interval", type=int, default=None,
                   help="steps between column selections "
                        f"(default: {ZENFLOW_DEFAULTS['select_interval']})")
    g.add_argument("--snake-zenflow-update-interval", type=int, default=None,
                   help="steps per CPU update of the other columns "
                        f"(default: {ZENFLOW_DEFAULTS['update_interval']})")
    g.add_argument("--snake-zenflow-full-warmup-steps", type=int, default=None,
                   help="first steps done as exact AdamW updates "
                        f"(default: {ZENFLOW_DEFAULTS['full_warmup_steps']})")
    g.add_argument("--snake-zenflow-overlap-step", action="store_true", default=None,
                   help="run the CPU update in the background, an interval late")
    return p


def validate_snake_args(args: argparse.Namespace, parser: argparse.ArgumentParser, *,
                        planned: bool = False) -> None:
    """Fill the --snake-* flags' derived defaults and refuse what does not hold, naming the
    flag. ``planned``: the flags describe a run being planned (tools/plan.py), perhaps for
    another machine, whose memory is its hardware profile's, not this one's."""
    check_rule(parser, check_checkpoint_interval, args.snake_checkpoint_interval)
    _default_host_memory_limit(args)
    for flag in ("--snake-host-memory-limit", "--snake-gpu-memory-limit"):
        attr = flag[2:].replace("-", "_")
        if getattr(args, attr) is not None:
            try:
                setattr(args, attr, parse_size(getattr(args, attr)))
            except ValueError as exc:
                fail(parser, flag, str(exc))
    if args.snake_offload or args.snake_activation_offload:   # the store's host pool
        here = None if planned else physical_memory_bytes()
        check_rule(parser, lambda: check_host_memory_limit(args.snake_host_memory_limit,
                                                           physical_bytes=here))
    _validate_activation_tier(args, parser)
    for flag, default in OFFLOAD_ONLY_DEFAULTS.items():  # nothing is silently ignored
        attr = flag[2:].replace("-", "_")
        if not args.snake_offload and getattr(args, attr) is not None:
            fail(parser, flag, "configures --snake-offload's offloaded state; add "
                 "--snake-offload or drop the flag")
        if args.snake_offload and getattr(args, attr) is None:
            setattr(args, attr, default)
    if args.snake_dry_run and not args.snake_offload:
        fail(parser, "--snake-dry-run", "estimates --snake-offload's run; add "
             "--snake-offload or drop the flag")
    _validate_io_engine(args, parser)
    if args.snake_offload_dir:
        check_rule(parser, split_offload_dirs, args.snake_offload_dir)
    _validate_trace(args, parser)
    _validate_auto(args, parser)
    if args.snake_offload:
        check_rule(parser, check_alpha, args.snake_alpha)
        args.snake_device_optimizer_share = check_rule(
            parser, lambda: check_device_optimizer_share(
                args.snake_device_optimizer_share,
                getattr(args, "use_precision_aware_optimizer", False)))
    _validate_pipeline(args, parser)
    _validate_zenflow(args, parser)
    _validate_optimizer_threads(args, parser, planned)


def _validate_optimizer_threads(args, parser, planned: bool) -> None:
    """The host optimizer's thread budget: its value checked against this machine's cores,
    or its default filled in; a planned run's is another machine's, checked there."""
    threads = args.snake_optimizer_threads
    if threads is not None and not (args.snake_offload or args.snake_zenflow):
        fail(parser, "--snake-optimizer-threads", "sets the threads of the host optimizer of "
             "--snake-offload or --snake-zenflow; add one of them or drop the flag")
    if planned:
        if threads is not None and threads < 1:
            fail(parser, "--snake-optimizer-threads", f"must be >= 1, got {threads}")
    elif args.snake_offload or args.snake_zenflow:
        args.snake_optimizer_threads = check_rule(parser, check_optimizer_threads, threads)


def _default_host_memory_limit(args) -> None:
    """--snake-host-memory-limit not given: the cap for now, and
    ``args.snake_host_pool_default`` says so; the pre-flight of an offloaded run
    (``preflight.host_pool_default``, with the model's shapes) sizes the pool to the run."""
    default = args.snake_host_memory_limit is None
    if default:
        args.snake_host_memory_limit = DEFAULT_POOL_CAP_BYTES
    args.snake_host_pool_default = default or getattr(args, "snake_host_pool_default", False)


def refuse_flags_snake_auto_chooses(args, parser, given: list[str]) -> None:
    """With --snake-auto, the settings it chooses may not be given too (``given``: the
    command line)."""
    if args.snake_auto:
        for flag in AUTO_CHOSEN_FLAGS:
            if any(a == flag or a.startswith(flag + "=") for a in given):
                fail(parser, flag, "is chosen by --snake-auto; drop one of the two")


def _validate_activation_tier(args, parser) -> None:
    if args.snake_activation_tier is None:   # placed by the plan where there is one to make
        args.snake_activation_tier = "auto" if args.snake_offload and \
            args.snake_schedule == "vertical" else "nvme"
    if args.snake_activation_offload and not args.snake_offload and \
            args.snake_activation_tier == "device":
        fail(parser, "--snake-activation-tier", "use host or nvme with "
             "--snake-activation-offload")
    policy = args.snake_activation_offload_policy
    if policy is not None and not args.snake_activation_offload:
        fail(parser, "--snake-activation-offload-policy", "applies with "
             "--snake-activation-offload: add it, or drop the policy")
    if policy == "adaptive" and args.snake_offload:
        fail(parser, "--snake-activation-offload-policy", "adaptive plans Megatron's "
             "schedule; with --snake-offload the saved tensors inside each unit's recompute "
             "all go (policy all): drop the flag")
    if args.snake_activation_offload and policy is None:
        args.snake_activation_offload_policy = "all" if args.snake_offload else "adaptive"
    if args.snake_activation_offload and args.snake_profile_iters < 1:
        fail(parser, "--snake-profile-iters", "must be >= 1: the saved-tensor offload plan "
             "and the auto tier's are made from profiled iterations")
    if args.snake_activation_tier == "auto" and args.snake_schedule == "horizontal":
        fail(parser, "--snake-activation-tier", "auto plans the vertical schedule's "
             "checkpoints; the horizontal ablation has none to plan: use host or nvme")
    if args.snake_activation_offload and not args.snake_offload and \
            args.snake_activation_tier == "auto":
        fail(parser, "--snake-activation-tier", "auto applies to the vertical schedule's "
             "checkpoints (--snake-offload); use host or nvme with --snake-activation-offload")


def _validate_pipeline(args, parser) -> None:
    """Snake units and groups against the pipeline stages."""
    pp = args.pipeline_model_parallel_size
    if args.snake_offload and args.snake_checkpoint_interval > args.num_layers // pp:
        fail(parser, "--snake-checkpoint-interval", f"{args.snake_checkpoint_interval} layers "
             f"per unit is more than the {args.num_layers // pp} layers of a pipeline stage; "
             f"use at most {args.num_layers // pp} (one unit per stage)")
    if args.snake_group_size is not None:
        if not args.snake_offload:
            fail(parser, "--snake-group-size", "applies to the vertical schedule; add "
                 "--snake-offload or drop the flag")
        if args.snake_schedule == "horizontal":
            fail(parser, "--snake-group-size", "the horizontal schedule runs micro-batch by "
                 "micro-batch; drop --snake-group-size or use --snake-schedule vertical")
        check_rule(parser, snake_groups, args.num_microbatches, args.snake_group_size)
    elif args.snake_offload:
        args.snake_group_size = default_group_size(args.num_microbatches, pp)
    if args.snake_offload and args.sequence_parallel:
        fail(parser, "--sequence-parallel", "is not supported with --snake-offload yet: the "
             "offloaded optimizer does not all-reduce the sequence-parallel layer-norm "
             "gradients across tensor-parallel ranks; drop one of the two flags")
    if args.snake_activation_offload and not args.snake_offload and pp > 1:
        fail(parser, "--snake-activation-offload", "without --snake-offload wraps Megatron's "
             "no-pipelining schedule; with --pipeline-model-parallel-size > 1 add "
             "--snake-offload (offload inside each unit's recompute) or drop it")
    if args.snake_offload and pp > 1 and args.snake_schedule == "horizontal":
        fail(parser, "--snake-schedule", "horizontal is a one-stage ablation; use "
             "vertical with --pipeline-model-parallel-size > 1")


def _validate_auto(args, parser) -> None:
    if args.snake_auto and not args.snake_offload:
        fail(parser, "--snake-auto", "configures --snake-offload's run; add --snake-offload")
    if args.snake_auto and args.snake_schedule != "vertical":
        fail(parser, "--snake-auto", "plans the vertical schedule; drop --snake-schedule "
             "horizontal")
    if args.snake_hardware is None:
        if args.snake_auto:
            fail(parser, "--snake-auto", "needs --snake-hardware PROFILE (measure one with "
                 "tools/calibrate.py, or name a shipped one such as h100_4x_gen4)")
        return
    if not (args.snake_auto or args.snake_dry_run):
        fail(parser, "--snake-hardware", "is read by --snake-auto and --snake-dry-run; add "
             "one of them or drop the flag")
    if args.snake_schedule != "vertical" or args.snake_activation_offload:
        fail(parser, "--snake-hardware", "the cost model plans the vertical schedule "
             "without --snake-activation-offload; drop one of them")
    check_rule(parser, load_profile, args.snake_hardware, "--snake-hardware")


def _validate_trace(args, parser) -> None:
    given = args.snake_trace_iteration
    if args.snake_trace is None:
        if given is not None:
            fail(parser, "--snake-trace-iteration", "chooses the iteration --snake-trace "
                 "records; add --snake-trace FILE or drop the flag")
        return
    if given is not None and given > args.train_iters:
        fail(parser, "--snake-trace-iteration", f"{given} is never reached in a run of "
             f"--train-iters {args.train_iters}; give 1 to {args.train_iters}")
    if given is None:   # the default: the loop takes the last iteration of a shorter run
        args.snake_trace_iteration = DEFAULT_TRACE_ITERATION
    folder = os.path.dirname(os.path.abspath(args.snake_trace))
    if os.path.isdir(args.snake_trace) or not os.path.isdir(folder) or \
            not os.access(folder, os.W_OK):
        fail(parser, "--snake-trace", f"{args.snake_trace!r} must name a file in an "
             "existing, writable directory (it is written at the traced iteration)")


def split_offload_dirs(value: str) -> list[str]:
    """``--snake-offload-dir``'s comma-separated directories (the store is striped over
    them); an empty entry, or one given twice, is refused (FlagError)."""
    entries = value.split(",")
    if not all(entries):
        raise FlagError(f"--snake-offload-dir {value!r} has an empty entry; give directories "
                        "separated by single commas, e.g. /nvme0/off,/nvme1/off")
    twice = named_twice(entries, os.path.normpath)
    if twice:
        raise FlagError(f"--snake-offload-dir {value!r} names one directory more than once "
                        f"({', '.join(twice)}); give each drive's directory once")
    return entries


def _validate_io_engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--snake-io-engine needs a store to drive, and the native engines need their build."""
    if args.snake_io_engine == "auto":
        return
    if not (args.snake_offload or args.snake_activation_offload):
        fail(parser, "--snake-io-engine", "configures the offload store; add --snake-offload "
             "or --snake-activation-offload, or drop the flag")
    from megatron_snake.storage.engine import native_available

    if args.snake_io_engine in ("uring", "threads") and not native_available():
        fail(parser, "--snake-io-engine", f"{args.snake_io_engine} is a native engine and "
             "megatron_snake._snake_aio is not built here; install liburing-dev and a C "
             "compiler and reinstall (bash tools/install.sh), or use python")


def _validate_zenflow(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ZenFlow's knobs need --snake-zenflow (a knob is never silently ignored) and build
    ``args.zenflow``, which checks their values; refuse what ZenFlow does not combine with."""
    given = {key: getattr(args, f"snake_zenflow_{key}") for key in ZENFLOW_DEFAULTS}
    given = {key: value for key, value in given.items() if value is not None}
    args.zenflow = None
    if not args.snake_zenflow:
        for key in given:
            fail(parser, "--snake-zenflow-" + key.replace("_", "-"), "needs --snake-zenflow")
        return
    if args.snake_offload:
        fail(parser, "--snake-zenflow", "cannot be combined with --snake-offload: ZenFlow "
             "keeps the working weights on the compute device (ZeRO-Offload style) while "
             "--snake-offload moves them unit by unit; drop one of the two flags")
    if args.fp16:
        fail(parser, "--fp16", "--snake-zenflow has no loss scaler yet; use --bf16 or fp32")
    if args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1:
        fail(parser, "--tensor-model-parallel-size", "--snake-zenflow supports data "
             "parallelism only (tensor and pipeline parallel size 1)")
    args.zenflow = check_rule(parser, lambda: ZenFlowSettings(**given))
