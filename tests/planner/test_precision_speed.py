"""`auto`'s timing of a model's precisions: every candidate called at each batch a server
forms, the sizes weighed alike per sample. A clock the runs advance stands in for time, so the
arithmetic is checked, not this machine's speed."""

from __future__ import annotations

import types

import numpy as np
import pytest

import planner.precision_speed as speed


def test_each_candidate_is_timed_at_every_served_batch_size_and_priced_per_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    # seconds a call: "flat" pays the same per sample at every size; "batched" gains at 4 only,
    # which timing 1 and 8 alone cannot see
    per_call = {"flat": lambda b: 0.010 * b, "batched": lambda b: 0.005 * b if b == 4
                else 0.0105 * b}
    calls: dict[str, list[int]] = {name: [] for name in per_call}

    def run(name: str):
        def call(x: np.ndarray) -> None:
            calls[name].append(len(x))
            now[0] += per_call[name](len(x))
        return call

    seconds, by_size = speed._per_sample({n: run(n) for n in per_call},
                                         np.zeros((1, 3, 4, 4), np.float32))
    assert speed.SIZES == (1, 2, 4, speed.BATCH) and speed.BATCH == 8
    for name in per_call:  # warm-up and measured rounds, every size in each
        assert sorted(set(calls[name])) == list(speed.SIZES)
        assert len(calls[name]) == len(speed.SIZES) * (speed.WARMUP + speed.ROUNDS)
    assert seconds["flat"] == pytest.approx(0.010, abs=1e-6)  # per sample, each sample alike
    assert seconds["batched"] == pytest.approx((0.0105 * (1 + 2 + 8) + 0.005 * 4) / 15,
                                                abs=1e-6)
    assert seconds["batched"] < seconds["flat"]  # 1 and 8 alone would say the opposite
    assert by_size["batched"] == pytest.approx({"1": 0.0105, "2": 0.0105, "4": 0.005,
                                                "8": 0.0105})
