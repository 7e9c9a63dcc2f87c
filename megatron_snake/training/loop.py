"""The training loop: Megatron-LM's ``pretrain`` reduced to the parts a GPT pretraining
run needs. ``pretrain`` sets up the process group, tokenizer, log and datasets, builds the
run (``build.build_run``) and hands it to one ``Trainer``: train, evaluate, save, restore.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import megatron_snake.timeline as timeline
from megatron_snake.training import torch_dist
from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.storage.safe_files import write_file_atomically
from megatron_snake.training import (auto_config, checkpointing, distributed, restore,
                                     offloaded_state, preflight)
from megatron_snake.training.build import Run, build_run
from megatron_snake.training.checkpoint_dir import Checkpoint
from megatron_snake.training.preemption import ExitConditions
from megatron_snake.training.profiling import StepProfiler
from megatron_snake.training.tracking import Trackers
from megatron_snake.training.data import build_gpt_datasets, micro_batches, num_samples_for
from megatron_snake.training.tokenizer import (build_tokenizer, padded_vocab_size,
                                                 tokenizer_flags)
from megatron_snake.training.train_log import TrainLog


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()}


def _lm_loss(reports, device) -> float:
    """The (sum, count) each micro-batch's loss function reported, summed over the step's
    micro-batches and data-parallel ranks: Megatron-LM's ``lm loss``; under pipeline
    parallelism the last stage's figure, on every stage."""
    # stays zero on a stage before the last; on the compute device, which NCCL needs
    totals = torch.zeros(2, dtype=torch.double, device=device)
    if reports:
        totals = torch.stack([r["lm loss"].view(-1) for r in reports]).sum(dim=0).double()
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    return (totals[0] / totals[1].clamp(min=1)).item()


def _next_microbatches(iterator, count: int, device: torch.device) -> list[dict]:
    return [to_device(next(iterator), device) for _ in range(count)]


def _stop_on_nan(iteration: int, lm_loss: float, grad_norm) -> None:
    """Megatron-LM's default: a NaN or Inf loss or gradient norm stops the run before it
    is logged as progress or saved (every rank sees the same reduced values)."""
    bad = [f"{name} {value}" for name, value in (("lm loss", lm_loss), ("grad norm", grad_norm))
           if value is not None and not math.isfinite(value)]
    if bad:
        raise FloatingPointError(
            f"iteration {iteration}: {' and '.join(bad)}: training stops here and this "
            "iteration is not saved (the last --save checkpoint is intact). Lower --lr or "
            "check the data, then resume with --load; --no-check-for-nan-in-loss-and-grad "
            "goes on instead")


class Trainer:
    """Megatron-LM's ``pretrain`` loop over one built ``Run``: train, evaluate, save,
    restore. The data comes in as datasets; everything it steps is the run's."""

    def __init__(self, run: Run, log: TrainLog, train_ds, valid_ds=None, *,
                 exit_conditions: ExitConditions | None = None,
                 profiler: StepProfiler | None = None):
        self.run, self.args, self.log = run, run.args, log
        self.train_ds, self.valid_ds = train_ds, valid_ds
        self.iteration, self.consumed = 0, 0
        self.store_meter = offloaded_state.StoreMeter(
            run.tensor_store, details=getattr(run.args, "snake_log_details", False))
        self.exit_conditions, self.profiler = exit_conditions, profiler
        # the offloaded optimizer's counters at the last log line
        self._optimizer_since = run.optimizer.counters() if run.args.snake_offload else None

    def _batches(self, dataset, consumed: int):
        return micro_batches(dataset, micro_batch_size=self.args.micro_batch_size,
                             data_parallel_rank=parallel_state.get_data_parallel_rank(),
                             data_parallel_size=parallel_state.get_data_parallel_world_size(),
                             consumed_samples=consumed, num_workers=self.args.num_workers)

    # --- checkpoints -------------------------------------------------------------------
    def save(self) -> None:
        run = self.run
        if self.args.ckpt_format == "torch_dist":   # Megatron's format
            torch_dist.save(self.args.save, iteration=self.iteration,
                            consumed_samples=self.consumed, run=run)
            self.log.print(f"> saved checkpoint at iteration {self.iteration} to "
                           f"{self.args.save} (torch_dist)")
            return
        gpt = unwrap_model(run.model)
        if run.offloaded:  # streamed: one layout's weights, master weights, moments at a time
            weights = run.offloaded.weights
            model_state = weights.resident_state_dict(gpt)
            units = weights.checkpoint_units(optimizer=not self.args.no_save_optim)
            optimizer_state = run.optimizer.state_dict(layouts=False)
        else:
            model_state, units = gpt.state_dict(), None
            optimizer_state = run.optimizer.state_dict()
        checkpointing.save_checkpoint(self.args.save, iteration=self.iteration,
                                      consumed_samples=self.consumed, args=self.args,
                                      model_state=model_state,
                                      optimizer_state=optimizer_state,
                                      scheduler_state=run.scheduler.state_dict(),
                                      units=units)
        self.log.print(f"> saved checkpoint at iteration {self.iteration} to {self.args.save} "
                       "(torch)")

    def restore(self, checkpoint: Checkpoint, *, finetune: bool = False) -> None:
        """Load ``checkpoint`` into the run and continue from its iteration (the weights
        only, from iteration 0, with ``finetune``)."""
        restored = restore.restore(self.run, checkpoint, finetune=finetune, log=self.log.print)
        if not finetune:
            self.iteration, self.consumed = restored.iteration, restored.consumed_samples

    # --- evaluation --------------------------------------------------------------------
    def evaluate(self) -> float:
        """``--eval-iters`` forward-only steps over the validation set, from its start."""
        args, run = self.args, self.run
        run.model.eval()
        it = self._batches(self.valid_ds, consumed=0)
        total = 0.0
        with torch.no_grad():
            for _ in range(args.eval_iters):
                mbs = _next_microbatches(it, args.num_microbatches, run.device)
                total += _lm_loss(run.evaluate(mbs), run.device)
        run.model.train()
        return total / max(args.eval_iters, 1)

    # --- training ----------------------------------------------------------------------
    def _log_extra(self, activation_peak: dict) -> tuple[str, dict]:
        """The interval's store traffic (offloaded runs) and ZenFlow's fields, for the log
        line and the trackers."""
        text, scalars = self.store_meter.interval(activation_peak)
        if self.args.snake_zenflow:
            text = " | ".join(p for p in (text, self.run.optimizer.log_fields()) if p)
        elif self.args.snake_offload:
            opt = self.run.optimizer
            if self.args.snake_log_details:
                text = " | ".join(p for p in (text, opt.log_fields(self._optimizer_since)) if p)
            self._optimizer_since = opt.counters()
        return text, scalars

    def _write_trace(self, recorded: timeline.Timeline) -> None:
        """--snake-trace: this rank's timeline of the traced iteration (one file per rank
        when there are several: FILE's name with .rankN before its extension)."""
        path = self.args.snake_trace
        if dist.get_world_size() > 1:
            stem, ext = os.path.splitext(path)
            path = f"{stem}.rank{dist.get_rank()}{ext}"
        # a new 0600 file, never written through a link planted at the path
        write_file_atomically(path, json.dumps(recorded.chrome_trace()).encode(),
                              what="--snake-trace file")
        self.log.print(f"> --snake-trace: iteration {self.iteration + 1} written to {path} "
                       f"({len(recorded.spans)} spans)")

    def train(self) -> list[float]:
        """Step to ``--train-iters`` (or ``--exit-interval``). Returns each step's lm loss."""
        args, run = self.args, self.run
        train_iter = self._batches(self.train_ds, consumed=self.consumed)
        run.model.train()
        history = []
        self.log.print(self.log.legend(
            offloaded_state.StoreMeter.LEGEND if run.tensor_store is not None else ""))
        if self.profiler:
            self.profiler.check_start(self.iteration, self.log.print)
        self.log.start_interval()
        self.store_meter.start_interval()
        traced = min(self.iteration + args.snake_trace_iteration, args.train_iters) \
            if args.snake_trace else None
        while self.iteration < args.train_iters:
            if self.profiler:
                self.profiler.before_step(self.iteration)
            mbs = _next_microbatches(train_iter, args.num_microbatches, run.device)
            if self.iteration + 1 == traced:
                with timeline.recording() as recorded:
                    step = run.step(mbs)
                self._write_trace(recorded)
            else:
                step = run.step(mbs)
            self.iteration += 1
            self.consumed += args.global_batch_size
            lm_loss = _lm_loss(step.reports, run.device)
            if args.check_for_nan_in_loss_and_grad:
                _stop_on_nan(self.iteration, lm_loss, step.grad_norm)
            history.append(lm_loss)
            self.log.step(iteration=self.iteration, consumed_samples=self.consumed,
                          lm_loss=lm_loss, lr=run.optimizer.param_groups[0]["lr"],
                          grad_norm=step.grad_norm,
                          loss_scale=run.optimizer.get_loss_scale().item(),
                          skipped=not step.update_successful,
                          extra=lambda: self._log_extra(step.activation_peak))
            if self.profiler and (trace := self.profiler.after_step(self.iteration)):
                self.log.print(f"> --profile: trace written to {trace}")
            if self.valid_ds is not None and args.eval_interval and \
                    self.iteration % args.eval_interval == 0:
                with self._outside_the_interval():
                    self.log.validation(self.iteration, self.evaluate())
            exiting = self._exit_reason()
            periodic = bool(args.save_interval) and self.iteration % args.save_interval == 0
            if args.save and (periodic or exiting or self.iteration == args.train_iters):
                with self._outside_the_interval():
                    self.save()
            if exiting:
                self.log.print(f"> exiting at iteration {self.iteration}: {exiting}"
                               + ("" if args.save else " (no --save: nothing was saved)"))
                break
        if self.profiler and (trace := self.profiler.close(self.iteration)):
            self.log.print(f"> --profile: trace written to {trace} (the run ended first)")
        if run.tensor_store is not None:
            self.log.print(self.store_meter.total())
        if args.snake_offload:
            self.log.print(run.optimizer.summary())
        return history

    @contextlib.contextmanager
    def _outside_the_interval(self):
        """Evaluation and saving take neither time nor store traffic from the log
        interval's training figures (Megatron-LM stops its interval timer for them too)."""
        started, before = time.perf_counter(), self.store_meter.snapshot()
        yield
        seconds = time.perf_counter() - started
        self.log.exclude(seconds)
        self.store_meter.exclude(before, seconds)

    def _exit_reason(self) -> str | None:
        """Why training stops after this iteration, before --train-iters, or None."""
        if self.args.exit_interval and self.iteration % self.args.exit_interval == 0:
            return f"--exit-interval {self.args.exit_interval}"
        return self.exit_conditions.check() if self.exit_conditions else None


def pretrain(args: argparse.Namespace) -> list[float]:
    """Train as the flags say. Returns the lm loss of every iteration run here."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if args.deterministic_mode:
        # cuBLAS is deterministic only with a fixed workspace; torch refuses its matmuls
        # under deterministic algorithms without it (the setting Megatron-LM documents)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.deterministic_mode or was_deterministic)
    try:
        with contextlib.ExitStack() as closing:   # trackers, the SIGTERM handler
            return _pretrain(args, closing)
    finally:  # a process that trains more than once (tests, notebooks) gets its mode back
        torch.use_deterministic_algorithms(was_deterministic)


def _pretrain(args: argparse.Namespace, closing: contextlib.ExitStack) -> list[float]:
    device = distributed.resolve_device(args.device)
    # Megatron-LM's --exit-duration-in-mins counts from the start, set-up included
    exit_conditions = ExitConditions(signal_handler=args.exit_signal_handler,
                                     duration_minutes=args.exit_duration_in_mins, device=device)
    closing.callback(exit_conditions.close)
    distributed.initialize(device=device,
                           tensor_model_parallel_size=args.tensor_model_parallel_size,
                           pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                           seed=args.seed, timeout_minutes=args.distributed_timeout_minutes)
    rank = dist.get_rank()
    notes: list[str] = []   # printed once the log is there
    source, finetune = restore.check_checkpoints(args, notes.append)
    tokenizer = build_tokenizer(**tokenizer_flags(args))
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    trackers = Trackers(args, writes=rank == 0)
    closing.callback(trackers.close)
    log = TrainLog(args, vocab, device, rank=rank, trackers=trackers)
    for note in notes:
        log.print(note)
    # the data files are checked before the offload directory and the model are made, and
    # before the pre-flight, whose host figure starts from the resident memory it measures:
    # the datasets' indices are in it (a dry run builds nothing, and predicts without them)
    if not args.snake_dry_run:
        train_ds, valid_ds, _ = build_gpt_datasets(
            mock=args.mock_data, data_path=args.data_path, split=args.split,
            train_data_path=args.train_data_path, valid_data_path=args.valid_data_path,
            test_data_path=args.test_data_path, eod_mask_loss=args.eod_mask_loss,
            seq_length=args.seq_length, seed=args.seed, tokenizer=tokenizer,
            data_cache_path=args.data_cache_path,
            num_samples=num_samples_for(args.train_iters, args.global_batch_size,
                                        args.eval_interval, args.eval_iters))
    with preflight.dry_run_verdict(args, log.print):
        if args.snake_hardware:  # --snake-auto's choice, or --snake-dry-run's prediction
            auto_config.configure(args, vocab, log=log.print)
        if args.snake_offload:  # the bytes each tier needs, refused before the model is built
            preflight.run(args, vocab, rank=rank, log=log.print)
    if args.snake_dry_run:
        return []
    with build_run(args, device, vocab, rank=rank, log=log.print) as run:
        trainer = Trainer(run, log, train_ds, valid_ds, exit_conditions=exit_conditions,
                          profiler=StepProfiler(args, device, rank) if args.profile else None)
        if source:
            trainer.restore(source, finetune=finetune)
        try:
            return trainer.train()
        except RuntimeError as exc:
            if dist.get_world_size() > 1 and distributed.is_lost_peer(exc):
                raise RuntimeError(
                    f"rank {rank}: lost contact with another rank during training ({exc}). "
                    "A rank died or hung: its own log has the cause; the others stop here "
                    "(--distributed-timeout-minutes bounds the wait)") from exc
            raise
