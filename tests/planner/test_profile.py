"""The profiler: a real measurement of a small model, the JSON contract, the cache."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from service.commands import main
from core.errors import ProfileError
from planner.graph.capture import capture
from core.loaded import ModelSpec
from planner.models import load_model
from planner.profiling.cpu_memory import region_peaks
from planner.profiling.grid import batch_grid, fill_time, fill_workspace
from planner.profiling.profiler import ProfileOptions, cached_profile
from core.tree import Parallel, iter_layers, iter_nodes, load_profile, profile_from_json, \
    profile_to_json, save_profile

PAPER_EXAMPLE = {
    "schema": "vbs.profile/1", "batch_max": 2, "meta": {"model": "paper-three-layer"},
    "root": {"kind": "series", "name": "net", "children": [
        {"kind": "layer", "name": "L1", "in": 1, "out": 1, "time": [4, 6], "ws": [1, 2]},
        {"kind": "layer", "name": "L2", "in": 1, "out": 1, "time": [4, 6], "ws": [4, 8]},
        {"kind": "layer", "name": "L3", "in": 1, "out": 1, "time": [4, 6], "ws": [1, 2]},
    ]},
}


@pytest.fixture(scope="module")
def squeezenet_profile(tmp_path_factory):
    cap = capture(load_model(ModelSpec("squeezenet1_0", input_shape=(3, 64, 64))))
    cache = tmp_path_factory.mktemp("cache")
    opts = ProfileOptions(batch_max=3, repeats=2, warmup=1)
    profile, hit = cached_profile(cap, opts, cache, progress=False)
    return cap, opts, cache, profile, hit


def test_measured_profile_has_every_unit_and_batch(squeezenet_profile) -> None:
    cap, _, _, profile, hit = squeezenet_profile
    assert not hit
    layers = list(iter_layers(profile.root))
    assert [l.name for l in layers] == [l.name for l in iter_layers(cap.tree)]
    for layer in layers:
        assert len(layer.time) == 3 and all(t > 0 for t in layer.time)
        assert len(layer.ws) == 3 and all(w >= 0 for w in layer.ws)
        assert layer.in_bytes > 0 and layer.out_bytes > 0
    # A convolution allocates its output and more on the CPU: its workspace is measured.
    assert layers[0].ws[-1] > 0
    for block in (n for n in iter_nodes(profile.root) if isinstance(n, Parallel)):
        assert block.in_bytes > 0 and len(block.time) == 3
    meta = profile.meta
    for key in ("model", "input_shape", "dtype", "device_name", "torch", "cudnn",
                "batch_sizes_measured", "fingerprint"):
        assert key in meta
    assert meta["batch_sizes_measured"] == [1, 2, 3]


def test_profile_round_trips_through_json(squeezenet_profile, tmp_path) -> None:
    profile = squeezenet_profile[3]
    path = tmp_path / "p.json"
    save_profile(profile, path)
    again = load_profile(path)
    assert again == profile and again.meta == profile.meta
    assert json.loads(path.read_text())["schema"] == "vbs.profile/1"


def test_profiling_the_same_thing_twice_is_a_cache_hit(squeezenet_profile) -> None:
    cap, opts, cache, profile, _ = squeezenet_profile
    t0 = time.perf_counter()
    again, hit = cached_profile(cap, opts, cache, progress=False)
    assert hit and again == profile
    assert time.perf_counter() - t0 < 1.0


def test_paper_example_written_by_hand_loads() -> None:
    profile = profile_from_json(PAPER_EXAMPLE)
    assert [l.name for l in iter_layers(profile.root)] == ["L1", "L2", "L3"]
    assert profile_from_json(profile_to_json(profile)) == profile
    bare = dict(PAPER_EXAMPLE, root=PAPER_EXAMPLE["root"]["children"])  # a bare list is a chain
    assert profile_from_json(bare).root.children == profile.root.children
    # a unit that only writes into its input says so (optional: absent is false)
    raw = json.loads(json.dumps(PAPER_EXAMPLE))
    middle = raw["root"]["children"][1]
    raw["root"]["children"].insert(2, {"kind": "layer", "name": "relu", "in": middle["out"],
                                       "out": middle["out"], "time": [0.0] * raw["batch_max"],
                                       "ws": [0] * raw["batch_max"], "inplace": True})
    with_relu = profile_from_json(raw)
    assert with_relu.root.children[2].inplace and not with_relu.root.children[1].inplace
    assert profile_from_json(profile_to_json(with_relu)) == with_relu


@pytest.mark.parametrize("change, message", [
    (lambda p: p["root"]["children"][1].update(time=[4]), "has 1 values"),
    (lambda p: p["root"]["children"][1].update({"in": 2}), "out must equal the next in"),
    (lambda p: p["root"]["children"][0].update(ws=[1, -2]), "non-negative"),
    (lambda p: p.update(batch_max=0), "batch_max"),
    (lambda p: p["root"]["children"][2].update(name="L1"), "unique"),
    (lambda p: p["root"]["children"][0].update(kind="conv"), "unknown kind"),
    (lambda p: p["root"]["children"][0].update(inplace="yes"), "'inplace' must be true or false"),
    (lambda p: p["root"]["children"][0].update({"inplace": True, "out": 2}), "'in' and 'out' must be equal"),
])
def test_bad_profiles_are_refused_with_a_reason(change, message) -> None:
    raw = json.loads(json.dumps(PAPER_EXAMPLE))
    change(raw)
    with pytest.raises(ProfileError, match=message):
        profile_from_json(raw)


def test_region_peaks_from_memory_events() -> None:
    def mem(ts, total, delta):
        return {"name": "[memory]", "ts": ts, "args": {"Total Allocated": total, "Bytes": delta,
                                                       "Device Type": 0}}
    events = [
        mem(1, 1000, 1000),                                   # before: the input
        {"name": "vbs::a", "ph": "X", "ts": 10, "dur": 10},
        mem(11, 1500, 500), mem(12, 2500, 1000), mem(13, 1500, -1000),
        {"name": "vbs::b", "ph": "X", "ts": 30, "dur": 5},  # allocates nothing
        {"name": "other", "ph": "X", "ts": 40, "dur": 5}, mem(41, 9999, 8499),
    ]
    assert region_peaks(events, "vbs::") == {"vbs::a": 1500, "vbs::b": 0}


def test_grid_and_interpolation() -> None:
    assert batch_grid(8, grid=False) == list(range(1, 9))
    grid = batch_grid(32, grid=True)
    assert grid[:4] == [1, 2, 3, 4] and grid[-1] == 32 and len(grid) < 16
    assert fill_time({1: 1.0, 3: 3.0}, 3) == [1.0, 2.0, 3.0]
    assert fill_workspace({1: 10, 3: 5}, 3) == [10, 10, 5]  # never below a neighbour


def test_cli_profile_writes_the_contract(tmp_path, capsys) -> None:
    out = tmp_path / "c.json"
    argv = ["profile", "--model", "tests.planner.factories:two_layer", "--input-shape", "3,8,8",
            "--batch-max", "2", "--repeats", "1", "--out", str(out), "--quiet", "--no-cache"]
    assert main(argv) == 0
    raw = json.loads(out.read_text())
    assert raw["schema"] == "vbs.profile/1" and raw["batch_max"] == 2
    assert [c["name"] for c in raw["root"]["children"]] == ["a", "b"]
    assert "fingerprint" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_measures_workspace(tmp_path) -> None:
    cap = capture(load_model(ModelSpec("resnet18", device="cuda")))
    profile, _ = cached_profile(cap, ProfileOptions(batch_max=4, repeats=3), tmp_path, progress=False)
    assert profile.meta["cudnn"] and all(len(l.time) == 4 for l in iter_layers(profile.root))


def test_onednn_keeps_every_primitive_a_profile_builds_unless_the_user_says(monkeypatch):
    """oneDNN reads its cache capacity when torch's first CPU kernel runs: apply_threads sets it
    (a profile's round-robin over 16 batch sizes evicts the default 1024 primitives), and
    keeps a capacity the user set."""
    from planner.models import ONEDNN_CACHE, apply_threads

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    apply_threads(0)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    apply_threads(0)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_onnxruntime_runs_are_timed_as_a_plans_calls_meet_them(monkeypatch, tmp_path) -> None:
    """Every call of a run the profiler makes takes samples of its own: the median of calls
    each on the input the call before it had just read priced small batches 5-10% below what
    a plan's calls, each on the next samples, measured (bench/price_state.py,
    docs/benchmarks.md section 3)."""
    from planner.profiling import ort as ort_profiling
    from planner.profiling.profiler import RUN_CALLS

    timed: list[tuple[int, int]] = []  # (batch size, address of the input) per timed call
    run_pass = ort_profiling.OrtProfile.run_pass

    def spied(self, x, profiled=None, counted=True):
        if profiled is None:
            timed.append((int(x.shape[0]), x.data_ptr()))
        return run_pass(self, x, profiled, counted)

    monkeypatch.setattr(ort_profiling.OrtProfile, "run_pass", spied)
    cap = capture(load_model(ModelSpec("squeezenet1_0", input_shape=(3, 64, 64))))
    opts = ProfileOptions(batch_max=3, repeats=2, warmup=1, runtime="auto")
    profile, _ = cached_profile(cap, opts, tmp_path, progress=False)
    assert profile.meta["runtimes"]["onnxruntime"]["runs"]
    calls = RUN_CALLS + 1  # one not timed first
    passes = [timed[k:k + calls] for k in range(0, len(timed), calls)]
    assert len(passes) == 3 * 3 and all(len(p) == calls for p in passes)  # 3 batches x 3
    for each in passes:
        assert len({b for b, _ in each}) == 1
        assert len({address for _, address in each}) == calls, each
