"""Write the tokenizer a run used as a Hugging Face tokenizer directory (``AutoTokenizer`` loads it offline).

* A sentencepiece ``.model`` becomes a ``tokenizers`` pipeline that follows the model's own settings:
  the normalizer spec (precompiled character map, extra-whitespace removal, whitespace escaping to
  ``▁``, dummy prefix), BPE merges ranked by piece score (or the Unigram pieces and scores), byte
  fallback, and user-defined pieces (``\\n`` for ``tools/train_tokenizer.py`` models) kept whole.
  Encoding matches ``SentencePieceTokenizer.tokenize`` (checked by ``compare_encodings``). **No BOS
  or EOS is added**: our training data has none (documents are separated by EOD = ``</s>``), so
  ``tokenizer(text)`` gives exactly the ids the model was trained on. The ``.model`` file is copied
  next to it as ``tokenizer.model``.
* A Hugging Face ``tokenizer.json`` is wrapped with its special tokens; a saved tokenizer directory is
  copied.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence

SAMPLE_TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    if x > 10:\n        return x ** 2  # square\n\treturn -1\n",
    "  leading and   repeated   spaces  \n\n\ntrailing   ",
    "numbers 1234567890 3.14159 0x1F 1e-5",
    "unicode: naïve café Ωmega ✓ 日本語 😀",
    "",
    " ",
)


def _spm_proto(path: str):
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:  # the generated module needs protobuf
        raise ImportError(f"exporting a sentencepiece tokenizer needs the 'protobuf' package ({e})") from None

    proto = pb.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def spm_to_tokenizers(model_file: str):
    """A ``tokenizers.Tokenizer`` that encodes like ``SentencePieceProcessor.encode`` (no BOS/EOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = _spm_proto(model_file)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    pieces = list(proto.pieces)
    unk = pieces[trainer.unk_id].piece if 0 <= trainer.unk_id < len(pieces) else None
    user_defined = [p.piece for p in pieces if p.type == 4]
    if trainer.model_type == 2:  # BPE
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == 1}
        ranked = []
        for piece, (score, idx) in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, idx, left, right))
        merges = [(a, b) for _, _, a, b in sorted(ranked)]
        model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                           byte_fallback=trainer.byte_fallback, ignore_merges=False)
    elif trainer.model_type == 1:  # Unigram
        model = models.Unigram([(p.piece, p.score) for p in pieces], trainer.unk_id, trainer.byte_fallback)
    else:
        raise ValueError(f"{model_file}: sentencepiece model type {trainer.model_type} is not supported for export "
                         "(BPE and Unigram are)")
    tok = Tokenizer(model)
    norm = []
    if spec.precompiled_charsmap:
        norm.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        norm += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        norm.append(normalizers.Prepend(" "))
    if spec.escape_whitespaces:
        norm.append(normalizers.Replace(" ", "▁"))
    if norm:
        tok.normalizer = normalizers.Sequence(norm)
    if user_defined:  # emitted whole, never merged with their neighbours
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    dec = [decoders.Replace("▁", " ")]
    if trainer.byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _special(proto, idx: int) -> str | None:
    return proto.pieces[idx].piece if 0 <= idx < len(proto.pieces) else None


def save_hf_tokenizer(tokenizer_type: str, source: str, out_dir: str, model_max_length: int | None = None) -> dict:
    """Write tokenizer files into ``out_dir``; returns ``{"bos_token_id", "eos_token_id", "pad_token_id"}``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(source):
        for name in os.listdir(source):
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), out_dir)
        hf = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    elif tokenizer_type == "HuggingFaceTokenizer":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(source)
        vocab = tok.get_vocab(with_added_tokens=True)
        specials = {k: next((t for t in names if t in vocab), None) for k, names in
                    {"eos_token": ("</s>", "<|endoftext|>", "<eos>", "<EOD>"), "bos_token": ("<s>", "<bos>"),
                     "pad_token": ("<pad>", "[PAD]"), "unk_token": ("<unk>", "[UNK]")}.items()}
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in specials.items() if v})
    elif tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        proto = _spm_proto(source)
        t = proto.trainer_spec
        specials = {"unk_token": _special(proto, t.unk_id), "bos_token": _special(proto, t.bos_id),
                    "eos_token": _special(proto, t.eos_id), "pad_token": _special(proto, t.pad_id)}
        hf = PreTrainedTokenizerFast(tokenizer_object=spm_to_tokenizers(source), clean_up_tokenization_spaces=False,
                                     split_special_tokens=True,
                                     **{k: v for k, v in specials.items() if v})
        shutil.copy2(source, os.path.join(out_dir, "tokenizer.model"))
    else:
        raise ValueError(f"tokenizer type {tokenizer_type} cannot be exported to Hugging Face")
    if model_max_length:
        hf.model_max_length = model_max_length
    hf.save_pretrained(out_dir)
    return {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id, "pad_token_id": hf.pad_token_id}


def compare_encodings(ours, hf_dir: str, texts: Sequence[str] = SAMPLE_TEXTS) -> list[str]:
    """Texts on which ``AutoTokenizer.from_pretrained(hf_dir)`` and our tokenizer give different ids."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return [t for t in texts
            if list(hf(t, add_special_tokens=True, verbose=False)["input_ids"]) != list(ours.tokenize(t))]
