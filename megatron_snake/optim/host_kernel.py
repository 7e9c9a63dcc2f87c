"""The host update of the offloaded AdamW in one pass: the gradient's clip, AdamW with
decoupled weight decay, and the new master, moments and working weights, each in its stored
dtype, in one read and one write of each element.

Two implementations give the same bits:

- **native**: ``csrc/adamw.c`` (module ``megatron_snake._snake_adamw``, built by setup.py),
  AVX-512, AVX2 or generic C chosen at run time, on its own threads with the GIL released;
- **torch**: torch's kernels, the passes the native one replaces (``grad.mul_(clip)``,
  ``torch._fused_adamw_``, the casts and Transformer Engine's roundings of
  ``optim/precision.py``), used when the module is not built, when torch's CPU capability
  is one whose arithmetic the native kernel was not checked against, when the native kernel
  disagrees with ``torch._fused_adamw_`` on this machine (checked once, on a few hundred
  elements, at the first call), or when ``SNAKE_ADAMW_ISA=torch``.

``implementation()`` says which runs, for the start-up line. ``SNAKE_ADAMW_ISA`` (generic,
avx2, avx512, torch) forces one (for tests and benchmarks); a level the CPU lacks is refused.

**torch's bits.** torch's fused kernel runs a tensor in vector lanes (``lanes()``: 16 under
torch's AVX-512 capability, 8 under AVX2) from its first element, and its last (numel mod
lanes) elements on a scalar path that rounds differently. A ``Segment`` therefore says how
many of its leading elements torch would have run in lanes (``vector``; by default the
segment is a whole tensor to torch: ``numel - numel % lanes``). A parameter piece cut into
several segments (where host buffers end) gives each the count of its own elements that lie
before the piece's tail (``vector_count``), and no bridge is needed.

**Dtypes** (Megatron-Core's precision-aware optimizer, ``optim/precision.py``): gradient
fp32 or bf16; master fp32, fp16 (scaled) or int16 remainders (with the bf16 working weights
as ``Segment.weights``: Transformer Engine's split); moments fp32, bf16, fp16 or fp8 (uint8
or float8_e4m3fn bytes, E4M3; scaled); working weights none, bf16 or fp16. A scaled state is
stored per parameter piece (``Segment.piece``) with Transformer Engine's ``scale =
max(-min, max) / range`` of the piece's new values, so the update runs twice: once for the
min and max of each piece, once to write (both implementations; the fp32, bf16 and remainder
modes run once). That is TE's rule for every piece; the chunked update of
``offloaded_adamw`` takes a piece longer than one chunk as ``abs().max()``, which differs
only in the sign of an all-zero piece's scale (+0 there, -0 by TE's rule).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_snake.optim.precision import (E4M3, FP8, REMAINDER, SCALED, join_master,
                                            quantize, scale_for, split_master)

try:  # built by setup.py; absent when the build failed or was skipped
    from megatron_snake import _snake_adamw as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

ENV = "SNAKE_ADAMW_ISA"
ISAS = ("generic", "avx2", "avx512")
STATES = ("master", "exp_avg", "exp_avg_sq")
# torch's CPU capability -> (its float lanes, whether its kernel fuses multiply-adds)
CAPABILITIES = {"AVX512": (16, True), "AVX2": (8, True), "DEFAULT": (8, False)}
WEIGHTS_ROUNDING = ("even", "te")
CHUNK_ELEMENTS = 1 << 16    # the torch path's fp32 scratch batch (a multiple of lanes)


@dataclass
class Segment:
    """Elements contiguous in every stream (1-D contiguous CPU tensors of one length).
    The ``*_out`` tensors default to the inputs (in place); given, each is the input itself
    or memory overlapping no input (out of place: the old state is kept). ``weights``: the
    remainders' bf16 high halves, read (``weights_out`` defaults to them); else the new
    working weights go to ``weights_out`` when it is given. ``vector``: how many leading
    elements torch would run in lanes (default ``numel - numel % lanes()``). ``piece``: the
    parameter piece a scaled state's scale spans. ``decay``: weight decay applies."""

    grad: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    weights: torch.Tensor | None = None
    master_out: torch.Tensor | None = None
    exp_avg_out: torch.Tensor | None = None
    exp_avg_sq_out: torch.Tensor | None = None
    weights_out: torch.Tensor | None = None
    vector: int | None = None
    piece: int = 0
    decay: bool = True

    def __post_init__(self):
        if self.master_out is None:
            self.master_out = self.master
        if self.exp_avg_out is None:
            self.exp_avg_out = self.exp_avg
        if self.exp_avg_sq_out is None:
            self.exp_avg_sq_out = self.exp_avg_sq
        if self.weights is not None and self.weights_out is None:
            self.weights_out = self.weights

    @property
    def numel(self) -> int:
        return self.master.numel()


def stream_bytes(segments: list[Segment], scaled: bool = False) -> int:
    """Bytes of memory one call's streams hold: every input read once and every output
    written once (an in-place state both), the inputs twice where a scaled state makes the
    call run twice (its min and max first). The native kernel touches exactly these; torch's
    passes (the fallback) touch some again, which this does not count."""
    def nbytes(t):
        return t.numel() * t.element_size() if t is not None else 0
    reads = writes = 0
    for s in segments:
        reads += sum(nbytes(t) for t in (s.grad, s.master, s.exp_avg, s.exp_avg_sq, s.weights))
        writes += sum(nbytes(t) for t in (s.master_out, s.exp_avg_out, s.exp_avg_sq_out,
                                          s.weights_out))
    return reads * (2 if scaled else 1) + writes


def lanes() -> int:
    """torch's float lanes on this machine (its fused AdamW's Vec::size())."""
    return CAPABILITIES.get(torch.backends.cpu.get_cpu_capability(), (8, False))[0]


def vector_count(piece_numel: int, start: int, stop: int, lane_count: int | None = None) -> int:
    """``Segment.vector`` of the elements [start, stop) of one parameter piece of
    ``piece_numel`` elements that torch would run as one tensor."""
    n = lane_count or lanes()
    return max(0, min(piece_numel - piece_numel % n - start, stop - start))


# --- which implementation -------------------------------------------------------------
_chosen: tuple[str, int | None] | None = None   # (description, native isa or None)


def _native_isa_asked() -> int | None:
    """The level SNAKE_ADAMW_ISA asks for (None: the widest), or -1 for torch."""
    asked = os.environ.get(ENV, "").strip().lower()
    if not asked:
        return None
    if asked == "torch":
        return -1
    if asked not in ISAS:
        raise ValueError(f"{ENV}={asked!r}: one of {', '.join(ISAS + ('torch',))}")
    if _native is None:
        raise ValueError(f"{ENV}={asked}: the native kernel (megatron_snake._snake_adamw) "
                         f"is not built here")
    isa = ISAS.index(asked)
    if not _native.isa_supported(isa):
        raise ValueError(f"{ENV}={asked}: this CPU lacks {asked}")
    return isa


def implementation() -> str:
    """``native (avx512|avx2|generic)`` or ``torch (why)``: what ``adamw_update`` runs."""
    return _choose()[0]


def _choose() -> tuple[str, int | None]:
    global _chosen
    if _chosen is None:
        _chosen = _select()
    return _chosen


def reset() -> None:
    """Choose again at the next call (after changing SNAKE_ADAMW_ISA: tests)."""
    global _chosen
    _chosen = None


def _select() -> tuple[str, int | None]:
    isa = _native_isa_asked()
    if isa == -1:
        return f"torch ({ENV}=torch)", None
    if _native is None:
        return "torch (the native kernel megatron_snake._snake_adamw is not built)", None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITIES:
        return (f"torch (the native kernel is not checked against torch's {capability} "
                f"kernel)"), None
    isa = _native.best_isa() if isa is None else isa
    if not _agrees_with_torch(isa):
        return (f"torch (the native kernel ({ISAS[isa]}) disagrees with torch's fused AdamW "
                f"on this machine)"), None
    return f"native ({ISAS[isa]})", isa


def _agrees_with_torch(isa: int) -> bool:
    """The native kernel against torch._fused_adamw_ on a few hundred elements (both rules,
    with and without weight decay, bf16 weights): the same bits, or False."""
    g = torch.Generator().manual_seed(0)
    n = 4 * lanes() * 4 + lanes() - 1
    ok = True
    for wd in (0.1, 0.0):
        master = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g) * 1e-2
        m = torch.randn(n, generator=g) * 1e-3
        v = torch.rand(n, generator=g) * 1e-5
        want = [t.clone() for t in (master, grad, m, v)]
        torch._fused_adamw_([want[0]], [want[1]], [want[2]], [want[3]], [],
                            [torch.tensor(3.0)], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False)
        w = torch.empty(n, dtype=torch.bfloat16)
        seg = Segment(grad, master.clone(), m.clone(), v.clone(), weights_out=w)
        _native_update([seg], isa, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=wd, step=3.0, clip=None, scales=None,
                       weights_rounding="even", threads=1)
        for x, y in ((seg.master, want[0]), (seg.exp_avg, want[2]),
                     (seg.exp_avg_sq, want[3]), (w, want[0].to(torch.bfloat16))):
            ok = ok and torch.equal(x.view(torch.int16 if x.element_size() == 2
                                           else torch.int32),
                                    y.view(torch.int16 if y.element_size() == 2
                                           else torch.int32))
    return ok


# --- the call ---------------------------------------------------------------------------
def adamw_update(segments: list[Segment], *, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, step, clip=None,
                 scales: dict | None = None, weights_rounding: str = "even",
                 threads: int = 1) -> dict:
    """One AdamW update of ``segments`` (all of one part: the same dtypes and step).

    ``step``: the step count (int, float or a 0-d tensor; torch reads it as fp32).
    ``clip``: Megatron's clip coefficient (a float or a 0-d tensor, applied as an fp32
    ``grad * clip``), or None for none. ``weight_decay`` applies to the segments with
    ``decay``. ``scales``: for each scaled state (fp16 master, fp16 or fp8 moments), the
    multiplier of each piece its stored values are read back with (``precision.dequantize``);
    returns the new ones (a dict, empty when no state is scaled). ``weights_rounding``: the
    bf16 working weights of an fp32 master, "even" (torch's cast, as Megatron copies its
    fp32 masters into bf16 parameters) or "te" (Transformer Engine's remainder split: ties
    away from zero, what remainders give). ``threads``: the native kernel's; the torch path
    runs on the calling thread's torch threads. The gradient may be scaled in place by the
    torch path (as today's update does); the native kernel only reads it."""
    if weights_rounding not in WEIGHTS_ROUNDING:
        raise ValueError(f"weights_rounding: one of {WEIGHTS_ROUNDING}")
    step = float(step)
    if clip is not None:   # fp32, as Megatron's clip_coeff
        clip = float(torch.as_tensor(clip, dtype=torch.float32))
    _check(segments, weights_rounding)
    _, isa = _choose()
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              step=step, clip=clip, scales=scales, weights_rounding=weights_rounding)
    if isa is None:
        return _torch_update(segments, **kw)
    return _native_update(segments, isa, threads=threads, **kw)


def _state_dtype(t: torch.Tensor) -> torch.dtype:
    """The stored dtype in precision.py's names (fp8 is uint8 there)."""
    return FP8 if t.dtype in (torch.uint8, E4M3) else t.dtype


def _check(segments: list[Segment], weights_rounding: str) -> None:
    if not segments:
        return
    first = segments[0]
    dtypes = {name: _state_dtype(getattr(first, name)) for name in ("grad",) + STATES}
    with_weights = first.weights_out is not None
    if dtypes["grad"] not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the gradient is fp32 or bf16, not {dtypes['grad']}")
    if dtypes["master"] not in (torch.float32, torch.float16, REMAINDER):
        raise ValueError(f"the master is fp32, fp16 or int16 remainders, not "
                         f"{dtypes['master']}")
    for name in ("exp_avg", "exp_avg_sq"):
        if dtypes[name] not in (torch.float32, torch.bfloat16, torch.float16, FP8):
            raise ValueError(f"{name} is fp32, bf16, fp16 or fp8, not {dtypes[name]}")
    for seg in segments:
        n = seg.numel
        for name in ("grad",) + STATES:
            for t in (getattr(seg, name), getattr(seg, name + "_out", None)):
                if t is None:
                    continue
                if _state_dtype(t) != dtypes[name]:
                    raise ValueError(f"{name}: every segment's dtype must be "
                                     f"{dtypes[name]}")
                if not t.is_cpu or not t.is_contiguous() or t.numel() != n:
                    raise ValueError(f"{name}: contiguous CPU tensors of the segment's "
                                     f"{n} elements")
        if (seg.weights_out is not None) != with_weights:
            raise ValueError("weights_out: given for every segment or for none")
        if dtypes["master"] == REMAINDER and (
                seg.weights is None or seg.weights.dtype != torch.bfloat16):
            raise ValueError("int16 remainders need the bf16 working weights (weights)")
        for t in (seg.weights, seg.weights_out):
            if t is not None and (not t.is_cpu or not t.is_contiguous() or t.numel() != n):
                raise ValueError("weights: contiguous CPU tensors of the segment's length")
        if seg.weights_out is not None and seg.weights_out.dtype not in (torch.bfloat16,
                                                                          torch.float16):
            raise ValueError("the working weights are bf16 or fp16")
        if weights_rounding == "te" and seg.weights_out is not None and \
                seg.weights_out.dtype != torch.bfloat16:
            raise ValueError("weights_rounding 'te' is a rule for bf16 weights")


def _scaled_states(seg: Segment) -> list[str]:
    return [name for name in STATES if _state_dtype(getattr(seg, name)) in SCALED]


def _multipliers(dtype: torch.dtype, scale: torch.Tensor) -> list[float]:
    """What precision.quantize returns for each piece's scale: the multiplier its stored
    values are read back with."""
    if dtype == torch.float16:
        return scale.tolist()
    one = torch.ones_like(scale)
    inverse = one / (one / scale)
    out = torch.where(scale > 0, inverse, torch.where(scale == 0, torch.zeros_like(scale),
                                                       torch.full_like(scale, float("nan"))))
    return out.tolist()


def _absmax(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per piece, Transformer Engine's ``max(-min, max)`` (precision.absmax), 0 for a
    piece with no element (its min above its max)."""
    return torch.where(lo > hi, torch.zeros_like(lo), torch.maximum(-lo, hi))


def _piece_count(segments: list[Segment]) -> int:
    return max(seg.piece for seg in segments) + 1


def _scales_in(segments, scaled, scales) -> dict:
    pieces = _piece_count(segments)
    out = {}
    for name in scaled:
        values = (scales or {}).get(name)
        if values is None or len(values) < pieces:
            raise ValueError(f"{name} is scaled: scales[{name!r}] needs a multiplier for "
                             f"each of its {pieces} pieces")
        out[name] = torch.tensor(list(values)[:pieces], dtype=torch.float32)
    return out


# --- native -----------------------------------------------------------------------------
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", FP8: "E4M3",
          REMAINDER: "REM16"}


def _code(dtype) -> int:
    return _native.NONE if dtype is None else getattr(_native, _CODES[dtype])


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _native_update(segments, isa, *, lr, beta1, beta2, eps, weight_decay, step, clip,
                   scales, weights_rounding, threads) -> dict:
    if not segments:
        return {}
    first = segments[0]
    lane_count = lanes()
    fields = []   # adamw_segment's fields, in order (csrc/adamw.h)
    for seg in segments:
        n = seg.numel
        vector = n - n % lane_count if seg.vector is None else seg.vector
        fields += [_ptr(seg.grad), _ptr(seg.master), _ptr(seg.exp_avg), _ptr(seg.exp_avg_sq),
                   _ptr(seg.weights), _ptr(seg.master_out), _ptr(seg.exp_avg_out),
                   _ptr(seg.exp_avg_sq_out), _ptr(seg.weights_out), n, vector, seg.piece,
                   int(seg.decay)]
    rows = torch.tensor(fields, dtype=torch.int64)
    capability = torch.backends.cpu.get_cpu_capability()
    kw = dict(grad=_code(first.grad.dtype), master=_code(_state_dtype(first.master)),
              exp_avg=_code(_state_dtype(first.exp_avg)),
              exp_avg_sq=_code(_state_dtype(first.exp_avg_sq)),
              weights=_code(None if first.weights_out is None else first.weights_out.dtype),
              lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
              clip=clip,
              rules=_native.RULES_FMA if CAPABILITIES.get(capability, (8, True))[1]
              else _native.RULES_PLAIN,
              weights_round=_native.ROUND_TE if weights_rounding == "te"
              else _native.ROUND_EVEN,
              threads=threads, isa=isa)
    scaled = _scaled_states(first)
    if not scaled:
        _native.step(rows.data_ptr(), len(segments), **kw)
        return {}
    # a scaled state: the min and max of each piece's new values, then the update with the
    # scales they give
    pieces = _piece_count(segments)
    scale_in = _scales_in(segments, scaled, scales)
    minmax = {name: torch.empty((pieces, 2), dtype=torch.float32) for name in scaled}

    def addrs(tensors):
        return tuple(_ptr(tensors.get(name)) for name in STATES)

    _native.step(rows.data_ptr(), len(segments), mode=_native.MINMAX, pieces=pieces,
                 scale_in=addrs(scale_in), minmax=addrs(minmax), **kw)
    scale = {name: scale_for(_state_dtype(getattr(first, name)),
                             _absmax(minmax[name][:, 0], minmax[name][:, 1]))
             for name in scaled}
    _native.step(rows.data_ptr(), len(segments), mode=_native.WRITE, pieces=pieces,
                 scale_in=addrs(scale_in), scale_out=addrs(scale), **kw)
    return {name: _multipliers(_state_dtype(getattr(first, name)), scale[name])
            for name in scaled}


# --- torch ------------------------------------------------------------------------------
def _fused(tensors, hyper, decay: bool) -> None:
    """torch._fused_adamw_ on lists (master, grad, exp_avg, exp_avg_sq) of fp32 tensors."""
    masters, grads, exp_avgs, exp_avg_sqs = tensors
    if not masters:
        return
    torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [],
                        [torch.tensor(hyper["step"])] * len(masters), lr=hyper["lr"],
                        beta1=hyper["beta1"], beta2=hyper["beta2"],
                        weight_decay=hyper["weight_decay"] if decay else 0.0,
                        eps=hyper["eps"], amsgrad=False, maximize=False)


def _rule_runs(lo: int, hi: int, vector: int, lane_count: int):
    """[lo, hi) of a segment as torch tensors that give each element its rule: (a, b,
    padded). Elements before ``vector`` in lanes: a run of whole lanes, then the rest padded
    to a whole lane; the others as runs shorter than a lane (all scalar tail to torch)."""
    split = min(max(vector, lo), hi)
    whole = lo + (split - lo) // lane_count * lane_count
    runs = [(lo, whole, False)] if whole > lo else []
    if split > whole:
        runs.append((whole, split, True))
    runs += [(a, min(hi, a + lane_count - 1), False) for a in range(split, hi, lane_count - 1)]
    return runs


def _run_rules(views: list[torch.Tensor], lo: int, hi: int, vector: int, hyper,
               decay: bool) -> None:
    """torch's fused AdamW on ``views`` (master, grad, exp_avg, exp_avg_sq: fp32 tensors
    holding elements [lo, hi) of a segment), each element by its rule."""
    lane_count = lanes()
    tensors, padded = ([], [], [], []), []
    for a, b, pad in _rule_runs(lo, hi, vector, lane_count):
        parts = [x[a - lo:b - lo] for x in views]
        if pad:   # a lane's worth, zero beyond the run: torch runs it in lanes
            lane = [torch.zeros(lane_count, dtype=torch.float32) for _ in views]
            for dst, src in zip(lane, parts):
                dst[:b - a].copy_(src)
            padded.append((lane, parts, b - a))
            parts = lane
        for out, part in zip(tensors, parts):
            out.append(part)
    _fused(tensors, hyper, decay)
    for lane, parts, n in padded:
        for dst, src in zip(parts, lane):
            dst.copy_(src[:n])


def _te_high(master: torch.Tensor, out: torch.Tensor) -> None:
    """The bf16 weights by Transformer Engine's split (ties away from zero)."""
    bits = master.view(torch.int32) + (1 << 15)
    out.view(torch.int16).copy_(torch.bitwise_right_shift(bits, 16))


def _write_weights(p: torch.Tensor, out: torch.Tensor | None, weights_rounding: str) -> None:
    if out is None:
        return
    if weights_rounding == "te":
        _te_high(p, out)
    else:
        out.copy_(p)


def _in_place_fp32(seg: Segment) -> bool:
    return all(getattr(seg, name).dtype == torch.float32
               and getattr(seg, name + "_out").data_ptr() == getattr(seg, name).data_ptr()
               for name in STATES) and seg.grad.dtype == torch.float32


def _torch_update(segments, *, lr, beta1, beta2, eps, weight_decay, step, clip, scales,
                  weights_rounding) -> dict:
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 step=step)
    clip_t = None if clip is None else torch.tensor(clip, dtype=torch.float32)
    lane_count = lanes()
    if not segments:
        return {}
    scaled = _scaled_states(segments[0])
    if not scaled and all(_in_place_fp32(seg) for seg in segments):
        # today's passes: the clip, the fused kernel in place, the weights' cast
        for seg in segments:
            n = seg.numel
            vector = n - n % lane_count if seg.vector is None else seg.vector
            if clip_t is not None:
                seg.grad.mul_(clip_t)
            _run_rules([seg.master, seg.grad, seg.exp_avg, seg.exp_avg_sq], 0, n, vector,
                       hyper, seg.decay)
            _write_weights(seg.master, seg.weights_out, weights_rounding)
        return {}
    # any other mode: chunks loaded into fp32, updated, rounded back
    scale_in = _scales_in(segments, scaled, scales) if scaled else {}
    scale_out = None
    if scaled:   # a first pass for each piece's min and max
        pieces = _piece_count(segments)
        lows = {name: torch.full((pieces,), float("inf")) for name in scaled}
        highs = {name: torch.full((pieces,), -float("inf")) for name in scaled}
        for seg, lo, hi, new in _torch_chunks(segments, hyper, clip_t, scale_in):
            for name, x in zip(STATES, new):
                if name in scaled and x.numel():
                    low, high = torch.aminmax(x)
                    lows[name][seg.piece] = torch.minimum(lows[name][seg.piece], low)
                    highs[name][seg.piece] = torch.maximum(highs[name][seg.piece], high)
        scale_out = {name: scale_for(_state_dtype(getattr(segments[0], name)),
                                     _absmax(lows[name], highs[name]))
                     for name in scaled}
    for seg, lo, hi, new in _torch_chunks(segments, hyper, clip_t, scale_in):
        _torch_store(seg, lo, hi, new, scale_out, weights_rounding)
    return {name: _multipliers(_state_dtype(getattr(segments[0], name)), scale_out[name])
            for name in scaled}


def _torch_chunks(segments, hyper, clip_t, scale_in):
    """(segment, lo, hi, [new master, exp_avg, exp_avg_sq] in fp32) for each chunk of each
    segment; the inputs are only read."""
    lane_count = lanes()
    for seg in segments:
        n = seg.numel
        vector = n - n % lane_count if seg.vector is None else seg.vector
        for lo in range(0, n, CHUNK_ELEMENTS):
            hi = min(n, lo + CHUNK_ELEMENTS)
            g = seg.grad[lo:hi].to(torch.float32, copy=True)
            if clip_t is not None:
                g.mul_(clip_t)
            if _state_dtype(seg.master) == REMAINDER:
                p = torch.empty(hi - lo, dtype=torch.float32)
                join_master(seg.weights[lo:hi], seg.master[lo:hi], p)
            else:
                p = _load(seg.master[lo:hi], scale_in.get("master"), seg.piece)
            m = _load(seg.exp_avg[lo:hi], scale_in.get("exp_avg"), seg.piece)
            v = _load(seg.exp_avg_sq[lo:hi], scale_in.get("exp_avg_sq"), seg.piece)
            _run_rules([p, g, m, v], lo, hi, vector, hyper, seg.decay)
            yield seg, lo, hi, [p, m, v]


def _load(stored: torch.Tensor, scale: torch.Tensor | None, piece: int) -> torch.Tensor:
    """A stored state's fp32 values (precision.dequantize), a new tensor."""
    x = (stored.view(E4M3) if _state_dtype(stored) == FP8 else stored).to(torch.float32,
                                                                            copy=True)
    if scale is not None:
        x.mul_(scale[piece])
    return x


def _torch_store(seg: Segment, lo: int, hi: int, new, scale_out, weights_rounding) -> None:
    p, m, v = new
    if _state_dtype(seg.master) == REMAINDER:
        split_master(p, seg.weights_out[lo:hi], seg.master_out[lo:hi])
    else:   # the weights from the fp32 result, before a scaled master is rounded
        _write_weights(p, None if seg.weights_out is None else seg.weights_out[lo:hi],
                       weights_rounding)
    for name, x in zip(STATES, (p, m, v)):
        dtype = _state_dtype(getattr(seg, name))
        if dtype == REMAINDER:
            continue
        out = getattr(seg, name + "_out")[lo:hi]
        if dtype not in SCALED:
            out.copy_(x)
            continue
        target = out.view(torch.uint8) if dtype == FP8 else out
        quantize(x, dtype, target, scale_out[name][seg.piece])
