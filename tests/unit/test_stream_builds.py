"""The training stream across a resume that needs more samples than it was built with (a larger
`train.max_steps` or global batch): the samples of the builds before keep their order, and the rest
come from a build appended after them (trainer/run.py `_build_data`, `DataPosition.stream_builds`).
megatron-core orders a build's samples by how many are asked for, so building the stream again for
more samples re-shuffled every epoch, the one being read among them: the rest of that epoch read
samples already read and never reached others."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from tandem.data_pipeline.dataset import build_datasets
from tandem.trainer.recipe import load_config
from tandem.trainer.run import _build_data
from tests.conftest import TINY_OVERRIDES

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")
ONE_PROCESS = SimpleNamespace(dp_size=1, is_main=True)


def _windows(ds, start: int, end: int) -> torch.Tensor:
    return torch.stack([ds[i]["tokens"] for i in range(start, end)])


def test_a_resume_past_the_stream_appends_a_build_and_keeps_the_epoch_being_read(corpus_cache,
                                                                                capsys):
    def cfg(steps: int):
        return load_config(RECIPE, TINY_OVERRIDES + [f"data.cache_dir={corpus_cache}",
                                                     f"train.max_steps={steps}"])

    position, batch, first, _, _ = _build_data(cfg(8), ONE_PROCESS, {})
    epoch = len(first)  # megatron-core builds whole epochs: the first holds all of this one
    built = position.stream_builds[0]  # 8 steps' samples and the rewinds' headroom
    assert position.stream_builds == [built] and 8 * batch <= built < epoch
    position.consumed_samples = (epoch // 2 // batch) * batch  # half the epoch read, then saved
    saved = {"step": position.consumed_samples // batch, **position.state()}

    steps = (5 * epoch // 2) // batch  # two and a half epochs: past what the stream holds
    resumed, _, stream, _, _ = _build_data(cfg(steps), ONE_PROCESS, saved)
    extra = resumed.stream_builds[-1]  # what the first build lacks of the rest of the run
    assert resumed.stream_builds == [built, extra], resumed.stream_builds
    assert epoch + extra >= resumed.end_sample(steps - saved["step"]) > epoch
    assert f"from a build of {extra} more, seeded train.seed + 1" in capsys.readouterr().err
    # the rest of the epoch being read is the first build's, in its order
    rest = range(position.consumed_samples, epoch)
    assert torch.equal(_windows(stream, rest.start, rest.stop), _windows(first, rest.start,
                                                                         rest.stop))
    # then the appended build's samples, as that build orders them on its own
    data = cfg(steps).data
    appended, _, _ = build_datasets(data, data.seq_len, cfg(steps).train.seed + 1,
                                    num_train_samples=extra, num_valid_samples=None)
    assert len(stream) == epoch + len(appended)
    assert torch.equal(_windows(stream, epoch, epoch + 64), _windows(appended, 0, 64))
    # and a later resume rebuilds the same stream from the recorded builds
    again, _, same, _, _ = _build_data(cfg(steps), ONE_PROCESS,
                                   {"step": saved["step"], **resumed.state()})
    assert again.stream_builds == resumed.stream_builds
    assert torch.equal(_windows(same, epoch - 8, epoch + 8), _windows(stream, epoch - 8, epoch + 8))
