"""render_comparison: numbers from SQL, what each page holds, escaping (static checks on the files;
the browser checks are in test_browser.py)."""
from __future__ import annotations

import base64
import html
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import reports
from capturestore import Store
from tests.reports.conftest import REPO
from tests.reports.synthetic import XSS_PROMPTS


def _figure_specs(page: str) -> dict:
    """{figure id: spec} of the figures embedded in a rendered page."""
    return {m.group(1): json.loads(m.group(2)) for m in
            re.finditer(r'<script type="application/json" id="fig-([^"]+)">(.*?)</script>', page, re.S)}


def _z(spec: dict) -> np.ndarray:
    z = spec["data"][0]["z"]
    rows, cols = (int(x) for x in z["shape"].split(","))
    return np.frombuffer(base64.b64decode(z["bdata"]), dtype="<f4").reshape(rows, cols)


@pytest.fixture(scope="module")
def bug_report(compared, tmp_path_factory):
    out = tmp_path_factory.mktemp("bug-report")
    index = reports.render_comparison(compared["store"], compared["bug"].comparison_id, out)
    return out, index


def test_report_writes_index_prompt_pages_one_plotly_and_the_queries(bug_report, compared):
    out, index = bug_report
    assert index == out / "index.html"
    import plotly

    shipped = (__import__("pathlib").Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    assert (out / "plotly.min.js").read_bytes() == shipped
    assert len(list(out.rglob("plotly*.js"))) == 1
    assert sorted(p.name for p in (out / "prompts").iterdir()) == ["p0000.html", "p0001.html", "p0002.html"]
    for page in [index, *(out / "prompts").iterdir()]:
        text = page.read_text()
        # every script / stylesheet is a relative file: nothing is loaded from the network
        assert not re.search(r'(src|href)="(https?:)?//', text), page
    sql = (out / "queries.sql").read_text()
    assert "FROM kv_head_metrics" in sql and compared["bug"].comparison_id in sql


def test_every_listed_query_runs_on_the_store_and_returns_rows(bug_report, compared):
    out, _ = bug_report
    statements = [s.strip() for s in re.split(r";\n", (out / "queries.sql").read_text()) if "SELECT" in s]
    assert len(statements) >= 8
    for s in statements:
        assert compared["store"].sql(s).num_rows > 0, s


def test_banner_and_checks_show_the_comparisons_row(bug_report, compared):
    out, index = bug_report
    store, cid = compared["store"], compared["bug"].comparison_id
    row = store.sql(f"SELECT * FROM comparisons WHERE comparison_id = '{cid}'").to_pylist()[0]
    page = index.read_text()
    assert '<div class="headline" id="verdict-headline">FAIL</div>' in page
    assert f"logits: {html.escape(row['logit_summary'])}</div>" in page
    assert f"KV: {html.escape(row['kv_summary'])}</div>" in page
    sigma = re.search(r"σ-ratio(?: ← decided)?</td>\s*<td class=\"num\">([^<]+)</td>", page).group(1)
    assert float(sigma) == pytest.approx(row["logit_sigma_ratio"], rel=1e-3)
    assert "first deviating KV layer" in page or "model.layers.2" in page
    # static top-k: oracle over the raw token rows in numpy
    tok = store.sql(f"SELECT passed, topk_5_error FROM logit_token_metrics WHERE comparison_id = '{cid}'").to_pydict()
    m = re.search(r"(\d+)/(\d+) tokens fail; max error K5 ([0-9.e-]+),", page)
    assert (int(m.group(1)), int(m.group(2))) == (tok["passed"].count(False), len(tok["passed"]))
    assert float(m.group(3)) == pytest.approx(np.max(tok["topk_5_error"]), rel=1e-3)
    runs = compared["bug"].runs
    assert (f"--baseline {runs['baseline']} --expected {runs['expected']} --actual {runs['actual']}\n"
            f"capturestore report {cid} --store {store.root} --out DIR</pre>") in page
    # the triage branch taken: prefill failure (token 0) and an engine bug, not dtype noise
    on = re.findall(r'class="node d\d on" data-node="([^"]+)"', page)
    assert row["failure_phase"] == "prefill" and "prefill" in on and "bug" in on and "noise" not in on


def test_kv_heatmap_is_the_max_over_heads_of_the_stored_rows(bug_report, compared):
    """Oracle: numpy over the raw kv_head_metrics rows (not the report's GROUP BY)."""
    out, index = bug_report
    store, cid = compared["store"], compared["bug"].comparison_id
    pid = re.search(r'data-page="p0001"', index.read_text()) and \
        store.sql(f"SELECT prompt_id FROM prompts WHERE run_id = '{compared['bug'].runs['expected']}' "
                  f"AND prompt_idx = 1").column(0)[0].as_py()
    rows = store.sql(f"SELECT layer, position, head, k_linf FROM kv_head_metrics "
                     f"WHERE comparison_id = '{cid}' AND prompt_id = '{pid}'").to_pydict()
    layers = sorted(set(rows["layer"]), key=lambda s: int(s.split(".")[2]))
    n_pos = max(rows["position"]) + 1
    want = np.full((len(layers), n_pos), -np.inf)
    for layer, pos, v in zip(rows["layer"], rows["position"], rows["k_linf"]):
        want[layers.index(layer), pos] = max(want[layers.index(layer), pos], v)
    spec = _figure_specs((out / "prompts" / "p0001.html").read_text())["k-linf"]
    assert spec["data"][0]["y"] == layers
    np.testing.assert_allclose(_z(spec), want.astype(np.float32), rtol=0, atol=0)
    # the bug is in layers 2+: their L-inf is far above layers 0-1 (the figure can show it)
    assert _z(spec)[2:].min() > 3 * _z(spec)[:2].max()


def test_aggregated_bc_figure_holds_the_kv_gen_bc_rows(bug_report, compared):
    out, index = bug_report
    store, cid = compared["store"], compared["bug"].comparison_id
    rows = store.sql(f"SELECT gen_token_idx, layer, v_bc FROM kv_gen_bc WHERE comparison_id = '{cid}'").to_pylist()
    spec = _figure_specs(index.read_text())["agg-v-bc"]
    z, layers = _z(spec), spec["data"][0]["y"]
    assert len(rows) == z.size
    for r in rows:
        assert z[layers.index(r["layer"]), r["gen_token_idx"]] == np.float32(r["v_bc"])
    assert spec["data"][0]["colorscale"][1] == [0.8, "#d73027"]  # reference/000: flat red below 0.8


def test_prompt_text_and_labels_are_escaped(bug_report):
    out, _ = bug_report
    for page in [out / "index.html", *(out / "prompts").iterdir()]:
        text = page.read_text()
        assert "<script>alert(1)" not in text and "<img src=x" not in text and "<b>label</b>" not in text, page
    index = (out / "index.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in index and "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in index
    assert "bug &lt;b&gt;label&lt;/b&gt;" in index


def test_report_is_regenerated_by_a_fresh_process_from_the_store_alone(compared, tmp_path):
    """The CLI in another interpreter: nothing in memory from the comparison is available there."""
    cid = compared["ok"].comparison_id
    r = subprocess.run([sys.executable, "-m", "capturestore.cli", "report", cid, "--store",
                        str(compared["store"].root), "--out", str(tmp_path / "rep")],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "rep" / "index.html")
    page = (tmp_path / "rep" / "index.html").read_text()
    assert 'id="verdict-headline">PASS' in page and cid in page


def test_modules_and_tasks_tabs_render_whatever_their_views_hold(compared, tmp_path):
    from capturestore.analysis import compare_runs
    from capturestore.comparators import Comparator
    from capturestore.comparators.modules import ModulesComparator
    from tests.reports.synthetic import add_runs

    class ModuleRows(Comparator):  # module_metrics rows written with the comparison (its evidence is sealed after)
        name, judges = "module_rows", False
        tables = {"module_metrics": ModulesComparator.tables["module_metrics"]}

        def finish(self):
            cid = self.context.comparison_id
            return {"module_metrics": {"comparison_id": [cid, cid], "module": ["model.layers.1.mlp", "model.layers.0.mlp"],
                                       "phase": ["prefill", "prefill"], "l2_ratio": [2.5, 1.25]}}

    store = Store.open(tmp_path / "s")
    runs = add_runs(store, n_prompts=1)
    res = compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"], baseline_run=runs["baseline"],
                       label="synthetic", comparators=[ModuleRows()])
    cid = res.comparison_id
    store.append_table("task_scores", {"run_id": [res.runs["actual"]], "task": ["gsm8k"], "score": [0.4375],
                                       "sample_note": ["<script>alert(1)</script>"]})
    store.append_table("task_samples", {"run_id": [res.runs["actual"]] * 3, "question": ["q-dev", "q-ok1", "q-ok2"],
                                        "deviated": [True, False, False]})
    index = reports.render_comparison(store, cid, tmp_path / "rep").read_text()
    samples = index[index.index("<h2>task_samples</h2>"):]
    assert re.search(r"<details open><summary>deviating: 1</summary>.*q-dev", samples, re.S)
    assert re.search(r"<details><summary>matching: 2</summary>.*q-ok1.*q-ok2", samples, re.S)
    assert 'data-tab="modules"' in index and 'data-tab="tasks"' in index
    assert "model.layers.1.mlp" in index and "0.4375" in index and "&lt;script&gt;alert(1)" in index
    spec = _figure_specs(index)["module_metrics-modules"]
    assert spec["data"][0]["x"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert spec["data"][0]["y"] == [1.25, 2.5]


def test_no_modules_or_tasks_tab_without_their_views(bug_report):
    index = bug_report[1].read_text()
    assert 'data-tab="modules"' not in index and 'data-tab="tasks"' not in index


def test_diff_page_shows_both_verdicts_and_the_per_layer_change(compared, tmp_path):
    page = reports.render_diff(compared["store"], compared["ok"].comparison_id, compared["bug"].comparison_id,
                               tmp_path).read_text()
    assert compared["ok"].comparison_id in page and compared["bug"].comparison_id in page
    assert re.search(r"<td>passed</td><td>yes</td><td>no</td>", page)
    assert "model.layers.2.self_attn" in page and (tmp_path / "plotly.min.js").is_file()
    # the BC change per generation token x layer is head - base of the kv_gen_bc rows
    store = compared["store"]
    b, h = ({(r["gen_token_idx"], r["layer"]): r["k_bc"] for r in store.sql(
        f"SELECT * FROM kv_gen_bc WHERE comparison_id = '{c.comparison_id}'").to_pylist()} for c in (compared["ok"], compared["bug"]))
    spec = _figure_specs(page)["delta-k-bc"]
    z, layers = _z(spec), spec["data"][0]["y"]
    for (g, layer), v in h.items():
        assert z[layers.index(layer), g] == pytest.approx(v - b[(g, layer)], abs=1e-6)


@pytest.mark.parametrize("loc", [{"phase": "decode", "layer": 3, "module": "model.layers.3.mlp", "token": 2},
                                 '{"phase": "decode", "layer": 3, "module": "model.layers.3.mlp", "token": 2}'])
def test_localisation_column_is_shown_with_its_labels(loc):
    from reports.render import _localisation

    got = dict(_localisation({"localisation": loc, "failure_phase": "decode", "kv_first_failing_layer": "layers.4"}, {}))
    assert got["phase"] == "decode" and got["decoder layer"] == "3" and got["module"] == "model.layers.3.mlp"
    assert got["generation token"] == "2" and got["first deviating KV layer"].startswith("layers.4 (")


def test_localisation_without_the_column_uses_the_older_ones():
    from reports.render import _localisation

    got = dict(_localisation({"failure_phase": "prefill", "first_failing_token": '{"prompt_id": "p", "gen_token_idx": 0}'}, {}))
    assert got == {"phase": "prefill", "first failing logit token": "prompt_id p, gen_token_idx 0"}


def test_two_way_and_logits_only_comparisons_render_what_they_hold(tmp_path):
    from capturestore.analysis import compare_runs
    from tests.reports.synthetic import add_runs

    store = Store.open(tmp_path / "s")
    runs = add_runs(store, n_prompts=2)
    two = compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"], label="two-way")
    logits_only = compare_runs(store, expected_run=runs["expected"], actual_run=runs["actual"],
                               baseline_run=runs["baseline"], kv=False)
    page = reports.render_comparison(store, two.comparison_id, tmp_path / "two").read_text()
    assert 'id="verdict-headline">NOT JUDGED' in page  # two-way KV is not judged: no pass, no fail
    prompt = (tmp_path / "two" / "prompts" / "p0000.html").read_text()
    figs = _figure_specs(prompt)
    assert "k-linf" in figs and "k-bc" not in figs and "k-ratio" not in figs and "ratios" not in figs
    page = reports.render_comparison(store, logits_only.comparison_id, tmp_path / "lo").read_text()
    assert 'id="verdict-headline">PASS' in page and "No cross-prompt BC" in page
    figs = _figure_specs((tmp_path / "lo" / "prompts" / "p0000.html").read_text())
    assert {"topk", "ratios", "bc"} <= set(figs) and not any(k.startswith(("k-", "v-")) for k in figs)
