"""Tests of the data side: tokenizers, tools/preprocess_data.py, GPT datasets, micro-batches.

Run: python -m pytest -q tests/test_data.py
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import expect_flag_error
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.data import (
    build_gpt_datasets,
    micro_batches,
    num_samples_for,
    parse_data_path,
)
from megatron_snake.training.loop import pretrain
from megatron_snake.training.tokenizer import (
    ByteTokenizer,
    NullTokenizer,
    build_tokenizer,
    padded_vocab_size,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")


def _load_preprocess():
    name = "megatron_snake_tools_preprocess_data"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the worker pool pickles its functions by module name
    spec.loader.exec_module(module)
    return module


WORDS = ["alpha", "beta", "gamma", "δέλτα", "✓", "naïve", "日本語", "end."]


def _documents(n, seed):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        k = int(torch.randint(1, 15, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (k,), generator=g).tolist()
        docs.append(" ".join(WORDS[i] for i in idx))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file and a jsonl file, preprocessed once for the whole module."""
    d = tmp_path_factory.mktemp("corpus")
    pp = _load_preprocess()
    txt_docs = _documents(60, seed=1)
    txt = d / "docs.txt"
    # blank lines are not documents
    txt.write_text("\n".join(txt_docs[:30]) + "\n\n" + "\n".join(txt_docs[30:]) + "\n", "utf-8")
    txt_prefix = pp.main(
        ["--input", str(txt), "--output-prefix", str(d / "out" / "txt"), "--append-eod"]
    )["text"]
    jsonl_docs = _documents(50, seed=2)
    jsonl = d / "docs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(jsonl_docs)),
        "utf-8",
    )
    jsonl_prefix = pp.main(
        [
            "--input", str(jsonl), "--output-prefix", str(d / "out" / "js"),
            "--append-eod", "--workers", "2",
        ]
    )["text"]
    return {
        "dir": d,
        "txt_docs": txt_docs,
        "txt_prefix": txt_prefix,
        "jsonl_docs": jsonl_docs,
        "jsonl_prefix": jsonl_prefix,
        "cache": str(d / "cache"),
    }


def _build(corpus, **overrides):
    kwargs = dict(
        mock=False,
        data_path=[corpus["txt_prefix"]],
        split="80,10,10",
        seq_length=16,
        seed=1234,
        tokenizer=ByteTokenizer(),
        num_samples=(64, 8, 8),
        data_cache_path=corpus["cache"],
    )
    kwargs.update(overrides)
    return build_gpt_datasets(**kwargs)


# ------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eod == 256
    for text in ["", "hello", "héllo wörld", "日本語 ✓ 🐍", "tab\tnewline\n"]:
        ids = tok.tokenize(text)
        assert all(0 <= i < 256 for i in ids)
        assert ids == list(text.encode("utf-8"))
        assert tok.detokenize(ids) == text
        assert tok.detokenize(ids + [tok.eod]) == text
    assert build_tokenizer("ByteTokenizer", None).vocab_size == 257
    assert build_tokenizer(None, None).vocab_size == 257


def test_null_tokenizer_matches_megatron():
    tok = build_tokenizer("NullTokenizer", 100)
    assert isinstance(tok, NullTokenizer)
    # Megatron-LM: eod == --vocab-size, vocab_size == --vocab-size + 1
    assert tok.eod == 100 and tok.vocab_size == 101
    assert tok.tokenize("1 2  3\n4 100") == [1, 2, 3, 4, 100]
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer", None)
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("5 101")


def test_unknown_tokenizer_type():
    with pytest.raises(ValueError, match="--tokenizer-type") as err:
        build_tokenizer("GPT3Tokenizer", None)
    assert "ByteTokenizer" in str(err.value) and "GPT2BPETokenizer" in str(err.value)


def _megatron_padding(orig, divisible_by, tp):
    after = orig
    multiple = divisible_by * tp
    while after % multiple != 0:
        after += 1
    return after


@pytest.mark.parametrize(
    "orig,div,tp,expected",
    [(257, 128, 1, 384), (50257, 128, 1, 50304), (50257, 128, 8, 51200), (256, 128, 1, 256),
     (32000, 128, 2, 32000), (101, 1, 1, 101), (129, 64, 3, 192)],
)
def test_padded_vocab_size(orig, div, tp, expected):
    assert padded_vocab_size(orig, div, tp) == expected == _megatron_padding(orig, div, tp)


def test_padded_vocab_size_default():
    assert padded_vocab_size(ByteTokenizer().vocab_size) == 384


# ----------------------------------------------------------------------------- preprocessing


def test_preprocess_writes_documents(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = ByteTokenizer()
    for key, docs in (("txt_prefix", corpus["txt_docs"]), ("jsonl_prefix", corpus["jsonl_docs"])):
        prefix = corpus[key]
        assert prefix.endswith("_text_document")
        ds = IndexedDataset(prefix)
        assert len(ds) == len(docs)
        for i in (0, 7, len(docs) - 1):
            ids = ds[i].tolist()
            assert ids[-1] == tok.eod
            assert tok.detokenize(ids) == docs[i]
        del ds


def test_preprocess_errors(tmp_path):
    pp = _load_preprocess()
    with pytest.raises(FileNotFoundError, match="--input"):
        pp.main(["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken\n', "utf-8")
    with pytest.raises(ValueError, match="line 2"):
        pp.main(["--input", str(bad), "--output-prefix", str(tmp_path / "bad")])
    assert not any(p.name.startswith("bad_text_document") for p in tmp_path.iterdir())
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "x"}\n', "utf-8")
    with pytest.raises(ValueError, match="--json-keys"):
        pp.main(["--input", str(nokey), "--output-prefix", str(tmp_path / "nk")])
    txt = tmp_path / "a.txt"
    txt.write_text("hello\n", "utf-8")
    with pytest.raises(ValueError, match="--tokenizer-type"):
        pp.main(["--input", str(txt), "--output-prefix", str(tmp_path / "a"),
                 "--tokenizer-type", "Foo"])


def test_preprocess_cli_missing_input(tmp_path):
    proc = subprocess.run(
        [sys.executable, PREPROCESS, "--input", str(tmp_path / "nope.txt"),
         "--output-prefix", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "--input" in proc.stderr and "nope.txt" in proc.stderr


def test_preprocess_null_tokenizer(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    pp = _load_preprocess()
    src = tmp_path / "ids.txt"
    src.write_text("1 2 3\n4 5\n", "utf-8")
    prefix = pp.main(["--input", str(src), "--output-prefix", str(tmp_path / "n"),
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod"])[
        "text"]
    ds = IndexedDataset(prefix)
    assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2, 3, 10], [4, 5, 10]]
    del ds


# ---------------------------------------------------------------------------------- datasets


def test_gpt_dataset_from_preprocessed_text(corpus):
    train, valid, test = _build(corpus)
    assert len(train) >= 64 and len(valid) >= 8 and len(test) >= 8
    s = 16
    it = micro_batches(train, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1,
                       consumed_samples=0)
    for _ in range(3):
        b = next(it)
        assert set(b) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}
        assert b["tokens"].shape == (4, s) and b["tokens"].dtype == torch.int64
        assert b["labels"].shape == (4, s) and b["labels"].dtype == torch.int64
        assert b["loss_mask"].shape == (4, s) and b["loss_mask"].dtype == torch.float32
        assert b["position_ids"].shape == (4, s) and b["position_ids"].dtype == torch.int64
        assert b["attention_mask"].shape == (4, 1, s, s)
        assert b["attention_mask"].dtype == torch.bool
        # labels are the next tokens
        assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
        assert int(b["tokens"].max()) <= 256 and int(b["tokens"].min()) >= 0
        assert torch.equal(b["position_ids"], torch.arange(s).expand(4, s))
        causal_masked = torch.ones(s, s, dtype=torch.bool).triu(1)
        assert torch.equal(b["attention_mask"][0, 0], causal_masked)
        assert torch.all(b["loss_mask"] == 1.0)
    # The sample text is a contiguous slice of the eod-separated documents.
    stream = []
    for d in corpus["txt_docs"]:
        stream += ByteTokenizer().tokenize(d) + [256]
    sample = train[0]
    text = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
    assert any(stream[i:i + s + 1] == text for i in range(len(stream) - s))


def test_dataset_options_and_determinism(corpus):
    a = _build(corpus, eod_mask_loss=True, reset_position_ids=True, create_attention_mask=False)[0]
    b = next(micro_batches(a, micro_batch_size=8, data_parallel_rank=0, data_parallel_size=1,
                           consumed_samples=0))
    assert b["attention_mask"] is None
    assert torch.all(b["loss_mask"][b["tokens"] == 256] == 0)
    # reset_position_ids: positions restart after each eod
    row = b["tokens"][0]
    eods = (row == 256).nonzero().flatten().tolist()
    if eods and eods[0] < 15:
        assert int(b["position_ids"][0, eods[0] + 1]) == 0
    # Same seed -> same samples (second build loads the cached indices).
    first = _build(corpus)[0]
    again = _build(corpus)[0]
    for i in (0, 5, 40):
        assert torch.equal(first[i]["tokens"], again[i]["tokens"])
    other = _build(corpus, seed=7)[0]
    assert not all(torch.equal(first[i]["tokens"], other[i]["tokens"]) for i in range(8))
    # The index cache went where we asked, not next to the data.
    assert os.listdir(corpus["cache"])
    assert not os.path.exists(os.path.join(corpus["dir"], "out", "cache"))
    assert not os.path.exists(corpus["txt_prefix"])


def test_blended_data_path(corpus):
    train, valid, test = _build(
        corpus, data_path=["0.3", corpus["txt_prefix"], "0.7", corpus["jsonl_prefix"]],
        num_samples=(40, 8, 8),
    )
    assert len(train) >= 40
    b = next(micro_batches(train, micro_batch_size=4, data_parallel_rank=0,
                           data_parallel_size=1, consumed_samples=0))
    assert b["tokens"].shape == (4, 16)
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    # Unweighted blend of two prefixes.
    train2 = _build(corpus, data_path=[corpus["txt_prefix"], corpus["jsonl_prefix"]])[0]
    assert len(train2) > 0


def test_mock_dataset():
    tok = ByteTokenizer()
    train, valid, test = build_gpt_datasets(
        mock=True, data_path=None, split="969,30,1", seq_length=32, seed=1,
        tokenizer=tok, num_samples=(100, 10, 10),
    )
    assert len(train) >= 100
    b = next(micro_batches(train, micro_batch_size=3, data_parallel_rank=0,
                           data_parallel_size=1, consumed_samples=0))
    assert b["tokens"].shape == (3, 32) and b["attention_mask"].shape == (3, 1, 32, 32)
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    assert int(b["tokens"].max()) < tok.vocab_size


# ------------------------------------------------------------------------------ micro-batches


class _IndexDataset:
    """Sample i is a sequence full of i, so batches reveal which samples they hold."""

    def __init__(self, n, s=4):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.full((self.s,), i, dtype=torch.long)
        return {"tokens": t, "labels": t.clone(), "loss_mask": torch.ones(self.s),
                "position_ids": torch.arange(self.s)}


def _ids(batch):
    return batch["tokens"][:, 0].tolist()


def test_sampler_order_matches_megatron():
    ds = _IndexDataset(100)
    mbs, dp = 2, 3
    its = [micro_batches(ds, micro_batch_size=mbs, data_parallel_rank=r, data_parallel_size=dp,
                         consumed_samples=6) for r in range(dp)]
    seen = []
    for step in range(5):
        window = [_ids(next(it)) for it in its]
        start = 6 + step * mbs * dp
        assert window == [[start + r * mbs + j for j in range(mbs)] for r in range(dp)]
        seen += sum(window, [])
    assert len(seen) == len(set(seen))  # the ranks are disjoint
    b = next(micro_batches(ds, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1,
                           consumed_samples=0))
    assert b["attention_mask"] is None


def test_two_dp_ranks_disjoint_real_data(corpus):
    train = _build(corpus)[0]
    r0 = micro_batches(train, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=2,
                       consumed_samples=0)
    r1 = micro_batches(train, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2,
                       consumed_samples=0)
    single = micro_batches(train, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1,
                           consumed_samples=0)
    for _ in range(4):
        a, b, whole = next(r0), next(r1), next(single)
        assert torch.equal(torch.cat([a["tokens"], b["tokens"]]), whole["tokens"])


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_exactly(corpus, dp):
    train = _build(corpus)[0]
    mbs, n_done, n_more = 2, 5, 4
    for rank in range(dp):
        it = micro_batches(train, micro_batch_size=mbs, data_parallel_rank=rank,
                           data_parallel_size=dp, consumed_samples=0)
        for _ in range(n_done):
            next(it)
        expected = [next(it) for _ in range(n_more)]
        resumed = micro_batches(train, micro_batch_size=mbs, data_parallel_rank=rank,
                                data_parallel_size=dp, consumed_samples=n_done * mbs * dp)
        for e in expected:
            r = next(resumed)
            for k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                assert torch.equal(e[k], r[k])


def test_exhaustion_is_a_clear_error():
    it = micro_batches(_IndexDataset(10), micro_batch_size=2, data_parallel_rank=0,
                       data_parallel_size=2, consumed_samples=2)
    assert _ids(next(it)) == [2, 3]
    assert _ids(next(it)) == [6, 7]
    with pytest.raises(RuntimeError, match="num_samples"):
        next(it)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        micro_batches(_IndexDataset(10), micro_batch_size=2, data_parallel_rank=2,
                      data_parallel_size=2, consumed_samples=0)
    assert num_samples_for(100, 8, 50, 5) == (800, 120, 40)


# ------------------------------------------------------------------------------------ errors


def test_missing_data_path(corpus, tmp_path):
    missing = str(tmp_path / "nothing_text_document")
    with pytest.raises(FileNotFoundError, match="--data-path") as err:
        _build(corpus, data_path=[missing])
    assert missing + ".bin" in str(err.value)
    with pytest.raises(FileNotFoundError, match="--data-path"):
        _build(corpus, data_path=["0.5", corpus["txt_prefix"], "0.5", missing])
    with pytest.raises(ValueError, match="--data-path"):
        _build(corpus, data_path=None)
    # .bin present, .idx missing
    half = tmp_path / "half_text_document"
    (tmp_path / "half_text_document.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"half_text_document\.idx"):
        parse_data_path([str(half)])


def test_bad_split(corpus):
    with pytest.raises(ValueError, match="--split"):
        _build(corpus, split="0,0,0")
    # 60 documents: a 0.5% test split holds no document (Megatron would loop forever).
    with pytest.raises(ValueError, match="--split"):
        _build(corpus, split="99.5,0,0.5")
    train, valid, test = _build(corpus, split="100,0,0", num_samples=(16, 0, 0))
    assert len(train) >= 16 and valid is None and test is None


# ------------------------------------- per-split paths, --eod-mask-loss, --num-workers (flags)

# a tiny GPT for the end-to-end runs below (pretrain_gpt's flags)
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "3e-3", "--seed", "5", "--device", "cpu"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _one_letter_corpus(tmp_path, name, letter, n=40):
    """Documents made of one letter only, so a batch shows which file it came from."""
    src = tmp_path / f"{name}.txt"
    src.write_text("".join(f"{letter * (3 + i % 5)} {letter * (1 + i % 3)}\n"
                           for i in range(n)), "utf-8")
    return _load_preprocess().main(["--input", str(src), "--output-prefix",
                                    str(tmp_path / name), "--append-eod"])["text"]


def _record_batches(monkeypatch):
    """Every micro-batch the trainer reads, with whether it was read for training (grad on)
    or for evaluation (under no_grad)."""
    from megatron_snake.training import loop

    seen, real = [], loop.micro_batches

    def recording(*args, **kwargs):
        for batch in real(*args, **kwargs):
            seen.append((torch.is_grad_enabled(), batch))
            yield batch

    monkeypatch.setattr(loop, "micro_batches", recording)
    return seen


def _byte_set(batches):
    return set(torch.cat([b["tokens"].flatten() for b in batches]).tolist())


def test_per_split_paths_build_from_their_own_files(tmp_path):
    a = _one_letter_corpus(tmp_path, "a", "a")
    z = _one_letter_corpus(tmp_path, "z", "z")
    cache = str(tmp_path / "cache")
    train, valid, test = build_gpt_datasets(
        mock=False, data_path=None, split=None, seq_length=16, seed=1, tokenizer=ByteTokenizer(),
        num_samples=(32, 8, 8), data_cache_path=cache, train_data_path=[a],
        valid_data_path=["0.5", z, "0.5", a])
    assert test is None  # no --test-data-path: no test split
    eod, space = 256, ord(" ")
    assert {int(train[i]["tokens"].max()) for i in range(len(train))} <= {ord("a"), eod}
    assert _byte_set([train[i] for i in range(32)]) == {ord("a"), space, eod}
    # the valid blend takes both files, each whole
    assert _byte_set([valid[i] for i in range(8)]) == {ord("a"), ord("z"), space, eod}
    with pytest.raises(ValueError, match="mutually exclusive"):
        build_gpt_datasets(mock=False, data_path=[a], split="1,0,0", seq_length=16, seed=1,
                           tokenizer=ByteTokenizer(), num_samples=(8, 0, 0),
                           data_cache_path=cache, train_data_path=[a])


def test_separate_train_and_valid_paths_train_and_evaluate_from_their_files(
        megatron_world, tmp_path, monkeypatch):
    a = _one_letter_corpus(tmp_path, "a", "a")
    z = _one_letter_corpus(tmp_path, "z", "z")
    seen = _record_batches(monkeypatch)
    losses = pretrain(parse_args([*TINY, "--train-iters", "4", "--eval-interval", "2",
                                  "--eval-iters", "1", "--train-data-path", a,
                                  "--valid-data-path", z, "--data-cache-path",
                                  str(tmp_path / "cache")]))
    assert len(losses) == 4
    trained = [b for grad, b in seen if grad]
    evaluated = [b for grad, b in seen if not grad]
    assert len(trained) == 4 * 2 and len(evaluated) == 2 * 2  # 2 micro-batches a step
    assert _byte_set(trained) == {ord("a"), ord(" "), 256}
    assert _byte_set(evaluated) == {ord("z"), ord(" "), 256}


def test_default_split_with_a_small_corpus_keeps_its_message(megatron_world, corpus):
    # 60 documents: the default --split 969,30,1 leaves the test split without one
    with pytest.raises(ValueError, match=r"--split 969, 30, 1 leaves the test split"):
        pretrain(parse_args([*TINY, "--train-iters", "2", "--data-path", corpus["txt_prefix"],
                             "--data-cache-path", corpus["cache"]]))


def test_eod_mask_loss_zeroes_the_loss_mask_at_eod(megatron_world, corpus, monkeypatch):
    flags = [*TINY, *NO_DROPOUT, "--train-iters", "3", "--deterministic-mode", "--data-path",
             corpus["txt_prefix"], "--split", "100,0,0", "--data-cache-path", corpus["cache"]]
    seen = _record_batches(monkeypatch)
    plain = pretrain(parse_args(flags))
    plain_batches = [b for _, b in seen]
    seen.clear()
    masked = pretrain(parse_args([*flags, "--eod-mask-loss"]))
    masked_batches = [b for _, b in seen]
    eod = 256
    for p, m in zip(plain_batches, masked_batches, strict=True):
        assert torch.equal(p["tokens"], m["tokens"])  # the same samples
        assert torch.all(p["loss_mask"] == 1)
        assert torch.equal(m["loss_mask"], (m["tokens"] != eod).float())
    assert sum(int((b["tokens"] == eod).sum()) for b in masked_batches) > 3
    assert masked != plain


def test_num_workers_give_the_same_batches(corpus):
    train = _build(corpus)[0]
    for dp in (1, 2):
        for rank in range(dp):
            kwargs = dict(micro_batch_size=2, data_parallel_rank=rank, data_parallel_size=dp,
                          consumed_samples=6)
            inline = micro_batches(train, num_workers=0, **kwargs)
            workers = micro_batches(train, num_workers=2, **kwargs)
            for _ in range(7):
                a, b = next(inline), next(workers)
                for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                    assert torch.equal(a[key], b[key]), key
    # and they run out at the same window, with the same message
    for workers in (0, 2):
        it = micro_batches(_IndexDataset(10), micro_batch_size=2, data_parallel_rank=1,
                           data_parallel_size=2, consumed_samples=2, num_workers=workers)
        assert [_ids(next(it)), _ids(next(it))] == [[4, 5], [8, 9]]
        with pytest.raises(RuntimeError, match="consumed_samples=10 needs samples up to 14"):
            next(it)


def test_num_workers_keep_the_losses_and_the_resume(megatron_world, tmp_path):
    """Dropout on: the workers must not draw from the global RNG (seeding them), or the
    losses change with --num-workers and a resumed run differs from the straight one."""
    flags = [*TINY, "--train-iters", "6", "--deterministic-mode", "--eval-interval", "2",
             "--eval-iters", "1"]
    inline = pretrain(parse_args([*flags, "--num-workers", "0"]))
    workers = [*flags, "--num-workers", "2"]
    assert pretrain(parse_args(workers)) == inline
    pretrain(parse_args([*workers, "--exit-interval", "3", "--save", str(tmp_path)]))
    assert pretrain(parse_args([*workers, "--load", str(tmp_path)])) == inline[3:]


@pytest.mark.parametrize("flags,flag_named", [
    (["--data-path", "x_text_document", "--train-data-path", "x_text_document"],
     "--train-data-path"),
    (["--mock-data", "--train-data-path", "x_text_document"], "--train-data-path"),
    (["--mock-data", "--data-path", "x_text_document"], "--mock-data"),
    (["--valid-data-path", "x_text_document"], "--valid-data-path"),
    (["--test-data-path", "x_text_document"], "--test-data-path"),
    (["--train-data-path", "x_text_document", "--split", "90,10,0"], "--split"),
    (["--train-data-path"], "--train-data-path"),
    (["--data-path"], "--data-path"),
    (["--num-workers", "-1"], "--num-workers"),
])
def test_bad_data_flags_fail_naming_the_flag(capsys, flags, flag_named):
    expect_flag_error(capsys, flags, flag_named)


def test_per_split_path_errors_name_the_flag(corpus, tmp_path):
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    missing = str(tmp_path / "nothing_text_document")
    kwargs = dict(mock=False, data_path=None, split=None, seq_length=16, seed=1,
                  tokenizer=ByteTokenizer(), num_samples=(8, 8, 8),
                  data_cache_path=corpus["cache"], train_data_path=[corpus["txt_prefix"]])
    with pytest.raises(FileNotFoundError, match="--valid-data-path .*nothing_text_document.bin"):
        build_gpt_datasets(**kwargs, valid_data_path=[missing])
    with pytest.raises(FileNotFoundError, match="--test-data-path"):
        build_gpt_datasets(**kwargs, test_data_path=["1", corpus["txt_prefix"], "1", missing])
    empty = str(tmp_path / "empty_text_document")
    IndexedDatasetBuilder(empty + ".bin", dtype=numpy.uint16).finalize(empty + ".idx")
    # (an empty .bin cannot even be mapped: "cannot read"; unmapped: "holds no tokens")
    with pytest.raises(ValueError, match="--valid-data-path .*empty_text_document: (cannot read|"
                                         "the dataset holds no tokens)"):
        build_gpt_datasets(**kwargs, valid_data_path=[empty])
    with pytest.raises(ValueError, match="--valid-data-path .*the dataset holds no tokens"):
        build_gpt_datasets(**kwargs, valid_data_path=[empty], mmap_bin_files=False)
