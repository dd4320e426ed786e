"""torchrun worker: the train head sends a new weight version through the real channel + weight sync;
every rollout rank applies it with Generator.update_weights and checks its parameters bitwise."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.channel import Channel  # noqa: E402
from parallel.weight_sync import WeightSender, receive_weights  # noqa: E402


def trained_weights(model, version):
    """What the trainer would hold at `version`: a deterministic perturbation of the initial weights."""
    g = torch.Generator().manual_seed(version)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def main():
    from transformers import AutoModelForCausalLM

    from rollout import Generator

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    bucket_mb = float(sys.argv[2])
    ok = True
    if rank == 0:
        channel = Channel(list(range(1, world)))
        sender = WeightSender(bucket_mb, verify=True, timeout_s=60)
        for version in (1, 2):
            sender.send(channel, list(range(1, world)), trained_weights(model, version), version, torch.device("cpu"))
        sender.wait(60)
        for _src, msg in channel.poll(timeout_s=60) + channel.poll(timeout_s=5):
            ok &= msg["ok"]
    else:
        channel = Channel([0])
        gen = Generator(model, max_batch_size=2, max_seq_len=32)
        gen.add_request("r", [1, 2, 3], __import__("rollout").SamplingParams(max_new_tokens=20, seed=1))
        gen.step()  # mid-generation, as on a real rollout rank
        for _ in range(2):
            ((_, msg),) = channel.poll(timeout_s=60)
            gen.update_weights(receive_weights(msg, 0, torch.device("cpu"), verify=True), msg["version"])
            want = trained_weights(
                AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32), msg["version"]
            )
            got = model.state_dict()
            same = all(torch.equal(got[k], want[k]) for k in want) and gen.version == msg["version"]
        channel.send(0, "check", ok=bool(same))
    dist.barrier()
    if rank == 0:
        print("WEIGHT_SYNC_OK" if ok else "WEIGHT_SYNC_MISMATCH", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
