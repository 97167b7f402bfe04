"""The policy seen as parts the engine and the drafter share: body and head (``TargetModel``), per-row KV caches
and attention masks, and the CPU decode paths. A leaf layer: it imports neither ``drafter`` nor ``rollout``.
"""
