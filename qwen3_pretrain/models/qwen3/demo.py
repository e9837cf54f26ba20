"""``qwen3-pretrain demo``: the model and HF weight I/O end to end, in seconds on a CPU.

Builds a tiny random Qwen3 with the real 151,936-entry vocabulary, saves it in
HuggingFace format (with the tokenizer, so the directory is a complete HF
model), loads it back and checks the reloaded logits equal the in-memory
model's bit for bit (the demo saves fp32 so no rounding is expected).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer

from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.errors import MissingFileError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.hf_io import load_hf_model, save_hf_model
from qwen3_pretrain.models.qwen3.model import Qwen3Model

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TOKENIZER = REPO_ROOT / "assets" / "qwen3-tokenizer"
PROMPT = "The quick brown fox jumps over the lazy dog."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def tiny_config() -> Qwen3Config:
    """Qwen3 layout (GQA, q/k norms, head_dim != hidden / heads, tied head) at toy width."""
    return Qwen3Config(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, max_position_embeddings=4096)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = CommandParser("demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/demo/tiny-qwen3"),
                        help="HF model directory to write (replaced if it holds a previous model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                        help="directory with the Qwen3 tokenizer.json (default: the bundled copy)")
    return parser.parse_args(argv)


def tokenize(tokenizer_dir: Path, text: str) -> torch.Tensor:
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise MissingFileError(f"{path}: no tokenizer.json; pass --tokenizer DIR with the Qwen3 tokenizer files")
    ids = Tokenizer.from_file(str(path)).encode(text).ids
    return torch.tensor([ids])  # [batch=1, seq]


def checksum(logits: torch.Tensor) -> str:
    first = ", ".join(f"{v:.6f}" for v in logits.flatten()[:4].tolist())
    return f"sum={logits.double().sum().item():.6f} first=[{first}]"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    ids = tokenize(args.tokenizer, PROMPT)
    model = Qwen3Model(tiny_config())
    model.init_weights(seed=args.seed)
    side_files = [args.tokenizer / f for f in TOKENIZER_FILES if (args.tokenizer / f).is_file()]
    save_hf_model(model, args.output, dtype=torch.float32, extra_files=side_files)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"saved a tiny random Qwen3 ({num_params / 1e6:.2f}M parameters, tied embeddings) to {args.output}")
    print(f"prompt: {PROMPT!r} -> {ids.shape[1]} tokens {ids[0].tolist()}")

    with torch.no_grad():
        expected = model(ids)
        reloaded = load_hf_model(args.output, dtype=torch.float32)(ids)
    equal = torch.equal(expected, reloaded)
    print(f"logits shape: {list(reloaded.shape)}")
    print(f"checksum: {checksum(reloaded)}")
    print(f"reloaded logits equal the in-memory model's: {'yes (bit-exact)' if equal else 'NO'}")
    return 0 if equal else 1
