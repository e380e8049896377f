"""Unrolled bounded repetitions (structured_output/repetition.py): the same token masks as
xgrammar's own grammar at every step of random walks, and the rewrite applied where it should."""

from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr

from fastdeploy.structured_output.grammar import build_grammar
from fastdeploy.structured_output.repetition import MAX_UNROLLED, unroll_bounded_repetitions

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tag": {"type": "string", "minLength": 2, "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 1000},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "tag", "n", "ok"],
    },
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
    {"type": "object", "properties": {"code": {"type": "string", "maxLength": 4}}},
]


@pytest.fixture(scope="module")
def tokenizer_info(tokenizer):
    return xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def tokenizer():
    from fastdeploy.config import EngineConfig
    from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

    config = EngineConfig()
    return load_tokenizer(config.model, resolve_model(config.model))


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().flatten()


def _same_masks_on_walks(info, original, unrolled, walks: int, seed: int) -> int:
    """Random walks under ``original``'s masks; both grammars' masks must agree at every step."""
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    a, b = compiler.compile_grammar(original), compiler.compile_grammar(unrolled)
    rng = random.Random(seed)
    steps = 0
    for _ in range(walks):
        ma, mb = xgr.GrammarMatcher(a), xgr.GrammarMatcher(b)
        mask_a, mask_b = (
            xgr.allocate_token_bitmask(1, info.vocab_size),
            xgr.allocate_token_bitmask(1, info.vocab_size),
        )
        while not ma.is_terminated() and steps < 10_000:
            ma.fill_next_token_bitmask(mask_a)
            mb.fill_next_token_bitmask(mask_b)
            assert torch.equal(mask_a, mask_b), f"masks differ after {steps} steps"
            allowed = _allowed(mask_a, info.vocab_size).tolist()
            token = rng.choice(allowed)
            assert ma.accept_token(token) and mb.accept_token(token)
            steps += 1
        assert mb.is_terminated()
    return steps


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array-of-strings", "array-of-ints", "optional"])
def test_unrolled_json_schema_gives_the_same_masks(tokenizer_info, schema):
    original = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    unrolled = build_grammar("json", json.dumps(schema))
    assert "__unrolled" in str(unrolled) and "__unrolled" not in str(original)
    assert str(build_grammar("json", json.dumps(schema), unroll=False)) == str(original)  # (validation)
    assert _same_masks_on_walks(tokenizer_info, original, unrolled, walks=8, seed=0) > 5


def test_unrolled_regex_gives_the_same_masks(tokenizer_info):
    original = xgr.Grammar.from_regex("[a-z]{2,6}-[0-9]{1,3}x")
    unrolled = build_grammar("regex", "[a-z]{2,6}-[0-9]{1,3}x")
    assert "__unrolled" in str(unrolled)
    assert _same_masks_on_walks(tokenizer_info, original, unrolled, walks=6, seed=1) > 10


def test_what_is_left_as_it_is():
    # nothing after the repetition, an unbounded one, or a bound past MAX_UNROLLED: no rewrite
    assert unroll_bounded_repetitions('root ::= (("a" b{0, 3}))\nb ::= (("b"))') is None
    assert unroll_bounded_repetitions('root ::= ((b{0, -1} "a"))\nb ::= (("b"))') is None
    big = f'root ::= ((b{{0, {MAX_UNROLLED + 1}}} "a"))\nb ::= (("b"))'
    assert unroll_bounded_repetitions(big) is None
    assert unroll_bounded_repetitions('root ::= ((("a" | "c") b{0, 3} "a"))\nb ::= (("b"))') is None
    # two in one sequence: the last first, then the one before it (its tail now ends in the chain)
    two = unroll_bounded_repetitions('root ::= ((b{0, 1} "-" b{1, 2} "a"))\nb ::= (("b"))').splitlines()
    assert two[-2] == "root ::= ((root__unrolled1_0_1))"
    assert 'root__unrolled1_0_1 ::= (("-" b root__unrolled0_0_1) | (b root__unrolled1_0_0))' in two
    # a lookahead of the rule stays on the rule and goes to each rule of its chain
    text = unroll_bounded_repetitions('root ::= (("x" b{1, 2} "a")) (=("z"))\nb ::= (("b"))')
    assert text.splitlines() == [
        'root__unrolled0_0_1 ::= (("a") | (b root__unrolled0_0_0)) (=("z"))',
        'root__unrolled0_0_0 ::= (("a")) (=("z"))',
        'root ::= (("x" b root__unrolled0_0_1)) (=("z"))',
        'b ::= (("b"))',
    ]
