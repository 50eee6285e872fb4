"""One model's weights held once across the ONNX Runtime sessions of its runs.

Why: every run (units composed into one graph) gets a session, and a session holds its own
copy of its graph's weights (at ORT_ENABLE_ALL NCHWc-reordered ones), so a model's memory grew
with the number of its runs (docs/benchmarks.md, section 11). ``add_initializer`` lets a session
use a tensor the caller holds, but only for tensors its optimiser leaves as they are, and
without the blocked layouts convolutions run up to 1.6x slower. So ``SharedWeights.session``
first optimises the run's graph at the caller's level with a session of its own (its weights
written apart), keeps each weight of the result once, by content (the optimiser names its new
tensors per graph; the same weight reordered alike is the same bytes in every run), and serves
the optimised graph at ORT_DISABLE_ALL on those buffers. The stripped graph is cached by the
run's structure, so a session made again is not optimised again.

The weights ONNX Runtime packs into a layout of its own as a session is made (the B of a
MatMul or Gemm: most of alexnet's, ConvNeXt's pointwise layers) are not shared: shared, the
original stayed beside the packed copy, the weights twice; given to the session as its own
(from a file in the same folder, read as it is made) it frees them once packed.

Limits: the optimised graph is this CPU's (never stored); weights under ``min_bytes`` and the
packed copies of MatMul/Gemm weights stay per session; buffers live as long as the
``SharedWeights`` and every session made on it (each keeps a reference to it); CPU only.
Figures: ``bench/ort_weights_probe.py``, docs/benchmarks.md section 11.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from core.weights_file import SESSIONS_PREFIX, copy_fields, owned_folder, refer, remove_owned, \
    tensor_bytes

# where a weight that a session gets by add_initializer is said to be: an empty file that
# ONNX Runtime checks is there but never reads (the tensor is the caller's)
_PLACEHOLDER = "shared-weights.bin"
_ALIGN = 64  # bytes: what MLAS's kernels like their weights aligned to
_MAP_ALIGN = 1 << 16  # an offset ONNX Runtime maps external data at (its allocation granularity)
_FOLDER = "session.model_external_initializers_file_folder_path"
_OUT_FILE = "session.optimized_model_external_initializers_file_name"
_OUT_MIN = "session.optimized_model_external_initializers_min_size_in_bytes"
_PACKED = "packed-weights.bin"  # the weights sessions pack (``_packed_inputs``), read as made
_PACKS = frozenset({"MatMul", "Gemm", "FusedMatMul", "FusedGemm"})
# int8 kernels (a QDQ graph's convolutions and products, fused) pack their weight, input 3
_PACKS_INT8 = frozenset({"QLinearConv", "QLinearMatMul", "QGemm"})


@dataclass(frozen=True)
class _Graph:
    """A run's optimised graph without its weights, and the key of each weight it names."""

    proto: bytes
    weights: tuple[tuple[str, bytes], ...]  # initializer name -> content key
    packed: int = 0  # bytes of the weights its session packs and owns


class SharedWeights:
    """The distinct weights of one model's sessions, each held once (by content), and the
    sessions made on them (``session``). Keep it as long as any of its sessions: each
    session keeps a reference to it too."""

    def __init__(self, *, min_bytes: int = 1024, folder: str | None = None) -> None:
        self.min_bytes = min_bytes
        self._tensors: dict[bytes, tuple[np.ndarray, ort.OrtValue]] = {}
        self._graphs: dict[tuple[bytes, int], _Graph] = {}
        self._packed: dict[bytes, int] = {}  # content -> its offset in the packed weights' file
        self._lock = threading.Lock()
        # its files (the graphs optimised, the weights sessions pack), in ``folder`` if given
        # (locked while this process lives: `vbs serve` removes one a killed process left)
        self._dir, owner = owned_folder(SESSIONS_PREFIX, folder)
        open(os.path.join(self._dir, _PLACEHOLDER), "wb").close()
        self._finalizer = weakref.finalize(self, remove_owned, self._dir, owner)
        self.last_new_bytes = 0  # bytes the last ``session`` call added to the buffers
        self.last_graph_bytes = 0  # the last session's graph: what it copies (small weights too)
        self.last_packed_bytes = 0  # the weights the last session packed and owns

    @property
    def held_bytes(self) -> int:
        """Bytes of the distinct weights held (once, whatever the number of sessions)."""
        return sum(array.nbytes for array, _ in list(self._tensors.values()))

    def _put_packed(self, array: np.ndarray, content: bytes) -> int:
        """A weight a session packs, in the file its sessions read it from (once, by
        content); its offset (aligned for mapping)."""
        if content not in self._packed:
            with open(os.path.join(self._dir, _PACKED), "ab") as out:
                offset = -(-out.tell() // _MAP_ALIGN) * _MAP_ALIGN
                out.write(b"\0" * (offset - out.tell()))
                out.write(memoryview(array.reshape(-1).view(np.uint8)))
            self._packed[content] = offset
        return self._packed[content]

    @property
    def packed_bytes(self) -> int:
        """Bytes of the distinct weights the sessions pack and own (in a file until then)."""
        with self._lock:
            path = os.path.join(self._dir, _PACKED)
            return os.path.getsize(path) if self._packed and os.path.exists(path) else 0

    @property
    def tensors(self) -> int:
        return len(self._tensors)

    def close(self) -> None:
        """Forget the buffers and the cached graphs (sessions made keep what they use)."""
        with self._lock:
            self._tensors.clear()
            self._graphs.clear()

    def session(self, model: onnx.ModelProto, options: ort.SessionOptions,
                providers: Sequence[str] = ("CPUExecutionProvider",), *,
                sources: Mapping[str, Callable[[], bytes]] | None = None
                ) -> ort.InferenceSession:
        """A session running ``model`` as ``options`` say (optimised at their
        ``graph_optimization_level``) on the shared weights. ``options`` is the serving
        session's own: it is changed (its level set to ORT_DISABLE_ALL, the weights added),
        so pass a fresh one each time, as for any session. ``sources``: where the bytes of
        ``model``'s shells are (``core.runtimes.onnx_compose.Composed``), read one at a time
        where the graph is not optimised yet."""
        key = _structure(model)
        level = options.graph_optimization_level
        with self._lock:
            graph = self._graphs.get((key, int(level)))
            before = self.held_bytes
            if graph is None:
                graph = self._graphs[(key, int(level))] = self._prepare(model, level, providers,
                                                                        sources or {})
            self.last_new_bytes = self.held_bytes - before
            self.last_graph_bytes = len(graph.proto)
            self.last_packed_bytes = graph.packed
            for name, content in graph.weights:
                options.add_initializer(name, self._tensors[content][1])
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.add_session_config_entry(_FOLDER, self._dir)
        session = ort.InferenceSession(graph.proto, options, providers=list(providers))
        session._shared_weights = self  # the buffers outlive every session that reads them
        return session

    def _prepare(self, model: onnx.ModelProto, level: ort.GraphOptimizationLevel,
                 providers: Sequence[str], sources: Mapping[str, Callable[[], bytes]]) -> _Graph:
        """``model`` optimised at ``level`` (none at ORT_DISABLE_ALL), its weights moved into
        the shared buffers."""
        work = tempfile.mkdtemp(dir=self._dir)
        try:
            # the graph's weights go to a file first, one tensor at a time: ONNX Runtime maps
            # them from there rather than holding a serialized copy and its own beside
            # the caller's (what made a session cost about 6x its weights at its peak)
            source = _externalised(model, work, "source.bin", self.min_bytes, sources)
            if level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
                optimised = source
            else:
                onnx.save(source, os.path.join(work, "source.onnx"))
                del source
                path = os.path.join(work, "model.onnx")
                opts = ort.SessionOptions()
                opts.graph_optimization_level = level
                opts.intra_op_num_threads = 1
                opts.optimized_model_filepath = path
                opts.add_session_config_entry(_OUT_FILE, "weights.bin")
                opts.add_session_config_entry(_OUT_MIN, str(self.min_bytes))
                opts.add_session_config_entry("session.disable_prepacking", "1")
                opts.enable_cpu_mem_arena = False
                ort.InferenceSession(os.path.join(work, "source.onnx"), opts,
                                     providers=list(providers))
                optimised = onnx.load(path, load_external_data=False)
            named: list[tuple[str, bytes]] = []
            packed, owned = _packed_inputs(optimised.graph), 0
            for tensor in optimised.graph.initializer:
                if tensor.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                info = {e.key: e.value for e in tensor.external_data}
                array = _read(os.path.join(work, info["location"]), int(info.get("offset", 0)),
                              tensor)
                if tensor.name in packed:  # the session's own: packed, its bytes given back
                    refer(tensor, _PACKED, self._put_packed(array, _content(array)),
                           array.nbytes)
                    owned += array.nbytes
                    continue
                content = _content(array)
                if content not in self._tensors:
                    self._tensors[content] = (array, ort.OrtValue.ortvalue_from_numpy(array))
                named.append((tensor.name, content))
                refer(tensor, _PLACEHOLDER, 0, array.nbytes)
            return _Graph(optimised.SerializeToString(), tuple(named), owned)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _packed_inputs(graph: onnx.GraphProto) -> set[str]:
    """The weights ONNX Runtime packs into a layout of its own as a session is made (the B of
    a MatMul or Gemm, the int8 weight of a QLinearConv, QLinearMatMul or QGemm): given to the
    session as its own, it frees them once packed; shared (``add_initializer``), they stay
    beside the packed copy, the weights twice."""
    return {node.input[1] for node in graph.node
            if node.op_type in _PACKS and len(node.input) > 1} | {
        node.input[3] for node in graph.node if node.op_type in _PACKS_INT8 and len(node.input) > 3}


def _externalised(model: onnx.ModelProto, folder: str, name: str, min_bytes: int,
                  sources: Mapping[str, Callable[[], bytes]]) -> onnx.ModelProto:
    """``model`` with each initializer of ``min_bytes`` or more written to ``folder/name``, at
    an offset aligned for mapping, and referred to there (``model`` is left as it is, and its
    weights are never copied whole: one tensor's bytes at a time); a shell's bytes are its
    tensor's in ``sources``, read one at a time."""
    shell = onnx.ModelProto()
    copy_fields(model, shell, skip="graph")
    copy_fields(model.graph, shell.graph, skip="initializer")
    with open(os.path.join(folder, name), "wb") as out:
        for tensor in model.graph.initializer:
            read = sources.get(tensor.name)
            if read is None and (tensor_bytes(tensor) < min_bytes or not tensor.raw_data):
                shell.graph.initializer.add().CopyFrom(tensor)
                continue
            raw = read() if read is not None else tensor.raw_data
            offset = -(-out.tell() // _MAP_ALIGN) * _MAP_ALIGN
            out.seek(offset)
            out.write(raw)
            moved = shell.graph.initializer.add()
            moved.name, moved.data_type = tensor.name, tensor.data_type
            moved.dims.extend(tensor.dims)
            refer(moved, name, offset, len(raw))
            del raw
    return shell


def _structure(model: onnx.ModelProto) -> bytes:
    """A run's identity without reading its weights: nodes, inputs, outputs, and the name,
    type and shape of every initializer (a name is one tensor in all runs of a model)."""
    h = hashlib.blake2b(digest_size=20)
    graph = model.graph
    for part in (*graph.node, *graph.input, *graph.output, *model.opset_import):
        h.update(part.SerializeToString())
    for tensor in graph.initializer:
        h.update(f"{tensor.name}:{tensor.data_type}:{list(tensor.dims)};".encode())
    return h.digest()


def _read(path: str, offset: int, tensor: onnx.TensorProto) -> np.ndarray:
    """The tensor's bytes from ``path`` at ``offset`` into a buffer of its own, aligned."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    nbytes = tensor_bytes(tensor)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    flat = raw[start:start + nbytes]
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(memoryview(flat)) != nbytes:
            raise ValueError(f"{tensor.name}: {path} ends before its {nbytes} bytes")
    return flat.view(dtype).reshape(tuple(tensor.dims))


def _content(array: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{array.dtype.str}:{array.shape};".encode())
    h.update(memoryview(array.reshape(-1).view(np.uint8)))
    return h.digest()
