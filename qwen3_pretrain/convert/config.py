"""The data conversion config (``pretain_data_config.yaml``): the reference workflow's keys and this
project's, each with its help text (the configuration reference is generated from it)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from qwen3_pretrain.config.loader import field_help
from qwen3_pretrain.errors import ConfigError


@dataclasses.dataclass
class DataConvertConfig:
    """The data conversion config (``pretain_data_config.yaml``)."""

    input_path: str = field_help(help="parquet or JSON-lines file (.jsonl, also .gz/.zst), a folder of them "
                                      "(searched recursively) or a glob")
    tokenizer_path: str = field_help(help="folder holding tokenizer.json (a HuggingFace model folder) or the file")
    output_path: str = field_help(help="folder for shard_NNNNN.bin/.idx and manifest.json (created if missing)")
    seq_length: int = field_help(8192, help="training sequence length the data is meant for (recorded in the "
                                            "manifest; samples are packed at training time, so the shards serve "
                                            "any seq_length: training at another one logs a note)")
    shards: int = field_help(16, help="number of output shards; documents are spread so tokens balance "
                                         "(on several ranks each shard is written as one piece per rank)")
    do_lower_case: bool = field_help(False, help="lower-case the text before tokenizing")
    max_doc_length: int = field_help(100000, help="longest sequence, in tokens (end-of-document token not "
                                                  "counted); a longer document is split into consecutive "
                                                  "sequences of at most this many tokens, none dropped")
    chunk_size: int = field_help(5000, help="most documents per unit of parallel work")
    chunk_bytes: int = field_help(1 << 20, help="most bytes of text per unit of parallel work: a unit ends at "
                                                "chunk_size documents or chunk_bytes bytes, whichever comes "
                                                "first, so every worker gets a share of any input")
    workers: int = field_help(0, help="tokenizing processes; 0 = all available cores")
    text_column: str = field_help("text", help="parquet column (or JSON-lines key) holding the document text")
    append_eod: bool = field_help(True, help="end every document with the end-of-document token "
                                             "(<|endoftext|>, id 151643 for Qwen3)")
    master_addr: str = field_help("127.0.0.1", help="under mpirun with several ranks: host name or address of the "
                                                    "node running rank 0 (torchrun exports its own)")
    master_port: int = field_help(29500, help="under mpirun with several ranks: TCP port rank 0 listens on")
    rank_timeout_s: int = field_help(600, help="with several ranks: a rank that shows no progress for this "
                                               "many seconds while others wait for it stops the run, named in "
                                               "the error (a rank done early waits as long as the others keep "
                                               "making progress)")
    tokenizer_backend: Literal["auto", "fast", "reference"] = field_help(
        "auto", help="fast (tiktoken, exact), reference (the tokenizers library) or auto (fast when it "
                     "can be exact for this tokenizer, else reference)")

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value cannot work."""
        minimums = {"seq_length": (2, "a training sample needs at least 2 tokens"),
                    "shards": (1, "at least one shard is needed"),
                    "chunk_size": (1, "a unit holds at least one document"),
                    "chunk_bytes": (1, "a unit holds at least one byte"),
                    "max_doc_length": (1, "a sequence holds at least one token"),
                    "workers": (0, "0 means all cores"),
                    "rank_timeout_s": (1, "a wait needs a limit")}
        for key, (minimum, why) in minimums.items():
            value = getattr(self, key)
            if value < minimum:
                raise ConfigError(f"{key}: {value} is too small; give at least {minimum} ({why})")
        for key in ("input_path", "tokenizer_path", "output_path", "text_column"):
            if not str(getattr(self, key)).strip():
                raise ConfigError(f"{key}: is empty; give a value")
