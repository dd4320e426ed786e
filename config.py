"""One typed config tree for hexrl, loaded from exp/configs/<name>.yaml and overridden by `key.sub=value`.

    python train.py                                  # exp/configs/cpu_demo.yaml
    torchrun ... train.py config=gpu_r1_1.5b train.lr=2e-5 max_staleness=8 plan=plan.json resume=auto

Rules: every key must exist in the dataclasses below (an unknown key is an error naming the closest valid
key); values are parsed as YAML scalars and type-checked against the field's annotation. A bare key that
is the unique leaf name anywhere in the tree is accepted as a shorthand (`max_staleness=0`), and `plan=`,
`resume=` are short for `plan.path=` and `checkpoint.resume=`.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from buffer import CONSUME_ORDERS
from errors import HexrlError

CONFIG_DIR = Path(__file__).resolve().parent / "exp" / "configs"
DEFAULT_CONFIG = "cpu_demo"


class ConfigError(HexrlError, ValueError):
    same_on_every_rank = True
    pass


@dataclass
class ModelConfig:
    path: str = "exp/tiny-model"  # HF hub id or local dir (AutoModelForCausalLM / AutoTokenizer)
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    attn_implementation: str = "sdpa"


@dataclass
class DataConfig:
    task: str = "arith"  # arith | arith_tail (synthetic, built in: tasks.py) | gsm8k | math | deepscaler | path to jsonl/parquet
    num_train: int = 20000  # arith and arith_tail only
    num_test: int = 500  # held-out problems used for greedy evaluation
    seed: int = 0
    question_field: str = "question"  # field mapping for local jsonl/parquet
    answer_field: str = "answer"
    on_bad_row: str = "skip"  # skip (counted warning) | fail
    max_prompt_tokens: int = 512


@dataclass
class RolloutConfig:
    samples_per_prompt: int = 8  # G, the GRPO group size
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_batch_size: int = 64  # generator slots per rollout rank: an upper bound, the KV pool may allow fewer
    max_seq_len: int = 128
    # The paged KV cache (kv_cache.py KVPool): one pool of kv_block_size-token blocks per rollout rank, shared by the
    # rollout and eval generators. Its size: kv_cache_tokens if > 0, else kv_cache_fraction (in [0, 1)) of the free
    # device memory after the weights (on CPU: of MemAvailable), else 0/0 = max_batch_size x max_seq_len tokens (the
    # size of a static cache: never preempts). Slots = min(max_batch_size, pool tokens // kv_seq_tokens), where
    # kv_seq_tokens is the K/V a sequence is expected to hold (0 = max_seq_len); a sequence that outgrows the pool
    # sends the youngest request back to the queue, recomputed on readmission.
    kv_cache_fraction: float = 0.0
    kv_cache_tokens: int = 0
    kv_block_size: int = 16  # tokens per block; flash-attn's paged kernel needs a multiple of 256
    kv_seq_tokens: int = 0
    interrupt_mode: str = "recompute"  # recompute (exact, AReaL) | keep (reuse stale KV cache)
    compile_decode: str = "auto"  # auto (CUDA graphs on a GPU) | always | never
    # new requests' prompt rows a compiled decode step carries, packed (static shapes: every such step pays for all
    # of them); longer prompts run as separate prefill forwards, as all do at 0. An eager step carries any chunk.
    # 256: a GSM8K prompt under a chat template is ~100-250 tokens, and a GRPO group computes its prompt once.
    prefill_ride_tokens: int = 256
    flash_attn: str = "never"  # auto (on a GPU when flash-attn is installed) | always | never;
    # opt-in: no GPU we had could install flash-attn, so it is untested
    max_queued_groups: int = 16  # groups granted to one rollout rank but not yet finished
    max_pending_scores: int = 64  # finished requests awaiting their score; past it the rank waits for scores
    reward_correct: float = 1.0
    reward_wrong: float = 0.0


@dataclass
class TrainConfig:
    prompts_per_step: int = 32  # B, in GRPO groups (each of samples_per_prompt trajectories)
    total_steps: int = 60
    max_train_seconds: float = 0.0  # stop once training has run this long (0 = no limit)
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    clip_eps: float = 0.2
    behav_imp_weight_cap: float = 5.0  # 0 = no cap (the cap of behav_correction mask / tis)
    # off-policy correction of pi_prox / pi_behav (parallel/ppo.py behaviour_correction): mask (AReaL: drop tokens
    # above the cap) | tis (truncate at the cap) | mis-seq / mis-geo (drop sequences whose ratio / geometric-mean
    # ratio leaves behav_correction_bounds) | icepop (drop tokens outside the bounds)
    behav_correction: str = "mask"
    behav_correction_bounds: list = field(default_factory=lambda: [0.5, 2.0])
    loss_aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    kl_coef: float = 0.0  # KL(pi_theta || pi_ref) penalty (k3) to the initial weights; > 0 keeps a frozen copy
    # DAPO dynamic sampling: a finished group whose rewards are all equal is dropped (consumed, logged in the
    # ledger) and a new group admitted in its place, at most this many per step (0 = off)
    dynamic_sampling_max_discards: int = 0
    # truncated responses (finish_reason "length"): none | mask (they carry no loss) | penalty (DAPO's soft
    # overlong punishment over the last overlong_buffer_tokens of rollout.max_new_tokens, added to the reward)
    overlong: str = "none"
    overlong_buffer_tokens: int = 0
    recompute_prox_logprobs: bool = True  # decoupled PPO (AReaL); False = standard PPO (prox = behaviour)
    ppo_minibatches: int = 1
    micro_batch_tokens: int = 8192
    min_microbatches: int = 0  # per DP rank and minibatch; 0 = the pipeline depth (keeps every stage busy)
    grad_bucket_mb: float = 25.0  # DP gradient all-reduce bucket
    logprob_chunk_tokens: int = 1024  # log-probs / entropy this many tokens at a time (0 = a micro-batch at once)
    activation_checkpointing: bool = False  # per decoder layer: keep its input, recompute it in backward
    # FSDP2 over the DP ranks (dp > 1): fp32 master weights, gradients and AdamW state 1/dp per rank
    shard_state: bool = True
    advantage_eps: float = 1e-6
    max_nonfinite_steps: int = 3  # skip a non-finite loss; stop after this many in a row
    seed: int = 1


@dataclass
class StalenessConfig:
    max_staleness: int = 4  # η: 0 = synchronous RL
    consume_order: str = "deadline"  # deadline | admission | completion (plain AReaL): see buffer.py


@dataclass
class LoggingConfig:
    run_dir: str = "runs"
    run_name: str = ""  # default: <config>-<timestamp>
    wandb: str = "offline"  # offline | online | disabled
    wandb_project: str = "hexrl"
    eval_every: int = 10  # greedy held-out accuracy every K steps (and at start and end)
    progress: bool = True


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0 = only at the end when enabled)
    resume: str = ""  # "" | auto | <checkpoint dir>
    keep: int = 2
    at_end: bool = False


@dataclass
class PlanConfig:
    path: str = ""  # plan JSON from schedule.py; "" = default split
    num_rollout: int = 0  # default split: rollout ranks (0 = half the world)


@dataclass
class DistConfig:
    """How the ranks talk: deadlines of every wait, and the weight transfer."""

    timeout_s: float = 600.0  # process-group timeout for every collective
    rollout_timeout_s: float = 120.0  # a rollout rank silent this long is declared dead
    weight_bucket_mb: float = 64.0
    verify_weights: bool = True  # per-version checksum checked on the rollout side
    # Colocated mode: rollout and train ranks share devices (local rank r on GPU r % visible GPUs). Every group runs
    # on gloo (NCCL refuses two ranks on one GPU), weight buckets travel through pinned host memory, and on a GPU
    # each role's process is capped at its fraction of the device (torch.cuda.set_per_process_memory_fraction;
    # 0 = no cap) -- the rollout's KV pool is sized from what its cap leaves.
    colocate: bool = False
    # How an owner hands a weight bucket to a rollout relay: wire (over the process group) | shared (in shared memory:
    # CUDA IPC on a GPU, a /dev/shm file on CPU; needs every rank on one host, i.e. dist.colocate) | auto (shared
    # when colocated: on a GPU one device copy instead of device -> pinned host -> socket -> pinned host -> device;
    # exp/bench_weight_sync.py --handover wire,shared measures both).
    handover: str = "auto"
    train_memory_fraction: float = 0.0
    rollout_memory_fraction: float = 0.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    config_name: str = DEFAULT_CONFIG


ALIASES = {"plan": "plan.path", "resume": "checkpoint.resume"}
# Keys that moved: still accepted for one release, with one line saying where they live now.
MOVED = {f"plan.{k}": f"dist.{k}" for k in ("timeout_s", "rollout_timeout_s", "weight_bucket_mb", "verify_weights")}


def _leaves(cls, prefix: str = "") -> dict[str, type]:
    """Dotted key -> annotated type, for every leaf field of the tree."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.update(_leaves(t, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = t
    return out


LEAVES = _leaves(Config)


def _resolve_key(key: str) -> str:
    if key in LEAVES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key in MOVED:
        print(f"hexrl: config key '{key}' is deprecated, use '{MOVED[key]}'", file=sys.stderr, flush=True)
        return MOVED[key]
    by_leaf = [k for k in LEAVES if k.rsplit(".", 1)[-1] == key]
    if len(by_leaf) == 1:
        return by_leaf[0]
    close = difflib.get_close_matches(key, list(LEAVES) + list(ALIASES), n=1, cutoff=0.0)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value, typ):
    if typ is float and isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    expected = typing.get_origin(typ) or typ
    if value is None or not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"config key '{key}' expects {getattr(typ, '__name__', typ)}, got {value!r}")
    return value


def _set(cfg: Config, key: str, value) -> None:
    key = _resolve_key(key)
    *path, leaf = key.split(".")
    node = cfg
    for p in path:
        node = getattr(node, p)
    setattr(node, leaf, _coerce(key, value, LEAVES[key]))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    q = CONFIG_DIR / f"{name}.yaml"
    if q.exists():
        return q
    names = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config '{name}' not found (looked for {p} and {q}); available: {', '.join(names)}")


def load_config(args: list[str]) -> Config:
    """`args` are `key=value` strings; `config=<name|path>` picks the YAML (default cpu_demo)."""
    overrides: list[tuple[str, str]] = []
    name = DEFAULT_CONFIG
    for a in args:
        if "=" not in a:
            raise ConfigError(f"argument '{a}' is not of the form key=value")
        k, v = a.split("=", 1)
        k = k.lstrip("-")
        if k == "config":
            name = v
        else:
            overrides.append((k, v))
    cfg = Config()
    path = config_path(name)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for k, v in _flatten(data).items():
        _set(cfg, k, v)
    cfg.config_name = path.stem
    for k, v in overrides:
        _set(cfg, k, yaml.safe_load(v) if v != "" else "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    checks = [
        (cfg.staleness.max_staleness >= 0, "staleness.max_staleness must be >= 0"),
        (
            cfg.staleness.consume_order in CONSUME_ORDERS,
            f"staleness.consume_order must be {'|'.join(CONSUME_ORDERS)}, got {cfg.staleness.consume_order!r}",
        ),
        (cfg.rollout.samples_per_prompt >= 1, "rollout.samples_per_prompt must be >= 1"),
        (cfg.train.prompts_per_step >= 1, "train.prompts_per_step must be >= 1"),
        (cfg.rollout.interrupt_mode in ("recompute", "keep"), "rollout.interrupt_mode must be recompute|keep"),
        (cfg.rollout.compile_decode in ("auto", "always", "never"), "rollout.compile_decode must be auto|always|never"),
        (cfg.rollout.flash_attn in ("auto", "always", "never"), "rollout.flash_attn must be auto|always|never"),
        (
            cfg.rollout.prefill_ride_tokens >= 0,
            "rollout.prefill_ride_tokens must be >= 0 (0: separate prefill forwards)",
        ),
        (cfg.data.on_bad_row in ("skip", "fail"), "data.on_bad_row must be skip|fail"),
        (cfg.logging.wandb in ("offline", "online", "disabled"), "logging.wandb must be offline|online|disabled"),
        (cfg.train.ppo_minibatches >= 1, "train.ppo_minibatches must be >= 1"),
        (cfg.train.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = no clipping)"),
        (cfg.train.behav_imp_weight_cap >= 0, "train.behav_imp_weight_cap must be >= 0 (0 = no cap)"),
        (cfg.train.kl_coef >= 0, "train.kl_coef must be >= 0 (0 = no KL term, no reference model)"),
        (cfg.train.dynamic_sampling_max_discards >= 0, "train.dynamic_sampling_max_discards must be >= 0 (0 = off)"),
        (cfg.train.overlong in ("none", "mask", "penalty"), "train.overlong must be none|mask|penalty"),
        (
            cfg.train.overlong != "penalty" or 0 < cfg.train.overlong_buffer_tokens < cfg.rollout.max_new_tokens,
            "train.overlong=penalty needs 0 < train.overlong_buffer_tokens < rollout.max_new_tokens",
        ),
        (cfg.train.min_microbatches >= 0, "train.min_microbatches must be >= 0 (0 = the pipeline depth)"),
        (cfg.train.logprob_chunk_tokens >= 0, "train.logprob_chunk_tokens must be >= 0 (0 = no chunking)"),
        (cfg.rollout.max_seq_len > cfg.rollout.max_new_tokens, "rollout.max_seq_len must exceed max_new_tokens"),
        (len(cfg.train.betas) == 2, "train.betas must be a list of two floats"),
        (
            cfg.train.behav_correction in ("mask", "tis", "mis-seq", "mis-geo", "icepop"),
            "train.behav_correction must be mask|tis|mis-seq|mis-geo|icepop",
        ),
        (
            cfg.train.behav_correction != "tis" or cfg.train.behav_imp_weight_cap > 0,
            "train.behav_correction=tis truncates at train.behav_imp_weight_cap, which must be > 0",
        ),
        (
            len(cfg.train.behav_correction_bounds) == 2
            and 0 < cfg.train.behav_correction_bounds[0] <= 1 <= cfg.train.behav_correction_bounds[1],
            "train.behav_correction_bounds must be [low, high] with 0 < low <= 1 <= high",
        ),
        (
            cfg.train.loss_aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
            "train.loss_aggregation must be token-mean|seq-mean-token-mean|seq-mean-token-sum",
        ),
        (cfg.dist.handover in ("auto", "wire", "shared"), "dist.handover must be auto|wire|shared"),
        (
            cfg.dist.handover != "shared" or cfg.dist.colocate,
            "dist.handover=shared hands weights over in this host's memory: it needs dist.colocate=true (every rank "
            "on one host)",
        ),
        (
            0 <= cfg.dist.train_memory_fraction <= 1 and 0 <= cfg.dist.rollout_memory_fraction <= 1,
            "dist.train_memory_fraction and dist.rollout_memory_fraction must be in [0, 1] (0 = no cap)",
        ),
        (
            cfg.dist.train_memory_fraction + cfg.dist.rollout_memory_fraction <= 1,
            "dist.train_memory_fraction + dist.rollout_memory_fraction must be <= 1: the roles share one device",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# Keys that may differ between a checkpoint and the run resuming from it (everything else must match).
RESUMABLE_KEYS = {
    "train.total_steps",
    "train.max_train_seconds",
    "logging.run_dir",
    "logging.run_name",
    "logging.progress",
    "logging.wandb",
    "logging.eval_every",
    "checkpoint.resume",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.at_end",
    "plan.path",
    "plan.num_rollout",
    "rollout.max_pending_scores",
    "train.logprob_chunk_tokens",  # memory only: the values are the same
    "train.activation_checkpointing",  # memory only: the values are the same
    "rollout.kv_cache_fraction",  # the KV pool's size: scheduling only, every token's log-prob is the same
    "rollout.kv_cache_tokens",
    "rollout.kv_block_size",
    "rollout.kv_seq_tokens",
    "rollout.prefill_ride_tokens",  # scheduling only, like the pool's size
    *MOVED,  # a checkpoint written before the move holds them under plan.*
    *MOVED.values(),
}


def mismatched_keys(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ; a key added after the checkpoint was written counts as its default there."""
    a, b = _flatten(saved), _flatten(current)
    defaults = _flatten(to_dict(Config()))
    a = {**defaults, **a}
    return sorted(k for k in set(a) | set(b) if k not in RESUMABLE_KEYS and a.get(k) != b.get(k))
