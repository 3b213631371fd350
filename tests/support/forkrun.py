"""Run many ``python -m csframework`` command lines quickly: this process imports csframework (and torch,
Hydra) once, then forks a fresh child per command line that calls the CLI's ``main()`` with that argv, its
own environment additions and its stdout/stderr in files. A child is a new process like the CLI's
(signals, exit status, Hydra's global state are its own); only the interpreter start-up is shared.

Usage (what ``run_chains`` does): ``python forkrun.py <jobs.json> <results.json> [parallel]``, where
jobs.json is a list of chains, each a list of ``{"argv": [...], "env": {...}, "collect": [paths]}``; the
command lines of one chain run one after the other, chains run ``parallel`` at a time. results.json gets,
per chain, a list of ``{"returncode", "stdout", "stderr", "files"}`` (``returncode`` is ``-N`` for a child
killed by signal N; ``files`` maps each ``collect`` path to its text right after that job, or ``None``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def preload() -> None:
    """Import, before forking, what every run imports (its children would each import it again, about half of
    a short forked run's time): the CLI, the run and its built-in plugins, the eager backend, torch's compiler
    stack (building an optimizer imports it), Hydra's plugins (found by a scan of every installed one), and
    matplotlib's figure, PNG writer and font list (the loss curves drawn at a run's end) where the plot extra is
    installed. Nothing here starts a thread or leaves a file open."""
    import csframework.__main__  # noqa: F401
    import csframework.backends.eager  # noqa: F401
    import csframework.builtin.checkpoint  # noqa: F401
    import csframework.builtin.logs  # noqa: F401
    import csframework.run  # noqa: F401
    import torch._dynamo  # noqa: F401
    from hydra.core.plugins import Plugins

    Plugins.instance()  # (scans hydra_plugins once, importing each)
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401 - (its import loads the font list: matplotlib.font_manager)
        import matplotlib.ticker  # noqa: F401
    except ImportError:  # no plot extra: a run draws curves.svg
        pass


def run_cli_and_exit(argv: list[str], setup=lambda: None) -> None:
    """In a forked child: ``setup()`` (redirections, environment), then the CLI's ``main()`` with ``argv``,
    then leave with the exit status the interpreter would give (an uncaught error's traceback printed, 1)."""
    code = 1
    try:
        setup()
        sys.argv = ["csframework", *argv]
        from csframework.__main__ import main

        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - what the interpreter would print for an uncaught error
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _child(argv: list[str], env: dict, out: str, err: str) -> None:
    def setup():
        os.environ.update(env)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)

    run_cli_and_exit(argv, setup)


def serve(chains: list[list[dict]], parallel: int, workdir: Path) -> list[list[dict]]:
    results: list[list[dict]] = [[] for _ in chains]
    position = [0] * len(chains)
    waiting = list(range(len(chains)))
    running: dict[int, tuple[int, str, str]] = {}

    def read(path: str):
        try:
            return Path(path).read_text()
        except OSError:
            return None

    ended: dict[int, float] = {}  # when each chain's previous command ended

    def start(chain: int) -> None:
        job = chains[chain][position[chain]]
        if job.get("new_second") and chain in ended:  # as typed: in a second after the previous one ended,
            # which had named its run directory (Hydra's dated one, to the second) before it ended
            time.sleep(max(0.0, int(ended[chain]) + 1 - time.time()))
        out = str(workdir / f"{chain}-{position[chain]}.out")
        err = str(workdir / f"{chain}-{position[chain]}.err")
        pid = os.fork()
        if pid == 0:
            _child(job["argv"], job.get("env", {}), out, err)
        running[pid] = (chain, out, err)

    while waiting or running:
        while waiting and len(running) < parallel:
            start(waiting.pop(0))
        pid, status = os.wait()
        chain, out, err = running.pop(pid)
        ended[chain] = time.time()
        job = chains[chain][position[chain]]
        results[chain].append({"returncode": os.waitstatus_to_exitcode(status),
                               "stdout": Path(out).read_text(errors="replace"),
                               "stderr": Path(err).read_text(errors="replace"),
                               "files": {path: read(path) for path in job.get("collect", [])}})
        position[chain] += 1
        if position[chain] < len(chains[chain]):
            waiting.insert(0, chain)
    return results


def run_chains(chains: list[list[dict]], env: dict, parallel: int = 2, timeout: float = 600,
               cwd: str | None = None) -> list[list[dict]]:
    """Run ``chains`` through a fresh ``forkrun.py`` process started with ``env`` in ``cwd``; returns the
    results."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs, results = Path(tmp) / "jobs.json", Path(tmp) / "results.json"
        jobs.write_text(json.dumps(chains))
        done = subprocess.run([sys.executable, __file__, str(jobs), str(results), str(parallel)], env=env,
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(results.read_text())


if __name__ == "__main__":
    preload()  # once, before forking (no thread pool started yet)

    jobs_path, results_path = Path(sys.argv[1]), Path(sys.argv[2])
    parallel = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    with tempfile.TemporaryDirectory() as work:
        found = serve(json.loads(jobs_path.read_text()), parallel, Path(work))
    results_path.write_text(json.dumps(found))
