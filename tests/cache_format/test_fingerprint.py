import pytest

from kdcache.cache_format import FingerprintError, fingerprint, hash_tree
from kdcache.cache_format.fingerprint import canonical_json, diff_parts


def test_invariant_to_key_order():
    a = {"teacher": {"w": "abc", "cfg": {"x": 1, "y": [1, 2]}}, "k": 64}
    b = {"k": 64, "teacher": {"cfg": {"y": [1, 2], "x": 1}, "w": "abc"}}
    assert fingerprint(a) == fingerprint(b)


@pytest.mark.parametrize("change", [
    lambda d: d.update(k=65),
    lambda d: d.update(k=64.0),            # int and float are different settings
    lambda d: d.update(k="64"),
    lambda d: d["teacher"].update(w="abd"),
    lambda d: d.update(extra=None),
])
def test_changes_when_content_changes(change):
    base = {"teacher": {"w": "abc"}, "k": 64}
    other = {"teacher": dict(base["teacher"]), "k": 64}
    change(other)
    assert fingerprint(base) != fingerprint(other)


@pytest.mark.parametrize("bad", [{"x": object()}, {"x": float("nan")}, {1: "int key"}, {"p": b"bytes"}])
def test_unhashable_is_an_error_naming_the_key(bad):
    with pytest.raises(FingerprintError, match=r"\$"):
        canonical_json(bad)


def test_tree_hash_ignores_paths_and_mtimes(tmp_path):
    for root in ("a", "b"):
        (tmp_path / root / "sub").mkdir(parents=True)
        (tmp_path / root / "sub" / "w.bin").write_bytes(b"weights")
        (tmp_path / root / "config.json").write_text("{}")
    assert hash_tree(tmp_path / "a") == hash_tree(tmp_path / "b")
    (tmp_path / "b" / "sub" / "w.bin").write_bytes(b"weightz")
    assert hash_tree(tmp_path / "a") != hash_tree(tmp_path / "b")


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(FingerprintError, match="no such file"):
        hash_tree(tmp_path / "nope")


def test_diff_parts_names_changes():
    assert diff_parts({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 0}) == ["b", "c"]
