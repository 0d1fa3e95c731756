"""Chat records shared by the pipeline tests."""

MULTI = {"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "sql, python"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "docker"},
]}
