"""extractors/streamed.py: layer-streamed references are the whole-model references, bit for bit.

Every comparison here is exact (max abs difference 0, NaN where NaN): same device, same dtype,
the same transformers modules, only the weights arrive one unit at a time. Checkpoints are real
safetensors files: the cached tiny models, and re-sharded / re-typed copies the tests write.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from extractors.hf import (  # noqa: E402
    capture_hf_run,
    extract_hf_kv_caches_teacher_forced,
    generate_hf_logits_and_kv,
    load_hf_model,
)
from extractors.models import TINY_ARCHS, model_content_hash  # noqa: E402
from extractors.modules import capture_hf_module_run, capture_hf_modules  # noqa: E402
from extractors.streamed import (  # noqa: E402
    GiB,
    Checkpoint,
    CheckpointError,
    MemoryBudgetError,
    StreamedModel,
    prepare_reference,
    run_streamed,
)

PROMPTS = [
    [1] + list(range(40, 61)),  # 22 tokens: longer than the sliding window (16)
    [1, 300, 301, 302, 303],
    [1] + list(range(500, 515)),  # 16 tokens
    [1],
]
TEACHERS = [[700, 701, 702, 703, 704], [710, 711], [720, 721, 722, 723, 724, 725, 726, 727], [730, 731, 732]]


def _same(a, b, what):
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN at different places"
    diff = (a.double() - b.double()).nan_to_num(0).abs().max().item() if a.numel() else 0.0
    assert diff == 0.0, f"{what}: max abs difference {diff}, not 0"


def _same_capture(got, want, what):
    (gl, gkv), (wl, wkv) = got, want
    _same(gl, wl, f"{what} logits")
    assert list(gkv) == list(wkv)
    for n in wkv:
        _same(gkv[n][0], wkv[n][0], f"{what} {n} K")
        _same(gkv[n][1], wkv[n][1], f"{what} {n} V")


def reshard(src, dst, n_shards: int, dtype: str | None = None):
    """Write ``src``'s weights as ``n_shards`` safetensors shards + index (optionally cast to
    ``dtype``, config.json saying so) into ``dst``: a real sharded checkpoint."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    if dtype is not None:
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
        cfg = json.loads((dst / "config.json").read_text())
        cfg["dtype"] = dtype
        (dst / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        part = names[s::n_shards]
        fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(dst / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def whole(tiny_model):
    cache = {}

    def get(path, dtype):
        key = (str(path), dtype)
        if key not in cache:
            cache[key] = load_hf_model(path, dtype)
        return cache[key]

    return get


# ----------------------------------------------------------------------------------------------
# bit identity, every architecture, FP32 and BF16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_logits_and_kv_are_bit_identical_to_the_whole_model(tiny_model, whole, arch, dtype):
    path = tiny_model(arch)
    model = whole(path, dtype)
    sm = StreamedModel(path, dtype)
    # a group of one, a group of several ragged prompts (each its own forward, as capture_hf_run
    # runs them), the same prompts as one left-padded batch, and greedy decoding of the group
    fns = [lambda: extract_hf_kv_caches_teacher_forced(sm.model, [PROMPTS[0]], [TEACHERS[0]], return_logits=True)]
    got_one = run_streamed(sm, fns)
    assert sm.loads == len(sm.units)  # one pass over the weights
    fns = [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(sm.model, [p], [t], return_logits=True)
           for p, t in zip(PROMPTS, TEACHERS)]
    fns.append(lambda: extract_hf_kv_caches_teacher_forced(sm.model, PROMPTS, TEACHERS, return_logits=True))
    got_group = run_streamed(sm, fns)
    assert sm.loads == 2 * len(sm.units)  # five forwards, still one pass over the weights
    got_greedy = run_streamed(sm, [lambda p=p: generate_hf_logits_and_kv(sm.model, [p], 4) for p in PROMPTS])
    assert sm.loads == (2 + 5) * len(sm.units)  # greedy: prefill + 4 decode forwards = 5 passes
    # no budget given: every unit but each pass's first (the embedding) was read in the background
    # while the unit before it computed: what is compared below is the prefetched path
    assert sm.prefetched == sm.loads - (2 + 5)

    _same_capture(got_one[0], extract_hf_kv_caches_teacher_forced(model, [PROMPTS[0]], [TEACHERS[0]],
                                                                   return_logits=True), "group of 1")
    for i, (p, t) in enumerate(zip(PROMPTS, TEACHERS)):
        _same_capture(got_group[i], extract_hf_kv_caches_teacher_forced(model, [p], [t], return_logits=True),
                      f"prompt {i} of a group")
        _same_capture(got_greedy[i], generate_hf_logits_and_kv(model, [p], 4), f"greedy prompt {i}")
    _same_capture(got_group[-1], extract_hf_kv_caches_teacher_forced(model, PROMPTS, TEACHERS, return_logits=True),
                  "left-padded batch")
    # the parameters went back to meta: nothing of the model stays in memory between groups
    assert {p.device.type for p in sm.model.parameters()} == {"meta"}


def test_streamed_weights_require_grad_as_loaded_ones_so_bf16_lm_heads_round_alike(tmp_path):
    """torch 2.13's CPU BF16 linear runs another kernel for a weight that requires no grad
    (measured on an AVX-512F Xeon: the LM head's logits differ by up to 1/32, 6.8x slower); the
    streamed weights were installed frozen, so at an LM head of 256 x 32,000 the streamed BF16
    reference differed from the whole model's (which from_pretrained leaves requiring grad). Both
    halves are asserted: the flag as loaded (on any CPU), and the logits bit for bit (where the two
    kernels differ, this shape shows it: the teacher-forced rows are a strided slice of a batch
    of 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path / "m"))
    path = tmp_path / "m"
    model = load_hf_model(path, "bfloat16")
    sm = StreamedModel(path, "bfloat16")
    prompt, teacher = list(range(3, 40)), list(range(900, 908))
    flags = {}

    def forward():
        flags.update({n: p.requires_grad for n, p in sm.model.named_parameters()})
        return extract_hf_kv_caches_teacher_forced(sm.model, [prompt], [teacher], return_logits=True)

    got = run_streamed(sm, [forward])[0]
    _same_capture(got, extract_hf_kv_caches_teacher_forced(model, [prompt], [teacher], return_logits=True),
                  "BF16 LM head 256 x 32000")
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()} and all(flags.values())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_kernel_rounding_reference_is_bit_identical_to_the_whole_model(tiny_model, whole, arch):
    """The BF16 expected reference of a truncating vLLM-CPU (extractors.kernel_rounding) streamed
    layer by layer: logits and KV equal the whole-model one bit for bit, the emulation on in both
    (it patches the modeling module, so the streamed skeleton's layers are covered), and it does
    take effect there: the truncated reference differs from torch's rounding."""
    from extractors.kernel_rounding import check_kernel_rounding, kernel_rounding, kernel_rounding_unsupported

    path = tiny_model(arch)
    model = whole(path, "bfloat16")
    why = kernel_rounding_unsupported(path)
    if arch == "gpt-oss":  # attention sinks: not emulated, refused in one line from the config alone
        assert why and "GptOssForCausalLM" in why
        with pytest.raises(ValueError, match="GptOssForCausalLM"):
            check_kernel_rounding(model, "toward_zero")
        return
    assert why is None, why
    sm = StreamedModel(path, "bfloat16")

    def forwards(m):
        return [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(m, [p], [t], return_logits=True)
                for p, t in zip(PROMPTS, TEACHERS)] + [lambda: generate_hf_logits_and_kv(m, [PROMPTS[1]], 3)]

    with kernel_rounding(sm.model, "toward_zero"):
        got = run_streamed(sm, forwards(sm.model))
    with kernel_rounding(model, "toward_zero"):
        want = [f() for f in forwards(model)]
    nearest = [f() for f in forwards(model)]
    first = next(iter(want[0][1]))
    for i, (g, w, n) in enumerate(zip(got, want, nearest)):
        _same_capture(g, w, f"{arch} toward_zero forward {i}")
    # K of the first layer is the rotary output: rounded otherwise on a good share of its elements
    k_t, k_n = want[0][1][first][0].float(), nearest[0][1][first][0].float()
    assert float((k_t != k_n).float().mean()) > 0.2
    assert float((want[0][0] - nearest[0][0]).abs().max()) > 0  # the logits move too


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_module_tensors_are_bit_identical_to_the_whole_model(tiny_model, whole, arch):
    path = tiny_model(arch)
    for dtype in ("float32", "bfloat16"):
        model = whole(path, dtype)
        sm = StreamedModel(path, dtype)

        def collect(m, p, t):
            got = {}
            logits, order = capture_hf_modules(m, p, t, lambda mod, ph, st, x: got.setdefault((mod, ph, st), x),
                                               inputs=True)
            return logits, order, got

        streamed = run_streamed(sm, [lambda p=p, t=t: collect(sm.model, p, t) for p, t in zip(PROMPTS, TEACHERS)])
        for i, (p, t) in enumerate(zip(PROMPTS, TEACHERS)):
            logits, order, got = collect(model, p, t)
            s_logits, s_order, s_got = streamed[i]
            assert s_order == order
            _same(s_logits, logits, f"{arch} {dtype} prompt {i} logits")
            assert sorted(s_got) == sorted(got) and len(got) > 10 * len(t)
            for k in got:
                _same(s_got[k], got[k], f"{arch} {dtype} prompt {i} {k}")


def test_sharded_bf16_checkpoint_streams_bit_identically_in_fp32_and_bf16(tiny_model, whole, tmp_path):
    # a BF16 checkpoint in 3 shards: FP32 is an exact widening, BF16 keeps the file's bytes
    # (at the file's page offset, as the whole-model load maps them)
    path = reshard(tiny_model("llama-gqa"), tmp_path / "bf16-sharded", 3, dtype="bfloat16")
    ck = Checkpoint(path)
    assert len({e.file for e in ck.entries.values()}) == 3
    for dtype in ("float32", "bfloat16"):
        sm = StreamedModel(path, dtype)
        got = run_streamed(sm, [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(sm.model, [p], [t],
                                                                                     return_logits=True)
                                for p, t in zip(PROMPTS, TEACHERS)]
                           + [lambda: generate_hf_logits_and_kv(sm.model, [PROMPTS[0]], 3)])
        assert sm.prefetched == sm.loads - 4  # 4 passes (the greedy prompt's); FP32: the numpy widening
        model = whole(path, dtype)
        for i, (p, t) in enumerate(zip(PROMPTS, TEACHERS)):
            _same_capture(got[i], extract_hf_kv_caches_teacher_forced(model, [p], [t], return_logits=True),
                          f"{dtype} prompt {i}")
        _same_capture(got[-1], generate_hf_logits_and_kv(model, [PROMPTS[0]], 3), f"{dtype} greedy")


@pytest.mark.parametrize("chunk", [None, 1000])  # 1000 bytes: many chunks, none a whole tensor
def test_a_background_read_casts_bit_for_bit_as_torch_does(tmp_path, monkeypatch, chunk):
    # the prefetch's casts (numpy's BF16 -> FP32 widening; serial copy_ pieces for the others)
    # against tensor.to(dtype), on every kind of value: NaN payloads, infinities, signed zeros,
    # subnormals, the extremes; FP32 -> BF16 halfway cases (round to nearest even)
    from safetensors.torch import save_file

    bits = torch.tensor([0x7FC0, 0x7FA1, 0xFFC3, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F,
                         0x3F80, 0x4049, 0xC2F7], dtype=torch.int32).to(torch.int16)
    rng = np.random.default_rng(0)
    bf16 = torch.cat([bits.view(torch.bfloat16), torch.from_numpy(rng.standard_normal(100_000).astype(np.float32))
                      .to(torch.bfloat16)])
    f32 = torch.cat([bf16.float(), torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), 3e38, 1e-40]),
                     torch.from_numpy(rng.standard_normal(100_000).astype(np.float32))])
    save_file({"b": bf16, "f": f32, "h": f32.clamp(-6e4, 6e4).half()}, str(tmp_path / "model.safetensors"))
    if chunk:
        monkeypatch.setattr("extractors.streamed._READ_CHUNK", chunk)
    ck = Checkpoint(tmp_path)
    for name, src in (("b", bf16), ("f", f32)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = src.to(dtype)
            for background in (False, True):
                got = ck.read(name, dtype, background=background)
                assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
                    (name, dtype, background)
            # a device's read (staged through two host buffers, each chunk copied as read), run
            # here on the CPU: the same chunks, offsets and casts
            got = ck._read_staged(ck.entries[name], name, src.dtype, dtype, "cpu")
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, dtype)
    want = f32.clamp(-6e4, 6e4).half().float()
    assert torch.equal(ck.read("h", torch.float32, background=True).view(torch.int32), want.view(torch.int32))


def test_a_staged_read_waits_for_each_buffers_last_copy_before_refilling_it(tmp_path, monkeypatch):
    # the order a device's read keeps, with events that log (on the CPU a copy is done when it
    # returns, so only the order can be checked here; the H200 run checked the bits): before a
    # buffer is filled, the event of its last copy is waited for; after its copy, recorded; and
    # every event is waited for before the read returns
    from safetensors.torch import save_file

    import extractors.streamed as streamed

    want = torch.arange(10_000, dtype=torch.float32)
    save_file({"w": want}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(streamed, "_READ_CHUNK", 4096)  # 1,024 values a chunk: 10 chunks
    log = []

    class Event:
        def __init__(self, i):
            self.i = i

        def record(self):
            log.append(("record", self.i))

        def synchronize(self):
            log.append(("wait", self.i))

    stages = [(torch.empty(4096, dtype=torch.uint8), Event(i)) for i in range(2)]
    fill = streamed._fill

    def logged_fill(f, view, need, e, name):
        at = np.frombuffer(view, dtype=np.uint8).ctypes.data
        log.append(("fill", [b.data_ptr() for b, _ in stages].index(at)))
        fill(f, view, need, e, name)

    monkeypatch.setattr(streamed, "_fill", logged_fill)
    ck = Checkpoint(tmp_path)
    monkeypatch.setattr(ck, "_stages", lambda device: stages)
    got = ck.read("w", torch.float32, "cpu", staged=True)
    assert torch.equal(got, want)
    chunks = [x for i in range(10) for x in (("wait", i % 2), ("fill", i % 2), ("record", i % 2))]
    assert log == chunks + [("wait", 0), ("wait", 1)]
    # a device's read asked not to stage still returns on that device (meta stands in for one)
    monkeypatch.setattr(streamed, "_fill", fill)
    assert ck.read("w", torch.float32, "meta", staged=False).device.type == "meta"
    assert ck.read("w", torch.bfloat16, "meta", staged=False).device.type == "meta"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_reads_on_several_threads_stream_bit_identically(tiny_model, whole, dtype):
    # the CPU's reads on 3 threads (a machine of 12+ CPUs has them; 2-7 CPUs read on one): the pool
    # shared under its lock, each cast on its own thread; every unit's weights and a streamed
    # capture are the one-thread path's / the whole model's (FP32: the whole model's alignment)
    path = tiny_model("llama-gqa")
    assert StreamedModel(path, dtype).readers == max(1, min(4, len(os.sched_getaffinity(0)) // 4))
    sm = StreamedModel(path, dtype)
    sm.readers = 3
    fns = [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(sm.model, [p], [t], return_logits=True)
           for p, t in zip(PROMPTS, TEACHERS)]
    fns.append(lambda: generate_hf_logits_and_kv(sm.model, [PROMPTS[0]], 3))
    got = run_streamed(sm, fns)
    assert sm._readers_pool is not None and sm.prefetched > 0
    for i, (p, t) in enumerate(zip(PROMPTS, TEACHERS)):
        _same_capture(got[i], extract_hf_kv_caches_teacher_forced(whole(path, dtype), [p], [t], return_logits=True),
                      f"prompt {i}, 3 reading threads")
    _same_capture(got[-1], generate_hf_logits_and_kv(whole(path, dtype), [PROMPTS[0]], 3), "greedy, 3 reading threads")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_reads_on_several_threads_give_every_unit_the_same_weights(tiny_model, whole, monkeypatch, dtype):
    # a device's reads (staged through pinned buffers, a unit's tensors on up to READERS threads),
    # run on the CPU: every weight the CPU path reads, bit for bit, in the unit's order; then a
    # streamed capture through them is the whole model's
    monkeypatch.setattr("extractors.streamed._READ_CHUNK", 1000)  # many chunks, both buffers of each thread
    path = tiny_model("llama-gqa")
    plain, staged = StreamedModel(path, dtype), StreamedModel(path, dtype)
    plain.readers = 1  # the CPU path as on 2-7 CPUs
    staged.staged, staged.readers = True, 3
    names = {id(m): n for n, m in plain.model.named_modules()} | {id(m): n for n, m in staged.model.named_modules()}
    for u, v in zip(plain.units, staged.units):
        want, got = plain.read_unit(u), staged.read_unit(v)
        assert [(names[id(m)], a, n) for m, a, _, n in got] == [(names[id(m)], a, n) for m, a, _, n in want]
        for (_, a, t, _), (_, _, w, _) in zip(got, want):
            assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t.view(-1).view(torch.uint8),
                                                                             w.view(-1).view(torch.uint8)), a
    assert staged._readers_pool is not None and plain._readers_pool is None
    if dtype == "bfloat16":  # a cast from the FP32 checkpoint: fresh memory on both paths, as aligned
        fns = [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(staged.model, [p], [t], return_logits=True)
               for p, t in zip(PROMPTS, TEACHERS)]
        got = run_streamed(staged, fns)
        for i, (p, t) in enumerate(zip(PROMPTS, TEACHERS)):
            _same_capture(got[i], extract_hf_kv_caches_teacher_forced(whole(path, dtype), [p], [t],
                                                                       return_logits=True), f"prompt {i}, staged")


def test_random_groups_and_lengths_stream_bit_identically(tiny_model, whole):
    """Property: any group of prompts (sizes 1-5, lengths 1-30, teacher tokens 0-8) streamed in one
    pass gives each prompt exactly its whole-model capture."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    rows = st.lists(st.tuples(st.integers(1, 30), st.integers(0, 8)), min_size=1, max_size=5)

    @settings(max_examples=10, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(["llama-gqa", "gemma3-sliding", "mistral-sliding"]), st.sampled_from(["float32", "bfloat16"]),
           rows, st.integers(0, 2**16))
    def check(arch, dtype, shape, seed):
        path = tiny_model(arch)
        rng = np.random.default_rng(seed)
        prompts = [[1] + rng.integers(4, 1024, n - 1).tolist() for n, _ in shape]
        teachers = [rng.integers(4, 1024, t).tolist() for _, t in shape]
        sm = StreamedModel(path, dtype)
        got = run_streamed(sm, [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(sm.model, [p], [t],
                                                                                     return_logits=True)
                                for p, t in zip(prompts, teachers)])
        assert sm.loads == len(sm.units)
        model = whole(path, dtype)
        for i, (p, t) in enumerate(zip(prompts, teachers)):
            _same_capture(got[i], extract_hf_kv_caches_teacher_forced(model, [p], [t], return_logits=True), str(i))

    check()


# ----------------------------------------------------------------------------------------------
# into the store: the same runs, reused alike


def _cfg(store, rid):
    return json.loads(store.sql(f"SELECT config FROM runs WHERE run_id = '{rid}'").to_pylist()[0]["config"])


def test_streamed_runs_store_what_whole_model_runs_store_and_are_reused_alike(tiny_model, tmp_path):
    from capturestore import Store, prompt_id
    from capturestore.analysis import find_reference_run

    path = tiny_model("gemma3-sliding")
    st = Store.open(tmp_path / "store")
    pids = [prompt_id(p) for p in PROMPTS]
    runs = {}
    for mode, stream in (("whole", False), ("streamed", True)):
        info = {}
        runs[mode, "greedy"] = capture_hf_run(st, path, PROMPTS, num_tokens=4, stream=stream, info=info)
        assert info["path"] == mode
        teacher = [st.read_tokens(runs[mode, "greedy"], pid)[len(p):].tolist() for pid, p in zip(pids, PROMPTS)]
        runs[mode, "tf"] = capture_hf_run(st, path, PROMPTS, teacher_tokens=teacher, dtype="bfloat16", stream=stream)
        runs[mode, "mod"] = capture_hf_module_run(st, path, PROMPTS, TEACHERS, ["model.layers.*.mlp", "model.norm"],
                                                  stream=stream, info=info)
        assert info["path"] == mode and info["peak"].rss > 0
        if stream:
            assert info["weight_passes"] == max(len(t) for t in TEACHERS)  # prefill + decode steps
    for kind in ("greedy", "tf", "mod"):
        a, b = runs["whole", kind], runs["streamed", kind]
        ca, cb = _cfg(st, a), _cfg(st, b)
        assert (ca["reference_path"], cb["reference_path"]) == ("whole", "streamed")
        assert cb["reference_device"] == "cpu" and cb["device_name"]
        for k in set(ca) - {"reference_path", "reference_groups", "reference_memory_budget"}:
            assert ca[k] == cb[k], k
        for pid in pids:
            assert st.read_tokens(a, pid).tolist() == st.read_tokens(b, pid).tolist()
            _same(st.read_logits(b, pid, as_torch=True), st.read_logits(a, pid, as_torch=True), f"{kind} logits")
            if kind != "mod":
                for x, y in zip(st.read_kv(b, pid, as_torch=True), st.read_kv(a, pid, as_torch=True)):
                    _same(x, y, f"{kind} KV")
        if kind == "mod":
            for pid in pids:
                for module in ca["modules"]:
                    for phase in ("prefill", "decode"):
                        x = st.read_tensor(a, pid, module, phase=phase)
                        y = st.read_tensor(b, pid, module, phase=phase)
                        assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True), (module, phase)
    # reuse keys are the pipeline's: the newest run of either path is found
    want = {"capture": "greedy", "num_tokens": 4, "attn_implementation": "eager", "model_given": False}
    found = find_reference_run(st, model_hash=model_content_hash(path), dtype="float32", prompt_ids=pids, config=want)
    assert found == runs["streamed", "greedy"]


def test_a_budget_below_the_weights_streams_in_groups_and_stays_identical(tiny_model, tmp_path):
    from capturestore import Store, prompt_id

    path = tiny_model("llama-gqa")
    sm = StreamedModel(path, "float32")
    weights = sm.weights_nbytes()
    big = max(sm.unit_nbytes(u) for u in sm.units)
    st = Store.open(tmp_path / "store")
    # room for the largest unit and about one prompt's activations: several groups
    plan, _ = prepare_reference(path, "float32", "cpu", big + 200_000, None, [(27, 6), (7, 3), (24, 9), (4, 4)])
    assert plan.path == "streamed" and len(plan.groups) > 1 and sum(map(len, plan.groups)) == 4
    info = {}
    rid = capture_hf_run(st, path, PROMPTS, teacher_tokens=TEACHERS, memory=big + 200_000, info=info)
    assert info["path"] == "streamed" and info["groups"] == [len(g) for g in plan.groups]
    assert info["weight_passes"] == len(plan.groups)
    ref = capture_hf_run(st, path, PROMPTS, teacher_tokens=TEACHERS, memory=weights * 4)
    assert _cfg(st, ref)["reference_path"] == "whole"
    for p in PROMPTS:
        pid = prompt_id(p)
        _same(st.read_logits(rid, pid, as_torch=True), st.read_logits(ref, pid, as_torch=True), "logits")


def test_a_budget_smaller_than_one_layer_is_refused_with_the_size_a_layer_needs(tiny_model, tmp_path):
    from capturestore import Store

    path = tiny_model("llama-gqa")
    sm = StreamedModel(path, "float32")
    sizes = {u.name: sm.unit_nbytes(u) for u in sm.units}
    name, big = max(sizes.items(), key=lambda x: x[1])
    # q, o 128x128; k, v 64x128; gate, up, down 128x256; two norms of 128: FP32
    assert name == "model.layers.0" and big == 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 256 + 2 * 128)
    st = Store.open(tmp_path / "store")
    with pytest.raises(MemoryBudgetError, match=rf"smaller than one layer of the model: {name} needs "
                                                rf"0\.56 MiB \({big} bytes\)"):
        capture_hf_run(st, path, PROMPTS, num_tokens=2, memory=big - 1)
    assert st.runs().num_rows == 0


def test_prefetch_is_planned_where_two_neighbouring_units_fit_and_refused_below_one():
    from extractors.streamed import plan_reference

    units = [("embed", 10), ("l0", 40), ("l1", 40), ("head", 70)]
    # budget 100: the head (70) + both prompts (5 + 5) in one group; embed+l0 60, l0+l1 90 fit,
    # l1+head 120 does not: that change loads serially, and the plan says which
    plan = plan_reference(weights=160, units=units, budget=100, per_prompt=[5, 5])
    assert plan.groups == [[0, 1]] and plan.prefetch == (0, 1) and plan.no_prefetch == (("l1", "head", 120),)
    assert "prefetch on 2 of 3 unit changes, not on l1 -> head" in plan.describe()
    # budget 75: room 5 beside the head, one prompt a group; only embed+l0 (55) fits
    plan = plan_reference(weights=160, units=units, budget=75, per_prompt=[5, 5])
    assert plan.groups == [[0], [1]] and plan.prefetch == (0,) and [x[:2] for x in plan.no_prefetch] == [
        ("l0", "l1"), ("l1", "head")]
    assert "prefetch on 1 of 3 unit changes, not on l1 -> head and 1 more (l1 + head = 0.00 MiB" in plan.describe()
    # no pair fits: no prefetch at all, said so; the budget check itself is unchanged
    plan = plan_reference(weights=120, units=[("a", 40), ("b", 40), ("c", 40)], budget=60, per_prompt=[5])
    assert plan.prefetch == () and plan.describe().count("no prefetch: two neighbouring units do not fit") == 1
    # four prompts of 20 beside two layers of 30 in 100: packed beside one layer (room 70) they
    # make groups of 3 + 1 (activations 60: no pair fits); beside a pair (room 40) as many groups
    # of 2 + 2: those are taken, and every change is read ahead
    plan = plan_reference(weights=60, units=[("a", 30), ("b", 30)], budget=100, per_prompt=[20] * 4,
                          stream=True)
    assert plan.groups == [[0, 1], [2, 3]] and plan.prefetch == (0,)
    plan = plan_reference(weights=60, units=[("a", 30), ("b", 30)], budget=100, per_prompt=[20] * 3,
                          stream=True)
    assert plan.groups == [[0, 1, 2]] and plan.prefetch == ()  # 2 + 1 would be one more pass
    plan = plan_reference(weights=160, units=units, budget=10_000, per_prompt=[5, 5], stream=True)
    assert plan.prefetch == (0, 1, 2) and "prefetch: each next unit read while one computes (3 of 3" in plan.describe()
    plan = plan_reference(weights=160, units=units, budget=10_000, per_prompt=[5, 5], stream=True, prefetch=False)
    assert plan.prefetch == () and "no prefetch (turned off)" in plan.describe()
    with pytest.raises(MemoryBudgetError, match="smaller than one layer of the model: head needs"):
        plan_reference(weights=160, units=units, budget=69, per_prompt=[5, 5])


def test_a_unit_is_read_ahead_only_beside_the_one_unit_the_plan_lets_it_share_memory_with(tiny_model):
    """What is resident when each unit's read starts: with the plan's prefetch, the unit computing
    (and only where that pair fits); without it, nothing (the last unit freed first)."""
    path = tiny_model("llama-gqa")
    for allowed in (frozenset(), frozenset({1, 2})):
        sm = StreamedModel(path, "float32")
        sm.prefetch = allowed
        seen, lock, read_unit = [], threading.Lock(), sm.read_unit

        looked = [threading.Event() for _ in sm.units]

        def spy(u, background=False, read_unit=read_unit, sm=sm, seen=seen, looked=looked):
            resident = [i for i, x in enumerate(sm.units)
                        if any(mod._parameters[a].device.type != "meta" for mod, a in x.params.values())]
            with lock:
                seen.append((sm.units.index(u), background, resident))
            looked[sm.units.index(u)].set()
            return read_unit(u, background)

        def spy_free(u, free=sm.free, sm=sm, allowed=allowed, looked=looked):
            i = sm.units.index(u)
            if i in allowed:  # the read-ahead of unit i + 1 has looked before unit i goes (a loaded
                assert looked[i + 1].wait(30)  # machine may start its thread after unit i computed)
            free(u)

        sm.read_unit, sm.free = spy, spy_free
        got = run_streamed(sm, [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(sm.model, [p], [t],
                                                                                     return_logits=True)
                                for p, t in zip(PROMPTS[:2], TEACHERS[:2])])
        n = len(sm.units)
        want = [(i, i - 1 in allowed, [i - 1] if i - 1 in allowed else []) for i in range(n)]
        assert seen == want and sm.prefetched == len(allowed)
        if not allowed:
            first = got
        else:
            for a, b in zip(got, first):
                _same_capture(a, b, "prefetch on vs off")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_freed_layer_s_memory_is_read_into_by_the_next_and_nothing_more_is_kept(tiny_model, whole, dtype):
    """Fresh pages cost a fault each: loaded serially, layer i + 1 is read into layer i's freed
    memory, same results bit for bit; a read leaves the pool empty (what the unit cannot use is
    released first) and a run leaves nothing behind, prefetched too (where a layer's memory goes
    then depends on when the read ahead and the free meet: not asserted)."""
    path = tiny_model("llama-gqa")
    model = whole(path, dtype)
    for allowed in (frozenset(), None):
        sm = StreamedModel(path, dtype)
        if allowed is not None:
            sm.prefetch = allowed
        ptrs, left, install, read_unit = {}, [], sm.install, sm.read_unit

        def spy_install(tensors, sm=sm, ptrs=ptrs, install=install):
            for mod, attr, t, _ in tensors:
                ptrs.setdefault(next(i for i, u in enumerate(sm.units) if any(m is mod for m, _ in u.params.values())),
                                set()).add(t.untyped_storage().data_ptr())
            install(tensors)

        def spy_read(u, background=False, sm=sm, left=left, read_unit=read_unit):
            out = read_unit(u, background)
            if not background:  # a read ahead runs beside the compute thread, which may free a unit
                left.append(sum(len(v) for v in sm.pool.free.values()))  # into the pool meanwhile
            return out

        sm.install, sm.read_unit = spy_install, spy_read
        got = run_streamed(sm, [lambda p=p, t=t: extract_hf_kv_caches_teacher_forced(sm.model, [p], [t],
                                                                                     return_logits=True)
                                for p, t in zip(PROMPTS[:2], TEACHERS[:2])])
        layers = [i for i, u in enumerate(sm.units) if u.name.startswith("model.layers.")]
        if allowed is not None:
            for i in layers[1:]:
                assert ptrs[i] == ptrs[i - 1], i  # every weight in memory of the layer before
            assert len(ptrs[layers[0]]) == len(sm.units[layers[0]].params)  # (distinct buffers, one a weight)
        assert set(left) <= {0} and not sm.pool.free and not sm.pool.lent and not sm._lent
        assert left, "no serial read was checked"
        for i, (p, t) in enumerate(zip(PROMPTS[:2], TEACHERS[:2])):
            _same_capture(got[i], extract_hf_kv_caches_teacher_forced(model, [p], [t], return_logits=True), str(i))


def test_a_failing_forward_stops_the_group_and_is_raised(tiny_model):
    sm = StreamedModel(tiny_model("llama-mha"), "float32")
    before = set(threading.enumerate())  # a thread of an earlier test ending meanwhile is no leak

    def bad():
        extract_hf_kv_caches_teacher_forced(sm.model, [[1, 2, 3]], [[4]], return_logits=True)
        raise RuntimeError("boom in a worker")

    with pytest.raises(RuntimeError, match="boom in a worker"):
        run_streamed(sm, [lambda: generate_hf_logits_and_kv(sm.model, [[1, 2]], 5), bad])
    assert not set(threading.enumerate()) - before, "run_streamed left a thread running"
    assert {p.device.type for p in sm.model.parameters()} == {"meta"}
    with pytest.raises(RuntimeError, match="ran outside run_streamed"):
        extract_hf_kv_caches_teacher_forced(sm.model, [[1, 2, 3]], [[4]])


def test_cuda_device_is_refused_where_torch_sees_none():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: benchmarks/cuda_reference_check.py covers it")
    from extractors.hf import _device_str

    assert _device_str("cpu") == "cpu"
    for bad, match in (("cuda", "sees no CUDA device"), ("cuda:1", "sees no CUDA device"), ("tpu", "give cpu or cuda")):
        with pytest.raises(ValueError, match=match):
            _device_str(bad)


# ----------------------------------------------------------------------------------------------
# checkpoints whose shards, index and model disagree: refused naming file and tensor, no run


def _write_index(path, weight_map):
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _edit_shard(file, edit):
    from safetensors.torch import load_file, save_file

    t = load_file(str(file))
    edit(t)
    save_file(t, str(file), metadata={"format": "pt"})


def _break(kind, path):
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard1 = path / "model-00001-of-00003.safetensors"
    name = sorted(k for k, v in idx.items() if v == shard1.name)[0]
    if kind == "missing tensor":  # the index places it in shard 1, shard 1 lacks it
        _edit_shard(shard1, lambda t: t.pop(name))
        return shard1, name
    if kind == "tensor the index does not list":
        _edit_shard(shard1, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
        return shard1, "model.layers.0.extra.weight"
    if kind == "unexpected tensor":  # listed in the index and present, but not a model parameter
        _edit_shard(shard1, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2)))
        _write_index(path, {**idx, "model.layers.9.mlp.up_proj.weight": shard1.name})
        return shard1, "model.layers.9.mlp.up_proj.weight"
    if kind == "model lacks tensor":  # neither index nor shards hold a parameter of the model
        w = {k: v for k, v in idx.items() if k != "model.norm.weight"}
        _edit_shard(path / idx["model.norm.weight"], lambda t: t.pop("model.norm.weight"))
        _write_index(path, w)
        return path, "model.norm.weight"
    if kind == "shape":
        _edit_shard(shard1, lambda t: t.__setitem__(name, t[name][..., :-1].contiguous() if t[name].ndim == 2
                                                      else t[name][:-1].contiguous()))
        return shard1, name
    if kind == "dtype":
        _edit_shard(shard1, lambda t: t.__setitem__(name, t[name].to(torch.float16)))
        return shard1, name
    if kind == "missing shard":
        shard1.unlink()
        return path / "model.safetensors.index.json", name
    if kind == "truncated shard":
        data = shard1.read_bytes()
        shard1.write_bytes(data[:-100])
        (n,) = struct.unpack("<Q", data[:8])
        last = max(((k, v["data_offsets"][1]) for k, v in json.loads(data[8:8 + n]).items()
                    if k != "__metadata__"), key=lambda x: x[1])[0]
        return shard1, last
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing tensor", "tensor the index does not list", "unexpected tensor",
                                  "model lacks tensor", "shape", "dtype", "missing shard", "truncated shard"])
def test_a_checkpoint_whose_shards_or_index_disagree_is_refused_before_any_run(tiny_model, tmp_path, kind):
    from capturestore import Store

    path = reshard(tiny_model("llama-mha"), tmp_path / "ck", 3)
    where, name = _break(kind, path)
    st = Store.open(tmp_path / "store")
    with pytest.raises(CheckpointError) as e:
        capture_hf_run(st, path, PROMPTS[:1], num_tokens=2, stream=True)
    msg = str(e.value)
    assert str(where) in msg and (name in msg or kind == "missing shard"), msg
    assert "\n" not in msg
    assert st.runs().num_rows == 0
    with pytest.raises(CheckpointError):  # the whole-model path checks the checkpoint too
        capture_hf_run(st, path, PROMPTS[:1], num_tokens=2, stream=False)
    assert st.runs().num_rows == 0


def test_model_content_hash_is_unchanged_by_sharding_and_reads_no_whole_tensor(tiny_model, tmp_path):
    # the hash reads tensors in chunks now; it must equal the safetensors-loaded definition
    import hashlib

    from safetensors.torch import load_file

    src = tiny_model("llama-gqa")
    path = reshard(src, tmp_path / "ck", 3)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("transformers_version", None)
    h = hashlib.sha256(b"config\0" + json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode())
    t = load_file(str(src / "model.safetensors"))
    for name in sorted(t):
        d = hashlib.sha256(f"{name}\0{t[name].dtype}\0{tuple(t[name].shape)}\0".encode())
        d.update(t[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        h.update(d.digest())
    assert model_content_hash(src) == model_content_hash(path) == h.hexdigest()


def test_plan_takes_the_whole_path_when_the_weights_fit(tiny_model):
    path = tiny_model("mistral-sliding")
    plan, sm = prepare_reference(path, "bfloat16", "cpu", 1 * GiB, None, [(10, 3)] * 3)
    assert plan.path == "whole" and plan.groups == [[0, 1, 2]]
    assert plan.weights == sm.weights_nbytes() == sum(p.numel() * 2 for p in sm.model.parameters())
    assert "whole" in plan.describe() and "3 prompt" in plan.describe()


def test_tensors_from_pretrained_skips_silently_are_accepted_not_refused(tiny_model, whole, tmp_path):
    # old Llama checkpoints carry rotary_emb.inv_freq per layer: transformers ignores them, so do we
    path = reshard(tiny_model("llama-mha"), tmp_path / "ck", 2)
    shard = path / "model-00001-of-00002.safetensors"
    _edit_shard(shard, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(16)))
    idx = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    _write_index(path, {**idx, "model.layers.0.self_attn.rotary_emb.inv_freq": shard.name})
    sm = StreamedModel(path, "float32")
    got = run_streamed(sm, [lambda: extract_hf_kv_caches_teacher_forced(sm.model, [PROMPTS[0]], [TEACHERS[0]],
                                                                         return_logits=True)])
    _same_capture(got[0], extract_hf_kv_caches_teacher_forced(whole(path, "float32"), [PROMPTS[0]], [TEACHERS[0]],
                                                              return_logits=True), "with inv_freq")
