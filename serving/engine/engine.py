"""The engine facade of one replica: schedule -> run -> postprocess, one step at a time.

    engine = Engine(model_dir, config=EngineConfig(max_num_seqs=64))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32), tenant_id="acme")
    while engine.has_unfinished():
        for out in engine.step(): ...   # new tokens and text per request, finish reasons, timings

Not thread-safe: one thread (the replica's model thread) owns an engine."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.grammar import GrammarCompiler
from serving.engine.grammar_mask import mask_logits
from serving.engine.kv_budget import kv_cache_budget
from serving.engine.kv_cache import KVCacheManager, blocks_of_share
from serving.engine.loading import load_tokenizer, prompt_encoder
from serving.engine.logit_adjust import adjust_logits
from serving.engine.logprobs import LogprobReader, TokenLogprob
from serving.engine.lora import LoraAdapter, check_adapter_fits
from serving.engine.lora_batch import FusedLoraWeights, lora_step
from serving.engine.lora_slots import AdapterSlots
from serving.engine.runner import ModelRunner
from serving.engine.sampling import Sampler, make_generator
from serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, latest_ends_in_steps
from serving.engine.sequence import DEFAULT_TIER, FinishReason, SamplingParams, Sequence, TenantLimits
from serving.engine.token_bytes import token_bytes_reader

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int | None = None  # None: a share of the device's memory (serving/engine/kv_budget.py)
    gpu_memory_fraction: float = 0.8  # of the GPU memory free once the weights are loaded
    cpu_memory_fraction: float = 0.5  # of the host memory available, at most what the engine can fill
    block_size: int = 16
    max_running_per_tenant: int | None = None
    max_blocks_per_tenant: int | None = None
    max_kv_share_per_tenant: float | None = None  # the same cap as a share of the pool, whatever its size
    tier_aging_s: float = 10.0  # a waiting flex sequence's promotion to the default tier (tiers.py)
    enable_prefix_caching: bool = True
    compile: bool = False  # torch.compile the gather path's decode attention (slow warm-up)
    # "auto": the engine's own fused forward for the Llama family, transformers' modules for the rest;
    # "fused" refuses a model it cannot serve; "generic" always transformers' (serving/engine/runner.py)
    forward: str = "auto"
    # "auto": the native paged kernel on a CPU in fp32 where it builds, else gather + SDPA; "native"
    # refuses to start without it; "gather" always the gather path
    attention: str = "auto"
    # fp32 on a CPU: Linear weights in oneDNN's format (engine/packing.py); None: if timing says it pays
    pack_linear: bool | None = None
    device: str | None = None
    seed: int | None = None  # the shared sampler's seed, for reproducible unseeded sampling in tests
    max_loras: int = 8  # LoRA adapters resident at once (lora_slots.py); the fused forward only
    # A tail of up to half a block kept in half a block, where the attention reads it (half_blocks.py)
    half_block_tails: bool = True
    max_lora_rank: int = 64


def _tenant_block_cap(config: EngineConfig, num_blocks: int) -> int | None:
    """The tighter of the two per-tenant block caps, the share counted in this pool's blocks."""
    caps = [config.max_blocks_per_tenant] if config.max_blocks_per_tenant is not None else []
    if config.max_kv_share_per_tenant is not None:
        if not 0 < config.max_kv_share_per_tenant <= 1:
            raise ValueError("max_kv_share_per_tenant must be in (0, 1]")
        caps.append(blocks_of_share(config.max_kv_share_per_tenant, num_blocks))
    return min(caps) if caps else None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    is_finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_batched_tokens: int  # in the last step
    num_scheduled_seqs: int  # in the last step
    kv_allocated_slots: int  # token slots in blocks held by running sequences
    kv_used_slots: int  # tokens those sequences hold in the cache
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_steps: int
    adapters_resident: tuple[str, ...] = ()  # LoRA adapters installed, least recently used first
    num_adapter_loads: int = 0  # installs since start (after an eviction, a reload counts again)
    num_adapter_evictions: int = 0


@dataclass(slots=True)
class _RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""  # emitted so far
    held_text: str = ""  # decoded but held back: it might be the start of a stop string
    num_reported_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # sampled, not yet reported


def _take_logprobs(state: _RequestState) -> list[TokenLogprob]:
    """The log probabilities sampled since the last report, which this one reports."""
    reported, state.logprobs = state.logprobs, []
    return reported


def _apply_stop_strings(
    state: _RequestState,
    new_text: str,
    *,
    is_finished: bool,
    num_unchecked: int,
    finish: Callable[[str, FinishReason], object],
) -> tuple[str, bool]:
    """Return the text safe to emit now. The last len(longest stop) - 1 characters are held back, since
    they may begin a stop string the next token completes; a completed stop string cuts the text there
    and finishes the request (the stop string itself is not emitted, as in the OpenAI API).
    Only a stop that ends past the held text and the new text's first `num_unchecked` characters counts:
    the held text was looked at already, and those characters came before the min_tokens-th token, before
    which no stop string is looked for (vLLM's min_tokens)."""
    stops = state.seq.params.stop
    pending = state.held_text + new_text
    checked_from = len(state.held_text) + num_unchecked
    found = (pending.find(s, max(0, checked_from - len(s) + 1)) for s in stops)
    hits = [i for i in found if i != -1]
    if hits:
        state.held_text = ""
        if is_finished:
            state.seq.finish_reason = FinishReason.STOP
        else:
            finish(state.seq.request_id, FinishReason.STOP)
        return pending[: min(hits)], True
    if is_finished:
        state.held_text = ""
        return pending, True
    num_held = min(len(pending), max(len(s) for s in stops) - 1)
    state.held_text = pending[len(pending) - num_held :]
    return pending[: len(pending) - num_held], False


def _kv_cache_bytes(config: EngineConfig, device: torch.device, max_useful_bytes: int) -> int:
    """The KV cache's size: the config's, else a share of the device's memory (kv_budget.py), which the
    runner asks once the weights are loaded. Replicas that share a GPU should each be given a size: the
    first would take the share of all."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    budget = kv_cache_budget(
        device=device,
        max_useful_bytes=max_useful_bytes,
        gpu_memory_fraction=config.gpu_memory_fraction,
        cpu_memory_fraction=config.cpu_memory_fraction,
    )
    logger.info("KV cache: %d MiB on %s (%s)", budget.num_bytes >> 20, device, budget.reason)
    return budget.num_bytes


def probe_device(device: torch.device) -> None:
    """The smallest round trip through the device, which fails where its context is broken."""
    torch.ones(1, device=device).add_(1).cpu()


class StepFailed(RuntimeError):
    """A step failed after scheduling: the requests of its batch (`request_ids`) are lost, and the
    caller ends them; the engine's other requests are as they were. The message is the cause's."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(str(cause))
        self.request_ids = request_ids


class Engine:
    def __init__(self, model_dir: str | Path, *, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        device = torch.device(config.device) if config.device else None
        self.runner = ModelRunner(
            model_dir,
            device=device,
            kv_cache_bytes=functools.partial(_kv_cache_bytes, config),  # asked after the weights load
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            compile_attention=config.compile,
            pack_linear=config.pack_linear,
            forward=config.forward,
            attention=config.attention,
        )
        self.tokenizer: Any = load_tokenizer(model_dir)
        self._encode = prompt_encoder(self.tokenizer)
        eos = self.runner.model.generation_config.eos_token_id
        eos_ids = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        self._extra_eos_ids = tuple(eos_ids[1:])
        self._eos_ids = tuple(eos_ids)  # min_tokens holds every one of them back (logit_adjust.py)
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            is_prefix_caching_enabled=config.enable_prefix_caching,
            half_block_tails=config.half_block_tails and self.runner.reads_half_blocks,
        )
        # LoRA adapters' slots (lora_slots.py), installed in the runner's layout on first use
        self.adapters: AdapterSlots[LoraAdapter, FusedLoraWeights] = AdapterSlots(
            max_loras=config.max_loras, prepare=self.runner.prepare_adapter
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.runner.max_model_len,
                block_size=config.block_size,
                max_running_per_tenant=config.max_running_per_tenant,
                max_blocks_per_tenant=_tenant_block_cap(config, self.runner.num_blocks),
                eos_token_id=eos_ids[0] if eos_ids else None,
                tier_aging_s=config.tier_aging_s,
            ),
            self.kv_cache,
            adapters=self.adapters,
        )
        self.sampler = Sampler(seed=config.seed)
        self._requests: dict[str, _RequestState] = {}
        self._logprobs = LogprobReader(token_bytes_reader(self.tokenizer))
        # response_format's grammars, compiled on the replica's preparing thread (grammar.py)
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size=self.runner.vocab_size, eos_ids=eos_ids)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def max_output_tokens(self, num_prompt_tokens: int, limits: TenantLimits | None = None) -> int:
        """The most tokens a prompt this long can ever be given: the context limit's room, or less where
        the KV cache (or a tenant's share of it) could not hold that much."""
        return self.scheduler.max_output_tokens(num_prompt_tokens, limits)

    def encode(self, text: str) -> list[int]:
        """The prompt's ids, as `self.tokenizer(text)["input_ids"]` gives them. Safe to call from another
        thread than the one stepping the engine (the replica prepares prompts on one of its own)."""
        return self._encode(text)

    def warmup(self) -> None:
        # Timed with the sampling a default request gets, since the step the replica times holds it too;
        # with a seed of its own, so that the engine's seeded draws are the same as without a warm-up.
        params = SamplingParams(seed=0)
        generator = make_generator(params)
        self.runner.warmup(sample=lambda logits: self.sampler(logits, [params], [generator]))

    def probe(self) -> None:
        """One token's forward pass through the model, on a block of its own and outside the
        scheduler; raises what the device raises. After steps that failed one after another it tells a
        broken device (a sticky CUDA error fails every call) from requests that fail on their own, none
        of which it holds. Model thread only."""
        # An id no caller holds: the KV cache keys its blocks by request id, and a caller's request named
        # like the probe would lose its blocks when the probe frees its own.
        seq = Sequence(request_id=f"probe-{uuid.uuid4().hex}", prompt_token_ids=[0])
        # An empty block only: taking a cached one would evict a prefix that requests could still use,
        # and allocate() would count the probe among the prefix cache's queries.
        if not self.kv_cache.lend_empty_block(seq):  # none empty: the device alone is checked
            probe_device(self.runner.device)
            return
        try:
            self.runner.execute(self.runner.build_batch([seq], [1])).cpu()
        finally:
            self.kv_cache.free(seq)

    @property
    def base_step_s(self) -> float:
        """A step's time with one sequence decoding (measured by warmup(); 0 before it): the fixed
        cost that batching shares out, which the autoscaler weighs the steps' times against. It leaves
        out the scheduler's and the detokenizer's few microseconds for one sequence."""
        return self.runner.base_step_s

    # --- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        tenant_id: str = "default",
        cache_group: str | None = None,
        arrival_time: float | None = None,
        tier: int = DEFAULT_TIER,
        limits: TenantLimits | None = None,
        adapter: LoraAdapter | None = None,
    ) -> None:
        """Queue a request. Raises ValueError, with nothing allocated, for a request this engine can
        never serve (empty or too-long prompt, max_tokens beyond the context, bad sampling values, an
        adapter over max_lora_rank or not of this base, any adapter on transformers' modules).
        `adapter`: the LoRA adapter it runs with, installed on first use (lora_slots.py)."""
        params.validate()
        if adapter is not None:
            if self.runner.adapter_refusal is not None:
                raise ValueError(self.runner.adapter_refusal)
            check_adapter_fits(adapter, self.runner.model.config, max_rank=self.config.max_lora_rank)
        vocab_size = self.runner.vocab_size
        if any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_token_ids
        ):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        if any(token_id >= vocab_size for token_id, _ in params.logit_bias):
            raise ValueError(
                f"logit_bias names a token id the model does not have (its vocabulary is {vocab_size})"
            )
        if params.seed is not None and not 0 <= params.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {params.seed}")
        if self._extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=(*params.stop_token_ids, *self._extra_eos_ids)
            )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            tenant_id=tenant_id,
            cache_group=cache_group,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            tier=tier,
            limits=limits,
            adapter_id=adapter.adapter_id if adapter is not None else None,
        )
        generator = make_generator(params)  # before queueing: nothing may be left behind on failure
        self.scheduler.add(seq)
        if adapter is not None:
            self.adapters.register(seq, adapter)
        self._requests[request_id] = _RequestState(
            seq, IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids), generator
        )

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks at once. False if it was unknown or already finished."""
        self._requests.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def seconds_until_ready(self) -> float | None:
        """0 when a step has work, None when nothing is queued (the replica's loop asks every engine;
        an encoder engine may answer that its batch is due later)."""
        return 0.0 if self.scheduler.has_unfinished() else None

    def sequence(self, request_id: str) -> Sequence | None:
        return self.scheduler.get(request_id)

    def expire_waiting(self, max_wait_s: float) -> list[str]:
        """Drop the requests that waited over `max_wait_s` for a first seat (the queue timeout); their ids."""
        for seq in (expired := self.scheduler.expire_waiting(max_wait_s)):
            self._requests.pop(seq.request_id, None)
        return [seq.request_id for seq in expired]

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens not yet prefilled over the waiting and running sequences (the heartbeat's)."""
        seqs = (state.seq for state in self._requests.values())
        return sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in seqs)

    def latest_ends_in_steps(self, limit: int) -> tuple[int, ...]:
        """When the batch's seats free at the latest, in steps (the heartbeat's; Scheduler's)."""
        return latest_ends_in_steps(self.scheduler.running_seqs(), limit)

    # --- the step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. Raises StepFailed, naming the requests of its batch, when anything after the
        scheduling fails (the forward pass, say): those are lost, the others (waiting, or preempted) can
        run on."""
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return []
        seqs = [item.seq for item in scheduled.scheduled]
        try:
            return self._run_batch(scheduled, seqs)
        except Exception as exc:
            raise StepFailed([seq.request_id for seq in seqs], exc) from exc

    def _run_batch(self, scheduled: SchedulerOutput, seqs: list[Sequence]) -> list[RequestOutput]:
        items = scheduled.scheduled
        if self.adapters.has_holders:  # each adapter's rows side by side, updated in place (lora_batch.py)
            items = sorted(items, key=lambda item: item.seq.adapter_id or "")
            seqs = [item.seq for item in items]
        self.runner.copy_tails(self.kv_cache.take_copies())  # tails out of half blocks, before any write
        batch = self.runner.build_batch(seqs, [item.num_new_tokens for item in items])
        lora = lora_step(seqs, self.adapters, batch.query_lens, self.runner.device)
        logits = self.runner.execute(batch, lora)
        sampled_seqs = [seqs[i] for i in batch.sampled_seq_indices.tolist()]
        states = [self._requests[seq.request_id] for seq in sampled_seqs]
        wanting = [i for i, s in enumerate(states) if s.seq.params.logprobs is not None]
        # The model's own distribution: the raw logits, as the sampler's temperature and top-p leave them.
        logprobs = torch.log_softmax(logits[wanting].float(), dim=-1) if wanting else None
        adjusted = [i for i, s in enumerate(states) if s.seq.params.adjusts_logits]
        if adjusted:
            logits = adjust_logits(logits, adjusted, [states[i].seq for i in adjusted], eos_ids=self._eos_ids)
        logits = mask_logits(logits, [s.seq for s in states])  # response_format's grammars, in place
        sampled = self.sampler(logits, [s.seq.params for s in states], [s.generator for s in states])
        token_ids = sampled.tolist()
        if logprobs is not None:
            num_top = [states[i].seq.params.logprobs or 0 for i in wanting]
            read = self._logprobs.read(logprobs, num_top, sampled[wanting])
            for i, token_logprob in zip(wanting, read, strict=True):
                states[i].logprobs.append(token_logprob)
        finished = self.scheduler.update(
            scheduled, {seq.request_id: t for seq, t in zip(sampled_seqs, token_ids, strict=True)}
        )
        finished_ids = {seq.request_id for seq in finished}
        return [self._postprocess(state, state.seq.request_id in finished_ids) for state in states]

    def _postprocess(self, state: _RequestState, is_finished: bool) -> RequestOutput:
        seq = state.seq
        first_index = state.num_reported_tokens
        new_token_ids = seq.output_token_ids[first_index:]
        state.num_reported_tokens = seq.num_output_tokens
        pieces = [state.detokenizer.add(t) for t in new_token_ids]
        new_text = "".join(pieces)
        if is_finished:
            new_text += state.detokenizer.flush()
        if seq.params.stop:
            # vLLM's min_tokens: no stop string is looked for until the min_tokens-th token is out, so the
            # text of the tokens before it cannot end one (a stop may still begin there and end after).
            unchecked = sum(
                len(piece)
                for index, piece in enumerate(pieces, start=first_index)
                if index < seq.params.min_tokens - 1
            )
            new_text, is_finished = _apply_stop_strings(
                state,
                new_text,
                is_finished=is_finished,
                num_unchecked=unchecked,
                finish=self.scheduler.finish,
            )
        state.text += new_text
        if is_finished:
            del self._requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            new_text=new_text,
            is_finished=is_finished,
            finish_reason=seq.finish_reason if is_finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finished_time=seq.finished_time,
            logprobs=_take_logprobs(state) if seq.params.logprobs is not None else None,
        )

    # --- observability -----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        running = self.scheduler.running_seqs()
        return EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            kv_cache_usage=s.kv_usage,
            num_batched_tokens=s.num_batched_tokens,
            num_scheduled_seqs=s.num_scheduled_seqs,
            kv_allocated_slots=sum(self.kv_cache.num_slots(seq) for seq in running),
            kv_used_slots=sum(seq.num_computed_tokens for seq in running),
            num_preemptions=s.num_preemptions,
            prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            num_steps=s.num_steps,
            adapters_resident=(adapters := self.adapters.stats()).resident,
            num_adapter_loads=adapters.num_loads,
            num_adapter_evictions=adapters.num_evictions,
        )
