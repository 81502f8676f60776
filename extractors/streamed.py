"""Layer-streamed HF references: a model larger than memory run one decoder layer at a time.

The model is a skeleton whose parameters live on the meta device (buffers such as the rotary
``inv_freq`` are computed as ``from_pretrained`` computes them: real, on the compute device).
Its weights come from the checkpoint's safetensors one *unit* at a time: the embedding, each
decoder layer, then the final norm with the LM head. The forward that runs is the model's own
``forward`` (``extractors.hf`` / ``extractors.modules`` functions, unchanged), so masks, rotary
embeddings, sliding windows, soft-capping and every architecture detail are built by the very
code a whole-model reference runs: on one device and dtype a streamed reference is
**bit-identical** to the whole-model one (``tests/extractors/test_streamed.py`` pins it, max
abs difference 0, on every tiny architecture).

How one pass over the weights serves a whole group of prompts: each prompt's capture runs in its
own worker thread; a pre-forward hook on every unit blocks the worker until that unit's weights
are loaded and it is the worker's turn. The coordinator loads unit ``u``, lets every worker that
is waiting for ``u`` run it (one worker at a time: no two forwards run at once), then frees ``u``
(its parameters go back to the meta device) and installs ``u + 1``, which a thread of its own read
while ``u`` computed wherever the plan holds both units (prefetch; its casts start no OpenMP team,
so the forwards' threading is untouched). A teacher-forced capture is one forward: its weights are read once per group.
A greedy capture is one forward per generated token (prefill + ``num_tokens`` decode steps, as
``generate_hf_logits_and_kv`` runs them), so its weights are read ``num_tokens + 1`` times per
group (docs/references.md measures what this costs).

Weights are read with plain file reads (no mmap, so the page cache never counts in the process's
RSS), in chunks converted into a preallocated tensor of the parameter's dtype with ``copy_``:
the same elementwise cast ``from_pretrained`` applies with ``tensor.to(dtype)`` (round to
nearest even), bit for bit. The checkpoint (one ``model.safetensors`` or shards with
``model.safetensors.index.json``) is checked against the skeleton before anything runs:
:class:`CheckpointError` names the file and the tensor of a missing, unexpected, misplaced,
mis-shaped or mis-typed tensor.

torch and transformers are imported lazily.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CheckpointError",
    "MemoryBudgetError",
    "Checkpoint",
    "StreamedModel",
    "per_expert_checkpoint",
    "ReferencePlan",
    "plan_reference",
    "available_memory",
    "run_streamed",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GiB = 1 << 30
# safetensors dtype codes -> (torch dtype name, bytes per element)
_ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
              "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
              "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}
_PAGE = 4096  # mmap granularity: a mmapped tensor's address modulo it is its file offset's
_READ_CHUNK = 4 << 20  # bytes read (and converted) at a time: bounds the transient copy (4 MiB: 2.5x faster
# than 64 MiB for a BF16 -> FP32 copy_, the chunk still in cache; 60 MiB less beside a prefetch)
READERS = 4  # at most this many threads read one unit's tensors at once (StreamedModel.read_unit)
CPUS_PER_READER = 4  # on the CPU one reading thread per this many usable CPUs (the forward needs the rest)
_SERIAL_GRAIN = 32768  # at::internal::GRAIN_SIZE: an elementwise op on fewer elements runs serially


class CheckpointError(ValueError):
    """A checkpoint whose files, index and model disagree (names the file and the tensor)."""


class MemoryBudgetError(ValueError):
    """A memory budget too small for one unit (layer) of the model (says what one needs)."""


# ----------------------------------------------------------------------------------------------
# the checkpoint: headers only, checked before anything runs


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: ``file``, absolute byte ``offset``, ``nbytes``; its safetensors
    ``dtype`` code (``BF16``, ``F32``, ...) and ``shape``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def safetensors_torch_dtype(code: str) -> str:
    """torch dtype name of a safetensors dtype code (``BF16`` -> ``bfloat16``)."""
    return _ST_DTYPES[code][0]


def read_safetensors_header(path) -> dict[str, "TensorEntry"]:
    """``{name: TensorEntry}`` of one safetensors file, from its header alone (``CheckpointError``
    for a header that does not describe the file)."""
    return _read_header(Path(path))


def _read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (a, b) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name}: dtype {dtype} not supported")
        numel = 1
        for s in shape:
            numel *= s
        if b - a != numel * _ST_DTYPES[dtype][1]:
            raise CheckpointError(f"{path}: tensor {name}: {b - a} bytes stored for shape {list(shape)} {dtype}")
        if base + b > size:
            raise CheckpointError(f"{path}: tensor {name}: its bytes end at {base + b}, past the end of the file "
                                  f"({size} bytes; truncated?)")
        out[name] = TensorEntry(name, path, dtype, shape, base + a, b - a)
    return out


class Checkpoint:
    """The tensors of a safetensors checkpoint directory (``model.safetensors``, or the shards
    named by ``model.safetensors.index.json``), read from headers; :meth:`read` reads one."""

    def __init__(self, path):
        self.path = Path(path)
        self._local = threading.local()  # each reading thread's staging buffers (_read_staged)
        index = self.path / INDEX_FILE
        self.entries: dict[str, TensorEntry] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: no readable weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
            headers = {}
            for fn in files:
                f = self.path / fn
                if not f.exists():
                    names = sorted(k for k, v in weight_map.items() if v == fn)
                    raise CheckpointError(f"{index}: names shard {fn} (for {names[0]}{' and others' if len(names) > 1 else ''}), "
                                          f"which does not exist")
                headers[fn] = _read_header(f)
            for name, fn in sorted(weight_map.items()):
                if name not in headers[fn]:
                    raise CheckpointError(f"{self.path / fn}: lacks tensor {name}, which {INDEX_FILE} places there")
                self.entries[name] = headers[fn][name]
            for fn, hdr in headers.items():
                for name in sorted(hdr):
                    if name not in weight_map:
                        raise CheckpointError(f"{self.path / fn}: holds tensor {name}, which {INDEX_FILE} does not list")
                    if weight_map[name] != fn:
                        raise CheckpointError(f"{self.path / fn}: holds tensor {name}, which {INDEX_FILE} places in "
                                              f"{weight_map[name]}")
            for extra in sorted(set(p.name for p in self.path.glob("*.safetensors")) - set(files)):
                raise CheckpointError(f"{self.path / extra}: a safetensors file {INDEX_FILE} does not name")
        elif (self.path / SINGLE_FILE).exists():
            self.entries = _read_header(self.path / SINGLE_FILE)
        else:
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} and no {INDEX_FILE} (streamed references read "
                                  f"safetensors checkpoints)")

    def check(self, expected: dict, dtype: str | None, tied: dict[str, str], ignored=()) -> None:
        """Refuse (``CheckpointError``, naming file and tensor) a tensor missing, unexpected, of
        another shape than ``expected`` (``{name: shape}``) or of a floating dtype other than
        ``dtype`` (the checkpoint's own, ``config.json``'s ``dtype``; None: the first tensor's).
        ``tied``: ``{name: source}`` parameters the checkpoint may omit (read from ``source``).
        ``ignored``: regular expressions of tensors ``from_pretrained`` itself skips without a word
        (old checkpoints' ``rotary_emb.inv_freq``, the model's ``_keys_to_ignore_on_load_unexpected``)."""
        import re

        skip = [re.compile(p) for p in ignored]
        where = lambda name: self.entries[name].file  # noqa: E731
        for name in sorted(expected):
            if name not in self.entries and not (name in tied and tied[name] in self.entries):
                raise CheckpointError(f"{self.path}: tensor {name} is missing (the model has it, no file holds it)")
        allowed = set(expected)
        for name in sorted(self.entries):
            if name not in allowed and any(p.search(name) for p in skip):
                continue
            if name not in allowed:
                raise CheckpointError(f"{where(name)}: tensor {name} is unexpected (the model has no such parameter)")
            want, got = tuple(expected[name]), self.entries[name].shape
            if want != got:
                raise CheckpointError(f"{where(name)}: tensor {name} has shape {list(got)}, the model's is {list(want)}")
        floats = {n: e.dtype for n, e in self.entries.items() if e.dtype.startswith(("F", "BF")) and n in allowed}
        if floats:
            ref = dtype or _ST_DTYPES[floats[min(floats)]][0]
            for name in sorted(floats):
                if _ST_DTYPES[floats[name]][0] != ref:
                    raise CheckpointError(f"{where(name)}: tensor {name} is {_ST_DTYPES[floats[name]][0]}, the "
                                          f"checkpoint's dtype is {ref}")

    def read(self, name: str, dtype, device="cpu", background: bool = False, pool=None, staged: bool | None = None):
        """Tensor ``name`` as ``dtype`` on ``device``: read in chunks, each cast with ``copy_``
        (``tensor.to(dtype)``'s cast), into one preallocated tensor.

        pool: a :class:`_BufferPool` of freed weights' memory to read into instead of a fresh
        allocation (CPU): fresh pages cost a fault each (~1 GB/s here), reused ones nothing.

        background: the read runs beside a forward (a prefetch), so its cast must not start an
        OpenMP team of its own (two teams on the forward's cores: under load each spins for the
        other's cores). BF16 -> FP32, the usual cast, is then the exact widening it is (the 16
        bits shifted into the high half: what torch's scalar and vector casts do, NaN payloads
        included) in numpy, which runs it on this thread alone and releases the GIL; any other cast
        is ``copy_`` in pieces below ATen's parallel grain (32,768 elements), which run serially.

        staged: read through :meth:`_read_staged` (default: on any device but the CPU)."""
        import numpy as np
        import torch

        e = self.entries[name]
        src_dtype = getattr(torch, _ST_DTYPES[e.dtype][0])
        if staged if staged is not None else str(device) != "cpu":
            return self._read_staged(e, name, src_dtype, dtype, device)
        if src_dtype == dtype:
            # from_pretrained keeps such a tensor where safetensors mmaps it: at its file offset
            # modulo the page. Kernels' results depend on alignment (an FP32 GEMV differs by
            # rounding between a 64-byte and a 40-mod-64 weight), so this copy sits at the same
            # address modulo the page as the whole-model one.
            key = self.buffer_key(name, dtype, device)
            raw = pool.take(key) if pool is not None else None
            raw = torch.empty(e.nbytes + _PAGE, dtype=torch.uint8) if raw is None else raw
            start = (e.offset - raw.data_ptr()) % _PAGE
            out = raw[start:start + e.nbytes].view(dtype).view(e.shape)
            buffer = raw
        else:
            key = self.buffer_key(name, dtype, device)
            out = pool.take(key) if pool is not None else None
            out = torch.empty(e.shape, dtype=dtype) if out is None else out
            buffer = out
        if pool is not None:
            pool.lend(out, key, buffer)
        flat = out.view(-1)
        itemsize = _ST_DTYPES[e.dtype][1]
        per = max(1, _READ_CHUNK // itemsize)
        numel = flat.numel()
        with open(e.file, "rb", buffering=0) as f:
            f.seek(e.offset)
            if src_dtype == dtype:
                view = memoryview(flat.view(torch.uint8).numpy()) if numel else memoryview(b"")
                got = 0
                while got < e.nbytes:
                    n = f.readinto(view[got:min(e.nbytes, got + _READ_CHUNK)])
                    if not n:
                        raise CheckpointError(f"{e.file}: tensor {name}: file ended after {got} of {e.nbytes} bytes")
                    got += n
            else:
                buf = torch.empty(min(per, numel), dtype=src_dtype)
                bview = memoryview(buf.view(torch.uint8).numpy()) if numel else memoryview(b"")
                widen = background and src_dtype == torch.bfloat16 and dtype == torch.float32
                if widen:
                    src16 = buf.view(torch.int16).numpy().view(np.uint16)
                    dst32 = flat.view(torch.int32).numpy().view(np.uint32)
                for a in range(0, numel, per):
                    k = min(per, numel - a)
                    _fill(f, bview, k * itemsize, e, name)
                    if widen:
                        np.left_shift(src16[:k], 16, out=dst32[a:a + k], dtype=np.uint32)
                    elif background:
                        for b in range(0, k, _SERIAL_GRAIN):
                            c = min(_SERIAL_GRAIN, k - b)
                            flat[a + b:a + b + c].copy_(buf[b:b + c])
                    else:
                        flat[a:a + k].copy_(buf[:k])
        return out if str(device) == "cpu" else out.to(device)

    def _read_staged(self, e: TensorEntry, name: str, src_dtype, dtype, device):
        """:meth:`read` onto a device (CUDA): the file's bytes, chunk by chunk, into one of two
        pinned host buffers, each chunk copied to the device without blocking while the next is
        read, and cast there (a non-blocking copy converts on the device: BF16 -> FP32 is the exact
        widening it is on the CPU, FP32 -> BF16 the same round to nearest even). Everything runs on
        the device's default stream (no thread here sets another), in order with the forwards and
        the freeing of the unit before: the forwards must run on it too (a forward under
        ``torch.cuda.stream(s)`` would not be ordered with a read into memory it still uses).

        Before this, each weight went through a fresh pageable host tensor of the target dtype and
        a blocking copy: 13.4 GB of new host pages per pass over a 3.6 B model in FP32, 10.8 s a
        pass on an H200 machine where the whole model ran the same five passes in 0.78 s in all
        (docs/references.md)."""
        import contextlib

        import torch

        dev = torch.device(device)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            # the device's current stream, not device 0's: the copies, the events and the forwards
            # are then in one order on it, whichever thread reads
            return self._read_chunks(e, name, src_dtype, dtype, device)

    def _read_chunks(self, e: TensorEntry, name: str, src_dtype, dtype, device):
        import torch

        out = torch.empty(e.shape, dtype=dtype, device=device)
        flat = out.view(-1)
        numel = flat.numel()
        itemsize = _ST_DTYPES[e.dtype][1]
        per = max(1, _READ_CHUNK // itemsize)
        stages = self._stages(device)
        with open(e.file, "rb", buffering=0) as f:
            f.seek(e.offset)
            for i, a in enumerate(range(0, numel, per)):
                k = min(per, numel - a)
                buf, copied = stages[i % 2]
                if copied is not None:
                    copied.synchronize()  # the copy that last read this buffer is done
                need = k * itemsize
                _fill(f, memoryview(buf.numpy()), need, e, name)
                flat[a:a + k].copy_(buf[:need].view(src_dtype), non_blocking=True)
                if copied is not None:
                    copied.record()
        for _, copied in stages:
            if copied is not None:
                copied.synchronize()
        return out

    def _stages(self, device) -> list:
        """This thread's two staging buffers for ``device``: ``(pinned uint8 host tensor of
        _READ_CHUNK bytes, CUDA event of its last copy)``; on the CPU (tests) plain memory, no event."""
        import torch

        mine = self._local.__dict__.setdefault("stages", {})
        key = (str(device), _READ_CHUNK)
        if key not in mine:
            cuda = torch.device(device).type == "cuda"
            mine[key] = [(torch.empty(_READ_CHUNK, dtype=torch.uint8, pin_memory=cuda),
                          torch.cuda.Event() if cuda else None) for _ in range(2)]
        return mine[key]

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def buffer_key(self, name: str, dtype, device="cpu") -> tuple:
        """What memory :meth:`read` of ``name`` as ``dtype`` needs, as a :class:`_BufferPool` key."""
        import torch

        e = self.entries[name]
        if getattr(torch, _ST_DTYPES[e.dtype][0]) == dtype and str(device) == "cpu":
            return ("raw", e.nbytes + _PAGE)
        return ("tensor", e.shape, dtype)


# ----------------------------------------------------------------------------------------------
# the skeleton


def _torch_dtype(dtype: str):
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"streamed reference: dtype {dtype!r} not one of {sorted(dtypes)}")
    return dtypes[dtype]


@dataclass
class Unit:
    """One streamed piece of the model: ``name``, its ``modules`` (``(name, module)``; hooks on
    the first's entry and the last's exit) and its parameters ``{full name: (module, attr)}``."""

    name: str
    modules: list
    params: dict


class StreamedModel:
    """A causal LM of checkpoint ``path`` whose weights live in the checkpoint, one unit at a time.

    ``model``: the skeleton, a ``transformers`` model in ``dtype`` with eager attention, used as a
    whole model is (``extract_hf_kv_caches_teacher_forced(sm.model, ...)``), but only inside
    :func:`run_streamed`, which loads each unit as the forwards reach it.
    """

    def __init__(self, path, dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path, self.dtype, self.device = Path(path), dtype, str(device)
        if torch.device(self.device).type == "cuda" and torch.device(self.device).index is None:
            # the index now: reader threads would take theirs (device 0), not this thread's
            self.device = f"cuda:{torch.cuda.current_device()}"
        self.checkpoint = Checkpoint(path)
        config = AutoConfig.from_pretrained(str(path))
        # As from_pretrained builds it: every tensor on meta, then the non-persistent buffers
        # (rotary inv_freq, Gemma's embed_scale) made real on the device and set by the model's own
        # initialize_weights; parameters are flagged initialised, so they stay on meta.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype), attn_implementation="eager")
        for p in model.parameters():
            p._is_hf_initialized = True
        for key, buf in list(model.named_non_persistent_buffers()):
            owner, _, attr = key.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = torch.empty_like(buf, device=self.device)
        model.initialize_weights()
        self.model = model.eval()
        self.model._capture_device = torch.device(self.device)
        self.units = self._units()
        expected = {n: tuple(p.shape) for n, p in self._named_params().items()}
        self.tied = self._tied()  # parameters the checkpoint may omit: read from their source
        raw = json.loads((self.path / "config.json").read_text())  # the checkpoint's own dtype, as written
        raw = raw.get("text_config", raw) if "dtype" not in raw and "torch_dtype" not in raw else raw
        cfg_dtype = raw.get("dtype") or raw.get("torch_dtype")
        ignored = {r"rotary_emb\.inv_freq$", *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())}
        self.checkpoint.check(expected, str(cfg_dtype).removeprefix("torch.") if cfg_dtype else None, self.tied,
                              ignored)
        self.loads = 0  # units loaded so far (a teacher-forced group: one per unit)
        self.prefetched = 0  # of which read in the background while the unit before computed
        self.bytes_read = 0
        # units i whose successor i + 1 may be read while i computes (both resident then): all
        # here; prepare_reference keeps those whose pair fits the memory budget (ReferencePlan)
        self.prefetch = frozenset(range(len(self.units) - 1))
        self.pool = _BufferPool()  # freed units' memory, reused by the next unit's reads
        # a device's weights are staged through pinned host buffers (Checkpoint._read_staged), a
        # unit's tensors by up to READERS threads at once; the CPU's read into the pool, by one
        # thread per CPUS_PER_READER usable CPUs (one on 2-7 CPUs: the forward needs its cores)
        self.staged = self.device != "cpu"
        cpus = usable_cpus()
        self.readers = max(1, min(READERS, cpus if self.staged else cpus // CPUS_PER_READER))
        self._readers_pool = None
        self._readers_lock = threading.Lock()
        self._lent = {}  # (id(module), attr) -> the weight tensor installed there
        self.streaming = False
        self.units[0].modules[0][1].register_forward_pre_hook(self._outside)

    def _outside(self, module, args):
        if not self.streaming:
            raise RuntimeError(f"streamed model {self.path}: a forward ran outside run_streamed (its weights are "
                               f"on the meta device until run_streamed loads them)")

    def _named_params(self) -> dict:
        out = {}
        for mname, mod in self.model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                out[f"{mname}.{pname}" if mname else pname] = p
        return out

    def _tied(self) -> dict[str, str]:
        """``{parameter: checkpoint tensor}`` for tied weights the checkpoint omits (lm_head)."""
        cfg = self.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if not getattr(text, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)):
            return {}
        keys = getattr(self.model, "_tied_weights_keys", None) or {}
        if isinstance(keys, dict):
            return {k: v for k, v in keys.items() if k not in self.checkpoint.entries}
        return {}

    def _units(self) -> list[Unit]:
        m = self.model
        inner = m.model
        layers = inner.layers
        mods = dict(m.named_modules())
        name_of = {id(v): k for k, v in mods.items()}

        def unit(name, modules):
            params = {}
            for mod in modules:
                base = name_of[id(mod)]
                for sub_name, sub in mod.named_modules():
                    full = f"{base}.{sub_name}" if sub_name else base
                    for pname, _ in sub.named_parameters(recurse=False):
                        params[f"{full}.{pname}"] = (sub, pname)
            return Unit(name, [(name_of[id(x)], x) for x in modules], params)

        units = [unit(name_of[id(inner.embed_tokens)], [inner.embed_tokens])]
        units += [unit(name_of[id(layer)], [layer]) for layer in layers]
        units.append(unit(f"{name_of[id(inner.norm)]} + {name_of[id(m.lm_head)]}", [inner.norm, m.lm_head]))
        covered = {n for u in units for n in u.params}
        rest = sorted(set(self._named_params()) - covered)
        if rest:
            raise ValueError(f"streamed reference ({type(m).__name__}): parameters outside the streamed units "
                             f"(embedding, decoder layers, final norm + LM head): {rest[:5]}")
        return units

    def unit_nbytes(self, u: Unit) -> int:
        return sum(self._param(mod, attr).numel() * self._param(mod, attr).element_size()
                   for mod, attr in u.params.values())

    @staticmethod
    def _param(mod, attr):
        return mod._parameters[attr]

    def weights_nbytes(self) -> int:
        return sum(self.unit_nbytes(u) for u in self.units)

    def read_unit(self, u: Unit, background: bool = False) -> list:
        """``u``'s weights read from the checkpoint (not yet in the model): ``[(module, attr,
        tensor, bytes read)]``. ``background``: beside a forward (:meth:`Checkpoint.read`)."""
        srcs = {full: self.tied.get(full, full) if full not in self.checkpoint.entries else full for full in u.params}
        # what this unit cannot use goes before anything is allocated: never more than the plan
        self.pool.drop_unused([self.checkpoint.buffer_key(srcs[f], mod._parameters[a].dtype, self.device)
                               for f, (mod, a) in u.params.items()])
        items = list(u.params.items())
        threads = self.readers > 1 and len(items) > 1
        # on several threads each cast runs on its own thread (read's background form: numpy's
        # widening or copy_ below ATen's grain), never an OpenMP team per thread; the same bits
        serial = background or threads

        def one(item):
            full, (mod, attr) = item
            t = self.checkpoint.read(srcs[full], mod._parameters[attr].dtype, self.device, background=serial,
                                     pool=self.pool, staged=self.staged)
            return mod, attr, t, self.checkpoint.entries[srcs[full]].nbytes

        if threads:
            return list(self._reader_pool().map(one, items))
        return [one(item) for item in items]

    def _reader_pool(self):
        """Threads reading one unit's tensors at once (the reads and casts release the GIL; a
        staged read's thread has its own two staging buffers; the CPU's reads share the pool, which
        locks): one thread read 5.0 GB/s from the page cache on the H200 machine, where a pass over
        the weights is the read alone (docs/references.md)."""
        with self._readers_lock:
            if self._readers_pool is None:
                import weakref
                from concurrent.futures import ThreadPoolExecutor

                self._readers_pool = ThreadPoolExecutor(self.readers, thread_name_prefix="capturestore-read")
                weakref.finalize(self, self._readers_pool.shutdown, wait=False)  # its threads end with the model
        return self._readers_pool

    def install(self, tensors: list) -> None:
        """Put weights from :meth:`read_unit` into the model."""
        import torch.nn as nn

        for mod, attr, t, nbytes in tensors:
            # requires_grad as from_pretrained leaves it (True): torch's CPU BF16 linear takes
            # another kernel for a weight that requires no grad (AVX-512F, torch 2.13: other
            # rounding in the LM head, 6.8x slower), so a frozen weight is another reference
            mod._parameters[attr] = nn.Parameter(t, requires_grad=mod._parameters[attr].requires_grad)
            self._lent[id(mod), attr] = t
            self.bytes_read += nbytes
        self.loads += 1

    def load(self, u: Unit) -> None:
        self.install(self.read_unit(u))

    def free(self, u: Unit) -> None:
        """``u``'s parameters back to meta; their memory to the pool for the next read (or, where
        it was not the pool's, to the OS)."""
        import torch.nn as nn

        pooled = True
        for mod, attr in u.params.values():
            old = mod._parameters[attr]
            mod._parameters[attr] = nn.Parameter(old.to("meta"), requires_grad=old.requires_grad)
            t = self._lent.pop((id(mod), attr), None)
            pooled &= t is not None and self.pool.give_back(t)
        del old, t
        if not pooled and not self.staged:  # a staged unit freed device memory, nothing of the host's
            _release_freed_memory()


def _fill(f, view: memoryview, need: int, e: TensorEntry, name: str) -> None:
    """``view[:need]`` read from ``f`` (``readinto`` until it is full); CheckpointError where the
    file ends first."""
    got = 0
    while got < need:
        n = f.readinto(view[got:need])
        if not n:
            raise CheckpointError(f"{e.file}: tensor {name}: file ended early")
        got += n


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _release_freed_memory() -> None:
    """Hand the freed unit's pages back to the OS. glibc serves the unit's tensors of up to 32 MB
    (k/v projections) from its heaps, which it does not shrink while later allocations sit above
    them: without this, a greedy baseline's peak RSS grew pass after pass (5.4 GiB at a 2 GiB
    budget on a 3.6 B model after 9 passes; 2.2 GiB with every allocation over 1 MB mmapped)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


# ----------------------------------------------------------------------------------------------
# one pass over the weights for a group of workers


class _Aborted(BaseException):
    """Raised in a worker blocked on a unit when the coordinator gives up (another worker failed)."""


class _Worker:
    def __init__(self, fn: Callable, cond: threading.Condition):
        self.fn, self.cond = fn, cond
        self.want: int | None = None  # unit index the worker waits for
        self.granted = False
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        import torch

        # torch's grad and inference modes are per thread: the forward runs in the caller's, as a
        # whole-model forward on the caller's thread would (the weights require grad, as loaded)
        self.modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def _main(self):
        import torch

        try:
            with torch.inference_mode(self.modes[0]), torch.set_grad_enabled(self.modes[1]):
                self.result = self.fn()
        except _Aborted:
            pass
        except BaseException as e:  # handed to the coordinator, raised there
            self.error = e
        with self.cond:
            self.done = True
            self.cond.notify_all()


class _BufferPool:
    """Freed weights' memory kept for the next unit's reads (a layer's tensors fit the next
    layer's exactly; the LM head's fit the embedding's on the next greedy pass). Memory stays
    within the plan: a read takes what fits and :meth:`drop_unused` then releases the rest, so
    what the pool holds beside the resident units is never more than the unit just freed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free: dict = {}  # key -> [buffer]
        self.lent: dict = {}  # id(weight tensor) -> (key, buffer)

    def take(self, key):
        with self.lock:
            got = self.free.get(key)
            return got.pop() if got else None

    def lend(self, tensor, key, buffer):
        with self.lock:
            self.lent[id(tensor)] = (key, buffer)

    def give_back(self, tensor) -> bool:
        with self.lock:
            kb = self.lent.pop(id(tensor), None)
            if kb is not None:
                self.free.setdefault(kb[0], []).append(kb[1])
            return kb is not None

    def drop_unused(self, keep=()) -> None:
        """Release the free buffers but those ``keep`` (keys, one buffer each) asks for."""
        want: dict = {}
        for k in keep:
            want[k] = want.get(k, 0) + 1
        with self.lock:
            dropped = False
            for k in list(self.free):
                n = want.get(k, 0)
                dropped |= len(self.free[k]) > n
                del self.free[k][n:]
                if not self.free[k]:
                    del self.free[k]
        if dropped:
            _release_freed_memory()

    def clear(self) -> None:
        with self.lock:
            self.lent.clear()
        self.drop_unused()


class _Prefetch:
    """Unit ``idx``'s weights read on a thread of its own while the unit before it computes."""

    def __init__(self, sm: StreamedModel, idx: int):
        self.idx = idx
        self.tensors = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(sm,), daemon=True)
        self.thread.start()

    def _main(self, sm):
        try:
            self.tensors = sm.read_unit(sm.units[self.idx], background=True)
        except BaseException as e:  # raised by take(), in the coordinator
            self.error = e

    def take(self) -> list:
        self.thread.join()
        if self.error is not None:
            raise self.error
        tensors, self.tensors = self.tensors, None
        return tensors


class _Stream:
    """Hooks that make every worker wait at each unit until the coordinator hands it over."""

    def __init__(self, sm: StreamedModel):
        self.sm = sm
        self.cond = threading.Condition()
        self.workers: dict[threading.Thread, _Worker] = {}
        self.abort = False
        self.handles = []
        self.current: int | None = None  # index of the loaded unit
        self.pending: _Prefetch | None = None  # the next unit, being read in the background

    def _enter(self, idx: int):
        def pre_hook(module, args):
            w = self.workers.get(threading.current_thread())
            if w is None:
                raise RuntimeError(f"streamed model: unit {self.sm.units[idx].name} ran outside run_streamed")
            with self.cond:
                w.want, w.granted = idx, False
                self.cond.notify_all()
                while not w.granted and not self.abort:
                    self.cond.wait()
                if self.abort:
                    raise _Aborted()
                w.want = None
        return pre_hook

    def __enter__(self):
        for i, u in enumerate(self.sm.units):
            first = u.modules[0][1]
            self.handles.append(first.register_forward_pre_hook(self._enter(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _run_until_blocked(self, w: _Worker) -> None:
        """Let ``w`` run (alone) until it waits for a unit again or finishes."""
        with self.cond:
            w.granted = True
            self.cond.notify_all()
            while not w.done and not (w.want is not None and not w.granted):
                self.cond.wait()

    def run(self, fns: Sequence[Callable]) -> list:
        workers = [_Worker(fn, self.cond) for fn in fns]
        try:
            for w in workers:  # each starts alone and runs up to its first unit
                self.workers[w.thread] = w
                with self.cond:
                    w.thread.start()
                    w.granted = True  # nothing to wait for before the first unit
                    while not w.done and not (w.want is not None and not w.granted):
                        self.cond.wait()
                self._raise(workers)
            n = len(self.sm.units)
            while not all(w.done for w in workers):
                for idx in range(n):
                    while True:
                        waiting = [w for w in workers if not w.done and w.want == idx]
                        if not waiting:
                            break
                        u = self.sm.units[idx]
                        if self.pending is not None and self.pending.idx == idx:
                            tensors = self.pending.take()
                            self.pending = None
                            self.sm.prefetched += 1
                        else:
                            tensors = self.sm.read_unit(u)
                        self.sm.install(tensors)
                        del tensors
                        # the next unit of this sweep is read while this one computes, where the
                        # plan holds both (a sweep's last unit: the workers are done or start
                        # another forward at the embedding, which is not guessed)
                        if self.pending is None and idx + 1 < n and idx in self.sm.prefetch:
                            self.pending = _Prefetch(self.sm, idx + 1)
                        try:
                            for w in waiting:
                                self._run_until_blocked(w)
                                self._raise(workers)
                        finally:
                            self.sm.free(u)
            return [w.result for w in workers]
        finally:
            with self.cond:
                self.abort = True
                self.cond.notify_all()
            for w in workers:
                if w.thread.ident is not None:
                    w.thread.join()
            if self.pending is not None:  # read for no one (a failure): dropped
                self.pending.thread.join()
                self.pending = None
            self.sm._lent.clear()
            self.sm.pool.clear()  # nothing of the weights stays in memory after a run

    @staticmethod
    def _raise(workers):
        for w in workers:
            if w.error is not None:
                raise w.error


def run_streamed(sm: StreamedModel, fns: Sequence[Callable]) -> list:
    """Run every ``fn()`` (each a capture of ``sm.model``, e.g. one prompt's forward) with the
    weights streamed: each unit is loaded once for every forward of every ``fn`` that reaches it
    in the same sweep, run by each in turn, then freed. Returns the ``fn`` results in order; a
    worker's exception is raised here (the others are stopped)."""
    if sm.streaming:
        raise RuntimeError(f"streamed model {sm.path}: run_streamed is already running on it")
    sm.streaming = True
    try:
        with _Stream(sm) as stream:
            return stream.run(fns)
    finally:
        sm.streaming = False


# ----------------------------------------------------------------------------------------------
# memory budget


def available_memory(device: str = "cpu") -> int:
    """Bytes available for a reference on ``device``: ``MemAvailable`` of ``/proc/meminfo`` (CPU)
    or the free memory of the CUDA device."""
    if str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class ReferencePlan:
    """How a reference runs: ``path`` (``whole`` or ``streamed``), ``weights`` bytes in the run's
    dtype, ``largest_unit`` (name, bytes), ``budget`` bytes and the prompt ``groups`` (lists of
    prompt indices; one pass over the weights each)."""

    path: str
    weights: int
    largest_unit: tuple[str, int]
    budget: int
    groups: list
    # streamed: units i whose successor is read while i computes (both resident, with a group's
    # activations, within the budget), and the unit changes that are not: (name, next, bytes both)
    prefetch: tuple = ()
    no_prefetch: tuple = ()
    prefetch_off: bool = False  # turned off by the caller

    def describe(self) -> str:
        g = ", ".join(str(len(x)) for x in self.groups)
        out = (f"{self.path} ({size_text(self.weights)} of weights, budget {size_text(self.budget)}, "
               f"largest unit {self.largest_unit[0]} {size_text(self.largest_unit[1])}; "
               f"{len(self.groups)} group(s) of {g} prompt(s)")
        if self.path == "streamed":
            out += "; " + self.describe_prefetch()
        return out + ")"

    def describe_prefetch(self) -> str:
        """Which unit changes read the next unit while one computes, and why the others do not."""
        n = len(self.prefetch) + len(self.no_prefetch)
        if self.prefetch_off:
            return "no prefetch (turned off)"
        if not self.no_prefetch:
            return f"prefetch: each next unit read while one computes ({n} of {n} unit changes)"
        a, b, both = max(self.no_prefetch, key=lambda x: x[2])
        names = f"{a} -> {b}" + (f" and {len(self.no_prefetch) - 1} more" if len(self.no_prefetch) > 1 else "")
        head = ("no prefetch: two neighbouring units do not fit the budget" if not self.prefetch else
                f"prefetch on {len(self.prefetch)} of {n} unit changes, not on {names}")
        return (f"{head} ({a} + {b} = {size_text(both)} with the activations; these load serially)"
                if self.prefetch else f"{head} ({names}: {size_text(both)} with the activations)")


def prompt_activation_bytes(config, dtype: str, seq: int, logits_rows: int) -> int:
    """A bound on what one prompt of ``seq`` tokens holds during a forward: its KV of every layer,
    a layer's activations (eager attention scores ``[heads, seq, seq]`` in float32 included) and
    ``logits_rows`` rows of float32 logits."""
    import torch

    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    item = torch.empty((), dtype=_torch_dtype(dtype)).element_size()
    heads = c.num_attention_heads
    kvh = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = 2 * c.num_hidden_layers * kvh * hd * seq * item * 2  # cache + the aligned copy
    layer = (3 * heads * seq * seq * 4 + 8 * seq * c.hidden_size * item
             + 4 * seq * c.intermediate_size * item)
    return kv + layer + 2 * logits_rows * c.vocab_size * 4


def size_text(n: int) -> str:
    """Bytes for a person: GiB from 1 GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.2f} MiB"


def plan_reference(*, weights: int, units: Sequence[tuple[str, int]], budget: int, per_prompt: Sequence[int],
                   stream: bool | None = None, prefetch: bool = True) -> ReferencePlan:
    """``whole`` when the weights and the largest prompt's activations fit ``budget`` (or
    ``stream`` is False); else ``streamed``, in groups of prompts whose activations fit beside the
    largest unit. ``MemoryBudgetError`` when a streamed path's largest unit alone exceeds the budget.
    Each unit change whose two units fit with the activations reads the next unit ahead (``prefetch``
    False: none does)."""
    name, big = max(units, key=lambda x: x[1])
    most = max(per_prompt, default=0)
    if stream is False or (stream is None and weights + most <= budget):
        return ReferencePlan("whole", weights, (name, big), budget, [list(range(len(per_prompt)))])
    if big > budget:
        raise MemoryBudgetError(f"reference memory budget {size_text(budget)} is smaller than one layer of the "
                                f"model: {name} needs {size_text(big)} ({big} bytes); give at least "
                                f"{(big + most) / GiB:.4f} GiB")

    def pack(room):
        groups, cur, used = [], [], 0
        for i, b in enumerate(per_prompt):
            if cur and used + b > room:
                groups.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += b
        if cur:
            groups.append(cur)
        return groups

    groups = pack(budget - big)
    # two neighbouring units resident while the second is read ahead: groups packed to leave
    # room for the largest pair when that makes no more of them (a group is a pass over the
    # weights: it costs more than the reads a prefetch overlaps); else a unit change is read
    # ahead only where its pair and the largest group's activations fit
    pair = max((units[i][1] + units[i + 1][1] for i in range(len(units) - 1)), default=big)
    if not prefetch:
        return ReferencePlan("streamed", weights, (name, big), budget, groups, prefetch_off=True)
    if pair <= budget and len(pack(budget - pair)) <= len(groups):
        groups = pack(budget - pair)
    acts = max(sum(per_prompt[i] for i in g) for g in groups) if per_prompt else 0
    prefetch, no_prefetch = [], []
    for i in range(len(units) - 1):
        both = units[i][1] + units[i + 1][1] + acts
        if both <= budget:
            prefetch.append(i)
        else:
            no_prefetch.append((units[i][0], units[i + 1][0], both))
    return ReferencePlan("streamed", weights, (name, big), budget, groups, tuple(prefetch), tuple(no_prefetch))


def per_expert_checkpoint(path) -> bool:
    """Whether a safetensors checkpoint stores MoE experts one tensor each (``...experts.<e>...``):
    transformers fuses them into one parameter per layer on load, so the checkpoint's names are not
    the model's and the streamed path (which reads parameters by name) cannot take it."""
    import re

    path = Path(path)
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).exists() else sorted(path.glob("*.safetensors"))
    pat = re.compile(r"\.experts\.\d+\.")
    return any(pat.search(name) for f in files for name in _read_header(f))


def prepare_reference(model_path, dtype: str, device: str = "cpu", memory: float | int | None = None,
                      stream: bool | None = None, seqs: Sequence[tuple[int, int]] = (), extra_per_prompt: int = 0,
                      prefetch: bool = True):
    """Plan a reference of ``model_path`` in ``dtype`` on ``device`` before any run is written.

    memory: the budget in bytes (None: :func:`available_memory`). stream: None chooses by the
    budget, True / False force a path. seqs: ``(tokens, logits rows)`` per prompt, for the
    activations' share. prefetch: False reads no unit ahead (:func:`plan_reference`). Returns ``(plan, streamed_model)``: the model is the checked skeleton
    (checkpoint refused here with ``CheckpointError``; a budget below one unit with
    ``MemoryBudgetError``). A checkpoint without safetensors takes the whole path (``plan`` None).
    """
    path = Path(model_path)
    if not (path / INDEX_FILE).exists() and not (path / SINGLE_FILE).exists():
        if stream:
            raise CheckpointError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}: a streamed reference reads "
                                  f"safetensors checkpoints")
        return None, None
    if per_expert_checkpoint(path):
        if stream:
            raise CheckpointError(f"{path}: a MoE checkpoint with one tensor per expert, which transformers fuses on "
                                  f"load: a streamed reference cannot read it layer by layer (docs/moe.md)")
        return None, None
    sm = StreamedModel(path, dtype, device)
    budget = int(memory) if memory is not None else available_memory(device)
    per = [prompt_activation_bytes(sm.model.config, dtype, s, r) + extra_per_prompt for s, r in seqs]
    units = [(u.name, sm.unit_nbytes(u)) for u in sm.units]
    weights = sum(b for _, b in units)
    plan = plan_reference(weights=weights, units=units, budget=budget, per_prompt=per, stream=stream,
                          prefetch=prefetch)
    sm.prefetch = frozenset(plan.prefetch)
    return plan, sm


class PeakMemory:
    """Peak resident memory of this process (and of the CUDA device) over a ``with`` block.

    CPU: resident set size sampled every ``interval`` seconds by a thread (``/proc/self/statm``),
    so nothing of the process's own peak counters is reset (a caller measuring ``VmHWM`` keeps its
    figure); where ``/proc`` is absent, the process's lifetime peak (``ru_maxrss``).
    CUDA: ``torch.cuda.max_memory_allocated`` since entry.
    """

    def __init__(self, device: str = "cpu", interval: float = 0.01):
        self.device, self.interval = str(device), interval
        self.rss = None
        self.cuda = None
        self.sampled = Path("/proc/self/statm").exists()
        self._stop = threading.Event()
        self._thread = None

    def _sample(self):
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm", "rb", buffering=0) as f:
            while True:
                f.seek(0)
                self.rss = max(self.rss or 0, int(f.read().split()[1]) * page)
                if self._stop.wait(self.interval):
                    return

    def __enter__(self):
        if self.sampled:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(torch.device(self.device))
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.rss = _lifetime_peak()
        if self.device.startswith("cuda"):
            import torch

            self.cuda = int(torch.cuda.max_memory_allocated(torch.device(self.device)))

    def describe(self) -> str:
        s = f"peak RSS {size_text(self.rss)}" + ("" if self.sampled else " (process lifetime)")
        if self.cuda is not None:
            s += f", peak CUDA {size_text(self.cuda)}"
        return s


def _lifetime_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
