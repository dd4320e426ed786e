"""Weight-transfer checksums: exact, position-sensitive, and the same whatever chunk size computes them."""

import pytest
import torch

from parallel import weight_sync
from parallel.weight_sync import checksum


def reference_checksum(flat: torch.Tensor) -> int:
    """The definition, in one piece: sum over 32-bit words of (unsigned word) * (index mod 65521 + 1)."""
    data = flat.contiguous().view(torch.uint8).tolist()
    data += [0] * ((-len(data)) % 4)
    words = [int.from_bytes(bytes(data[i : i + 4]), "little") for i in range(0, len(data), 4)]
    return sum(w * (i % 65521 + 1) for i, w in enumerate(words))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 3, 1001])
def test_checksum_matches_its_definition_in_any_chunking(monkeypatch, dtype, n):
    flat = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    expected = reference_checksum(flat)
    for chunk in (1, 7, 1 << 20):
        monkeypatch.setattr(weight_sync, "CHECKSUM_CHUNK_WORDS", chunk)
        assert checksum(flat) == expected


def test_checksum_sees_a_swap_and_a_one_ulp_change():
    flat = torch.randn(64, generator=torch.Generator().manual_seed(0))
    swapped = flat.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    nudged = flat.clone()
    nudged.view(torch.int32)[5] += 1
    assert len({checksum(flat), checksum(swapped), checksum(nudged)}) == 3
