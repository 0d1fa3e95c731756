"""A teacher view (privileged context, SPEC.md 4.5): a record may carry the token ids its teacher scored
(teacher_input_ids, e.g. with a hint in the system prompt) and, per trained position, the teacher position that
scored it. Both backends store it beside the student's ids and read it back; a view that does not score the
student's trained tokens is refused by the writer and by the reader's value checks, naming sample and position."""
import dataclasses

import numpy as np
import pytest

from kdcache.cache_format import layout, open_cache, write_cache
from kdcache.cache_format.errors import RecordError
from kdcache.cache_format.record import check_record
from kdcache.cache_format.values import Rules, block_problem
from tests.helpers.records import make_records, writer_kwargs


def with_view(rec, hint=(7, 8, 9)):
    """rec as a teacher saw it with `hint` ids inserted after its first token: the same trained tokens, each
    position shifted by len(hint)."""
    t_ids = np.concatenate([rec.input_ids[:1], np.asarray(hint, np.int32), rec.input_ids[1:]])
    return dataclasses.replace(rec, teacher_input_ids=t_ids, teacher_positions=rec.positions + len(hint))


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_teacher_view_is_stored_beside_the_students_ids_and_read_back(tmp_path, backend):
    recs = make_records(12, seed=3)
    recs = [with_view(r) if i % 3 else r for i, r in enumerate(recs)]      # samples 0, 3, 6, 9: no view
    write_cache(tmp_path / "c", recs, shard_size=5, **writer_kwargs(backend))
    got = list(open_cache(str(tmp_path / "c")))
    assert [r.sample_id for r in got] == list(range(12))
    for want, r in zip(recs, got):
        np.testing.assert_array_equal(r.input_ids, want.input_ids)
        np.testing.assert_array_equal(r.positions, want.positions)
        if want.teacher_input_ids is None:
            assert r.teacher_input_ids is None and r.teacher_positions is None
        else:
            np.testing.assert_array_equal(r.teacher_input_ids, want.teacher_input_ids)
            np.testing.assert_array_equal(r.teacher_positions, want.teacher_positions)
            np.testing.assert_array_equal(r.teacher_input_ids[r.teacher_positions + 1], r.targets)


@pytest.mark.parametrize("backend", ["arrow", "zarr"])
def test_a_cache_without_views_has_no_teacher_columns(tmp_path, backend):
    write_cache(tmp_path / "c", make_records(4), shard_size=4, **writer_kwargs(backend))
    assert all(r.teacher_input_ids is None for r in open_cache(str(tmp_path / "c")))


def test_the_writer_refuses_a_view_that_scores_other_tokens():
    rec = with_view(make_records(1, seed=5)[0])
    shifted = dataclasses.replace(rec, teacher_positions=rec.teacher_positions - 1)
    with pytest.raises(RecordError, match=r"sample 0: position \d+ trains token \d+, but its teacher position"):
        check_record(shifted, 8, 300)
    with pytest.raises(RecordError, match="come together"):
        check_record(dataclasses.replace(rec, teacher_positions=None), 8, 300)
    with pytest.raises(RecordError, match="strictly increasing"):
        check_record(dataclasses.replace(rec, teacher_positions=rec.teacher_positions[::-1].copy()), 8, 300)
    check_record(rec, 8, 300)


def test_the_readers_value_checks_name_a_stored_view_that_scores_other_tokens():
    recs = [check_record(r, 8, 300) for r in [with_view(r) for r in make_records(3, seed=9)]]
    cols = layout.encode(recs, top_k=8, logprob_dtype="float32")
    dec = layout.Decoded(cols, top_k=8, logprob_dtype="float32")
    rules = Rules(vocab_size=300, top_k=8, ragged=False, sample=0)
    assert block_problem(cols, dec.ids, dec.lps, dec.draws, "float32", rules) is None
    s1 = int(cols.position_offsets[1])                       # sample 1's first position
    at = int(cols.teacher_token_offsets[1] + cols.teacher_positions[s1] + 1)
    cols.teacher_input_ids[at] = (cols.teacher_input_ids[at] + 1) % 300
    problem = block_problem(cols, dec.ids, dec.lps, dec.draws, "float32", rules)
    assert problem.startswith(f"sample 1 position {int(cols.positions[s1])}: trains token") and \
        "teacher view must score the same tokens" in problem, problem
