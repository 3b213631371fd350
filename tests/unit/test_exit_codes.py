"""``csf.ExitCode`` (issue 51 item 6): every exit status csframework decides is a member of one enum, no
instance has its class's status overwritten from outside, and docs/reference/cli.md lists the members."""
import ast
import re
import signal
from pathlib import Path

import pytest

import csframework as csf
from csframework.errors import ConfigError, ExitCode, PluginError, PluginImportError
from csframework.plugins import load_module_path
from csframework.signals import Interrupted, exit_status
from csframework.sweep.job import exit_status_of
from csframework.sweep.marks import INTERRUPTED, reset_stop

PACKAGE = Path(csf.__file__).parent
CLI_REFERENCE = PACKAGE.parent / "docs" / "reference" / "cli.md"
_EXITS = {("sys", "exit"), ("os", "_exit")}


def bare_exit_statuses(source: str) -> list[str]:
    """Where ``source`` decides an exit status without ``ExitCode``: ``sys.exit``/``os._exit`` of a number,
    ``exit_code = <number>``, ``return <number>`` in a function that returns an ``ExitCode``, and any
    ``<object>.exit_code = ...`` other than ``self``'s (an instance's status overwritten from outside)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in _EXITS \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.append(f"line {node.lineno}: {node.func.value.id}.{node.func.attr}({node.args[0].value!r})")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                name = target.id if isinstance(target, ast.Name) else \
                    target.attr if isinstance(target, ast.Attribute) else None
                if name != "exit_code":
                    continue
                if isinstance(node.value, ast.Constant):
                    found.append(f"line {node.lineno}: exit_code = {node.value.value!r}")
                elif isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                                and target.value.id == "self"):
                    found.append(f"line {node.lineno}: {ast.unparse(target)} overwritten")
        elif isinstance(node, ast.FunctionDef) and node.returns is not None and "ExitCode" in ast.unparse(node.returns):
            found += [f"line {r.lineno}: return {r.value.value!r}" for r in ast.walk(node)
                      if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)]
    return sorted(found, key=lambda where: int(where.split(":")[0].removeprefix("line ")))


def test_no_exit_status_is_a_bare_number_or_overwritten():
    found = {str(path.relative_to(PACKAGE)): bare for path in sorted(PACKAGE.rglob("*.py"))
             if (bare := bare_exit_statuses(path.read_text()))}
    assert found == {}, f"use csframework.errors.ExitCode (a constructor argument, or a subclass): {found}"


def test_the_checker_finds_each_kind_of_bare_status():
    source = ("import os, sys\n"
              "class E(Exception):\n    exit_code = 2\n"
              "def f(e) -> ExitCode:\n    e.exit_code = ExitCode.OK\n    sys.exit(2)\n    os._exit(0)\n    return 1\n"
              "class F(Exception):\n    def __init__(self, code):\n        self.exit_code = code\n")
    assert bare_exit_statuses(source) == ["line 3: exit_code = 2", "line 5: e.exit_code overwritten",
                                          "line 6: sys.exit(2)", "line 7: os._exit(0)", "line 8: return 1"]


def documented_codes() -> list[tuple[int, str]]:
    """The ``| status | `NAME` | meaning |`` rows of the CLI reference's exit status table."""
    section = CLI_REFERENCE.read_text().split("## Exit status", 1)[1].split("\n## ", 1)[0]
    return [(int(status), name) for status, name in re.findall(r"^\| (\d+) \| `(\w+)` \|", section, re.M)]


def test_the_cli_reference_lists_every_exit_code_in_order():
    assert documented_codes() == [(code.value, code.name) for code in ExitCode]


def test_the_enum_is_public_and_its_codes_are_the_clis():
    assert csf.ExitCode is ExitCode and "ExitCode" in csf.__all__
    assert [int(c) for c in ExitCode] == [0, 1, 2, 128 + signal.SIGINT, 128 + signal.SIGTERM]


def test_each_error_carries_its_class_code_or_the_one_it_was_given():
    assert csf.CsfError("x").exit_code is ExitCode.FAILED
    assert ConfigError("x").exit_code is ExitCode.CONFIG_ERROR
    assert PluginError("p", "on_fit_start", ConfigError("bad key")).exit_code is ExitCode.CONFIG_ERROR
    assert PluginError("p", "on_fit_start", RuntimeError("boom")).exit_code is ExitCode.FAILED
    assert PluginError("p", None, RuntimeError("boom"), ExitCode.CONFIG_ERROR).exit_code is ExitCode.CONFIG_ERROR
    assert PluginImportError("p", "entry point p", ImportError("x"), "fix").exit_code is ExitCode.FAILED
    assert PluginError.exit_code is ExitCode.FAILED  # the class's own code is never changed by an instance


def test_a_plugins_enable_module_that_does_not_load_is_a_config_error():
    with pytest.raises(PluginImportError) as info:
        load_module_path("csframework_no_such_module_h51")
    assert info.value.exit_code is ExitCode.CONFIG_ERROR


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, ExitCode.INTERRUPTED),
                                              (signal.SIGTERM, ExitCode.TERMINATED), (None, ExitCode.INTERRUPTED)])
def test_a_stop_signal_has_its_exit_code(signum, code):
    assert exit_status(signum) is code
    if signum is not None:
        assert Interrupted(signum, step=3).exit_code is code


def test_a_sweeps_exit_code(tmp_path):
    reset_stop()
    completed, failed = {"status": "completed"}, {"status": "failed"}
    assert exit_status_of(tmp_path, [completed, completed]) is ExitCode.OK
    assert exit_status_of(tmp_path, [completed, failed]) is ExitCode.FAILED
    (tmp_path / INTERRUPTED).write_text(str(int(signal.SIGTERM)))
    assert exit_status_of(tmp_path, [completed, failed]) is ExitCode.TERMINATED
    (tmp_path / INTERRUPTED).write_text("9")  # not a stop signal (the file is untrusted): a stop all the same
    assert exit_status_of(tmp_path, [completed]) is ExitCode.INTERRUPTED
