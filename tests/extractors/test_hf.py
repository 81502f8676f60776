"""extractors/hf.py: HF teacher-forced / greedy logits + KV, checked against independent oracles.

Oracles: plain unbatched HF forwards with HF's own cache (no code from extractors.hf), HF's own
``model.generate``, and K/V recomputed by hand in float64 (RMSNorm -> k_proj -> RoPE).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from extractors.hf import (  # noqa: E402
    capture_hf_run,
    extract_hf_kv_caches_teacher_forced,
    generate_hf_logits_and_kv,
    hf_layer_names,
    load_hf_model,
)

W = 16  # sliding_window of the tiny gemma3/mistral models; HF keeps W - 1 positions

# Three prompts of different lengths (longer, shorter and equal to W) and ragged teacher tokens.
PROMPTS = [
    [1] + list(range(40, 61)),  # 22 tokens
    [1, 300, 301, 302, 303],  # 5 tokens
    [1] + list(range(500, 515)),  # 16 tokens
]
TEACHERS = [[700, 701, 702, 703, 704], [710, 711], [720, 721, 722, 723, 724, 725, 726, 727]]


@pytest.fixture(scope="module")
def models(tiny_model):
    cache = {}

    def get(arch, dtype="float32"):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = load_hf_model(tiny_model(arch), dtype)
        return cache[arch, dtype]

    return get


def _plain_forward(model, ids):
    """Unbatched HF forward with default positions and HF's own cache: (logits [seq, vocab],
    [(k, v) per layer] each [kv_head, kept, head_dim])."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    layers = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
    return out.logits[0], layers


def _nan_positions(x):
    """Positions (seq index) where a [kv_head, seq, head_dim] tensor is NaN, asserting whole rows."""
    nan = x.isnan()
    assert torch.equal(nan.any(-1), nan.all(-1)), "partial NaN inside a position"
    assert torch.equal(nan.any(-1).any(0), nan.any(-1).all(0)), "NaN in some heads only"
    return set(torch.nonzero(nan[0].all(-1)).flatten().tolist())


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3-sliding", "mistral-sliding"])
def test_ragged_batch_matches_plain_unbatched_forwards(models, arch):
    model = models(arch)
    cfg = model.config
    sliding = [t == "sliding_attention" for t in getattr(cfg, "layer_types", None) or []] or \
        [getattr(cfg, "sliding_window", None) is not None] * cfg.num_hidden_layers
    logits, kv = extract_hf_kv_caches_teacher_forced(model, PROMPTS, TEACHERS, return_logits=True)

    lens = [len(p) + len(t) for p, t in zip(PROMPTS, TEACHERS)]
    B, G, S = len(PROMPTS), max(map(len, TEACHERS)), max(lens)
    assert logits.shape == (G, B, cfg.vocab_size) and logits.dtype == torch.float32
    assert list(kv) == [f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)]
    for b, (p, t) in enumerate(zip(PROMPTS, TEACHERS)):
        ref_logits, ref_layers = _plain_forward(model, p + t)
        n = lens[b]
        # logits[j, b] = output at position len(p) - 1 + j (predicts teacher token j)
        torch.testing.assert_close(logits[: len(t), b], ref_logits[len(p) - 1 : n - 1], atol=2e-5, rtol=0)
        assert logits[len(t):, b].isnan().all()
        for i, (name, (k, v)) in enumerate(kv.items()):
            assert k.shape == v.shape == (B, cfg.num_key_value_heads, S, cfg.head_dim)
            rk, rv = ref_layers[i]
            kept = rk.shape[1]
            assert kept == (min(n, W - 1) if sliding[i] else n)
            # HF's kept positions sit at the end: they are positions n-kept .. n-1
            torch.testing.assert_close(k[b, :, n - kept : n], rk, atol=1e-5, rtol=0, msg=f"{name} row {b}")
            torch.testing.assert_close(v[b, :, n - kept : n], rv, atol=1e-5, rtol=0, msg=f"{name} row {b}")
            expect_nan = set(range(0, n - kept)) | set(range(n, S))
            assert _nan_positions(k[b]) == expect_nan, f"{name} row {b}"
            assert _nan_positions(v[b]) == expect_nan, f"{name} row {b}"


def _rms(x, w, eps, gemma):
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * ((1.0 + w) if gemma else w)


def _rope(x, pos, theta):
    """HF (non-interleaved) RoPE by hand: x [head, seq, d], pos [seq]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


@pytest.mark.parametrize("arch,layer,theta", [
    ("llama-gqa", 1, 10000.0),
    ("gemma3-sliding", 2, 10000.0),  # sliding layer: local RoPE base
    ("gemma3-sliding", 3, 1_000_000.0),  # full layer: global RoPE base
])
def test_k_and_v_match_a_hand_recomputation_from_hidden_states(models, arch, layer, theta):
    model = models(arch)
    cfg = model.config
    gemma = cfg.model_type.startswith("gemma")
    ids = PROMPTS[0] + TEACHERS[0]  # 27 tokens > W
    kv = extract_hf_kv_caches_teacher_forced(model, [PROMPTS[2], ids], [[], []])
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0].double().numpy()
    sd = {n: p.detach().double().numpy() for n, p in model.model.layers[layer].named_parameters()}
    x = _rms(hidden, sd["input_layernorm.weight"], cfg.rms_norm_eps, gemma)
    H, D = cfg.num_key_value_heads, cfg.head_dim
    k = (x @ sd["self_attn.k_proj.weight"].T).reshape(len(ids), H, D).transpose(1, 0, 2)
    v = (x @ sd["self_attn.v_proj.weight"].T).reshape(len(ids), H, D).transpose(1, 0, 2)
    if gemma:
        k = _rms(k, sd["self_attn.k_norm.weight"], cfg.rms_norm_eps, True)
    k = _rope(k, np.arange(len(ids)), theta)

    got_k, got_v = (t[1].double().numpy() for t in kv[f"model.layers.{layer}.self_attn.attn"])
    n = len(ids)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    first = n - (W - 1) if layer_types[layer] == "sliding_attention" else 0
    assert np.isnan(got_k[:, :first]).all() and not np.isnan(got_k[:, first:n]).any()
    np.testing.assert_allclose(got_k[:, first:n], k[:, first:], atol=5e-5, rtol=0)
    np.testing.assert_allclose(got_v[:, first:n], v[:, first:], atol=5e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama-mha", "gemma3-sliding"])
def test_greedy_path_matches_hf_generate_and_teacher_forced_pass(models, arch):
    model = models(arch)
    prompts = [PROMPTS[0], PROMPTS[1]]
    n_new = 14  # 5 + 14 and 22 + 14 > W: windows slide during decode
    logits, kv = generate_hf_logits_and_kv(model, prompts, n_new)
    assert logits.shape == (n_new, 2, model.config.vocab_size)
    tokens = logits.argmax(-1).T.tolist()  # [batch][gen_token]
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        assert tokens[b] == ref[0, len(p):].tolist()

    tf_logits, tf_kv = extract_hf_kv_caches_teacher_forced(model, prompts, tokens, return_logits=True)
    torch.testing.assert_close(logits, tf_logits, atol=5e-5, rtol=0)
    for name in kv:
        for a, c in zip(kv[name], tf_kv[name]):
            assert torch.equal(a.isnan(), c.isnan()), name
            torch.testing.assert_close(a.nan_to_num(), c.nan_to_num(), atol=2e-5, rtol=0)
    # the extra forward: the KV covers the last generated token of every row
    for b, p in enumerate(prompts):
        last = len(p) + n_new - 1
        for name in kv:
            assert not kv[name][0][b, :, last].isnan().any(), f"{name} row {b} misses its last token"


def test_bf16_model_keeps_bf16_and_stays_within_bf16_rounding_of_fp32(models):
    fp32, bf16 = models("gemma3-sliding"), models("gemma3-sliding", "bfloat16")
    l32, kv32 = extract_hf_kv_caches_teacher_forced(fp32, PROMPTS, TEACHERS, return_logits=True)
    l16, kv16 = extract_hf_kv_caches_teacher_forced(bf16, PROMPTS, TEACHERS, return_logits=True)
    assert l16.dtype == torch.bfloat16
    for name in kv32:
        k32, k16 = kv32[name][0], kv16[name][0]
        assert k16.dtype == torch.bfloat16 and torch.equal(k32.isnan(), k16.isnan())
        d = (k16.float() - k32).nan_to_num()
        rel_l2 = d.norm() / k32.nan_to_num().norm()
        # bf16 keeps 8 significant bits (eps 2^-8 = 0.0039); a few layers of rounding stay ~1e-2
        assert 1e-4 < rel_l2 < 3e-2, f"{name}: rel L2 {rel_l2:.3g}"


def test_empty_teacher_rows_give_kv_of_the_prompt_and_nan_logits(models):
    model = models("llama-gqa")
    logits, kv = extract_hf_kv_caches_teacher_forced(model, PROMPTS[:2], [[], [9, 10]], return_logits=True)
    assert logits.shape[:2] == (2, 2)
    assert logits[:, 0].isnan().all() and not logits[:, 1].isnan().any()
    k = kv["model.layers.0.self_attn.attn"][0]
    assert _nan_positions(k[0]) == set()  # row 0: 22 prompt tokens fill the width
    assert _nan_positions(k[1]) == set(range(7, 22))


@pytest.mark.parametrize("call,match", [
    (lambda m: extract_hf_kv_caches_teacher_forced(m, [[1, 2], []], [[3], [4]]), r"input_ids\[1\]: empty"),
    (lambda m: extract_hf_kv_caches_teacher_forced(m, [1, 2, 5000], [3]), r"input_ids\[0\]\[2\]: token id 5000 outside"),
    (lambda m: extract_hf_kv_caches_teacher_forced(m, [1, 2], [3, -1]), r"teacher_tokens\[0\]\[1\]: token id -1"),
    (lambda m: extract_hf_kv_caches_teacher_forced(m, [1, 2.0], [3]), r"input_ids\[0\]\[1\]: token id 2.0 is a float"),
    (lambda m: extract_hf_kv_caches_teacher_forced(m, [[1, 2], [3]], [[4]]), r"teacher_tokens has 1 rows, input_ids has 2"),
    (lambda m: generate_hf_logits_and_kv(m, [1, 2], 0), r"num_tokens must be an int >= 1, got 0"),
    (lambda m: load_hf_model("/nonexistent", "int8"), r"dtype 'int8' not one of"),
])
def test_bad_input_is_refused_naming_where(models, call, match):
    with pytest.raises(ValueError, match=match):
        call(models("llama-gqa"))


def test_tensor_inputs_are_accepted_like_lists(models):
    model = models("llama-gqa")
    a = extract_hf_kv_caches_teacher_forced(model, torch.tensor([PROMPTS[1]]), torch.tensor([TEACHERS[1]]))
    b = extract_hf_kv_caches_teacher_forced(model, PROMPTS[1], TEACHERS[1])
    for name in a:
        assert torch.equal(a[name][0], b[name][0]) and torch.equal(a[name][1], b[name][1])


def test_capture_hf_run_writes_what_the_extractors_return(models, tiny_model, tmp_path):
    import capturestore as store_mod
    from extractors.models import model_content_hash

    path = tiny_model("gemma3-sliding")
    model = models("gemma3-sliding")
    store = store_mod.Store.open(tmp_path / "store")
    names = hf_layer_names(model)

    tf_run = capture_hf_run(store, path, PROMPTS, teacher_tokens=TEACHERS, model=model, release="r1")
    gen_run = capture_hf_run(store, path, PROMPTS[:2], num_tokens=6, model=model)
    with pytest.raises(ValueError, match="model passed is float32, the run says dtype='bfloat16'"):
        capture_hf_run(store, path, PROMPTS[:1], num_tokens=2, model=model, dtype="bfloat16")

    runs = {r["run_id"]: r for r in store.runs().to_pylist()}
    assert runs[tf_run]["engine"] == "hf" and runs[tf_run]["dtype"] == "float32"
    assert runs[tf_run]["model_hash"] == model_content_hash(path)
    cfg = runs[tf_run]["config"]
    cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
    assert cfg["mode"] == "teacher_forced" and cfg["layer_names"] == names

    prompt_rows = {r["prompt_id"]: r for r in store.prompts(tf_run).to_pylist()}
    assert sorted((r["n_prompt_tokens"], r["n_tokens"]) for r in prompt_rows.values()) == \
        sorted((len(p), len(p) + len(t)) for p, t in zip(PROMPTS, TEACHERS))
    for p, t in zip(PROMPTS, TEACHERS):
        logits, kv = extract_hf_kv_caches_teacher_forced(model, [p], [t], return_logits=True)
        pid = store_mod.prompt_id(p)
        assert store.read_tokens(tf_run, pid).tolist() == p + t
        torch.testing.assert_close(store.read_logits(tf_run, pid, as_torch=True), logits[:, 0], atol=0, rtol=0)
        k, v = store.read_kv(tf_run, pid, as_torch=True)
        assert k.shape == (len(names), 2, len(p) + len(t), 32)
        for i, n in enumerate(names):
            torch.testing.assert_close(k[i], kv[n][0][0], atol=0, rtol=0, equal_nan=True)
            torch.testing.assert_close(v[i], kv[n][1][0], atol=0, rtol=0, equal_nan=True)

    for p in PROMPTS[:2]:
        logits, kv = generate_hf_logits_and_kv(model, [p], 6)
        toks = p + logits[:, 0].argmax(-1).tolist()
        pid = store_mod.prompt_id(p)
        assert store.read_tokens(gen_run, pid).tolist() == toks
        torch.testing.assert_close(store.read_logits(gen_run, pid, as_torch=True), logits[:, 0], atol=0, rtol=0)


def test_repeated_calls_share_no_state(models):
    # A stale cache carried between calls would change the second capture of the same input.
    model = models("gemma3-sliding")
    first = extract_hf_kv_caches_teacher_forced(model, PROMPTS, TEACHERS, return_logits=True)
    extract_hf_kv_caches_teacher_forced(model, [PROMPTS[1][:3]], [[9] * 30], return_logits=True)
    generate_hf_logits_and_kv(model, [PROMPTS[0]], 3)
    again = extract_hf_kv_caches_teacher_forced(model, PROMPTS, TEACHERS, return_logits=True)
    torch.testing.assert_close(again[0], first[0], atol=0, rtol=0, equal_nan=True)
    for name in first[1]:
        for a, b in zip(first[1][name], again[1][name]):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def _ragged_batches():
    from hypothesis import strategies as st

    row = st.tuples(st.integers(1, 30), st.integers(0, 8))  # (prompt_len, teacher_len)
    return st.tuples(st.sampled_from(["llama-mha", "llama-gqa", "gemma3-sliding"]),
                     st.lists(row, min_size=1, max_size=4), st.integers(0, 2**16))


def test_random_ragged_batches_match_plain_forwards(models):
    """Property: any batch of (prompt_len, teacher_len) rows, including 1-token prompts and empty
    teacher rows, gives each row exactly its own unbatched forward (logits + kept KV)."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_ragged_batches())
    def check(case):
        arch, shape, seed = case
        model = models(arch)
        rng = np.random.default_rng(seed)
        prompts = [[1] + rng.integers(4, 1024, p - 1).tolist() for p, _ in shape]
        teachers = [rng.integers(4, 1024, t).tolist() for _, t in shape]
        logits, kv = extract_hf_kv_caches_teacher_forced(model, prompts, teachers, return_logits=True)
        for b, (p, t) in enumerate(zip(prompts, teachers)):
            ref_logits, ref_layers = _plain_forward(model, p + t)
            n = len(p) + len(t)
            if t:
                torch.testing.assert_close(logits[: len(t), b], ref_logits[len(p) - 1 : n - 1], atol=2e-5, rtol=0)
            for i, (k, v) in enumerate(kv.values()):
                rk, rv = ref_layers[i]
                kept = rk.shape[1]
                torch.testing.assert_close(k[b, :, n - kept : n], rk, atol=2e-5, rtol=0)
                torch.testing.assert_close(v[b, :, n - kept : n], rv, atol=2e-5, rtol=0)
                assert k[b, :, : n - kept].isnan().all() and k[b, :, n:].isnan().all()

    check()
