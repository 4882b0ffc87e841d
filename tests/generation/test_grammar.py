"""Structured output on the tiny random-weight model: with the grammar's mask, whatever the weights, a
`json_schema` request's text parses and validates, a `json_object` one's is an object, the sequence ends when the
JSON is complete, and requests without a format that share its batch get the tokens they get alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from strata.errors import RequestError
from strata.runtime.generation.grammar import GrammarBatch, GrammarCompiler, ResponseFormat, ResponseFormatError
from strata.runtime.generation.sampler import SamplingParams, make_generator, sample
from strata.runtime.generation.scheduler import GenRequest

# every value bounded (string lengths, integer ranges, item counts): the grammar completes within MAX_TOKENS
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 400  # more than the longest text PERSON admits, one byte a token (8 + 4 * 3 + 6 characters of 4 bytes)
PROMPT = "Describe a person as JSON:"


def check_person(text: str) -> dict:
    """`text` parsed, checked against PERSON by hand (and by jsonschema where it is installed)."""
    value = json.loads(text)
    assert isinstance(value, dict) and list(value) == list(PERSON["properties"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["role"] in ("admin", "user", "guest")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 4 for t in value["tags"])
    assert list(value["address"]) == ["city", "zip"] and isinstance(value["address"]["city"], str)
    assert len(value["address"]["city"]) <= 6 and 10000 <= value["address"]["zip"] <= 99999
    assert isinstance(value["active"], bool)
    try:
        import jsonschema
    except ImportError:
        return value
    jsonschema.validate(value, PERSON)
    return value


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.5, "seed": 2},
                                      {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 3}],
                         ids=["greedy", "t1", "t1.5", "top-p-k"])
def test_a_json_schema_request_parses_and_validates(tiny_engine, sampling):
    out = tiny_engine.generate(PROMPT, max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT, **sampling)
    assert out.finish_reason == "stop" and len(out.token_ids) < MAX_TOKENS
    check_person(out.text)
    assert not set(out.token_ids) & tiny_engine.eos_token_ids  # the grammar ended it, no EOS was sampled


def test_the_same_request_without_a_format_is_not_json(tiny_engine):
    """The model alone (random weights) writes no such JSON: what the tests above see is the grammar's doing."""
    out = tiny_engine.generate(PROMPT, max_tokens=60)
    with pytest.raises(ValueError):
        check_person(out.text)


# seeds whose walk closes the object within MAX_TOKENS: an object's strings are unbounded, and with seed 3 the
# random weights write one string until max_tokens ends it (a JSON prefix, finish_reason "length")
@pytest.mark.parametrize("seed", [None, 1, 2, 5])
def test_a_json_object_request_gives_an_object(tiny_engine, seed):
    sampling = {} if seed is None else {"temperature": 1.0, "seed": seed}
    out = tiny_engine.generate(PROMPT, max_tokens=MAX_TOKENS, response_format={"type": "json_object"}, **sampling)
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)
    run_on = tiny_engine.generate(PROMPT, max_tokens=50, response_format={"type": "json_object"}, temperature=1.0,
                                  seed=3)
    assert run_on.finish_reason == "length" and run_on.text.startswith('{"')


def test_greedy_structured_output_is_deterministic(tiny_engine):
    runs = [tiny_engine.generate(PROMPT, max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].text == runs[1].text
    seeded = [tiny_engine.generate(PROMPT, max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT, temperature=1.0,
                                   seed=9) for _ in range(2)]
    assert seeded[0].token_ids == seeded[1].token_ids


def test_the_sequence_ends_when_the_json_is_complete(tiny_engine):
    """ignore_eos: no EOS could end it; the grammar does, at the closing brace, long before max_tokens."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = ResponseFormat.from_schema(schema)
    sched = tiny_engine.scheduler()
    sched.start()
    [handle] = sched.submit_together([GenRequest(tiny_engine.tokenizer.encode(PROMPT), SamplingParams(
        max_tokens=100, response_format=fmt, ignore_eos=True))], asynchronous=False)
    events = list(handle.iter_events(timeout=120))
    text, token_ids = "".join(e.text for e in events), [e.token_id for e in events if e.token_id is not None]
    assert events[-1].finish_reason == "stop" and text in ('{"ok": true}', '{"ok": false}')
    assert events[-1].token_id is not None  # the event of the JSON's last token ends it: no step after it
    assert tiny_engine.tokenizer.decode(token_ids) == text  # every token is part of the JSON
    cut = tiny_engine.generate(PROMPT, max_tokens=3, response_format=fmt)  # too few tokens: cut short
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and text.startswith(cut.text)


def test_requests_without_a_format_are_unchanged_by_one_in_their_batch(tiny_engine):
    """Greedy requests batched with two structured ones (greedy and sampled) get the tokens they get alone."""
    ids = [tiny_engine.tokenizer.encode(t) for t in ("The river runs", PROMPT, "Once upon a time", "hello")]
    sched = tiny_engine.scheduler(max_batch=4, token_budget=64)
    plain = SamplingParams(max_tokens=24)
    reqs = [GenRequest(ids[0], plain),
            GenRequest(ids[1], SamplingParams(max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT)),
            GenRequest(ids[2], SamplingParams(max_tokens=24)),
            GenRequest(ids[3], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4,
                                              response_format=PERSON_FORMAT))]
    sched.start()
    handles = sched.submit_together(reqs, asynchronous=False)
    events = [list(h.iter_events(timeout=120)) for h in handles]
    tokens = [[e.token_id for e in evs if e.token_id is not None] for evs in events]
    texts = ["".join(e.text for e in evs) for evs in events]
    for i in (0, 2):
        alone = tiny_engine.generate(ids[i], max_tokens=24)
        assert tokens[i] == alone.token_ids and texts[i] == alone.text
    check_person(texts[1]), check_person(texts[3])
    assert all(evs[-1].finish_reason == "stop" for evs in (events[1], events[3]))


@pytest.mark.parametrize("schema,problem", [
    ({"type": "foo"}, 'Unsupported type "foo"'),
    ({"type": "object", "properties": []}, "properties must be an object"),
    ({"type": "string", "pattern": "(("}, "parenthesis"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ({"anyOf": []}, "admits no JSON value"),
])
def test_a_bad_schema_is_a_request_error_naming_the_problem(tiny_engine, schema, problem):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    with pytest.raises(ResponseFormatError, match="json_schema.schema") as e:
        tiny_engine.generate(PROMPT, max_tokens=8, response_format=fmt)
    assert problem in str(e.value) and "\n" not in str(e.value) and e.value.param == "response_format"
    assert tiny_engine.generate(PROMPT, max_tokens=2).finish_reason == "length"  # the engine serves on


@pytest.mark.parametrize("value,problem", [
    ("json", "response_format must be"), ({"type": "yaml"}, "'yaml' is unknown"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": True}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}}, "strict must be"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"const": float("nan")}}}, "is not JSON"),
])
def test_a_malformed_response_format_is_refused(value, problem):
    with pytest.raises(RequestError, match="^response_format") as e:
        SamplingParams(response_format=value)
    assert problem in str(e.value)
    assert SamplingParams(response_format={"type": "text"}).response_format is None


def test_compiled_grammars_are_cached_per_schema_least_recent_dropped(tiny_engine):
    tok = tiny_engine.tokenizer
    compiler = GrammarCompiler(tok, tiny_engine.checkpoint.config.vocab_size, tiny_engine.eos_token_ids, cache_size=2)
    a, b, c = (ResponseFormat.from_schema({"type": "object", "properties": {k: {"type": "integer"}}}) for k in "abc")
    first = compiler.compile(a)
    assert compiler.compile(ResponseFormat.parse({"type": "json_schema", "json_schema": {
        "name": "other", "schema": a.schema, "strict": True}})) is first  # the name does not count
    assert compiler.compiled == 1
    compiler.compile(b), compiler.compile(c)
    assert compiler.compiled == 3 and compiler.cached() == 2
    assert compiler.compile(a) is not first and compiler.compiled == 4  # a was the least recently used: dropped
    reordered = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    ordered = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    assert compiler.compile(ResponseFormat.from_schema(reordered)) is not compiler.compile(
        ResponseFormat.from_schema(ordered))  # the JSON follows the property order: different grammars


def test_the_mask_covers_the_models_padded_vocabulary_and_no_control_characters(tiny_engine):
    """A model vocabulary 37 ids past the tokenizer's: those ids are never allowed; inside a string no token with a
    raw control character is (JSON escapes them); the caller's logits row is left as it was."""
    tok = tiny_engine.tokenizer
    vocab = tok.vocab_size + 37
    grammar = GrammarCompiler(tok, vocab, tiny_engine.eos_token_ids).compile(ResponseFormat("json_object"))
    matcher, rows = grammar.matcher(), GrammarBatch()
    logits = torch.zeros(1, vocab)
    masked = rows.mask(logits, [matcher])
    assert torch.equal(logits, torch.zeros(1, vocab))
    allowed = masked[0].isfinite().nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    assert max(allowed) < tok.vocab_size
    for t in tok.encode('{"a": "', add_special_tokens=False):
        assert matcher.advance(t)
    allowed = rows.mask(logits, [matcher])[0].isfinite().nonzero()[:, 0].tolist()
    texts = {t: tok.decode([t]) for t in allowed}
    assert len(allowed) > 100 and max(allowed) < tok.vocab_size
    assert not any(ch < " " for text in texts.values() for ch in text)
    assert tok.encode("b", add_special_tokens=False)[0] in allowed
    assert not matcher.done and not matcher.advance(tok.eos_token_ids.copy().pop())  # no end inside a string


def test_a_batch_of_rows_is_masked_as_each_row_alone(tiny_engine):
    """`GrammarBatch.mask`: rows with and without grammars in one call, at every step of three JSON texts: only the
    grammar rows change, each exactly as its own matcher's bitmask says (read bit by bit), the caller's logits
    untouched; a step without grammar rows returns the logits as they are."""
    tok = tiny_engine.tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size, tiny_engine.eos_token_ids)
    person, obj = compiler.compile(ResponseFormat.parse(PERSON_FORMAT)), compiler.compile(ResponseFormat("json_object"))
    ids = [tok.encode(t, add_special_tokens=False) for t in ('{"name": "Ada", "age": 3', '{"a": 1', '{"name": "B')]
    matchers = [person.matcher(), obj.matcher(), person.matcher()]
    rows = GrammarBatch()
    logits = torch.randn(5, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    for step in range(max(map(len, ids)) + 1):
        masked = rows.mask(logits, [matchers[0], None, matchers[1], None, matchers[2]])  # rows 1 and 3 free text
        assert torch.equal(masked[[1, 3]], logits[[1, 3]]) and torch.equal(logits, before)
        for row, m in ((0, matchers[0]), (2, matchers[1]), (4, matchers[2])):
            expected = logits[row : row + 1].masked_fill(~allowed_mask(m, tok.vocab_size), float("-inf"))
            assert torch.equal(masked[row : row + 1], expected), (step, row)
        for m, seq in zip(matchers, ids, strict=True):
            if step < len(seq):
                assert m.advance(seq[step])
    assert rows.mask(logits, [None] * 5) is logits


def allowed_mask(matcher, vocab: int) -> torch.Tensor:
    """bool [1, V]: the tokens `matcher` allows next, read off its bitmask bit by bit."""
    words = matcher.bitmask.astype(np.int64) & 0xFFFFFFFF
    return torch.tensor([[bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)]])


def test_sample_never_picks_a_masked_token():
    """The argmax (and every sampled token) is the best among the tokens left finite, never a masked one."""
    logits = torch.tensor([[0.0, 9.0, 3.0, 8.0, 1.0]])
    masked = logits.clone()
    masked[:, 1::2] = -float("inf")  # a grammar allowing the even ids
    assert sample(masked, SamplingParams(), None).item() == 2
    g = make_generator(0, "cpu")
    draws = {sample(masked, SamplingParams(temperature=2.0), g).item() for _ in range(200)}
    assert draws <= {0, 2, 4} and len(draws) == 3


@pytest.mark.gpu
def test_structured_output_on_cuda_beside_overlapped_decode(tiny_model_dir):
    """On CUDA (the mask applied on the device, overlapped decode on by default): structured requests parse and
    validate, alone and batched with free-text ones, every row in overlapped steps (a grammar's row sampled once
    the host has advanced the grammar with its last token)."""
    from strata import Engine

    with Engine.from_pretrained(tiny_model_dir, device="cuda") as engine:
        for sampling in ({}, {"temperature": 1.0, "seed": 1}):
            out = engine.generate(PROMPT, max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT, **sampling)
            assert out.finish_reason == "stop"
            check_person(out.text)
        ids = [engine.tokenizer.encode(t) for t in ("The river runs", PROMPT, "Once upon a time", "hello")]
        sched = engine.scheduler(max_batch=4)
        sched.start()
        reqs = [GenRequest(ids[0], SamplingParams(max_tokens=48)),
                GenRequest(ids[1], SamplingParams(max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT)),
                GenRequest(ids[2], SamplingParams(max_tokens=48)),
                GenRequest(ids[3], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4,
                                                  response_format=PERSON_FORMAT))]
        events = [list(h.iter_events(timeout=300)) for h in sched.submit_together(reqs, asynchronous=False)]
        check_person("".join(e.text for e in events[1])), check_person("".join(e.text for e in events[3]))
        assert events[1][-1].finish_reason == events[3][-1].finish_reason == "stop"
        assert all(evs[-1].finish_reason in ("length", "stop") for evs in events)  # none aborted


def test_the_utf8_states_agree_with_pythons_decoder():
    """`text_after` against Python's UTF-8 decoder on random byte strings weighted to the edges (lead bytes,
    continuation bytes, E0/ED/F0/F4), from every state a real prefix leads to: between characters exactly where
    the bytes so far decode, ill-formed exactly where no ending makes them decode (any character in progress ends
    with one of 80, 90, A0 and then 80s)."""
    from strata.runtime.generation.grammar import TEXT_BAD, TEXT_START, text_after

    def decodes(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    endings = [b""] + [bytes([first]) + b"\x80" * n for first in (0x80, 0x90, 0xA0) for n in range(3)]
    rng = np.random.default_rng(0)
    edges = np.array([0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF,
                      0xF0, 0xF4, 0xF5, 0xFF], dtype=np.uint8)
    prefixes = [b"", b"\xc3", b"\xe0", b"\xe1", b"\xed", b"\xe1\x80", b"\xf0", b"\xf1", b"\xf4", b"\xf1\x80",
                b"\xf1\x80\x80"]
    vocab = [bytes(rng.choice(edges, size=rng.integers(1, 6)).tolist()) for _ in range(2000)] + [b""]
    starts = text_after(prefixes, set())[TEXT_START]  # the state each prefix leaves
    assert len(set(starts.tolist())) == 8  # c3, e1 80 and f1 80 80 all wait for one byte
    after = text_after(vocab, {len(vocab) - 1})
    for prefix, state in zip(prefixes, starts.tolist(), strict=True):
        for t, token in enumerate(vocab[:-1]):
            text = prefix + token
            assert (after[state, t] == TEXT_START) == decodes(text), (prefix, token)
            assert (after[state, t] == TEXT_BAD) == (not any(decodes(text + end) for end in endings)), (prefix, token)
        assert after[state, len(vocab) - 1] == state  # a stop token leaves the state as it was


def test_a_json_string_never_takes_bytes_utf8_forbids(tiny_engine):
    """Inside a JSON string the byte-level vocabulary's single-byte tokens are offered only where UTF-8 allows
    them: no continuation byte to begin a character, after ED no A0-BF (a surrogate, which decodes to three U+FFFD
    and passed a 6-character maxLength as one), after E0 no 80-9F (overlong), after F4 no 90-BF; the closing quote
    only between characters."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = tiny_engine.tokenizer
    byte_token = {b: tok.token_to_id(ch) for b, ch in bytes_to_unicode().items()}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    grammar = GrammarCompiler(tok, tok.vocab_size, tiny_engine.eos_token_ids).compile(ResponseFormat.from_schema(schema))

    def offered(prefix: bytes) -> set[int]:
        matcher = grammar.matcher()
        for t in tok.encode('{"city": "', add_special_tokens=False) + [byte_token[b] for b in prefix]:
            assert matcher.advance(t)
        allowed = allowed_mask(matcher, tok.vocab_size)[0]
        return {b for b, t in byte_token.items() if allowed[t]}

    cont = set(range(0x80, 0xC0))
    assert not offered(b"") & cont and {0x41, 0xC3, 0xE0, 0xED, 0xF0, 0xF4} <= offered(b"")
    assert not offered(b"") & ({0xC0, 0xC1} | set(range(0xF5, 0x100)))
    assert offered(b"\xed") == set(range(0x80, 0xA0))
    assert offered(b"\xe0") == set(range(0xA0, 0xC0))
    assert offered(b"\xf4") == set(range(0x80, 0x90))
    assert offered(b"\xf0\x90") == cont
    assert ord('"') in offered(b"\xed\x9f\xbf") and ord('"') not in offered(b"\xed\x9f")


def test_a_json_string_never_escapes_a_surrogate(tiny_engine):
    """No \\u escape of U+D800-U+DFFF (a lone one fails pydantic's parser, the OpenAI client's helper): after \\uD
    only 0-7 are offered, after \\u any hex digit, after a backslash the escapes JSON has; an escape once
    complete, the closing quote again; the tokens the grammar offers are taken as they are elsewhere."""
    tok = tiny_engine.tokenizer
    grammar = GrammarCompiler(tok, tok.vocab_size, tiny_engine.eos_token_ids).compile(
        ResponseFormat.from_schema({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}))

    def offered(text: str) -> set[str]:
        matcher = grammar.matcher()
        for t in tok.encode('{"s": "' + text, add_special_tokens=False):
            assert matcher.advance(t), text
        allowed = allowed_mask(matcher, tok.vocab_size)[0]
        return {ch for ch in map(chr, range(0x20, 0x7F)) if allowed[tok.encode(ch, add_special_tokens=False)[0]]}

    hexdigits = set("0123456789abcdefABCDEF")
    assert offered("\\") == set('"\\/bfnrtu')
    assert offered("\\u") == hexdigits
    assert offered("\\ud") == set("01234567") and offered("\\uD") == set("01234567")
    assert offered("\\ud7f") == hexdigits and offered("\\u00e") == hexdigits
    assert '"' in offered("\\ud7ff") and '"' not in offered("\\ud7f")
    assert '"' in offered("a\\n") and '"' in offered("\\\\")  # an escaped backslash ends its escape
