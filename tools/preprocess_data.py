#!/usr/bin/env python
"""Tokenize a text corpus into a Megatron indexed dataset (``.bin`` + ``.idx``).

A small counterpart of Megatron-LM's ``tools/preprocess_data.py``. Input formats:

* ``.json`` / ``.jsonl``: one JSON object per line; each key of ``--json-keys`` (default
  ``text``) holds a document's text.
* anything else (e.g. ``.txt``): one document per line; blank lines are skipped.

Output, per key: ``<output-prefix>_<key>_document.bin`` and ``..._document.idx`` (for plain
text the key is ``text``). Pass ``<output-prefix>_text_document`` to ``--data-path``.
Each document is one sequence; ``--append-eod`` appends the tokenizer's end-of-document id to
each document (recommended for GPT pretraining). Empty documents are skipped.

The files are written under temporary names and renamed at the end, so a failed run leaves
no half-written dataset behind.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --append-eod --workers 4

The tokenizer flags are pretrain_gpt.py's (``--tokenizer-type`` and the files it reads,
e.g. ``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``);
train with the same ones.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron_snake.training.tokenizer import (  # noqa: E402
    add_tokenizer_args, build_tokenizer, tokenizer_flags)


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="Input file: .json/.jsonl (one JSON object per line) or text "
                            "(one document per line).")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Keys to extract from each JSON line (JSON input only).")
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_args(group)
    group.add_argument("--append-eod", action="store_true",
                       help="Append the end-of-document token to every document.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Path prefix of the output files (without suffix).")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="Number of tokenizer processes.")
    group.add_argument("--log-interval", type=int, default=0,
                       help="Print progress every N documents (0: only at the end).")
    return parser.parse_args(argv)


def _is_json_input(path: str) -> bool:
    return path.endswith(".json") or path.endswith(".jsonl")


class _Encoder:
    """Turns one input line into token ids per key; picklable for multiprocessing."""

    def __init__(self, args: argparse.Namespace):
        self.tokenizer_flags = tokenizer_flags(args)
        self.json_keys = list(args.json_keys)
        self.append_eod = bool(args.append_eod)
        self.input = args.input
        self.is_json = _is_json_input(args.input)
        self.tokenizer = None

    def initializer(self) -> None:
        self.tokenizer = build_tokenizer(**self.tokenizer_flags)

    def encode(self, item: Tuple[int, str]) -> Tuple[int, Dict[str, List[int]], int]:
        lineno, line = item
        if self.tokenizer is None:
            self.initializer()
        if self.is_json:
            if not line.strip():
                return lineno, {}, len(line)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"--input {self.input}: line {lineno}: invalid JSON ({err.msg} at column "
                    f"{err.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"--input {self.input}: line {lineno}: expected a JSON object, got "
                    f"{type(obj).__name__}"
                )
            texts = {}
            for key in self.json_keys:
                if key not in obj:
                    raise ValueError(
                        f"--input {self.input}: line {lineno}: no key {key!r} (--json-keys "
                        f"{' '.join(self.json_keys)}; keys present: {sorted(obj)})"
                    )
                if not isinstance(obj[key], str):
                    raise ValueError(
                        f"--input {self.input}: line {lineno}: value of {key!r} is "
                        f"{type(obj[key]).__name__}, expected a string"
                    )
                texts[key] = obj[key]
        else:
            text = line.rstrip("\r\n")
            if not text.strip():
                return lineno, {}, len(line)
            texts = {"text": text}
        out = {}
        for key, text in texts.items():
            try:
                ids = self.tokenizer.tokenize(text)
            except ValueError as err:
                raise ValueError(f"--input {self.input}: line {lineno}: {err}") from None
            ids = list(ids)
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            out[key] = ids
        return lineno, out, len(line)


_WORKER_ENCODER: Optional[_Encoder] = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    encoder.initializer()
    _WORKER_ENCODER = encoder


def _encode_in_worker(item: Tuple[int, str]) -> Tuple[int, Dict[str, List[int]], int]:
    return _WORKER_ENCODER.encode(item)


def _read_lines(path: str) -> Iterator[Tuple[int, str]]:
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            yield lineno, line


def output_prefixes(output_prefix: str, keys: Sequence[str]) -> Dict[str, str]:
    """The dataset prefix (what ``--data-path`` takes) for each key."""
    return {key: f"{output_prefix}_{key}_document" for key in keys}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Run the preprocessing; returns {key: dataset prefix}. Raises FileNotFoundError /
    ValueError with the offending flag in the message on bad input."""
    args = get_args(argv)
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input: no such file: {args.input}")
    # Imported here so that --help and argument errors stay fast (megatron.core is heavy).
    import numpy

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    tokenizer = build_tokenizer(**tokenizer_flags(args))
    keys = list(args.json_keys) if _is_json_input(args.input) else ["text"]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--json-keys has duplicates: {keys}")

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = output_prefixes(args.output_prefix, keys)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp_suffix = f".tmp{os.getpid()}"
    builders = {
        key: IndexedDatasetBuilder(prefix + ".bin" + tmp_suffix, dtype=dtype)
        for key, prefix in prefixes.items()
    }

    encoder = _Encoder(args)
    pool = None
    t0 = time.time()
    n_docs = {key: 0 for key in keys}
    n_tokens = {key: 0 for key in keys}
    n_bytes = 0
    ok = False
    try:
        if args.workers > 1:
            # fork (the Linux default) so that the workers need not re-import this script.
            ctx = multiprocessing.get_context(
                "fork" if "fork" in multiprocessing.get_all_start_methods() else None
            )
            pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(encoder,))
            encoded = pool.imap(_encode_in_worker, _read_lines(args.input), chunksize=256)
        else:
            encoder.initializer()
            encoded = map(encoder.encode, _read_lines(args.input))
        for i, (_lineno, docs, nbytes) in enumerate(encoded, start=1):
            n_bytes += nbytes
            for key, ids in docs.items():
                if not ids:
                    continue
                builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                n_docs[key] += 1
                n_tokens[key] += len(ids)
            if args.log_interval and i % args.log_interval == 0:
                elapsed = max(time.time() - t0, 1e-9)
                print(f"processed {i} lines ({n_bytes / elapsed / 1e6:.2f} MB/s)",
                      file=sys.stderr)
        for key, prefix in prefixes.items():
            if n_docs[key] == 0:
                raise ValueError(f"--input {args.input}: no non-empty document for key {key!r}")
            builders[key].finalize(prefix + ".idx" + tmp_suffix)
        for prefix in prefixes.values():
            os.replace(prefix + ".bin" + tmp_suffix, prefix + ".bin")
            os.replace(prefix + ".idx" + tmp_suffix, prefix + ".idx")
        ok = True
    finally:
        if pool is not None:
            pool.terminate() if not ok else pool.close()
            pool.join()
        if not ok:
            for key, prefix in prefixes.items():
                try:
                    builders[key].data_file.close()
                except Exception:
                    pass
                for path in (prefix + ".bin" + tmp_suffix, prefix + ".idx" + tmp_suffix):
                    if os.path.exists(path):
                        os.remove(path)
    elapsed = time.time() - t0
    for key, prefix in prefixes.items():
        print(
            f"wrote {prefix}.bin/.idx: {n_docs[key]} documents, {n_tokens[key]} tokens "
            f"({tokenizer!r}, dtype {numpy.dtype(dtype).name}, {elapsed:.1f}s)",
            file=sys.stderr,
        )
    return prefixes


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as _err:
        sys.exit(f"error: {_err}")
