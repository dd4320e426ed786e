"""hexrl: fully asynchronous PPO/GRPO across heterogeneous devices.

    torchrun --nproc_per_node=4 train.py                       # the CPU demo (exp/configs/cpu_demo.yaml)
    torchrun --nproc_per_node=N train.py config=<name> plan=plan.json max_staleness=8 train.lr=2e-5

The story of a run:
1. every rank loads the config, the tokenizer and the task, and joins the process group
   (gloo on CPU; NCCL for weights plus gloo for control on GPU);
2. the rank map (schedule.py's plan, or a default split) gives each rank a role: `rollout` ranks
   generate (rollout_worker.py), `train` ranks run the DP×TP×PP PPO trainer (parallel/);
3. the train head (train rank 0) is also the controller: it admits GRPO groups to rollout ranks under
   the staleness bound (buffer.py), collects finished groups, forms batches oldest-first, trains,
   and sends each new weight version to the rollout ranks, which apply it between decode steps;
4. metrics go to runs/<run>/metrics.jsonl (+ W&B), every consumed trajectory to ledger.jsonl;
5. every rank ends with barrier → destroy_process_group → flush → os._exit(0).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from buffer import StalenessBuffer, Trajectory, group_advantages
from config import Config, ConfigError, load_config, to_dict
from parallel.channel import Channel, PeerTimeout
from parallel.rankmap import RankMapError, check_plan, default_plan, load_plan
from parallel.weight_sync import WeightSender
from runlog import RunLog, run_directory
from tasks import load_task


class SetupError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- setup
def init_distributed(cfg: Config) -> torch.device:
    if "RANK" not in os.environ:          # plain `python train.py`: a world of one cannot split roles
        raise SetupError("launch with torchrun, e.g. `torchrun --nproc_per_node=4 train.py` "
                         "(hexrl needs at least one rollout and one train rank)")
    timeout = datetime.timedelta(seconds=cfg.plan.timeout_s)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(int(os.environ.get("HEXRL_THREADS", 1)))   # ranks share the cores
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


def load_model(cfg: Config, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=resolve_dtype(cfg, device),
                                                 attn_implementation=cfg.model.attn_implementation)
    return model.to(device).eval()


def make_trainer(cfg: Config, groups, device: torch.device):
    from parallel.trainer import Trainer, TrainerConfig

    t = cfg.train
    tcfg = TrainerConfig(lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas), eps=t.eps,
                         grad_clip=t.grad_clip or None, clip_eps=t.clip_eps,
                         behav_imp_weight_cap=t.behav_imp_weight_cap or None,
                         recompute_prox_logprobs=t.recompute_prox_logprobs, temperature=cfg.rollout.temperature or 1.0,
                         ppo_minibatches=t.ppo_minibatches, micro_batch_tokens=t.micro_batch_tokens, seed=t.seed,
                         dtype="bfloat16" if resolve_dtype(cfg, device) == torch.bfloat16 else "float32")
    return Trainer(cfg.model.path, groups, tcfg, device)


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
    """Controller + train rank 0: admission, batching, training, weight sync, evaluation, logging."""

    def __init__(self, cfg: Config, groups, trainer, train_rows: list[dict], test_rows: list[dict],
                 log: RunLog, device: torch.device):
        self.cfg, self.groups, self.trainer, self.log, self.device = cfg, groups, trainer, log, device
        self.rollout_ranks = list(groups.rollout_ranks)
        self.channel = Channel(self.rollout_ranks)
        self.buffer = StalenessBuffer(cfg.train.prompts_per_step, cfg.staleness.max_staleness)
        self.sender = WeightSender(cfg.plan.weight_bucket_mb, cfg.plan.verify_weights, cfg.plan.timeout_s)
        self.train_ids = [r["prompt_id"] for r in train_rows]
        self.test_ids = [r["prompt_id"] for r in test_rows]
        self.data_epoch, self.data_pos = 0, 0
        self.order = self._epoch_order(0)
        self.outstanding = {r: 0 for r in self.rollout_ranks}   # groups granted and not finished, per rank
        self.counters = {r: {} for r in self.rollout_ranks}     # latest counters reported by each rollout rank
        self.pending_eval: dict[int, dict] = {}                  # version -> {correct, total, expected}
        self.idle_s = 0.0
        self.consumed: list = []

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
        if kind == "result":
            trajs = [Trajectory.from_dict(t) for t in msg["trajectories"]]
            self.buffer.complete(msg["group_id"], trajs)
            self.outstanding[src] -= 1
            self.counters[src] = msg["counters"]
        elif kind == "eval_result":
            ev = self.pending_eval[msg["version"]]
            ev["correct"] += sum(msg["correct"])
            ev["total"] += len(msg["correct"])
            if ev["total"] == ev["expected"]:
                self.log.eval(msg["version"], ev["correct"] / ev["total"], ev["total"])
                del self.pending_eval[msg["version"]]
        elif kind == "bye":
            self.counters[src] = msg["counters"]

    def pump(self, timeout_s: float) -> None:
        msgs = self.channel.poll(timeout_s=timeout_s)
        for src, msg in msgs:
            self.handle(src, msg)
        if not msgs and timeout_s > 0:
            silent = self.channel.silent_peers(self.cfg.plan.rollout_timeout_s)
            busy = [r for r in silent if self.outstanding[r] > 0 or self._evaluating(r)]
            if busy:
                raise PeerTimeout(busy, self.cfg.plan.rollout_timeout_s, "rollout results")

    def _evaluating(self, rank: int) -> bool:
        return bool(self.pending_eval)

    # -- evaluation and weights -------------------------------------------------------------------
    def start_eval(self, version: int) -> None:
        ids, n = self.test_ids, len(self.rollout_ranks)
        self.pending_eval[version] = {"correct": 0, "total": 0, "expected": len(ids)}
        for j, rank in enumerate(self.rollout_ranks):
            self.channel.send(rank, "eval", version=version, prompt_ids=ids[j::n])

    def wait_evals(self) -> None:
        while self.pending_eval:
            self.pump(timeout_s=1.0)

    def sync_weights(self) -> float:
        state_dict = self.trainer.gather_full_state_dict()
        return self.sender.send(self.channel, self.rollout_ranks, state_dict, self.buffer.version, self.device)

    # -- one optimizer step -----------------------------------------------------------------------
    def train_on(self, batch: list) -> dict:
        version = self.buffer.version - 1            # the version these trajectories are trained at
        trajs: list[Trajectory] = []
        for ticket, group in batch:
            for t, a in zip(group, group_advantages([t.reward for t in group], self.cfg.train.advantage_eps)):
                t.advantage = a
            trajs.extend(group)
        broadcast_json({"kind": "train", "trajectories": [t.to_dict() for t in trajs]},
                       src=self.groups.train_ranks[0], group=self.groups.train_group)
        t0 = time.perf_counter()
        stats = self.trainer.train_step(trajs)
        train_s = time.perf_counter() - t0
        self.log.ledger(trajs, version, self.buffer.version)
        lags = [version - v for t in trajs for v in t.versions]
        return {**stats, "train_s": train_s, "reward_mean": sum(t.reward for t in trajs) / len(trajs),
                "train_accuracy": sum(t.correct for t in trajs) / len(trajs),
                "staleness_max": max(lags, default=0), "staleness_mean": sum(lags) / max(len(lags), 1),
                "response_len_mean": sum(len(t.response_ids) for t in trajs) / len(trajs)}

    def run(self) -> None:
        cfg = self.cfg
        self.sync_weights()                           # rollout ranks start bitwise equal to the trainer
        self.start_eval(self.buffer.version)
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
            stats = self.train_on(batch)
            sync_s = self.sync_weights()
            self.grant()                              # capacity grew with the version
            now = time.monotonic()
            step_s, last = now - last, now
            gen_tokens = sum(c.get("generated_tokens", 0) for c in self.counters.values())
            roll_idle = [c["idle_s"] / max(c["elapsed_s"], 1e-9) for c in self.counters.values() if c]
            stats.update(step=self.buffer.version, version=self.buffer.version, step_s=step_s, weight_sync_s=sync_s,
                         trained_tokens_per_s=stats["trained_tokens"] / step_s,
                         generated_tokens_per_s=(gen_tokens - last_counters.get("gen", 0)) / step_s,
                         rollout_idle_frac=sum(roll_idle) / max(len(roll_idle), 1),
                         trainer_idle_frac=self.idle_s / max(now - t_start, 1e-9),
                         reward_s=sum(c.get("reward_s", 0.0) for c in self.counters.values()),
                         elapsed_s=now - t_start)
            last_counters["gen"] = gen_tokens
            self.log.step(stats)
            if cfg.logging.eval_every and self.buffer.version % cfg.logging.eval_every == 0 \
                    and self.buffer.version < cfg.train.total_steps:
                self.start_eval(self.buffer.version)
        if self.buffer.version not in self.pending_eval:
            self.start_eval(self.buffer.version)
        self.wait_evals()
        self.shutdown()

    def shutdown(self) -> None:
        broadcast_json({"kind": "stop"}, src=self.groups.train_ranks[0], group=self.groups.train_group)
        for rank in self.rollout_ranks:
            self.channel.send(rank, "stop")
        deadline = time.monotonic() + self.cfg.plan.timeout_s
        while len(self.channel.closed) < len(self.rollout_ranks) and time.monotonic() < deadline:
            for src, msg in self.channel.poll(timeout_s=0.5):
                if msg["kind"] in ("result", "eval_result", "bye"):
                    self.counters[src] = msg.get("counters", self.counters[src])
        self.sender.wait(self.cfg.plan.timeout_s)


def run_train_follower(groups, trainer) -> None:
    """Train ranks other than the head: do what the head broadcasts."""
    head = groups.train_ranks[0]
    while True:
        cmd = broadcast_json(None, src=head, group=groups.train_group)
        if cmd["kind"] == "stop":
            return
        trainer.train_step([Trajectory.from_dict(t) for t in cmd["trajectories"]])
        trainer.gather_full_state_dict()


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    cfg = load_config(argv)
    device = init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    tok, hf_config = load_tokenizer_and_config(cfg)
    plan = load_plan(cfg.plan.path) if cfg.plan.path else \
        default_plan(world, hf_config.num_hidden_layers, cfg.plan.num_rollout)
    check_plan(plan, world, hf_config.num_hidden_layers)
    torch.manual_seed(cfg.train.seed)

    from parallel.groups import build_groups
    groups = build_groups(plan)                      # collective: every rank, same order
    train_rows, test_rows = load_task(cfg.data, tok)
    head = groups.train_ranks[0]

    if groups.role == "rollout":
        from rollout_worker import RolloutWorker
        RolloutWorker(cfg, load_model(cfg, device), tok, train_rows, test_rows, head, device).run()
    else:
        trainer = make_trainer(cfg, groups, device)
        if rank == head:
            run_dir = run_directory(cfg)
            log = RunLog(cfg, run_dir, plan)
            TrainHead(cfg, groups, trainer, train_rows, test_rows, log, device).run()
            log.close()
        else:
            run_train_follower(groups, trainer)
    return 0


def shutdown_cleanly(code: int) -> None:
    """barrier → destroy → flush → os._exit: gloo ranks importing transformers can abort at exit otherwise."""
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1:])
    except (ConfigError, RankMapError, SetupError, PeerTimeout, ValueError) as e:
        rank = os.environ.get("RANK", "0")
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    shutdown_cleanly(code)
