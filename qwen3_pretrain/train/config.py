"""The training config: the reference workflow's ``pretrain_config.yaml`` keys, verbatim, plus extras.

Every field carries its help text; the configuration reference in the docs is
generated from these dataclasses so it cannot drift from the code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from qwen3_pretrain.config.loader import field_help
from qwen3_pretrain.data.sources import DataSource, parse_data_path
from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.models.qwen3.config import RECOMPUTE
from qwen3_pretrain.parallel.dims import sequence_split_problem, unsupported_combination


CONVENTIONS = ("default", "megatron")
# The keys whose default depends on ``conventions``: (this project's default, Megatron-LM / Megatron-Bridge's).
# Each is declared with default None ("from conventions") so that a value set explicitly, even the
# project's default, is never overridden. moe_router_dtype is not one: its default, fp32, is Megatron's
# already. A key added here belongs in docs/from-megatron.md's conventions table (a test holds them equal).
CONVENTION_KEYS: dict[str, tuple[Any, Any]] = {
    "lr_warmup_from_zero": (False, True),
    "weight_decay_embeddings": (False, True),
    "moe_aux_loss_scale": ("mean_over_layers", "megatron"),
}


@dataclass
class TrainConfig:
    # --- keys of the reference pretrain_config.yaml ------------------------
    model_name: str = field_help("qwen3-8b", "Preset to build (qwen3-0.6b … qwen3-32b) when model_path is empty; "
                                 "otherwise a label that must not contradict model_path's config.json.")
    model_path: str | None = field_help(None, "HuggingFace model directory (config.json + safetensors) to continue "
                                        "pre-training from; empty: random init of the preset named by model_name.")
    output_path: str = field_help("runs/pretrain", "Directory for checkpoints (step_<N>/), metrics.jsonl and the "
                                  "resolved config.yaml.")
    data_path: str | list[Any] = field_help(
        "runs/data/d_convert", "Directory of shard_*.bin/.idx + manifest.json written by 'qwen3-pretrain convert'; "
        "or several, blended by weight: a list of {path: DIR, weight: W} or Megatron's flat string "
        "\"0.7 /data/wiki 0.3 /data/books\" (weights are normalized; see training.md, Blending datasets).")
    tokenizer_path: str | None = field_help(None, "Tokenizer directory; checked against the data's manifest and "
                                            "copied into merged models.")
    rank_size: int | None = field_help(None, "Total number of processes (devices); must equal the launched world "
                                       "size. Empty: whatever was launched.")
    master_addr: str = field_help("127.0.0.1", "Address of rank 0 for the rendezvous under mpirun (torchrun sets "
                                  "its own).")
    master_port: int = field_help(29500, "Port of rank 0 for the rendezvous under mpirun.")
    hostfile: str | None = field_help(None, "mpirun hostfile of this run; recorded for reference (mpirun reads its "
                                      "own -hostfile argument).")
    tp: int = field_help(1, "Tensor-parallel degree (splits attention heads, a hybrid's Gated DeltaNet heads, MLP and "
                            "vocabulary).")
    pp: int = field_help(1, "Pipeline-parallel degree (splits the layers into contiguous stages).")
    cp: int = field_help(1, "Context-parallel degree: splits every sequence over this many ranks (each holds two "
                         "mirrored chunks of 2 x cp, for causal load balance); attention all-gathers keys and "
                         "values over them. For long sequences (docs/training.md 'Long sequences'); seq_length "
                         "must be a multiple of 2 x cp. world = pp x dp x cp x tp.")
    ep: int = field_help(1, "Expert-parallel degree of a mixture-of-experts model: each MoE layer's experts are "
                         "split over this many ranks and the tokens travel to their experts' ranks and back "
                         "(all-to-all). Borrowed from the dp_shard x cp x tp ranks (not a factor of the world): must "
                         "divide them and num_experts. docs/moe.md 'Expert parallelism'.")
    seq_length: int = field_help(4096, "Tokens per sample.")
    batch_size: int = field_help(1, "Micro-batch per data-parallel rank (samples). Global batch = batch_size x dp "
                                 "x gradient_accumulation_steps.")
    learning_rate: float = field_help(1e-5, "Peak learning rate, reached after warmup_steps.")
    warmup_steps: int = field_help(0, "Linear warm-up steps from 0 to learning_rate.")
    total_steps: int = field_help(1000, "Optimizer steps to train; the LR decays to min_lr at this step.")
    save_steps: int = field_help(1000, "Save a checkpoint every this many steps (and at the end). 0: only at the end.")
    mixed_precision: Literal["bf16", "fp32"] = field_help("bf16", "bf16: bf16 compute, fp32 master weights, "
                                                          "gradient reduction and loss. fp32: everything fp32.")
    allow_tf32: bool = field_help(
        False, "Under mixed_precision fp32 on CUDA: fp32 matmuls run on the TF32 tensor cores "
               "(torch.backends.cuda.matmul.fp32_precision tf32: 10-bit mantissa products, fp32 accumulation; "
               "several times faster), and MFU divides by the TF32 peak. false: full fp32 products at the fp32 "
               "peak. Ignored on other devices (Ascend has no TF32).")
    cpu_bf16_matmul: Literal["auto", "bf16", "fp32"] = field_help(
        "auto", "On a CPU under mixed_precision bf16: bf16 multiplies bf16 natively; fp32 multiplies fp32 copies of "
                "the bf16 operands (same products, fp32 accumulation either way; 3-5x faster on x86 CPUs without "
                "AVX512-BF16 or AMX); auto: fp32 on such CPUs, bf16 elsewhere.")
    cpu_malloc_trim: bool = field_help(
        True, "On a CPU run with glibc: after every step the C heap's free pages go back to the OS (malloc_trim), "
              "so resident memory stops growing where buffer sizes change from step to step (MoE routing). "
              "Values are unchanged; false keeps the pages (glibc's own behaviour). No effect elsewhere.")
    cpu_malloc_trim_growth: float = field_help(
        0.0, "With cpu_malloc_trim: 0 trims the heap after every step (resident memory flat; about 1% of a step's "
             "CPU time, the next step faulting the pages in again); a fraction such as 0.05 trims only after a "
             "step whose resident memory exceeds the one after the first step since the last trim by more than "
             "it (and 64 MiB): steady memory is never trimmed, growing memory saw-tooths within that margin.")
    cpu_flush_denormal: bool = field_help(
        True, "On a CPU run: denormal floats (below 1.2e-38 in fp32) are flushed to zero on every rank's CPU "
              "threads from start-up (torch.set_flush_denormal: the x86 FTZ/DAZ bits). An x86 core computes a "
              "denormal in microcode, 10-150x slower: the Gated DeltaNet's fp32 decays of Qwen3.5 / Qwen3-Next "
              "reach them (bench/README.md 'Denormal floats'). Each op reads and writes a denormal as 0 (the "
              "hybrid's losses measured bitwise equal); false computes them exactly and slowly. No effect on "
              "GPUs and NPUs (their kernels take denormals at full speed).")
    fp8: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] | None = field_help(
        None, "FP8 matmuls (torchao) for the decoder layers' projections whose dimensions are multiples of 16 "
              "(never the LM head, embedding or MoE routers; weights, optimizer state and checkpoints stay in "
              "high precision). tensorwise: one dynamic scale per tensor, the fastest on Hopper, and the recipe "
              "fp8_all_gather needs; rowwise: one power-of-two scale per row; rowwise_with_gw_hp: rowwise, "
              "weight gradient in high precision; mxfp8: blocks of 32 sharing a scale, Blackwell only. Needs "
              "torchao (pip install 'qwen3-pretrain[fp8]') and FP8 tensor cores (CUDA compute capability 8.9+, "
              "10.0+ for mxfp8) unless fp8_emulate. Empty: off (docs/fp8.md).")
    fp8_all_gather: bool = field_help(
        False, "With fp8 tensorwise under FSDP: weights are all-gathered in FP8 (one byte a weight instead of "
               "two), their scales computed in one all-reduce per step after the optimizer step.")
    fp8_filter: list[str] = field_help(
        [], "Projections kept out of FP8, by module path: an entry excludes every path containing it "
            "(down_proj, layers.0., shared_expert); entries starting with + keep FP8 to paths containing one "
            "of them (+mlp.: only the MLPs). Paths look like layers.3.attn.q_proj, layers.3.mlp.down_proj, "
            "layers.2.linear_attn.out_proj, mtp.layers.0.mlp.up_proj. A MoE layer's experts are matched as the "
            "one path mlp.experts in every layer (experts: all of them out of FP8; +mlp.: them and the MLPs in).")
    fp8_emulate: bool = field_help(
        False, "Allow fp8 on a device without FP8 tensor cores (CPU, A100, Ascend 910B): the FP8 numerics "
               "(operands rounded to e4m3/e5m2 with their scales), multiplied in high precision: slower than "
               "bf16, for tests and experiments. The fp8_* keys are ignored while fp8 is empty.")
    distributed_optimizer: bool = field_help(True, "Shard optimizer state, gradients and master weights over the "
                                             "data-parallel ranks (ZeRO/FSDP); false keeps full replicas.")
    dp_shard: int | None = field_help(
        None, "Hybrid sharding (HSDP): shard over groups of this many data-parallel ranks (e.g. the dp ranks of one "
              "node) and replicate the shards across groups; must divide dp. Weights are gathered and gradients "
              "reduce-scattered inside a group, and only the gradient shards are all-reduced between groups. "
              "Empty: all dp ranks with distributed_optimizer, 1 (full replicas) without; a value above 1 needs "
              "distributed_optimizer true.")
    gradient_checkpointing: bool = field_help(False, "Recompute each layer's activations in the backward pass "
                                              "(same as activation_checkpointing: full).")
    weight_decay: float = field_help(0.01, "AdamW weight decay of matrices (not of norms; the embedding: "
                                              "weight_decay_embeddings).")
    mtp_loss_weight: float = field_help(
        0.0, "Train the hybrids' multi-token-prediction layer (mtp_num_hidden_layers; Qwen3.5 and Qwen3-Next "
             "ship one) with this weight on its loss, added to the LM loss (0.1 as Megatron-Bridge's recipe); "
             "logged as mtp_loss. 0: no MTP layer is built and a checkpoint's mtp.* tensors are carried to the "
             "merged model unchanged. Under pp the layer is on the last stage and the next tokens' "
             "embeddings travel down the pipeline beside the hidden states.")
    apply_wd_to_qk_layernorm: bool = field_help(
        False, "Also decay the attention's q/k norm weights (Megatron's flag of that name, on in its Qwen3-Next "
               "recipe). The hybrids' norms are zero-centred (scale 1 + weight), so decay pulls the scale "
               "towards 1, not 0.")
    log_steps: int = field_help(10, "Log a line and a metrics.jsonl record every this many steps.")
    # --- extras --------------------------------------------------------------
    gradient_accumulation_steps: int = field_help(1, "Micro-batches per optimizer step on each data-parallel rank.")
    seed: int = field_help(1234, "Seed of weight initialization and data order.")
    min_lr: float = field_help(0.0, "Learning rate at total_steps.")
    lr_decay_style: Literal["cosine", "linear", "constant", "wsd"] = field_help(
        "cosine", "Decay after warm-up. wsd: warmup-stable-decay (Megatron's WSD): the peak until lr_decay_steps - "
                  "lr_wsd_decay_steps, then down to min_lr in the shape lr_wsd_decay_style.")
    lr_decay_steps: int | None = field_help(None, "Step at which the decay reaches min_lr (Megatron's "
                                            "--lr-decay-iters); min_lr after it. Empty: total_steps.")
    lr_wsd_decay_steps: int | None = field_help(None, "With lr_decay_style wsd: steps of the final anneal, ending "
                                                "at lr_decay_steps (Megatron's --lr-wsd-decay-iters).")
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = field_help(
        "exponential", "Shape of the wsd anneal, as Megatron's --lr-wsd-decay-style (its default exponential: "
                       "2 x 0.5^r - 1 of the way from the peak to min_lr at fraction r of the anneal; minus_sqrt: "
                       "1 - sqrt(r)).")
    lr_warmup_from_zero: bool | None = field_help(
        None, "Warm-up as Megatron's: step k (0-based) runs at learning_rate x k / warmup_steps, so the first step "
              "runs at lr 0 and the peak is reached at step warmup_steps. false: (k + 1) / warmup_steps, one step "
              "earlier. Empty: from conventions (default false, megatron true).")
    weight_decay_embeddings: bool | None = field_help(
        None, "Also decay the token embedding (and so a tied LM head), as Megatron, which exempts only 1-D "
              "parameters. Norms and the Gated DeltaNet's A_log/dt_bias stay undecayed. Empty: from conventions "
              "(default false, megatron true).")
    conventions: Literal["default", "megatron"] = field_help(
        "default", "Defaults of the convention keys left empty (those whose help says 'from conventions'): "
                   "default is this project's; megatron takes Megatron-LM / Megatron-Bridge's (warm-up from lr "
                   "0, weight decay on the embedding, the MoE balancing loss and z-loss summed over layers; "
                   "docs/from-megatron.md). A key set explicitly wins; the "
                   "run-start log line lists the values in force.")
    adam_beta1: float = field_help(0.9, "AdamW beta1.")
    adam_beta2: float = field_help(0.95, "AdamW beta2.")
    adam_eps: float = field_help(1e-8, "AdamW epsilon.")
    clip_grad: float = field_help(1.0, "Clip the global gradient norm (over all ranks) to this; 0 disables.")
    pp_schedule: Literal["1f1b", "interleaved", "gpipe"] = field_help("1f1b", "Pipeline schedule; interleaved "
                                                                      "runs pp_virtual_stages stages per rank.")
    pp_virtual_stages: int = field_help(2, "Stages per rank for pp_schedule: interleaved.")
    reduce_grads_every_microbatch: bool = field_help(
        False, "With gradient_accumulation_steps > 1 and pp 1: reduce-scatter gradients after every micro-batch, "
               "so each rank keeps only its fp32 gradient shard (4 bytes/parameter / dp instead of 4 bytes/"
               "parameter), at the cost of one reduce-scatter per micro-batch. False: accumulate unsharded, reduce "
               "once per step (the pipeline schedule always does).")
    keep_params_gathered: bool = field_help(
        False, "Megatron's accumulation (distributed optimizer): each step gathers the weights once and keeps "
               "them through its micro-batches (2 bytes/parameter in bf16 held all step), gradients accumulate "
               "unsharded, and are reduced once: one all-gather and one reduce-scatter per step instead of two "
               "all-gathers per micro-batch. For gradient accumulation without recompute, where the bytes "
               "moved per step bound the speed. With reduce_grads_every_microbatch the gradients are reduced "
               "after every micro-batch instead (ZeRO-2's traffic). Needs distributed_optimizer.")
    grad_reduce_dtype: Literal["fp32", "bf16"] = field_help(
        "fp32", "With mixed_precision bf16: the dtype gradients accumulate in across micro-batches and are "
                "reduced over the data-parallel ranks in. fp32 (Megatron's --accumulate-allreduce-grads-in-fp32); "
                "bf16 halves the gradients held between micro-batches and the bytes reduced, with rounded sums.")
    pp_microbatch_size: int = field_help(1, "Samples per pipeline micro-batch; each rank's batch of batch_size x "
                                         "gradient_accumulation_steps samples is split into micro-batches of this.")
    activation_checkpointing: Literal[RECOMPUTE] | None = field_help(
        None, "What backward recomputes instead of keeping. full: every layer (keeps only each layer's input); "
              "selective: the attention core (the kernel's scores/softmax statistics and, with fp32 attention "
              "on a CPU, its fp32 copies), as Megatron's and MindSpeed's selective recompute; mlp: each MLP's "
              "intermediate activations (3 x intermediate_size per token; this project's 'selective' before); "
              "none. Empty: from gradient_checkpointing.")
    device: Literal["auto", "cpu", "cuda", "npu"] = field_help("auto", "auto picks cuda, then npu (torch_npu), "
                                                               "then cpu.")
    eval_steps: int = field_help(0, "Evaluate on the held-out split every this many steps; 0 disables.")
    eval_iters: int = field_help(4, "Global batches per evaluation.")
    valid_fraction: float = field_help(0.0, "Fraction of documents held out for evaluation (needs eval_steps).")
    model_overrides: dict[str, Any] = field_help({}, "config.json keys overriding the preset, e.g. "
                                                 "{num_hidden_layers: 4, hidden_size: 256} for a small model.")
    loss_chunk_tokens: int | None = field_help(None, "Tokens per chunk of the fused LM head + cross-entropy; "
                                               "its working set is one chunk's fp32 logits, chunk x vocab/tp x "
                                               "4 bytes (in bf16 too). Empty: 4096 on GPUs and NPUs, 1024 on a "
                                               "CPU (as fast there), halved while chunk x vocab x 4 bytes "
                                               "exceeds 4 GiB (GPUs, NPUs; down to 1024) or 640 MiB (CPU; down "
                                               "to 256): Qwen3's 151,936 vocab keeps 4096 / 1024, Qwen3.5's "
                                               "248,320 gets 512 on a CPU.")
    reset_position_ids: bool = field_help(False, "Restart RoPE positions at each packed document.")
    document_mask: bool = field_help(False, "Also stop attention across packed documents (implies "
                                     "reset_position_ids). GPUs and NPUs take the document boundaries; a CPU "
                                     "builds a seq x seq mask per sample.")
    keep_last_n: int = field_help(3, "Keep this many newest checkpoints; 0 keeps all.")
    async_save: bool = field_help(False, "Write checkpoints in the background while training goes on.")
    max_nonfinite_steps: int = field_help(5, "Stop cleanly after this many consecutive steps with a NaN/inf loss "
                                          "or gradient norm (each one is skipped).")
    peak_tflops: float | None = field_help(None, "Peak TFLOP/s per device for MFU, of what the matmuls run in "
                                           "(bf16, TF32 with allow_tf32, fp32); empty: from the device table, by "
                                           "the exact name the device reports (an unknown device warns and MFU "
                                           "is nan; CPU: measured at start-up).")
    collective_timeout_s: int = field_help(600, "Timeout of collectives: a dead rank stops the others after this.")
    init_timeout_s: int = field_help(300, "Timeout for reaching master_addr:master_port at start-up.")
    tensorboard: bool = field_help(False, "Also write TensorBoard events to output_path/tensorboard.")
    deterministic: bool = field_help(
        False, "Deterministic kernels: torch.use_deterministic_algorithms (flash attention's deterministic "
               "backward; no atomic adds in index and scatter kernels), cuBLAS with a fixed workspace "
               "(CUBLAS_WORKSPACE_CONFIG), cuDNN deterministic, HCCL deterministic reductions on NPUs. Two runs "
               "of one layout are then meant to give bit-equal losses on a GPU (never run on a GPU or NPU yet: "
               "bench/device_check.sh checks a resume against an uninterrupted run); a few percent slower "
               "(torch also fills new tensors' memory, so that reading it unwritten cannot differ between "
               "runs). CPU steps are deterministic either way.")
    compile: bool = field_help(False, "torch.compile each decoder layer, the MTP layer's too (after activation "
                                      "checkpointing, before FSDP): one graph per layer kind, no graph break (the "
                                      "log says what was compiled after the first step); meant to be faster on "
                                      "GPUs once compiled (never timed on one yet); the first step pays the "
                                      "compilation (tens of seconds). Under tp > 1 with full recompute each layer's "
                                      "attention and MLP are compiled instead (the recompute around them stays "
                                      "eager), and under ep > 1 a sparse layer's parts around the router; not with "
                                      "tp > 1 and selective recompute, nor with cp > 1 (docs/training.md).")
    # --- observability: phases, health, profiler, memory snapshots, hangs, trackers (docs/monitoring.md) ---
    profile_steps: str | None = field_help(None, "Trace these steps with torch.profiler, e.g. 10-12 (a range, "
                                           "inclusive): one Chrome/Perfetto trace per rank in "
                                           "output_path/profile/step_10-12/. Empty: no fixed range.")
    profile_every: int = field_help(0, "Trace profile_window steps ending at every this-many-th step (e.g. 500); "
                                    "0: never.")
    profile_window: int = field_help(2, "Steps per profile_every trace.")
    memory_snapshot_steps: int = field_help(0, "CUDA: record the allocator's history (each allocation with its "
                                            "stack) for this many first steps and dump it to output_path/memory/ "
                                            "for https://pytorch.org/memory_viz; 0: off. An out-of-memory error "
                                            "dumps a snapshot there whatever this is, its path in the error.")
    hang_factor: float = field_help(10.0, "Hang watchdog: a step running longer than this many times the median "
                                    "of the recent steps (and hang_min_s) writes every rank's Python stacks to "
                                    "output_path/hang/, names the ranks behind and ends the run (exit code 3). "
                                    "0: no watchdog.")
    hang_min_s: float = field_help(300.0, "The hang watchdog's floor: no step counts as hung before this many "
                                   "seconds.")
    nccl_trace_buffer_size: int = field_help(2000, "CUDA: collectives kept per rank by NCCL's flight recorder "
                                             "(TORCH_NCCL_TRACE_BUFFER_SIZE), dumped to output_path/hang/ on a "
                                             "collective timeout; 0: off. The environment's own setting wins.")
    trackers: list[str] = field_help([], "Experiment trackers besides TensorBoard: wandb, swanlab (optional "
                                     "packages: pip install 'qwen3-pretrain[trackers]'); one that cannot start "
                                     "is a warning.")
    tracker_project: str = field_help("qwen3-pretrain", "The trackers' project.")
    tracker_run_name: str | None = field_help(None, "The trackers' run name; empty: the tracker's own choice.")
    tracker_tags: list[str] = field_help([], "The trackers' tags.")
    tracker_mode: Literal["offline", "online"] = field_help("offline", "offline: the trackers write under "
                                                            "output_path/<tracker> for a later sync; online: sent "
                                                            "as the run goes.")
    # --- mixture of experts (Qwen3-MoE models; docs/moe.md) ------------------------------------------------
    moe_aux_loss: Literal["global_batch", "micro_batch", "none"] = field_help(
        "global_batch", "The load-balancing loss of a MoE model. global_batch: each layer's expert frequencies "
                        "over every rank of a micro-batch, accumulated over the step's micro-batches so far (Qwen's "
                        "recipe; layouts give the same loss); micro_batch: transformers' definition, per rank and "
                        "micro-batch with all layers pooled (pp 1 only); none: no balancing loss (the load is "
                        "still logged). Formulas in docs/moe.md.")
    moe_aux_loss_coef: float | None = field_help(None, "Weight of the load-balancing loss in the objective. Empty: "
                                                 "the model config's router_aux_loss_coef (0.001 in Qwen3-MoE).")
    moe_aux_loss_scale: Literal["mean_over_layers", "megatron"] | None = field_help(
        None, "How the balancing loss and the z-loss scale with the layers. mean_over_layers: the mean of the "
              "layers' terms, each balancing term E sum_e f_e P_e (k at balance; transformers' scale); megatron: "
              "Megatron-core's, the layers' terms summed, each balancing term divided by top-k (1 at balance), "
              "so at one coefficient a layer's balancing gradient is L/k times mean_over_layers' and its z-loss "
              "gradient L times (L: MoE layers). moe_aux_loss global_batch or none. Empty: from conventions "
              "(default mean_over_layers, megatron megatron). Conversion: docs/moe.md.")
    moe_router_dtype: Literal["fp32", "bf16"] = field_help(
        "fp32", "Dtype of the MoE routers' logits. fp32: weight and input upcast for the router's one small "
                "matmul (as Megatron's Qwen3 recipes); bf16: in the model's dtype, as transformers computes "
                "them (bf16 logits choose another top-8 than fp32 ones for a few percent of tokens; docs/moe.md). "
                "The same under mixed_precision fp32.")
    moe_bias_update_rate: float = field_help(
        0.0, "Aux-loss-free balancing (DeepSeek-V3): each MoE layer's per-expert bias, added to the router's "
             "probabilities for the top-k choice only, moves by this much per step toward the step's global "
             "balance (sign of mean load - load). 0: off. DeepSeek-V3 used 1e-3 with sigmoid scores; the "
             "probabilities here are softmax ones, about 1/num_experts each. Saved in checkpoints; not part "
             "of the HF format (merge leaves it out). docs/moe.md.")
    moe_z_loss_coef: float = field_help(0.0, "Weight of the router z-loss (the mean squared log-sum-exp of the "
                                        "router logits, ST-MoE), which keeps the logits small; 0 disables.")
    moe_capacity_factor: float | None = field_help(
        None, "Expert capacity with token dropping: each expert computes at most ceil(factor x pairs / "
              "num_experts) of the (token, expert) pairs that chose it, those with the largest routing weights "
              "(Megatron's --moe-expert-capacity-factor with the probs drop policy); a dropped pair contributes "
              "nothing (its token keeps its other experts and the residual). Bounds what one expert's rank "
              "receives under skewed routing. Empty: dropless, every pair computed. docs/moe.md.")
    moe_capacity_scope: Literal["micro_batch", "rank"] = field_help(
        "micro_batch", "The pairs a capacity is decided over: micro_batch, every rank's share of the global "
                       "micro-batch (a small all-gather of the routing weights), so every layout drops the "
                       "same pairs as one process; rank, each rank's own tokens (Megatron's way; no "
                       "collective, but which pairs drop depends on the layout).")
    moe_pad_to_capacity: bool = field_help(
        False, "With moe_capacity_factor: every expert's group padded with zero rows to the most rows it can "
               "receive (fixed shapes, Megatron's --moe-pad-expert-input-to-capacity); costs the padding's "
               "compute. docs/moe.md.")
    moe_force_balance: bool = field_help(False, "Benchmark mode: route every token round-robin over the experts "
                                         "(perfect balance, as published MoE throughput figures assume) instead "
                                         "of by the router; the log marks such runs. Not for real training.")

    def __post_init__(self) -> None:
        self.resolve_conventions()
        self.validate()

    def resolve_conventions(self) -> None:
        """Fill the convention keys left empty with ``conventions``' values (the resolved config.yaml then
        records the values in force, so a resume reads them back whatever the table says later). Resolved
        once, at construction: ``dataclasses.replace(cfg, conventions=...)`` keeps the values already filled."""
        if self.conventions not in CONVENTIONS:
            raise ConfigError(f"conventions: {self.conventions!r} is not one of {', '.join(CONVENTIONS)}")
        which = CONVENTIONS.index(self.conventions)
        for key, values in CONVENTION_KEYS.items():
            if getattr(self, key) is None:
                setattr(self, key, values[which])

    def conventions_in_force(self) -> str:
        """For the run-start log: the conventions and each convention key's value, a key set against the
        chosen conventions marked."""
        which = CONVENTIONS.index(self.conventions)
        parts = []
        for key, values in CONVENTION_KEYS.items():
            value = getattr(self, key)
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            parts.append(f"{key} {shown}" + ("" if value == values[which] else " (set explicitly)"))
        return f"conventions {self.conventions}: " + ", ".join(parts)

    @property
    def data_sources(self) -> tuple[DataSource, ...]:
        """The datasets data_path names, with weights summing to 1."""
        return parse_data_path(self.data_path)

    @property
    def per_document_positions(self) -> bool:
        """RoPE positions restart at each packed document: asked for, or implied by the document mask."""
        return self.reset_position_ids or self.document_mask

    @property
    def ac_mode(self) -> str:
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "full" if self.gradient_checkpointing else "none"

    def validate(self) -> None:
        at_least = {"tp": 1, "pp": 1, "cp": 1, "seq_length": 2, "batch_size": 1, "total_steps": 1, "log_steps": 1,
                    "gradient_accumulation_steps": 1, "pp_virtual_stages": 1, "pp_microbatch_size": 1,
                    "loss_chunk_tokens": 1, "collective_timeout_s": 1, "init_timeout_s": 1, "eval_iters": 1,
                    "lr_decay_steps": 1, "lr_wsd_decay_steps": 1}
        for key, low in at_least.items():
            if getattr(self, key) is not None and getattr(self, key) < low:
                raise ConfigError(f"{key} must be >= {low}, got {getattr(self, key)}")
        for key in ("warmup_steps", "save_steps", "eval_steps", "keep_last_n", "max_nonfinite_steps",
                    "weight_decay", "min_lr", "clip_grad"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.cpu_malloc_trim_growth < 10:
            raise ConfigError(f"cpu_malloc_trim_growth must be 0 (trim after every step) or a fraction below 10 "
                              f"(0.05: once resident memory grew by 5%), got {self.cpu_malloc_trim_growth}")
        parse_data_path(self.data_path)  # a bad data_path stops here, before anything starts
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise ConfigError(f"lr_decay_steps ({self.lr_decay_steps}) must be above warmup_steps "
                              f"({self.warmup_steps}): the decay ends that many steps into the run, after the "
                              "warm-up; raise it, or leave it empty to decay until total_steps")
        if self.lr_decay_style == "wsd":
            end = self.total_steps if self.lr_decay_steps is None else self.lr_decay_steps
            if self.lr_wsd_decay_steps is None or self.lr_wsd_decay_steps > end:
                raise ConfigError(f"lr_decay_style wsd needs lr_wsd_decay_steps between 1 and the decay's end "
                                  f"({end}, lr_decay_steps or total_steps), got {self.lr_wsd_decay_steps}: set "
                                  "lr_wsd_decay_steps (e.g. a tenth of the run)")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.rank_size is not None and self.rank_size < 1:
            raise ConfigError(f"rank_size must be >= 1, got {self.rank_size}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ConfigError(f"valid_fraction must be in [0, 1), got {self.valid_fraction}")
        problem = sequence_split_problem(self.seq_length, self.cp, self.tp)
        if problem:
            raise ConfigError(problem)
        if self.ep < 1:
            raise ConfigError(f"ep must be >= 1 (1: no expert parallelism), got {self.ep}")
        if self.dp_shard is not None and self.dp_shard < 1:
            raise ConfigError(f"dp_shard must be >= 1, got {self.dp_shard}")
        if self.dp_shard is not None and self.dp_shard > 1 and not self.distributed_optimizer:
            raise ConfigError(f"dp_shard {self.dp_shard} shards weights, gradients and optimizer state, but "
                              "distributed_optimizer is false (full replicas); set distributed_optimizer true, or "
                              "drop dp_shard")
        problem = unsupported_combination(compile=self.compile, tp=self.tp, cp=self.cp, ep=self.ep,
                                          recompute=self.ac_mode, keep_params_gathered=self.keep_params_gathered,
                                          distributed_optimizer=self.distributed_optimizer)
        if problem:
            raise ConfigError(problem)
        if self.grad_reduce_dtype == "bf16" and self.mixed_precision != "bf16":
            raise ConfigError(f"grad_reduce_dtype bf16 needs mixed_precision bf16 (it is {self.mixed_precision}): "
                              "set mixed_precision bf16, or grad_reduce_dtype fp32")
        if self.reduce_grads_every_microbatch and self.pp > 1:
            raise ConfigError("reduce_grads_every_microbatch needs pp 1: the pipeline schedule accumulates "
                              "gradients unsharded and reduces them once per step; set it to False")
        if self.allow_tf32 and self.mixed_precision != "fp32":
            raise ConfigError(f"allow_tf32 true needs mixed_precision fp32 (it is {self.mixed_precision}, whose "
                              "matmuls are bf16 already): set allow_tf32 false, or mixed_precision fp32")
        self._validate_fp8()
        if self.mtp_loss_weight < 0:
            raise ConfigError(f"mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if self.moe_aux_loss == "micro_batch" and self.pp > 1:
            raise ConfigError("moe_aux_loss micro_batch pools a micro-batch's layers (transformers' definition), "
                              "which pp > 1 puts on different ranks; use moe_aux_loss global_batch, or pp 1")
        if self.moe_aux_loss_scale == "megatron" and self.moe_aux_loss == "micro_batch":
            origin = " (from conventions megatron)" if self.conventions == "megatron" else ""
            raise ConfigError(f"moe_aux_loss_scale megatron{origin} scales each layer's own balancing term, which "
                              "moe_aux_loss micro_batch (all layers pooled) does not have; use moe_aux_loss "
                              "global_batch, or moe_aux_loss_scale mean_over_layers")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ConfigError(f"moe_capacity_factor must be > 0 (1.0: each expert takes its even share of the "
                              f"pairs), got {self.moe_capacity_factor}; leave it empty for dropless routing")
        if self.moe_pad_to_capacity and self.moe_capacity_factor is None:
            raise ConfigError("moe_pad_to_capacity pads each expert's group to its capacity, but "
                              "moe_capacity_factor is empty (dropless); set a factor, or moe_pad_to_capacity false")
        for key in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_rate"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        self._validate_observability()
        if self.batch_size * self.gradient_accumulation_steps % self.pp_microbatch_size:
            raise ConfigError(f"batch_size x gradient_accumulation_steps ({self.batch_size} x "
                              f"{self.gradient_accumulation_steps}) must be a multiple of pp_microbatch_size "
                              f"({self.pp_microbatch_size})")

    def _validate_fp8(self) -> None:
        if self.fp8 is None:  # the other fp8 keys are ignored: FP8 switches off by this key alone (at a resume too)
            return
        if self.fp8_all_gather and self.fp8 != "tensorwise":
            raise ConfigError(f"fp8_all_gather needs fp8 tensorwise (it is {self.fp8}): the weights are cast "
                              "to FP8 with one scale each before the gather; set fp8 tensorwise or "
                              "fp8_all_gather false")
        if self.fp8_all_gather and not self.distributed_optimizer:
            raise ConfigError("fp8_all_gather needs distributed_optimizer true (FSDP gathers the weights)")
        bad = [e for e in self.fp8_filter if not str(e).lstrip("+")]
        if bad:
            raise ConfigError(f"fp8_filter has an empty entry {bad[0]!r}: name a module path part, e.g. down_proj")

    def _validate_observability(self) -> None:
        for key in ("profile_every", "memory_snapshot_steps", "hang_factor", "hang_min_s",
                    "nccl_trace_buffer_size"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.profile_window < 1:
            raise ConfigError(f"profile_window must be >= 1, got {self.profile_window}")
        if self.profile_every and self.profile_window > self.profile_every:
            raise ConfigError(f"profile_window {self.profile_window} is longer than profile_every "
                              f"{self.profile_every}: make it shorter")
        parse_step_range(self.profile_steps)
        unknown = [t for t in self.trackers if t not in ("wandb", "swanlab")]
        if unknown:
            raise ConfigError(f"trackers {unknown} unknown: use wandb and/or swanlab (TensorBoard: tensorboard true)")


def parse_step_range(text: str | None) -> tuple[int, int] | None:
    """``profile_steps``: ``"10-12"`` -> (10, 12); ``"7"`` -> (7, 7); empty -> None."""
    if not text:
        return None
    first, _, last = str(text).partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        a, b = 0, -1
    if a < 1 or b < a:
        raise ConfigError(f"profile_steps must be a step range like 10-12 (first >= 1, last >= first), got {text!r}")
    return a, b
