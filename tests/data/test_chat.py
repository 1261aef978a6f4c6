"""Golden assistant loss masks with the real chat templates and tokenizers (SmolLM2's ChatML, Qwen3,
Qwen3-Coder, Llama-3.1, gpt-oss harmony), and record normalisation (tool calls, tool results, reasoning).

The expected text is written out from reading each template (tests/fixtures/targets/*/chat_template.jinja).
"""
import datetime

import pytest
from targets import tokenizer_folder
from transformers import AutoTokenizer

from draftsmith.data.chat import (
    generated_message,
    normalize_conversation,
    normalize_tools,
    prompt_messages,
    render_generation_prompt,
    render_with_loss_mask,
)
from draftsmith.data.errors import UserError
from draftsmith.data.target import resolve_target_path


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return resolve_target_path("smollm2")


@pytest.fixture(scope="module")
def chatml(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(tokenizer_folder("qwen3"))


@pytest.fixture(scope="module")
def qwen3_coder():
    return AutoTokenizer.from_pretrained(tokenizer_folder("qwen3-coder-30b-a3b-instruct"))


@pytest.fixture(scope="module")
def llama31():
    return AutoTokenizer.from_pretrained(tokenizer_folder("llama-3.1-8b-instruct"))


@pytest.fixture(scope="module")
def gpt_oss():
    return AutoTokenizer.from_pretrained(tokenizer_folder("gpt-oss-20b"))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def tool(text: str) -> dict:
    return {"role": "tool", "content": text}


def call(name: str, arguments: dict, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name."}},
                   "required": ["city"]}}}


def masked_runs(tokenizer, messages: list[dict], tools=None, **options) -> list[tuple[int, str]]:
    """The rendered sample as alternating (mask, decoded text) runs of equal mask."""
    ids, mask = render_with_loss_mask(tokenizer, messages, tools, **options)
    assert len(ids) == len(mask)
    runs, first = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[first]:
            runs.append((mask[first], tokenizer.decode(ids[first:k])))
            first = k
    return runs


def trained_text(tokenizer, messages: list[dict], tools=None, **options) -> list[str]:
    return [text for m, text in masked_runs(tokenizer, messages, tools, **options) if m]


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


def test_chatml_earlier_turns_are_trained_only_when_asked(chatml):
    messages = [system("Be brief."), user("Hi"), assistant("Hello!"), user("Bye"), assistant("Goodbye.")]
    assert trained_text(chatml, messages) == ["Hello!<|im_end|>", "Goodbye.<|im_end|>"]
    assert trained_text(chatml, messages, loss_on_earlier_turns=False) == ["Goodbye.<|im_end|>"]


def test_template_without_tool_calls_is_an_error_naming_the_message(chatml):
    with pytest.raises(UserError, match=r"assistant message 1: its tool call 'get_weather' is not in the text"):
        render_with_loss_mask(chatml, [user("Weather?"), call("get_weather", {"city": "Paris"}),
                                       tool("Sunny"), assistant("Sunny.")])


# Qwen3: the last reply keeps its <think> block; replies before the last user query lose their reasoning


def test_qwen3_think_block_in_last_turn_and_reasoning_dropped_earlier(qwen3):
    messages = [user("2+2?"), assistant("4", reasoning="Add them."), user("3+3?"),
                assistant("6", reasoning="Add again.")]
    assert masked_runs(qwen3, messages) == [
        (0, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "4<|im_end|>"),
        (0, "\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "<think>\nAdd again.\n</think>\n\n6<|im_end|>"),
        (0, "\n"),
    ]
    assert trained_text(qwen3, messages, loss_on_earlier_turns=False) == [
        "<think>\nAdd again.\n</think>\n\n6<|im_end|>"]
    assert trained_text(qwen3, messages, loss_on_reasoning=False) == ["4<|im_end|>", "6<|im_end|>"]


def test_qwen3_last_turn_without_reasoning_gets_an_empty_think_block(qwen3):
    assert masked_runs(qwen3, [system("Be brief."), user("Hi"), assistant("Hello!")]) == [
        (0, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        (1, "<think>\n\n</think>\n\nHello!<|im_end|>"),
        (0, "\n"),
    ]
    assert trained_text(qwen3, [user("Hi"), assistant("Hello!")], loss_on_reasoning=False) == ["Hello!<|im_end|>"]


def test_qwen3_inline_think_in_content_is_reformatted_or_dropped(qwen3):
    messages = [user("Hi"), assistant("<think>Greet.</think>Hello!"), user("Bye"),
                assistant("<think>Wave.</think>Goodbye.")]
    assert trained_text(qwen3, messages) == ["Hello!<|im_end|>", "<think>\nWave.\n</think>\n\nGoodbye.<|im_end|>"]


def test_qwen3_reasoning_that_quotes_the_think_tags(qwen3):
    messages = [user("Hi"), assistant("Hello!", reasoning="Quote <think> and </think> once.")]
    assert trained_text(qwen3, messages) == ["<think>\nQuote <think> and </think> once.\n</think>\n\nHello!<|im_end|>"]
    assert trained_text(qwen3, messages, loss_on_reasoning=False) == ["Hello!<|im_end|>"]


def test_qwen3_tool_turns_lose_their_reasoning_once_a_new_user_query_follows(qwen3):
    # the generation prompt of the second reply still shows the first call's think block: the template
    # re-renders that turn once "Thanks!" arrives
    messages = [user("Weather in Paris?"), call("get_weather", {"city": "Paris"}, reasoning="Look it up."),
                tool("Sunny, 22C"), assistant("It is sunny.", reasoning="Report."), user("Thanks!"),
                assistant("You are welcome.", reasoning="Reply.")]
    runs = masked_runs(qwen3, messages, [WEATHER_TOOL])
    assert runs[0][0] == 0 and runs[0][1].endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    assert runs[1:] == [
        (1, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'),
        (0, "\n<|im_start|>user\n<tool_response>\nSunny, 22C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (1, "It is sunny.<|im_end|>"),
        (0, "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"),
        (1, "<think>\nReply.\n</think>\n\nYou are welcome.<|im_end|>"),
        (0, "\n"),
    ]


# Qwen3-Coder: XML tool calls are trained through <|im_end|>; tool responses come back as a user turn


def test_qwen3_coder_tool_calls_and_final_answer(qwen3_coder):
    record = {"messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 22C"},
        {"role": "tool", "tool_call_id": "c2", "content": "Snow, -3C"},
        {"role": "assistant", "content": "Paris is sunny; Oslo has snow."}],
        "tools": [WEATHER_TOOL]}
    runs = masked_runs(qwen3_coder, normalize_conversation(record), normalize_tools(record))
    assert runs[0][0] == 0
    assert runs[0][1].startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\nYou have access to the "
                                 "following functions:\n\n<tools>\n<function>\n<name>get_weather</name>\n")
    assert runs[0][1].endswith("</IMPORTANT><|im_end|>\n<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert runs[1:] == [
        (1, ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "</parameter>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>")),
        (0, ("\n<|im_start|>user\n<tool_response>\nSunny, 22C\n</tool_response>\n<tool_response>\nSnow, -3C\n"
            "</tool_response>\n<|im_end|>\n<|im_start|>assistant\n")),
        (1, "Paris is sunny; Oslo has snow.<|im_end|>"),
        (0, "\n"),
    ]
    assert trained_text(qwen3_coder, normalize_conversation(record), normalize_tools(record),
                        loss_on_earlier_turns=False) == ["Paris is sunny; Oslo has snow.<|im_end|>"]


def test_qwen3_coder_text_before_a_tool_call_is_trained(qwen3_coder):
    message = {**call("get_weather", {"city": "Paris"}), "content": "Let me check."}
    assert trained_text(qwen3_coder, [user("Weather?"), message], [WEATHER_TOOL]) == [
        ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>")]


# Llama-3.1: tools go into the first user turn, the call is JSON, its result comes back as `ipython`


def test_llama31_tool_call_ipython_result_and_answer(llama31):
    messages = [user("Weather in Paris?"), call("get_weather", {"city": "Paris"}), tool("Sunny, 22C"),
                assistant("It is sunny.")]
    runs = masked_runs(llama31, messages, [WEATHER_TOOL])
    assert runs[0][0] == 0
    assert runs[0][1].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: "
                                 "ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                                 "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions")
    assert runs[0][1].endswith('"city"\n            ]\n        }\n    }\n}\n\nWeather in Paris?<|eot_id|>'
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert runs[1:] == [
        (1, '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
        (0, ('<|start_header_id|>ipython<|end_header_id|>\n\n"Sunny, 22C"<|eot_id|>'
            "<|start_header_id|>assistant<|end_header_id|>\n\n")),
        (1, "It is sunny.<|eot_id|>"),
    ]


def test_llama31_two_turns_without_tools(llama31):
    messages = [system("Be brief."), user("Hi"), assistant(" Hello!\n"), user("Bye"), assistant("Goodbye.")]
    # the template trims contents, so " Hello!\n" renders as "Hello!"
    assert masked_runs(llama31, messages) == [
        (0, ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")),
        (1, "Hello!<|eot_id|>"),
        (0, ("<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
            "\n\n")),
        (1, "Goodbye.<|eot_id|>"),
    ]


def test_template_refusal_is_a_user_error(llama31):
    two_calls = call("get_weather", {"city": "Paris"})
    two_calls["tool_calls"] = two_calls["tool_calls"] * 2
    with pytest.raises(UserError, match="chat template refused .* only supports single tool-calls"):
        render_with_loss_mask(llama31, [user("Weather?"), two_calls, tool("Sunny"), assistant("Sunny.")])


# gpt-oss harmony: `thinking` is the analysis channel, content the final one (<|return|> on the last turn)


def harmony_system(tools: bool) -> str:
    today = datetime.date.today().strftime("%Y-%m-%d")
    calls = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
            f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n# Valid channels: analysis, "
            f"commentary, final. Channel must be included for every message.{calls}<|end|>")


def test_gpt_oss_analysis_and_final(gpt_oss):
    messages = [system("Be brief."), user("What is 2+2?"), assistant("4", reasoning="Add the numbers.")]
    prompt = (harmony_system(False) + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
              "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")
    assert masked_runs(gpt_oss, messages) == [
        (0, prompt),
        (1, ("<|channel|>analysis<|message|>Add the numbers.<|end|><|start|>assistant<|channel|>final<|message|>4"
            "<|return|>")),
    ]
    assert masked_runs(gpt_oss, messages, loss_on_reasoning=False) == [
        (0, prompt + "<|channel|>analysis<|message|>Add the numbers.<|end|>"),
        (1, "<|start|>assistant<|channel|>final<|message|>4<|return|>"),
    ]


def test_gpt_oss_tool_call_in_commentary(gpt_oss):
    # a later final answer drops the call's analysis message from the rendering
    messages = [user("Weather in Paris?"), call("get_weather", {"city": "Paris"}, reasoning="Look it up."),
                tool("Sunny, 22C"), assistant("It is sunny.", reasoning="Report.")]
    runs = masked_runs(gpt_oss, messages, [WEATHER_TOOL])
    assert runs[0] == (0, harmony_system(True) + "<|start|>developer<|message|># Tools\n\n## functions\n\n"
                       "namespace functions {\n\n// Get the weather.\ntype get_weather = (_: {\n// City name.\n"
                       "city: string,\n}) => any;\n\n} // namespace functions<|end|>"
                       "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    assert runs[1:] == [
        (1, ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'),
        (0, ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny, 22C"<|end|>'
            "<|start|>assistant")),
        (1, ("<|channel|>analysis<|message|>Report.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
            "<|return|>")),
    ]
    assert trained_text(gpt_oss, messages, [WEATHER_TOOL], loss_on_earlier_turns=False, loss_on_reasoning=False) == [
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"]


def test_gpt_oss_last_tool_call_keeps_its_analysis(gpt_oss):
    messages = [user("Weather in Paris?"), call("get_weather", {"city": "Paris"}, reasoning="Look it up.")]
    assert trained_text(gpt_oss, messages, [WEATHER_TOOL]) == [
        ("<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')]
    assert trained_text(gpt_oss, messages, [WEATHER_TOOL], loss_on_reasoning=False) == [
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>']


def test_gpt_oss_earlier_final_answers_end_with_end(gpt_oss):
    messages = [user("Hi"), assistant("Hello!", reasoning="Greet."), user("Bye"), assistant("Goodbye.", "Wave.")]
    assert trained_text(gpt_oss, messages) == [
        "<|channel|>final<|message|>Hello!<|end|>",
        "<|channel|>analysis<|message|>Wave.<|end|><|start|>assistant<|channel|>final<|message|>Goodbye.<|return|>"]


# every template


TOOL_CONVERSATION = [user("Weather in Paris?"), call("get_weather", {"city": "Paris"}, reasoning="Look it up."),
                     tool("Sunny, 22C"), assistant("It is sunny.", reasoning="Report.")]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "llama31", "gpt_oss"])
def test_tool_results_are_never_trained(family, request):
    tok = request.getfixturevalue(family)
    runs = masked_runs(tok, TOOL_CONVERSATION, [WEATHER_TOOL], loss_on_earlier_turns=True)
    assert [m for m, _ in runs].count(1) == 2
    # the whole result lies inside one untrained run, so none of its tokens is trained
    assert any(m == 0 and "Sunny, 22C" in text for m, text in runs), runs


@pytest.mark.parametrize(("family", "end_of_turn", "after"), [
    ("chatml", "<|im_end|>", "\n"), ("qwen3", "<|im_end|>", "\n"), ("qwen3_coder", "<|im_end|>", "\n"),
    ("llama31", "<|eot_id|>", ""), ("gpt_oss", "<|return|>", "")])
def test_last_reply_mask_starts_where_the_generation_prompt_ends(family, end_of_turn, after, request):
    tok = request.getfixturevalue(family)
    messages = [system("Be brief."), user("Hi"), assistant("Hello!", reasoning="Greet back."), user("Bye"),
                assistant("Goodbye.", reasoning="Say bye.")]
    ids, mask = render_with_loss_mask(tok, messages)
    last = max(k for k, m in enumerate(mask) if m)
    start = last
    while mask[start - 1]:
        start -= 1
    assert tok.decode(ids[:start]) == tok.decode(render_generation_prompt(tok, prompt_messages(messages)))
    assert tok.decode(ids[start : last + 1]).endswith("Goodbye." + end_of_turn)
    assert tok.decode(ids[last + 1 :]) == after


def test_render_generation_prompt_ends_with_the_assistant_header(chatml):
    ids = render_generation_prompt(chatml, [system("Be brief."), user("Hi")])
    assert chatml.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_render_generation_prompt_shows_the_tools(qwen3_coder):
    text = qwen3_coder.decode(render_generation_prompt(qwen3_coder, [user("Hi")], [WEATHER_TOOL]))
    assert "<name>get_weather</name>" in text and text.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                               "<|im_start|>assistant\n")


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


def test_prompt_messages_keeps_the_tool_exchange_before_the_last_reply():
    assert prompt_messages(TOOL_CONVERSATION) == TOOL_CONVERSATION[:3]


def test_prompt_messages_of_a_bare_prompt_is_the_prompt():
    assert prompt_messages([user("Hi")]) == [user("Hi")]


def test_prompt_messages_without_a_user_turn_is_an_error():
    with pytest.raises(ValueError, match="no user message"):
        prompt_messages([system("S"), assistant("Hello!")])


# normalize_conversation and normalize_tools


def test_normalize_sharegpt():
    record = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                {"from": "gpt", "value": "A", "reasoning_content": "R"}]}
    assert normalize_conversation(record) == [system("S"), user("Q"), assistant("A", reasoning="R")]


def test_normalize_openai_keeps_reasoning_under_either_name():
    record = {"messages": [{"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "A", "reasoning_content": "R"}], "id": 7}
    assert normalize_conversation(record) == [user("Q"), assistant("A", reasoning="R")]
    record["messages"][1] = {"role": "assistant", "content": "A", "thinking": "R"}
    assert normalize_conversation(record) == [user("Q"), assistant("A", reasoning="R")]


def test_normalize_openai_tool_calls_and_results():
    record = {"messages": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "3"},
        {"role": "ipython", "content": "4"}]}
    assert normalize_conversation(record) == [
        user("Q"),
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}, "id": "c1"}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "f"},
        tool("4")]


def test_normalize_sharegpt_function_call_and_observation():
    record = {"conversations": [
        {"from": "human", "value": "Q"},
        {"from": "function_call", "value": '{"name": "f", "arguments": {"x": 1}}'},
        {"from": "observation", "value": "2"},
        {"from": "gpt", "value": "It is 2."}]}
    assert normalize_conversation(record) == [user("Q"), call("f", {"x": 1}), tool("2"), assistant("It is 2.")]


def test_normalize_tools_wraps_bare_schemas_and_parses_json():
    bare = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    wrapped = {"type": "function", "function": bare}
    assert normalize_tools({"tools": [bare]}) == [wrapped]
    assert normalize_tools({"tools": '[{"type": "function", "function": {"name": "f", "parameters": '
                                      '{"type": "object", "properties": {}}}}]'}) == [wrapped]
    assert normalize_tools({"messages": []}) == []


def test_normalize_bare_prompt_and_named_column():
    assert normalize_conversation({"prompt": "Q"}) == [user("Q")]
    assert normalize_conversation({"question": "Q"}, column="question") == [user("Q")]
    turns = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    record = {"dialog": turns, "prompt": "ignored"}
    assert normalize_conversation(record, column="dialog") == [user("Q"), assistant("A")]


def test_normalize_unknown_role_names_the_field_and_the_valid_roles():
    record = {"conversations": [{"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]}
    valid = (r"\(valid: \['assistant', 'function_call', 'gpt', 'human', 'ipython', 'observation', 'system', "
             r"'tool', 'user'\]\)")
    with pytest.raises(UserError, match=r"conversations\[1\]\.from: unknown role 'bot' " + valid):
        normalize_conversation(record)


def _turns(*turns) -> dict:
    return {"messages": [{"role": "user", "content": "Q"}, *turns]}


def _calls(*calls) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


@pytest.mark.parametrize(
    ("record", "column", "message"),
    [
        ({"text": "Q"}, "", r"none of the fields \['conversations', 'messages', 'prompt'\] \(found fields: "),
        ({"text": "Q"}, "dialog", r"no field 'dialog' \(found fields: \['text'\]\)"),
        ({"messages": []}, "", "field 'messages' must be a prompt string or a non-empty list of turns"),
        ({"messages": ["Q"]}, "", r"messages\[0\] must be a dict"),
        ({"messages": [{"role": "user", "text": "Q"}]}, "", r"messages\[0\] must have 'from' and 'value'"),
        ({"messages": [{"role": "user", "content": None}]}, "", r"messages\[0\]\.content must be a string"),
        (_turns({"role": "assistant", "content": "A", "thinking": "R", "reasoning_content": "S"}), "",
         r"messages\[1\] has both reasoning_content and thinking, and they differ"),
        (_turns({"role": "assistant", "content": "A", "thinking": 3}), "", r"messages\[1\]\.thinking must be a string"),
        (_turns({"role": "assistant", "content": None, "tool_calls": []}), "",
         r"messages\[1\]\.tool_calls must be a non-empty list of calls"),
        (_turns(_calls({"type": "function", "function": {"arguments": "{}"}})), "",
         r"messages\[1\]\.tool_calls\[0\]\.function\.name must be the called function's name"),
        (_turns(_calls({"function": {"name": "f", "arguments": "{'x': 1}"}})), "",
         r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"),
        (_turns(_calls({"function": {"name": "f", "arguments": "[1]"}})), "",
         r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object .* got list"),
        (_turns(_calls({"function": "f"})), "", r"messages\[1\]\.tool_calls\[0\]\.function must be a dict"),
        (_turns({"role": "user", "content": "Q", "tool_calls": [{"function": {"name": "f"}}]}), "",
         r"messages\[1\]\.tool_calls: only assistant turns make tool calls"),
        (_turns({"role": "tool", "content": {"temp": 3}}), "", r"messages\[1\]\.content must be a string, got dict"),
        (_turns({"role": "tool", "content": "3", "tool_call_id": 7}), "",
         r"messages\[1\]\.tool_call_id must be a string"),
        ({"conversations": [{"from": "human", "value": "Q"}, {"from": "function_call", "value": "f(1)"}]}, "",
         r"conversations\[1\]\.value: a function_call turn must hold a JSON call"),
    ],
)
def test_normalize_rejects_wrong_shapes(record, column, message):
    with pytest.raises(UserError, match=message):
        normalize_conversation(record, column=column)


@pytest.mark.parametrize(("tools", "message"), [
    ({"name": "f"}, "record field 'tools' must be a list of function schemas, got dict"),
    ("[{", "record field 'tools' is not valid JSON"),
    ([{"type": "function", "function": {"description": "no name"}}], r"tools\[0\] must be .* non-empty function\.name"),
    (["f"], r"tools\[0\] must be"),
])
def test_normalize_tools_rejects_wrong_shapes(tools, message):
    with pytest.raises(UserError, match=message):
        normalize_tools({"messages": "Q", "tools": tools})


def test_generated_harmony_turn_becomes_channels_and_renders_back_as_written(gpt_oss):
    """What gpt-oss generates after `<|start|>assistant` (regeneration) is split into its channels, and the
    template renders that message back to the same text, all of it trained."""
    written = ("<|channel|>analysis<|message|>The user wants a loop.<|end|><|start|>assistant"
               "<|channel|>final<|message|>Use `for x in xs:`.<|return|>")
    message = generated_message(gpt_oss, gpt_oss(written, add_special_tokens=False)["input_ids"])
    assert message == {"role": "assistant", "content": "Use `for x in xs:`.",
                       "reasoning_content": "The user wants a loop."}
    assert trained_text(gpt_oss, [user("loop?"), message]) == [written]
    call = ('<|channel|>commentary to=functions.run_python <|constrain|>json<|message|>{"code": "print(1)"}'
            "<|call|>")
    assert generated_message(gpt_oss, gpt_oss(call, add_special_tokens=False)["input_ids"])["tool_calls"] == [
        {"type": "function", "function": {"name": "run_python", "arguments": {"code": "print(1)"}}}]
    # an untrained model writes no channels: its text is the content
    assert generated_message(gpt_oss, gpt_oss("no channels", add_special_tokens=False)["input_ids"]) == {
        "role": "assistant", "content": "no channels"}


def test_generated_turn_of_other_templates_keeps_think_and_calls_inline(qwen3):
    written = "<think>\nplan\n</think>\n\nanswer<|im_end|>"
    assert generated_message(qwen3, qwen3(written, add_special_tokens=False)["input_ids"]) == {
        "role": "assistant", "content": "<think>\nplan\n</think>\n\nanswer"}
