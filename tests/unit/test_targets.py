"""``csframework.targets``: every ``_target_`` the framework builds from the config (model, datasets,
``collate_fn``, optimizer, schedule) fails in one line naming its key and the cause, in the user's file and
line where there is one; and ``--config-name`` / ``config_name`` that is not there gets "did you mean"."""
import sys
import textwrap

import pytest

import csframework as csf
import fixtures
from csframework import targets

USER_MODULE = """\
    import torch


    class Optimizer(torch.optim.SGD):
        def __init__(self, params, lr=0.1):
            raise RuntimeError("no such learning")


    class Schedule(torch.optim.lr_scheduler.LambdaLR):
        def __init__(self, optimizer):
            super().__init__(optimizer, lambda step: 1.0 / step)  # step 0: ZeroDivisionError
    """


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "csf_user_targets.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the file is named relative to the working directory
    yield "csf_user_targets"
    sys.modules.pop("csf_user_targets", None)  # the next test's is another file


@pytest.mark.parametrize("overrides, message", [
    (["optimizer._target_=csf_user_targets.Optimizer"],
     "optimizer: csf_user_targets.Optimizer(...) raised RuntimeError: no such learning (csf_user_targets.py:6); "
     "run with debug=true for the traceback"),
    (["optimizer.schedule._target_=csf_user_targets.Schedule"],
     "optimizer.schedule: csf_user_targets.Schedule(...) raised ZeroDivisionError: float division by zero "
     "(csf_user_targets.py:11); run with debug=true for the traceback"),
    (["+data.collate_fn._target_=csf_user_target.collate"],
     "data.collate_fn._target_: csf_user_target.collate: no module named 'csf_user_target' (did you mean "
     "'csf_user_targets'?); check the dotted path"),
    (["data.val._target_=fixtures.Blobz"],
     "data.val._target_: fixtures.Blobz: module 'fixtures' has no 'Blobz' (did you mean 'Blobs'?); check the "
     "dotted path"),
    # nothing close installed: no far-fetched guess among every module there is (it was '_codecs')
    (["model._target_=my_models.MLP"],
     "model._target_: my_models.MLP: no module named 'my_models'; check the dotted path"),
], ids=["optimizer", "schedule", "collate_fn", "dataset", "nothing-close"])
def test_every_target_fails_in_one_line_naming_its_key(tmp_path, user_module, overrides, message):
    with pytest.raises(csf.ConfigError) as caught:
        csf.Run(fixtures.compose(*overrides), output_dir=tmp_path / "run")
    assert caught.value.exit_code == 2
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_place_is_the_user_s_innermost_line_not_torch_s(tmp_path, monkeypatch):
    (tmp_path / "csf_user_net.py").write_text("import torch\n\n\ndef net():\n    return torch.nn.Linear(3, -1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(csf.ConfigError) as caught:
        targets.build({"_target_": "csf_user_net.net"}, "model")
    assert str(caught.value).startswith("model: csf_user_net.net(...) raised RuntimeError: ")
    assert str(caught.value).endswith(" (csf_user_net.py:5); run with debug=true for the traceback")


def test_a_misspelled_primary_config_gets_did_you_mean(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    with pytest.raises(csf.ConfigError) as caught:
        csf.compose(config_dir=str(tmp_path), config_name="mien")
    assert str(caught.value) == ("--config-name: no primary config 'mien' in the config search path (available: "
                                 "config, mine); did you mean `--config-name mine`?")


def test_targets_below_recursive_false_are_left_to_the_target():
    built = targets.build({"_target_": "collections.OrderedDict", "_recursive_": False,
                           "inner": {"_target_": "csf_no_such_module.Thing"}}, "model")
    assert built == {"inner": {"_target_": "csf_no_such_module.Thing"}}  # never imported, as Hydra leaves it


def test_an_option_whose_file_is_here_but_not_on_the_search_path_says_where_it_is(tmp_path, monkeypatch):
    """A newcomer's ``data=my_data`` without ``--config-dir conf``, or ``conf/models/`` for the group ``model``:
    the refusal listed only the built-in options; it now names the file found and what to do."""
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "my_data.yaml").write_text("batch_size: 4\n")
    (tmp_path / "conf" / "models").mkdir()
    (tmp_path / "conf" / "models" / "my_model.yaml").write_text("_target_: torch.nn.Linear\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(csf.ConfigError) as caught:
        csf.compose(["data=my_data"])
    assert str(caught.value).endswith("; conf/data/my_data.yaml is here: give its config directory with "
                                      "--config-dir conf")
    with pytest.raises(csf.ConfigError) as caught:
        csf.compose(["model=my_model"], config_dir="conf")
    assert str(caught.value).endswith("; conf/models/my_model.yaml is here, but a config group's options are the files "
                                      "of a folder named after it: move it to <your config directory>/model/")
