"""The rollout rank: its loop (top of the story, `RolloutWorker`), our KV-cached generator and its sampler.

The rank generates GRPO groups for the train head and applies new weights between decode steps.
Messages from the head (parallel/channel.py), handled between decode steps:
  grant    {groups: [[group_id, prompt_id], ...]}  -> G requests each, per-request seeds
  weights  {version, buckets}                      -> receive, verify, gen.update_weights (interruptible:
                                                      sequences in flight continue under the new version)
  eval     {version, prompt_ids}                   -> greedy accuracy on held-out prompts, answered at once
  fetch    {group_id}                              -> the head posted its receive for a `result`: wait for that
                                                      send, answer `delivered` (parallel/trajectories.py)
  stop     {}                                      -> answer `bye` and return
  abort    {reason}                                -> the run is over (the head has printed why): raise Aborted
To the head: `ready` once (model loaded, generator built, reward worker started: dist.rollout_timeout_s counts
only from here, so a slow start is not mistaken for a stuck rank), `result` (one finished group, with this
rank's counters), `eval_result`, and `alive` (counters) whenever nothing else was sent for a while, so the head
can tell a slow rank from a stuck one.

Scoring overlaps decoding: a finished request goes to GroupScorer (a RewardPool: plain-number answers scored at
once, the rest by a math-verify worker process) and the loop decodes on; scores are collected without blocking
between decode steps, and a group's `result` goes out once its G samples are scored. At most
rollout.max_pending_scores requests wait for a score; past that the loop waits for scores before it decodes on.
New weights and evals do not wait for pending scores (a score does not depend on the policy); a stop waits for
them, so every group decoded before it is sent before `bye`; an abort drops them (the run is over).

The generator: KV-cached, continuously batched, over HF Llama / Qwen2 / Qwen3 / Mistral weights.
Rollout is HBM-bandwidth bound, so we own the three things that decide its speed and exactness:
the KV cache (preallocated, one row per slot), the attention + decode loop, and the sampler.
Everything else is the HF model's own modules and weights (embed_tokens, each layer's norms,
q/k/v/o projections and MLP, the final norm, lm_head and the rotary embedding), so a trainer that
updates `model.state_dict()` names updates us, and nothing depends on HF's cache API. The HF pieces we
run our way (RoPE with a signed sin, RMSNorm with HF's bits in fewer ops, sliding windows read the way HF
reads them, fused projections whose storage layout is chosen per shape on CPU) are each exact against the
HF module they replace (tests/test_generator.py).

Story of a request:
  add_request -> waiting queue -> admitted into the lowest free slot -> "prefill" writes the K/V of
  all its tokens but the last into the slot's cache rows -> each step() feeds the last token of every
  running slot through ONE batched decode forward, samples the next token -> a finished request frees
  its slot at once and a waiting one takes it on the next step (continuous batching).
  Invariant of a running slot: the cache holds K/V for tokens[:-1]; tokens[-1] is the next input.

Weight updates (`update_weights`) happen between step() calls. interrupt_mode="recompute" (default,
as AReaL) re-prefills every in-flight sequence (prompt + tokens so far) under the new weights, so
every later token is exactly the new policy's. interrupt_mode="keep" reuses the stale cache: no
recompute cost, but later tokens attend to K/V computed by the old weights, so their log-probs are
not exactly the new policy's (the trainer's recomputed/proximal log-probs must absorb the gap).
Each generated token carries the policy version that sampled it.

Tensor parallelism (`tp_group` of k ranks): decode reads every weight and the whole KV cache each step, so k
devices that each hold 1/k of them decode a model (or a batch) one device cannot hold, and each step reads 1/k as
much per device. Sharding follows the trainer's rules (parallel/tensor_parallel.py), so the full HF tensors the
weight sync sends are sliced the same way: q/k/v and gate/up by rows (whole heads, contiguous: a rank's query
heads use exactly its own KV heads, the n_kv_heads/k its cache holds), o_proj and down_proj by columns, embedding
and LM head by vocabulary rows. A layer costs two all-reduces (o_proj's and down_proj's outputs, before the
residual add; their biases added once, after), the embedding one and the LM head one all-gather into the full
fp32 logits. Collectives give every rank the same result, so ranks given the same calls stay in lockstep and
sample the same tokens with no further communication. k must divide the head, KV-head, MLP and vocabulary sizes
(KV heads are never replicated), and the decode step is not compiled under TP (its collectives would sit in it).

The sampler: one token per row from fp32 logits, reproducible per request. Log-prob convention (the
trainer uses the same): logprob = log_softmax(logits / temperature) over the full vocabulary in fp32,
i.e. after temperature and BEFORE top-k/top-p truncation; for greedy (temperature 0) it is
log_softmax(logits), i.e. temperature 1. Seeds: sampling noise is counter based, u = hash(seed, index of
the token in the completion), and a token is drawn by inverting the CDF of the (truncated) distribution
at u, so a request with a given seed samples the same tokens whichever requests share its batch and
whichever slot it lands in. `generate(prompts, params)` with one SamplingParams gives request i the seed
`params.seed + i`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from buffer import Trajectory
from emulation import Throttle
from parallel.channel import Aborted, Channel, PeerTimeout
from parallel.replica import ReplicaLink
from parallel.tensor_parallel import check_tp_divides, shard_dim, slice_shard
from parallel.trajectories import TrajectorySender
from parallel.weight_sync import receive_version
from reward_math import DEFAULT_LIMITS, RewardPool, ScoreDetails, ScoreLimits

ROPE_TABLE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")  # x * rsqrt(mean x^2 + eps) * w

# ----------------------------------------------------------------------------- the rollout rank's loop


def request_seed(base: int, group_id: int, sample_idx: int) -> int:
    """Depends only on (seed, group, sample): the same tokens whatever rank or slot serves the request."""
    return (base * 1_000_003 + group_id * 4099 + sample_idx) % (2**62)


class GroupScorer:
    """Finished requests -> scored GRPO groups, scoring in a RewardPool while the caller decodes on.

    submit() returns at once unless max_pending requests already wait for a score; then it waits for scores
    (calling on_wait every wait_s, e.g. a heartbeat). collect() never blocks (unless asked to wait) and returns
    the groups whose samples are all scored, as (group_id, trajectories in sample order). Rewards are exactly
    score()'s: the same extraction, fast path and cache, math-verify bounded by limits.timeout_s in a killed-and-
    replaced worker process, a timeout scored wrong. `blocked_s` is the time the caller spent inside submit,
    collect and drain (the inline fast path and waits for scores), i.e. scoring's cost on the decode loop;
    the workers' own time overlaps decoding and is pool.reward_s."""

    def __init__(
        self,
        samples_per_prompt: int,
        reward_correct: float,
        reward_wrong: float,
        max_pending: int,
        limits: ScoreLimits = DEFAULT_LIMITS,
        on_wait: Callable[[], None] = lambda: None,
        wait_s: float = 0.1,
    ):
        if max_pending < 1:
            raise ValueError(f"rollout.max_pending_scores must be >= 1, got {max_pending}")
        self.G, self.reward_correct, self.reward_wrong = samples_per_prompt, reward_correct, reward_wrong
        self.max_pending, self.on_wait, self.wait_s = max_pending, on_wait, wait_s
        self.pool = RewardPool(num_workers=1, limits=limits)  # one math-verify process per rank, started now
        self.groups: dict[int, dict] = {}  # group_id -> {prompt_id, trajs: {sample: Trajectory}}
        self.unscored: dict[Hashable, object] = {}  # pool key -> the finished request awaiting its score
        self.eval_scores: dict[int, ScoreDetails] = {}
        self.complete: list[tuple[int, list[Trajectory]]] = []
        self.blocked_s = 0.0

    @property
    def pending(self) -> int:
        """Requests submitted whose score has not been collected yet."""
        return len(self.unscored)

    def open(self, group_id: int, prompt_id: int) -> None:
        self.groups[group_id] = {"prompt_id": prompt_id, "trajs": {}}

    def submit(self, out, response: str, gold: str) -> None:
        """Score a finished request (request_id = (group_id, sample_idx)); response is its decoded text."""
        t0 = time.perf_counter()
        self._make_room()
        key = ("train", *out.request_id)
        self.pool.submit(key, response, gold)  # bad input raises here, before anything is recorded
        self.unscored[key] = out
        self.blocked_s += time.perf_counter() - t0

    def collect(self, wait_s: float = 0.0) -> list[tuple[int, list[Trajectory]]]:
        """Groups completed since the last call; with wait_s > 0, waits up to that long for a score first."""
        t0 = time.perf_counter()
        self._take(self.pool.poll(wait_s=wait_s))
        self.blocked_s += time.perf_counter() - t0
        done, self.complete = self.complete, []
        return done

    def drain(self) -> list[tuple[int, list[Trajectory]]]:
        """Wait for every submitted score; the groups they complete."""
        done = self.collect()
        while self.pending:
            self.on_wait()
            done += self.collect(wait_s=self.wait_s)
        return done

    def score_all(self, pairs: list[tuple[str, str]]) -> list[ScoreDetails]:
        """Score (response, gold) pairs now, through the same workers (eval); not counted in blocked_s."""
        for j, (response, gold) in enumerate(pairs):
            self._make_room()
            self.pool.submit(("eval", j), response, gold)
            self.unscored[("eval", j)] = None
        while len(self.eval_scores) < len(pairs):
            self._take(self.pool.poll(wait_s=self.wait_s))
            self.on_wait()
        scores, self.eval_scores = [self.eval_scores[j] for j in range(len(pairs))], {}
        return scores

    def _make_room(self) -> None:
        while self.pending >= self.max_pending:  # bounded: wait for scores rather than queue without limit
            self._take(self.pool.poll(wait_s=self.wait_s))
            self.on_wait()

    def _take(self, results) -> None:
        for key, details, _ in results:
            out = self.unscored.pop(key)
            if key[0] == "eval":
                self.eval_scores[key[1]] = details
                continue
            group_id, sample_idx = key[1], key[2]
            group = self.groups[group_id]
            correct = details.reward > 0
            group["trajs"][sample_idx] = Trajectory(
                prompt_id=group["prompt_id"],
                sample_idx=sample_idx,
                prompt_ids=list(out.prompt_ids),
                response_ids=list(out.token_ids),
                behav_logprobs=list(out.logprobs),
                versions=list(out.versions),
                reward=self.reward_correct if correct else self.reward_wrong,
                finish_reason=out.finish_reason,
                group_id=group_id,
                correct=correct,
            )
            if len(group["trajs"]) == self.G:
                del self.groups[group_id]
                self.complete.append((group_id, [group["trajs"][s] for s in range(self.G)]))

    def close(self) -> None:
        self.pool.close()


class RolloutWorker:
    """One rank of a rollout replica. A TP replica's leader runs this loop as a TP-1 rank does (it alone talks to
    the head and scores); its followers run the same loop on what the leader shares each turn (parallel/replica.py)
    and make the same generator calls, so the sharded generator's collectives pair up."""

    def __init__(
        self,
        cfg,
        model,
        tokenizer,
        train_rows: list[dict],
        test_rows: list[dict],
        head: int,
        device: torch.device,
        replica: ReplicaLink | None = None,
        weight_links: dict | None = None,
        throttle: Throttle | None = None,
    ):
        """`weight_links`: this leader's weight-sync process groups (ParallelGroups.weight_links); `throttle`: an
        emulated device type's (emulation.py; None runs at this machine's speed)."""
        self.cfg, self.model, self.tok, self.head, self.device = cfg, model, tokenizer, head, device
        self.replica = replica
        self.weight_links = weight_links or {}
        self.throttle = throttle or Throttle()
        self.weights_incomplete = False  # a version stopped half-way: generate nothing until a whole one arrives
        self.deferred_evals: list[dict] = []
        self.is_leader = replica is None or replica.is_leader
        r = cfg.rollout
        # math-verify's imports (in the scorer's worker process) overlap the generator's set-up
        self.scorer = (
            GroupScorer(
                r.samples_per_prompt, r.reward_correct, r.reward_wrong, r.max_pending_scores, on_wait=self.heartbeat
            )
            if self.is_leader
            else None
        )
        self.rows = {"train": {r["prompt_id"]: r for r in train_rows}, "test": {r["prompt_id"]: r for r in test_rows}}
        self.encoded: dict[tuple[str, int], list[int]] = {}
        tp = 1 if replica is None else len(replica.ranks)
        self.gpu_options = gpu_options(device, cfg.rollout.compile_decode, cfg.rollout.flash_attn, tp=tp)
        if replica is not None:
            self.gpu_options["tp_group"] = replica.group
        self.gen = Generator(
            model,
            max_batch_size=cfg.rollout.max_batch_size,
            max_seq_len=cfg.rollout.max_seq_len,
            interrupt_mode=cfg.rollout.interrupt_mode,
            **self.gpu_options,
        )
        self.eval_gen: Generator | None = None
        self.channel = Channel([head]) if self.is_leader else None
        self.outbox = TrajectorySender(head, cfg.dist.timeout_s)  # sent groups, kept until the head fetches them
        self.t_start = time.monotonic()
        self.idle_s = 0.0
        self.generated_tokens = 0
        self.heartbeat_s = min(5.0, cfg.dist.rollout_timeout_s / 4)
        self.last_sent = time.monotonic()

    def send(self, kind: str, **payload) -> None:
        if self.is_leader:  # followers speak to no one
            self.channel.send(self.head, kind, **payload)
            self.last_sent = time.monotonic()

    def heartbeat(self) -> None:
        if self.is_leader and time.monotonic() - self.last_sent > self.heartbeat_s:
            self.send("alive", counters=self.counters())

    def prompt_ids(self, split: str, prompt_id: int) -> list[int]:
        key = (split, prompt_id)
        if key not in self.encoded:
            ids = self.tok(self.rows[split][prompt_id]["prompt"])["input_ids"]
            limit = self.cfg.rollout.max_seq_len - self.cfg.rollout.max_new_tokens
            if len(ids) > limit:
                raise ValueError(
                    f"prompt {prompt_id} ({split}) has {len(ids)} tokens; rollout.max_seq_len - "
                    f"max_new_tokens allows {limit}"
                )
            self.encoded[key] = ids
        return self.encoded[key]

    def sampling(self, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=[self.tok.eos_token_id],
            seed=seed,
        )

    # -- messages ----------------------------------------------------------------------------------
    def on_grant(self, msg: dict) -> None:
        G = self.cfg.rollout.samples_per_prompt
        for group_id, prompt_id in msg["groups"]:
            if self.scorer is not None:
                self.scorer.open(group_id, prompt_id)
            prompt = self.prompt_ids("train", prompt_id)
            for s in range(G):
                self.gen.add_request(
                    (group_id, s), prompt, self.sampling(request_seed(self.cfg.train.seed, group_id, s))
                )

    def on_weights(self, msg: dict) -> None:
        """Bucket by bucket (parallel/weight_sync.py): each is received (and forwarded, by a machine's relay),
        handed to the TP followers, applied and dropped before the next, so a rank holds at most two buckets of the
        new version, never a second model. The version switches with the last bucket; no decode step runs in
        between. A version whose source fails half-way leaves this replica generating nothing (a partly applied
        version is no version) until the head sends a whole one."""
        version, n = msg["version"], len(msg["buckets"])
        if n == 0:  # a skipped update: the same weights under a new version number
            if not self.weights_incomplete:
                self.gen.update_weights({}, version)
            self.send("weights_ok", version=version, failed={})
            return

        def apply(bucket: dict, last: bool) -> None:
            if self.replica is not None:  # only the leader receives; its followers get each bucket from it
                bucket = self.replica.share_weights(bucket)
            self.gen.update_weights(bucket, version, last=last)

        if not self.is_leader:
            for i in range(n):
                bucket = self.replica.share_weights(None)
                if not bucket:  # the leader's source failed: this version is off
                    self.weights_incomplete = True
                    return
                self.gen.update_weights(bucket, version, last=i == n - 1)
            self.weights_incomplete = False
            self.run_deferred_evals()
            return
        try:
            failed = receive_version(msg, self.weight_links, self.device, apply, self.cfg.dist.rollout_timeout_s / 2)
        except PeerTimeout as e:
            self.weights_incomplete = True
            if self.replica is not None:
                self.replica.share_weights({})
            self.send("weights_failed", version=version, reason=str(e))
            return
        self.weights_incomplete = False
        self.send("weights_ok", version=version, failed={str(k): v for k, v in failed.items()})
        self.run_deferred_evals()

    def run_deferred_evals(self) -> None:
        evals, self.deferred_evals = self.deferred_evals, []
        for msg in evals:
            self.on_eval(msg)

    @torch.no_grad()
    def on_eval(self, msg: dict) -> None:
        if self.weights_incomplete:  # evaluated once the version has arrived whole (the head re-sends it)
            self.deferred_evals.append(msg)
            return
        if self.eval_gen is None:  # a second cache over the same (shared) weights
            self.eval_gen = Generator(
                self.model,
                max_batch_size=self.cfg.rollout.max_batch_size,
                max_seq_len=self.cfg.rollout.max_seq_len,
                **self.gpu_options,
            )
        self.eval_gen.version = self.gen.version
        ids = msg["prompt_ids"]
        greedy = SamplingParams(
            temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens, stop_token_ids=[self.tok.eos_token_id]
        )
        # streamed rather than generate(): a long eval share must not look like a stuck rank
        for j, i in enumerate(ids):
            self.eval_gen.add_request(j, self.prompt_ids("test", i), greedy)
        done = {}
        while self.eval_gen.num_unfinished():
            done.update((o.request_id, o) for o in self.step(self.eval_gen))
            if self.scorer is not None:
                self.send_results(self.scorer.collect())  # training groups still score meanwhile
            self.heartbeat()
        if self.scorer is None:  # a follower: the leader scores and answers
            return
        outs = [done[j] for j in range(len(ids))]
        scores = self.scorer.score_all(
            [
                (self.tok.decode(o.token_ids, skip_special_tokens=True), self.rows["test"][i]["answer"])
                for i, o in zip(ids, outs)
            ]
        )
        correct = [int(d.reward > 0) for d in scores]
        self.send("eval_result", version=msg["version"], tag=msg.get("tag", ""), prompt_ids=ids, correct=correct)

    # -- finished sequences --------------------------------------------------------------------------
    def on_finished(self, out) -> None:
        if self.scorer is None:
            return
        group_id, _ = out.request_id
        row = self.rows["train"][self.scorer.groups[group_id]["prompt_id"]]
        self.generated_tokens += len(out.token_ids)
        self.scorer.submit(out, self.tok.decode(out.token_ids, skip_special_tokens=True), row["answer"])

    def send_results(self, groups: list[tuple[int, list[Trajectory]]]) -> None:
        """Each group packed and sent point-to-point, then announced (`result`, with its size)."""
        for group_id, trajs in groups:
            self.send("result", **self.outbox.post(group_id, trajs), counters=self.counters())

    def on_fetch(self, msg: dict) -> None:
        if self.is_leader:  # a TP follower sends nothing
            self.outbox.fetched(msg["group_id"])
            self.send("delivered", group_id=msg["group_id"])

    def step(self, gen: Generator) -> list:
        """One generator step; on an emulated device type its prefill part is padded by the compute fraction and
        the rest (decode, memory-bound) by the bandwidth fraction."""
        prefill_before, t0 = gen.stats.prefill_seconds, time.perf_counter()
        outs = gen.step()
        if self.throttle.active:
            took, prefill = time.perf_counter() - t0, gen.stats.prefill_seconds - prefill_before
            self.throttle.pad("compute", prefill)
            self.throttle.pad("bandwidth", took - prefill)
        return outs

    def counters(self) -> dict:
        # reward_s: seconds the loop was blocked on scoring (inline fast path, waits for scores); reward_service_s:
        # the scorings' own time (inline and in the math-verify worker), mostly overlapped with decoding
        return {
            "elapsed_s": time.monotonic() - self.t_start,
            "idle_s": self.idle_s,
            "reward_s": self.scorer.blocked_s if self.scorer else 0.0,
            "reward_service_s": self.scorer.pool.reward_s if self.scorer else 0.0,
            "generated_tokens": self.generated_tokens,
            "version": self.gen.version,
            "prefill_s": self.gen.stats.prefill_seconds,
            "prefill_tokens": self.gen.stats.prefill_tokens,
            "throttle_s": sum(self.throttle.slept_s.values()),
        }

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.loop()
        finally:
            if self.scorer is not None:
                self.scorer.close()

    def receive(self) -> list[tuple[int, dict]]:
        """This turn's messages from the head: polled by the leader, then shared with the replica's followers."""
        msgs = []
        if self.is_leader:
            idle = self.gen.num_unfinished() == 0 and not self.scorer.pending  # nothing to do until the head sends
            t0 = time.monotonic()
            msgs = self.channel.poll(timeout_s=1.0 if idle else 0.0)
            if idle:
                self.idle_s += time.monotonic() - t0
                if not msgs and self.channel.silent_peers(self.cfg.dist.timeout_s):
                    raise PeerTimeout([self.head], self.cfg.dist.timeout_s, "work from the train head")
        if self.replica is not None:
            try:
                msgs = self.replica.share(msgs)
            except RuntimeError as e:  # a replica peer is gone: the head drops the replica
                raise Aborted(f"rollout replica {self.replica.ranks} lost a rank ({str(e).splitlines()[0]})") from None
        return msgs

    def loop(self) -> None:
        handlers = {"grant": self.on_grant, "weights": self.on_weights, "eval": self.on_eval, "fetch": self.on_fetch}
        if self.scorer is not None:
            self.scorer.pool.wait_ready()  # a first slow-path score must not wait for math-verify's imports
        self.send("ready", counters=self.counters())
        while True:
            msgs = self.receive()
            for _, msg in msgs:
                if msg["kind"] == "stop":
                    if self.scorer is not None:  # groups decoded before the stop still reach the head
                        self.send_results(self.scorer.drain())
                    self.send("bye", counters=self.counters())
                    return
                if msg["kind"] == "abort":
                    raise Aborted(msg["reason"])
                handlers[msg["kind"]](msg)
            if self.gen.num_unfinished() and not self.weights_incomplete:
                for out in self.step(self.gen):
                    self.on_finished(out)
                if self.scorer is not None:
                    self.send_results(self.scorer.collect())
            elif self.scorer is not None and self.scorer.pending:  # only scores left: wait briefly, then poll
                self.send_results(self.scorer.collect(wait_s=0.05))
            self.heartbeat()


# ----------------------------------------------------------------------------- the HF model's pieces, run our way


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate_half's sign folded in: rotate_half(x) * sin == roll(x, D/2) * signed_sin, bit for bit."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D] rotated by cos and signed_sin(sin) [B, L, D]."""
    cos, sin_signed = cos.unsqueeze(1), sin_signed.unsqueeze(1)  # [B, 1, L, D] broadcast over heads
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF RMSNorm (fp32 statistics, weight applied in the input dtype) with fewer ops: at decode sizes
    each op is a ~10 us dispatch on CPU and there are 2 norms per layer. For fp32 input `F.rms_norm` is one
    kernel with the same bits (tested); for bf16 HF rounds before the weight, so its arithmetic is written out."""
    if type(norm).__name__ not in RMS_NORM_CLASSES:
        return norm(x)
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    h = x.float()
    inv_rms = h.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()
    return norm.weight * (h * inv_rms).to(x.dtype)


def layer_windows(config, n_layers: int) -> list[int | None]:
    """Sliding-window size per layer (None = full attention), read the way HF reads it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:n_layers]]
    return [window] * n_layers


_INPUT_MAJOR_FASTER: dict[tuple, bool] = {}


def input_major_is_faster(out_features: int, in_features: int, rows: int, dtype: torch.dtype) -> bool:
    """CPU: is x @ W faster with W stored [in, out] than [out, in] (an nn.Linear's), at decode size?

    MKL's small-GEMM speed depends on the weight's layout, both ways and by shape: with 32 rows and 1 thread,
    weights streamed from memory, gate/up took 474 vs 592 us input-major (tiny model) and 1.9 vs 2.3 ms
    (34M config) while down_proj was 8-15% slower. So each shape is timed once per process, both layouts
    interleaved over ~16 MB of weight copies (in a decode step the weights come from memory, not cache), best
    of 5, and input-major must win by 5%. Both layouts give the same bits here (MKL); the tests run both."""
    key = (out_features, in_features, rows, dtype)
    if key not in _INPUT_MAJOR_FASTER:
        copies = max(2, (16 << 20) // (out_features * in_features * dtype.itemsize))
        x = torch.randn(rows, in_features, dtype=dtype)
        layouts = {"row": [torch.randn(out_features, in_features, dtype=dtype) for _ in range(copies)]}
        layouts["input"] = [w.t().contiguous().t() for w in layouts["row"]]
        best = {}
        for _ in range(5):
            for name, weights in layouts.items():
                t0 = time.perf_counter()
                for w in weights:
                    F.linear(x, w)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        _INPUT_MAJOR_FASTER[key] = best["input"] < 0.95 * best["row"]
    return _INPUT_MAJOR_FASTER[key]


def fuse_linears(
    linears: list[torch.nn.Linear], input_major: Callable[[int, int], bool]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight matrix (and bias) for Linear layers that read the same input: one GEMM instead of several.
    Returned as an [out, in] view like an nn.Linear weight. The layers' parameters become views of it, so
    whatever writes them (update_weights, load_state_dict, another Generator on the same model) writes the
    fused matrix too, and no memory is duplicated. `input_major(out, in)` says whether to store it [in, out]."""

    def cols():
        col = 0
        for lin in linears:
            yield lin, slice(col, col + lin.out_features)
            col += lin.out_features

    fused = getattr(linears[0], "_fused", None)  # a Generator built on this model before
    if fused is not None and all(
        lin.weight.data_ptr() == fused[0][r].data_ptr()
        and lin.weight.stride() == fused[0][r].stride()
        and (lin.bias is None or lin.bias.data_ptr() == fused[1][r].data_ptr())
        for lin, r in cols()
    ):
        return fused
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if input_major(*weight.shape):
        weight = weight.t().contiguous().t()
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat(
            [lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features) for lin in linears]
        )
    for lin, r in cols():
        lin.weight.data = weight[r]
        if lin.bias is not None:
            lin.bias.data = bias[r]
    linears[0]._fused = (weight, bias)
    return weight, bias


_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer avalanche hash of a Python int or int64 lanes (multipliers < 2**31: no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def seed_hash(seed):
    """The seed's half of counter_uniform, computed once per request (int, or int64 tensor)."""
    return _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))


def uniform_from_hash(hashed_seed, counter):
    h = _mix32(hashed_seed ^ (counter & _MASK32))
    return (h.to(torch.float64) + 0.5) / 2.0**32 if isinstance(h, torch.Tensor) else (h + 0.5) / 2.0**32


def counter_uniform(seeds, counters):
    """u in (0, 1) as a pure function of (seed, counter): the same draw in any batch, on any slot.
    Python ints or int64 tensors, the same value either way (the sampler hashes a batch's few ints in
    Python: ~30 tensor ops of 32 lanes cost more than the arithmetic)."""
    return uniform_from_hash(seed_hash(seeds), counters)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    u: torch.Tensor,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (tokens, logprobs); rows with temperature 0 are greedy.

    logits [B, V] fp32; temperature [B] fp32, or one float for all rows; top_p [B] fp32 and top_k [B]
    int64 (V when disabled), needed only with `truncate`; u [B] fp64. Sampling inverts the CDF at u.
    With `truncate` the vocabulary is sorted and cut by top-k, then top-p of the renormalised
    remainder (the order HF applies them); logprobs are never truncated.
    """
    if isinstance(temperature, torch.Tensor):
        greedy = temperature == 0
        all_greedy, any_greedy = bool(greedy.all()), bool(greedy.any())
        scaled = logits if all_greedy else logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    else:  # one temperature for every row (the usual case): no per-row tensors (x / 1 is x, bit for bit)
        greedy, all_greedy, any_greedy = None, temperature == 0, temperature == 0
        scaled = logits if temperature in (0.0, 1.0) else logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1) if any_greedy else None
    if not all_greedy:
        vocab = logits.shape[1]
        if truncate:
            sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
            probs = sorted_logp.exp()
            rank = torch.arange(vocab, device=logits.device)
            probs = probs * (rank.unsqueeze(0) < top_k.unsqueeze(1))
            cum = probs.cumsum(dim=-1)
            mass_before = cum - probs  # keep a token while the mass ranked above it < top_p
            in_nucleus = (mass_before < top_p.unsqueeze(1) * cum[:, -1:]) | (top_p >= 1.0).unsqueeze(1)
            probs = probs * in_nucleus  # (top_p = 1 keeps even the tail that fp32 cumsum rounds away)
        else:
            probs = logp.exp()
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1]
        target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
        idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=vocab - 1)
        drawn = order.gather(1, idx.unsqueeze(1)).squeeze(1) if truncate else idx
        tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


try:  # optional: flash-attn's in-place KV-cache decode kernel (GPU only)
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # pragma: no cover - not installed on CPU machines
    flash_attn_with_kvcache = None

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
LM_HEAD_BLOCK = 1024  # vocabulary rows per LM-head GEMM on CPU (see Generator._logits)


def gpu_options(device: torch.device, compile_decode: str = "auto", flash_attn: str = "never", tp: int = 1) -> dict:
    """Generator keyword arguments from "auto" | "always" | "never" (not on/off: YAML reads those as booleans).
    auto compiles the decode step into CUDA graphs on a GPU (launch-bound eager) but not on CPU (the static step
    is slower there) nor under tensor parallelism (tp > 1: the step's collectives are not captured), and uses
    flash-attn on a GPU when installed (opt-in: untested). Numbers: exp/GENERATOR.md."""
    on_gpu = device.type == "cuda"
    flash_ok = on_gpu and flash_attn_with_kvcache is not None
    return dict(
        compile_decode=compile_decode == "always" or compile_decode == "auto" and on_gpu and tp == 1,
        use_flash_attn=flash_attn == "always" or flash_attn == "auto" and flash_ok,
    )


# ----------------------------------------------------------------------------- public data types


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # -1 keeps the whole vocabulary
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    def validate(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")


@dataclass
class RequestOutput:
    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token, when hit, is included)
    logprobs: list[float]  # see the log-prob convention in the module docstring
    versions: list[int]  # policy version that sampled each token
    finish_reason: str  # "stop" | "length"


@dataclass
class GeneratorStats:
    decode_steps: int = 0
    prefill_tokens: int = 0  # tokens whose K/V were (re)computed by prefill, recompute included
    recompute_tokens: int = 0  # the part of prefill_tokens caused by weight updates
    prefill_tokens_shared: int = 0  # prompt tokens whose K/V were copied from a slot with the same prompt
    prefill_forwards: int = 0  # prefill-only forward passes (the last chunk of a step rides in its decode forward)
    generated_tokens: int = 0
    weight_updates: int = 0
    prefill_seconds: float = 0.0  # planning, K/V copies and prefill-only forwards
    decode_seconds: float = 0.0  # decode forwards, with the prefill rows riding in them, and sampling

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


@dataclass
class _Request:
    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    hashed_seed: int = 0  # seed_hash(params.seed), for the per-token uniforms
    needs_prefill: bool = True
    cache_version: int = -1  # the weights its prompt's K/V in the cache were computed with

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    @property
    def num_tokens(self) -> int:  # len(all_tokens) without building the list (read every decode step)
        return len(self.prompt_ids) + len(self.token_ids)


@dataclass
class _PrefillChunk:
    tokens: torch.Tensor  # [n, length] tokens[:-1] of n requests, right-padded
    write_rows: torch.Tensor  # rows of the cache's flat [slots * kv_heads * max_seq_len, D] view ...
    read_rows: torch.Tensor  # ... that receive these rows of the chunk's k/v ([n * length * kv_heads, D])


class Generator:
    """Continuous-batching generator; see the module docstring for the protocol and conventions.

    It fuses each layer's q/k/v and gate/up projections (their parameters become views of the fused
    matrices): move the model to its device and dtype before building the Generator, not after.

    tp_group (a torch.distributed group of k > 1 ranks): this rank runs shard r of the model, tensor parallel
    (see the module docstring). The HF model's weights are sliced in place, once (the model is marked, so a
    second Generator on it, e.g. for evaluation, reuses the shard); every rank of the group must make the same
    calls in the same order, and then gets the same outputs."""

    def __init__(
        self,
        model,
        max_batch_size: int = 32,
        max_seq_len: int = 1024,
        version: int = 0,
        interrupt_mode: str = "recompute",
        compile_decode: bool = False,
        use_flash_attn: bool = False,
        max_prefill_tokens: int = 16384,
        weight_layout: str = "auto",
        tp_group=None,
    ):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"Generator supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        if interrupt_mode not in ("recompute", "keep"):
            raise ValueError(f"interrupt_mode must be 'recompute' or 'keep', got {interrupt_mode!r}")
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if use_flash_attn and (flash_attn_with_kvcache is None or self.device.type != "cuda"):
            raise ValueError("use_flash_attn=True needs the flash_attn package and a CUDA model")
        self.tp_group = tp_group
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        if self.tp_rank < 0:
            raise ValueError("tp_group: this process is not a member of the group")
        if self.tp > 1:
            check_tp_divides(config, self.tp)
            if compile_decode:
                raise ValueError(
                    f"compile_decode=True is not supported with tensor parallelism (tp={self.tp}): the decode step's "
                    "collectives are not captured by torch.compile / CUDA graphs; use compile_decode=False"
                )
            if getattr(model.lm_head, "bias", None) is not None:
                raise ValueError("tensor parallelism: an LM head with a bias is not supported")
        shard = getattr(model, "_generator_tp_shard", None)  # (tp_rank, tp, shards) left by a Generator before
        if shard is None and self.tp > 1:
            shard = (self.tp_rank, self.tp, self._shard_model(model))
            model._generator_tp_shard = shard
        if shard is not None and shard[:2] != (self.tp_rank, self.tp):
            raise ValueError(
                f"the model holds TP shard {shard[0]} of {shard[1]} (sliced by an earlier Generator); "
                f"this Generator is rank {self.tp_rank} of tp={self.tp}: pass the same tp_group"
            )
        # name -> (split dim, full HF shape) of every parameter held as a TP slice (empty without TP)
        self.shards: dict[str, tuple[int, tuple[int, ...]]] = {} if shard is None else shard[2]

        self.model = model.eval()
        base = model.model
        self.embed, self.layers, self.norm = base.embed_tokens, list(base.layers), base.norm
        self.rotary, self.lm_head = base.rotary_emb, model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = config.num_attention_heads // self.tp  # this rank's heads (all of them without TP)
        self.n_kv_heads = config.num_key_value_heads // self.tp
        self.scale = attn.scaling
        self.vocab_size = config.vocab_size  # the full vocabulary: logits are gathered before sampling
        self.local_vocab = config.vocab_size // self.tp
        self.vocab_start = self.tp_rank * self.local_vocab  # this rank's rows of embed_tokens and lm_head
        self.windows = layer_windows(config, len(self.layers))
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.interrupt_mode, self.use_flash_attn = interrupt_mode, use_flash_attn
        self.version = version
        if weight_layout not in ("auto", "row", "input"):
            raise ValueError(f"weight_layout must be 'auto', 'row' or 'input', got {weight_layout!r}")
        if weight_layout == "auto" and self.device.type != "cpu":
            weight_layout = "row"

        def input_major(out_features: int, in_features: int) -> bool:
            return (
                weight_layout == "input"
                or weight_layout == "auto"
                and input_major_is_faster(out_features, in_features, max_batch_size, self.dtype)
            )

        self.qkv = [
            fuse_linears([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], input_major) for l in self.layers
        ]
        self.gate_up = [fuse_linears([l.mlp.gate_proj, l.mlp.up_proj], input_major) for l in self.layers]
        self.o_proj = [fuse_linears([l.self_attn.o_proj], input_major) for l in self.layers]
        self.down_proj = [fuse_linears([l.mlp.down_proj], input_major) for l in self.layers]
        self.qkv_sizes = [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        # RoPE cos / signed sin of every cache position, computed once by the model's own rotary module
        # (exact: cos/sin are elementwise in the position); rope types that rescale with length are called per step.
        self.rope_table = None
        if getattr(self.rotary, "rope_type", None) in ROPE_TABLE_TYPES:
            cos, sin = self.rotary(
                torch.zeros(1, dtype=self.dtype, device=self.device),
                torch.arange(max_seq_len, device=self.device).unsqueeze(0),
            )
            self.rope_table = (cos[0], signed_sin(sin[0]))

        # The cache: per layer [slots, kv_heads, max_seq_len, head_dim], owned by us.
        shape = (max_batch_size, self.n_kv_heads, max_seq_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.cache_positions = torch.arange(max_seq_len, device=self.device)
        # row of (slot, kv head, position 0) in a cache's flat [slots * kv_heads * max_seq_len, D] view
        self.kv_row_starts = (
            torch.arange(max_batch_size * self.n_kv_heads, device=self.device).view(max_batch_size, -1) * max_seq_len
        )

        self.waiting: deque[_Request] = deque()
        self.slots: list[_Request | None] = [None] * max_batch_size
        self.requests: dict[Hashable, _Request] = {}
        self.stats = GeneratorStats()

        # A compiled decode step needs static shapes: always all slots and the full cache length.
        self.static_decode = compile_decode
        self._decode_forward = self._forward_eager
        if compile_decode:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            if self.device.type == "cuda":
                # A CUDA graph replays fixed addresses. Tensors that are not parameters would otherwise be copied
                # into the graph's own input buffers on every replay: the whole cache and the fused weights.
                fused = [t for pair in self.qkv + self.gate_up + self.o_proj + self.down_proj for t in pair]
                for t in [
                    *self.k_cache,
                    *self.v_cache,
                    *fused,
                    self.cache_positions,
                    self.kv_row_starts,
                    *(self.rope_table or ()),
                ]:
                    if t is not None:
                        torch._dynamo.mark_static_address(t)
            self._decode_forward = torch.compile(self._forward_eager, mode=mode, dynamic=False)

    def _shard_model(self, model) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Replace each split parameter by this rank's slice, by the trainer's rules (parallel/tensor_parallel.py:
        q/k/v, gate/up, embedding and LM head by rows, o_proj and down_proj by columns); returns name ->
        (dim, full shape). A tied embedding is one Parameter under two names: sliced once."""
        params = dict(model.named_parameters(remove_duplicate=False))
        shards = {n: (shard_dim(n), tuple(p.shape)) for n, p in params.items() if shard_dim(n) is not None}
        sliced = set()
        with torch.no_grad():
            for name, (dim, _) in shards.items():
                p = params[name]
                if id(p) not in sliced:
                    sliced.add(id(p))
                    local = slice_shard(p.detach(), dim, self.tp_rank, self.tp)
                    p.data = local.clone(memory_format=torch.contiguous_format)  # frees the full tensor
        for module in model.modules():  # fuse_linears reads out_features
            if isinstance(module, torch.nn.Linear):
                module.out_features, module.in_features = module.weight.shape
            elif isinstance(module, torch.nn.Embedding):
                module.num_embeddings = module.weight.shape[0]
        return shards

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.tp_group)
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ids; under TP each rank looks up the ids in its vocabulary rows (zeros for the rest)
        and the sum over ranks is the full lookup (exact: one nonzero term)."""
        if self.tp == 1:
            return self.embed(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.embed.weight)
        return self._all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def _row_parallel(self, x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """o_proj / down_proj. Under TP each rank holds a slice of the input features: partial products are
        summed over the group, then the (replicated) bias is added once."""
        if self.tp == 1:
            return F.linear(x, *weight_bias)
        weight, bias = weight_bias
        out = self._all_reduce(F.linear(x, weight))
        return out if bias is None else out + bias

    # ------------------------------------------------------------------ the transformer, our way

    def _qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Input norm, one fused q/k/v GEMM, RoPE; returns q, k, v as [B, heads, L, D]."""
        a = self.layers[i].self_attn
        b, n = x.shape[:2]
        qkv = F.linear(rms_norm(self.layers[i].input_layernorm, x), *self.qkv[i])
        nq, nk, _ = self.qkv_sizes
        v = qkv[..., nq + nk :].view(b, n, -1, self.head_dim).transpose(1, 2)
        if hasattr(a, "q_norm"):  # Qwen3: per-head RMSNorm on q and k before RoPE
            q, k = (t.view(b, n, -1, self.head_dim) for t in qkv[..., : nq + nk].split([nq, nk], -1))
            q, k = rms_norm(a.q_norm, q).transpose(1, 2), rms_norm(a.k_norm, k).transpose(1, 2)
            return rope(q, cos, sin), rope(k, cos, sin), v
        # q and k are adjacent in the fused output: rotate them as one tensor
        qk = rope(qkv[..., : nq + nk].view(b, n, -1, self.head_dim).transpose(1, 2), cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], v

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, signed sin) [B, L, D] at positions [B, L]."""
        if self.rope_table is not None:
            return self.rope_table[0][positions], self.rope_table[1][positions]
        cos, sin = self.rotary(x, positions)
        return cos, signed_sin(sin)

    def _finish_layer(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj, residual, MLP, residual; attn_out [rows, L, heads * D]."""
        layer = self.layers[i]
        x = x + self._row_parallel(attn_out, self.o_proj[i])
        gate, up = F.linear(rms_norm(layer.post_attention_layernorm, x), *self.gate_up[i]).chunk(2, dim=-1)
        return x + self._row_parallel(layer.mlp.act_fn(gate).mul_(up), self.down_proj[i])

    def _plan_prefill(self, reqs: list[_Request]) -> list[_PrefillChunk]:
        """Decide how each request's K/V of tokens[:-1] get into its slot; returns the chunks to compute.

        The samples of a GRPO group share their prompt: a fresh request whose prompt is already in the
        cache (another slot's, computed with the current weights) gets those K/V copied now; one whose
        prompt is computed in this step becomes an extra destination of that computation's rows (prefill
        is most of the work for short answers). The rest is computed in right-padded chunks of requests
        sorted by length, each within the prefill token budget (count x longest)."""
        reqs = [r for r in reqs if r.num_tokens > 1]
        for r in reqs:
            r.cache_version = self.version
        resident = {
            tuple(r.prompt_ids): r.slot
            for r in self.slots
            if r is not None and not r.needs_prefill and r.cache_version == self.version
        }
        computed: dict[tuple, _Request] = {}
        compute: list[_Request] = []
        sharers: dict[int, list[int]] = {}  # id(computed request) -> slots that receive its rows too
        for r in reqs:
            key = tuple(r.prompt_ids)
            if r.token_ids or key not in resident and key not in computed:
                compute.append(r)
                if not r.token_ids:
                    computed[key] = r
            elif key in resident:
                n, src = len(r.prompt_ids) - 1, resident[key]
                for k_layer, v_layer in zip(self.k_cache, self.v_cache):
                    k_layer[r.slot, :, :n] = k_layer[src, :, :n]
                    v_layer[r.slot, :, :n] = v_layer[src, :, :n]
                self.stats.prefill_tokens_shared += n
            else:
                sharers.setdefault(id(computed[key]), []).append(r.slot)
                self.stats.prefill_tokens_shared += len(r.prompt_ids) - 1
        compute.sort(key=lambda r: r.num_tokens)
        chunks = []
        while compute:
            n = 1
            while n < len(compute) and (n + 1) * (compute[n].num_tokens - 1) <= self.max_prefill_tokens:
                n += 1
            chunks.append(self._prefill_chunk(compute[:n], sharers))
            compute = compute[n:]
        return chunks

    def _prefill_chunk(self, reqs: list[_Request], sharers: dict[int, list[int]]) -> _PrefillChunk:
        """Right-padded tokens[:-1] of `reqs` and where each real row's K/V go in the flat cache view."""
        seqs = [r.all_tokens[:-1] for r in reqs]
        length = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), length, dtype=torch.long)
        heads = torch.arange(self.n_kv_heads)
        dst, src = [], []  # cache rows (slot, kv head, position) <- rows (request, position, kv head) of k
        for i, (r, s) in enumerate(zip(reqs, seqs)):
            tokens[i, : len(s)] = torch.tensor(s)
            pos = torch.arange(len(s)).unsqueeze(1)  # [len, 1]
            for slot in [r.slot] + sharers.get(id(r), []):
                dst.append((slot * self.n_kv_heads + heads) * self.max_seq_len + pos)
                src.append((i * length + pos) * self.n_kv_heads + heads)
        self.stats.prefill_tokens += sum(len(s) for s in seqs)
        return _PrefillChunk(
            tokens.to(self.device), torch.cat(dst).view(-1).to(self.device), torch.cat(src).view(-1).to(self.device)
        )

    def _forward_eager(
        self, tokens: torch.Tensor, positions: torch.Tensor, span: int, chunk: _PrefillChunk | None = None
    ) -> torch.Tensor | None:
        """One decode token for each of the first `tokens.shape[0]` slots, plus (optionally) the prefill rows
        of a chunk riding in the same GEMMs; returns fp32 logits [B, V] of the decode rows (None if B = 0).

        tokens/positions [B]: the input token of each slot and the cache index it is written at.
        span: how many cache positions decode attention reads (>= max(positions) + 1).
        Prefill rows are appended after the decode rows; they attend among themselves (causal SDPA over the
        padded chunk) while decode rows read the cache, which holds every row's K/V of this layer by then.
        Riding along costs a fraction of a separate forward: at these sizes a GEMM's cost is mostly the
        pass over the weights (tiny model, 17 GEMMs: 60 rows cost 1.26x 32 rows; 28 rows alone cost as much).
        """
        b = tokens.shape[0]
        kv = self.n_kv_heads
        write_rows = (self.kv_row_starts[:b] + positions.unsqueeze(1)).view(-1)
        read_rows = None  # rows of k/v to write (None: all, in order)
        rows_pos = positions
        if chunk is not None:
            n, length = chunk.tokens.shape
            tokens = torch.cat([tokens, chunk.tokens.view(-1)])
            rows_pos = torch.cat([positions, self.cache_positions[:length].repeat(n)])
            write_rows = torch.cat([write_rows, chunk.write_rows])
            read_rows = torch.cat([torch.arange(b * kv, device=self.device), chunk.read_rows + b * kv])
        x = self._embed(tokens.unsqueeze(1))  # [rows, 1, H]
        cos, sin = self._cos_sin(x, rows_pos.unsqueeze(1))
        masks = (
            {}
            if b == 0 or self.use_flash_attn
            else {window: self._decode_mask(positions, span, window) for window in set(self.windows)}
        )
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, x, cos, sin)  # [rows, heads, 1, D]
            window = self.windows[i]
            # write every row's K/V first (index_copy_: a third of index_put's time), then attention reads the cache
            for cache, new in ((self.k_cache[i], k), (self.v_cache[i], v)):
                new = new.reshape(-1, self.head_dim)
                cache.view(-1, self.head_dim).index_copy_(0, write_rows, new if read_rows is None else new[read_rows])
            if i == len(self.layers) - 1 and chunk is not None:  # only the prefill rows' cache is wanted
                if b == 0:
                    return None
                x, q, chunk = x[:b], q[:b], None
            outs = []
            if b:
                outs.append(self._decode_attention(i, q[:b], positions, span, window, masks.get(window)))
            if chunk is not None:
                outs.append(self._prefill_attention(q[b:], k[b:], v[b:], n, length, window))
            x = self._finish_layer(i, x, outs[0] if len(outs) == 1 else torch.cat(outs))
        return self._logits(rms_norm(self.norm, x)[:, 0])

    def _decode_mask(self, positions: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
        """Additive mask [B * kv_heads, 1, span]: each slot reads its own positions (within the window)."""
        b = positions.shape[0]
        kpos, qpos = self.cache_positions[:span].unsqueeze(0), positions.unsqueeze(1)
        keep = (kpos <= qpos) if window is None else (kpos <= qpos) & (kpos > qpos - window)
        return (
            torch.zeros(b, self.n_kv_heads, 1, span, dtype=self.dtype, device=self.device)
            .masked_fill_(~keep.view(b, 1, 1, span), float("-inf"))
            .view(-1, 1, span)
        )

    def _decode_attention(
        self, i: int, q: torch.Tensor, positions: torch.Tensor, span: int, window: int | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of one query row per slot over its cache rows; returns [B, 1, heads * D]."""
        b = q.shape[0]
        if self.use_flash_attn:
            out = flash_attn_with_kvcache(
                q.transpose(1, 2),
                self.k_cache[i][:b].transpose(1, 2),
                self.v_cache[i][:b].transpose(1, 2),
                cache_seqlens=(positions + 1).to(torch.int32),
                softmax_scale=self.scale,
                causal=True,
                window_size=(-1, -1) if window is None else (window - 1, 0),
            )
            return out.reshape(b, 1, -1)
        # GQA without repeating K/V: the `group` query heads of one KV head become `group` query rows.
        # Written out, not SDPA: for one query row per head SDPA's masked path costs more than the math.
        qg = q.reshape(b * self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
        keys = self.k_cache[i][:b, :, :span].reshape(b * self.n_kv_heads, span, self.head_dim)
        values = self.v_cache[i][:b, :, :span].reshape(b * self.n_kv_heads, span, self.head_dim)
        scores = torch.baddbmm(mask, qg, keys.transpose(1, 2), alpha=self.scale)
        probs = scores.softmax(-1, dtype=torch.float32).to(self.dtype)
        return torch.bmm(probs, values).view(b, 1, -1)

    def _prefill_attention(self, q, k, v, n: int, length: int, window: int | None) -> torch.Tensor:
        """Causal attention within each right-padded sequence of a chunk (a real query never looks past
        itself, so padding needs no key mask); q/k/v [n * length, heads, 1, D] -> [n * length, 1, heads * D]."""
        q, k, v = (t.reshape(n, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if window is None or window >= length:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            qpos = self.cache_positions[:length].unsqueeze(1)
            kpos = self.cache_positions[:length].unsqueeze(0)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=(kpos <= qpos) & (kpos > qpos - window), scale=self.scale, enable_gqa=True
            )
        return out.transpose(1, 2).reshape(n * length, 1, -1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V]. On CPU a large vocabulary goes through the LM head in blocks of rows: as one
        [B, H] x [H, V] GEMM it ran at half the speed (V = 16384, MKL, 1 thread: 28 ms vs 14 ms in blocks of
        1024). On GPU it is one GEMM. Under TP each rank computes its [B, V/k] and all of them are gathered, so
        every rank samples the same tokens from the same logits."""
        w, b = self.lm_head.weight.detach(), self.lm_head.bias
        if self.device.type != "cpu" or w.shape[0] <= 4 * LM_HEAD_BLOCK:
            logits = F.linear(h, w, b).float()
        else:
            out = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype)
            for i in range(0, w.shape[0], LM_HEAD_BLOCK):
                torch.matmul(h, w[i : i + LM_HEAD_BLOCK].t(), out=out[:, i : i + LM_HEAD_BLOCK])
            logits = (out if b is None else out + b).float()
        if self.tp == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp)]
        dist.all_gather(parts, logits, group=self.tp_group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ streaming API

    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a request; it is admitted into a slot by a later step() as soon as one is free."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the generator")
        params.validate()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        bad = [t for t in prompt_ids + list(params.stop_token_ids) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) + params.max_new_tokens - 1 > self.max_seq_len:
            raise ValueError(
                f"request {request_id!r}: prompt length {len(prompt_ids)} + max_new_tokens "
                f"{params.max_new_tokens} - 1 exceeds max_seq_len {self.max_seq_len}"
            )
        req = _Request(
            request_id,
            prompt_ids,
            dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids)),
            hashed_seed=seed_hash(params.seed),
        )
        self.requests[request_id] = req
        self.waiting.append(req)

    def num_unfinished(self) -> int:
        return len(self.requests)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free slots (prefill), then ONE batched decode step for all
        running slots. Returns the requests that finished in this step."""
        for slot in range(self.max_batch_size):
            if not self.waiting:
                break
            if self.slots[slot] is None:
                req = self.waiting.popleft()
                req.slot, req.needs_prefill = slot, True
                self.slots[slot] = req
        running = [r for r in self.slots if r is not None]
        if not running:
            return []
        to_prefill = [r for r in running if r.needs_prefill]
        riding = None
        if to_prefill:
            t0 = time.perf_counter()
            chunks = self._plan_prefill(to_prefill)
            for r in to_prefill:
                r.needs_prefill = False
            # the last chunk rides in the decode forward; earlier ones (over the token budget), and all of
            # them under a compiled static-shape decode step, run as prefill-only forwards
            if chunks and not self.static_decode:
                riding = chunks.pop()
            no_rows = torch.zeros(0, dtype=torch.long, device=self.device)
            for chunk in chunks:
                self.stats.prefill_forwards += 1
                self._forward_eager(no_rows, no_rows, 0, chunk)
            self.stats.prefill_seconds += time.perf_counter() - t0

        t0 = time.perf_counter()
        width = self.max_batch_size if self.static_decode else max(r.slot for r in running) + 1
        tokens, positions = [0] * width, [0] * width  # idle slots decode a dummy token at position 0
        for r in running:
            tokens[r.slot], positions[r.slot] = (r.token_ids or r.prompt_ids)[-1], r.num_tokens - 1
        span = self.max_seq_len if self.static_decode else max(positions) + 1
        if self.static_decode and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are consumed: reuse their memory
        logits = self._decode_forward(
            torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device), span, riding
        )
        new_tokens, new_logprobs = self._sample(logits, running)
        self.stats.decode_steps += 1
        self.stats.generated_tokens += len(running)

        finished = []
        for r, tok, lp in zip(running, new_tokens, new_logprobs):
            r.token_ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            reason = (
                "stop"
                if tok in r.params.stop_token_ids
                else ("length" if len(r.token_ids) >= r.params.max_new_tokens else None)
            )
            if reason is not None:
                finished.append(self._release(r, reason))
        self.stats.decode_seconds += time.perf_counter() - t0
        return finished

    def _sample(self, logits: torch.Tensor, running: list[_Request]) -> tuple[list[int], list[float]]:
        if len(running) < logits.shape[0]:  # drop the rows of idle slots
            logits = logits[torch.tensor([r.slot for r in running], device=self.device)]
        params = [r.params for r in running]
        dev = self.device
        temperatures = {p.temperature for p in params}
        temperature = (
            temperatures.pop()
            if len(temperatures) == 1
            else torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        )
        truncate = any(p.temperature > 0 and (p.top_p < 1.0 or 0 < p.top_k < self.vocab_size) for p in params)
        top_p = top_k = None
        if truncate:
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            top_k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=dev)
        u = torch.tensor(
            [uniform_from_hash(r.hashed_seed, len(r.token_ids)) for r in running], dtype=torch.float64, device=dev
        )
        tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, u, truncate)
        return tokens.tolist(), logprobs.tolist()

    def _release(self, req: _Request, reason: str) -> RequestOutput:
        if req.slot >= 0:
            self.slots[req.slot] = None
        del self.requests[req.request_id]
        return RequestOutput(req.request_id, req.prompt_ids, req.token_ids, req.logprobs, req.versions, reason)

    def abort(self, request_id: Hashable) -> None:
        """Drop a waiting or running request; its slot is free for the next step()."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"abort: unknown request id {request_id!r}")
        if req.slot < 0:
            self.waiting.remove(req)
        self._release(req, "abort")

    def unfinished_requests(self) -> list[tuple[Hashable, list[int], SamplingParams, list[int]]]:
        """(request_id, prompt_ids, params, tokens so far) of every waiting or running request."""
        return [(r.request_id, list(r.prompt_ids), r.params, list(r.token_ids)) for r in self.requests.values()]

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        last: bool = True,
    ) -> None:
        """Copy HF-named tensors (all of `model.state_dict()` or any bucket of it) into the model.

        A version sent in buckets is applied with one call per bucket, `last=True` on the final one: only then does
        the generator's version switch (and, in recompute mode, the in-flight sequences get marked for re-prefill).

        Allowed between step() calls. With tied embeddings either key updates the shared tensor.
        Under TP the tensors are the full HF ones (what the trainer's weight sync sends); each rank copies its slice.
        In "recompute" mode every in-flight sequence is re-prefilled under the new weights at the
        next step(); in "keep" mode its stale cache is reused.
        """
        if version < self.version:
            raise ValueError(f"update_weights: version {version} is older than current version {self.version}")
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        items = weights.items() if isinstance(weights, Mapping) else weights
        for name, tensor in items:
            target = targets.get(name)
            if target is None:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of this "
                    f"{self.model.config.model_type} model (expected HF state_dict names)"
                )
            dim, shape = self.shards.get(name, (None, tuple(target.shape)))
            if tuple(tensor.shape) != shape:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, model expects {shape}")
            target.copy_(slice_shard(tensor, dim, self.tp_rank, self.tp))
        if not last:
            return
        self.version = version
        self.stats.weight_updates += 1
        if self.interrupt_mode == "recompute":
            for r in self.slots:
                if r is not None:
                    r.needs_prefill = True
                    self.stats.recompute_tokens += r.num_tokens - 1

    # ------------------------------------------------------------------ batch API

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Generate for every prompt with continuous batching; outputs are in prompt order.

        One SamplingParams for the list gives request i the seed `params.seed + i`; a list gives
        one SamplingParams per prompt, used as is.
        """
        if isinstance(params, SamplingParams):
            params = [dataclasses.replace(params, seed=params.seed + i) for i in range(len(prompts))]
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} SamplingParams")
        if self.requests:
            raise RuntimeError("generate: the generator already has unfinished streaming requests")
        keys = [("generate", i) for i in range(len(prompts))]
        try:
            for key, prompt, p in zip(keys, prompts, params):
                self.add_request(key, prompt, p)
        except Exception:
            for key in keys:  # leave the generator empty, not half-loaded
                if key in self.requests:
                    self.abort(key)
            raise
        results: dict[Hashable, RequestOutput] = {}
        while self.requests:
            for out in self.step():
                results[out.request_id] = out
        outs = [results[k] for k in keys]
        for i, out in enumerate(outs):
            out.request_id = i
        return outs
