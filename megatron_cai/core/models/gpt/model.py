"""GPTModel: embedding -> transformer layers -> output layer -> per-token loss.

One instance holds one pipeline stage (or one virtual-pipeline chunk): ``pre_process`` says it owns
the embedding, ``post_process`` the final norm, output layer and loss; ``layer_numbers`` its global
layer indices. Tensors are ``[batch, seq, hidden]``; under sequence parallelism the sequence dimension
is split over the TP ranks between the embedding and the output layer.
"""
from __future__ import annotations

import torch
from torch import nn

from ... import parallel_state as ps
from ...pipeline_parallel.layer_split import stage_layer_numbers
from ...quantization.qat_linear import attach_gemm_quantizers
from ...tensor_parallel import mappings
from ...tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ...tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    initialize_parameters,
    normal_init,
    set_param_meta,
)
from ...tensor_parallel.random import get_rng_tracker
from ...transformer.block import TransformerBlock
from ...transformer.lse_stats import LseStatsCollector
from ...transformer.rope import rotary_cos_sin
from ...transformer.self_attention import KVCache
from .config import GPTConfig

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class GPTEmbedding(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        init = normal_init(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                      init_method=init)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            set_param_meta(self.position_embeddings.weight,
                           full_shape=(config.max_position_embeddings, config.hidden_size), init_method=init)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        if self.config.mup.input_mult() != 1.0:  # --mup-embedding-mult
            x = x * self.config.mup.input_mult()
        if self.config.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x)
        p = self.config.hidden_dropout if self.training else 0.0
        if p:
            if self.config.sequence_parallel:
                with get_rng_tracker().fork():
                    x = nn.functional.dropout(x, p, True)
            else:
                x = nn.functional.dropout(x, p, True)
        return x


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig, pre_process: bool = True, post_process: bool = True,
                 layer_numbers: list[int] | None = None, lse_stats: LseStatsCollector | None = None) -> None:
        """``lse_stats``: an explicit collector of per-layer attention lse statistics (None: not recorded).

        With ``config.qat`` enabled, every linear except the LM head gets its GEMM quantizer here."""
        super().__init__()
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        if layer_numbers is None:
            layer_numbers = list(range(config.num_layers))
        self.layer_numbers = list(layer_numbers)
        self.embedding = GPTEmbedding(config) if pre_process else None
        self.decoder = TransformerBlock(config, self.layer_numbers, post_process, lse_stats)
        self.output_layer = None
        if post_process:
            init = normal_init(config.init_method_std)
            if config.untie_embeddings_and_output_weights:
                self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, bias=False,
                                                         init_method=init)
            elif not pre_process:
                # Tied embeddings on the last pipeline stage: a copy of the first stage's table, initialised
                # identically and kept identical by summing the two copies' gradients.
                self.output_layer = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, bias=False,
                                                         init_method=init)
                self.output_layer.weight.init_name = WORD_EMBEDDINGS
                self.output_layer.weight.shared_embedding = True
        if pre_process and not post_process and not config.untie_embeddings_and_output_weights:
            self.embedding.word_embeddings.weight.shared_embedding = True  # summed with the last stage's copy
        self.input_tensor: torch.Tensor | None = None
        if config.qat.enabled:  # the LM head stays in high precision
            attach_gemm_quantizers(self, config.qat, exclude=("output_layer",))

    def initialize(self, seed: int) -> None:
        """Layout-invariant initialisation (see tensor_parallel.layers.initialize_parameters)."""
        initialize_parameters(self, seed)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Pipeline stages after the first take their input from the previous stage."""
        self.input_tensor = tensor

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor, labels: torch.Tensor | None = None,
                visibility: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: KVCache | None = None, label_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (stages before the last), per-token losses [b, s] (with labels) or the
        vocab-parallel logits [b, s, vocab / TP] (without).

        ``label_positions`` [b, s] (trees, see ``datasets.tree_dataset``): slot t's logits come from the
        hidden state at position ``label_positions[b, t]`` instead of t (default: t)."""
        if self.pre_process:
            x = self.embedding(input_ids, position_ids)
        else:
            x = self.input_tensor
        rotary = None
        if self.config.position_embedding_type == "rope":
            c = self.config
            rotary = rotary_cos_sin(position_ids, rotary_dim(c), c.rotary_base,
                                    scaling_factor=c.rope_scaling_factor if c.rope_scaling else None,
                                    interleaved=c.rotary_interleaved)
        x = self.decoder(x, rotary, visibility, position_ids, kv_cache)
        if not self.post_process:
            return x
        logits = self._logits(x, label_positions)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.config.vocab_size, self.config.output_zreg_coeff)

    def _logits(self, x: torch.Tensor, label_positions: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x)
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x)
        if label_positions is not None:
            x = x.gather(1, label_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        logits = nn.functional.linear(x, self.output_weight())
        mult = self.config.mup.logit_mult(self.config.hidden_size)  # --use-mup's output multiplier
        return logits * mult if mult != 1.0 else logits

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (gathered over TP, padding rows dropped) for sampling and export."""
        full = mappings.gather_from_tensor_model_parallel_region(logits)
        return full[..., : self.config.vocab_size]


def rotary_dim(config: GPTConfig) -> int:
    """Dims of each head that RoPE rotates: int(kv_channels * rotary_percent), as Megatron computes it
    (multi-latent attention: the positional part of its heads, int(qk_pos_emb_head_dim * rotary_percent))."""
    if config.multi_latent_attention:
        return int(config.qk_pos_emb_head_dim * config.rotary_percent)
    return int(config.kv_channels * config.rotary_percent)


def build_model_chunks(config: GPTConfig, seed: int, vpp_size: int | None = None,
                       lse_stats: LseStatsCollector | None = None) -> list[GPTModel]:
    """The model chunks of this rank (one per virtual pipeline stage), initialised layout-invariantly."""
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    chunks = []
    for v in range(vpp_size or 1):
        pre = pp_rank == 0 and v == 0
        post = pp_rank == pp_size - 1 and v == (vpp_size or 1) - 1
        layers = stage_layer_numbers(config.num_layers, pp_rank, pp_size, v, vpp_size, config.pipeline_split)
        model = GPTModel(config, pre, post, layers, lse_stats=lse_stats)
        model.initialize(seed)
        chunks.append(model)
    return chunks
