"""capture_hf_module_run writes a whole model's prompt on a background thread while the next
prompt's forwards run: at most one prompt queued, and every failure (the writer's or the
forwards') surfaces in the caller and aborts the run, leaving the store as it was."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import extractors.modules as modules  # noqa: E402
from capturestore import Store  # noqa: E402
from capturestore.layout import ARRAYS_DIR  # noqa: E402
from extractors.hf import load_hf_model  # noqa: E402

MODULES = ["model.layers.0", "model.layers.1.mlp", "lm_head"]


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama-gqa")
    return path, load_hf_model(path, "float32")


@pytest.fixture(autouse=True)
def background_on(monkeypatch):
    """These tests are about the writer thread: on, whatever this machine's CPUs say."""
    monkeypatch.setattr(modules, "BACKGROUND_WRITER", True)


def test_the_writer_thread_is_used_only_where_the_forwards_leave_a_cpu(llama, monkeypatch):
    """Auto (BACKGROUND_WRITER None): a CPU model whose torch threads take every CPU writes in
    turn (measured: no gain on 2 cores); one thread fewer than the CPUs, or the switch, writes on
    the thread."""
    import torch

    _, model = llama
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(modules, "BACKGROUND_WRITER", None)
    # torch's thread count as a value, not set: an in-process vLLM engine earlier in the session
    # turns torch.set_num_threads into a no-op after binding its threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus)
    assert modules.background_writes(model) is False
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus - 1)
    assert modules.background_writes(model) is True
    for switch in (True, False):
        monkeypatch.setattr(modules, "BACKGROUND_WRITER", switch)
        assert modules.background_writes(model) is switch


def _prompts(n):
    rng = np.random.default_rng(n)
    return ([rng.integers(4, 200, size=6).tolist() for _ in range(n)],
            [rng.integers(4, 200, size=4).tolist() for _ in range(n)])


def _store_with_one_run(tmp_path, llama):
    path, model = llama
    store = Store.open(tmp_path / "s")
    prompts, conts = _prompts(1)
    kept = modules.capture_hf_module_run(store, path, prompts, conts, MODULES, model=model)
    return store, kept


def _as_it_was(store, kept):
    assert store.committed_ids() == {kept} and store.pending() == []
    assert sorted(p.name for p in (store.root / ARRAYS_DIR).iterdir() if p.is_dir()) == [kept]
    assert store.verify().ok


def test_a_prompt_is_written_while_the_next_ones_forwards_run_one_prompt_queued_at_most(tmp_path, llama, monkeypatch):
    path, model = llama
    store = Store.open(tmp_path / "s")
    events, lock = [], threading.Lock()
    real_write, real_capture = modules.write_prompt_modules, modules.capture_hf_modules
    began = {10 + i: threading.Event() for i in range(4)}

    def write(run, prompt, *a):
        with lock:
            events.append(("write", prompt[0], threading.current_thread().name))
        if prompt[0] < 13:  # a slow disk: the next prompt's forwards start meanwhile (a serial loop
            began[prompt[0] + 1].wait(30)  # never starts them: it waits out the 30 s and fails below)
        out = real_write(run, prompt, *a)
        with lock:
            events.append(("written", prompt[0], None))
        return out

    def capture(model, prompt, *a, **kw):
        with lock:
            events.append(("forwards", prompt[0], None))
        began[prompt[0]].set()
        return real_capture(model, prompt, *a, **kw)

    monkeypatch.setattr(modules, "write_prompt_modules", write)
    monkeypatch.setattr(modules, "capture_hf_modules", capture)
    prompts, conts = _prompts(4)
    prompts = [[10 + i, *p[1:]] for i, p in enumerate(prompts)]  # prompt i starts with token 10 + i
    run = modules.capture_hf_module_run(store, path, prompts, conts, MODULES, model=model)
    assert {e[2] for e in events if e[0] == "write"} == {"capturestore-module-writer_0"}
    at = {(e[0], e[1]): n for n, e in enumerate(events)}
    for i in range(10, 13):
        assert at[("forwards", i + 1)] < at[("written", i)]  # overlapped
    for i in range(10, 12):
        assert at[("written", i)] < at[("forwards", i + 2)]  # never two prompts queued
    assert len(store.prompts(run)) == 4 and store.verify().ok


def test_a_background_writers_error_surfaces_once_naming_the_prompt_and_the_store_keeps_what_it_held(
        tmp_path, llama, monkeypatch):
    path, model = llama
    store, kept = _store_with_one_run(tmp_path, llama)
    real = modules.write_prompt_modules
    calls = []

    def failing(run, *a):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real(run, *a)

    monkeypatch.setattr(modules, "write_prompt_modules", failing)
    prompts, conts = _prompts(4)
    with pytest.raises(OSError, match="simulated") as err:
        modules.capture_hf_module_run(store, path, prompts, conts, MODULES, model=model)
    (note,) = err.value.__notes__  # one message, naming the prompt and where it was raised
    assert "raised writing prompts[1] into run" in note and "background writer thread; the run is aborted" in note
    assert len(calls) == 2  # nothing written after the failure
    _as_it_was(store, kept)


def test_a_failing_forward_waits_for_the_writer_then_aborts_the_run(tmp_path, llama, monkeypatch):
    path, model = llama
    store, kept = _store_with_one_run(tmp_path, llama)
    real_write, real_capture = modules.write_prompt_modules, modules.capture_hf_modules
    n = []

    def slow_write(*a):
        time.sleep(0.3)  # still writing prompt 1 when prompt 2's forwards fail
        return real_write(*a)

    def capture(*a, **kw):
        n.append(1)
        if len(n) == 3:
            raise RuntimeError("forward failed (simulated)")
        return real_capture(*a, **kw)

    monkeypatch.setattr(modules, "write_prompt_modules", slow_write)
    monkeypatch.setattr(modules, "capture_hf_modules", capture)
    prompts, conts = _prompts(4)
    with pytest.raises(RuntimeError, match="forward failed"):
        modules.capture_hf_module_run(store, path, prompts, conts, MODULES, model=model)
    time.sleep(0.4)  # a writer left running would write into the removed run now
    _as_it_was(store, kept)
