"""The torch_dist layout of MoE expert parameters, in one process: ``tp_layout`` records their global
``[num_experts, ...]`` shape and expert-TP split, and the pieces that EP 2 x expert TP 2 ranks write read back
into EP 4 x expert TP 1 and EP 1 ranks as the experts they hold (checked against slices of the full tensor)."""
import torch

from megatron_cai.core.transformer.moe.experts import GroupedExperts
from megatron_cai.training.checkpoint import dcp_pieces as dc
from megatron_cai.training.checkpoint import tp_layout

E, HIDDEN, FFN = 4, 8, 6
FULL = {"fc1_weight": torch.randn(E, 2 * FFN, HIDDEN), "fc2_weight": torch.randn(E, HIDDEN, FFN)}


def _experts(ep_rank: int, ep: int, etp_rank: int, etp: int) -> GroupedExperts:
    """The experts of one (EP, expert TP) rank, initialised from FULL by the parameters' own initialisers."""
    per = E // ep

    def init_from(name):
        return lambda full, gen: full.copy_(FULL[name])

    m = GroupedExperts(E, range(ep_rank * per, (ep_rank + 1) * per), HIDDEN, FFN, "swiglu", False,
                       init_from("fc1_weight"), init_from("fc2_weight"), False, etp_rank, etp)
    for p in m.parameters():
        with torch.no_grad():
            p.init_method(p.data, None)
    return m


def test_tp_layout_records_global_expert_shape():
    layout = tp_layout([_experts(1, 2, 1, 2)])
    assert layout["fc1_weight"] == {"tp_dim": 1, "tp_sections": [FFN, FFN], "full_shape": [E, 2 * FFN, HIDDEN],
                                    "expert": True}
    assert layout["fc2_weight"] == {"tp_dim": 2, "tp_sections": None, "full_shape": [E, HIDDEN, FFN],
                                    "expert": True}
    assert tp_layout([_experts(0, 1, 0, 1)])["fc1_weight"]["tp_dim"] is None  # expert TP 1: not split


def test_ep2_etp2_pieces_read_back_at_ep4_and_ep1(tmp_path):
    sd = {}
    for name in FULL:
        pieces = []
        for ep_rank in range(2):
            for etp_rank in range(2):
                m = _experts(ep_rank, 2, etp_rank, 2)
                meta = tp_layout([m])[name]
                pieces += dc.save_pieces(dict(m.named_parameters())[name], meta, etp_rank, 2, ep=(ep_rank, 2)).pieces
        assert len({o for o, _ in pieces}) == len(pieces)  # no two ranks write the same piece
        sd[name] = dc.Pieces(FULL[name].shape, pieces)
    path = str(tmp_path / "ckpt")
    dc.dcp_save(sd, path, no_dist=True)
    saved = dc.read_dcp_metadata(path).state_dict_metadata
    for ep in (4, 1):
        for ep_rank in range(ep):
            m = _experts(ep_rank, ep, 0, 1)
            for name, p in m.named_parameters():
                target = torch.zeros_like(p)
                meta = tp_layout([m])[name]
                dc.dcp_load({name: dc.load_pieces(target, meta, saved[name].size, 0, 1, name, ep=(ep_rank, ep))},
                            path, no_dist=True)
                per = E // ep
                assert torch.equal(target, FULL[name][ep_rank * per:(ep_rank + 1) * per]), (ep, ep_rank, name)


def test_hf_export_refuses_moe_by_name():
    """No Hugging Face architecture here holds MoE layers: every one refuses, naming the flag and Mixtral."""
    import pytest

    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.transformer.moe.config import MoEConfig
    from megatron_cai.interop.hf import choose_architecture
    from megatron_cai.training.checkpoint import ConversionError

    llama = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope")
    assert choose_architecture(GPTConfig(**llama)) == "llama"
    with pytest.raises(ConversionError, match="--num-experts 4.*Mixtral"):
        choose_architecture(GPTConfig(**llama, moe=MoEConfig(num_experts=4)))


def test_architecture_check_compares_moe_fields_not_expert_layout():
    """A checkpoint must agree on the experts (count, width, routing, which layers), not on EP."""
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.transformer.moe.config import MoEConfig

    def gpt(**moe):
        return GPTConfig(num_layers=4, moe=MoEConfig(**moe))

    assert gpt(num_experts=4, expert_model_parallel_size=2).architecture_diff(gpt(num_experts=4)) == []
    assert gpt(num_experts=4, layer_freq=1).architecture_diff(gpt(num_experts=4, layer_freq=[1, 1, 1, 1])) == []
    for other in (dict(num_experts=8), dict(num_experts=4, layer_freq=2), dict(num_experts=4, router_topk=1,
                                                                                 router_pre_softmax=True)):
        assert [d.split(":")[0] for d in gpt(num_experts=4).architecture_diff(gpt(**other))] == ["moe_architecture"]
    assert GPTConfig(num_layers=4).architecture_diff(gpt(num_experts=4))  # dense vs MoE
