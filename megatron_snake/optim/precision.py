"""Megatron-Core's precision-aware optimizer for the offloaded AdamW: the dtype each state is
stored and moved in, and the rules that round a state to it and back.

Megatron-LM's flags (``megatron/training/arguments.py`` of core_v0.16.1) and Megatron-Core's
``OptimizerConfig`` (``megatron/core/optimizer/optimizer_config.py``, 0.16.1):

==================================  ==================================  =======
flag                                choices                             default
==================================  ==================================  =======
``--use-precision-aware-optimizer``  (on / off)                          off
``--main-params-dtype``             fp32, fp16                          fp32
``--main-grads-dtype``              fp32, bf16                          fp32
``--exp-avg-dtype``                 fp32, fp16, bf16, fp8               fp32
``--exp-avg-sq-dtype``              fp32, fp16, bf16, fp8               fp32
==================================  ==================================  =======

Megatron-LM maps the names with ``dtype_map`` (fp32 float32, bf16 bfloat16, fp16 float16,
fp8 uint8), and ``OptimizerConfig`` refuses any of them other than fp32 without
``use_precision_aware_optimizer``. ``store_param_remainders`` has no flag in Megatron-LM:
``OptimizerConfig`` defaults it to True, and Transformer Engine applies it only to bf16
parameters with fp32 master weights (``FusedAdam.__init__``: "Works only when param type is
BF16 and master weight type is FP32"). So under ``--bf16`` with ``--main-params-dtype fp32``
the master weights are stored as 16-bit remainders.

**Remainders (exact).** Transformer Engine's ``multi_tensor_adam_param_remainder`` kernel
(``transformer_engine/common/multi_tensor/adam.cu``, ``AdamFunctorMasterParamRemainder``)
views the fp32 master as two int16 halves (little-endian: ``int16[1]`` the high half,
``int16[0]`` the low half). Split: the bf16 weight is the high half, plus one when the low
half is negative as an int16 (its top bit is set: the dropped part is at least half a bf16
unit, "Round up"), and the remainder is the low half. Join: the high half is the bf16 weight,
minus one when the remainder is negative ("Undo rounding"), and the low half is the
remainder. The two are inverse bit for bit, so the master is exact; the bf16 weight is the
master rounded to nearest with ties away from zero, which differs from torch's round to
nearest even only where the master lies exactly halfway between two bf16 values.

**Moments and fp16 masters (approximate).** Transformer Engine's ``FusedAdam``
(``transformer_engine/pytorch/optimizers/fused_adam.py``: ``_apply_scale``,
``get_unscaled_state``) computes in fp32 and rounds a state to its dtype per tensor after
each step: bf16 by a plain cast (round to nearest even, no scale); fp16 with a scale
``absmax / (65504 / 2)``: stored ``fp16(x * (1 / scale))`` (``1 / scale`` is 0 when the scale
is 0), read back as ``float(stored) * scale``; fp8 (E4M3) with ``scale = absmax / 448``:
stored ``e4m3(x * (1 / scale))`` (saturating), read back as ``float(stored) * (1 / (1 /
scale))``. Transformer Engine's "tensor" is a parameter (a rank's shard of it under the
distributed optimizer); here it is a parameter's piece in one record (a rank's shard, cut
where ``--snake-alpha`` splits the update): the update of one part of a layout runs apart
from the other's, so a scale spans what one update sees. Where a piece is all zero, an fp8
scale is 0 and Transformer Engine would multiply by 1 / 0; here the piece is stored as zeros.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from megatron_snake.errors import FlagError

# Megatron-LM's dtype_map (megatron/training/arguments.py, validate_args)
DTYPE_MAP = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "fp8": torch.uint8}
NAMES = {dtype: name for name, dtype in DTYPE_MAP.items()}
# Megatron-LM's flags: the attribute, the flag, its choices (default fp32)
FLAGS = {"main_params_dtype": ("--main-params-dtype", ("fp32", "fp16")),
         "main_grads_dtype": ("--main-grads-dtype", ("fp32", "bf16")),
         "exp_avg_dtype": ("--exp-avg-dtype", ("fp32", "fp16", "bf16", "fp8")),
         "exp_avg_sq_dtype": ("--exp-avg-sq-dtype", ("fp32", "fp16", "bf16", "fp8"))}
DEFAULT = "fp32"
USE_FLAG = "--use-precision-aware-optimizer"
REMAINDER = torch.int16            # the stored master under remainders
FP8 = torch.uint8                  # Megatron's name for fp8; the bytes are E4M3
E4M3 = torch.float8_e4m3fn
# Transformer Engine's dtype_to_range_map: the largest value a scaled state is stored at
SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, FP8: 448.0}
SCALED = tuple(SCALED_RANGE)


# the chunked update's rate over the fused fp32 AdamW's by its slowest stored dtype
# (tools/bench_optimizer_rate.py on one core of the CPU machine, 2026-11-26)
UPDATE_RATE_SHARE = {"remainders": 0.466, "bf16": 0.355, "fp16": 0.156, "fp8": 0.040}


def as_dtype(value) -> torch.dtype:
    """A dtype flag's value: Megatron-LM's name (this project's parser keeps it until
    ``validate_args``) or the torch dtype Megatron-LM's ``validate_args`` made of it."""
    return value if isinstance(value, torch.dtype) else DTYPE_MAP[value]


def dtype_name(dtype: torch.dtype) -> str:
    """The flag's name of a stored dtype (int16: the remainders)."""
    return "int16 remainders" if dtype == REMAINDER else NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class Precision:
    """The dtypes one offloaded AdamW stores: ``params`` the working weights (the training
    dtype), ``master`` float32, float16 or int16 (remainders), the moments float32,
    bfloat16, float16 or uint8 (fp8), ``grad`` float32 or bfloat16."""

    params: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32
    grad: torch.dtype = torch.float32

    def __post_init__(self):
        if self.master == REMAINDER and self.params != torch.bfloat16:
            raise ValueError("master-weight remainders need bf16 working weights")
        if self.master not in (torch.float32, torch.float16, REMAINDER):
            raise ValueError(f"master weights are stored in fp32, fp16 or as remainders, "
                             f"not {self.master}")
        for name in ("exp_avg", "exp_avg_sq"):
            if getattr(self, name) not in (torch.float32, torch.bfloat16, torch.float16, FP8):
                raise ValueError(f"{name} is stored in fp32, bf16, fp16 or fp8")
        if self.grad not in (torch.float32, torch.bfloat16):
            raise ValueError("gradients are stored in fp32 or bf16")

    @classmethod
    def from_args(cls, args) -> "Precision":
        """The dtypes ``args`` ask for (Megatron-LM's flags, validated by
        ``check_precision_args``), with Megatron-Core's default store_param_remainders."""
        params = getattr(args, "params_dtype", None) or (
            torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32)
        if not getattr(args, "use_precision_aware_optimizer", False):
            return cls(params=params)
        main = as_dtype(getattr(args, "main_params_dtype", DEFAULT))
        if main == torch.float32 and params == torch.bfloat16:
            main = REMAINDER                                 # store_param_remainders
        return cls(params=params, master=main,
                   exp_avg=as_dtype(getattr(args, "exp_avg_dtype", DEFAULT)),
                   exp_avg_sq=as_dtype(getattr(args, "exp_avg_sq_dtype", DEFAULT)),
                   grad=as_dtype(getattr(args, "main_grads_dtype", DEFAULT)))

    # --- what it is ----------------------------------------------------------------------
    @property
    def remainders(self) -> bool:
        return self.master == REMAINDER

    @property
    def fp32(self) -> bool:
        """Every state and the gradient in fp32: today's fused update on the stored bytes."""
        return all(d == torch.float32 for d in (self.master, self.exp_avg, self.exp_avg_sq,
                                                self.grad))

    @property
    def speculable(self) -> bool:
        """Whether an update may be speculated (``OffloadedAdamW``'s ``speculate``): its
        working weights, published before the step's verdict, can be put back as they were
        from the stored master (fp32: a cast of it; remainders: their record is kept apart
        until the verdict). An fp16 master is stored scaled, so the weights the update
        published from its fp32 result cannot be."""
        return self.master != torch.float16

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of a state ("master", "exp_avg", "exp_avg_sq") or "grad"."""
        return getattr(self, name)

    def nbytes(self, name: str) -> int:
        """Bytes per element of a stored state or of the gradient."""
        return torch.tensor([], dtype=self.dtype(name)).element_size()

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the master weights and both moments (12 in fp32)."""
        return sum(self.nbytes(n) for n in ("master", "exp_avg", "exp_avg_sq"))

    @property
    def grad_bytes(self) -> int:
        return self.nbytes("grad")

    def checkpoint_dtype(self, name: str) -> torch.dtype:
        """The dtype a checkpoint holds a state in, as Megatron-Core's distributed optimizer
        writes it (``get_unscaled_state``): the moments and an fp16 master unscaled to
        fp32, the master's int16 remainders as they are, the weights in their dtype."""
        if name == "weights":
            return self.params
        return REMAINDER if name == "master" and self.remainders else torch.float32

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes per parameter of a checkpoint's optimizer state (master and moments)."""
        return sum(torch.tensor([], dtype=self.checkpoint_dtype(n)).element_size()
                   for n in ("master", "exp_avg", "exp_avg_sq"))

    @property
    def update_rate_share(self) -> float:
        """The update's rate against the fused fp32 AdamW, for the cost model: 1 when every
        state is fp32 (the fused kernel on the stored bytes), else the chunked update's
        share for its slowest stored dtype, measured on one core of the CPU machine
        (tools/bench_optimizer_rate.py, docs/benchmarks.md, 2026-11-26)."""
        if self.fp32:
            return 1.0
        dtypes = (self.master, self.exp_avg, self.exp_avg_sq)
        if FP8 in dtypes:
            return UPDATE_RATE_SHARE["fp8"]
        if torch.float16 in dtypes:
            return UPDATE_RATE_SHARE["fp16"]
        if torch.bfloat16 in dtypes:
            return UPDATE_RATE_SHARE["bf16"]
        return UPDATE_RATE_SHARE["remainders"]

    def approximate(self) -> list[str]:
        """The states stored approximately, in words (empty: exact)."""
        out = [f"{flag} {NAMES[getattr(self, attr)]}"
               for attr, flag in (("exp_avg", "--exp-avg-dtype"),
                                  ("exp_avg_sq", "--exp-avg-sq-dtype"),
                                  ("grad", "--main-grads-dtype"))
               if getattr(self, attr) != torch.float32]
        if self.master == torch.float16:
            out.insert(0, "--main-params-dtype fp16")
        return out

    def summary(self) -> str:
        """The start line: the dtypes, their bytes, and what is exact or approximate."""
        states = (f"master weights {dtype_name(self.master)}, exp_avg "
                  f"{dtype_name(self.exp_avg)}, exp_avg_sq {dtype_name(self.exp_avg_sq)}, "
                  f"gradients {dtype_name(self.grad)}")
        if self.remainders:
            states += " (bf16 weight + 16-bit remainder = the fp32 master, bit for bit: exact)"
        approx = self.approximate()
        verdict = ("APPROXIMATE: " + ", ".join(approx) + " are rounded after each update "
                   "with Transformer Engine's FusedAdam rule (docs/precision.md)") \
            if approx else "exact"
        return (f"> precision-aware optimizer: {states}; {self.state_bytes} B of optimizer "
                f"state and {self.grad_bytes} B of gradient per parameter (fp32: 12 and 4); "
                f"{verdict}")


def check_precision_args(args) -> None:
    """Megatron-Core's rule (``OptimizerConfig.__post_init__``): without
    --use-precision-aware-optimizer every dtype is fp32; and what the offloaded AdamW needs of
    the training dtype: --main-grads-dtype bf16 is Megatron-LM's with --bf16 only (it turns
    fp32 accumulation off there, and nothing elsewhere), and an fp16 master needs 16-bit
    working weights. Raises FlagError naming the flag."""
    for attr, (flag, choices) in FLAGS.items():
        value = getattr(args, attr, DEFAULT)
        name = value if isinstance(value, str) else NAMES.get(value)
        if name not in choices:
            raise FlagError(f"{flag}: {value!r} is not one of {', '.join(choices)}")
        if name != DEFAULT and not getattr(args, "use_precision_aware_optimizer", False):
            raise FlagError(f"{flag} {name} needs {USE_FLAG} (Megatron-Core keeps every "
                            f"optimizer state in fp32 without it); add it or drop {flag}")
    grads = as_dtype(getattr(args, "main_grads_dtype", DEFAULT))
    if grads != torch.float32 and not args.bf16:
        raise FlagError("--main-grads-dtype bf16 applies to --bf16 training (Megatron-LM "
                        "keeps bf16 gradients only there); add --bf16 or drop the flag")
    main = as_dtype(getattr(args, "main_params_dtype", DEFAULT))
    if main != torch.float32 and not (args.bf16 or args.fp16):
        raise FlagError("--main-params-dtype fp16: with fp32 training the working weights "
                        "are fp32 and there is no separate master to store in fp16; add "
                        "--bf16 or --fp16, or drop the flag")


def map_precision_args(args) -> None:
    """Megatron-LM's ``validate_args`` step: the dtype flags' names become torch dtypes."""
    for attr in FLAGS:
        setattr(args, attr, as_dtype(getattr(args, attr, DEFAULT)))


# --- the remainders: Transformer Engine's split, bit for bit ----------------------------
# As int32 bit patterns (two's complement, wrapping), with h the high and l the low 16 bits
# of an fp32 master m and r = l as an int16 (sign-extended): the kernel's bf16 weight is
# h + (r < 0), i.e. (m + 0x8000) >> 16 (the carry out of the low half is the round-up), and
# joining is h' * 65536 + (l & 0xFFFF) with h' = hi - (r < 0), i.e. hi * 65536 + r.
_HALF = 1 << 15
_HIGH = 1 << 16


def _check_endianness() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("master-weight remainders assume a little-endian machine, as "
                           "Transformer Engine's kernel does")


def split_master(master: torch.Tensor, hi_out: torch.Tensor, rem_out: torch.Tensor,
                 scratch: torch.Tensor | None = None) -> None:
    """fp32 ``master`` (contiguous 1-D) -> bf16 ``hi_out`` and int16 ``rem_out``: the high
    half, rounded up when the low half is negative as an int16, and the low half
    (``AdamFunctorMasterParamRemainder``'s "Split into BF16 params ... and remainders").
    ``scratch``: an int32 buffer of the same length, else one is made."""
    _check_endianness()
    bits = master.view(torch.int32)
    rem_out.copy_(bits)                            # the low 16 bits (int32 -> int16 wraps)
    tmp = torch.empty_like(bits) if scratch is None else scratch
    torch.add(bits, _HALF, out=tmp)
    torch.bitwise_right_shift(tmp, 16, out=tmp)
    hi_out.view(torch.int16).copy_(tmp)


def join_master(hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor,
                scratch: torch.Tensor | None = None) -> None:
    """bf16 ``hi`` and int16 ``rem`` -> fp32 ``out`` (contiguous 1-D): ``split_master``
    undone (the kernel's "Reconstruct FP32 params"). ``scratch``: unused (the same
    signature as ``split_master``)."""
    _check_endianness()
    out.copy_(hi)                         # bf16 -> fp32 is the bits shifted up: hi * 65536
    out.view(torch.int32).add_(rem)       # + r, wrapping


def split_flat(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 working weights, int16 remainders) of an fp32 master, new tensors."""
    master = master.detach().reshape(-1).to(torch.float32).contiguous()
    hi = torch.empty(master.numel(), dtype=torch.bfloat16, device=master.device)
    rem = torch.empty(master.numel(), dtype=REMAINDER, device=master.device)
    split_master(master, hi, rem)
    return hi, rem


def join_flat(hi: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 master of bf16 working weights and their int16 remainders, a new tensor."""
    out = torch.empty(rem.numel(), dtype=torch.float32, device=rem.device)
    join_master(hi.reshape(-1).contiguous(), rem.reshape(-1).contiguous(), out)
    return out


# --- rounding a state to its dtype and back: Transformer Engine's FusedAdam rule --------
def absmax(x: torch.Tensor) -> torch.Tensor:
    """``max(-min, max)`` in fp32 (``_apply_scale``'s ``torch.aminmax``); 0 when empty."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).to(torch.float32)


def scale_for(dtype: torch.dtype, amax: torch.Tensor) -> torch.Tensor:
    """A scaled dtype's fp32 scale for a tensor whose largest magnitude is ``amax``:
    ``amax / range`` (``torch.div(absmax, max_range, out=scale)``)."""
    return amax / torch.tensor(SCALED_RANGE[dtype], dtype=torch.float32)


def quantize(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor,
             scale: torch.Tensor | None = None) -> float:
    """Round fp32 ``x`` (a scratch tensor: scaled dtypes change it) into ``out`` of the
    stored ``dtype`` (uint8 holds fp8's E4M3 bytes). ``scale``: a scaled dtype's, when the
    caller took the absmax over more than ``x`` (a piece computed in chunks). Returns the
    multiplier ``dequantize`` reads it back with (1.0 for unscaled dtypes)."""
    if dtype in (torch.float32, torch.bfloat16):
        out.copy_(x)                       # torch's cast: round to nearest even
        return 1.0
    if scale is None:
        scale = scale_for(dtype, absmax(x))
    if dtype == torch.float16:
        rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), dtype=torch.float32))
        x.mul_(rscale)
        out.copy_(x)
        return float(scale)
    # fp8: the quantizer's scale is 1 / scale, the reader's scale_inv its reciprocal
    if not float(scale) > 0:
        if float(scale) == 0:              # an all-zero piece (TE would divide by zero)
            out.zero_()
            return 0.0
        out.view(E4M3).copy_(x * scale)    # NaN in, NaN out, as in Transformer Engine
        return float("nan")
    qscale = torch.ones((), dtype=torch.float32) / scale
    x.mul_(qscale)
    x.clamp_(-448.0, 448.0)                # __NV_SATFINITE
    out.view(E4M3).copy_(x)
    return float(torch.ones((), dtype=torch.float32) / qscale)


def dequantize(q: torch.Tensor, dtype: torch.dtype, multiplier: float,
               out: torch.Tensor) -> None:
    """The fp32 values of a stored state (``get_unscaled_state``) into ``out``."""
    if dtype == FP8:
        out.copy_(q.view(E4M3))
    else:
        out.copy_(q)
    if dtype in SCALED:
        out.mul_(torch.tensor(multiplier, dtype=torch.float32))


def is_finite_scale(multiplier: float) -> bool:
    return math.isfinite(multiplier)
