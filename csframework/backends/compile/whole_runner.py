"""The step's runner while the whole step is one graph (``whole_step.WholeStep``)."""
from __future__ import annotations

from typing import Any, Callable

from ..eager_step import Install, StepRunner
from .functions import Guarded, model_function
from .session import CompileSession
from .whole_step import WholeStep


class WholeStepRunner:
    """The step's runner while the whole step is one graph (``WholeStep``), and evaluation compiled with
    ``torch.compile``. When the step is not one graph after all it installs, once, the per-function runner (the
    first trace failed) or the eager one (Inductor failed), and that runner trains the batch."""

    def __init__(self, session: CompileSession, whole: WholeStep, *, install: Install,
                 per_function: Callable[[Guarded], StepRunner], eager: Callable[[], StepRunner]):
        self.session, self.whole, self.install = session, whole, install
        self.per_function, self.eager = per_function, eager
        self.evaluate: Callable[[Any], dict] = model_function(session, self, "evaluate", eager().evaluate)

    def train_batch(self, run: Any, batch: Any, last: bool) -> dict:
        self.session.scope.enter()
        outputs = self.whole(batch, run.global_step)
        if outputs is not None:
            return outputs
        why, reason = self.whole.refused or ("compile", "unknown")
        self.session.whole = False
        if why == "compile":
            self.session.fall_back(reason)
            runner = self.eager()
        else:  # data-dependent code: Dynamo compiles what it can and reports the graph breaks
            self.session.run.log.info("step_compiled_per_function", reason=reason)
            runner = self.per_function(self.evaluate)  # type: ignore[arg-type]
        self.install(runner)
        return runner.train_batch(run, batch, last)

    def train_eagerly(self, run: Any, batch: Any) -> None:
        """The same step without its graph: the payoff check's eager step."""
        self.whole.eager(batch, run)

    def make_eager(self, name: str) -> None:
        """``name`` runs eagerly from now on (csframework's recompile bound): evaluation (the step's own graphs
        are bounded by ``WholeStep``)."""
        if name == "evaluate":
            self.evaluate = self.eager().evaluate

    def fail(self, reason: str) -> None:
        """Compiling failed: the eager runner replaces this one (once)."""
        if self.session.fall_back(reason):
            self.install(self.eager())
