"""Bad models and bad input: one clear error naming the problem, exit code 2 from the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from service.commands import main
from core.errors import BatchMixingError, ModelError, TraceError, UsageError
from planner.graph.capture import capture
from core.loaded import ModelSpec
from core.shapes import parse_shape
from planner.models import load_model

F = "tests.planner.factories"


def _capture(name: str, shape: tuple[int, ...]) -> None:
    capture(load_model(ModelSpec(name, input_shape=shape)))


def test_an_op_that_mixes_samples_is_refused_by_name() -> None:
    with pytest.raises(BatchMixingError, match=r"'mean'.*mixes the samples"):
        _capture(f"{F}:mixes_samples", (3, 8, 8))


def test_a_batch_size_baked_into_an_op_is_refused() -> None:
    with pytest.raises(ModelError, match="reshape"):
        _capture(f"{F}:fixed_batch", (12,))


def test_data_dependent_control_flow_cannot_be_traced() -> None:
    with pytest.raises(TraceError, match="torch.fx cannot trace"):
        _capture(f"{F}:data_dependent", (4,))


def test_activations_that_overflow_a_half_precision_are_captured() -> None:
    """inf and NaN in an activation (float16's overflow) are no mixing of samples: the check
    compares them in place, its tolerance from the finite values (a NaN tolerance was a
    RuntimeError that stopped `vbs plan --precision auto` on resnet101)."""
    loaded = load_model(ModelSpec(f"{F}:overflows_in_half", input_shape=(4,), dtype="float16"))
    with torch.inference_mode():
        assert torch.isnan(loaded.module(torch.ones(2, 4, dtype=torch.float16))).all()
    assert len(capture(loaded).tree.children) >= 2


def test_a_factory_that_raises() -> None:
    with pytest.raises(ModelError, match="no checkpoint here"):
        load_model(ModelSpec(f"{F}:raises"))


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(ModelError, match="did you mean resnet50"):
        load_model(ModelSpec("resnet5O"))


def test_an_input_shape_the_model_rejects() -> None:
    with pytest.raises(ModelError, match="rejects input of shape"):
        _capture(f"{F}:two_layer", (4, 8, 8))


@pytest.mark.parametrize("text", ["", "3,-1,4", "a,b", "0"])
def test_bad_shapes(text: str) -> None:
    with pytest.raises(UsageError):
        parse_shape(text)


def test_weights_file_round_trip_and_mismatch(tmp_path) -> None:
    good = tmp_path / "good.pt"
    model = load_model(ModelSpec(f"{F}:two_layer", input_shape=(3, 8, 8))).module
    torch.save(model.state_dict(), good)
    again = load_model(ModelSpec(f"{F}:two_layer", input_shape=(3, 8, 8), weights=good)).module
    assert torch.equal(again.a.weight, model.a.weight)
    bad = tmp_path / "bad.pt"
    torch.save({"a.weight": torch.zeros(1)}, bad)
    with pytest.raises(ModelError, match="do not fit the model"):
        load_model(ModelSpec(f"{F}:two_layer", weights=bad))
    with pytest.raises(ModelError, match="no weights file"):
        load_model(ModelSpec(f"{F}:two_layer", weights=tmp_path / "missing.pt"))


def test_cli_prints_one_line_and_exits_2(capsys) -> None:
    assert main(["graph", "--model", f"{F}:mixes_samples", "--input-shape", "3,8,8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vbs graph: error:") and "Traceback" not in err[0]


def test_cli_debug_shows_the_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "service.commands", "--debug", "graph", "--model", "nope_net"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_cli_batch_max_below_one_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", "c3d", "--batch-max", "0"])
    assert exc.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_sub_batches_may_differ_as_much_as_the_arithmetic_allows() -> None:
    """cuDNN picks another algorithm per batch size and computes float32 convolutions in TF32
    by default (10 bits of mantissa): its sub-batches differ from the whole batch by ~1e-3 of
    the values, which is the arithmetic, not an op mixing samples (seen on an H200). On the CPU
    and without TF32 the check stays tight."""
    from planner.graph import inspect

    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.backends.cudnn.flags(allow_tf32=True):
            assert (inspect.arithmetic_tolerance(torch.float32, "cuda")
                    == inspect.arithmetic_tolerance(torch.float16, "cpu"))
            assert inspect.arithmetic_tolerance(torch.float32, "cpu") == (1e-3, 1e-4)
        with torch.backends.cudnn.flags(allow_tf32=False):
            assert inspect.arithmetic_tolerance(torch.float32, "cuda") == (1e-3, 1e-4)
            torch.backends.cuda.matmul.allow_tf32 = True
            assert inspect.arithmetic_tolerance(torch.float32, "cuda") == (1e-2, 1e-2)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
