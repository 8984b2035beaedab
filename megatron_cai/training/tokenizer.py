"""Tokenizers behind one small interface (Megatron's ``--tokenizer-type`` names).

Every tokenizer offers ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``vocab_size``,
``eod`` (the end-of-document id that ``--append-eod`` writes and ``--eod-mask-loss`` /
``--reset-position-ids`` look for), and ``bos`` / ``pad`` (``None`` when the tokenizer has none).

* ``SentencePieceTokenizer``: a ``.model`` file. **EOD is the sentencepiece EOS piece** (``</s>``,
  ``sp.eos_id()``; id 2 in models trained by ``tools/train_tokenizer.py``). A model without an EOS
  piece falls back to a piece named ``<EOD>`` or ``<|endoftext|>``; if none exists, ``eod`` raises.
* ``HuggingFaceTokenizer``: a local ``tokenizer.json`` file or a local directory loadable by
  ``transformers.AutoTokenizer`` (``local_files_only``; nothing is downloaded). EOD is the EOS token.
* ``NullTokenizer``: text is whitespace-separated integer ids (for tests). As in Megatron, ids are
  ``0..vocab_size-1`` and EOD is the extra id ``vocab_size``, so ``tokenizer.vocab_size`` is
  ``--vocab-size + 1``.

This module imports neither torch nor argparse, so preprocessing workers start fast.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


class MegatronTokenizer:
    """Common interface; subclasses implement ``tokenize``, ``detokenize`` and the properties."""

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    @property
    def bos(self) -> int | None:
        return None

    @property
    def pad(self) -> int | None:
        return None


class SentencePieceTokenizer(MegatronTokenizer):
    """A sentencepiece ``.model``; EOD is its EOS piece (see the module docstring)."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece as spm

        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-model {model_file}: sentencepiece model file not found")
        self.model_file = model_file
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"--tokenizer-model {model_file}: not a sentencepiece model ({e})") from None
        self._eod = self._sp.eos_id()
        if self._eod < 0:
            for piece in ("<EOD>", "<|endoftext|>"):
                pid = self._sp.piece_to_id(piece)
                if pid != self._sp.unk_id():
                    self._eod = pid
                    break

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        if self._eod < 0:
            raise ValueError(f"{self.model_file} has no EOS/<EOD> piece; --append-eod cannot be used")
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad(self) -> int | None:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def id_to_piece(self, token_id: int) -> str:
        """The sentencepiece piece of an id (for inspection)."""
        return self._sp.id_to_piece(int(token_id))


class HuggingFaceTokenizer(MegatronTokenizer):
    """A local Hugging Face tokenizer (``tokenizer.json`` file or a saved tokenizer directory)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tok = None  # tokenizers.Tokenizer
        self._hf = None  # transformers tokenizer
        if os.path.isfile(path):
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ImportError("HuggingFaceTokenizer needs the 'tokenizers' package") from None
            try:
                self._tok = Tokenizer.from_file(path)
            except Exception as e:  # tokenizers raises a plain Exception on bad files
                raise ValueError(f"--tokenizer-model {path}: not a tokenizer.json ({e})") from None
        elif os.path.isdir(path):
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ImportError("HuggingFaceTokenizer on a directory needs 'transformers'") from None
            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        else:
            raise FileNotFoundError(
                f"--tokenizer-model {path}: no such local file or directory (tokenizers are never downloaded)"
            )
        self._eod = self._find_special("eos_token_id", ("</s>", "<|endoftext|>", "<eos>", "<EOD>"))
        self._bos = self._find_special("bos_token_id", ("<s>", "<bos>"))
        self._pad = self._find_special("pad_token_id", ("<pad>", "[PAD]"))

    def _find_special(self, attr: str, names: Sequence[str]) -> int | None:
        """The transformers attribute when set, else the first of ``names`` in the vocabulary."""
        if self._hf is not None:
            value = getattr(self._hf, attr, None)
            if value is not None:
                return int(value)
            vocab = self._hf.get_vocab()
        else:
            vocab = self._tok.get_vocab(with_added_tokens=True)
        for name in names:
            if name in vocab:
                return int(vocab[name])
        return None

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise ValueError(f"{self.path} has no EOS token; --append-eod cannot be used")
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int | None:
        return self._pad


class NullTokenizer(MegatronTokenizer):
    """Text is whitespace-separated integer ids in ``[0, vocab_size)``; EOD is ``vocab_size``."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError("NullTokenizer needs --vocab-size >= 1")
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise ValueError(f"NullTokenizer expects integers, got {word[:40]!r}") from None
            if not 0 <= i < self._n:
                raise ValueError(f"NullTokenizer id {i} is outside [0, {self._n})")
            ids.append(i)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None,
                    **unused) -> MegatronTokenizer:
    """Build a tokenizer by Megatron type name (see ``TOKENIZER_TYPES``).

    ``tokenizer_model`` is the ``.model`` (SentencePiece) or a local ``tokenizer.json``/directory
    (HuggingFace); ``vocab_size`` is required by ``NullTokenizer`` only. Extra keyword arguments
    (other Megatron tokenizer flags) are accepted and ignored.
    """
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a local path)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; "
                     f"choose one of {', '.join(TOKENIZER_TYPES)}")


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Round the vocabulary up to a multiple of ``make_vocab_size_divisible_by * TP`` (Megatron rule)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return ((orig_vocab_size + multiple - 1) // multiple) * multiple
