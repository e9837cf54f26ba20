"""The multi-token-prediction layer's targets on packed documents, and its FLOPs and memory in MFU and the plan.

Targets: in a packed sample a document's last two positions would predict their token after next from the
next document. With per-document positions (``reset_position_ids`` / ``document_mask``) the engine ignores
them, so the MTP loss of a packed batch equals what each document gives alone: checked against a reference
written here, which runs each document through the model by itself and combines the documents' mean MTP
losses weighted by their counted positions. The main loss keeps every position, boundaries included.

FLOPs and memory: ``plan/flops.py``'s count and the planner's memory against an independent count of the
MTP layer's matmul shapes and parameters (its projection, one decoder layer, the shared head's second pass).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qwen3_pretrain.data.reader import document_positions
from qwen3_pretrain.models.ops.loss import IGNORE_INDEX
from qwen3_pretrain.models.qwen3.model import LossHead, ModelOptions, Qwen3Model
from qwen3_pretrain.train.engine import Engine, mtp_targets

EOD = 1
HYBRID = dict(model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"],
              partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, mtp_num_hidden_layers=1)
SEQ = 40
# Each row's documents by length, EOD included, over seq + 1 tokens: one-token documents (a lone EOD),
# documents of two and three tokens, a document whose EOD is the sample's last label (row 0 and 3), one whose
# EOD is the input before the last (seq - 2), one whose EOD is the last input (the label beyond it starts the
# next document), and a row of one document.
ROWS = [[6, 1, 9, 2, 3, 17, 3], [12, 27, 2], [20, 20, 1], [41]]


def _tokens(rows: list[list[int]], seed: int = 0) -> torch.Tensor:
    """[batch, seq + 1] token ids: each row's documents of random ids >= 2, each ending with EOD (cut at
    seq + 1 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for lengths in rows:
        docs = [torch.cat([torch.randint(2, 250, (n - 1,), generator=gen), torch.tensor([EOD])]) for n in lengths]
        out.append(torch.cat(docs)[:SEQ + 1])
    assert all(len(row) == SEQ + 1 for row in out)
    return torch.stack(out)


def _batch(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reader's sample layout (data/reader.py PackedDataset)."""
    inputs = tokens[:, :-1]
    positions = torch.stack([torch.from_numpy(document_positions(row.numpy(), EOD)) for row in inputs])
    return {"input_ids": inputs, "labels": tokens[:, 1:].clone(), "positions": positions}


def _documents(row: torch.Tensor) -> list[torch.Tensor]:
    """A row's seq + 1 tokens cut into its documents: each runs to its EOD, or to the row's end; a document
    that would begin at the last token (only ever a label) is left out."""
    docs, start = [], 0
    for i in range(SEQ):  # an EOD among the inputs ends its document
        if row[i] == EOD:
            docs.append(row[start:i + 1])
            start = i + 1
    if start < SEQ:
        docs.append(row[start:])
    return docs


def _model(tiny_config, loss_head: bool = False) -> Qwen3Model:
    torch.manual_seed(0)
    options = ModelOptions(document_mask=True, multi_token_prediction=True,
                           loss_head=LossHead(chunk_tokens=16) if loss_head else None)
    return Qwen3Model(tiny_config(**HYBRID), options)


def _engine(model: Qwen3Model, per_document_positions: bool, eod_id: int | None = EOD,
            mtp_weight: float = 0.5) -> Engine:
    """An engine of one process without a process group: only what a micro-batch's loss reads."""
    engine = Engine.__new__(Engine)
    engine.cfg = SimpleNamespace(per_document_positions=per_document_positions)
    engine.dims = SimpleNamespace(cp=1, tp=1)
    engine.cp_rank, engine.device, engine.parts = 0, torch.device("cpu"), [model]
    engine.mtp_weight, engine.mtp_sum, engine.eod_id, engine.loss_scale = mtp_weight, torch.zeros(()), eod_id, 1.0
    return engine


def _reference_mtp_loss(model: Qwen3Model, tokens: torch.Tensor) -> tuple[float, int]:
    """Each document run alone: its MTP loss is the mean over its positions that have a token after next in
    the document; the documents' means weighted by those counts. Returns (the weighted mean, the count)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in tokens:
            for doc in _documents(row):
                n = len(doc) - 2
                if n <= 0:
                    continue
                ids = doc[None, :-1]
                _, mtp_logits = model(ids, torch.arange(ids.shape[1])[None], mtp_input=doc[None, 1:])
                mean = F.cross_entropy(mtp_logits[0, :n].double(), doc[2:]).item()
                total, count = total + mean * n, count + n
    return total / count, count


def test_mtp_loss_on_packed_documents_equals_each_document_alone(tiny_config):
    model = _model(tiny_config)
    tokens = _tokens(ROWS)
    mb = _batch(tokens)
    targets = Engine.mtp_labels(_engine(model, per_document_positions=True), mb)
    with torch.no_grad():
        _, mtp_logits = model(mb["input_ids"], mb["positions"], mtp_input=mb["labels"])
    kept = targets != IGNORE_INDEX
    packed = F.cross_entropy(mtp_logits[kept].double(), targets[kept]).item()
    want, count = _reference_mtp_loss(model, tokens)
    assert int(kept.sum()) == count  # the same weights: each document's positions, none across a boundary
    assert packed == pytest.approx(want, rel=1e-5)
    # without the masking the documents' last positions count too, and the loss differs
    unmasked = mtp_targets(mb["labels"], mb["input_ids"])
    assert int((unmasked != IGNORE_INDEX).sum()) > count
    loose = F.cross_entropy(mtp_logits.flatten(0, 1).double(), unmasked.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    assert loose.item() > want * count + 1.0


def test_which_positions_are_ignored():
    """A document's last two positions (the one before its EOD and the EOD), and every sample's last; an EOD
    on the last input ignores the position before it (its token after next is the label beyond the input)."""
    ids = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9, 10, EOD]])
    labels = torch.cat([ids[:, 1:], torch.tensor([[11]])], dim=1)
    got = mtp_targets(labels, ids, EOD)
    ignored = (got == IGNORE_INDEX).nonzero()[:, 1].tolist()
    assert ignored == [1, 2, 3, 4, 5, 8, 9]
    kept = got != IGNORE_INDEX
    assert torch.equal(got[kept], torch.cat([labels[:, 1:], labels[:, :1]], dim=1)[kept])  # the token after next
    assert ((mtp_targets(labels, ids) == IGNORE_INDEX).nonzero()[:, 1].tolist()) == [9]  # no documents


def test_engine_masks_only_with_per_document_positions(tiny_config):
    """Without per-document positions (one stream per sample: attention reads across documents) the targets
    stay the labels moved one on, as before; with them, and no end-of-document token known (the
    simulation's data), too."""
    model = _model(tiny_config)
    mb = _batch(_tokens(ROWS))
    plain = torch.cat([mb["labels"][:, 1:], torch.full((len(ROWS), 1), IGNORE_INDEX)], dim=1)
    assert torch.equal(Engine.mtp_labels(_engine(model, per_document_positions=False), mb), plain)
    assert torch.equal(Engine.mtp_labels(_engine(model, True, eod_id=None), mb), plain)
    assert not torch.equal(Engine.mtp_labels(_engine(model, True), mb), plain)


def test_main_loss_at_boundaries_is_unchanged(tiny_config):
    """The engine's micro-batch loss: the main term counts every position (an EOD's label is the next
    document's first token, as without the MTP layer), the MTP term only the positions within documents;
    the labels handed in are not changed in place."""
    model = _model(tiny_config, loss_head=True)
    mb = _batch(_tokens(ROWS))
    labels = mb["labels"].clone()
    engine = _engine(model, per_document_positions=True, mtp_weight=0.5)
    total = engine.micro_batch_loss(model, mb).item()  # with grad: a training step's loss
    with torch.no_grad():
        hidden, mtp_hidden = model(mb["input_ids"], mb["positions"], mtp_input=mb["labels"])
        head = model.lm_head.weight
        main = F.cross_entropy((hidden @ head.T).flatten(0, 1).double(), labels.flatten(), reduction="sum")
        targets = mtp_targets(labels, mb["input_ids"], EOD)
        mtp = F.cross_entropy((mtp_hidden @ head.T).flatten(0, 1).double(), targets.flatten(),
                              ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.equal(mb["labels"], labels)
    assert engine.mtp_sum.item() == pytest.approx(mtp.item(), rel=1e-5)
    assert total == pytest.approx(main.item() + 0.5 * mtp.item(), rel=1e-5)
