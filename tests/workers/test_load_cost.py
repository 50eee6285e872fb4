"""What the worker without torch gets from a default `vbs plan`: tables it can run, even where
the profile chose torch for some unit (``planner.pipeline.compile_served``, chosen again from
the same measurements), and what it keeps loaded, measured and stored for the service
(``workers.load_cost``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core import runtimes
from core.compiled import CompiledModel
from core.errors import TableFormatError, UsageError
from core.runtimes.base import RuntimeOptions
from core.runtimes.ort_sessions import FACTOR_FLOOR, SESSION_GROWTH, served_factor
from core.spec import ModelSpec
from core.tree import Layer, Measured, Profile, Series, iter_layers
from planner.pipeline import Prepared, capture_model, compile_served, publish, strategies
from planner.profiling.profiler import cached_profile, chosen_again, fingerprint
from planner.settings import Settings
from planner.solver.tables import build_tables
from planner.store import open_store
from planner.store.keys import table_id
from planner.stored import compiled_key, model_key, read_compiled
from service.commands import main
from workers.array_backend import ArrayModel
from workers.load_cost import LoadCost, read_load
from workers.memory import MemoryProbe
from workers.worker import Worker

NAME, SHAPE = "tests.planner.factories:two_layer", (3, 8, 8)
SERVED = "tiny"


def _settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path / "cache", store=str(tmp_path / "store"), batch_max=3,
                    profile_repeats=1, profile_warmup=0, slot_count=64)


def _torch_free(profile: Profile) -> Profile:
    """``profile`` with torch's figures of every unit at no cost, so that ``auto`` runs every
    step on torch (as it does a step wherever torch measures faster than a call)."""
    def walk(node):  # type: ignore[no-untyped-def]
        if isinstance(node, Layer):
            assert node.measured(runtimes.ONNXRUNTIME) is not None, node.name
            return dataclasses.replace(node, runtimes=tuple(
                (rt, Measured(tuple(0.0 for _ in m.time), m.ws) if rt == runtimes.TORCH else m)
                for rt, m in node.runtimes))
        if isinstance(node, Series):
            return dataclasses.replace(node, children=tuple(walk(c) for c in node.children))
        return dataclasses.replace(node, branches=tuple(walk(b) for b in node.branches))

    return Profile(profile.batch_max, walk(profile.root), dict(profile.meta))


def test_a_profile_that_chose_torch_gets_tables_the_worker_without_torch_runs(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    spec = ModelSpec(NAME, input_shape=SHAPE)
    model = capture_model(spec, settings)
    assert model.options.runtime == "auto"
    measured, _ = cached_profile(model.capture, model.options, settings.profile_cache,
                                 progress=False)
    profile = chosen_again(_torch_free(measured), model.capture, model.options)
    assert profile.fingerprint == model.fingerprint
    assert runtimes.TORCH in next(iter_layers(profile.root)).runtime  # auto chose torch there
    with open_store(settings.store_location) as store:
        tables = build_tables(profile, strategies("vbs"), slot_count=settings.slot_count)
        publish(store, spec, profile, tables)
        prepared = Prepared(model.capture, profile, tables, "vbs", published=True)
        cid = compile_served(store, model, prepared, settings, "time", SERVED)
        assert cid is not None
        compiled = CompiledModel.from_bytes(store.get_compiled(cid), cid)
        lean_fp = str(compiled.meta["fingerprint"])
        ort_options = dataclasses.replace(model.options, runtime=runtimes.ONNXRUNTIME, lean=True)
        assert lean_fp == fingerprint(model.capture, ort_options) != model.fingerprint
        # the served profile's table runs torch steps: the worker without torch refuses it
        assert ArrayModel(compiled, profile.root, model.fingerprint).unrunnable(tables["vbs"])
        stored = read_compiled(store, SERVED, spec, "vbs", "time")
        assert stored.fingerprint == lean_fp
        assert ArrayModel(stored.compiled, stored.profile.root,
                          lean_fp).unrunnable(stored.tables["vbs"]) == ""
        # the model's own key still names the served profile's tables (the torch worker's)
        assert store.get_model(model_key(spec, "vbs", "time")) == table_id(
            model.fingerprint, "vbs", "time")


def test_choosing_again_is_the_profilers_choice_from_the_same_figures(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    model = capture_model(ModelSpec(NAME, input_shape=SHAPE), settings)
    measured, _ = cached_profile(model.capture, model.options, settings.profile_cache,
                                 progress=False)
    ort = dataclasses.replace(model.options, runtime=runtimes.ONNXRUNTIME)
    named = chosen_again(measured, model.capture, ort)
    for layer in iter_layers(named.root):
        assert set(layer.runtime) == {runtimes.ONNXRUNTIME}, layer.name
        assert layer.time == layer.measured(runtimes.ONNXRUNTIME).time
    back = chosen_again(named, model.capture, model.options)
    assert back.root == measured.root and back.fingerprint == measured.fingerprint
    torch_only = Profile(measured.batch_max, measured.root, {**measured.meta, "runtimes": {}})
    with pytest.raises(UsageError, match="did not measure"):
        chosen_again(torch_only, model.capture, ort)


def test_vbs_plan_stores_what_the_worker_without_torch_keeps(tmp_path: Path, capsys) -> None:
    store = str(tmp_path / "store")
    assert main(["plan", "--model", f"{SERVED}={NAME}@3x8x8", "--batch-max", "3", "--store",
                 store, "--cache-dir", str(tmp_path / "cache"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "loaded without torch: keeps" in out, out
    spec = ModelSpec(NAME, input_shape=SHAPE)
    with open_store(store) as st:
        cid = st.get_model(compiled_key(SERVED, spec))
        cost = read_load(st, cid)
        stored = read_compiled(st, SERVED, spec, "vbs", "time")
        apart = read_compiled(st, SERVED, spec, "vbs", "time", weights_dir=tmp_path / "w")
    assert cost is not None and cost.load_s > 0
    assert cost.weights_bytes == stored.compiled.weight_bytes() > 0
    batch_buffer = 3 * 3 * 8 * 8 * 4  # batch_max samples of float32
    # the units' graphs keep none of their weights of 1 KiB or more in memory (a file holds
    # them): what the model keeps is its sessions' copy and what stays in the graphs
    resident = apart.compiled.resident_weight_bytes()
    assert resident < cost.weights_bytes
    assert cost.buffer_bytes == batch_buffer
    assert cost.kept_bytes == resident + cost.held_bytes + cost.buffer_bytes
    # what making its largest session asks free: the runtime's own rule, for its whole graph
    assert 0 < cost.making_bytes <= SESSION_GROWTH * cost.weights_bytes
    assert LoadCost.from_bytes(cost.to_bytes(), "here") == cost


def test_a_session_asks_free_what_vbs_plan_measured_making_it_took(tmp_path: Path,
                                                                     capsys) -> None:
    """`vbs plan` measures, in a fresh process, what making the model's sessions grew it by
    at the peak per byte of their weights; the service's worker asks that (with the margin of
    ``served_factor``) free before a session, not the bound of 7, and the bytes the service
    counts for the load before it starts are what the load then asks."""
    store = str(tmp_path / "store")
    name, served = "tests.planner.factories:conv_chain", "chain"
    assert main(["plan", "--model", f"{served}={name}@3x8x8", "--batch-max", "2", "--store",
                 store, "--cache-dir", str(tmp_path / "cache"), "--quiet"]) == 0
    assert "a session asks" in capsys.readouterr().out
    spec = ModelSpec(name, input_shape=(3, 8, 8))
    with open_store(store) as st:
        cost = read_load(st, st.get_model(compiled_key(served, spec)))
        stored = read_compiled(st, served, spec, "vbs", "time")
    assert cost is not None and cost.weights_bytes > 8 << 20
    # measured (the bound only where nothing was): a session peaks above the weights it keeps
    assert cost.making_seen > 1.0
    assert cost.making_factor == served_factor(cost.making_seen) >= FACTOR_FLOOR
    model = ArrayModel(stored.compiled, stored.profile.root, stored.fingerprint)
    worker = Worker(model, stored.tables["vbs"], MemoryProbe("cpu"), name=served,
                    runtime_options=RuntimeOptions(making_factor=cost.making_factor))
    try:
        assert worker.making_bytes == cost.making_bytes
        assert cost.making_bytes <= cost.making_factor * cost.weights_bytes + 1
    finally:
        worker.release()


def test_the_served_factor_is_the_measured_one_with_its_margin_within_the_bound() -> None:
    assert served_factor(0.0) == SESSION_GROWTH  # nothing measured
    assert served_factor(0.2) == FACTOR_FLOOR
    assert served_factor(2.0) == 3.0
    assert served_factor(40.0) == SESSION_GROWTH


@pytest.mark.parametrize("data", [b"{", b'{"kept_bytes": 1}', b'{"kept_bytes": -1, "load_s": 1, '
                                  b'"weights_bytes": 0, "held_bytes": 0, "making_bytes": 0}'])
def test_unreadable_load_figures_name_the_fix(data: bytes) -> None:
    with pytest.raises(TableFormatError, match="vbs plan"):
        LoadCost.from_bytes(data, "load figures of x")


def test_units_refused_beside_torch_for_their_layout_run_in_the_tables_without_torch(
        tmp_path: Path) -> None:
    """A unit whose input or output is channels-last in the model (ConvNeXt's LayerNorm2d) is
    measured on ONNX Runtime and refused only beside torch: the model's own tables run it on
    torch, the compiled model's (every step on ONNX Runtime) run it there, and the worker
    without torch serves them, its outputs equal to ``model(x)``."""
    import numpy as np
    import torch

    from core.runs import supports
    from planner.models import load_model
    from planner.profiling.takes import LAYOUT
    from planner.stored import read
    from tests.planner.factories import channels_last_norm

    name, served, store = "tests.planner.factories:channels_last_norm", "cl", str(tmp_path / "s")
    torch.manual_seed(0)
    weights = tmp_path / "w.pt"
    torch.save(channels_last_norm().state_dict(), weights)
    assert main(["plan", "--model", f"{served}={name}@3x8x8", "--weights", str(weights),
                 "--batch-max", "2", "--store", store, "--cache-dir", str(tmp_path / "cache"),
                 "--quiet"]) == 0
    spec = ModelSpec(name, input_shape=SHAPE, weights=weights)
    with open_store(store) as st:
        lean = read_compiled(st, served, spec, "vbs", "time")
        found = read(st, str(lean.profile.meta["chosen_from"]), ("vbs",), "time", repair=False)
    assert found is not None
    own = found[0]
    norm = next(n for n in iter_layers(own.root) if n.name == "1.norm")
    assert dict(norm.unsupported)[runtimes.ONNXRUNTIME].startswith(LAYOUT)
    assert norm.measured(runtimes.ONNXRUNTIME) is not None  # measured all the same
    assert not supports(norm, runtimes.ONNXRUNTIME)
    assert lean.fingerprint != own.fingerprint and lean.profile.meta.get("chosen_from")
    assert all(supports(n, runtimes.ONNXRUNTIME) for n in iter_layers(lean.profile.root))
    model = ArrayModel(lean.compiled, lean.profile.root, lean.fingerprint)
    table = lean.tables["vbs"]
    assert model.unrunnable(table) == ""
    worker = Worker(model, table, MemoryProbe("cpu"), name=served)
    x = np.random.default_rng(0).standard_normal((2, *SHAPE), dtype=np.float32)
    got, _ = worker.infer(x)
    with torch.inference_mode():
        want = load_model(spec).module(torch.from_numpy(x)).numpy()
    worker.release()
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4), np.abs(got - want).max()
