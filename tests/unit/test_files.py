"""``csframework.files``: the one atomic write."""
import json

import pytest

from csframework.files import fsync_dir, write_json_atomic, write_text_atomic


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    write_json_atomic(path, {"step": 3, "path": tmp_path})
    assert json.loads(path.read_text()) == {"step": 3, "path": str(tmp_path)}
    write_text_atomic(path, "new", durable=False)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    fsync_dir(tmp_path)


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "index.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_json_atomic(path, {1j: 2})  # a complex key is not JSON
    assert path.read_text() == "old"
