"""Tokenizers that need no download, and Megatron's vocabulary padding rule.

Two tokenizers are offered, both usable as the ``tokenizer`` of a Megatron-Core
``GPTDatasetConfig`` (they expose ``vocab_size``, ``eod`` and ``unique_identifiers``):

* ``ByteTokenizer`` (default): the UTF-8 bytes of the text (ids 0..255) plus one
  end-of-document token ``eod = 256``; ``vocab_size = 257``.
* ``NullTokenizer``: Megatron-LM's ``_NullTokenizer``. The text already holds the ids as
  whitespace-separated integers. ``--vocab-size V`` counts the ordinary ids ``0..V-1``; the
  end-of-document id is ``V`` and the tokenizer's ``vocab_size`` is ``V + 1`` (exactly as in
  Megatron-LM, where ``eod = vocab_size_without_eod``).

The model's embedding size is ``padded_vocab_size(tokenizer.vocab_size, ...)``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Optional

TOKENIZER_TYPES = ("ByteTokenizer", "NullTokenizer")


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
            raise ValueError(f"--vocab-size must be positive for NullTokenizer, got {vocab_size}")
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


def build_tokenizer(tokenizer_type: str = "ByteTokenizer", vocab_size: Optional[int] = None):
    """Build a tokenizer by its ``--tokenizer-type`` name.

    ``vocab_size`` is ``--vocab-size``: required by NullTokenizer, ignored by ByteTokenizer
    (whose vocabulary is fixed at 257), as Megatron-LM ignores it for file-based tokenizers.
    """
    if tokenizer_type is None:
        tokenizer_type = "ByteTokenizer"
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer requires --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; valid choices: "
        f"{', '.join(TOKENIZER_TYPES)}"
    )


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
