"""The paged-KV gather of ``extractors.paged`` as one numba kernel per layer (optional: needs numba).

``gather_layers`` reads each needed (block, kv_head) tile of a paged cache once, straight from
the cache (no copy of the blocks first), and writes K and V once, in their final
``[batch, kv_head, seq, head_dim]`` order. Only bits move: every dtype is copied as unsigned
integers of its width, so the result is bit-identical to the torch path it replaces
(``paged._gather_kv_torch``, kept as the oracle in tests/extractors/test_paged_kernel.py).

A tile's in-block map is affine (``PagedLayout.k_affine``): element (token t, dim d) of head h
sits at ``base + h*sh + t*st + d*sd``. Three cases:
- ``sd == 1`` (V, and K of flash-attn / Neuron): each token is a run of head_dim values, copied
  as such (LLVM vectorises the run);
- ``st == 1`` (vLLM CPU 'vec' K, stored as ``[head_dim, block_size]``): a transpose. It runs in
  L x L squares held in vector registers (``_transpose_square``: L loads of L values, log2(L)
  rounds of interleaves, L stores), L = 16 for 1- and 2-byte values, 8 for 4- and 8-byte ones;
  an element-by-element transposing copy costs 3-4x a clone of the same bytes on this CPU
  (docs/benchmarks.md), the squares about one clone. The edges (head_dim or a partial last
  block's tokens not a multiple of L) are copied element by element.
- anything else affine: element by element.
Tokens past the seq axis (a partial last block) are neither read nor written.
"""
from __future__ import annotations

import numpy as np

from metrics._numba import import_numba

numba = import_numba()  # guarded: a vLLM engine still starts in this process (see metrics._numba)
from llvmlite import ir  # noqa: E402
from numba.core import cgutils, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

__all__ = ["gather_layers", "square_side", "WIDTHS"]


def _njit(f):
    try:
        return numba.njit(cache=True, nogil=True, boundscheck=False)(f)
    except Exception:  # noqa: BLE001 - no writable cache location: compile per process
        return numba.njit(cache=False, nogil=True, boundscheck=False)(f)


def square_side(itemsize: int) -> int:
    """S of the S x S transposed squares for values of ``itemsize`` bytes: two 128-bit lanes' worth."""
    return 2 * (16 // itemsize)


@intrinsic
def _transpose_square(typingctx, src, s_at, s_stride, dst, d_at, d_stride):  # pragma: no cover - compiled
    """dst[d_at + j*d_stride + i] = src[s_at + i*s_stride + j] for i, j < S = 2m (``square_side``),
    m the values per 128-bit lane. Register i (< m) holds four lane-sized runs: rows i and i+m of
    columns 0..m-1, then of columns m..2m-1 (the loads place them: no shuffle); log2(m) rounds of
    in-lane interleaves (row i with row i + m/2, unpack lo/hi) transpose each lane's m x m block,
    after which register j holds output row j (lanes 0-1) and output row m+j (lanes 2-3). In-lane
    shuffles are one cheap instruction each; a cross-lane network (vpermt2w) cost 3x as much."""
    sig = types.void(src, s_at, s_stride, dst, d_at, d_stride)

    def codegen(context, builder, signature, args):
        tys = signature.args
        width = context.get_abi_sizeof(context.get_data_type(tys[0].dtype))
        m = 16 // width
        elem = ir.IntType(8 * width)
        run = ir.VectorType(elem, m)
        i32 = ir.IntType(32)

        def idx(k):
            return context.cast(builder, args[k], tys[k], types.int64)

        def mask(values):
            return ir.Constant(ir.VectorType(i32, len(values)), values)

        sp = context.make_array(tys[0])(context, builder, args[0]).data
        dp = context.make_array(tys[3])(context, builder, args[3]).data
        s_at, s_st, d_at, d_st = idx(1), idx(2), idx(4), idx(5)

        def load(row, col):
            at = builder.add(s_at, builder.add(builder.mul(s_st, ir.Constant(s_st.type, row)),
                                               ir.Constant(s_at.type, col)))
            return builder.load(builder.bitcast(builder.gep(sp, [at]), run.as_pointer()), align=width)

        pair = mask(list(range(2 * m)))
        quad = mask(list(range(4 * m)))
        regs = []
        for i in range(m):
            a = builder.shuffle_vector(load(i, 0), load(i + m, 0), pair)
            b = builder.shuffle_vector(load(i, m), load(i + m, m), pair)
            regs.append(builder.shuffle_vector(a, b, quad))
        half = m // 2
        lo = mask([k * m + (q // 2) + (4 * m if q % 2 else 0) for k in range(4) for q in range(m)])
        hi = mask([k * m + half + (q // 2) + (4 * m if q % 2 else 0) for k in range(4) for q in range(m)])
        for _ in range(m.bit_length() - 1):
            new = [None] * m
            for i in range(half):
                new[2 * i] = builder.shuffle_vector(regs[i], regs[i + half], lo)
                new[2 * i + 1] = builder.shuffle_vector(regs[i], regs[i + half], hi)
            regs = new
        row = ir.VectorType(elem, 2 * m)
        first, second = mask(list(range(2 * m))), mask(list(range(2 * m, 4 * m)))
        for j in range(m):
            for out_row, part in ((j, first), (j + m, second)):
                at = builder.add(d_at, builder.mul(d_st, ir.Constant(d_st.type, out_row)))
                p = builder.bitcast(builder.gep(dp, [at]), row.as_pointer())
                builder.store(builder.shuffle_vector(regs[j], regs[j], part), p, align=width)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _copy_run(typingctx, src, s_at, dst, d_at, n):  # pragma: no cover - compiled
    """dst[d_at:d_at + n] = src[s_at:s_at + n] (memcpy; the arrays never overlap)."""
    sig = types.void(src, s_at, dst, d_at, n)

    def codegen(context, builder, signature, args):
        tys = signature.args
        width = context.get_abi_sizeof(context.get_data_type(tys[0].dtype))
        sp = context.make_array(tys[0])(context, builder, args[0]).data
        dp = context.make_array(tys[2])(context, builder, args[2]).data
        s = builder.gep(sp, [context.cast(builder, args[1], tys[1], types.int64)])
        d = builder.gep(dp, [context.cast(builder, args[3], tys[3], types.int64)])
        n_bytes = builder.mul(context.cast(builder, args[4], tys[4], types.int64), ir.Constant(ir.IntType(64), width))
        cgutils.raw_memcpy(builder, d, s, n_bytes, 1)
        return context.get_dummy_value()

    return sig, codegen


@_njit
def _copy_tile(src, at, st, sd, out, o_at, n_tok, d, side):  # pragma: no cover - compiled
    """One (block, head) tile: element (t, i) at src[at + t*st + i*sd] -> out[o_at + t*d + i]."""
    if sd == 1 and st == d:  # the whole tile is one run (vLLM CPU V, Neuron)
        _copy_run(src, at, out, o_at, n_tok * d)
    elif sd == 1:  # one run per token (flash-attn: tokens strided by kv_head * head_dim)
        for t in range(n_tok):
            _copy_run(src, at + t * st, out, o_at + t * d, d)
    elif st == 1:
        t_sq = n_tok - n_tok % side
        i_sq = d - d % side
        for i0 in range(0, i_sq, side):
            for t0 in range(0, t_sq, side):
                _transpose_square(src, at + i0 * sd + t0, sd, out, o_at + t0 * d + i0, d)
        for t in range(n_tok):  # the edges: tokens past the last square, dims past the last square
            lo = i_sq if t < t_sq else 0
            for i in range(lo, d):
                out[o_at + t * d + i] = src[at + t + i * sd]
    else:
        for t in range(n_tok):
            for i in range(d):
                out[o_at + t * d + i] = src[at + t * st + i * sd]


@_njit
def _gather(src, numel, blocks, base, sh, st, sd, out, b, h, nb, bs, d, seq, side):  # pragma: no cover - compiled
    for r in range(b):
        for j in range(nb):
            t0 = j * bs
            n_tok = min(bs, seq - t0)
            if n_tok <= 0:
                break
            blk = blocks[r * nb + j] * numel + base
            for hh in range(h):
                o_at = ((r * h + hh) * seq + t0) * d
                _copy_tile(src, blk + hh * sh, st, sd, out, o_at, n_tok, d, side)


@intrinsic
def _pointer(typingctx, address, like):  # pragma: no cover - compiled
    """The integer ``address`` as a pointer to ``like``'s element type."""
    ptr_t = types.CPointer(like.dtype)
    sig = ptr_t(address, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))

    return sig, codegen


@_njit
def _gather_layers(addresses, like, blocks, maps, numel, b, h, nb, bs, d, seq, side):  # pragma: no cover - compiled
    out_n = b * h * seq * d
    for layer in range(addresses.shape[0]):
        for w in range(2):  # K, then V
            src = numba.carray(_pointer(addresses[layer, w], like), addresses[layer, 4 + w] * numel)
            out = numba.carray(_pointer(addresses[layer, 2 + w], like), out_n)
            _gather(src, numel, blocks, maps[w, 0], maps[w, 1], maps[w, 2], maps[w, 3], out,
                    b, h, nb, bs, d, seq, side)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_LIKE = {w: np.zeros(1, u) for w, u in _UINT.items()}
WIDTHS = tuple(_UINT)


def gather_layers(addresses: np.ndarray, itemsize: int, block_numel: int, blocks: np.ndarray, maps: np.ndarray,
                  num_kv_heads: int, block_size: int, head_dim: int, seq: int) -> None:
    """Gather K and V of several layers in one call, by address (the caller owns every check).

    addresses: int64 [layer, 6]: K source, V source, K out, V out data addresses, then the K and
      V sources' block counts. Sources are C-contiguous ``[num_blocks, block_numel]`` of values of
      ``itemsize`` bytes (any type: bits are copied); outs C-contiguous ``[batch, kv_head, seq,
      head_dim]`` of the same itemsize, never overlapping a source.
    blocks: int64 C-contiguous [batch, logical_block], every id in [0, num_blocks) of every source,
      ``ceil(seq / block_size)`` ids per row at least (ids past ``seq`` are not read).
    maps: int64 [2, 4], the K and V in-block maps (base, head_stride, token_stride, dim_stride), >= 0.
    """
    b, nb = blocks.shape
    _gather_layers(addresses, _LIKE[itemsize], blocks.reshape(-1), maps, block_numel, b, num_kv_heads, nb,
                   block_size, head_dim, seq, square_side(itemsize))
