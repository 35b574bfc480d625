"""bench/verify_cost.py keeps running (`--quick`: the test flavors of qwen4_exp and the
full-attention MoE family, batch 1 and 4, K=1..3) and what it prints holds together: the break-even
acceptance length and the speedup at full acceptance are the cost model applied to the printed
costs, the per-kind split adds up to the forward it splits, a (K+1)-token verify runs K+1 recurrent
Gated DeltaNet steps in every Gated DeltaNet layer (one per token, none in the full-attention
family), and repeated verify forwards leave the decoder state as it was (rollback). No figure's size
is asserted: timings on a shared CPU are noise."""

from __future__ import annotations

import os
import sys

import pytest

from bench.verify_cost import cost_model, predicted_speedup
from tests import processes

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KS = (1, 2, 3)


def fields(line: str) -> dict:
    return dict(item.split("=", 1) for item in line.split()[1:])


@pytest.fixture(scope="module")
def quick():
    proc = processes.command([sys.executable, "bench/verify_cost.py", "--quick"], timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    by = {}
    for line in lines:
        by.setdefault(line.split()[0], []).append(fields(line))
    return lines, by


def test_cost_model_is_its_definition():
    c1, cd, cv = 2.0, 0.5, 3.0
    be, top = cost_model(c1, cd, cv, 3)
    assert be == pytest.approx((3 * cd + cv) / c1)
    # break-even: no gain, no loss
    assert predicted_speedup(be, c1, cd, cv, 3) == pytest.approx(1.0)
    assert top == pytest.approx(predicted_speedup(4, c1, cd, cv, 3))


def test_break_even_follows_from_the_printed_costs(quick):
    _, by = quick
    rows = by["breakeven"]
    assert {(r["family"], r["batch"], int(r["K"])) for r in rows} == {
        (f, b, k) for f in ("qwen4_exp", "moe") for b in ("1", "4") for k in KS}
    for r in rows:
        k, c1, cd, cv = (
            int(r["K"]),
            float(r["c1_ms"]),
            float(r["draft_step_ms"]),
            float(r["verify_ms"]),
        )
        be = (k * cd + cv) / c1
        assert float(r["break_even"]) == pytest.approx(be, rel=2e-3, abs=2e-4)
        assert float(r["max_speedup"]) == pytest.approx((k + 1) / be, rel=2e-3, abs=2e-4)
        assert float(r["verify_over_one"]) == pytest.approx(cv / c1, rel=2e-3, abs=2e-4)
        assert float(r["draft_over_one"]) == pytest.approx(cd / c1, rel=2e-3, abs=2e-4)
        # the tiny flavors are their own depth: nothing to rescale
        assert float(r["break_even_at_depth"]) == pytest.approx(float(r["break_even"]), rel=1e-3)
        # verify forwards without a commit leave the state unchanged
        assert r["rollback_exact"] == "1"


def test_per_kind_split_adds_up_and_names_each_family_s_layers(quick):
    _, by = quick
    kinds = {}
    for r in by["cost"]:
        kinds.setdefault((r["family"], r["batch"], r["K"]), {})[r["kind"]] = r
    assert len(kinds) == 2 * 2 * len(KS)
    for (family, _, _), parts in kinds.items():
        layers = {kind: int(r["layers"]) for kind, r in parts.items()}
        # debug_qwen4: Gated DeltaNet and QSA alternate, MoE everywhere, PLE on 0
        if family == "qwen4_exp":
            assert layers["linear_attention"] == 2 and layers["indexed_attention"] == 2
            assert layers["moe"] == 4 and layers["ple"] == 1 and "full_attention" not in layers
        else:
            assert layers["full_attention"] == 2 and "linear_attention" not in layers
        for side in ("one_ms", "verify_ms"):
            total = float(parts["total"][side])
            assert sum(float(r[side]) for kind,
                       r in parts.items() if kind != "total") == pytest.approx(
                total, rel=1e-3, abs=5e-4)
        for r in parts.values():
            # printed to 1e-6 ms, the ratio to 1e-4
            one, ver = float(r["one_ms"]), float(r["verify_ms"])
            slack = 1e-4 + (ver / one) * (1e-6 / one + 1e-6 / max(ver, 1e-6))
            assert float(r["ratio"]) == pytest.approx(ver / one, abs=slack)


def test_verify_runs_one_recurrent_step_per_token(quick):
    _, by = quick
    for r in by["recurrent_steps"]:
        tokens, gdn = int(r["tokens"]), int(r["gdn_layers"])
        if r["family"] == "qwen4_exp":
            assert gdn == 2 and int(r["calls"]) == gdn and r["steps"] == str(tokens), r
        else:
            assert gdn == 0 and int(r["calls"]) == 0, r


def test_summary_line(quick):
    lines, by = quick
    assert lines[-1].startswith("summary: ")
    summary = fields(lines[-1])
    assert set(summary) == {f"break_even_{f}_b{b}_k3" for f in ("qwen4_exp", "moe") for b in (1, 4)}
    for key, value in summary.items():
        family, batch = key[len("break_even_"):].rsplit("_b", 1)[0], key.rsplit("_b",
                                                                                1)[1].split("_")[0]
        row = next(r for r in by["breakeven"] if r["family"] == family and r["batch"] == batch
                   and r["K"] == "3")
        assert float(value) == pytest.approx(float(row["break_even"]), abs=1e-4)
