"""DeepSeek-V4, GLM-4.5, DeepSeek-V2 and MiniMax-M2 checkpoints (the tiny `--arch` demo models) on the live server,
through the official `openai` client: chat through the model's chat template and plain completions, whole and
streamed, answer what the engine generates greedily for the same prompt, several prompts of one request decode in
shared steps as each does alone, and bad requests get OpenAI-shaped errors without taking the server down."""

from __future__ import annotations

import pytest
from test_server import MODEL, LiveServer, start_live_server

ARCHS = ["deepseek_v4", "glm4_moe", "deepseek_v2", "minimax_m2"]
CONTEXT = 256
CHAT = [{"role": "user", "content": "Tell me about the river and the valley."}]
CHATML = "<|im_start|>user\nTell me about the river and the valley.<|im_end|>\n<|im_start|>assistant\n"


def serve(model_dir) -> LiveServer:
    """A real uvicorn server on a free localhost port, in a thread, serving `model_dir` with a context of CONTEXT."""
    return start_live_server(model_dir, max_batch=4, max_queue=16, config={"runtime": {"max_context": CONTEXT}})


@pytest.fixture(scope="module", params=ARCHS)
def live(request, tmp_path_factory):
    from strata.runtime.demo.model import write_demo_model

    arch = request.param
    srv = serve(write_demo_model(tmp_path_factory.mktemp(arch) / "tiny", "tiny", arch=arch, engram=False,
                                 progress=False))
    assert srv.engine.checkpoint.config.model_type == arch
    yield srv
    srv.close()


def test_chat_answers_what_the_engine_generates(live):
    """A greedy chat completion, whole and streamed, is the engine's own greedy reply to the templated prompt."""
    c = live.client()
    assert live.engine.tokenizer.apply_chat_template(CHAT) == CHATML  # the demo's template, as the server renders it
    ids = live.engine.chat_prompt(CHAT)
    ref = live.engine.chat(CHAT, max_tokens=10)
    assert ref.token_ids  # the random model writes something before any EOS
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_completions_share_steps_and_answer_as_alone(live, monkeypatch):
    """Greedy completions of several prompts in one request (decoded in shared steps, each from its own cache) and
    a streamed one equal the engine's greedy generation of each prompt alone; generated logprobs are the top ones.
    The CPU kernel gives a token the same bits whatever else its expert computes; on an AMX CPU a shared prompt pass
    would hand experts of more than 12 tokens to torch's GEMMs, which do not, so every expert stays on the kernel."""
    from strata.kernels.cpu import experts as ce

    monkeypatch.setattr(ce, "torch_gemms_on_amx", lambda: False)
    c = live.client()
    prompts = ["In the beginning", "The river ran down through the valley of the", "Hello"]
    solo = [live.engine.generate(p, max_tokens=8) for p in prompts]
    r = c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, logprobs=1)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [s.text for s in solo]
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in solo)
    for ch in r.choices:
        for top, value in zip(ch.logprobs.top_logprobs, ch.logprobs.token_logprobs, strict=True):
            assert max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy took the most likely token
    parts = list(c.completions.create(model=MODEL, prompt=prompts[1], max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == solo[1].text


def test_bad_requests_get_openai_errors(live):
    """A prompt past the context and an out-of-range field are 400s the client reads as OpenAI errors (their param
    and code); the server answers the next request."""
    openai = pytest.importorskip("openai")
    c = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=[5] * (CONTEXT + 1), max_tokens=4)
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=CONTEXT)
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
