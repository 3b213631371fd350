"""``csframework.errors``: what is echoed to the console from a file or a config cannot forge a line."""
import pytest

from csframework.errors import ConfigError, clipped, printable


def test_control_characters_are_escaped_for_the_console():
    assert printable("val/loss\n[fake] csframework: done\x1b[2K\u202e") == \
        "val/loss\\n[fake] csframework: done\\x1b[2K\\u202e"


def test_clipped_bounds_what_a_message_repeats_of_an_input():
    """Issue 47 (14): a short input is kept whole, a long one's start and end with its length."""
    assert clipped("step-40") == "step-40"
    long = "step-" + "9" * 4999 + "1"
    assert clipped(long) == f"{long[:198]}...{long[-198:]} (5005 characters)"
    assert len(clipped(long)) < 420 and len(clipped("x" * 10**6, limit=20)) < 50


def test_the_cli_repeats_no_input_at_unbounded_length(capsys):
    """Issue 47 (14): whatever message an error was built with, the CLI's line clips each overlong word (a
    3000-character value as Hydra's error quotes it, or a path), keeping the rest of the line."""
    from csframework.__main__ import report_error

    report_error(ConfigError(f"optimizer.lr: Value '{'a' * 3000}' of type 'str' could not be converted to Float"))
    line = capsys.readouterr().err
    assert len(line) < 520 and line.endswith("(3002 characters) of type 'str' could not be converted to Float\n")


def test_a_composition_error_from_python_clips_the_value_it_quotes():
    """Issue 47 (14): ``csf.compose`` with a 3000-character value of the wrong type (before: quoted whole)."""
    from csframework import hydra_session

    with pytest.raises(ConfigError, match=r"optimizer\.lr: .*\(3002 characters\)") as e:
        hydra_session.compose_dict(["optimizer.lr=" + "a" * 3000])
    assert len(str(e.value)) < 700


def test_a_group_option_longer_than_a_file_name_is_one_config_error():
    """Issue 47 (14): ``model=<3000 characters>``: before, Hydra's ``OSError: File name too long`` was a
    traceback repeating the whole name."""
    from csframework import hydra_session

    with pytest.raises(ConfigError, match=r"\(\d+ characters\): File name too long: an override names") as e:
        hydra_session.compose_dict(["model=" + "m" * 3000])
    assert len(str(e.value)) < 700


def test_every_csframework_error_clips_what_its_message_repeats():
    """Issue 47 (14): from Python too (``csf.Run``, ``load_checkpoint``), however the message was built."""
    from csframework.errors import CheckpointNotFound, ValidationError

    assert len(str(ConfigError(f"seed: {'9' * 5000} is out of range"))) < 450
    assert str(CheckpointNotFound(f"/runs/{'x' * 5000} does not exist")).endswith("(5006 characters) does not exist")
    assert len(str(ValidationError(["a: fine", "name: " + "n" * 5000]))) < 500
