"""Paged-KV reconstruction against a per-token gather oracle written from the raw layouts."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extractors.paged import (
    merge_tp_shards,
    neuron_layout,
    reconstruct_contiguous_kv,
    reconstruct_contiguous_kv_batch,
    vllm_cpu_layout,
    vllm_cpu_vec_index_maps,
)

# ---------------------------------------------------------------- oracle (slow and obvious)


def oracle_token(layout, entry, block, slot, head, cpu_maps=None):
    """K and V vectors [head_dim] of one token, read straight from the raw layout."""
    if layout == "neuron":
        k, v = entry
        return k[block, head, slot], v[block, head, slot]
    if layout == "flash_attn":
        return entry[0, block, slot, head], entry[1, block, slot, head]
    k_index, v_index = cpu_maps
    row = entry[block, head].reshape(-1)
    return row[k_index[slot]], row[v_index[slot]]


def oracle_kv(layout, entry, table, seq_len, s_max, block_size, heads, head_dim, window=None, cpu_maps=None):
    k = torch.full((heads, s_max, head_dim), float("nan"), dtype=torch.float64)
    v = k.clone()
    for pos in range(seq_len):
        if window is not None and pos < seq_len - window + 1:
            continue
        block = table[pos // block_size]
        for h in range(heads):
            kk, vv = oracle_token(layout, entry, block, pos % block_size, h, cpu_maps)
            k[h, pos], v[h, pos] = kk.double(), vv.double()
    return k, v


def make_entry(layout, num_blocks, heads, block_size, head_dim, gen):
    if layout == "neuron":
        shape = (num_blocks, heads, block_size, head_dim)
        return (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    if layout == "flash_attn":
        return torch.randn((2, num_blocks, block_size, heads, head_dim), generator=gen)
    return torch.randn((num_blocks, heads, block_size, 2 * head_dim), generator=gen)


def random_cpu_maps(block_size, head_dim, rng):
    perm = rng.permutation(2 * block_size * head_dim)
    n = block_size * head_dim
    return perm[:n].reshape(block_size, head_dim), perm[n:].reshape(block_size, head_dim)


def group_layout(layout, heads, block_size, head_dim, cpu_maps):
    if layout == "vllm_cpu":
        return {"name": "vllm_cpu", "isa": "test", "k_index": cpu_maps[0].tolist(), "v_index": cpu_maps[1].tolist()}
    return {"name": layout}


def assert_same_nan_aware(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.double(), want.double()
    assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{what}: NaN positions differ"
    m = ~torch.isnan(w)
    assert torch.equal(g[m], w[m]), f"{what}: values differ"


# ---------------------------------------------------------------- property test


@st.composite
def paged_cases(draw):
    layout = draw(st.sampled_from(["vllm_cpu", "flash_attn", "neuron"]))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    total_heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    head_dim = draw(st.integers(1, 4))
    num_groups = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 3))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    groups = []
    for gi in range(num_groups):
        groups.append(dict(
            block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
            sliding=draw(st.booleans()),
            window=draw(st.integers(1, 20)),
            n_layers=draw(st.integers(1, 2)),
        ))
    seed = draw(st.integers(0, 2**31 - 1))
    return layout, tp, total_heads, head_dim, groups, seq_lens, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_cases())
def test_reconstruct_matches_per_token_oracle(case):
    layout, tp, total_heads, head_dim, groups, seq_lens, seed = case
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    per_rank_heads = max(1, total_heads // tp)
    num_blocks = 64
    cfg_groups, tables, specs, layer_group = [], [], {}, {}
    for gi, g in enumerate(groups):
        bs = g["block_size"]
        names = [f"model.layers.{gi}_{j}.self_attn.attn" for j in range(g["n_layers"])]
        maps = random_cpu_maps(bs, head_dim, rng) if layout == "vllm_cpu" else None
        cfg_groups.append({
            "layer_names": names, "block_size": bs, "num_kv_heads": per_rank_heads, "head_size": head_dim,
            "spec_type": "SlidingWindowSpec" if g["sliding"] else "FullAttentionSpec",
            "sliding_window": g["window"] if g["sliding"] else None,
            "layout": group_layout(layout, per_rank_heads, bs, head_dim, maps),
        })
        need = max(math.ceil(n / bs) for n in seq_lens)
        tables.append([list(rng.choice(num_blocks, size=need + int(rng.integers(0, 3)))) for _ in seq_lens])
        for name in names:
            specs[name] = (bs, g["window"] if g["sliding"] else None, maps)
            layer_group[name] = gi
    cfg = {"groups": cfg_groups, "num_blocks": num_blocks, "total_num_kv_heads": total_heads, "tp_size": tp}
    ranks = [{name: make_entry(layout, num_blocks, per_rank_heads, specs[name][0], head_dim, gen) for name in specs}
             for _ in range(tp)]
    if total_heads < tp:  # replicated heads: the ranks sharing a head hold the same copy of it
        ranks = [ranks[r - r % (tp // total_heads)] for r in range(tp)]

    got = reconstruct_contiguous_kv_batch(ranks if tp > 1 else ranks[0], cfg, tables, seq_lens, len(seq_lens))

    s_max = max(seq_lens)
    for name, (bs, window, maps) in specs.items():
        k_got, v_got = got[name]
        for b, n in enumerate(seq_lens):
            table = tables[layer_group[name]][b]
            for head in range(total_heads):
                if total_heads >= tp:
                    rank, local = head // per_rank_heads, head % per_rank_heads
                else:
                    rank, local = head * (tp // total_heads), 0
                k_all, v_all = oracle_kv(layout, ranks[rank][name], table, n, s_max, bs, per_rank_heads,
                                         head_dim, window, maps)
                where = f"{layout} layer {name} row {b} head {head} (rank {rank})"
                assert_same_nan_aware(k_got[b, head], k_all[local], "k " + where)
                assert_same_nan_aware(v_got[b, head], v_all[local], "v " + where)
    # the single-sequence entry point agrees with row 0 of the batch
    one = reconstruct_contiguous_kv(ranks if tp > 1 else ranks[0], cfg, [t[0] for t in tables], seq_lens[0])
    for name in specs:
        assert_same_nan_aware(one[name][0][0], got[name][0][0, :, :seq_lens[0]], f"single vs batch {name}")


# ---------------------------------------------------------------- hand cases


def _one_group_cfg(bs=4, heads=2, d=3, layout="neuron", spec="FullAttentionSpec", window=None, names=("a",)):
    return {"groups": [{"layer_names": list(names), "block_size": bs, "num_kv_heads": heads, "head_size": d,
                        "spec_type": spec, "sliding_window": window, "layout": {"name": layout}}],
            "num_blocks": 8, "total_num_kv_heads": heads, "tp_size": 1}


def test_neuron_hand_case_reads_blocks_in_table_order():
    # block b, head h, slot t, dim d holds 1000*b + 100*h + 10*t + d
    b, h, t, d = np.meshgrid(np.arange(8), np.arange(2), np.arange(4), np.arange(3), indexing="ij")
    k = torch.tensor(1000 * b + 100 * h + 10 * t + d, dtype=torch.float32)
    kv = {"a": (k, -k)}
    out_k, out_v = reconstruct_contiguous_kv(kv, _one_group_cfg(), [[5, 2]], 6)["a"]
    assert out_k.shape == (1, 2, 6, 3)
    assert out_k[0, 1, :, 0].tolist() == [5100, 5110, 5120, 5130, 2100, 2110]
    assert out_k[0, 0, 5].tolist() == [2010, 2011, 2012]
    assert torch.equal(out_v, -out_k)


def test_sliding_window_nan_fills_before_window_only_for_sliding_spec():
    k = torch.arange(8 * 1 * 4 * 1, dtype=torch.float32).view(8, 1, 4, 1)
    kv = {"a": (k, k)}
    cfg = _one_group_cfg(heads=1, d=1, spec="SlidingWindowSpec", window=3)
    out = reconstruct_contiguous_kv(kv, cfg, [[0, 1, 2]], 10)["a"][0][0, 0, :, 0]
    # 10 tokens, window 3 counting the current token: positions 8, 9 kept (HF keeps W-1)
    assert torch.isnan(out[:8]).all() and out[8:].tolist() == [8.0, 9.0]
    cfg_full = _one_group_cfg(heads=1, d=1, spec="FullAttentionSpec", window=3)
    out_full = reconstruct_contiguous_kv(kv, cfg_full, [[0, 1, 2]], 10)["a"][0][0, 0, :, 0]
    assert out_full.tolist() == [float(x) for x in range(10)]


def test_batch_rows_of_different_lengths_are_nan_padded_at_the_end():
    k = torch.arange(8 * 4, dtype=torch.float32).view(8, 1, 4, 1)
    cfg = _one_group_cfg(heads=1, d=1)
    out = reconstruct_contiguous_kv_batch({"a": (k, k)}, cfg, [[[1, 2], [3]]], [6, 2], 2)["a"][0]
    assert out.shape == (2, 1, 6, 1)
    assert out[0, 0, :, 0].tolist() == [4, 5, 6, 7, 8, 9]
    assert out[1, 0, :2, 0].tolist() == [12, 13] and torch.isnan(out[1, 0, 2:]).all()


def test_vllm_cpu_vec_orders_read_transposed_k_and_plain_v():
    bs, d, heads = 4, 2, 1
    k_index, v_index = vllm_cpu_vec_index_maps(bs, d)
    # Hand-build one block the way the fp32 'vec' kernel stores it: K as [d, bs], V as [bs, d].
    k_true = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])  # [slot, dim]
    v_true = -k_true
    row = torch.cat([k_true.t().reshape(-1), v_true.reshape(-1)])
    cache = torch.zeros(2, heads, bs, 2 * d)
    cache[1, 0] = row.view(bs, 2 * d)
    cfg = _one_group_cfg(bs=bs, heads=heads, d=d)
    lay = vllm_cpu_layout(heads, bs, d, k_index, v_index, isa="vec")
    k, v = reconstruct_contiguous_kv({"a": cache}, cfg, [[1]], 4, layout=lay)["a"]
    assert torch.equal(k[0, 0], k_true) and torch.equal(v[0, 0], v_true)


def test_vllm_cpu_maps_that_do_not_cover_the_row_are_refused():
    k_index, v_index = vllm_cpu_vec_index_maps(4, 2)
    with pytest.raises(ValueError, match="exactly once"):
        vllm_cpu_layout(1, 4, 2, k_index, k_index)
    with pytest.raises(ValueError):
        vllm_cpu_layout(1, 8, 2, k_index, v_index)


# ---------------------------------------------------------------- TP merge


def _rank_kv(heads, tag):
    k = torch.full((1, heads, 2, 1), float(tag))
    return {"l": (k, k + 0.5)}


@pytest.mark.parametrize("total,tp,want", [(8, 8, list(range(8))), (2, 8, [0, 4]), (16, 8, None), (1, 4, [0])])
def test_merge_tp_stride_rule(total, tp, want):
    per = max(1, total // tp)
    # replicated (total < tp): ranks of one head hold the same copy, tagged by its first rank
    ranks = [_rank_kv(per, r if total >= tp else r - r % (tp // total)) for r in range(tp)]
    k, v = merge_tp_shards(ranks, total, tp)["l"]
    assert k.shape == (1, total, 2, 1)
    expected = want if want is not None else [h // per for h in range(total)]
    assert k[0, :, 0, 0].tolist() == [float(x) for x in expected]
    assert torch.equal(v, k + 0.5)


@pytest.mark.parametrize("total,tp", [(6, 4), (3, 8), (12, 8)])
def test_merge_tp_refuses_heads_not_divisible(total, tp):
    ranks = [_rank_kv(max(1, total // tp), r) for r in range(tp)]
    with pytest.raises(ValueError, match=f"{total}.*{tp}|{tp}.*{total}"):
        merge_tp_shards(ranks, total, tp)


def test_merge_tp_refuses_wrong_rank_count_and_head_count():
    with pytest.raises(ValueError, match="3 ranks for tp_size=4"):
        merge_tp_shards([_rank_kv(1, r) for r in range(3)], 4, 4)
    with pytest.raises(ValueError, match="rank 1: has 2 kv heads, expected 1"):
        merge_tp_shards([_rank_kv(1, 0), _rank_kv(2, 1)], 2, 2)


def test_reconstruct_refuses_tp_degree_not_dividing_heads():
    cfg = _one_group_cfg(heads=1, d=1)
    cfg.update(total_num_kv_heads=3, tp_size=2)
    k = torch.zeros(8, 1, 4, 1)
    with pytest.raises(ValueError, match="total_num_kv_heads=3 is not divisible by tp_size=2"):
        reconstruct_contiguous_kv([{"a": (k, k)}, {"a": (k, k)}], cfg, [[0]], 2)


# ---------------------------------------------------------------- bad input


def _kv(heads=2, d=3):
    k = torch.zeros(8, heads, 4, d)
    return {"a": (k, k)}


def test_block_table_shorter_than_seq_len_names_layer_group_and_numbers():
    with pytest.raises(ValueError, match=r"layer a \(group 0, block_size 4\).*seq_len 9 needs 3 blocks.*only 2"):
        reconstruct_contiguous_kv(_kv(), _one_group_cfg(), [[0, 1]], 9)


def test_seq_len_zero_is_refused():
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        reconstruct_contiguous_kv(_kv(), _one_group_cfg(), [[0, 1]], 0)


def test_layer_in_no_group_is_refused_not_read_with_another_table():
    kv = {**_kv(), "model.layers.9.self_attn.attn": _kv()["a"]}
    with pytest.raises(ValueError, match=r"layer model\.layers\.9\.self_attn\.attn belongs to no KV cache group"):
        reconstruct_contiguous_kv(kv, _one_group_cfg(), [[0, 1]], 4)


def test_block_id_out_of_range_and_shape_mismatch_are_refused():
    with pytest.raises(ValueError, match="block id 9 out of range for a cache of 8 blocks"):
        reconstruct_contiguous_kv(_kv(), _one_group_cfg(), [[9]], 2)
    with pytest.raises(ValueError, match=r"layer a \(k\): paged KV has shape \(8, 2, 4, 5\)"):
        reconstruct_contiguous_kv(_kv(d=5), _one_group_cfg(), [[0]], 2)


def test_wrong_number_of_block_tables_is_refused():
    with pytest.raises(ValueError, match="2 block tables for 1 KV cache groups"):
        reconstruct_contiguous_kv(_kv(), _one_group_cfg(), [[0], [1]], 2)


def test_explicit_layout_object_overrides_config():
    k = torch.arange(8 * 2 * 4 * 3, dtype=torch.float32).view(8, 2, 4, 3)
    cfg = _one_group_cfg(layout="flash_attn")
    out = reconstruct_contiguous_kv({"a": (k, k)}, cfg, [[3]], 4, layout=neuron_layout(2, 4, 3))["a"][0]
    assert torch.equal(out[0], k[3])


def test_layouts_with_affine_in_block_maps_take_the_strided_fast_path():
    from extractors.paged import flash_attn_layout

    k_index, v_index = vllm_cpu_vec_index_maps(32, 64)
    vec = vllm_cpu_layout(2, 32, 64, k_index, v_index)
    # K (transposed) tile of head 1 starts at its row 2*32*64, then dim stride 32, token stride 1
    assert vec.k_affine == (2 * 32 * 64 * 0, 2 * 32 * 64, 1, 32)
    assert vec.v_affine == (32 * 64, 2 * 32 * 64, 64, 1)
    assert neuron_layout(4, 16, 8).k_affine == (0, 16 * 8, 8, 1)
    assert flash_attn_layout(4, 16, 8).k_affine == (0, 8, 4 * 8, 1)
    perm = np.random.default_rng(0).permutation(2 * 32 * 64)
    scrambled = vllm_cpu_layout(2, 32, 64, perm[:2048], perm[2048:])
    assert scrambled.k_affine is None and scrambled.v_affine is None


# ---------------------------------------------------------------- broken evidence


@pytest.mark.parametrize("table", [[[0.9, 2.9]], [np.array([0.9, 2.9])], [torch.tensor([0.9, 2.9])],
                                   [[[0, 1], [2.5]]], [np.array([True, False])]])
def test_non_integer_block_ids_are_refused_not_truncated(table):
    # [0.9, 2.9] used to become blocks [0, 2]: a silent read of other blocks than the engine's
    with pytest.raises(ValueError, match=r"group 0: block ids must be integers, got (float|bool)"):
        if isinstance(table[0], list) and isinstance(table[0][0], list):
            reconstruct_contiguous_kv_batch(_kv(), _one_group_cfg(), table, [5, 2], 2)
        else:
            reconstruct_contiguous_kv(_kv(), _one_group_cfg(), table, 5)


def test_integer_block_ids_of_any_integer_type_still_read_the_same_blocks():
    k = torch.arange(8 * 2 * 4 * 3, dtype=torch.float32).view(8, 2, 4, 3)
    want = reconstruct_contiguous_kv({"a": (k, k)}, _one_group_cfg(), [[5, 2]], 6)["a"][0]
    assert torch.equal(want[0, :, :4], k[5]) and torch.equal(want[0, :, 4:], k[2, :, :2])
    for table in (np.array([5, 2], np.int32), torch.tensor([5, 2], dtype=torch.int32), [np.int16(5), np.int16(2)]):
        got = reconstruct_contiguous_kv({"a": (k, k)}, _one_group_cfg(), [table], 6)["a"][0]
        assert torch.equal(got, want)
    got = reconstruct_contiguous_kv({"a": (k, k)}, _one_group_cfg(), [[5, 2]], np.int64(6))["a"][0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("seq_len", [5.5, 6.0, True, "6", torch.tensor(6.0)])
def test_non_integer_seq_len_is_refused(seq_len):
    with pytest.raises(ValueError, match="seq_len must be an integer, got"):
        reconstruct_contiguous_kv(_kv(), _one_group_cfg(), [[0, 1]], seq_len)
    with pytest.raises(ValueError, match="seq_len must be an integer, got"):
        reconstruct_contiguous_kv_batch(_kv(), _one_group_cfg(), [[[0, 1], [2, 3]]], [6, seq_len], 2)


def test_merge_tp_refuses_mixed_dtypes_across_ranks():
    a, b = _rank_kv(1, 0), _rank_kv(1, 1)
    b["l"] = (b["l"][0].to(torch.bfloat16), b["l"][1].to(torch.bfloat16))
    with pytest.raises(ValueError, match="layer l: rank 1 K is bfloat16 but rank 0 K is float32"):
        merge_tp_shards([a, b], 2, 2)
    c = _rank_kv(1, 1)
    c["l"] = (c["l"][0], c["l"][1].double())
    with pytest.raises(ValueError, match="layer l: rank 1 V is float64 but rank 0 K is float32"):
        merge_tp_shards([a, c], 2, 2)


def test_merge_tp_refuses_replicated_ranks_that_disagree():
    # total 2 heads over tp 4: ranks 0, 1 replicate head 0; ranks 2, 3 head 1
    ranks = [_rank_kv(1, r // 2) for r in range(4)]
    k, _ = merge_tp_shards(ranks, 2, 4)["l"]
    assert k[0, :, 0, 0].tolist() == [0.0, 1.0]
    nan_copy = [_rank_kv(1, r // 2) for r in range(4)]
    for r in (2, 3):  # NaN at the same place in both replicas (e.g. padding) is agreement
        nan_copy[r]["l"][0][0, 0, 1, 0] = float("nan")
    assert torch.isnan(merge_tp_shards(nan_copy, 2, 4)["l"][0][0, 1, 1, 0])
    ranks[3]["l"] = (ranks[3]["l"][0], ranks[3]["l"][1] + 1e-3)  # rank 3's copy of head 1's V is off
    with pytest.raises(ValueError, match=r"layer l V: ranks 2 and 3 hold the same replicated KV head but differ at 2 of 2"):
        merge_tp_shards(ranks, 2, 4)
