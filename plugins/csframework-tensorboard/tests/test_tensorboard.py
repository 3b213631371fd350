"""csframework-tensorboard: the event files, read back with TensorBoard's own reader, hold what the run
logged (metrics.csv), the config and the hparams; rank 0 writes alone; a resume appends without duplicates."""
import shutil

import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

pytestmark = pytest.mark.slow
ONLY = ["tensorboard"]  # entry-point plugins these runs load


def read(log_dir):
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0,
                                                                          event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def scalars(acc) -> dict:
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def logged(result) -> dict:
    """metrics.csv as {name: [(step, value)]} (a step's last row winning, were there two)."""
    by_name: dict = {}
    for row in result.metrics:
        by_name.setdefault(row["name"], {})[row["step"]] = row["value"]
    return {name: sorted(steps.items()) for name, steps in by_name.items()}


def assert_same(tb: dict, csv: dict):
    assert tb.keys() == csv.keys()
    for name in csv:
        assert [s for s, _ in tb[name]] == [s for s, _ in csv[name]], name
        assert [v for _, v in tb[name]] == pytest.approx([v for _, v in csv[name]], rel=1e-6), name


def test_scalars_config_and_hparams(csf_runner):
    result = csf_runner.run(autoload=ONLY)
    assert result.exit_code == 0, result.error
    acc = read(result.output_dir / "tensorboard")
    assert_same(scalars(acc), logged(result))
    assert {"train/loss", "val/loss", "val/accuracy", "lr"} <= set(scalars(acc))

    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    optimizer:\n" in text and "      name: sgd\n" in text

    content = acc.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = session.session_start_info.hparams
    assert hp["optimizer.lr"].number_value == pytest.approx(0.1)
    assert hp["optimizer.name"].string_value == "sgd"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert "val/loss" in {m.name.tag for m in experiment.metric_infos}


def test_a_resumed_run_appends_without_duplicate_steps(csf_runner):
    first = csf_runner.run(["checkpoint.every_steps=10", "checkpoint.keep_last=5"], autoload=ONLY)
    assert first.exit_code == 0, first.error
    shutil.rmtree(first.output_dir / "checkpoints" / "step-00000020")  # as if it died before saving step 20
    resumed = csf_runner.run(["checkpoint.every_steps=10", "checkpoint.keep_last=5", "checkpoint.resume=auto"],
                             output_dir=first.output_dir, autoload=ONLY)
    assert resumed.exit_code == 0, resumed.error
    # metrics.csv holds each step once: the rows after step 10's checkpoint moved to metrics-superseded.csv
    assert [r["step"] for r in resumed.metrics if r["name"] == "train/loss"] == [5, 10, 15, 20]
    log_dir = first.output_dir / "tensorboard"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one per process, in one directory
    assert_same(scalars(read(log_dir)), logged(resumed))


def test_log_dir_from_the_command_line_and_disable(csf_runner, tmp_path):
    result = csf_runner.cli([f"tensorboard.log_dir={tmp_path / 'tb'}", "tensorboard.flush_secs=5"], autoload=ONLY)
    assert result.exit_code == 0, result.stderr[-2000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert not (result.output_dir / "tensorboard").exists()

    off = csf_runner.run(["plugins.disable=[tensorboard]"], autoload=ONLY)
    assert off.exit_code == 0, off.error
    assert not (off.output_dir / "tensorboard").exists()
    refused = csf_runner.run(["plugins.disable=[tensorboard]", "tensorboard.flush_secs=5"], autoload=ONLY)
    assert refused.exit_code == 2
    assert "tensorboard.flush_secs: plugin 'tensorboard' is disabled" in str(refused.error)
    on_the_command_line = csf_runner.cli(["plugins.disable=[tensorboard]", "tensorboard.flush_secs=10"],
                                         autoload=ONLY)
    assert on_the_command_line.exit_code == 2
    assert on_the_command_line.stderr.strip().splitlines()[-1] == (
        "csframework: error: tensorboard.flush_secs: plugin 'tensorboard' is disabled (plugins.disable), so its "
        "config section is gone; remove the setting or enable the plugin")


def test_under_ddp_only_rank_0_writes(csf_runner):
    result = csf_runner.cli(["data.batch_size=8"], nproc=2, autoload=ONLY)
    assert result.exit_code == 0, result.stderr[-3000:]
    files = list((result.output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    assert_same(scalars(read(result.output_dir / "tensorboard")), logged(result))


def test_a_compiled_run_writes_the_same_scalars(csf_runner):
    """backend.compile=true: the event file holds the run's logged metrics, step for step."""
    result = csf_runner.run(["backend.compile=true"], autoload=ONLY)
    assert result.exit_code == 0, result.error
    assert result.summary["compile"]["graph_breaks"] == 0
    assert_same(scalars(read(result.output_dir / "tensorboard")), logged(result))
