"""What loaded models keep, counted by the device's one owner of memory
(``DeviceMemory.models``: ``loaded`` / ``unloaded`` / ``capacity`` / ``fit``) on a recorded
cgroup and under a configured total: the capacity the models share, the plans' budget under
the total, and the idle working set moved by a load or an unload while requests are held (it
cannot be read then) and read again once nothing is."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

from tests.workers.cgroups import IDLE, LIMIT, MiB, Recorded, table_of
from workers.device_memory import DeviceMemory
from workers.ledger import RESERVE_SHARE
from workers.models_memory import ModelCost

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
    assert memory.growth == 2.0 and memory.models.kept() == {}
    assert memory.models.capacity() == LIMIT - MARGIN - IDLE
    recorded.use(IDLE + WEIGHTS)  # the model's weights are in the group now, nothing held
    memory.models.loaded("m", WEIGHTS)
    assert memory.models.kept() == {"m": WEIGHTS}
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS  # read again
    assert memory.models.capacity() == LIMIT - MARGIN - IDLE  # what they keep is theirs
    memory.models.unloading("m")
    recorded.use(IDLE)
    assert memory.models.unloaded("m") == (WEIGHTS, WEIGHTS)
    assert memory.models.kept() == {} and memory.report().idle_working_set_bytes == IDLE


def test_a_load_while_requests_are_held_moves_the_idle_working_set(recorded: Recorded) -> None:
    memory = _memory(recorded)
    ticket = memory.admit("m", 4 * MiB)
    assert ticket is not None
    recorded.use(IDLE + WEIGHTS + 4 * MiB)
    memory.models.loaded("m", WEIGHTS)  # cannot be read now: moved by what the model keeps
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS
    memory.models.unloading("m")
    recorded.use(IDLE + WEIGHTS // 2 + 4 * MiB)
    assert memory.models.unloaded("m") == (WEIGHTS // 2, WEIGHTS)  # only half, as measured
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS // 2
    recorded.use(IDLE + WEIGHTS // 2)
    memory.done(ticket)  # nothing held: read again
    assert memory.report().idle_working_set_bytes == IDLE + WEIGHTS // 2
    # what the process holds besides its models stays in the capacity's figure
    assert memory.models.capacity() == LIMIT - MARGIN - IDLE - WEIGHTS // 2


def test_a_configured_total_holds_the_models_and_their_plans(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")  # no cgroup limit
    total = 256 * MiB
    memory = _memory(recorded, total=total)
    assert memory.growth == 1.0
    assert memory.models.capacity() == total - MARGIN
    assert memory.plan_free() == total - MARGIN
    memory.models.loaded("m", WEIGHTS)
    assert memory.plan_free() == total - WEIGHTS - MARGIN  # plans get what the models leave
    assert memory.budget() == total - WEIGHTS - MARGIN
    memory.models.unloading("m")
    assert memory.models.unloaded("m") == (WEIGHTS, WEIGHTS)  # no group: all it kept
    assert memory.plan_free() == total - MARGIN


def test_without_any_limit_the_device_free_memory_bounds_them(recorded: Recorded) -> None:
    (recorded.group / "memory.max").write_text("max\n")
    memory = _memory(recorded)
    memory.probe.source = lambda: 1024 * MiB  # the device's reading
    assert memory.models.capacity() == 1024 * MiB - MARGIN
    memory.models.loaded("m", WEIGHTS)
    memory.probe.source = lambda: 1024 * MiB - WEIGHTS  # its weights came off the reading
    assert memory.models.capacity() == 1024 * MiB - MARGIN  # and count as theirs


def test_what_a_model_keeps_is_the_larger_of_its_parts_and_the_groups_growth(
        recorded: Recorded) -> None:
    memory = _memory(recorded)
    memory.models.loading("m")  # the group read as the load begins
    recorded.use(IDLE + 3 * WEIGHTS)  # the load grew the group by more than its parts say
    assert memory.models.loaded("m", WEIGHTS) == 3 * WEIGHTS
    assert memory.models.kept() == {"m": 3 * WEIGHTS}


def test_overlapping_loads_share_the_groups_growth_by_their_parts(recorded: Recorded) -> None:
    """Loads under way together each see the others' growth: none is counted at the growth
    it saw (at start five models counted at the five's growth each made every one look too
    large, and all were unloaded); what the group grew by beyond their parts is shared."""
    memory = _memory(recorded)
    memory.models.loading("a")
    memory.models.loading("b")
    recorded.use(IDLE + 5 * WEIGHTS)  # a loaded: 5 parts' worth grown, b's load included
    assert memory.models.loaded("a", 2 * WEIGHTS) == 2 * WEIGHTS  # its parts: b still loads
    memory.models.load_ended("a")  # the residency's end of every load: counted once
    recorded.use(IDLE + 6 * WEIGHTS)
    # the last one ended: 6 grown, 3 by their parts; the 3 beyond shared 2:1
    assert memory.models.loaded("b", WEIGHTS) == 2 * WEIGHTS
    assert memory.models.kept() == {"a": 4 * WEIGHTS, "b": 2 * WEIGHTS}
    # a load alone afterwards is counted at the growth it saw again
    memory.models.loading("c")
    recorded.use(IDLE + 9 * WEIGHTS)
    assert memory.models.loaded("c", WEIGHTS) == 3 * WEIGHTS


def test_which_models_fit_is_the_memory_owners_answer(recorded: Recorded) -> None:
    memory = _memory(recorded)
    capacity = memory.models.capacity()
    small = ModelCost("a", keeps=WEIGHTS, one_sample=8 * MiB, working=64 * MiB)
    fit = memory.models.fit([small])
    assert fit.capacity == capacity and fit.growth == memory.growth == 2.0
    assert fit.reserve == capacity // RESERVE_SHARE  # under a limit, for requests' bodies
    assert fit.need == WEIGHTS + 2 * 8 * MiB and fit.fits
    assert memory.models.fit([small], working=True).need == WEIGHTS + 2 * 64 * MiB
    assert memory.models.never_fits(small) is None
    huge = ModelCost("b", keeps=capacity, one_sample=8 * MiB, working=8 * MiB)
    assert not memory.models.fit([huge]).fits
    why = memory.models.never_fits(huge)
    assert why is not None and "raise the memory limit" in why and str(capacity) in why
    # a loaded model counts what it kept, not its estimate
    memory.models.loaded("b", 4 * MiB)
    assert memory.models.fit([huge]).kept == 4 * MiB


def test_a_load_has_room_to_make_its_largest_session(recorded: Recorded) -> None:
    """A model about to load needs free what making its largest session asks (ONNX Runtime's
    SESSION_GROWTH x weights) beyond what it then keeps, beside what the others keep: the
    residency unloads idle models for it (issue 57: resnet34's session, never made beside four
    idle models, and every one of its requests a 503). Once loaded, it counts what it keeps."""
    memory = _memory(recorded)
    capacity = memory.models.capacity()
    making, session = capacity // 2, WEIGHTS // 2
    # its session (given back before it is made again) is part of what it keeps; its weights
    # and batch buffer stay while the session is made (what ort_sessions asks free beside them)
    big = ModelCost("big", keeps=WEIGHTS, one_sample=MiB, working=MiB, making=making,
                    made=session)
    assert big.remaking == making - session
    alone = memory.models.fit([big], loading="big")
    assert alone.need == WEIGHTS + (making - session) and alone.fits
    # not made at its last load (nothing to give back): the whole making beside what it keeps
    assert dataclasses.replace(big, made=0).remaking == making
    others = [ModelCost(f"o{i}", keeps=capacity // 5, one_sample=MiB, working=MiB)
              for i in range(3)]
    assert memory.models.fit([*others, big]).fits  # loaded: what it keeps and a plan
    assert not memory.models.fit([*others, big], loading="big").fits  # loading: its session
    assert memory.models.fit([*others, big], loading="o0").fits  # o0 makes none so large
    assert memory.models.never_fits(big) is None


def test_a_loads_place_is_held_until_the_load_ends(recorded: Recorded) -> None:
    memory = _memory(recorded)
    cost = ModelCost("m", keeps=WEIGHTS, one_sample=16 * MiB, working=16 * MiB)
    assert memory.models.admit_load(cost)
    assert memory.report().held_bytes == WEIGHTS  # counted as in the group at once
    memory.models.load_ended("m")
    assert memory.report().held_bytes == 0
    assert memory.models.admit_load(cost)
    recorded.use(IDLE + WEIGHTS)
    memory.models.loaded("m", WEIGHTS)  # its place goes with the load
    assert memory.report().held_bytes == 0 and memory.models.kept() == {"m": WEIGHTS}
    memory.models.load_ended("m")  # once
    assert memory.report().held_bytes == 0
