"""Trainer → rollout weight transfer: full HF-named state dict in flat buckets, stamped with the version.

The train head announces a version on the control channel (bucket layout + one checksum per bucket),
then sends each bucket as one flat tensor (gloo on CPU, NCCL on GPU: the bucket lives on the sender's
device), in the rollout model's compute dtype. The rollout side receives one bucket at a time into a buffer of
the announced size, verifies its checksum when asked to, and applies it (HF names and shapes, bitwise what was
sent) before receiving the next; the version switches with the last bucket.
A mismatch raises WeightSyncError (the rollout rank stops rather than generate with corrupted weights);
a rollout rank that does not take its buckets within the deadline is named in a PeerTimeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from errors import HexrlError
from parallel.channel import PeerTimeout, wait_work

WEIGHT_TAG = 21


class WeightSyncError(HexrlError, RuntimeError):
    """A weight version arrived corrupted, or its transfer could not finish."""


DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


CHECKSUM_CHUNK_WORDS = 1 << 20  # int64 intermediates of at most this many words (8 MiB), whatever the bucket size


def checksum(flat: torch.Tensor) -> int:
    """Position-weighted integer sum of the raw bits: device-agnostic, exact, sensitive to swaps. Computed on the
    tensor's device a chunk at a time, so its integer intermediates never copy the whole bucket."""
    words = flat.contiguous().view(torch.uint8)
    words = torch.nn.functional.pad(words, (0, (-words.numel()) % 4)).view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + CHECKSUM_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        weights = torch.arange(start, start + chunk.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
        total += (chunk * weights).sum()
    return int(total.item())


def make_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[tuple[dict, torch.Tensor]]:
    """Group same-dtype tensors into flat buckets of about `bucket_bytes`; returns (meta, flat)."""
    buckets, names, size, dtype = [], [], 0, None

    def close():
        if names:
            flat = torch.cat([state_dict[n].reshape(-1) for n in names])
            meta = {
                "names": list(names),
                "shapes": [list(state_dict[n].shape) for n in names],
                "dtype": str(flat.dtype),
                "numel": flat.numel(),
            }
            buckets.append((meta, flat))

    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if names and (t.dtype != dtype or size + nbytes > bucket_bytes):
            close()
            names, size = [], 0
        names.append(name)
        size += nbytes
        dtype = t.dtype
    close()
    return buckets


class WeightSender:
    """Lives on the train head. Keeps in-flight buckets alive until their sends have completed."""

    def __init__(self, bucket_mb: float, verify: bool, timeout_s: float, dtype: torch.dtype | None = None):
        """`dtype`: what the weights travel in -- the rollout model's compute dtype (bf16 on GPU), so nothing is
        sent that the receiver would round away; None sends them as the trainer holds them."""
        self.timeout_s, self.dtype = timeout_s, dtype
        self.last_bytes = 0  # bytes sent for the last version, all receivers together
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.verify = verify
        self.in_flight: list[tuple] = []
        self.in_flight_version = -1
        self.abandoned: list[tuple] = []  # sends to dropped ranks: gloo may still read these buffers

    def receivers_in_flight(self) -> set[int]:
        """Ranks the last version was sent to and whose sends have not been waited for."""
        return {dst for dst, _, _ in self.in_flight}

    def send(
        self,
        channel,
        dst_ranks: list[int],
        state_dict: dict[str, torch.Tensor],
        version: int,
        device: torch.device,
        wait_timeout_s: float | None = None,
    ) -> float:
        """Announce and send one version; first waits (up to wait_timeout_s) for the previous one to leave."""
        t0 = time.perf_counter()
        self.wait(self.timeout_s if wait_timeout_s is None else wait_timeout_s)
        if self.dtype is not None:
            state_dict = {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in state_dict.items()}
        buckets = [(meta, flat.to(device)) for meta, flat in make_buckets(state_dict, self.bucket_bytes)]
        self.last_bytes = len(dst_ranks) * sum(flat.numel() * flat.element_size() for _, flat in buckets)
        metas = []
        for meta, flat in buckets:
            metas.append({**meta, "checksum": checksum(flat) if self.verify else None})
        self.in_flight_version = version
        for dst in dst_ranks:
            channel.send(dst, "weights", version=version, buckets=metas)
            for _, flat in buckets:
                self.in_flight.append((dst, dist.isend(flat, dst=dst, tag=WEIGHT_TAG), flat))
        return time.perf_counter() - t0

    def wait(self, timeout_s: float) -> None:
        """The previous version's buckets must have left before their memory is reused. Raises PeerTimeout
        naming every rank that did not take them in time (their sends are then abandoned).
        With gloo a timed-out wait closes every pair of the process group ("Application timeout caused pair
        closure"), so the train head first waits for the receivers' `weights_ok` over the channel and drops
        a rank that never answers (`forget`); this wait then only finds completed sends."""
        late: list[int] = []
        for dst, work, _ in self.in_flight:
            if dst in late:
                continue
            try:
                wait_work(work, timeout_s, [dst], "a rollout rank to receive weights")
            except PeerTimeout:
                late.append(dst)
        self.abandoned += [x for x in self.in_flight if x[0] in late]
        self.in_flight = []
        if late:
            raise PeerTimeout(late, timeout_s, "a rollout rank to receive weights")

    def forget(self, rank: int) -> None:
        """A dropped rank: stop waiting for its sends (kept alive, never awaited)."""
        self.abandoned += [x for x in self.in_flight if x[0] == rank]
        self.in_flight = [x for x in self.in_flight if x[0] != rank]


def receive_buckets(msg: dict, src: int, device: torch.device, verify: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Receive the buckets announced by a `weights` message one at a time: yields each bucket's HF-named tensors
    (views of its one flat buffer), so a receiver that applies each before asking for the next holds one bucket,
    never the whole model."""
    for meta in msg["buckets"]:
        flat = torch.empty(meta["numel"], dtype=DTYPES[meta["dtype"]], device=device)
        dist.recv(flat, src=src, tag=WEIGHT_TAG)  # sent right after the announcement; PG timeout applies
        if verify and meta["checksum"] is not None and checksum(flat) != meta["checksum"]:
            raise WeightSyncError(
                f"weight checksum mismatch for version {msg['version']} "
                f"(bucket starting at {meta['names'][0]}): corrupted in transfer"
            )
        bucket, offset = {}, 0
        for name, shape in zip(meta["names"], meta["shapes"]):
            n = 1
            for s in shape:
                n *= s
            bucket[name] = flat[offset : offset + n].view(shape)
            offset += n
        del flat
        yield bucket


def receive_weights(msg: dict, src: int, device: torch.device, verify: bool) -> dict[str, torch.Tensor]:
    """The whole announced state dict at once (tests and tools; rollout ranks apply bucket by bucket)."""
    return {name: t for bucket in receive_buckets(msg, src, device, verify) for name, t in bucket.items()}
