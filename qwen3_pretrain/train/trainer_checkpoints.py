"""The trainer's checkpoint plumbing: resume from ``output_path``'s newest complete checkpoint (every rank the
same one, the same model; a changed learning-rate schedule said), what a save records beside the weights
(step, tokens, the data position, the layout, the config), and the starting checkpoint's tensors that are
not trained (a vision tower, an untrained MTP layer), kept for merge.

``TrainerCheckpoints`` is a part of ``Trainer`` (train/trainer.py), kept apart by what it does: its methods
read the trainer's run (``cfg``, ``launch``, ``dims``, ``source``), its ``engine``, ``loader``,
``checkpointer`` and counters, and it says its load as a start-up phase (``TrainerLog._phase``). The bytes on
disk are ``checkpoint/``'s.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from qwen3_pretrain.checkpoint.layout import CARRIED_DIR, read_meta
from qwen3_pretrain.config.loader import to_dict
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.hf_carried import write_carried
from qwen3_pretrain.models.qwen3.model import MTP_PREFIX
from qwen3_pretrain.train.model_source import ARCHITECTURE_KEYS
from qwen3_pretrain.train.optim import lr_at

log = logging.getLogger("qwen3_pretrain.train")

# What the learning rate at a step depends on besides the step: changed on resume, the schedule changes shape.
SCHEDULE_KEYS = ("learning_rate", "min_lr", "warmup_steps", "total_steps", "lr_decay_style", "lr_decay_steps",
                 "lr_wsd_decay_steps", "lr_wsd_decay_style", "lr_warmup_from_zero")


class TrainerCheckpoints:
    """Resume, save, and carry the untrained tensors: the checkpoint side of ``Trainer``."""

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
