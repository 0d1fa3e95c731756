"""Rule 2, token-exact: the student's tokenizer must be the one the cache's ids came from (fast, no DeepSpeed)."""
import copy

import pytest

from kdcache.cache_format.tokenizer_id import tokenizer_identity
from kdcache.common.errors import TokenizerMismatch
from kdcache.demo.tokenizer import train_tokenizer
from kdcache.train.model import check_tokenizer


def manifest_of(tok):
    return {"meta": {"tokenizer": tokenizer_identity(tok)}}


def test_the_same_tokenizer_passes(tiny):
    check_tokenizer(copy.deepcopy(tiny["tok"]), manifest_of(tiny["tok"]), "cache/")


def test_an_added_token_is_refused_naming_the_vocabulary_size(tiny):
    other = copy.deepcopy(tiny["tok"])
    other.add_tokens(["<extra>"])
    with pytest.raises(TokenizerMismatch, match=r"cache/.*vocabulary size 400 in the cache, 401 here"):
        check_tokenizer(other, manifest_of(tiny["tok"]), "cache/")


def test_same_size_other_tokens_is_refused(tiny, tmp_path):
    from kdcache.demo.task import corpus
    reversed_text = [t[::-1] for t in corpus(tiny["train"])]       # other merges, the same alphabet
    other = train_tokenizer(reversed_text, str(tmp_path), vocab_size=len(tiny["tok"]))
    assert len(other) == len(tiny["tok"])                          # the size alone cannot tell them apart
    with pytest.raises(TokenizerMismatch, match="same size, different token strings or ids"):
        check_tokenizer(other, manifest_of(tiny["tok"]), "cache/")


def test_a_base_tokenizer_of_the_same_vocabulary_passes(tiny):
    """An instruct teacher (EOS <|im_end|>) and a base student (EOS <|endoftext|>, no template): every id is the
    same, which is all training on cached ids needs."""
    other = copy.deepcopy(tiny["tok"])
    other.eos_token, other.chat_template = "<|endoftext|>", None
    check_tokenizer(other, manifest_of(tiny["tok"]), "cache/")


def test_a_cache_without_a_recorded_tokenizer_is_refused(tiny):
    with pytest.raises(TokenizerMismatch, match="records no tokenizer"):
        check_tokenizer(tiny["tok"], {"meta": {}}, "cache/")
