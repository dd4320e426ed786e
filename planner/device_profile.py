"""Measuring a device for the planner (`schedule.py profile`): the runtime's own code -- GEMMs at training shapes,
large copies, generator.Generator decode and prefill steps, parallel.trainer.Trainer steps and, on CPU, a weight-sync
bucket hop between two processes -- timed on this machine's device (CUDA if there is one, else one CPU core), then
fitted by profile_fit.finish_profile into the cost model's constants (mfu_train, mfu_infer, hbm_eff,
decode_overhead_s, train_overhead_s, mfu_decode; link_gbps and sync_latency_s). Apart from the planner's arithmetic,
which stays in cost_model (no torch), this is the one place the planner side runs the runtime."""

from __future__ import annotations

import platform
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpu_bench.co_load import decode_beside, start_peers
from generator import Generator, SamplingParams
from parallel.packing import dynamic_microbatches
from parallel.weight_sync import checksum
from planner import cost_model, profile_fit, specs
from planner.profile_models import PROFILE_MINIBATCHES, median, profiled_trainer, random_llama, random_trajectories


def _device_name(torch, device) -> str:

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} (CPU, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})"


# Shapes the profile runs, per device kind. GEMMs are training micro-batch shapes (tokens x hidden x out); the
# decode models are random Llamas (hidden, intermediate, layers, heads, kv heads, vocab) around the sizes a run on
# that device trains: the CPU demo's tiny model and two larger ones (which still fit this box's last-level cache:
# the bandwidth a CPU rank sees is the cache's when its model fits there, so the profile measures that regime).
#   decode          (batch, context) points on every model, memory-bound: the bandwidth + overhead line (on a CPU
#                   core one row per step; on a GPU up to 64 rows still read the weights once)
#   decode_compute  (batch, context) points past one row on the first `compute_models` models: a full rollout batch
#                   at a short context (compute-bound by the raw rates: the decode compute rate, mfu_decode) and a
#                   few rows, between the two roofs, where a max and a sum of them differ most (decode_combine)
#   train_model     the model the Trainer steps run on. On CPU that is the tiny one, the size CPU runs train: a
#                   train step's fixed part is mostly per-parameter work (AdamW, the fp64 gradient norm, fresh
#                   gradients), so the intercept of a 7x larger model's steps is no per-step constant for the demo's,
#                   and small GEMMs and elementwise ops run the tiny model's FLOPs at a lower rate than a larger one's
#   train           (trajectories, prompt, response): every point one micro-batch per PPO minibatch, 2 minibatches
#   link            bucket sizes of a weight-sync hop between two processes (CPU: gloo on this host)
NULL_MODEL = (64, 128, 4, 2, 1, 64)  # (hidden, intermediate, layers, heads, kv heads, vocab): next to no bytes
PROFILE_SHAPES = {
    "cpu": {
        "gemm": [(1024, 256, 680), (1024, 512, 1024), (1024, 1024, 1024)],
        "copy_bytes": 256 * 2**20,
        # the last: 4 layers of hidden 64 (0.3 MB), whose step is nearly all the per-step host work (dispatch,
        # sampling): it pins the line's intercept, which the larger models alone leave to noise
        "models": [(256, 680, 4, 8, 4, 388), (512, 1376, 6, 8, 4, 4096), (768, 2048, 8, 12, 4, 8192), NULL_MODEL],
        # (batch, context): one row per step, the weight-read-bound step. On a core a step of 2-4 rows costs up to
        # twice a 1-row one (each row another pass over the weights in the small-row matmuls), which the bytes +
        # overhead line cannot hold: such points pulled its intercept below 0 in one profile of three
        "decode": [(1, 64), (1, 192), (1, 320)],
        # a few rows (a small replica batch, exp/hetero_cpu.py's 8) and the CPU demo's max_batch_size at short
        # contexts: they tell the decode roof's two forms apart (profile_fit.finish_profile)
        "decode_compute": [(8, 64), (64, 16), (64, 32)],
        "compute_models": 2,
        "decode_steps": 16,
        "prefill": [(1, 64), (4, 64), (4, 128), (8, 128)],
        "train": [(4, 32, 32), (8, 32, 32), (8, 64, 64), (16, 64, 64)],  # (trajectories, prompt, response)
        # the largest train point again with micro-batches of 256 tokens: 4 per minibatch instead of 1, the same
        # FLOPs; what it costs more is each micro-batch's fixed part (microbatch_overhead_s)
        "train_split": [(16, 64, 64, 256)],
        # the TP-2 steps: one and four 1024-token micro-batches per minibatch, the CPU runs' size, so that the work
        # TP leaves whole separates into its part per token and its part per optimizer step
        "train_tp": [(16, 64, 64), (64, 64, 64)],
        "train_dp": [(16, 64, 64), (64, 64, 64)],  # the DP-2 steps: the same two sizes
        "train_mb": 1024,  # micro_batch_tokens (the CPU demo's)
        "work_model": 1,  # the model prefill runs on (an index into models)
        "train_model": 0,  # the model training runs on: the tiny one (see above)
        "link_bytes": [2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20],  # up to the runtime's 64 MiB bucket
        # a co-load peer (--co-load): a rollout replica of the CPU runs, exp/hetero_cpu.py's -- the tiny model
        # (models[co_load_model]), 8 slots, prompts of 64 and responses of 32 tokens, refilled as they finish
        "co_load_model": 0,
        "co_load_batch": (8, 64, 32),
        # a co-load train peer: the CPU runs' step, 128 trajectories of 29 + 25 tokens (2 minibatches)
        "co_load_train": (128, 29, 25),
        # a smoke run (--seconds < 30): two small models, fewer points
        "smoke": {
            "gemm": [(1024, 256, 680), (1024, 512, 1024)],
            "copy_bytes": 64 * 2**20,
            "models": [(256, 680, 4, 8, 4, 388), (512, 1376, 6, 8, 4, 4096), NULL_MODEL],  # 12, 86, 0.3 MB
            "work_model": 0,  # prefill and train on the tiny one
            "decode": [(1, 32), (1, 96)],
            "compute_models": 1,
            "prefill": [(1, 32), (4, 32), (4, 64)],
            "train": [(4, 16, 16), (8, 16, 32)],
            "train_split": [(8, 16, 32, 96)],
            "train_tp": [(8, 16, 32), (32, 16, 32)],
            "train_dp": [(8, 16, 32), (32, 16, 32)],
            "link_bytes": [2**20, 4 * 2**20, 16 * 2**20],
        },
    },
    "cuda": {
        "gemm": [(8192, 4096, 4096), (8192, 4096, 11008), (16384, 8192, 8192)],
        "copy_bytes": 2 * 2**30,
        "models": [(1024, 2816, 16, 16, 4, 32000), (2048, 5632, 16, 16, 4, 32000), (3072, 8192, 20, 24, 8, 32000)],
        "decode": [(1, 512), (16, 512), (16, 2048), (64, 1024)],
        "decode_compute": [],  # RL batches on a GPU stay memory-bound: mfu_decode is mfu_infer
        "compute_models": 0,
        "decode_steps": 32,
        "prefill": [(4, 512), (8, 1024), (16, 1024), (16, 2048)],
        "train": [(8, 256, 768), (16, 256, 768), (16, 512, 1536)],
        "train_mb": 16384,
        "work_model": 1,
        "train_model": 1,
        "link_bytes": [],  # a GPU pair's link (NCCL) is not profiled yet: the cluster's link_eff / sync_latency_s
        "smoke": {
            "models": [(1024, 2816, 8, 16, 4, 32000), (2048, 5632, 8, 16, 4, 32000)],
            "work_model": 0,
            "train_model": 0,
            "decode": [(1, 512), (16, 512), (16, 2048)],
            "prefill": [(4, 512), (8, 1024), (16, 1024)],
            "train": [(8, 256, 768), (16, 256, 768)],
        },
    },
}


def profile_device(
    gpu: specs.GPUType,
    seconds: float = 120.0,
    log=print,
    nominal: str = "type",
    throttle=None,
    co_load: int = 0,
    co_load_trainers: int = 0,
    beside: dict | None = None,
) -> dict:
    """Measure this machine's device (CUDA if present, else CPU with one thread per process, as a CPU rank runs) in
    one process with torch and the runtime's own code, and return the device-profile structure (schedule.py
    profile writes it as YAML). `gpu` is the cluster GPU type whose nominal tflops / hbm_tbps the fractions are of.
      gemm      dense matmuls at training micro-batch shapes in the compute dtype (bf16 on a GPU, fp32 on CPU)
      copy      large device-to-device copies (bytes read + written); gemm and copy are the peaks, measured first and
                last (the faster pass counts)
      decode    generator.Generator steps over random HF Llamas at a few batch sizes and contexts; fitted by least
                squares to step = bytes / bandwidth + overhead, bytes = cost_model.decode_bytes_per_step (weights + the KV read)
      prefill   Generator prefill of fresh prompts: step = FLOPs / rate + overhead
      decode_compute  Generator steps of a full batch at a short context (CPU): compute-bound by the raw rates;
                step = FLOPs / rate + the decode overhead (mfu_decode); and of a few rows: with them the fit also
                tries step = bytes / bandwidth + FLOPs / rate + overhead and keeps the form that fits better
      train     parallel.trainer.Trainer.train_step on one gloo rank (2 PPO minibatches, so the proximal log-prob
                recompute runs: 4 passes, as cost_model counts them): step = FLOPs / rate + overhead, the overhead
                per optimizer step (less the cost model's own optimizer term) being train_overhead_s
      train_tp  (CPU) the largest train point again as a tensor-parallel step of two processes: a TP rank still runs
                the work TP does not divide (norms, residual adds, the loss, each op's host work) and the
                all-reduces; what it took beyond the cost model's FLOPs / tp and all-reduce terms is tp_unsplit
      train_dp  (CPU) the same points as data-parallel steps of two processes, as the CPU recipes train (no FSDP):
                each rank its half of the batch, then the gradient all-reduce; what a step took beyond what the
                cost model charges a DP rank for it (1/dp of the FLOPs, the optimizer, the all-reduce over the
                type's intra link) is dp_overhead_s. The TP and DP steps keep both of the host's cores busy, where
                another tenant's burst shows most: each runs in two passes, before the decode points and after the
                training ones, and keeps the faster (`pass_s` records both)
      link      (CPU) one weight-sync bucket hop between this process and a second one over gloo, as
                parallel/weight_sync.py's owner makes it and a train rank waits for it: fill a fresh buffer,
                checksum it, send; the receiver takes it into a fresh buffer and acknowledges (its verify and copy-out
                are the relay's, off the clock). hop = bytes / bandwidth (sync.link_gbps); a tiny hop's seconds are
                the fixed cost (sync.sync_latency_s)
    `seconds` is the budget of the timed loops (each point runs at least twice); model builds add a little. A GPU
    is timed by the wall clock, a CPU by the process's CPU seconds (_Bench.clock).
    nominal "type": the fractions are of gpu's tflops / hbm_tbps; "measured": of this device's own GEMM FLOP/s and
    copy bandwidth (for a device without a trusted spec-sheet peak, e.g. a CPU core; the planner rescales them to
    the cluster's numbers).
    `throttle` (an emulation.Throttle of an emulated type): the Generator's steps run through it as an emulated
    rollout rank's do, padded after every step, and are timed by their CPU time as before (the padding not counted).
    Their constants are then this machine's as that type's rank gets it -- after each of the throttle's pauses, which
    cost the next step CPU time (exp/bench_throttle.py) -- and the planner applies the type's fractions on top.
    A training step's work is padded by its CPU time in the runtime (after the step, or before each wait of a
    pipeline stage on its neighbours) and the link is padded by its wall time, exactly: neither is throttled here, the link and the TP and DP steps are not measured, and a planner given this
    machine's profile first keeps its training constants for every type (profile_fit.apply_profile).
    `co_load` (CPU): the decode and prefill points are measured beside that many peer processes (cpu_bench/co_load.start_peers), each a
    rollout replica of the CPU runs decoding under the same throttle, as the other ranks a run puts on this host
    are busy beside each rank: they share its cores' caches and memory bandwidth, and a memory-bound step's CPU
    time grows with them (docs/planner.md, "Where the error is"). `co_load_trainers` of the peers are train ranks
    instead (Trainer.train_step of the CPU runs' shape, each step one piece padded by the throttle's compute
    fraction, as a train rank's is): a run's neighbours are trainers as well as replicas, and a trainer's GEMMs and
    optimizer stream other memory than a decode step. The profile records them (`co_load`).
    `beside` ({GPU type: its emulation.Throttle}; an emulated type with co-load trainers): a rollout replica's decode
    step (the co-load peers' shape) again beside the same co-load with its trainers under each type's throttle in
    turn, its wall and CPU seconds per step (`decode_beside`): a plan puts a rollout rank beside trainers of any type,
    and a faster type's trainers keep more of the shared cores busy -- the step costs more CPU time and waits for a
    core its padding does not absorb (exp/bench_cotenancy.py). profile_fit.finish_profile makes them
    TypeEfficiency.decode_beside."""

    start = time.perf_counter()
    bench = _Bench.for_this_device(seconds, throttle)
    _check_co_load(bench.cuda, co_load, co_load_trainers, throttle, beside)
    shapes = bench.shapes
    out: dict = {"device": _device_name(torch, bench.device), "dtype": str(bench.dtype).replace("torch.", "")}
    # The peaks are measured twice, first and last, and the faster pass counts: the fractions are of them, and a
    # neighbour that slowed a short pass once would otherwise read as an implausible >100% efficiency of every step
    first_gemm, first_copy = bench.peaks(0.5)
    log(
        f"gemm:    {max(first_gemm) * 1e3:9.1f} GFLOP/s (best of {[round(g * 1e3, 1) for g in first_gemm]}; again last)"
    )
    log(f"copy:    {first_copy * 1e3:9.1f} GB/s (read + write; again last)")
    # (e') train points again, tensor- and data-parallel over two processes of this machine (CPU: one GPU has no
    # second device; a type profile's training is the machine's, profile_fit.apply_profile). Both ranks keep both of
    # the host's cores busy, so another tenant's burst shows in them more than in any one-process point: they run in
    # two passes, here and after the training points, and each point keeps the faster pass (as the peaks do)
    train_dims = shapes["models"][shapes.get("train_model", shapes["work_model"])]
    parallel: dict[str, list[dict]] = {}
    bench.parallel_pass(parallel, train_dims, gpu.intra_gbps)
    # (c) decode and (d) prefill, through generator.Generator (the rollout rank's own decode loop)
    decode, prefill, peer_steps = bench.generator_steps(co_load, co_load_trainers, log)
    if co_load:
        batch, prompt, response = shapes["co_load_batch"]
        out["co_load"] = {
            "peers": co_load,
            "trainers": co_load_trainers,
            "train_batch": list(shapes["co_load_train"]),
            "model": list(shapes["models"][shapes["co_load_model"]]),
            **{"batch": batch, "prompt": prompt, "response": response},
            "peer_steps": peer_steps,  # Generator steps each peer made while the points were measured
        }
        log(f"co-load: the peers made {peer_steps} Generator steps meanwhile")
    if beside:
        out["decode_beside"] = decode_beside(
            beside, throttle, co_load, co_load_trainers, shapes, shapes["decode_steps"],
            seconds * SHARE["beside"], bench.requests, log,
        )  # fmt: skip
    # (e) a training step of parallel.trainer.Trainer on one rank
    train = _profile_train(
        random_llama(*train_dims),
        shapes["train"] + shapes.get("train_split", []),
        shapes["train_mb"],
        bench.device,
        bench.dtype,
        bench.timed,
        seconds * SHARE["train"],
    )
    last_gemm, last_copy = bench.peaks(0.5)
    gemm = [{"shape": list(shape), "tflops": max(a, b)} for shape, a, b in zip(shapes["gemm"], first_gemm, last_gemm)]
    gemm_tflops, copy_tbps = max(g["tflops"] for g in gemm), max(first_copy, last_copy)
    log(
        f"peaks:   gemm {gemm_tflops * 1e3:.1f} GFLOP/s, copy {copy_tbps * 1e3:.1f} GB/s (the faster of the first pass and "
        f"the last: {max(first_gemm) * 1e3:.1f} / {max(last_gemm) * 1e3:.1f} GFLOP/s, {first_copy * 1e3:.1f} / "
        f"{last_copy * 1e3:.1f} GB/s)"
    )
    out.update(gemm=gemm, gemm_tflops=gemm_tflops, copy_tbps=copy_tbps, decode=decode, prefill=prefill, train=train)
    # (e') the second pass of the TP and DP steps (the first ran before the decode points), the faster kept
    bench.parallel_pass(parallel, train_dims, gpu.intra_gbps)
    bench.close()
    for kind, passes in parallel.items():
        out[kind] = _faster_pass(passes)
        if out[kind]:
            steps = ", ".join(
                f"{p['tokens']} tokens {p['step_s'] * 1e3:.1f} ms (passes {' / '.join(f'{t * 1e3:.1f}' for t in p['pass_s'])})"
                for p in out[kind]["points"]
            )
            log(f"train:   {kind[-2:]} {max(out[kind]['dp'], out[kind]['tp'])} steps of {steps}")
    # (f) the weight-sync link between two processes of this machine
    if not bench.cuda and shapes.get("link_bytes") and throttle is None:
        out["link"] = _profile_link(shapes["link_bytes"], seconds * SHARE["link"])
    if out.get("link"):
        log(
            f"link:    {len(out['link']['points'])} bucket hops of {shapes['link_bytes'][0] >> 20}-"
            f"{shapes['link_bytes'][-1] >> 20} MiB, tiny hop {out['link']['latency_s'] * 1e3:.3f} ms"
        )
    return profile_fit.finish_profile(
        out, gpu, log, time.perf_counter() - start, measured_nominal=nominal == "measured"
    )


# the share of profile_device's `seconds` each kind of point gets
SHARE = {"gemm": 0.07, "copy": 0.06, "decode": 0.4, "prefill": 0.13, "train": 0.2, "train_tp": 0.05, "train_dp": 0.05,
         "link": 0.04, "beside": 0.5}  # fmt: skip


def _check_co_load(cuda: bool, co_load: int, co_load_trainers: int, throttle, beside: dict | None) -> None:
    if co_load < 0 or (co_load and cuda):
        raise specs.SpecError(f"co_load {co_load}: give a number of peer processes >= 0, on a CPU profile only")
    if not 0 <= co_load_trainers <= co_load:
        raise specs.SpecError(f"co_load_trainers {co_load_trainers}: give 0 to co_load ({co_load}) of the peers")
    if beside and (throttle is None or not co_load_trainers):
        raise specs.SpecError("beside: an emulated type's profile (a throttle) with co-load trainers to put beside it")


class _Requests:
    """Random prompts fed to a Generator and its steps run as the profiled rank runs them: through the emulated
    type's throttle, padded after every step, when there is one."""

    def __init__(self, throttle) -> None:
        self.rng = torch.Generator().manual_seed(0)
        self.next_id = 0
        self.step = (lambda gen: gen.step()) if throttle is None else throttle.generator_step  # the rank's own padding

    def add(self, gen, vocab: int, count: int, length: int, new_tokens: int) -> None:
        for p in torch.randint(0, vocab, (count, length), generator=self.rng).tolist():
            self.next_id += 1
            gen.add_request(self.next_id, p, SamplingParams(max_new_tokens=new_tokens, seed=self.next_id))

    def drain(self, gen) -> None:
        while gen.num_unfinished():
            self.step(gen)


class _Bench:
    """This machine's device as profile_device times it: its dtype, the shapes it runs, its clock."""

    def __init__(self, seconds: float, throttle) -> None:
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32  # the runtime's dtype "auto"
        self.nbytes = 2 if self.cuda else 4
        shapes = PROFILE_SHAPES["cuda" if self.cuda else "cpu"]
        if seconds < 30:  # a smoke run: smaller models, fewer points
            shapes = {**shapes, **shapes["smoke"]}
        self.shapes, self.seconds, self.throttle = shapes, seconds, throttle
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        # a GPU is timed by the wall clock (device synchronised); a CPU core by this process's CPU seconds: on a
        # shared, loaded machine the wall clock of a millisecond step measures the other processes' time slices
        self.clock = time.perf_counter if self.cuda else time.process_time
        self.requests = _Requests(throttle)
        self.parallel_peer: _ParallelPeer | None = None  # rank 1 of the TP and DP steps, from the first on

    @classmethod
    def for_this_device(cls, seconds: float, throttle) -> _Bench:
        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # one CPU rank is one process on one core (OMP_NUM_THREADS=1 in every CPU recipe)
        return cls(seconds, throttle)

    def timed(self, fn, budget_s: float, fastest: bool = False) -> float:
        """Median of fn()'s seconds over runs filling budget_s: one warm-up, then at least 2 and at most 50 runs; the
        fastest run instead with `fastest` (a peak: a neighbour only ever slows a run, and a median of a few short
        runs on a shared host reads below the device's peak). fn may return its own seconds (a float); otherwise
        the call is timed here, the device synchronised."""
        fn()
        self.sync()
        times: list[float] = []
        until = time.perf_counter() + budget_s
        while len(times) < 2 or (time.perf_counter() < until and len(times) < 50):
            t0 = self.clock()
            t = fn()
            self.sync()
            times.append(t if isinstance(t, float) else self.clock() - t0)
        return min(times) if fastest else median(times)

    def peaks(self, budget: float) -> tuple[list[float], float]:
        """(a) GEMM FLOP/s of each shape and (b) copy bandwidth (read + write), each point's fastest run over `budget`."""
        shapes, device, dtype, seconds = self.shapes, self.device, self.dtype, self.seconds
        gemm = []
        for m, k, n in shapes["gemm"]:
            a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
            t = self.timed(lambda a=a, b=b: a @ b, seconds * SHARE["gemm"] * budget / len(shapes["gemm"]), fastest=True)
            gemm.append(2 * m * k * n / t / 1e12)
        src = torch.ones(shapes["copy_bytes"] // self.nbytes, device=device, dtype=dtype)
        dst = torch.empty_like(src)
        t = self.timed(lambda dst=dst, src=src: dst.copy_(src), seconds * SHARE["copy"] * budget, fastest=True)
        return gemm, 2 * src.numel() * self.nbytes / t / 1e12

    def parallel_pass(self, parallel: dict[str, list[dict]], train_dims: tuple, intra_gbps: float) -> None:
        """One pass of the tensor- and data-parallel train points (CPU, no throttle), appended to `parallel`."""
        shapes = self.shapes
        for kind, dp, tp in (("train_tp", 1, TRAIN_TP), ("train_dp", TRAIN_DP, 1)):
            if not self.cuda and self.throttle is None and shapes.get(kind) and not dist.is_initialized():
                points = [(len(shapes["train"]) + i, p) for i, p in enumerate(shapes[kind])]
                self.parallel_peer = self.parallel_peer or _ParallelPeer()
                parallel.setdefault(kind, []).append(
                    _profile_train_parallel(
                        self.parallel_peer,
                        train_dims,
                        points,
                        shapes["train_mb"],
                        intra_gbps,
                        self.seconds * SHARE[kind] / 2,
                        dp,
                        tp,
                    )
                )

    def close(self) -> None:
        if self.parallel_peer is not None:
            self.parallel_peer.close()
            self.parallel_peer = None

    def generator_steps(self, co_load: int, co_load_trainers: int, log) -> tuple[list[dict], list[dict], list[int]]:
        """(c) decode and (d) prefill points of generator.Generator over the profile's models, beside `co_load` peers:
        (decode points, prefill points, the Generator steps each peer made meanwhile)."""
        shapes, requests, sync, clock = self.shapes, self.requests, self.sync, self.clock
        models, decode_pts, prefill_pts = shapes["models"], shapes["decode"], shapes["prefill"]
        compute_pts, compute_models = shapes.get("decode_compute", []), shapes.get("compute_models", 0)
        steps = shapes["decode_steps"]
        decode, prefill = [], []
        n_decode = len(models) * len(decode_pts) + min(compute_models, len(models)) * len(compute_pts)
        peers = (
            start_peers(
                co_load,
                models[shapes["co_load_model"]],
                shapes["co_load_batch"],
                self.throttle,
                log,
                co_load_trainers,
                (shapes["co_load_train"], shapes["train_mb"]),
            )
            if co_load
            else None
        )
        try:
            for mi, dims in enumerate(models):
                hf, spec = random_llama(*dims)
                hf = hf.to(device=self.device, dtype=self.dtype)
                every = decode_pts + prefill_pts + (compute_pts if mi < compute_models else [])
                gen = Generator(
                    hf,
                    max_batch_size=max(b for b, _ in every),
                    max_seq_len=max(c for _, c in every) + steps + 8,
                )

                def run_decode(b: int, ctx: int, gen=gen, spec=spec) -> float:
                    requests.add(gen, spec.vocab, b, ctx, steps + 3)
                    requests.step(gen)  # prefill and the first token
                    sync()
                    t0 = clock()
                    for _ in range(steps):
                        requests.step(gen)
                    sync()
                    t = (clock() - t0) / steps
                    requests.drain(gen)
                    return t

                def run_prefill(b: int, length: int, gen=gen, spec=spec) -> None:
                    requests.add(gen, spec.vocab, b, length, 1)
                    requests.drain(gen)

                for b, ctx in decode_pts + (compute_pts if mi < compute_models else []):
                    t = self.timed(lambda b=b, ctx=ctx: run_decode(b, ctx), self.seconds * SHARE["decode"] / n_decode)
                    context = ctx + (steps + 1) / 2  # the mean K/V length the timed steps read
                    decode.append(
                        {
                            "model": spec.name,
                            "params": spec.params,
                            "batch": b,
                            "context": context,
                            "bytes": cost_model.decode_bytes_per_step(spec, b, context, self.nbytes),
                            "flops": b * (spec.layers * spec.layer_flops_per_token(context) + 2 * spec.head_params),
                            "step_s": t,
                        }
                    )
                if mi == shapes["work_model"]:
                    for b, length in prefill_pts:
                        t = self.timed(
                            lambda b=b, length=length: run_prefill(b, length),
                            self.seconds * SHARE["prefill"] / len(prefill_pts),
                        )
                        flops = b * (
                            length * spec.layers * spec.layer_flops_per_token((length - 1) / 2) + 2 * spec.head_params
                        )
                        prefill.append({"model": spec.name, "batch": b, "prompt": length, "flops": flops, "step_s": t})
                del gen, hf
        finally:
            peer_steps = peers.close() if peers is not None else []
        return decode, prefill, peer_steps


def _faster_pass(passes: list[dict]) -> dict:
    """One structure of _profile_train_parallel from its passes: the first's, each point's step_s the faster pass's
    and `pass_s` every pass's ({} where a pass measured nothing)."""
    if not passes or not all(passes):
        return {}
    out = {**passes[0], "points": []}
    for points in zip(*(p["points"] for p in passes)):
        seconds = [p["step_s"] for p in points]
        out["points"].append({**points[0], "step_s": min(seconds), "pass_s": seconds})
    return out


def _train_point(
    spec, optimizer_steps: int, n: int, prompt: int, response: int, step_s: float, micro_batch_tokens: int
) -> dict:

    length = prompt + response
    per_seq = length * (spec.layers * spec.layer_flops_per_token((length - 1) / 2) + 2 * spec.head_params)
    return {
        "model": spec.name,
        "params": spec.params,
        "optimizer_params": spec.optimizer_params,
        "optimizer_steps": optimizer_steps,
        "trajectories": n,
        "tokens": n * length,
        "flops": specs.Workload().train_passes * n * per_seq,  # forward + backward + the proximal recompute
        "micro_batch_tokens": micro_batch_tokens,
        # micro-batches per minibatch as the Trainer packs them (its n / optimizer_steps sequences)
        "microbatches": len(dynamic_microbatches([length] * (n // optimizer_steps), micro_batch_tokens)),
        "step_s": step_s,
    }


def _profile_train(hf_and_spec, points, micro_batch_tokens: int, device, dtype, timed, budget_s: float) -> list[dict]:
    """Trainer.train_step on one rank (gloo world of 1, or gloo + NCCL on a GPU) over random trajectories; a point
    (trajectories, prompt, response[, micro_batch_tokens]) may pack its minibatches finer than `micro_batch_tokens`."""

    hf, spec = hf_and_spec  # fp32 master weights; bf16 autocast on a GPU, as the runtime trains
    with tempfile.TemporaryDirectory() as tmp:
        own = not dist.is_initialized()
        if own:
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            trainers = {}
            rows = []
            for seed, (n, prompt, response, *mb) in enumerate(points):
                mb = mb[0] if mb else micro_batch_tokens
                if mb not in trainers:
                    trainers[mb] = profiled_trainer(hf, spec, 1, mb, device, dtype)
                batch = random_trajectories(spec.vocab, n, prompt, response, seed)
                t = timed(lambda batch=batch, trainer=trainers[mb]: trainer.train_step(batch), budget_s / len(points))
                rows.append(_train_point(spec, PROFILE_MINIBATCHES, n, prompt, response, t, mb))
            del trainers
        finally:
            if own:
                dist.destroy_process_group()
    return rows


TRAIN_TP = 2  # the tensor-parallel degree of the profile's TP steps (two processes of this machine)
TRAIN_DP = 2  # the data-parallel degree of its DP steps


def _parallel_step_loop(
    rank: int, init: str, dims: tuple, points: list, micro_batch_tokens: int, budget_s: float, dp: int, tp: int
) -> tuple[list[float], specs.ModelSpec]:
    """Both sides of the TP or DP steps (rank 0 here, rank 1 a spawned process): the same random Llama and batches on
    each, Trainer.train_step at dp x tp; per point one warm-up, then steps until rank 0's share of the budget is spent
    (at least 3, at most 20). A step's seconds are the larger of the two ranks' CPU seconds: the ranks wait for each
    other at every all-reduce, so the slower one sets the step, and CPU time leaves out other processes' time slices,
    as the rest of a CPU profile does. Rank 0 returns the medians and the model's cost-model spec."""

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=dp * tp, timeout=timedelta(seconds=LINK_TIMEOUT_S)
    )
    medians = []
    try:
        hf, spec = random_llama(*dims)
        trainer = profiled_trainer(hf, spec, tp, micro_batch_tokens, torch.device("cpu"), torch.float32, dp=dp)
        go, took = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
        for seed, point in points:
            batch = random_trajectories(spec.vocab, *point, seed=seed)
            times: list[float] = []
            until = time.perf_counter() + budget_s / len(points)
            while True:
                if rank == 0:
                    go.fill_(float(len(times) < 4 or (time.perf_counter() < until and len(times) < 21)))
                dist.broadcast(go, src=0)
                if not go.item():
                    break
                t0 = time.process_time()
                trainer.train_step(batch)
                took.fill_(time.process_time() - t0)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times.append(float(took.item()))
            medians.append(median(times[1:]))
        del trainer
    finally:
        dist.destroy_process_group()
    return medians, spec


def _parallel_peer_loop(jobs) -> None:
    while (job := jobs.get()) is not None:
        init, dims, points, micro_batch_tokens, dp, tp = job
        _parallel_step_loop(1, init, dims, points, micro_batch_tokens, 0.0, dp, tp)


class _ParallelPeer:
    """Rank 1 of every TP and DP step of a profile, one spawned process for all of them: each spawn imports torch
    and the runtime, seconds of a short profile."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.jobs = ctx.SimpleQueue()
        self.proc = ctx.Process(target=_parallel_peer_loop, args=(self.jobs,), daemon=True)
        self.proc.start()
        self.tmp = tempfile.TemporaryDirectory()
        self.runs = 0

    def start(self, dims: tuple, points: list, micro_batch_tokens: int, dp: int, tp: int) -> str:
        """Start its side of one run of steps; the init method of that run's process group."""
        if not self.proc.is_alive():
            raise RuntimeError(f"the profile's parallel peer exited (code {self.proc.exitcode})")
        self.runs += 1
        init = f"file://{self.tmp.name}/init_{self.runs}"
        self.jobs.put((init, dims, points, micro_batch_tokens, dp, tp))
        return init

    def close(self) -> None:
        self.jobs.put(None)
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()
        self.tmp.cleanup()


def _profile_train_parallel(
    peer: _ParallelPeer,
    dims: tuple,
    points: list,
    micro_batch_tokens: int,
    intra_gbps: float,
    budget_s: float,
    dp: int,
    tp: int,
) -> dict:
    """(CPU) train points again as steps over two processes of this machine, tensor-parallel (tp 2) or
    data-parallel (dp 2): what such a rank does that the cost model's FLOPs / tp (or / dp) leave out
    (profile_fit.tp_unsplit_fit: per token and per optimizer step, hence two sizes; profile_fit.dp_overhead_fit), the
    all-reduces priced over `intra_gbps`, the profiled type's link inside a machine. `points` are
    (seed, (trajectories, prompt, response)). Returns {"dp", "tp", "layers", "hidden", "passes", "bytes",
    "micro_batch_tokens", "optimizer_steps", "intra_gbps", "model_config", "points": [{"trajectories", "prompt",
    "response", "tokens", "flops", "step_s"}]}."""

    init = peer.start(dims, points, micro_batch_tokens, dp, tp)
    medians, spec = _parallel_step_loop(0, init, dims, points, micro_batch_tokens, budget_s, dp, tp)
    rows = []
    for (_, (n, prompt, response)), step_s in zip(points, medians):
        row = _train_point(spec, PROFILE_MINIBATCHES, n, prompt, response, step_s, micro_batch_tokens)
        rows.append({**{k: row[k] for k in ("trajectories", "tokens", "flops", "step_s")}, "prompt": prompt,
                     "response": response})  # fmt: skip
    return {
        "dp": dp,
        "tp": tp,
        "layers": spec.layers,
        "hidden": spec.hidden,
        "passes": specs.Workload().train_passes,
        "bytes": 4,  # fp32 on CPU
        "micro_batch_tokens": micro_batch_tokens,
        "optimizer_steps": PROFILE_MINIBATCHES,
        "intra_gbps": intra_gbps,
        "model_config": spec.to_config(),
        "points": rows,
    }


LINK_TIMEOUT_S = 300  # the link measurement's peer starts, or the profile stops with gloo's error, within this


def _link_peer(init: str, nbytes_max: int) -> None:
    """The receiving side of _profile_link (a spawned process): for each announced size, receive a bucket into a
    fresh buffer and acknowledge it with the CPU seconds that took here, then verify its checksum and copy it out
    (apply: the relay's own work, which the sender does not wait for); a size of 0 ends it."""

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=1, world_size=2, timeout=timedelta(seconds=LINK_TIMEOUT_S))
    dst = torch.empty(nbytes_max, dtype=torch.uint8)
    size, ack = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.float64)
    try:
        while True:
            dist.recv(size, src=0)
            n = int(size.item())
            if n == 0:
                break
            t0 = time.process_time()
            buf = torch.empty(n, dtype=torch.uint8)  # a fresh wire buffer per bucket, as the runtime's
            dist.recv(buf, src=0)
            ack.fill_(time.process_time() - t0)
            dist.send(ack, dst=0)
            checksum(buf)
            dst[:n].copy_(buf)
    finally:
        dist.destroy_process_group()


def _profile_link(sizes: list[int], budget_s: float) -> dict:
    """One weight-sync bucket hop between this process and a spawned one over gloo (median of at least 3 per size),
    as parallel/weight_sync.py's send_version makes it and a train rank waits for it: the sender fills a fresh buffer
    from its weights, checksums it (dist.verify_weights, on by default) and sends it; the receiver takes it into a
    fresh buffer and acknowledges, then verifies and copies it out (the relay's own work, off the sender's clock). A
    hop's seconds are the CPU seconds of both processes until the acknowledgement (gloo's socket work included): on
    a quiet machine about its wall time, and, like the rest of a CPU profile (time.process_time), free of other
    processes' time slices on a loaded one; `wall_s` is reported beside it. Returns {"latency_s": an 8-byte hop,
    "points": [{"bytes", "hop_s", "wall_s"}]}."""

    if dist.is_initialized():  # a process group exists (a test's): the link is not measured here
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/link_init"
        peer = mp.get_context("spawn").Process(target=_link_peer, args=(init, max(sizes)), daemon=True)
        peer.start()
        dist.init_process_group(
            "gloo", init_method=init, rank=0, world_size=2, timeout=timedelta(seconds=LINK_TIMEOUT_S)
        )
        src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.float64)
        try:

            def hop(n: int) -> tuple[float, float]:
                dist.send(torch.tensor([n], dtype=torch.int64), dst=1)
                t0, w0 = time.process_time(), time.perf_counter()
                buf = torch.empty(n, dtype=torch.uint8)
                buf.copy_(src[:n])
                checksum(buf)
                dist.send(buf, dst=1)
                dist.recv(ack, src=1)
                return time.process_time() - t0 + float(ack.item()), time.perf_counter() - w0

            def median_hop(n: int, budget: float) -> dict:
                hop(n)  # warm-up
                runs, until = [], time.perf_counter() + budget
                while len(runs) < 3 or (time.perf_counter() < until and len(runs) < 50):
                    runs.append(hop(n))
                return {"bytes": n, "hop_s": median([c for c, _ in runs]), "wall_s": median([w for _, w in runs])}

            per = budget_s / (len(sizes) + 1)
            latency = median_hop(8, per)["hop_s"]
            points = [median_hop(n, per) for n in sizes]
            dist.send(torch.zeros(1, dtype=torch.int64), dst=1)
        finally:
            dist.destroy_process_group()
            peer.join(timeout=30)
            if peer.is_alive():
                peer.kill()
    return {"latency_s": latency, "points": points}
