"""The GPT model configuration (a dataclass; saved in every checkpoint).

Everything a model module needs is a field here, set once when the config is built
(``megatron_cai.training.arguments.build_config``) and read by the modules' constructors and
forwards: nothing pokes settings into a built model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...mup import MupConfig
from ...pipeline_parallel.layer_split import PipelineSplit
from ...quantization.qat_config import QATConfig
from ...transformer.layer_pattern import validate_patterns
from ...transformer.moe.config import MoEConfig

ACTIVATIONS = ("relu2", "swiglu", "gelu_erf", "gelu_tanh")
# saved configs (checkpoints, Hugging Face exports) before erf GeLU existed called the tanh GeLU "gelu"
LEGACY_ACTIVATIONS = {"gelu": "gelu_tanh"}


@dataclass
class GPTConfig:
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    vocab_size: int = 8000                 # real vocabulary (tokenizer size)
    padded_vocab_size: int | None = None   # embedding rows (multiple of make_vocab_size_divisible_by * TP)
    ffn_hidden_size: int | None = None     # default 4 * hidden_size
    num_query_groups: int | None = None    # KV heads (MQA = 1, GQA < heads); default = heads
    kv_channels: int | None = None         # head dim; default hidden_size / heads
    seq_length: int = 256
    max_position_embeddings: int | None = None
    position_embedding_type: str = "rope"  # rope | learned_absolute | none
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0            # fraction of each head's dims that RoPE rotates
    rope_scaling: bool = False             # Llama 3.x frequency scaling of RoPE (--use-rope-scaling)
    rope_scaling_factor: float = 8.0       # its factor (--rope-scaling-factor, Megatron-LM's default 8)
    rotary_interleaved: bool = False       # RoPE rotates (even, odd) pairs (RoFormer) instead of the two halves
    attention_output_gate: bool = False    # attention output x sigmoid(gate), the gate projected per head
    qk_layernorm: bool = False             # norm over head_dim on queries and keys (before RoPE)
    apply_layernorm_1p: bool = False       # zero-centred norm weights: scale by (1 + weight)
    recompute_granularity: str | None = None  # None | full | selective (core attention)
    recompute_method: str | None = None       # full: uniform | block
    recompute_num_layers: int | None = None
    normalization: str = "LayerNorm"       # LayerNorm | RMSNorm
    layernorm_epsilon: float = 1e-5
    # relu2 | swiglu | gelu_erf (Megatron-LM's default GeLU) | gelu_tanh (--openai-gelu). The dataclass default
    # stays relu2 (what the model-level tests were written against); the flags' default is Megatron's gelu_erf.
    activation: str = "relu2"
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False             # biases on the Q/K/V projections only (Qwen2; implied by add_bias_linear)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    sequence_parallel: bool = False
    attention_backend: str | None = None   # None: the best available (see core.transformer.attention)
    attention_zreg_coeff: float = 0.0
    # Attention Z-Reg's per-micro-batch scale: the gradient injected in each micro-batch's backward is
    # attention_zreg_coeff * attention_zreg_scale (1 / micro-batches per step, so a step adds w once).
    attention_zreg_scale: float = 1.0
    output_zreg_coeff: float = 0.0
    window_size: int | None = None
    # per-layer attention patterns (core.transformer.layer_pattern): Megatron's int or 0/1 list, and ours
    window_attn_skip_freq: int | list[int] | None = None
    # multi-latent attention (core.transformer.mla; Megatron-LM's flags and defaults)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rotary_scaling_factor: float = 1.0
    mscale_all_dim: float = 0.0
    kv_share_pattern: int | list[int] | None = None  # K/V source of each layer (int N: groups of N); list after init
    qat: QATConfig = field(default_factory=QATConfig)  # quantization-aware training (fmt "none": off)
    moe: MoEConfig | None = None           # Mixture of Experts in the MLP slot (None: dense)
    mup: MupConfig = field(default_factory=MupConfig)  # Maximal Update Parameterization (core.mup; off by default)
    # Megatron's uneven pipeline split (core.pipeline_parallel.layer_split); None / False: layers split evenly
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(f"hidden-size {self.hidden_size} is not divisible by num-attention-heads "
                                 f"{self.num_attention_heads}; set --kv-channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num-attention-heads {self.num_attention_heads} is not divisible by "
                             f"num-query-groups {self.num_query_groups}")
        if isinstance(self.moe, dict):
            self.moe = MoEConfig.from_dict(self.moe)
        self.kv_share_pattern = validate_patterns(self.num_layers, self.window_size, self.window_attn_skip_freq,
                                                  self.kv_share_pattern)
        if self.multi_latent_attention and (self.kv_share_pattern or self.position_embedding_type != "rope"):
            raise ValueError("--multi-latent-attention needs --position-embedding-type rope and no --kv-share-pattern")
        if self.multi_latent_attention and (self.rotary_interleaved or self.attention_output_gate):
            raise ValueError("--multi-latent-attention with --rotary-interleaved or --attention-output-gate is not "
                             "implemented here (they apply to standard self-attention)")
        if isinstance(self.qat, dict):  # the settings dict of checkpoints saved before QATConfig
            self.qat = QATConfig.from_dict(self.qat)
        if isinstance(self.mup, dict):
            self.mup = MupConfig.from_dict(self.mup)
        if self.mup.enabled and (self.moe is not None or self.multi_latent_attention):
            raise ValueError("--use-mup with MoE or --multi-latent-attention is not implemented here (MuP applies to "
                             "dense GPT layers with standard self-attention)")
        if self.activation == "gelu":
            raise ValueError("activation 'gelu' is ambiguous: 'gelu_erf' (Megatron-LM's GeLU) or 'gelu_tanh' "
                             "(--openai-gelu)")
        choices = {"position_embedding_type": ("rope", "learned_absolute", "none"),
                   "normalization": ("LayerNorm", "RMSNorm"), "activation": ACTIVATIONS,
                   "recompute_granularity": (None, "full", "selective"),
                   "recompute_method": (None, "uniform", "block")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    # Fields that define the weights' shapes and meaning: a checkpoint must agree on these.
    ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "ffn_hidden_size",
                           "num_query_groups", "kv_channels", "position_embedding_type", "normalization",
                           "activation", "untie_embeddings_and_output_weights", "add_bias_linear",
                           "max_position_embeddings", "qk_layernorm", "apply_layernorm_1p", "rotary_percent",
                           "add_qkv_bias", "rope_scaling", "rope_scaling_factor", "rotary_interleaved",
                           "attention_output_gate", "kv_share_pattern",
                           "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                           "qk_pos_emb_head_dim", "v_head_dim", "moe_architecture", "mup")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def pipeline_split(self) -> PipelineSplit:
        """Which layers each pipeline stage holds (the four split fields)."""
        return PipelineSplit(self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage,
                             self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split)

    @property
    def moe_architecture(self) -> dict | None:
        """The MoE fields a checkpoint must agree on (None: dense); the experts' layout over ranks may differ."""
        return None if self.moe is None else self.moe.architecture(self.num_layers)

    @property
    def qkv_bias(self) -> bool:
        """Whether the Q/K/V projections have biases (Megatron-LM: --add-qkv-bias, or every linear's bias)."""
        return self.add_bias_linear or self.add_qkv_bias

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """A config from its saved dict; names of earlier versions are read as they were meant."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        if "activation" in d:
            d["activation"] = LEGACY_ACTIVATIONS.get(d["activation"], d["activation"])
        return cls(**d)

    def architecture_diff(self, other: GPTConfig) -> list[str]:
        """Names and values of the architecture fields where the two configs differ."""
        return [f"{k}: {getattr(other, k)!r} (checkpoint) vs {getattr(self, k)!r} (this run)"
                for k in self.ARCHITECTURE_FIELDS if getattr(self, k) != getattr(other, k)]
