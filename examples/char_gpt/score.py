"""Score a trained run on every window of the validation split, not a sample: the mean loss over all the
non-overlapping windows of ``block_size`` characters of the last 10% of the text the run trained on.

    python score.py outputs/stdlib

``--nanogpt DIR CKPT`` scores a checkpoint of nanoGPT's own ``train.py`` on the same windows, with the model
class of the nanoGPT checkout ``DIR`` (its ``model.py``); the run directory gives the text and the windows.
"""
from __future__ import annotations

import argparse
import sys

import torch

import csframework as csf
from chars import CharWindows
from sample import load, read_training_text, training_text


def windows_of(run_dir: str) -> CharWindows:
    """The validation split's non-overlapping windows of the text the run trained on (its path and block size
    from the checkpoint's config, checked as ``sample.load`` checks them)."""
    config = csf.load_checkpoint(run_dir).config
    read_training_text(config)  # the file checked, with the key named (read once: ``read_text`` is cached)
    path, num_chars = training_text(config)
    block = config.get("model", {}).get("block_size") if isinstance(config.get("model"), dict) else None
    if type(block) is not int or not 0 < block <= 1 << 20:
        raise ValueError(f"the checkpoint's model.block_size is {block!r:.40}, not a context length")
    return CharWindows(path, "val", block, stride=block, num_chars=num_chars)


@torch.no_grad()
def mean_loss(loss_of, windows: CharWindows, batch_size: int = 64) -> float:
    """The mean over ``windows`` of ``loss_of(inputs, targets)`` (a batch's mean loss), weighted by batch size."""
    total = 0.0
    for start in range(0, len(windows), batch_size):
        pairs = [windows[i] for i in range(start, min(start + batch_size, len(windows)))]
        inputs, targets = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        total += float(loss_of(inputs, targets)) * len(pairs)
    return total / len(windows)


def nanogpt_loss(checkout: str, checkpoint: str):
    """``loss_of`` for a checkpoint of nanoGPT's ``train.py``, with the checkout's own model class."""
    sys.path.insert(0, checkout)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)  # nanoGPT's own format: a trusted file
    gpt = GPT(GPTConfig(**saved["model_args"]))
    gpt.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    gpt.eval()
    return lambda inputs, targets: gpt(inputs, targets)[1]


def model_loss(run_dir: str):
    """``loss_of`` for the run's own newest checkpoint."""
    model, _ = load(run_dir)
    return lambda inputs, targets: model((inputs, targets))["loss"]


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory of this example (its text and windows)")
    parser.add_argument("--nanogpt", nargs=2, metavar=("DIR", "CKPT"),
                        help="score nanoGPT's checkpoint CKPT instead, with the model of its checkout DIR")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        windows = windows_of(args.run_dir)
        loss_of = nanogpt_loss(*args.nanogpt) if args.nanogpt else model_loss(args.run_dir)
    except (csf.CsfError, ValueError) as e:  # no such run or checkpoint, or one whose config names no text file
        parser.exit(2, f"{parser.prog}: error: {args.run_dir}: {e}\n")
    loss = mean_loss(loss_of, windows)
    print(f"validation loss over all {len(windows)} windows: {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
