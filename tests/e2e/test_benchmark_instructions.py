"""benchmarks/instructions.py: a step's instruction count is the difference of two callgrind totals over the
difference of their steps, per side and per function (valgrind itself is not run here: a measurement takes
about 10 minutes; the contestants it runs are loop_overhead's, tested in test_benchmarks.py)."""
import subprocess

import pytest

from benchmarks import instructions, loop_overhead

STEPS = instructions.STEPS


def callgrind_file(path, total: int):
    """The head of a callgrind output file as callgrind 3.19 writes it (its ``summary:`` line) and its end."""
    path.write_text(f"# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: {total}\n"
                    f"fl=(1) ceval.c\nfn=(1) f\n0 {total}\ntotals: {total}\n")
    return path


def test_a_steps_count_is_the_difference_of_two_runs_over_their_steps(tmp_path):
    setup = {"hand": 9_000_000_000, "framework": 16_000_000_000}  # set-up and tear-down differ; they cancel
    per_step = {"hand": 1_500_000, "framework": 1_650_000}
    files = {(side, n): callgrind_file(tmp_path / f"{side}.{n}", setup[side] + per_step[side] * n)
             for side in instructions.SIDES for n in STEPS}
    figure = instructions.figure(files)
    assert figure.samples == [1_650_000] and figure.baseline_samples == [1_500_000]
    assert figure.measured == pytest.approx(1.1) and figure.unit == "instructions/step"


def test_a_file_without_totals_is_refused_naming_it(tmp_path):
    (tmp_path / "killed").write_text("# callgrind format\nevents: Ir\n")
    with pytest.raises(ValueError, match="killed has no totals line"):
        instructions.total(tmp_path / "killed")


def test_functions_are_compared_per_step(tmp_path, monkeypatch):
    """``--functions``: each function's per-step count, the framework's less the hand-written loop's."""
    counts = {("hand", STEPS[0]): 100, ("hand", STEPS[1]): 300, ("framework", STEPS[0]): 500,
              ("framework", STEPS[1]): 1100}
    files = {key: tmp_path / f"{key[0]}.{key[1]}" for key in counts}
    annotate = {str(files[key]): (f"{n * 10:,} (50.0%)  Python/ceval.c:_PyEval_EvalFrameDefault [/lib/libpython3.11.so]\n"
                                  f"{n:,} ( 5.0%)  ???:at::native::add [/lib/libtorch_cpu.so]\n"
                                  f"{n * 11:,} (100.0%)  PROGRAM TOTALS\n")
                for key, n in counts.items()}

    def run(command, **kwargs):
        assert command[:3] == ["callgrind_annotate", "--inclusive=no", "--threshold=100"]
        return subprocess.CompletedProcess(command, 0, stdout=annotate[command[-1]], stderr="")

    monkeypatch.setattr(instructions.subprocess, "run", run)
    steps = STEPS[1] - STEPS[0]
    assert instructions.step_difference(files) == [
        ((6000 - 2000) / steps, "Python/ceval.c:_PyEval_EvalFrameDefault"), ((600 - 200) / steps, "???:at::native::add")]


def test_the_contestants_are_loop_overheads_under_callgrind(tmp_path):
    command = instructions.callgrind_command(tmp_path / "out", "framework", 300)
    assert command[:3] == ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp_path / 'out'}"]
    assert command[3:] == loop_overhead.command("--contestant", "framework", "--model", "tiny", "--data", "premade",
                                                "--steps", "300", "--no-curves", "--freeze-gc")
