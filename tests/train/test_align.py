"""Cross-tokenizer alignment (issue 46, train/align.py) on the tokenizer families tests/helpers builds: ids give
their bytes back exactly (multi-byte UTF-8 included), two families' tokenizations of one text are matched by byte
offsets, whitespace-leading and one-character answers keep their span, and a teacher's mapped top-k sums to 1 with
its tail."""
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from kdcache.train import align as al
from kdcache.train.align import ALIGNED, INSIDE, ONE_TO_ONE, NotByteExact
from tests.helpers.families import FAMILIES, corpus_texts, family_tokenizer

TEXTS = ["sql", "a", " aws, linux", "\nThe skills are python and sql.", "   padded   ",
         "naïve café — 日本語 🙂", "def one():\n    return 1\n", "tab\there", "x" * 40]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each family's tokenizer at two vocabulary sizes (other merges, other ids): {(family, size): tokenizer}."""
    from kdcache.demo.task import corpus, make_splits
    root = tmp_path_factory.mktemp("align")
    texts = corpus_texts() + list(corpus(make_splits(60, 0, seed=0)[0]))
    return {(f, n): family_tokenizer(f, str(root / f"{f}-{n}"), texts, vocab_size=n)
            for f in FAMILIES for n in (400, 700)}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_id_gives_its_bytes_back_and_texts_round_trip(families, family):
    tok = families[(family, 700)]
    pieces = al.token_bytes(tok)
    assert len(pieces) == len(tok)
    for text in TEXTS:
        ids = al.encode_exact(tok, pieces, text)
        assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")
        assert tok.decode(ids) == text
    for special in tok.all_special_tokens:
        assert pieces[tok.convert_tokens_to_ids(special)] == special.encode()


def test_a_normalizing_tokenizer_is_refused_naming_the_byte(families):
    """Qwen's tokenizers apply NFC: a decomposed accent comes back composed, so the text is not byte-exact."""
    tok = families[("chatml", 700)]
    decomposed = "cafe\u0301 menu"
    with pytest.raises(NotByteExact, match="first differing at byte 3"):
        al.encode_exact(tok, al.token_bytes(tok), decomposed)
    al.encode_exact(families[("llama3", 700)], al.token_bytes(families[("llama3", 700)]), decomposed)   # no normalizer


@pytest.mark.parametrize("teacher,student", [("llama3", "chatml"), ("gemma", "qwen3"), ("mistral", "llama3"),
                                             ("chatml", "gemma")])
def test_two_families_align_by_byte_offsets(families, teacher, student):
    t_tok, s_tok = families[(teacher, 700)], families[(student, 400)]
    t_pieces, s_pieces = al.token_bytes(t_tok), al.token_bytes(s_tok)
    seen = {ONE_TO_ONE: 0, ALIGNED: 0, INSIDE: 0}
    for text in TEXTS:
        t_ids, s_ids = al.encode_exact(t_tok, t_pieces, text), al.encode_exact(s_tok, s_pieces, text)
        ts, ss = al.starts(t_pieces, t_ids), al.starts(s_pieces, s_ids)
        a = al.align(ts, ss)
        assert len(a.kind) == len(s_ids) and sum(a.counts().values()) == len(s_ids)
        for i, (k, j) in enumerate(zip(a.kind, a.teacher)):
            seen[int(k)] += 1
            if k == INSIDE:
                assert j == -1 and ss[i] not in set(ts[:-1].tolist())     # starts inside a teacher token
                continue
            assert ts[j] == ss[i]                                       # both predict after the same bytes
            assert (ts[j + 1] == ss[i + 1]) == (k == ONE_TO_ONE)
            if k == ONE_TO_ONE:
                assert t_pieces[t_ids[j]] == s_pieces[s_ids[i]]
        assert a.kind[0] != INSIDE                                      # the answer's first token keeps its span
    assert seen[ONE_TO_ONE] > 0 and seen[INSIDE] > 0          # vocabularies of 700 and 400: both kinds occur


def test_a_one_character_and_a_whitespace_leading_answer_keep_their_span(families):
    t_tok, s_tok = families[("llama3", 700)], families[("chatml", 400)]
    t_pieces, s_pieces = al.token_bytes(t_tok), al.token_bytes(s_tok)
    for text in ("a", "\n", " x", "\n\nsql"):
        ts = al.starts(t_pieces, al.encode_exact(t_tok, t_pieces, text))
        ss = al.starts(s_pieces, al.encode_exact(s_tok, s_pieces, text))
        a = al.align(ts, ss)
        assert a.kind[0] != INSIDE and a.teacher[0] == 0 and ss[-1] == len(text.encode())
    with pytest.raises(NotByteExact, match="cover 3 and 2 bytes"):
        al.align(np.array([0, 3]), np.array([0, 2]))


def test_mapped_top_k_sums_to_one_with_the_tail_and_merges_equal_bytes(families):
    t_tok, s_tok = families[("llama3", 700)], families[("chatml", 400)]
    t_pieces, s_pieces = al.token_bytes(t_tok), al.token_bytes(s_tok)
    eot = {t_tok.convert_tokens_to_ids("<|eot_id|>"): s_tok.convert_tokens_to_ids("<|im_end|>")}
    t2s = al.vocab_map(t_pieces, s_pieces, eot)
    assert t2s[next(iter(eot))] == eot[next(iter(eot))]                   # the end of turn maps by role
    mapped = np.flatnonzero(t2s >= 0)
    missing = np.flatnonzero(t2s < 0)
    assert len(mapped) and len(missing)                                     # 700 against 400: some have none
    for t in mapped[:50]:
        if t not in eot:
            assert t_pieces[t] == s_pieces[t2s[t]]
    rng = np.random.default_rng(0)
    k = 8
    ids = np.stack([rng.choice(np.concatenate([mapped[:20], missing[:20]]), k, replace=False) for _ in range(16)])
    logits = rng.normal(size=(16, len(t_tok)))
    full = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    lp = np.take_along_axis(full, ids, 1)
    ids[3, -1] = -1                                                          # a padded slot
    s_ids, s_lp, tail = al.map_topk(ids, lp, t2s)
    total = np.exp(s_lp.astype(np.float64)).sum(1) + np.exp(tail)
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)
    for r in range(16):
        ok = s_ids[r] >= 0
        assert len(set(s_ids[r][ok].tolist())) == ok.sum()                     # one entry per student id
        want = sum(np.exp(lp[r, c]) for c in range(k) if ids[r, c] >= 0 and t2s[ids[r, c]] >= 0)
        np.testing.assert_allclose(np.exp(s_lp[r][ok].astype(np.float64)).sum(), want, rtol=1e-5)
    two = np.array([[mapped[0], mapped[1]]])                                  # two teacher ids, one student id
    t2s_merged = t2s.copy()
    t2s_merged[mapped[1]] = t2s[mapped[0]]
    s_ids, s_lp, tail = al.map_topk(two, np.log([[0.5, 0.2]]), t2s_merged)
    assert s_ids[0].tolist() == [t2s[mapped[0]], -1]
    np.testing.assert_allclose(np.exp(s_lp[0, 0]), 0.7, rtol=1e-6)
    np.testing.assert_allclose(np.exp(tail[0]), 0.3, rtol=1e-6)


@pytest.mark.parametrize("teacher,student", [("llama3", "chatml"), ("gemma", "qwen3")])
def test_each_teacher_token_maps_to_the_student_token_its_bytes_begin_with(families, teacher, student):
    t_tok, s_tok = families[(teacher, 700)], families[(student, 400)]
    t_pieces, s_pieces = al.token_bytes(t_tok), al.token_bytes(s_tok)
    added = set(t_tok.added_tokens_decoder)
    t2s = al.first_token_map(t_pieces, s_tok, s_pieces, added)
    equal = al.vocab_map(t_pieces, s_pieces)
    by_prefix = 0
    for t, b in enumerate(t_pieces):
        if equal[t] >= 0:
            assert t2s[t] == equal[t]                                  # the same bytes: the same token
        elif t in added or not b:
            assert t2s[t] == -1                                        # other markup has no student equivalent
        else:
            s = int(t2s[t])
            assert s >= 0 and s_pieces[s] and b.startswith(s_pieces[s]) and s_pieces[s] != b
            try:
                first = s_tok(b.decode("utf-8"), add_special_tokens=False)["input_ids"][0]
                assert s == first                                      # the student's own first token of it
            except UnicodeDecodeError:                                 # a byte fragment: the longest prefix
                assert not any(b.startswith(p) and len(p) > len(s_pieces[s]) for p in s_pieces if p != b)
            by_prefix += 1
    assert by_prefix > 50                                              # other merges: many tokens differ


def test_a_sentencepiece_vocabulary_gives_its_bytes_back(tmp_path):
    """Gemma-style: "\u2581" for a space, <0xNN> byte fallback for what the vocabulary lacks (the emoji here)."""
    vocab = {"<unk>": 0, "<eos>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "a", "b", "c", "é", "\u2581a", "ab", "\u2581ab"]:
        vocab[piece] = len(vocab)
    merges = [("\u2581", "a"), ("a", "b"), ("\u2581a", "b")]
    core = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    core.normalizer = normalizers.Replace(" ", "\u2581")
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    pieces = al.token_bytes(tok)
    assert pieces[vocab["\u2581ab"]] == b" ab" and pieces[vocab["<0xF0>"]] == b"\xf0"
    for text in ("ab ab c", "é 🙂 ab", " a"):
        ids = al.encode_exact(tok, pieces, text)
        assert b"".join(pieces[i] for i in ids) == text.encode()
    assert any(pieces[i] == b"\xf0" for i in al.encode_exact(tok, pieces, "🙂"))


def test_a_tokenizer_of_another_kind_is_refused_by_name(tmp_path):
    core = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    core.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    with pytest.raises(ValueError, match="neither byte-level BPE nor SentencePiece"):
        al.token_bytes(tok)


@pytest.mark.parametrize("pieces", ["sentencepiece", "sentencepiece-prefix", "sentencepiece-legacy"])
def test_the_sentencepiece_family_fixtures_have_the_real_shapes(tmp_path, pieces):
    """tests/helpers/families.py's SentencePiece-style tokenizers (the pairs test_cross_tokenizer trains): "\\u2581"
    spaces, byte fallback for a character the vocabulary lacks, and for -prefix a dummy-prefix space on a text's
    first piece that the decoder strips; token_bytes gives each piece's bytes back."""
    tok = family_tokenizer("mistral", str(tmp_path / "tok"), corpus_texts(), vocab_size=600, pieces=pieces)
    assert al._decoder_kind(tok) == "sentencepiece"
    got = tok.convert_ids_to_tokens(tok("a b ∰", add_special_tokens=False)["input_ids"])
    assert got[0] == ("a" if pieces == "sentencepiece" else "\u2581a") and "\u2581" in "".join(got)
    assert [p for p in got if p.startswith("<0x")] == ["<0xE2>", "<0x88>", "<0xB0>"]       # ∰ by its bytes
    assert tok.decode(tok("a b ∰", add_special_tokens=False)["input_ids"]) == "a b ∰"
    text = "def f():\n    return 1  # naïve 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    lead = b"" if pieces == "sentencepiece" else b" "
    assert b"".join(al.token_bytes(tok)[i] for i in ids) == lead + text.encode()
    # sequence_pieces takes the dummy prefix off: on the first piece, and for -legacy after each special token
    eos = tok.convert_tokens_to_ids("</s>")
    ids = tok("a b</s>c", add_special_tokens=False)["input_ids"]
    raw = [al.token_bytes(tok)[i] for i in ids]
    assert eos in ids and b"".join(raw) == {"sentencepiece": b"a b</s>c", "sentencepiece-prefix": b" a b</s>c",
                                            "sentencepiece-legacy": b" a b</s> c"}[pieces]
    seq = al.sequence_pieces(al.token_bytes(tok), ids, tok.added_tokens_decoder, al.dummy_prefix(tok))
    assert b"".join(seq) == b"a b</s>c"
    assert al.dummy_prefix(tok) == {"sentencepiece": "", "sentencepiece-prefix": "first",
                                    "sentencepiece-legacy": "every"}[pieces]


def test_a_prefixing_student_maps_a_teacher_word_to_what_it_writes_inside_a_text(tmp_path):
    """A student whose tokenizer writes a dummy-prefix space (Llama 2, Mistral v0.1) tokenizes a teacher piece
    " docker" on its own as "\\u2581" (the dummy) then "\\u2581docker"...; inside a text it writes no dummy, so the
    teacher's piece maps to the student token of its first bytes, never to the dummy space alone."""
    from tests.helpers.families import corpus_texts, family_tokenizer
    texts = corpus_texts()
    t_tok = family_tokenizer("chatml", str(tmp_path / "t"), texts, vocab_size=700)
    flat = [" ".join(t.split()) for t in texts[::-1]]      # no runs of spaces: the vocabulary has no "\u2581\u2581"
    s_tok = family_tokenizer("mistral", str(tmp_path / "s"), flat, vocab_size=500, pieces="sentencepiece-legacy")
    assert "\u2581\u2581" not in s_tok.get_vocab()
    t_pieces, s_pieces = al.token_bytes(t_tok), al.token_bytes(s_tok)
    space = s_pieces.index(b" ")
    words = [t for t, b in enumerate(t_pieces) if len(b) > 2 and b[:1] == b" " and b[1:2].isalpha()
             and b" " + b[1:2] in s_pieces and b not in s_pieces]
    assert len(words) > 20
    old = al.first_token_map(t_pieces, s_tok, s_pieces, t_tok.added_tokens_decoder)
    new = al.first_token_map(t_pieces, s_tok, s_pieces, t_tok.added_tokens_decoder,
                             student_prefix=al.dummy_prefix(s_tok))
    assert sum(old[t] == space for t in words) > len(words) // 2       # the dummy, were the prefix not known
    assert not any(new[t] == space for t in words)
    assert all(t_pieces[t].startswith(s_pieces[new[t]]) and len(s_pieces[new[t]]) >= 2 for t in words)
