"""End to end through the CLIs: demo corpus -> tokenizer -> preprocess (2 workers) -> GPT batches."""
import json
import os
import subprocess
import sys

import numpy as np
import torch
from testlib import ROOT

from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.data_samplers import build_pretraining_data_loader
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset
from megatron_cai.training.tokenizer import build_tokenizer


def tool(name, *args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_corpus_tokenizer_preprocess_dataset(tmp_path):
    corpus = tmp_path / "stdlib.jsonl"
    out = tool("make_demo_corpus.py", "--output", corpus, "--max-mb", "0.4")
    assert "wrote" in out
    texts, paths = [], []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            texts.append(rec["text"])
            paths.append(rec["path"])
    size = os.path.getsize(corpus)
    assert 0.4e6 <= size < 0.4e6 + 256 * 1024 and len(texts) >= 5
    assert all(p.endswith(".py") and "site-packages" not in p and "/test/" not in f"/{p}" for p in paths)
    again = tmp_path / "again.jsonl"
    tool("make_demo_corpus.py", "--output", again, "--max-mb", "0.4")
    assert again.read_bytes() == corpus.read_bytes()  # deterministic

    out = tool("train_tokenizer.py", "--input", corpus, "--vocab-size", 512,
               "--model-prefix", tmp_path / "tok")
    assert "round trip exact" in out
    model = str(tmp_path / "tok.model")
    out = tool("preprocess_data.py", "--input", corpus, "--output-prefix", tmp_path / "data" / "stdlib",
               "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod",
               "--workers", 2)
    assert f"{len(texts)} documents" in out
    prefix = str(tmp_path / "data" / "stdlib_text_document")
    tok = build_tokenizer("SentencePieceTokenizer", model)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for i, text in enumerate(texts):  # every document survives the pipeline exactly, in order
        ids = ds[i]
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.detokenize(ids[:-1].tolist()) == text

    cfg = GPTDatasetConfig(sequence_length=64, random_seed=3, eod_token_id=tok.eod, eod_mask_loss=True,
                           reset_position_ids=True, reset_attention_mask=True)
    train, valid, test = build_train_valid_test_datasets([prefix], "90,10,0", (32, 8, 0), cfg)
    assert test is None and len(train) >= 32 and len(valid) >= 8
    batch = next(iter(build_pretraining_data_loader(train, 0, micro_batch_size=4)))
    assert batch["tokens"].shape == (4, 64) and batch["labels"].shape == (4, 64)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    # The text before the first EOD of a sample is a piece of one corpus document.
    row = batch["tokens"][0].tolist()
    piece = tok.detokenize(row[: row.index(tok.eod)] if tok.eod in row else row)
    assert any(piece in text for text in texts)
