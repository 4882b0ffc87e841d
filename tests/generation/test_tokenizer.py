"""Tokenizer, StreamDecoder and StopMatcher, checked against transformers on a tiny offline BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from strata.errors import CheckpointError, RequestError, StrataError, UnsupportedError
from strata.runtime.generation.text.tokenizer import StopMatcher, StreamDecoder, Tokenizer, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today?",
    "Mixture of experts models route each token to a few experts.",
    "Café naïve résumé — déjà vu. 你好，世界。こんにちは 🎉🚀",
]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template in the older style that lives in tokenizer_config.json: roles, conditions, raise_exception,
# namespace, loop controls, tojson and the bos/eos tokens transformers passes in.
CONFIG_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% if messages[0]['role'] == 'system' %}
    {% set ns.system = messages[0]['content'] %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set loop_messages = messages %}
{% endif %}
{% if ns.system %}[SYS] {{ ns.system }} [/SYS]
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[USER] {{ message['content'] | trim }}
    {% elif message['role'] == 'assistant' %}
[ASSISTANT] {{ message['content'] }}{{ eos_token }}
    {% endif %}
    {% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}[TOOLS] {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""

TEXTS = [
    "Hello world!",
    "The quick brown fox <|im_end|> jumps",
    "<|im_start|>user\nCafé 你好 🎉<|im_end|>",
    "  leading spaces and\ttabs\nnewlines  ",
    "日本語のテキスト 🚀🚀 naïve",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [
        {"role": "system", "content": "You are helpful & <brief>."},
        {"role": "user", "content": "  Say 你好 🎉  "},
        {"role": "assistant", "content": "你好!"},
        {"role": "user", "content": "Again"},
    ],
]


def _train() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


@pytest.fixture(scope="module")
def trained() -> HFTokenizer:
    return _train()


def _write(d: Path, tok: HFTokenizer, config: dict, jinja: str | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory, trained) -> Path:
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": "IGNORED {{ nonsense"}
    return _write(tmp_path_factory.mktemp("chatml"), trained, cfg, jinja=CHATML)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    # Like Llama 3 / DeepSeek: tokenizer.json's post-processor prepends BOS (add_bos_token only documents it).
    tok = _train()
    bos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    cfg = {
        "bos_token": "<|endoftext|>",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "add_bos_token": True,
        "chat_template": [{"name": "default", "template": CONFIG_TEMPLATE}, {"name": "other", "template": "x"}],
    }
    return _write(tmp_path_factory.mktemp("cfg"), tok, cfg)


@pytest.fixture(scope="module")
def stale_bos_dir(tmp_path_factory, trained) -> Path:
    # tokenizer_config says add_bos_token but tokenizer.json has no post-processor: transformers 5 adds no BOS.
    cfg = {"bos_token": "<|endoftext|>", "add_bos_token": True, "unk_token": "<unk-not-in-vocab>"}
    return _write(tmp_path_factory.mktemp("stale"), trained, cfg)


def _hf(d: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("which", ["chatml_dir", "config_dir", "stale_bos_dir"])
def test_encode_decode_match_transformers(which, request):
    d = request.getfixturevalue(which)
    ours, ref = Tokenizer.from_dir(d), _hf(d)
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_bos(chatml_dir, config_dir):
    chatml, cfg = Tokenizer.from_dir(chatml_dir), Tokenizer.from_dir(config_dir)
    im_start = chatml.token_to_id("<|im_start|>")
    assert im_start is not None and chatml.encode("<|im_start|>", add_special_tokens=True) == [im_start]
    assert chatml.bos_token_id is None and chatml.eos_token_ids == {chatml.token_to_id("<|im_end|>")}
    assert chatml.pad_token_id == chatml.token_to_id("<|endoftext|>")
    assert cfg.bos_token_id == cfg.token_to_id("<|endoftext|>")
    assert cfg.add_bos_token and not chatml.add_bos_token
    assert cfg.encode("hi")[0] == cfg.bos_token_id and cfg.encode("hi", add_special_tokens=False)[0] != cfg.bos_token_id
    assert cfg.token_to_id("not-a-token-xyz") is None
    cfg.add_eos_token_ids([7, 8])
    cfg.add_eos_token_ids(9)
    assert {7, 8, 9} <= cfg.eos_token_ids


def test_decode_out_of_vocab_ids(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    ids = tok.encode("Hello")
    assert tok.decode(ids + [tok.vocab_size, tok.vocab_size + 1000]) == "Hello"
    assert tok.decode([tok.vocab_size + 5]) == ""


@pytest.mark.parametrize("which", ["chatml_dir", "config_dir"])
def test_chat_template_matches_transformers(which, request):
    d = request.getfixturevalue(which)
    ours, ref = Tokenizer.from_dir(d), _hf(d)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(conv, add_generation_prompt=gen) == expected
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <in> a city"}}]
    expected = ref.apply_chat_template(CONVERSATIONS[0], tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=tools) == expected


def test_chat_template_errors(config_dir, tmp_path, trained):
    tok = Tokenizer.from_dir(config_dir)
    bad = [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "again"}]
    with pytest.raises(RequestError, match="roles must alternate") as e:
        tok.apply_chat_template(bad)
    assert "\n" not in str(e.value)
    for messages in ([], "hello", [{"content": "no role"}]):
        with pytest.raises(RequestError):
            tok.apply_chat_template(messages)
    bare = Tokenizer.from_dir(_write(tmp_path / "bare", trained, {}))
    assert not bare.has_chat_template
    with pytest.raises(UnsupportedError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])


def test_from_dir_errors(tmp_path, trained):
    with pytest.raises(CheckpointError, match="tokenizer.json") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = _write(tmp_path / "ok", trained, {})
    (d / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)
    d2 = _write(tmp_path / "syntax", trained, {}, jinja="{% for m in messages %}")
    with pytest.raises(StrataError, match="syntax error"):
        Tokenizer.from_dir(d2).apply_chat_template(CONVERSATIONS[0])


def test_load_tokenizer_is_none_only_without_any_tokenizer_files(tmp_path, trained):
    """A directory with no tokenizer files has no tokenizer (a model served by token ids); tokenizer files strata
    cannot read without tokenizer.json are an error that says how to write one; tokenizer.json loads."""
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(CheckpointError, match="no tokenizer.json.*save_pretrained") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
    tok = load_tokenizer(_write(tmp_path / "ok", trained, {}))
    assert isinstance(tok, Tokenizer) and tok.decode(tok.encode("Hello world")) == "Hello world"


@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_equals_decode(chatml_dir, skip):
    tok = Tokenizer.from_dir(chatml_dir)
    for text in TEXTS + ["🎉", "é", "你好世界🚀 mixed ünïcödé 👩‍👩‍👧 end"]:
        ids = tok.encode(text, add_special_tokens=False)
        dec = StreamDecoder(tok, skip_special_tokens=skip)
        pieces = [dec.push(i) for i in ids]
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), text
        assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters really are split across byte-level tokens here, so some pushes must return "".
    ids = tok.encode("👩‍👩‍👧", add_special_tokens=False)
    dec = StreamDecoder(tok)
    assert "" in [dec.push(i) for i in ids]


def test_stream_decoder_with_prompt_and_unknown_ids(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    gen = tok.encode("Bonjour, café 🎉!", add_special_tokens=False)
    dec = StreamDecoder(tok, prompt_ids=prompt)
    out = "".join(dec.push(i) for i in gen + [tok.vocab_size + 3]) + dec.flush()
    assert out == tok.decode(gen)


def test_stop_matcher_spanning_pieces():
    m = StopMatcher(["</answer>", "STOP"])
    out, stopped = m.feed("The result is 42</ans")
    assert (out, stopped) == ("The result is 42", False)
    out, stopped = m.feed("wer> trailing")
    assert (out, stopped) == ("", True) and m.matched == "</answer>"
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_stop_matcher_one_char_at_a_time():
    m = StopMatcher(["<|end|>"])
    emitted, stopped = "", False
    for ch in "abc <|e <|en <|end|> xyz":
        piece, stopped = m.feed(ch)
        emitted += piece
        if stopped:
            break
    assert stopped and emitted == "abc <|e <|en "


def test_stop_matcher_at_start_and_no_false_positive():
    m = StopMatcher(["\n\n"])
    assert m.feed("\n\nhello") == ("", True)
    m = StopMatcher(["stop"])
    text = ["st", "o", "p", "ping"]  # "stop" does complete here: "st"+"o"+"p"
    assert [m.feed(t) for t in text[:3]] == [("", False), ("", False), ("", True)]
    m = StopMatcher(["stop"])
    emitted = [m.feed(t)[0] for t in ["sto", "rm st", "ore", " s"]]
    assert "".join(emitted) == "storm store " and m.flush() == "s"
    assert not m.stopped


def test_stop_matcher_flush_releases_held_text_and_no_stops():
    m = StopMatcher(["ENDOFTEXT"])
    assert m.feed("partial END") == ("partial ", False)
    assert m.flush() == "END"
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False) and m.flush() == ""
    m = StopMatcher(["ab", "b"])  # earliest match wins
    assert m.feed("xab") == ("x", True) and m.matched == "ab"
