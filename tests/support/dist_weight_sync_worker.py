"""torchrun worker: train ranks of a dp x tp x pp layout stream weight versions (parallel/weight_sync.py) to TP-1
rollout replicas spread over "machines"; every replica applies them with Generator.update_weights and checks its
parameters bitwise against the trainer's own gathered state dict; the train head checks the bytes it sent
against the planner's number (cost_model, from the model's config alone).

    torchrun --nproc_per_node=N tests/support/dist_weight_sync_worker.py CASES OUT
CASES: a JSON file, a list of cases run one after another in the same processes (each process pays its start-up
once): {"name", "model", "layout": [dp, tp, pp], "bucket_mb", "machines", "dtype", "env"}. A case's world is its
dp * tp * pp train ranks and one rank per rollout replica; "machines" gives each replica's machine, e.g. "0,0,1".
A case runs in its own gloo world of the launch's first ranks (torchrun's store, under a key prefix per case; N is the
largest case's world), and each of its ranks writes its report to OUT/NAME/report_<rank>.json. "env" is set for the case
only: HEXRL_MEASURE_MEMORY=1 makes each rank also report the peak resident memory its sync added (VmHWM reset
through /proc/self/clear_refs), in bytes; HEXRL_TEST_HANDOVER=shared hands the buckets to the relays in shared memory
(dist.handover=shared), and a replica then reports how many owners' slots it mapped per version;
HEXRL_SYNC_VERSIONS (default 2): how many versions are synced; parallel.weight_sync.STAGE_ENV stages every bucket
through host memory.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
import parallel.weight_sync as weight_sync  # noqa: E402
from config import TrainConfig  # noqa: E402
from parallel import sync_layout  # noqa: E402
from parallel.channel import Channel  # noqa: E402
from parallel.groups import build_groups  # noqa: E402
from parallel.weight_sync import bucket_meta, plan_version, receive_version, send_version, weights_message  # noqa: E402
from plan import make_train_plan  # noqa: E402
from planner import specs  # noqa: E402


def peak_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])
    return 0


def reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return peak_kb()


def main():
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    # torchrun's own TCPStore (the one a run's channel uses), a key prefix per case
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    for case in cases:
        dp, tp, pp = case["layout"]
        world = dp * tp * pp + len(case["machines"].split(","))
        if rank >= world:  # not a rank of this case
            continue
        case_out = out / case["name"]
        case_out.mkdir(exist_ok=True)
        saved = dict(os.environ)
        os.environ.update(case["env"])
        try:
            case_store = dist.PrefixStore(case["name"], store)
            dist.init_process_group("gloo", store=case_store, rank=rank, world_size=world)
            run_case(case["model"], dp, tp, pp, case["bucket_mb"], case["machines"], case["dtype"], case_out)
            dist.destroy_process_group()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    sys.stdout.flush()
    os._exit(0)


def run_case(model_dir, dp, tp, pp, bucket_mb, machines, dtype_name, out):
    from transformers import AutoConfig, AutoModelForCausalLM

    bucket_bytes = int(float(bucket_mb) * 2**20)
    machines = [int(m) for m in machines.split(",")]
    dtype = getattr(torch, dtype_name)
    measure = os.environ.get("HEXRL_MEASURE_MEMORY") == "1"
    handover = os.environ.get("HEXRL_TEST_HANDOVER", "wire")
    versions = range(1, int(os.environ.get("HEXRL_SYNC_VERSIONS", "2")) + 1)  # weight versions synced, from 1
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    stage_layers = [(s * layers // pp, (s + 1) * layers // pp) for s in range(pp)]
    plan = make_train_plan(dp, tp, pp, stage_layers, world)
    n_train = dp * tp * pp
    for i, m in enumerate(machines):
        plan["ranks"][n_train + i]["machine"] = m
    groups = build_groups(plan, mate_timeout_s=60)
    leaders = groups.rollout_ranks
    ok, report = True, {}
    if groups.is_train:
        from parallel.trainer import Trainer

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = Trainer(model, groups, TrainConfig(), "cpu")
        channel = Channel(leaders) if groups.is_train_head else None
        itemsize = torch.empty((), dtype=dtype).element_size()
        for version in versions:
            for p in trainer.params.values():  # "training": elementwise, so every TP shard moves alike
                p.data.mul_(1 + 0.01 * version).add_(0.001 * version)
            full = trainer.gather_full_state_dict()  # the reference: the trainer's own gather, independent code
            dist.barrier(group=groups.train_group)
            if groups.is_train_head:
                torch.save({n: t.to(dtype) for n, t in full.items()}, Path(out) / f"v{version}.pt")
                layout = {
                    "buckets": [
                        bucket_meta(b, trainer.full_shapes, dtype) for b in trainer.sync_buckets(itemsize, bucket_bytes)
                    ],
                    "verify": True,
                    "handover": handover,
                }
                paths, senders = plan_version(leaders, groups)
                for leader in paths:
                    extra = weights_message(leader, paths, senders, groups)
                    channel.send(leader, "weights", version=version, **layout, **extra)
                box = [senders]
            else:
                box = [None]
            dist.broadcast_object_list(box, src=groups.train_ranks[0], group=groups.train_group)
            before = reset_peak() if measure else 0
            failed, sent = send_version(trainer, box[0], dtype, bucket_bytes, 60, verify=True, handover=handover)
            if measure:
                report[f"peak_extra_v{version}"] = (peak_kb() - before) * 1024
            ok &= not failed
            if groups.is_train_head:
                spec = specs.model_from_config(AutoConfig.from_pretrained(model_dir).to_dict())
                planned = sync_layout.sync_buckets(
                    sync_layout.hf_param_table(spec), stage_layers, itemsize, bucket_bytes
                )
                report[f"sent_v{version}"] = sent
                report["predicted"] = sync_layout.sync_bytes_sent(planned, len(set(machines)))
                report["buckets"] = len(planned)
                report["max_wire"] = max(b.wire_bytes for b in planned)
            dist.barrier()  # every replica has checked this version
        if groups.is_train_head:
            checks = []
            while len(checks) < len(leaders):
                checks += [msg["ok"] for _, msg in channel.poll(timeout_s=120)]
            ok &= all(checks)
    else:
        from generator import Generator, SamplingParams

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        gen = Generator(model, max_batch_size=2, max_seq_len=32)
        gen.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=20, seed=1))
        gen.step()  # mid-generation, as on a real rollout rank
        channel = Channel([groups.train_ranks[0]])
        same = True
        opened = []
        open_slots = weight_sync.open_slots

        def counting_open_slots(descriptor, device):
            opened.append(1)
            return open_slots(descriptor, device)

        weight_sync.open_slots = counting_open_slots
        try:
            same = receive_versions(versions, channel, groups, gen, model, measure, opened, report, out)
        finally:
            weight_sync.open_slots = open_slots
        channel.send(groups.train_ranks[0], "check", ok=bool(same))
        ok = same
    report.update(rank=rank, role=groups.role, ok=bool(ok))
    (Path(out) / f"report_{rank}.json").write_text(json.dumps(report))  # (stdout lines of ranks interleave)
    dist.barrier()


def receive_versions(versions, channel, groups, gen, model, measure, opened, report, out) -> bool:
    """A replica's side of every version: applied through the Generator, then checked bitwise."""
    same = True
    for _ in versions:
        ((_, msg),) = channel.poll(timeout_s=120)
        before = reset_peak() if measure else 0
        opened.clear()
        failed = receive_version(
            msg,
            groups.weight_links,
            torch.device("cpu"),
            lambda b, last, v=msg["version"]: gen.update_weights(b, v, last=last),
            60,
        )
        if measure:
            report[f"peak_extra_v{msg['version']}"] = (peak_kb() - before) * 1024
        report[f"opened_v{msg['version']}"] = len(opened)
        dist.barrier()
        want = torch.load(Path(out) / f"v{msg['version']}.pt", weights_only=True)
        got = model.state_dict()
        same &= not failed and gen.version == msg["version"]
        same &= all(torch.equal(got[k], want[k]) for k in want)
    return same


if __name__ == "__main__":
    main()
