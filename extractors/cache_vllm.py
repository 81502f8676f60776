"""vLLM in-process under ``capturestore.cachecheck``: the scheduling scenarios as engine settings
and request patterns (docs/cachecheck.md, "vLLM").

vLLM's cache cannot be driven one operation at a time (its scheduler decides what runs in each
step, and the token fed at a step is the one it sampled at the previous one), so this adapter
does not implement the step-level session of ``CacheAdapter``. It runs **request patterns**
instead (``VllmCacheAdapter.run``): requests submitted at given engine steps or after another
finished, aborted at a step, forked (``n > 1``), teacher-forced where a scenario needs given
tokens, and records for every request the raw logits of every position the engine sampled from
(``extractors.vllm_logits``'s worker-side capture, before the sampler) and the tokens it fed.

The engine under test is one ``LLM`` with the configuration asked for (prefix caching, chunked
prefill by its token budget, block size, a KV budget in blocks). Its **full-prefix reference**
is a second ``LLM`` of the same model, dtype and block size with no cache reuse: prefix caching
off and a token budget of the whole context, so every sequence is one prefill whose every
position is computed from its whole prefix (the prompt-logits capture of ``vllm_logits``).

Scenarios (``SCENARIOS``; ``bs`` the block size): single, prefix_hit (prompts sharing k = bs-1,
bs, bs+1, 2 bs tokens of a finished one), batch_N, invariance, compaction (rows finishing at
their length caps), reuse (a new request in a finished one's freed blocks), cancel (abort
mid-decode, then a request in its blocks), fork (``n = 3`` sampled branches and a shared
system prompt), chunk_mixed (a long prompt prefilled while others decode: chunks that do not
divide it), preempt (more work than the KV budget: preemption and recompute), long, overflow
(stopped at the context, a longer prompt refused). ``truncate`` is not run: vLLM has no
operation that cuts a live request's cache back.

Planted bugs (``BUGS``, installed on the worker's model runner through ``collective_rpc``, each
changes the output; the tests prove it first): ``chunk_pos_off_by_one`` (positions of every chunk after a
request's first are one too high: RoPE only, the cache slots stay right), ``stale_prefix_block``
(a prefix-cache hit reads a block holding another request's data: the hit block's slot is
overwritten with the block that held it before, as a reused slot not cleared would).
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

import numpy as np

from extractors.cache_adapters import CacheAdapter, NotSupported

BUGS = ("chunk_pos_off_by_one", "stale_prefix_block")
_CAP = "capturestore"


@dataclass
class VReq:
    """One request of a pattern. ``at``: the engine step it is submitted at; ``after``: or once the
    request of that name finished; ``abort_at``: steps after its submission it is aborted at;
    ``teacher``: tokens the engine is made to feed; ``n``/``temperature``/``seed``: parallel
    sampling; ``kind``: the history kind of its positions (``segments`` overrides: [(pos, kind)])."""

    name: str
    prompt: list
    max_tokens: int
    kind: str = "single"
    at: int = 0
    after: str | None = None
    abort_at: int | None = None
    teacher: list | None = None
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    segments: list | None = None


@dataclass
class VOut:
    """What one request (one branch of a fork) produced: its tokens (prompt + fed), the positions
    whose logits the engine computed as a sampling row, those rows, how it ended."""

    name: str
    tokens: list
    prompt_len: int
    positions: list
    logits: list
    finish: str | None
    cached_tokens: int = 0
    submitted_step: int = 0
    extra: dict = field(default_factory=dict)


def _sampling(req: VReq, max_context: int):
    from vllm import SamplingParams

    spec = {"from": len(req.prompt), "to": max_context + 1}
    if req.teacher:
        spec["teacher"] = list(req.teacher)
    return SamplingParams(temperature=req.temperature, n=req.n, seed=req.seed, max_tokens=req.max_tokens,
                          ignore_eos=True, detokenize=False, extra_args={_CAP: spec})


class VllmCacheAdapter(CacheAdapter):
    """vLLM in-process (module docstring). ``prefix_caching``: on/off; ``chunk``: the token budget
    per step (chunked prefill at that size; None: the whole context, no chunking of one prompt);
    ``num_blocks``: the KV budget in blocks (small: preemption); ``bugs``: planted (``BUGS``)."""

    padding_side = None

    def __init__(self, model_dir, dtype: str = "float32", *, block_size: int = 32, prefix_caching: bool = True,
                 chunk: int | None = None, max_context: int = 256, max_batch: int = 8, num_blocks: int | None = None,
                 bugs=()):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the scheduler is ours to drive
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from extractors.vllm_rpc import make_llm

        bad = [b for b in bugs if b not in BUGS]
        if bad:
            raise ValueError(f"VllmCacheAdapter: unknown bug(s) {bad}; known: {', '.join(BUGS)}")
        if block_size % 32:
            raise ValueError(f"VllmCacheAdapter: block size {block_size}: vLLM's CPU attention needs a multiple of 32")
        self.dtype, self.block_size, self.max_context, self.max_batch = dtype, block_size, max_context, max_batch
        self.prefix_caching, self.chunk, self.bugs = prefix_caching, chunk, tuple(bugs)
        self.num_blocks = num_blocks or 2 * max_batch * (-(-max_context // block_size)) + 8
        budget = chunk or max_context
        if budget < max_batch:
            raise ValueError(f"VllmCacheAdapter: a chunk of {budget} tokens is below max_batch {max_batch}")
        common = {"dtype": dtype, "max_model_len": max_context, "block_size": block_size, "max_num_seqs": max_batch}
        self.llm = make_llm(model_dir, **common, num_gpu_blocks_override=self.num_blocks,
                            enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunk is not None,
                            max_num_batched_tokens=budget, long_prefill_token_threshold=0)
        self.ref = make_llm(model_dir, **common, num_gpu_blocks_override=2 * max_batch * (-(-max_context // block_size)) + 8,
                            enable_prefix_caching=False, max_num_batched_tokens=max(max_context, max_batch) * max_batch)
        from extractors.vllm_logits import enable_vllm_logits_capture

        info = enable_vllm_logits_capture(self.llm)
        enable_vllm_logits_capture(self.ref)
        if bugs:  # on the worker, in-process (a plain function: the extension class is shared by both engines)
            self.planted = self.llm.collective_rpc(plant_cache_bugs, kwargs={"bugs": list(bugs)})[0]
        self.vocab_size = int(info["vocab_size"])
        sched = self.llm.llm_engine.engine_core.engine_core.scheduler
        preempt = sched._preempt_request

        def counted(*args, **kwargs):
            sched._cc_preemptions = getattr(sched, "_cc_preemptions", 0) + 1
            return preempt(*args, **kwargs)

        sched._preempt_request = counted  # counts preemptions: the preempt scenario says how many it forced
        self.name = (f"vllm[bs={block_size},prefix_caching={'on' if prefix_caching else 'off'},"
                     f"chunk={chunk or 'off'},blocks={self.num_blocks}" + (f",bugs={'+'.join(bugs)}" if bugs else "") + "]")
        self._ids = 0

    # ------------------------------------------------------------------ the reference

    def full_logits(self, seqs):
        """Every position of each sequence from its whole prefix: one prefill each, no cache reuse.
        A sequence filling the whole context has no row for its last position (NaN): vLLM must
        sample one token more than it holds, and no scenario judges that position."""
        from vllm import SamplingParams

        from extractors.vllm_logits import take_vllm_request_logits

        feed = [list(map(int, s))[: self.max_context - 1] for s in seqs]
        params = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, prompt_logprobs=0,
                                 extra_args={_CAP: {"from": 1, "to": len(f) + 1}}) for f in feed]
        outs = self.ref.generate([{"prompt_token_ids": f} for f in feed], params, use_tqdm=False)
        logits, _, positions = take_vllm_request_logits(self.ref, [o.request_id for o in outs])
        res = []
        for s, f, lg, pos in zip(seqs, feed, logits, positions):
            if pos != list(range(1, len(f) + 1)):
                raise RuntimeError(f"vLLM reference: rows for {pos[:3]}..{len(pos)}, expected 1..{len(f)}")
            rows = lg.float().numpy()
            if len(f) < len(s):
                rows = np.concatenate([rows, np.full((len(s) - len(f), rows.shape[1]), np.nan, np.float32)])
            res.append(rows)
        return res

    # ------------------------------------------------------------------ patterns

    def supports(self, op: str) -> bool:
        return op == "run"

    def scenario_table(self) -> dict:
        """This adapter's scenarios (request patterns) instead of the step-level ones."""
        return vllm_scenarios()

    def reset(self):
        """Nothing to do between scenarios: finished requests free their blocks (the prefix cache
        keeps what it may, as it would in service)."""

    def run(self, reqs: list) -> dict:
        """Drive the engine through the pattern ``reqs`` (``VReq``s); -> {name: [VOut per branch]}."""
        eng = self.llm.llm_engine
        pending = list(reqs)
        live: dict = {}  # engine request id -> (VReq, submitted step)
        done: set = set()
        outputs: dict = {}  # (rid, branch) -> (token ids, finish reason, cached)
        try:
            return self._drive(eng, pending, live, done, outputs)
        except BaseException:
            ids = [rid if r.n == 1 else f"{b}_{rid}" for rid, (r, _) in live.items() for b in range(r.n)]
            eng.abort_request(list(live) + ids)  # leave the engine empty for the next scenario
            raise

    def _drive(self, eng, pending, live, done, outputs) -> dict:
        from extractors.vllm_logits import take_vllm_request_logits

        sched = eng.engine_core.engine_core.scheduler
        chunked: set = set()
        step = 0
        while pending or eng.has_unfinished_requests():
            for r in list(pending):
                if (r.after is None and r.at <= step) or (r.after is not None and r.after in done):
                    rid = f"cc{self._ids}"
                    self._ids += 1
                    eng.add_request(rid, {"prompt_token_ids": list(map(int, r.prompt))}, _sampling(r, self.max_context))
                    live[rid] = (r, step)
                    pending.remove(r)
            for rid, (r, t0) in list(live.items()):
                if r.abort_at is not None and step - t0 >= r.abort_at and r.name not in done:
                    eng.abort_request([rid])
                    done.add(r.name)
                    for b in range(r.n):
                        key = (rid, b)
                        toks, _, cached = outputs.get(key, ([], None, 0))
                        outputs[key] = (toks, "abort", cached)
            if not eng.has_unfinished_requests():
                if pending and not any(r.after is None for r in pending) and not any(r.after in done for r in pending):
                    raise RuntimeError(f"vLLM pattern: requests {[r.name for r in pending]} wait for ones never run")
                step += 1
                continue
            stepped = eng.step()
            for q in sched.requests.values():  # a prompt computed in parts: chunked prefill
                if 0 < q.num_computed_tokens < q.num_prompt_tokens:
                    chunked.add(q.request_id.rsplit("-", 1)[0].split("_", 1)[-1])
            for o in stepped:
                r = live[o.request_id][0]
                for c in o.outputs:
                    b = c.index if r.n > 1 else 0
                    if outputs.get((o.request_id, b), (None, None))[1] == "abort":
                        continue
                    outputs[(o.request_id, b)] = (list(c.token_ids), c.finish_reason, int(o.num_cached_tokens or 0))
                if o.finished:
                    done.add(r.name)
            step += 1
            if step > 10_000:
                raise RuntimeError("vLLM pattern: the engine did not finish in 10000 steps")
        result: dict = {}
        for rid, (r, t0) in live.items():
            ids = [rid] if r.n == 1 else [f"{b}_{rid}" for b in range(r.n)]
            logits, _, positions = take_vllm_request_logits(self.llm, ids)
            for b, (lg, pos) in enumerate(zip(logits, positions)):
                toks, finish, cached = outputs.get((rid, b), ([], None, 0))
                # the row predicting token index i is the logits at position i - 1; a row exists for
                # every token fed after the prompt and for the last (sampled, not fed) one
                fed = list(r.prompt) + toks
                keep = [i for i, p in enumerate(pos) if p - 1 < len(fed)]
                rows = lg.float().numpy()
                result.setdefault(r.name, []).append(VOut(
                    r.name if r.n == 1 else f"{r.name}/branch{b}", fed, len(r.prompt), [pos[i] - 1 for i in keep],
                    [rows[i] for i in keep], finish, cached, t0, {"chunked": rid in chunked}))
        return result

    def close(self):
        from extractors.vllm_rpc import close_llm

        for llm in (getattr(self, "llm", None), getattr(self, "ref", None)):
            if llm is not None:
                close_llm(llm)
        self.llm = self.ref = None
        gc.collect()

    def prefill(self, prompts, chunk_size=None):  # the step-level session is not vLLM's
        raise NotSupported("vLLM is driven by request patterns (VllmCacheAdapter.run)")


# ---------------------------------------------------------------------- scenarios


def _seq(s, out: VOut, kind: str, segments=None):
    from capturestore.cachecheck import ScenarioSeq

    return ScenarioSeq(out.name, list(out.tokens), segments or [(0, kind)], list(out.positions), list(out.logits),
                prompt_len=out.prompt_len)


def _emit(s, outs: dict, kinds: dict | None = None, hits: bool = True):
    """Record every branch of ``outs`` with its history kinds. The engine decides two histories
    itself: a prompt it prefilled in several steps is ``chunk``, one that hit the prefix cache is
    ``offset`` (a continued prefix) unless ``hits`` is False (a fork, whose sharing is the hit)."""
    for name, branches in outs.items():
        for o in branches:
            k = (kinds or {}).get(name, "single")
            seg = k if isinstance(k, list) else [(0, k)]
            if o.extra.get("chunked"):
                seg = [(0, "chunk")]
            elif any(x == "chunk" for _, x in seg):  # prefilled whole after all: no chunk history
                seg = [(p, "batch" if x == "chunk" else x) for p, x in seg]
            elif hits and o.cached_tokens:
                seg = [(0, "offset")]
            s.done.append(_seq(s, o, seg[0][1], seg))
    return outs


def _v_single(s):
    _emit(s, s.a.run([VReq("r0", s.prompt(11), 8)]))


def _v_prefix_hit(s):
    bs = s.a.block_size
    base = s.prompt(2 * bs + 5)
    reqs = [VReq("warm", base, 2, kind="batch")]
    for k in sorted({bs - 1, bs, bs + 1, 2 * bs}):
        reqs.append(VReq(f"shared{k}", base[:k] + s.prompt(5), 3, kind="offset", after="warm"))
    outs = s.a.run(reqs)
    _emit(s, outs, {r.name: r.kind for r in reqs})
    s.notes.append("prefix-cache hits (tokens): " + ", ".join(f"{n}={o[0].cached_tokens}" for n, o in outs.items()))


def _v_batch(n):
    def run(s):
        from capturestore.cachecheck import ragged_prompts

        bs = s.a.block_size
        prompts = ragged_prompts(s, n, 2, 2 * bs + 3)
        reqs = [VReq(f"b{i}/len{len(p)}", p, 6, kind="batch") for i, p in enumerate(prompts)]
        _emit(s, s.a.run(reqs), {r.name: "batch" for r in reqs})
    return run


def _v_invariance(s):
    from capturestore.cachecheck import ragged_prompts, ScenarioSeq

    bs = s.a.block_size
    r = s.prompt(bs + 3)
    alone = s.a.run([VReq("alone", r, 6)])["alone"][0]
    comp = ragged_prompts(s, 5, 2, 2 * bs + 3)
    reqs = [VReq(f"c{i}", p, 6, kind="batch") for i, p in enumerate(comp[:2])] + [VReq("batched", r, 6, kind="batch")] + \
        [VReq(f"c{i}", p, 6, kind="batch") for i, p in enumerate(comp[2:], 2)]
    outs = s.a.run(reqs)
    batched = outs["batched"][0]
    _emit(s, {"alone": [alone]}, {"alone": "single"})
    _emit(s, outs, {q.name: "batch" for q in reqs})
    same = dict(zip(alone.positions, alone.logits))
    pos = [p for p in batched.positions if p in same]
    s.done.append(ScenarioSeq("batched-vs-alone", list(batched.tokens), [(0, "invariance")], pos,
                       [batched.logits[batched.positions.index(p)] for p in pos], reference={p: same[p] for p in pos}))


def _v_compaction(s):
    from capturestore.cachecheck import ragged_prompts

    bs = s.a.block_size
    prompts = ragged_prompts(s, 5, 3, 2 * bs + 3)
    caps = [8, 2, 8, 4, 8]  # a middle row finishes first, then another: the batch is compacted twice
    reqs = [VReq(f"r{i}/len{len(p)}/max{c}", p, c) for i, (p, c) in enumerate(zip(prompts, caps))]
    # a survivor's positions after the first row finished (its own 2nd decoded token on) are "compaction"
    kinds = {q.name: [(0, "batch"), (len(q.prompt) + 2, "compaction")] for q in reqs}
    _emit(s, s.a.run(reqs), kinds)


def _v_reuse(s):
    bs = s.a.block_size
    reqs = [VReq("long", s.prompt(2 * bs + 2), 4, kind="batch"), VReq("companion", s.prompt(5), 10, kind="batch"),
            VReq("new-in-freed", s.prompt(3), 6, kind="reuse", after="long")]
    _emit(s, s.a.run(reqs), {q.name: q.kind for q in reqs})


def _v_cancel(s):
    bs = s.a.block_size
    reqs = [VReq("survivor", s.prompt(bs + 2), 10, kind="batch"),
            VReq("aborted", s.prompt(2 * bs - 1), 20, kind="batch", abort_at=4),
            VReq("new-after-abort", s.prompt(4), 5, kind="cancel", after="aborted")]
    outs = s.a.run(reqs)
    if outs["aborted"][0].finish != "abort":
        raise RuntimeError(f"cancel: the request finished ({outs['aborted'][0].finish}) before its abort")
    _emit(s, outs, {q.name: q.kind for q in reqs})


def _v_fork(s):
    bs = s.a.block_size
    reqs = []
    for plen in (bs + 5, 2 * bs):  # a mid-block and a block-aligned prefix, 3 sampled branches each
        p = s.prompt(plen)
        # no per-request seed: vLLM's CPU sampler refuses a seeded generator across a chunked prefill
        reqs.append(VReq(f"n3/p{plen}", p, 6, n=3, temperature=1.0))
    system = s.prompt(2 * bs + 3)  # a shared system prompt, continued three ways together
    reqs += [VReq(f"system/q{i}", system + s.prompt(2 + i), 4) for i in range(3)]
    _emit(s, s.a.run(reqs), {q.name: "fork" for q in reqs}, hits=False)


def _v_chunk_mixed(s):
    bs = s.a.block_size
    reqs = [VReq("decoding0", s.prompt(5), 12, kind="batch"), VReq("decoding1", s.prompt(9), 12, kind="batch"),
            VReq("long-prompt", s.prompt(3 * bs + 3), 4, kind="chunk", at=2)]
    _emit(s, s.a.run(reqs), {q.name: q.kind for q in reqs})


def _v_preempt(s):
    a = s.a
    bs = a.block_size
    plen = bs + 1
    n = a.max_batch
    need = n * -(-(plen + 2 * bs) // bs)
    if need <= a.num_blocks:
        raise NotSupported(f"the KV budget ({a.num_blocks} blocks) holds this scenario's {need} blocks: start the "
                           "engine with fewer blocks (num_blocks) to force preemption")
    reqs = [VReq(f"p{i}", s.prompt(plen), 2 * bs - 1, kind="preempt") for i in range(n)]
    before = _preemptions(a)
    _emit(s, a.run(reqs), {q.name: "preempt" for q in reqs})
    s.notes.append(f"preemptions: {_preemptions(a) - before}")


def _preemptions(a) -> int:
    sched = a.llm.llm_engine.engine_core.engine_core.scheduler
    return int(getattr(sched, "_cc_preemptions", 0))


def _long_len(a) -> int:
    return max(3 * a.block_size, 64)  # three blocks at least (4 bs at 128 would not fit a 512 context)


def _v_long(s):
    _emit(s, s.a.run([VReq("long", s.prompt(_long_len(s.a)), 8, kind="long")]), {"long": "long"})


def _v_overflow(s):
    from capturestore.cachecheck import ScenarioCheck

    n = s.a.max_context
    outs = s.a.run([VReq("to-limit", s.prompt(n - 2), 10, kind="overflow")])
    o = outs["to-limit"][0]
    _emit(s, outs, {"to-limit": "overflow"})
    fed = len(o.tokens)
    s.checks.append(ScenarioCheck("stopped-at-limit", "overflow", fed, fed == n and o.finish == "length",
                           f"{fed} tokens (context {n}), finish reason {o.finish}"))
    try:
        s.a.run([VReq("past-limit", s.prompt(n + 1), 1, kind="overflow")])
    except Exception as e:  # noqa: BLE001 - any clear error passes; the message is kept
        s.checks.append(ScenarioCheck("prompt-past-limit", "overflow", n, True, f"refused: {type(e).__name__}: {str(e)[:160]}"))
    else:
        s.checks.append(ScenarioCheck("prompt-past-limit", "overflow", n, False,
                               f"a prompt of {n + 1} tokens (context {n}) ran without an error"))


def _v_truncate(s):
    raise NotSupported("vLLM has no operation that cuts a live request's cache back to k tokens")


def vllm_scenarios() -> dict:
    from capturestore.cachecheck import Scenario

    need = ("run",)
    bs = lambda a: a.block_size
    out = [Scenario("single", "single", need, _v_single, lambda a: 19),
           Scenario("prefix_hit", "offset", need, _v_prefix_hit, lambda a: 2 * bs(a) + 8)]
    out += [Scenario(f"batch_{n}", "batch", need, _v_batch(n), lambda a: 2 * bs(a) + 9) for n in (2, 3, 5, 8)]
    out += [Scenario("invariance", "invariance", need, _v_invariance, lambda a: 2 * bs(a) + 9),
            Scenario("compaction", "compaction", need, _v_compaction, lambda a: 2 * bs(a) + 11),
            Scenario("reuse", "reuse", need, _v_reuse, lambda a: 2 * bs(a) + 6),
            Scenario("cancel", "cancel", need, _v_cancel, lambda a: 2 * bs(a) + 19),
            Scenario("truncate", "truncate", need, _v_truncate),
            Scenario("fork", "fork", need, _v_fork, lambda a: 2 * bs(a) + 9),
            Scenario("chunk_mixed", "chunk", need, _v_chunk_mixed, lambda a: 3 * bs(a) + 7),
            Scenario("preempt", "preempt", need, _v_preempt, lambda a: 3 * bs(a)),
            Scenario("long", "long", need, _v_long, lambda a: _long_len(a) + 8),
            Scenario("overflow", "overflow", need, _v_overflow, lambda a: a.max_context)]
    return {x.name: x for x in out}


# ---------------------------------------------------------------------- planted bugs (worker side)


def plant_cache_bugs(worker, bugs) -> list:
    """Install ``bugs`` on ``worker``'s model runner (called on the worker: ``collective_rpc``).
    Both act after ``_prepare_inputs``, where the runner has placed this step's positions, slot
    mapping and block tables, before the forward."""
    runner = worker.model_runner
    bugs = set(bugs)
    first: dict = {}  # request -> tokens computed when first scheduled (a prefix hit is not a chunk)
    prepare = runner._prepare_inputs

    def prepare_with_bugs(scheduler_output, *args, **kwargs):
        out = prepare(scheduler_output, *args, **kwargs)
        if "chunk_pos_off_by_one" in bugs:
            _shift_chunk_positions(runner, scheduler_output, first)
        if "stale_prefix_block" in bugs:
            _stale_prefix(runner, scheduler_output)
        return out

    runner._prepare_inputs = prepare_with_bugs
    return sorted(bugs)


def _shift_chunk_positions(runner, so, first: dict) -> None:
    """Positions of a prefill chunk after a request's first one: one too high (RoPE only; the
    slots were computed from the right positions before)."""
    batch = runner.input_batch
    for new in so.scheduled_new_reqs:
        first[new.req_id] = int(new.num_computed_tokens)
    for req_id, n in so.num_scheduled_tokens.items():
        req = runner.requests.get(req_id)
        i = batch.req_id_to_index.get(req_id)
        if req is None or i is None:
            continue
        computed = int(batch.num_computed_tokens_cpu[i])
        if computed < len(req.prompt_token_ids) and computed != first.get(req_id, 0):
            lo = int(runner.query_start_loc.np[i])
            runner.positions[lo:lo + n] += 1


def _stale_prefix(runner, so) -> None:
    """A new request whose prompt hit the prefix cache: its last hit block is overwritten with
    the contents of a neighbouring block of the pool (another request's data), as a reused slot
    not cleared would leave it."""
    import torch

    bs = runner.cache_config.block_size
    for new in so.scheduled_new_reqs:
        nb = int(new.num_computed_tokens) // bs
        if nb < 1:
            continue
        hit = new.block_ids[0][nb - 1]
        src = hit - 1 if hit > 1 else hit + 1
        with torch.no_grad():
            for kv in runner.kv_caches:
                kv[hit].copy_(kv[src])
