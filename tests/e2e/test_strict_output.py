"""Strict output (issue 27, item 5): what csframework writes is readable by strict readers and cannot forge
anything. ``summary.json`` and ``events.jsonl`` parse with a JSON parser that refuses bare ``NaN`` and
``Infinity`` and hold no object reprs, after a run whose loss went NaN and after a plugin reported NaN and
infinite metrics; ``sweep.csv`` cells a spreadsheet would evaluate as a formula (``=``, ``+``, ``-``,
``@``) are neutralised; control characters in a metric name or a lock record never reach the console raw.
"""
from __future__ import annotations

import csv
import fcntl
import json
import re
import socket
from pathlib import Path

import pytest

import csframework as csf
import fixtures
import hostile
from fixtures import CONF
from hostile import Hostile, strict_json

#: Characters that would end, move or restyle a console line if printed raw (what ``errors.printable``
#: escapes): C0 controls but the line's own newline, DEL, C1 controls, bidirectional overrides.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def assert_strict_run_files(run_dir: Path) -> dict:
    """``summary.json`` and every line of ``events.jsonl`` are strict JSON without object reprs; returns
    the summary."""
    text = (run_dir / "summary.json").read_text(encoding="utf-8")
    summary = strict_json(text)
    assert " object at 0x" not in text, text
    lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines
    for line in lines:
        strict_json(line)
        assert " object at 0x" not in line, line
    return summary


def _fit(run_dir: Path, *overrides: str, plugins=()):
    try:
        return csf.Run(fixtures.compose(*overrides), output_dir=run_dir, plugins=list(plugins)).fit(), None
    except (csf.CsfError, ValueError, TypeError) as e:  # the run may refuse a value; it must say which
        return None, e


def test_a_run_whose_loss_goes_nan_writes_strict_json(tmp_path):
    summary, error = _fit(tmp_path, "loop.max_steps=5", "loop.log_every=1", "checkpoint.every_steps=1",
                          plugins=[fixtures.PoisonAt(3)])
    assert isinstance(error, csf.NonFiniteLossError), error
    written = assert_strict_run_files(tmp_path)
    assert written["status"] == "failed" and written["global_step"] == 3


def test_nan_and_infinite_metrics_from_a_plugin_are_written_as_strict_json(tmp_path):
    summary, error = _fit(tmp_path, "loop.max_steps=3", "loop.log_every=1", plugins=[hostile.OddMetrics()])
    written = assert_strict_run_files(tmp_path)
    if error is None:
        assert written["status"] == "completed"
        assert {"odd/nan", "odd/inf", "odd/ninf"} <= set(written["metrics"])  # written somehow, not dropped
    else:  # refused: named
        assert "odd/" in str(error), error


def test_values_json_cannot_hold_in_the_summary_are_named_not_reprd(tmp_path):
    summary, error = _fit(tmp_path, "loop.max_steps=2", plugins=[hostile.OddSummary()])
    if (tmp_path / "summary.json").exists():
        assert_strict_run_files(tmp_path)
    if error is not None:
        assert "odd_extra" in str(error), error
        # the plugin that put it there is blamed (issue 37: it was plugin 'metrics', which writes the file)
        assert "plugin 'odd_summary'" in str(error) and "plugin 'metrics'" not in str(error), error
    else:  # accepted: then an object cannot have been written as its repr (checked above), so it was refused
        pytest.fail("a summary value JSON cannot hold (object()) was accepted without an error naming it")


@pytest.mark.slow
def test_control_characters_in_a_metric_name_do_not_reach_the_console(tmp_path, cli_env):
    h = Hostile(tmp_path)
    run = tmp_path / "run"
    out = h.cli(["--config-dir", CONF, *fixtures.TINY, "loop.max_steps=2", "loop.log_every=1",
                 "plugins.enable=[hostile:OddMetrics]", f"hydra.run.dir={run}"], cli_env)
    hostile.assert_bounded(out)
    console = out.stdout + out.stderr
    assert "evil" in console, str(out)  # the metric was reported: its name shown, escaped
    assert not RAW_CONTROL.findall(console), f"raw control characters on the console: " \
                                             f"{sorted(set(RAW_CONTROL.findall(console)))!r}"
    assert not [line for line in console.splitlines() if line.startswith("csframework: error: FORGED")], str(out)
    assert_strict_run_files(run)


@pytest.mark.slow
def test_control_characters_in_a_lock_record_do_not_reach_the_console(tmp_path, cli_env):
    """A run directory in use: the refusal names the holder from its lock record, which anyone could have
    written; its control characters are escaped, so it is one line and forges none."""
    h = Hostile(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".csframework.lock"
    record = {"pid": 1, "host": "evil\x1b[2J\r\ncsframework: error: FORGED LINE\x07", "started": "\x1b]0;title\x07"}
    with open(lock, "w") as f:
        f.write(json.dumps(record, ensure_ascii=False))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = h.cli(["--config-dir", CONF, *fixtures.TINY, "loop.max_steps=2", f"hydra.run.dir={run}"], cli_env)
    hostile.assert_bounded(out)
    assert out.returncode == 2, str(out)
    lines = hostile.error_lines(out.stderr)
    assert len(lines) == 1 and "is in use by another csframework run" in lines[0], str(out)
    console = out.stdout + out.stderr
    assert not RAW_CONTROL.findall(console), f"raw control characters on the console: {console!r}"
    assert not [line for line in console.splitlines() if line.startswith("csframework: error: FORGED")], str(out)
    assert socket.gethostname()  # (the record's host is forged; the real one is not asserted on)


# unquoted, so the override reaches the table as it is (a quoted value keeps its quotes, which are inert);
# a leading "=" cannot be given unquoted, so it comes as a metric name (hostile.FORMULA_METRIC)
FORMULAS = ["+cmd", "-2+3", "@SUM"]


@pytest.mark.slow
def test_sweep_csv_neutralises_cells_a_spreadsheet_would_evaluate(tmp_path, cli_env):
    h = Hostile(tmp_path)
    sweep = tmp_path / "sweep"
    values = ",".join(FORMULAS)
    out = h.cli(["-m", "--config-dir", CONF, *[o for o in fixtures.TINY if not o.startswith("loop.max_steps")],
                 "loop.max_steps=1", "plugins.enable=[hostile:Note]", f"note.text={values}",
                 f"hydra.sweep.dir={sweep}"], cli_env, timeout=hostile.SWEEP_TIMEOUT)
    hostile.assert_bounded(out)
    assert out.returncode == 0, str(out)
    with open(sweep / "sweep.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(FORMULAS)
    assert any(hostile.FORMULA_METRIC in header for header in rows[0]), list(rows[0])  # the metric is there
    for row, value in zip(rows, FORMULAS):
        assert value in row["note.text"], row  # still there to read, but inert
    for row in rows:
        for key, cell in [*row.items(), *((k, k) for k in row)]:  # every cell and every header
            if cell[:1] in ("=", "+", "-", "@", "\t", "\r"):
                try:
                    float(cell)  # a plain number (a negative loss) is data, not a formula
                except ValueError:
                    pytest.fail(f"sweep.csv cell {cell!r} (column {key!r}) would be evaluated as a formula")
    rows_json = strict_json((sweep / "sweep.json").read_text())
    assert all(v in r["note.text"] for r, v in zip(rows_json, FORMULAS))  # JSON needs no neutralising
