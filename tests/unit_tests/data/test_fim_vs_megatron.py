"""Fill-in-the-middle samples (--fim-data) against megatron-core 0.19.2's own GPTFIMDataset: the same .bin/.idx,
seed and tokenizer give the same tokens, sample for sample, read in the same order."""

import typing

import numpy as np
import pytest
from testlib.data import random_docs, write_dataset

from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.fim_dataset import FimConfig, FimGPTDataset
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig

if not hasattr(typing, "override"):
    typing.override = lambda f: f

SEQ = 48
CHARS = "abcdefghijklmnopqrstuvwxyz \n.,:;()=+-*/0123456789"  # ids 0..49; "\n" (27) splits fragments
SPECIAL = {"<eod>": 50, "<fim_prefix>": 51, "<fim_middle>": 52, "<fim_suffix>": 53, "<fim_pad>": 54}


class CharTokenizer:
    """One character per id, and five special tokens; both sides read it (megatron-core as ``_tokenizer``)."""

    def tokens_to_ids(self, tokens):
        one = SPECIAL.get(tokens, CHARS.find(tokens)) if isinstance(tokens, str) else None
        return one if one is not None else [self.tokens_to_ids(t) for t in tokens]

    def ids_to_text(self, ids, remove_special_tokens=None):
        assert remove_special_tokens  # what GPTFIMDataset asks for
        return "".join(CHARS[i] for i in ids if i < len(CHARS))

    def text_to_ids(self, text):
        return [CHARS.index(c) for c in text]

    def fim_text(self, ids):  # this repository's FimTokenizer protocol
        return self.ids_to_text(ids, remove_special_tokens=True)

    fim_ids = text_to_ids


class _MegatronTok:
    eod, pad, vocab_size = 50, 54, 55
    _tokenizer = CharTokenizer()

    def __getattr__(self, name):  # unique_identifiers and the like
        return None


def _corpus(tmp_path):
    docs = random_docs(3, 300, max_len=40, vocab=50, eod=50)
    docs += [np.array([50])] * 5  # empty documents: consecutive EODs in a sample
    prefix = str(tmp_path / "fim")
    write_dataset(prefix, docs)
    return prefix


def _megatron(prefix, cache, **fim):
    builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

    extra = {
        "prefix": "<fim_prefix>",
        "middle": "<fim_middle>",
        "suffix": "<fim_suffix>",
        "pad": "<fim_pad>",
        "eod": "<eod>",
    }
    cfg = GPTFIMDatasetConfig(
        random_seed=1234,
        sequence_length=SEQ,
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=cache,
        tokenizer=_MegatronTok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
        fim_extra_tokens=extra,
        **fim,
    )
    return builder.BlendedMegatronDatasetBuilder(GPTFIMDataset, [200, 0, 0], lambda: True, cfg).build()[0]


def _ours(prefix, cache, rate, spm_rate, split_sample=None, fragment_rate=None, no_prefix=None):
    tok = CharTokenizer()
    fim = FimConfig(
        tok,
        rate,
        spm_rate,
        prefix_id=51,
        middle_id=52,
        suffix_id=53,
        pad_id=54,
        eod_id=50,
        split_sample_id=tok.tokens_to_ids(split_sample) if split_sample else None,
        fragment_rate=fragment_rate,
        no_prefix=no_prefix,
    )
    config = GPTDatasetConfig(sequence_length=SEQ, split="1,0,0", path_to_cache=cache, fim=fim)
    return build_train_valid_test_datasets([prefix], "1,0,0", (200, 0, 0), config)[0]


SETTINGS = {
    "psm_and_spm": {"fim_rate": 0.9, "fim_spm_rate": 0.5},
    "fragments": {"fim_rate": 0.8, "fim_spm_rate": 0.3, "fim_split_sample": "\n", "fim_fragment_rate": 0.7},
    "no_prefix": {"fim_rate": 1.0, "fim_spm_rate": 0.5, "fim_no_prefix": "a"},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_fim_samples_match_megatron_core(tmp_path, name):
    prefix = _corpus(tmp_path)
    fim = SETTINGS[name]
    theirs = _megatron(prefix, str(tmp_path / "mcache"), **fim)
    ours = _ours(
        prefix,
        str(tmp_path / "cache"),
        fim["fim_rate"],
        fim["fim_spm_rate"],
        fim.get("fim_split_sample"),
        fim.get("fim_fragment_rate"),
        fim.get("fim_no_prefix"),
    )
    assert isinstance(ours, FimGPTDataset) and len(ours) == len(theirs)
    transformed = fragments = 0
    for i in range(len(ours)):
        text = theirs._query_document_sample_shuffle_indices(i)[0]
        got = ours.get_text(i)
        np.testing.assert_array_equal(got, text, err_msg=f"sample {i}")
        transformed += bool(np.isin(got, [51, 53]).any())
        fragments += int(np.sum((got[:-1] == 27) & (got[1:] == 51)))  # a fragment after a split token, FIM'd
    assert transformed > len(ours) // 4  # the transform ran, in many samples
    assert (fragments > 0) == ("fim_split_sample" in fim)


def test_run_tokenizer_as_fim_tokenizer(tmp_path):
    """A GPT-2 BPE tokenizer of the run: a token string of the vocabulary is its id; one that is not maps to
    <|endoftext|> (megatron-core's GPT-2 tokenizer gives its unknown token, <|endoftext|>); the text of a piece
    leaves the special tokens out."""
    import json

    pytest.importorskip("tokenizers")
    from megatron_cai.training.flags.fim import FimSettings, fim_config
    from megatron_cai.training.tokenizer import GPT2BPETokenizer

    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "c": 2, "<|endoftext|>": 3, "Ġ": 4}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    settings = FimSettings(
        0.5, 0.5, ("<fim_prefix>", "b", "c", "<fim_pad>", "<|endoftext|>"), split_sample="a", fragment_rate=0.5
    )
    fim = fim_config(settings, tok)
    assert (fim.prefix_id, fim.middle_id, fim.suffix_id, fim.pad_id, fim.eod_id, fim.split_sample_id) == (
        3,
        1,
        2,
        3,
        3,
        0,
    )
    assert fim.tokenizer.fim_text(np.array([0, 3, 4, 1, 2])) == "a "  # b, c: FIM tokens here; 3: EOD
    assert fim.tokenizer.fim_ids("a b") == [0, 4, 1]
