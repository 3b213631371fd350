"""Graph passes of the emulator's "compiler": clean-up, a canonical form (fingerprint, comparison of
retraces) and the compile report (op counts by kind, memory)."""
from __future__ import annotations

import hashlib
import operator
from collections import Counter
from typing import Sequence

import torch
from torch.fx import GraphModule, Node

from .errors import Where

aten = torch.ops.aten
_ALIASES = {aten.detach.default, aten.alias.default}


def postprocess(gm: GraphModule) -> GraphModule:
    """Drop ``detach``/``alias`` (no autograd runs in the graph) and dead code; in-place updates stay."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ALIASES:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):  # profiler ranges (e.g. around zero_grad): exits, then enters
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "profiler" and not node.users:
            graph.erase_node(node)
    eliminate_dead_code(graph)
    gm.recompile()
    return gm


def _mutates(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


#: Operations whose schema declares a fresh result that may still share its input's memory.
_UNDECLARED_VIEWS = {aten._unsafe_view.default, aten.lift_fresh.default}


def _may_alias(node: Node) -> bool:
    """Whether ``node``'s result may share memory with one of its arguments (a view, an in-place update, one
    result of an operation that returns several, an operation of unknown schema)."""
    if node.target is operator.getitem:
        return True  # the result of the operation it takes it from
    schema = getattr(node.target, "_schema", None)
    return (schema is None or node.target in _UNDECLARED_VIEWS
            or any(r.alias_info is not None for r in schema.returns))


def fresh_outputs(gm: GraphModule) -> tuple[bool, ...]:
    """For each output of the graph: whether it is memory that nothing after the step writes into: shared
    with no input (state, batch) nor constant of the graph, and returned once. The others (an input, a view
    of one, a state tensor updated in place) are copied for the caller, as the state changes in place at the
    next step."""
    shares_input: set[Node] = set()
    output = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            shares_input.add(node)
        elif node.op == "output":
            output = node
        elif _may_alias(node) and any(arg in shares_input for arg in node.all_input_nodes):
            shares_input.add(node)
    if output is None:
        return ()
    results = [a for a in torch.utils._pytree.tree_leaves(output.args[0])]
    counts = Counter(results)
    return tuple(isinstance(r, Node) and r.op == "call_function" and r not in shares_input and counts[r] == 1
                 for r in results)


def eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """Remove operations whose results nothing uses, keeping those that update a tensor in place.

    The step's work is in-place updates whose results are unused (``param.add_``, optimizer state); torch.fx's
    own pass keeps them on newer torch, while on 2.4 it erased them, and with them the whole backward pass.
    """
    for node in reversed(list(graph.nodes)):
        if not node.users and not _mutates(node) and not node.is_impure():
            graph.erase_node(node)


# -- canonical form --------------------------------------------------------------------------------------------

def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")


def _fmt(value, index: dict) -> str:
    if isinstance(value, Node):
        return f"%{index[value]}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_fmt(v, index) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v, index)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return repr(value)


def _tensor_desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _const_desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    data = t.detach().cpu().contiguous()
    digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()[:16]
    return f"{_tensor_desc(t)}#{digest}"


def canonical(gm: GraphModule) -> list[str]:
    """One line per node, independent of node names: what a fingerprint hashes and retraces compare."""
    index: dict[Node, int] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            val = node.meta.get("val")
            lines.append(f"input {_tensor_desc(val)}" + (" grad" if getattr(val, "requires_grad", False) else ""))
        elif node.op == "get_attr":
            lines.append(f"constant {_const_desc(getattr(gm, node.target, None))}")
        elif node.op == "output":
            lines.append(f"output {_fmt(node.args, index)}")
        else:
            lines.append(f"{op_name(node.target)}{_fmt(tuple(node.args), index)}"
                         + (f" {_fmt(dict(node.kwargs), index)}" if node.kwargs else ""))
    return lines


def fingerprint(lines: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]


def wheres(gm: GraphModule) -> list:
    """For each node, the user's line that created it (``node.meta["csf_where"]``), or None."""
    return [node.meta.get("csf_where") for node in gm.graph.nodes]


def first_difference(old: list[str], old_wheres: list, new: list[str], new_wheres: list) -> str:
    """A sentence naming the first operation where two traces differ, with the user's line if known."""
    for i in range(max(len(old), len(new))):
        a = old[i] if i < len(old) else None
        b = new[i] if i < len(new) else None
        if a == b:
            continue
        where = Where(*new_wheres[i]) if i < len(new_wheres) and new_wheres[i] else None
        old_where = Where(*old_wheres[i]) if i < len(old_wheres) and old_wheres[i] else None
        place = f" (this trace: {where}" if where else ""
        if old_where and str(old_where) != str(where):
            place += ("; " if place else " (") + f"first trace: {old_where}"
        place += ")" if place else ""
        return (f"the first differing operation is #{i}: {_short(b)} in this trace, {_short(a)} in the first "
                f"trace{place}")
    return "the traces differ"


def _short(line: str | None) -> str:
    if line is None:
        return "nothing (the trace ended)"
    return line if len(line) <= 140 else line[:137] + "..."


# -- compile report ------------------------------------------------------------------------------------------

_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution", "convolution_backward",
           "_convolution", "addbmm", "dot", "mv", "einsum"}
_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "prod", "norm", "linalg_vector_norm", "var", "std",
              "var_mean", "argmax", "argmin", "_log_softmax", "_softmax", "_log_softmax_backward_data",
              "_softmax_backward_data", "logsumexp", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
              "nll_loss2d_backward", "cumsum", "all", "any"}
_NORM = {"native_layer_norm", "native_layer_norm_backward", "native_batch_norm", "native_batch_norm_backward",
         "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "native_group_norm",
         "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"}
_COPY = {"_to_copy", "clone", "copy_", "copy", "contiguous", "_unsafe_view", "lift_fresh_copy"}
_CREATE = {"zeros", "ones", "full", "empty", "arange", "scalar_tensor", "zeros_like", "ones_like", "full_like",
           "empty_like", "empty_strided", "new_zeros", "new_ones", "new_full", "new_empty", "lift_fresh"}


def op_kind(target) -> str:
    if not isinstance(target, torch._ops.OpOverload):
        return "other"
    name = target._schema.name.split("::")[-1]
    base = name.rstrip("_")
    tags = set(target.tags)
    if "attention" in base:
        return "attention"
    if base in _MATMUL:
        return "matmul"
    if base in _NORM:
        return "normalization"
    if torch.Tag.nondeterministic_seeded in tags or base in ("bernoulli", "native_dropout", "rand", "randn",
                                                             "uniform", "normal"):
        return "random"
    if base.startswith("_amp_") or base.startswith("_foreach"):
        return "fused_update"
    if base in _REDUCTION:
        return "reduction"
    if getattr(target, "is_view", False) or base in ("t", "view", "expand", "permute", "transpose", "split",
                                                      "split_with_sizes", "unsqueeze", "squeeze", "slice", "select",
                                                      "as_strided", "unbind", "reshape"):
        return "view"
    if base in _COPY:
        return "copy_cast"
    if base in _CREATE:
        return "creation"
    if torch.Tag.pointwise in tags or base in ("where", "lerp", "addcmul", "addcdiv", "threshold_backward",
                                               "gelu_backward", "embedding_dense_backward"):
        return "elementwise"
    if base in ("embedding", "index_select", "gather", "scatter", "scatter_add", "index", "index_put",
                "embedding_dense_backward"):
        return "gather_scatter"
    if base in ("cat", "stack"):
        return "concat"
    return "other"


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def analyse(gm: GraphModule, input_kinds: Sequence[tuple[str, bool]]) -> dict:
    """Op counts by kind and by op, and memory: state bytes by kind and a liveness-based activation peak."""
    nodes = list(gm.graph.nodes)
    by_op: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    in_place = 0
    for node in nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        by_op[op_name(node.target)] += 1
        by_kind[op_kind(node.target)] += 1
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            in_place += 1

    memory: Counter[str] = Counter()
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for node, (kind, trainable) in zip(placeholders, input_kinds):
        size = _nbytes(node.meta.get("val"))
        memory[f"{kind}_bytes"] += size
        if trainable:
            memory["gradient_bytes"] += size

    # activation estimate: tensors produced in the graph, live from definition to last use (views and
    # in-place results share storage and add nothing)
    last_use: dict[Node, int] = {}
    for i, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = i
    live, peak = 0, 0
    frees: Counter[int] = Counter()
    for i, node in enumerate(nodes):
        if node.op == "call_function" and node.target is not operator.getitem:
            target = node.target
            aliasing = isinstance(target, torch._ops.OpOverload) and (
                getattr(target, "is_view", False) or target._schema.is_mutable)
            if not aliasing:
                size = _nbytes(node.meta.get("val"))
                live += size
                frees[last_use.get(node, len(nodes))] += size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    memory["activation_bytes_estimate"] = peak
    return {"ops": {"total": sum(by_op.values()), "in_place_updates": in_place,
                    "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
                    "by_op": dict(sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0])))},
            "memory": dict(memory)}
