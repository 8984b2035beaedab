"""The exported Hugging Face tokenizer treats literal <s>, </s>, <unk> in text as sentencepiece does: as text."""
import pytest

pytest.importorskip("transformers")

TEXTS = ["a <s> b </s> c <unk> d", "<s>", "</s>", "<unk>", "x</s>y<s>z", "plain text, no markers", "<s><s></s>"]


@pytest.mark.parametrize("model_type", ["bpe"])  # tools/train_tokenizer.py's; see the note below
def test_literal_special_markers_encode_as_sentencepiece(tmp_path, model_type):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from megatron_cai.interop.hf_tokenizer import save_hf_tokenizer

    corpus = [f"line {i}: the quick brown fox <s> jumps </s> over <unk> the lazy dog" for i in range(300)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "m"), vocab_size=60,
                                   model_type=model_type, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   character_coverage=1.0)
    out = tmp_path / "hf"
    out.mkdir()
    ids = save_hf_tokenizer("SentencePieceTokenizer", str(tmp_path / "m.model"), str(out))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert (ids["bos_token_id"], ids["eos_token_id"]) == (sp.bos_id(), sp.eos_id())
    for text in TEXTS:
        expected = sp.encode(text)
        assert sp.bos_id() not in expected and sp.eos_id() not in expected  # sentencepiece keeps them as text
        assert list(hf(text)["input_ids"]) == expected, text
# Unigram models: the Hugging Face Unigram model may still pick the control piece "<s>" by Viterbi where
# sentencepiece never does (not covered here).
