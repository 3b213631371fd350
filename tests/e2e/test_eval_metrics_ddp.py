"""A config metric (``metrics:``, torchmetrics) under DDP: two ranks, each evaluating its shard of a set
whose size the ranks do not divide, compute the single process's whole-set value (each sample once: the
padding row left out, the ranks' states gathered by torchmetrics)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fixtures

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")
# 63 validation samples in batches of 8 over 2 ranks: rank 1's last batch ends with a padding row; the sum of
# every logit changes with any sample counted twice
COMMON = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "data.val.n=63", "data.eval_batch_size=8",
          "loop.max_steps=4", "loop.log_every=4", "optimizer=sgd", "optimizer.lr=0.1", "data.shuffle=false",
          "+metrics.logit_sum._target_=torchmetrics.SumMetric", "+metrics.logit_sum.inputs=[logits]",
          "+metrics.acc._target_=torchmetrics.Accuracy", "+metrics.acc.task=multiclass", "+metrics.acc.num_classes=4"]


@pytest.mark.skipif(not TORCHRUN.exists() and shutil.which("torchrun") is None, reason="torchrun not found")
def test_two_ranks_compute_the_metric_of_the_whole_set_once(tmp_path, cli_env):
    pytest.importorskip("torchmetrics")
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp = subprocess.run([torchrun, "--nproc_per_node=2", "-m", "csframework", *COMMON, "data.batch_size=8",
                          "backend.strategy=ddp", f"hydra.run.dir={ddp_dir}"],
                         env=cli_env, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = subprocess.run([sys.executable, "-m", "csframework", *COMMON, "data.batch_size=16",
                             f"hydra.run.dir={single_dir}"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    ddp_metrics = json.loads((ddp_dir / "summary.json").read_text())["metrics"]
    single_metrics = json.loads((single_dir / "summary.json").read_text())["metrics"]
    assert ddp_metrics["val/logit_sum"] == pytest.approx(single_metrics["val/logit_sum"], rel=1e-4, abs=1e-3)
    assert ddp_metrics["val/acc"] == single_metrics["val/acc"]
