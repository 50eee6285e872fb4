"""A compiled model's weights kept apart (``core.weights_file``) and runs composed without a
copy of them (``UnitGraphs.compose_referring``): the graphs hold none of the large weights,
the sessions made from them compute what sessions of the whole graph do, the blob written
again is the blob read, and the file is gone from its folder from the start."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import numpy_helper

from core.compiled import CompiledModel
from core.loaded import ModelSpec
from core.weights_file import WeightsFile, is_moved
from planner.compile import compile_capture
from planner.graph.capture import capture
from planner.models import load_model

ort = pytest.importorskip("onnxruntime")
from core.runtimes.ort_sessions import session_options, start  # noqa: E402
from core.runtimes.ort_weights import SharedWeights  # noqa: E402


@pytest.fixture(scope="module")
def compiled() -> tuple[CompiledModel, bytes]:
    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("resnet18", input_shape=(3, 32, 32))))
    model = compile_capture(cap, "test")
    return model, model.to_bytes()


def _run(session: "ort.InferenceSession", x: np.ndarray) -> np.ndarray:
    return session.run(None, {"x": x})[0]


def test_moved_graphs_hold_no_large_weight_and_compute_the_same(compiled, tmp_path) -> None:
    start()
    whole, blob = compiled
    apart = CompiledModel.from_bytes(blob, "test", weights_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left behind
    assert apart.weight_bytes() == whole.weight_bytes() > 40 * 2**20
    assert apart.resident_weight_bytes() < 0.01 * apart.weight_bytes()
    assert whole.resident_weight_bytes() == whole.weight_bytes()
    children = apart.shapes.tree.children
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    want = _run(ort.InferenceSession(whole.graphs.compose(children).SerializeToString(),
                                     session_options(2)), x)
    # a copy composed from the moved graphs reads their bytes back
    copied = apart.graphs.compose(children)
    assert not any(map(is_moved, copied.graph.initializer))
    assert np.array_equal(_run(ort.InferenceSession(copied.SerializeToString(),
                                                    session_options(2)), x), want)
    # composed referring: no weight's bytes in the run's graph, read as the session is made
    run = apart.graphs.compose_referring(children, 1024)
    assert run.weight_bytes == whole.weight_bytes()
    assert run.model.ByteSize() < 0.01 * run.weight_bytes
    assert set(run.sources) == {t.name for t in run.model.graph.initializer
                                if not t.raw_data and not t.float_data}
    shared = SharedWeights()
    got = _run(shared.session(run.model, session_options(2), sources=run.sources), x)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    # the same from graphs that hold their weights (compose_referring reads them there)
    held = whole.graphs.compose_referring(children, 1024)
    assert held.model.ByteSize() < 0.01 * held.weight_bytes
    again = _run(SharedWeights().session(held.model, session_options(2), sources=held.sources),
                 x)
    assert np.array_equal(again, got)


def test_a_moved_model_writes_the_blob_it_was_read_from(compiled, tmp_path) -> None:
    whole, blob = compiled
    apart = CompiledModel.from_bytes(blob, "test", weights_dir=tmp_path)
    back = CompiledModel.from_bytes(apart.to_bytes(), "again")
    for name, graph in whole.graphs.units.items():
        again = back.graphs.units[name].graph
        assert list(again.node) == list(graph.graph.node), name
        assert [t.name for t in again.initializer] == [t.name for t in graph.graph.initializer]
        for a, b in zip(again.initializer, graph.graph.initializer):
            assert not is_moved(a)
            assert np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b)), a.name


def test_the_file_reads_back_what_was_put_after_it_settled(tmp_path) -> None:
    file = WeightsFile(tmp_path)
    parts = [bytes([i]) * (1000 + 37 * i) for i in range(5)]
    offsets = [file.put(p) for p in parts]
    file.settle()
    assert all(o % 64 == 0 for o in offsets)
    assert [file.read(o, len(p)) for o, p in zip(offsets, parts)] == parts
    with pytest.raises(OSError, match="ends at"):
        file.read(offsets[-1], len(parts[-1]) + 1)


def test_the_sessions_files_go_beside_the_weights_file(compiled, tmp_path) -> None:
    """The files a model's sessions are made from (the optimised graphs, the weights a session
    packs) go to the weights file's folder, a disk (the cache directory), not the temporary
    directory, which is a tmpfs (memory) in the containers."""
    from core.runtimes.ort_sessions import OrtSessions

    start()
    _, blob = compiled
    apart = CompiledModel.from_bytes(blob, "test", weights_dir=tmp_path)
    units = OrtSessions(apart.graphs, 2)
    units.prepare(tuple(apart.shapes.tree.children), 1)
    made = [p for p in tmp_path.iterdir() if p.name.startswith("vbs-ort-weights-")]
    assert len(made) == 1 and any(made[0].iterdir())  # the classifier's packed weights
    units.release()


def test_a_killed_processs_sessions_folder_is_swept_a_live_ones_is_not(tmp_path) -> None:
    """A SharedWeights' folder holds a lock its process keeps: after a kill -9 the folder is
    left, and `sweep` (what `vbs serve` runs as it starts) removes it; a live process's
    folder stays, and goes when its SharedWeights does."""
    import os
    import signal
    import subprocess
    import sys

    from core.weights_file import SESSIONS_PREFIX, sweep

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from core.runtimes.ort_weights import SharedWeights\n"
         "w = SharedWeights(folder=sys.argv[1]); print(w._dir, flush=True); time.sleep(120)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        left = child.stdout.readline().strip()
        mine = SharedWeights(folder=str(tmp_path))
        assert sweep(tmp_path, SESSIONS_PREFIX) == []  # both alive
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert os.path.isdir(left)  # what the kill left behind
    assert sweep(tmp_path, SESSIONS_PREFIX) == [left]
    assert not os.path.exists(left) and os.path.isdir(mine._dir)
    folder = mine._dir
    del mine
    assert not os.path.exists(folder)


def test_a_weights_folder_that_cannot_be_written_is_refused_naming_the_setting(tmp_path
                                                                               ) -> None:
    from core.errors import UsageError
    from core.weights_file import SESSIONS_PREFIX, ready_folder

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UsageError, match="VBS_CACHE_DIR: cannot write"):
        ready_folder(blocker / "weights", (SESSIONS_PREFIX,), "VBS_CACHE_DIR")
    assert ready_folder(tmp_path / "weights", (SESSIONS_PREFIX,), "VBS_CACHE_DIR") == []
