"""Chat records -> role/content messages -> token ids with a 0/1 loss mask on assistant-generated tokens.

Rendering always goes through the target tokenizer's own chat template (DESIGN.md section 1, data/ step).
"""
from __future__ import annotations

from draftsmith.data.errors import UserError

ROLES = ("system", "user", "assistant")
# ShareGPT writes "human"/"gpt"; OpenAI-style records already use ROLES.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", **{r: r for r in ROLES}}
RECORD_FIELDS = ("conversations", "messages", "prompt")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = "DRAFTSMITH_END_OF_TURN_PROBE"


def normalize_conversation(record: dict, column: str = "") -> list[dict]:
    """A ShareGPT, OpenAI or bare-prompt record (or record[column] when given) -> [{"role", "content"}]."""
    if column:
        if column not in record:
            raise UserError(f"record has no field '{column}' (found fields: {sorted(record)})")
        field = column
    else:
        field = next((f for f in RECORD_FIELDS if f in record), None)
        if field is None:
            raise UserError(
                f"record has none of the fields {list(RECORD_FIELDS)} (found fields: {sorted(record)}); "
                "pass column= to name the field that holds the conversation"
            )
    value = record[field]
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise UserError(
            f"field '{field}' must be a prompt string or a non-empty list of turns, got {value!r:.80}"
        )
    return [_normalize_turn(turn, f"{field}[{i}]") for i, turn in enumerate(value)]


def _normalize_turn(turn: object, where: str) -> dict:
    """One ShareGPT {"from", "value"} or OpenAI {"role", "content"} turn -> a message dict."""
    if not isinstance(turn, dict):
        raise UserError(f"{where} must be a dict with 'from'/'value' or 'role'/'content', got {turn!r:.80}")
    role_key, content_key = ("from", "value") if "from" in turn else ("role", "content")
    if role_key not in turn or content_key not in turn:
        raise UserError(
            f"{where} must have 'from' and 'value' (ShareGPT) or 'role' and 'content' (OpenAI); "
            f"found keys {sorted(turn)}"
        )
    role = turn[role_key]
    if role not in ROLE_ALIASES:
        raise UserError(f"{where}.{role_key}: unknown role {role!r} (valid: {sorted(ROLE_ALIASES)})")
    content = turn[content_key]
    if not isinstance(content, str):
        raise UserError(f"{where}.{content_key} must be a string, got {type(content).__name__}")
    message = {"role": ROLE_ALIASES[role], "content": content}
    reasoning = turn.get("reasoning_content")
    if message["role"] == "assistant" and reasoning is not None:
        if not isinstance(reasoning, str):
            raise UserError(f"{where}.reasoning_content must be a string, got {type(reasoning).__name__}")
        message["reasoning_content"] = reasoning
    return message


def render_with_loss_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Render through the tokenizer's chat template; mask is 1 exactly on assistant-generated tokens.

    Generated = the assistant content, a `<think>...</think>` block rendered in that turn, and the
    template's end-of-turn token. A token counts when any of its characters lies in such a span.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"{type(tokenizer).__name__} is a slow tokenizer; the loss mask needs offset mappings, "
            "which only fast (tokenizers-backed) tokenizers give: load it with AutoTokenizer (use_fast=True)"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = assistant_char_spans(text, messages, end_of_turn_marker(tokenizer))
    covered = bytearray(len(text))
    for start, end in spans:
        covered[start:end] = b"\x01" * (end - start)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(covered.find(1, a, b) != -1) for a, b in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask


def end_of_turn_marker(tokenizer) -> str:
    """The text the template writes right after an assistant's content, through its first special token."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    rendered = tokenizer.apply_chat_template(probe, tokenize=False)
    if _PROBE not in rendered:
        raise UserError(f"the chat template does not render assistant content verbatim: {rendered!r:.200}")
    tail = rendered.split(_PROBE, 1)[1]
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    stripped = tail.lstrip()
    for token in sorted(specials, key=len, reverse=True):
        if token and stripped.startswith(token):
            return tail[: len(tail) - len(stripped) + len(token)]
    raise UserError(
        f"the chat template follows assistant content with {tail[:40]!r}, which does not start with a "
        "special token; cannot tell which token ends an assistant turn"
    )


def assistant_char_spans(text: str, messages: list[dict], marker: str) -> list[tuple[int, int]]:
    """[start, end) character spans of each assistant turn's generated text in the rendered `text`.

    Messages are located from the last one backwards, each ending before the next one starts, so text
    that the template injects earlier (a default system prompt, a date line) is never taken for a turn.
    """
    spans, limit = [], len(text)
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i]["content"]
        if messages[i]["role"] == "assistant":
            start, end = _find_assistant_turn(text, content, marker, limit, i)
            start = _include_think_block(text, marker, start)
            spans.append((start, end))
            limit = start
        else:
            limit = _find_content_start(text, content, marker, limit)
    return spans[::-1]


def _find_content_start(text: str, content: str, marker: str, limit: int) -> int:
    """Start of the last rendering of a non-assistant `content` before `limit` (`limit` if not found)."""
    content = content.strip()
    if not content:
        return limit
    # Prefer the occurrence closed by the marker: the assistant header after a user turn may hold the text.
    pos = text.rfind(content + marker, 0, limit)
    if pos == -1:
        pos = text.rfind(content, 0, limit)
    return limit if pos == -1 else pos


def _find_assistant_turn(text: str, content: str, marker: str, limit: int, index: int) -> tuple[int, int]:
    """Span of the last `content` + end-of-turn marker that ends by `limit`, as the template rendered it."""
    candidates = [content, content.strip()]
    if THINK_CLOSE in content:
        # Templates like Qwen3's move an inline <think> block out of the content (or drop it).
        candidates.append(content.split(THINK_CLOSE)[-1].strip())
    for candidate in candidates:
        pos = text.rfind(candidate + marker, 0, limit)
        if pos != -1:
            return pos, pos + len(candidate) + len(marker)
    raise UserError(
        f"assistant message {index}: its content {content[:60]!r} followed by the end-of-turn marker "
        f"{marker!r} was not found in the rendered chat template output (searched up to character {limit})"
    )


def _include_think_block(text: str, marker: str, start: int) -> int:
    """Move `start` back over a `<think>...</think>` block that the template put right before the content."""
    close_at = text.rfind(THINK_CLOSE, 0, start)
    if close_at == -1 or text[close_at + len(THINK_CLOSE) : start].strip():
        return start
    # the block opens after the previous turn's end-of-turn marker; take the first <think> after it,
    # since the reasoning may quote the tag
    turn_start = text.rfind(marker, 0, close_at)
    open_at = text.find(THINK_OPEN, 0 if turn_start == -1 else turn_start + len(marker), close_at)
    return start if open_at == -1 else open_at


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation before its last assistant turn (all of it when it has none), for regeneration."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    prompt = messages[:last]
    if not any(m["role"] == "user" for m in prompt):
        roles = [m["role"] for m in messages]
        raise UserError(f"conversation has no user message before its last assistant turn (roles: {roles})")
    return prompt


def render_generation_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` plus the template's assistant header, ready for the target to generate."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
