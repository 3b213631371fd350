"""Datasets under DDP: two torchrun ranks with two loader workers each read every sample once per epoch, for
an IterableDataset (sharded by the framework) and a map-style one, through a user collate_fn."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from numbered import N, write_conf

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="torchrun not found")
@pytest.mark.parametrize("data", ["numbered", "numbered_map"])
def test_two_ddp_ranks_with_workers_read_each_sample_once_per_epoch(tmp_path, cli_env, data):
    conf = write_conf(tmp_path / "conf")
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    env = dict(cli_env, SEEN_DIR=str(seen_dir))
    # 64 samples, 2 ranks x batch 8: 4 steps per epoch; 8 steps are 2 epochs
    done = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "csframework", "--config-dir", conf,
                           "model=seen", f"data={data}", "data.num_workers=2", "loop.max_steps=8",
                           "loop.log_every=4", "optimizer=sgd", "backend.strategy=ddp",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [[[int(i) for i in line.split()] for line in (seen_dir / f"rank-{r}.txt").read_text().splitlines()]
             for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [8, 8]
    for epoch in range(2):
        shares = [[i for batch in batches[4 * epoch: 4 * epoch + 4] for i in batch] for batches in ranks]
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == list(range(N)), f"epoch {epoch}"
