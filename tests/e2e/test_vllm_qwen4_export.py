"""`tandem export --family qwen4_exp` writes the drafter where vLLM's `Qwen4ExpMTP` loads it: every
exported name goes through vLLM's own weight-name remapping (run in the vLLM virtual environment the
serving test builds); every `mtp.*` tensor lands on a name of the draft model (`model.*`), the
trunk's tensors are skipped by the draft loader except the shared embedding and head, the drafter's
decoder layer is named exactly like a trunk QSA layer, and every shape follows the config. (vLLM
serves this model on CUDA only, so serving itself is `bench/gpu_check.py`'s.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))


def test_exported_drafter_names_follow_vllm_remapping(tmp_path):
    from tandem.trainer.hf.export import export_hf
    from tandem.trainer.hf.reader import CheckpointReader
    from tests.e2e.test_vllm_serving import vllm_python
    from tests.eval_helpers import tiny_qwen4_model
    from tests.unit.test_qwen4_exp import VOCAB

    # every part on: QSA, Gated DeltaNet, hyper-connections, PLE, MoE
    model = tiny_qwen4_model(3, vocab=VOCAB)
    cfg, mtp = model.cfg, model.mtp_cfg
    out = tmp_path / "export"
    export_hf(model, str(out), "qwen4_exp", cfg=cfg, mtp=mtp)
    reader = CheckpointReader(str(out))
    shapes = {k: tuple(reader.shape(k)) for k in reader.keys()}
    reader.close()

    proc = subprocess.run([vllm_python(), os.path.join(HERE, "vllm_qwen4_names.py"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    vllm_side = json.loads(proc.stdout.strip().splitlines()[-1])
    remapped = vllm_side["names"]
    assert set(remapped) == set(shapes)
    # the drafter was trained reusing depth 1's QSA selection: the config tells vLLM's proposer so,
    # under the key its speculative config reads (default off there)
    with open(out / "config.json") as f:
        assert json.load(f)["index_share_for_mtp_iteration"] is True
    assert "index_share_for_mtp_iteration" in vllm_side["speculative_config_keys"]

    mtp_keys = [k for k in shapes if k.startswith("mtp.")]
    assert mtp_keys and all(remapped[k] == "model." + k[len("mtp."):] for k in mtp_keys)
    assert remapped["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert remapped["lm_head.weight"] == "lm_head.weight"
    trunk = [k for k in shapes if k.startswith("model.layers.")
             or k.startswith("model.hyper_connection_mixer.")]
    # the draft model loads none of the trunk
    assert trunk and all(remapped[k] is None for k in trunk)

    H, C, R = cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank
    expect = {
        "mtp.fc_embedding.weight": (H, H),
        "mtp.fc_hidden.weight": (H, H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (C * H,),
        "mtp.hyper_connection_mixer.hc_norm.weight": (C * H,),
        "mtp.hyper_connection_mixer.input_mix_weight_down.weight": (R, C * H),
        "mtp.hyper_connection_mixer.input_mix_weight_up.weight": (C * H, R),
    }
    for k, shape in expect.items():
        assert shapes[k] == shape, (k, shapes[k], shape)
    # vLLM drops it; none exported
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in shapes
    # the drafter's layer is a QSA + MoE + hyper-connection decoder layer, named and shaped as trunk
    # layer 1
    layer = {k[len("mtp.layers.0."):]: s for k,
             s in shapes.items() if k.startswith("mtp.layers.0.")}
    qsa = {k[len("model.layers.1."):]: s for k,
           s in shapes.items() if k.startswith("model.layers.1.")}
    assert layer == qsa
    assert not any(k.startswith("ple.") for k in layer)  # PLE off in the drafter
