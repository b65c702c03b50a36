"""Helpers of the ``specdec distill`` tests."""

from __future__ import annotations

from pathlib import Path


def distill_argv(target_dir: Path, corpus: Path, out: Path, steps: int) -> list[str]:
    return ["distill", "--target", str(target_dir), "--out", str(out), "--corpus", str(corpus),
            "--layers", "2", "--hidden", "32", "--intermediate", "64", "--seq-len", "32", "--batch-size", "4",
            "--max-train-tokens", "4096", "--eval-tokens", "512", "--top-k", "8", "--minutes", "0",
            "--max-steps", str(steps), "--lr", "3e-3", "--init", "random", "--warmup-steps", "2", "--save-every", "5",
            "--eval-every", "10", "--accept-prompts", "4", "--accept-tokens", "12", "--threads", "1",
            "--no-progress"]
