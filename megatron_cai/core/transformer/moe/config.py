"""The Mixture-of-Experts configuration: Megatron-LM's MoE flags, its names and defaults, as one dataclass.

``GPTConfig.moe`` holds one (None: a dense model). Each field is the flag of the same name with ``--moe-``
(or ``--num-experts`` / ``--expert-*``) in front; ``validate`` raises one ``ValueError`` naming every bad flag.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")


@dataclass
class MoEConfig:
    num_experts: int = 8
    ffn_hidden_size: int | None = None          # --moe-ffn-hidden-size (default: the model's ffn_hidden_size)
    layer_freq: int | list[int] = 1             # --moe-layer-freq: every N-th layer, or a 0/1 pattern per layer
    router_topk: int = 2
    router_score_function: str = "softmax"
    router_pre_softmax: bool = False
    router_topk_scaling_factor: float | None = None
    router_num_groups: int | None = None        # group-limited (device-limited) routing
    router_group_topk: int | None = None
    router_dtype: str | None = None             # None: the input's dtype; fp32 | fp64
    input_jitter_eps: float | None = None
    router_load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    expert_capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    pad_expert_input_to_capacity: bool = False
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    shared_expert_overlap: bool = False         # accepted: the shared experts run in the same stream here
    grouped_gemm: bool = False
    permute_fusion: bool = False                # accepted: the permutation is index_select / scatter_add here
    token_dispatcher_type: str = "allgather"
    per_layer_logging: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the tensor-model-parallel size
    extra: dict = field(default_factory=dict)   # unused; keeps saved configs loadable when fields are added

    def validate(self, num_layers: int) -> None:
        problems = []
        if self.num_experts < 1:
            problems.append(f"--num-experts {self.num_experts} must be >= 1")
        if not 1 <= self.router_topk <= self.num_experts:
            problems.append(f"--moe-router-topk {self.router_topk} must be in 1..--num-experts {self.num_experts}")
        choices = {"router_load_balancing_type": LOAD_BALANCING_TYPES, "router_score_function": SCORE_FUNCTIONS,
                   "token_dispatcher_type": DISPATCHERS, "token_drop_policy": DROP_POLICIES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                problems.append(f"--moe-{name.replace('_', '-')} {getattr(self, name)}: one of {', '.join(allowed)}")
        if self.router_dtype not in (None, "fp32", "fp64"):
            problems.append(f"--moe-router-dtype {self.router_dtype}: fp32 or fp64")
        if self.router_load_balancing_type == "sinkhorn" and self.aux_loss_coeff:
            problems.append("--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff")
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            problems.append("--moe-router-num-groups and --moe-router-group-topk go together")
        elif self.router_num_groups is not None:
            if self.num_experts % self.router_num_groups:
                problems.append(f"--num-experts {self.num_experts} is not divisible by --moe-router-num-groups "
                                f"{self.router_num_groups}")
            if self.router_topk % self.router_group_topk or self.router_group_topk > self.router_num_groups:
                problems.append(f"--moe-router-group-topk {self.router_group_topk} must divide --moe-router-topk "
                                f"{self.router_topk} and be at most --moe-router-num-groups {self.router_num_groups}")
        if self.router_enable_expert_bias and self.router_score_function != "sigmoid":
            problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        if (self.router_topk == 1 and self.router_score_function == "softmax" and not self.router_pre_softmax
                and self.router_load_balancing_type != "sinkhorn"):
            problems.append("--moe-router-topk 1 with softmax needs --moe-router-pre-softmax (a softmax over one "
                            "expert has no gradient)")
        if self.pad_expert_input_to_capacity and self.expert_capacity_factor is None:
            problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if isinstance(self.layer_freq, list) and len(self.layer_freq) != num_layers:
            problems.append(f"--moe-layer-freq lists {len(self.layer_freq)} layers, the model has {num_layers}")
        if isinstance(self.layer_freq, int) and self.layer_freq < 1:
            problems.append(f"--moe-layer-freq {self.layer_freq} must be >= 1")
        if self.num_experts % self.expert_model_parallel_size:
            problems.append(f"--num-experts {self.num_experts} is not divisible by --expert-model-parallel-size "
                            f"{self.expert_model_parallel_size}")
        if problems:
            raise ValueError("; ".join(problems))

    # Fields that define the experts' weights and what the layer computes: a checkpoint must agree on these
    # (not on how the experts are laid out over ranks).
    ARCHITECTURE_FIELDS = ("num_experts", "ffn_hidden_size", "router_topk", "router_score_function",
                           "router_pre_softmax", "router_topk_scaling_factor", "router_num_groups",
                           "router_group_topk", "router_enable_expert_bias", "shared_expert_intermediate_size",
                           "shared_expert_gate")

    def architecture(self, num_layers: int) -> dict:
        """The architecture fields, and which layers are MoE layers (``--moe-layer-freq`` as a 0/1 list)."""
        return {**{k: getattr(self, k) for k in self.ARCHITECTURE_FIELDS},
                "moe_layers": [int(self.is_moe_layer(i)) for i in range(1, num_layers + 1)]}

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 1-based ``layer_number`` holds an MoE layer (Megatron's --moe-layer-freq rule)."""
        if isinstance(self.layer_freq, int):
            return (layer_number - 1) % self.layer_freq == 0
        return bool(self.layer_freq[layer_number - 1])

    def aux_loss_enabled(self) -> bool:
        return self.router_load_balancing_type in ("aux_loss", "seq_aux_loss", "global_aux_loss") and \
            self.aux_loss_coeff > 0

    @classmethod
    def from_dict(cls, d: dict) -> MoEConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
