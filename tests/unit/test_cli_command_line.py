"""What the CLI reads of the command line before Hydra's ``@hydra.main`` parses it (issue 51: Hydra's own
dispatch chooses run, sweep, help, ``--cfg``, ``--info``): the user's config directories, to check their
files before Hydra reads them, ``--help`` and the overrides; Hydra's other flags pass untouched."""
import pytest

from csframework.__main__ import command_line


@pytest.mark.parametrize("argv, config_dir, config_name, helping, overrides", [
    (["seed=1", "~model.loss"], None, None, False, ["seed=1", "~model.loss"]),
    (["-c", "job", "--config-dir", "/conf", "seed=1"], "/conf", None, False, ["seed=1"]),
    (["-cd", "/conf", "-cn", "mine", "-m", "optimizer=sgd,adamw"], "/conf", "mine", False, ["optimizer=sgd,adamw"]),
    (["--config-dir=/conf", "--config-name=mine", "--info", "defaults"], "/conf", "mine", False, []),
    (["--help", "device=csx"], None, None, True, ["device=csx"]),
    (["-h"], None, None, True, []),
])
def test_the_config_directory_name_help_and_overrides_are_read(argv, config_dir, config_name, helping, overrides):
    args = command_line(argv)
    assert (args.config_dir, args.config_name, args.help, args.overrides) == (config_dir, config_name, helping,
                                                                               overrides)


def test_only_an_absolute_config_path_is_the_users():
    assert command_line(["--config-path", "/abs/conf"]).config_path == "/abs/conf"
    assert command_line(["-cp", "conf"]).config_path is None  # relative to Hydra's calling module: csframework's
