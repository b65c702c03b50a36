"""A tiny Llama target (4 layers, hidden 64) with its own small BPE tokenizer, briefly trained on a small
synthetic corpus of prose and code, shared by the ``specdec distill`` tests (built once, in seconds)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specdec.model_files import model_construction

WORDS = ("the model draft token target layer cache speculative decoding accepts rejects proposes verifies "
         "python function returns value list dict string number loop while for if else class method").split()


def _corpus(folder: Path) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for i in range(12):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize() + "." for _ in range(60)]
        (folder / f"doc{i}.txt").write_text(" ".join(sents) + "\n")
    for i in range(6):
        lines = []
        for j in range(40):
            a, b = rng.sample(WORDS, 2)
            lines.append(f"def {a}_{j}({b}):\n    return {b} + {j}\n")
        (folder / f"mod{i}.py").write_text("\n".join(lines))
    return folder


def _tokenizer(corpus: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")


# Session scope (built once per pytest process): the files using it may be spread across xdist workers and
# interleaved with other files by the duration-ordered schedule (tests/conftest.py), where a package scope
# would be torn down and trained again each time the package is re-entered.
@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and spares a shared CPU
    root = tmp_path_factory.mktemp("distill")
    corpus = _corpus(root / "corpus")
    tok = _tokenizer(corpus)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with model_construction():
        target = LlamaForCausalLM(cfg)
    # A few LM steps on the corpus give the random target structure for the draft to learn.
    ids = tok("\n".join(p.read_text() for p in sorted(corpus.iterdir())))["input_ids"]
    data = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for step in range(40):
        batch = data[torch.randint(0, len(data), (8,))]
        loss = target(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    yield root, corpus, target_dir
    torch.set_num_threads(threads)
