"""DP = 2 (spawn, gloo): the offloaded, per-unit sharded AdamW equals Megatron-Core's
DistributedOptimizer, and each rank's directory holds only its own shard.

Reference: Megatron's DDP (use_distributed_optimizer) + get_megatron_optimizer with
use_distributed_optimizer=True + OptimizerParamScheduler, Megatron's schedule. Ours: the
vertical schedule over OffloadedUnits + OffloadedAdamW on the NVMe tier. Gradients are
averaged the same way (scale by 1/DP, sum reduce-scatter); Megatron's Adam is torch's
unfused AdamW and ours the fused kernel, and the gradient norm is summed in another order,
so the weights agree within float rounding: 1e-6 of each parameter's norm after three steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from megatron_snake.training.distributed import free_port, local_rank_env

WORLD = 2
STEPS = 3


def _rank_main(rank: int, port: int, root: str, clip: float):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(local_rank_env(rank, WORLD, port))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from conftest import build_model, make_microbatches, tiny_args
    from megatron_snake import vertical_forward_backward
    from megatron_snake.models.gpt_units import GPTUnits
    from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
    from megatron_snake.storage.store import TensorStore
    from megatron_snake.offload.unit_weights import OffloadedUnits
    from megatron_snake.optim.dp_shards import DataParallel
    from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
    from megatron_snake.optim.unit_params import UnitParams
    from megatron_snake.schedule.unit_store import CombinedStore
    from megatron_snake.training import distributed
    from megatron_snake.training.model import wrap_ddp
    from megatron_snake.training.optimizer import build_scheduler
    from megatron_snake.training.step import megatron_forward_backward

    device = distributed.resolve_device("cpu")
    distributed.initialize(device=device, seed=1234)
    args = tiny_args("--untie-embeddings-and-output-weights", "--disable-bias-linear",
                     "--lr", "5e-3", "--lr-warmup-iters", "1", "--train-iters", "3",
                     "--clip-grad", str(clip))
    batches = [make_microbatches(2, seed=100 * rank + s) for s in range(STEPS)]

    # Reference: Megatron's distributed optimizer.
    reference = build_model(args, device)
    ddp = wrap_ddp(reference, use_distributed_optimizer=True)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr,
                              weight_decay=args.weight_decay, clip_grad=clip,
                              use_distributed_optimizer=True)
    ref_opt = get_megatron_optimizer(opt_cfg, [ddp])
    ref_sched = build_scheduler(args, ref_opt)
    reference.config.no_sync_func = ddp.no_sync
    reference.config.finalize_model_grads_func = finalize_model_grads
    for mbs in batches:
        ddp.zero_grad_buffer()
        ref_opt.zero_grad()
        megatron_forward_backward(ddp, mbs)
        ref_opt.step()
        ref_sched.step(increment=args.global_batch_size)
    reference.config.no_sync_func = reference.config.finalize_model_grads_func = None

    # Ours: offloaded per-unit shards.
    ours = build_model(args, device)
    params = UnitParams.of(GPTUnits(ours, 2))
    dp = DataParallel.from_megatron()
    assert dp.size == WORLD
    with TensorStore(root, rank=rank, host_memory_limit=256 << 20) as store:
        opt = OffloadedAdamW(params, store, lr=args.lr, weight_decay=args.weight_decay,
                             clip_grad=clip, alpha=0.25, dp=dp)
        weights = OffloadedUnits(params, store, opt, device=device, dtype=torch.float32)
        sched = build_scheduler(args, opt)
        total = sum(lay.numel for lay in params.all_layouts())
        assert opt.state_bytes() <= 12 * (total // WORLD + len(params.units)), \
            "each rank holds only its shard of the optimizer state"
        for mbs in batches:
            ckpts = OffloadedUnitInputs(store, "nvme", len(mbs), device)
            vertical_forward_backward(ours, mbs, checkpoint_interval=2,
                                      store=CombinedStore(ckpts, weights))
            ckpts.finish_step()
            opt.step()
            sched.step(increment=args.global_batch_size)
        # Each unit's reduce-scatter is launched async and waited for only after the next
        # unit's was launched, i.e. after that unit's backward: the collective overlapped it.
        log = opt.collective_log
        launched = [key for op, key in log if op == "launch"]
        assert len(launched) == len(params.all_layouts()) > 1, log
        for key, following in zip(launched, launched[1:]):
            assert log.index(("wait", key)) > log.index(("launch", following)), log
        weights.load_all()
        opt.close()
        mine = os.path.join(root, f"rank{rank}")
        for key in store.keys():
            paths = {path for path, _, _ in store.location(key)}
            assert all(os.path.dirname(path) == mine for path in paths), (key, paths)

    ref = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        rel = ((p.detach() - ref[name].detach()).norm() / ref[name].detach().norm()).item()
        assert rel <= 1e-6, f"rank {rank} {name}: relative difference {rel:.2e}"
    distributed.shutdown()


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_dp2_offloaded_adamw_equals_megatron_distributed_optimizer(tmp_path, clip):
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path), clip), nprocs=WORLD, join=True)


def _pretrain_main(rank: int, port: int, root: str):
    import json
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(local_rank_env(rank, WORLD, port))
    torch.set_num_threads(1)
    from megatron_snake.training import distributed
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    flags = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4", "--device", "cpu",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    megatron = pretrain(parse_args(flags))
    snake = pretrain(parse_args([*flags, "--snake-offload", "--save", os.path.join(root, "ckpt"),
                                 "--snake-offload-dir", root]))
    with open(os.path.join(root, f"losses{rank}.json"), "w") as f:
        json.dump({"megatron": megatron, "snake": snake}, f)
    distributed.shutdown()


def test_dp2_pretrain_with_snake_offload(tmp_path):
    """torchrun-style DP = 2 through pretrain_gpt's loop: the same losses as Megatron's DDP
    run, each rank saving its own optimizer shard."""
    import json

    mp.spawn(_pretrain_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    runs = [json.loads((tmp_path / f"losses{r}.json").read_text()) for r in range(WORLD)]
    assert runs[0] == runs[1], "the logged loss is averaged over data-parallel ranks"
    for a, b in zip(runs[0]["megatron"], runs[0]["snake"]):
        assert abs(a - b) <= 1e-5 * abs(a), runs[0]
    saved = sorted(os.listdir(tmp_path / "ckpt" / "iter_0000004"))   # Megatron's files
    assert saved == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
