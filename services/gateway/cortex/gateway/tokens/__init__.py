"""Prompt text into the exact token ids the engine will see: the tokenizer core, its segment cache,
the parallel encoder, the heavy lane, the answers' tokens.
"""
