"""Words of the Python standard library's own source (always present, nothing to download) as batchified
token streams, the way pytorch/examples' word_language_model reads wikitext-2: each line's words (split on
white space) and an ``<eos>``; the first 80% of the words is the training split, the next 10% validation,
the last 10% test. The vocabulary is the training split's most frequent words, the rest ``<unk>``."""
from __future__ import annotations

import functools
import sysconfig
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

#: Where each split starts and ends, as fractions of the words.
SPLITS = {"train": (0.0, 0.8), "val": (0.8, 0.9), "test": (0.9, 1.0)}
EOS, UNK = "<eos>", "<unk>"


@functools.lru_cache(maxsize=2)
def read_words(num_words: int | None = None) -> tuple[str, ...]:
    """The words of the stdlib's top-level ``*.py`` files in sorted order, an ``<eos>`` after each line; the
    first ``num_words`` of them when given."""
    words: list[str] = []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in source.read_text(encoding="utf-8", errors="replace").splitlines():
            words += line.split() + [EOS]
        if num_words is not None and len(words) >= num_words:
            break
    return tuple(words[:num_words])


def split_words(split: str, num_words: int | None) -> tuple[str, ...]:
    """The words of ``split`` (``train``, ``val`` or ``test``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    words = read_words(num_words)
    start, end = SPLITS[split]
    return words[int(len(words) * start):int(len(words) * end)]


@functools.lru_cache(maxsize=2)
def vocabulary(num_words: int | None, max_vocab: int) -> dict[str, int]:
    """Word -> id: ``<unk>`` first, then the training split's ``max_vocab - 1`` most frequent words (ties in
    alphabetical order, so the ids never depend on a hash seed)."""
    counts = Counter(split_words("train", num_words))
    ranked = sorted(counts, key=lambda word: (-counts[word], word))[:max_vocab - 1]
    return {word: i for i, word in enumerate([UNK, *ranked])}


def vocab_size(num_words: int | None = None, max_vocab: int = 10000) -> int:
    """How many ids the vocabulary has (the model's input and output size)."""
    return len(vocabulary(num_words, max_vocab))


def word_stream(split: str = "train", streams: int = 20, num_words: int | None = None,
                max_vocab: int = 10000) -> TensorDataset:
    """``split``'s word ids cut into ``streams`` equal columns (word_language_model's ``batchify``: the tail
    that does not fill a row is dropped), as a dataset of rows: item ``i`` is ``(ids[i], ids[i + 1])``, each
    ``[streams]``. Read in order with ``data.batch_size`` as the BPTT length, a batch is the next
    ``[bptt, streams]`` chunk and its next words (word_language_model's ``get_batch``)."""
    vocab = vocabulary(num_words, max_vocab)
    ids = torch.tensor([vocab.get(word, 0) for word in split_words(split, num_words)], dtype=torch.long)
    rows = len(ids) // streams
    if rows < 2:
        raise ValueError(f"split {split!r} has {len(ids)} words: too few for {streams} streams")
    columns = ids[:rows * streams].view(streams, rows).t().contiguous()  # [rows, streams]
    return TensorDataset(columns[:-1], columns[1:])
