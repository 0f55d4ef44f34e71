"""ModelRunner: loads a causal LM and runs one forward pass per engine step over a paged KV cache.

A step's work (prefill chunks and decodes together) is flattened into one `[1, T]` batch with per-token
positions; paged attention (attention.py) writes and reads the K/V pool. Only the rows that are sampled
go through the LM head.

Two forwards: the engine's own for the Llama family (fused_llama.py: fewer, larger operations per
layer), and transformers' modules for every other architecture, with the paged attention registered
through `AttentionInterface`. Two attentions: the native kernel that reads the pool in place
(native_attention.py; fp32 on a CPU), and gather + SDPA everywhere else. Each is chosen at load
("auto"), or required, in which case a model or machine that cannot have it is refused with the reason.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from serving.engine.attention import AttentionClock, build_attention_metadata, register_paged_attention
from serving.engine.forward_batch import BatchBuilder, ForwardBatch
from serving.engine.fused_llama import FusedForwardUnsupported, FusedLlama, fused_linear_shapes
from serving.engine.gather_attention import AttentionScratch, DecodeKernel, compile_decode_kernel
from serving.engine.half_blocks import TailCopy
from serving.engine.host_memory import keep_freed_memory, zero_pages
from serving.engine.loading import default_device_and_dtype, load_causal_lm
from serving.engine.lora import LoraAdapter
from serving.engine.lora_batch import FusedLoraWeights, LoraStep
from serving.engine.lora_weights import fused_lora_weights
from serving.engine.native_attention import NativeAttention, key_pool_view, load_native_attention
from serving.engine.native_library import KernelUnavailable
from serving.engine.native_ops import NativeOps, load_native_ops
from serving.engine.packing import PackingVerdict, can_pack, pack_linear_layers, packing_pays
from serving.engine.sequence import Sequence

logger = logging.getLogger(__name__)

FORWARDS = ("auto", "fused", "generic")
ATTENTIONS = ("auto", "native", "gather")


class ModelRunner:
    """Owns the model and the K/V pool. Size the KV manager from `num_blocks` and `block_size`;
    `bytes_per_block` covers every layer's K and V. Per step: `build_batch` (before the scheduler
    advances num_computed_tokens), then `execute`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kv_cache_bytes: int | Callable[[torch.device, int], int],
        block_size: int = 16,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        compile_attention: bool = False,
        pack_linear: bool | None = None,
        forward: str = "auto",
        attention: str = "auto",
        native_ops: bool = True,
    ) -> None:
        sized_later = callable(kv_cache_bytes)  # a number is checked before anything loads
        for name, value in (
            *(() if sized_later else (("kv_cache_bytes", kv_cache_bytes),)),
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        if compile_attention and attention == "native":
            raise ValueError("the compiled decode kernel belongs to the gather path, not the native kernel")
        self.device = torch.device(device) if device is not None else default_device_and_dtype()[0]
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's activations are not page-faulted in again every step
        attn_name = register_paged_attention()
        # load_causal_lm refuses a directory without *.safetensors (ModelLoadError, a ValueError) and
        # never runs remote code.
        self.model = load_causal_lm(
            model_dir, device=self.device, dtype=self.dtype, attn_implementation=attn_name
        )
        # fp32 on a CPU: Linear weights in oneDNN's format (serving/engine/packing.py), 2x faster GEMMs
        # on some CPUs and slower on others. None: timed here, both ways, and packed if it pays.
        self.packing: PackingVerdict | None = None
        packable = can_pack(self.device, self.dtype)
        if pack_linear is None and packable:
            # Timed on the products the forward will run: the fused one's, where it takes the model.
            shapes = fused_linear_shapes(self.model) if forward != "generic" else None
            self.packing = packing_pays(self.model, shapes=shapes)
            pack_linear = self.packing.pack
        is_packed = bool(pack_linear and packable)
        self.fused: FusedLlama | None = None
        self.forward_refusal: str | None = "generic forward asked for"
        if forward != "generic":
            try:
                self.fused = FusedLlama(self.model, packed=is_packed, ops=self._native_ops(native_ops))
                self.forward_refusal = None
            except FusedForwardUnsupported as exc:  # refused before it took any weight over
                if forward == "fused":
                    raise FusedForwardUnsupported(exc.reason, str(model_dir)) from None
                self.forward_refusal = exc.reason
        if self.fused is not None:
            self.num_packed_linears = self.fused.num_packed_linears
        else:
            self.num_packed_linears = pack_linear_layers(self.model) if is_packed else 0
        config = self.model.config.get_text_config()
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = config.max_position_embeddings
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)

        elem_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.bytes_per_block: int = (
            2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem_bytes
        )
        if callable(kv_cache_bytes):  # sized from the device, now that the weights hold their memory
            # (and never past what max_num_seqs sequences at the whole context could fill)
            kv_cache_bytes = kv_cache_bytes(
                self.device, max_num_seqs * self.max_blocks_per_seq * self.bytes_per_block
            )
            if kv_cache_bytes < 1:
                raise ValueError(f"the device leaves no memory for the KV cache ({kv_cache_bytes} bytes)")
        self.num_blocks: int = kv_cache_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} is below one block ({self.bytes_per_block} bytes for "
                f"{self.num_layers} layers x {block_size} tokens)"
            )
        # Zeros, not empty: padded rows read unused slots with weight 0, and 0 * NaN would be NaN.
        pool = _zeros(
            (self.num_layers, 2, self.num_blocks, block_size, self.num_kv_heads, self.head_dim),
            self.dtype,
            self.device,
        )
        self._kv_pool = pool
        self.kv_caches = [(pool[i, 0], pool[i, 1]) for i in range(self.num_layers)]
        self.scratch = AttentionScratch(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.decode_kernel: DecodeKernel | None = compile_decode_kernel() if compile_attention else None
        self.kernel, self.attention_refusal = self._native_attention(attention, compile_attention)
        if attention == "native" and self.kernel is None:
            raise KernelUnavailable(f"the native attention kernel cannot run here: {self.attention_refusal}")
        if self.kernel is not None:
            # Each layer's keys lie just before its values: the kernel's reads of a tail in half a block
            # may run past the last block's keys into them (csrc/paged_attention.c, block_of).
            self.kv_caches = [(key_pool_view(k), v) for k, v in self.kv_caches]
        logger.debug("model runner for %s: %s", model_dir, self.describe())
        self.base_step_s = 0.0  # a step's fixed cost, measured by warmup()
        self.attention_clock = AttentionClock()  # time in attention, every step's (bench's step breakdown)

        # Each step's input is assembled in buffers kept for the runner's life (forward_batch.py).
        self._batches = BatchBuilder(
            device=self.device,
            block_size=block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )

    @property
    def _is_cpu_fp32(self) -> bool:
        """Where the C library's kernels run."""
        return self.device.type == "cpu" and self.dtype == torch.float32

    def _native_ops(self, wanted: bool) -> NativeOps | None:
        """The C row operators for the fused forward, where the C library builds (CPU, fp32)."""
        if not wanted or not self._is_cpu_fp32:
            return None
        try:
            return load_native_ops()
        except KernelUnavailable:
            return None  # torch's operators, as the attention's refusal will say why

    def _native_attention(
        self, attention: str, compile_attention: bool
    ) -> tuple[NativeAttention | None, str | None]:
        """The native kernel as this runner's attention (and None), or None and why not."""
        if attention == "gather":
            return None, "gather + SDPA asked for"
        if compile_attention:
            return None, "the compiled decode kernel asked for"
        if not self._is_cpu_fp32:
            return None, f"it runs fp32 on a CPU, not {self.dtype} on {self.device.type}"
        reason = NativeAttention.supports(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
        )
        if reason is not None:
            return None, reason
        try:
            return load_native_attention(), None
        except KernelUnavailable as exc:
            return None, str(exc)

    def describe(self) -> str:
        """Which forward, attention and Linear layers this runner took, and why not the others."""
        forward = f"transformers' modules ({self.forward_refusal})"
        if self.fused is not None:
            forward = "fused Llama forward" + (" (C row ops)" if self.fused.ops is not None else "")
        attention = "native paged kernel" if self.kernel else f"gather + SDPA ({self.attention_refusal})"
        linears = (
            self.packing.describe()
            if self.packing is not None
            else ("packed" if self.num_packed_linears else "plain")
        )
        return f"{forward}; {attention}; Linear layers {linears}"

    @property
    def reads_half_blocks(self) -> bool:
        """Whether its attention reads a tail in half a block (half_blocks.py): the native kernel does."""
        return self.kernel is not None

    def copy_tails(self, copies: list[TailCopy]) -> None:
        """Move tails out of half blocks (half_blocks.py), before the step that reads them."""
        if copies:
            move_tails(self._kv_pool, copies)

    @property
    def kv_cache_bytes_allocated(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def build_batch(self, seqs: list[Sequence], num_new_tokens: list[int]) -> ForwardBatch:
        """The step's tokens are seq.token_ids[num_computed_tokens : num_computed_tokens + n] for each
        sequence; a sequence is sampled iff that range reaches the end of its token_ids."""
        return self._batches.build(seqs, num_new_tokens)

    @property
    def adapter_refusal(self) -> str | None:
        """Why this runner serves no LoRA adapter (transformers' modules: only the fused forward applies
        them), or None when it does."""
        if self.fused is None:
            return (
                "LoRA adapters are served by the fused Llama forward only, not by transformers' modules "
                f"({self.forward_refusal})"
            )
        return None

    def prepare_adapter(self, adapter: LoraAdapter) -> FusedLoraWeights:
        """The adapter's weights in this runner's layout, on its device (lora_weights.py)."""
        if self.fused is None:
            raise ValueError(self.adapter_refusal)
        return fused_lora_weights(adapter, self.fused)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch, lora: LoraStep | None = None) -> torch.Tensor:
        """One forward pass; returns logits [S, vocab] for the sampled rows, in batch order. `lora`:
        the step's adapter rows (fused forward only; lora_batch.py)."""
        metadata = build_attention_metadata(
            kv_caches=self.kv_caches,
            scratch=self.scratch,
            block_size=self.block_size,
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            block_tables=batch.block_tables,
            slot_mapping=batch.slot_mapping,
            decode_kernel=self.decode_kernel,
            kernel=self.kernel,
            num_heads=self.num_heads,
            clock=self.attention_clock,
        )
        if self.fused is not None:
            return self.fused.forward(batch.input_ids, batch.positions, batch.sample_indices, metadata, lora)
        if lora is not None:
            raise ValueError(self.adapter_refusal)
        # use_cache=False: the config default would build a throwaway DynamicCache every forward.
        output = self.model(
            input_ids=batch.input_ids.view(1, -1),
            position_ids=batch.positions.view(1, -1),
            use_cache=False,
            logits_to_keep=batch.sample_indices,
            paged_metadata=metadata,
        )
        logits: torch.Tensor = output.logits[0]
        return logits

    def warmup(self, sample: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Run a full-width decode step and a prefill chunk before serving so that scratch buffers,
        allocator pools and (when enabled) the compiled kernel exist before the first request, then time
        a step of one decoding sequence (`sample`: what the engine does with its logits, timed with it).
        It writes into block 0 only and clears the pool afterwards: call it before any sequence holds
        blocks."""
        # Spans >= 2 blocks when the pool allows (compiled kernels specialise on sizes 0 and 1).
        context = min(self.max_model_len, 2 * self.block_size + 1, self.num_blocks * self.block_size)
        num_blocks = -(-context // self.block_size)

        def fake(num_tokens: int, num_computed: int) -> Sequence:
            seq = Sequence(request_id="warmup", prompt_token_ids=[0] * num_tokens)
            seq.num_computed_tokens = num_computed
            seq.block_table = [0] * num_blocks
            return seq

        num_decodes = min(self.max_num_seqs, self.max_num_batched_tokens)
        decodes = [fake(context, context - 1) for _ in range(num_decodes)]
        self.execute(self.build_batch(decodes, [1] * num_decodes))
        chunk = min(context, self.max_num_batched_tokens)
        self.execute(self.build_batch([fake(context, context - chunk)], [chunk]))
        if chunk > 1 and context > chunk:
            self.execute(self.build_batch([fake(chunk, 0)], [chunk]))
        self.base_step_s = self._time_one_decode(fake(context, context - 1), sample)
        with torch.inference_mode():
            self._kv_pool[:, :, 0].zero_()  # the one block it wrote
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_one_decode(
        self, seq: Sequence, sample: Callable[[torch.Tensor], torch.Tensor] | None, repeats: int = 5
    ) -> float:
        """The median time of one decoding sequence's step, batch built, logits sampled and read back:
        the fixed cost of a step, which the autoscaler weighs step times against (rollouts.fleet.autoscaler).
        The median leaves out a first call that compiles for its size."""
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            logits = self.execute(self.build_batch([seq], [1]))
            (logits if sample is None else sample(logits)).cpu()
            times.append(time.perf_counter() - started)
        return statistics.median(times)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. On a CPU in fp32, zero pages mapped in as sequences write them (host_memory.py)."""
    if device.type == "cpu" and dtype == torch.float32:
        return zero_pages(shape)
    with torch.inference_mode():
        return torch.zeros(shape, dtype=dtype, device=device)


@torch.inference_mode()
def move_tails(pool: torch.Tensor, copies: list[TailCopy]) -> None:
    """Carry out tail moves in `pool` ([layers, 2, blocks, block_size, kv heads, head dim], keys in
    key_pool_view's layout), in order, every layer at once. A block one move leaves may be a later one's
    destination, never the reverse, so in order each reads what the allocator saw. Two slice copies a
    move: 25 µs for one, 87 for four on the bench model (one indexed copy for all took 118 and 249)."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    keys = pool[:, 0].view(num_layers, num_blocks, num_kv_heads, head_dim, block_size)
    values = pool[:, 1]
    for move in copies:
        src, dst, n = move.src_block, move.dst_block, move.num_tokens
        columns = slice(move.src_column, move.src_column + n)
        keys[:, dst, :, :, :n] = keys[:, src, :, :, columns]
        values[:, dst, :n] = values[:, src, columns]
