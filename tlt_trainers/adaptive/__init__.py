"""When and how much to speculate: one decider shared by TLT's own engine and the vLLM scheduler.

Pure Python, no torch: :mod:`tlt_trainers.rollout.selector` and :mod:`tlt_trainers.vllm.schedule` price their arms
(strategies, draft lengths) and hand the prices to :class:`~.decider.SpeculationDecider`, which owns the rules.
"""

from .decider import Decision, DecisionRules, Estimate, SpeculationDecider

__all__ = ["Decision", "DecisionRules", "Estimate", "SpeculationDecider"]
