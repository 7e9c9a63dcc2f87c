"""Transformer Engine's ``_extra_state`` from a checkpoint, checked before TE reads it.

TE layers keep their FP8 metadata as a pickle: a uint8 tensor of ``pickle.dumps`` bytes
(TE 2) or a ``torch.save`` BytesIO (TE 1). The checkpoint loaders let both through (a
tensor and a BytesIO are plain values), and then TE's ``set_extra_state`` and
Megatron-Core's ``merge_extra_states`` pre-hook unpickle them unchecked: a crafted
checkpoint would run code. ``refuse_unsafe_extra_state(model)`` adds a load pre-hook on the
model's root, which runs before any submodule's own hooks, and unpickles every
``*_extra_state*`` entry of the incoming state dict with an allowlist: tensors, plain
values and TE's recipe classes. Anything else stops the load, and nothing in it runs.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle

import torch

from megatron_snake.training.checkpointing import UnsafeCheckpointError, only_safe_globals

# What TE's FP8 metadata pickles: tensors (rebuilt from bytes, which are checked in turn),
# containers and torch's value types. A recipe object is one of TE's dataclasses, enums or
# named tuples (an enum member pickles by value: Format(_FormatHelper(448, 57344))).
_ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
            ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
            ("torch", "Size"), ("torch", "device")}
_TE_RECIPES = "transformer_engine.common.recipe"


def _load_weights_only(data: bytes):
    """``data`` as ``torch.load`` reads it under torch's own weights-only allowlist, nothing
    added: what ``torch.storage._load_from_bytes`` (weights_only=False) and TE 1's BytesIO
    would load, checked."""
    with only_safe_globals(()):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _is_recipe_type(found) -> bool:
    return isinstance(found, type) and found.__module__ == _TE_RECIPES and (
        (issubclass(found, enum.Enum) and found is not enum.Enum)
        or dataclasses.is_dataclass(found)
        or (issubclass(found, tuple) and hasattr(found, "_fields")))


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, so that BUILD can be checked too: the C one sets any
    state on any object, a class or a function included, before a later opcode is
    refused."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        if "." in name:   # an attribute path reaches past the allowlist
            raise UnsafeCheckpointError(f"refers to {module}.{name}")
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_weights_only
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _TE_RECIPES and _is_recipe_type(found := super().find_class(module, name)):
            return found
        raise UnsafeCheckpointError(f"refers to {module}.{name}")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError("holds a persistent id")

    def load_build(self):
        """Only a recipe dataclass's own fields, as a plain dict, on an instance of it."""
        state, target = self.stack[-1], self.stack[-2]
        fields = getattr(type(target), "__dataclass_fields__", None)
        if isinstance(target, type) or not _is_recipe_type(type(target)) or fields is None \
                or not isinstance(state, dict) or not set(state) <= set(fields) | {"_cached_repr"}:
            raise UnsafeCheckpointError(f"sets attributes of {type(target).__name__} "
                                        f"{getattr(target, '__name__', '')}".rstrip())
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def check_extra_state(key: str, value) -> None:
    """Unpickle ``value`` (one ``_extra_state`` entry) the way TE would, with the allowlist;
    raise UnsafeCheckpointError naming ``key`` if it needs anything else."""
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
        return   # no FP8 metadata: TE reads nothing
    try:
        if isinstance(value, torch.Tensor):
            if value.dtype != torch.uint8:
                raise UnsafeCheckpointError(f"is a {value.dtype} tensor, not pickled bytes")
            _Unpickler(io.BytesIO(value.detach().cpu().numpy().tobytes())).load()
        elif isinstance(value, io.BytesIO):
            _load_weights_only(value.getvalue())
        else:
            raise UnsafeCheckpointError(f"is a {type(value).__name__}, which TE never saves")
    except UnsafeCheckpointError as exc:
        detail = str(exc)
    except pickle.UnpicklingError as exc:
        detail = f"is refused by torch's weights-only loader ({str(exc).splitlines()[0][:200]})"
    except Exception as exc:  # noqa: BLE001 - bytes that do not parse are not TE's
        detail = f"does not parse ({type(exc).__name__}: {str(exc)[:200]})"
    else:
        return
    raise UnsafeCheckpointError(
        f"--load: the checkpoint's {key} (Transformer Engine's extra state) {detail}, "
        "which TE's FP8 metadata never does: refused before TE unpickles it, nothing in it "
        "was run. Load only checkpoints you trust, from their own --save") from None


def _check_incoming(module, state_dict, prefix, *_):
    for key, value in state_dict.items():
        if key.startswith(prefix) and "_extra_state" in key.rsplit(".", 1)[-1]:
            check_extra_state(key, value)


def refuse_unsafe_extra_state(model: torch.nn.Module) -> torch.nn.Module:
    """Check every ``_extra_state`` entry of a state dict loaded into ``model`` (or a
    module wrapping it) before any of its submodules reads one."""
    model.register_load_state_dict_pre_hook(_check_incoming)
    return model
