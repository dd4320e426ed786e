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

import cpu_bench
from buffer import StalenessBuffer, Trajectory, group_advantages, overlong_penalty, zero_variance
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
from errors import HexrlError, SetupError
from head import Admission, DataOrder, EvalBook, NonFiniteGuard, RolloutPool, StepMetrics, WeightAcks
from parallel import sync_layout
from parallel.channel import Aborted, Channel, PeerTimeout
from parallel.trajectories import PackedGroup, TrajectoryInbox, batch_control, broadcast_batch, pack, receive_batch
from parallel.weight_sync import bucket_meta, plan_version, send_version, weights_message
from plan import (
    PlanError,
    all_gather_json,
    check_launch,
    check_plan,
    default_plan,
    device_name,
    layout_mismatches,
    layout_record,
    load_plan,
)
from runlog import RunLog
from tasks import DataError, load_task


class RolloutRanksLost(HexrlError, RuntimeError):
    """The run finished without some rollout ranks; exit 3 so the launcher reclaims the stuck processes."""

    exit_code = 3


# ---------------------------------------------------------------------------------------------- setup
def launched_world_size() -> int:
    """The launcher's world size (torchrun sets RANK and WORLD_SIZE for every rank)."""
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one cannot split roles
        raise SetupError(
            "launch with torchrun, e.g. `torchrun --nproc_per_node=4 train.py` "
            "(hexrl needs at least one rollout and one train rank)"
        )
    return int(os.environ["WORLD_SIZE"])


def init_distributed(cfg: Config) -> torch.device:
    timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
    if torch.cuda.is_available() and cfg.dist.colocate:  # ranks share GPUs: NCCL would refuse, so gloo for all
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", timeout=timeout)
        return device
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():  # NCCL refuses two ranks on one GPU
            raise SetupError(
                f"local rank {local} has no GPU of its own: {torch.cuda.device_count()} visible on this "
                f"node; hexrl runs one rank per GPU (--nproc_per_node=<GPUs per node>), or several with "
                "dist.colocate=true"
            )
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(int(os.environ.get("HEXRL_THREADS", 1)))  # ranks share the cores
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def share_device(cfg: Config, groups, device: torch.device) -> None:
    """Colocated mode on a GPU: cap this role's process at its share of the device. gloo runs all_reduce and
    broadcast on CUDA tensors but not the trainer's gathers, reduce-scatters and pipeline sends, nor a TP replica's
    gathers: the colocated GPU mode takes one train rank and single-GPU replicas (on CPU any layout runs)."""
    if device.type != "cuda":
        return
    # the groups as built: a plan without a rollout section has one single-rank replica per rollout rank
    if groups.dp * groups.tp * groups.pp > 1 or any(r.tp > 1 for r in groups.replicas):
        raise SetupError(
            "dist.colocate on a GPU runs every group on gloo, which cannot gather CUDA tensors: it needs one train "
            f"rank (this plan: dp={groups.dp} tp={groups.tp} pp={groups.pp}) and rollout replicas of TP 1"
        )
    fraction = {"train": cfg.dist.train_memory_fraction, "rollout": cfg.dist.rollout_memory_fraction}.get(groups.role)
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def weight_handover(cfg: Config) -> str:
    """How owners hand weight buckets to rollout relays (parallel/weight_sync.py): in shared memory when every rank
    is on this host (dist.colocate), over the process group otherwise."""
    if cfg.dist.handover == "auto":
        return "shared" if cfg.dist.colocate else "wire"
    return cfg.dist.handover


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def check_model_path(path: str) -> None:
    local = Path(path)
    if (local.is_absolute() or path.startswith(".") or path.startswith("exp/")) and not local.exists():
        raise SetupError(f"model.path '{path}' does not exist")


def model_num_layers(cfg: Config) -> int:
    """The model's layer count for the plan checks, from a local model directory's config.json where it names it:
    transformers is not imported yet (seconds a rank), so a launch with a bad plan stops early."""
    check_model_path(cfg.model.path)
    try:
        return int(json.loads((Path(cfg.model.path) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return load_tokenizer_and_config(cfg)[1].num_hidden_layers


def load_tokenizer_and_config(cfg: Config):
    from transformers import AutoConfig, AutoTokenizer

    path = cfg.model.path
    check_model_path(path)
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
    """The train rank's Trainer."""
    from parallel.trainer import Trainer

    # temperature 0 is greedy sampling, whose tokens are scored under the untempered policy
    temperature = cfg.rollout.temperature or 1.0
    # the trainer computes in bf16 or fp32 (an fp16 rollout model still trains in fp32)
    compute_dtype = torch.bfloat16 if resolve_dtype(cfg, device) == torch.bfloat16 else torch.float32
    trainer = Trainer(cfg.model.path, groups, cfg.train, device, temperature=temperature, compute_dtype=compute_dtype)
    return trainer


def broadcast_json(obj, src: int, group) -> dict:
    """Small documents from the train head to all train ranks (commands; a batch's trajectories follow packed)."""
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
    """Controller + train rank 0: a loop over its bookkeeping (below TrainHead) that talks to the rollout ranks
    over the channel and to the train followers through train-group broadcasts."""

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
        self.buffer = StalenessBuffer(
            cfg.train.prompts_per_step, cfg.staleness.max_staleness, consume_order=cfg.staleness.consume_order
        )
        self.data = DataOrder([r["prompt_id"] for r in train_rows], cfg.data.seed)
        self.nonfinite = NonFiniteGuard(cfg.train.max_nonfinite_steps)
        if resumed is not None:  # everything else starts afresh (counters, timings)
            self.buffer = StalenessBuffer.from_state_dict(resumed["buffer"])
            self.data = DataOrder(self.data.prompt_ids, cfg.data.seed, resumed["data_epoch"], resumed["data_pos"])
            self.nonfinite.in_a_row = resumed["nonfinite_in_a_row"]
        self.pool = RolloutPool(groups.replicas)
        self.weight_acks = WeightAcks()
        self.admission = Admission(self.buffer, self.data, self.pool, cfg.rollout.max_queued_groups)
        self.evals = EvalBook([r["prompt_id"] for r in test_rows])
        self.metrics = StepMetrics()
        self.inbox = TrajectoryInbox()  # receives posted for the groups rollout leaders announced
        self.sync_dtype = resolve_dtype(cfg, device)  # weights travel in the rollout model's compute dtype
        self.bucket_bytes = int(cfg.dist.weight_bucket_mb * 2**20)
        self.sync_bytes = self.sync_predicted_bytes = 0  # this version's, for its metrics line
        self.resynced: dict[int, int] = {}  # leader -> the version last re-sent to it after a failed relay
        self._sync_layout: dict | None = None
        self.resync_wanted: set[int] = set()
        self.discarded = 0  # groups dropped by dynamic sampling since the last step
        self.training_done = False  # after the last step groups are left as they are (in the buffer, not dropped)
        self.in_collective = False  # an error there reaches every train rank itself
        self.last_command = time.monotonic()
        self.stopped = False

    @property
    def rollout_ranks(self) -> list[int]:
        return self.pool.live

    # -- messages ---------------------------------------------------------------------------------
    def command(self, kind: str, **payload) -> None:
        """To the other train ranks (a collective on the train group)."""
        broadcast_json({"kind": kind, **payload}, src=self.groups.train_ranks[0], group=self.groups.train_group)
        self.last_command = time.monotonic()

    def rewards(self, group) -> list[float]:
        """What the advantages see: the scorer's rewards, plus DAPO's overlong penalty (train.overlong)."""
        t, r = self.cfg.train, self.cfg.rollout
        extra = t.overlong == "penalty"
        return [
            x.reward
            + (overlong_penalty(len(x.response_ids), r.max_new_tokens, t.overlong_buffer_tokens) if extra else 0.0)
            for x in group
        ]

    def drops_group(self, group) -> bool:
        """Dynamic sampling (train.dynamic_sampling_max_discards): a group whose rewards are all equal has zero
        advantages -- no signal -- and is dropped, up to the per-step limit (then trained: no step waits forever
        on a policy that solves, or fails, everything)."""
        limit = self.cfg.train.dynamic_sampling_max_discards
        done = self.training_done or self.buffer.version >= self.cfg.train.total_steps
        return not done and self.discarded < limit and zero_variance(self.rewards(group))

    def send_grants(self) -> None:
        """Send each rollout rank the groups admitted for it (head.Admission: as many as the staleness bound and
        the rank's queue allow); a `grant` message names them."""
        for rank, groups in self.admission.grants().items():
            self.channel.send(rank, "grant", groups=groups)

    def on_message(self, src: int, msg: dict) -> None:
        """One message from a rollout rank (rollout.py's docstring lists them)."""
        kind = msg["kind"]
        if src in self.pool.lost:  # a dropped rank woke up: its work was re-queued already
            return
        if kind == "result":  # packed, on its way: post the receive, wait for it once delivered (no deadline)
            try:
                self.inbox.expect(src, msg["group_id"], msg["nbytes"])
            except RuntimeError as e:  # it died after announcing the group: its connection is closed already
                self.drop_rollout_rank(src, f"closed its connection ({str(e).splitlines()[0][:100]})")
                return
            self.channel.send(src, "fetch", group_id=msg["group_id"])
        elif kind == "delivered":
            group = self.inbox.take(src, msg["group_id"])
            self.pool.finished(src)
            if self.drops_group(group):
                self.buffer.discard(msg["group_id"])
                self.discarded += 1
                self.log.ledger(list(group), None, self.buffer.version, updated=False, dropped="zero_variance")
                self.send_grants()  # its slot is refilled with a new group
            else:
                self.buffer.complete(msg["group_id"], group)
        elif kind == "eval_result":
            self.log_evals(self.evals.record(msg["version"], src, msg["correct"]))
        elif kind == "weights_ok":
            self.weight_acks.acked(msg["version"], src)
            # A machine-mate it relays to did not take them: a lost mate, or a live one that gave up on this relay
            # while it waited on a stopped sibling (their link then fails both ways). Either way the owners send it the
            # version straight, as to a mate whose relay failed, and their deadline says whether it is lost.
            for mate in msg.get("failed", {}):
                if int(mate) in self.pool.live:
                    self.resync_wanted.add(int(mate))
        elif kind == "weights_failed":  # its relay never delivered: straight from the owners, unless done already
            self.resync_wanted.add(src)
        elif kind == "ready":
            self.pool.ready.add(src)
        if "counters" in msg:
            self.pool.report(src, msg["counters"])

    def poll_messages(self, timeout_s: float) -> None:
        """Handle what the rollout ranks sent (waiting up to `timeout_s` for the first), re-send a version a replica
        missed, drop ranks silent past their deadline, and keep the train followers' broadcast alive."""
        msgs = self.channel.poll(timeout_s=timeout_s)
        for src, msg in msgs:
            self.on_message(src, msg)
        if self.resync_wanted:
            wanted = [r for r in self.resync_wanted if r in self.pool.live and self.resynced.get(r) != self.version]
            self.resync_wanted.clear()
            if wanted:
                self.sync_weights(targets=wanted)
        if not msgs and timeout_s > 0:
            timeout = self.cfg.dist.rollout_timeout_s
            for rank in self.pool.stuck(self.channel.silent_peers(timeout), self.evals.owes):
                self.drop_rollout_rank(rank, f"silent for {timeout:.0f}s")
        if time.monotonic() - self.last_command > self.cfg.dist.timeout_s / 4:
            self.command("wait")  # the other train ranks' broadcast must not time out

    def await_ready(self) -> None:
        """Rollout ranks load the model and warm up at their own pace (dist.timeout_s, like any collective);
        dist.rollout_timeout_s, the bound for a stuck rank, applies once they have said `ready`."""
        deadline = time.monotonic() + self.cfg.dist.timeout_s
        while missing := self.pool.not_ready():
            if time.monotonic() > deadline:
                raise PeerTimeout(missing, self.cfg.dist.timeout_s, "rollout ranks to load the model (`ready`)")
            self.poll_messages(timeout_s=0.5)  # owes nothing yet, so nobody is dropped for silence here

    def drop_rollout_rank(self, rank: int, why: str) -> None:
        """Continue without a stuck rollout rank: re-queue its groups, forget its eval share and weight sends."""
        if len(self.pool.live) == 1:
            raise PeerTimeout([rank], self.cfg.dist.rollout_timeout_s, "rollout results (no rollout rank left)")
        self.pool.drop(rank)
        self.weight_acks.drop(rank)
        self.channel.closed.add(rank)
        self.channel.send(rank, "abort", reason=f"dropped by the train head ({why})")  # read if it ever wakes
        requeued = self.buffer.requeue_rank(rank)
        self.log_evals(self.evals.drop_rank(rank))
        print(
            f"[rank {dist.get_rank()}] warning: rollout rank {rank} {why} at step {self.buffer.version}; "
            f"re-queued groups {requeued}; continuing with rollout ranks {self.pool.live}",
            file=sys.stderr,
            flush=True,
        )
        self.log.event(self.buffer.version, "rollout_rank_lost", rank=rank, reason=why, requeued=requeued)
        self.send_grants()

    # -- evaluation and weights -------------------------------------------------------------------
    def start_eval(self, version: int) -> None:
        for rank, prompt_ids in self.evals.start(version, self.pool.live).items():
            self.channel.send(rank, "eval", version=version, prompt_ids=prompt_ids)
        self.log_evals(self.evals.finished())  # an empty test set finishes at once

    def log_evals(self, results: list[tuple[int, float, int]]) -> None:
        for version, accuracy, total in results:
            self.log.eval_result(version, accuracy, total)

    def wait_evals(self) -> None:
        while self.evals.pending:
            self.poll_messages(timeout_s=1.0)

    @contextlib.contextmanager
    def collective(self):
        """A collective of the train group runs inside: an error there reaches every train rank by itself, so
        abort() must not start another one. The flag is cleared only on a clean exit; after an error it stays
        set for abort()."""
        self.in_collective = True
        yield
        self.in_collective = False

    @property
    def version(self) -> int:
        return self.buffer.version

    def sync_layout(self) -> dict:
        """The part of every `weights` message that is the same for all leaders and versions."""
        if self._sync_layout is None:
            itemsize = torch.empty((), dtype=self.sync_dtype).element_size()
            buckets = self.trainer.sync_buckets(itemsize, self.bucket_bytes)
            self._sync_layout = {
                "buckets": [bucket_meta(b, self.trainer.full_shapes, self.sync_dtype) for b in buckets],
                "verify": self.cfg.dist.verify_weights,
                "handover": weight_handover(self.cfg),
            }
            # the planner's number for this schedule: the buckets of the model's config, not the trainer's own
            spec = sync_layout.hf_shape(self.trainer.hf_config.to_dict())
            stages = [tuple(x) for x in self.groups.stage_layers]
            self.planned_buckets = sync_layout.sync_buckets(
                sync_layout.hf_param_table(spec), stages, itemsize, self.bucket_bytes
            )
        return self._sync_layout

    def sync_weights(self, changed: bool = True, targets: list[int] | None = None) -> float:
        """Send this version's weights to every live replica (or re-send them to `targets`), streamed from the train
        ranks (parallel/weight_sync.py). A relay that fails is dropped, and the machine-mates it relayed to get the
        version again straight from the owners. Groups may be admitted at this version only afterwards."""
        t0 = time.perf_counter()
        version = self.version
        if targets is None:
            self.sync_bytes = self.sync_predicted_bytes = 0
        leaders = list(targets or self.pool.live)
        if targets is None:
            self.weight_acks.started(version, leaders)
        if not changed and targets is None:  # a skipped update: same weights, new version number
            for leader in leaders:
                self.channel.send(leader, "weights", version=version, buckets=[])
        else:
            layout = self.sync_layout()
            paths, senders = plan_version(leaders, self.groups)
            for leader in paths:
                extra = weights_message(leader, paths, senders, self.groups)
                self.channel.send(leader, "weights", version=version, **layout, **extra)
            if targets is None:
                self.sync_predicted_bytes = sync_layout.sync_bytes_sent(self.planned_buckets, len(senders))
            args = {"senders": senders, "dtype": str(self.sync_dtype), "bucket_bytes": self.bucket_bytes}
            args["timeout_s"], args["verify"] = self.cfg.dist.rollout_timeout_s, self.cfg.dist.verify_weights
            args["handover"] = weight_handover(self.cfg)
            self.command("sync", args=args)
            with self.collective():
                failed, sent = self.stream_version(args)
            self.sync_bytes += sent
            for rank in failed:
                if rank in self.pool.live:
                    self.drop_rollout_rank(rank, "did not take its weights in time")
            orphans = [r for r, (source, _) in paths.items() if source in failed and r in self.pool.live]
            for r in orphans:
                self.resynced[r] = version
            if orphans:
                self.sync_weights(targets=orphans)
        if targets is None:
            self.buffer.weights_sent(version)  # only now may groups be admitted at this version
        return time.perf_counter() - t0

    def stream_version(self, args: dict) -> tuple[list[int], int]:
        """The head's part of streaming a version from the train ranks (parallel/weight_sync.py): (the relays that
        failed, bytes sent)."""
        return send_version(self.trainer, **{**args, "dtype": self.sync_dtype})

    # -- one optimizer step -----------------------------------------------------------------------
    def train_on(self, batch: list) -> tuple[dict, bool]:
        """Returns (stats, updated): a batch with non-finite inputs, or whose loss or gradient turns out
        non-finite, is consumed without an update (the trainer skips the optimizer step)."""
        version = self.buffer.version - 1  # the version these trajectories are trained at
        trajs: list[Trajectory] = []
        for _ticket, group in batch:
            for t, a in zip(group, group_advantages(self.rewards(group), self.cfg.train.advantage_eps)):
                t.advantage = a
            trajs.extend(group)
        finite_inputs = all(math.isfinite(t.advantage) and all(map(math.isfinite, t.behav_logprobs)) for t in trajs)
        t0 = time.perf_counter()
        if finite_inputs:  # the groups' bytes as they arrived (groups restored from a checkpoint: packed now)
            packed = [group.packed if isinstance(group, PackedGroup) else pack(group) for _ticket, group in batch]
            advantages = [t.advantage for t in trajs]
            self.command("train", **batch_control(packed, advantages))
            with self.collective():
                broadcast_batch(packed, advantages, src=self.groups.train_ranks[0], group=self.groups.train_group)
                stats = self.trainer.train_step(trajs)
        else:
            stats = {"loss": float("nan"), "grad_norm": float("nan"), "trained_tokens": 0.0}
        updated = finite_inputs and math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
        self.log.ledger(trajs, version, self.buffer.version, updated)
        stats = {**stats, "train_s": time.perf_counter() - t0, "nonfinite_skipped": int(not updated)}
        return {**stats, **StepMetrics.batch(trajs, version)}, updated

    def check_finite(self, updated: bool) -> None:
        self.nonfinite.record(updated, self.buffer.version)

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Every train rank writes its shard into the temp dir, then the head completes it (checkpoint.py)."""
        self.wait_evals()  # eval lines land before the recorded log sizes
        version = self.buffer.version
        tmp = self.writer.begin(version)
        self.command("checkpoint", dir=str(tmp))
        with self.collective():
            save_train_shard(self.trainer, tmp, dist.get_rank())
            full = self.trainer.gather_full_state_dict()  # the HF export of this version (fp32, on the head)
            dist.barrier(group=self.groups.train_group)
        head_state = {
            "config": to_dict(self.cfg),
            "version": version,
            "buffer": self.buffer.state_dict(),
            **self.data.state_dict(),
            "nonfinite_in_a_row": self.nonfinite.in_a_row,
            "wandb_id": self.log.wandb_id,
            "log_sizes": self.log.sizes(),
            "lost_rollout_ranks": self.pool.lost,
        }
        self.writer.finish(tmp, version, full, head_state)

    def run(self) -> None:
        """The loop, and on any error an `abort` to every other rank (none of them waits forever)."""
        try:
            self.loop()
        except BaseException as e:
            self.abort(str(e))
            raise
        finally:
            self.log.close()

    def loop(self) -> None:
        cfg = self.cfg
        start_version = self.buffer.version
        replicas = ", ".join(f"{r.id}: ranks {r.ranks} share {r.share:.3f}" for r in self.groups.replicas)
        print(f"hexrl: rollout replicas {replicas}; idle ranks {self.groups.idle_ranks}", flush=True)
        self.await_ready()
        self.sync_weights()  # rollout ranks start bitwise equal to the trainer
        if start_version == 0 or (cfg.logging.eval_every and start_version % cfg.logging.eval_every == 0):
            self.start_eval(start_version)  # (a resumed run redoes the eval its checkpoint preceded)
            self.wait_evals()
        self.send_grants()
        self.metrics.start()
        while self.buffer.version < cfg.train.total_steps:
            if cfg.train.max_train_seconds and self.metrics.elapsed_s() > cfg.train.max_train_seconds:
                break
            t_wait = time.monotonic()
            while not self.buffer.ready():
                self.poll_messages(timeout_s=0.5)
                self.send_grants()
            self.metrics.trainer_idle(time.monotonic() - t_wait)
            batch = self.buffer.take()
            stats, updated = self.train_on(batch)
            stats["dropped_groups"], self.discarded = self.discarded, 0
            sync_s = self.sync_weights(changed=updated)
            self.send_grants()  # capacity grew with the version
            sync = {
                "weight_sync_bytes": self.sync_bytes,
                "weight_sync_predicted_bytes": self.sync_predicted_bytes,
                "weight_sync_dtype": str(self.sync_dtype).removeprefix("torch."),
                "weight_sync_handover": weight_handover(self.cfg),
            }
            if self.weight_acks.ready_s is not None:  # the last version every replica took, end to end
                sync["weight_ready_s"] = self.weight_acks.ready_s
            self.log.step(self.metrics.step(stats, self.buffer.version, sync_s, self.pool, sync))
            self.check_finite(updated)
            v = self.buffer.version
            if (cfg.checkpoint.every and v % cfg.checkpoint.every == 0) or (
                cfg.checkpoint.at_end and v == cfg.train.total_steps
            ):
                self.checkpoint()
            if cfg.logging.eval_every and v % cfg.logging.eval_every == 0 and v < cfg.train.total_steps:
                self.start_eval(v)
        self.training_done = True
        if self.buffer.version not in self.evals.started:
            self.start_eval(self.buffer.version)
        self.wait_evals()
        self.shutdown()
        if self.pool.lost:
            raise RolloutRanksLost(
                f"finished at step {self.buffer.version} without rollout rank(s) "
                f"{self.pool.lost_ranks()} (stopped answering); exiting 3 so the launcher ends them"
            )

    def shutdown(self) -> None:
        self.command("stop")
        self.stopped = True
        for rank in self.pool.live + self.groups.idle_ranks:
            self.channel.send(rank, "stop")
        deadline = time.monotonic() + self.cfg.dist.timeout_s
        while any(r not in self.channel.closed for r in self.pool.live) and time.monotonic() < deadline:
            for src, msg in self.channel.poll(timeout_s=0.5):
                if "counters" in msg:
                    self.pool.report(src, msg["counters"])

    def abort(self, reason: str) -> None:
        """On an error: tell the rollout ranks (and, outside a collective, the train ranks) to exit."""
        if self.stopped:  # they have their `stop` already
            return
        for rank in self.pool.live + self.groups.idle_ranks:
            self.channel.send(rank, "abort", reason=reason)
        if not self.in_collective:
            try:
                self.command("abort", reason=reason)
            except RuntimeError:  # a train rank is gone: torchrun ends the others
                pass


class TrainFollower:
    """A train rank other than the head: does what the head broadcasts."""

    def __init__(self, groups, trainer):
        self.groups, self.trainer = groups, trainer

    def run(self) -> None:
        groups, trainer, head = self.groups, self.trainer, self.groups.train_ranks[0]
        while True:
            cmd = broadcast_json(None, src=head, group=groups.train_group)
            kind = cmd["kind"]
            if kind == "stop":
                return
            if kind == "abort":
                raise Aborted(cmd["reason"])
            if kind == "train":
                batch = receive_batch(cmd, head, groups.train_group)  # a wait on the head, not work
                trainer.train_step(batch)
            elif kind == "sync":
                dtype = getattr(torch, cmd["args"]["dtype"].split(".")[-1])
                send_version(trainer, **{**cmd["args"], "dtype": dtype})
            elif kind == "checkpoint":
                save_train_shard(trainer, Path(cmd["dir"]), dist.get_rank())
                trainer.gather_full_state_dict()
                dist.barrier(group=groups.train_group)


def wait_idle(head: int) -> None:
    """A rank the plan leaves idle (no replica fits it) joins the process groups, then waits for the end."""
    print(f"[rank {dist.get_rank()}] idle: the plan gives this rank no role", file=sys.stderr, flush=True)
    channel = Channel([head])
    while True:
        for _, msg in channel.poll(timeout_s=1.0):
            if msg["kind"] == "stop":
                return
            if msg["kind"] == "abort":
                raise Aborted(msg["reason"])


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
    world = launched_world_size()
    num_layers = model_num_layers(cfg)
    plan = load_plan(cfg.plan.path) if cfg.plan.path else default_plan(world, num_layers, cfg.plan.num_rollout)
    check_plan(plan, world, num_layers)  # each rank alone, before it connects: a bad plan stops no rank mid-handshake
    device = init_distributed(cfg)
    rank = dist.get_rank()
    check_launch(plan, device, os.environ)  # collective: each rank is where the plan put it, or every rank stops
    tok, hf_config = load_tokenizer_and_config(cfg)
    torch.manual_seed(cfg.train.seed)

    from parallel.groups import build_groups

    groups = build_groups(plan, mate_timeout_s=cfg.dist.rollout_timeout_s / 2)  # collective: every rank, same order
    layout = all_gather_json(layout_record(plan, os.environ, device_name(device), groups.what_runs()))
    if problems := layout_mismatches(plan, layout, any_device=True):  # the groups run something else than planned
        raise PlanError(f"the process groups do not run the plan: {problems[0]}")
    try:
        prompt_limit = min(cfg.data.max_prompt_tokens, cfg.rollout.max_seq_len - cfg.rollout.max_new_tokens)
        train_rows, test_rows = load_task(cfg.data, tok, prompt_limit)
    except (DataError, OSError) as e:  # bad rows (on_bad_row=fail), missing files, no rows
        raise SetupError(f"data: {e}") from None
    head = groups.train_ranks[0]
    if cfg.dist.colocate:
        share_device(cfg, groups, device)

    if groups.role == "idle":
        wait_idle(head)
        return 0
    if groups.role == "rollout":
        role = make_rollout_worker(cfg, groups, device, tok, train_rows, test_rows)
    elif rank != head:
        role = TrainFollower(groups, load_trainer(cfg, groups, device)[0])
    else:
        role = start_head(cfg, groups, device, tok, hf_config, train_rows, test_rows, plan, layout)
    cpu_bench.wrap_rank(plan, rank, role)  # a rank of an emulated device type runs at its fraction of this machine
    role.run()
    return 0


def make_rollout_worker(cfg: Config, groups, device: torch.device, tok, train_rows, test_rows):
    """A rank of a rollout replica: the policy on its device and the rank's loop (rollout.py)."""
    from parallel.replica import ReplicaLink
    from rollout import RolloutWorker

    replica = groups.replica
    link = ReplicaLink(replica.group, replica.ranks, device) if replica.tp > 1 else None
    policy = load_policy(cfg, device)
    head = groups.train_ranks[0]
    return RolloutWorker(cfg, policy, tok, train_rows, test_rows, head, device, link, groups.weight_links)


def load_trainer(cfg: Config, groups, device: torch.device):
    """A train rank's Trainer, resumed from the run's checkpoint if there is one: (trainer, checkpoint, head state)."""
    trainer = make_trainer(cfg, groups, device)
    checkpoint, state = resolve_resume(cfg, groups)
    if checkpoint is not None:
        load_train_shard(trainer, checkpoint, dist.get_rank(), len(groups.train_ranks))
    return trainer, checkpoint, state


def start_head(cfg: Config, groups, device: torch.device, tok, hf_config, train_rows, test_rows, plan, layout):
    """The train head: its trainer, the run directory, the checkpoint writer. A failure here tells every other rank
    to stop, since none of them waits on anything but the head."""
    channel = Channel(groups.rollout_ranks)
    try:
        trainer, checkpoint, state = load_trainer(cfg, groups, device)
        log = open_run(cfg, checkpoint, state, plan)
        (log.dir / "layout.json").write_text(json.dumps(layout, indent=1))  # what ran, rank by rank
    except BaseException as e:
        for r in groups.rollout_ranks + groups.idle_ranks:
            channel.send(r, "abort", reason=str(e))
        raise
    writer = CheckpointWriter(log.dir, cfg.checkpoint.keep, tok, hf_config)
    return TrainHead(cfg, groups, trainer, train_rows, test_rows, log, device, channel, writer, state)


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
    """One line naming the problem, then the error's exit code (2; 3 for lost rollout ranks). An error every rank
    meets alike is printed once per node, by its local rank 0."""
    rank = os.environ.get("RANK", "0")
    if getattr(e, "same_on_every_rank", False) and os.environ.get("LOCAL_RANK", "0") != "0":
        time.sleep(5.0)  # local rank 0 prints it; exiting first would make torchrun kill it mid-way
        os._exit(getattr(e, "exit_code", 2))
    if not isinstance(e, Aborted):  # the head has printed why it aborted the run
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
    if os.environ.get("GROUP_RANK", "0") == "0" and os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
        # node 0's agent hosts the rendezvous store when node 0 is the endpoint's machine (exp/multi_node_cpu.sh pins
        # it with is_host): leaving at once would cut the other nodes' agents off before they see their ranks' codes
        time.sleep(2.0)
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
