"""Shared-memory slots (parallel/handover.py): what the owner writes the receiver's mapping sees, the /dev/shm name
goes away once released, and every bad descriptor is refused with one HandoverError naming the problem."""

import json
import os

import pytest
import torch

from parallel.handover import DESCRIPTOR_BYTES, HandoverError, SharedSlots, encode_descriptor, open_slots

CPU = torch.device("cpu")


def test_a_receiver_sees_what_the_owner_writes_in_every_slot():
    owner = SharedSlots(2, 100, CPU)
    try:
        reader = open_slots(owner.descriptor, CPU)
        for index in range(5):  # bucket i lives in slot i % 2, refilled in turn
            data = torch.randint(0, 256, (100 - index,), dtype=torch.uint8)
            owner.slot(index, data.numel()).copy_(data)
            assert torch.equal(reader.slot(index, data.numel()), data)
        # the two slots are distinct memory
        owner.slot(0, 100).fill_(1)
        owner.slot(1, 100).fill_(2)
        assert int(reader.slot(2, 100).sum()) == 100 and int(reader.slot(3, 100).sum()) == 200
    finally:
        owner.close()


def test_the_name_is_released_and_the_mappings_stay():
    owner = SharedSlots(2, 16, CPU)
    path = owner.path
    reader = open_slots(owner.descriptor, CPU)
    owner.release_name()
    assert not os.path.exists(path)
    owner.slot(1, 16).fill_(7)
    assert reader.slot(1, 16).tolist() == [7] * 16
    with pytest.raises(HandoverError, match="gone"):  # a late receiver cannot open released slots
        open_slots(owner.descriptor, CPU)
    owner.close()


def test_a_bucket_larger_than_its_slot_is_refused():
    owner = SharedSlots(2, 16, CPU)
    try:
        with pytest.raises(HandoverError, match="does not fit a shared slot of 16 bytes"):
            owner.slot(0, 17)
    finally:
        owner.close()


def spec_of(owner: SharedSlots) -> dict:
    return json.loads(bytes(owner.descriptor.tolist()).rstrip(b"\0"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "../../etc/passwd"}, "not a hexrl-weights-"),
        ({"name": "hexrl-weights-x/../../etc/passwd"}, "not a hexrl-weights-"),
        ({"name": "other-file"}, "not a hexrl-weights-"),
        ({"kind": "socket"}, "unknown kind 'socket'"),
        ({"kind": "cuda"}, "cannot be opened by a process on cpu"),
        ({"slot_bytes": 1 << 20}, "shorter than"),
        ({"count": "two"}, "unreadable"),
    ],
)
def test_bad_descriptors_are_refused_with_one_error(change, message):
    owner = SharedSlots(2, 16, CPU)
    try:
        spec = {**spec_of(owner), **change}
        with pytest.raises(HandoverError, match=message):
            open_slots(encode_descriptor(spec), CPU)
    finally:
        owner.close()


def test_garbage_and_oversized_descriptors_are_refused():
    with pytest.raises(HandoverError, match="unreadable"):
        open_slots(torch.full((DESCRIPTOR_BYTES,), 0x7B, dtype=torch.uint8), CPU)
    with pytest.raises(HandoverError, match="exceeds"):
        encode_descriptor({"kind": "file", "name": "x" * DESCRIPTOR_BYTES})
    with pytest.raises(HandoverError, match="count >= 1"):
        SharedSlots(0, 16, CPU)
