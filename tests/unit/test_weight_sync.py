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


# ---------------------------------------------------------------------------------------------- bucket by bucket
def swap_in_buckets(kind: str, bucket_names: int | None):
    """Generate 4 tokens, swap to new weights (all at once, or `bucket_names` names per call), generate on."""
    import copy

    from test_generator import PROMPTS, make_model, perturbed_state_dict

    from generator import Generator, SamplingParams

    model = make_model(kind)
    new = perturbed_state_dict(copy.deepcopy(model), seed=7)
    gen = Generator(model, max_batch_size=4, max_seq_len=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    for i, prompt in enumerate(PROMPTS[:3]):
        gen.add_request(i, prompt, params)
    outs = {}
    for _ in range(4):
        outs.update((o.request_id, o) for o in gen.step())
    items = list(new.items())
    if bucket_names is None:
        gen.update_weights(new, version=1)
    else:
        chunks = [dict(items[i : i + bucket_names]) for i in range(0, len(items), bucket_names)]
        for j, chunk in enumerate(chunks):
            gen.update_weights(chunk, version=1, last=j == len(chunks) - 1)
            if j < len(chunks) - 1:  # mid-version: still the old one, nothing marked for re-prefill yet
                assert gen.version == 0 and not any(r is not None and r.needs_prefill for r in gen.slots)
    assert gen.version == 1
    while gen.num_unfinished():
        outs.update((o.request_id, o) for o in gen.step())
    return [(o.token_ids, o.logprobs, o.versions) for _, o in sorted(outs.items())]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_version_applied_bucket_by_bucket_equals_one_update(kind):
    assert swap_in_buckets(kind, 3) == swap_in_buckets(kind, None)


def test_a_stream_keeps_at_most_two_buffers_alive(monkeypatch):
    """BucketStream waits for the bucket before last before a new one may be filled: whatever the peers do, at most
    IN_FLIGHT buffers are referenced at any time, and a peer whose send fails gets nothing more."""
    import gc
    import weakref

    from parallel.channel import PeerTimeout
    from parallel.weight_sync import IN_FLIGHT, BucketStream

    sends = []

    class Work:
        def __init__(self, dst):
            self.dst = dst

    def isend(buf, dst, group):
        sends.append(dst)
        return Work(dst)

    def wait_work(work, timeout_s, who, what):
        if work.dst == 2:
            raise PeerTimeout(who, timeout_s, what)

    monkeypatch.setattr(weight_sync.dist, "isend", isend)
    monkeypatch.setattr(weight_sync, "wait_work", wait_work)
    monkeypatch.setattr(weight_sync, "ABANDONED", [])
    stream = BucketStream({1: None, 2: None}, 1.0, "test")
    alive = []
    for _ in range(10):
        stream.reserve()
        gc.collect()
        alive = [r for r in alive if r() is not None and not any(r() is b for b in weight_sync.ABANDONED)]
        assert len(alive) <= IN_FLIGHT - 1, "a new buffer while two are still leaving"
        buf = torch.zeros(1000, dtype=torch.uint8)
        alive.append(weakref.ref(buf))
        stream.send(buf)
        del buf
    assert stream.close() == {2: "rank(s) [2] sent nothing for 1s while waiting for test"}
    # peer 2 fails at its first wait, when its second bucket is already posted: nothing more after that
    assert sends.count(1) == 10 and sends.count(2) == IN_FLIGHT
    assert stream.bytes_sent == (10 + IN_FLIGHT) * 1000
