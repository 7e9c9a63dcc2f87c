"""Tokenizers by Megatron-LM's ``--tokenizer-type`` names, and Megatron's vocabulary padding.

Every tokenizer can be the ``tokenizer`` of a Megatron-Core ``GPTDatasetConfig``: it exposes
``vocab_size``, ``eod``, ``unique_identifiers`` (part of the dataset cache key),
``tokenize(text) -> list[int]`` and ``detokenize(ids)``.

* ``ByteTokenizer`` (default): the UTF-8 bytes of the text (ids 0..255) plus one
  end-of-document token ``eod = 256``; ``vocab_size = 257``. Needs no file.
* ``NullTokenizer``: Megatron-LM's ``_NullTokenizer``. The text already holds the ids as
  whitespace-separated integers. ``--vocab-size V`` counts the ordinary ids ``0..V-1``; the
  end-of-document id is ``V`` and the tokenizer's ``vocab_size`` is ``V + 1`` (exactly as in
  Megatron-LM, where ``eod = vocab_size_without_eod``).
* ``GPT2BPETokenizer`` (``--vocab-file vocab.json --merge-file merges.txt``): GPT-2's
  byte-level BPE run by the ``tokenizers`` library; ``eod`` is ``<|endoftext|>``. Megatron-Core
  0.16.1's own GPT-2 path (``MegatronHFTokenizer``) loads the "gpt2" tokenizer from the
  Hugging Face Hub, so it cannot run offline; Megatron-LM's ``_GPT2BPETokenizer`` lives in its
  training repository, not in megatron-core. Like it, ``<|endoftext|>`` is not a special
  token inside text, and ``vocab_size`` is the size of vocab.json.
* ``HuggingFaceTokenizer`` (``--tokenizer-model DIR``): Megatron-Core's
  ``HuggingFaceTokenizer`` (``transformers.AutoTokenizer``) over a local directory; ``eod``
  is the eos token. The directory must exist, so nothing is downloaded (Megatron-LM would
  take a Hub name too).
* ``SentencePieceTokenizer`` (``--tokenizer-model FILE.model``): Megatron-Core's
  ``SentencePieceTokenizer``, as Megatron-LM builds it by default; ``eod`` is the model's eos
  id and no token is added. (Megatron-LM's ``--legacy-tokenizer`` path appends ``<EOD>``,
  ``<PAD>``, ... tokens instead.)

The three file-based ones need the ``[tokenizers]`` extra (``pip install -e .[tokenizers]``).
The model's embedding size is ``padded_vocab_size(tokenizer.vocab_size, ...)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections import OrderedDict
from typing import Iterable, List, Optional

from megatron_snake.errors import FlagError

# --tokenizer-type -> the file flags it reads (its dest names).
TOKENIZER_FILES = {
    "ByteTokenizer": (),
    "NullTokenizer": (),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
}
TOKENIZER_TYPES = tuple(TOKENIZER_FILES)
_FILE_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")
# The package each file-based type imports.
_LIBRARY = {"GPT2BPETokenizer": "tokenizers", "HuggingFaceTokenizer": "transformers",
            "SentencePieceTokenizer": "sentencepiece"}


class ByteTokenizer:
    """UTF-8 byte-level tokenizer: ids 0..255 are bytes, 256 is the end-of-document token."""

    _EOD = 256

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return self._EOD

    @property
    def eos(self) -> int:
        return self._EOD

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """Identifies this tokenizer in Megatron-Core's dataset index cache key."""
        return OrderedDict({"class": "ByteTokenizer"})

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Bytes back to text. The eod token is dropped; invalid UTF-8 (e.g. a sequence cut
        in the middle of a character) is replaced by U+FFFD instead of raising."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if i == self._EOD:
                continue
            if not 0 <= i < 256:
                raise ValueError(f"ByteTokenizer: id {i} is outside 0..256")
            data.append(i)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eod=256)"


class NullTokenizer:
    """Megatron-LM's NullTokenizer: the text is whitespace-separated integer ids.

    ``vocab_size`` (the ``--vocab-size`` value) is the number of ordinary ids; eod is that
    same number and ``self.vocab_size`` is one more.
    """

    def __init__(self, vocab_size: int):
        vocab_size = int(vocab_size)
        if vocab_size <= 0:
            raise FlagError(f"--vocab-size must be positive for NullTokenizer, got {vocab_size}")
        self._vocab_size_without_eod = vocab_size
        self._eod_id = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict(
            {"class": "NullTokenizer", "vocab_size": self._vocab_size_without_eod}
        )

    def tokenize(self, text: str) -> List[int]:
        ids = []
        for tok in text.split():
            try:
                i = int(tok)
            except ValueError:
                raise ValueError(
                    f"NullTokenizer expects whitespace-separated integer ids, got {tok!r}"
                ) from None
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"NullTokenizer: id {i} is outside 0..{self.vocab_size - 1} "
                    f"(--vocab-size {self._vocab_size_without_eod}; eod is "
                    f"{self._eod_id})"
                )
            ids.append(i)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


class GPT2BPETokenizer:
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE (vocab.json + merges.txt), run
    by the ``tokenizers`` library. ``eod`` is ``<|endoftext|>``."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        self._files = [os.path.abspath(vocab_file), os.path.abspath(merge_file)]
        try:
            self._tokenizer = ByteLevelBPETokenizer(*self._files)
        except Exception as exc:  # the library raises its own (Rust) exception type
            raise FlagError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a "
                            f"GPT-2 vocab.json and merges.txt ({exc})") from None
        self._eod = self._tokenizer.token_to_id(self.EOD_TOKEN)
        if self._eod is None:
            raise FlagError(f"--vocab-file {vocab_file}: has no {self.EOD_TOKEN} token, "
                            "which GPT2BPETokenizer uses as the end-of-document token")

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict({"class": "GPT2BPETokenizer", "tokenizer_path": self._files})

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        # eod decodes to its text, as in Megatron-LM (it is not a special token here)
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"GPT2BPETokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


def add_tokenizer_args(group) -> None:
    """The tokenizer flags (Megatron-LM's names), shared by pretrain_gpt and preprocess_data."""
    others = [t for t in TOKENIZER_TYPES if t != "ByteTokenizer"]
    group.add_argument("--tokenizer-type", default="ByteTokenizer",
                       help=f"{', '.join(others[:-1])} or {others[-1]} (default: %(default)s)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer's vocabulary size, without eod")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    group.add_argument("--tokenizer-model", default=None,
                       help="HuggingFaceTokenizer's directory, SentencePieceTokenizer's .model")


def tokenizer_flags(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`build_tokenizer` from parsed flags."""
    return {name: getattr(args, name)
            for name in ("tokenizer_type", "vocab_size", *_FILE_FLAGS)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_files(tokenizer_type: str, files: dict) -> None:
    """Each type gets exactly the file flags it reads, and they exist."""
    needed = TOKENIZER_FILES[tokenizer_type]
    for name, path in files.items():
        if path is not None and name not in needed:
            reads = " and ".join(map(_flag, needed)) or "no file"
            raise ValueError(f"{_flag(name)} is not read by --tokenizer-type {tokenizer_type} "
                             f"(it reads {reads}); drop the flag or change the type")
    if any(files[name] is None for name in needed):
        raise FlagError(f"--tokenizer-type {tokenizer_type} needs "
                        f"{' and '.join(_flag(name) for name in needed)}")
    # HuggingFaceTokenizer takes a directory: a Hub name is refused, so nothing downloads
    want_dir = tokenizer_type == "HuggingFaceTokenizer"
    kind = "local directory (nothing is downloaded)" if want_dir else "file"
    for name in needed:
        if not (os.path.isdir if want_dir else os.path.isfile)(files[name]):
            raise ValueError(f"{_flag(name)} {files[name]}: no such {kind}")
    library = _LIBRARY.get(tokenizer_type)
    if library and importlib.util.find_spec(library) is None:
        raise FlagError(f"--tokenizer-type {tokenizer_type} needs the {library} package: "
                        f"pip install {library} (or pip install -e .[tokenizers])")


def _megatron_core_tokenizer(tokenizer_type: str, path: str):
    """Megatron-Core's own tokenizer ("huggingface" or "sentencepiece" library)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.tokenizers import MegatronTokenizer

    library = "huggingface" if tokenizer_type == "HuggingFaceTokenizer" else "sentencepiece"
    try:
        tokenizer = MegatronTokenizer.from_pretrained(
            tokenizer_path=os.path.abspath(path), metadata_path={"library": library})
    except (ValueError, OSError, RuntimeError) as exc:
        raise FlagError(f"--tokenizer-model {path}: cannot load it as a {tokenizer_type} "
                        f"({exc})") from None
    eod = tokenizer.eod
    if eod is None or eod < 0:  # HF: no eos (nor sep) token; SentencePiece: eos_id -1
        raise FlagError(f"--tokenizer-model {path}: the tokenizer has no eos token, which "
                        "Megatron uses as the end-of-document token")
    return tokenizer


def build_tokenizer(tokenizer_type: str = "ByteTokenizer", vocab_size: Optional[int] = None,
                    *, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None):
    """Build a tokenizer by its ``--tokenizer-type`` name; the keyword arguments are the
    flags of :func:`add_tokenizer_args` (pass ``**tokenizer_flags(args)``).

    ``vocab_size`` is ``--vocab-size``: required by NullTokenizer. Megatron-LM ignores it
    for the others (their vocabulary is the tokenizer's); here it is an error, like a file
    flag the type does not read. Raises ValueError naming the flag on bad input.
    """
    if tokenizer_type is None:
        tokenizer_type = "ByteTokenizer"
    if tokenizer_type not in TOKENIZER_FILES:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; valid choices: "
                         f"{', '.join(TOKENIZER_TYPES)}")
    _check_files(tokenizer_type, {"vocab_file": vocab_file, "merge_file": merge_file,
                                  "tokenizer_model": tokenizer_model})
    if vocab_size is not None and tokenizer_type != "NullTokenizer":
        raise FlagError(f"--vocab-size is read by --tokenizer-type NullTokenizer only; "
                        f"{tokenizer_type}'s vocabulary is its own: drop --vocab-size")
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise FlagError("--tokenizer-type NullTokenizer requires --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    return _megatron_core_tokenizer(tokenizer_type, tokenizer_model)


def padded_vocab_size(
    orig_vocab_size: int,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round ``orig_vocab_size`` up to a multiple
    of ``make_vocab_size_divisible_by * tensor_model_parallel_size``."""
    multiple = int(make_vocab_size_divisible_by) * int(tensor_model_parallel_size)
    if multiple <= 0:
        raise ValueError(
            "--make-vocab-size-divisible-by and --tensor-model-parallel-size must be positive"
        )
    return -(-int(orig_vocab_size) // multiple) * multiple
