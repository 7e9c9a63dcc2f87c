"""The vertical schedule across pipeline stages: snake groups flowing 1F1B-style.

A step's M micro-batches are cut into M/G *snake groups* of G (``--snake-group-size``). A
stage sweeps one group vertically through its units (forward_sweep), sends the group's
outputs to the next stage, and later sweeps the group back (backward_sweep) with the
gradients the next stage returns. Groups move through the stages exactly as micro-batches
do in Megatron-Core's ``forward_backward_pipelining_without_interleaving``: stage s of p
runs min(p - s - 1, M/G) warm-up forward groups, then alternates one forward and one
backward group, then drains the remaining backward groups. Activations and their gradients
cross stages through Megatron-Core's P2PCommunicator; plain sends stay in flight while the
next group computes.

The trade-off G sets: a stage loads its units' weights once per group per sweep, so weight
traffic grows as M/G, while the pipeline bubble is about (p - 1) / (M/G + p - 1). With one
stage and G = M this is pure GreedySnake (megatron_snake.schedule.vertical).

Numbers: every micro-batch sees the module calls Megatron's schedules make, so losses are
bit-identical; gradient sums run in another order (within float rounding).

The signature is Megatron's ``forward_backward_func``'s (keyword arguments, a forward step
function and a data iterator in, one report per micro-batch out), so Megatron-LM's
``train_step`` and ``evaluate`` call it as they call Megatron's own schedules; the snake's
settings are bound first (``functools.partial``).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_snake.errors import FlagError
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.schedule.forward_step import ForwardStepError, capture_microbatches
from megatron_snake.schedule.sweeps import backward_sweep, forward_sweep
from megatron_snake.schedule.unit_store import InMemoryStore, UnitStore


def snake_groups(num_microbatches: int, group_size: int | None) -> list[list[int]]:
    """Micro-batch ids cut into consecutive groups of ``group_size`` (default: one group).
    The one home of ``--snake-group-size``'s rule: the flag check calls this too."""
    size = num_microbatches if group_size is None else group_size
    if not isinstance(size, int) or size < 1 or num_microbatches % size:
        raise FlagError(f"--snake-group-size {group_size} must divide the {num_microbatches} "
                        "micro-batches per step (--global-batch-size / (--micro-batch-size x "
                        "data-parallel size)); pick a divisor")
    return [list(range(g, g + size)) for g in range(0, num_microbatches, size)]


def default_group_size(num_microbatches: int, num_stages: int) -> int:
    """M on one stage; else the largest divisor G of M with M/G >= 4(p-1) groups (a bubble
    of at most about 20%), or 1."""
    if num_stages == 1:
        return num_microbatches
    divisors = [g for g in range(1, num_microbatches + 1) if num_microbatches % g == 0]
    return max([g for g in divisors if num_microbatches // g >= 4 * (num_stages - 1)],
               default=1)


def warmup_groups(stage: int, num_stages: int, num_groups: int) -> int:
    """Forward groups a stage runs before its first backward group (Megatron's 1F1B)."""
    return min(num_stages - stage - 1, num_groups)


class _StageLinks:
    """Sends and receives one group's tensors between neighbouring stages (a no-op on the
    side of a stage that has no neighbour).

    The calls, and their order on both sides, are those of Megatron's non-interleaved 1F1B
    (so they match under NCCL as they do there). A plain send (warm-up, cool-down, the last
    steady-state backward) does not wait: it returns with the transfer in flight, through
    Megatron's ``overlap_p2p_comm`` path, so the transfer overlaps the next group's compute;
    ``finish`` waits for all of them at the end of the step.
    """

    def __init__(self, config, tensor_shape):
        self.first = parallel_state.is_pipeline_first_stage()
        self.last = parallel_state.is_pipeline_last_stage()
        self.shape = tensor_shape
        self.p2p = None
        self._in_flight = []  # (tensor, wait handles): a sent tensor lives until its wait
        if not (self.first and self.last):
            # Megatron hands back wait handles of unbatched p2p ops only (its interleaved
            # schedule turns batching off to overlap, too); all of a step's ops go the same
            # way, since unbatched ops on a 2-rank pipeline use another communicator for
            # one direction and would not match batched ones.
            unbatched = copy.copy(config)
            unbatched.batch_p2p_comm = False
            self.p2p = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(),
                                       unbatched)

    def _send_async(self, tensors, send_one):
        for tensor in tensors:
            _, handles = send_one(tensor)
            self._in_flight.append((tensor, handles))

    def finish(self):
        """Wait for every send still in flight."""
        for _, handles in self._in_flight:
            for handle in (handles.values() if isinstance(handles, dict) else handles):
                handle.wait()
        self._in_flight = []

    def _shapes(self, group):
        return [self.shape] * len(group)

    @staticmethod
    def _by_mb(group, tensors):
        return None if tensors is None else dict(zip(group, tensors))

    @staticmethod
    def _in_order(group, by_mb):
        return [by_mb[mb] for mb in group]

    def recv_forward(self, group):
        if self.first:
            return None
        return self._by_mb(group, self.p2p.recv_forward(self._shapes(group), False))

    def send_forward(self, group, outputs):
        if not self.last:
            self._send_async(self._in_order(group, outputs), lambda t: (
                self.p2p.send_forward_recv_forward(t, recv_prev=False, tensor_shape=self.shape,
                                                   overlap_p2p_comm=True)))

    def send_forward_recv_backward(self, group, outputs, backward_group):
        if self.last:
            return None
        grads = self.p2p.send_forward_recv_backward(self._in_order(group, outputs),
                                                    self._shapes(backward_group), False)
        return self._by_mb(backward_group, grads)

    def recv_backward(self, group):
        if self.last:
            return None
        return self._by_mb(group, self.p2p.recv_backward(self._shapes(group), False))

    def send_backward(self, group, input_grads):
        if not self.first:
            self._send_async(self._in_order(group, input_grads), lambda t: (
                self.p2p.send_backward_recv_backward(t, recv_next=False, tensor_shape=self.shape,
                                                     overlap_p2p_comm=True)))

    def send_backward_recv_forward(self, group, input_grads, next_group):
        if self.first:
            return None
        received = self.p2p.send_backward_recv_forward(
            self._in_order(group, input_grads), self._shapes(next_group), False)
        return self._by_mb(next_group, received)


def _stage_tensor_shape(units: GPTUnits, seq_length: int,
                        micro_batch_size: int) -> tuple[int, int, int]:
    """[sequence, micro-batch, hidden] of what crosses a stage boundary (sequence split
    across tensor-parallel ranks under sequence parallelism), as Megatron's schedules
    compute it."""
    if units.config.sequence_parallel:
        seq_length //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq_length, micro_batch_size, units.config.hidden_size)


def snake_forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                           seq_length: int, micro_batch_size: int,
                           decoder_seq_length: int | None = None, forward_only: bool = False,
                           collect_non_loss_data: bool = False, first_val_step=None,
                           adjust_tensor_shapes_fn=None, p2p_communicator=None,
                           pg_collection=None, force_all_reduce: bool | None = False,
                           group_size: int | None = None, checkpoint_interval: int = 1,
                           store: UnitStore | None = None, units: GPTUnits | None = None,
                           finalize_grads: bool = True):
    """Run one step's ``num_microbatches`` micro-batches on this pipeline stage in snake
    groups, 1F1B-style, with Megatron's ``forward_backward_func`` signature.

    ``forward_step_func(data_iterator, model)`` is called once per micro-batch at the start
    (``forward_step.capture_microbatches``); its loss function is applied where the model's
    last unit computes the per-token loss. Returns what the loss function reports, one per
    micro-batch in micro-batch order, on the last stage (an empty list elsewhere), as
    Megatron's schedules do. Unless ``forward_only``, accumulates into ``param.grad`` (or
    ``param.main_grad``) what Megatron's schedules accumulate, and calls
    ``config.finalize_model_grads_func`` when it is set, as they do. The snake's own
    settings: ``group_size`` (micro-batches per snake group; default all),
    ``checkpoint_interval`` (layers per unit), ``store`` (where unit inputs and weights
    live), ``units`` (the model's unit partition, made once for a run), ``finalize_grads``
    (False where the store's weights own the gradients: ``config.finalize_model_grads_func``,
    which Megatron-LM's loop sets for its DDP buffers, is then not called).
    """
    if collect_non_loss_data:
        raise ForwardStepError("--snake-offload: collecting non-loss data (a "
                               "non_loss_data_func) is not supported by the snake schedule")
    if adjust_tensor_shapes_fn is not None:
        raise ForwardStepError("--snake-offload: adjust_tensor_shapes_fn (Model Optimizer's "
                               "distillation) is not supported by the snake schedule")
    chunk = model[0] if isinstance(model, (list, tuple)) and len(model) == 1 else model
    if units is None:
        units = GPTUnits(chunk, checkpoint_interval)
    elif units.checkpoint_interval != checkpoint_interval:
        raise ValueError(f"units were cut every {units.checkpoint_interval} layers, the step "
                         f"asks for --snake-checkpoint-interval {checkpoint_interval}")
    store = InMemoryStore() if store is None else store
    config = units.config
    groups = snake_groups(num_microbatches, group_size)
    contexts = [units.context(mb.batch, seq_length, mb.loss_func) for mb in
                capture_microbatches(forward_step_func, data_iterator, model,
                                     num_microbatches)]
    links = _StageLinks(config, _stage_tensor_shape(units, seq_length, micro_batch_size))
    num_stages = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    rng_states: dict = {}
    reports: dict = {}
    total_tokens = 0

    def forward(group, inputs):
        return forward_sweep(units, contexts, store, group, forward_only=forward_only,
                             rng_states=rng_states, inputs=inputs)

    def backward(index, output_grads):
        nonlocal total_tokens
        group_reports, tokens, input_grads = backward_sweep(
            units, contexts, store, groups[index], rng_states=rng_states,
            num_microbatches=num_microbatches, gradients_final=index == len(groups) - 1,
            output_grads=output_grads)
        reports.update(group_reports)
        total_tokens = total_tokens + tokens
        return input_grads

    no_sync = getattr(config, "no_sync_func", None) or nullcontext
    with no_sync():
        if forward_only:
            for group in groups:
                outputs = forward(group, links.recv_forward(group))
                if links.last:
                    reports.update(outputs)
                else:
                    links.send_forward(group, outputs)
        else:
            _one_f_one_b(groups, warmup_groups(stage, num_stages, len(groups)), links,
                         forward, backward)
        links.finish()

    if finalize_grads and not forward_only and \
            getattr(config, "finalize_model_grads_func", None) is not None:
        per_token = getattr(config, "calculate_per_token_loss", False)
        num_tokens = torch.as_tensor(total_tokens, dtype=torch.int) if per_token else None
        config.finalize_model_grads_func([chunk], num_tokens,
                                         **({"force_all_reduce": force_all_reduce}
                                            if force_all_reduce else {}))
    return [reports[mb] for mb in range(num_microbatches)] if links.last else []


def _one_f_one_b(groups, num_warmup, links: _StageLinks, forward, backward) -> None:
    """Megatron's non-interleaved 1F1B order, with a snake group where it has a micro-batch."""
    for group in groups[:num_warmup]:
        links.send_forward(group, forward(group, links.recv_forward(group)))
    steady = len(groups) - num_warmup
    inputs = links.recv_forward(groups[num_warmup]) if steady else None
    for i in range(steady):
        group = groups[num_warmup + i]
        output_grads = links.send_forward_recv_backward(group, forward(group, inputs), groups[i])
        input_grads = backward(i, output_grads)
        if i == steady - 1:
            links.send_backward(groups[i], input_grads)
        else:
            inputs = links.send_backward_recv_forward(groups[i], input_grads,
                                                      groups[num_warmup + i + 1])
    for i in range(steady, len(groups)):
        links.send_backward(groups[i], backward(i, links.recv_backward(groups[i])))
