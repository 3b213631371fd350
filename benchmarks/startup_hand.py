"""The hand-written baseline of ``benchmarks/startup.py``: a plain PyTorch script that builds the same model,
data, optimizer and schedule as ``python -m csframework`` does for the same workload and runs one step.

    python benchmarks/startup_hand.py mlp            # fixtures.mlp on fixtures.Blobs (tests/support on PYTHONPATH)
    python benchmarks/startup_hand.py default        # the embedded default: TinyTransformer on StdlibText
    python benchmarks/startup_hand.py default hydra  # the same inside a bare Hydra app (what Hydra alone costs)

When the first optimizer step (and the schedule's step) is done it writes the wall clock and its CPU time so
far to the file named by ``CSF_FIRST_STEP_FILE``, as ``benchmarks.startup.FirstStep`` does inside the
framework's run. Run by path, not as a module, so that it imports no more than such a script would.
"""
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

torch.set_num_threads(int(os.environ.get("CSF_BENCH_THREADS", "1")))


def mlp_workload():
    from fixtures import Blobs, mlp

    net = mlp(dim=8, hidden=16, classes=4)
    return net, Blobs(n=256), 16, lambda x, y: F.cross_entropy(net(x), y)


def default_workload():
    from csframework.defaults import StdlibText, TinyTransformer

    model = TinyTransformer(vocab_size=256, block_size=64, d_model=128, n_layers=2, n_heads=4, dropout=0.0)
    data = StdlibText(split="train", block_size=64, num_chars=600_000)
    return model, data, 32, lambda x, y: model((x, y))["loss"]  # the model computes its loss


def main(workload: str) -> None:
    torch.manual_seed(0)
    model, dataset, batch_size, loss_of = {"mlp": mlp_workload, "default": default_workload}[workload]()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    # conf/optimizer/adamw.yaml: AdamW, clipping at 1.0, 30 warm-up steps then a cosine decay
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    warmup, total, floor = 30, 1, 3e-4 / 3e-3
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else
                                                  floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1, s / total))))
    model.train()
    for x, y in loader:
        loss = loss_of(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        break
    stamp = os.environ.get("CSF_FIRST_STEP_FILE")
    if stamp:
        with open(stamp, "w") as f:
            f.write(f"{time.time()!r} {time.process_time()!r}")
    print(f"loss {loss.item():.4f}")


def hydra_app() -> None:
    """``main`` as the task of an empty ``@hydra.main`` app (Hydra's argument parsing, its two compositions,
    its output directory, logging and ``.hydra/`` record): the floor of any Hydra application."""
    import hydra

    argv, sys.argv = sys.argv, [sys.argv[0], f"hydra.run.dir={os.environ.get('CSF_HYDRA_RUN_DIR', 'outputs')}"]
    hydra.main(version_base="1.3", config_path=None)(lambda cfg: main(argv[1]))()


if __name__ == "__main__":
    hydra_app() if sys.argv[2:] == ["hydra"] else main(sys.argv[1] if len(sys.argv) > 1 else "mlp")
