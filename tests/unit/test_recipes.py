"""Every recipe composes and validates; its size and per-rank memory fit the hardware it names."""

import glob
import os

import pytest
import torch

from tandem.models import TandemModel
from tandem.trainer.config import load_config
from tandem.trainer.estimate import estimate

RECIPES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "*.yaml")))
HBM_GIB = {"cuda": 80, "npu": 64}


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_composes_validates_and_fits(recipe):
    text = open(recipe).read()
    assert text.startswith("#") and "ardware" in text.split("\n\n")[0].split("run:")[0], "header must state the hardware"
    cfg = load_config(recipe)
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.ep * max(cfg.parallel.dp, 1)
    est = estimate(cfg, world)
    print(f"{os.path.basename(recipe)}: world={world} (tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
          f"ep={cfg.parallel.ep}) {est.summary()}")
    assert est.total_params > 0 and est.active_params_per_token <= est.total_params
    if cfg.device in HBM_GIB:
        assert 2e9 <= est.total_params <= 8e9  # "a few billion"
        assert est.total_gib_per_rank < 0.9 * HBM_GIB[cfg.device]


def test_parameter_count_is_exact():
    cfg = load_config(RECIPES[0], ["model.tie_embeddings=true"])
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp)
    est = estimate(cfg)
    assert est.total_params == sum(p.numel() for p in model.parameters())
    assert est.mtp_params == sum(p.numel() for p in model.mtp.parameters())
