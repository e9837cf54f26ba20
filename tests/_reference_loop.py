"""An independent reference for the training tests: a plain ``transformers`` training loop.

It shares no code with the package: the initial weights come from a HF directory written by
``transformers`` itself, the batches are read from the shards' Megatron ``.idx``/``.bin`` bytes with
numpy and ordered as the reader documents it, and the learning rate is written out from its
definition. Whatever the trainer gets wrong (loss scaling, gradient reduction, data order,
schedule), this loop does not inherit.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

# The .idx dtype codes (Megatron-LM's indexed dataset).
IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
              8: np.uint16}
IDX_MAGIC = b"MMIDIDX\x00\x00"


def read_sequences(prefix: Path) -> list[np.ndarray]:
    """The sequences of one ``prefix.idx``/``prefix.bin`` pair: header, lengths, byte pointers."""
    idx = prefix.with_name(prefix.name + ".idx").read_bytes()
    assert idx[:9] == IDX_MAGIC and struct.unpack_from("<Q", idx, 9)[0] == 1, f"{prefix}.idx: not a version-1 index"
    dtype = np.dtype(IDX_DTYPES[idx[17]])
    count, _ = struct.unpack_from("<QQ", idx, 18)
    lengths = np.frombuffer(idx, np.int32, count, offset=34)
    pointers = np.frombuffer(idx, np.int64, count, offset=34 + 4 * count)
    tokens = np.fromfile(prefix.with_name(prefix.name + ".bin"), dtype=dtype)
    return [tokens[p // dtype.itemsize:p // dtype.itemsize + n] for p, n in zip(pointers, lengths, strict=True)]


def read_documents(data_path: Path) -> list[np.ndarray]:
    """Every document of a converted data directory, shards in the manifest's order. Only directories
    whose every sequence is a whole document (ends with EOD) are handled: the corpora the tests write."""
    manifest = json.loads((Path(data_path) / "manifest.json").read_text())
    eod = manifest["tokenizer"]["eod_id"]
    docs = [seq for shard in manifest["shards"] for seq in read_sequences(Path(data_path) / shard["prefix"])]
    assert all(len(d) and d[-1] == eod for d in docs), "a document cut into pieces: not handled here"
    return docs


def global_batches(data_path: Path, seq_length: int, seed: int, global_batch: int) -> Iterator[torch.Tensor]:
    """``[global_batch, seq_length + 1]`` token windows per step, in the documented data order.

    Epoch ``e`` draws from ``np.random.default_rng([seed, e])``: first a permutation of the documents,
    concatenated into one stream, cut into windows of ``seq_length + 1`` tokens every ``seq_length``
    tokens; then a permutation of those windows, the order in which they are visited. Step ``k`` takes
    samples ``[k * global_batch, (k + 1) * global_batch)`` of the epochs laid end to end.
    """
    docs = read_documents(data_path)
    num_samples = (sum(len(d) for d in docs) - 1) // seq_length
    epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def sample(i: int) -> np.ndarray:
        epoch, j = divmod(i, num_samples)
        if epoch not in epochs:
            rng = np.random.default_rng([seed, epoch])
            stream = np.concatenate([docs[d] for d in rng.permutation(len(docs))])
            epochs[epoch] = (stream, rng.permutation(num_samples))
        stream, order = epochs[epoch]
        start = int(order[j]) * seq_length
        return stream[start:start + seq_length + 1]

    for step in range(10**9):
        first = step * global_batch
        yield torch.from_numpy(np.stack([sample(i) for i in range(first, first + global_batch)]).astype(np.int64))


def scheduled_lr(step: int, peak: float, warmup: int, total: int, min_lr: float, style: str) -> float:
    """LR of 0-based step ``step``: linear warm-up reaching ``peak`` at step ``warmup - 1``, then
    ``style`` decay from ``peak`` to ``min_lr`` over the remaining ``total - warmup`` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total - warmup))  # fraction of the decay behind us
    if style == "constant":
        return peak
    shape = 1.0 - done if style == "linear" else (1.0 + math.cos(math.pi * done)) / 2
    return min_lr + (peak - min_lr) * shape


def write_transformers_init(path: Path, model: dict, seed: int) -> Path:
    """A randomly initialized model as ``transformers`` itself initializes and saves one."""
    import transformers

    config = transformers.Qwen3Config(**model, max_position_embeddings=256, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                      bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


# Parameters AdamW does not decay: norms, the embedding, Gated DeltaNet's decay parameters.
NO_DECAY = ("norm.weight", "A_log", "dt_bias")


def train_with_transformers(hf_dir: Path, data_path: Path, cfg: dict, steps: int, global_batch: int) -> list[dict]:
    """``steps`` AdamW steps of the HF model in ``hf_dir`` (whichever causal LM its config.json names) on
    full-vocabulary logits; ``cfg`` holds the training config's keys. Returns per-step ``{"step", "loss",
    "grad_norm", "lr"}`` like metrics.jsonl."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    model.train()
    params = dict(model.named_parameters())  # a tied head is the embedding, listed once
    no_decay = [p for n, p in params.items() if n.endswith(NO_DECAY) or "embed_tokens" in n]
    decay = [p for n, p in params.items() if not (n.endswith(NO_DECAY) or "embed_tokens" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.0, betas=(cfg["adam_beta1"], cfg["adam_beta2"]), eps=cfg["adam_eps"])
    batches = global_batches(data_path, cfg["seq_length"], cfg["seed"], global_batch)
    out = []
    for step in range(steps):
        tokens = next(batches)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip_grad"]).item()
        lr = scheduled_lr(step, cfg["learning_rate"], cfg["warmup_steps"], cfg["total_steps"], cfg["min_lr"],
                          cfg["lr_decay_style"])
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
        out.append({"step": step + 1, "loss": loss.item(), "grad_norm": grad_norm, "lr": lr})
    return out
