"""Several replicas of a backend behind one client, for scale-out.

``--target-addr`` / ``--draft-addr`` take ``host:port[,host:port...]`` or ``dns:///name:port`` (a
headless Service: every address the name resolves to is a replica, re-resolved periodically). Each
sequence stays on one replica for its whole life (its KV cache lives there); a new sequence goes to
the least-loaded healthy replica. When a replica fails or drains (health NOT_SERVING, or calls answer
UNAVAILABLE), its sequences move to another healthy replica, which rebuilds the cache from the resent
history: a lost replica costs a recompute, never correctness.

Membership follows the name: an address that leaves DNS takes no new sequences, and once the sequences
homed on it have ended (released, or moved on failure) it is dropped and its client closed, so a set
behind a rolling deployment does not grow without bound. Health checks of the replicas run in parallel
(at most HEALTH_CHECK_CONCURRENCY at a time): a round over many dead addresses takes about one timeout,
not one per address.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from specdec.errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)

REPLICA_RETRY_SECONDS = 2.0
HEALTH_CHECK_CONCURRENCY = 8  # replicas health-checked at once (each check waits up to its timeout)
# settings the gateway puts on its backend client; a replica set hands them to every replica
_SHARED = ("model_name", "retry_seconds", "call_timeout", "stop_retrying", "on_unavailable", "vocab_size",
           "on_call_time")


def is_replica_spec(spec: str) -> bool:
    """Whether an address names several replicas (a list, or a DNS name to resolve)."""
    return "," in spec or spec.startswith("dns:")


def resolve(spec: str) -> list[str]:
    """The replica addresses a spec names now (DNS looked up)."""
    if spec.startswith("dns:"):
        parts = urlsplit(spec.replace("dns:///", "dns://", 1))
        host, port = parts.hostname, parts.port
        if not host or not port:
            raise ConfigError(f"{spec!r}: expected dns:///NAME:PORT")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            logger.warning("cannot resolve %s: %s", host, exc)
            return []
        addrs = sorted({f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos})
        return addrs
    addrs = [a.strip() for a in spec.split(",") if a.strip()]
    if not addrs:
        raise ConfigError(f"{spec!r} names no address; expected host:port[,host:port...] or dns:///NAME:PORT")
    return addrs


class ReplicaSet:
    """The worker interface of one backend client (``propose`` / ``verify`` / ``release`` ...) over
    several replicas, each a client of its own built by ``factory(address)``."""

    def __init__(self, spec: str, factory: Callable[[str], object], health_interval: float = 1.0,
                 refresh_seconds: float = 30.0):
        self.address = spec
        self._factory = factory
        self._shared: dict[str, object] = {}
        self.replicas: dict[str, object] = {}
        self.healthy: dict[str, bool] = {}
        self._home: dict[str, str] = {}  # sequence id -> replica address
        self._gone: set[str] = set()  # addresses that left the name's answer: dropped once nothing is homed there
        self._in_flight: dict[str, int] = {}  # address -> calls under way outside a sequence's home (release)
        self._deadlines: dict[str, float | None] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.refresh_seconds = refresh_seconds
        self._refresh()
        if not self.replicas:
            raise ConfigError(f"{spec!r} resolves to no address")
        probe = next(iter(self.replicas.values()))
        self.role = probe.role
        self.phase = probe.phase
        self._checks = ThreadPoolExecutor(HEALTH_CHECK_CONCURRENCY, thread_name_prefix=f"{self.role}-health")
        self._monitor = threading.Thread(target=self._watch, args=(health_interval,), name=f"{self.role}-replicas",
                                         daemon=True)
        self._monitor.start()

    # -- the settings the gateway puts on its client ---------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if name in _SHARED:
            self._shared[name] = value
            for replica in self.replicas.values():
                setattr(replica, name, value if name != "retry_seconds" else min(value, REPLICA_RETRY_SECONDS))
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        if name in _SHARED and name in self.__dict__.get("_shared", {}):
            return self._shared[name]
        raise AttributeError(name)

    # -- membership and health ---------------------------------------------------------------------------
    def _refresh(self) -> None:
        addrs = resolve(self.address)
        if not addrs:
            return  # keep what we have when DNS has nothing to say
        with self._lock:
            for addr in addrs:
                if addr in self._gone:  # back in the name's answer before it was dropped: health decides
                    self._gone.discard(addr)
                    logger.info("%s replica %s is back in the name's addresses", self.role, addr)
                if addr not in self.replicas:
                    replica = self._factory(addr)
                    # a replica that stops answering hands its sequences on quickly, rather than being
                    # retried for the whole backend timeout while others could serve them
                    replica.retry_seconds = min(replica.retry_seconds, REPLICA_RETRY_SECONDS)
                    for name, value in self._shared.items():
                        setattr(replica, name, value if name != "retry_seconds" else min(value, REPLICA_RETRY_SECONDS))
                    self.replicas[addr] = replica
                    self.healthy[addr] = True
                    logger.info("%s replica %s added", getattr(replica, "role", "backend"), addr)
            for addr in set(self.replicas) - set(addrs) - self._gone:
                self._gone.add(addr)
                self.healthy[addr] = False  # gone from DNS: no new sequences; held ones stay until they end
                logger.info("%s replica %s left the name's addresses", self.role, addr)
        self._prune()

    def _prune(self) -> None:
        """Drop the addresses that left the name once no sequence is homed there and no call is under way."""
        with self._lock:
            busy = set(self._home.values()) | {a for a, n in self._in_flight.items() if n}
            dropped = [(addr, self.replicas.pop(addr)) for addr in sorted(self._gone - busy)
                       if addr in self.replicas and len(self.replicas) > 1]
            for addr, _ in dropped:
                self._gone.discard(addr)
                self.healthy.pop(addr, None)
        for addr, replica in dropped:
            logger.info("%s replica %s dropped: it left the name's addresses and serves no sequence", self.role, addr)
            replica.close()

    def check_health(self, timeout: float) -> None:
        """Health-check every replica, at most HEALTH_CHECK_CONCURRENCY at once; an address that left the name
        stays unhealthy (it takes no new sequence) whatever it answers."""
        replicas = list(self.replicas.items())
        answers = self._checks.map(lambda item: item[1].is_serving(timeout=timeout), replicas)
        for (addr, _), ok in zip(replicas, answers):
            ok = ok and addr not in self._gone
            if addr in self.replicas and ok != self.healthy.get(addr):
                logger.warning("%s replica %s is %s", self.role, addr, "serving" if ok else "NOT serving")
            if addr in self.replicas:
                self.healthy[addr] = ok

    def _watch(self, interval: float) -> None:
        last_refresh = time.monotonic()
        while not self._stop.wait(interval):
            self.check_health(timeout=max(interval, 0.5))
            if self.address.startswith("dns:") and time.monotonic() - last_refresh >= self.refresh_seconds:
                last_refresh = time.monotonic()
                self._refresh()
            else:
                self._prune()

    def load(self) -> dict[str, int]:
        """Sequences each replica holds for this gateway."""
        with self._lock:
            counts = {addr: 0 for addr in self.replicas}
            for addr in self._home.values():
                counts[addr] = counts.get(addr, 0) + 1
            return counts

    def _home_of(self, sequence_id: str, avoid: str | None = None) -> str:
        with self._lock:
            addr = self._home.get(sequence_id)
            if addr is not None and addr != avoid:
                return addr
            counts = self.load()
            candidates = [a for a in self.replicas if self.healthy.get(a) and a != avoid] or \
                [a for a in self.replicas if a != avoid] or list(self.replicas)
            addr = min(candidates, key=lambda a: (counts.get(a, 0), a))
            self._home[sequence_id] = addr
            deadline = self._deadlines.get(sequence_id)
            if deadline is not None:
                self.replicas[addr].set_deadline(sequence_id, deadline)
            return addr

    def _call(self, method: str, sequence_id: str, *args):
        """Call the sequence's replica; if it is unavailable, move the sequence to another one (which
        gets the whole history: it holds nothing of it) until every replica has been tried."""
        tried: set[str] = set()
        addr = self._home_of(sequence_id)
        while True:
            try:
                return getattr(self.replicas[addr], method)(sequence_id, *args)
            except BackendUnavailableError:
                tried.add(addr)
                self.healthy[addr] = False
                others = [a for a in self.replicas if a not in tried]
                if not others:
                    raise
                self.replicas[addr].forget(sequence_id)
                with self._lock:
                    self._home.pop(sequence_id, None)
                addr = self._home_of(sequence_id, avoid=addr)
                if addr in tried:
                    raise
                logger.info("%s: sequence %s moves to replica %s", self.role, sequence_id, addr)

    # -- the worker interface ------------------------------------------------------------------------------
    def propose(self, sequence_id: str, token_ids, num_speculative_tokens: int, params):
        return self._call("propose", sequence_id, token_ids, num_speculative_tokens, params)

    def verify(self, sequence_id: str, token_ids, proposal, params):
        return self._call("verify", sequence_id, token_ids, proposal, params)

    def set_deadline(self, sequence_id: str, deadline: float | None) -> None:
        self._deadlines[sequence_id] = deadline
        with self._lock:
            addr = self._home.get(sequence_id)
            replica = self.replicas.get(addr) if addr is not None else None
        if replica is not None:
            replica.set_deadline(sequence_id, deadline)

    def release(self, sequence_id: str) -> None:
        self._deadlines.pop(sequence_id, None)
        with self._lock:
            addr = self._home.pop(sequence_id, None)
            replica = self.replicas.get(addr) if addr is not None else None
            if replica is not None:  # not dropped while the release is under way
                self._in_flight[addr] = self._in_flight.get(addr, 0) + 1
        if replica is None:
            return
        try:
            replica.release(sequence_id)
        finally:
            with self._lock:
                self._in_flight[addr] -= 1

    def get_info(self, timeout: float):
        """The first replica's info, once every replica answers; replicas must serve the same model."""
        infos = {addr: replica.get_info(timeout) for addr, replica in list(self.replicas.items())}
        first_addr, first = next(iter(infos.items()))
        for addr, info in infos.items():
            if (info.model_name, info.tokenizer_fingerprint) != (first.model_name, first.tokenizer_fingerprint):
                raise ConfigError(f"{self.role} replicas differ: {first_addr} serves {first.model_name!r}, "
                                  f"{addr} serves {info.model_name!r}")
        return first

    def is_serving(self, timeout: float = 2.0) -> bool:
        return any(replica.is_serving(timeout) for replica in list(self.replicas.values()))

    def close(self) -> None:
        self._stop.set()
        self._checks.shutdown(wait=False)
        for replica in list(self.replicas.values()):
            replica.close()
