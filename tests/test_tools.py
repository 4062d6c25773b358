"""Tool calls (issue 49): ``tools`` / ``tool_choice`` through the chat template, the Hermes ``<tool_call>`` parser
(streamed pieces give the same answer as the whole text), forced calls by grammar through the official client, and
the errors."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from servers import serve_in_thread  # noqa: E402
from triforce import SamplingParams, TriForce  # noqa: E402
from triforce.serve import ServerDefaults, create_app  # noqa: E402
from triforce.serve.settings import APIError  # noqa: E402
from triforce.serve.tools import ToolCallParser, parse_tools  # noqa: E402

GREEDY = SamplingParams(temperature=0)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}\n</tool_call>'


# ------------------------------------------------------------------------------------------------ the parser
def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parser_splits_content_and_calls():
    content, calls = ToolCallParser.parse("Let me check.\n" + CALL + "\n" + CALL.replace("oslo", "rome"))
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "oslo", "days": 2}), ("get_weather", {"city": "rome", "days": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert ToolCallParser.parse(CALL + "\n")[0] is None  # only calls: content null, as OpenAI sends it
    assert ToolCallParser.parse("no call, a < b") == ("no call, a < b", [])
    bad = "<tool_call>\nnot json\n</tool_call>"  # kept as text, as vLLM's hermes parser does
    assert ToolCallParser.parse("x " + bad) == ("x" + bad, [])
    cut = '<tool_call>\n{"name": "get_weather", "argu'  # max_tokens cut the block: it stays text
    assert ToolCallParser.parse(CALL + cut)[0] == cut
    # a whole output that is one call without the tags (Qwen2.5-Coder's habit), bare or fenced, naming a tool
    bare = '{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}'
    for text in (bare, f"```json\n{bare}\n```\n", f" {bare}"):
        content, calls = ToolCallParser.parse(text, ["get_weather"])
        assert content is None and _calls(calls) == [("get_weather", {"city": "oslo", "days": 2})], text
    assert ToolCallParser.parse(bare, ["get_time"]) == (bare, [])  # a function not offered: text
    assert ToolCallParser.parse(bare) == (bare, [])  # no tools named: text
    assert ToolCallParser.parse("```json\n[1, 2]\n```", ["get_weather"]) == ("```json\n[1, 2]\n```", [])
    assert ToolCallParser.parse("```python\nx = 1\n```", ["get_weather"]) == ("```python\nx = 1\n```", [])


PIECES = st.lists(st.sampled_from(["Hi", " ", "\n", "<", "<tool", "_call>", CALL, "</tool_call>", "a < b", "{}", "```",
                                   "```json\n",
                                   "<tool_call>\n[1]\n</tool_call>", '{"name": "f", "arguments": {}}']), max_size=8)


@settings(max_examples=200, deadline=None)
@given(PIECES, st.data(), st.sampled_from([(), ("f",)]))
def test_streamed_pieces_give_the_whole_texts_answer(pieces, data, names):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parser, content, calls = ToolCallParser(names), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        c, k = parser.feed(text[a:b])
        content, calls = content + c, calls + k
    rest, more = parser.finish()
    content, calls = content + rest, calls + more
    whole_content, whole_calls = ToolCallParser.parse(text, names)
    assert (content or None if calls else content) == whole_content
    assert _calls(calls) == _calls(whole_calls)


def test_parse_tools_refuses_what_it_cannot_serve():
    template = "{% if tools %}<tool_call>{% endif %}"
    assert parse_tools({}, template) is None
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}, template) is None
    spec = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": False}, template)
    assert (spec.choice, spec.parallel, spec.response_format()) == ("auto", False, None)
    cases = [({"tools": [WEATHER]}, "{{ messages }}", "tools"),  # the template has no tool calls
             ({"tools": {"a": 1}}, template, "tools"),
             ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, template, "tools[0]"),
             ({"tools": [{"type": "code_interpreter"}]}, template, "tools[0]"),
             ({"tools": [WEATHER, WEATHER]}, template, "tools"),
             ({"tool_choice": "required"}, template, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "always"}, template, "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, template,
              "tool_choice"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, template,
              "tool_choice"),
             ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, template, "parallel_tool_calls")]
    for body, tmpl, param in cases:
        with pytest.raises(APIError) as e:
            parse_tools(body, tmpl)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)


def test_tags_that_are_tokens_of_their_own_are_named_in_the_grammar():
    """Qwen2.5's ``<tool_call>`` is one added token, which llguidance reads as special: its mask offers that token
    for the quoted text but its matcher then refuses it, so the forced grammar names the token."""
    from tiny import tool_tokenizer
    from triforce.speculation.grammar import constraint_for, reads_as_special

    tok = tool_tokenizer()
    assert not reads_as_special(tok, "<tool_call>", len(tok), (2,))  # not a token: the quoted text
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert all(reads_as_special(tok, t, len(tok), (2,)) for t in ("<tool_call>", "</tool_call>"))
    spec = parse_tools({"tools": [TIME], "tool_choice": "required", "parallel_tool_calls": False},
                       "{{ tools }}<tool_call>")
    fmt = spec.response_format(tags_are_tokens=True)
    assert fmt["lark"].startswith('start: call "\\n"?\ncall: <tool_call> "\\n" body')
    constraint = constraint_for(fmt, tok, len(tok), (2,))
    constraint.begin(0)
    assert constraint.allowed([]).nonzero().flatten().tolist() == [open_id]
    call = tok('\n{"name": "get_time", "arguments": {"zone": "cet"}}\n', add_special_tokens=False)["input_ids"]
    assert constraint.allowed([open_id] + call).nonzero().flatten().tolist() == [close_id]
    assert constraint.allowed([open_id] + call + [close_id]).nonzero().flatten().tolist() == [2, 3]  # EOS or "\n"
    assert constraint.allowed([open_id] + call + [close_id, 3]).nonzero().flatten().tolist() == [2]  # one call


# ------------------------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def tool_folder(tmp_path_factory):
    """A tiny Llama with a character tokenizer that writes JSON and a Hermes tool template."""
    from tiny import hf_model, tool_tokenizer

    path = tmp_path_factory.mktemp("tool_model")
    hf_model(7, vocab=99, layers=2, max_pos=2048).save_pretrained(path)
    tool_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tools_server(tool_folder):
    """(client, the same model in this process) with greedy sampling by default."""
    tf = TriForce.load(tool_folder)
    app = create_app(TriForce.load(tool_folder), ServerDefaults(model_id="tools", temperature=0))
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), tf


def _stream(client, **kw):
    """(content, [(name, arguments)], finish_reason) of a streamed chat answer, from its deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_a_named_tool_choice_forces_a_valid_call_equal_to_the_library(tools_server):
    client, tf = tools_server
    kw = dict(model="tools", messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("call_")
    assert set(args) == {"city", "days"} and 1 <= len(args["city"]) <= 8 and args["city"].isalpha()
    assert args["city"].islower() and 1 <= args["days"] <= 7
    # the same tokens as the library under the same grammar (the tools rendered by the template)
    spec = parse_tools(kw, tf.tokenizer.chat_template)
    ids = tf.tokenizer.apply_chat_template(ASK, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    text = tf.generate(list(ids), max_new_tokens=120, sampling=GREEDY, response_format=spec.response_format()).text
    assert r.usage.prompt_tokens == len(ids)
    assert _calls(ToolCallParser.parse(text)[1]) == [("get_weather", args)]
    assert _stream(client, **kw) == ("", [("get_weather", args)], "tool_calls")


def test_required_tool_calls_are_each_valid_for_its_tool(tools_server):
    client, _ = tools_server
    r = client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=200, temperature=0.9, seed=5, n=3)
    for choice in r.choices:
        assert choice.message.tool_calls, choice  # at least one call, each whole and valid
        for call in choice.message.tool_calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_time":
                assert args in ({"zone": "utc"}, {"zone": "cet"})
            else:
                assert call.function.name == "get_weather" and set(args) == {"city", "days"}
        assert choice.finish_reason in ("tool_calls", "length")


def test_auto_returns_what_the_model_writes_as_calls_streamed_and_not(tools_server):
    """With ``auto`` the model chooses; a grammar stands in for a model that chose to call (a random model would
    not): its text with a call in it comes back as content plus ``tool_calls``."""
    client, _ = tools_server
    lark = f"start: {json.dumps('Sure.' + chr(10) + CALL)}"
    kw = dict(model="tools", messages=ASK, tools=[WEATHER], max_tokens=120,
              response_format={"type": "lark", "lark": lark})
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
    assert _calls([c.model_dump() for c in message.tool_calls]) == [("get_weather", {"city": "oslo", "days": 2})]
    assert _stream(client, **kw) == ("Sure.", [("get_weather", {"city": "oslo", "days": 2})], "tool_calls")
    plain = client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER], max_tokens=12)
    assert plain.choices[0].message.tool_calls is None  # the random model wrote text: content only


def test_tool_results_go_back_through_the_template(tools_server):
    client, tf = tools_server
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"}]
    r = client.chat.completions.create(model="tools", messages=history, tools=[WEATHER], max_tokens=8)
    rendered = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "oslo", "days": 2}}}]},
        {"role": "tool", "content": "sunny, 12 C", "tool_call_id": "call_1"}]
    text = tf.tokenizer.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert CALL in text and "<tool>sunny, 12 C<assistant>" in text
    ids = tf.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tf.generate(ids, max_new_tokens=8, sampling=GREEDY).text
    bad = history[:1] + [dict(history[1], tool_calls=[{"id": "c", "type": "function",
                                                       "function": {"name": "f", "arguments": "{oops"}}])]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tools", messages=bad, tools=[WEATHER], max_tokens=4)
    assert e.value.body["param"] == "messages[1].tool_calls"
