"""Control and trajectory messages between the train head and the rollout ranks.

A message is a small JSON document (never pickle: nothing received is ever executed) put in a per-pair
mailbox on the job's key-value store (the TCPStore torchrun already runs for rendezvous). Sending never
blocks on the receiver, so a rollout rank never waits for a busy trainer, and receiving is a cheap
non-blocking check, so every wait has a deadline of our choosing and a silent peer is *named* instead
of hanging the run. (Point-to-point gloo receives cannot be polled: their `is_completed()` stays False
until `wait()`, and `wait(timeout)` is not honoured for receives — measured here.)
Keys: hexrl/<run>/mb/<dst>/<src>/<seq>, one per message, deleted once read; per-pair order is kept by seq.
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
        self.next_in = {p: 0 for p in self.peers}  # next sequence number expected from each peer
        self.next_out: dict[int, int] = {}
        self.last_heard = {p: time.monotonic() for p in self.peers}
        self.closed: set[int] = set()

    def _key(self, dst: int, src: int, seq: int) -> str:
        return f"{self.ns}/mb/{dst}/{src}/{seq}"

    def send(self, dst: int, kind: str, **payload) -> None:
        seq = self.next_out.get(dst, 0)
        self.next_out[dst] = seq + 1
        self.store.set(self._key(dst, self.rank, seq), json.dumps({"kind": kind, **payload}, separators=(",", ":")))

    def poll(self, timeout_s: float = 0.0, peers: list[int] | None = None) -> list[tuple[int, dict]]:
        """Messages that have arrived, as (source rank, message), in order per source. With timeout_s > 0,
        waits up to that long for at least one message (returns [] if none came)."""
        deadline = time.monotonic() + timeout_s
        sleep = 0.0002
        while True:
            out = []
            for p in peers or self.peers:
                while p not in self.closed:
                    key = self._key(self.rank, p, self.next_in[p])
                    if not self.store.check([key]):
                        break
                    msg = json.loads(self.store.get(key))
                    self.store.delete_key(key)
                    self.next_in[p] += 1
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
