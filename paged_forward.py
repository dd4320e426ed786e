"""The generator's forward pass over the HF model's weights, and why it is not HF's forward.

A rollout step is one batch of rows from many sequences at once: a decode row for every running sequence, each at
its own position, plus the prefill rows of prompts admitted in this step (continuous batching). Their K/V live in
one paged pool (kv_cache.py) that sequences enter and leave between steps, read through per-slot block tables, and
the step replays as a compiled graph (a CUDA graph on a GPU) per batch width, so every shape in it is static and
the pool is written in place. HF's forward takes one padded batch with a cache of its own per batch; none of that
fits. So this module runs the HF model's own modules and weights (embedding, norms, rotary embedding, LM head) in
our pieces (model.py: fused q/k/v and gate/up GEMMs, RoPE with a signed sin, the HF RMSNorm's bits), with its own
attention over the pool: decode rows read their slot's live blocks (gathered matmuls, or FlexAttention over the
pool in place), a right-padded prefill chunk attends within itself, packed prefill rows read the pool as decode
rows do. The Generator (generator.py) decides which rows run and where their K/V go; this module computes them.

Tensor parallelism (a tp_group of k ranks): each rank holds the shard of model_family.py's TP split (sliced by the
Generator), n_heads/k query heads and n_kv_heads/k KV heads of the pool. A layer costs two all-reduces (o_proj's
and down_proj's outputs, before the residual add; their biases added once, after), the embedding one and the LM
head one all-gather into the full fp32 logits, so every rank samples the same tokens. The collectives are torch's
functional ones (torch.distributed._functional_collectives: ops that return their result), which torch.compile
traces into the step's graph as gpt-fast does: a TP replica runs the same compiled step as a single device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from model import ROPE_TABLE_TYPES, fuse_linears, input_major_is_faster, layer_windows, rms_norm, rope, signed_sin

try:  # torch-native paged decode attention (the GPU path: compiled into one kernel that reads the live blocks in place)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without FlexAttention
    BlockMask = flex_attention = None

try:  # optional: flash-attn's in-place KV-cache decode kernel (GPU only)
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # pragma: no cover - not installed on CPU machines
    flash_attn_with_kvcache = None

_COMPILED_FLEX = []


def _compiled_flex():
    """flex_attention compiled once per process (the eager GPU step): uncompiled it is a reference implementation
    that materialises scores over the whole pool. The compiled decode step compiles it with the rest."""
    if not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]


LM_HEAD_BLOCK = 1024  # vocabulary rows per LM-head GEMM on CPU (see PagedForward.logits)


class PrefillChunk(NamedTuple):  # a named tuple: torch.compile takes its fields as plain tensor inputs
    tokens: torch.Tensor  # [n, length] tokens[:-1] of n requests, right-padded; packed: [rows] one after another
    write_rows: torch.Tensor  # rows of a pool layer's flat [kv_heads * pool rows, D] view ...
    read_rows: torch.Tensor  # ... that receive these rows of the chunk's k/v ([rows * kv_heads, D])
    positions: torch.Tensor | None = None  # packed: [rows] each row's position in its sequence
    slots: torch.Tensor | None = None  # packed: [rows] the slot whose block table each row's attention reads


class PagedForward:
    """The forward of one (shard of a) model over a paged KV pool; see the module docstring.

    Built in two steps: the model's pieces, its TP geometry, the fused projections and the RoPE table first (the
    pool is sized from that geometry), then `attach` gives it the pool, the block tables it reads and the step's
    options. Fusing makes the model's q/k/v and gate/up parameters views of the fused matrices (model.py), so
    whatever writes the model's parameters (update_weights, load_state_dict) writes what this forward reads."""

    def __init__(self, model, tp_group, weight_layout: str, max_batch_size: int, max_seq_len: int):
        config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.tp_group = tp_group
        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        base = model.model
        self.embed, self.layers, self.norm = base.embed_tokens, list(base.layers), base.norm
        self.rotary, self.lm_head = base.rotary_emb, model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = config.num_attention_heads // self.tp  # this rank's heads (all of them without TP)
        self.n_kv_heads = config.num_key_value_heads // self.tp
        self.scale = attn.scaling
        self.local_vocab = config.vocab_size // self.tp
        self.vocab_start = self.tp_rank * self.local_vocab  # this rank's rows of embed_tokens and lm_head
        self.windows = layer_windows(config, len(self.layers))
        if weight_layout not in ("auto", "row", "input"):
            raise ValueError(f"weight_layout must be 'auto', 'row' or 'input', got {weight_layout!r}")
        if weight_layout == "auto" and self.device.type != "cpu":
            weight_layout = "row"

        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        def input_major(out_features: int, in_features: int) -> bool:
            return (
                weight_layout == "input"
                or weight_layout == "auto"
                and input_major_is_faster(out_features, in_features, max_batch_size, self.dtype, weight_bytes)
            )

        self.qkv = [
            fuse_linears([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], input_major) for l in self.layers
        ]
        self.gate_up = [fuse_linears([l.mlp.gate_proj, l.mlp.up_proj], input_major) for l in self.layers]
        self.o_proj = [fuse_linears([l.self_attn.o_proj], input_major) for l in self.layers]
        self.down_proj = [fuse_linears([l.mlp.down_proj], input_major) for l in self.layers]
        self.qkv_sizes = [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        # RoPE cos / signed sin of every cache position, computed once by the model's own rotary module
        # (exact: cos/sin are elementwise in the position); rope types that rescale with length are called per step.
        self.rope_table = None
        if getattr(self.rotary, "rope_type", None) in ROPE_TABLE_TYPES:
            cos, sin = self.rotary(
                torch.zeros(1, dtype=self.dtype, device=self.device),
                torch.arange(max_seq_len, device=self.device).unsqueeze(0),
            )
            self.rope_table = (cos[0], signed_sin(sin[0]))

    def attach(
        self,
        kv_pool,
        block_table: torch.Tensor,
        logical: torch.Tensor,
        rows: int,
        static: bool,
        decode_attention: str,
        use_flash_attn: bool,
    ) -> None:
        """The pool this forward reads and writes, the block tables the Generator keeps ([slots, blocks per
        sequence], and FlexAttention's logical index of every pool block), the most rows of a step (decode rows,
        then packed prefill rows), static: the compiled step's static shapes, and the decode attention to run."""
        self.kv_pool, self.block_size = kv_pool, kv_pool.block_size
        self.block_table, self._logical = block_table, logical
        self.static, self.decode_attention, self.use_flash_attn = static, decode_attention, use_flash_attn
        bs = self.block_size
        self.cache_positions = torch.arange(block_table.shape[1] * bs, device=self.device)
        # row of (kv head, block 0, offset 0) in a pool layer's flat [kv_heads * (num_blocks + 1) * bs, D] view
        self.head_rows_host = torch.arange(self.n_kv_heads) * ((kv_pool.num_blocks + 1) * bs)
        self.head_rows = self.head_rows_host.to(self.device)
        self._gather_out: torch.Tensor | None = None  # CPU scratch for the gathered live blocks (see _live_kv)
        self._flex_positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._flex_slots = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._row_ids = torch.arange(rows, device=self.device)  # decode row i reads slot i's blocks
        self._pool_index = torch.arange(max(2, len(self.layers)), device=self.device)  # K/V and layer indices
        self._flex_mask_mods = {w: self._flex_mask_mod(w) for w in set(self.windows)}

    def static_tensors(self) -> list[torch.Tensor]:
        """What a CUDA graph of the step reads that is not a parameter: marked as static addresses, so a replay
        copies none of it into the graph's own input buffers (the whole pool, the fused weights)."""
        fused = [t for pair in self.qkv + self.gate_up + self.o_proj + self.down_proj for t in pair]
        tables = [self.cache_positions, self.head_rows, self.block_table, self._logical, self._flex_positions]
        tables += [self._flex_slots, self._row_ids, self._pool_index, *(self.rope_table or ())]
        return [t for t in [self.kv_pool.storage, *fused, *tables] if t is not None]

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the TP group, out of place (a functional collective: traced into a compiled step)."""
        return funcol.all_reduce(x, "sum", self.tp_group)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ids; under TP each rank looks up the ids in its vocabulary rows (zeros for the rest)
        and the sum over ranks is the full lookup (exact: one nonzero term)."""
        if self.tp == 1:
            return self.embed(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.embed.weight)
        return self._all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def _row_parallel(self, x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """o_proj / down_proj. Under TP each rank holds a slice of the input features: partial products are
        summed over the group, then the (replicated) bias is added once."""
        if self.tp == 1:
            return F.linear(x, *weight_bias)
        weight, bias = weight_bias
        out = self._all_reduce(F.linear(x, weight))
        return out if bias is None else out + bias

    # ------------------------------------------------------------------ the transformer, our way

    def _qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Input norm, one fused q/k/v GEMM, RoPE; returns q, k, v as [B, heads, L, D]."""
        a = self.layers[i].self_attn
        b, n = x.shape[:2]
        qkv = F.linear(rms_norm(self.layers[i].input_layernorm, x), *self.qkv[i])
        nq, nk, _ = self.qkv_sizes
        v = qkv[..., nq + nk :].view(b, n, -1, self.head_dim).transpose(1, 2)
        if hasattr(a, "q_norm"):  # Qwen3: per-head RMSNorm on q and k before RoPE
            q, k = (t.view(b, n, -1, self.head_dim) for t in qkv[..., : nq + nk].split([nq, nk], -1))
            q, k = rms_norm(a.q_norm, q).transpose(1, 2), rms_norm(a.k_norm, k).transpose(1, 2)
            return rope(q, cos, sin), rope(k, cos, sin), v
        # q and k are adjacent in the fused output: rotate them as one tensor
        qk = rope(qkv[..., : nq + nk].view(b, n, -1, self.head_dim).transpose(1, 2), cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], v

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, signed sin) [B, L, D] at positions [B, L]."""
        if self.rope_table is not None:
            return self.rope_table[0][positions], self.rope_table[1][positions]
        cos, sin = self.rotary(x, positions)
        return cos, signed_sin(sin)

    def _finish_layer(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj, residual, MLP, residual; attn_out [rows, L, heads * D]."""
        layer = self.layers[i]
        x = x + self._row_parallel(attn_out, self.o_proj[i])
        gate, up = F.linear(rms_norm(layer.post_attention_layernorm, x), *self.gate_up[i]).chunk(2, dim=-1)
        return x + self._row_parallel(layer.mlp.act_fn(gate).mul_(up), self.down_proj[i])

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        span: int,
        chunk: PrefillChunk | None = None,
    ) -> torch.Tensor | None:
        """One decode token for each of the first `tokens.shape[0]` slots, plus (optionally) the prefill rows
        of a chunk riding in the same GEMMs; returns fp32 logits [B, V] of the decode rows (None if B = 0).

        tokens/positions [B]: the input token of each slot and its position; rows [B]: where its K/V go in a head's
        plane of the pool (block * block_size + offset; idle slots: the null block). span: how many positions
        (whole blocks, >= max(positions) + 1) of each slot's block table decode attention reads.
        Prefill rows are appended after the decode rows. A right-padded chunk's rows attend among themselves
        (causal SDPA over the padded chunk); a packed chunk's rows read the pool as decode rows do, each its own
        sequence's blocks up to its position. Either way the pool holds every row's K/V of this layer by then.
        Riding along costs a fraction of a separate forward: at these sizes a GEMM's cost is mostly the
        pass over the weights (tiny model, 17 GEMMs: 60 rows cost 1.26x 32 rows; 28 rows alone cost as much).
        """
        b = tokens.shape[0]
        kv = self.n_kv_heads
        write_rows = (rows.unsqueeze(1) + self.head_rows).view(-1)
        read_rows = None  # rows of k/v to write (None: all, in order)
        rows_pos = positions
        packed = chunk is not None and chunk.slots is not None
        readers = None  # the slot whose blocks each row of pool attention reads (None: row i reads slot i's)
        if packed:
            tokens = torch.cat([tokens, chunk.tokens])
            rows_pos = torch.cat([positions, chunk.positions])
            readers = torch.cat([self._row_ids[:b], chunk.slots])
        elif chunk is not None:
            n, length = chunk.tokens.shape
            tokens = torch.cat([tokens, chunk.tokens.view(-1)])
            rows_pos = torch.cat([positions, self.cache_positions[:length].repeat(n)])
        if chunk is not None:
            write_rows = torch.cat([write_rows, chunk.write_rows])
            read_rows = torch.cat([torch.arange(b * kv, device=self.device), chunk.read_rows + b * kv])
        x = self._embed(tokens.unsqueeze(1))  # [rows, 1, H]
        cos, sin = self._cos_sin(x, rows_pos.unsqueeze(1))
        attend_pos = rows_pos if packed else positions  # the rows that read the pool
        written_at = None
        if self.static:
            # Compiled, K/V go in by index_put_ on the pool's own storage, an index per dim, which inductor does in
            # place; inductor functionalizes index_copy_ into a layer's view into a copy of the whole pool per layer
            # (tests/unit/test_generator.py checks the generated code).
            plane = (self.kv_pool.num_blocks + 1) * self.block_size
            head, row = write_rows // plane, write_rows % plane
            written_at = (head, row // self.block_size, row % self.block_size)
        tables = self.block_table[:b] if readers is None else self.block_table.index_select(0, readers)
        masks, live = {}, None
        if b and self.decode_attention == "flex":
            masks = {window: self._flex_block_mask(attend_pos, readers, tables, window) for window in set(self.windows)}
        elif b and not self.use_flash_attn:
            masks = {window: self._decode_mask(attend_pos, span, window) for window in set(self.windows)}
            live = tables[:, : span // self.block_size].reshape(-1)  # the live blocks, row-major
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, x, cos, sin)  # [rows, heads, 1, D]
            window = self.windows[i]
            # write every row's K/V first (eager, index_copy_: a third of index_put's time), then attention reads the pool
            for j, new in ((0, k), (1, v)):
                new = new.reshape(-1, self.head_dim)
                new = new if read_rows is None else new[read_rows]
                if written_at is None:
                    self._pool_layer(j, i).view(-1, self.head_dim).index_copy_(0, write_rows, new)
                else:
                    at = (self._pool_index[j], self._pool_index[i], *written_at)
                    self.kv_pool.storage.index_put_(at, new)
            last = i == len(self.layers) - 1 and chunk is not None  # only the prefill rows' cache is wanted
            if last and b == 0:
                return None
            if packed:  # one attention call for all rows (one block mask); the last layer keeps the decode rows'
                out = self._decode_attention(i, q, attend_pos, span, window, masks.get(window), live, tables)
                x = self._finish_layer(i, x[:b], out[:b]) if last else self._finish_layer(i, x, out)
                continue
            if last:
                x, q, chunk = x[:b], q[:b], None
            outs = []
            if b:
                outs.append(self._decode_attention(i, q[:b], positions, span, window, masks.get(window), live, tables))
            if chunk is not None:
                outs.append(self._prefill_attention(q[b:], k[b:], v[b:], n, length, window))
            x = self._finish_layer(i, x, outs[0] if len(outs) == 1 else torch.cat(outs))
        return self.logits(rms_norm(self.norm, x)[:, 0])

    def _pool_layer(self, kv: int, i: int) -> torch.Tensor:
        """Layer i's K (kv=0) or V (1) in the pool. The compiled step indexes the storage, so that its graph mutates
        one input rather than views of it; eager takes the pool's ready views (no indexing ops per layer)."""
        return self.kv_pool.storage[kv, i] if self.static else (self.kv_pool.k, self.kv_pool.v)[kv][i]

    def _decode_mask(self, positions: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
        """Additive mask [kv_heads * B, 1, span] (head-major, as the gathered K/V): each slot reads its own
        positions (within the window); the rest of its last block and the null blocks after it are masked."""
        b = positions.shape[0]
        kpos, qpos = self.cache_positions[:span].unsqueeze(0), positions.unsqueeze(1)
        keep = (kpos <= qpos) if window is None else (kpos <= qpos) & (kpos > qpos - window)
        return (
            torch.zeros(self.n_kv_heads, b, 1, span, dtype=self.dtype, device=self.device)
            .masked_fill_(~keep.view(1, b, 1, span), float("-inf"))
            .view(-1, 1, span)
        )

    def _flex_mask_mod(self, window: int | None):
        """FlexAttention's mask over the pool layer viewed as one sequence of (blocks + 1) * block_size rows: row
        kv_idx of block kv_idx // bs is key position logical * bs + kv_idx % bs of row b's slot if that slot's table
        holds the block at that logical index; it is read up to b's position (within the window). It reads the
        generator's persistent tables (fixed addresses, so a CUDA graph of the step reads their current values)."""
        table, logical, bs = self.block_table, self._logical, self.block_size
        positions, slots = self._flex_positions, self._flex_slots

        def mask_mod(b, h, q_idx, kv_idx):
            block = kv_idx // bs
            index = logical[block]
            kpos = index * bs + kv_idx % bs
            keep = (table[slots[b], index] == block) & (kpos <= positions[b])
            return keep if window is None else keep & (kpos > positions[b] - window)

        return mask_mod

    def _flex_block_mask(
        self, positions: torch.Tensor, readers: torch.Tensor | None, tables: torch.Tensor, window: int | None
    ):
        """The block mask of one decode step: row b (its query rows, one per query head of a KV head) visits the
        first positions[b] // bs + 1 blocks of its slot's block table (`tables`: row b's), in place in the pool
        (the kernel's KV tiles are the pool's blocks), and the mask_mod cuts the last one at its position. Nothing
        is gathered; a free block is never visited."""
        b, bs = positions.shape[0], self.block_size
        self._flex_positions[:b].copy_(positions)
        self._flex_slots[:b].copy_(self._row_ids[:b] if readers is None else readers)
        return BlockMask.from_kv_blocks(
            (positions // bs + 1).to(torch.int32).view(b, 1, 1),
            tables.view(b, 1, 1, -1),
            BLOCK_SIZE=(128, bs),
            mask_mod=self._flex_mask_mods[window],
            seq_lengths=(self.n_heads // self.n_kv_heads, (self.kv_pool.num_blocks + 1) * bs),
            compute_q_blocks=False,
        )

    def _live_kv(self, pool: torch.Tensor, live: torch.Tensor, b: int, span: int) -> torch.Tensor:
        """The blocks `live` of one pool layer, gathered as [kv_heads * B, span, D]: for each head and slot its
        positions [0, span) as one contiguous matrix. On CPU (eager) into one scratch buffer, K's and then V's,
        that grows with the longest live span: a fresh 1 MB allocation per gather is a page-faulting mmap there,
        and writing the V over the K just read keeps the copy in cache (tiny model, 32 slots, 4 layers timed
        alone: span 64 on par with reading a static cache in place, span 160 4-17% slower; 45-55% with two
        buffers)."""
        plane = pool.view(self.n_kv_heads, -1, self.block_size * self.head_dim)
        if self.device.type != "cpu" or self.static:
            out = plane.index_select(1, live)
        else:
            numel = self.n_kv_heads * live.numel() * self.block_size * self.head_dim
            if self._gather_out is None or self._gather_out.numel() < numel:
                self._gather_out = torch.empty(numel + numel // 4, dtype=self.dtype)
            out = torch.index_select(
                plane, 1, live, out=self._gather_out[:numel].view(self.n_kv_heads, live.numel(), -1)
            )
        return out.view(self.n_kv_heads * b, span, self.head_dim)

    def _decode_attention(
        self,
        i: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        window: int | None,
        mask: torch.Tensor | None,
        live: torch.Tensor | None,
        tables: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of each query row over its slot's live blocks (`tables`: row b's block table); returns
        [B, 1, heads * D]."""
        b = q.shape[0]
        kv, group = self.n_kv_heads, self.n_heads // self.n_kv_heads
        if self.use_flash_attn:  # the pool as flash-attn's paged layout [blocks, block_size, kv_heads, D] (a view)
            out = flash_attn_with_kvcache(
                q.transpose(1, 2),
                self._pool_layer(0, i).permute(1, 2, 0, 3),
                self._pool_layer(1, i).permute(1, 2, 0, 3),
                cache_seqlens=(positions + 1).to(torch.int32),
                block_table=tables,
                softmax_scale=self.scale,
                causal=True,
                window_size=(-1, -1) if window is None else (window - 1, 0),
            )
            return out.reshape(b, 1, -1)
        if self.decode_attention == "flex":  # the pool layer as one sequence of rows shared by every slot (batch 1)
            keys, values = (self._pool_layer(j, i).reshape(1, kv, -1, self.head_dim) for j in (0, 1))
            attend = flex_attention if self.static or self.device.type == "cpu" else _compiled_flex()
            # GQA as query rows: a KV head's `group` query heads are `group` query rows of that head, so flex runs
            # its decoding kernel (which takes only power-of-two GQA ratios) and reads each KV block once per KV head
            out = attend(q.reshape(b, kv, group, self.head_dim), keys, values, block_mask=mask, scale=self.scale)
            return out.reshape(b, 1, -1)
        # GQA without repeating K/V: the `group` query heads of one KV head become `group` query rows.
        # Written out, not SDPA: for one query row per head SDPA's masked path costs more than the math.
        qg = q.reshape(b, kv, group, self.head_dim).transpose(0, 1).reshape(kv * b, group, self.head_dim)
        keys = self._live_kv(self._pool_layer(0, i), live, b, span)
        scores = torch.baddbmm(mask, qg, keys.transpose(1, 2), alpha=self.scale)
        probs = scores.softmax(-1, dtype=torch.float32).to(self.dtype)
        values = self._live_kv(self._pool_layer(1, i), live, b, span)  # over the keys (on CPU)
        return torch.bmm(probs, values).view(kv, b, group * self.head_dim).transpose(0, 1).reshape(b, 1, -1)

    def _prefill_attention(self, q, k, v, n: int, length: int, window: int | None) -> torch.Tensor:
        """Causal attention within each right-padded sequence of a chunk (a real query never looks past
        itself, so padding needs no key mask); q/k/v [n * length, heads, 1, D] -> [n * length, 1, heads * D]."""
        q, k, v = (t.reshape(n, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if window is None or window >= length:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            qpos = self.cache_positions[:length].unsqueeze(1)
            kpos = self.cache_positions[:length].unsqueeze(0)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=(kpos <= qpos) & (kpos > qpos - window), scale=self.scale, enable_gqa=True
            )
        return out.transpose(1, 2).reshape(n * length, 1, -1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V]. On CPU a large vocabulary goes through the LM head in blocks of rows (MKL runs
        one [B, H] x [H, V] GEMM of a large V at about half the speed of blocks of LM_HEAD_BLOCK rows). On GPU it is
        one GEMM. Under TP each rank computes its [B, V/k] and all of them are gathered, so
        every rank samples the same tokens from the same logits."""
        w, b = self.lm_head.weight.detach(), self.lm_head.bias
        if self.device.type != "cpu" or w.shape[0] <= 4 * LM_HEAD_BLOCK:
            logits = F.linear(h, w, b).float()
        else:
            out = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype)
            for i in range(0, w.shape[0], LM_HEAD_BLOCK):
                torch.matmul(h, w[i : i + LM_HEAD_BLOCK].t(), out=out[:, i : i + LM_HEAD_BLOCK])
            logits = (out if b is None else out + b).float()
        if self.tp == 1:
            return logits
        rows, local = logits.shape
        parts = funcol.all_gather_single(logits, 0, self.tp_group)  # [tp * B, V/k], rank by rank
        return parts.view(self.tp, rows, local).transpose(0, 1).reshape(rows, self.tp * local)
