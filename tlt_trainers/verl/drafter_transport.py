"""The drafter-update transport between veRL's ``tlt`` rollout replicas: Ray actor calls from the driver."""

from __future__ import annotations

import ray

from ..online import DrafterPayload, DrafterTransport


class RayDrafterTransport(DrafterTransport):
    """Drafters travel from each :class:`~.server.TLTRolloutServer` to the driver (``drafter_state``) and back
    (``load_drafter_state``); the optimizer state stays with each replica. Blocking calls: the manager runs the
    update cycle in a thread, off its event loop."""

    def __init__(self, servers: list):
        self.servers = servers

    def collect(self) -> list[DrafterPayload | None]:
        return ray.get([server.drafter_state.remote() for server in self.servers])

    def load_everywhere(self, payload: DrafterPayload) -> None:
        ray.get([server.load_drafter_state.remote(payload) for server in self.servers])
