"""Tables of named entries (the built-in losses, the optimisers, the targets) that a module extends
by registering one; their readers (the command line's choices, the manifest and its schema,
the errors that list the known names) read the table, so they see every entry registered so far."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in the order registered; ``kind`` names them in errors ("loss", ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Adds ``entry`` under ``name`` (a name taken is an error: unregister it first)."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> T:
        """Removes and returns the entry of ``name``."""
        return self._entries.pop(name)

    @property
    def names(self) -> Names:
        """The names, read afresh at each use (a later registration is among them)."""
        return Names(self)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class Names(Sequence[str]):
    """A registry's names as a tuple of them reads (indexing, ``in``, equality, repr), taken at
    each use."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def __getitem__(self, index):
        return tuple(self._registry)[index]

    def __len__(self) -> int:
        return len(self._registry)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._registry))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._registry

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Names) else other)

    __hash__ = None  # (equal to a tuple that changes: no hash)

    def __repr__(self) -> str:
        return repr(tuple(self))
