"""One part's update on the host: the clip, AdamW and the new working weights, on the state
the update borrowed from the store (``optim/update_worker.py`` lends it and takes it back).

The arithmetic is torch's fused AdamW kernel (the one ``torch.optim.AdamW(fused=True)``
runs) on views of the state's host buffers (no copy): one view per parameter and buffer. The
kernel is elementwise, but it rounds a tensor's last (numel mod its vector lanes) elements
on a scalar path, so where a buffer's edge cuts a parameter off its 16-element lines, those
elements are gathered into a small tensor of their own (a bridge), and every bit equals the
per-parameter reference (docs/design.md, invariant 1). Weight decay follows Megatron (none on
biases and 1-D parameters).

With Megatron-Core's precision-aware optimizer (``optim/precision.py``) each state is stored
in its own dtype; the update then loads a chunk of each state into fp32 scratch buffers,
runs the same fused AdamW kernel on them, parameter piece by parameter piece (cut at
16-element lines, so every bit is the kernel's on the whole piece), and rounds the results
back to their dtypes by Transformer Engine's rules. With every state in fp32 it runs on the
stored bytes in place.
"""

from __future__ import annotations

import bisect
import itertools
import time

import torch

import megatron_snake.timeline as timeline
from megatron_snake.optim.adamw import STATES, fused_adamw_
from megatron_snake.optim.parts import LANE_ELEMENTS, PartStates
from megatron_snake.optim.precision import (E4M3, FP8, REMAINDER, SCALED, join_master,
                                            quantize, scale_for, split_master)

# Elements per fp32 scratch batch of the chunked (precision-aware) update: a multiple of
# LANE_ELEMENTS, so a piece cut into chunks is rounded as the whole piece. 2^18 (four fp32
# buffers of 1 MiB) was the fastest of 2^16 to 2^21 on the CPU machine (tools/
# bench_optimizer_rate.py --chunk-elements): smaller batches pay each torch op's fixed cost
# more often, larger ones fall out of the cache.
CHUNK_ELEMENTS = 1 << 18


def _intervals(sizes: list[int], ranges: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The element ``ranges`` (start, stop, start of their parameter) of a concatenation of
    pieces of ``sizes``, cut where the pieces are; a cut off the parameter's 16-element
    lines becomes one interval from the line before it to the line after (a bridge)."""
    cuts = list(itertools.accumulate(sizes))[:-1]
    out = []
    for start, stop, origin in ranges:
        pos = start
        for cut in cuts:
            if not pos < cut < stop:
                continue
            off = (cut - origin) % LANE_ELEMENTS
            down, up = max(pos, cut - off), min(stop, cut - off + LANE_ELEMENTS)
            if off == 0:
                down = up = cut
            if pos < down:
                out.append((pos, down))
            if down < up:
                out.append((down, up))
            pos = max(pos, up)
        if pos < stop:
            out.append((pos, stop))
    return out


def _take(pieces: list[torch.Tensor], intervals: list[tuple[int, int]]):
    """(tensors, bridges): each interval of the concatenation of ``pieces`` as a view of
    one piece, or, across pieces, gathered into a new tensor; ``bridges`` lists those as
    (tensor, [(piece view, its slice of the tensor)]) for ``_return_bridges``."""
    starts = list(itertools.accumulate([0] + [p.numel() for p in pieces]))
    tensors, bridges = [], []
    for a, b in intervals:
        parts = [(p[max(a, s) - s:min(b, e) - s], slice(max(a, s) - a, min(b, e) - a))
                 for p, s, e in zip(pieces, starts, starts[1:]) if s < b and a < e]
        if len(parts) == 1:
            tensors.append(parts[0][0])
        else:
            bridge = torch.cat([view for view, _ in parts])
            tensors.append(bridge)
            bridges.append((bridge, parts))
    return tensors, bridges


def _return_bridges(bridges) -> None:
    for bridge, parts in bridges:
        for view, piece in parts:
            view.copy_(bridge[piece])


class _Flat:
    """Element access to a record lent as 1-D pieces (cut where its host buffers end: records
    of other dtypes are cut at other elements). fp8 records are uint8 bytes read as E4M3."""

    def __init__(self, pieces: list[torch.Tensor]):
        self.pieces = [p for p in pieces if p.numel()]
        self.starts = list(itertools.accumulate([0] + [p.numel() for p in self.pieces]))

    def spans(self, a: int, b: int):
        """(view of a piece, its offset from ``a``) covering elements [a, b)."""
        i = bisect.bisect_right(self.starts, a) - 1
        pos = a
        while pos < b:
            piece, start = self.pieces[i], self.starts[i]
            end = min(b, start + piece.numel())
            yield piece[pos - start:end - start], pos - a
            pos, i = end, i + 1

    def view(self, a: int, b: int) -> torch.Tensor | None:
        """Elements [a, b) as one view, when one piece holds them."""
        spans = list(self.spans(a, b))
        return spans[0][0] if len(spans) == 1 else None

    def read(self, a: int, b: int, out: torch.Tensor, fp8: bool = False) -> None:
        """Elements [a, b) into ``out``, converted to its dtype."""
        for view, off in self.spans(a, b):
            out[off:off + view.numel()].copy_(view.view(E4M3) if fp8 else view)

    def write(self, a: int, b: int, src: torch.Tensor) -> None:
        """``src`` (the record's dtype) into elements [a, b)."""
        for view, off in self.spans(a, b):
            view.copy_(src[off:off + view.numel()])


class HostUpdate:
    """The arithmetic of one part's update (``run``), for the parts of ``states``. Runs on
    the update worker only: its scratch buffers are that thread's."""

    def __init__(self, states: PartStates, *, beta1: float, beta2: float, eps: float):
        self.states, self.precision = states, states.precision
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self._scratch: dict | None = None   # the chunked update's fp32 buffers

    def run(self, key, part: str, hyper, clip_coef, lent: dict, phase,
            out: dict | None = None) -> list[torch.Tensor]:
        """Update part ``part`` of layout ``key`` in the lent records ``lent`` ({state:
        1-D pieces}; "w" too under remainders) with ``hyper`` (StepHyper) and the clip
        coefficient (None: no clip), timing its phases with ``phase(name, since)``.
        ``out``: write the new master weights and moments there ({state: 1-D pieces of
        records of the same dtypes and sizes}, a scaled state's scales as the part's next
        ones) and leave ``lent`` as it is, but for the clip of its gradient. Returns the
        new working weights' pieces (the new master itself in fp32)."""
        if out is not None:
            t = time.perf_counter()
            for name in STATES:    # records of one dtype and size are cut alike
                for dst, src in zip(out[name], lent[name]):
                    dst.copy_(src)
            lent = {**lent, **{name: out[name] for name in STATES}}
            if self.precision.remainders:   # the working weights are the masters' high halves
                lent["w"] = lent["w"].clone()
            phase("adamw", t)
        if self.precision.fp32:
            self.in_place(key, part, hyper, clip_coef, lent, phase)
            return lent["master"]
        t = time.perf_counter()
        weights = self.chunked(key, part, hyper, clip_coef, lent, next_scales=out is not None)
        phase("adamw", t)
        return weights

    def in_place(self, key, part: str, hyper, clip_coef, lent: dict,
                 phase=lambda name, since: None) -> None:
        """Every state fp32: the fused kernel on the lent bytes, one view per parameter."""
        lay = self.states.layouts[key]
        lo, hi = self.states.part_range(key, part)
        # each a list of 1-D pieces, cut at the same elements (same dtype and size)
        t = time.perf_counter()
        if clip_coef is not None:
            for piece in lent["grad"]:
                piece.mul_(clip_coef)
        phase("clip", t)
        t = time.perf_counter()
        ranges: dict[bool, list] = {True: [], False: []}   # by weight decay
        for seg, piece in lay.pieces(lo, hi):
            ranges[seg.decay].append((piece.start - lo, piece.stop - lo, seg.offset - lo))
        sizes = [p.numel() for p in lent["master"]]
        step = torch.tensor(float(hyper.step), device=lent["master"][0].device)
        for decay, rs in ranges.items():
            if not rs:
                continue
            intervals = _intervals(sizes, rs)
            taken = {name: _take(lent[name], intervals) for name in STATES + ("grad",)}
            with timeline.span("fused adamw", "cpu adamw",
                               params=sum(b - a for a, b in intervals)):
                fused_adamw_(taken["master"][0], taken["grad"][0], taken["exp_avg"][0],
                             taken["exp_avg_sq"][0], step, lr=hyper.lr,
                             beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                             weight_decay=hyper.weight_decay if decay else 0.0)
            for name in STATES:
                _return_bridges(taken[name][1])
        phase("adamw", t)

    # --- the chunked update (precision-aware) -------------------------------------------
    def chunked(self, key, part: str, hyper, clip_coef, lent: dict,
                next_scales: bool = False) -> list[torch.Tensor]:
        """One part's update with states in their own dtypes: each parameter piece, in
        chunks of at most CHUNK_ELEMENTS cut at 16-element lines from its start, loaded into
        fp32 scratch (several small pieces share one batch), updated by the fused kernel
        (one tensor per chunk: the bits of the kernel on the whole piece), and rounded back
        into the lent records. A scaled state (fp16, fp8) takes its piece's absmax after the
        update: a piece longer than one chunk is computed twice, the first time for its
        absmax only. Returns the new working weights' pieces for ``on_weights``.
        ``next_scales``: the new scales are the part's next ones (an update out of place)."""
        p = self.precision
        flats = {name: _Flat(lent[name]) for name in STATES + ("grad",)}
        pieces = self.states.pieces(key, part)
        n = pieces[-1][1] if pieces else 0
        if p.remainders:      # the working weights: the masters' high halves, replaced
            new_w = lent["w"].reshape(-1)
        elif p.master != torch.float32:
            new_w = torch.empty(n, dtype=p.params)
        else:
            new_w = None
        scaled = [name for name in STATES if p.dtype(name) in SCALED]
        scales_in = {name: self.states.scales[(name, key, part)] for name in scaled}
        scales_out = {name: list(scales_in[name]) for name in scaled}
        tasks = {True: [], False: []}                       # by weight decay
        for index, (a, b, decay) in enumerate(pieces):
            for c in range(a, b, CHUNK_ELEMENTS):
                tasks[decay].append((index, c, min(b, c + CHUNK_ELEMENTS)))
        long = {i for i, (a, b, _) in enumerate(pieces) if b - a > CHUNK_ELEMENTS}
        step = torch.tensor(float(hyper.step))
        with timeline.span("chunked adamw", "cpu adamw", params=n):
            for decay, todo in tasks.items():
                wd = hyper.weight_decay if decay else 0.0
                amax: dict = {}
                if scaled and long:   # first pass: the absmax of each long piece's states
                    for batch in self._batches([t for t in todo if t[0] in long]):
                        views = self._compute(batch, flats, lent, scales_in, clip_coef, step,
                                              hyper.lr, wd, first_pass=True)
                        for (index, _, _), view in zip(batch, views):
                            for name in scaled:
                                value = view[name].abs().max().to(torch.float32)
                                amax[(name, index)] = torch.maximum(
                                    amax.get((name, index), value), value)
                for batch in self._batches(todo):
                    views = self._compute(batch, flats, lent, scales_in, clip_coef, step,
                                          hyper.lr, wd)
                    for (index, a, b), view in zip(batch, views):
                        self._store_chunk(index, a, b, view, flats, new_w, scales_out,
                                          amax, long)
        for name in scaled:
            self.states.set_scales(name, key, part, scales_out[name], next_scales)
        return [new_w] if new_w is not None else lent["master"]

    @staticmethod
    def _batches(tasks: list):
        """Consecutive tasks whose chunks fit one scratch batch together."""
        batch, size = [], 0
        for task in tasks:
            length = task[2] - task[1]
            if batch and size + length > CHUNK_ELEMENTS:
                yield batch
                batch, size = [], 0
            batch.append(task)
            size += length
        if batch:
            yield batch

    @staticmethod
    def scratch_bytes() -> int:
        """Host memory of the chunked update's scratch buffers (5.5 MiB at 2^18 elements):
        fp32 master, moments and gradient, the int16 remainder and its int32 working copy."""
        return (4 * 4 + 2 + 4) * CHUNK_ELEMENTS

    def _scratch_buffers(self) -> dict:
        if self._scratch is None:   # made on the worker, kept for the run (scratch_bytes())
            self._scratch = {name: torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
                             for name in STATES + ("grad",)}
            self._scratch["rem"] = torch.empty(CHUNK_ELEMENTS, dtype=REMAINDER)
            self._scratch["i32"] = torch.empty(CHUNK_ELEMENTS, dtype=torch.int32)
        return self._scratch

    def _compute(self, batch: list, flats: dict, lent: dict, scales_in: dict, clip_coef,
                 step: torch.Tensor, lr: float, weight_decay: float,
                 first_pass: bool = False) -> list[dict]:
        """Load a batch of chunks into fp32, run the fused AdamW kernel on them (one tensor
        per chunk) and return each chunk's new values: views of the scratch buffers, or of
        the lent record itself where an fp32 state's chunk lies in one of its pieces (it
        is updated in place, as the all-fp32 update does). ``first_pass``: the results
        are only looked at (every input is copied, nothing changes)."""
        p, scratch = self.precision, self._scratch_buffers()
        views, offset = [], 0
        for index, a, b in batch:
            length = b - a
            view = {"in_place": set()}
            for name in STATES + ("grad",):
                dtype = p.dtype(name)
                target = scratch[name][offset:offset + length]
                if dtype == torch.float32 and not first_pass:
                    direct = flats[name].view(a, b)
                    if direct is not None:   # updated where it is stored
                        view[name] = direct
                        view["in_place"].add(name)
                        continue
                view[name] = target
                if dtype == REMAINDER:
                    rem = flats[name].view(a, b)
                    if rem is None:
                        rem = scratch["rem"][offset:offset + length]
                        flats[name].read(a, b, rem)
                    join_master(lent["w"].reshape(-1)[a:b], rem, target,
                                scratch["i32"][offset:offset + length])
                    continue
                flats[name].read(a, b, target, fp8=dtype == FP8)
                if dtype in SCALED:
                    target.mul_(torch.tensor(scales_in[name][index], dtype=torch.float32))
            if clip_coef is not None:
                view["grad"].mul_(clip_coef)
            views.append(view)
            offset += length
        fused_adamw_([v["master"] for v in views], [v["grad"] for v in views],
                     [v["exp_avg"] for v in views], [v["exp_avg_sq"] for v in views], step,
                     lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                     weight_decay=weight_decay)
        return views

    def _store_chunk(self, index: int, a: int, b: int, view: dict, flats: dict, new_w,
                     scales_out: dict, amax: dict, long: set) -> None:
        """Round one chunk's new fp32 values into their records (and the new working
        weights): remainders split exactly, the rest by Transformer Engine's rules."""
        p = self.precision
        if p.remainders:
            target = flats["master"].view(a, b)
            rem = target if target is not None else self._scratch["rem"][:b - a]
            split_master(view["master"], new_w[a:b], rem, self._scratch["i32"][:b - a])
            if target is None:
                flats["master"].write(a, b, rem)
        elif new_w is not None:   # fp16 master: the weights from the fp32 result (the kernel's)
            new_w[a:b].copy_(view["master"])
        for name in STATES:
            dtype = p.dtype(name)
            if dtype == REMAINDER or name in view["in_place"]:
                continue
            if dtype not in SCALED:
                flats[name].write(a, b, view[name])
                continue
            scale = scale_for(dtype, amax[(name, index)]) if index in long else None
            target = flats[name].view(a, b)
            out = target if target is not None else torch.empty(b - a, dtype=dtype)
            scales_out[name][index] = quantize(view[name], dtype, out, scale)
            if target is None:
                flats[name].write(a, b, out)
