"""Pre-tokenized training data: flat token arrays on disk, read through ``numpy.memmap``.

Three layouts, as the field writes them:

* a Partita token folder (``partita tokenize`` writes it): ``meta.json`` naming the shards, their
  dtype (uint16 or uint32), the tokenizer's vocabulary and its end-of-document token, beside
  the shards ``shard-00000.bin``, ... (flat little-endian arrays, documents one after another,
  each ended by the end-of-document token);
* llm.c's ``.bin`` files (a 256 x int32 header: magic 20240520, version 1 with uint16 tokens or
  2 with uint32, the token count; then the tokens), one file or a folder of them;
* nanoGPT's ``train.bin`` (flat uint16, no header), one file or a folder of them.

A sequence is a window of seq_len + 1 tokens (inputs and the next tokens); the windows tile each
shard without overlap (never across shards). The order is a function of (seed, step): global row
g of the run (step x global batch + row) is window ``order(g)`` of a bijective shuffle of all
windows, reshuffled each epoch, so every rank computes the rows it trains on and reads only
those, and a resumed run reads what the first would have. numpy only: the launcher checks a
``--data`` folder before any rank starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partita import fileio
from partita.errors import PartitaError

META = "meta.json"
FORMAT = "partita-tokens"
LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_DTYPES = {1: np.uint16, 2: np.uint32}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Tokens read from the start of each shard to check them against the model's vocabulary.
CHECKED_TOKENS = 1 << 20


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int  # bytes before the first token (llm.c's header)
    tokens: int
    dtype: type


@dataclass(frozen=True)
class TokenFiles:
    """The shards of a ``--data`` path, in order, and what the folder says of them."""

    shards: tuple[Shard, ...]
    vocab: int | None  # the tokenizer's vocabulary, where the files say it
    eod: int | None
    where: str

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def windows(self, seq_len: int) -> list[int]:
        """Windows of seq_len + 1 tokens in each shard."""
        return [s.tokens // (seq_len + 1) for s in self.shards]


def is_token_data(path: str | Path) -> bool:
    """A folder, or a ``.bin`` file: token data; anything else is text (bytes as tokens)."""
    p = Path(path)
    return p.is_dir() or p.suffix == ".bin"


def open_tokens(path: str | Path) -> TokenFiles:
    """The token data at ``path`` (a folder or a ``.bin`` file); bad input is one line."""
    p = Path(path)
    if not p.exists():
        raise PartitaError(f"--data {p}: no such file or folder")
    if p.is_dir() and (p / META).is_file():
        return _partita_folder(p)
    files = sorted(p.glob("*.bin")) if p.is_dir() else [p]
    if not files:
        raise PartitaError(f"--data {p}: a folder with neither {META} nor .bin files; give a folder that "
                           f"`partita tokenize` wrote, or .bin token files")
    return TokenFiles(shards=tuple(_bin_shard(f) for f in files), vocab=None, eod=None, where=str(p))


def _partita_folder(folder: Path) -> TokenFiles:
    where = str(folder / META)
    meta = fileio.load_json(folder / META)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PartitaError(f"{where}: not a {FORMAT} folder description; write it with `partita tokenize`")
    dtype = DTYPES.get(meta.get("dtype"))
    if dtype is None:
        raise PartitaError(f"{where}: dtype {meta.get('dtype')!r}; valid: {', '.join(DTYPES)}")
    shards = []
    for name in meta.get("shards") or []:
        f = folder / str(name)
        if not f.is_file():
            raise PartitaError(f"{where}: shard {name} is missing")
        size = f.stat().st_size
        if size % np.dtype(dtype).itemsize:
            raise PartitaError(f"{f}: {size} bytes is not a whole number of {meta['dtype']} tokens")
        shards.append(Shard(f, 0, size // np.dtype(dtype).itemsize, dtype))
    if not shards:
        raise PartitaError(f"{where}: lists no shards")
    vocab, eod = meta.get("vocab"), meta.get("eod")
    if not isinstance(vocab, int) or vocab < 1 or (eod is not None and not (isinstance(eod, int) and 0 <= eod < vocab)):
        raise PartitaError(f"{where}: vocab must be a positive integer and eod a token below it, got {vocab!r}, {eod!r}")
    return TokenFiles(shards=tuple(shards), vocab=vocab, eod=eod, where=str(folder))


def _bin_shard(f: Path) -> Shard:
    if not f.is_file():
        raise PartitaError(f"--data {f}: not a regular file")
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = np.frombuffer(fh.read(4 * 3), dtype="<i4") if size >= 4 * LLMC_HEADER_INTS else np.zeros(0, "<i4")
    if len(head) == 3 and head[0] == LLMC_MAGIC:
        dtype = LLMC_DTYPES.get(int(head[1]))
        if dtype is None:
            raise PartitaError(f"{f}: llm.c header version {int(head[1])}; known: 1 (uint16), 2 (uint32)")
        offset = 4 * LLMC_HEADER_INTS
        tokens = int(head[2])
        if offset + tokens * np.dtype(dtype).itemsize > size:
            raise PartitaError(f"{f}: its header counts {tokens:,} tokens, the file holds fewer")
        return Shard(f, offset, tokens, dtype)
    if size % 2:
        raise PartitaError(f"{f}: {size} bytes is not a whole number of uint16 tokens (nanoGPT's format)")
    return Shard(f, 0, size // 2, np.uint16)


def check_tokens(files: TokenFiles, *, vocab: int, seq_len: int) -> None:
    """The data fits the model: its vocabulary (said, or the largest token of each shard's first
    ``CHECKED_TOKENS``) within the model's, and at least one sequence of seq_len + 1 tokens."""
    if files.vocab is not None and files.vocab > vocab:
        raise PartitaError(f"--data {files.where}: tokenized with a vocabulary of {files.vocab:,}, the model has "
                           f"{vocab:,}; tokenize with the model's tokenizer")
    for s in files.shards:
        head = _view(s)[:CHECKED_TOKENS]
        top = int(head.max()) if len(head) else 0
        if top >= vocab:
            raise PartitaError(f"--data {s.path}: holds token {top:,}, beyond the model's vocabulary of {vocab:,} "
                               f"(a {np.dtype(s.dtype).name} file of another tokenizer?); tokenize with the model's")
    if sum(files.windows(seq_len)) < 1:
        raise PartitaError(f"--data {files.where}: {files.tokens:,} tokens in {len(files.shards)} shard(s) hold no "
                           f"sequence of seq_len {seq_len} + 1 tokens within one shard; give more text")


def _view(s: Shard) -> np.ndarray:
    return np.memmap(s.path, dtype=s.dtype, mode="r", offset=s.offset, shape=(s.tokens,))


class TokenWindows:
    """Global row g -> its seq_len + 1 tokens, in the order of (seed, epoch)'s shuffle."""

    def __init__(self, files: TokenFiles, *, seq_len: int, seed: int) -> None:
        self.files, self.seq_len, self.seed = files, seq_len, seed
        self.per_shard = files.windows(seq_len)
        self.starts = np.cumsum([0, *self.per_shard])
        self.count = int(self.starts[-1])
        self.views = [_view(s) for s in files.shards]

    def rows(self, first: int, n: int) -> np.ndarray:
        """Rows first .. first + n - 1 of the run, [n, seq_len + 1] int64."""
        out = np.empty((n, self.seq_len + 1), dtype=np.int64)
        for i in range(n):
            w = self.window(first + i)
            shard = int(np.searchsorted(self.starts, w, side="right")) - 1
            at = (w - int(self.starts[shard])) * (self.seq_len + 1)
            out[i] = self.views[shard][at:at + self.seq_len + 1]
        return out

    def window(self, g: int) -> int:
        """The window row g reads: an affine bijection of the windows, new each epoch."""
        n = self.count
        epoch, i = divmod(g, n)
        a, c = _shuffle(n, self.seed, epoch)
        return (a * i + c) % n


def _shuffle(n: int, seed: int, epoch: int) -> tuple[int, int]:
    """(a, c) with gcd(a, n) = 1: x -> a x + c mod n permutes 0..n-1."""
    rng = np.random.default_rng([seed, epoch])
    if n == 1:
        return 1, 0
    while True:
        a = int(rng.integers(1, n))
        if math.gcd(a, n) == 1:
            return a, int(rng.integers(0, n))


def write_meta(folder: Path, *, shards: list[str], dtype: str, vocab: int, eod: int | None, tokens: int,
               tokenizer: str) -> None:
    text = json.dumps({"format": FORMAT, "version": 1, "dtype": dtype, "vocab": vocab, "eod": eod,
                       "tokens": tokens, "shards": shards, "tokenizer": tokenizer}, indent=1)
    fileio.write_text(folder / META, text + "\n")
