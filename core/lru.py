"""The one bounded least-recently-used cache of vbs-serve, for answers that depend only on
what they are keyed by (a table's programs, a table's times per budget, a model's /plan
answers), and its form for values that belong to an object and are keyed by its identity
(``OwnedLRU``: a table's costs, a tree's index).

Thread-safe: the lock is held only to read and to store, never while a value is made, so two
threads may make the same value once each; the last stored wins, and both are equal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRU(Generic[V]):
    """At most ``size`` values by key; storing one more forgets the least recently used."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an LRU holds at least one value, not {size}")
        self.size = size
        self._values: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: Hashable) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._values.get(key)
            if found is not None:
                self._values.move_to_end(key)
            return found

    def put(self, key: Hashable, value: V) -> V:
        """Store ``value`` as the most recently used; returns it."""
        with self._lock:
            self._values[key] = value
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every value (what they depend on changed)."""
        with self._lock:
            self._values.clear()

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key``, made by ``make()`` and stored when it is not held."""
        found = self.get(key)
        return found if found is not None else self.put(key, make())


class OwnedLRU(Generic[V]):
    """At most ``size`` values, each belonging to an object (a table, a tree) and keyed by its
    identity and a key. The object is kept beside its value, so its id is not reused by
    another object while the entry lives, and a value is never given for the wrong one."""

    def __init__(self, size: int) -> None:
        self._values: LRU[tuple[object, V]] = LRU(size)

    def get_or_make(self, owner: object, key: Hashable, make: Callable[[], V]) -> V:
        """The value of ``key`` for ``owner``, made by ``make()`` and stored when not held."""
        found = self._values.get((id(owner), key))
        if found is not None and found[0] is owner:
            return found[1]
        return self._values.put((id(owner), key), (owner, make()))[1]
