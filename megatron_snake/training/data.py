"""GPT datasets and micro-batch iteration on top of Megatron-Core's dataset code.

* :func:`build_gpt_datasets` builds the (train, valid, test) datasets with Megatron-Core's
  ``BlendedMegatronDatasetBuilder`` / ``GPTDatasetConfig`` / ``GPTDataset`` (or
  ``MockGPTDataset``), from Megatron indexed datasets written by ``tools/preprocess_data.py``.
* :func:`micro_batches` iterates a dataset in Megatron-LM's ``MegatronPretrainingSampler``
  order and collates each micro-batch into the dict ``pretrain_gpt.get_batch`` produces.

Works with or without ``torch.distributed``. When it is initialized, every rank must call
:func:`build_gpt_datasets` (the builder runs barriers): global rank 0 builds and caches the
index files first, the other ranks then load them, so ``data_cache_path`` must be visible to
all ranks (a shared file system on multi-node jobs).
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import logging
import os
import signal
import struct
import warnings
import weakref
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch
from torch.utils.data import DataLoader

from megatron_snake.errors import FlagError, UserError
from megatron_snake.storage.safe_files import private_dir

GPT_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


class _NoMockCacheNotice(logging.Filter):
    """Mock data has no index worth caching: Megatron's "Unable to save MockGPTDataset
    indexes" on every run is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to save MockGPTDataset indexes")


_MOCK_CACHE_NOTICE = _NoMockCacheNotice()


def _megatron_datasets():
    """Import Megatron-Core's dataset modules lazily (importing megatron.core is slow and
    warns about the missing Transformer Engine / Apex on CPU machines)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets import blended_megatron_dataset_builder as bmdb
        from megatron.core.datasets.blended_dataset import BlendedDataset
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    logging.getLogger(GPTDataset.__module__).addFilter(_MOCK_CACHE_NOTICE)  # added once
    return bmdb, BlendedDataset, GPTDataset, GPTDatasetConfig, MockGPTDataset


# --------------------------------------------------------------------------------------------
# --data-path parsing
# --------------------------------------------------------------------------------------------


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path"
                    ) -> Tuple[List[str], Optional[List[float]]]:
    """Parse a Megatron-style ``--data-path`` list into (prefixes, weights or None).

    ``["prefix"]``, ``["prefixA", "prefixB"]`` (weights from the dataset sizes) or
    ``["0.3", "prefixA", "0.7", "prefixB"]``. A prefix may also be given with its ``.bin`` or
    ``.idx`` suffix. Each prefix must have both ``.bin`` and ``.idx`` files, and they must
    make one dataset (:func:`check_indexed_dataset`; else :class:`DataError`). Prefixes are
    returned as absolute paths (Megatron hashes them into the index-cache key). ``flag``
    names the flag in errors (``--train-data-path`` etc. follow the same rules).
    """
    if isinstance(data_path, str):
        data_path = data_path.split()
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError(
            f"{flag} is empty (pass at least one dataset prefix, or use --mock-data)"
        )
    if len(items) % 2 == 0 and all(_is_number(items[i]) for i in range(0, len(items), 2)):
        weights = [float(items[i]) for i in range(0, len(items), 2)]
        prefixes = [items[i] for i in range(1, len(items), 2)]
        bad = [w for w in weights if not w > 0]
        if bad:
            raise ValueError(f"{flag} weights must be positive, got {weights}")
    elif any(_is_number(x) for x in items):
        raise ValueError(
            f"{flag} {' '.join(items)!r}: expected either prefixes only or "
            f"'weight prefix' pairs, e.g. {flag} 0.3 dataA_text_document 0.7 "
            "dataB_text_document"
        )
    else:
        weights = None
        prefixes = items
    resolved = []
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if prefix.endswith(suffix) and not os.path.exists(prefix + ".bin"):
                prefix = prefix[: -len(suffix)]
                break
        for suffix in (".bin", ".idx"):
            path = prefix + suffix
            if not os.path.isfile(path):
                hint = ""
                if not prefix.endswith("_document"):
                    hint = (
                        " (tools/preprocess_data.py writes <output-prefix>_text_document.bin/.idx;"
                        " pass <output-prefix>_text_document)"
                    )
                raise DataFileMissing(f"{flag} {prefix}: missing file {path}{hint}")
        check_indexed_dataset(prefix, flag)
        resolved.append(os.path.abspath(prefix))
    return resolved, weights


class DataError(UserError, ValueError):
    """A dataset prefix whose files cannot be used: missing, or not one dataset."""


class DataFileMissing(DataError, FileNotFoundError):
    """A dataset prefix without its .bin or .idx file (a FileNotFoundError, as before)."""


_IDX_FIXED = 34  # header 9, version 8, dtype code 1, sequence count 8, document count 8
_IDX_CHUNK = 1 << 20  # sequences per pass: bounded memory on corpora of 1e9 sequences


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> None:
    """Refuse (DataError) a Megatron indexed dataset whose .idx and .bin do not belong
    together, before anything reads it: Megatron-Core reads the .bin at the offsets the .idx
    gives, so a foreign, short or retyped pair trains on wrong tokens or fails mid-run.

    The .idx layout is megatron.core's _IndexWriter's: the header, version 1, a dtype code
    of DType, the sequence and document counts n and d, then int32 lengths[n], int64
    pointers[n], int64 document_indices[d] and, in a multimodal dataset, int8 modes[n].
    Checked: that layout and size exactly, pointers[i] == the sum of the lengths before i
    times the token size, document_indices from 0 to n, and the .bin's size == the end of
    the last sequence. Read through a memmap, a chunk at a time.
    """
    with warnings.catch_warnings():  # importing megatron.core warns about TE and Apex
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx_path, bin_path = prefix + ".idx", prefix + ".bin"

    def refuse(problem: str) -> DataError:
        return DataError(
            f"{flag} {prefix}: {idx_path} does not describe {bin_path} ({problem}); re-run "
            f"tools/preprocess_data.py for this prefix, or fix {flag}")

    idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
    with open(idx_path, "rb") as f:
        fixed = f.read(_IDX_FIXED)
    if fixed[:9] != _INDEX_HEADER:
        raise refuse(f"the .idx ({idx_size} bytes) does not start with Megatron's index header")
    if len(fixed) < _IDX_FIXED:
        raise refuse(f"the .idx is {idx_size} bytes, shorter than its {_IDX_FIXED}-byte header")
    version, code, n, d = struct.unpack("<QBQQ", fixed[9:])
    if version != 1:
        raise refuse(f"the .idx has format version {version}, not 1")
    if code not in {c.value for c in DType}:
        raise refuse(f"the .idx has dtype code {code}, none of Megatron's "
                     f"{sorted(c.value for c in DType)}")
    if d == 0:  # Megatron's writer always starts them with 0
        raise refuse("the .idx has no document indices")
    arrays = _IDX_FIXED + 12 * n + 8 * d
    if idx_size not in (arrays, arrays + n):  # without or with the multimodal modes
        raise refuse(f"the .idx is {idx_size} bytes, not the {arrays} its {n} sequences "
                     f"and {d} document indices take")
    itemsize = DType.size(code)
    mm = numpy.memmap(idx_path, mode="r", offset=_IDX_FIXED)
    lengths = mm[:4 * n].view(numpy.int32)
    pointers = mm[4 * n:12 * n].view(numpy.int64)
    docs = mm[12 * n:12 * n + 8 * d].view(numpy.int64)
    if (int(docs[0]), int(docs[-1])) != (0, n):  # Megatron asserts the end; GPT needs no more
        raise refuse(f"its document indices run {int(docs[0])}..{int(docs[-1])}, not 0..{n}")
    end = 0  # where in the .bin the next sequence starts
    for beg in range(0, n, _IDX_CHUNK):
        nbytes = lengths[beg:beg + _IDX_CHUNK].astype(numpy.int64) * itemsize
        starts = end + numpy.cumsum(nbytes) - nbytes
        if (nbytes < 0).any() or not numpy.array_equal(pointers[beg:beg + _IDX_CHUNK], starts):
            name = numpy.dtype(DType.dtype_from_code(code)).name
            raise refuse(f"its sequence pointers do not match its lengths in {name} tokens of "
                         f"{itemsize} bytes: a changed dtype code or a damaged .idx")
        end = int(starts[-1] + nbytes[-1])
    if bin_size != end:
        raise refuse(f"the .bin is {bin_size} bytes, the .idx describes {end}")


def default_data_cache_path() -> str:
    """Where dataset index caches go unless ``data_cache_path`` is given:
    ``$MEGATRON_SNAKE_DATA_CACHE``, else ``$XDG_CACHE_HOME/megatron_snake/dataset_indices``
    (``~/.cache/...``). Never the data directory, which may be read-only."""
    env = os.environ.get("MEGATRON_SNAKE_DATA_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_snake", "dataset_indices")


def _data_fingerprint(prefixes: Sequence[str]) -> str:
    """A short hash of the data files' paths, sizes and modification times: the cache
    subdirectory, so that rewriting a dataset in place never reuses stale indices."""
    h = hashlib.sha1()
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            st = os.stat(prefix + suffix)
            h.update(f"{prefix}{suffix}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _parse_split(split: str) -> List[float]:
    """``--split`` "969,30,1" -> normalized [train, valid, test] weights (Megatron's rule)."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--split {split!r}: expected comma-separated numbers, e.g. 969,30,1"
        ) from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(
            f"--split {split!r}: expected 1 to 3 non-negative numbers with a positive sum"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def _document_lengths(prefix: str, mmap_bin_files: bool, flag: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        # Copy: the array views the .idx mmap, which the dataset's __del__ closes.
        indexed = IndexedDataset(prefix, mmap=mmap_bin_files)
        lengths = indexed.sequence_lengths.copy()
        del indexed
    except Exception as err:  # a corrupt or foreign .idx
        raise ValueError(f"{flag} {prefix}: cannot read the indexed dataset: {err}") from err
    return lengths


def _check_splits_nonempty(prefixes: Sequence[str], split: str, mmap_bin_files: bool) -> None:
    """Megatron's GPTDataset loops forever when a split it must build has no tokens
    (GPTDataset._get_num_epochs). Refuse such a configuration with a clear message."""
    vector = _parse_split(split)
    bounds, acc = [], 0.0
    for w in vector:
        bounds.append(None if w == 0 else (acc, acc + w))
        acc += w
    names = ("train", "valid", "test")
    for prefix in prefixes:
        lengths = _document_lengths(prefix, mmap_bin_files, "--data-path")
        n = len(lengths)
        for name, bound in zip(names, bounds):
            if bound is None:
                continue
            beg = int(round(bound[0] * float(n)))
            end = int(round(bound[1] * float(n)))
            if end <= beg or int(lengths[beg:end].sum()) == 0:
                raise ValueError(
                    f"--split {split} leaves the {name} split of --data-path {prefix} empty "
                    f"({end - beg} of its {n} documents). Use more documents, or give that "
                    "split weight 0 (e.g. --split 100,0,0)."
                )


def _check_nonempty(prefixes: Sequence[str], flag: str, mmap_bin_files: bool) -> None:
    """A --train/valid/test-data-path dataset is used whole: it must hold a token (the same
    endless loop as an empty --split part otherwise)."""
    for prefix in prefixes:
        if int(_document_lengths(prefix, mmap_bin_files, flag).sum()) == 0:
            raise ValueError(f"{flag} {prefix}: the dataset holds no tokens")


def num_samples_for(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> Tuple[int, int, int]:
    """Megatron-LM's train/valid/test sample counts for a run of ``train_iters`` steps:
    (train_iters*gbs, (train_iters//eval_interval + 1)*eval_iters*gbs, eval_iters*gbs)."""
    train = train_iters * global_batch_size
    valid = (train_iters // max(eval_interval, 1) + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return train, valid, test


# --------------------------------------------------------------------------------------------
# Dataset building
# --------------------------------------------------------------------------------------------


def _builder_class():
    bmdb, BlendedDataset, _, _, _ = _megatron_datasets()

    class _Builder(bmdb.BlendedMegatronDatasetBuilder):
        """Megatron-Core's builder, with one fix for runs without torch.distributed:
        BlendedDataset calls torch.distributed.get_rank() on a cache miss when a cache path
        is set, which raises if no process group exists. Without torch.distributed the blend
        indices (cheap, built in C++) are therefore built in memory and not cached."""

        @staticmethod
        def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
            if cls is BlendedDataset and not torch.distributed.is_initialized():
                *rest, config = args
                if config.path_to_cache is not None:
                    config = copy.copy(config)
                    config.path_to_cache = None
                args = (*rest, config)
            return bmdb.BlendedMegatronDatasetBuilder.build_generic_dataset(
                cls, is_built_on_rank, synchronize_ranks, *args
            )

    return _Builder


def build_gpt_datasets(
    *,
    mock: bool,
    data_path: Optional[Sequence[str]],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    num_samples: Tuple[Optional[int], Optional[int], Optional[int]],
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    data_cache_path: Optional[str] = None,
    mmap_bin_files: bool = True,
    train_data_path: Optional[Sequence[str]] = None,
    valid_data_path: Optional[Sequence[str]] = None,
    test_data_path: Optional[Sequence[str]] = None,
):
    """Build the (train, valid, test) GPT datasets; a split with weight 0 gives None.

    Args:
        mock: use Megatron's ``MockGPTDataset`` (synthetic documents; ``data_path`` and
            ``split`` are ignored, Megatron forces split "1,1,1").
        data_path: ``--data-path`` (see :func:`parse_data_path`).
        split: ``--split``, e.g. "969,30,1".
        train_data_path, valid_data_path, test_data_path: instead of ``data_path`` and
            ``split``, Megatron's separate datasets per split (``blend_per_split``), each
            used whole and written like ``data_path``; a split without one gives None.
        tokenizer: a tokenizer from :mod:`megatron_snake.training.tokenizer` (anything with
            ``vocab_size``, ``eod`` and ``unique_identifiers``).
        num_samples: the number of samples each split must provide (None: one epoch). The
            datasets repeat epochs to reach it; :func:`micro_batches` raises when a run reads
            past the end, so pass enough: ``num_samples_for(train_iters, global_batch_size,
            eval_interval, eval_iters)`` is Megatron-LM's rule (train = train_iters * gbs).
        data_cache_path: ``--data-cache-path`` for the document/sample/shuffle index files
            (default :func:`default_data_cache_path`). Must be shared by all ranks when
            torch.distributed is initialized. Unused for mock data (built in memory).
        mmap_bin_files: mmap the .bin files (``--no-mmap-bin-files`` sets False).

    Each sample is a dict with ``tokens``/``labels`` [s] int64 (labels[t] == tokens[t+1] of
    the underlying token stream), ``loss_mask`` [s] float32, ``position_ids`` [s] int64 and,
    if ``create_attention_mask``, ``attention_mask`` [1, s, s] bool (True = masked).
    """
    _, _, GPTDataset, GPTDatasetConfig, MockGPTDataset = _megatron_datasets()
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    num_samples = list(num_samples)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must have 3 entries (train, valid, test), got {num_samples}")
    for tok_attr in ("vocab_size", "eod", "unique_identifiers"):
        if not hasattr(tokenizer, tok_attr):
            raise TypeError(f"tokenizer {tokenizer!r} lacks {tok_attr!r}")

    if mock:
        blend = blend_per_split = None
        path_to_cache = None
        cls = MockGPTDataset
    else:
        per_split = (train_data_path, valid_data_path, test_data_path)
        blend = blend_per_split = None
        if any(p is not None for p in per_split):
            if data_path:
                raise FlagError("--data-path and --train-data-path/--valid-data-path/"
                                "--test-data-path are mutually exclusive; give one of them")
            blend_per_split = [None if p is None else parse_data_path(p, flag)
                               for p, flag in zip(per_split, PER_SPLIT_FLAGS)]
            for b, flag, n in zip(blend_per_split, PER_SPLIT_FLAGS, num_samples):
                if b is not None:
                    _check_nonempty(b[0], flag, mmap_bin_files)
                if b is not None and b[1] is not None and n is None:
                    raise ValueError(f"{flag} with weights needs a sample count for its split")
            split = None  # Megatron: split and blend_per_split are incompatible
            prefixes = [p for b in blend_per_split if b is not None for p in b[0]]
        else:
            if not data_path:
                raise FlagError("--data-path is required unless --mock-data is set")
            prefixes, weights = parse_data_path(data_path)
            _check_splits_nonempty(prefixes, split, mmap_bin_files)
            blend = (prefixes, weights)
            if weights is not None and any(n is None for n in num_samples):
                raise ValueError(
                    "--data-path with weights needs a sample count for every split "
                    f"(num_samples={tuple(num_samples)})"
                )
        cache_root = data_cache_path or default_data_cache_path()
        # Megatron reads its index caches back with numpy's pickle-enabled loader: the run
        # uses a cache directory only when it is a real one of this user's, mode 0700, so
        # nobody else can plant a file in it (the root the user names may be shared)
        os.makedirs(cache_root, exist_ok=True)
        path_to_cache = os.path.join(cache_root, _data_fingerprint(prefixes))
        private_dir(path_to_cache, what="--data-cache-path entry")
        cls = GPTDataset

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if mock else split,
        path_to_cache=path_to_cache,
        mmap_bin_files=mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    with warnings.catch_warnings():
        # Megatron warns when tokenizer.pad is missing / collides; our tokenizers have no pad.
        warnings.filterwarnings("ignore", message="The pad token id in the tokenizer collides")
        datasets = _builder_class()(cls, num_samples, lambda: True, config).build()
    return tuple(datasets)


# --------------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------------


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """Stack per-sample dicts into Megatron's GPT batch: tokens/labels/position_ids [b, s]
    int64, loss_mask [b, s] float32, attention_mask [b, 1, s, s] bool or None."""
    batch: Dict[str, Optional[torch.Tensor]] = {}
    for key in GPT_BATCH_KEYS:
        if key not in samples[0] or samples[0][key] is None:
            batch[key] = None
            continue
        batch[key] = torch.stack([torch.as_tensor(s[key]) for s in samples])
    for key in ("tokens", "labels", "position_ids"):
        batch[key] = batch[key].long()
    batch["loss_mask"] = batch["loss_mask"].float()
    if batch["attention_mask"] is not None:
        batch["attention_mask"] = batch["attention_mask"].bool()
    return batch


def micro_batches(
    dataset,
    *,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int,
    num_workers: int = 0,
) -> Iterator[Dict[str, Optional[torch.Tensor]]]:
    """Infinite, deterministic iterator of this rank's micro-batches.

    Same order as Megatron-LM's ``MegatronPretrainingSampler``: the i-th global window is
    the samples ``[c + i*w, c + (i+1)*w)`` with ``c = consumed_samples`` and
    ``w = micro_batch_size * data_parallel_size``; rank r takes its ``r``-th slice of
    ``micro_batch_size`` samples. Resuming with ``consumed_samples`` = (micro-batches taken)
    * w continues exactly where a run stopped.

    ``num_workers`` > 0 (``--num-workers``): a torch DataLoader whose worker processes read
    and collate the same micro-batches ahead, in the same order.

    Raises RuntimeError (on the ``next()`` that needs it) when a window reaches past
    ``len(dataset)``: build the dataset with ``num_samples`` >= train_iters *
    global_batch_size (see :func:`num_samples_for`).
    """
    if dataset is None:
        raise ValueError(
            "dataset is None (its --split weight is 0, or it was not built on this rank)"
        )
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank {data_parallel_rank} must be in [0, {data_parallel_size})"
        )
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
    if num_workers < 0:
        raise FlagError(f"--num-workers must be >= 0, got {num_workers}")
    return _micro_batch_generator(dataset, micro_batch_size, data_parallel_rank,
                                  data_parallel_size, consumed_samples, num_workers)


def _windows(total, mbs, dp_rank, dp_size, consumed):
    """This rank's sample indices, one list per micro-batch, while the windows fit."""
    window = mbs * dp_size
    while consumed + window <= total:
        start = consumed + dp_rank * mbs
        yield list(range(start, start + mbs))
        consumed += window


def _leave_signals_to_the_rank(_worker_id: int) -> None:
    """A DataLoader worker ignores SIGTERM. torchrun signals a rank's process group and
    Slurm every process of the job step; a worker killed by that SIGTERM would end the rank
    with "DataLoader worker is killed by signal" before --exit-signal-handler could finish
    the iteration and save. A worker whose rank is gone exits on its own (the DataLoader's
    watchdog), and the rank kills the ones left at its exit (``_kill_workers_at_exit``)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _kill_workers_at_exit() -> None:
    """multiprocessing ends daemonic children at exit with SIGTERM and then waits for
    them; a DataLoader worker ignores SIGTERM, so it is killed first instead. Registered
    after multiprocessing's own exit function (``import torch`` imports it), so it runs
    before it."""
    for worker in list(_workers):
        if worker.is_alive():
            worker.kill()
            worker.join()


_workers = weakref.WeakSet()   # the DataLoader worker processes this rank started
atexit.register(_kill_workers_at_exit)


def _workers_loader(dataset, indices, num_workers):
    # The index lists are the batch sampler, so the order and the resume point are the
    # ones of ``_windows`` (the DataLoader keeps its workers' batches in order). Its own
    # generator: seeding the workers must not draw from the global RNG dropout uses.
    batches = iter(DataLoader(
        dataset, batch_sampler=indices, collate_fn=collate, num_workers=num_workers,
        generator=torch.Generator(), worker_init_fn=_leave_signals_to_the_rank))
    _workers.update(batches._workers)
    return batches


def _micro_batch_generator(dataset, mbs, dp_rank, dp_size, consumed, num_workers):
    total, window = len(dataset), mbs * dp_size
    indices = _windows(total, mbs, dp_rank, dp_size, consumed)
    if num_workers:
        batches = _workers_loader(dataset, indices, num_workers)
    else:
        batches = (collate([dataset[i] for i in idx]) for idx in indices)
    for batch in batches:
        yield batch
        consumed += window
    raise RuntimeError(
        f"data exhausted: the dataset has {total} samples, but the micro-batch window "
        f"at consumed_samples={consumed} needs samples up to {consumed + window} "
        f"(micro_batch_size {mbs} x data_parallel_size {dp_size}). Build the datasets "
        "with num_samples >= train_iters * global_batch_size (num_samples_for())."
    )


def random_microbatches(num: int, batch: int, seq: int, vocab: int, *, seed: int = 0,
                        loss_mask_drop: float = 0.0, device=None) -> List[Dict[str, torch.Tensor]]:
    """``num`` micro-batches of uniformly random tokens with Megatron's GPT batch keys (a
    causal mask; ``loss_mask_drop`` of the tokens masked out of the loss at random): for
    tests and benchmarks that need no dataset."""
    gen = torch.Generator().manual_seed(seed)
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).logical_not()
    out = []
    for _ in range(num):
        text = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        loss_mask = (torch.rand(batch, seq, generator=gen) >= loss_mask_drop).float()
        mb = dict(tokens=text[:, :-1].contiguous(), labels=text[:, 1:].contiguous(),
                  loss_mask=loss_mask,
                  attention_mask=causal[None, None].expand(batch, 1, seq, seq),
                  position_ids=torch.arange(seq)[None].expand(batch, seq))
        out.append({k: v.to(device) for k, v in mb.items()} if device is not None else mb)
    return out
