"""`manage.py quantize MODEL VERSION --to NEW_VERSION --method int8-weight`: a quantized sibling of a
version, registered as a new version of the same model whose parent is the version it was made from,
then measured against that parent on held-out text, the figures recorded as the new version's quality
(docs/architecture.md, "Quantized siblings")."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from audit import actors
from registry import artifacts
from registry.models import Model, ModelVersion
from registry.services import RegistryError, model_version_register
from registry.version_quality import model_version_quality_set

METHODS = tuple(q.value for q in ModelVersion.Quantization if q.value)


class Command(BaseCommand):
    help = (
        "Write a quantized sibling of MODEL:VERSION, register it as MODEL:NEW_VERSION (its parent: VERSION) "
        "and record its perplexity and greedy-token agreement against VERSION on held-out text."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("version", help="the version to quantize (a float one)")
        parser.add_argument("--to", dest="new_version", required=True, help="the new version's name")
        parser.add_argument("--method", default="int8-weight", help=f"one of: {', '.join(METHODS)}")
        parser.add_argument(
            "--text",
            metavar="FILE",
            help="the held-out text, UTF-8 (default: the stories shipped in serving/engine/heldout.txt)",
        )
        parser.add_argument("--created-by", default="cli")

    def handle(self, *args: object, **options: Any) -> None:
        name, method = options["model"], options["method"]
        source = self._source(name, options["version"], method)
        # Deferred: torch and transformers, which `manage.py help` and the other commands never load.
        from serving.engine.quality import DEFAULT_TEXT, evaluate
        from serving.engine.quantize import QuantizationError, write_int8_sibling

        text_path = Path(options["text"]) if options["text"] else DEFAULT_TEXT
        try:
            text = text_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read the held-out text {text_path}: {exc}") from None
        if not text.strip():
            raise CommandError(f"the held-out text {text_path} is empty")
        source_dir = Path(source.artifact_uri)
        actor = actors.command(__name__)
        try:
            artifacts.verify(source_dir, expected_files=source.files, expected_sha256=source.sha256)
            with tempfile.TemporaryDirectory(prefix="switchyard-quantize-") as tmp:
                written = write_int8_sibling(source_dir, Path(tmp) / "model", method=method)
                sibling = model_version_register(
                    name=name,
                    version=options["new_version"],
                    source_dir=written.directory,
                    kind=source.model.kind,
                    created_by=options["created_by"],
                    parent=source,
                    actor=actor,
                    quantization=method,
                )
        except (artifacts.ArtifactError, RegistryError, QuantizationError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"registered {name}:{sibling.version} ({method} of {source.version}): {len(written.modules)} "
            f"Linear layers int8, {', '.join(written.kept) or 'none'} kept; weights {written.weight_bytes} "
            f"bytes, {written.weight_ratio:.1%} of the parent's {written.source_weight_bytes}"
        )
        self.stdout.write(f"sha256:{sibling.sha256}")
        report = evaluate(source_dir, sibling.artifact_uri, text=text)
        quality = {
            **report.as_record(),
            "method": method,
            "parent": source.version,
            "text": text_path.name,
            "measured_at": timezone.now().isoformat(),
        }
        model_version_quality_set(model_version=sibling, quality=quality, actor=actor)
        self.stdout.write(
            f"perplexity {report.perplexity:.4f} vs parent {report.parent_perplexity:.4f} "
            f"({report.perplexity_increase:+.3%}); greedy agreement {report.greedy_agreement:.2%} "
            f"over {report.num_predictions} positions of {text_path.name}"
        )

    def _source(self, name: str, version: str, method: str) -> ModelVersion:
        """The version to quantize, or the refusal that says why it cannot be."""
        if method not in METHODS:
            raise CommandError(f"unknown quantization method {method!r}; known: {', '.join(METHODS)}")
        source = (
            ModelVersion.objects.filter(model__name=name, version=version)
            .select_related("model", "parent", "adapter_of__model")
            .first()
        )
        if source is None:
            raise CommandError(f"no version {name}:{version}")
        if source.adapter_of is not None:
            base = source.adapter_of
            raise CommandError(
                f"{name}:{version} is a LoRA adapter (of {base.model.name}:{base.version}); quantize its base"
            )
        if source.quantization:
            parent = f"its parent {source.parent.version}" if source.parent else "a float version"
            raise CommandError(
                f"{name}:{version} is already quantized ({source.quantization}); quantize {parent}"
            )
        if source.model.kind != Model.Kind.CAUSAL_LM:
            raise CommandError(f"{name} is a {source.model.kind} model; only causal LMs are quantized")
        return source
