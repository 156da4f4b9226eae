"""The job's store with every request kept small: what torchrun's store server of torch 2.7.1 (the users' torch)
reads reliably.

torch 2.7.1's libuv store server (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp, the backend torchrun's
agent hosts the store with) drops a client's connection when a request reaches it cut across two of its reads:
the client's next call fails with "failed to recv, got 0 bytes" / "Connection reset by peer". Found under
torchrun with 4 ranks (tests/test_distributed.py, users-torch lane): a gather value of ~8 KB followed by a
``check`` of 4 keys, and reproduced without us by one ``set`` of 7954 bytes followed by two ``check``s from 4
ranks (tests/test_distributed.py ``test_store_requests_stay_small``); torch 2.13's server reads the same
traffic fine. A request is cut when more than one read's worth is waiting at the server, so here:

* a value longer than :data:`PART` characters is set in parts under ``KEY#i``, each followed by a round trip
  (``check``: the server has read the part before the next one is sent), then ``KEY`` itself is set to a
  marker naming the part count (``\\0`` + count: no JSON text starts with NUL); readers reassemble it;
* ``check`` / ``multi_get`` of many keys (every rank's key in a job of hundreds of ranks) go :data:`KEYS` keys
  per request.
"""
from __future__ import annotations

PART = 2048  # characters of a value per request (values are ASCII JSON: one byte each)
KEYS = 32  # keys per check / multi_get request (a key is ~50 bytes)


class SmallRequests:
    """``store`` (a torch.distributed Store) behind the same calls we use, every request small (module doc)."""

    def __init__(self, store):
        self.raw = store

    def set(self, key: str, value: str):
        if len(value) <= PART:
            self.raw.set(key, value)
            return
        n = 0
        for n, i in enumerate(range(0, len(value), PART), 1):
            self.raw.set(f"{key}#{n - 1}", value[i:i + PART])
            self.raw.check([f"{key}#{n - 1}"])  # a round trip: the server has read this part
        self.raw.set(key, f"\0{n}")

    def check(self, keys: list) -> bool:
        return all(self.raw.check(keys[i:i + KEYS]) for i in range(0, len(keys), KEYS))

    def multi_get(self, keys: list) -> list:
        vals = []
        for i in range(0, len(keys), KEYS):
            vals += self.raw.multi_get(keys[i:i + KEYS])
        return [self._whole(k, v) for k, v in zip(keys, vals)]

    def get(self, key: str) -> bytes:
        return self._whole(key, self.raw.get(key))

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        return self.raw.compare_set(key, expected, value)  # callers keep these values small (group.record_fail)

    def _whole(self, key: str, v: bytes) -> bytes:
        if not v.startswith(b"\0"):
            return v
        return b"".join(self.multi_get([f"{key}#{i}" for i in range(int(v[1:]))]))
