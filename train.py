"""hexrl: fully asynchronous PPO/GRPO across heterogeneous devices.

    torchrun --nproc_per_node=4 train.py                       # the CPU demo (exp/configs/cpu_demo.yaml)
    torchrun --nproc_per_node=N train.py config=<name> plan=plan.json max_staleness=8 train.lr=2e-5

The story of a run:
1. every rank loads the config, the tokenizer and the task, and joins the process group
   (gloo on CPU; NCCL for weights plus gloo for control on GPU);
2. the rank map (schedule.py's plan, or a default split) gives each rank a role: `rollout` ranks
   generate (rollout.py), `train` ranks run the DP×TP×PP PPO trainer (parallel/);
3. the train head (train rank 0) is also the controller: it admits GRPO groups to rollout ranks under
   the staleness bound (buffer.py), collects finished groups, forms batches that keep every deadline, trains,
   and sends each new weight version to the rollout ranks, which apply it between decode steps;
4. metrics go to runs/<run>/metrics.jsonl (+ W&B), every consumed trajectory to ledger.jsonl;
   every `checkpoint.every` steps the train ranks write a checkpoint (checkpoint.py); `resume=auto` continues
   from the latest complete one, truncating the logs back to it so every step is logged and trained once;
5. every rank ends with barrier → destroy_process_group → flush → os._exit(0).

Faults: every wait has a deadline. A rollout rank silent for dist.rollout_timeout_s while it owes work (counted
from its `ready`: loading the model may take up to dist.timeout_s) is dropped (its groups re-queued, the run
continues with the others, and the head exits 3 at the end naming it, so the launcher reclaims the stuck
process); a non-finite step is skipped (stop after train.max_nonfinite_steps in a row); bad input ends the run
with one line `[rank R] error: ...` and exit code 2, and the head tells the other ranks to stop (`abort`) so
none waits forever.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from buffer import StalenessBuffer, Trajectory, group_advantages
from checkpoint import (
    CheckpointError,
    CheckpointWriter,
    find_resume,
    load_head_state,
    load_train_shard,
    open_run,
    save_train_shard,
)
from config import Config, load_config, to_dict
from errors import HexrlError
from parallel.channel import Aborted, Channel, PeerTimeout
from parallel.rankmap import check_plan, default_plan, load_plan
from parallel.weight_sync import WeightSender
from runlog import RunLog
from tasks import DataError, load_task


class SetupError(HexrlError, RuntimeError):
    """The launch cannot work: no torchrun, no GPU for a rank, a model path that does not load."""

    same_on_every_rank = True


class NonFiniteError(HexrlError, RuntimeError):
    """Too many non-finite steps in a row (train.max_nonfinite_steps)."""


class RolloutRanksLost(HexrlError, RuntimeError):
    """The run finished without some rollout ranks; exit 3 so the launcher reclaims the stuck processes."""

    exit_code = 3


# ---------------------------------------------------------------------------------------------- setup
def init_distributed(cfg: Config) -> torch.device:
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one cannot split roles
        raise SetupError(
            "launch with torchrun, e.g. `torchrun --nproc_per_node=4 train.py` "
            "(hexrl needs at least one rollout and one train rank)"
        )
    timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():  # NCCL refuses two ranks on one GPU
            raise SetupError(
                f"local rank {local} has no GPU of its own: {torch.cuda.device_count()} visible on this "
                f"node; hexrl runs one rank per GPU (--nproc_per_node=<GPUs per node>)"
            )
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(int(os.environ.get("HEXRL_THREADS", 1)))  # ranks share the cores
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def load_tokenizer_and_config(cfg: Config):
    from transformers import AutoConfig, AutoTokenizer

    path = cfg.model.path
    local = Path(path)
    if (local.is_absolute() or path.startswith(".") or path.startswith("exp/")) and not local.exists():
        raise SetupError(f"model.path '{path}' does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        hf_config = AutoConfig.from_pretrained(path)
    except OSError as e:
        raise SetupError(f"cannot load model.path '{path}': {str(e).splitlines()[0]}") from None
    if tok.eos_token_id is None:
        raise SetupError(f"tokenizer at '{path}' has no eos token")
    return tok, hf_config


def load_policy(cfg: Config, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.path, dtype=resolve_dtype(cfg, device), attn_implementation=cfg.model.attn_implementation
    )
    return model.to(device).eval()


def make_trainer(cfg: Config, groups, device: torch.device):
    from parallel.trainer import Trainer

    # temperature 0 is greedy sampling, whose tokens are scored under the untempered policy
    temperature = cfg.rollout.temperature or 1.0
    # the trainer computes in bf16 or fp32 (an fp16 rollout model still trains in fp32)
    compute_dtype = torch.bfloat16 if resolve_dtype(cfg, device) == torch.bfloat16 else torch.float32
    return Trainer(cfg.model.path, groups, cfg.train, device, temperature=temperature, compute_dtype=compute_dtype)


def broadcast_json(obj, src: int, group) -> dict:
    """Small documents from the train head to all train ranks (trajectories, commands)."""
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() != src:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.numpy()).decode())


# ---------------------------------------------------------------------------------------------- train head
class TrainHead:
    """Controller + train rank 0: admission, batching, training, weight sync, evaluation, checkpoints, logging."""

    def __init__(
        self,
        cfg: Config,
        groups,
        trainer,
        train_rows: list[dict],
        test_rows: list[dict],
        log: RunLog,
        device: torch.device,
        channel: Channel,
        writer: CheckpointWriter,
        resumed: dict | None = None,
    ):
        self.cfg, self.groups, self.trainer, self.log, self.device = cfg, groups, trainer, log, device
        self.channel, self.writer = channel, writer
        self.rollout_ranks = list(groups.rollout_ranks)
        self.lost_ranks: list[int] = []
        self.buffer = StalenessBuffer(
            cfg.train.prompts_per_step, cfg.staleness.max_staleness, consume_order=cfg.staleness.consume_order
        )
        self.sender = WeightSender(cfg.dist.weight_bucket_mb, cfg.dist.verify_weights, cfg.dist.timeout_s)
        self.train_ids = [r["prompt_id"] for r in train_rows]
        self.test_ids = [r["prompt_id"] for r in test_rows]
        self.data_epoch, self.data_pos = 0, 0
        self.nonfinite_in_a_row = 0
        if resumed is not None:  # everything else starts afresh (counters, timings)
            self.buffer = StalenessBuffer.from_state_dict(resumed["buffer"])
            self.data_epoch, self.data_pos = resumed["data_epoch"], resumed["data_pos"]
            self.nonfinite_in_a_row = resumed["nonfinite_in_a_row"]
        self.order = self._epoch_order(self.data_epoch)
        self.outstanding = {r: 0 for r in self.rollout_ranks}  # groups granted and not finished, per rank
        self.counters = {r: {} for r in self.rollout_ranks}  # latest counters reported by each rollout rank
        self.ready_ranks: set[int] = set()  # rollout ranks that have said `ready`
        self.weights_taken = {r: -1 for r in self.rollout_ranks}  # last weight version each rank acknowledged
        self.pending_eval: dict[int, dict] = {}  # version -> {correct, total, expected, owed}
        self.evaluated: set[int] = set()
        self.idle_s = 0.0
        self.state_dict: dict | None = None  # the weights of the current version (fp32, CPU)
        self.in_collective = False  # an error there reaches every train rank itself
        self.last_command = time.monotonic()
        self.stopped = False

    # -- data order: a seeded permutation per epoch; its position is what checkpoints save --------
    def _epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.cfg.data.seed * 7919 + epoch)
        return [self.train_ids[i] for i in torch.randperm(len(self.train_ids), generator=g).tolist()]

    def next_prompt(self) -> int:
        if self.data_pos == len(self.order):
            self.data_epoch, self.data_pos = self.data_epoch + 1, 0
            self.order = self._epoch_order(self.data_epoch)
        self.data_pos += 1
        return self.order[self.data_pos - 1]

    # -- messages ---------------------------------------------------------------------------------
    def command(self, kind: str, **payload) -> None:
        """To the other train ranks (a collective on the train group)."""
        broadcast_json({"kind": kind, **payload}, src=self.groups.train_ranks[0], group=self.groups.train_group)
        self.last_command = time.monotonic()

    def grant(self) -> None:
        """Admit as many groups as the staleness bound allows, to the least-loaded rollout ranks."""
        cap = self.cfg.rollout.max_queued_groups
        grants: dict[int, list] = {}
        while self.buffer.capacity() > 0:
            rank = min(self.rollout_ranks, key=lambda r: self.outstanding[r])
            if self.outstanding[rank] >= cap:
                break
            prompt_id = self.buffer.requeued[0].prompt_id if self.buffer.requeued else None
            ticket = self.buffer.admit(prompt_id if prompt_id is not None else self.next_prompt(), rank)
            self.outstanding[rank] += 1
            grants.setdefault(rank, []).append([ticket.group_id, ticket.prompt_id])
        for rank, gs in grants.items():
            self.channel.send(rank, "grant", groups=gs)

    def handle(self, src: int, msg: dict) -> None:
        kind = msg["kind"]
        if src in self.lost_ranks:  # a dropped rank woke up: its work was re-queued already
            return
        if kind == "result":
            trajs = [Trajectory.from_dict(t) for t in msg["trajectories"]]
            self.buffer.complete(msg["group_id"], trajs)
            self.outstanding[src] -= 1
            self.counters[src] = msg["counters"]
        elif kind == "eval_result":
            ev = self.pending_eval[msg["version"]]
            ev["correct"] += sum(msg["correct"])
            ev["total"] += len(msg["correct"])
            ev["owed"][src] -= len(msg["correct"])
            self._finish_eval(msg["version"])
        elif kind == "weights_ok":
            self.note_weights_taken(src, msg["version"])
        elif kind in ("bye", "alive", "ready"):
            self.counters[src] = msg["counters"]
            if kind == "ready":
                self.ready_ranks.add(src)

    def pump(self, timeout_s: float) -> None:
        msgs = self.channel.poll(timeout_s=timeout_s)
        for src, msg in msgs:
            self.handle(src, msg)
        if not msgs and timeout_s > 0:
            silent = self.channel.silent_peers(self.cfg.dist.rollout_timeout_s)
            busy = [r for r in silent if r in self.rollout_ranks and (self.outstanding[r] > 0 or self._owes_eval(r))]
            for rank in busy:
                self.drop_rollout_rank(rank, f"silent for {self.cfg.dist.rollout_timeout_s:.0f}s")
        if time.monotonic() - self.last_command > self.cfg.dist.timeout_s / 4:
            self.command("wait")  # the other train ranks' broadcast must not time out

    def await_ready(self) -> None:
        """Rollout ranks load the model and warm up at their own pace (dist.timeout_s, like any collective);
        dist.rollout_timeout_s, the bound for a stuck rank, applies once they have said `ready`."""
        deadline = time.monotonic() + self.cfg.dist.timeout_s
        while missing := [r for r in self.rollout_ranks if r not in self.ready_ranks]:
            if time.monotonic() > deadline:
                raise PeerTimeout(missing, self.cfg.dist.timeout_s, "rollout ranks to load the model (`ready`)")
            self.pump(timeout_s=0.5)  # owes nothing yet, so nobody is dropped for silence here

    def rollout_total(self, key: str) -> float:
        """A counter summed over the rollout ranks (their latest reports)."""
        return sum(c.get(key, 0) for c in self.counters.values())

    def _owes_eval(self, rank: int) -> bool:
        return any(ev["owed"].get(rank, 0) > 0 for ev in self.pending_eval.values())

    def drop_rollout_rank(self, rank: int, why: str) -> None:
        """Continue without a stuck rollout rank: re-queue its groups, forget its eval share and weight sends."""
        if len(self.rollout_ranks) == 1:
            raise PeerTimeout([rank], self.cfg.dist.rollout_timeout_s, "rollout results (no rollout rank left)")
        self.rollout_ranks.remove(rank)
        self.lost_ranks.append(rank)
        self.channel.closed.add(rank)
        self.channel.send(rank, "abort", reason=f"dropped by the train head ({why})")  # read if it ever wakes
        requeued = self.buffer.requeue_rank(rank)
        del self.outstanding[rank]
        self.sender.forget(rank)
        for version, ev in list(self.pending_eval.items()):
            ev["expected"] -= ev["owed"].pop(rank, 0)
            self._finish_eval(version)
        print(
            f"[rank {dist.get_rank()}] warning: rollout rank {rank} {why} at step {self.buffer.version}; "
            f"re-queued groups {requeued}; continuing with rollout ranks {self.rollout_ranks}",
            file=sys.stderr,
            flush=True,
        )
        self.log.event(self.buffer.version, "rollout_rank_lost", rank=rank, reason=why, requeued=requeued)
        self.grant()

    # -- evaluation and weights -------------------------------------------------------------------
    def start_eval(self, version: int) -> None:
        self.evaluated.add(version)
        ids, n = self.test_ids, len(self.rollout_ranks)
        owed = {rank: len(ids[j::n]) for j, rank in enumerate(self.rollout_ranks)}
        self.pending_eval[version] = {"correct": 0, "total": 0, "expected": len(ids), "owed": owed}
        for j, rank in enumerate(self.rollout_ranks):
            self.channel.send(rank, "eval", version=version, prompt_ids=ids[j::n])

    def _finish_eval(self, version: int) -> None:
        ev = self.pending_eval[version]
        if ev["total"] == ev["expected"]:
            if ev["total"]:
                self.log.eval_result(version, ev["correct"] / ev["total"], ev["total"])
            del self.pending_eval[version]

    @contextlib.contextmanager
    def collective(self):
        """A collective of the train group runs inside: an error there reaches every train rank by itself, so
        abort() must not start another one. The flag is cleared only on a clean exit; after an error it stays
        set for abort()."""
        self.in_collective = True
        yield
        self.in_collective = False

    def wait_evals(self) -> None:
        while self.pending_eval:
            self.pump(timeout_s=1.0)

    def sync_weights(self, changed: bool = True) -> float:
        if changed or self.state_dict is None:
            with self.collective():
                self.state_dict = self.trainer.gather_full_state_dict()
        t0 = time.perf_counter()
        self.await_weight_receipts(self.cfg.dist.rollout_timeout_s)
        self.sender.send(
            self.channel,
            self.rollout_ranks,
            self.state_dict,
            self.buffer.version,
            self.device,
            self.cfg.dist.rollout_timeout_s,
        )
        self.buffer.weights_sent(self.buffer.version)  # only now may groups be admitted at this version
        return time.perf_counter() - t0

    def note_weights_taken(self, rank: int, version: int) -> None:
        if rank in self.weights_taken:
            self.weights_taken[rank] = max(self.weights_taken[rank], version)

    def weights_not_taken(self) -> list[int]:
        """Ranks the last version was sent to that have not acknowledged it."""
        return [
            r
            for r in self.sender.receivers_in_flight()
            if self.weights_taken.get(r, -1) < self.sender.in_flight_version
        ]

    def await_weight_receipts(self, timeout_s: float) -> None:
        """Every rank the previous version went to acknowledges it over the channel, or is dropped: never a
        timed-out wait on a gloo send, which would close the whole process group."""
        deadline = time.monotonic() + timeout_s
        while True:
            late = [r for r in self.weights_not_taken() if r in self.rollout_ranks]
            if not late:
                return
            if time.monotonic() > deadline:
                for rank in late:
                    self.drop_rollout_rank(rank, "did not receive weights in time")
                return
            self.pump(timeout_s=0.05)

    # -- one optimizer step -----------------------------------------------------------------------
    def train_on(self, batch: list) -> tuple[dict, bool]:
        """Returns (stats, updated): a batch with non-finite inputs, or whose loss or gradient turns out
        non-finite, is consumed without an update (the trainer skips the optimizer step)."""
        version = self.buffer.version - 1  # the version these trajectories are trained at
        trajs: list[Trajectory] = []
        for _ticket, group in batch:
            for t, a in zip(group, group_advantages([t.reward for t in group], self.cfg.train.advantage_eps)):
                t.advantage = a
            trajs.extend(group)
        finite_inputs = all(math.isfinite(t.advantage) and all(map(math.isfinite, t.behav_logprobs)) for t in trajs)
        t0 = time.perf_counter()
        if finite_inputs:
            self.command("train", trajectories=[t.to_dict() for t in trajs])
            with self.collective():
                stats = self.trainer.train_step(trajs)
        else:
            stats = {"loss": float("nan"), "grad_norm": float("nan"), "trained_tokens": 0.0}
        updated = finite_inputs and math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
        train_s = time.perf_counter() - t0
        self.log.ledger(trajs, version, self.buffer.version, updated)
        lags = [version - v for t in trajs for v in t.versions]
        return {
            **stats,
            "train_s": train_s,
            "nonfinite_skipped": int(not updated),
            "reward_mean": sum(t.reward for t in trajs) / len(trajs),
            "train_accuracy": sum(t.correct for t in trajs) / len(trajs),
            "staleness_max": max(lags, default=0),
            "staleness_mean": sum(lags) / max(len(lags), 1),
            "response_len_mean": sum(len(t.response_ids) for t in trajs) / len(trajs),
        }, updated

    def check_finite(self, updated: bool) -> None:
        self.nonfinite_in_a_row = 0 if updated else self.nonfinite_in_a_row + 1
        if not updated:
            limit = self.cfg.train.max_nonfinite_steps
            print(
                f"[rank {dist.get_rank()}] warning: step {self.buffer.version} had a non-finite loss or input; "
                f"update skipped ({self.nonfinite_in_a_row} in a row, limit {limit})",
                file=sys.stderr,
                flush=True,
            )
            if self.nonfinite_in_a_row >= max(limit, 1):
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} non-finite steps in a row (up to step "
                    f"{self.buffer.version}, train.max_nonfinite_steps={limit}); "
                    "lower train.lr or check the data and rewards"
                )

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Every train rank writes its shard into the temp dir, then the head completes it (checkpoint.py)."""
        self.wait_evals()  # eval lines land before the recorded log sizes
        version = self.buffer.version
        tmp = self.writer.begin(version)
        self.command("checkpoint", dir=str(tmp))
        with self.collective():
            save_train_shard(self.trainer, tmp, dist.get_rank())
            dist.barrier(group=self.groups.train_group)
        head_state = {
            "config": to_dict(self.cfg),
            "version": version,
            "buffer": self.buffer.state_dict(),
            "data_epoch": self.data_epoch,
            "data_pos": self.data_pos,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "wandb_id": self.log.wandb_id,
            "log_sizes": self.log.sizes(),
            "lost_rollout_ranks": self.lost_ranks,
        }
        self.writer.finish(tmp, version, self.state_dict, head_state)

    def run(self) -> None:
        cfg = self.cfg
        start_version = self.buffer.version
        self.await_ready()
        self.sync_weights()  # rollout ranks start bitwise equal to the trainer
        if start_version == 0 or (cfg.logging.eval_every and start_version % cfg.logging.eval_every == 0):
            self.start_eval(start_version)  # (a resumed run redoes the eval its checkpoint preceded)
            self.wait_evals()
        self.grant()
        t_start = last = time.monotonic()
        last_counters = {}
        while self.buffer.version < cfg.train.total_steps:
            if cfg.train.max_train_seconds and time.monotonic() - t_start > cfg.train.max_train_seconds:
                break
            t_wait = time.monotonic()
            while not self.buffer.ready():
                self.pump(timeout_s=0.5)
                self.grant()
            self.idle_s += time.monotonic() - t_wait
            batch = self.buffer.take()
            stats, updated = self.train_on(batch)
            sync_s = self.sync_weights(changed=updated)
            self.grant()  # capacity grew with the version
            now = time.monotonic()
            step_s, last = now - last, now
            gen_tokens = self.rollout_total("generated_tokens")
            roll_idle = [c["idle_s"] / max(c["elapsed_s"], 1e-9) for c in self.counters.values() if c]
            stats.update(
                step=self.buffer.version,
                version=self.buffer.version,
                step_s=step_s,
                weight_sync_s=sync_s,
                trained_tokens_per_s=stats["trained_tokens"] / step_s,
                generated_tokens_per_s=(gen_tokens - last_counters.get("gen", 0)) / step_s,
                rollout_idle_frac=sum(roll_idle) / max(len(roll_idle), 1),
                trainer_idle_frac=self.idle_s / max(now - t_start, 1e-9),
                reward_s=self.rollout_total("reward_s"),
                rollout_prefill_s=self.rollout_total("prefill_s"),
                rollout_prefill_tokens=self.rollout_total("prefill_tokens"),
                elapsed_s=now - t_start,
            )
            last_counters["gen"] = gen_tokens
            self.log.step(stats)
            self.check_finite(updated)
            v = self.buffer.version
            if (cfg.checkpoint.every and v % cfg.checkpoint.every == 0) or (
                cfg.checkpoint.at_end and v == cfg.train.total_steps
            ):
                self.checkpoint()
            if cfg.logging.eval_every and v % cfg.logging.eval_every == 0 and v < cfg.train.total_steps:
                self.start_eval(v)
        if self.buffer.version not in self.evaluated:
            self.start_eval(self.buffer.version)
        self.wait_evals()
        self.shutdown()
        if self.lost_ranks:
            raise RolloutRanksLost(
                f"finished at step {self.buffer.version} without rollout rank(s) "
                f"{self.lost_ranks} (stopped answering); exiting 3 so the launcher ends them"
            )

    def shutdown(self) -> None:
        self.command("stop")
        self.stopped = True
        for rank in self.rollout_ranks:
            self.channel.send(rank, "stop")
        deadline = time.monotonic() + self.cfg.dist.timeout_s
        while any(r not in self.channel.closed for r in self.rollout_ranks) and time.monotonic() < deadline:
            for src, msg in self.channel.poll(timeout_s=0.5):
                if msg["kind"] in ("result", "eval_result", "bye", "alive") and src in self.counters:
                    self.counters[src] = msg.get("counters", self.counters[src])
                elif msg["kind"] == "weights_ok":
                    self.note_weights_taken(src, msg["version"])
        for rank in self.weights_not_taken():
            self.sender.forget(rank)  # it never took the last version: do not wait on gloo for it
        self.sender.wait(self.cfg.dist.timeout_s)

    def abort(self, reason: str) -> None:
        """On an error: tell the rollout ranks (and, outside a collective, the train ranks) to exit."""
        if self.stopped:  # they have their `stop` already
            return
        for rank in self.rollout_ranks:
            self.channel.send(rank, "abort", reason=reason)
        if not self.in_collective:
            try:
                self.command("abort", reason=reason)
            except RuntimeError:  # a train rank is gone: torchrun ends the others
                pass


def run_train_follower(groups, trainer) -> None:
    """Train ranks other than the head: do what the head broadcasts."""
    head = groups.train_ranks[0]
    trainer.gather_full_state_dict()  # the head's first weight sync (a collective under TP/PP)
    while True:
        cmd = broadcast_json(None, src=head, group=groups.train_group)
        kind = cmd["kind"]
        if kind == "stop":
            return
        if kind == "abort":
            raise Aborted(cmd["reason"])
        if kind == "train":
            trainer.train_step([Trajectory.from_dict(t) for t in cmd["trajectories"]])
            trainer.gather_full_state_dict()
        elif kind == "checkpoint":
            save_train_shard(trainer, Path(cmd["dir"]), dist.get_rank())
            dist.barrier(group=groups.train_group)


# ---------------------------------------------------------------------------------------------- resume
def resolve_resume(cfg: Config, groups) -> tuple[Path | None, dict | None]:
    """Head: find the checkpoint and check its config; tell the other train ranks which one to load (or that
    resolving failed, so they stop too). Returns (checkpoint, head state)."""
    head = groups.train_ranks[0]
    if dist.get_rank() == head:
        try:
            path = find_resume(cfg)
            state = load_head_state(path, cfg) if path is not None else None
        except (CheckpointError, OSError, json.JSONDecodeError, KeyError) as e:
            broadcast_json({"error": str(e)}, src=head, group=groups.train_group)
            raise CheckpointError(str(e)) from None
        broadcast_json({"path": str(path) if path else None}, src=head, group=groups.train_group)
        return path, state
    msg = broadcast_json(None, src=head, group=groups.train_group)
    if "error" in msg:
        raise Aborted(msg["error"])
    return (Path(msg["path"]) if msg["path"] else None), None


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    cfg = load_config(argv)
    device = init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    tok, hf_config = load_tokenizer_and_config(cfg)
    plan = (
        load_plan(cfg.plan.path)
        if cfg.plan.path
        else default_plan(world, hf_config.num_hidden_layers, cfg.plan.num_rollout)
    )
    check_plan(plan, world, hf_config.num_hidden_layers)
    torch.manual_seed(cfg.train.seed)

    from parallel.groups import build_groups

    groups = build_groups(plan)  # collective: every rank, same order
    try:
        train_rows, test_rows = load_task(cfg.data, tok)
    except (DataError, OSError) as e:  # bad rows (on_bad_row=fail), missing files, no rows
        raise SetupError(f"data: {e}") from None
    head = groups.train_ranks[0]

    if groups.role == "rollout":
        from rollout import RolloutWorker

        RolloutWorker(cfg, load_policy(cfg, device), tok, train_rows, test_rows, head, device).run()
        return 0
    if rank != head:
        trainer = make_trainer(cfg, groups, device)
        checkpoint, _ = resolve_resume(cfg, groups)
        if checkpoint is not None:
            load_train_shard(trainer, checkpoint, rank, len(groups.train_ranks))
        run_train_follower(groups, trainer)
        return 0
    channel = Channel(groups.rollout_ranks)
    try:
        trainer = make_trainer(cfg, groups, device)
        checkpoint, state = resolve_resume(cfg, groups)
        if checkpoint is not None:
            load_train_shard(trainer, checkpoint, rank, len(groups.train_ranks))
        log = open_run(cfg, checkpoint, state, plan)
    except BaseException as e:
        for r in groups.rollout_ranks:
            channel.send(r, "abort", reason=str(e))
        raise
    writer = CheckpointWriter(log.dir, cfg.checkpoint.keep, tok, hf_config)
    head_loop = TrainHead(cfg, groups, trainer, train_rows, test_rows, log, device, channel, writer, state)
    try:
        head_loop.run()
    except BaseException as e:
        head_loop.abort(str(e))
        raise
    finally:
        log.close()
    return 0


def shutdown_cleanly(code: int) -> None:
    """barrier → destroy → flush → os._exit: gloo ranks importing transformers can abort at exit otherwise."""
    if dist.is_initialized():
        if code == 0:
            try:
                dist.barrier()
            except RuntimeError:  # a peer ended first (e.g. the head exiting 3): it reports why itself
                os._exit(0)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_on_error(e: BaseException) -> None:
    """One line naming the problem, then the error's exit code (2; 3 for lost rollout ranks)."""
    rank = os.environ.get("RANK", "0")
    if getattr(e, "same_on_every_rank", False) and rank != "0":
        time.sleep(5.0)  # rank 0 prints it; exiting first would make torchrun kill rank 0 mid-way
    elif not isinstance(e, Aborted):  # the head has printed why it aborted the run
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
    os._exit(getattr(e, "exit_code", 2))


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1:])
    # every concept's own error, the head's stop signal, and what library argument checks and the OS raise on
    # bad input (a trajectory the trainer cannot use, a file that cannot be read)
    except (HexrlError, Aborted, ValueError, OSError) as e:
        exit_on_error(e)
    shutdown_cleanly(code)
