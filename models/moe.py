"""Mixture-of-experts MLP: top-k router, grouped experts, optional shared experts.

Routing follows DeepSeek-V3 / GLM-4.5 (sigmoid scores, a selection-only correction bias, optional
group-limited routing, routed scaling) and Qwen3-MoE / Mixtral (softmax scores). Experts run
grouped: token copies are sorted by expert, and one `torch._grouped_mm` per projection computes
every expert's contiguous block from the per-expert counts as a device tensor, so a one-process MoE
forward never waits for the host (no `.tolist()`/`.item()`; counts come from `scatter_add_`, not
`bincount`, which syncs on CUDA). The kernel sits behind two custom ops (`tandem::grouped_mm` and
its backward's `tandem::grouped_mm_raw`), so `torch.compile` (`train.compile`) traces a block
through it without a graph break. Where the grouped kernel is missing for the device/dtype (or the
row strides are not 16-byte aligned) the experts fall back to one matmul per expert over host-side
counts (`model.expert_matmul`). Expert parallelism replaces `GroupedExperts` by a dispatching module
built from it with the same parameters (trainer/parallel/tensor.py `ParallelExperts`, whose
`prepare` and `dispatch` start the exchanges); the model itself holds no process groups.

Auxiliary losses (load balance, z-loss) never travel through return values: `AuxLossGrad` attaches
their gradient to the layer's output during backward (Megatron's approach), so pipeline stages and
the loss code need not know about them. Their values are kept for logging in `last_aux_loss` (a
detached tensor: converting it to a Python float here would be a host sync per layer per
micro-batch).

Precision: routing (logits, scores, top-k, the correction-bias comparison and the aux/z-losses)
always computes in fp32, with autocast disabled locally, as Megatron and the reference
implementations do; the experts compute in whatever precision autocast (or the parameters) give;
each token's weighted sum of its top-k expert outputs accumulates in fp32 in slot order
(`combine_expert_outputs`), not by a scatter-add in bf16, so it is bitwise reproducible.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .experts import GroupedExperts
from .layers import SwiGLU, count_loss, loss_counter


class AuxLossGrad(torch.autograd.Function):
    """Identity on `output`; in backward, feeds d(aux_loss) = scale into aux_loss's graph."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def expert_counts(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token copies per expert as an int64 device tensor, without a host sync (CUDA's `bincount`
    reads the maximum back to size its output)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_indices.device)
    return counts.scatter_add_(0, flat_indices, torch.ones_like(flat_indices))


def expert_loads(indices_tk: torch.Tensor, num_experts: int,
                 counted_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 copies per expert of the tokens that count (`counted_t` [T] bool: False on padding,
    whose copies are routed and computed but left out of the loads and the auxiliary losses; None:
    every token counts)."""
    if counted_t is None:
        return expert_counts(indices_tk.flatten(), num_experts).float()
    weights = counted_t.float()[:, None].expand(indices_tk.shape).flatten()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=indices_tk.device)
    return counts.scatter_add_(0, indices_tk.flatten(), weights)


# `torch._grouped_mm` behind custom ops: torch.compile then treats the grouped matmul as one opaque
# call (its own fake implementation of the aten op accepts bf16 only, and the 16-byte base-pointer
# check reads `data_ptr()`, which a graph cannot), while eager runs the same kernel as before.
def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i (a scatter of distinct indices: no accumulation, deterministic)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum over j = 0..k-1, in that order, of w[t, j] * y[pos[t, j]], accumulated in fp32
    and cast once to y's dtype. A scatter-add (`index_add_`) would sum the copies in y's dtype (bf16
    under autocast: a rounding per copy) and, on CUDA, in whatever order its atomics land (runs that
    differ bit for bit). Written as a Function so that backward keeps only y in its own dtype (as
    the product `y * w` did) and the fp32 products stay one [T, H] slice at a time, never [T, k,
    H]."""

    @staticmethod
    def forward(ctx, y_nh: torch.Tensor, w_tk: torch.Tensor, pos_tk: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_nh, w_tk, pos_tk)
        # fp32, or fp64 for an fp64 run
        acc = ctx.acc = torch.promote_types(y_nh.dtype, torch.float32)
        w = w_tk.to(acc)
        out = torch.zeros(w.shape[0], y_nh.shape[1], dtype=acc, device=y_nh.device)
        for j in range(w.shape[1]):
            out.addcmul_(y_nh.index_select(0, pos_tk[:, j]).to(acc), w[:, j : j + 1])
        return out.to(y_nh.dtype)

    @staticmethod
    def backward(ctx, grad_th: torch.Tensor):
        y_nh, w_tk, pos_tk = ctx.saved_tensors
        g, w = grad_th.to(ctx.acc), w_tk.to(ctx.acc)
        grad_y = torch.empty_like(y_nh) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for j in range(w.shape[1]):
            if grad_y is not None:  # each copy's position is written once: no accumulation
                grad_y.index_copy_(0, pos_tk[:, j], (g * w[:, j : j + 1]).to(y_nh.dtype))
            if grad_w is not None:
                grad_w[:, j] = (g * y_nh.index_select(0, pos_tk[:, j]).to(ctx.acc)).sum(-1)
        return grad_y, grad_w.to(w_tk.dtype) if grad_w is not None else None, None


def copy_positions(order: torch.Tensor, k: int) -> torch.Tensor:
    """pos [T, k]: the expert-sorted row of token t's j-th copy (order[pos[t, j]] = t * k + j),
    which both `token_copies`' backward and `combine_expert_outputs` gather by; computed once per
    layer."""
    return inverse_permutation(order).view(-1, k)


class _TokenCopies(torch.autograd.Function):
    """x[order // k]: every token's k copies in expert-sorted order (copy (t, j) is row pos[t, j]).
    Backward sums each token's k copy gradients in a fixed order (j = 0..k-1) in fp32 and casts
    once, like `combine_expert_outputs`: bitwise reproducible on every device, where indexing's
    backward (an accumulating index_put; index_select's index_add_ uses atomics on CUDA) sums them
    in the copies' dtype, and about 7x faster on CPU than the accumulating index_put."""

    @staticmethod
    def forward(ctx, x_th: torch.Tensor, order: torch.Tensor, pos_tk: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pos_tk)
        return x_th.index_select(0, order // pos_tk.shape[1])

    @staticmethod
    def backward(ctx, grad_nh: torch.Tensor):
        (pos,) = ctx.saved_tensors
        grad = grad_nh.index_select(0,
                                    pos[:, 0]).to(torch.promote_types(grad_nh.dtype, torch.float32))
        for j in range(1, pos.shape[1]):
            grad.add_(grad_nh.index_select(0, pos[:, j]))
        return grad.to(grad_nh.dtype), None, None


def token_copies(x_th: torch.Tensor, order: torch.Tensor, pos_tk: torch.Tensor) -> torch.Tensor:
    """Each token's k copies, sorted by expert: row i is token order[i] // k; `pos_tk` is
    `copy_positions(order, k)` (see `_TokenCopies`)."""
    return _TokenCopies.apply(x_th, order, pos_tk)


def combine_expert_outputs(y_sorted_nh: torch.Tensor, pos_tk: torch.Tensor,
                           weights_tk: torch.Tensor) -> torch.Tensor:
    """Each token's routed output, sum_j weights[t, j] * (its j-th copy's expert output), from the
    copies' outputs in expert-sorted order (copy (t, j) is row pos[t, j] of y, `copy_positions`).
    fp32 accumulation in a fixed order (j = 0..k-1, whatever the experts): bitwise reproducible on
    every device, and one bf16 rounding per output instead of one per copy. Returns y's dtype."""
    return _WeightedCombine.apply(y_sorted_nh, weights_tk, pos_tk)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Selection-only bias of aux-loss-free balancing (DeepSeek-V3 `e_score_correction_bias`).
        # A buffer: it is updated by the load rule, never by gradients, and is checkpointed.
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.num_experts, dtype=torch.float32))
        # Routed token copies per expert since the last bias update (load-balance metrics, aux-free
        # rule).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32),
                             persistent=False)

    def forward(self, x_th: torch.Tensor, counted_t: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (weights [T,k], expert indices [T,k], router logits [T,E] in fp32). `counted_t`
        [T] bool: the tokens the load counters count (False on padding; None: all)."""
        # Autocast would turn the fp32 linear back into a bf16 one (and the ops after it follow).
        with torch.autocast(x_th.device.type, enabled=False):
            return self._route(x_th.float(), self.weight.float(), counted_t)

    def _route(self, x_th: torch.Tensor, weight_eh: torch.Tensor,
               counted_t: Optional[torch.Tensor] = None):
        cfg = self.cfg
        logits = F.linear(x_th, weight_eh)
        scores = logits.sigmoid() if cfg.router_score == "sigmoid" else logits.softmax(dim=-1)
        choice = scores.detach() + self.e_score_correction_bias
        if cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, self.num_experts // cfg.n_group)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep_groups = group_score.topk(cfg.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_score).scatter_(1, keep_groups, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        indices = choice.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        with torch.no_grad():
            self.tokens_per_expert += expert_loads(indices, self.num_experts, counted_t)
        return weights, indices, logits

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-free balancing step: raise the bias of under-loaded experts, lower over-loaded
        ones."""
        load = tokens_per_expert.float()
        self.e_score_correction_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.expert_matmul)
        self.shared_experts = (
            SwiGLU(cfg.hidden_size,
                   cfg.resolved_shared_expert_size) if cfg.num_shared_experts > 0 else None
        )
        # Qwen3-Next / Qwen4-Exp scale the shared expert per token by sigmoid(gate(x)).
        self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                                   if cfg.shared_expert_gate and self.shared_experts is not None
                                   else None)
        # The last micro-batch's aux + z loss (detached tensor, None until one is computed), and
        # the step's (layers.STEP_COUNTERS)
        self.last_aux_loss = None
        self.register_buffer("aux_loss_sum", loss_counter(), persistent=False)

    def route_and_compute(self, x_th: torch.Tensor, weights: torch.Tensor,
                          indices: torch.Tensor) -> torch.Tensor:
        """Sort token copies by expert, run the experts grouped, combine each token's weighted
        outputs (`combine_expert_outputs`: fp32, fixed order), and add the shared expert's output on
        `x_th`. The shared expert runs between `dispatch` and the routed experts: under expert
        parallelism its matmuls are issued while the token copies are in flight (the all-to-all is
        asynchronous until the experts read its output)."""
        k = indices.shape[1]
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, self.cfg.num_experts)  # stays on the device
        self.experts.prepare(counts)
        pos = copy_positions(order, k)
        x_sorted = token_copies(x_th, order, pos)
        self.experts.dispatch(x_sorted, counts)
        shared = self.shared_output(x_th) if self.shared_experts is not None else None
        out = combine_expert_outputs(self.experts(x_sorted, counts), pos, weights)
        return out if shared is None else out + shared

    def shared_output(self, x_th: torch.Tensor) -> torch.Tensor:
        """The shared expert's output (scaled by its gate where there is one)."""
        shared = self.shared_mlp(x_th)
        if self.shared_expert_gate is not None:
            # under tp the replicated gate scales a partial output: its gradient is partial over tp
            shared = torch.sigmoid(self.shared_expert_gate(x_th)) * shared
        return shared

    def shared_mlp(self, x_th: torch.Tensor) -> torch.Tensor:
        """The shared expert's MLP (tensor parallelism computes it on its shards instead)."""
        return self.shared_experts(x_th)

    def forward(self, x_bsh: torch.Tensor, context=None, aux_grad_scale: float = 1.0,
                counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`context`: the window's split over context-parallel ranks (models/context.py), over which
        the auxiliary losses average. `aux_grad_scale`: the gradient the caller's objective gives
        this forward's aux + z loss (the trainer's: 1 / the micro-batches of its global step, so
        that the step optimises their mean). `counted` [B, S] bool: False where the row is padding
        (`TandemModel.counted_rows`); padding is routed and computed like any token, but the load
        counters (the aux-free bias step, `moe/max_over_mean_load`) and the auxiliary losses leave
        it out, as if the window ended before it. None: every row counts."""
        shape = x_bsh.shape
        x = x_bsh.reshape(-1, shape[-1])
        counted_t = counted.reshape(-1) if counted is not None else None
        weights, indices, logits = self.router(x, counted_t)
        out = self.route_and_compute(x, weights, indices)
        if self.training and torch.is_grad_enabled() and self._needs_aux():
            aux, scale = self._window_aux(logits, indices, aux_grad_scale, context, counted_t)
            self.record_aux(aux)
            out = AuxLossGrad.apply(out, aux, scale)
        return out.view(shape)

    def record_aux(self, aux: torch.Tensor) -> None:
        self.last_aux_loss = aux.detach()
        count_loss(self.aux_loss_sum, aux)

    def _needs_aux(self) -> bool:
        return self.cfg.computes_aux_loss

    def _window_aux(self, logits: torch.Tensor, indices: torch.Tensor, scale: float, context,
                    counted_t: Optional[torch.Tensor] = None):
        """(aux + z loss, its gradient scale) over the micro-batch's tokens. Under context
        parallelism they are means over every cp rank's rows: the per-expert sums they are built
        from are summed over the ranks (`context.sum`: E numbers, not the [tokens x E] logits),
        every rank computes the same loss, and the sum's backward adds the cp copies of its
        gradient, so each carries 1/cp of it."""
        window = context if context is not None and context.sharded else None
        with torch.autocast(logits.device.type, enabled=False):
            sums = self._aux_sums(logits.float(), indices, counted_t)
            if window is not None:
                sums = window.sum(sums)
                scale = scale / window.size
            return self._aux_terms(sums), scale

    def _aux_sums(self, logits: torch.Tensor, indices: torch.Tensor,
                  counted_t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[2E + 3] fp32 sums over the tokens the losses average (`counted_t`: those that count):
        each expert's normalised routing probability and its routed copies (no gradient), then the
        routed copies of all experts, the squared logsumexp of the logits, and the token count."""
        cfg = self.cfg
        probs = logits.sigmoid() if cfg.router_score == "sigmoid" else logits.softmax(-1)
        probs = probs / probs.sum(-1, keepdim=True)
        counts = expert_loads(indices, cfg.num_experts, counted_t)
        # weighted by the rows that count only when some may not (no multiply on every forward)
        w_t = counted_t.float() if counted_t is not None else None
        if w_t is not None:
            probs = probs * w_t[:, None]
        z = logits.new_zeros(())
        if cfg.z_loss_coef > 0:
            z_t = torch.logsumexp(logits, dim=-1).pow(2)
            z = (z_t if w_t is None else z_t * w_t).sum()
        tokens = logits.new_tensor(float(logits.shape[0])) if w_t is None else w_t.sum()
        copies = tokens * indices.shape[1]
        return torch.cat([probs.sum(0), counts, torch.stack([copies, z, tokens])])

    def _aux_terms(self, sums: torch.Tensor):
        """DeepSeek-V3's balance loss E * sum_i f_i * P_i (f_i = c_i / (T k), the share of the T
        tokens' k routed slots that went to expert i; P_i the mean probability) and the z-loss
        mean(logsumexp^2), from `_aux_sums`."""
        cfg, e = self.cfg, self.cfg.num_experts
        prob_sum, counts, copies, z_sum, tokens = (
            sums[:e],
            sums[e : 2 * e],
            sums[2 * e],
            sums[2 * e + 1],
            sums[2 * e + 2],
        )
        terms = []
        if cfg.balance == "aux_loss" and cfg.aux_loss_coef > 0:
            # (clamped: a window of padding alone counts no token, and adds nothing)
            terms.append(cfg.aux_loss_coef * e * ((counts / copies.clamp(min=1))
                                                  * (prob_sum / tokens.clamp(min=1))).sum())
        if cfg.z_loss_coef > 0:
            terms.append(cfg.z_loss_coef * z_sum / tokens.clamp(min=1))
        return sum(terms) if terms else None
