"""A store writer run as its own process by the reliability tests.

    writer_proc.py STORE stream N_PROMPTS SEED   write one run step by step, print progress
    writer_proc.py STORE hold                    begin a run, write a little, wait for stdin, commit
    writer_proc.py STORE hold-commit             write a run, stop mid-commit (prompts and captures
                                                 segments written, the runs marker not), wait for stdin

The data of prompt i is ``prompt_data(seed, i)``, so a test can recompute what was written.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 3, 2, 32, 64
PROMPT_LEN = 8  # the first tokens are the prompt, the rest its continuation


def prompt_data(seed: int, i: int) -> dict[str, np.ndarray]:
    """tokens [token] (an 8-token prompt + its continuation, ids below VOCAB), k/v [layer, kv_head,
    seq, head_dim] bf16 (one position per token), logits [gen_token, vocab] fp32 (one row per
    continuation token)."""
    rng = np.random.default_rng([seed, i])
    seq = 24 + i
    return {
        "tokens": rng.integers(0, VOCAB, size=seq),
        "k": rng.standard_normal((LAYERS, KV_HEADS, seq, HEAD_DIM)).astype(ml_dtypes.bfloat16),
        "v": rng.standard_normal((LAYERS, KV_HEADS, seq, HEAD_DIM)).astype(ml_dtypes.bfloat16),
        "logits": rng.standard_normal((seq - PROMPT_LEN, VOCAB)).astype(np.float32),
    }


def stream(store_path: str, n_prompts: int, seed: int) -> None:
    from capturestore import Store

    store = Store.open(store_path)
    with store.begin_run(engine="test", model_path=f"seed{seed}", chunk_tokens=8, config={"seed": seed}) as run:
        print("begun", run.run_id, flush=True)
        for i in range(n_prompts):
            d = prompt_data(seed, i)
            pid = run.add_prompt(d["tokens"][:PROMPT_LEN], text=f"prompt {i}", continuation=d["tokens"][PROMPT_LEN:])
            for t in range(d["k"].shape[2]):  # one decode step at a time
                run.append_kv(pid, d["k"][:, :, t : t + 1], d["v"][:, :, t : t + 1])
                if t < len(d["logits"]):
                    run.append_logits(pid, d["logits"][t : t + 1])
            print("prompt", i, flush=True)
    store.append_table("writer_metrics", [{"run_id": run.run_id, "prompt_idx": i, "seed": seed} for i in range(n_prompts)])
    print("committed", run.run_id, flush=True)


def hold(store_path: str) -> None:
    from capturestore import Store

    store = Store.open(store_path)
    run = store.begin_run(engine="test", model_path="hold")
    d = prompt_data(0, 0)
    pid = run.add_prompt(d["tokens"])
    run.write_kv(pid, d["k"], d["v"])
    print("ready", run.run_id, flush=True)
    sys.stdin.readline()
    run.commit()
    print("committed", run.run_id, flush=True)


def hold_commit(store_path: str) -> None:
    from capturestore import Store

    store = Store.open(store_path)
    write_segment = type(store)._write_segment

    def stalled(self, table, data, segment=None, durable=False):
        if table == "runs":  # the commit marker is next: stop here until told to go on
            print("committing", segment, flush=True)
            sys.stdin.readline()
        return write_segment(self, table, data, segment=segment, durable=durable)

    type(store)._write_segment = stalled
    with store.begin_run(engine="test", model_path="hold-commit") as run:
        d = prompt_data(3, 0)
        pid = run.add_prompt(d["tokens"][:PROMPT_LEN], continuation=d["tokens"][PROMPT_LEN:])
        run.write_kv(pid, d["k"], d["v"])
        run.write_logits(pid, d["logits"])
    print("committed", run.run_id, flush=True)


if __name__ == "__main__":
    path, mode = sys.argv[1], sys.argv[2]
    if mode == "stream":
        stream(path, int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "hold":
        hold(path)
    elif mode == "hold-commit":
        hold_commit(path)
    else:
        raise SystemExit(f"unknown mode {mode}")
