"""``csframework.jsonout``: strict JSON, non-finite numbers written as strings and a value JSON cannot hold
named by its key."""
import json

import pytest

from csframework.jsonout import dumps


def test_strict_json_writes_non_finite_numbers_as_strings_and_names_what_it_cannot_write():
    text = dumps({"loss": float("nan"), "best": float("inf"), "worst": -float("inf"), "n": np_int()})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "loss": "NaN", "best": "Infinity", "worst": "-Infinity", "n": 3}
    with pytest.raises(TypeError, match=r"summary\.metrics\.acc: a object cannot be written as JSON"):
        dumps({"metrics": {"acc": object()}}, where="summary")


def test_a_flat_event_of_plain_fields_is_written_as_jsonable_writes_it():
    """Such a dict is written without jsonable's walk: a non-finite float, a bool or a non-string key still
    go through it."""
    assert dumps({"event": "train", "step": 3, "loss": 0.25}) == '{"event": "train", "step": 3, "loss": 0.25}'
    assert dumps({"event": "train", "loss": float("nan")}) == '{"event": "train", "loss": "NaN"}'
    assert dumps({"ok": True, 1: -float("inf")}) == '{"ok": true, "1": "-Infinity"}'
    flat = {"event": "caf\u00e9 \"x\"", "path": "a\\b\n", "n": -1, "x": 1e300}  # text as it is, escapes as json's
    assert dumps(flat) == json.dumps(flat, ensure_ascii=False)
    assert dumps(flat, indent=2) == json.dumps(flat, ensure_ascii=False, indent=2)


def np_int():
    import numpy as np

    return np.int64(3)
