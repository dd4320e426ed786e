"""Our own 1F1B over the PP group (torch's PipelineStage needs static shapes; our packed micro-batches vary in length).

Two schedules: 1F1B for training, a plain forward sweep for inference (prox log-probs).

A stage is described by a callable `step(i, x) -> y`: micro-batch i, input x (None on the first stage, which reads
token ids itself), output y (hidden activations to send on, or on the last stage a scalar loss for training /
anything for inference). Every stage of a pipeline derives the same micro-batches from the same data, so the
activation shape of micro-batch i is known on both sides (`act_shape(i)`) and no shape is ever communicated.

1F1B (non-interleaved, as in PipeDream-Flush/Megatron): stage s runs min(pp-s-1, M) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. At most pp-s activations are alive.
Sends and receives in opposite directions are posted together (batch_isend_irecv) so neighbours never deadlock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StageLinks:
    """This rank's place in its pipeline: global ranks of the neighbours (None at the ends)."""

    prev: int | None
    next: int | None
    group: Any
    device: torch.device
    act_dtype: torch.dtype = torch.float32  # activations always travel in fp32 (bf16 compute casts on entry)
    # wraps every wait on a neighbour: the CPU bench (cpu_bench/) pads the work before it, the wait is not work
    waiting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @classmethod
    def from_groups(cls, groups, device) -> StageLinks:
        p, ranks = groups.pp_rank, groups.pp_ranks
        return cls(
            prev=ranks[p - 1] if p > 0 else None,
            next=ranks[p + 1] if p + 1 < len(ranks) else None,
            group=groups.pp_group,
            device=torch.device(device),
        )

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    # ---- point-to-point; `send` tensors and `recv` shapes are exchanged in one batch
    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[tuple, int]]) -> list[torch.Tensor]:
        ops, out = [], []
        for t, peer in sends:
            ops.append(dist.P2POp(dist.isend, t.detach().to(self.act_dtype).contiguous(), peer, self.group))
        for shape, peer in recvs:
            buf = torch.empty(shape, dtype=self.act_dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
            out.append(buf)
        if ops:
            with self.waiting():
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return out


def forward_only(
    links: StageLinks,
    num_microbatches: int,
    act_shape: Callable[[int], tuple],
    step: Callable[[int, torch.Tensor | None], Any],
) -> list[Any]:
    """Runs every micro-batch through the pipeline without grad; returns the last stage's outputs (else [])."""
    outputs = []
    with torch.no_grad():
        for i in range(num_microbatches):
            x = None if links.first else links.exchange([], [(act_shape(i), links.prev)])[0]
            y = step(i, x)
            if links.last:
                outputs.append(y)
            else:
                links.exchange([(y, links.next)], [])
    return outputs


def train_1f1b(
    links: StageLinks,
    num_microbatches: int,
    act_shape: Callable[[int], tuple],
    step: Callable[[int, torch.Tensor | None], torch.Tensor],
    pp_rank: int,
    pp: int,
) -> None:
    """Forward and backward of every micro-batch under 1F1B; gradients accumulate in the stage's parameters.
    On the last stage `step` returns the micro-batch's (already globally normalised) scalar loss."""
    m = num_microbatches
    warmup = min(pp - pp_rank - 1, m)
    alive: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (input, output) of forwarded, not yet backwarded

    def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
        if x is not None:
            x.requires_grad_()
        y = step(i, x)
        alive.append((x, y))
        return y

    def backward(grad_y: torch.Tensor | None) -> torch.Tensor | None:
        x, y = alive.pop(0)
        if links.last:
            y.backward()
        else:
            y.backward(grad_y.to(y.dtype))
        return None if x is None else x.grad

    def recv_forward(i: int) -> torch.Tensor | None:
        return None if links.first else links.exchange([], [(act_shape(i), links.prev)])[0]

    for i in range(warmup):
        y = forward(i, recv_forward(i))
        if not links.last:
            links.exchange([(y, links.next)], [])

    fwd, bwd = warmup, 0  # next micro-batch to forward / to backward
    x = recv_forward(fwd) if fwd < m else None
    while fwd < m:
        y = forward(fwd, x)
        fwd += 1
        # send this output on, receive the gradient of the oldest alive micro-batch
        grad_y = None
        if not links.last:
            grad_y = links.exchange([(y, links.next)], [(act_shape(bwd), links.next)])[0]
        grad_x = backward(grad_y)
        bwd += 1
        if links.first:
            x = None
        elif fwd < m:  # send the input gradient back, receive the next input
            x = links.exchange([(grad_x, links.prev)], [(act_shape(fwd), links.prev)])[0]
        else:
            links.exchange([(grad_x, links.prev)], [])

    while bwd < m:  # cool-down: drain the warm-up micro-batches
        grad_y = None if links.last else links.exchange([], [(act_shape(bwd), links.next)])[0]
        grad_x = backward(grad_y)
        bwd += 1
        if not links.first:
            links.exchange([(grad_x, links.prev)], [])
