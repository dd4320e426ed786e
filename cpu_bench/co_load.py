"""Co-load: the other ranks a CPU run puts on this host, busy beside the rank a device profile measures.

A CPU rank shares its host's cores, caches and memory bandwidth with the run's other ranks, so `schedule.py profile
--co-load N [--co-load-trainers K]` measures the Generator's steps beside N peer processes (K of them train ranks,
the rest rollout replicas decoding), and, for an emulated type, its decode step again beside each emulated type's
trainers (decode_beside: cpu_bench/host.py prices a replica at the mean over its split's trainers).
"""

from __future__ import annotations

import queue
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpu_bench.emulation import Throttle
from generator import Generator, SamplingParams
from planner.profile_models import median, profiled_trainer, random_llama, random_trajectories


def decode_beside(
    beside: dict,
    throttle,
    co_load: int,
    trainers: int,
    shapes: dict,
    steps: int,
    budget_s: float,
    requests,
    log,
) -> dict:
    """(CPU, an emulated type) the co-load peers' decode step -- a rollout replica of the CPU runs: its model, batch
    and prompt -- timed by the wall clock and by CPU time, `steps` steps at a time through this type's throttle
    (`requests.step`), beside the co-load of `co_load` peers whose `trainers` train under each type's throttle in `beside` in
    turn (its decoding peers stay this type's), for budget_s / len(beside) each after BESIDE_WARMUP_S (long enough
    for every peer's first step; the budget several of the slowest trainers' steps, so that the decoder sees their
    bursts and their pauses alike). Returns {"model", "model_config", "batch", "context", "bytes", "fraction" (this
    type's bandwidth fraction), "points": {type: {"wall_s", "cpu_s", "runs"}}} with each point's medians per step."""

    dims = shapes["models"][shapes["co_load_model"]]
    batch, prompt, _ = shapes["co_load_batch"]
    hf, spec = random_llama(*dims)
    gen = Generator(hf.float(), max_batch_size=batch, max_seq_len=prompt + steps + 8)
    points = {}
    for name, trainer_throttle in beside.items():
        load = start_peers(
            co_load, dims, shapes["co_load_batch"], throttle, log, trainers,
            (shapes["co_load_train"], shapes["train_mb"]), trainer_throttle=trainer_throttle,
        )  # fmt: skip
        try:
            walls, cpus = [], []
            time.sleep(BESIDE_WARMUP_S)
            until = time.perf_counter() + budget_s / len(beside)
            while len(walls) < 3 or (time.perf_counter() < until and len(walls) < 200):
                requests.add(gen, spec.vocab, batch, prompt, steps + 3)
                requests.step(gen)  # prefill and the first token: the timed steps are decode only
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    requests.step(gen)
                walls.append((time.perf_counter() - w0) / steps)
                cpus.append((time.process_time() - c0) / steps)
                requests.drain(gen)
        finally:
            load.close()
        points[name] = {"wall_s": median(walls), "cpu_s": median(cpus), "runs": len(walls)}
        log(
            f"beside:  {trainers} {name} trainer{'s' if trainers > 1 else ''}: decode step {points[name]['wall_s'] * 1e3:.2f} "
            f"ms wall, {points[name]['cpu_s'] * 1e3:.2f} ms CPU ({len(walls)} x {steps} steps)"
        )
    return {
        "model": list(dims),
        "model_config": spec.to_config(),
        "batch": batch,
        "context": prompt + (steps + 1) / 2,  # the mean K/V length the timed steps read
        "bytes": 4,  # fp32 on CPU
        "fraction": throttle.emulation.fraction("bandwidth"),
        "points": points,
    }


BESIDE_WARMUP_S = 5.0  # the decode_beside co-load runs this long before its points are timed
CO_LOAD_START_S = 300  # every co-load peer has built its model and started decoding within this


class CoLoad:
    """Running co-load peers (start_peers); close() stops them and returns the Generator steps each one made."""

    def __init__(self, procs: list, stop, done, tmp: str | None = None) -> None:
        self.procs, self.stop, self.done, self.tmp = procs, stop, done, tmp

    def close(self) -> list[int]:
        """Stop the peers; their step counts in order. A peer that died before it reported makes the co-load
        partial, and the points measured beside it wrong: that is an error naming it, not a quieter profile."""

        self.stop.set()
        steps: dict[int, int] = {}
        until = time.monotonic() + 60
        while len(steps) < len(self.procs) and time.monotonic() < until:
            try:
                seed, n = self.done.get(timeout=0.5)
                steps[seed] = n
            except queue.Empty:
                if all(p.exitcode is not None for p in self.procs) and self.done.empty():
                    break
        lost = [i for i in range(len(self.procs)) if i not in steps]
        self.kill()
        if lost:
            raise RuntimeError(
                f"co-load: peers {lost} died while the points were measured (their load is missing from them)"
            )
        return [steps[i] for i in sorted(steps)]

    def kill(self) -> None:

        for p in self.procs:
            p.kill()
            p.join(timeout=30)
        self.procs = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def trainer_peer(dims: tuple, train: tuple, throttle, seed: int, ready, stop, done, group=None) -> None:
    """One co-load train peer (a spawned process, one thread): Trainer.train_step of a random Llama of `dims` over
    `train` = ((trajectories, prompt, response), micro_batch_tokens), each step padded by `throttle`'s compute
    fraction (None: back to back), until `stop` is set; then it reports its steps on `done` under `seed`. `group`
    (init method, rank, world size): one rank of a DP group of train peers, which step in lockstep as a plan's DP
    trainers do (their bursts coincide at every gradient all-reduce; rank 0 says when to stop, so all leave at the
    same step); None: a gloo world of its own."""

    torch.set_num_threads(1)
    (n, prompt, response), micro_batch_tokens = train
    throttle = throttle or Throttle()
    with tempfile.TemporaryDirectory() as tmp:
        init, rank, world = group or (f"file://{tmp}/init", 0, 1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        hf, spec = random_llama(*dims)
        trainer = profiled_trainer(hf, spec, 1, micro_batch_tokens, torch.device("cpu"), torch.float32, dp=world)
        batch = random_trajectories(spec.vocab, n, prompt, response, seed if world == 1 else 0)  # one batch a group
        go, steps = torch.zeros(1), 0
        ready.put(seed)
        while True:
            go.fill_(0.0 if stop.is_set() else 1.0)
            if world > 1:
                dist.broadcast(go, src=0)
            if not go.item():
                break
            with throttle.piece("compute"):
                trainer.train_step(batch)
            steps += 1
        dist.destroy_process_group()
    done.put((seed, steps))


def decoder_peer(dims: tuple, shape: tuple, throttle, seed: int, ready, stop, done) -> None:
    """One co-load peer (a spawned process, one thread): a rollout replica's decode loop -- `shape` (batch, prompt,
    response) requests on a random Llama of `dims`, refilled whenever all have finished -- every Generator step
    through `throttle` (None: back to back), until `stop` is set; then it reports its steps on `done`."""

    torch.set_num_threads(1)
    batch, prompt, response = shape
    hf, spec = random_llama(*dims)
    gen = Generator(hf, max_batch_size=batch, max_seq_len=prompt + response + 8)
    rng = torch.Generator().manual_seed(seed)
    next_id = steps = 0
    ready.put(seed)
    while not stop.is_set():
        if not gen.num_unfinished():
            for p in torch.randint(0, spec.vocab, (batch, prompt), generator=rng).tolist():
                next_id += 1
                gen.add_request(next_id, p, SamplingParams(max_new_tokens=response, seed=next_id))
        gen.step() if throttle is None else throttle.generator_step(gen)
        steps += 1
    done.put((seed, steps))


def start_peers(
    peers: int, dims: tuple, shape: tuple, throttle, log, trainers: int = 0, train: tuple = (), trainer_throttle=None
) -> CoLoad:
    """Start `peers` co-load peers, the first `trainers` of them train peers (trainer_peer, `train` their
    shape, under `trainer_throttle`, another type's, when one is given, else `throttle`; in DP pairs, the last alone
    when their count is odd: a plan's trainers are DP groups whose bursts coincide, and a decoder beside such a pair
    waits for a core more than beside independent trainers), the rest decoding ones (decoder_peer, under
    `throttle`), and wait until every one works; a peer that fails to start stops the profile with one error naming
    it, the others stopped."""

    ctx = mp.get_context("spawn")
    ready, stop, done = ctx.Queue(), ctx.Event(), ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="co_load-")  # the DP pairs' rendezvous files

    def group(i: int):
        pair = i // 2
        if 2 * pair + 1 >= trainers:  # the odd one out
            return None
        return f"file://{tmp}/dp{pair}", i % 2, 2

    procs = [
        ctx.Process(
            target=trainer_peer,
            args=(dims, train, trainer_throttle or throttle, i, ready, stop, done, group(i)),
            daemon=True,
        )
        if i < trainers
        else ctx.Process(target=decoder_peer, args=(dims, shape, throttle, i, ready, stop, done), daemon=True)
        for i in range(peers)
    ]
    load = CoLoad(procs, stop, done, tmp)
    for p in procs:
        p.start()
    started, until = 0, time.monotonic() + CO_LOAD_START_S
    while started < peers:
        dead = [i for i, p in enumerate(procs) if p.exitcode is not None]
        if dead or time.monotonic() > until:
            load.kill()
            why = (
                f"peers {dead} exited"
                if dead
                else f"{peers - started} did not start decoding within {CO_LOAD_START_S} s"
            )
            raise RuntimeError(f"co-load of {peers} peer processes: {why} (each builds a random Llama and decodes)")
        try:
            ready.get(timeout=1.0)
            started += 1
        except queue.Empty:
            pass
    decoding = f"{peers - trainers} decoding {shape[0]} rows" if peers > trainers else ""
    training = f"{trainers} training" + (" in DP pairs" if trainers > 1 else "") if trainers else ""
    if trainers and trainer_throttle is not None:
        training += f" as {trainer_throttle.type_name}"
    log(f"co-load: {peers} peer{'s' if peers > 1 else ''} ({', '.join(x for x in (training, decoding) if x)}) "
        "working")  # fmt: skip
    return load
