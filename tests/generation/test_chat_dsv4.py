"""DeepSeek-V4's chat encoding (strata.runtime.generation.text.chat_dsv4) against the test vectors of DeepSeek's release
(`encoding/tests/test_input_{1..4}.json` / `test_output_{1..4}.txt` of deepseek-ai/DeepSeek-V4-Flash and -Pro, MIT
licensed), kept in data/deepseek_v4/. Inputs 1 and 3 and outputs 1 and 3 are byte-identical to the release's (their
SHA-256 sums below were published beside them); 4 is vLLM's copy (tests/tokenizers_/fixtures/deepseek_v4), which names
reasoning `reasoning` where the release names it `reasoning_content` (so does 1 and 3's: renamed back); input 2 and
its output are rebuilt from the release's test file and two independent ports that embed them. The release's outputs
end without a newline, as these do.

Also: the request-facing `render_chat` (tools onto the system message, the thinking switches, refused internal
roles), and `Tokenizer` using it for a deepseek_v4 checkpoint without a chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from strata.errors import RequestError
from strata.runtime.generation.text.chat_dsv4 import (
    ASSISTANT,
    BOS,
    EOS,
    REASONING_EFFORT_MAX,
    THINK_END,
    THINK_START,
    USER,
    encode_messages,
    render_chat,
)

DATA = Path(__file__).parent / "data" / "deepseek_v4"
# (vector, thinking mode) as the release's test_encoding_dsv4.py encodes each
VECTORS = [(1, "thinking"), (2, "thinking"), (3, "thinking"), (4, "chat")]
PUBLISHED_SHA256 = {"test_input_1.json": "10e0c074c977c3a80daab758af28219c6b1c2bd7f3f5cf2890c84b361cc32897",
                    "test_output_1.txt": "9b366d9d2eac842a6e890594aac0b58648e5623717202b33497afadf03e26540",
                    "test_output_3.txt": "b3b1cd8748b7b90d3c6be6da3f786f12e4d70be073bd445ea162dfad4dc01a64"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def _messages(n: int) -> list[dict]:
    data = json.loads((DATA / f"test_input_{n}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # vector 1: tools beside the messages, put on the system message as the release does
        data["messages"][0]["tools"] = data["tools"]
        return data["messages"]
    return data


def test_the_vectors_are_the_published_bytes():
    """The committed copies are the release's files (a transcription slip would fail here, not as an encoder bug)."""
    for name, digest in PUBLISHED_SHA256.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize(("n", "mode"), VECTORS)
def test_encode_messages_reproduces_the_release_vectors(n, mode):
    assert encode_messages(_messages(n), mode) == (DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")


def test_render_chat_builds_vector_1_from_an_openai_request():
    """Tools given beside the messages (as a request sends them) go onto the system message: the release's output 1
    exactly."""
    data = json.loads((DATA / "test_input_1.json").read_text(encoding="utf-8"))
    assert render_chat(data["messages"], tools=data["tools"]) == (DATA / "test_output_1.txt").read_text("utf-8")


def test_thinking_switches_and_generation_prompt():
    chat = [{"role": "user", "content": "Hi"}]
    assert render_chat(chat) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_START}"  # thinking unless turned off
    assert render_chat(chat, enable_thinking=False) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}"
    assert render_chat(chat, thinking=False) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}"
    assert render_chat(chat, enable_thinking=False, thinking=True).endswith(THINK_START)
    assert render_chat(chat, reasoning_effort="none").endswith(THINK_END)
    assert render_chat(chat, reasoning_effort="max") == f"{BOS}{REASONING_EFFORT_MAX}{USER}Hi{ASSISTANT}{THINK_START}"
    assert render_chat(chat, reasoning_effort="low") == render_chat(chat)  # only max changes the prompt
    assert render_chat(chat, False) == f"{BOS}{USER}Hi"
    with pytest.raises(RequestError, match="enable_thinking must be true or false"):
        render_chat(chat, enable_thinking="yes")


def test_earlier_reasoning_is_dropped_unless_asked_or_tools_are_given():
    chat = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "a", "reasoning_content": "old"},
            {"role": "user", "content": "B"}]
    assert render_chat(chat) == f"{BOS}{USER}A{ASSISTANT}{THINK_END}a{EOS}{USER}B{ASSISTANT}{THINK_START}"
    kept = f"{BOS}{USER}A{ASSISTANT}{THINK_START}old{THINK_END}a{EOS}{USER}B{ASSISTANT}{THINK_START}"
    assert render_chat(chat, drop_thinking=False) == kept
    assert "old</think>" in render_chat(chat, tools=[WEATHER])


def test_tools_go_on_the_system_message_or_lead_the_prompt():
    with_system = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
                              tools=[WEATHER])
    assert with_system.startswith(f"{BOS}Be brief.\n\n## Tools\n\n")
    assert '{"name": "get_weather", "description": "The weather"' in with_system
    alone = render_chat([{"role": "user", "content": "x"}], tools=[WEATHER])
    assert alone.startswith(f"{BOS}\n\n## Tools\n\n") and alone.endswith(f"{USER}x{ASSISTANT}{THINK_START}")


def test_tool_results_merge_into_one_user_turn_in_call_order():
    calls = [{"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "B"}'}},
             {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "A"}}}]
    text = render_chat([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
                        {"role": "tool", "tool_call_id": "a", "content": "ra"},
                        {"role": "tool", "tool_call_id": "b", "content": "rb"}], enable_thinking=False)
    assert text.endswith(f"{EOS}{USER}<tool_result>rb</tool_result>\n\n<tool_result>ra</tool_result>"
                         f"{ASSISTANT}{THINK_END}")


@pytest.mark.parametrize(("message", "error"), [
    ({"role": "developer", "content": "x"}, "no developer role"),
    ({"role": "user", "content": "x", "task": "action"}, "quick-instruction tasks are not supported"),
    ({"role": "function", "content": "x"}, "no role 'function'"),
])
def test_internal_roles_and_tasks_are_refused_in_one_line(message, error):
    with pytest.raises(RequestError, match=error) as e:
        render_chat([message])
    assert "\n" not in str(e.value)


def test_a_deepseek_v4_checkpoint_without_a_template_renders_through_the_encoder(tmp_path):
    """`Tokenizer.from_dir` gives a deepseek_v4 checkpoint with no template the built-in renderer (and not another
    model type); a template of the checkpoint's own wins."""
    from strata.runtime.demo.tokenizer import write_tokenizer_files
    from strata.runtime.generation.text.tokenizer import Tokenizer

    write_tokenizer_files(tmp_path, 512, 256)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.has_chat_template
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, enable_thinking=False) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert not Tokenizer.from_dir(tmp_path).has_chat_template
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    (tmp_path / "chat_template.jinja").write_text("T:{{ messages[0].content }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(chat) == "T:Hi"
