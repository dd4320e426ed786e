"""The rollout rank: messages from the head, grants turned into requests, weights between steps, evals, scoring.

The rank generates GRPO groups for the train head with our generator (generator.py) and applies new weights between
decode steps. Messages from the head (parallel/channel.py), handled between decode steps:
  grant    {groups: [[group_id, prompt_id], ...]}  -> G requests each, per-request seeds (the head's admission of
                                                      groups into this rank's queue)
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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

from buffer import Trajectory
from generator import Generator, SamplingParams
from parallel.channel import Aborted, Channel, PeerTimeout
from parallel.replica import ReplicaLink
from parallel.trajectories import TrajectorySender
from parallel.weight_sync import receive_version
from reward_math import DEFAULT_LIMITS, RewardPool, ScoreDetails, ScoreLimits
from runlog import peak_memory_bytes


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
    ):
        """`weight_links`: this leader's weight-sync process groups (ParallelGroups.weight_links)."""
        self.cfg, self.model, self.tok, self.head, self.device = cfg, model, tokenizer, head, device
        self.replica = replica
        self.weight_links = weight_links or {}
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
        self.gen = Generator.from_config(model, r, tp_group=None if replica is None else replica.group)
        self.eval_gen: Generator | None = None
        self.channel = Channel([head]) if self.is_leader else None
        self.outbox = TrajectorySender(head, cfg.dist.timeout_s)  # sent groups, kept until the head fetches them
        self.t_start = time.monotonic()
        self.idle_s = 0.0
        self.generate_s = 0.0
        # the generator steps' own CPU seconds (this thread's: sleeps cost none) and their count: with
        # generate_s they split a replica's generation into its work, its padding and its waits for a core
        self.generate_cpu_s = 0.0
        self.generate_steps = 0
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
        if self.eval_gen is None:  # over the same (shared) weights and the same KV pool: no second cache
            tp_group = None if self.replica is None else self.replica.group
            self.eval_gen = Generator.from_config(self.model, self.cfg.rollout, tp_group, kv_pool=self.gen.kv_pool)
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

    @staticmethod
    def run_step(gen: Generator) -> list:
        """How one generator step runs: a seam for the CPU bench (cpu_bench/), which pads it to a slower device."""
        return gen.step()

    def step(self, gen: Generator) -> list:
        """One generator step. Its wall time (with the bench's padding, if any) adds to generate_s: the rest of the
        loop's busy time (messages, scoring, sending groups) is what is left of elapsed_s - idle_s."""
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = self.run_step(gen)
        self.generate_s += time.perf_counter() - t0
        self.generate_cpu_s += time.thread_time() - c0
        self.generate_steps += 1
        return outs

    def counters(self) -> dict:
        # reward_s: seconds the loop was blocked on scoring (inline fast path, waits for scores); reward_service_s:
        # the scorings' own time (inline and in the math-verify worker), mostly overlapped with decoding
        return {
            "elapsed_s": time.monotonic() - self.t_start,
            "idle_s": self.idle_s,
            "generate_s": self.generate_s,
            "generate_cpu_s": self.generate_cpu_s,
            "generate_steps": self.generate_steps,
            "reward_s": self.scorer.blocked_s if self.scorer else 0.0,
            "reward_service_s": self.scorer.pool.reward_s if self.scorer else 0.0,
            "generated_tokens": self.generated_tokens,
            "version": self.gen.version,
            "prefill_s": self.gen.stats.prefill_seconds,
            "prefill_tokens": self.gen.stats.prefill_tokens,
            "peak_memory_bytes": peak_memory_bytes(),
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
