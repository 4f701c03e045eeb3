"""The run-time state: every store, cache and lock the package keeps from one call to the next, as the named
members of one object, ``STATE`` (docs/design.md, "State kept across calls", is its table; a test holds the two
equal).

A module declares each store here where it defines it and keeps using it by its module name::

    _RUNTIME = STATE.add("report.runtime", {})
    @STATE.cached("rules.layer_index", 4096)
    def layer_index(path): ...

``STATE.reset()`` (``sparse_compile.extend.reset_state``) empties every member in place but the kept ones (the
registered methods and the functions registered with transformers are definitions; a live model's settings go
with the model), which leaves what a fresh import has. One fork hook renews every lock in a child process (a thread
that held one at the fork cannot leave the child waiting). ``BoundedLRU`` is the one least-recently-used store of a
fixed size. The kernels (below the package) keep a few stores of their own: they are members too, read where their
module is loaded, so naming them loads no kernel module.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Optional

__all__ = ["STATE", "State", "Member", "BoundedLRU", "Lock", "Value", "WITH_MODEL"]

WITH_MODEL = "a live model's setting: it goes with the model"  # why reset keeps the per-model members


class BoundedLRU:
    """At most ``maxsize`` entries; reaching a new key past it drops the least recently used one. ``get`` and
    ``touch`` count as a use, ``peek`` and ``in`` do not."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"BoundedLRU: maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def get(self, key: Hashable, default: Any = None) -> Any:
        if key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key]

    def peek(self, key: Hashable, default: Any = None) -> Any:
        return self._data.get(key, default)

    def touch(self, key: Hashable) -> bool:
        """Whether ``key`` is held; if so it is now the most recently used."""
        if key not in self._data:
            return False
        self._data.move_to_end(key)
        return True

    def put(self, key: Hashable, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self._data.pop(key, default)

    def clear(self) -> None:
        self._data.clear()


class Lock:
    """A ``threading.Lock`` that the fork hook replaces in a child process (held by another thread at the fork,
    the child's copy would never be released)."""

    __slots__ = ("_lock", "_held", "__weakref__")

    def __init__(self) -> None:
        self._lock = self._held = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> bool:
        lock = self._lock
        lock.acquire()
        self._held = lock  # released as acquired: a block that forked, in the child, leaves the child's new lock
        return True

    def __exit__(self, *exc) -> None:
        self._held.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _renew(self) -> None:
        self._lock = threading.Lock()


_LOCKS: "weakref.WeakSet[Lock]" = weakref.WeakSet()  # every Lock, the members' and each DensityHistory's


class Value:
    """One value (a flag, a loaded file, a default) that ``reset`` puts back to ``initial``. Tests may replace
    ``.value`` (``monkeypatch.setattr(STATE["breakeven.tables"], "value", table)``)."""

    __slots__ = ("value", "initial")

    def __init__(self, initial: Any) -> None:
        self.value = self.initial = initial

    def __len__(self) -> int:  # 1 once set: a fresh import holds 0
        return int(self.value is not self.initial)

    def clear(self) -> None:
        self.value = self.initial


@dataclass(frozen=True)
class Member:
    """One store. ``bound``: the entries it holds at most (None: as many as the live objects or sites it
    describes); ``kept``: why ``reset`` leaves it ("" where it empties it)."""

    name: str
    bound: Optional[int]
    size: Callable[[], int]
    clear: Callable[[], None]
    get: Callable[[], Any]
    kept: str = ""


class State:
    """The package's run-time state (module docstring); ``STATE`` is the one instance."""

    def __init__(self) -> None:
        self._members: dict[str, Member] = {}

    # -- declaring members: each returns the store it adds ---------------------------------------------------
    def add(self, name: str, store: Any, *, bound: Optional[int] = None, kept: str = "",
            size: Optional[Callable[[], int]] = None, clear: Optional[Callable[[], None]] = None) -> Any:
        """``store`` (a dict, set, weak container, list or any object with ``clear``) as the member ``name``."""
        if name in self._members:
            raise ValueError(f"state member {name!r} declared twice")
        self._members[name] = Member(name, bound, size or (lambda: len(store)), clear or store.clear,
                                     lambda: store, kept)
        return store

    def lru(self, name: str, maxsize: int) -> BoundedLRU:
        return self.add(name, BoundedLRU(maxsize), bound=maxsize)

    def value(self, name: str, initial: Any = None, *, kept: str = "") -> Value:
        return self.add(name, Value(initial), bound=1, kept=kept)

    def lock(self, name: str, lock: Optional[Lock] = None) -> Lock:
        lock = lock or Lock()
        return self.add(name, lock, bound=1, size=lambda: int(lock.locked()), clear=lambda: None)

    def cached(self, name: str, maxsize: Optional[int], *, bound: Optional[int] = None, kept: str = "") -> Callable:
        """``functools.lru_cache(maxsize)`` of the decorated function, as the member ``name`` (``bound``: the
        entries an unbounded cache holds at most, e.g. one per device)."""

        def decorate(function: Callable) -> Callable:
            cached = functools.lru_cache(maxsize=maxsize)(function)
            self.add(name, cached, bound=maxsize if maxsize is not None else bound, kept=kept,
                     size=lambda: cached.cache_info().currsize, clear=cached.cache_clear)
            return cached

        return decorate

    def outside(self, name: str, module: str, attribute: str, *, bound: Optional[int] = None,
                initial: Any = None) -> None:
        """A store that a kernel module (below the package: it cannot import this one) keeps as ``attribute``,
        read where ``module`` is loaded. An ``lru_cache``, a dict or a list is emptied, a dict of counters
        (``initial`` a dict) set back to ``initial``, any other value set to ``initial``."""

        def store():
            loaded = sys.modules.get(module)
            return getattr(loaded, attribute) if loaded is not None else None

        def size() -> int:
            held = store()
            if hasattr(held, "cache_info"):
                return held.cache_info().currsize
            if isinstance(initial, dict):
                return sum(1 for count in held.values() if count) if held else 0
            if isinstance(held, (dict, list)):
                return len(held)
            return int(held is not initial)

        def clear() -> None:
            held = store()
            if hasattr(held, "cache_clear"):
                held.cache_clear()
            elif isinstance(initial, dict):
                if held is not None:
                    held.update(initial)
            elif isinstance(held, (dict, list)):
                held.clear()
            elif module in sys.modules:
                setattr(sys.modules[module], attribute, initial)

        if name in self._members:
            raise ValueError(f"state member {name!r} declared twice")
        self._members[name] = Member(name, bound, size, clear, store)

    # -- reading and resetting ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Member]:
        return iter(self._members.values())

    def __getitem__(self, name: str) -> Any:
        """The store of member ``name`` (None: a kernel module not loaded)."""
        return self._members[name].get()

    def names(self) -> list[str]:
        return list(self._members)

    def summary(self) -> dict[str, tuple[int, Optional[int]]]:
        """name -> (entries now, bound)."""
        return {m.name: (m.size(), m.bound) for m in self._members.values()}

    def locks(self) -> list[Lock]:
        """The members' locks."""
        return [m.get() for m in self._members.values() if isinstance(m.get(), Lock)]

    def reset(self, *names: str) -> None:
        """Empty every member but the kept ones (what a fresh import holds), or the members ``names``."""
        for name in names or list(self._members):
            member = self._members[name]
            if names or not member.kept:
                member.clear()

    @contextlib.contextmanager
    def override(self, name: str, value: Any) -> Iterator[None]:
        """Member ``name`` (a ``Value``) holds ``value`` inside the block."""
        held = self[name]
        before, held.value = held.value, value
        try:
            yield
        finally:
            held.value = before


def _renew_locks() -> None:
    for lock in list(_LOCKS):
        lock._renew()


if hasattr(os, "register_at_fork"):  # POSIX: the one fork hook
    os.register_at_fork(after_in_child=_renew_locks)

STATE = State()

# the kernels' own stores (module docstring); Triton's compiled kernels are Triton's, not these
_KERNELS = "sparse_compile.kernels."
STATE.outside("kernels.plan_buckets", _KERNELS + "common", "plan_buckets", bound=256)
STATE.outside("kernels.capability", _KERNELS + "attention", "_CAPABILITY")
STATE.outside("kernels.hopper_failed", _KERNELS + "attention", "_HOPPER_FAILED")
STATE.outside("kernels.hopper_import", _KERNELS + "attention", "_HOPPER_IMPORT", bound=1)
STATE.outside("kernels.backend_calls", _KERNELS + "attention", "BACKEND_CALLS", bound=2,
              initial={"hopper": 0, "triton": 0})
STATE.outside("kernels.last_backend", _KERNELS + "attention", "last_backend", bound=1)
STATE.outside("kernels.sm_counts", _KERNELS + "hopper", "_SM_COUNTS")
STATE.outside("kernels.layouts", _KERNELS + "hopper", "_LAYOUTS")
