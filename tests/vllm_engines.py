"""Shutting a test's vLLM engine down now, not whenever the garbage collector reaches it.

An engine in the test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) tears down vLLM's process groups when it shuts
down. One kept alive by a failed test's traceback (its frame holds the engine or the fixture's namespace) shuts down
later, under the next test's engine, which then fails with "pipeline model parallel group is not initialized" (seen
in CI: one real failure became two). vLLM's clients shut down once, so the later collection does nothing.
"""

from __future__ import annotations


def shut_down(llm) -> None:
    """Shut ``llm`` (a ``vllm.LLM``) down now; idempotent."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()
