"""Prompts and completions are logged only when sampled logging is on, and then redacted."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from django.test import AsyncClient
from hypothesis import given
from hypothesis import strategies as st

from serving.telemetry.prompt_log import LOGGED_CHARS, redact

SECRETS = {
    "an e-mail address": ("write to jane.doe+ml@example.co.uk today", "[EMAIL]"),
    "one of our keys": ("key sy-AbC123_dEf456-ghIJ789 works", "[SECRET]"),
    "another provider's key": ("OPENAI sk-proj1234abcd5678efgh", "[SECRET]"),
    "a bearer token": ("Authorization: Bearer eyJhbGciOi.J9.abc-def", "Bearer [SECRET]"),
    "an AWS key": ("id AKIAIOSFODNN7EXAMPLE here", "[SECRET]"),
    "a digest": ("sha 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "[SECRET]"),
    "a card number": ("card 4111 1111 1111 1111 exp", "[NUMBER]"),
    "a phone number": ("call +1 (555) 123-4567 now", "[NUMBER]"),
    "an IP address": ("from 192.168.10.254 at noon", "[IP]"),
    "an IPv6 address": ("from 2001:db8:85a3::8a2e:370:7334 at noon", "[IP]"),
    "a base64 secret": ("AWS_SECRET wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY ok", "[SECRET]"),
    "a password in a URL": ("dsn postgres://app:S3cret!@db:5432/x", "postgres://[SECRET]@db"),
    "a password pair": ("login password=hunter2 please", "password=[SECRET]"),
    "basic credentials": ("Authorization: Basic dXNlcjpwYXNzd29yZA== sent", "Basic [SECRET]"),
    "a private key": (
        "key -----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY----- end",
        "key [SECRET] end",
    ),
}


@pytest.mark.parametrize("kind", SECRETS)
def test_each_kind_of_secret_is_replaced(kind: str) -> None:
    text, placeholder = SECRETS[kind]
    redacted = redact(text)
    assert placeholder in redacted
    assert redacted.split()[0] == text.split()[0]  # the words around it stay


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("set DB_PASSWORD=hunter2 now", "set DB_PASSWORD=[SECRET] now"),
        ("PGPASSWORD=hunter2 psql", "PGPASSWORD=[SECRET] psql"),
        ("export GITHUB_TOKEN=abc123", "export GITHUB_TOKEN=[SECRET]"),
        ("OPENAI_API_KEY=sk-abc in .env", "OPENAI_API_KEY=[SECRET] in .env"),
        (
            "/cb?access_token=ya29abc&client_secret=hunter2",
            "/cb?access_token=[SECRET]&client_secret=[SECRET]",
        ),
        ('{"password":"hunter2","user":"jo"}', '{"password":[SECRET],"user":"jo"}'),
        ("{'api_key': 'abc123'}", "{'api_key': [SECRET]}"),
        ('password: "correct horse battery" ok', "password: [SECRET] ok"),
        ("max_tokens=5, tokens: 7, secretary: Bob", "max_tokens=5, tokens: 7, secretary: Bob"),
        # a password holds any character but a space: & ; ' , are part of it, an escaped quote too
        ("password: Tr0ub4dor&3horse x", "password: [SECRET] x"),
        ("password=O'Brien1984 y", "password=[SECRET] y"),
        ("DB_PASSWORD=P@ss;w0rd,! z", "DB_PASSWORD=[SECRET] z"),
        ('"api_key": "ab\\"cd" next', '"api_key": [SECRET] next'),
        ("token: " + "x" * 300 + " end", "token: [SECRET] end"),
    ],
)
def test_secret_pairs_with_prefixed_or_quoted_names_are_redacted(text: str, expected: str) -> None:
    """Names as .env files, JSON, YAML and query strings write them; not names that only contain a
    secret's word (max_tokens, secretary)."""
    assert redact(text) == expected


@pytest.mark.parametrize(
    "cut_after", [8, 14, 30]
)  # characters of what follows the key that fit before the cut
def test_a_secret_past_what_is_logged_leaves_no_fragment_in_it(cut_after: int) -> None:
    """A long key shrinks to a placeholder, and whatever followed it moves inside the logged part: none
    of it may be a piece of a secret the patterns did not see whole."""
    begin, end = "-----BEGIN PRIVATE KEY-----", "-----END PRIVATE KEY-----"
    body = "a1" * ((2 * LOGGED_CHARS - cut_after - len(begin) - len(end)) // 2)
    text = f"{begin}{body}{end}" + " alice.smith@example.com +1 555 867 5309 end"
    redacted = redact(text)
    for fragment in ("alice", "smith", "example", "555", "867", "5309"):
        assert fragment not in redacted, (fragment, redacted[-80:])


def test_ordinary_text_and_short_numbers_stay_and_long_text_is_cut() -> None:
    text = "In 2026 the 42 trains carried 1,250 parcels between 3 towns at 12:30:45: version v2.1 (build 77)."
    assert redact(text) == text
    long = redact("word " * 1000)
    assert len(long) < LOGGED_CHARS + 40 and long.endswith("[3000 more characters]")


_word = st.text(alphabet="abcdefghij klmnop.,!?", max_size=30)
_email = st.builds(
    "{}@{}.{}".format,
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._+-", min_size=1, max_size=12),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=10),
    st.sampled_from(["com", "org", "io", "co.uk"]),
)
_number = st.lists(st.integers(0, 9), min_size=9, max_size=19).map(lambda ds: "".join(map(str, ds)))
_key = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=8, max_size=40
)


_base64 = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/", min_size=22, max_size=60
).map(
    lambda t: f"{t}7Q="  # a digit and a letter, as any real key of that length has
)


@given(
    before=_word,
    after=_word,
    secret=st.one_of(_email, _number, _key.map(lambda k: f"sy-{k}"), _base64),
)
def test_a_secret_anywhere_in_text_never_survives(before: str, after: str, secret: str) -> None:
    redacted = redact(f"{before} {secret} {after}")
    assert secret not in redacted
    assert redact(redacted) == redacted  # the placeholders are not themselves redacted again


# --- through the API ---------------------------------------------------------------------------------

pytestmark_db = pytest.mark.django_db(transaction=True)
PROMPT = "Hello from jane.doe@example.com, my card is 4111 1111 1111 1111, please reply"


async def _infer(acme) -> dict:  # type: ignore[no-untyped-def]
    response = await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        data=json.dumps({"input": PROMPT, "max_tokens": 6, "temperature": 0}),
        content_type="application/json",
        headers=acme.auth,
    )
    assert response.status_code == 200
    return {**response.json(), "request_id": response.headers["X-Request-Id"]}


@pytestmark_db
async def test_by_default_no_log_record_anywhere_holds_the_prompt_or_the_output(acme, caplog) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level
    body = await _infer(acme)
    for _ in range(10):  # a sampled record would be written by a task on this loop as the request ends
        await asyncio.sleep(0)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for secret in ("jane.doe@example.com", "4111 1111", "my card is", "Hello from"):
        assert secret not in logged
    if len(body["output"].strip()) >= 10:  # long enough not to turn up in other text by chance
        assert body["output"].strip() not in logged


@pytestmark_db
async def test_a_sampled_request_is_logged_once_redacted(acme, caplog, settings) -> None:
    settings.LOG_PROMPTS_SAMPLE_RATE = 1.0
    caplog.set_level(logging.INFO, logger="switchyard.prompts")
    body = await _infer(acme)
    for _ in range(100):  # written by a task once the request has ended
        if any(r.name == "switchyard.prompts" for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    (record,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "switchyard.prompts"]
    assert record == {
        "request_id": body["request_id"],
        "tenant": "acme",
        "model": "demo-chat",
        "version": "v1",
        "input": "Hello from [EMAIL], my card is [NUMBER], please reply",
        "completed": True,
        "output": redact(body["output"]),
    }


class _EndedHandle:
    """A dispatched request as maybe_log sees it, already ended with an empty output."""

    request_id, model_name, version = "r1", "m", "v1"

    def capture_text(self) -> asyncio.Future[str | None]:
        done = asyncio.get_running_loop().create_future()
        done.set_result("")
        return done


async def test_chat_messages_and_embedding_inputs_are_redacted_and_vectors_never_logged(
    settings, caplog
) -> None:
    from serving.telemetry import prompt_log

    settings.LOG_PROMPTS_SAMPLE_RATE = 1.0
    caplog.set_level(logging.INFO, logger="switchyard.prompts")
    chat = {"messages": [{"role": "user", "content": "mail me at a@b.io"}], "input": None, "inputs": None}
    embed = {"input": None, "messages": None, "inputs": ["call 555 123 4567", "hi"]}
    assert prompt_log.maybe_log(_EndedHandle(), tenant="t", submission=chat)
    assert prompt_log.maybe_log(_EndedHandle(), tenant="t", submission=embed)
    while prompt_log._writing:
        await asyncio.sleep(0)
    records = [json.loads(r.getMessage()) for r in caplog.records]
    (chat_record,) = [r for r in records if "output" in r]  # written in either order
    (embed_record,) = [r for r in records if "output" not in r]
    assert chat_record["input"] == [{"role": "user", "content": "mail me at [EMAIL]"}]
    assert chat_record["output"] == "" and chat_record["completed"]
    assert embed_record["input"] == ["call [NUMBER]", "hi"] and "output" not in embed_record
    settings.LOG_PROMPTS_SAMPLE_RATE = 0.0
    assert not prompt_log.maybe_log(_EndedHandle(), tenant="t", submission=chat)


async def test_redaction_runs_off_the_event_loop_and_logs_at_most_eight_of_many_inputs(
    settings, caplog, monkeypatch
) -> None:
    """Redacting is up to a tenth of a second over a text made to be slow, and an embedding request may
    carry 2,048 texts: on the gateway's loop it held every other request."""
    import threading

    from serving.telemetry import prompt_log

    threads = set()
    real = prompt_log.redact

    def watched(text: str) -> str:
        threads.add(threading.current_thread())
        return real(text)

    monkeypatch.setattr(prompt_log, "redact", watched)
    settings.LOG_PROMPTS_SAMPLE_RATE = 1.0
    caplog.set_level(logging.INFO, logger="switchyard.prompts")
    embed = {"input": None, "messages": None, "inputs": [f"text {i}" for i in range(20)]}
    assert prompt_log.maybe_log(_EndedHandle(), tenant="t", submission=embed)
    while prompt_log._writing:
        await asyncio.sleep(0)
    (record,) = [json.loads(r.getMessage()) for r in caplog.records]
    assert record["input"] == [f"text {i}" for i in range(8)] + ["…[12 more inputs]"]
    # its own thread: not the loop's default pool, which key lookups and routing reads wait for
    assert {t.name.split("_")[0] for t in threads} == {"prompt-log-redaction"}


async def test_a_record_that_finds_the_redaction_backlogged_is_dropped_with_a_warning(
    settings, caplog, monkeypatch
) -> None:
    from serving.telemetry import prompt_log
    from serving.throttle import Throttle

    monkeypatch.setattr(prompt_log, "MAX_REDACTING", 0)
    monkeypatch.setattr(
        prompt_log, "_dropped_warning", Throttle()
    )  # another test's warning is not this one's
    settings.LOG_PROMPTS_SAMPLE_RATE = 1.0
    caplog.set_level(logging.INFO)
    assert prompt_log.maybe_log(_EndedHandle(), tenant="t", submission={"input": "hello", "messages": None})
    while prompt_log._writing:
        await asyncio.sleep(0)
    assert not [r for r in caplog.records if r.name == "switchyard.prompts"]
    assert any("records are being dropped" in r.getMessage() for r in caplog.records)
