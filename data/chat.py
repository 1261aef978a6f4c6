"""Chat records -> messages (+ tools) -> token ids with a 0/1 loss mask on assistant-generated tokens.

Rendering always goes through the target tokenizer's own chat template (DESIGN.md section 1, data/ step).
Messages follow OpenAI's chat format (role/content, assistant `tool_calls`, `tool` results), which the Qwen3,
Qwen3-Coder, Llama-3.1 and gpt-oss templates read; reasoning is kept as `reasoning_content`.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import jinja2

from draftsmith.data.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT writes "human"/"gpt" and "observation" for a tool result; Llama 3.1 calls tool results "ipython".
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "observation": "tool", "ipython": "tool", **{r: r for r in ROLES}}
# A ShareGPT turn of this role is an assistant tool call: its value is the JSON call (or a list of calls).
SHAREGPT_CALL_ROLE = "function_call"
RECORD_FIELDS = ("conversations", "messages", "prompt")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A turn's reasoning as each template renders it, when it opens the turn: Qwen3's think block, harmony's
# analysis message (github.com/openai/harmony, "Reasoning").
REASONING_BLOCKS = ((THINK_OPEN, THINK_CLOSE), ("<|channel|>analysis<|message|>", "<|end|>"))
_PROBE = "DRAFTSMITH_END_OF_TURN_PROBE"


def normalize_conversation(record: dict, column: str = "") -> list[dict]:
    """A ShareGPT, OpenAI or bare-prompt record (or record[column] when given) -> OpenAI-style messages."""
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
    if turn.get(role_key) == SHAREGPT_CALL_ROLE and role_key == "from":
        return {"role": "assistant", "content": "", "tool_calls": _sharegpt_tool_calls(turn.get("value"), where)}
    calls = turn.get("tool_calls")
    # OpenAI gives a tool-calling assistant turn content null (or no content at all)
    if role_key not in turn or (content_key not in turn and calls is None):
        raise UserError(
            f"{where} must have 'from' and 'value' (ShareGPT) or 'role' and 'content' (OpenAI); "
            f"found keys {sorted(turn)}"
        )
    role = turn[role_key]
    if role not in ROLE_ALIASES:
        valid = sorted([*ROLE_ALIASES, SHAREGPT_CALL_ROLE])
        raise UserError(f"{where}.{role_key}: unknown role {role!r} (valid: {valid})")
    message = {"role": ROLE_ALIASES[role], "content": turn.get(content_key)}
    if message["content"] is None and calls is not None:
        message["content"] = ""
    if not isinstance(message["content"], str):
        raise UserError(f"{where}.{content_key} must be a string, got {type(message['content']).__name__}")
    if calls is not None and message["role"] != "assistant":
        raise UserError(f"{where}.tool_calls: only assistant turns make tool calls, this turn's role is {role!r}")
    if message["role"] == "assistant":
        _copy_reasoning(turn, message, where)
        if calls is not None:
            message["tool_calls"] = _normalize_tool_calls(calls, f"{where}.tool_calls")
    if message["role"] == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                if not isinstance(turn[key], str):
                    raise UserError(f"{where}.{key} must be a string, got {type(turn[key]).__name__}")
                message[key] = turn[key]
    return message


def _copy_reasoning(turn: dict, message: dict, where: str) -> None:
    """Reasoning arrives as `reasoning_content` (Qwen3, DeepSeek) or `thinking` (gpt-oss); kept under the first."""
    given = {k: turn[k] for k in ("reasoning_content", "thinking") if turn.get(k) is not None}
    for key, value in given.items():
        if not isinstance(value, str):
            raise UserError(f"{where}.{key} must be a string, got {type(value).__name__}")
    if len(set(given.values())) > 1:
        raise UserError(f"{where} has both reasoning_content and thinking, and they differ: keep one of them")
    if given:
        message["reasoning_content"] = next(iter(given.values()))


def _sharegpt_tool_calls(value: object, where: str) -> list[dict]:
    """A ShareGPT function_call value: a JSON {"name", "arguments"} call, or a list of them."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}.value: a function_call turn must hold a JSON call ({e}): {value!r:.80}") from None
    return _normalize_tool_calls(value if isinstance(value, list) else [value], f"{where}.value")


def _normalize_tool_calls(calls: object, where: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise UserError(f"{where} must be a non-empty list of calls "
                        f"[{{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}], got {calls!r:.80}")
    return [_normalize_tool_call(call, f"{where}[{i}]") for i, call in enumerate(calls)]


def _normalize_tool_call(call: object, where: str) -> dict:
    """One call -> {"type": "function", "function": {"name", "arguments": dict}} (plus its "id" when given)."""
    if not isinstance(call, dict):
        raise UserError(f"{where} must be a dict, got {call!r:.80}")
    # OpenAI nests the call under "function"; ShareGPT function_call values give it bare
    function, fwhere = (call["function"], f"{where}.function") if "function" in call else (call, where)
    if not isinstance(function, dict):
        raise UserError(f"{fwhere} must be a dict with 'name' and 'arguments', got {function!r:.80}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"{fwhere}.name must be the called function's name (a non-empty string), got {name!r}")
    out = {"type": "function", "function": {"name": name,
                                            "arguments": _parse_arguments(function.get("arguments"), fwhere)}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _parse_arguments(arguments: object, where: str) -> dict:
    # Qwen3-Coder's template iterates the arguments as a mapping and Llama 3.1's and gpt-oss's dump them with
    # tojson, so OpenAI's JSON-string form is parsed once here instead of rendering double-encoded
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise UserError(f"{where}.arguments is not valid JSON ({e}): {arguments!r:.80}") from None
    if not isinstance(arguments, dict):
        raise UserError(f"{where}.arguments must be a JSON object of argument names to values, "
                        f"got {type(arguments).__name__}")
    return arguments


def normalize_tools(record: dict) -> list[dict]:
    """record["tools"] (OpenAI function schemas, or a JSON string of them) -> [{"type": "function", "function"}]."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise UserError(f"record field 'tools' is not valid JSON ({e}): {tools!r:.80}") from None
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise UserError(f"record field 'tools' must be a list of function schemas, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise UserError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": ...}}}} with a non-empty function.name, got {tool!r:.80}")
        out.append({"type": "function", "function": function})
    return out


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages`; a template's refusal (raise_exception) becomes a UserError."""
    # Qwen3 reads reasoning as `reasoning_content`, gpt-oss as `thinking`: give each template its name
    shown = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
    try:
        # an empty tools list still switches some templates (Llama 3.1) into tool mode: pass None instead
        return tokenizer.apply_chat_template(shown, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        roles = [m["role"] for m in messages]
        raise UserError(f"the chat template refused a conversation with roles {roles}: {e}") from None


def render_with_loss_mask(tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
                          loss_on_earlier_turns: bool = True,
                          loss_on_reasoning: bool = True) -> tuple[list[int], list[int]]:
    """Render through the tokenizer's chat template; mask is 1 exactly on the trained assistant tokens.

    A turn's trained text runs from the end of its generation prompt through the token that ends it
    (tool calls included, tool results never). Only the last assistant turn is trained unless
    loss_on_earlier_turns; a reasoning block opening a turn is skipped unless loss_on_reasoning.
    A token counts when any of its characters lies in a trained span.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"{type(tokenizer).__name__} is a slow tokenizer; the loss mask needs offset mappings, "
            "which only fast (tokenizers-backed) tokenizers give: load it with AutoTokenizer (use_fast=True)"
        )
    text = render_chat(tokenizer, messages, tools)
    spans = assistant_char_spans(tokenizer, text, messages, tools, loss_on_earlier_turns=loss_on_earlier_turns,
                                 loss_on_reasoning=loss_on_reasoning)
    covered = bytearray(len(text))
    for start, end in spans:
        covered[start:end] = b"\x01" * (end - start)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(covered.find(1, a, b) != -1) for a, b in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask


@dataclass(frozen=True)
class TurnMarkers:
    header: str
    """What add_generation_prompt appends: the assistant header the target continues from ("" if none)."""
    end_tokens: tuple[str, ...]
    """Special tokens the template closes an assistant message with (last turn, earlier turn, tool call)."""


def turn_markers(tokenizer) -> TurnMarkers:
    """The template's assistant header and end-of-turn tokens, found by rendering probe conversations."""
    # cached per tokenizer and template text (a tokenizer may hold several named templates: a dict)
    return _probe_turn_markers(tokenizer, str(tokenizer.chat_template))


@functools.lru_cache(maxsize=8)
def _probe_turn_markers(tokenizer, chat_template: str) -> TurnMarkers:
    user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}
    plain, prompt = render_chat(tokenizer, [user]), render_chat(tokenizer, [user], add_generation_prompt=True)
    header = prompt[len(plain):] if prompt.startswith(plain) else ""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content},
                      key=len, reverse=True)
    ends = [_special_after_probe(render_chat(tokenizer, [user, reply]), specials)]
    # harmony ends an earlier final answer with <|end|> and a tool call with <|call|>, the last turn with <|return|>
    call = {"type": "function", "function": {"name": "probe", "arguments": {"probe": _PROBE}}}
    for probe in ([user, reply, user],
                  [user, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "x"}]):
        try:
            text = render_chat(tokenizer, probe)
        except UserError:
            continue  # a template without tool support may refuse the tool probe
        if _PROBE in text:
            tail = text.split(_PROBE, 1)[1]
            found = [(tail.find(t), t) for t in specials if t in tail]
            ends += [min(found)[1]] if found else []
    return TurnMarkers(header=header, end_tokens=tuple(dict.fromkeys(ends)))


def _special_after_probe(rendered: str, specials: list[str]) -> str:
    """The special token the template writes right after an assistant's content."""
    if _PROBE not in rendered:
        raise UserError(f"the chat template does not render assistant content verbatim: {rendered!r:.200}")
    tail = rendered.split(_PROBE, 1)[1]
    stripped = tail.lstrip()
    for token in specials:
        if stripped.startswith(token):
            return token
    raise UserError(
        f"the chat template follows assistant content with {tail[:40]!r}, which does not start with a "
        "special token; cannot tell which token ends an assistant turn"
    )


def assistant_char_spans(tokenizer, text: str, messages: list[dict], tools: list[dict] | None = None, *,
                         loss_on_earlier_turns: bool = True, loss_on_reasoning: bool = True) -> list[tuple[int, int]]:
    """[start, end) character spans of the trained assistant text in `text`, the rendering of `messages`.

    An assistant message that opens the conversation has no prompt to answer and is never trained.
    """
    markers = turn_markers(tokenizer)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    spans = []
    for i in turns if loss_on_earlier_turns else turns[-1:]:
        start = _turn_start(tokenizer, text, messages, tools, i, markers.header)
        # a next message from the assistant too starts where its own generation prompt ends
        bound = len(text)
        if i + 1 < len(messages) and messages[i + 1]["role"] == "assistant":
            bound = _turn_start(tokenizer, text, messages, tools, i + 1, markers.header) - len(markers.header)
        end = _turn_end(text, start, bound, markers, i)
        _check_turn_rendered(text[start:end], messages[i], i)
        if not loss_on_reasoning:
            start = _after_reasoning(text, start, end, messages[i])
        spans.append((start, end))
    return spans


def _turn_start(tokenizer, text: str, messages: list[dict], tools: list[dict] | None, index: int,
                header: str) -> int:
    """Where the target starts writing assistant message `index` in `text`: right after its generation prompt."""
    prompt = render_chat(tokenizer, messages[:index], tools, add_generation_prompt=True)
    if text.startswith(prompt):
        return len(prompt)
    # Templates re-render earlier turns once later ones exist (Qwen3 drops old reasoning, harmony the analysis
    # before a final answer): anchor on the longest tail of the prompt found after the first difference
    first_diff = next((k for k, (a, b) in enumerate(zip(text, prompt)) if a != b), min(len(text), len(prompt)))
    lo, hi = 0, len(prompt)  # find(prompt[k:]) succeeds for every k past the answer: bisect for it
    while lo < hi:
        mid = (lo + hi) // 2
        if text.find(prompt[mid:], first_diff) != -1:
            hi = mid
        else:
            lo = mid + 1
    tail = prompt[lo:]
    if len(tail) <= len(header):
        raise UserError(f"assistant message {index}: its generation prompt (ending {prompt[-80:]!r}) was not found "
                        "in the rendered conversation; the template renders the turns before it differently")
    return text.find(tail, first_diff) + len(tail)


def _turn_end(text: str, start: int, bound: int, markers: TurnMarkers, index: int) -> int:
    """End of the token that closes the assistant message starting at `start` (searched before `bound`).

    An end token followed by another assistant header continues the message (harmony: an analysis message,
    then the final answer or tool call), so the first end token that is not closes it.
    """
    ends = re.compile("|".join(re.escape(t) for t in markers.end_tokens))
    continues = re.compile(r"\s*" + re.escape(markers.header)) if markers.header else None
    last = None
    for found in ends.finditer(text, start, bound):
        last = found.end()
        if continues is None or not continues.match(text, last):
            return last
    if last is None:
        raise UserError(f"assistant message {index}: none of the end-of-turn tokens {list(markers.end_tokens)} "
                        f"follows it in the rendered conversation ({text[start:start + 80]!r}...)")
    return last


def _check_turn_rendered(rendered: str, message: dict, index: int) -> None:
    """The template must show the message's content (or its tool calls) in its turn, else the span is wrong."""
    calls = message.get("tool_calls") or []
    content = message["content"]
    # Qwen3's template moves an inline <think> block out of the content (or drops it)
    visible = (content.split(THINK_CLOSE)[-1] if THINK_CLOSE in content else content).strip()
    # harmony renders a tool call's content as its analysis, or drops it: check only the calls there
    wanted = [c["function"]["name"] for c in calls] if calls else ([visible] if visible else [])
    missing = next((w for w in wanted if w not in rendered), None)
    if missing is not None:
        what = f"its tool call {missing!r}" if calls else f"its content {content[:60]!r}"
        raise UserError(f"assistant message {index}: {what} is not in the text the chat template rendered for "
                        f"that turn ({rendered[:120]!r}); the template rewrites or drops it")


def _after_reasoning(text: str, start: int, end: int, message: dict) -> int:
    """Where a turn's text after a reasoning block that opens it begins (`start` when there is none)."""
    at = end - len(text[start:end].lstrip())
    for open_tag, close_tag in REASONING_BLOCKS:
        if text.startswith(open_tag, at):
            # the reasoning may quote the closing tag: look for it after the reasoning's own text
            skip = len(message.get("reasoning_content", "").strip())
            close_at = text.find(close_tag, at + len(open_tag) + skip, end)
            if close_at == -1:
                return end  # an unclosed block (a reply cut off while reasoning) is all reasoning
            after = close_at + len(close_tag)
            return end - len(text[after:end].lstrip())
    return start


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation before its last assistant turn (all of it when it has none), for regeneration."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    prompt = messages[:last]
    if not any(m["role"] == "user" for m in prompt):
        roles = [m["role"] for m in messages]
        raise UserError(f"conversation has no user message before its last assistant turn (roles: {roles})")
    return prompt


def render_generation_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` plus the template's assistant header, ready for the target to generate."""
    text = render_chat(tokenizer, messages, tools, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- a generated turn back into a message ---------------------------------------------------------------------

HARMONY_SPECIALS = ("<|channel|>", "<|message|>")
# one harmony message the model wrote: [<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][ <|constrain|>json]
# <|message|>BODY<|end|>, <|return|> or <|call|>
_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?<\|channel\|>(?P<channel>\w+)(?:\s+to=(?P<to>[^\s<]+))?"
    r"(?:(?!<\|channel\|>).)*?<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|return\|>|<\|call\|>|$)", re.DOTALL)


def generated_message(tokenizer, token_ids: list[int]) -> dict:
    """The assistant message that `token_ids` (what the target generated after the generation prompt) stands for.

    A harmony target (GPT-OSS) writes channels: analysis -> reasoning, final -> `content`, a commentary message
    to `functions.NAME` -> a tool call, so the template renders the turn back as the target wrote it. Other
    templates keep reasoning (`<think>`) and tool-call text inline in the content, which they render verbatim.
    """
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    if not all(s in specials for s in HARMONY_SPECIALS):
        return {"role": "assistant", "content": tokenizer.decode(token_ids, skip_special_tokens=True).strip()}
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    thinking, content, calls = [], [], []
    for m in _HARMONY_MESSAGE.finditer(text):
        body = m["body"]
        if m["channel"] == "analysis":
            thinking.append(body)
        elif m["to"] and m["to"].startswith("functions."):
            calls.append({"type": "function", "function": {"name": m["to"].removeprefix("functions."),
                                                           "arguments": _arguments_or_text(body)}})
        else:
            content.append(body)
    if not (thinking or content or calls):  # no channel structure at all (an untrained model): plain text
        return {"role": "assistant", "content": tokenizer.decode(token_ids, skip_special_tokens=True).strip()}
    message = {"role": "assistant", "content": "".join(content)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)  # the normalised name (render_chat shows it as `thinking`)
    if calls:
        message["tool_calls"] = calls
    return message


def _arguments_or_text(body: str):
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return {"input": body}
    return value if isinstance(value, dict) else {"input": value}
