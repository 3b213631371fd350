"""``csframework.config.user_files`` and composition's interpolation errors.

Hostile config text: interpolation cycles, unset environment variables, unknown or failing resolvers
are one error naming the key; a user's YAML file that expands beyond a sane size (an alias bomb) is refused
in moments naming the file, through ``compose(config_dir=...)``, ``hydra.searchpath`` and the CLI."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import csframework as csf
from csframework.config import MAX_CONFIG_BYTES, MAX_CONFIG_NODES
from csframework.errors import ConfigError
import fixtures
from fixtures import CONF, TINY, compose
from forkrun import run_chains

UNSET = "CSF_TEST_SURELY_UNSET_VARIABLE"


class Hung(BaseException):
    """Raised by ``deadline``; not an ``Exception``, so no ``except Exception`` on the way can swallow it."""


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging the suite if the code under test never returns."""
    def expired(*_):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("overrides, key, says", [
    (["loop.max_steps=${loop.max_epochs}", "loop.max_epochs=${loop.max_steps}"], "loop.max_steps", "cycle"),
    (["data.train.n=${data.train.n}"], "data.train.n", "cycle"),
    ([f"loop.max_steps=${{oc.env:{UNSET}}}"], "loop.max_steps", UNSET),
    (["loop.max_steps=${nosuch:1}"], "loop.max_steps", "nosuch"),
    (["loop.max_steps=${oc.decode:'[1'}"], "loop.max_steps", "BRACKET"),
    (["loop.max_steps=${oc.decode:abc}"], "loop.max_steps", "abc"),
    (["loop.max_steps=${loop.nowhere}"], "loop.max_steps", "loop.nowhere"),
    (["+stages={a:{loop:{max_steps:'${nosuch:1}'}}}"], "stages.a.loop.max_steps", "nosuch"),
    ([f"hydra.run.dir=${{oc.env:{UNSET}}}"], "hydra.run.dir", UNSET),
], ids=["cycle", "self-reference", "unset-env", "unknown-resolver", "resolver-parse-error", "resolver-type-error",
        "missing-key", "in-a-stage", "hydra-run-dir"])
def test_interpolation_errors_name_the_key(overrides, key, says, monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    with pytest.raises(ConfigError) as caught:
        compose(*overrides)
    message = str(caught.value)
    assert message.startswith(f"{key}: ") and says in message and "\n" not in message, message


def test_a_run_directory_made_of_hydra_resolvers_still_composes():
    """``hydra.run.dir`` is resolved at compose time as Hydra resolves it in a run: ``${hydra:...}`` works."""
    assert compose("hydra.run.dir=outputs/${hydra:job.name}/${now:%Y}/${hydra.job.override_dirname}").seed == 0


def test_an_interpolation_in_a_user_file_names_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    conf = _user_conf(tmp_path, "data/envsized.yaml", f"defaults:\n  - blobs\n  - _self_\nbatch_size: ${{oc.env:{UNSET}}}\n")
    with pytest.raises(ConfigError, match=rf"^data\.batch_size: .*{UNSET}"):
        csf.compose(TINY + ["data=envsized"], config_dir=conf)


def _user_conf(tmp_path: Path, name: str, text: str | bytes) -> str:
    """A copy of the test config directory with ``text`` (or those bytes) in the file ``name``."""
    conf = tmp_path / "conf"
    if not conf.exists():
        shutil.copytree(CONF, conf)
    (conf / name).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        (conf / name).write_bytes(text)
    else:
        (conf / name).write_text(text)
    return str(conf)


def billion_laughs(levels: int = 9) -> str:
    """A few hundred bytes of YAML that expand to 9**levels strings."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE_FILES = {
    "alias-bomb": (billion_laughs(), "alias"),
    "recursive-alias": ("a: &a [1, *a]\n", "alias"),
    "deeply-nested": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested"),  # beyond libyaml's own limit
    "nested-past-the-limit": ("a: " + "[" * 150 + "]" * 150 + "\n", "nested"),  # within it
    "oversized": ("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1) + "batch_size: 4\n", "bytes"),
    "not-utf-8": ("batch_size: 4\n# caf\xe9\n".encode("latin-1"), "not UTF-8"),  # was a message naming no file
}


@pytest.mark.parametrize("case", HOSTILE_FILES)
def test_a_hostile_user_file_is_refused_naming_it(case, tmp_path):
    text, says = HOSTILE_FILES[case]
    conf = _user_conf(tmp_path, "data/hostile.yaml", text)
    with deadline(60), pytest.raises(ConfigError) as caught:
        csf.compose(TINY + ["data=hostile"], config_dir=conf)
    assert str(caught.value).startswith(f"{conf}/data/hostile.yaml: ") and says in str(caught.value)


@pytest.mark.parametrize("kind", ["dangling-link", "fifo", "unreadable"])
def test_a_config_file_that_cannot_be_read_is_one_error_naming_it(kind, tmp_path):
    """A link to nothing, a FIFO (whose read would block forever) or a file without read permission in the
    config directory is refused naming it, not a traceback or a hang."""
    conf = Path(_user_conf(tmp_path, "data/ok.yaml", "batch_size: 4\n"))
    path = conf / "model" / "odd.yaml"
    path.parent.mkdir(exist_ok=True)
    if kind == "dangling-link":
        path.symlink_to(tmp_path / "nowhere.yaml")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("x: 1\n")
        path.chmod(0)
        if os.access(path, os.R_OK):  # root reads it anyway
            pytest.skip("running as root: a file without read permission is still readable")
    with deadline(60), pytest.raises(ConfigError) as caught:
        csf.compose(TINY, config_dir=conf)
    assert str(caught.value).startswith(f"{path}: "), caught.value
    assert "remove" in str(caught.value)


def test_an_alias_bomb_on_the_search_path_is_refused(tmp_path):
    conf = _user_conf(tmp_path, "data/bomb.yaml", billion_laughs())
    with deadline(60), pytest.raises(ConfigError, match=r"data/bomb\.yaml: .*alias"):
        csf.compose([o for o in TINY if not o.startswith("data=")] + ["data=bomb", f"hydra.searchpath=[file://{conf}]"])


def test_an_alias_bomb_is_refused_even_in_an_option_the_run_does_not_choose(tmp_path):
    """Every YAML file of a user config directory is checked, so a bomb cannot wait for its option."""
    conf = _user_conf(tmp_path, "model/bomb.yaml", billion_laughs())
    with pytest.raises(ConfigError, match=r"model/bomb\.yaml: "):
        csf.compose(TINY, config_dir=conf)


def test_aliases_within_the_limit_still_work(tmp_path):
    """Anchors and aliases are ordinary YAML: a file that shares a value, and one that expands to fewer
    than ``MAX_CONFIG_NODES`` nodes, compose."""
    shared = ("train:\n  _target_: fixtures.Blobs\n  n: &n 128\nval:\n  _target_: fixtures.Blobs\n  n: *n\n"
              "batch_size: 16\n")
    conf = _user_conf(tmp_path, "data/shared.yaml", shared)
    levels = max(n for n in range(1, 10) if 9 ** (n + 1) < MAX_CONFIG_NODES)  # about a tenth of the limit
    _user_conf(tmp_path, "unused/big.yaml", billion_laughs(levels))
    assert csf.compose(TINY + ["data=shared"], config_dir=conf).data.val["n"] == 128


@pytest.mark.slow
@pytest.mark.parametrize("multirun", [False, True], ids=["run", "multirun"])
def test_cli_refuses_an_alias_bomb_in_the_config_dir_within_seconds(multirun, tmp_path, cli_env):
    conf = _user_conf(tmp_path, "data/bomb.yaml", billion_laughs())
    argv = [sys.executable, "-m", "csframework", *(["-m"] if multirun else []), "--config-dir", conf,
            "model=blobs_mlp", "data=bomb", "loop.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    done = subprocess.run(argv, env=cli_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"csframework: error: {conf}/data/bomb.yaml: its YAML aliases expand it to "
                                   f"more than {MAX_CONFIG_NODES:,} nodes (an alias bomb?); a config file must "
                                   "stay below that")
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_cli_interpolation_errors_exit_2_naming_the_key(tmp_path):
    env = dict(os.environ, PYTHONPATH=fixtures.pythonpath())
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop(UNSET, None)
    cases = [(["loop.max_steps=${loop.max_epochs}", "loop.max_epochs=${loop.max_steps}"], "loop.max_steps"),
             ([f"loop.max_steps=${{oc.env:{UNSET}}}"], "loop.max_steps"),
             (["loop.max_steps=${nosuch:1}"], "loop.max_steps"),
             ([f"hydra.run.dir=${{oc.env:{UNSET}}}"], "hydra.run.dir")]
    chains = [[{"argv": ["--config-dir", CONF, "model=blobs_mlp", "data=blobs", *extra]
                + ([] if extra[0].startswith("hydra.run.dir") else [f"hydra.run.dir={tmp_path / str(i)}"])}]
              for i, (extra, _) in enumerate(cases)]
    for (extra, key), [result] in zip(cases, run_chains(chains, env)):
        stderr = result["stderr"]
        assert result["returncode"] == 2 and "Traceback" not in stderr, (extra, stderr)
        assert stderr.startswith(f"csframework: error: {key}: ") and len(stderr.strip().splitlines()) == 1, \
            (extra, stderr)
    assert not list(tmp_path.iterdir())
