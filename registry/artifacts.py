"""The artifact store: model directories copied under ARTIFACT_ROOT/NAME/VERSION, safetensors only,
with a sha256 per file and one digest over all of them that loading checks again.

Only the local-directory store is built; an object store (S3, GCS) would implement the same two calls
and is left out until a deployment needs one."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from registry.safetensors_header import SafetensorsHeaderError, check_safetensors

# Pickle-based weight formats can run code on load; we never accept them.
FORBIDDEN_SUFFIXES = frozenset(
    {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".h5", ".msgpack"}
)
# Custom modeling code would need trust_remote_code, which we never turn on.
CODE_SUFFIXES = frozenset({".py", ".pyc", ".so"})


class ArtifactError(Exception):
    """A model directory that cannot be registered or loaded; the message is one clear line."""


class ArtifactDigestMismatch(ArtifactError):
    pass


@dataclass(frozen=True, slots=True)
class ArtifactManifest:
    files: dict[str, str]  # relative path -> sha256
    sha256: str
    size_bytes: int


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(files: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for rel_path in sorted(files):
        digest.update(f"{rel_path}\0{files[rel_path]}\n".encode())
    return digest.hexdigest()


def _list_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def validate_source_dir(source_dir: Path, *, config_name: str = "config.json") -> list[Path]:
    """Check a directory before anything is copied: safetensors weights, nothing pickled, no code.
    `config_name`: the file that says what it is (a LoRA adapter's: adapter_config.json)."""
    if not source_dir.is_dir():
        raise ArtifactError(f"{source_dir} is not a directory")
    files = _list_files(source_dir)
    if any(p.is_symlink() for p in source_dir.rglob("*")):
        raise ArtifactError(f"{source_dir} contains symbolic links; copy the real files")
    forbidden = [p.name for p in files if p.suffix.lower() in FORBIDDEN_SUFFIXES]
    if forbidden:
        raise ArtifactError(
            f"refusing pickle-based weights ({', '.join(forbidden)}); convert them to safetensors"
        )
    code = [p.name for p in files if p.suffix.lower() in CODE_SUFFIXES]
    if code:
        raise ArtifactError(f"refusing custom code ({', '.join(code)}); trust_remote_code is never enabled")
    if not any(p.suffix == ".safetensors" for p in files):
        raise ArtifactError(f"no *.safetensors weights in {source_dir}")
    if not (source_dir / config_name).is_file():
        raise ArtifactError(f"no {config_name} in {source_dir}")
    for path in files:
        if path.suffix == ".safetensors":
            try:
                check_safetensors(path)
            except SafetensorsHeaderError as exc:
                raise ArtifactError(f"{path.name} is not a valid safetensors file: {exc}") from None
    _check_references(source_dir, files)
    _check_no_code_references(source_dir, files)
    return files


# Keys by which a config asks transformers for code from the artifact or a hub repository (auto_map:
# "configuration_x.MyConfig", or "org/repo--modeling.MyModel"). Refused whatever they name: the loader
# never enables trust_remote_code, and a config that needs it would be served by some other class.
CODE_KEYS = frozenset({"auto_map", "trust_remote_code", "custom_pipelines"})


def _check_no_code_references(root: Path, files: list[Path]) -> None:
    # The configs (config.json, tokenizer_config.json, generation_config.json, …), not a vocabulary,
    # whose keys are tokens: one spelled "auto_map" is no request for code.
    for path in (p for p in files if p.suffix == ".json" and "config" in p.name):
        key = _code_key(_json(path))
        if key is not None:
            raise ArtifactError(
                f"{path.relative_to(root)} sets {key!r}, which asks for custom code; "
                "trust_remote_code is never enabled: refusing it"
            )


def _code_key(data: object) -> str | None:
    if isinstance(data, dict):
        for key, value in data.items():
            if key in CODE_KEYS and value not in (None, False, {}, []):
                return str(key)
            found = _code_key(value)
            if found is not None:
                return found
    elif isinstance(data, list):
        for item in data:
            found = _code_key(item)
            if found is not None:
                return found
    return None


def _check_references(root: Path, files: list[Path]) -> None:
    """Files that name other files must name them inside the artifact: transformers joins a sharded
    checkpoint's weight_map entries, and the encoder a sentence-transformers modules.json's paths, onto
    the directory, so `../other/model.safetensors` would load weights no digest covered. Nor may they
    name a hidden file (a dot first), which the manifest leaves out: one put in the store after
    registration would load, past verify()."""
    inside = root.resolve()
    for path in files:
        data = _json(path) if path.name.endswith(".index.json") or path.name == "modules.json" else None
        if isinstance(data, dict) and isinstance(data.get("weight_map"), dict):
            names = list(data["weight_map"].values())
        elif isinstance(data, list):
            names = [module.get("path", "") for module in data if isinstance(module, dict)]
        else:
            continue
        for name in names:
            target = (root / str(name)).resolve()
            if not isinstance(name, str) or Path(name).is_absolute() or not target.is_relative_to(inside):
                raise ArtifactError(f"{path.name} names {name!r}, outside the artifact; refusing it")
            if target.name.startswith("."):
                raise ArtifactError(
                    f"{path.name} names {name!r}, a hidden file no digest covers; refusing it"
                )


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"{path.name} is not readable JSON: {exc}") from None


# The heads a config's `architectures` names, by the suffix transformers gives each (LlamaForCausalLM,
# GPT2LMHeadModel, BertForSequenceClassification), and the kind whose loader builds that head
# (serving/engine/loading.py). A checkpoint registered as another kind answered 503 for ever, the reason
# in the replica's log only; or, as a classifier, would have got a random head.
HEAD_KINDS = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForSequenceClassification", "classifier"),
)


def check_kind(root: Path, kind: str) -> None:
    """Refuse a model directory whose config names a head of another kind than `kind`. A causal LM or a
    classifier must name its own head; an embedding model must name neither (its loader takes the base
    model, and a head's checkpoint is most likely a mistaken --kind). A config that names no
    architecture cannot be told apart, and is taken as it is said to be, except for a classifier, which
    must name its head."""
    config = _json(root / "config.json")
    named = config.get("architectures") if isinstance(config, dict) else None
    architectures = [str(a) for a in named] if isinstance(named, list) else []
    heads = {head_kind for a in architectures for suffix, head_kind in HEAD_KINDS if a.endswith(suffix)}
    if kind in heads or (not heads and kind != "classifier" and (kind == "embedding" or not architectures)):
        return
    if not heads and kind == "causal-lm":
        described = f"a base model without a language-model head ({', '.join(architectures)})"
    elif not heads:
        described = f"no ...ForSequenceClassification head ({', '.join(architectures) or 'no architectures'})"
    else:
        described = f"a {' and '.join(sorted(heads))} model ({', '.join(architectures)})"
    hint = f"; register it with --kind {sorted(heads)[0]}" if len(heads) == 1 else ""
    article = "an" if kind[0] in "aeiou" else "a"
    raise ArtifactError(f"config.json describes {described}, not {article} {kind} model{hint}")


def compute_manifest(root: Path) -> ArtifactManifest:
    files = {str(p.relative_to(root)): _file_sha256(p) for p in _list_files(root)}
    size = sum(p.stat().st_size for p in _list_files(root))
    return ArtifactManifest(files=files, sha256=manifest_digest(files), size_bytes=size)


def stage_copy(
    source_dir: Path, artifact_root: Path, *, config_name: str = "config.json"
) -> tuple[Path, ArtifactManifest]:
    """Copy into a staging directory beside the final place, so a failure leaves nothing behind and
    the final move is a rename on the same filesystem."""
    validate_source_dir(source_dir, config_name=config_name)
    artifact_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=artifact_root))
    try:
        shutil.copytree(source_dir, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))
        return staging, compute_manifest(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def verify(artifact_dir: Path, *, expected_files: dict[str, str], expected_sha256: str) -> None:
    """Re-hash every file before a load; any difference from the registry refuses the load, as does a
    symbolic link (the loader would follow it to whatever it names now) or a file naming another outside
    the artifact."""
    if not artifact_dir.is_dir():
        raise ArtifactError(f"artifact directory {artifact_dir} is missing")
    if artifact_dir.is_symlink() or any(p.is_symlink() for p in artifact_dir.rglob("*")):
        raise ArtifactError(f"artifact {artifact_dir} contains symbolic links; refusing to load")
    _check_references(artifact_dir, _list_files(artifact_dir))
    actual = compute_manifest(artifact_dir)
    if actual.files != expected_files or actual.sha256 != expected_sha256:
        changed = sorted(
            set(actual.files.items()).symmetric_difference(expected_files.items()), key=lambda kv: kv[0]
        )
        names = sorted({path for path, _ in changed})
        raise ArtifactDigestMismatch(
            f"artifact {artifact_dir} does not match its registered digest {expected_sha256[:12]}…"
            f" (differs: {', '.join(names) or 'digest'}); refusing to load"
        )
