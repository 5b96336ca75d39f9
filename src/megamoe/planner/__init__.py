"""Planning the megakernel: its knobs, the one check that they suit a layer, and the planner's rules."""

from megamoe.planner.kernel_config import KernelConfig, LayerShape, check_kernel_config
from megamoe.planner.rules import Plan, format_plan, plan

__all__ = ["KernelConfig", "LayerShape", "Plan", "check_kernel_config", "format_plan", "plan"]
