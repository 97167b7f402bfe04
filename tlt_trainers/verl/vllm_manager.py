"""The checkpoint manager of veRL's vLLM rollout with TLT: after every policy sync, the drafter follows.

veRL builds it from ``actor_rollout_ref.rollout.checkpoint_manager_class`` (``configure_vllm_rollout`` sets it) and
calls ``update_weights`` at the start of ``fit`` and after every actor update. This one runs veRL's sync, then, where
vLLM serves the drafter, fetches the drafter's weights from actor rank 0 (one safetensors blob of vLLM's tensors:
vLLM's msgpack RPC does not rebuild tensors inside untyped arguments) and has every worker of every replica reload
them (``tlt_reload_drafter`` of :class:`~.vllm_worker.TLTColocateExtension`, vLLM's layer-wise reload: one collective
RPC per replica, through its first server, whose engine reaches every worker; the servers of other nodes have no
engine), then resets the replicas' prefix caches, whose drafter KV entries the old weights computed. The first push
replaces the dummy weights vLLM starts with. Later ones are skipped while the drafter is unchanged, unless the
rollout's sleep mode is on (:attr:`weights_survive_sleep` False): a sleep at level 2 discards the drafter's weights
with the policy's.

While vLLM speculates, :meth:`spec_decode_counters` reads its ``vllm:spec_decode_*`` counters from every replica's
``/metrics`` (veRL's vLLM server runs vLLM's HTTP app in the process that keeps the stats).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request

from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from ..vllm.metrics import SpecDecodeCounters, parse_spec_decode_metrics

logger = logging.getLogger(__name__)


class TLTCheckpointEngineManager(CheckpointEngineManager):
    """veRL's CheckpointEngineManager plus the drafter push; counts in :attr:`pushes`, timings in the last push."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushes = 0
        self.last_push_seconds = 0.0
        self.last_sync_end: float | None = None  # the rollout starts after a sync: the trainer times it from here
        self.pushed_version: int | None = None  # the drafter version vLLM holds (None: dummy weights)
        # set by TLTPPOTrainer: whether vLLM serves the drafter, the rollout's dtype, and whether vLLM keeps its
        # weights between rollouts (no sleep mode); until then, push at every sync
        self.speculating = False
        self.dtype: str | None = None
        self.weights_survive_sleep = False
        self._counters_seen: dict[str, SpecDecodeCounters] = {}  # per replica address: its last reading
        self._metrics_failed: set[str] = set()

    @property
    def engine_servers(self) -> list:
        """One server per replica, the one on the replica's first node (``server_handle``): the one with an engine,
        whose collective RPC reaches every worker of the replica (veRL's own calls skip the other nodes' servers)."""
        return [replica.servers[0] if replica.server_handle is None else replica.server_handle
                for replica in self.replicas]

    @auto_await
    async def update_weights(self, global_steps: int | None = None):
        metrics = await CheckpointEngineManager.update_weights.__wrapped__(self, global_steps)
        await self.push_drafter()
        self.last_sync_end = time.perf_counter()
        return metrics

    async def push_drafter(self) -> bool:
        """Load actor rank 0's drafter into every vLLM worker that speculates with it; False when none does or vLLM
        already holds this version of it (and keeps it: :attr:`weights_survive_sleep`)."""
        if not self.speculating:
            return False
        start = time.perf_counter()
        unless = self.pushed_version if self.weights_survive_sleep else None
        answers = await asyncio.to_thread(self.actor_wg.tlt_drafter_weights, self.dtype, unless)
        answer = next((a for a in answers if a is not None), None)
        if answer is None:
            return False
        version, blob = answer
        if blob is None:  # unchanged since the last push, and vLLM kept it
            return False
        await asyncio.gather(*[server.collective_rpc.remote("tlt_reload_drafter", args=(blob,))
                               for server in self.engine_servers])
        await asyncio.gather(*[replica.clear_kv_cache() for replica in self.replicas])
        self.pushes += 1
        self.pushed_version = version
        self.last_push_seconds = time.perf_counter() - start
        return True

    def spec_decode_counters(self) -> SpecDecodeCounters | None:
        """vLLM's speculative-decoding counts since the last call, summed over the replicas (None when none reports
        them: not speculating, or /metrics unreachable). Each replica's counts are taken against that replica's own
        last reading, so a replica whose /metrics cannot be read this time adds nothing now and its counts arrive
        with its next reading (never a negative delta); the first failure per address is logged."""
        delta, seen = SpecDecodeCounters(), False
        for replica in self.replicas:
            address = replica.server_address
            if not address:
                continue
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                    counters = parse_spec_decode_metrics(response.read().decode())
            except OSError as err:
                if address not in self._metrics_failed:
                    self._metrics_failed.add(address)
                    logger.warning("TLT: cannot read vLLM's /metrics at %s (%s); this replica's speculation counts "
                                   "are left out until a read succeeds, then counted in full. Further failures at "
                                   "this address are logged at debug level.", address, err)
                else:
                    logger.debug("TLT: cannot read vLLM's /metrics at %s: %s", address, err)
                continue
            if counters is not None:
                previous = self._counters_seen.get(address, SpecDecodeCounters())
                if counters.num_drafts < previous.num_drafts:  # the server restarted: its counts start again
                    previous = SpecDecodeCounters()
                delta = delta + (counters - previous)
                self._counters_seen[address] = counters
                seen = True
        return delta if seen else None

