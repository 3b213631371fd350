"""The CLI's one dispatch (issue 42, as Hydra's ``_run_hydra``): the command line is parsed once and
``mode_of`` alone chooses what it asks for: Hydra's own modes (help, info, ``--cfg`` ...), a sweep, or one
run the CLI composes itself."""
import pytest

from csframework.__main__ import HYDRA, MULTIRUN, RUN, mode_of
from csframework.hydra_session import parse_command_line


@pytest.mark.parametrize("argv, mode", [
    (["loop.max_steps=2"], RUN),
    ([], RUN),
    (["hydra.mode=RUN", "seed=1"], RUN),
    (["-m", "optimizer=sgd,adamw"], MULTIRUN),
    (["--multirun", "seed=1"], MULTIRUN),
    (["hydra.mode=MULTIRUN", "seed=1,2"], MULTIRUN),
    (["--help"], HYDRA),
    (["--hydra-help"], HYDRA),
    (["--cfg", "job"], HYDRA),
    (["--info"], HYDRA),
    (["--resolve", "--cfg", "job"], HYDRA),
    (["--config-path", "/elsewhere", "seed=1"], HYDRA),
    (["--no-such-flag"], HYDRA),  # a usage error: Hydra reports it
])
def test_one_place_chooses_what_the_command_line_asks_for(argv, mode):
    assert mode_of(parse_command_line(argv)) == mode
