"""examples/own_corpus.sh, README.md's "Your own corpus" recipe, on a small corpus made here:
a tokenizer trained offline (or an existing tokenizer.json), the indexed dataset, a run that
saves and stops, and a second that resumes it to the uninterrupted run's losses."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "own_corpus.sh")
WORDS = ("the quick brown fox jumps over a lazy dog while the snake sweeps every unit of "
         "weights from the drive and back, micro-batch after micro-batch").split()
# after the script's own flags, so these win: a tiny GPT, quick and exact on the CPU
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2",
         "--deterministic-mode", "--device", "cpu"]


def _documents(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(5 + i % 20)).capitalize() + "."
            for i in range(n)]


def _corpus(path, n: int = 300) -> str:
    """n short documents: one JSON object a line (.jsonl), or one document a line."""
    jsonl = str(path).endswith(".jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for doc in _documents(n):
            f.write((json.dumps({"text": doc}) if jsonl else doc) + "\n")
    return str(path)


def _losses(out: str) -> list[float]:
    """Each training iteration's lm loss as printed (the validation line's "lm loss value"
    does not match)."""
    return [float(x) for x in re.findall(r"lm loss:?\s*([-+]?[0-9][-+0-9.eE]*)", out)]


def _script(tmp_path, corpus: str, work, **env) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   TMPDIR=str(tmp_path), **env)
    proc = subprocess.run(["bash", SCRIPT, corpus, str(work), *MODEL], capture_output=True,
                          text=True, env=environ, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_own_corpus_trains_saves_and_resumes_exactly(megatron_world, tmp_path):
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    corpus = _corpus(tmp_path / "corpus.jsonl")
    work = tmp_path / "work"
    proc = _script(tmp_path, corpus, work, TRAIN_ITERS="6", STOP_AT="3", VOCAB_SIZE="300")

    # the tokenizer was trained here, and the dataset built with it
    assert (work / "tokenizer" / "vocab.json").is_file()
    assert (work / "tokenizer" / "merges.txt").is_file()
    for suffix in (".bin", ".idx"):
        assert (work / "data" / f"corpus_text_document{suffix}").stat().st_size > 0
    # the first run saved at STOP_AT and stopped; the second loaded it and saved at the end
    ckpt = work / "ckpt"
    assert (ckpt / "iter_0000003").is_dir() and (ckpt / "iter_0000006").is_dir()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    losses = _losses(proc.stdout)
    assert len(losses) == 6, proc.stdout[-3000:]        # iterations 1-3, then 4-6
    assert all(math.isfinite(x) for x in losses)

    # the same run without the stop, here in the test's process: the same losses
    tok = work / "tokenizer"
    offload = tmp_path / "ref_offload"
    offload.mkdir()
    reference = pretrain(parse_args([
        "--snake-offload", "--snake-offload-dir", str(offload),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
        "--merge-file", str(tok / "merges.txt"),
        "--data-path", str(work / "data" / "corpus_text_document"), "--split", "90,10,0",
        "--data-cache-path", str(work / "data" / "cache"), "--train-iters", "6", *MODEL]))
    # equal to the digits printed: the stop and the resume change no number
    assert len(reference) == 6
    assert all(math.isclose(x, ref, rel_tol=1e-5) for x, ref in zip(losses, reference)), \
        (losses, reference)
    assert losses[-1] < losses[0]


def test_own_corpus_with_an_existing_tokenizer_json(tmp_path):
    """TOKENIZER_JSON: a Hugging Face tokenizer.json (here one the tokenizers library
    trained) becomes a local HuggingFaceTokenizer directory; the corpus is plain text."""
    pytest.importorskip("transformers")
    corpus = _corpus(tmp_path / "corpus.txt", n=200)     # plain text this time
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(_documents(200), vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save(str(tmp_path / "tokenizer.json"))
    work = tmp_path / "work"
    proc = _script(tmp_path, corpus, work, TOKENIZER_JSON=str(tmp_path / "tokenizer.json"),
                   TRAIN_ITERS="2", STOP_AT="1")
    assert (work / "tokenizer" / "tokenizer.json").is_file()
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert len(_losses(proc.stdout)) == 2, proc.stdout[-3000:]
