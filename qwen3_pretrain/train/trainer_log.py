"""What the trainer tells: the start report (layout, model, kernels, FP8, data notes, resume), the planner's
memory prediction for the very layout that runs and the measured peak beside it, the MFU peak and where it
comes from, each logged step's record (``metrics.jsonl``; the log line is a view of it), the eval line, and
the start-up phases with their durations.

``TrainerLog`` is a part of ``Trainer`` (train/trainer.py), kept apart by what it does: its methods read the
trainer's run (``cfg``, ``launch``, ``dims``, ``source``, ``device``), its ``engine`` and ``metrics``
writer; only the logging rank (``is_log_rank``) writes, except where a method says otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch.distributed as dist

from qwen3_pretrain.config.loader import save_config
from qwen3_pretrain.hardware import matmul_precision
from qwen3_pretrain.models.ops.fp8 import describe as describe_fp8
from qwen3_pretrain.models.ops.precision import matmul_dtype
from qwen3_pretrain.parallel import env
from qwen3_pretrain.parallel.parallelize import describe_kernels, kernel_table
from qwen3_pretrain.plan.flops import TokenFlops
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.layers import math_fallbacks
from qwen3_pretrain.plan.memory import predict_memory
from qwen3_pretrain.train.metrics import (cpu_peak_per_process, device_capacity, device_memory, device_peak_tflops,
                                          format_line, measure_cpu_tflops, memory_warning, runtime_reserved_gib,
                                          step_memory, utilization)
from qwen3_pretrain.train.observe import format_observed
from qwen3_pretrain.train.optim import describe_optimizer
from qwen3_pretrain.train.parallelism import engine_layout

log = logging.getLogger("qwen3_pretrain.train")


class TrainerLog:
    """The start report, the step and eval records, memory predicted and measured: the telling side of
    ``Trainer``."""

    @contextlib.contextmanager
    def _phase(self, what: str):
        """Log ``what`` when it starts and how long it took when it ends (on the logging rank)."""
        if self.is_log_rank:
            log.info("%s ...", what)
        start = time.perf_counter()
        yield
        if self.is_log_rank:
            log.info("done in %.1f s: %s", time.perf_counter() - start, what.split(" (")[0])

    def _peak_tflops(self) -> float:
        """The peak per device that MFU divides by (on the logging rank; nan elsewhere), logged with its
        origin. On a CPU: one core's matmul peak, measured while the other ranks wait (collective), times
        the cores this node's processes may run on between them over their number, whatever the launcher
        bound each process to and set its threads to."""
        cfg, dtype = self.cfg, matmul_dtype(self.cfg.mixed_precision, self.fp32_matmul)
        precision = matmul_precision(cfg.mixed_precision, cfg.allow_tf32, self.device.type)
        if self.device.type == "cpu" and not cfg.peak_tflops:
            cores, processes = env.node_cpu_share(self.launch.launcher != "none")
            dist.barrier()
            per_core = measure_cpu_tflops(dtype=dtype, threads=1) if self.is_log_rank else float("nan")
            dist.barrier()
            peak = cpu_peak_per_process(per_core, cores, processes)
            origin = (f"{per_core:.3g} TFLOP/s measured on one core in {str(dtype).removeprefix('torch.')} x "
                      f"{cores} cores / {processes} process(es) on this node")
        elif self.is_log_rank:  # only the logging rank looks the device up (and warns if it is unknown)
            peak, origin = device_peak_tflops(self.device, cfg.peak_tflops, dtype, precision)
        else:
            return float("nan")
        if self.is_log_rank:
            log.info("MFU against a peak of %.3g TFLOP/s per device (%s)", peak, origin)
        return peak

    def _log_step(self, rec: dict, peak_tflops: float, flops_per_token: TokenFlops, avg_step: float) -> None:
        world = self.launch.world_size
        tps = self.global_tokens / rec["step_time_s"]
        record = {
            "step": rec["step"], "total_steps": self.cfg.total_steps, "loss": rec["loss"], "lr": rec["lr"],
            "grad_norm": rec["grad_norm"], "tokens_per_sec": tps, "tokens_per_sec_per_device": tps / world,
            "step_time_s": rec["step_time_s"], **utilization(flops_per_token, tps / world, peak_tflops),
            **step_memory(self.device), "tokens_seen": self.tokens_seen,
            "eta_s": (self.cfg.total_steps - rec["step"]) * avg_step,
            "samples_by_dataset": self.train_data.samples_by_dataset(rec["consumed_samples"]),
        }
        record.update({key: value for key, value in rec.items() if key.startswith(("moe_", "mtp_"))})
        record.update({key: value for key, value in rec.items()
                       if key.startswith(("time_", "slowest_")) or key in ("ranks", "health_worst")})
        if self.cfg.moe_force_balance:
            record["moe_force_balance"] = True
        if rec["skipped"]:
            record["skipped"] = True
        log.info(format_line(record) + format_observed(record))
        self.metrics.write(record)

    def _log_eval(self, loss: float) -> None:
        if self.is_log_rank:
            ppl = math.exp(loss) if loss < 50 else float("inf")
            log.info("eval at step %d | loss %.4f | ppl %.2f", self.step, loss, ppl)
            self.metrics.write({"event": "eval", "step": self.step, "eval_loss": loss, "eval_ppl": ppl})

    def _log_start(self) -> None:
        cfg, dims, m = self.cfg, self.dims, self.source.config
        if self.launch.rank == 0:
            save_config(cfg, Path(cfg.output_path) / "config.yaml")
        if self.is_log_rank:
            weights = (f"weights from {self.resumed_from.name} (resumed)" if self.resumed_from is not None
                       else self.source.description)
            size = f"{_count(m.num_params())} params"
            if m.is_moe:  # the active ones (a token's share of the experts) are what MFU counts
                size += f", {_count(m.num_params(active=True))} active"
            log.info("run start: world %d | tp %d pp %d dp %d cp %d | global_batch %d (batch_size %d x dp %d x "
                     "accumulation %d) | seq %d | model %s, %s | %s | device %s | launcher %s",
                     self.launch.world_size, dims.tp, dims.pp, dims.dp, dims.cp, self.global_batch, cfg.batch_size,
                     dims.dp, cfg.gradient_accumulation_steps, cfg.seq_length, self.source.name, size, weights,
                     self.device, self.launch.launcher)
            log.info("%s", cfg.conventions_in_force())
            log.info("kernels: %s", describe_kernels(kernel_table(
                m, self.engine.target_device_type, self.engine.elementwise, cfg.mixed_precision, self.fp32_matmul,
                dims.cp > 1, describe_optimizer(self.optimizers[0]), fp8=self.engine.fp8, compiled=cfg.compile)))
            if self.engine.fp8 is not None:
                log.info("%s", describe_fp8(self.engine.fp8, self.engine.parts))
            # The start record first: a resume record after it belongs to the run it starts.
            self.metrics.write({"event": "start", "step": self.step, "world": self.launch.world_size,
                                "tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "dp": dims.dp,
                                "global_batch": self.global_batch})
            for manifest, source in zip(self.manifests, cfg.data_sources):
                if manifest.get("seq_length") not in (None, cfg.seq_length):
                    log.info("%s was converted for seq_length %s; training at %d (fine: samples are packed at any "
                             "length)", source.path, manifest["seq_length"], cfg.seq_length)
            if self.fp32_matmul:
                log.info("bf16 matmuls are computed in fp32: %s (cpu_bf16_matmul: %s)", "this CPU has no AVX512-BF16 "
                         "or AMX, native bf16 would run several times slower" if cfg.cpu_bf16_matmul == "auto"
                         else "as configured", cfg.cpu_bf16_matmul)
            if self.resumed_from is not None:
                log.info("resumed from %s at step %d", self.resumed_from, self.step)
                self.metrics.write({"event": "resume", "step": self.step, "path": str(self.resumed_from)})
            self._log_predicted_memory()

    def _layout(self) -> Layout:
        return engine_layout(self.cfg, self.parallelism, self.loss_chunk_tokens, self.device.type,
                             self.fp32_matmul)

    def _log_predicted_memory(self) -> None:
        """The planner's prediction for this very layout (with the device runtime's own memory), a warning
        when it exceeds the device, and one for attention the device serves with its math kernel."""
        layout, model = self._layout(), self.source.config
        reserve = runtime_reserved_gib(self.device) * 2**30
        self.predicted_memory = mem = predict_memory(model, layout, runtime_reserved_bytes=reserve)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in mem.gib().items() if k != "total")
        skew = (" at even expert routing; `plan --moe-imbalance` prices skewed routing"
                if model.num_experts and layout.ep > 1 and layout.moe_rank_load == 1 else "")
        log.info("predicted peak memory per device: %.2f GiB (%s GiB; worst pipeline stage %d)%s",
                 mem.total / 2**30, parts, mem.stage, skew)
        warning = memory_warning(mem.total, device_capacity(self.device))
        if warning:
            log.warning(warning)
        for call in math_fallbacks(model, layout):
            log.warning("attention (%s mask, %s, %d/%d heads, %d x %d) has no fused kernel on %s and runs on SDPA's "
                        "math kernel, which keeps %.2f GiB of fp32 probabilities per layer call (counted in the "
                        "prediction); train in bf16 for the flash kernel", call.mask, call.dtype, call.q_heads,
                        call.kv_heads, call.q_len, call.kv_len, self.device.type,
                        4 * call.batch * call.q_heads * call.q_len * call.kv_len / 2**30)

    def _log_measured_memory(self) -> None:
        record = device_memory(self.device)
        if "reserved_gib" in record:
            log.info("peak memory after %d steps: measured %.2f GiB allocated (%.2f GiB reserved by the allocator, "
                     "%.2f GiB held outside it, %.2f GiB free) vs predicted %.2f GiB allocated, %.2f GiB in all "
                     "(this stage's rank; prediction is the worst stage)", self.step, record["allocated_gib"],
                     record["reserved_gib"], record["outside_allocator_gib"], record["free_gib"],
                     self.predicted_memory.allocated / 2**30, self.predicted_memory.total / 2**30)
        else:
            log.info("peak memory after %d steps: %.2f GiB RSS (the whole process) vs predicted %.2f GiB of tensors",
                     self.step, record["rss_gib"], self.predicted_memory.allocated / 2**30)
        self.metrics.write({"event": "memory", "step": self.step, **record,
                            "predicted_allocated_gib": self.predicted_memory.allocated / 2**30,
                            "predicted_total_gib": self.predicted_memory.total / 2**30})


def _count(n: int) -> str:
    """A parameter count as people write it: 20.3M, 8.19B."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
