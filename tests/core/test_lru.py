"""core.lru: the bounded caches, and values owned by an object kept apart by its identity."""

from __future__ import annotations

from core.lru import LRU, OwnedLRU


class Owner:
    """A stand-in for a table or a tree: equal to any other, distinct by identity."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Owner)

    __hash__ = object.__hash__


def test_the_least_recently_used_value_goes_first() -> None:
    cache: LRU[int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3


def test_owned_values_are_made_once_per_owner_and_never_given_for_another() -> None:
    cache: OwnedLRU[str] = OwnedLRU(4)
    made: list[str] = []

    def make(label: str):
        return lambda: made.append(label) or label

    one, two = Owner(), Owner()
    assert cache.get_or_make(one, 7, make("one")) == "one"
    assert cache.get_or_make(one, 7, make("again")) == "one"  # held: not made again
    assert cache.get_or_make(two, 7, make("two")) == "two"  # equal owner, same key: its own
    assert made == ["one", "two"]
    # an entry whose owner is not the one asking (as after an id is reused) is made anew
    cache._values.put((id(two), 8), (one, "stale"))
    assert cache.get_or_make(two, 8, make("fresh")) == "fresh"
    # bounded: the least recently used goes, and is made again when asked for
    for k in range(4):
        cache.get_or_make(one, ("k", k), make(f"k{k}"))
    assert cache.get_or_make(one, 7, make("remade")) == "remade"
