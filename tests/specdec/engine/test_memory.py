"""specdec/engine/memory.py and the lean forward's weights: one copy of each weight, the same outputs."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.lean_forward import lean_decoder
from specdec.engine.memory import weight_bytes
from specdec.engine.models import load_model
from specdec.engine.quant import QuantLinear
from specdec.engine.runner import ModelRunner


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def test_the_lean_decoder_holds_no_second_copy_of_the_fused_weights(target_dir):
    lm = load_model(str(target_dir), dtype="float32")  # its own copy: the test rebinds its weights
    model, ids = lm.model, list(range(5, 25))
    before = _logits(model, ids)
    own = weight_bytes(model)  # the parameters and the rotary buffer
    assert own - _param_bytes(model) < 1024
    # the layout on CUDA (no oneDNN packed copies): the fused q|k|v and gate|up matrices are the weights themselves
    net = lean_decoder(model, use_onednn=False)
    layer = net.layers[0]
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert layer.qkv.weight.untyped_storage().data_ptr() == q_proj.untyped_storage().data_ptr()
    assert weight_bytes(model, net) == own  # was + the fused copies (~1.5x on SmolLM2)
    again = lean_decoder(model, use_onednn=False)  # a second decoder over the model finds them fused: no copy
    assert weight_bytes(model, net, again) == own
    assert torch.equal(_logits(model, ids), before)  # transformers' forward reads the same numbers


@pytest.mark.parametrize("role, quantization", [("target", "none"), ("draft", "int8")])
def test_a_service_runner_lets_go_of_the_weights_its_lean_forward_holds_packed(target_dir, role, quantization):
    owned = load_model(str(target_dir), dtype="float32")
    reference = load_model(str(target_dir), dtype="float32")
    params = _param_bytes(owned.model)
    runner = ModelRunner(owned, 256, role=role, quantization=quantization, release_unread_weights=True)
    plain = ModelRunner(reference, 256, role=role, quantization=quantization)
    held, plain_held = runner.weight_bytes(), plain.weight_bytes()
    layer_params = params - owned.model.model.embed_tokens.weight.numel() * 4
    # the decoder layers' float weights are read only as packed (oneDNN) or int8 copies: one copy is kept
    assert held <= plain_held - 0.9 * layer_params
    if quantization == "int8":
        products = [p for layer in runner.net.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        assert all(isinstance(p, QuantLinear) for p in products)
        assert all(p.q is None for p in products if p.packed is not None)  # the unpacked int8 copy dropped
        assert held < params  # int8 layers + the float embedding: less than the float model
    ids = list(range(7, 47))
    a, b = runner.get_or_create("s", None), plain.get_or_create("s", None)
    assert torch.equal(runner.forward(a, ids, num_logits=3), plain.forward(b, ids, num_logits=3))


def test_released_weights_keep_their_shapes_and_refuse_a_transformers_forward(target_dir):
    lm = load_model(str(target_dir), dtype="float32")
    vocab = lm.vocab_size
    ModelRunner(lm, 256, role="target", release_unread_weights=True)
    assert lm.vocab_size == vocab  # read from the LM head's shape
    with pytest.raises(RuntimeError, match="released"):
        _logits(lm.model, [1, 2, 3])
