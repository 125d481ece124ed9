"""Training data: synthetic tokens, pre-tokenized token files (``partita.tokens``: a folder
``partita tokenize`` wrote, llm.c's or nanoGPT's ``.bin`` files), or a local text file through a
byte-level tokenizer.

Batches are a pure function of (seed, step): every rank draws the same global batch and keeps
its data-parallel slice, and a resumed run sees exactly the batches the first run would have.
Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from partita.errors import PartitaError
from partita.tokens import TokenWindows, check_tokens, is_token_data, open_tokens

BYTE_VOCAB = 256


class TokenSource:
    """``batch(step)`` -> (inputs, targets), each [global_batch, seq_len] int64 on the CPU."""

    def __init__(self, kind: str, *, vocab: int, seq_len: int, global_batch: int, seed: int) -> None:
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed
        self.text: torch.Tensor | None = None
        self.windows: TokenWindows | None = None
        if kind != "synthetic" and is_token_data(kind):
            files = open_tokens(kind)
            check_tokens(files, vocab=vocab, seq_len=seq_len)
            self.windows = TokenWindows(files, seq_len=seq_len, seed=seed)
        elif kind != "synthetic":
            self.text = _read_bytes(Path(kind), vocab=vocab, seq_len=seq_len)

    def batch(self, step: int, dp: int = 1, dp_index: int = 0, *,
              rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of step ``step``'s global batch that data-parallel replica ``dp_index`` of ``dp``
        trains on (replica d takes the d-th contiguous block), or the ``rows`` given (a replica's
        uneven share, ``Plan.replica_rows``). Only those rows are built."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n, s = self.global_batch, self.seq_len
        mine = rows if rows is not None else slice(dp_index * (n // dp), (dp_index + 1) * (n // dp))
        if self.windows is not None:  # only this replica's rows are read from the files
            first = mine.start or 0
            count = (mine.stop if mine.stop is not None else n) - first
            rows = torch.from_numpy(self.windows.rows(step * n + first, count))
        elif self.text is None:
            # Learnable synthetic text: each row counts from a random start by a random stride
            # (mod vocab), so the loss falls as the model learns to continue it.
            start = torch.randint(0, self.vocab, (n, 1), generator=gen)[mine]
            stride = torch.randint(1, 8, (n, 1), generator=gen)[mine]
            rows = (start + stride * torch.arange(s + 1)) % self.vocab
        else:
            starts = torch.randint(0, len(self.text) - s - 1 + 1, (n,), generator=gen)[mine]
            rows = torch.stack([self.text[i:i + s + 1] for i in starts.tolist()])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def check_data(kind: str, *, vocab: int, seq_len: int) -> None:
    """Refuse a ``--data`` no batch can be drawn from, without reading the file: the launcher
    calls it before any rank starts, and every rank before its first collective."""
    if kind == "synthetic":
        return
    if is_token_data(kind):
        check_tokens(open_tokens(kind), vocab=vocab, seq_len=seq_len)
        return
    path = Path(kind)
    if not path.exists():
        raise PartitaError(f"--data {path}: no such file; give 'synthetic' or a local text file")
    if not path.is_file():
        raise PartitaError(f"--data {path} is not a file; give 'synthetic' or a local text file")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise PartitaError(f"--data {path}: cannot read it ({e.strerror}); give a readable text file") from None
    if vocab < BYTE_VOCAB:
        raise PartitaError(f"--data {path}: the byte-level tokenizer needs a vocabulary of at least {BYTE_VOCAB} "
                           f"tokens, the model has {vocab}; use --data synthetic")
    size = path.stat().st_size
    if size < seq_len + 1:
        raise PartitaError(f"--data {path}: {size} bytes is shorter than one sequence of seq_len {seq_len} + 1 "
                           f"tokens ({seq_len + 1} bytes); give a longer text file or --data synthetic")


def _read_bytes(path: Path, *, vocab: int, seq_len: int) -> torch.Tensor:
    check_data(str(path), vocab=vocab, seq_len=seq_len)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    if len(data) < seq_len + 1:  # the file shrank since it was checked
        raise PartitaError(f"--data {path}: {len(data)} bytes is shorter than one sequence of {seq_len + 1} tokens")
    return torch.from_numpy(data.astype(np.int64))
