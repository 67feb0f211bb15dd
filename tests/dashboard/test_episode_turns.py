"""The trajectory browser's turn-by-turn shaping of a stored multi-turn episode."""

from trajflow.dashboards.data import episode_turns


def test_episode_turns_pairs_each_assistant_turn_with_its_tool_calls():
    messages = [
        {"role": "assistant", "content": "call calc", "tool_calls": '[{"name": "calculator"}]'},
        {"role": "tool", "content": "7006652", "tool_calls": None},
        {"role": "assistant", "content": "call search", "tool_calls": None},
        {"role": "tool", "content": "error: unknown tool 'search'", "tool_calls": None},
        {"role": "assistant", "content": "7006652", "tool_calls": None},
    ]
    calls = [
        {"turn": 0, "name": "calculator", "arguments": '{"expression": "1234 * 5678"}', "result": "7006652",
         "error": None, "duration_s": 0.01},
        {"turn": 1, "name": "search", "arguments": '{"q": "x"}', "result": "", "error": "unknown tool 'search'",
         "duration_s": 0.0},
    ]
    turns = episode_turns(messages, calls)
    assert [(t["role"], t["turn"]) for t in turns] == [("assistant", 1), ("tool", 1), ("assistant", 2), ("tool", 2),
                                                       ("assistant", 3)]
    assert turns[0]["calls"] == [{"name": "calculator", "arguments": '{"expression": "1234 * 5678"}',
                                  "result": "7006652", "error": None, "duration_s": 0.01}]
    assert turns[1]["content"] == "7006652"
    assert turns[2]["calls"][0]["error"] == "unknown tool 'search'"
    assert turns[4]["calls"] == []


def test_single_turn_rows_have_no_turn_view():
    assert episode_turns(None, None) == []
    assert episode_turns([], []) == []
