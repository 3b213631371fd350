"""``csframework.builtin.checkpoint.store`` (the ``checkpoints/`` directory) and ``untrusted`` (how its files
are read): adversarial checkpoint directories (issue 9, item 1): whatever ``checkpoints/`` holds, files outside it
are never touched, resume uses only this run's own good checkpoints, and what is wrong is named.

Every case starts from a copy of the same two runs side by side: ``run`` (checkpoints at steps 2, 3, 4) and
a ``sibling`` run (steps 3, 6), each with a sentinel file, and a sentinel beside them. The attack is applied
to ``run``, which is then resumed (``checkpoint.resume=auto``, ``keep_last=1`` so pruning runs at once).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

import csframework as csf
from csframework.builtin import checkpoint as ckpt

import fixtures
from fixtures import events, fit

RESUME = ["loop.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep_last=1", "checkpoint.resume=auto"]


def snapshot(path: Path) -> dict:
    """Every file under ``path`` (links as their target) with its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, path)] = (os.readlink(full) if os.path.islink(full)
                                                else Path(full).read_bytes())
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    base = tmp_path_factory.mktemp("template")
    fit(base / "run", "loop.max_steps=4", "checkpoint.every_steps=1", "checkpoint.keep_last=3")
    fit(base / "sibling", "loop.max_steps=6", "checkpoint.every_steps=3")
    for where in (base, base / "run", base / "sibling"):
        (where / "sentinel.txt").write_text("keep me")
    return base


class Place:
    """A fresh copy of the template: ``run``, ``sibling``, their checkpoints and what lies outside."""

    def __init__(self, template: Path, tmp_path: Path):
        self.base = tmp_path / "runs"
        shutil.copytree(template, self.base, symlinks=True)
        self.run, self.sibling = self.base / "run", self.base / "sibling"
        self.root = self.run / "checkpoints"
        self.index = self.root / "index.json"
        self.outside = {"sibling": snapshot(self.sibling), "base": (self.base / "sentinel.txt").read_bytes()}

    def write_index(self, value) -> None:
        self.index.write_text(value if isinstance(value, str) else json.dumps(value))

    def assert_outside_untouched(self) -> None:
        assert snapshot(self.sibling) == self.outside["sibling"]
        assert (self.base / "sentinel.txt").read_bytes() == self.outside["base"]
        assert (self.run / "sentinel.txt").read_text() == "keep me"

    def resume(self, *extra, plugins=()):
        return fit(self.run, *RESUME, *extra, plugins=plugins)


@pytest.fixture
def place(template, tmp_path):
    return Place(template, tmp_path)


def resumed_from(run_dir: Path) -> str:
    return next(e for e in events(run_dir) if e["event"] == "resumed")["path"]


def index_warning(run_dir: Path) -> dict:
    return next(e for e in events(run_dir) if e["event"] == "checkpoint_index_rebuilt")


def assert_resumed_from_own(place: Place, step: int = 4) -> None:
    assert resumed_from(place.run) == str(place.root / f"step-{step:08d}")
    assert json.loads(place.index.read_text()) == {"checkpoints": ["step-00000006"]}
    assert ckpt.scan_checkpoints(place.root) == ["step-00000006"]


# -- the index ----------------------------------------------------------------------------------------------
def _index_attacks(place: Place) -> dict:
    own = ["step-00000002", "step-00000003", "step-00000004"]
    other = place.sibling / "checkpoints" / "step-00000006"
    return {
        "dotdot": ["..", *own],  # pruning rmtree(checkpoints/..) deleted the run directory
        "dot": [*own, "."],
        "absolute": [*own, str(other)],
        "into-another-run": [*own, "../../sibling/checkpoints/step-00000006"],
        "duplicates": [*own, "step-00000004", "step-00000002"],
        "not-a-list": {"checkpoints": "step-00000004"},
        "not-an-object": own,
        "nested": {"checkpoints": [own]},
        "listed-but-missing": [*own, "step-00000009"],
        "not-json": "{\"checkpoints\": [",
    }


@pytest.mark.parametrize("attack", ["dotdot", "dot", "absolute", "into-another-run", "duplicates", "not-a-list",
                                    "not-an-object", "nested", "listed-but-missing", "not-json"])
def test_a_crafted_index_is_a_hint_rebuilt_from_the_directory(place, attack):
    value = _index_attacks(place)[attack]
    place.write_index(value if isinstance(value, (dict, str)) or attack == "not-an-object"
                      else {"checkpoints": value})
    _, summary = place.resume()
    assert summary["status"] == "completed" and summary["global_step"] == 6
    place.assert_outside_untouched()
    warning = index_warning(place.run)
    assert warning["path"] == str(place.index) and warning["level"] == "warning"
    assert warning["checkpoints"] == ["step-00000002", "step-00000003", "step-00000004"]
    assert_resumed_from_own(place)


def test_a_deeply_nested_index_is_damaged_not_a_recursion_error(place):
    place.write_index('{"checkpoints": ' + "[" * 200_000 + "]" * 200_000 + "}")
    place.resume()
    assert "nested deeper than" in index_warning(place.run)["problem"]
    place.assert_outside_untouched()
    assert_resumed_from_own(place)


def test_an_index_nested_within_the_recursion_limit_but_too_deep_is_damaged(place):
    place.write_index({"checkpoints": ["step-00000004"], "x": json.loads("[" * 100 + "]" * 100)})
    place.resume()
    assert f"nested deeper than {ckpt.MAX_DEPTH} levels" in index_warning(place.run)["problem"]
    assert_resumed_from_own(place)


def test_an_oversized_index_is_not_read(place):
    place.write_index({"checkpoints": ["step-00000002"] + ["step-00000004"] * 100_000})  # > 1 MiB
    assert place.index.stat().st_size > ckpt.MAX_INDEX_BYTES
    place.resume()
    assert f"larger than {ckpt.MAX_INDEX_BYTES} bytes" in index_warning(place.run)["problem"]
    place.assert_outside_untouched()
    assert_resumed_from_own(place)


def test_an_index_that_is_a_link_to_another_runs_index_is_not_followed(place):
    place.index.unlink()
    place.index.symlink_to(place.sibling / "checkpoints" / "index.json")
    place.resume()
    assert "symbolic link" in index_warning(place.run)["problem"]
    place.assert_outside_untouched()  # the sibling's index was not rewritten through the link
    assert not place.index.is_symlink()
    assert_resumed_from_own(place)


def test_a_directory_named_like_the_index_is_kept_and_named_when_the_index_cannot_be_written(place):
    place.index.unlink()
    place.index.mkdir()
    (place.index / "mine.txt").write_text("keep me")
    with pytest.raises(csf.PluginError, match=re.escape(f"checkpoint: could not update {place.index}")) as info:
        place.resume()
    assert info.value.exit_code == 1
    assert (place.index / "mine.txt").read_text() == "keep me"
    assert "Is a directory" in index_warning(place.run)["problem"]
    assert resumed_from(place.run) == str(place.root / "step-00000004")
    assert ckpt.scan_checkpoints(place.root)[:3] == ["step-00000002", "step-00000003", "step-00000004"]
    place.assert_outside_untouched()


# -- links and foreign entries in checkpoints/ --------------------------------------------------------------
@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "unindexed"])
def test_a_checkpoint_name_that_links_out_of_the_run_is_not_a_checkpoint(place, indexed):
    link = place.root / "step-00000005"
    link.symlink_to(place.sibling / "checkpoints" / "step-00000006", target_is_directory=True)
    if indexed:
        place.write_index({"checkpoints": ["step-00000003", "step-00000004", "step-00000005"]})
    else:
        place.index.unlink()
    _, summary = place.resume()
    assert summary["status"] == "completed"
    place.assert_outside_untouched()
    assert resumed_from(place.run) == str(place.root / "step-00000004")
    if indexed:
        assert "step-00000005, which is not a checkpoint directory" in index_warning(place.run)["problem"]
    # the run's own step 5 replaced the link (never written through) and was pruned like any checkpoint
    assert_resumed_from_own(place)


def test_pruning_leaves_everything_but_the_frameworks_own_checkpoints(place):
    foreign = {"notes.txt": "mine", "step-5": "short name", "step-00000001.bak": "backup",
               "step-000000001": "nine digits, leading zero"}
    for name, text in foreign.items():
        (place.root / name).mkdir()
        (place.root / name / "keep.txt").write_text(text)
    (place.root / "step-00000001").write_text("a file with a checkpoint's name")
    place.resume()
    place.assert_outside_untouched()
    for name, text in foreign.items():
        assert (place.root / name / "keep.txt").read_text() == text
    assert (place.root / "step-00000001").read_text() == "a file with a checkpoint's name"
    assert_resumed_from_own(place)


def test_stale_cleanup_removes_only_the_frameworks_temporary_names_and_never_follows_links(place):
    # the run holds the run directory's lock, so no other writer is alive: every temporary name of the
    # framework's (unpredictable: 16 hex digits) is a dead writer's; nothing else is touched
    (place.root / ".tmp-step-00000009.0123456789abcdef").mkdir()
    (place.root / ".tmp-step-00000009.0123456789abcdef" / "state.pt").write_text("half")
    (place.root / ".index.json.fedcba9876543210.tmp").write_text("{")
    (place.root / ".old-step-00000004.00112233aabbccdd").symlink_to(place.sibling / "checkpoints",
                                                                     target_is_directory=True)
    (place.root / ".tmp-step-00000009.not-hex").mkdir()  # not a name the framework writes under
    place.resume()
    place.assert_outside_untouched()
    left = sorted(p.name for p in place.root.iterdir())
    assert left == [".tmp-step-00000009.not-hex", "index.json", "step-00000006"]


# -- damaged files inside a checkpoint ----------------------------------------------------------------------
def _rewrite_meta(checkpoint: Path, change) -> None:
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(change(meta))


@pytest.mark.parametrize("damage", ["not-json", "deeply-nested", "too-deep", "oversized", "wrong-types",
                                    "link", "yaml-bomb", "config-too-large"])
def test_a_damaged_meta_or_config_falls_back_to_the_previous_checkpoint(place, damage, monkeypatch):
    newest = place.root / "step-00000004"
    meta_path = newest / "meta.json"
    if damage == "not-json":
        meta_path.write_text('{"files": {"state.pt": ')
    elif damage == "deeply-nested":
        _rewrite_meta(newest, lambda m: json.dumps(m)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif damage == "too-deep":
        _rewrite_meta(newest, lambda m: json.dumps(dict(m, plugins={"p": json.loads("[" * 80 + "]" * 80)})))
    elif damage == "oversized":
        monkeypatch.setattr(ckpt.format, "MAX_META_BYTES", 64 << 10)
        _rewrite_meta(newest, lambda m: json.dumps(dict(m, plugins={"p": "x" * (100 << 10)})))
    elif damage == "wrong-types":
        _rewrite_meta(newest, lambda m: json.dumps(dict(m, metrics=["train/loss", 0.1])))
    elif damage == "link":
        meta_path.unlink()
        meta_path.symlink_to(place.sibling / "checkpoints" / "step-00000006" / "meta.json")
    else:  # a config.yaml whose checksum in meta.json matches, so only its content can refuse it
        text = ("a: &a [x, x, x, x, x, x, x, x]\n" + "".join(f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi"))) if damage == "yaml-bomb" else "a: 1\n"
        (newest / "config.yaml").write_text(text)

        size = len(text) if damage == "yaml-bomb" else ckpt.MAX_CONFIG_BYTES + 1  # claimed: never read

        def fix(m):
            m["files"]["config.yaml"] = {"bytes": size, "crc32": ckpt.file_crc32(newest / "config.yaml")}
            return json.dumps(m)

        _rewrite_meta(newest, fix)
    _, summary = place.resume()
    assert summary["status"] == "completed" and summary["global_step"] == 6
    place.assert_outside_untouched()
    warning = next(e for e in events(place.run) if e["event"] == "checkpoint_damaged")
    assert warning["path"] == str(newest)
    assert ("config.yaml" if damage.startswith(("yaml", "config")) else "meta.json") in warning["error"]
    assert resumed_from(place.run) == str(place.root / "step-00000003")


# -- what checkpoint.resume may name ------------------------------------------------------------------------
def test_a_bare_state_dict_as_resume_target_is_refused_naming_it(tmp_path):
    import torch

    bare = tmp_path / "model.pt"
    torch.save(fixtures.mlp().state_dict(), bare)
    with pytest.raises(csf.CsfError) as info:
        fit(tmp_path / "run", f"checkpoint.resume={bare}")
    assert info.value.exit_code == 2
    assert re.search(rf"checkpoint.resume: {re.escape(str(bare))} is not a csframework checkpoint: it is a file, "
                     "and a checkpoint is a directory holding meta.json", str(info.value))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_directory_without_meta_json_as_resume_target_is_refused_naming_what_is_missing(tmp_path):
    import torch

    folder = tmp_path / "weights"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / "model.pt")
    with pytest.raises(csf.CsfError, match=re.escape(f"checkpoint.resume: {folder} is not a csframework checkpoint: "
                                                     "it holds no meta.json")) as info:
        fit(tmp_path / "run", f"checkpoint.resume={folder}")
    assert info.value.exit_code == 2
    # a state.pt without its meta.json: a checkpoint directory missing a file, refused naming it
    (folder / "model.pt").rename(folder / "state.pt")
    with pytest.raises(csf.CsfError, match=re.escape(f"checkpoint {folder}: meta.json is missing")):
        fit(tmp_path / "again", f"checkpoint.resume={folder}")  # "run" holds the refused run's events.jsonl


def test_resume_from_another_run_reads_its_index_but_never_rewrites_it(place, tmp_path):
    other = place.sibling / "checkpoints"
    (other / "index.json").write_text(json.dumps({"checkpoints": ["..", "step-00000003", "step-00000006"]}))
    before = snapshot(place.sibling)
    target = tmp_path / "runs" / "run" / ".." / "sibling"  # resolved before use
    _, summary = fit(tmp_path / "new", "loop.max_steps=8", f"checkpoint.resume={target}")
    assert summary["status"] == "completed"
    assert snapshot(place.sibling) == before
    assert resumed_from(tmp_path / "new") == str(other.resolve() / "step-00000006")
    assert index_warning(tmp_path / "new")["path"] == str(other.resolve() / "index.json")


def test_a_file_where_checkpoints_should_be_is_an_error_with_resume_auto(place):
    shutil.rmtree(place.root)
    place.root.write_text("not a directory")
    with pytest.raises(csf.CsfError) as info:
        place.resume()
    assert info.value.exit_code == 2
    assert f"{place.root}: it is a file, not the run's own checkpoints directory; remove it" in str(info.value)
    assert place.root.read_text() == "not a directory"
    place.assert_outside_untouched()


def test_an_unreadable_checkpoints_directory_is_an_error_not_a_fresh_start(place, monkeypatch):
    real_scandir = os.scandir

    def denied(path="."):
        if Path(path) == place.root:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(ckpt.store.os, "scandir", denied)
    with pytest.raises(csf.CsfError, match=re.escape(f"cannot list the checkpoints in {place.root} "
                                                     "(Permission denied)")) as info:
        place.resume()
    assert info.value.exit_code == 2
    monkeypatch.undo()
    assert ckpt.scan_checkpoints(place.root) == ["step-00000002", "step-00000003", "step-00000004"]
    assert json.loads(place.index.read_text())["checkpoints"][-1] == "step-00000004"
    place.assert_outside_untouched()
