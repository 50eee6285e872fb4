"""The worker without torch by default on the CPU (``VBS_LEAN=auto``), even where torch is
installed: a model `vbs plan` compiled with tables that run so is served from the store, and
what `vbs plan` measured it keeps is its cost before its first load; a model whose store holds
no such form (planned with ``--runtime torch``) falls back to torch, as does ``VBS_LEAN=off``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from core.spec import ModelSpec
from planner.store import open_store
from planner.stored import compiled_key
from service.commands import main
from service.main import create_app
from tests.planner.factories import two_layer
from tests.service.conftest import TINY, TINY_SHAPE, run, running
from workers.load_cost import read_load

LEAN = "compiled ONNX graphs, without torch"
TORCH = "the captured torch model"


NAME = TINY.split("=")[1].split("@")[0]


@pytest.fixture
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vbs_cache: Path) -> Any:
    """`vbs plan` of the tiny model, with weights of its own, into a store, as the service's
    settings would plan it; returns (store, weights file, the model)."""
    for name, value in {"VBS_PROFILE_REPEATS": "1", "VBS_PROFILE_WARMUP": "0",
                        "VBS_SLOT_COUNT": "64", "VBS_CACHE_DIR": str(vbs_cache)}.items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(7)
    model = two_layer().eval()
    weights = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), weights)

    def plan(*extra: str) -> tuple[Path, Path, torch.nn.Module]:
        store = tmp_path / "store"
        assert main(["plan", "--model", TINY, "--batch-max", "4", "--store", str(store),
                     "--weights", str(weights), "--quiet", *extra]) == 0
        return store, weights, model
    return plan


def _served(make_settings: Any, planned: tuple[Path, Path, torch.nn.Module], **settings: Any
            ) -> dict[str, Any]:
    """How the service describes the model, after answering a request with ``model(x)``."""
    store, weights, model = planned
    x = np.random.default_rng(0).standard_normal((3, *TINY_SHAPE)).astype(np.float32)

    async def body() -> tuple[dict[str, Any], np.ndarray]:
        app = create_app(make_settings(store=store, weights=weights, **settings))
        async with running(app) as client:
            described = (await client.get("/models")).json()["models"][0]
            answer = await client.post("/v2/models/tiny/infer", json={"inputs": [{
                "name": "input", "shape": list(x.shape), "datatype": "FP32",
                "data": x.ravel().tolist()}]})
            assert answer.status_code == 200, answer.text
            out = answer.json()["outputs"][0]
            return described, np.asarray(out["data"], np.float32).reshape(out["shape"])

    described, got = run(body())
    with torch.inference_mode():
        want = model(torch.from_numpy(x)).numpy()
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), np.abs(got - want).max()
    return described


def test_a_compiled_model_is_served_without_torch_by_default(plan: Any, make_settings: Any
                                                             ) -> None:
    planned = plan()
    with open_store(str(planned[0])) as st:
        recorded = read_load(st, st.get_model(compiled_key("tiny", ModelSpec(
            NAME, input_shape=TINY_SHAPE))))
    assert recorded is not None
    described = _served(make_settings, planned)
    assert described["runs_on"] == LEAN, described
    # known before the load, from the store: what `vbs plan` measured the model keeps
    assert described["planned_load"] == {"kept_bytes": recorded.kept_bytes,
                                         "making_bytes": recorded.making_bytes,
                                         "making_factor": recorded.making_factor,
                                         "load_s": recorded.load_s}
    assert described["kept_bytes"] >= recorded.weights_bytes


def test_a_model_planned_for_torch_alone_is_served_with_torch(plan: Any, make_settings: Any
                                                              ) -> None:
    # no ONNX Runtime figures: its plans run torch steps, which the worker without torch cannot
    planned = plan("--runtime", "torch")
    with open_store(str(planned[0])) as st:
        recorded = read_load(st, st.get_model(compiled_key("tiny", ModelSpec(
            NAME, input_shape=TINY_SHAPE))))
    # what the default worker keeps of it is known before its load: torch's import counted
    # (hundreds of MB, where the model's weights are a few KB), as `vbs plan` measured it
    assert recorded is not None and recorded.with_torch
    assert recorded.kept_bytes > 100 * 2**20 > recorded.weights_bytes > 0
    described = _served(make_settings, planned, runtime="torch")
    assert described["runs_on"] == TORCH, described
    assert described["planned_load"]["kept_bytes"] == recorded.kept_bytes


def test_lean_off_serves_a_compiled_model_with_torch(plan: Any, make_settings: Any) -> None:
    described = _served(make_settings, plan(), lean="off")
    assert described["runs_on"] == TORCH, described
