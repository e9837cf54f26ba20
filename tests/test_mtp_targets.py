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


# --- FLOPs (MFU, HFU, the planner's time) and the planner's memory ---------------------------------------

PLAN_HYBRID = dict(model_type="qwen3_5_text", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=128,
                   layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
                   partial_rotary_factor=0.25, mtp_num_hidden_layers=1)
PLAN_MOE = dict(PLAN_HYBRID, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, shared_expert_intermediate_size=96)


def _mtp_forward_flops(cfg, seq: int) -> float:
    """The MTP layer's forward FLOPs per token from its matmul shapes (2 per multiply-add): fc [2h -> h]; a
    gated full-attention layer (q_proj with its gate, k, v, o; Q K^T and A V over the causal half); its MLP,
    layer 0's (dense SwiGLU, or the router, the routed experts and the gated shared expert); the shared head's
    second pass [h -> vocab]."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    matmuls = 2 * h * h + h * 2 * q + 2 * h * kv + q * h + cfg.vocab_size * h
    if cfg.num_experts:
        matmuls += h * cfg.num_experts + 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok
        matmuls += 3 * h * cfg.shared_expert_intermediate_size + h
    else:
        matmuls += 3 * h * cfg.intermediate_size
    return 2 * matmuls + 2 * 2 * q * seq / 2


@pytest.mark.parametrize("model", [PLAN_HYBRID, PLAN_MOE])
def test_mfu_counts_the_mtp_layer_as_its_matmuls(model):
    """The training log's count (``flops.token_flops``, MFU and HFU) and the planner's step time count the MTP
    layer: 3x its forward in the model count, and under full recompute its decoder layer's forward once more
    (fc and the head pass are not recomputed; nor is a dense MLP's down projection, whose output backward
    does not need: torch's checkpoint stops before it)."""
    from qwen3_pretrain.models.qwen3.config import Qwen3Config
    from qwen3_pretrain.plan.flops import token_flops

    cfg, seq = Qwen3Config(**model), 512
    forward = _mtp_forward_flops(cfg, seq)
    without, with_mtp = token_flops(cfg, seq, "full"), token_flops(cfg, seq, "full", mtp=True)
    assert with_mtp.model - without.model == pytest.approx(3 * forward, rel=1e-12)
    not_rerun = 2 * (2 * cfg.hidden_size ** 2 + cfg.vocab_size * cfg.hidden_size)
    not_rerun += 0 if cfg.num_experts else 2 * cfg.hidden_size * cfg.intermediate_size
    assert with_mtp.hardware - without.hardware == pytest.approx(4 * forward - not_rerun, rel=1e-12)


def test_mtp_share_of_a_released_hybrids_flops():
    """Qwen3.5-9B at seq 4096: the MTP layer is a tenth or more of the trained FLOPs (the issue's 10-17%)."""
    from qwen3_pretrain.models.qwen3.config import get_preset
    from qwen3_pretrain.plan.flops import token_flops

    cfg = get_preset("qwen3.5-9b")
    without, with_mtp = token_flops(cfg, 4096), token_flops(cfg, 4096, mtp=True)
    assert 0.08 < 1 - without.model / with_mtp.model < 0.2


def _layout(dtype: torch.dtype, mtp: bool, **kwargs):
    from qwen3_pretrain.plan.layout import Layout

    return Layout(mixed_precision="bf16" if dtype == torch.bfloat16 else "fp32", device_type="cpu", mtp=mtp,
                  activation_checkpointing="none", **kwargs)


@pytest.mark.parametrize("model", [PLAN_HYBRID, PLAN_MOE])
def test_planner_counts_the_mtp_layers_parameters_gradients_and_optimizer_state(model):
    """The real MTP layer's parameters (fc, norms, decoder layer, every expert) on the head's stage, their
    fp32 master copy, gradient and AdamW moments; nothing on the other stages."""
    from qwen3_pretrain.models.qwen3.config import Qwen3Config
    from qwen3_pretrain.plan import memory
    from qwen3_pretrain.plan.layout import stage_shapes

    cfg = Qwen3Config(**model)
    real = sum(p.numel() for p in Qwen3Model(cfg, ModelOptions(multi_token_prediction=True)).mtp.parameters())
    for pp in (1, 2):
        base, with_mtp = _layout(torch.bfloat16, False, pp=pp), _layout(torch.bfloat16, True, pp=pp)
        for shape in stage_shapes(cfg, base):
            extra = real if shape.has_head else 0
            assert memory.stage_params(cfg, with_mtp, shape).total - memory.stage_params(cfg, base, shape).total \
                == extra
            step = [memory._moments(cfg, lay, shape)["optimizer step"] for lay in (base, with_mtp)]
            assert step[1]["optimizer"] - step[0]["optimizer"] == 8 * extra  # AdamW's two fp32 moments
            assert step[1]["gradients"] - step[0]["gradients"] == 4 * extra
            assert step[1]["parameters"] - step[0]["parameters"] == 4 * extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_counts_what_the_mtp_layer_saves_for_backward(dtype):
    """Counted by saved-tensor hooks on the real MTP layer and its pass of the fused loss (parameters and the
    RoPE tables excluded; its inputs, the next tokens' embeddings and the final hidden states, counted: only
    it keeps them): what the planner adds per micro-batch, plus the per-call tensors it leaves out (each
    zero-centred norm's fp32 ``1 + weight``, the q/k norms' scales) and the head's weight gradient its loss
    pass keeps, which the planner adds at the loss."""
    from qwen3_pretrain.models.qwen3.config import Qwen3Config
    from qwen3_pretrain.models.qwen3.model import rope_cos_sin
    from qwen3_pretrain.plan import memory
    from qwen3_pretrain.plan.layout import stage_shapes

    cfg, seq = Qwen3Config(**PLAN_HYBRID), 128
    h, d = cfg.hidden_size, dtype.itemsize
    model = Qwen3Model(cfg, ModelOptions(multi_token_prediction=True, loss_head=LossHead(chunk_tokens=64))).to(dtype)
    embeds, hidden = (torch.randn(1, seq, h, dtype=dtype, requires_grad=True) for _ in range(2))
    cos, sin = rope_cos_sin(torch.arange(seq)[None], cfg.rotary_dim, cfg.rope_theta, dtype)
    outside = {t.untyped_storage()._cdata for t in [*model.parameters(), cos, sin]}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage()._cdata not in outside:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.lm_head(model.mtp(embeds, hidden, cos, sin, None), torch.randint(0, cfg.vocab_size, (1, seq)))
    per_call = 5 * 4 * h + 2 * 4 * cfg.head_dim  # five zero-centred norms, the q and k norms
    head_grad = d * cfg.vocab_size * h
    base, with_mtp = _layout(dtype, False, seq_length=seq), _layout(dtype, True, seq_length=seq)
    shape = stage_shapes(cfg, base)[-1]
    planned = memory._microbatch_activations(cfg, with_mtp, shape) - memory._microbatch_activations(cfg, base, shape)
    assert sum(saved.values()) == planned + per_call + head_grad
    loss = [memory._moments(cfg, lay, shape)["loss"]["logits"] for lay in (base, with_mtp)]
    assert loss[1] - loss[0] == head_grad
