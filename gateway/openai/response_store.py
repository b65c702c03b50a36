"""The Responses API's store: what ``store: true`` keeps for ``previous_response_id`` and ``GET
/v1/responses/{id}``, in the gateway's memory, bounded three ways.

- **By count** (``--responses-store-max-entries``) and **by bytes** (``--responses-store-max-bytes``, each
  entry counted as the JSON it holds): past either, the least recently used entries go first.
- **By age** (``--responses-store-ttl-seconds``): an entry not read or continued for that long is gone.

An entry keeps the whole conversation the response ended (its input items and its output items), so a
continuation needs only that one entry, whatever was evicted before it. Entries belong to the API key that
made them (a SHA-256 digest of it, never the key): another key's lookup is the same 404 as an unknown id, so
it cannot tell that the id exists. Without API keys every client shares one owner.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from specdec.errors import ResponseNotFoundError
from specdec.serving.metrics import response_store_changed, response_store_evicted


def owner_of(authorization: str | None) -> str:
    """The owner a request's ``Authorization`` header stands for: a digest of its bearer token."""
    _, _, token = (authorization or "").strip().partition(" ")
    return hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()


@dataclass
class StoredResponse:
    owner: str
    response: dict  # the response object, as GET returns it
    items: list[dict]  # the conversation it ended: its input items (earlier turns included), then its output
    input_count: int  # how many of ``items`` are input (GET .../input_items lists them)
    nbytes: int = 0
    touched: float = 0.0


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_seconds: float | None, model_name: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl_seconds
        self.model_name = model_name
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        response_store_changed(model_name, 0, 0)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> bool:
        """Keep ``entry`` (False: it alone is larger than the store, and is not kept)."""
        entry.nbytes = len(json.dumps([entry.response, entry.items], ensure_ascii=False).encode("utf-8"))
        if entry.nbytes > self.max_bytes or self.max_entries < 1:
            return False
        with self._lock:
            self._expire()
            old = self._entries.pop(entry.response["id"], None)
            if old is not None:
                self._bytes -= old.nbytes
            entry.touched = self.clock()
            self._entries[entry.response["id"]] = entry
            self._bytes += entry.nbytes
            while len(self._entries) > self.max_entries:
                self._evict("entries")
            while self._bytes > self.max_bytes:
                self._evict("bytes")
            self._report()
        return True

    def get(self, owner: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry (now the most recently used), or ResponseNotFoundError (404) when it is unknown,
        expired, evicted or another key's."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                self._report()
                raise ResponseNotFoundError(f"no stored response with id {response_id!r}: it was never stored "
                                            "(store: false), or it expired or was evicted from this gateway's store, "
                                            "or another API key made it", param=param)
            entry.touched = self.clock()
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id, param="response_id")
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            self._report()

    def _expire(self) -> None:
        if self.ttl is None:
            return
        horizon = self.clock() - self.ttl
        while self._entries:
            oldest = next(iter(self._entries.values()))  # least recently used: the first to expire
            if oldest.touched > horizon:
                break
            self._evict("expired")

    def _evict(self, reason: str) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.nbytes
        response_store_evicted(self.model_name, reason)

    def _report(self) -> None:
        response_store_changed(self.model_name, len(self._entries), self._bytes)
