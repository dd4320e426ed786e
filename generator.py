"""The continuous-batching generator: requests, slots, preemption, the prefill plan, the decode step, new weights.

KV-cached and continuously batched over HF Llama / Qwen2 / Qwen3 / Mistral weights. Rollout is HBM-bandwidth bound,
so we own what decides its speed and exactness: the paged KV cache (kv_cache.py), the forward with its attention
over that cache (paged_forward.py: why it is not HF's forward), the decode loop (here) and the sampler
(sampler.py). The forward runs the HF model's own modules and weights, so a trainer that updates
`model.state_dict()` names updates us, and nothing depends on HF's cache API.

Story of a request:
  add_request -> waiting queue -> admitted into the lowest free slot once the KV pool has blocks for it ->
  "prefill" writes the K/V of all its tokens but the last into its blocks -> each step() gives every running
  slot the block its next row needs and feeds the last token of every running slot through ONE batched decode
  forward, samples the next token -> a finished request frees its slot and its blocks at once and a waiting one
  takes them on the next step (continuous batching). A running sequence that needs a block the pool does not
  have preempts the youngest request: back to the queue with its tokens, recomputed on readmission.
  Invariant of a running slot: its blocks hold K/V for tokens[:-1]; tokens[-1] is the next input.
  The decode step samples on the device. With async_decode (default on a GPU) the host reads step k's tokens
  while step k+1 runs: that step takes its input tokens from step k's on the device. A stop token is therefore
  seen a step late; its request's extra row is dropped. The GPU step runs in batch-size buckets (a CUDA graph
  each) with FlexAttention over the live blocks in place; it carries up to `ride_tokens` packed prefill rows of
  new prompts (prefill rows "riding" in the decode forward). docs/generator.md, "The GPU decode path", says what runs where and why.

Weight updates (`update_weights`) happen between step() calls. interrupt_mode="recompute" (default,
as AReaL) re-prefills every in-flight sequence (prompt + tokens so far) under the new weights, so
every later token is exactly the new policy's. interrupt_mode="keep" reuses the stale cache: no
recompute cost, but later tokens attend to K/V computed by the old weights, so their log-probs are
not exactly the new policy's (the trainer's recomputed/proximal log-probs must absorb the gap).
Each generated token carries the policy version that sampled it.

Tensor parallelism (`tp_group` of k ranks): decode reads every weight and the whole KV cache each step, so k
devices that each hold 1/k of them decode a model (or a batch) one device cannot hold, and each step reads 1/k as
much per device. Sharding follows the TP split of model_family.py (the trainer's too), so the full HF tensors the
weight sync sends are sliced the same way: q/k/v and gate/up by rows (whole heads, contiguous: a rank's query
heads use exactly its own KV heads, the n_kv_heads/k its cache holds), o_proj and down_proj by columns, embedding
and LM head by vocabulary rows. The forward's collectives (paged_forward.py) give every rank the same logits, so
ranks given the same calls stay in lockstep and sample the same tokens with no further communication; they are
functional collectives, so the compiled decode step holds them and a TP replica compiles its step as one device
does. k must divide the head, KV-head, MLP and vocabulary sizes (KV heads are never replicated).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from config import ConfigError, RolloutConfig
from kv_cache import KVPool, available_memory
from model_family import check_tp_divides, model_family, shard_dim, slice_shard
from paged_forward import PagedForward, PrefillChunk, flash_attn_with_kvcache, flex_attention
from sampler import sample_tokens, seed_hash, uniform_from_hash

# A prefill row "rides" in a decode step: a new prompt's token computed as one more row of the decode forward, packed
# after the decode rows, instead of in a forward of its own. A compiled step carries up to this many such rows.
PACKED_RIDE_TOKENS = RolloutConfig.prefill_ride_tokens


def gpu_options(
    device: torch.device,
    compile_decode: str = "auto",
    flash_attn: str = "never",
    kv_block_size: int = 16,
    ride_tokens: int = PACKED_RIDE_TOKENS,
) -> dict:
    """Generator keyword arguments from "auto" | "always" | "never" (not on/off: YAML reads those as booleans).
    auto compiles the decode step into CUDA graphs on a GPU (launch-bound eager) but not on CPU (the static step
    is slower there), whatever the replica's TP degree (its collectives are in the compiled step as the rest is),
    and uses flash-attn on a GPU when installed and the KV blocks are a multiple of 256
    tokens, which its paged kernel needs (opt-in: untested). A compiled step carries up to ride_tokens packed prefill rows; an eager one the chunk as it
    is. Numbers: docs/generator.md."""
    on_gpu = device.type == "cuda"
    flash_ok = on_gpu and flash_attn_with_kvcache is not None and kv_block_size % 256 == 0
    compiled = compile_decode == "always" or compile_decode == "auto" and on_gpu
    return dict(
        compile_decode=compiled,
        use_flash_attn=flash_attn == "always" or flash_attn == "auto" and flash_ok,
        ride_tokens=ride_tokens if compiled else None,
    )


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
    prefill_rides: int = 0  # decode forwards that carried a chunk's prefill rows
    generated_tokens: int = 0
    weight_updates: int = 0
    preemptions: int = 0  # requests sent back to the queue for lack of KV blocks (recomputed on readmission)
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
    blocks: list[int] = field(default_factory=list)  # its block table: KV-pool blocks of positions 0, bs, 2 bs, ...
    arrival: int = 0  # age on the KV pool (preemption sends the youngest back to the queue)
    donor: _Request | None = None  # admitted this step sharing that request's prompt K/V (see Generator._admit)
    unresolved: int = 0  # tokens sampled on the device whose values the host has not read yet (async decode)
    finished: bool = False  # released (finished or aborted): rows of it in unresolved steps are dropped

    @property
    def all_tokens(self) -> list[int]:  # the host's tokens: only read when none is unresolved
        return self.prompt_ids + self.token_ids

    @property
    def num_tokens(self) -> int:  # tokens so far, unresolved ones included (read every decode step)
        return len(self.prompt_ids) + len(self.token_ids) + self.unresolved


@dataclass
class _LaunchedStep:
    """A decode step whose tokens were sampled on the device; the host reads them a step later (async decode)."""

    requests: list[tuple[_Request, int]]  # (running request, its row: its slot at launch)
    tokens: torch.Tensor  # [width] int64 on the device: the next step's input tokens are read from it there
    host_tokens: torch.Tensor  # [width] int64, pinned on CUDA: filled by a non_blocking copy
    host_logprobs: torch.Tensor  # [width] fp32, likewise
    done: torch.cuda.Event | None  # recorded after the copies (None on CPU: the copies are plain)
    version: int  # the weights that sampled it


def kv_options(r) -> dict:
    """Generator keyword arguments for the KV pool from a RolloutConfig, each value checked (one ConfigError naming
    the key)."""
    checks = [
        (0.0 <= r.kv_cache_fraction < 1.0, f"rollout.kv_cache_fraction must be in [0, 1), got {r.kv_cache_fraction}"),
        (
            r.kv_cache_tokens >= 0,
            f"rollout.kv_cache_tokens must be >= 0 (0 = sized otherwise), got {r.kv_cache_tokens}",
        ),
        (
            r.kv_cache_tokens == 0 or r.kv_cache_tokens >= r.max_seq_len,
            f"rollout.kv_cache_tokens ({r.kv_cache_tokens}) must hold one sequence of rollout.max_seq_len "
            f"({r.max_seq_len})",
        ),
        (r.kv_block_size >= 1, f"rollout.kv_block_size must be >= 1, got {r.kv_block_size}"),
        (
            0 <= r.kv_seq_tokens <= r.max_seq_len,
            f"rollout.kv_seq_tokens must be in [0, rollout.max_seq_len = {r.max_seq_len}], got {r.kv_seq_tokens}",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return dict(
        kv_block_size=r.kv_block_size,
        kv_cache_tokens=r.kv_cache_tokens,
        kv_cache_fraction=r.kv_cache_fraction,
        kv_seq_tokens=r.kv_seq_tokens,
    )


class Generator:
    """Continuous-batching generator; see the module docstring for the protocol and conventions.

    It fuses each layer's q/k/v and gate/up projections (their parameters become views of the fused
    matrices): move the model to its device and dtype before building the Generator, not after.

    tp_group (a torch.distributed group of k > 1 ranks): this rank runs shard r of the model, tensor parallel
    (see the module docstring). The HF model's weights are sliced in place, once (the model is marked, so a
    second Generator on it, e.g. for evaluation, reuses the shard); every rank of the group must make the same
    calls in the same order, and then gets the same outputs.

    The KV cache is paged (KVPool): `kv_pool` shares another generator's pool (the rollout rank's eval generator);
    without one, the generator builds its own, of `kv_cache_tokens` tokens if > 0, else `kv_cache_fraction` of the
    memory available after the weights (`available_memory`), else max_batch_size x max_seq_len tokens (a static
    cache's size: never preempts), in blocks of `kv_block_size` tokens (16 by default). The slot count is
    min(max_batch_size, pool tokens // kv_seq_tokens), kv_seq_tokens being the K/V a sequence is expected to hold
    (0: max_seq_len, so that every slot can reach full length)."""

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
        kv_pool: KVPool | None = None,
        kv_block_size: int | None = None,
        kv_cache_tokens: int = 0,
        kv_cache_fraction: float = 0.0,
        kv_seq_tokens: int = 0,
        async_decode: bool | None = None,
        decode_attention: str = "auto",
        decode_buckets: bool | Sequence[int] | None = None,
        ride_tokens: int | None = None,
    ):
        config = model.config
        model_family(getattr(config, "model_type", None))
        if interrupt_mode not in ("recompute", "keep"):
            raise ValueError(f"interrupt_mode must be 'recompute' or 'keep', got {interrupt_mode!r}")
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if use_flash_attn and (flash_attn_with_kvcache is None or self.device.type != "cuda"):
            raise ValueError("use_flash_attn=True needs the flash_attn package and a CUDA model")
        on_gpu = self.device.type == "cuda"
        asked_attention = decode_attention
        if decode_attention == "auto":  # FlexAttention in the compiled GPU step, else the gathered matmuls (see docs)
            flex_ok = on_gpu and compile_decode and flex_attention is not None and not use_flash_attn
            decode_attention = "flex" if flex_ok else "gather"
        if decode_attention not in ("gather", "flex") or decode_attention == "flex" and flex_attention is None:
            raise ValueError(
                f"decode_attention must be 'auto', 'gather' or 'flex' (needs torch's flex_attention), got {decode_attention!r}"
            )
        if decode_attention == "flex" and use_flash_attn:
            raise ValueError("decode_attention='flex' and use_flash_attn=True exclude each other")
        self.decode_attention = decode_attention
        # async decode: the host reads step k's tokens while step k+1 runs. Default on a GPU only: on CPU every op
        # is synchronous anyway, and the lag costs a row for each stopped request and a step before its slot refills.
        self.async_decode = on_gpu if async_decode is None else async_decode
        self._launched: list[_LaunchedStep] = []  # decode steps whose tokens the host has not read, oldest first
        self._resolved: list[RequestOutput] = []  # requests finished outside step() (flushes), returned by the next
        self.tp_group = tp_group
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        if self.tp_rank < 0:
            raise ValueError("tp_group: this process is not a member of the group")
        if self.tp > 1:
            check_tp_divides(config, self.tp)
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
        self.vocab_size = config.vocab_size  # the full vocabulary: logits are gathered before sampling
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        # Prefill rows that ride in a decode forward, packed (see _plan_prefill): the compiled step's static shapes
        # cannot take the right-padded chunk of any size that rides in an eager step, so there a chunk of up to
        # ride_tokens rows rides, padded to that many; 0: under compile_decode every chunk is a prefill-only forward
        if ride_tokens is not None and ride_tokens < 0:
            raise ValueError(f"ride_tokens must be >= 0 (0: no packed prefill rows), got {ride_tokens}")
        self.ride_tokens = (PACKED_RIDE_TOKENS if compile_decode else 0) if ride_tokens is None else ride_tokens
        self.interrupt_mode, self.use_flash_attn = interrupt_mode, use_flash_attn
        self.version = version
        # the network: fused projections, RoPE, paged attention, TP collectives (paged_forward.py)
        self.forward = PagedForward(model, tp_group, weight_layout, max_batch_size, max_seq_len)
        self.n_kv_heads, self.head_dim = self.forward.n_kv_heads, self.forward.head_dim

        # The paged KV cache: blocks from a pool (this generator's own, or shared), a block table per slot.
        self.kv_pool = self._kv_pool(kv_pool, kv_block_size, kv_cache_tokens, kv_cache_fraction, max_seq_len)
        bs = self.block_size = self.kv_pool.block_size
        self.max_blocks = -(-max_seq_len // bs)  # a block table's width: blocks of one sequence at max_seq_len
        if self.kv_pool.num_blocks < self.max_blocks:
            raise ValueError(
                f"the KV pool holds {self.kv_pool.num_blocks} blocks of {bs} tokens; one sequence of max_seq_len "
                f"{max_seq_len} needs {self.max_blocks}: raise kv_cache_tokens or kv_cache_fraction"
            )
        # flex's Triton kernels tile the pool's blocks and the head dim with matmuls at least 16 deep, in
        # power-of-two tiles of at most 64 KV rows: on a GPU the blocks must be cut in such tiles
        flex_tiles = bs >= 16 and (bs & (bs - 1) == 0 or bs % 64 == 0) and self.head_dim >= 16
        if on_gpu and self.decode_attention == "flex" and not flex_tiles:
            if asked_attention == "flex":
                raise ValueError(
                    f"decode_attention='flex' on a GPU needs kv_block_size a power of two >= 16 or a multiple of 64 "
                    f"and head_dim >= 16, got kv_block_size {bs}, head_dim {self.head_dim}"
                )
            self.decode_attention = "gather"
        if not on_gpu and self.decode_attention == "flex" and compile_decode:
            # inductor's CPU flex template takes the block table's width (blocks of one sequence) for the KV length
            # it may visit, while here the KV sequence is the whole pool: its lowering fails at the first step
            raise ValueError(
                "decode_attention='flex' with compile_decode=True runs on a GPU only (torch's CPU flex kernel cannot "
                "read the pool in place); on CPU use decode_attention='gather' or compile_decode=False"
            )
        if use_flash_attn and bs % 256:
            raise ValueError(f"use_flash_attn: flash-attn's paged kernel needs kv_block_size % 256 == 0, got {bs}")
        if not 0 <= kv_seq_tokens <= max_seq_len:
            raise ValueError(f"kv_seq_tokens must be in [0, max_seq_len = {max_seq_len}], got {kv_seq_tokens}")
        self.max_batch_size = max(
            1, min(max_batch_size, self.kv_pool.num_blocks * bs // (kv_seq_tokens or max_seq_len))
        )
        self.kv_pool.register(self)
        # per slot, its blocks (unused entries: the null block 0); on the device, and a host copy to edit
        self.block_table = torch.zeros(self.max_batch_size, self.max_blocks, dtype=torch.int32, device=self.device)
        self._table = (
            self.block_table if self.device.type == "cpu" else torch.zeros_like(self.block_table, device="cpu")
        )
        self._table_dirty = False
        self._fresh_blocks: list[int] = []  # allocated since the last forward: zeroed before it
        self.decode_span = 0  # positions per slot the last decode step's attention read (whole blocks)
        self.decode_width = 0  # rows of the last decode step (its bucket, with decode_buckets)
        # FlexAttention's page table: the logical index of every pool block in the table of the sequences holding it
        # (unique: shared prompt blocks sit at the same index in every sharer's table), and each row's position
        self._logical = torch.zeros(self.kv_pool.num_blocks + 1, dtype=torch.int32, device=self.device)
        self._logical_host = (
            self._logical if self.device.type == "cpu" else torch.zeros_like(self._logical, device="cpu")
        )
        rows = self.max_batch_size + self.ride_tokens  # decode rows, then packed prefill rows
        self.forward.attach(
            self.kv_pool,
            self.block_table,
            self._logical,
            rows,
            compile_decode,
            self.decode_attention,
            use_flash_attn,
        )

        self.waiting: deque[_Request] = deque()
        self.slots: list[_Request | None] = [None] * self.max_batch_size
        self.requests: dict[Hashable, _Request] = {}
        self.stats = GeneratorStats()

        # A compiled decode step needs static shapes: every block of the tables, and a batch width from a few buckets
        # (powers of two up to max_batch_size, or the widths given as decode_buckets): the running slots are padded
        # to the smallest bucket that holds them, so a CUDA graph is captured per bucket and a small tail batch does
        # not pay for max_batch_size rows. Each bucket is a compile of the whole step (tens of seconds for a
        # 28-layer model on a GPU): fewer widths compile faster and pad more.
        self.static_decode = compile_decode
        if isinstance(decode_buckets, (list, tuple)):
            if not decode_buckets or min(decode_buckets) < 1:
                raise ValueError(f"decode_buckets: batch widths >= 1, got {list(decode_buckets)}")
            self.buckets = sorted({min(int(w), self.max_batch_size) for w in decode_buckets} | {self.max_batch_size})
            decode_buckets = True
        else:
            self.buckets = sorted(
                {min(1 << i, self.max_batch_size) for i in range(self.max_batch_size.bit_length() + 1)}
            )
        self.decode_buckets = (compile_decode or on_gpu) if decode_buckets is None else decode_buckets
        self._decode_step = self._decode_and_sample
        if compile_decode or on_gpu and self.decode_attention == "flex":
            # a graph per bucket (x the few sampler variants: greedy / sampled / truncated); past dynamo's default
            # limit of 8 recompiles per function it would fall back to eager
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    limit = max(getattr(torch._dynamo.config, name), 4 * len(self.buckets))
                    setattr(torch._dynamo.config, name, limit)
        if compile_decode:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            if self.device.type == "cuda":
                # A CUDA graph replays fixed addresses. Tensors that are not parameters would otherwise be copied
                # into the graph's own input buffers on every replay: the whole cache and the fused weights.
                for t in self.forward.static_tensors():
                    torch._dynamo.mark_static_address(t)
            self._decode_step = torch.compile(self._decode_and_sample, mode=mode, dynamic=False)

    @classmethod
    def from_config(cls, model, rollout: RolloutConfig, tp_group=None, kv_pool: KVPool | None = None) -> Generator:
        """The Generator the rollout rank runs, every knob from the config's `rollout` section (checked: one
        ConfigError naming the key). With `kv_pool` (the eval generator's: the rollout generator's pool) only the
        expected K/V per sequence is taken from the config; the pool's own size and blocks stay."""
        device = next(model.parameters()).device
        r = rollout
        kv = kv_options(r) if kv_pool is None else {"kv_seq_tokens": r.kv_seq_tokens}
        options = gpu_options(
            device,
            r.compile_decode,
            r.flash_attn,
            kv_block_size=r.kv_block_size,
            ride_tokens=r.prefill_ride_tokens,
        )
        # the eval generator keeps the default interrupt mode: it runs to completion between weight versions
        interrupt = {"interrupt_mode": r.interrupt_mode} if kv_pool is None else {}
        return cls(
            model,
            max_batch_size=r.max_batch_size,
            max_seq_len=r.max_seq_len,
            tp_group=tp_group,
            kv_pool=kv_pool,
            **interrupt,
            **kv,
            **options,
        )

    def _kv_pool(
        self, pool: KVPool | None, block_size: int | None, tokens: int, fraction: float, max_seq_len: int
    ) -> KVPool:
        """The given pool (checked against this model's K/V geometry), or a new one sized as the class says."""
        geometry = (len(self.forward.layers), self.n_kv_heads, self.head_dim, self.dtype, self.device)
        if pool is not None:
            if tokens or fraction or block_size not in (None, pool.block_size):
                raise ValueError("kv_pool is given: kv_cache_tokens, kv_cache_fraction and kv_block_size are its own")
            theirs = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype, pool.device)
            if theirs != geometry:
                raise ValueError(
                    f"kv_pool holds (layers, kv heads, head dim, dtype, device) {theirs}; this model needs {geometry}"
                )
            return pool
        block_size = 16 if block_size is None else block_size
        if block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {block_size}")
        if tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0, got {tokens}")
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"kv_cache_fraction must be in [0, 1), got {fraction}")
        if tokens:
            num_blocks = -(-tokens // block_size)
        elif fraction:
            block_bytes = block_size * KVPool.token_bytes(*geometry[:4])
            num_blocks = int(fraction * available_memory(self.device)) // block_bytes
            if self.tp > 1:  # the ranks of a replica must take the same scheduling decisions: the smallest pool
                n = torch.tensor([num_blocks], device=self.device)
                dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.tp_group)
                num_blocks = int(n.item())
        else:
            num_blocks = self.max_batch_size * -(-max_seq_len // block_size)
        return KVPool(*geometry[:3], max(num_blocks, 1), block_size, self.dtype, self.device)

    def _shard_model(self, model) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Replace each split parameter by this rank's slice, by the TP split of model_family.py (
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

    def _plan_prefill(self, reqs: list[_Request]) -> list[PrefillChunk]:
        """Decide how each request's K/V of tokens[:-1] get into its blocks; returns the chunks to compute.

        The samples of a GRPO group share their prompt (`_admit` gave a fresh request whose prompt another one holds
        or computes the full blocks of that prompt): the rest of a prompt resident in another slot (computed with the
        current weights) is copied now, block by block; that of a prompt computed in this step becomes an extra
        destination of that computation's rows (prefill is most of the work for short answers). The rest is computed
        in right-padded chunks of requests sorted by length, each within the prefill token budget (count x
        longest). With ride_tokens, the shortest requests whose rows (and their sharers' extra rows) fit it go, first,
        into one packed chunk, returned last, to ride in the decode forward. Newly allocated blocks are zeroed first,
        so no stale K/V (not even a non-finite one) is read."""
        self._zero_fresh_blocks()
        reqs = [r for r in reqs if r.num_tokens > 1]
        for r in reqs:
            r.cache_version = self.version
        compute: list[_Request] = []
        sharers: dict[int, list[_Request]] = {}  # id(computed request) -> requests that receive its rows too
        copies: list[tuple[int, int]] = []  # (source block, destination block)
        for r in reqs:
            donor, r.donor = r.donor, None
            if donor is None:
                compute.append(r)
                continue
            n = len(r.prompt_ids) - 1
            self.stats.prefill_tokens_shared += n
            if donor.needs_prefill:  # computed in this step
                sharers.setdefault(id(donor), []).append(r)
            elif n % self.block_size:  # resident: its partly filled last prompt block is copied
                copies.append((donor.blocks[n // self.block_size], r.blocks[n // self.block_size]))
        if copies:
            src, dst = (self._to_device(torch.tensor(c)) for c in zip(*copies))
            self.kv_pool.storage.index_copy_(3, dst, self.kv_pool.storage.index_select(3, src))
        compute.sort(key=lambda r: r.num_tokens)
        riders, rest, rows, writes = [], [], 0, 0
        for r in compute if self.ride_tokens else []:
            n = len(r.prompt_ids) + len(r.token_ids) - 1
            extra = len(sharers.get(id(r), [])) * (n % self.block_size)  # each sharer's rows of the last prompt block
            if rows + n <= self.ride_tokens and writes + n + extra <= 2 * self.ride_tokens:
                riders.append(r)
                rows, writes = rows + n, writes + n + extra
            else:
                rest.append(r)
        if riders:
            compute = rest
        chunks = []
        while compute:
            n = 1
            while n < len(compute) and (n + 1) * (compute[n].num_tokens - 1) <= self.max_prefill_tokens:
                n += 1
            chunks.append(self._prefill_chunk(compute[:n], sharers))
            compute = compute[n:]
        if riders:
            chunks.append(self._packed_chunk(riders, sharers))
        return chunks

    def _token_rows(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end) of a sequence with these blocks, in a head's plane of the pool (CPU)."""
        pos = torch.arange(start, end)
        return torch.tensor(blocks)[pos // self.block_size] * self.block_size + pos % self.block_size

    def _kv_writes(
        self, reqs: list[_Request], firsts: list[int], sharers: dict[int, list[_Request]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a chunk's K/V rows go: (pool rows of a layer's flat view, rows of the chunk's k/v [rows * kv_heads,
        D] written there), for request i's tokens[:-1] computed at chunk rows firsts[i]..., and for each request
        sharing its prompt (holding the full prompt blocks already) the rest of the prompt."""
        heads, head_rows = torch.arange(self.n_kv_heads), self.forward.head_rows_host  # no device-to-host copy (a sync)
        dst, src = [], []  # pool rows (kv head, block, offset) <- rows (chunk row, kv head) of k
        for r, first in zip(reqs, firsts):
            n = len(r.prompt_ids) + len(r.token_ids) - 1
            rows = (first + torch.arange(n).unsqueeze(1)) * self.n_kv_heads + heads  # [n, kv_heads]
            dst.append(self._token_rows(r.blocks, 0, n).unsqueeze(1) + head_rows)
            src.append(rows)
            for sharer in sharers.get(id(r), []):
                start = n // self.block_size * self.block_size
                dst.append(self._token_rows(sharer.blocks, start, n).unsqueeze(1) + head_rows)
                src.append(rows[start:])
        return torch.cat(dst).view(-1), torch.cat(src).view(-1)

    def _prefill_chunk(self, reqs: list[_Request], sharers: dict[int, list[_Request]]) -> PrefillChunk:
        """Right-padded tokens[:-1] of `reqs` and where each real row's K/V go in a pool layer's flat view."""
        seqs = [r.all_tokens[:-1] for r in reqs]
        length = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), length, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)
        write_rows, read_rows = self._kv_writes(reqs, [i * length for i in range(len(reqs))], sharers)
        self.stats.prefill_tokens += sum(len(s) for s in seqs)
        return PrefillChunk(self._to_device(tokens), self._to_device(write_rows), self._to_device(read_rows))

    def _packed_chunk(self, reqs: list[_Request], sharers: dict[int, list[_Request]]) -> PrefillChunk:
        """tokens[:-1] of `reqs` one after another, each row with its position and slot: its attention reads its
        sequence's blocks in the pool, as a decode row does, so no sequence is padded. Under compile_decode the
        chunk is padded to static shapes: ride_tokens rows (padding: token 0 at position 0 of slot 0, which reads
        one key and is never used) and 2 x ride_tokens rows of K/V writes (padding: into the null block)."""
        tokens, positions, slots, firsts = [], [], [], []
        for r in reqs:
            s = r.all_tokens[:-1]
            firsts.append(len(tokens))
            tokens += s
            positions += range(len(s))
            slots += [r.slot] * len(s)
        write_rows, read_rows = self._kv_writes(reqs, firsts, sharers)
        self.stats.prefill_tokens += len(tokens)
        if self.static_decode:
            pad = self.ride_tokens - len(tokens)
            tokens, positions, slots = tokens + [0] * pad, positions + [0] * pad, slots + [0] * pad
            pad = 2 * self.ride_tokens * self.n_kv_heads - write_rows.numel()
            write_rows = torch.cat([write_rows, torch.zeros(pad, dtype=write_rows.dtype)])  # row 0: the null block's
            read_rows = torch.cat([read_rows, torch.zeros(pad, dtype=read_rows.dtype)])
        rows = self._to_device(torch.tensor([tokens, positions, slots]))
        writes = self._to_device(torch.stack([write_rows, read_rows]))
        return PrefillChunk(rows[0], writes[0], writes[1], rows[1], rows[2])

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
            arrival=next(self.kv_pool.arrivals),
        )
        self.requests[request_id] = req
        self.waiting.append(req)

    def num_unfinished(self) -> int:
        return len(self.requests)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Give every running slot the KV blocks it needs (preempting the youngest requests if the pool is out
        of them), admit waiting requests into free slots while blocks last (prefill), then ONE batched decode
        step for all running slots. Returns the requests that finished in this step; with async_decode, those
        whose last token the previous step sampled (the host reads a step's tokens while the next one runs)."""
        finished, self._resolved = self._resolved, []
        t0 = time.perf_counter()
        self._retire_by_length()
        self._grow()
        self.stats.decode_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        self._admit()
        running = [r for r in self.slots if r is not None]
        if not running:
            finished += self._resolve(keep=0)
            if self.waiting:  # cannot happen: the pool holds a whole sequence and the others' blocks can be taken
                raise RuntimeError("Generator.step: requests wait but none can be admitted (KV pool accounting)")
            return finished
        to_prefill = [r for r in running if r.needs_prefill]
        riding = None
        if to_prefill:
            chunks = self._plan_prefill(to_prefill)
            for r in to_prefill:
                r.needs_prefill = False
            self._sync_table()
            # the last chunk rides in the decode forward; earlier ones (over the token budget) run as prefill-only
            # forwards, and under a compiled static-shape decode step all but a packed one (ride_tokens)
            if chunks and (chunks[-1].slots is not None or not self.static_decode):
                riding = chunks.pop()
                self.stats.prefill_rides += 1
            no_rows = torch.zeros(0, dtype=torch.long, device=self.device)
            for chunk in chunks:
                self.stats.prefill_forwards += 1
                self.forward(no_rows, no_rows, no_rows, 0, chunk)
        self.stats.prefill_seconds += time.perf_counter() - t0

        t0 = time.perf_counter()
        self._zero_fresh_blocks()
        self._sync_table()
        self._launch(running, riding)
        finished += self._resolve(keep=1 if self.async_decode else 0)
        self.stats.decode_seconds += time.perf_counter() - t0
        return finished

    def _launch(self, running: list[_Request], riding: PrefillChunk | None) -> None:
        """Queue one decode step (forward + sampling) for the running slots on the device; nothing waits for it. A
        row whose input token the previous step sampled reads it on the device; positions, block rows, seeds and
        counters are known on the host (every running row adds one token) and go over in one copy."""
        last = max(r.slot for r in running) + 1
        width = next(w for w in self.buckets if w >= last) if self.decode_buckets else last
        if riding is not None and self.static_decode:  # one more graph, the widest bucket's: not one per bucket
            width = self.buckets[-1]
        self.decode_width = width
        # idle slots decode a dummy token at position 0, written into the null block
        cols = [[0] * width for _ in range(5)]  # input token, position, pool row, hashed seed, token counter
        bs = self.block_size
        prev = self._launched[-1] if self._launched else None
        from_prev = []  # slots whose input token is still on the device
        for r in running:
            p, s = r.num_tokens - 1, r.slot
            if r.unresolved:
                from_prev.append(s)
            else:
                cols[0][s] = (r.token_ids or r.prompt_ids)[-1]
            cols[1][s], cols[2][s] = p, r.blocks[p // bs] * bs + p % bs
            cols[3][s], cols[4][s] = r.hashed_seed, len(r.token_ids) + r.unresolved
        # the live blocks: up to the longest sequence's last block (compiled: every block, static shapes)
        span = self.max_blocks * bs if self.static_decode else (max(cols[1]) // bs + 1) * bs
        self.decode_span = span
        tokens, positions, rows, seeds, counters = self._to_device(torch.tensor(cols))
        if self.device.type == "cpu" and not self.static_decode:  # ~30 int64 ops on a few lanes cost more there
            seeds = torch.tensor([uniform_from_hash(h, c) for h, c in zip(cols[3], cols[4])], dtype=torch.float64)
            counters = None
        if from_prev:
            at = self._to_device(torch.tensor(from_prev))
            tokens = tokens.index_copy(0, at, prev.tokens[at])
        sampling = self._sampling_inputs(running, width)
        if self.static_decode and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed: reuse their memory
        new_tokens, logprobs = self._decode_step(tokens, positions, rows, span, riding, seeds, counters, *sampling)
        if self.device.type == "cuda":  # the host reads them a step later, from pinned memory: no sync now
            new_tokens = new_tokens.clone()  # out of the graph's memory, which the next replay reuses
            host_tokens = torch.empty(width, dtype=torch.long, pin_memory=True).copy_(new_tokens, non_blocking=True)
            host_logprobs = torch.empty(width, dtype=torch.float32, pin_memory=True)
            host_logprobs.copy_(logprobs, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host_tokens, host_logprobs, done = new_tokens, logprobs, None
        rows_of = [(r, r.slot) for r in running]
        self._launched.append(_LaunchedStep(rows_of, new_tokens, host_tokens, host_logprobs, done, self.version))
        for r in running:
            r.unresolved += 1
        self.stats.decode_steps += 1

    def _resolve(self, keep: int) -> list[RequestOutput]:
        """Read the tokens of all launched steps but the last `keep` (waiting for their copies), append them, stamp
        the version that sampled them and finish requests on a stop token or at max_new_tokens. A row of a request
        finished meanwhile (its stop token came in an earlier step; or aborted) is dropped."""
        finished = []
        while len(self._launched) > keep:
            launched = self._launched.pop(0)
            if launched.done is not None:
                launched.done.synchronize()
            tokens, logprobs = launched.host_tokens.tolist(), launched.host_logprobs.tolist()
            for r, row in launched.requests:
                if r.finished:
                    continue
                tok = tokens[row]
                r.unresolved -= 1
                r.token_ids.append(tok)
                r.logprobs.append(logprobs[row])
                r.versions.append(launched.version)
                self.stats.generated_tokens += 1
                reason = (
                    "stop"
                    if tok in r.params.stop_token_ids
                    else ("length" if len(r.token_ids) >= r.params.max_new_tokens else None)
                )
                if reason is not None:
                    finished.append(self._release(r, reason))
        return finished

    def _flush(self) -> None:
        """Read every launched step now (a sync); what finishes is returned by the next step()."""
        self._resolved += self._resolve(keep=0)

    def _retire_by_length(self) -> None:
        """A request whose unresolved token is its max_new_tokens-th needs no more rows: its slot and blocks go now,
        as they would have had the host read that token already, and it finishes when the token is read."""
        for r in self.slots:
            if r is not None and r.unresolved and len(r.token_ids) + r.unresolved >= r.params.max_new_tokens:
                self._drop_blocks(r)
                self.slots[r.slot], r.slot = None, -1

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without a sync: a pageable host-to-device copy waits for the stream, a
        non_blocking one from pinned memory does not (the caching host allocator keeps the buffer until the copy
        ran)."""
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ KV blocks

    def _blocks_for(self, num_tokens: int) -> int:
        """Blocks a running request of num_tokens tokens holds: K/V of tokens[:-1] plus its next decode row."""
        return -(-num_tokens // self.block_size)

    def _grow(self) -> None:
        """Every running request, oldest first, gets the blocks its next decode row needs (one at a block boundary;
        all of them for a recompute after a weight swap). A request the pool cannot serve takes the blocks of the
        youngest requests (another generator's on the pool first, then this one's younger ones); failing that it is
        the youngest itself and goes back to the queue."""
        for r in sorted((r for r in self.slots if r is not None), key=lambda r: r.arrival):
            if r.slot < 0:  # preempted for an older one in this loop
                continue
            need = self._blocks_for(r.num_tokens) - len(r.blocks)
            if need <= 0:
                continue
            if self._reserve(need, r):
                self._assign(r, r.blocks + self._allocate(need))
            else:
                self._preempt(r)

    def _reserve(self, need: int, younger_than: _Request | None) -> bool:
        """Free blocks until `need` are free, preempting as preemption_victim says; False if not possible."""
        while self.kv_pool.num_free < need:
            victim = preemption_victim(self.kv_pool, self, younger_than)
            if victim is None:
                return False
            victim[0]._preempt(victim[1])
        return True

    def _admit(self) -> None:
        """Waiting requests, in order, into free slots (lowest first) while the pool has their blocks and, besides,
        one block of headroom for every running sequence that can still grow (itself included): admitting up to the
        last block would only preempt the newcomer at its next block boundary. A pool of a static cache's size thus
        never refuses a free slot. The first request that does not fit waits, and so do the ones behind it. A fresh
        request whose prompt another slot holds (computed with the current weights) or computes in this step shares
        the full blocks of that prompt (refcounted, never written again: decode writes from the prompt's last
        position on, a recompute takes fresh blocks)."""
        if not self.waiting:
            return
        headroom = sum(self._can_grow(r, len(r.blocks)) for r in self.slots if r is not None)
        resident = {
            tuple(r.prompt_ids): r
            for r in self.slots
            if r is not None and not r.needs_prefill and r.cache_version == self.version
        }
        computed: dict[tuple, _Request] = {}
        for slot in range(self.max_batch_size):
            if not self.waiting:
                break
            if self.slots[slot] is not None:
                continue
            r = self.waiting[0]
            donor, key = None, tuple(r.prompt_ids)
            if not r.token_ids and len(r.prompt_ids) > 1:
                donor = resident.get(key) or computed.get(key)
            shared = (len(r.prompt_ids) - 1) // self.block_size if donor is not None else 0
            need = self._blocks_for(r.num_tokens) - shared
            grows = self._can_grow(r, need + shared)
            if not self._reserve(need + headroom + grows, None):
                break
            headroom += grows
            self.waiting.popleft()
            r.slot, r.needs_prefill, r.donor = slot, True, donor
            self.slots[slot] = r
            blocks = donor.blocks[:shared] if donor is not None else []
            self.kv_pool.share(blocks)
            self._assign(r, blocks + self._allocate(need))
            if donor is None and not r.token_ids and len(r.prompt_ids) > 1:
                computed[key] = r

    def _can_grow(self, r: _Request, holding: int) -> bool:
        """Will a request holding this many blocks need another before its max_new_tokens-th token?"""
        return self._blocks_for(len(r.prompt_ids) + r.params.max_new_tokens - 1) > holding

    def _allocate(self, n: int) -> list[int]:
        blocks = self.kv_pool.allocate(n)
        self._fresh_blocks += blocks
        return blocks

    def _zero_fresh_blocks(self) -> None:
        if self._fresh_blocks:
            self.kv_pool.storage.index_fill_(3, self._to_device(torch.tensor(self._fresh_blocks)), 0.0)
            self._fresh_blocks = []

    def _assign(self, r: _Request, blocks: list[int]) -> None:
        """Set a running request's blocks and its row of the block table."""
        old, r.blocks = len(r.blocks), blocks
        if len(blocks) < old:
            self._table[r.slot, len(blocks) :] = 0
        if len(blocks) > old:
            self._table[r.slot, old : len(blocks)] = torch.tensor(blocks[old:], dtype=torch.int32)
            if self.decode_attention == "flex":
                self._logical_host[blocks[old:]] = torch.arange(old, len(blocks), dtype=torch.int32)
        self._table_dirty = True

    def _drop_blocks(self, r: _Request) -> None:
        self.kv_pool.release(r.blocks)
        if r.slot >= 0:
            self._assign(r, [])
        r.blocks = []

    def _preempt(self, r: _Request) -> None:
        """Back to the waiting queue (by age, so the oldest is readmitted first) with its tokens so far, its blocks
        freed; on readmission prompt + tokens are recomputed, the recompute path of a weight swap. Its tokens must
        be on the host for that: a launched step is read first (a sync; preemption is rare), which may finish it."""
        if r.unresolved:
            self._flush()
            if r.finished:
                return
        self.stats.preemptions += 1
        self._drop_blocks(r)
        self.slots[r.slot], r.slot, r.needs_prefill, r.donor = None, -1, True, None
        at = next((j for j, w in enumerate(self.waiting) if w.arrival > r.arrival), len(self.waiting))
        self.waiting.insert(at, r)

    def _sync_table(self) -> None:
        if self._table_dirty:
            if self._table is not self.block_table:  # pinned, non_blocking: no sync with the running step
                self.block_table.copy_(self._table.pin_memory(), non_blocking=True)
                self._logical.copy_(self._logical_host.pin_memory(), non_blocking=True)
            self._table_dirty = False

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Per layer, every slot's K as [slots, kv_heads, max_seq_len, D], gathered through the block tables: a copy,
        for inspection (the storage is kv_pool.k; positions past a slot's length hold zeros or null-block rows)."""
        return [self._dense(layer) for layer in self.kv_pool.k]

    @property
    def v_cache(self) -> list[torch.Tensor]:
        """As k_cache, for V."""
        return [self._dense(layer) for layer in self.kv_pool.v]

    def _dense(self, layer: torch.Tensor) -> torch.Tensor:
        self._sync_table()
        blocks = layer[:, self.block_table.long()]  # [kv_heads, slots, max_blocks, block_size, D]
        dense = blocks.transpose(0, 1).reshape(self.max_batch_size, self.n_kv_heads, -1, self.head_dim)
        return dense[:, :, : self.max_seq_len]

    def kv_live_tokens(self) -> int:
        """K/V rows the running sequences hold (shared prompt rows counted once per sequence)."""
        return sum(r.num_tokens - 1 for r in self.slots if r is not None and not r.needs_prefill)

    def _sampling_inputs(self, running: list[_Request], width: int) -> tuple:
        """The sampler's arguments for a step of `width` rows (idle rows draw a dummy token): per-row tensors only
        where the rows differ, and the host-side flags it needs (so that it reads nothing back from the device)."""
        params = [r.params for r in running]
        temperatures = {p.temperature for p in params}
        all_greedy = temperatures == {0.0}
        any_greedy = 0.0 in temperatures
        truncate = any(p.temperature > 0 and (p.top_p < 1.0 or 0 < p.top_k < self.vocab_size) for p in params)
        if self.static_decode:  # one graph for greedy and sampled rows alike (argmax and draw, chosen per row)
            all_greedy, any_greedy = False, True
        if len(temperatures) == 1:
            temperature = temperatures.pop()
            if self.static_decode:  # a tensor: a graph per temperature value would be one per eval/rollout switch
                temperature = self._to_device(torch.full((width,), temperature, dtype=torch.float32))
        else:
            t = torch.ones(width, dtype=torch.float32)
            t[[r.slot for r in running]] = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            temperature = self._to_device(t)
        top_p = top_k = None
        if truncate:
            p_k = torch.tensor([[1.0] * width, [float(self.vocab_size)] * width], dtype=torch.float64)
            p_k[:, [r.slot for r in running]] = torch.tensor(
                [[p.top_p for p in params], [p.top_k if p.top_k > 0 else self.vocab_size for p in params]],
                dtype=torch.float64,
            )
            p_k = self._to_device(p_k)
            top_p, top_k = p_k[0].float(), p_k[1].long()
        return temperature, top_p, top_k, truncate, all_greedy, any_greedy

    def _decode_and_sample(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        span: int,
        chunk: PrefillChunk | None,
        seeds: torch.Tensor,
        counters: torch.Tensor | None,
        temperature: torch.Tensor | float,
        top_p: torch.Tensor | None,
        top_k: torch.Tensor | None,
        truncate: bool,
        all_greedy: bool,
        any_greedy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward and the sampler, all device ops (the compiled step: one CUDA graph per bucket, sampling
        included). The counter-based uniforms come from the rows' hashed seeds and token counters on the device, the
        same values as the host's `uniform_from_hash` (tested); eager on CPU `seeds` holds the uniforms themselves,
        hashed in Python (counters None). Returns (tokens, logprobs) [width]."""
        logits = self.forward(tokens, positions, rows, span, chunk)
        u = seeds if counters is None else uniform_from_hash(seeds, counters)
        return sample_tokens(logits, temperature, top_p, top_k, u, truncate, (all_greedy, any_greedy))

    def _release(self, req: _Request, reason: str) -> RequestOutput:
        self._drop_blocks(req)
        if req.slot >= 0:
            self.slots[req.slot] = None
        req.slot, req.finished = -1, True
        del self.requests[req.request_id]
        return RequestOutput(req.request_id, req.prompt_ids, req.token_ids, req.logprobs, req.versions, reason)

    def abort(self, request_id: Hashable) -> None:
        """Drop a waiting or running request; its slot is free for the next step()."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"abort: unknown request id {request_id!r}")
        if req.slot < 0 and not req.unresolved:  # waiting (a request retired by length waits for its last token)
            self.waiting.remove(req)
        self._release(req, "abort")  # rows of it in launched steps are dropped when read

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
        self._flush()  # launched steps' tokens are the old weights' (their version) and a recompute needs them all
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
        if self.interrupt_mode == "recompute":  # stale K/V: their blocks go back, the next step takes fresh ones
            for r in self.slots:
                if r is not None:
                    r.needs_prefill = True
                    self._drop_blocks(r)
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


def preemption_victim(pool: KVPool, generator: Generator, younger_than: _Request | None):
    """(generator, request) to preempt so that `generator` can go on, among the generators on `pool`: the youngest running request of another
    generator on the pool, else `generator`'s own youngest one younger than `younger_than` (none if None)."""
    best = None
    for other in pool.generators():
        if other is not generator:
            for r in other.slots:
                if r is not None and r.blocks and (best is None or r.arrival > best[1].arrival):
                    best = (other, r)
    if best is not None or younger_than is None:
        return best
    for r in generator.slots:
        if r is not None and r.blocks and r.arrival > younger_than.arrival:
            if best is None or r.arrival > best[1].arrival:
                best = (generator, r)
    return best
