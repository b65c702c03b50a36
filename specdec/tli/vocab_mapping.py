"""Token-Level Intersection (TLI): the vocabulary mapping between a draft and a target tokenizer.

Heterogeneous-vocabulary speculative decoding (Timor et al., 2025, "TLI") lets a draft model whose
tokenizer differs from the target's propose tokens, as long as every proposed token also exists in the
target's vocabulary. Two tokens "are the same" here when they stand for exactly the same **bytes** of
decoded text:

* byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2 ...): token strings are bytes written with the GPT-2
  ``bytes_to_unicode`` alphabet (``Ġ`` = space, ``Ċ`` = newline ...), which :func:`token_bytes` inverts;
* SentencePiece (Llama 2, Mistral, Gemma ...): ``▁`` (U+2581) marks a space, ``<0xNN>`` byte-fallback
  pieces stand for the single byte ``NN``, everything else is its UTF-8 text;
* plain pieces: the UTF-8 text of the piece.

The convention is detected by *probing*: a probe text is encoded and the convention under which the
concatenated token bytes reproduce the probe exactly wins. Every resulting byte string that is valid
UTF-8 is then checked against the tokenizer's own decoder (``decode([anchor, id])``); a token whose
decoder output disagrees is left unmapped (``None``). Special / control tokens (bos, eos, pad, unk,
added special tokens, chat markers such as ``<|im_start|>`` or ``<start_of_turn>``) are ``None`` too:
they are never mapped.

Canonical tokens
    When several tokens of one vocabulary have the same bytes (SentencePiece's ``a`` and ``<0x61>``,
    an added token duplicating a vocabulary entry), exactly one of them takes part in the mapping: the
    *canonical* one, chosen by the key ``(kind, id)`` where kind 0 = ordinary vocabulary token,
    1 = added (non-special) token, 2 = byte-fallback piece ``<0xNN>`` — i.e. prefer the token the
    tokenizer itself produces, then the lowest id. The non-canonical duplicates map to ``-1`` so the
    mapping is one-to-one and ``draft_logits_to_target`` is a plain scatter.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from specdec.tli.id_maps import mask_ids, scatter_ids

from specdec.errors import ConfigError
from specdec.engine.cache_files import cache_root
from specdec.model_files import tokenizer_fingerprint

logger = logging.getLogger(__name__)

#: Bump when the way token bytes or the mapping are computed changes: old cache files are ignored.
MAPPING_FORMAT_VERSION = 1

KIND_NORMAL = 0
KIND_ADDED = 1
KIND_BYTE_FALLBACK = 2

SPIECE_UNDERLINE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Added tokens that are not flagged special but are still control markers, never text:
# <|im_start|>, <|extra_0|> ..., [INST], [multimodal] ..., <start_of_image>, <unused12>.
# (HTML-like added tokens such as Gemma's <table>, <s>, </td> ARE text and are kept.)
_MARKER_PATTERNS = (
    re.compile(r"<\|[^\s]*\|>"),
    re.compile(r"\[/?[A-Za-z_]+[A-Za-z0-9_]*\]"),
    re.compile(r"<[A-Za-z]+(?:_[A-Za-z0-9]+)+>"),
    re.compile(r"<unused\d+>"),
)

_PROBES = (
    "Hello world!\n\tTabs  and   spaces: é, 中文, 🙂 ok",
    "Hello world, how are you?",
    "a b",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTES_TO_UNICODE: dict[int, str] = _bytes_to_unicode()
UNICODE_TO_BYTES: dict[str, int] = {c: b for b, c in BYTES_TO_UNICODE.items()}


# --------------------------------------------------------------------------------------------------
# Per-token bytes


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise ConfigError(
            f"{type(tokenizer).__name__} is not a fast (Rust `tokenizers`-backed) Hugging Face tokenizer; "
            "Token-Level Intersection needs one (PreTrainedTokenizerFast / TokenizersBackend)"
        )
    return backend


def _byte_level_bytes(piece: str) -> bytes | None:
    try:
        return bytes(UNICODE_TO_BYTES[c] for c in piece)
    except KeyError:
        return None


def _sentencepiece_bytes(piece: str, byte_fallback: bool = True) -> bytes:
    if byte_fallback:
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")


def _plain_bytes(piece: str) -> bytes:
    return piece.encode("utf-8")


_CONVENTIONS = {
    "byte_level": _byte_level_bytes,
    "sentencepiece": _sentencepiece_bytes,
    "plain": _plain_bytes,
}


@dataclass(frozen=True)
class TokenTable:
    """What :func:`analyze_tokenizer` found: per-id bytes (``None`` = never mapped) and kinds."""

    convention: str  # "byte_level" | "sentencepiece" | "plain" | "decode"
    adds_prefix_space: bool  # encode("x") yields the bytes b" x" (SentencePiece dummy prefix)
    byte_fallback: bool
    bytes: list[bytes | None]
    kinds: list[int]
    special_ids: frozenset[int]
    rejected_by_decoder: int  # tokens whose conventional bytes disagreed with the tokenizer's decoder

    def canonical(self) -> dict[bytes, int]:
        """bytes -> canonical id (see module docstring: key ``(kind, id)``). Shared: do not modify."""
        return self._canonical

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest token's byte length (bounds the greedy match of re-tokenization)."""
        return max((len(b) for b in self._canonical), default=1)

    @cached_property
    def _canonical(self) -> dict[bytes, int]:
        best: dict[bytes, int] = {}
        kinds = self.kinds
        for i, b in enumerate(self.bytes):
            if b is None:
                continue
            j = best.get(b)
            if j is None or (kinds[i], i) < (kinds[j], j):
                best[b] = i
        return best


def _is_marker(content: str) -> bool:
    return any(p.fullmatch(content) for p in _MARKER_PATTERNS)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """bos/eos/pad/unk/..., every added token flagged special, and added tokens that look like markers."""
    ids: set[int] = set()
    for i in getattr(tokenizer, "all_special_ids", []) or []:
        if i is not None and i >= 0:
            ids.add(int(i))
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False) or _is_marker(str(tok)):
            ids.add(int(i))
    return frozenset(ids)


def _vocab_len(tokenizer: Any, backend: Any) -> int:
    n = backend.get_vocab_size(with_added_tokens=True)
    try:
        n = max(n, len(tokenizer))
    except TypeError:
        pass
    return int(n)


def _detect_convention(backend: Any) -> tuple[str, bool]:
    """Encode probe texts; the convention whose token bytes reproduce a probe exactly wins."""
    for probe in _PROBES:
        want = probe.encode("utf-8")
        enc = backend.encode(probe, add_special_tokens=False)
        for name, conv in _CONVENTIONS.items():
            parts = [conv(t) for t in enc.tokens]
            if any(p is None for p in parts):
                continue
            got = b"".join(parts)  # type: ignore[arg-type]
            if got == want:
                return name, False
            if got == b" " + want:
                return name, True
    return "decode", False


def analyze_tokenizer(tokenizer: Any, verify: bool = True) -> TokenTable:
    """Compute (and memoize on the tokenizer object) the :class:`TokenTable` of a fast HF tokenizer."""
    backend = _backend(tokenizer)
    n = _vocab_len(tokenizer, backend)
    cached = getattr(tokenizer, "_specdec_tli_table", None)
    if isinstance(cached, TokenTable) and len(cached.bytes) == n:  # tokens added since: recompute
        return cached
    t0 = time.perf_counter()
    pieces: list[str | None] = [None] * n
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= i < n:
            pieces[i] = piece
    specials = special_token_ids(tokenizer)
    added = {int(i): str(t) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    convention, prefix_space = _detect_convention(backend)

    byte_fallback = False
    if convention == "sentencepiece":
        probe_id = backend.token_to_id("<0x41>")
        byte_fallback = probe_id is not None and backend.decode([probe_id], skip_special_tokens=False) == "A"

    out: list[bytes | None] = [None] * n
    kinds = [KIND_NORMAL] * n
    for i, piece in enumerate(pieces):
        if piece is None or i in specials:
            continue
        if i in added:
            kinds[i] = KIND_ADDED
            if convention == "byte_level":  # the ByteLevel decoder maps a token only if every char is in the table
                b = _byte_level_bytes(piece)
                out[i] = b if b is not None else piece.encode("utf-8")
            elif convention == "sentencepiece":
                out[i] = piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")
            else:
                out[i] = piece.encode("utf-8")
        elif convention == "byte_level":
            out[i] = _byte_level_bytes(piece)  # a char outside the table: not a byte-level token, undefined
        elif convention == "sentencepiece":
            if byte_fallback and piece.startswith("<0x") and _BYTE_PIECE.fullmatch(piece):
                kinds[i] = KIND_BYTE_FALLBACK
                out[i] = bytes([int(piece[3:5], 16)])
            else:
                out[i] = piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")
        elif convention == "plain":
            out[i] = piece.encode("utf-8")
        if out[i] == b"":
            out[i] = None

    rejected = 0
    if convention == "decode" or verify:
        out, rejected = _check_with_decoder(backend, out, pieces, specials, decode_only=(convention == "decode"))
    table = TokenTable(
        convention=convention,
        adds_prefix_space=prefix_space,
        byte_fallback=byte_fallback,
        bytes=out,
        kinds=kinds,
        special_ids=specials,
        rejected_by_decoder=rejected,
    )
    logger.debug(
        "token bytes of a %d-token vocabulary: convention=%s byte_fallback=%s prefix_space=%s, %d special, "
        "%d rejected by the decoder (%.2fs)",
        n, convention, byte_fallback, prefix_space, len(specials), rejected, time.perf_counter() - t0,
    )
    try:
        tokenizer._specdec_tli_table = table
    except AttributeError:
        pass
    return table


def _find_anchor(backend: Any, out: Sequence[bytes | None]) -> tuple[int, str] | None:
    """A token that decodes to a single ASCII letter on its own (decoded in front of every checked token)."""
    for ch in "aeoxAZ":
        i = backend.token_to_id(ch)
        if i is not None and backend.decode([i], skip_special_tokens=False) == ch:
            return i, ch
    for ch in "aeoxAZ":
        for i, b in enumerate(out):
            if b == ch.encode():
                if backend.decode([i], skip_special_tokens=False) == ch:
                    return i, ch
                break
    return None


def _check_with_decoder(
    backend: Any,
    out: list[bytes | None],
    pieces: Sequence[str | None],
    specials: frozenset[int],
    decode_only: bool,
) -> tuple[list[bytes | None], int]:
    """Compare each valid-UTF-8 token's bytes with ``decode([anchor, id])`` (the anchor keeps decoders such as
    SentencePiece's ``Strip`` from eating a leading space); a token that disagrees becomes ``None``.
    With ``decode_only`` (no convention recognised) the decoder's output *defines* the bytes."""
    anchor = _find_anchor(backend, out)
    ids = [
        i for i, p in enumerate(pieces) if p is not None and i not in specials and (decode_only or out[i] is not None)
    ]
    if anchor is None:
        batches = [[i] for i in ids]
        prefix = ""
    else:
        batches = [[anchor[0], i] for i in ids]
        prefix = anchor[1]
    decoded = backend.decode_batch(batches, skip_special_tokens=False)
    result = list(out)
    rejected = 0
    for i, text in zip(ids, decoded):
        if decode_only:
            if text.startswith(prefix) and "\ufffd" not in text:
                result[i] = text[len(prefix):].encode("utf-8") or None
            else:
                result[i] = None
            continue
        b = out[i]
        try:
            want = b.decode("utf-8")  # type: ignore[union-attr]
        except UnicodeDecodeError:
            continue  # partial UTF-8 (byte pieces): decoders print U+FFFD, nothing to compare
        if text != prefix + want and not (anchor is None and text == want.removeprefix(" ")):
            result[i] = None
            rejected += 1
    return result, rejected


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """For every token id of a fast HF tokenizer, the exact bytes it stands for in decoded text.

    A word-start marker (``▁``, ``Ġ``) becomes a space, ``<0xNN>`` byte-fallback pieces become the
    byte ``NN``. Special/control tokens and tokens whose bytes are not well defined are ``None``.
    The list is ``len(tokenizer)`` long (ids the model's padded embedding may add beyond it are unmapped).
    """
    return list(analyze_tokenizer(tokenizer).bytes)


# --------------------------------------------------------------------------------------------------
# The mapping


@dataclass(eq=False)
class VocabMapping:
    """One-to-one map between the canonical tokens of two vocabularies that stand for the same bytes.

    ``draft_to_target[d]`` is the target id with the same bytes as draft token ``d`` (``-1``: none, or
    ``d`` is special / a non-canonical duplicate); ``target_to_draft`` the reverse.
    """

    draft_to_target: torch.Tensor  # LongTensor [draft_vocab_size]
    target_to_draft: torch.Tensor  # LongTensor [target_vocab_size]
    intersection_size: int
    draft_vocab_size: int
    target_vocab_size: int
    draft_fingerprint: str
    target_fingerprint: str
    _cache: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def build(cls, draft_tokenizer: Any, target_tokenizer: Any) -> "VocabMapping":
        t0 = time.perf_counter()
        draft = analyze_tokenizer(draft_tokenizer)
        target = analyze_tokenizer(target_tokenizer)
        d_canon = draft.canonical()
        t_canon = target.canonical()
        d2t = torch.full((len(draft.bytes),), -1, dtype=torch.long)
        t2d = torch.full((len(target.bytes),), -1, dtype=torch.long)
        pairs = [(d, t_canon[b]) for b, d in d_canon.items() if b in t_canon]
        if pairs:
            idx = torch.tensor(pairs, dtype=torch.long)
            d2t[idx[:, 0]] = idx[:, 1]
            t2d[idx[:, 1]] = idx[:, 0]
        mapping = cls(
            draft_to_target=d2t,
            target_to_draft=t2d,
            intersection_size=len(pairs),
            draft_vocab_size=len(draft.bytes),
            target_vocab_size=len(target.bytes),
            draft_fingerprint=tokenizer_fingerprint(draft_tokenizer),
            target_fingerprint=tokenizer_fingerprint(target_tokenizer),
        )
        logger.debug(
            "built TLI mapping in %.2fs (%s x %s)", time.perf_counter() - t0, draft.convention, target.convention
        )
        return mapping

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VocabMapping):
            return NotImplemented
        fields = ("intersection_size", "draft_vocab_size", "target_vocab_size", "draft_fingerprint", "target_fingerprint")
        return (
            all(getattr(self, f) == getattr(other, f) for f in fields)
            and torch.equal(self.draft_to_target.cpu(), other.draft_to_target.cpu())
            and torch.equal(self.target_to_draft.cpu(), other.target_to_draft.cpu())
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"VocabMapping(intersection_size={self.intersection_size}, draft_vocab_size={self.draft_vocab_size}, "
            f"target_vocab_size={self.target_vocab_size}, draft_fingerprint={self.draft_fingerprint!r}, "
            f"target_fingerprint={self.target_fingerprint!r})"
        )

    # -- statistics ----------------------------------------------------------------------------------

    @property
    def draft_share(self) -> float:
        """Share of the draft vocabulary that is in the intersection."""
        return self.intersection_size / self.draft_vocab_size if self.draft_vocab_size else 0.0

    @property
    def target_share(self) -> float:
        """Share of the target vocabulary that is in the intersection."""
        return self.intersection_size / self.target_vocab_size if self.target_vocab_size else 0.0

    def summary(self) -> str:
        return (
            f"TLI intersection: {self.intersection_size:,} tokens = {self.draft_share:.1%} of the draft "
            f"vocabulary ({self.draft_vocab_size:,}) and {self.target_share:.1%} of the target vocabulary "
            f"({self.target_vocab_size:,})"
        )

    # -- tensors -------------------------------------------------------------------------------------

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        t = self._cache.get(key)
        if t is None:
            if name == "d2t":
                t = self.draft_to_target.to(device)
            elif name == "t2d":
                t = self.target_to_draft.to(device)
            elif name == "draft_mask":
                t = (self.draft_to_target >= 0).to(device)
            elif name == "draft_ids":
                t = torch.nonzero(self.draft_to_target >= 0).squeeze(1).to(device)
            elif name == "target_ids":
                d = torch.nonzero(self.draft_to_target >= 0).squeeze(1)
                t = self.draft_to_target[d].to(device)
            else:  # pragma: no cover
                raise KeyError(name)
            self._cache[key] = t
        return t

    @property
    def draft_mask(self) -> torch.BoolTensor:
        """``[draft_vocab_size]``: True for the draft tokens in the intersection."""
        return self._on("draft_mask", self.draft_to_target.device)  # type: ignore[return-value]

    def to(self, device: str | torch.device) -> "VocabMapping":
        device = torch.device(device)
        return VocabMapping(
            self.draft_to_target.to(device),
            self.target_to_draft.to(device),
            self.intersection_size,
            self.draft_vocab_size,
            self.target_vocab_size,
            self.draft_fingerprint,
            self.target_fingerprint,
        )

    def restrict_draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V]`` with every draft token outside the intersection set to ``-inf``.

        ``V`` may differ from the tokenizer's size (padded embeddings): ids beyond the tokenizer are masked.
        """
        return mask_ids(logits, self._on("draft_mask", logits.device), float("-inf"))

    def draft_logits_to_target(self, logits: torch.Tensor, target_vocab_size: int | None = None) -> torch.Tensor:
        """Scatter draft logits ``[..., V_draft]`` into target id space ``[..., target_vocab_size]``.

        Target ids outside the intersection get ``-inf``; ``softmax`` of the result is the draft's
        distribution restricted (and renormalised) to the intersection, indexed by target id — the
        ``q`` that TLI's rejection sampling compares with the target's ``p``.
        """
        size = int(target_vocab_size or self.target_vocab_size)
        d_ids = self._on("draft_ids", logits.device)
        t_ids = self._on("target_ids", logits.device)
        if d_ids.numel() and int(d_ids[-1]) >= logits.shape[-1]:
            keep = d_ids < logits.shape[-1]
            d_ids, t_ids = d_ids[keep], t_ids[keep]
        if t_ids.numel() and size <= int(t_ids.max()):
            raise ValueError(
                f"target_vocab_size {size} is smaller than the largest mapped target id {int(t_ids.max())}"
            )
        return scatter_ids(logits, d_ids, t_ids, size, float("-inf"))

    def draft_ids_to_target(self, ids: torch.Tensor | Sequence[int], strict: bool = True) -> torch.Tensor:
        """Map draft ids to target ids. ``strict``: raise ``ValueError`` for an id outside the intersection
        (otherwise it maps to ``-1``)."""
        return self._convert(ids, "d2t", "draft", strict)

    def target_ids_to_draft(self, ids: torch.Tensor | Sequence[int], strict: bool = True) -> torch.Tensor:
        """Map target ids to draft ids (``-1``/``ValueError`` outside the intersection)."""
        return self._convert(ids, "t2d", "target", strict)

    def _convert(self, ids: torch.Tensor | Sequence[int], name: str, side: str, strict: bool) -> torch.Tensor:
        ids_t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(list(ids), dtype=torch.long)
        table = self._on(name, ids_t.device)
        in_range = (ids_t >= 0) & (ids_t < table.numel())
        out = torch.where(in_range, table[ids_t.clamp(0, table.numel() - 1)], torch.full_like(ids_t, -1))
        if strict and bool((out < 0).any()):
            bad = ids_t[out < 0].flatten()[:8].tolist()
            raise ValueError(f"{side} ids {bad} are not in the TLI vocabulary intersection")
        return out

    def draft_logits_to_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy TLI drafting: the argmax of the intersection-restricted draft logits, as target ids."""
        best = self.restrict_draft_logits(logits).argmax(dim=-1)
        return self.draft_ids_to_target(best, strict=False)

    # -- persistence ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": MAPPING_FORMAT_VERSION,
            "draft_to_target": self.draft_to_target.cpu(),
            "target_to_draft": self.target_to_draft.cpu(),
            "intersection_size": self.intersection_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_vocab_size": self.target_vocab_size,
            "draft_fingerprint": self.draft_fingerprint,
            "target_fingerprint": self.target_fingerprint,
        }

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename), so concurrent builders never see a partial file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(self.state_dict(), f)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a cache may be shared
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> "VocabMapping":
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        if state.get("format") != MAPPING_FORMAT_VERSION:
            raise ValueError(f"{path}: mapping format {state.get('format')!r}, expected {MAPPING_FORMAT_VERSION}")
        m = cls(
            draft_to_target=state["draft_to_target"],
            target_to_draft=state["target_to_draft"],
            intersection_size=int(state["intersection_size"]),
            draft_vocab_size=int(state["draft_vocab_size"]),
            target_vocab_size=int(state["target_vocab_size"]),
            draft_fingerprint=str(state["draft_fingerprint"]),
            target_fingerprint=str(state["target_fingerprint"]),
        )
        if m.draft_to_target.shape != (m.draft_vocab_size,) or m.target_to_draft.shape != (m.target_vocab_size,):
            raise ValueError(f"{path}: tensor shapes do not match the vocabulary sizes")
        if int((m.draft_to_target >= 0).sum()) != m.intersection_size:
            raise ValueError(f"{path}: intersection size does not match the tensors")
        return m


def mapping_cache_path(draft_tokenizer: Any, target_tokenizer: Any, cache_dir: str | Path | None = None) -> Path:
    """Where :func:`load_or_build_mapping` keeps the mapping of this (draft, target) pair."""
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "tli"
    d_fp = tokenizer_fingerprint(draft_tokenizer)
    t_fp = tokenizer_fingerprint(target_tokenizer)
    key = hashlib.sha256(f"{d_fp}:{t_fp}:v{MAPPING_FORMAT_VERSION}".encode()).hexdigest()[:12]
    return root / f"draft-{d_fp[:16]}_target-{t_fp[:16]}_{key}.pt"


def load_or_build_mapping(
    draft_tokenizer: Any, target_tokenizer: Any, cache_dir: str | Path | None = None
) -> VocabMapping:
    """The TLI mapping of (draft, target), from ``cache_dir`` (default ``cache_root()/"tli"``) when a
    file for both tokenizer fingerprints is there, else built and written there."""
    path = mapping_cache_path(draft_tokenizer, target_tokenizer, cache_dir)
    d_fp = tokenizer_fingerprint(draft_tokenizer)
    t_fp = tokenizer_fingerprint(target_tokenizer)
    t0 = time.perf_counter()
    mapping: VocabMapping | None = None
    if path.exists():
        try:
            mapping = VocabMapping.load(path)
            if (mapping.draft_fingerprint, mapping.target_fingerprint) != (d_fp, t_fp):
                raise ValueError("fingerprints differ")
            how = f"loaded from {path}"
        except Exception as exc:  # corrupt / stale file: rebuild
            logger.warning("ignoring TLI mapping cache %s (%s); rebuilding", path, exc)
            mapping = None
    if mapping is None:
        mapping = VocabMapping.build(draft_tokenizer, target_tokenizer)
        try:
            mapping.save(path)
            how = f"built and cached at {path}"
        except OSError as exc:
            how = f"built (not cached: {exc})"
    logger.info("%s; %s in %.2fs", mapping.summary(), how, time.perf_counter() - t0)
    return mapping


def check_useful(mapping: VocabMapping, min_share: float = 0.05, min_size: int = 1000) -> VocabMapping:
    """Refuse (``ConfigError``) an intersection too small for TLI drafting to pay off.

    The draft may only propose intersection tokens, and the target's tokens outside it can never be
    drafted, so both shares must be at least ``min_share`` and the intersection at least ``min_size``.
    """
    problems = []
    if mapping.intersection_size < min_size:
        problems.append(f"fewer than min_size={min_size:,} tokens in common")
    if mapping.draft_share < min_share:
        problems.append(
            f"only {mapping.draft_share:.2%} of the draft vocabulary is in it (min_share={min_share:.0%}), so the "
            "draft would mostly propose tokens it has to mask out"
        )
    if mapping.target_share < min_share:
        problems.append(
            f"only {mapping.target_share:.2%} of the target vocabulary is in it (min_share={min_share:.0%}), so "
            "most target tokens could never be drafted and almost every proposal would be rejected"
        )
    if problems:
        raise ConfigError(
            f"the draft and target tokenizers share too few tokens for Token-Level Intersection to be useful: "
            f"{mapping.intersection_size:,} tokens in common between a {mapping.draft_vocab_size:,}-token draft "
            f"vocabulary (fingerprint {mapping.draft_fingerprint}) and a {mapping.target_vocab_size:,}-token "
            f"target vocabulary (fingerprint {mapping.target_fingerprint}): " + "; ".join(problems) + ". Use a "
            "draft model whose tokenizer is closer to the target's, or lower min_share/min_size."
        )
    return mapping


def encode_ids_to_bytes(table: Sequence[bytes | None], ids: Iterable[int]) -> bytes:
    """Concatenated bytes of ``ids`` under a :func:`token_bytes` table (special tokens contribute nothing)."""
    return b"".join(table[i] or b"" for i in ids)
