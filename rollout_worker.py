"""The rollout rank's loop: generate GRPO groups for the train head, apply new weights between decode steps.

Messages from the head (parallel/channel.py), handled between decode steps:
  grant    {groups: [[group_id, prompt_id], ...]}  -> G requests each, per-request seeds
  weights  {version, buckets}                      -> receive, verify, gen.update_weights (interruptible:
                                                      sequences in flight continue under the new version)
  eval     {version, prompt_ids}                   -> greedy accuracy on held-out prompts, answered at once
  stop     {}                                      -> answer `bye` and return
  abort    {reason}                                -> the run is over (the head has printed why): raise Aborted
To the head: `ready` once (model loaded, generator built, reward worker started: plan.rollout_timeout_s counts
only from here, so a slow start is not mistaken for a stuck rank), `result` (one finished group, with this
rank's counters), `eval_result`, and `alive` (counters) whenever nothing else was sent for a while, so the head
can tell a slow rank from a stuck one.
"""
from __future__ import annotations

import time

import torch

from buffer import Trajectory
from parallel.channel import Aborted, Channel, PeerTimeout
from parallel.weight_sync import receive_weights
from reward_math import score, warm_up
from rollout import Generator, SamplingParams, gpu_options


def request_seed(base: int, group_id: int, sample_idx: int) -> int:
    """Depends only on (seed, group, sample): the same tokens whatever rank or slot serves the request."""
    return (base * 1_000_003 + group_id * 4099 + sample_idx) % (2**62)


class RolloutWorker:
    def __init__(self, cfg, model, tokenizer, train_rows: list[dict], test_rows: list[dict], head: int,
                 device: torch.device):
        self.cfg, self.model, self.tok, self.head, self.device = cfg, model, tokenizer, head, device
        warm_up(wait=False)                           # math-verify's imports overlap the generator's set-up
        self.rows = {"train": {r["prompt_id"]: r for r in train_rows}, "test": {r["prompt_id"]: r for r in test_rows}}
        self.encoded: dict[tuple[str, int], list[int]] = {}
        self.gpu_options = gpu_options(device, cfg.rollout.compile_decode, cfg.rollout.flash_attn)
        self.gen = Generator(model, max_batch_size=cfg.rollout.max_batch_size, max_seq_len=cfg.rollout.max_seq_len,
                             interrupt_mode=cfg.rollout.interrupt_mode, **self.gpu_options)
        self.eval_gen: Generator | None = None
        self.channel = Channel([head])
        self.open_groups: dict[int, dict] = {}        # group_id -> {prompt_id, outs: {sample: Trajectory}}
        self.t_start = time.monotonic()
        self.idle_s = self.reward_s = 0.0
        self.generated_tokens = 0
        self.heartbeat_s = min(5.0, cfg.plan.rollout_timeout_s / 4)
        self.last_sent = time.monotonic()

    def send(self, kind: str, **payload) -> None:
        self.channel.send(self.head, kind, **payload)
        self.last_sent = time.monotonic()

    def heartbeat(self) -> None:
        if time.monotonic() - self.last_sent > self.heartbeat_s:
            self.send("alive", counters=self.counters())

    def prompt_ids(self, split: str, prompt_id: int) -> list[int]:
        key = (split, prompt_id)
        if key not in self.encoded:
            ids = self.tok(self.rows[split][prompt_id]["prompt"])["input_ids"]
            limit = self.cfg.rollout.max_seq_len - self.cfg.rollout.max_new_tokens
            if len(ids) > limit:
                raise ValueError(f"prompt {prompt_id} ({split}) has {len(ids)} tokens; rollout.max_seq_len - "
                                 f"max_new_tokens allows {limit}")
            self.encoded[key] = ids
        return self.encoded[key]

    def sampling(self, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_token_ids=[self.tok.eos_token_id], seed=seed)

    # -- messages ----------------------------------------------------------------------------------
    def on_grant(self, msg: dict) -> None:
        G = self.cfg.rollout.samples_per_prompt
        for group_id, prompt_id in msg["groups"]:
            self.open_groups[group_id] = {"prompt_id": prompt_id, "outs": {}}
            prompt = self.prompt_ids("train", prompt_id)
            for s in range(G):
                self.gen.add_request((group_id, s), prompt, self.sampling(request_seed(self.cfg.train.seed, group_id, s)))

    def on_weights(self, msg: dict) -> None:
        p = self.cfg.plan
        state_dict = receive_weights(msg, self.head, self.device, p.verify_weights)
        self.gen.update_weights(state_dict, msg["version"])
        self.send("weights_ok", version=msg["version"])    # the head may now reuse the send buffers

    @torch.no_grad()
    def on_eval(self, msg: dict) -> None:
        if self.eval_gen is None:     # a second cache over the same (shared) weights
            self.eval_gen = Generator(self.model, max_batch_size=self.cfg.rollout.max_batch_size,
                                      max_seq_len=self.cfg.rollout.max_seq_len, **self.gpu_options)
        self.eval_gen.version = self.gen.version
        ids = msg["prompt_ids"]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens,
                                stop_token_ids=[self.tok.eos_token_id])
        # streamed rather than generate(): a long eval share must not look like a stuck rank
        for j, i in enumerate(ids):
            self.eval_gen.add_request(j, self.prompt_ids("test", i), greedy)
        done = {}
        while self.eval_gen.num_unfinished():
            done.update((o.request_id, o) for o in self.eval_gen.step())
            self.heartbeat()
        outs = [done[j] for j in range(len(ids))]
        correct = [int(score(self.tok.decode(o.token_ids, skip_special_tokens=True),
                             self.rows["test"][i]["answer"]) > 0) for i, o in zip(ids, outs)]
        self.send("eval_result", version=self.gen.version, tag=msg.get("tag", ""),
                          prompt_ids=ids, correct=correct)

    # -- finished sequences --------------------------------------------------------------------------
    def on_finished(self, out) -> None:
        group_id, sample_idx = out.request_id
        group = self.open_groups[group_id]
        row = self.rows["train"][group["prompt_id"]]
        t0 = time.perf_counter()
        correct = score(self.tok.decode(out.token_ids, skip_special_tokens=True), row["answer"]) > 0
        self.reward_s += time.perf_counter() - t0
        r = self.cfg.rollout
        group["outs"][sample_idx] = Trajectory(
            prompt_id=group["prompt_id"], sample_idx=sample_idx, prompt_ids=list(out.prompt_ids),
            response_ids=list(out.token_ids), behav_logprobs=list(out.logprobs), versions=list(out.versions),
            reward=r.reward_correct if correct else r.reward_wrong, finish_reason=out.finish_reason,
            group_id=group_id, correct=correct)
        self.generated_tokens += len(out.token_ids)
        if len(group["outs"]) == r.samples_per_prompt:
            del self.open_groups[group_id]
            trajs = [group["outs"][s].to_dict() for s in range(r.samples_per_prompt)]
            self.send("result", group_id=group_id, trajectories=trajs,
                              counters=self.counters())

    def counters(self) -> dict:
        return {"elapsed_s": time.monotonic() - self.t_start, "idle_s": self.idle_s, "reward_s": self.reward_s,
                "generated_tokens": self.generated_tokens, "version": self.gen.version,
                "prefill_s": self.gen.stats.prefill_seconds, "prefill_tokens": self.gen.stats.prefill_tokens}

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        handlers = {"grant": self.on_grant, "weights": self.on_weights, "eval": self.on_eval}
        warm_up()                                     # a first slow-path score must not stall a decode step
        self.send("ready", counters=self.counters())
        while True:
            idle = self.gen.num_unfinished() == 0
            t0 = time.monotonic()
            msgs = self.channel.poll(timeout_s=1.0 if idle else 0.0)
            if idle:
                self.idle_s += time.monotonic() - t0
                if not msgs and self.channel.silent_peers(self.cfg.plan.timeout_s):
                    raise PeerTimeout([self.head], self.cfg.plan.timeout_s, "work from the train head")
            for _, msg in msgs:
                if msg["kind"] == "stop":
                    self.send("bye", counters=self.counters())
                    return
                if msg["kind"] == "abort":
                    raise Aborted(msg["reason"])
                handlers[msg["kind"]](msg)
            if self.gen.num_unfinished():
                for out in self.gen.step():
                    self.on_finished(out)
            self.heartbeat()
