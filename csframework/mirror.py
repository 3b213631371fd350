"""``Mirror``: how ``Run`` shows a piece of what it holds as an attribute of its own, read-only, typed once and
documented where the piece is: ``run.global_step`` is ``run.state.global_step`` (the loop's record, which
``RunState`` documents), ``run.module`` is ``run.current.module`` (``Stage`` documents it). Plugins read the
one spelling ``run.<name>``; the holder is the loop's, or the stage's, business. ``RecordView`` is the loop's
record so mirrored (``Run`` is one)."""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Generic, NoReturn, TypeVar

from .state import RunState

T = TypeVar("T")

#: The class that documents each holder's fields.
DOCUMENTED_BY = {"state": "RunState", "current": "Stage"}


class Mirror(Generic[T]):
    """Declares ``run.<name>`` (of type ``T``) to be ``run.<holder>.<name>``, read-only.

    When the class is made, a plain ``property`` takes its place: its getter is ``operator.attrgetter`` (a
    C call, no Python frame: plugins read some of these at every step), its doc names the documented field,
    and its setter refuses, naming the owner, as the loop alone writes its record."""

    def __init__(self, holder: str) -> None:
        self.holder = holder

    def __set_name__(self, owner: type, name: str) -> None:
        field = f"{DOCUMENTED_BY[self.holder]}.{name}"

        def refuse(_: Any, __: Any) -> NoReturn:
            raise AttributeError(f"run.{name} is read-only: it is {field}, which the run keeps (a plugin reads it)")

        setattr(owner, name, property(attrgetter(f"{self.holder}.{name}"), refuse,
                                      doc=f"``{field}`` (read-only; documented there)."))

    if TYPE_CHECKING:  # what the type checker sees: the field's type, and no assignment
        def __get__(self, run: object, owner: type | None = None) -> T: ...

        def __set__(self, run: object, value: NoReturn) -> None: ...


class RecordView:
    """The loop's record (``self.state``, a ``RunState``) as read-only attributes of ``Run``: each field a
    plugin reads under one name, ``run.<field>`` (``RunState`` documents it), and the two calls a plugin
    makes on the record."""

    state: RunState

    global_step: Mirror[int] = Mirror("state")
    stage_index: Mirror[int] = Mirror("state")
    stage_step: Mirror[int] = Mirror("state")
    epoch: Mirror[int] = Mirror("state")
    batch_in_epoch: Mirror[int] = Mirror("state")
    micro_step: Mirror[int] = Mirror("state")
    epoch_end: Mirror[bool] = Mirror("state")
    last_eval_step: Mirror[int] = Mirror("state")
    stop_signal: Mirror[int | None] = Mirror("state")
    stopping: Mirror[bool] = Mirror("state")
    stop_reason: Mirror[str | None] = Mirror("state")
    metrics: Mirror[dict[str, float]] = Mirror("state")
    carried: Mirror[Any] = Mirror("state")
    eval_seconds: Mirror[float] = Mirror("state")
    compile_seconds: Mirror[float] = Mirror("state")
    train_seconds: Mirror[float] = Mirror("state")
    train_steps: Mirror[int] = Mirror("state")

    def closes_epochs(self, every: int | None) -> bool:
        """``RunState.closes_epochs``: whether the step that just ended closed epoch ``every``, ``2 * every`` ..."""
        return self.state.closes_epochs(every)

    def set_save_due(self, due: Callable[[int], bool] | None, save: Callable[[], object] | None = None) -> None:
        """Tell the loop at which steps the caller saves the run's state: ``due(step)`` is asked once a step,
        after the step and before its hooks; where it says ``True`` the loop first reports the metrics not
        yet logged (``on_log_metrics``, their losses checked), so the state saved holds them and nothing calls
        back into the loop. ``save()``, if given, is called by the loop at those steps after the step's
        ``on_train_step_end`` hooks (after the step's evaluation and every plugin's step end: what the
        checkpoint plugin does); without it, the caller saves in its own hooks. One caller (the checkpoint
        plugin, at ``on_train_start``): a later call replaces it; ``None`` asks nothing."""
        self.state.save_due, self.state.save = due, save if due is not None else None
