"""Pre-tokenized data (partita.tokens) and `partita tokenize`: the three file layouts, the order
as a function of (seed, step), each replica reading its own rows, one line for bad input, and
training on a corpus tokenized by a tokenizer the test builds."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from partita.errors import PartitaError
from partita.tokens import LLMC_MAGIC, TokenWindows, check_tokens, open_tokens

tokenizers = pytest.importorskip("tokenizers")


def _partita(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "partita.cli", *map(str, argv)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def _one_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus of 40 documents and a BPE tokenizer trained on it (vocabulary under tiny-llama's 256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog and then runs far away into the forest to sleep".split()
    docs = [" ".join(rng.choice(words, 150)) for _ in range(40)]
    with open(d / "corpus.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    (d / "one.txt").write_text(docs[0])
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<|endoftext|>"]))
    (d / "tok").mkdir()
    tok.save(str(d / "tok" / "tokenizer.json"))
    proc = _partita("tokenize", d / "corpus.jsonl", "--tokenizer", d / "tok", "-o", d / "data", cwd=d)
    assert proc.returncode == 0, proc.stderr
    return d, tok, docs


def test_tokenize_writes_each_document_and_its_end(corpus):
    d, tok, docs = corpus
    meta = json.loads((d / "data" / "meta.json").read_text())
    eod = tok.token_to_id("<|endoftext|>")
    assert (meta["dtype"], meta["vocab"], meta["eod"]) == ("uint16", tok.get_vocab_size(), eod)
    tokens = np.fromfile(d / "data" / meta["shards"][0], dtype=np.uint16)
    want = [i for doc in docs for i in tok.encode(doc, add_special_tokens=False).ids + [eod]]
    assert tokens.tolist() == want and meta["tokens"] == len(want)
    files = open_tokens(d / "data")
    assert files.tokens == len(want) and files.eod == eod


def test_tokenize_refuses_in_one_line(corpus, tmp_path):
    d, _, _ = corpus
    assert "not an empty folder" in _one_line(_partita("tokenize", d / "one.txt", "--tokenizer", d / "tok",
                                                       "-o", d / "data", cwd=tmp_path))
    assert "no tokenizer.json" in _one_line(_partita("tokenize", d / "one.txt", "--tokenizer", tmp_path,
                                                     "-o", tmp_path / "out", cwd=tmp_path))
    assert "no such token" in _one_line(_partita("tokenize", d / "one.txt", "--tokenizer", d / "tok", "--eod",
                                                 "<nope>", "-o", tmp_path / "out", cwd=tmp_path))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_llm_c_and_nanogpt_files_read_as_their_writers_write_them(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 200
    header = np.zeros(256, dtype="<i4")
    header[:3] = (LLMC_MAGIC, 1, len(tokens))
    (tmp_path / "llmc.bin").write_bytes(header.tobytes() + tokens.tobytes())
    tokens.tofile(tmp_path / "train.bin")
    for name in ("llmc.bin", "train.bin"):
        files = open_tokens(tmp_path / name)
        view = TokenWindows(files, seq_len=9, seed=0)
        assert view.count == 100 and np.array_equal(view.views[0][:], tokens)
    with pytest.raises(PartitaError, match="beyond the model's vocabulary of 128"):
        check_tokens(open_tokens(tmp_path / "train.bin"), vocab=128, seq_len=9)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(PartitaError, match="not a whole number of uint16 tokens"):
        open_tokens(tmp_path / "odd.bin")


def test_every_window_once_an_epoch_and_the_order_a_function_of_seed_and_step(tmp_path):
    (np.arange(10_000, dtype=np.uint16) % 250).tofile(tmp_path / "a.bin")
    (np.arange(7_000, dtype=np.uint16) % 250).tofile(tmp_path / "b.bin")
    files = open_tokens(tmp_path)
    view = TokenWindows(files, seq_len=99, seed=3)
    assert view.count == 100 + 70
    epoch = [view.window(g) for g in range(view.count)]
    assert sorted(epoch) == list(range(view.count))  # a permutation
    assert [view.window(g) for g in range(view.count, 2 * view.count)] != epoch  # reshuffled
    again = TokenWindows(files, seq_len=99, seed=3)
    assert np.array_equal(again.rows(37, 5), view.rows(37, 5))
    assert not np.array_equal(TokenWindows(files, seq_len=99, seed=4).rows(0, 5), view.rows(0, 5))


def test_a_folder_of_another_tokenizer_is_one_line(corpus, tmp_path):
    d, _, _ = corpus
    meta = json.loads((d / "data" / "meta.json").read_text())
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / meta["shards"][0]).write_bytes((d / "data" / meta["shards"][0]).read_bytes())
    (bad / "meta.json").write_text(json.dumps(meta | {"vocab": 50257}))
    with pytest.raises(PartitaError, match="vocabulary of 50,257, the model has 256"):
        check_tokens(open_tokens(bad), vocab=256, seq_len=16)


torch = pytest.importorskip("torch")


def test_training_on_token_files_learns_and_a_resume_reproduces_the_losses(corpus, tmp_path):
    from runtime_helpers import make_plan, run_parallel

    from partita.runtime.data import TokenSource
    from partita.runtime.train import TrainConfig

    d, _, _ = corpus
    data = str(d / "data")
    source = TokenSource(data, vocab=256, seq_len=16, global_batch=8, seed=0)
    whole, _ = source.batch(3)
    parts = [source.batch(3, dp=2, dp_index=i)[0] for i in range(2)]
    assert torch.equal(torch.cat(parts), whole)  # each replica reads its own rows of the same batch
    plan = make_plan(dp=2, micro_batch=2, num_micro_batches=2)
    cfg = TrainConfig(steps=6, warmup_steps=1, data=data, lr=3e-3)
    losses, _ = run_parallel(plan, cfg)
    assert losses[-1] < losses[0] - 0.2
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Exception):
        run_parallel(plan, dataclasses.replace(cfg, checkpoint_dir=ckpt, checkpoint_every=2, crash_after_step=4))
    tail, _ = run_parallel(plan, dataclasses.replace(cfg, checkpoint_dir=ckpt, checkpoint_every=2, resume=True))
    assert tail == pytest.approx(losses[4:], rel=1e-6)
