"""``specdec distill``: train a small draft model for a target by knowledge distillation.

The draft shares the target's tokenizer (it is saved next to the weights), so it drafts for the target
without any vocabulary mapping. Pipeline:

1. **Corpus.** By default, text that ships with the Python interpreter, so it works offline: prose
   (``pydoc_data/topics.py``, the language/library reference topics of ``help()``, plus the ``.txt``
   files and IDLE's ``help.html`` of the standard library) and code (the standard library's ``.py``
   sources, test suites and codec tables left out). ``--corpus PATH`` (a file or a folder of
   .txt/.md/.rst/.py, repeatable) replaces it. Documents are tokenized with the target's tokenizer,
   joined with a separator token and cut into fixed-length chunks; whole documents are held out for
   evaluation. Cached under ``OUT/cache``.
2. **Teacher signal.** The target's top-k log-probabilities (ids + values, bf16 on disk) for every
   position of a chunk, computed once by batched bf16-autocast inference and stored in shards under
   ``OUT/cache``. Training shards are labelled lazily, the first time training reaches them, so a
   time-budgeted run labels only what it uses; later epochs and resumed runs reuse the shards.
3. **Draft.** The target's model class and config with fewer layers / a smaller hidden size. With the
   target's hidden size, the draft copies the target's embeddings (tied lm_head) and a spread of the
   target's layers (e.g. 0, 10, 20, 29) and its final norm. With a smaller hidden size ``H`` everything
   is copied through a projection ``P`` (target hidden x H, orthonormal columns): the top-H principal
   directions of the target's residual stream (``--projection hidden``, default; or of its embedding
   matrix, ``--projection embedding``). Embedding = ``E @ P`` (tied lm_head), each copied layer's
   input matrices = ``W diag(g) P`` (the RMSNorm gain ``g`` folded in, the norm reset to ones, rescaled
   for the RMS over H instead of the full width), its output matrices = ``P^T W``; kept MLP neurons
   are the target's most important ones when ``--intermediate`` is smaller, kept heads the first of
   each kept KV group. Before training such a draft agrees with the target no more than a random one
   (skipping 26 of 30 layers breaks the target's computation), but it learns several times faster:
   in a 2-minute trial (46 steps) 13.9% held-out agreement against 4.4% from random layers.
4. **Training.** Forward KL from the teacher's renormalised top-k distribution to the draft's full
   softmax (plus ``--ce-weight`` x cross-entropy on the teacher's argmax or the data), computed by a
   fused, chunked lm_head + loss so the (tokens x vocab) logits are never materialised. bf16 autocast,
   AdamW, linear warmup then cosine decay over the run's progress (the larger of steps/--max-steps and
   time/--minutes), gradient clipping. The teacher costs several times more per token than a draft
   step, so once labelling has used ``--label-fraction`` of ``--minutes`` the run stops labelling and
   trains more epochs over the labelled chunks. The embeddings (tied with the lm_head) train at
   ``--embed-lr-scale`` times the learning rate (0 freezes them; default 0.1 when projected, 0 when
   copied unchanged at the target's width).
5. **Checkpoints** every ``--save-every`` steps in ``OUT/checkpoint`` (model, optimizer, step, data
   position, RNG, elapsed time); running the same command again resumes. ``--minutes`` and
   ``--max-steps`` are totals over resumed runs.
6. **Evaluation and export.** Held-out teacher-forced top-1 agreement with the target (periodically and
   at the end, on the exported bf16 weights), a free-running greedy acceptance estimate (the target
   generates; the fraction of the draft's greedy guesses it would accept and the tokens per target
   step for ``k`` speculative tokens), then a Hugging Face folder in ``OUT``: config.json,
   model.safetensors (bf16), the target's tokenizer files, generation_config.json, README.md (model
   card) and distill.json. ``OUT/cache`` and ``OUT/checkpoint`` are work files (listed in
   ``OUT/.gitignore``); ship the rest.

Defaults, for ``smollm2-135m`` (30 layers, hidden 576, vocab 49152) on 2 CPU cores: 4 layers, hidden
256, 4 heads / 2 KV heads of dim 64, MLP 1024 -> 16.5M parameters, of which 12.6M are the tied
49152x256 embedding; model.safetensors is 33 MB in bf16 (hidden 576 would need 56 MB for the embedding
alone). The vocabulary projection dominates both the training cost (the lm_head and its softmax are
~70% of a step) and the drafting cost, so width is kept small and depth cheap. Measured on a shared
2-core AVX512-bf16 machine, 1 thread: a step of 8 x 256 tokens takes ~2.4 s (~850 training tokens/s);
teacher labelling runs at ~250-290 tokens/s. With --minutes 60 and both cores, about half the budget
labels ~1M tokens and the rest adds epochs over them.

Modules: ``config`` (command line, DistillConfig), ``corpus`` (documents, tokenized chunks), ``teacher``
(top-k labels, their cache), ``onpolicy`` (the target's own continuations), ``draft_init`` (draft
architecture and initialisation), ``loss``, ``evaluate``, ``export`` and ``model_card`` (the output folder),
``prepare``, ``schedule``, ``checkpoint``, ``train`` (the run: ``distill()``, ``run()``) and ``summary``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from specdec.distill.config import DistillConfig, add_arguments

if TYPE_CHECKING:
    from specdec.distill.train import distill, run

__all__ = ["add_arguments", "run", "distill", "DistillConfig"]


# `specdec COMMAND` imports this package for add_arguments whatever the command: the training side (torch,
# transformers) is imported on first use (PEP 562).
def __getattr__(name: str) -> Any:
    if name in ("run", "distill"):
        return getattr(importlib.import_module("specdec.distill.train"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
