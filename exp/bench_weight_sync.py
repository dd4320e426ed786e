"""Weight sync, a naive full-state sync vs the runtime's plan-shaped one (parallel/weight_sync.py), side by side in one
run, and the runtime's seconds against the planner's prediction.

    .venv/bin/python exp/bench_weight_sync.py [--replicas 2] [--dtype bfloat16] [--bucket-mb 64] [--repeats 5]

One train rank (the stage owner) and `--replicas` TP-1 rollout replicas on this machine (gloo), each replica a real
Generator over a random Llama-shaped model, in `--dtype` (the rollout model's compute dtype; the trainer keeps
fp32 master weights). Per version, timed on the train rank from the start of the sync until every replica has
applied it (a barrier):
  naive    the straightforward sync: gather the full fp32 state dict onto the head (a host copy), cut it into
           fp32 buckets (another copy), checksum each through whole-bucket int64 intermediates, send every bucket
           to every rollout rank one rank after another; each rollout rank allocates fp32 receive buffers for the
           whole model, receives everything, then checksums and applies it.
  runtime  sync_layout.sync_buckets streamed from the owner in the compute dtype, one copy per machine (a relay
           forwards to its machine-mates), at most 2 buckets alive per side, checksums a chunk at a time.
  shared   (--handover wire,shared) the same, but the owner hands each bucket to the relay in shared memory
           (dist.handover=shared: CUDA IPC on a GPU, a /dev/shm file on CPU); the relay forwards on the wire.
Runs interleave (naive, runtime, naive, ...) and report medians; both paths' replicas end bitwise equal to the
trainer's weights in `--dtype` (checked).

Prediction: cost_model.sync_seconds -- the planner's formula over the same buckets -- with the achieved link
bandwidth and per-version latency fitted (calibration.calibrate's least squares) on two SMALLER models' runtime syncs,
then applied to the benchmark model it has never seen. The error is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from config import TrainConfig  # noqa: E402
from parallel.channel import Channel  # noqa: E402
from parallel.groups import build_groups  # noqa: E402
from parallel.weight_sync import (  # noqa: E402
    bucket_meta,
    plan_version,
    receive_version,
    send_version,
    weights_message,
)
from plan import make_train_plan  # noqa: E402
from planner import cost_model, specs  # noqa: E402

# (hidden, layers, intermediate, vocab): two small models to fit the link on, then the benchmark model (~42M)
SHAPES = {"fit-a": (256, 4, 768, 8000), "fit-b": (384, 6, 1024, 12000), "bench": (512, 8, 1536, 16000)}


def make_model(shape, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, inter, vocab = shape
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


# ------------------------------------------------------------------------------------------ the naive sync
def naive_checksum(flat: torch.Tensor) -> int:
    words = flat.contiguous().view(torch.uint8)
    words = torch.nn.functional.pad(words, (0, (-words.numel()) % 4)).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return int((words * (torch.arange(words.numel(), dtype=torch.int64) % 65521 + 1)).sum())


def naive_buckets(state_dict: dict, bucket_bytes: int) -> list[tuple[list[str], torch.Tensor]]:
    out, names, size = [], [], 0
    for name, t in state_dict.items():
        if names and size + t.numel() * 4 > bucket_bytes:
            out.append((names, torch.cat([state_dict[n].reshape(-1) for n in names])))
            names, size = [], 0
        names.append(name)
        size += t.numel() * 4
    out.append((names, torch.cat([state_dict[n].reshape(-1) for n in names])))
    return out


def naive_send(trainer, leaders: list[int], bucket_bytes: int) -> int:
    full = trainer.gather_full_state_dict()  # fp32 host copy of the whole model
    buckets = naive_buckets(full, bucket_bytes)
    sums = [naive_checksum(flat) for _, flat in buckets]
    works, sent = [], 0
    for dst in leaders:  # one rank after another, every bucket to every rank
        for _, flat in buckets:
            works.append(dist.isend(flat, dst=dst, tag=21))
            sent += flat.numel() * 4
    for w in works:
        w.wait()
    del sums
    return sent


def naive_receive(gen, shapes: dict, bucket_bytes: int, version: int) -> None:
    names = list(shapes)
    layout, group, size = [], [], 0
    for n in names:
        numel = torch.Size(shapes[n]).numel()
        if group and size + numel * 4 > bucket_bytes:
            layout.append(group)
            group, size = [], 0
        group.append(n)
        size += numel * 4
    layout.append(group)
    buffers = [torch.empty(sum(torch.Size(shapes[n]).numel() for n in g)) for g in layout]  # the whole model, fp32
    for buf in buffers:
        dist.recv(buf, src=0, tag=21)
    state = {}
    for g, buf in zip(layout, buffers):
        naive_checksum(buf)
        offset = 0
        for n in g:
            numel = torch.Size(shapes[n]).numel()
            state[n] = buf[offset : offset + numel].view(shapes[n])
            offset += numel
    gen.update_weights(state, version)


# ------------------------------------------------------------------------------------------ one process
def worker(rank: int, world: int, args, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # gloo on CUDA too: every rank on one GPU is the colocated mode, whose buckets travel through pinned host memory
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device(args.device)
    shapes = {**SHAPES, "bench": tuple(int(x) for x in args.bench_shape.split(","))}
    dtype = getattr(torch, args.dtype)
    bucket_bytes = int(args.bucket_mb * 2**20)
    itemsize = torch.empty((), dtype=dtype).element_size()
    results = {}
    version = 0
    for name, shape in shapes.items():
        plan = make_train_plan(1, 1, 1, [(0, shape[1])], world)
        groups = build_groups(plan, mate_timeout_s=300)
        leaders = groups.rollout_ranks
        if args.direct:  # every replica its own relay: the owner sends each bucket to each replica
            for replica in groups.replicas:
                replica.machine = replica.leader
        if groups.is_train:
            from parallel.trainer import Trainer

            trainer = Trainer(make_model(shape, torch.float32), groups, TrainConfig(), args.device)
            channel = Channel(leaders, namespace=f"bench/{name}")
            buckets = trainer.sync_buckets(itemsize, bucket_bytes)
            layout = {"buckets": [bucket_meta(b, trainer.full_shapes, dtype) for b in buckets], "verify": True}
        else:
            from generator import Generator

            model = make_model(shape, dtype).to(device)
            gen = Generator(model, max_batch_size=2, max_seq_len=32)
            shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
            channel = Channel([0], namespace=f"bench/{name}")
        times = {"naive": [], "runtime": [], "shared": []}
        sent = {}
        repeats = args.repeats if name == "bench" else max(2, args.repeats // 2)
        # the naive sync runs on host memory: on CUDA only the runtime's is timed; "runtime" is the wire hand-over
        paths = ("naive", "runtime") if name == "bench" and device.type == "cpu" else ("runtime",)
        if name == "bench" and "shared" in args.handover.split(","):
            paths += ("shared",)
        for _ in range(repeats):
            for path in paths:
                version += 1
                if groups.is_train:
                    for p in trainer.params.values():
                        p.data.mul_(1.001)
                dist.barrier()
                t0 = time.perf_counter()
                if groups.is_train and path == "naive":
                    sent[path] = naive_send(trainer, leaders, bucket_bytes)
                elif groups.is_train:
                    handover = "shared" if path == "shared" else "wire"
                    routes, senders = plan_version(leaders, groups)
                    for leader in routes:
                        msg = weights_message(leader, routes, senders, groups)
                        channel.send(leader, "weights", version=version, **layout, **msg, handover=handover)
                    failed, sent[path] = send_version(trainer, senders, dtype, bucket_bytes, 300, True, handover)
                    assert not failed, failed
                elif path == "naive":
                    naive_receive(gen, shapes, bucket_bytes, version)
                else:
                    ((_, msg),) = channel.poll(timeout_s=300)

                    def apply(bucket, last, v=msg["version"], g=gen):
                        g.update_weights(bucket, v, last=last)

                    receive_version(msg, groups.weight_links, device, apply, 300)
                dist.barrier()
                times[path].append(time.perf_counter() - t0)
        ok = torch.ones(1)
        if groups.is_train:
            want = {n: t.to(dtype).cpu() for n, t in trainer.gather_full_state_dict().items()}
        for r in leaders:  # bitwise check, replica by replica
            if groups.is_train:
                for t in want.values():
                    dist.send(t.contiguous(), dst=r)
                dist.recv(ok, src=r)
                results.setdefault("bitwise", []).append(bool(ok.item()))
            elif rank == r:
                got = model.state_dict()
                same = True
                for n in got:
                    t = torch.empty(got[n].shape, dtype=got[n].dtype)
                    dist.recv(t, src=0)
                    same &= torch.equal(t, got[n].cpu())
                dist.send(torch.tensor([float(same)]), dst=0)
        if groups.is_train:
            results[name] = {
                "params": sum(p.numel() for p in trainer.params.values()),
                "buckets": buckets,
                "sent": sent,
                "seconds": {k: statistics.median(v) for k, v in times.items() if v},
            }
        dist.barrier()
    if rank == 0:
        torch.save(
            {
                k: (v if k == "bitwise" else {**v, "buckets": [b.wire_bytes for b in v["buckets"]]})
                for k, v in results.items()
            },
            out_path,
        )
        report(results, args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def report(results: dict, args) -> None:
    replicas = {i: 1 for i in range(args.replicas)} if args.direct else {0: args.replicas}
    one_machine = [[0]]

    def predict(buckets, eff):
        return cost_model.sync_seconds(buckets, replicas, one_machine, lambda a, b: 1.0, eff)

    # fit (latency, achieved GB/s) on the two small models: predicted = latency + T(1 GB/s) / link_eff
    xs = [
        predict(results[k]["buckets"], specs.Efficiency(link_eff=1.0, sync_latency_s=0.0)) for k in ("fit-a", "fit-b")
    ]
    ys = [results[k]["seconds"]["runtime"] for k in ("fit-a", "fit-b")]
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    bench = results["bench"]
    # the two small models can both be latency-bound (on a GPU, ~0.1 s each): no bandwidth to fit, no prediction
    eff = specs.Efficiency(link_eff=1.0 / slope, sync_latency_s=max(0.0, ys[0] - slope * xs[0])) if slope > 0 else None
    predicted = predict(bench["buckets"], eff) if eff else None
    naive, runtime = bench["seconds"].get("naive"), bench["seconds"]["runtime"]
    print(
        f"weight sync: 1 train rank -> {args.replicas} rollout replicas on one machine "
        f"({'the owner sends to each' if args.direct else 'one relay forwards'}), rollout dtype {args.dtype}, "
        f"{args.bucket_mb:g} MB buckets, medians of {args.repeats}"
    )
    print(f"{'model':>6} {'params':>8} {'path':>8} {'MB sent':>8} {'s/version':>10} {'GB/s':>6}")
    for name in results:
        if name == "bitwise":
            continue
        r = results[name]
        for path, s in r["seconds"].items():
            mb = r["sent"][path] / 1e6
            print(f"{name:>6} {r['params'] / 1e6:7.1f}M {path:>8} {mb:8.1f} {s:10.3f} {mb / 1e3 / s:6.2f}")
    if eff:
        print(
            f"fitted on fit-a/fit-b: achieved {eff.link_eff:.2f} GB/s (planner link at 1 GB/s nominal), "
            f"latency {eff.sync_latency_s * 1e3:.1f} ms"
        )
    else:
        print(f"fit-a/fit-b took {ys[0]:.3f} s and {ys[1]:.3f} s: latency-bound, no bandwidth fitted, no prediction")
    shared = bench["seconds"].get("shared")
    if shared:
        faster = "shared" if shared < runtime else "wire"
        print(
            f"hand-over to the relay: wire {runtime:.3f} s vs shared memory {shared:.3f} s per version "
            f"({runtime / shared:.2f}x): {faster} is faster"
        )
    versus = f" vs naive {naive:.3f} s = {naive / runtime:.2f}x faster" if naive else ""
    prediction = (
        f"planner predicts {predicted:.3f} s ({(runtime - predicted) / predicted * 100:+.1f}% measured vs predicted)"
        if predicted
        else "no prediction"
    )
    print(f"bench ({bench['params'] / 1e6:.1f}M params, {args.device}): runtime {runtime:.3f} s{versus}; {prediction}")
    print(f"every replica bitwise the trainer's weights in {args.dtype}: {all(results['bitwise'])}")
    print(
        "SUMMARY "
        + json.dumps(
            {
                "device": args.device,
                "params": bench["params"],
                "speedup": naive / runtime if naive else None,
                "runtime_s": runtime,
                "naive_s": naive,
                "shared_s": shared,
                "faster_handover": ("shared" if shared < runtime else "wire") if shared else None,
                "predicted_s": predicted,
                "error": (runtime - predicted) / predicted if predicted else None,
                "bitwise": all(results["bitwise"]),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--direct", action="store_true", help="no relay: the owner sends to every replica itself")
    ap.add_argument(
        "--handover",
        default="wire",
        help="owner -> relay hand-overs timed on the bench model: wire (the process group; the 'runtime' rows), "
        "wire,shared (also shared memory: dist.handover=shared, CUDA IPC on a GPU, /dev/shm on CPU)",
    )
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: every rank on the one GPU (the colocated hand-over)")
    ap.add_argument(
        "--bench-shape",
        default=",".join(map(str, SHAPES["bench"])),
        help="hidden,layers,intermediate,vocab of the benchmark model (1.5B-shaped: 1536,28,8960,151936)",
    )
    ap.add_argument("--out", default="/tmp/bench_weight_sync.pt")
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = 1 + args.replicas
    mp.start_processes(worker, args=(world, args, port, args.out), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
