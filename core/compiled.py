"""A model compiled for a worker without torch: its shapes and every unit's ONNX graph, one blob.

``vbs plan`` exports the units once (``planner.compile``) and stores this beside the tables,
under the profile's fingerprint; a worker on the CPU whose plans run only ONNX Runtime runs
(``workers.array_backend``) serves from it with neither torch nor the weights file. Every run
a plan uses is composed from these graphs (``core.runtimes.onnx_compose``), so the store
holds each weight once, not once per run.

The blob is a zip: ``compiled.json`` (schema, the model's shapes, what did not export and
why, the versions it was exported with) and one ``.onnx`` file per unit and per exported join.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any

import onnx

from core.errors import TableFormatError
from core.model_shapes import ModelShapes
from core.runtimes.onnx_compose import UnitGraphs
from core.tree import Series
from core.weights_file import WeightsFile, is_moved, tensor_bytes

SCHEMA = "vbs.compiled/1"
MOVED_MIN = 1024  # bytes: smaller weights stay in their graphs (SharedWeights' min_bytes)
_MANIFEST = "compiled.json"


@dataclass(frozen=True)
class CompiledModel:
    """A model's unit graphs and shapes, and what it was compiled from (``meta``)."""

    graphs: UnitGraphs
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def shapes(self) -> ModelShapes:
        return self.graphs.shapes

    @property
    def name(self) -> str:
        return self.shapes.name

    def weight_bytes(self) -> int:
        """Bytes of every unit's and join's initializers: the model's weights, once."""
        return sum(tensor_bytes(t)
                   for g in (*self.graphs.units.values(), *self.graphs.joins.values())
                   for t in g.graph.initializer)

    def resident_weight_bytes(self) -> int:
        """Of ``weight_bytes``, those the graphs hold in memory (not in the weights file)."""
        return sum(tensor_bytes(t)
                   for g in (*self.graphs.units.values(), *self.graphs.joins.values())
                   for t in g.graph.initializer if not is_moved(t))

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        units = sorted(self.graphs.units)
        joins = sorted(self.graphs.joins)
        manifest = {"schema": SCHEMA, "shapes": self.shapes.to_json(),
                    "failed": dict(self.graphs.failed), "units": units, "joins": joins,
                    "meta": {**self.meta, "weight_bytes": self.weight_bytes()}}
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
            z.writestr(_MANIFEST, json.dumps(manifest))
            for i, name in enumerate(units):
                z.writestr(f"units/{i}.onnx", self._whole(self.graphs.units[name]))
            for i, name in enumerate(joins):
                z.writestr(f"joins/{i}.onnx", self._whole(self.graphs.joins[name]))
        return buffer.getvalue()

    def _whole(self, graph: onnx.ModelProto) -> bytes:
        """``graph`` serialized with every weight's bytes (those in the weights file too)."""
        if not any(map(is_moved, graph.graph.initializer)):
            return graph.SerializeToString()
        whole = onnx.ModelProto()
        whole.CopyFrom(graph)
        for tensor in whole.graph.initializer:
            if is_moved(tensor):
                raw = self.graphs.raw(tensor)
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
                tensor.raw_data = raw
        return whole.SerializeToString()

    @staticmethod
    def manifest(blob: bytes, where: str) -> tuple[ModelShapes, dict[str, Any]]:
        """The shapes and meta of a stored blob, its graphs left unread (what an estimate of
        a model not loaded yet needs)."""
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                manifest = json.loads(z.read(_MANIFEST))
            return ModelShapes.from_json(manifest["shapes"]), dict(manifest.get("meta", {}))
        except Exception as exc:  # noqa: BLE001 - zip and JSON each raise their own
            raise TableFormatError(f"{where} cannot be read ({type(exc).__name__}: {exc}): run "
                                   "`vbs plan --replan` to compile it again") from exc

    @classmethod
    def from_bytes(cls, blob: bytes, where: str, *,
                   weights_dir: str | os.PathLike[str] | None = None) -> "CompiledModel":
        """Read a blob ``to_bytes`` wrote; TableFormatError naming ``where`` and the fix when
        it cannot be read. With ``weights_dir``, the graphs' weights of ``MOVED_MIN`` bytes
        or more go to a file there as each graph is read (``core.weights_file``), not into
        the graphs."""
        file = WeightsFile(weights_dir) if weights_dir is not None else None

        def read(data: bytes) -> onnx.ModelProto:
            graph = onnx.load_from_string(data)
            return file.moved(graph, MOVED_MIN) if file is not None else graph

        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as z:
                manifest = json.loads(z.read(_MANIFEST))
                if manifest.get("schema") != SCHEMA:
                    raise ValueError(f"schema {manifest.get('schema')!r}, not {SCHEMA}")
                shapes = ModelShapes.from_json(manifest["shapes"])
                units = {name: read(z.read(f"units/{i}.onnx"))
                         for i, name in enumerate(manifest["units"])}
                joins = {name: read(z.read(f"joins/{i}.onnx"))
                         for i, name in enumerate(manifest["joins"])}
            if file is not None:
                file.settle()
        except Exception as exc:  # noqa: BLE001 - zip, JSON and protobuf each raise their own
            raise TableFormatError(f"{where} cannot be read ({type(exc).__name__}: {exc}): run "
                                   "`vbs plan --replan` to compile it again") from exc
        if not isinstance(shapes.tree, Series):
            raise TableFormatError(f"{where}: the tree's root is not a series")
        graphs = UnitGraphs(shapes, units, joins, dict(manifest.get("failed", {})), file)
        return cls(graphs, dict(manifest.get("meta", {})))
