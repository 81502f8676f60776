"""The numba gather of extractors/_paged_numba.py is bit-identical to the torch path it replaces
(``paged._gather_kv_torch``, the oracle): random block tables (shuffled, reversed, repeated,
non-contiguous), partial last blocks, several batch rows, 1-8 KV heads, block sizes and head dims
on and off the kernel's transposed-square sides, BF16 / FP32 / FP16 / FP64 / FP8 (uint8 and
float8) caches filled with random bits (NaN payloads and subnormals included)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from extractors import paged as P  # noqa: E402
from extractors.paged import (  # noqa: E402
    flash_attn_layout,
    neuron_layout,
    reconstruct_contiguous_kv_batch,
    vllm_cpu_layout,
    vllm_cpu_vec_index_maps,
)

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.uint8, torch.float8_e4m3fn]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(_INT[x.element_size()])


def random_bits(shape, dtype, gen) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * width,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_case(name, heads, block_size, head_dim, num_blocks, dtype, gen):
    """(layout, k_src, v_src) with sources ``[num_blocks, block_numel]`` as ``PagedLayout.sources`` gives."""
    if name == "vllm_cpu":
        lay = vllm_cpu_layout(heads, block_size, head_dim, *vllm_cpu_vec_index_maps(block_size, head_dim))
        entry = random_bits((num_blocks, heads, block_size, 2 * head_dim), dtype, gen)
    elif name == "flash_attn":
        lay = flash_attn_layout(heads, block_size, head_dim)
        entry = random_bits((2, num_blocks, block_size, heads, head_dim), dtype, gen)
    else:
        lay = neuron_layout(heads, block_size, head_dim)
        entry = (random_bits((num_blocks, heads, block_size, head_dim), dtype, gen),
                 random_bits((num_blocks, heads, block_size, head_dim), dtype, gen))
    k_src, v_src = lay.sources(entry, "layer")
    return lay, k_src, v_src


def test_the_kernel_is_what_runs():
    # numba imports here, so a vLLM CPU 'vec' layout (K transposed) must take the kernel, not fall back
    lay, k_src, v_src = make_case("vllm_cpu", 2, 32, 64, 4, torch.bfloat16, torch.Generator().manual_seed(0))
    kernel = P._numba_kernel()
    assert kernel is not None and P._kernel_reads(kernel, lay, k_src, v_src)
    assert lay.k_affine[2:] == (1, 32) and lay.v_affine[2:] == (64, 1)  # K: token stride 1 (transposed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(["vllm_cpu", "flash_attn", "neuron"]),
       dtype=st.sampled_from(DTYPES),
       heads=st.sampled_from([1, 2, 3, 8]),
       block_size=st.sampled_from([1, 5, 8, 16, 32, 48, 64]),
       head_dim=st.sampled_from([1, 4, 7, 8, 16, 24, 32, 64, 80]),
       data=st.data())
def test_kernel_gather_is_bit_identical_to_the_torch_path(layout, dtype, heads, block_size, head_dim, data):
    batch = data.draw(st.integers(1, 3), label="batch")
    n_layers = data.draw(st.integers(1, 3), label="layers")
    num_blocks = data.draw(st.integers(1, 12), label="num_blocks")
    seq = data.draw(st.integers(1, 5 * block_size), label="seq")
    nb = -(-seq // block_size)
    order = data.draw(st.sampled_from(["random", "reversed", "same"]), label="order")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    if order == "random":  # ids may repeat and skip: any in-range table
        table = rng.integers(0, num_blocks, (batch, nb))
    elif order == "reversed":
        table = (num_blocks - 1 - np.arange(batch * nb) % num_blocks).reshape(batch, nb)
    else:
        table = np.full((batch, nb), num_blocks - 1)
    blocks = torch.from_numpy(table.astype(np.int64))
    gen = torch.Generator().manual_seed(int(rng.integers(0, 2**31)))
    cases = [make_case(layout, heads, block_size, head_dim, num_blocks, dtype, gen) for _ in range(n_layers)]
    lay = cases[0][0]
    got = P._gather_group(lay, [(k, v) for _, k, v in cases], blocks, seq)
    for (_, k_src, v_src), (k, v) in zip(cases, got):
        want_k, want_v = P._gather_kv_torch(lay, k_src, v_src, blocks, seq)
        assert k.shape == want_k.shape == (batch, heads, seq, head_dim) and k.dtype == dtype
        assert v.shape == want_v.shape and v.dtype == dtype
        assert torch.equal(bits(k), bits(want_k)), f"K differs at {int((bits(k) != bits(want_k)).sum())} values"
        assert torch.equal(bits(v), bits(want_v)), f"V differs at {int((bits(v) != bits(want_v)).sum())} values"


def test_kernel_reads_the_vllm_cpu_transposed_k_element_by_element():
    # an explicit case with every edge: 40 tokens = one full 32-token block + 8 of the next (a
    # partial last block), head_dim 40 (two 16-squares + an 8 edge in bf16), blocks out of order
    bs, d, h = 32, 40, 2
    lay, k_src, v_src = make_case("vllm_cpu", h, bs, d, 5, torch.bfloat16, torch.Generator().manual_seed(3))
    blocks = torch.tensor([[4, 1]])
    (k, v), = P._gather_group(lay, [(k_src, v_src)], blocks, 40)
    tiles = k_src.view(5, h, 2, bs * d)
    for t in range(40):
        blk, slot = int(blocks[0, t // bs]), t % bs
        for hh in range(h):
            for i in range(d):  # K stored [head_dim, block_size]: (slot, i) at i * bs + slot
                assert bits(k[0, hh, t, i]) == bits(tiles[blk, hh, 0, i * bs + slot])
                assert bits(v[0, hh, t, i]) == bits(tiles[blk, hh, 1, slot * d + i])


def test_reconstruct_gives_the_same_bits_with_and_without_the_kernel(monkeypatch):
    bs, d, h = 32, 64, 2
    gen = torch.Generator().manual_seed(5)
    k_index, v_index = vllm_cpu_vec_index_maps(bs, d)
    cfg = {"num_blocks": 9, "total_num_kv_heads": h, "tp_size": 1,
           "groups": [{"layer_names": ["a", "b"], "spec_type": "FullAttentionSpec", "block_size": bs,
                       "num_kv_heads": h, "head_size": d, "sliding_window": None,
                       "layout": {"name": "vllm_cpu", "isa": "vec", "k_index": k_index.tolist(),
                                  "v_index": v_index.tolist()}}]}
    paged = {name: torch.randn((9, h, bs, 2 * d), generator=gen).to(torch.bfloat16) for name in ("a", "b")}
    tables = [[[8, 2, 5], [0, 7, 1]]]
    fast = reconstruct_contiguous_kv_batch(paged, cfg, tables, [90, 70], 2)
    monkeypatch.setattr(P, "_KERNEL", [None])
    plain = reconstruct_contiguous_kv_batch(paged, cfg, tables, [90, 70], 2)
    for name in paged:
        for x, y in zip(fast[name], plain[name]):
            assert x.shape == y.shape == (2, h, 90, d)
            assert torch.equal(bits(x), bits(y))
            assert x[1, :, 70:].isnan().all() and not x[1, :, :70].isnan().any()


def test_sources_the_kernel_does_not_take_fall_back_to_torch():
    # a non-contiguous source (a strided view of a bigger cache) goes through the torch path
    lay, k_src, v_src = make_case("neuron", 2, 8, 16, 6, torch.float32, torch.Generator().manual_seed(7))
    wide = torch.cat([k_src, k_src], dim=1)[:, : k_src.shape[1]]
    assert not wide.is_contiguous() and not P._kernel_reads(P._numba_kernel(), lay, wide, v_src)
    blocks = torch.tensor([[5, 0]])
    (k, v), = P._gather_group(lay, [(wide, v_src)], blocks, 12)
    want_k, want_v = P._gather_kv_torch(lay, k_src, v_src, blocks, 12)
    assert torch.equal(bits(k), bits(want_k)) and torch.equal(bits(v), bits(want_v))


def test_layers_of_one_width_but_different_dtypes_keep_their_own_dtype():
    # one kernel call per value width: a bf16 and an fp16 layer share it (each layer its own buffer)
    gen = torch.Generator().manual_seed(11)
    cases = [make_case("vllm_cpu", 2, 16, 24, 4, dtype, gen) for dtype in (torch.bfloat16, torch.float16)]
    lay, blocks = cases[0][0], torch.tensor([[3, 0, 2]])
    got = P._gather_group(lay, [(k, v) for _, k, v in cases], blocks, 40)
    for (_, k_src, v_src), (k, v) in zip(cases, got):
        want_k, want_v = P._gather_kv_torch(lay, k_src, v_src, blocks, 40)
        assert k.dtype == v.dtype == k_src.dtype
        assert torch.equal(bits(k), bits(want_k)) and torch.equal(bits(v), bits(want_v))
    # a layer's K and V share a buffer of their own, freed with the layer (a buffer of every
    # layer was a fresh mapping past glibc's mmap threshold, its pages faulted in each time)
    storages = [(k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()) for k, v in got]
    assert all(a == b for a, b in storages) and len({a for a, _ in storages}) == len(got)
