"""bf16 in one process: routing stays fp32 under autocast, the MoE layer and the whole model train
under bf16 autocast, and the device layer refuses bf16 / devices the hardware does not have."""

import os

import pytest
import torch

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.moe import MoE
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.parallel.device import Device, resolve_device


def moe_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=64,
                moe_intermediate_size=16, num_experts=8, top_k=2, num_shared_experts=1,
                first_k_dense=1,
                max_seq_len=64, balance="aux_loss", aux_loss_coef=0.1, z_loss_coef=0.01)
    base.update(kw)
    return ModelConfig(**base)


def make_moe(**kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(moe_cfg(**kw))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.router.e_score_correction_bias.normal_(0.0, 0.05)
    return moe


@pytest.mark.parametrize("score, n_group", [("sigmoid", 1), ("sigmoid", 2), ("softmax", 1)])
def test_router_computes_in_fp32_under_autocast(score, n_group):
    moe = make_moe(router_score=score, n_group=n_group, topk_group=1)
    x = torch.randn(64, 32)
    ref_w, ref_idx, ref_logits = moe.router(x)  # plain fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, idx, logits = moe.router(x)
        aux, _ = moe._window_aux(logits, idx, 1.0, None)
    assert logits.dtype == w.dtype == aux.dtype == torch.float32
    # bit-identical to the fp32 computation: autocast did not turn the router's matmul into bf16
    assert torch.equal(logits, ref_logits) and torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    assert torch.equal(aux, moe._window_aux(ref_logits, ref_idx, 1.0, None)[0])
    # a bf16 router would not be: its logits carry bf16 rounding
    bf16_logits = torch.nn.functional.linear(x.bfloat16(), moe.router.weight.bfloat16()).float()
    assert (bf16_logits - ref_logits).abs().max() > 1e-4


def test_moe_forward_backward_under_bf16_autocast():
    moe = make_moe()
    moe.train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    ref = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert moe.last_aux_loss.dtype == torch.float32 and moe.last_aux_loss > 0
    # bf16 compute: close to fp32 (8-bit mantissa) but not equal
    err = float((out.float() - ref).detach().norm() / ref.detach().norm())
    assert 1e-4 < err < 2e-2, err
    out.float().pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in moe.named_parameters():  # fp32 master weights get fp32 gradients
        assert p.grad is not None and p.grad.dtype == torch.float32, name


def test_model_trains_under_bf16_autocast():
    torch.manual_seed(0)
    model = TandemModel(moe_cfg(num_experts=4), MTPConfig(num_steps=2, num_layers=1))
    tokens = torch.randint(0, 128, (2, 17))
    ref = model(tokens).loss_sums
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens)
    assert out.loss_sums.dtype == torch.float32  # losses accumulate in fp32
    assert torch.allclose(out.loss_sums, ref, rtol=1e-2) and not torch.equal(out.loss_sums, ref)
    out.loss_sums.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_is_a_config_error():
    with pytest.raises(ConfigError,
                       match="config key 'device'='cuda' but no CUDA device is visible"):
        resolve_device("cuda")


def _pretend_cuda(monkeypatch, major: int, name: str):
    """A CUDA card of compute capability `major`.x as torch's own bf16 check sees it: before
    Ampere (8) torch still creates bf16 tensors there, emulated."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("Props", (), {"major": major, "minor": 0}))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    return Device("cuda", "nccl", torch.device("cuda", 0))


def test_bf16_refused_where_only_emulated(monkeypatch):
    """A V100 emulates bf16 (torch.cuda.is_bf16_supported() is True there, by default counting
    emulation): `auto` chose bf16 autocast on it, many times slower than fp32, and `bf16` passed."""
    device = _pretend_cuda(monkeypatch, 7, "Tesla V100-SXM2-16GB")
    with pytest.raises(ConfigError, match=r"config key 'train.dtype'='bf16' but this cuda device "
                                          r"\(Tesla V100-SXM2-16GB\) has no native bf16"):
        device.check_dtype("bf16")
    device.check_dtype("fp32")
    assert device.autocast_dtype("auto") is None  # auto falls back to fp32 there
    ampere = _pretend_cuda(monkeypatch, 8, "NVIDIA A100-SXM4-80GB")
    ampere.check_dtype("bf16")
    assert ampere.autocast_dtype("auto") == torch.bfloat16
    # CPU autocast has bf16
    assert resolve_device("cpu", dtype="bf16").autocast_dtype("bf16") == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, native):
    """`train.dtype=auto` on a CPU: bf16 only with bf16 instructions (emulated bf16 matmuls are many
    times slower than fp32's); an explicit `bf16` still runs either way. The default job's recipe
    uses `auto`."""
    from tandem.trainer.parallel import device as device_layer
    from tandem.trainer.recipe import load_config

    caps = {key: False for key in device_layer._CPU_BF16_FEATURES}
    caps.update({"architecture": "x86_64", "avx2": True, "avx512_bf16": native})
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    device = resolve_device("cpu", dtype="auto")
    assert device.native_bf16() is native
    assert device.autocast_dtype("auto") == (torch.bfloat16 if native else None)
    assert device.autocast_dtype("bf16") == torch.bfloat16 and device.autocast_dtype("fp32") is None
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")
    assert load_config(recipe).train.dtype == "auto"


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_pieces_kept_out_of_fsdp_compute_as_fsdp_gathers_them(checkpointing):
    """`cast_kept_whole` (trainer/parallel/data.py) on the pieces a pipeline keeps out of FSDP
    (embedding, final norm, head, MTP module): under bf16 autocast the model computes exactly as the
    same model with those pieces' parameters in bf16, i.e. as FSDP's policy gathers them (losses bit
    for bit, gradients to bf16 rounding), their norms and embedding lookups hand on bf16, and the
    parameters stay the fp32 leaves the optimizer and checkpoints see. Also with their blocks
    recomputed in backward."""
    import copy

    from tandem.models.layers import RMSNorm
    from tandem.trainer.parallel.activation_checkpoint import apply_activation_checkpointing
    from tandem.trainer.parallel.data import cast_kept_whole

    torch.manual_seed(0)
    kept = TandemModel(moe_cfg(num_experts=4), MTPConfig(num_steps=2, num_layers=1))
    for p in kept.parameters():  # norms away from 1, so their weights' bf16 rounding shows
        torch.nn.init.normal_(p, mean=0.5, std=0.3)
    gathered, plain = copy.deepcopy(kept), copy.deepcopy(kept)
    pieces = ("embed_tokens", "norm", "lm_head", "mtp")
    cast_kept_whole(kept, [p for n, p in kept.named_parameters() if n.split(".")[0] in pieces],
                    torch.bfloat16)
    for piece in pieces:
        getattr(gathered, piece).to(torch.bfloat16)
    if checkpointing != "none":
        for m in (kept, gathered, plain):
            apply_activation_checkpointing(m, checkpointing)
    # of the pieces' norms and embedding (the trunk's blocks compute as autocast has them)
    norm_dtypes = set()
    in_pieces = {
        id(m)
        for model in (kept, gathered, plain)
        for piece in pieces
        for m in getattr(model, piece).modules()
    }
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: (
            norm_dtypes.add(out.dtype)
            if id(m) in in_pieces and isinstance(m, (RMSNorm, torch.nn.Embedding))
            else None
        )
    )
    tokens = torch.randint(0, 128, (2, 17))
    runs = {}
    for name, m in (("kept", kept), ("gathered", gathered), ("plain", plain)):
        norm_dtypes.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(tokens).loss_sums
        loss.sum().backward()
        runs[name] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()}, set(norm_dtypes))
    hook.remove()
    assert torch.equal(runs["kept"][0], runs["gathered"][0])
    # autocast alone: fp32 norms, embedding
    assert not torch.equal(runs["plain"][0], runs["gathered"][0])
    assert runs["kept"][2] == {torch.bfloat16} and torch.float32 in runs["plain"][2]
    for n, p in kept.named_parameters():
        assert (
            type(p) is torch.nn.Parameter
            and p.dtype == torch.float32
            and p.grad.dtype == torch.float32
        ), n
        ref = runs["gathered"][1][n].float()
        assert (p.grad - ref).abs().max() <= 2e-2 * ref.abs().max() + 1e-6, n
    # no copy left
    assert "weight" not in vars(kept.norm) and kept.norm.weight is kept.norm._parameters["weight"]


@pytest.mark.usefixtures("fresh_dynamo")
def test_pieces_kept_out_of_fsdp_keep_their_casts_in_compiled_blocks():
    """Under `train.compile` a kept-whole MTP block must not run the graph compiled for a trunk
    block of the same shape (dynamo shares graphs between blocks and does not guard on module
    hooks): compiled and eager training forwards give the same losses bit for bit (aot_eager: no
    kernel fusion)."""
    import copy

    from tandem.trainer.parallel.compile import apply_compile
    from tandem.trainer.parallel.data import cast_kept_whole

    torch.manual_seed(0)
    eager = TandemModel(moe_cfg(num_experts=4), MTPConfig(num_steps=2, num_layers=1))
    for p in eager.parameters():
        torch.nn.init.normal_(p, mean=0.5, std=0.3)
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):  # the embedding too, so the trunk blocks also see bf16 inputs
        cast_kept_whole(m, [*m.mtp.parameters(), *m.embed_tokens.parameters()], torch.bfloat16)
    apply_compile(compiled, backend="aot_eager")
    tokens = torch.randint(0, 128, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(eager(tokens).loss_sums, compiled(tokens).loss_sums)


def test_hyper_connection_streams_stay_fp32_under_autocast():
    """Under bf16 autocast the streams leave a mixer fp32 even when they arrived bf16 (FSDP's
    gathered embedding), while the sublayer's input is handed on in bf16; `fp32_parameters` names
    what the recurrence and the stream mixing read, which FSDP's bf16 policy keeps whole in fp32."""
    from tandem.models.hyper_connection import HyperConnection
    from tandem.trainer.parallel.data import fp32_parameters

    torch.manual_seed(0)
    hc = HyperConnection(8, 4, 4)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, inject = hc(x.to(torch.bfloat16))
        out = hc.inject(x.to(torch.bfloat16), torch.randn(2, 5, 8, dtype=torch.bfloat16), inject)
    assert (out.dtype, mixed.dtype, inject.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    cfg = moe_cfg(hc_count=4, hc_lowrank=4, full_attention_interval=2, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    names = set(fp32_parameters(TandemModel(cfg, MTPConfig(num_steps=1, num_layers=1))))
    kinds = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in names}
    assert kinds == {"linear_attn.A_log", "linear_attn.dt_bias", "hc_norm.weight",
                     "router.weight"}, kinds


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0), ("NVIDIA B200", 2250.0), ("Ascend910B3", 313.0),
    ("Ascend910B2", 0.0), ("Tesla V100-SXM2-16GB", 0.0)])
def test_peak_of_each_card_form(monkeypatch, name, peak):
    """The dense bf16 peak behind `mfu`: an H100 PCIe took the SXM card's 989 (its MFU read 24%
    low), and every 910B the B3's 313; a card without a known figure gets 0 (MFU left out)."""
    assert _pretend_cuda(monkeypatch, 9, name).peak_tflops() == peak


def test_more_processes_than_devices_is_a_config_error(monkeypatch):
    """torchrun starting more processes on a node than it has GPUs: one line naming `device`
    instead of CUDA's "invalid device ordinal" traceback."""
    _pretend_cuda(monkeypatch, 9, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("set_device called"))
    with pytest.raises(ConfigError, match=r"config key 'device'='auto': this process is local rank "
                                          r"4, but 4 cuda device\(s\) are visible here"):
        resolve_device("auto", local_rank=4)
