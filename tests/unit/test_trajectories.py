"""Packed trajectories (parallel/trajectories.py): exact round trips and the bytes they cost (the real path rollout
leader → train head → train follower under torchrun: tests/dist/test_trajectories_ranks.py)."""

import json
import math
import os
import random
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from buffer import Trajectory, group_advantages  # noqa: E402
from parallel.trajectories import (  # noqa: E402
    TrajectoryFormatError,
    batch_control,
    batch_payload,
    pack,
    packed_size,
    unpack,
    unpack_batch,
)


def bits(x):
    """A field as JSON-safe text, floats by their 64 bits: equal exactly when bitwise equal (NaN payloads too)."""
    if isinstance(x, float):
        return "f:" + struct.pack("<d", x).hex()
    if isinstance(x, list):
        return [bits(v) for v in x]
    return f"{type(x).__name__}:{x}"


def canon(trajs):
    return [{k: bits(v) for k, v in t.to_dict().items()} for t in trajs]


def f32(values):
    """Python floats that are exactly float32 values, as the sampler's log-probs are."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def make_group(rng, group_id, G, prompt_len, mean_len, versions=(3, 4, 5), max_id=151_935):
    prompt = [rng.randrange(max_id) for _ in range(prompt_len)]
    out = []
    for s in range(G):
        n = min(int(rng.lognormvariate(math.log(mean_len), 0.5)), 8 * mean_len)
        cuts = [0, *sorted(rng.randrange(n + 1) for _ in range(len(versions) - 1)), n]
        vs = [v for k, v in enumerate(versions) for _ in range(cuts[k + 1] - cuts[k])]
        out.append(
            Trajectory(
                prompt_id=group_id * 7 % 1000,
                sample_idx=s,
                prompt_ids=list(prompt),
                response_ids=[rng.randrange(max_id) for _ in range(n)],
                behav_logprobs=f32([-rng.expovariate(1.0) for _ in range(n)]),
                versions=vs,
                reward=rng.choice([0.0, 1.0]),
                finish_reason=rng.choice(["stop", "length"]),
                group_id=group_id,
                correct=rng.random() < 0.5,
            )
        )
    return out


def odd_trajectories(rng):
    """The corners: empty and long responses, NaN / inf / -0.0 and non-float32 log-probs, extreme ids and versions,
    several prompts, odd finish reasons, lengths that disagree (the trainer names those itself)."""
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF0_0000_0000_0001))[0]  # a signalling NaN
    ts = [
        Trajectory(0, 0, [], [], [], [], 0.0),
        Trajectory(1, 1, [5], [], [], [], -1.5, advantage=math.nan, finish_reason="", group_id=2**62, correct=True),
        Trajectory(
            2**63 - 1,
            -(2**63),
            [0, 2**31 - 1, -(2**31)],
            [2**31 - 1, 0, -(2**31)],
            [math.nan, math.inf, -math.inf],
            [2**31 - 1, -(2**31), 0],
            math.inf,
            advantage=-0.0,
            finish_reason="ünïcode reason",
        ),
        Trajectory(3, 0, [1, 2], [7, 8, 9, 10], [0.1, -0.0, 1e-320, nan_payload], [1, 2, 1, 2], 1e300),
        Trajectory(4, 0, [1, 2], [7], [-0.5, -0.25], [9, 9, 9], 0.5, finish_reason="length"),  # lengths disagree
    ]
    n = 20_000
    ts.append(
        Trajectory(
            5,
            3,
            [rng.randrange(2**31) for _ in range(300)],
            [rng.randrange(2**31) for _ in range(n)],
            f32([rng.gauss(-2, 3) for _ in range(n)]),
            [rng.randrange(4) for _ in range(n)],  # a run per token or so
            0.25,
        )
    )
    return ts


def test_round_trip_is_exact_for_random_and_odd_trajectories():
    rng = random.Random(0)
    cases = [[], odd_trajectories(rng)]
    for k in range(40):
        group = make_group(rng, rng.randrange(2**40), rng.randint(1, 16), rng.randint(0, 300), rng.choice([1, 30, 500]))
        if k % 3 == 0:  # mixed prompts, NaN / inf sprinkled in, a non-float32 value forces the float64 section
            group += make_group(rng, 5, 2, 10, 20)
            for t in group[::2]:
                if t.behav_logprobs:
                    t.behav_logprobs[rng.randrange(len(t.behav_logprobs))] = rng.choice([math.nan, -math.inf, 0.1])
        cases.append(group)
    for trajs in cases:
        buf = pack(trajs)
        assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0 and packed_size(buf) == buf.numel()
        assert canon(unpack(buf)) == canon(trajs)
        assert canon(unpack(pack(unpack(buf)))) == canon(trajs)
    assert [len(t.prompt_ids) for t in unpack(pack(cases[2]))] == [len(t.prompt_ids) for t in cases[2]]


def test_unpacked_lists_are_fresh_python_values():
    trajs = make_group(random.Random(1), 9, 4, 12, 10)
    out = unpack(pack(trajs))
    out[0].prompt_ids.append(-1)  # each trajectory owns its lists, as after JSON
    assert out[1].prompt_ids == trajs[1].prompt_ids
    assert all(type(x) is int for x in out[0].response_ids) and all(type(x) is float for x in out[0].behav_logprobs)
    assert type(out[0].correct) is bool and type(out[0].reward) is float


def test_bytes_per_response_token_on_realistic_groups():
    """Groups as a long-reasoning GRPO run sends them: G = 16, prompts of 100-300 tokens, ~2k-token responses
    spanning 3 policy versions. Target <= 12 B per response token, JSON is ~28."""
    rng = random.Random(2)
    groups = [make_group(rng, g, 16, rng.randint(100, 300), 2000) for g in range(4)]
    tokens = sum(len(t.response_ids) for g in groups for t in g)
    packed = sum(pack(g).numel() for g in groups)
    as_json = sum(len(json.dumps([t.to_dict() for t in g])) for g in groups)
    assert packed / tokens <= 12.0, packed / tokens
    assert packed / tokens < 8.5 and as_json / tokens > 20  # 8 B (id + log-prob) plus headers and prompts
    # short answers (the CPU demo's ~20-token responses, prompts of ~60 tokens, G = 8) stay well under JSON too
    small = [make_group(rng, g, 8, 60, 20) for g in range(4)]
    tokens = sum(len(t.response_ids) for g in small for t in g)
    assert (
        sum(pack(g).numel() for g in small) / tokens
        < 0.5 * sum(len(json.dumps([t.to_dict() for t in g])) for g in small) / tokens
    )


def test_bad_input_is_named():
    with pytest.raises(TrajectoryFormatError, match="cannot pack trajectory 0"):
        pack([Trajectory(0, 0, [2**31], [], [], [], 0.0)])  # a token id beyond int32
    with pytest.raises(TrajectoryFormatError, match="cannot pack trajectory 1"):
        pack([Trajectory(0, 0, [], [], [], [], 0.0), Trajectory(0, 0, [], [None], [], [], 0.0)])
    with pytest.raises(TrajectoryFormatError, match="NUL"):
        pack([Trajectory(0, 0, [], [], [], [], 0.0, finish_reason="a\0b")])
    buf = pack(make_group(random.Random(3), 1, 2, 5, 5))
    with pytest.raises(TrajectoryFormatError, match="magic"):
        unpack(torch.zeros_like(buf))
    with pytest.raises(TrajectoryFormatError, match="declare"):
        unpack(buf[:-8])


def test_batch_payload_is_the_groups_as_they_are_then_the_advantages():
    """What the head broadcasts to the train followers: each group's received bytes unchanged, then one float64
    advantage per trajectory (exactly the head's numbers)."""
    rng = random.Random(4)
    groups = [make_group(rng, g, 4, 20, 30) for g in range(3)]
    packed = [pack(g) for g in groups]
    trajs = [t for g in groups for t in g]
    for g in groups:
        for t, a in zip(g, group_advantages([t.reward for t in g])):
            t.advantage = a
    advantages = [t.advantage for t in trajs]
    cmd = batch_control(packed, advantages)
    payload = batch_payload(packed, advantages)
    assert torch.equal(payload[: sum(cmd["sizes"])], torch.cat(packed))
    assert cmd == {"sizes": [p.numel() for p in packed], "count": 12}
    assert canon(unpack_batch(cmd["sizes"], payload)) == canon(trajs)
    with pytest.raises(TrajectoryFormatError, match="advantages"):
        unpack_batch(cmd["sizes"], payload[:-8])
