"""--use-precision-aware-optimizer with --snake-offload: Megatron-Core's precision-aware
optimizer options for the offloaded AdamW (megatron_snake/optim/precision.py,
docs/precision.md).

- The master-weight remainders are Transformer Engine's split, written out here on the bit
  patterns, and exact: over 20 steps the masters are those of today's fp32 masters, bit for
  bit, at the optimizer and in bf16 training.
- bf16, fp16 and fp8 moments are held to a reference written here with Transformer Engine's
  FusedAdam rounding rule (``_apply_scale`` / ``get_unscaled_state``), step by step.
- The pre-flight's bytes are the store's counters; the planner counts the dtypes.
- Checkpoints keep Megatron's keys and dtypes and round-trip both formats; a remainders
  checkpoint loads into a plain run and back.
- The flags are refused where they cannot work, naming the flag.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import VOCAB, build_model, expect_flag_error, make_microbatches, tiny_args
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.optim import host_kernel
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.parts import PARTS, part_bounds
from megatron_snake.optim.precision import (FP8, REMAINDER, Precision, join_flat,
                                            split_flat)
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.storage.store import TensorStore
from megatron_snake.training.arguments import parse_args

BF16 = torch.bfloat16
REMAINDERS = Precision(params=BF16, master=REMAINDER)


# --- the remainder rule, written out on the bit patterns ----------------------------------
def _te_split(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Transformer Engine's AdamFunctorMasterParamRemainder on uint32 fp32 bit patterns:
    the bf16 bits are the high 16 bits, plus one (mod 2**16) when the low 16 bits read as an
    int16 are negative; the remainder is the low 16 bits."""
    high, low = (bits >> 16).astype(np.int64), (bits & 0xFFFF).astype(np.int64)
    hi = (high + (low >= 0x8000)) & 0xFFFF
    return hi.astype(np.uint16), low.astype(np.uint16)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int32).numpy().view(np.uint32)


def test_remainders_are_transformer_engines_split_and_exact():
    """Every kind of fp32 (random bit patterns: normal, subnormal, inf, NaN, both signs,
    and the ties): the split is the kernel's rule, joining undoes it bit for bit, and the
    bf16 weight differs from torch's cast only at exact ties (low half 0x8000) and NaNs."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
                      0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF,
                      0x3F807FFF, 0x7F7F8000, 0x7FC00000, 0xFFFF8000, 0x7FFF8000,
                      0x7FFFFFFF, 0x80008000, 0xFFFFFFFF], dtype=np.uint32)
    bits = np.concatenate([bits, edges])
    master = torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32)
    hi, rem = split_flat(master)
    want_hi, want_rem = _te_split(bits)
    assert np.array_equal(hi.view(torch.int16).numpy().view(np.uint16), want_hi)
    assert np.array_equal(rem.numpy().view(np.uint16), want_rem)
    assert np.array_equal(_bits(join_flat(hi, rem)), bits), "join(split(x)) is x, bit for bit"
    cast = master.to(BF16).view(torch.int16).numpy().view(np.uint16)
    differ = cast != want_hi
    tie = (bits & 0xFFFF) == 0x8000
    assert not (differ & ~tie & ~torch.isnan(master).numpy()).any()
    assert differ[tie & ~torch.isnan(master).numpy()].any(), "ties to even differ somewhere"


# --- Transformer Engine's rounding of a state, written out ---------------------------------
def _te_store(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``FusedAdam._apply_scale``: (stored, multiplier) of fp32 ``x`` in ``dtype``."""
    if dtype == BF16:
        return x.to(BF16), 1.0
    amax = torch.maximum(-x.min(), x.max()).to(torch.float32) if x.numel() else \
        torch.zeros(())
    if dtype == torch.float16:
        scale = amax / torch.tensor(65504.0 / 2, dtype=torch.float32)
        rscale = scale.reciprocal() if scale > 0 else torch.zeros(())
        return (x * rscale).to(torch.float16), float(scale)
    scale = amax / torch.tensor(448.0, dtype=torch.float32)          # fp8, E4M3
    if scale == 0:
        return torch.zeros_like(x, dtype=torch.float8_e4m3fn), 0.0
    qscale = 1 / scale
    return (x * qscale).clamp(-448, 448).to(torch.float8_e4m3fn), float(1 / qscale)


def _te_load(stored: torch.Tensor, multiplier: float) -> torch.Tensor:
    """``FusedAdam.get_unscaled_state``: the fp32 values of a stored state."""
    out = stored.to(torch.float32)
    if stored.dtype != BF16:
        out = out * torch.tensor(multiplier, dtype=torch.float32)
    return out


def _tiny_layouts(megatron_world, interval: int = 2) -> UnitParams:
    model = build_model(tiny_args("--untie-embeddings-and-output-weights"), megatron_world)
    return UnitParams.of(GPTUnits(model, interval))


def _gradients(params: UnitParams, steps: int):
    g = torch.Generator().manual_seed(3)
    return [{lay.key: torch.randn(lay.numel, generator=g) * 0.01 for lay in params.units}
            for _ in range(steps)]


def _run_optimizer(params, store_dir, precision, grads, *, clip, alpha, buffer_bytes):
    """The offloaded AdamW alone over ``grads``; per step {key: (master, exp_avg,
    exp_avg_sq)} as fp32 values (masters joined with their working weights)."""
    out = []
    with TensorStore(store_dir, rank=0, host_memory_limit=256 << 20,
                     buffer_bytes=buffer_bytes) as store:
        opt = OffloadedAdamW(params, store, lr=2e-3, weight_decay=0.1, clip_grad=clip,
                             alpha=alpha, precision=precision)
        for step in grads:
            for lay in reversed(params.units):
                opt.gradient_ready(lay.key, step[lay.key])
            opt.step()
            opt.flush()
            states = {}
            for lay in params.units:
                state = opt.layout_state(lay.key)
                master = state["master"]
                if master.dtype == REMAINDER:
                    w = torch.cat([store.get(("w", lay.key, p)).wait() for p in PARTS
                                   if ("w", lay.key, p) in store])
                    master = join_flat(w, master)
                states[lay.key] = (master.clone(), state["exp_avg"].clone(),
                                   state["exp_avg_sq"].clone())
            out.append(states)
        opt.close()
    return out


@pytest.mark.parametrize("alpha,clip", [(0.25, 0.5), (0.0, 0.0)])
def test_remainders_are_bit_exact_against_fp32_masters_over_20_steps(megatron_world,
                                                                     tmp_path, alpha, clip):
    """A tiny GPT's layouts, 20 steps of the same gradients, the update split by alpha and
    clipped, host buffers of 64 KiB (int16 records are cut at other elements than fp32
    ones): today's fused update on fp32 masters, and the chunked one on bf16 weights +
    int16 remainders. Every master and both moments are the same bits at every step."""
    params = _tiny_layouts(megatron_world)
    grads = _gradients(params, 20)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fp32 = _run_optimizer(params, tmp_path / "a", Precision(), grads, clip=clip, alpha=alpha,
                          buffer_bytes=64 << 10)
    rem = _run_optimizer(params, tmp_path / "b", REMAINDERS, grads, clip=clip, alpha=alpha,
                         buffer_bytes=64 << 10)
    moved = 0
    for step, (a, b) in enumerate(zip(fp32, rem)):
        for key in a:
            for name, x, y in zip(("master", "exp_avg", "exp_avg_sq"), a[key], b[key]):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32)), \
                    f"step {step + 1}, unit {key}: {name} differs"
        moved += sum(not torch.equal(a[k][0], fp32[0][k][0]) for k in a)
    assert moved, "the masters moved"


@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP8], ids=["bf16", "fp16", "fp8"])
def test_moments_follow_transformer_engines_rounding_rule(megatron_world, tmp_path,
                                                          monkeypatch, dtype):
    """Both moments in ``dtype`` (remainder masters): step by step, the reference here
    runs torch's fused AdamW on each parameter's piece of a part in fp32 and stores the
    moments by Transformer Engine's rule (per piece: the scale of a "tensor"); the offloaded
    AdamW's moments and masters are its bits. Chunks of 256 elements, so a piece is
    computed in chunks, twice for its absmax."""
    monkeypatch.setattr(host_kernel, "CHUNK_ELEMENTS", 256)   # the torch path, where it runs
    params = _tiny_layouts(megatron_world)
    steps, lr, wd, alpha = 6, 2e-3, 0.1, 0.25
    grads = _gradients(params, steps)
    precision = Precision(params=BF16, master=REMAINDER, exp_avg=dtype, exp_avg_sq=dtype)
    ours = _run_optimizer(params, tmp_path, precision, grads, clip=0.0, alpha=alpha,
                          buffer_bytes=64 << 10)
    for lay in params.units:
        master = lay.gather(device="cpu", dtype=torch.float32)   # the first masters
        pieces = []   # (a, b, decay) of the whole flat, cut where a part starts
        for lo, hi_ in part_bounds(lay, alpha):
            pieces += [(s.start, s.stop, seg.decay) for seg, s in lay.pieces(lo, hi_)]
        m = {p: (torch.zeros(p[1] - p[0], dtype=torch.float8_e4m3fn if dtype == FP8
                             else dtype), 1.0) for p in pieces}
        v = dict(m)
        for step in range(steps):
            g = grads[step][lay.key]
            for p in pieces:
                a, b, decay = p
                mm, vv = _te_load(*m[p]), _te_load(*v[p])
                mp = master[a:b].clone()
                torch._fused_adamw_([mp], [g[a:b].clone()], [mm], [vv], [],
                                    [torch.tensor(float(step + 1))], lr=lr, beta1=0.9,
                                    beta2=0.999, weight_decay=wd if decay else 0.0, eps=1e-8,
                                    amsgrad=False, maximize=False)
                master[a:b] = mp
                m[p], v[p] = _te_store(mm, dtype), _te_store(vv, dtype)
            got = ours[step][lay.key]
            want_m = torch.cat([_te_load(*m[p]) for p in pieces])
            want_v = torch.cat([_te_load(*v[p]) for p in pieces])
            for name, x, y in (("master", got[0], master), ("exp_avg", got[1], want_m),
                               ("exp_avg_sq", got[2], want_v)):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32)), \
                    f"step {step + 1}, unit {lay.key}: {name} is not the reference's"


# --- bf16 training: remainders against fp32 masters --------------------------------------
def _train(megatron_world, root, precision_flags, batches, *, te_working_weights=False):
    """bf16 training of a tiny GPT through build_run; per step the losses and every
    layout's fp32 masters (joined from the remainders when stored so).
    ``te_working_weights``: today's fp32 masters, with working weights rounded by the
    remainders' rule (Transformer Engine's split), as the remainders run's are."""
    from megatron_snake.optim.unit_params import SHARED
    from megatron_snake.training.build import build_run
    from megatron_snake.training.distributed import set_seed
    from megatron_snake.training.loop import _lm_loss

    args = parse_args(["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads",
                       "4", "--seq-length", "16", "--hidden-dropout", "0",
                       "--attention-dropout", "0", "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--bf16", "--lr", "3e-3", "--clip-grad",
                       "1.0", "--snake-offload", "--snake-offload-dir", str(root),
                       "--deterministic-mode", "--device", "cpu", *precision_flags])
    losses, masters = [], []
    torch.use_deterministic_algorithms(True)
    set_seed(args.seed)   # the same initial weights in both runs
    try:
        with build_run(args, megatron_world, VOCAB, log=lambda *a: None) as run:
            opt, weights, store = run.optimizer, run.offloaded.weights, run.tensor_store
            if te_working_weights:
                opt.host_update.weights_rounding = "te"
                for lay in weights.params.units:
                    hi = split_flat(opt.layout_state(lay.key)["master"])[0]
                    for part, (lo, hi_) in weights.record_parts(lay):
                        store.put(("w", lay.key, part), hi[lo:hi_],
                                  tier=weights.tier_of(lay.key), kind="weights").wait()
                shared = weights.params.shared
                if shared.segments:
                    hi = split_flat(opt.layout_state(SHARED)["master"])[0]
                    for seg, view in zip(shared.segments, shared.views(hi)):
                        seg.param.data.copy_(view)
            for mbs in batches:
                outcome = run.step(mbs)
                losses.append(_lm_loss(outcome.reports, megatron_world))
                step = {}
                for key in opt.layouts:
                    master = opt.layout_state(key)["master"]
                    if master.dtype == REMAINDER:
                        w = torch.cat([store.get(("w", key, p)).wait() for p in PARTS
                                       if ("w", key, p) in store])
                        master = join_flat(w, master)
                    step[key] = master.clone()
                masters.append(step)
    finally:
        torch.use_deterministic_algorithms(False)
    return losses, masters


def test_bf16_training_with_remainders_keeps_todays_fp32_masters(megatron_world, tmp_path):
    """20 steps of bf16 training: today's fp32 masters (working weights rounded as the
    remainders round them) and --use-precision-aware-optimizer's bf16 weights + 16-bit
    remainders give the same losses and the same fp32 masters, bit for bit, at every step."""
    batches = [make_microbatches(2, seed=s) for s in range(20)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref_losses, ref = _train(megatron_world, tmp_path / "a", [], batches,
                             te_working_weights=True)
    losses, ours = _train(megatron_world, tmp_path / "b", ["--use-precision-aware-optimizer"],
                          batches)
    assert losses == ref_losses
    for step, (a, b) in enumerate(zip(ref, ours)):
        for key in a:
            assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), \
                f"step {step + 1}, layout {key}: masters differ"
    assert not torch.equal(ref[0][0], ref[-1][0])


@pytest.mark.parametrize("clip", ["1.0", "100"], ids=["clip binds", "clip kept"])
@pytest.mark.parametrize("tier", ["host", "nvme", "pinned"])
def test_the_update_replaces_the_working_weights_in_place_under_remainders(
        megatron_world, tmp_path, monkeypatch, tier, clip):
    """Under remainders the working weights are the masters' high halves: each part's
    update borrows its record (in host memory: a copy of a unit pinned on the device) and
    replaces the old weights in the same pass that writes the remainders, then gives it
    back. No converted copy is published (``put_converted`` is never called for a
    working-weight record) and every layout's records were borrowed; joined with the
    remainders they are today's fp32 masters at every step, bit for bit (the records are
    the new masters' high halves). Weights and optimizer state on the host tier, on the
    drive, and the units pinned on the device; the backward parts' speculative updates
    (their new weights written apart, as ``w.next``) updated again where the clip binds,
    kept where it does not."""
    converted, borrowed = [], []
    put_converted, borrow = TensorStore.put_converted, TensorStore.borrow

    def counting_put_converted(self, key, *args, **kwargs):
        converted.append(key)
        return put_converted(self, key, *args, **kwargs)

    def counting_borrow(self, key, *args, **kwargs):
        borrowed.append(key)
        return borrow(self, key, *args, **kwargs)

    monkeypatch.setattr(TensorStore, "put_converted", counting_put_converted)
    monkeypatch.setattr(TensorStore, "borrow", counting_borrow)
    flags = {"host": ["--snake-param-tier", "host", "--snake-optimizer-tier", "host"],
             "nvme": ["--snake-param-tier", "nvme", "--snake-optimizer-tier", "nvme"],
             "pinned": ["--snake-gpu-memory-limit", "1GiB"]}[tier] + ["--clip-grad", clip]
    batches = [make_microbatches(2, seed=s) for s in range(3)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, ref = _train(megatron_world, tmp_path / "a", flags, batches, te_working_weights=True)
    converted.clear()
    borrowed.clear()
    _, ours = _train(megatron_world, tmp_path / "b",
                     ["--use-precision-aware-optimizer", *flags], batches)
    assert [key for key in converted if key[0] == "w"] == []
    assert {key[1] for key in borrowed if key[0] == "w"} == set(ours[0])
    for step, (a, b) in enumerate(zip(ref, ours)):
        for key in a:
            assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), \
                f"step {step + 1}, layout {key}: masters differ"


# --- bytes: the pre-flight against the store's counters ----------------------------------
MODES = {"fp32": [], "remainders": ["--use-precision-aware-optimizer"],
         "remainders+bf16 moments": ["--use-precision-aware-optimizer", "--exp-avg-dtype",
                                     "bf16", "--exp-avg-sq-dtype", "bf16"],
         "fp16 moments, bf16 gradients": ["--use-precision-aware-optimizer", "--exp-avg-dtype",
                                          "fp16", "--exp-avg-sq-dtype", "fp16",
                                          "--main-grads-dtype", "bf16"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_preflight_bytes_are_the_stores(megatron_world, tmp_path, mode):
    """The pre-flight's optimizer and gradient bytes (the dtypes counted) are what the
    store writes for them at start, and what the drive reads and writes of the optimizer
    state per step (the clip binds on these steps: without speculation, each part is read
    and written once); the state summary says the same."""
    from megatron_snake.training import preflight
    from megatron_snake.training.build import build_run
    from megatron_snake.training.distributed import set_seed

    args = parse_args(["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads",
                       "4", "--seq-length", "16", "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--bf16", "--snake-offload",
                       "--snake-offload-dir", str(tmp_path), "--snake-alpha", "0.25",
                       "--snake-speculate", "off", "--device", "cpu", *MODES[mode]])
    pf = preflight.estimate(args, VOCAB)
    precision = Precision.from_args(args)
    assert pf.nvme_optimizer == precision.state_bytes * pf.params_rank
    assert pf.nvme_gradients == precision.grad_bytes * pf.params_rank
    assert ("precision-aware optimizer" in pf.summary()) == (mode != "fp32")
    set_seed(args.seed)
    with build_run(args, megatron_world, VOCAB, log=lambda *a: None) as run:
        store, opt = run.tensor_store, run.optimizer
        assert opt.state_bytes() == pf.nvme_optimizer
        assert opt.grad_bytes() == pf.nvme_gradients
        assert store.counters.by_kind["optim"]["nvme"][1] == pf.nvme_optimizer
        for seed in range(3):
            before = copy.deepcopy(store.counters.snapshot()["by_kind"])
            run.step(make_microbatches(2, seed=seed))
            opt.flush()
            store.synchronize()
            after = store.counters.snapshot()["by_kind"]
            read, written = (a - b for a, b in zip(after["optim"]["nvme"],
                                                   before["optim"]["nvme"]))
            assert read == written == pf.nvme_optimizer, (mode, read, written)
            was = before.get("grad", {}).get("host", [0, 0])
            grads = [a - b for a, b in zip(after["grad"]["host"], was)]
            assert grads[1] == pf.nvme_gradients   # the pool has room: host, in its dtype
        summary = run.offloaded.summary(args)
        assert f"{(pf.nvme_optimizer + pf.nvme_gradients) / 2**20:.1f} MiB" in summary


def test_planner_counts_the_dtypes():
    """The planner's workload takes each record's dtype from the flags, and its optimizer
    bytes per step follow them: remainders + bf16 moments move half of fp32's."""
    from megatron_snake.planner import load_profile, predict
    from megatron_snake.training.workload import workload_from_args

    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--bf16", "--snake-offload", "--device", "cpu"]
    hw = load_profile("h100_4x_gen4")
    nvme = {}
    for mode, flags in MODES.items():
        w = workload_from_args(parse_args([*base, *flags], world_size=1), VOCAB)
        p = Precision.from_args(parse_args([*base, *flags], world_size=1))
        assert w.optimizer_bytes == p.state_bytes and w.grad_bytes == p.grad_bytes
        assert w.update_reads_weights == p.remainders
        nvme[mode] = sum(predict(w, hw, check=False).bytes_by_kind["optim"]["nvme"])
    assert nvme["remainders+bf16 moments"] * 2 == nvme["fp32"]
    assert nvme["remainders"] * 12 == nvme["fp32"] * 10


# --- checkpoints --------------------------------------------------------------------------
SMALL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "6",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "5",
         "--train-iters", "4", "--deterministic-mode", "--bf16", "--device", "cpu",
         "--num-workers", "0"]
PRECISE = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype",
           "bf16"]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_resume_is_bit_exact_with_remainders_and_bf16_moments(megatron_world, tmp_path, fmt):
    """Saved at iteration 2 and resumed: the losses of the uninterrupted run, both formats.
    torch_dist holds Megatron's keys and dtypes: ``fp32_param`` the int16 remainders, the
    moments in fp32 (Megatron-Core's ``get_unscaled_state``), the weights in bf16."""
    from megatron.core import dist_checkpointing

    from megatron_snake.training.loop import pretrain

    flags = [*SMALL, "--snake-offload", *PRECISE, "--ckpt-format", fmt]
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", str(tmp_path)]))
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert resumed == full[2:], (resumed, full[2:])
    if fmt == "torch_dist":
        meta = dist_checkpointing.load_tensors_metadata(str(tmp_path / "iter_0000002"))
        key = "decoder.layers.mlp.linear_fc1.weight"
        assert meta[f"optimizer.state.fp32_param.{key}"].dtype == torch.int16
        assert meta[f"optimizer.state.exp_avg.{key}"].dtype == torch.float32
        assert meta[f"optimizer.state.exp_avg_sq.{key}"].dtype == torch.float32
        assert meta[key].dtype == BF16


def test_a_remainders_checkpoint_moves_between_an_offloaded_and_a_plain_run(
        megatron_world, tmp_path, capsys, monkeypatch):
    """torch_dist both ways at one rank, bf16: the offloaded run's int16 remainders are
    joined with its bf16 weights into the plain run's fp32 masters (each of which splits
    back into its bf16 weight, and not all of which are bf16 values), and a plain run's
    fp32 masters are split for an offloaded one, each saying so; the next losses are those
    of the saved run going on (the first the same, the next within the two schedules'
    rounding: measured 3e-6)."""
    from megatron_snake.training import torch_dist
    from megatron_snake.training.loop import pretrain

    joined, join = [], torch_dist._join_remainders

    def spy(optimizer, loaded):
        join(optimizer, loaded)
        for inner, state in torch_dist._float16_optimizers(optimizer, loaded):
            for params, group in zip(inner.float16_groups, torch_dist._masters(state)):
                joined.extend((p.detach().clone(), m.clone()) for p, m in zip(params, group))

    monkeypatch.setattr(torch_dist, "_join_remainders", spy)

    flags = [*SMALL, "--hidden-dropout", "0", "--attention-dropout", "0",
             "--ckpt-format", "torch_dist"]
    offloaded = [*flags, "--snake-offload", "--use-precision-aware-optimizer"]
    pretrain(parse_args([*offloaded, "--exit-interval", "2", "--save",
                         str(tmp_path / "a")]))
    capsys.readouterr()
    going_on = pretrain(parse_args([*offloaded, "--load", str(tmp_path / "a")]))
    plain = pretrain(parse_args([*flags, "--load", str(tmp_path / "a")]))
    out = capsys.readouterr().out
    assert "master weights rebuilt from the checkpoint's bf16 weights and 16-bit " \
           "remainders (exact)" in out
    assert len(plain) == len(going_on) == 2 and plain[0] == going_on[0]
    assert abs(plain[1] - going_on[1]) <= 5e-5 * abs(plain[1]), (plain, going_on)
    assert joined and all(m.dtype == torch.float32 for _, m in joined)
    assert all(torch.equal(split_flat(m)[0], p.detach().reshape(-1)) for p, m in joined)
    assert any(not torch.equal(m, p.float()) for p, m in joined), "remainders were not zero"
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", str(tmp_path / "b")]))
    plain_on = pretrain(parse_args([*flags, "--load", str(tmp_path / "b")]))
    capsys.readouterr()
    split = pretrain(parse_args([*offloaded, "--load", str(tmp_path / "b")]))
    assert "fp32 master weights split into bf16 weights and 16-bit remainders (exact" in \
        capsys.readouterr().out
    assert split[0] == plain_on[0]
    assert abs(split[1] - plain_on[1]) <= 5e-5 * abs(split[1]), (split, plain_on)


def test_torch_format_refuses_another_precision_and_torch_dist_converts(megatron_world,
                                                                        tmp_path, capsys):
    """The torch format loads optimizer state only into the precision it was saved with
    (one clear line naming the flags); torch_dist converts, with a note."""
    from megatron_snake.training.checkpointing import CheckpointMismatchError
    from megatron_snake.training.loop import pretrain

    saved = [*SMALL, "--snake-offload", *PRECISE, "--exit-interval", "2"]
    pretrain(parse_args([*saved, "--ckpt-format", "torch", "--save", str(tmp_path / "t")]))
    with pytest.raises(CheckpointMismatchError, match=r"other precision-aware optimizer "
                       r"settings \(master saved int16 now float32, exp_avg saved bfloat16 "
                       r"now float32, exp_avg_sq saved bfloat16 now float32.*torch_dist"):
        pretrain(parse_args([*SMALL, "--snake-offload", "--ckpt-format", "torch", "--load",
                             str(tmp_path / "t")]))
    pretrain(parse_args([*saved, "--ckpt-format", "torch_dist", "--save",
                         str(tmp_path / "d")]))
    capsys.readouterr()
    losses = pretrain(parse_args([*SMALL, "--snake-offload", "--use-precision-aware-optimizer",
                                  "--exp-avg-dtype", "fp16", "--load", str(tmp_path / "d")]))
    out = capsys.readouterr().out
    assert "exp_avg saved by a run that stored it in bf16, stored here in fp16 " \
           "(--exp-avg-dtype): rounded on load by Transformer Engine's rule" in out
    assert len(losses) == 2 and all(np.isfinite(losses))


# --- the flags ----------------------------------------------------------------------------
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16"]


@pytest.mark.parametrize("flags,named", [
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--snake-zenflow"], "--use-precision-aware-optimizer"),
    (["--snake-offload", "--exp-avg-dtype", "bf16"], "--exp-avg-dtype"),
    (["--snake-offload", "--main-params-dtype", "fp16"], "--main-params-dtype"),
    (["--snake-offload", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
     "--main-grads-dtype"),
    (["--snake-offload", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"],
     "--main-params-dtype"),
    (["--snake-offload", "--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp64"],
     "--exp-avg-sq-dtype"),
])
def test_flags_are_refused_where_they_cannot_work(capsys, flags, named):
    err = expect_flag_error(capsys, [*TINY, *flags], named)
    assert "Traceback" not in err


def test_flags_take_megatrons_names_choices_and_defaults():
    """Megatron-LM core_v0.16.1's flags: the defaults are fp32 and off; validated, the
    names become Megatron-LM's torch dtypes (fp8: uint8)."""
    args = parse_args([*TINY, "--snake-offload"])
    assert args.use_precision_aware_optimizer is False
    assert (args.main_params_dtype, args.main_grads_dtype, args.exp_avg_dtype,
            args.exp_avg_sq_dtype) == (torch.float32,) * 4
    args = parse_args([*TINY, "--snake-offload", "--bf16", "--use-precision-aware-optimizer",
                       "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16",
                       "--main-grads-dtype", "bf16"])
    assert (args.exp_avg_dtype, args.exp_avg_sq_dtype, args.main_grads_dtype) == \
        (torch.uint8, torch.float16, torch.bfloat16)
    p = Precision.from_args(args)
    assert (p.master, p.exp_avg, p.exp_avg_sq, p.grad) == (REMAINDER, FP8, torch.float16, BF16)
    assert p.state_bytes == 2 + 1 + 2 and p.grad_bytes == 2
    assert p.approximate() == ["--exp-avg-dtype fp8", "--exp-avg-sq-dtype fp16",
                               "--main-grads-dtype bf16"]
    assert "APPROXIMATE" in p.summary() and "exact" not in p.summary().split(";")[-1]
    fp16 = Precision.from_args(parse_args([*TINY, "--snake-offload", "--fp16",
                                           "--use-precision-aware-optimizer",
                                           "--main-params-dtype", "fp16"]))
    assert fp16.master == torch.float16 and fp16.approximate() == ["--main-params-dtype fp16"]
    assert Precision.from_args(parse_args([*TINY, "--snake-offload", "--bf16",
                                           "--use-precision-aware-optimizer"])).summary() \
        .endswith("exact")


def test_the_plugin_takes_the_flag_with_snake_offload(capsys):
    """The Megatron-LM plug-in takes --use-precision-aware-optimizer with
    --snake-offload: it notes that the offloaded AdamW honours it, and applies the same
    rules to Megatron-LM's mapped dtypes."""
    from test_megatron_lm_contract import FLAGS, mlm_args

    from megatron_snake.megatron_lm import flags

    args = mlm_args("--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                    checked=False)
    notes = flags.check_args(args, "pretrain_gpt.py", [*FLAGS, "--bf16",
                                                      "--use-precision-aware-optimizer"])
    assert any(n.startswith("> --use-precision-aware-optimizer with --snake-offload") for n in
               notes), notes
    args = mlm_args("--bf16", checked=False)
    args.use_precision_aware_optimizer = True
    args.main_params_dtype = torch.float16
    args.bf16, args.params_dtype = False, torch.float32
    with pytest.raises(SystemExit):
        flags.check_args(args, "pretrain_gpt.py", FLAGS)
    assert "--main-params-dtype" in capsys.readouterr().err


def test_remainders_need_bf16_weights():
    with pytest.raises(ValueError, match="remainders need bf16"):
        Precision(params=torch.float16, master=REMAINDER)


def test_data_parallel_remainders_save_and_load_into_one_rank(tmp_path):
    """Two data-parallel ranks (each its shard of every layout's remainders, moments and
    working-weight records, the tied embedding's too), bf16 moments, clipping and a
    deferred part: saved in torch_dist and loaded by one rank, and by the two again: the
    next losses agree (the one rank sums the batch in another order)."""
    from test_torch_dist_checkpoint import FLAGS as DIST_FLAGS
    from test_torch_dist_checkpoint import _losses

    flags = [*DIST_FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "511", "--snake-offload",
             "--snake-alpha", "0.3", "--clip-grad", "0.5", *PRECISE]
    ckpt = str(tmp_path / "ckpt")
    _losses(*flags, "--train-iters", "4", "--save", ckpt, nproc=2)
    two = _losses(*flags, "--train-iters", "7", "--load", ckpt,
                  "--use-checkpoint-opt_param-scheduler", nproc=2)
    one = _losses(*flags, "--train-iters", "7", "--load", ckpt,
                  "--use-checkpoint-opt_param-scheduler")
    assert len(two) == len(one) == 3
    for a, b in zip(two, one):
        assert abs(a - b) <= 5e-4 * abs(a), (two, one)
