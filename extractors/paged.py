"""Paged KV caches back to contiguous per-layer K/V, for vLLM CPU, vLLM CUDA (flash-attn) and Neuron.

Pure torch: nothing here imports vLLM, so every layout is testable from arrays alone.

Vocabulary (reference/000):
- ``kv_cache_config``: a plain dict, the form ``get_kv_cache_config()`` returns over RPC::

      {"num_blocks": int, "total_num_kv_heads": int, "tp_size": int, "layout": "vllm_cpu",
       "groups": [{"layer_names": [...], "spec_type": "FullAttentionSpec" | "SlidingWindowSpec",
                   "block_size": int, "num_kv_heads": int (per rank), "head_size": int,
                   "sliding_window": int | None,
                   "layout": {"name": "vllm_cpu", "isa": "vec",
                              "k_index": [...], "v_index": [...]}}, ...]}

  Each group has its own block table. ``layout`` per group may be omitted when the caller
  passes ``layout=``; ``k_index``/``v_index`` only exist for ``vllm_cpu``.
- ``paged_kv``: ``{layer_name: entry}`` for one TP rank, or a list of those indexed by rank.
  The entry depends on the layout:
    * ``vllm_cpu``:   one tensor ``[num_blocks, kv_head, block_size, 2*head_dim]``; each
      (block, head) row holds a K region of ``block_size*head_dim`` values, then a V region, in
      in-block orders that depend on dtype and kernel ISA (given as index maps, derived by
      writing known values through the real cache-write op; see extractors.vllm_rpc).
    * ``flash_attn``: one tensor ``[2, num_blocks, block_size, kv_head, head_dim]`` or a pair
      ``(k, v)`` each ``[num_blocks, block_size, kv_head, head_dim]``.
    * ``neuron``:     a pair ``(k, v)`` each ``[num_blocks, kv_head, block_size, head_dim]``.
- ``block_tables``: a list indexed by group; for one sequence each entry is
  ``[logical_block]`` physical block ids, for a batch ``[batch, logical_block]``.

Every layout is reduced to the same description (``PagedLayout``): K and V each come from a
source viewed as ``[num_blocks, block_numel]`` and an offset map ``[kv_head, block_size,
head_dim]`` inside one block. Reconstruction is then one vectorised gather per K and V.
"""
from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

LAYOUT_NAMES = ("vllm_cpu", "flash_attn", "neuron")
SLIDING_WINDOW_SPEC = "SlidingWindowSpec"


@dataclass(frozen=True, eq=False)
class PagedLayout:
    """Where element (kv_head, token-in-block, dim) of K and of V lives inside one block.

    k_offsets, v_offsets: [kv_head, block_size, head_dim] int64, flat offsets into one block of
    the K (resp. V) source viewed as ``[num_blocks, block_numel]``.
    fused: K and V share one source tensor (vllm_cpu); otherwise the entry holds two sources.
    """

    name: str
    num_kv_heads: int
    block_size: int
    head_dim: int
    k_offsets: torch.Tensor
    v_offsets: torch.Tensor
    block_numel: int
    fused: bool
    isa: str | None = None

    def __post_init__(self):
        # Affine offset maps (every layout measured so far) let the gather run as one strided
        # copy instead of a per-element index computation (~5x faster, benchmarks/bench_extract.py).
        object.__setattr__(self, "k_affine", _affine(self.k_offsets))
        object.__setattr__(self, "v_affine", _affine(self.v_offsets))
        both = self.k_affine is not None and self.v_affine is not None
        object.__setattr__(self, "kernel_maps", np.array([self.k_affine, self.v_affine], dtype=np.int64) if both else None)

    def sources(self, entry, layer: str):
        """The K and V sources of one layer's paged entry, each ``[num_blocks, block_numel]``."""
        h, bs, d = self.num_kv_heads, self.block_size, self.head_dim
        if self.name == "vllm_cpu":
            t = _as_tensor(entry, layer)
            _check_shape(t, (None, h, bs, 2 * d), "[num_blocks, kv_head, block_size, 2*head_dim]", layer)
            flat = t.reshape(t.shape[0], -1)
            return flat, flat
        if isinstance(entry, (tuple, list)):
            if len(entry) != 2:
                raise ValueError(f"layer {layer}: expected a (k, v) pair, got {len(entry)} tensors")
            k, v = (_as_tensor(x, layer) for x in entry)
        else:
            t = _as_tensor(entry, layer)
            if self.name == "neuron" and t.dim() == 5:
                k, v = t[0], t[1]
            elif self.name == "flash_attn":
                _check_shape(t, (2, None, bs, h, d), "[2, num_blocks, block_size, kv_head, head_dim]", layer)
                k, v = t[0], t[1]
            else:
                raise ValueError(f"layer {layer}: layout {self.name} needs a (k, v) pair, got one tensor {tuple(t.shape)}")
        want = (None, bs, h, d) if self.name == "flash_attn" else (None, h, bs, d)
        dims = "[num_blocks, block_size, kv_head, head_dim]" if self.name == "flash_attn" else "[num_blocks, kv_head, block_size, head_dim]"
        for name, x in (("k", k), ("v", v)):
            _check_shape(x, want, dims, f"{layer} ({name})")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"layer {layer}: k has {k.shape[0]} blocks but v has {v.shape[0]}")
        return k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)


def _affine(offsets: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(base, head_stride, token_stride, dim_stride) if offsets[h, t, d] is affine in h, t, d."""
    h, bs, d = offsets.shape
    base = int(offsets[0, 0, 0])
    sh = int(offsets[1, 0, 0]) - base if h > 1 else 0
    st = int(offsets[0, 1, 0]) - base if bs > 1 else 0
    sd = int(offsets[0, 0, 1]) - base if d > 1 else 0
    hh, tt, dd = _grid(h, bs, d)
    if min(sh, st, sd) < 0 or not torch.equal(offsets, base + hh * sh + tt * st + dd * sd):
        return None  # as_strided takes no negative strides; the generic gather handles any map
    return base, sh, st, sd


def _as_tensor(x, layer: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise ValueError(f"layer {layer}: paged KV entry must be a tensor, got {type(x).__name__}")


def _check_shape(t: torch.Tensor, want: tuple, dims: str, layer: str) -> None:
    ok = t.dim() == len(want) and all(w is None or w == s for w, s in zip(want, t.shape))
    if not ok:
        shown = tuple("N" if w is None else w for w in want)
        raise ValueError(f"layer {layer}: paged KV has shape {tuple(t.shape)}, expected {dims} = {shown}")


def _grid(h: int, bs: int, d: int):
    hh = torch.arange(h, dtype=torch.int64).view(h, 1, 1)
    tt = torch.arange(bs, dtype=torch.int64).view(1, bs, 1)
    dd = torch.arange(d, dtype=torch.int64).view(1, 1, d)
    return hh, tt, dd


def neuron_layout(num_kv_heads: int, block_size: int, head_dim: int) -> PagedLayout:
    """Neuron: separate K and V, each ``[num_blocks, kv_head, block_size, head_dim]``."""
    h, t, d = _grid(num_kv_heads, block_size, head_dim)
    off = (h * block_size + t) * head_dim + d
    return PagedLayout("neuron", num_kv_heads, block_size, head_dim, off, off,
                       num_kv_heads * block_size * head_dim, fused=False)


def flash_attn_layout(num_kv_heads: int, block_size: int, head_dim: int) -> PagedLayout:
    """vLLM CUDA flash-attn: ``[2, num_blocks, block_size, kv_head, head_dim]``."""
    h, t, d = _grid(num_kv_heads, block_size, head_dim)
    off = (t * num_kv_heads + h) * head_dim + d
    return PagedLayout("flash_attn", num_kv_heads, block_size, head_dim, off, off,
                       num_kv_heads * block_size * head_dim, fused=False)


def vllm_cpu_layout(num_kv_heads: int, block_size: int, head_dim: int, k_index, v_index,
                    isa: str | None = None) -> PagedLayout:
    """vLLM CPU: ``[num_blocks, kv_head, block_size, 2*head_dim]`` with in-block index maps.

    k_index, v_index: [block_size, head_dim] (or flat) offsets of token t, dim d inside one
    (block, head) row of ``2*block_size*head_dim`` values. Together they must cover the row
    exactly once, which catches a map derived for another block size or head size.
    """
    region = 2 * block_size * head_dim
    k_idx, v_idx = (torch.as_tensor(np.asarray(x), dtype=torch.int64) for x in (k_index, v_index))
    if k_idx.numel() != block_size * head_dim or v_idx.numel() != block_size * head_dim:
        raise ValueError(f"vllm_cpu index maps (isa={isa}) have {k_idx.numel()}/{v_idx.numel()} entries, "
                         f"expected block_size*head_dim = {block_size}*{head_dim} = {block_size * head_dim}")
    k_idx, v_idx = k_idx.reshape(block_size, head_dim), v_idx.reshape(block_size, head_dim)
    both = torch.cat([k_idx.flatten(), v_idx.flatten()]).sort().values
    if not torch.equal(both, torch.arange(region, dtype=torch.int64)):
        raise ValueError(
            f"vllm_cpu index maps (isa={isa}) do not cover a (block, head) row of "
            f"2*{block_size}*{head_dim}={region} values exactly once")
    h = torch.arange(num_kv_heads, dtype=torch.int64).view(-1, 1, 1) * region
    return PagedLayout("vllm_cpu", num_kv_heads, block_size, head_dim, h + k_idx, h + v_idx,
                       num_kv_heads * region, fused=True, isa=isa)


def vllm_cpu_vec_index_maps(block_size: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The in-block orders ENGINES.md measured for float32 ('vec' ISA): K stored transposed
    ``[head_dim, block_size]``, V as ``[block_size, head_dim]``. Returns (k_index, v_index),
    each [block_size, head_dim]. A documented fallback; derive the map from the real op when
    vLLM is at hand."""
    t = np.arange(block_size).reshape(-1, 1)
    d = np.arange(head_dim).reshape(1, -1)
    return d * block_size + t, block_size * head_dim + t * head_dim + d


_GROUP_LAYOUTS: dict[int, tuple[Mapping, PagedLayout]] = {}


def layout_from_group(group: Mapping, layer_hint: str = "") -> PagedLayout:
    """Build the PagedLayout a kv_cache_config group describes (its ``layout`` entry).

    Memoised per group object (a config is read on every extraction; building a vllm_cpu layout
    from its index lists costs more than gathering a small request).
    """
    hit = _GROUP_LAYOUTS.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1]
    lay = _build_layout(group, layer_hint)
    if len(_GROUP_LAYOUTS) >= 256:
        _GROUP_LAYOUTS.clear()
    _GROUP_LAYOUTS[id(group)] = (group, lay)
    return lay


def _build_layout(group: Mapping, layer_hint: str) -> PagedLayout:
    spec = group.get("layout")
    if spec is None:
        raise ValueError(f"KV cache group of {layer_hint or group.get('layer_names')} has no 'layout'; pass layout=")
    if isinstance(spec, str):
        spec = {"name": spec}
    name = spec["name"]
    h, bs, d = int(group["num_kv_heads"]), int(group["block_size"]), int(group["head_size"])
    if name == "vllm_cpu":
        if "k_index" not in spec:
            raise ValueError(f"group of {layer_hint}: vllm_cpu layout needs k_index/v_index maps")
        return vllm_cpu_layout(h, bs, d, spec["k_index"], spec["v_index"], isa=spec.get("isa"))
    if name == "flash_attn":
        return flash_attn_layout(h, bs, d)
    if name == "neuron":
        return neuron_layout(h, bs, d)
    raise ValueError(f"unknown paged KV layout {name!r}; known: {LAYOUT_NAMES}")


def _resolve_layout(layout, group: Mapping, group_idx: int, layer: str) -> PagedLayout:
    if layout is None:
        lay = layout_from_group(group, layer)
    elif isinstance(layout, PagedLayout):
        lay = layout
    elif isinstance(layout, str):
        spec = group.get("layout")
        spec = spec if isinstance(spec, Mapping) and spec.get("name") == layout else {"name": layout}
        lay = layout_from_group({**group, "layout": spec}, layer)
    elif isinstance(layout, Mapping):
        if group_idx not in layout:
            raise ValueError(f"layout mapping has no entry for group {group_idx} (layer {layer})")
        return _resolve_layout(layout[group_idx], group, group_idx, layer)
    else:
        raise ValueError(f"layout must be a PagedLayout, a name or a mapping group->layout, got {type(layout).__name__}")
    if lay.block_size != int(group["block_size"]):
        raise ValueError(f"layer {layer} (group {group_idx}): layout block_size {lay.block_size} "
                         f"!= group block_size {group['block_size']}")
    return lay


def _layer_to_group(kv_cache_config: Mapping) -> dict[str, int]:
    out: dict[str, int] = {}
    for gi, group in enumerate(kv_cache_config["groups"]):
        for name in group["layer_names"]:
            if name in out:
                raise ValueError(f"layer {name} is in KV cache groups {out[name]} and {gi}")
            out[name] = gi
    return out


def _int_ids(x, group_idx: int) -> np.ndarray:
    """Block ids as int64, refusing anything that is not integer-typed: a cast would truncate
    ``[0.9, 2.9]`` to blocks ``[0, 2]`` and read other blocks than the engine used."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
            shown = x.reshape(-1)[:4].tolist()
            raise ValueError(f"group {group_idx}: block ids must be integers, got {str(x.dtype).removeprefix('torch.')} "
                             f"values {shown}{'...' if x.numel() > 4 else ''}")
        return x.detach().to("cpu", torch.int64).numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        shown = a.reshape(-1)[:4].tolist()
        raise ValueError(f"group {group_idx}: block ids must be integers, got {a.dtype} "
                         f"values {shown}{'...' if a.size > 4 else ''}")
    return a.astype(np.int64, copy=False)


def _block_table_2d(table, group_idx: int, batch_size: int | None) -> np.ndarray:
    """One group's block table as int64 [batch, logical_block]; ValueError for non-integer ids."""
    if isinstance(table, (torch.Tensor, np.ndarray)):
        t = _int_ids(table, group_idx)
    else:
        rows = list(table)
        if rows and not np.isscalar(rows[0]) and not isinstance(rows[0], (int, np.integer)):
            width = max((len(r) for r in rows), default=0)
            t = np.full((len(rows), width), -1, dtype=np.int64)
            for i, r in enumerate(rows):
                ids = _int_ids(r if isinstance(r, (torch.Tensor, np.ndarray)) else list(r), group_idx).reshape(-1)
                t[i, :ids.size] = ids
        else:
            t = _int_ids(rows, group_idx) if rows else np.zeros(0, dtype=np.int64)
    if batch_size is None:
        if t.ndim == 2 and t.shape[0] == 1:
            return t
        if t.ndim != 1:
            raise ValueError(f"group {group_idx}: a single sequence needs a 1-D block table, got shape "
                             f"{tuple(t.shape)}; use reconstruct_contiguous_kv_batch for several")
        return t.reshape(1, -1)
    if t.ndim == 1:
        t = t.reshape(1, -1)
    if t.ndim != 2 or t.shape[0] < batch_size:
        raise ValueError(f"group {group_idx}: block table of shape {tuple(t.shape)} has fewer than "
                         f"batch_size={batch_size} rows")
    return t[:batch_size]


def _request_blocks(table: np.ndarray, seq_lens: list[int], block_size: int, where: str) -> np.ndarray:
    """The ``[batch, ceil(max(seq_lens) / block_size)]`` ids each row reads: its own blocks, then
    block 0 as padding (NaN-filled later). ValueError when a row's table is too short for its length."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    for row, (n, m) in enumerate(zip(seq_lens, need)):
        prefix = table[row, :m]
        if prefix.size < m or bool((prefix < 0).any()):
            have = int((table[row] >= 0).sum())
            raise ValueError(f"{where}, row {row}: seq_len {n} needs {m} blocks but the block table has only {have}")
    nb = max(need)
    out = table[:, :nb].copy()
    for row, m in enumerate(need):
        out[row, m:] = 0
    return out


_KERNEL: list = []  # [module or None], filled on first use


def _numba_kernel():
    """``extractors._paged_numba`` when numba imports (the 'fast' extra), else None; once per process.
    ``CAPTURESTORE_PAGED_KERNEL=torch`` keeps the torch path (the kernel's oracle)."""
    if not _KERNEL:
        mod = None
        if os.environ.get("CAPTURESTORE_PAGED_KERNEL", "auto") != "torch":
            try:
                from extractors import _paged_numba as mod
            except ImportError:
                mod = None
        _KERNEL.append(mod)
    return _KERNEL[0]


def _kernel_reads(kernel, lay: PagedLayout, k_src: torch.Tensor, v_src: torch.Tensor) -> bool:
    return (kernel is not None and lay.k_affine is not None and lay.v_affine is not None
            and k_src.device.type == "cpu" and v_src.device.type == "cpu"
            and k_src.element_size() == v_src.element_size() and k_src.element_size() in kernel.WIDTHS
            and k_src.is_contiguous() and v_src.is_contiguous())


def _gather_group(lay: PagedLayout, sources: list, blocks: torch.Tensor, seq_pad: int) -> list:
    """``[(k, v)]``, each ``[batch, kv_head, seq_pad, head_dim]``, of the layers ``sources`` (their
    ``(k_src, v_src)``, each ``[num_blocks, block_numel]``) for the blocks ``[batch, logical_block]``
    (ids checked in range by the caller).

    Affine maps over contiguous CPU sources go through the numba kernel when it imports, all such
    layers in one call: each needed tile read once from the cache itself, K and V written once in
    their final order (vLLM CPU's transposed K tiles in vector-register squares), bit-identical to
    ``_gather_kv_torch``, which runs otherwise."""
    kernel = _numba_kernel()
    out: list = [None] * len(sources)
    by_width: dict[int, list[int]] = {}
    for i, (k_src, v_src) in enumerate(sources):
        if _kernel_reads(kernel, lay, k_src, v_src):
            by_width.setdefault(k_src.element_size(), []).append(i)
        else:
            out[i] = _gather_kv_torch(lay, k_src, v_src, blocks, seq_pad)
    if not by_width:
        return out
    ids = blocks.contiguous().numpy()
    b, h, d = blocks.shape[0], lay.num_kv_heads, lay.head_dim
    for width, members in by_width.items():
        # a buffer per layer for its K and V, each [batch, kv_head, seq_pad, head_dim] (K first).
        # Not one buffer for every layer: past glibc's largest mmap threshold (32 MiB) each such
        # buffer was a fresh mapping, its every page faulted in on each extraction (a 64 MiB
        # group: 66.7 ms, 15.1 ms a buffer per layer, docs/benchmarks.md); a layer's buffer is
        # reused from the heap once the last extraction's is freed
        dtype = sources[members[0]][0].dtype
        step = b * h * seq_pad * d * width
        rows = []
        for i in members:
            k_src, v_src = sources[i]
            buf = torch.empty((2, b, h, seq_pad, d), dtype=dtype)
            k, v = buf.unbind(0)
            out[i] = (k if k_src.dtype == dtype else k.view(k_src.dtype),
                      v if v_src.dtype == dtype else v.view(v_src.dtype))
            base = buf.data_ptr()
            rows.append((k_src.data_ptr(), v_src.data_ptr(), base, base + step, k_src.shape[0], v_src.shape[0]))
        kernel.gather_layers(np.array(rows, dtype=np.int64), width, sources[members[0]][0].shape[1], ids,
                             lay.kernel_maps, h, lay.block_size, d, seq_pad)
    return out


def _gather_kv(lay: PagedLayout, k_src: torch.Tensor, v_src: torch.Tensor, blocks: torch.Tensor, seq_pad: int):
    """K and V ``[batch, kv_head, seq_pad, head_dim]`` of one layer (``_gather_group`` of one)."""
    return _gather_group(lay, [(k_src, v_src)], blocks, seq_pad)[0]


def _gather_kv_torch(lay: PagedLayout, k_src: torch.Tensor, v_src: torch.Tensor, blocks: torch.Tensor,
                     seq_pad: int):
    """``_gather_kv`` in torch alone: the path without numba, and the kernel's oracle in tests."""
    blocks = blocks.to(k_src.device)
    if lay.k_affine is None or lay.v_affine is None or not (k_src.is_contiguous() and v_src.is_contiguous()):
        return (_gather_generic(k_src, lay.k_offsets, blocks, seq_pad),
                _gather_generic(v_src, lay.v_offsets, blocks, seq_pad))
    # Affine maps: copy the needed blocks once (whole contiguous blocks, memcpy speed; shared by
    # K and V when one tensor holds both), then one strided copy each into the final order.
    # ~25% faster than per-head strided index_select, ~5x faster than element indexing.
    k_blocks = k_src.index_select(0, blocks.reshape(-1))
    v_blocks = k_blocks if v_src is k_src else v_src.index_select(0, blocks.reshape(-1))
    return (_reorder(k_blocks, lay.k_affine, lay, blocks.shape, seq_pad),
            _reorder(v_blocks, lay.v_affine, lay, blocks.shape, seq_pad))


def _reorder(gathered: torch.Tensor, affine, lay: PagedLayout, shape, seq_pad: int) -> torch.Tensor:
    """gathered [batch*logical_block, block_numel] -> [batch, kv_head, seq_pad, head_dim]."""
    base, sh, st, sd = affine
    b, nb = shape
    h, bs, d, numel = lay.num_kv_heads, lay.block_size, lay.head_dim, gathered.shape[1]
    view = gathered.as_strided((b, h, nb, bs, d), (nb * numel, sh, numel, st, sd), base)
    out = torch.empty((b, h, nb, bs, d), dtype=gathered.dtype)
    out.copy_(view)
    return out.view(b, h, nb * bs, d)[:, :, :seq_pad]


def _gather_generic(source: torch.Tensor, offsets: torch.Tensor, blocks: torch.Tensor, seq_pad: int) -> torch.Tensor:
    """Any in-block map: source [num_blocks, block_numel], offsets [kv_head, block_size,
    head_dim], blocks [batch, logical_block] -> [batch, kv_head, seq_pad, head_dim]."""
    b, nb = blocks.shape
    h, bs, d = offsets.shape
    out = source[blocks.view(b, 1, nb, 1, 1), offsets.view(1, h, 1, bs, d)].view(b, h, nb * bs, d)
    return out[:, :, :seq_pad]


def _reconstruct_rank(paged_kv: Mapping, kv_cache_config: Mapping, block_tables: Sequence,
                      seq_lens: list[int], batch_size: int | None, layout) -> dict:
    groups = kv_cache_config["groups"]
    layer_to_group = _layer_to_group(kv_cache_config)
    if len(block_tables) != len(groups):
        raise ValueError(f"got {len(block_tables)} block tables for {len(groups)} KV cache groups")
    tables: dict[int, torch.Tensor] = {}
    layouts: dict[int, PagedLayout] = {}
    tops: dict[int, int] = {}
    checked: set[tuple[int, int]] = set()
    s_max = max(seq_lens)
    members: dict[int, list] = {}
    for layer, entry in paged_kv.items():
        if layer not in layer_to_group:
            raise ValueError(f"layer {layer} belongs to no KV cache group (groups hold "
                             f"{sum(len(g['layer_names']) for g in groups)} layers, e.g. "
                             f"{[g['layer_names'][0] for g in groups if g['layer_names']]}); "
                             "refusing to read it with another group's block table")
        gi = layer_to_group[layer]
        group = groups[gi]
        bs = int(group["block_size"])
        if gi not in layouts:
            layouts[gi] = _resolve_layout(layout, group, gi, layer)
            table = _block_table_2d(block_tables[gi], gi, batch_size)
            ids = _request_blocks(table, seq_lens, bs, f"layer {layer} (group {gi}, block_size {bs})")
            tables[gi], tops[gi] = torch.from_numpy(ids), int(ids.max())
        lay = layouts[gi]
        k_src, v_src = lay.sources(entry, layer)
        n_blocks = k_src.shape[0]
        if (gi, n_blocks) not in checked:
            top = tops[gi]
            if top >= n_blocks:
                raise ValueError(f"layer {layer} (group {gi}): block id {top} out of range for a cache of "
                                 f"{n_blocks} blocks")
            checked.add((gi, n_blocks))
        members.setdefault(gi, []).append((layer, k_src, v_src))
    gathered = {}
    for gi, layers in members.items():  # one gather per group: the kernel takes all its layers at once
        kv = _gather_group(layouts[gi], [(k, v) for _, k, v in layers], tables[gi], s_max)
        gathered.update(zip((name for name, _, _ in layers), kv))
    result = {}
    for layer in paged_kv:  # in the caller's layer order
        k, v = gathered[layer]
        _nan_fill(k, v, groups[layer_to_group[layer]], seq_lens, s_max)
        result[layer] = (k, v)
    return result


def _nan_fill(k: torch.Tensor, v: torch.Tensor, group: Mapping, lens: list[int], s_max: int) -> None:
    """NaN past each row's length, and before the window for SlidingWindowSpec groups only."""
    sliding = group.get("spec_type") == SLIDING_WINDOW_SPEC
    if not sliding and min(lens) == s_max:
        return  # every position of every row is real
    pos = torch.arange(s_max, dtype=torch.int64).view(1, 1, -1, 1)
    n = torch.as_tensor(lens, dtype=torch.int64).view(-1, 1, 1, 1)
    invalid = pos >= n
    if sliding:
        window = group.get("sliding_window")
        if not window:
            raise ValueError(f"SlidingWindowSpec group {group['layer_names'][:1]} has no sliding_window")
        # The window counts the current token: with n tokens cached only n-W+1.. are kept.
        invalid = invalid | (pos < n - int(window) + 1)
    if not k.dtype.is_floating_point:
        raise ValueError(f"cannot NaN-fill a {k.dtype} KV cache (quantized caches are not supported)")
    k.masked_fill_(invalid, float("nan"))
    v.masked_fill_(invalid, float("nan"))


def _as_count(x, what: str) -> int:
    """An integer (Python, numpy or a one-element integer tensor); ValueError for 2.5, True, "3"."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, (str, bytes)):
        raise ValueError(f"{what} must be an integer, got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {x!r} ({type(x).__name__})") from None


def _seq_lens(seq_len, batch_size: int | None) -> list[int]:
    n = 1 if batch_size is None else batch_size
    if isinstance(seq_len, (Sequence, np.ndarray)) or (isinstance(seq_len, torch.Tensor) and seq_len.dim() > 0):
        lens = [_as_count(x, "seq_len") for x in seq_len]
        if len(lens) != n:
            raise ValueError(f"got {len(lens)} seq_lens for batch_size={n}")
    else:
        lens = [_as_count(seq_len, "seq_len")] * n
    if n < 1:
        raise ValueError(f"batch_size must be >= 1, got {n}")
    for i, x in enumerate(lens):
        if x < 1:
            raise ValueError(f"seq_len must be >= 1, got {x}" + (f" for row {i}" if n > 1 else ""))
    return lens


def _reconstruct(paged_kv, kv_cache_config, block_tables, seq_len, batch_size, layout):
    lens = _seq_lens(seq_len, batch_size)
    if isinstance(paged_kv, Mapping):
        return _reconstruct_rank(paged_kv, kv_cache_config, block_tables, lens, batch_size, layout)
    per_rank = [_reconstruct_rank(p, kv_cache_config, block_tables, lens, batch_size, layout) for p in paged_kv]
    tp = int(kv_cache_config.get("tp_size", len(per_rank)))
    total = kv_cache_config.get("total_num_kv_heads")
    if total is None:
        raise ValueError("kv_cache_config lacks total_num_kv_heads, needed to merge TP shards")
    return merge_tp_shards(per_rank, int(total), tp)


def reconstruct_contiguous_kv(paged_kv, kv_cache_config: Mapping, block_tables: Sequence, seq_len: int,
                              layout=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Contiguous K/V of one sequence from a paged cache.

    paged_kv: ``{layer: entry}`` of one TP rank, or a list of those indexed by rank (merged with
      ``merge_tp_shards`` using the config's total_num_kv_heads and tp_size).
    block_tables: list indexed by KV cache group of ``[logical_block]`` physical block ids.
    seq_len: tokens to read (>= 1); for SlidingWindowSpec groups it must be the number of
      tokens the engine has computed, since the window (which counts the current token) is
      measured from it: positions ``< seq_len - sliding_window + 1`` are NaN.
    layout: None (each group's ``layout`` in the config), a PagedLayout, a layout name, or a
      mapping group index -> one of those.
    Returns ``{layer: (k, v)}``, each ``[1, kv_head, seq, head_dim]`` in the cache dtype (with
    numba, a layer's K and V are views of one buffer of its own).
    Raises ValueError for a layer in no group, seq_len < 1, a block table too short for
    seq_len, block ids out of range and shapes that disagree with the config.
    """
    return _reconstruct(paged_kv, kv_cache_config, block_tables, seq_len, None, layout)


def reconstruct_contiguous_kv_batch(paged_kv, kv_cache_config: Mapping, block_tables: Sequence,
                                    seq_len, batch_size: int, layout=None) -> dict:
    """Contiguous K/V of ``batch_size`` sequences, one row per block-table row.

    block_tables: list indexed by group of ``[batch, logical_block]`` (rows of different lengths
      may be given as lists; missing entries are -1).
    seq_len: one int for all rows, or a list of per-row lengths. The seq axis is the longest;
      positions at or past a row's own length are NaN (padding, never a real token).
    Returns ``{layer: (k, v)}``, each ``[batch, kv_head, seq, head_dim]``.
    """
    return _reconstruct(paged_kv, kv_cache_config, block_tables, seq_len, int(batch_size), layout)


def _check_replica(layer: str, a, b, ra: int, rb: int) -> None:
    for which, x, y in zip("KV", a, b):
        if x.shape != y.shape:
            raise ValueError(f"layer {layer} {which}: replicated head of rank {rb} has shape {tuple(y.shape)}, "
                             f"rank {ra} {tuple(x.shape)}")
        differ = (x != y) & ~(torch.isnan(x) & torch.isnan(y)) if x.dtype.is_floating_point else x != y
        n = int(differ.sum())
        if n:
            raise ValueError(f"layer {layer} {which}: ranks {ra} and {rb} hold the same replicated KV head but differ "
                             f"at {n} of {x.numel()} values; the engine's ranks disagree")


def merge_tp_shards(per_rank_kv: Sequence[Mapping], total_num_kv_heads: int, tp_size: int) -> dict:
    """Merge per-rank ``{layer: (k, v)}`` (``[batch, heads_per_rank, seq, head_dim]``) on the head axis.

    Partitioned (total_num_kv_heads >= tp_size, divisible): every rank holds distinct heads,
    concatenated in rank order. Replicated (total_num_kv_heads < tp_size, dividing it): ranks
    ``0, s, 2s, ...`` with ``s = tp_size // total_num_kv_heads`` each contribute their one head.
    Every rank of a group ``[i*s, (i+1)*s)`` computes that same head from the same input, so
    their copies must agree bit for bit (NaN where NaN); a rank that disagrees would be attending
    over other KV than the one captured, so it is refused, naming the layer and both ranks.
    All ranks must hold K and V of one dtype (mixing them would be cast silently by the merge).
    """
    tp_size, total = int(tp_size), int(total_num_kv_heads)
    if tp_size < 1 or total < 1:
        raise ValueError(f"tp_size ({tp_size}) and total_num_kv_heads ({total}) must be >= 1")
    if len(per_rank_kv) != tp_size:
        raise ValueError(f"got KV from {len(per_rank_kv)} ranks for tp_size={tp_size}")
    if total >= tp_size:
        if total % tp_size:
            raise ValueError(f"total_num_kv_heads={total} is not divisible by tp_size={tp_size}")
        ranks, per_rank = list(range(tp_size)), total // tp_size
    else:
        if tp_size % total:
            raise ValueError(f"tp_size={tp_size} is not divisible by total_num_kv_heads={total}")
        ranks, per_rank = list(range(0, tp_size, tp_size // total)), 1
    layers = list(per_rank_kv[0].keys())
    for r, kv in enumerate(per_rank_kv):
        if set(kv.keys()) != set(layers):
            raise ValueError(f"rank {r} has layers {sorted(set(kv) ^ set(layers))} that rank 0 "
                             "does not share (or lacks them)")
    out = {}
    for layer in layers:
        dtypes = {(r, w): str(x.dtype).removeprefix("torch.") for r, kv in enumerate(per_rank_kv)
                  for w, x in zip("kv", kv[layer])}
        if len(set(dtypes.values())) > 1:
            first = dtypes[(0, "k")]
            odd = next(key for key, d in dtypes.items() if d != first)
            raise ValueError(f"layer {layer}: rank {odd[0]} {odd[1].upper()} is {dtypes[odd]} but rank 0 K is {first}; "
                             "TP shards of one cache must share a dtype")
        for r in range(tp_size):
            k, v = per_rank_kv[r][layer]
            if k.shape[1] != per_rank or v.shape[1] != per_rank:
                raise ValueError(f"layer {layer}, rank {r}: has {k.shape[1]} kv heads, expected "
                                 f"{per_rank} (total {total}, tp_size {tp_size})")
        if total < tp_size:
            for r in range(tp_size):
                owner = r - r % (tp_size // total)
                if r != owner:
                    _check_replica(layer, per_rank_kv[owner][layer], per_rank_kv[r][layer], owner, r)
        out[layer] = (torch.cat([per_rank_kv[r][layer][0] for r in ranks], dim=1),
                      torch.cat([per_rank_kv[r][layer][1] for r in ranks], dim=1))
    return out
