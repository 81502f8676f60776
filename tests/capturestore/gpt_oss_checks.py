"""The tiny GPT-OSS through ``capturestore run --target vllm`` (FP32 engine), checked against HF.

Shared by ``test_gpt_oss_vllm.py`` (hybrid KV cache manager on, vLLM's CPU default: two KV cache
groups) and ``test_gpt_oss_vllm_hybrid_off.py`` (off: one group, nothing freed), one engine each.
The oracle is HF FP32 eager on the same weights (the store's baseline runs): vLLM-CPU's FP32
logits, KV and module tensors must equal it to FP32 rounding, not only pass the verdicts.
"""
from __future__ import annotations

import json

import numpy as np

from capturestore import Store

W = 16  # the tiny GPT-OSS's sliding window; sliding layers are the even ones
SLIDING, FULL = (0, 2), (1, 3)
# a 40-token prompt + 20 tokens = 60 positions: past block 0 (block_size 32) + W, so the hybrid
# manager frees a block of the sliding layers; an 8-token one that frees nothing. Both decode
# past prompt + W (where ENGINES.md once saw GPT-OSS go wrong with the hybrid manager off).
PROMPTS = [[1] + [40 + (7 * i) % 300 for i in range(39)], [1, 43, 323, 79, 82, 391, 326, 72]]
NUM_TOKENS = 20
MODULES = ("model.embed_tokens,model.layers.*.input_layernorm,model.layers.*.self_attn.q_proj,"
           "model.layers.*.self_attn.k_proj,model.layers.*.self_attn.v_proj,model.layers.*.self_attn.o_proj,"
           "model.layers.*.self_attn,model.layers.*.post_attention_layernorm,model.layers.*.mlp,model.layers.*,"
           "model.norm")  # every module of the GPT-OSS map
ATOL = 2e-4  # FP32 engine vs FP32 HF: measured <= 1.4e-5 on logits, ~5e-6 on KV


def run_fp32(tmp_path, plugins=("logits", "kv", "modules"), engine_hook=None, **engine_options):
    """``pipeline.run`` on the tiny GPT-OSS, vLLM FP32 target, ``plugins`` (``engine_hook``: a fault
    to plant, ``pipeline.run``'s); returns ``(result, store, lines)``."""
    import numba  # noqa: F401 - the engine must start in a process that already uses numba

    from capturestore import pipeline
    from extractors.models import tiny_model

    lines: list[str] = []
    store = tmp_path / "s"
    result = pipeline.run(tiny_model("gpt-oss"), PROMPTS, target="vllm", dtype="float32", num_tokens=NUM_TOKENS,
                          store=store, release="r", plugins=list(plugins),
                          modules=MODULES if "modules" in plugins else None,
                          out=lines.append, engine_options=engine_options or None, engine_hook=engine_hook)
    return result, Store.open(store), "\n".join(lines)


def target_config(st, result) -> dict:
    return json.loads(st.show(result.runs["actual"])["run"]["config"])


def prompt_ids(st, run_id) -> list[str]:
    return [r["prompt_id"] for r in st.sql(f"SELECT DISTINCT prompt_id FROM captures WHERE run_id = '{run_id}' "
                                           "ORDER BY prompt_id").to_pylist()]


def check_logits_equal_hf_fp32(st, result) -> None:
    for pid in prompt_ids(st, result.runs["actual"]):
        a = np.asarray(st.read_logits(result.runs["actual"], pid), np.float64)
        b = np.asarray(st.read_logits(result.runs["baseline"], pid), np.float64)
        assert a.shape == b.shape == (NUM_TOKENS, 1024)
        err = np.abs(a - b).max()
        assert err < ATOL, f"prompt {pid}: vLLM FP32 logits {err:.2e} from HF FP32"


def check_kv(st, result, *, hybrid: bool) -> None:
    """Layer names are HF's; every position both hold equals HF; which positions each holds, exactly:
    HF all of a full layer and the last W - 1 of a sliding one; the engine every position it fed
    (not the last teacher token: sampled, never fed back), of a sliding layer only its window
    (hybrid: NaN-filled outside, ``SlidingWindowSpec``) or all (no hybrid: nothing freed). A
    position only the engine holds is excluded from the verdict, never judged equal."""
    act, base = result.runs["actual"], result.runs["baseline"]
    for pid in prompt_ids(st, act):
        names = st.sql(f"SELECT layer_names FROM captures WHERE run_id = '{act}' AND prompt_id = '{pid}' "
                       "AND kind = 'kv_k'").to_pylist()[0]["layer_names"]
        assert list(names) == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
        for kind in (0, 1):
            a = np.asarray(st.read_kv(act, pid)[kind], np.float64)  # [layer, kv_head, seq, head_dim]
            b = np.asarray(st.read_kv(base, pid)[kind], np.float64)
            assert a.shape == b.shape
            pos = np.arange(a.shape[2])
            fed = pos < a.shape[2] - 1
            for layer in range(4):
                af = np.isfinite(a[layer]).all(axis=(0, 2))
                bf = np.isfinite(b[layer]).all(axis=(0, 2))
                both = af & bf
                assert np.abs(a[layer][:, both] - b[layer][:, both]).max() < ATOL
                if layer in FULL:
                    assert (bf == (pos >= 0)).all() and (af == fed).all()
                    continue
                assert (bf == (pos >= len(pos) - (W - 1))).all()  # HF keeps the last W - 1 positions
                engine_window = fed & (pos >= len(pos) - 1 - (W - 1))
                assert (af == (engine_window if hybrid else fed)).all(), (pid, layer, np.nonzero(af)[0])


def check_groups(cfg: dict, *, hybrid: bool) -> None:
    groups = [(g["spec_type"], g["sliding_window"], sorted(g["layer_names"])) for g in cfg["kv_cache_groups"]]
    names = [f"model.layers.{i}.attn.attn" for i in range(4)]  # vLLM's own names, stored as HF's
    if hybrid:
        assert sorted(groups, key=str) == sorted([("SlidingWindowSpec", W, [names[0], names[2]]),
                                                  ("FullAttentionSpec", None, [names[1], names[3]])], key=str)
    else:
        assert groups == [("FullAttentionSpec", W, names)]
    assert cfg["hybrid_kv_cache_manager"] is hybrid
    assert cfg["kv_layer_names"] == {n: f"model.layers.{i}.self_attn.attn" for i, n in enumerate(names)}


def check_modules_equal_hf_fp32(st, result) -> None:
    """The GPT-OSS vLLM<->HF name map: every mapped module of the engine equals HF FP32's."""
    row = st.sql(f"SELECT comparator_runs FROM comparisons WHERE comparison_id = '{result.comparison_id}'").to_pylist()
    mods = json.loads(row[0]["comparator_runs"])["modules"]
    judged = {r["module"] for r in st.sql(f"SELECT DISTINCT module FROM module_verdicts WHERE comparison_id = "
                                          f"'{result.comparison_id}'").to_pylist()}
    want = {f"model.layers.{i}{s}" for i in range(4) for s in (
        "", ".input_layernorm", ".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.o_proj",
        ".self_attn", ".post_attention_layernorm", ".mlp")} | {"model.embed_tokens", "model.norm"}
    want |= {m for m in judged if m.endswith(".mlp.router")}  # with routing: the routers, judged as modules too
    assert judged == want
    for pid in prompt_ids(st, mods["actual"]):
        for module in sorted(want):
            for phase in ("prefill", "decode"):
                a = np.asarray(st.read_tensor(mods["actual"], pid, module, phase=phase), np.float64)
                b = np.asarray(st.read_tensor(mods["baseline"], pid, module, phase=phase), np.float64)
                assert a.shape == b.shape, (module, phase, a.shape, b.shape)
                assert np.abs(a - b).max() < ATOL, f"{module} {phase}: {np.abs(a - b).max():.2e}"
