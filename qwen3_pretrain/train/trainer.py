"""The training loop: set-up on every rank, then forward/backward (pipelined or not), reduce, step, log.

``qwen3-pretrain train --config pretrain_config.yaml [key=value ...]`` runs it
as one process, under ``torchrun`` or under ``mpirun``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

from qwen3_pretrain.checkpoint.layout import find_latest
from qwen3_pretrain.checkpoint.manager import Checkpointer
from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.config.loader import load_config, to_dict
from qwen3_pretrain.data.blend import BlendedDataset, validate_sources
from qwen3_pretrain.data.prefetch import Prefetcher
from qwen3_pretrain.data.reader import GlobalBatchLoader
from qwen3_pretrain.errors import ConfigError, UserError
from qwen3_pretrain.fsutil import make_dirs
from qwen3_pretrain.hardware import default_chunk_tokens
from qwen3_pretrain.models.ops.precision import use_fp32_matmul
from qwen3_pretrain.models.qwen3.model import TIED_ALIASES
from qwen3_pretrain.parallel import env, launch
from qwen3_pretrain.plan.flops import token_flops
from qwen3_pretrain.train.compile_report import compile_summary
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.engine import Engine
from qwen3_pretrain.train.host_memory import HostMemory
from qwen3_pretrain.train.metrics import MetricsWriter
from qwen3_pretrain.train.model_source import resolve_model
from qwen3_pretrain.train.observe import Observer, flight_recorder_env, tracker_sinks
from qwen3_pretrain.train.optim import lr_at
from qwen3_pretrain.train.parallelism import resolve_parallelism
from qwen3_pretrain.train.trainer_checkpoints import TrainerCheckpoints
from qwen3_pretrain.train.trainer_log import TrainerLog

log = logging.getLogger("qwen3_pretrain.train")


# Steps logged after every start whatever log_steps is, so the first loss (and step time) come at once.
ALWAYS_LOGGED_STEPS = 3


class TrainingHalted(UserError):
    """Training stopped on purpose (too many non-finite steps); the last good checkpoint is kept."""


class Trainer(TrainerCheckpoints, TrainerLog):
    """One rank's training run: set-up, the step, the loop; checkpoints (``TrainerCheckpoints``) and what the
    run logs (``TrainerLog``) are its parts in train/trainer_checkpoints.py and train/trainer_log.py."""

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
        lr = lr_at(self.step, self.cfg)
        # The step's loss reduction also tells every rank whether any was asked to stop (SIGTERM/SIGINT).
        # No wait for the device here: the step read its figures after backward, which waited for everything
        # queued before (the previous step's update included), so a step's time is one period of the device's
        # work, and its update runs while the host prepares the next step.
        with self.observer.step(self.step + 1):  # phases, profiler window, hang watchdog, OOM snapshot
            # timed from here, as its phases are: a profile window's start (the profiler's start-up, several
            # ms on a CPU) is not the step's time, as its export at the end is not
            start = time.perf_counter()
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

