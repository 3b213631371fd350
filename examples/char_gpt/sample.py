"""Generate text with the weights of a trained run (read with ``csf.load_checkpoint``: plain tensors, nothing in
the checkpoint can run code):

    python sample.py outputs/shakespeare --start "ROMEO:" --chars 300
"""
from __future__ import annotations

import argparse

import torch

import csframework as csf
from chars import Alphabet, read_text
from gpt import CharGPT


def training_text(config: dict) -> tuple[str | None, int | None]:
    """``data.train.path`` and ``data.train.num_chars`` of a checkpoint's config, checked: the config is read
    back from the run directory, so it is data (a path string, a count), never trusted to be well formed."""
    train = config.get("data", {}).get("train") if isinstance(config.get("data"), dict) else None
    if not isinstance(train, dict):
        raise ValueError("the checkpoint's config has no data.train section; is this a run of char_gpt?")
    path, num_chars = train.get("path"), train.get("num_chars")
    if path is not None and not isinstance(path, str):
        raise ValueError(f"the checkpoint's data.train.path is {type(path).__name__}, not a path")
    if num_chars is not None and (type(num_chars) is not int or num_chars < 1):
        raise ValueError(f"the checkpoint's data.train.num_chars is {num_chars!r:.40}, not a positive count")
    return path, num_chars


def read_training_text(config: dict) -> str:
    """The text the run trained on (``training_text``; the file ``chars.read_file`` checks before reading)."""
    path, num_chars = training_text(config)
    try:
        return read_text(path, num_chars)
    except (OSError, ValueError) as e:
        raise ValueError(f"the checkpoint's data.train.path: {e}") from e


def load(run_dir: str, which: str = "newest") -> tuple[CharGPT, Alphabet]:
    """The run's model with its checkpoint's weights, and the alphabet of the text it was trained on."""
    checkpoint = csf.load_checkpoint(run_dir, which=which)
    alphabet = Alphabet(read_training_text(checkpoint.config))
    settings = {k: v for k, v in checkpoint.config["model"].items() if k not in ("_target_", "vocab_size")}
    model = CharGPT(vocab_size=len(alphabet.chars), **settings)
    model.load_state_dict(checkpoint.model)
    return model.eval(), alphabet


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (or one of its checkpoints)")
    parser.add_argument("--which", default="newest", help="newest, best or step-<N>")
    parser.add_argument("--start", default="\n", help="the text to continue")
    parser.add_argument("--chars", type=int, default=300, help="characters to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model, alphabet = load(args.run_dir, args.which)
    except (csf.CsfError, ValueError) as e:  # no such run or checkpoint, or one whose config names no text file
        parser.exit(2, f"{parser.prog}: error: {args.run_dir}: {e}\n")
    unknown = sorted(set(args.start) - set(alphabet.chars))
    if unknown:
        parser.error(f"--start: the characters {unknown!r} are not in the training text's alphabet")
    start = alphabet.encode(args.start)[None, :]
    out = model.generate(start, args.chars, temperature=args.temperature, top_k=args.top_k,
                         generator=torch.Generator().manual_seed(args.seed))
    text = alphabet.decode(out[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main()
