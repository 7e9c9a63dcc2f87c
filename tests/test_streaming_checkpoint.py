"""Streaming checkpoints, for state bigger than memory: an offloaded run's --save reads each
layout's state (working weights, master weights, moments) from its tier, writes it and
drops it before the next; --load puts it back the same way. Both formats: torch (a file
per unit) and torch_dist (Megatron's files, each layout's pieces written together). Resume
stays bit-exact (one rank, data parallel 2, pipeline parallel 2); the big model of
test_bigger_than_memory saves and loads within its RSS bound (training state >= 4x peak
RSS); a corrupted, truncated, swapped or missing unit file is refused naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from megatron_snake.training import checkpointing
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.checkpoint_dir import find_checkpoint
from megatron_snake.training.distributed import free_port, local_rank_env
from megatron_snake.training.loop import pretrain

SMALL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "6",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "5"]
# dropout on: resuming exactly needs the RNG streams and the data position back too; the
# torch format's unit files (torch_dist: the tests that name it)
FLAGS = [*SMALL, "--train-iters", "4", "--deterministic-mode", "--snake-offload",
         "--ckpt-format", "torch"]
DIST = ["--ckpt-format", "torch_dist"]   # (given last: it overrides FLAGS' choice)
STATE = "model_optim_rng.pt"
RANK_DIR = ("iter_0000002", "mp_rank_00")


def _unit_files(rank_dir) -> list[str]:
    return sorted(n for n in os.listdir(rank_dir) if n.startswith("unit_"))


# --- resume is bit-exact -------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    [],
    # deferred forward parts and clipping: updates still pending at the save; untied: no
    # shared layout, the embedding and output layer are units' parameters
    ["--snake-alpha", "0.3", "--clip-grad", "0.5", "--untie-embeddings-and-output-weights",
     "--snake-checkpoint-interval", "2"],
])
def test_resume_is_bit_exact(megatron_world, tmp_path, extra):
    flags = [*FLAGS, *extra]
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", str(tmp_path)]))
    resumed_from_dist = _resumed_from_torch_dist(flags, tmp_path / "dist")
    assert resumed_from_dist == full[2:], (resumed_from_dist, full[2:])
    rank_dir = tmp_path.joinpath(*RANK_DIR)
    state = torch.load(rank_dir / STATE, weights_only=True)
    tied = not extra
    units = 3 if tied else 2      # --snake-checkpoint-interval 2: layers (0, 1), (2)
    keys = list(range(units)) + (["shared"] if tied else [])
    assert state["units"] == keys
    assert _unit_files(rank_dir) == sorted(
        [f"unit_{k}.bin" for k in keys] + [f"unit_{k}.bin.sha256.json" for k in keys])
    # the state file holds no unit's tensors: only the resident ones (the tied embedding)
    assert "layouts" not in state["optimizer"]
    assert [n for n, v in state["model"].items() if torch.is_tensor(v)] == \
        (["embedding.word_embeddings.weight"] if tied else [])
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert resumed == full[2:], (resumed, full[2:])


def _resumed_from_torch_dist(flags: list[str], root) -> list[float]:
    """Saved at iteration 2 in Megatron's format and resumed from it; the checkpoint holds
    Megatron-LM's keys (layers stacked on a leading axis) with their global shapes."""
    from megatron.core import dist_checkpointing

    pretrain(parse_args([*flags, *DIST, "--exit-interval", "2", "--save", str(root)]))
    shapes = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(
        str(root / "iter_0000002")).items()}
    assert shapes["decoder.layers.mlp.linear_fc1.weight"] == (3, 128, 32)
    assert shapes["optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"] == \
        (3, 128, 32)
    return pretrain(parse_args([*flags, *DIST, "--load", str(root)]))


def test_save_and_load_hold_one_layout_at_a_time(megatron_world, tmp_path, monkeypatch):
    """Every layout read for a save is dropped before the next is read, every unit file
    read for a load likewise, and neither calls a method that returns the whole model or
    the whole optimizer shard."""
    from megatron_snake.offload.unit_weights import OffloadedUnits
    from megatron_snake.optim.offloaded_adamw import OffloadedAdamW

    held, calls = [], {"save": 0, "load": 0}

    def track(what, entry):
        assert not [r for r in held if r() is not None], f"{what}: the previous layout is held"
        held[:] = [weakref.ref(v) for v in entry.values() if torch.is_tensor(v)]
        held.extend(weakref.ref(v._base) for v in entry.values()
                    if torch.is_tensor(v) and v._base is not None)
        calls[what] += 1
        return entry

    real_unit_state, real_read = OffloadedUnits.unit_state, checkpointing._read_unit
    real_state_dict = OffloadedAdamW.state_dict

    def whole(*args, **kwargs):
        raise AssertionError("the whole model or optimizer shard at once")

    monkeypatch.setattr(OffloadedUnits, "unit_state",
                        lambda self, key, optimizer=True: track(
                            "save", real_unit_state(self, key, optimizer)))
    monkeypatch.setattr(checkpointing, "_read_unit",
                        lambda root, path, key: track("load", real_read(root, path, key)))
    monkeypatch.setattr(OffloadedUnits, "model_state_dict", whole)
    monkeypatch.setattr(OffloadedUnits, "load_model_state_dict", whole)
    monkeypatch.setattr(OffloadedAdamW, "state_dict", lambda self, layouts=True:
                        whole() if layouts else real_state_dict(self, layouts=False))
    flags = [*FLAGS, "--train-iters", "3"]
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", str(tmp_path)]))
    held.clear()
    pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert calls == {"save": 4, "load": 4}   # 3 units and the shared (tied) layout


def test_torch_dist_reads_each_layout_once_and_never_the_whole_model(megatron_world, tmp_path,
                                                                      monkeypatch):
    """--ckpt-format torch_dist: the writer asks for each layout's state once (its pieces are
    written together, whatever order Megatron's keys would give them) and drops it before
    the next; the load puts back one unit at a time; neither gathers the whole model."""
    from megatron_snake.offload.unit_weights import OffloadedUnits
    from megatron_snake.optim.offloaded_adamw import OffloadedAdamW

    calls: dict = {"save": [], "load": []}
    held: list = []
    real_unit_state, real_load = OffloadedUnits.unit_state, OffloadedUnits.load_unit_state

    def unit_state(self, key, optimizer=True, **kwargs):
        assert not [r for r in held if r() is not None], "the previous layout is held"
        entry = real_unit_state(self, key, optimizer, **kwargs)
        held[:] = [weakref.ref(v) for v in entry.values() if torch.is_tensor(v)]
        calls["save"].append(key)
        return entry

    def whole(*args, **kwargs):
        raise AssertionError("the whole model or optimizer shard at once")

    monkeypatch.setattr(OffloadedUnits, "unit_state", unit_state)
    monkeypatch.setattr(OffloadedUnits, "load_unit_state", lambda self, key, state, **kw: (
        calls["load"].append(key), real_load(self, key, state, **kw)))
    monkeypatch.setattr(OffloadedUnits, "model_state_dict", whole)
    monkeypatch.setattr(OffloadedUnits, "load_model_state_dict", whole)
    monkeypatch.setattr(OffloadedAdamW, "state_dict", whole)
    flags = [*FLAGS, *DIST, "--train-iters", "3"]
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", str(tmp_path)]))
    pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert calls == {"save": [0, 1, 2, "shared"], "load": [0, 1, 2]}


# --- two ranks: data parallel 2, pipeline parallel 2 ---------------------------------------
MULTI_RANK_FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size",
                    "8", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4",
                    "--device", "cpu", "--deterministic-mode", "--snake-offload"]


def _two_ranks(rank: int, port: int, root: str, parallel: list[str], ckpt_format: str):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(local_rank_env(rank, 2, port))
    torch.set_num_threads(1)
    from megatron_snake.training import distributed

    flags = [*MULTI_RANK_FLAGS, *parallel, "--ckpt-format", ckpt_format]
    ckpt = os.path.join(root, "ckpt")
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", ckpt]))
    resumed = pretrain(parse_args([*flags, "--load", ckpt]))
    distributed.shutdown()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump({"full": full, "resumed": resumed}, f)


@pytest.mark.parametrize("name,parallel,rank_dirs,ckpt_format", [
    ("dp2", [], ["mp_rank_00_dp000", "mp_rank_00_dp001"], "torch"),
    # the tied embedding's two copies (first and last stage) are units of their stages
    ("pp2", ["--pipeline-model-parallel-size", "2"], ["mp_rank_00_000", "mp_rank_00_001"],
     "torch_dist"),
])
def test_resume_is_bit_exact_on_two_ranks(tmp_path, name, parallel, rank_dirs, ckpt_format):
    """Each rank saves its own layouts (under data parallelism its shard of each: working
    weights, master weights, moments) and loads them back: the straight run's losses. Data
    parallel in this project's own format (whose files show the shards), pipeline stages in
    Megatron's (the two formats share the offloaded state's save and load per layout; each
    two-rank case takes a minute and a half, so each runs in one of them)."""
    mp.spawn(_two_ranks, args=(free_port(), str(tmp_path), parallel, ckpt_format), nprocs=2,
             join=True)
    for rank in range(2):
        run = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert run["resumed"] == run["full"][2:], run
    iteration = tmp_path / "ckpt" / "iter_0000002"
    if ckpt_format == "torch_dist":   # one file per rank, Megatron's
        assert sorted(os.listdir(iteration)) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
        return
    assert sorted(os.listdir(iteration)) == rank_dirs
    if name != "dp2":
        return
    shards = []
    for rank_dir in sorted(iteration.iterdir()):
        entry = checkpointing._read_unit(str(tmp_path), str(rank_dir / "unit_1.bin"), 1)
        assert entry["weights"].numel() == entry["master"].numel() == \
            entry["shard"][1] - entry["shard"][0]
        shards.append((entry["shard"], entry["numel"]))
    (first, numel), (second, _) = shards
    assert first == [0, second[0]] and second[1] == numel, "two halves of the unit"


# --- integrity of unit files ---------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(megatron_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    pretrain(parse_args([*FLAGS, "--exit-interval", "2", "--save", str(root)]))
    return root


def _copy(saved, tmp_path, name="unit_1.bin") -> tuple[str, str]:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return str(root), str(root.joinpath(*RANK_DIR, name))


def _resign(path: str) -> None:
    """Write the checksum file to match (what someone who can write the file can do)."""
    data = pathlib.Path(path).read_bytes()
    sidecar = pathlib.Path(path + checkpointing.CHECKSUM_SUFFIX)
    manifest = json.loads(sidecar.read_text())
    manifest.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    sidecar.write_text(json.dumps(manifest))


def _load_fails(root: str) -> str:
    with pytest.raises(ValueError) as caught:
        pretrain(parse_args([*FLAGS, "--load", root]))
    return str(caught.value)


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_flipped_byte_in_a_unit_file_is_refused_naming_it(saved, tmp_path, where):
    root, path = _copy(saved, tmp_path)
    offset = 40 if where == "header" else os.path.getsize(path) - 100
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    message = _load_fails(root)
    assert message.startswith(f"--load {root}: {path} is corrupt (checksum mismatch"), message
    assert "restore it from a copy or load an earlier iteration" in message


def test_a_truncated_unit_file_is_refused_naming_it(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    size = os.path.getsize(path)
    os.truncate(path, size - 64)
    assert _load_fails(root).startswith(
        f"--load {root}: {path} is corrupt (truncated: {size - 64} of {size} bytes)")


@pytest.mark.parametrize("name", ["unit_1.bin", "unit_shared.bin",
                                  "unit_1.bin.sha256.json"])
def test_a_missing_unit_file_is_refused_naming_it_before_anything_loads(saved, tmp_path,
                                                                       name):
    root, path = _copy(saved, tmp_path, name)
    os.unlink(path)
    args = parse_args([*FLAGS, "--load", root])
    with pytest.raises(ValueError) as caught:   # before any state is applied
        checkpointing.load_checkpoint(find_checkpoint(root), args=args)
    message = str(caught.value)
    if name.endswith(".json"):
        unit = path[:-len(checkpointing.CHECKSUM_SUFFIX)]
        assert message.startswith(f"--load {root}: {unit} has no checksum file "), message
    else:
        assert message.startswith(f"--load {root}: {path} is missing ({STATE} lists it)"), \
            message
    assert _load_fails(root) == message


def test_a_unit_file_in_another_units_place_is_refused(saved, tmp_path):
    """unit_0.bin copied over unit_1.bin with its checksum file: every checksum matches,
    the header names the other unit."""
    root, path = _copy(saved, tmp_path)
    for suffix in ("", checkpointing.CHECKSUM_SUFFIX):
        shutil.copyfile(path.replace("unit_1", "unit_0") + suffix, path + suffix)
    message = _load_fails(root)
    assert message.startswith(f"--load {root}: {path} matches its checksum but is not a unit "
                              "file of megatron_snake (it holds unit 0, not 1)"), message


def test_a_unit_header_pointing_outside_the_file_is_refused(saved, tmp_path):
    """A re-signed header whose tensor claims more bytes than the file has is refused,
    not read past the end."""
    root, path = _copy(saved, tmp_path)
    data = pathlib.Path(path).read_bytes()
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    header["tensors"][0]["shape"] = [10 ** 9]
    header["tensors"][0]["bytes"] = 4 * 10 ** 9
    text = json.dumps(header).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    pathlib.Path(path).write_bytes(data[:16] + text + data[16 + length:])
    _resign(path)
    message = _load_fails(root)
    assert message.startswith(f"--load {root}: {path} matches its checksum but is not a unit "
                              "file of megatron_snake (entry 'master' does not fit the "
                              "file)"), message


def test_a_checkpoint_of_another_format_version_is_refused(saved, tmp_path):
    root, path = _copy(saved, tmp_path, STATE)
    sidecar = pathlib.Path(path + checkpointing.CHECKSUM_SUFFIX)
    sidecar.write_text(sidecar.read_text().replace('"format_version": 3',
                                                   '"format_version": 2'))
    assert _load_fails(root) == f"--load {path}: format version 2 is not 3"


def test_a_checkpoint_with_another_unit_partition_is_refused(saved, tmp_path):
    root, _ = _copy(saved, tmp_path)
    with pytest.raises(KeyError, match=re.escape(
            "checkpoint units [0, 1, 2, 'shared'] do not match the model's units "
            "[0, 1, 'shared']; was it saved with another --snake-checkpoint-interval?")):
        pretrain(parse_args([*FLAGS, "--load", root, "--snake-checkpoint-interval", "2"]))


# --- the big model: save and load within the RSS bound --------------------------------------
def test_big_model_saves_and_loads_within_its_rss_bound(tmp_path, ckpt_format="torch_dist"):
    """test_bigger_than_memory's 201M-parameter GPT (3.8 GiB of fp32 training state):
    --save (twice) in a process whose peak RSS stays a quarter of that state or less,
    --load and one more step likewise, and that step's loss is the uninterrupted run's, in
    torch_dist (the default: Megatron's files, written and read one unit at a time; the
    torch format streams through the same per-layout state, ``unit_state``, and its own
    writer is tested on small models above: this test takes four minutes a format).
    (The whole-model save and load this replaces peaked at 3.57 and 3.54 GiB: ratio 1.1.)
    The host limit is the least the pre-flight takes for this model (the optimizer's
    update outside the pool, 108 MiB, and a pool of two buffers)."""
    from test_bigger_than_memory import (BIG, FP32_STATE_BYTES_PER_PARAMETER,
                                         train_in_subprocess)

    ckpt = tmp_path / "ckpt"

    def flags(iters, name, *extra):
        (tmp_path / name).mkdir()
        out = list(BIG)
        out[out.index("--train-iters") + 1] = str(iters)
        return [*out, "--snake-offload", "--snake-offload-dir", str(tmp_path / name),
                "--snake-host-memory-limit", "128MiB", "--ckpt-format", ckpt_format, *extra]

    # --train-iters 3 in all three runs (it sets the learning-rate schedule), the first
    # stopped after its second step
    _, peak_save, out = train_in_subprocess(
        flags(3, "off_save", "--save", str(ckpt), "--save-interval", "1", "--exit-interval", "2"))
    params = float(re.search(r"> megatron_snake: ([0-9.]+)M parameters", out).group(1)) * 1e6
    state = params * FP32_STATE_BYTES_PER_PARAMETER
    assert out.count("> saved checkpoint at iteration") == 2
    resumed, peak_load, out = train_in_subprocess(flags(3, "off_load", "--load", str(ckpt)))
    assert "> loaded checkpoint from" in out and len(resumed) == 1
    shutil.rmtree(ckpt)
    straight, _, _ = train_in_subprocess(flags(3, "off_straight"))
    print(f"training state {state / 2**30:.2f} GiB; peak RSS with --save "
          f"{peak_save / 2**30:.2f} GiB (ratio {state / peak_save:.1f}), with --load "
          f"{peak_load / 2**30:.2f} GiB (ratio {state / peak_load:.1f})")
    assert state / peak_save >= 4, (state, peak_save)
    assert state / peak_load >= 4, (state, peak_load)
    assert resumed[0] == straight[2], (resumed, straight)
