"""Mixture of Experts (Megatron's layout): router, token dispatcher, experts and shared experts, one file each."""
