"""A model planned in int8 (`vbs plan --precision int8 --calibration DIR`) served beside its
float32 tables under another name: `/models`, the OIP metadata and config and `/plan` say each
one's precision, and both answer (the accuracy is tests/workers/test_precision.py's), by the
worker without torch and by the torch worker (the int8 graphs `vbs plan` stored); and one planned
in bfloat16 or float16 served beside them by the torch worker. No precision or calibration
samples are set when serving: each name is served at what `vbs plan` planned it at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from core.precision import FLOAT_TOLERANCE, GUARD_SLACK
from service.commands import main
from service.main import create_app
from tests.service.conftest import run, running

pytest.importorskip("sklearn")  # the test extra: scikit-learn's bundled digits
from tests.planner.digits import digits, factory, train  # noqa: E402

NAME = "tests.planner.digits:factory@1x16x16"


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained digits CNN planned twice into one store: ``d8`` with int8 units, ``d32`` in
    float32 (the store, its weights ``w.pt`` and the cache beside it)."""
    root = tmp_path_factory.mktemp("planned")
    x, y = digits()
    weights, folder = root / "w.pt", root / "calibration"
    torch.save(train(x[:600], y[:600], epochs=3).state_dict(), weights)
    folder.mkdir()
    np.save(folder / "samples.npy", x[600:664])
    common = ["--weights", str(weights), "--batch-max", "4", "--store", str(root / "store"),
              "--cache-dir", str(root / "cache"), "--select-rounds", "1", "--quiet"]
    assert main(["plan", "--model", f"d8={NAME}", "--precision", "int8", "--calibration",
                 str(folder), *common]) == 0
    assert main(["plan", "--model", f"d32={NAME}", *common]) == 0
    return root


def test_int8_and_float32_served_side_by_side_say_their_precision(
        make_settings: Any, planned: Path) -> None:
    x, _ = digits()
    settings = make_settings(models=[f"d8={NAME}", f"d32={NAME}"], weights=planned / "w.pt",
                             cache_dir=planned / "cache", store=planned / "store")
    sample = np.ascontiguousarray(x[700:702])

    async def body() -> None:
        async with running(create_app(settings)) as client:
            models = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
            int8 = models["d8"]["precision"]
            assert int8["precision"] == "int8" and int8["int8"] and int8["held_out"] == 16
            assert models["d32"]["precision"]["precision"] == "float32"
            for name, want in (("d8", "int8"), ("d32", "float32")):
                meta = (await client.get(f"/v2/models/{name}")).json()
                assert meta["parameters"]["precision"] == want
                config = (await client.get(f"/v2/models/{name}/config")).json()
                assert config["parameters"]["precision"] == {"string_value": want}
                plan = (await client.get("/plan", params={"model": name, "mem": "1GB",
                                                          "batch": 2})).json()
                units = {u["precision"] for u in plan["plan"]["units"]}
                assert ("int8" in units) if want == "int8" else units == {"float32"}
                body = {"inputs": [{"name": "input", "shape": [2, 1, 16, 16],
                                    "datatype": "FP32", "data": sample.ravel().tolist()}]}
                answer = await client.post(f"/v2/models/{name}/infer", json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["outputs"][0]["shape"] == [2, 10]

    run(body())


def test_int8_served_by_the_torch_worker_runs_the_graphs_vbs_plan_stored(
        make_settings: Any, planned: Path) -> None:
    """Served with torch (VBS_LEAN=off), no precision or calibration samples set: the int8
    model is captured with the int8 graphs `vbs plan` stored, not at float32 under the int8
    name (where the float32 model's tables would be found) nor quantized again, so its
    planned tables are found (nothing planned at load); it answers as the worker without
    torch does, within what the guard allows, and the float32 model beside it stays so."""
    x, _ = digits()
    sample = np.ascontiguousarray(x[700:708])
    body = {"inputs": [{"name": "input", "shape": [8, 1, 16, 16], "datatype": "FP32",
                        "data": sample.ravel().tolist()}]}
    answers: dict[str, np.ndarray] = {}

    async def served(lean: str) -> None:
        settings = make_settings(models=[f"d8={NAME}", f"d32={NAME}"], weights=planned / "w.pt",
                                 cache_dir=planned / "cache", store=planned / "store", lean=lean)
        async with running(create_app(settings)) as client:
            models = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
            torch_worker = "the captured torch model"
            assert (models["d8"]["runs_on"] == torch_worker) == (lean == "off")
            assert models["d8"]["precision"]["precision"] == "int8"
            assert models["d8"]["table"]["kind"] == "planned"
            assert models["d32"]["precision"]["precision"] == "float32"
            answer = await client.post("/v2/models/d8/infer", json=body)
            assert answer.status_code == 200, answer.text
            answers[lean] = np.asarray(answer.json()["outputs"][0]["data"],
                                       np.float32).reshape(8, 10)
            if lean == "off":
                answers["error"] = np.float32(models["d8"]["precision"]["error"])

    async def both() -> None:
        await served("auto")
        await served("off")

    run(both())
    scale = max(1.0, float(np.abs(answers["auto"]).max()))
    tolerance = FLOAT_TOLERANCE + GUARD_SLACK * float(answers["error"])
    assert np.abs(answers["off"] - answers["auto"]).max() <= tolerance * scale
    assert answers["off"].argmax(1).tolist() == answers["auto"].argmax(1).tolist()


def test_a_precision_named_when_serving_is_served_whatever_was_planned(
        make_settings: Any, planned: Path) -> None:
    """`vbs serve --precision float32` (VBS_PRECISION named) serves the float32 table of a name
    `vbs plan` planned int8: by the torch worker, the float32 model's tables found (nothing
    planned at load), not the int8 compiled model; named `auto`, the planned int8 one."""
    async def served(precision: str) -> dict[str, Any]:
        settings = make_settings(models=[f"d8={NAME}"], weights=planned / "w.pt",
                                 cache_dir=planned / "cache", store=planned / "store",
                                 precision=precision)
        async with running(create_app(settings)) as client:
            (entry,) = (await client.get("/models")).json()["models"]
            return entry

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        return await served("float32"), await served("auto")

    named, auto = run(both())
    assert named["precision"]["precision"] == "float32"
    assert named["runs_on"] == "the captured torch model" and named["table"]["kind"] == "planned"
    assert auto["precision"]["precision"] == "int8"
    assert auto["runs_on"] == "compiled ONNX graphs, without torch"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_served_by_the_torch_worker_says_its_precision(
        make_settings: Any, planned: Path, dtype: str) -> None:
    """`vbs plan --precision bfloat16|float16` under a name of its own, served beside the
    float32 and int8 models with no precision or calibration samples set: the torch worker
    captures it at the dtype `vbs plan` recorded for that name and finds the tables planned
    for it (the same fingerprint: nothing planned at load), and `/models`, the OIP metadata
    and `/plan` say it; the answer (float32 sent) is the half model's; the others keep
    theirs."""
    x, _ = digits()
    model = factory()
    model.load_state_dict(torch.load(planned / "w.pt", weights_only=True))
    common = ["--weights", str(planned / "w.pt"), "--batch-max", "4", "--store",
              str(planned / "store"), "--cache-dir", str(planned / "cache"), "--select-rounds",
              "1", "--quiet"]
    # the name planned in float32 first: its compiled model stays in the store, an older plan's
    assert main(["plan", "--model", f"b16={NAME}", *common]) == 0
    assert main(["plan", "--model", f"b16={NAME}", "--precision", dtype, "--calibration",
                 str(planned / "calibration"), *common]) == 0
    settings = make_settings(models=[f"b16={NAME}", f"d32={NAME}", f"d8={NAME}"],
                             weights=planned / "w.pt", cache_dir=planned / "cache",
                             store=planned / "store")
    sample = np.ascontiguousarray(x[700:702])

    async def body() -> None:
        async with running(create_app(settings)) as client:
            models = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
            entry = models["b16"]
            assert entry["precision"]["precision"] == dtype
            assert entry["runs_on"] == "the captured torch model"
            # nor estimated before its load from that older plan's compiled model
            assert "planned_load" not in entry and "planned_load" in models["d8"]
            assert entry["table"]["kind"] == "planned" and entry["table"]["version"] == 1
            assert models["d32"]["precision"]["precision"] == "float32"
            assert models["d8"]["precision"]["precision"] == "int8"
            meta = (await client.get("/v2/models/b16")).json()
            assert meta["parameters"]["precision"] == dtype
            plan = (await client.get("/plan", params={"model": "b16", "mem": "1GB",
                                                      "batch": 2})).json()
            assert {u["precision"] for u in plan["plan"]["units"]} == {dtype}
            body = {"inputs": [{"name": "input", "shape": [2, 1, 16, 16], "datatype": "FP32",
                                "data": sample.ravel().tolist()}]}
            answer = await client.post("/v2/models/b16/infer", json=body)
            assert answer.status_code == 200, answer.text
            got = np.asarray(answer.json()["outputs"][0]["data"], np.float32).reshape(2, 10)
            with torch.inference_mode():
                half = getattr(torch, dtype)
                own = model.eval().to(half)(torch.from_numpy(sample).to(half)).float().numpy()
            assert np.abs(got - own).max() <= 1e-2 * max(1.0, float(np.abs(own).max()))
            assert got.argmax(1).tolist() == own.argmax(1).tolist()

    run(body())
