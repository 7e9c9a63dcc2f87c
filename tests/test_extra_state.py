"""Transformer Engine's pickled ``_extra_state`` is checked before TE unpickles it.

Transformer Engine is not installed here, so ``TELinear`` below stands in for a TE layer:
its ``get_extra_state`` and ``set_extra_state`` do what TE 2's do (a uint8 tensor of
``pickle.dumps`` bytes, read back with ``pickle.loads``; TE 1: a ``torch.save`` BytesIO).
It is attached to a GPTModel as ``build_gpt_model`` makes it, so every checkpoint loader,
which all end in the model's ``load_state_dict``, goes through the same check.
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from conftest import build_model, tiny_args


class TELinear(torch.nn.Module):
    """Transformer Engine 2's extra-state round trip (TE 1's with ``bytes_io``)."""

    def __init__(self, bytes_io: bool = False):
        super().__init__()
        self.bytes_io = bytes_io
        self.fp8_meta = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3),
                         "extra_fp8_variables": {"num_gemms": 1}}

    def get_extra_state(self):
        if self.bytes_io:
            out = io.BytesIO()
            torch.save(self.fp8_meta, out)
            return out
        return torch.frombuffer(bytearray(pickle.dumps(self.fp8_meta)), dtype=torch.uint8)

    def set_extra_state(self, state):
        if isinstance(state, io.BytesIO):
            state.seek(0)
            self.fp8_meta = torch.load(state, weights_only=False)
        elif state.numel():
            self.fp8_meta = pickle.loads(state.numpy().tobytes())


class _MakeDir:
    """A pickle that runs ``os.mkdir(path)`` when it is loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


class _StorageFromBytes:
    """A pickle that hands ``data`` to ``torch.storage._load_from_bytes``, as a pickled
    tensor does (which torch.loads with weights_only=False)."""

    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.data,)


def _payloads(path: str) -> dict:
    saved = io.BytesIO()
    torch.save({"scale_fwd": _MakeDir(path)}, saved)
    return {
        "pickle": torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": _MakeDir(path)})),
                                   dtype=torch.uint8),
        "tensor bytes": torch.frombuffer(bytearray(pickle.dumps(
            {"scale_fwd": _StorageFromBytes(saved.getvalue())})), dtype=torch.uint8),
        "bytes_io": saved,
    }


@pytest.fixture
def gpt(megatron_world):
    model = build_model(tiny_args(), megatron_world)
    model.decoder.layers[0].te = TELinear()
    return model


def test_te_extra_state_loads_when_it_is_tensors_and_plain_values(gpt, megatron_world):
    layer = gpt.decoder.layers[0]
    layer.te.fp8_meta["scale_fwd"] = torch.tensor([2.0, 3.0, 4.0])
    state = gpt.state_dict()
    layer.te.fp8_meta = {}
    gpt.load_state_dict(state)
    assert torch.equal(layer.te.fp8_meta["scale_fwd"], torch.tensor([2.0, 3.0, 4.0]))
    assert layer.te.fp8_meta["extra_fp8_variables"] == {"num_gemms": 1}

    layer.te = TELinear(bytes_io=True)   # TE 1's format
    layer.te.fp8_meta["scale_fwd"] = torch.tensor([5.0])
    state = gpt.state_dict()
    layer.te.fp8_meta = {}
    gpt.load_state_dict(state)
    assert torch.equal(layer.te.fp8_meta["scale_fwd"], torch.tensor([5.0]))


@pytest.mark.parametrize("kind", ["pickle", "tensor bytes", "bytes_io"])
def test_te_extra_state_that_would_run_code_is_refused_before_te_reads_it(
        gpt, tmp_path, kind):
    from megatron_snake.training.checkpointing import UnsafeCheckpointError

    target = str(tmp_path / "ran")
    state = gpt.state_dict()
    key = "decoder.layers.0.te._extra_state"
    assert key in state
    state[key] = _payloads(target)[kind]
    with pytest.raises(UnsafeCheckpointError, match=r"decoder\.layers\.0\.te\._extra_state.*"
                       r"nothing in it was run"):
        gpt.load_state_dict(state)
    assert not os.path.exists(target)


@pytest.mark.parametrize("kind", ["pickle", "tensor bytes", "bytes_io"])
def test_the_payloads_do_run_code_in_a_model_without_the_check(tmp_path, kind):
    """The control: the same payloads, loaded into a module that is not checked, run."""
    target = str(tmp_path / "ran")
    holder = torch.nn.Module()
    holder.te = TELinear()
    holder.load_state_dict({"te._extra_state": _payloads(target)[kind]})
    assert os.path.isdir(target)


def test_te_extra_state_of_another_type_is_refused(gpt):
    from megatron_snake.training.checkpointing import UnsafeCheckpointError

    state = gpt.state_dict()
    state["decoder.layers.0.te._extra_state"] = torch.ones(4)   # float: not pickled bytes
    with pytest.raises(UnsafeCheckpointError, match="float32 tensor"):
        gpt.load_state_dict(state)
    state["decoder.layers.0.te._extra_state"] = torch.empty(0, dtype=torch.uint8)   # no FP8
    gpt.load_state_dict(state)


@pytest.fixture
def te_recipes(monkeypatch):
    """A stand-in for ``transformer_engine.common.recipe`` as TE 2 defines its recipes: a
    dataclass whose format is an enum whose values are named tuples."""
    import dataclasses
    import enum
    import sys
    import types
    from typing import NamedTuple

    name = "transformer_engine.common.recipe"
    module = types.ModuleType(name)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    @dataclasses.dataclass()
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__ = name
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    for parent in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_te_extra_state_with_its_fp8_recipe_loads(gpt, te_recipes):
    layer = gpt.decoder.layers[0]
    layer.te.fp8_meta["recipe"] = te_recipes.DelayedScaling(margin=2)
    state = gpt.state_dict()
    layer.te.fp8_meta = {}
    gpt.load_state_dict(state)
    assert layer.te.fp8_meta["recipe"] == te_recipes.DelayedScaling(margin=2)
    assert layer.te.fp8_meta["recipe"].fp8_format is te_recipes.Format.HYBRID


def test_te_extra_state_that_sets_attributes_of_an_allowed_function_is_refused(gpt):
    """BUILD with slot state on an allowed global (here a function) would set attributes
    on it for the whole process while the payload is checked: refused before that."""
    from megatron_snake.training.checkpointing import UnsafeCheckpointError

    payload = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n"    # GLOBAL
               b"N}X\x05\x00\x00\x00snakeK\x01s\x86b.")          # (None, {snake: 1}), BUILD
    state = gpt.state_dict()
    state["decoder.layers.0.te._extra_state"] = torch.frombuffer(bytearray(payload),
                                                                dtype=torch.uint8)
    try:
        with pytest.raises(UnsafeCheckpointError, match="sets attributes of function"):
            gpt.load_state_dict(state)
        assert not hasattr(torch._utils._rebuild_tensor_v2, "snake")
    finally:
        vars(torch._utils._rebuild_tensor_v2).pop("snake", None)


def test_te_extra_state_that_reaches_past_an_allowed_name_is_refused(gpt, te_recipes):
    from megatron_snake.training.checkpointing import UnsafeCheckpointError

    te_recipes.Enum = __import__("enum").Enum   # as `from enum import Enum` leaves it
    for name in ("Enum", "DelayedScaling.__init__.__globals__"):
        payload = f"\x80\x02ctransformer_engine.common.recipe\n{name}\n.".encode("latin-1")
        state = gpt.state_dict()
        state["decoder.layers.0.te._extra_state"] = torch.frombuffer(bytearray(payload),
                                                                    dtype=torch.uint8)
        with pytest.raises(UnsafeCheckpointError, match="refers to transformer_engine"):
            gpt.load_state_dict(state)
