"""capturestore run --target vllm --kv-cache-dtype fp8: bad input is one line, exit 2, before anything is
written (issue 20 §1). The engine itself: tests/extractors/test_vllm_fp8.py (and the end-to-end run here)."""
import pytest

from capturestore.cli import main
from extractors import vllm_fp8 as F

NO_ISA = {"avx512": False, "amx": False, "machine": "x86_64", "capability": "AVX2"}


@pytest.fixture(scope="module")
def model():
    from extractors.models import tiny_model

    return tiny_model("llama-gqa")


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("the cat sat on the mat\nan apple a day keeps\n")
    return p


def _cli(capsys, *args):
    rc = main(["run", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _refused(capsys, tmp_path, *args, pattern):
    store = tmp_path / "s"
    rc, out, err = _cli(capsys, *args, "--store", store, "--quiet")
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and pattern in lines[0], err
    assert not store.exists()


def test_fp8_on_a_cpu_without_avx512_or_amx_is_refused(capsys, tmp_path, model, prompt_file, monkeypatch):
    monkeypatch.setattr(F, "_cpu_caps", lambda: NO_ISA)
    _refused(capsys, tmp_path, "--model", model, "--prompts", prompt_file, "--kv-cache-dtype", "fp8",
             pattern="FP8 KV cache needs x86 with AVX-512 or AMX; this CPU (x86_64, torch capability AVX2)")


def test_scales_for_the_wrong_number_of_layers_are_refused(capsys, tmp_path, model, prompt_file, monkeypatch):
    from nki_fp8.checkpoint import save_kv_scales

    monkeypatch.setattr(F, "_cpu_caps", lambda: {**NO_ISA, "avx512": True})
    save_kv_scales(tmp_path / "sc", [0.5] * 5, [0.5] * 5)
    _refused(capsys, tmp_path, "--model", model, "--prompts", prompt_file, "--kv-cache-dtype", "fp8",
             "--fp8-scales", tmp_path / "sc", pattern="scales for 5 layers, the model has 3")


@pytest.mark.parametrize("args,pattern", [
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4': not one of auto"),
    (["--fp8-emulate"], "--fp8-emulate needs --kv-cache-dtype fp8"),
    (["--kv-cache-dtype", "fp8", "--target", "hf:bfloat16"], "the FP8 vLLM cache is for --target vllm"),
])
def test_other_bad_fp8_options_are_refused(capsys, tmp_path, model, prompt_file, args, pattern):
    _refused(capsys, tmp_path, "--model", model, "--prompts", prompt_file, *args, pattern=pattern)
