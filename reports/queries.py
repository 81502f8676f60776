"""The SQL a report is rendered from: named queries over the catalog views (docs/tables.md).

Every number a report shows comes from one of these queries, run through ``Store.sql`` (read-only,
confined to the store), so a report can be regenerated from the store alone and anyone can run
the same query with ``capturestore sql``. A ``Queries`` object records each statement it ran, with
the comparison id filled in, for the report's Queries tab and ``queries.sql``.

The views a query reads may be absent (a logits-only comparison writes no KV tables, module and
task tables exist only when something wrote them) or may have more columns than this code knows
(the schemas grow): queries are composed from the views and columns the store holds, and rows
are read by column name.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

import pyarrow as pa

__all__ = ["Queries", "quote"]

# A run whose config holds "task_analysis_id" (capturestore.tasks: the lm-eval analysis its prompts
# came from) brings that analysis's task_scores / task_samples rows into its comparisons' reports.
TASK_ANALYSIS_RE = r'"task_analysis_id":\s*"([^"]+)"'


def quote(s: str) -> str:
    """A SQL string literal."""
    return "'" + str(s).replace("'", "''") + "'"


@dataclass
class Queries:
    """Runs named queries on ``store`` and remembers them (name, purpose, SQL) in order."""

    store: object
    ran: list = field(default_factory=list)  # [(name, purpose, sql)]
    _views: dict | None = None  # view -> [columns]

    def run(self, name: str, purpose: str, sql: str) -> pa.Table:
        sql = re.sub(r"\n\s*\n", "\n", textwrap.dedent(sql).strip())
        if name not in {n for n, _, _ in self.ran}:
            self.ran.append((name, purpose, sql))
        return self.store.sql(sql)

    def views(self) -> dict:
        """{view: [column names]} of every view of the store (one query)."""
        if self._views is None:
            t = self.store.sql("SELECT table_name, column_name FROM information_schema.columns "
                               "ORDER BY table_name, ordinal_position")
            out: dict = {}
            for tname, col in zip(t.column("table_name").to_pylist(), t.column("column_name").to_pylist()):
                out.setdefault(tname, []).append(col)
            self._views = out
        return self._views

    def has(self, view: str, *columns: str) -> bool:
        cols = self.views().get(view)
        return cols is not None and all(c in cols for c in columns)

    # ---- the comparison and what it binds ------------------------------------------------------
    def comparison(self, cid: str) -> dict | None:
        rows = self.run("comparison", "the comparisons row: verdicts, which check decided, localisation",
                        f"SELECT * FROM comparisons WHERE comparison_id = {quote(cid)}").to_pylist()
        return rows[0] if rows else None

    def latest_comparisons(self, n: int = 5) -> list[dict]:
        if not self.has("comparisons", "comparison_id"):
            return []
        order = "created_at DESC, " if self.has("comparisons", "created_at") else ""
        return self.store.sql(f"SELECT * FROM comparisons ORDER BY {order}comparison_id DESC LIMIT {int(n)}").to_pylist()

    def runs(self, cid: str) -> list[dict]:
        """One row per role the comparison binds; run columns are NULL where the run is gone."""
        roles = [r for r in ("baseline", "expected", "actual") if self.has("comparisons", f"{r}_run")]
        picks = " UNION ALL ".join(f"SELECT '{r}' AS role, {r}_run AS run_id, {i} AS ord FROM comparisons "
                                   f"WHERE comparison_id = {quote(cid)}" for i, r in enumerate(roles))
        return self.run("runs", "the runs compared, by role (engine, release, dtype, model hash)", f"""
            SELECT c.role, c.run_id, r.* EXCLUDE (run_id), r.run_id IS NOT NULL AS present
            FROM ({picks}) c LEFT JOIN runs r ON r.run_id = c.run_id
            WHERE c.run_id IS NOT NULL ORDER BY c.ord""").to_pylist()

    # ---- per prompt ---------------------------------------------------------------------------
    def prompt_summary(self, cid: str, expected_run: str) -> pa.Table:
        """One row per prompt of the comparison: text, lengths, logit and KV summary numbers."""
        c = quote(cid)
        ctes, joins, cols, ids = [], [], [], []
        if self.has("logit_token_metrics", "prompt_id"):
            three = self.has("logit_token_metrics", "linf_ratio", "l2_ratio", "bc")
            ctes.append(f"""lg AS (SELECT prompt_id, count(*) AS n_gen_tokens,
                count(*) FILTER (WHERE NOT passed) AS n_failed_tokens,
                min(gen_token_idx) FILTER (WHERE NOT passed) AS first_failed_token,
                count(*) FILTER (WHERE divergence) AS n_divergent,
                min(gen_token_idx) FILTER (WHERE divergence) AS first_divergent_token
                {', max(linf_ratio) AS max_linf_ratio, max(l2_ratio) AS max_l2_ratio, min(bc) AS min_logit_bc' if three else ''}
                FROM logit_token_metrics WHERE comparison_id = {c} GROUP BY prompt_id)""")
            joins.append("LEFT JOIN lg USING (prompt_id)")
            cols.append("lg.* EXCLUDE (prompt_id)")
            ids.append("SELECT prompt_id FROM lg")
        if self.has("kv_head_metrics", "prompt_id"):
            ctes.append(f"""kv AS (SELECT prompt_id, max(k_linf) AS max_k_linf, max(v_linf) AS max_v_linf,
                max(base_k_linf) AS max_base_k_linf, max(base_v_linf) AS max_base_v_linf,
                CASE WHEN max(base_k_linf) > 0 THEN max(k_linf) / max(base_k_linf) END AS kv_k_linf_ratio,
                CASE WHEN max(base_v_linf) > 0 THEN max(v_linf) / max(base_v_linf) END AS kv_v_linf_ratio
                FROM kv_head_metrics WHERE comparison_id = {c} GROUP BY prompt_id)""")
            joins.append("LEFT JOIN kv USING (prompt_id)")
            cols.append("kv.* EXCLUDE (prompt_id)")
            ids.append("SELECT prompt_id FROM kv")
        if self.has("kv_token_bc", "prompt_id"):
            ctes.append(f"""kb AS (SELECT prompt_id, min(k_bc) AS min_k_bc, min(v_bc) AS min_v_bc
                FROM kv_token_bc WHERE comparison_id = {c} GROUP BY prompt_id)""")
            joins.append("LEFT JOIN kb USING (prompt_id)")
            cols.append("kb.* EXCLUDE (prompt_id)")
        if not ids:
            return pa.table({"prompt_id": pa.array([], pa.string())})
        ctes.append(f"ids AS ({' UNION '.join(ids)})")
        return self.run("prompt_summary", "one row per prompt: lengths, failing tokens, worst ratios and BC", f"""
            WITH {', '.join(ctes)}
            SELECT ids.prompt_id, p.prompt_idx, p.n_tokens, p.n_prompt_tokens, p.text, {', '.join(cols)}
            FROM ids LEFT JOIN (SELECT * FROM prompts WHERE run_id = {quote(expected_run)}) p USING (prompt_id)
            {' '.join(joins)}
            ORDER BY p.prompt_idx NULLS LAST, ids.prompt_id""")

    def logit_totals(self, cid: str) -> dict:
        """Over every prompt and generation token: tokens, failing tokens, the largest top-k error
        per k and the largest three-way ratios ({} without logit metrics)."""
        cols = self.views().get("logit_token_metrics", [])
        if "prompt_id" not in cols:
            return {}
        maxes = [c for c in cols if re.fullmatch(r"topk_\w+_error", c)]
        maxes += [c for c in ("linf_ratio", "l2_ratio") if c in cols]
        return self.run("logit_totals", "over all prompts and tokens: failing tokens, largest top-k error per k, "
                        "largest three-way ratio", f"""
            SELECT count(*) AS n_tokens, count(*) FILTER (WHERE NOT passed) AS n_failed_tokens,
                   count(*) FILTER (WHERE divergence) AS n_divergent{''.join(f', max({c}) AS max_{c}' for c in maxes)}
            FROM logit_token_metrics WHERE comparison_id = {quote(cid)}""").to_pylist()[0]

    def logit_tokens(self, cid: str) -> pa.Table | None:
        if not self.has("logit_token_metrics", "prompt_id"):
            return None
        return self.run("logit_tokens", "per prompt x generation token: status, top-k errors, three-way ratios, BC", f"""
            SELECT * EXCLUDE (comparison_id) FROM logit_token_metrics
            WHERE comparison_id = {quote(cid)} ORDER BY prompt_id, gen_token_idx""")

    def kv_positions(self, cid: str) -> pa.Table | None:
        """Per prompt x layer x position: worst L-inf over KV heads of target and BF16, their ratio."""
        if not self.has("kv_head_metrics", "prompt_id"):
            return None
        return self.run("kv_positions", "per prompt x layer x position: max over KV heads of L-inf (target, BF16) "
                        "and the target/BF16 ratio", f"""
            SELECT prompt_id, layer, position, max(k_linf) AS k_linf, max(v_linf) AS v_linf,
                   max(base_k_linf) AS base_k_linf, max(base_v_linf) AS base_v_linf,
                   CASE WHEN max(base_k_linf) > 0 THEN max(k_linf) / max(base_k_linf) END AS k_ratio,
                   CASE WHEN max(base_v_linf) > 0 THEN max(v_linf) / max(base_v_linf) END AS v_ratio
            FROM kv_head_metrics WHERE comparison_id = {quote(cid)}
            GROUP BY prompt_id, layer, position ORDER BY prompt_id""")

    def kv_heads(self, cid: str) -> pa.Table | None:
        """Per prompt x layer x KV head: worst L-inf over positions of target and BF16."""
        if not self.has("kv_head_metrics", "prompt_id", "head"):
            return None
        return self.run("kv_heads", "per prompt x layer x KV head: max over positions of L-inf (target, BF16)", f"""
            SELECT prompt_id, layer, head, max(k_linf) AS k_linf, max(v_linf) AS v_linf,
                   max(base_k_linf) AS base_k_linf, max(base_v_linf) AS base_v_linf
            FROM kv_head_metrics WHERE comparison_id = {quote(cid)}
            GROUP BY prompt_id, layer, head ORDER BY prompt_id""")

    def kv_token_bc(self, cid: str) -> pa.Table | None:
        if not self.has("kv_token_bc", "prompt_id"):
            return None
        return self.run("kv_token_bc", "per prompt x layer x position: BC of target vs BF16 K/V errors", f"""
            SELECT prompt_id, layer, position, k_bc, v_bc FROM kv_token_bc
            WHERE comparison_id = {quote(cid)} ORDER BY prompt_id""")

    # ---- across prompts -----------------------------------------------------------------------
    def kv_gen_bc(self, cid: str) -> pa.Table | None:
        if not self.has("kv_gen_bc", "gen_token_idx"):
            return None
        return self.run("kv_gen_bc", "cross-prompt BC per generation token x layer (errors of all prompts pooled)", f"""
            SELECT * EXCLUDE (comparison_id) FROM kv_gen_bc WHERE comparison_id = {quote(cid)}
            ORDER BY gen_token_idx""")

    def divergences_per_gen_token(self, cid: str) -> pa.Table | None:
        if not self.has("logit_token_metrics", "divergence"):
            return None
        return self.run("divergences_per_gen_token", "prompts diverging at each generation token", f"""
            SELECT gen_token_idx, count(*) FILTER (WHERE divergence) AS n_divergent, count(*) AS n_prompts
            FROM logit_token_metrics WHERE comparison_id = {quote(cid)}
            GROUP BY gen_token_idx ORDER BY gen_token_idx""")

    def kv_layer_verdicts(self, cid: str) -> list[dict]:
        if not self.has("kv_layer_verdicts", "layer"):
            return []
        return self.run("kv_layer_verdicts", "per layer: pooled KV verdict numbers (sigma-ratio, BC, worst L-inf)", f"""
            SELECT * EXCLUDE (comparison_id) FROM kv_layer_verdicts WHERE comparison_id = {quote(cid)}""").to_pylist()

    def optional_table(self, view: str, cid: str, run_ids: list[str], limit: int) -> tuple[list[str], list[dict], int]:
        """Rows of ``view`` that belong to this comparison (by comparison_id, else by run_id, else by the
        analysis_id a run's config names as task_analysis_id):
        (columns, first ``limit`` rows, total rows). ([], [], 0) when the view is absent."""
        if view not in self.views():
            return [], [], 0
        if self.has(view, "comparison_id"):
            where, drop = f"comparison_id = {quote(cid)}", " EXCLUDE (comparison_id)"
        elif self.has(view, "run_id") and run_ids:
            where, drop = f"run_id IN ({', '.join(quote(r) for r in run_ids)})", ""
        elif self.has(view, "analysis_id") and run_ids:  # task tables: the analysis a run's config names
            linked = (f"SELECT regexp_extract(config, {quote(TASK_ANALYSIS_RE)}, 1) FROM runs "
                      f"WHERE run_id IN ({', '.join(quote(r) for r in run_ids)})")
            where, drop = f"analysis_id IN ({linked})", ""
        else:
            return [], [], 0
        n = self.run(f"{view}_count", f"rows of {view} of this comparison",
                     f"SELECT count(*) AS n FROM {view} WHERE {where}").column("n")[0].as_py()
        t = self.run(view, f"the {view} rows of this comparison (first {limit})",
                     f"SELECT *{drop} FROM {view} WHERE {where} LIMIT {int(limit)}")
        return t.column_names, t.to_pylist(), int(n)
