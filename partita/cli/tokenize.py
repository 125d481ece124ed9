"""``partita tokenize TEXT... --tokenizer DIR -o data/``: text to the token files ``--data`` reads.

Each ``.txt`` (or other text) file is one document; each line of a ``.jsonl`` file is one, its
``"text"`` field. Every document is encoded with a local Hugging Face tokenizer
(``tokenizer.json``, through the ``tokenizers`` package; a folder holding one, or the file) and
ended by the tokenizer's end-of-document token (``--eod``, else the first of the usual names the
tokenizer knows: ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``). The tokens go to
shards of at most ``--shard-tokens`` (uint16 where the vocabulary fits, else uint32) with a
``meta.json`` (``partita.tokens``), each written to a temporary name and renamed; nothing is
downloaded. A progress bar counts the input bytes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from partita import fileio
from partita.errors import PartitaError
from partita.tokens import META, write_meta

EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
SHARD_TOKENS = 100_000_000


def add_tokenize_arguments(sub) -> None:
    p = sub.add_parser("tokenize", help="tokenize local text files into the token files `launch --data` reads")
    p.add_argument("text", nargs="+", help="text files (.txt: one document each; .jsonl: a document a line, "
                                           "its \"text\")")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a folder (a model's) holding one")
    p.add_argument("-o", "--output", required=True, help="the folder to write (created; must be empty)")
    p.add_argument("--eod", default=None, help="the end-of-document token (default: the tokenizer's)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help=f"tokens a shard (default {SHARD_TOKENS:,})")


def load_tokenizer(ref: str):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json or a folder holding one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PartitaError("partita tokenize needs the tokenizers package: pip install tokenizers") from None
    path = Path(ref)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise PartitaError(f"--tokenizer {ref}: no tokenizer.json there; give a tokenizer.json or a model folder "
                           f"holding one")
    try:
        return Tokenizer.from_str(fileio.read_text(path))
    except Exception as e:  # noqa: BLE001 -- the package raises its own exception types
        raise PartitaError(f"--tokenizer {path}: not a tokenizer the tokenizers package reads "
                           f"({' '.join(str(e).split())[:200]})") from None


def eod_id(tokenizer, name: str | None) -> int:
    names = [name] if name else list(EOD_NAMES)
    for n in names:
        i = tokenizer.token_to_id(n)
        if i is not None:
            return int(i)
    if name:
        raise PartitaError(f"--eod {name!r}: the tokenizer has no such token")
    raise PartitaError(f"the tokenizer has none of the usual end-of-document tokens ({', '.join(EOD_NAMES)}); "
                       f"name its token with --eod")


def documents(path: Path):
    """The documents of one input file, as text."""
    if path.suffix == ".jsonl":
        for n, line in enumerate(fileio.read_text(path, limit=1 << 40).splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError:
                raise PartitaError(f"{path}:{n}: not a JSON line") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise PartitaError(f"{path}:{n}: a JSON line needs a \"text\" string")
            yield doc["text"]
    else:
        yield fileio.read_text(path, limit=1 << 40)


def tokenize_command(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    if args.shard_tokens < 1:
        raise PartitaError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    inputs = [Path(t) for t in args.text]
    for p in inputs:
        if not p.is_file():
            raise PartitaError(f"{p}: no such file")
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PartitaError(f"-o {out}: exists and is not an empty folder; give a new one (nothing is overwritten)")
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eod = eod_id(tokenizer, args.eod)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    out.mkdir(parents=True, exist_ok=True)
    shards, buffer, total, docs = [], [], 0, 0

    def flush() -> None:
        nonlocal buffer
        if not buffer:
            return
        name = f"shard-{len(shards):05d}.bin"
        fileio.write_text(out / name, np.concatenate(buffer).astype(dtype).tobytes())
        shards.append(name)
        buffer = []

    pending = 0
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  transient=True) as progress:
        task = progress.add_task("tokenizing", total=sum(p.stat().st_size for p in inputs))
        for p in inputs:
            for text in documents(p):
                ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids + [eod], dtype=np.int64)
                docs += 1
                while len(ids):
                    room = args.shard_tokens - pending
                    buffer.append(ids[:room])
                    pending += min(room, len(ids))
                    total += min(room, len(ids))
                    ids = ids[room:]
                    if pending == args.shard_tokens:
                        flush()
                        pending = 0
            progress.advance(task, p.stat().st_size)
        flush()
    write_meta(out, shards=shards, dtype=dtype, vocab=vocab, eod=eod, tokens=total, tokenizer=str(args.tokenizer))
    print(f"wrote {out}: {total:,} tokens of {docs:,} documents in {len(shards)} shard(s) ({dtype}, vocabulary "
          f"{vocab:,}, end of document {eod}); train on it with `partita launch PLAN --data {out}` "
          f"({out / META} describes it)")
    return 0
