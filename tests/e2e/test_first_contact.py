"""What a new user touches in the first hour behaves as they expect (issue 14, items 1-4, 7, 8): a NaN stops
the run at its step, ``fit()`` and ``validate()`` return one shape, the final checkpoint and summary hold
the last steps' metrics, a rejected run writes nothing, bad input gets "did you mean", and a user's own
primary config runs however it is given."""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import csframework as csf
import fixtures
from fixtures import PoisonAt, events
from forkrun import run_chains

TINY_CLI = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.eval_steps=2"]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


# -- 1. a non-finite loss stops the run at its step --------------------------------------------------------------
def test_a_nan_at_step_3_of_50_stops_at_step_3_without_a_checkpoint_after_step_2(tmp_path):
    cfg = fixtures.compose("loop.max_steps=50", "loop.log_every=10", "checkpoint.every_steps=2",
                           "checkpoint.keep_last=50")
    run = csf.Run(cfg, plugins=[PoisonAt(3)], output_dir=tmp_path)
    with pytest.raises(csf.NonFiniteLossError, match="at step 3"):
        run.fit()
    assert run.global_step == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["global_step"] == 3
    assert checkpoints(tmp_path) == ["step-00000002"]


# -- 2. fit() and validate() return one shape ---------------------------------------------------------------------
def test_fit_and_validate_return_the_same_summary_and_validate_after_fit_does_not_warn(tmp_path):
    run = csf.Run(fixtures.compose("loop.max_steps=4", "loop.eval_every=4"), output_dir=tmp_path)
    fitted, validated = run.fit(), run.validate()
    assert set(fitted) == set(validated) >= {"status", "mode", "global_step", "device_type", "metrics", "run_id"}
    assert (fitted["mode"], validated["mode"]) == ("fit", "validate")
    assert fitted["status"] == validated["status"] == "completed" and validated["global_step"] == 4
    assert validated["metrics"]["val/loss"] == pytest.approx(fitted["metrics"]["val/loss"])  # the trained weights
    assert "validating_initial_weights" not in [e["event"] for e in events(tmp_path)]

    fresh = tmp_path / "fresh"  # a validation of untrained weights is still told so
    summary = csf.Run(fixtures.compose("mode=validate"), output_dir=fresh).validate()
    assert summary["mode"] == "validate" and summary["global_step"] == 0 and "val/loss" in summary["metrics"]
    assert "validating_initial_weights" in [e["event"] for e in events(fresh)]


# -- 3. the final checkpoint and summary.json hold the last steps' metrics ----------------------------------------
def test_final_checkpoint_and_summary_hold_the_metrics_of_the_last_steps(tmp_path):
    cfg = fixtures.compose("loop.max_steps=7", "loop.log_every=5", "checkpoint.every_steps=7")
    csf.Run(cfg, output_dir=tmp_path).fit()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["name"] == "train/loss"]
    assert [int(r["step"]) for r in rows] == [5, 7]
    meta = json.loads((tmp_path / "checkpoints" / "step-00000007" / "meta.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert meta["metrics"]["train/loss"] == pytest.approx(float(rows[-1]["value"]))
    assert summary["metrics"]["train/loss"] == pytest.approx(float(rows[-1]["value"]))


# -- 7. bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("loop.max_stepz=5", "did you mean `loop.max_steps`?"),
    ("lop.max_steps=5", "did you mean `loop`?"),
    ("optimizer.schedule.warmup_step=5", "did you mean `optimizer.schedule.warmup_steps`?"),
    ("precision=bfloat61", "did you mean `precision=bfloat16`?"),
    ("+stages.b.loop.max_stepz=3", "did you mean `stages.b.loop.max_steps`?"),
    ("stages.b.loop.max_steps=3", "to add it, write +stages.b.loop.max_steps=3"),
    # a model's arguments are an open map: its keys, not a schema's, are the nearest; the + form stays offered
    ("model.net.hiden=5", "did you mean `model.net.hidden`? (to add a new key, write +model.net.hiden=5)"),
    # the whole override, quoted for a shell (it was cut at its first space: `write +metrics={mae:`)
    ("metrics={mae: {_target_: x.Y}}", "to add it, write '+metrics={mae: {_target_: x.Y}}'"),
    # a nested group's option is suggested as it is written (a '/'), without a '+' where one fails (a group
    # in every defaults list: "Multiple values for hydra/sweeper"); test_cli.py: a group of the user's own
    ("hydra/launcher=joblibb", "did you mean `hydra/launcher=joblib`?"),
    ("+hydra/sweeper=optunaa", "did you mean `hydra/sweeper=optuna`?"),
])
def test_a_misspelled_key_or_option_gets_did_you_mean(override, message):
    with pytest.raises(csf.ConfigError) as error:
        csf.Run(fixtures.compose(override))
    assert message in str(error.value)


def test_a_group_of_the_user_s_own_is_suggested_with_the_plus_it_needs(tmp_path):
    """``+experiment=spiral`` (a group no defaults list holds): the suggestion keeps the ``+``; without it the
    pasted override is refused (no match in the defaults list)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "spirals.yaml").write_text("# @package _global_\nseed: 3\n")
    with pytest.raises(csf.ConfigError, match=re.escape("did you mean `+experiment=spirals`?")):
        csf.compose(["+experiment=spiral"], config_dir=tmp_path)
    assert csf.compose(["+experiment=spirals"], config_dir=tmp_path).seed == 3


def test_predict_without_a_predict_set_says_how_to_give_one(tmp_path):
    """data.predict is None in the schema: ``data.predict._target_=...`` would be refused (not in the config);
    the message gives the form that works, which composes."""
    with pytest.raises(csf.ConfigError, match=re.escape("+data.predict._target_=<dataset class>")):
        csf.Run(fixtures.compose(), output_dir=tmp_path).predict()
    fixtures.compose("+data.predict._target_=x.Y", "+data.predict.n=3")


def test_a_stage_device_type_in_lower_case_is_the_run_s_device():
    cfg = fixtures.compose("+stages.a.loop.max_steps=1", "+stages.b.device.type=cpu", "+stages.b.loop.max_steps=1")
    run = csf.Run(cfg)
    assert [c.device.type for _, c in run.stages] == ["CPU", "CPU"]


def test_plugins_enable_naming_a_missing_module_is_a_config_error(tmp_path):
    with pytest.raises(csf.PluginError) as error:
        csf.Run(fixtures.compose("plugins.enable=[no_such_plugin_module]"), output_dir=tmp_path)
    assert error.value.exit_code == 2 and "no_such_plugin_module" in str(error.value)


def test_a_warm_up_longer_than_the_run_warns_naming_both_keys(tmp_path):
    csf.Run(fixtures.compose("loop.max_steps=4", "optimizer.schedule.warmup_steps=30"), output_dir=tmp_path).fit()
    warnings = [e for e in events(tmp_path) if e["event"] == "warmup_longer_than_training"]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning"
    assert "optimizer.schedule.warmup_steps (30)" in warnings[0]["problem"]
    assert "loop.max_steps (4)" in warnings[0]["problem"]


def test_a_resumed_warm_up_longer_than_the_run_says_a_new_run_is_the_fix(tmp_path):
    """On a resume the schedule is the checkpoint's: the warning's fix (a shorter warm-up) takes a new run; it
    was given as if the setting would act (a newcomer set it, resumed, and was told to set it again)."""
    csf.Run(fixtures.compose("loop.max_steps=4", "optimizer.schedule.warmup_steps=30",
                             "checkpoint.every_steps=2"), output_dir=tmp_path).fit()
    csf.Run(fixtures.compose("loop.max_steps=8", "optimizer.schedule.warmup_steps=1", "checkpoint.resume=auto"),
            output_dir=tmp_path).fit()
    first, resumed = [e for e in events(tmp_path) if e["event"] == "warmup_longer_than_training"]
    assert first["fix"].startswith("set optimizer.schedule.warmup_steps=0")
    assert resumed["fix"].startswith("a resumed run keeps its checkpoint's schedule: in a new run, set "
                                     "optimizer.schedule.warmup_steps=0")


# -- 8. a user's own primary config -------------------------------------------------------------------------------
@pytest.fixture
def user_conf(tmp_path) -> Path:
    """A user config directory: the test groups plus a primary config extending csframework's."""
    conf = tmp_path / "user_conf"
    shutil.copytree(fixtures.CONF, conf)
    (conf / "mine.yaml").write_text(textwrap.dedent("""\
        defaults:
          - config
          - override model: blobs_mlp
          - override data: blobs
          - _self_
        loop:
          max_steps: 5
          log_every: 5
          eval_every: null
          eval_steps: 2
        optimizer:
          lr: 0.02
        """))
    return conf


def test_compose_with_a_user_primary_config_fits_with_its_values(tmp_path, user_conf):
    cfg = csf.compose(["optimizer=sgd"], config_dir=str(user_conf), config_name="mine")
    assert (cfg.loop.max_steps, cfg.optimizer.lr) == (5, 0.02)
    summary = csf.Run(cfg, output_dir=tmp_path / "run").fit()
    assert summary["status"] == "completed" and summary["global_step"] == 5


# -- the command line: nothing written for a rejected run, one line for a bad sweep, every way to give configs ------
@pytest.mark.slow
def test_the_command_line_of_a_new_user(tmp_path, cli_env, user_conf):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "chatty_plugin.py").write_text(textwrap.dedent("""\
        import logging
        from csframework import hookimpl

        @hookimpl
        def on_fit_start(run):
            logging.getLogger("chatty_plugin").info("hello from the plugin")
        """))
    env = dict(cli_env, PYTHONPATH=os.pathsep.join([str(tmp_path), cli_env["PYTHONPATH"]]))
    existing = work / "existing"
    existing_record = b"# the record of an earlier run\n"
    (existing / ".hydra").mkdir(parents=True)
    (existing / ".hydra" / "config.yaml").write_bytes(existing_record)
    cases = {
        "rejected": TINY_CLI + ["loop.max_steps=3", "loop.log_every=0"],
        "compose-error": TINY_CLI + ["loop.max_stepz=3"],
        "check": TINY_CLI + ["mode=check"],
        "missing-plugin": TINY_CLI + ["plugins.enable=[no_such_plugin_module]"],
        "missing-stage": TINY_CLI + ["stages.b.loop.max_steps=3"],
        "rejected-into-a-run": TINY_CLI + ["loop.log_every=0", f"hydra.run.dir={existing}"],
        "help": ["--help"],
        "sweep-bad-value": ["-m", *TINY_CLI, "loop.max_steps=2", "optimizer.lr=0.1,abc"],
        "primary": ["--config-dir", str(user_conf), "--config-name", "mine", f"hydra.run.dir={work}/primary"],
        "searchpath": ["model=blobs_mlp", "data=blobs", "loop.max_steps=3", "loop.eval_steps=2",
                       f"hydra.searchpath=[file://{user_conf}]", f"hydra.run.dir={work}/searchpath"],
        "config-dir": ["--config-dir", str(user_conf), "model=blobs_mlp", "data=blobs", "loop.max_steps=3",
                       "loop.eval_steps=2", "plugins.enable=[chatty_plugin]", f"hydra.run.dir={work}/config-dir"],
    }
    # one at a time: two runs started in the same second would share the default run directory
    results = dict(zip(cases, [c[0] for c in run_chains([[{"argv": argv}] for argv in cases.values()],
                                                         env, parallel=1, cwd=str(work))]))

    for case in ("rejected", "compose-error", "missing-plugin", "missing-stage", "rejected-into-a-run"):
        assert results[case]["returncode"] == 2, (case, results[case]["stderr"])
        assert "Traceback" not in results[case]["stderr"], case
    assert results["check"]["returncode"] == 0, results["check"]["stderr"]
    assert sorted(p.name for p in work.iterdir()) == ["config-dir", "existing", "primary", "searchpath"]
    assert sorted(p.name for p in existing.rglob("*")) == [".hydra", "config.yaml"]
    assert (existing / ".hydra" / "config.yaml").read_bytes() == existing_record
    assert "did you mean `loop.max_steps`?" in results["compose-error"]["stderr"]
    assert "+stages.b.loop.max_steps=3" in results["missing-stage"]["stderr"]

    assert results["help"]["returncode"] == 0 and "max_steps" in results["help"]["stdout"]
    assert "selected" not in results["help"]["stdout"]

    sweep = results["sweep-bad-value"]
    assert sweep["returncode"] == 2
    assert [line for line in sweep["stderr"].splitlines() if line.strip()] == [
        "csframework: error: the sweep's job with optimizer.lr=abc: optimizer.lr: Value 'abc' of type 'str' "
        "could not be converted to Float"]

    for case, steps in (("primary", 5), ("searchpath", 3), ("config-dir", 3)):
        assert results[case]["returncode"] == 0, (case, results[case]["stderr"][-3000:])
        summary = json.loads((work / case / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["global_step"] == steps, case
        assert (work / case / ".hydra" / "config.yaml").is_file(), case
    # one stream and format for the user's logging and csframework's; nothing on stdout
    fit = results["config-dir"]
    assert "][chatty_plugin][INFO] - hello from the plugin" in fit["stderr"]
    assert "][csframework][INFO] - fit_start" in fit["stderr"] and fit["stdout"] == ""
    assert yaml.safe_load((work / "primary" / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] == 0.02


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not found")
@pytest.mark.parametrize("run_dir", [None, "runs/${now:%H-%M-%S-%f}"], ids=["default", "per-rank-name"])
def test_torchrun_ranks_share_one_run_directory_and_leave_no_other(tmp_path, cli_env, run_dir):
    """Without ``hydra.run.dir`` (and with one that differs per rank), every rank uses rank 0's directory and
    no rank leaves a directory of its own."""
    argv = [str(TORCHRUN), "--nproc_per_node=2", "-m", "csframework", *TINY_CLI, "loop.max_steps=2",
            "backend.strategy=ddp"] + ([f"hydra.run.dir={run_dir}"] if run_dir else [])
    done = subprocess.run(argv, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    leaves = [p for p in tmp_path.rglob("*") if p.is_dir() and not any(q.is_dir() for q in p.iterdir())
              and p.name not in ("step-00000002", ".hydra")]
    runs = [p for p in tmp_path.rglob("events.jsonl")]
    assert len(runs) == 1, runs
    assert [p for p in leaves if p != runs[0].parent] == [], f"stray directories: {leaves}"
    assert (runs[0].parent / ".hydra" / "config.yaml").is_file()
    assert sum('"event": "fit_start"' in line for line in runs[0].read_text().splitlines()) == 1
