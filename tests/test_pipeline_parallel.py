"""Invariant 1 under TP x PP x DP (spawn, gloo): the snake schedule in groups of G equals
Megatron-Core's own schedules on the same micro-batches.

Reference: ``forward_backward_pipelining_without_interleaving`` when PP > 1, else
``forward_backward_no_pipelining``, with pretrain_gpt's forward step and loss, under
Megatron's DDP with ``finalize_model_grads`` (data-parallel all-reduce, and the tied
embedding's all-reduce between the first and last stage). Ours: the snake schedule over the
same DDP model. Losses on the last stage are bit-identical; gradients (after finalize) agree
within 1e-6 relative, the per-micro-batch terms being summed in another order.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from megatron_snake.training.distributed import free_port, local_rank_env

REL_TOL = 1e-6
NUM_MICROBATCHES = 4


def _reference(model, mbs):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_snake.schedule.loss import pretrain_gpt_forward_step

    tokens = mbs[0]["tokens"]
    results = get_forward_backward_func()(
        forward_step_func=pretrain_gpt_forward_step, data_iterator=iter(mbs), model=model,
        num_microbatches=len(mbs), seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0], forward_only=False)
    return [(r["lm loss"][0] / r["lm loss"][1].clamp(min=1)).detach() for r in results]


def _rank_main(rank, world, port, tp, pp, variants, errors_dir):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(local_rank_env(rank, world, port))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        _compare_all(tp, pp, variants)
    except BaseException:
        with open(os.path.join(errors_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _compare_all(tp, pp, variants):

    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from conftest import build_model, gradients, make_microbatches, tiny_args, zero_gradients
    from megatron_snake import vertical_forward_backward
    from megatron_snake.training import distributed
    from megatron_snake.training.model import wrap_ddp

    from megatron_snake.schedule import pipeline

    in_flight_at_finish = []  # plain sends return at once; the step's end waits for them
    finish = pipeline._StageLinks.finish
    pipeline._StageLinks.finish = lambda links: (
        in_flight_at_finish.append(len(links._in_flight)), finish(links))[1]
    device = distributed.resolve_device("cpu")
    distributed.initialize(device=device, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp, seed=1234)
    dp_rank = parallel_state.get_data_parallel_rank()
    mbs = make_microbatches(NUM_MICROBATCHES, seed=11 + dp_rank)
    last_stage = parallel_state.is_pipeline_last_stage()
    for extra in variants:
        args = tiny_args("--num-layers", "4", "--tensor-model-parallel-size", str(tp),
                         "--pipeline-model-parallel-size", str(pp), *extra)
        model = wrap_ddp(build_model(args, device))
        model.config.no_sync_func = model.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
        zero_gradients(model)
        ref_losses = _reference(model, mbs)
        ref_grads = gradients(model)
        # interval 2: one unit per stage (the last stage's only unit is its loss unit)
        for group_size, interval in ((1, 1), (2, 1), (NUM_MICROBATCHES, 1), (2, 2)):
            zero_gradients(model)
            losses = vertical_forward_backward(model, mbs, checkpoint_interval=interval,
                                               group_size=group_size)
            grads = gradients(model)
            where = f"{extra} G={group_size} interval={interval} tp={tp} pp={pp}"
            if last_stage:
                assert len(losses) == NUM_MICROBATCHES, where
                for i, (ours, ref) in enumerate(zip(losses, ref_losses)):
                    assert torch.equal(ours, ref.to(ours.dtype)), f"{where} mb {i}: {ours} != {ref}"
            else:
                assert losses == [], where
            for name, ref in ref_grads.items():
                assert ref.abs().max() > 0, f"{where} {name}: reference gradient is all zero"
                rel = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
                assert rel <= REL_TOL, f"{where} {name}: relative gradient error {rel:.2e}"
    if pp > 1:  # every stage has a warm-up or cool-down send each step
        assert in_flight_at_finish and min(in_flight_at_finish) >= 1, in_flight_at_finish
    distributed.shutdown()


TOPOLOGIES = {  # name: (world, TP, PP)
    "tp2": (2, 2, 1),
    "pp2": (2, 1, 2),
    "dp2": (2, 1, 1),
    "tp2xpp2": (4, 2, 2),
}
VARIANTS = [("--untie-embeddings-and-output-weights",),
            ("--position-embedding-type", "rope")]  # tied: the embedding spans two stages


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_snake_groups_match_megatron_schedules(tmp_path, topology):
    world, tp, pp = TOPOLOGIES[topology]
    try:
        mp.spawn(_rank_main, args=(world, free_port(), tp, pp, VARIANTS, str(tmp_path)),
                 nprocs=world, join=True)
    except Exception:
        reports = sorted(tmp_path.glob("rank*.txt"))
        raise AssertionError("\n".join(p.read_text() for p in reports) or "a rank failed")
