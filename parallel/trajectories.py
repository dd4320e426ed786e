"""Trajectories on the wire: a list of Trajectory packed into one flat byte buffer, and how groups travel.

Why here and not in buffer.py: the format exists for the transport (rollout leader → train head → train
followers), beside the other wire paths (channel.py for control messages, weight_sync.py for weights);
buffer.py stays the staleness rules, free of torch.distributed.

Format (native byte order, every section starts 8-byte aligned, the total is a multiple of 8):
  header    int64[10]        MAGIC, trajectories n, distinct prompts, prompt tokens, response tokens,
                             log-probs, version runs, bytes per log-prob (4 or 8), finish-name bytes, total bytes
  rows      int64[n, 10]     prompt_id, sample_idx, group_id, prompt index, response tokens, log-probs,
                             versions, version runs, finish code, correct
  scalars   float64[n, 2]    reward, advantage
  prompts   int64[prompts]   lengths, then int32[prompt tokens]: each distinct prompt once (the G samples of a
                             group share theirs)
  tokens    int32[response tokens]
  logprobs  float32[...]     float64 instead when some value is not exactly a float32 (the sampler's always are)
  versions  int32[runs, 2]   run-length coded (version, count): a response spans a few policy versions
  names     utf-8            the finish reasons the codes index, each ended by a NUL
So a response token costs 8 bytes (id + log-prob) plus its share of 80 bytes of header and row per trajectory,
8 per version run and 4 per prompt token / G. Unpacking gives back every field exactly (floats bitwise,
NaN and inf included), lengths that disagree included (the trainer reports those itself).

Rollout leader → train head (TrajectorySender / TrajectoryInbox). Gloo's point-to-point is a rendezvous: a send's
bytes move only once the receiver has posted its receive, moved by the sender's gloo thread; `is_completed()` stays
False until `wait()` on both sides, and a wait that times out closes every pair of the process group. So:
  1. leader: pack, `isend` (tag TRAJECTORY_TAG), then `result` {group_id, nbytes, counters} on the channel;
  2. head, reading `result`: posts the matching `irecv` (nothing waits), answers `fetch` {group_id};
  3. leader, reading `fetch`: the head's receive is posted, so its send completes by itself within moments; it
     waits for it (deadline dist.timeout_s: only a dead or stopped head makes it fire) and says `delivered`;
  4. head, reading `delivered`: the bytes are in its socket or buffer already, so its wait cannot depend on the
     leader being alive (SIGSTOP or not) any more; unpacks and completes the group.
A leader stopped anywhere in between is just silent: the head drops it as before, its posted receives are kept
alive and never awaited. Results are matched in order (gloo keeps per-pair, per-tag order; so do the channel and
the head, which posts one receive per `result` read from a live rank and none once it dropped the rank).

Train head → train followers (broadcast_batch / receive_batch): the head forwards the groups' buffers as they
arrived, then the batch's advantages (float64: exactly the head's numbers, as JSON carried them): one control
broadcast (the sizes, through the head's `command`), then one `dist.broadcast` of the concatenation over the train
group. About 8 bytes per response token against JSON's 30 (exp/bench_trajectories.py measures both).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
import torch.distributed as dist

from buffer import Trajectory
from errors import HexrlError
from parallel.channel import wait_work

TRAJECTORY_TAG = 23
MAGIC = 0x68657872_6C545231  # "hexrlTR1"
HEADER = 10  # int64 fields
ROW = 10  # int64 fields per trajectory
assert array("i").itemsize == 4 and array("q").itemsize == 8


class TrajectoryFormatError(HexrlError, ValueError):
    """A buffer that is not a packed trajectory list, or a trajectory the format cannot hold."""


class PackedGroup(list):
    """A group's trajectories (a list, as the staleness buffer keeps them) with the bytes they arrived as, so the
    head forwards those instead of packing again."""

    def __init__(self, trajectories: Sequence[Trajectory], packed: torch.Tensor):
        super().__init__(trajectories)
        self.packed = packed


def _pad(n: int) -> int:
    return (n + 7) // 8 * 8


def _tensor(a: array, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(a, dtype=dtype) if len(a) else torch.empty(0, dtype=dtype)


def pack(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """-> a uint8 tensor holding the list (see the module docstring)."""
    rows, scalars = array("q"), array("d")
    prompt_index: dict[tuple, int] = {}
    prompt_lens, prompts = array("q"), array("i")
    tokens, logprobs, versions = array("i"), array("d"), array("i")
    names: dict[str, int] = {}
    version_lens = []
    try:
        for t in trajectories:
            key = tuple(t.prompt_ids)
            p = prompt_index.get(key)
            if p is None:
                p = prompt_index[key] = len(prompt_lens)
                prompt_lens.append(len(key))
                prompts.extend(key)
            code = names.setdefault(t.finish_reason, len(names))
            tokens.extend(t.response_ids)
            logprobs.extend(t.behav_logprobs)
            versions.extend(t.versions)
            version_lens.append(len(t.versions))
            rows.extend(
                (t.prompt_id, t.sample_idx, t.group_id, p, len(t.response_ids), len(t.behav_logprobs))
                + (len(t.versions), 0, code, int(bool(t.correct)))
            )
            scalars.extend((t.reward, t.advantage))
    except (OverflowError, TypeError) as e:
        raise TrajectoryFormatError(f"cannot pack trajectory {len(version_lens)}: {e}") from None
    if not all(isinstance(name, str) and "\0" not in name for name in names):
        raise TrajectoryFormatError(f"finish reasons must be strings without NUL, got {list(names)}")
    name_bytes = "".join(name + "\0" for name in names).encode()

    # versions, run-length coded per trajectory: a run starts at each change and at each trajectory's start
    v = _tensor(versions, torch.int32)
    lens = torch.tensor(version_lens, dtype=torch.int64)
    ends = lens.cumsum(0)
    starts = ends - lens
    change = torch.ones(v.numel(), dtype=torch.bool)
    if v.numel() > 1:
        change[1:] = v[1:] != v[:-1]
    change[starts[lens > 0]] = True
    at = change.nonzero().squeeze(1)
    counts = torch.diff(at, append=torch.tensor([v.numel()]))
    runs = torch.stack([v[at], counts.to(torch.int32)], dim=1)
    csum = torch.cat([torch.zeros(1, dtype=torch.int64), change.cumsum(0)])
    n = len(version_lens)
    table = _tensor(rows, torch.int64).view(n, ROW)
    table[:, 7] = csum[ends] - csum[starts]

    lp64 = _tensor(logprobs, torch.float64)
    lp32 = lp64.to(torch.float32)
    lp = lp32 if torch.equal(lp32.to(torch.float64).view(torch.int64), lp64.view(torch.int64)) else lp64
    sections = [
        table,
        _tensor(scalars, torch.float64),
        _tensor(prompt_lens, torch.int64),
        _tensor(prompts, torch.int32),
        _tensor(tokens, torch.int32),
        lp,
        runs,
        torch.frombuffer(bytearray(name_bytes), dtype=torch.uint8) if name_bytes else torch.empty(0, dtype=torch.uint8),
    ]
    sizes = [s.numel() * s.element_size() for s in sections]
    total = 8 * HEADER + sum(_pad(s) for s in sizes)
    header = [MAGIC, n, len(prompt_lens), len(prompts), len(tokens), len(logprobs), runs.shape[0]]
    header += [lp.element_size(), len(name_bytes), total]
    out = torch.zeros(total, dtype=torch.uint8)
    out[: 8 * HEADER] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    offset = 8 * HEADER
    for s, size in zip(sections, sizes):
        out[offset : offset + size] = s.contiguous().view(-1).view(torch.uint8)
        offset += _pad(size)
    return out


def packed_size(buf: torch.Tensor) -> int:
    """The byte length a packed buffer declares (its header's last field)."""
    if buf.numel() < 8 * HEADER or buf[:8].view(torch.int64).item() != MAGIC:
        raise TrajectoryFormatError("not a packed trajectory buffer (bad magic)")
    return int(buf[8 * (HEADER - 1) : 8 * HEADER].view(torch.int64).item())


def unpack(buf: torch.Tensor) -> list[Trajectory]:
    """The exact inverse of pack()."""
    total = packed_size(buf)
    if buf.numel() != total:
        raise TrajectoryFormatError(f"packed trajectories declare {total} bytes, the buffer holds {buf.numel()}")
    _, n, n_prompts, n_prompt_tokens, n_tokens, n_logprobs, n_runs, lp_bytes, n_names, _ = (
        buf[: 8 * HEADER].view(torch.int64).tolist()
    )
    if lp_bytes not in (4, 8):
        raise TrajectoryFormatError(f"packed trajectories: bad log-prob width {lp_bytes}")
    offset = 8 * HEADER

    def take(count: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal offset
        size = count * torch.empty(0, dtype=dtype).element_size()
        if offset + size > total:
            raise TrajectoryFormatError("packed trajectories: a section runs past the end of the buffer")
        s = buf[offset : offset + size].view(dtype)
        offset += _pad(size)
        return s

    rows = take(n * ROW, torch.int64).view(n, ROW).tolist()
    scalars = take(2 * n, torch.float64).view(n, 2).tolist()
    prompt_lens = take(n_prompts, torch.int64).tolist()
    prompt_tokens = take(n_prompt_tokens, torch.int32)
    tokens = take(n_tokens, torch.int32)
    logprobs = take(n_logprobs, torch.float32 if lp_bytes == 4 else torch.float64)
    runs = take(2 * n_runs, torch.int32).view(n_runs, 2).tolist()
    names = bytes(take(n_names, torch.uint8).numpy()).decode().split("\0")[:-1]
    columns = [sum(r[k] for r in rows) for k in (4, 5, 7)]
    if sum(prompt_lens) != n_prompt_tokens or columns != [n_tokens, n_logprobs, n_runs]:
        raise TrajectoryFormatError("packed trajectories: lengths disagree with the header")

    prompts, at = [], 0
    for length in prompt_lens:
        prompts.append(prompt_tokens[at : at + length].tolist())
        at += length
    out = []
    t_at = l_at = r_at = 0
    for (pid, sidx, gid, p, nt, nl, nv, nr, code, correct), (reward, advantage) in zip(rows, scalars):
        versions = []
        for version, count in runs[r_at : r_at + nr]:
            versions += [version] * count
        if len(versions) != nv:
            raise TrajectoryFormatError("packed trajectories: version runs disagree with the lengths")
        out.append(
            Trajectory(
                prompt_id=pid,
                sample_idx=sidx,
                prompt_ids=list(prompts[p]),
                response_ids=tokens[t_at : t_at + nt].tolist(),
                behav_logprobs=logprobs[l_at : l_at + nl].tolist(),
                versions=versions,
                reward=reward,
                advantage=advantage,
                finish_reason=names[code],
                group_id=gid,
                correct=bool(correct),
            )
        )
        t_at, l_at, r_at = t_at + nt, l_at + nl, r_at + nr
    return out


# ---------------------------------------------------------------------------------------------- rollout → head
class TrajectorySender:
    """On a rollout leader: each group's buffer and send Work, kept alive until the head has fetched it."""

    def __init__(self, head: int, timeout_s: float):
        self.head, self.timeout_s = head, timeout_s
        self.unfetched: dict[int, tuple] = {}  # group_id -> (work, buffer)

    def post(self, group_id: int, trajectories: Sequence[Trajectory]) -> dict:
        """isend the packed group; -> the fields of its `result` message (send that right after)."""
        buf = pack(trajectories)
        self.unfetched[group_id] = (dist.isend(buf, dst=self.head, tag=TRAJECTORY_TAG), buf)
        return {"group_id": group_id, "nbytes": buf.numel()}

    def fetched(self, group_id: int) -> None:
        """The head posted its receive (`fetch`): the send completes by itself; wait for it, then say `delivered`."""
        if group_id not in self.unfetched:
            raise HexrlError(f"the train head fetched group {group_id}, which this rank never sent")
        work, _ = self.unfetched.pop(group_id)
        wait_work(work, self.timeout_s, [self.head], f"the train head to receive group {group_id}")


class TrajectoryInbox:
    """On the train head: receives posted for announced groups, awaited only once they are delivered."""

    def __init__(self):
        self.posted: dict[tuple[int, int], tuple] = {}  # (src, group_id) -> (work, buffer); a dropped rank's stay

    def expect(self, src: int, group_id: int, nbytes: int) -> None:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.posted[(src, group_id)] = (dist.irecv(buf, src=src, tag=TRAJECTORY_TAG), buf)

    def take(self, src: int, group_id: int) -> PackedGroup:
        """The group `src` says it delivered: its send completed, so this wait finishes without it."""
        work, buf = self.posted.pop((src, group_id))
        work.wait()
        trajectories = unpack(buf)
        if any(t.group_id != group_id for t in trajectories):
            raise TrajectoryFormatError(f"rank {src} delivered group {group_id} holding other groups' trajectories")
        return PackedGroup(trajectories, buf)


# ---------------------------------------------------------------------------------------------- head → followers
def broadcast_batch(groups: Sequence[torch.Tensor], advantages: Sequence[float], src: int, group) -> None:
    """Head, after the control broadcast of the sizes (batch_control): the groups' buffers as they are, then the
    batch's advantages, in one broadcast over the train group."""
    dist.broadcast(batch_payload(groups, advantages), src=src, group=group)


def batch_payload(groups: Sequence[torch.Tensor], advantages: Sequence[float]) -> torch.Tensor:
    return torch.cat([*groups, torch.tensor(list(advantages), dtype=torch.float64).view(torch.uint8)])


def batch_control(groups: Sequence[torch.Tensor], advantages: Sequence[float]) -> dict:
    """The fields of the `train` command that announces broadcast_batch: byte sizes and the trajectory count."""
    return {"sizes": [g.numel() for g in groups], "count": len(advantages)}


def receive_batch(cmd: dict, src: int, group) -> list[Trajectory]:
    """Follower: the batch broadcast_batch sent, advantages set to the head's."""
    payload = torch.empty(sum(cmd["sizes"]) + 8 * cmd["count"], dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    return unpack_batch(cmd["sizes"], payload)


def unpack_batch(sizes: Sequence[int], payload: torch.Tensor) -> list[Trajectory]:
    trajectories, at = [], 0
    for size in sizes:
        trajectories += unpack(payload[at : at + size])
        at += size
    if payload.numel() != at + 8 * len(trajectories):
        raise TrajectoryFormatError(
            f"a batch of {len(trajectories)} trajectories came with {payload.numel() - at} bytes of advantages"
        )
    for t, a in zip(trajectories, payload[at:].view(torch.float64).tolist()):
        t.advantage = a
    return trajectories
