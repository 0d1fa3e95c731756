"""Property-based: any input gives an Example or a BadRow with a message, never a traceback."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdcache.pipeline.data import BadRow, Example, iter_rows, parse_row

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), c, max_size=4)),
                           max_leaves=12)
roles = st.sampled_from(["system", "user", "assistant", "tool", "wizard", "", None, 3])
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": st.one_of(st.text(max_size=30), scalars)}),
                    max_size=5)
records = st.one_of(
    json_values,
    st.fixed_dictionaries({"messages": st.one_of(messages, json_values)}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), scalars),
                           "completion": st.one_of(st.text(max_size=20), scalars)}),
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=20), scalars)}, optional={"extra": json_values}),
)


@given(records)
@settings(max_examples=400, deadline=None)
def test_parse_record_returns_example_or_bad_record(data):
    try:
        ex = parse_row(data)
    except BadRow as e:
        assert str(e)
        return
    assert isinstance(ex, Example)
    if ex.kind == "chat":
        assert any(m["role"] == "assistant" and m["content"].strip() for m in ex.messages)
    elif ex.kind == "pair":
        assert ex.completion.strip()
    else:
        assert ex.text.strip()


@given(st.lists(st.one_of(st.binary(max_size=40), records.map(lambda r: json.dumps(r).encode())), max_size=12))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_jsonl_reader_never_raises_and_counts_every_nonblank_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("h") / "d.jsonl"
    lines = [ln.replace(b"\n", b" ").replace(b"\r", b" ") for ln in lines]
    path.write_bytes(b"".join(ln + b"\n" for ln in lines))
    recs = list(iter_rows(str(path)))
    assert len(recs) == sum(1 for ln in lines if ln.strip())
    for r in recs:
        assert (r.error is None) or r.error.startswith(("invalid JSON", "invalid UTF-8"))
        assert r.where.startswith(str(path) + ":")
