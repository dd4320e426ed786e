"""Shared-memory slots for handing weight buckets to another process on the same host without copying them
through a socket: CUDA IPC on a GPU, a /dev/shm file on CPU.

Colocated mode runs every group on gloo, which moves a CUDA bucket device -> pinned host -> TCP loopback -> pinned
host -> device. With shared slots the owner writes each bucket into memory the receiver has mapped, and the
process group carries only a handle (once per version) and a bucket index each way (parallel/weight_sync.py's
SlotStream): one device-to-device copy on a GPU instead of four copies and a socket.

Owner side: SharedSlots(count, slot_bytes, device) allocates `count` slots and describes them in a fixed-size
uint8 tensor (`descriptor`) the receiver passes to `open_slots`. On CPU the file is unlinked as soon as every
receiver has mapped it (`release_name`), so a crash later leaves nothing in /dev/shm. The descriptor is JSON of
numbers and hex strings, never pickle.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from errors import HexrlError

DESCRIPTOR_BYTES = 1024  # the handle of one owner's slots: JSON, zero-padded to a fixed size for one dist.recv
SHM_DIR = "/dev/shm"
FILE_PREFIX = "hexrl-weights-"


class HandoverError(HexrlError, RuntimeError):
    """Shared slots that cannot be created or opened (no /dev/shm, a bad descriptor, a slot out of range)."""


class SharedSlots:
    """`count` slots of `slot_bytes` each in memory another process on this host can map."""

    def __init__(self, count: int, slot_bytes: int, device: torch.device):
        if count < 1 or slot_bytes < 1:
            raise HandoverError(f"shared slots need count >= 1 and slot_bytes >= 1, got {count} x {slot_bytes}")
        self.count, self.slot_bytes, self.device = count, slot_bytes, device
        self.path: str | None = None
        nbytes = count * slot_bytes
        if device.type == "cuda":
            self.memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
            (dev, handle, size, offset, rc_handle, rc_offset, event, event_sync) = (
                self.memory.untyped_storage()._share_cuda_()
            )
            spec = {"kind": "cuda", "device": dev, "handle": handle.hex(), "size": size, "offset": offset}
            spec.update(ref_counter=rc_handle.hex(), ref_counter_offset=rc_offset, event_sync=bool(event_sync))
            spec["event"] = event.hex() if event else ""
        elif device.type == "cpu":
            if not os.path.isdir(SHM_DIR):
                raise HandoverError(f"shared slots on CPU need {SHM_DIR} (a tmpfs); use dist.handover=wire")
            fd, self.path = tempfile.mkstemp(dir=SHM_DIR, prefix=FILE_PREFIX)
            os.close(fd)
            self.memory = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
            spec = {"kind": "file", "name": os.path.basename(self.path)}
        else:
            raise HandoverError(f"shared slots support cpu and cuda devices, not {device.type}")
        spec.update(count=count, slot_bytes=slot_bytes)
        self.descriptor = encode_descriptor(spec)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return slot_view(self.memory, self.count, self.slot_bytes, index, nbytes)

    def release_name(self) -> None:
        """Every receiver has mapped the slots: the /dev/shm name is no longer needed (the mappings stay)."""
        if self.path is not None:
            os.unlink(self.path)
            self.path = None

    def close(self) -> None:
        self.release_name()
        self.memory = None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks a receiver had open go back to the allocator once it let them go


class OpenedSlots:
    """A receiver's mapping of an owner's SharedSlots."""

    def __init__(self, memory: torch.Tensor, count: int, slot_bytes: int):
        self.memory, self.count, self.slot_bytes = memory, count, slot_bytes

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return slot_view(self.memory, self.count, self.slot_bytes, index, nbytes)


def slot_view(memory: torch.Tensor, count: int, slot_bytes: int, index: int, nbytes: int) -> torch.Tensor:
    """Bucket `index` lives in slot index % count; it must fit the slot."""
    if nbytes > slot_bytes or index < 0:
        raise HandoverError(f"bucket {index} of {nbytes} bytes does not fit a shared slot of {slot_bytes} bytes")
    start = (index % count) * slot_bytes
    return memory[start : start + nbytes]


def encode_descriptor(spec: dict) -> torch.Tensor:
    raw = json.dumps(spec, separators=(",", ":")).encode()
    if len(raw) > DESCRIPTOR_BYTES:
        raise HandoverError(f"shared-slot descriptor of {len(raw)} bytes exceeds {DESCRIPTOR_BYTES}")
    out = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def open_slots(descriptor: torch.Tensor, device: torch.device) -> OpenedSlots:
    """Map the slots a SharedSlots' descriptor names, in this process."""
    raw = bytes(descriptor.to(torch.uint8).tolist()).rstrip(b"\0")
    try:
        spec = json.loads(raw)
        count, slot_bytes, kind = int(spec["count"]), int(spec["slot_bytes"]), spec["kind"]
    except (ValueError, KeyError, TypeError) as e:
        raise HandoverError(f"unreadable shared-slot descriptor ({e}): {raw[:80]!r}") from None
    nbytes = count * slot_bytes
    if kind == "file":
        name = str(spec.get("name", ""))
        # only a file the owner created for this purpose: no path of any other kind is ever opened
        if not name.startswith(FILE_PREFIX) or "/" in name or name in (".", ".."):
            raise HandoverError(f"shared-slot descriptor names {name!r}, not a {FILE_PREFIX}* file in {SHM_DIR}")
        path = os.path.join(SHM_DIR, name)
        if not os.path.isfile(path) or os.path.getsize(path) < nbytes:
            raise HandoverError(
                f"shared slots {path} are gone or shorter than {nbytes} bytes (the owner released them)"
            )
        memory = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    elif kind == "cuda":
        if device.type != "cuda":
            raise HandoverError(f"shared slots on a GPU cannot be opened by a process on {device}")
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            int(spec["device"]),
            bytes.fromhex(spec["handle"]),
            int(spec["size"]),
            int(spec["offset"]),
            bytes.fromhex(spec["ref_counter"]),
            int(spec["ref_counter_offset"]),
            bytes.fromhex(spec["event"]) if spec["event"] else None,
            bool(spec["event_sync"]),
        )
        memory = torch.empty(0, dtype=torch.uint8, device=f"cuda:{int(spec['device'])}").set_(storage)
        if memory.numel() < nbytes:
            raise HandoverError(f"shared GPU slots hold {memory.numel()} bytes, the descriptor says {nbytes}")
    else:
        raise HandoverError(f"shared-slot descriptor of unknown kind {kind!r} (expected 'file' or 'cuda')")
    return OpenedSlots(memory, count, slot_bytes)
