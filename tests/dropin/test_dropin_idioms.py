"""Training-repository idioms run under wdsraft and webdataset side by side (issue 14, item 5): the same
stream for the same seeds, and exact resumes at many points, with 0 and 2 DataLoader workers, across
epoch boundaries, resampled or not. The pipelines are in ``dropin_idioms`` (their idioms, our code)."""

from __future__ import annotations

import pytest
import torch
import webdataset
from dropin_idioms import audio_style, clip_style, lm_manifest, timm_style

import wdsraft as wds
from wdsraft.testing import assert_resumes_everywhere, identity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _same(make) -> list:
    ours = [identity(x) for x in make(wds)]
    assert ours == [identity(x) for x in make(webdataset)]
    return ours


def _clip_loader(lib, urls, resampled: bool, workers: int):
    """get_wds_dataset's loader: batch_size=None, persistent workers, with_epoch on a resampled dataset."""
    dataset = clip_style(lib, urls, resampled, epoch_batches=3 if resampled else 0)
    return lib.WebLoader(dataset, batch_size=None, shuffle=False, num_workers=workers, persistent_workers=workers > 0)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("resampled", [False, True])
def test_clip_style_loader(text_urls, resampled, workers) -> None:
    def make(lib):
        torch.manual_seed(0)  # (the workers' seeds, which a resampled shard list draws from)
        return _clip_loader(lib, text_urls, resampled, workers)

    stream = _same(make)
    assert len(stream) == (3 * max(workers, 1) if resampled else 9)

    def two_epochs():
        loader = make(wds)
        if resampled:
            return loader.with_epoch(2 * len(stream))  # (a window that goes on into the next loader epoch)
        return loader.repeat(2)

    points = None if workers == 0 else [0, 2, len(stream) - 1, len(stream), len(stream) + 3]
    assert len(assert_resumes_everywhere(two_epochs, kill_points=points, same_shape=False)) == 2 * len(stream)


@pytest.mark.parametrize("workers", [0, 2])
def test_lm_manifest_loader(text_urls, tmp_path, workers) -> None:
    manifest = tmp_path / "train.manifest"
    manifest.write_text("".join(f"{url}\n" for url in text_urls))

    def make(lib):
        return lib.WebLoader(lm_manifest(lib, str(manifest)), batch_size=None, num_workers=workers)

    stream = _same(make)
    assert sum(len(batch) for batch in stream) == 30
    points = None if workers == 0 else [1, 4, 8]
    assert_resumes_everywhere(lambda: make(wds).repeat(2), kill_points=points, same_shape=False)


@pytest.mark.parametrize("epoch", [-1, 3])
def test_timm_style_reader(text_urls, epoch) -> None:
    """timm iterates the pipeline in its own reader; the detshuffle epoch moves with each pass."""
    stream = _same(lambda lib: timm_style(lib, text_urls, epoch=epoch).repeat(2))
    assert len(stream) == 60
    assert_resumes_everywhere(lambda: timm_style(wds, text_urls, epoch=epoch).repeat(2))


@pytest.mark.parametrize("workers", [0, 2])
def test_audio_style_preencoded_loader(audio_urls, workers) -> None:
    def make(lib):
        loader = lib.WebLoader(audio_style(lib, audio_urls), batch_size=None, num_workers=workers)
        return loader.unbatched().shuffle(5, seed=2, **({} if lib is webdataset else {"reshuffle_each_epoch": False}))

    stream = _same(make)
    assert len(stream) == 20
    points = None if workers == 0 else [0, 3, 11, 19]
    assert_resumes_everywhere(lambda: make(wds).repeat(2), kill_points=points, same_shape=False)
