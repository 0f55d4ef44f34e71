"""A replica's preparing thread: makes each submission ready for the engine (its sampling parameters
checked, a chat rendered, the prompt tokenized) while the model thread runs the step in progress, and puts
it in the inbox; the model thread only adds it. Tokenizing on the model thread cost each new request's
step ~0.1-0.5 ms for a short prompt here, and a prompt of 32,768 characters (the gateway's limit) held
every running sequence ~9 ms (docs/architecture.md, "Tokenizing off the model thread").

One thread, so arrivals reach the inbox in the order they came. The Rust tokenizer releases the GIL inside
transformers' call, so the loop and the model thread run on meanwhile (a chat template and the Python
around the tokenizer do hold it)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2
from django.conf import settings

from serving.replica.adapters import AdapterUnavailable, ReplicaAdapters, adapter_version
from serving.replica.inbox import Inbox
from serving.replica.step_result import Arrival, Route
from serving.transport.protocol import Submit, error_event, max_tokens_for

logger = logging.getLogger(__name__)


class Preparer:
    def __init__(self, inbox: Inbox, *, replica_id: str, thread_name: str) -> None:
        self._inbox = inbox
        self._replica_id = replica_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self.engine: Any = None  # set once the replica's engine is loaded
        self.adapters = ReplicaAdapters(replica_id=replica_id)  # LoRA adapters read on first use

    def submit(self, submission: Submit | None, abort: str | None) -> None:
        """On the loop, after Inbox.count_in() said the arrival is to be prepared here."""
        try:
            self._executor.submit(self.put, submission, abort)
        except RuntimeError:  # shut down: the replica is stopping, and nothing will take it
            self._inbox.count_out()

    def put(self, submission: Submit | None, abort: str | None) -> None:
        arrival = self.prepare(submission) if submission is not None else None
        self._inbox.put(arrival, abort)

    def prepare(self, submit: Submit) -> Arrival:
        """Everything about a submission the engine itself need not do: never raises, a failure is the
        arrival's error. Reads the tokenizer only (concurrent reads are safe; nothing here sets its
        truncation or padding, the one thing that would not be)."""
        # Deferred (torch, via the engine's package): see serving/replica/engine_loading.py.
        from serving.engine.chat import encode_chat_prompt
        from serving.engine.sequence import TIER_NAMES, SamplingParams, TenantLimits

        request_id = submit.request_id
        route = Route(
            submit.reply_to,
            submit.submitted_at or time.time(),
            wants_keepalives=submit.keepalives is True,
        )
        arrival = Arrival(request_id, route)
        try:
            if submit.adapter is not None:  # an adapter version of this base: its metrics are its own
                route.adapter = adapter_version(submit)
                arrival.adapter = self.adapters.get(submit, self.engine)
            raw = submit.params
            fields = {**raw, "stop": tuple(raw.get("stop") or ())}
            if "logit_bias" in raw:
                fields["logit_bias"] = tuple(tuple(pair) for pair in raw["logit_bias"])
            response_format = fields.pop("response_format", None)
            if response_format is not None:  # compiled here, off the model thread, once per schema
                if not isinstance(response_format, dict):
                    raise ValueError("response_format must be an object")
                fields["grammar"] = self.engine.grammars.compile(response_format)
            to_context = "max_tokens" in raw and raw["max_tokens"] is None  # chat's default: to the end
            if to_context:
                fields["max_tokens"] = 1  # set below, once the prompt's length is known
            arrival.params = SamplingParams(**fields)
            if submit.service_tier not in TIER_NAMES:
                raise ValueError(f"service_tier must be one of {', '.join(TIER_NAMES)}")
            arrival.tier = TIER_NAMES.index(submit.service_tier)
            if submit.max_running is not None or submit.kv_share is not None:
                arrival.limits = TenantLimits(max_running=submit.max_running, kv_share=submit.kv_share)
                arrival.limits.validate()
            inputs = submit.inputs  # a non-generative request's texts
            if inputs is not None:
                if not isinstance(inputs, list) or not all(isinstance(t, str) for t in inputs):
                    raise ValueError("inputs must be a list of strings")
                encoded = [self.engine.encode(t) for t in inputs]
                arrival.prompt_ids, arrival.num_prompt_tokens = encoded, sum(map(len, encoded))
            else:
                if submit.input is not None:
                    arrival.prompt_ids = self.engine.encode(submit.input)
                elif submit.messages is not None:
                    tools = submit.tools  # a chat's, for its template (serving/engine/chat.py)
                    if tools is not None and not (
                        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
                    ):
                        raise ValueError("tools must be a list of objects")
                    arrival.prompt_ids = encode_chat_prompt(
                        self.engine.tokenizer, submit.messages, self.engine.encode, tools
                    )
                else:
                    raise ValueError("a submission needs an input, messages or inputs")
                arrival.num_prompt_tokens = len(arrival.prompt_ids)
                context = self.engine.max_model_len
                if not to_context and arrival.num_prompt_tokens + arrival.params.max_tokens > context:
                    # As vLLM answers it (a 400), not an output cut short at the context's end.
                    raise ValueError(
                        f"this model's context is {context} tokens, and the prompt's "
                        f"{arrival.num_prompt_tokens} tokens with max_tokens {arrival.params.max_tokens} "
                        "would pass it: shorten the prompt or lower max_tokens"
                    )
                if to_context:  # as far as the context goes, and as far as the KV cache could hold
                    room = self.engine.max_output_tokens(arrival.num_prompt_tokens, arrival.limits)
                    max_tokens = max_tokens_for(None, room=room, limit=settings.MAX_TOKENS_LIMIT)
                    arrival.params = dataclasses.replace(arrival.params, max_tokens=max_tokens)
            arrival.tenant = submit.tenant or "default"
            arrival.cache_group = submit.cache_group
        except AdapterUnavailable as exc:  # the adapter version's failure, not the request's
            arrival.error = error_event("internal_error", str(exc))
        except (TypeError, ValueError, KeyError) as exc:
            arrival.error = error_event("invalid_request_error", str(exc))
        except Exception as exc:
            if type(exc) is jinja2.TemplateError:
                # The template's raise_exception refused the conversation (roles that do not alternate,
                # say): the request's fault. Its subclasses (a template that does not parse, an undefined
                # name) are the version's.
                arrival.error = error_event("invalid_request_error", str(exc))
            else:
                logger.exception("replica %s: could not prepare request %s", self._replica_id, request_id)
                arrival.error = error_event("internal_error", "the replica could not admit it")
        return arrival

    async def shutdown(self) -> None:
        """Wait for a preparation under way; those not started are dropped (nothing would serve them)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True)
