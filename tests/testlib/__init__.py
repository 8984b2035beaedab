"""Libraries shared by the tests: independent references (attention, data, quantization, Squinch oracle,
trees), the gloo harness, short in-process trainings, distillation fixtures, Megatron's launch scripts."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
TOOLS = os.path.join(ROOT, "tools")
