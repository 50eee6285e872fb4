"""The allocator rule: expandable segments unless the user chose their own settings (on a GPU,
tests/gpu checks that every plan then allocates no more than its claim)."""

from __future__ import annotations

import logging

import pytest
import torch

from core import cuda_allocator


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cuda_allocator, "_done", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    asked: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", asked.append)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", asked.append, raising=False)
    return asked


def test_blocks_split_exactly_unless_the_user_chose(fresh) -> None:
    assert cuda_allocator.split_exactly()
    assert cuda_allocator.split_exactly()  # once per process
    assert fresh == ["expandable_segments:True"]


def test_the_users_settings_are_kept_and_a_missing_split_is_named(fresh, monkeypatch,
                                                                  caplog) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    with caplog.at_level(logging.WARNING, logger="core.cuda_allocator"):
        assert not cuda_allocator.split_exactly()
    assert fresh == []
    assert "expandable_segments:True" in caplog.text and "max_split_size_mb:128" in caplog.text
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    assert cuda_allocator.split_exactly() and fresh == []
