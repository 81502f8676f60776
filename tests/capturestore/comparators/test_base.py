"""The comparator pipeline: the pass / phase / localisation rules written once, declared schemas
on disk and in the views, and a comparator from another package (entry point) run by name."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

from capturestore import Store
from capturestore.analysis import compare_runs
from capturestore.comparators import (
    Comparator,
    Localisation,
    TableSpec,
    Verdict,
    decoder_layer_index,
    declared_tables,
    localise,
    overall_passed,
    phase_at,
    register_comparator,
)
from capturestore.comparators.base import to_arrow

REPO = Path(__file__).resolve().parents[3]
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
H, D, V = 2, 16, 200


def _v(passed, rank, **loc):
    return Verdict("x", passed, "", Localisation(**loc) if loc else None, None, rank)


# ------------------------------------------------------------------------------------ rules


def test_nothing_judged_or_an_unjudged_part_is_never_a_pass():
    assert overall_passed([]) is False
    assert overall_passed([None, None]) is False
    assert overall_passed([_v(True, 1)]) is True
    assert overall_passed([_v(True, 1), _v(None, 2)]) is False  # judged nothing: no pass
    assert overall_passed([_v(True, 1), _v(False, 2)]) is False


def test_phase_rule_logit_row_zero_and_kv_before_the_prompt_end_are_prefill():
    plen = 5
    assert [phase_at(plen - 1 + g, plen) for g in range(3)] == ["prefill", "decode", "decode"]
    assert phase_at(np.arange(3, 7), plen).tolist() == ["prefill", "prefill", "decode", "decode"]


def test_localisation_takes_each_key_from_the_first_evidence_in_rank_order():
    module = _v(False, 0, phase="decode", layer=2, module="model.layers.2.mlp")
    logit = _v(False, 10, phase="prefill", token=0)
    kv = _v(False, 20, phase="prefill", layer=3)
    assert localise([kv, logit]).as_dict() == {"phase": "prefill", "layer": 3, "module": None, "token": 0}
    assert localise([kv, logit, module]).as_dict() == {"phase": "decode", "layer": 2, "module": "model.layers.2.mlp",
                                                      "token": 0}
    assert localise([_v(True, 0), None]) is None


def test_decoder_layer_index_of_layer_and_module_names():
    assert decoder_layer_index("model.layers.12.self_attn.attn") == 12
    assert decoder_layer_index("model.language_model.layers.3.mlp") == 3
    assert decoder_layer_index("7") == 7
    assert decoder_layer_index("model.norm") is None and decoder_layer_index("lm_head") is None


def test_rows_are_written_with_the_declared_types_extra_columns_kept_missing_ones_null():
    spec = TableSpec(pa.schema([("comparison_id", pa.string()), ("n", pa.int64()), ("x", pa.float64())]), 3)
    t = to_arrow([[{"comparison_id": "cmp-a", "n": 1, "extra": "e"}],
                  {"comparison_id": np.array(["cmp-a"], dtype=object), "x": np.array([np.nan], np.float32)}],
                 spec, "t")
    assert t.schema.names == ["comparison_id", "n", "x", "extra"]
    assert t.schema.field("x").type == pa.float64() and t.schema.field("n").type == pa.int64()
    assert t.column("n").to_pylist() == [1, None] and t.column("x").to_pylist() == [None, None]  # NaN -> NULL
    assert t.column("extra").to_pylist() == ["e", None]
    assert t.schema.metadata[b"capturestore.schema"] == b"t/3"


def test_a_second_comparator_cannot_take_a_name_or_a_table():
    class Kv(Comparator):
        name = "kv"

    with pytest.raises(ValueError, match="'kv' is taken"):
        register_comparator(Kv)

    class Thief(Comparator):
        name = "thief"
        tables = {"kv_gen_bc": declared_tables()["kv_gen_bc"]}

    with pytest.raises(ValueError, match="kv_gen_bc"):
        register_comparator(Thief)


# ------------------------------------------------------------------------------- on a store


def _bf16(x):
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.fixture
def runs(tmp_path):
    """FP32 baseline, its BF16 rounding as expected and as actual (a correct engine), the logits,
    and a second FP32 run (an actual with no error at all)."""
    rng = np.random.default_rng(1)
    prompts = [(rng.integers(4, V, n).tolist(), rng.integers(4, V, 5).tolist()) for n in (7, 11)]
    kv = [(rng.standard_normal((3, H, len(p) + len(c), D)).astype(np.float32),
           rng.standard_normal((3, H, len(p) + len(c), D)).astype(np.float32)) for p, c in prompts]
    logits = [rng.standard_normal((len(c), V)).astype(np.float32) * 3 for _, c in prompts]
    store = Store.open(tmp_path / "s")

    def write(dtype, cast):
        with store.begin_run(engine="synthetic", model_path="/m", model_hash="h0", dtype=dtype) as run:
            for i, (p, c) in enumerate(prompts):
                pid = run.add_prompt(p, continuation=c)
                run.write_kv(pid, cast(kv[i][0]), cast(kv[i][1]), layer_names=LAYERS)
                run.write_logits(pid, cast(logits[i]))
        return run.run_id

    ident = lambda x: x  # noqa: E731
    return store, write("float32", ident), write("bfloat16", _bf16), write("bfloat16", _bf16), logits, write("float32", ident)


class Unjudged(Comparator):
    """Judges nothing: its verdict's passed is None."""

    name = "unjudged-test"

    def verdict(self):
        return Verdict(self.name, None, "not judged: nothing to see", None)


def test_a_comparator_that_judged_nothing_alone_is_stored_as_not_passed(runs):
    store, base, exp, act, *_ = runs
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, logits=False, kv=False,
                       comparators=[Unjudged()])
    assert res.passed is False
    row = store.sql(f"SELECT passed, localisation FROM comparisons WHERE comparison_id = '{res.comparison_id}'")
    assert row.to_pylist() == [{"passed": False, "localisation": None}]


def test_kv_only_evidence_localises_to_the_layer_index_and_prefill(runs, tmp_path):
    store, base, exp, *_ = runs

    def broken(x):  # layer 1 of every position off by 5 % in the actual run
        y = _bf16(x).copy()
        y[1] *= 1.05
        return _bf16(y)

    with store.begin_run(engine="synthetic", model_path="/m", model_hash="h0", dtype="bfloat16") as run:
        for p in store.prompts(exp).to_pylist():
            k, v = store.read_kv(base, p["prompt_id"])
            pid = run.add_prompt(p["token_ids"][: p["n_prompt_tokens"]], continuation=p["token_ids"][p["n_prompt_tokens"]:])
            run.write_kv(pid, broken(np.asarray(k, np.float32)), _bf16(np.asarray(v, np.float32)), layer_names=LAYERS)
            run.write_logits(pid, store.read_logits(exp, p["prompt_id"]))
        k_bad = run.run_id
    res = compare_runs(store, expected_run=exp, actual_run=k_bad, baseline_run=base)
    assert not res.passed and res.kv_verdict.first_failing_layer == LAYERS[1]
    assert res.localisation == {"phase": "prefill", "layer": 1, "module": None, "token": None}
    row = store.sql(f"SELECT failure_phase, failure_layer, failure_module, failure_token, localisation "
                    f"FROM comparisons WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    where = (row["failure_phase"], row["failure_layer"], row["failure_module"], row["failure_token"])
    assert where == ("prefill", 1, None, None)
    assert json.loads(row["localisation"]) == res.localisation


def test_views_of_declared_tables_are_the_declared_columns_and_old_segments_read_null(runs):
    store, base, exp, act, *_ = runs
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
    declared = declared_tables()
    for table in ("comparisons", "kv_layer_verdicts", "logit_token_metrics"):
        got = [r["column_name"] for r in store.sql(f"DESCRIBE {table}").to_pylist()]
        assert got == declared[table].schema.names, table
    # a comparisons segment of schema version 1 (no localisation columns), as older stores hold
    old = {k: v for k, v in store.sql(f"SELECT * FROM comparisons WHERE comparison_id = '{res.comparison_id}'")
           .to_pylist()[0].items() if k not in ("localisation", "failure_layer", "failure_module", "failure_token")}
    store.append_table("comparisons", [{**old, "comparison_id": "cmp-old-1"}])
    row = store.sql("SELECT failure_layer, localisation, typeof(failure_layer) t FROM comparisons "
                    "WHERE comparison_id = 'cmp-old-1'").to_pylist()
    assert row == [{"failure_layer": None, "localisation": None, "t": "BIGINT"}]
    assert Store.open(store.root).verify().ok


PLUGIN = '''
import numpy as np
import pyarrow as pa
from capturestore.comparators import Comparator, Localisation, TableSpec, Verdict


class PlugComparator(Comparator):
    """Max |actual - expected| logit per prompt; fails naming a module (module evidence)."""

    name = "plug"
    tables = {"plug_prompt_metrics": TableSpec(pa.schema([
        ("comparison_id", pa.string()), ("prompt_id", pa.string()), ("n_rows", pa.int64()),
        ("max_abs_diff", pa.float64())]), 1)}
    needs = ("logits",)
    localisation_rank = 0
    comparison_fields = (pa.field("plug_worst", pa.float64()),)

    def __init__(self):
        self.worst = 0.0

    def compare(self, prompt):
        e = np.asarray(prompt.logits("expected"), np.float64)
        a = np.asarray(prompt.logits("actual"), np.float64)
        d = float(np.max(np.abs(a - e)))
        self.worst = max(self.worst, d)
        return {"plug_prompt_metrics": [{"comparison_id": prompt.comparison_id, "prompt_id": prompt.prompt_id,
                                         "n_rows": np.int32(e.shape[0]), "max_abs_diff": d}]}

    def verdict(self):
        return Verdict(self.name, False, f"FAIL: worst {self.worst}",
                       Localisation(phase="decode", layer=1, module="model.layers.1.mlp", token=2), None, 0)

    def comparison_columns(self, verdict, passed):
        return {"plug_worst": self.worst}
'''


def test_a_comparator_of_another_package_runs_by_name_through_its_entry_point(runs, tmp_path):
    store, base, exp, act, logits, fp32 = runs
    site = tmp_path / "site"
    (site / "plugpkg").mkdir(parents=True)
    (site / "plugpkg" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    dist = site / "plugpkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugpkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[capturestore.comparators]\nplug = plugpkg:PlugComparator\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    # actual = an FP32 run: logits and KV pass (no error at all), the plugin sees BF16 rounding
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("plugin_proc.py")), str(store.root), exp, fp32, base],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "plug" in res["names"] and {"logits", "kv", "fp8_kv_floor"} <= set(res["names"])
    # logits and KV pass, the plugin fails: the comparison fails, and its module
    # evidence decides the localisation
    assert res["passed"] is False
    assert res["localisation"] == {"phase": "decode", "layer": 1, "module": "model.layers.1.mlp", "token": 2}
    cid = res["comparison_id"]
    rows = store.sql(f"SELECT * FROM comparisons WHERE comparison_id = '{cid}'").to_pylist()
    assert rows[0]["logit_passed"] is True and rows[0]["kv_passed"] is True and rows[0]["passed"] is False
    assert rows[0]["failure_module"] == "model.layers.1.mlp" and rows[0]["failure_layer"] == 1
    # its table holds the oracle's numbers, typed as it declared (n_rows int32 in, int64 stored)
    got = store.sql(f"SELECT prompt_id, n_rows, max_abs_diff FROM plug_prompt_metrics WHERE comparison_id = '{cid}' "
                    f"ORDER BY prompt_id").to_pylist()
    pids = store.prompts(exp).column("prompt_id").to_pylist()
    want = sorted(({"prompt_id": pid, "n_rows": len(lg),
                    "max_abs_diff": float(np.max(np.abs(lg.astype(np.float64) - _bf16(lg))))}
                   for pid, lg in zip(pids, logits)), key=lambda r: r["prompt_id"])
    assert got == want
    # its comparisons column is in the segment (this process does not know the plugin: the view
    # shows the columns declared here)
    import pyarrow.parquet as pq

    segs = [pq.read_table(p) for p in (store.root / "tables" / "comparisons").glob("*.parquet")]
    mine = [r for t in segs for r in t.to_pylist() if r.get("comparison_id") == cid]
    assert mine[0]["plug_worst"] == max(r["max_abs_diff"] for r in want)
    seg = next((store.root / "tables" / "plug_prompt_metrics").glob("*.parquet"))
    assert pq.read_schema(seg).field("n_rows").type == pa.int64()


def test_a_declared_table_with_a_truncated_segment_keeps_its_declared_columns_and_fails_naming_it(runs):
    import duckdb

    from capturestore.catalog import rebuild_catalog_file
    from capturestore.errors import QueryError

    store, base, exp, act, *_ = runs
    compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base)
    seg = next((store.root / "tables" / "kv_gen_bc").glob("*.parquet"))
    seg.write_bytes(seg.read_bytes()[:100])
    fresh = Store.open(store.root)
    with pytest.raises(QueryError, match=f"table kv_gen_bc is unreadable.*{seg.name}"):
        fresh.sql("SELECT * FROM kv_gen_bc")
    assert fresh.sql("SELECT count(*) n FROM kv_layer_verdicts").column("n").to_pylist() == [3]
    _, broken = rebuild_catalog_file(store.root)
    assert list(broken) == ["kv_gen_bc"]
    con = duckdb.connect(str(store.root / "catalog.duckdb"), read_only=True)
    try:
        cols = [r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE kv_gen_bc)").fetchall()]
        assert cols == declared_tables()["kv_gen_bc"].schema.names
        cols = [r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE comparisons)").fetchall()]
        assert cols == declared_tables()["comparisons"].schema.names
    finally:
        con.close()


class Quiet(Comparator):
    """Declares a table but writes no row of it, and passes."""

    name = "quiet-test"
    tables = {"quiet_test_rows": TableSpec(pa.schema([("comparison_id", pa.string())]), 1)}

    def compare(self, prompt):
        return {"quiet_test_rows": []}

    def verdict(self):
        return Verdict(self.name, True, "PASS: nothing wrong")


def test_a_table_without_rows_gets_no_segment_and_a_comparator_named_twice_is_refused(runs):
    store, base, exp, act, *_ = runs
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=[Quiet()])
    assert res.passed and res.verdicts["quiet-test"].passed is True
    assert not (store.root / "tables" / "quiet_test_rows").exists()
    with pytest.raises(ValueError, match="name one twice"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=["kv"])


class Raising(Comparator):
    """Raises ``error`` in the stage named ``stage``; writes one row per prompt otherwise."""

    name = "raising-test"
    tables = {"raising_test_rows": TableSpec(pa.schema([("comparison_id", pa.string()), ("prompt_id", pa.string())]),
                                             1)}

    def __init__(self, stage, error):
        self.stage, self.error = stage, error

    def _maybe(self, stage):
        if stage == self.stage:
            raise self.error

    def prepare(self, context):
        super().prepare(context)
        self._maybe("prepare")

    def compare(self, prompt):
        self._maybe("compare")
        return {"raising_test_rows": [{"comparison_id": prompt.comparison_id, "prompt_id": prompt.prompt_id}]}

    def finish(self):
        self._maybe("finish")
        return {}

    def verdict(self):
        self._maybe("verdict")
        return Verdict(self.name, True, "PASS")


@pytest.mark.parametrize("stage", ["prepare", "compare", "finish", "verdict"])
def test_a_comparator_raising_in_any_stage_is_stored_errored_with_its_traceback_and_the_others_run(runs, stage):
    store, base, exp, act, *_ = runs
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base,
                       comparators=[Raising(stage, KeyError(f"bug in {stage}"))])
    assert res.verdicts["logits"].passed is True and res.verdicts["kv"].passed is True  # the others ran and pass
    v = res.verdicts["raising-test"]
    assert v.passed is None and v.text.startswith("errored: KeyError: 'bug in") and not res.passed
    assert f"in {stage}" in res.errors["raising-test"] and "Traceback" in res.errors["raising-test"]
    row = store.sql(f"SELECT passed, logit_passed, kv_passed, errored FROM comparisons "
                    f"WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    assert row["passed"] is False and row["logit_passed"] is True and row["kv_passed"] is True
    assert json.loads(row["errored"]) == res.errors
    assert not (store.root / "tables" / "raising_test_rows").exists()  # partial rows are never stored


def test_a_comparator_raising_valueerror_refuses_the_comparison_storing_nothing(runs):
    store, base, exp, act, *_ = runs
    with pytest.raises(ValueError, match="bad input here"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base,
                     comparators=[Raising("compare", ValueError("bad input here"))])
    assert not (store.root / "tables" / "comparisons").exists()
    assert not (store.root / "tables" / "raising_test_rows").exists()


def test_a_comparator_reads_its_own_runs_when_given_and_the_row_records_them(runs):
    store, base, exp, act, _, fp32 = runs
    seen = {}

    class Spy(Comparator):
        name = "spy-test"

        def compare(self, prompt):
            seen[prompt.prompt_id] = dict(prompt.runs)
            return {}

        def verdict(self):
            return Verdict(self.name, True, "PASS")

    own = {"baseline": base, "expected": exp, "actual": fp32}
    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=[Spy()],
                       comparator_runs={"spy-test": own})
    assert res.passed and len(seen) == 2 and all(r == own for r in seen.values())
    row = store.sql("SELECT actual_run, comparator_runs FROM comparisons").to_pylist()[0]
    assert row["actual_run"] == act and json.loads(row["comparator_runs"]) == {"spy-test": own}
    with pytest.raises(ValueError, match=r"comparator_runs\['spy-test'\] has roles \['actual', 'expected'\]"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=[Spy()],
                     comparator_runs={"spy-test": {"expected": exp, "actual": fp32}})
    with pytest.raises(ValueError, match="comparator_runs names 'nobody'"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparator_runs={"nobody": own})


def test_an_asked_for_comparator_that_judged_nothing_holds_the_comparison_back(runs):
    """verdict() None is the base class's default: a plugin that forgets it, or judges nothing, is no
    pass (a comparator declaring ``judges = False`` only stores evidence and does not hold it back)."""
    store, base, exp, act, *_ = runs

    class Nothing(Comparator):
        name = "nothing-test"

    class Evidence(Comparator):
        name = "evidence-test"
        judges = False

    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=[Nothing()])
    assert res.verdicts["logits"].passed is True and res.verdicts["kv"].passed is True
    assert res.verdicts["nothing-test"].passed is None and "judged nothing" in res.verdicts["nothing-test"].text
    assert not res.passed
    ok = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=[Evidence()])
    assert ok.passed and ok.verdicts["evidence-test"] is None


def test_a_comparator_raising_in_its_row_cells_stores_none_of_its_rows_and_the_row_does_not_pass(runs):
    store, base, exp, act, *_ = runs

    class Cells(Raising):
        name = "cells-test"
        tables = {"cells_test_rows": TableSpec(pa.schema([("comparison_id", pa.string()), ("prompt_id", pa.string())]),
                                               1)}

        def compare(self, prompt):
            return {"cells_test_rows": [{"comparison_id": prompt.comparison_id, "prompt_id": prompt.prompt_id}]}

        def comparison_columns(self, verdict, passed):
            raise KeyError("bug in cells")

    res = compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base, comparators=[Cells(None, None)])
    assert not res.passed and res.verdicts["cells-test"].text.startswith("errored: KeyError: 'bug in cells'")
    assert res.verdicts["cells-test"].detail is None  # the traceback is in res.errors, not in the verdict
    row = store.sql(f"SELECT passed, logit_passed, errored FROM comparisons "
                    f"WHERE comparison_id = '{res.comparison_id}'").to_pylist()[0]
    assert row["passed"] is False and row["logit_passed"] is True and "bug in cells" in row["errored"]
    assert not (store.root / "tables" / "cells_test_rows").exists()


def test_a_damaged_store_met_by_a_comparator_refuses_the_comparison_storing_nothing(runs):
    from capturestore.errors import CorruptChunkError

    store, base, exp, act, *_ = runs
    with pytest.raises(CorruptChunkError, match="chunk 0/0"):
        compare_runs(store, expected_run=exp, actual_run=act, baseline_run=base,
                     comparators=[Raising("compare", CorruptChunkError("run x, prompt y, logits, chunk 0/0: bad crc"))])
    assert not (store.root / "tables" / "comparisons").exists()
