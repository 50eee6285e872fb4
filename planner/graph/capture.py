"""Capture a model as the division tree of units that the planner and the executor share.

Steps, each small: torch.fx trace → ``BatchInspector`` (node kinds, per-sample shapes, batch
independence) → the DAG of activations (inline values such as weights, shapes and tuples are
recomputed where used, so they add no edges of their own) → ``decompose`` (series, parallel,
opaque) → units: in each series, a heavy op (convolution, linear, pooling, matmul, attention,
normalisation) starts a unit and the light ops after it (BatchNorm, activations, dropout,
reshapes, scaling) join it, as the paper bundles them. Each unit becomes a small
GraphModule that shares the model's weights; each parallel block gets a ``Join`` that folds
a branch's sub-batch into the join buffer.

The pure tree (``core.tree``, no torch) names every unit; ``Capture.units`` and
``Capture.joins`` (``core.units``, what the executor reads) map those names to what runs them.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from core.errors import ModelError, TraceError
from planner.graph.decompose import DItem, DOp, DOpaque, DParallel, DSeries, decompose, walk_vertices
from planner.graph.inspect import PARTS, BatchInspector, NodeInfo, describe, module_path
from core.loaded import LoadedModel
from core.units import MODULE_GATE, Capture, Join, Unit, op_chain
from core.tree import Layer, Parallel, Series

HEAVY_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd, nn.Linear, nn.Bilinear, nn.Embedding,
    nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._LPPoolNd, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.instancenorm._InstanceNorm, nn.MultiheadAttention, nn.Upsample,
)
HEAVY_FUNCTIONS: frozenset[Any] = frozenset({
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    torch.conv1d, torch.conv2d, torch.conv3d, F.linear, F.bilinear, torch.matmul, torch.bmm,
    torch.mm, torch.einsum, torch.baddbmm, torch.addmm, operator.matmul,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
    torch.max_pool1d, torch.max_pool2d, torch.max_pool3d, torch.avg_pool1d,
    F.layer_norm, F.group_norm, F.instance_norm, F.local_response_norm,
    F.scaled_dot_product_attention, F.interpolate, F.embedding,
})
HEAVY_METHODS = frozenset({"matmul", "bmm", "mm"})
ADD_TARGETS = frozenset({operator.add, operator.iadd, torch.add, "add", "add_"})
MUL_TARGETS = frozenset({operator.mul, operator.imul, torch.mul, "mul", "mul_"})


IN_PLACE_OPERATORS: dict[Any, Any] = {operator.iadd: operator.add, operator.isub: operator.sub,
                                       operator.imul: operator.mul,
                                       operator.itruediv: operator.truediv}


def _new_tensor_twin(target: Any) -> Any:
    """The op that computes what the in-place ``target`` computes into a new tensor, or None
    (``torch.relu_`` -> ``torch.relu``, ``F.relu_`` -> ``F.relu``, ``operator.iadd`` -> add)."""
    if target in IN_PLACE_OPERATORS:
        return IN_PLACE_OPERATORS[target]
    name = getattr(target, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return None
    for namespace in (torch, F):
        if getattr(namespace, name, None) is target and callable(getattr(namespace, name[:-1], None)):
            return getattr(namespace, name[:-1])
    return None


def _inplace_argument(node: fx.Node) -> inspect.BoundArguments | None:
    """A call's arguments bound to its signature, when it was given ``inplace=True`` (by
    keyword or position); else None."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return bound if bound.arguments.get("inplace") is True else None


def _without_inplace(node: fx.Node) -> bool:
    """Set a call's ``inplace=True`` argument to False; whether it had one."""
    bound = _inplace_argument(node)
    if bound is None:
        return False
    bound.arguments["inplace"] = False
    node.args, node.kwargs = tuple(bound.args), dict(bound.kwargs)
    return True


def _writes_in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes its result into its first argument (and returns it)."""
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", None) is True
    if node.op == "call_function":
        return _new_tensor_twin(node.target) is not None or _inplace_argument(node) is not None
    if node.op == "call_method":
        name = str(node.target)
        return (name.endswith("_") and not name.endswith("__")
                and callable(getattr(torch.Tensor, name[:-1], None)))
    return False


def only_writes_its_input(gm: fx.GraphModule) -> bool:
    """Whether a unit is a chain of in-place ops on its input: run as the model runs it, its
    output is its input."""
    nodes = op_chain(gm)
    return bool(nodes) and all(_writes_in_place(gm, n) for n in nodes)


def write_new_tensors(gm: fx.GraphModule) -> bool:
    """Make the ops of a unit that write into its input in place (the ReLU(inplace=True) after
    a residual add, ``x.relu_()``, ``x += ...``) compute a new tensor instead; whether any did.

    The walk counts a new output buffer for every unit and frees the input chunk once read;
    an output that is its input would pin the chunk, so the executor would have to copy it
    (one more pass over the activation). Written into a new tensor, the values are the same
    and the memory is what the walk counts. Only for a unit that is the one reader of its
    input (the caller checks): no one else could see the difference."""
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    changed = False
    for node in list(x.users):
        if not node.args or node.args[0] is not x or not _writes_in_place(gm, node):
            continue
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if next(iter(module.parameters()), None) is not None \
                    or next(iter(module.buffers()), None) is not None:
                continue  # a module with state is not copied: its output is copied instead
            twin = copy.deepcopy(module)
            twin.inplace = False
            node.target = f"{str(node.target).replace('.', '_')}_new_tensor"
            gm.add_submodule(node.target, twin)
        elif node.op == "call_function":
            twin = _new_tensor_twin(node.target)
            if twin is not None:
                node.target = twin
            else:
                _without_inplace(node)
        else:  # a method such as relu_: its twin without the underscore
            node.target = str(node.target)[:-1]
        changed = True
    if changed:
        gm.recompile()
    return changed


def _is_heavy(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), HEAVY_MODULES)
    if node.op == "call_function":
        return node.target in HEAVY_FUNCTIONS
    if node.op == "call_method":
        return node.target in HEAVY_METHODS
    return False


def _reads_shape(node: fx.Node) -> bool:
    """``x.size()``, ``x.size(d)``, ``x.shape``, ``x.dim()`` of a tensor: metadata, not data."""
    if node.op == "call_method" and node.target in ("size", "dim"):
        return True
    return (node.op == "call_function" and node.target is getattr and len(node.args) == 2
            and node.args[1] in ("shape", "ndim"))


def _batch_shape(x: torch.Tensor, shape: tuple[int, ...], dim: int | None = None) -> Any:
    """The shape of an activation with per-sample ``shape`` holding as many samples as ``x``."""
    full = torch.Size((x.shape[0], *shape))
    return full if dim is None else full[dim]


def _op_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    fname = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "op")
    path = module_path(node)
    return f"{path}.{fname}" if path else str(fname)


def _common_path(nodes: Sequence[fx.Node]) -> str:
    paths = [module_path(n).split(".") for n in nodes if module_path(n)]
    if not paths:
        return ""
    prefix = paths[0]
    for p in paths[1:]:
        i = 0
        while i < min(len(prefix), len(p)) and prefix[i] == p[i]:
            i += 1
        prefix = prefix[:i]
    return ".".join(prefix)


def trace(loaded: LoadedModel) -> fx.GraphModule:
    """torch.fx symbolic trace, translated into a TraceError that says what to do; alone in the
    process (``MODULE_GATE``)."""
    try:
        with MODULE_GATE.tracing():
            gm = fx.symbolic_trace(loaded.module)
    except Exception as exc:
        raise TraceError(
            f"torch.fx cannot trace {loaded.spec.name!r}: {type(exc).__name__}: {exc}. Models whose "
            "control flow depends on tensor values cannot be planned; move that logic out of "
            "forward() or wrap it in a leaf module") from exc
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


class _Builder:
    """Turns the decomposed DAG of one traced model into units, joins and the pure tree."""

    def __init__(self, gm: fx.GraphModule, infos: dict[fx.Node, NodeInfo]) -> None:
        self.gm = gm
        self.infos = infos
        self.modules = dict(gm.named_modules())
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.nodes = list(gm.graph.nodes)
        self.units: dict[str, Unit] = {}
        self.joins: dict[str, Join] = {}
        self.owner: dict[str, str] = {}
        self.names: set[str] = set()

    # ---- the DAG of activations
    def act_inputs(self, node: fx.Node) -> list[fx.Node]:
        """Activations a node reads, directly or through inline values (tuples, arithmetic).

        Reading only the shape of an activation is no dependency: every activation holds
        the same samples, so its shape is its static per-sample shape behind the batch size
        of whatever the unit reads (see ``_batch_shape``).
        """
        seen: list[fx.Node] = []
        stack = [a for a in node.all_input_nodes] if not _reads_shape(node) else []
        visited: set[fx.Node] = set()
        while stack:
            a = stack.pop()
            if a in visited:
                continue
            visited.add(a)
            if self.infos[a].activation:
                if a not in seen:
                    seen.append(a)
            elif not _reads_shape(a):
                stack.extend(a.all_input_nodes)
        return sorted(seen, key=self.order.__getitem__)

    def inline_closure(self, nodes: Sequence[fx.Node]) -> list[fx.Node]:
        """The inline values a set of nodes needs, recomputed inside the unit that runs them."""
        need: set[fx.Node] = set()
        stack = [a for n in nodes for a in n.all_input_nodes]
        while stack:
            a = stack.pop()
            if a in need or self.infos[a].activation:
                continue
            need.add(a)
            if not _reads_shape(a):
                stack.extend(a.all_input_nodes)
        return sorted(need, key=self.order.__getitem__)

    def copy_nodes(self, g: fx.Graph, env: dict[fx.Node, fx.Node], nodes: Sequence[fx.Node],
                   batch_from: fx.Node) -> None:
        """Copy nodes into ``g``; a shape read of a tensor not in ``env`` is rebuilt from the
        static per-sample shape and the batch size of ``batch_from`` (a node of ``g``)."""
        for n in nodes:
            if _reads_shape(n) and n.args[0] not in env:
                shape = self.infos[n.args[0]].shape
                dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
                env[n] = g.call_function(_batch_shape, (batch_from, shape, dim))
            else:
                env[n] = g.node_copy(n, lambda a: env[a])

    def unique(self, name: str) -> str:
        name = name or "unit"
        out, k = name, 2
        while out in self.names:
            out, k = f"{name}_{k}", k + 1
        self.names.add(out)
        return out

    # ---- joins
    def join_kind(self, join: fx.Node, fork: fx.Node, exits: Sequence[fx.Node],
                  identity: bool) -> tuple[str, list[fx.Node | None]] | None:
        ends = set(exits) | ({fork} if identity else set())
        if set(self.act_inputs(join)) != ends:
            return None

        def branch_of(a: Any) -> fx.Node | None | bool:
            if isinstance(a, fx.Node) and a in exits:
                return a
            if a is fork and identity:
                return None
            return False

        target = join.target
        if join.op == "call_function" and target is torch.cat:
            seq = join.args[0] if join.args else join.kwargs.get("tensors")
            dim = join.args[1] if len(join.args) > 1 else join.kwargs.get("dim", 0)
            if not isinstance(seq, (list, tuple)) or not isinstance(dim, int):
                return None
            order = [branch_of(a) for a in seq]
            rank = len(self.infos[join].shape) + 1
            if dim % rank == 0 or False in order or len(set(map(id, order))) != len(order):
                return None
            if len(order) != len(exits) + (1 if identity else 0):
                return None
            return "cat", order  # type: ignore[return-value]
        operands = [a for a in join.args if isinstance(a, fx.Node)]
        if join.op in ("call_function", "call_method") and (target in ADD_TARGETS or target in MUL_TARGETS):
            if len(join.args) == 2 and len(operands) == 2 and not join.kwargs:
                order = [branch_of(a) for a in operands]
                if False not in order and len(set(map(id, order))) == 2:
                    shapes = {self.infos[a].shape if a is not None else self.infos[fork].shape
                              for a in order}  # type: ignore[union-attr]
                    if target in ADD_TARGETS and shapes == {self.infos[join].shape}:
                        return "add", order  # type: ignore[return-value]
                    if target in MUL_TARGETS and identity and len(exits) == 1:
                        return "mul", order  # type: ignore[return-value]
        if identity and len(exits) == 1:  # any op of the fork and one branch
            return (getattr(target, "__name__", str(target)), [exits[0], None])
        return None

    def make_join(self, name: str, item: DParallel, vertex: Callable[[int], fx.Node]) -> Join:
        join = vertex(item.join)
        fork = vertex(item.fork)
        shape = self.infos[join].shape
        cl = self.infos[join].channels_last
        kind = item.join_kind
        order = [vertex(e) if e is not None else None for e in item.exits]
        if kind == "cat":
            rank = len(shape) + 1
            dim = join.args[1] if len(join.args) > 1 else join.kwargs.get("dim", 0)
            dim = int(dim) % rank  # type: ignore[arg-type]
            slices, start = [], 0
            for e in order:
                length = (self.infos[e] if e is not None else self.infos[fork]).shape[dim - 1]
                slices.append((start, length))
                start += length
            return Join(name, "cat", shape, dim=dim, slices=tuple(slices), channels_last=cl)
        if kind == "add":
            return Join(name, "add", shape, channels_last=cl)
        if kind == "mul":
            operands = [a for a in join.args if isinstance(a, fx.Node)]
            return Join(name, "mul", shape, fork_first=(operands[0] is fork,), channels_last=cl)
        # Any other op of (fork, branch output): a GraphModule with those two inputs.
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {fork: g.placeholder("fork"), order[0]: g.placeholder("y")}
        self.copy_nodes(g, env, self.inline_closure([join]) + [join], env[fork])
        g.output(env[join])
        return Join(name, kind, shape, apply=fx.GraphModule(self.gm, g), channels_last=cl)

    # ---- units
    def make_unit(self, nodes: Sequence[fx.Node], source: fx.Node, kind: str) -> Layer:
        heads = [n for n in nodes if _is_heavy(n, self.modules)]
        if kind == "opaque":
            base = _common_path(nodes) or _op_name(nodes[0])
        else:
            base = _op_name(heads[0] if heads else nodes[0])
        name = self.unique(base)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {source: g.placeholder("x")}
        inside = set(nodes)
        body = sorted(set(self.inline_closure(nodes)) | inside, key=self.order.__getitem__)
        for n in body:
            for a in self.act_inputs(n):
                if a not in inside and a is not source:
                    raise TraceError(f"{describe(n)} reads {describe(a)}, which is neither its unit's "
                                     f"input nor inside unit {name!r}; please report this model")
        self.copy_nodes(g, env, body, env[source])
        g.output(env[nodes[-1]])
        module = fx.GraphModule(self.gm, g)
        in_bytes, out_bytes = self.infos[source].bytes_per_sample, self.infos[nodes[-1]].bytes_per_sample
        in_place = None
        if all(u in inside for u in source.users if not _reads_shape(u)):  # its input is its own
            if kind == "layer" and in_bytes == out_bytes and only_writes_its_input(module):
                in_place = fx.GraphModule(self.gm, copy.deepcopy(g))
            write_new_tensors(module)
        ops = tuple(n.name for n in nodes)
        for n in nodes:
            self.owner[n.name] = name
        self.units[name] = Unit(name, module, self.infos[nodes[-1]].shape, ops,
                               channels_last=self.infos[nodes[-1]].channels_last,
                               in_place=in_place)
        return Layer(name=name, in_bytes=in_bytes, out_bytes=out_bytes, kind=kind, ops=ops,
                     inplace=in_place is not None)

    def series(self, ds: DSeries, source: fx.Node, name: str,
               vertex: Callable[[int], fx.Node]) -> Series:
        children: list[Layer | Parallel | Series] = []
        run: list[fx.Node] = []
        current = source  # the tensor the next unit reads

        def flush() -> None:
            nonlocal run, current
            if not run:
                return
            # A heavy op starts a unit; the light ops after it join that unit.
            groups: list[list[fx.Node]] = []
            for n in run:
                if not groups or _is_heavy(n, self.modules):
                    groups.append([n])
                else:
                    groups[-1].append(n)
            for grp in groups:
                children.append(self.make_unit(grp, current, "layer"))
                current = grp[-1]
            run = []

        for it in ds.items:
            if isinstance(it, DOp):
                run.append(vertex(it.vertex))
                continue
            flush()
            if isinstance(it, DOpaque):
                children.append(self.make_unit([vertex(v) for v in it.vertices], current, "opaque"))
            else:
                children.append(self.parallel(it, vertex))
            current = vertex(it.sink if isinstance(it, DOpaque) else it.join)
        flush()
        return Series(name=name, children=tuple(children))

    def parallel(self, item: DParallel, vertex: Callable[[int], fx.Node]) -> Parallel:
        members = [vertex(v) for b in item.branches for v in _vertices(b)] + [vertex(item.join)]
        name = self.unique(_common_path(members) or _op_name(vertex(item.join)))
        fork = vertex(item.fork)
        branches = []
        for i, b in enumerate(item.branches):
            if not b.items:
                branches.append(Series(name=self.unique(f"{name}.identity"), children=()))
                continue
            bnodes = [vertex(v) for v in _vertices(b)]
            bpath = _common_path(bnodes)
            bname = self.unique(bpath if bpath and bpath != name else f"{name}.branch{i}")
            branches.append(self.series(b, fork, bname, vertex))
        self.joins[name] = self.make_join(name, item, vertex)
        self.owner[vertex(item.join).name] = name
        return Parallel(name=name, in_bytes=self.infos[fork].bytes_per_sample,
                        out_bytes=self.infos[vertex(item.join)].bytes_per_sample,
                        branches=tuple(branches), join=item.join_kind)


def _vertices(item: DItem | DSeries) -> list[int]:
    return walk_vertices(item)


def capture(loaded: LoadedModel) -> Capture:
    """Trace, inspect, decompose and build the units of a loaded model."""
    name = loaded.spec.name
    x = loaded.example(sum(PARTS))
    try:
        with torch.inference_mode(), MODULE_GATE.running():
            expected = loaded.module(x)
    except Exception as exc:
        raise ModelError(f"{name!r} rejects input of shape {tuple(x.shape[1:])} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                         "pass --input-shape with the shape the model takes, without the batch") from exc
    if not isinstance(expected, torch.Tensor):
        raise ModelError(f"{name!r} returns a {type(expected).__name__}; vbs-serve serves models "
                         "that return one tensor (put the model in eval mode)")
    gm = trace(loaded)
    with MODULE_GATE.running():
        infos = BatchInspector(gm).inspect(x)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise TraceError(f"{name!r} takes {len(placeholders)} inputs; vbs-serve plans single-input models")
    output = next(n for n in nodes if n.op == "output")
    result = output.args[0]
    if not isinstance(result, fx.Node) or not infos[result].activation:
        raise TraceError(f"{name!r} does not return one activation tensor")
    b = _Builder(gm, infos)
    acts = [n for n in nodes if infos.get(n, NodeInfo(False)).activation]
    # Keep only activations on a path to the output (the rest cannot change the result).
    alive: set[fx.Node] = {result}
    for n in reversed(acts):
        if n in alive:
            alive.update(b.act_inputs(n))
    acts = [n for n in acts if n in alive]
    index = {n: i for i, n in enumerate(acts)}
    preds = {index[n]: [index[a] for a in b.act_inputs(n)] for n in acts}
    source, sink = index[placeholders[0]], index[result]

    def vertex(i: int) -> fx.Node:
        return acts[i]

    def join_kind(f: int, j: int, exits: Sequence[int], identity: bool) -> Any:
        verdict = b.join_kind(acts[j], acts[f], [acts[e] for e in exits], identity)
        if verdict is None:
            return None
        kind, order = verdict
        return kind, [index[e] if e is not None else None for e in order]

    tree = decompose([i for i in range(len(acts)) if i != source], preds, source, sink, join_kind)
    root = b.series(tree, placeholders[0], name, vertex)
    loaded_out = tuple(expected.shape[1:])
    return Capture(model=loaded, graph=gm, tree=root, units=b.units, joins=b.joins,
                   output_shape=loaded_out, ops=b.owner)

