"""Character-level text: a text file (tiny shakespeare, say), or by default the Python standard library's own
source (always present, nothing to download). The alphabet is every character of the whole text; the first
90% is the training split, the rest the validation split."""
from __future__ import annotations

import functools
import os
import stat
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


#: The largest text file read (enwik8, the classic character-level benchmark, is 100 MB).
MAX_TEXT_BYTES = 128 << 20


def read_file(path: str) -> str:
    """The UTF-8 text of ``path``, read only when it is a regular file of at most ``MAX_TEXT_BYTES``: a FIFO
    (which would block), a device such as ``/dev/zero`` (which never ends) or a directory is a ``ValueError``
    naming it before anything is read (a run's config, read back by sample.py, may have been forged)."""
    fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: it is not a regular file (a FIFO, a device or a directory); give a text file")
        data = f.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise ValueError(f"{path}: it holds more than {MAX_TEXT_BYTES} bytes; give a smaller text file")
    return data.decode("utf-8")


@functools.lru_cache(maxsize=2)
def read_text(path: str | None, num_chars: int | None) -> str:
    """The text of ``path`` (``read_file``), or of the stdlib's top-level ``*.py`` files in sorted order; its
    first ``num_chars`` characters when given."""
    if path:
        text = read_file(path)
    else:
        parts, total = [], 0
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            parts.append(source.read_text(encoding="utf-8", errors="replace"))
            total += len(parts[-1])
            if num_chars is not None and total >= num_chars:
                break
        text = "".join(parts)
    return text[:num_chars] if num_chars else text


class Alphabet:
    """The characters of a text, sorted, and the codes of the characters."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.code = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.code[c] for c in text], dtype=torch.long)

    def decode(self, codes) -> str:
        return "".join(self.chars[int(i)] for i in codes)


class CharWindows(Dataset):
    """Windows of ``block_size`` characters of one split, starting every ``stride`` characters (1: every
    position, as nanoGPT's random windows can); item ``i`` is ``(inputs, targets)``, the targets shifted by
    one character."""

    def __init__(self, path: str | None = None, split: str = "train", block_size: int = 64, stride: int = 1,
                 num_chars: int | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        text = read_text(path, num_chars)
        self.alphabet = Alphabet(text)
        cut = int(len(text) * 0.9)
        self.data = self.alphabet.encode(text[:cut] if split == "train" else text[cut:])
        self.block_size, self.stride = block_size, stride

    def __len__(self) -> int:
        return max(0, (len(self.data) - self.block_size - 1) // self.stride + 1)

    def __getitem__(self, i: int):
        start = i * self.stride
        window = self.data[start:start + self.block_size + 1]
        return window[:-1], window[1:]


def vocab_size(path: str | None = None, num_chars: int | None = None) -> int:
    """The size of the alphabet of the text (the model's ``vocab_size``: ``${vocab:...}`` in the config)."""
    return len(Alphabet(read_text(path, num_chars)).chars)
