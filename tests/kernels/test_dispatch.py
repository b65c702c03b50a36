"""SPECDEC_KERNELS / kernels= resolution, and the plumbing of kernels and device through config and LLM."""

from __future__ import annotations

import pytest
import torch

from kernels.dispatch import kernels_mode, resolve
from specdec.engine.models import parse_dtype


def test_modes(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    assert kernels_mode(None) == "auto"
    assert resolve(None, "cpu") == "torch" and resolve("torch", "cuda") == "torch"
    assert resolve("triton", "cpu") == "triton"  # the interpreter (tests/kernels/conftest.py turned it on)
    monkeypatch.setenv("SPECDEC_KERNELS", "torch")
    assert kernels_mode(None) == "torch" and kernels_mode("triton") == "triton"  # the argument wins
    monkeypatch.setenv("SPECDEC_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="SPECDEC_KERNELS"):
        kernels_mode(None)


def test_dtype_auto_follows_the_device():
    assert parse_dtype("auto", "cuda") is torch.bfloat16
    assert parse_dtype("auto", "cpu") is torch.float32 and parse_dtype(None) is torch.float32
    assert parse_dtype("float32", "cuda") is torch.float32


def test_service_and_serve_flags():
    import argparse

    from specdec.entrypoints.serve import ServeConfig
    from specdec.serving import settings
    from target_service.config import ENV_PREFIX, TargetServiceConfig

    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, TargetServiceConfig, ENV_PREFIX)
    cfg = settings.from_args(TargetServiceConfig, parser.parse_args(["--kernels", "triton", "--device", "cuda"]))
    assert (cfg.kernels, cfg.device) == ("triton", "cuda")
    assert TargetServiceConfig().kernels is None  # None: $SPECDEC_KERNELS, else auto
    assert {"device", "kernels"} <= set(ServeConfig.__dataclass_fields__)


def test_llm_rejects_an_unknown_mode(target_dir):
    from specdec import LLM
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="kernels must be one of"):
        LLM(str(target_dir), dtype="float32", kernels="fast")
