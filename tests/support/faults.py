"""Storage faults, injected by wrapping the real store (local folder or S3).

``FaultyStore(inner, cut=...)`` makes a ``create`` whose location ``cut`` picks fail half
way: half the bytes land under a hidden name beside it (what a process killed mid-write
leaves on a local disk; on S3 an interrupted ``PUT`` leaves nothing) and it raises.
``listing=...`` changes what a listing returns, e.g. leaving out the newest file, as a
listing that lags a write does on some stores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.lakehouse.storage.store import Store


class StoreWentAway(OSError):
    """The store failed in the middle of a write."""


class FaultyStore:
    """A store that fails as told, and otherwise does what ``inner`` does.

    Args:
        inner: the real store.
        cut: locations whose ``create`` fails half way.
        listing: given a folder and its names, the names a listing returns.
    """

    def __init__(
        self,
        inner: Store,
        cut: Callable[[str], bool] = lambda _: False,
        listing: Callable[[str, list[str]], list[str]] = lambda _, names: names,
    ) -> None:
        self.inner, self.cut, self.listing = inner, cut, listing

    def create(self, path: str, data: bytes, *, durable: bool = True) -> bool:
        if self.cut(path):
            folder, _, name = path.rpartition("/")
            self.inner.write(f"{folder}/.{name}.cut-short", data[: len(data) // 2])
            raise StoreWentAway(f"the store went away half way through writing {path}")
        return self.inner.create(path, data, durable=durable)

    def names(self, folder: str) -> list[str]:
        return self.listing(folder, self.inner.names(folder))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
