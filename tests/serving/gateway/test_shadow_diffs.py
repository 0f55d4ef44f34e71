"""Shadow output diffs: where a copy's tokens first differ from its primary's and what share agree, checked
against greedy outputs this test computes itself with the engine on each version's weights; and the
differing pairs kept, redacted, while prompt logging is on."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from serving.gateway.shadow_diff import compare
from serving.transport.protocol import ShadowResult

MAX_TOKENS = 12
PROMPTS = [f"hello {i}" for i in range(6)]


# --- the comparison ---------------------------------------------------------------------------------------


def test_compare_finds_the_first_differing_token_and_the_share_that_agree() -> None:
    same = compare(["a", "b", "c"], ["a", "b", "c"])
    assert (same.first_divergence, same.agreement, same.diverged) == (None, 1.0, False)
    one_off = compare(["a", "b", "c", "d"], ["a", "x", "c", "d"])
    assert (one_off.first_divergence, one_off.agreement) == (1, 0.75)
    prefix = compare(["a", "b"], ["a", "b", "c"])  # over the shorter output; the next token differs
    assert (prefix.first_divergence, prefix.agreement) == (2, 1.0)
    assert compare([], []).agreement == 1.0 and compare([], []).first_divergence is None
    assert (compare([], ["a"]).first_divergence, compare([], ["a"]).agreement) == (0, 0.0)


def test_the_shadow_result_carries_the_diff_and_reads_an_older_gateways_as_none() -> None:
    wire = ShadowResult(False, 3, 0.5).to_wire()
    assert ShadowResult.from_wire(wire) == ShadowResult(False, 3, 0.5)
    assert ShadowResult.from_wire({"type": "replica.shadow_result", "matched": True}) == ShadowResult(True)
    bad = {"matched": False, "agreement": 7, "first_divergence": -1}
    assert ShadowResult.from_wire(bad) == ShadowResult(False)


# --- through the gateway, against outputs computed here -----------------------------------------------------


@pytest.fixture(scope="module")
def perturbed_weights_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """The demo model with noise on one layer's MLP: greedy outputs that agree for a few tokens, then
    part (on some prompts), rather than from the first token."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed") / "model"
    shutil.copytree(demo_model_dir, out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    for name, tensor in weights.items():
        if "layers.1.mlp.down_proj" in name:
            noise = torch.randn(tensor.shape, generator=generator)
            weights[name] = tensor + 0.3 * tensor.std() * noise
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _greedy(model_dir: Path, prompts: list[str]) -> dict[str, tuple[list[int], list[str]]]:
    """Each prompt's greedy token ids and the text each token added, from the engine alone."""
    from serving.engine.engine import Engine
    from serving.engine.sampling import SamplingParams
    from serving.replica.config import engine_config_from_settings

    engine = Engine(model_dir, config=engine_config_from_settings())
    outputs = {}
    for prompt in prompts:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        engine.add_request(prompt, engine.encode(prompt), params)
        ids: list[int] = []
        pieces: list[str] = []
        while engine.has_unfinished():
            for out in engine.step():
                ids += out.new_token_ids
                pieces.append(out.new_text)
        outputs[prompt] = (ids, pieces)
    return outputs


def _first_difference(a: list[Any], b: list[Any]) -> int | None:
    for index in range(min(len(a), len(b))):
        if a[index] != b[index]:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _mirror_to(source_dir: Path) -> None:
    from registry.services import alias_set, model_version_register, routing_mirror_set

    v2 = model_version_register(name="demo-chat", version="v2", source_dir=source_dir, created_by="test")
    alias_set(model=v2.model, name="canary", version=v2, actor="test")  # the alias gives it a replica
    routing_mirror_set(model=v2.model, version=v2, pct=100)


async def _serve_one_at_a_time(acme: Any, prompts: list[str]) -> None:
    from serving.gateway import shadow

    for prompt in prompts:
        response = await AsyncClient().post(
            "/v1/models/demo-chat/infer",
            data=json.dumps({"input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}),
            content_type="application/json",
            headers=acme.auth,
        )
        assert response.status_code == 200, response.content
        await shadow.wait_idle()  # one copy at a time on the candidate: a batch of one, as computed here


async def _candidate_window(runtime: Any, started: datetime) -> Any:
    from serving.telemetry.metrics_reads import version_window

    for replica in runtime.replicas.values():
        await replica.flush_metrics()
    end = datetime.now(tz=UTC) + timedelta(seconds=5)
    return await sync_to_async(version_window)(model_name="demo-chat", version="v2", start=started, end=end)


async def _start(make_tenant: Any) -> tuple[Any, Any]:
    from serving.runtime import get_runtime

    runtime = await get_runtime()
    assert await runtime.wait_ready()
    return runtime, await sync_to_async(make_tenant)("acme")


@pytest.mark.django_db(transaction=True)
async def test_same_weights_agree_everywhere_and_never_diverge(
    make_tenant, registered_model, demo_model_dir
) -> None:
    await sync_to_async(_mirror_to)(demo_model_dir)
    runtime, acme = await _start(make_tenant)
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    await _serve_one_at_a_time(acme, PROMPTS[:3])
    v2 = await _candidate_window(runtime, started)
    assert (v2.num_shadow_compared, v2.num_shadow_matched) == (3, 3)
    assert v2.shadow_agreement.count == 3 and v2.shadow_agreement.mean == 1.0
    assert v2.shadow_first_divergence.count == 0


@pytest.mark.django_db(transaction=True)
async def test_other_weights_record_the_first_index_where_the_token_sequences_differ(
    make_tenant, registered_model, demo_model_dir, perturbed_weights_dir, settings
) -> None:
    from serving.models import ShadowDiffPair

    primary = await sync_to_async(_greedy)(demo_model_dir, PROMPTS)
    candidate = await sync_to_async(_greedy)(perturbed_weights_dir, PROMPTS)
    differences = {p: _first_difference(primary[p][0], candidate[p][0]) for p in PROMPTS}
    # One that diverges where the text shows it (a token that completes no character yet adds "", and two
    # such tokens read alike: the gateway sees text, not ids), the latest such; and one that does not.
    diverging = [
        p
        for p in PROMPTS
        if differences[p] is not None and _first_difference(primary[p][1], candidate[p][1]) == differences[p]
    ]
    assert diverging, differences
    chosen = max(diverging, key=lambda p: differences[p])
    agreeing = [p for p in PROMPTS if differences[p] is None][:1]

    settings.LOG_PROMPTS_SAMPLE_RATE = 1.0  # every differing copy is drawn for keeping
    settings.SHADOW_DIFF_PAIRS = 5
    await sync_to_async(_mirror_to)(perturbed_weights_dir)
    runtime, acme = await _start(make_tenant)
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    await _serve_one_at_a_time(acme, [chosen, *agreeing])
    v2 = await _candidate_window(runtime, started)

    assert v2.num_shadow_compared == 1 + len(agreeing)
    divergence = v2.shadow_first_divergence
    assert divergence.count == 1
    assert divergence.min == divergence.max == differences[chosen]
    ids_a, ids_b = primary[chosen][0], candidate[chosen][0]
    shorter = min(len(ids_a), len(ids_b))
    agreement = sum(a == b for a, b in zip(ids_a, ids_b, strict=False)) / shorter
    pieces_a, pieces_b = primary[chosen][1], candidate[chosen][1]
    piece_agreement = sum(a == b for a, b in zip(pieces_a, pieces_b, strict=False)) / shorter
    assert v2.shadow_agreement.count == 1 + len(agreeing)
    assert v2.shadow_agreement.min == pytest.approx(piece_agreement)
    assert piece_agreement >= agreement  # positions whose ids differ but add the same text count as agreeing

    pairs = await sync_to_async(lambda: list(ShadowDiffPair.objects.all()))()
    assert len(pairs) == 1  # the differing copy only
    pair = pairs[0]
    assert pair.first_divergence == differences[chosen] and pair.primary_version == "v1"
    assert pair.input == chosen and pair.primary_output == "".join(pieces_a)


@pytest.mark.django_db(transaction=True)
async def test_differing_pairs_are_redacted_capped_and_kept_only_with_prompt_logging_on(
    make_tenant, registered_model, perturbed_weights_dir, settings
) -> None:
    from serving.models import ShadowDiffPair
    from serving.telemetry import shadow_pairs

    shadow_pairs._full.clear()
    await sync_to_async(_mirror_to)(perturbed_weights_dir)
    _, acme = await _start(make_tenant)
    secret_prompts = [f"mail alice{i}@example.com then hello {i}" for i in range(4)]

    settings.LOG_PROMPTS_SAMPLE_RATE = 0.0  # off, the default: nothing is kept
    await _serve_one_at_a_time(acme, secret_prompts)
    assert await sync_to_async(ShadowDiffPair.objects.count)() == 0

    settings.LOG_PROMPTS_SAMPLE_RATE = 1.0
    settings.SHADOW_DIFF_PAIRS = 2
    await _serve_one_at_a_time(acme, secret_prompts)
    inputs = await sync_to_async(lambda: [p.input for p in ShadowDiffPair.objects.all()])()
    assert 1 <= len(inputs) <= 2  # the copies that differed, up to the cap
    assert all("@example.com" not in text and "[EMAIL]" in text for text in inputs)
    shadow_pairs._full.clear()


def test_metrics_expose_the_diffs_as_histograms_beside_the_compared_and_matched_counts() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from serving.telemetry import metric_window as m
    from serving.telemetry.prometheus import SwitchyardCollector
    from serving.telemetry.recorder import MetricsRecorder

    recorder = MetricsRecorder(model_name="chat", version="v2", version_id=1, replica_id="r1")
    for matched, divergence, agreement in ((True, None, 1.0), (False, 3, 0.5), (False, 0, 0.0)):
        recorder.count({m.SHADOW_COMPARED: 1, m.SHADOW_MATCHED: int(matched)})
        values = {m.SHADOW_AGREEMENT: agreement}
        if divergence is not None:
            values[m.SHADOW_FIRST_DIVERGENCE] = float(divergence)
        recorder.observe(values)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwitchyardCollector(lambda: [recorder]))
    text = generate_latest(registry).decode()
    labels = 'model="chat",replica="r1",version="v2"'
    assert f"switchyard_shadow_compared_total{{{labels}}} 3.0" in text
    assert f"switchyard_shadow_matched_total{{{labels}}} 1.0" in text
    assert f'switchyard_shadow_agreement_ratio_bucket{{le="0.25",{labels}}} 1.0' in text
    assert f"switchyard_shadow_agreement_ratio_sum{{{labels}}} 1.5" in text
    assert f'switchyard_shadow_first_divergence_tokens_bucket{{le="1.0",{labels}}} 1.0' in text
    assert f'switchyard_shadow_first_divergence_tokens_bucket{{le="4.0",{labels}}} 2.0' in text
    assert f"switchyard_shadow_first_divergence_tokens_count{{{labels}}} 2.0" in text
