"""The llguidance backend and the ``auto`` choice between it and xgrammar: masks that keep a greedy
decode inside the schema, the switch to xgrammar once a constraint is compiled, and mixed batches."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("xgrammar")

from fastdeploy.core.sampling_params import StructuredOutputsParams  # noqa: E402
from fastdeploy.structured_output.guidance import GuidanceGrammar, GuidanceRequestGrammar  # noqa: E402
from fastdeploy.structured_output.manager import RequestGrammar, StructuredOutputManager  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "green"]},
    },
    "required": ["name", "size", "ok", "color"],
}


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from fastdeploy.config import EngineConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    config = EngineConfig()
    return load_tokenizer(config.model, resolve_model(config.model))


def _manager(tokenizer, monkeypatch, backend: str) -> StructuredOutputManager:
    monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", backend)
    return StructuredOutputManager(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _allowed(row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (row.to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.reshape(-1)[:vocab].bool()


def _masked_decode(manager, grammar, tokenizer, seed: int, steps: int = 300) -> str:
    """Sample from random logits under the grammar's mask until it allows only EOS."""
    g = torch.Generator().manual_seed(seed)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    tokens = []
    for _ in range(steps):
        mask = manager.bitmask(["r"], [grammar]).array()
        allowed = _allowed(torch.from_numpy(mask[0].copy()), vocab)
        assert allowed.any()
        if allowed.sum() == 1 and allowed[eos]:
            break
        logits = torch.randn(vocab, generator=g)
        logits[~allowed] = float("-inf")
        logits[eos] = float("-inf") if allowed.sum() > 1 else logits[eos]
        token = int(logits.argmax())
        tokens.append(token)
        grammar.accept_token(token)
    return tokenizer.decode(tokens)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_masked_random_decode_follows_the_schema(tokenizer, monkeypatch, backend):
    manager = _manager(tokenizer, monkeypatch, backend)
    try:
        compiled = manager.submit(StructuredOutputsParams(json=SCHEMA)).result(timeout=120)
        kind = GuidanceGrammar if backend == "guidance" else object
        assert isinstance(compiled, kind)
        for seed in range(3):
            grammar = manager.new_request_grammar(compiled, [tokenizer.eos_token_id])
            text = _masked_decode(manager, grammar, tokenizer, seed)
            jsonschema.validate(json.loads(text), SCHEMA)
            assert not grammar.failed
    finally:
        manager.shutdown()


def test_auto_starts_under_llguidance_then_takes_the_compiled_grammar(tokenizer, monkeypatch):
    manager = _manager(tokenizer, monkeypatch, "auto")
    try:
        first = manager.submit(StructuredOutputsParams(json=SCHEMA)).result(timeout=120)
        assert isinstance(first, GuidanceGrammar)  # at once: no wait for the compile
        assert isinstance(
            manager.new_request_grammar(first, [tokenizer.eos_token_id]), GuidanceRequestGrammar
        )
        key = next(iter(manager._cache))
        manager._cache[key].result(timeout=120)  # the background xgrammar compile
        later = manager.submit(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA)))).result(
            timeout=10
        )
        assert not isinstance(later, GuidanceGrammar)
        assert isinstance(manager.new_request_grammar(later, [tokenizer.eos_token_id]), RequestGrammar)
        assert manager.num_compiles == 1 and manager.num_guidance_grammars == 1
    finally:
        manager.shutdown()


def test_a_batch_mixing_both_backends_gets_each_rows_own_mask(tokenizer, monkeypatch):
    manager = _manager(tokenizer, monkeypatch, "auto")
    try:
        params = StructuredOutputsParams(choice=["alpha", "beta"])
        guided = manager.new_request_grammar(
            manager.submit(params).result(timeout=60), [tokenizer.eos_token_id]
        )
        next(iter(manager._cache.values())).result(timeout=120)
        compiled = manager.submit(params).result(timeout=10)
        xgr_grammar = manager.new_request_grammar(compiled, [tokenizer.eos_token_id])
        regex = StructuredOutputsParams(regex="[0-9]{3}")
        digits = manager.new_request_grammar(
            manager.submit(regex).result(timeout=60), [tokenizer.eos_token_id]
        )
        mask = manager.bitmask(["g", "x", "d"], [guided, xgr_grammar, digits]).array()
        alone = [
            manager.bitmask([r], [g]).array()[0]
            for r, g in (("g", guided), ("x", xgr_grammar), ("d", digits))
        ]
        for row, expected in zip(mask, alone, strict=True):
            assert (row == expected).all()
        vocab = len(tokenizer)
        assert torch.equal(
            _allowed(torch.from_numpy(mask[0].copy()), vocab),
            _allowed(torch.from_numpy(mask[1].copy()), vocab),
        )
        digit_texts = {
            tokenizer.decode([t])
            for t in _allowed(torch.from_numpy(mask[2].copy()), vocab).nonzero().flatten().tolist()
        }
        assert digit_texts and all(t.isdigit() for t in digit_texts)
    finally:
        manager.shutdown()


def test_eos_outside_the_tokenizer_keeps_auto_on_xgrammar(tokenizer, monkeypatch):
    """A model whose end-of-sequence ids lie past its tokenizer (a dummy-weight model served with
    another model's tokenizer): llguidance could never stop, so auto compiles with xgrammar and
    guidance refuses the constraint."""
    vocab = len(tokenizer) + 1024
    for backend in ("auto", "guidance"):
        monkeypatch.setenv("FD_STRUCTURED_OUTPUTS_BACKEND", backend)
        manager = StructuredOutputManager(lambda: tokenizer, vocab, [vocab - 1])
        try:
            future = manager.submit(StructuredOutputsParams(json=SCHEMA))
            if backend == "auto":
                assert not isinstance(future.result(timeout=120), GuidanceGrammar)
                again = manager.submit(StructuredOutputsParams(regex="[0-9]+")).result(timeout=120)
                assert not isinstance(again, GuidanceGrammar) and manager.num_guidance_grammars == 0
            else:
                with pytest.raises(ValueError, match="end-of-sequence"):
                    future.result(timeout=120)
        finally:
            manager.shutdown()
