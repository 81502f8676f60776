"""Prove an engine's KV cache correct: a scenario matrix judged against the same engine's
full-prefix recomputation (reference/004; docs/cachecheck.md).

``cachecheck(model, engine=..., store=...)`` drives an engine through a cache adapter
(``extractors.cache_adapters``: a full-prefix forward and a cached session whose operations
are each optional) over the scenarios below, judges every position of every request against
the full-prefix logits of the same token sequence (tokens and logits apart,
``metrics.cache_equivalence``), names the bug class each failure points to, and stores it as a
comparison of its own kind (tables ``cachecheck_*``, committed with the ``comparisons`` row last).

The matrix (``bs``: the engine's block size, 16 when it has none; ``W``: its sliding window):

=============  ===========  ==============================================================
scenario       needs        what it does
=============  ===========  ==============================================================
single         step         one request alone: prefill, 8 greedy steps (the baseline)
offset         step         prefill k tokens (k = 1, bs-1, bs, bs+1), feed the rest one by one
batch_N        step         N = 2, 3, 5, 8 ragged prompts prefilled together (padded), decoded
invariance     step         one request alone, then among 5 companions: alone == batched
compaction     free         5 ragged requests; two finish mid-batch (a middle row first), the
                            survivors decode on after the batch is compacted
reuse          free         a long request finishes; a short new one takes its slot/blocks: equal
                            to its full prefix and to the same request on a fresh engine
cancel         free         a request aborted mid-decode; a new one joins in its blocks
truncate       truncate     cut back to k (mid-block; then a block boundary: bs, or 3 bs within
                            a window of the end), continued with another token: positions restart at k
fork           fork         a prefix (mid-block and block-aligned) continued n ways, batched:
                            each branch == its own full prefix (copy-on-write)
chunk_C        prefill      chunked prefill, C = 1, 7, bs, and one not dividing the prompt
long           step         a prompt of max(4 W, 4 bs, 64) tokens (windows), decoded
overflow       step         filled to the context limit: the last positions are judged, one
                            step more must raise, never wrap silently
=============  ===========  ==============================================================

Every cached scenario needs ``reset`` and ``prefill`` too. A scenario whose operation the
adapter lacks, or that raises ``NotSupported``, is "not run" (with the reason), never passed;
an engine raising anywhere else fails the scenario. The check passes only when every scenario
asked for ran and passed.

Diagnosis (``metrics.cache_equivalence.diagnose``): each request records which kind of history
each of its positions has (alone, batched, after compaction, reuse, fork, truncation, chunking)
and a failure is attributed to the kind at its first differing position; a baseline (``single``)
failing from its first position makes every failure systematic, one failing only late makes
them windows or truncation. Where the adapter gives KV (``kv`` and ``full_kv``) a failing
request also names its first differing KV layer and position.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from metrics.cache_equivalence import (
    CLASS_TEXT,
    diagnose,
    first_kv_difference,
    judge_request,
    relative_linf,
    tolerance,
)

__all__ = [
    "SCENARIOS",
    "CacheCheckResult",
    "RequestResult",
    "ScenarioResult",
    "cachecheck",
    "check_cache",
    "make_adapter",
    "measure_noise",
    "scenario_names",
]

ENGINES = ("hf", "paged", "vllm")


# ------------------------------------------------------------------------------ records


@dataclass
class ScenarioSeq:
    """One request's evidence while a scenario runs: the realised tokens, the positions whose
    logits the engine returned (the logits at position p come from input token p), and the
    history kind of each position range (``segments``: [(from_position, kind)])."""

    name: str
    tokens: list
    segments: list  # [(from_position, kind)]
    positions: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    last: Any = None
    kv: Any = None
    reference: Any = None  # {position: logits} instead of the full prefix (batch invariance)
    prompt_len: int = 0  # tokens it was prefilled with (or held when it forked / was cut)

    def kind_at(self, position: int) -> str:
        kind = self.segments[0][1]
        for start, k in self.segments:
            if position >= start:
                kind = k
        return kind


class ScenarioCheck:
    """Not a logit judgement: an expected engine behaviour (an error at the context limit)."""

    def __init__(self, name, kind, position, passed, detail):
        self.name, self.kind, self.position, self.passed, self.detail = name, kind, position, passed, detail


class _Session:
    """What a scenario function drives: the adapter plus the records of its requests."""

    def __init__(self, adapter, rng):
        self.a = adapter
        self.rng = rng
        self.live: dict = {}
        self.done: list = []
        self.checks: list = []
        self.notes: list = []  # what a scenario observed beyond its judgements (prefix hits, preemptions)

    def prompt(self, n: int) -> list:
        return self.rng.integers(4, self.a.vocab_size, n).tolist()

    def prefill(self, names, prompts, kind="single", chunk=None):
        handles, logits = self.a.prefill([list(p) for p in prompts], chunk_size=chunk) if chunk else \
            self.a.prefill([list(p) for p in prompts])
        for h, name, p, lg in zip(handles, names, prompts, logits):
            lg = np.asarray(lg, np.float32).reshape(-1, np.shape(lg)[-1])
            first = len(p) - lg.shape[0]
            s = ScenarioSeq(name, list(p), [(0, kind)], list(range(first, len(p))), list(lg), lg[-1], prompt_len=len(p))
            self.live[h] = s
        return list(handles)

    def step(self, handles, tokens=None):
        handles = list(handles)
        if tokens is None:
            tokens = [None] * len(handles)
        tokens = [int(np.argmax(self.live[h].last)) if t is None else int(t) for h, t in zip(handles, tokens)]
        out = np.asarray(self.a.step(handles, tokens), np.float32)
        for h, t, lg in zip(handles, tokens, out):
            s = self.live[h]
            s.tokens.append(t)
            s.positions.append(len(s.tokens) - 1)
            s.logits.append(lg)
            s.last = lg
        return out

    def decode(self, handles, n: int):
        for _ in range(n):
            self.step(handles)

    def mark(self, handles, kind: str):
        """From the next position on, ``handles``' positions have history ``kind``."""
        for h in handles:
            s = self.live[h]
            s.segments.append((len(s.tokens), kind))

    def _kv(self, h):
        if self.a.supports("kv") and self.a.supports("full_kv"):
            try:
                return self.a.kv(h)
            except Exception:  # noqa: BLE001 - KV is extra evidence; the logits still judge
                return None
        return None

    def _record(self, h):
        s = self.live.pop(h)
        s.kv = self._kv(h)
        self.done.append(s)
        return s

    def free(self, handles):
        for h in handles:
            self._record(h)
        self.a.free(list(handles))

    def truncate(self, h, k: int, token: int):
        """Cut ``h`` back to ``k`` tokens and feed ``token`` (another than the one it had at k)."""
        s = self.live[h]
        self.done.append(ScenarioSeq(s.name, list(s.tokens), list(s.segments), list(s.positions), list(s.logits),
                              kv=self._kv(h), prompt_len=s.prompt_len))
        self.a.truncate(h, k)
        s.name = f"{s.name.split('@')[0]}@cut{k}"
        s.prompt_len = k
        s.tokens, s.positions, s.logits, s.segments = s.tokens[:k], [], [], [(0, "truncate")]
        self.step([h], [token])

    def fork(self, h, n: int):
        new = list(self.a.fork(h, n))
        parent = self.live[h]
        for i, x in enumerate(new):
            self.live[x] = ScenarioSeq(f"{parent.name}/branch{i + 1}", list(parent.tokens), [(0, "fork")], last=parent.last,
                                prompt_len=len(parent.tokens))
        parent.segments.append((len(parent.tokens), "fork"))
        return new

    def finish(self):
        for h in list(self.live):
            self._record(h)


# ------------------------------------------------------------------------------ scenarios


def _bs(a) -> int:
    return a.block_size or 16


def _sc_single(s):
    h = s.prefill(["r0"], [s.prompt(11)])
    s.decode(h, 8)


def _sc_offset(s):
    bs = _bs(s.a)
    for k in sorted({1, bs - 1, bs, bs + 1}):
        s.a.reset()
        p = s.prompt(k + 5)
        h = s.prefill([f"k{k}"], [p[:k]], kind="offset")
        for t in p[k:]:
            s.step(h, [t])
        s.decode(h, 3)
        s.finish()


def ragged_prompts(s, n: int, lo: int, hi: int) -> list:
    lens = s.rng.choice(np.arange(lo, hi + 1), size=n, replace=False) if hi - lo + 1 >= n else \
        s.rng.integers(lo, hi + 1, n)
    return [s.prompt(int(x)) for x in lens]


def _sc_batch(n):
    def run(s):
        bs = _bs(s.a)
        prompts = ragged_prompts(s, n, 2, 2 * bs + 3)
        h = s.prefill([f"b{i}/len{len(p)}" for i, p in enumerate(prompts)], prompts, kind="batch")
        s.decode(h, 6)
    run.batch = n
    return run


def _sc_invariance(s):
    bs = _bs(s.a)
    r = s.prompt(bs + 3)
    h = s.prefill(["alone"], [r])
    s.decode(h, 6)
    alone = s.live[h[0]]
    s.finish()
    s.a.reset()
    companions = ragged_prompts(s, 5, 2, 2 * bs + 3)
    prompts = companions[:2] + [r] + companions[2:]
    hs = s.prefill([f"c{i}" for i in range(2)] + ["batched"] + [f"c{i}" for i in range(2, 5)], prompts, kind="batch")
    s.decode(hs, 6)
    batched = s.live[hs[2]]
    s.finish()
    same = dict(zip(alone.positions, alone.logits))
    pos = [p for p in batched.positions if p in same]
    s.done.append(ScenarioSeq("batched-vs-alone", list(batched.tokens), [(0, "invariance")], pos,
                       [batched.logits[batched.positions.index(p)] for p in pos],
                       reference={p: same[p] for p in pos}))


def _sc_compaction(s):
    bs = _bs(s.a)
    prompts = ragged_prompts(s, 5, 3, 2 * bs + 3)
    hs = s.prefill([f"r{i}/len{len(p)}" for i, p in enumerate(prompts)], prompts, kind="batch")
    s.decode(hs, 2)
    s.free([hs[1]])  # a middle row finishes (length cap)
    live = [h for h in hs if h != hs[1]]
    s.mark(live, "compaction")
    s.decode(live, 2)
    s.free([live[0]])  # the first row finishes
    live = live[1:]
    s.decode(live, 4)


def _sc_reuse(s):
    bs = _bs(s.a)
    a = s.prefill(["long"], [s.prompt(2 * bs + 2)], kind="batch")[0]
    b = s.prefill(["companion"], [s.prompt(5)], kind="batch")[0]
    s.decode([a, b], 4)
    s.free([a])
    s.mark([b], "compaction")
    c = s.prefill(["new-in-freed"], [s.prompt(3)], kind="reuse")[0]
    s.decode([b, c], 6)
    reused = s.live[c]
    s.finish()
    # the same request on a fresh engine, its tokens fed as they came: equal to the reused slot's
    s.a.reset()
    f = s.prefill(["fresh"], [reused.tokens[: reused.prompt_len]], kind="reuse")[0]
    for t in reused.tokens[reused.prompt_len:]:
        s.step([f], [t])
    fresh = s.live[f]
    s.finish()
    s.done.append(ScenarioSeq("new-in-freed-vs-fresh", list(reused.tokens), [(0, "reuse")], list(reused.positions),
                       list(reused.logits), reference=dict(zip(fresh.positions, fresh.logits))))


def _sc_cancel(s):
    bs = _bs(s.a)
    a = s.prefill(["survivor"], [s.prompt(bs + 2)], kind="batch")[0]
    b = s.prefill(["aborted"], [s.prompt(2 * bs - 1)], kind="batch")[0]
    s.decode([a, b], 3)
    s.free([b])  # aborted mid-decode
    s.mark([a], "compaction")
    d = s.prefill(["new-after-abort"], [s.prompt(4)], kind="cancel")[0]
    s.decode([a, d], 5)


def _sc_truncate(s):
    bs = _bs(s.a)
    p = s.prompt(2 * bs + 3)
    h = s.prefill(["r0"], [p])[0]
    s.decode([h], 6)
    # cut 1: mid-block, then grow past the next block boundary; cut 2: back to a block boundary,
    # deep (bs) where the engine has no window, else the boundary just passed (a windowed cache
    # keeps only the last W-1 positions beyond what it decoded since, so it can roll back no further)
    for k, grow in ((2 * bs + 1, bs), (None, 5)):
        if k is None:
            k = 3 * bs if s.a.window else bs
        old = s.live[h].tokens[k]
        s.truncate(h, k, (old + 1 - 4) % (s.a.vocab_size - 4) + 4)
        s.decode([h], grow)


def _sc_fork(s):
    bs = _bs(s.a)
    for plen, n in ((bs + 5, 3), (2 * bs, 2)):
        s.a.reset()
        h = s.prefill([f"p{plen}"], [s.prompt(plen)])[0]
        top = np.argsort(-s.live[h].last)[: n + 1]
        new = s.fork(h, n)
        s.step([h, *new], top.tolist())
        s.decode([h, *new], 5)
        s.finish()


def _sc_chunk(c):
    def run(s):
        bs = _bs(s.a)
        size = {"1": 1, "7": 7, "bs": bs, "nondiv": bs + 3}[c]
        h = s.prefill([f"chunk{size}"], [s.prompt(2 * bs + 5)], kind="chunk", chunk=size)
        s.decode(h, 4)
    run.chunked = True
    return run


def _long_len(a) -> int:
    return max(4 * (a.window or 0), 4 * _bs(a), 64)


def _sc_long(s):
    h = s.prefill(["long"], [s.prompt(_long_len(s.a))], kind="long")
    s.decode(h, 8)


def _sc_overflow(s):
    n = s.a.max_context
    h = s.prefill(["to-limit"], [s.prompt(n - 2)], kind="overflow")
    s.decode(h, 2)  # positions n-2 and n-1: the last ones inside the context
    try:
        s.a.step(h, [int(np.argmax(s.live[h[0]].last))])
    except Exception as e:  # noqa: BLE001 - any clear error passes; the message is kept
        s.checks.append(ScenarioCheck("step-past-limit", "overflow", n, True, f"refused: {type(e).__name__}: {e}"))
    else:
        s.checks.append(ScenarioCheck("step-past-limit", "overflow", n, False,
                               f"a step at position {n} (context {n}) ran without an error: a silent wrap"))


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str
    needs: tuple
    run: Callable
    min_context: Callable = lambda a: 0  # positions the scenario needs


def _scenarios() -> dict:
    base = ("reset", "prefill", "step")
    out = [Scenario("single", "single", base, _sc_single, lambda a: 19),
           Scenario("offset", "offset", base, _sc_offset, lambda a: _bs(a) + 9)]
    out += [Scenario(f"batch_{n}", "batch", base, _sc_batch(n), lambda a: 2 * _bs(a) + 9) for n in (2, 3, 5, 8)]
    out += [Scenario("invariance", "invariance", base, _sc_invariance, lambda a: 2 * _bs(a) + 9),
            Scenario("compaction", "compaction", (*base, "free"), _sc_compaction, lambda a: 2 * _bs(a) + 11),
            Scenario("reuse", "reuse", (*base, "free"), _sc_reuse, lambda a: 2 * _bs(a) + 6),
            Scenario("cancel", "cancel", (*base, "free"), _sc_cancel, lambda a: 2 * _bs(a) + 2),
            Scenario("truncate", "truncate", (*base, "truncate"), _sc_truncate, lambda a: 3 * _bs(a) + 9),
            Scenario("fork", "fork", (*base, "fork"), _sc_fork, lambda a: 2 * _bs(a) + 6)]
    out += [Scenario(f"chunk_{c}", "chunk", base, _sc_chunk(c), lambda a: 2 * _bs(a) + 9) for c in ("1", "7", "bs", "nondiv")]
    out += [Scenario("long", "long", base, _sc_long, lambda a: _long_len(a) + 8),
            Scenario("overflow", "overflow", base, _sc_overflow, lambda a: a.max_context)]
    return {s.name: s for s in out}


SCENARIOS = _scenarios()


def scenario_names() -> list:
    return list(SCENARIOS)


def _table(adapter) -> dict:
    """The scenarios of ``adapter``: its own (``scenario_table()``: vLLM's request patterns) or
    the step-level matrix."""
    own = getattr(adapter, "scenario_table", None)
    return own() if callable(own) else SCENARIOS


# ------------------------------------------------------------------------------ results


@dataclass
class RequestResult:
    scenario: str
    request: str
    kind: str  # history kind at the first difference (or of the request)
    status: str  # pass | fail
    positions: np.ndarray
    judgement: Any = None  # metrics.cache_equivalence.RequestJudgement; None for a check
    first_position: int | None = None
    kv_diff: tuple | None = None  # (layer, position, rel err)
    diagnosis: str | None = None
    detail: str | None = None


@dataclass
class ScenarioResult:
    name: str
    kind: str
    status: str  # pass | fail | not_run
    reason: str | None = None
    requests: list = field(default_factory=list)
    diagnosis: str | None = None
    seconds: float = 0.0
    generations: list = field(default_factory=list)  # (prompt_len, tokens) of each request: its plain generation
    notes: list = field(default_factory=list)  # what the scenario observed (prefix-cache hits, preemptions)

    @property
    def failed(self) -> list:
        return [r for r in self.requests if r.status == "fail"]

    def summary(self) -> str:
        if self.status == "not_run":
            return f"{self.name}: not run ({self.reason})"
        if self.status == "pass":
            worst = max((r.judgement.max_err for r in self.requests if r.judgement is not None), default=float("nan"))
            note = "".join(f"; {n}" for n in self.notes)
            return f"{self.name}: pass ({len(self.requests)} requests, max rel logit error {worst:.2e}{note})"
        r = self.failed[0]
        where = f"request {r.request}, first difference at position {r.first_position}"
        if r.judgement is not None:
            j = r.judgement
            where += (f" (tokens {'differ' if j.first_token_diff is not None else 'equal'}, "
                      f"rel logit error {j.max_err:.2e} vs tolerance {j.tol:.1e})")
        if r.kv_diff is not None:
            where += f", KV first differs in layer {r.kv_diff[0]} at position {r.kv_diff[1]} ({r.kv_diff[2]:.2e})"
        if r.detail:
            where += f": {r.detail}"
        return f"{self.name}: FAIL, {self.diagnosis}: {where}"


@dataclass
class CacheCheckResult:
    comparison_id: str | None
    engine: str
    dtype: str
    noise: float
    tolerance: float
    scenarios: list
    wall_s: float
    plain_s: float = float("nan")  # sum of the plain generations of the same tokens (benchmark)

    @property
    def passed(self) -> bool:
        return bool(self.scenarios) and all(s.status == "pass" for s in self.scenarios)

    @property
    def not_run(self) -> list:
        return [s for s in self.scenarios if s.status == "not_run"]

    @property
    def failed(self) -> list:
        return [s for s in self.scenarios if s.status == "fail"]

    def verdict(self) -> str:
        if self.passed:
            return "PASS"
        if self.failed:
            return "FAIL"
        return "NOT PASSED"

    def summary(self) -> str:
        lines = [s.summary() for s in self.scenarios]
        classes = dict.fromkeys(s.diagnosis for s in self.failed if s.diagnosis)
        lines += [f"  {c}: {CLASS_TEXT[c]}" for c in classes if c in CLASS_TEXT]
        tail = (f"overall: {self.verdict()} ({len(self.scenarios) - len(self.failed) - len(self.not_run)} passed, "
                f"{len(self.failed)} failed, {len(self.not_run)} not run; engine {self.engine} {self.dtype}, "
                f"tolerance {self.tolerance:.1e} rel (noise {self.noise:.1e})")
        return "\n".join([*lines, tail])


# ------------------------------------------------------------------------------ the check


def measure_noise(adapter, rng) -> float:
    """The engine's own spread, no cache involved: the same requests' full-prefix logits alone vs
    among companions of other lengths at batch sizes 2, 4 and max_batch, and vs the same positions
    computed within a longer sequence (another matmul shape, as a cache's shapes differ); the
    worst position's relative L-inf."""
    bs = _bs(adapter)
    worst = 0.0
    for n in (7, bs + 3):
        r = rng.integers(4, adapter.vocab_size, n + 9).tolist()
        longer = np.asarray(adapter.full_logits([r])[0])
        r = r[:n]
        alone = np.asarray(adapter.full_logits([r])[0])
        worst = max(worst, float(np.nanmax(relative_linf(longer[:n], alone))))
        for size in sorted({2, 4, min(8, adapter.max_batch)}):
            comp = [rng.integers(4, adapter.vocab_size, int(m)).tolist() for m in rng.integers(2, 2 * bs + 4, size - 1)]
            batched = np.asarray(adapter.full_logits([*comp[: size // 2], r, *comp[size // 2:]])[size // 2])
            worst = max(worst, float(np.nanmax(relative_linf(batched, alone))))
    return worst


def _run_scenario(adapter, sc: Scenario, seed: int):
    missing = [op for op in sc.needs if not adapter.supports(op)]
    if missing:
        return None, f"the adapter lacks {', '.join(missing)}"
    from extractors.cache_adapters import NotSupported

    s = _Session(adapter, np.random.default_rng([seed, sum(map(ord, sc.name))]))
    adapter.reset()
    t0 = time.perf_counter()
    try:
        sc.run(s)
    except NotSupported as e:
        return None, f"the adapter does not support it: {e}"
    except Exception as e:  # noqa: BLE001 - an engine raising inside a scenario fails it
        s.finish()
        s.checks.append(ScenarioCheck("engine", sc.kind, None, False, f"the engine raised {type(e).__name__}: {e}"))
    s.finish()
    return (s, time.perf_counter() - t0), None


def _judge(adapter, sc: Scenario, s, tol: float, ref_cache: dict) -> list:
    out = []
    for seq in s.done:
        if not seq.positions:
            continue
        if seq.reference is not None:
            ref = np.stack([seq.reference[p] for p in seq.positions])
        else:
            key = tuple(seq.tokens)
            if key not in ref_cache:
                ref_cache[key] = np.asarray(adapter.full_logits([seq.tokens])[0], np.float32)
            ref = ref_cache[key][seq.positions]
        j = judge_request(np.stack(seq.logits), ref, seq.positions, tol)
        first = j.first_diff
        kind = seq.kind_at(first if first is not None else seq.positions[0])
        kvd = None
        if first is not None and seq.kv is not None:
            try:
                fk, fv = adapter.full_kv(seq.tokens[: seq.kv[0].shape[2]])
                kvd = first_kv_difference(seq.kv[0], seq.kv[1], fk, fv, tol)
            except Exception:  # noqa: BLE001 - KV is extra evidence
                kvd = None
        out.append(RequestResult(sc.name, seq.name, kind, "pass" if j.passed else "fail", j.positions, j, first, kvd))
    for c in s.checks:
        out.append(RequestResult(sc.name, c.name, c.kind, "pass" if c.passed else "fail",
                                 np.asarray([] if c.position is None else [c.position]), None, c.position,
                                 detail=c.detail))
    return out


def _baseline_state(results: dict) -> str:
    if results.get("oracle") is not None and results["oracle"].status == "fail":
        return "from_start"  # the full-prefix reference itself differs from the second oracle
    base = results.get("single")
    if base is None or base.status != "fail":
        return "clean"
    r = base.failed[0]
    first_compared = int(r.positions[0]) if len(r.positions) else 0
    return "from_start" if r.first_position is None or r.first_position <= first_compared else "late"


def _oracle_scenario(adapter, oracle, tol: float, seed: int) -> ScenarioResult:
    """``oracle``: the engine's own full-prefix logits against a second oracle's (HF's plain
    forward) on prompts of several lengths: a reference that is itself wrong fails here, from its
    first position (systematic), rather than hiding a cache bug."""
    rng = np.random.default_rng([seed, 11])
    lens = sorted({11, 2 * _bs(adapter) + 5, min(_long_len(adapter), adapter.max_context)})
    t0 = time.perf_counter()
    reqs = []
    for n in lens:
        tokens = rng.integers(4, adapter.vocab_size, n).tolist()
        mine = np.asarray(adapter.full_logits([tokens])[0], np.float32)
        ref = np.asarray(oracle.full_logits([tokens])[0], np.float32)
        j = judge_request(mine, ref, np.arange(n), tol)
        reqs.append(RequestResult("oracle", f"full-prefix/len{n}", "oracle", "pass" if j.passed else "fail",
                                  j.positions, j, j.first_diff))
    status = "pass" if all(r.status == "pass" for r in reqs) else "fail"
    return ScenarioResult("oracle", "oracle", status, None, reqs, seconds=time.perf_counter() - t0)


def check_cache(adapter, *, scenarios=None, seed: int = 0, progress=None, oracle=None) -> CacheCheckResult:
    """Run the scenario matrix on ``adapter`` and judge it (no store): the pure part of ``cachecheck``.

    ``scenarios``: names (default every one, ``scenario_names()``); refused up front
    (ValueError) when a scenario needs more positions than the adapter's ``max_context``.
    ``oracle``: a second oracle (anything with ``full_logits``, e.g. ``HFCacheAdapter``): the
    engine's full-prefix reference is first checked against it (scenario ``oracle``)."""
    _check_choices(seed, scenarios)
    table = _table(adapter)
    names = list(scenarios) if scenarios is not None else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"cachecheck: unknown scenario(s) {unknown}; known: {', '.join(table)}")
    if not adapter.max_context or adapter.max_context < 2:
        raise ValueError(f"cachecheck: adapter {adapter.name} declares no max_context")
    for n in names:
        need = table[n].min_context(adapter)
        if need > adapter.max_context:
            raise ValueError(f"cachecheck: scenario {n} needs {need} positions, beyond the engine's context of "
                             f"{adapter.max_context}: leave it out (--scenarios) or give a longer context")
    t0 = time.perf_counter()
    rng = np.random.default_rng([seed, 7])
    noise = measure_noise(adapter, rng)
    tol = tolerance(adapter.dtype, noise)
    results: dict = {}
    if oracle is not None:
        if progress:
            progress("scenario oracle")
        results["oracle"] = _oracle_scenario(adapter, oracle, tol, seed)
    for n in names:
        ref_cache: dict = {}  # references of this scenario only: memory is bounded by the largest scenario
        sc = table[n]
        if progress:
            progress(f"scenario {n}")
        ran, reason = _run_scenario(adapter, sc, seed)
        if ran is None:
            results[n] = ScenarioResult(n, sc.kind, "not_run", reason)
            continue
        s, secs = ran
        reqs = _judge(adapter, sc, s, tol, ref_cache)
        gens = [(q.prompt_len, list(q.tokens)) for q in s.done if q.reference is None and q.positions]
        status = "pass" if reqs and all(r.status == "pass" for r in reqs) else "fail"
        results[n] = ScenarioResult(n, sc.kind, status, None if reqs else "no evidence", reqs, seconds=secs,
                                    generations=gens, notes=list(s.notes))
    baseline = _baseline_state(results)
    stale_seen = any(q.kind in ("reuse", "cancel") for r in results.values() for q in r.failed)
    for r in results.values():
        for q in r.failed:
            q.diagnosis = diagnose(q.kind, baseline, stale_seen)
        if r.failed:
            r.diagnosis = r.failed[0].diagnosis
    return CacheCheckResult(None, adapter.name, adapter.dtype, noise, tol, list(results.values()),
                            time.perf_counter() - t0)


# ------------------------------------------------------------------------------ engines


def make_adapter(model, engine: str = "hf", dtype: str = "float32", *, max_context: int | None = None,
                 block_size: int | None = None, bugs=(), engine_options: dict | None = None):
    """The adapter of ``engine`` over checkpoint ``model``: ``hf`` (transformers' DynamicCache),
    ``paged`` (the reference paged engine, ``extractors.cache_engine``; ``bugs`` plants bugs),
    or ``package.module:Class``
    (your own adapter class, called as ``Class(model, dtype=dtype, **engine_options)``).
    An engine that cannot start raises ``EngineStartError`` (one line)."""
    from capturestore.pipeline import EngineStartError

    validate_inputs(model, engine, dtype, None, bugs, max_context=max_context, block_size=block_size)
    opts = dict(engine_options or {})
    try:
        if engine == "hf":
            from extractors.cache_adapters import HFCacheAdapter

            return HFCacheAdapter(model, dtype, max_context=max_context, **opts)
        if engine == "paged":
            from extractors.cache_adapters import PagedEngineAdapter

            return PagedEngineAdapter(model, dtype, block_size=16 if block_size is None else block_size,
                                      max_context=128 if max_context is None else max_context, bugs=bugs, **opts)
        if engine == "vllm":
            from extractors.cache_vllm import VllmCacheAdapter

            return VllmCacheAdapter(model, dtype, block_size=32 if block_size is None else block_size,
                                    max_context=256 if max_context is None else max_context, bugs=bugs, **opts)
        if ":" in engine:
            import importlib

            mod, _, cls = engine.partition(":")
            factory = getattr(importlib.import_module(mod), cls)
            return factory(model, dtype=dtype, **opts)
    except ValueError:
        raise
    except ImportError as e:
        raise EngineStartError(f"cachecheck: engine {engine} cannot start: {e}") from None
    except Exception as e:  # noqa: BLE001 - an engine failing at start is one line
        raise EngineStartError(f"cachecheck: engine {engine} failed to start: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None
    raise ValueError(f"cachecheck: unknown engine {engine!r}; one of {', '.join(ENGINES)} or package.module:Class")


def _check_choices(seed, scenarios) -> None:
    """The seed and the scenario list, refused by validate_inputs before anything starts and by
    check_cache for an adapter passed in."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"cachecheck: seed {seed!r} must be a non-negative integer")
    if scenarios is not None and not list(scenarios):  # an empty list is not "every scenario"
        raise ValueError("cachecheck: no scenario named (pass none for every scenario)")


def validate_inputs(model, engine: str = "hf", dtype: str = "float32", scenarios=None, bugs=(), *, seed: int = 0,
                    max_context: int | None = None, block_size: int | None = None) -> None:
    """Refuse bad input before anything starts or is written (ValueError, one line)."""
    from pathlib import Path

    _check_choices(seed, scenarios)
    if max_context is not None and max_context < 2:  # 0 read as "the engine's default" until checked here
        raise ValueError(f"cachecheck: max_context {max_context} must be at least 2 positions")
    if block_size is not None:
        if engine not in ("paged", "vllm"):
            raise ValueError(f"cachecheck: block_size applies to the paged and vllm engines, not {engine!r}")
        if block_size < 1:
            raise ValueError(f"cachecheck: block_size {block_size} must be at least 1")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"cachecheck: dtype {dtype!r} is not float32 or bfloat16")
    if model is None or not (Path(model) / "config.json").exists():
        raise ValueError(f"cachecheck: {model} is not a model directory (no config.json)")
    if engine not in ENGINES and ":" not in engine:
        raise ValueError(f"cachecheck: unknown engine {engine!r}; one of {', '.join(ENGINES)} or package.module:Class")
    if engine == "vllm":
        from extractors.cache_vllm import BUGS, vllm_scenarios

        table = vllm_scenarios()
    else:
        from extractors.cache_engine import BUGS

        table = SCENARIOS
    unknown = [n for n in scenarios or () if n not in table]
    if unknown:
        raise ValueError(f"cachecheck: unknown scenario(s) {unknown}; known: {', '.join(table)}")
    if bugs:
        if engine not in ("paged", "vllm"):
            raise ValueError("cachecheck: planted bugs (--bug) exist in the paged test engine only (and in vllm)")
        bad = [b for b in bugs if b not in BUGS]
        if bad:
            raise ValueError(f"cachecheck: unknown bug(s) {bad}; known: {', '.join(BUGS)}")


def cachecheck(model, *, engine: str = "hf", dtype: str = "float32", store=None, scenarios=None,
               label: str | None = None, seed: int = 0, max_context: int | None = None,
               block_size: int | None = None, bugs=(), adapter=None, hf_reference: bool = False,
               progress=None, engine_options: dict | None = None) -> CacheCheckResult:
    """Prove ``engine``'s KV cache on ``model`` equivalent to its full-prefix recomputation over
    the scenario matrix (module docstring), and store the result in ``store`` (a Store, or a path /
    URL where a store is created when there is none; None: not stored; refused before anything
    runs when it cannot be written). ``adapter``: an adapter instance to use instead of ``engine`` (your own).
    ``hf_reference``: also check the engine's full-prefix forward against HF's plain forward of
    ``model`` in the same dtype (the ``oracle`` scenario, the second oracle). ``engine_options``:
    keywords of the engine's adapter (vllm: ``prefix_caching``, ``chunk``, ``num_blocks``).

    Refused with ValueError before anything runs: an unknown engine, scenario or dtype, a model
    directory without config.json, scenarios beyond the engine's context. An engine that cannot
    start raises ``capturestore.pipeline.EngineStartError``."""
    from pathlib import Path

    if adapter is None:
        validate_inputs(model, engine, dtype, scenarios, bugs, seed=seed, max_context=max_context,
                        block_size=block_size)
    st = None
    if store is not None:
        from capturestore.store import as_store, require_writable

        st = store if hasattr(store, "append_table") else as_store(store, create=True)
        require_writable(st, "cachecheck")
    own = adapter is None
    if own:
        adapter = make_adapter(model, engine, dtype, max_context=max_context, block_size=block_size, bugs=bugs,
                               engine_options=engine_options)
    try:
        oracle = None
        if hf_reference:
            from extractors.cache_adapters import HFCacheAdapter

            oracle = HFCacheAdapter(model, dtype, max_context=adapter.max_context)
        result = check_cache(adapter, scenarios=scenarios, seed=seed, progress=progress, oracle=oracle)
    finally:
        if own:
            adapter.close()
    if st is not None:
        result.comparison_id = store_result(st, result, model=str(Path(model)) if model else None, label=label,
                                            adapter=adapter)
    return result


def store_result(store, result: CacheCheckResult, *, model: str | None, label: str | None, adapter) -> str:
    """Commit ``result`` as a comparison of its own kind: the ``cachecheck_*`` tables, then the
    ``comparisons`` row last (``integrity.commit_comparison``). -> the comparison id."""
    from capturestore.comparators.base import (
        COMPARISONS_SCHEMA_VERSION,
        TableSpec,
        to_arrow,
    )
    from capturestore.comparators.cachecheck import (
        TABLES,
        engine_row,
        position_rows,
        request_rows,
        scenario_rows,
    )
    from capturestore.integrity import commit_comparison

    cid = f"cmp-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    model_hash = None
    if model:
        try:
            from extractors.models import model_content_hash

            model_hash = model_content_hash(model)
        except (ValueError, OSError):
            model_hash = None
    tables = {
        "cachecheck_engines": [engine_row(cid, result, model, model_hash, adapter)],
        "cachecheck_scenarios": scenario_rows(cid, result),
        "cachecheck_requests": request_rows(cid, result),
        "cachecheck_positions": position_rows(cid, result),
    }
    staged = {t: to_arrow([rows], TABLES[t], t) for t, rows in tables.items()}
    staged = {t: x for t, x in staged.items() if x.num_rows}
    from capturestore.comparators import declared_tables

    spec = declared_tables()["comparisons"]
    row = {"comparison_id": cid, "label": label, "created_at": datetime.now(UTC), "baseline_run": None,
           "expected_run": None, "actual_run": None, "three_way": False,
           "n_prompts": sum(len(s.requests) for s in result.scenarios), "models_differ": False,
           "passed": result.passed,
           "failure_phase": None,
           "localisation": None if result.passed or not result.failed else json.dumps(
               {"scenario": result.failed[0].name, "diagnosis": result.failed[0].diagnosis}),
           "failure_token": None if not result.failed else result.failed[0].failed[0].first_position}
    commit_comparison(store, cid, staged, to_arrow([[row]], TableSpec(spec.schema, COMPARISONS_SCHEMA_VERSION),
                                                   "comparisons"))
    return cid
