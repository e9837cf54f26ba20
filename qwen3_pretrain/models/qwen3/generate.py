"""``qwen3-pretrain generate``: continue a prompt with a HuggingFace-format Qwen3 model, on the CPU.

    qwen3-pretrain generate --model runs/quickstart/w_pretrain_merged \\
        --prompt "The history of" --max_new_tokens 32

Loads the directory with the project's own loader (no ``transformers``) and
its ``tokenizer.json`` with the ``tokenizers`` library, then decodes greedily
(``--top_k 0``, the default) or samples from the ``top_k`` most likely tokens.
There is no KV cache: each new token runs the model over the whole sequence,
which is fine for the short continuations used to eyeball a checkpoint.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.models.qwen3.hf_io import check_not_training_output, load_hf_model
from qwen3_pretrain.models.qwen3.model import Qwen3Model

# The pre-training document separator: a model trained on packed documents emits it where a text ends.
ENDOFTEXT = "<|endoftext|>"


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen."""

    max_new_tokens: int = 32  # tokens to add at most (fewer when a stop token comes first)
    top_k: int = 0  # 0: greedy (the most likely token); k > 0: sample among the k most likely
    temperature: float = 1.0  # divides the logits before top-k sampling; ignored when greedy
    seed: int = 0  # seed of the sampling generator, so a sampled continuation is reproducible

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max_new_tokens {self.max_new_tokens}: give at least 1")
        if self.top_k < 0:
            raise UserError(f"--top_k {self.top_k}: give 0 (greedy) or a positive number of candidates")
        if self.temperature <= 0:
            raise UserError(f"--temperature {self.temperature}: give a positive number (1.0 leaves the "
                            "logits unchanged; use --top_k 0 for greedy decoding)")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The ``tokenizer.json`` of ``directory`` (a HF model directory or a tokenizer directory)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise MissingFileError(f"{path}: no tokenizer.json; pass --tokenizer DIR with the Qwen3 tokenizer "
                               "(e.g. assets/qwen3-tokenizer), or merge with --tokenizer_path so the model "
                               "directory holds one")
    return Tokenizer.from_file(str(path))


def stop_ids(model: Qwen3Model, tokenizer: Tokenizer) -> set[int]:
    """Token ids that end a continuation: the model's eos and the document separator."""
    ids = {model.config.eos_token_id} - {None}
    endoftext = tokenizer.token_to_id(ENDOFTEXT)
    if endoftext is not None:
        ids.add(endoftext)
    return ids


def next_token_logits(model: Qwen3Model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [vocab] of the token after ``ids`` [seq], computing the LM head for the last position only."""
    window = ids[-model.config.max_position_embeddings:]
    hidden, _ = model.hidden_states(window[None])  # [1, seq, hidden]
    return model.lm_head(hidden[0, -1]).float()


def choose(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """The next token id: argmax when greedy, else a draw among the ``top_k`` most likely."""
    if sampling.top_k == 0:
        return int(logits.argmax())
    values, indices = torch.topk(logits / sampling.temperature, min(sampling.top_k, logits.numel()))
    pick = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)
    return int(indices[pick])


@torch.no_grad()
def generate(model: Qwen3Model, prompt_ids: list[int], sampling: SamplingConfig,
             stop: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The new token ids after ``prompt_ids`` (without the prompt), ending with a stop id if one came."""
    sampling.validate()
    if not prompt_ids:
        raise UserError("the prompt encodes to no tokens; give a non-empty --prompt")
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(sampling.seed)
    new: list[int] = []
    model.eval()
    for _ in range(sampling.max_new_tokens):
        token = choose(next_token_logits(model, ids), sampling, generator)
        new.append(token)
        if token in stop:
            break
        ids = torch.cat([ids, torch.tensor([token])])
    return new


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = CommandParser("generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path,
                        help="HF model directory (config.json + safetensors), e.g. the output of merge")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=32,
                        help="tokens to generate at most (default 32)")
    parser.add_argument("--top_k", "--top-k", type=int, default=0,
                        help="0: greedy decoding (default); k > 0: sample among the k most likely tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="directory holding tokenizer.json (default: the model directory)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Print the prompt and its continuation, then one line of timing."""
    args = parse_args(argv)
    sampling = SamplingConfig(args.max_new_tokens, args.top_k, args.temperature, args.seed)
    sampling.validate()
    if not args.model.is_dir():
        raise MissingFileError(f"--model {args.model}: no such directory; give a HF model directory "
                               "(e.g. the output_path of 'qwen3-pretrain merge')")
    check_not_training_output(args.model)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    model = load_hf_model(args.model, dtype=torch.float32)
    prompt_ids = tokenizer.encode(args.prompt).ids
    start = time.perf_counter()
    new = generate(model, prompt_ids, sampling, stop_ids(model, tokenizer))
    secs = time.perf_counter() - start
    mode = "greedy" if sampling.top_k == 0 else f"top-{sampling.top_k} sampling, T={sampling.temperature:g}"
    print(f"prompt ({len(prompt_ids)} tokens): {args.prompt!r}")
    print(f"continuation ({len(new)} tokens, {mode}): {tokenizer.decode(new, skip_special_tokens=False)!r}")
    print(f"generated {len(new)} tokens in {secs:.2f} s ({len(new) / max(secs, 1e-9):.1f} tokens/s) "
          f"with {args.model}")
    return 0
