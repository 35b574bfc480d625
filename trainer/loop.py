"""The training loop.

One optimizer step: every micro-batch of this rank runs forward+backward with its per-depth loss
sums normalised by the *global* number of valid targets per depth (all micro-batches, all
data-parallel replicas), so any layout optimises exactly the single-process objective. Then the
aux-free router biases move, gradients are clipped, AdamW steps, and the step's record is written.
Data order and the learning rate are pure functions of the consumed-sample count (DataPosition), the
MTP loss schedule of the step number, so a resume needs only those two, the weights, the optimizer
and the RNG states, and continues at the next unconsumed sample under any global batch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional

import torch
from torch import nn


from . import preemption
from .checkpoint import CheckpointWriter, check_compatible, latest_checkpoint, load_checkpoint, read_trainer_state
from .config import ConfigError, TandemConfig, to_yaml
from .loss import combine_losses, depth_coefficients, lambda_at, loss_gradient
from .metrics import MetricsLogger
from .optim import build_optimizer, lr_at, set_lr
from .parallel import ParallelState, init_parallel
from .parallel.device import FINETUNE_MMAP_THRESHOLD, autocast_context, resolve_device, set_malloc_mmap_threshold
from .qsa_training import IndexerTraining


def prepare_run_dir(run_dir: str) -> None:
    """Fail early (before any expensive work) if the run directory cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"config key 'run.dir'={run_dir!r} is not writable: {exc.strerror or exc}") from None


def write_config(run_dir: str, config_yaml: str) -> None:
    tmp = os.path.join(run_dir, "config.yaml.tmp")
    with open(tmp, "w") as f:
        f.write(config_yaml)
    os.replace(tmp, os.path.join(run_dir, "config.yaml"))


def build_model(cfg: TandemConfig, pstate: ParallelState) -> nn.Module:
    """This rank's part of the model: built on the meta device, parallelized, then only its shards
    materialised, seeded so every layout starts from identical weights, or read from
    `model.init_from` (trainer/materialize.py)."""
    from .materialize import build_sharded_model

    return build_sharded_model(cfg, pstate)


def check_frozen_reference(step_dir: str, reference: Optional[dict]) -> None:
    """A frozen-trunk checkpoint resumes only on the very trunk it was trained on."""
    from .hf.init_from import check_reference, read_reference

    saved = read_reference(step_dir)
    if saved is None:
        return
    check_reference(saved, step_dir)
    if reference is None or reference["path"] != saved["path"]:
        raise ConfigError(f"checkpoint {step_dir} was trained on the frozen trunk {saved['path']}, but this run's "
                          f"model.init_from is {reference['path'] if reference else 'unset (or train.freeze_trunk=false)'}")


class Trainer:
    def __init__(self, cfg: TandemConfig, resume: bool = False):
        self.cfg = cfg
        # A torchrun restart (--max-restarts) of a failed job resumes from the last checkpoint.
        self.resume = resume or cfg.train.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        prepare_run_dir(cfg.run.dir)
        # Host memory of fine-tuning: a fixed mmap threshold hands freed read / all-gather buffers back.
        threshold = cfg.train.malloc_mmap_threshold
        if threshold < 0:
            threshold = FINETUNE_MMAP_THRESHOLD if cfg.model.init_from else 0
        if threshold > 0:
            set_malloc_mmap_threshold(threshold)
        if cfg.model.init_from:  # the trunk's shape and the tokenizer come from the checkpoint being fine-tuned
            from tandem.data_pipeline.dataset import follow_checkpoint_tokenizer
            from tandem.data_pipeline.tokenizer import checkpoint_tokenizer

            from .hf.init_from import adopt_checkpoint_config, resolve_init_from

            source = resolve_init_from(cfg.model.init_from)
            adopted = follow_checkpoint_tokenizer(cfg.data, cfg.model.init_from, checkpoint_tokenizer(source))
            if adopted and int(os.environ.get("RANK", "0")) == 0:
                print(f"init_from: data.tokenizer={adopted} (the checkpoint's tokenizer)", file=sys.stderr)
            adopt_checkpoint_config(cfg)
        reference = None
        if cfg.train.freeze_trunk and cfg.model.init_from:  # checkpoints will point at the frozen trunk
            from .hf.init_from import make_reference

            reference = make_reference(cfg.model.init_from)
        self.config_yaml = to_yaml(cfg)
        self.device = resolve_device(cfg.device, dtype=cfg.train.dtype)
        self.pstate: ParallelState = init_parallel(cfg, self.device)
        from tandem.data_pipeline.dataset import DataPosition, build_datasets, check_vocab

        t = cfg.train
        self.global_batch = t.micro_batch_size * t.grad_accum_steps * self.pstate.dp_size
        # Where the data continues: the checkpoint's consumed samples, whatever global batch it ran with.
        found = latest_checkpoint(cfg.run.dir) if self.resume else None
        saved = read_trainer_state(found[1]) if found is not None else {}
        self.data_position = DataPosition(self.global_batch, cfg.data.seq_len)
        if found is not None:
            self.data_position.load_state(saved)
        steps_left = max(t.max_steps - int(saved.get("step", 0)), 1)
        self.train_ds, self.valid_ds, self.tokenizer = build_datasets(
            cfg.data, cfg.data.seq_len, t.seed,
            num_train_samples=self.data_position.next_sample() + (steps_left + t.max_skips + 1) * self.global_batch,
            num_valid_samples=max(cfg.eval.loss_batches * t.micro_batch_size, cfg.eval.num_prompts, 1),
            model_vocab_size=cfg.model.vocab_size)
        check_vocab(self.tokenizer, cfg.model.vocab_size)
        eod = getattr(self.tokenizer, "eod_id", None)
        if cfg.model.ple_layers and eod is not None and cfg.model.eos_token_id != eod:
            # PLE's n-grams stop at the end-of-document token: a wrong one silently mixes documents
            raise ConfigError(f"config key 'model.eos_token_id'={cfg.model.eos_token_id} is not the end-of-document "
                              f"token of {self.tokenizer.path} (id {eod}); PLE's n-grams must stop at it")
        if found is not None:  # every check on the checkpoint before the model is built
            check_compatible(found[1], self.config_yaml)
            check_frozen_reference(found[1], reference)
        self._attach(build_model(cfg, self.pstate))
        self.checkpoints = CheckpointWriter(cfg.run.dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, reference,
                                            tokenizer=self.tokenizer.path)
        self.start_step = 0
        if found is not None:
            state = load_checkpoint(found[1], self.model, self.optimizer)
            self.start_step = int(state["step"])
            self.guard.load_state(state)
            if self.pstate.is_main:
                print(f"resumed from {found[1]} at step {self.start_step}{self.data_position.resume_note(state)}",
                      file=sys.stderr)
        from .flops import hardware_flops_per_token, training_flops_per_token

        # `mfu` counts model FLOPs (3x the forward); `hfu` what the step executes (recomputation too)
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len)
        self.hardware_flops_per_token = hardware_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len,
                                                                 cfg.train.activation_checkpointing)
        self.peak_flops = (cfg.logging.peak_tflops or self.device.peak_tflops()) * 1e12
        # Written only once every check above has passed, so a failed start leaves an earlier run's
        # config.yaml as it was.
        if self.pstate.is_main:
            write_config(cfg.run.dir, self.config_yaml)
        self.evaluator = None
        if cfg.eval.interval > 0 and cfg.mtp.num_steps > 0:
            from tandem.eval.in_loop import InLoopEvaluator

            self.evaluator = InLoopEvaluator(cfg, self.model, self.valid_ds, self.tokenizer, self.pstate)

    @classmethod
    def for_model(cls, cfg: TandemConfig, model: nn.Module, pstate: ParallelState) -> "Trainer":
        """A trainer around an already parallelized model, with no datasets, run directory or
        evaluator: for benchmarks and equivalence tests that feed their own micro-batches to
        `forward_backward` and then call `update_router_biases`, `clip_gradients` and the optimizer."""
        self = cls.__new__(cls)
        self.cfg, self.pstate, self.device = cfg, pstate, pstate.device
        self._attach(model)
        return self

    def _attach(self, model: nn.Module) -> None:
        """Optimizer, precision, MoE bookkeeping and the bad-step guard for `model`."""
        from .guard import BadStepGuard

        t = self.cfg.train
        self.model = model
        self.optimizer = build_optimizer(model, t)
        self.autocast_dtype = self.device.autocast_dtype(t.dtype)
        self.moe_layers = [m for m in model.modules() if hasattr(m, "router") and hasattr(m.router, "update_bias")]
        from tandem.models.moe import expert_paths

        # which kernel the routed experts run (probed at this rank's layer widths): a silent fall-back to
        # the per-expert loop costs a host sync per layer, so the run says it at start and in its records
        self.expert_path, line = expert_paths(model, self.device.device, self.autocast_dtype)
        if line and self.pstate.is_main:
            print(line, file=sys.stderr)
        # The one-process objective is the mean aux/z-loss over every micro-batch of the global step.
        # Gradients are summed over the batch ranks (dp*ep), so each micro-batch's aux gradient is
        # 1/(micro-batches per rank * batch ranks); pipeline ranks split their share into
        # parallel.pp_microbatches instead of grad_accum_steps. (TP ranks compute the aux gradient
        # replicated; under SP it is computed on the gathered logits and scaled in TensorParallelMoE.)
        pipeline = self.pstate.pipeline
        micro_per_rank = pipeline.n_micro if pipeline is not None else t.grad_accum_steps
        for moe in self.moe_layers:
            moe.aux_grad_scale = 1.0 / (micro_per_rank * self.pstate.dp_size)
        m = self.cfg.model
        self.indexers = IndexerTraining(model, m.indexer_loss_coef, m.indexer_warmup_steps,
                                        1.0 / (micro_per_rank * self.pstate.dp_size), m.resolved_indexer_warmup)
        self.guard = BadStepGuard(self.cfg, self)

    # ---------------------------------------------------------------------------------------------
    def micro_batches(self, step: int) -> List[Dict[str, torch.Tensor]]:
        from tandem.data_pipeline.dataset import batch_indices, get_batch

        t = self.cfg.train
        out, read = [], []
        first = self.data_position.next_sample()
        for micro in range(t.grad_accum_steps):
            idx = batch_indices(first, micro, t.grad_accum_steps, self.pstate.dp_rank, self.pstate.dp_size,
                                t.micro_batch_size)
            batch = get_batch(self.train_ds, idx)
            out.append({k: v.to(self.device.device) for k, v in batch.items()})
            read += idx
        _record_samples_for_tests(step + 1, self.pstate.rank, read)
        return out

    def global_target_counts(self, batches) -> torch.Tensor:
        """Valid targets per depth over the whole global batch (known before any forward)."""
        from tandem.models import depth_target_mask

        depths = 1 + self.cfg.mtp.num_steps
        # fp32, not fp64 (accelerators such as Ascend 910 have no fp64 units): counts are integers,
        # exact in fp32 up to 2^24 targets per depth per step.
        counts = torch.zeros(depths, dtype=torch.float32, device=self.device.device)
        for b in batches:
            for d in range(depths):
                counts[d] += depth_target_mask(b["loss_mask"], b["doc_ids"], d).sum()
        return self.pstate.all_reduce_dp(counts)

    def forward_backward(self, batches, global_counts: torch.Tensor, coefs: List[float]) -> torch.Tensor:
        """Run every micro-batch; return per-depth loss sums over this rank's data (detached)."""
        # The gradient each depth's loss sum will receive, told to the model for this step only: the
        # fused head then accumulates every depth's weight gradient into one buffer (models/loss.py).
        self.model.loss_grad_scales = loss_gradient(global_counts, coefs)
        try:
            return self._forward_backward(batches, global_counts, coefs)
        finally:
            self.model.loss_grad_scales = None

    def _forward_backward(self, batches, global_counts: torch.Tensor, coefs: List[float]) -> torch.Tensor:
        if self.pstate.pipeline is not None:
            return self.pstate.pipeline.forward_backward(batches, global_counts, coefs)
        # Loss sums are fp32 (as the losses themselves; no fp64 on accelerators): logged only.
        sums = torch.zeros(len(coefs), dtype=torch.float32, device=self.device.device)
        # FSDP2 (parallel.reshard_after_microbatch): by default every micro-batch's backward
        # reduce-scatters into the sharded fp32 gradients and reshards, as torchtitan does; false
        # accumulates unsharded gradients locally and reduce-scatters once, in the last micro-batch's
        # backward (the same sum: one collective per step instead of per micro-batch), keeping the
        # parameters gathered in between, as torch's pipeline stages do (the pipeline path above,
        # data.pipeline_stage_class).
        from torch.distributed.fsdp import FSDPModule

        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        every = self.cfg.parallel.reshard_after_microbatch
        for i, b in enumerate(batches):
            sync = every or i == len(batches) - 1
            for m in fsdp:
                m.set_requires_gradient_sync(sync, recurse=False)
                m.set_reshard_after_backward(sync, recurse=False)
            with self.autocast():
                out = self.model(b["tokens"], b["loss_mask"], b["doc_ids"], self.cfg.data.document_mask)
                loss = combine_losses(out.loss_sums, global_counts, coefs)
            loss.backward()
            sums += out.loss_sums.detach().float()
        return sums

    def autocast(self):
        """The compute-precision context of a forward (nullcontext in fp32)."""
        return autocast_context(self.device.type, self.autocast_dtype)

    def update_router_biases(self) -> Dict[str, float]:
        """Aux-free bias step from the step's expert loads (summed over every rank that routed
        different tokens); returns load-balance metrics. Every all-reduce runs wherever its group exists,
        also on a rank with no MoE layer (a pipeline stage of dense layers beside a copy of a dense MTP
        module): its peers wait in the same collectives."""
        if self.moe_layers:
            loads = torch.stack([m.router.tokens_per_expert for m in self.moe_layers])
        else:
            loads = torch.zeros(0, self.cfg.model.num_experts, device=self.device.device)
        copies = self.pstate.mtp_copies_group
        if copies is not None:  # MTP depths spread over pp ranks: each copy routed its depths' tokens
            mtp = {id(m) for m in self.model.mtp.modules()}
            rows = torch.tensor([i for i, m in enumerate(self.moe_layers) if id(m) in mtp], dtype=torch.long,
                                device=loads.device)
            part = loads.index_select(0, rows)
            torch.distributed.all_reduce(part, group=copies)
            loads.index_copy_(0, rows, part)
        group = self.pstate.router_load_group
        if self.pstate.world_size > 1 and group is not None:
            torch.distributed.all_reduce(loads, group=group)
        for moe, load in zip(self.moe_layers, loads):
            # A frozen router (train.freeze_trunk) keeps its bias too: the trunk stays bit-identical.
            if moe.cfg.balance == "aux_free" and moe.router.weight.requires_grad:
                moe.router.update_bias(load)
            moe.router.tokens_per_expert.zero_()
        if not self.moe_layers:
            return {}
        ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)
        metrics = {"moe/max_over_mean_load": float(ratio.max()), "moe/mean_max_over_mean_load": float(ratio.mean())}
        aux = [m.last_aux_loss for m in self.moe_layers if m.last_aux_loss is not None]
        if aux:  # one host sync per step, here where it is logged
            metrics["moe/aux_loss"] = float(torch.stack([a.float() for a in aux]).mean())
        return metrics

    def discard_router_loads(self) -> Dict[str, float]:
        """A dropped step must not move the aux-free biases either."""
        for moe in self.moe_layers:
            moe.router.tokens_per_expert.zero_()
        return {}

    def clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.pstate.gradient_finisher is not None:
            return float(self.pstate.gradient_finisher(params, self.cfg.train.grad_clip))
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))

    def save(self, step: int, wait: bool = False) -> None:
        """Checkpoint `step` (in the background with checkpoint.async_save unless `wait`)."""
        self.checkpoints.save(step, self.model, self.optimizer, self.config_yaml,
                              {**self.data_position.state(), **self.guard.state()})
        if wait:
            self.checkpoints.finish()

    # ---------------------------------------------------------------------------------------------
    def train(self) -> Optional[dict]:
        cfg, t = self.cfg, self.cfg.train
        K = cfg.mtp.num_steps
        logger = MetricsLogger(cfg, self.pstate.is_main, self.start_step, t.max_steps)
        previous_handlers = preemption.install_preemption_handler()
        self.model.train()
        last_record = None
        step = self.start_step
        try:
            while step < t.max_steps:
                t0 = time.perf_counter()
                self.device.reset_peak_memory()
                # the LR and the MTP weight follow the samples seen (in steps of the run's first global
                # batch), so a resume under another global batch keeps them in step with the data
                schedule_step = self.data_position.schedule_step()
                lr = lr_at(t, schedule_step)
                set_lr(self.optimizer, lr)
                coefs = depth_coefficients(cfg.mtp, schedule_step)
                self.indexers.begin_step(schedule_step)
                batches = self.micro_batches(step)
                counts = self.global_target_counts(batches)
                sums = self.pstate.all_reduce_dp(self.forward_backward(batches, counts, coefs))
                grad_norm = self.clip_gradients()
                per_depth = (sums / counts.clamp(min=1)).tolist()
                record = {"step": step + 1, "loss": float(sum(c * l for c, l in zip(coefs, per_depth))),
                          "loss/main": per_depth[0]}
                for k in range(1, K + 1):
                    record[f"loss/mtp_{k}"] = per_depth[k]
                # The bad-step guard decides before the update touches weights or router biases.
                action = self.guard.inspect(step + 1, record, grad_norm)
                if action == "ok":
                    moe_metrics = self.update_router_biases()
                    self.indexers.before_update(schedule_step)
                    self.optimizer.step()
                else:
                    moe_metrics = self.discard_router_loads()
                self.optimizer.zero_grad(set_to_none=True)
                if action == "halt":
                    self.guard.halt(step, record)  # checkpoints the last good state, raises
                if action == "rewind":
                    step = self.guard.rewind(step)  # reloads the last checkpoint, marks the batch skipped
                    continue
                if action != "ok":
                    record["skipped"] = 1.0
                self.device.synchronize()
                step += 1
                self.data_position.advance()
                _kill_for_tests(step, self.pstate.rank)
                dt = time.perf_counter() - t0
                tokens_per_s = self.global_batch * cfg.data.seq_len / dt
                if self.peak_flops:
                    per_flop = tokens_per_s / (self.pstate.world_size * self.peak_flops)
                    record.update({"mfu": self.flops_per_token * per_flop, "hfu": self.hardware_flops_per_token * per_flop})
                record.update({"lr": lr, "grad_norm": grad_norm, "mtp/lambda": lambda_at(cfg.mtp, schedule_step),
                               "tokens_per_s": tokens_per_s, "consumed_samples": self.data_position.consumed_samples,
                               "consumed_tokens": self.data_position.consumed_tokens,
                               "mem/peak_gb": self.device.peak_memory_gb(), **moe_metrics, **self.indexers.metrics(),
                               **({"moe/expert_path": self.expert_path} if self.expert_path else {}),
                               **self.guard.metrics()})
                if self.evaluator is not None and (step % cfg.eval.interval == 0 or step == t.max_steps):
                    with self.autocast():  # the precision it trains in (FSDP may hold bf16 parameters)
                        record.update(self.evaluator.run(step))
                    logger.log_samples(step, self.evaluator.last_samples)
                if step % t.log_interval == 0 or step == t.max_steps or any(k.startswith("eval/") for k in record):
                    logger.log(record)
                logger.progress(step, record)
                last_record = record
                if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < t.max_steps:
                    self.save(step)
                if preemption.agree_preemption():
                    self.save(step, wait=True)
                    preemption.requeue_current_job()
                    if self.pstate.is_main:
                        print(f"preempted: checkpointed step {step} and asked Slurm to requeue", file=sys.stderr)
                    return last_record
            saved = self.checkpoints.pending[1] if self.checkpoints.pending else (
                latest_checkpoint(cfg.run.dir, report=False) or (0, ""))[0]
            if cfg.checkpoint.save_final and t.max_steps > 0 and saved < step:
                self.save(step)
            self.checkpoints.finish()
        finally:
            preemption.restore_signal_handlers(previous_handlers)
            logger.close()
        return last_record


def _kill_for_tests(step: int, rank: int) -> None:
    """Test hook: TANDEM_TEST_KILL_AT_STEP=<step>[:<rank>] SIGKILLs that rank after that step, on the
    job's first attempt only (so a torchrun restart can show recovery)."""
    spec = os.environ.get("TANDEM_TEST_KILL_AT_STEP")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at, _, who = spec.partition(":")
    if step == int(at) and rank == int(who or 0):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _record_samples_for_tests(step: int, rank: int, samples: List[int]) -> None:
    """Test hook: TANDEM_TEST_SAMPLE_LOG=<dir> appends the training samples each rank reads for each
    1-based step to <dir>/rank<R>.jsonl, so a test can follow a run's data sample by sample."""
    where = os.environ.get("TANDEM_TEST_SAMPLE_LOG")
    if where:
        import json

        with open(os.path.join(where, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "samples": [int(i) for i in samples]}) + "\n")


def train(cfg: TandemConfig, resume: bool = False) -> Optional[dict]:
    return Trainer(cfg, resume=resume).train()
