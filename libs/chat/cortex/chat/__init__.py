"""``cortex.chat``: the prompt tokens an engine computes for a request, computed elsewhere.

The gateway (to route on exact KV blocks) and the simulated engine (to be the engine) both
turn requests into token ids through this library, so they agree with each other and with
SGLang / vLLM::

    chat = ChatTokenizer.load()                       # default DeepSeek-V4 tokenizer+template
    args = render_args(body, Engine.VLLM)             # the engine's reading of the body
    ids = chat.encode_chat(args)                      # == the engine's prompt_token_ids

See ``docs/chat.md`` for what is guaranteed.
"""

from cortex.chat.conversation import ContentFormat, Conversation, build_conversation
from cortex.chat.encoder import Encoder, EncoderChoice, select_encoder
from cortex.chat.errors import ChatError, InvalidChatRequest, TemplateError
from cortex.chat.request import RenderArgs, render_args, text_add_special_tokens
from cortex.chat.template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, load_chat_template
from cortex.chat.tokenize_api import (
    DetokenizeQuery,
    TokenizeQuery,
    detokenize_query,
    detokenize_response,
    tokenize_query,
    tokenize_response,
)
from cortex.chat.tokenizer import ChatPrompt, ChatTokenizer, default_tokenizer_dir, load_tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ChatError",
    "ChatPrompt",
    "ChatTemplate",
    "ChatTokenizer",
    "ContentFormat",
    "Conversation",
    "DetokenizeQuery",
    "Encoder",
    "EncoderChoice",
    "InvalidChatRequest",
    "RenderArgs",
    "TemplateError",
    "TokenizeQuery",
    "build_conversation",
    "default_tokenizer_dir",
    "detokenize_query",
    "detokenize_response",
    "load_chat_template",
    "load_tokenizer",
    "render_args",
    "select_encoder",
    "text_add_special_tokens",
    "tokenize_query",
    "tokenize_response",
]
