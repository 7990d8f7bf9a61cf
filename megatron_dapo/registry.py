"""Registry: the named implementations of one choice field of the config, filled by the modules that define them
(the policy losses, the log-prob implementations, the environments). Pure Python: the config imports no component."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic
from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """name -> implementation for the choice field `field` ("section.field"): a dict that refuses a name registered
    twice (`add`) and answers an unknown one with a ValueError naming the field and its choices (`lookup`)."""

    def __init__(self, field: str, kind: str) -> None:
        super().__init__()
        self.field, self.kind = field, kind

    def add(self, name: str, value: T) -> T:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = value
        return value

    def lookup(self, name: str, also: Iterable[str] = ()) -> T:
        """The implementation of `name`; `also`: further valid names the error lists (ones loaded on first use)."""
        if name not in self:
            raise ValueError(f"{self.field}: unknown {name!r}; choose one of {sorted(set(self) | set(also))}")
        return self[name]
