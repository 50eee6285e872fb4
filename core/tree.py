"""The division tree and the Profile: plain data, no torch, so the solver starts fast.

A tree is made of four kinds of node (schema ``vbs.profile/1``, docs/architecture.md, Contracts):

- ``Layer``  (kind ``layer`` or ``opaque``): one unit run as a whole; ``time[b-1]`` is the
  total seconds to run b samples at once, ``ws[b-1]`` the workspace bytes at batch b;
  an optional ``energy[b-1]`` (same shape as ``time``) lets the solver minimise energy;
  ``inplace`` (optional, false) marks a unit that only writes into its input, such as the
  in-place ReLU after a residual add: run on every sample of a buffer nobody else reads,
  its output is that buffer (the executor's walk counts no new output then).
  With unit runtimes (``core.runtimes``): ``runtimes`` holds each runtime's own
  measurements (``time``: one call on b samples; ``ws``), ``unsupported`` why a runtime
  cannot take the unit, and ``runtime[b-1]`` which runtime ``time``/``ws`` are of: the
  fastest at b (for ONNX Runtime its time inside a run of units, the call's fixed cost
  ``meta.runtimes.onnxruntime.call_s`` taken off, since a run pays it once).
- ``Series``: children run one after the other; each child's ``out`` is the next one's ``in``.
- ``Parallel``: a fork tensor (``in`` bytes per sample) read by every branch, and a join
  tensor (``out`` bytes per sample) that each branch folds its output into (``join`` says
  how: ``cat`` into channel slices, ``add`` by accumulation, or any other op applied with
  the fork, such as the ``mul`` of squeeze-and-excitation). ``time[b-1]``, when measured,
  is the cost of folding b samples into the join buffer; it defaults to zero. ``runtimes``
  and ``unsupported`` as for a unit (a block runs whole inside one runtime's run of units).

Sizes are bytes per sample; activations scale linearly with the number of samples.
A tree without ``time``/``ws`` (``vbs graph``) is the same shape with those left empty.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from core.errors import ProfileError

SCHEMA = "vbs.profile/1"


@dataclass(frozen=True)
class Measured:
    """One runtime's measurements of a node: seconds for b samples at once (a unit: one call;
    a block: its folds) and, for a unit, its workspace bytes."""

    time: tuple[float, ...]
    ws: tuple[int, ...] = ()


Runtimes = tuple[tuple[str, Measured], ...]  # (runtime, its measurements), in a fixed order


@dataclass(frozen=True)
class Layer:
    """A unit run as a whole: one heavy op and the light ops after it, or an opaque region."""

    name: str
    in_bytes: int
    out_bytes: int
    time: tuple[float, ...] = ()
    ws: tuple[int, ...] = ()
    kind: str = "layer"  # "layer" | "opaque"
    ops: tuple[str, ...] = ()  # the traced ops it runs, for display only
    energy: tuple[float, ...] = ()  # joules for b samples at once, where a counter exists
    # it only writes into its input (the in-place ReLU after a residual add): run on every
    # sample of a buffer nobody else reads, its output is that buffer and it allocates nothing
    inplace: bool = False
    runtimes: Runtimes = ()  # each runtime's measurements
    unsupported: tuple[tuple[str, str], ...] = ()  # (runtime, why it cannot take the unit)
    runtime: tuple[str, ...] = ()  # per b: the runtime ``time`` and ``ws`` are of

    def measured(self, runtime: str) -> Measured | None:
        for name, figures in self.runtimes:
            if name == runtime:
                return figures
        return None

    def runtime_at(self, b: int) -> str:
        """The runtime ``time``/``ws`` are of at b samples ('' when the profile names none)."""
        return self.runtime[b - 1] if self.runtime else ""


@dataclass(frozen=True)
class Series:
    """Children run one after the other."""

    name: str
    children: tuple["Node", ...]

    @property
    def in_bytes(self) -> int:
        return self.children[0].in_bytes if self.children else 0

    @property
    def out_bytes(self) -> int:
        return self.children[-1].out_bytes if self.children else 0


@dataclass(frozen=True)
class Parallel:
    """A fork read by every branch and a join built in place from the branch outputs."""

    name: str
    in_bytes: int
    out_bytes: int
    branches: tuple[Series, ...]
    join: str = "cat"
    time: tuple[float, ...] = ()
    energy: tuple[float, ...] = ()  # joules to fold b samples into the join, when measured
    runtimes: Runtimes = ()  # each runtime's fold times, measured with its units
    unsupported: tuple[tuple[str, str], ...] = ()  # (runtime, why it cannot run the block whole)

    def measured(self, runtime: str) -> Measured | None:
        for name, figures in self.runtimes:
            if name == runtime:
                return figures
        return None


Node = Union[Layer, Series, Parallel]


@dataclass(frozen=True)
class Profile:
    """A division tree with measured time and workspace for every batch size 1..batch_max."""

    batch_max: int
    root: Series
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def fingerprint(self) -> str:
        return str(self.meta.get("fingerprint", ""))

    @property
    def granule(self) -> int:
        """Bytes the device's allocator rounds every allocation up to (512 for CUDA's caching
        allocator, 1 on CPU): from ``meta["alloc_granule"]``, else from ``meta["device"]``."""
        from core.sizes import granule_for

        given = self.meta.get("alloc_granule")
        if isinstance(given, int) and not isinstance(given, bool) and given >= 1:
            return given
        return granule_for(str(self.meta.get("device", "cpu")))


# --------------------------------------------------------------------------- walking


def iter_layers(node: Node) -> Iterator[Layer]:
    """Every unit of a tree in execution order (branches one after another)."""
    if isinstance(node, Layer):
        yield node
    elif isinstance(node, Series):
        for child in node.children:
            yield from iter_layers(child)
    else:
        for branch in node.branches:
            yield from iter_layers(branch)


def fold_order(block: Parallel) -> tuple[int, ...]:
    """The order in which a block's branches run and fold into its join.

    Branches run in their order, but an ``add`` join folds its identity branches (which run
    nothing) last: then the first fold is a branch's output, which the join can take over as
    its buffer instead of copying it (``core.units.Join.fold``). Every ``add`` join
    has two operands, and IEEE addition of two numbers does not depend on their order, so the
    result is bit for bit the model's. No step of a program belongs to an identity branch, so
    a program's steps are in this order as much as in the branches' own."""
    indices = range(len(block.branches))
    if block.join != "add":
        return tuple(indices)
    return (tuple(i for i in indices if block.branches[i].children)
            + tuple(i for i in indices if not block.branches[i].children))


def iter_nodes(node: Node) -> Iterator[Node]:
    """Every node of a tree, parents before children."""
    yield node
    if isinstance(node, Series):
        for child in node.children:
            yield from iter_nodes(child)
    elif isinstance(node, Parallel):
        for branch in node.branches:
            yield from iter_nodes(branch)


# --------------------------------------------------------------------------- JSON


def node_to_json(node: Node, *, measured: bool = True) -> dict[str, Any]:
    """One node as its JSON (``vbs.profile/1``); ``measured=False`` leaves out time and ws."""
    if isinstance(node, Layer):
        out: dict[str, Any] = {"kind": node.kind, "name": node.name, "in": node.in_bytes,
                               "out": node.out_bytes}
        if measured:
            out["time"] = list(node.time)
            out["ws"] = list(node.ws)
            if node.energy:
                out["energy"] = list(node.energy)
        if node.ops:
            out["ops"] = list(node.ops)
        if node.inplace:
            out["inplace"] = True
        if measured:
            _runtimes_to_json(node, out)
        return out
    if isinstance(node, Series):
        return {"kind": "series", "name": node.name,
                "children": [node_to_json(c, measured=measured) for c in node.children]}
    out = {"kind": "parallel", "name": node.name, "in": node.in_bytes, "out": node.out_bytes,
           "join": node.join,
           "branches": [node_to_json(b, measured=measured) for b in node.branches]}
    if measured and node.time:
        out["time"] = list(node.time)
    if measured and node.energy:
        out["energy"] = list(node.energy)
    if measured:
        _runtimes_to_json(node, out)
    return out


def _runtimes_to_json(node: Layer | Parallel, out: dict[str, Any]) -> None:
    if isinstance(node, Layer) and node.runtime:
        out["runtime"] = list(node.runtime)
    if node.runtimes:
        out["runtimes"] = {name: {"time": list(m.time), **({"ws": list(m.ws)} if m.ws else {})}
                           for name, m in node.runtimes}
    if node.unsupported:
        out["unsupported"] = dict(node.unsupported)


def _runtimes_from_json(raw: dict[str, Any], where: str, batch_max: int | None, *,
                        unit: bool) -> dict[str, Any]:
    """The runtime fields of a node (all optional), checked like ``time`` and ``ws``."""
    fields: dict[str, Any] = {}
    given = raw.get("runtimes")
    if given is not None:
        if not isinstance(given, dict):
            raise ProfileError(f"{where}: 'runtimes' must be an object of runtime -> measurements")
        runtimes = []
        for name, m in given.items():
            if not isinstance(m, dict):
                raise ProfileError(f"{where}: runtimes[{name!r}] must be an object with 'time'")
            here = f"{where} runtimes[{name!r}]"
            time = _numbers(m, "time", here, batch_max, whole=False)
            ws = _numbers(m, "ws", here, batch_max, whole=True) if unit else ()
            runtimes.append((str(name), Measured(time, ws)))
        fields["runtimes"] = tuple(runtimes)
    why = raw.get("unsupported")
    if why is not None:
        if not isinstance(why, dict) or not all(isinstance(v, str) for v in why.values()):
            raise ProfileError(f"{where}: 'unsupported' must map runtimes to reasons")
        fields["unsupported"] = tuple((str(k), v) for k, v in why.items())
    chosen = raw.get("runtime")
    if unit and chosen is not None:
        if not isinstance(chosen, list) or not all(isinstance(v, str) for v in chosen) or (
                batch_max is not None and len(chosen) != batch_max):
            raise ProfileError(f"{where}: 'runtime' must list a runtime name for each b")
        fields["runtime"] = tuple(chosen)
    return fields


def _need(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ProfileError(f"{where}: missing field {key!r}; see the vbs.profile/1 schema in docs/architecture.md")
    return obj[key]


def _size(obj: dict[str, Any], key: str, where: str) -> int:
    value = _need(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ProfileError(f"{where}: {key!r} must be a non-negative number of bytes, got {value!r}")
    if float(value) != int(value):
        raise ProfileError(f"{where}: {key!r} must be a whole number of bytes, got {value!r}")
    return int(value)


def _series_of(raw: Any, where: str, batch_max: int | None) -> Series:
    node = node_from_json(raw, batch_max=batch_max, where=where)
    if isinstance(node, Series):
        return node
    return Series(name=node.name, children=(node,))


def _numbers(obj: dict[str, Any], key: str, where: str, batch_max: int | None,
             *, whole: bool) -> tuple[Any, ...]:
    values = obj.get(key)
    if values is None:
        if batch_max is None:
            return ()
        raise ProfileError(f"{where}: missing {key!r}, a list of {batch_max} values (b = 1..{batch_max})")
    if not isinstance(values, list):
        raise ProfileError(f"{where}: {key!r} must be a list, got {type(values).__name__}")
    if batch_max is not None and len(values) != batch_max:
        raise ProfileError(f"{where}: {key!r} has {len(values)} values, batch_max is {batch_max}: "
                           f"give one value for every batch size 1..{batch_max}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v:
            raise ProfileError(f"{where}: {key!r} holds {v!r}; every value must be a non-negative number")
    return tuple(int(v) for v in values) if whole else tuple(float(v) for v in values)


def _optional_numbers(obj: dict[str, Any], key: str, where: str,
                      batch_max: int | None) -> tuple[float, ...]:
    """An optional per-batch list (``energy``): absent is empty, present is checked like time."""
    if obj.get(key) is None:
        return ()
    return _numbers(obj, key, where, batch_max, whole=False)


def node_from_json(raw: Any, *, batch_max: int | None = None, where: str = "root") -> Node:
    """Parse and check one NODE; ``batch_max=None`` accepts a tree without measurements."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: a node must be a JSON object, got {type(raw).__name__}")
    kind = _need(raw, "kind", where)
    name = str(raw.get("name", where))
    here = f"{where} ({name})" if name != where else where
    if kind in ("layer", "opaque"):
        inplace = raw.get("inplace", False)
        if not isinstance(inplace, bool):
            raise ProfileError(f"{here}: 'inplace' must be true or false, got {inplace!r}")
        layer = Layer(name=name, in_bytes=_size(raw, "in", here), out_bytes=_size(raw, "out", here),
                      time=_numbers(raw, "time", here, batch_max, whole=False),
                      ws=_numbers(raw, "ws", here, batch_max, whole=True), kind=kind,
                      ops=tuple(str(op) for op in raw.get("ops", ())),
                      energy=_optional_numbers(raw, "energy", here, batch_max), inplace=inplace,
                      **_runtimes_from_json(raw, here, batch_max, unit=True))
        if inplace and layer.in_bytes != layer.out_bytes:
            raise ProfileError(f"{here}: an 'inplace' unit writes its output into its input, so "
                               f"'in' and 'out' must be equal ({layer.in_bytes} != {layer.out_bytes})")
        return layer
    if kind == "series":
        children_raw = _need(raw, "children", here)
        if not isinstance(children_raw, list):
            raise ProfileError(f"{here}: 'children' must be a list")
        children = tuple(node_from_json(c, batch_max=batch_max, where=f"{here}.children[{i}]")
                         for i, c in enumerate(children_raw))
        for a, b in zip(children, children[1:]):
            if a.out_bytes != b.in_bytes:
                raise ProfileError(
                    f"{here}: {a.name!r} puts out {a.out_bytes} bytes per sample but the next child "
                    f"{b.name!r} takes {b.in_bytes}; in a series each child's out must equal the next in")
        return Series(name=name, children=children)
    if kind == "parallel":
        branches_raw = _need(raw, "branches", here)
        if not isinstance(branches_raw, list) or not branches_raw:
            raise ProfileError(f"{here}: 'branches' must be a non-empty list")
        branches = tuple(_series_of(b, f"{here}.branches[{i}]", batch_max)
                         for i, b in enumerate(branches_raw))
        time = tuple(float(t) for t in raw["time"]) if "time" in raw else ()
        if time and batch_max is not None and len(time) != batch_max:
            raise ProfileError(f"{here}: 'time' has {len(time)} values, batch_max is {batch_max}")
        return Parallel(name=name, in_bytes=_size(raw, "in", here), out_bytes=_size(raw, "out", here),
                        branches=branches, join=str(raw.get("join", "cat")), time=time,
                        energy=_optional_numbers(raw, "energy", here, batch_max),
                        **_runtimes_from_json(raw, here, batch_max, unit=False))
    raise ProfileError(f"{here}: unknown kind {kind!r}; use layer, opaque, series or parallel")


def profile_to_json(profile: Profile) -> dict[str, Any]:
    return {"schema": SCHEMA, "batch_max": profile.batch_max, "meta": profile.meta,
            "root": node_to_json(profile.root)}


def profile_from_json(raw: Any) -> Profile:
    """Parse and check a Profile; hand-written ones (a chain of layers) are accepted too."""
    if not isinstance(raw, dict):
        raise ProfileError("a profile must be a JSON object with schema, batch_max and root")
    schema = raw.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ProfileError(f"unsupported profile schema {schema!r}; this vbs reads {SCHEMA!r}")
    batch_max = raw.get("batch_max")
    if isinstance(batch_max, bool) or not isinstance(batch_max, int) or batch_max < 1:
        raise ProfileError(f"'batch_max' must be a whole number >= 1, got {batch_max!r}")
    root_raw = _need(raw, "root", "profile")
    if isinstance(root_raw, list):  # a bare chain of layers is a series
        root_raw = {"kind": "series", "name": "root", "children": root_raw}
    root = _series_of(root_raw, "root", batch_max)
    if not any(True for _ in iter_layers(root)):
        raise ProfileError("the profile has no layers")
    names = [n.name for n in iter_layers(root)]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ProfileError(f"layer names must be unique; repeated: {sorted(dup)[:5]}")
    meta = raw.get("meta") or {}
    if not isinstance(meta, dict):
        raise ProfileError("'meta' must be a JSON object")
    return Profile(batch_max=batch_max, root=root, meta=meta)


def load_profile(path: str | Path) -> Profile:
    """Read a Profile JSON file; every problem is a ProfileError naming the file."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"no profile at {p}; make one with `vbs profile --out {p}`") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile {p}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{p} is not valid JSON: {exc}") from exc
    try:
        return profile_from_json(raw)
    except ProfileError as exc:
        raise ProfileError(f"{p}: {exc}") from exc


def save_profile(profile: Profile, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(profile_to_json(profile), indent=1))
    tmp.replace(p)  # atomic: a reader never sees half a profile


# --------------------------------------------------------------------------- text


def render(node: Node, depth: int = 0) -> list[str]:
    """The tree as indented lines: kind, name, and bytes per sample in and out."""
    from core.sizes import format_bytes  # light: no numba
    pad = "  " * depth
    if isinstance(node, Layer):
        tag = "opaque " if node.kind == "opaque" else ""
        return [f"{pad}{tag}{node.name}  in {format_bytes(node.in_bytes)}  out {format_bytes(node.out_bytes)}"]
    if isinstance(node, Series):
        if not node.children:
            return [f"{pad}{node.name}  (identity)"]
        head = [f"{pad}{node.name}  series of {len(node.children)}"]
        return head + [line for c in node.children for line in render(c, depth + 1)]
    head = [f"{pad}{node.name}  parallel x{len(node.branches)} join={node.join}  "
            f"in {format_bytes(node.in_bytes)}  out {format_bytes(node.out_bytes)}"]
    return head + [line for b in node.branches for line in render(b, depth + 1)]
