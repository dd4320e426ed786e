"""Control and trajectory messages between the train head and the rollout ranks.

A message is a small JSON document (never pickle: nothing received is ever executed) pushed on a per-pair
queue of the job's key-value store (the TCPStore torchrun already runs for rendezvous: `Store.queue_push` /
`queue_pop`, first in first out, so per-pair order needs no sequence numbers). Sending never
blocks on the receiver, so a rollout rank never waits for a busy trainer, and receiving is a cheap
non-blocking check, so every wait has a deadline of our choosing and a silent peer is *named* instead
of hanging the run. (Point-to-point gloo receives cannot be polled: their `is_completed()` stays False
until `wait()`, and `wait(timeout)` is not honoured for receives — measured here.)
Queues: <namespace>/q/<dst>/<src>; a popped message is gone from the store.
Large tensors (weights) travel over the process group instead, see parallel/weight_sync.py.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from errors import HexrlError


class Aborted(RuntimeError):
    """The train head ended the run (an `abort` message); it has printed why, so this rank exits quietly."""


class PeerTimeout(HexrlError, RuntimeError):
    """A peer sent nothing within the deadline of a wait."""

    def __init__(self, ranks: list[int], seconds: float, what: str):
        super().__init__(f"rank(s) {ranks} sent nothing for {seconds:.0f}s while waiting for {what}")
        self.ranks = ranks


def default_store():
    return dist.distributed_c10d._get_default_store()


class Channel:
    def __init__(self, peers: list[int], store=None, namespace: str = "hexrl"):
        self.rank = dist.get_rank()
        self.peers = list(peers)
        self.store = store or default_store()
        self.ns = namespace
        self.last_heard = {p: time.monotonic() for p in self.peers}
        self.closed: set[int] = set()

    def _queue(self, dst: int, src: int) -> str:
        return f"{self.ns}/q/{dst}/{src}"

    def send(self, dst: int, kind: str, **payload) -> None:
        self.store.queue_push(self._queue(dst, self.rank), json.dumps({"kind": kind, **payload}, separators=(",", ":")))

    def poll(self, timeout_s: float = 0.0, peers: list[int] | None = None) -> list[tuple[int, dict]]:
        """Messages that have arrived, as (source rank, message), in order per source. With timeout_s > 0,
        waits up to that long for at least one message (returns [] if none came)."""
        deadline = time.monotonic() + timeout_s
        sleep = 0.0002
        while True:
            out = []
            for p in peers or self.peers:
                while p not in self.closed:
                    try:
                        msg = json.loads(self.store.queue_pop(self._queue(self.rank, p), block=False))
                    except dist.QueueEmptyError:
                        break
                    self.last_heard[p] = time.monotonic()
                    if msg["kind"] == "bye":
                        self.closed.add(p)
                    out.append((p, msg))
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.01)

    def silent_peers(self, seconds: float) -> list[int]:
        now = time.monotonic()
        return [p for p in self.peers if p not in self.closed and now - self.last_heard[p] > seconds]


def wait_work(work, timeout_s: float, who: list[int], what: str) -> None:
    """Wait on a send's Work with a deadline (gloo sends honour it)."""
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerTimeout(who, timeout_s, f"{what} ({str(e).splitlines()[0][:120]})") from None
