"""Phase 1 of the planner (schedule.py tells the whole story): for ONE split of the cluster into trainer
and rollout GPUs, plan each side.

  train side    enumerate DP x TP x PP (TP/DP groups of one GPU type, stages may differ in type); layers per
                stage proportional to stage compute, then rebalanced for memory; the fastest layout wins.
  rollout side  a MILP (python-mip/CBC) over replica configs psi = (type, TP inside a machine, PP):
                maximise sum_psi y_psi h_psi under per-machine TP packing (why this is Eq. 2: schedule.py),
                then the replicas are placed on concrete GPUs.

`SplitPlanner` holds the cluster, model, workload and the caches; schedule.Planner adds phase 2, the search
over splits. Every time and memory formula is in cost_model.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import cache

import mip

import cost_model as cm
from cost_model import Cluster, Efficiency, ModelSpec, ReplicaCost, StageSpec, Workload
from parallel.rankmap import PlanError

# ----------------------------------------------------------------------------- plan pieces


@dataclass
class TrainPlan:
    dp: int
    tp: int
    pp: int
    stages: list[tuple[str, int, list[int]]]  # (gpu_type, layers, gpu ids in tp-fastest order)
    seconds: float


@dataclass(frozen=True)
class ReplicaConfig:
    gpu_type: str
    tp: int
    pp: int
    cost: ReplicaCost


@dataclass
class RolloutPlan:
    replicas: list[tuple[ReplicaConfig, list[int]]]  # config, gpu ids (stage-major, tp-fastest)
    tokens_per_s: float
    prefill_tflops: float
    seq_tokens_per_s: float  # decode speed of one sequence on the fastest replica


@dataclass
class SolverStats:
    seconds: float = 0.0
    iterations: int = 0
    evaluations: int = 0
    milp_solves: int = 0
    status: str = "optimal"
    history: list[float] = field(default_factory=list)


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


# ----------------------------------------------------------------------------- phase 1 for one split


class SplitPlanner:
    def __init__(
        self,
        cluster: Cluster,
        model: ModelSpec,
        wl: Workload,
        eff: Efficiency | None = None,
        max_seconds: float = 10.0,
        forced_layout: tuple[int, int, int] | None = None,
    ) -> None:
        self.cluster, self.model, self.wl = cluster, model, wl
        self.eff = eff or Efficiency()
        self.max_seconds = max_seconds
        self.forced_layout = forced_layout
        self.stats = SolverStats()
        # global GPU ids in cluster order; machine m owns ids first[m] .. first[m] + gpus - 1
        self.first, n = [], 0
        for m in cluster.machines:
            self.first.append(n)
            n += m.gpus
        self.gpu_machine = [m.index for m in cluster.machines for _ in range(m.gpus)]
        self.types = sorted({m.gpu_type for m in cluster.machines})
        self._rollout_cache: dict[tuple, tuple[float, list]] = {}
        self._configs_cache: dict[str, list[ReplicaConfig]] = {}
        self._split_cache: dict[tuple, list[int] | None] = {}

    # ------------------------------------------------------------------ Phase 1a: training plan
    def train_plan(self, train_counts: tuple[int, ...]) -> TrainPlan | None:
        per_type: dict[str, list[int]] = {}
        for m, k in zip(self.cluster.machines, train_counts):
            per_type.setdefault(m.gpu_type, []).extend(range(self.first[m.index], self.first[m.index] + k))
        per_type = {t: ids for t, ids in per_type.items() if ids}
        total = sum(len(ids) for ids in per_type.values())
        if total == 0:
            return None
        g = math.gcd(*[len(ids) for ids in per_type.values()])
        best: TrainPlan | None = None
        for group in (d for d in range(1, g + 1) if g % d == 0):  # group = dp * tp GPUs of one stage
            pp = total // group
            if pp > self.model.layers:
                continue
            for tp in (t for t in range(1, group + 1) if group % t == 0 and self.tp_ok(t)):
                dp = group // tp
                if self.forced_layout and (dp, tp, pp) != self.forced_layout:
                    continue
                for order in itertools.permutations(sorted(per_type)):
                    plan = self._layout(per_type, order, dp, tp, pp)
                    if plan and (best is None or plan.seconds < best.seconds):
                        best = plan
        return best

    def tp_ok(self, tp: int) -> bool:
        """TP must split the attention heads evenly and either split or replicate the KV heads evenly."""
        kv = self.model.kv_heads
        return self.model.heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)

    def _layout(
        self, per_type: dict[str, list[int]], order: tuple[str, ...], dp: int, tp: int, pp: int
    ) -> TrainPlan | None:
        ids = [i for t in order for i in per_type[t]]
        group = dp * tp
        blocks = [ids[k * group : (k + 1) * group] for k in range(pp)]
        types = [self.cluster.machines[self.gpu_machine[b[0]]].gpu_type for b in blocks]
        gm = self.gpu_machine
        specs = []
        for k, b in enumerate(blocks):
            tp_groups = [b[j * tp : (j + 1) * tp] for j in range(dp)]
            dp_groups = [b[j::tp] for j in range(tp)]
            tp_bw = min(self.cluster.group_gbps({gm[i] for i in grp}) for grp in tp_groups)
            dp_bw = min(self.cluster.group_gbps({gm[i] for i in grp}) for grp in dp_groups)
            nxt = min(self.cluster.link_gbps(gm[a], gm[c]) for a, c in zip(b, blocks[k + 1])) if k + 1 < pp else 0.0
            specs.append((types[k], tuple(sorted({gm[i] for i in b})), tp_bw, dp_bw, nxt))
        key = (tuple(types), dp, tp, pp)
        if key not in self._split_cache:
            self._split_cache[key] = self._split_layers(types, dp, tp, pp)
        layers = self._split_cache[key]
        if layers is None:
            return None
        stages = [StageSpec(t, l, ms, a, b, c) for (t, ms, a, b, c), l in zip(specs, layers)]
        secs = cm.train_step_seconds(self.model, stages, dp, tp, self.cluster.gpu_types, self.wl, self.eff)
        return TrainPlan(dp, tp, pp, [(t, l, b) for t, l, b in zip(types, layers, blocks)], secs)

    def _split_layers(self, types: list[str], dp: int, tp: int, pp: int) -> list[int] | None:
        """Layers per stage proportional to stage compute (the LM head counts on the last stage), then
        moved off stages that exceed memory, then greedily off the slowest stage while that helps."""
        L, mdl = self.model.layers, self.model
        speed = [self.cluster.gpu(t).tflops * self.eff.of(t).mfu_train for t in types]
        f_layer = mdl.layer_flops_per_token(self.wl.decode_context)
        f_head = 2 * mdl.head_params
        head = [0.0] * (pp - 1) + [f_head]
        target = (L * f_layer + f_head) / sum(speed)
        ideal = [max(1.0, (target * s - h) / f_layer) for s, h in zip(speed, head)]
        layers = [max(1, int(x)) for x in ideal]
        while sum(layers) > L:
            k = max((i for i in range(pp) if layers[i] > 1), key=lambda i: layers[i] - ideal[i], default=None)
            if k is None:
                return None
            layers[k] -= 1
        while sum(layers) < L:
            layers[min(range(pp), key=lambda i: layers[i] - ideal[i])] += 1

        def mem_ok(k: int, lk: int) -> bool:
            need = cm.train_memory_bytes(mdl, lk, k == pp - 1, k == 0, dp, tp, k, pp, self.wl)
            return need <= self.cluster.gpu(types[k]).hbm_gb * 1e9 * self.eff.mem_frac

        def time_of(k: int, lk: int) -> float:
            return (lk * f_layer + head[k]) / speed[k]

        for _ in range(L * pp):  # memory rebalance
            over = [k for k in range(pp) if not mem_ok(k, layers[k])]
            if not over:
                break
            k = over[0]
            dst = [j for j in range(pp) if j != k and mem_ok(j, layers[j] + 1)]
            if layers[k] <= 1 or not dst:
                return None
            layers[k] -= 1
            layers[min(dst, key=lambda j: time_of(j, layers[j] + 1))] += 1
        if any(not mem_ok(k, layers[k]) for k in range(pp)):
            return None
        for _ in range(L):  # balance: shave the slowest stage
            slow = max(range(pp), key=lambda k: time_of(k, layers[k]))
            if layers[slow] <= 1:
                break
            cands = [
                j
                for j in range(pp)
                if j != slow and mem_ok(j, layers[j] + 1) and time_of(j, layers[j] + 1) < time_of(slow, layers[slow])
            ]
            if not cands:
                break
            layers[slow] -= 1
            layers[min(cands, key=lambda j: time_of(j, layers[j] + 1))] += 1
        return layers

    # ------------------------------------------------------------------ Phase 1b: rollout plan
    def replica_configs(self, gpu_type: str) -> list[ReplicaConfig]:
        if gpu_type not in self._configs_cache:
            gpu = self.cluster.gpu(gpu_type)
            max_tp = max(m.gpus for m in self.cluster.machines if m.gpu_type == gpu_type)
            n_type = sum(m.gpus for m in self.cluster.machines if m.gpu_type == gpu_type)
            inter = self.cluster.inter_gbps.get((gpu_type, gpu_type), gpu.intra_gbps)
            out = []
            for tp in powers_of_two(max_tp):
                if not self.tp_ok(tp):
                    continue
                for pp in range(1, min(8, self.model.layers) + 1):
                    if tp * pp > n_type:
                        break
                    link = gpu.intra_gbps if tp * pp <= max_tp else inter
                    cost = cm.replica_cost(self.model, gpu, tp, pp, self.wl, self.eff, link)
                    if cost:
                        out.append(ReplicaConfig(gpu_type, tp, pp, cost))
            self._configs_cache[gpu_type] = out
        return self._configs_cache[gpu_type]

    def _type_rollout_milp(self, gpu_type: str, free: tuple[int, ...]) -> tuple[float, dict]:
        """Max sum y_psi h_psi for one GPU type, `free` = rollout GPUs per machine (sorted). Returns
        (tokens/s, {"y": {config index: count}, "patterns": [(machine slot, [tp sizes])]})."""
        configs = self.replica_configs(gpu_type)
        tps = sorted({c.tp for c in configs})
        if not configs or sum(free) == 0:
            return 0.0, {"y": {}, "patterns": []}
        classes = sorted(set(free))
        patterns = {r: _tp_patterns(r, tuple(tps)) for r in classes}
        model = mip.Model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
        model.verbose = 0
        y = [model.add_var(var_type=mip.INTEGER, lb=0) for _ in configs]
        w = {(r, j): model.add_var(var_type=mip.INTEGER, lb=0) for r in classes for j in range(len(patterns[r]))}
        for r in classes:
            model += mip.xsum(w[r, j] for j in range(len(patterns[r]))) == free.count(r)
        for tp in tps:
            supply = mip.xsum(w[r, j] * patterns[r][j].count(tp) for r in classes for j in range(len(patterns[r])))
            model += mip.xsum(c.pp * y[i] for i, c in enumerate(configs) if c.tp == tp) <= supply
        model.objective = mip.xsum(c.cost.tokens_per_s * y[i] for i, c in enumerate(configs))
        status = model.optimize(max_seconds=self.max_seconds)
        self.stats.milp_solves += 1
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            raise PlanError(f"rollout MILP for {gpu_type} ended with status {status.name}")
        if status != mip.OptimizationStatus.OPTIMAL:
            self.stats.status = "feasible (time limit)"
        counts = {i: int(round(v.x)) for i, v in enumerate(y) if v.x and v.x > 0.5}
        slots = []
        for r in classes:
            for j, pat in enumerate(patterns[r]):
                slots += [(r, pat)] * int(round(w[r, j].x or 0))
        return sum(configs[i].cost.tokens_per_s * n for i, n in counts.items()), {"y": counts, "patterns": slots}

    def _type_rollout_brute(self, gpu_type: str, free: tuple[int, ...]) -> tuple[float, dict]:
        """--exhaustive: enumerate every multiset of replicas, keep the best one that packs into machines."""
        configs = self.replica_configs(gpu_type)
        best: tuple[float, dict] = (0.0, {"y": {}})

        def packs(need: dict[int, int]) -> bool:
            groups = sorted((tp for tp, n in need.items() for _ in range(n)), reverse=True)
            return _pack(tuple(groups), tuple(sorted(free, reverse=True)))

        def rec(i: int, left: int, y: dict[int, int], value: float) -> None:
            nonlocal best
            if i == len(configs):
                need: dict[int, int] = {}
                for j, n in y.items():
                    need[configs[j].tp] = need.get(configs[j].tp, 0) + configs[j].pp * n
                if value > best[0] and packs(need):
                    best = (value, {"y": dict(y)})
                return
            c = configs[i]
            for n in range(left // (c.tp * c.pp) + 1):
                if n:
                    y[i] = n
                rec(i + 1, left - n * c.tp * c.pp, y, value + n * c.cost.tokens_per_s)
            y.pop(i, None)

        rec(0, sum(free), {}, 0.0)
        return best

    def rollout_plan(self, train_counts: tuple[int, ...], exhaustive: bool = False) -> RolloutPlan | None:
        free_by_type: dict[str, list[tuple[int, int]]] = {}
        for m, k in zip(self.cluster.machines, train_counts):
            if m.gpus - k > 0:
                free_by_type.setdefault(m.gpu_type, []).append((m.gpus - k, m.index))
        replicas: list[tuple[ReplicaConfig, list[int]]] = []
        for t, free in free_by_type.items():
            key = (t, tuple(sorted(r for r, _ in free)), exhaustive)
            if key not in self._rollout_cache:
                solve = self._type_rollout_brute if exhaustive else self._type_rollout_milp
                self._rollout_cache[key] = solve(t, key[1])
            value, sol = self._rollout_cache[key]
            if value > 0:
                replicas += self._place_replicas(t, free, sol, train_counts)
        if not replicas:
            return None
        total = sum(c.cost.tokens_per_s for c, _ in replicas)
        prefill = sum(c.cost.prefill_tflops for c, _ in replicas)
        seq = max(1.0 / c.cost.round_s for c, _ in replicas)
        return RolloutPlan(replicas, total, prefill, seq)

    def _place_replicas(
        self, gpu_type: str, free: list[tuple[int, int]], sol: dict, train_counts: tuple[int, ...]
    ) -> list[tuple[ReplicaConfig, list[int]]]:
        """Turn replica counts into concrete GPUs: cut each machine's rollout GPUs into TP groups
        (largest first, contiguous local ids), then give each replica pp groups of its TP size."""
        configs = self.replica_configs(gpu_type)
        demand = sorted(((configs[i], n) for i, n in sol["y"].items()), key=lambda cn: -cn[0].tp)
        need = {}
        for c, n in demand:
            need[c.tp] = need.get(c.tp, 0) + c.pp * n
        groups: dict[int, list[list[int]]] = {tp: [] for tp in need}
        machines = sorted(free, key=lambda rm: (-rm[0], rm[1]))
        cursor = {m: self.first[m] + train_counts[m] for _, m in machines}
        left = {m: r for r, m in machines}
        for tp in sorted(need, reverse=True):  # first-fit decreasing (exact for powers of 2)
            for _, m in machines:
                while len(groups[tp]) < need[tp] and left[m] >= tp:
                    groups[tp].append(list(range(cursor[m], cursor[m] + tp)))
                    cursor[m] += tp
                    left[m] -= tp
            if len(groups[tp]) < need[tp]:
                raise PlanError(f"internal: could not place {need[tp]} TP-{tp} groups on {gpu_type} machines")
        out = []
        for c, n in demand:
            for _ in range(n):
                ids = [i for _ in range(c.pp) for i in groups[c.tp].pop(0)]
                out.append((c, ids))
        return out


@cache
def _tp_patterns(r: int, tps: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every multiset of TP group sizes (from tps) that fits in r GPUs of one machine."""
    out = []

    def rec(left: int, i: int, acc: tuple[int, ...]) -> None:
        out.append(acc)
        for j in range(i, len(tps)):
            if tps[j] <= left:
                rec(left - tps[j], j, acc + (tps[j],))

    rec(r, 0, ())
    return out


@cache
def _pack(groups: tuple[int, ...], bins: tuple[int, ...]) -> bool:
    """Can these TP groups (sizes, descending) be placed into machines with `bins` free GPUs?"""
    if not groups:
        return True
    g, rest = groups[0], groups[1:]
    tried = set()
    for i, b in enumerate(bins):
        if b >= g and b not in tried:
            tried.add(b)
            nb = tuple(sorted(bins[:i] + (b - g,) + bins[i + 1 :], reverse=True))
            if _pack(rest, nb):
                return True
    return False
