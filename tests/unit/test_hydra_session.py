"""``csframework.hydra_session``, composition without plugins: it takes the backend schemas and config
paths as arguments, and types ``backend`` with the schema of its device type (``csframework.config``'s
typing, and ``stage_config`` merging a stage onto the typed backend)."""
import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import pytest

from csframework.backends.csx.schema import CsxConfig
from csframework.backends.eager import CpuConfig, GpuConfig
from csframework.config import stage_config
from csframework.hydra_session import compose, register_config_files
from csframework.errors import ConfigError, ValidationError

BACKENDS = {"CPU": CpuConfig, "GPU": GpuConfig, "CSX": CsxConfig}
CSX_CONF = ["pkg://csframework.backends.csx.conf"]


def test_the_schemas_import_without_the_plugin_system():
    for module in ("csframework.config", "csframework.hydra_session"):  # composition knows no plugin either
        code = (f"import {module}, sys; "
                "assert not {'csframework.plugins', 'csframework.builtin', 'csframework.run'} & set(sys.modules)")
        assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0, module


def test_backend_is_typed_by_its_device_types_schema():
    cfg = compose(["device=csx", "backend.num_csx=2"], backends=BACKENDS, config_files=CSX_CONF)
    assert isinstance(cfg.backend, CsxConfig) and cfg.backend.num_csx == 2
    assert isinstance(compose([], backends=BACKENDS).backend, CpuConfig)


def test_a_device_type_nobody_supplies_is_refused_naming_the_known_ones():
    with pytest.raises(ValidationError, match="backend.type: 'CSX' is not a device type; use CPU, GPU"):
        compose(["device=csx"], backends={"CPU": CpuConfig, "GPU": GpuConfig}, config_files=CSX_CONF)


def test_a_setting_of_another_backend_names_its_owner_and_an_unknown_one_the_settings():
    with pytest.raises(ValidationError) as e:
        compose(["backend.compile_only=true", "+backend.turbo=1"], backends=BACKENDS)
    assert e.value.problems == [
        "backend.compile_only: only CSX understands it, and this run's device is CPU; remove it or use device=csx",
        "backend.turbo: the CPU backend has no such setting (its settings: compile, compile_fullgraph, compile_mode, "
        "compile_whole_step, float32_matmul_precision, fsdp_wrap, strategy, threads, timeout_s)"]
    with pytest.raises(ConfigError, match="backend.num_csx: Value 'x' of type 'str' could not be converted"):
        compose(["device=csx", "backend.num_csx=x"], backends=BACKENDS, config_files=CSX_CONF)


def test_the_float32_matmul_precision_is_one_of_torchs_levels_on_cpu_and_gpu():
    cfg = compose(["device=gpu", "backend.float32_matmul_precision=high"], backends=BACKENDS)
    assert cfg.backend.float32_matmul_precision.value == "high"
    assert compose(["device=gpu"], backends=BACKENDS).backend.float32_matmul_precision is None  # torch's own
    assert compose(["backend.float32_matmul_precision=medium"], backends=BACKENDS).backend.float32_matmul_precision.value == "medium"
    with pytest.raises(ConfigError, match=r"backend.float32_matmul_precision: Invalid value 'tf32', expected one "
                                          r"of \[highest, high, medium\]"):
        compose(["device=gpu", "backend.float32_matmul_precision=tf32"], backends=BACKENDS)
    with pytest.raises(ValidationError, match="backend.float32_matmul_precision: only CPU/GPU understands it"):
        compose(["device=csx", "backend.float32_matmul_precision=high"], backends=BACKENDS, config_files=CSX_CONF)


@pytest.mark.parametrize("overrides", [
    ["device=csx", "backend.threads=null"], ["device=csx", "backend.threads=2"],
    ["device=csx", "backend.compile=false", "backend.strategy=single", "backend.fsdp_wrap=[]",
     "backend.timeout_s=600", "backend.float32_matmul_precision=null", "+backend.device_index=0"],
    ["backend.num_csx=1", "backend.compile_dir=null", "backend.retrace_every_iteration=false", "backend.threads=null"],
])
def test_another_devices_setting_left_null_or_at_its_default_moves_between_devices(overrides):
    """A config written for one device runs on another: a key only another backend has is dropped when it is
    ``null`` or that backend's default; ``threads`` is every device's."""
    cfg = compose(overrides, backends=BACKENDS, config_files=CSX_CONF)
    expected = CsxConfig if "device=csx" in overrides else CpuConfig
    assert type(cfg.backend) is expected
    assert cfg.backend.threads == (2 if "backend.threads=2" in overrides else None if "backend.threads=null" in overrides else 0)


def test_another_devices_setting_changed_from_its_default_is_still_refused():
    with pytest.raises(ValidationError, match="backend.num_csx: only CSX understands it"):
        compose(["backend.num_csx=2"], backends=BACKENDS, config_files=CSX_CONF)
    with pytest.raises(ValidationError, match="backend.device_index: only GPU understands it"):
        compose(["device=csx", "+backend.device_index=1"], backends=BACKENDS, config_files=CSX_CONF)


def test_a_new_backend_schema_is_all_composition_needs():
    @dataclass
    class Other:
        type: str = "CPU"
        knob: int = 3

    # the built-in backend/cpu.yaml lists every CpuConfig key (what --help shows): the new schema drops them
    # (Hydra deletes no null value: such a key is set first)
    dropped = [o for f in dataclasses.fields(CpuConfig) if f.name != "type"
               for o in ([f"backend.{f.name}=true"] if f.default is None else []) + [f"~backend.{f.name}"]]
    cfg = compose(["+backend.knob=4", *dropped], backends={"CPU": Other})
    assert cfg.backend == Other(knob=4)


def test_a_stage_merges_onto_the_typed_backend():
    cfg = compose(["device=csx", "+stages.a.loop.max_steps=2", "+stages.b.backend.num_csx=2"],
                  backends=BACKENDS, config_files=CSX_CONF)
    assert stage_config(cfg, "b", cfg.stages["b"]).backend == CsxConfig(num_csx=2, compile_dir=cfg.backend.compile_dir,
                                                                         graph_compiler=cfg.backend.graph_compiler)
    with pytest.raises(ConfigError, match="stages.a.backend.strategy"):
        stage_config(cfg, "a", {"backend": {"strategy": "ddp"}})


def test_a_backends_config_files_become_group_options(tmp_path):
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "tiny.yaml").write_text("type: TINY\n")
    (tmp_path / "backend").mkdir()
    (tmp_path / "backend" / "tiny.yaml").write_text("type: TINY\nknob: [1\n")
    with pytest.raises(ConfigError, match="tiny.yaml"):  # a broken file is named
        register_config_files([f"file://{tmp_path}"])
    (tmp_path / "backend" / "tiny.yaml").write_text("type: TINY\nknob: 1\n")

    @dataclass
    class Tiny:
        type: str = "TINY"
        knob: int = 0

    cfg = compose(["device=tiny"], backends={"TINY": Tiny}, config_files=[f"file://{tmp_path}"])
    assert cfg.backend == Tiny(knob=1)


# -- issue 29 item 3: an interpolation into a group the user replaced ---------------------------------------------
def test_the_default_data_composes_with_a_model_that_has_no_block_size():
    """``conf/data/stdlib_text.yaml`` follows the transformer's ``block_size`` when the model has one: with any
    other model (here the built-in linear classifier) the data still composes, with a window of 64."""
    cfg = compose(["model=tiny_linear"], backends=BACKENDS)
    assert cfg.data.train["block_size"] == cfg.data.val["block_size"] == 64
    assert compose(["model.block_size=32"], backends=BACKENDS).data.train["block_size"] == 32


def test_an_interpolation_into_a_replaced_group_names_both_group_options(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_model.yaml").write_text("_target_: torch.nn.Linear\nin_features: 4\nout_features: 3\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "my_text.yaml").write_text(
        "train:\n  _target_: csframework.defaults.StdlibText\n  block_size: ${model.block_size}\nval: null\n")
    with pytest.raises(ConfigError) as error:
        compose(["model=my_model", "data=my_text"], config_dir=str(tmp_path), backends=BACKENDS)
    assert str(error.value) == ("data.train.block_size: ${model.block_size} (from data=my_text) but model=my_model "
                                "has no block_size; set data.train.block_size=<value>, or choose a model that has one")
    with pytest.raises(ConfigError) as error:  # given on the command line, it is said so
        compose(["model=my_model", "data=my_text", "data.train.block_size=8", "+data.train.split=${loop.nope}"],
                config_dir=str(tmp_path), backends=BACKENDS)
    assert str(error.value) == ("data.train.split: ${loop.nope} (from the overrides) but the config has no "
                                "loop.nope; set data.train.split=<value>")


def test_a_primary_config_in_the_working_directory_is_named_with_its_config_dir(tmp_path, monkeypatch):
    """``--config-name my_run`` without ``--config-dir conf``: the refusal names conf/my_run.yaml and the flag
    (it listed the primaries there are, ``config``), as a group's option found nearby is."""
    from csframework.hydra_session import missing_primary

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my_run.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    monkeypatch.chdir(tmp_path)
    assert missing_primary("my_run", None).endswith(
        "(available: config); conf/my_run.yaml is here: give its config directory with --config-dir conf")
    assert missing_primary("other", None).endswith("(available: config)")
