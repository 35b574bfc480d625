"""HF import and export: clear errors (malformed files named, long lists cut short, `tandem export`
refusing an OUT or tokenizer that would lose data or ship a wrong tokenizer), the Qwen3-Next `mtp.*`
naming, and shard-wise (DTensor) slicing."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.checkpoint import save_checkpoint
from tandem.trainer.hf.export import export_hf, export_main
from tandem.trainer.hf.families import Src, UnsupportedCheckpoint
from tandem.trainer.hf.importer import (
    load_hf_model,
    load_hf_weights,
    read_source,
    shard_index,
)
from tandem.trainer.hf.reader import (
    CheckpointError,
    CheckpointReader,
    PickleCheckpointError,
    safetensors_header,
)
from tandem.trainer.recipe import load_config, to_yaml
from tests.e2e.test_bad_input import snapshot

V = 96


def tiny_qwen3(tmp_path, name="q"):
    torch.manual_seed(0)
    cfg = T.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / name)
    return tmp_path / name


def write_config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields))
    return path


def test_unsupported_architecture_named(tmp_path):
    d = write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedCheckpoint, match="GPT2LMHeadModel"):
        load_hf_model(str(d))


DSV3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=96,
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=12,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
            num_experts_per_tok=2, n_routed_experts=4)


@pytest.mark.parametrize("fields,named", [
    (dict(DSV3, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"]),
     "DeepseekV2ForCausalLM: this MLA family is not supported"),
    (dict(DSV3, attention_bias=True), "attention_bias=true"),
    (dict(DSV3, rope_interleave=False), "rope_interleave=false"),
    (dict(DSV3, scoring_func="softmax"), "only sigmoid scoring"),
    (dict(DSV3, rope_scaling=dict(rope_type="longrope", factor=4.0)), "rope_type='longrope'"),
    (dict(DSV3, rope_scaling=dict(rope_type="yarn", factor=4.0, attention_factor=0.5)),
     "explicit attention_factor"),
    # a bare KeyError named neither the file nor the family
    ({k: v for k, v in DSV3.items() if k != "hidden_size"},
     "deepseek_v3: config.json lacks 'hidden_size'"),
    # the model's own check, reported against the file rather than a key the user never wrote
    (dict(DSV3, moe_intermediate_size=0), "deepseek_v3: config.json describes a model Tandem "
     "cannot build: model.moe_intermediate_size must be positive"),
])
def test_what_deepseek_v3_import_cannot_compute_is_named(fields, named, tmp_path):
    """DeepSeek-V3 and Kimi-K2 import (MLA, YaRN); the MLA families and options whose routing,
    biases or rotary layout this model lacks are refused by name before any weight is read."""
    d = write_config(tmp_path / "mla", **fields)
    with pytest.raises(UnsupportedCheckpoint, match=re.escape(named)):
        load_hf_model(str(d))


def test_qwen3_next_trunk_rejected(tmp_path):
    d = write_config(tmp_path / "qn", architectures=["Qwen3NextForCausalLM"],
                     model_type="qwen3_next")
    with pytest.raises(UnsupportedCheckpoint, match="linear attention"):
        load_hf_model(str(d))


def test_missing_moe_field_named(tmp_path):
    """A Qwen3-MoE config.json without num_experts_per_tok failed with a bare KeyError."""
    cfg = T.Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    d = tmp_path / "moe"
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    fields = json.loads((d / "config.json").read_text())
    del fields["num_experts_per_tok"]
    (d / "config.json").write_text(json.dumps(fields))
    with pytest.raises(UnsupportedCheckpoint,
                       match="^qwen3_moe: config.json lacks 'num_experts_per_tok'$"):
        load_hf_model(str(d))


@pytest.mark.parametrize("name,act", [("ckpt[step1]", "silu"), ("swish", "swish")])
def test_checkpoints_transformers_loads_give_its_logits(tmp_path, name, act):
    """A directory name with glob characters ("no *.safetensors in ...") and hidden_act swish
    (transformers' silu) were refused."""
    d = tiny_qwen3(tmp_path, name)
    fields = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**fields, "hidden_act": act}))
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = T.AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits
        model, _ = load_hf_model(str(d))
        ours = model.logits(0, model.trunk(ids, torch.arange(12)[None]))
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_missing_and_unexpected_names_listed(tmp_path):
    d = tiny_qwen3(tmp_path)
    state = load_file(str(d / "model.safetensors"))
    state.pop("model.layers.1.self_attn.q_norm.weight")
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as exc:
        load_hf_model(str(d))
    msg = str(exc.value)
    assert "missing tensors (1): model.layers.1.self_attn.q_norm.weight" in msg
    assert "unexpected tensors (1): model.layers.0.mlp.extra.weight" in msg


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    d = tiny_qwen3(tmp_path)
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(40, 32)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight -> "
                                              r"layers\.0\.mlp\.up_proj\.weight: "
                                              r"expected \(48, 32\), found \(40, 32\)"):
        load_hf_model(str(d))


def test_vocab_mismatch(tmp_path):
    d = tiny_qwen3(tmp_path)
    model, _ = load_hf_model(str(d))
    cfg = ModelConfig(**{**model.cfg.__dict__, "vocab_size": 128})
    other = TandemModel(cfg, MTPConfig(num_steps=0))
    with pytest.raises(CheckpointError,
                       match="vocab mismatch.*vocab_size=96.*model.vocab_size=128"):
        load_hf_weights(other, str(d))
    # a tokenizer beside the checkpoint that is larger than the embedding table
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)},
                               unk_token="w0")).save(str(d / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="tokenizer/vocab mismatch.*200 tokens"):
        load_hf_model(str(d))


def test_pickle_needs_trust(tmp_path):
    d = tiny_qwen3(tmp_path)
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(PickleCheckpointError, match="pytorch_model.bin.*trust_pickle=True"):
        load_hf_model(str(d))
    model, _ = load_hf_model(str(d), trust_pickle=True)
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_qwen3_next_mtp_naming_round_trip(tmp_path):
    """A Qwen3 trunk with a Qwen3-Next-style mtp.* block: export names, zero-centred norm
    conversion, re-import."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, num_experts=0, qk_norm=True, max_seq_len=64)
    model = TandemModel(cfg, MTPConfig(num_steps=2, num_layers=1, moe=False,
                                       trunk_input="final_norm")).eval()
    assert export_hf(model, str(tmp_path / "qn"), family="qwen3_next_mtp") == "qwen3_next_mtp"
    keys = set(load_file(str(tmp_path / "qn" / "model.safetensors")))
    for k in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate_proj.weight",
              "mtp.layers.0.input_layernorm.weight"):
        assert k in keys, k
    assert json.loads((tmp_path / "qn" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    again, tcfg = load_hf_model(str(tmp_path / "qn"), mtp_overrides={"num_steps": 2})
    assert tcfg.mtp.num_layers == 1 and not tcfg.mtp.moe
    for (n1, a), (n2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    # the trunk still loads in transformers (the mtp.* tensors are extra)
    T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "qn"))


def test_zero_centred_norm_conversion(tmp_path):
    """Qwen3-Next stores RMSNorm weights as w - 1: the reader adds 1 (and slices still work)."""
    save_file({"n": torch.tensor([0.0, 0.5, -0.25, 1.0])}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(str(tmp_path))
    out = read_source(reader, Src(["n"], plus_one=True), (slice(1, 3),), (4,))
    assert torch.equal(out, torch.tensor([1.5, 0.75]))


class FakeMesh:
    """Just enough of a DeviceMesh for compute_local_shape_and_global_offset: rank `coord` of a 1-D
    mesh."""

    def __init__(self, size, coord):
        self.shape, self._coord = (size,), [coord]

    def _is_current_rank_part_of_mesh(self):
        return True

    def _sym_get_coordinate(self, index):
        return self._coord[index]


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_reads_only_local_slice(tmp_path, dim):
    """Two fake ranks of a Shard(dim) placement each read exactly their half, for a plain tensor and
    for per-expert tensors stacked along dim 0 (expert parallelism reads only its experts'
    files)."""
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    full = torch.randn(4, 6, 8)
    save_file({f"e{e}": full[e].clone() for e in range(4)} | {"w": full[0].clone()},
              str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(str(tmp_path))
    pieces, plain = [], []
    for rank in range(2):
        idx = shard_index(full.shape, FakeMesh(2, rank), [Shard(dim)])
        assert idx[dim] == slice(rank * full.shape[dim] // 2, (rank + 1) * full.shape[dim] // 2)
        pieces.append(read_source(reader, Src([f"e{e}" for e in range(4)], stacked=True), idx,
                                  full.shape))
        idx2 = shard_index(full[0].shape, FakeMesh(2, rank), [Shard(dim)])
        plain.append(read_source(reader, Src(["w"]), idx2, full[0].shape))
    assert torch.equal(torch.cat(pieces, dim), full)
    assert torch.equal(torch.cat(plain, dim), full[0])
    assert pieces[0].shape[dim] == full.shape[dim] // 2


def test_real_dtensor_world_size_one(tmp_path):
    """gloo, one process: DTensor parameters load through the same path."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d = tiny_qwen3(tmp_path)
    ref, _ = load_hf_model(str(d))
    created = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = TandemModel(ref.cfg, ref.mtp_cfg)
        attn = model.layers["0"].self_attn
        attn.q_proj.weight = torch.nn.Parameter(distribute_tensor(attn.q_proj.weight.data, mesh,
                                                                  [Shard(0)]))
        load_hf_weights(model, str(d))
        assert torch.equal(attn.q_proj.weight.full_tensor(),
                           ref.layers["0"].self_attn.q_proj.weight)
    finally:
        if created:
            dist.destroy_process_group()


# --- malformed Hugging Face directories: one line naming the file -------------------------------
def test_random_bytes_safetensors_named(tmp_path):
    d = tiny_qwen3(tmp_path)
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a safetensors file"):
        load_hf_model(str(d))


def test_config_not_json_named(tmp_path):
    d = tiny_qwen3(tmp_path)
    (d / "config.json").write_text("not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_hf_model(str(d))


def test_corrupt_tokenizer_named_by_eval(tmp_path, capsys):
    from tandem.trainer.cli import main

    d = tiny_qwen3(tmp_path)
    (d / "tokenizer.json").write_text("garbage")
    with pytest.raises(CheckpointError, match=r"cannot read tokenizer file .*tokenizer\.json"):
        load_hf_model(str(d))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "a b"}\n')
    assert main(["eval", "--hf", str(d), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tandem eval: error: cannot read tokenizer file ")
    assert err[-1].endswith("tokenizer.json: expected value at line 1 column 1")
    # without prompts: a Hugging Face directory has no validation split (the default data
    # config's, a corpus of another vocabulary, had run into an IndexError)
    assert main(["eval", "--hf", str(d)]) == 2
    assert capsys.readouterr().err.strip() == (
        "tandem eval: error: --hf DIR has no validation split to take prompts from: pass "
        "--prompts FILE or --suite")


def test_shape_mismatch_message_stays_short(tmp_path):
    """Every tensor of a wider config.json mismatches; the error names the first few and counts."""
    d = tiny_qwen3(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(CheckpointError) as exc:
        load_hf_model(str(d))
    msg = str(exc.value)
    assert msg.startswith(f"shape mismatch in {d} (") and "model.embed_tokens.weight" in msg
    assert len(msg) < 600 and msg.endswith("more") and "\n" not in msg


# --- `tandem export`: refused before anything is read or lost -----------------------------------
@pytest.fixture
def run(tmp_path):
    """A run directory as training leaves it: checkpoints/step_1, config.yaml, metrics.jsonl."""
    cfg = load_config(None, ["model.vocab_size=512", "model.hidden_size=32", "model.num_layers=1",
                             "model.num_heads=4", "model.num_kv_heads=2",
                             "model.intermediate_size=48", "model.num_experts=0",
                             "mtp.num_steps=0", "data.vocab_size=512",
                             f"run.dir={tmp_path}/run"])
    torch.manual_seed(0)
    save_checkpoint(str(tmp_path / "run"), 1, TandemModel(cfg.model, cfg.mtp), None,
                    to_yaml(cfg), {})
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path / "run"


def export_error(capsys, *argv):
    """The one stderr line of a refused `tandem export`."""
    assert export_main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tandem export: error: ")
    return lines[0]


@pytest.mark.parametrize("where", ["run", "step", "inside", "parent"])
def test_export_out_never_overlaps_the_run(run, capsys, where):
    out = {"run": run, "step": run / "checkpoints" / "step_1", "inside": run / "hf",
           "parent": run.parent}[where]
    before = snapshot(run.parent)
    for checkpoint in (run, run / "checkpoints" / "step_1"):
        err = export_error(capsys, "--checkpoint", str(checkpoint), "--out", str(out),
                           "--overwrite")
        assert f"--out {out} " in err and f"the checkpoint's run directory {run};" in err
    assert snapshot(run.parent) == before and not (run / "hf").exists()


def test_export_overwrite_replaces_only_an_earlier_export(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    err = export_error(capsys, "--checkpoint", str(run), "--out", str(out))
    assert err.endswith(f"{out} exists; pass --overwrite to replace it")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    err = export_error(capsys, "--checkpoint", str(run), "--out", str(out), "--overwrite")
    assert f"holds {out / 'notes.txt'}, which no export writes" in err
    assert snapshot(out) == before
    (out / "notes.txt").unlink()
    assert export_main(["--checkpoint", str(run), "--out", str(out), "--overwrite"]) == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def _tokenizer(path, size):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0")).save(str(path))
    return path


@pytest.mark.parametrize("bad", ["missing", "directory", "not_a_tokenizer", "too_large"])
def test_export_tokenizer_checked_first(run, tmp_path, capsys, bad):
    tok = {"missing": tmp_path / "nope.json", "directory": tmp_path,
           "not_a_tokenizer": tmp_path / "data.jsonl",
           "too_large": _tokenizer(tmp_path / "big.json", 600)}[bad]
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    before = snapshot(tmp_path)
    err = export_error(capsys, "--checkpoint", str(run), "--out", str(tmp_path / "hf"),
                       "--tokenizer", str(tok))
    # tokenizers' own reason follows the file's name: only that much is asserted
    assert err[len("tandem export: error: "):].startswith({
        "missing": f"--tokenizer {tok} does not exist",
        "directory": f"--tokenizer {tok} holds no tokenizer.json",
        "not_a_tokenizer": f"cannot read tokenizer file {tok}: ",
        "too_large": f"tokenizer {tok} has vocab_size=600, larger than model.vocab_size=512; "
                     "raise model.vocab_size or use a smaller tokenizer"}[bad])
    assert snapshot(tmp_path) == before and not (tmp_path / "hf").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_export")]


def test_export_copies_a_fitting_tokenizer(run, tmp_path):
    tok = _tokenizer(tmp_path / "small.json", 100)
    assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "hf"),
                        "--tokenizer", str(tok)]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_data_offsets_that_do_not_match_shape_and_dtype(tmp_path):
    """A header whose byte span for a tensor differs from its shape x dtype (or overlaps another
    tensor's) is refused as the safetensors library refuses it: Tandem's slice reader read the
    neighbouring bytes as the tensor."""
    import struct

    file = str(tmp_path / "model.safetensors")
    data = bytes(48)  # a: 8 x F32, then b: 4 x F32

    def write(a_offsets, b_offsets):
        header = {"a": {"dtype": "F32", "shape": [8], "data_offsets": a_offsets},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": b_offsets}}
        raw = json.dumps(header).encode()
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + data)

    write([0, 32], [32, 48])
    safetensors_header(file)  # well formed
    write([4, 32], [32, 48])
    with pytest.raises(CheckpointError, match=r"tensor a's data_offsets span 28 bytes, its shape "
                                              r"\[8\] and dtype F32 need 32"):
        safetensors_header(file)
    write([0, 32], [16, 32])
    with pytest.raises(CheckpointError, match="tensors a and b overlap"):
        safetensors_header(file)


def test_eval_of_a_model_without_mtp_says_so(tmp_path, capsys):
    """A trunk without an MTP module has nothing to draft with, --num-steps or not (the message
    said --num-steps was not set when it was)."""
    from tandem.trainer.cli import main

    d = tiny_qwen3(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "a b"}\n')
    assert main(["eval", "--hf", str(d), "--prompts", str(prompts), "--num-steps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tandem eval: error: the model has no MTP module (mtp.num_steps=0) to draft with")
