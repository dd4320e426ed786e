"""One pipeline stage of an HF causal LM for the trainer: HF's own modules, tensor-parallel by torch.

A `Stage` holds layers [start, end) of the HF model (the first stage also its embedding, the last its final norm
and LM head) under the HF parameter names ("model.layers.3.mlp.up_proj.weight"). With tp > 1 it is sharded by
`parallelize_module` over the TP mesh: the HF config's own `base_model_tp_plan` for the decoder layers (q/k/v and
gate/up column-parallel, o_proj and down_proj row-parallel: model_family.py's split), and ours for the ends, in
END_PLAN -- the embedding vocab-parallel, the LM head column-parallel with *local* logits [B, T, V/tp] for
`vocab_parallel_logprobs_and_entropy`. Parameters an HF plan marks "replicated_with_grad_allreduce" (Qwen3's
per-head q/k norms see only this rank's heads) keep a full copy whose gradient the trainer sums over TP.
Attention is parallel/packed_attention.py's per-sequence causal attention over packed rows.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from model_family import ModelFamilyError, check_tp_divides, model_family, shard_dim
from parallel.packed_attention import ATTENTION, PackedSeqs

# the ends of the model, which HF's base plans leave whole: vocabulary rows split, logits left local
END_PLAN = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
}
# the input of each attention and MLP block made one Replicate DTensor: the column-parallel projections reading it
# (q, k, v; gate, up) then sum their input gradients as one Partial, all-reduced once per block, as Megatron's f
INPUT_PLAN = {
    "model.layers.*.self_attn": PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Replicate()}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    ),
    "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
}
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}  # HF plan strings -> torch styles
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


class Stage(nn.Module):
    """Layers [start, end) of an HF causal LM, TP shard over `tp_mesh` (None: whole). First stage: ids -> hidden;
    middle: hidden -> hidden; last stage: hidden -> local logits [B, T, V/tp] (the whole model when first and
    last). The HF model is left as it was (the stage holds copies of its modules)."""

    def __init__(
        self, hf_model: nn.Module, layers: tuple[int, int], first: bool, last: bool, tp_mesh=None, device="cpu"
    ):
        super().__init__()
        cfg = hf_model.config
        model_family(getattr(cfg, "model_type", None))
        tp = 1 if tp_mesh is None else tp_mesh.size()
        check_tp_divides(cfg, tp)
        start, end = layers
        if not (0 <= start < end <= cfg.num_hidden_layers):
            raise ValueError(f"stage layers [{start},{end}) outside the model's {cfg.num_hidden_layers} layers")
        self.layer_range, self.first, self.last = (start, end), first, last
        # per-layer activation checkpointing (torch.utils.checkpoint): a layer keeps only its input and recomputes
        # the rest in backward -- its TP collectives too, in the same order on every TP rank, so they pair up
        self.activation_checkpointing = False
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        tp_rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()
        self.vocab_start = tp_rank * (cfg.vocab_size // tp)

        base = hf_model.model
        parts = nn.ModuleDict({"rotary_emb": base.rotary_emb})
        parts["layers"] = nn.ModuleDict({str(i): base.layers[i] for i in range(start, end)})
        if first:
            parts["embed_tokens"] = base.embed_tokens
        if last:
            parts["norm"] = base.norm
            if not self.tied or first:  # a tied head on the first stage is its embedding (deepcopy keeps the tie)
                parts["lm_head"] = hf_model.lm_head
        parts = copy.deepcopy(parts)  # one copy, so tied parameters stay one
        if any(p.dtype != torch.float32 for p in parts.parameters()):
            parts.float()  # fp32 master weights (the compute dtype is autocast's)
        parts.to(device)
        self.config = parts["layers"][str(start)].self_attn.config  # the copy's config: our attention, not HF's
        self.config._attn_implementation = ATTENTION
        self.rotary_emb = parts["rotary_emb"]  # knows the model's RoPE scaling variant
        self.model = nn.Module()  # mirrors HF's `model.` prefix so parameter names match the HF checkpoint
        if first:
            self.model.embed_tokens = parts["embed_tokens"]
        self.model.layers = parts["layers"]
        if last:
            self.model.norm = parts["norm"]
            if "lm_head" in parts:
                self.lm_head = parts["lm_head"]
            else:  # tied across stages: the last stage holds its own copy of the embedding, its gradient summed
                emb = base.embed_tokens.weight  # with stage 0's by the trainer so both copies take identical steps
                self.lm_head = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device=device)
                with torch.no_grad():
                    self.lm_head.weight.copy_(emb.float())

        self.tp_partial_grads: set[str] = set()  # replicated parameters whose gradient is summed over TP
        if tp_mesh is not None:
            self._parallelize(tp_mesh, cfg)
        self.shard_specs = {name: _tp_dim(p) for name, p in self.named_parameters(remove_duplicate=False)}
        for name, dim in self.shard_specs.items():  # the weight sync and the generator slice by model_family's rule
            if tp > 1 and dim != shard_dim(name):
                raise ModelFamilyError(f"{cfg.model_type}'s TP plan splits {name} along {dim}, not {shard_dim(name)}")

    def _parallelize(self, tp_mesh, cfg) -> None:
        plan = getattr(cfg, "base_model_tp_plan", None) or {}
        layer_plan = {}
        for pattern, style in plan.items():
            if style == GRAD_ALLREDUCE:
                suffix = pattern.split("*.", 1)[1]
                self.tp_partial_grads |= {n for n, _ in self.model.named_parameters() if f".{suffix}." in n}
            elif style in STYLES:
                layer_plan[f"model.{pattern}"] = STYLES[style]()
            else:
                raise ModelFamilyError(f"{cfg.model_type}'s TP plan uses style {style!r}, which hexrl does not run")
        self.tp_partial_grads = {f"model.{n}" for n in self.tp_partial_grads}
        ends = {k: v for k, v in END_PLAN.items() if _has(self, k)}
        parallelize_module(self, tp_mesh, {**INPUT_PLAN, **layer_plan, **ends})
        if self.tied and self.first and self.last:  # distributing each module gave each its own parameter: re-tie
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, packed: PackedSeqs | None) -> torch.Tensor:
        """x: token ids [B, T] on the first stage, hidden [B, T, H] elsewhere; packed: the sequences packed in
        the single row (B = 1), or None for plain causal attention over each row."""
        h = self.model.embed_tokens(x) if self.first else x
        rope = self.rotary_emb(h, position_ids)
        for layer in self.model.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(
                    layer, h, position_ids=position_ids, position_embeddings=rope, packed=packed, use_reentrant=False
                )
            else:
                h = layer(h, position_ids=position_ids, position_embeddings=rope, packed=packed)
        if not self.last:
            return h
        return self.lm_head(self.model.norm(h))

    def replicated_over_tp(self, name: str) -> bool:
        return self.shard_specs.get(name) is None


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _tp_dim(p: torch.Tensor) -> int | None:
    """The dimension a parameter is split along over TP (None: replicated)."""
    if isinstance(p, DTensor):
        for placement in p.placements:
            if isinstance(placement, Shard):
                return placement.dim
    return None
