"""Hugging Face export/import: logits parity (fp32) and greedy generation vs transformers, from checkpoints
saved by a TP = 2, PP = 2 run; exact HF -> ours -> HF round trips; the exported tokenizer; CLI errors."""
import contextlib
import io
import json
import os
import sys

import pytest
import torch
from testlib import TOOLS
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train, with_activation

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron_cai.core.datasets.mock_dataset import MockGPTDataset  # noqa: E402
from megatron_cai.inference.generation import full_logits, generate, load_model  # noqa: E402
from megatron_cai.interop.hf import export_to_hf, import_from_hf  # noqa: E402
from megatron_cai.training.checkpoint import ConversionError  # noqa: E402

sys.path.insert(0, TOOLS)

COMMON = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
                       "--lr", "1e-3", "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0",
                       "--max-position-embeddings", "64", "--init-method-std", "0.1"]
CONFIGS = {  # name: (flags, expected architecture)
    "default": (["--group-query-attention", "--num-query-groups", "2"], "nemotron"),
    "llama": (["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--group-query-attention",
               "--num-query-groups", "1", "--untie-embeddings-and-output-weights"], "llama"),
    "gpt2": (["--position-embedding-type", "learned_absolute", "--activation", "gelu_tanh"], "gpt2"),
    "gpt2_erf": (["--position-embedding-type", "learned_absolute", "--activation", "gelu"], "gpt2"),
}
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _quiet(*a, **k):
    pass


def _train_all(rank, world_size, root):
    for name, (flags, _) in CONFIGS.items():
        base = with_activation(COMMON) if any(f in flags for f in ("--swiglu", "--activation")) else COMMON
        train(base + TP2PP2 + flags + ["--save", os.path.join(root, name)], world_size)
    return True


@pytest.fixture(scope="module")
def tp2pp2_checkpoints(tmp_path_factory):
    """Checkpoints saved by real (TP, PP) = (2, 2) gloo runs, one per configuration."""
    root = str(tmp_path_factory.mktemp("tp2pp2"))
    run_distributed(_train_all, 4, (root,))
    for name in CONFIGS:
        meta = json.load(open(os.path.join(root, name, "iter_0000002", "metadata.json")))
        assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (2, 2)
    return root


def _hf(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_logits_and_greedy_match_transformers(tp2pp2_checkpoints, tmp_path, name):
    ckpt = os.path.join(tp2pp2_checkpoints, name)
    out = str(tmp_path / "hf")
    assert export_to_hf(ckpt, out, log=_quiet) == CONFIGS[name][1]
    tensors = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    emb = tensors.get("model.embed_tokens.weight", tensors.get("transformer.wte.weight"))
    assert emb.shape == (100, 32)  # 112 padded rows at TP = 2, trimmed to the vocabulary
    hf = _hf(out)
    ours, _ = load_model(ckpt)
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, full_logits(ours, tokens), rtol=1e-5, atol=1e-5)
    prompt = tokens[:1, :6]
    assert torch.equal(_hf_greedy(hf, prompt, 32), generate(ours, prompt, 32, temperature=0).tokens)


def test_generate_cli_matches_transformers(tp2pp2_checkpoints, tmp_path):
    import generate as generate_tool

    ckpt = os.path.join(tp2pp2_checkpoints, "default")
    export_to_hf(ckpt, str(tmp_path / "hf"), log=_quiet)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert generate_tool.main(["--load", ckpt, "--prompt", "3 14 15 92", "--max-new-tokens", "32",
                                   "--temperature", "0"]) == 0
    printed = [int(x) for x in buf.getvalue().split()]
    expected = _hf_greedy(_hf(str(tmp_path / "hf")), torch.tensor([[3, 14, 15, 92]]), 32)[0].tolist()
    assert printed == expected


def test_remote_code_export_for_rmsnorm_relu2_with_window(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(COMMON + ["--normalization", "RMSNorm", "--window-size", "8", "--save", ckpt])
    out = str(tmp_path / "hf")
    assert export_to_hf(ckpt, out, log=_quiet) == "megatron_cai"
    assert os.path.exists(os.path.join(out, "modeling_megatron_cai.py"))
    with pytest.raises(ConversionError, match="nemotron needs normalization=LayerNorm"):
        export_to_hf(ckpt, str(tmp_path / "x"), architecture="nemotron", log=_quiet)
    hf = _hf(out, trust_remote_code=True)
    ours, _ = load_model(ckpt)
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, full_logits(ours, tokens), rtol=1e-5, atol=1e-5)
    prompt = tokens[:1, :5]  # (a windowed model decodes without a KV cache: keep it short)
    assert torch.equal(_hf_greedy(hf, prompt, 16), generate(ours, prompt, 16, temperature=0).tokens)


def _tiny_llama(path):
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)  # no trivially-initialised norms
    model.save_pretrained(path)
    return model


def _tiny_gpt2(path):
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gpt2])
def test_hf_import_export_round_trip_is_exact(tmp_path, make):
    make(str(tmp_path / "orig"))
    original = safetensors_torch.load_file(str(tmp_path / "orig" / "model.safetensors"))
    import_from_hf(str(tmp_path / "orig"), str(tmp_path / "ckpt"), tp=2, pp=2, log=_quiet)
    meta = json.load(open(tmp_path / "ckpt" / "iter_0000000" / "metadata.json"))
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (2, 2)
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "again"), log=_quiet)
    again = safetensors_torch.load_file(str(tmp_path / "again" / "model.safetensors"))
    assert sorted(again) == sorted(original)
    for k, v in original.items():
        assert torch.equal(v, again[k]), k


def test_imported_llama_trains_from_the_hf_weights(tmp_path):
    """pretrain_gpt.py --load of an imported checkpoint (fresh start): iteration 1's loss is the HF model's
    loss on the same batch."""
    from megatron_cai.interop.hf import pretrain_flags
    from megatron_cai.training.checkpoint import load_canonical

    hf = _tiny_llama(str(tmp_path / "orig")).eval()
    import_from_hf(str(tmp_path / "orig"), str(tmp_path / "ckpt"), log=_quiet)
    flags = pretrain_flags(load_canonical(str(tmp_path / "ckpt")).config)
    hist = train(flags + ["--mock-data", "--vocab-size", "100", "--seq-length", "16", "--micro-batch-size", "2",
                          "--global-batch-size", "4", "--train-iters", "1", "--hidden-dropout", "0",
                          "--attention-dropout", "0", "--eval-interval", "0", "--eval-iters", "0", "--seed", "5",
                          "--load", str(tmp_path / "ckpt")])
    assert hist["iteration"] == 1
    ds = MockGPTDataset(4, 16, 100, seed=5)
    batch = [ds[i] for i in range(4)]
    tokens, labels = torch.stack([b["tokens"] for b in batch]), torch.stack([b["labels"] for b in batch])
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten())
    assert hist["history"][0]["lm loss"] == pytest.approx(ref.item(), rel=1e-5)


def test_sentencepiece_tokenizer_export(tmp_path):
    from train_tokenizer import train_tokenizer

    from megatron_cai.training.tokenizer import SentencePieceTokenizer

    code = ["def f(x):\n    return x * 2  # double\n", "class A:\n\tpass\n\n\nprint('héllo wörld', 42)\n",
            "for i in range(10):\n        total += i ** 2\n"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": c.replace("x", f"x{i}")}) + "\n" for i in range(100) for c in code))
    train_tokenizer([str(corpus)], str(tmp_path / "tok"), vocab_size=400, verify_docs=5, log=_quiet)
    model_file = str(tmp_path / "tok.model")
    ckpt = str(tmp_path / "ckpt")
    train(COMMON + ["--tokenizer-model", model_file, "--save", ckpt])
    out = str(tmp_path / "hf")
    export_to_hf(ckpt, out, log=_quiet)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = SentencePieceTokenizer(model_file)
    for text in code + ["  if   y:\n\t\t  return None\n", "naïve ✓ 😀 1234", ""]:
        ids = hf_tok(text)["input_ids"]
        assert ids == ours.tokenize(text), text  # no BOS: exactly the ids the model was trained on
        assert hf_tok.decode(ids) == text
    assert hf_tok.eos_token_id == ours.eod
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["vocab_size"] == 400 and cfg["eos_token_id"] == ours.eod
    assert _hf(out).get_input_embeddings().weight.shape[0] == len(hf_tok)


def test_cli_errors(tmp_path):
    import convert_checkpoint

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert convert_checkpoint.main(["--to", "hf", "--load", str(tmp_path / "none"), "--save", str(tmp_path)]) == 2
        assert convert_checkpoint.main(["--from", "hf", "--load", str(tmp_path), "--save", str(tmp_path / "o")]) == 2
    assert "latest_checkpointed_iteration.txt" in err.getvalue() and "config.json" in err.getvalue()


@pytest.mark.parametrize("option,message", [
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5"), ({"qk_layernorm": True}, "--qk-layernorm"),
    ({"apply_layernorm_1p": True}, "--apply-layernorm-1p"),
    ({"position_embedding_type": "none"}, "--position-embedding-type none")])
def test_export_refuses_model_options_no_hf_architecture_has(option, message):
    """The export must not write a model that computes something else: options the HF architectures (and our
    remote code) do not implement are refused with the option's flag."""
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.interop.hf import ARCHITECTURES, choose_architecture

    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8,
                       normalization="RMSNorm", activation="swiglu", **option)
    with pytest.raises(ConversionError, match=message):
        choose_architecture(config)
    for arch in ARCHITECTURES:
        with pytest.raises(ConversionError, match=message):
            choose_architecture(config, arch)
    assert choose_architecture(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,
                                         seq_length=8, normalization="RMSNorm", activation="swiglu")) == "llama"
