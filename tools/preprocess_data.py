#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron MMIDIDX ``<prefix>_<key>_document.bin/.idx`` files.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

    python tools/preprocess_data.py --tree --input trees.jsonl --output-prefix data/trees ...

Megatron-LM's flags. Each line is a JSON object; every ``--json-keys`` key must hold a string.
With ``--tree`` each line is one tree of nodes ``{"text", "children", "bidirectional", "loss"}``
(``--json-keys`` names the one text key of the nodes): the ``.bin/.idx`` pair holds one document per
tree (nodes in DFS preorder, readable by any MMIDIDX reader) and ``<prefix>.tree`` the node
structure (format: ``megatron_cai/core/datasets/tree_format.py``); ``--append-eod`` ends every leaf
(every branch) with EOD.
Workers (a process pool) decode, parse and tokenize chunks of lines; the parent writes the results
in input order (single writer). A malformed line (invalid UTF-8, bad JSON, invalid Unicode such as a lone
surrogate ``"\\ud800"``, missing key, non-string value, text the tokenizer refuses) stops the run with
``<file>:<line>: <reason>`` and exit code 1, and leaves no output behind; ``--skip-bad-lines`` skips and counts
them instead. Documents with no tokens are skipped and counted; blank lines are ignored and counted.

Outputs are published together or not at all: every ``.bin``, ``.idx`` (and ``.tree``) is written under a
temporary name ``<path>.tmp-<PID>`` and renamed into place only once all of them are complete (``.idx``
last). A failure (a full disk, a bad line), SIGTERM or SIGINT removes the temporary files and stops the
worker processes; workers also exit on their own when the parent dies (SIGKILL), and the next run for the
same output removes the temporary files of a dead run (core/datasets/temp_files.py).
"""
from __future__ import annotations

import argparse
import errno
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_cai.core.datasets.indexed_dataset import (  # noqa: E402
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron_cai.core.datasets.temp_files import remove_dead_temporaries, remove_quietly, temp_path  # noqa: E402
from megatron_cai.core.datasets.tree_format import (  # noqa: E402
    TreeFormatError,
    TreeSidecarBuilder,
    encode_tree,
    flatten_tree,
    tree_path,
)
from megatron_cai.training.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

MAX_BAD_LINES_SHOWN = 5
CHUNK_LINES = 256
CHUNK_BYTES = 1 << 18


class BadLine(ValueError):
    """One input line cannot be used; ``reason`` says why."""


class PreprocessError(RuntimeError):
    """Preprocessing stopped; the message names the file and line."""


class DiskFull(PreprocessError):
    """The output's file system is full (ENOSPC / EDQUOT): nothing was published."""


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the parent: clean up and stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class OutOfVocabulary(ValueError):
    """The tokenizer produced an id outside its own vocabulary: never written, never skipped."""


def check_ids_in_vocabulary(ids, vocab_size: int, what: str) -> None:
    """Raise OutOfVocabulary when an id of ``ids`` is outside ``[0, vocab_size)`` (the same rule as training)."""
    if len(ids) and (max(ids) >= vocab_size or min(ids) < 0):
        bad = max(ids) if max(ids) >= vocab_size else min(ids)
        raise OutOfVocabulary(f"{what}: token id {bad} is outside the tokenizer's vocabulary of {vocab_size} ids")


def _json_object(raw: bytes) -> dict | None:
    """One JSONL line as a dict; ``None`` for a blank line; ``BadLine`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(f"invalid UTF-8 at byte {e.start} ({raw[e.start:e.start + 4]!r})") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(f"malformed JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    _check_unicode(obj)
    return obj


def _check_unicode(value, where: str = "") -> None:
    """``BadLine`` for a string (key or value, at any depth) that is not valid Unicode: JSON's ``\\ud800``
    escapes decode to lone surrogates, which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadLine(f"invalid Unicode{where}: lone surrogate U+{ord(value[e.start]):04X} at character "
                          f"{e.start}") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, " in a key")
            _check_unicode(v, f" in key {k!r}" if not where else where)
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v, where)


def parse_json_line(raw: bytes, keys: Sequence[str]) -> dict[str, str] | None:
    """The ``keys`` of one JSONL line as strings; ``None`` for a blank line; ``BadLine`` otherwise."""
    obj = _json_object(raw)
    if obj is None:
        return None
    out = {}
    for key in keys:
        if key not in obj:
            present = ", ".join(repr(k) for k in list(obj)[:5])
            raise BadLine(f"missing key {key!r} (keys present: {present or 'none'})")
        value = obj[key]
        if not isinstance(value, str):
            raise BadLine(f"key {key!r} holds {type(value).__name__}, expected a string")
        out[key] = value
    return out


def iter_jsonl_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, raw bytes without the newline)`` of a file."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            yield line_no, raw.rstrip(b"\r\n")


def iter_chunks(path: str) -> Iterator[list[tuple[int, bytes]]]:
    """Lines grouped into chunks of at most CHUNK_LINES lines / CHUNK_BYTES bytes."""
    chunk: list[tuple[int, bytes]] = []
    size = 0
    for item in iter_jsonl_lines(path):
        chunk.append(item)
        size += len(item[1]) + 1
        if len(chunk) >= CHUNK_LINES or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def sentence_splitter(lang: str, keep_newlines: bool):
    """nltk's punkt sentence splitter for ``lang`` (Megatron-LM's: with ``keep_newlines``, newlines after a
    sentence stay in it). Nothing is downloaded: nltk and its punkt data must be installed."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise ValueError("--split-sentences needs nltk, which is not installed (pip install nltk; then its punkt "
                         "data: python -m nltk.downloader punkt); nothing is downloaded here") from None
    try:
        splitter = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except (LookupError, OSError):
        raise ValueError(f"--split-sentences --lang {lang}: nltk's punkt data (tokenizers/punkt/{lang}.pickle) is not "
                         f"installed (python -m nltk.downloader punkt); nothing is downloaded here") from None
    if not keep_newlines:
        return splitter

    class KeepNewlines(PunktLanguageVars):  # Megatron-LM's CustomLanguageVars: \s* (not \s+) after the ending
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)
            ))"""

    return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=KeepNewlines())


def split_sentences(splitter, text: str, max_len: int = 1_000_000) -> list[str]:
    """``text``'s sentences, split in chunks of ``max_len`` characters as Megatron-LM's tool does."""
    return [s for i in range(0, len(text), max_len) for s in splitter.tokenize(text[i:i + max_len])]


def partition_order(inputs: list[str], partitions: int, sequential: bool) -> Iterator[bytes]:
    """The lines of ``inputs`` in the order Megatron-LM's tool writes them with --partitions: partition 0's lines,
    then partition 1's, ...; a partition holds every N-th line (round robin), or with ``sequential``
    (--keep-sequential-samples) a contiguous block of ceil(lines / N)."""
    import gzip

    def lines() -> Iterator[bytes]:
        for path in inputs:
            with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
                yield from f

    if sequential:
        yield from lines()  # contiguous blocks, concatenated in order
        return
    for p in range(partitions):
        for i, line in enumerate(lines()):
            if i % partitions == p:
                yield line


class Encoder:
    """Parses and tokenizes lines (one instance per worker process)."""

    def __init__(self, keys: Sequence[str], tokenizer_kwargs: dict, append_eod: bool, dtype: type,
                 tree: bool = False, sentences: tuple[str, bool] | None = None) -> None:
        self.keys = list(keys)
        self.tokenizer = build_tokenizer(**tokenizer_kwargs)
        self.append_eod = append_eod
        self.eod = self.tokenizer.eod if append_eod else None
        self.dtype = dtype
        self.tree = tree
        self.splitter = sentence_splitter(*sentences) if sentences else None

    def encode_tree_line(self, raw: bytes) -> dict[str, tuple] | None:
        """``{key: (token array, TreeNodes)}`` of one tree line (EOD ending every leaf); ``None`` if blank."""
        obj = _json_object(raw)
        if obj is None:
            return None
        try:
            tokens, nodes = encode_tree(flatten_tree(obj, self.keys[0]), self.tokenizer.tokenize, self.eod)
        except (TreeFormatError, ValueError) as e:
            raise BadLine(str(e)) from None
        check_ids_in_vocabulary(tokens, self.tokenizer.vocab_size, f"key {self.keys[0]!r}")
        return {self.keys[0]: (np.asarray(tokens, dtype=self.dtype), nodes)}

    def encode_line(self, raw: bytes) -> dict[str, np.ndarray] | None:
        """Token arrays per key (EOD appended to non-empty documents); ``None`` for a blank line."""
        if self.tree:
            return self.encode_tree_line(raw)
        fields = parse_json_line(raw, self.keys)
        if fields is None:
            return None
        out = {}
        for key, text in fields.items():
            pieces = [text] if self.splitter is None else split_sentences(self.splitter, text)
            try:
                sentences = [ids for ids in (self.tokenizer.tokenize(piece) for piece in pieces) if ids]
            except (ValueError, TypeError) as e:  # the tokenizer refuses this text
                raise BadLine(f"key {key!r}: {e}") from None
            if sentences and self.append_eod:
                sentences[-1].append(self.eod)
            for ids in sentences:
                check_ids_in_vocabulary(ids, self.tokenizer.vocab_size, f"key {key!r}")
            arrays = [np.asarray(ids, dtype=self.dtype) for ids in sentences]
            out[key] = arrays if self.splitter is not None else (arrays[0] if arrays else np.asarray([], self.dtype))
        return out

    def encode_chunk(self, chunk: list[tuple[int, bytes]]) -> list[tuple[int, int, str, object]]:
        """``(line, nbytes, kind, payload)`` per line; kind is "ok", "blank" or "bad" (payload = reason)."""
        results = []
        for line_no, raw in chunk:
            try:
                tokens = self.encode_line(raw)
            except BadLine as e:
                results.append((line_no, len(raw) + 1, "bad", str(e)))
                continue
            except OutOfVocabulary as e:
                results.append((line_no, len(raw) + 1, "vocab", str(e)))
                continue
            results.append((line_no, len(raw) + 1, "blank" if tokens is None else "ok", tokens))
        return results


_WORKER_ENCODER: Encoder | None = None


def _init_worker(parent: int, *args) -> None:
    """A worker of the process ``parent``: SIGINT is the parent's to handle, and the worker exits when its
    parent is gone (also when it died while this worker was still starting)."""
    global _WORKER_ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # reparented: the parent died (SIGKILL) without stopping the pool

    threading.Thread(target=exit_with_parent, name="exit-with-parent", daemon=True).start()
    _WORKER_ENCODER = Encoder(*args)


def _encode_chunk_in_worker(chunk: list[tuple[int, bytes]]) -> list[tuple[int, int, str, object]]:
    return _WORKER_ENCODER.encode_chunk(chunk)


@dataclass
class PreprocessStats:
    """What a run did (also printed as the summary)."""

    lines: int = 0
    bytes: int = 0
    blank_lines: int = 0
    bad_lines: int = 0
    first_bad_lines: list[tuple[int, str]] = field(default_factory=list)
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    empty_documents: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    nodes: dict[str, int] | None = None  # --tree: nodes per key

    def summary(self, path: str) -> str:
        """Human-readable summary."""
        rate = self.lines / max(self.seconds, 1e-9)
        mbps = self.bytes / 1e6 / max(self.seconds, 1e-9)
        rows = [f"processed {path}: {self.lines} lines, {self.bytes / 1e6:.2f} MB in {self.seconds:.1f} s "
                f"({rate:.0f} docs/s, {mbps:.2f} MB/s)"]
        for key, prefix in self.outputs.items():
            if self.nodes is not None:
                rows.append(f"  {key}: {self.documents[key]} trees, {self.nodes[key]} nodes, {self.tokens[key]} "
                            f"tokens, {self.empty_documents[key]} empty trees skipped -> {prefix}.bin/.idx/.tree")
                continue
            rows.append(f"  {key}: {self.documents[key]} documents, {self.tokens[key]} tokens, "
                        f"{self.empty_documents[key]} empty documents skipped -> {prefix}.bin/.idx")
        rows.append(f"  blank lines ignored: {self.blank_lines}")
        bad = f"  bad lines skipped: {self.bad_lines}"
        if self.first_bad_lines:
            bad += " (first: " + "; ".join(f"line {n}: {r}" for n, r in self.first_bad_lines) + ")"
        rows.append(bad)
        return "\n".join(rows)


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    """``<output_prefix>_<key>_document`` (``_sentence`` with --split-sentences; Megatron's naming)."""
    return f"{output_prefix}_{key}_{level}"


def preprocess(input_path: str, output_prefix: str, tokenizer_type: str, tokenizer_model: str | None = None,
               vocab_size: int | None = None, json_keys: Sequence[str] = ("text",), append_eod: bool = False,
               workers: int = 1, log_interval: int = 1000, skip_bad_lines: bool = False,
               progress: bool | None = None, log=None, tree: bool = False,
               tokenizer_options: dict | None = None, sentences: tuple[str, bool] | None = None,
               source_name: str | None = None) -> PreprocessStats:
    """Tokenize ``input_path`` into ``<output_prefix>_<key>_document.{bin,idx}`` for every key.

    ``tree``: each line is one tree (see the module docstring); ``json_keys`` is the one node text key
    and ``<prefix>.tree`` is written too (before the ``.idx``). A plain run removes a stale
    ``<prefix>.tree`` left at its output prefix.

    Raises ``PreprocessError`` (``"<file>:<line>: <reason>"``) on a bad line unless
    ``skip_bad_lines``; then no output files exist for this run (earlier files at the output paths
    are left untouched). ``progress``: tqdm bar (``None``: only on a terminal); ``log``: a function
    for progress lines when the bar is off (default: stderr). ``tokenizer_options``: the other tokenizer
    flags (``vocab_file``, ``merge_file``, ``tiktoken_pattern``, ...) as ``build_tokenizer`` takes them.
    """
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: file not found")
    if workers < 1:
        raise ValueError("--workers must be >= 1")
    if len(set(json_keys)) != len(json_keys) or not json_keys:
        raise ValueError(f"--json-keys must be distinct and non-empty, got {list(json_keys)}")
    if tree and len(json_keys) != 1:
        raise ValueError(f"--tree takes one --json-keys key (the nodes' text), got {list(json_keys)}")
    if sentences is not None:
        sentence_splitter(*sentences)  # nltk and its punkt data, or one error naming what is missing
    tokenizer_kwargs = {"tokenizer_type": tokenizer_type, "tokenizer_model": tokenizer_model,
                        "vocab_size": vocab_size, **(tokenizer_options or {})}
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    if append_eod:
        _ = tokenizer.eod  # fails early with a clear message when there is none
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    for key in json_keys:
        prefix = output_prefix_for(output_prefix, key, "sentence" if sentences else "document")
        for path in (get_bin_path(prefix), get_idx_path(prefix), tree_path(prefix)):
            for dead in remove_dead_temporaries(path):
                log(f"removed {dead}: a temporary file of a run that is no longer alive")
    stats = PreprocessStats(nodes={} if tree else None)
    builders: dict[str, IndexedDatasetBuilder] = {}
    sidecars: dict[str, TreeSidecarBuilder] = {}
    for key in json_keys:
        prefix = output_prefix_for(output_prefix, key, "sentence" if sentences else "document")
        builders[key] = IndexedDatasetBuilder(get_bin_path(prefix), dtype)
        stats.outputs[key] = prefix
        stats.documents[key] = stats.tokens[key] = stats.empty_documents[key] = 0
        if tree:
            sidecars[key] = TreeSidecarBuilder(tree_path(prefix))
            stats.nodes[key] = 0

    total_bytes = os.path.getsize(input_path)
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="tokenizing",
               disable=(not progress) if progress is not None else None, dynamic_ncols=True)
    t0 = time.time()
    next_log = log_interval
    init_args = (list(json_keys), tokenizer_kwargs, append_eod, dtype, tree, sentences)
    name = source_name or input_path

    def handle(results: list[tuple[int, int, str, object]]) -> None:
        nonlocal next_log
        for line_no, nbytes, kind, payload in results:
            stats.lines += 1
            stats.bytes += nbytes
            if kind == "vocab":  # a tokenizer/vocabulary mismatch: fatal even with --skip-bad-lines
                raise PreprocessError(f"{name}:{line_no}: {payload}")
            if kind == "bad":
                if not skip_bad_lines:
                    raise PreprocessError(f"{name}:{line_no}: {payload}")
                stats.bad_lines += 1
                if len(stats.first_bad_lines) < MAX_BAD_LINES_SHOWN:
                    stats.first_bad_lines.append((line_no, str(payload)))
            elif kind == "blank":
                stats.blank_lines += 1
            else:
                for key, ids in payload.items():
                    if tree:
                        ids, nodes = ids
                    if len(ids) == 0:
                        stats.empty_documents[key] += 1
                        continue
                    if tree:
                        sidecars[key].add_tree(nodes)
                        stats.nodes[key] += len(nodes.parents)
                    for piece in (ids if isinstance(ids, list) else [ids]):  # sentences, or the document
                        builders[key].add_item(piece)
                    builders[key].end_document()
                    stats.documents[key] += 1
                    stats.tokens[key] += sum(len(piece) for piece in (ids if isinstance(ids, list) else [ids]))
        bar.update(sum(r[1] for r in results))
        elapsed = max(time.time() - t0, 1e-9)
        bar.set_postfix_str(f"{stats.lines / elapsed:.0f} docs/s", refresh=False)
        if bar.disable and log_interval > 0 and stats.lines >= next_log:
            log(f"processed {stats.lines} documents ({stats.lines / elapsed:.0f} docs/s, "
                f"{stats.bytes / 1e6 / elapsed:.2f} MB/s)")
            next_log = (stats.lines // log_interval + 1) * log_interval

    pool = None
    finalized = False
    try:
        if workers == 1:
            encoder = Encoder(*init_args)
            for chunk in iter_chunks(input_path):
                handle(encoder.encode_chunk(chunk))
        else:
            # A process pool that reports dead workers (BrokenProcessPool) instead of hanging.
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_init_worker, initargs=(os.getpid(), *init_args))
            pending: deque = deque()
            try:
                for chunk in iter_chunks(input_path):  # bounded window: flat memory, order preserved
                    pending.append(pool.submit(_encode_chunk_in_worker, chunk))
                    if len(pending) >= 4 * workers:
                        handle(pending.popleft().result())
                while pending:
                    handle(pending.popleft().result())
            except BrokenProcessPool as e:
                raise PreprocessError(f"a tokenizer worker process died ({e}); try --workers 1") from None
        _publish_outputs(builders, sidecars, stats.outputs, tree)
        finalized = True
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFull(f"{out_dir}: no space left on device ({errno.errorcode[e.errno]}) while writing "
                       f"{', '.join(p + '.bin/.idx' for p in stats.outputs.values())} (after {stats.lines} input "
                       f"lines); nothing was published") from e
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if not finalized:
            for builder in builders.values():
                builder.abort()
            for sidecar in sidecars.values():
                sidecar.abort()
    stats.seconds = time.time() - t0
    return stats


def _publish_outputs(builders: dict[str, IndexedDatasetBuilder], sidecars: dict[str, TreeSidecarBuilder],
                     outputs: dict[str, str], tree: bool) -> None:
    """Every output complete under its temporary name first (a full disk fails here, publishing nothing), then
    renamed into place, each ``.idx`` last."""
    for key, builder in builders.items():
        if tree:
            sidecars[key].prepare()
        builder.prepare(get_idx_path(outputs[key]))
    for key, builder in builders.items():
        sidecar = tree_path(outputs[key])
        if tree:
            sidecars[key].publish()
        elif os.path.exists(sidecar):
            os.remove(sidecar)  # a stale tree sidecar would make --data-format auto read trees
        builder.publish()


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True,
                       help="JSONL file, one JSON object per line (a glob of files, .gz too, with --partitions > 1)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    group.add_argument("--tree", action="store_true",
                       help="each line is a tree of {text, children, bidirectional, loss} nodes; also writes "
                            "<prefix>.tree (the node structure)")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence (nltk's punkt; <prefix>_<key>_sentence.bin/.idx); needs nltk "
                            "and its punkt data installed (nothing is downloaded)")
    group.add_argument("--keep-newlines", action="store_true", help="--split-sentences: keep newlines in sentences")
    group.add_argument("--lang", default="english", help="--split-sentences: punkt's language")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None,
                       help="sentencepiece .model, or a local tokenizer.json / directory for HuggingFace")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tiktoken-pattern", default=None, help="TikTokenizer: v1 or v2")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids reserved for special tokens")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None, help="TikTokenizer: special tokens")
    group.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    for flag, kind, default in _MEGATRON_TOKENIZER_OPTIONS:
        if kind is bool:
            group.add_argument(flag, action="store_true", help="Megatron-LM's; only its default is taken here")
        else:
            group.add_argument(flag, type=kind, default=default, nargs="+" if kind is list else None,
                               help="Megatron-LM's; only its default is taken here")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes <output-prefix>_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="Megatron-LM's input partitions: the documents come in its merged order (round robin, "
                            "or contiguous blocks with --keep-sequential-samples), one output, no partition files")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="--partitions: contiguous blocks of lines, so the input order is kept")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="log progress every N documents when no progress bar is shown")
    group.add_argument("--max-documents", type=int, default=100_000,
                       help="Megatron-LM's, with --find-optimal-num-workers only (refused here): no effect")
    group.add_argument("--find-optimal-num-workers", action="store_true",
                       help="refused: time runs with different --workers instead")
    group.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64], help="see the line above")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip malformed lines (reported with line numbers) instead of stopping")
    group.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    return parser.parse_args(argv)


# Megatron-LM's other tokenizer flags (its _add_tokenizer_args): accepted at their defaults, refused otherwise
_MEGATRON_TOKENIZER_OPTIONS = [
    ("--vocab-extra-ids", int, 0), ("--tokenizer-hf-no-use-fast", bool, False),
    ("--tokenizer-hf-no-include-special-tokens", bool, False), ("--null-tokenizer-eod-id", int, None),
    ("--null-tokenizer-pad-id", int, -1), ("--tokenizer-special-tokens", list, None),
    ("--tokenizer-sentencepiece-legacy", bool, False), ("--tokenizer-metadata", str, None),
    ("--chat-template", str, None), ("--padded-vocab-size", int, None), ("--trust-remote-code", bool, False)]


def _refused_options(args: argparse.Namespace) -> list[str]:
    """The Megatron-LM flags given with a value other than the one this tool implements (one line each)."""
    out = []
    for flag, _, default in _MEGATRON_TOKENIZER_OPTIONS:
        value = vars(args)[flag[2:].replace("-", "_")]
        if value != default and flag != "--trust-remote-code":  # no remote code is ever run: nothing to trust
            out.append(f"{flag} {value}: only its default ({default}) is implemented here")
    if args.find_optimal_num_workers:
        out.append("--find-optimal-num-workers: not implemented here; time runs with different --workers")
    if args.partitions < 1:
        out.append(f"--partitions {args.partitions}: must be >= 1")
    return out


def _stop_on_signal(signum, frame) -> None:
    """SIGTERM / SIGINT: raise :class:`Interrupted` once (a second signal is ignored while cleaning up)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)
    refused = _refused_options(args)
    if refused:
        print("preprocess_data.py: error: " + "; ".join(refused), file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_on_signal)
    try:
        stats = _run(args)
    except Interrupted as e:
        print(f"preprocess_data.py: error: {e}: no output written, temporary files removed", file=sys.stderr)
        return 128 + e.signum
    except PreprocessError as e:
        hint = "" if "vocabulary" in str(e) or isinstance(e, DiskFull) else "; use --skip-bad-lines to skip such lines"
        print(f"preprocess_data.py: error: {e}\n  (no output written{hint})", file=sys.stderr)
        return 1
    except (OSError, ValueError, ImportError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    print(stats.summary(args.input))
    return 0


def _run(args: argparse.Namespace) -> PreprocessStats:
    options = {"vocab_file": args.vocab_file, "merge_file": args.merge_file, "tiktoken_pattern": args.tiktoken_pattern,
               "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens,
               "tiktoken_special_tokens": args.tiktoken_special_tokens}
    sentences = (args.lang, args.keep_newlines) if args.split_sentences else None

    def run(path: str, name: str | None = None) -> PreprocessStats:
        return preprocess(path, args.output_prefix, args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                          args.json_keys, args.append_eod, args.workers, args.log_interval, args.skip_bad_lines,
                          progress=False if args.no_progress else None, tree=args.tree, tokenizer_options=options,
                          sentences=sentences, source_name=name)

    if args.partitions == 1:
        return run(args.input)
    import glob

    inputs = glob.glob(args.input)  # as Megatron-LM's tool, in the file system's order
    if not inputs:
        raise FileNotFoundError(f"--input {args.input}: no file matches")
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    ordered = f"{args.output_prefix}.partition_order.jsonl"
    remove_dead_temporaries(ordered)
    tmp = temp_path(ordered)
    try:
        with open(tmp, "wb") as f:
            for line in partition_order(inputs, args.partitions, args.keep_sequential_samples):
                f.write(line if line.endswith(b"\n") else line + b"\n")
        how = "contiguous blocks" if args.keep_sequential_samples else "round robin"
        return run(tmp, f"{args.input} (in the order of {args.partitions} partitions, {how}; line)")
    finally:
        remove_quietly(tmp)


if __name__ == "__main__":
    sys.exit(main())
