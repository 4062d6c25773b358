"""Prompt caches on disk: a prompt's full KV cache kept in a file, so that a later process prefills only what follows.

As llama.cpp's ``--prompt-cache`` and llama-server's ``--slot-save-path`` do, the verifier's full KV cache
(positions 0 .. T-1 of the tokens it holds after a request) is written to a file; a later request whose prompt starts
with some of those tokens loads their keys and values and prefills only the rest (the engine's prefix reuse,
:meth:`~triforce.engine.Engine.adopt_prefix`). The KV of a prefix depends only on the prefix (causal attention), so
the output distribution is unchanged.

One file per entry, ``<dir>/<model key>-<tokens hash>.safetensors`` (safetensors: a JSON header and raw tensors,
read through a memory map, only the positions reused):

- tensors ``k``, ``v``: (L, 1, nkv, T, hs) in the KV dtype; ``tokens``: (T,) int64;
- metadata: ``format`` (:data:`FORMAT_VERSION`), ``model_key`` (:func:`model_key`: the weight files' names, sizes and
  modification times, the config's shape, the weights' and KV dtypes, triforce's version) and ``crc32`` of the
  tensors' bytes.

A file that is truncated or corrupted (safetensors' header check, the checksum), from another model, dtype or
version of the format is skipped with one warning, never read into the cache. The directory is kept under a size
cap by deleting the least recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..text.tokens import common_prefix_length
from .caches import FullKVCache

if TYPE_CHECKING:  # the model imports the caches, never the reverse
    from ..model.config import ModelConfig

#: bumped whenever the file layout changes; files of another version are skipped
FORMAT_VERSION = "1"
_SUFFIX = ".safetensors"


def model_key(source: str, cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
              precision: str = "exact") -> str:
    """A short hex key that changes whenever the KV a prompt produces could: the model's files (names, sizes,
    modification times; a folder's config.json and weights, or a GGUF file), its configuration, the weights' and KV
    dtypes, its arithmetic, and triforce's version.

    Args:
        source: the model's path (:attr:`~triforce.formats.loading.LoadedModel.source`); a hub id keys by name only.
        cfg: its configuration; dtype: the weights' dtype; kv_dtype: the full KV cache's dtype; precision: the
            model's arithmetic (``model.precision``: ``file`` or ``exact``).

    Returns:
        24 hex digits.
    """
    from .._version import __version__

    path = Path(source).expanduser()
    kept = (".json", ".safetensors", ".gguf")
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in kept)
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()]
    blob = json.dumps([str(path.resolve()) if path.exists() else source, stamp, repr(cfg), str(dtype), str(kv_dtype),
                       __version__, FORMAT_VERSION] + ([] if precision == "exact" else [precision]))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


#: safetensors' dtype names of the KV a file may hold
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _crc(*tensors: torch.Tensor) -> str:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


def check_options(directory, max_bytes=None, min_new_tokens: int = 1) -> Path:
    """Check a prompt cache's options before any model loads, creating the directory (a run must not find out
    after its prefill that it cannot write there); returns the directory.

    Raises:
        ValueError: naming the parameter (``prompt_cache``, ``prompt_cache_max_bytes``,
            ``prompt_cache_min_tokens``) and what it takes.
    """
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ValueError(f"prompt_cache must be a directory path (str or os.PathLike), got {directory!r}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"prompt_cache_max_bytes must be None or an integer >= 0, got {max_bytes!r}")
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"prompt_cache_min_tokens must be an integer >= 0, got {min_new_tokens!r}")
    path = Path(directory).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"prompt_cache must be a directory, got the file {str(path)!r}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"prompt_cache {str(path)!r} cannot be created or written: {e.strerror or e}") from None
    return path


@dataclass
class PromptCacheHit:
    """A prefix loaded from a file.

    Attributes:
        cache: a :class:`~triforce.kv.caches.FullKVCache` holding the KV of ``tokens`` (``length == len(tokens)``).
        tokens: the prefix of the request's prompt it covers. path: the file it came from.
    """

    cache: FullKVCache
    tokens: list[int]
    path: Path


class PromptCache:
    """A directory of prompt caches for one model (see the module docstring).

    Args:
        directory: where the files live (created if missing).
        key: :func:`model_key` of the model and dtypes whose KV is stored.
        max_bytes: size cap of this model's files in the directory; the least recently used go first (None: no cap).
        min_new_tokens: :meth:`should_store` answers True only where at least this many tokens were computed beyond
            what was loaded (a short follow-up question does not rewrite a long document's file).

    Raises:
        ValueError: ``directory`` not a non-empty path, or one that cannot be created or written (a file, a
            read-only place), or ``max_bytes`` or ``min_new_tokens`` not integers >= 0 (:func:`check_options`).
    """

    def __init__(self, directory: str | os.PathLike, key: str, max_bytes: int | None = None,
                 min_new_tokens: int = 1) -> None:
        self.directory = check_options(directory, max_bytes, min_new_tokens)
        self.key, self.max_bytes, self.min_new_tokens = key, max_bytes, min_new_tokens
        self._warned: set[Path] = set()

    def _entries(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob(f"{self.key}-*{_SUFFIX}"))

    def _skip(self, path: Path, why: str) -> None:
        if path not in self._warned:
            self._warned.add(path)
            warnings.warn(f"prompt cache {path} ignored: {why}", stacklevel=3)

    def _tokens(self, path: Path) -> list[int] | None:
        """The tokens a file covers, after its header checks (None, with one warning, where a check fails)."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT_VERSION:
                    self._skip(path, f"format {meta.get('format')!r}, this version reads {FORMAT_VERSION!r}")
                    return None
                if meta.get("model_key") != self.key:
                    self._skip(path, "written for another model or dtype")
                    return None
                return f.get_tensor("tokens").tolist()
        except Exception as e:  # a truncated or garbled file: safetensors' own header and size checks
            if not path.exists():  # deleted by another process since the directory was listed: not damaged
                return None
            self._skip(path, f"unreadable ({type(e).__name__}: {str(e)[:80]})")
            return None

    def lookup(self, prompt: list[int], cfg: ModelConfig, device: torch.device | str = "cpu",
               longer_than: int = 0, capacity: int = 0) -> PromptCacheHit | None:
        """The longest prefix of ``prompt`` that a file holds, loaded into a full KV cache, or None. The file is read
        one layer at a time into the cache (memory-mapped), so loading holds one layer beside the cache.

        Args:
            prompt: the request's token ids.
            cfg: the target's configuration (the cache's shape); device: where the cache goes.
            longer_than: only prefixes of more tokens count (what the engine already holds).
            capacity: positions to allocate (the request's full-cache capacity, so the engine need not copy the
                cache into a larger one); at least the prefix's.

        Returns:
            :class:`PromptCacheHit` (its file's modification time is refreshed: least recently used goes first), or
            None: no file shares more than ``longer_than`` first tokens with ``prompt`` and passes its checks (a
            failing file is warned about once and the next best tried), or the model uses dynamic NTK RoPE (its keys
            depend on the request's length).
        """
        if cfg.rope_type == "dynamic" or not prompt:
            return None
        candidates = []
        for path in self._entries():
            tokens = self._tokens(path)
            if tokens is None:
                continue
            n = common_prefix_length(tokens, prompt)
            if n > longer_than:
                candidates.append((n, path, len(tokens)))
        for n, path, held in sorted(candidates, reverse=True):  # the longest prefix whose file passes its checks
            cache = self._read_kv(path, cfg, held, n, max(n, capacity), device)
            if cache is not None:
                try:
                    os.utime(path)  # most recently used
                except FileNotFoundError:  # evicted by another process after it was read: the KV is in memory
                    pass
                return PromptCacheHit(cache, list(prompt[:n]), path)
        return None

    def _read_kv(self, path: Path, cfg: ModelConfig, held: int, n: int, capacity: int,
                 device: torch.device | str) -> FullKVCache | None:
        """A full KV cache of ``capacity`` positions holding a file's first ``n`` positions, read one layer at a time
        with plain reads (a memory map's pages would count in the resident set until unmapped: the whole file), after
        the shape checks and the checksum over the whole file's keys and values (None, warned, where one fails);
        ``held``: the tokens its header lists, each of which needs a position. The safetensors layout: an 8-byte
        little-endian header length, the JSON header (each tensor's dtype, shape and ``data_offsets``), the data."""
        L, nkv, hs = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
                k, v = header["k"], header["v"]
                shape, dtype = tuple(k["shape"]), _DTYPES.get(k["dtype"])
                if len(shape) != 5 or shape[:3] != (L, 1, nkv) or shape[4] != hs or tuple(v["shape"]) != shape \
                        or dtype is None or v["dtype"] != k["dtype"]:
                    self._skip(path, f"KV of shape {shape}, this model's is ({L}, 1, {nkv}, T, {hs})")
                    return None
                if shape[3] < held:
                    self._skip(path, f"KV of {shape[3]} positions for {held} tokens")
                    return None
                cache = FullKVCache(cfg, capacity, dtype, device)
                layer = torch.empty(shape[1:], dtype=dtype)  # (1, nkv, T, hs): one layer's keys or values
                raw = layer.view(torch.uint8).numpy().reshape(-1)
                crc = 0
                for entry, dst in ((k, cache.k), (v, cache.v)):
                    f.seek(8 + size + entry["data_offsets"][0])
                    for i in range(L):  # the checksum runs over the file's bytes in order, a layer at a time
                        if f.readinto(raw) != raw.nbytes:
                            raise EOFError("the file ends inside its data")
                        crc = zlib.crc32(raw.data, crc)
                        dst[i, :, :, :n].copy_(layer[:, :, :n])
                crc_expected = (header.get("__metadata__") or {}).get("crc32")
        except Exception as e:
            if not path.exists():  # deleted by another process meanwhile
                return None
            self._skip(path, f"unreadable ({type(e).__name__})")
            return None
        if f"{crc:08x}" != crc_expected:
            self._skip(path, "checksum mismatch (a corrupted file)")
            return None
        cache.length = n
        return cache

    def before_request(self, engine, ids: list[int], capacity: int = 0) -> tuple[int, PromptCacheHit | None]:
        """Before a request on ``engine`` (an :class:`~triforce.engine.Engine`): the longest prefix of ``ids`` that a
        file holds beyond what the engine already keeps is adopted as its prefix (prefix reuse then prefills only the
        rest), in a cache of ``capacity`` positions (the request's, :func:`~triforce.plan.size_request`) where given.

        Returns:
            ``(cached, hit)``: the prompt tokens whose KV the request starts with (the engine's kept prefix or the
            file's), and the :class:`PromptCacheHit` adopted, or None.
        """
        held = engine.prefix_tokens
        cached = common_prefix_length(held, ids)
        target = engine.target
        hit = self.lookup(ids, target.cfg, target.device, longer_than=cached, capacity=capacity)
        if hit is not None:
            engine.adopt_prefix(hit.cache, hit.tokens)
            cached = len(hit.tokens)
        return cached, hit

    def after_request(self, engine, cached: int, hit: PromptCacheHit | None) -> dict:
        """After a request on ``engine``: its full KV cache written where it computed enough new tokens
        (:meth:`should_store`); ``cached`` and ``hit`` are :meth:`before_request`'s.

        Returns:
            the stats' ``prompt_cache`` entry: ``loaded_tokens`` (from a file), ``loaded_from`` (the file or None),
            ``stored`` (the file written, or None).
        """
        tokens, full = engine.prefix_tokens, engine.full_cache
        stored = None
        if full is not None and tokens and self.should_store(tokens, cached):
            path = self.store(full, tokens)  # None where writing failed (warned)
            stored = str(path) if path is not None else None
        return {"loaded_tokens": len(hit.tokens) if hit else 0, "loaded_from": str(hit.path) if hit else None,
                "stored": stored}

    def should_store(self, tokens: list[int], loaded: int) -> bool:
        """Whether a request that ends holding the KV of ``tokens``, of which ``loaded`` came from a file or the
        engine's kept prefix, adds enough to write (:attr:`min_new_tokens`)."""
        return len(tokens) - loaded >= max(1, self.min_new_tokens)

    def store(self, cache: FullKVCache, tokens: list[int]) -> Path | None:
        """Write the KV of ``tokens`` (positions 0 .. len-1 of ``cache``) as a new entry, atomically (a temporary
        file renamed into place); entries whose tokens are a prefix of ``tokens`` are deleted (this one covers
        them), then the least recently used until this model's files fit :attr:`max_bytes`.

        Returns:
            the file written, or None where writing failed (a full disk, the directory removed): warned, and the
            request's output is not affected.

        Raises:
            ValueError: ``cache`` holds fewer positions than ``tokens``, or more than one sequence.
        """
        from safetensors.torch import save_file

        n = len(tokens)
        if cache.length < n or cache.k.shape[1] != 1:
            raise ValueError(f"store: the cache holds {cache.length} positions of {cache.k.shape[1]} sequences, "
                             f"need {n} of 1")
        k = cache.k[:, :, :, :n].to("cpu").contiguous()
        v = cache.v[:, :, :, :n].to("cpu").contiguous()
        ids = torch.tensor(tokens, dtype=torch.int64)
        digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        path = self.directory / f"{self.key}-{digest}{_SUFFIX}"
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            os.close(fd)
            save_file({"k": k, "v": v, "tokens": ids}, tmp,
                      metadata={"format": FORMAT_VERSION, "model_key": self.key, "crc32": _crc(k, v)})
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"prompt cache not written to {self.directory}: {e}", stacklevel=2)
            return None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        for other in self._entries():
            if other != path:
                held = self._tokens(other)
                if held is not None and len(held) <= n and held == tokens[:len(held)]:
                    other.unlink(missing_ok=True)
        self._evict(keep=path)
        return path

    def _evict(self, keep: Path) -> None:
        if self.max_bytes is None:
            return
        sizes = {}
        for p in self._entries():  # another process may delete files meanwhile: those are gone already
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            sizes[p] = (st.st_mtime, st.st_size)
        total = sum(size for _, size in sizes.values())
        for p in sorted(sizes, key=lambda p: sizes[p][0]):  # oldest use first
            if total <= self.max_bytes:
                break
            if p != keep:
                total -= sizes[p][1]
                p.unlink(missing_ok=True)
