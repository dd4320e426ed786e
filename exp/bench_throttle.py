"""How exactly does the emulation throttle (emulation.py) slow a rank down on this machine?

    python exp/bench_throttle.py [--fractions 0.5,0.25,0.1] [--model exp/tiny-model]

Two measurements, each side by side with its baseline in one run (this machine is shared and noisy):
  decode   the rollout rank's decode loop (generator.Generator, --batch sequences, through Throttle.generator_step) at
           each bandwidth fraction f: the wanted slowdown is 1 / f; printed is achieved / wanted, and the loop's CPU
           time against the unthrottled loop's (> 1: the same work cost more CPU after the throttle's sleeps)
  pause    one pass of the model's decoder weights through matmuls (the shape of a decode step), back to back vs.
           after a pause of p seconds, the pause spent sleeping, spinning, or re-reading the weights: the extra CPU
           milliseconds per pass. Where the pass costs more after a sleep or a spin but not after re-reading the
           weights, the working set fell out of the caches meanwhile (other processes, other tenants of the host).
The throttle pads a piece by its CPU time (cost / fraction), so what the work loses after a pause it also pays
1 / f times over: the emulated device is slower than asked by achieved / wanted. The cost model prices the fractions
as asked (cpu_bench/host.HostSpeeds.speed), so this ratio is what an emulated run's step time exceeds its prediction by.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_loop(gen, throttle, vocab: int, batch: int, new_tokens: int, tag) -> tuple[float, float]:
    """(wall s, CPU s) of generating new_tokens for batch fresh prompts through the throttle."""
    import torch

    from generator import SamplingParams

    rng = torch.Generator().manual_seed(0)
    for i, p in enumerate(torch.randint(1, vocab, (batch, 29), generator=rng).tolist()):
        gen.add_request((tag, i), p, SamplingParams(max_new_tokens=new_tokens, seed=i))
    t0, c0 = time.perf_counter(), time.process_time()
    while gen.num_unfinished():
        throttle.generator_step(gen)
    return time.perf_counter() - t0, time.process_time() - c0


def pause_penalty(hf, pauses: list[float], repeats: int) -> list[dict]:
    import torch

    weights = [p.detach() for name, p in hf.named_parameters() if p.dim() == 2 and "embed" not in name]
    inputs = {w.shape[1]: torch.randn(8, w.shape[1]) for w in weights}  # a decode step's rows, per input width

    def one_pass() -> float:
        c0 = time.thread_time()
        for w in weights:
            inputs[w.shape[1]] @ w.T
        return time.thread_time() - c0

    def spin(s: float) -> None:
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    def reread(s: float) -> None:
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            for w in weights:
                w.sum()

    def median_after(gap) -> float:
        times = []
        for _ in range(repeats):
            gap()
            times.append(one_pass())
        return statistics.median(times)

    base = median_after(lambda: None)
    rows = []
    for p in pauses:
        row = {"pause_s": p, "base_ms": base * 1e3}
        for name, fn in (("sleep", time.sleep), ("spin", spin), ("reread", reread)):
            row[f"{name}_extra_ms"] = (median_after(lambda fn=fn, p=p: fn(p)) - base) * 1e3
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "exp/tiny-model"))
    ap.add_argument("--fractions", default="0.5,0.25,0.1")
    ap.add_argument("--batch", type=int, default=8, help="sequences per decode step (exp/hetero_cpu.py's)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pauses", default="0.005,0.02,0.06,0.18")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from cpu_bench.emulation import Emulation, Throttle
    from generator import Generator

    torch.set_num_threads(1)  # one CPU rank: one thread
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    gen = Generator(hf, max_batch_size=a.batch, max_seq_len=29 + a.new_tokens + 8)
    vocab = hf.config.vocab_size
    decode_loop(gen, Throttle(), vocab, a.batch, a.new_tokens, "warm-up")
    print(f"decode: {a.batch} sequences x {a.new_tokens} tokens, {Path(a.model).name}, one thread")
    print(f"{'fraction':>8s} {'wanted':>7s} {'achieved':>9s} {'ratio':>6s} {'CPU vs unthrottled':>19s}")
    for f in [1.0] + [float(x) for x in a.fractions.split(",")]:
        base_wall, base_cpu = decode_loop(gen, Throttle(), vocab, a.batch, a.new_tokens, ("base", f))
        throttle = Throttle(Emulation(bandwidth=f)) if f < 1 else Throttle()
        wall, cpu = decode_loop(gen, throttle, vocab, a.batch, a.new_tokens, f)
        achieved = wall / base_wall
        print(f"{f:8g} {1 / f:6.2f}x {achieved:8.2f}x {achieved * f:6.2f} {cpu / base_cpu:18.2f}x")
    print("\npause: one pass of the decoder weights through matmuls, extra CPU ms after a pause spent")
    print(f"{'pause s':>8s} {'pass ms':>8s} {'sleeping':>9s} {'spinning':>9s} {'re-reading':>11s}")
    for r in pause_penalty(hf, [float(x) for x in a.pauses.split(",")], a.repeats):
        print(
            f"{r['pause_s']:8g} {r['base_ms']:8.2f} {r['sleep_extra_ms']:+9.2f} {r['spin_extra_ms']:+9.2f} "
            f"{r['reread_extra_ms']:+11.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
