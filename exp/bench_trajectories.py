"""Trajectories on the wire, JSON vs packed (parallel/trajectories.py), side by side in one process.

    .venv/bin/python exp/bench_trajectories.py [--prompts 512] [--samples 16] [--mean-len 2000]

A synthetic batch as a long-reasoning GRPO run makes it: `--prompts` groups of `--samples` responses, prompts of
100-300 tokens (shared within a group), response lengths lognormal around `--mean-len` (sigma 0.3), token ids
below 151,936, float32 log-probs, each response spanning 1-3 policy versions. Both paths do what the run does:
  JSON    rollout: to_dict + json.dumps per group (the `result` message) -> head: json.loads + from_dict per group,
          then to_dict + json.dumps of the whole batch (broadcast_json) -> follower: json.loads + from_dict
  packed  rollout: pack per group (+ its small `result` message) -> head: unpack per group, then the broadcast
          payload (the received buffers as they are + the advantages) -> follower: unpack_batch
The head's CPU seconds are its decode + re-encode (time.process_time, gc enabled as in a run); the transfers
themselves are not timed (gloo moves bytes in its own threads). Bytes per response token count everything sent
rollout -> head (messages and buffers) and head -> followers. Every decoded list is checked against the original.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from buffer import Trajectory, group_advantages  # noqa: E402
from parallel.trajectories import batch_control, batch_payload, pack, unpack, unpack_batch  # noqa: E402

COUNTERS = {"elapsed_s": 1234.5, "idle_s": 12.25, "reward_s": 3.5, "generated_tokens": 123456, "version": 7}


def synthetic_batch(prompts: int, samples: int, mean_len: int, seed: int) -> list[list[Trajectory]]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(prompts):
        prompt = torch.randint(0, 151_936, (int(torch.randint(100, 301, (1,), generator=g)),), generator=g).tolist()
        lengths = (mean_len * torch.exp(0.3 * torch.randn(samples, generator=g))).clamp(1, 8 * mean_len).long()
        group = []
        for s, n in enumerate(lengths.tolist()):
            ids = torch.randint(0, 151_936, (n,), generator=g).tolist()
            logprobs = (-torch.empty(n).exponential_(1.0, generator=g)).tolist()  # float32 values
            cut = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            v = 40 + gid % 3
            versions = [v] * cut[0] + [v + 1] * (cut[1] - cut[0]) + [v + 2] * (n - cut[1])
            reward = float(torch.rand((), generator=g) < 0.4)
            group.append(
                Trajectory(gid % 7473, s, list(prompt), ids, logprobs, versions, reward, 0.0, "stop", gid, reward > 0)
            )
        groups.append(group)
    return groups


def timed(fn):
    gc.collect()
    t0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - t0, time.perf_counter() - w0


def with_advantages(groups: list[list[Trajectory]]) -> list[float]:
    """The head's GRPO advantages (common to both paths, not timed)."""
    out = []
    for group in groups:
        for t, a in zip(group, group_advantages([t.reward for t in group])):
            t.advantage = a
            out.append(a)
    return out


def json_path(groups: list[list[Trajectory]]) -> dict:
    def rollout():
        return [
            json.dumps(
                {"kind": "result", "group_id": gid, "trajectories": [t.to_dict() for t in g], "counters": COUNTERS},
                separators=(",", ":"),
            )
            for gid, g in enumerate(groups)
        ]

    msgs, enc_cpu, enc_wall = timed(rollout)
    up = sum(len(m) for m in msgs)

    def head_decode():
        return [[Trajectory.from_dict(t) for t in json.loads(m)["trajectories"]] for m in msgs]

    got, dec_cpu, dec_wall = timed(head_decode)
    msgs.clear()  # freed, as once parsed
    with_advantages(got)

    def head_encode():  # broadcast_json({"kind": "train", "trajectories": ...})
        doc = {"kind": "train", "trajectories": [t.to_dict() for g in got for t in g]}
        return torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)

    data, re_cpu, re_wall = timed(head_encode)
    down = data.numel()

    def follower():
        return [Trajectory.from_dict(t) for t in json.loads(bytes(data.numpy()).decode())["trajectories"]]

    out, fol_cpu, fol_wall = timed(follower)
    return locals()


def packed_path(groups: list[list[Trajectory]]) -> dict:
    def rollout():
        bufs = [pack(g) for g in groups]
        msgs = [
            json.dumps(
                {"kind": "result", "group_id": gid, "nbytes": b.numel(), "counters": COUNTERS}, separators=(",", ":")
            )
            for gid, b in enumerate(bufs)
        ]
        msgs += [json.dumps({"kind": "delivered", "group_id": gid}, separators=(",", ":")) for gid in range(len(bufs))]
        return bufs, msgs

    (bufs, msgs), enc_cpu, enc_wall = timed(rollout)
    up = sum(b.numel() for b in bufs) + sum(len(m) for m in msgs)

    def head_decode():  # TrajectoryInbox.take, less the wait
        return [unpack(b) for b in bufs]

    got, dec_cpu, dec_wall = timed(head_decode)
    advantages = with_advantages(got)

    def head_encode():  # train_on: the `train` command (sizes) + broadcast_batch's payload
        cmd = json.dumps({"kind": "train", **batch_control(bufs, advantages)})
        return cmd, batch_payload(bufs, advantages)

    (cmd, payload), re_cpu, re_wall = timed(head_encode)
    down = payload.numel() + len(cmd)
    sizes = json.loads(cmd)["sizes"]

    def follower():
        return unpack_batch(sizes, payload)

    out, fol_cpu, fol_wall = timed(follower)
    return locals()


def same(a: list[Trajectory], b: list[Trajectory]) -> bool:
    return a == b  # field by field (no NaN in this batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--mean-len", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    groups = synthetic_batch(args.prompts, args.samples, args.mean_len, args.seed)
    tokens = sum(len(t.response_ids) for g in groups for t in g)
    n = sum(len(g) for g in groups)
    print(
        f"batch: {args.prompts} prompts x {args.samples} samples = {n} trajectories, {tokens:,} response tokens "
        f"(mean {tokens / n:.0f}), built in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    results = {}
    for name, path in (("json", json_path), ("packed", packed_path)):
        r = path(groups)
        with_advantages(groups)
        flat = [t for g in groups for t in g]
        assert same([t for g in r["got"] for t in g], flat) and same(r["out"], flat), f"{name}: not the same list"
        results[name] = {k: r[k] for k in ("up", "down", "enc_cpu", "dec_cpu", "re_cpu", "fol_cpu")}
        for t in flat:
            t.advantage = 0.0
        del r
        gc.collect()
        print(f"{name} done at {time.perf_counter() - t0:.1f} s", flush=True)

    j, p = results["json"], results["packed"]
    head = {k: r["dec_cpu"] + r["re_cpu"] for k, r in results.items()}
    rows = [
        ("rollout -> head, B per response token", j["up"] / tokens, p["up"] / tokens, "{:.2f}"),
        ("head -> followers, B per response token", j["down"] / tokens, p["down"] / tokens, "{:.2f}"),
        ("rollout encode, CPU s", j["enc_cpu"], p["enc_cpu"], "{:.3f}"),
        ("head decode, CPU s", j["dec_cpu"], p["dec_cpu"], "{:.3f}"),
        ("head re-encode for followers, CPU s", j["re_cpu"], p["re_cpu"], "{:.3f}"),
        ("head total, CPU s", head["json"], head["packed"], "{:.3f}"),
        ("follower decode, CPU s", j["fol_cpu"], p["fol_cpu"], "{:.3f}"),
    ]
    print(f"\n{'':42s} {'JSON':>10s} {'packed':>10s} {'JSON/packed':>12s}")
    for what, a, b, fmt in rows:
        ratio = a / b if b > 0 else math.inf
        print(f"{what:42s} {fmt.format(a):>10s} {fmt.format(b):>10s} {ratio:>11.1f}x")
    summary = {
        "prompts": args.prompts,
        "samples": args.samples,
        "response_tokens": tokens,
        "packed_bytes_per_token": p["up"] / tokens,
        "json_bytes_per_token": j["up"] / tokens,
        "head_cpu_s": head,
        "head_cpu_ratio": head["json"] / head["packed"],
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
