"""The hf target on GPT-OSS: transformers has no SDPA attention for it (eager only, where its
attention sinks live), so ``--target hf:bfloat16`` would be the eager expected run itself; it is
refused in one line, exit 2, before anything is written."""
from capturestore.cli import main
from extractors.models import tiny_model


def test_hf_target_on_gpt_oss_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox jumps over the lazy dog.\n")
    store = tmp_path / "s"
    rc = main(["run", "--model", str(tiny_model("gpt-oss")), "--prompts", str(prompts), "--target", "hf:bfloat16",
               "--num-tokens", "4", "--store", str(store), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "GptOssForCausalLM has no SDPA attention" in err, err
    assert not store.exists()
