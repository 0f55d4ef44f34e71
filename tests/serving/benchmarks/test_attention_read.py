"""`manage.py bench attention`: the paged-attention kernel's read of the KV cache against a streaming read,
on a step small enough for a test."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from serving.benchmarks.attention_read import AttentionShape

SMALL = ["--rows", "4", "--context", "40", "--layers", "2", "--pool-mib", "4", "--steps", "2"]


def test_the_report_gives_the_kernels_share_of_the_streaming_rate() -> None:
    out = StringIO()
    call_command("bench", "attention", *SMALL, stdout=out)
    text = out.getvalue()
    assert "4 decode rows at context 40, 2 layers" in text
    # 4 rows x 40 positions x 4 KV heads x 64 floats x 4 bytes, keys and values, two layers
    assert "0.6 MiB at" in text
    share = re.search(r"the kernel's cold read: (\d+)% of the streaming rate", text)
    assert share is not None and int(share.group(1)) > 0
    assert re.search(r"streaming read here \(torch.sum over 256 MiB, contiguous\): [\d.]+ GB/s", text)


def test_a_pool_too_small_for_the_step_is_refused_before_anything_is_timed() -> None:
    with pytest.raises(CommandError, match="hold 4 blocks a layer; the step needs 512"):
        call_command("bench", "attention", "--pool-mib", "1", "--steps", "1")


def test_a_step_reads_every_rows_context_in_every_layer() -> None:
    shape = AttentionShape(rows=3, context=17, layers=5)
    assert shape.blocks_per_row == 2
    assert shape.bytes_per_step == 2 * 3 * 17 * 4 * 64 * 4 * 5
