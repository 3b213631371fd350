"""The command line: the headline commands, refused runs (exit status, the key
named, no traceback, nothing written), entry-point plugins, ``--cfg job``, multirun, ``mode=check`` and
what reaches the console."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import fixtures

pytestmark = pytest.mark.slow

TINY = ["--config-dir", fixtures.CONF, "model=blobs_mlp", "data=blobs", "loop.eval_steps=2"]


def cli(*overrides, env, flags=(), cwd=None, timeout=180, tiny=True):
    """``python -m csframework [flags] [tiny config] overrides`` (Hydra wants flags such as ``-m`` first)."""
    cmd = [sys.executable, "-m", "csframework", *flags, *(TINY if tiny else []), *overrides]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def assert_nothing_written(run_dir: Path):
    for name in ("checkpoints", "metrics.csv", "summary.json", "events.jsonl"):
        assert not (run_dir / name).exists(), f"{name} was written"


# -- 2. the headline command -----------------------------------------------------------------------------------
def test_headline_csx_command_checks(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    r = cli("device=csx", "backend.retrace_every_iteration=true", "mode=check", f"hydra.run.dir={run_dir}",
            env=cli_env, cwd=tmp_path, tiny=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check passed: device CSX" in r.stdout
    assert_nothing_written(run_dir)


# -- 3, 4. refused runs --------------------------------------------------------------------------------------------
def test_device_and_backend_together_are_refused_naming_both(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    r = cli("device=gpu", "backend=csx", "loop.max_steps=3", f"hydra.run.dir={run_dir}", env=cli_env)
    assert r.returncode == 2, r.stderr
    assert "device, backend: both choose the device (device=gpu, backend=csx)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_written(run_dir)


@pytest.mark.parametrize("overrides, line", [
    (["backend.compile_only=true"], "backend.compile_only: only CSX understands it"),
    (["optimizer.lr=abc"], "csframework: error: optimizer.lr: Value 'abc' of type 'str' could not be converted"),
    (["loop.max_stepz=5"], "csframework: error: loop.max_stepz: Key 'max_stepz' not in 'LoopConfig'"),
    (["precision=fp8"], "csframework: error: precision: no option 'fp8' in config group 'precision'"),
    (["+stages.a.loop.max_steps=2", "+stages.b.device=csx"],
     "stages.b.device: CSX differs from the run's device CPU"),
], ids=["compile_only-on-cpu", "lr-not-a-number", "unknown-key", "no-such-precision", "stage-device"])
def test_bad_runs_exit_2_naming_the_key_without_traceback(tmp_path, cli_env, overrides, line):
    run_dir = tmp_path / "run"
    r = cli("loop.max_steps=3", *overrides, f"hydra.run.dir={run_dir}", env=cli_env)
    assert r.returncode == 2, r.stderr
    assert line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert_nothing_written(run_dir)


# -- 5. plugins from the command line -------------------------------------------------------------------------------
PLUGIN = '''
import os
from csframework import hookimpl

@hookimpl
def on_train_batch_end(run, batch_idx):
    with open(os.environ["STEP_COUNTER_FILE"], "a") as f:
        f.write(f"{run.global_step}\\n")
'''


def install_entry_point_plugin(site: Path, name: str = "step_counter") -> None:
    """A distribution as pip would leave it: a module and ``<name>-0.1.dist-info`` with an entry point."""
    (site / f"{name}_plugin.py").write_text(PLUGIN)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[csframework.plugins]\n{name} = {name}_plugin\n")


def test_an_entry_point_plugin_is_discovered_and_can_be_disabled(tmp_path, cli_env):
    site = tmp_path / "site"
    site.mkdir()
    install_entry_point_plugin(site)
    counter = tmp_path / "calls.txt"
    env = dict(cli_env, PYTHONPATH=f"{site}:{cli_env['PYTHONPATH']}", STEP_COUNTER_FILE=str(counter),
               CSFRAMEWORK_PLUGINS_AUTOLOAD="step_counter")

    r = cli("loop.max_steps=7", f"hydra.run.dir={tmp_path / 'on'}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert counter.read_text().split() == [str(s) for s in range(1, 8)]  # once per step

    counter.unlink()
    r = cli("loop.max_steps=7", "plugins.disable=[step_counter]", f"hydra.run.dir={tmp_path / 'off'}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not counter.exists()
    assert json.loads((tmp_path / "off" / "summary.json").read_text())["global_step"] == 7


def test_a_broken_entry_point_plugin_is_named(tmp_path, cli_env):
    site = tmp_path / "site"
    site.mkdir()
    install_entry_point_plugin(site, "broken")
    (site / "broken_plugin.py").write_text("raise ImportError('missing dependency foo')\n")
    env = dict(cli_env, PYTHONPATH=f"{site}:{cli_env['PYTHONPATH']}", CSFRAMEWORK_PLUGINS_AUTOLOAD="broken")
    r = cli("loop.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert r.returncode != 0
    assert ("plugin 'broken' (distribution broken 0.1) failed to load: ImportError: missing dependency foo; "
            "turn it off with plugins.disable=[broken]") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_plugin_module_that_fails_to_import_is_named(tmp_path, cli_env):
    r = cli("loop.max_steps=2", "plugins.enable=[no.such.module]", f"hydra.run.dir={tmp_path / 'run'}",
            env=cli_env)
    assert r.returncode != 0
    assert "plugin 'no.such.module' (plugins.enable) failed to load: ModuleNotFoundError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_written(tmp_path / "run")


def test_a_plugin_raising_in_a_hook_fails_the_run_with_its_name(tmp_path, cli_env):
    (tmp_path / "exploding.py").write_text(textwrap.dedent('''
        from pathlib import Path
        from csframework import hookimpl

        @hookimpl
        def on_eval_end(run, metrics):
            raise ValueError("cannot handle " + ", ".join(sorted(metrics)))

        @hookimpl
        def on_exception(run, error):
            (Path(run.output_dir) / "on_exception.txt").write_text(type(error).__name__)
    '''))
    env = dict(cli_env, PYTHONPATH=f"{tmp_path}:{cli_env['PYTHONPATH']}")
    run_dir = tmp_path / "run"
    r = cli("loop.max_steps=4", "loop.eval_every=2", "checkpoint.every_steps=1", "plugins.enable=[exploding]",
            f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == 1
    # one line: the step, the plugin and hook, its file:line and the exception; the traceback in error.txt
    assert (f"csframework: error: the evaluation at step 2 failed in plugin 'exploding', hook 'on_eval_end' "
            f"({tmp_path / 'exploding.py'}:7): ValueError: cannot handle val/accuracy, val/loss; the traceback is "
            f"in {run_dir / 'error.txt'}") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert (run_dir / "on_exception.txt").read_text() == "PluginError"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["global_step"] == 2
    # the evaluation at step 2 failed before step 2's checkpoint: step 1's is the last, intact
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    assert index["checkpoints"][-1] == "step-00000001"


# -- 8. the config on the command line -------------------------------------------------------------------------------
def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path, cli_env):
    r = cli("optimizer=sgd", "optimizer.lr=0.25", "loop.max_steps=42", flags=["--cfg", "job"],
            env=cli_env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["optimizer"]["name"] == "sgd" and cfg["optimizer"]["lr"] == 0.25
    assert cfg["loop"]["max_steps"] == 42 and cfg["model"]["_target_"] == "csframework.models.Supervised"
    assert cfg["device"]["type"] == "CPU" and cfg["backend"]["type"] == "CPU"
    assert "hydra" not in cfg
    assert list(tmp_path.iterdir()) == []  # no run directory


def _schema_defaults(schema) -> dict:
    """Every field of a backend schema with its default, as YAML reads it back."""
    import dataclasses
    from enum import Enum

    values = {f.name: getattr(schema(), f.name) for f in dataclasses.fields(schema)}
    return {k: v.value if isinstance(v, Enum) else v for k, v in values.items()}


@pytest.mark.parametrize("flags, overrides, schema", [
    (["--cfg", "job"], [], "CpuConfig"), (["--cfg", "job"], ["device=gpu"], "GpuConfig"), (["--help"], [], "CpuConfig"),
], ids=["cfg-job-cpu", "cfg-job-gpu", "help"])
def test_help_and_cfg_job_list_every_backend_key_with_its_default(tmp_path, cli_env, flags, overrides, schema):
    from csframework.backends import eager

    r = cli(*overrides, flags=flags, env=cli_env, cwd=tmp_path, tiny=False)
    assert r.returncode == 0, r.stderr
    text = r.stdout if flags != ["--help"] else r.stdout.split("Override anything in the config")[1].split("\n", 1)[1]
    shown = yaml.safe_load(text.split("== Backend settings of every device")[0].split("Powered by Hydra")[0])["backend"]
    # before: type, strategy and threads only (compile, compile_mode, timeout_s ... were accepted, never shown)
    assert shown == _schema_defaults(getattr(eager, schema))
    assert "float32_matmul_precision" in shown  # issue 50 item 6: it was GPU's alone, in neither
    if flags == ["--help"]:  # every device's settings, the others' too (issue 50 item 6)
        listed = dict(line.split(": ", 1) for line in r.stdout.split("== Backend settings of every device")[1]
                      .split("Powered by Hydra")[0].splitlines() if line.startswith("device="))
        assert "device_index" in listed["device=gpu"] and "threads" in listed["device=csx"].split(", ")


@pytest.mark.parametrize("argv", [["device=csx", "--help"], ["--help", "device=csx"],
                                  ["--config-dir", "conf", "model=tiny_linear", "--help"]],
                         ids=["overrides-then-help", "help-then-overrides", "config-dir"])
def test_help_shows_the_chosen_config_wherever_the_flag_stands(tmp_path, cli_env, argv):
    """``--help`` after the overrides (``device=csx --help``) was an argparse error: the footer csframework
    adds was appended after the flag, away from Hydra's one run of overrides."""
    (tmp_path / "conf").mkdir()
    r = cli(flags=argv, env=cli_env, cwd=tmp_path, tiny=False)
    assert r.returncode == 0, r.stderr
    assert "== Backend settings of every device" in r.stdout and "unrecognized arguments" not in r.stderr
    config = r.stdout.split("Override anything in the config")[1]
    shown = yaml.safe_load(config.split("\n", 1)[1].split("== Backend settings of every device")[0])
    assert shown["device"]["type"] == ("CSX" if "device=csx" in argv else "CPU")
    assert shown["model"]["_target_"].endswith("Supervised" if "model=tiny_linear" in argv else "TinyTransformer")


def test_check_mode_from_the_cli_trains_nothing(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    r = cli("mode=check", f"hydra.run.dir={run_dir}", env=cli_env)
    assert r.returncode == 0, r.stderr
    assert "check passed: device CPU, stages main" in r.stdout
    assert_nothing_written(run_dir)


def test_validate_mode_evaluates_a_trained_run_s_checkpoint(tmp_path, cli_env):
    trained = tmp_path / "trained"
    r = cli("loop.max_steps=6", "loop.eval_every=3", f"hydra.run.dir={trained}", env=cli_env)
    assert r.returncode == 0, r.stderr
    final = json.loads((trained / "summary.json").read_text())["metrics"]["val/loss"]

    run_dir = tmp_path / "validate"
    r = cli("mode=validate", f"checkpoint.resume={trained}", f"hydra.run.dir={run_dir}", env=cli_env)
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stderr and "val/loss=" in r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 6
    assert summary["metrics"]["val/loss"] == pytest.approx(final, rel=1e-6)  # the trained weights, evaluated
    assert not (run_dir / "checkpoints").exists()  # evaluating writes no checkpoint

    r = cli("mode=validate", f"hydra.run.dir={tmp_path / 'fresh'}", env=cli_env)  # nothing to restore
    assert r.returncode == 0 and "validating_initial_weights" in r.stderr and "checkpoint.resume=" in r.stderr


def test_multirun_runs_one_job_per_choice(tmp_path, cli_env):
    sweep = tmp_path / "sweep"
    r = cli("optimizer=sgd,adamw", "loop.max_steps=3", f"hydra.sweep.dir={sweep}", flags=["-m"], env=cli_env)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    for job, optimizer in zip(jobs, ["sgd", "adamw"]):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["global_step"] == 3
        assert yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optimizer"]["name"] == optimizer
    assert len((sweep / "sweep.csv").read_text().splitlines()) == 3


def test_a_single_run_is_composed_by_hydra_alone(tmp_path, cli_env):
    """A run goes the one way through Hydra (issue 51): ``@hydra.main`` composes it (its dispatch's look at
    ``hydra.mode``, then the run's; csframework composes nothing itself) and its task types it, with one
    plugin manager, the command line's, handed to the run; Hydra's record of the run is as Hydra writes it:
    mode RUN, the run directory and the overrides."""
    run_dir = tmp_path / "run"
    script = textwrap.dedent('''
        import sys
        from hydra._internal.hydra import Hydra
        composed, own = [], []
        compose_config = Hydra.compose_config
        def counting(self, *args, **kwargs):
            composed.append(kwargs.get("run_mode"))
            return compose_config(self, *args, **kwargs)
        Hydra.compose_config = counting
        from csframework import hydra_session, plugins
        compose = hydra_session._compose
        hydra_session._compose = lambda *args, **kwargs: own.append(args) or compose(*args, **kwargs)
        managers = []
        manager_init = plugins.CheckingManager.__init__
        def counted(self, *args, **kwargs):
            managers.append(self)
            manager_init(self, *args, **kwargs)
        plugins.CheckingManager.__init__ = counted
        from csframework.__main__ import main
        try:
            main()
        finally:
            print("compositions:", len(composed), "own:", len(own), "plugin managers:", len(managers))
    ''')
    argv = [*TINY, "loop.max_steps=2", f"hydra.run.dir={run_dir}", "+hydra.job.env_set.CSF_TEST_SEED=5",
            "seed=${oc.env:CSF_TEST_SEED}"]
    r = subprocess.run([sys.executable, "-c", script, *argv], env=cli_env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compositions: 2 own: 0 plugin managers: 1" in r.stdout, r.stdout
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    record = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert record["mode"] == "RUN" and record["run"]["dir"] == str(run_dir)
    assert record["runtime"]["output_dir"] == str(run_dir)
    assert record["overrides"]["task"] == [a for a in argv[2:] if not a.startswith(("hydra.", "+hydra."))]
    assert record["overrides"]["hydra"] == [f"hydra.run.dir={run_dir}", "+hydra.job.env_set.CSF_TEST_SEED=5",
                                            "hydra.mode=RUN"]
    # the run's config saw hydra.job.env_set, as its job does: the seed came from it
    assert yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["seed"] == "${oc.env:CSF_TEST_SEED}"
    assert yaml.safe_load((run_dir / "checkpoints" / "step-00000002" / "config.yaml").read_text())["seed"] == 5


# -- logging --------------------------------------------------------------------------------------------------------
def test_console_shows_each_event_once(tmp_path, cli_env):
    run_dir = tmp_path / "run"
    r = cli("loop.max_steps=6", "loop.log_every=2", "loop.eval_every=3", f"hydra.run.dir={run_dir}", env=cli_env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line.split(" ", 1)[-1] for line in r.stderr.splitlines() if line.strip()]  # drop the timestamp
    assert lines, "nothing on stderr"
    assert len(lines) == len(set(lines)), "a line appears twice:\n" + r.stderr
    assert sum("fit_start" in line for line in lines) == 1
    assert sum(" train " in f" {line} " for line in lines) == 3  # steps 2, 4, 6
    assert not list(run_dir.glob("*.log"))  # Hydra's job log is off: the run logs through structlog
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["event"] for e in events} >= {"fit_start", "metrics", "checkpoint_saved", "fit_end"}
    assert all({"run_id", "stage", "step"} <= set(e) for e in events)


def test_importing_and_running_configures_no_logging(tmp_path, cli_env):
    script = textwrap.dedent(f'''
        import logging, structlog
        root = logging.getLogger()
        before = (list(root.handlers), root.level, structlog.is_configured())
        import csframework as csf, fixtures
        assert (list(root.handlers), root.level, structlog.is_configured()) == before, "import"
        csf.Run(fixtures.compose("loop.max_steps=2"), output_dir={str(tmp_path / "run")!r}).fit()
        assert (list(root.handlers), root.level, structlog.is_configured()) == before, "run"
        assert not structlog.is_configured()
        print("ok")
    ''')
    r = subprocess.run([sys.executable, "-c", script], env=cli_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.slow
def test_test_and_predict_modes_use_a_trained_run_s_best_checkpoint(tmp_path, cli_env):
    trained = tmp_path / "trained"
    best = ["loop.max_steps=6", "loop.eval_every=2", "checkpoint.keep_best.monitor=val/loss",
            "checkpoint.keep_best.mode=max"]  # val/loss falls: under max the best is step 2's
    r = cli(*best, "+data.test._target_=fixtures.Blobs", "+data.test.n=24", f"hydra.run.dir={trained}", env=cli_env)
    assert r.returncode == 0, r.stderr
    fitted = json.loads((trained / "summary.json").read_text())
    assert fitted["tested_weights"] == "checkpoints/step-00000002" and "test/loss=" in r.stderr

    r = cli("mode=test", "+data.test._target_=fixtures.Blobs", "+data.test.n=24", f"checkpoint.resume={trained}",
            f"hydra.run.dir={tmp_path / 'test'}", env=cli_env)
    assert r.returncode == 0, r.stderr
    tested = json.loads((tmp_path / "test" / "summary.json").read_text())
    assert tested["mode"] == "test" and tested["global_step"] == 2
    assert tested["metrics"]["test/loss"] == pytest.approx(fitted["metrics"]["test/loss"], rel=1e-6)

    r = cli("mode=predict", "+data.predict._target_=fixtures.Blobs", "+data.predict.n=5",
            f"checkpoint.resume={trained}", f"hydra.run.dir={tmp_path / 'predict'}", env=cli_env)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (tmp_path / "predict" / "predictions.jsonl").read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(5)) and all(0 <= row["preds"] < 4 for row in rows)


def test_a_refused_resume_leaves_the_run_directories_as_they_were(tmp_path, cli_env):
    """Exit 2 writes nothing: Hydra had rewritten an existing run directory's .hydra/ (the record of how its
    run was trained) before the refusal, and a run directory created for a refused run was left holding its
    lock, .hydra/ and events.jsonl, which then refused a fresh run there ("holds a run")."""
    trained = tmp_path / "trained"
    assert cli("loop.max_steps=2", "loop.eval_every=null", f"hydra.run.dir={trained}", env=cli_env).returncode == 0
    (trained / "checkpoints" / "step-00000002" / "state.pt").write_bytes(b"")  # damaged: every resume refused
    hydra = {p.name: p.read_bytes() for p in (trained / ".hydra").iterdir()}
    r = cli("loop.max_steps=4", "optimizer.lr=0.5", "checkpoint.resume=auto", f"hydra.run.dir={trained}", env=cli_env)
    assert r.returncode == 2 and "could read none" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in (trained / ".hydra").iterdir()} == hydra
    fresh = tmp_path / "new" / "run"
    r = cli("loop.max_steps=4", f"checkpoint.resume={trained}", f"hydra.run.dir={fresh}", env=cli_env)
    assert r.returncode == 2 and "could read none" in r.stderr and "start_over" not in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()
