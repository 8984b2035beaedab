"""Tokenizers behind one small interface (Megatron's ``--tokenizer-type`` names).

Every tokenizer offers ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``vocab_size``,
``eod`` (the end-of-document id that ``--append-eod`` writes and ``--eod-mask-loss`` /
``--reset-position-ids`` look for), and ``bos`` / ``pad`` (``None`` when the tokenizer has none).

* ``SentencePieceTokenizer``: a ``.model`` file. **EOD is the sentencepiece EOS piece** (``</s>``,
  ``sp.eos_id()``; id 2 in models trained by ``tools/train_tokenizer.py``). A model without an EOS
  piece falls back to a piece named ``<EOD>`` or ``<|endoftext|>``; if none exists, ``eod`` raises.
* ``HuggingFaceTokenizer``: a local ``tokenizer.json`` file or a local directory loadable by
  ``transformers.AutoTokenizer`` (``local_files_only``; nothing is downloaded). EOD is the EOS token.
* ``GPTSentencePieceTokenizer``: the same as ``SentencePieceTokenizer`` (Megatron's GPT variant encodes
  text as plain sentencepiece ids; EOD is EOS).
* ``Llama2Tokenizer``: a sentencepiece ``.model``; every document starts with BOS, as Megatron's
  ``Llama2Tokenizer.tokenize`` (``bos=True, eos=False``) writes it.
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file``
  (merges.txt), run by the Hugging Face ``tokenizers`` library. EOD is ``<|endoftext|>``.
* ``TikTokenizer``: Megatron's tiktoken format, a local JSON list of ``{rank, token_bytes, token_str}``
  (``--tokenizer-model``), with ``--tiktoken-pattern v1|v2`` and ``--tiktoken-num-special-tokens`` special
  ids first (``<unk> <s> </s> <mask> <pad> <cls> <sep>``, then fillers); EOD is ``</s>``. Needs ``tiktoken``;
  nothing is downloaded.
* ``NullTokenizer``: text is whitespace-separated integer ids (for tests). As in Megatron, ids are
  ``0..vocab_size-1`` and EOD is the extra id ``vocab_size``, so ``tokenizer.vocab_size`` is
  ``--vocab-size + 1``.

This module imports neither torch nor argparse, so preprocessing workers start fast.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
                   "TikTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


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


class Llama2Tokenizer(SentencePieceTokenizer):
    """A sentencepiece model that starts every document with BOS (Megatron's Llama2Tokenizer)."""

    def tokenize(self, text: str) -> list[int]:
        if self.bos is None:
            raise ValueError(f"{self.model_file} has no BOS piece, which Llama2Tokenizer prepends")
        return [self.bos, *self._sp.encode(text, out_type=int)]


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE from vocab.json + merges.txt, through the Hugging Face ``tokenizers`` library."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag}")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path}: file not found")
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        except ImportError:
            raise ImportError("GPT2BPETokenizer needs the 'tokenizers' package (pip install -e .[hf])") from None
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # tokenizers raises a plain Exception on bad files
            raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not GPT-2 BPE files ({e})") \
                from None
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._vocab = self._tok.get_vocab()
        self.vocab_file = vocab_file

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        if "<|endoftext|>" not in self._vocab:
            raise ValueError(f"--vocab-file {self.vocab_file} has no <|endoftext|> token; --append-eod cannot be used")
        return self._vocab["<|endoftext|>"]


TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+",
}


class TikTokenizer(MegatronTokenizer):
    """Megatron's TikTokenizer: a local tiktoken vocabulary JSON, special tokens on the first ids."""

    def __init__(self, path: str | None, pattern: str | None = "v2", num_special_tokens: int = 1000,
                 special_tokens: Sequence[str] | None = None, vocab_size: int | None = None) -> None:
        import base64
        import json

        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"--tokenizer-model {path}: tiktoken vocabulary JSON not found (TikTokenizer "
                                    f"reads a local file; nothing is downloaded)")
        try:
            import tiktoken
        except ImportError:
            raise ImportError("TikTokenizer needs the 'tiktoken' package (pip install -e .[hf])") from None
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        specials = list(special_tokens) if special_tokens else list(TIKTOKEN_SPECIAL_TOKENS)
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in specials]
        if missing or len(set(specials)) != len(specials) or len(specials) > num_special_tokens:
            raise ValueError(f"--tiktoken-special-tokens must be unique, include {' '.join(TIKTOKEN_SPECIAL_TOKENS)} "
                             f"and number at most --tiktoken-num-special-tokens {num_special_tokens}")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        try:
            with open(path) as f:
                entries = json.load(f)
            ranks = {}
            for i, e in enumerate(entries):
                if e["rank"] != i:
                    raise ValueError(f"entry {i} has rank {e['rank']}")
                ranks[base64.b64decode(e["token_bytes"])] = i + num_special_tokens
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--tokenizer-model {path}: not a tiktoken vocabulary JSON ({e})") from None
        if vocab_size is not None:  # Megatron cuts the BPE ranks to --vocab-size minus the special ids
            ranks = {b: r for b, r in ranks.items() if r < vocab_size}
        self._n = num_special_tokens + len(ranks)
        self.special_tokens = specials
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
                                      mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(specials)})

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self.special_tokens.index("</s>")

    @property
    def bos(self) -> int | None:
        return self.special_tokens.index("<s>")

    @property
    def pad(self) -> int | None:
        return self.special_tokens.index("<pad>")


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
                    vocab_file: str | None = None, merge_file: str | None = None, tiktoken_pattern: str | None = None,
                    tiktoken_num_special_tokens: int = 1000, tiktoken_special_tokens: Sequence[str] | None = None,
                    **unused) -> MegatronTokenizer:
    """Build a tokenizer by Megatron type name (see ``TOKENIZER_TYPES``).

    ``tokenizer_model`` is the ``.model`` (SentencePiece) or a local ``tokenizer.json``/directory
    (HuggingFace); ``vocab_size`` is required by ``NullTokenizer`` only. Extra keyword arguments
    (other Megatron tokenizer flags) are accepted and ignored.
    """
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        cls = Llama2Tokenizer if tokenizer_type == "Llama2Tokenizer" else SentencePieceTokenizer
        return cls(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, tiktoken_pattern, tiktoken_num_special_tokens, tiktoken_special_tokens,
                            vocab_size)
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
