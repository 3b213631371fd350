"""Running again into a run directory, as a user does after a first run (issue 39 items 2 to 4):

- a fresh run in a directory that holds a run is refused (exit 2) naming the directory and the ways on,
  and nothing there changes; ``checkpoint.start_over=true`` moves the old run aside first, so two runs' rows
  never mix in one ``metrics.csv``;
- a run that ``request_stop`` ended (early stopping) is complete: ``resume=auto`` says so and trains
  nothing, unless the stop condition's settings changed;
- the interrupt hint is the whole command that continues the run, and running it as printed continues it,
  also from the default dated directory; ``resume=auto`` where there is nothing to resume is a warning
  naming the directory.

The user's plugins live in the directory the CLI runs from, as in a user's project."""
from __future__ import annotations

import csv
import json
import os
import shlex

import pytest

import fixtures
from doc_blocks import ROOT
from forkrun import run_chains

MODULES = {
    "stopper.py": """\
        from dataclasses import dataclass

        import csframework as csf


        @dataclass
        class StopperConfig:
            step: int = 0
            \"\"\"The step after which the run asks to stop.\"\"\"


        class Stopper:
            name = "stopper"

            @csf.hookimpl
            def csframework_config_sections(self):
                return {"stopper": StopperConfig}

            @csf.hookimpl
            def on_train_step_end(self, run, step):
                if step == run.config.stopper.step:
                    run.request_stop(f"stopper: step {step} reached")
        """,
    "sigterm.py": """\
        import os
        import signal

        from csframework import hookimpl


        @hookimpl
        def on_train_step_end(run, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        """,
}
TINY = ["model=blobs_mlp", "data=blobs", "loop.max_steps=4", "loop.eval_every=null", "checkpoint.every_steps=2",
        "optimizer=sgd"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return fixtures.user_project(tmp_path_factory, MODULES)


def cli(project, *chains: list[list[str]]) -> list[list[dict]]:
    """Each chain's command lines, one after the other (chains side by side), from the project directory."""
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath(str(project)))
    return run_chains([[{"argv": ["--config-dir", str(project / "conf"), *TINY, *argv]} for argv in chain]
                       for chain in chains], env, cwd=str(project))


def rows(run_dir) -> list[tuple[int, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [(int(r["step"]), r["name"]) for r in csv.DictReader(f)]


def refusal(run_dir, command: str) -> str:
    """The line that refuses a fresh run of ``command`` in ``run_dir``, which holds a run."""
    return (f"csframework: error: run directory {run_dir} holds a run (checkpoints, summary.json, metrics.csv, "
            f"events.jsonl); continue it with: {command} checkpoint.resume=auto hydra.run.dir={run_dir}, or start a new run in "
            "another directory (hydra.run.dir=...), or here with checkpoint.start_over=true (the old run's files "
            "are moved into previous-runs/ there)")


def test_the_docs_show_the_refusal_a_user_sees():
    """docs/durability.md shows the line as the CLI prints it."""
    page = (ROOT / "docs" / "durability.md").read_text()
    assert refusal("/home/me/runs/a", "python -m csframework optimizer=sgd") in page.splitlines()


def errors(result: dict) -> list[str]:
    return [line for line in result["stderr"].splitlines() if line.startswith("csframework: error:")]


@pytest.mark.slow
def test_a_fresh_run_never_starts_over_a_run_directory_that_holds_a_run(project):
    run_dir = project / "runs" / "rerun"
    at = f"hydra.run.dir={run_dir}"
    first, again, over = cli(project, [[at], [at], [at, "checkpoint.start_over=true"]])[0]
    assert first["returncode"] == 0, first["stderr"][-3000:]
    # the same command again: refused, naming the directory and both ways on; nothing changed there
    assert again["returncode"] == 2, again["stderr"][-3000:]
    assert errors(again) == [refusal(run_dir, f"csframework --config-dir {project / 'conf'} {' '.join(TINY)}")]
    assert "Traceback" not in again["stderr"]
    # start_over: the first run's files are in previous-runs/<time>/, the new run's rows alone in metrics.csv
    assert over["returncode"] == 0, over["stderr"][-3000:]
    [previous] = (run_dir / "previous-runs").iterdir()
    assert json.loads((previous / "summary.json").read_text())["run_id"] != \
        json.loads((run_dir / "summary.json").read_text())["run_id"]
    assert sorted(p.name for p in (previous / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-00000002", "step-00000004"]
    for metrics in (rows(previous), rows(run_dir)):
        assert len(metrics) == len(set(metrics)), metrics  # one row per step and metric: one run's
    assert rows(previous) == rows(run_dir)


@pytest.mark.slow
def test_an_early_stopped_run_is_complete_unless_its_stop_settings_change(project):
    run_dir = project / "runs" / "stopped"
    argv = ["plugins.enable=[stopper:Stopper]", "stopper.step=3", "loop.max_steps=10", f"hydra.run.dir={run_dir}"]
    first, again, changed = cli(project, [argv, [*argv, "checkpoint.resume=auto"],
                                          [*argv[:-3], "stopper.step=6", "loop.max_steps=10", argv[-1],
                                           "checkpoint.resume=auto"]])[0]
    assert first["returncode"] == 0, first["stderr"][-3000:]
    assert again["returncode"] == 0, again["stderr"][-3000:]
    assert "csframework: already complete at step 3 (stopped early: stopper: step 3 reached); nothing to do" \
        in again["stdout"], again["stdout"][-3000:]
    # the rerun trained nothing: no row after step 3 (before the change of settings)
    assert changed["returncode"] == 0, changed["stderr"][-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["stop_reason"] == "stopper: step 6 reached", summary
    logged = [step for step, name in rows(run_dir) if name == "train/loss"]
    # loop.log_every=2 and each end: had the "already complete" rerun trained, it would have gone on to step 10
    assert logged == [2, 3, 4, 6], logged


@pytest.mark.slow
def test_the_interrupt_hint_is_the_whole_command_and_continues_the_run_from_a_dated_directory(project):
    [[stopped, fresh_auto]] = cli(project, [["plugins.enable=[sigterm]", "optimizer.lr=0.05"],
                                            ["checkpoint.resume=auto", "hydra.run.dir=runs/empty"]])
    assert stopped["returncode"] == 143, stopped["stderr"][-3000:]
    [hint] = [line for line in stopped["stderr"].splitlines() if line.startswith("csframework: interrupted:")]
    said, command = hint.split("; continue with: ")
    assert said == "csframework: interrupted: stopped by SIGTERM after step 3"  # signals act at the next step's end
    argv = shlex.split(command)
    run_dir = project / "outputs"
    [dated] = [p for p in run_dir.glob("*/*") if (p / "checkpoints").is_dir()]
    assert argv == ["csframework", "--config-dir", str(project / "conf"), *TINY, "plugins.enable=[sigterm]",
                    "optimizer.lr=0.05", "checkpoint.resume=auto", f"hydra.run.dir={dated}"]
    # run as printed (the plugin signals at step 2 only): the run goes on from step 3 to its end
    [[resumed]] = run_chains([[{"argv": argv[1:]}]], dict(os.environ, PYTHONPATH=fixtures.pythonpath(str(project))),
                             cwd=str(project))
    assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
    events = [json.loads(line) for line in (dated / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [3]
    assert json.loads((dated / "summary.json").read_text())["global_step"] == 4
    # resume=auto in a directory without checkpoints: a warning naming it
    assert fresh_auto["returncode"] == 0, fresh_auto["stderr"][-3000:]
    [warning] = [line for line in fresh_auto["stderr"].splitlines() if "nothing_to_resume" in line]
    assert "WARNING" in warning and f"found no checkpoint in run directory {project / 'runs' / 'empty'}" in warning
