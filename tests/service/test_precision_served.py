"""A model planned in int8 (`vbs plan --precision int8 --calibration DIR`) served beside its
float32 tables under another name: `/models`, the OIP metadata and config and `/plan` say each
one's precision, and both answer (the accuracy is tests/workers/test_precision.py's); and one
planned and served in bfloat16 or float16 by the torch worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.commands import main
from service.main import create_app
from tests.service.conftest import run, running

pytest.importorskip("sklearn")  # the test extra: scikit-learn's bundled digits
from tests.planner.digits import digits, train  # noqa: E402

NAME = "tests.planner.digits:factory@1x16x16"


def test_int8_and_float32_served_side_by_side_say_their_precision(
        make_settings: Any, tmp_path: Path) -> None:
    x, y = digits()
    weights, folder = tmp_path / "w.pt", tmp_path / "calibration"
    torch.save(train(x[:600], y[:600], epochs=3).state_dict(), weights)
    folder.mkdir()
    np.save(folder / "samples.npy", x[600:664])
    common = ["--weights", str(weights), "--batch-max", "4", "--store", str(tmp_path / "store"),
              "--cache-dir", str(tmp_path / "cache"), "--select-rounds", "1", "--quiet"]
    assert main(["plan", "--model", f"d8={NAME}", "--precision", "int8", "--calibration",
                 str(folder), *common]) == 0
    assert main(["plan", "--model", f"d32={NAME}", *common]) == 0
    settings = make_settings(models=[f"d8={NAME}", f"d32={NAME}"], weights=weights,
                             cache_dir=tmp_path / "cache")
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_served_by_the_torch_worker_says_its_precision(
        make_settings: Any, tmp_path: Path, dtype: str) -> None:
    """`vbs plan --precision bfloat16|float16` and `vbs serve` with VBS_PRECISION set so and
    the same samples: the torch worker captures the model at that dtype and finds the tables
    planned for it (the same fingerprint: nothing planned at load), and `/models`, the OIP
    metadata and `/plan` say it; the answer (float32 sent) is the half model's."""
    x, y = digits()
    weights, folder = tmp_path / "w.pt", tmp_path / "calibration"
    model = train(x[:600], y[:600], epochs=3)
    torch.save(model.state_dict(), weights)
    folder.mkdir()
    np.save(folder / "samples.npy", x[600:664])
    assert main(["plan", "--model", f"b16={NAME}", "--precision", dtype, "--calibration",
                 str(folder), "--weights", str(weights), "--batch-max", "4", "--store",
                 str(tmp_path / "store"), "--cache-dir", str(tmp_path / "cache"),
                 "--select-rounds", "1", "--quiet"]) == 0
    settings = make_settings(models=[f"b16={NAME}"], weights=weights,
                             cache_dir=tmp_path / "cache", precision=dtype,
                             calibration=folder)
    sample = np.ascontiguousarray(x[700:702])

    async def body() -> None:
        async with running(create_app(settings)) as client:
            (entry,) = (await client.get("/models")).json()["models"]
            assert entry["precision"]["precision"] == dtype
            assert entry["table"]["kind"] == "planned" and entry["table"]["version"] == 1
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
