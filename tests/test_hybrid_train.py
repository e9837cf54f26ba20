"""A hybrid (Qwen3.5: Gated DeltaNet and gated full-attention layers) trains the same in every parallel
layout as in one process, on packed documents, and one process matches a plain ``transformers`` loop.

Every run starts from the same HF directory written by ``transformers`` (a tiny ``Qwen3_5ForCausalLM`` with
tied embeddings, layers [linear, full, linear, full] so each of two pipeline stages holds one of each) and
trains 5 steps of global batch 4 with document masking: each packed document is computed as if alone, in
the Gated DeltaNet layers (state and convolution restart) as in attention.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._reference_loop import train_with_transformers
from tests._train_helpers import FP32_LOSS_RTOL, assert_same_training, check_ok, make_corpus, run_train, step_records, write_config
from tests._train_runs import GLOBAL_BATCH, OPTIMIZER, TOTAL_STEPS

TINY_HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
                   max_position_embeddings=256, layer_types=["linear_attention", "full_attention"] * 2,
                   bos_token_id=0, eos_token_id=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})

# name -> (processes, overrides); global batch 4 each
LAYOUTS = {
    "single": (1, ["gradient_accumulation_steps=2"]),
    "single-no-document-mask": (1, ["gradient_accumulation_steps=2", "document_mask=false"]),
    "dp2": (2, []),
    "pp2": (2, ["pp=2", "gradient_accumulation_steps=2"]),
    "tp2": (2, ["tp=2", "gradient_accumulation_steps=2"]),
    "cp2": (2, ["cp=2", "gradient_accumulation_steps=2"]),
    # tp x cp splitting the Gated DeltaNet heads twice: 4 key heads (8 value heads) in place of 2
    "single-wide": (1, ["gradient_accumulation_steps=2"]),
    "cp2-tp2-wide": (4, ["cp=2", "tp=2", "gradient_accumulation_steps=2"]),
    # selective recompute: the delta rule (and attention's kernel call) run again in backward
    "single-ac-selective": (1, ["gradient_accumulation_steps=2", "activation_checkpointing=selective"]),
    # the multi-token-prediction layer trained beside (from a checkpoint that ships one)
    "single-mtp": (1, ["gradient_accumulation_steps=2", "mtp_loss_weight=0.1"]),
    # each layout class once: FSDP, cp, and tp with pp, which covers tp 2 and pp 2 alone (the MTP layer's tp
    # plan, parallel/tensor_parallel.py, on the last stage; the next tokens' embeddings down the pipeline)
    "dp2-mtp": (2, ["mtp_loss_weight=0.1"]),
    "cp2-mtp": (2, ["cp=2", "gradient_accumulation_steps=2", "mtp_loss_weight=0.1"]),
    "tp2-pp2-mtp": (4, ["tp=2", "pp=2", "gradient_accumulation_steps=2", "mtp_loss_weight=0.1"]),
    # Qwen3.5-MoE (every layer's MLP a mixture of 4 experts, top 2, with a gated shared expert), balanced by
    # the global-batch loss (one global micro-batch of 4 samples in both); its experts over 2 ranks
    "single-moe": (1, ["batch_size=4", "moe_aux_loss=global_batch"]),
    "dp2-ep2-moe": (2, ["batch_size=2", "ep=2", "moe_aux_loss=global_batch"]),
    # ep borrowing the tp ranks: the MoE layers, shared expert included, on each tp rank's share of the tokens
    "tp2-ep2-moe": (2, ["batch_size=4", "tp=2", "ep=2", "moe_aux_loss=global_batch"]),
    # Qwen3-Next: the fused, per-key-head grouped projections, under cp's head split and tp
    "single-next": (1, ["gradient_accumulation_steps=2"]),
    "cp2-next": (2, ["cp=2", "gradient_accumulation_steps=2"]),
    "tp2-next": (2, ["tp=2", "gradient_accumulation_steps=2"]),
    # with its MTP layer trained (a MoE layer too, its experts split as the others')
    "single-moe-mtp": (1, ["batch_size=4", "moe_aux_loss=global_batch", "mtp_loss_weight=0.1"]),
    "dp2-ep2-moe-mtp": (2, ["batch_size=2", "ep=2", "moe_aux_loss=global_batch", "mtp_loss_weight=0.1"]),
}
TINY_HYBRID_MOE = dict({k: v for k, v in TINY_HYBRID.items() if k != "intermediate_size"}, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


class HybridRuns:
    def __init__(self, root) -> None:
        self.root = root
        self._done: dict = {}

    @functools.cached_property
    def corpus(self):
        return make_corpus(self.root / "corpus")

    @functools.cached_property
    def hf_init(self):
        import transformers

        torch.manual_seed(0)
        path = self.root / "hf_init"
        transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TINY_HYBRID)).save_pretrained(path)
        return path

    @functools.cached_property
    def hf_init_wide(self):
        import transformers

        torch.manual_seed(0)
        path = self.root / "hf_init_wide"
        config = transformers.Qwen3_5TextConfig(**dict(TINY_HYBRID, linear_num_key_heads=4, linear_num_value_heads=8))
        transformers.Qwen3_5ForCausalLM(config).save_pretrained(path)
        return path

    @functools.cached_property
    def hf_init_moe(self):
        import transformers

        torch.manual_seed(0)
        path = self.root / "hf_init_moe"
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TINY_HYBRID_MOE))
        with torch.no_grad():  # decisive routing: no near-tie for summation order to flip between layouts
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.mul_(50)
        model.save_pretrained(path)
        return path

    @functools.cached_property
    def hf_init_mtp(self):
        """The same weights, plus an MTP layer (mtp.*) as the released checkpoints ship one."""
        return self._with_mtp(self.hf_init, "hf_init_mtp", seed=3)

    @functools.cached_property
    def hf_init_next(self):
        import transformers

        torch.manual_seed(0)
        path = self.root / "hf_init_next"
        config = transformers.Qwen3NextConfig(**dict(TINY_HYBRID_MOE, intermediate_size=96, mlp_only_layers=[1]))
        transformers.Qwen3NextForCausalLM(config).save_pretrained(path)
        return path

    @functools.cached_property
    def hf_init_moe_mtp(self):
        return self._with_mtp(self.hf_init_moe, "hf_init_moe_mtp", seed=4)

    def _with_mtp(self, source, name: str, seed: int):
        """A copy of ``source`` with an MTP layer added."""
        import shutil

        from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointReader
        from tests.test_hybrid_parity import _with_mtp

        path = self.root / name
        shutil.copytree(source, path)
        _with_mtp(path, HFCheckpointReader(path).config, seed=seed)
        return path

    def records(self, name: str) -> list[dict]:
        if name not in self._done:
            nproc, overrides = LAYOUTS[name]
            run = self.root / name
            run.mkdir()
            # the initial model named by the layout's suffix (made only when first asked for)
            suffix = "moe_mtp" if name.endswith("-moe-mtp") else name.rsplit("-", 1)[-1]
            init = getattr(self, f"hf_init_{suffix}") if suffix in ("mtp", "moe", "next", "wide", "moe_mtp") \
                else self.hf_init
            config = write_config(run / "c.yaml", self.corpus, run / "out", model_name="tiny-qwen3.5",
                                  model_path=str(init), model_overrides={}, document_mask=True, **OPTIMIZER)
            check_ok(run_train(config, nproc, *overrides, timeout=600))
            self._done[name] = step_records(run / "out")
        return self._done[name]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    return HybridRuns(tmp_path_factory.mktemp("hybrid"))


def test_one_process_without_document_mask_matches_a_plain_transformers_loop(hybrid_runs):
    """transformers' Qwen3.5 runs every row as one sequence (its kernels take no document boundaries): so
    does the trainer without document masking, through its own Gated DeltaNet kernel."""
    want = train_with_transformers(hybrid_runs.hf_init, hybrid_runs.corpus, OPTIMIZER, TOTAL_STEPS, GLOBAL_BATCH)
    got = hybrid_runs.records("single-no-document-mask")
    assert_same_training(got, want, label="hybrid one process vs transformers loop")
    assert got[-1]["loss"] < got[0]["loss"]


def test_document_mask_changes_the_hybrid(hybrid_runs):
    """The packed documents' boundaries matter: with the mask the losses differ from without it."""
    masked, plain = hybrid_runs.records("single"), hybrid_runs.records("single-no-document-mask")
    assert abs(masked[-1]["loss"] - plain[-1]["loss"]) > 10 * FP32_LOSS_RTOL * plain[-1]["loss"]


def test_selective_recompute_replays_the_delta_rule_exactly(hybrid_runs):
    assert_same_training(hybrid_runs.records("single-ac-selective"), hybrid_runs.records("single"), 1e-6, 1e-6,
                         label="hybrid selective recompute")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2", "pp2", "tp2", "cp2", "cp2-tp2-wide"])
def test_hybrid_layout_matches_single_process(name, hybrid_runs):
    """Under tp the Gated DeltaNet heads are split over the tp ranks, under cp over the cp ranks, under both
    over tp x cp (each tp rank's share split again)."""
    single = "single-wide" if name.endswith("-wide") else "single"
    assert_same_training(hybrid_runs.records(name), hybrid_runs.records(single), label=f"hybrid {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2-ep2-moe", "tp2-ep2-moe", "dp2-ep2-moe-mtp"])
def test_hybrid_moe_with_expert_parallelism_matches_single_process(name, hybrid_runs):
    got, want = hybrid_runs.records(name), hybrid_runs.records(name.replace("dp2-ep2", "single").replace(
        "tp2-ep2", "single"))
    assert_same_training(got, want, label=f"hybrid {name}")
    assert_same_training([{**r, "loss": r["moe_aux_loss"]} for r in got],
                         [{**r, "loss": r["moe_aux_loss"]} for r in want], label=f"hybrid {name} aux loss")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["cp2-next", "tp2-next"])
def test_qwen3_next_layout_matches_single_process(name, hybrid_runs):
    """Qwen3-Next's fused projections (q, k, v, z and b, a grouped per key head) under cp's head split (its
    convolution rows and decay parameters sliced to the rank's heads) and tp; a MoE model with a dense layer."""
    assert_same_training(hybrid_runs.records(name), hybrid_runs.records("single-next"), label=f"qwen3-next {name}")


def test_multi_token_prediction_trains_beside_the_model(hybrid_runs):
    """With mtp_loss_weight the MTP loss is logged and falls, and its gradient reaches the shared weights: the
    LM losses move away from the run without it."""
    with_mtp, without = hybrid_runs.records("single-mtp"), hybrid_runs.records("single")
    assert all("mtp_loss" in r for r in with_mtp) and not any("mtp_loss" in r for r in without)
    assert with_mtp[0]["loss"] == pytest.approx(without[0]["loss"], rel=1e-6)  # same model, same batch
    assert with_mtp[-1]["mtp_loss"] < with_mtp[0]["mtp_loss"]
    assert abs(with_mtp[-1]["loss"] - without[-1]["loss"]) > 10 * FP32_LOSS_RTOL * without[-1]["loss"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2-mtp", "cp2-mtp", "tp2-pp2-mtp"])
def test_multi_token_prediction_layout_matches_single_process(name, hybrid_runs):
    got, want = hybrid_runs.records(name), hybrid_runs.records("single-mtp")
    assert_same_training(got, want, label=f"hybrid {name}")
    assert_same_training([{**r, "loss": r["mtp_loss"]} for r in got], [{**r, "loss": r["mtp_loss"]} for r in want],
                         label=f"hybrid {name} mtp_loss")


def _multimodal_checkpoint(path):
    """A tiny ``Qwen3_5ForConditionalGeneration`` as transformers saves it, plus an MTP layer's tensors in the
    file as the released checkpoints ship them (transformers neither makes nor loads those)."""
    import transformers
    from safetensors.torch import load_file, save_file

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    torch.manual_seed(1)
    config = transformers.Qwen3_5Config(text_config=dict(TINY_HYBRID), vision_config=vision,
                                        tie_word_embeddings=True)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(path)
    from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointReader
    from tests.test_hybrid_parity import _with_mtp

    _with_mtp(path, HFCheckpointReader(path).config, seed=2)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"].to(torch.bfloat16)  # a dtype of its own, kept
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_continuing_a_multimodal_checkpoint_keeps_what_it_does_not_train(tmp_path):
    """Trained from a Qwen3.5 multimodal checkpoint (text under model.language_model., a vision tower, an MTP
    layer), then merged: transformers loads the result as the same class; the vision and MTP tensors are
    bit-identical (dtypes too), the text model's weights are the trained ones."""
    import transformers
    from safetensors import safe_open

    from qwen3_pretrain.checkpoint.merge import merge_checkpoint

    source = _multimodal_checkpoint(tmp_path / "source")
    config = write_config(tmp_path / "c.yaml", make_corpus(tmp_path / "corpus", num_docs=40), tmp_path / "out",
                          model_name="tiny-qwen3.5-vl", model_path=str(source), model_overrides={}, total_steps=2,
                          document_mask=True)
    proc = run_train(config, 1)
    check_ok(proc)
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        visual = sum(n.startswith("model.visual.") for n in f.keys())
        mtp = sum(n.startswith("mtp.") for n in f.keys())
    assert f"carried unchanged, not trained: {visual + mtp} tensors" in proc.stdout
    assert f"(model.visual.* {visual}, mtp.* {mtp})" in proc.stdout
    merged = merge_checkpoint(tmp_path / "out", tmp_path / "merged", "tiny-qwen3.5-vl", dtype=torch.float32,
                              progress=False).output_path
    model = transformers.AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32)
    assert type(model) is transformers.Qwen3_5ForConditionalGeneration
    with safe_open(str(source / "model.safetensors"), "pt") as before, \
            safe_open(str(merged / "model.safetensors"), "pt") as after:
        assert set(after.keys()) == set(before.keys())
        for name in before.keys():
            a, b = before.get_tensor(name), after.get_tensor(name)
            if name.startswith(("model.visual.", "mtp.")):
                assert a.dtype == b.dtype and torch.equal(a, b), name
        embed = "model.language_model.embed_tokens.weight"
        assert not torch.equal(before.get_tensor(embed), after.get_tensor(embed))


def test_a_trained_multi_token_prediction_layer_is_merged_back(hybrid_runs, tmp_path):
    """The trained MTP layer goes into the merged model under the checkpoint's names (mtp.*), changed by
    training; the merged model still loads in transformers, which leaves mtp.* aside."""
    import transformers
    from safetensors import safe_open

    from qwen3_pretrain.checkpoint.merge import merge_checkpoint

    hybrid_runs.records("single-mtp")
    merged = merge_checkpoint(hybrid_runs.root / "single-mtp" / "out", tmp_path / "merged", "tiny-qwen3.5",
                              dtype=torch.float32, progress=False).output_path
    with safe_open(str(hybrid_runs.hf_init_mtp / "model.safetensors"), "pt") as before, \
            safe_open(str(merged / "model.safetensors"), "pt") as after:
        mtp = sorted(n for n in before.keys() if n.startswith("mtp."))
        assert mtp and sorted(n for n in after.keys() if n.startswith("mtp.")) == mtp
        assert not torch.equal(before.get_tensor("mtp.fc.weight"), after.get_tensor("mtp.fc.weight"))
    assert type(transformers.AutoModelForCausalLM.from_pretrained(merged)) is transformers.Qwen3_5ForCausalLM
