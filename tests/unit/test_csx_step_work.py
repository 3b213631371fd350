"""What the CSX emulator does around a step's graph, made cheap for issue 52 (at most 50 us of its own work a
step): the state checked by identity (``graph/watch.py``), arguments and outputs handled without torch's
general pytree (``graph/flat.py``), outputs copied only where they share an input's memory
(``passes.fresh_outputs``), the graph's inputs kept and its rate and step written only when they change
(``graph/execution.py``). Each must see every change the slower code saw, and some it missed."""
from __future__ import annotations

import collections
import functools
import sys

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import csframework as csf
from csframework.backends.csx import lowlevel
from csframework.graph import flat, passes, state_guard, tracer
from csframework.graph import optim as graph_optim
from csframework.graph.compiler import StaticStep
from csframework.graph.watch import StateWatch, args_check


@pytest.fixture(autouse=True)
def fresh_process_state():
    lowlevel._reset()
    yield
    lowlevel._reset()


Pair = collections.namedtuple("Pair", "a b")
T = torch.ones(2)
TREES = [T, 3, None, "s", (), [], {}, (T, [T, {"b": T, "a": 2}]), {"z": (T, None), "a": [1.5, T]},
         Pair(T, [T]), collections.OrderedDict(b=T, a=T), collections.defaultdict(list, x=[T]),
         nn.Parameter(torch.ones(1)), ((([(T, T)],),), {"k": {"deep": [(T,)]}}),
         {"') or __import__('os') or ('": T, (1, "k"): [T], 3: 2.0},  # keys are never written into code
         functools.reduce(lambda tree, _: [tree, T], range(250), T)]  # deeper than a generated expression goes


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_flat_gives_what_pytree_gives(tree):
    expected, spec = pytree.tree_flatten(tree)
    got = flat.leaves(tree)
    assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))
    for args, kwargs in (((tree,), {}), ((T, tree), {"k": tree, "j": T})):  # a step's arguments
        call = [id(leaf) for leaf in pytree.tree_leaves((args, kwargs))]
        assert [id(leaf) for leaf in flat.call_leaves(args, kwargs)] == call
        assert [id(leaf) for leaf in flat.flattener(args, kwargs)(args, kwargs)] == call
    rebuilt = flat.unflatten(got, spec)
    assert type(rebuilt) is type(tree)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))  # torch < 2.5 compares specs recursively (a dataclass's ==)
    try:
        assert pytree.tree_flatten(rebuilt)[1] == spec
    finally:
        sys.setrecursionlimit(limit)
    assert all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), expected))
    with pytest.raises(ValueError):
        flat.unflatten(got + [0], spec)


FLAT_CALL = (([(T, T)], {"x": T, "y": [1, None]}), {"k": T})
OTHER_STRUCTURES = [(([(T, T, T)], {"x": T, "y": [1, None]}), {"k": T}),  # a longer tuple
                    (([[T, T]], {"x": T, "y": [1, None]}), {"k": T}),  # a list for a tuple
                    (([(T, T)], {"y": [1, None], "x": T}), {"k": T}),  # the keys in another order
                    (([(T, T)], {"x": T, "z": [1, None]}), {"k": T}),  # another key
                    (([(T, T)], {"x": T, "y": [1, (None,)]}), {"k": T}),  # a container for a leaf
                    (([(T, nn.Parameter(T))], {"x": T, "y": [1, None]}), {"k": T}),  # another leaf type (pytree's)
                    (([(T, T)], {"x": T, "y": [1, None]}), {}),  # no keyword
                    (([(T, T)], collections.OrderedDict(x=T, y=[1, None])), {"k": T})]  # another container


@pytest.mark.parametrize("other", OTHER_STRUCTURES, ids=range(len(OTHER_STRUCTURES)))
def test_a_flattener_takes_only_its_own_structure(other):
    """A step's arguments are flattened by code made for the last call's structure: any other is refused
    (``None``: the step walks them and makes a flattener for the new one), its own gives pytree's leaves."""
    flatten = flat.flattener(*FLAT_CALL)
    assert [id(leaf) for leaf in flatten(*FLAT_CALL)] == [id(leaf) for leaf in pytree.tree_leaves(FLAT_CALL)]
    assert flatten(*other) is None
    assert [id(leaf) for leaf in flat.flattener(*other)(*other)] == [id(leaf) for leaf in pytree.tree_leaves(other)]


def hide_torch_guard(monkeypatch) -> None:
    """A torch without the private C tensor guard; ``torch._dynamo`` (which imports it) is imported first, so that
    nothing imported while it is hidden fails."""
    import torch._dynamo  # noqa: F401

    monkeypatch.delattr(torch._C._dynamo.guards, "TensorGuards")


def torch_guard_usable() -> bool:
    """Whether this torch's private C tensor guard is built as ``watch.layout_check`` builds it (torch 2.13 yes,
    2.4 no: there ``layout_check`` compares the attributes)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        return bool(TensorGuards(T, dynamic_dims_sizes=None, dynamic_dims_strides=[[None]]).check(T))
    except Exception:  # noqa: BLE001 - any failure of the private API is "not usable"
        return False


def watched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()},
                                   {"params": model[2].parameters(), "weight_decay": 0.0}], lr=1e-3)
    graph_optim.preinitialize(optimizer)
    tensors = [*model.parameters(), *model.buffers(),
               *(v for st in optimizer.state.values() for v in st.values())]
    return model, optimizer, StateWatch([model], [optimizer], [], tensors)


CHANGES = {
    "a parameter replaced": lambda m, o: setattr(m[0], "weight", nn.Parameter(m[0].weight.detach().clone())),
    "a buffer added": lambda m, o: m[2].register_buffer("extra", torch.zeros(1)),
    "a layer replaced": lambda m, o: m.__setitem__(1, nn.BatchNorm1d(8)),
    "evaluation mode": lambda m, o: m.eval(),
    "a parameter frozen": lambda m, o: m[2].bias.requires_grad_(False),
    "a parameter resized in place": lambda m, o: setattr(m[2].bias, "data", torch.zeros(3)),
    "the model in float64 (identities kept)": lambda m, o: m.double(),
    "an optimizer setting": lambda m, o: o.param_groups[1].__setitem__("weight_decay", 0.1),
    "a setting made a tensor": lambda m, o: o.param_groups[0].__setitem__("eps", torch.tensor([1e-8, 1e-8])),
    "a setting removed": lambda m, o: o.param_groups[0].pop("amsgrad"),
    "a parameter moved to the other group": lambda m, o: o.param_groups[1]["params"].insert(
        0, o.param_groups[0]["params"].pop()),
    "a group added": lambda m, o: o.add_param_group({"params": [nn.Parameter(torch.ones(1))]}),
    "the optimizer's state loaded": lambda m, o: o.load_state_dict(o.state_dict()),
    "a state entry rebound": lambda m, o: o.state[m[0].weight].__setitem__("exp_avg", torch.zeros(8, 4)),
    "a state entry added": lambda m, o: o.state[m[0].weight].__setitem__("extra", torch.zeros(1)),
    "a parameter's state removed": lambda m, o: o.state.pop(m[2].bias),
}


@pytest.mark.parametrize("identities", [True, False], ids=["torch's guard manager", "identities in Python"])
@pytest.mark.parametrize("guard", [True, False], ids=["torch's tensor guard", "attributes compared"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_the_state_watch_sees_every_change(change, guard, identities, monkeypatch):
    """With torch's C tensor guard comparing the layouts, and without it (a torch that lacks the private API);
    with torch's guard manager comparing the identities (``state_guard.py``), and in Python."""
    if guard and not torch_guard_usable():
        pytest.skip(f"torch {torch.__version__}'s TensorGuards takes other arguments: the attributes are compared")
    if identities and not state_guard._works():
        pytest.skip(f"torch {torch.__version__}'s guard manager takes other arguments: compared in Python")
    if not guard:
        hide_torch_guard(monkeypatch)
    if not identities:
        monkeypatch.setattr(state_guard, "_works", lambda: False)
    model, optimizer, watch = watched()
    assert (type(watch.layout).__name__ == "builtin_function_or_method") is guard
    fits = watch.check([T])  # what a step calls: the state unchanged and an argument laid out as T
    assert (fits.__module__ == state_guard.__name__) is identities
    assert watch.unchanged() and fits([torch.zeros(2)])
    optimizer.param_groups[0]["lr"] = 0.5  # a graph input, not part of the state
    model[0].weight.data.add_(1.0)  # values change at every step
    assert watch.unchanged() and fits([torch.zeros(2)])
    assert not fits([torch.zeros(3)]) and not fits([torch.zeros(2, dtype=torch.int64)]) and not fits([T, T])
    CHANGES[change](model, optimizer)
    assert not watch.unchanged()
    assert not fits([T])


@pytest.mark.skipif(tracer.TORCH < (2, 13), reason="torch's guard manager took other arguments before")
def test_torch_guard_manager_checks_the_state_where_torch_has_it():
    """Not only where it is imported first: a step's trace has imported Dynamo before the first watch."""
    import torch._dynamo  # noqa: F401

    state_guard._works.cache_clear()
    assert state_guard._works()
    watch = watched()[2]
    assert watch.check([T]).__module__ == state_guard.__name__
    # built once per arguments' layout (milliseconds on a real model): an evaluation's short last batch and
    # the full ones alternate
    assert watch.check([torch.zeros(2)]) is watch.check([T]) is not watch.check([torch.zeros(1)])


@pytest.mark.parametrize("identities", [True, False], ids=["torch's guard manager", "identities in Python"])
def test_a_write_that_changes_nothing_leaves_the_check_passing_again(identities, monkeypatch):
    """A dict written back as it was (a trace swaps the parameters out and back) moves its version: the guard
    built before fails, the state is found unchanged, and the check made then passes (not the stale guard)."""
    if identities and not state_guard._works():
        pytest.skip(f"torch {torch.__version__}'s guard manager takes other arguments: compared in Python")
    if not identities:
        monkeypatch.setattr(state_guard, "_works", lambda: False)
    model, optimizer, watch = watched()
    fits = watch.check([T])
    weight, entry = model[0].weight, optimizer.state[model[0].weight]
    for d, key in ((model[0]._parameters, "weight"), (entry, "exp_avg")):
        d[key], d[key] = None, d[key]  # out and back
    assert watch.unchanged() and fits([T]) is not identities
    assert watch.check([T])([T])
    for _ in range(6):  # written at every step (a user's preinitialize()): not a guard built each time
        model[0]._parameters["weight"], model[0]._parameters["weight"] = None, weight
        fits = watch.check([T])
        assert fits([T])
    assert fits.__module__ == StateWatch.__module__  # compared in Python from then on


def test_steady_steps_take_the_one_call_check(monkeypatch):
    """After the step that follows the trace (which swapped the parameters out and back), every step passes
    the guard manager's check: the watch's Python comparison is not run again."""
    if not state_guard._works():
        pytest.skip(f"torch {torch.__version__}'s guard manager takes other arguments: compared in Python")
    compared = []
    unchanged = StateWatch.unchanged
    monkeypatch.setattr(StateWatch, "unchanged", lambda self: compared.append(1) or unchanged(self))
    weight, steps = sgd_steps(rebind=False, count=8)
    assert steps.traces == 1 and steps.executions == 8 and len(compared) == 1


def low_level_training(tmp_path, change, steps=4):
    """The low-level CSX loop, ``change(model)`` made before step 3 (without retracing)."""
    backend = csf.backend("CSX", compile_dir=str(tmp_path / "compile"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled = csf.compile(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @csf.trace
    def step(x, y):
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss, model[2].bias, model[2].bias[:2], loss * 2

    returned = []
    for i in range(steps):
        if i == 2:
            change(model)
        g = torch.Generator().manual_seed(i)
        returned.append(step(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)))
    return returned


@pytest.mark.parametrize("change, needle", [
    (lambda m: m[2].bias.requires_grad_(False), "state tensor 2.bias: requires_grad True when traced, False now"),
    (lambda m: setattr(m[2].bias, "data", torch.zeros(5)), r"state tensor 2.bias: shape \[4\] float32 when traced, "
                                                           r"shape \[5\] float32 now"),
], ids=["frozen", "resized"])
def test_a_state_tensor_changed_in_place_needs_a_new_graph(tmp_path, change, needle):
    """A parameter frozen (it would go on being updated) or resized in place keeps its identity; the graph
    traced for it does not fit any more: refused, naming the tensor (before issue 52 both went unseen)."""
    with pytest.raises(csf.CompileError, match=f"iteration 3 has different inputs.*{needle}"):
        low_level_training(tmp_path, change)


def test_outputs_sharing_the_state_are_copies_and_the_others_are_not(tmp_path):
    returned = low_level_training(tmp_path, lambda m: None)
    first, last = returned[0], returned[-1]
    # the bias moved at every step, not what step 1 returned of it
    assert not torch.equal(first[1], last[1]) and not torch.equal(first[2], last[2])
    assert torch.equal(first[2], first[1][:2])
    # the graph's own results (loss, loss * 2) are handed out as made; the bias and its view are copied
    gm = make_fx(lambda p, x: (x.sum(), p, p[:2], p.add_(1), x * 2, (x * 3).view(-1)))(torch.ones(3),
                                                                                       torch.ones(2, 2))
    passes.postprocess(gm)
    assert passes.fresh_outputs(gm) == (True, False, False, False, True, True)


def test_the_rate_and_step_inputs_are_the_hosts_at_every_step_even_when_the_graph_writes_into_them():
    """The rate and step tensors are written only when their value changes, or when something wrote into
    them: here the graph itself, which halves its rate input in place at every step."""
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step(x):
        group = optimizer.param_groups[0]
        group["lr"].mul_(0.5)  # the rate, a graph input inside the trace
        return x * group["lr"] + tracer.active().global_step

    steps = StaticStep(step, "step", retrace=False, cache=None, optimizers=[optimizer])
    got = [steps((torch.ones(1),), {}, iteration=i, global_step=g).item() for i, g in enumerate([3, 3, 4], 1)]
    optimizer.param_groups[0]["lr"] = 0.2
    got.append(steps((torch.ones(1),), {}, iteration=4, global_step=4).item())
    assert got == pytest.approx([3.05, 3.05, 4.05, 4.1])
    assert steps.traces == 1


def sgd_steps(rebind: bool, count: int = 4) -> tuple[torch.Tensor, StaticStep]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graph_optim.preinitialize(optimizer)

    def step(x):
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    steps = StaticStep(step, "step", retrace=False, cache=None, modules=[model], optimizers=[optimizer])
    for i in range(count):
        if rebind and i == 2:
            optimizer.param_groups[0]["momentum"] = float("0.9")  # the same value, another object
        steps((torch.full((4, 3), float(i)),), {}, iteration=i + 1, global_step=i)
    return model.weight.detach(), steps


def test_a_setting_rebound_to_an_equal_value_is_the_same_graph():
    """Settings are watched by identity: one rebound to an equal value makes the state be collected again,
    and its signature, compared by value, is the traced one: training goes on as if nothing happened."""
    weight, steps = sgd_steps(rebind=True)
    assert steps.traces == 1 and steps.executions == 4
    assert torch.equal(weight, sgd_steps(rebind=False)[0])


@pytest.mark.parametrize("batch, needle", [
    (torch.ones(4, 3, dtype=torch.float64), r"argument 0 of the step: shape \[4, 3\] float32 when traced, "
                                            r"shape \[4, 3\] float64 now"),
    (torch.ones(5, 3), r"argument 0 of the step: shape \[4, 3\] float32 when traced, shape \[5, 3\] float32 now"),
], ids=["dtype", "shape"])
def test_an_argument_of_another_layout_is_refused_after_steps_that_reused_the_signature(batch, needle):
    def step(x):
        return x * 2

    steps = StaticStep(step, "step", retrace=False, cache=None)
    for i in range(3):  # the second and third reuse the first call's signature
        steps((torch.ones(4, 3),), {}, iteration=i + 1, global_step=i)
    with pytest.raises(csf.CompileError, match=f"iteration 4 has different inputs.*{needle}"):
        steps((batch,), {}, iteration=4, global_step=3)


def test_equal_structures_share_one_generated_rebuilder():
    """A retrace records its output structures anew at every step: generating their code once is enough."""
    first, second = (pytree.tree_flatten(({"loss": T, "n": [T, 3]},))[1] for _ in range(2))
    assert first is not second
    try:
        hash(first)
    except TypeError:
        pytest.skip(f"torch {torch.__version__}'s TreeSpec cannot be hashed: each spec gets its own builder")
    flat.unflatten([T, T, 3], first)
    flat.unflatten([T, T, 3], second)
    assert flat._BUILDERS[id(first)][1] is flat._BUILDERS[id(second)][1]


def test_an_optimizer_registered_after_the_trace_is_refused_naming_the_state(tmp_path):
    """``csf.trace`` hands its step the optimizers it knows at every call: one registered after the trace
    changes the state, which the watch sees (the graph traced without it was called with one input too many)."""
    backend = csf.backend("CSX", compile_dir=str(tmp_path / "compile"))
    model = nn.Linear(8, 4)
    compiled = csf.compile(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @csf.trace
    def step(x):
        compiled(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step(torch.ones(2, 8))
    backend.register_optimizer(torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.5))
    with pytest.raises(csf.CompileError, match="iteration 2 has different inputs.*state tensors changed from 2 to 3"):
        step(torch.ones(2, 8))


@pytest.mark.parametrize("guard", [True, False], ids=["torch's tensor guard", "attributes compared"])
def test_the_arguments_check_fails_for_another_layout_or_a_non_tensor(guard, monkeypatch):
    if not guard:
        hide_torch_guard(monkeypatch)
    fits = args_check([torch.ones(2), torch.ones(3, dtype=torch.int64)])
    assert fits([torch.zeros(2), torch.zeros(3, dtype=torch.int64)])
    for other in ([torch.ones(2), None], [torch.ones(2), 3], [torch.ones(2)], [torch.ones(2), torch.ones(3)],
                  [torch.ones(2, requires_grad=True), torch.ones(3, dtype=torch.int64)],
                  [nn.Parameter(torch.ones(2)), torch.ones(3, dtype=torch.int64)]):
        assert not fits(other)
    assert args_check([torch.ones(2), 3]) is None  # a non-tensor argument: the signature is computed anew
