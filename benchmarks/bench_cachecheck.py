"""Benchmark of the cache check (issue 23, "Performance").

Run: ``python benchmarks/bench_cachecheck.py`` (one engine of each kind: paged, HF, vLLM; a
few minutes on 2 cores, the size ``make bench`` runs), ``--all`` for every engine and vLLM
configuration below (the whole matrix: ~9 engines x 2-5 min, too long for ``make bench``), or
``--engines paged:llama-gqa`` for one. For each engine, the full scenario matrix on a tiny model
(``check_cache``: the noise measurement, every scenario, every full-prefix reference, the
judgement) against the sum of the plain generations of the same tokens measured in the same
run: each judged request generated alone on a fresh engine (its prompt prefilled, then its
tokens fed one step at a time, nothing judged). The ratio is what proving the cache costs per
generated token; peak RSS says memory stays bounded (the largest scenario, not the matrix).
Goal: no engine FAILs (they are correct engines; the exit status says so): PASS, or NOT PASSED
where a scenario asked an operation the engine lacks (vLLM cannot truncate, docs/cachecheck.md).
Issue 23 set no ratio goal (docs/cachecheck.md records ~0.6-1.5x).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (run as a script)

ENGINES = ["paged:llama-gqa", "hf:llama-mha", "hf:llama-gqa", "hf:gemma3-sliding"]
# vLLM configurations: engine:arch:options (bs block size, pc prefix caching on, chunkN chunked
# prefill at N tokens, blocksN a KV budget of N blocks: preemption), the wider matrix the tests
# leave out (they start two configurations)
VLLM = ["vllm:llama-gqa:bs32,pc,chunk32,blocks20", "vllm:llama-gqa:bs32", "vllm:llama-gqa:bs128,pc",
        "vllm:llama-gqa:bs128,chunk64", "vllm:gemma3-sliding:bs32,pc,chunk32"]
# make bench's default: one engine of each kind (the vLLM one with prefix caching, chunked prefill
# and preemption, the configuration that exercises most)
DEFAULT = ["paged:llama-gqa", "hf:llama-gqa", "vllm:llama-gqa:bs32,pc,chunk32,blocks20"]


def vllm_options(text: str) -> dict:
    opts = {"prefix_caching": False, "chunk": None}
    for o in filter(None, text.split(",")):
        if o == "pc":
            opts["prefix_caching"] = True
        elif o.startswith("chunk"):
            opts["chunk"] = int(o[5:])
        elif o.startswith("blocks"):
            opts["num_blocks"] = int(o[6:])
        elif o.startswith("bs"):
            opts["block_size"] = int(o[2:])
    return opts


def plain_vllm_generations(adapter, generations) -> float:
    """vLLM: each request alone on the engine under test, greedy, as many tokens as it generated
    (the cost of the same tokens; nothing captured or judged)."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    for plen, tokens in generations:
        n = max(len(tokens) - plen, 1)
        adapter.llm.generate([{"prompt_token_ids": tokens[:plen]}],
                             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False),
                             use_tqdm=False)
    return time.perf_counter() - t0


def plain_generations(adapter, generations) -> float:
    """Seconds to generate every (prompt_len, tokens) alone, the cache used but nothing judged."""
    t0 = time.perf_counter()
    for plen, tokens in generations:
        adapter.reset()
        handles, _ = adapter.prefill([tokens[:plen]])
        for t in tokens[plen:]:
            adapter.step(handles, [t])
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=";".join(DEFAULT),
                    help="engine:arch[:vllm options], separated by ';' (default: one of each kind)")
    ap.add_argument("--all", action="store_true", help="every engine and vLLM configuration (long)")
    args = ap.parse_args(argv)
    if args.all:
        args.engines = ";".join(ENGINES + VLLM)
    import torch

    from capturestore.cachecheck import check_cache, make_adapter
    from extractors.models import tiny_model

    torch.manual_seed(0)
    rows = []
    for spec in args.engines.split(";"):
        engine, arch, *rest = spec.split(":")
        if engine == "vllm":
            opts = vllm_options(rest[0] if rest else "")
            adapter = make_adapter(tiny_model(arch), "vllm", "float32", block_size=opts.pop("block_size", 32),
                                   max_context=512 if "block_size=128" in spec or "bs128" in spec else 256,
                                   engine_options=opts)
        else:
            adapter = make_adapter(tiny_model(arch), engine, "float32", max_context=128 if engine == "paged" else None)
        t0 = time.perf_counter()
        result = check_cache(adapter)
        wall = time.perf_counter() - t0
        gens = [g for s in result.scenarios for g in s.generations]
        plain = (plain_vllm_generations if engine == "vllm" else plain_generations)(adapter, gens)
        adapter.close()
        positions = sum(len(q.positions) for s in result.scenarios for q in s.requests)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append((spec, result.verdict(), len(result.scenarios), len(gens), positions, wall, plain, wall / plain, rss))
        print(f"{spec}: {result.verdict()} in {wall:.1f} s", file=sys.stderr)
    head = ("engine", "verdict", "scenarios", "requests", "positions", "matrix s", "plain gen s", "ratio",
            "goal", "peak RSS MB", "met")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        met = "MISSED" if str(r[1]) == "FAIL" else "met"
        print(f"{r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:.1f} | {r[7]:.2f}x | "
              f"no FAIL (ratio: none set) | {r[8]:.0f} | {met}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 1 if any(str(r[1]) == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
