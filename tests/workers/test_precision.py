"""Precision per unit: int8 units quantized from a user's calibration samples, guarded against
float32 on held-out ones, planned, compiled and served by the worker without torch
(``planner.precision``, ``core.precision``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import UsageError
from core.precision import Precision
from core.spec import ModelSpec
from planner.calibration import read_calibration
from planner.settings import Settings
from planner.store import open_store
from planner.stored import model_key, read_compiled
from planner.view.data import plan_description
from service.commands import main
from workers.array_backend import ArrayModel
from workers.memory import MemoryProbe
from workers.worker import Worker

pytest.importorskip("sklearn")  # the test extra: scikit-learn's bundled digits
from tests.planner.digits import SHAPE, digits, factory, train  # noqa: E402

NAME = "tests.planner.digits:factory"
TRAIN, CALIBRATION = 1000, 160  # samples: the rest of the 1797 are the test set


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """(weights, calibration folder, test inputs, test labels) of the digits CNN."""
    root = tmp_path_factory.mktemp("digits")
    x, y = digits()
    model = train(x[:TRAIN], y[:TRAIN])
    weights = root / "w.pt"
    torch.save(model.state_dict(), weights)
    folder = root / "calibration"
    folder.mkdir()
    np.save(folder / "samples.npy", x[TRAIN:TRAIN + CALIBRATION])
    return weights, folder, x[TRAIN + CALIBRATION:], y[TRAIN + CALIBRATION:]


def _plan(tmp: Path, weights: Path, served: str, *flags: str) -> int:
    return main(["plan", "--model", f"{served}={NAME}@1x16x16", "--weights", str(weights),
                 "--batch-max", "4", "--store", str(tmp / "store"), "--cache-dir",
                 str(tmp / "cache"), "--select-rounds", "1", "--quiet", *flags])


def _served(store: Path, served: str, weights: Path) -> tuple[Worker, object]:
    spec = ModelSpec(NAME, input_shape=SHAPE, weights=weights)
    with open_store(str(store)) as st:
        lean = read_compiled(st, served, spec, "vbs", "time")
    model = ArrayModel(lean.compiled, lean.profile.root, lean.fingerprint)
    return Worker(model, lean.tables["vbs"], MemoryProbe("cpu"), name=served), lean


def _answers(worker: Worker, x: np.ndarray) -> np.ndarray:
    return np.concatenate([worker.infer(np.ascontiguousarray(c))[0]
                           for c in np.array_split(x, -(-len(x) // 4))])


def test_int8_served_without_torch_keeps_the_trained_models_accuracy(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray]) -> None:
    """`vbs plan --precision int8 --calibration DIR` on a CNN trained on real digits (int8
    whatever its speed here, which decides `auto`: the test below): its units int8 where the
    guard allowed (said in the profile and the compiled model), its weights a
    third of float32's bytes or less, and the plans the worker without torch serves answer the
    held-out test set within 1 point of float32's accuracy; the float32 model planned beside it
    under the same name keeps its own table."""
    weights, folder, x, y = trained
    assert _plan(tmp_path, weights, "d8", "--precision", "int8", "--calibration",
                 str(folder)) == 0
    assert _plan(tmp_path, weights, "d32") == 0
    worker8, lean8 = _served(tmp_path / "store", "d8", weights)
    worker32, lean32 = _served(tmp_path / "store", "d32", weights)
    precision = Precision.from_json(lean8.profile.meta.get("precision"))
    assert precision.int8 and precision.held_out == CALIBRATION // 4
    assert precision.agreement >= 1 - Settings().max_error
    assert Precision.from_json(lean8.compiled.meta.get("precision")) == precision
    assert lean32.profile.meta.get("precision") is None and lean8.fingerprint != lean32.fingerprint
    assert lean8.compiled.weight_bytes() <= 0.35 * lean32.compiled.weight_bytes()
    with open_store(str(tmp_path / "store")) as st:  # one model key per precision
        spec = ModelSpec(NAME, input_shape=SHAPE)
        for lean, precision_name in ((lean8, "int8"), (lean32, "float32")):
            own = lean.profile.meta.get("chosen_from") or lean.fingerprint
            assert st.get_model(model_key(spec, "vbs", "time", precision_name)) == \
                f"{own}.vbs.time"
    table = lean8.tables["vbs"]  # /plan, the page: each unit's precision
    units = plan_description(table, int(table.row(4).plans[-1]), 4, precision)["units"]
    assert any(u["precision"] == "int8" for u in units)
    assert all((u["precision"] == "int8") == (u["unit"] in precision.int8
                                              and "onnxruntime" in u["runtime"]) for u in units)
    try:
        got8, got32 = _answers(worker8, x), _answers(worker32, x)
    finally:
        worker8.release()
        worker32.release()
    with torch.inference_mode():
        model = factory()
        model.load_state_dict(torch.load(weights, weights_only=True))
        want = model.eval()(torch.from_numpy(x)).numpy()
    assert np.allclose(got32, want, rtol=1e-4, atol=1e-4)  # float32 served is model(x)
    acc8, acc32 = float((got8.argmax(1) == y).mean()), float((want.argmax(1) == y).mean())
    # the figure docs/benchmarks.md section 13 quotes (`pytest -s -k trained_models_accuracy`)
    print(f"\ndigits, {len(y)} held-out: float32 {100 * acc32:.2f}%, int8 served "
          f"{100 * acc8:.2f}% ({len(precision.int8)} units int8), top-1 as float32's on "
          f"{100 * float((got8.argmax(1) == want.argmax(1)).mean()):.2f}%")
    assert acc32 > 0.9, acc32  # it learned the digits
    assert acc8 >= acc32 - 0.01, (acc8, acc32)
    assert not np.allclose(got8, want, rtol=1e-4, atol=1e-4)  # int8 ran, not float32


def test_the_guard_keeps_float32_the_units_that_would_move_the_answer(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray]) -> None:
    """With no disagreement allowed and calibration samples that teach int8 a range far from
    what the held-out samples hold, the guard takes units back to float32 until the held-out
    samples' top-1 is float32's: what it keeps, run again, agrees as it says."""
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import with_precision

    weights, folder, x, _ = trained
    skewed = tmp_path / "skewed"
    skewed.mkdir()
    samples = np.load(folder / "samples.npy")
    fit = samples[: 3 * len(samples) // 4] * 0.05  # ranges 20x too small: int8 saturates
    np.save(skewed / "a.npy", fit)
    np.save(skewed / "b.npy", samples[3 * len(samples) // 4:])
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=weights)))
    every = with_precision(cap, "int8", skewed, 1.0)  # nothing taken back
    guarded = with_precision(cap, "int8", skewed, 0.0)
    assert every.precision.int8 and every.precision.agreement < 1.0
    assert len(guarded.precision.int8) < len(every.precision.int8)
    assert guarded.precision.agreement == 1.0
    assert "stay float32" in guarded.precision.why or not guarded.precision.int8


def test_auto_keeps_int8_only_where_this_machine_measured_it_faster(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` measures the whole model in int8 against float32 once and keeps the verdict
    beside the profiles; where int8 ran below ``MIN_SPEEDUP`` of float32's speed it stays
    float32 and says why (the same fingerprint as float32), else it keeps the guard's units;
    `int8` keeps them either way and says what auto would do. The verdict is set here in the
    cache (what another run on another machine could have measured): no timing decides;
    no half precision is weighed (a CPU without their kernels: the test below weighs them)."""
    import planner.precision_half as half_module
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import with_precision
    from planner.precision_speed import FOLDER, MIN_SPEEDUP, keeps_int8

    monkeypatch.setattr(half_module, "natives", lambda device: ())

    weights, folder, _, _ = trained
    cache = tmp_path / "cache"
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=weights)))
    first = with_precision(cap, "auto", folder, 0.5, cache)
    (verdict,) = (cache / FOLDER).iterdir()  # measured once, kept
    assert first.precision.speedup > 0
    assert bool(first.precision.int8) == keeps_int8(first.precision.speedup)
    assert first.precision.speedup == with_precision(cap, "auto", folder, 0.5, cache
                                                     ).precision.speedup  # read back
    verdict.write_text('{"speedup": 0.5}')
    slow = with_precision(cap, "auto", folder, 0.5, cache)
    assert slow.precision.int8 == () and slow.precision.speedup == 0.5
    assert "0.50x float32's speed" in slow.precision.why and "so float32" in slow.precision.why
    assert slow.graphs is cap.graphs and slow.precision.fingerprint_key() is None
    asked = with_precision(cap, "int8", folder, 0.5, cache)
    assert asked.precision.int8 and "--precision auto would run float32" in asked.precision.why
    verdict.write_text(f'{{"speedup": {MIN_SPEEDUP + 1}}}')
    fast = with_precision(cap, "auto", folder, 0.5, cache)
    assert fast.precision.int8 == asked.precision.int8
    assert fast.precision.speedup == MIN_SPEEDUP + 1 and "auto would" not in fast.precision.why
    assert not keeps_int8(MIN_SPEEDUP - 0.01) and keeps_int8(0.0)  # 0: not measured


def test_precision_without_samples_or_with_wrong_ones_says_what_to_give(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray],
        capsys: pytest.CaptureFixture[str]) -> None:
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import with_precision

    weights = trained[0]
    assert _plan(tmp_path, weights, "d", "--precision", "int8") == 2
    assert "--precision int8 needs --calibration DIR" in capsys.readouterr().err
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=weights)))
    auto = with_precision(cap, "auto", None, 0.01)
    assert auto.precision.int8 == () and "no calibration samples" in auto.precision.why
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    np.save(wrong / "x.npy", np.zeros((16, 3, 16, 16), np.float32))
    with pytest.raises(UsageError, match=r"x.npy has shape \(16, 3, 16, 16\).*\(1, 16, 16\)"):
        read_calibration(wrong, NAME, SHAPE)
    with pytest.raises(UsageError, match="no such folder"):
        read_calibration(tmp_path / "none", NAME, SHAPE)


def test_a_plan_says_what_its_own_guard_measured_when_the_profile_is_cached(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray]) -> None:
    """The int8 units' kernels are the fingerprint's (their names and the samples'), so a
    second plan reuses the cached profile; the guard's record (its bound, what it measured)
    is that plan's own, not the first's."""
    weights, folder, _, _ = trained
    for bound in ("0.5", "0.25"):
        assert _plan(tmp_path, weights, "d8", "--precision", "int8", "--calibration",
                     str(folder), "--max-error", bound, "--replan") == 0
    worker, lean = _served(tmp_path / "store", "d8", weights)
    worker.release()
    assert Precision.from_json(lean.profile.meta["precision"]).max_error == 0.25
    assert Precision.from_json(lean.compiled.meta["precision"]).max_error == 0.25


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_served_keeps_the_trained_models_accuracy(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray], dtype: str) -> None:
    """`vbs plan --precision bfloat16|float16 --calibration DIR` on the digits CNN: the model
    captured again at that dtype (every unit on torch: the profile, /plan and the page say so,
    and what the guard measured), its fingerprint its own, and the torch worker's plans answer
    the held-out test set within 1 point of float32's accuracy, at that dtype (not float32's
    answers), within its tolerance of the model's own at that dtype. float16 is CUDA's (on
    this CPU torch emulates it): the same path, rehearsed here."""
    from core.precision import HALF_TOLERANCE
    from planner.pipeline import prepare

    weights, folder, x, y = trained
    assert _plan(tmp_path, weights, "half", "--precision", dtype, "--calibration",
                 str(folder)) == 0
    spec = ModelSpec(NAME, input_shape=SHAPE, weights=weights)
    settings = Settings(precision=dtype, calibration=folder, cache_dir=tmp_path / "cache",
                        max_error=0.01)
    with open_store(str(tmp_path / "store")) as st:
        prepared = prepare(spec, settings, st, batch_max=4, progress=False)
    assert not prepared.published  # the table `vbs plan` stored: the same fingerprint
    precision = Precision.from_json(prepared.profile.meta.get("precision"))
    assert precision.name == dtype and precision == prepared.capture.precision
    assert prepared.profile.meta["dtype"] == dtype and precision.held_out == CALIBRATION // 4
    assert precision.agreement >= 1 - settings.max_error and 0 < precision.error < 0.1
    table = prepared.table
    units = plan_description(table, int(table.row(4).plans[-1]), 4, precision)["units"]
    assert units and all(u["precision"] == dtype for u in units)
    worker = Worker(prepared.capture, table, MemoryProbe("cpu"), name="half")
    try:  # as a torch worker is given a batch: the model's input on its device and dtype
        got = np.concatenate([
            worker.infer(worker.model.to_input(torch.from_numpy(c)))[0].float().numpy()
            for c in np.array_split(x, -(-len(x) // 4))])
    finally:
        worker.release()
    with torch.inference_mode():
        model = factory()
        model.load_state_dict(torch.load(weights, weights_only=True))
        want = model.eval()(torch.from_numpy(x)).numpy()
        half = getattr(torch, dtype)
        own = model.to(half)(torch.from_numpy(x).to(half)).float().numpy()
    assert not np.allclose(got, want, rtol=1e-4, atol=1e-4)  # the half precision ran
    scale = max(1.0, float(np.abs(own).max()))
    assert float(np.abs(got - own).max()) <= HALF_TOLERANCE * scale
    acc16, acc32 = float((got.argmax(1) == y).mean()), float((want.argmax(1) == y).mean())
    print(f"\ndigits, {len(y)} held-out: float32 {100 * acc32:.2f}%, {dtype} served "
          f"{100 * acc16:.2f}%")
    assert acc32 > 0.9 and acc16 >= acc32 - 0.01, (acc16, acc32)


def test_auto_takes_a_half_precision_only_where_it_measured_fastest(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device with half-precision kernels `auto` times float32 (ONNX Runtime's whole graph
    and torch's), the guard's int8 units and each half precision the device runs in the same
    rounds, once (kept beside the profiles), and takes the fastest half only where it was the
    fastest of all and beat float32 by ``MIN_SPEEDUP``; else it keeps the int8 choice and says
    what the half measured. The times are set here in the cache (what another machine could
    have measured): no timing decides; the device's kernels are set too (bfloat16 alone, as
    on a CPU with AVX512-BF16; then bfloat16 and float16, as on a CUDA device from Ampere
    on), so the test runs the same on a CPU without them."""
    import json

    import planner.precision_half as half_module
    from core.precision import BFLOAT16, FLOAT16
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import with_precision
    from planner.precision_speed import FOLDER

    monkeypatch.setattr(half_module, "natives", lambda device: (BFLOAT16,))
    weights, folder, _, _ = trained
    cache = tmp_path / "cache"
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=weights)))
    def measured() -> dict[Path, dict]:
        with_precision(cap, "auto", folder, 0.5, cache)
        return {p: json.loads(p.read_text()) for p in (cache / FOLDER).iterdir()}

    (int8_speed,) = [p for p, v in measured().items() if "speedup" in v]
    for path in (cache / FOLDER).iterdir():
        path.unlink()  # int8 measured faster, kept: bfloat16 is weighed against it too
    int8_speed.write_text('{"speedup": 2.0}')
    (times,) = [p for p, v in measured().items() if "seconds" in v]
    assert {"float32", "float32 torch", "int8", BFLOAT16} == set(
        json.loads(times.read_text())["seconds"])

    def decided(**seconds: float) -> Precision:
        times.write_text(json.dumps({"seconds": {n.replace("_", " "): s
                                                 for n, s in seconds.items()}}))
        return with_precision(cap, "auto", folder, 0.5, cache).precision

    fast = decided(float32=4.0, float32_torch=5.0, int8=3.0, bfloat16=2.0)
    assert fast.name == BFLOAT16 and fast.speedup == 2.0 and fast.held_out == CALIBRATION // 4
    assert "the fastest" in fast.why and fast.fingerprint_key() == {
        "dtype": BFLOAT16, "calibration": fast.calibration}
    int8 = decided(float32=4.0, float32_torch=5.0, int8=1.5, bfloat16=2.0)
    assert int8.name == "int8" and "bfloat16 ran 2.00x float32's speed, int8 faster" in int8.why
    close = decided(float32=4.0, float32_torch=2.0, int8=3.0, bfloat16=1.95)
    assert close.name == "int8" and "1.03x float32's speed, below the 1.05x wanted" in close.why
    asked = with_precision(cap, "bfloat16", folder, 0.5, cache)  # whatever it measured
    assert asked.precision.name == BFLOAT16 and asked.model.torch_dtype == torch.bfloat16
    strict = with_precision(cap, "bfloat16", folder, -1.0, cache)  # no guard holds
    assert strict.precision.name == "float32" and "moved top-1" in strict.precision.why
    assert strict.model.torch_dtype == torch.float32

    monkeypatch.setattr(half_module, "natives", lambda device: (BFLOAT16, FLOAT16))
    before = set((cache / FOLDER).iterdir())
    with_precision(cap, "auto", folder, 0.5, cache)  # other candidates: timed again, once
    (both,) = set((cache / FOLDER).iterdir()) - before
    assert {"float32", "float32 torch", "int8", BFLOAT16, FLOAT16} == set(
        json.loads(both.read_text())["seconds"])
    times = both
    f16 = decided(float32=4.0, float32_torch=5.0, int8=3.0, bfloat16=2.0, float16=1.6)
    assert f16.name == FLOAT16 and f16.speedup == 2.5 and f16.fingerprint_key() == {
        "dtype": FLOAT16, "calibration": f16.calibration}
    b16 = decided(float32=4.0, float32_torch=5.0, int8=3.0, bfloat16=1.6, float16=2.0)
    assert b16.name == BFLOAT16 and b16.speedup == 2.5
    neither = decided(float32=4.0, float32_torch=5.0, int8=1.0, bfloat16=1.6, float16=1.5)
    assert neither.name == "int8" and "float16 ran 2.67x float32's speed, int8 faster" in neither.why
    asked16 = with_precision(cap, "float16", folder, 0.5, cache)  # whatever it measured
    assert asked16.precision.name == FLOAT16 and asked16.model.torch_dtype == torch.float16
    assert ("no float16 kernels" in asked16.precision.why) != half_module.native(
        cap.model.device, FLOAT16)  # where torch only emulates them, it says so


def test_auto_guards_the_next_half_precision_where_the_fastest_one_moved_the_answer(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """float16's range ends at 65504: the digits CNN with its last layer scaled by 1e5 gives
    logits that overflow to inf in float16, and its top-1 moves, while bfloat16 (float32's
    range) keeps it (random-weight mobilenet_v2 underflows the other end: docs/benchmarks.md,
    section 13). Where float16 measured the fastest half, `auto` guards it, the guard
    refuses it, and the next half that qualifies, bfloat16, is guarded in its place and served,
    its ``why`` saying what float16 did. The times and the device's kernels are set as in the
    test above; the guard runs for real."""
    import json

    import planner.precision_half as half_module
    from core.precision import BFLOAT16, FLOAT16
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import with_precision
    from planner.precision_speed import FOLDER

    weights, folder, _, _ = trained
    state = torch.load(weights)
    last = max(int(k.split(".")[0]) for k in state)  # the last Linear's index
    for part in ("weight", "bias"):
        state[f"{last}.{part}"] = state[f"{last}.{part}"] * 1e5
    scaled = tmp_path / "scaled.pt"
    torch.save(state, scaled)
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=scaled)))
    cache = tmp_path / "cache"
    f16 = with_precision(cap, "float16", folder, 0.05, cache).precision
    assert f16.name == "float32" and "float16 moved top-1" in f16.why  # the overflow, for real
    assert with_precision(cap, "bfloat16", folder, 0.05, cache).precision.name == BFLOAT16

    monkeypatch.setattr(half_module, "natives", lambda device: (BFLOAT16, FLOAT16))
    with_precision(cap, "auto", folder, 0.05, cache)
    (times,) = [p for p in (cache / FOLDER).iterdir() if "seconds" in json.loads(p.read_text())]
    names = json.loads(times.read_text())["seconds"]
    set_to = {FLOAT16: 1.0, BFLOAT16: 2.0, "int8": 3.0}
    times.write_text(json.dumps({"seconds": {n: set_to.get(n, 4.0) for n in names}}))
    chosen = with_precision(cap, "auto", folder, 0.05, cache)
    assert chosen.precision.name == BFLOAT16 and chosen.model.torch_dtype == torch.bfloat16
    assert chosen.precision.speedup == 2.0 and "the fastest guarded" in chosen.precision.why
    assert "float16 moved top-1" in chosen.precision.why

    set_to[BFLOAT16] = 3.9  # bfloat16 below MIN_SPEEDUP (or int8 faster): auto says why
    times.write_text(json.dumps({"seconds": {n: set_to.get(n, 4.0) for n in names}}))
    kept = with_precision(cap, "auto", folder, 0.05, cache).precision
    assert kept.name in ("int8", "float32") and "float16 moved top-1" in kept.why
    assert "bfloat16 ran" in kept.why


def test_auto_weighs_the_rest_where_a_half_precision_cannot_be_captured(
        tmp_path: Path, trained: tuple[Path, Path, np.ndarray, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model the capture refuses at one half precision (its check found the samples of a
    batch mixed, say) is not a plan that fails: `auto` times and weighs the other candidates
    and its ``why`` says which half was not timed and why."""
    import json

    import planner.precision_half as half_module
    from core.errors import BatchMixingError
    from core.precision import BFLOAT16, FLOAT16
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import with_precision
    from planner.precision_speed import FOLDER

    _, folder, _, _ = trained
    cap = capture(load_model(ModelSpec(NAME, input_shape=SHAPE, weights=trained[0])))
    recaptured = half_module._recaptured

    def refuses_float16(capture: object, dtype: str) -> object:
        if dtype == FLOAT16:
            raise BatchMixingError("mixes the samples of a batch (overflow)")
        return recaptured(capture, dtype)  # type: ignore[arg-type]

    monkeypatch.setattr(half_module, "natives", lambda device: (BFLOAT16, FLOAT16))
    monkeypatch.setattr(half_module, "_recaptured", refuses_float16)
    cache = tmp_path / "cache"
    chosen = with_precision(cap, "auto", folder, 0.05, cache).precision
    assert "float16 was not timed: the model at float16 mixes the samples" in chosen.why
    (times,) = [p for p in (cache / FOLDER).iterdir() if "seconds" in json.loads(p.read_text())]
    timed = json.loads(times.read_text())["seconds"]
    assert BFLOAT16 in timed and FLOAT16 not in timed
    again = with_precision(cap, "auto", folder, 0.05, cache).precision  # the times cached
    assert again.name == chosen.name and "float16 was not timed" in again.why


def test_a_relu_between_int8_units_lets_onnx_runtime_run_the_join_before_it_in_int8(
        tmp_path: Path) -> None:
    """A weightless ReLU unit after a residual add, between int8 units: quantized at its
    output's scale (zero point 0, which is the ReLU), so the add before it and the ReLU run in
    int8 inside a run (ONNX Runtime fuses QLinearAdd and keeps no float32 Add nor Relu).
    Left float32, as before, the add and the ReLU ran
    float32 with a dequantize and a quantize each side: 10% of resnet50's int8 time. The run
    still gives float32's answer within int8's error."""
    import onnx
    import onnxruntime as ort

    from core.runtimes.onnx_compose import UnitGraphs
    from core.runtimes.onnx_graphs import export_units
    from core.runtimes.ort_sessions import session_options
    from planner.graph.capture import capture
    from planner.models import load_model
    from planner.precision import _quantize_units

    torch.manual_seed(0)
    cap = capture(load_model(ModelSpec("tests.planner.factories:inplace_residual",
                                       input_shape=(3, 16, 16))))
    folder = tmp_path / "samples"
    folder.mkdir()
    np.save(folder / "x.npy", np.random.default_rng(0).normal(size=(48, 3, 16, 16))
            .astype(np.float32))
    samples = read_calibration(folder, "inplace_residual", cap.input_shape)
    graphs = export_units(cap)
    units = _quantize_units(cap, graphs, samples)
    stem, block, relu_unit, wide, narrow = cap.tree.children
    inner = block.branches[0].children[0]  # type: ignore[union-attr]
    assert set(units) == {u.name for u in (stem, inner, relu_unit, wide, narrow)}
    relu = units[relu_unit.name].graph.graph
    assert [n.op_type for n in relu.node] == ["QuantizeLinear", "DequantizeLinear"]
    zero = next(t for t in relu.initializer if t.name.endswith("zero_point"))
    assert onnx.numpy_helper.to_array(zero).item() == 0

    def session(int8: list[str], optimized: str = "") -> ort.InferenceSession:
        mixed = UnitGraphs(graphs.shapes, {**graphs.units, **{n: units[n].graph for n in int8}},
                           graphs.joins, graphs.failed)
        options = session_options(1)
        options.optimized_model_filepath = optimized
        return ort.InferenceSession(mixed.compose(cap.tree.children).SerializeToString(),
                                    options, providers=["CPUExecutionProvider"])

    optimized = str(tmp_path / "optimized.onnx")
    every = session(list(units), optimized)
    ops = [n.op_type for n in onnx.load(optimized).graph.node]
    assert "QLinearAdd" in ops
    assert not {"Add", "Relu"} & set(ops), ops
    # the ReLU in int8 moves the answer by no more than int8's rounding: the next unit
    # quantized its input at that scale anyway
    x = samples.held_out
    with torch.inference_mode():
        scale = float(np.abs(cap.model.module(torch.from_numpy(x)).numpy()).max())
    before = session([n for n in units if n != relu_unit.name]).run(None, {"x": x})[0]
    assert np.abs(every.run(None, {"x": x})[0] - before).max() <= 0.01 * scale
