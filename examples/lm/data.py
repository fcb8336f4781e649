"""Byte-level tokens from text on this machine: no downloads, no tokenizer.

The default corpus is the Python standard library's own source files (found through `sysconfig`), so every
machine with Python has it. `--data` takes any text file or folder instead. Files are split into train and
validation by a hash of their path (the same split on every machine); the tokens of each split are cached
on disk as raw bytes, under a key made of the file list, sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from lm.config import Config

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".yaml", ".yml", ".c", ".h", ".html")


def corpus_files(data: str | None) -> tuple[Path, list[Path]]:
    """The corpus root and its files, sorted: `data` itself, the text files under it, or the stdlib's `.py`."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts]
    else:
        root = Path(data).expanduser()
        if root.is_file():
            return root.parent, [root]
        if not root.is_dir():
            raise FileNotFoundError(f"data={data!r} is neither a file nor a folder.")
        files = [f for f in root.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES]
    if not files:
        raise FileNotFoundError(f"no text files found under {root}.")
    return root, sorted(files)


def _is_validation(relative_path: str, val_fraction: float) -> bool:
    return zlib.crc32(relative_path.encode()) % 10_000 < val_fraction * 10_000


def load_tokens(config: Config) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation tokens, uint8 arrays mapped from the cache (built on first use)."""
    root, files = corpus_files(config.data)
    listing = [(str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([str(root), listing, config.val_fraction]).encode()).hexdigest()[:16]
    cache = Path(config.data_cache).expanduser() / key
    if not (cache / "meta.json").exists():
        _build_cache(cache, root, listing, config.val_fraction)
    return tuple(np.memmap(cache / f"{split}.u8", np.uint8, mode="r") for split in ("train", "val"))


def _build_cache(cache: Path, root: Path, listing: list, val_fraction: float) -> None:
    splits = {"train": [], "val": []}
    for relative, _, _ in listing:
        splits["val" if _is_validation(relative, val_fraction) else "train"].append((root / relative).read_bytes())
    if not splits["train"] or not splits["val"]:
        # One file, or a few that hash to one side: cut the concatenated text instead.
        text = b"".join(splits["train"] + splits["val"])
        cut = int(len(text) * (1 - val_fraction))
        splits = {"train": [text[:cut]], "val": [text[cut:]]}
    cache.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split, parts in splits.items():
        tokens = b"".join(parts)
        sizes[split] = len(tokens)
        temporary = cache / f"{split}.u8.{os.getpid()}"
        temporary.write_bytes(tokens)
        temporary.replace(cache / f"{split}.u8")
    # Written last: its presence says the cache is complete.
    meta = dict(root=str(root), files=len(listing), tokens=sizes, val_fraction=val_fraction)
    temporary = cache / f"meta.json.{os.getpid()}"
    temporary.write_text(json.dumps(meta, indent=2))
    temporary.replace(cache / "meta.json")


def _starts(tokens: np.ndarray, seq_len: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Where `count` random windows of `seq_len + 1` tokens (inputs and their next-token targets) start."""
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"the split has {len(tokens)} tokens, too few for seq_len={seq_len}.")
    return rng.integers(0, len(tokens) - seq_len - 1, size=count)


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The windows of `seq_len + 1` tokens at `starts`, `[len(starts), seq_len + 1]` int32. A process of a
    multi-process run reads only the rows of its own devices (`starts[rows]`)."""
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).reshape(len(starts), seq_len + 1).astype(np.int32)


def train_starts(tokens: np.ndarray, config: Config, step: int) -> np.ndarray:
    """The window starts of the batch of `step`, `[batch_size]`: a function of (seed, step) alone, so a resumed
    run sees the batches that an unbroken one would have seen, and every process the same global batch."""
    return _starts(tokens, config.seq_len, config.batch_size, np.random.default_rng([config.seed, step]))


def train_batch(tokens: np.ndarray, config: Config, step: int) -> np.ndarray:
    """The whole batch of `step`, `[batch_size, seq_len + 1]` int32."""
    return windows(tokens, train_starts(tokens, config, step), config.seq_len)


def validation_starts(tokens: np.ndarray, config: Config) -> list[np.ndarray]:
    """The window starts of the `eval_batches` fixed validation batches, `[batch_size]` each."""
    rng = np.random.default_rng([config.seed, 2**31])
    return [_starts(tokens, config.seq_len, config.batch_size, rng) for _ in range(config.eval_batches)]
