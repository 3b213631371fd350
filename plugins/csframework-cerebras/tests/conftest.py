"""The compared runs, shared by the bridge's tests (``bridge_runs.py`` has the settings)."""
import pytest

from bridge_runs import BRIDGE, COMPARED, EMULATOR, cli


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The ``COMPARED`` run on device=cpu, through the bridge (cstorch's CPU backend) and on the emulator."""
    pytest.importorskip("cerebras.pytorch", reason="cerebras-pytorch is not installed (its own venv: see README)")
    from csframework.testing import CsfRunner

    out = {}
    for name, device in (("cpu", ["device=cpu"]), ("bridge", BRIDGE), ("csx", EMULATOR)):
        result = cli(CsfRunner(tmp_path_factory.mktemp(name)), [*device, *COMPARED])
        assert result.exit_code == 0, (name, result.stderr[-2000:])
        out[name] = result
    return out
