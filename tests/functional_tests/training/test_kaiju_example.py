"""examples/kaiju/train_kaiju.sh keeps running: its tiny size, shrunk further, trains on random tokens, saves, and
the checkpoint decodes greedily with the int8 KV cache (tools/generate.py --kv-cache-dtype int8)."""
import contextlib
import io
import os
import subprocess
import sys

from testlib import ROOT, TOOLS

from megatron_cai.inference.generation import load_model


def test_kaiju_example_trains_and_decodes_with_int8_cache(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    env = dict(os.environ, MOCK_DATA="1", NPROC="1", TRAIN_ITERS="3", CKPT_DIR=ckpt,
               PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "kaiju", "train_kaiju.sh"), "tiny",
                           "--hidden-size", "64", "--seq-length", "128", "--window-size", "32", "--log-interval", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in proc.stdout.splitlines() if "lm loss:" in line]
    assert len(losses) == 3
    model, ck = load_model(ckpt)
    cfg = model.config
    assert (cfg.num_query_groups, cfg.window_size, cfg.window_attn_skip_freq) == (1, 32, 6)
    assert cfg.kv_share_pattern == [0, 0, 2, 2, 4, 4] and cfg.activation == "relu2" and cfg.qat.fmt == "int8"
    assert cfg.qat.granularity == "row"  # per-token activation clamps: decoding does not depend on the batch
    assert [model.decoder.layers[str(n)].self_attention.window for n in range(6)] == [32] * 5 + [None]
    sys.path.insert(0, TOOLS)
    import generate as generate_tool

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = generate_tool.main(["--load", ckpt, "--prompt", "1 2 3", "--max-new-tokens", "8", "--temperature", "0",
                                 "--kv-cache-dtype", "int8", "--device", "cpu"])
    assert rc == 0 and out.getvalue().strip()
