"""The schedules against Megatron-Core's own schedule, on the GPU.

The CPU suite (tests/test_vertical_exactness.py, tests/test_vertical_dropout.py,
tests/test_vertical_offloaded_checkpoints.py) shows the vertical schedule equals
Megatron-Core's ``forward_backward_no_pipelining`` on the CPU. Here the same comparisons run
with the model, the micro-batches and the unit inputs on DEVICE, where other kernels
(cuBLAS, CUDA dropout), the CUDA generator, Megatron's CUDA RNG tracker and the tensor
store's copy streams are in play:

- fp32 (TF32 off): vertical and horizontal losses bit-identical to Megatron's, gradients
  within 1e-6 relative per parameter (the snake sums some of them in another order), with
  checkpoints kept in memory or offloaded to host / nvme through the tensor store.
- bf16, the model wrapped in Megatron's Float16Module the way training wraps it: losses
  within a bf16 tolerance, gradients close (bf16 ``grad``, or fp32 ``main_grad`` under DDP).
- dropout 0.1: the recompute replays the forward's masks from the CUDA generator and the
  tracker. Megatron draws masks micro-batch by micro-batch, so the vertical schedule can
  equal it only for M = 1 (for M > 1 it is compared with a kept-activation run in its own
  unit-major order); the horizontal schedule draws in Megatron's order for every M.
"""

from __future__ import annotations

import os

# cuBLAS is deterministic under torch.use_deterministic_algorithms only with a fixed
# workspace; it has to be set before the first cuBLAS handle exists.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import (build_model, gradients, make_microbatches,  # noqa: E402
                      megatron_forward_backward, tiny_args, zero_gradients)
from gpu_helpers import DEVICE, gpu_world, on_device, rel_err, requires_device  # noqa: E402,F401
from megatron_snake import vertical_forward_backward  # noqa: E402
from megatron_snake.models.gpt_units import GPTUnits  # noqa: E402
from megatron_snake.schedule.vertical import horizontal_forward_backward  # noqa: E402
from megatron_snake.training.distributed import set_seed  # noqa: E402

pytestmark = requires_device

REL_TOL = 1e-6           # fp32 gradients summed in another order
BF16_LOSS_TOL = 1e-2     # relative, per micro-batch loss
BF16_GRAD_TOL = 2e-2     # relative (norm), bf16 param.grad accumulated in bf16
BF16_MAIN_GRAD_TOL = 1e-5  # relative (norm), bf16 terms summed in an fp32 main_grad
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")

SCHEDULES = {"vertical": vertical_forward_backward, "horizontal": horizontal_forward_backward}
VARIANTS = {
    "learned-tied": (),
    "rope-untied": ("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
}


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def _microbatches(num: int, seed: int = 0):
    mbs = on_device(make_microbatches(num, seed=seed))
    assert all(t.device == DEVICE for mb in mbs for t in mb.values() if torch.is_tensor(t))
    return mbs


def _assert_losses_equal(losses, ref_losses):
    assert len(losses) == len(ref_losses)
    for i, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert ours.device == DEVICE, f"micro-batch {i}: loss on {ours.device}, not {DEVICE}"
        assert torch.equal(ours, ref.to(ours.dtype)), f"micro-batch {i}: loss {ours} != {ref}"


def _assert_grads_close(grads, ref_grads, tol):
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref.device == DEVICE and grads[name].device == DEVICE, name
        assert ref.abs().max() > 0, f"{name}: reference gradient is all zero"
        err = rel_err(grads[name], ref)
        assert err <= tol, f"{name}: relative gradient error {err:.2e} > {tol:.0e}"


def _megatron_then(model, mbs, run):
    """Megatron's losses and gradients, then ``run()``'s, from zeroed gradients each."""
    zero_gradients(model)
    ref_losses = megatron_forward_backward(model, mbs)
    ref_grads = gradients(model)
    zero_gradients(model)
    losses = run()
    return ref_losses, ref_grads, losses, gradients(model)


# --- fp32 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("store_kind", ["memory", "host", "nvme"])
@pytest.mark.parametrize("variant,checkpoint_interval,num_microbatches",
                         [("learned-tied", 2, 3), ("rope-untied", 1, 4)])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_fp32_matches_megatron(gpu_world, tmp_path, schedule, variant, checkpoint_interval,
                               num_microbatches, store_kind):
    from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
    from megatron_snake.storage.store import TensorStore
    from megatron_snake.schedule.unit_store import CombinedStore, InMemoryStore

    assert not torch.backends.cuda.matmul.allow_tf32, "gpu_world turns TF32 off"
    args = tiny_args(*VARIANTS[variant])
    model = build_model(args, gpu_world)
    assert all(p.device == DEVICE for p in model.parameters())
    mbs = _microbatches(num_microbatches)
    fn = SCHEDULES[schedule]

    if store_kind == "memory":
        ref_losses, ref_grads, losses, grads = _megatron_then(
            model, mbs, lambda: fn(model, mbs, checkpoint_interval=checkpoint_interval))
    else:
        with TensorStore(tmp_path, rank=0, device=DEVICE,
                         host_memory_limit=256 << 20) as tstore:
            checkpoints = OffloadedUnitInputs(tstore, store_kind, num_microbatches, DEVICE)
            store = CombinedStore(checkpoints, InMemoryStore())
            ref_losses, ref_grads, losses, grads = _megatron_then(
                model, mbs, lambda: fn(model, mbs, checkpoint_interval=checkpoint_interval,
                                       store=store))
            checkpoints.finish_step()
            written = tstore.counters.written[store_kind]
            assert tstore.keys() == [], "every checkpoint is dropped after its backward"
        units = GPTUnits(model, checkpoint_interval).num_units
        one = mbs[0]["tokens"].numel() * args.hidden_size * 4  # [s, b, h] fp32
        assert written == (units - 1) * num_microbatches * one, \
            "every unit checkpoint but the loss unit's went through the tier"

    _assert_losses_equal(losses, ref_losses)
    _assert_grads_close(grads, ref_grads, REL_TOL)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_fp32_forward_only_matches_megatron(gpu_world, schedule):
    model = build_model(tiny_args(*VARIANTS["rope-untied"]), gpu_world)
    mbs = _microbatches(3, seed=5)
    zero_gradients(model)
    ref = megatron_forward_backward(model, mbs, forward_only=True)
    losses = SCHEDULES[schedule](model, mbs, checkpoint_interval=2, forward_only=True)
    _assert_losses_equal(losses, ref)
    assert all(p.grad is None for p in model.parameters()), "forward only: no gradients"


# --- bf16 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ddp,variant", [(False, "learned-tied"), (True, "rope-untied")],
                         ids=["float16module-tied", "float16module-ddp-untied"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_bf16_float16module_close_to_megatron(gpu_world, schedule, ddp, variant):
    """``--bf16``: bf16 weights in Megatron's Float16Module, as training builds them (and,
    for Megatron's side of training, Megatron's DDP with fp32 main_grad on top). Bare, the
    bf16 ``grad`` of every micro-batch is added in bf16 in another order: close. Under DDP
    each micro-batch's bf16 gradient is added to an fp32 main_grad: close to fp32 rounding
    (untied here: a tied embedding gets its two terms added in bf16 by Megatron's single
    graph and one by one into main_grad by the schedules, a bf16 rounding apart)."""
    from megatron.core.transformer.module import Float16Module

    from megatron_snake.training.model import wrap_ddp

    args = tiny_args("--bf16", *VARIANTS[variant])
    gpt = build_model(args, gpu_world)
    model = Float16Module(gpt.config, gpt)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if ddp:
        model = wrap_ddp(model)
    mbs = _microbatches(3, seed=1)
    ref_losses, ref_grads, losses, grads = _megatron_then(
        model, mbs, lambda: SCHEDULES[schedule](model, mbs, checkpoint_interval=2))

    assert len(losses) == len(ref_losses)
    for i, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert ours.device == DEVICE and torch.isfinite(ours), (i, ours)
        err = abs(ours.float().item() - ref.float().item()) / abs(ref.float().item())
        assert err <= BF16_LOSS_TOL, f"micro-batch {i}: loss {ours} vs Megatron's {ref}"
    expected = torch.float32 if ddp else torch.bfloat16
    assert all(g.dtype == expected for g in grads.values()), \
        {n: g.dtype for n, g in grads.items()}
    _assert_grads_close(grads, ref_grads, BF16_MAIN_GRAD_TOL if ddp else BF16_GRAD_TOL)


# --- dropout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,checkpoint_interval", [("learned-tied", 2), ("rope-untied", 1)])
def test_dropout_vertical_matches_megatron_one_microbatch(gpu_world, variant,
                                                          checkpoint_interval):
    """M = 1: unit-major and micro-batch-major draw order coincide, so with the same seed the
    vertical forward draws Megatron's masks and its recompute must replay them."""
    model = build_model(tiny_args(*DROPOUT, *VARIANTS[variant]), gpu_world)
    model.train()
    mbs = _microbatches(1, seed=2)

    def vertical():
        set_seed(99)
        return vertical_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval)

    zero_gradients(model)
    set_seed(99)
    ref_losses = megatron_forward_backward(model, mbs)
    ref_grads = gradients(model)
    zero_gradients(model)
    losses = vertical()
    _assert_losses_equal(losses, ref_losses)
    _assert_grads_close(gradients(model), ref_grads, REL_TOL)

    # The masks matter: without dropout the loss is another.
    model.eval()
    zero_gradients(model)
    set_seed(99)
    plain = vertical_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval,
                                      forward_only=True)
    assert not torch.equal(plain[0], losses[0]), "dropout 0.1 changed nothing"


def test_dropout_horizontal_matches_megatron(gpu_world):
    """The horizontal schedule draws micro-batch by micro-batch, as Megatron does: the same
    masks for every M, replayed by each unit's recompute."""
    model = build_model(tiny_args(*DROPOUT, *VARIANTS["rope-untied"]), gpu_world)
    model.train()
    mbs = _microbatches(3, seed=3)
    zero_gradients(model)
    set_seed(99)
    ref_losses = megatron_forward_backward(model, mbs)
    ref_grads = gradients(model)
    zero_gradients(model)
    set_seed(99)
    losses = horizontal_forward_backward(model, mbs, checkpoint_interval=2)
    _assert_losses_equal(losses, ref_losses)
    _assert_grads_close(gradients(model), ref_grads, REL_TOL)


@pytest.mark.parametrize("store_kind", ["memory", "nvme"])
def test_dropout_vertical_recompute_replays_cuda_masks(gpu_world, tmp_path, store_kind):
    """M = 3: the vertical order's masks (other than Megatron's) come back exactly in the
    recompute: the same numbers as one autograd graph over the same order with every
    activation kept (tests/test_vertical_dropout.py's reference), also with the checkpoints
    going through NVMe on the store's copy streams."""
    from test_vertical_dropout import _kept_activation_reference

    from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
    from megatron_snake.storage.store import TensorStore
    from megatron_snake.schedule.unit_store import CombinedStore, InMemoryStore

    model = build_model(tiny_args(*DROPOUT), gpu_world)
    model.train()
    mbs = _microbatches(3, seed=4)
    zero_gradients(model)
    set_seed(99)
    ref_losses = _kept_activation_reference(model, mbs, 2)
    ref_grads = gradients(model)
    zero_gradients(model)
    if store_kind == "memory":
        set_seed(99)
        losses = vertical_forward_backward(model, mbs, checkpoint_interval=2)
    else:
        with TensorStore(tmp_path, rank=0, device=DEVICE,
                         host_memory_limit=256 << 20) as tstore:
            checkpoints = OffloadedUnitInputs(tstore, store_kind, len(mbs), DEVICE)
            set_seed(99)
            losses = vertical_forward_backward(
                model, mbs, checkpoint_interval=2,
                store=CombinedStore(checkpoints, InMemoryStore()))
            checkpoints.finish_step()
            assert tstore.counters.written[store_kind] > 0
    _assert_losses_equal(losses, ref_losses)
    _assert_grads_close(gradients(model), ref_grads, REL_TOL)

    # And they are not Megatron's masks (M > 1): the losses differ from its run.
    zero_gradients(model)
    set_seed(99)
    megatron_losses = megatron_forward_backward(model, mbs)
    assert not all(torch.equal(a, b.to(a.dtype)) for a, b in zip(losses, megatron_losses))
