"""Loading a model safely: safetensors only, never remote code."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from serving.engine.int8_loading import Int8LoadError, load_int8_pretrained, quantization_of

# transformers builds a model under process-global state (its default-device and dtype contexts, lazy
# module imports); two loads in two threads at once can leave one of them with meta tensors ("Cannot
# copy out of meta tensor"). An embedded server loads one replica per version in threads, so loads
# take turns. Anything else in the process that calls from_pretrained should hold it too.
MODEL_LOAD_LOCK = threading.RLock()


class ModelLoadError(ValueError):
    pass


def default_device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_tokenizer(model_dir: str | Path) -> Any:
    with MODEL_LOAD_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)


# Texts on which a direct encoder must give the wrapper's ids before it is trusted: empty, whitespace
# at either end, newlines, punctuation, digits, accents, other scripts, an emoji.
_PROBE_TEXTS = (
    "",
    " ",
    "Hello, world!",
    "  two spaces before, one after ",
    "line one\nline two\n\n\ttabbed",
    "digits 12345 and 3.14159; x=y+z",
    "accents ünïcödé, quotes “curly” — dash, 漢字, emoji 🙂",
)


def prompt_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """A function giving `tokenizer(text)["input_ids"]` for a prompt, faster where it can be: the Rust
    tokenizer's `encode_batch` called directly skips the Python that transformers wraps around it,
    ~165 -> ~80 us for a 100-word prompt warm and ~520 -> ~320 us in a thread that has just woken
    (docs/architecture.md, "Tokenizing off the model thread"). `encode_batch` rather than `encode`, because it
    releases the GIL while it runs, so a model thread steps on meanwhile.

    Taken only where it gives the same ids: the two agree on probe texts and on the tokenizer's special
    tokens, and at each call the Rust tokenizer is set as the wrapper would set it for a plain call (no
    truncation or padding, special tokens split or not as the tokenizer says). The wrapper leaves such
    settings as the last call made them, so a call elsewhere with `truncation=True` would otherwise
    cut every later prompt short; then that prompt goes through the wrapper, which resets them.
    Otherwise, or if anything about the direct call fails, the wrapper itself."""

    def wrapped(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return wrapped

    def is_set_for_a_plain_call() -> bool:
        split_specials = bool(getattr(tokenizer, "split_special_tokens", False))
        return (
            backend.truncation is None
            and backend.padding is None
            and bool(getattr(backend, "encode_special_tokens", split_specials)) == split_specials
        )

    def direct(text: str) -> list[int]:
        if not is_set_for_a_plain_call():
            return wrapped(text)
        return list(backend.encode_batch([text], add_special_tokens=True)[0].ids)

    specials = " ".join(getattr(tokenizer, "all_special_tokens", None) or ())
    try:
        agrees = all(direct(text) == wrapped(text) for text in (*_PROBE_TEXTS, specials, f"a{specials}b"))
    except Exception:
        return wrapped
    return direct if agrees else wrapped


def load_causal_lm(
    model_dir: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> Any:
    with MODEL_LOAD_LOCK:
        from transformers import AutoModelForCausalLM

        return _load_pretrained(AutoModelForCausalLM, model_dir, device, dtype, attn_implementation)


def load_encoder(
    model_dir: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Any:
    """An encoder without a head (BERT and the like), as sentence-embedding models are saved."""
    with MODEL_LOAD_LOCK:
        from transformers import AutoModel

        return _load_pretrained(AutoModel, model_dir, device, dtype, None)


def load_classifier(
    model_dir: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Any:
    """An encoder with its sequence-classification head, as text classifiers are saved."""
    with MODEL_LOAD_LOCK:
        from transformers import AutoModelForSequenceClassification

        # A head the checkpoint lacks would be initialised at random: confident nonsense, so refused.
        return _load_pretrained(
            AutoModelForSequenceClassification, model_dir, device, dtype, None, require_all_weights=True
        )


def _load_pretrained(
    auto_class: Any,
    model_dir: str | Path,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    attn_implementation: str | None,
    *,
    require_all_weights: bool = False,
) -> Any:
    path = Path(model_dir)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"no *.safetensors weights in {path}; other formats are refused")
    default_device, default_dtype = default_device_and_dtype()
    kwargs: dict[str, Any] = {
        "use_safetensors": True,
        "trust_remote_code": False,
        "dtype": dtype or default_dtype,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with MODEL_LOAD_LOCK:
        model: Any
        if quantization_of(path) is not None:  # a quantized sibling: int8 Linear layers, every weight loaded
            try:
                model = load_int8_pretrained(
                    auto_class, path, dtype=kwargs["dtype"], attn_implementation=attn_implementation
                )
            except Int8LoadError as exc:
                raise ModelLoadError(str(exc)) from None
        elif require_all_weights:
            model, info = auto_class.from_pretrained(str(path), output_loading_info=True, **kwargs)
            missing = sorted(info.get("missing_keys") or ())
            if missing:
                raise ModelLoadError(
                    f"{path} lacks weights the model needs ({', '.join(missing[:4])}"
                    f"{', …' if len(missing) > 4 else ''}); refused rather than initialised at random"
                )
        else:
            model = auto_class.from_pretrained(str(path), **kwargs)
        return model.to(device or default_device).eval()
