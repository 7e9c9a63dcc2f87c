"""The one-pass host AdamW update (csrc/adamw.c through optim/host_kernel.py) gives torch's
bits, at every instruction set this CPU runs and in the torch fallback:

- fp32: torch._fused_adamw_ itself (not this project's code) is the reference, on values
  from zero to huge of both signs, lengths off the 8- and 16-element lanes (the scalar
  tail), both weight-decay settings, several steps and hyperparameters, the clip on and off,
  in place and out of place, one and two threads; bf16 weights are master.to(bf16);
- a parameter piece cut into segments anywhere (Segment.vector) is the kernel on the piece;
- the precision-aware modes against references written here from torch ops: the fused
  kernel on each piece in fp32, then the casts, Transformer Engine's remainder split and
  its per-piece scaling (fp16 and fp8), over several steps;
- the stores round as torch's casts do at every midpoint of bf16, fp16 and fp8;
- fp32 masters with Transformer Engine's rounding of the working weights and remainders give
  the same masters, moments and weights (docs/design.md, the host update kernel);
- torch's default (no-AVX) build, whose kernel fuses no multiply-add, in a subprocess.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_snake.optim import host_kernel as hk
from megatron_snake.optim.precision import split_master

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LEVELS = ("torch",) + hk.ISAS


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    """Each implementation: the torch path and every native level this CPU has."""
    name = request.param
    if name != "torch":
        if hk._native is None:
            pytest.skip("the native kernel is not built")
        if not hk._native.isa_supported(hk.ISAS.index(name)):
            pytest.skip(f"this CPU lacks {name}")
    monkeypatch.setenv(hk.ENV, name)
    hk.reset()
    want = f"torch ({hk.ENV}=torch)" if name == "torch" else f"native ({name})"
    assert hk.implementation() == want
    yield name
    hk.reset()


def _one_thread_for_torch(level: str, threads: int) -> None:
    if level == "torch" and threads > 1:
        pytest.skip("the torch path runs on torch's own threads: threads is the kernel's")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    bad = (_bits(x) != _bits(y)).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {x.numel()} elements differ, first "
                              f"at {int(bad[0])}: {x[bad[0]].item()!r} vs {y[bad[0]].item()!r}")


def _values(n: int, gen, scale: float, positive: bool = False) -> torch.Tensor:
    """Magnitudes over many decades, zeros, both signs, a few huge and tiny ones."""
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3) * scale
    x[::13] = 0.0
    x[3::29] *= 1e8
    x[7::31] *= 1e-30
    return x.abs() if positive else x


def _reference(p, g, m, v, hyper, decay, clip):
    """torch._fused_adamw_ on one tensor (a parameter piece), fp32, new tensors."""
    p, g, m, v = (t.to(F32, copy=True) for t in (p, g, m, v))
    if clip is not None:
        g.mul_(torch.tensor(clip, dtype=F32))
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(hyper["step"]))],
                        lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"],
                        weight_decay=hyper["weight_decay"] if decay else 0.0,
                        eps=hyper["eps"], amsgrad=False, maximize=False)
    return p, m, v


HYPERS = [dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1),
          dict(lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0, step=7),
          dict(lr=2e-3, beta1=0.3, beta2=0.99, eps=1e-8, weight_decay=0.01, step=1000),
          dict(lr=0.1, beta1=0.5, beta2=0.5, eps=1e-3, weight_decay=1.0, step=2)]
# parameter pieces: lengths on and off the lanes; the first two long enough for two threads
LENGTHS = (9001, 8192, 1, 7, 8, 15, 16, 17, 100, 1003)


@pytest.mark.parametrize("hyper", HYPERS, ids=["default", "no-decay", "big-lerp", "wild"])
@pytest.mark.parametrize("clip", [None, 0.37], ids=["no-clip", "clip"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_is_torchs_fused_adamw(level, hyper, clip, in_place, threads):
    _one_thread_for_torch(level, threads)
    gen = torch.Generator().manual_seed(hash((clip, in_place, threads, hyper["step"])) % 1000)
    segs, refs, kept = [], [], []
    for i, n in enumerate(LENGTHS):
        p, g = _values(n, gen, 1.0), _values(n, gen, 1e-2)
        m, v = _values(n, gen, 1e-3), _values(n, gen, 1e-5, positive=True)
        decay = i % 2 == 0
        refs.append(_reference(p, g, m, v, hyper, decay, clip))
        kept.append([t.clone() for t in (p, g, m, v)])
        outs = {} if in_place else {name: torch.full((n,), 7.0) for name in
                                    ("master_out", "exp_avg_out", "exp_avg_sq_out")}
        segs.append(hk.Segment(g, p, m, v, weights_out=torch.empty(n, dtype=BF16),
                               decay=decay, **outs))
    out = hk.adamw_update(segs, clip=clip, threads=threads, **hyper)
    assert out == {}
    for seg, (p, m, v), old in zip(segs, refs, kept):
        _same(seg.master_out, p, "master")
        _same(seg.exp_avg_out, m, "exp_avg")
        _same(seg.exp_avg_sq_out, v, "exp_avg_sq")
        _same(seg.weights_out, p.to(BF16), "bf16 weights")
        if not in_place:   # the old state is kept (the gradient may be clipped in place)
            for x, y in zip((seg.master, seg.exp_avg, seg.exp_avg_sq), (old[0], old[2], old[3])):
                _same(x, y, "input kept")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_piece_cut_into_segments_is_the_kernel_on_the_piece(level, threads):
    """One parameter piece cut where host buffers would end (off every lane), each segment
    saying how much of it lies before the piece's scalar tail."""
    _one_thread_for_torch(level, threads)
    gen = torch.Generator().manual_seed(5)
    hyper = HYPERS[0]
    n = 12013
    p, g = _values(n, gen, 1.0), _values(n, gen, 1e-2)
    m, v = _values(n, gen, 1e-3), _values(n, gen, 1e-5, positive=True)
    want = _reference(p, g, m, v, hyper, True, None)
    cuts = [0, 777, 6001, n - 3, n]
    segs = [hk.Segment(g[a:b], p[a:b], m[a:b], v[a:b], vector=hk.vector_count(n, a, b))
            for a, b in zip(cuts, cuts[1:])]
    hk.adamw_update(segs, threads=threads, **hyper)
    for got, ref, name in zip((p, m, v), want, ("master", "exp_avg", "exp_avg_sq")):
        _same(got, ref, name)


@pytest.mark.parametrize("master_dtype", [F32, "rem"])
def test_outputs_at_any_alignment(level, master_dtype):
    """Out of place into buffers that start anywhere (the SIMD loops store non-temporally
    into outputs nothing reads back where they are aligned, and plainly where not)."""
    gen = torch.Generator().manual_seed(9)
    hyper, n = HYPERS[0], 3001
    for offsets in [(0, 0, 0, 0), (1, 3, 5, 7), (8, 1, 0, 2), (3, 0, 16, 9)]:
        p, g = _values(n, gen, 1.0), _values(n, gen, 1e-2)
        m, v = _values(n, gen, 1e-3), _values(n, gen, 1e-5, positive=True)
        want = _reference(p, g, m, v, hyper, True, None)
        if master_dtype == "rem":
            hi, master = split_master_hi(p), split_master_rem(p)
        else:
            hi, master = None, p
        outs = [torch.empty(n + 32, dtype=t.dtype)[off:off + n]
                for t, off in zip((hi if hi is not None else torch.empty(0, dtype=BF16),
                                   master, m, v), offsets)]
        seg = hk.Segment(g, master, m, v, weights=hi, weights_out=outs[0], master_out=outs[1],
                         exp_avg_out=outs[2], exp_avg_sq_out=outs[3])
        hk.adamw_update([seg], **hyper)
        where = f"offsets {offsets}"
        if master_dtype == "rem":
            _same(outs[1], split_master_rem(want[0]), f"{where}: remainders")
            _same(outs[0], split_master_hi(want[0]), f"{where}: weights")
        else:
            _same(outs[1], want[0], f"{where}: master")
            _same(outs[0], want[0].to(BF16), f"{where}: weights")
        _same(outs[2], want[1], f"{where}: exp_avg")
        _same(outs[3], want[2], f"{where}: exp_avg_sq")


# --- the precision-aware modes ----------------------------------------------------------
RANGE = {F16: 65504.0 / 2, "fp8": 448.0}


def _te_store(x: torch.Tensor, dtype):
    """Transformer Engine's FusedAdam rule for one piece (written here from torch ops):
    (stored, multiplier)."""
    amax = torch.maximum(-x.min(), x.max()).to(F32)
    scale = amax / torch.tensor(RANGE[dtype], dtype=F32)
    if dtype == F16:
        rscale = scale.reciprocal() if scale > 0 else torch.zeros((), dtype=F32)
        return (x * rscale).to(F16), float(scale)
    if scale == 0:
        return torch.zeros(x.numel(), dtype=torch.uint8), 0.0
    q = torch.ones((), dtype=F32) / scale
    stored = (x * q).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return stored, float(torch.ones((), dtype=F32) / q)


def _te_load(stored: torch.Tensor, dtype, multiplier: float) -> torch.Tensor:
    x = stored.view(torch.float8_e4m3fn) if dtype == "fp8" else stored
    return x.to(F32) * torch.tensor(multiplier, dtype=F32)


def _store(x: torch.Tensor, dtype):
    if dtype in (F16, "fp8"):
        return _te_store(x, dtype)
    return x.to(dtype), 1.0


def _load(stored, dtype, multiplier):
    return _te_load(stored, dtype, multiplier) if dtype in (F16, "fp8") else stored.to(F32)


def _torch_dtype(dtype):
    return torch.uint8 if dtype == "fp8" else dtype


MODES = {
    # name: (grad, master, exp_avg, exp_avg_sq, weights)
    "remainders, bf16 moments, bf16 grads": (BF16, "rem", BF16, BF16, BF16),
    "remainders, fp32 moments": (F32, "rem", F32, F32, BF16),
    "fp32 master, bf16 moments, fp16 weights": (F32, F32, BF16, BF16, F16),
    "fp16 master, fp16 moments": (F32, F16, F16, F16, F16),
    "remainders, fp8 moments": (F32, "rem", "fp8", "fp8", BF16),
    "fp32 master, fp16 exp_avg, fp8 exp_avg_sq, bf16 grads": (BF16, F32, F16, "fp8", BF16),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
@pytest.mark.parametrize("threads", [1, 2])
def test_precision_modes_follow_the_rounding_rules(level, mode, in_place, threads):
    """Three steps on four parameter pieces (the second cut into two segments, the last all
    zero), against a reference per piece: stored values loaded into fp32, torch's fused
    kernel on the piece, then the remainder split, the casts or Transformer Engine's scaling
    of the piece."""
    _one_thread_for_torch(level, threads)
    grad_dt, master_dt, m_dt, v_dt, w_dt = MODES[mode]
    gen = torch.Generator().manual_seed(11)
    hyper = dict(HYPERS[0])
    lengths, clip = (5003, 6144 + 9, 37, 64), 0.5
    pieces = []   # per piece: reference fp32 master, stored moments and multipliers
    for i, n in enumerate(lengths):
        master = _values(n, gen, 1.0) if i < 3 else torch.zeros(n)
        if master_dt == F16:   # an fp16 master holds what its range does
            master = master.clamp(-1e4, 1e4)
        pieces.append({"master": master, "m": _store(torch.zeros(n), m_dt),
                       "v": _store(torch.zeros(n), v_dt), "decay": i != 2})
    # the stored state the kernel works on, per piece
    stored = []
    for piece in pieces:
        if master_dt == "rem":
            hi = torch.empty(piece["master"].numel(), dtype=BF16)
            rem = torch.empty(piece["master"].numel(), dtype=torch.int16)
            split_master(piece["master"], hi, rem)
            s = {"master": rem, "weights": hi}
        elif master_dt == F16:
            s = dict(zip(("master", "m_master"), _te_store(piece["master"], F16)))
            piece["m_master"] = s["m_master"]
            piece["master"] = _te_load(s["master"], F16, s["m_master"])
        else:
            s = {"master": piece["master"].clone()}
        s["exp_avg"], s["exp_avg_sq"] = piece["m"][0].clone(), piece["v"][0].clone()
        stored.append(s)
    scales = {}
    if master_dt == F16:
        scales["master"] = [s["m_master"] for s in stored]
    if m_dt in (F16, "fp8"):
        scales["exp_avg"] = [p["m"][1] for p in pieces]
    if v_dt in (F16, "fp8"):
        scales["exp_avg_sq"] = [p["v"][1] for p in pieces]
    for step in range(1, 4):
        hyper["step"] = step
        grads = [(_values(p["master"].numel(), gen, 1e-2) if i < 3
                  else torch.zeros(p["master"].numel())).to(grad_dt)
                 for i, p in enumerate(pieces)]
        # the reference
        for piece, g in zip(pieces, grads):
            m = _load(piece["m"][0], m_dt, piece["m"][1])
            v = _load(piece["v"][0], v_dt, piece["v"][1])
            p, m, v = _reference(piece["master"], g, m, v, hyper, piece["decay"], clip)
            piece["weights"] = split_master_hi(p) if master_dt == "rem" else p.to(w_dt)
            if master_dt == F16:
                q, piece["m_master"] = _te_store(p, F16)
                piece["q_master"], p = q, _te_load(q, F16, piece["m_master"])
            piece["master"], piece["m"], piece["v"] = p, _store(m, m_dt), _store(v, v_dt)
        # the kernel
        segs, outs = [], []
        for index, (s, g) in enumerate(zip(stored, grads)):
            n = g.numel()
            cuts = [0, 1000, n] if index == 1 else [0, n]
            o = {name: (s[name] if in_place else torch.empty_like(s[name]))
                 for name in ("master", "exp_avg", "exp_avg_sq")}
            o["weights"] = s.get("weights") if in_place and "weights" in s else \
                torch.empty(n, dtype=BF16 if master_dt == "rem" else w_dt)
            outs.append(o)
            for a, b in zip(cuts, cuts[1:]):
                segs.append(hk.Segment(
                    g[a:b], s["master"][a:b], s["exp_avg"][a:b], s["exp_avg_sq"][a:b],
                    weights=s["weights"][a:b] if "weights" in s else None,
                    master_out=o["master"][a:b], exp_avg_out=o["exp_avg"][a:b],
                    exp_avg_sq_out=o["exp_avg_sq"][a:b], weights_out=o["weights"][a:b],
                    vector=hk.vector_count(n, a, b), piece=index,
                    decay=pieces[index]["decay"]))
        scales = hk.adamw_update(segs, clip=clip, scales=scales, threads=threads, **hyper)
        for index, (piece, o) in enumerate(zip(pieces, outs)):
            where = f"step {step}, piece {index}"
            _same(o["weights"], piece["weights"], f"{where}: weights")
            if master_dt == "rem":
                _same(o["master"], split_master_rem(piece["master"]), f"{where}: remainders")
            elif master_dt == F16:
                _same(o["master"], piece["q_master"], f"{where}: fp16 master")
                assert scales["master"][index] == pytest.approx(piece["m_master"], nan_ok=True)
            else:
                _same(o["master"], piece["master"], f"{where}: master")
            _same(o["exp_avg"], piece["m"][0].view(_torch_dtype(m_dt)), f"{where}: exp_avg")
            _same(o["exp_avg_sq"], piece["v"][0].view(_torch_dtype(v_dt)),
                  f"{where}: exp_avg_sq")
            for name, key, dt in (("exp_avg", "m", m_dt), ("exp_avg_sq", "v", v_dt)):
                if dt in (F16, "fp8"):
                    assert _bits(torch.tensor([scales[name][index]], dtype=F32)).item() == \
                        _bits(torch.tensor([piece[key][1]], dtype=F32)).item(), \
                        f"{where}: {name}'s multiplier"
        for s, o in zip(stored, outs):   # the next step reads what this one wrote
            s.update({name: o[name] for name in ("master", "exp_avg", "exp_avg_sq")})
            if "weights" in s:
                s["weights"] = o["weights"]


def split_master_hi(master: torch.Tensor) -> torch.Tensor:
    hi = torch.empty(master.numel(), dtype=BF16)
    split_master(master, hi, torch.empty(master.numel(), dtype=torch.int16))
    return hi


def split_master_rem(master: torch.Tensor) -> torch.Tensor:
    rem = torch.empty(master.numel(), dtype=torch.int16)
    split_master(master, torch.empty(master.numel(), dtype=BF16), rem)
    return rem


# --- the stores at every midpoint -------------------------------------------------------
def _midpoints(values: torch.Tensor) -> torch.Tensor:
    """Every finite value of a format, the midpoints between neighbours and a float either
    side of each midpoint, both signs (fp32)."""
    v = torch.unique(values[torch.isfinite(values)].abs()).to(torch.float64)
    mid = ((v[1:] + v[:-1]) / 2).to(F32)
    near = torch.cat([mid, torch.nextafter(mid, torch.tensor(0.0)),
                      torch.nextafter(mid, torch.tensor(float("inf"))), v.to(F32)])
    return torch.cat([near, -near])


@pytest.mark.parametrize("dtype", [BF16, F16, "fp8"])
def test_stores_round_as_torchs_casts(level, dtype):
    """beta1 = 0 makes the new exp_avg the gradient itself; with the largest value at the
    format's range the fp16 and fp8 scale is exactly 1, so the stored exp_avg is the cast of
    the gradient: at every midpoint of the format it rounds as torch's cast does."""
    if dtype == BF16:
        grid = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(BF16)
        g = _midpoints(grid.to(F32))
    elif dtype == F16:
        grid = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(F16)
        g = _midpoints(grid.to(F32))
        g = torch.cat([g[g.abs() < RANGE[F16]], torch.tensor([RANGE[F16]])])
    else:
        g = _midpoints(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F32))
        g = torch.cat([g[g.abs() < 448.0], torch.tensor([448.0])])
    n = g.numel()
    m = torch.zeros(n, dtype=_torch_dtype(dtype))
    seg = hk.Segment(g, torch.zeros(n), m, torch.zeros(n))
    scales = {"exp_avg": [1.0]} if dtype in (F16, "fp8") else None
    out = hk.adamw_update([seg], lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0,
                          step=1, scales=scales)
    want = g.to(torch.float8_e4m3fn).view(torch.uint8) if dtype == "fp8" else g.to(dtype)
    _same(m, want, f"{dtype} store")
    if scales:
        assert out["exp_avg"] == [1.0]


# --- the fp32-moments question: one kernel, one rounding ---------------------------------
def test_te_rounding_gives_fp32_masters_the_weights_of_remainders(level):
    """Five steps: fp32 masters with weights_rounding="te" and int16 remainders give the
    same masters, moments and bf16 weights, bit for bit. With "even" (torch's cast, what
    the fp32 path does today) the weights differ exactly where a master is a tie."""
    gen = torch.Generator().manual_seed(3)
    n = 20011
    master = _values(n, gen, 1.0)
    master.view(torch.int32)[::97] &= ~0xFFFF    # ties: exactly halfway between two bf16
    master.view(torch.int32)[::97] |= 0x8000
    hi, rem = split_master_hi(master), split_master_rem(master)
    fp32 = [master.clone(), torch.zeros(n), torch.zeros(n)]
    rems = [rem, torch.zeros(n), torch.zeros(n)]
    w32, w16, even = torch.empty(n, dtype=BF16), hi, torch.empty(n, dtype=BF16)
    ties = 0
    for step in range(1, 6):
        g = _values(n, gen, 1e-2)
        before = fp32[0].clone()
        hk.adamw_update([hk.Segment(g, *fp32, weights_out=w32)], weights_rounding="te",
                        step=step, **{k: v for k, v in HYPERS[0].items() if k != "step"})
        hk.adamw_update([hk.Segment(g, *rems, weights=w16)], step=step,
                        **{k: v for k, v in HYPERS[0].items() if k != "step"})
        _same(w32, w16, f"step {step}: weights")
        _same(split_master_rem(fp32[0]), rems[0], f"step {step}: remainders")
        _same(fp32[1], rems[1], f"step {step}: exp_avg")
        _same(fp32[2], rems[2], f"step {step}: exp_avg_sq")
        # the same update with torch's cast of the weights
        state = [before, *(t.clone() for t in fp32[1:])]
        hk.adamw_update([hk.Segment(g, before, torch.zeros(n), torch.zeros(n),
                                    master_out=state[0], weights_out=even)],
                        step=1, weights_rounding="even", lr=0.0, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0)   # lr 0: the weights of `before`
        tie = (_bits(before) & 0xFFFF) == 0x8000
        differ = _bits(even) != _bits(split_master_hi(before))
        assert torch.equal(differ, tie & ((_bits(before) >> 16) & 1 == 0)), \
            "the two roundings differ exactly at ties whose high half is even"
        ties += int(differ.sum())
    assert ties > 0


# --- torch's default build ---------------------------------------------------------------
_DEFAULT_BUILD = r"""
import torch
from megatron_snake.optim import host_kernel as hk
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
g = torch.Generator().manual_seed(0)
for wd in (0.1, 0.0):
    n = 1003
    p, gr = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5
    want = [t.clone() for t in (p, gr, m, v)]
    torch._fused_adamw_(*[[t] for t in want], [], [torch.tensor(4.0)], lr=1e-3, beta1=0.8,
                        beta2=0.99, weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False)
    seg = hk.Segment(gr, p, m, v)
    hk.adamw_update([seg], lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=wd, step=4)
    for x, y in zip((p, m, v), (want[0], want[2], want[3])):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
print(hk.implementation())
"""


def test_torchs_default_build_fuses_nothing():
    """Under ATEN_CPU_CAPABILITY=default torch's kernel is plain C++ without FMA: the
    native kernel follows it there too (and says it runs)."""
    if hk._native is None:
        pytest.skip("the native kernel is not built")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.pop(hk.ENV, None)
    out = subprocess.run([sys.executable, "-c", _DEFAULT_BUILD], env=env, cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("native ("), out.stdout


# --- choosing, refusing, the bound --------------------------------------------------------
def test_forcing_a_level(monkeypatch):
    monkeypatch.setenv(hk.ENV, "sse9")
    hk.reset()
    with pytest.raises(ValueError, match="one of generic, avx2, avx512, torch"):
        hk.implementation()
    monkeypatch.setenv(hk.ENV, "torch")
    hk.reset()
    assert hk.implementation() == f"torch ({hk.ENV}=torch)"
    if hk._native is not None:
        for isa, name in enumerate(hk.ISAS):
            monkeypatch.setenv(hk.ENV, name)
            hk.reset()
            if hk._native.isa_supported(isa):
                assert hk.implementation() == f"native ({name})"
            else:
                with pytest.raises(ValueError, match=f"this CPU lacks {name}"):
                    hk.implementation()
    monkeypatch.delenv(hk.ENV)
    hk.reset()
    assert hk.implementation().startswith("native (" if hk._native else "torch (")
    hk.reset()


def test_bad_calls_are_refused():
    n = 10
    f = torch.zeros(n)
    with pytest.raises(ValueError, match="remainders need the bf16 working weights"):
        hk.adamw_update([hk.Segment(f, torch.zeros(n, dtype=torch.int16), f.clone(),
                                    f.clone())], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="every segment's dtype"):
        hk.adamw_update([hk.Segment(f, f.clone(), f.clone(), f.clone()),
                         hk.Segment(f, f.clone(), f.clone().to(BF16), f.clone())],
                        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="needs a multiplier"):
        hk.adamw_update([hk.Segment(f, f.clone(), f.clone().to(F16), f.clone(), piece=1)],
                        scales={"exp_avg": [1.0]}, lr=1e-3, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0, step=1)
    if hk._native is not None:   # the binding checks what the wrapper does not
        with pytest.raises(ValueError, match="bad arguments"):
            hk._native.step(0, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0, step=1.0)
        with pytest.raises(TypeError, match="required"):
            hk._native.step(0, 0)


def test_the_bound_moves_the_same_bytes():
    if hk._native is None:
        pytest.skip("the native kernel is not built")
    n = 10007
    g, p, m, v = (torch.randn(n) for _ in range(4))
    w = torch.empty(n, dtype=torch.int16)
    want_p, want_m, want_v = p + g, m + g, v + g
    for isa in range(3):
        if hk._native.isa_supported(isa):
            pp, mm, vv = p.clone(), m.clone(), v.clone()
            hk._native.bound(g.data_ptr(), pp.data_ptr(), mm.data_ptr(), vv.data_ptr(),
                             w.data_ptr(), n, threads=2, isa=isa)
            assert torch.equal(pp, want_p) and torch.equal(mm, want_m) and torch.equal(vv, want_v)
            assert torch.equal(w, (pp.view(torch.int32) >> 16).to(torch.int16))


def test_the_host_update_benchmark_runs_every_variant(tmp_path):
    """tools/bench_host_update.py on a small part, every precision mode: each variant timed,
    each ratio a positive rate (it calls the kernel's entry points as the update does)."""
    if hk.implementation().startswith("torch"):
        pytest.skip(f"the update runs {hk.implementation()}")
    import importlib.util
    import json
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                        "bench_host_update.py")
    spec = importlib.util.spec_from_file_location("bench_host_update", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "out.json"
    assert bench.main(["--params", "4099", "--rounds", "1", "--json-out", str(out),
                       "--modes", *bench.PRECISION_MODES]) == 0
    result = json.loads(out.read_text())
    assert len(result["variants"]) == 3 + 2 * len(bench.PRECISION_MODES)
    assert len(result["ratios"]) == 2 + len(bench.PRECISION_MODES)
    assert all(r > 0 for r in result["ratios"].values())
