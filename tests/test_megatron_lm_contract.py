"""The Megatron-LM plug-in driven the way Megatron-LM 0.16.1 drives it, without Megatron-LM.

CI has no Megatron-LM checkout (tests/megatron_lm runs the real pretrain_gpt.py where one is
given), so these tests call the plug-in's pieces as Megatron-LM's training package calls
them: the call order, arguments and attributes of ``setup_model_and_optimizer``, ``train``,
``train_step``, ``evaluate``, ``save_checkpoint``, ``load_checkpoint``, ``training_log``
and ``validate_args`` at tag core_v0.16.1 (the line numbers are its
megatron/training/training.py's), through stand-ins written here, each naming the
Megatron-LM function it stands for. The model provider, the learning-rate schedule and the
forward step are built as Megatron-LM's ``gpt_builder``, ``get_optimizer_param_scheduler``
and ``pretrain_gpt.py`` build theirs; the plug-in's pieces are handed over as hooks.py
hands them to Megatron-LM.

The numbers are held to Megatron's own code only: the same forward step, data and initial
weights through Megatron-Core's ``forward_backward_no_pipelining`` on an in-memory model under
Megatron's DDP with Megatron's optimizer (``get_megatron_optimizer``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import (OptimizerParamScheduler,
                                                     get_canonical_lr_for_logging)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.timers import Timers
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from conftest import VOCAB, make_microbatches
from megatron_snake.errors import UserError
from megatron_snake.megatron_lm import checkpoints, flags, log as snake_log, run as plugin_run
from megatron_snake.megatron_lm.model import SnakeModelChunk
from megatron_snake.schedule.forward_step import ForwardStepError
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.distributed import set_seed
from megatron_snake.training.model import transformer_config
from megatron_snake.training.optimizer import optimizer_config

SEED = 5
MICRO_BATCH, GLOBAL_BATCH, SEQ = 2, 4, 16       # 2 micro-batches per step
STEPS = 4
FLOPS_PER_ITERATION = 1.25e12   # num_floating_point_operations(args, batch_size), made up
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO_BATCH),
         "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(STEPS),
         "--lr", "3e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(SEED),
         "--snake-offload", "--snake-checkpoint-interval", "1"]
EXTRA = "max token loss"   # the extra value the test's loss function reports

# Attributes Megatron-LM's parsed args have (at its defaults) that this project's lack:
# what the plug-in and the stand-ins below read, and what the flag table reads.
MEGATRON_LM_ONLY = dict(
    consumed_valid_samples=0, skipped_train_samples=0, iteration=0,
    num_floating_point_operations_so_far=0, decoder_seq_length=None,
    weight_decay_incr_style="constant", lr_wsd_decay_iters=None,
    lr_wsd_decay_style="exponential", timing_log_level=0, timing_log_option="minmax",
    calculate_per_token_loss=False, accumulate_allreduce_grads_in_fp32=False,
    recompute_granularity=None, recompute_activations=False, recompute_method=None,
    num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
    fp8=None, fp4=None, context_parallel_size=1, num_experts=None, mtp_num_layers=None,
    multi_latent_attention=False, is_hybrid_model=False, use_torch_fsdp2=False,
    use_megatron_fsdp=False, cuda_graph_impl="none", enable_cuda_graph=False,
    external_cuda_graph=False, tp_comm_overlap=False, optimizer_cpu_offload=False,
    use_precision_aware_optimizer=False, decoupled_lr=None, rampup_batch_size=None,
    train_samples=None, async_save=False, non_persistent_save_interval=None,
    log_params_norm=False, log_num_zeros_in_grad=False,
    check_weight_hash_across_dp_replicas_interval=None, save_wgrads_interval=None,
    save_dgrads_interval=None, data_parallel_random_init=False,
    use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False,
    align_param_gather=True,
)


_ARGS: argparse.Namespace | None = None


def get_args() -> argparse.Namespace:
    """Megatron-LM's ``get_args()``: the flags ``mlm_args`` made last."""
    return _ARGS


def mlm_args(*extra: str, argv=None, checked: bool = True) -> argparse.Namespace:
    """Megatron-LM's args after its ``validate_args`` (and ``get_args()`` from now on):
    this project's parsed flags (Megatron-LM's names) plus the attributes only Megatron-LM's
    have, at its defaults; ``checked``: then ``flags.check_args`` as hooks.py runs it after
    ``validate_args`` (its notes in ``args.snake_notes``)."""
    global _ARGS
    argv = [*FLAGS, *extra] if argv is None else argv
    args = parse_args(argv)
    for name, value in MEGATRON_LM_ONLY.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    # what Megatron-LM's validate_args sets
    args.consumed_train_samples = 0
    args.start_weight_decay = args.end_weight_decay = args.weight_decay
    if args.fp16:
        args.check_for_nan_in_loss_and_grad = False
    args.add_bias_linear = not args.disable_bias_linear
    args.padded_vocab_size = VOCAB
    if checked:
        args.snake_notes = flags.check_args(args, "pretrain_gpt.py", argv)
    _ARGS = args
    return args


# --- Megatron-LM's model provider and schedule (gpt_builders.py, training.py) ------------

def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None,
                pg_collection=None) -> GPTModel:
    """Megatron-LM's ``gpt_builder`` for ``--transformer-impl local``."""
    if config is None:   # core_transformer_config_from_args: every field named like a flag
        config = transformer_config(args)
        config.calculate_per_token_loss = args.calculate_per_token_loss
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(
            normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, fp16_lm_cross_entropy=False,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        vp_stage=vp_stage, pg_collection=pg_collection)


def model_provider(args):
    """pretrain_gpt.py's ``partial(model_provider, gpt_builder)``: what it hands
    ``pretrain`` and ``setup_model_and_optimizer`` hands ``get_model``."""
    def provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                 pg_collection=None):
        return gpt_builder(args, pre_process, post_process, vp_stage, config=config,
                           pg_collection=pg_collection)
    return provider


def get_optimizer_param_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """Megatron-LM's ``get_optimizer_param_scheduler`` with ``--train-iters``."""
    gbs = args.global_batch_size
    lr_decay_steps = args.lr_decay_iters * gbs
    if args.lr_warmup_fraction is not None:
        lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
    else:
        lr_warmup_steps = args.lr_warmup_iters * gbs
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=lr_warmup_steps, lr_decay_steps=lr_decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


# --- pretrain_gpt.py's forward step ------------------------------------------------------

CALLS = collections.Counter()   # forward steps and loss functions called


def get_batch(data_iterator, vp_stage=None):
    """pretrain_gpt.py's ``get_batch`` at one rank: the iterator's dict, in its order."""
    batch = next(data_iterator)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"], None)


def loss_func(loss_mask, output_tensor, model=None):
    """pretrain_gpt.py's ``loss_func`` (with its NaN / Inf checks), reporting one extra
    value: a single number per micro-batch, which Megatron-LM's ``train_step`` averages
    over the micro-batches."""
    CALLS["loss_func"] += 1
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)]),
              EXTRA: (losses * loss_mask).max().detach().view(1)}
    if get_args().check_for_nan_in_loss_and_grad:
        for rejection_func in (torch.isnan, torch.isinf):
            get_rerun_state_machine().validate_result(
                result=loss, rejection_func=rejection_func, message="found NaN or Inf in "
                "local forward loss calculation", tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan=False):
    """pretrain_gpt.py's ``forward_step``."""
    CALLS["forward_step"] += 1
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(
        data_iterator, vp_stage)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels,
                          loss_mask=loss_mask, packed_seq_params=packed_seq_params)
    return output_tensor, functools.partial(loss_func, loss_mask, model=model)


# --- Megatron-LM's training loop ---------------------------------------------------------

def _all_ranks_true(flag) -> bool:
    """``logical_and_across_model_parallel_group``: only the object ``True`` counts."""
    value = torch.tensor([1 if flag is True else 0], dtype=torch.int)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=mpu.get_model_parallel_group())
    return bool(value.item())


def _max_stat(stat):
    """``reduce_max_stat_across_model_parallel_group``: a float32 max, None kept."""
    value = torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    return None if value.item() == -1.0 else value.item()


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
               config, forward_backward_func, args):
    """Megatron-LM's ``train_step`` (training.py l.1603-1770, without Model Optimizer,
    --save-wgrads-interval and vision). Returns (loss_reduced, skipped_iter, grad_norm,
    num_zeros_in_grad)."""
    rerun_state_machine = get_rerun_state_machine()
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        for model_chunk in model:
            model_chunk.zero_grad_buffer()
            model_chunk.force_all_reduce = False      # save_wgrads_in_this_iteration
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length, forward_only=False,
            adjust_tensor_shapes_fn=None, force_all_reduce=False)
        for model_chunk in model:
            model_chunk.force_all_reduce = False
    _, should_exit, _ = rerun_state_machine.should_checkpoint_and_exit()
    assert not should_exit
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    update_successful = _all_ranks_true(update_successful)
    grad_norm = _max_stat(grad_norm)
    if update_successful:
        increment = args.num_microbatches * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    assert mpu.is_pipeline_last_stage(ignore_virtual=True)
    loss_reduced = {}
    for key in losses_reduced[0].keys():   # the last stage's reduction, per key
        val = [x[key].view(-1) for x in losses_reduced]
        if val[0].numel() == 2:            # (sum, count): over micro-batches and DP ranks
            val = torch.vstack(val).sum(dim=0)
            dist.all_reduce(val, group=mpu.get_data_parallel_group(with_context_parallel=True))
            loss_reduced[key] = val[0] / val[1]
        elif val[0].numel() == 1:          # one value: the mean over micro-batches
            loss_reduced[key] = torch.cat(val).mean()
        else:
            raise ValueError(f"Invalid value shape: {val[0].shape} for key {key}")
    return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad


@dataclass
class Logged:
    """What Megatron-LM's ``train`` hands ``training_log`` for one iteration, and what
    ``evaluate`` gave after it (with ``--eval-interval``)."""

    loss: dict
    grad_norm: float
    learning_rate: float
    loss_scale: float
    skipped_iter: int
    validation: dict = field(default_factory=dict)


def evaluate(forward_step_func, data_iterator, model, config, forward_backward_func,
             args) -> dict:
    """Megatron-LM's ``evaluate`` (training.py l.3035-3189) for one ``--eval-iters``,
    without non-loss data."""
    for model_module in model:
        model_module.eval()
    total_loss_dict = {}
    with torch.no_grad():
        config.timers = None
        loss_dicts = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=args.global_batch_size // (args.micro_batch_size *
                                                        args.data_parallel_size),
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length, forward_only=True)
        config.timers = Timers(args.timing_log_level, args.timing_log_option)
        for key in loss_dicts[0].keys():
            total = total_loss_dict.setdefault(key, torch.zeros(2))
            val = [x[key].view(-1) for x in loss_dicts]
            if val[0].numel() == 2:
                val = torch.vstack(val).sum(dim=0)
                dist.all_reduce(val, group=mpu.get_data_parallel_group(
                    with_context_parallel=True))
                total += val
            else:
                total[0] += torch.cat(val).sum()
                total[1] += len(loss_dicts)
        args.consumed_valid_samples += args.global_batch_size
    for model_module in model:
        model_module.train()
    return {key: (total[0] / total[1]).item() for key, total in total_loss_dict.items()}


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          forward_backward_func, args, *, valid_data=None, save_checkpoint=None,
          finalize_model_grads_func=finalize_model_grads) -> list[Logged]:
    """Megatron-LM's ``train`` (training.py l.2417-3032) from ``args.iteration`` to
    ``--train-iters``: the config hooks it sets, ``train_step``, the consumed samples and
    FLOPs, what it logs, ``evaluate`` every ``--eval-interval`` (on ``valid_data()``, a
    fresh iterator), ``save_checkpoint`` every ``--save-interval`` and the end at
    ``--exit-interval``."""
    config = get_model_config(model[0])
    for model_module in model:
        model_module.train()
    get_attr_wrapped_model(model[0], "pg_collection")
    iteration = args.iteration
    num_floating_point_operations_so_far = args.num_floating_point_operations_so_far
    config.grad_scale_func = optimizer.scale_loss
    config.timers = Timers(args.timing_log_level, args.timing_log_option)
    assert not (isinstance(model[0], DistributedDataParallel) and args.overlap_grad_reduce)
    assert not (args.overlap_param_gather and args.align_param_gather)
    config.finalize_model_grads_func = finalize_model_grads_func
    logged = []
    while iteration < args.train_iters:
        args.curr_iteration = iteration
        loss_dict, skipped_iter, grad_norm, _ = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler,
            config, forward_backward_func, args)
        iteration += 1
        args.consumed_train_samples += (mpu.get_data_parallel_world_size() *
                                        args.micro_batch_size * args.num_microbatches)
        num_floating_point_operations_so_far += FLOPS_PER_ITERATION
        loss_scale = optimizer.get_loss_scale().item() if not optimizer.is_stub_optimizer \
            else 1.0
        learning_rate = get_canonical_lr_for_logging(optimizer.param_groups)
        logged.append(Logged({k: v.item() for k, v in loss_dict.items()}, grad_norm,
                             learning_rate, loss_scale, skipped_iter))
        if valid_data is not None and args.eval_interval and \
                iteration % args.eval_interval == 0:
            logged[-1].validation = evaluate(forward_step_func, valid_data(), model, config,
                                             forward_backward_func, args)
        # checkpoint_and_decide_exit -> save_checkpoint_and_time -> save_checkpoint
        saved = False
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                            num_floating_point_operations_so_far, {},
                            non_persistent_ckpt=False, train_data_iterator=train_data_iterator,
                            preprocess_common_state_dict_fn=None)
            saved = True
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and not saved:
                save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                num_floating_point_operations_so_far, {},
                                train_data_iterator=train_data_iterator)
            break   # Megatron-LM's train() then calls sys.exit
    args.iteration = iteration
    return logged


def update_num_microbatches_stub(calls: list):
    """Megatron-LM's ``update_num_microbatches`` (a fixed batch size: nothing to update)."""
    def update_num_microbatches(consumed_samples, consistency_check=True, verbose=False):
        calls.append((consumed_samples, verbose))
    return update_num_microbatches


def get_rng_state_stub(calls: list):
    """Megatron-LM's ``get_rng_state(ckpt_format="torch_dist", ...)`` at one rank: its
    ``rng_state`` ShardedObject (numpy objects inside)."""
    def get_rng_state():
        calls.append(True)
        state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
                 "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
        return ShardedObject("rng_state", [state], (1, 1), (0, 0), replica_id=0)
    return get_rng_state


def save_checkpoint_stub(rng_calls: list, lines: list):
    """Megatron-LM's ``save_checkpoint`` as hooks.py replaces it with --snake-offload."""
    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                        num_floating_point_operations_so_far, *args, **kwargs):
        return checkpoints.save(iteration, model, optimizer, opt_param_scheduler,
                                num_floating_point_operations_so_far, log=lines.append,
                                megatron_lm_rng=get_rng_state_stub(rng_calls))
    return save_checkpoint


@contextlib.contextmanager
def offloaded(args, lines: list | None = None, load_calls: list | None = None):
    """Megatron-LM's ``setup_model_and_optimizer`` as hooks.py replaces it (``run.setup``
    with Megatron-LM's schedule and ``checkpoints.load``), inside ``run.closing()`` as
    hooks.py wraps ``pretrain``; yields its result and ``get_forward_backward_func()``.
    Built from ``SEED``, as Megatron-LM's initialisation seeds before the model is built."""
    lines = [] if lines is None else lines
    load_calls = [] if load_calls is None else load_calls
    set_seed(SEED)
    with plugin_run.closing():
        model, optimizer, scheduler = plugin_run.setup(
            args, model_provider(args), ModelType.encoder_or_decoder,
            make_scheduler=functools.partial(get_optimizer_param_scheduler, args),
            load=lambda built: checkpoints.load(
                built, update_num_microbatches=update_num_microbatches_stub(load_calls),
                log=lines.append),
            log=lines.append)
        yield model, optimizer, scheduler, plugin_run.current().forward_backward


def in_memory(args):
    """Megatron-LM's ``setup_model_and_optimizer`` without the plug-in, at one rank:
    ``get_model`` (the provider, ``set_defaults...``, Megatron's DDP), then
    ``get_megatron_optimizer`` and the schedule, from the same ``SEED``."""
    set_seed(SEED)
    gpt = model_provider(args)(pre_process=mpu.is_pipeline_first_stage(),
                               post_process=mpu.is_pipeline_last_stage(), config=None,
                               pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    gpt.model_type = ModelType.encoder_or_decoder
    for param in gpt.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if args.fp16 or args.bf16:
        gpt = Float16Module(gpt.config, gpt)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad, bucket_size=None,
        overlap_grad_reduce=False, use_distributed_optimizer=False)
    model = [DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)]
    optimizer = get_megatron_optimizer(optimizer_config(args), model)
    return model, optimizer, get_optimizer_param_scheduler(args, optimizer)


def batches(steps: int, seed: int = 0, distinct: int = 2) -> list[list[dict]]:
    """``steps`` global batches of micro-batches, ``distinct`` different ones in turn (random
    tokens are learnt only by seeing them again); one data iterator runs through them."""
    return [make_microbatches(GLOBAL_BATCH // MICRO_BATCH, batch=MICRO_BATCH, seq=SEQ,
                              seed=seed + s % distinct) for s in range(steps)]


def data_iterator(steps: list[list[dict]]):
    return iter([mb for step in steps for mb in step])


class Counting:
    """A function that counts its calls (``finalize_model_grads`` here)."""

    def __init__(self, func):
        self.func, self.calls = func, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.func(*args, **kwargs)


# --- the numbers: Megatron-LM's loop over the plug-in equals it over Megatron's own --------

def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_train_step_and_evaluate_match_megatron_core(megatron_world):
    """Megatron-LM's ``train`` / ``train_step`` / ``evaluate`` (every iteration) over the
    plug-in's model chunk, optimizer and schedule give, step for step, what they give over
    Megatron's own: ``forward_backward_no_pipelining`` on an in-memory GPTModel under
    Megatron's DDP with ``get_megatron_optimizer`` and ``finalize_model_grads`` (fp32,
    dropout 0, the same initial weights, data and forward step). Losses equal (bit for bit
    before the first update), grad norms within 1e-5, the learning rate and loss scale
    logged alike, the extra reported value back through train_step's reduction; the
    forward step and loss function called as often (once per micro-batch), and the snake
    never calls ``finalize_model_grads`` (its store owns the gradients)."""
    data, valid = batches(STEPS), batches(1, seed=100)
    runs = {}
    for name in ("megatron", "snake"):
        args = mlm_args("--eval-interval", "1")
        CALLS.clear()
        finalize = Counting(finalize_model_grads)
        if name == "megatron":
            model, optimizer, scheduler = in_memory(args)
            logged = train(forward_step, model, optimizer, scheduler, data_iterator(data),
                           get_forward_backward_func(), args,
                           valid_data=lambda: data_iterator(valid),
                           finalize_model_grads_func=finalize)
        else:
            with offloaded(args) as (model, optimizer, scheduler, forward_backward_func):
                assert isinstance(model, list) and len(model) == 1
                assert isinstance(model[0], SnakeModelChunk)
                logged = train(forward_step, model, optimizer, scheduler, data_iterator(data),
                               forward_backward_func, args,
                               valid_data=lambda: data_iterator(valid),
                               finalize_model_grads_func=finalize)
        assert args.iteration == STEPS
        assert args.consumed_train_samples == STEPS * GLOBAL_BATCH
        assert args.consumed_valid_samples == STEPS * GLOBAL_BATCH
        runs[name] = logged, dict(CALLS), finalize.calls
    (ours, our_calls, our_finalize), (reference, ref_calls, ref_finalize) = \
        runs["snake"], runs["megatron"]
    per_step = GLOBAL_BATCH // MICRO_BATCH
    assert our_calls == ref_calls == {"forward_step": 2 * STEPS * per_step,
                                      "loss_func": 2 * STEPS * per_step}
    assert (our_finalize, ref_finalize) == (0, STEPS)
    assert ours[0].loss == reference[0].loss, "the same initial weights: identical losses"
    for step, (a, b) in enumerate(zip(ours, reference), start=1):
        assert set(a.loss) == set(a.validation) == {"lm loss", EXTRA}
        for key in a.loss:
            assert _relative(a.loss[key], b.loss[key]) <= 1e-6, (step, key, a.loss, b.loss)
            assert _relative(a.validation[key], b.validation[key]) <= 1e-6, \
                (step, key, a.validation, b.validation)
        assert _relative(a.grad_norm, b.grad_norm) <= 1e-5, (step, a.grad_norm, b.grad_norm)
        assert a.learning_rate == b.learning_rate and a.loss_scale == b.loss_scale == 1.0
    assert reference[-1].loss["lm loss"] < reference[0].loss["lm loss"], "it must train"


def test_fp16_skips_the_iterations_megatron_skips(megatron_world):
    """Megatron-LM's ``train_step`` with ``--fp16`` and a loss scale that overflows at
    first: ``optimizer.step()`` says so (update_successful False, no grad norm), the
    schedule does not move, the logged loss scale halves, as over Megatron's fp16 optimizer
    and DDP. The snake accumulates gradients in fp32, so the plug-in turns on
    ``--accumulate-allreduce-grads-in-fp32`` with a note (Megatron's fp16 gradient buffers
    overflow in other iterations); the reference is built from the same args."""
    steps = 6
    data = batches(steps)
    flags_ = ("--fp16", "--train-iters", str(steps), "--initial-loss-scale", str(2 ** 22),
              "--hysteresis", "1")
    runs = {}
    for name in ("megatron", "snake"):
        args = mlm_args(*flags_)
        assert args.accumulate_allreduce_grads_in_fp32 is True
        assert any(note.startswith("> --fp16 with --snake-offload: ")
                   for note in args.snake_notes), args.snake_notes
        if name == "megatron":
            model, optimizer, scheduler = in_memory(args)
            runs[name] = train(forward_step, model, optimizer, scheduler, data_iterator(data),
                               get_forward_backward_func(), args)
        else:
            with offloaded(args) as (model, optimizer, scheduler, forward_backward_func):
                runs[name] = train(forward_step, model, optimizer, scheduler,
                                   data_iterator(data), forward_backward_func, args)
    ours, reference = runs["snake"], runs["megatron"]
    assert [r.skipped_iter for r in reference] == [1, 1, 1, 1, 0, 0], "the case must skip"
    assert [(r.skipped_iter, r.loss_scale, r.learning_rate) for r in ours] == \
        [(r.skipped_iter, r.loss_scale, r.learning_rate) for r in reference]
    for step, (a, b) in enumerate(zip(ours, reference), start=1):
        assert (a.grad_norm is None) == (b.grad_norm is None) == bool(a.skipped_iter)
        assert _relative(a.loss["lm loss"], b.loss["lm loss"]) <= 1e-5, (step, a, b)
        if a.grad_norm is not None:
            assert _relative(a.grad_norm, b.grad_norm) <= 1e-4, (step, a, b)


# --- save_checkpoint / load_checkpoint ---------------------------------------------------

def _saved_keys(iter_dir) -> set[str]:
    from megatron_snake.training.safe_dcp import read_metadata

    return {key.split("/")[0] for key in
            read_metadata(str(iter_dir / ".metadata")).state_dict_metadata}


def test_save_then_load_continues_with_the_uninterrupted_losses(megatron_world, tmp_path):
    """Megatron-LM's ``train`` saving at iteration 2 of 4 after its evaluation
    (``save_checkpoint`` as hooks.py replaces it: ``checkpoints.save``, with Megatron-LM's
    own ``rng_state`` from ``get_rng_state`` written beside the snake's), then a new run
    through ``setup_model_and_optimizer`` with ``--load``: Megatron-LM's
    ``load_checkpoint`` (``checkpoints.load``) leaves ``args.iteration``,
    ``args.num_floating_point_operations_so_far`` and the consumed samples as Megatron-LM's
    does and calls ``update_num_microbatches``; iterations 3 and 4 give the uninterrupted
    run's losses, grad norms and learning rates exactly. With ``--finetune`` the load
    starts at iteration 0 with the sample counts untouched and, as Megatron-LM's, the
    checkpoint's FLOPs so far."""
    data, valid, saved_at = batches(STEPS), batches(1, seed=100), 2
    root = tmp_path / "ckpt"
    args = mlm_args("--save", str(root), "--save-interval", str(saved_at),
                    "--eval-interval", str(saved_at))
    rng_calls, lines = [], []
    with offloaded(args, lines) as (model, optimizer, scheduler, forward_backward_func):
        uninterrupted = train(forward_step, model, optimizer, scheduler, data_iterator(data),
                              forward_backward_func, args,
                              valid_data=lambda: data_iterator(valid),
                              save_checkpoint=save_checkpoint_stub(rng_calls, lines))
    assert rng_calls == [True, True]   # at iterations 2 and 4
    assert {"rng_state", "snake_rng_state"} <= _saved_keys(root / "iter_0000002")
    assert any("successfully saved checkpoint from iteration       2" in line
               for line in lines), lines

    args = mlm_args("--load", str(root), "--ckpt-step", str(saved_at))
    load_calls = []
    with offloaded(args, load_calls=load_calls) as (model, optimizer, scheduler,
                                                    forward_backward_func):
        assert args.iteration == saved_at
        assert args.num_floating_point_operations_so_far == saved_at * FLOPS_PER_ITERATION
        assert args.consumed_train_samples == saved_at * GLOBAL_BATCH
        assert args.consumed_valid_samples == GLOBAL_BATCH
        assert load_calls == [(saved_at * GLOBAL_BATCH, True)]
        resumed = train(forward_step, model, optimizer, scheduler,
                        data_iterator(data[saved_at:]), forward_backward_func, args)
    assert args.iteration == STEPS and args.consumed_train_samples == STEPS * GLOBAL_BATCH
    assert [(r.loss, r.grad_norm, r.learning_rate) for r in resumed] == \
        [(u.loss, u.grad_norm, u.learning_rate) for u in uninterrupted[saved_at:]]

    args = mlm_args("--load", str(root), "--ckpt-step", str(saved_at), "--finetune")
    load_calls = []
    with offloaded(args, load_calls=load_calls):
        assert args.iteration == 0 and load_calls == []
        assert args.consumed_train_samples == args.consumed_valid_samples == 0
        assert args.num_floating_point_operations_so_far == saved_at * FLOPS_PER_ITERATION


# --- one run, driven as Megatron-LM's loop drives it --------------------------------------

class _TensorBoard:
    """Megatron-LM's TensorBoard writer (``add_scalar(name, value, iteration)``)."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


class _WandB:
    """Megatron-LM's W&B writer (the ``wandb`` module: ``log(dict, step)``)."""

    def __init__(self):
        self.logged = []

    def log(self, scalars, step):
        self.logged.append((dict(scalars), step))


def training_log_line(iteration: int, args, logged: Logged) -> str:
    """The line Megatron-LM's ``training_log`` hands ``print_rank_last`` (l.2008-2090)."""
    line = " [2025-01-01 00:00:00]"
    line += " iteration {:8d}/{:8d} |".format(iteration, args.train_iters)
    line += " consumed samples: {:12d} |".format(args.consumed_train_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(123.4)
    line += f" learning rate: {logged.learning_rate:.6E} |"
    line += " global batch size: {:5d} |".format(args.global_batch_size)
    for key, avg in logged.loss.items():
        line += " {}: {:.6E} |".format(key, avg)
    line += " loss scale: {:.1f} |".format(logged.loss_scale)
    line += f" grad norm: {logged.grad_norm:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(0)
    line += " number of nan iterations: {:3d} |".format(0)
    return line


class TestOneRun:
    """One offloaded run after one iteration of Megatron-LM's ``train``, shared by the
    tests of this class (the refusals come last: a refused forward step ends a run)."""

    @pytest.fixture(scope="class")
    def trained(self, megatron_world, tmp_path_factory):
        root = tmp_path_factory.mktemp("one_run") / "ckpt"
        args = mlm_args("--save", str(root), "--no-save-rng", "--exit-interval", "1")
        lines, rng_calls = [], []
        with offloaded(args, lines) as (model, optimizer, scheduler, forward_backward_func):
            logged = train(forward_step, model, optimizer, scheduler,
                           data_iterator(batches(1)), forward_backward_func, args,
                           save_checkpoint=save_checkpoint_stub(rng_calls, lines))
            yield argparse.Namespace(args=args, model=model, optimizer=optimizer,
                                     scheduler=scheduler, forward_backward=forward_backward_func,
                                     logged=logged, lines=lines, root=root,
                                     rng_calls=rng_calls)

    def test_the_model_chunk_offers_what_the_loop_calls(self, trained):
        """What Megatron-LM's ``train``, ``train_step`` and ``evaluate`` call on a model
        chunk (``zero_grad_buffer``, the ``force_all_reduce`` attribute, ``train`` /
        ``eval``, ``get_model_config``, ``get_attr_wrapped_model(chunk, "vp_stage")`` and
        ``"pg_collection"`` through ``.module``), and the refusal of a call of the whole
        model (the forward step's call goes to the schedule's stand-in instead)."""
        (chunk,) = trained.model
        gpt = chunk.module
        assert chunk.zero_grad_buffer() is None
        chunk.force_all_reduce = True
        chunk.force_all_reduce = False
        assert get_model_config(chunk) is gpt.config
        assert get_attr_wrapped_model(chunk, "vp_stage") is gpt.vp_stage
        assert get_attr_wrapped_model(chunk, "pg_collection") is gpt.pg_collection
        assert not isinstance(chunk, DistributedDataParallel)   # train(): no DDP hooks
        chunk.eval()
        assert not gpt.training and not any(m.training for m in gpt.modules())
        chunk.train()
        assert gpt.training and all(m.training for m in gpt.modules())
        batch = make_microbatches(1, batch=MICRO_BATCH, seq=SEQ)[0]
        with pytest.raises(RuntimeError, match="never called whole"):
            chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                  labels=batch["labels"])
        with pytest.raises(RuntimeError, match="unit by unit"):
            chunk.sharded_state_dict()

    def test_the_log_line_gets_the_snake_suffix(self, trained):
        """Megatron-LM's ``training_log`` line through ``print_rank_last``
        (``log.with_snake_suffix``): the line unchanged plus ``snake: ... |``, and the
        figures as ``snake/...`` scalars to its TensorBoard and W&B writers at the line's
        iteration; any other line (a validation line) is left as it is."""
        args, logged = trained.args, trained.logged[-1]
        line = training_log_line(args.iteration, args, logged)
        tensorboard, wandb = _TensorBoard(), _WandB()
        out = snake_log.with_snake_suffix(line, tensorboard_writer=tensorboard,
                                          wandb_writer=wandb)
        assert out.startswith(line + " snake: ") and out.endswith(" |"), out
        assert "\n" not in out
        assert tensorboard.scalars and all(name.startswith("snake/") and step == args.iteration
                                           for name, _, step in tensorboard.scalars)
        ((scalars, step),) = wandb.logged
        assert step == args.iteration
        assert scalars == {name: value for name, value, _ in tensorboard.scalars}
        validation = (" validation loss at iteration 1 | lm loss value: 4.852439E+00 | "
                      "lm loss PPL: 1.280617E+02 | ")
        for other in (validation, "> building train, validation, and test datasets ..."):
            tensorboard, wandb = _TensorBoard(), _WandB()
            assert snake_log.with_snake_suffix(other, tensorboard_writer=tensorboard,
                                               wandb_writer=wandb) == other
            assert tensorboard.scalars == [] and wandb.logged == []
        assert snake_log.with_snake_suffix(line, tensorboard_writer=None,
                                           wandb_writer=None).startswith(line + " snake: ")

    def test_the_exit_save_without_rng_writes_no_rng_state(self, trained):
        """Megatron-LM's ``save_checkpoint`` at ``--exit-interval`` with ``--no-save-rng``:
        ``get_rng_state`` is not called and neither RNG object is written; the tracker
        names the iteration and the log says so."""
        assert trained.args.iteration == 1 and len(trained.logged) == 1
        assert trained.rng_calls == []
        assert (trained.root / "latest_checkpointed_iteration.txt").read_text() == "1"
        keys = _saved_keys(trained.root / "iter_0000001")
        assert not keys & {"rng_state", "snake_rng_state"}, keys
        assert any("successfully saved checkpoint from iteration       1" in line
                   for line in trained.lines), trained.lines

    def _refused(self, trained, forward_step_func, **call) -> str:
        """``forward_step_func`` through Megatron-LM's ``train_step`` (or, with ``call``,
        ``forward_backward_func`` called with those keywords): the one-line refusal."""
        it = data_iterator(batches(1))
        with pytest.raises(ForwardStepError) as exc:
            if call:
                trained.forward_backward(forward_step_func=forward_step_func, data_iterator=it,
                                         model=trained.model, **call)
            else:
                train_step(forward_step_func, it, trained.model, trained.optimizer,
                           trained.scheduler, get_model_config(trained.model[0]),
                           trained.forward_backward, trained.args)
        if not call:   # Megatron-LM's run ends here; this process goes on: close the
            # iteration the refusal interrupted in the rerun state machine (one pass)
            assert not get_rerun_state_machine().should_run_forward_backward(None)
        assert isinstance(exc.value, UserError)
        message = str(exc.value)
        assert "\n" not in message and message.startswith("--snake-offload: "), message
        return message

    def test_refused_a_forward_step_calling_the_model_twice(self, trained):
        """Megatron-LM's ``train_step`` with a forward step that calls the model twice."""
        def twice(data_iterator, model):
            output, loss = forward_step(data_iterator, model)
            model(*get_batch(data_iterator)[:1])
            return output, loss

        assert "called the model 2 times" in self._refused(trained, twice)

    def test_refused_a_forward_step_changing_the_output(self, trained):
        """Megatron-LM's ``train_step`` with a forward step that computes with the model's
        output before returning it."""
        def scaled(data_iterator, model):
            output, loss = forward_step(data_iterator, model)
            return output * 2.0, loss

        assert "changed the model's output" in self._refused(trained, scaled)

    def test_refused_a_forward_step_without_labels(self, trained):
        """Megatron-LM's ``train_step`` with a forward step that calls the model without
        labels (it would compute logits, not the per-token loss)."""
        def no_labels(data_iterator, model):
            tokens, labels, loss_mask, attention_mask, position_ids, _ = get_batch(
                data_iterator)
            output = model(tokens, position_ids, attention_mask)
            return output, functools.partial(loss_func, loss_mask)

        assert "without labels" in self._refused(trained, no_labels)

    def test_refused_collecting_non_loss_data(self, trained):
        """Megatron-LM's ``evaluate`` with a ``process_non_loss_data_func`` (l.3158-3172):
        ``forward_backward_func(..., forward_only=True, collect_non_loss_data=True)``."""
        args = trained.args
        message = self._refused(
            trained, forward_step, num_microbatches=args.num_microbatches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length, forward_only=True,
            collect_non_loss_data=True)
        assert "non-loss data" in message


# --- the flags ----------------------------------------------------------------------------

# What turns each refused Megatron-LM flag on in Megatron-LM's args (after its validate_args).
REFUSED_GIVEN = {
    "--recompute-granularity": {"recompute_granularity": "selective"},
    "--num-layers-per-virtual-pipeline-stage": {"num_layers_per_virtual_pipeline_stage": 1},
    "--fp8-format": {"fp8": "hybrid"},
    "--fp4-format": {"fp4": "e2m1"},
    "--context-parallel-size": {"context_parallel_size": 2},
    "--num-experts": {"num_experts": 4},
    "--mtp-num-layers": {"mtp_num_layers": 1},
    "--multi-latent-attention": {"multi_latent_attention": True},
    "--hybrid-override-pattern": {"is_hybrid_model": True},
    "--use-torch-fsdp2": {"use_torch_fsdp2": True},
    "--use-megatron-fsdp": {"use_megatron_fsdp": True},
    "--cuda-graph-impl": {"cuda_graph_impl": "local"},
    "--tp-comm-overlap": {"tp_comm_overlap": True},
    "--optimizer": {"optimizer": "sgd"},
    "--optimizer-cpu-offload": {"optimizer_cpu_offload": True},
    "--decoupled-lr": {"decoupled_lr": 1e-4},
    "--calculate-per-token-loss": {"calculate_per_token_loss": True},
    "--rampup-batch-size": {"rampup_batch_size": ["4", "4", "100"]},
    "--train-samples": {"train_samples": 1000},
    "--ckpt-format": {"ckpt_format": "torch"},
    "--async-save": {"async_save": True},
    "--non-persistent-save-interval": {"non_persistent_save_interval": 10},
    "--log-params-norm": {"log_params_norm": True},
    "--log-num-zeros-in-grad": {"log_num_zeros_in_grad": True},
    "--check-weight-hash-across-dp-replicas-interval":
        {"check_weight_hash_across_dp_replicas_interval": 10},
    "--save-wgrads-interval": {"save_wgrads_interval": 10},
    "--data-parallel-random-init": {"data_parallel_random_init": True},
    "--check-for-large-grads": {"check_for_large_grads": True},
    "--optimizer-cuda-graph": {"optimizer_cuda_graph": True},
    "--use-mup": {"use_mup": True},
    "--ddp-param-name-patterns-for-fp32-local-accumulation":
        {"ddp_param_name_patterns_for_fp32_local_accumulation": ["*.bias"]},
    "--save-params-interval": {"save_params_interval": 10},
    "--save-activations-interval": {"save_activations_interval": 10},
    "--step-batch-size-schedule": {"step_batch_size_schedule": "0:4 1K:8"},
    "--verify-integrity": {"verify_integrity": True},
    "--freeze-all-layers": {"freeze_all_layers": True},
    "--logits-save-dir": {"logits_save_dir": "/tmp/logits"},
    "--logits-load-dir": {"logits_load_dir": "/tmp/logits"},
    "--override-ckpt-iteration": {"override_ckpt_iteration": 7},
    "--tensor-parallel-num-weight-shards": {"gtp_weight_remat_size": 2},
}
# Other Megatron-LM spellings of the same refusal.
REFUSED_ALSO = [
    ("--recompute-granularity", {"recompute_activations": True}),
    ("--num-layers-per-virtual-pipeline-stage", {"num_virtual_stages_per_pipeline_rank": 2}),
    ("--cuda-graph-impl", {"enable_cuda_graph": True}),
    ("--cuda-graph-impl", {"external_cuda_graph": True}),
    ("--save-wgrads-interval", {"save_dgrads_interval": 10}),
    ("--ckpt-format", {"ckpt_format": "torch_dcp"}),
]


def _check(capsys, args, argv=FLAGS) -> str:
    """``flags.check_args`` as hooks.py calls it after Megatron-LM's ``validate_args``:
    refused with status 2 and one line on stderr; returns that line."""
    with pytest.raises(SystemExit) as exc:
        flags.check_args(args, "pretrain_gpt.py", list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pretrain_gpt.py: error: "), err
    return err


def test_the_refusal_table_is_tested_whole():
    """Every rule of ``flags.REFUSED`` has its row here (a new rule needs one)."""
    assert set(REFUSED_GIVEN) == {rule.flag for rule in flags.REFUSED}


def test_megatron_lm_defaults_pass():
    """Megatron-LM's ``validate_args`` (with hooks.py's ``flags.check_args``) on its
    defaults with --snake-offload: nothing refused, nothing noted, and what this project's
    components read is derived."""
    args = mlm_args(checked=False)
    assert flags.check_args(args, "pretrain_gpt.py", FLAGS) == []
    assert args.num_microbatches == GLOBAL_BATCH // MICRO_BATCH
    assert args.disable_bias_linear is False


@pytest.mark.parametrize("flag,given", [*REFUSED_GIVEN.items(), *REFUSED_ALSO],
                         ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_a_refused_flag_is_named(capsys, flag, given):
    """Megatron-LM's ``initialize_megatron`` -> ``validate_args`` (hooks.py adds
    ``flags.check_args``): each flag --snake-offload does not run is refused, naming it and
    --snake-offload."""
    args = mlm_args(checked=False)
    for name, value in given.items():
        setattr(args, name, value)
    err = _check(capsys, args)
    assert err.startswith(f"pretrain_gpt.py: error: {flag}: cannot be combined with "
                          "--snake-offload: "), err


@pytest.mark.parametrize("rule", flags.ABSORBED, ids=lambda rule: rule.flag)
def test_an_absorbed_flag_is_turned_off_with_a_note(rule):
    """Megatron-LM's ``validate_args`` with an absorbed flag: accepted, turned off (so
    Megatron-LM's ``train`` drives no DDP overlap machinery) and noted once."""
    args = mlm_args(checked=False)
    setattr(args, rule.attr, True)
    notes = flags.check_args(args, "pretrain_gpt.py", [*FLAGS, rule.flag])
    assert getattr(args, rule.attr) is False
    assert notes == [f"> {rule.flag} with --snake-offload: {rule.note}"]


@pytest.mark.parametrize("flag", ["--snake-group-size", "--snake-checkpoint-interval=2",
                                  "--snake-offload-dir"])
def test_a_snake_flag_without_snake_offload_is_refused(capsys, flag):
    """Megatron-LM's ``validate_args`` without --snake-offload: a --snake-* flag would be
    ignored, so it is refused, naming it."""
    args = mlm_args(argv=[f for f in FLAGS if f != "--snake-offload"], checked=False)
    assert args.snake_offload is False
    name = flag.split("=")[0]
    err = _check(capsys, args, argv=[f for f in FLAGS if not f.startswith("--snake")]
                 + [flag] + ([] if "=" in flag else ["2"]))
    assert err.startswith(f"pretrain_gpt.py: error: {name}: configures --snake-offload"), err


@pytest.mark.parametrize("flag", ["--snake-zenflow", "--snake-activation-offload"])
def test_a_snake_flag_the_plugin_does_not_run_is_refused(capsys, flag):
    """Megatron-LM's ``validate_args`` with a --snake-* flag of examples/pretrain_gpt.py
    that the plug-in does not run: refused, naming it."""
    err = _check(capsys, mlm_args(checked=False), argv=[*FLAGS, flag])
    assert err.startswith(f"pretrain_gpt.py: error: {flag}: is not available"), err


def _transformer_engine_usable() -> bool:
    from megatron.core.extensions import transformer_engine

    return torch.cuda.is_available() and bool(getattr(transformer_engine, "HAVE_TE", False))


OTHER_REFUSALS = [   # by check_args' own rules, not the table
    ("--sequence-parallel", {"sequence_parallel": True, "tensor_model_parallel_size": 2}),
    pytest.param("--transformer-impl", {"transformer_impl": "transformer_engine"},
                 marks=pytest.mark.skipif(_transformer_engine_usable(),
                                          reason="refused without a GPU or without Transformer "
                                                 "Engine")),
]


@pytest.mark.parametrize("flag,given", OTHER_REFUSALS, ids=lambda v: v if isinstance(v, str)
                         else "-".join(v))
def test_other_refusals_name_the_flag(capsys, flag, given):
    """Megatron-LM's ``validate_args`` with ``--sequence-parallel`` (TP 2), or with its
    default ``--transformer-impl transformer_engine`` on a machine without a GPU or without
    Transformer Engine (megatron-core would build the TE spec, and fail inside the build)."""
    args = mlm_args(checked=False)
    for name, value in given.items():
        setattr(args, name, value)
    assert _check(capsys, args).startswith(f"pretrain_gpt.py: error: {flag}: ")


# Megatron-LM's parse_args (hooks.py adds flags.check_parsed): what its own later checks
# would refuse with an AssertionError traceback, said in one line first with --snake-offload.
BEFORE_MEGATRON_LM = [
    ("--save", {"save": "/tmp/ckpt", "save_interval": None}),
    ("--save", {"save": "/tmp/ckpt", "save_interval": 0}),
    ("--use-legacy-models", {"use_legacy_models": True}),
    ("--ckpt-convert-format", {"ckpt_convert_format": "torch"}),
]


@pytest.mark.parametrize("flag,given", BEFORE_MEGATRON_LM, ids=lambda v: v if isinstance(v, str)
                         else "-".join(f"{k}={w}" for k, w in v.items()))
def test_what_megatron_lm_asserts_later_is_one_line_first(capsys, flag, given):
    args = mlm_args(checked=False)
    for name, value in given.items():
        setattr(args, name, value)
    with pytest.raises(SystemExit) as exc:
        flags.check_parsed(args, "pretrain_gpt.py")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pretrain_gpt.py: error: {flag}: "), err


def test_without_snake_offload_megatron_lm_checks_its_own_flags():
    args = mlm_args(argv=[f for f in FLAGS if f != "--snake-offload"], checked=False)
    args.save, args.save_interval, args.ckpt_convert_format = "/tmp/ckpt", None, "torch"
    flags.check_parsed(args, "pretrain_gpt.py")   # nothing said: Megatron-LM's own check


def test_a_save_with_its_interval_passes():
    args = mlm_args(checked=False)
    args.save, args.save_interval = "/tmp/ckpt", 5
    flags.check_parsed(args, "pretrain_gpt.py")


def test_fp16_gradients_accumulate_in_fp32_with_a_note():
    """Megatron-LM's ``validate_args`` with ``--fp16``, whose gradient buffers are fp16
    unless ``--accumulate-allreduce-grads-in-fp32``: the snake's are fp32, so the flag is
    turned on and noted; given, nothing is said."""
    args = mlm_args("--fp16", checked=False)
    notes = flags.check_args(args, "pretrain_gpt.py", [*FLAGS, "--fp16"])
    assert args.accumulate_allreduce_grads_in_fp32 is True
    assert len(notes) == 1 and notes[0].startswith("> --fp16 with --snake-offload: "), notes
    args = mlm_args("--fp16", checked=False)
    args.accumulate_allreduce_grads_in_fp32 = True
    assert flags.check_args(args, "pretrain_gpt.py", [*FLAGS, "--fp16"]) == []


def test_without_a_run_the_log_line_is_unchanged():
    """``print_rank_last`` without --snake-offload (no run): Megatron-LM's line as it is."""
    assert plugin_run.current() is None
    line = " [2025-01-01 00:00:00] iteration        1/       4 | consumed samples:            4 |"
    tensorboard = _TensorBoard()
    assert snake_log.with_snake_suffix(line, tensorboard_writer=tensorboard,
                                       wandb_writer=None) == line
    assert tensorboard.scalars == []


def test_transformer_engine_is_refused_on_a_gpu_without_it(capsys, monkeypatch):
    """A GPU without Transformer Engine (the lent H200s): one line, not megatron-core's
    ImportError from inside the model's build."""
    from megatron.core.extensions import transformer_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformer_engine, "HAVE_TE", False)
    args = mlm_args(checked=False)
    args.transformer_impl = "transformer_engine"
    err = _check(capsys, args)
    assert err.startswith("pretrain_gpt.py: error: --transformer-impl: transformer_engine "
                          "(Megatron-LM's default) needs a GPU and Transformer Engine"), err
    assert "pass --transformer-impl local" in err
