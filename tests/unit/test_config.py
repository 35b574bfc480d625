"""Config composition and validation: each bad input gets a one-line error naming the key."""

import os

import pytest
import torch

from tandem.models import TandemModel
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.recipe import load_config, to_yaml


def test_overrides_and_lambda_alias(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("mtp:\n  num_steps: 2\n  loss:\n    lambda: 0.25\n    lambda_after: {10: "
                      "0.05}\ntrain:\n  "
                      "max_steps: 7\n")
    cfg = load_config(str(recipe), ["train.max_steps=9", "mtp.loss.lambda=0.5"])
    assert (cfg.mtp.num_steps, cfg.train.max_steps, cfg.mtp.loss.lambda_) == (2, 9, 0.5)
    assert cfg.mtp.loss.lambda_after == {10: 0.05}
    text = to_yaml(cfg)
    assert "lambda: 0.5" in text and "lambda_:" not in text
    again = tmp_path / "again.yaml"
    again.write_text(text)
    assert load_config(str(again)) == cfg  # the resolved config round-trips
    # a section set whole spells `lambda` as recipes do (it was an unknown key there)
    for whole in ("mtp.loss={lambda: 0.2}", "mtp={loss: {lambda: 0.2}}"):
        assert load_config(str(recipe), [whole]).mtp.loss.lambda_ == 0.2


def test_a_mapping_valued_key_is_replaced_whole(tmp_path):
    """A later layer's `mtp.loss.lambda_after` replaces the one beneath it (`{}` turns the schedule
    off), in a recipe over its base as on the command line; it was merged key by key, so `{}`
    kept the recipe's milestones and the run trained another weight schedule."""
    base = tmp_path / "base.yaml"
    base.write_text("mtp:\n  num_steps: 2\n  loss:\n    lambda_after: {10: 0.05}\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: base.yaml\nmtp:\n  loss:\n    lambda_after: {20: 0.1}\n")
    assert load_config(str(recipe)).mtp.loss.lambda_after == {20: 0.1}
    assert load_config(str(recipe), ["mtp.loss.lambda_after={}"]).mtp.loss.lambda_after == {}
    got = load_config(str(recipe), ["mtp.loss.lambda_after={5: 0.2}"]).mtp.loss.lambda_after
    assert got == {5: 0.2}
    assert load_config(str(base), ["train.max_steps=9"]).mtp.loss.lambda_after == {10: 0.05}
    with pytest.raises(ConfigError, match=r"'mtp.loss.lambda_after' is a mapping, set whole: "
                                          r"mtp.loss.lambda_after=\{20: 0.3\}"):
        load_config(str(recipe), ["mtp.loss.lambda_after.20=0.3"])


def test_a_string_keys_override_is_its_text(monkeypatch):
    """YAML dropped ` #2` from `run.dir=/sweeps/lr #2` as a comment (the run trained into
    /sweeps/lr) and read a run name 010 as 8, 12:30 as 750 and yes as True; `~` stayed a directory
    named `~`."""
    monkeypatch.setenv("HOME", "/home/someone")
    cfg = load_config(None, ["run.dir=/sweeps/lr #2", "run.name=010"])
    assert (cfg.run.dir, cfg.run.name) == ("/sweeps/lr #2", "010")
    for text in ("12:30", "yes", "0x10", "1.10"):
        assert load_config(None, [f"run.name={text}"]).run.name == text
    assert load_config(None, ["run.name='quoted name'"]).run.name == "quoted name"
    assert load_config(None, ["run.dir=~/runs/a"]).run.dir == "/home/someone/runs/a"
    assert load_config(None, ["train.max_steps=010"]).train.max_steps == 10  # still YAML
    # YAML's null stays refused for a text key (it became the text 'null', a path to load)
    with pytest.raises(ConfigError, match="'model.init_from' is text and cannot be null"):
        load_config(None, ["model.init_from=null"])
    assert load_config(None, ["model.init_from="]).model.init_from == ""


def test_every_yaml_mapping_file_is_refused_in_one_line_naming_it(tmp_path):
    """Recipes, a checkpoint's config.yaml and a reported run's config.yaml go through one reader
    (`read_yaml_mapping`): bad YAML, bytes that are not UTF-8, and a document that is not a mapping
    are one line naming the file, in the caller's error type; an empty file is {} where allowed."""
    from tandem.trainer.config_yaml import read_yaml_mapping

    path = tmp_path / "config.yaml"
    cases = {b"train: [1\n": "is not valid YAML: while parsing",
             b"train:\n  name: \xff\xfe\n": "is not valid YAML: 'utf-8' codec can't decode",
             b"- 1\n- 2\n": "is not a mapping of config sections"}
    for content, message in cases.items():
        path.write_bytes(content)
        with pytest.raises(ValueError) as info:
            read_yaml_mapping(str(path), f"checkpoint config {path}", ValueError)
        line = str(info.value)
        assert line.startswith(f"checkpoint config {path} {message}") and "\n" not in line, line
    path.write_bytes(b"# nothing yet\n")
    assert read_yaml_mapping(str(path), "x") == {}
    with pytest.raises(ConfigError, match="x is not a mapping of config sections"):
        read_yaml_mapping(str(path), "x", empty_ok=False)


def test_recipes_and_overrides_read_yaml_1_2_numbers(tmp_path):
    """PyYAML's YAML 1.1 read `parallel.pp_layout=[010,2]` as [8, 2] and `[1:0]` as [60] (base
    60), in a recipe as in an override, and a recipe's `name: off` as the boolean false; YAML 1.2
    reads 010 as 10 and keeps the others text, which an integer key refuses by name."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  num_layers: 4\nparallel:\n  pp_layout: [010, 2, 0x1, 0o1]\n"
                      "run:\n  name: off\ntrain:\n  lr: 3e-4\n  compile: false\n")
    cfg = load_config(str(recipe))
    assert (cfg.parallel.pp_layout, cfg.run.name) == ([10, 2, 1, 1], "off")
    assert (cfg.train.lr, cfg.train.compile) == (3e-4, False)
    assert load_config(None, ["parallel.pp_layout=[010,2]"]).parallel.pp_layout == [10, 2]
    with pytest.raises(ConfigError, match=r"'parallel.pp_layout\[0\]' \(in the overrides\): "
                                          r"Value '1:0' of type 'str' could not be converted"):
        load_config(None, ["parallel.pp_layout=[1:0]"])
    recipe.write_text("parallel:\n  pp_layout: [4:0]\n")
    with pytest.raises(ConfigError, match=r"'parallel.pp_layout\[0\]' \(in .*r.yaml\): Value "
                                          r"'4:0' of type 'str'"):
        load_config(str(recipe))
    # a recipe of comments alone is an empty one (a scalar is refused)
    recipe.write_text("# Hardware: CPU\n")
    assert load_config(str(recipe)) == load_config(None)
    recipe.write_text("just text\n")
    with pytest.raises(ConfigError, match="is not a mapping of config sections"):
        load_config(str(recipe))
    # a key given twice is refused where the second one is, as omegaconf's own loader did
    recipe.write_text("train:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: .*found duplicate key lr .*line 4"):
        load_config(str(recipe))
    # booleans a boolean key reads as before (omegaconf's own spellings), numbers as floats
    assert load_config(None, ["train.compile=yes", "train.lr=1"]).train.compile is True
    # a run's config.yaml quotes every text YAML 1.2 would read as something else (omegaconf's
    # dumper left 0o17 plain, read back as 15)
    from tandem.trainer.recipe import to_yaml

    for name in ("0o17", "0x10", "010", "1e3", "off", "1:0", ".5", "true", "- a", "plain"):
        saved = tmp_path / "config.yaml"
        saved.write_text(to_yaml(load_config(None, [f"run.name={name}"])))
        assert load_config(str(saved)).run.name == name


def test_an_interpolation_in_a_string_override_stays_text(monkeypatch, tmp_path):
    """`run.name=${oc.env:TOKEN}` put the variable's value into config.yaml, the checkpoints and
    wandb, and `run.dir=/a${b}` was refused as a missing key; the text is kept, through config.yaml
    and back (read back, config.yaml had resolved an escaped one again at resume)."""
    from tandem.trainer.recipe import as_dict, to_yaml

    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    cfg = load_config(None, ["run.name=${oc.env:SECRET_TOKEN}", "run.dir=/a${b}"])
    assert (cfg.run.name, cfg.run.dir) == ("${oc.env:SECRET_TOKEN}", "/a${b}")
    assert as_dict(cfg)["run"]["name"] == "${oc.env:SECRET_TOKEN}"
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert "hunter2" not in saved.read_text()
    again = load_config(str(saved))
    assert (again.run.name, again.run.dir) == ("${oc.env:SECRET_TOKEN}", "/a${b}")
    assert to_yaml(again) == saved.read_text()
    recipe = tmp_path / "recipe.yaml"  # a recipe's own interpolations still resolve
    recipe.write_text("run:\n  name: ${oc.env:SECRET_TOKEN}\n")
    assert load_config(str(recipe)).run.name == "hunter2"


@pytest.mark.parametrize("overrides, message", [
    (["train.max_stepz=3"], "unknown config key 'train.max_stepz'"),
    (["train.max_steps=abc"], "config key 'train.max_steps'"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    # these three once passed: a negative decay trained, a prompt-less evaluation crashed in its
    # first run after training, a token-less one failed with an unnamed key
    (["train.weight_decay=-1"], "config key 'train.weight_decay'=-1.0 must be >= 0"),
    (["eval.num_prompts=0"], "config key 'eval.num_prompts'=0 must be >= 1"),
    (["eval.max_new_tokens=1"], "config key 'eval.max_new_tokens'=1 must be >= 2"),
    # and these trained: NaN losses (rope_theta, rms_norm_eps), a crash at initialisation
    # (init_std), an MTP module trained to predict worse (lambda), depth 3 logging a loss of 0
    # with no target (seq_len), an unseeded error without its key (seed), and data.paths quietly
    # ignored for the embedded corpus
    (["model.rope_theta=-1"], "model.rope_theta must be positive and finite, got -1.0"),
    (["model.rms_norm_eps=0"], "model.rms_norm_eps must be positive and finite, got 0.0"),
    (["model.init_std=-1"], "model.init_std must be >= 0, got -1.0"),
    (["mtp.loss.lambda=-1"], "mtp.loss.lambda must be >= 0, got -1.0"),
    (["mtp.loss.lambda_after={5: -0.1}"], "mtp.loss.lambda_after[5] must be >= 0, got -0.1"),
    (["mtp.num_steps=3", "data.seq_len=3", "model.max_seq_len=16"],
     "config key 'data.seq_len'=3 must be > mtp.num_steps"),
    (["train.seed=-1"], "config key 'train.seed'=-1 must be in [0, 2**32)"),
    (["data.paths=[/data/a]"], "'data.paths'=['/data/a'] is not read with data.source=stdlib"),
    # the MoE's: n_group=0 divided by zero, a negative shared width crashed at construction, the
    # rest trained with a negative weight
    (["model.n_group=0"], "model.n_group must be positive and finite, got 0"),
    (["model.shared_expert_intermediate_size=-1"],
     "model.shared_expert_intermediate_size must be >= 0 and finite, got -1"),
    (["model.aux_loss_coef=-1"], "model.aux_loss_coef must be >= 0 and finite, got -1.0"),
    (["model.routed_scaling_factor=inf"], "model.routed_scaling_factor must be positive and "
                                          "finite, got inf"),
    (["model.routed_scaling_factor=-1"], "model.routed_scaling_factor must be positive"),
    (["train.decay_steps=-1"], "config key 'train.decay_steps'=-1 must be >= 0"),
    (["flavor=qwen4_exp_tiny", "model.ngram_size=0"], "model.ngram_size=0 must be >= 2"),
    (["mtp.num_steps=-1"], "mtp.num_steps must be >= 0"),
    (["train=5"], "config key 'train' is a section, not a value: set its keys (train.KEY=VALUE)"),
    (["mtp.loss=3"], "config key 'mtp.loss' is a section, not a value"),
    (["=5"], "override '=5' names no key, or a key with an empty part"),
    (["train..lr=1"], "override 'train..lr=1' names no key, or a key with an empty part"),
    (["train.skip_window=0"], "config key 'train.skip_window'=0 must be positive"),
    (["data.split=0,0,0"], "config key 'data.split'='0,0,0' must be up to three"),
    (["eval.loss_batches=0"], "config key 'eval.loss_batches'=0 must be >= 1"),
    (["mtp.loss.lambda_after={-5: 0.1}"], "mtp.loss.lambda_after[-5]: a step must be >= 0"),
    (["mtp.num_steps=2", "mtp.num_layers=0"], "mtp.num_layers must be positive"),
    (["mtp.num_steps=3", "mtp.loss.weights=[1,2]"],
     "mtp.loss.weights has 2 entries but mtp.num_steps=3"),
    (["model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads"),
    # accepted, and no gate was built
    (["model.shared_expert_gate=true", "model.num_shared_experts=0"],
     "model.shared_expert_gate=true gates the shared expert, but model.num_shared_experts=0"),
    (["model.top_k=9", "model.num_experts=8"], "model.top_k=9"),
    (["mtp.style=fancy"], "mtp.style"),
    (["mtp.style=parallel", "mtp.num_steps=3", "mtp.num_layers=1"],
     "mtp.num_layers=1 must equal mtp.num_steps=3"),
    (["model.vocab_size=1000", "data.vocab_size=4096"],
     "model.vocab_size=1000 is smaller than data.vocab_size=4096"),
    (["data.seq_len=4096", "model.max_seq_len=1024"], "model.max_seq_len"),
    (["device=tpu"], "config key 'device'"),
    (["mtp.loss.lambda=oops"], "mtp.loss.lambda"),
    (["noequals"], "not of the form key=value"),
    (['train.lr=`1e-3`'], "override 'train.lr=`1e-3`' has a value that is not valid YAML"),
    # passed the range checks and trained NaNs to the end, exiting 0
    (["train.lr=inf"], "config key 'train.lr'=inf must be a finite number"),
    (["train.eps=nan"], "config key 'train.eps'=nan must be a finite number"),
    (["mtp.loss.lambda=inf"], "config key 'mtp.loss.lambda'=inf must be a finite number"),
    (["mtp.loss.weights=[1.0,inf,1.0]"], "config key 'mtp.loss.weights'=[1.0, inf, 1.0] must be"),
    (["model.init_std=inf"], "config key 'model.init_std'=inf must be a finite number"),
    # MLA and YaRN
    (["flavor=debug_mla", "model.num_kv_heads=1"], "must equal model.num_heads=2 with MLA"),
    (["flavor=debug_mla", "model.qk_rope_head_dim=5"], "model.qk_rope_head_dim=5 must be even"),
    (["flavor=debug_mla", "model.qk_norm=true"], "MLA (model.kv_lora_rank > 0) takes no"),
    (["model.q_lora_rank=8"], "model.q_lora_rank is an MLA width; set model.kv_lora_rank too"),
    (["model.rope_scaling=ntk"], "model.rope_scaling must be 'none', 'yarn' or 'llama3'"),
    (["model.rope_scaling=llama3", "model.rope_high_freq_factor=0.5"],
     "0 < rope_low_freq_factor < rope_high_freq_factor"),
    (["model.rope_scaling=yarn", "model.rope_beta_fast=0.5"], "rope_beta_fast >= rope_beta_slow"),
    (["flavor=qwen4_exp_tiny", "model.rope_scaling=yarn"], "QSA (indexed_attention) layers"),
    # a traceback (omegaconf's merge: "Cannot merge incompatible container types")
    (["parallel.pp_layout.0=2"], "config key 'parallel.pp_layout' is a list, set whole"),
    # Hydra's deletion was read as a set: ~train.max_steps=5 trained 5 steps
    (["~train.max_steps=5"], "deleting a key is not supported"),
    # an override's typo named the recipe as a place to look
    (["train.max_stepz=3"], "unknown config key 'train.max_stepz' (in the overrides)"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_recipe_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    # `tandem train recipes/tiny.yaml` from outside the repository names the shipped recipe
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config("recipes/tiny.yaml")
    from tandem.trainer.recipe import SHIPPED_RECIPES

    assert str(err.value) == ("recipe file not found: recipes/tiny.yaml (a shipped recipe: "
                              f"{os.path.join(SHIPPED_RECIPES, 'tiny.yaml')})")
    # a directory given as the recipe, a checkpoint without its config: "recipe file not found"
    with pytest.raises(ConfigError, match=f"^recipe {tmp_path} is a directory, not a YAML file$"):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match=f"^{tmp_path} has no config.yaml: not a Tandem run or "
                                          "checkpoint, or an incomplete one$"):
        load_config(str(tmp_path / "config.yaml"))
    typo = tmp_path / "typo.yaml"
    typo.write_text("mtp:\n  num_stepz: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'mtp.num_stepz' \(in .*typo.yaml"):
        load_config(str(typo))
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(broken))


# --- composition: base recipes and model flavors (trainer/config.py, models/flavors.py) -----------
def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_base_recipe_is_composed_first_relative_to_the_recipe(tmp_path, monkeypatch):
    _write(tmp_path / "bases" / "base.yaml",
           "train:\n  max_steps: 7\n  lr: 0.002\nmtp:\n  loss:\n    lambda: 0.25\n    "
           "lambda_after: {10: 0.05}\n")
    child = _write(tmp_path / "bases" / "child.yaml", "base: base.yaml\ntrain:\n  max_steps: 9\n")
    # the base resolves from the recipe's directory, not the working directory
    monkeypatch.chdir(tmp_path)
    cfg = load_config(child, ["train.lr=0.001"])
    assert (cfg.train.max_steps, cfg.train.lr, cfg.mtp.loss.lambda_, cfg.mtp.loss.lambda_after) == (
        9,
        0.001,
        0.25,
        {10: 0.05},
    )
    # the resolved config is complete and self-contained: no composition keys, and it round-trips
    text = to_yaml(cfg)
    assert not any(line.startswith(("base:", "flavor:")) for line in text.splitlines())
    again = _write(tmp_path / "elsewhere" / "config.yaml", text)
    assert load_config(again) == cfg


def test_bases_in_order_then_the_recipe(tmp_path):
    _write(tmp_path / "a.yaml", "train:\n  max_steps: 1\n  lr: 0.002\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\ntrain:\n  max_steps: 2\n")
    _write(tmp_path / "c.yaml", "train:\n  max_steps: 3\n  seed: 5\n")
    cfg = load_config(_write(tmp_path / "d.yaml", "base: [b.yaml, c.yaml]\ntrain:\n  seed: 6\n"))
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.seed) == (3, 0.002, 6)


def test_flavor_in_a_recipe_and_on_the_command_line():
    from tandem.models import flavors

    debug = flavors.flavor("debug")["model"]
    cfg = load_config(None, ["data.vocab_size=512", "flavor=debug", "model.num_kv_heads=2"])
    assert all(getattr(cfg.model, k) == v for k, v in debug.items() if k != "num_kv_heads")
    assert cfg.model.num_kv_heads == 2  # later overrides win
    assert load_config(None, ["model.hidden_size=64", "data.vocab_size=512",
                              "flavor=debug"]).model.hidden_size == 32
    # the expanded form equals the flavor
    assert load_config(None, ["data.vocab_size=512", *flavors.overrides("debug")]) == load_config(
        None, ["data.vocab_size=512", "flavor=debug"])
    assert flavors.model_config("debug", vocab_size=97).hidden_size == 32


def test_recipe_sections_win_over_its_flavor_and_its_flavor_over_its_bases(tmp_path):
    _write(tmp_path / "base.yaml",
           "model:\n  hidden_size: 64\n  rope_theta: 500.0\ndata:\n  vocab_size: 512\n")
    cfg = load_config(_write(tmp_path / "r.yaml",
                             "base: base.yaml\nflavor: debug\nmodel:\n  num_layers: 3\n"))
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.rope_theta) == (32, 3, 500.0)


def test_explicit_keys_are_the_recipes_and_the_overrides_not_the_flavors(tmp_path):
    """What a run set itself (model.init_from leaves some of it as set): its recipe's sections and
    its bases', and the overrides; not a flavor's keys, in a recipe or on the command line."""
    from tandem.trainer.recipe import explicit_keys

    _write(tmp_path / "base.yaml", "model:\n  rope_theta: 500.0\nmtp:\n  loss:\n    lambda: 0.2\n")
    recipe = _write(tmp_path / "r.yaml",
                    "base: base.yaml\nflavor: debug\nmodel:\n  num_layers: 3\n")
    overrides = ["flavor=debug", "model.indexer_budget=96", "train.max_steps=2"]
    keys = explicit_keys(str(recipe), overrides)
    assert keys == {"model.rope_theta", "mtp.loss.lambda", "model.num_layers",
                    "model.indexer_budget", "train.max_steps"}, keys
    assert explicit_keys(None, ["flavor=debug"]) == frozenset()
    # a section set whole gives its leaves; an alias keeps its public spelling
    whole = ["model={rope_theta: 1.0e6, indexer_budget: 64}", "mtp.loss.lambda=0.3"]
    load_config(None, whole)
    assert explicit_keys(None, whole) == {"model.rope_theta", "model.indexer_budget",
                                          "mtp.loss.lambda"}


@pytest.mark.parametrize("files, message", [
    ({"r.yaml": "base: missing.yaml\n"}, "base recipe not found"),
    ({"r.yaml": "base: s.yaml\n", "s.yaml": "base: r.yaml\n"}, "includes itself"),
    ({"r.yaml": "base: {a: 1}\n"}, "base must be a recipe path or a list of them"),
    ({"r.yaml": "flavor: huge\n"}, "unknown model flavor 'huge'; known: debug"),
    ({"r.yaml": "base: s.yaml\n", "s.yaml": "train:\n  max_stepz: 3\n"},
     "unknown config key 'train.max_stepz' (in "),
])
def test_composition_errors_are_one_line(tmp_path, files, message):
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "r.yaml"))
    assert message in str(err.value) and "\n" not in str(err.value)
    if "max_stepz" in message:
        assert "s.yaml" in str(err.value)  # names the base file that holds the typo


def test_unknown_flavor_override():
    with pytest.raises(ConfigError, match="override 'flavor=huge': unknown model flavor 'huge'"):
        load_config(None, ["flavor=huge"])


# --- each section validates beside its fields -----------------------------------------------------
def test_every_section_has_its_checks():
    from tandem.models.config import ModelConfig
    from tandem.models.mtp_config import MTPConfig, MTPLossConfig
    from tandem.trainer import config
    from tandem.trainer.train_config import TrainConfig

    for cls in (config.RunConfig, config.DataConfig, TrainConfig, config.ParallelConfig,
                config.EvalConfig,
                config.LoggingConfig, config.CheckpointConfig, config.TandemConfig, ModelConfig,
                MTPConfig, MTPLossConfig):
        assert callable(getattr(cls, "validate", None)), cls.__name__


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=0"],
     "config key 'parallel.pp_virtual_stages'=0 must be positive"),
    (["parallel.pp_microbatches=-1"], "config key 'parallel.pp_microbatches'=-1 must be >= 0"),
    (["logging.peak_tflops=-1"], "config key 'logging.peak_tflops'=-1.0 must be >= 0"),
    (["parallel.dp_mode=ddp"], "config key 'parallel.dp_mode'='ddp' must be fsdp or allreduce"),
    (["mtp.loss.objective=kl"], "mtp.loss.objective='kl' must be ce or acceptance"),
    (["train.distill=soft", "mtp.loss.objective=acceptance"],
     "config key 'train.distill'='soft' must be none"),
])
def test_section_checks_at_load_time(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_mla_model_is_not_held_to_head_dim():
    """MLA's head widths are its qk_*/v_head_dim keys: a width that no head_dim divides (36 over 8
    heads, as transformers' DeepseekV3 runs it) was refused for GQA's reasons ("set
    model.head_dim", an odd rotary width)."""
    cfg = load_config(None, ["flavor=debug_mla", "data.vocab_size=512", "model.hidden_size=36",
                             "model.num_heads=8", "model.num_kv_heads=8"]).model
    model = TandemModel(cfg, MTPConfig(num_steps=0))
    out = model.trunk(torch.randint(0, 64, (1, 6)), torch.arange(6)[None])
    assert out.shape == (1, 6, 36) and torch.isfinite(out).all()
