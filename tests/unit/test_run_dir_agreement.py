"""What a run writes it can read back (issue 27 item 2), a plugin's forked child never finishes the run,
and a ``keep_best.monitor`` nothing reports is said at the first evaluation."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

import csframework as csf
from csframework.builtin.checkpoint import MAX_CONFIG_BYTES, list_checkpoints

import fixtures


@dataclasses.dataclass
class BigConfig:
    """A plugin section whose default is larger than a checkpoint's config.yaml may be."""

    blob: str = "x" * (MAX_CONFIG_BYTES + 10)


class BigSection:
    name = "big"

    @csf.hookimpl
    def csframework_config_sections(self):
        return {"big": BigConfig}


def test_a_config_too_large_to_resume_from_is_refused_before_training(tmp_path):
    config = csf.compose(fixtures.TINY + ["checkpoint.every_steps=2"], config_dir=fixtures.CONF,
                         plugins=[BigSection()])
    with pytest.raises(csf.CsfError) as info:
        csf.Run(config, plugins=[BigSection()], output_dir=tmp_path).fit()
    assert info.value.exit_code == 2
    assert f"big: the run's config is" in str(info.value) and f"more than the {MAX_CONFIG_BYTES} bytes" in str(info.value)
    assert not (tmp_path / "checkpoints").exists()  # nothing trained, no checkpoint no one could read


def test_a_plugins_forked_child_does_not_run_the_runs_failure_or_completion_paths(tmp_path):
    class Forker:
        name = "forker"

        @csf.hookimpl
        def on_train_batch_end(self, run):
            if run.global_step == 2 and os.fork() == 0:
                raise SystemExit(0)  # the child comes back into the run instead of calling os._exit

    summary = csf.Run(fixtures.compose("loop.max_steps=4"), plugins=[Forker()], output_dir=tmp_path).fit()
    os.waitpid(-1, 0)  # the child has ended (it exits at once) before summary.json is read
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == on_disk["status"] == "completed" and on_disk["global_step"] == 4
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert "fit_failed" not in events and events.count("fit_end") == 1


def test_a_keep_best_monitor_no_evaluation_reports_is_said_at_the_first_evaluation(tmp_path):
    csf.Run(fixtures.compose("loop.max_steps=4", "loop.eval_every=2", "loop.eval_steps=2",
                             "checkpoint.every_steps=2", "checkpoint.keep_best.monitor=val/los"),
            output_dir=tmp_path).fit()
    warnings = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
                if '"keep_best_monitor_not_reported"' in line]
    assert len(warnings) == 1 and warnings[0]["monitor"] == "val/los" and "val/loss" in warnings[0]["reported"]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000002", "step-00000004"]
