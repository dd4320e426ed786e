"""Peak device memory of every rank of a plan, from the runtime's own code run on fake tensors.

    python exp/estimate_memory.py --config gpu_r1_7b --plan plan.json [--json] [--headroom 0.9] [--jobs 2]
    python exp/estimate_memory.py --validate [--json]      # estimates vs measured peaks on CPU (real tensors, gloo)

What runs. Every distinct rank of the plan is built in a process of its own (torch.distributed allows one default
group per process) on torch's `fake` process-group backend -- FakeStore, the plan's world size, that rank -- under
FakeTensorMode, with the runtime's own classes: parallel.groups.build_groups(plan), then
  a train rank:   parallel.trainer.Trainer(...) from an HF model of the config's shape, ONE Trainer.train_step on
                  trajectories of the config's shapes, then ONE weight sync as its stage's sender
                  (parallel/weight_sync.send_version);
  a rollout rank: the HF model in its dtype (what train.py's load_policy puts on the device), generator.Generator as
                  RolloutWorker builds it (its KV pool included), ONE weight version received and applied
                  (weight_sync.receive_version, as the relay of its machine, through ReplicaLink.share_weights under
                  TP), then ONE Generator.step() with every slot at its longest context (its prefill included).
Distinct ranks: one per train stage and TP position -- the DP ranks of a stage are alike (DP rank 0, the largest
FSDP shard, stands for them) and so are its TP ranks after the first (same shard shapes; only TP rank 0 holds
weight-sync buckets) -- and per rollout replica shape (GPU type, TP): its leader and, under TP, a follower.

What is counted. torch's MemTracker (torch.distributed._tools.mem_tracker) follows every tensor storage the rank
allocates, from the trainer's (or the rollout model's) construction on, and keeps the peak of their total over the
whole sequence (construction, step, sync); the HF model a train rank slices its stage from lives in host memory, as
in train.py, and is built on the fake "meta" device so that it is not counted. At each new peak the storages are
sorted into kinds: weights (parameters and buffers, FSDP's unsharded copies included), grads, optimizer (what
AdamW's step allocates), logits (a tensor whose last dimension is the vocabulary or its TP slice), kv (what the
Generator allocates besides weights: its KV pool), sync_buffers (what the weight sync allocates) and activations
(the rest: activations and their recomputation, the packed batch, pipeline buffers, the grad norm's temporaries);
`where` names the runtime's innermost frames at the peak. (MemTracker rather than FSDPMemTracker: one tracker for
FSDP and non-FSDP stages alike, and its module hooks, which refuse a stage called once per micro-batch, are off.)

Device. The fake tensors live on "cpu" and the code runs its CPU path with the GPU's dtypes: the trainer gets
compute_dtype bfloat16 (bf16 autocast, FSDP's bf16 unsharded parameters, fp32 master state), the rollout model is
bf16, weights sync in bf16. A fake CUDA device would take other paths on a machine without CUDA (autocast turns
itself off, FSDP asks CUDA for its device), so it would not be the real code either. Where the code asks the device
for free memory (generator.available_memory, sizing a KV pool by rollout.kv_cache_fraction) it gets the GPU's HBM
minus what this rank holds. Not counted, so left to the headroom (--headroom, default: peak <= 0.9 x HBM): the CUDA
context and NCCL's buffers, the caching allocator's fragmentation, cuBLAS / flash-attn workspaces, CUDA graphs
(the estimate builds the Generator with compile_decode off) and anything a kernel allocates internally.

The batch. Prompts are data.max_prompt_tokens / 2 tokens (capped by the rollout length); every response has the
same length near rollout.max_new_tokens, chosen so that k sequences fill train.micro_batch_tokens exactly (the
largest micro-batches the trainer packs, k = ceil(micro_batch_tokens / (prompt + max_new_tokens))). `--batch full`
trains prompts_per_step x samples_per_prompt such sequences; the default `--batch steady` trains fewer -- per DP
rank and PPO minibatch pp + 1 full micro-batches, all train.ppo_minibatches minibatches -- which reaches the same
steady state (1F1B keeps at most pp micro-batches in flight, the optimizer state exists from the first minibatch
on) at a fraction of the time; only the packed batch rows of the sequences left out (~40 bytes per token) are
missing. --validate measures both against real runs.

Validation (--validate, tests/dist/test_measured_ranks.py). Two small models (a tied Qwen2, an untied GQA Llama) on
three layouts (dp 2 under FSDP, tp 2, pp 2), each with a rollout rank, run for real on CPU processes (gloo, real
tensors, the config's full batch) with torch.profiler recording every allocation (allocator level: what kernels
allocate for themselves too), then estimated in the same processes. The estimate is within 15% of the measured peak
(see docs/planner.md for the numbers). Shims the fake run needs are listed in `fake_runtime`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

WHERE_FRAMES = 4  # the innermost frames of the runtime's code at the peak, reported with each rank
KINDS = ("weights", "grads", "optimizer", "activations", "logits", "kv", "sync_buffers")
GB = 1e9  # cost_model's unit: hbm_gb is in 1e9 bytes
STEADY, FULL = "steady", "full"


# ----------------------------------------------------------------------------------------------------------------
# the tracker: torch's MemTracker, its storages sorted into our kinds at every new peak


def _tracker_class():
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType, _UpdateType

    class Extra(_RefType):
        LOGITS = "Logits"
        KV = "KV"
        SYNC = "Sync"

    class NoModuleStats:
        """MemTracker's module-wise statistics cost a walk over every module at every operation, and refuse a root
        module called twice (the trainer calls its stage once per micro-batch); only the total peak is wanted here,
        so the module hooks are not installed. Backward is told apart as ModTracker does."""

        parents = {"Global"}

        @property
        def is_bw(self) -> bool:
            return torch._C._current_graph_task_id() != -1

        def register_user_hooks(self, *hooks) -> None:
            pass

        def clear_user_hooks(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *args) -> None:
            pass

    class PeakTracker(MemTracker):
        """MemTracker over one rank. Its own labels come from hooks that see a parameter or gradient only when it is
        used (FSDP assigns sharded gradients directly), so at every new peak the storages of the watched modules'
        and optimizers' parameters and gradients are relabelled first. New storages are labelled by the current
        phase (`phase`: KV while a Generator is built, SYNC during the weight sync), or as logits by shape."""

        def __init__(self, vocab_dims: set[int]):
            super().__init__()
            self._mod_tracker = NoModuleStats()
            self._ref_class = (*_MemRefType, *Extra)
            self.vocab_dims = set(vocab_dims)
            self.phase = None
            self.modules: list[torch.nn.Module] = []
            self.optimizers: list[torch.optim.Optimizer] = []
            self.peak_where: list[str] = []

        def watch(self, *objs) -> None:
            for obj in objs:
                if isinstance(obj, torch.nn.Module):
                    self.modules.append(obj)
                elif isinstance(obj, torch.optim.Optimizer):
                    self.optimizers.append(obj)

        def _track(self, reftype, t: torch.Tensor) -> None:
            if not self._in_opt:
                if self.phase is not None:
                    reftype = self.phase
                elif t.dim() >= 2 and t.shape[-1] in self.vocab_dims and t.is_floating_point():
                    reftype = Extra.LOGITS
            super()._track(reftype, t)

        def _relabel(self, t: torch.Tensor, reftype) -> None:
            for st in get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.reftype != reftype:  # only storages this rank allocated
                    old, winfo.reftype = winfo.reftype, reftype
                    self._update_snap(_UpdateType.REF, winfo, old_reftype=old)

        def _refresh_labels(self) -> None:
            params = {}
            for m in self.modules:
                params.update((id(p), p) for p in m.parameters())
                for b in m.buffers():
                    self._relabel(b, _MemRefType.BUFFER)
            for opt in self.optimizers:
                params.update((id(p), p) for group in opt.param_groups for p in group["params"])
            for p in params.values():
                self._relabel(p, _MemRefType.PARAM)
                if p.grad is not None:
                    self._relabel(p.grad, _MemRefType.GRAD)

        def _update_peak_stats(self, peak_state) -> None:
            if any(s["Total"] > self._peak_mem.get(d, 0) for d, s in self._curr_mem_snap.items() if d.type == "cpu"):
                self._refresh_labels()
                self.peak_where = self._where()
            super()._update_peak_stats(peak_state)

        @staticmethod
        def _where() -> list[str]:
            """The runtime's frames at the peak (this repository's files, innermost last)."""
            frames = traceback.extract_stack()[:-3]
            ours = [f for f in frames if f.filename.startswith(str(ROOT)) and "site-packages" not in f.filename]
            return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours if not f.filename.endswith(__file__)]

        @property
        def current_bytes(self) -> int:
            return self._curr_mem_snap.get(torch.device("cpu"), {}).get("Total", 0)

        def peak_by_kind(self, device: str = "cpu") -> dict[str, int]:
            snap = self.get_tracker_snapshot("peak").get(torch.device(device), {})
            total = {k: snap.get(k, 0) for k in (*_MemRefType, *Extra, "Total")}
            m = _MemRefType
            out = {
                "weights": total[m.PARAM] + total[m.BUFFER],
                "grads": total[m.GRAD],
                "optimizer": total[m.OPT],
                "activations": total[m.ACT] + total[m.TEMP] + total[m.OTH],
                "logits": total[Extra.LOGITS],
                "kv": total[Extra.KV],
                "sync_buffers": total[Extra.SYNC],
            }
            out["peak_bytes"] = total["Total"]
            return out

    return PeakTracker, Extra


# ----------------------------------------------------------------------------------------------------------------
# the fake runtime: what the real code needs to run on fake tensors


@contextlib.contextmanager
def fake_runtime(free_bytes=None):
    """FakeTensorMode plus shims for what fake tensors cannot do, each undone on exit:
    (1) Module.to(device) moves each parameter and buffer to a new one (torch would swap the parameters in place,
        which fails for fake tensors the fake mode keeps weak references to);
    (2) DeviceMesh.from_group builds its (small, host) rank tensor outside the fake mode, which cannot read it;
    (3) .item() / .tolist() of a fake tensor whose value is unknown give 1.0, 0 or True (data no allocation
        depends on: metrics, a finite grad norm, sampled token 0, checksums that agree); known constants (a tensor
        made from Python numbers, through fake collectives) keep their value;
    (4) nonzero (boolean-mask indexing) of an unknown mask returns every position (an upper bound: the loss
        statistics' masked selections), of a known constant its true positions;
    (5) PackedSeqs.build, whose index tensors depend on the packed lengths' values, runs on real tensors and hands
        the trainer fake copies (allocated under the tracker);
    (6) generator.available_memory answers `free_bytes()` (the HBM left), as CUDA's free memory would.
    Yields the mode; module deep copies (the trainer copies the rotary module) need FakeCopyMode(mode) around them."""
    import dataclasses

    import torch._subclasses.fake_impls as fake_impls
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    import generator
    from parallel.packed_attention import PackedSeqs

    def module_to(self, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or dtype is not None:
            return original["to"](self, *args, **kwargs)
        moved: dict[int, torch.Tensor] = {}  # one new tensor per old one: tied parameters stay tied
        for module in self.modules():
            for store, wrap in ((module._parameters, True), (module._buffers, False)):
                for name, t in store.items():
                    if t is None or t.device == device:
                        continue
                    if id(t) not in moved:
                        new = t.detach().to(device)
                        moved[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new
                    store[name] = moved[id(t)]
        return self

    def from_group(*args, **kwargs):
        with unset_fake_temporarily():
            return original["from_group"](*args, **kwargs)

    scalar_ops = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
    nonzero_op = torch.ops.aten.nonzero.default
    impls = fake_impls.op_implementations_dict
    original = {
        "to": torch.nn.Module.to,
        "from_group": DeviceMesh.from_group,
        "available_memory": generator.available_memory,
        "build": PackedSeqs.__dict__["build"],
        **{op: impls[op] for op in (*scalar_ops, nonzero_op)},
    }

    def scalar(fake_mode, func, arg):
        try:
            return original[func](fake_mode, func, arg)
        except DataDependentOutputException:
            return 1.0 if arg.dtype.is_floating_point else True if arg.dtype == torch.bool else 0

    def nonzero(fake_mode, func, arg):
        constant = getattr(arg, "constant", None)
        n = int(torch.count_nonzero(constant)) if constant is not None else arg.numel()
        return arg.new_empty_strided((n, arg.dim()), (1, n), dtype=torch.int64)

    def build(cls, seq_lens, device):
        with unset_fake_temporarily():
            packed = original["build"].__func__(cls, seq_lens, "cpu")
        if packed is None:
            return None

        def fake(v):
            return mode.from_tensor(v).clone() if isinstance(v, torch.Tensor) else v

        fakes = {f.name: fake(getattr(packed, f.name)) for f in dataclasses.fields(packed)}
        fakes["bins"] = [tuple(fake(x) for x in b) for b in packed.bins]
        return dataclasses.replace(packed, **fakes)

    torch.nn.Module.to = module_to
    DeviceMesh.from_group = staticmethod(from_group)
    PackedSeqs.build = classmethod(build)
    for op in scalar_ops:
        impls[op] = scalar
    impls[nonzero_op] = nonzero
    if free_bytes is not None:
        generator.available_memory = lambda device: max(0, int(free_bytes()))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        torch.nn.Module.to = original["to"]
        DeviceMesh.from_group = staticmethod(original["from_group"])
        PackedSeqs.build = original["build"]
        generator.available_memory = original["available_memory"]
        for op in (*scalar_ops, nonzero_op):
            impls[op] = original[op]


# ----------------------------------------------------------------------------------------------------------------
# inputs: the model's shape, the run's dtypes, the batch


def hf_config(cfg, plan: dict | None = None):
    """The HF config of the run's model without downloading it: a local directory's config.json, else the shipped
    shape in exp/models/ named after the hub id, else the plan's model (schedule.py records it)."""
    from transformers import AutoConfig

    path = Path(cfg.model.path)
    local = path if path.is_absolute() else ROOT / path
    if (local / "config.json").exists():
        return AutoConfig.from_pretrained(local)
    shipped = ROOT / "exp" / "models" / f"{path.name.lower()}.json"
    if shipped.exists():
        fields = json.loads(shipped.read_text())
    elif plan is not None and "model" in plan.get("inputs", {}):
        fields = {k: v for k, v in plan["inputs"]["model"].items() if not k.startswith("_")}
    else:
        raise SystemExit(f"error: no config.json for model.path '{cfg.model.path}' (looked in {local}, {shipped})")
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def gpu_dtypes(cfg) -> tuple[torch.dtype, torch.dtype]:
    """(the rollout model's dtype = the weight-sync dtype, the trainer's compute dtype) on a GPU: train.py's
    resolve_dtype with a CUDA device ("auto" is bfloat16 there), and make_trainer's rule."""
    model = torch.bfloat16 if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    return model, torch.bfloat16 if model == torch.bfloat16 else torch.float32


def batch_shape(cfg) -> tuple[int, int, int]:
    """(prompt tokens, response tokens, sequences per full micro-batch): see the module docstring."""
    r, t = cfg.rollout, cfg.train
    prompt = max(1, min(cfg.data.max_prompt_tokens // 2, r.max_seq_len - r.max_new_tokens))
    per_micro = max(1, math.ceil(t.micro_batch_tokens / (prompt + r.max_new_tokens)))
    response = min(r.max_new_tokens, t.micro_batch_tokens // per_micro - prompt)
    if response < 1:  # a prompt alone fills the micro-batch
        response, per_micro = 1, max(1, t.micro_batch_tokens // (prompt + 1))
    return prompt, response, per_micro


def batch_size(cfg, dp: int, pp: int, batch: str) -> int:
    full = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
    if batch == FULL:
        return full
    _, _, per_micro = batch_shape(cfg)
    return min(full, cfg.train.ppo_minibatches * dp * (pp + 1) * per_micro)


def trajectories(cfg, n: int, vocab: int) -> list:
    from buffer import Trajectory

    prompt, response, _ = batch_shape(cfg)
    out = []
    for i in range(n):
        ids = [1 + (i + j) % (vocab - 1) for j in range(prompt + response)]
        out.append(
            Trajectory(
                prompt_id=i,
                sample_idx=0,
                prompt_ids=ids[:prompt],
                response_ids=ids[prompt:],
                behav_logprobs=[-1.0] * response,
                versions=[0] * response,
                reward=float(i % 2),
                advantage=0.5 if i % 2 else -0.5,
                group_id=i,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------------------
# one rank: the same code runs it on fake tensors (estimate) and on real ones (--validate's measurement)


def _relay_and_mates(groups) -> tuple[int, list[int]]:
    """The leader the weights go to (the relay of the machine with the most replica leaders) and its machine-mates:
    the relay's worst case, 2 buckets in flight."""
    by_machine: dict[int, list[int]] = {}
    for r in groups.replicas:
        by_machine.setdefault(r.machine, []).append(r.leader)
    leaders = sorted(max(by_machine.values(), key=len))
    return leaders[0], leaders[1:]


def host_model(hf_cfg, fake: bool):
    """The HF model Trainer._load makes (fp32), in host memory. Under the tracker the host is the "meta" device and
    the GPU is "cpu": a tracker counts every storage an operation touches, views of the host weights included."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta") if fake else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)


def run_train_rank(
    cfg, groups, model, *, batch: str = STEADY, tracker=None, fake_mode=None, sync: bool = True, device: str = "cpu"
):
    """What a train rank allocates: Trainer(model, ...), ONE train_step, then ONE weight sync in which DP replica 0
    sends its stage (parallel/weight_sync.send_version). `tracker` (a PeakTracker, entered by the caller) is told
    what to watch and which phase runs; `fake_mode` wraps the construction in FakeCopyMode."""
    from torch._subclasses.fake_tensor import FakeCopyMode

    from parallel.trainer import Trainer
    from parallel.weight_sync import send_version

    model_dtype, compute_dtype = gpu_dtypes(cfg)
    with FakeCopyMode(fake_mode) if fake_mode is not None else contextlib.nullcontext():
        trainer = Trainer(model, groups, cfg.train, device, temperature=cfg.rollout.temperature or 1.0,
                          compute_dtype=compute_dtype)  # fmt: skip
    del model
    if tracker is not None:
        tracker.watch(*[v for v in vars(trainer).values() if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))])
    trainer.train_step(trajectories(cfg, batch_size(cfg, groups.dp, groups.pp, batch), trainer.hf_config.vocab_size))
    if sync and groups.replicas:
        relay, _ = _relay_and_mates(groups)
        with _phase(tracker, "SYNC"):
            send_version(trainer, {relay: [0] * groups.pp}, model_dtype, int(cfg.dist.weight_bucket_mb * 2**20),
                         cfg.dist.rollout_timeout_s, cfg.dist.verify_weights)  # fmt: skip
    return trainer


def run_rollout_rank(cfg, groups, hf_cfg, *, tracker=None, sync: bool = True):
    """What a rollout rank allocates: its model in the rollout dtype (train.py's load_policy), the Generator as
    RolloutWorker builds it, ONE weight version as its machine's relay (weight_sync.receive_version; under TP through
    ReplicaLink.share_weights), then ONE Generator.step() with every slot holding its share of the KV pool, at most
    max_seq_len tokens (its prefill included)."""
    from transformers import AutoModelForCausalLM

    from generator import Generator, SamplingParams, gpu_options, kv_options
    from parallel import sync_layout
    from parallel.replica import ReplicaLink
    from parallel.weight_sync import bucket_meta, receive_version
    from planner.specs import model_from_config

    model_dtype, _ = gpu_dtypes(cfg)
    replica, r = groups.replica, cfg.rollout
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=model_dtype).eval()
    if tracker is not None:
        tracker.watch(model)
    full_shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    link = ReplicaLink(replica.group, replica.ranks, torch.device("cpu")) if replica.tp > 1 else None
    # what gpu_options gives on a GPU, less what cannot run here: CUDA graphs and flash-attn; "row" is what the
    # weight layout "auto" means off the CPU
    options = gpu_options(torch.device("cpu"), "never", "never")
    options.update(compile_decode=False, use_flash_attn=False, weight_layout="row")
    if link is not None:
        options["tp_group"] = link.group
    with _phase(tracker, "KV"):
        gen = Generator(model, max_batch_size=r.max_batch_size, max_seq_len=r.max_seq_len,
                        interrupt_mode=r.interrupt_mode, **kv_options(r), **options)  # fmt: skip
    if sync:
        spec = model_from_config(hf_cfg.to_dict())
        itemsize = torch.empty((), dtype=model_dtype).element_size()
        stages = [tuple(x) for x in groups.stage_layers]
        buckets = sync_layout.sync_buckets(
            sync_layout.hf_param_table(spec), stages, itemsize, int(cfg.dist.weight_bucket_mb * 2**20)
        )
        metas = [bucket_meta(b, full_shapes, model_dtype) for b in buckets]
        with _phase(tracker, "SYNC"):
            if link is None or link.is_leader:
                if link is not None:  # the control objects a leader shares stay as they are on the leader
                    link.share = lambda obj: obj
                relay, mates = _relay_and_mates(groups)
                me = dist.get_rank()
                msg = {"version": 1, "buckets": metas, "verify": cfg.dist.verify_weights, "source": None,
                       "owners": [groups.owner_ranks[s][0] for s in range(len(stages))],
                       "forward": mates if me == relay else []}  # fmt: skip

                def apply(tensors: dict, last: bool) -> None:
                    gen.update_weights(link.share_weights(tensors) if link is not None else tensors, 1, last=last)

                receive_version(msg, groups.weight_links, torch.device("cpu"), apply, cfg.dist.rollout_timeout_s)
            else:  # a follower gets each bucket from its leader: the names and shapes it would share, then the data
                for i, meta in enumerate(metas):
                    names = [(n, tuple(shape), meta["dtype"]) for n, shape in zip(meta["names"], meta["shapes"])]
                    link.share = lambda obj, names=names: names
                    gen.update_weights(link.share_weights(None), 1, last=i == len(metas) - 1)
    slots = gen.max_batch_size
    pool = getattr(gen, "kv_pool", None)
    capacity = pool.num_blocks * pool.block_size if pool is not None else slots * r.max_seq_len
    length = max(2, min(r.max_seq_len, capacity // slots))
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=1)
    vocab = hf_cfg.vocab_size
    for i in range(slots):
        gen.add_request(i, [1 + (i * 131 + j) % (vocab - 1) for j in range(length)], params)
    gen.step()
    return gen


_TRACKER = []  # the PeakTracker class and its extra kinds, made once per process


def _phase(tracker, name: str | None):
    @contextlib.contextmanager
    def scope():
        if tracker is None:
            yield
            return
        tracker.phase = getattr(_TRACKER[1], name)
        try:
            yield
        finally:
            tracker.phase = None

    return scope()


def new_tracker(hf_cfg, tp: int):
    if not _TRACKER:
        _TRACKER.extend(_tracker_class())
    return _TRACKER[0]({hf_cfg.vocab_size, hf_cfg.vocab_size // tp})


def init_fake(world_size: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def estimate_rank(cfg, plan: dict, rank: int, hbm_bytes: float, batch: str = STEADY, hf_cfg=None) -> dict:
    """The peak by kind of one rank, run on fake tensors; this process's default group must be the fake one."""
    from parallel.groups import build_groups

    torch.manual_seed(0)
    groups = build_groups(plan)
    hf_cfg = hf_cfg or hf_config(cfg, plan)
    t0 = time.perf_counter()
    if groups.role not in ("train", "rollout"):
        return {"rank": rank, "role": groups.role, **dict.fromkeys(KINDS, 0), "peak_bytes": 0, "seconds": 0.0}
    tracker = new_tracker(hf_cfg, groups.tp if groups.role == "train" else groups.replica.tp)
    with fake_runtime(free_bytes=lambda: hbm_bytes - tracker.current_bytes) as mode:
        if groups.role == "train":
            model = host_model(hf_cfg, fake=True)
            with tracker:
                run_train_rank(cfg, groups, model, batch=batch, tracker=tracker, fake_mode=mode)
        else:
            with tracker:
                run_rollout_rank(cfg, groups, hf_cfg, tracker=tracker)
    out = tracker.peak_by_kind()
    return {"rank": rank, "role": groups.role, **{k: out[k] for k in KINDS}, "peak_bytes": out["peak_bytes"],
            "where": tracker.peak_where[-WHERE_FRAMES:], "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# the plan's distinct ranks


def distinct_ranks(plan: dict) -> list[dict]:
    """One entry per kind of rank (see the module docstring): its representative rank and the ranks it stands for."""
    ranks = plan["ranks"]
    out = []
    train = plan["train"]
    for stage in train["stages"]:
        members = [r for r in ranks if r["role"] == "train" and r["pp"] == stage["pp"]]
        for first in (True, False) if train["tp"] > 1 else (True,):
            alike = sorted(r["rank"] for r in members if (r["tp"] == 0) == first)
            rep = min(r["rank"] for r in members if r["dp"] == 0 and r["tp"] == (0 if first else 1))
            what = f"stage {stage['pp']} tp {'0' if first else '1..' + str(train['tp'] - 1)}"
            out.append({"rank": rep, "role": "train", "gpu_type": stage["gpu_type"], "what": what, "ranks": alike})
    shapes: dict[tuple[str, int], list[dict]] = {}
    for rep in plan["rollout"]["replicas"]:
        shapes.setdefault((rep["gpu_type"], rep["tp"]), []).append(rep)
    machine = {r["rank"]: r.get("machine", 0) for r in ranks}
    for (gpu_type, tp), reps in sorted(shapes.items()):
        per_machine: dict[int, list[dict]] = {}
        for rep in reps:
            per_machine.setdefault(machine[rep["ranks"][0]], []).append(rep)
        busiest = max(per_machine.values(), key=len)
        relay = min(busiest, key=lambda rep: rep["ranks"][0])
        leaders = sorted(rep["ranks"][0] for rep in reps)
        followers = sorted(r for rep in reps for r in rep["ranks"][1:])
        out.append({"rank": relay["ranks"][0], "role": "rollout", "gpu_type": gpu_type,
                    "what": f"replica tp{tp} leader", "ranks": leaders})  # fmt: skip
        if tp > 1:
            out.append({"rank": relay["ranks"][1], "role": "rollout", "gpu_type": gpu_type,
                        "what": f"replica tp{tp} follower", "ranks": followers})  # fmt: skip
    return out


def hbm_of(plan: dict, gpu_type: str) -> float:
    return float(plan["inputs"]["cluster"]["gpu_types"][gpu_type]["hbm_gb"]) * GB


# ----------------------------------------------------------------------------------------------------------------
# --validate: estimates against the peaks measured on real tensors (CPU, gloo)

VALIDATION_MODELS = {
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
    "llama": dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1536, tie_word_embeddings=False),
}  # fmt: skip
VALIDATION_LAYOUTS = {"dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2)}


def validation_config():
    """A GPU config's knobs at CPU size: bf16 compute, activation checkpointing, chunked log-probs, 2 PPO
    minibatches of 16 sequences of 128 tokens, micro-batches of 512 tokens, a KV cache of 8 x 160 tokens."""
    from config import Config

    cfg = Config()
    cfg.model.dtype = "bfloat16"
    cfg.data.max_prompt_tokens = 32
    r, t = cfg.rollout, cfg.train
    r.samples_per_prompt, r.max_new_tokens, r.max_seq_len, r.max_batch_size = 8, 112, 160, 8
    t.prompts_per_step, t.ppo_minibatches, t.micro_batch_tokens = 4, 2, 512
    t.activation_checkpointing, t.logprob_chunk_tokens = True, 128
    cfg.dist.weight_bucket_mb = 4.0
    return cfg


def measured_peak(prof) -> tuple[int, int]:
    """(low, high): the most bytes alive at once among the CPU allocations the profiler recorded -- allocator level,
    so what kernels allocate for themselves is in. The profiler does not see a block freed on another thread (a
    gloo worker dropping the last reference to a collective's tensor). `high` counts such a block alive until its
    address is handed out again, `low` leaves out every block whose free it did not see (everything the measured
    code allocated is dropped before the profile ends, so those are exactly the unseen frees); the true peak lies
    in between."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "trace.json")
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    memory = sorted((e["ts"], i, e["args"]["Addr"], e["args"]["Bytes"]) for i, e in enumerate(events)
                    if e.get("name") == "[memory]")  # fmt: skip
    live: dict[int, int] = {}
    unseen = set()
    for _, i, addr, nbytes in memory:
        if nbytes > 0:
            if addr in live:
                unseen.add(live[addr])
            live[addr] = i
        else:
            live.pop(addr, None)
    unseen |= set(live.values())

    def peak(skip: set) -> int:
        alive: dict[int, int] = {}
        total = best = 0
        for _, i, addr, nbytes in memory:
            if nbytes > 0:
                total -= alive.pop(addr, 0)
                if i not in skip:
                    alive[addr] = nbytes
                    total += nbytes
            else:
                total -= alive.pop(addr, 0)
            best = max(best, total)
        return best

    return peak(unseen), peak(set())


def _validation_rank(rank: int, world: int, folder: str, cases: list[tuple[str, str]], batches: tuple) -> None:
    import gc

    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from parallel.groups import build_groups
    from plan import make_train_plan, stage_layer_ranges

    torch.set_num_threads(1)
    cfg = validation_config()
    rows = []
    for k, (model_name, layout) in enumerate(cases):
        fields = dict(VALIDATION_MODELS[model_name])
        hf_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        dp, tp, pp = VALIDATION_LAYOUTS[layout]
        plan = make_train_plan(dp, tp, pp, stage_layer_ranges(hf_cfg.num_hidden_layers, pp), world_size=world)
        dist.init_process_group("gloo", init_method=f"file://{folder}/store{k}", rank=rank, world_size=world)
        groups = build_groups(plan)
        torch.manual_seed(0)
        model = host_model(hf_cfg, fake=False) if groups.is_train else None
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            if groups.is_train:
                run_train_rank(cfg, groups, model, batch=FULL)
            else:
                run_rollout_rank(cfg, groups, hf_cfg)
            gc.collect()  # what the run made is gone before the profile ends
        low, high = measured_peak(prof)
        del model, prof
        dist.barrier()
        dist.destroy_process_group()
        init_fake(world, rank)
        est = {b: estimate_rank(cfg, plan, rank, 1e12, batch=b, hf_cfg=hf_cfg) for b in batches}
        dist.destroy_process_group()
        rows.append({"model": model_name, "layout": layout, "rank": rank, "role": groups.role, "measured_low": low,
                     "measured_high": high, "estimated": est[STEADY]["peak_bytes"],
                     "estimated_full_batch": est[FULL]["peak_bytes"] if FULL in est else None,
                     "kinds": {k: est[STEADY][k] for k in KINDS}})  # fmt: skip
    Path(folder, f"rank{rank}.json").write_text(json.dumps(rows))


def validate(cases: list[tuple[str, str]], world: int = 3, full_batch: bool = True) -> list[dict]:
    """Each (model, layout) of `cases` run for real on `world` CPU processes (the layout's train ranks, the rest
    rollout ranks) on the config's full batch with the profiler recording allocations, then estimated on fake
    tensors in the same processes (the default steady batch, and with `full_batch` the full one too). One row per
    rank and case; `error` is the estimate's relative distance to the measured range (0 inside it)."""
    import torch.multiprocessing as mp

    batches = (STEADY, FULL) if full_batch else (STEADY,)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_validation_rank, args=(world, folder, cases, batches), nprocs=world, join=True)
        rows = [row for r in range(world) for row in json.loads(Path(folder, f"rank{r}.json").read_text())]
    for row in rows:
        est, low, high = row["estimated"], row["measured_low"], row["measured_high"]
        row["error"] = est / high - 1 if est > high else est / low - 1 if est < low else 0.0
        row["error_vs_low"], row["error_vs_high"] = est / low - 1, est / high - 1
    return sorted(rows, key=lambda r: (r["model"], r["layout"], r["rank"]))


def measure_train_step(config: str, overrides: list[str], layers: int | None, tol: float = 0.15) -> dict:
    """One train rank (dp 1, tp 1, pp 1, no rollout rank) of the config's model shape (random weights; `layers`
    overrides its depth) run for real on this machine's device -- CUDA when there is one -- for ONE train step at
    the config's shapes (the estimator's steady batch), its peak measured (CUDA: max_memory_allocated above what was
    allocated before; CPU: the profiler's allocation records, as --validate), then estimated on fake tensors in the
    same process. exp/gpu_check.sh runs it for the 1.5B config on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    from parallel.groups import build_groups
    from plan import make_train_plan

    cfg = load_run(config, overrides)
    hf_cfg = hf_config(cfg)
    if layers:
        hf_cfg.num_hidden_layers = layers
        if getattr(hf_cfg, "layer_types", None):
            hf_cfg.layer_types = hf_cfg.layer_types[:layers]
    n = hf_cfg.num_hidden_layers
    plan = make_train_plan(1, 1, 1, [(0, n)], world_size=1)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        groups = build_groups(plan)
        torch.manual_seed(0)
        model = host_model(hf_cfg, fake=False)
        t0 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            run_train_rank(cfg, groups, model, device="cuda")
            torch.cuda.synchronize()
            low = high = torch.cuda.max_memory_allocated() - before
            hbm = torch.cuda.get_device_properties(0).total_memory
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                run_train_rank(cfg, groups, model)
            low, high = measured_peak(prof)
            hbm = 0
        step_s = time.perf_counter() - t0
        del model
        dist.destroy_process_group()
    init_fake(1, 0)
    try:
        est = estimate_rank(cfg, plan, 0, hbm or 1e12, hf_cfg=hf_cfg)
    finally:
        dist.destroy_process_group()
    row = {"config": config, "layers": n, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "measured_low": low, "measured_high": high, "estimated": est["peak_bytes"], "hbm_bytes": hbm,
           "kinds": {k: est[k] for k in KINDS}, "seconds": round(step_s, 1)}  # fmt: skip
    row["error_vs_low"], row["error_vs_high"] = row["estimated"] / low - 1, row["estimated"] / high - 1
    row["ok"] = validation_ok(row, tol)
    return row


def validation_ok(row: dict, tol: float = 0.15) -> bool:
    """The estimate within tol of the measured peak: of its lower bound (every free the profiler saw; exact when no
    gloo thread freed anything) and not above its upper bound (those frees counted late) by more than tol."""
    est = row["estimated"]
    return abs(est / row["measured_low"] - 1) <= tol and est <= (1 + tol) * row["measured_high"]


def format_validation(rows: list[dict]) -> str:
    lines = [f"{'model':<6} {'layout':<6} {'rank':>4} {'role':<8} {'measured MiB (low-high)':>24} {'estimated MiB':>13} "
             f"{'vs low':>7} {'vs high':>8} {'full-batch est.':>15}"]  # fmt: skip
    for r in rows:
        full = "" if r["estimated_full_batch"] is None else f"{r['estimated_full_batch'] / 2**20:.2f}"
        measured = f"{r['measured_low'] / 2**20:.2f}-{r['measured_high'] / 2**20:.2f}"
        lines.append(
            f"{r['model']:<6} {r['layout']:<6} {r['rank']:>4} {r['role']:<8} {measured:>24} "
            f"{r['estimated'] / 2**20:>13.2f} {r['error_vs_low']:>+7.1%} {r['error_vs_high']:>+8.1%} {full:>15}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# CLI


def load_run(config: str, overrides: list[str]):
    from config import load_config

    return load_config([f"config={config}", *overrides])


def worker_main(spec: dict) -> int:
    """One rank in this process: prints `RESULT <json>`."""
    torch.set_num_threads(1)
    cfg = load_run(spec["config"], spec.get("overrides", []))
    plan = json.loads(Path(spec["plan"]).read_text())
    init_fake(int(plan["world_size"]), spec["rank"])
    out = estimate_rank(cfg, plan, spec["rank"], spec["hbm_bytes"], spec.get("batch", STEADY))
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


def run_workers(specs: list[dict], jobs: int) -> list[dict]:
    """Each spec in its own process, at most `jobs` at a time. A rank the runtime's code cannot build or step (it
    raises) gets {"error": its last line}: that rank would not run either."""
    pending, running, results = list(enumerate(specs)), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            i, spec = pending.pop(0)
            cmd = [sys.executable, "-m", "planner.memory", json.dumps(spec)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            running.append(
                (
                    i,
                    spec,
                    subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, cwd=ROOT),
                )
            )
        time.sleep(0.2)
        for item in list(running):
            i, spec, proc = item
            if proc.poll() is None:
                continue
            running.remove(item)
            out, err = proc.communicate()
            line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                last = [x for x in err.strip().splitlines() if x.strip()][-1:] or [f"exit {proc.returncode}"]
                results[i] = {"error": last[0].removeprefix(f"[rank{spec['rank']}]: ").strip()}
                continue
            results[i] = json.loads(line[len("RESULT ") :])
    return [results[i] for i in range(len(specs))]


def gb(x: float) -> str:
    return f"{x / GB:.1f}"


def format_table(rows: list[dict], headroom: float) -> str:
    head = f"{'rank':>5} {'role':<8} {'what':<24} {'gpu':<6} {'HBM GB':>7} {'peak GB':>8} {'use':>5}  "
    head += " ".join(f"{k[:7]:>7}" for k in KINDS) + "  fits"
    lines = [head]
    for r in rows:
        where = f"{r['rank']:>5} {r['role']:<8} {r['what']:<24} {r['gpu_type']:<6} {gb(r['hbm_bytes']):>7} "
        if "error" in r:
            lines.append(where + f"{'-':>8} {'-':>5}  the runtime refuses this rank: {r['error'][:150]}  NO")
            continue
        use = r["peak_bytes"] / r["hbm_bytes"]
        kinds = " ".join(f"{gb(r[k]):>7}" for k in KINDS)
        lines.append(where + f"{gb(r['peak_bytes']):>8} {use:>5.0%}  {kinds}  {'yes' if r['fits'] else 'NO'}")
    lines.append(f"(GB = 1e9 bytes; a rank fits when its peak <= {headroom:.2f} x its HBM)")
    return "\n".join(lines)


def estimate_plan(config: str, plan_path: str, overrides: list[str], headroom: float, jobs: int, batch: str):
    plan = json.loads(Path(plan_path).read_text())
    targets = distinct_ranks(plan)
    specs = [
        {"config": config, "overrides": overrides, "plan": str(Path(plan_path).resolve()), "rank": t["rank"],
         "hbm_bytes": hbm_of(plan, t["gpu_type"]), "batch": batch}
        for t in targets
    ]  # fmt: skip
    rows = []
    for t, spec, res in zip(targets, specs, run_workers(specs, jobs)):
        row = {"rank": t["rank"], "role": t["role"], "gpu_type": t["gpu_type"], "hbm_bytes": int(spec["hbm_bytes"])}
        if "error" in res:
            row.update(error=res["error"], fits=False, what=t["what"], ranks=t["ranks"])
        else:
            row.update(peak_bytes=res["peak_bytes"], **{k: res[k] for k in KINDS}, what=t["what"], ranks=t["ranks"],
                       where=res.get("where", []), seconds=res.get("seconds"))  # fmt: skip
            row["fits"] = row["peak_bytes"] <= headroom * row["hbm_bytes"]
        rows.append(row)
    return rows


if __name__ == "__main__":  # one rank of run_workers
    sys.exit(worker_main(json.loads(sys.argv[1])))
