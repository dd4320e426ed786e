"""The paged KV cache: one pool of fixed-size blocks per rank, shared by its generators, and its memory sizing."""

from __future__ import annotations

import itertools
import os
import weakref

import torch


class KVPool:
    """The K/V of every sequence of a rank, in fixed-size blocks from one pool shared by its generators.

    Storage: one tensor [K/V, layer, kv_heads, num_blocks + 1, block_size, head_dim] (`k[i]`, `v[i]`: a layer's
    views), head-major: gathering a slot's blocks gives each head's keys as one contiguous [span, D] matrix, which
    the batched attention matmuls read, and a token's row in a head's plane is block * block_size + offset; the
    blocks a step allocates are zeroed with one op on it. Block 0 is the null block: no sequence owns it,
    the unused entries of every block table point at it and idle slots write their dummy decode rows into it; it is
    only ever read masked. A generator takes blocks as its sequences grow (at admission for the prompt, then one at
    each block boundary) and returns them when a request finishes, is aborted, preempted or recomputed. Blocks are
    reference counted: the samples of a GRPO group share the full blocks of their prompt. Every generator built on
    the pool registers itself, so one that runs out of blocks can preempt the others' requests (they are not
    stepping meanwhile: the rollout rank runs its eval generator to completion between rollout steps)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KVPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device)
        self.storage = torch.zeros(
            (2, num_layers, num_kv_heads, num_blocks + 1, block_size, head_dim), dtype=dtype, device=self.device
        )
        self.k, self.v = list(self.storage[0]), list(self.storage[1])  # per layer [kv_heads, blocks, offset, D]
        self.refs = [0] * (num_blocks + 1)  # sequences holding each block (the null block: none, ever)
        self.free = list(range(num_blocks, 0, -1))  # a stack: the block freed last is reused first
        self.peak_used = 0
        self.arrivals = itertools.count()  # request age across the pool's generators: preemption takes the youngest
        self._generators: list[weakref.ref] = []

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def used_bytes(self) -> int:
        """K/V bytes of the blocks held by sequences now (the pool's storage is reserved once, up front)."""
        return self.num_used * self.block_bytes

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"KVPool: {n} blocks asked, {len(self.free)} free")
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def register(self, generator) -> None:
        self._generators.append(weakref.ref(generator))

    def generators(self) -> list:
        alive = [g for g in (ref() for ref in self._generators) if g is not None]
        self._generators = [weakref.ref(g) for g in alive]
        return alive


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation could take now: on CUDA the free device memory plus what torch's caching allocator
    holds unused; on CPU the kernel's MemAvailable (sysconf's free pages where /proc/meminfo is missing)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # colocated mode caps this process at its share (dist.rollout_memory_fraction): the rest is the trainer's,
        # even before it has allocated it
        cap = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_allocated(device)
        return int(max(0, min(available, cap)))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
