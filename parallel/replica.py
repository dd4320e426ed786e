"""The lockstep of a TP rollout replica: what its leader hands its followers each turn of the rollout loop.

A TP-k replica is k ranks of one machine running one sharded Generator. Only the leader (its lowest rank) speaks
the control channel with the train head. Every turn of the rollout loop it shares what it is about to act on --
the head's messages, and the tensors of a new weight version, which only it receives from the head -- over the
replica's own process group; every rank then makes the same Generator calls in the same order, so their
collectives (all-reduce after attention and after the MLP, all-gather of the logits) pair up, and their sampled
tokens are the same (counter-based seeds over identical logits). Followers score nothing and send nothing.

Messages and weight metadata travel as pickled objects over the group's CPU (gloo) side; weight tensors as one flat
tensor per dtype on the generator's device (NCCL on GPU). A dead peer makes the collective fail on the others;
a stuck one makes the leader fall silent, and the head drops it -- with it the whole replica, whose work only
the leader holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.weight_sync import DTYPES


class ReplicaLink:
    def __init__(self, group, ranks: list[int], device: torch.device):
        self.group, self.ranks, self.device = group, list(ranks), device
        self.leader = self.ranks[0]
        self.is_leader = dist.get_rank() == self.leader

    def share(self, obj):
        """The leader's `obj` on every rank of the replica (followers pass None)."""
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group, device=torch.device("cpu"))
        return box[0]

    def share_weights(self, state_dict: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The leader's full state dict on every rank: names, shapes and dtypes as one object, the values as one
        flat tensor per dtype."""
        meta = self.share(
            [(n, tuple(t.shape), str(t.dtype)) for n, t in state_dict.items()] if self.is_leader else None
        )
        out: dict[str, torch.Tensor] = {}
        for dtype_name in sorted({d for _, _, d in meta}):
            names = [(n, shape) for n, shape, d in meta if d == dtype_name]
            if self.is_leader:
                flat = torch.cat([state_dict[n].reshape(-1).to(self.device) for n, _ in names])
            else:
                count = sum(torch.Size(shape).numel() for _, shape in names)
                flat = torch.empty(count, dtype=DTYPES[dtype_name], device=self.device)
            dist.broadcast(flat, src=self.leader, group=self.group)
            offset = 0
            for n, shape in names:
                size = torch.Size(shape).numel()
                out[n] = flat[offset : offset + size].view(shape)
                offset += size
        return out
