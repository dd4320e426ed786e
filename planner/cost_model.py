"""The cost model: time, memory and money of one plan, as formulas over the specs (planner/specs.py).

Rollout replica throughput (HexGen-style roofline), memory feasibility, training step time (Metis-style pipeline
model), weight-sync time (of the runtime's own buckets, parallel/sync_layout.py) and the step. No torch: numbers in,
numbers out. Units: seconds, bytes, FLOPs, tokens. GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

from parallel.sync_layout import SYNC_CHECKSUM_BYTES, SyncBucket, assign_senders, hf_param_table
from planner.specs import DECODE_COMBINES, Efficiency, GPUType, ModelSpec, TypeEfficiency, Workload

LINK_LATENCY_S = 1e-5  # alpha of one collective or point-to-point message (HexGen uses 1e-6..1e-5)


# ----------------------------------------------------------------------------- rollout


def layer_counts(layers: int, parts: int) -> list[int]:
    base, extra = divmod(layers, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class ReplicaCost:
    batch: int  # concurrent sequences that fit (continuous batching)
    round_s: float  # one decode step of the whole batch
    tokens_per_s: float  # h_psi: generated tokens / s
    prefill_tflops: float  # achieved FLOP/s available for prefill (TFLOP/s)


def decode_round_s(
    model: ModelSpec,
    gpu: GPUType,
    eff: TypeEfficiency,
    tp: int,
    pp: int,
    batch: float,
    context: float,
    nbytes: int,
    pp_gbps: float,
    speed: float = 1.0,
) -> float:
    """Time for one decode step of `batch` sequences on a tp x pp replica (roofline per stage).

    Stage k holds l_k layers and serves the batch as pp micro-batches, so per step each of its GPUs reads
      its weights pp times (once per micro-batch): pp * W_k / tp bytes, plus the KV cache of all `batch`
      sequences for its layers: batch * context * kv_layer * l_k bytes          -> / (hbm_tbps * hbm_eff)
    and computes batch * l_k * layer_flops(context) / tp (+ the LM head on the last stage)
                                                                              -> / (tflops * mfu_infer)
    taking the max of the two (a roofline; HexGen adds them), or their sum where the type's `decode_combine` is
    "sum" (a CPU core, whose profile fits that better). TP adds 2 all-reduces of batch*H per layer
    over NVLink; PP adds batch*H bytes per stage boundary. The step time is the slowest stage, plus the type's
    fixed per-step overhead `decode_overhead_s` (0 unless a device profile sets it: `schedule.py profile` fits
    step = bytes / (hbm_tbps * hbm_eff) + decode_overhead_s to the runtime's decode steps), and for more than one
    row `decode_multirow_s` besides (a CPU core's GEMM path; 0 unless a profile fits it). The compute roof is
    at `mfu_decode` (mfu_infer unless a profile fits it from compute-bound decode steps). `speed` is the share of
    its device the replica gets (Cluster.speeds: < 1 only for CPU processes sharing cores): the rates and the
    per-step host work all stretch by 1 / speed.
    """
    hbm = gpu.hbm_tbps * 1e12 * eff.hbm_eff * speed
    flops = gpu.tflops * 1e12 * eff.decode_mfu * speed
    combine = DECODE_COMBINES[eff.decode_combine]
    kv_layer = model.kv_bytes_per_token_layer(nbytes, tp)
    stage_layers = layer_counts(model.layers, pp)
    tp_comm = 0.0
    if tp > 1:
        tp_comm = 2 * (LINK_LATENCY_S + 2 * (tp - 1) / tp * batch * model.hidden * nbytes / (gpu.intra_gbps * 1e9))
    pp_comm = LINK_LATENCY_S * pp + batch * model.hidden * nbytes / (pp_gbps * 1e9) if pp > 1 else 0.0
    worst = 0.0
    for k, lk in enumerate(stage_layers):
        head = model.head_params if k == pp - 1 else 0
        weight_bytes = (lk * model.layer_params + head) * nbytes / tp
        mem_bytes = pp * weight_bytes + batch * context * kv_layer * lk
        compute = batch * (lk * model.layer_flops_per_token(context) + 2 * head) / tp
        roof = combine(mem_bytes / hbm, compute / flops)
        worst = max(worst, roof + lk * tp_comm)
    fixed = eff.decode_overhead_s + (eff.decode_multirow_s if batch > 1 else 0.0)
    return worst + pp_comm + fixed / speed


def decode_bytes_per_step(model: ModelSpec, batch: float, context: float, nbytes: int, tp: int = 1) -> float:
    """Bytes one GPU of a TP-tp replica (pp 1) reads in one decode step, as decode_round_s counts them: its
    weights (every layer and the LM head; the embedding is a lookup) plus the KV cache the batch attends to."""
    weights = (model.layers * model.layer_params + model.head_params) * nbytes / tp
    return weights + batch * context * model.kv_bytes_per_token_layer(nbytes, tp) * model.layers


# Rollout memory: what a rollout rank allocates (generator.Generator; checked against exp/estimate_memory.py, which
# runs it on fake tensors). Per GPU of a TP-tp replica, in the rollout dtype (wl.bytes):
#   weights  the model's weights / tp (before slicing, a TP rank holds the whole model once: the larger counts)
#   kv       the KV pool: 2 * kv_heads / tp * head_dim * bytes per token and layer
#   then the larger of
#   decode   one Generator.step(): a prefill chunk of PREFILL_CHUNK_TOKENS rows (at most the pool's) through a layer,
#            about (DECODE_H_BYTES * hidden + DECODE_I_BYTES * intermediate / tp) bytes per row at 2-byte compute (fitted
#            to the runtime at 7B with tp 1 and 2), plus the fp32 logits of the batch (LOGIT_COPIES_DECODE of them)
#   sync     the weight-sync buckets a replica leader holds at once (SYNC_BUCKETS_ALIVE: the one arriving and the
#            one forwarded to its machine-mates; a TP leader also flattens one for its followers)
PREFILL_CHUNK_TOKENS = 16384  # generator.Generator's max_prefill_tokens
DECODE_H_BYTES, DECODE_I_BYTES = 15.3, 4.32
LOGIT_COPIES_DECODE = 3
SYNC_BUCKETS_ALIVE = 2


@functools.cache
def largest_param_numel(model: ModelSpec) -> int:
    """The largest tensor weight sync sends (cached: the search prices thousands of replicas of one model)."""
    return max(n for _, n in hf_param_table(model))


def sync_buffer_bytes(model: ModelSpec, tp: int, bucket_bytes: float, nbytes: int) -> float:
    """Weight-sync buffers alive on a rollout replica leader: SYNC_BUCKETS_ALIVE buckets (+1 under TP), each the
    bucket size or the largest tensor, which travels alone (sync_layout.sync_buckets)."""
    largest = largest_param_numel(model) * nbytes
    return (SYNC_BUCKETS_ALIVE + (1 if tp > 1 else 0)) * (max(bucket_bytes, largest) + SYNC_CHECKSUM_BYTES)


def replica_memory_parts(
    model: ModelSpec,
    tp: int,
    kv_tokens: float,
    slots: int,
    wl: Workload,
    bucket_bytes: float = 64 * 2**20,
    pp: int = 1,
    stage: int = 0,
) -> dict[str, float]:
    """Peak bytes per GPU of one rollout rank by kind (the estimator's keys) for a KV pool of `kv_tokens` tokens
    shared by `slots` sequences; `peak_bytes` is their total. `stage` of `pp` (a pipelined replica's stage holds its
    layers; the runtime builds pp 1 only)."""
    nbytes = wl.bytes
    lk = layer_counts(model.layers, pp)[stage]
    head = model.head_params if stage == pp - 1 else 0
    embed = model.vocab * model.hidden if stage == 0 and not (model.tied and stage == pp - 1) else 0
    weights = (lk * model.layer_params + head + embed) * nbytes / tp
    kv = kv_tokens * model.kv_bytes_per_token_layer(nbytes, tp) * lk
    rows = min(PREFILL_CHUNK_TOKENS, kv_tokens)  # a step prefills at most one chunk, at most what the pool holds
    decode = rows * (DECODE_H_BYTES * model.hidden + DECODE_I_BYTES * model.intermediate / tp)
    decode *= nbytes / 2
    logits = LOGIT_COPIES_DECODE * 4 * slots * model.vocab if stage == pp - 1 else 0.0
    sync = sync_buffer_bytes(model, tp, bucket_bytes, nbytes)
    step = max(decode + logits, sync)
    parts = {
        "weights": weights,
        "kv": kv,
        "activations": decode if step > sync else 0.0,
        "logits": logits if step > sync else 0.0,
        "sync_buffers": sync if step == sync else 0.0,
    }
    parts["peak_bytes"] = max(weights + kv + step, weights * tp if tp > 1 else 0.0)  # loading: the whole model
    return parts


def replica_memory_batch(
    model: ModelSpec, gpu: GPUType, tp: int, pp: int, wl: Workload, mem_frac: float, bucket_bytes: float = 64 * 2**20
) -> int:
    """Most concurrent sequences that fit on every GPU of the replica within mem_frac of its HBM, by
    replica_memory_parts with a paged pool holding each sequence's mean context (+10% for partly filled blocks)."""
    budget = gpu.hbm_gb * 1e9 * mem_frac
    per_seq = wl.decode_context * 1.1

    def fits(batch: int) -> bool:
        return all(
            replica_memory_parts(model, tp, batch * per_seq, batch, wl, bucket_bytes, pp, k)["peak_bytes"] <= budget
            for k in range(pp)
        )

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def replica_cost(
    model: ModelSpec,
    gpu: GPUType,
    tp: int,
    pp: int,
    wl: Workload,
    eff: Efficiency,
    pp_gbps: float,
    bucket_bytes: float = 64 * 2**20,
    speed: float = 1.0,
    prefill_speed: float | None = None,
) -> ReplicaCost | None:
    """h_psi of one replica (tokens/s at the memory-limited batch), or None if the weights don't fit. `speed`:
    the share of its devices' rates it gets in decode (Cluster.speeds of "bandwidth"), `prefill_speed` in prefill
    (of "compute"; default `speed`)."""
    batch = min(replica_memory_batch(model, gpu, tp, pp, wl, eff.mem_frac, bucket_bytes), wl.max_batch)
    if batch < 1:
        return None
    te = eff.of(gpu.name)
    round_s = decode_round_s(model, gpu, te, tp, pp, batch, wl.decode_context, wl.bytes, pp_gbps, speed)
    prefill_speed = speed if prefill_speed is None else prefill_speed
    return ReplicaCost(batch, round_s, batch / round_s, tp * pp * gpu.tflops * te.mfu_infer * prefill_speed)


def rollout_seconds(
    model: ModelSpec,
    wl: Workload,
    tokens_per_s: float,
    prefill_tflops: float,
    tail_tokens_per_s: float,
    running_seqs: float = 0.0,
    train_s: float = 0.0,
) -> float:
    """C_ROLLOUT per step: decode B*E[g] tokens at the aggregate rate Sigma y*h (Eq. 2 with continuous x_psi),
    plus prefill (2 * params FLOPs per prefilled token on the replicas' compute): each GRPO group's prompt once, and
    the K/V a weight update makes the running sequences recompute (recompute_tokens). With eta >= 1 admission keeps
    every replica full while long sequences finish, so the output-length tail is hidden (it shows up as staleness in
    the simulator); with eta = 0 (synchronous) the step waits for its longest sequence: max(g) decode rounds of the
    fastest replica.
    `running_seqs` (the replicas' batches summed) and `train_s` (the train step) say how much a weight update
    interrupts: a rollout side that finishes its batch, recompute included, before the trainer does sits idle at the
    staleness bound when the next version arrives (nothing to recompute); one still busy after the step -- the
    bottleneck -- holds all its running sequences; in between, the recompute grows with the overrun."""
    if tokens_per_s <= 0:
        return math.inf
    flop_s = prefill_tflops * 1e12 / (2 * model.params)  # prefilled tokens / s
    decode = wl.batch * wl.gen_mean / tokens_per_s
    tail = wl.gen_max / tail_tokens_per_s if wl.eta == 0 else 0.0
    base = max(decode, tail) + prompt_prefill_tokens(wl) / flop_s
    full = recompute_tokens(wl, running_seqs) / flop_s
    if full <= 0:
        return base
    return base + full * min(1.0, max(0.0, (base + full - train_s) / full))


def prompt_prefill_tokens(wl: Workload) -> float:
    """Prompt tokens a step's generators prefill, as generator.Generator does: each GRPO group's prompt once (its
    samples share the prompt's K/V blocks), but its last token, which rides in the first decode step."""
    return wl.prompts_per_step * max(wl.prompt_len - 1.0, 0.0)


def recompute_tokens(wl: Workload, running_seqs: float) -> float:
    """Tokens whose K/V a weight update has `running_seqs` running sequences recompute, as generator.Generator does in
    "recompute" interrupt mode: each the context it holds (the mean: Workload.decode_context) but its last token,
    once per step. None where no update interrupts decoding (eta = 0: the step waits for every sequence) or the
    run keeps the stale K/V."""
    if wl.eta < 1 or not wl.kv_recompute:
        return 0.0
    return running_seqs * max(wl.decode_context - 1.0, 0.0)


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class StageSpec:
    gpu_type: str
    layers: int
    machines: tuple[int, ...]  # machines its dp*tp GPUs live on
    tp_gbps: float  # slowest link inside a TP group
    dp_gbps: float  # slowest link inside a DP group
    next_gbps: float  # link to the next stage (0 for the last)
    speed: float = 1.0  # Cluster.speeds of its slowest machine (< 1 only for CPU processes sharing cores)


# Training memory: what a train rank allocates (parallel/trainer.py under FSDP2, activation checkpointing, chunked
# log-probs and 1F1B; checked against exp/estimate_memory.py, which runs it on fake tensors). Per GPU of stage k
# (l_k layers) with T = microbatch_tokens tokens per micro-batch, in elements of this rank's TP shard of the stage:
#   shard      stage params / tp / dp (fully_shard over DP when dp > 1, else the whole TP shard)
#   weights    4 B * shard (fp32 master) + 2 B * the stage's embedding / LM head (FSDP keeps their bf16 copies for
#              the step) + 2 B * the decoder layer running (FSDP's unsharded copy, or autocast's)
#   grads      4 B * shard;  optimizer  8 B * shard (AdamW's two fp32 moments)
#   inputs     per micro-batch in flight under 1F1B (pp - k of them, as soon as a minibatch has that many): the
#              checkpointed layer inputs, l_k * T * H * r B (r the residual stream's bytes: 2 under FSDP, whose bf16
#              parameters and input casts make it bf16, 4 with fp32 parameters), the fp32 activation received from
#              the previous stage (under FSDP the first layer keeps a bf16 copy of it besides) and the fp32 output
#              sent to the next one (T * H * 4 B each)
#   and the largest of three moments:
#   a layer's backward  its recomputed forward and its gradients, T * (LAYER_H_BYTES * H + LAYER_I_BYTES * I / tp),
#              FSDP's flat all-gather (bf16) and reduce-scatter (fp32) buffers of the layer (6 B per element), and
#              off the first stage the fp32 gradient of the received activation
#   the LM head's backward (last stage)  LOGIT_BYTES * T * V / tp (bf16 logits, the gradient slices of the chunked
#              log-probs and their sum) and T * H * (HEAD_H_BYTES, +4 off the first stage); without FSDP, autocast's
#              bf16 copy of the head's weight (saved for backward)
#   the global grad norm  GRAD_NORM_BYTES per element of the largest gradient (its fp64 copy and square), after the
#              backward: the activations are gone by then
# The per-token constants are fitted to the runtime's first stages at 1.5B (tp 1), 7B and 14B (tp 2, FSDP); every
# rank of the 15 plans in docs/planner.md agrees with exp/estimate_memory.py within a few % (a test checks one small case).
LAYER_H_BYTES, LAYER_I_BYTES = 25.5, 12.3
LOGIT_BYTES = 8.0
HEAD_H_BYTES = 8.5
GRAD_NORM_BYTES = 16.0


def train_memory_parts(
    model: ModelSpec,
    stage_layers: int,
    last: bool,
    first: bool,
    dp: int,
    tp: int,
    pp_rank: int,
    pp: int,
    wl: Workload,
    shard_state: bool = True,
) -> dict[str, float]:
    """Peak bytes per GPU of one train rank by kind (the estimator's keys); `peak_bytes` is their total."""
    T, H = wl.microbatch_tokens, model.hidden
    layer = model.layer_params / tp
    embed = model.vocab * H if first else 0
    head = model.head_params + H if last and not (first and model.tied) else (H if last else 0)
    root = (embed + head) / tp
    fsdp = shard_state and dp > 1
    shard = (stage_layers * layer + root) / (dp if fsdp else 1)
    residual = wl.bytes if fsdp else 4
    in_flight = pp - pp_rank  # 1F1B's most; a step whose minibatches hold fewer micro-batches per DP rank has fewer
    # per micro-batch in flight: the checkpointed layer inputs, the fp32 activation received from the previous stage
    # (FSDP casts it to bf16 for the first layer, which keeps the copy; without FSDP it is the first layer's input)
    # and the fp32 output sent to the next one
    kept = stage_layers * residual + (4 if not first and fsdp else 0) + (0 if last else 4)
    inputs = in_flight * T * H * kept
    exchanged = 0 if first else T * H * 4  # the gradient of the received activation
    layer_moment = (
        inputs
        + exchanged
        + T * (LAYER_H_BYTES * H + LAYER_I_BYTES * model.intermediate / tp)
        + (6 * layer if fsdp else 0)
    )
    logits = LOGIT_BYTES * T * model.vocab / tp
    head_moment = 0.0
    if last:  # without FSDP's bf16 parameters, autocast's bf16 copy of the LM head weight is saved for backward
        head_moment = inputs + T * H * (HEAD_H_BYTES + (0 if first else 4)) + logits
        head_moment += 0 if fsdp else 2 * model.head_params / tp
    # the global grad norm squares each gradient in fp64 (a copy and its square): 16 B per element of the largest
    largest = max(model.vocab * H if first or last else 0, H * model.intermediate) / tp / (dp if fsdp else 1)
    norm_moment = GRAD_NORM_BYTES * largest
    moment = max(("layer", layer_moment + 2 * layer), ("head", head_moment), ("norm", norm_moment), key=lambda x: x[1])
    parts = {
        "weights": 4 * shard + (2 * root if fsdp else 0) + (2 * layer if moment[0] == "layer" else 0),
        "grads": 4 * shard,
        "optimizer": 8 * shard,
        "activations": {"layer": layer_moment, "head": head_moment - logits, "norm": norm_moment}[moment[0]],
        "logits": logits if moment[0] == "head" else 0.0,
    }
    parts["peak_bytes"] = sum(parts.values())
    return parts


def train_step_seconds(
    model: ModelSpec,
    stages: list[StageSpec],
    dp: int,
    tp: int,
    gpu_types: dict[str, GPUType],
    wl: Workload,
    eff: Efficiency,
) -> float:
    """C_TRAIN per RL step (train_step_times' first)."""
    return train_step_times(model, stages, dp, tp, gpu_types, wl, eff)[0]


def train_step_times(
    model: ModelSpec,
    stages: list[StageSpec],
    dp: int,
    tp: int,
    gpu_types: dict[str, GPUType],
    wl: Workload,
    eff: Efficiency,
) -> tuple[float, list[float]]:
    """(seconds, busy_s): C_TRAIN per RL step, and per stage the seconds its devices work in it -- its m
    micro-batches, gradient all-reduce, optimizer and fixed work; the rest of the step is its share of the 1F1B
    bubble, where it idles (what a CPU's shared cores see: cpu_bench/host.busy_devices).
    The step (Metis-style), for ppo_minibatches optimizer steps over tokens_per_step tokens:
    per micro-batch stage time t_k = train_passes * mb * FLOPs/token of its layers / (tp * tflops * mfu_train)
                                     + TP all-reduces (2 per layer per pass, ring 2(tp-1)/tp * mb*H bytes)
                                     + (1 - 1/tp) * the work TP leaves whole (tp_unsplit hidden-sized tensors per
                                       token, layer and pass at the decode bandwidth)
                                     + PP send of mb*H bytes per pass to the next stage
    pipeline per minibatch = sum_k t_k + (m - 1) * max_k t_k      (1F1B bubble, m micro-batches per replica)
    where a DP rank's share of a minibatch, S = tokens_per_step / (ppo_minibatches * dp), packs into
    m = max(stages, ceil(S / microbatch_tokens)) micro-batches of mb = S / m tokens (the runtime's packing)
    + DP gradient all-reduce 2(dp-1)/dp * fp32 stage grads / tp over the DP link, + optimizer (HBM-bound)
    + the type's fixed seconds per optimizer step `train_overhead_s` (0 unless a device profile sets it: the
    intercept of its Trainer steps, less this optimizer term), at tp > 1 its `tp_overhead_s` and at dp > 1 its
    `dp_overhead_s`.
    A stage's `speed` (Cluster.speeds: < 1 only for CPU processes sharing cores) scales its compute, its optimizer
    and its fixed per-step work; the links are not scaled."""
    nbytes = wl.bytes
    context = wl.decode_context  # mean attention span of a token in a packed sequence
    # the runtime packs a DP rank's share of a minibatch into m micro-batches of at most microbatch_tokens, and into
    # at least as many as there are stages (parallel/trainer.py): m of share / m tokens each, not m full ones
    tokens_per_rank = wl.tokens_per_step / wl.ppo_minibatches / dp
    m = max(len(stages), math.ceil(tokens_per_rank / wl.microbatch_tokens))
    mb = tokens_per_rank / m
    passes = wl.train_passes
    times, own = [], []  # per stage: one micro-batch's time, and its optimizer step's own work besides
    dp_sync = opt = fixed = 0.0
    for k, st in enumerate(stages):
        gpu, te = gpu_types[st.gpu_type], eff.of(st.gpu_type)
        last = k == len(stages) - 1
        flops = (
            passes * mb * (st.layers * model.layer_flops_per_token(context) + (2 * model.head_params if last else 0))
        )
        t = flops / (tp * gpu.tflops * 1e12 * te.mfu_train * st.speed) + te.microbatch_overhead_s / st.speed
        if tp > 1:
            ar_bytes = 2 * (tp - 1) / tp * mb * model.hidden * nbytes
            t += 2 * passes * st.layers * (LINK_LATENCY_S + ar_bytes / (st.tp_gbps * 1e9))
            unsplit = passes * mb * st.layers * te.tp_unsplit * model.hidden * nbytes
            t += (1 - 1 / tp) * unsplit / (gpu.hbm_tbps * 1e12 * te.hbm_eff * st.speed)
        if not last:
            t += passes * (LINK_LATENCY_S + mb * model.hidden * nbytes / (st.next_gbps * 1e9))
        times.append(t)
        params = (st.layers * model.layer_params + (model.head_params if last else 0)) / tp
        stage_sync = LINK_LATENCY_S + 2 * (dp - 1) / dp * params * 4 / (st.dp_gbps * 1e9) if dp > 1 else 0.0
        stage_opt = params * (18 + 12 / dp) / (gpu.hbm_tbps * 1e12 * te.hbm_eff * st.speed)
        extra = (te.tp_overhead_s if tp > 1 else 0.0) + (te.dp_overhead_s if dp > 1 else 0.0)
        stage_fixed = (te.train_overhead_s + extra) / st.speed
        dp_sync, opt, fixed = max(dp_sync, stage_sync), max(opt, stage_opt), max(fixed, stage_fixed)
        own.append(stage_sync + stage_opt + stage_fixed)
    pipeline = sum(times) + (m - 1) * max(times)
    busy = [wl.ppo_minibatches * (m * t + o) for t, o in zip(times, own)]
    return wl.ppo_minibatches * (pipeline + dp_sync + opt + fixed), busy


def train_tokens_per_s(wl: Workload, train_s: float) -> float:
    return wl.tokens_per_step / train_s if train_s > 0 else 0.0


# ----------------------------------------------------------------------------- weight sync, step


def sync_times(
    buckets: list[SyncBucket],
    replicas_per_machine: dict[int, int],
    owner_machines: list[list[int]],
    gbps,
    eff: Efficiency,
    speed: float = 1.0,
) -> tuple[float, float]:
    """(send_s, ready_s) of one version as the runtime runs it (parallel/weight_sync.py): each rollout machine's relay
    takes the buckets in order, every stage from the owner assign_senders picks, and forwards each bucket to the
    machine's k - 1 other replicas once it has it, while the next one arrives; it holds at most SYNC_BUCKETS_ALIVE
    (the next receive waits for the forward two buckets back). `gbps(a, b)`: machine-to-machine bandwidth (a == b:
    inside a machine).
      send_s   until every relay has received the last bucket (and every owner sent its stage to each machine it
               serves): what the train ranks pause for
      ready_s  until every replica holds the version: the relay's last forward ends one bucket-forward after its last
               receive at the earliest, so a version of one bucket takes two hops to a machine-mate. The rollout side
               pauses for it, and an eta = 0 step waits for it
    Both add a fixed latency. `speed` (Cluster.speeds of the machines involved, < 1 only for CPU processes sharing
    cores) stretches both: on a CPU a bucket's hop is host work (filling, checksumming, socket copies), and a device
    profile measures it on unshared cores."""
    senders = assign_senders(owner_machines, list(replicas_per_machine), gbps)
    send = ready = 0.0
    sending: dict[tuple[int, int], float] = {}
    for m, k in replicas_per_machine.items():
        received = forwarded = 0.0  # when the relay has received / finished forwarding the bucket so far
        alive: deque[float] = deque()  # the end times of the forwards still holding a bucket
        for b in buckets:
            sender = (b.stage, senders[(b.stage, m)])
            seconds = b.wire_bytes / (gbps(owner_machines[b.stage][sender[1]], m) * 1e9)
            sending[sender] = sending.get(sender, 0.0) + seconds
            start = received
            if len(alive) >= SYNC_BUCKETS_ALIVE:
                start = max(start, alive.popleft())
            received = start + seconds
            if k > 1:
                forwarded = max(forwarded, received) + (k - 1) * b.wire_bytes / (gbps(m, m) * 1e9)
                alive.append(forwarded)
        send, ready = max(send, received), max(ready, forwarded, received)
    owners = max(sending.values(), default=0.0)
    fixed, rate = eff.sync_latency_s / speed, eff.link_eff * speed
    return fixed + max(send, owners) / rate, fixed + max(ready, owners) / rate


def sync_seconds(
    buckets: list[SyncBucket],
    replicas_per_machine: dict[int, int],
    owner_machines: list[list[int]],
    gbps,
    eff: Efficiency,
    speed: float = 1.0,
) -> float:
    """C_UPDATE of one version: until every replica holds it (sync_times' ready_s)."""
    return sync_times(buckets, replicas_per_machine, owner_machines, gbps, eff, speed)[1]


def step_seconds(
    rollout_s: float, train_s: float, sync_s: float, wl: Workload, sync_send_s: float | None = None
) -> float:
    """Paper §4.4: step = weight sync + max(rollout + reward, train); eta = 0 runs them back to back. The two sides
    pause for different parts of the sync (sync_times): the rollout side until its replicas hold the version (sync_s),
    the train side until its sends are done (sync_send_s, default sync_s); an eta = 0 step waits for the replicas."""
    if wl.eta == 0:
        return sync_s + rollout_s + wl.reward_s + train_s
    send = sync_s if sync_send_s is None else sync_send_s
    return max(sync_s + rollout_s + wl.reward_s, send + train_s)
