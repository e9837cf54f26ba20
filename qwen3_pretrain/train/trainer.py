"""The training loop: set-up on every rank, then forward/backward (pipelined or not), reduce, step, log.

``qwen3-pretrain train --config pretrain_config.yaml [key=value ...]`` runs it
as one process, under ``torchrun`` or under ``mpirun``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from qwen3_pretrain.checkpoint.layout import CARRIED_DIR, find_latest, read_meta
from qwen3_pretrain.checkpoint.manager import Checkpointer
from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.config.loader import load_config, save_config, to_dict
from qwen3_pretrain.data.blend import BlendedDataset, validate_sources
from qwen3_pretrain.data.prefetch import Prefetcher
from qwen3_pretrain.data.reader import GlobalBatchLoader
from qwen3_pretrain.errors import ConfigError, UserError
from qwen3_pretrain.fsutil import make_dirs
from qwen3_pretrain.hardware import default_chunk_tokens, matmul_precision
from qwen3_pretrain.models.ops.fp8 import describe as describe_fp8
from qwen3_pretrain.models.ops.precision import matmul_dtype, use_fp32_matmul
from qwen3_pretrain.models.qwen3.hf_carried import write_carried
from qwen3_pretrain.models.qwen3.model import MTP_PREFIX, TIED_ALIASES
from qwen3_pretrain.parallel import env, launch
from qwen3_pretrain.parallel.parallelize import describe_kernels, kernel_table
from qwen3_pretrain.plan.flops import TokenFlops, token_flops
from qwen3_pretrain.plan.layout import Layout
from qwen3_pretrain.plan.layers import math_fallbacks
from qwen3_pretrain.plan.memory import predict_memory
from qwen3_pretrain.train.compile_report import compile_summary
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.engine import Engine, engine_layout, resolve_parallelism
from qwen3_pretrain.train.host_memory import HostMemory
from qwen3_pretrain.train.metrics import (MetricsWriter, cpu_peak_per_process, device_capacity, device_memory,
                                          device_peak_tflops, format_line, measure_cpu_tflops,
                                          memory_warning, runtime_reserved_gib, step_memory, utilization)
from qwen3_pretrain.train.model_source import ARCHITECTURE_KEYS, resolve_model
from qwen3_pretrain.train.observe import Observer, flight_recorder_env, format_observed, tracker_sinks
from qwen3_pretrain.train.optim import describe_optimizer, lr_at

log = logging.getLogger("qwen3_pretrain.train")


# Steps logged after every start whatever log_steps is, so the first loss (and step time) come at once.
ALWAYS_LOGGED_STEPS = 3
# What the learning rate at a step depends on besides the step: changed on resume, the schedule changes shape.
SCHEDULE_KEYS = ("learning_rate", "min_lr", "warmup_steps", "total_steps", "lr_decay_style", "lr_decay_steps",
                 "lr_wsd_decay_steps", "lr_wsd_decay_style", "lr_warmup_from_zero")


class TrainingHalted(UserError):
    """Training stopped on purpose (too many non-finite steps); the last good checkpoint is kept."""


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.launch = launch.detect_launch(cfg.master_addr, cfg.master_port)
        _setup_logging(self.launch.rank)
        self._resolve_run()
        env.set_deterministic(cfg.deterministic)
        self.device = env.pick_device(cfg.device, self.launch.local_rank, self.launch.local_world_size)
        # Before any arithmetic, so that the intra-op threads, started later, copy the setting (parallel/env.py)
        flushed = env.flush_cpu_denormals(cfg.cpu_flush_denormal) if self.device.type == "cpu" else False
        self.fp32_matmul = use_fp32_matmul(self.device, cfg.mixed_precision, cfg.cpu_bf16_matmul)
        if cfg.allow_tf32 and self.device.type == "cuda":  # before any matmul; the MFU peak follows it
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        self.loss_chunk_tokens = cfg.loss_chunk_tokens or default_chunk_tokens(self.device.type,
                                                                                self.source.config.vocab_size)
        flight_recorder_env(self.device.type, cfg.nccl_trace_buffer_size, cfg.output_path)
        env.init_process_group(self.launch, self.device, cfg.collective_timeout_s, cfg.init_timeout_s)
        # On a CPU, one fixed intra-op thread count for the run (runs repeat bitwise under load;
        # parallel/env.py). Not on an accelerator: its matmuls do not run on host threads, and the cores'
        # share is found by a collective that an accelerator's start-up has no need for.
        if self.device.type == "cpu":
            threads_line = env.set_cpu_threads(self.launch.launcher != "none")
            denormal_line = env.cpu_denormals_line(cfg.cpu_flush_denormal, flushed)  # checks the run's pool
            if self.launch.rank == 0:
                log.info("%s", threads_line)
                log.info("%s", denormal_line)
        # the heap's free pages back once resident memory has grown (train/host_memory.py)
        self.host_memory = HostMemory(self.device.type, cfg.cpu_malloc_trim, growth=cfg.cpu_malloc_trim_growth)
        if self.device.type == "cpu" and self.launch.rank == 0:
            log.info("%s", self.host_memory.line())
        self.mesh = self.dims.build_mesh(self.device.type)
        self.is_log_rank = self.dims.is_last_stage_lead(self.launch.rank)
        # Start-up phases that can take minutes (weights read from a HF directory, a checkpoint) are said
        # when they start and when they end. A run that resumes builds the model, then loads its weights.
        self.latest = find_latest(cfg.output_path)
        weights = (f"weights from {self.latest.name}, loaded next" if self.latest is not None
                   else self.source.description)
        with self._phase(f"building the model ({self.source.name}; {weights})"):
            self._create_engine()
        self._create_data()
        self.step = 0
        self.tokens_seen = 0
        self.nonfinite_in_a_row = 0
        self.stop_requested = self.stop_agreed = False
        make_dirs(cfg.output_path, "output_path")
        self.metrics = (MetricsWriter(cfg.output_path, cfg.tensorboard, tracker_sinks(cfg, to_dict(cfg)))
                        if self.is_log_rank else None)
        self.observer = Observer(cfg, self.device, self.launch.rank, self.launch.world_size, self.parts,
                                 self.engine.stage_indices)
        if self.engine.stage_compute is not None:  # under pp: each local stage's busy time in forward_backward
            self.engine.stage_compute.on = self.observer.clock.watch_stages(self.engine.stage_indices).span
        # A checkpoint of one stage holds a tied weight once, as the embedding: resumed under pp > 1,
        # the last stage's head (weight and optimizer state) reads the embedding's.
        aliases = TIED_ALIASES if self.source.config.tie_word_embeddings else None
        self.checkpointer = Checkpointer(cfg.output_path, self.parts, self.optimizers, cfg.keep_last_n,
                                         cfg.async_save, aliases=aliases, vocab_size=self.source.config.vocab_size,
                                         record=self.metrics.write if self.metrics is not None else None)
        self.resumed_from = self._maybe_resume()

    # --- set-up ------------------------------------------------------------------

    def _resolve_run(self) -> None:
        """The model and the parallelism of this run (``source``, ``parallelism``, ``dims``), with every
        check that needs no process group, so bad input stops each rank before heavy work."""
        cfg, world = self.cfg, self.launch.world_size
        if cfg.rank_size is not None and cfg.rank_size != world:
            raise ConfigError(f"rank_size is {cfg.rank_size} but {world} processes were launched; make them "
                              "equal (mpirun -np / torchrun --nproc_per_node x --nnodes)")
        self.source = resolve_model(cfg)
        model_cfg = self.source.config
        self.parallelism = resolve_parallelism(cfg, world, model_cfg)
        self.dims = self.parallelism.dims
        if cfg.eval_steps and not cfg.valid_fraction:
            raise ConfigError("eval_steps needs a held-out split: set valid_fraction (e.g. 0.01)")
        self.manifests = validate_sources(cfg.data_sources, model_cfg.vocab_size, cfg.tokenizer_path,
                                          cfg.seq_length)

    def _create_engine(self) -> None:
        # A rank's parameters are drawn or read on its share of the node's cores, the logging rank saying how
        # far; a run that resumes takes every one from its checkpoint, so they are only allocated.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // (self.launch.local_world_size or 1))
        progress = _progress_logger("materializing this rank's parameters") if self.is_log_rank else None
        allocate = (lambda part: part.to_empty(device=self.device)) if self.latest is not None else None
        self.engine = Engine(self.cfg, self.source, self.parallelism, self.mesh, self.device, self.fp32_matmul,
                             self.loss_chunk_tokens, allocate, init_threads=threads, progress=progress,
                             eod_id=self.manifests[0]["tokenizer"]["eod_id"])  # one tokenizer for all sources
        e = self.engine
        self.parts, self.optimizers, self.padded_vocab = e.parts, e.optimizers, e.padded_vocab

    def _create_data(self) -> None:
        cfg, dims = self.cfg, self.dims
        dataset = self.train_data = BlendedDataset.open(cfg.data_sources, cfg.seq_length, cfg.seed,
                                                        valid_fraction=cfg.valid_fraction)
        self.global_batch = self.engine.global_batch
        dp_rank = dims.dp_rank(self.launch.rank)
        micro = cfg.batch_size
        # The next steps' batches are read in a thread while this one runs (data/prefetch.py).
        vocab = self.source.config.vocab_size  # token ids checked on the host, before the device sees them
        self.loader = Prefetcher(GlobalBatchLoader(dataset, self.global_batch, dp_rank, dims.dp, micro,
                                                   vocab_size=vocab), self.device)
        self.eval_loader_args = None
        if cfg.eval_steps:
            valid = BlendedDataset.open(cfg.data_sources, cfg.seq_length, cfg.seed, split="valid",
                                        valid_fraction=cfg.valid_fraction)
            self.eval_loader_args = (valid, self.global_batch, dp_rank, dims.dp, micro)
        self.global_tokens = self.engine.global_tokens

    @contextlib.contextmanager
    def _phase(self, what: str):
        """Log ``what`` when it starts and how long it took when it ends (on the logging rank)."""
        if self.is_log_rank:
            log.info("%s ...", what)
        start = time.perf_counter()
        yield
        if self.is_log_rank:
            log.info("done in %.1f s: %s", time.perf_counter() - start, what.split(" (")[0])

    # --- checkpoints ------------------------------------------------------------------

    def _maybe_resume(self) -> Path | None:
        """Continue from ``output_path``'s newest complete checkpoint (found before the model was built),
        whatever layout wrote it."""
        path = self.latest
        # Every rank must see the same checkpoint (checkpoints live on a filesystem all nodes share).
        found = torch.tensor([int(path.name.split("_")[1]) if path else -1] * 2, device=self.device)
        found[1].neg_()
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found[0].item() != -found[1].item():
            raise UserError(f"ranks see different checkpoints in {self.cfg.output_path}; output_path must be on "
                            "a filesystem shared by all nodes (e.g. NFS)")
        if path is None:
            return None
        # before loading: a checkpoint of another model fails there with DCP's size or key errors
        self._check_checkpoint_model(read_meta(path), path)
        with self._phase(f"loading checkpoint {path}"):
            meta = self.checkpointer.load(path)
        self.engine.refresh_fp8_scales()  # FP8 all-gather scales from the loaded weights
        self.step, self.tokens_seen = meta["step"], meta["tokens_seen"]
        self.nonfinite_in_a_row = meta.get("nonfinite_in_a_row", 0)
        self.loader.load_state_dict(meta["data"])
        self._warn_schedule_change(meta.get("config", {}))
        return path

    def _warn_schedule_change(self, saved: dict) -> None:
        """Resuming with other learning-rate settings reshapes the schedule from the next step on: allowed
        (extending total_steps is common), but said, with the lr the next step gets under each schedule."""
        changed = {k: (saved[k], getattr(self.cfg, k)) for k in SCHEDULE_KEYS
                   if k in saved and saved[k] != getattr(self.cfg, k)}
        if not changed or not self.is_log_rank:
            return
        before = dataclasses.replace(self.cfg, **{k: old for k, (old, _) in changed.items()})
        log.warning("resuming with another learning-rate schedule (%s): the lr of step %d is %.3g (the checkpoint's "
                    "schedule: %.3g); to continue it unchanged, resume with the checkpoint's values",
                    ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()), self.step + 1,
                    lr_at(self.step, self.cfg), lr_at(self.step, before))

    def _check_checkpoint_model(self, meta: dict, path: Path) -> None:
        saved, current = meta.get("model_config", {}), self.source.config.to_hf_dict()
        diffs = [f"{k} {saved.get(k)} vs {current.get(k)}" for k in ARCHITECTURE_KEYS if saved.get(k) != current.get(k)]
        if diffs:
            raise UserError(f"{path} holds a different model ({', '.join(diffs)}); "
                            "use another output_path or the matching model config")

    def save_checkpoint(self) -> None:
        cfg, dims = self.cfg, self.dims
        meta = {
            "tokens_seen": self.tokens_seen, "model_name": cfg.model_name,
            "model_config": self.source.config.to_hf_dict(), "padded_vocab_size": self.padded_vocab,
            "tied": self.source.config.tie_word_embeddings, "tokenizer_path": cfg.tokenizer_path,
            "layout": {"world": self.launch.world_size, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "cp": dims.cp,
                       "dp_shard": dims.dp_shard, "distributed_optimizer": dims.distributed_optimizer,
                       "pp_schedule": cfg.pp_schedule},
            "data": self.loader.state_dict(), "config": to_dict(cfg), "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        if (Path(cfg.output_path) / CARRIED_DIR).is_dir():
            meta["carried"] = CARRIED_DIR  # relative to output_path
        self.checkpointer.save(self.step, meta)

    def _request_stop(self, signum, frame) -> None:
        if not self.stop_requested:
            log.warning("received %s: finishing step %d, saving a checkpoint, then exiting",
                        signal.Signals(signum).name, self.step + 1)
        self.stop_requested = True

    # --- one step -------------------------------------------------------------------

    def evaluate(self) -> float:
        """Mean token loss over ``eval_iters`` global batches of the held-out split (the same ones each time)."""
        loader = GlobalBatchLoader(*self.eval_loader_args, vocab_size=self.source.config.vocab_size)
        total = sum(self.engine.evaluate(next(loader), loader.bad_token) for _ in range(self.cfg.eval_iters))
        self.engine.reshard()
        return total / self.cfg.eval_iters

    def _mark(self, phase: str) -> None:
        """The engine's phase marks; the update's end also hands the step's freed heap pages back (the
        gradients are released by then), so the trim's time is the optimizer phase's and the phases still
        add up to the step."""
        if phase == "optimizer":
            self.host_memory.after_step()
        self.observer.mark(phase)

    def train_step(self) -> dict:
        start = time.perf_counter()
        lr = lr_at(self.step, self.cfg)
        # The step's loss reduction also tells every rank whether any was asked to stop (SIGTERM/SIGINT).
        # No wait for the device here: the step read its figures after backward, which waited for everything
        # queued before (the previous step's update included), so a step's time is one period of the device's
        # work, and its update runs while the host prepares the next step.
        with self.observer.step(self.step + 1):  # phases, profiler window, hang watchdog, OOM snapshot
            batches = next(self.loader)
            self.observer.mark("data")
            result = self.engine.step(batches, lr, flag=self.stop_requested, bad_token=self.loader.bad_token,
                                      mark=self._mark)
            seconds = time.perf_counter() - start  # a profile's export at the step's end is not its time
        self.stop_agreed = result.flagged
        self.step += 1
        self.tokens_seen += self.global_tokens
        return {"step": self.step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                "skipped": result.skipped, "step_time_s": seconds,
                "consumed_samples": self.loader.consumed_samples, **result.figures}

    # --- the loop -------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train until ``total_steps`` (or a stop signal), saving every ``save_steps`` and at the end."""
        cfg = self.cfg
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        self._carry_untrained()
        self._log_start()
        history: list[dict] = []
        if self.step >= cfg.total_steps:
            if self.is_log_rank:
                log.warning("checkpoint step %d >= total_steps %d: nothing to train; raise total_steps or use "
                            "another output_path", self.step, cfg.total_steps)
            return history
        peak = self._peak_tflops()
        flops_per_token = token_flops(self.source.config, cfg.seq_length, cfg.ac_mode, cfg.mtp_loss_weight > 0)
        avg_step = None
        saved_at = started_at = self.step
        while self.step < cfg.total_steps:
            # torch.compile compiles the layers when the first step runs them: a start-up phase of its own.
            with (self._phase(f"compiling the model (torch.compile, during step {self.step + 1})")
                  if cfg.compile and self.step == started_at else contextlib.nullcontext()):
                rec = self.train_step()
            if cfg.compile and self.step == started_at + 1 and self.is_log_rank:
                log.info("%s", compile_summary().line())
            history.append(rec)
            self._check_finite(rec)
            if avg_step is None or rec["step"] > 1:  # the first step pays for warm-up
                avg_step = rec["step_time_s"] if avg_step is None else 0.9 * avg_step + 0.1 * rec["step_time_s"]
            # The first steps are always logged: the first loss comes at once, whatever log_steps is. Every
            # rank decides alike (skipped and stop_agreed are global): the observer gathers from each.
            if (rec["step"] % cfg.log_steps == 0 or rec["step"] == cfg.total_steps
                    or rec["step"] <= started_at + ALWAYS_LOGGED_STEPS or rec["skipped"] or self.stop_agreed):
                rec.update(self.observer.collect(rec["step_time_s"], warn=self.is_log_rank))
                if self.is_log_rank:
                    self._log_step(rec, peak, flops_per_token, avg_step)
            due = self.step == cfg.total_steps or (cfg.save_steps and self.step % cfg.save_steps == 0)
            # A step skipped for a non-finite loss is not saved: 'latest' keeps naming the last good state.
            if (due or self.stop_agreed) and not rec["skipped"]:
                with self.observer.between_steps("checkpoint"):
                    self.save_checkpoint()
                saved_at = self.step
            if self.is_log_rank and rec["step"] == started_at + 3:
                self._log_measured_memory()
            if cfg.eval_steps and (self.step % cfg.eval_steps == 0 or self.step == cfg.total_steps):
                with self.observer.between_steps("eval"):
                    loss = self.evaluate()
                self._log_eval(loss)
            if self.stop_agreed:
                if self.is_log_rank:
                    log.info("stopped on request after step %d; checkpoint saved, resume by running the same command",
                             self.step)
                break
        if saved_at != self.step and self.nonfinite_in_a_row == 0:
            self.save_checkpoint()
        self.checkpointer.wait()
        # Let every rank's last pipeline sends land before any rank tears its process group down: a
        # transfer still in flight at that moment aborts the process.
        dist.barrier()
        return history

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

    def _check_finite(self, rec: dict) -> None:
        if not rec["skipped"]:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        if self.is_log_rank:
            log.warning("step %d: non-finite loss %s or grad_norm %s at data position %d samples; "
                        "optimizer step skipped", rec["step"], rec["loss"], rec["grad_norm"], rec["consumed_samples"])
        if self.nonfinite_in_a_row >= max(1, self.cfg.max_nonfinite_steps):
            raise TrainingHalted(f"{self.nonfinite_in_a_row} consecutive steps with a non-finite loss or gradient "
                                 f"norm (last at step {rec['step']}); stopping. Lower learning_rate or check the "
                                 "data at that position; the last good checkpoint is kept")

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

    def _carry_untrained(self) -> None:
        """Keep what the starting checkpoint holds beyond the text model (a vision tower, an MTP layer) in
        ``output_path/carried`` for merge to write back unchanged; said in the log."""
        reader = self.source.reader
        if reader is None or self.launch.rank != 0:
            return
        carried = Path(self.cfg.output_path) / CARRIED_DIR
        trained = self.cfg.mtp_loss_weight > 0  # the MTP layer is the model's, saved with it
        if trained and not reader.has_mtp:
            log.info("multi-token-prediction layer: %s holds none (no mtp.* tensors); it starts from random init",
                     reader.path)
        if self.resumed_from is None and write_carried(reader, carried, mtp_trained=trained) is not None:
            groups: dict[str, int] = {}
            for name in (n for n in reader.carried if not (trained and n.startswith(MTP_PREFIX))):
                prefix = ".".join(name.split(".")[:2]) if name.startswith("model.") else name.split(".")[0]
                groups[prefix] = groups.get(prefix, 0) + 1
            log.info("carried unchanged, not trained: %d tensors of %s (%s) -> %s; merge writes them back",
                     sum(groups.values()), reader.path,
                     ", ".join(f"{k}.* {n}" for k, n in groups.items()) or "none", carried)

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

    def close(self) -> None:
        self.observer.close()
        self.loader.close()
        self.checkpointer.close()
        if self.metrics is not None:
            self.metrics.close()
        env.destroy()


def _progress_logger(what: str, every_s: float = 5.0):
    """A ``progress(done, total)`` that logs ``what``'s share done, at most every ``every_s`` seconds."""
    last = time.perf_counter()

    def progress(done: int, total: int) -> None:
        nonlocal last
        if done < total and time.perf_counter() - last >= every_s:
            last = time.perf_counter()
            log.info("%s: %d%% (%.2f of %.2f B)", what, 100 * done // total, done / 1e9, total / 1e9)

    return progress


def _setup_logging(rank: int) -> None:
    # A known, harmless notice of torch.distributed, printed by every rank: the model's outputs are never
    # modified in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger("qwen3_pretrain")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    parser = CommandParser("train", description="Pre-train a Qwen3 model.", config=TrainConfig)
    parser.add_argument("--config", help="training config YAML (the reference pretrain_config.yaml keys)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def main(argv: list[str]) -> int:
    config_path, overrides = parse_args(argv)
    cfg = load_config(TrainConfig, config_path, overrides)
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    if trainer.launch.world_size > 1:
        # Everything is saved, flushed and closed. Skip the interpreter's teardown: destructors of
        # torch.distributed's background threads occasionally abort there ("terminate called without
        # an active exception"), which would turn a finished run into a failed one for the launcher.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _count(n: int) -> str:
    """A parameter count as people write it: 20.3M, 8.19B."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"
