"""Trainer -> rollout weight sync: streamed bucket by bucket from the train ranks that own the parameters, in the
rollout model's compute dtype, each bucket crossing each link once.

The buckets are parallel/sync_layout.sync_buckets -- the planner prices the very same list. One version:
  1. The train head picks one relay per rollout machine (its lowest live replica leader) and tells every live
     leader over the channel what will arrive and from whom (`weights`: the bucket layout, its source -- for a
     relay the owner of each stage that sends to it -- and for a relay the machine-mates it forwards to).
  2. Each relay takes each stage from one DP replica (all hold the same weights): the best-connected one, ties to
     the least loaded (sync_layout.assign_senders). The train ranks of that replica and stage walk its buckets in
     order (`send_version`): TP peers gather each sharded tensor onto the stage's owner (tp 0), one tensor at a
     time; the owner writes the bucket in the compute dtype into one flat byte buffer, appends its checksum
     (computed on the device, a chunk at a time) and isends it to each of its relays. At most 2 buckets are alive
     on an owner: before filling one it waits until at most one other is still leaving.
  3. A relay receives each bucket, isends it on to its machine-mates (again at most 2 alive), verifies it, and
     hands it to the caller, who applies it in place (and shares it with its TP followers, parallel/replica.py).
     A machine-mate does the same with what its relay forwards. The generator's version switches with the last
     bucket, and no decode step runs in between.

Links: every leader has its own group with the owners, every pair of leaders on a machine its own pair group
(parallel/groups.py). A dead or stopped peer can then fail only the links it is on -- in gloo a timed-out wait
closes every pair of its group, which is why one group over all receivers would not do.

What stays synchronous, and why: a send completes when its receiver takes it, so with at most 2 buckets in flight an
owner moves at the pace of its slowest live relay, about one decode step behind it -- the price of never holding a
second copy of the model. Nothing waits for a `weights_ok`: the channel keeps each rank's messages in order, so
groups granted after a version are generated with it, and the staleness bound needs no acknowledgement.

Faults: an owner's wait that fails or passes dist.rollout_timeout_s marks that relay failed; the train ranks
all-reduce the failures and the head drops those replicas and sends the version again, straight from the owners,
to the machine-mates they relayed to (which gave up on their relay after `mate_timeout_s`, reported
`weights_failed`, and generate nothing until a whole version has arrived). A relay whose forward fails names the
mate in its `weights_ok`, and the owners send that mate the version straight too: a live mate may have given up on a
relay that was waiting on a stopped sibling, and the owners' deadline tells it from a lost one. A checksum mismatch raises WeightSyncError: the rank stops rather
than generate with corrupted weights.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from errors import HexrlError
from parallel.channel import PeerTimeout, wait_work
from parallel.handover import DESCRIPTOR_BYTES, OpenedSlots, SharedSlots, open_slots
from parallel.sync_layout import SYNC_CHECKSUM_BYTES, SyncBucket, assign_senders


class WeightSyncError(HexrlError, RuntimeError):
    """A weight version arrived corrupted."""


DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}

CHECKSUM_CHUNK_WORDS = 1 << 20  # int64 intermediates of at most this many words (8 MiB), whatever the bucket size
IN_FLIGHT = 2  # buckets alive on a sender (the one leaving, the one being filled) and on a relay
ABANDONED: list[torch.Tensor] = []  # buffers of sends to failed peers: the backend may still read them
# fault injection for the tests: "<rank>:<version>:<STOP|KILL>" -- that rollout leader signals itself half-way
# through receiving that version (tests/e2e/test_fault_tolerance.py)
FAULT_ENV = "HEXRL_FAULT_IN_WEIGHT_SYNC"
# "1": stage every bucket through host memory even on CPU, so the tests run the colocated GPU path's code
STAGE_ENV = "HEXRL_STAGE_WEIGHTS_THROUGH_HOST"
HANDOVERS = ("wire", "shared")  # how an owner hands a bucket to a relay: the process group, or shared memory


def staged_through_host(device: torch.device) -> bool:
    """Colocated mode (dist.colocate) runs every group on gloo, which cannot send CUDA tensors: a bucket then
    travels through pinned host memory (the owner copies it out after sealing it, the receiver takes it there,
    verifies it and copies each tensor into its weights)."""
    if os.environ.get(STAGE_ENV) == "1":
        return True
    return device.type == "cuda" and "nccl" not in str(dist.get_backend())


def wire_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A bucket's receive buffer: on the device, or in (pinned) host memory when staged."""
    if staged_through_host(device):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def to_wire(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a sealed bucket is sent as: itself, or its copy in (pinned) host memory when staged."""
    if not staged_through_host(device):
        return buf
    host = wire_buffer(buf.numel(), device) if device.type == "cuda" else torch.empty_like(buf)
    return host.copy_(buf)


def checksum(data: torch.Tensor) -> int:
    """Position-weighted integer sum of the raw bits: sum over 32-bit words (zero-padded) of word * (index mod
    65521 + 1), modulo 2**64. Device-agnostic, exact, sensitive to swaps. Computed on the tensor's device a chunk at
    a time -- at most CHECKSUM_CHUNK_WORDS and 1/64 of the words -- in two int64 buffers of the chunk's length, so
    its intermediates stay under 7% of the data's own size (no integer copy of a whole bucket)."""
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 4
    words = raw[: whole * 4].view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    step = max(1024, min(CHECKSUM_CHUNK_WORDS, -(-whole // 64)))
    for start in range(0, whole, step):
        chunk = words[start : start + step].to(torch.int64)
        chunk &= 0xFFFFFFFF
        weights = torch.arange(start, start + chunk.numel(), device=raw.device, dtype=torch.int64)
        weights.remainder_(65521).add_(1)
        total += chunk.mul_(weights).sum()
        del chunk, weights
    tail = int.from_bytes(bytes(raw[whole * 4 :].cpu().tolist()), "little")  # the last < 4 bytes
    return (int(total.item()) + tail * (whole % 65521 + 1)) % (1 << 64)


# ----------------------------------------------------------------------------------------------- one bucket
def payload_view(buf: torch.Tensor, bucket: SyncBucket, dtype: torch.dtype) -> torch.Tensor:
    """The bucket's tensors, flat, in `dtype`: the front of its wire buffer."""
    return buf[: bucket.payload_bytes].view(dtype)


def seal(buf: torch.Tensor, bucket: SyncBucket, verify: bool) -> None:
    """Write the payload's checksum (or 0 when not verifying) into the buffer's last 8 bytes."""
    value = checksum(buf[: bucket.payload_bytes]) if verify else 0
    value = value - (1 << 64) if value >= 1 << 63 else value  # as the int64 it is stored in
    buf[-SYNC_CHECKSUM_BYTES:].view(torch.int64).fill_(value)


def unseal(buf: torch.Tensor, meta: dict, version: int, verify: bool) -> dict[str, torch.Tensor]:
    """Check a received buffer and return its HF-named tensors (views of it)."""
    dtype = DTYPES[meta["dtype"]]
    payload = buf[: meta["payload_bytes"]]
    if verify:
        sent = int(buf[-SYNC_CHECKSUM_BYTES:].view(torch.int64).item()) % (1 << 64)
        if checksum(payload) != sent:
            raise WeightSyncError(
                f"weight checksum mismatch for version {version} "
                f"(bucket starting at {meta['names'][0]}): corrupted in transfer"
            )
    flat, out, offset = payload.view(dtype), {}, 0
    for name, shape in zip(meta["names"], meta["shapes"]):
        n = torch.Size(shape).numel()
        out[name] = flat[offset : offset + n].view(shape)
        offset += n
    return out


def bucket_meta(bucket: SyncBucket, shapes: dict[str, tuple], dtype: torch.dtype) -> dict:
    """What a receiver needs to know of one bucket (the `weights` message carries one per bucket)."""
    return {
        "stage": bucket.stage,
        "names": list(bucket.names),
        "shapes": [list(shapes[n]) for n in bucket.names],
        "dtype": str(dtype),
        "payload_bytes": bucket.payload_bytes,
        "wire_bytes": bucket.wire_bytes,
    }


# ----------------------------------------------------------------------------------------------- streams
class BucketStream:
    """Sends a sequence of buffers to a set of peers, each over its own link, with at most IN_FLIGHT alive. A peer
    whose send fails or does not complete within `timeout_s` is marked failed and gets nothing more."""

    def __init__(self, links: dict[int, object], timeout_s: float, what: str):
        self.links, self.timeout_s, self.what = links, timeout_s, what
        self.in_flight: deque = deque()
        self.failed: dict[int, str] = {}
        self.bytes_sent = 0

    def _wait_oldest(self) -> None:
        buf, works = self.in_flight.popleft()
        for dst, work in works:
            if dst in self.failed:
                ABANDONED.append(buf)
                continue
            try:
                wait_work(work, self.timeout_s, [dst], self.what)
            except PeerTimeout as e:
                self.failed[dst] = str(e)
                ABANDONED.append(buf)

    def reserve(self) -> None:
        """Call before allocating the next buffer: afterwards at most IN_FLIGHT - 1 are still alive."""
        while len(self.in_flight) >= IN_FLIGHT:
            self._wait_oldest()

    def send(self, buf: torch.Tensor) -> None:
        works = []
        for dst, group in self.links.items():
            if dst in self.failed:
                continue
            try:
                works.append((dst, dist.isend(buf, dst=dst, group=group)))
                self.bytes_sent += buf.numel() * buf.element_size()
            except RuntimeError as e:  # the link is closed already
                self.failed[dst] = str(e).splitlines()[0][:200]
        self.in_flight.append((buf, works))

    def close(self) -> dict[int, str]:
        while self.in_flight:
            self._wait_oldest()
        return self.failed


class SlotStream:
    """The same-host hand-over (dist.handover=shared): the owner writes each bucket into one of IN_FLIGHT shared slots
    (parallel/handover.py) and sends each relay only the bucket's index; the relay applies the bucket from the slot
    and answers with the index, which frees the slot. The slots' handle goes to every relay first, once per version,
    and each relay confirms it has mapped them. A relay that does not answer within `timeout_s` is marked failed."""

    def __init__(self, links: dict[int, object], timeout_s: float, what: str, slot_bytes: int, device: torch.device):
        self.links, self.timeout_s, self.what, self.device = links, timeout_s, what, device
        self.in_flight: deque = deque()
        self.failed: dict[int, str] = {}
        self.bytes_sent = 0
        self.slots = SharedSlots(IN_FLIGHT, slot_bytes, device) if links else None
        if self.slots is not None:
            self._post(self.slots.descriptor, -1)
            self._wait_oldest()
            self.slots.release_name()

    def _post(self, message: torch.Tensor, index: int) -> None:
        works = []
        for dst, group in self.links.items():
            if dst in self.failed:
                continue
            ack = torch.full((1,), -2, dtype=torch.int64)
            try:
                works.append(
                    (dst, dist.isend(message, dst=dst, group=group), ack, dist.irecv(ack, src=dst, group=group))
                )
            except RuntimeError as e:  # the link is closed already
                self.failed[dst] = str(e).splitlines()[0][:200]
        self.in_flight.append((index, message, works))

    def _wait_oldest(self) -> None:
        index, message, works = self.in_flight.popleft()
        for dst, sent, ack, answered in works:
            if dst in self.failed:
                ABANDONED.extend((message, ack))
                continue
            try:
                wait_work(sent, self.timeout_s, [dst], self.what)
                wait_work(answered, self.timeout_s, [dst], self.what)
            except PeerTimeout as e:
                self.failed[dst] = str(e)
                ABANDONED.extend((message, ack))
                continue
            if int(ack.item()) != index:
                self.failed[dst] = f"rank {dst} answered bucket {int(ack.item())} for bucket {index}"

    def reserve(self) -> None:
        """Call before filling the next slot: afterwards at most IN_FLIGHT - 1 are still being read."""
        while len(self.in_flight) >= IN_FLIGHT:
            self._wait_oldest()

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self.slots.slot(index, nbytes)

    def send(self, index: int, nbytes: int) -> None:
        """Bucket `index` is in its slot: tell every live relay."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the slot's bytes are written before any relay reads them
        live = len([d for d in self.links if d not in self.failed])
        self._post(torch.tensor([index], dtype=torch.int64), index)
        self.bytes_sent += nbytes * live

    def close(self) -> dict[int, str]:
        while self.in_flight:
            self._wait_oldest()
        if self.slots is not None:
            self.slots.close()
        return self.failed


def receive_slots(src: int, group, device: torch.device) -> OpenedSlots:
    """A relay's side of a SlotStream's handshake: map the owner's slots and confirm."""
    descriptor = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
    dist.recv(descriptor, src=src, group=group)
    slots = open_slots(descriptor, device)
    dist.send(torch.tensor([-1], dtype=torch.int64), dst=src, group=group)
    return slots


def routes(leaders: list[int], machine_of: dict[int, int]) -> dict[int, tuple[int | None, list[int]]]:
    """leader -> (source, forward_to): per machine its lowest leader is the relay (source None: from the owners)
    and forwards to the others, whose source is the relay."""
    by_machine: dict[int, list[int]] = {}
    for leader in sorted(leaders):
        by_machine.setdefault(machine_of[leader], []).append(leader)
    out: dict[int, tuple[int | None, list[int]]] = {}
    for mates in by_machine.values():
        relay, rest = mates[0], mates[1:]
        out[relay] = (None, rest)
        out.update((m, (relay, [])) for m in rest)
    return out


def plan_version(leaders: list[int], groups) -> tuple[dict[int, tuple[int | None, list[int]]], dict[int, list[int]]]:
    """One version's paths (routes) and senders: relay -> for each stage the DP replica whose owner sends it
    (sync_layout.assign_senders, as the planner prices it)."""
    machine = {r.leader: r.machine for r in groups.replicas}
    paths = routes(leaders, machine)
    relays = sorted(r for r, (source, _) in paths.items() if source is None)
    owner_machines = [[groups.machine_of[r] for r in per_stage] for per_stage in groups.owner_ranks]
    assigned = assign_senders(owner_machines, [machine[r] for r in relays], groups.link_gbps)
    senders = {r: [assigned[(stage, machine[r])] for stage in range(len(owner_machines))] for r in relays}
    return paths, senders


def weights_message(leader: int, paths: dict, senders: dict, groups) -> dict:
    """The per-leader part of a `weights` message: its source, whom it forwards to, and (a relay) who sends each
    stage."""
    source, forward = paths[leader]
    owners = [groups.owner_ranks[s][dp] for s, dp in enumerate(senders[leader])] if source is None else []
    return {"source": source, "forward": forward, "owners": owners}


def mate_link(links: dict, a: int, b: int):
    return links[(min(a, b), max(a, b))]


# ----------------------------------------------------------------------------------------------- train side
def send_version(
    trainer,
    senders: dict,
    dtype: torch.dtype,
    bucket_bytes: int,
    timeout_s: float,
    verify: bool,
    handover: str = "wire",
) -> tuple[list[int], int]:
    """COLLECTIVE over the train group (every train rank calls it, in the same order as the head's `sync`).

    `senders`: relay -> for each stage the DP replica that sends it (plan_version). Each (DP replica, stage) with
    relays to serve streams its stage's buckets to them: its owner (tp 0) sends, its TP peers gather into it.
    `handover`: "wire" sends each bucket over the process group, "shared" hands it over in shared memory (the
    relays are on this host: SlotStream). Returns the relays that failed and the bytes all owners sent (bucket
    bytes per relay either way), the same on every train rank."""
    if handover not in HANDOVERS:
        raise ValueError(f"weight hand-over must be one of {HANDOVERS}, got {handover!r}")
    g = trainer.groups
    mine = [int(r) for r, dps in senders.items() if dps[g.pp_rank] == g.dp_rank]
    # under FSDP a stage's weights are spread over its DP replicas: all of them gather while any one sends
    lends = trainer.fsdp and bool(senders)
    failed: dict[int, str] = {}
    sent = 0
    if mine or lends:
        owner = g.tp_rank == 0 and bool(mine)
        itemsize = torch.empty((), dtype=dtype).element_size()
        buckets = [b for b in trainer.sync_buckets(itemsize, bucket_bytes) if b.stage == g.pp_rank]
        links = {r: g.weight_links[("owners", r)] for r in mine} if owner else {}
        what = "a rollout relay to receive weights"
        shared = handover == "shared"
        if shared:
            slot_bytes = max((b.wire_bytes for b in buckets), default=1)
            stream = SlotStream(links, timeout_s, what, slot_bytes, trainer.device)
        else:
            stream = BucketStream(links, timeout_s, what)
        for index, bucket in enumerate(buckets):
            buf = None
            if owner:
                stream.reserve()
                if shared:
                    buf = stream.slot(index, bucket.wire_bytes)
                else:
                    buf = torch.empty(bucket.wire_bytes, dtype=torch.uint8, device=trainer.device)
            trainer.fill_bucket(bucket, None if buf is None else payload_view(buf, bucket, dtype), dtype, bool(mine))
            if owner:
                seal(buf, bucket, verify)
                if shared:
                    stream.send(index, bucket.wire_bytes)
                else:
                    stream.send(to_wire(buf, trainer.device))
            del buf
        failed = stream.close()
        sent = stream.bytes_sent
    totals = torch.zeros(g.world_size + 1, dtype=torch.int64)
    totals[list(failed)] = 1
    totals[-1] = sent
    dist.all_reduce(totals, group=g.train_group)
    return [r for r in range(g.world_size) if totals[r] > 0], int(totals[-1])


# ----------------------------------------------------------------------------------------------- rollout side
def receive_version(
    msg: dict,
    links: dict,
    device: torch.device,
    apply: Callable[[dict[str, torch.Tensor], bool], None],
    forward_timeout_s: float,
) -> dict[int, str]:
    """A replica leader's side of one version: receive each announced bucket from its source (the owner of the
    bucket's stage, or this machine's relay), forward it to the mates this leader relays to, verify it and
    `apply(tensors, last)` it before receiving the next. Returns the mates whose forward failed.
    Raises PeerTimeout if a bucket does not arrive (the source is gone), WeightSyncError if one is corrupted."""
    me = dist.get_rank()
    forward = BucketStream(
        {m: mate_link(links, me, m) for m in msg["forward"]}, forward_timeout_s, "a machine-mate to take weights"
    )
    # the owners hand over through shared slots (SlotStream) only to relays; mates always get the wire
    shared = msg.get("handover", "wire") == "shared" and msg["source"] is None
    opened: dict[int, OpenedSlots] = {}
    n = len(msg["buckets"])
    # each owner numbers its own buckets from 0 (send_version walks its stage's buckets)
    index_in_stage: dict[int, int] = {}
    for i, meta in enumerate(msg["buckets"]):
        src = msg["owners"][meta["stage"]] if msg["source"] is None else msg["source"]
        group = links[("owners", me)] if msg["source"] is None else mate_link(links, me, src)
        index = index_in_stage.get(meta["stage"], 0)
        index_in_stage[meta["stage"]] = index + 1
        forward.reserve()
        try:
            if shared:
                if src not in opened:
                    opened[src] = receive_slots(src, group, device)
                ready = torch.full((1,), -2, dtype=torch.int64)
                dist.recv(ready, src=src, group=group)
                if int(ready.item()) != index:
                    raise WeightSyncError(f"rank {src} handed over bucket {int(ready.item())}, expected {index}")
                slot = opened[src].slot(index, meta["wire_bytes"])
                # a bucket to forward is copied out first, so the owner may refill the slot while it travels on
                buf = wire_buffer(meta["wire_bytes"], device).copy_(slot) if msg["forward"] else slot
            else:
                buf = wire_buffer(meta["wire_bytes"], device)
                dist.recv(buf, src=src, group=group)
        except RuntimeError as e:
            if isinstance(e, HexrlError):
                raise
            forward.close()
            raise PeerTimeout(
                [src], 0, f"bucket {i} of weight version {msg['version']} ({str(e).splitlines()[0][:120]})"
            ) from None
        if i == n // 2:
            injected_fault(me, msg["version"])
        forward.send(buf)
        apply(unseal(buf, meta, msg["version"], msg["verify"]), i == n - 1)
        if shared:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the slot is read before the owner may refill it
            dist.send(torch.tensor([index], dtype=torch.int64), dst=src, group=group)
        del buf
    opened.clear()
    return forward.close()


def injected_fault(rank: int, version: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec:
        want_rank, want_version, sig = spec.split(":")
        if int(want_rank) == rank and int(want_version) == version:
            os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
