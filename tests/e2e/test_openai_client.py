"""The `openai` Python package against our OpenAI-compatible endpoints on a live server."""

import httpx
import openai
import pytest

pytestmark = pytest.mark.live_server_process


@pytest.fixture
def client(platform_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform_server.url}/v1", api_key=platform_server.key, max_retries=0)


def test_models_list_says_each_models_kind(client: openai.OpenAI) -> None:
    kinds = {m.id: getattr(m, "kind", None) for m in client.models.list()}
    assert kinds == {
        "demo-chat": "causal-lm",
        "demo-embed": "embedding",
        "demo-classify": "classifier",
        "demo-finetune": "causal-lm",  # the demo tenant's own (seed_demo), which only it lists
    }


def test_completion_json_and_stream_agree_under_greedy_decoding(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="demo-chat", prompt="hello", max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert whole.system_fingerprint == "demo-chat:v1"

    chunks = list(
        client.completions.create(
            model="demo-chat",
            prompt="hello",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks if c.choices)  # none empty
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_chat_completion_json_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="demo-chat", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content  # the role goes out with the first token, as OpenAI's
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_of_completions_and_chats_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="demo-chat", prompt="hello", max_tokens=6, temperature=0, logprobs=2
    )
    lp = whole.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    text = whole.choices[0].text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):  # where each token's text is
        assert "\ufffd" in token or text[offset : offset + len(token)] == token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # greedy: the token is the likeliest of its two alternatives, and a probability's log is <= 0
        assert len(top) <= 2 and logprob <= 0 and max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert top[token] == pytest.approx(logprob, abs=1e-5)

    # Sampled, with no alternatives asked: each token's own entry is there all the same.
    sampled = (
        client.completions.create(
            model="demo-chat", prompt="hello", max_tokens=6, temperature=1.5, seed=3, logprobs=0
        )
        .choices[0]
        .logprobs
    )
    assert sampled is not None
    assert sampled.top_logprobs == [
        {t: lp} for t, lp in zip(sampled.tokens, sampled.token_logprobs, strict=True)
    ]
    # Streamed: the offsets run on from chunk to chunk.
    chunks = client.completions.create(
        model="demo-chat", prompt="hello", max_tokens=6, temperature=0, logprobs=1, stream=True
    )
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="demo-chat", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 3 for entry in content)
    joined = bytes(b for entry in content for b in entry.bytes).decode("utf-8", errors="replace")
    assert joined.rstrip("\ufffd") == chat.choices[0].message.content.rstrip("\ufffd")
    streamed = client.chat.completions.create(
        model="demo-chat",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    # Equal to float32 rounding: the second request's prefill may start from the first's cached prefix,
    # a matmul of another shape, which on some CPUs (AVX-512 here) rounds differently in the last bits.
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-5)
    # Asked for none, none come.
    plain = client.chat.completions.create(model="demo-chat", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logit_bias_and_penalties_steer_the_text(client: openai.OpenAI, platform_server) -> None:
    """As the `openai` client sends them: a bias of 100 makes greedy decoding pick that token every
    time; a frequency penalty makes it leave a token it keeps choosing."""
    from pathlib import Path

    from serving.engine.loading import load_tokenizer

    tokenizer = load_tokenizer(Path(platform_server.env["SWITCHYARD_STATE_DIR"]) / "demo-model")
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    forced = client.completions.create(
        model="demo-chat", prompt="hello", max_tokens=5, temperature=0, logit_bias={str(a): 100}
    )
    assert forced.choices[0].text == "aaaaa"
    chat = {"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    repeating = client.chat.completions.create(temperature=0, logit_bias={str(a): 5}, **chat)
    assert repeating.choices[0].message.content == "aaaaaa"
    penalized = client.chat.completions.create(
        temperature=0, logit_bias={str(a): 5}, frequency_penalty=2.0, presence_penalty=2.0, **chat
    )
    assert penalized.choices[0].message.content != "aaaaaa"
    assert penalized.choices[0].message.content.startswith("a")  # the first "a" comes before any penalty


def test_n_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    """Each choice its own sequence: seeded, they differ from each other and each reproduces, streamed or
    not; the prompt counts once in the usage, every choice's completion."""
    one = client.completions.create(model="demo-chat", prompt="hello", max_tokens=6, temperature=0)
    assert one.usage is not None
    kwargs = {"model": "demo-chat", "prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    whole = client.completions.create(n=3, logprobs=1, **kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) > 1
    assert all(c.logprobs is not None and len(c.logprobs.tokens) == 6 for c in whole.choices)
    assert whole.usage is not None and whole.usage.prompt_tokens == one.usage.prompt_tokens
    assert whole.usage.completion_tokens == 18 and whole.usage.total_tokens == one.usage.prompt_tokens + 18
    assert [c.text for c in client.completions.create(n=3, **kwargs).choices] == texts

    chunks = list(
        client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1, 2] and {f.finish_reason for f in finishes} == {
        "length"
    }
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="demo-chat", messages=messages, max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same answer
    streamed_chat = list(
        client.chat.completions.create(
            model="demo-chat", messages=messages, max_tokens=4, temperature=0, n=2, stream=True
        )
    )
    roles = sorted(c.choices[0].index for c in streamed_chat if c.choices and c.choices[0].delta.role)
    assert roles == [0, 1]  # each choice opens with the assistant's role
    answers = ["", ""]
    for chunk in streamed_chat:
        for choice in chunk.choices:
            answers[choice.index] += choice.delta.content or ""
    assert answers == [chat.choices[0].message.content] * 2


def test_openai_errors_are_raised_as_typed_exceptions(client: openai.OpenAI, platform_server) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n must be an integer from 1 to 16"):
        client.completions.create(model="demo-chat", prompt="hi", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer from 0 to 5"):
        client.completions.create(model="demo-chat", prompt="hi", max_tokens=2, logprobs=6)
    chat = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="demo-chat", messages=chat, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be an integer from 0 to 20"):
        client.chat.completions.create(model="demo-chat", messages=chat, logprobs=True, top_logprobs=21)
    # Too long in characters, as too long in tokens: a 400 (it was a 413, which the client has no class for)
    with pytest.raises(openai.BadRequestError, match="the limit is 32768"):
        client.completions.create(model="demo-chat", prompt="x" * 40_000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="32768-character limit"):
        client.chat.completions.create(
            model="demo-chat", messages=[{"role": "user", "content": "x" * 40_000}]
        )
    bad = openai.OpenAI(base_url=f"{platform_server.url}/v1", api_key="sy-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="demo-chat", messages=[{"role": "user", "content": "x"}])


def test_streams_end_with_done(platform_server) -> None:
    with httpx.stream(
        "POST",
        f"{platform_server.url}/v1/completions",
        headers={"Authorization": f"Bearer {platform_server.key}"},
        json={"model": "demo-chat", "prompt": "hi", "max_tokens": 3, "stream": True},
        timeout=30,
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert response.headers["X-Served-Version"] == "v1"


def test_embeddings_in_both_encodings(client: openai.OpenAI) -> None:
    """The client asks for base64 by default and decodes it; "float" is JSON numbers. Both must agree."""
    texts = ["hello world", "the quick brown fox"]
    default = client.embeddings.create(model="demo-embed", input=texts)
    as_float = client.embeddings.create(model="demo-embed", input=texts, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1]
    for decoded, as_numbers in zip(default.data, as_float.data, strict=True):
        assert [*decoded.embedding] == pytest.approx(as_numbers.embedding, abs=1e-6)
    assert default.data[0].embedding != pytest.approx(default.data[1].embedding, abs=1e-3)
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError, match="this endpoint serves embedding models"):
        client.embeddings.create(model="demo-chat", input="hi")


def test_parameters_passed_as_none_a_negative_seed_and_cached_tokens(client: openai.OpenAI) -> None:
    """What the client sends for a parameter given as None is null, which is absent; seed -1 is a seed;
    the prefix cache's tokens read where the client looks for them."""
    words = "once upon a time there was a little robot who loved to read books about the sea"
    messages = [{"role": "user", "content": f"{words}, {words}"}]
    kwargs = {"model": "demo-chat", "messages": messages, "max_completion_tokens": 4, "seed": -1}
    first = client.chat.completions.create(temperature=None, top_p=None, **kwargs)
    again = client.chat.completions.create(temperature=None, top_p=None, **kwargs)
    assert first.usage is not None and first.usage.completion_tokens == 4
    assert again.choices[0].message.content == first.choices[0].message.content  # seeded: it reproduces
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt: a block or more cached


def test_vllms_sampling_fields_pass_through_extra_body(client: openai.OpenAI) -> None:
    """What a vLLM user sends through the openai client (extra_body) is served, not a 400; a context
    overflow is the 400 vLLM answers, as openai.BadRequestError."""
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True}
    completion = client.completions.create(
        model="demo-chat", prompt="hello", max_tokens=4, temperature=0.8, seed=1, extra_body=extra
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="demo-chat", prompt="hello", max_tokens=2048)
