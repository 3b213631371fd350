"""csframework-cerebras against the real cerebras-pytorch (cstorch) of its own venv. Without cstorch (the core's
CI venv, torch 2.13) every test here is skipped. Each run is a fresh process (conftest.py)."""
import json
import math

import pytest
import torch

pytest.importorskip("cerebras.pytorch", reason="cerebras-pytorch is not installed (it has its own venv: see README)")

from bridge_runs import BRIDGE, COMPARED, cli  # noqa: E402

pytestmark = pytest.mark.slow
TINY = ["loop.eval_every=4"]


def params(run_dir):
    """The newest checkpoint's model parameters (``checkpoints/index.json`` lists them, oldest first)."""
    newest = json.loads((run_dir / "checkpoints" / "index.json").read_text())["checkpoints"][-1]
    return torch.load(run_dir / "checkpoints" / newest / "state.pt", weights_only=True)["model"]


def test_the_bridge_trains_through_cstorch(runs):
    summary = runs["bridge"].summary
    assert summary["status"] == "completed" and summary["global_step"] == 12
    assert summary["device_type"] == "CSX" and summary["cerebras"]["type"] == "CPU"
    assert summary["traces"] == 12  # cstorch's CPU backend runs the step's Python every step (no trace)
    # a train executor up to each evaluation (steps 5, 10) and the stage's end, an executor per evaluation
    # (its 3 batches each), and the state fetched by the checkpoint closure where it is saved (3, 6, 9, 12)
    assert summary["cerebras"]["executors"] == 3 + 3 and summary["eval_traces"] == 3 * 3
    assert summary["cerebras"]["checkpoint_fetches"] == 4
    assert "val/loss" in summary["metrics"]


def test_parameters_match_device_cpu(runs):
    ours, theirs = params(runs["bridge"].output_dir), params(runs["cpu"].output_dir)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.allclose(ours[key], theirs[key], atol=1e-5, rtol=0), key


def test_metrics_and_events_are_those_of_device_cpu(runs):
    """The step's values reach the ordinary hooks and metrics through cstorch's step closures: metrics.csv
    has the same rows as device=cpu's (cstorch keeps the learning rate in a float32 tensor), events.jsonl
    the same events."""
    def rows(result):
        return {(r["step"], r["name"]): r["value"] for r in result.metrics if r["name"] != "steps_per_sec"}

    ours, theirs = rows(runs["bridge"]), rows(runs["cpu"])
    assert ours.keys() == theirs.keys() and any(name == "train/loss" for _, name in ours)
    for key, value in theirs.items():
        assert math.isclose(ours[key], value, rel_tol=1e-6 if key[1] == "lr" else 0, abs_tol=1e-5), key
    names = [[e["event"], e.get("step")] for e in runs["bridge"].events]
    assert names == [[e["event"], e.get("step")] for e in runs["cpu"].events]


def test_user_step_closures_run_when_their_step_ends(csf_runner):
    """A ``@cstorch.step_closure`` in the user's model has run, with its step's value, by the time the
    step's ``on_train_batch_end`` fires (as cstorch's own loop runs them, before the next step)."""
    result = cli(csf_runner, [*BRIDGE, *TINY, "loop.max_steps=6", "model.net._target_=bridge_plugins.ClosureNet",
                              "plugins.enable=[bridge_plugins:ClosureOrder]"])
    assert result.exit_code == 0, result.stderr[-2000:]
    assert result.summary["closures"] == [[step, step] for step in range(1, 7)]


def test_a_killed_run_resumes_exactly(runs, csf_runner):
    """SIGKILL at step 7 (checkpoints at 3 and 6), then ``checkpoint.resume=auto``: the parameters after
    step 12 are those of the uninterrupted run."""
    killed = cli(csf_runner, [*BRIDGE, *COMPARED, "plugins.enable=[bridge_plugins:KillAt]"],
                 env={"BRIDGE_KILL_AT": "7"})
    assert killed.exit_code == -9, killed.stderr[-2000:]
    assert json.loads((killed.output_dir / "checkpoints" / "index.json").read_text())["checkpoints"] == [
        "step-00000003", "step-00000006"]
    resumed = cli(csf_runner, [*BRIDGE, *COMPARED, "checkpoint.resume=auto"], output_dir=killed.output_dir)
    assert resumed.exit_code == 0, resumed.stderr[-2000:]
    assert resumed.summary["global_step"] == 12
    assert any(e["event"] == "resumed" and e["step"] == 6 for e in resumed.events)
    ours, theirs = params(resumed.output_dir), params(runs["bridge"].output_dir)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_bfloat16_runs_under_cstorch_autocast_as_on_device_cpu(csf_runner):
    overrides = [*TINY, "loop.max_steps=8", "precision=bfloat16"]
    bridged, eager = cli(csf_runner, [*BRIDGE, *overrides]), cli(csf_runner, ["device=cpu", *overrides])
    assert bridged.exit_code == 0 and eager.exit_code == 0, (bridged.stderr[-1500:], eager.stderr[-1500:])
    assert bridged.summary["cerebras"]["precision"] == "bfloat16"
    ours, theirs = params(bridged.output_dir), params(eager.output_dir)
    for key in ours:
        assert torch.allclose(ours[key], theirs[key], atol=1e-5, rtol=0), key


def test_compile_only_lowers_locally_and_names_the_cluster_setting(csf_runner):
    result = cli(csf_runner, ["backend=cerebras", "backend.compile_only=true", *TINY, "loop.max_steps=8"])
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("csframework: error: cerebras.mgmt_address:") and "Traceback" not in result.stderr
    assert "ClusterConfigError" not in last
    executor = result.output_dir / "cerebras" / "executors" / "000001"
    assert sorted(p.name for p in executor.glob("*.mlir")) == ["cirh.mlir", "torch.mlir"]
    assert "torch.vtensor" in (executor / "torch.mlir").read_text()
    assert not (result.output_dir / "checkpoints").exists() or not any((result.output_dir / "checkpoints").iterdir())
    assert any(e["event"] == "cerebras_mixed_precision" for e in result.events)  # float32: cstorch's float16


def test_cbfloat16_with_dynamic_loss_scaling_and_the_schedule_are_in_the_lowered_graph(csf_runner):
    """precision=cbfloat16 maps onto cstorch.amp (the half dtype, a GradScaler with dynamic loss scaling),
    and the learning-rate schedule is stepped inside the traced step, so the graph computes the rate from
    its own state each step instead of freezing the first step's rate."""
    result = cli(csf_runner, ["backend=cerebras", "backend.compile_only=true", *TINY, "precision=cbfloat16",
                              "precision.loss_scaling=dynamic", "optimizer.schedule.warmup_steps=4"])
    assert result.exit_code == 2, result.stderr[-2000:]
    cirh = (result.output_dir / "cerebras" / "executors" / "000001" / "cirh.mlir").read_text()
    assert 'cs.fp16_type = "cbfloat16"' in cirh
    assert 'tf.resource_name = "state.grad_scaler.0.loss_scale"' in cirh
    assert 'tf.resource_name = "state.schedulers.0.last_epoch"' in cirh


def test_validate_only_reports_what_cstorch_checked_and_finishes(csf_runner):
    result = cli(csf_runner, ["backend=cerebras", "backend.validate_only=true", *TINY, "precision=bfloat16"])
    assert result.exit_code == 0, result.stderr[-2000:]
    assert result.summary["status"] == "validated" and result.summary["global_step"] == 0
    [report] = [e for e in result.events if e["event"] == "validate_only"]
    assert report["ops"] > 0 and "lowered it to Cerebras IR (CIRH) locally" in report["result"]
    assert (result.output_dir / "cerebras" / "executors" / "000001" / "cirh.mlir").stat().st_size > 0


@pytest.mark.parametrize("overrides, key", [
    (["backend.type=GPU"], "backend.type"),
    (["cerebras.job_priority=urgent"], "cerebras.job_priority"),
    (["cerebras.mgmt_address=nohost"], "cerebras.mgmt_address"),
    (["optimizer._target_=torch.optim.RMSprop"], "optimizer._target_"),
    (["backend.num_csx=0"], "backend.num_csx"),
    (["cerebras.job_time_sec=soon"], "cerebras.job_time_sec"),
    (["cerebras.mount_dirs=[/no/such/dir]"], "cerebras.mount_dirs: /no/such/dir does not exist"),
    (["backend.type=CPU", "precision=float16", "precision.loss_scaling=dynamic"], "precision: float16"),
    (["backend.type=CPU", "precision=cbfloat16", "precision.loss_scaling=dynamic"], "precision: cbfloat16"),
    (["backend.type=CPU", "loop.grad_accum_steps=2"], "loop.grad_accum_steps"),
    (["backend.type=CPU", "+stages={a: {loop: {max_steps: 2}}}"], "stages"),
])
def test_bad_settings_exit_2_naming_the_key(csf_runner, overrides, key):
    result = cli(csf_runner, ["backend=cerebras", *TINY, *overrides])
    assert result.exit_code == 2, result.stderr[-2000:]
    assert key in result.stderr and "Traceback" not in result.stderr
    assert not result.output_dir.exists() or not (result.output_dir / "summary.json").exists()


def test_training_on_the_cluster_without_an_address_is_refused_before_launch(csf_runner):
    result = cli(csf_runner, ["backend=cerebras", *TINY])
    assert result.exit_code == 2
    assert "cerebras.mgmt_address" in result.stderr.strip().splitlines()[-1]


def test_device_and_the_cerebras_backend_are_exclusive(csf_runner):
    result = cli(csf_runner, ["device=csx", "backend=cerebras", *TINY])
    assert result.exit_code == 2 and "device, backend: both choose the device" in result.stderr


def test_the_cluster_config_is_built_from_the_cerebras_section(tmp_path):
    """type=CSX with a cluster: what cstorch is handed (``ClusterConfig``), built from ``cerebras.*`` and
    ``backend.num_csx``/``num_workers_per_csx`` (no cluster can be reached here to run on it)."""
    import cerebras.pytorch as cstorch

    import csframework as csf
    from csframework_cerebras.backend import cluster_config

    data, code = tmp_path / "data", tmp_path / "code"
    data.mkdir(), code.mkdir()

    config = csf.compose(["backend=cerebras", "cerebras.mgmt_address=mgmt.example:443", "cerebras.mgmt_namespace=team",
                          "backend.num_csx=2", "backend.num_workers_per_csx=4", f"cerebras.mount_dirs=[{data}]",
                          f"cerebras.python_paths=[{code}]", "cerebras.job_labels=['team=ml']",
                          "cerebras.job_priority=p1", "cerebras.job_time_sec=3600", "data.batch_size=8"],
                         plugins=["csframework_cerebras.plugin"])
    cluster = cluster_config(cstorch, config)
    assert isinstance(cluster, cstorch.distributed.ClusterConfig)
    assert (cluster.mgmt_address, cluster.mgmt_namespace, cluster.num_csx, cluster.num_workers_per_csx) == (
        "mgmt.example:443", "team", 2, 4)
    assert [m.path for m in cluster.mount_dirs] == [str(data)] and cluster.python_paths == [str(code)]
    assert cluster.job_priority == cstorch.distributed.ClusterConfig(job_priority="p1").job_priority
    assert (cluster.job_time_sec, list(cluster.job_labels)) == (3600, ["team=ml"])
