"""Gated DeltaNet: parity with transformers' Qwen4-Exp module, chunked == recurrent (random inputs
and what real text puts into a chunk: runs of one token, periodic tokens, correlated keys, beta near
1, slow decay; outputs, gradients, bf16 autocast), and the decoder state contract of models/state.py
(prefill + steps, ragged rows, rollback to an accepted prefix, also inside a long verify forward of
a PLE model)."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from tandem.models import gated_deltanet as gdn
from tandem.models.delta_rule import (
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from tandem.models.documents import Documents
from tandem.models.gated_deltanet import GatedDeltaNet, qkv_rows_from_hf
from tandem.models.state import DecodeCache
from tests.eval_helpers import tiny_qwen4_model

HID, HK, HV, DK, DV, KER = 32, 2, 4, 8, 16, 4


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def make(gate_act="silu", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = GatedDeltaNet(HID, HK, HV, DK, DV, KER, gate_act=gate_act, kernel="torch")
    with torch.no_grad():
        # nn.Linear / Conv1d drew their rows in transformers' [q | k | v] order: store them by
        # key-head group, so the module computes the same function as one built with that order
        rows = qkv_rows_from_hf(HK, HV, DK, DV)
        m.in_proj_qkv.weight.copy_(m.in_proj_qkv.weight[rows].clone())
        m.conv1d.weight.copy_(m.conv1d.weight[rows].clone())
        # Decays from slow to fast so the state matters across chunk boundaries, and a non-trivial
        # norm.
        m.A_log.copy_(torch.tensor([0.01, 0.1, 0.5, 3.0]).log())
        m.dt_bias.uniform_(-1.0, 1.0)
        m.norm.weight.uniform_(0.5, 1.5)
    return m.to(dtype)


def positions(b, s, start=0):
    return torch.arange(start, start + s).expand(b, s)


# --- parity with the reference --------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_matches_transformers(gate):
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        vocab_size=64, hidden_size=HID, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=HK,
        linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
        linear_conv_kernel_dim=KER, hc_count=2, hc_lowrank=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, hidden_act="silu",
        output_gate_type=None if gate == "silu" else gate)
    ours = make(gate)
    ref = hf.Qwen4ExpTextGatedDeltaNet(cfg, 0)
    assert ref.norm.activation == gate
    # a checkpoint is a name copy, both ways, except that in_proj_qkv rows and conv1d channels are
    # stored by key-head group here ([q_g | k_g | v_g]) and [q | k | v] in transformers
    rows = qkv_rows_from_hf(HK, HV, DK, DV)
    permuted = ("in_proj_qkv.weight", "conv1d.weight")
    theirs = {k: v.clone() for k, v in ours.state_dict().items()}
    for k in permuted:
        theirs[k][rows] = ours.state_dict()[k]
    ref.load_state_dict(theirs)
    assert set(ref.state_dict()) == set(ours.state_dict())

    x = torch.randn(2, 70, HID)  # 70: one full chunk and a ragged one
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_ref = ours(x_ours, positions(2, 70)), ref(x_ref)
    assert rel_err(y_ours, y_ref) < 1e-5
    w = torch.randn_like(y_ref)
    (y_ours * w).sum().backward()
    (y_ref * w).sum().backward()
    assert rel_err(x_ours.grad, x_ref.grad) < 1e-4
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        theirs = ref_params[name].grad[rows] if name in permuted else ref_params[name].grad
        assert rel_err(p.grad, theirs) < 1e-4, name
    # bf16 follows the reference's casts: measured bit-identical on CPU; allowed one bf16 step per
    # element (another CPU's kernels may round a matmul differently), where computing a stage in
    # another precision moves many elements by several
    ours.bfloat16(), ref.bfloat16()
    with torch.no_grad():
        y16, r16 = ours(x.bfloat16(), positions(2, 70)).float(), ref(x.bfloat16()).float()
    assert ((y16 - r16).abs() <= 2**-7 * r16.abs() + 2**-14 * r16.abs().max()).all()


def test_chunked_equals_recurrent():
    torch.manual_seed(0)
    b, h, t = 2, 3, 150
    q = l2_normalize(torch.randn(b, h, t, DK)) * DK ** -0.5
    k = l2_normalize(torch.randn(b, h, t, DK))
    v = torch.randn(b, h, t, DV)
    g = -torch.rand(b, h, t) * torch.tensor([0.01, 0.3, 3.0])[None, :, None]
    beta = torch.rand(b, h, t)
    s0 = torch.randn(b, h, DK, DV)
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, s0)
    o_r, s_r, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5


# What real data puts into one chunk: runs of one token, periodic text, near-duplicate keys,
# learning rates near 1 and decay near 0. The strictly-lower A of a chunk then has powers that grow
# to ~1e17 before they cancel (a run of C identical keys gives binomial coefficients), while (I +
# A)^-1 stays bounded; a solve that goes through powers of A keeps nothing in fp32. Head dim 128 as
# in the real models (the dot products of longer keys concentrate), S = 256: four chunks, state
# carried across.
ADV_DK, ADV_S = 128, 256


def adversarial(kind, heads=2, s=ADV_S, dk=ADV_DK, seed=0):
    """(q, k, v, g, beta, s0) for the chunked/recurrent rule, fp32, batch 1."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rnd(1, heads, s, dk), rnd(1, heads, s, dk), rnd(1, heads, s, dk)
    beta = torch.rand(1, heads, s, generator=gen)
    low, high = (0.001, 0.05) if kind in ("run_slow", "periodic3", "periodic4") else (0.01, 0.3)
    decay_rate = torch.empty(heads).uniform_(low, high, generator=gen)  # A = exp(A_log)
    g = -decay_rate[None, :, None] * torch.nn.functional.softplus(rnd(1, heads, s))
    if kind in ("run", "run_slow"):
        # one token repeated at positions 40..139: chunk boundaries at 64 and 128 fall inside the
        # run
        for x in (q, k, v, beta, g):
            x[:, :, 40:140] = x[:, :, 40:41]
    elif kind.startswith("periodic"):
        period = int(kind[-1])
        for x in (q, k, v, beta, g):
            x[:, :, period:] = x[:, :, :period].repeat(1, 1, s // period,
                                                       *([1] * (x.dim() - 3)))[:, :, :s - period]
    elif kind in ("correlated", "beta_near_one"):
        # keys around one direction with pairwise cosine ~0.8, constant learning rate and slow decay
        k = rnd(1, heads, 1, dk) + 0.5 * rnd(1, heads, s, dk)
        beta = torch.full((1, heads, s), 0.9 if kind == "correlated" else 0.99)
        g = torch.full((1, heads, s), -0.01 if kind == "correlated" else -0.001)
    q = l2_normalize(q) * dk ** -0.5
    return q, l2_normalize(k), v, g, beta, rnd(1, heads, dk, dk) * 0.1


ADVERSARIAL = ["run", "run_slow", "periodic3", "periodic4", "correlated", "beta_near_one"]


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_chunked_equals_recurrent_on_adversarial_chunks(kind):
    q, k, v, g, beta, s0 = adversarial(kind)
    if kind == "correlated":
        cos = (k[0, 0, 1:] * k[0, 0, :-1]).sum(-1).mean()
        assert 0.75 < cos < 0.85
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, s0)
    o_r, s_r, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5


def test_chunked_gradients_equal_recurrent_on_a_run_of_one_token():
    q, k, v, g, beta, s0 = adversarial("run_slow", heads=1, s=192)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    w = torch.randn(1, 1, 192, ADV_DK, generator=torch.Generator().manual_seed(5))
    grads = []
    for rule in (chunked_gated_delta_rule, recurrent_gated_delta_rule):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        out, final = rule(*xs, s0)[:2]
        ((out * w).sum() + final.sum()).backward()
        grads.append([x.grad for x in xs])
    for name, got, ref in zip("qkvgb", *grads):
        assert rel_err(got, ref) < 1e-4, name


def test_chunked_under_bf16_autocast_on_a_run_of_one_token():
    """bf16 inputs under autocast (how a bf16 training step reaches the torch path) stay at bf16
    rounding of the fp32 recurrence, not amplified by the chunk solve."""
    q, k, v, g, beta, s0 = (x.bfloat16() for x in adversarial("run_slow"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, s0)
    o_r, s_r, _ = recurrent_gated_delta_rule(*(x.float() for x in (q, k, v, g, beta, s0)))
    assert rel_err(o_c.float(), o_r) < 2e-2 and rel_err(s_c.float(), s_r) < 2e-2


def test_meta_construction_and_tensor_parallel_shards():
    with torch.device("meta"):
        GatedDeltaNet(HID, HK, HV, DK, DV, KER)
    # Two head shards of the module (as a TP wrapper would leave them) sum to the whole: the module
    # reads its local head counts from its weights.
    m = make()
    x = torch.randn(1, 9, HID)
    full = m(x, positions(1, 9))
    kd, vd = HK * DK, HV * DV
    total = 0
    for r in range(2):
        shard = copy.deepcopy(m)
        # rows are stored by key-head group, so a rank's rows are one contiguous block (a plain
        # Shard(0))
        rows = torch.arange(r * (2 * kd + vd) // 2, (r + 1) * (2 * kd + vd) // 2)
        heads, vcols = slice(r * HV // 2, (r + 1) * HV // 2), slice(r * vd // 2, (r + 1) * vd // 2)
        shard.in_proj_qkv.weight = torch.nn.Parameter(m.in_proj_qkv.weight[rows])
        shard.conv1d.weight = torch.nn.Parameter(m.conv1d.weight[rows])
        shard.in_proj_z.weight = torch.nn.Parameter(m.in_proj_z.weight[vcols])
        for name in ("in_proj_b", "in_proj_a"):
            getattr(shard, name).weight = torch.nn.Parameter(getattr(m, name).weight[heads])
        shard.dt_bias, shard.A_log = (
            torch.nn.Parameter(m.dt_bias[heads]),
            torch.nn.Parameter(m.A_log[heads]),
        )
        shard.out_proj.weight = torch.nn.Parameter(m.out_proj.weight[:, vcols])
        total = total + shard(x, positions(1, 9))
    assert rel_err(total, full) < 1e-5


# --- decoding -------------------------------------------------------------------------------------
def run_schedule(m, streams, schedule, ring=8):
    """Feed each row's token stream through cached forwards. `schedule` is a list of forwards, each
    a list of (start, n_real) per row plus the forward's width R (short rows are padded with junk).
    Returns the cache and, per row, {position: output} for its real tokens."""
    b = len(streams)
    cache = DecodeCache(1, b, 128, torch.float32, torch.device("cpu"), ring=ring)
    outs = [dict() for _ in range(b)]
    for rows, width in schedule:
        x = torch.randn(b, width, HID)  # junk for padded tokens
        for i, (start, n) in enumerate(rows):
            x[i, :n] = streams[i][start:start + n]
        pos = torch.stack([torch.arange(st, st + width) for st, _ in rows])
        ragged = any(n < width for _, n in rows)
        cache.row_end = torch.tensor([st + n - 1 for st, n in rows]) if ragged else None
        with torch.no_grad():
            y = m(x, pos, cache.layer(0))
        for i, (start, n) in enumerate(rows):
            for j in range(n):
                outs[i][start + j] = y[i, j]
    return cache, outs


def check_against_full(m, streams, outs, tol=1e-5):
    for i, stream in enumerate(streams):
        with torch.no_grad():
            full = m(stream[None], positions(1, len(stream)))[0]
        got = torch.stack([outs[i][p] for p in sorted(outs[i])])
        assert sorted(outs[i]) == list(range(len(got)))
        assert rel_err(got, full[:len(got)]) < tol, i


def test_prefill_then_steps_equals_training_forward():
    m = make()
    streams = [torch.randn(30, HID), torch.randn(30, HID)]
    # 20-token prefill (chunked path: 20 > ring), then steps of 1, 1, 3 and 1 tokens (recurrent).
    sched = [([(0, 20)] * 2, 20), ([(20, 1)] * 2, 1), ([(21, 1)] * 2, 1), ([(22, 3)] * 2, 3),
             ([(25, 1)] * 2, 1)]
    _, outs = run_schedule(m, streams, sched)
    check_against_full(m, streams, outs)
    # A short prompt takes the recurrent path from position 0.
    _, outs = run_schedule(m, streams, [([(0, 3)] * 2, 3), ([(3, 2)] * 2, 2)])
    check_against_full(m, streams, outs)


def test_ragged_rows():
    m = make(gate_act="sigmoid")
    streams = [torch.randn(40, HID), torch.randn(40, HID)]
    sched = [
        ([(0, 20), (0, 13)], 20),    # prompts of 20 and 13 tokens (chunked path, row 1 padded)
        ([(20, 1), (13, 1)], 1),     # rows now at different positions
        ([(21, 3), (14, 2)], 3),     # short ragged forward (recurrent path, row 1 padded)
        # long ragged forward: row 1 keeps older conv inputs from the ring
        ([(24, 10), (16, 2)], 10),
        ([(34, 1), (18, 1)], 1),
    ]
    _, outs = run_schedule(m, streams, sched)
    check_against_full(m, streams, outs)


def test_rollback_to_accepted_prefix():
    """A verify forward over 4 tokens, then each row continues right after its accepted prefix (row
    0 accepts 1 draft, row 1 accepts 3): outputs and states equal a fresh pass over the committed
    tokens."""
    m = make()
    torch.manual_seed(1)
    prompt = torch.randn(2, 12, HID)
    verify = torch.randn(2, 4, HID)  # [last committed token, draft 1, draft 2, draft 3]
    nxt = torch.randn(2, 2, HID)
    accepted = [2, 4]  # tokens of the verify forward that are kept, per row
    ring, start = 8, 12

    def fresh(rows):
        cache = DecodeCache(1, 2, 64, torch.float32, torch.device("cpu"), ring=ring)
        with torch.no_grad():
            m(prompt, positions(2, 12), cache.layer(0))
            for x, pos in rows:
                y = m(x, pos, cache.layer(0))
        return cache, y

    # Spec path: verify 4 tokens, roll back by simply starting the next forward after the accepted
    # prefix.
    nstart = torch.tensor([start + a for a in accepted])
    cont_pos = nstart[:, None] + torch.arange(2)
    spec_cache, spec_y = fresh([(verify, positions(2, 4, start)), (nxt, cont_pos)])
    # Reference: each row alone, fed only its committed tokens.
    for i, a in enumerate(accepted):
        cache = DecodeCache(1, 1, 64, torch.float32, torch.device("cpu"), ring=ring)
        with torch.no_grad():
            m(prompt[i:i + 1], positions(1, 12), cache.layer(0))
            m(verify[i:i + 1, :a], positions(1, a, start), cache.layer(0))
            y = m(nxt[i:i + 1], cont_pos[i:i + 1], cache.layer(0))
        torch.testing.assert_close(spec_y[i], y[0], rtol=1e-6, atol=1e-6)
        last = int(cont_pos[i, -1])
        for name, back in (("gdn_state", 1), ("gdn_conv", KER - 1)):
            slots = cache.buffers[0][name].shape[1]  # ring + what a resume reads (models/state.py)
            for p in range(last - back + 1, last + 1):
                torch.testing.assert_close(spec_cache.buffers[0][name][i, p % slots],
                                           cache.buffers[0][name][0, p % slots], rtol=1e-6,
                                           atol=1e-6)


# --- kernels and precision ------------------------------------------------------------------------
def fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's `chunk_gated_delta_rule` contract (fla/ops/gated_delta_rule/chunk.py), checked and
    computed token by token: q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H], initial_state
    [N, H, K, V]; with `cu_seqlens` B is 1 and the state restarts at each cut (N segments). Returns
    (o [B, T, H, V] in v's dtype, the final fp32 states or None)."""
    b, t, h, dk = q.shape
    assert k.shape == q.shape and v.shape[:3] == (b, t, h) and g.shape == beta.shape == (b, t, h)
    cuts = [0, t] if cu_seqlens is None else cu_seqlens.tolist()
    assert cu_seqlens is None or (b == 1 and cu_seqlens.dtype in (torch.int32, torch.int64))
    n = b if cu_seqlens is None else len(cuts) - 1
    assert initial_state is None or initial_state.shape == (n, h, dk, v.shape[-1])
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q.float() * (dk ** -0.5 if scale is None else scale)
    outs, finals = [], []
    for i, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        seg = [x[rows, a:e].float().transpose(1, 2) for x in (q, k, v, g, beta)]
        h0 = None if initial_state is None else initial_state[i:i + 1] if cu_seqlens is not None \
            else initial_state
        out, final = recurrent_gated_delta_rule(*seg, h0)[:2]
        outs.append(out.transpose(1, 2))
        finals.append(final)
    return torch.cat(outs, 1).to(v.dtype), (torch.cat(finals) if output_final_state else None)


def test_the_fla_branches_equal_the_torch_rule(monkeypatch):
    """The calls CI cannot make (fla is Triton, CUDA only) against a stand-in that keeps fla's
    contract: the plain chunked forward, packed documents through `cu_seqlens` (values and
    gradients), and a prefill handing its state to the decoder's steps."""
    calls = []
    monkeypatch.setattr(gdn, "_fla_chunk", lambda *a, **kw: calls.append(kw) or fla_stand_in(
        *a, **kw))
    torch_layer = make()
    fla_layer = copy.deepcopy(torch_layer)
    fla_layer.kernel = "fla"
    torch.manual_seed(1)
    x = torch.randn(2, 70, HID, requires_grad=True)
    starts = torch.zeros(2, 70, dtype=torch.long)
    starts[0, 25:], starts[0, 50:], starts[1, 64:] = 25, 50, 64
    docs = Documents(starts)
    for d in (None, docs):
        pos = positions(2, 70) if d is None else d.positions()
        want, got = torch_layer(x, pos, documents=d), fla_layer(x, pos, documents=d)
        assert rel_err(got, want) < 1e-5
        (g_want,), (g_got,) = (torch.autograd.grad(y.square().sum(), x) for y in (want, got))
        assert rel_err(g_got, g_want) < 1e-5
    streams = [torch.randn(40, HID), torch.randn(40, HID)]
    # a 20-token prefill (fla, with no entering state), then ragged steps and a 10-token verify
    # forward that enters with the cached state
    sched = [([(0, 20), (0, 13)], 20), ([(20, 1), (13, 1)], 1), ([(21, 3), (14, 2)], 3),
             ([(24, 10), (16, 2)], 10), ([(34, 1), (18, 1)], 1)]
    _, outs = run_schedule(fla_layer, streams, sched)
    check_against_full(torch_layer, streams, outs)
    assert any(c.get("cu_seqlens") is not None for c in calls)
    assert any(c.get("initial_state") is not None for c in calls)


def test_fla_is_imported_only_for_a_cuda_kernel():
    """Importing the model and running it on CPU never imports fla: its import queries the current
    CUDA device (GPU 0 in a rank that has not chosen its own yet) and loads triton."""
    code = textwrap.dedent("""
        import sys
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "fla":
                    raise SystemExit(f"imported {name}")
        sys.meta_path.insert(0, Watch())
        import torch
        from tandem.models import gated_deltanet as gdn
        layer = gdn.GatedDeltaNet(16, 2, 2, 8, 8, 4, kernel="auto")
        layer(torch.randn(1, 5, 16), torch.arange(5)[None])
        print("ran without fla", flush=True)
        gdn.fla_kernel()  # the watch sees the import a CUDA forward would make
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout == "ran without fla\n", proc.stderr[-2000:]
    assert proc.returncode == 1 and "imported fla" in proc.stderr, proc.stderr[-2000:]


def test_fla_kernel_missing_is_a_one_line_error():
    if gdn.fla_kernel() is not None:
        pytest.skip("flash-linear-attention is installed")
    with pytest.raises(ValueError, match="model.linear_kernel") as err:
        GatedDeltaNet(HID, HK, HV, DK, DV, KER, kernel="fla")
    assert "\n" not in str(err.value)


def test_bf16_close_to_fp32():
    m32 = make()
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    x = torch.randn(2, 70, HID)
    with torch.no_grad():
        y32 = m32(x, positions(2, 70))
        y16 = m16(x.bfloat16(), positions(2, 70))
        assert y16.dtype == torch.bfloat16
        assert rel_err(y16.float(), y32) < 3e-2
        # and a cached bf16 prefill + step runs, its conv ring in bf16, its recurrent state in fp32
        cache = DecodeCache(1, 2, 80, torch.bfloat16, torch.device("cpu"), ring=8)
        m16(x[:, :69].bfloat16(), positions(2, 69), cache.layer(0))
        y_step = m16(x[:, 69:].bfloat16(), positions(2, 1, 69), cache.layer(0))
    assert cache.buffers[0]["gdn_state"].dtype == torch.float32
    assert cache.buffers[0]["gdn_conv"].dtype == torch.bfloat16
    assert rel_err(y_step.float(), y32[:, 69:]) < 3e-2


@pytest.mark.parametrize("width", [25, 28])
def test_hybrid_model_rollback_inside_a_long_verify_forward(width):
    """A PLE + Gated DeltaNet model under the default ring: a 25-28 token forward after a prefill,
    then the next forward starts right after a short accepted prefix of it. PLE's dilated conv reads
    the 9 positions before a resume (ple_conv_kernel 4 x ngram_size 3 - 3) and Gated DeltaNet's conv
    3, so a ring that only holds `ring` slots lets the verify forward overwrite what the resume
    reads."""
    from tests.eval_helpers import tiny_qwen4_model

    model = tiny_qwen4_model(0, seed=2)
    cfg = model.cfg
    assert cfg.layer_type(0) == "linear_attention" and 0 in cfg.ple_layers
    gen = torch.Generator().manual_seed(3)
    true = torch.randint(2, cfg.vocab_size, (1, 60), generator=gen)
    junk = torch.randint(2, cfg.vocab_size, (1, width), generator=gen)
    prompt, accepted, cont = 20, 1, 4

    def cache():
        # the default ring
        return DecodeCache(cfg.num_layers, 1, 64, torch.float32, torch.device("cpu"))

    def run(c, lo, hi, ids=None):
        ids = true[:, lo:hi] if ids is None else ids
        return model.trunk(ids, positions(1, hi - lo, lo), c)

    with torch.no_grad():
        spec = cache()
        run(spec, 0, prompt)
        verify = torch.cat([true[:, prompt:prompt + accepted], junk[:, accepted:]], 1)
        run(spec, prompt, prompt + width, verify)
        resume = prompt + accepted  # rollback: the next forward starts after the accepted prefix
        got = run(spec, resume, resume + cont)
        fresh = cache()
        run(fresh, 0, prompt)
        run(fresh, prompt, resume)
        ref = run(fresh, resume, resume + cont)
    assert rel_err(got, ref) < 1e-5


def test_document_resets_chunked_equal_recurrent_and_lone_documents():
    """Packed documents (data.document_mask): the state entering each document's first token is
    zero. The chunked form with resets equals the recurrent form with resets (boundaries inside
    chunks, at a chunk edge, a 1-token document, a run of one token straddling a boundary), and the
    module's output on a packed row equals each document run alone (conv and state restarted)."""
    from tandem.models.documents import Documents

    q, k, v, g, beta, _ = adversarial("run_slow", heads=2, s=200)
    doc_ids = torch.tensor([0] * 50 + [1] * 14 + [2] + [3] * 120 + [4] * 15)[None]  # a start at 64
    resets = Documents.from_doc_ids(doc_ids).positions() == 0
    o_c, _ = chunked_gated_delta_rule(q, k, v, g, beta, None, resets_bt=resets)
    o_r, _, _ = recurrent_gated_delta_rule(q, k, v, g, beta, None, resets_bt=resets)
    assert rel_err(o_c, o_r) < 1e-5
    o_plain, _ = chunked_gated_delta_rule(q, k, v, g, beta, None)
    assert rel_err(o_plain[:, :, 64:], o_c[:, :, 64:]) > 1e-3  # the resets matter

    m = make()
    lengths = [7, 13, 1, 70, 9]
    x = torch.randn(1, sum(lengths), HID, generator=torch.Generator().manual_seed(3))
    docs = Documents.from_doc_ids(torch.repeat_interleave(torch.arange(len(lengths)),
                                                          torch.tensor(lengths))[None])
    with torch.no_grad():
        packed = m(x, docs.positions(), documents=docs)
        start = 0
        for n in lengths:
            alone = m(x[:, start:start + n], positions(1, n))
            assert rel_err(packed[:, start:start + n], alone) < 1e-5
            start += n


def test_a_packed_documents_gates_never_reach_the_next_document():
    """Two documents in one chunk, the first forgetting fast (log decay -150 per token): the second
    one's outputs are bit-identical whatever the first one's gates, and a loss on the second sends
    them no gradient. With the chunk's running sum of log decays, the second document's decays
    were differences of two sums holding the first's -3000, and moved by a relative 1e-4."""
    from tandem.models.delta_rule import chunked_gated_delta_rule, l2_normalize

    gen = torch.Generator().manual_seed(0)
    T, split = 40, 20
    q = l2_normalize(torch.randn(1, 2, T, 16, generator=gen)) * 16 ** -0.5
    k = l2_normalize(torch.randn(1, 2, T, 16, generator=gen))
    v, beta = torch.randn(1, 2, T, 8, generator=gen), torch.rand(1, 2, T, generator=gen)
    resets = torch.zeros(1, T, dtype=torch.bool)
    resets[0, [0, split]] = True
    second = -0.05 * torch.rand(1, 2, T - split, generator=gen)
    outs = []
    for first in (-1.0, -150.0):
        g = torch.cat([torch.full((1, 2, split), first), second], -1).requires_grad_(True)
        out, _ = chunked_gated_delta_rule(q, k, v, g, beta, resets_bt=resets)
        out[:, :, split:].square().sum().backward()
        assert torch.count_nonzero(g.grad[..., :split]) == 0
        outs.append(out[:, :, split:].detach())
    assert torch.equal(outs[0], outs[1])


def test_slow_tokens_after_a_fast_forgetting_one_keep_fp32_precision():
    """Real gates reach g ~ -200 on some tokens (A up to 16, softplus up to 12). In each chunk 32
    such tokens, then 32 slow ones (g = -1e-3): per token, outputs and gradients stay at the
    recurrent form's distance from an fp64 recurrence. The slow tokens' decays were differences of
    two running sums that held -6400, and were a relative 4e-4 off (gradient 2e-4)."""
    gen = torch.Generator().manual_seed(0)
    T, D = 256, 16
    q, k, v = (torch.randn(1, 1, T, D, generator=gen) for _ in range(3))
    q, k = l2_normalize(q) * D ** -0.5, l2_normalize(k)
    beta = 0.5 * torch.rand(1, 1, T, generator=gen)
    g = torch.full((1, 1, T), -1e-3)
    g.view(4, 64)[:, :32] = -200.0
    w = torch.randn(1, 1, T, D, generator=gen)

    def run(rule, dtype):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
        out = rule(*xs)[0]
        return out.double(), [x.double() for x in torch.autograd.grad((out * w.to(dtype)).sum(),
                                                                       xs)]

    ref, ref_grads = run(recurrent_gated_delta_rule, torch.float64)
    out, grads = run(chunked_gated_delta_rule, torch.float32)
    per_token = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-3))[0, 0]
    assert per_token.max() < 1e-5, (per_token.max(), per_token.argmax())
    for name, got, want in zip("qkvgb", grads, ref_grads):
        assert (got - want).abs().max() / want.abs().max() < 2e-6, name


def test_the_chunked_rules_backward_is_linear_in_the_sequence():
    """The chunk loop's backward writes as much per token at 16 chunks as at 4: indexing each
    chunk out of the tensors that need a gradient zero-filled them whole once per chunk (32 s
    instead of 4 at 65536 tokens, and the only form on Ascend)."""
    from tests.backward_cost import backward_elements

    per_token = []
    for t in (256, 1024):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, t, 8, generator=g).requires_grad_() for _ in range(3))
        gate = (-torch.rand(1, 2, t, generator=g)).requires_grad_()
        beta = torch.rand(1, 2, t, generator=g).requires_grad_()
        out, state = chunked_gated_delta_rule(q, l2_normalize(k), v, gate, beta)
        per_token.append(backward_elements(out.sum() + state.sum()) / t)
    assert per_token[1] < 1.05 * per_token[0], per_token


@torch.no_grad()
def test_a_forward_of_exactly_ring_tokens_can_be_rolled_back():
    """models/state.py's contract: a forward over R <= ring tokens keeps every position's recurrent
    state, so a later forward may start anywhere inside it (rollback)."""
    from tandem.models.state import DecodeCache
    model = tiny_qwen4_model(1).double()
    ring = 8
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 64, (1, ring + 3), generator=g)
    pos = torch.arange(ring + 3).unsqueeze(0)
    full = model.trunk(tokens, pos)
    cache = DecodeCache(model.cfg.num_layers, 1, 64, torch.float64, torch.device("cpu"), ring=ring)
    model.trunk(tokens[:, :ring], pos[:, :ring], cache)  # exactly `ring` tokens
    j = 5  # roll back to the prefix 0..j-1 and continue
    out = model.trunk(tokens[:, j : j + 3], pos[:, j : j + 3], cache)
    # (Gated DeltaNet's rule computes in fp32 even in an fp64 model: ~5e-7 apart on main)
    torch.testing.assert_close(out, full[:, j : j + 3], atol=1e-5, rtol=1e-4)
