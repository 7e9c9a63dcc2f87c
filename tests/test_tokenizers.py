"""The file-based tokenizers (GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer):
round trips, eod, tools/preprocess_data.py and 5 training iterations with each, and one clear
error for each kind of bad tokenizer flag. The tokenizers are trained here from a small
corpus, so nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from conftest import expect_flag_error
from megatron_snake.training import build as build_module
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain
from megatron_snake.training.tokenizer import (GPT2BPETokenizer, build_tokenizer,
                                               padded_vocab_size)
from test_data import _load_preprocess

tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café",
         "日本語", "δέλτα", "tokens", "offload", "snake", "layer", "weights", "42", "1729", "✓"]
TEXT = "the quick brown fox jumps over the lazy dog: naïve café, 日本語 δέλτα ✓ 1729"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "5", "--log-interval", "1", "--lr", "1e-3", "--split", "100,0,0"]


def _documents(n: int = 200) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 11)) + "."
            for i in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A GPT-2 vocab.json + merges.txt, the same BPE as a transformers tokenizer directory
    (eos <|endoftext|>), one without an eos token, a SentencePiece model, and a jsonl corpus."""
    d = tmp_path_factory.mktemp("tokenizers")
    docs = _documents() + [TEXT]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=320, min_frequency=2, show_progress=False)
    bpe.save_model(str(d))
    vocab = json.loads((d / "vocab.json").read_text("utf-8"))
    vocab["<|endoftext|>"] = len(vocab)  # last, as in GPT-2's own vocab.json
    (d / "vocab.json").write_text(json.dumps(vocab), "utf-8")
    paths = {"vocab": str(d / "vocab.json"), "merges": str(d / "merges.txt")}

    for name, eos in (("hf", "<|endoftext|>"), ("hf_no_eos", None)):
        backend = tokenizers.ByteLevelBPETokenizer(paths["vocab"], paths["merges"])
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer,
                                                    eos_token=eos)
        fast.save_pretrained(str(d / name))
        paths[name] = str(d / name)

    (d / "corpus.txt").write_text("\n".join(docs) + "\n", "utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=120,
        character_coverage=1.0, model_type="bpe", minloglevel=2)
    paths["sp"] = str(d / "sp.model")

    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs),
                                    "utf-8")
    paths["jsonl"] = str(d / "corpus.jsonl")
    paths["dir"] = d
    return paths


def _flags(kind: str, files) -> list[str]:
    return {
        "GPT2BPETokenizer": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                             files["vocab"], "--merge-file", files["merges"]],
        "HuggingFaceTokenizer": ["--tokenizer-type", "HuggingFaceTokenizer",
                                 "--tokenizer-model", files["hf"]],
        "SentencePieceTokenizer": ["--tokenizer-type", "SentencePieceTokenizer",
                                   "--tokenizer-model", files["sp"]],
    }[kind]


def _build(kind: str, files):
    from megatron_snake.training.tokenizer import tokenizer_flags

    return build_tokenizer(**tokenizer_flags(parse_args(_flags(kind, files))))


KINDS = ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"]


# ------------------------------------------------------------------ round trips and eod


def test_gpt2_bpe_round_trip_and_eod(files):
    tok = _build("GPT2BPETokenizer", files)
    assert isinstance(tok, GPT2BPETokenizer)
    vocab = json.loads(open(files["vocab"], encoding="utf-8").read())
    assert tok.vocab_size == len(vocab)                  # Megatron-LM: len(encoder)
    assert tok.eod == tok.eos == vocab["<|endoftext|>"] == len(vocab) - 1
    ids = tok.tokenize(TEXT)
    assert len(ids) < len(TEXT.encode("utf-8")), "merges are applied"
    assert tok.detokenize(ids) == TEXT
    # as in Megatron-LM, eod is plain text both ways (not a special token inside text)
    assert tok.detokenize(ids + [tok.eod]) == TEXT + "<|endoftext|>"
    assert tok.eod not in tok.tokenize("a<|endoftext|>b")
    assert tok.unique_identifiers["class"] == "GPT2BPETokenizer"
    assert tok.unique_identifiers["tokenizer_path"] == [files["vocab"], files["merges"]]


def test_huggingface_round_trip_and_eod(files):
    tok = _build("HuggingFaceTokenizer", files)
    reference = transformers.AutoTokenizer.from_pretrained(files["hf"], local_files_only=True)
    assert tok.eod == reference.eos_token_id == reference.convert_tokens_to_ids("<|endoftext|>")
    assert tok.vocab_size == len(reference)
    ids = tok.tokenize(TEXT)
    # the same BPE as GPT2BPETokenizer's files gives the same ids
    assert ids == _build("GPT2BPETokenizer", files).tokenize(TEXT)
    assert tok.detokenize(ids) == TEXT
    assert tok.detokenize(ids + [tok.eod]) == TEXT  # the eos token is special here: dropped
    assert files["hf"] in tok.unique_identifiers.values()


def test_sentencepiece_round_trip_and_eod(files):
    tok = _build("SentencePieceTokenizer", files)
    reference = sentencepiece.SentencePieceProcessor(model_file=files["sp"])
    assert tok.eod == reference.eos_id() >= 0
    assert tok.vocab_size == reference.get_piece_size() == 120
    ids = tok.tokenize(TEXT)
    assert ids == reference.encode(TEXT)
    assert tok.detokenize(ids) == TEXT
    assert files["sp"] in tok.unique_identifiers.values()


# ------------------------------------------------------------- preprocess, then train


@pytest.mark.parametrize("kind,snake", [("GPT2BPETokenizer", True),
                                        ("HuggingFaceTokenizer", False),
                                        ("SentencePieceTokenizer", False)])
def test_preprocess_and_train(megatron_world, files, tmp_path, monkeypatch, kind, snake):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = _build(kind, files)
    # two workers for one of them: the tokenizer flags travel to the worker processes
    workers = "2" if kind == "GPT2BPETokenizer" else "1"
    prefix = _load_preprocess().main(
        ["--input", files["jsonl"], "--output-prefix", str(tmp_path / "corpus"),
         "--append-eod", "--workers", workers, *_flags(kind, files)])["text"]
    ds = IndexedDataset(prefix)
    docs = _documents()
    assert len(ds) == len(docs) + 1
    for i in (0, 5, len(docs) - 1):
        assert ds[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]
    del ds

    models = []

    def recording_build_gpt_model(*args, **kwargs):
        models.append(real_build(*args, **kwargs))
        return models[-1]

    real_build = build_module.build_gpt_model
    monkeypatch.setattr(build_module, "build_gpt_model", recording_build_gpt_model)
    flags = [*TINY, *_flags(kind, files), "--data-path", prefix,
             "--data-cache-path", str(tmp_path / "cache")] + (["--snake-offload"] if snake
                                                              else [])
    losses = pretrain(parse_args(flags))
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses), losses
    (model,) = models
    vocab = padded_vocab_size(tok.vocab_size)
    assert tok.vocab_size <= vocab < tok.vocab_size + 128 and vocab % 128 == 0
    assert model.vocab_size == vocab
    assert model.embedding.word_embeddings.num_embeddings == vocab


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("flags,flag_named,says", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file", "--merge-file"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}"], "--merge-file",
     "needs"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model", "needs"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-model", "needs"),
    # paths that do not exist; a Hub name is not a directory, so nothing is downloaded
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{dir}/none.json",
      "--merge-file", "{merges}"], "--vocab-file", "no such file"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{dir}/none.model"],
     "--tokenizer-model", "no such file"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
     "--tokenizer-model", "no such local directory"),
    # a file flag that the type does not read is not silently ignored
    (["--tokenizer-model", "{sp}"], "--tokenizer-model", "not read by"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--vocab-file", "{vocab}"],
     "--vocab-file", "not read by"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{sp}",
      "--merge-file", "{merges}"], "--merge-file", "not read by"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{hf}", "--vocab-file",
      "{vocab}"], "--vocab-file", "not read by"),
    (["--vocab-size", "10"], "--vocab-size", "NullTokenizer only"),
    # files that are there but are not what the type reads
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{vocab}"],
     "--tokenizer-model", "cannot load"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{merges}", "--merge-file",
      "{vocab}"], "--vocab-file", "not a GPT-2"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{hf_no_eos}"],
     "--tokenizer-model", "no eos token"),
])
def test_bad_tokenizer_flags(capsys, files, flags, flag_named, says):
    flags = [f.format(**files) for f in flags]
    err = expect_flag_error(capsys, flags, flag_named)
    assert says in err, err


@pytest.mark.parametrize("kind,package", [("GPT2BPETokenizer", "tokenizers"),
                                          ("HuggingFaceTokenizer", "transformers"),
                                          ("SentencePieceTokenizer", "sentencepiece")])
def test_missing_library_is_named(capsys, files, monkeypatch, kind, package):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real_find_spec(name, *a))
    err = expect_flag_error(capsys, _flags(kind, files), "--tokenizer-type")
    assert f"pip install {package}" in err and ".[tokenizers]" in err


def test_preprocess_refuses_bad_tokenizer_flags(files, tmp_path):
    pp = _load_preprocess()
    common = ["--input", files["jsonl"], "--output-prefix", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="--tokenizer-type GPT2BPETokenizer needs --vocab-file"):
        pp.main([*common, "--tokenizer-type", "GPT2BPETokenizer"])
    with pytest.raises(ValueError, match="--vocab-file is not read by"):
        pp.main([*common, "--vocab-file", files["vocab"]])
    assert list(tmp_path.iterdir()) == []
