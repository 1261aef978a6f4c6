"""Golden assistant loss masks for ChatML (SmolLM2), Llama-3.1 and Qwen3 templates, and record normalisation.

The Llama-3.1 and Qwen3 tokenizers are the SmolLM2 tokenizer plus the family's special tokens and a
template in fixtures/ that renders like the family's own (there is no model hub here).
"""
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from draftsmith.data.chat import (
    normalize_conversation,
    prompt_messages,
    render_generation_prompt,
    render_with_loss_mask,
)
from draftsmith.data.target import resolve_target_path

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return resolve_target_path("smollm2")


@pytest.fixture(scope="module")
def chatml(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def llama3(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_tokens(specials, special_tokens=True)
    tok.chat_template = (FIXTURES / "llama3_chat_template.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def qwen3(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    # Qwen3 ships <think> and </think> as added tokens that are not "special"
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = (FIXTURES / "qwen3_chat_template.jinja").read_text()
    return tok


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def assert_golden(tokenizer, messages: list[dict], expected: list[tuple[str, int]]) -> None:
    """Render `messages` and compare every (decoded token, mask) pair with `expected`."""
    ids, mask = render_with_loss_mask(tokenizer, messages)
    assert len(ids) == len(mask)
    actual = [(tokenizer.decode([i]), m) for i, m in zip(ids, mask)]
    if actual == expected:
        return
    shorter = min(len(actual), len(expected))
    first_bad = next((k for k, (a, e) in enumerate(zip(actual, expected)) if a != e), shorter)
    rows = []
    for k in range(max(len(actual), len(expected))):
        got = f"{actual[k][0]!r:>22} mask={actual[k][1]}" if k < len(actual) else f"{'-':>22}       "
        want = f"{expected[k][0]!r} mask={expected[k][1]}" if k < len(expected) else "-"
        rows.append(f"{'>>' if k == first_bad else '  '} {k:3d} {got}   expected {want}")
    header = f"token/mask mismatch at index {first_bad} ({len(actual)} tokens, {len(expected)} expected):"
    pytest.fail("\n".join([header, *rows]))


# ChatML: SmolLM2's own template (it injects a default system prompt when there is none)


def test_chatml_single_turn_masks_reply_and_im_end_only(chatml):
    assert_golden(chatml, [user("What is 2+2?"), assistant("4.")], [
        ("<|im_start|>", 0), ("system", 0), ("\n", 0), ("You", 0), (" are", 0), (" a", 0), (" helpful", 0),
        (" AI", 0), (" assistant", 0), (" named", 0), (" Sm", 0), ("ol", 0), ("LM", 0), (",", 0),
        (" trained", 0), (" by", 0), (" H", 0), ("ugging", 0), (" Face", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("What", 0), (" is", 0), (" ", 0), ("2", 0), ("+", 0),
        ("2", 0), ("?", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("4", 1), (".", 1), ("<|im_end|>", 1),
        ("\n", 0),
    ])


def test_chatml_system_prompt_and_two_turns(chatml):
    messages = [system("Be brief."), user("Hi"), assistant("Hello!"), user("Bye"), assistant("Goodbye.")]
    assert_golden(chatml, messages, [
        ("<|im_start|>", 0), ("system", 0), ("\n", 0), ("Be", 0), (" brief", 0), (".", 0), ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hi", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("Hello", 1), ("!", 1), ("<|im_end|>", 1),
        ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("By", 0), ("e", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("Good", 1), ("bye", 1), (".", 1),
        ("<|im_end|>", 1), ("\n", 0),
    ])


def test_chatml_reply_that_repeats_the_user_text(chatml):
    messages = [system("Echo."), user("Hello there"), assistant("Hello there"), user("Hello there"),
                assistant("Hello there")]
    assert_golden(chatml, messages, [
        ("<|im_start|>", 0), ("system", 0), ("\n", 0), ("E", 0), ("cho", 0), (".", 0), ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hello", 0), (" there", 0), ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("Hello", 1), (" there", 1),
        ("<|im_end|>", 1), ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hello", 0), (" there", 0), ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("Hello", 1), (" there", 1),
        ("<|im_end|>", 1), ("\n", 0),
    ])


def test_chatml_text_that_the_default_system_prompt_also_holds(chatml):
    # "Hugging Face<|im_end|>" ends SmolLM2's injected system prompt, the user turn and the reply
    ids, mask = render_with_loss_mask(chatml, [user("Hugging Face"), assistant("Hugging Face")])
    trained = "".join(chatml.decode([i]) for i, m in zip(ids, mask) if m)
    assert trained == "Hugging Face<|im_end|>"
    prompt_text = chatml.decode(ids[: mask.index(1)])
    assert prompt_text.endswith("user\nHugging Face<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_user_text_that_the_next_assistant_header_also_holds(chatml):
    messages = [system("S"), user("Who?"), assistant("assistant"), user("assistant"), assistant("ok")]
    assert_golden(chatml, messages, [
        ("<|im_start|>", 0), ("system", 0), ("\n", 0), ("S", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Who", 0), ("?", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("ass", 1), ("istant", 1),
        ("<|im_end|>", 1), ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("ass", 0), ("istant", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("ok", 1), ("<|im_end|>", 1), ("\n", 0),
    ])


# Llama-3.1: BOS and the date system block are never trained on; <|eot_id|> closes the reply

LLAMA3_SYSTEM_HEADER = [
    ("<|begin_of_text|>", 0), ("<|start_header_id|>", 0), ("system", 0), ("<|end_header_id|>", 0), ("\n", 0),
    ("\n", 0), ("Cut", 0), ("ting", 0), (" Knowledge", 0), (" Date", 0), (":", 0), (" December", 0), (" ", 0),
    ("2", 0), ("0", 0), ("2", 0), ("3", 0), ("\n", 0), ("Today", 0), (" Date", 0), (":", 0), (" ", 0),
    ("2", 0), ("6", 0), (" Jul", 0), (" ", 0), ("2", 0), ("0", 0), ("2", 0), ("4", 0),
]


def test_llama3_single_turn(llama3):
    assert_golden(llama3, [user("Hi"), assistant("Hello!")], LLAMA3_SYSTEM_HEADER + [
        ("\n\n", 0), ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0), ("Hi", 0),
        ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("ass", 0), ("istant", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0),
        ("Hello", 1), ("!", 1), ("<|eot_id|>", 1),
    ])


def test_llama3_system_prompt_two_turns_and_trimmed_reply(llama3):
    # the template trims contents, so " Hello!\n" renders as "Hello!"
    messages = [system("Be brief."), user("Hi"), assistant(" Hello!\n"), user("Bye"), assistant("Goodbye.")]
    assert_golden(llama3, messages, LLAMA3_SYSTEM_HEADER + [
        ("\n", 0), ("\n", 0), ("Be", 0), (" brief", 0), (".", 0), ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0), ("Hi", 0),
        ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("ass", 0), ("istant", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0),
        ("Hello", 1), ("!", 1), ("<|eot_id|>", 1),
        ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0), ("By", 0),
        ("e", 0), ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("ass", 0), ("istant", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0),
        ("Good", 1), ("bye", 1), (".", 1), ("<|eot_id|>", 1),
    ])


# Qwen3: the last reply keeps its <think> block (trained on); earlier replies lose their reasoning


def test_qwen3_think_block_in_last_turn_and_reasoning_stripped_earlier(qwen3):
    messages = [user("2+2?"), assistant("4", reasoning="Add them."), user("3+3?"),
                assistant("6", reasoning="Add again.")]
    assert_golden(qwen3, messages, [
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("2", 0), ("+", 0), ("2", 0), ("?", 0),
        ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("4", 1), ("<|im_end|>", 1), ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("3", 0), ("+", 0), ("3", 0), ("?", 0),
        ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("<think>", 1), ("\n", 1), ("Add", 1),
        (" again", 1), (".", 1), ("\n", 1), ("</think>", 1), ("\n", 1), ("\n", 1), ("6", 1),
        ("<|im_end|>", 1), ("\n", 0),
    ])


def test_qwen3_last_turn_without_reasoning_gets_an_empty_think_block(qwen3):
    assert_golden(qwen3, [system("Be brief."), user("Hi"), assistant("Hello!")], [
        ("<|im_start|>", 0), ("system", 0), ("\n", 0), ("Be", 0), (" brief", 0), (".", 0), ("<|im_end|>", 0),
        ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hi", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("<think>", 1), ("\n\n", 1),
        ("</think>", 1), ("\n", 1), ("\n", 1), ("Hello", 1), ("!", 1), ("<|im_end|>", 1), ("\n", 0),
    ])


def test_qwen3_inline_think_in_content_is_reformatted_or_dropped(qwen3):
    messages = [user("Hi"), assistant("<think>Greet.</think>Hello!"), user("Bye"),
                assistant("<think>Wave.</think>Goodbye.")]
    assert_golden(qwen3, messages, [
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hi", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("Hello", 1), ("!", 1), ("<|im_end|>", 1),
        ("\n", 0),
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("By", 0), ("e", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("<think>", 1), ("\n", 1), ("Wave", 1),
        (".", 1), ("\n", 1), ("</think>", 1), ("\n", 1), ("\n", 1), ("Good", 1), ("bye", 1), (".", 1),
        ("<|im_end|>", 1), ("\n", 0),
    ])


def test_qwen3_reasoning_that_quotes_the_think_tag(qwen3):
    assert_golden(qwen3, [user("Hi"), assistant("Hello!", reasoning="Quote <think> once.")], [
        ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Hi", 0), ("<|im_end|>", 0), ("\n", 0),
        ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0), ("<think>", 1), ("\n", 1), ("Qu", 1),
        ("ote", 1), (" ", 1), ("<think>", 1), (" once", 1), (".", 1), ("\n", 1), ("</think>", 1), ("\n", 1),
        ("\n", 1), ("Hello", 1), ("!", 1), ("<|im_end|>", 1), ("\n", 0),
    ])


@pytest.mark.parametrize("family", ["chatml", "llama3", "qwen3"])
def test_last_reply_mask_starts_where_the_generation_prompt_ends(family, request):
    tok = request.getfixturevalue(family)
    messages = [system("Be brief."), user("Hi"), assistant("Hello!", reasoning="Greet back."), user("Bye"),
                assistant("Goodbye.", reasoning="Say bye.")]
    ids, mask = render_with_loss_mask(tok, messages)
    last = max(k for k, m in enumerate(mask) if m)
    start = last
    while mask[start - 1]:
        start -= 1
    # compared as text: a header ending in "\n\n" may tokenize differently once the reply follows it
    assert tok.decode(ids[:start]) == tok.decode(render_generation_prompt(tok, prompt_messages(messages)))
    end_of_turn = "<|eot_id|>" if family == "llama3" else "<|im_end|>"
    assert tok.decode(ids[start : last + 1]).endswith("Goodbye." + end_of_turn)
    assert tok.decode(ids[last + 1 :]) == ("" if family == "llama3" else "\n")


def test_render_generation_prompt_ends_with_the_assistant_header(chatml):
    ids = render_generation_prompt(chatml, [system("Be brief."), user("Hi")])
    assert chatml.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_reply_the_template_rewrites_is_an_error_naming_the_message(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.content | upper }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match=r"assistant message 1: its content 'Hello!'"):
        render_with_loss_mask(tok, [user("Hi"), assistant("Hello!")])


def test_template_without_an_end_of_turn_token_is_an_error(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not start with a special token"):
        render_with_loss_mask(tok, [user("Hi"), assistant("Hello!")])


# prompt_messages


def test_prompt_messages_stops_before_the_last_reply():
    messages = [system("S"), user("Hi"), assistant("Hello!"), user("Bye"), assistant("Goodbye.")]
    assert prompt_messages(messages) == messages[:4]


def test_prompt_messages_of_a_bare_prompt_is_the_prompt():
    assert prompt_messages([user("Hi")]) == [user("Hi")]


def test_prompt_messages_without_a_user_turn_is_an_error():
    with pytest.raises(ValueError, match="no user message"):
        prompt_messages([system("S"), assistant("Hello!")])


# normalize_conversation


def test_normalize_sharegpt():
    record = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                {"from": "gpt", "value": "A", "reasoning_content": "R"}]}
    assert normalize_conversation(record) == [system("S"), user("Q"), assistant("A", reasoning="R")]


def test_normalize_openai_keeps_reasoning_content():
    record = {"messages": [{"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "A", "reasoning_content": "R"}], "id": 7}
    assert normalize_conversation(record) == [user("Q"), assistant("A", reasoning="R")]


def test_normalize_bare_prompt_and_named_column():
    assert normalize_conversation({"prompt": "Q"}) == [user("Q")]
    assert normalize_conversation({"question": "Q"}, column="question") == [user("Q")]
    turns = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    record = {"dialog": turns, "prompt": "ignored"}
    assert normalize_conversation(record, column="dialog") == [user("Q"), assistant("A")]


def test_normalize_unknown_role_names_the_field_and_the_valid_roles():
    record = {"conversations": [{"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]}
    valid = r"\(valid: \['assistant', 'gpt', 'human', 'system', 'user'\]\)"
    with pytest.raises(ValueError, match=r"conversations\[1\]\.from: unknown role 'bot' " + valid):
        normalize_conversation(record)


@pytest.mark.parametrize(
    ("record", "column", "message"),
    [
        ({"text": "Q"}, "", r"none of the fields \['conversations', 'messages', 'prompt'\] \(found fields: "),
        ({"text": "Q"}, "dialog", r"no field 'dialog' \(found fields: \['text'\]\)"),
        ({"messages": []}, "", "field 'messages' must be a prompt string or a non-empty list of turns"),
        ({"messages": ["Q"]}, "", r"messages\[0\] must be a dict"),
        ({"messages": [{"role": "user", "text": "Q"}]}, "", r"messages\[0\] must have 'from' and 'value'"),
        ({"messages": [{"role": "user", "content": None}]}, "", r"messages\[0\]\.content must be a string"),
    ],
)
def test_normalize_rejects_wrong_shapes(record, column, message):
    with pytest.raises(ValueError, match=message):
        normalize_conversation(record, column=column)
