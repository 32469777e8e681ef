"""Golden KV-event payloads of the 2026 features, encoded by the engines' own event classes.

Writes ``tests/kvevents/data/kv_event_payloads_2026.json`` (the format of
``kv_event_payloads.json``: engine, version, note, payload_hex, generic decode) from the
released wheels of vLLM 0.33.0 and SGLang 0.5.23:

    python -m venv /tmp/golden && /tmp/golden/bin/pip install msgspec
    pip download --no-deps vllm==0.33.0 sglang==0.5.23 -d /tmp/wheels
    /tmp/golden/bin/python tools/gen_golden_2026.py --wheels /tmp/wheels

Only ``msgspec`` is needed: the event modules (``vllm/distributed/kv_events.py``,
``sglang/srt/disaggregation/kv_events.py``) are read from the wheels and cut down (with
``ast``) to their msgspec structs and hash-namespace helpers, which import nothing else; the
batches are encoded with ``msgspec.msgpack.Encoder`` exactly as both publishers do. The
event *contents* follow the engines' emitters, read from the same wheels:

- vLLM EAGLE lookahead (``v1/core/block_pool.py::cache_full_blocks``): ``token_ids`` are the
  blocks' tokens, ``lookahead_token_ids`` one list of the next L tokens per block, and the
  block hash is ``H((parent, block tokens, (extra, *next L tokens)))``
  (``v1/core/kv_cache_utils.py::get_request_block_hasher``) — the hashes here are real
  (sha256 over pickle, default seed; the script checks the spec's plain vector first);
- SGLang EAGLE (``srt/mem_cache/events.py::record_store``): a bigram radix key publishes
  each page's ``token_ids`` as pairs ``(raw[j], raw[j+1])`` and ``block_size`` = pairs per
  page; consecutive pages of a node coalesce into one event. SGLang hashes bigram pages with
  its native page hash, which needs its compiled extension: the hashes here are opaque ids;
- vLLM hybrid models (``v1/core/kv_cache_manager.py`` fills ``kv_cache_spec_kind`` and
  ``kv_cache_spec_sliding_window`` per group): every KV-cache group publishes its own
  stores and removals of the same request block hashes, with its ``group_idx``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pickle
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import msgspec

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
_VLLM_MODULE = "vllm/distributed/kv_events.py"
_SGLANG_MODULE = "sglang/srt/disaggregation/kv_events.py"
_KEEP_CLASSES = {"EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved",
                 "AllBlocksCleared", "KVEventBatch", "StorageMedium"}
_KEEP_FUNCTIONS = {"kv_event_namespace_seed", "namespaced_block_hash"}
_KEEP_IMPORTS = {"msgspec", "enum", "hashlib", "typing"}
_TS = 1_700_000_000.25
_OUT = Path(__file__).resolve().parents[1] / "tests/kvevents/data/kv_event_payloads_2026.json"


def _module_source(wheels: Path, pattern: str, member: str) -> str:
    found = sorted(wheels.glob(pattern))
    if not found:
        raise SystemExit(f"no wheel matching {pattern} in {wheels}")
    with zipfile.ZipFile(found[-1]) as wheel:
        return wheel.read(member).decode()


def _event_classes(source: str) -> dict[str, Any]:
    """Exec only the module's structs, enums and hash helpers (they import msgspec only)."""
    tree = ast.parse(source)
    kept: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Import) and all(a.name in _KEEP_IMPORTS for a in node.names):
            kept.append(node)
        elif isinstance(node, ast.ImportFrom) and node.module in _KEEP_IMPORTS:
            kept.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in _KEEP_CLASSES:
            kept.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name in _KEEP_FUNCTIONS:
            kept.append(node)
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and (t.id.startswith("MEDIUM_") or t.id.startswith("_NAME"))
            for t in node.targets
        ):
            kept.append(node)
    namespace: dict[str, Any] = {"ExternalBlockHash": bytes | int,
                                 "__name__": "engine_events"}
    exec(compile(ast.Module(body=kept, type_ignores=[]), "<engine events>", "exec"), namespace)
    return namespace


# ---- vLLM's block hash (sha256 over pickle protocol 5, default seed) -------------------------

def _vllm_h(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


_VLLM_NONE_HASH = _vllm_h("vllm-none-hash")


def _vllm_chain(tokens: list[int], size: int, lookahead: int, parent: bytes | None = None
                ) -> list[bytes]:
    """Digests of the full blocks of ``tokens`` whose next ``lookahead`` tokens exist."""
    out: list[bytes] = []
    prev = parent or _VLLM_NONE_HASH
    start = 0
    while start + size + lookahead <= len(tokens):
        end = start + size
        if lookahead == 0:
            extra: object = None
        elif lookahead == 1:
            extra = (None, tokens[end])
        else:
            extra = (None, *tokens[end:end + lookahead])
        prev = _vllm_h((prev, tuple(tokens[start:end]), extra))
        out.append(prev)
        start = end
    return out


def _int(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & (2**64 - 1)


def _check_vllm_hash() -> None:
    plain = [_int(d) for d in _vllm_chain(list(range(1, 33)), 16, 0)]
    if plain != [1403909460543360175, 1643945449041937783]:  # kv-events.md §3 vectors
        raise SystemExit(f"vLLM hash replica disagrees with the spec vectors: {plain}")


# ---- cases --------------------------------------------------------------------------------

def _vllm_cases(ev: dict[str, Any]) -> list[tuple[str, object]]:
    stored, removed, cleared = ev["BlockStored"], ev["BlockRemoved"], ev["AllBlocksCleared"]
    batch = ev["KVEventBatch"]
    cases: list[tuple[str, object]] = []

    # EAGLE lookahead L=1: a 50-token prompt has three hashed blocks (block 2 ends at token
    # 48; its lookahead token, the 49th, exists). Stored in two steps, then block 2 evicted.
    prompt = list(range(1, 51))
    digests = _vllm_chain(prompt, 16, 1)
    first = stored(block_hashes=[_int(d) for d in digests[:2]], parent_block_hash=None,
                   token_ids=prompt[:32], block_size=16, lora_id=None, medium="GPU",
                   lora_name=None, extra_keys=[None, None], group_idx=0,
                   kv_cache_spec_kind="full_attention",
                   lookahead_token_ids=[prompt[16:17], prompt[32:33]])
    more = stored(block_hashes=[_int(digests[2])], parent_block_hash=_int(digests[1]),
                  token_ids=prompt[32:48], block_size=16, lora_id=None, medium="GPU",
                  lora_name=None, extra_keys=[None], group_idx=0,
                  kv_cache_spec_kind="full_attention", lookahead_token_ids=[prompt[48:49]])
    gone = removed(block_hashes=[_int(digests[2])], medium="GPU", group_idx=0)
    cases.append(("EAGLE lookahead L=1 (EAGLE-family drafter): tokens 1..50, block 16; block"
                  " hashes are vLLM's real sha256 hashes with extra keys (None, next token)",
                  batch(ts=_TS, events=[first, more, gone], data_parallel_rank=0)))

    # Multi-module MTP: L = num_speculative_tokens = 2.
    digests2 = _vllm_chain(prompt, 16, 2)
    mtp = stored(block_hashes=[_int(d) for d in digests2], parent_block_hash=None,
                 token_ids=prompt[:48], block_size=16, lora_id=None, medium="GPU",
                 lora_name=None, extra_keys=[None, None, None], group_idx=0,
                 kv_cache_spec_kind="full_attention",
                 lookahead_token_ids=[prompt[16:18], prompt[32:34], prompt[48:50]])
    cases.append(("multi-module MTP lookahead L=2: tokens 1..50, block 16; real vLLM hashes"
                  " with extra keys (None, t, t')",
                  batch(ts=_TS, events=[mtp], data_parallel_rank=0)))

    # Hybrid (sliding window + full attention): every group stores the same request hashes.
    hashes = [_int(d) for d in _vllm_chain(prompt, 16, 0)]
    full = stored(block_hashes=hashes, parent_block_hash=None, token_ids=prompt[:48],
                  block_size=16, lora_id=None, medium="GPU", lora_name=None,
                  extra_keys=[None, None, None], group_idx=0,
                  kv_cache_spec_kind="full_attention")
    window = stored(block_hashes=hashes, parent_block_hash=None, token_ids=prompt[:48],
                    block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[None, None, None], group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)
    swa_gone = removed(block_hashes=[hashes[2]], medium="GPU", group_idx=1)
    cases.append(("hybrid model: full-attention group 0 and sliding-window (32) group 1 store"
                  " tokens 1..48 (real plain hashes), then group 1 evicts block 2",
                  batch(ts=_TS, events=[full, window, swa_gone], data_parallel_rank=0)))

    mamba = stored(block_hashes=hashes, parent_block_hash=None, token_ids=prompt[:48],
                   block_size=16, lora_id=None, medium="GPU", lora_name=None,
                   extra_keys=[None, None, None], group_idx=1, kv_cache_spec_kind="mamba")
    cases.append(("hybrid model: full-attention group 0 and Mamba group 1 store tokens 1..48",
                  batch(ts=_TS, events=[full, mamba, cleared()], data_parallel_rank=0)))
    return cases


def _sglang_cases(ev: dict[str, Any]) -> list[tuple[str, object]]:
    stored, removed, batch = ev["BlockStored"], ev["BlockRemoved"], ev["KVEventBatch"]
    medium = ev["StorageMedium"].GPU

    def pages(raw: list[int], page: int) -> list[list[tuple[int, int]]]:
        pairs = [(raw[j], raw[j + 1]) for j in range(len(raw) - 1)]
        usable = len(pairs) // page * page
        return [pairs[i:i + page] for i in range(0, usable, page)]

    cases: list[tuple[str, object]] = []
    # Page size 1 (the default): a node over raw tokens 1..5 has 4 bigrams, one per page;
    # record_store enqueues one event per page and enqueue() coalesces them.
    one = pages([1, 2, 3, 4, 5], 1)
    ids = [1001, 1002, 1003, 1004]
    first = stored(block_hashes=[ids[0]], parent_block_hash=None, token_ids=list(one[0]),
                   block_size=1, lora_id=None, medium=medium)
    for previous, (page, block) in enumerate(zip(one[1:], ids[1:], strict=True)):
        nxt = stored(block_hashes=[block], parent_block_hash=ids[previous],
                     token_ids=list(page), block_size=1, lora_id=None, medium=medium)
        first.block_hashes.extend(nxt.block_hashes)  # KVCacheEventRecorder.enqueue
        first.token_ids.extend(nxt.token_ids)
    gone = removed(block_hashes=ids[2:], medium=medium)
    cases.append(("EAGLE bigram pages, page size 1: raw tokens 1..5 -> 4 pairs coalesced into"
                  " one store (block hashes are opaque ids), then a node of 2 pages evicted",
                  batch(ts=_TS, events=[first, gone], attn_dp_rank=0)))

    four = pages(list(range(1, 10)), 4)  # 9 raw tokens, 8 bigrams, 2 pages of 4
    node = stored(block_hashes=[2001, 2002], parent_block_hash=None,
                  token_ids=[pair for page in four for pair in page], block_size=4,
                  lora_id=None, medium=medium)
    child = stored(block_hashes=[2003], parent_block_hash=2002,
                   token_ids=list(pages(list(range(9, 14)), 4)[0]), block_size=4,
                   lora_id=None, medium=medium, session_id="s-1")
    cases.append(("EAGLE bigram pages, page size 4: raw tokens 1..9 (2 pages), then a child"
                  " node over raw 9..13 (1 page, another session so not coalesced)",
                  batch(ts=_TS, events=[node, child], attn_dp_rank=0)))
    return cases


def _entry(engine: str, version: str, note: str, batch: object) -> dict[str, Any]:
    payload = msgspec.msgpack.Encoder().encode(batch)  # what both publishers call
    return {"engine": engine, "version": version,
            "note": f"{note}; encoded by the {engine} {version} wheel's own event classes",
            "payload_hex": payload.hex(),
            "decoded": msgspec.msgpack.decode(payload)}


def _download(into: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(into),
                    f"vllm=={VLLM_VERSION}", f"sglang=={SGLANG_VERSION}"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="folder holding both wheels"
                        " (default: pip download them into a temporary folder)")
    parser.add_argument("--out", type=Path, default=_OUT)
    args = parser.parse_args()
    _check_vllm_hash()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or Path(tmp)
        if args.wheels is None:
            _download(wheels)
        vllm = _event_classes(_module_source(wheels, f"vllm-{VLLM_VERSION}-*.whl",
                                             _VLLM_MODULE))
        sglang = _event_classes(_module_source(wheels, f"sglang-{SGLANG_VERSION}-*.whl",
                                               _SGLANG_MODULE))
    entries = [_entry("vllm", VLLM_VERSION, note, b) for note, b in _vllm_cases(vllm)]
    entries += [_entry("sglang", SGLANG_VERSION, note, b) for note, b in _sglang_cases(sglang)]
    args.out.write_text(json.dumps(entries, indent=1) + "\n")
    print(f"wrote {len(entries)} payloads to {args.out}")


if __name__ == "__main__":
    main()
