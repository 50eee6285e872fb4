"""What loaded models keep, counted by the device's one owner of memory
(``DeviceMemory.model_loaded`` / ``model_unloaded`` / ``models_capacity``) on a recorded
cgroup and under a configured total: the capacity the models share, the plans' budget under
the total, and the idle working set moved by a load or an unload while requests are held (it
cannot be read then) and read again once nothing is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.cgroups import IDLE, LIMIT, MiB, Recorded, table_of
from workers.device_memory import DeviceMemory

MARGIN = 32 * MiB
WEIGHTS = 100 * MiB


@pytest.fixture
def recorded(tmp_path: Path) -> Recorded:
    return Recorded(tmp_path)


def _memory(recorded: Recorded, total: int = 0) -> DeviceMemory:
    memory = DeviceMemory("cpu", margin=MARGIN, read=recorded.read, trim=lambda: None,
                          total=total)
    table = table_of(16 * MiB)
    memory.register("m", lambda: table, lambda: 0)
    return memory


def test_under_a_cgroup_the_models_share_the_limit_less_what_the_process_holds(
        recorded: Recorded) -> None:
    memory = _memory(recorded)
    assert memory.growth == 2.0 and memory.kept() == {}
    assert memory.models_capacity() == LIMIT - MARGIN - IDLE
    recorded.use(IDLE + WEIGHTS)  # the model's weights are in the group now, nothing held
    memory.model_loaded("m", WEIGHTS)
    assert memory.kept() == {"m": WEIGHTS}
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS  # read again
    assert memory.models_capacity() == LIMIT - MARGIN - IDLE  # what they keep is theirs
    recorded.use(IDLE)
    memory.model_unloaded("m", WEIGHTS)
    assert memory.kept() == {} and memory.report().idle_working_set_bytes == IDLE


def test_a_load_while_requests_are_held_moves_the_idle_working_set(recorded: Recorded) -> None:
    memory = _memory(recorded)
    ticket = memory.admit("m", 4 * MiB)
    assert ticket is not None
    recorded.use(IDLE + WEIGHTS + 4 * MiB)
    memory.model_loaded("m", WEIGHTS)  # cannot be read now: moved by what the model keeps
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS
    memory.model_unloaded("m", WEIGHTS // 2)  # gave back only half, as measured
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS // 2
    recorded.use(IDLE + WEIGHTS // 2)
    memory.done(ticket)  # nothing held: read again
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS // 2
    # what the process holds besides its models stays in the capacity's figure
    assert memory.models_capacity() == LIMIT - MARGIN - IDLE - WEIGHTS // 2


def test_a_configured_total_holds_the_models_and_their_plans(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")  # no cgroup limit
    total = 256 * MiB
    memory = _memory(recorded, total=total)
    assert memory.growth == 1.0
    assert memory.models_capacity() == total - MARGIN
    assert memory.plan_free() == total - MARGIN
    memory.model_loaded("m", WEIGHTS)
    assert memory.plan_free() == total - WEIGHTS - MARGIN  # plans get what the models leave
    assert memory.budget() == total - WEIGHTS - MARGIN
    memory.model_unloaded("m", WEIGHTS)
    assert memory.plan_free() == total - MARGIN


def test_without_any_limit_the_device_free_memory_bounds_them(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")
    memory = _memory(recorded)
    memory.probe.source = lambda: 1024 * MiB  # the device's reading
    assert memory.models_capacity() == 1024 * MiB - MARGIN
    memory.model_loaded("m", WEIGHTS)
    memory.probe.source = lambda: 1024 * MiB - WEIGHTS  # its weights came off the reading
    assert memory.models_capacity() == 1024 * MiB - MARGIN  # and count as theirs
