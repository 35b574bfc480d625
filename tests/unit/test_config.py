"""Config composition and validation: each bad input gets a one-line error naming the key."""

import pytest

from tandem.trainer.config import ConfigError, load_config, to_yaml


def test_overrides_and_lambda_alias(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("mtp:\n  num_steps: 2\n  loss:\n    lambda: 0.25\n    lambda_after: {10: 0.05}\ntrain:\n  max_steps: 7\n")
    cfg = load_config(str(recipe), ["train.max_steps=9", "mtp.loss.lambda=0.5"])
    assert (cfg.mtp.num_steps, cfg.train.max_steps, cfg.mtp.loss.lambda_) == (2, 9, 0.5)
    assert cfg.mtp.loss.lambda_after == {10: 0.05}
    text = to_yaml(cfg)
    assert "lambda: 0.5" in text and "lambda_:" not in text
    again = tmp_path / "again.yaml"
    again.write_text(text)
    assert load_config(str(again)) == cfg  # the resolved config round-trips


@pytest.mark.parametrize("overrides, message", [
    (["train.max_stepz=3"], "unknown config key 'train.max_stepz'"),
    (["train.max_steps=abc"], "config key 'train.max_steps'"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["mtp.num_steps=-1"], "mtp.num_steps must be >= 0"),
    (["mtp.num_steps=2", "mtp.num_layers=0"], "mtp.num_layers must be positive"),
    (["mtp.num_steps=3", "mtp.loss.weights=[1,2]"], "mtp.loss.weights has 2 entries but mtp.num_steps=3"),
    (["model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads"),
    (["model.top_k=9", "model.num_experts=8"], "model.top_k=9"),
    (["mtp.style=fancy"], "mtp.style"),
    (["mtp.style=parallel", "mtp.num_steps=3", "mtp.num_layers=1"], "mtp.num_layers=1 must equal mtp.num_steps=3"),
    (["model.vocab_size=1000", "data.vocab_size=4096"], "model.vocab_size=1000 is smaller than data.vocab_size=4096"),
    (["data.seq_len=4096", "model.max_seq_len=1024"], "model.max_seq_len"),
    (["device=tpu"], "config key 'device'"),
    (["mtp.loss.lambda=oops"], "mtp.loss.lambda"),
    (["noequals"], "not of the form key=value"),
    (["run.name=`id`"], "override 'run.name=`id`' has a value that is not valid YAML"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_recipe_errors(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    typo = tmp_path / "typo.yaml"
    typo.write_text("mtp:\n  num_stepz: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'mtp.num_stepz' \(in .*typo.yaml"):
        load_config(str(typo))
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(broken))
