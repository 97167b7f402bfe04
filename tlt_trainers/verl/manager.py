"""TLTAgentLoopManager: veRL's AgentLoopManager plus TLT's use of the rollout's idle time.

A rollout step splits the batch over the agent-loop workers and waits for all of them. While it waits
(``ray.wait`` over the workers' futures, waking every ``POLL_SECONDS``), every ``tlt`` replica that has
served its requests and has nothing queued trains its drafter; a new request stops it within one
micro-step. When all workers are done the replicas give back what their engines keep between batches (unless
``tlt.keep_engine_memory``), and the manager stops the training and hands the rest to the update cycle
of :mod:`tlt_trainers.online`: train after the rollout instead if no replica trained in idle time
(``post_rollout``: a budget proportional to the rollout), average the drafters that trained (weighted by
their steps, :data:`~tlt_trainers.online.MergeRule.STEP_WEIGHTED_AVERAGE`) and load the result into every
replica, so the next rollout drafts with it. The step's ``tlt/*`` metrics wait in :attr:`last_metrics` for
the trainer to log.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import ray
from verl.experimental.agent_loop import AgentLoopManager
from verl.protocol import DataProto
from verl.utils.ray_utils import auto_await
from verl.utils.skip import SkipManager

from .. import metric_names as metric
from ..online import MergeRule, SliceReport, after_rollout_budget, finish_update, update_metrics, waited_seconds
from .drafter_transport import RayDrafterTransport
from .replica import server_name
from .settings import TLTSection

POLL_SECONDS = 0.25


def find_servers() -> list:
    """The tlt servers of this Ray job, by replica rank (they are named actors, see ``replica.server_name``)."""
    names = sorted((a["name"] if isinstance(a, dict) else a) for a in ray.util.list_named_actors())
    ranks = sorted(int(n.rsplit("_", 1)[1]) for n in names if n.startswith(server_name(0)[:-1]) and
                   n.rsplit("_", 1)[1].isdigit())
    return [ray.get_actor(server_name(rank)) for rank in ranks]


class TLTAgentLoopManager(AgentLoopManager):
    """Set as ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` by our config."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.tlt = TLTSection.from_mapping(config.get("tlt"))
        self._servers: list | None = None
        self.last_metrics: dict[str, float] = {}
        self.drafter_updates = 0

    @property
    def servers(self) -> list:
        if self._servers is None:
            self._servers = find_servers()
            if not self._servers:
                raise RuntimeError("TLTAgentLoopManager found no tlt rollout server: set "
                                   "actor_rollout_ref.rollout.name=tlt (the tlt_ppo_trainer config does).")
        return self._servers

    @auto_await
    @SkipManager.annotate(role="rollout")
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """AgentLoopManager's rollout, with idle replicas training their drafters while it runs."""
        if "priority" not in prompts.non_tensor_batch:
            prompts.non_tensor_batch["priority"] = np.arange(len(prompts), dtype=np.int64)
        validate = bool(prompts.meta_info.get("validate", False))
        servers = self.servers
        start = time.perf_counter()
        chunks = prompts.chunk(len(self.agent_loop_workers))
        pending = [worker.generate_sequences.remote(chunk) for worker, chunk in zip(self.agent_loop_workers, chunks)]
        order = list(pending)
        training: dict[int, ray.ObjectRef] = {}
        finished_workers: list[float] = []
        while pending:
            done, pending = await asyncio.to_thread(ray.wait, pending, num_returns=1, timeout=POLL_SECONDS)
            finished_workers += [time.perf_counter() - start] * len(done)
            if validate or not pending or self.tlt.drafter_max_idle_seconds <= 0 or self.tlt.speculation == "never":
                continue
            idle = await asyncio.gather(*[s.is_idle.remote() for s in servers])
            for rank, (server, is_idle) in enumerate(zip(servers, idle)):
                if is_idle and rank not in training:  # served its share while others still generate
                    training[rank] = server.train_drafter.remote(self.tlt.drafter_max_idle_seconds)
        rollout_seconds = time.perf_counter() - start
        outputs = await asyncio.gather(*order)

        output = DataProto.concat(outputs)
        metrics = [o.meta_info.pop("metrics") for o in outputs]
        timing = self._performance_metrics(metrics, output)
        output.meta_info = {"timing": timing, **outputs[0].meta_info}

        stats = await asyncio.gather(*[s.rollout_stats.remote() for s in servers])
        if validate:
            return output
        self.last_metrics = await self._update_drafters(servers, training, stats, rollout_seconds, finished_workers)
        return output

    async def _update_drafters(self, servers, training, stats, rollout_seconds, finished_workers) -> dict:
        """Stop the idle slices, give back the engines' memory, then the update cycle
        (:func:`~tlt_trainers.online.finish_update`: the fallback on every replica when none trained in idle time, the
        merge by ``step_weighted_average``), in a thread: the transport's Ray calls block."""
        await asyncio.gather(*[s.stop_training.remote() for s in servers])
        idle_results = {rank: await ref for rank, ref in training.items()}
        # The rollout is over: the servers give back what their engines keep between batches (unless
        # tlt.keep_engine_memory) before the drafter update and the training step veRL runs next (whose replica sleep
        # would give it back too). After the idle slices: a server releases under the lock they hold.
        await asyncio.gather(*[s.release_engine_memory.remote() for s in servers])

        def report(result: dict, rank: int) -> SliceReport:
            return SliceReport.from_metrics(result, total_steps=stats[rank].get("drafter_total_steps", 0))

        idle = [report(idle_results.get(rank, {}), rank) for rank in range(len(servers))]
        budget = after_rollout_budget(self.tlt, rollout_seconds) if self.tlt.speculation != "never" else None
        fallback = None
        if budget is not None:
            def fallback() -> list[SliceReport]:
                results = ray.get([s.train_drafter.remote(budget, at_least_one=True) for s in servers])
                return [report(result, rank) for rank, result in enumerate(results)]

        outcome = await asyncio.to_thread(finish_update, idle, RayDrafterTransport(servers),
                                          MergeRule.STEP_WEIGHTED_AVERAGE, fallback)
        if outcome.merged is not None:
            self.drafter_updates += 1

        def total(name):
            return float(sum(s.get(name, 0) for s in stats))

        rows = total("row_forwards")
        return {
            metric.ACCEPTANCE_LENGTH: total("emitted_tokens") / rows if rows else float("nan"),
            metric.SPECULATIVE_STEP_FRACTION: total("speculative_steps") / max(total("decode_steps"), 1.0),
            metric.HISTORY_PROPOSED_TOKENS: total("history_proposed"),
            metric.ROLLOUT_SECONDS: rollout_seconds,
            # worker-seconds spent waiting for the slowest agent-loop worker: the time TLT trains in
            metric.IDLE_SECONDS: waited_seconds(finished_workers),
            metric.HISTORY_BYTES: total("history_bytes"),
            **update_metrics(outcome),
        }

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.last_metrics = self.last_metrics, {}
        return metrics
