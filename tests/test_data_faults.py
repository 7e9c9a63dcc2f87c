"""Datasets whose .bin and .idx do not belong together: refused when the datasets are built,
in one line naming both files, before anything is written (no index cache).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_data_faults.py
"""

import os
import shutil
import subprocess
import sys

import numpy
import pytest
import torch

from megatron_snake.errors import UserError
from megatron_snake.training import data
from megatron_snake.training.data import DataError, DataFileMissing, check_indexed_dataset
from test_data import TINY, _build, corpus  # noqa: F401  (corpus: the module's fixture)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "examples", "pretrain_gpt.py")
DTYPE_BYTE = 17  # in the .idx: after the 9-byte header and the 8-byte version


def _copy(prefix, dst):
    """A copy of a dataset under a new prefix, to damage without touching the fixture's."""
    for suffix in (".bin", ".idx"):
        shutil.copyfile(prefix + suffix, dst + suffix)
    return dst


def _poke(path, offset, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([value]))


def _shorten(path, by=None, to=None):
    os.truncate(path, os.path.getsize(path) - by if to is None else to)


def _garbage(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(3),
                              dtype=torch.uint8).numpy().tobytes())


def _assert_refused(err, prefix, flag="--data-path"):
    """One line, a UserError, naming the flag, both files and what to do."""
    msg = str(err)
    assert isinstance(err, DataError) and isinstance(err, UserError), repr(err)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{flag} {prefix}: "), msg
    assert f"{prefix}.idx" in msg and f"{prefix}.bin" in msg, msg
    assert "re-run tools/preprocess_data.py" in msg, msg
    return msg


# fault -> (how the copy is damaged, what the message says about it)
FAULTS = {
    "bin_of_another_dataset": (
        lambda p, c: shutil.copyfile(c["jsonl_prefix"] + ".bin", p + ".bin"), "the .bin is"),
    "bin_one_byte_short": (lambda p, c: _shorten(p + ".bin", by=1), "the .bin is"),
    "bin_half_length": (
        lambda p, c: _shorten(p + ".bin", to=os.path.getsize(p + ".bin") // 2), "the .bin is"),
    "dtype_int32_for_uint16": (lambda p, c: _poke(p + ".idx", DTYPE_BYTE, 4),
                               "do not match its lengths in int32 tokens"),
    "dtype_invalid_code": (lambda p, c: _poke(p + ".idx", DTYPE_BYTE, 99), "dtype code 99"),
    "idx_truncated": (lambda p, c: _shorten(p + ".idx", by=8), "document indices take"),
    "idx_cut_inside_its_header": (lambda p, c: _shorten(p + ".idx", to=20), "-byte header"),
    "idx_garbage": (lambda p, c: _garbage(p + ".idx"), "index header"),
    "idx_empty": (lambda p, c: _shorten(p + ".idx", to=0), "(0 bytes) does not start"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_files_that_do_not_belong_together_are_refused_before_anything_is_written(
        corpus, tmp_path, fault):
    damage, says = FAULTS[fault]
    prefix = _copy(corpus["txt_prefix"], str(tmp_path / "bad_text_document"))
    damage(prefix, corpus)
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as err:
        _build(corpus, data_path=[prefix], split="100,0,0", num_samples=(16, 0, 0),
               data_cache_path=str(cache))
    assert says in _assert_refused(err.value, prefix)
    assert not cache.exists()


def test_every_prefix_of_every_data_flag_is_checked(corpus, tmp_path):
    good = corpus["txt_prefix"]
    bad = _copy(good, str(tmp_path / "bad_text_document"))
    _shorten(bad + ".bin", by=1)
    cache = str(tmp_path / "cache")
    with pytest.raises(DataError) as err:  # the second of a weighted blend
        _build(corpus, data_path=["0.5", good, "0.5", bad], data_cache_path=cache)
    _assert_refused(err.value, bad)
    for flag, paths in (("--valid-data-path", dict(train_data_path=[good],
                                                    valid_data_path=[bad])),
                        ("--test-data-path", dict(train_data_path=[good],
                                                  test_data_path=["1", bad]))):
        with pytest.raises(DataError) as err:
            _build(corpus, data_path=None, data_cache_path=cache, **paths)
        _assert_refused(err.value, bad, flag)
    assert not os.path.exists(cache)


def test_a_missing_file_is_one_line_naming_it(corpus, tmp_path):
    for suffix in (".bin", ".idx"):
        prefix = _copy(corpus["txt_prefix"], str(tmp_path / f"no{suffix[1:]}_text_document"))
        os.remove(prefix + suffix)
        with pytest.raises(DataFileMissing) as err:
            _build(corpus, data_path=[prefix], data_cache_path=str(tmp_path / "cache"))
        msg = str(err.value)
        # a DataError, and still a FileNotFoundError for callers that catch that
        assert all(isinstance(err.value, c) for c in (DataError, FileNotFoundError, UserError))
        assert "\n" not in msg and f"missing file {prefix}{suffix}" in msg, msg
    assert not (tmp_path / "cache").exists()


def test_pointers_are_checked_across_chunks_and_sound_datasets_pass(
        corpus, tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    # 7 sequences a chunk: the running offset is carried over many chunk boundaries
    monkeypatch.setattr(data, "_IDX_CHUNK", 7)
    for key in ("txt_prefix", "jsonl_prefix"):
        check_indexed_dataset(corpus[key])
    # a multimodal .idx (one mode byte per sequence after the document indices)
    mm = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(mm + ".bin", dtype=numpy.int32, multimodal=True)
    for i in range(20):
        builder.add_item(torch.arange(i % 5 + 1), mode=i % 2)
        builder.end_document()
    builder.finalize(mm + ".idx")
    check_indexed_dataset(mm)
    # one pointer, of the 41st of 60 sequences (the 6th chunk), off by one token
    bad = _copy(corpus["txt_prefix"], str(tmp_path / "bad_text_document"))
    pointers = 34 + 4 * 60  # after the fixed fields and the 60 int32 lengths
    arr = numpy.memmap(bad + ".idx", dtype=numpy.int64, mode="r+", offset=pointers, shape=60)
    arr[40] += 2
    arr.flush()
    del arr
    with pytest.raises(DataError) as err:
        check_indexed_dataset(bad)
    assert "sequence pointers do not match" in _assert_refused(err.value, bad)


def test_pretrain_gpt_refuses_a_bin_one_byte_short(corpus, tmp_path):
    prefix = _copy(corpus["txt_prefix"], str(tmp_path / "short_text_document"))
    _shorten(prefix + ".bin", by=1)
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, SCRIPT, *TINY, "--train-iters", "2", "--data-path", prefix,
         "--split", "100,0,0", "--data-cache-path", str(cache)],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600)
    assert proc.returncode != 0, proc.stdout[-2000:]
    size = os.path.getsize(prefix + ".bin")
    assert (f"--data-path {prefix}: {prefix}.idx does not describe {prefix}.bin (the .bin "
            f"is {size} bytes, the .idx describes {size + 1})") in proc.stderr, proc.stderr[-3000:]
    assert "lm loss" not in proc.stdout  # no step ran
    assert not cache.exists()
