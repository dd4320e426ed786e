"""What a CPU rollout rank's decode costs beside each kind of neighbour a plan can give it, side by side in one run.

    python exp/bench_cotenancy.py                       # an h20ish decoder of exp/clusters/cpu_hetero.yaml
    python exp/bench_cotenancy.py --decoder h800ish --seconds 40 --repeats 2

A device profile (`schedule.py profile --co-load`) measures each emulated type's decode points beside one mix of
peers of its own type, and its replica's step again beside each type's trainers (decode_beside); a plan puts a
rollout rank beside others (exp/hetero_cpu.py: the planner's h20ish decoders beside two h800ish trainers, which
train in lockstep, one DP group). This measures, by hand and at any mix, one decoder -- the tiny model,
--batch rows of --prompt + --response tokens, refilled as they finish, every step through its type's throttle as a
rollout rank's -- alone and beside each mix, and prints per mix its tokens/s, the CPU and wall milliseconds of a
generator step, the waits for a core (wall - CPU - padding), and its wall against the profile mix's. A mix is
peers `D:<type>` (a decoding peer), `T:<type>` (a training peer, its own process) or `DP:<type>` (two training
peers in one gloo group of 2: their bursts coincide at every all-reduce), each under its type's throttle.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from cpu_bench import co_load  # noqa: E402
from cpu_bench.emulation import Emulation, Throttle  # noqa: E402
from planner import device_profile, profile_models  # noqa: E402

SHAPES = device_profile.PROFILE_SHAPES["cpu"]
DIMS = SHAPES["models"][SHAPES["co_load_model"]]  # the tiny model, as the profile's co-load peers run it
TRAIN = SHAPES["co_load_train"]  # the CPU runs' train step


def parse_mix(text: str, types: dict) -> list[tuple[str, str]]:
    """'D:h20ish,DP:h800ish' -> [("D", "h20ish"), ("DP", "h800ish")]; '' -> alone."""
    peers = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, _, type_name = item.partition(":")
        if kind not in ("D", "T", "DP") or type_name not in types:
            raise SystemExit(f"error: mix item {item!r}: give D:, T: or DP: and one of the types {sorted(types)}")
        peers.append((kind, type_name))
    return peers


def measure(decoder: Throttle, peers: list, types: dict, args, tmp: str) -> dict:
    """One decoder's steps for --seconds beside `peers` (started and warmed first)."""
    import torch
    import torch.multiprocessing as mp

    from generator import Generator, SamplingParams

    ctx = mp.get_context("spawn")
    ready, stop, done = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = []
    for i, (kind, type_name) in enumerate(peers):
        throttle = Throttle(types[type_name], type_name)
        if kind == "T":
            target, fn_args = co_load.trainer_peer, (DIMS, (TRAIN, SHAPES["train_mb"]), throttle, i)
            procs.append(ctx.Process(target=target, args=(*fn_args, ready, stop, done), daemon=True))
        elif kind == "D":
            shape = (args.batch, args.prompt, args.response)
            procs.append(ctx.Process(target=co_load.decoder_peer, args=(DIMS, shape, throttle, i, ready, stop, done),
                                     daemon=True))  # fmt: skip
        else:  # a DP pair in lockstep, as the profile's co-load trainers run
            init = f"file://{tmp}/init-{i}-{time.time_ns()}"
            procs += [ctx.Process(target=co_load.trainer_peer, args=(DIMS, (TRAIN, SHAPES["train_mb"]), throttle,
                                                                     100 * i + r, ready, stop, done, (init, r, 2)),
                                  daemon=True) for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=co_load.CO_LOAD_START_S)
        torch.set_num_threads(1)
        hf, spec = profile_models.random_llama(*DIMS)
        gen = Generator(hf, max_batch_size=args.batch, max_seq_len=args.prompt + args.response + 8)
        rng = torch.Generator().manual_seed(1)
        next_id = tokens = steps = 0
        cpu = 0.0
        time.sleep(args.warmup)
        slept, t0 = sum(decoder.slept_s.values()), time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            if not gen.num_unfinished():
                for prompt in torch.randint(0, spec.vocab, (args.batch, args.prompt), generator=rng).tolist():
                    next_id += 1
                    gen.add_request(next_id, prompt, SamplingParams(max_new_tokens=args.response, seed=next_id))
            c0 = time.thread_time()
            outs = decoder.generator_step(gen)
            cpu += time.thread_time() - c0
            tokens += sum(len(o.token_ids) for o in outs)  # counted as sequences finish
            steps += 1
        wall, pad = time.perf_counter() - t0, sum(decoder.slept_s.values()) - slept
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
            p.kill()
    return {"tokens_per_s": tokens / wall, "cpu_ms": cpu / steps * 1e3, "wall_ms": wall / steps * 1e3,
            "wait_ms": (wall - cpu - pad) / steps * 1e3}  # fmt: skip


def default_mixes(spec: dict, decoder: str) -> dict[str, str]:
    """{name: peers}: alone; the profile's co-load as exp/hetero_cpu.sh sets it (the cluster's ranks less one, half
    the ranks training in DP pairs, one alone when their count is odd, all of the decoder's type); and the same
    peers with the trainers of each other type (the profile's decode_beside points)."""
    ranks = sum(m["gpus"] * m.get("count", 1) for m in spec["machines"])
    peers = ranks - 1
    trainers = min(ranks // 2, peers)
    decoders = [f"D:{decoder}"] * (peers - trainers)

    def training(t: str) -> list[str]:
        return [f"DP:{t}"] * (trainers // 2) + [f"T:{t}"] * (trainers % 2)

    return {
        "alone": "",
        "profile": ",".join(decoders + training(decoder)),
        **{f"D+DP:{t}": ",".join(decoders + training(t)) for t in spec["gpu_types"] if t != decoder},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default=str(ROOT / "exp/clusters/cpu_hetero.yaml"))
    ap.add_argument("--decoder", default="h20ish", help="the emulated type of the measured decoder")
    ap.add_argument("--mix", action="append", default=None,
                    help="NAME=PEERS, e.g. planner=D:h20ish,DP:h800ish (repeatable; default: alone, the "
                         "profile's co-load -- the cluster's ranks less one, half the ranks training -- and the same "
                         "decoders beside DP pairs of each type)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=29)
    ap.add_argument("--response", type=int, default=25)
    ap.add_argument("--seconds", type=float, default=25.0, help="measured seconds per mix")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds the peers run before the measurement")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the mixes")
    args = ap.parse_args(argv)
    spec = yaml.safe_load(Path(args.cluster).read_text())
    types = {name: Emulation.from_dict(g.get("emulate") or {}, f"gpu_types.{name}")
             for name, g in spec["gpu_types"].items()}  # fmt: skip
    if args.decoder not in types:
        raise SystemExit(f"error: --decoder {args.decoder!r} is not a type of {args.cluster} ({sorted(types)})")
    d = args.decoder
    mixes = default_mixes(spec, d)
    if args.mix:
        mixes = {}
        for item in args.mix:
            name, sep, peers = item.partition("=")
            if not sep:
                raise SystemExit(f"error: --mix {item!r}: give NAME=PEERS")
            mixes[name] = peers
    parsed = {name: parse_mix(peers, types) for name, peers in mixes.items()}
    print(
        f"{d} decoder ({args.batch} rows, {args.prompt} + {args.response} tokens) of {DIMS}, {args.seconds:g} s a mix"
    )
    print(f"{'round':>5s} {'mix':16s} {'peers':28s} {'tok/s':>7s} {'cpu ms':>7s} {'wall ms':>8s} {'waits':>6s} "
          f"{'wall/profile':>12s}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            rows = {name: measure(Throttle(types[d], d), peers, types, args, tmp) for name, peers in parsed.items()}
            base = rows.get("profile", next(iter(rows.values())))["wall_ms"]
            for name, r in rows.items():
                print(f"{rep:5d} {name:16s} {mixes[name] or '-':28s} {r['tokens_per_s']:7.0f} {r['cpu_ms']:7.2f} "
                      f"{r['wall_ms']:8.2f} {r['wait_ms']:6.2f} {r['wall_ms'] / base:12.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
