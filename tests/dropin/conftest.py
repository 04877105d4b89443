"""Shards for the drop-in suite: tiny, numbered, some samples without text (for ``select``)."""

from __future__ import annotations

import pytest
from dropin_idioms import audio_sample


@pytest.fixture(scope="package")
def text_urls(write_shards) -> list[str]:
    samples = [{"json": {"id": n}, **({"txt": "t" * (n % 9 + 1)} if n % 6 else {})} for n in range(30)]
    return write_shards("text", samples, 7)


@pytest.fixture(scope="package")
def audio_urls(write_shards) -> list[str]:
    return write_shards("audio", [audio_sample(n) for n in range(20)], 6)
