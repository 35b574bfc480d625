"""Every recipe composes and validates; its size and per-rank memory fit the hardware it names."""

import glob
import os

import pytest
import torch
from omegaconf import OmegaConf

from tandem.models import TandemModel, flavors
from tandem.models.mtp_config import validate_model
from tandem.trainer.estimate import estimate
from tandem.trainer.parallel.pipeline_plan import PipelinePlan, item_flops, stage_flops
from tandem.trainer.recipe import as_dict, load_config

RECIPE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
RECIPES = sorted(glob.glob(os.path.join(RECIPE_DIR, "*.yaml")))
HBM_GIB = {"cuda": 80, "npu": 64}
# a recipe whose header names a bigger device is held to that device (141 GB = 131 GiB)
DEVICE_GIB = {"H200": 131}
# what each cluster recipe is: the DeepSeek-V3-like recipes are "a few billion" parameters, the
# Qwen3.8-Flash-Next ones its published ~179B
SIZES = {"moe_4b": (2e9, 8e9), "qwen38_flash": (1.7e11, 1.9e11)}
# the keys a recipe's header says its command line gives (paths of the user's checkpoints and data)
COMMAND_LINE = {
    "finetune_mtp_selfdistill.yaml": ["model.init_from=runs/tiny",
                                      "data.paths=[runs/tiny-gen.jsonl]"],
    "mtp_refresh.yaml": ["model.init_from=runs/trunk_ft", "mtp.init_from=runs/tiny",
                         "data.paths=[runs/trunk_ft-gen.jsonl]"],
}


def _load(recipe: str):
    return load_config(recipe, COMMAND_LINE.get(os.path.basename(recipe), []))


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_composes_validates_and_fits(recipe):
    text = open(recipe).read()
    header = text.split("\n\n")[0].split("run:")[0]
    assert text.startswith("#") and "ardware" in header, "header must state the hardware"
    cfg = _load(recipe)
    world = (
        cfg.parallel.tp
        * cfg.parallel.pp
        * cfg.parallel.cp
        * cfg.parallel.ep
        * max(cfg.parallel.dp, 1)
    )
    est = estimate(cfg, world)
    print(f"{os.path.basename(recipe)}: world={world} (tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
          f"cp={cfg.parallel.cp} "
          f"ep={cfg.parallel.ep}) {est.summary()}")
    assert est.total_params > 0 and est.active_params_per_token <= est.total_params
    if cfg.device in HBM_GIB:
        low, high = next(size for key,
                         size in SIZES.items() if os.path.basename(recipe).startswith(key))
        assert low <= est.total_params <= high
        header = text.split("run:")[0]
        hbm = next((gib for name,
                    gib in DEVICE_GIB.items() if name in header and cfg.device == "cuda"),
                   HBM_GIB[cfg.device])
        assert est.total_gib_per_rank < 0.9 * hbm


def test_parameter_count_is_exact():
    cfg = load_config(RECIPES[0], ["model.tie_embeddings=true"])
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp)
    est = estimate(cfg)
    assert est.total_params == sum(p.numel() for p in model.parameters())
    assert est.mtp_params == sum(p.numel() for p in model.mtp.parameters())


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_pipeline_ranks_within_1_2x_and_stages_within_1_5x_of_the_mean(recipe):
    """No pp rank carries more than 1.2x the mean training FLOPs (trainer/estimate.py's, as
    bench/pipeline_balance.py prints them), and no pipeline stage more than 1.5x, the Qwen3.8-Flash
    recipes' drafter depths included: with mtp.qsa_reuse_indices depth 1's QSA selection travels to
    the later depths' stages. Under the interleaved schedule a rank runs its stages one after
    another, every rank the same chunk order, so the steady state runs at the rank's pace; a
    heavier stage lengthens the warm-up and cool-down. The Qwen3.8-Flash recipe holds 4 stages per
    rank (its heads' stages x1.46 the mean stage, its ranks x1.02): at 3 (x1.09, x1.04) a rank's
    peak of micro-batches in flight needed 131 GiB per H200, 117.6 at 4."""
    cfg = _load(recipe)
    plan = PipelinePlan(cfg)
    plan.check(cfg)
    layers, depths = item_flops(cfg)
    flops = stage_flops(layers, depths, plan.layout, plan.depth_stage)
    ranks = [sum(flops[s] for s in plan.stages_of(r)) for r in range(plan.pp)]
    stage_ratio = max(flops) / (sum(flops) / len(flops))
    rank_ratio = max(ranks) / (sum(ranks) / len(ranks))
    print(f"{os.path.basename(recipe)}: max stage x{stage_ratio:.3f}, max pp rank "
          f"x{rank_ratio:.3f} of the mean")
    assert stage_ratio <= 1.5
    assert rank_ratio <= 1.2


def _flat(node, prefix=""):
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + str(key)] = value
    return out


@pytest.mark.parametrize("gpu, ascend", [("moe_4b_mtp_gpu.yaml", "moe_4b_mtp_ascend.yaml"),
                                         ("qwen38_flash_gpu.yaml", "qwen38_flash_ascend.yaml")])
def test_ascend_recipe_is_the_gpu_recipe_plus_a_short_override(gpu, ascend):
    """Each GPU/Ascend pair is one recipe: the Ascend one names the GPU one as its `base:` and sets
    only what the device changes; everything else resolves identically."""
    raw = OmegaConf.to_container(OmegaConf.load(os.path.join(RECIPE_DIR, ascend)))
    assert raw.pop("base") == gpu
    own = _flat(raw)
    assert len(own) <= 8, own
    g = _flat(as_dict(load_config(os.path.join(RECIPE_DIR, gpu))))
    a = _flat(as_dict(load_config(os.path.join(RECIPE_DIR, ascend))))
    assert a["device"] == "npu" and g["device"] == "cuda"
    assert {k for k in g if g[k] != a[k]} == set(own)


@pytest.mark.parametrize("name", flavors.names())
def test_every_flavor_validates_and_reads_back_from_its_overrides(name):
    validate_model(flavors.model_config(name), flavors.mtp_config(name))
    # the `key=value` form parses back to the flavor's values (no data here: a megatron prefix is
    # never read)
    cfg = load_config(None, ["data.source=megatron", "data.paths=[/nowhere]", "data.seq_len=64",
                             f"flavor={name}"])
    for section, keys in flavors.flavor(name).items():
        for key, value in keys.items():
            assert getattr(getattr(cfg, section), key) == value, (section, key)
    assert cfg == load_config(None,
                              ["data.source=megatron", "data.paths=[/nowhere]", "data.seq_len=64",
                                     *flavors.overrides(name)])


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_models_are_named_flavors(recipe):
    """A recipe that trains a model from scratch takes its shape from a named flavor (one home for
    each shape); fine-tuning recipes take it from model.init_from."""
    cfg = _load(recipe)
    if cfg.model.init_from or "finetune" in os.path.basename(recipe):
        return
    matches = [name for name in flavors.names()
               if all(getattr(cfg.model, k) == v for k, v in flavors.flavor(name)["model"].items())]
    assert matches, "the recipe's model is no named flavor: add one to models/flavors.py"
