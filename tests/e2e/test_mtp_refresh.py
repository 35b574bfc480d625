"""`mtp.init_from` (recipes/mtp_refresh.yaml): the trunk comes from `model.init_from`, the MTP
module, and only it, from another checkpoint. Two tiny runs trained from different seeds give a
trunk and an MTP module that differ everywhere; a refresh run with lr 1e-20 (it must be positive)
must then hold exactly the one's trunk and the other's MTP parameters, whether the MTP module comes
from a Tandem checkpoint or from its Hugging Face export. A directory without MTP weights, or with
MTP shapes that do not fit, is a one-line ConfigError naming the key."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny.yaml")
REFRESH = os.path.join(ROOT, "recipes", "mtp_refresh.yaml")


def _train(run_dir, cache, *extra):
    from tandem.trainer.cli import main as cli

    args = TINY_OVERRIDES + [f"data.cache_dir={cache}", f"run.dir={run_dir}", "train.max_steps=1",
                             "checkpoint.interval=1", *extra]
    assert cli(["train", TINY, *args]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache):
    """{old: trunk + MTP (seed 0), new: trunk + MTP (seed 1), plain: no MTP module}."""
    tmp = tmp_path_factory.mktemp("refresh")
    out = {"old": str(tmp / "old"), "new": str(tmp / "new"), "plain": str(tmp / "plain")}
    _train(out["old"], corpus_cache, "train.seed=0")
    _train(out["new"], corpus_cache, "train.seed=1")
    _train(out["plain"], corpus_cache, "mtp.num_steps=0")
    return out


def _state(path, parameters_only=False):
    from tandem.trainer.checkpoint import load_model_from_checkpoint

    model = load_model_from_checkpoint(path)[0]
    keep = dict(model.named_parameters()) if parameters_only else model.state_dict()
    return {k: v.detach().float() for k, v in keep.items()}


def _refresh_args(runs, run_dir, mtp_from, cache, *extra):
    return [f"model.init_from={runs['new']}", f"mtp.init_from={mtp_from}", f"run.dir={run_dir}",
            "data.source=stdlib", f"data.cache_dir={cache}", "data.stdlib_max_bytes=200000",
            "data.seq_len=32",
            "train.micro_batch_size=2", "train.max_steps=1", "train.warmup_steps=1",
            "train.lr=1e-20", "train.min_lr=1e-20",
            "train.dtype=fp32", "train.frozen_dtype=fp32", "mtp.num_steps=2", "eval.interval=0",
            "checkpoint.interval=1", "logging.wandb=false", "logging.progress=false", *extra]


def test_refresh_loads_the_trunk_of_one_and_the_mtp_module_of_the_other(runs, corpus_cache,
                                                                        tmp_path):
    from tandem.trainer.cli import main as cli

    run_dir = str(tmp_path / "refresh")
    assert cli(["train", REFRESH, *_refresh_args(runs, run_dir, runs["old"], corpus_cache)]) == 0
    # config.yaml records the step each source was read at (a run directory's newest moves on)
    saved = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    assert saved.model.init_from == os.path.join(runs["new"], "checkpoints", "step_1")
    assert saved.mtp.init_from == os.path.join(runs["old"], "checkpoints", "step_1")
    # parameters: the training step moves the MoE routers' balancing biases (buffers) even at lr
    # 1e-20
    old, new, got = (_state(p, parameters_only=True) for p in (runs["old"], runs["new"], run_dir))
    assert set(got) == set(old) == set(new)
    mtp = [k for k in got if k.startswith("mtp.")]
    assert mtp and len(mtp) < len(got)
    for k, v in got.items():
        want = old[k] if k.startswith("mtp.") else new[k]
        # one step of lr 1e-20: no change
        torch.testing.assert_close(v, want, rtol=0, atol=1e-12, msg=k)
        # the two sources differ, so this tells
        if v.numel() > 1 and "norm" not in k and "bias" not in k:
            assert not torch.equal(old[k], new[k]), k


def test_a_resume_reads_both_sources_at_the_steps_it_started_from(runs, corpus_cache, tmp_path):
    """Both sources name run directories, whose newest checkpoints move on: a resume (every Slurm
    requeue) must read the steps the run started from, as config.yaml says. mtp.init_from was read
    at the source's newest step again, and config.yaml then named a step never read."""
    import shutil

    from tandem.trainer.cli import main as cli

    sources = {name: str(tmp_path / name) for name in ("old", "new")}
    for name, path in sources.items():
        shutil.copytree(runs[name], path)
    run_dir = str(tmp_path / "refresh")
    args = _refresh_args(sources, run_dir, sources["old"], corpus_cache)
    assert cli(["train", REFRESH, *args]) == 0
    for path in sources.values():  # each source run publishes a newer checkpoint
        shutil.copytree(os.path.join(path, "checkpoints", "step_1"),
                        os.path.join(path, "checkpoints", "step_2"))
    assert cli(["train", REFRESH, *args, "train.max_steps=2", "--resume"]) == 0
    saved = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    assert saved.model.init_from == os.path.join(sources["new"], "checkpoints", "step_1")
    assert saved.mtp.init_from == os.path.join(sources["old"], "checkpoints", "step_1")


def test_load_mtp_weights_in_process_and_its_errors(runs):
    """The loader alone, on a plain model: exactly the mtp.* tensors change; the error cases."""
    from tandem.models import TandemModel
    from tandem.trainer.checkpoint import resolve_checkpoint
    from tandem.trainer.config_checks import ConfigError
    from tandem.trainer.materialize import load_mtp_weights
    from tandem.trainer.recipe import load_config

    cfg = load_config(os.path.join(resolve_checkpoint(runs["new"]), "config.yaml"))
    model = TandemModel(cfg.model, cfg.mtp)
    model.load_state_dict(_state(runs["new"]))
    loaded = load_mtp_weights(model, runs["old"])
    assert loaded and all(k.startswith("mtp.") for k in loaded)
    old, new, got = _state(runs["old"]), _state(runs["new"]), model.state_dict()
    for k, v in got.items():
        assert torch.equal(v.float(), old[k] if k.startswith("mtp.") else new[k]), k

    with pytest.raises(ConfigError,
                       match=r"^config key 'mtp.init_from'=.*holds no MTP weights") as exc:
        load_mtp_weights(model, runs["plain"])
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError,
                       match=r"^config key 'mtp.init_from'=.*is not a Tandem checkpoint"):
        load_mtp_weights(model, os.path.dirname(runs["plain"]) + "/nowhere")
    cfg.model.hidden_size *= 2  # a trunk of another width: the old MTP module does not fit it
    wide = TandemModel(cfg.model, cfg.mtp)
    with pytest.raises(ConfigError, match=r"^config key 'mtp.init_from'=.*does not fit") as exc:
        load_mtp_weights(wide, runs["old"])
    assert "\n" not in str(exc.value)


def test_refresh_from_a_checkpoint_without_mtp_fails_before_loading(runs, corpus_cache, tmp_path,
                                                                    capsys):
    from tandem.trainer.cli import main as cli

    run_dir = tmp_path / "refresh"
    rc = cli(["train", REFRESH, *_refresh_args(runs, str(run_dir), runs["plain"], corpus_cache)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and "mtp.init_from" in err[-1] and "holds no MTP weights" in err[-1], err[-3:]
    assert not os.path.exists(run_dir / "checkpoints")


def test_refresh_from_a_hugging_face_directory(runs, corpus_cache, tmp_path, capsys):
    """A released model's own MTP weights as `mtp.init_from`: the old run exported to Hugging Face
    layout (`tandem export`) gives exactly its MTP tensors, and nothing of its trunk."""
    from tandem.trainer.cli import main as cli

    hf = str(tmp_path / "old_hf")
    assert cli(["export", "--checkpoint", runs["old"], "--out", hf]) == 0
    run_dir = str(tmp_path / "refresh")
    assert cli(["train", REFRESH, *_refresh_args(runs, run_dir, hf, corpus_cache)]) == 0
    old, new, got = (_state(p, parameters_only=True) for p in (runs["old"], runs["new"], run_dir))
    assert set(got) == set(old)
    assert any(k.startswith("mtp.") for k in got)
    for k, v in got.items():
        torch.testing.assert_close(v, old[k] if k.startswith("mtp.") else new[k], rtol=0,
                                   atol=1e-12, msg=k)

    plain_hf = str(tmp_path / "plain_hf")  # a trunk-only export: a one-line error, nothing written
    assert cli(["export", "--checkpoint", runs["plain"], "--out", plain_hf]) == 0
    refused = tmp_path / "refused"
    capsys.readouterr()
    rc = cli(["train", REFRESH, *_refresh_args(runs, str(refused), plain_hf, corpus_cache)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and err[-1].endswith(f"config key 'mtp.init_from'={plain_hf!r}: its safetensors "
                                        "hold no MTP weights"), err[-3:]
    assert not (refused / "checkpoints").exists()
